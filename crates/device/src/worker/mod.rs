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
//!
//! `pass` is the data path; `lifecycle` carries out the control thread's commands and
//! the queues' starts, stops and retirements; `thread` runs workers and sleeps for them.

mod lifecycle;
mod mailbox;
mod pass;
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

use log::error;
use proto::wire::feature;
use proto::Parser;
use storage::{Completion, Engine, Full, Op};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

pub(crate) use mailbox::{Command, Lost, Mailbox, WorkerHandle};
use pass::SubmitBatch;
pub(crate) use pool::{Pool, PoolConfig};
pub(crate) use queue::QueueStart;
#[cfg(test)]
pub(crate) use queue::SLOT_IOVECS;
use queue::{Queue, RateLimit};
pub(crate) use throttled::ThrottleSetup;
use throttled::Throttled;

use crate::blk::Blk;
use crate::dirty_log::DirtyLog;
use crate::fence::Fence;
use crate::memory::GuestMemory;
use crate::stats::LifecycleStats;
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
    /// The disk's name (log lines of its thread say it: log_context.rs).
    pub disk: Arc<str>,
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
    /// The disk's name, for the log lines written while it is served.
    pub(super) disk: Arc<str>,
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
    /// Pushes not submitted yet, and when to submit them.
    batch: SubmitBatch,
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
    /// `now` in [`crate::throttle::ticks`], for the per-request stamps.
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
        let epoll = Arc::new(Epoll::new()?);
        setup.fence.worker(true);
        Ok(Worker {
            engine: setup.engine,
            queues: Vec::new(),
            zombies: Vec::new(),
            id: setup.id,
            disk: setup.disk,
            depth: setup.depth,
            blk: setup.blk,
            mailbox,
            epoll,
            key: 0,
            parser: Parser::new(0),
            mem: Arc::new(GuestMemory::empty()),
            retired: Vec::new(),
            batch: SubmitBatch::new(setup.submit_batch),
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
        self.fence.worker(false);
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
