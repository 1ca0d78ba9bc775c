//! fio's `rate_iops=` and `rate=`: I/Os of each direction are issued no faster than the
//! rate allows (fio's `rate_process=linear`), so that devices can be compared at equal
//! offered load. Each direction has its own clock: an I/O may start when that clock is
//! due; starting it advances the clock by the I/O's share of the rate. A clock left
//! behind (the device was slower, or the job waited) catches up with a burst of at most
//! [`BURST`], not all at once.

use std::time::{Duration, Instant};

use crate::job::JobSpec;
use crate::workload::IoDir;

/// How far behind a direction's clock may fall before it is pulled up.
pub const BURST: Duration = Duration::from_millis(10);

/// The pacing of one job clone.
#[derive(Debug)]
pub struct Pacer {
    iops: [u64; 2],
    bps: [u64; 2],
    next: [Instant; 2],
}

fn dir_index(d: IoDir) -> usize {
    match d {
        IoDir::Read => 0,
        IoDir::Write => 1,
    }
}

impl Pacer {
    /// The pacer of `spec`, or None when it sets no rate. Makes the calling thread's
    /// sleeps precise (timer slack 1 ns instead of 50 µs): the pacer sleeps for gaps of
    /// microseconds.
    pub fn of(spec: &JobSpec, start: Instant) -> Option<Pacer> {
        if spec.rate_iops == [0, 0] && spec.rate == [0, 0] {
            return None;
        }
        // SAFETY: prctl(PR_SET_TIMERSLACK) takes an integer and touches no memory.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64) };
        Some(Pacer {
            iops: spec.rate_iops,
            bps: spec.rate,
            next: [start; 2],
        })
    }

    /// When an I/O of direction `dir` may start, if not `now`.
    pub fn due(&self, dir: IoDir, now: Instant) -> Option<Instant> {
        let t = self.next[dir_index(dir)];
        (t > now).then_some(t)
    }

    /// An I/O of `dir` and `len` bytes starts `now`.
    pub fn started(&mut self, dir: IoDir, len: u64, now: Instant) {
        let i = dir_index(dir);
        let mut step = Duration::ZERO;
        if let Some(ns) = 1_000_000_000u64.checked_div(self.iops[i]) {
            step = step.max(Duration::from_nanos(ns));
        }
        if self.bps[i] > 0 {
            let ns = (u128::from(len) * 1_000_000_000 / u128::from(self.bps[i])) as u64;
            step = step.max(Duration::from_nanos(ns));
        }
        let floor = now.checked_sub(BURST).unwrap_or(now);
        self.next[i] = self.next[i].max(floor) + step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_pacing_with_a_bounded_burst() {
        let t0 = Instant::now();
        let spec = JobSpec {
            rate_iops: [1000, 0],
            rate: [0, 4096 * 100],
            ..JobSpec::default()
        };
        let mut p = Pacer::of(&spec, t0).unwrap();
        assert_eq!(p.due(IoDir::Read, t0), None);
        p.started(IoDir::Read, 4096, t0);
        assert_eq!(p.due(IoDir::Read, t0), Some(t0 + Duration::from_millis(1)));
        // Writes: 100 4 KiB writes per second by bandwidth.
        p.started(IoDir::Write, 4096, t0);
        assert_eq!(
            p.due(IoDir::Write, t0),
            Some(t0 + Duration::from_millis(10))
        );
        // Far behind: the clock is pulled up to now - BURST, not left at t0.
        let late = t0 + Duration::from_secs(5);
        assert_eq!(p.due(IoDir::Read, late), None);
        p.started(IoDir::Read, 4096, late);
        assert_eq!(p.next[0], late - BURST + Duration::from_millis(1));
        assert!(Pacer::of(&JobSpec::default(), t0).is_none());
    }
}
