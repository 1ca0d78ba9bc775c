//! Inflight I/O tracking (vhost-user protocol feature INFLIGHT_SHMFD, split queues): a
//! shared memory region, kept by the frontend across backend restarts, that records which
//! descriptor heads the device has taken and not yet answered, so that a restarted device
//! resubmits exactly those — in the order it took them — even when it had completed
//! requests out of order.
//!
//! Layout (vhost-user.rst, "Inflight I/O tracking"), one queue region after another, each
//! [`queue_region_size`] bytes:
//!
//! ```text
//! u64 features; u16 version; u16 desc_num; u16 last_batch_head; u16 used_idx;
//! desc[desc_num]: { u8 inflight; u8 padding[5]; u16 next; u64 counter; }
//! ```
//!
//! The device marks a head when it takes it (counter, then inflight = 1), and when it
//! publishes a batch of used entries it links them (`next`, `last_batch_head`), stores the
//! used index, then clears their inflight flags and stores `used_idx`. After a crash, a
//! `used_idx` behind the ring's used index means the crash came between those steps: the
//! last batch is cleared first. The frontend may write the region at any time: everything
//! read from it is checked (heads, the batch list, how many are in flight).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

use crate::sigbus;

const HEADER: usize = 16;
const DESC: usize = 16;
const ALIGN: usize = 64;
/// The only version of the region layout.
const VERSION: u16 = 1;

/// Bytes one queue's region takes for a queue of `queue_size` entries.
pub(crate) fn queue_region_size(queue_size: u16) -> usize {
    (HEADER + DESC * usize::from(queue_size)).next_multiple_of(ALIGN)
}

/// The whole region, mapped.
#[derive(Debug)]
pub(crate) struct InflightRegion {
    base: *mut u8,
    len: usize,
    num_queues: u16,
    queue_size: u16,
    file: File,
    _guard: Option<sigbus::Registration>,
}

// SAFETY: the mapping is owned by the region and lives until it is dropped; all access to
// it goes through raw-pointer volatile reads and writes of plain integers, and each queue's
// part is written by one thread at a time (its worker).
unsafe impl Send for InflightRegion {}
// SAFETY: as above; shared references only hand out per-queue views.
unsafe impl Sync for InflightRegion {}

impl Drop for InflightRegion {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly what mmap returned; nothing uses the mapping now
        // (queue views hold an Arc of the region).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl InflightRegion {
    /// A new, zeroed region for `num_queues` queues of up to `queue_size` entries
    /// (GET_INFLIGHT_FD), in a memfd sealed against resizing.
    pub(crate) fn create(
        num_queues: u16,
        queue_size: u16,
        poison: &Arc<AtomicBool>,
    ) -> io::Result<InflightRegion> {
        let len = queue_region_size(queue_size) * usize::from(num_queues);
        // SAFETY: memfd_create with a static name; the fd is owned by the File below.
        let fd = unsafe {
            libc::memfd_create(
                c"vblk-inflight".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own memfd; F_ADD_SEALS takes an int.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        InflightRegion::map(file, 0, len, num_queues, queue_size, poison)
    }

    /// The region the frontend passes back (SET_INFLIGHT_FD), checked against its file.
    pub(crate) fn open(
        file: File,
        mmap_offset: u64,
        mmap_size: u64,
        num_queues: u16,
        queue_size: u16,
        poison: &Arc<AtomicBool>,
    ) -> Result<InflightRegion, String> {
        if num_queues == 0 || queue_size == 0 || !queue_size.is_power_of_two() {
            return Err(format!(
                "{num_queues} queues of {queue_size} entries: both must be non-zero, the size a power of two"
            ));
        }
        let need = (queue_region_size(queue_size) * usize::from(num_queues)) as u64;
        if mmap_size < need {
            return Err(format!(
                "{mmap_size} bytes for {num_queues} queues of {queue_size} entries, which need {need}"
            ));
        }
        if !mmap_offset.is_multiple_of(4096) {
            return Err(format!("mmap offset {mmap_offset:#x} is not page aligned"));
        }
        let (fs, _) = sigbus::file_pages(file.as_raw_fd()).map_err(|e| e.to_string())?;
        if ![
            sigbus::TMPFS_MAGIC,
            sigbus::RAMFS_MAGIC,
            sigbus::HUGETLBFS_MAGIC,
        ]
        .contains(&fs)
        {
            return Err(format!(
                "its file is on a file system of type {fs:#x}, not a memfd, tmpfs or hugetlbfs (accesses to a file elsewhere can stall the device)"
            ));
        }
        let file_len = file.metadata().map_err(|e| e.to_string())?.len();
        if mmap_offset
            .checked_add(mmap_size)
            .is_none_or(|end| end > file_len)
        {
            return Err(format!(
                "offset {mmap_offset:#x} + size {mmap_size:#x} reaches past the end of its file ({file_len:#x} bytes)"
            ));
        }
        let len = usize::try_from(mmap_size).map_err(|_| "size does not fit".to_string())?;
        InflightRegion::map(file, mmap_offset, len, num_queues, queue_size, poison)
            .map_err(|e| format!("mmap failed: {e}"))
    }

    fn map(
        file: File,
        offset: u64,
        len: usize,
        num_queues: u16,
        queue_size: u16,
        poison: &Arc<AtomicBool>,
    ) -> io::Result<InflightRegion> {
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a new shared mapping of our own fd; the arguments were checked.
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
            return Err(io::Error::last_os_error());
        }
        let base = p.cast::<u8>();
        Ok(InflightRegion {
            base,
            len,
            num_queues,
            queue_size,
            _guard: sigbus::register(base, len, sigbus::system_page(), poison),
            file,
        })
    }

    /// (mmap_size, num_queues, queue_size), for the GET_INFLIGHT_FD reply.
    pub(crate) fn shape(&self) -> (u64, u16, u16) {
        (self.len as u64, self.num_queues, self.queue_size)
    }

    /// The memfd, to send to the frontend.
    pub(crate) fn fd(&self) -> &File {
        &self.file
    }

    /// Queue `index`'s part, for a ring of `ring_size` entries; None when the region has
    /// no room for it.
    pub(crate) fn queue(self: &Arc<Self>, index: usize, ring_size: u16) -> Option<InflightQueue> {
        if index >= usize::from(self.num_queues) || ring_size > self.queue_size {
            return None;
        }
        let off = queue_region_size(self.queue_size) * index;
        Some(InflightQueue {
            // SAFETY: off + queue_region_size(queue_size) <= len, inside the mapping.
            base: unsafe { self.base.add(off) },
            size: ring_size,
            counter: 0,
            _region: self.clone(),
        })
    }
}

/// One queue's part of the region, owned by the queue's worker.
#[derive(Debug)]
pub(crate) struct InflightQueue {
    base: *mut u8,
    size: u16,
    counter: u64,
    _region: Arc<InflightRegion>,
}

// SAFETY: points into the region's mapping, kept alive by the Arc; used by one thread at
// a time (the queue moves from the control thread to its worker).
unsafe impl Send for InflightQueue {}

impl InflightQueue {
    fn u16_at(&self, off: usize) -> u16 {
        // SAFETY: off + 2 <= the queue's region (callers pass header offsets or a head
        // below `size`); volatile, the frontend may write the region concurrently.
        u16::from_le(unsafe { self.base.add(off).cast::<u16>().read_volatile() })
    }

    fn set_u16(&self, off: usize, v: u16) {
        // SAFETY: as for u16_at.
        unsafe { self.base.add(off).cast::<u16>().write_volatile(v.to_le()) }
    }

    fn desc(&self, head: u16) -> usize {
        HEADER + DESC * usize::from(head)
    }

    fn inflight(&self, head: u16) -> bool {
        // SAFETY: head < size <= queue_size: inside the queue's region.
        unsafe { self.base.add(self.desc(head)).read_volatile() == 1 }
    }

    fn set_inflight(&self, head: u16, v: bool) {
        // SAFETY: as above.
        unsafe { self.base.add(self.desc(head)).write_volatile(u8::from(v)) }
    }

    fn counter_of(&self, head: u16) -> u64 {
        // SAFETY: as above; the counter is at offset 8 of the 16-byte entry.
        u64::from_le(unsafe {
            self.base
                .add(self.desc(head) + 8)
                .cast::<u64>()
                .read_volatile()
        })
    }

    /// Prepare the region when the ring starts, given the ring's used index. A fresh region
    /// is initialised; one left by an earlier device is recovered. Returns the heads to
    /// resubmit, in the order they were taken, and the next available index to use
    /// (`used_idx + heads in flight`).
    pub(crate) fn prepare(&mut self, ring_used_idx: u16) -> (Vec<u16>, u16) {
        let version = self.u16_at(8);
        let desc_num = self.u16_at(10);
        if version != VERSION || desc_num != self.size {
            if version != 0 {
                log::warn!(
                    "inflight region version {version} for {desc_num} entries does not match a ring of {}: starting afresh",
                    self.size
                );
            }
            // SAFETY: the whole queue region (header and `size` entries) is ours to write.
            unsafe { std::ptr::write_bytes(self.base, 0, HEADER + DESC * usize::from(self.size)) };
            self.set_u16(8, VERSION);
            self.set_u16(10, self.size);
            self.set_u16(14, ring_used_idx);
            self.counter = 0;
            return (Vec::new(), ring_used_idx);
        }
        let region_used = self.u16_at(14);
        if region_used != ring_used_idx {
            // A crash between publishing the used index and clearing the last batch: the
            // batch's heads were answered. Walk its list (bounded; heads checked).
            let mut n = ring_used_idx.wrapping_sub(region_used).min(self.size);
            let mut head = self.u16_at(12);
            while n > 0 && head < self.size {
                self.set_inflight(head, false);
                head = self.u16_at(self.desc(head) + 6);
                n -= 1;
            }
            fence(Ordering::SeqCst);
            self.set_u16(14, ring_used_idx);
        }
        let mut pending: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| self.inflight(h))
            .map(|h| (self.counter_of(h), h))
            .collect();
        pending.sort_unstable();
        self.counter = pending.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        let next_avail = ring_used_idx.wrapping_add(pending.len() as u16);
        (pending.into_iter().map(|(_, h)| h).collect(), next_avail)
    }

    /// The device took `head` from the available ring.
    pub(crate) fn taken(&mut self, head: u16) {
        let at = self.desc(head);
        // SAFETY: head < size (the worker checked it against the ring): inside the region.
        unsafe {
            self.base
                .add(at + 8)
                .cast::<u64>()
                .write_volatile(self.counter.to_le())
        };
        self.counter = self.counter.wrapping_add(1);
        fence(Ordering::Release);
        self.set_inflight(head, true);
    }

    /// About to publish `batch` (before the used index store): link it as the last batch.
    pub(crate) fn before_publish(&mut self, batch: &[(u16, u32)]) {
        let mut last = self.u16_at(12);
        for &(head, _) in batch {
            if head < self.size {
                self.set_u16(self.desc(head) + 6, last);
                last = head;
            }
        }
        self.set_u16(12, last);
        fence(Ordering::Release);
    }

    /// `batch` is published and the ring's used index is `used_idx`: clear it.
    pub(crate) fn after_publish(&mut self, batch: &[(u16, u32)], used_idx: u16) {
        for &(head, _) in batch {
            if head < self.size {
                self.set_inflight(head, false);
            }
        }
        fence(Ordering::Release);
        self.set_u16(14, used_idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_resubmits_what_was_in_flight_in_order() {
        let poison = Arc::new(AtomicBool::new(false));
        let region = Arc::new(InflightRegion::create(2, 16, &poison).unwrap());
        assert_eq!(region.shape(), (2 * 320, 2, 16));
        let mut q = region.queue(1, 16).unwrap();
        assert_eq!(q.prepare(0), (vec![], 0), "fresh");
        // Take 6, 1, 4, 3; answer 1 and 3 (out of order), in one batch.
        for h in [6, 1, 4, 3] {
            q.taken(h);
        }
        let batch = [(1, 1), (3, 1)];
        q.before_publish(&batch);
        q.after_publish(&batch, 2);
        // A new device on the same region: 6 then 4 are still to answer.
        let mut q2 = region.queue(1, 16).unwrap();
        assert_eq!(q2.prepare(2), (vec![6, 4], 4));
        q2.taken(9);
        assert!(
            q2.counter_of(9) > q2.counter_of(4),
            "the counter carries on"
        );

        // A crash after the used index store, before the batch was cleared: the ring's
        // used index is ahead of the region's, and the batch counts as answered.
        let mut q = region.queue(0, 16).unwrap();
        q.prepare(0);
        for h in [2, 5, 7] {
            q.taken(h);
        }
        let batch = [(5, 1), (2, 1)];
        q.before_publish(&batch);
        // (crash here: the ring's used index became 2, the flags were not cleared)
        let mut q3 = region.queue(0, 16).unwrap();
        assert_eq!(q3.prepare(2), (vec![7], 3));
    }

    #[test]
    fn a_region_from_the_frontend_is_checked() {
        let poison = Arc::new(AtomicBool::new(false));
        let fresh = InflightRegion::create(1, 64, &poison).unwrap();
        let file = fresh.fd().try_clone().unwrap();
        let err = |r: Result<InflightRegion, String>| r.unwrap_err();
        assert!(err(InflightRegion::open(
            file.try_clone().unwrap(),
            0,
            8192,
            1,
            64,
            &poison
        ))
        .contains("past the end"));
        assert!(err(InflightRegion::open(
            file.try_clone().unwrap(),
            0,
            100,
            1,
            64,
            &poison
        ))
        .contains("need"));
        assert!(err(InflightRegion::open(
            file.try_clone().unwrap(),
            0,
            1088,
            1,
            63,
            &poison
        ))
        .contains("power of two"));
        let ok = Arc::new(InflightRegion::open(file, 0, 1088, 1, 64, &poison).unwrap());
        assert!(ok.queue(0, 128).is_none(), "a ring larger than the region");
        assert!(
            ok.queue(1, 64).is_none(),
            "a queue the region has no room for"
        );
        // Garbage written by the frontend: a batch list that loops, heads out of range.
        let mut q = ok.queue(0, 64).unwrap();
        q.prepare(0);
        q.set_u16(12, 200);
        q.taken(3);
        let mut q2 = ok.queue(0, 64).unwrap();
        assert_eq!(q2.prepare(60000), (vec![3], 60001));
    }
}
