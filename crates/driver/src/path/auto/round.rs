//! The disk-wide half of `auto`: the round's clock, the tallies every queue adds to, and
//! the decision (see the module above for what a round is).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{
    ns, AutoTrial, CANDIDATES, CLAIMED, IDLE, IOPS_TIE, LONG_SLOT, LONG_STEPS, RECHECK,
    RECHECK_MAX, RECHECK_ROUNDS, ROTATIONAL_DEPTH, SCHEDULE, SLOT, SLOT_MAX, SLOT_MIN_IOS, STEPS,
};

/// One slot's tally in a round, tagged with the round's number (its low 24 bits, above
/// the 40-bit sum): an add for another round than the tally's is dropped, so a queue
/// that checked the round just before another queue restarted it cannot add its old
/// slot's count to the new round. One compare-and-swap per queue per slot.
#[derive(Debug, Default)]
pub(super) struct Tally(AtomicU64);

pub(super) const TALLY_BITS: u32 = 40;
pub(super) const TALLY_SUM: u64 = (1 << TALLY_BITS) - 1;

impl Tally {
    pub(super) fn tag(round: u64) -> u64 {
        (round & 0xFF_FFFF) << TALLY_BITS
    }

    /// Zero, for round `round`.
    pub(super) fn reset(&self, round: u64) {
        self.0.store(Tally::tag(round), Ordering::Relaxed);
    }

    /// Add `x` if the tally is round `round`'s (saturating: a slot never nears 2^40).
    pub(super) fn add(&self, round: u64, x: u64) {
        let tag = Tally::tag(round);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v & !TALLY_SUM == tag)
                    .then(|| tag | (v & TALLY_SUM).saturating_add(x).min(TALLY_SUM))
            });
    }

    /// Raise the tally to `x` if it is round `round`'s and below it.
    pub(super) fn max(&self, round: u64, x: u64) {
        let tag = Tally::tag(round);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v & !TALLY_SUM == tag && v & TALLY_SUM < x.min(TALLY_SUM))
                    .then(|| tag | x.min(TALLY_SUM))
            });
    }

    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed) & TALLY_SUM
    }
}

/// The disk-wide half of `auto`, shared by the disk's queues: the round's clock, the I/Os
/// and CPU time every queue completed in each slot, and the last choice. Written a few
/// times per slot per queue during a round and once per round otherwise; never locked.
#[derive(Debug)]
pub(crate) struct AutoDisk {
    pub(super) base: Instant,
    /// Rounds begun.
    pub(super) round: AtomicU64,
    /// When the running round's first slot starts, ns after `base`: [`IDLE`] between
    /// rounds, [`CLAIMED`] while one queue sets a round up or decides it.
    pub(super) start: AtomicU64,
    /// The length of a slot, ns, and the number of slots, of the running round.
    pub(super) slot: AtomicU64,
    pub(super) steps: AtomicU64,
    /// Per slot of the running round, summed over the queues that measured in it: I/Os
    /// completed, submitting threads' CPU time, and each queue's rate (its I/Os over the
    /// time it measured, from the moment the slot's candidate had settled on it to the
    /// end of the slot).
    pub(super) ios: [Tally; STEPS],
    pub(super) cpu_ns: [Tally; STEPS],
    pub(super) rate: [Tally; STEPS],
    /// The longest a queue took (or would have taken, extrapolated) in this round to
    /// settle after a switch, ns: what was on the ring beyond the new depth to complete.
    pub(super) settle_ns: Tally,
    /// When a workload's change may start a round (ns after `base`): after a round of
    /// long slots, not before [`RECHECK_ROUNDS`] round lengths have passed.
    pub(super) quiet_until: AtomicU64,
    /// Rounds decided, and the index in [`CANDIDATES`] of the last one's choice.
    pub(super) decided: AtomicU64,
    pub(super) pick: AtomicU64,
    /// When an unchanged workload is due to be measured again (ns after `base`), and the
    /// interval that set it.
    pub(super) recheck_at: AtomicU64,
    pub(super) recheck: AtomicU64,
    /// The last round's figures per candidate (f64 bits): IOPS, µs of CPU per I/O.
    pub(super) iops: [AtomicU64; CANDIDATES.len()],
    pub(super) cpu_us: [AtomicU64; CANDIDATES.len()],
}

impl AutoDisk {
    pub(crate) fn new() -> AutoDisk {
        AutoDisk {
            base: Instant::now(),
            round: AtomicU64::new(0),
            start: AtomicU64::new(IDLE),
            slot: AtomicU64::new(ns(SLOT)),
            steps: AtomicU64::new(STEPS as u64),
            ios: Default::default(),
            cpu_ns: Default::default(),
            rate: Default::default(),
            settle_ns: Tally::default(),
            quiet_until: AtomicU64::new(0),
            decided: AtomicU64::new(0),
            pick: AtomicU64::new(0),
            recheck_at: AtomicU64::new(u64::MAX),
            recheck: AtomicU64::new(ns(RECHECK)),
            iops: Default::default(),
            cpu_us: Default::default(),
        }
    }

    pub(super) fn now(&self) -> u64 {
        ns(self.base.elapsed())
    }

    /// The running round's number of slots.
    pub(super) fn steps(&self) -> usize {
        (self.steps.load(Ordering::Relaxed) as usize).min(STEPS)
    }

    /// Start a round `delay` from now, unless one runs.
    pub(super) fn begin(&self, delay: Duration) {
        if self.claim(IDLE) {
            self.open(delay);
        }
    }

    /// Round `from` was left undecided too long (no queue completed I/O to decide it in
    /// time: the disk went idle, or its load is too sparse for slots this short): start
    /// it over in one slot, with slots twice as long (up to [`SLOT_MAX`]), so that a
    /// sparse load is decided rather than measured over and over.
    pub(super) fn restart(&self, from: u64) {
        if self.claim(from) {
            let slot = self.slot.load(Ordering::Relaxed);
            self.slot
                .store((slot * 2).min(ns(SLOT_MAX)), Ordering::Relaxed);
            self.open(SLOT);
        }
    }

    /// Take `start` from `from` to CLAIMED; false if another queue changed it first.
    pub(super) fn claim(&self, from: u64) -> bool {
        self.start
            .compare_exchange(from, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// With `start` claimed: clear the tallies and start the next round `delay` from now.
    pub(super) fn open(&self, delay: Duration) {
        // Only the claiming queue changes the round number. The tallies are tagged with
        // the new round's, so a queue that checked the old one just before this cannot
        // add to them.
        let next = self.round.load(Ordering::Acquire) + 1;
        for k in 0..STEPS {
            self.ios[k].reset(next);
            self.cpu_ns[k].reset(next);
            self.rate[k].reset(next);
        }
        self.settle_ns.reset(next);
        let long = self.slot.load(Ordering::Relaxed) >= ns(LONG_SLOT);
        self.steps.store(
            if long { LONG_STEPS } else { STEPS } as u64,
            Ordering::Relaxed,
        );
        self.round.store(next, Ordering::Release);
        self.start.store(self.now() + ns(delay), Ordering::Release);
        log::debug!(
            "auto: round {next} at {:.3} s: {} slots of {:.0} ms",
            self.now() as f64 / 1e9,
            self.steps(),
            self.slot.load(Ordering::Relaxed) as f64 / 1e6
        );
    }

    /// A queue of round `round` completed `ios` I/Os in slot `k` over the `busy` ns it
    /// measured, with `cpu` ns of its thread's CPU time. A measurement over less than a
    /// quarter of the slot (the candidate settled late, or the queue noticed the slot's
    /// end late) is left out: a few I/Os over a short time say little.
    pub(super) fn add(&self, round: u64, k: usize, ios: u64, cpu: u64, busy: u64) {
        if busy < self.slot.load(Ordering::Relaxed) / 4 {
            return;
        }
        if self.round.load(Ordering::Acquire) == round
            && self.start.load(Ordering::Acquire) < CLAIMED
        {
            self.ios[k].add(round, ios);
            self.cpu_ns[k].add(round, cpu);
            self.rate[k].add(round, ios.saturating_mul(1_000_000_000) / busy.max(1));
        }
    }

    /// A queue of round `round` took (or would take) `need` ns to settle after a switch.
    /// More than half a slot: the round cannot measure that candidate fairly, so it is
    /// started again at once with slots three times as long (up to [`SLOT_MAX`]).
    pub(super) fn settled_in(&self, round: u64, need: u64) {
        self.settle_ns.max(round, need);
        let slot = self.slot.load(Ordering::Relaxed);
        if need > slot / 2 && slot < ns(SLOT_MAX) && self.round.load(Ordering::Acquire) == round {
            let start = self.start.load(Ordering::Acquire);
            if start < CLAIMED && self.claim(start) {
                self.lengthen(slot, need);
            }
        }
    }

    /// With `start` claimed: slots long enough for a settling of `settle` ns, and a new
    /// round at once.
    fn lengthen(&self, slot: u64, settle: u64) {
        let longer = (slot * 2).max(settle * 3).min(ns(SLOT_MAX));
        log::debug!(
            "auto: a switch took {:.1} ms to settle in slots of {:.0} ms: slots of {:.0} ms",
            settle as f64 / 1e6,
            slot as f64 / 1e6,
            longer as f64 / 1e6
        );
        self.slot.store(longer, Ordering::Relaxed);
        self.open(Duration::ZERO);
    }

    /// The disk's IOPS in slot `k`: the measuring queues' rates, summed (None: no queue
    /// measured in it).
    pub(super) fn slot_iops(&self, k: usize) -> Option<f64> {
        let rate = self.rate[k].get();
        (rate > 0).then_some(rate as f64)
    }

    /// End round `started_at` (its `start`): one queue wins the right to decide, picks,
    /// and publishes the choice. False if another queue decides it.
    pub(super) fn decide(&self, started_at: u64) -> bool {
        if self
            .start
            .compare_exchange(started_at, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let slot = self.slot.load(Ordering::Relaxed);
        let steps = self.steps();
        // A switch that took more than half a slot to settle (a deep ring on a slow
        // disk draining to a shallow depth) left too little of its slots measured: the
        // round is run again at once with slots long enough, rather than decided.
        let settle = self.settle_ns.get();
        if settle > slot / 2 && slot < ns(SLOT_MAX) {
            self.lengthen(slot, settle);
            return false;
        }
        let trials: Vec<AutoTrial> = CANDIDATES
            .iter()
            .enumerate()
            .map(|(c, cand)| {
                let (mut ios, mut cpu, mut rates, mut n) = (0, 0, 0.0, 0);
                for k in (0..steps).filter(|&k| SCHEDULE[k] == c) {
                    ios += self.ios[k].get();
                    cpu += self.cpu_ns[k].get();
                    if let Some(r) = self.slot_iops(k) {
                        rates += r;
                        n += 1;
                    }
                }
                AutoTrial {
                    path: cand.path,
                    queue_depth: cand.shallow.then_some(ROTATIONAL_DEPTH),
                    iops: if n > 0 { rates / f64::from(n) } else { 0.0 },
                    cpu_us_per_io: cpu as f64 / 1e3 / ios.max(1) as f64,
                }
            })
            .collect();
        let previous =
            (self.decided.load(Ordering::Relaxed) > 0).then(|| self.pick.load(Ordering::Relaxed));
        let (pick, kept) = choose(&trials, previous.map(|p| p as usize));
        let recheck = if kept {
            (self.recheck.load(Ordering::Relaxed) * 2).min(ns(RECHECK_MAX))
        } else {
            ns(RECHECK)
        };
        let fewest = (0..steps).map(|k| self.ios[k].get()).min().unwrap_or(0);
        if fewest < SLOT_MIN_IOS {
            self.slot
                .store((slot * 2).min(ns(SLOT_MAX)), Ordering::Relaxed);
        }
        for (c, t) in trials.iter().enumerate() {
            self.iops[c].store(t.iops.to_bits(), Ordering::Relaxed);
            self.cpu_us[c].store(t.cpu_us_per_io.to_bits(), Ordering::Relaxed);
        }
        self.pick.store(pick as u64, Ordering::Relaxed);
        self.recheck.store(recheck, Ordering::Relaxed);
        let round_ns = slot * steps as u64;
        let now = self.now();
        self.recheck_at.store(
            now + recheck.max(RECHECK_ROUNDS * round_ns),
            Ordering::Relaxed,
        );
        let long = steps == LONG_STEPS;
        self.quiet_until.store(
            if long {
                now + RECHECK_ROUNDS * round_ns
            } else {
                0
            },
            Ordering::Relaxed,
        );
        self.decided.fetch_add(1, Ordering::Release);
        self.start.store(IDLE, Ordering::Release);
        log::debug!(
            "auto: round decided at {:.3} s: {:?}",
            now as f64 / 1e9,
            trials
                .iter()
                .map(|t| (t.path, t.queue_depth, t.iops.round()))
                .collect::<Vec<_>>()
        );
        true
    }

    pub(super) fn trials(&self) -> Vec<AutoTrial> {
        if self.decided.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        CANDIDATES
            .iter()
            .enumerate()
            .map(|(c, cand)| AutoTrial {
                path: cand.path,
                queue_depth: cand.shallow.then_some(ROTATIONAL_DEPTH),
                iops: f64::from_bits(self.iops[c].load(Ordering::Relaxed)),
                cpu_us_per_io: f64::from_bits(self.cpu_us[c].load(Ordering::Relaxed)),
            })
            .collect()
    }
}

/// The choice from a round's figures (an index into them): the most IOPS; among those
/// within [`IOPS_TIE`] of it, `previous` if it is one of them (kept: true), else the least
/// CPU per I/O.
pub(super) fn choose(trials: &[AutoTrial], previous: Option<usize>) -> (usize, bool) {
    let best = trials.iter().map(|t| t.iops).fold(0.0, f64::max);
    let tied = || {
        trials
            .iter()
            .enumerate()
            .filter(move |(_, t)| t.iops >= best * (1.0 - IOPS_TIE))
    };
    match previous {
        Some(p) if tied().any(|(i, _)| i == p) => (p, true),
        _ => (
            tied()
                .min_by(|a, b| a.1.cpu_us_per_io.total_cmp(&b.1.cpu_us_per_io))
                .map_or(0, |(i, _)| i),
            false,
        ),
    }
}
