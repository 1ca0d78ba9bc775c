//! The reset fence: a request taken before a reset never reaches the disk or guest memory
//! after a request taken after it, on any queue of the device.
//!
//! Stopping a ring (GET_VRING_BASE, which QEMU sends before every reset, reboot, `stop` and
//! shutdown) waits for the ring's requests, so normally nothing from before is left when
//! the next start comes. Two things leave requests behind: a drain that ran out of time
//! (storage that holds a request for longer than `--drain-timeout-secs`), and a worker
//! thread that could not be joined in time at the end of a session. Their requests are
//! *old*: they stay in the engine until it hands them back, their completions are never
//! published, and they are counted here, daemon-wide (across sessions and workers).
//!
//! While any old request is out, every queue that starts is *fenced*: it takes nothing
//! from its ring (not even the heads an inflight region asks to resubmit) until the count
//! is back to zero. Queues that were running before are not affected: they are not "after"
//! anything. The wait is counted and logged ([`FenceStats`], `vblk stats`).
//!
//! Old requests always end: the file engines' I/O is the kernel's to finish (it cannot be
//! cancelled once submitted, and no later request overtakes it), and the NBD engine fails
//! what its server does not answer within its bounded reconnect window. A fence therefore
//! holds new requests until the old ones are finished — it never fails them, which would
//! turn a slow disk into a guest's file system errors.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::daemon::Controls;
use crate::stats::FenceStats;

/// Old requests, daemon-wide.
#[derive(Debug, Default)]
pub(crate) struct Fence {
    old: AtomicUsize,
    /// Workers that exist (made and not yet dropped): one may still have requests at its
    /// engine that no fence counts yet, while its thread is busy.
    workers: AtomicUsize,
    stats: Arc<FenceStats>,
    /// The disk's controls, poked when the last old request or worker is gone: the image
    /// is let go only then (a migration's switchover, a frontend that left), and the
    /// disk's thread waits for that.
    waker: OnceLock<Arc<Controls>>,
}

impl Fence {
    pub(crate) fn new(stats: Arc<FenceStats>) -> Fence {
        Fence {
            old: AtomicUsize::new(0),
            workers: AtomicUsize::new(0),
            stats,
            waker: OnceLock::new(),
        }
    }

    /// Poke `controls` whenever the fence becomes clear.
    pub(crate) fn set_waker(&self, controls: Arc<Controls>) {
        let _ = self.waker.set(controls);
    }

    /// Nothing old is out and no worker exists: nothing this disk took can still reach
    /// it.
    pub(crate) fn clear(&self) -> bool {
        self.old() == 0 && self.workers() == 0
    }

    fn poke(&self) {
        if let Some(c) = self.waker.get() {
            c.poke();
        }
    }

    /// A worker was made (`true`) or dropped (`false`).
    pub(crate) fn worker(&self, made: bool) {
        if made {
            self.workers.fetch_add(1, Ordering::AcqRel);
        } else if self.workers.fetch_sub(1, Ordering::AcqRel) == 1 && self.old() == 0 {
            self.poke();
        }
    }

    /// Workers that exist.
    pub(crate) fn workers(&self) -> usize {
        self.workers.load(Ordering::Acquire)
    }

    /// `n` more requests became old.
    pub(crate) fn hold(&self, n: usize) {
        if n > 0 {
            let now = self.old.fetch_add(n, Ordering::AcqRel) + n;
            self.stats.old_requests.store(now as u64, Ordering::Relaxed);
        }
    }

    /// `n` old requests ended.
    pub(crate) fn release(&self, n: usize) {
        if n > 0 {
            let before = self.old.fetch_sub(n, Ordering::AcqRel);
            debug_assert!(before >= n, "fence released more than it held");
            self.stats
                .old_requests
                .store(before.saturating_sub(n) as u64, Ordering::Relaxed);
            if before == n {
                self.poke();
            }
        }
    }

    /// Old requests still out (0: a queue may take requests).
    pub(crate) fn old(&self) -> usize {
        self.old.load(Ordering::Acquire)
    }

    /// A fenced queue was let go after `waited`.
    pub(crate) fn lifted(&self, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.stats.fenced_starts.fetch_add(1, Ordering::Relaxed);
        self.stats.wait_ns_total.fetch_add(ns, Ordering::Relaxed);
        fetch_max(&self.stats.wait_ns_max, ns);
    }

    #[cfg(test)]
    pub(crate) fn stats(&self) -> &FenceStats {
        &self.stats
    }
}

pub(crate) fn fetch_max(a: &AtomicU64, v: u64) {
    a.fetch_max(v, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_statistics() {
        let f = Fence::new(Arc::default());
        assert_eq!(f.old(), 0);
        f.hold(3);
        f.hold(0);
        assert_eq!(f.old(), 3);
        assert_eq!(f.stats().old_requests.load(Ordering::Relaxed), 3);
        f.release(2);
        f.release(1);
        assert_eq!(f.old(), 0);
        assert_eq!(f.stats().old_requests.load(Ordering::Relaxed), 0);
        f.lifted(Duration::from_millis(5));
        f.lifted(Duration::from_millis(2));
        assert_eq!(f.stats().fenced_starts.load(Ordering::Relaxed), 2);
        assert_eq!(f.stats().wait_ns_max.load(Ordering::Relaxed), 5_000_000);
        assert_eq!(f.stats().wait_ns_total.load(Ordering::Relaxed), 7_000_000);
    }
}
