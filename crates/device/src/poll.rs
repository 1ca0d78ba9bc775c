//! The adaptive polling window: polling only while it pays for itself.
//!
//! After its queues run dry a worker spins for up to the current window before it re-arms
//! notifications and sleeps. Spinning costs the CPU it spins for; sleeping costs the CPU of
//! one trip through the scheduler (block in epoll, be woken by an eventfd), which the
//! worker measures on itself (on a nested VM 4-16 µs, on bare metal 1-3 µs), plus the
//! latency of the wake-up. Three rules bound what polling may cost:
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
//! - **Within those bounds the window adapts**: when spinning found work it doubles; when
//!   it ran out it halves, down to the floor.
//!
//! `--poll-us` is the ceiling; 0 never spins. Until the first sleep has been measured
//! the ceiling alone bounds the window.

use std::time::Duration;

/// How much a new sample moves a running figure (1/8).
const WEIGHT: f64 = 1.0 / 8.0;
/// Measure one sleep in this many (the measurement itself takes two system calls).
pub(crate) const SAMPLE_EVERY: u32 = 16;
/// While polling does not pay, one idle period in this many still spins for the floor.
pub(crate) const PROBE_EVERY: u32 = 8;

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

/// The polling window of one worker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Poll {
    /// `--poll-us`: the window never exceeds it.
    max: Duration,
    /// The adaptive window, before the bounds.
    cur: Duration,
    /// One sleep's CPU cost, ns (measured one sleep in SAMPLE_EVERY).
    sleep_cost: Avg,
    /// CPU spent on each polled idle period, ns: the spin, and the sleep after a miss.
    poll_cost: Avg,
    /// Work served after each polled idle period.
    poll_work: Avg,
    /// Work served after each sleep.
    sleep_work: Avg,
    /// How the idle period before the current busy period ended.
    last: Option<Ended>,
    /// Sleeps until the next measurement.
    until_sample: u32,
    /// Idle periods begun (the probes are counted in them).
    idle_periods: u32,
}

impl Poll {
    pub(crate) fn new(max_us: u64) -> Poll {
        let max = Duration::from_micros(max_us);
        Poll {
            max,
            cur: max,
            sleep_cost: Avg::default(),
            poll_cost: Avg::default(),
            poll_work: Avg::default(),
            sleep_work: Avg::default(),
            last: None,
            until_sample: 0,
            idle_periods: 0,
        }
    }

    /// The longest the window may be now: the ceiling, bounded by a sleep's cost.
    fn bound(&self) -> Duration {
        match self.sleep_cost() {
            Some(c) => self.max.min(c),
            None => self.max,
        }
    }

    /// Whether polling costs no more CPU per unit of work than sleeping (true until both
    /// have been seen).
    pub(crate) fn pays(&self) -> bool {
        let (Some(w), Some(pc), Some(pw), Some(sw)) = (
            self.sleep_cost.0,
            self.poll_cost.0,
            self.poll_work.0,
            self.sleep_work.0,
        ) else {
            return true;
        };
        // Cross-multiplied to avoid dividing by a count near zero:
        // pc / pw <= w / sw  <=>  pc * sw <= w * pw.
        pc * sw <= w * pw
    }

    /// The worker's queues ran dry: an idle period begins.
    pub(crate) fn idle(&mut self) {
        self.idle_periods = self.idle_periods.wrapping_add(1);
    }

    /// How long to spin in this idle period.
    pub(crate) fn window(&self) -> Duration {
        let b = self.bound();
        if self.pays() {
            self.cur.clamp(b / 32, b)
        } else if self.idle_periods.is_multiple_of(PROBE_EVERY) {
            b / 32
        } else {
            Duration::ZERO
        }
    }

    /// Spinning found work after spinning `spun`.
    pub(crate) fn hit(&mut self, spun: Duration) {
        self.cur = (self.window() * 2).min(self.bound());
        self.last = Some(Ended::Hit(spun));
    }

    /// Spinning ran out without work (the worker is about to sleep).
    pub(crate) fn miss(&mut self) {
        self.last = Some(Ended::Miss(self.window()));
        self.cur = (self.cur / 2).max(self.bound() / 32);
    }

    /// The busy period after the last idle period ended, having served `work` (requests
    /// taken from rings plus completions taken from the engine).
    pub(crate) fn busy(&mut self, work: u64) {
        let work = work as f64;
        match self.last.take() {
            Some(Ended::Hit(spun)) => {
                self.poll_cost.add(spun.as_nanos() as f64);
                self.poll_work.add(work);
            }
            Some(Ended::Miss(window)) => {
                let sleep = self.sleep_cost.0.unwrap_or(0.0);
                self.poll_cost.add(window.as_nanos() as f64 + sleep);
                self.poll_work.add(work);
                self.sleep_work.add(work);
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
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn window_adapts_within_the_ceiling_before_any_sleep_is_measured() {
        let mut p = Poll::new(320);
        for _ in 0..10 {
            p.miss();
        }
        assert_eq!(p.window(), 10 * US);
        p.hit(US);
        assert_eq!(p.window(), 20 * US);
        for _ in 0..10 {
            p.hit(US);
        }
        assert_eq!(p.window(), 320 * US);
    }

    #[test]
    fn poll_zero_never_spins_nor_measures() {
        let mut off = Poll::new(0);
        off.hit(US);
        assert_eq!(off.window(), Duration::ZERO);
        assert!(!off.sample_due());
        off.slept(10 * US);
        off.hit(US);
        assert_eq!(off.window(), Duration::ZERO);
    }

    #[test]
    fn the_window_never_exceeds_what_a_sleep_costs() {
        let mut p = Poll::new(200);
        assert_eq!(p.window(), 200 * US);
        p.slept(8 * US);
        assert_eq!(p.sleep_cost(), Some(8 * US));
        assert_eq!(
            p.window(),
            8 * US,
            "bounded at once by the first measurement"
        );
        for _ in 0..10 {
            p.hit(US);
        }
        assert_eq!(p.window(), 8 * US, "hits do not grow it past the cost");
        for _ in 0..10 {
            p.miss();
        }
        assert_eq!(
            p.window(),
            8 * US / 32,
            "misses shrink it to 1/32 of the bound"
        );
        p.hit(US);
        assert_eq!(p.window(), 8 * US / 16);
    }

    #[test]
    fn a_cheap_ceiling_stays_the_bound_when_sleeps_cost_more() {
        let mut p = Poll::new(5);
        p.slept(40 * US);
        assert_eq!(p.window(), 5 * US);
    }

    #[test]
    fn the_sleep_cost_is_a_running_average() {
        let mut p = Poll::new(200);
        p.slept(16 * US);
        p.slept(32 * US);
        assert_eq!(p.sleep_cost(), Some(18 * US), "moves an eighth of the way");
        for _ in 0..200 {
            p.slept(4 * US);
        }
        let c = p.sleep_cost().unwrap();
        assert!(c >= 4 * US && c < 5 * US, "{c:?}");
        // Cheaper sleeps narrow the window; dearer ones widen the bound again.
        assert!(p.window() < 5 * US);
        for _ in 0..200 {
            p.slept(50 * US);
        }
        for _ in 0..10 {
            p.hit(US);
        }
        assert!(p.window() > 45 * US, "{:?}", p.window());
    }

    /// `n` idle periods that spinning ended after `spun`, each followed by `work`.
    fn hits(p: &mut Poll, n: usize, spun: Duration, work: u64) {
        for _ in 0..n {
            p.hit(spun);
            p.busy(work);
        }
    }

    /// `n` idle periods whose window ran out, each sleep costing `cost` and followed by
    /// `work`.
    fn misses(p: &mut Poll, n: usize, cost: Duration, work: u64) {
        for _ in 0..n {
            p.miss();
            p.slept(cost);
            p.busy(work);
        }
    }

    #[test]
    fn polling_pays_when_requests_come_back_sooner_than_a_sleep_costs() {
        // QD1 at saturation: the next request comes 1 µs after the completion; a sleep
        // costs 10 µs and serves one request.
        let mut p = Poll::new(200);
        misses(&mut p, 4, 10 * US, 1);
        hits(&mut p, 40, US, 1);
        assert!(p.pays());
        assert_eq!(p.window(), 10 * US, "the full bound");
    }

    #[test]
    fn polling_stops_when_a_wake_up_serves_many_requests_at_once() {
        // 500 k IOPS offered: requests 2 µs apart, one per hit, while a 10 µs sleep finds
        // twenty waiting.
        let mut p = Poll::new(200);
        misses(&mut p, 4, 10 * US, 20);
        hits(&mut p, 40, 2 * US, 1);
        assert!(!p.pays());
        let windows: Vec<Duration> = (0..2 * PROBE_EVERY)
            .map(|_| {
                p.idle();
                p.window()
            })
            .collect();
        let probes = windows.iter().filter(|w| **w == 10 * US / 32).count();
        assert_eq!(probes, 2, "one idle period in PROBE_EVERY spins the floor");
        assert_eq!(
            windows.iter().filter(|w| w.is_zero()).count(),
            windows.len() - 2,
            "the others sleep at once: {windows:?}"
        );
        // The load changes: a spin now finds whole batches (QD32 at saturation); the floor
        // window still sees them and polling resumes.
        hits(&mut p, 40, 300 * Duration::from_nanos(1), 32);
        assert!(p.pays());
        assert!(p.window() > 10 * US / 32);
    }

    #[test]
    fn polling_pays_at_saturation_where_a_spin_finds_a_whole_batch() {
        // QD32 at saturation: a spin of 2 µs finds the driver's refill of 32 requests; a
        // sleep would find the same 32 at 10 µs.
        let mut p = Poll::new(200);
        misses(&mut p, 4, 10 * US, 32);
        hits(&mut p, 40, 2 * US, 32);
        assert!(p.pays());
    }

    #[test]
    fn windows_that_run_out_shrink_to_the_floor() {
        // A slow disk or an idle guest: nothing comes within the window.
        let mut p = Poll::new(200);
        misses(&mut p, 40, 8 * US, 2);
        assert!(!p.pays());
        while !p.window().is_zero() {
            p.idle();
        }
        p.idle();
        assert!(p.window().is_zero());
        while p.window().is_zero() {
            p.idle();
        }
        assert_eq!(p.window(), 8 * US / 32, "a probe spins the floor");
    }

    #[test]
    fn one_sleep_in_sample_every_is_measured() {
        let mut p = Poll::new(200);
        let due = (0..SAMPLE_EVERY * 4).filter(|_| p.sample_due()).count();
        assert_eq!(due, 4);
    }
}
