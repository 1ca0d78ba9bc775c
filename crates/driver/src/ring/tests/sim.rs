//! A simulated virtio device on the other side of the split ring under test.
//!
//! The device reads the descriptor table and the avail ring, and writes the used ring,
//! in the same memory as the ring under test, following virtio 1.2 §2.7: it finds every field
//! from the three addresses the ring reports and the offsets the spec gives, not from
//! `Layout`, so the two are checked against each other. It asserts what the spec asks of a
//! driver (chains that end and do not loop, no NEXT with INDIRECT, no nested indirect tables,
//! device-readable buffers before device-writable ones) and decides notifications the way
//! §2.7.7 and §2.7.10 say a device does.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::sync::atomic::{fence, AtomicU16, Ordering};

use crate::ring::{Layout, Seg, SplitRing};

// Spelled as in virtio 1.2 §2.7.5, §2.7.6 and §2.7.8, independently of ring.rs.
pub(super) const VIRTQ_DESC_F_NEXT: u16 = 1;
pub(super) const VIRTQ_DESC_F_WRITE: u16 = 2;
pub(super) const VIRTQ_DESC_F_INDIRECT: u16 = 4;
pub(super) const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
pub(super) const VIRTQ_USED_F_NO_NOTIFY: u16 = 1;

/// `struct virtq_desc` (§2.7.5).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct VirtqDesc {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) flags: u16,
    pub(super) next: u16,
}

/// Zeroed, page-aligned memory for one ring, freed on drop.
struct Area {
    ptr: *mut u8,
    layout: AllocLayout,
}

impl Area {
    fn new(len: usize) -> Area {
        let layout = AllocLayout::from_size_align(len, 4096).unwrap();
        assert!(layout.size() > 0);
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocating {len} bytes failed");
        Area { ptr, layout }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: ptr came from alloc_zeroed with this very layout and is freed only here.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// A ring, the device on its other side, and their memory. Fields drop in order, so the
/// memory goes last.
pub(super) struct Harness {
    pub(super) ring: SplitRing,
    pub(super) dev: Device,
    pub(super) layout: Layout,
    area: Area,
}

impl Harness {
    pub(super) fn new(size: u16, max_indirect: u16, indirect: bool, event_idx: bool) -> Harness {
        let layout = Layout::new(size, max_indirect);
        let area = Area::new(layout.len);
        // SAFETY: area is layout.len zeroed, writable, page-aligned bytes owned by the harness,
        // which drops them after the ring; in this process only the ring and the simulated
        // device touch them, both through raw pointers or atomics, on one thread.
        let ring = unsafe { SplitRing::new(area.ptr, layout, indirect, event_idx) };
        let dev = Device::new(&ring, area.ptr, layout.len, event_idx);
        Harness {
            ring,
            dev,
            layout,
            area,
        }
    }

    pub(super) fn base(&self) -> u64 {
        self.area.ptr as u64
    }

    /// Add `segs`, expecting room.
    pub(super) fn add(&mut self, segs: &[Seg]) -> u16 {
        self.ring.add(segs).expect("the ring has room")
    }

    /// The device takes and completes everything published, in order; the driver reaps.
    /// Returns the heads reaped.
    pub(super) fn complete_all(&mut self) -> Vec<u16> {
        while let Some(c) = self.dev.pop_avail() {
            self.dev.put_used(c.head.into(), written(&c.segs));
        }
        self.dev.flush_used();
        self.reap()
    }

    /// Reap every used entry, expecting no errors.
    pub(super) fn reap(&mut self) -> Vec<u16> {
        let mut heads = Vec::new();
        while let Some(r) = self.ring.pop_used() {
            heads.push(r.expect("an honest device").0);
        }
        heads
    }

    /// Run `n` single-buffer requests all the way through, to move both indices.
    pub(super) fn advance(&mut self, n: usize) {
        for i in 0..n {
            self.add(&make_segs(1, i as u64));
            self.ring.publish();
            self.ring.needs_kick();
            assert_eq!(self.complete_all().len(), 1);
        }
    }
}

/// What the device found behind one avail entry.
#[derive(Debug)]
pub(super) struct Chain {
    pub(super) head: u16,
    /// The buffers, in chain order.
    pub(super) segs: Vec<Seg>,
    /// The descriptors they came from (main table or indirect table), in chain order.
    pub(super) raw: Vec<VirtqDesc>,
    /// Entries of the main table the chain occupies, in chain order.
    pub(super) table_descs: Vec<u16>,
    /// Address and entry count of the indirect table, when the head refers to one.
    pub(super) indirect: Option<(u64, usize)>,
}

/// The device side, as §2.7 describes it.
pub(super) struct Device {
    area: *mut u8,
    area_len: usize,
    size: u16,
    pub(super) desc: u64,
    avail: u64,
    used: u64,
    event_idx: bool,
    /// Next avail entry to take.
    pub(super) last_avail: u16,
    /// Next used entry to fill.
    used_idx: u16,
    /// Used index at the last interrupt decision.
    signalled: u16,
}

impl Device {
    fn new(ring: &SplitRing, area: *mut u8, area_len: usize, event_idx: bool) -> Device {
        let (desc, avail, used) = ring.addresses();
        Device {
            area,
            area_len,
            size: ring.size(),
            desc,
            avail,
            used,
            event_idx,
            last_avail: 0,
            used_idx: 0,
            signalled: 0,
        }
    }

    fn n(&self) -> u64 {
        u64::from(self.size)
    }

    /// Host pointer to `len` bytes at guest address `addr` (identity mapping), which must lie
    /// inside the ring's area.
    fn ptr(&self, addr: u64, len: usize) -> *mut u8 {
        let base = self.area as u64;
        assert!(
            addr >= base && addr - base + len as u64 <= self.area_len as u64,
            "{addr:#x} + {len} is outside the ring area {base:#x} + {}",
            self.area_len
        );
        self.area.wrapping_add((addr - base) as usize)
    }

    /// The 16-bit field at guest address `addr`, shared with the ring.
    fn field(&self, addr: u64) -> &AtomicU16 {
        assert_eq!(addr % 2, 0, "{addr:#x} is not 2-aligned");
        let p = self.ptr(addr, 2);
        // SAFETY: p is 2-aligned and inside the area (checked above), which the harness keeps
        // alive longer than the device; AtomicU16 has the layout of u16, and nothing in these
        // tests holds a &mut to ring memory.
        unsafe { &*p.cast::<AtomicU16>() }
    }

    // Avail ring (§2.7.6): flags, idx, ring[size], used_event.
    pub(super) fn avail_flags(&self) -> u16 {
        u16::from_le(self.field(self.avail).load(Ordering::Relaxed))
    }

    pub(super) fn avail_idx(&self) -> u16 {
        u16::from_le(self.field(self.avail + 2).load(Ordering::Acquire))
    }

    fn avail_entry(&self, i: u16) -> u16 {
        let p = self.ptr(self.avail + 4 + 2 * u64::from(i % self.size), 2);
        // SAFETY: p is a 2-aligned avail ring entry inside the area (ptr checked the bounds).
        u16::from_le(unsafe { p.cast::<u16>().read_volatile() })
    }

    pub(super) fn used_event(&self) -> u16 {
        u16::from_le(
            self.field(self.avail + 4 + 2 * self.n())
                .load(Ordering::Relaxed),
        )
    }

    // Used ring (§2.7.8): flags, idx, ring[size] of (id: u32, len: u32), avail_event.
    pub(super) fn set_used_flags(&self, v: u16) {
        self.field(self.used).store(v.to_le(), Ordering::Relaxed);
    }

    pub(super) fn used_idx_in_memory(&self) -> u16 {
        u16::from_le(self.field(self.used + 2).load(Ordering::Relaxed))
    }

    /// Store the used index as it is (a hostile device may store anything).
    pub(super) fn set_used_idx(&self, v: u16) {
        self.field(self.used + 2)
            .store(v.to_le(), Ordering::Release);
    }

    pub(super) fn avail_event(&self) -> u16 {
        u16::from_le(
            self.field(self.used + 4 + 8 * self.n())
                .load(Ordering::Relaxed),
        )
    }

    pub(super) fn set_avail_event(&self, v: u16) {
        self.field(self.used + 4 + 8 * self.n())
            .store(v.to_le(), Ordering::Relaxed);
    }

    pub(super) fn read_desc(&self, table: u64, i: usize) -> VirtqDesc {
        let addr = table + 16 * i as u64;
        assert_eq!(addr % 16, 0, "descriptor at {addr:#x} is not 16-aligned");
        let p = self.ptr(addr, 16);
        // SAFETY: p is a 16-aligned, in-bounds descriptor slot (checked above); VirtqDesc is
        // repr(C) with the wire layout and any bit pattern is a valid value.
        let d = unsafe { p.cast::<VirtqDesc>().read_volatile() };
        VirtqDesc {
            addr: u64::from_le(d.addr),
            len: u32::from_le(d.len),
            flags: u16::from_le(d.flags),
            next: u16::from_le(d.next),
        }
    }

    /// Take the next chain the driver made available, or None when there is none.
    pub(super) fn pop_avail(&mut self) -> Option<Chain> {
        let idx = self.avail_idx();
        if idx == self.last_avail {
            return None;
        }
        assert!(
            idx.wrapping_sub(self.last_avail) <= self.size,
            "avail idx {idx} is more than {} ahead of {}",
            self.size,
            self.last_avail
        );
        let head = self.avail_entry(self.last_avail);
        self.last_avail = self.last_avail.wrapping_add(1);
        Some(self.walk(head))
    }

    /// Follow the chain at `head` through the table (§2.7.5) and, when the head refers to
    /// one, through its indirect table (§2.7.5.3).
    pub(super) fn walk(&self, head: u16) -> Chain {
        assert!(
            head < self.size,
            "head {head} is past the table of {}",
            self.size
        );
        let mut chain = Chain {
            head,
            segs: Vec::new(),
            raw: Vec::new(),
            table_descs: Vec::new(),
            indirect: None,
        };
        let mut i = head;
        loop {
            assert!(
                i < self.size,
                "descriptor {i} is past the table of {}",
                self.size
            );
            assert!(
                !chain.table_descs.contains(&i),
                "the chain at {head} loops back to {i}"
            );
            chain.table_descs.push(i);
            let d = self.read_desc(self.desc, usize::from(i));
            if d.flags & VIRTQ_DESC_F_INDIRECT != 0 {
                assert_eq!(
                    d.flags & VIRTQ_DESC_F_NEXT,
                    0,
                    "INDIRECT together with NEXT"
                );
                assert_eq!(i, head, "an indirect descriptor in the middle of a chain");
                assert!(
                    d.len > 0 && d.len.is_multiple_of(16),
                    "indirect table of {} bytes",
                    d.len
                );
                let entries = d.len as usize / 16;
                let mut j = 0;
                let mut seen = vec![false; entries];
                loop {
                    assert!(
                        j < entries,
                        "indirect next {j} is past the table of {entries}"
                    );
                    assert!(!seen[j], "the indirect table at {head} loops back to {j}");
                    seen[j] = true;
                    let e = self.read_desc(d.addr, j);
                    assert_eq!(e.flags & VIRTQ_DESC_F_INDIRECT, 0, "nested indirect table");
                    take(&mut chain, e);
                    if e.flags & VIRTQ_DESC_F_NEXT == 0 {
                        break;
                    }
                    j = usize::from(e.next);
                }
                chain.indirect = Some((d.addr, entries));
                return chain;
            }
            take(&mut chain, d);
            if d.flags & VIRTQ_DESC_F_NEXT == 0 {
                return chain;
            }
            i = d.next;
        }
    }

    /// Write used element `at` (§2.7.8) as it is, without moving the used index.
    pub(super) fn write_used_elem(&self, at: u16, id: u32, len: u32) {
        let p = self.ptr(self.used + 4 + 8 * u64::from(at % self.size), 8);
        // SAFETY: p is a 4-aligned (the used ring is page-aligned), in-bounds used element of
        // two u32s (ptr checked the bounds).
        unsafe {
            p.cast::<u32>().write_volatile(id.to_le());
            p.cast::<u32>().add(1).write_volatile(len.to_le());
        }
    }

    /// Return a buffer: write the next used element, not yet visible (see `flush_used`).
    pub(super) fn put_used(&mut self, id: u32, len: u32) {
        self.write_used_elem(self.used_idx, id, len);
        self.used_idx = self.used_idx.wrapping_add(1);
    }

    /// Publish the used elements written so far and decide, as §2.7.7 says, whether to
    /// interrupt the driver.
    pub(super) fn flush_used(&mut self) -> bool {
        self.field(self.used + 2)
            .store(self.used_idx.to_le(), Ordering::Release);
        // The device's half of the pairing: the new used index before reading used_event.
        fence(Ordering::SeqCst);
        let (old, new) = (self.signalled, self.used_idx);
        self.signalled = new;
        if old == new {
            return false;
        }
        if self.event_idx {
            passes(self.used_event(), new, old)
        } else {
            self.avail_flags() & VIRTQ_AVAIL_F_NO_INTERRUPT == 0
        }
    }

    /// About to sleep: ask to be notified of the next avail entry (§2.7.10).
    pub(super) fn wait_for_kick(&self) {
        if self.event_idx {
            self.set_avail_event(self.last_avail);
        } else {
            self.set_used_flags(0);
        }
    }

    /// Busy polling the avail ring: ask not to be notified (§2.7.10).
    pub(super) fn suppress_kicks(&self) {
        if self.event_idx {
            // An index already behind us: publishing more never passes it.
            self.set_avail_event(self.last_avail.wrapping_sub(1));
        } else {
            self.set_used_flags(VIRTQ_USED_F_NO_NOTIFY);
        }
    }
}

/// Append one descriptor's buffer to `chain`, checking readable-before-writable (§2.7.4.2).
fn take(chain: &mut Chain, d: VirtqDesc) {
    let writable = d.flags & VIRTQ_DESC_F_WRITE != 0;
    assert!(
        writable || chain.segs.iter().all(|s| !s.writable),
        "a device-readable buffer after a device-writable one in the chain at {}",
        chain.head
    );
    chain.segs.push(Seg {
        addr: d.addr,
        len: d.len,
        writable,
    });
    chain.raw.push(d);
}

/// Whether moving an index from `old` to `new` steps over `event`, by counting the steps:
/// the definition `need_event` computes in one expression.
pub(super) fn passes(event: u16, new: u16, old: u16) -> bool {
    let mut i = old;
    while i != new {
        if i == event {
            return true;
        }
        i = i.wrapping_add(1);
    }
    false
}

/// `n` buffers of a request tagged `tag`: device-readable first, then device-writable.
pub(super) fn make_segs(n: usize, tag: u64) -> Vec<Seg> {
    (0..n)
        .map(|i| Seg {
            addr: 0x7f00_0000_0000 + tag * 0x10_0000 + i as u64 * 0x1000,
            len: 1 + ((tag as u32).wrapping_mul(31) + i as u32 * 512) % 4096,
            writable: i >= n / 2,
        })
        .collect()
}

/// Bytes a device writes for `segs`: all of its writable buffers.
pub(super) fn written(segs: &[Seg]) -> u32 {
    segs.iter().filter(|s| s.writable).map(|s| s.len).sum()
}
