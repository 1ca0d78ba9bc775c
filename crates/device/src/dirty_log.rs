//! The dirty log of live migration (vhost-user `VHOST_F_LOG_ALL` with
//! `VHOST_USER_PROTOCOL_F_LOG_SHMFD`): a bitmap in memory the frontend shares, one bit per
//! 4 KiB page of guest *physical* memory, bit `page % 8` of byte `page / 8`. While it is
//! on, every byte the device writes into guest memory — read payloads, GET_ID strings,
//! status bytes, used-ring entries, the used index, the used flags and `avail_event` —
//! marks its pages, after the write and before the guest can see the completion. The
//! frontend reads and clears the bitmap with atomic exchanges, so marks are atomic ORs of
//! one byte, as libvhost-user's are.
//!
//! The frontend passes the bitmap's fd, size and offset (SET_LOG_BASE); all three are
//! checked like any frontend input: the file must be a memfd or on tmpfs/hugetlbfs (a file
//! elsewhere could stall the workers), the offset page aligned, the region inside the
//! file, the size at most [`MAX_LOG_BYTES`]. A page past the end of the bitmap (a guest
//! address the frontend did not size the log for) is counted and not marked.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::sigbus;

/// Bytes of guest memory one bit covers (VHOST_LOG_PAGE).
pub(crate) const LOG_PAGE: u64 = 0x1000;
/// The largest bitmap taken: 1 GiB covers 32 TiB of guest physical address space.
pub(crate) const MAX_LOG_BYTES: u64 = 1 << 30;

/// A mapped dirty bitmap.
#[derive(Debug)]
pub(crate) struct DirtyLog {
    base: *mut u8,
    len: usize,
    /// Pages marked (each mark of a page counts), shared with the daemon's statistics.
    marked: Arc<AtomicU64>,
    /// Marks that fell past the end of the bitmap.
    outside: AtomicU64,
    _guard: Option<sigbus::Registration>,
    _file: File,
}

// SAFETY: the mapping is owned by the log and lives until it is dropped; it is only
// accessed through atomic byte operations, from any thread.
unsafe impl Send for DirtyLog {}
// SAFETY: as above.
unsafe impl Sync for DirtyLog {}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        // SAFETY: base/len are what mmap returned; no reference into the mapping outlives
        // the log (marks go through `&self`).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl DirtyLog {
    /// Map `size` bytes at `offset` of `file` (SET_LOG_BASE). `poison` is raised if the
    /// frontend truncates the file under us (the SIGBUS guard).
    pub(crate) fn map(
        file: File,
        size: u64,
        offset: u64,
        poison: &Arc<AtomicBool>,
        marked: Arc<AtomicU64>,
    ) -> Result<DirtyLog, String> {
        if size == 0 || size > MAX_LOG_BYTES {
            return Err(format!(
                "a log of {size} bytes: it must be between 1 and {MAX_LOG_BYTES}"
            ));
        }
        if !offset.is_multiple_of(4096) {
            return Err(format!("log offset {offset:#x} is not page aligned"));
        }
        let (fs, page) = sigbus::file_pages(file.as_raw_fd()).map_err(|e| e.to_string())?;
        if ![
            sigbus::TMPFS_MAGIC,
            sigbus::RAMFS_MAGIC,
            sigbus::HUGETLBFS_MAGIC,
        ]
        .contains(&fs)
        {
            return Err(format!(
                "the log's file is on a file system of type {fs:#x}, not a memfd, tmpfs or hugetlbfs"
            ));
        }
        let meta = file.metadata().map_err(|e| e.to_string())?;
        if !meta.file_type().is_file() {
            return Err("the log's fd is not a regular file".into());
        }
        let file_len = meta.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(format!(
                "log offset {offset:#x} + size {size:#x} reaches past the end of its file ({file_len:#x} bytes)"
            ));
        }
        let len = usize::try_from(size).map_err(|_| "the log size does not fit".to_string())?;
        let off = libc::off_t::try_from(offset).map_err(|_| "the log offset does not fit")?;
        // SAFETY: a new shared mapping of our own fd; the arguments were checked above.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap failed: {}", std::io::Error::last_os_error()));
        }
        let base = p.cast::<u8>();
        Ok(DirtyLog {
            base,
            len,
            marked,
            outside: AtomicU64::new(0),
            _guard: sigbus::register(base, len, page, poison),
            _file: file,
        })
    }

    /// Mark the pages of `len` bytes of guest memory at guest physical address `gpa`.
    pub(crate) fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        let mut n = 0;
        for page in first..=last {
            let byte = page / 8;
            if byte >= self.len as u64 {
                self.outside.fetch_add(last - page + 1, Ordering::Relaxed);
                break;
            }
            // SAFETY: byte < len: inside the mapping, which lives as long as `self`;
            // AtomicU8 has the alignment and size of u8.
            let cell = unsafe { AtomicU8::from_ptr(self.base.add(byte as usize)) };
            cell.fetch_or(1 << (page % 8), Ordering::Relaxed);
            n += 1;
        }
        self.marked.fetch_add(n, Ordering::Relaxed);
    }

    /// Pages marked so far, and marks that fell past the bitmap.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.marked.load(Ordering::Relaxed),
            self.outside.load(Ordering::Relaxed),
        )
    }

    /// The bitmap's size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether page `page` is marked (tests).
    #[cfg(test)]
    pub(crate) fn is_marked(&self, page: u64) -> bool {
        let byte = page / 8;
        if byte >= self.len as u64 {
            return false;
        }
        // SAFETY: as in `mark`.
        let cell = unsafe { AtomicU8::from_ptr(self.base.add(byte as usize)) };
        cell.load(Ordering::Relaxed) & (1 << (page % 8)) != 0
    }

    /// Every marked page, in order (tests).
    #[cfg(test)]
    pub(crate) fn marked_pages(&self) -> Vec<u64> {
        (0..self.len as u64 * 8)
            .filter(|&p| self.is_marked(p))
            .collect()
    }
}

/// A memfd of `len` bytes for a log (tests, and the fuzzing and hostile harnesses).
#[cfg(test)]
pub(crate) fn test_log(len: u64) -> DirtyLog {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create with a static name; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"vblk-log-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: just created, owned by nothing else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    DirtyLog::map(f, len, 0, &Arc::new(AtomicBool::new(false)), Arc::default()).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_bits_of_guest_physical_addresses() {
        let log = test_log(4096);
        log.mark(0, 1);
        log.mark(0x1fff, 2); // pages 1 and 2
        log.mark(0x10_0000, 0x3000); // pages 256, 257, 258
        log.mark(0x5000, 0); // nothing
        assert_eq!(log.marked_pages(), vec![0, 1, 2, 256, 257, 258]);
        assert_eq!(log.counts(), (6, 0));
        // Past the end of a 4 KiB bitmap (which covers 128 MiB).
        log.mark(128 << 20, 8192);
        log.mark(u64::MAX - 10, 100);
        assert_eq!(log.counts().1, 3);
        assert_eq!(log.marked_pages().len(), 6);
    }

    #[test]
    fn a_log_from_the_frontend_is_checked() {
        use std::os::fd::FromRawFd;
        let poison = Arc::new(AtomicBool::new(false));
        let memfd = |len: u64| {
            // SAFETY: as in test_log.
            let fd = unsafe { libc::memfd_create(c"log".as_ptr(), libc::MFD_CLOEXEC) };
            // SAFETY: just created, owned by nothing else.
            let f = unsafe { File::from_raw_fd(fd) };
            f.set_len(len).unwrap();
            f
        };
        let err = |r: Result<DirtyLog, String>| r.unwrap_err();
        assert!(
            err(DirtyLog::map(memfd(4096), 8192, 0, &poison, Arc::default()))
                .contains("past the end")
        );
        assert!(err(DirtyLog::map(
            memfd(8192),
            4096,
            100,
            &poison,
            Arc::default()
        ))
        .contains("aligned"));
        assert!(err(DirtyLog::map(memfd(4096), 0, 0, &poison, Arc::default())).contains("between"));
        assert!(err(DirtyLog::map(
            memfd(4096),
            MAX_LOG_BYTES + 1,
            0,
            &poison,
            Arc::default()
        ))
        .contains("between"));
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let disk = tempfile::tempfile_in(target).unwrap();
        disk.set_len(4096).unwrap();
        assert!(err(DirtyLog::map(disk, 4096, 0, &poison, Arc::default())).contains("file system"));
        let (r, _w) = std::io::pipe().unwrap();
        let pipe: File = std::os::fd::OwnedFd::from(r).into();
        assert!(DirtyLog::map(pipe, 4096, 0, &poison, Arc::default()).is_err());
        assert!(DirtyLog::map(memfd(8192), 4096, 4096, &poison, Arc::default()).is_ok());
    }
}
