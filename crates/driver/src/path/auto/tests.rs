//! `auto`'s decisions from given figures: choice, pooling, settling, restarts.

use super::round::*;
use super::*;

fn sig(reads: f64, size: f64, sequential: f64, depth: f64) -> Signature {
    Signature {
        reads,
        size,
        sequential,
        depth,
    }
}

fn trial(path: PathKind, iops: f64, cpu_us_per_io: f64) -> AutoTrial {
    AutoTrial {
        path,
        queue_depth: None,
        iops,
        cpu_us_per_io,
    }
}

#[test]
fn the_most_iops_win_and_cpu_breaks_ties_and_the_path_in_use_stays_among_equals() {
    use PathKind::{Batch, Bio, Request};
    let t = [
        trial(Bio, 1.00e6, 0.5),
        trial(Batch, 1.10e6, 0.6),
        trial(Request, 0.90e6, 0.4),
    ];
    assert_eq!(choose(&t, None), (1, false));
    let t = [
        trial(Bio, 1.00e6, 0.5),
        trial(Batch, 1.02e6, 0.6),
        trial(Request, 0.90e6, 0.4),
    ];
    assert_eq!(choose(&t, None), (0, false), "within 3 %: less CPU");
    assert_eq!(choose(&t, Some(1)), (1, true), "in use and tied: kept");
    assert_eq!(choose(&t, Some(2)), (0, false), "in use but 12 % behind");
}

#[test]
fn a_round_pools_every_queues_slots_and_one_queue_decides_it() {
    let disk = AutoDisk::new();
    assert!(disk.trials().is_empty());
    disk.begin(Duration::ZERO);
    let start = disk.start.load(Ordering::Acquire);
    assert!(start < CLAIMED);
    let round = disk.round.load(Ordering::Acquire);
    assert_eq!(round, 1);
    assert_eq!(disk.steps(), STEPS, "short slots: three passes");
    disk.begin(Duration::ZERO);
    assert_eq!(disk.round.load(Ordering::Acquire), 1, "one round at a time");
    // Two queues, in the first eight slots (bio, batch, request, shallow request,
    // shallow request, request, batch, bio; nothing in the others), each measuring
    // 20 ms of its slot. Queue A alone would see batch ahead (it got the CPU in
    // batch's slots); the disk's totals favour bio.
    let per_queue = [
        [10_000, 30_000, 5_000, 1_000, 1_000, 5_000, 30_000, 10_000],
        [50_000, 10_000, 20_000, 2_000, 2_000, 20_000, 10_000, 50_000],
    ];
    let busy = ns(Duration::from_millis(20));
    for q in per_queue {
        for (k, ios) in q.into_iter().enumerate() {
            disk.add(round, k, ios, ios * 500, busy);
        }
    }
    disk.add(round + 1, 0, 1_000_000, 0, busy);
    assert!(disk.decide(start));
    assert!(!disk.decide(start), "decided once");
    assert_eq!(disk.decided.load(Ordering::Acquire), 1);
    assert_eq!(disk.pick.load(Ordering::Acquire), 0, "bio");
    let t = disk.trials();
    assert_eq!(t.len(), CANDIDATES.len());
    // A path's IOPS: the mean over its measured slots of each queue's rate over the
    // time it measured, summed over the queues.
    assert_eq!(t[0].path, PathKind::Bio);
    assert!((t[0].iops - 60_000.0 / 0.020).abs() < 1.0, "{t:?}");
    assert!((t[1].iops - 40_000.0 / 0.020).abs() < 1.0, "{t:?}");
    assert!((t[3].iops - 3_000.0 / 0.020).abs() < 1.0, "{t:?}");
    assert_eq!(
        (t[2].queue_depth, t[3].queue_depth),
        (None, Some(ROTATIONAL_DEPTH))
    );
    assert!((t[0].cpu_us_per_io - 0.5).abs() < 1e-9, "{t:?}");
    assert_eq!(disk.start.load(Ordering::Acquire), IDLE);
    // Nothing is added between rounds.
    disk.add(round, 0, 5, 5, 5);
    assert_eq!(disk.ios[0].get(), 60_000);
    // The next round starts from zero and keeps bio while it stays among the best.
    disk.begin(Duration::ZERO);
    let start = disk.start.load(Ordering::Acquire);
    for k in 0..STEPS {
        disk.add(2, k, 100_000, 1, busy);
    }
    assert!(disk.decide(start));
    assert_eq!(disk.pick.load(Ordering::Acquire), 0);
    assert_eq!(disk.recheck.load(Ordering::Relaxed), ns(RECHECK) * 2);
}

#[test]
fn a_slow_settling_round_is_run_again_at_once_with_slots_that_measure_it() {
    // A slow disk: the shallow candidate's slot spends 450 ms draining what the deep
    // one left on the ring. The queue that saw it starts the round again at once, with
    // slots three times as long, one pass of them; the recheck, and a round for a changed
    // workload, wait eight rounds' time at least.
    let disk = AutoDisk::new();
    disk.begin(Duration::ZERO);
    let start = disk.start.load(Ordering::Acquire);
    disk.settled_in(1, ns(Duration::from_millis(450)));
    assert!(!disk.decide(start), "the old round is gone");
    assert_eq!(disk.decided.load(Ordering::Acquire), 0);
    assert_eq!(disk.round.load(Ordering::Acquire), 2);
    assert_eq!(
        disk.slot.load(Ordering::Relaxed),
        ns(Duration::from_millis(1350))
    );
    assert_eq!(disk.steps(), LONG_STEPS);
    assert_eq!(disk.settle_ns.get(), 0, "measured anew");
    // The shallow request path completes 1.75x the others' I/Os in the time measured.
    let start = disk.start.load(Ordering::Acquire);
    let busy = ns(Duration::from_millis(900));
    for k in 0..LONG_STEPS {
        let ios = if CANDIDATES[SCHEDULE[k]].shallow {
            112
        } else {
            64
        };
        disk.add(2, k, ios, 1000 * ios, busy);
    }
    disk.settled_in(2, ns(Duration::from_millis(440)));
    let before = disk.now();
    assert!(disk.decide(start));
    assert_eq!(disk.pick.load(Ordering::Acquire), 3, "{:?}", disk.trials());
    let round = ns(Duration::from_millis(1350)) * LONG_STEPS as u64;
    assert!(disk.recheck_at.load(Ordering::Relaxed) >= before + RECHECK_ROUNDS * round);
    assert!(disk.quiet_until.load(Ordering::Relaxed) >= before + RECHECK_ROUNDS * round);
    // A measurement over less than a quarter of a slot is left out.
    disk.begin(Duration::ZERO);
    disk.add(3, 0, 1000, 1, ns(Duration::from_millis(100)));
    assert_eq!(disk.ios[0].get(), 0);
    // At the longest slot, a round is decided however long it took to settle.
    let disk = AutoDisk::new();
    disk.slot.store(ns(SLOT_MAX), Ordering::Relaxed);
    disk.begin(Duration::ZERO);
    disk.settled_in(1, ns(SLOT_MAX));
    assert!(disk.decide(disk.start.load(Ordering::Acquire)));
}

#[test]
fn a_round_left_undecided_is_measured_again_not_decided_on_stale_counts() {
    let disk = AutoDisk::new();
    disk.begin(Duration::ZERO);
    let start = disk.start.load(Ordering::Acquire);
    disk.add(1, 0, 500, 1, ns(SLOT));
    // Nobody followed the round until long after its end: it starts over, with
    // slots twice as long each time (a load too sparse for them), up to SLOT_MAX.
    disk.restart(start);
    assert_eq!(disk.round.load(Ordering::Acquire), 2);
    assert_eq!(disk.slot.load(Ordering::Relaxed), ns(SLOT) * 2);
    assert!(disk.start.load(Ordering::Acquire) < CLAIMED);
    assert_eq!(disk.ios[0].get(), 0, "counts start from zero");
    assert!(
        !disk.decide(start),
        "the old round cannot be decided any more"
    );
    assert_eq!(disk.decided.load(Ordering::Acquire), 0);
    for _ in 0..8 {
        disk.restart(disk.start.load(Ordering::Acquire));
    }
    assert_eq!(disk.slot.load(Ordering::Relaxed), ns(SLOT_MAX));
    // A stale caller (the round already restarted) changes nothing.
    disk.restart(start);
    assert_eq!(disk.round.load(Ordering::Acquire), 10);
}

#[test]
fn a_count_for_an_earlier_round_never_lands_in_the_next() {
    let disk = AutoDisk::new();
    disk.begin(Duration::ZERO);
    let start = disk.start.load(Ordering::Acquire);
    disk.ios[3].add(1, 700);
    // A queue checked round 1 and was preempted; meanwhile round 1 restarts as 2.
    disk.restart(start);
    disk.ios[3].add(1, 500);
    disk.cpu_ns[3].add(1, 500);
    assert_eq!((disk.ios[3].get(), disk.cpu_ns[3].get()), (0, 0));
    disk.ios[3].add(2, 9);
    assert_eq!(disk.ios[3].get(), 9);
    disk.ios[3].add(2, u64::MAX);
    assert_eq!(disk.ios[3].get(), TALLY_SUM, "saturates below the tag");
    disk.ios[3].add(2, 1);
    assert_eq!(disk.ios[3].get(), TALLY_SUM, "and keeps its round");
}

#[test]
fn a_workload_on_a_buckets_edge_is_the_same_workload() {
    let qd32 = sig(1.0, 4096.0, 1.0, 32.0);
    assert!(!qd32.differs(&sig(1.0, 4096.0, 1.0, 31.2)));
    assert!(!qd32.differs(&sig(0.9, 4096.0, 0.95, 20.0)));
    assert!(qd32.differs(&sig(1.0, 4096.0, 1.0, 8.0)), "depth 4x lower");
    assert!(
        qd32.differs(&sig(1.0, 65536.0, 1.0, 32.0)),
        "16x larger I/O"
    );
    assert!(qd32.differs(&sig(0.5, 4096.0, 1.0, 32.0)), "half writes");
    assert!(qd32.differs(&sig(1.0, 4096.0, 0.0, 32.0)), "random");
    assert!(!Signature::default().differs(&Signature::default()));
}
