//! A vring's kick, call and error descriptors, as the frontend hands them over, and how
//! the device reads and signals them without ever blocking on them.
//!
//! The descriptor is shared with the frontend: so is its open file description, and with
//! it `O_NONBLOCK`, which the frontend can clear again at any time after we set it. So no
//! call here relies on that flag:
//! - a pipe or FIFO is read and written with `preadv2`/`pwritev2` and `RWF_NOWAIT`, which
//!   never blocks whatever the flags;
//! - a socket with `recv`/`send` and `MSG_DONTWAIT`;
//! - an eventfd is never read (its kicks are watched edge-triggered: a counter cannot fill
//!   up); it is written, and Linux has no per-call flag for that, so the write runs under
//!   the [`watchdog`](crate::watchdog), which interrupts it if it blocks: the descriptor is
//!   then reported [`Signalled::Wedged`] and the session ends.
//!
//! Anything else (a regular file, a directory, a character device) is refused when the
//! frontend passes it: it cannot be watched with epoll, or reading it means something else.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::watchdog;

/// What a descriptor is, which decides how it is read and written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FdKind {
    Eventfd,
    Pipe,
    Socket,
}

/// A kick, call or error descriptor from the frontend.
#[derive(Debug)]
pub(crate) struct VringFd {
    file: File,
    kind: FdKind,
}

/// How a signal went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signalled {
    /// Written, or already pending (a full pipe or a saturated counter means "something
    /// happened" already).
    Yes,
    /// The write blocked and the watchdog interrupted it: the frontend wedged the
    /// descriptor.
    Wedged,
    /// The descriptor failed (its reader is gone): nothing more will be heard through it.
    Failed,
}

impl VringFd {
    /// Take `file` as a vring descriptor for `role` ("kick", "call", "error").
    pub(crate) fn new(file: File, role: &str) -> Result<VringFd, String> {
        let kind = kind_of(&file).ok_or_else(|| {
            format!(
                "the {role} fd ({}) is not an eventfd, a pipe or a socket",
                describe(&file)
            )
        })?;
        // Best effort: nothing below relies on it, but a frontend that leaves it set spares
        // the watchdog any work.
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL take no pointers.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Ok(VringFd { file, kind })
    }

    pub(crate) fn kind(&self) -> FdKind {
        self.kind
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Tell the peer something happened (a call or an error). Never blocks for longer than
    /// the watchdog allows.
    pub(crate) fn signal(&self) -> Signalled {
        let one = 1u64.to_ne_bytes();
        let fd = self.file.as_raw_fd();
        let iov = libc::iovec {
            iov_base: one.as_ptr().cast_mut().cast(),
            iov_len: one.len(),
        };
        let r = match self.kind {
            FdKind::Eventfd => watchdog::guarded(|| {
                // SAFETY: writes 8 bytes from a live local array to a descriptor we own.
                unsafe { libc::write(fd, one.as_ptr().cast(), one.len()) }
            }),
            // SAFETY: one iovec naming a live local array; RWF_NOWAIT never blocks.
            FdKind::Pipe => unsafe { libc::pwritev2(fd, &iov, 1, -1, libc::RWF_NOWAIT) },
            // SAFETY: as above, for a socket.
            FdKind::Socket => unsafe {
                libc::send(
                    fd,
                    one.as_ptr().cast(),
                    one.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            },
        };
        if r >= 0 {
            return Signalled::Yes;
        }
        match io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) => Signalled::Yes,
            Some(libc::EINTR) if self.kind == FdKind::Eventfd => Signalled::Wedged,
            Some(libc::EINTR) => Signalled::Yes,
            _ => Signalled::Failed,
        }
    }

    /// Read what is waiting on a kick pipe or socket (an eventfd is never read). False at
    /// end of file: the writer went away.
    pub(crate) fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        let fd = self.file.as_raw_fd();
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let r = match self.kind {
            FdKind::Eventfd => return true,
            // SAFETY: one iovec naming a live local buffer; RWF_NOWAIT never blocks.
            FdKind::Pipe => unsafe { libc::preadv2(fd, &iov, 1, -1, libc::RWF_NOWAIT) },
            // SAFETY: reads at most 64 bytes into a live local buffer, without waiting.
            FdKind::Socket => unsafe {
                libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT)
            },
        };
        r != 0
    }
}

/// What `file` is, if it is one of the kinds a vring descriptor may be.
fn kind_of(file: &File) -> Option<FdKind> {
    let meta = file.metadata().ok()?;
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_fifo() {
        return Some(FdKind::Pipe);
    }
    if t.is_socket() {
        return Some(FdKind::Socket);
    }
    let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()?;
    (link.as_os_str() == "anon_inode:[eventfd]").then_some(FdKind::Eventfd)
}

fn describe(file: &File) -> String {
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map(|l| l.display().to_string())
        .unwrap_or_else(|e| format!("unknown: {e}"))
}

#[cfg(test)]
mod tests {
    use std::os::fd::FromRawFd;

    use super::*;

    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two fds into a live local array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both ends were just created and are owned by these Files.
        unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
    }

    fn set_blocking(f: &File) {
        // SAFETY: fcntl on a descriptor the test owns.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }

    /// The frontend clears O_NONBLOCK after handing the fd over (it shares the open file
    /// description), then fills the pipe or empties it: the device never blocks.
    #[test]
    fn pipes_never_block_whatever_the_frontend_does_to_their_flags() {
        let (r, w) = pipe();
        let (r2, w2) = (r.try_clone().unwrap(), w.try_clone().unwrap());
        let call = VringFd::new(w, "call").unwrap();
        let kick = VringFd::new(r, "kick").unwrap();
        assert_eq!(call.kind(), FdKind::Pipe);
        set_blocking(&w2);
        set_blocking(&r2);
        // Fill the pipe: every further signal must still return at once.
        for _ in 0..20_000 {
            assert_eq!(call.signal(), Signalled::Yes);
        }
        // Drain it from "the frontend's" side, then read an empty pipe from ours.
        assert!(kick.drain());
        let mut left = Vec::new();
        set_nonblocking_and_drain(&r2, &mut left);
        assert!(kick.drain(), "empty, not end of file");
        drop(w2);
        drop(call);
        assert!(!kick.drain(), "the writer is gone: end of file");
    }

    fn set_nonblocking_and_drain(f: &File, _into: &mut Vec<u8>) {
        use std::io::Read;
        // SAFETY: fcntl on a descriptor the test owns.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        let mut buf = [0u8; 4096];
        let mut f = f;
        while matches!(f.read(&mut buf), Ok(n) if n > 0) {}
    }

    /// A saturated eventfd the frontend made blocking: the signal is interrupted and
    /// reported wedged.
    #[test]
    fn a_saturated_blocking_eventfd_is_reported_wedged() {
        let efd = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        let dup = efd.try_clone().unwrap();
        // SAFETY: the dup's fd is handed to the File, which owns it from here on.
        let f = unsafe { File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dup)) };
        let call = VringFd::new(f, "call").unwrap();
        assert_eq!(call.kind(), FdKind::Eventfd);
        assert_eq!(call.signal(), Signalled::Yes);
        // SAFETY: fcntl on the test's own eventfd.
        unsafe {
            let flags = libc::fcntl(efd.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(efd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
        efd.read().unwrap();
        efd.write(u64::MAX - 1).unwrap();
        assert_eq!(call.signal(), Signalled::Wedged);
    }

    #[test]
    fn regular_files_are_refused() {
        let f = tempfile::tempfile().unwrap();
        let e = VringFd::new(f, "kick").unwrap_err();
        assert!(e.contains("not an eventfd, a pipe or a socket"), "{e}");
    }
}
