//! The sync engine: `submit` does every queued operation on the calling thread
//! with `preadv2`/`pwritev2` (`RWF_DSYNC` for durable writes), `fdatasync` and
//! `fallocate`, so completions are ready when it returns. The kernel-thread model
//! of Xen's blkback, and the baseline the io_uring engine is measured against.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::backend::Backend;
use crate::engine::{Completion, CompletionRing, Engine, Full, Op};
use crate::sysio::SyncIo;

/// Synchronous engine for files and block devices.
pub(crate) struct SyncEngine {
    io: SyncIo,
    queued: VecDeque<(u64, Op)>,
    done: CompletionRing,
    depth: usize,
}

impl SyncEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: usize) -> Self {
        SyncEngine {
            io: SyncIo::new(backend),
            queued: VecDeque::with_capacity(depth),
            done: CompletionRing::new(depth),
            depth,
        }
    }
}

impl Engine for SyncEngine {
    fn name(&self) -> &'static str {
        "sync"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight() >= self.depth {
            return Err(Full);
        }
        self.queued.push_back((token, op));
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        while let Some((token, op)) = self.queued.pop_front() {
            // SAFETY: `op` was pushed under the push contract, which lasts until
            // its completion is reaped.
            let result = unsafe { self.io.run(&op) };
            self.done.push(token, result);
        }
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        self.done.drain(f)
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.done.is_empty() {
            self.submit()?;
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.done.len()
    }
}
