//! A worker thread of the daemon's pool: it runs the workers of every disk (every
//! session) placed on it, polls all of their queues in one loop and sleeps only when all
//! are idle, in one epoll that holds every kick, engine and mailbox descriptor of its
//! workers. The wake-up a host pays is shared by its disks.
//!
//! One round serves each worker once (commands, then a pass over its queues). Rounds
//! repeat while any worker makes progress, then for the polling window (poll.rs: one
//! window per thread and kind of idle period, fed by the work of all its workers; the
//! kind is whether any worker has operations at the disk); then every worker re-arms its
//! kicks and the thread sleeps until a kick, a completion, a command or the earliest
//! deadline of any worker. Coalescing (`--coalesce-us`, poll.rs) puts a timed sleep with
//! kicks still off before that, for as long as such sleeps are followed by work.
//!
//! A worker that panics is dropped from the thread and reported through its mailbox (its
//! session ends); the thread goes on serving the others. Workers that end are dropped on
//! the pool's reaper thread: dropping one waits for the requests it still has at the disk,
//! which must not stall the other disks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use log::{error, warn};
use std::os::fd::AsRawFd;

use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::{nanos, Worker};
use crate::poll::{Poll, Wait};
use crate::stats::{bump, WorkerStats};

/// Empty polling rounds between two reads of the clock.
const IDLE_ROUNDS_PER_CLOCK: u32 = 16;
/// The key of the thread's own inbox in its epoll (workers' keys are below it).
pub(super) const INBOX_KEY: u32 = u32::MAX;

/// Workers handed to a thread, and the pool telling it to end.
pub(super) struct Inbox {
    new: Mutex<Vec<Worker>>,
    pending: AtomicBool,
    stop: AtomicBool,
    pub(super) efd: EventFd,
}

impl Inbox {
    pub(super) fn new() -> std::io::Result<Inbox> {
        Ok(Inbox {
            new: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            efd: EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?,
        })
    }

    /// Hand `worker` to the thread.
    pub(super) fn push(&self, worker: Worker) {
        self.new
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(worker);
        self.pending.store(true, Ordering::Release);
        let _ = self.efd.write(1);
    }

    /// End the thread (once it holds no worker).
    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.efd.write(1);
    }

    fn take(&self) -> Vec<Worker> {
        self.pending.store(false, Ordering::Release);
        let _ = self.efd.read();
        std::mem::take(&mut *self.new.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One thread of the pool.
pub(super) struct WorkerThread {
    pub(super) index: usize,
    pub(super) epoll: Arc<Epoll>,
    pub(super) inbox: Arc<Inbox>,
    pub(super) workers: Vec<Worker>,
    pub(super) next_key: u32,
    pub(super) poll: Poll,
    pub(super) pin: Option<usize>,
    pub(super) stats: Arc<WorkerStats>,
    /// Workers that ended go here to be dropped (pool.rs).
    pub(super) reaper: Sender<Worker>,
}

impl WorkerThread {
    pub(super) fn run(mut self) {
        // Timed sleeps (a coalescing sleep, a QoS limit's next slot, a stop's deadline)
        // end within a µs of their deadline instead of the default slack of 50 µs.
        // SAFETY: prctl(PR_SET_TIMERSLACK) takes an integer and touches no memory.
        if unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000u64, 0u64, 0u64, 0u64) } != 0 {
            warn!(
                "worker thread {}: cannot set its timer slack: {}",
                self.index,
                std::io::Error::last_os_error()
            );
        }
        if let Some(cpu) = self.pin.take() {
            if let Err(e) = crate::config::pin_current_thread(cpu) {
                warn!("worker thread {}: cannot pin to CPU {cpu}: {e}", self.index);
            }
        }
        let mut idle_since: Option<Instant> = None;
        let mut idle_rounds = 0u32;
        let mut polling = false;
        let mut work = 0u64;
        // Coalescing (poll.rs): whether the last sleep left kicks off, and the work served
        // since it began.
        let mut coalesced = false;
        let mut since_coalesced = 0u64;
        let mut events = vec![EpollEvent::default(); 64];
        let mut now = Instant::now();
        loop {
            if self.inbox.pending.load(Ordering::Acquire) {
                self.welcome();
            }
            if self.inbox.stop.load(Ordering::SeqCst) && self.workers.is_empty() {
                return;
            }
            let mut progress = false;
            for w in &mut self.workers {
                progress |= w.service(now).unwrap_or(true);
                let done = w.take_work();
                work += done;
                since_coalesced += done;
            }
            self.let_go();
            if progress {
                if polling {
                    let spun = idle_since.map_or(Duration::ZERO, |t| now - t);
                    self.poll.hit(spun);
                    bump(&self.stats.poll_hits, 1);
                    polling = false;
                }
                idle_since = None;
                idle_rounds = 0;
                now = Instant::now();
                continue;
            }
            if idle_since.is_none() {
                // A busy period ends: credit its work to how the idle period before it
                // ended (poll.rs compares polling's cost per unit of work with sleeping's).
                self.poll.busy(std::mem::take(&mut work));
                self.poll.tick(now, thread_cpu);
                self.stats
                    .poll_regime
                    .store(self.poll.choice() as u64, Ordering::Relaxed);
            }
            // While polling, read the clock once per IDLE_ROUNDS_PER_CLOCK empty rounds:
            // it costs more than a round, and the window need not be exact.
            idle_rounds += 1;
            if idle_since.is_some() && !idle_rounds.is_multiple_of(IDLE_ROUNDS_PER_CLOCK) {
                std::hint::spin_loop();
                continue;
            }
            now = Instant::now();
            let since = match idle_since {
                Some(t) => t,
                None => {
                    // What this idle period waits for: the disk too, or the guest alone
                    // (poll.rs learns the two apart).
                    let at_disk = self.workers.iter().any(|w| w.at_disk());
                    self.poll
                        .idle(if at_disk { Wait::Disk } else { Wait::Guest });
                    *idle_since.insert(now)
                }
            };
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
            if let Some(delay) = self.poll.coalescing() {
                // Sleep with kicks still off: what the guest queues meanwhile waits at
                // most `delay` and is served by one wake-up. A coalescing sleep that was
                // followed by no work re-arms kicks (the guest went quiet, or waits for
                // us at QD1: the trial then finds this regime slower and drops it).
                if !coalesced || since_coalesced > 0 {
                    coalesced = true;
                    since_coalesced = 0;
                    self.sleep(&mut events, Some(delay));
                    idle_since = None;
                    now = Instant::now();
                    continue;
                }
            }
            coalesced = false;
            let mut more = false;
            for w in &mut self.workers {
                more |= w.rearm();
            }
            if more {
                // Work came in while re-arming: the window's spin found it after all.
                if let Some(t) = idle_since {
                    self.poll.hit(Instant::now() - t);
                }
                idle_since = None;
                now = Instant::now();
                continue;
            }
            self.sleep(&mut events, None);
            idle_since = None;
            now = Instant::now();
        }
    }

    /// Put the workers handed over on this thread.
    fn welcome(&mut self) {
        for mut w in self.inbox.take() {
            let key = self.next_key;
            self.next_key = self.next_key.wrapping_add(1) % INBOX_KEY;
            if let Err(e) = w.adopt(self.epoll.clone(), key) {
                error!(
                    "worker thread {}: cannot take worker {}: {e}",
                    self.index, w.id
                );
                w.mailbox.fail();
                w.detach();
                let _ = self.reaper.send(w);
                continue;
            }
            self.workers.push(w);
        }
    }

    /// Hand the workers that ended (or panicked) to the reaper.
    fn let_go(&mut self) {
        let mut i = 0;
        while i < self.workers.len() {
            if self.workers[i].exiting() || self.workers[i].failed {
                let mut w = self.workers.swap_remove(i);
                w.detach();
                let _ = self.reaper.send(w);
            } else {
                i += 1;
            }
        }
    }

    /// Wait in epoll for a kick, a completion or a command of any worker, no later than
    /// any worker's deadline; `coalescing`: kicks are off, and the wait lasts at most that.
    fn sleep(&mut self, events: &mut [EpollEvent], coalescing: Option<Duration>) {
        let mut deadline: Option<Instant> = None;
        let mut unannounced = false;
        for w in &self.workers {
            let hint = w.sleep_hint();
            unannounced |= hint.unannounced;
            deadline = match (deadline, hint.deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        if unannounced {
            // An engine without a completion fd must be waited for here (inline and sync
            // engines finish at once).
            for w in &mut self.workers {
                if w.sleep_hint().unannounced {
                    w.wait_engine();
                }
            }
            return;
        }
        let timeout = deadline
            .map(|d| {
                d.saturating_duration_since(Instant::now())
                    .min(Duration::from_secs(1))
            })
            .map_or(coalescing, |t| Some(coalescing.map_or(t, |c| c.min(t))));
        bump(&self.stats.sleeps, 1);
        if coalescing.is_some() {
            bump(&self.stats.coalesced_sleeps, 1);
        }
        // One sleep in poll::SAMPLE_EVERY is measured: the CPU this thread spends on it
        // (entering epoll, being switched out, woken and switched in) bounds the polling
        // window (poll.rs). A wait that found events at once did not sleep: not counted.
        let sample = self
            .poll
            .sample_due()
            .then(|| (thread_cpu(), Instant::now()));
        let waited = wait_precise(&self.epoll, timeout, events);
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
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return,
            Err(e) => {
                error!("worker thread {}: epoll_wait failed: {e}", self.index);
                std::thread::sleep(Duration::from_millis(1));
                return;
            }
        };
        for ev in &events[..n] {
            let (key, code) = ((ev.data() >> 32) as u32, ev.data() as u32);
            if key == INBOX_KEY {
                continue;
            }
            // A key no worker holds: an event that was queued before its worker left.
            if let Some(w) = self.workers.iter_mut().find(|w| w.key() == key) {
                w.event(code, ev.event_set());
            }
        }
    }
}

impl Worker {
    /// [`Worker::serve_round`], with a panic caught: the worker is marked failed (its
    /// mailbox refuses commands, its session learns it is lost) and `None` is returned.
    fn service(&mut self, now: Instant) -> Option<bool> {
        // Log lines written meanwhile name the disk. The round borrows the worker
        // mutably, so the name is lent as a pointer, not a borrow (a clone would cost two
        // atomic operations per worker per round).
        let disk: *const str = &*self.disk;
        // SAFETY: the name is the heap string of `self.disk`, an Arc<str> the worker
        // holds for its whole life and never replaces or changes; the call ends before
        // this function returns, while `self` lives.
        let round = unsafe {
            crate::log_context::with_disk_ptr(disk, || {
                catch_unwind(AssertUnwindSafe(|| self.serve_round(now)))
            })
        };
        match round {
            Ok(p) => Some(p),
            Err(_) => {
                error!(
                    "worker {}: it panicked; its session ends, the thread serves its other workers on",
                    self.id
                );
                self.failed = true;
                self.mailbox.fail();
                None
            }
        }
    }
}

/// Set once `epoll_pwait2` answered ENOSYS: timed waits then round up to milliseconds.
static NO_PWAIT2: AtomicBool = AtomicBool::new(false);

/// Whether timed waits in `epoll` are precise to the microsecond (`epoll_pwait2`, Linux
/// 5.11), tried with a wait that returns at once (`epoll` holds nothing level-triggered
/// that is ready, or the event stays reported: nothing is consumed).
pub(super) fn precise_waits(epoll: &Epoll) -> bool {
    let mut one = [EpollEvent::default()];
    let _ = wait_precise(epoll, Some(Duration::ZERO), &mut one);
    !NO_PWAIT2.load(Ordering::Relaxed)
}

/// Wait in `epoll` for up to `timeout` (None: until an event), to the microsecond: a
/// disk's QoS limits wake the worker when a waiting request may go, at rates up to
/// hundreds of thousands per second (epoll_pwait2, Linux 5.11; before it, epoll_wait's
/// milliseconds).
fn wait_precise(
    epoll: &Epoll,
    timeout: Option<Duration>,
    events: &mut [EpollEvent],
) -> std::io::Result<usize> {
    let Some(t) = timeout else {
        return epoll.wait(-1, events);
    };
    if !NO_PWAIT2.load(Ordering::Relaxed) {
        let ts = libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
        };
        // SAFETY: a valid epoll fd; `events` is a live array of epoll_event-compatible
        // structures (EpollEvent is repr(transparent) over epoll_event) of the length
        // passed; `ts` is a live timespec; no signal mask.
        let r = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait2,
                epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len().min(i32::MAX as usize) as libc::c_int,
                &ts as *const libc::timespec,
                std::ptr::null::<libc::sigset_t>(),
                0usize,
            )
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOSYS) {
            return Err(e);
        }
        NO_PWAIT2.store(true, Ordering::Relaxed);
    }
    let ms = t.as_millis().min(1000) as i32 + i32::from(t.subsec_nanos() % 1_000_000 != 0);
    epoll.wait(ms, events)
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
