//! Reconnection attempts off the worker. An attempt (name lookup, connect, handshake, all
//! bounded together by [`NbdOptions::timeout`](super::NbdOptions)) runs on a short-lived
//! thread of its own, which hands the ready socket back over a channel and wakes the
//! engine through an eventfd in the engine's epoll set: a worker reconnecting to a server
//! that trickles its handshake goes on serving everything else, and only ever reads the
//! attempt's result.
//!
//! The thread touches no operation and no caller buffer, only the export's description
//! (shared, read-only) and the socket it makes. If the engine is gone when it ends (an
//! engine dropped during an attempt does not wait for it), the channel is closed and the
//! socket is closed unused; the eventfd lives until both sides let go of it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::Arc;

use super::sys::os_err;
use super::{Export, NbdError};

/// A connection attempt under way.
pub(crate) struct Dial {
    rx: Receiver<Result<OwnedFd, NbdError>>,
}

impl Dial {
    /// Starts an attempt to connect to `ex`; `wake` is written once its result is sent.
    pub(crate) fn start(ex: &Arc<Export>, wake: &Arc<OwnedFd>) -> io::Result<Dial> {
        let (tx, rx) = mpsc::sync_channel(1);
        let (ex, wake) = (Arc::clone(ex), Arc::clone(wake));
        std::thread::Builder::new()
            .name("nbd-connect".into())
            .spawn(move || {
                // A closed channel means the engine is gone: the socket is dropped here.
                let _ = tx.send(ex.connect());
                let one = 1u64.to_ne_bytes();
                // SAFETY: writes 8 bytes from a live local to an eventfd kept alive by
                // the Arc this thread holds.
                unsafe { libc::write(wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
            })?;
        Ok(Dial { rx })
    }

    /// The attempt's result, once it has one.
    pub(crate) fn result(&self) -> Option<Result<OwnedFd, NbdError>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err(NbdError::Connect {
                source: io::Error::other("the connection attempt's thread ended without a result"),
            })),
        }
    }
}

/// A non-blocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; flags are valid.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(os_err());
    }
    // SAFETY: eventfd just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Resets an eventfd (it stays readable until read).
pub(crate) fn drain(fd: &OwnedFd) {
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live local; the eventfd is non-blocking.
    unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
}
