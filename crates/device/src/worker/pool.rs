//! The daemon's worker threads (`--threads T`), shared by every disk it serves and kept
//! across sessions: a session puts its workers on them ([`Pool::attach`]) and takes them
//! off when it ends. Also the reaper, the thread that drops workers that ended.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{channel, sync_channel};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use log::{error, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::thread::{precise_waits, Inbox, WorkerThread, INBOX_KEY};
use super::{Worker, WorkerHandle};
use crate::poll::{Poll, PIN_REGIME_ENV};
use crate::stats::WorkerStats;

/// How the pool's threads run.
#[derive(Clone, Debug, Default)]
pub(crate) struct PoolConfig {
    /// Threads (at least 1).
    pub threads: usize,
    /// Thread t runs on CPU `cpus[t % len]` (empty: not pinned).
    pub cpus: Vec<usize>,
    /// The polling window's ceiling, µs (0: never spin).
    pub poll_us: u64,
    /// The longest a coalescing sleep leaves kicks off, µs (0: never coalesce).
    pub coalesce_us: u64,
}

struct ThreadHandle {
    inbox: Arc<Inbox>,
    join: Option<JoinHandle<()>>,
}

/// The worker threads.
pub(crate) struct Pool {
    threads: Vec<ThreadHandle>,
    stats: Vec<Arc<WorkerStats>>,
    reaper: Option<JoinHandle<()>>,
}

impl Pool {
    /// Start `config.threads` threads (and the reaper). They sleep until workers come.
    pub(crate) fn new(config: &PoolConfig) -> io::Result<Pool> {
        let (to_reaper, reaped) = channel::<Worker>();
        let reaper = std::thread::Builder::new()
            .name("vblk-reaper".into())
            .spawn(move || {
                for w in reaped {
                    // Dropping a worker waits for its requests at the disk (worker/mod.rs).
                    if catch_drop(w).is_err() {
                        error!("a worker panicked while it ended");
                    }
                }
            })?;
        let mut pool = Pool {
            threads: Vec::new(),
            stats: Vec::new(),
            reaper: Some(reaper),
        };
        let mut coalesce_us = config.coalesce_us;
        let pinned = std::env::var(PIN_REGIME_ENV).ok();
        for t in 0..config.threads.max(1) {
            let inbox = Arc::new(Inbox::new()?);
            let epoll = Arc::new(Epoll::new()?);
            epoll.ctl(
                ControlOperation::Add,
                inbox.efd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, u64::from(INBOX_KEY) << 32),
            )?;
            if coalesce_us > 0 && !precise_waits(&epoll) {
                // epoll_wait's timeouts are whole milliseconds: a coalescing sleep would
                // hold requests for 1 ms, not the microseconds asked for.
                warn!(
                    "--coalesce-us {coalesce_us}: this kernel has no epoll_pwait2 (Linux 5.11), so a worker cannot sleep for microseconds; coalescing is off"
                );
                coalesce_us = 0;
            }
            let mut poll = Poll::new(config.poll_us, coalesce_us);
            if let Some(name) = &pinned {
                match Poll::regime_named(name) {
                    Some(r) if poll.pin(r) => {}
                    _ => warn!("{PIN_REGIME_ENV}={name}: not a regime these flags allow; ignored"),
                }
            }
            let stats = Arc::<WorkerStats>::default();
            let thread = WorkerThread {
                index: t,
                epoll,
                inbox: inbox.clone(),
                workers: Vec::new(),
                next_key: 0,
                poll,
                pin: (!config.cpus.is_empty()).then(|| config.cpus[t % config.cpus.len()]),
                stats: stats.clone(),
                reaper: to_reaper.clone(),
            };
            let join = std::thread::Builder::new()
                .name(format!("vblk-worker-{t}"))
                .spawn(move || thread.run())?;
            pool.threads.push(ThreadHandle {
                inbox,
                join: Some(join),
            });
            pool.stats.push(stats);
        }
        Ok(pool)
    }

    /// The number of threads.
    pub(crate) fn len(&self) -> usize {
        self.threads.len()
    }

    /// The threads' counters, by thread.
    pub(crate) fn stats(&self) -> &[Arc<WorkerStats>] {
        &self.stats
    }

    /// Put `worker` on thread `thread % len`. Dropping the handle ends the worker and
    /// waits up to `join_timeout` for it to be gone.
    pub(crate) fn attach(
        &self,
        thread: usize,
        mut worker: Worker,
        join_timeout: Duration,
    ) -> io::Result<WorkerHandle> {
        let (alive, ended) = sync_channel::<()>(0);
        worker.set_alive(alive);
        let handle = WorkerHandle {
            id: worker.id,
            mailbox: worker.mailbox.clone(),
            ended,
            join_timeout,
        };
        self.threads[thread % self.threads.len()].inbox.push(worker);
        Ok(handle)
    }
}

/// Drop `w`, catching a panic.
fn catch_drop(w: Worker) -> std::thread::Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(w)))
}

impl Drop for Pool {
    /// Every worker has ended (their sessions dropped their handles): the threads end,
    /// then the reaper once it dropped the last worker.
    fn drop(&mut self) {
        for t in &self.threads {
            t.inbox.stop();
        }
        for t in &mut self.threads {
            if let Some(j) = t.join.take() {
                if j.join().is_err() {
                    error!("a worker thread panicked");
                }
            }
        }
        // The reaper is not waited for: a worker it still drops is one whose requests
        // did not end in time (NBD deadlines bound them), left to end on its own.
        drop(self.reaper.take());
    }
}
