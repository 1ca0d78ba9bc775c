//! The device side of one split virtqueue (virtio 1.2 §2.7), read and written through host
//! pointers resolved once per memory table.
//!
//! Each of the three parts (descriptor table, available ring, used ring) must lie inside one
//! memory region, as QEMU's own vhost code requires; [`DeviceRing::bind`] checks that, and
//! their alignment, and is redone whenever the frontend changes its memory table. The
//! driver writes the available ring and reads the used ring concurrently: every access is a
//! volatile or atomic load or store of a little-endian value, never a Rust reference.
//!
//! Publishing: the used elements of a pass are written, then the used index is stored once
//! (Release), then the driver's wish to be notified is read (`used_event` with EVENT_IDX,
//! the avail ring's NO_INTERRUPT flag without it), so the driver is interrupted at most once
//! per batch and never when it asked not to be.

use std::sync::atomic::{fence, AtomicU16, Ordering};

use proto::GuestRam;

use crate::memory::GuestMemory;

/// Avail ring flag: the driver does not want interrupts (without EVENT_IDX).
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Used ring flag: the device does not want kicks (without EVENT_IDX).
const USED_F_NO_NOTIFY: u16 = 1;

/// Descriptor flag: the buffer is a table of descriptors.
const DESC_F_INDIRECT: u16 = 4;

/// The address and flags of the descriptor at `d`.
///
/// # Safety
/// `d` must point to 16 readable, 8-byte aligned bytes (a descriptor in mapped guest
/// memory).
unsafe fn desc_addr_flags(d: *const u8) -> (u64, u16) {
    // SAFETY: the caller guarantees 16 readable aligned bytes; volatile reads, since the
    // driver may be writing them.
    unsafe {
        (
            u64::from_le(d.cast::<u64>().read_volatile()),
            u16::from_le(d.add(12).cast::<u16>().read_volatile()),
        )
    }
}

/// A hint to bring the cache line at `p` in; never faults, whatever `p` is.
#[inline]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it does not fault on any address, and SSE is part of
    // the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Guest physical addresses of a queue's three parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct RingAddrs {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

/// What is wrong with a ring's placement or its available index.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RingError {
    #[error("the {part} at guest address {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        part: &'static str,
        addr: u64,
        align: u64,
    },
    #[error("the {part} at guest address {addr:#x} + {len} bytes is not inside one memory region")]
    Outside {
        part: &'static str,
        addr: u64,
        len: u64,
    },
    #[error("the available index {avail} is {ahead} entries ahead of the device's {next}, more than the queue size {size}")]
    AvailTooFar {
        avail: u16,
        next: u16,
        ahead: u16,
        size: u16,
    },
    #[error("a split ring of {size} entries (the size must be a power of two)")]
    Size { size: u16 },
}

/// One queue's ring, device side.
#[derive(Debug)]
pub(crate) struct DeviceRing {
    size: u16,
    /// `size - 1`: a ring index is masked, not divided (the size is a power of two, which
    /// `new` checks and the session refuses otherwise).
    mask: u16,
    addrs: RingAddrs,
    event_idx: bool,
    desc: *mut u8,
    avail: *mut u8,
    used: *mut u8,
    next_avail: u16,
    next_used: u16,
    /// Available index last read (entries up to it may be popped without another read).
    seen_avail: u16,
    /// Available entries before this index have been prefetched (a burst the worker could
    /// not take at once is not prefetched again on every pass).
    prefetched: u16,
}

// SAFETY: the pointers point into guest memory mappings that the owner keeps alive (the
// worker holds the GuestMemory the ring was bound to); the ring is used by one thread at a
// time (it moves between the control thread and a worker, never shared).
unsafe impl Send for DeviceRing {}

impl DeviceRing {
    /// A ring of `size` entries at `addrs`, starting at `base` (the next available index
    /// to process, from SET_VRING_BASE), bound to `mem`.
    pub(crate) fn new(
        mem: &GuestMemory,
        size: u16,
        addrs: RingAddrs,
        event_idx: bool,
        base: u16,
    ) -> Result<DeviceRing, RingError> {
        if !size.is_power_of_two() {
            return Err(RingError::Size { size });
        }
        let mut ring = DeviceRing {
            size,
            mask: size - 1,
            addrs,
            event_idx,
            desc: std::ptr::null_mut(),
            avail: std::ptr::null_mut(),
            used: std::ptr::null_mut(),
            next_avail: base,
            next_used: base,
            seen_avail: base,
            prefetched: base,
        };
        ring.bind(mem)?;
        // The used index carries on from what is in the ring (what this or an earlier
        // device last published), as libvhost-user does.
        ring.next_used = u16::from_le(ring.u16_at(ring.used, 2).load(Ordering::Acquire));
        Ok(ring)
    }

    /// Resolve the ring's parts in `mem` (a new memory table).
    pub(crate) fn bind(&mut self, mem: &GuestMemory) -> Result<(), RingError> {
        let n = u64::from(self.size);
        let parts = [
            ("descriptor table", self.addrs.desc, 16, 16 * n),
            ("available ring", self.addrs.avail, 2, 6 + 2 * n),
            ("used ring", self.addrs.used, 4, 6 + 8 * n),
        ];
        let mut host = [std::ptr::null_mut(); 3];
        for (i, (part, addr, align, len)) in parts.into_iter().enumerate() {
            if !addr.is_multiple_of(align) {
                return Err(RingError::Misaligned { part, addr, align });
            }
            host[i] = mem
                .host_range(addr, len)
                .ok_or(RingError::Outside { part, addr, len })?;
        }
        self.desc = host[0];
        self.avail = host[1];
        self.used = host[2];
        Ok(())
    }

    /// Entries in the ring.
    pub(crate) fn size(&self) -> u16 {
        self.size
    }

    /// Guest address of the descriptor table.
    pub(crate) fn desc_table(&self) -> u64 {
        self.addrs.desc
    }

    /// The next available index the device will process (GET_VRING_BASE).
    pub(crate) fn next_avail(&self) -> u16 {
        self.next_avail
    }

    /// Start processing at `next` instead (inflight recovery knows better than the base).
    pub(crate) fn set_next_avail(&mut self, next: u16) {
        self.next_avail = next;
        self.seen_avail = next;
        self.prefetched = next;
    }

    /// The used index: what the device has published so far.
    pub(crate) fn next_used(&self) -> u16 {
        self.next_used
    }

    fn u16_at(&self, base: *mut u8, off: usize) -> &AtomicU16 {
        // SAFETY: `bind` checked that base..base+len of this part lies inside one mapped
        // region and that the part is at least 2-byte aligned; every `off` used below is
        // even and inside that length. An AtomicU16 over shared memory is how the ring is
        // meant to be accessed; the mapping outlives `self` (see the Send impl).
        unsafe { AtomicU16::from_ptr(base.add(off).cast()) }
    }

    fn avail_idx(&self, order: Ordering) -> u16 {
        u16::from_le(self.u16_at(self.avail, 2).load(order))
    }

    /// Whether the driver made chains available that [`refresh`](Self::refresh) has not
    /// seen (or an index that refresh will refuse): one load.
    pub(crate) fn has_new(&self) -> bool {
        self.avail_idx(Ordering::Relaxed) != self.seen_avail || self.seen_avail != self.next_avail
    }

    /// Read the available index; the number of chains waiting, or an error when the driver
    /// claims more than the queue can hold.
    pub(crate) fn refresh(&mut self) -> Result<u16, RingError> {
        let avail = self.avail_idx(Ordering::Acquire);
        let ahead = avail.wrapping_sub(self.next_avail);
        if ahead > self.size {
            return Err(RingError::AvailTooFar {
                avail,
                next: self.next_avail,
                ahead,
                size: self.size,
            });
        }
        self.seen_avail = avail;
        Ok(ahead)
    }

    /// The next available head, if the last [`refresh`](Self::refresh) saw one.
    pub(crate) fn pop(&mut self) -> Option<u16> {
        if self.next_avail == self.seen_avail {
            return None;
        }
        let slot = usize::from(self.next_avail & self.mask);
        let head = u16::from_le(
            self.u16_at(self.avail, 4 + 2 * slot)
                .load(Ordering::Relaxed),
        );
        self.next_avail = self.next_avail.wrapping_add(1);
        Some(head)
    }

    /// Ask the CPU to fetch, in parallel, what the walks of the next (at most `max`)
    /// available chains will read first: their descriptors, then the indirect tables
    /// those name, then the buffers the chains start with (the request headers). The
    /// driver wrote all of these from another CPU, so each is a cache miss; walked one
    /// after the other, a burst of N chains waits N times for each level, and prefetched
    /// it waits about once per level. Only hints: whatever is read here is bounds-checked
    /// before it is used as an address, never trusted, and read again by the walk.
    pub(crate) fn prefetch(&mut self, mem: &GuestMemory, max: usize) {
        const LEVEL: usize = 32;
        let waiting = self.seen_avail.wrapping_sub(self.next_avail);
        // Start after what an earlier pass prefetched, if that is still ahead of us.
        let done = self.prefetched.wrapping_sub(self.next_avail);
        let start = if done <= waiting {
            self.prefetched
        } else {
            self.next_avail
        };
        let n = usize::from(self.seen_avail.wrapping_sub(start)).min(max.min(LEVEL));
        if n < 2 {
            // One chain: nothing to overlap its misses with.
            return;
        }
        self.prefetched = start.wrapping_add(n as u16);
        let mut descs = [std::ptr::null::<u8>(); LEVEL];
        for (i, d) in descs.iter_mut().enumerate().take(n) {
            let slot = usize::from(start.wrapping_add(i as u16) & self.mask);
            let head = u16::from_le(
                self.u16_at(self.avail, 4 + 2 * slot)
                    .load(Ordering::Relaxed),
            );
            if head < self.size {
                // SAFETY: head < size: inside the descriptor table `bind` checked.
                *d = unsafe { self.desc.add(16 * usize::from(head)) };
                prefetch(*d);
            }
        }
        // The next level: each descriptor's buffer (an indirect table or a header).
        let mut firsts = [std::ptr::null::<u8>(); LEVEL];
        for (d, first) in descs.iter().zip(firsts.iter_mut()).take(n) {
            if d.is_null() {
                continue;
            }
            // SAFETY: `d` is a 16-byte descriptor inside the table `bind` checked (16-byte
            // aligned).
            let (addr, flags) = unsafe { desc_addr_flags(*d) };
            let Some(p) = mem.host_range(addr, 16) else {
                continue;
            };
            prefetch(p);
            if flags & DESC_F_INDIRECT != 0 && (p as usize).is_multiple_of(8) {
                *first = p;
            }
        }
        // Indirect chains: the buffer their first entry names (the header).
        for first in firsts.iter().take(n) {
            if first.is_null() {
                continue;
            }
            // SAFETY: `host_range` checked 16 bytes at `first` inside one mapped region,
            // and `first` is 8-byte aligned (checked above).
            let (addr, _) = unsafe { desc_addr_flags(*first) };
            if let Some(p) = mem.host_range(addr, 1) {
                prefetch(p);
            }
        }
    }

    /// Give back the head just popped (it will be the next one popped).
    pub(crate) fn unpop(&mut self) {
        self.next_avail = self.next_avail.wrapping_sub(1);
    }

    /// Ask the driver for kicks (`enable`) or not. When enabling, returns whether chains
    /// arrived meanwhile (then the caller must not sleep).
    pub(crate) fn set_kicks(&mut self, enable: bool) -> bool {
        if self.event_idx {
            if enable {
                let at = 4 + 8 * usize::from(self.size);
                self.u16_at(self.used, at)
                    .store(self.next_avail.to_le(), Ordering::Relaxed);
            }
            // With EVENT_IDX the driver kicks only when it passes avail_event, which we
            // leave behind while polling: nothing to write to stop kicks.
        } else {
            let flags = if enable { 0 } else { USED_F_NO_NOTIFY };
            self.u16_at(self.used, 0)
                .store(flags.to_le(), Ordering::Relaxed);
        }
        if !enable {
            return false;
        }
        // Order the store above before reading the index (pairs with the driver's fence
        // between writing avail idx and reading our flags / avail_event).
        fence(Ordering::SeqCst);
        self.avail_idx(Ordering::Relaxed) != self.next_avail
    }

    /// Write `done` (head, used length) to the used ring, store the used index once, and
    /// say whether the driver wants a notification.
    pub(crate) fn publish(&mut self, done: &[(u16, u32)]) -> bool {
        if done.is_empty() {
            return false;
        }
        let old = self.next_used;
        let mut idx = old;
        for &(head, len) in done {
            let at = 4 + 8 * usize::from(idx & self.mask);
            // SAFETY: `at + 8 <= 4 + 8 * size`, inside the used ring checked by `bind`,
            // which is 4-byte aligned; volatile stores into shared memory.
            unsafe {
                let p = self.used.add(at).cast::<u32>();
                p.write_volatile(u32::from(head).to_le());
                p.add(1).write_volatile(len.to_le());
            }
            idx = idx.wrapping_add(1);
        }
        // Release: the elements above are visible no later than the index covering them.
        self.u16_at(self.used, 2)
            .store(idx.to_le(), Ordering::Release);
        self.next_used = idx;
        // The index store must be ordered before reading the driver's notification request
        // (pairs with the driver's fence after writing it).
        fence(Ordering::SeqCst);
        if self.event_idx {
            let at = 4 + 2 * usize::from(self.size);
            let event = u16::from_le(self.u16_at(self.avail, at).load(Ordering::Relaxed));
            idx.wrapping_sub(event).wrapping_sub(1) < idx.wrapping_sub(old)
        } else {
            let flags = u16::from_le(self.u16_at(self.avail, 0).load(Ordering::Relaxed));
            flags & AVAIL_F_NO_INTERRUPT == 0
        }
    }
}
