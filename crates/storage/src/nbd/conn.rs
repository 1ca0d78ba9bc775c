//! One NBD connection in transmission, non-blocking.
//!
//! Sending: the send queue holds the slots that have pieces left to send and room in their
//! window ([`WINDOW`](super::slots::WINDOW) pieces awaiting replies), in order.
//! `flush` gathers as many requests as one `sendmsg` takes (headers built on the spot,
//! write payloads as iovecs pointing into the caller's buffers: nothing is copied), and
//! keeps the place of a partial send (slot, piece, bytes sent) for the next call; when
//! the socket is full, `EPOLLOUT` is watched until it drains.
//!
//! Receiving: a small buffer takes reply headers (many write replies arrive in one
//! `recv`). A read reply's payload goes into the caller's iovecs: the bytes that came in
//! the same `recv` as the header are copied from the buffer (at most [`RBUF`] bytes), the
//! rest is read by `readv` straight into the iovecs, with the buffer as the last iovec to
//! catch the next header in the same call.
//!
//! A reply header is taken only when its cookie names a piece awaiting a reply on this
//! connection ([`Slot::claim`]); anything else is a protocol violation that breaks the
//! connection before a byte of its payload is read, so it completes nothing and writes
//! into no buffer. Payloads land only in the buffers of the operation the header was
//! claimed for, on the socket it came from: once a connection is broken, its socket is
//! closed and its receive state dropped, so nothing sent on it can be read any more.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Instant;

use super::slots::{scatter, segments, uncookie, Slot, Stray};
use super::wire::{self, REPLY_LEN, REQUEST_LEN};

/// Receive buffer bytes: 64 reply headers.
pub(crate) const RBUF: usize = 1024;
/// Iovecs per `sendmsg` / `readv` (the kernel's `IOV_MAX`).
pub(crate) const IOV_MAX: usize = 1024;
/// Request headers per `sendmsg`.
pub(crate) const HDRS_MAX: usize = 256;

/// Where the receiver is in the byte stream.
#[derive(Clone, Copy, Debug)]
enum Rx {
    Header,
    Payload {
        slot: u32,
        gen: u16,
        piece: u32,
        got: u64,
        len: u64,
        /// When the piece was wholly sent: its deadline runs until the payload is in.
        sent: u32,
    },
}

/// Why a connection is given up (logged; its operations are replayed elsewhere).
#[derive(Debug)]
pub(crate) struct Broken {
    pub why: String,
    /// The server ended the connection (it closed or reset it): nothing sent on it is
    /// applied later. Otherwise vblk gives it up (a protocol
    /// violation, a local error) and the server may still be working on what it got.
    pub server_ended: bool,
}

impl From<String> for Broken {
    /// Given up by vblk.
    fn from(why: String) -> Broken {
        Broken {
            why,
            server_ended: false,
        }
    }
}

/// The server ended the connection: `why`.
fn ended(why: String) -> Broken {
    Broken {
        why,
        server_ended: true,
    }
}

/// Whether `errno` from a send or receive means the peer closed or reset the connection.
fn peer_gone(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)
    )
}

/// A connection's state.
pub(crate) struct Conn {
    pub fd: Option<OwnedFd>,
    /// Slots with pieces left to send, oldest first.
    pub sendq: std::collections::VecDeque<u32>,
    /// Pieces sent whose reply has not come.
    pub waiting: usize,
    /// When bytes last arrived (or the connection last went from idle to waiting).
    pub last_rx: Instant,
    /// Since when the piece at the head of the send queue has waited for the socket to
    /// take it (None: nothing is left unsent in the last `flush`).
    pub send_since: Option<Instant>,
    /// EPOLLOUT is being watched.
    pub want_out: bool,
    rx: Rx,
    rbuf: Box<[u8; RBUF]>,
    rhead: usize,
    rtail: usize,
}

impl Conn {
    pub(crate) fn new(depth: usize) -> Conn {
        Conn {
            fd: None,
            sendq: std::collections::VecDeque::with_capacity(depth),
            waiting: 0,
            last_rx: Instant::now(),
            send_since: None,
            want_out: false,
            rx: Rx::Header,
            rbuf: Box::new([0u8; RBUF]),
            rhead: 0,
            rtail: 0,
        }
    }

    /// A fresh socket: the byte stream starts over.
    pub(crate) fn attach(&mut self, fd: OwnedFd) {
        self.fd = Some(fd);
        self.waiting = 0;
        self.send_since = None;
        self.want_out = false;
        self.rx = Rx::Header;
        self.rhead = 0;
        self.rtail = 0;
        self.last_rx = Instant::now();
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    /// When the piece whose reply payload is being received was sent (its deadline runs
    /// until the payload is in).
    pub(crate) fn receiving(&self) -> Option<(u32, u32, u32)> {
        match self.rx {
            Rx::Header => None,
            Rx::Payload {
                slot, piece, sent, ..
            } => Some((slot, piece, sent)),
        }
    }

    /// Sends what the socket takes; a piece wholly sent is stamped `now_ms`. `Ok(true)`
    /// when the send queue is empty.
    pub(crate) fn flush(
        &mut self,
        slots: &mut [Slot],
        zero: &[u8],
        iovs: &mut Vec<libc::iovec>,
        hdrs: &mut Vec<[u8; REQUEST_LEN]>,
        now: Instant,
        now_ms: u32,
    ) -> Result<bool, Broken> {
        let empty = self.send(slots, zero, iovs, hdrs, now_ms)?;
        if empty {
            self.send_since = None;
        } else {
            self.send_since.get_or_insert(now);
        }
        Ok(empty)
    }

    /// `flush` without the clock of the head piece.
    fn send(
        &mut self,
        slots: &mut [Slot],
        zero: &[u8],
        iovs: &mut Vec<libc::iovec>,
        hdrs: &mut Vec<[u8; REQUEST_LEN]>,
        now_ms: u32,
    ) -> Result<bool, Broken> {
        let fd = self.raw_fd();
        while !self.sendq.is_empty() {
            iovs.clear();
            hdrs.clear();
            let total = self.gather(slots, zero, iovs, hdrs);
            // SAFETY: msghdr is plain data; all-zero is a valid empty message.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iovs.as_mut_ptr();
            msg.msg_iovlen = iovs.len();
            // SAFETY: the iovecs point into `hdrs` (not resized while they live: capacity
            // HDRS_MAX is reserved up front and never exceeded), into the zero buffer, or
            // into caller buffers lent under the push contract until completion.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => return Ok(false),
                    _ if peer_gone(&e) => return Err(ended(format!("send failed: {e}"))),
                    _ => return Err(format!("send failed: {e}").into()),
                }
            }
            let n = n as u64;
            self.advance(slots, n, now_ms);
            if n < total {
                return Ok(self.sendq.is_empty());
            }
        }
        Ok(true)
    }

    /// Builds the iovecs of the next requests to send; returns their bytes.
    fn gather(
        &self,
        slots: &[Slot],
        zero: &[u8],
        iovs: &mut Vec<libc::iovec>,
        hdrs: &mut Vec<[u8; REQUEST_LEN]>,
    ) -> u64 {
        let mut total = 0u64;
        for (qi, &si) in self.sendq.iter().enumerate() {
            let s = &slots[si as usize];
            for p in s.next..s.window_end() {
                if hdrs.len() >= HDRS_MAX || iovs.len() + 2 > IOV_MAX {
                    return total;
                }
                // Only the head piece can be partly sent.
                let skip = if qi == 0 && p == s.next {
                    u64::from(s.sent)
                } else {
                    0
                };
                hdrs.push(s.header(si, p));
                let h = hdrs.last().map_or(std::ptr::null(), |h| h.as_ptr());
                let hskip = skip.min(REQUEST_LEN as u64);
                iovs.push(libc::iovec {
                    // `hskip <= REQUEST_LEN`: inside (or one past) the header.
                    iov_base: h.wrapping_add(hskip as usize) as *mut libc::c_void,
                    iov_len: REQUEST_LEN - hskip as usize,
                });
                total += REQUEST_LEN as u64 - hskip;
                let plen = s.payload(p);
                if plen == 0 {
                    continue;
                }
                let (start, _) = s.piece(p);
                let pskip = skip.saturating_sub(REQUEST_LEN as u64);
                let room = IOV_MAX - iovs.len();
                let added = if s.iov.is_null() {
                    iovs.push(libc::iovec {
                        iov_base: zero.as_ptr() as *mut libc::c_void,
                        iov_len: (plen - pskip) as usize,
                    });
                    plen - pskip
                } else {
                    // SAFETY: the slot's iovecs are valid under the push contract.
                    unsafe { segments(s.iov, s.iovcnt, start + pskip, plen - pskip, iovs, room) }
                };
                total += added;
                if added < plen - pskip {
                    return total; // out of iovecs in the middle of this payload
                }
            }
        }
        total
    }

    /// Accounts `n` bytes sent at `now_ms`.
    fn advance(&mut self, slots: &mut [Slot], mut n: u64, now_ms: u32) {
        while let Some(&si) = self.sendq.front() {
            let s = &mut slots[si as usize];
            let size = REQUEST_LEN as u64 + s.payload(s.next);
            let left = size - u64::from(s.sent);
            if n < left {
                s.sent += n as u32;
                return;
            }
            n -= left;
            s.sent = 0;
            s.mark_sent(s.next, now_ms);
            s.next += 1;
            // The next piece's wait for the socket starts now.
            self.send_since = None;
            if self.waiting == 0 {
                self.last_rx = Instant::now();
            }
            self.waiting += 1;
            if s.next == s.window_end() {
                // All sent, or the window is full: a reply puts it back (`header`).
                self.sendq.pop_front();
            }
            if n == 0 {
                return;
            }
        }
    }

    /// Reads every reply available. Slots whose last piece was answered are appended to
    /// `finished`; `scratch` holds the `readv` iovecs.
    pub(crate) fn receive(
        &mut self,
        me: u16,
        slots: &mut [Slot],
        finished: &mut Vec<u32>,
        scratch: &mut Vec<libc::iovec>,
        now: Instant,
    ) -> Result<(), Broken> {
        let fd = self.raw_fd();
        loop {
            match self.rx {
                Rx::Header => {
                    if self.rtail - self.rhead >= REPLY_LEN {
                        let mut h = [0u8; REPLY_LEN];
                        h.copy_from_slice(&self.rbuf[self.rhead..self.rhead + REPLY_LEN]);
                        self.rhead += REPLY_LEN;
                        self.header(me, &h, slots, finished)?;
                        continue;
                    }
                    if self.rhead > 0 {
                        self.rbuf.copy_within(self.rhead..self.rtail, 0);
                        self.rtail -= self.rhead;
                        self.rhead = 0;
                    }
                    let free = &mut self.rbuf[self.rtail..];
                    // SAFETY: reads into the free tail of our own buffer.
                    let n = unsafe {
                        libc::recv(fd, free.as_mut_ptr().cast(), free.len(), libc::MSG_DONTWAIT)
                    };
                    match received(n)? {
                        None => return Ok(()),
                        Some(n) => {
                            self.rtail += n;
                            self.last_rx = now;
                        }
                    }
                }
                Rx::Payload {
                    slot,
                    gen,
                    piece,
                    mut got,
                    len,
                    sent,
                } => {
                    let s = &slots[slot as usize];
                    if !s.busy || s.gen != gen {
                        // Cannot happen: only this connection's replies change the slot.
                        return Err(format!(
                            "internal error: slot {slot} changed under a reply's payload"
                        )
                        .into());
                    }
                    let base = s.piece(piece).0;
                    let avail = self.rtail - self.rhead;
                    if avail > 0 {
                        let k = (avail as u64).min(len - got) as usize;
                        // SAFETY: a read's iovecs are writable caller buffers (push
                        // contract) covering the piece; `got + k <= len`.
                        unsafe {
                            scatter(
                                s.iov,
                                s.iovcnt,
                                base + got,
                                &self.rbuf[self.rhead..self.rhead + k],
                            )
                        };
                        self.rhead += k;
                        got += k as u64;
                    } else {
                        self.rhead = 0;
                        self.rtail = 0;
                        scratch.clear();
                        // SAFETY: as above.
                        unsafe {
                            segments(s.iov, s.iovcnt, base + got, len - got, scratch, IOV_MAX - 1)
                        };
                        let want: u64 = scratch.iter().map(|v| v.iov_len as u64).sum();
                        scratch.push(libc::iovec {
                            iov_base: self.rbuf.as_mut_ptr().cast(),
                            iov_len: RBUF,
                        });
                        // SAFETY: every iovec points into a writable caller buffer of the
                        // read (push contract) or into our own receive buffer.
                        let n = unsafe { libc::readv(fd, scratch.as_ptr(), scratch.len() as i32) };
                        let Some(n) = received(n)? else {
                            self.rx = Rx::Payload {
                                slot,
                                gen,
                                piece,
                                got,
                                len,
                                sent,
                            };
                            return Ok(());
                        };
                        self.last_rx = now;
                        let k = (n as u64).min(want);
                        got += k;
                        self.rtail = n - k as usize;
                    }
                    if got == len {
                        self.rx = Rx::Header;
                        answer(&slots[slot as usize], slot, finished);
                    } else {
                        self.rx = Rx::Payload {
                            slot,
                            gen,
                            piece,
                            got,
                            len,
                            sent,
                        };
                    }
                }
            }
        }
    }

    /// Handles one reply header.
    fn header(
        &mut self,
        me: u16,
        h: &[u8; REPLY_LEN],
        slots: &mut [Slot],
        finished: &mut Vec<u32>,
    ) -> Result<(), Broken> {
        let r = wire::reply(h).map_err(|magic| {
            if magic == wire::STRUCTURED_REPLY_MAGIC {
                "the server sent a structured reply, which was not negotiated".to_owned()
            } else {
                format!(
                    "reply magic {magic:#x}, expected {:#x}",
                    wire::SIMPLE_REPLY_MAGIC
                )
            }
        })?;
        let (si, gen, piece) = uncookie(r.cookie);
        let stray = |why: Stray| {
            format!(
                "reply with cookie {:#x} (slot {si}, use {gen}, piece {piece}) matches no request awaiting one: {why}",
                r.cookie
            )
        };
        let s = slots
            .get_mut(si as usize)
            .filter(|s| s.busy && s.conn == me)
            .ok_or(Stray::Idle)
            .map_err(stray)?;
        let reopened = s.claim(gen, piece).map_err(stray)?;
        // Kept for the payload: a piece sent after this reply may take its place.
        let sent = s.sent_time(piece);
        if reopened {
            self.sendq.push_back(si);
        }
        self.waiting = self.waiting.saturating_sub(1);
        if r.error == wire::NBD_ESHUTDOWN {
            // Not ended: the server may still finish what it has (the protocol lets it).
            return Err("the server is shutting down (ESHUTDOWN)".to_owned().into());
        }
        if r.error != 0 {
            if s.error == 0 {
                s.error = wire::errno_of(r.error);
            }
        } else {
            let len = s.reply_payload(piece);
            if len > 0 {
                self.rx = Rx::Payload {
                    slot: si,
                    gen,
                    piece,
                    got: 0,
                    len,
                    sent,
                };
                return Ok(());
            }
        }
        answer(s, si, finished);
        Ok(())
    }
}

/// A piece claimed by its reply is wholly received: the slot is finished when it was the
/// last. (Payloads arrive one after another, so every other piece claimed before it is
/// received by now.)
fn answer(s: &Slot, si: u32, finished: &mut Vec<u32>) {
    if s.done() {
        finished.push(si);
    }
}

/// A `recv`/`readv` result: `Ok(None)` when nothing is there yet.
fn received(n: isize) -> Result<Option<usize>, Broken> {
    if n > 0 {
        return Ok(Some(n as usize));
    }
    if n == 0 {
        return Err(ended("the server closed the connection".into()));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
        _ if peer_gone(&e) => Err(ended(format!("receive failed: {e}"))),
        _ => Err(format!("receive failed: {e}").into()),
    }
}

/// Sends `NBD_CMD_DISC` (best effort) on a connection in transmission.
pub(crate) fn disconnect(fd: &OwnedFd) {
    let h = wire::request(0, wire::CMD_DISC, 0, 0, 0);
    // SAFETY: sends from a live local buffer.
    unsafe {
        libc::send(
            fd.as_raw_fd(),
            h.as_ptr().cast(),
            h.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
}
