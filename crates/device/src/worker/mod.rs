//! A worker: one thread, the only owner of a set of started virtqueues and of one storage
//! engine. Nothing it touches per request is shared with another worker; the control
//! thread talks to it through a mailbox.
//!
//! One pass pops every available chain of every served queue (while the engine has room:
//! chains left in the ring wait there, nothing is failed for want of room), has `proto`
//! check it, hands the payload iovecs (pointers into guest memory, no copy) to the engine,
//! submits, reaps finished operations, writes their status bytes, publishes each queue's
//! completions with one used-index store and signals each queue at most once. Passes
//! repeat while there is work, then for the polling window; then kicks are re-armed and the
//! worker sleeps in epoll until a kick, an engine completion or a mailbox message. A
//! worker never sleeps with work queued in its engine (it retries every millisecond) or
//! with chains it could pop.
//!
//! Mailbox commands: start, stop (GET_VRING_BASE: stop popping, wait for the queue's
//! requests to finish, publish them, answer the next available index), enable, new call,
//! kick or error fd, new guest memory, exit.

mod queue;

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use proto::wire::{feature, status, ID_BYTES};
use proto::{Parser, Rejected, Request, RequestKind};
use storage::{Completion, Engine, Op};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub(crate) use queue::QueueStart;
use queue::{token, untoken, Queue, RateLimit, Stopping};

use crate::blk::Blk;
use crate::memory::GuestMemory;
use crate::poll::Poll;
use crate::stats::bump;
use crate::stats::WorkerStats;

/// Empty polling passes between two reads of the clock.
const IDLE_PASSES_PER_CLOCK: u32 = 16;
/// How long GET_VRING_BASE waits for a queue's requests before it gives up on them.
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// epoll data of the engine's completion fd and of the mailbox.
const EV_ENGINE: u64 = u64::MAX - 1;
const EV_MAILBOX: u64 = u64::MAX;

/// What the control thread asks of a worker.
#[derive(Debug)]
pub(crate) enum Command {
    Start(Box<QueueStart>),
    Stop {
        queue: usize,
        reply: SyncSender<u16>,
    },
    Enable {
        queue: usize,
        enabled: bool,
    },
    SetCall {
        queue: usize,
        fd: Option<File>,
    },
    SetErr {
        queue: usize,
        fd: Option<File>,
    },
    SetKick {
        queue: usize,
        fd: File,
    },
    Memory {
        mem: Arc<GuestMemory>,
        reply: SyncSender<()>,
    },
    Exit,
}

/// Commands waiting for a worker, and the eventfd that wakes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    cmds: Mutex<VecDeque<Command>>,
    pending: AtomicBool,
    efd: EventFd,
}

impl Mailbox {
    fn new() -> io::Result<Mailbox> {
        Ok(Mailbox {
            cmds: Mutex::new(VecDeque::new()),
            pending: AtomicBool::new(false),
            efd: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    fn send(&self, cmd: Command) {
        self.cmds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(cmd);
        self.pending.store(true, Ordering::Release);
        let _ = self.efd.write(1);
    }

    fn take(&self) -> VecDeque<Command> {
        self.pending.store(false, Ordering::Release);
        let _ = self.efd.read();
        std::mem::take(&mut *self.cmds.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// What a worker is made of.
pub(crate) struct WorkerSetup {
    pub id: usize,
    pub blk: Arc<Blk>,
    pub engine: Box<dyn Engine>,
    pub depth: usize,
    pub poll_us: u64,
    pub cpu: Option<usize>,
    pub submit_batch: u32,
    /// Raised by the SIGBUS guard when guest memory was truncated under us.
    pub poison: Arc<AtomicBool>,
    /// Called (once) when the worker finds the session poisoned: ends the connection.
    pub kill: Box<dyn Fn() + Send>,
    /// This worker's counters.
    pub stats: Arc<WorkerStats>,
}

/// The control thread's handle on a worker thread.
pub(crate) struct WorkerHandle {
    mailbox: Arc<Mailbox>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Start a worker thread.
    pub(crate) fn spawn(setup: WorkerSetup) -> io::Result<WorkerHandle> {
        let mailbox = Arc::new(Mailbox::new()?);
        let worker = Worker::new(setup, mailbox.clone())?;
        let name = format!("vblk-worker-{}", worker.id);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || worker.run())?;
        Ok(WorkerHandle {
            mailbox,
            thread: Some(thread),
        })
    }

    pub(crate) fn send(&self, cmd: Command) {
        self.mailbox.send(cmd);
    }

    /// Send a command and wait for its answer (None if the worker is gone).
    pub(crate) fn ask<T>(&self, make: impl FnOnce(SyncSender<T>) -> Command) -> Option<T> {
        let (tx, rx) = sync_channel(1);
        self.mailbox.send(make(tx));
        rx.recv().ok()
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.mailbox.send(Command::Exit);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                error!("a worker thread panicked");
            }
        }
    }
}

/// One worker thread's state.
pub(crate) struct Worker {
    // Field order matters. The engine goes first: dropping it waits for everything in
    // flight, whose iovec arrays live in the queues' slots and whose buffers live in
    // guest memory; then the queues, then the memory views.
    engine: Box<dyn Engine>,
    queues: Vec<Queue>,
    /// Queues stopped while requests were still in flight (GET_VRING_BASE timed out):
    /// kept until the engine hands those requests back; nothing of them is published.
    zombies: Vec<Queue>,
    id: usize,
    depth: usize,
    blk: Arc<Blk>,
    mailbox: Arc<Mailbox>,
    epoll: Epoll,
    parser: Parser,
    mem: Arc<GuestMemory>,
    /// Older memory views still referenced by requests in flight.
    retired: Vec<Arc<GuestMemory>>,
    poll: Poll,
    pin: Option<usize>,
    /// Submit to the engine after this many pushes (usize::MAX: once per pass).
    submit_every: usize,
    unsubmitted: usize,
    pushed: bool,
    in_flight: usize,
    done: Vec<Completion>,
    next_gen: u16,
    poison: Arc<AtomicBool>,
    kill: Option<Box<dyn Fn() + Send>>,
    io_log: RateLimit,
    exit: bool,
    /// How long a GET_VRING_BASE waits for the queue's requests.
    stop_timeout: Duration,
    stats: Arc<WorkerStats>,
    /// The start of the current pass: one clock read per pass times every request.
    now: Instant,
    /// Work served since the worker last went idle: chains taken from rings plus
    /// completions taken from the engine (for the polling decision, poll.rs).
    work: u64,
}

impl Worker {
    pub(crate) fn new(setup: WorkerSetup, mailbox: Arc<Mailbox>) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            mailbox.efd.as_raw_fd(),
            EpollEvent::new(EventSet::IN, EV_MAILBOX),
        )?;
        if let Some(fd) = setup.engine.notify_fd() {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, EV_ENGINE),
            )?;
        }
        Ok(Worker {
            engine: setup.engine,
            queues: Vec::new(),
            zombies: Vec::new(),
            id: setup.id,
            depth: setup.depth,
            blk: setup.blk,
            mailbox,
            epoll,
            parser: Parser::new(0),
            mem: Arc::new(GuestMemory::empty()),
            retired: Vec::new(),
            poll: Poll::new(setup.poll_us),
            pin: setup.cpu,
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
            poison: setup.poison,
            kill: Some(setup.kill),
            io_log: RateLimit::new(),
            exit: false,
            stop_timeout: STOP_TIMEOUT,
            stats: setup.stats,
            now: Instant::now(),
            work: 0,
        })
    }

    fn run(mut self) {
        if let Some(cpu) = self.pin.take() {
            if let Err(e) = crate::config::pin_current_thread(cpu) {
                warn!("worker {}: cannot pin to CPU {cpu}: {e}", self.id);
            }
        }
        let mut idle_since: Option<Instant> = None;
        let mut idle_passes = 0u32;
        let mut polling = false;
        let mut events = vec![EpollEvent::default(); 64];
        while !self.exit {
            if self.mailbox.pending.load(Ordering::Acquire) {
                self.handle_commands();
                continue;
            }
            if self.poison.load(Ordering::Relaxed) {
                self.poisoned();
            }
            let progress = self.pass();
            self.finish_stops();
            if progress {
                if polling {
                    let spun = idle_since.map_or(Duration::ZERO, |t| self.now - t);
                    self.poll.hit(spun);
                    bump(&self.stats.poll_hits, 1);
                    polling = false;
                }
                idle_since = None;
                idle_passes = 0;
                continue;
            }
            if idle_since.is_none() {
                // A busy period ends: credit its work to how the idle period before it
                // ended (poll.rs compares polling's cost per unit of work with sleeping's).
                self.poll.busy(std::mem::take(&mut self.work));
                self.poll.tick(self.now, thread_cpu);
            }
            // While polling, read the clock once per IDLE_PASSES_PER_CLOCK empty passes:
            // it costs more than a pass, and the window need not be exact.
            idle_passes += 1;
            if idle_since.is_some() && !idle_passes.is_multiple_of(IDLE_PASSES_PER_CLOCK) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert_with(|| {
                self.poll.idle();
                now
            });
            if now.duration_since(since) < self.poll.window() {
                polling = true;
                std::hint::spin_loop();
                continue;
            }
            if polling {
                self.poll.miss();
                bump(&self.stats.poll_misses, 1);
                polling = false;
            }
            self.stats
                .poll_window_ns
                .store(nanos(self.poll.window()), Ordering::Relaxed);
            self.stats
                .poll_forced
                .store(u64::from(self.poll.forced()), Ordering::Relaxed);
            if self.rearm() {
                // Work came in while re-arming: the window's spin found it after all.
                if let Some(t) = idle_since {
                    self.poll.hit(Instant::now() - t);
                }
                idle_since = None;
                continue;
            }
            self.sleep(&mut events);
            idle_since = None;
        }
    }

    /// Wait in epoll for a kick, a completion or a command.
    fn sleep(&mut self, events: &mut [EpollEvent]) {
        if self.in_flight > 0 && self.engine.notify_fd().is_none() {
            // An engine without a completion fd must be waited for here.
            if let Err(e) = self.engine.wait() {
                error!(
                    "worker {}: engine {} wait failed: {e}",
                    self.id,
                    self.engine.name()
                );
            }
            return;
        }
        let mut timeout: i32 = -1;
        if self.engine.backlog() > 0 {
            // The kernel refused some submissions (EAGAIN/EBUSY): retry soon.
            timeout = 1;
        }
        if let Some(d) = self.next_deadline() {
            let ms = d.saturating_duration_since(Instant::now()).as_millis();
            timeout = if timeout < 0 {
                ms.min(1000) as i32 + 1
            } else {
                timeout.min(ms as i32 + 1)
            };
        }
        bump(&self.stats.sleeps, 1);
        // One sleep in poll::SAMPLE_EVERY is measured: the CPU this thread spends on it
        // (entering epoll, being switched out, woken and switched in) bounds the polling
        // window (poll.rs). A wait that found events at once did not sleep: not counted.
        let sample = self
            .poll
            .sample_due()
            .then(|| (thread_cpu(), Instant::now()));
        let waited = self.epoll.wait(timeout, events);
        if let Some((cpu0, wall0)) = sample {
            let (cpu, wall) = (thread_cpu().saturating_sub(cpu0), wall0.elapsed());
            if wall > cpu + Duration::from_micros(1) {
                self.poll.slept(cpu);
                if let Some(c) = self.poll.sleep_cost() {
                    self.stats.sleep_cost_ns.store(nanos(c), Ordering::Relaxed);
                }
            }
        }
        let n = match waited {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return,
            Err(e) => {
                error!("worker {}: epoll_wait failed: {e}", self.id);
                std::thread::sleep(Duration::from_millis(1));
                return;
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                EV_MAILBOX | EV_ENGINE => {}
                index => self.kicked(index as usize, ev.event_set()),
            }
        }
    }

    /// A queue's kick fd is readable (or hung up).
    fn kicked(&mut self, index: usize, set: EventSet) {
        let Some(q) = self.queues.iter_mut().find(|q| q.index == index) else {
            return;
        };
        let open = q.clear_kick();
        if !open || set.contains(EventSet::HANG_UP) || set.contains(EventSet::ERROR) {
            let fd = q.kick.as_raw_fd();
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
            q.stop_broken(format_args!("its kick fd was closed or hung up"));
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.queues
            .iter()
            .filter_map(|q| q.stopping.as_ref().map(|s| s.deadline))
            .min()
    }

    fn handle_commands(&mut self) {
        for cmd in self.mailbox.take() {
            match cmd {
                Command::Start(start) => self.start(*start),
                Command::Stop { queue, reply } => {
                    match self.queues.iter_mut().find(|q| q.index == queue) {
                        Some(q) => {
                            // With inflight tracking the requests still out are recorded
                            // in the region and resubmitted at the next start: no wait.
                            let wait = if q.inflight.is_some() {
                                Duration::ZERO
                            } else {
                                self.stop_timeout
                            };
                            q.stopping = Some(Stopping {
                                deadline: Instant::now() + wait,
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
                Command::Exit => self.exit = true,
            }
        }
    }

    fn queue_mut(&mut self, index: usize) -> Option<&mut Queue> {
        self.queues.iter_mut().find(|q| q.index == index)
    }

    fn start(&mut self, start: QueueStart) {
        let gen = self.next_gen;
        self.next_gen = self.next_gen.wrapping_add(1);
        let mut q = Queue::new(start, gen);
        if let Err(e) = watch_kick(&self.epoll, &mut q) {
            error!("queue {}: cannot watch its kick fd: {e}", q.index);
        }
        self.queues.push(q);
    }

    fn set_kick(&mut self, index: usize, fd: File) {
        let Some(q) = self.queues.iter_mut().find(|q| q.index == index) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            q.kick.as_raw_fd(),
            EpollEvent::default(),
        );
        q.kick = fd;
        if let Err(e) = watch_kick(&self.epoll, q) {
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

    /// One pass over every queue. True if anything was popped or completed.
    fn pass(&mut self) -> bool {
        self.now = Instant::now();
        let mut progress = false;
        if !self.queues.is_empty() {
            let limits = self.blk.limits();
            let durable = self.blk.write_through();
            for qi in 0..self.queues.len() {
                progress |= self.drain(qi, &limits, durable);
            }
        }
        self.submit();
        progress |= self.reap();
        for q in &mut self.queues {
            q.publish();
            q.store_in_flight();
        }
        if self.in_flight == 0 && !self.retired.is_empty() {
            self.retired.clear();
        }
        progress
    }

    /// Pop and start the available chains of queue `qi`. True if any was popped.
    fn drain(&mut self, qi: usize, limits: &proto::Limits, durable: bool) -> bool {
        let q = &mut self.queues[qi];
        if !q.serving() {
            return false;
        }
        if !q.quiet {
            q.ring.set_kicks(false);
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
        // The old I/O of heads to resubmit may still run in a queue stopped without waiting
        // for it (inflight tracking): resubmit them only once it is done.
        let old_io = self.zombies.iter().any(|z| z.index == q.index);
        q.ring
            .prefetch(&self.mem, self.depth.saturating_sub(self.in_flight));
        let mem = self.mem.mmap();
        let mut popped = false;
        while self.in_flight < self.depth {
            let (head, resubmitted) = match q.resubmit.front() {
                Some(_) if old_io => break,
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
            q.slots[h].taken = self.now;
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
                }
                q.used.push((head, used_len));
                if st == status::OK {
                    q.count_completed(head, self.now);
                } else {
                    bump(&q.stats.completed, 1);
                }
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
        for c in self.done.drain(..) {
            let (index, gen, head) = untoken(c.token);
            if let Some(q) = self
                .queues
                .iter_mut()
                .find(|q| q.index == index && q.gen == gen)
            {
                complete(q, head, c.result, &mut self.io_log, true, self.now);
            } else if let Some(q) = self
                .zombies
                .iter_mut()
                .find(|q| q.index == index && q.gen == gen)
            {
                complete(q, head, c.result, &mut self.io_log, false, self.now);
            } else {
                error!(
                    "worker {}: completion for unknown request {:#x}",
                    self.id, c.token
                );
            }
        }
        self.zombies.retain(|q| q.in_flight > 0);
        true
    }

    /// Answer the GET_VRING_BASEs whose queues have nothing left in flight (or that waited
    /// too long).
    fn finish_stops(&mut self) {
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
                q.kick.as_raw_fd(),
                EpollEvent::default(),
            );
            q.publish();
            let next = q.ring.next_avail();
            if let Some(stop) = q.stopping.take() {
                let _ = stop.reply.send(next);
            }
            if q.in_flight > 0 && q.inflight.is_some() {
                info!(
                    "queue {}: stopped at available index {next} with {} requests in flight; the inflight region keeps them for the next start",
                    q.index, q.in_flight
                );
                q.ring_ok = false;
                self.zombies.push(q);
            } else if q.in_flight > 0 {
                error!(
                    "queue {}: {} requests still in flight after {:?}; the ring is stopped at available index {next} and their completions will be dropped",
                    q.index, q.in_flight, self.stop_timeout
                );
                q.ring_ok = false;
                self.zombies.push(q);
            } else {
                info!("queue {}: stopped at available index {next}", q.index);
            }
        }
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
            more |= q.ring.set_kicks(true);
        }
        more && room
    }
}

/// Watch a queue's kick fd in `epoll`: an eventfd edge-triggered (never read: every kick
/// queues one event, and a wake-up costs one syscall less), anything else level-triggered
/// (read on every event). Hang-ups and errors are reported either way.
fn watch_kick(epoll: &Epoll, q: &mut Queue) -> io::Result<()> {
    q.kick_edge = queue::is_eventfd(&q.kick);
    let mut set = EventSet::IN;
    if q.kick_edge {
        set |= EventSet::EDGE_TRIGGERED;
    }
    epoll.ctl(
        ControlOperation::Add,
        q.kick.as_raw_fd(),
        EpollEvent::new(set, q.index as u64),
    )
}

/// This thread's CPU time (user and system), to the nanosecond.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into a live local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn nanos(d: Duration) -> u64 {
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

/// Finish request `head` of `q` with the engine's `result`; `publish`: write the status
/// and queue the used element (false for a queue the frontend has already stopped).
fn complete(
    q: &mut Queue,
    head: u16,
    result: io::Result<u64>,
    log: &mut RateLimit,
    publish: bool,
    now: Instant,
) {
    let Some(slot) = q.slots.get_mut(usize::from(head)) else {
        return;
    };
    if !slot.busy {
        error!(
            "queue {}: completion for head {head}, which is not in flight",
            q.index
        );
        return;
    }
    slot.busy = false;
    q.in_flight -= 1;
    let (st, used_len) = match &result {
        Ok(_) => (status::OK, slot.req.used_len_ok()),
        Err(e) => {
            bump(&q.stats.failed, 1);
            if log.allow() {
                warn!(
                    "queue {}: {:?} of {} bytes at sector {} failed: {e}",
                    q.index, slot.req.kind, slot.req.len, slot.req.sector
                );
            }
            (status::IOERR, 1)
        }
    };
    if !publish {
        return;
    }
    // SAFETY: status_ptr is a checked byte of guest memory, kept mapped by the worker's
    // memory view or its retired views while the request was in flight.
    unsafe { slot.req.status_ptr.write_volatile(st) };
    q.used.push((head, used_len));
    q.count_completed(head, now);
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
            durable,
        },
        RequestKind::WriteZeroes { unmap } => Op::WriteZeroes {
            offset: req.offset(),
            len: req.len,
            unmap,
            durable,
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
            // buffer of at least `iov_len` bytes that the worker's memory view keeps mapped.
            unsafe { v.iov_base.cast::<u8>().add(i).write_volatile(*b) };
        }
        src = &src[n..];
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
        if self.mailbox.pending.load(Ordering::Acquire) {
            self.handle_commands();
        }
        let p = self.pass();
        self.finish_stops();
        p
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
        (Worker::new(setup, mailbox.clone()).unwrap(), mailbox)
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
    pub(crate) fn set_stop_timeout(&mut self, d: Duration) {
        self.stop_timeout = d;
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
