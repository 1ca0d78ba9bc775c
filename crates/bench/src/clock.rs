//! The job loop's clock: nanoseconds on `CLOCK_MONOTONIC`'s scale as one integer, read from
//! the CPU's time-stamp counter where the kernel itself trusts it.
//!
//! The loop reads the clock twice per I/O (before and after its submission) and once per
//! batch of completions. Through the vDSO a read of `CLOCK_MONOTONIC` costs 23-25 ns on
//! this project's machines (`lfence; rdtsc`, the seqcount of the kernel's time data, a
//! multiply), a plain `rdtsc` 10 ns: at a few million I/Os per second the vDSO reads were
//! about a fifth of the job thread's cycles (`perf` on a null disk at QD32), time the
//! benchmark spent measuring rather than doing I/O. fio reads the counter for the same
//! reason (`clocksource=cpu`, its default where the counter is reliable).
//!
//! The counter is used only when the kernel's current clocksource is `tsc` (it has checked
//! that the counter runs at a constant rate, in step on every CPU, through idle states)
//! and the CPU says `constant_tsc` and `nonstop_tsc`; anywhere else, and on other
//! architectures, every read is `clock_gettime`. Ticks are converted with a rate
//! calibrated once per process against `CLOCK_MONOTONIC` over [`CALIBRATION`] (an error
//! of a few parts per million: a latency of 100 µs is off by less than a nanosecond).
//! The rate stays what it was at calibration while `CLOCK_MONOTONIC` follows NTP's
//! corrections (at most 500 ppm): a run's length and latencies are off by as much at most,
//! and the instants the loop compares with (the ramp's end, the deadline) are mapped onto
//! the clock again as it runs ([`Mark`]), so a long run does not end late.
//! Without `lfence` a read may execute up to the CPU's reorder window (about a hundred
//! nanoseconds) before or after the instructions around it: what a submission latency of
//! a few hundred nanoseconds can carry as error, and no completion latency can see.
//! A job that paces its I/O (`rate_iops=`) still reads `Instant` per I/O in the pacer.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the counter's rate is measured against `CLOCK_MONOTONIC`, once per process.
pub const CALIBRATION: Duration = Duration::from_millis(10);

/// How often a [`Mark`] is mapped onto the clock again, in clock time.
pub const REMAP: Duration = Duration::from_millis(100);

/// The process's clock.
#[derive(Debug)]
pub struct Clock {
    tsc: Option<TscScale>,
}

/// Ticks to nanoseconds: `base_ns + (ticks - base_ticks) * mult >> 32`.
#[derive(Debug, Clone, Copy)]
struct TscScale {
    base_ticks: u64,
    base_ns: u64,
    /// Nanoseconds per tick, in 32.32 fixed point.
    mult: u64,
}

impl Clock {
    /// The process's clock, calibrated on first use (which takes [`CALIBRATION`] where the
    /// counter is used).
    pub fn get() -> &'static Clock {
        static CLOCK: OnceLock<Clock> = OnceLock::new();
        CLOCK.get_or_init(|| Clock {
            tsc: tsc_trusted().then(calibrate).flatten(),
        })
    }

    /// Whether reads come from the time-stamp counter (else from `clock_gettime`).
    pub fn uses_tsc(&self) -> bool {
        self.tsc.is_some()
    }

    /// Now, in nanoseconds on `CLOCK_MONOTONIC`'s scale.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self.tsc {
            Some(s) => s.ns(ticks()),
            None => mono_ns(),
        }
    }

    /// `t` on this clock's scale: from an `Instant` read between two reads of this clock.
    pub fn at(&self, t: Instant) -> u64 {
        let (now, ns) = bracketed(4, || self.now_ns(), Instant::now);
        if t >= now {
            ns.saturating_add((t - now).as_nanos() as u64)
        } else {
            ns.saturating_sub((now - t).as_nanos() as u64)
        }
    }
}

/// An [`Instant`] the job loop compares the clock with, on the clock's scale, mapped again
/// every [`REMAP`] of clock time or every 1,024 looks, whichever comes first (the count
/// covers a clock that stopped advancing: a counter reset under it reads as its base).
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    at: Instant,
    ns: u64,
    next_map: u64,
    looks: u32,
}

impl Mark {
    /// `at` on `clock`.
    pub fn new(clock: &Clock, at: Instant) -> Mark {
        let ns = clock.at(at);
        Mark {
            at,
            ns,
            next_map: clock.now_ns().saturating_add(REMAP.as_nanos() as u64),
            looks: 0,
        }
    }

    /// The instant on the clock, `now` being the clock's reading.
    #[inline]
    pub fn ns(&mut self, clock: &Clock, now: u64) -> u64 {
        self.looks = self.looks.wrapping_add(1);
        if now >= self.next_map || self.looks.is_multiple_of(1024) {
            *self = Mark {
                looks: self.looks,
                ..Mark::new(clock, self.at)
            };
        }
        self.ns
    }

    /// The instant on the clock as last mapped.
    #[inline]
    pub fn last(&self) -> u64 {
        self.ns
    }
}

impl TscScale {
    #[inline]
    fn ns(&self, ticks: u64) -> u64 {
        let d = ticks.wrapping_sub(self.base_ticks);
        // A counter read on another CPU a little behind the base (within the kernel's
        // synchronisation check) reads as the base, never as centuries later.
        if d > u64::MAX / 2 {
            return self.base_ns;
        }
        self.base_ns + ((u128::from(d) * u128::from(self.mult)) >> 32) as u64
    }
}

/// Nanoseconds on `CLOCK_MONOTONIC`, the clock [`Instant`] reads on Linux, as one integer.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec.max(0) as u64) * 1_000_000_000 + ts.tv_nsec.max(0) as u64
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks() -> u64 {
    // SAFETY: `rdtsc` reads a counter into registers and touches no memory; the intrinsic
    // has no memory-safety precondition (a process that disabled it with PR_SET_TSC gets
    // SIGSEGV, which this program never asks for).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks() -> u64 {
    mono_ns()
}

/// The kernel keeps time with the counter and the CPU says it is invariant.
fn tsc_trusted() -> bool {
    let source =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .unwrap_or_default();
    source.trim() == "tsc" && invariant_tsc()
}

/// The CPU's counter is invariant (`constant_tsc`, `nonstop_tsc`), whatever the kernel
/// keeps time with.
fn invariant_tsc() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    has("constant_tsc") && has("nonstop_tsc")
}

/// `inner` read between two reads of `outer` (nanoseconds), the tightest bracket of
/// `tries` (a preemption between the reads would widen it): what `inner` read, and the
/// bracket's midpoint.
fn bracketed<T>(tries: u32, outer: impl Fn() -> u64, inner: impl Fn() -> T) -> (T, u64) {
    let mut best: Option<(u64, T, u64)> = None;
    for _ in 0..tries.max(1) {
        let a = outer();
        let v = inner();
        let spread = outer().saturating_sub(a);
        if best.as_ref().is_none_or(|b| spread < b.0) {
            best = Some((spread, v, a + spread / 2));
        }
    }
    let (_, v, mid) = best.expect("at least one try");
    (v, mid)
}

/// The counter's rate against `CLOCK_MONOTONIC`; none if the counter did not advance with it.
fn calibrate() -> Option<TscScale> {
    let (t0, n0) = bracketed(8, mono_ns, ticks);
    std::thread::sleep(CALIBRATION);
    let (t1, n1) = bracketed(8, mono_ns, ticks);
    let (dt, dn) = (t1.checked_sub(t0)?, n1.checked_sub(n0)?);
    if dt == 0 || dn < CALIBRATION.as_nanos() as u64 {
        return None;
    }
    let mult = u64::try_from((u128::from(dn) << 32) / u128::from(dt)).ok()?;
    Some(TscScale {
        base_ticks: t1,
        base_ns: n1,
        mult,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read` against `CLOCK_MONOTONIC` over 50 ms, nested both ways so that a preemption
    /// between two reads widens the bounds instead of failing: the clock's interval must
    /// lie inside the outer monotonic one and contain the inner one, give or take `slack`.
    fn keeps_step(read: impl Fn() -> u64, slack: u64) {
        let (m0, c0) = (mono_ns(), read());
        let m0_in = mono_ns();
        std::thread::sleep(Duration::from_millis(50));
        let m1_in = mono_ns();
        let (c1, m1) = (read(), mono_ns());
        assert!(
            c0 + slack >= m0 && c1 <= m1 + slack,
            "clock {c0}..{c1} outside monotonic {m0}..{m1} (slack {slack} ns)"
        );
        let dc = c1.saturating_sub(c0);
        assert!(
            dc + slack >= m1_in - m0_in && dc <= m1 - m0 + slack,
            "50 ms: clock {dc} ns, monotonic {}..{} ns (slack {slack} ns)",
            m1_in - m0_in,
            m1 - m0
        );
    }

    #[test]
    fn the_process_clock_keeps_step_with_clock_monotonic() {
        let c = Clock::get();
        // Where the kernel keeps time with the counter (this project's machines), the
        // counter is what the loop reads.
        assert_eq!(c.uses_tsc(), tsc_trusted(), "{c:?}");
        for _ in 0..5 {
            // Up to a few ppm of calibration error since the base, plus NTP's slew.
            let age = c.now_ns().saturating_sub(c.tsc.map_or(0, |s| s.base_ns));
            keeps_step(|| c.now_ns(), 50_000 + age / 1_000);
        }
    }

    #[test]
    fn a_calibrated_counter_keeps_step_with_clock_monotonic() {
        // The counter path on any CPU with an invariant counter, even where the kernel
        // keeps time with another clocksource (a CI VM on kvm-clock).
        if !invariant_tsc() {
            assert!(!Clock::get().uses_tsc());
            return;
        }
        let scale = calibrate().expect("an invariant counter calibrates");
        keeps_step(|| scale.ns(ticks()), 50_000);
    }

    #[test]
    fn a_counter_read_behind_the_base_reads_as_the_base() {
        let s = TscScale {
            base_ticks: 1_000,
            base_ns: 5_000,
            mult: 1 << 31,
        };
        assert_eq!(s.ns(1_000), 5_000);
        assert_eq!(s.ns(3_000), 6_000);
        assert_eq!(s.ns(999), 5_000);
        // 2^62 ticks later (centuries at any clock rate): no overflow.
        assert_eq!(s.ns(1_000 + (1 << 62)), 5_000 + (1 << 61));
    }

    #[test]
    fn instants_map_onto_the_clock() {
        let c = Clock::get();
        // Read around the instant's own read, so that a preemption anywhere here widens
        // the bounds instead of failing the test.
        let before = c.now_ns();
        let past = Instant::now() - Duration::from_millis(30);
        let (at, after) = (c.at(past), c.now_ns());
        let slack = 1_000_000;
        assert!(
            at + 30_000_000 + slack >= before && at + 30_000_000 <= after + slack,
            "30 ms ago mapped to {at}, now {before}..{after}"
        );
        let later = Instant::now() + Duration::from_millis(30);
        let at = c.at(later);
        std::thread::sleep(later.saturating_duration_since(Instant::now()));
        let now = c.now_ns();
        assert!(
            now + slack >= at && now < at + 1_000_000_000,
            "at {at}, woke at {now}"
        );
    }

    #[test]
    fn a_mark_is_mapped_again_when_the_clock_stops() {
        // A clock whose counter stopped (reads its base forever): the deadline still comes,
        // from the looks.
        let stuck = Clock {
            tsc: Some(TscScale {
                base_ticks: ticks().wrapping_add(u64::MAX / 2),
                base_ns: 1_000_000_000,
                mult: 1 << 32,
            }),
        };
        assert_eq!(stuck.now_ns(), 1_000_000_000);
        let mut m = Mark::new(&stuck, Instant::now() + Duration::from_millis(20));
        assert!(m.last() > stuck.now_ns());
        std::thread::sleep(Duration::from_millis(30));
        let now = stuck.now_ns();
        let passed = (0..1024).any(|_| now >= m.ns(&stuck, now));
        assert!(
            passed,
            "the mark stayed at {} with the clock at {now}",
            m.last()
        );
    }
}
