//! A worker: the one owner of a set of virtqueues and of one storage engine.
//!
//! One pass pops every available chain of every owned queue, has `proto` check it, hands
//! the payload iovecs (pointers into guest memory, no copy) to the engine, submits the batch
//! with one call, reaps finished operations, writes their status bytes, publishes them in the
//! used rings and signals each queue at most once. Passes repeat while there is work, then
//! for the polling window, then notifications are re-armed and the worker sleeps until a
//! kick or an engine completion wakes it.
//!
//! Request state lives in a slab per queue indexed by descriptor head, allocated when the
//! worker is made: nothing is allocated per request.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use log::{error, warn};
use proto::wire::{feature, status, ID_BYTES};
use proto::{Limits, Parser, Rejected, Request, RequestKind, RingInfo};
use storage::{Completion, Engine, Op};
use vhost_user_backend::{VringMutex, VringT};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use crate::poll::Poll;
use crate::used::UsedBatch;

/// Guest memory as the device maps it.
pub(crate) type Mem = GuestMemoryMmap<()>;
/// The guest memory handle shared with vhost-user-backend.
pub(crate) type AtomicMem = GuestMemoryAtomic<Mem>;
/// A virtqueue as vhost-user-backend keeps it.
pub(crate) type Vring = VringMutex<AtomicMem>;

/// Empty polling passes between two reads of the clock.
const IDLE_PASSES_PER_CLOCK: u32 = 16;

/// How many bad requests a queue logs in full before it only counts them.
const BAD_REQUEST_LOG_LIMIT: u64 = 20;

/// Device-wide state the workers read. Written only by the control thread, and then only
/// through atomics.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Limits that do not depend on negotiation (capacity, segments, read-only).
    pub base_limits: Limits,
    /// Virtio features the driver acknowledged.
    pub acked: AtomicU64,
    /// The `writeback` byte of the config space (may be changed by the driver).
    pub writeback: AtomicBool,
    /// The GET_ID answer, zero padded.
    pub serial: [u8; ID_BYTES],
    /// Per queue, indexed by global queue index.
    pub queues: Vec<QueueShared>,
    /// Guest memory (vhost-user-backend swaps its contents on SET_MEM_TABLE / ADD_MEM_REG).
    pub mem: AtomicMem,
}

/// What the control thread needs to see of a queue.
#[derive(Debug, Default)]
pub(crate) struct QueueShared {
    /// Requests popped and not yet completed.
    pub in_flight: AtomicU32,
    /// The ring was found broken; the queue is stopped until the frontend resets it.
    pub broken: AtomicBool,
    /// Requests completed (any status).
    pub completed: AtomicU64,
    /// Requests answered with an error status or dropped as unanswerable.
    pub rejected: AtomicU64,
}

impl Shared {
    /// The limits in force for the features acked now.
    pub(crate) fn limits(&self) -> Limits {
        let acked = self.acked.load(Ordering::Relaxed);
        let has = |f| acked & feature::bit(f) != 0;
        Limits {
            flush: has(feature::FLUSH),
            discard: has(feature::DISCARD),
            write_zeroes: has(feature::WRITE_ZEROES),
            ..self.base_limits
        }
    }

    fn indirect(&self) -> bool {
        self.acked.load(Ordering::Relaxed) & feature::bit(feature::RING_INDIRECT_DESC) != 0
    }

    /// Writes must reach stable storage before they complete (writethrough).
    pub(crate) fn write_through(&self) -> bool {
        let acked = self.acked.load(Ordering::Relaxed);
        if acked & feature::bit(feature::FLUSH) == 0 {
            // A driver that cannot flush must get durable writes (virtio 1.2 §5.2.6.1).
            return true;
        }
        !self.writeback.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct Slot {
    busy: bool,
    req: Request,
}

#[derive(Debug)]
struct LocalQueue {
    /// Global queue index (what the driver calls it).
    index: usize,
    /// Request slots indexed by descriptor head.
    slots: Vec<Slot>,
    /// Completions not yet published in the used ring.
    used: UsedBatch,
    /// Notifications are currently disabled by us (we are polling this queue).
    quiet: bool,
    /// Bad requests seen.
    bad: u64,
}

/// One worker thread's state.
pub(crate) struct Worker {
    // Field order matters: the engine is dropped (waiting for everything in flight) before
    // the guest memory the in-flight operations point into.
    engine: Box<dyn Engine>,
    shared: Arc<Shared>,
    queues: Vec<LocalQueue>,
    parser: Parser,
    heads: Vec<u16>,
    done: Vec<Completion>,
    poll: Poll,
    in_flight: usize,
    pushed: bool,
    mem: Option<Arc<Mem>>,
    /// Older memory maps still referenced by in-flight requests.
    retired: Vec<Arc<Mem>>,
    /// The CPU this worker's thread should run on, until it has been pinned there.
    pin: Option<usize>,
    /// Submit to the engine after this many pushes (usize::MAX: once per pass).
    submit_every: usize,
    /// Pushes since the last submit.
    unsubmitted: usize,
}

impl Worker {
    /// A worker owning the global queues `owned` (each of up to `queue_size` entries).
    pub(crate) fn new(
        shared: Arc<Shared>,
        engine: Box<dyn Engine>,
        owned: &[usize],
        queue_size: u16,
        poll_us: u64,
        cpu: Option<usize>,
        submit_batch: u32,
    ) -> Worker {
        let qsize = usize::from(queue_size);
        // A request can split at memory-region boundaries: room for twice seg_max buffers.
        let max_iov = 2 * shared.base_limits.seg_max as usize + 4;
        let queues = owned
            .iter()
            .map(|&index| LocalQueue {
                index,
                slots: (0..qsize)
                    .map(|_| Slot {
                        busy: false,
                        req: Request::with_capacity(max_iov),
                    })
                    .collect(),
                used: UsedBatch::new(qsize),
                quiet: false,
                bad: 0,
            })
            .collect::<Vec<_>>();
        let depth = qsize * owned.len();
        Worker {
            engine,
            shared,
            queues,
            parser: Parser::new(2 * qsize),
            heads: Vec::with_capacity(qsize),
            done: Vec::with_capacity(depth),
            poll: Poll::new(poll_us),
            in_flight: 0,
            pushed: false,
            mem: None,
            retired: Vec::new(),
            pin: cpu,
            submit_every: if submit_batch == 0 {
                usize::MAX
            } else {
                submit_batch as usize
            },
            unsubmitted: 0,
        }
    }

    /// Hand everything pushed to the kernel.
    fn submit(&mut self) {
        if !self.pushed {
            return;
        }
        match self.engine.submit() {
            Ok(()) => {
                self.pushed = false;
                self.unsubmitted = 0;
            }
            // Submissions stay queued in the engine; the next pass retries.
            Err(e) => warn!("engine {}: submit failed: {e}", self.engine.name()),
        }
    }

    /// The engine's completion eventfd, to be watched with the worker's kicks.
    pub(crate) fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        self.engine.notify_fd()
    }

    /// Run passes over `vrings` (this worker's queues, in the order of `owned`) until the
    /// queues are dry, the polling window has passed and notifications are re-armed.
    pub(crate) fn run(&mut self, vrings: &[Vring]) {
        if let Some(cpu) = self.pin.take() {
            // vhost-user-backend owns the worker threads; a worker pins the thread it runs on
            // the first time it runs.
            if let Err(e) = crate::config::pin_current_thread(cpu) {
                warn!("cannot pin a worker to CPU {cpu}: {e}");
            }
        }
        let mut idle_since: Option<Instant> = None;
        let mut idle_passes = 0u32;
        let mut polling = false;
        loop {
            let mem = self.refresh_mem();
            let mut progress = false;
            for (qi, vring) in vrings.iter().enumerate().take(self.queues.len()) {
                progress |= self.drain(qi, vring, &mem);
            }
            self.submit();
            progress |= self.reap();
            self.signal(vrings, &mem);
            if progress {
                if polling {
                    self.poll.hit();
                    polling = false;
                }
                idle_since = None;
                idle_passes = 0;
                continue;
            }
            // While polling, read the clock once per IDLE_PASSES_PER_CLOCK empty passes:
            // it costs more than a pass, and the window need not be exact.
            idle_passes += 1;
            if idle_since.is_some() && !idle_passes.is_multiple_of(IDLE_PASSES_PER_CLOCK) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            if now.duration_since(since) < self.poll.window() {
                polling = true;
                std::hint::spin_loop();
                continue;
            }
            if polling {
                self.poll.miss();
                polling = false;
            }
            if self.rearm(vrings, &mem) {
                idle_since = None;
                continue;
            }
            if self.in_flight > 0 && self.engine.notify_fd().is_none() {
                // An engine without a completion fd must be waited for here.
                if let Err(e) = self.engine.wait() {
                    error!("engine {}: wait failed: {e}", self.engine.name());
                    return;
                }
                continue;
            }
            return;
        }
    }

    /// Load the current guest memory map, keeping older maps alive while requests that
    /// point into them are in flight.
    fn refresh_mem(&mut self) -> Arc<Mem> {
        let now = self.shared.mem.memory().into_inner();
        match &self.mem {
            Some(cur) if Arc::ptr_eq(cur, &now) => {}
            _ => {
                if let Some(old) = self.mem.replace(now.clone()) {
                    if self.in_flight > 0 {
                        self.retired.push(old);
                    }
                }
            }
        }
        if self.in_flight == 0 && !self.retired.is_empty() {
            self.retired.clear();
        }
        now
    }

    /// Pop and start every available request of local queue `qi`. True if any was popped.
    fn drain(&mut self, qi: usize, vring: &Vring, mem: &Mem) -> bool {
        let shared = &self.shared;
        let q = &mut self.queues[qi];
        let qs = &shared.queues[q.index];
        if qs.broken.load(Ordering::Acquire) {
            return false;
        }
        let mut st = vring.get_mut();
        if !st.get_queue().ready() || !st.is_enabled() {
            return false;
        }
        let size = st.get_queue().size();
        if usize::from(size) > q.slots.len() {
            stop_queue(
                qs,
                q.index,
                &format!("queue size {size} is larger than {} offered", q.slots.len()),
            );
            return false;
        }
        if !q.quiet {
            if let Err(e) = st.get_queue_mut().disable_notification(mem) {
                stop_queue(
                    qs,
                    q.index,
                    &format!("cannot write the used ring flags: {e}"),
                );
                return false;
            }
            q.quiet = true;
        }
        let ring = RingInfo {
            desc_table: GuestAddress(st.get_queue().desc_table()),
            size,
            indirect: shared.indirect(),
        };
        self.heads.clear();
        match st.get_queue_mut().iter(mem) {
            Ok(iter) => {
                for chain in iter {
                    if self.heads.len() == self.heads.capacity() {
                        break;
                    }
                    self.heads.push(chain.head_index());
                }
            }
            Err(e) => {
                stop_queue(qs, q.index, &format!("available ring is broken: {e}"));
                return false;
            }
        }
        if self.heads.is_empty() {
            return false;
        }
        let limits = shared.limits();
        let durable = shared.write_through();
        for &head in &self.heads {
            if head >= size {
                stop_queue(
                    qs,
                    q.index,
                    &format!("head {head} is outside the queue of size {size}"),
                );
                return true;
            }
            let slot = &mut q.slots[usize::from(head)];
            if slot.busy {
                stop_queue(
                    qs,
                    q.index,
                    &format!("head {head} was made available again while in flight"),
                );
                return true;
            }
            let answer = match self.parser.parse(mem, ring, head, &limits, &mut slot.req) {
                Ok(()) => match slot.req.kind {
                    RequestKind::GetId => {
                        write_id(&slot.req, &shared.serial);
                        Some((status::OK, slot.req.used_len_ok()))
                    }
                    _ => {
                        let op = to_op(&slot.req, durable);
                        let token = ((qi as u64) << 32) | u64::from(head);
                        // SAFETY: the iovecs live in the slot, which is neither moved nor
                        // reused while busy (slots are allocated once; a busy head is never
                        // parsed again); they point into guest memory kept mapped by
                        // `self.mem`/`self.retired` until the completion is reaped.
                        match unsafe { self.engine.push(token, op) } {
                            Ok(()) => {
                                slot.busy = true;
                                self.in_flight += 1;
                                qs.in_flight.fetch_add(1, Ordering::AcqRel);
                                self.pushed = true;
                                self.unsubmitted += 1;
                                if self.unsubmitted >= self.submit_every {
                                    if let Err(e) = self.engine.submit() {
                                        warn!("engine {}: submit failed: {e}", self.engine.name());
                                    } else {
                                        self.pushed = false;
                                        self.unsubmitted = 0;
                                    }
                                }
                                None
                            }
                            Err(_) => {
                                error!("queue {}: engine full, failing request {head}", q.index);
                                Some((status::IOERR, 1))
                            }
                        }
                    }
                },
                Err(Rejected::Answer { status_ptr, error }) => {
                    log_bad(&mut q.bad, q.index, format_args!("request {head}: {error}"));
                    qs.rejected.fetch_add(1, Ordering::Relaxed);
                    // SAFETY: the parser translated status_ptr from a device-writable byte
                    // inside guest memory, which `mem` keeps mapped.
                    unsafe { status_ptr.write_volatile(error.status()) };
                    Some((error.status(), 1))
                }
                Err(Rejected::Unanswerable(error)) => {
                    log_bad(
                        &mut q.bad,
                        q.index,
                        format_args!("request {head} cannot be answered: {error}"),
                    );
                    qs.rejected.fetch_add(1, Ordering::Relaxed);
                    Some((status::IOERR, 0))
                }
            };
            if let Some((st_byte, used_len)) = answer {
                if st_byte == status::OK {
                    // SAFETY: as above, status_ptr is a checked byte of guest memory.
                    unsafe { slot.req.status_ptr.write_volatile(status::OK) };
                }
                q.used.push(head, used_len);
                qs.completed.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Complete every finished operation. True if any finished.
    fn reap(&mut self) -> bool {
        if self.in_flight == 0 {
            return false;
        }
        self.done.clear();
        let done = &mut self.done;
        let n = self.engine.reap(&mut |c| done.push(c));
        if n == 0 {
            return false;
        }
        self.in_flight -= n;
        for (qi, q) in self.queues.iter_mut().enumerate() {
            let qs = &self.shared.queues[q.index];
            for c in self.done.iter().filter(|c| (c.token >> 32) as usize == qi) {
                let head = c.token as u16;
                let Some(slot) = q.slots.get_mut(usize::from(head)) else {
                    continue;
                };
                slot.busy = false;
                qs.in_flight.fetch_sub(1, Ordering::AcqRel);
                let (st_byte, used_len) = match &c.result {
                    Ok(_) => (status::OK, slot.req.used_len_ok()),
                    Err(e) => {
                        warn!(
                            "queue {}: {:?} at sector {} failed: {e}",
                            q.index, slot.req.kind, slot.req.sector
                        );
                        (status::IOERR, 1)
                    }
                };
                // SAFETY: status_ptr is a checked byte of guest memory, kept mapped by
                // `mem` or `self.retired` while the request was in flight.
                unsafe { slot.req.status_ptr.write_volatile(st_byte) };
                q.used.push(head, used_len);
                qs.completed.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Publish each queue's completions with one used-index update and notify the driver
    /// once, if it wants to hear of them.
    fn signal(&mut self, vrings: &[Vring], mem: &Mem) {
        for (qi, q) in self.queues.iter_mut().enumerate() {
            if q.used.is_empty() {
                continue;
            }
            let mut st = vrings[qi].get_mut();
            match q.used.publish(st.get_queue_mut(), mem) {
                Ok(true) => {
                    if let Err(e) = st.signal_used_queue() {
                        warn!("queue {}: cannot signal the driver: {e}", q.index);
                    }
                }
                Ok(false) => {}
                Err(e) => stop_queue(&self.shared.queues[q.index], q.index, &e),
            }
        }
    }

    /// Re-enable notifications before sleeping. True if work arrived meanwhile.
    fn rearm(&mut self, vrings: &[Vring], mem: &Mem) -> bool {
        let mut more = false;
        for (qi, q) in self.queues.iter_mut().enumerate() {
            if !q.quiet {
                continue;
            }
            q.quiet = false;
            let mut st = vrings[qi].get_mut();
            if !st.get_queue().ready() {
                continue;
            }
            match st.get_queue_mut().enable_notification(mem) {
                Ok(m) => more |= m,
                Err(e) => {
                    let qs = &self.shared.queues[q.index];
                    stop_queue(qs, q.index, &format!("cannot re-enable notifications: {e}"));
                }
            }
        }
        more
    }

    /// Forget per-queue state of global queue `index` after the frontend stopped it.
    pub(crate) fn reset_queue(&mut self, index: usize) {
        if let Some(q) = self.queues.iter_mut().find(|q| q.index == index) {
            q.quiet = false;
            q.bad = 0;
        }
    }
}

/// Stop a queue whose ring cannot be trusted; other queues go on.
fn stop_queue(qs: &QueueShared, index: usize, why: &str) {
    if !qs.broken.swap(true, Ordering::AcqRel) {
        error!("queue {index}: stopped until the driver resets it: {why}");
    }
}

/// Log a bad request; a hostile driver gets only the first few logged.
fn log_bad(bad: &mut u64, index: usize, msg: std::fmt::Arguments<'_>) {
    *bad += 1;
    if *bad <= BAD_REQUEST_LOG_LIMIT {
        warn!("queue {index}: {msg}");
        if *bad == BAD_REQUEST_LOG_LIMIT {
            warn!("queue {index}: further bad requests are counted, not logged");
        }
    }
}

fn to_op(req: &Request, durable: bool) -> Op {
    let iov = req.iov.as_ptr();
    let iovcnt = req.iov.len() as u32;
    match req.kind {
        RequestKind::In => Op::Read {
            offset: req.offset(),
            iov,
            iovcnt,
        },
        RequestKind::Out => Op::Write {
            offset: req.offset(),
            iov,
            iovcnt,
            durable,
        },
        RequestKind::Flush | RequestKind::GetId => Op::Flush,
        RequestKind::Discard => Op::Discard {
            offset: req.offset(),
            len: req.len,
        },
        RequestKind::WriteZeroes { unmap } => Op::WriteZeroes {
            offset: req.offset(),
            len: req.len,
            unmap,
        },
    }
}

/// Copy the ID into the request's payload buffers (`req.len` bytes, at most 20).
fn write_id(req: &Request, serial: &[u8; ID_BYTES]) {
    let mut src = &serial[..req.len as usize];
    for v in &req.iov {
        let n = v.iov_len.min(src.len());
        for (i, b) in src[..n].iter().enumerate() {
            // SAFETY: the iovec was translated by the parser from a device-writable guest
            // buffer of at least `iov_len` bytes that `mem` keeps mapped.
            unsafe { v.iov_base.cast::<u8>().add(i).write_volatile(*b) };
        }
        src = &src[n..];
    }
}

/// Read the worker's completion eventfd to clear it (level-triggered epoll).
pub(crate) fn clear_eventfd(fd: std::os::fd::RawFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reading 8 bytes into a local 8-byte buffer; fd is the engine's eventfd, which
    // outlives the worker that owns the engine.
    let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::WouldBlock {
            warn!("cannot read the engine eventfd: {e}");
        }
    }
}
