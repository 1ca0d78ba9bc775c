//! QoS in the worker: requests over the limit wait in order, holding their slots; a stop,
//! a change of limits and the end of all limits let them go; a limit on writes does not
//! hold reads.

use std::sync::Arc;
use std::time::Instant;

use super::rings::{read_batch, step};
use super::*;
use crate::throttle::{Limiter, Limits};
use crate::worker::ThrottleSetup;

/// `limits` for the rig's disk, as a change of limits tells a running worker.
fn limit(rig: &mut Rig, limits: &str) {
    let l = Limits::parse(limits).unwrap();
    let setup = (!l.is_unlimited()).then(|| {
        Box::new(ThrottleSetup {
            limiters: vec![(
                Arc::new(Limiter::new(&l, Instant::now(), Arc::default())),
                0,
            )],
            own: 1,
            stats: Arc::default(),
            group_stats: None,
        })
    });
    Worker::post(&rig.mailbox, Command::Throttle(setup));
    rig.worker.step();
}

/// One request per second: the bucket (a tenth of a second of the rate) lets the first
/// go at once and holds the second for the next second.
#[test]
fn requests_over_the_limit_wait_holding_their_slots() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    limit(&mut rig, "iops-total=1");
    read_batch(&mut rig, 3);
    step(&mut rig, 5);
    assert_eq!(rig.used_idx(), 1, "one request went, two wait");
    assert_eq!(
        rig.worker.in_flight(),
        2,
        "the waiting ones hold their slots"
    );
    // The limit lifts: they go, in order.
    limit(&mut rig, "none");
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 3);
    assert_eq!(
        rig.used_elem(1).0,
        3,
        "the second request (head 3) went next"
    );
    assert_eq!(rig.used_elem(2).0, 6);
    assert_eq!(rig.worker.in_flight(), 0);
}

/// Stopping a ring (a reset, a migration, a shutdown) does not wait out the limits.
#[test]
fn a_stop_lets_waiting_requests_go_at_once() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    limit(&mut rig, "iops-total=1");
    read_batch(&mut rig, 4);
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 1);
    let t0 = Instant::now();
    assert_eq!(rig.stop(), 4, "the stop answers after every request");
    assert!(t0.elapsed() < std::time::Duration::from_secs(1));
    assert_eq!(rig.used_idx(), 4, "all four completed, none dropped");
}

/// A new limit applies to the requests already waiting: a looser one lets them go.
#[test]
fn a_change_of_limits_applies_to_waiting_requests() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    limit(&mut rig, "iops-total=1");
    read_batch(&mut rig, 3);
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 1);
    limit(&mut rig, "iops-total=1000000");
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 3);
}

/// A write limit holds writes only: reads are not counted against it.
#[test]
fn a_write_limit_does_not_hold_reads() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    limit(&mut rig, "iops-write=1");
    read_batch(&mut rig, 3);
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 3, "reads are not limited");
    assert_eq!(rig.worker.in_flight(), 0);
}
