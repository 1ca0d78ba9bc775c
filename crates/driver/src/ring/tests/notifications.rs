//! Notifications both ways: the EVENT_IDX arithmetic, driver -> device kicks and
//! device -> driver interrupts, with and without EVENT_IDX (§2.7.7, §2.7.10).

use super::sim::{
    make_segs, passes, Chain, Harness, VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_USED_F_NO_NOTIFY,
};
use super::*;

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
