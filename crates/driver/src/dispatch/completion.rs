//! Telling the device and hearing back: publishing what the paths put on the ring, reaping
//! the used ring into the in-flight table, spinning and then sleeping on the call eventfd
//! for it, and noticing the device leave.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::error;
use proto::wire::status;

use super::Core;
use crate::error::{Error, ErrorKind};

/// Looks at the used ring between two reads of the clock while spinning.
const SPIN_CHECKS: u32 = 64;
/// Empty polls between two checks that the device is still connected.
const LIVENESS_EVERY: u32 = 4096;

impl Core {
    // ---- telling the device ----

    /// Publish once `n` requests wait unpublished (the batch path's rule).
    pub(crate) fn publish_batch(&mut self, n: u16) {
        if self.ring.unpublished() >= n {
            self.publish();
        }
    }

    /// Publish the requests added since the last publication and notify the device if it
    /// asked to be.
    pub(crate) fn publish(&mut self) {
        if self.ring.unpublished() == 0 {
            return;
        }
        self.ring.publish();
        if self.ring.needs_kick() {
            if let Err(e) = self.kick.write(1) {
                error!("queue {}: cannot notify the device: {e}", self.index);
            }
        }
    }

    // ---- completion ----

    /// Reap every used entry; returns how many requests finished.
    pub(crate) fn reap(&mut self) -> usize {
        let mut n = 0;
        self.ring.prefetch_used();
        while let Some(r) = self.ring.pop_used() {
            match r {
                Ok((head, _len)) => {
                    // SAFETY: status points to head's status byte in the ring's memory; the
                    // device has returned the head, so it no longer writes it.
                    let st = unsafe { self.ring.status(head).read_volatile() };
                    let result = match st {
                        status::OK => Ok(()),
                        status::IOERR => Err(ErrorKind::Io),
                        status::UNSUPP => Err(ErrorKind::Unsupported),
                        _ => Err(ErrorKind::Protocol),
                    };
                    self.requests -= 1;
                    self.table.finish_head(head, result);
                    n += 1;
                }
                Err(e) => {
                    error!("queue {}: device broke the ring: {e}", self.index);
                    self.fail_all(ErrorKind::Protocol);
                    return n;
                }
            }
        }
        n
    }

    /// Fail every outstanding request with `kind` and stop using the ring.
    pub(crate) fn fail_all(&mut self, kind: ErrorKind) {
        self.dead = true;
        self.shared.dead.store(true, Ordering::Relaxed);
        let heads: Vec<u16> = self.ring.outstanding_heads().collect();
        for h in heads {
            self.table.finish_head(h, Err(kind));
        }
        self.table.fail_parked(kind);
        self.ring.reset_outstanding();
        self.requests = 0;
    }

    /// Reap without blocking; every [`LIVENESS_EVERY`] empty polls with requests
    /// outstanding, check that the device is still there.
    pub(crate) fn poll_ring(&mut self) -> usize {
        let n = self.reap();
        if n == 0 && self.requests > 0 {
            self.idle_polls += 1;
            if self.idle_polls >= LIVENESS_EVERY {
                self.idle_polls = 0;
                if !self.dead && self.peer_gone() {
                    self.fail_all(ErrorKind::Disconnected);
                }
            }
        } else {
            self.idle_polls = 0;
        }
        n
    }

    /// Spin, then sleep until the used ring may have entries, the device leaves, or
    /// `timeout` passes (Ok either way; the caller re-checks).
    pub(crate) fn block(&mut self, timeout: Option<Duration>) -> Result<(), Error> {
        if self.dead {
            return Ok(());
        }
        let spin = self.spin.min(timeout.unwrap_or(self.spin));
        if !spin.is_zero() {
            // The clock is read once per SPIN_CHECKS looks at the ring: reading it costs
            // more than a look, and the spin bound need not be exact.
            let spin_until = Instant::now() + spin;
            loop {
                for _ in 0..SPIN_CHECKS {
                    if self.ring.has_used() {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
                if Instant::now() >= spin_until {
                    break;
                }
            }
        }
        self.sleep(timeout)
    }

    /// Arm the call eventfd and sleep on it (and on the socket hanging up).
    pub(crate) fn sleep(&mut self, timeout: Option<Duration>) -> Result<(), Error> {
        if self.ring.enable_interrupts() {
            self.ring.disable_interrupts();
            return Ok(());
        }
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
        let r = self.wait_wake_fds(ms);
        self.ring.disable_interrupts();
        r
    }

    /// `poll(2)` the call eventfd and the device socket for up to `ms` (-1: no limit);
    /// then clear the eventfd if it was signalled and fail everything if the socket hung
    /// up. An interrupted poll is Ok: the caller checks again.
    fn wait_wake_fds(&mut self, ms: i32) -> Result<(), Error> {
        let mut fds = [
            libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.sock_fd,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd structs for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Error::os(ErrorKind::Io, "poll", e));
        }
        if fds[0].revents & libc::POLLIN != 0 {
            // The count is of no interest; this only clears the eventfd.
            let _ = self.call.read();
        }
        if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            self.fail_all(ErrorKind::Disconnected);
        }
        Ok(())
    }

    /// For a sleep outside the queue: arm the call eventfd. False when the caller must
    /// not sleep on this queue (completions are already waiting, or the device is gone).
    pub(crate) fn arm(&mut self) -> bool {
        if self.dead {
            return false;
        }
        if self.ring.enable_interrupts() {
            self.ring.disable_interrupts();
            return false;
        }
        true
    }

    /// The call eventfd and the device socket, for [`Core::arm`]'s caller to sleep on.
    pub(crate) fn wake_fds(&self) -> [std::os::fd::RawFd; 2] {
        [self.call.as_raw_fd(), self.shared.sock_fd]
    }

    /// After a sleep outside the queue: back to polling, clear the call eventfd if it was
    /// signalled, and fail everything if the device hung up (a poll that does not wait;
    /// an error of it leaves the next poll of the ring and its liveness check to tell).
    pub(crate) fn disarm(&mut self) {
        self.ring.disable_interrupts();
        if !self.dead {
            let _ = self.wait_wake_fds(0);
        }
    }

    /// Whether the device's end of the socket is closed.
    pub(crate) fn peer_gone(&self) -> bool {
        if self.shared.dead.load(Ordering::Relaxed) {
            return true;
        }
        let mut fd = libc::pollfd {
            fd: self.shared.sock_fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: a valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut fd, 1, 0) };
        r > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

impl Drop for Core {
    /// Wait (up to 5 s) for the device to return every request, so no buffer lent to it is
    /// freed while it may write it; leak what is left. I/Os a path still held were never
    /// sent: their buffers are simply freed.
    fn drop(&mut self) {
        self.publish();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.ring.is_idle() && !self.dead && Instant::now() < deadline {
            if self.reap() == 0 {
                let _ = self.block(Some(Duration::from_millis(100)));
            }
        }
        if !self.ring.is_idle() && !self.dead {
            error!(
                "queue {}: dropped with requests outstanding; their buffers are leaked",
                self.index
            );
            self.table.leak_buffers();
        }
    }
}
