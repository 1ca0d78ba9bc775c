//! A hostile device: used indices and ids that the driver must refuse, and garbage that
//! must never panic or leak descriptors.

use std::collections::HashMap;

use super::sim::{make_segs, Harness};
use super::*;

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

/// The reap's prefetch pass reads ids before `pop_used` checks them: an id past the ring
/// must not be turned into an address (in a debug build, `at` asserts it stays inside the
/// area), and the pop still reports it.
#[test]
fn prefetching_used_entries_trusts_no_id() {
    for id in [8u32, 0x1_0000, u32::MAX] {
        let mut h = Harness::new(8, 4, true, false);
        h.add(&make_segs(3, 0));
        h.add(&make_segs(3, 1));
        h.ring.publish();
        h.dev.put_used(id, 0);
        h.dev.put_used(1, 0);
        h.dev.flush_used();
        h.ring.prefetch_used();
        assert_eq!(
            h.ring.pop_used(),
            Some(Err(RingError::UsedId { id })),
            "id {id}"
        );
    }
}
