//! QoS: a disk's limits and a group's, held by every worker that serves a member disk.
//!
//! QEMU's leaky bucket (util/throttle.c) is, exactly, the generic cell rate algorithm:
//! a bucket's level is how far its *theoretical arrival time* (TAT) runs ahead of now,
//! times the rate. A request is admitted while `TAT - now <= tau` (QEMU: while the level
//! is at most the bucket size, checked before the request is counted), and then pushes
//! TAT by its cost, `units / rate`. `tau` is the bucket size over the rate: a tenth of a
//! second of the rate without `-max` (QEMU's `avg/10`), `max * max-length / avg` seconds
//! with it; with `-max-length` above 1 a second bucket holds the burst to the `-max` rate
//! (a tenth of a second of it as tolerance), as QEMU's `burst_level` does.
//!
//! Held as one `AtomicU64` per bucket, in ticks of 1/16 ns since a process-wide epoch (36
//! years before it wraps), the state needs no lock: a worker reads each bucket it must
//! pass, and charges them with compare-and-swap. No credit is lost to rounding (a
//! request's cost is rounded up to the tick, 1/16 ns) and none to timer lateness (a late
//! wake finds the credit that accrued). Two workers that check at once may both pass a
//! bucket that had room for one: each request they admit was conforming when checked,
//! and the overshoot is paid back by later requests (QEMU's bucket admits a request
//! larger than its room the same way).
//!
//! Members of a group are served fairly while more than one waits (QEMU serves them
//! round-robin): each member's `served` counts the group time its requests took; one that
//! is more than [`QUANTUM`] ahead of another waiting member lets it go first. A member
//! that starts waiting starts at most two quanta behind the least-served waiting member
//! (or, when none waits, the most-served member), so an idle spell earns no more credit
//! than that. (It started level: a disk at QD1,
//! which stops waiting between each request and the next, lost what it was behind at
//! every request, and a QD32 disk beside it took three slots in four. Then it started at
//! most one quantum behind, exactly where it would begin to go first: each slot a QD1
//! disk missed in a round trip longer than a slot was forgiven when it came back, and it
//! got a third of the group when every round trip missed one.) A request that comes to a
//! member with nothing waiting, while the member is behind another that waits, goes at
//! once, as far as its own cost beyond the buckets' tolerance ([`Limiter::wait_arriving`]):
//! a disk that waits on each completion would otherwise add a slot's wait to every round
//! trip, which a disk with requests always waiting never pays.

pub mod limits;

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use limits::Limits;
use limits::{Scope, Unit, BUCKETS};

/// Ticks per second (1/16 ns).
const TICKS_PER_SEC: u128 = 16_000_000_000;
/// How far one member of a group may run ahead of another that waits, in group time.
pub const QUANTUM: Duration = Duration::from_millis(1);
/// Most members (disks) of one group.
pub const MAX_MEMBERS: usize = 128;

/// The instant ticks count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `t` in ticks since the epoch.
pub fn ticks(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos() * 16).unwrap_or(u64::MAX)
}

/// Nanoseconds in `ticks` (a difference of two [`ticks`]).
pub fn ticks_to_ns(ticks: u64) -> u64 {
    ticks / 16
}

/// The instant of `ticks`.
pub fn instant(ticks: u64) -> Instant {
    epoch() + Duration::from_nanos(ticks / 16)
}

fn ticks_of(d: Duration) -> u64 {
    u64::try_from(d.as_nanos() * 16).unwrap_or(u64::MAX)
}

/// Which way a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// A read.
    Read = 0,
    /// A write, discard or write-zeroes.
    Write = 1,
}

#[derive(Debug, Default)]
#[repr(align(64))]
struct Padded(AtomicU64);

/// A rate and its tolerance, and its TAT.
#[derive(Debug)]
struct Rate {
    /// Units per second.
    rate: u64,
    /// How far TAT may run ahead of now, ticks.
    tau: u64,
    tat: Padded,
}

impl Rate {
    fn new(rate: u64, tau: u64, now: u64) -> Rate {
        Rate {
            rate,
            tau,
            tat: Padded(AtomicU64::new(now)),
        }
    }

    /// The cost of `num / den` units, ticks, rounded up.
    fn cost(&self, num: u64, den: u64) -> u64 {
        let t = (u128::from(num) * TICKS_PER_SEC).div_ceil(u128::from(den) * u128::from(self.rate));
        u64::try_from(t).unwrap_or(u64::MAX)
    }

    /// Zero if a request may go at `now` with `slack` ticks of tolerance beyond `tau`,
    /// else when it may.
    fn wait(&self, now: u64, slack: u64) -> u64 {
        let tat = self.tat.0.load(Ordering::Acquire);
        let tau = self.tau.saturating_add(slack);
        if tat > now.saturating_add(tau) {
            tat - tau
        } else {
            0
        }
    }

    fn charge(&self, now: u64, cost: u64) {
        let _ = self
            .tat
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tat| {
                Some(tat.max(now).saturating_add(cost))
            });
    }
}

#[derive(Debug)]
struct Bucket {
    unit: Unit,
    scope: Scope,
    main: Rate,
    /// With `-max-length` above 1: the burst held to the `-max` rate.
    burst: Option<Rate>,
}

impl Bucket {
    fn applies(&self, dir: Dir) -> bool {
        match self.scope {
            Scope::Total => true,
            Scope::Read => dir == Dir::Read,
            Scope::Write => dir == Dir::Write,
        }
    }

    /// A request of `bytes` in this bucket's units: (numerator, denominator).
    fn units(&self, bytes: u64, op_size: u64) -> (u64, u64) {
        match self.unit {
            Unit::Bytes => (bytes, 1),
            // QEMU: a request larger than iops-size counts as size / iops-size requests
            // (fractional), a smaller one as one.
            Unit::Ops if op_size != 0 && bytes > op_size => (bytes, op_size),
            Unit::Ops => (1, 1),
        }
    }
}

/// One member's share of a group.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Share {
    /// Group time its requests took, ticks.
    served: AtomicU64,
    /// Its workers that have requests waiting.
    waiting: AtomicU32,
}

/// Counters of a limiter (a disk's or a group's).
#[derive(Debug)]
pub struct LimiterStats {
    /// Requests that waited.
    pub delayed: AtomicU64,
    /// Their waits, ns, summed.
    pub wait_ns: AtomicU64,
    /// A group's, by member: the group time, ns, each member was behind beyond the two
    /// quanta it may be when it started waiting, which it gave up (it had nothing
    /// waiting meanwhile: an idle disk, or a guest slower than its share).
    pub forfeited_ns: [AtomicU64; MAX_MEMBERS],
}

impl Default for LimiterStats {
    fn default() -> LimiterStats {
        LimiterStats {
            delayed: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            forfeited_ns: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// The limits of a disk or a group, in force from when it was made (a change makes a new
/// one: the buckets start empty, as QEMU's do on every change).
#[derive(Debug)]
pub struct Limiter {
    limits: Limits,
    buckets: Vec<Bucket>,
    op_size: u64,
    shares: Box<[Share]>,
    /// Members that exist (indices below this).
    members: AtomicUsize,
    quantum: u64,
    /// Its counters (kept across changes of its limits by whoever made it).
    pub stats: std::sync::Arc<LimiterStats>,
}

impl Limiter {
    /// A limiter for `limits` (checked, not unlimited), its buckets empty at `now`.
    pub fn new(limits: &Limits, now: Instant, stats: std::sync::Arc<LimiterStats>) -> Limiter {
        let t = ticks(now);
        let sec = ticks_of(Duration::from_secs(1));
        let tenth = sec / 10;
        let buckets = BUCKETS
            .iter()
            .zip(&limits.buckets)
            .filter(|(_, b)| b.avg != 0)
            .map(|(&(unit, scope), b)| {
                // QEMU: the bucket holds avg/10 without -max, max * max-length with it.
                let tau = if b.max == 0 {
                    tenth
                } else {
                    let t = u128::from(b.max) * u128::from(b.max_length) * u128::from(sec)
                        / u128::from(b.avg);
                    u64::try_from(t).unwrap_or(u64::MAX)
                };
                let burst = (b.max != 0 && b.max_length > 1).then(|| Rate::new(b.max, tenth, t));
                Bucket {
                    unit,
                    scope,
                    main: Rate::new(b.avg, tau, t),
                    burst,
                }
            })
            .collect();
        Limiter {
            limits: limits.clone(),
            buckets,
            op_size: limits.iops_size,
            shares: (0..MAX_MEMBERS).map(|_| Share::default()).collect(),
            members: AtomicUsize::new(1),
            quantum: ticks_of(QUANTUM),
            stats,
        }
    }

    /// Its limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Members 0..n exist (a group's disks).
    pub fn set_members(&self, n: usize) {
        self.members
            .store(n.clamp(1, MAX_MEMBERS), Ordering::Release);
    }

    /// Zero if a request going `dir` may go at `now` (ticks), else when it may (ticks).
    /// Changes nothing. (As in QEMU, a bucket is checked before the request is counted:
    /// its size does not matter here.)
    pub fn wait(&self, dir: Dir, now: u64) -> u64 {
        self.wait_beyond(dir, now, None)
    }

    /// [`Limiter::wait`] with each bucket's tolerance stretched by the cost of a request
    /// of `beyond` bytes (none: not stretched).
    fn wait_beyond(&self, dir: Dir, now: u64, beyond: Option<u64>) -> u64 {
        let mut until = 0;
        for b in self.buckets.iter().filter(|b| b.applies(dir)) {
            let units = beyond.map(|bytes| b.units(bytes, self.op_size));
            let slack = |r: &Rate| units.map_or(0, |(num, den)| r.cost(num, den));
            until = until.max(b.main.wait(now, slack(&b.main)));
            if let Some(r) = &b.burst {
                until = until.max(r.wait(now, slack(r)));
            }
        }
        until
    }

    /// As [`Limiter::wait`], for a request of `bytes` that comes to `member` while it has
    /// nothing waiting. If another waiting member has been served more, the request may
    /// go as far as its own cost beyond each bucket's tolerance: it goes now instead of
    /// at the group's next slot, and the slot it took is the next one's (the buckets
    /// count it as any other, so the group's rate over time does not change). A member
    /// that waits on each completion (a disk at QD1) spends a slot's wait on every
    /// request otherwise, which a member with requests always waiting never does: its
    /// round trip plus that wait, longer than two slots of a busy group, held it below
    /// half however far behind it was.
    pub fn wait_arriving(&self, dir: Dir, bytes: u64, now: u64, member: usize) -> u64 {
        self.wait_beyond(dir, now, self.behind(member).then_some(bytes))
    }

    /// Whether another waiting member has been served more than `member`.
    fn behind(&self, member: usize) -> bool {
        let n = self.members.load(Ordering::Acquire);
        if n <= 1 {
            return false;
        }
        let mine = self.shares[member].served.load(Ordering::Relaxed);
        self.shares[..n].iter().enumerate().any(|(k, s)| {
            k != member
                && s.waiting.load(Ordering::Relaxed) > 0
                && s.served.load(Ordering::Relaxed) > mine
        })
    }

    /// Whether `member` may take the group's next credit: no other waiting member is
    /// more than a quantum behind it.
    pub fn may_go(&self, member: usize) -> bool {
        let n = self.members.load(Ordering::Acquire);
        if n <= 1 {
            return true;
        }
        let mine = self.shares[member].served.load(Ordering::Relaxed);
        !self.shares[..n].iter().enumerate().any(|(k, s)| {
            k != member
                && s.waiting.load(Ordering::Relaxed) > 0
                && mine
                    > s.served
                        .load(Ordering::Relaxed)
                        .saturating_add(self.quantum)
        })
    }

    /// Count a request of `bytes` going `dir` at `now` (ticks) in every bucket it
    /// passes, and in `member`'s share.
    pub fn charge(&self, dir: Dir, bytes: u64, now: u64, member: usize) {
        let mut longest = 0;
        for b in self.buckets.iter().filter(|b| b.applies(dir)) {
            let (num, den) = b.units(bytes, self.op_size);
            let c = b.main.cost(num, den);
            b.main.charge(now, c);
            longest = longest.max(c);
            if let Some(r) = &b.burst {
                r.charge(now, r.cost(num, den));
            }
        }
        if self.members.load(Ordering::Relaxed) > 1 {
            self.shares[member]
                .served
                .fetch_add(longest, Ordering::Relaxed);
        }
    }

    /// A worker of `member` has requests waiting (or no longer: each worker of a disk
    /// says so once each way). A member that starts waiting starts at most two quanta
    /// behind the least-served member already waiting (none waiting: the most-served
    /// member): one more than a member may be behind before it goes first, so a slot
    /// missed between two requests is won back. What it was behind beyond that it gives
    /// up, and [`LimiterStats::forfeited_ns`] counts it.
    pub fn set_waiting(&self, member: usize, waiting: bool) {
        let share = &self.shares[member];
        if !waiting {
            let _ = share
                .waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| w.checked_sub(1));
            return;
        }
        if share.waiting.fetch_add(1, Ordering::Relaxed) > 0 {
            return;
        }
        let n = self.members.load(Ordering::Acquire);
        let others = self.shares[..n]
            .iter()
            .enumerate()
            .filter(|(k, _)| *k != member)
            .map(|(_, s)| s);
        let least_waiting = others
            .clone()
            .filter(|s| s.waiting.load(Ordering::Relaxed) > 0)
            .map(|s| s.served.load(Ordering::Relaxed))
            .min();
        // With nobody waiting, the group's most-served member: what a member served
        // alone meanwhile is not owed back to one that was idle.
        let least =
            least_waiting.or_else(|| others.map(|s| s.served.load(Ordering::Relaxed)).max());
        if let Some(least) = least {
            let floor = least.saturating_sub(2 * self.quantum);
            let before = share.served.fetch_max(floor, Ordering::Relaxed);
            if before < floor {
                self.stats.forfeited_ns[member]
                    .fetch_add(ticks_to_ns(floor - before), Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests;
