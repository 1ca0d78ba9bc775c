//! The adaptive polling window.
//!
//! After its queues run dry a worker spins for up to the current window before it re-arms
//! notifications and sleeps: on this kind of machine a cross-core eventfd wake-up costs tens
//! of microseconds while a look at the ring costs a tenth of one. The window adapts: when
//! spinning found work the window doubles (up to the configured maximum); when it found
//! none the window halves (down to a thirty-second of the maximum), so an idle device stops
//! burning a core while a busy one keeps its latency.

use std::time::Duration;

/// The polling window of one worker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Poll {
    max: Duration,
    cur: Duration,
}

impl Poll {
    pub(crate) fn new(max_us: u64) -> Poll {
        let max = Duration::from_micros(max_us);
        Poll { max, cur: max }
    }

    /// How long to spin now.
    pub(crate) fn window(&self) -> Duration {
        self.cur
    }

    /// Spinning found work.
    pub(crate) fn hit(&mut self) {
        self.cur = (self.cur * 2).min(self.max);
    }

    /// Spinning ran out without work.
    pub(crate) fn miss(&mut self) {
        self.cur = (self.cur / 2).max(self.max / 32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_adapts_within_bounds() {
        let mut p = Poll::new(320);
        for _ in 0..10 {
            p.miss();
        }
        assert_eq!(p.window(), Duration::from_micros(10));
        p.hit();
        assert_eq!(p.window(), Duration::from_micros(20));
        for _ in 0..10 {
            p.hit();
        }
        assert_eq!(p.window(), Duration::from_micros(320));
        let mut off = Poll::new(0);
        off.hit();
        assert_eq!(off.window(), Duration::ZERO);
    }
}
