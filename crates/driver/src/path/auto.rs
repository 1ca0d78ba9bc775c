//! `auto`: the driver picks the path per queue.
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
//! 2. **What it measures.** Otherwise bio, batch and request are each tried on the live
//!    workload in short trials (a few thousand I/Os or 30 ms each, twice, in the order
//!    A B C C B A so that drift cancels); the path with the most I/Os per second wins, and
//!    among paths within 3 % of it the one with the least CPU time per I/O (a paced workload
//!    gets the same IOPS on every path; then CPU decides). A path already in use that is
//!    still within 3 % of the best stays (no flapping between equals on noise). The workload's signature — read
//!    share, I/O size, sequential share, depth — is recorded with the choice and checked
//!    every few thousand I/Os; when it changes the trials run again, and also after 32
//!    checks regardless — 64, 128, … up to 1024 checks while the trials keep choosing the
//!    same path, so that a steady workload pays less and less for being re-measured.
//!
//! Switching away from the request path first lets everything it holds go to the ring, so
//! the ordering promises (flush barriers) hold across switches.

use std::time::{Duration, Instant};

use crate::dispatch::Core;
use crate::io::Op;
use crate::path::request::RequestPath;
use crate::path::PathKind;
use crate::queue::QueueOptions;

/// Requests on the ring at once on a rotational disk: one being served, one ready behind
/// it so that the head does not wait for a round trip between requests.
pub const ROTATIONAL_DEPTH: u16 = 2;
/// I/Os per trial at most, at least, and the time after which a trial ends anyway.
const TRIAL_IOS: u64 = 4096;
const TRIAL_MIN_IOS: u64 = 32;
const TRIAL_TIME: Duration = Duration::from_millis(30);
/// While running the chosen path: how often the signature is checked.
const CHECK_IOS: u64 = 16384;
const CHECK_TIME: Duration = Duration::from_millis(250);
/// Checks after which the trials run again even if the workload looks the same: at first,
/// and at most (the interval doubles while the trials keep choosing the same path).
const CHECKS_PER_CHOICE: u32 = 32;
const CHECKS_PER_CHOICE_MAX: u32 = 1024;
/// IOPS within this fraction of the best count as equal; CPU per I/O decides.
const IOPS_TIE: f64 = 0.03;

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

#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    ios: u64,
    wall_ns: u64,
    cpu_ns: u64,
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

#[derive(Debug)]
pub(crate) struct Auto {
    pub request: RequestPath,
    batch: u16,
    mode: PathKind,
    candidates: Vec<PathKind>,
    rotational: bool,
    /// Trial schedule (indices into `candidates`) and the step being run; None: running
    /// the chosen path.
    schedule: Vec<usize>,
    step: Option<usize>,
    tallies: Vec<Tally>,
    phase_ios: u64,
    phase_start: Instant,
    phase_cpu: u64,
    window: Window,
    last_end: u64,
    chosen: Signature,
    checks: u32,
    /// Checks before the next re-trial of an unchanged workload.
    recheck_after: u32,
    /// The path the last trials chose.
    last_pick: Option<PathKind>,
    choices: u64,
    trials: Vec<AutoTrial>,
}

impl Auto {
    pub(crate) fn new(opts: &QueueOptions, ring_size: u16, rotational: bool) -> Auto {
        let candidates = if rotational {
            vec![PathKind::Request]
        } else {
            vec![PathKind::Bio, PathKind::Batch, PathKind::Request]
        };
        let mut request = opts.request;
        if rotational && request.queue_depth == 0 {
            request.queue_depth = ROTATIONAL_DEPTH;
        }
        let n = candidates.len();
        let schedule: Vec<usize> = (0..n).chain((0..n).rev()).collect();
        let mut a = Auto {
            request: RequestPath::new(request, ring_size),
            batch: opts.batch.max(1),
            mode: candidates[0],
            rotational,
            step: None,
            tallies: vec![Tally::default(); n],
            candidates,
            schedule,
            phase_ios: 0,
            phase_start: Instant::now(),
            phase_cpu: 0,
            window: Window::default(),
            last_end: u64::MAX,
            chosen: Signature::default(),
            checks: 0,
            recheck_after: CHECKS_PER_CHOICE,
            last_pick: None,
            choices: 0,
            trials: Vec::new(),
        };
        if !rotational {
            a.step = Some(0);
        }
        a.start_phase();
        a
    }

    pub(crate) fn report(&self) -> AutoReport {
        AutoReport {
            current: self.mode,
            reason: if self.rotational {
                format!(
                    "the device reports a rotational disk: request path, {} elevator, \
                     queue depth {}",
                    self.request.opts.elevator, self.request.opts.queue_depth
                )
            } else if self.step.is_some() {
                "trials in progress".into()
            } else {
                "the best of the last trials".into()
            },
            choices: self.choices,
            trials: self.trials.clone(),
        }
    }

    fn start_phase(&mut self) {
        self.phase_ios = 0;
        self.phase_start = Instant::now();
        self.phase_cpu = thread_cpu_ns();
    }

    fn switch(&mut self, core: &mut Core, to: PathKind) {
        if self.mode == PathKind::Request && to != PathKind::Request {
            self.request.drain(core);
        } else {
            core.publish();
        }
        self.mode = to;
    }

    pub(crate) fn submit(&mut self, core: &mut Core, id: u32) {
        let e = core.table.get(id);
        let w = &mut self.window;
        w.ios += 1;
        w.reads += u64::from(e.op == Op::Read);
        w.bytes += e.bytes;
        w.sequential += u64::from(e.sector == self.last_end);
        w.depth += core.table.in_flight as u64;
        self.last_end = e.sector + e.bytes / 512;
        match self.mode {
            PathKind::Request => self.request.submit(core, id),
            _ => {
                if let Err(e) = core.send(id) {
                    // Submission already returned for the caller's sake only on the request
                    // path; here it has not, but the I/O is admitted: fail it in order.
                    core.table.fail(id, e.kind());
                }
                if self.mode == PathKind::Bio || core.ring.unpublished() >= self.batch {
                    core.publish();
                }
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
        self.phase_ios += n;
        let (min, max, time) = match self.step {
            Some(_) => (TRIAL_MIN_IOS, TRIAL_IOS, TRIAL_TIME),
            None => (TRIAL_MIN_IOS, CHECK_IOS, CHECK_TIME),
        };
        if self.phase_ios < min {
            return;
        }
        if self.phase_ios < max && (self.phase_ios & 15 != 0 || self.phase_start.elapsed() < time) {
            return;
        }
        self.end_phase(core);
    }

    fn end_phase(&mut self, core: &mut Core) {
        match self.step {
            Some(step) => {
                let i = self.schedule[step];
                let t = &mut self.tallies[i];
                t.ios += self.phase_ios;
                t.wall_ns += self.phase_start.elapsed().as_nanos() as u64;
                t.cpu_ns += thread_cpu_ns().saturating_sub(self.phase_cpu);
                if step + 1 < self.schedule.len() {
                    self.step = Some(step + 1);
                    let next = self.candidates[self.schedule[step + 1]];
                    self.switch(core, next);
                } else {
                    self.choose(core);
                }
                self.window = Window::default();
            }
            None => {
                let sig = self.window.signature();
                self.window = Window::default();
                self.checks += 1;
                if sig.differs(&self.chosen) {
                    // A new workload: what was chosen for the old one counts for nothing.
                    self.last_pick = None;
                }
                if !self.rotational
                    && (sig.differs(&self.chosen) || self.checks >= self.recheck_after)
                {
                    self.checks = 0;
                    self.tallies.iter_mut().for_each(|t| *t = Tally::default());
                    self.step = Some(0);
                    let first = self.candidates[self.schedule[0]];
                    self.switch(core, first);
                }
            }
        }
        self.start_phase();
    }

    fn choose(&mut self, core: &mut Core) {
        self.trials = self
            .candidates
            .iter()
            .zip(&self.tallies)
            .map(|(&path, t)| AutoTrial {
                path,
                iops: t.ios as f64 / (t.wall_ns.max(1) as f64 / 1e9),
                cpu_us_per_io: t.cpu_ns as f64 / 1e3 / t.ios.max(1) as f64,
            })
            .collect();
        let best = self.trials.iter().map(|t| t.iops).fold(0.0, f64::max);
        let tied = || {
            self.trials
                .iter()
                .filter(move |t| t.iops >= best * (1.0 - IOPS_TIE))
        };
        // Hysteresis: a path that is still among the best stays, and the workload is
        // re-measured less often; otherwise the least CPU per I/O among the best wins.
        let pick = match self.last_pick {
            Some(p) if tied().any(|t| t.path == p) => {
                self.recheck_after = (self.recheck_after * 2).min(CHECKS_PER_CHOICE_MAX);
                p
            }
            _ => {
                self.recheck_after = CHECKS_PER_CHOICE;
                tied()
                    .min_by(|a, b| a.cpu_us_per_io.total_cmp(&b.cpu_us_per_io))
                    .map_or(PathKind::Bio, |t| t.path)
            }
        };
        self.last_pick = Some(pick);
        self.choices += 1;
        self.step = None;
        self.chosen = self.window.signature();
        self.checks = 0;
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
