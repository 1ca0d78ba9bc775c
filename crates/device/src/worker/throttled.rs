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
        self.admit_as(dir, bytes, now, false)
    }

    /// [`Throttled::admit`] for a request just taken from its ring, that waits behind
    /// none of its direction. If the limiters hold it and this worker had nothing
    /// waiting, its disk counts as waiting from now (a member coming back is at most two
    /// quanta behind: the group's `set_waiting`), and a group it is behind in lets the
    /// request go at once ([`Limiter::wait_arriving`]); if it goes and nothing else
    /// waits, it stops waiting again. A request the limiters let go costs what it did
    /// (the group's members are looked at only for one that would wait).
    pub fn admit_arriving(&mut self, dir: Dir, bytes: u64, now: u64) -> u64 {
        let until = self.admit(dir, bytes, now);
        if until == 0 || self.waiting {
            return until;
        }
        self.set_waiting(true);
        let until = self.admit_as(dir, bytes, now, true);
        if until == 0 && self.parked.iter().all(VecDeque::is_empty) {
            self.set_waiting(false);
        }
        until
    }

    fn admit_as(&self, dir: Dir, bytes: u64, now: u64, arriving: bool) -> u64 {
        let mut until = 0;
        for (i, (l, member)) in self.setup.limiters.iter().enumerate() {
            until = until.max(if arriving && i >= self.setup.own {
                l.wait_arriving(dir, bytes, now, *member)
            } else {
                l.wait(dir, now)
            });
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

    /// Two disks in a group of 20 k IOPS on one simulated thread, over one second:
    /// disk b (member 0) always has requests waiting; disk a (member 1) runs at QD1, its
    /// next request arriving `round_trips[i]` µs (in turn) after the last one went. At
    /// each microsecond the thread looks at b first, then a (b wins every tie). The
    /// requests each got.
    fn qd1_beside_qd32(round_trips: &[u64]) -> [u32; 2] {
        let start = Instant::now();
        let group = limiter("iops-total=20000", start);
        group.set_members(2);
        let setup = |member| ThrottleSetup {
            limiters: vec![(group.clone(), member)],
            own: 0,
            stats: Arc::default(),
            group_stats: None,
        };
        let (mut a, mut b) = (Throttled::new(setup(1), 4), Throttled::new(setup(0), 4));
        b.park(Dir::Read, Parked { queue: 0, head: 0 });
        let us = 16_000;
        let t0 = ticks(start);
        // The bucket's first tenth of a second of credit goes before the count starts.
        let count_from = t0 + 200_000 * us;
        let (mut got, mut b_next, mut a_next, mut a_arrives, mut i) = ([0u32; 2], t0, 0, t0, 0);
        for step in 0..1_200_000u64 {
            let now = t0 + step * us;
            while now >= b_next {
                match b.admit(Dir::Read, 4096, now) {
                    0 => got[0] += u32::from(now >= count_from),
                    w => b_next = w,
                }
            }
            if now >= a_arrives && now >= a_next {
                let arriving = !a.queued(Dir::Read);
                let wait = if arriving {
                    a.admit_arriving(Dir::Read, 4096, now)
                } else {
                    a.admit(Dir::Read, 4096, now)
                };
                match wait {
                    0 => {
                        got[1] += u32::from(now >= count_from);
                        a.parked[0].clear();
                        a_arrives = now + round_trips[i % round_trips.len()] * us;
                        i += 1;
                    }
                    w => {
                        if arriving {
                            a.park(Dir::Read, Parked { queue: 0, head: 0 });
                        }
                        a_next = w;
                    }
                }
            }
            b.update_waiting(now);
            a.update_waiting(now);
        }
        got
    }

    fn share(got: [u32; 2]) -> f64 {
        f64::from(got[1]) / f64::from(got[0] + got[1])
    }

    /// A QD1 disk whose next request comes 120 µs after its last went (more than two
    /// slots of 50 µs) gets what its round trip allows, 1/120 µs of the 20 k: it goes
    /// at once when it is behind. It got a third: each request also waited for the
    /// group's next slot, so every round trip took three slots.
    #[test]
    fn a_qd1_disk_with_a_long_round_trip_gets_what_its_round_trip_allows() {
        let got = qd1_beside_qd32(&[120]);
        assert!(share(got) > 0.41, "the QD1 disk got {got:?}");
        // And no more than half when its round trip allows more.
        let got = qd1_beside_qd32(&[10]);
        assert!(
            (0.49..=0.51).contains(&share(got)),
            "the QD1 disk got {got:?}"
        );
    }

    /// A QD1 disk whose round trip is a slot and a half, and whose guest stalls for
    /// 1.5 ms every 100 requests (a vCPU descheduled; less than the two quanta a member
    /// coming back may be behind), wins back what the other disk took meanwhile. It got
    /// 44 %: taking every other slot, as fast as its round trip let it, it never caught
    /// up, and what it was behind beyond two quanta was forgiven at the next stall.
    #[test]
    fn a_qd1_disk_that_stalls_wins_its_stall_back() {
        let mut round_trips = vec![60; 99];
        round_trips.push(1500);
        let got = qd1_beside_qd32(&round_trips);
        assert!(share(got) > 0.485, "the QD1 disk got {got:?}");
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
