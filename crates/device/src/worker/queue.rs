//! One started virtqueue as its worker holds it: the ring, a request slot per descriptor
//! head, the completions of the current pass, the queue's eventfds, and the state that
//! decides whether it is served (enabled, broken, stopping).
//!
//! A chain that cannot be answered (no trustworthy status byte: a malformed descriptor, an
//! indirect table of a bad length, a loop, a head out of range or already in flight) never
//! reaches the used ring. The queue is stopped with one log line that gives the numbers,
//! the frontend is told through the vring's error eventfd (SET_VRING_ERR), and the
//! available index is left pointing at that chain, so GET_VRING_BASE reports exactly the
//! chains that were answered. Other queues go on.
//!
//! Completion tokens name the queue, its start (a 32-bit generation that no other start of
//! the same queue index still holds while its requests are out) and the head, so a
//! completion can never be taken for another start's request.

use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use log::{error, warn};
use proto::{Request, RingInfo};

use crate::dirty_log::DirtyLog;
use crate::inflight::InflightQueue;
use crate::ring::DeviceRing;
use crate::stats::{Kind, QueueStats};
use crate::vring_fd::{Signalled, VringFd};

/// Payload iovecs a slot keeps room for whatever its requests needed. Requests with more
/// segments grow the slot's vector; a worker keeps at most [`BIG_SLOTS`] grown vectors and
/// shrinks the others back when their request completes, so a guest sending
/// maximum-size requests on every head of every queue cannot make the daemon hold
/// `queues x entries x seg_max` iovecs.
pub(crate) const SLOT_IOVECS: usize = 8;
/// Grown iovec vectors a worker keeps (about 8 KiB each at seg_max 254).
pub(crate) const BIG_SLOTS: usize = 256;

/// The state of one descriptor head.
#[derive(Debug)]
pub(crate) struct Slot {
    pub busy: bool,
    /// Its iovec vector grew past [`SLOT_IOVECS`] and counts in the worker's budget.
    pub big: bool,
    pub req: Request,
    /// When the request was taken (the start of that worker pass), in
    /// [`throttle::ticks`](crate::throttle::ticks): an integer, so that a completion's
    /// latency is one subtraction, not two normalised `Instant`s.
    pub taken: u64,
}

/// A GET_VRING_BASE waiting for the queue's requests to finish.
#[derive(Debug)]
pub(crate) struct Stopping {
    pub deadline: Instant,
    /// When the stop was asked for.
    pub since: Instant,
    pub reply: SyncSender<u16>,
}

/// Everything the control thread hands a worker to start a queue.
#[derive(Debug)]
pub(crate) struct QueueStart {
    pub index: usize,
    pub ring: DeviceRing,
    pub info: RingInfo,
    pub kick: VringFd,
    pub call: Option<VringFd>,
    pub err: Option<VringFd>,
    pub enabled: bool,
    pub stats: Arc<QueueStats>,
    /// The queue's part of the inflight region, when the frontend set one up.
    pub inflight: Option<InflightQueue>,
    /// Heads an earlier device took and did not answer, to run first, in order.
    pub resubmit: Vec<u16>,
    /// Where used-ring writes are logged while a migration runs (VHOST_VRING_F_LOG's
    /// log_guest_addr), if the frontend asked.
    pub log_used: Option<u64>,
}

/// A started queue.
#[derive(Debug)]
pub(crate) struct Queue {
    /// Global queue index (what the driver calls it).
    pub index: usize,
    /// Distinguishes this start of the queue from earlier ones in completion tokens.
    pub gen: u32,
    pub ring: DeviceRing,
    /// The ring can be read and written (false once a memory table left it outside).
    pub ring_ok: bool,
    pub info: RingInfo,
    pub slots: Vec<Slot>,
    pub in_flight: usize,
    /// Completions not yet published.
    pub used: Vec<(u16, u32)>,
    pub kick: VringFd,
    /// The kick fd is an eventfd watched edge-triggered: a kick is seen without reading
    /// it (one syscall less per wake-up). Pipes are watched level-triggered and read.
    pub kick_edge: bool,
    pub call: Option<VringFd>,
    pub err: Option<VringFd>,
    pub enabled: bool,
    /// Started while requests from before a reset were out (fence.rs): nothing is taken
    /// until they end. When it started.
    pub fenced: Option<Instant>,
    /// The frontend wedged one of its descriptors: the session must end.
    pub wedged: bool,
    /// Stopped as broken: nothing more is popped until the frontend restarts the queue.
    pub broken: bool,
    /// Kicks are disabled (we are polling this queue).
    pub quiet: bool,
    pub stopping: Option<Stopping>,
    pub stats: Arc<QueueStats>,
    /// Malformed requests seen (the first few are logged).
    pub bad: u64,
    pub inflight: Option<InflightQueue>,
    /// Heads to run before any new one (inflight recovery), oldest first.
    pub resubmit: std::collections::VecDeque<u16>,
    /// Where used-ring writes are logged while a migration runs.
    pub log_used: Option<u64>,
}

/// How many malformed requests a queue logs in full before it only counts them.
const BAD_REQUEST_LOG_LIMIT: u64 = 20;

impl Queue {
    pub(crate) fn new(start: QueueStart, gen: u32, fenced: bool) -> Queue {
        let size = usize::from(start.ring.size());
        Queue {
            index: start.index,
            gen,
            ring: start.ring,
            ring_ok: true,
            info: start.info,
            // Small to start with; a slot's iovec vector grows to what its requests need.
            slots: (0..size)
                .map(|_| Slot {
                    busy: false,
                    big: false,
                    req: Request::with_capacity(SLOT_IOVECS),
                    taken: 0,
                })
                .collect(),
            in_flight: 0,
            used: Vec::with_capacity(size),
            kick_edge: false,
            kick: start.kick,
            call: start.call,
            err: start.err,
            enabled: start.enabled,
            fenced: fenced.then(Instant::now),
            wedged: false,
            broken: false,
            quiet: false,
            stopping: None,
            stats: start.stats,
            bad: 0,
            inflight: start.inflight,
            resubmit: start.resubmit.into(),
            log_used: start.log_used,
        }
    }

    /// Whether chains should be popped now.
    pub(crate) fn serving(&self) -> bool {
        self.enabled
            && !self.broken
            && self.ring_ok
            && self.stopping.is_none()
            && self.fenced.is_none()
    }

    /// Stop serving the queue until the frontend restarts it; tell the frontend through
    /// the error eventfd.
    pub(crate) fn stop_broken(&mut self, why: std::fmt::Arguments<'_>) {
        if self.broken {
            return;
        }
        self.broken = true;
        error!(
            "queue {}: stopped: {why} (available index {}, {} requests still in flight; it runs again when the frontend restarts it)",
            self.index,
            self.ring.next_avail(),
            self.in_flight
        );
        if let Some(err) = &self.err {
            if err.signal() == Signalled::Wedged {
                self.wedged = true;
            }
        }
    }

    /// Log a malformed request; a hostile driver gets only the first few logged.
    pub(crate) fn log_bad(&mut self, msg: std::fmt::Arguments<'_>) {
        self.bad += 1;
        if self.bad <= BAD_REQUEST_LOG_LIMIT {
            warn!("queue {}: {msg}", self.index);
            if self.bad == BAD_REQUEST_LOG_LIMIT {
                warn!(
                    "queue {}: further malformed requests are counted, not logged",
                    self.index
                );
            }
        }
    }

    /// Mark the used ring's pages in `log` (it was just written: entries, index, flags or
    /// avail_event), if the frontend asked for used-ring logging.
    pub(crate) fn log_used_ring(&self, log: Option<&DirtyLog>) {
        if let (Some(log), Some(gpa)) = (log, self.log_used) {
            // flags, idx, the ring, avail_event.
            log.mark(gpa, 6 + 8 * u64::from(self.ring.size()));
        }
    }

    /// Ask for kicks or not (DeviceRing::set_kicks), logging the used ring's write.
    pub(crate) fn set_kicks(&mut self, enable: bool, log: Option<&DirtyLog>) -> bool {
        let more = self.ring.set_kicks(enable);
        self.log_used_ring(log);
        more
    }

    /// Publish this pass's completions and notify the driver if it wants to hear.
    pub(crate) fn publish(&mut self, log: Option<&DirtyLog>) {
        if self.used.is_empty() {
            return;
        }
        if !self.ring_ok {
            // The ring is no longer where the frontend says memory is: nothing can be
            // published; the completions are lost with the queue (it is broken).
            self.used.clear();
            return;
        }
        if let Some(iq) = &mut self.inflight {
            iq.before_publish(&self.used);
        }
        let notify = self.ring.publish(&self.used);
        // Logged after the writes, before the driver is told (a migration's last sync
        // comes after the ring is stopped, which waits for this).
        self.log_used_ring(log);
        if let Some(iq) = &mut self.inflight {
            iq.after_publish(&self.used, self.ring.next_used());
        }
        self.used.clear();
        if notify {
            if let Some(call) = &self.call {
                if call.signal() == Signalled::Wedged {
                    self.wedged = true;
                }
            }
        }
    }

    /// Read a level-triggered kick fd (it never blocks) so that the poll sleeps again.
    /// False when the fd is at end of file (a pipe whose writer went away).
    pub(crate) fn clear_kick(&self) -> bool {
        self.kick_edge || self.kick.drain()
    }
}

/// Completion tokens carry the generation, the queue and the head.
pub(crate) fn token(index: usize, gen: u32, head: u16) -> u64 {
    (u64::from(gen) << 32) | ((index as u64 & 0xffff) << 16) | u64::from(head)
}

/// The (queue index, generation, head) of a token.
pub(crate) fn untoken(token: u64) -> (usize, u32, u16) {
    (
        ((token >> 16) & 0xffff) as usize,
        (token >> 32) as u32,
        token as u16,
    )
}

/// A log that lets a few lines through per interval and counts the rest.
#[derive(Debug)]
pub(crate) struct RateLimit {
    window: Instant,
    count: u32,
    suppressed: u64,
}

impl RateLimit {
    /// Lines let through per interval.
    const LINES: u32 = 10;
    /// The interval.
    const SECS: u64 = 10;

    pub(crate) fn new() -> RateLimit {
        RateLimit {
            window: Instant::now(),
            count: 0,
            suppressed: 0,
        }
    }

    /// Whether a line may be logged now (then log it); counts it otherwise.
    pub(crate) fn allow(&mut self) -> bool {
        let now = Instant::now();
        if now.duration_since(self.window).as_secs() >= Self::SECS {
            if self.suppressed > 0 {
                warn!(
                    "{} more failed I/Os in the last {}+ s were not logged",
                    self.suppressed,
                    Self::SECS
                );
            }
            self.window = now;
            self.count = 0;
            self.suppressed = 0;
        }
        if self.count < Self::LINES {
            self.count += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }
}

impl Queue {
    /// Count the completion of head `head` at `now` (ticks).
    pub(crate) fn count_completed(&self, head: u16, now: u64) {
        let slot = &self.slots[usize::from(head)];
        let kind = match slot.req.kind {
            proto::RequestKind::In => Kind::Read,
            proto::RequestKind::Out => Kind::Write,
            proto::RequestKind::Flush => Kind::Flush,
            proto::RequestKind::Discard => Kind::Discard,
            proto::RequestKind::WriteZeroes { .. } => Kind::WriteZeroes,
            proto::RequestKind::GetId => Kind::GetId,
        };
        self.stats.done(
            kind,
            slot.req.len,
            crate::throttle::ticks_to_ns(now.saturating_sub(slot.taken)),
        );
    }

    /// Publish the in-flight gauge.
    pub(crate) fn store_in_flight(&self) {
        self.stats
            .in_flight
            .store(self.in_flight as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        assert_eq!(untoken(token(255, 7, 65535)), (255, 7, 65535));
        assert_eq!(untoken(token(0, 0, 0)), (0, 0, 0));
        assert_eq!(
            untoken(token(65535, u32::MAX, 1)),
            (65535, u32::MAX, 1),
            "every bit of the generation survives"
        );
        assert_ne!(token(3, 1, 9), token(3, 1 + (1 << 16), 9));
    }

    #[test]
    fn rate_limit_lets_a_few_through() {
        let mut r = RateLimit::new();
        let allowed = (0..100).filter(|_| r.allow()).count();
        assert_eq!(allowed, RateLimit::LINES as usize);
        assert_eq!(r.suppressed, 100 - u64::from(RateLimit::LINES));
    }
}
