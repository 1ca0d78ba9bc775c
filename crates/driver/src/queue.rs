//! A [`Queue`]: one virtqueue, owned by one thread, and the I/O API on it.
//!
//! Every I/O the caller submits is tagged with a token and completes exactly once, with its
//! buffers handed back. An I/O larger than one request can carry (the device's `size_max`
//! × `seg_max`) is split into several requests and still completes once; on the request
//! path several adjacent I/Os may travel in one request and still complete one by one.
//! When the ring is full the submitter reaps completions (waiting if it must) until there
//! is room: submission never fails for lack of descriptors. When the device goes away,
//! every outstanding and later I/O completes with [`ErrorKind::Disconnected`].
//!
//! Inside, a queue is a `Core` (the dispatcher: ring, in-flight table, notifications)
//! and the path state that decides what reaches the ring and when.

use std::time::{Duration, Instant};

use crate::disk::{Limits, Shared};
use crate::dispatch::Core;
use crate::error::{Error, ErrorKind};
use crate::io::{Completion, Io, SubmitError};
use crate::mem::Buffer;
use crate::path::auto::{Auto, AutoReport};
use crate::path::request::{RequestPath, RequestStats};
use crate::path::{PathKind, RequestOptions};
use crate::ring::SplitRing;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

/// Tuning of a queue.
#[derive(Clone, Copy, Debug)]
pub struct QueueOptions {
    /// The I/O path.
    pub path: PathKind,
    /// Requests per notification on the batch path.
    pub batch: u16,
    /// How long `wait` spins on the used ring before it sleeps on the call eventfd.
    pub spin: Duration,
    /// The request path's plug, merging and elevator (also used by `auto`).
    pub request: RequestOptions,
    /// How long a call that must wait for the device waits before it fails with
    /// [`crate::ErrorKind::Timeout`]: a device that holds its requests must not hold the
    /// calling thread forever. It bounds a submission's wait for room on a full ring (a
    /// request needs more descriptors than are free: without indirect descriptors a ring
    /// fills before the in-flight table does) and a blocking call's wait for its answer
    /// ([`Queue::read_at`], [`Queue::write_at`], [`Queue::flush_sync`],
    /// [`Queue::discard_sync`], [`Queue::write_zeroes_sync`], [`Queue::get_id`]). The
    /// request of a blocking call that timed out stays with the device; its answer is
    /// dropped when it comes, and until then the queue takes no other blocking call.
    pub wait_limit: Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            path: PathKind::Bio,
            batch: 16,
            spin: Duration::from_micros(50),
            request: RequestOptions::default(),
            wait_limit: Duration::from_secs(30),
        }
    }
}

const INTERNAL_TOKEN: u64 = u64::MAX;

/// A path's state on one queue.
#[derive(Debug)]
pub(crate) enum PathState {
    Bio,
    Batch(u16),
    Request(Box<RequestPath>),
    Auto(Box<Auto>),
}

/// One virtqueue and the I/O submitted on it. `Send`, not shared: one thread drives it.
pub struct Queue {
    pub(crate) core: Core,
    pub(crate) path: PathState,
    kind: PathKind,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("index", &self.core.index)
            .field("size", &self.core.ring.size())
            .field("path", &self.kind)
            .field("in_flight", &self.core.table.in_flight)
            .finish()
    }
}

impl Queue {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<Shared>,
        limits: Limits,
        index: u16,
        ring: SplitRing,
        kick: EventFd,
        call: EventFd,
        opts: QueueOptions,
        rotational: bool,
    ) -> Queue {
        let size = ring.size();
        let core = Core::new(
            shared,
            limits,
            index,
            ring,
            kick,
            call,
            opts.spin,
            opts.wait_limit,
        );
        let path = match opts.path {
            PathKind::Bio | PathKind::Passthru => PathState::Bio,
            PathKind::Batch => PathState::Batch(opts.batch.max(1)),
            PathKind::Request => PathState::Request(Box::new(RequestPath::new(opts.request, size))),
            PathKind::Auto => PathState::Auto(Box::new(Auto::new(&opts, size, rotational))),
        };
        Queue {
            core,
            path,
            kind: opts.path,
        }
    }

    /// This queue's index on the device.
    pub fn index(&self) -> u16 {
        self.core.index
    }

    /// The ring size.
    pub fn size(&self) -> u16 {
        self.core.ring.size()
    }

    /// The I/O path in use.
    pub fn path(&self) -> PathKind {
        self.kind
    }

    /// I/Os submitted whose completion the caller has not yet taken.
    pub fn in_flight(&self) -> usize {
        self.core.table.in_flight - self.core.table.abandoned()
    }

    /// Allocate a buffer in memory shared with the device.
    pub fn alloc(&self, len: usize) -> Result<Buffer, Error> {
        self.core.shared.pool.alloc(len)
    }

    /// The request path's counters (merges, dispatches), on `request` and `auto`.
    pub fn request_stats(&self) -> Option<RequestStats> {
        match &self.path {
            PathState::Request(r) => Some(r.stats),
            PathState::Auto(a) => Some(a.request.stats),
            _ => None,
        }
    }

    /// What `auto` chose and why, on `auto`.
    pub fn auto_report(&self) -> Option<AutoReport> {
        match &self.path {
            PathState::Auto(a) => Some(a.report(&self.core.shared.auto)),
            _ => None,
        }
    }

    /// The share of the device flow `flow` gets under the `bfq` elevator, relative to the
    /// other flows' weights (default 100; at least 1). Tag I/Os with [`Io::flow`].
    pub fn set_flow_weight(&mut self, flow: u16, weight: u32) {
        match &mut self.path {
            PathState::Request(r) => r.set_flow_weight(flow, weight),
            PathState::Auto(a) => a.request.set_flow_weight(flow, weight),
            _ => {}
        }
    }

    // ---- submission ----

    /// Submit `io`. On an error nothing was sent and the buffers come back.
    pub fn submit(&mut self, io: Io) -> Result<(), SubmitError> {
        // bio and batch (also under auto) send the common I/O (one buffer, one request) in
        // one pass.
        let single = self.core.is_single(&io);
        match &mut self.path {
            PathState::Bio | PathState::Batch(_) if single => self.core.send_single(io)?,
            PathState::Auto(a) if single && a.sends_directly() => {
                let (op, sector, bytes) = (io.op, io.offset / 512, io.bufs.total_len());
                self.core.send_single(io)?;
                a.observe(op, sector, bytes, self.core.table.in_flight);
                a.sent(&mut self.core);
                return Ok(());
            }
            _ => {
                let Some(id) = self.core.admit(io)? else {
                    return Ok(());
                };
                match &mut self.path {
                    PathState::Bio | PathState::Batch(_) => self.send_now(id)?,
                    PathState::Request(r) => r.submit(&mut self.core, id),
                    PathState::Auto(a) => a.submit(&mut self.core, id),
                }
            }
        }
        match self.path {
            PathState::Bio => self.core.publish(),
            PathState::Batch(n) => self.core.publish_batch(n),
            _ => {}
        }
        Ok(())
    }

    fn send_now(&mut self, id: u32) -> Result<(), SubmitError> {
        self.core.send(id).map_err(|error| SubmitError {
            error,
            bufs: self.core.table.withdraw(id),
        })
    }

    /// Read `buf.len()` bytes at `offset` into `buf`.
    pub fn read(&mut self, offset: u64, buf: Buffer, token: u64) -> Result<(), SubmitError> {
        self.submit(Io::read(offset, buf, token))
    }

    /// Write `buf` at `offset`.
    pub fn write(&mut self, offset: u64, buf: Buffer, token: u64) -> Result<(), SubmitError> {
        self.submit(Io::write(offset, buf, token))
    }

    /// Read into several buffers, in order, from `offset`.
    pub fn readv(&mut self, offset: u64, bufs: Vec<Buffer>, token: u64) -> Result<(), SubmitError> {
        self.submit(Io::readv(offset, bufs, token))
    }

    /// Write several buffers, in order, at `offset`.
    pub fn writev(
        &mut self,
        offset: u64,
        bufs: Vec<Buffer>,
        token: u64,
    ) -> Result<(), SubmitError> {
        self.submit(Io::writev(offset, bufs, token))
    }

    /// Make every completed write durable. Completes at once on a device without a
    /// volatile cache (no FLUSH feature).
    pub fn flush(&mut self, token: u64) -> Result<(), SubmitError> {
        self.submit(Io::flush(token))
    }

    /// Discard `len` bytes at `offset` (a hint: the range may read back as zeroes or not).
    pub fn discard(&mut self, offset: u64, len: u64, token: u64) -> Result<(), SubmitError> {
        self.submit(Io::discard(offset, len, token))
    }

    /// Make `len` bytes at `offset` read as zeroes; `unmap` lets the device deallocate.
    pub fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        unmap: bool,
        token: u64,
    ) -> Result<(), SubmitError> {
        self.submit(Io::write_zeroes(offset, len, unmap, token))
    }

    /// Let everything submitted go to the device and tell it (the batch path's publication,
    /// the request path's plug flush; harmless on bio).
    pub fn unplug(&mut self) {
        match &mut self.path {
            PathState::Bio | PathState::Batch(_) => self.core.publish(),
            PathState::Request(r) => r.unplug(&mut self.core),
            PathState::Auto(a) => a.unplug(&mut self.core),
        }
        self.core.post_flush();
    }

    // ---- completion ----

    /// After completions were reaped: a post-flush for parked FUA writes, and the request
    /// path's next dispatches (the queue depth has room again).
    fn after_reap(&mut self) {
        self.core.post_flush();
        match &mut self.path {
            PathState::Request(r) => r.run(&mut self.core),
            PathState::Auto(a) => a.after_reap(&mut self.core),
            PathState::Bio | PathState::Batch(_) => {}
        }
    }

    /// Take a finished I/O without blocking.
    pub fn poll(&mut self) -> Option<Completion> {
        if self.core.table.ready.is_empty() && self.core.poll_ring() > 0 {
            self.after_reap();
        }
        let c = self.core.table.pop_ready()?;
        if let PathState::Auto(a) = &mut self.path {
            a.completed(&mut self.core, 1);
        }
        Some(c)
    }

    /// Wait for a finished I/O: let everything staged go, spin on the used ring for the
    /// spin bound, then sleep on the call eventfd. `None` waits without limit.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Completion, Error> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.unplug();
        loop {
            if let Some(c) = self.poll() {
                return Ok(c);
            }
            if self.in_flight() == 0 {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    "wait with nothing in flight".into(),
                ));
            }
            if self.core.requests == 0 && !self.core.dead {
                // Whatever is in flight is staged or parked: let it go.
                self.unplug();
                if self.core.requests == 0 && self.core.table.ready.is_empty() {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "{} I/Os in flight but none on the ring (a driver bug)",
                            self.core.table.in_flight
                        ),
                    ));
                }
                continue;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("no completion within {timeout:?}"),
                ));
            }
            self.core.block(left)?;
        }
    }

    /// For a thread that serves several queues and sleeps on all of them at once (as
    /// `vblk bench --job-threads` does): get ready to sleep on this queue outside it. Sends
    /// whatever is staged, asks the device to signal the call eventfd on its next
    /// completion and returns the descriptors to wait on with `poll(2)` or epoll: the call
    /// eventfd (readable: a completion may be waiting) and the device's socket (hung up:
    /// the device left; wait for `POLLRDHUP`). `None`: do not sleep, [`Queue::poll`] this
    /// queue now (completions are already waiting, staged I/Os just went to the ring, or
    /// the device is gone). After the sleep, whatever woke it, call [`Queue::disarm`]
    /// before polling again: a queue left armed costs the device a signal per completion.
    pub fn arm(&mut self) -> Option<[std::os::fd::RawFd; 2]> {
        if !self.core.table.ready.is_empty() {
            return None;
        }
        if self.core.requests == 0 && self.core.table.in_flight > 0 {
            // Held by the path (plugged, in the elevator) or parked behind a flush.
            self.unplug();
            return None;
        }
        self.core.arm().then(|| self.core.wake_fds())
    }

    /// After a sleep begun with [`Queue::arm`]: back to polling (the device no longer
    /// signals), the call eventfd cleared, and, if the device hung up, every I/O in flight
    /// completed with [`ErrorKind::Disconnected`]. One `poll(2)` with no timeout.
    pub fn disarm(&mut self) {
        self.core.disarm();
    }

    // ---- blocking convenience API ----

    fn run_sync(&mut self, submitted: Result<(), SubmitError>) -> Result<Completion, Error> {
        submitted.map_err(|e| e.error)?;
        let limit = self.core.wait_limit;
        let c = match self.wait(Some(limit)) {
            Err(e) if e.kind() == ErrorKind::Timeout => {
                self.core.table.abandon(INTERNAL_TOKEN);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the device did not answer within {:.1} s (QueueOptions::wait_limit); the request stays with it and its answer will be dropped",
                        limit.as_secs_f64()
                    ),
                ));
            }
            r => r?,
        };
        if c.token != INTERNAL_TOKEN {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "blocking calls need an idle queue".into(),
            ));
        }
        c.result.map_err(Error::from)?;
        Ok(c)
    }

    fn require_idle(&self) -> Result<(), Error> {
        if self.core.table.abandoned() > 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a blocking call that timed out left its request with the device, which has not answered it yet".into(),
            ));
        }
        if self.core.table.in_flight > 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "blocking calls need an idle queue; {} I/Os are in flight",
                    self.core.table.in_flight
                ),
            ));
        }
        Ok(())
    }

    /// Read `out.len()` bytes at `offset` (copies through a shared buffer). The queue must
    /// have nothing else in flight.
    pub fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        self.require_idle()?;
        let buf = self.alloc(out.len())?;
        let submitted = self.read(offset, buf, INTERNAL_TOKEN);
        let c = self.run_sync(submitted)?;
        let buf = c
            .bufs
            .into_one()
            .ok_or_else(|| Error::new(ErrorKind::Protocol, "buffer lost".into()))?;
        out.copy_from_slice(&buf);
        Ok(())
    }

    /// Write `data` at `offset` (copies through a shared buffer). The queue must have
    /// nothing else in flight.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.require_idle()?;
        let mut buf = self.alloc(data.len())?;
        buf.copy_from_slice(data);
        let submitted = self.write(offset, buf, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Flush and wait.
    pub fn flush_sync(&mut self) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.flush(INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Discard and wait.
    pub fn discard_sync(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.discard(offset, len, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Write zeroes and wait.
    pub fn write_zeroes_sync(&mut self, offset: u64, len: u64, unmap: bool) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.write_zeroes(offset, len, unmap, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Ask the device for its ID string (GET_ID). The queue must be idle.
    pub fn get_id(&mut self) -> Result<String, Error> {
        self.require_idle()?;
        self.core.get_id(INTERNAL_TOKEN)
    }

    /// Give the parts back (for [`crate::Passthru`]); the queue must be idle.
    pub(crate) fn into_core(self) -> Result<Core, Box<crate::passthru::NotIdle>> {
        if self.core.table.in_flight > 0 {
            let n = self.core.table.in_flight;
            return Err(Box::new(crate::passthru::NotIdle {
                queue: self,
                error: Error::new(
                    ErrorKind::InvalidInput,
                    format!("the queue has {n} I/Os in flight; passthru needs an idle queue"),
                ),
            }));
        }
        Ok(self.core)
    }
}
