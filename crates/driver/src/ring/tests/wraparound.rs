//! Many requests: both 16-bit indices wrapping, random completion orders, random
//! interleavings of adds, publishes, completions and reaps.

use std::collections::{BTreeSet, HashMap};

use super::sim::{make_segs, written, Chain, Harness};
use super::*;

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
