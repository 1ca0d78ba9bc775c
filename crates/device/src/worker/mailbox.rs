//! How the control thread talks to a worker: commands in a mailbox (a locked queue the
//! control thread fills and the worker empties, plus an eventfd that wakes it), answers on
//! a one-shot channel, each awaited with a deadline.
//!
//! A worker that does not answer in time, or that panicked (its thread drops it and
//! serves its other workers on), is reported as [`Lost`]: the session then ends and the
//! daemon serves the next frontend. Ending a worker is awaited with a deadline too; one
//! that does not end in time is left to end on its own (its requests stay counted in the
//! device's [`Fence`](super::Fence), so nothing of it can land after a later session's
//! requests).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use log::error;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::queue::QueueStart;
use crate::dirty_log::DirtyLog;
use crate::memory::GuestMemory;
use crate::vring_fd::VringFd;

/// What the control thread asks of a worker.
#[derive(Debug)]
pub(crate) enum Command {
    Start(Box<QueueStart>),
    /// GET_VRING_BASE: stop popping, wait (up to the drain timeout) for the queue's
    /// requests, publish them, answer the next available index.
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
        fd: Option<VringFd>,
    },
    SetErr {
        queue: usize,
        fd: Option<VringFd>,
    },
    SetKick {
        queue: usize,
        fd: VringFd,
    },
    Memory {
        mem: Arc<GuestMemory>,
        reply: SyncSender<()>,
    },
    /// Live migration's dirty log: mark every guest page written from now on (Some), or
    /// stop (None). Answered once the worker uses it.
    Log {
        log: Option<Arc<DirtyLog>>,
        reply: SyncSender<()>,
    },
    /// Where queue `queue`'s used-ring writes are logged (SET_VRING_ADDR with
    /// VHOST_VRING_F_LOG on a running ring; None: not logged). Answered once the worker
    /// logs there: the frontend counts on every used-ring write after its reply being
    /// logged.
    LogRing {
        queue: usize,
        used_gpa: Option<u64>,
        reply: SyncSender<()>,
    },
    /// New QoS limits for the disk (None: unlimited). Requests waiting are looked at again
    /// under them.
    Throttle(Option<Box<super::ThrottleSetup>>),
    /// Tests: panic on the worker thread.
    #[cfg(test)]
    Panic,
    Exit,
}

/// Commands waiting for a worker, and the eventfd that wakes it.
#[derive(Debug)]
pub(crate) struct Mailbox {
    cmds: Mutex<VecDeque<Command>>,
    pub(super) pending: AtomicBool,
    pub(super) efd: EventFd,
    /// Set when the worker panicked: it takes no more commands.
    gone: AtomicBool,
}

impl Mailbox {
    pub(crate) fn new() -> io::Result<Mailbox> {
        Ok(Mailbox {
            cmds: Mutex::new(VecDeque::new()),
            pending: AtomicBool::new(false),
            efd: EventFd::new(EFD_NONBLOCK)?,
            gone: AtomicBool::new(false),
        })
    }

    /// The worker panicked: commands waiting are dropped (whoever awaits an answer learns
    /// at once that none comes) and later ones too.
    pub(super) fn fail(&self) {
        self.gone.store(true, Ordering::SeqCst);
        self.take();
    }

    pub(crate) fn send(&self, cmd: Command) {
        if self.gone.load(Ordering::SeqCst) {
            return;
        }
        self.cmds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(cmd);
        self.pending.store(true, Ordering::Release);
        let _ = self.efd.write(1);
    }

    pub(super) fn take(&self) -> VecDeque<Command> {
        self.pending.store(false, Ordering::Release);
        let _ = self.efd.read();
        std::mem::take(&mut *self.cmds.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A worker that did not answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Lost {
    /// It ended without answering: it panicked (logged where it happened).
    #[error("worker {0} is gone (it panicked)")]
    Gone(usize),
    /// No answer within the deadline.
    #[error("worker {worker} did not answer within {waited:?}")]
    Late {
        /// The worker.
        worker: usize,
        /// How long it was waited for.
        waited: Duration,
    },
}

/// The control thread's handle on a worker (on a thread of the daemon's pool).
pub(crate) struct WorkerHandle {
    pub(super) id: usize,
    pub(super) mailbox: Arc<Mailbox>,
    /// Disconnected once the worker is dropped (its sender is the worker's last field,
    /// dropped also when it unwinds): ending waits on it.
    pub(super) ended: Receiver<()>,
    /// How long dropping the handle waits for the worker to end.
    pub(super) join_timeout: Duration,
}

impl WorkerHandle {
    pub(crate) fn send(&self, cmd: Command) {
        self.mailbox.send(cmd);
    }

    /// Its mailbox (to tell it of changes that do not wait for an answer).
    pub(crate) fn mailbox(&self) -> Arc<Mailbox> {
        self.mailbox.clone()
    }

    /// Send a command and wait up to `deadline` for its answer.
    pub(crate) fn ask<T>(
        &self,
        deadline: Duration,
        make: impl FnOnce(SyncSender<T>) -> Command,
    ) -> Result<T, Lost> {
        let (tx, rx) = sync_channel(1);
        self.mailbox.send(make(tx));
        match rx.recv_timeout(deadline) {
            Ok(v) => Ok(v),
            Err(RecvTimeoutError::Disconnected) => Err(Lost::Gone(self.id)),
            Err(RecvTimeoutError::Timeout) => Err(Lost::Late {
                worker: self.id,
                waited: deadline,
            }),
        }
    }

    /// Whether the worker has ended (normally only after Exit; else it panicked).
    pub(crate) fn ended(&self) -> bool {
        self.mailbox.gone.load(Ordering::SeqCst)
            || matches!(self.ended.try_recv(), Err(TryRecvError::Disconnected))
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.mailbox.send(Command::Exit);
        if let Err(RecvTimeoutError::Timeout) = self.ended.recv_timeout(self.join_timeout) {
            error!(
                "worker {}: it did not end within {:?} (requests still at the disk); it is left to end on its own, and its requests keep later ones fenced",
                self.id, self.join_timeout
            );
        }
    }
}
