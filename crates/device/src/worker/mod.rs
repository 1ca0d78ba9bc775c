//! A worker: one thread, the only owner of a set of started virtqueues and of one storage
//! engine. Nothing it touches per request is shared with another worker; the control
//! thread talks to it through a mailbox (`mailbox`).
//!
//! One pass pops every available chain of every served queue (while the engine has room:
//! chains left in the ring wait there, nothing is failed for want of room), has `proto`
//! check it, hands the payload iovecs (pointers into guest memory, no copy) to the engine,
//! submits, reaps finished operations, writes their status bytes, publishes each queue's
//! completions with one used-index store and signals each queue at most once. Passes
//! repeat while there is work, then for the polling window; then kicks are re-armed and the
//! worker sleeps in epoll until a kick, an engine completion or a mailbox message (or,
//! coalescing, sleeps first with kicks still off for up to `--coalesce-us`: poll.rs). A
//! worker never sleeps with work queued in its engine (it retries every millisecond) or
//! with chains it could pop.
//!
//! Stopping a ring (GET_VRING_BASE) stops popping and waits, up to the drain timeout, for
//! the queue's requests; they are published, then the next available index is answered.
//! Requests still out at the timeout become *old* (the queue is kept as a zombie until the
//! engine hands them back, and nothing of them is published) and are counted in the
//! daemon's reset [`Fence`]: a queue started while any are out takes nothing until they
//! end, on whichever worker it runs.

mod mailbox;
mod pool;
mod queue;
mod request;
mod thread;
mod throttled;

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use proto::wire::{feature, status};
use proto::{Parser, Rejected, RequestKind};
use storage::{Completion, Engine, Full, Op};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

pub(crate) use mailbox::{Command, Lost, Mailbox, WorkerHandle};
pub(crate) use pool::{Pool, PoolConfig};
pub(crate) use queue::QueueStart;
#[cfg(test)]
pub(crate) use queue::SLOT_IOVECS;
use queue::{token, untoken, Queue, RateLimit, Stopping};
use request::{complete, keep_or_shrink, to_op, write_id, LogView};
pub(crate) use throttled::ThrottleSetup;
use throttled::{Parked, Throttled};

use crate::blk::Blk;
use crate::dirty_log::DirtyLog;
use crate::fence::{fetch_max, Fence};
use crate::memory::GuestMemory;
use crate::stats::{bump, LifecycleStats};
use crate::throttle::{self, Dir};
use crate::vring_fd::FdKind;

/// How often a worker with a fenced queue looks whether the fence has lifted.
const FENCE_CHECK: Duration = Duration::from_millis(10);
/// The low half of a worker's epoll data (the high half is the worker's key on its
/// thread): a queue index, or the engine's completion fd, or the mailbox.
const EV_ENGINE: u32 = u32::MAX - 1;
const EV_MAILBOX: u32 = u32::MAX;

/// What a worker is made of.
pub(crate) struct WorkerSetup {
    pub id: usize,
    pub blk: Arc<Blk>,
    pub engine: Box<dyn Engine>,
    pub depth: usize,
    pub submit_batch: u32,
    /// How long a ring stop waits for the queue's requests.
    pub drain_timeout: Duration,
    /// The daemon's reset fence.
    pub fence: Arc<Fence>,
    /// Raised by the SIGBUS guard when guest memory was truncated under us.
    pub poison: Arc<AtomicBool>,
    /// Called (once) when the worker must end the session: guest memory truncated under
    /// it, or a descriptor the frontend wedged.
    pub kill: Box<dyn Fn() + Send>,
    /// The daemon's ring-stop and misbehaviour counters.
    pub lifecycle: Arc<LifecycleStats>,
    /// The disk's QoS limits, if it has any.
    pub throttle: Option<ThrottleSetup>,
}

/// What a worker's thread must know before it sleeps ([`Worker::sleep_hint`]).
pub(super) struct SleepHint {
    /// Wake by then even without an event.
    pub deadline: Option<Instant>,
    /// The engine holds completions no fd announces: do not sleep.
    pub unannounced: bool,
}

/// An engine in place of the real one once it is dropped (the worker is ending).
struct Gone;

impl Engine for Gone {
    fn name(&self) -> &'static str {
        "gone"
    }
    unsafe fn push(&mut self, _token: u64, _op: Op) -> Result<(), Full> {
        Err(Full)
    }
    fn submit(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn reap(&mut self, _f: &mut dyn FnMut(Completion)) -> usize {
        0
    }
    fn wait(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    fn in_flight(&self) -> usize {
        0
    }
}

/// One worker thread's state.
pub(crate) struct Worker {
    // Field order matters. The engine goes first (`Drop` drops it explicitly before
    // anything else): dropping it waits for everything in flight, whose iovec arrays live
    // in the queues' slots and whose buffers live in guest memory; then the queues, then
    // the memory views.
    engine: Box<dyn Engine>,
    queues: Vec<Queue>,
    /// Queues stopped while requests were still in flight (GET_VRING_BASE timed out):
    /// kept until the engine hands those requests back; nothing of them is published.
    zombies: Vec<Queue>,
    id: usize,
    depth: usize,
    blk: Arc<Blk>,
    mailbox: Arc<Mailbox>,
    /// The epoll of the thread that runs this worker, and the worker's key in it (the
    /// high half of every epoll data it registers).
    epoll: Arc<Epoll>,
    key: u64,
    parser: Parser,
    mem: Arc<GuestMemory>,
    /// Older memory views still referenced by requests in flight.
    retired: Vec<Arc<GuestMemory>>,
    /// Submit to the engine after this many pushes (usize::MAX: once per pass).
    submit_every: usize,
    unsubmitted: usize,
    pushed: bool,
    in_flight: usize,
    done: Vec<Completion>,
    next_gen: u32,
    /// Old requests (of zombies) this worker has counted in the fence.
    fenced_here: usize,
    fence: Arc<Fence>,
    /// Slots holding a grown iovec vector, and how many may (queue::BIG_SLOTS).
    big_slots: usize,
    big_slots_max: usize,
    poison: Arc<AtomicBool>,
    kill: Option<Box<dyn Fn() + Send>>,
    io_log: RateLimit,
    exit: bool,
    /// It panicked: its thread lets go of it.
    failed: bool,
    /// How long a GET_VRING_BASE waits for the queue's requests.
    drain_timeout: Duration,
    lifecycle: Arc<LifecycleStats>,
    /// Live migration's dirty log, while it runs.
    log: Option<Arc<DirtyLog>>,
    /// QoS, while the disk has limits (or requests still wait for old ones).
    throttle: Option<Box<Throttled>>,
    /// When a waiting request may go, if one waits.
    throttle_wake: Option<Instant>,
    /// The start of the current pass: one clock read per pass times every request.
    now: Instant,
    /// `now` in [`throttle::ticks`], for the per-request stamps.
    now_ticks: u64,
    /// Work served since the thread last took it: chains taken from rings plus
    /// completions taken from the engine (for the polling decision, poll.rs).
    work: u64,
    /// Dropped last, when everything of the worker is gone: its handle's join waits for
    /// this (mailbox.rs).
    _alive: Option<std::sync::mpsc::SyncSender<()>>,
}

impl Worker {
    /// A worker that is not on a thread yet: [`Worker::adopt`] puts it on one.
    pub(crate) fn new(setup: WorkerSetup, mailbox: Arc<Mailbox>) -> io::Result<Worker> {
        Ok(Worker {
            engine: setup.engine,
            queues: Vec::new(),
            zombies: Vec::new(),
            id: setup.id,
            depth: setup.depth,
            blk: setup.blk,
            mailbox,
            epoll: Arc::new(Epoll::new()?),
            key: 0,
            parser: Parser::new(0),
            mem: Arc::new(GuestMemory::empty()),
            retired: Vec::new(),
            submit_every: if setup.submit_batch == 0 {
                usize::MAX
            } else {
                setup.submit_batch as usize
            },
            unsubmitted: 0,
            pushed: false,
            in_flight: 0,
            done: Vec::with_capacity(setup.depth),
            next_gen: 0,
            fenced_here: 0,
            fence: setup.fence,
            big_slots: 0,
            big_slots_max: queue::BIG_SLOTS,
            poison: setup.poison,
            kill: Some(setup.kill),
            io_log: RateLimit::new(),
            exit: false,
            failed: false,
            drain_timeout: setup.drain_timeout,
            lifecycle: setup.lifecycle,
            log: None,
            throttle: setup
                .throttle
                .map(|t| Box::new(Throttled::new(t, setup.depth))),
            throttle_wake: None,
            now: Instant::now(),
            now_ticks: 0,
            work: 0,
            _alive: None,
        })
    }

    /// Put the worker on the thread whose epoll is `epoll`, as `key` there: its mailbox,
    /// its engine's completion fd and its queues' kick fds wake that thread from now on.
    pub(super) fn adopt(&mut self, epoll: Arc<Epoll>, key: u32) -> io::Result<()> {
        self.detach();
        self.epoll = epoll;
        self.key = u64::from(key) << 32;
        self.epoll.ctl(
            ControlOperation::Add,
            self.mailbox.efd.as_raw_fd(),
            EpollEvent::new(EventSet::IN, self.key | u64::from(EV_MAILBOX)),
        )?;
        if let Some(fd) = self.engine.notify_fd() {
            self.epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, self.key | u64::from(EV_ENGINE)),
            )?;
        }
        for q in &mut self.queues {
            watch_kick(&self.epoll, self.key, q)?;
        }
        Ok(())
    }

    /// Take everything of this worker out of its thread's epoll (it leaves the thread).
    /// A descriptor the frontend shares stays open in the frontend: left registered, it
    /// would keep waking the thread for a worker that is gone.
    pub(super) fn detach(&mut self) {
        let del = |fd| {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        };
        del(self.mailbox.efd.as_raw_fd());
        if let Some(fd) = self.engine.notify_fd() {
            del(fd);
        }
        for q in &self.queues {
            del(q.kick.file().as_raw_fd());
        }
    }

    /// Signals its handle once it is dropped.
    pub(super) fn set_alive(&mut self, alive: std::sync::mpsc::SyncSender<()>) {
        self._alive = Some(alive);
    }

    /// The worker's key on its thread.
    pub(super) fn key(&self) -> u32 {
        (self.key >> 32) as u32
    }

    /// One round on its thread: take the commands waiting, then one pass over the
    /// queues at `now`, answer the stops that can be answered. True if anything was done.
    pub(super) fn serve_round(&mut self, now: Instant) -> bool {
        if self.idle_at_a_glance() {
            return false;
        }
        let mut progress = false;
        if self.mailbox.pending.load(Ordering::Acquire) {
            self.handle_commands();
            progress = true;
            if self.exit {
                return true;
            }
        }
        if self.poison.load(Ordering::Relaxed) {
            self.poisoned();
        }
        progress |= self.pass(now);
        self.finish_stops();
        self.check_wedged();
        progress
    }

    /// Whether a round would find nothing to do: nothing in flight or waiting, no
    /// command, no stop, fence or broken descriptor to look after, and no new chain on
    /// any queue (one load of each avail index). With many disks on a thread, most
    /// visits are to idle disks, and this is all they cost.
    fn idle_at_a_glance(&self) -> bool {
        self.in_flight == 0
            && self.throttle.is_none()
            && self.zombies.is_empty()
            && self.retired.is_empty()
            && !self.mailbox.pending.load(Ordering::Acquire)
            && !self.poison.load(Ordering::Relaxed)
            && self.queues.iter().all(|q| {
                q.stopping.is_none()
                    && q.fenced.is_none()
                    && !q.wedged
                    && q.used.is_empty()
                    && q.resubmit.is_empty()
                    && (!q.serving() || !q.ring.has_new())
            })
    }

    /// Whether this worker has requests in flight: at the engine, in its backlog, or
    /// held by QoS limits (`in_flight` counts them all). Their completions or slots will
    /// bring work without the guest (poll.rs, `Wait::Disk`).
    pub(super) fn at_disk(&self) -> bool {
        self.in_flight > 0
    }

    /// Whether the worker was told to end.
    pub(super) fn exiting(&self) -> bool {
        self.exit
    }

    /// The work served since the last call (poll.rs).
    pub(super) fn take_work(&mut self) -> u64 {
        std::mem::take(&mut self.work)
    }

    /// What the thread must know before it sleeps: when the worker needs it back even
    /// without an event (a stop's deadline, a fence check, the kernel refusing
    /// submissions), and whether its engine has completions no fd will announce.
    pub(super) fn sleep_hint(&self) -> SleepHint {
        let retry = (self.engine.backlog() > 0).then(|| Instant::now() + Duration::from_millis(1));
        let deadline = match (self.next_deadline(), retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        SleepHint {
            deadline,
            unannounced: self.in_flight > 0 && self.engine.notify_fd().is_none(),
        }
    }

    /// An engine without a completion fd: let it finish what it holds (inline and sync
    /// engines finish at once).
    pub(super) fn wait_engine(&mut self) {
        if let Err(e) = self.engine.wait() {
            error!(
                "worker {}: engine {} wait failed: {e}",
                self.id,
                self.engine.name()
            );
        }
    }

    /// An epoll event of this worker: `code` is the low half of its data.
    pub(super) fn event(&mut self, code: u32, set: EventSet) {
        match code {
            EV_MAILBOX | EV_ENGINE => {}
            index => self.kicked(index as usize, set),
        }
    }

    /// A queue's kick fd is readable (or hung up).
    fn kicked(&mut self, index: usize, set: EventSet) {
        let Some(q) = self.queues.iter_mut().find(|q| q.index == index) else {
            return;
        };
        let open = q.clear_kick();
        if !open || set.contains(EventSet::HANG_UP) || set.contains(EventSet::ERROR) {
            let fd = q.kick.file().as_raw_fd();
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            q.stop_broken(format_args!("its kick fd was closed or hung up"));
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let stops = self
            .queues
            .iter()
            .filter_map(|q| q.stopping.as_ref().map(|s| s.deadline));
        let fenced = self
            .queues
            .iter()
            .any(|q| q.fenced.is_some())
            .then(|| Instant::now() + FENCE_CHECK);
        stops.chain(fenced).chain(self.throttle_wake).min()
    }

    fn handle_commands(&mut self) {
        for cmd in self.mailbox.take() {
            match cmd {
                Command::Start(start) => self.start(*start),
                Command::Stop { queue, reply } => {
                    let drain = self.drain_timeout;
                    match self.queues.iter_mut().find(|q| q.index == queue) {
                        Some(q) => {
                            // Whatever the frontend stops a ring for (a reset, a reboot,
                            // `stop`, a shutdown, a migration), the requests it sent
                            // finish first: a write from before must not land after the
                            // next start's, nor a read fill memory the guest reuses.
                            let now = Instant::now();
                            q.stopping = Some(Stopping {
                                deadline: now + drain,
                                since: now,
                                reply,
                            })
                        }
                        None => {
                            warn!(
                                "worker {}: stop for queue {queue}, which it does not hold",
                                self.id
                            );
                            let _ = reply.send(0);
                        }
                    }
                }
                Command::Enable { queue, enabled } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.enabled = enabled;
                    }
                }
                Command::SetCall { queue, fd } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.call = fd;
                    }
                }
                Command::SetErr { queue, fd } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.err = fd;
                    }
                }
                Command::SetKick { queue, fd } => self.set_kick(queue, fd),
                Command::Memory { mem, reply } => {
                    self.set_memory(mem);
                    let _ = reply.send(());
                }
                Command::Log { log, reply } => {
                    self.log = log;
                    // Rings written before logging began are logged now, so that no
                    // used-ring write from before escapes the migration's copy.
                    for q in &self.queues {
                        q.log_used_ring(self.log.as_deref());
                    }
                    let _ = reply.send(());
                }
                Command::Throttle(setup) => match (&mut self.throttle, setup) {
                    (Some(t), setup) => t.replace(setup.map(|b| *b)),
                    (None, Some(setup)) => {
                        self.throttle = Some(Box::new(Throttled::new(*setup, self.depth)));
                    }
                    (None, None) => {}
                },
                Command::LogRing {
                    queue,
                    used_gpa,
                    reply,
                } => {
                    if let Some(q) = self.queues.iter_mut().find(|q| q.index == queue) {
                        q.log_used = used_gpa;
                        q.log_used_ring(self.log.as_deref());
                    }
                    let _ = reply.send(());
                }
                #[cfg(test)]
                Command::Panic => panic!("worker {}: panic asked for by a test", self.id),
                Command::Exit => self.exit = true,
            }
        }
    }

    fn queue_mut(&mut self, index: usize) -> Option<&mut Queue> {
        self.queues.iter_mut().find(|q| q.index == index)
    }

    fn start(&mut self, start: QueueStart) {
        let gen = self.new_gen(start.index);
        let old = self.fence.old();
        if let Some(stale) = self.queues.iter().position(|q| q.index == start.index) {
            // The session starts a queue only once it answered its stop; a queue still
            // held here was stopped as broken and never asked for: it ends now.
            let q = self.queues.swap_remove(stale);
            self.retire(q, "started again");
        }
        let mut q = Queue::new(start, gen, old > 0);
        if old > 0 {
            info!(
                "queue {}: started while {old} requests from before a reset are still out; it takes nothing until they end",
                q.index
            );
        }
        if let Err(e) = watch_kick(&self.epoll, self.key, &mut q) {
            error!("queue {}: cannot watch its kick fd: {e}", q.index);
        }
        self.queues.push(q);
    }

    /// A generation for a new start of queue `index` that no zombie of that index holds:
    /// a late completion can never be taken for a request of the new start, however many
    /// starts come and go while it is out.
    fn new_gen(&mut self, index: usize) -> u32 {
        loop {
            let gen = self.next_gen;
            self.next_gen = self.next_gen.wrapping_add(1);
            let taken = |q: &Queue| q.index == index && q.gen == gen;
            if !self.zombies.iter().any(taken) && !self.queues.iter().any(taken) {
                return gen;
            }
        }
    }

    fn set_kick(&mut self, index: usize, fd: crate::vring_fd::VringFd) {
        let Some(q) = self.queues.iter_mut().find(|q| q.index == index) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            q.kick.file().as_raw_fd(),
            EpollEvent::default(),
        );
        q.kick = fd;
        if let Err(e) = watch_kick(&self.epoll, self.key, q) {
            error!("queue {index}: cannot watch its new kick fd: {e}");
        }
    }

    fn set_memory(&mut self, mem: Arc<GuestMemory>) {
        let old = std::mem::replace(&mut self.mem, mem);
        if self.in_flight > 0 {
            self.retired.push(old);
        }
        for q in &mut self.queues {
            if !q.ring_ok {
                continue;
            }
            if let Err(e) = q.ring.bind(&self.mem) {
                q.ring_ok = false;
                q.stop_broken(format_args!("after the new memory table, {e}"));
            }
        }
    }

    /// Guest memory was truncated under us: stop everything and end the session.
    fn poisoned(&mut self) {
        for q in &mut self.queues {
            q.ring_ok = false;
            q.stop_broken(format_args!(
                "the frontend truncated guest memory under the device (SIGBUS caught)"
            ));
        }
        if let Some(kill) = self.kill.take() {
            kill();
        }
    }

    /// A call, error or kick descriptor the frontend wedged (a write the watchdog had to
    /// interrupt): stop its queues and end the session, so the next frontend is served.
    fn check_wedged(&mut self) {
        if !self.queues.iter().any(|q| q.wedged) {
            return;
        }
        for q in self.queues.iter_mut().filter(|q| q.wedged) {
            q.wedged = false;
            q.call = None;
            q.err = None;
            q.stop_broken(format_args!(
                "the frontend wedged its call or error descriptor (a write to it blocked until the watchdog interrupted it)"
            ));
        }
        if let Some(kill) = self.kill.take() {
            self.lifecycle.wedged_fds.fetch_add(1, Ordering::Relaxed);
            error!(
                "worker {}: ending the session: the frontend wedged a descriptor it handed over",
                self.id
            );
            kill();
        }
    }

    /// Let fenced queues go once no request from before a reset is out.
    fn lift_fences(&mut self) {
        if !self.queues.iter().any(|q| q.fenced.is_some()) || self.fence.old() > 0 {
            return;
        }
        for q in &mut self.queues {
            if let Some(since) = q.fenced.take() {
                let waited = since.elapsed();
                self.fence.lifted(waited);
                info!(
                    "queue {}: the requests from before the reset ended; it waited {:.1} ms for them",
                    q.index,
                    waited.as_secs_f64() * 1e3
                );
            }
        }
    }

    /// One pass over every queue. True if anything was popped or completed.
    fn pass(&mut self, now: Instant) -> bool {
        self.now = now;
        self.now_ticks = throttle::ticks(now);
        self.lift_fences();
        let mut progress = false;
        if self.throttle.is_some() {
            progress |= self.admit_parked();
        }
        if !self.queues.is_empty() {
            let limits = self.blk.limits();
            let durable = self.blk.write_through();
            for qi in 0..self.queues.len() {
                progress |= self.drain(qi, &limits, durable);
            }
        }
        if let Some(t) = &mut self.throttle {
            t.update_waiting();
            if t.idle() {
                self.throttle = None;
                self.throttle_wake = None;
            }
        }
        self.submit();
        progress |= self.reap();
        for q in &mut self.queues {
            q.publish(self.log.as_deref());
            q.store_in_flight();
        }
        if self.in_flight == 0 && !self.retired.is_empty() {
            self.retired.clear();
        }
        progress
    }

    /// Let waiting requests go that the limiters now admit, in order per direction; those
    /// of a queue that no longer serves (stopping, broken, disabled) go at once. True if
    /// any went.
    fn admit_parked(&mut self) -> bool {
        let Some(t) = self.throttle.as_deref_mut() else {
            return false;
        };
        let now = self.now_ticks;
        let durable = self.blk.write_through();
        let mut went = false;
        let mut wake: Option<u64> = None;
        for dir in [Dir::Read, Dir::Write] {
            while let Some(&p) = t.parked[dir as usize].front() {
                let found = self
                    .queues
                    .iter_mut()
                    .chain(self.zombies.iter_mut())
                    .find(|q| q.index == p.queue && q.slots[usize::from(p.head)].busy);
                let Some(q) = found else {
                    error!(
                        "worker {}: a waiting request (queue {}, head {}) lost its queue",
                        self.id, p.queue, p.head
                    );
                    t.parked[dir as usize].pop_front();
                    continue;
                };
                let h = usize::from(p.head);
                if q.serving() {
                    let wait = t.admit(dir, q.slots[h].req.len, now);
                    if wait != 0 {
                        wake = Some(wake.map_or(wait, |w| w.min(wait)));
                        break;
                    }
                }
                let slot = &mut q.slots[h];
                let op = to_op(&slot.req, durable);
                // SAFETY: as in `drain`: the iovecs live in the busy slot, which is neither
                // moved nor reused until its completion is reaped; they point into guest
                // memory that `self.mem` or `self.retired` keeps mapped until then.
                match unsafe { self.engine.push(token(q.index, q.gen, p.head), op) } {
                    Ok(()) => {
                        t.parked[dir as usize].pop_front();
                        t.waited(Duration::from_nanos(throttle::ticks_to_ns(
                            self.now_ticks.saturating_sub(slot.taken),
                        )));
                        went = true;
                        self.pushed = true;
                        self.unsubmitted += 1;
                        if self.unsubmitted >= self.submit_every {
                            submit(&mut *self.engine, &mut self.io_log);
                            self.unsubmitted = 0;
                            self.pushed = self.engine.backlog() > 0;
                        }
                    }
                    // The engine is full: it waits a little longer.
                    Err(_) => break,
                }
            }
        }
        self.throttle_wake = wake.map(throttle::instant);
        went
    }

    /// Pop and start the available chains of queue `qi`. True if any was popped.
    fn drain(&mut self, qi: usize, limits: &proto::Limits, durable: bool) -> bool {
        let q = &mut self.queues[qi];
        if !q.serving() {
            return false;
        }
        if !q.quiet {
            q.set_kicks(false, self.log.as_deref());
            q.quiet = true;
        }
        match q.ring.refresh() {
            Ok(0) if q.resubmit.is_empty() => return false,
            Ok(_) => {}
            Err(e) => {
                q.stop_broken(format_args!("{e}"));
                return false;
            }
        }
        q.ring
            .prefetch(&self.mem, self.depth.saturating_sub(self.in_flight));
        let mem: &GuestMemory = &self.mem;
        let mut popped = false;
        while self.in_flight < self.depth {
            let (head, resubmitted) = match q.resubmit.front() {
                Some(&h) => {
                    q.resubmit.pop_front();
                    (h, true)
                }
                None => match q.ring.pop() {
                    Some(h) => (h, false),
                    None => break,
                },
            };
            popped = true;
            self.work += 1;
            let give_back = |q: &mut Queue| {
                if resubmitted {
                    q.resubmit.push_front(head);
                } else {
                    q.ring.unpop();
                }
            };
            let size = q.ring.size();
            if head >= size {
                give_back(q);
                q.stop_broken(format_args!(
                    "the available ring names head {head}, outside the queue of size {size}"
                ));
                break;
            }
            let h = usize::from(head);
            if q.slots[h].busy {
                give_back(q);
                q.stop_broken(format_args!(
                    "head {head} was made available again while still in flight"
                ));
                break;
            }
            q.slots[h].taken = self.now_ticks;
            let parsed = self
                .parser
                .parse(mem, q.info, head, limits, &mut q.slots[h].req);
            let answer = match parsed {
                Ok(()) => {
                    let slot = &mut q.slots[h];
                    match slot.req.kind {
                        RequestKind::GetId => {
                            write_id(&slot.req, &self.blk.serial);
                            Some((status::OK, slot.req.used_len_ok()))
                        }
                        RequestKind::In
                        | RequestKind::Out
                        | RequestKind::Discard
                        | RequestKind::WriteZeroes { .. }
                            if self.throttle.as_deref().is_some_and(|t| {
                                let dir = direction(&slot.req.kind);
                                t.queued(dir) || t.admit(dir, slot.req.len, self.now_ticks) != 0
                            }) =>
                        {
                            // It waits for the disk's limits (throttled.rs); it holds its
                            // slot and counts as in flight meanwhile.
                            if let Some(t) = self.throttle.as_deref_mut() {
                                t.park(
                                    direction(&slot.req.kind),
                                    Parked {
                                        queue: q.index,
                                        head,
                                    },
                                );
                            }
                            slot.busy = true;
                            q.in_flight += 1;
                            self.in_flight += 1;
                            None
                        }
                        _ => {
                            let op = to_op(&slot.req, durable);
                            // SAFETY: the iovecs live in the slot, which is neither moved
                            // nor reused while busy (the slot vector is never resized; a
                            // busy head is refused above); they point into guest memory
                            // that `self.mem` or `self.retired` keeps mapped until the
                            // completion is reaped.
                            match unsafe { self.engine.push(token(q.index, q.gen, head), op) } {
                                Ok(()) => {
                                    slot.busy = true;
                                    q.in_flight += 1;
                                    self.in_flight += 1;
                                    self.pushed = true;
                                    self.unsubmitted += 1;
                                    if self.unsubmitted >= self.submit_every {
                                        submit(&mut *self.engine, &mut self.io_log);
                                        self.unsubmitted = 0;
                                        self.pushed = self.engine.backlog() > 0;
                                    }
                                    None
                                }
                                Err(_) => {
                                    // The engine is full after all: leave the chain in
                                    // the ring.
                                    give_back(q);
                                    break;
                                }
                            }
                        }
                    }
                }
                Err(Rejected::Answer { status_ptr, error }) => {
                    q.log_bad(format_args!("request {head}: {error}"));
                    bump(&q.stats.rejected, 1);
                    // SAFETY: the parser translated status_ptr from a device-writable byte
                    // inside guest memory, which `self.mem` keeps mapped.
                    unsafe { status_ptr.write_volatile(error.status()) };
                    if let Some(log) = &self.log {
                        let view = LogView {
                            log,
                            mem: &self.mem,
                            retired: &self.retired,
                        };
                        view.mark_status(status_ptr);
                    }
                    Some((error.status(), 1))
                }
                Err(Rejected::Unanswerable(error)) => {
                    give_back(q);
                    bump(&q.stats.rejected, 1);
                    q.stop_broken(format_args!("request {head} cannot be answered: {error}"));
                    break;
                }
            };
            if !resubmitted {
                if let Some(iq) = &mut q.inflight {
                    iq.taken(head);
                }
            }
            if let Some((st, used_len)) = answer {
                if st == status::OK {
                    // SAFETY: as above, status_ptr is a checked byte of guest memory.
                    unsafe { q.slots[h].req.status_ptr.write_volatile(status::OK) };
                    if let Some(log) = &self.log {
                        let view = LogView {
                            log,
                            mem: &self.mem,
                            retired: &self.retired,
                        };
                        view.mark_request(&q.slots[h].req);
                    }
                }
                q.used.push((head, used_len));
                if st == status::OK {
                    q.count_completed(head, self.now_ticks);
                } else {
                    bump(&q.stats.completed, 1);
                }
                keep_or_shrink(&mut q.slots[h], (&mut self.big_slots, self.big_slots_max));
            }
        }
        popped
    }

    /// Hand everything pushed to the kernel.
    fn submit(&mut self) {
        if !self.pushed {
            return;
        }
        submit(&mut *self.engine, &mut self.io_log);
        self.unsubmitted = 0;
        self.pushed = self.engine.backlog() > 0;
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
        self.work += n as u64;
        let mut old_done = 0;
        let view = self.log.as_deref().map(|log| LogView {
            log,
            mem: &self.mem,
            retired: &self.retired,
        });
        for c in self.done.drain(..) {
            let (index, gen, head) = untoken(c.token);
            if let Some(q) = self
                .queues
                .iter_mut()
                .find(|q| q.index == index && q.gen == gen)
            {
                let big = (&mut self.big_slots, self.big_slots_max);
                let log = view.as_ref();
                complete(
                    q,
                    head,
                    c.result,
                    &mut self.io_log,
                    true,
                    self.now_ticks,
                    big,
                    log,
                );
            } else if let Some(q) = self
                .zombies
                .iter_mut()
                .find(|q| q.index == index && q.gen == gen)
            {
                let big = (&mut self.big_slots, self.big_slots_max);
                let log = view.as_ref();
                complete(
                    q,
                    head,
                    c.result,
                    &mut self.io_log,
                    false,
                    self.now_ticks,
                    big,
                    log,
                );
                old_done += 1;
            } else {
                error!(
                    "worker {}: completion for unknown request {:#x}",
                    self.id, c.token
                );
            }
        }
        if old_done > 0 {
            self.fenced_here -= old_done;
            self.fence.release(old_done);
            let big = &mut self.big_slots;
            self.zombies.retain(|q| {
                if q.in_flight == 0 {
                    *big -= q.slots.iter().filter(|s| s.big).count();
                }
                q.in_flight > 0
            });
        }
        true
    }

    /// Answer the GET_VRING_BASEs whose queues have nothing left in flight (or that waited
    /// too long).
    fn finish_stops(&mut self) {
        // Every round of every worker comes here: read no clock unless a ring is stopping
        // (with many disks on a thread, a clock read per worker per round was a third of
        // the thread's CPU).
        if !self.queues.iter().any(|q| q.stopping.is_some()) {
            return;
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.queues.len() {
            let q = &self.queues[i];
            let Some(stop) = &q.stopping else {
                i += 1;
                continue;
            };
            if q.in_flight > 0 && now < stop.deadline {
                i += 1;
                continue;
            }
            let mut q = self.queues.swap_remove(i);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.kick.file().as_raw_fd(),
                EpollEvent::default(),
            );
            q.publish(self.log.as_deref());
            let next = q.ring.next_avail();
            let waited = q.stopping.as_ref().map(|s| now - s.since);
            if let Some(stop) = q.stopping.take() {
                let _ = stop.reply.send(next);
            }
            let l = &self.lifecycle;
            l.stops.fetch_add(1, Ordering::Relaxed);
            if let Some(waited) = waited.filter(|w| !w.is_zero()) {
                l.drains.fetch_add(1, Ordering::Relaxed);
                fetch_max(&l.drain_wait_ns_max, nanos(waited));
            }
            if q.in_flight > 0 {
                l.drains_timed_out.fetch_add(1, Ordering::Relaxed);
                error!(
                    "queue {}: {} requests still in flight after {:?}; the ring is stopped at available index {next}; they are fenced: no request taken after this stop runs until they end, and nothing of them is published{}",
                    q.index,
                    q.in_flight,
                    self.drain_timeout,
                    if q.inflight.is_some() {
                        " (the inflight region keeps them for a restart on the same region)"
                    } else {
                        ""
                    }
                );
            } else if let Some(w) = waited.filter(|w| *w >= Duration::from_millis(1)) {
                info!(
                    "queue {}: stopped at available index {next} after waiting {:.1} ms for its requests",
                    q.index,
                    w.as_secs_f64() * 1e3
                );
            } else {
                info!("queue {}: stopped at available index {next}", q.index);
            }
            self.retire(q, "stopped");
        }
    }

    /// Let go of a queue the frontend no longer runs. Requests still out make it a zombie:
    /// kept (their iovecs live in its slots) until the engine hands them back, counted in
    /// the fence, never published.
    fn retire(&mut self, mut q: Queue, why: &str) {
        if q.in_flight == 0 {
            self.big_slots -= q.slots.iter().filter(|s| s.big).count();
            return;
        }
        if why != "stopped" {
            warn!(
                "queue {}: {why} with {} requests in flight; they are fenced",
                q.index, q.in_flight
            );
        }
        q.ring_ok = false;
        q.used.clear();
        self.fenced_here += q.in_flight;
        self.fence.hold(q.in_flight);
        self.zombies.push(q);
    }

    /// Re-enable kicks before sleeping. True if chains arrived meanwhile that can be
    /// popped now.
    fn rearm(&mut self) -> bool {
        let room = self.in_flight < self.depth;
        let mut more = false;
        for q in &mut self.queues {
            if !q.quiet || !q.serving() {
                continue;
            }
            q.quiet = false;
            more |= q.set_kicks(true, self.log.as_deref());
        }
        more && room
    }
}

impl Drop for Worker {
    /// The worker ends (Exit, or a panic unwinding): the engine is dropped first, which
    /// waits for everything in flight (their buffers are guest memory and their iovecs
    /// live in the slots). While it waits, those requests count in the fence, so that a
    /// worker whose thread is left to end on its own (a join that ran out of time) cannot
    /// have them land after a later session's requests.
    fn drop(&mut self) {
        let live = self.in_flight - self.fenced_here;
        self.fence.hold(live);
        let engine = std::mem::replace(&mut self.engine, Box::new(Gone));
        drop(engine);
        self.fence.release(live + self.fenced_here);
        self.fenced_here = 0;
    }
}

/// Watch a queue's kick fd in `epoll`: an eventfd edge-triggered (never read: every kick
/// queues one event, and a wake-up costs one syscall less), anything else level-triggered
/// (read on every event). Hang-ups and errors are reported either way.
fn watch_kick(epoll: &Epoll, key: u64, q: &mut Queue) -> io::Result<()> {
    q.kick_edge = q.kick.kind() == FdKind::Eventfd;
    let mut set = EventSet::IN;
    if q.kick_edge {
        set |= EventSet::EDGE_TRIGGERED;
    }
    epoll.ctl(
        ControlOperation::Add,
        q.kick.file().as_raw_fd(),
        EpollEvent::new(set, key | q.index as u64),
    )
}

pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Hand the engine's queued work to the kernel, logging a failure (rate-limited).
fn submit(engine: &mut dyn Engine, log: &mut RateLimit) {
    if let Err(e) = engine.submit() {
        if log.allow() {
            warn!("engine {}: submit failed: {e}", engine.name());
        }
    }
}

/// Which limits a request counts against: reads, or writes (with discards and
/// write-zeroes, by their length, as QEMU's throttle filter counts them).
fn direction(kind: &RequestKind) -> Dir {
    match kind {
        RequestKind::In => Dir::Read,
        _ => Dir::Write,
    }
}

/// Whether the acked features include indirect descriptors.
pub(crate) fn indirect_acked(blk: &Blk) -> bool {
    blk.acked(feature::RING_INDIRECT_DESC)
}

#[cfg(test)]
impl Worker {
    /// Handle pending commands and run one pass (tests drive workers by hand).
    pub(crate) fn step(&mut self) -> bool {
        self.serve_round(Instant::now())
    }

    /// Run passes until one makes no progress and the engine is idle.
    pub(crate) fn settle(&mut self) {
        for _ in 0..10_000 {
            let progress = self.step();
            if !progress && self.in_flight == 0 {
                return;
            }
            if !progress {
                let _ = self.engine.wait();
            }
        }
        panic!("worker did not settle");
    }

    /// A worker driven by the test thread (no thread, no epoll waits).
    pub(crate) fn for_test(setup: WorkerSetup) -> (Worker, Arc<Mailbox>) {
        let mailbox = Arc::new(Mailbox::new().unwrap());
        let mut w = Worker::new(setup, mailbox.clone()).unwrap();
        w.adopt(Arc::new(Epoll::new().unwrap()), 0).unwrap();
        (w, mailbox)
    }

    /// Queue a command for a test-driven worker.
    pub(crate) fn post(mailbox: &Mailbox, cmd: Command) {
        mailbox.send(cmd);
    }

    /// Whether queue `index` is held and stopped as broken.
    pub(crate) fn queue_broken(&self, index: usize) -> bool {
        self.queues.iter().any(|q| q.index == index && q.broken)
    }

    /// Shorten GET_VRING_BASE's wait.
    pub(crate) fn set_drain_timeout(&mut self, d: Duration) {
        self.drain_timeout = d;
    }

    /// Whether queue `index` is held and fenced.
    pub(crate) fn queue_fenced(&self, index: usize) -> bool {
        self.queues
            .iter()
            .any(|q| q.index == index && q.fenced.is_some())
    }

    /// Keep at most `n` grown iovec vectors.
    pub(crate) fn set_big_slots_max(&mut self, n: usize) {
        self.big_slots_max = n;
    }

    /// The next generation a start would try.
    pub(crate) fn set_next_gen(&mut self, gen: u32) {
        self.next_gen = gen;
    }

    /// The generations of the running queue `index` and of its zombies.
    pub(crate) fn gens(&self, index: usize) -> (Option<u32>, Vec<u32>) {
        let live = self.queues.iter().find(|q| q.index == index).map(|q| q.gen);
        let old = self
            .zombies
            .iter()
            .filter(|q| q.index == index)
            .map(|q| q.gen)
            .collect();
        (live, old)
    }

    /// Slots holding a grown iovec vector, and the iovecs all slots hold.
    pub(crate) fn iovec_memory(&self) -> (usize, usize) {
        let held = self
            .queues
            .iter()
            .chain(&self.zombies)
            .flat_map(|q| &q.slots)
            .map(|s| s.req.iov.capacity())
            .sum();
        (self.big_slots, held)
    }

    /// Requests in flight (held by queues and zombies).
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues stopped with requests still in flight.
    pub(crate) fn zombies(&self) -> usize {
        self.zombies.len()
    }
}
