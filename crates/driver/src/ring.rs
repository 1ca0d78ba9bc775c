//! The driver side of a split virtqueue (virtio 1.2 §2.7): descriptor table, available ring
//! and used ring in shared memory, with free-descriptor management, indirect descriptors
//! and EVENT_IDX notification suppression in both directions.
//!
//! Nothing the device writes is trusted: the used ring's index and elements are checked
//! against what the driver has outstanding, and the free list lives in private memory
//! (`next`, `chain`), never read back from the shared descriptor table.
//!
//! Memory ordering, one place each:
//! - publish: descriptors and avail ring entries are written, then the avail index is stored
//!   with Release, so the device that Acquires the index sees complete chains (§2.7.13.3.1).
//! - kick decision: a SeqCst fence between publishing the index and reading `avail_event` /
//!   the used flags, so the device either sees the new index or we see its request for a
//!   notification (§2.7.13.4; the same pairing as Linux's virtio_mb before vring_need_event).
//! - reap: the used index is loaded with Acquire before the used elements it covers are
//!   read (§2.7.14).
//! - arming interrupts: a SeqCst fence between writing `used_event` (or clearing the
//!   no-interrupt flag) and re-reading the used index, so a completion that raced with the
//!   arming is seen rather than slept through.

use std::sync::atomic::{fence, AtomicU16, Ordering};

/// Descriptor flags.
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Avail ring flag: do not interrupt (without EVENT_IDX).
const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Used ring flag: do not notify (without EVENT_IDX).
const USED_F_NO_NOTIFY: u16 = 1;
const PAGE: usize = 4096;

/// One descriptor, as it lies in the table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// One buffer of a request: guest address, length, device-writable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seg {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

/// Where the parts of one queue lie, as offsets from the start of its area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub size: u16,
    pub desc: usize,
    pub avail: usize,
    pub used: usize,
    /// Per head, one cache line: the 16-byte request header, 32 bytes of request-owned
    /// payload (discard segment, GET_ID answer) and, at [`STATUS_AT`], the status byte. The
    /// device reads the header and writes the status in the same line, so a request moves
    /// one line between the cores instead of two, and no line is shared between requests.
    pub aux: usize,
    /// Per head: an indirect table of `max_indirect` descriptors.
    pub indirect: usize,
    pub max_indirect: u16,
    /// Bytes the queue needs, rounded up to a page.
    pub len: usize,
}

/// Bytes of request-owned memory per head: one cache line.
pub(crate) const AUX_LEN: usize = 64;
/// Offset of the status byte in a head's request area.
pub(crate) const STATUS_AT: usize = 48;

impl Layout {
    pub(crate) fn new(size: u16, max_indirect: u16) -> Layout {
        let n = usize::from(size);
        let desc = 0;
        let avail = desc + 16 * n;
        let used = (avail + 6 + 2 * n).next_multiple_of(PAGE);
        let aux = (used + 6 + 8 * n).next_multiple_of(64);
        let indirect = (aux + AUX_LEN * n).next_multiple_of(64);
        let len = (indirect + 16 * n * usize::from(max_indirect)).next_multiple_of(PAGE);
        Layout {
            size,
            desc,
            avail,
            used,
            aux,
            indirect,
            max_indirect,
            len,
        }
    }
}

/// The driver side of one split ring.
#[derive(Debug)]
pub(crate) struct SplitRing {
    size: u16,
    /// `size - 1`: split rings are a power of two long (the driver picks only such sizes,
    /// and `new` asserts it), so a ring index is masked, not divided (a division per
    /// request each way).
    mask: u16,
    /// Host address of the queue's area (also its guest address: identity mapping).
    base: *mut u8,
    layout: Layout,
    use_indirect: bool,
    event_idx: bool,
    free_head: u16,
    num_free: u16,
    /// Private links: the free list, and each chain in the order it was taken.
    next: Vec<u16>,
    /// Per head: descriptors its chain holds (0 when the head is free).
    chain: Vec<u16>,
    /// Next avail index to fill.
    avail_idx: u16,
    /// Avail index last stored to shared memory.
    published: u16,
    /// Avail index at the last notification decision.
    kicked: u16,
    /// Next used index to read.
    last_used: u16,
}

// SAFETY: the ring's pointers address its own area of the shared mapping, which only this
// ring's owner touches on the driver side; moving the owner to another thread is fine.
unsafe impl Send for SplitRing {}

impl SplitRing {
    /// A ring over `base..base+layout.len`, which must be zeroed, mapped for as long as the
    /// ring lives, and used by nothing else on the driver side.
    ///
    /// # Safety
    /// `base` points to `layout.len` writable, zeroed bytes that outlive the ring and that
    /// no one else in this process accesses.
    pub(crate) unsafe fn new(
        base: *mut u8,
        layout: Layout,
        indirect: bool,
        event_idx: bool,
    ) -> SplitRing {
        let size = layout.size;
        // The mask keeps every index inside the ring only for a power of two (the attach
        // offers no other size; 0 would mask nothing).
        assert!(size.is_power_of_two(), "split ring of {size} entries");
        let mut ring = SplitRing {
            size,
            mask: size - 1,
            base,
            layout,
            use_indirect: indirect && layout.max_indirect > 1,
            event_idx,
            free_head: 0,
            num_free: size,
            next: (1..=size).collect(),
            chain: vec![0; usize::from(size)],
            avail_idx: 0,
            published: 0,
            kicked: 0,
            last_used: 0,
        };
        ring.disable_interrupts();
        ring
    }

    pub(crate) fn size(&self) -> u16 {
        self.size
    }

    /// Guest addresses of the descriptor table, avail ring and used ring.
    pub(crate) fn addresses(&self) -> (u64, u64, u64) {
        let b = self.base as u64;
        (
            b + self.layout.desc as u64,
            b + self.layout.avail as u64,
            b + self.layout.used as u64,
        )
    }

    /// Host pointer `off` bytes into the queue's area.
    fn at(&self, off: usize) -> *mut u8 {
        debug_assert!(off < self.layout.len);
        // SAFETY: every offset used is inside the layout, inside the area.
        unsafe { self.base.add(off) }
    }

    fn atomic_u16(&self, off: usize) -> &AtomicU16 {
        // SAFETY: `off` is a 2-aligned offset of a u16 field of the avail or used ring inside
        // the area, which lives as long as &self; AtomicU16 has the layout of u16.
        unsafe { &*(self.at(off) as *const AtomicU16) }
    }

    fn avail_flags(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.avail)
    }

    fn avail_idx_ref(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.avail + 2)
    }

    fn used_event(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.avail + 4 + 2 * usize::from(self.size))
    }

    fn used_flags(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.used)
    }

    fn used_idx(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.used + 2)
    }

    fn avail_event(&self) -> &AtomicU16 {
        self.atomic_u16(self.layout.used + 4 + 8 * usize::from(self.size))
    }

    /// Host pointer to the request header + payload area of `head`.
    pub(crate) fn aux(&self, head: u16) -> *mut u8 {
        self.at(self.layout.aux + AUX_LEN * usize::from(head))
    }

    /// Host pointer to the indirect table of `head`.
    fn indirect_table(&self, head: u16) -> *mut u8 {
        self.at(
            self.layout.indirect + 16 * usize::from(head) * usize::from(self.layout.max_indirect)
        )
    }

    /// Host pointer to the status byte of `head`.
    pub(crate) fn status(&self, head: u16) -> *mut u8 {
        self.at(self.layout.aux + AUX_LEN * usize::from(head) + STATUS_AT)
    }

    /// Descriptors a request of `segs` buffers takes from the table.
    #[inline(always)]
    pub(crate) fn descriptors_for(&self, segs: usize) -> u16 {
        if self.use_indirect && segs > 1 && segs <= usize::from(self.layout.max_indirect) {
            1
        } else {
            // Saturate: 65537 buffers must not count as 1 descriptor.
            u16::try_from(segs).unwrap_or(u16::MAX)
        }
    }

    /// Most buffers one request may have on this ring.
    pub(crate) fn max_segs(&self) -> usize {
        if self.use_indirect {
            usize::from(self.layout.max_indirect)
        } else {
            usize::from(self.size)
        }
    }

    pub(crate) fn num_free(&self) -> u16 {
        self.num_free
    }

    /// The head the next request will get.
    pub(crate) fn next_head(&self) -> u16 {
        self.free_head
    }

    /// Whether nothing is outstanding.
    pub(crate) fn is_idle(&self) -> bool {
        self.num_free == self.size
    }

    fn write_desc(&self, ptr: *mut Desc, d: Desc) {
        // SAFETY: ptr is a descriptor slot of this ring's table or of one of its own indirect
        // tables, inside the area; the device does not read it until the chain is published.
        unsafe { ptr.write_volatile(d) };
    }

    fn desc_ptr(&self, i: u16) -> *mut Desc {
        self.at(self.layout.desc + 16 * usize::from(i)).cast()
    }

    /// Put a request of `segs` on the ring (not yet visible to the device: see [`publish`]).
    /// Returns its head, or None when the table lacks free descriptors.
    ///
    /// [`publish`]: SplitRing::publish
    #[inline(always)]
    pub(crate) fn add(&mut self, segs: &[Seg]) -> Option<u16> {
        let need = self.descriptors_for(segs.len());
        if segs.is_empty() || need > self.num_free {
            return None;
        }
        let head = self.free_head;
        if need == 1 && segs.len() > 1 {
            let table = self.indirect_table(head);
            for (i, s) in segs.iter().enumerate() {
                let last = i + 1 == segs.len();
                self.write_desc(
                    // SAFETY: i < max_indirect, inside head's indirect table.
                    unsafe { table.cast::<Desc>().add(i) },
                    Desc {
                        addr: s.addr,
                        len: s.len,
                        flags: if s.writable { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT },
                        next: if last { 0 } else { i as u16 + 1 },
                    },
                );
            }
            self.write_desc(
                self.desc_ptr(head),
                Desc {
                    addr: table as u64,
                    len: 16 * segs.len() as u32,
                    flags: F_INDIRECT,
                    next: 0,
                },
            );
            self.free_head = self.next[usize::from(head)];
        } else {
            let mut idx = head;
            for (i, s) in segs.iter().enumerate() {
                let last = i + 1 == segs.len();
                let next = self.next[usize::from(idx)];
                self.write_desc(
                    self.desc_ptr(idx),
                    Desc {
                        addr: s.addr,
                        len: s.len,
                        flags: if s.writable { F_WRITE } else { 0 } | if last { 0 } else { F_NEXT },
                        next: if last { 0 } else { next },
                    },
                );
                idx = next;
            }
            self.free_head = idx;
        }
        self.num_free -= need;
        self.chain[usize::from(head)] = need;
        let slot = self.layout.avail + 4 + 2 * usize::from(self.avail_idx & self.mask);
        // SAFETY: slot is an avail ring entry inside the area (2-aligned).
        unsafe { self.at(slot).cast::<u16>().write_volatile(head) };
        self.avail_idx = self.avail_idx.wrapping_add(1);
        Some(head)
    }

    /// Requests added but not yet published.
    pub(crate) fn unpublished(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.published)
    }

    /// Make every added request visible to the device.
    pub(crate) fn publish(&mut self) {
        // Release: the descriptors and avail entries written above become visible no later
        // than the index that covers them.
        self.avail_idx_ref()
            .store(self.avail_idx, Ordering::Release);
        self.published = self.avail_idx;
    }

    /// Whether the device wants a notification for what was published since the last call.
    pub(crate) fn needs_kick(&mut self) -> bool {
        let old = self.kicked;
        let new = self.published;
        self.kicked = new;
        if old == new {
            return false;
        }
        // SeqCst: order the avail index store above before reading the device's
        // notification request below (pairs with the device's barrier after writing it).
        fence(Ordering::SeqCst);
        if self.event_idx {
            let event = self.avail_event().load(Ordering::Relaxed);
            need_event(event, new, old)
        } else {
            self.used_flags().load(Ordering::Relaxed) & USED_F_NO_NOTIFY == 0
        }
    }

    /// Prefetch, for writing, the request lines of the heads the device has returned and
    /// this ring has not reaped yet (up to 32): their status bytes are read next, and
    /// their header, descriptor and indirect table written again when the heads are
    /// reused; and the avail ring's line where the next requests' entries start. The
    /// device's core wrote or read each of those lines last; asked for together they move
    /// in parallel, where the reap's status reads would wait for them one at a time, and
    /// arrive owned, where a read would bring them shared and each next write would ask
    /// again (docs/design-notes.md has the A/B runs). Only hints: an id is checked when it
    /// is popped, not here.
    pub(crate) fn prefetch_used(&self) {
        let used_idx = self.used_idx().load(Ordering::Acquire);
        let n = used_idx.wrapping_sub(self.last_used).min(32);
        if n < 2 {
            return;
        }
        for i in 0..n {
            let slot = self.last_used.wrapping_add(i) & self.mask;
            let off = self.layout.used + 4 + 8 * usize::from(slot);
            // SAFETY: off is a used ring element inside the area (4-aligned).
            let id = unsafe { self.at(off).cast::<u32>().read_volatile() };
            if id < u32::from(self.size) {
                let head = id as u16;
                prefetch_write(self.aux(head));
                prefetch_write(self.desc_ptr(head).cast());
                if self.use_indirect {
                    prefetch_write(self.indirect_table(head));
                }
            }
        }
        // The avail ring's line where the next requests' entries start (their entries may
        // run into the next line, which is not asked for: what was measured).
        let slot = self.avail_idx & self.mask;
        prefetch_write(self.at(self.layout.avail + 4 + 2 * usize::from(slot)));
    }

    /// Whether the used ring holds entries not yet reaped.
    pub(crate) fn has_used(&self) -> bool {
        self.used_idx().load(Ordering::Acquire) != self.last_used
    }

    /// Take the next used entry: `(head, len)`; an error if the device wrote nonsense.
    pub(crate) fn pop_used(&mut self) -> Option<Result<(u16, u32), RingError>> {
        // Acquire: the used elements below were written before the index we read.
        let used_idx = self.used_idx().load(Ordering::Acquire);
        if used_idx == self.last_used {
            return None;
        }
        // Requests the device holds: published and not yet reaped. Descriptors in use bound
        // it too (a chain may take several; reset_outstanding frees them all).
        let outstanding = self
            .published
            .wrapping_sub(self.last_used)
            .min(self.size - self.num_free);
        let ahead = used_idx.wrapping_sub(self.last_used);
        if ahead > outstanding {
            return Some(Err(RingError::UsedIndex {
                used: used_idx,
                last: self.last_used,
                outstanding,
            }));
        }
        let off = self.layout.used + 4 + 8 * usize::from(self.last_used & self.mask);
        // SAFETY: off is a used ring element inside the area (4-aligned).
        let (id, len) = unsafe {
            let p = self.at(off).cast::<u32>();
            (p.read_volatile(), p.add(1).read_volatile())
        };
        self.last_used = self.last_used.wrapping_add(1);
        if id >= u32::from(self.size) || self.chain[id as usize] == 0 {
            return Some(Err(RingError::UsedId { id }));
        }
        let head = id as u16;
        self.free_chain(head);
        Some(Ok((head, len)))
    }

    fn free_chain(&mut self, head: u16) {
        let n = std::mem::take(&mut self.chain[usize::from(head)]);
        let mut last = head;
        for _ in 1..n {
            last = self.next[usize::from(last)];
        }
        self.next[usize::from(last)] = self.free_head;
        self.free_head = head;
        self.num_free += n;
    }

    /// Heads still outstanding (for failing them all when the device is gone).
    pub(crate) fn outstanding_heads(&self) -> impl Iterator<Item = u16> + '_ {
        (0..self.size).filter(|&h| self.chain[usize::from(h)] != 0)
    }

    /// Forget every outstanding request (the device is gone).
    pub(crate) fn reset_outstanding(&mut self) {
        let heads: Vec<u16> = self.outstanding_heads().collect();
        for h in heads {
            self.free_chain(h);
        }
    }

    /// Ask the device to interrupt on the next completion. True if completions are already
    /// waiting (then the caller should reap rather than sleep).
    pub(crate) fn enable_interrupts(&mut self) -> bool {
        if self.event_idx {
            self.used_event().store(self.last_used, Ordering::Relaxed);
        } else {
            self.avail_flags().store(0, Ordering::Relaxed);
        }
        // SeqCst: the request above must be visible before we look at the used index again.
        fence(Ordering::SeqCst);
        self.has_used()
    }

    /// Ask the device not to interrupt (we are polling).
    pub(crate) fn disable_interrupts(&mut self) {
        if self.event_idx {
            // Half the index space away: the device will not reach it while we poll.
            self.used_event()
                .store(self.last_used.wrapping_add(0x7fff), Ordering::Relaxed);
        } else {
            self.avail_flags()
                .store(AVAIL_F_NO_INTERRUPT, Ordering::Relaxed);
        }
    }
}

/// Ask for the cache line at `p` in a writable state (PREFETCHW): a hint that never faults.
/// Written as an instruction, because `_mm_prefetch` with `_MM_HINT_ET0` compiles to a
/// read prefetch (PREFETCHT0) unless the `prfchw` target feature is enabled, which the
/// x86_64 baseline does not include.
#[inline(always)]
fn prefetch_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHW is a hint: it does not fault on any address and changes no
    // register, flag or memory. Intel CPUs before Broadwell execute its encoding as a
    // no-op.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `vring_need_event`: whether moving the index from `old` to `new` passes `event`.
pub(crate) fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// The device wrote something impossible to the used ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RingError {
    /// The used index moved further than there are outstanding requests.
    #[error("used index {used} is more than {outstanding} ahead of {last}")]
    UsedIndex {
        used: u16,
        last: u16,
        outstanding: u16,
    },
    /// A used element names a head that is not outstanding.
    #[error("used element names head {id}, which is not outstanding")]
    UsedId { id: u32 },
}

#[cfg(test)]
mod tests;
