//! Passthru: raw virtio-blk commands through a submission/completion ring pair, with
//! completions found by polling the used ring — the 2024 io_uring passthrough RFC
//! (`/dev/vdXc0`, `IORING_OP_URING_CMD`) done where it belongs, in a userspace driver.
//!
//! The caller registers buffers once ([`Passthru::register`]), then pushes [`Cmd`]s — any
//! request type, header fields as sent, data as a slice of a registered buffer in either
//! direction — and submits them in a batch ([`Passthru::submit`]: one publication, at most
//! one notification). [`Passthru::reap`] takes finished commands off the used ring: the
//! raw status byte and the used length the device reported, nothing interpreted. With
//! `polled` (the default) the ring never asks the device for an interrupt: no eventfd
//! write on the device's side, no wake-up on ours; the caller polls.
//!
//! The kernel RFC's reviewers raised three objections; here is how they are answered:
//! - **No FLUSH.** Every type goes through, FLUSH included, and GET_ID, DISCARD,
//!   WRITE_ZEROES, GET_LIFETIME, SECURE_ERASE, or a type the device does not know (its
//!   answer, UNSUPP, comes back as it is).
//! - **Layering.** There is no block layer underneath to bypass: a passthru queue owns its
//!   virtqueue outright (it is made from an idle [`Queue`], which it consumes), so no
//!   request path state can disagree with what the caller sent; other queues of the disk
//!   keep their own paths.
//! - **Unprivileged use.** The driver can only send what the vhost-user socket's owner lets
//!   it reach; the device checks every request (bounds, read-only, segment limits) whoever
//!   sends it. A raw command is no more powerful than the same bytes written by a guest.

use std::time::{Duration, Instant};

use crate::dispatch::Core;
use crate::error::{Error, ErrorKind};
use crate::mem::Buffer;
use crate::queue::Queue;

/// A slice of a registered buffer carried by a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Data {
    /// Index of the registered buffer.
    pub buf: u16,
    /// Offset into it.
    pub offset: u32,
    /// Bytes.
    pub len: u32,
    /// The device writes it (IN, GET_ID, GET_LIFETIME); otherwise it reads it (OUT, the
    /// ranges of DISCARD, WRITE_ZEROES, SECURE_ERASE).
    pub from_device: bool,
}

/// One raw command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cmd {
    /// The request type (`proto::wire::req_type`, or any other value).
    pub type_: u32,
    /// The header's ioprio field.
    pub ioprio: u32,
    /// The header's sector field.
    pub sector: u64,
    /// The payload, if any.
    pub data: Option<Data>,
    /// Returned with the completion.
    pub user_data: u64,
}

/// One finished command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cqe {
    /// The command's `user_data`.
    pub user_data: u64,
    /// The status byte the device wrote (0 OK, 1 IOERR, 2 UNSUPP, or whatever it wrote), or
    /// `Disconnected` when the device went away with the command outstanding.
    pub status: Result<u8, ErrorKind>,
    /// The used length the device reported (bytes it wrote, status byte included).
    pub used_len: u32,
}

/// Tuning of a passthru queue.
#[derive(Clone, Copy, Debug)]
pub struct PassthruOptions {
    /// Completions are found by polling only: the device is never asked to interrupt.
    pub polled: bool,
}

impl Default for PassthruOptions {
    fn default() -> Self {
        PassthruOptions { polled: true }
    }
}

/// A queue that could not become a passthru queue (it had I/O in flight), given back.
#[derive(Debug)]
pub struct NotIdle {
    /// The queue, untouched.
    pub queue: Queue,
    /// Why, with the numbers.
    pub error: Error,
}

/// Empty looks at the used ring between checks that the device is still there.
const LIVENESS_EVERY: u32 = 1 << 16;

/// A virtqueue driven by raw commands.
pub struct Passthru {
    core: Core,
    bufs: Vec<Buffer>,
    /// Per ring head: the user_data of the command on it.
    user: Vec<u64>,
    sq: Vec<Cmd>,
    sq_size: usize,
    polled: bool,
    in_flight: usize,
    idle_polls: u32,
    /// Completions of commands lost with the device, not yet reported.
    failed: Vec<Cqe>,
}

impl std::fmt::Debug for Passthru {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Passthru")
            .field("index", &self.core.index)
            .field("registered", &self.bufs.len())
            .field("queued", &self.sq.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl Passthru {
    /// Turn an idle queue into a passthru queue.
    pub fn new(queue: Queue, opts: PassthruOptions) -> Result<Passthru, Box<NotIdle>> {
        let core = queue.into_core()?;
        let n = usize::from(core.ring.size());
        Ok(Passthru {
            core,
            bufs: Vec::new(),
            user: vec![0; n],
            sq: Vec::with_capacity(n),
            sq_size: n,
            polled: opts.polled,
            in_flight: 0,
            idle_polls: 0,
            failed: Vec::new(),
        })
    }

    /// Register buffers; returns the index of the first (the others follow in order).
    pub fn register(&mut self, bufs: Vec<Buffer>) -> Result<u16, Error> {
        let first = self.bufs.len();
        if first + bufs.len() > usize::from(u16::MAX) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} buffers registered and {} more asked for: at most 65535",
                    first,
                    bufs.len()
                ),
            ));
        }
        self.bufs.extend(bufs);
        Ok(first as u16)
    }

    /// Registered buffer `i` (to fill before a write, or to read after a read).
    pub fn buffer(&self, i: u16) -> Option<&Buffer> {
        self.bufs.get(usize::from(i))
    }

    /// Registered buffer `i`, writable. Do not touch a buffer a command in flight uses.
    pub fn buffer_mut(&mut self, i: u16) -> Option<&mut Buffer> {
        self.bufs.get_mut(usize::from(i))
    }

    /// Allocate a buffer in memory shared with the device (to register).
    pub fn alloc(&self, len: usize) -> Result<Buffer, Error> {
        self.core.shared.pool.alloc(len)
    }

    /// Commands submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Commands pushed and not yet submitted.
    pub fn queued(&self) -> usize {
        self.sq.len()
    }

    /// Room left in the submission queue (as many entries as the ring).
    pub fn sq_space(&self) -> usize {
        self.sq_size - self.sq.len()
    }

    /// Queue `cmd` for the next [`Passthru::submit`]. Refused (with the numbers) when its
    /// buffer slice is not registered or out of bounds, or the queue is full.
    pub fn push(&mut self, cmd: Cmd) -> Result<(), Error> {
        if self.sq.len() >= self.sq_size {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "the submission queue is full ({} entries): submit and reap first",
                    self.sq_size
                ),
            ));
        }
        if let Some(d) = cmd.data {
            let Some(b) = self.bufs.get(usize::from(d.buf)) else {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "buffer {} is not registered ({} are)",
                        d.buf,
                        self.bufs.len()
                    ),
                ));
            };
            let end = u64::from(d.offset) + u64::from(d.len);
            if d.len == 0 || end > b.len() as u64 {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "bytes {}..{end} of buffer {} ({} bytes long): empty or out of bounds",
                        d.offset,
                        d.buf,
                        b.len()
                    ),
                ));
            }
        }
        self.sq.push(cmd);
        Ok(())
    }

    /// Put queued commands on the ring, in order, as many as fit; publish once and notify
    /// the device if it asked to be. Returns how many went.
    pub fn submit(&mut self) -> Result<usize, Error> {
        let mut sent = 0;
        let mut result = Ok(());
        for i in 0..self.sq.len() {
            let c = self.sq[i];
            let data = c.data.map(|d| {
                let b = &self.bufs[usize::from(d.buf)];
                (
                    b.gpa() + u64::from(d.offset),
                    u64::from(d.len),
                    d.from_device,
                )
            });
            match self.core.put_raw(c.type_, c.ioprio, c.sector, data) {
                Ok(Some(head)) => {
                    self.user[usize::from(head)] = c.user_data;
                    sent += 1;
                }
                Ok(None) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.sq.drain(..sent);
        self.in_flight += sent;
        if sent > 0 {
            self.core.publish();
        }
        result.map(|()| sent)
    }

    /// Take finished commands off the used ring into `out`; returns how many.
    pub fn reap(&mut self, out: &mut [Cqe]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(c) = self.failed.pop() else { break };
            out[n] = c;
            self.in_flight -= 1;
            n += 1;
        }
        if self.core.dead {
            return n;
        }
        // As the block paths' reap: the returned heads' lines, asked for owned and at once.
        self.core.ring.prefetch_used();
        while n < out.len() {
            let Some(r) = self.core.ring.pop_used() else {
                break;
            };
            match r {
                Ok((head, used_len)) => {
                    // SAFETY: head's status byte lies in the ring's memory; the device has
                    // returned the head, so it no longer writes it.
                    let st = unsafe { self.core.ring.status(head).read_volatile() };
                    out[n] = Cqe {
                        user_data: self.user[usize::from(head)],
                        status: Ok(st),
                        used_len,
                    };
                    self.core.requests -= 1;
                    self.in_flight -= 1;
                    n += 1;
                }
                Err(e) => {
                    log::error!("queue {}: device broke the ring: {e}", self.core.index);
                    self.fail_outstanding(ErrorKind::Protocol);
                    return n + self.reap(&mut out[n..]);
                }
            }
        }
        if n == 0 && self.in_flight > 0 {
            self.idle_polls += 1;
            if self.idle_polls >= LIVENESS_EVERY {
                self.idle_polls = 0;
                if self.core.peer_gone() {
                    self.fail_outstanding(ErrorKind::Disconnected);
                    return self.reap(out);
                }
            }
        } else {
            self.idle_polls = 0;
        }
        n
    }

    /// The device is gone: every outstanding command completes with `kind`, reported by
    /// the next reaps.
    fn fail_outstanding(&mut self, kind: ErrorKind) {
        self.core.dead = true;
        self.core
            .shared
            .dead
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let heads: Vec<u16> = self.core.ring.outstanding_heads().collect();
        self.failed.extend(heads.iter().map(|&h| Cqe {
            user_data: self.user[usize::from(h)],
            status: Err(kind),
            used_len: 0,
        }));
        self.core.ring.reset_outstanding();
        self.core.requests = 0;
    }

    /// Reap at least `min` completions into `out` (at most `out.len()`), polling (or, when
    /// not polled, sleeping on the device's interrupt after a short spin). With a
    /// `timeout`, return what was reaped when it passes, or a [`ErrorKind::Timeout`]
    /// error if that is nothing (a device that holds its requests); `None` waits without
    /// limit.
    pub fn wait(
        &mut self,
        min: usize,
        out: &mut [Cqe],
        timeout: Option<Duration>,
    ) -> Result<usize, Error> {
        let min = min.min(out.len()).min(self.in_flight);
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut n = 0;
        let mut spins = 0u32;
        loop {
            n += self.reap(&mut out[n..]);
            if n >= min {
                return Ok(n);
            }
            // A clock read every 1024 empty polls: the deadline is seconds, a poll 0.1 µs.
            spins = spins.wrapping_add(1);
            if let Some(d) = deadline.filter(|_| !self.polled || spins.is_multiple_of(1024)) {
                if Instant::now() >= d {
                    if n > 0 {
                        return Ok(n);
                    }
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "no completion within {timeout:?} with {} command(s) in flight",
                            self.in_flight
                        ),
                    ));
                }
            }
            if self.core.dead && self.failed.is_empty() {
                if n > 0 {
                    return Ok(n);
                }
                return Err(ErrorKind::Disconnected.into());
            }
            if self.polled {
                std::hint::spin_loop();
            } else {
                let left = deadline.map_or(Duration::from_millis(100), |d| {
                    d.saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(100))
                });
                self.core.block(Some(left))?;
            }
        }
    }
}

impl Drop for Passthru {
    fn drop(&mut self) {
        // Registered buffers the device may still write must not go back to the pool.
        let mut scratch = [Cqe {
            user_data: 0,
            status: Ok(0),
            used_len: 0,
        }; 64];
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.in_flight > 0 && !self.core.dead && std::time::Instant::now() < deadline {
            if self.reap(&mut scratch) == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if self.in_flight > 0 && !self.core.dead {
            log::error!(
                "queue {}: passthru dropped with {} commands outstanding; its buffers are leaked",
                self.core.index,
                self.in_flight
            );
            for b in self.bufs.drain(..) {
                std::mem::forget(b);
            }
        }
    }
}
