//! The backstop against a frontend that shrinks its memory under the device.
//!
//! Guest memory is a file (a memfd, usually) that the frontend maps and passes to us. The
//! device checks at map time that every region lies inside its file (`memory.rs`), but a
//! frontend can `ftruncate` the file afterwards: the next access to a page past the new
//! end raises SIGBUS, whose default action kills the daemon. QEMU's
//! `memory-backend-memfd` seals its memfds against shrinking (`F_SEAL_SHRINK`), so a well
//! behaved frontend never does this; a hostile or buggy one must not be able to take the
//! daemon (and every other disk it serves) down with it.
//!
//! A SIGBUS at an address inside a registered guest mapping is answered by mapping a
//! fresh anonymous page over the faulting page (`MAP_FIXED`): the faulting access is
//! retried and sees zeroes, and the owner's poison flag is raised. The session that owns
//! the mapping sees the flag and ends the connection. A SIGBUS anywhere else (a real bug)
//! gets the default action. Accesses made by the kernel on our behalf (io_uring reading a
//! truncated page) do not raise SIGBUS: they fail with EFAULT and the request gets IOERR.
//!
//! The patch covers the mapping's page: the system page for a memfd or tmpfs file, the
//! huge page (2 MiB or 1 GiB, from `fstatfs`) for a hugetlbfs file, since a hugetlbfs
//! mapping can only be replaced in whole huge pages.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Registered mappings at most (QEMU uses a handful; 509 memory slots per session).
const SLOTS: usize = 2048;

struct Entry {
    start: AtomicUsize,
    end: AtomicUsize,
    /// The mapping's page size (a power of two).
    page: AtomicUsize,
    flag: AtomicPtr<AtomicBool>,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Entry = Entry {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    page: AtomicUsize::new(4096),
    flag: AtomicPtr::new(std::ptr::null_mut()),
};

/// tmpfs, hugetlbfs and ramfs: the file systems guest memory may live on.
pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;
pub(crate) const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
pub(crate) const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// The system's page size.
pub(crate) fn system_page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// The file system type and the page size of mappings of `fd`: the huge page size for a
/// hugetlbfs file, the system page otherwise.
pub(crate) fn file_pages(fd: std::os::fd::RawFd) -> std::io::Result<(i64, usize)> {
    // SAFETY: fstatfs on a descriptor the caller owns, into a zeroed buffer.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let kind = st.f_type as i64;
    let page = if kind == HUGETLBFS_MAGIC {
        usize::try_from(st.f_bsize)
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(2 << 20)
    } else {
        system_page()
    };
    Ok((kind, page))
}

static TABLE: [Entry; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// A registered mapping; unregistered on drop.
#[derive(Debug)]
pub(crate) struct Registration {
    slot: usize,
    // Keeps the flag the handler may write alive while registered.
    _flag: Arc<AtomicBool>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let e = &TABLE[self.slot];
        e.end.store(0, Ordering::SeqCst);
        e.start.store(0, Ordering::SeqCst);
        e.flag.store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

/// Register `len` bytes at `start`, mapped in pages of `page` bytes, as guest memory whose
/// SIGBUS raises `flag` instead of killing the process. None when the table is full (then
/// a SIGBUS there kills).
pub(crate) fn register(
    start: *mut u8,
    len: usize,
    page: usize,
    flag: &Arc<AtomicBool>,
) -> Option<Registration> {
    install();
    let start = start as usize;
    let end = start.checked_add(len)?;
    for (slot, e) in TABLE.iter().enumerate() {
        if e.flag
            .compare_exchange(
                std::ptr::null_mut(),
                Arc::as_ptr(flag).cast_mut(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        {
            e.page.store(page.max(4096), Ordering::SeqCst);
            e.start.store(start, Ordering::SeqCst);
            e.end.store(end, Ordering::SeqCst);
            return Some(Registration {
                slot,
                _flag: flag.clone(),
            });
        }
    }
    log::warn!("SIGBUS guard table full ({SLOTS} mappings): a truncated guest memory file there would kill the daemon");
    None
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler
        // has the SA_SIGINFO signature and only uses async-signal-safe operations
        // (atomics and mmap).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                log::warn!(
                    "cannot install the SIGBUS guard: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    });
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; si_addr is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for e in TABLE.iter() {
        let flag = e.flag.load(Ordering::SeqCst);
        if flag.is_null() {
            continue;
        }
        let (start, end) = (e.start.load(Ordering::SeqCst), e.end.load(Ordering::SeqCst));
        if addr < start || addr >= end {
            continue;
        }
        let size = e.page.load(Ordering::SeqCst);
        let page = addr & !(size - 1);
        // SAFETY: `page` lies inside a guest mapping this process made (registered above
        // and not yet unregistered; mappings are aligned to their page size); replacing
        // one page of it with anonymous memory only changes what that shared view shows,
        // and no Rust reference into guest memory exists (all guest accesses are
        // raw-pointer copies).
        let r = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            // SAFETY: the Registration holding this slot keeps the flag's Arc alive.
            unsafe { (*flag).store(true, Ordering::SeqCst) };
            return;
        }
        break;
    }
    // Not guest memory (or it could not be patched): die as SIGBUS would have.
    // SAFETY: restoring the default disposition; the faulting access is retried on return
    // and raises SIGBUS again, now fatal.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memfd mapped past its end, touched: the guard patches the page and raises the
    /// flag instead of the process dying.
    #[test]
    fn truncated_mapping_is_patched_and_flagged() {
        // SAFETY: plain syscalls on a memfd this test owns; the mapping is unmapped below.
        unsafe {
            let fd = libc::memfd_create(c"sigbus-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, 8192), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            ) as *mut u8;
            assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
            let flag = Arc::new(AtomicBool::new(false));
            let reg = register(p, 8192, 4096, &flag).unwrap();
            p.write_volatile(7);
            assert_eq!(libc::ftruncate(fd, 4096), 0);
            assert_eq!(p.read_volatile(), 7, "the first page is still backed");
            assert!(!flag.load(Ordering::SeqCst));
            assert_eq!(p.add(4096).read_volatile(), 0, "patched page reads zero");
            assert!(flag.load(Ordering::SeqCst));
            drop(reg);
            libc::munmap(p.cast(), 8192);
            libc::close(fd);
        }
    }

    /// A mapping in huge pages is patched a whole huge page at a time (a hugetlbfs
    /// mapping cannot be split below its page size). Shown on a memfd mapped at a 2 MiB
    /// boundary and registered with a 2 MiB page.
    #[test]
    fn a_huge_page_mapping_is_patched_in_huge_pages() {
        const HUGE: usize = 2 << 20;
        // SAFETY: plain syscalls on a memfd and mappings this test owns, unmapped below.
        unsafe {
            let fd = libc::memfd_create(c"sigbus-huge".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, (2 * HUGE) as libc::off_t), 0);
            // Reserve 3 huge pages of address space, then map the file at the first 2 MiB
            // boundary inside it.
            let area = libc::mmap(
                std::ptr::null_mut(),
                3 * HUGE,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            ) as usize;
            assert_ne!(area as *mut libc::c_void, libc::MAP_FAILED);
            let at = (area + HUGE - 1) & !(HUGE - 1);
            let p = libc::mmap(
                at as *mut libc::c_void,
                2 * HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            ) as *mut u8;
            assert_eq!(p as usize, at);
            let flag = Arc::new(AtomicBool::new(false));
            let reg = register(p, 2 * HUGE, HUGE, &flag).unwrap();
            p.add(HUGE + 4096).write_volatile(9);
            assert_eq!(libc::ftruncate(fd, HUGE as libc::off_t), 0);
            assert_eq!(p.add(HUGE + 8192).read_volatile(), 0, "patched");
            assert!(flag.load(Ordering::SeqCst));
            // One fault replaced the whole second huge page: one anonymous mapping covers
            // it exactly (a 4 KiB patch, which hugetlbfs would refuse, would cover 4 KiB).
            let (lo, hi) = (at + HUGE, at + 2 * HUGE);
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let whole = format!("{lo:x}-{hi:x} ");
            assert!(
                maps.lines().any(|l| l.starts_with(&whole)),
                "no mapping {whole}in\n{maps}"
            );
            assert_eq!(p.add(HUGE + 4096).read_volatile(), 0);
            assert_eq!(p.add(2 * HUGE - 1).read_volatile(), 0);
            drop(reg);
            libc::munmap(area as *mut libc::c_void, 3 * HUGE);
            libc::close(fd);
        }
    }

    #[test]
    fn hugetlbfs_files_map_in_huge_pages() {
        // SAFETY: memfd_create with a static name; closed below. Creating a hugetlb memfd
        // needs no reserved huge pages (mapping it would).
        let fd = unsafe {
            libc::memfd_create(
                c"sigbus-hugetlb".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_HUGETLB,
            )
        };
        if fd >= 0 {
            let (kind, page) = file_pages(fd).unwrap();
            assert_eq!(kind, HUGETLBFS_MAGIC);
            assert!(page >= 2 << 20, "{page}");
            // SAFETY: our own fd.
            unsafe { libc::close(fd) };
        } else {
            let e = std::io::Error::last_os_error();
            panic!("cannot make a hugetlbfs memfd to test with: {e} (the kernel needs CONFIG_HUGETLBFS)");
        }
        // SAFETY: as above, a plain memfd.
        let fd = unsafe { libc::memfd_create(c"sigbus-plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        assert_eq!(file_pages(fd).unwrap(), (TMPFS_MAGIC, system_page()));
        // SAFETY: our own fd.
        unsafe { libc::close(fd) };
    }
}
