//! The driver side of the split ring against a simulated device.
//!
//! The device below reads the descriptor table and the avail ring, and writes the used ring,
//! in the same memory as the ring under test, following virtio 1.2 §2.7: it finds every field
//! from the three addresses the ring reports and the offsets the spec gives, not from
//! `Layout`, so the two are checked against each other. It asserts what the spec asks of a
//! driver (chains that end and do not loop, no NEXT with INDIRECT, no nested indirect tables,
//! device-readable buffers before device-writable ones) and decides notifications the way
//! §2.7.7 and §2.7.10 say a device does.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{fence, AtomicU16, Ordering};

use super::*;

// Spelled as in virtio 1.2 §2.7.5, §2.7.6 and §2.7.8, independently of ring.rs.
const VIRTQ_DESC_F_NEXT: u16 = 1;
const VIRTQ_DESC_F_WRITE: u16 = 2;
const VIRTQ_DESC_F_INDIRECT: u16 = 4;
const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
const VIRTQ_USED_F_NO_NOTIFY: u16 = 1;

/// `struct virtq_desc` (§2.7.5).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct VirtqDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
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
struct Harness {
    ring: SplitRing,
    dev: Device,
    layout: Layout,
    area: Area,
}

impl Harness {
    fn new(size: u16, max_indirect: u16, indirect: bool, event_idx: bool) -> Harness {
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

    fn base(&self) -> u64 {
        self.area.ptr as u64
    }

    /// Add `segs`, expecting room.
    fn add(&mut self, segs: &[Seg]) -> u16 {
        self.ring.add(segs).expect("the ring has room")
    }

    /// The device takes and completes everything published, in order; the driver reaps.
    /// Returns the heads reaped.
    fn complete_all(&mut self) -> Vec<u16> {
        while let Some(c) = self.dev.pop_avail() {
            self.dev.put_used(c.head.into(), written(&c.segs));
        }
        self.dev.flush_used();
        self.reap()
    }

    /// Reap every used entry, expecting no errors.
    fn reap(&mut self) -> Vec<u16> {
        let mut heads = Vec::new();
        while let Some(r) = self.ring.pop_used() {
            heads.push(r.expect("an honest device").0);
        }
        heads
    }

    /// Run `n` single-buffer requests all the way through, to move both indices.
    fn advance(&mut self, n: usize) {
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
struct Chain {
    head: u16,
    /// The buffers, in chain order.
    segs: Vec<Seg>,
    /// The descriptors they came from (main table or indirect table), in chain order.
    raw: Vec<VirtqDesc>,
    /// Entries of the main table the chain occupies, in chain order.
    table_descs: Vec<u16>,
    /// Address and entry count of the indirect table, when the head refers to one.
    indirect: Option<(u64, usize)>,
}

/// The device side, as §2.7 describes it.
struct Device {
    area: *mut u8,
    area_len: usize,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    event_idx: bool,
    /// Next avail entry to take.
    last_avail: u16,
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
    fn avail_flags(&self) -> u16 {
        u16::from_le(self.field(self.avail).load(Ordering::Relaxed))
    }

    fn avail_idx(&self) -> u16 {
        u16::from_le(self.field(self.avail + 2).load(Ordering::Acquire))
    }

    fn avail_entry(&self, i: u16) -> u16 {
        let p = self.ptr(self.avail + 4 + 2 * u64::from(i % self.size), 2);
        // SAFETY: p is a 2-aligned avail ring entry inside the area (ptr checked the bounds).
        u16::from_le(unsafe { p.cast::<u16>().read_volatile() })
    }

    fn used_event(&self) -> u16 {
        u16::from_le(
            self.field(self.avail + 4 + 2 * self.n())
                .load(Ordering::Relaxed),
        )
    }

    // Used ring (§2.7.8): flags, idx, ring[size] of (id: u32, len: u32), avail_event.
    fn set_used_flags(&self, v: u16) {
        self.field(self.used).store(v.to_le(), Ordering::Relaxed);
    }

    fn used_idx_in_memory(&self) -> u16 {
        u16::from_le(self.field(self.used + 2).load(Ordering::Relaxed))
    }

    /// Store the used index as it is (a hostile device may store anything).
    fn set_used_idx(&self, v: u16) {
        self.field(self.used + 2)
            .store(v.to_le(), Ordering::Release);
    }

    fn avail_event(&self) -> u16 {
        u16::from_le(
            self.field(self.used + 4 + 8 * self.n())
                .load(Ordering::Relaxed),
        )
    }

    fn set_avail_event(&self, v: u16) {
        self.field(self.used + 4 + 8 * self.n())
            .store(v.to_le(), Ordering::Relaxed);
    }

    fn read_desc(&self, table: u64, i: usize) -> VirtqDesc {
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
    fn pop_avail(&mut self) -> Option<Chain> {
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
    fn walk(&self, head: u16) -> Chain {
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
    fn write_used_elem(&self, at: u16, id: u32, len: u32) {
        let p = self.ptr(self.used + 4 + 8 * u64::from(at % self.size), 8);
        // SAFETY: p is a 4-aligned (the used ring is page-aligned), in-bounds used element of
        // two u32s (ptr checked the bounds).
        unsafe {
            p.cast::<u32>().write_volatile(id.to_le());
            p.cast::<u32>().add(1).write_volatile(len.to_le());
        }
    }

    /// Return a buffer: write the next used element, not yet visible (see `flush_used`).
    fn put_used(&mut self, id: u32, len: u32) {
        self.write_used_elem(self.used_idx, id, len);
        self.used_idx = self.used_idx.wrapping_add(1);
    }

    /// Publish the used elements written so far and decide, as §2.7.7 says, whether to
    /// interrupt the driver.
    fn flush_used(&mut self) -> bool {
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
    fn wait_for_kick(&self) {
        if self.event_idx {
            self.set_avail_event(self.last_avail);
        } else {
            self.set_used_flags(0);
        }
    }

    /// Busy polling the avail ring: ask not to be notified (§2.7.10).
    fn suppress_kicks(&self) {
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
fn passes(event: u16, new: u16, old: u16) -> bool {
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
fn make_segs(n: usize, tag: u64) -> Vec<Seg> {
    (0..n)
        .map(|i| Seg {
            addr: 0x7f00_0000_0000 + tag * 0x10_0000 + i as u64 * 0x1000,
            len: 1 + ((tag as u32).wrapping_mul(31) + i as u32 * 512) % 4096,
            writable: i >= n / 2,
        })
        .collect()
}

/// Bytes a device writes for `segs`: all of its writable buffers.
fn written(segs: &[Seg]) -> u32 {
    segs.iter().filter(|s| s.writable).map(|s| s.len).sum()
}

/// Descriptors a request of `n` buffers should take, computed from the rule, not the ring.
fn expected_descs(n: usize, indirect: bool, max_indirect: u16) -> u16 {
    if indirect && max_indirect > 1 && n > 1 && n <= usize::from(max_indirect) {
        1
    } else {
        n as u16
    }
}

/// splitmix64: a seeded generator, so every failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

// ---- layout ----

#[test]
fn layout_parts_are_aligned_disjoint_and_inside_len() {
    for (size, mi) in [
        (1, 0),
        (2, 2),
        (8, 4),
        (256, 0),
        (256, 130),
        (1024, 128),
        (32768, 0),
        (32768, 4),
    ] {
        let l = Layout::new(size, mi);
        let n = usize::from(size);
        // §2.7: descriptor table 16-aligned, avail ring 2-aligned, used ring 4-aligned.
        assert_eq!(l.desc % 16, 0, "{l:?}");
        assert_eq!(l.avail % 2, 0, "{l:?}");
        assert_eq!(l.used % 4, 0, "{l:?}");
        assert_eq!(l.indirect % 16, 0, "{l:?}");
        assert!(l.desc + 16 * n <= l.avail, "{l:?}");
        assert!(l.avail + 6 + 2 * n <= l.used, "{l:?}");
        assert!(l.used + 6 + 8 * n <= l.aux, "{l:?}");
        assert!(l.aux + AUX_LEN * n <= l.indirect, "{l:?}");
        assert_eq!(l.aux % 64, 0, "request areas are cache-line aligned: {l:?}");
        assert!(l.indirect + 16 * n * usize::from(mi) <= l.len, "{l:?}");
        assert_eq!(l.len % 4096, 0, "{l:?}");
        assert_eq!((l.size, l.max_indirect), (size, mi));
    }
}

#[test]
fn addresses_and_per_head_areas_lie_in_the_area() {
    let h = Harness::new(8, 4, true, false);
    let b = h.base();
    assert_eq!(
        h.ring.addresses(),
        (
            b + h.layout.desc as u64,
            b + h.layout.avail as u64,
            b + h.layout.used as u64
        )
    );
    for head in 0..8u16 {
        let aux = h.ring.aux(head) as u64;
        let status = h.ring.status(head) as u64;
        assert_eq!(aux, b + (h.layout.aux + AUX_LEN * usize::from(head)) as u64);
        assert_eq!(
            status,
            aux + STATUS_AT as u64,
            "status shares the header's cache line"
        );
        const { assert!(STATUS_AT >= 16 + 32 && STATUS_AT < AUX_LEN) };
        assert!(status < b + h.layout.indirect as u64);
    }
}

#[test]
fn a_new_ring_is_idle_with_interrupts_off() {
    for event_idx in [false, true] {
        let mut h = Harness::new(8, 4, true, event_idx);
        assert_eq!(h.ring.size(), 8);
        assert_eq!(h.ring.num_free(), 8);
        assert!(h.ring.is_idle());
        assert_eq!(h.ring.next_head(), 0);
        assert_eq!(h.ring.unpublished(), 0);
        assert_eq!(h.ring.outstanding_heads().count(), 0);
        assert!(!h.ring.has_used());
        assert!(h.ring.pop_used().is_none());
        assert!(!h.ring.needs_kick(), "nothing published, nothing to kick");
        assert_eq!(h.dev.avail_idx(), 0);
        if event_idx {
            // §2.7.10: with EVENT_IDX the driver leaves flags at 0 and uses used_event.
            assert_eq!(h.dev.avail_flags(), 0);
            assert_eq!(h.dev.used_event(), 0x7fff);
        } else {
            assert_eq!(h.dev.avail_flags(), VIRTQ_AVAIL_F_NO_INTERRUPT);
            assert_eq!(h.dev.used_event(), 0);
        }
    }
}

// ---- publishing ----

#[test]
fn added_requests_are_invisible_until_published() {
    let mut h = Harness::new(8, 4, true, true);
    let heads: Vec<u16> = (0..3).map(|i| h.add(&make_segs(2, i))).collect();
    assert_eq!(heads, [0, 1, 2]);
    assert_eq!(h.ring.unpublished(), 3);
    assert_eq!(
        h.dev.avail_idx(),
        0,
        "avail idx in memory moved before publish"
    );
    assert!(h.dev.pop_avail().is_none());

    h.ring.publish();
    assert_eq!(h.ring.unpublished(), 0);
    assert_eq!(h.dev.avail_idx(), 3);
    for (i, &head) in heads.iter().enumerate() {
        let c = h.dev.pop_avail().unwrap();
        assert_eq!(c.head, head);
        assert_eq!(c.segs, make_segs(2, i as u64));
    }
    assert!(h.dev.pop_avail().is_none());

    let late = h.add(&make_segs(3, 9));
    assert_eq!(h.ring.unpublished(), 1);
    assert_eq!(h.dev.avail_idx(), 3);
    assert!(h.dev.pop_avail().is_none());
    h.ring.publish();
    assert_eq!(h.dev.avail_idx(), 4);
    assert_eq!(h.dev.pop_avail().unwrap().head, late);

    // Publishing nothing new changes nothing.
    h.ring.publish();
    assert_eq!(h.dev.avail_idx(), 4);
    assert_eq!(h.ring.unpublished(), 0);
}

#[test]
fn an_empty_request_is_refused() {
    let mut h = Harness::new(8, 4, true, false);
    assert_eq!(h.ring.add(&[]), None);
    assert_eq!(h.ring.num_free(), 8);
    assert_eq!(h.ring.unpublished(), 0);
}

// ---- chains ----

#[test]
fn a_direct_chain_reaches_the_device_intact() {
    let mut h = Harness::new(8, 0, false, false);
    let segs = make_segs(3, 5);
    let head = h.add(&segs);
    assert_eq!(h.ring.num_free(), 5);
    h.ring.publish();
    let c = h.dev.pop_avail().unwrap();
    assert_eq!(c.head, head);
    assert_eq!(c.indirect, None);
    assert_eq!(c.segs, segs);
    assert_eq!(c.table_descs, [0, 1, 2]);
    let flags: Vec<u16> = c.raw.iter().map(|d| d.flags).collect();
    assert_eq!(
        flags,
        [
            VIRTQ_DESC_F_NEXT,
            VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE,
            VIRTQ_DESC_F_WRITE
        ]
    );
    assert_eq!(c.raw[0].next, 1);
    assert_eq!(c.raw[1].next, 2);
}

#[test]
fn an_indirect_chain_reaches_the_device_intact() {
    let mut h = Harness::new(8, 4, true, false);
    let segs = make_segs(4, 7);
    let head = h.add(&segs);
    assert_eq!(
        h.ring.num_free(),
        7,
        "an indirect request takes one descriptor"
    );
    let other = h.add(&make_segs(2, 8));
    h.ring.publish();

    let c = h.dev.pop_avail().unwrap();
    assert_eq!(c.head, head);
    assert_eq!(c.table_descs, [head]);
    let table = h.base() + (h.layout.indirect + 16 * 4 * usize::from(head)) as u64;
    assert_eq!(c.indirect, Some((table, 4)));
    // The head itself: INDIRECT only (§2.7.5.3.1: no NEXT; WRITE means nothing here).
    let d = h.dev.read_desc(h.dev.desc, usize::from(head));
    assert_eq!(
        d,
        VirtqDesc {
            addr: table,
            len: 64,
            flags: VIRTQ_DESC_F_INDIRECT,
            next: 0
        }
    );
    assert_eq!(c.segs, segs);
    let links: Vec<(u16, u16)> = c.raw.iter().map(|d| (d.flags, d.next)).collect();
    assert_eq!(
        links,
        [
            (VIRTQ_DESC_F_NEXT, 1),
            (VIRTQ_DESC_F_NEXT, 2),
            (VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 3),
            (VIRTQ_DESC_F_WRITE, 0),
        ]
    );

    // The second request has its own table, past the first one's.
    let c2 = h.dev.pop_avail().unwrap();
    assert_eq!(c2.head, other);
    let (t2, n2) = c2.indirect.unwrap();
    assert_eq!(n2, 2);
    assert!(
        t2 >= table + 64 || t2 + 32 <= table,
        "indirect tables overlap"
    );
    assert_eq!(c2.segs, make_segs(2, 8));
}

#[test]
fn a_single_buffer_never_goes_indirect() {
    let mut h = Harness::new(8, 4, true, false);
    assert_eq!(h.ring.descriptors_for(1), 1);
    let segs = make_segs(1, 3);
    h.add(&segs);
    h.ring.publish();
    let c = h.dev.pop_avail().unwrap();
    assert_eq!(c.indirect, None);
    assert_eq!(c.segs, segs);
    assert_eq!(c.raw[0].flags, VIRTQ_DESC_F_WRITE);
}

#[test]
fn chains_longer_than_max_indirect_fall_back_to_direct() {
    let mut h = Harness::new(8, 4, true, false);
    assert_eq!(h.ring.max_segs(), 4);
    for n in 2..=4 {
        assert_eq!(h.ring.descriptors_for(n), 1, "{n} buffers");
    }
    for n in 5..=8 {
        assert_eq!(h.ring.descriptors_for(n), n as u16, "{n} buffers");
    }

    let exact = make_segs(4, 1);
    h.add(&exact);
    let long = make_segs(5, 2);
    let head = h.add(&long);
    assert_eq!(h.ring.num_free(), 8 - 1 - 5);
    h.ring.publish();
    let first = h.dev.pop_avail().unwrap();
    assert!(first.indirect.is_some());
    let c = h.dev.pop_avail().unwrap();
    assert_eq!(c.head, head);
    assert_eq!(c.indirect, None);
    assert_eq!(c.segs, long);
    assert_eq!(c.table_descs.len(), 5);
    for (d, next) in c.raw.iter().zip(&c.table_descs[1..]) {
        assert_ne!(d.flags & VIRTQ_DESC_F_NEXT, 0);
        assert_eq!(d.next, *next);
    }
    assert_eq!(c.raw[4].flags & VIRTQ_DESC_F_NEXT, 0);

    // Everything free again: a direct chain of the whole table fits, one more buffer not.
    h.dev.put_used(first.head.into(), 0);
    h.dev.put_used(c.head.into(), 0);
    h.dev.flush_used();
    assert_eq!(h.reap(), [first.head, c.head]);
    assert_eq!(h.ring.num_free(), 8);
    assert_eq!(h.ring.add(&make_segs(9, 3)), None);
    let whole = make_segs(8, 4);
    h.add(&whole);
    assert_eq!(h.ring.num_free(), 0);
    h.ring.publish();
    assert_eq!(h.dev.pop_avail().unwrap().segs, whole);
}

#[test]
fn indirect_needs_a_table_of_at_least_two() {
    for (indirect, mi) in [(true, 0), (true, 1), (false, 4)] {
        let mut h = Harness::new(8, mi, indirect, false);
        assert_eq!(h.ring.max_segs(), 8);
        assert_eq!(h.ring.descriptors_for(3), 3);
        let segs = make_segs(3, 0);
        h.add(&segs);
        assert_eq!(h.ring.num_free(), 5);
        h.ring.publish();
        let c = h.dev.pop_avail().unwrap();
        assert_eq!(c.indirect, None);
        assert_eq!(c.segs, segs);
    }
}

#[test]
fn a_request_of_more_buffers_than_u16_counts_is_refused() {
    // 65537 and 65538 buffers must not be mistaken for 1 and 2 descriptors.
    for (indirect, mi) in [(false, 0), (true, 4)] {
        let mut h = Harness::new(8, mi, indirect, false);
        for n in [usize::from(u16::MAX) + 2, usize::from(u16::MAX) + 3] {
            let segs = vec![make_segs(1, 0)[0]; n];
            assert!(h.ring.descriptors_for(n) > h.ring.size(), "{n} buffers");
            assert_eq!(h.ring.add(&segs), None, "{n} buffers");
            assert_eq!(h.ring.num_free(), 8);
            assert_eq!(h.ring.unpublished(), 0);
        }
    }
}

// ---- a full ring ----

#[test]
fn a_full_ring_of_direct_chains_refuses_then_makes_room() {
    let mut h = Harness::new(8, 0, false, false);
    let a = h.add(&make_segs(3, 0));
    let b = h.add(&make_segs(3, 1));
    assert_eq!(h.ring.num_free(), 2);
    let before = (h.ring.next_head(), h.ring.unpublished());
    assert_eq!(h.ring.add(&make_segs(3, 2)), None, "3 descriptors into 2");
    assert_eq!(h.ring.num_free(), 2);
    assert_eq!((h.ring.next_head(), h.ring.unpublished()), before);
    let c = h.add(&make_segs(2, 3));
    assert_eq!(h.ring.num_free(), 0);
    assert_eq!(h.ring.add(&make_segs(1, 4)), None);
    assert_eq!(h.ring.unpublished(), 3);

    h.ring.publish();
    let chains: Vec<Chain> = std::iter::from_fn(|| h.dev.pop_avail()).collect();
    assert_eq!(chains.iter().map(|c| c.head).collect::<Vec<_>>(), [a, b, c]);
    // Complete the middle one only.
    h.dev.put_used(b.into(), 0);
    h.dev.flush_used();
    assert_eq!(h.reap(), [b]);
    assert_eq!(h.ring.num_free(), 3);
    assert_eq!(h.ring.add(&make_segs(4, 5)), None);
    let d = h.add(&make_segs(3, 6));
    assert_eq!(d, b, "the freed chain is reused first");
    assert_eq!(h.ring.num_free(), 0);
    h.ring.publish();
    assert_eq!(h.dev.pop_avail().unwrap().segs, make_segs(3, 6));
}

#[test]
fn a_full_ring_of_indirect_requests_refuses_then_makes_room() {
    let mut h = Harness::new(8, 4, true, true);
    let heads: BTreeSet<u16> = (0..8).map(|i| h.add(&make_segs(3, i))).collect();
    assert_eq!(heads, (0..8).collect());
    assert_eq!(h.ring.num_free(), 0);
    assert_eq!(h.ring.add(&make_segs(3, 8)), None);
    assert_eq!(h.ring.add(&make_segs(1, 8)), None);

    h.ring.publish();
    let mut chains: Vec<Chain> = std::iter::from_fn(|| h.dev.pop_avail()).collect();
    assert_eq!(chains.len(), 8);
    let five = chains.swap_remove(5);
    h.dev.put_used(five.head.into(), 1);
    h.dev.flush_used();
    assert_eq!(h.reap(), [five.head]);
    assert_eq!(h.ring.num_free(), 1);
    assert_eq!(
        h.ring.add(&make_segs(5, 9)),
        None,
        "5 > max_indirect: 5 descriptors"
    );
    assert_eq!(h.ring.next_head(), five.head);
    assert_eq!(h.add(&make_segs(4, 10)), five.head);
    h.ring.publish();
    assert_eq!(h.dev.pop_avail().unwrap().segs, make_segs(4, 10));
}

// ---- many requests: wrap-around, random completion order ----

/// Push 70,000 requests through a ring of 8 so both 16-bit indices wrap, the device taking
/// everything published and completing a random subset in random order, in up to two
/// batches, sometimes asleep and sometimes busy; the driver sometimes armed for interrupts
/// and sometimes polling. Checks every head comes back once with its length, the
/// notification decisions on both sides, and that all descriptors return.
fn run_through_wraparound(indirect: bool, event_idx: bool, seed: u64) {
    const SIZE: u16 = 8;
    const REQUESTS: usize = 70_000;
    let mut h = Harness::new(SIZE, 4, indirect, event_idx);
    let mut rng = Rng(seed);
    let mut outstanding: HashMap<u16, Vec<Seg>> = HashMap::new();
    let mut held: Vec<Chain> = Vec::new();
    let (mut submitted, mut completed) = (0usize, 0usize);
    let mut per_head = [0usize; SIZE as usize];

    while completed < REQUESTS {
        let device_waits = rng.chance(50);
        if device_waits {
            h.dev.wait_for_kick();
        } else {
            h.dev.suppress_kicks();
        }

        let mut added = 0;
        for _ in 0..=rng.below(4) {
            if submitted == REQUESTS {
                break;
            }
            let segs = make_segs(1 + rng.below(4), submitted as u64);
            let need = h.ring.descriptors_for(segs.len());
            assert_eq!(need, expected_descs(segs.len(), indirect, 4));
            match h.ring.add(&segs) {
                Some(head) => {
                    assert!(
                        outstanding.insert(head, segs).is_none(),
                        "head {head} twice"
                    );
                    submitted += 1;
                    added += 1;
                }
                None => {
                    assert!(need > h.ring.num_free());
                    break;
                }
            }
        }
        assert_eq!(
            h.dev.avail_idx(),
            h.dev.last_avail,
            "visible before publish"
        );
        h.ring.publish();
        assert_eq!(h.dev.avail_idx(), submitted as u16);
        assert_eq!(
            h.ring.needs_kick(),
            device_waits && added > 0,
            "kick with the device {} after {added} new",
            if device_waits { "asleep" } else { "busy" }
        );

        while let Some(c) = h.dev.pop_avail() {
            assert_eq!(c.segs, outstanding[&c.head]);
            held.push(c);
        }
        rng.shuffle(&mut held);
        let done: Vec<Chain> = held.split_off(rng.below(held.len() + 1));

        let armed = rng.chance(50);
        if armed {
            assert!(!h.ring.enable_interrupts(), "nothing is waiting");
        }
        let split = rng.below(done.len() + 1);
        let mut interrupts = Vec::new();
        for batch in [&done[..split], &done[split..]] {
            if batch.is_empty() {
                continue;
            }
            for c in batch {
                h.dev.put_used(c.head.into(), written(&c.segs));
            }
            interrupts.push(h.dev.flush_used());
        }
        for (i, &irq) in interrupts.iter().enumerate() {
            // Armed with EVENT_IDX: one interrupt for the first batch, none for the second
            // until the driver re-arms. Armed without: every batch. Polling: none.
            let want = armed && (!event_idx || i == 0);
            assert_eq!(irq, want, "batch {i}, armed {armed}");
        }

        let mut reaped = 0;
        while let Some(r) = h.ring.pop_used() {
            let (head, len) = r.unwrap();
            let segs = outstanding.remove(&head).expect("head outstanding");
            assert_eq!(len, written(&segs));
            per_head[usize::from(head)] += 1;
            reaped += 1;
        }
        assert_eq!(reaped, done.len());
        completed += reaped;
        h.ring.disable_interrupts();

        let in_use: u16 = outstanding
            .values()
            .map(|s| expected_descs(s.len(), indirect, 4))
            .sum();
        assert_eq!(h.ring.num_free() + in_use, SIZE);
    }

    assert!(outstanding.is_empty() && held.is_empty());
    assert_eq!(submitted, REQUESTS);
    assert_eq!(h.ring.num_free(), SIZE);
    assert!(h.ring.is_idle());
    assert_eq!(h.ring.outstanding_heads().count(), 0);
    assert!(per_head.iter().all(|&n| n > 0), "{per_head:?}");
    // Both indices went around 0xffff -> 0 once.
    assert_eq!(h.dev.avail_idx(), (REQUESTS % 65536) as u16);
    assert_eq!(h.dev.used_idx_in_memory(), (REQUESTS % 65536) as u16);
}

#[test]
fn indices_wrap_direct_with_flags() {
    run_through_wraparound(false, false, 1);
}

#[test]
fn indices_wrap_direct_with_event_idx() {
    run_through_wraparound(false, true, 2);
}

#[test]
fn indices_wrap_indirect_with_flags() {
    run_through_wraparound(true, false, 3);
}

#[test]
fn indices_wrap_indirect_with_event_idx() {
    run_through_wraparound(true, true, 4);
}

/// Random adds, publishes, completions in random order and reaps; after every step the
/// free count plus the descriptors of outstanding chains is the table size, the device sees
/// each outstanding chain intact, and no descriptor belongs to two chains.
fn random_interleavings(indirect: bool, seed: u64) {
    const SIZE: u16 = 16;
    let mut h = Harness::new(SIZE, 4, indirect, false);
    let mut rng = Rng(seed);
    let mut model: HashMap<u16, (Vec<Seg>, u16)> = HashMap::new();
    let mut at_device: Vec<Chain> = Vec::new();
    let mut tag = 0u64;

    for step in 0..20_000 {
        match rng.below(10) {
            0..=4 => {
                let n = 1 + rng.below(6);
                let need = expected_descs(n, indirect, 4);
                assert_eq!(h.ring.descriptors_for(n), need);
                let before = (h.ring.num_free(), h.ring.next_head(), h.ring.unpublished());
                let segs = make_segs(n, tag);
                tag += 1;
                match h.ring.add(&segs) {
                    Some(head) => {
                        assert_eq!(head, before.1);
                        assert_eq!(h.ring.num_free(), before.0 - need);
                        assert!(model.insert(head, (segs, need)).is_none());
                    }
                    None => {
                        assert!(need > before.0, "step {step}: refused with room");
                        let after = (h.ring.num_free(), h.ring.next_head(), h.ring.unpublished());
                        assert_eq!(after, before, "a refused add changed the ring");
                    }
                }
            }
            5 => h.ring.publish(),
            6 | 7 => {
                while let Some(c) = h.dev.pop_avail() {
                    assert_eq!(c.segs, model[&c.head].0);
                    at_device.push(c);
                }
                if !at_device.is_empty() {
                    let c = at_device.swap_remove(rng.below(at_device.len()));
                    h.dev.put_used(c.head.into(), written(&c.segs));
                    h.dev.flush_used();
                }
            }
            _ => {
                while let Some(r) = h.ring.pop_used() {
                    let (head, len) = r.unwrap();
                    let (segs, _) = model.remove(&head).expect("head outstanding");
                    assert_eq!(len, written(&segs));
                }
            }
        }

        let in_use: u16 = model.values().map(|(_, n)| n).sum();
        assert_eq!(h.ring.num_free() + in_use, SIZE, "step {step}");
        assert_eq!(h.ring.is_idle(), model.is_empty());
        let heads: BTreeSet<u16> = h.ring.outstanding_heads().collect();
        assert_eq!(heads, model.keys().copied().collect(), "step {step}");
        let mut taken = BTreeSet::new();
        for (&head, (segs, need)) in &model {
            let c = h.dev.walk(head);
            assert_eq!(&c.segs, segs, "step {step}: head {head}");
            assert_eq!(c.table_descs.len(), usize::from(*need));
            for d in c.table_descs {
                assert!(taken.insert(d), "step {step}: descriptor {d} in two chains");
            }
        }
    }

    h.ring.publish();
    while let Some(c) = h.dev.pop_avail() {
        at_device.push(c);
    }
    for c in at_device {
        h.dev.put_used(c.head.into(), written(&c.segs));
    }
    h.dev.flush_used();
    for head in h.reap() {
        model.remove(&head).unwrap();
    }
    assert!(model.is_empty());
    assert_eq!(h.ring.num_free(), SIZE);

    // Nothing leaked: the whole table goes out again, one descriptor per request.
    let heads: BTreeSet<u16> = (0..SIZE).map(|i| h.add(&make_segs(1, i.into()))).collect();
    assert_eq!(heads, (0..SIZE).collect());
    assert_eq!(h.ring.add(&make_segs(1, 0)), None);
}

#[test]
fn random_interleavings_direct() {
    random_interleavings(false, 0x5eed);
}

#[test]
fn random_interleavings_indirect() {
    random_interleavings(true, 0xfeed);
}

// ---- EVENT_IDX math ----

#[test]
fn need_event_hand_computed() {
    // (event, new, old, whether old -> new steps over event)
    let cases = [
        (0, 1, 0, true),
        (1, 1, 0, false),
        (0, 0, 0, false),
        (5, 5, 5, false),
        (5, 10, 5, true),
        (9, 10, 5, true),
        (10, 10, 5, false),
        (4, 10, 5, false),
        (11, 10, 5, false),
        // Around the wrap.
        (0xfffe, 2, 0xfffe, true),
        (0xffff, 2, 0xfffe, true),
        (0, 2, 0xfffe, true),
        (1, 2, 0xfffe, true),
        (2, 2, 0xfffe, false),
        (0xfffd, 2, 0xfffe, false),
        (0xffff, 0, 0xffff, true),
        (0, 0, 0xffff, false),
        // A whole half of the index space at once.
        (0x7fff, 0x8000, 0, true),
        (0x8000, 0x8000, 0, false),
        // The disable_interrupts value is out of reach of small steps.
        (3 + 0x7fff, 5, 3, false),
        (0xfff0_u16.wrapping_add(0x7fff), 0x10, 0xfff0, false),
    ];
    for (event, new, old, want) in cases {
        assert_eq!(
            need_event(event, new, old),
            want,
            "need_event({event:#x}, {new:#x}, {old:#x})"
        );
        assert_eq!(
            passes(event, new, old),
            want,
            "passes({event:#x}, {new:#x}, {old:#x})"
        );
    }
}

#[test]
fn need_event_matches_counting_steps() {
    for (old, new) in [
        (0u16, 0u16),
        (0, 1),
        (0, 300),
        (0xff00, 0x0100),
        (0xffff, 0),
        (0x8000, 0x7fff),
    ] {
        for event in 0..=u16::MAX {
            assert_eq!(
                need_event(event, new, old),
                passes(event, new, old),
                "event {event:#x} old {old:#x} new {new:#x}"
            );
        }
    }
}

// ---- driver -> device notifications ----

#[test]
fn needs_kick_follows_avail_event() {
    let mut h = Harness::new(8, 0, false, true);
    assert_eq!(h.dev.avail_event(), 0);
    // The device waits at 0: the first entry passes it.
    h.add(&make_segs(1, 0));
    h.ring.publish();
    assert!(h.ring.needs_kick());
    assert!(!h.ring.needs_kick(), "nothing new since the last decision");
    h.complete_all();

    // The device wants a kick once entry 5 is published.
    h.dev.set_avail_event(5);
    h.add(&make_segs(1, 1));
    h.add(&make_segs(1, 2));
    h.ring.publish();
    assert!(!h.ring.needs_kick(), "1..3 does not reach 5");
    h.add(&make_segs(1, 3));
    h.ring.publish();
    h.add(&make_segs(1, 4));
    h.ring.publish();
    assert!(!h.ring.needs_kick(), "3..5 does not reach 5");
    h.add(&make_segs(1, 5));
    h.ring.publish();
    assert!(h.ring.needs_kick(), "5..6 publishes entry 5");
    h.complete_all();

    // Two publishes, one decision: the decision covers both.
    h.dev.set_avail_event(6);
    h.add(&make_segs(1, 6));
    h.ring.publish();
    h.add(&make_segs(1, 7));
    h.ring.publish();
    assert!(h.ring.needs_kick(), "6..8 covers 6");

    // With EVENT_IDX the used flags mean nothing (§2.7.10): avail_event decides alone.
    h.complete_all();
    h.dev.set_used_flags(VIRTQ_USED_F_NO_NOTIFY);
    h.dev.set_avail_event(8);
    h.add(&make_segs(1, 8));
    h.ring.publish();
    assert!(h.ring.needs_kick(), "NO_NOTIFY ignored with EVENT_IDX");
    h.dev.set_used_flags(0);
    h.dev.set_avail_event(8);
    h.add(&make_segs(1, 9));
    h.ring.publish();
    assert!(!h.ring.needs_kick(), "avail_event already behind");
}

#[test]
fn needs_kick_across_the_index_wrap() {
    let mut h = Harness::new(8, 0, false, true);
    h.advance(0xfffd);
    assert_eq!(h.dev.avail_idx(), 0xfffd);
    h.dev.set_avail_event(0xffff);
    for (tag, want) in [(0, false), (1, false), (2, true), (3, false)] {
        h.add(&make_segs(1, tag));
        h.ring.publish();
        assert_eq!(
            h.ring.needs_kick(),
            want,
            "publishing entry {:#x}",
            0xfffd + tag
        );
        h.complete_all();
    }
    assert_eq!(h.dev.avail_idx(), 1);
    h.dev.set_avail_event(2);
    for tag in 0..3 {
        h.add(&make_segs(1, tag));
    }
    h.ring.publish();
    assert!(h.ring.needs_kick(), "1..4 covers 2");
    h.complete_all();
    // The device waits at exactly the current index: the next entry wakes it.
    h.dev.wait_for_kick();
    h.add(&make_segs(1, 0));
    h.ring.publish();
    assert!(h.ring.needs_kick());
}

#[test]
fn needs_kick_without_event_idx_follows_no_notify() {
    let mut h = Harness::new(8, 0, false, false);
    h.add(&make_segs(1, 0));
    h.ring.publish();
    assert!(h.ring.needs_kick(), "flags 0: notify");
    assert!(!h.ring.needs_kick(), "nothing new");

    h.dev.set_used_flags(VIRTQ_USED_F_NO_NOTIFY);
    h.add(&make_segs(1, 1));
    h.ring.publish();
    assert!(!h.ring.needs_kick(), "NO_NOTIFY");

    // avail_event means nothing without EVENT_IDX.
    h.dev.set_used_flags(0);
    h.dev.set_avail_event(100);
    h.add(&make_segs(1, 2));
    h.ring.publish();
    assert!(h.ring.needs_kick(), "flags 0 again: notify");
}

// ---- device -> driver interrupts ----

#[test]
fn interrupts_with_event_idx() {
    let mut h = Harness::new(8, 0, false, true);
    for i in 0..4 {
        h.add(&make_segs(1, i));
    }
    h.ring.publish();
    let chains: Vec<Chain> = std::iter::from_fn(|| h.dev.pop_avail()).collect();

    // Polling (as created): the first completion does not interrupt.
    h.dev.put_used(chains[0].head.into(), 0);
    assert!(!h.dev.flush_used());
    assert_eq!(h.reap(), [chains[0].head]);

    // Armed with nothing waiting: used_event = last_used, and the next completion interrupts.
    assert!(!h.ring.enable_interrupts());
    assert_eq!(h.dev.used_event(), 1);
    assert_eq!(h.dev.avail_flags(), 0, "flags stay 0 with EVENT_IDX");
    h.dev.put_used(chains[1].head.into(), 0);
    assert!(h.dev.flush_used());
    // ... and only that one, until the driver re-arms.
    h.dev.put_used(chains[2].head.into(), 0);
    assert!(!h.dev.flush_used());

    // Arming with completions waiting says so, so the caller reaps instead of sleeping.
    assert!(h.ring.enable_interrupts());
    assert_eq!(h.dev.used_event(), 1);
    assert_eq!(h.reap(), [chains[1].head, chains[2].head]);

    h.ring.disable_interrupts();
    assert_eq!(h.dev.used_event(), 3u16.wrapping_add(0x7fff));
    h.dev.put_used(chains[3].head.into(), 0);
    assert!(!h.dev.flush_used());
    assert!(h.ring.enable_interrupts(), "one completion waiting");
    assert_eq!(h.reap(), [chains[3].head]);
    assert!(!h.ring.enable_interrupts());
    assert_eq!(h.dev.used_event(), 4);
}

#[test]
fn interrupts_with_event_idx_across_the_index_wrap() {
    let mut h = Harness::new(8, 0, false, true);
    h.advance(0xffff);
    h.add(&make_segs(1, 0));
    h.add(&make_segs(1, 1));
    h.ring.publish();
    let a = h.dev.pop_avail().unwrap();
    let b = h.dev.pop_avail().unwrap();
    assert!(!h.ring.enable_interrupts());
    assert_eq!(h.dev.used_event(), 0xffff);
    h.dev.put_used(a.head.into(), 0);
    h.dev.put_used(b.head.into(), 0);
    assert!(h.dev.flush_used(), "0xffff..1 covers 0xffff");
    assert_eq!(h.dev.used_idx_in_memory(), 1);
    assert_eq!(h.reap(), [a.head, b.head]);
    h.ring.disable_interrupts();
    assert_eq!(h.dev.used_event(), 0x8000);
}

#[test]
fn interrupts_without_event_idx_follow_no_interrupt() {
    let mut h = Harness::new(8, 0, false, false);
    for i in 0..4 {
        h.add(&make_segs(1, i));
    }
    h.ring.publish();
    let chains: Vec<Chain> = std::iter::from_fn(|| h.dev.pop_avail()).collect();

    assert_eq!(h.dev.avail_flags(), VIRTQ_AVAIL_F_NO_INTERRUPT);
    h.dev.put_used(chains[0].head.into(), 0);
    assert!(!h.dev.flush_used());
    assert_eq!(h.reap().len(), 1);

    assert!(!h.ring.enable_interrupts());
    assert_eq!(h.dev.avail_flags(), 0);
    for c in &chains[1..3] {
        h.dev.put_used(c.head.into(), 0);
        assert!(h.dev.flush_used(), "flags 0: every completion interrupts");
    }
    assert!(h.ring.enable_interrupts(), "two completions waiting");
    assert_eq!(h.reap().len(), 2);

    h.ring.disable_interrupts();
    assert_eq!(h.dev.avail_flags(), VIRTQ_AVAIL_F_NO_INTERRUPT);
    h.dev.put_used(chains[3].head.into(), 0);
    assert!(!h.dev.flush_used());
    assert_eq!(
        h.dev.used_event(),
        0,
        "used_event untouched without EVENT_IDX"
    );
}

// ---- a hostile device ----

#[test]
fn a_used_index_too_far_ahead_is_an_error() {
    let mut h = Harness::new(8, 0, false, false);
    let a = h.add(&make_segs(1, 0));
    let b = h.add(&make_segs(1, 1));
    h.ring.publish();
    h.dev.write_used_elem(0, a.into(), 0);
    h.dev.write_used_elem(1, b.into(), 0);
    h.dev.write_used_elem(2, a.into(), 0);
    h.dev.set_used_idx(3);
    let err = RingError::UsedIndex {
        used: 3,
        last: 0,
        outstanding: 2,
    };
    assert_eq!(h.ring.pop_used(), Some(Err(err)));
    assert_eq!(
        h.ring.pop_used(),
        Some(Err(err)),
        "still wrong, still an error"
    );
    assert_eq!(h.ring.num_free(), 6);
    // Behind last_used is a long way ahead.
    h.dev.set_used_idx(0xffff);
    assert!(matches!(
        h.ring.pop_used(),
        Some(Err(RingError::UsedIndex { used: 0xffff, .. }))
    ));
    // The truth is still accepted.
    h.dev.set_used_idx(2);
    assert_eq!(h.reap(), [a, b]);
    assert!(h.ring.is_idle());
}

#[test]
fn a_used_index_counts_requests_not_descriptors() {
    // Two requests of three descriptors each: three completions are one too many.
    let mut h = Harness::new(8, 0, false, false);
    let a = h.add(&make_segs(3, 0));
    let b = h.add(&make_segs(3, 1));
    h.ring.publish();
    h.dev.write_used_elem(0, a.into(), 0);
    h.dev.write_used_elem(1, b.into(), 0);
    h.dev.write_used_elem(2, b.into(), 0);
    h.dev.set_used_idx(3);
    assert_eq!(
        h.ring.pop_used(),
        Some(Err(RingError::UsedIndex {
            used: 3,
            last: 0,
            outstanding: 2
        }))
    );
    assert_eq!(h.ring.num_free(), 2);
}

#[test]
fn a_used_index_counts_only_published_requests() {
    let mut h = Harness::new(8, 4, true, true);
    let a = h.add(&make_segs(2, 0));
    h.ring.publish();
    let b = h.add(&make_segs(2, 1));
    h.dev.write_used_elem(0, a.into(), 0);
    h.dev.write_used_elem(1, b.into(), 0);
    h.dev.set_used_idx(2);
    assert_eq!(
        h.ring.pop_used(),
        Some(Err(RingError::UsedIndex {
            used: 2,
            last: 0,
            outstanding: 1
        }))
    );
    assert_eq!(h.ring.num_free(), 6);
}

#[test]
fn a_used_id_out_of_range_or_not_outstanding_is_an_error() {
    // Each case on a fresh ring with heads 0 and 1 outstanding and head 0 already returned
    // once: (id written, whether 0 was returned first).
    for (id, first_return_0) in [
        (8u32, false),
        (9, false),
        (0x1_0000, false),
        (u32::MAX, false),
        (5, false),
        (0, true),
    ] {
        let mut h = Harness::new(8, 0, false, false);
        h.add(&make_segs(1, 0));
        h.add(&make_segs(1, 1));
        h.add(&make_segs(1, 2));
        h.ring.publish();
        if first_return_0 {
            h.dev.put_used(0, 0);
            h.dev.flush_used();
            assert_eq!(h.reap(), [0]);
        }
        let free = h.ring.num_free();
        h.dev.put_used(id, 0);
        h.dev.flush_used();
        assert_eq!(
            h.ring.pop_used(),
            Some(Err(RingError::UsedId { id })),
            "id {id}"
        );
        assert_eq!(h.ring.num_free(), free, "id {id}");
        assert!(h.ring.outstanding_heads().all(|x| x != 5));
    }
}

#[test]
fn garbage_from_the_device_never_panics_or_leaks() {
    let mut h = Harness::new(8, 4, true, true);
    let mut rng = Rng(0xbad);
    let mut model: HashMap<u16, u16> = HashMap::new();
    for _ in 0..5_000 {
        for _ in 0..rng.below(3) {
            let n = 1 + rng.below(6);
            if let Some(head) = h.ring.add(&make_segs(n, 0)) {
                model.insert(head, expected_descs(n, true, 4));
            }
        }
        if rng.chance(70) {
            h.ring.publish();
        }
        // The device writes a few elements of anything and moves the index anywhere near.
        let last = h.dev.used_idx_in_memory();
        for k in 0..4u16 {
            let id = match rng.below(4) {
                0 => rng.next() as u32,
                _ => rng.below(10) as u32,
            };
            h.dev
                .write_used_elem(last.wrapping_add(k), id, rng.next() as u32);
        }
        let step = rng.below(12) as u16;
        h.dev.set_used_idx(last.wrapping_add(step).wrapping_sub(2));
        for _ in 0..16 {
            match h.ring.pop_used() {
                None | Some(Err(_)) => break,
                Some(Ok((head, _))) => {
                    assert!(model.remove(&head).is_some(), "head {head} not outstanding");
                }
            }
        }
        let in_use: u16 = model.values().sum();
        assert_eq!(h.ring.num_free() + in_use, 8);
        if rng.chance(5) {
            h.ring.reset_outstanding();
            model.clear();
            assert!(h.ring.is_idle());
        }
    }
}

// ---- outstanding heads ----

#[test]
fn outstanding_heads_and_reset() {
    let mut h = Harness::new(16, 4, false, false);
    let heads: Vec<u16> = [3, 1, 2, 4]
        .iter()
        .enumerate()
        .map(|(i, &n)| h.add(&make_segs(n, i as u64)))
        .collect();
    assert_eq!(h.ring.num_free(), 16 - 10);
    let out: BTreeSet<u16> = h.ring.outstanding_heads().collect();
    assert_eq!(out, heads.iter().copied().collect());

    h.ring.publish();
    let chains: Vec<Chain> = std::iter::from_fn(|| h.dev.pop_avail()).collect();
    h.dev.put_used(chains[1].head.into(), 0);
    h.dev.flush_used();
    assert_eq!(h.reap(), [heads[1]]);
    let out: BTreeSet<u16> = h.ring.outstanding_heads().collect();
    assert_eq!(out, [heads[0], heads[2], heads[3]].into_iter().collect());
    assert_eq!(h.ring.num_free(), 16 - 9);

    h.ring.reset_outstanding();
    assert_eq!(h.ring.outstanding_heads().count(), 0);
    assert_eq!(h.ring.num_free(), 16);
    assert!(h.ring.is_idle());
    // Every descriptor came back: the whole table goes out again.
    let all: BTreeSet<u16> = (0..16).map(|i| h.add(&make_segs(1, i))).collect();
    assert_eq!(all, (0..16).collect());
    assert_eq!(h.ring.add(&make_segs(1, 0)), None);
    h.ring.reset_outstanding();
    assert!(h.ring.is_idle());
}
