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
//! Without `lfence` a read may move a few dozen cycles past neighbouring instructions,
//! which no latency this benchmark reports can see.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the counter's rate is measured against `CLOCK_MONOTONIC`, once per process.
pub const CALIBRATION: Duration = Duration::from_millis(10);

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

    /// `t` on this clock's scale.
    pub fn at(&self, t: Instant) -> u64 {
        let (now, ns) = (Instant::now(), self.now_ns());
        if t >= now {
            ns.saturating_add((t - now).as_nanos() as u64)
        } else {
            ns.saturating_sub((now - t).as_nanos() as u64)
        }
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
pub fn mono_ns() -> u64 {
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
    // SAFETY: `rdtsc` reads a counter; it has no preconditions and touches no memory.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn ticks() -> u64 {
    mono_ns()
}

/// The kernel keeps time with the counter and the CPU says it is invariant.
fn tsc_trusted() -> bool {
    if !cfg!(target_arch = "x86_64") {
        return false;
    }
    let source =
        std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
            .unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or("");
    let has = |f: &str| flags.split_whitespace().any(|w| w == f);
    source.trim() == "tsc" && has("constant_tsc") && has("nonstop_tsc")
}

/// A (counter, monotonic ns) pair read as close together as a few tries allow.
fn pair() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..8 {
        let a = mono_ns();
        let t = ticks();
        let b = mono_ns();
        let spread = b.saturating_sub(a);
        if spread < best.0 {
            best = (spread, t, a + spread / 2);
        }
    }
    (best.1, best.2)
}

/// The counter's rate against `CLOCK_MONOTONIC`; none if the counter did not advance with it.
fn calibrate() -> Option<TscScale> {
    let (t0, n0) = pair();
    std::thread::sleep(CALIBRATION);
    let (t1, n1) = pair();
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

    #[test]
    fn the_clock_keeps_step_with_clock_monotonic() {
        let c = Clock::get();
        // Where the kernel keeps time with the counter (this project's machines), the
        // counter is what the loop reads.
        assert_eq!(c.uses_tsc(), tsc_trusted(), "{c:?}");
        for _ in 0..5 {
            let (m0, c0) = (mono_ns(), c.now_ns());
            std::thread::sleep(Duration::from_millis(50));
            let (c1, m1) = (c.now_ns(), mono_ns());
            // Read inside the monotonic bracket, up to the calibration's error (a few ppm
            // of the time since it) and the pair's spread.
            let slack = 20_000;
            assert!(
                c0 + slack >= m0 && c1 <= m1 + slack,
                "clock {c0}..{c1} outside monotonic {m0}..{m1}"
            );
            let (dm, dc) = ((m1 - m0) as f64, (c1 - c0) as f64);
            assert!(
                (dc / dm - 1.0).abs() < 1e-3,
                "50 ms: clock {dc} ns, monotonic {dm} ns"
            );
        }
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
    }

    #[test]
    fn an_instant_maps_onto_the_clock() {
        let c = Clock::get();
        let later = Instant::now() + Duration::from_millis(30);
        let at = c.at(later);
        std::thread::sleep(later.saturating_duration_since(Instant::now()));
        let now = c.now_ns();
        assert!(
            now >= at && now - at < 1_000_000_000,
            "at {at}, woke at {now}"
        );
    }
}
