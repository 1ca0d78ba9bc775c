//! The adaptive polling window: polling only while it pays for itself.
//!
//! After its queues run dry a worker spins for up to the current window before it re-arms
//! notifications and sleeps. Spinning costs the CPU it spins for; sleeping costs the CPU of
//! one trip through the scheduler (block in epoll, be woken by an eventfd), which the
//! worker measures on itself (on a nested VM 4-16 µs, on bare metal 1-3 µs), plus the
//! latency of the wake-up. These rules bound what polling may cost:
//!
//! - **The window never exceeds the measured cost of a sleep.** This is spin-then-block
//!   with the spin bounded by the cost of blocking (the ski-rental rule): whenever the next
//!   request comes, the CPU spent on one idle period is at most twice what the better of
//!   "sleep at once" and "spin until it comes" would have spent. Work that comes later than
//!   a sleep's cost (a disk that takes 50 µs, an idle guest) never makes the worker spin
//!   for it.
//! - **Polling goes on only while it costs less per request than sleeping.** A sleep is
//!   not paid once per request: the requests that arrive while the worker sleeps and wakes
//!   are served by one wake-up (at 500 k IOPS offered, about twenty). So the worker keeps
//!   two running figures, both in CPU per unit of work served (requests taken from a ring
//!   plus completions taken from the engine): polling's (the spin of each polled idle
//!   period, plus the sleep after a window that ran out, over the work served after it)
//!   and sleeping's (a sleep's cost over the work served per wake-up). While polling's is
//!   the higher, the worker sleeps at once, except one idle period in [`PROBE_EVERY`],
//!   which spins for the floor (a thirty-second of the bound): that probe keeps polling's
//!   figure up to date for when the load changes, at an eighth of what spinning the floor
//!   every time cost (at 500 k IOPS offered, requests 2 µs apart, floor spins found one
//!   request each and made the default configuration cost 23 % more CPU than
//!   `--poll-us 0`).
//! - **Whichever regime measures best, by the clock.** The CPU figures above are per idle
//!   period and say nothing of two costs: the requests that come while the worker sleeps
//!   wait for the wake-up (tens of µs across cores on a nested VM), so a guest limited by
//!   its queue depth goes slower (at QD32 the same run settled at 1.5 M or at 4.4 M IOPS
//!   depending on the regime it fell into); and each busy period has a fixed cost of its
//!   own, so spins that each find one request of a paced guest cost more than they
//!   save (at 100 k IOPS offered the adaptive window spent 2.37 µs of CPU per request
//!   where the grace alone spent 1.83). So every [`TRIAL_EVERY`] the worker runs a trial:
//!   one epoch of [`EPOCH`] in each regime the flags allow, in rotating order: *poll* (the
//!   window at its bound), *adapt* (the window below, under the CPU rule) and *lean*
//!   (only `--poll-us 0`'s grace, below), and last, with `--coalesce-us`, *coalesce* (no
//!   spin, then a sleep with kicks off: see [`Regime::Coalesce`]). It compares the work served per second and
//!   the CPU time per unit of work, and keeps until the next trial the regime that costs
//!   the least CPU per unit of work, unless another brought work at least [`GAIN_MIN`]
//!   times as fast and its gain in pace is at least its cost in CPU per unit of work
//!   (the guest gets as much more throughput as it costs more CPU per request). The
//!   regime running stays while it is within [`KEEP_WITHIN`] of the cheapest. Epochs are
//!   of equal length by the clock, unlike idle periods sorted by how they ended: a spin
//!   that found work is, by being a hit, a short gap, so per-period rates favour polling
//!   even for a paced guest. While the choice holds the trials space out to one in four
//!   seconds; a trial costs a paced guest at most one epoch of spinning (0.25-1 % of a
//!   CPU). A trial that spans an idle spell is dropped, and so is one with an epoch at a
//!   tenth of another's pace (the guest started or stopped inside it), unless the trial
//!   before was dropped for that too (then the regime really is that slow).
//! - **Within those bounds the window adapts**: when spinning found work it doubles; when
//!   it ran out it halves, down to the floor.
//!
//! - **Two kinds of idle period, learned apart.** An idle period with operations at
//!   the disk waits for the disk as much as for the guest; one with none waits for the
//!   guest alone. They are different waits: at QD1 on an O_DIRECT file the first lasts a
//!   disk's latency (tens of µs: spinning it is lost), the second the driver's answer to
//!   a completion (a µs or two: spinning it saves a wake-up per request). One window fed
//!   by both learned from the first to sleep at once in the second, and the worker slept
//!   twice per request (two wake-ups, where qemu-storage-daemon's main loop takes one).
//!   So each kind has its own window, grace, CPU figures and count of idle periods (in
//!   which the probes below are counted: "one idle period in N" is one of its kind); a
//!   sleep's cost, the regime and the trials are the thread's. The kind is the thread's
//!   too: an idle period is the disk's when any worker on the thread has requests at its
//!   engine or held by QoS limits as it begins, so the split helps at QD1, and a thread
//!   whose disks always have requests at the engine (QD32 on a file) learns as before.
//!
//! `--poll-us` is the ceiling. Until the first sleep has been measured the ceiling alone
//! bounds the window.
//!
//! `--poll-us 0` has no window, only a grace of [`GRACE`] (a few µs), and no trials
//! unless `--coalesce-us` gives the grace something to be tried against: at QD1 a driver
//! that watches its used ring answers a completion within one or two microseconds, and
//! a worker that slept at once made it pay a cross-core wake-up (tens of µs on a nested
//! VM) per request. qemu-storage-daemon's main loop, which never polls, is kept awake
//! by its own overhead after each completion and so finds the next request waiting;
//! the grace does on purpose, and for no longer, what that overhead does by accident.
//! It is kept while it finds work and dropped at the first idle period it does not;
//! then one idle period in [`GRACE_PROBE_EVERY`] tries it again. A paced guest (requests
//! farther apart than the grace) pays one grace per that many idle periods.

use std::time::{Duration, Instant};

/// How much a new sample moves a running figure (1/8).
const WEIGHT: f64 = 1.0 / 8.0;
/// Measure one sleep in this many (the measurement itself takes two system calls).
pub(crate) const SAMPLE_EVERY: u32 = 16;
/// While polling does not pay, one idle period in this many still spins for the floor.
pub(crate) const PROBE_EVERY: u32 = 8;
/// `--poll-us 0`'s grace: how long a worker spins after its queues run dry while the
/// guest answers completions within it.
pub(crate) const GRACE: Duration = Duration::from_micros(4);
/// Without the grace, one idle period in this many still spins it.
pub(crate) const GRACE_PROBE_EVERY: u32 = 32;
/// How often the worker runs a trial (one epoch per regime) while its choice changes, and
/// how long each epoch is.
pub(crate) const TRIAL_EVERY: Duration = Duration::from_secs(1);
pub(crate) const EPOCH: Duration = Duration::from_millis(10);
/// Each trial in a row that keeps the choice doubles the time to the next, up to this
/// many doublings (a settled load pays for a trial every 4 s).
const TRIAL_SPACING_MAX: u32 = 2;
/// An epoch first seen to end this late, with the worker asleep for most of it, spanned
/// an idle spell of the guest: not counted.
const EPOCH_STALE: Duration = Duration::from_millis(40);
/// A regime that costs more CPU per unit of work is chosen when its epoch served work at
/// least this many times as fast as the cheapest's (below it, the difference is noise or
/// a paced guest's catching up).
pub(crate) const GAIN_MIN: f64 = 1.2;
/// The regime running keeps its place while it costs at most this much more CPU per unit
/// of work than the cheapest (measurement noise must not flip it every trial).
const KEEP_WITHIN: f64 = 1.03;
/// A trial one of whose epochs served work at less than 1/TRANSITION of another's pace
/// saw the guest start or stop: it decides nothing.
const TRANSITION: f64 = 10.0;
/// ... unless the trials before it were, this many in a row: then it decides as it finds.
const TRANSITIONS_IN_A_ROW: u32 = 1;
/// Trials that served less work than this decide nothing (an idle guest); the next
/// then comes after [`TRIAL_RETRY`].
const TRIAL_MIN_WORK: u64 = 64;
const TRIAL_RETRY: Duration = Duration::from_millis(100);

/// A testing aid: a worker thread runs only the regime this names (`poll`, `adapt`,
/// `lean`, `coalesce`) and no trials, if the flags allow it, so that a test can see one
/// regime's behaviour without depending on what the trials would measure.
pub const PIN_REGIME_ENV: &str = "VBLK_TEST_POLL_REGIME";

/// How a worker spends its idle periods; a trial runs an epoch of each and the worker
/// keeps the one it chose until the next trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Regime {
    /// The adaptive window under the CPU rule (the choice until a trial has decided,
    /// unless `--poll-us 0` makes it the grace; 0, the statistics' zero value).
    Adapt = 0,
    /// Spin the whole window (the bound) in every idle period.
    Poll = 1,
    /// Only the grace, while it finds work (what `--poll-us 0` always does).
    Lean = 2,
    /// No spin: the worker sleeps with kicks still off for up to `--coalesce-us` and
    /// serves what came meanwhile; a sleep that finds nothing re-arms kicks (one wake-up
    /// serves several requests of a paced guest, each waiting at most that long).
    Coalesce = 3,
}

const REGIMES: usize = 4;
const ALL: [Regime; REGIMES] = [Regime::Adapt, Regime::Poll, Regime::Lean, Regime::Coalesce];

impl Regime {
    /// The name `vblk stats` shows.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Regime::Poll => "poll",
            Regime::Adapt => "adapt",
            Regime::Lean => "lean",
            Regime::Coalesce => "coalesce",
        }
    }

    /// The regime stored as `n` in the statistics.
    pub(crate) fn from_u64(n: u64) -> Regime {
        ALL.get(n as usize).copied().unwrap_or(Regime::Adapt)
    }
}

/// The epochs that measure what each regime costs and how fast the guest goes under it.
#[derive(Debug, Clone, Copy)]
struct Trial {
    /// When the next trial begins.
    next_at: Instant,
    /// The epoch running (its index in the trial's order), if any, since when, and the
    /// thread's CPU time then.
    epoch: Option<(usize, Instant, Duration)>,
    /// The order of this trial's epochs (the first three rotated after each trial, the
    /// coalescing one last).
    order: [Regime; REGIMES],
    /// Per regime: work served, wall-clock time, CPU time.
    work: [u64; REGIMES],
    wall: [Duration; REGIMES],
    cpu: [Duration; REGIMES],
    /// The regime the last trial chose (the adaptive window until one has).
    choice: Regime,
    /// Trials in a row that kept the choice (they space the next out).
    kept: u32,
    /// Trials in a row dropped as [`Verdict::Transition`].
    transitions: u32,
    /// The regimes this worker may run (the polling ones need `--poll-us` above 0, the
    /// coalescing one `--coalesce-us`); a trial runs an epoch of each.
    allowed: [bool; REGIMES],
}

/// The regime to run, from each regime's pace (work per second) and CPU per unit of
/// work: the cheapest, unless another brought work at least [`GAIN_MIN`] times as fast
/// and no less faster than it costs more CPU per unit of work (then the fastest such).
/// The `current` regime counts as the cheapest while within [`KEEP_WITHIN`] of it, and
/// stays while it qualifies and is within [`KEEP_WITHIN`] of the chosen one's pace.
fn choose(pace: &[f64; REGIMES], cost: &[f64; REGIMES], current: Regime) -> Regime {
    let current = current as usize;
    let mut cheapest = (0..REGIMES)
        .min_by(|&a, &b| cost[a].total_cmp(&cost[b]))
        .unwrap_or(0);
    if cost[current] <= cost[cheapest] * KEEP_WITHIN {
        cheapest = current;
    }
    let pays = |r: usize| {
        let gain = pace[r] / pace[cheapest];
        r == cheapest || (gain >= GAIN_MIN && gain >= cost[r] / cost[cheapest])
    };
    let mut chosen = cheapest;
    for r in 0..REGIMES {
        if pays(r) && pace[r] > pace[chosen] {
            chosen = r;
        }
    }
    if pays(current) && pace[current] * KEEP_WITHIN >= pace[chosen] {
        chosen = current;
    }
    ALL[chosen]
}

/// What a trial that ended says.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    /// Run this regime until the next trial.
    Run(Regime),
    /// Too little work to tell (an idle guest).
    TooLittle,
    /// An epoch served work at less than 1/[`TRANSITION`] of another's pace: the guest
    /// started or stopped inside it, unless it happens again.
    Transition,
}

impl Trial {
    /// What the trial just ended says ([`choose`]).
    fn verdict(&self) -> Verdict {
        let ran = |r: usize| self.allowed[r];
        if self.work.iter().sum::<u64>() < TRIAL_MIN_WORK
            || (0..REGIMES).any(|r| ran(r) && self.work[r] == 0)
        {
            return Verdict::TooLittle;
        }
        // A regime not allowed has no pace and an infinite cost: never chosen.
        let pace: [f64; REGIMES] = std::array::from_fn(|r| {
            if ran(r) {
                self.work[r] as f64 / self.wall[r].as_secs_f64().max(1e-9)
            } else {
                0.0
            }
        });
        let cost: [f64; REGIMES] = std::array::from_fn(|r| {
            if ran(r) {
                self.cpu[r].as_secs_f64().max(1e-12) / self.work[r] as f64
            } else {
                f64::INFINITY
            }
        });
        // An epoch that served work at a tenth of another's pace most likely saw the
        // guest start or stop (the end of a run, a guest that pauses). A regime that is
        // that much slower (a sleep per request for a guest that answers at once) shows
        // it again in the trial after: the second such trial in a row decides.
        let top = pace.iter().copied().fold(0.0, f64::max);
        let slow = (0..REGIMES).any(|r| ran(r) && pace[r] * TRANSITION < top);
        if self.transitions < TRANSITIONS_IN_A_ROW && slow {
            return Verdict::Transition;
        }
        Verdict::Run(choose(&pace, &cost, self.choice))
    }
}

/// An exponentially weighted running average; None until the first sample.
#[derive(Debug, Clone, Copy, Default)]
struct Avg(Option<f64>);

impl Avg {
    fn add(&mut self, x: f64) {
        self.0 = Some(match self.0 {
            None => x,
            Some(a) => a + (x - a) * WEIGHT,
        });
    }
}

/// How the last idle period ended (what the busy period after it is credited to).
#[derive(Debug, Clone, Copy)]
enum Ended {
    /// Spinning found work after this long.
    Hit(Duration),
    /// The window (this long) ran out; the worker slept.
    Miss(Duration),
}

/// What an idle period waits for (each kind has its own [`Window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Nothing is at the disk: only the guest can bring work.
    Guest = 0,
    /// Requests are at the engine or held by QoS limits: their completions (or their
    /// slots), or the guest, bring work.
    Disk = 1,
}

/// What one kind of idle period has taught the worker.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// The adaptive window, before the bounds.
    cur: Duration,
    /// CPU spent on each polled idle period, ns: the spin, and the sleep after a miss.
    poll_cost: Avg,
    /// Work served after each polled idle period.
    poll_work: Avg,
    /// Work served after each sleep.
    sleep_work: Avg,
    /// The lean regime (`--poll-us 0`'s only one): the last grace spun found work.
    grace: bool,
    /// Idle periods of this kind begun (the probes are counted in them: at QD1 the two
    /// kinds alternate, and a count shared by both would give every probe to one kind).
    periods: u32,
}

/// The polling windows of one worker thread (one per [`Wait`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Poll {
    /// `--poll-us`: the window never exceeds it.
    max: Duration,
    /// One sleep's CPU cost, ns (measured one sleep in SAMPLE_EVERY).
    sleep_cost: Avg,
    /// Per [`Wait`]: its window and figures.
    kinds: [Window; 2],
    /// What the current (or last) idle period waits for.
    wait: Wait,
    /// How the idle period before the current busy period ended, and its kind.
    last: Option<(Wait, Ended)>,
    /// Sleeps until the next measurement.
    until_sample: u32,
    /// `--coalesce-us`: the longest a coalescing sleep leaves kicks off (0: never).
    coalesce: Duration,
    trial: Trial,
}

impl Poll {
    pub(crate) fn new(max_us: u64, coalesce_us: u64) -> Poll {
        let max = Duration::from_micros(max_us);
        let allowed = ALL.map(|r| match r {
            Regime::Adapt | Regime::Poll => max_us > 0,
            Regime::Lean => true,
            Regime::Coalesce => coalesce_us > 0,
        });
        let window = Window {
            cur: max,
            poll_cost: Avg::default(),
            poll_work: Avg::default(),
            sleep_work: Avg::default(),
            grace: false,
            periods: 0,
        };
        Poll {
            max,
            sleep_cost: Avg::default(),
            kinds: [window; 2],
            wait: Wait::Guest,
            last: None,
            until_sample: 0,
            coalesce: Duration::from_micros(coalesce_us),
            trial: Trial {
                next_at: Instant::now(),
                epoch: None,
                order: ALL,
                work: [0; REGIMES],
                wall: [Duration::ZERO; REGIMES],
                cpu: [Duration::ZERO; REGIMES],
                choice: if max_us > 0 {
                    Regime::Adapt
                } else {
                    Regime::Lean
                },
                kept: 0,
                transitions: 0,
                allowed,
            },
        }
    }

    /// The regime the running epoch forces, if one runs.
    fn forced_regime(&self) -> Option<Regime> {
        self.trial.epoch.map(|(i, _, _)| self.trial.order[i])
    }

    /// Run `regime` alone, without trials ([`PIN_REGIME_ENV`]); false, and nothing
    /// changed, if the flags do not allow it.
    pub(crate) fn pin(&mut self, regime: Regime) -> bool {
        if !self.trial.allowed[regime as usize] {
            return false;
        }
        self.trial.allowed = ALL.map(|r| r == regime);
        self.trial.choice = regime;
        true
    }

    /// The regime named `name` (what `vblk stats` shows).
    pub(crate) fn regime_named(name: &str) -> Option<Regime> {
        ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether trials run: more than one regime is allowed (`--poll-us 0` without
    /// `--coalesce-us`: only the grace, no trials).
    fn trials(&self) -> bool {
        self.trial.allowed.iter().filter(|&&a| a).count() > 1
    }

    /// The last trial's choice (`--poll-us 0` alone: always the grace), what `vblk stats`
    /// shows.
    pub(crate) fn choice(&self) -> Regime {
        self.trial.choice
    }

    /// The regime the worker runs now: the running epoch's, or the last trial's choice.
    pub(crate) fn regime(&self) -> Regime {
        self.forced_regime().unwrap_or(self.trial.choice)
    }

    /// How long the coming sleep may leave kicks off, if the worker coalesces now.
    pub(crate) fn coalescing(&self) -> Option<Duration> {
        (self.regime() == Regime::Coalesce).then_some(self.coalesce)
    }

    /// The first epoch at or after position `from` in the trial's order whose regime is
    /// allowed.
    fn epoch_from(&self, from: usize) -> Option<usize> {
        (from..REGIMES).find(|&i| self.trial.allowed[self.trial.order[i] as usize])
    }

    /// Advance the epochs at `now` (called at the end of each busy period); `cpu` reads
    /// this thread's CPU time, at most once per epoch boundary.
    pub(crate) fn tick(&mut self, now: Instant, cpu: impl FnOnce() -> Duration) {
        if !self.trials() {
            return;
        }
        let first = self.epoch_from(0);
        let next = self
            .trial
            .epoch
            .and_then(|(i, _, _)| self.epoch_from(i + 1));
        let t = &mut self.trial;
        match t.epoch {
            None if now >= t.next_at => {
                t.work = [0; REGIMES];
                t.epoch = first.map(|i| (i, now, cpu()));
            }
            Some((i, began, cpu0)) if now.saturating_duration_since(began) >= EPOCH => {
                let c = cpu();
                let wall = now.saturating_duration_since(began);
                let used = c.saturating_sub(cpu0);
                if wall > EPOCH_STALE && used < wall / 2 {
                    // The guest went idle during the epoch (tick runs only when a busy
                    // period ends, and the worker slept through most of it): its
                    // wall-clock time is mostly that idle spell and says nothing of
                    // any regime. Drop the trial; the choice stands. (A worker busy
                    // without a break for that long is not idle: its epoch counts.)
                    t.epoch = None;
                    t.next_at = now + TRIAL_RETRY;
                    return;
                }
                let r = t.order[i] as usize;
                t.wall[r] = wall;
                t.cpu[r] = used;
                if let Some(n) = next {
                    t.epoch = Some((n, now, c));
                } else {
                    t.epoch = None;
                    let verdict = t.verdict();
                    // The coalescing epoch stays last: a guest that waits on its
                    // completions falls behind in it and catches up after it, which
                    // would flatter whichever epoch came next.
                    t.order[..REGIMES - 1].rotate_left(1);
                    match verdict {
                        Verdict::Run(r) => {
                            t.transitions = 0;
                            if r == t.choice {
                                t.kept = (t.kept + 1).min(TRIAL_SPACING_MAX);
                            } else {
                                t.kept = 0;
                                t.choice = r;
                            }
                            t.next_at = now + TRIAL_EVERY * (1 << t.kept);
                        }
                        // Too little work to tell, or the guest started or stopped: try
                        // again soon, so that a load that starts is judged within tens of
                        // milliseconds.
                        Verdict::TooLittle => t.next_at = now + TRIAL_RETRY,
                        Verdict::Transition => {
                            t.transitions += 1;
                            t.next_at = now + TRIAL_RETRY;
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// The longest the window may be now: the ceiling, bounded by a sleep's cost.
    fn bound(&self) -> Duration {
        match self.sleep_cost() {
            Some(c) => self.max.min(c),
            None => self.max,
        }
    }

    /// The current kind of idle period's window and figures.
    fn kind(&self) -> &Window {
        &self.kinds[self.wait as usize]
    }

    /// The window and figures of idle periods of kind `wait`, to update.
    fn kind_mut(&mut self, wait: Wait) -> &mut Window {
        &mut self.kinds[wait as usize]
    }

    /// The adaptive regime's CPU rule, for the current kind of idle period: whether
    /// polling costs no more CPU per unit of work than sleeping (true until both have
    /// been seen).
    pub(crate) fn pays(&self) -> bool {
        let k = self.kind();
        let (Some(w), Some(pc), Some(pw), Some(sw)) = (
            self.sleep_cost.0,
            k.poll_cost.0,
            k.poll_work.0,
            k.sleep_work.0,
        ) else {
            return true;
        };
        // Cross-multiplied to avoid dividing by a count near zero:
        // pc / pw <= w / sw  <=>  pc * sw <= w * pw.
        pc * sw <= w * pw
    }

    /// The worker's queues ran dry: an idle period begins, waiting for `wait`.
    pub(crate) fn idle(&mut self, wait: Wait) {
        self.wait = wait;
        let k = self.kind_mut(wait);
        k.periods = k.periods.wrapping_add(1);
    }

    /// How long to spin in this idle period.
    pub(crate) fn window(&self) -> Duration {
        match self.regime() {
            Regime::Lean => {
                if self.kind().grace || self.kind().periods.is_multiple_of(GRACE_PROBE_EVERY) {
                    if self.max.is_zero() {
                        GRACE
                    } else {
                        GRACE.min(self.max)
                    }
                } else {
                    Duration::ZERO
                }
            }
            // The guest waits for our wake-ups: spin as long as a sleep would cost.
            Regime::Poll => self.bound(),
            Regime::Adapt => self.adaptive_window(),
            // Sleep at once, without kicks, for up to the coalescing delay.
            Regime::Coalesce => Duration::ZERO,
        }
    }

    /// The adaptive regime's window.
    fn adaptive_window(&self) -> Duration {
        let b = self.bound();
        if self.pays() {
            self.kind().cur.clamp(b / 32, b)
        } else if self.kind().periods.is_multiple_of(PROBE_EVERY) {
            b / 32
        } else {
            Duration::ZERO
        }
    }

    /// Spinning found work after spinning `spun`.
    pub(crate) fn hit(&mut self, spun: Duration) {
        let cur = (self.adaptive_window() * 2).min(self.bound());
        let k = self.kind_mut(self.wait);
        k.grace = true;
        k.cur = cur;
        self.last = Some((self.wait, Ended::Hit(spun)));
    }

    /// Spinning ran out without work (the worker is about to sleep).
    pub(crate) fn miss(&mut self) {
        self.last = Some((self.wait, Ended::Miss(self.window())));
        let floor = self.bound() / 32;
        let k = self.kind_mut(self.wait);
        k.grace = false;
        k.cur = (k.cur / 2).max(floor);
    }

    /// The busy period after the last idle period ended, having served `work` (requests
    /// taken from rings plus completions taken from the engine).
    pub(crate) fn busy(&mut self, work: u64) {
        if let Some(r) = self.forced_regime() {
            self.trial.work[r as usize] += work;
        }
        let work = work as f64;
        let sleep = self.sleep_cost.0.unwrap_or(0.0);
        match self.last.take() {
            Some((wait, Ended::Hit(spun))) => {
                let k = self.kind_mut(wait);
                k.poll_cost.add(spun.as_nanos() as f64);
                k.poll_work.add(work);
            }
            Some((wait, Ended::Miss(window))) => {
                let k = self.kind_mut(wait);
                k.poll_cost.add(window.as_nanos() as f64 + sleep);
                k.poll_work.add(work);
                k.sleep_work.add(work);
            }
            None => {}
        }
    }

    /// Whether the coming sleep should be measured (one in [`SAMPLE_EVERY`]); never when
    /// polling is off, since nothing would use the figure.
    pub(crate) fn sample_due(&mut self) -> bool {
        if self.max.is_zero() {
            return false;
        }
        if self.until_sample == 0 {
            self.until_sample = SAMPLE_EVERY - 1;
            true
        } else {
            self.until_sample -= 1;
            false
        }
    }

    /// A sleep that blocked cost `cpu` of this thread's CPU time.
    pub(crate) fn slept(&mut self, cpu: Duration) {
        self.sleep_cost.add(cpu.as_nanos() as f64);
    }

    /// The running estimate of a sleep's CPU cost, if measured.
    pub(crate) fn sleep_cost(&self) -> Option<Duration> {
        self.sleep_cost
            .0
            .map(|ns| Duration::from_nanos(ns.max(0.0) as u64))
    }
}

#[cfg(test)]
mod tests;
