//! A worker's part in QoS: the limiters of its disk (its own limits, its group's), and the
//! requests that wait for them, per direction in arrival order (a request never overtakes
//! an earlier one of its direction; a read may pass a waiting write, as in QEMU).
//!
//! A waiting request has been taken from its ring and checked, and holds its slot (it
//! counts as in flight: a ring stop waits for it); it goes to the engine once every
//! limiter lets it, or at once when its queue stops serving (a stop, a reset, a broken
//! ring: QEMU's drains bypass limits too). A worker with no limiter holds none of this:
//! an unlimited disk pays one branch per request.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::throttle::{Dir, Limiter, LimiterStats};

/// What a worker is given to throttle its requests.
#[derive(Clone, Debug)]
pub(crate) struct ThrottleSetup {
    /// Each limiter, and the member index of this worker's disk in it: the disk's own
    /// first (the first `own` of them), then its group's.
    pub limiters: Vec<(Arc<Limiter>, usize)>,
    /// How many of `limiters` are the disk's own (0 or 1).
    pub own: usize,
    /// The disk's throttling counters.
    pub stats: Arc<LimiterStats>,
    /// The group's, when the disk is in one.
    pub group_stats: Option<Arc<LimiterStats>>,
}

/// A request waiting for the limiters.
#[derive(Clone, Copy, Debug)]
pub(super) struct Parked {
    pub queue: usize,
    pub head: u16,
}

/// How soon a member that let another go first looks again, ticks (50 µs).
const YIELD_TICKS: u64 = 50 * 16_000;

pub(super) struct Throttled {
    setup: ThrottleSetup,
    /// By [`Dir`].
    pub parked: [VecDeque<Parked>; 2],
    /// Whether this worker told its limiters it has requests waiting.
    waiting: bool,
}

impl Throttled {
    /// Room for `depth` waiting requests per direction: parking never allocates.
    pub fn new(setup: ThrottleSetup, depth: usize) -> Throttled {
        Throttled {
            setup,
            parked: [
                VecDeque::with_capacity(depth),
                VecDeque::with_capacity(depth),
            ],
            waiting: false,
        }
    }

    /// New limiters (a change of limits; none: unlimited). Waiting requests stay in
    /// order and are looked at again under the new limits.
    pub fn replace(&mut self, setup: Option<ThrottleSetup>) {
        self.set_waiting(false);
        match setup {
            Some(s) => self.setup = s,
            None => {
                self.setup.limiters.clear();
                self.setup.own = 0;
            }
        }
        // Whether it waits for the new limiters is looked at by the next pass.
    }

    /// No limiter and nothing waiting: the worker can drop this.
    pub fn idle(&self) -> bool {
        self.setup.limiters.is_empty() && self.parked.iter().all(VecDeque::is_empty)
    }

    /// Whether a request of `bytes` going `dir` may go at `now` (ticks): if so it is
    /// counted and 0 returned; else the tick to look again at.
    pub fn admit(&self, dir: Dir, bytes: u64, now: u64) -> u64 {
        let mut until = 0;
        for (l, member) in &self.setup.limiters {
            until = until.max(l.wait(dir, now));
            if !l.may_go(*member) {
                until = until.max(now + YIELD_TICKS);
            }
        }
        if until > 0 {
            return until;
        }
        for (l, member) in &self.setup.limiters {
            l.charge(dir, bytes, now, *member);
        }
        0
    }

    /// Whether requests of `dir` wait already (a new one goes behind them).
    pub fn queued(&self, dir: Dir) -> bool {
        !self.parked[dir as usize].is_empty()
    }

    /// A request waits.
    pub fn park(&mut self, dir: Dir, p: Parked) {
        self.parked[dir as usize].push_back(p);
    }

    /// A request that waited `waited` went.
    pub fn waited(&self, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        for s in std::iter::once(&self.setup.stats).chain(&self.setup.group_stats) {
            s.delayed.fetch_add(1, Ordering::Relaxed);
            s.wait_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// Tell the limiters whether this worker has requests waiting for them at `now`
    /// (ticks), for fairness in groups: a direction's first waiting request that the
    /// disk's own limits would let go. One that its own limits hold does not wait for the
    /// group: counted as waiting, a disk capped by its own limit would hold every other
    /// member of its group to its pace (each may be at most a quantum ahead of a waiting
    /// member), where the group's credit it cannot use belongs to the others.
    pub fn update_waiting(&mut self, now: u64) {
        let own = &self.setup.limiters[..self.setup.own.min(self.setup.limiters.len())];
        let waiting = [Dir::Read, Dir::Write].into_iter().any(|dir| {
            !self.parked[dir as usize].is_empty() && own.iter().all(|(l, _)| l.wait(dir, now) == 0)
        });
        self.set_waiting(waiting);
    }

    fn set_waiting(&mut self, waiting: bool) {
        if waiting == self.waiting {
            return;
        }
        self.waiting = waiting;
        for (l, member) in &self.setup.limiters {
            l.set_waiting(*member, waiting);
        }
    }
}

impl Drop for Throttled {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::throttle::{ticks, Limits};

    fn limiter(limits: &str, now: Instant) -> Arc<Limiter> {
        let l = Limits::parse(limits).unwrap();
        Arc::new(Limiter::new(&l, now, Arc::default()))
    }

    /// A disk whose own limit holds its waiting requests does not wait for its group: the
    /// group's other member goes on however far ahead it is. Once its own limit lets its
    /// next request go, it waits for the group, and the member ahead lets it go first.
    #[test]
    fn a_disk_held_by_its_own_limit_does_not_hold_its_group() {
        let start = Instant::now();
        let own = limiter("iops-total=1", start);
        let group = limiter("iops-total=1000", start);
        group.set_members(2);
        let setup = ThrottleSetup {
            limiters: vec![(own, 0), (group.clone(), 0)],
            own: 1,
            stats: Arc::default(),
            group_stats: None,
        };
        let mut t = Throttled::new(setup, 4);
        let now = ticks(start);
        assert_eq!(t.admit(Dir::Read, 4096, now), 0, "the first request goes");
        assert_ne!(
            t.admit(Dir::Read, 4096, now),
            0,
            "its own limit holds the next"
        );
        t.park(Dir::Read, Parked { queue: 0, head: 1 });
        // The other member takes 100 ms of the group's time.
        for _ in 0..100 {
            group.charge(Dir::Read, 4096, now, 1);
        }
        t.update_waiting(now);
        assert!(
            group.may_go(1),
            "a member held by its own limit made the group wait for it"
        );
        // A second later its own limit lets the request go: now it waits for the group.
        let later = ticks(start + Duration::from_secs(1));
        t.update_waiting(later);
        assert!(
            !group.may_go(1),
            "a member that waits for the group only is not served first"
        );
        assert!(group.may_go(0));
    }
}
