//! The threads engine: each engine (so each device worker) owns a pool of threads that do
//! the operations with `preadv2`/`pwritev2`, `fdatasync` and `fallocate` ([`SyncIo`]), as
//! QEMU's `aio=threads` does with its thread pool, and as close as userspace comes to Xen
//! blkback's kernel thread doing synchronous submission for its ring.
//!
//! `push` queues on the engine itself (no lock); `submit` hands the whole batch to the pool
//! under the pool's one lock, which only this engine and its own threads take — there is
//! no lock shared between workers or between the queues of different workers. Completions
//! come back through the pool's done queue and the engine's eventfd ([`crate::pool`]).
//!
//! The pool has up to `--engine-threads` threads ([`DEFAULT_ENGINE_THREADS`] by default),
//! started as the work needs them. The pool size is the most operations this engine has
//! at the disk at once: a deeper guest queue waits in the pool's queue.
//!
//! Short transfers, end of file, O_DIRECT bounce buffers (one per thread, for one
//! operation at a time) and the fallbacks of discard and write-zeroes are [`SyncIo`]'s, the
//! same code as the sync engine's. The kernel never refuses work here, so
//! [`Engine::backlog`] is always 0.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::backend::Backend;
use crate::engine::{Completion, CompletionRing, Engine, Full, Op};
use crate::error::Error;
use crate::pool::{drain_eventfd, new_eventfd, wait_readable, Job, Pool};
#[cfg(doc)]
use crate::sysio::SyncIo;

/// Default pool size per engine. The pool bounds the I/O the engine has at the disk at
/// once; 16 holds the 16 MiB bounce ceiling of the other engines (one 1 MiB buffer per
/// thread), and threads are started only as concurrency needs them.
pub const DEFAULT_ENGINE_THREADS: usize = 16;
/// Largest pool per engine: QEMU's thread pool default (`thread-pool-max` 64).
pub const MAX_ENGINE_THREADS: usize = 64;

/// Thread-pool engine for files and block devices.
pub(crate) struct ThreadsEngine {
    /// Declared first: dropped (threads joined) before `event` is closed.
    pool: Pool,
    /// Pushed and not yet handed to the pool.
    staged: VecDeque<Job>,
    /// Taken from the pool, not yet reaped.
    ready: CompletionRing,
    /// Signals read from the eventfd whose completions have not been taken.
    credit: u64,
    event: OwnedFd,
    /// Pushed and not reaped.
    in_flight: usize,
    depth: usize,
}

impl ThreadsEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: u32, threads: usize) -> Result<Self, Error> {
        let setup = |source| Error::EngineSetup {
            engine: "threads",
            depth,
            source,
        };
        let n = depth as usize;
        let event = new_eventfd().map_err(setup)?;
        let pool = Pool::new(backend, n, threads, 1, event.as_raw_fd(), "io").map_err(setup)?;
        Ok(ThreadsEngine {
            pool,
            staged: VecDeque::with_capacity(n),
            ready: CompletionRing::new(n),
            credit: 0,
            event,
            in_flight: 0,
            depth: n,
        })
    }

    /// Takes the completions the eventfd has signalled.
    fn collect(&mut self) {
        self.credit += drain_eventfd(self.event.as_raw_fd());
        let ready = &mut self.ready;
        let n = self
            .pool
            .take(self.credit, &mut |c| ready.push(c.token, c.result));
        self.credit -= n;
    }
}

impl Engine for ThreadsEngine {
    fn name(&self) -> &'static str {
        "threads"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.depth {
            return Err(Full);
        }
        self.in_flight += 1;
        self.staged.push_back(Job { tag: token, op });
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        // SAFETY: every staged op was pushed under the push contract, which lasts until its
        // completion is reaped (taken from the pool first) or the engine, and with it the
        // pool, is dropped.
        unsafe { self.pool.submit(&mut self.staged) };
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        // No syscall unless a completion is visible: then the eventfd holds (or is about
        // to hold) its signal.
        if self.pool.has_done() {
            self.collect();
        }
        let n = self.ready.drain(f);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        self.submit()?;
        loop {
            if self.in_flight == 0 || !self.ready.is_empty() {
                return Ok(());
            }
            if self.pool.has_done() {
                self.collect();
                if !self.ready.is_empty() {
                    return Ok(());
                }
            }
            wait_readable(self.event.as_raw_fd())?;
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheMode, DiskSpec, OpenOptions};

    /// Threads start as concurrency needs them, up to the pool size, and stay.
    #[test]
    fn threads_start_on_demand() {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("vblk-threads-")
            .tempdir_in(target)
            .unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0x5au8; 1 << 20]).unwrap();
        let opts = OpenOptions {
            cache: CacheMode::Writeback,
            ..Default::default()
        };
        let b = Arc::new(Backend::open(&DiskSpec::File(path), &opts).unwrap());
        let mut e = ThreadsEngine::new(b, 32, 4).unwrap();
        assert_eq!(e.pool.threads(), 1, "one thread at setup");
        let mut bufs = vec![vec![0u8; 4096]; 8];
        let iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        for round in 0..3 {
            let n = if round == 0 { 2 } else { 8 };
            for (i, v) in iovs.iter().take(n).enumerate() {
                let op = Op::Read {
                    offset: 4096 * i as u64,
                    iov: v,
                    iovcnt: 1,
                };
                // SAFETY: the buffers and iovecs outlive the engine's use (reaped below).
                unsafe { e.push(i as u64, op) }.unwrap();
            }
            e.submit().unwrap();
            let mut got = 0;
            while got < n {
                e.wait().unwrap();
                got += e.reap(&mut |c| assert_eq!(c.result.unwrap(), 4096));
            }
            let want = if round == 0 { 2 } else { 4 };
            assert_eq!(e.pool.threads(), want, "round {round}");
        }
        assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0x5a)));
    }
}
