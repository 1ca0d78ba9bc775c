//! `auto`: the driver picks the path per disk.
//!
//! "If this optimization depends on the host, then it should be reported to the guest" —
//! and where the host does not say, measured. Two inputs:
//!
//! 1. **What the device reports.** A vblk device whose disk is rotational (an `hdd:` disk,
//!    a file on a rotational block device) says so in vblk's hint block (see
//!    [`crate::disk::DeviceHints`]): the host does no reordering and seeks cost, so the
//!    request path with `deadline` (merging, sector-sorted batches) is used, without trials,
//!    and with a dispatch depth of [`ROTATIONAL_DEPTH`] unless the caller set `queue_depth`:
//!    one head serves one request at a time, so deeper dispatch only moves the queue from
//!    the elevator, where requests merge and are sorted, to the device, where they wait in
//!    arrival order.
//! 2. **What it measures.** Otherwise bio, batch and request are tried on the live workload
//!    in a *round* of eighteen time slots of 30 ms, three times in the order A B C C B A
//!    so that drift cancels (six slots per path: the disk's total over one slot varies by
//!    several per cent, and paths 5 % apart must be told apart), and **every queue of the
//!    disk runs the same path in the same slot**: the
//!    round is one clock shared by the disk's queues ([`AutoDisk`]), and each queue adds
//!    the I/Os it completed in a slot to the disk's count for that slot. The path whose
//!    slots completed the most I/Os wins, and among paths within 3 % of it the one with
//!    the least CPU time per I/O (a paced workload gets the same IOPS on every path; then
//!    CPU decides). A path already in use that is still within 3 % of the best stays (no
//!    flapping between equals on noise).
//!
//!    Why per disk and in lockstep: with more submitting threads than CPUs (the 16-job
//!    matrix on 2 CPUs), a trial on one queue mostly measures how much CPU the scheduler
//!    gave its thread in those 30 ms (one path's trials varied tenfold between queues of
//!    one run), and so each queue chose nearly at random. The disk's total over a slot is
//!    what the paths change, and it does not depend on which thread had the CPU.
//!
//!    Each queue checks its workload's signature — read share, I/O size, sequential
//!    share, depth — every few thousand I/Os; when it moves away from the one the last
//!    round was run for, that queue starts a new round for the disk. An unchanged workload
//!    is measured again after 8 s, then 16 s, ... up to 256 s while the rounds keep
//!    choosing the same path. The first round starts 100 ms after the first I/Os, once
//!    the workload has settled (threads started, memory touched).
//!
//! Switching away from the request path first lets everything it holds go to the ring, so
//! the ordering promises (flush barriers) hold across switches.
//!
//! Cost on the hot path: between rounds, a counter per completion and, every 16, two
//! relaxed loads of the disk's round state (a line written once per round); during a
//! round, a clock read every 4 completions and one atomic add per queue per slot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::dispatch::Core;
use crate::io::Op;
use crate::path::request::RequestPath;
use crate::path::PathKind;
use crate::queue::QueueOptions;

/// Requests on the ring at once on a rotational disk: one being served, one ready behind
/// it so that the head does not wait for a round trip between requests.
pub const ROTATIONAL_DEPTH: u16 = 2;
/// The paths a round tries, and the order of its slots (indices into it).
const CANDIDATES: [PathKind; 3] = [PathKind::Bio, PathKind::Batch, PathKind::Request];
const SCHEDULE: [usize; 18] = [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0];
const STEPS: usize = SCHEDULE.len();
/// One slot of a round, at first; doubled (up to [`SLOT_MAX`]) while a slot sees fewer
/// than [`SLOT_MIN_IOS`] I/Os on the whole disk, or a round goes undecided for want of
/// completions to decide it in time.
const SLOT: Duration = Duration::from_millis(30);
const SLOT_MAX: Duration = Duration::from_millis(480);
const SLOT_MIN_IOS: u64 = 256;
/// The first round starts this long after the disk's first I/Os.
const FIRST_DELAY: Duration = Duration::from_millis(100);
/// While running the chosen path: how often a queue checks its workload's signature.
const CHECK_IOS: u64 = 16384;
const CHECK_TIME: Duration = Duration::from_millis(250);
/// An unchanged workload is measured again after this long at first, and at most (the
/// interval doubles while the rounds keep choosing the same path).
const RECHECK: Duration = Duration::from_secs(8);
const RECHECK_MAX: Duration = Duration::from_secs(256);
/// IOPS within this fraction of the best count as equal; CPU per I/O decides.
const IOPS_TIE: f64 = 0.03;
/// `AutoDisk::start` when no round runs, and while one is being set up or decided.
const IDLE: u64 = u64::MAX;
const CLAIMED: u64 = u64::MAX - 1;

/// The measurements behind one choice.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AutoTrial {
    /// The path tried.
    pub path: PathKind,
    /// I/Os completed per second during its trials.
    pub iops: f64,
    /// The submitting thread's CPU time per I/O, in microseconds.
    pub cpu_us_per_io: f64,
}

/// What `auto` chose and why.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct AutoReport {
    /// The path in use now.
    pub current: PathKind,
    /// Why: the device's hint, or trials.
    pub reason: String,
    /// How many times the trials ran.
    pub choices: u64,
    /// The last trials' figures (empty when the device's hint decided).
    pub trials: Vec<AutoTrial>,
}

/// The workload's shape: what the choice was made for.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Signature {
    /// Share of reads (0..=1).
    reads: f64,
    /// Mean I/O size, bytes.
    size: f64,
    /// Share of I/Os that start where the previous one ended (0..=1).
    sequential: f64,
    /// Mean number of I/Os in flight at submission.
    depth: f64,
}

impl Signature {
    /// Whether `self` is a different workload from `other`: a quarter of the mix moved
    /// between reads and writes or between sequential and random, or the I/O size or the
    /// depth changed by more than 2×. Tolerances rather than buckets, so that a workload
    /// sitting on a bucket's edge (QD32's mean depth is 31.9 in one window and 32 in the
    /// next) does not look new at every check.
    fn differs(&self, other: &Signature) -> bool {
        let ratio = |a: f64, b: f64| a.max(1.0) / b.max(1.0);
        let apart = |a: f64, b: f64| ratio(a, b) > 2.0 || ratio(b, a) > 2.0;
        (self.reads - other.reads).abs() >= 0.25
            || (self.sequential - other.sequential).abs() >= 0.25
            || apart(self.size, other.size)
            || apart(self.depth, other.depth)
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Window {
    ios: u64,
    reads: u64,
    bytes: u64,
    sequential: u64,
    depth: u64,
}

impl Window {
    fn signature(&self) -> Signature {
        let n = self.ios.max(1) as f64;
        Signature {
            reads: self.reads as f64 / n,
            size: self.bytes as f64 / n,
            sequential: self.sequential as f64 / n,
            depth: self.depth as f64 / n,
        }
    }
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write; the clock id is a constant Linux knows.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

/// One slot's tally in a round, tagged with the round's number (its low 24 bits, above
/// the 40-bit sum): an add for another round than the tally's is dropped, so a queue
/// that checked the round just before another queue restarted it cannot add its old
/// slot's count to the new round. One compare-and-swap per queue per slot.
#[derive(Debug, Default)]
struct Tally(AtomicU64);

const TALLY_BITS: u32 = 40;
const TALLY_SUM: u64 = (1 << TALLY_BITS) - 1;

impl Tally {
    fn tag(round: u64) -> u64 {
        (round & 0xFF_FFFF) << TALLY_BITS
    }

    /// Zero, for round `round`.
    fn reset(&self, round: u64) {
        self.0.store(Tally::tag(round), Ordering::Relaxed);
    }

    /// Add `x` if the tally is round `round`'s (saturating: a slot never nears 2^40).
    fn add(&self, round: u64, x: u64) {
        let tag = Tally::tag(round);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v & !TALLY_SUM == tag)
                    .then(|| tag | (v & TALLY_SUM).saturating_add(x).min(TALLY_SUM))
            });
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed) & TALLY_SUM
    }
}

/// The disk-wide half of `auto`, shared by the disk's queues: the round's clock, the I/Os
/// and CPU time every queue completed in each slot, and the last choice. Written a few
/// times per slot per queue during a round and once per round otherwise; never locked.
#[derive(Debug)]
pub(crate) struct AutoDisk {
    base: Instant,
    /// Rounds begun.
    round: AtomicU64,
    /// When the running round's first slot starts, ns after `base`: [`IDLE`] between
    /// rounds, [`CLAIMED`] while one queue sets a round up or decides it.
    start: AtomicU64,
    /// The length of a slot, ns.
    slot: AtomicU64,
    /// Per slot of the running round: I/Os completed and submitting threads' CPU time.
    ios: [Tally; STEPS],
    cpu_ns: [Tally; STEPS],
    /// Rounds decided, and the index in [`CANDIDATES`] of the last one's choice.
    decided: AtomicU64,
    pick: AtomicU64,
    /// When an unchanged workload is due to be measured again (ns after `base`), and the
    /// interval that set it.
    recheck_at: AtomicU64,
    recheck: AtomicU64,
    /// The last round's figures per candidate (f64 bits): IOPS, µs of CPU per I/O.
    iops: [AtomicU64; 3],
    cpu_us: [AtomicU64; 3],
}

impl AutoDisk {
    pub(crate) fn new() -> AutoDisk {
        AutoDisk {
            base: Instant::now(),
            round: AtomicU64::new(0),
            start: AtomicU64::new(IDLE),
            slot: AtomicU64::new(ns(SLOT)),
            ios: Default::default(),
            cpu_ns: Default::default(),
            decided: AtomicU64::new(0),
            pick: AtomicU64::new(0),
            recheck_at: AtomicU64::new(u64::MAX),
            recheck: AtomicU64::new(ns(RECHECK)),
            iops: Default::default(),
            cpu_us: Default::default(),
        }
    }

    fn now(&self) -> u64 {
        ns(self.base.elapsed())
    }

    /// Start a round `delay` from now, unless one runs.
    fn begin(&self, delay: Duration) {
        if self.claim(IDLE) {
            self.open(delay);
        }
    }

    /// Round `from` was left undecided too long (no queue completed I/O to decide it in
    /// time: the disk went idle, or its load is too sparse for slots this short): start
    /// it over in one slot, with slots twice as long (up to [`SLOT_MAX`]), so that a
    /// sparse load is decided rather than measured over and over.
    fn restart(&self, from: u64) {
        if self.claim(from) {
            let slot = self.slot.load(Ordering::Relaxed);
            self.slot
                .store((slot * 2).min(ns(SLOT_MAX)), Ordering::Relaxed);
            self.open(SLOT);
        }
    }

    /// Take `start` from `from` to CLAIMED; false if another queue changed it first.
    fn claim(&self, from: u64) -> bool {
        self.start
            .compare_exchange(from, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// With `start` claimed: clear the tallies and start the next round `delay` from now.
    fn open(&self, delay: Duration) {
        // Only the claiming queue changes the round number. The tallies are tagged with
        // the new round's, so a queue that checked the old one just before this cannot
        // add to them.
        let next = self.round.load(Ordering::Acquire) + 1;
        for k in 0..STEPS {
            self.ios[k].reset(next);
            self.cpu_ns[k].reset(next);
        }
        self.round.store(next, Ordering::Release);
        self.start.store(self.now() + ns(delay), Ordering::Release);
    }

    /// A queue of round `round` completed `ios` I/Os in slot `k`, with `cpu` ns of its
    /// thread's CPU time.
    fn add(&self, round: u64, k: usize, ios: u64, cpu: u64) {
        if self.round.load(Ordering::Acquire) == round
            && self.start.load(Ordering::Acquire) < CLAIMED
        {
            self.ios[k].add(round, ios);
            self.cpu_ns[k].add(round, cpu);
        }
    }

    /// End round `started_at` (its `start`): one queue wins the right to decide, picks,
    /// and publishes the choice. False if another queue decides it.
    fn decide(&self, started_at: u64) -> bool {
        if self
            .start
            .compare_exchange(started_at, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        let slot = self.slot.load(Ordering::Relaxed);
        let trials: Vec<AutoTrial> = (0..CANDIDATES.len())
            .map(|c| {
                let (mut ios, mut cpu) = (0, 0);
                for k in (0..STEPS).filter(|&k| SCHEDULE[k] == c) {
                    ios += self.ios[k].get();
                    cpu += self.cpu_ns[k].get();
                }
                let slots = SCHEDULE.iter().filter(|&&i| i == c).count() as f64;
                AutoTrial {
                    path: CANDIDATES[c],
                    iops: ios as f64 / (slots * slot as f64 / 1e9),
                    cpu_us_per_io: cpu as f64 / 1e3 / ios.max(1) as f64,
                }
            })
            .collect();
        let previous = (self.decided.load(Ordering::Relaxed) > 0)
            .then(|| CANDIDATES[self.pick.load(Ordering::Relaxed) as usize]);
        let (pick, kept) = choose(&trials, previous);
        let recheck = if kept {
            (self.recheck.load(Ordering::Relaxed) * 2).min(ns(RECHECK_MAX))
        } else {
            ns(RECHECK)
        };
        let fewest = (0..STEPS).map(|k| self.ios[k].get()).min().unwrap_or(0);
        if fewest < SLOT_MIN_IOS {
            self.slot
                .store((slot * 2).min(ns(SLOT_MAX)), Ordering::Relaxed);
        }
        for (c, t) in trials.iter().enumerate() {
            self.iops[c].store(t.iops.to_bits(), Ordering::Relaxed);
            self.cpu_us[c].store(t.cpu_us_per_io.to_bits(), Ordering::Relaxed);
        }
        let index = CANDIDATES.iter().position(|&p| p == pick).unwrap_or(0);
        self.pick.store(index as u64, Ordering::Relaxed);
        self.recheck.store(recheck, Ordering::Relaxed);
        self.recheck_at
            .store(self.now() + recheck, Ordering::Relaxed);
        self.decided.fetch_add(1, Ordering::Release);
        self.start.store(IDLE, Ordering::Release);
        true
    }

    fn trials(&self) -> Vec<AutoTrial> {
        if self.decided.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        (0..CANDIDATES.len())
            .map(|c| AutoTrial {
                path: CANDIDATES[c],
                iops: f64::from_bits(self.iops[c].load(Ordering::Relaxed)),
                cpu_us_per_io: f64::from_bits(self.cpu_us[c].load(Ordering::Relaxed)),
            })
            .collect()
    }
}

/// The choice from a round's figures: the most IOPS; among paths within [`IOPS_TIE`] of
/// it, `previous` if it is one of them (kept: true), else the least CPU per I/O.
fn choose(trials: &[AutoTrial], previous: Option<PathKind>) -> (PathKind, bool) {
    let best = trials.iter().map(|t| t.iops).fold(0.0, f64::max);
    let tied = || {
        trials
            .iter()
            .filter(move |t| t.iops >= best * (1.0 - IOPS_TIE))
    };
    match previous {
        Some(p) if tied().any(|t| t.path == p) => (p, true),
        _ => (
            tied()
                .min_by(|a, b| a.cpu_us_per_io.total_cmp(&b.cpu_us_per_io))
                .map_or(PathKind::Bio, |t| t.path),
            false,
        ),
    }
}

/// Where a queue is in the disk's rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    /// Running the chosen path; checking the workload's signature.
    Chosen,
    /// In round `round`, in slot `step` (STEPS: the round's slots are over, waiting for
    /// its decision), or None before its first slot.
    Round { round: u64, step: Option<usize> },
}

#[derive(Debug)]
pub(crate) struct Auto {
    pub request: RequestPath,
    batch: u16,
    mode: PathKind,
    rotational: bool,
    stage: Stage,
    /// I/Os completed in the current slot, and the thread's CPU time when it began.
    slot_ios: u64,
    slot_cpu: u64,
    /// Rounds decided whose choice this queue follows.
    decided: u64,
    /// The signature check window: I/Os completed and when it began.
    phase_ios: u64,
    phase_start: Instant,
    window: Window,
    last_end: u64,
    chosen: Signature,
}

impl Auto {
    pub(crate) fn new(opts: &QueueOptions, ring_size: u16, rotational: bool) -> Auto {
        let mut request = opts.request;
        if rotational && request.queue_depth == 0 {
            request.queue_depth = ROTATIONAL_DEPTH;
        }
        Auto {
            request: RequestPath::new(request, ring_size),
            batch: opts.batch.max(1),
            mode: if rotational {
                PathKind::Request
            } else {
                PathKind::Bio
            },
            rotational,
            stage: Stage::Chosen,
            slot_ios: 0,
            slot_cpu: 0,
            decided: 0,
            phase_ios: 0,
            phase_start: Instant::now(),
            window: Window::default(),
            last_end: u64::MAX,
            chosen: Signature::default(),
        }
    }

    pub(crate) fn report(&self, disk: &AutoDisk) -> AutoReport {
        let decided = disk.decided.load(Ordering::Acquire);
        AutoReport {
            current: self.mode,
            reason: if self.rotational {
                format!(
                    "the device reports a rotational disk: request path, {} elevator, \
                     queue depth {}",
                    self.request.opts.elevator, self.request.opts.queue_depth
                )
            } else if matches!(self.stage, Stage::Round { .. }) {
                "trials in progress".into()
            } else if decided == 0 {
                "no trials yet".into()
            } else {
                "the best of the disk's last trials".into()
            },
            choices: if self.rotational { 0 } else { decided },
            trials: if self.rotational {
                Vec::new()
            } else {
                disk.trials()
            },
        }
    }

    fn switch(&mut self, core: &mut Core, to: PathKind) {
        if self.mode == to {
            return;
        }
        if self.mode == PathKind::Request {
            self.request.drain(core);
        } else {
            core.publish();
        }
        self.mode = to;
    }

    /// Whether the path in use sends each I/O at once (bio, batch): then the queue may use
    /// the one-request fast path, and calls [`Auto::observe`] and [`Auto::sent`] around it.
    pub(crate) fn sends_directly(&self) -> bool {
        self.mode != PathKind::Request
    }

    /// Count an I/O of `bytes` at `sector` into the workload's signature.
    pub(crate) fn observe(&mut self, op: Op, sector: u64, bytes: u64, in_flight: usize) {
        let w = &mut self.window;
        w.ios += 1;
        w.reads += u64::from(op == Op::Read);
        w.bytes += bytes;
        w.sequential += u64::from(sector == self.last_end);
        w.depth += in_flight as u64;
        self.last_end = sector + bytes / 512;
    }

    /// An I/O went to the ring on bio or batch: publish as that path does.
    pub(crate) fn sent(&mut self, core: &mut Core) {
        if self.mode == PathKind::Bio {
            core.publish();
        } else {
            core.publish_batch(self.batch);
        }
    }

    pub(crate) fn submit(&mut self, core: &mut Core, id: u32) {
        let e = core.table.get(id);
        self.observe(e.op, e.sector, e.bytes, core.table.in_flight);
        match self.mode {
            PathKind::Request => self.request.submit(core, id),
            _ => {
                if let Err(e) = core.send(id) {
                    // Submission already returned for the caller's sake only on the request
                    // path; here it has not, but the I/O is admitted: fail it in order.
                    core.table.fail(id, e.kind());
                }
                self.sent(core);
            }
        }
    }

    pub(crate) fn unplug(&mut self, core: &mut Core) {
        match self.mode {
            PathKind::Request => self.request.unplug(core),
            _ => core.publish(),
        }
    }

    pub(crate) fn after_reap(&mut self, core: &mut Core) {
        if self.mode == PathKind::Request {
            self.request.run(core);
        }
    }

    /// The caller took `n` completions.
    pub(crate) fn completed(&mut self, core: &mut Core, n: u64) {
        if self.rotational {
            return;
        }
        self.phase_ios += n;
        self.slot_ios += n;
        match self.stage {
            Stage::Round { .. } => {
                if self.phase_ios & 3 == 0 {
                    self.follow(core);
                }
            }
            Stage::Chosen => {
                if self.phase_ios & 15 != 0 {
                    return;
                }
                let disk = &core.shared.auto;
                if disk.start.load(Ordering::Relaxed) < CLAIMED
                    || disk.decided.load(Ordering::Relaxed) != self.decided
                {
                    self.follow(core);
                } else if disk.decided.load(Ordering::Relaxed) == 0 {
                    // The disk's first I/Os: measure once they have settled.
                    disk.begin(FIRST_DELAY);
                } else if self.phase_ios >= CHECK_IOS || self.phase_start.elapsed() >= CHECK_TIME {
                    self.check(core);
                }
            }
        }
    }

    /// The end of a signature window while running the chosen path: a changed workload,
    /// or one due to be measured again, starts a round for the disk.
    fn check(&mut self, core: &mut Core) {
        let disk = &core.shared.auto;
        let sig = self.window.signature();
        self.window = Window::default();
        self.phase_ios = 0;
        self.phase_start = Instant::now();
        if sig.differs(&self.chosen) || disk.now() >= disk.recheck_at.load(Ordering::Relaxed) {
            disk.begin(SLOT);
        }
    }

    /// Follow the disk's round: join it, run the path of the current slot (adding what
    /// this queue completed in the previous one to the disk's count), decide it once its
    /// slots are over, and take the decision.
    fn follow(&mut self, core: &mut Core) {
        let disk = &core.shared.auto;
        let start = disk.start.load(Ordering::Acquire);
        if start >= CLAIMED {
            let decided = disk.decided.load(Ordering::Acquire);
            if decided != self.decided {
                self.adopt(core, decided);
            }
            return;
        }
        let round = disk.round.load(Ordering::Acquire);
        let (step, joined) = match self.stage {
            Stage::Round { round: r, step } if r == round => (step, false),
            _ => (None, true),
        };
        if joined {
            self.window = Window::default();
        }
        let now = disk.now();
        let k =
            (now >= start).then(|| ((now - start) / disk.slot.load(Ordering::Relaxed)) as usize);
        let k = k.map(|k| k.min(STEPS));
        let mut to = None;
        if k != step {
            if let Some(prev) = step.filter(|&s| s < STEPS) {
                let cpu = thread_cpu_ns().saturating_sub(self.slot_cpu);
                disk.add(round, prev, self.slot_ios, cpu);
            }
            self.slot_ios = 0;
            if let Some(k) = k {
                self.slot_cpu = thread_cpu_ns();
                to = (k < STEPS).then(|| CANDIDATES[SCHEDULE[k]]);
            }
        }
        self.stage = Stage::Round { round, step: k };
        // The slots are over: after one more slot (for every queue to add its last
        // count), decide. A round nobody completed I/O to decide in time (the disk went
        // idle in it) is measured again rather than decided on stale counts.
        let slot = disk.slot.load(Ordering::Relaxed);
        let end = start + (STEPS as u64 + 1) * slot;
        if now >= end + STEPS as u64 * slot {
            disk.restart(start);
        } else if now >= end && disk.decide(start) {
            let decided = disk.decided.load(Ordering::Acquire);
            self.adopt(core, decided);
            return;
        }
        if let Some(to) = to {
            self.switch(core, to);
        }
    }

    /// Take the disk's decision number `decided`.
    fn adopt(&mut self, core: &mut Core, decided: u64) {
        let pick = CANDIDATES[core.shared.auto.pick.load(Ordering::Relaxed) as usize];
        self.decided = decided;
        self.stage = Stage::Chosen;
        self.chosen = self.window.signature();
        self.window = Window::default();
        self.phase_ios = 0;
        self.phase_start = Instant::now();
        self.switch(core, pick);
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(choose(&t, None), (Batch, false));
        let t = [
            trial(Bio, 1.00e6, 0.5),
            trial(Batch, 1.02e6, 0.6),
            trial(Request, 0.90e6, 0.4),
        ];
        assert_eq!(choose(&t, None), (Bio, false), "within 3 %: less CPU");
        assert_eq!(
            choose(&t, Some(Batch)),
            (Batch, true),
            "in use and tied: kept"
        );
        assert_eq!(
            choose(&t, Some(Request)),
            (Bio, false),
            "in use but 12 % behind"
        );
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
        disk.begin(Duration::ZERO);
        assert_eq!(disk.round.load(Ordering::Acquire), 1, "one round at a time");
        // Two queues, in the first six slots (bio, batch, request, request, batch, bio;
        // nothing in the others). Queue A alone
        // would see batch ahead (it got the CPU in batch's slots); the disk's totals
        // favour bio.
        let per_queue = [
            [10_000, 30_000, 5_000, 5_000, 30_000, 10_000],
            [50_000, 10_000, 20_000, 20_000, 10_000, 50_000],
        ];
        for q in per_queue {
            for (k, ios) in q.into_iter().enumerate() {
                disk.add(round, k, ios, ios * 500);
            }
        }
        disk.add(round + 1, 0, 1_000_000, 0);
        assert!(disk.decide(start));
        assert!(!disk.decide(start), "decided once");
        assert_eq!(disk.decided.load(Ordering::Acquire), 1);
        assert_eq!(
            CANDIDATES[disk.pick.load(Ordering::Acquire) as usize],
            PathKind::Bio
        );
        let t = disk.trials();
        // Each path's IOPS: its I/Os over all its slots (STEPS / 3 of them).
        let path_s = SLOT.as_secs_f64() * (STEPS / CANDIDATES.len()) as f64;
        assert_eq!(t[0].path, PathKind::Bio);
        assert!((t[0].iops - 120_000.0 / path_s).abs() < 1.0, "{t:?}");
        assert!((t[1].iops - 80_000.0 / path_s).abs() < 1.0, "{t:?}");
        assert!((t[0].cpu_us_per_io - 0.5).abs() < 1e-9, "{t:?}");
        assert_eq!(disk.start.load(Ordering::Acquire), IDLE);
        // Nothing is added between rounds.
        disk.add(round, 0, 5, 5);
        assert_eq!(disk.ios[0].get(), 120_000 / 2);
        // The next round starts from zero and keeps bio while it stays among the best.
        disk.begin(Duration::ZERO);
        let start = disk.start.load(Ordering::Acquire);
        for k in 0..STEPS {
            disk.add(2, k, 100_000, 1);
        }
        assert!(disk.decide(start));
        assert_eq!(
            CANDIDATES[disk.pick.load(Ordering::Acquire) as usize],
            PathKind::Bio
        );
        assert_eq!(disk.recheck.load(Ordering::Relaxed), ns(RECHECK) * 2);
    }

    #[test]
    fn a_round_left_undecided_is_measured_again_not_decided_on_stale_counts() {
        let disk = AutoDisk::new();
        disk.begin(Duration::ZERO);
        let start = disk.start.load(Ordering::Acquire);
        disk.add(1, 0, 500, 1);
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
}
