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
//! 2. **What it measures.** Otherwise four candidates are tried on the live workload:
//!    bio, batch, the request path at the configured dispatch depth (by default the
//!    ring's size) and the request path at a shallow depth ([`ROTATIONAL_DEPTH`]), in a
//!    *round* of twenty-four time slots of 30 ms, three times in the order A B C D D C B A
//!    so that drift cancels (six slots per candidate: the disk's total over one slot
//!    varies by several per cent, and paths 5 % apart must be told apart), and **every
//!    queue of the disk runs the same candidate in the same slot**: the
//!    round is one clock shared by the disk's queues ([`AutoDisk`]), and each queue adds
//!    the I/Os it completed in a slot, and the time it measured them over, to the disk's
//!    count for that slot. The candidate with the highest IOPS wins, and among those
//!    within 3 % of it the one with the least CPU time per I/O (a paced workload gets the
//!    same IOPS on every path; then CPU decides). A candidate already in use that is
//!    still within 3 % of the best stays (no flapping between equals on noise).
//!
//!    The shallow candidate is how a disk that seeks but does not say so (most virtual
//!    disks over a hard disk; `hdd:SIZE:norot`) is found: with two requests on the ring,
//!    the rest wait in the elevator, merge and go in sector order, which on such a disk
//!    is worth 1.75-6.7x (docs/experiments.md, S4); on a disk that serves many requests
//!    at once it loses, and is not chosen. A slot is measured from the moment its
//!    candidate has *settled* on the queue: after a switch from a deep ring to the
//!    shallow depth, the requests beyond it have to complete first, which on a slow disk
//!    takes longer than a slot (32 random reads on a 7200 rpm disk: 0.4 s). The disk's
//!    IOPS in a slot is the sum of its queues' rates, each over the time it measured. A
//!    queue that saw a settling take more than half a slot starts the round again at once,
//!    with slots three times that long (up to [`SLOT_MAX`]); a settling counts only if
//!    the queue took the completions as they came (a thread that was off its CPU reaps
//!    them in bulk, and its clock says nothing about the disk). Slots of [`LONG_SLOT`]
//!    or more make a round of one pass (eight slots), and after such a round the next one
//!    (for a changed workload or a recheck) waits [`RECHECK_ROUNDS`] round lengths, so
//!    that trials keep a slow disk off its best path for at most a ninth of its time.
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
//! round, a comparison per completion while a slot settles, a clock read every 4
//! completions and four atomic adds per queue per slot.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::dispatch::Core;
use crate::io::Op;
use crate::path::request::RequestPath;
use crate::path::PathKind;
use crate::queue::QueueOptions;

mod round;
pub(crate) use round::AutoDisk;

/// Requests on the ring at once on a rotational disk: one being served, one ready behind
/// it so that the head does not wait for a round trip between requests.
pub const ROTATIONAL_DEPTH: u16 = 2;
/// What a round tries: a path, and for the request path its dispatch depth.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    path: PathKind,
    /// The request path with [`ROTATIONAL_DEPTH`] requests on the ring at most (the
    /// others wait in the elevator, where they merge and are sorted), instead of the
    /// depth the caller configured (by default the ring's size).
    shallow: bool,
}

const fn candidate(path: PathKind, shallow: bool) -> Candidate {
    Candidate { path, shallow }
}

/// The candidates of a round, and the order of its slots (indices into it): A B C D D C
/// B A, three times, or once when slots are long ([`LONG_SLOT`]).
const CANDIDATES: [Candidate; 4] = [
    candidate(PathKind::Bio, false),
    candidate(PathKind::Batch, false),
    candidate(PathKind::Request, false),
    candidate(PathKind::Request, true),
];
const SCHEDULE: [usize; 24] = [
    0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3, 2, 1, 0,
];
const STEPS: usize = SCHEDULE.len();
const LONG_STEPS: usize = 2 * CANDIDATES.len();
/// One slot of a round, at first; doubled (up to [`SLOT_MAX`]) while a slot sees fewer
/// than [`SLOT_MIN_IOS`] I/Os on the whole disk, or a round goes undecided for want of
/// completions to decide it in time; lengthened at once to three times the longest
/// settling when a switch took more than half a slot to settle (see [`Auto::follow`]).
const SLOT: Duration = Duration::from_millis(30);
const SLOT_MAX: Duration = Duration::from_millis(1920);
const SLOT_MIN_IOS: u64 = 256;
/// Slots at least this long: a round is one pass (A B C D D C B A), not three. The disk
/// is slow enough (a few hundred I/Os per slot at most) that its noise is not what the
/// repeats were for, and three passes would keep it off its best path for a minute.
const LONG_SLOT: Duration = Duration::from_millis(240);
/// How often a round may run at most, in round lengths: trials, which run the worse
/// candidates most of the time, take at most one part in nine of a disk's time.
const RECHECK_ROUNDS: u64 = 8;
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
    /// The request path's dispatch depth in this trial, when it was not the configured
    /// one (the shallow trial: 2).
    pub queue_depth: Option<u16>,
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
    /// The request path's dispatch depth now, when auto chose one that is not the
    /// configured one (the shallow depth, 2).
    pub queue_depth: Option<u16>,
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
    /// The request path dispatches at most [`ROTATIONAL_DEPTH`] requests (else
    /// `depth`).
    shallow: bool,
    /// The request path's dispatch depth the caller configured (0: the ring's size), and
    /// the one used when not shallow: that, or [`ROTATIONAL_DEPTH`] on a rotational disk.
    asked: u16,
    depth: u16,
    rotational: bool,
    stage: Stage,
    /// Whether the current slot's candidate has settled on this queue (no more requests
    /// on the ring than it allows), and when it did and the slot began (disk ns), and
    /// how many requests were over its depth then.
    settled: bool,
    settle_at: u64,
    slot_began: u64,
    excess: u32,
    /// I/Os completed in the current slot since it settled (before: while settling),
    /// and the thread's CPU time when it settled.
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
            asked: opts.request.queue_depth,
            depth: request.queue_depth,
            request: RequestPath::new(request, ring_size),
            batch: opts.batch.max(1),
            mode: if rotational {
                PathKind::Request
            } else {
                PathKind::Bio
            },
            shallow: false,
            rotational,
            stage: Stage::Chosen,
            settled: true,
            settle_at: 0,
            slot_began: 0,
            excess: 0,
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
            queue_depth: (self.mode == PathKind::Request
                && self.request.opts.queue_depth != self.asked)
                .then_some(self.request.opts.queue_depth),
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

    fn switch(&mut self, core: &mut Core, to: Candidate) {
        if self.mode == to.path && self.shallow == to.shallow {
            return;
        }
        if self.mode == PathKind::Request && to.path != PathKind::Request {
            self.request.drain(core);
        } else if self.mode != PathKind::Request {
            core.publish();
        }
        self.mode = to.path;
        self.shallow = to.shallow;
        self.request.opts.queue_depth = match (to.shallow, self.depth) {
            (true, 0) => ROTATIONAL_DEPTH,
            (true, d) => d.min(ROTATIONAL_DEPTH),
            (false, d) => d,
        };
        if to.path == PathKind::Request {
            // A deeper dispatch than before: what waits in the elevator may go now.
            self.request.run(core);
        }
    }

    /// The most requests the current candidate puts on the ring.
    fn ring_depth(&self, core: &Core) -> u32 {
        match self.mode {
            PathKind::Request if self.request.opts.queue_depth > 0 => {
                u32::from(self.request.opts.queue_depth)
            }
            _ => u32::from(core.ring.size()),
        }
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
                if !self.settled && core.requests <= self.ring_depth(core) {
                    // What the previous candidate had on the ring beyond this one's
                    // depth has completed: the slot is measured from here. The time it
                    // took counts only if this queue took those completions as they
                    // came: a thread that was off its CPU reaps them in bulk, late.
                    let disk = &core.shared.auto;
                    let drained = self.slot_ios;
                    self.settled = true;
                    self.settle_at = disk.now();
                    self.slot_ios = 0;
                    self.slot_cpu = thread_cpu_ns();
                    if let Stage::Round {
                        round,
                        step: Some(_),
                    } = self.stage
                    {
                        if drained * 2 >= u64::from(self.excess) {
                            disk.settled_in(round, self.settle_at.saturating_sub(self.slot_began));
                        }
                    }
                }
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
        let now = disk.now();
        let changed = sig.differs(&self.chosen) && now >= disk.quiet_until.load(Ordering::Relaxed);
        if changed || now >= disk.recheck_at.load(Ordering::Relaxed) {
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
            self.settled = true;
            self.slot_ios = 0;
        }
        let now = disk.now();
        let steps = disk.steps();
        let k =
            (now >= start).then(|| ((now - start) / disk.slot.load(Ordering::Relaxed)) as usize);
        let k = k.map(|k| k.min(steps));
        let mut to = None;
        if k != step {
            if let Some(prev) = step.filter(|&s| s < steps) {
                if self.settled {
                    let cpu = thread_cpu_ns().saturating_sub(self.slot_cpu);
                    let busy = now.saturating_sub(self.settle_at);
                    disk.add(round, prev, self.slot_ios, cpu, busy);
                } else {
                    // Not settled in the whole slot: how long it would have taken, at
                    // the rate the excess went down.
                    let spent = now.saturating_sub(self.slot_began);
                    let need = spent.saturating_mul(u64::from(self.excess)) / self.slot_ios.max(1);
                    disk.settled_in(round, need.max(spent));
                }
            }
            self.slot_ios = 0;
            if let Some(k) = k {
                to = (k < steps).then(|| CANDIDATES[SCHEDULE[k]]);
            }
        }
        self.stage = Stage::Round { round, step: k };
        // The slots are over: after one more slot (for every queue to add its last
        // count), decide. A round nobody completed I/O to decide in time (the disk went
        // idle in it) is measured again rather than decided on stale counts.
        let slot = disk.slot.load(Ordering::Relaxed);
        let end = start + (steps as u64 + 1) * slot;
        if now >= end + steps as u64 * slot {
            disk.restart(start);
        } else if now >= end && disk.decide(start) {
            let decided = disk.decided.load(Ordering::Acquire);
            self.adopt(core, decided);
            return;
        }
        if let Some(to) = to {
            self.switch(core, to);
            let depth = self.ring_depth(core);
            self.slot_began = now;
            self.excess = core.requests.saturating_sub(depth);
            self.settled = self.excess == 0;
            self.settle_at = now;
            self.slot_cpu = thread_cpu_ns();
        }
    }

    /// Take the disk's decision number `decided`.
    fn adopt(&mut self, core: &mut Core, decided: u64) {
        let pick = CANDIDATES
            [(core.shared.auto.pick.load(Ordering::Relaxed) as usize).min(CANDIDATES.len() - 1)];
        self.decided = decided;
        self.stage = Stage::Chosen;
        self.settled = true;
        self.slot_ios = 0;
        self.chosen = self.window.signature();
        self.window = Window::default();
        self.phase_ios = 0;
        self.phase_start = Instant::now();
        self.switch(core, pick);
    }
}

#[cfg(test)]
mod tests;
