//! A pool of I/O threads owned by one engine (so by one device worker): the `threads`
//! engine's whole mechanism, and the aio engine's helper for what Linux AIO cannot do.
//!
//! Hand-off. One queue of jobs per pool, behind one mutex, shared by the engine that owns
//! the pool and the pool's own threads — never by two engines, so never by two workers or
//! the queues they serve (DESIGN rule 2). The owner moves a whole batch in under one lock
//! and wakes only as many sleeping threads as there are new jobs; a thread takes one job at
//! a time, so whichever thread is free takes the next job (no job waits behind a slow one
//! while another thread idles, as it would with one ring per thread).
//!
//! Completions. A thread pushes its result onto the pool's done queue, then adds 1 to the
//! engine's eventfd. Every completion is signalled exactly once, after it is visible, so
//! the owner consumes exactly as many completions as it has read signals
//! ([`Pool::take`]): the eventfd is then readable exactly while completions wait, and a
//! level-triggered epoll on it neither misses one nor spins on a stale signal. The owner
//! learns that completions are visible from an atomic counter, without a syscall.
//!
//! Threads are started when work needs them: a pool of `max` threads has as many as the
//! most jobs it has held at once (at most `max`), like QEMU's thread pool. None are
//! stopped while the pool lives, so a warm pool makes no allocation per job. Each thread
//! owns a [`SyncIo`] (its own bounce buffer and zero buffer, allocated on first use, one
//! operation at a time): at most `max` bounce buffers of 1 MiB per pool.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::backend::Backend;
use crate::engine::{errno, Completion, Op};
use crate::sysio::SyncIo;

/// Pool threads are named this and the pool's name (`vblk-pool-io`, `vblk-pool-aio`), so
/// that CPU accounting can find them (`vblk bench` counts them on the device side).
pub const POOL_THREAD_PREFIX: &str = "vblk-pool-";

/// Stack size of a pool thread: `SyncIo` needs a few KiB.
const STACK: usize = 256 * 1024;

/// One job: `op`, answered with a [`Completion`] carrying `tag`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Job {
    pub tag: u64,
    pub op: Op,
}

/// What the owner and the threads share.
struct Shared {
    state: Mutex<State>,
    /// Signalled when jobs arrive or the pool stops.
    work: Condvar,
    /// Completions pushed and not taken (the owner's syscall-free check).
    done_len: AtomicUsize,
}

struct State {
    jobs: VecDeque<Job>,
    done: VecDeque<Completion>,
    /// Threads waiting on `work`.
    sleeping: usize,
    /// Wake-ups sent and not yet used by a waking thread.
    woken: usize,
    stop: bool,
}

/// A pool of up to `max` threads doing [`SyncIo::run`] for one engine.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    max: usize,
    backend: Arc<Backend>,
    /// The owner's eventfd; it outlives the pool (the owner drops the pool first).
    efd: RawFd,
    name: &'static str,
    /// Jobs handed over whose completion has not been taken.
    outstanding: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock left the queues consistent (every
        // update under the lock is a single push or pop).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Pool {
    /// A pool for up to `depth` jobs at once, with up to `max` threads (`max >= 1`) that
    /// signal completions on `efd`. `min` threads start now: an engine that cannot start a
    /// thread fails at setup rather than at its first operation.
    pub(crate) fn new(
        backend: Arc<Backend>,
        depth: usize,
        max: usize,
        min: usize,
        efd: RawFd,
        name: &'static str,
    ) -> io::Result<Pool> {
        let mut pool = Pool {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    jobs: VecDeque::with_capacity(depth),
                    done: VecDeque::with_capacity(depth),
                    sleeping: 0,
                    woken: 0,
                    stop: false,
                }),
                work: Condvar::new(),
                done_len: AtomicUsize::new(0),
            }),
            threads: Vec::with_capacity(max),
            max: max.max(1),
            backend,
            efd,
            name,
            outstanding: 0,
        };
        for _ in 0..min.min(pool.max) {
            pool.spawn()?;
        }
        Ok(pool)
    }

    fn spawn(&mut self) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let io = SyncIo::new(Arc::clone(&self.backend));
        let efd = self.efd;
        let handle = std::thread::Builder::new()
            .name(format!("{POOL_THREAD_PREFIX}{}", self.name))
            .stack_size(STACK)
            .spawn(move || run(&shared, io, efd))?;
        self.threads.push(handle);
        Ok(())
    }

    /// Hands every job in `jobs` to the pool (one lock), wakes as many sleeping threads
    /// as needed and starts threads up to one per outstanding job (at most `max`).
    ///
    /// # Safety
    /// The [`Engine::push`](crate::Engine::push) contract holds for every job's op until
    /// its completion has been taken, or the pool is dropped.
    pub(crate) unsafe fn submit(&mut self, jobs: &mut VecDeque<Job>) {
        let n = jobs.len();
        if n == 0 {
            return;
        }
        let wake = {
            let mut st = self.shared.lock();
            st.jobs.extend(jobs.drain(..));
            let wake = n.min(st.sleeping.saturating_sub(st.woken));
            st.woken += wake;
            wake
        };
        for _ in 0..wake {
            self.shared.work.notify_one();
        }
        self.outstanding += n;
        while self.threads.len() < self.max.min(self.outstanding) {
            if let Err(e) = self.spawn() {
                // The threads there are take the work; it only waits longer.
                log::warn!(
                    "{} pool: cannot start thread {} of {}: {e}",
                    self.name,
                    self.threads.len() + 1,
                    self.max
                );
                break;
            }
        }
    }

    /// Whether completions are waiting to be taken.
    pub(crate) fn has_done(&self) -> bool {
        self.shared.done_len.load(Ordering::Acquire) > 0
    }

    /// Passes at most `max` completions, oldest first, to `f` (under the pool's lock: `f`
    /// only files them away); returns how many.
    pub(crate) fn take(&mut self, max: u64, f: &mut dyn FnMut(Completion)) -> u64 {
        if max == 0 || !self.has_done() {
            return 0;
        }
        let mut n = 0;
        let mut st = self.shared.lock();
        while n < max {
            let Some(c) = st.done.pop_front() else { break };
            f(c);
            n += 1;
        }
        self.shared
            .done_len
            .fetch_sub(n as usize, Ordering::Release);
        drop(st);
        self.outstanding -= n as usize;
        n
    }

    /// Jobs handed over whose completion has not been taken.
    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Threads started so far.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for Pool {
    /// Jobs not started are dropped; jobs running finish (they may be using the owner's
    /// buffers) before the threads are joined.
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.jobs.clear();
            st.stop = true;
        }
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                log::error!("{} pool: a thread panicked", self.name);
            }
        }
    }
}

/// A pool thread: take a job, do it, file the completion, signal it; until stopped.
fn run(shared: &Shared, mut io: SyncIo, efd: RawFd) {
    loop {
        let job = {
            let mut st = shared.lock();
            loop {
                if st.stop {
                    return;
                }
                if let Some(job) = st.jobs.pop_front() {
                    break job;
                }
                st.sleeping += 1;
                st = shared.work.wait(st).unwrap_or_else(PoisonError::into_inner);
                st.sleeping -= 1;
                st.woken = st.woken.saturating_sub(1);
            }
        };
        // SAFETY: the owner pushed this op under the push contract, which lasts until its
        // completion is taken; it is taken only after it is filed below.
        let result = catch_unwind(AssertUnwindSafe(|| unsafe { io.run(&job.op) }))
            .unwrap_or_else(|_| Err(errno(libc::EIO)));
        {
            let mut st = shared.lock();
            st.done.push_back(Completion {
                token: job.tag,
                result,
            });
            shared.done_len.fetch_add(1, Ordering::Release);
        }
        signal(efd);
    }
}

/// Adds 1 to the eventfd `efd`.
fn signal(efd: RawFd) {
    let one = 1u64;
    loop {
        // SAFETY: writes 8 bytes from a live u64 to an eventfd the owner keeps open until
        // this thread has been joined.
        let rc = unsafe { libc::write(efd, (&one as *const u64).cast(), 8) };
        if rc == 8 {
            return;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            // Only a counter at 2^64 - 2 refuses, which a completion count never reaches.
            log::error!("pool: cannot signal completion on eventfd {efd}: {e}");
            return;
        }
    }
}

/// Reads and resets the eventfd `efd` (non-blocking): the signals since the last read.
pub(crate) fn drain_eventfd(efd: RawFd) -> u64 {
    let mut count = 0u64;
    loop {
        // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd the caller owns.
        let rc = unsafe { libc::read(efd, (&mut count as *mut u64).cast(), 8) };
        if rc == 8 {
            return count;
        }
        if rc < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        // EAGAIN: nothing signalled.
        return 0;
    }
}

/// Blocks until the eventfd `efd` is readable (or a signal interrupts).
pub(crate) fn wait_readable(efd: RawFd) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd: efd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let rc = unsafe { libc::poll(&mut p, 1, -1) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// A non-blocking, close-on-exec eventfd.
pub(crate) fn new_eventfd() -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall; flags are valid.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if efd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: eventfd just returned this descriptor and nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(efd) })
}
