//! The driver side of the split ring against a simulated device ([`sim`]).
//!
//! Tests by theme: layout, publishing, chains, a full ring and outstanding heads here;
//! [`wraparound`] (many requests, both indices wrapping, random orders), [`notifications`]
//! (EVENT_IDX math, kicks and interrupts in both directions) and [`hostile`] (what a lying
//! device gets back).

mod hostile;
mod notifications;
mod sim;
mod wraparound;

use std::collections::BTreeSet;

use super::*;
use sim::{
    make_segs, Chain, Harness, VirtqDesc, VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE,
};

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
