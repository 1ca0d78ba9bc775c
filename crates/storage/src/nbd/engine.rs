//! The NBD engine: one worker's connection (or several, with multi-conn) to the server.
//!
//! `push` turns an operation into a slot (its pieces become requests) on a connection's
//! send queue; `submit` sends what the sockets take; `reap` reads replies, matches their
//! cookies to slots (replies come in any order; each piece is taken once, see `slots`),
//! and hands out finished operations. Nothing is allocated per operation: slots, queues
//! and scratch vectors are sized at creation.
//!
//! The notify fd is an epoll set of the engine's own: the sockets (readable: replies;
//! writable, while a send is unfinished), a timerfd that ticks while anything waits for
//! the server, and an eventfd that a reconnection attempt's thread writes when it is done.
//! A worker sleeping on it wakes for replies, for a socket that drains, for a new
//! connection, and for the ticks that keep the deadlines (`deadline`) and pace
//! reconnection — it never spins, and never blocks on a server (see `reconnect` for breaks
//! and replays).
//!
//! Dropping the engine waits for the operations in flight (their buffers are lent to it)
//! for at most [`NbdOptions::timeout`](super::NbdOptions), then sends a FLUSH if anything
//! was written since the last one, within the same deadline. What is still in flight then
//! is abandoned and logged: the sockets are closed, and since only the engine reads them
//! (a reconnection thread never sees an operation), no reply can reach a caller buffer
//! after `drop` returns.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::error;

use super::conn::{disconnect, Conn, HDRS_MAX, IOV_MAX};
use super::deadline::{Clock, Oldest};
use super::dial;
use super::reconnect::{Life, State};
use super::slots::Slot;
use super::sys::{epoll_ctl, os_err};
use super::wire::*;
use super::Export;
use crate::engine::{
    check_range, errno, iov_slice, iov_total, Completion, CompletionRing, Engine, Full, Op,
};

/// Bytes per trim or write-zeroes request.
const BIG_CHUNK: u64 = 1 << 30;
/// The zero buffer for writing zeroes on servers without WRITE_ZEROES.
const ZERO_CHUNK: u32 = 1 << 20;
/// The token of the flush an engine sends when it is dropped.
const DROP_TOKEN: u64 = u64::MAX;
/// epoll data of the timer (sockets use their connection index).
const EV_TIMER: u64 = u64::MAX;
/// epoll data of the eventfd that reconnection attempts write.
const EV_DIAL: u64 = u64::MAX - 1;

/// The engine of an NBD disk.
pub(crate) struct NbdEngine {
    pub(super) ex: Arc<Export>,
    pub(super) slots: Box<[Slot]>,
    free: Vec<u32>,
    pub(super) conns: Vec<Conn>,
    pub(super) lives: Vec<Life>,
    /// Connections with an attempt under way.
    pub(super) dialing: usize,
    done: CompletionRing,
    finished: Vec<u32>,
    in_flight: usize,
    depth: usize,
    pub(super) epoll: OwnedFd,
    pub(super) timer: OwnedFd,
    /// Written by a reconnection attempt's thread when it has a result.
    pub(super) wake: Arc<OwnedFd>,
    /// When the timer fires next (None: disarmed).
    pub(super) tick_at: Option<Instant>,
    /// Send times of pieces, and the per-request deadline.
    pub(super) clock: Clock,
    /// No request awaiting a reply is past its deadline before this (None: none awaits).
    pub(super) due: Option<Instant>,
    /// Each connection's oldest request awaiting a reply (scratch of `deadline`).
    pub(super) oldest: Vec<Option<Oldest>>,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<[u8; REQUEST_LEN]>,
    rscratch: Vec<libc::iovec>,
    zero: Vec<u8>,
    rr: usize,
    /// Writes completed since the last flush was sent.
    dirty: bool,
}

// SAFETY: the raw pointers in slots and scratch vectors are caller buffers lent under the
// `Engine::push` contract (valid from any thread) or point into the engine's own heap
// buffers; the engine is used by one thread at a time (`&mut self`).
unsafe impl Send for NbdEngine {}

impl NbdEngine {
    pub(crate) fn new(ex: Arc<Export>, depth: usize) -> Result<NbdEngine, crate::Error> {
        let setup = |source| crate::Error::EngineSetup {
            engine: "nbd",
            depth: depth as u32,
            source,
        };
        // SAFETY: plain syscall; a fresh descriptor is returned or -1.
        let efd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if efd < 0 {
            return Err(setup(os_err()));
        }
        // SAFETY: epoll_create1 just returned this descriptor; nothing else owns it.
        let epoll = unsafe { OwnedFd::from_raw_fd(efd) };
        // SAFETY: plain syscall; flags are valid.
        let tfd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if tfd < 0 {
            return Err(setup(os_err()));
        }
        // SAFETY: timerfd_create just returned this descriptor; nothing else owns it.
        let timer = unsafe { OwnedFd::from_raw_fd(tfd) };
        epoll_ctl(
            &epoll,
            libc::EPOLL_CTL_ADD,
            timer.as_raw_fd(),
            libc::EPOLLIN as u32,
            EV_TIMER,
        )
        .map_err(setup)?;
        let wake = dial::eventfd().map_err(setup)?;
        epoll_ctl(
            &epoll,
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            libc::EPOLLIN as u32,
            EV_DIAL,
        )
        .map_err(setup)?;
        ex.add_engine()?;
        let n = ex.conns();
        let mut engine = NbdEngine {
            slots: vec![Slot::IDLE; depth].into_boxed_slice(),
            free: (0..depth as u32).rev().collect(),
            conns: (0..n).map(|_| Conn::new(depth)).collect(),
            lives: (0..n).map(|_| Life::new()).collect(),
            dialing: 0,
            done: CompletionRing::new(depth + 1),
            finished: Vec::with_capacity(depth),
            in_flight: 0,
            depth,
            epoll,
            timer,
            wake: Arc::new(wake),
            tick_at: None,
            clock: Clock::new(ex.opts.timeout),
            due: None,
            oldest: Vec::with_capacity(n),
            iovs: Vec::with_capacity(IOV_MAX),
            hdrs: Vec::with_capacity(HDRS_MAX),
            rscratch: Vec::with_capacity(IOV_MAX),
            zero: Vec::new(),
            rr: 0,
            dirty: false,
            ex,
        };
        for c in 0..n {
            // A worker's engine starts connected (on the thread that creates it, within
            // the timeout); a server that is down now is an error here, not a stall.
            if let Err(e) = engine.ex.connect().and_then(|fd| engine.attach(c, fd)) {
                engine.ex.remove_engine();
                return Err(crate::Error::Nbd {
                    uri: engine.ex.spec.to_string(),
                    source: e,
                });
            }
        }
        Ok(engine)
    }

    /// Makes `fd` (connected and negotiated) connection `c`, watched and up.
    pub(super) fn attach(&mut self, c: usize, fd: OwnedFd) -> Result<(), super::NbdError> {
        epoll_ctl(
            &self.epoll,
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            libc::EPOLLIN as u32,
            c as u64,
        )
        .map_err(|source| super::NbdError::Io {
            during: "setting up the connection",
            source,
        })?;
        self.conns[c].attach(fd);
        self.lives[c].state = State::Up;
        Ok(())
    }

    /// Fills and queues a slot, or answers at once.
    fn start(&mut self, token: u64, op: Op) -> Option<io::Result<u64>> {
        let ex = Arc::clone(&self.ex);
        let size = ex.info.size;
        let block = u64::from(ex.block);
        let aligned = |off: u64, len: u64| off.is_multiple_of(block) && len.is_multiple_of(block);
        let mut s = Slot::IDLE;
        s.token = token;
        s.busy = true;
        match op {
            Op::Read {
                offset,
                iov,
                iovcnt,
            }
            | Op::Write {
                offset,
                iov,
                iovcnt,
                ..
            } => {
                let write = matches!(op, Op::Write { .. });
                if write && ex.read_only {
                    return Some(Err(errno(libc::EROFS)));
                }
                if write && ex.writes_fenced.load(Ordering::Relaxed) {
                    return Some(Err(errno(libc::EIO)));
                }
                // SAFETY: the push contract keeps the iovec array valid.
                let total = match unsafe { iov_slice(iov, iovcnt) }.and_then(iov_total) {
                    Ok(t) => t,
                    Err(e) => return Some(Err(e)),
                };
                if let Err(e) = check_range(offset, total, size) {
                    return Some(Err(e));
                }
                if !aligned(offset, total) {
                    return Some(Err(errno(libc::EINVAL)));
                }
                if total == 0 {
                    return Some(Ok(0));
                }
                s.cmd = if write { CMD_WRITE } else { CMD_READ };
                if let Op::Write { durable: true, .. } = op {
                    if ex.has(FLAG_SEND_FUA) {
                        s.flags = CMD_FLAG_FUA;
                    } else {
                        s.then_flush = ex.has(FLAG_SEND_FLUSH);
                    }
                }
                s.offset = offset;
                s.iov = iov;
                s.iovcnt = iovcnt;
                s.result = total;
                if !s.cut(total, u64::from(ex.max_payload)) {
                    return Some(Err(errno(libc::EINVAL)));
                }
            }
            Op::Flush => {
                if ex.read_only || !ex.has(FLAG_SEND_FLUSH) {
                    return Some(Ok(0));
                }
                // Nothing written since the fence can be made durable, and what was
                // written before it may yet be overwritten by the server.
                if ex.writes_fenced.load(Ordering::Relaxed) {
                    return Some(Err(errno(libc::EIO)));
                }
                s.cmd = CMD_FLUSH;
                s.single();
                self.dirty = false;
            }
            Op::Discard { offset, len, .. } | Op::WriteZeroes { offset, len, .. } => {
                if ex.read_only {
                    return Some(Err(errno(libc::EROFS)));
                }
                if ex.writes_fenced.load(Ordering::Relaxed) {
                    return Some(Err(errno(libc::EIO)));
                }
                if let Err(e) = check_range(offset, len, size) {
                    return Some(Err(e));
                }
                if !aligned(offset, len) {
                    return Some(Err(errno(libc::EINVAL)));
                }
                s.offset = offset;
                let durable = matches!(
                    op,
                    Op::Discard { durable: true, .. } | Op::WriteZeroes { durable: true, .. }
                );
                let cut = match op {
                    _ if len == 0 => return Some(Ok(0)),
                    Op::Discard { .. } if !ex.has(FLAG_SEND_TRIM) => return Some(Ok(0)),
                    Op::Discard { .. } => {
                        s.cmd = CMD_TRIM;
                        s.cut(len, BIG_CHUNK)
                    }
                    Op::WriteZeroes { unmap, .. } if ex.has(FLAG_SEND_WRITE_ZEROES) => {
                        s.cmd = CMD_WRITE_ZEROES;
                        s.flags = if unmap { 0 } else { CMD_FLAG_NO_HOLE };
                        s.cut(len, BIG_CHUNK)
                    }
                    _ => {
                        // Write zeroes from a shared buffer (iov null).
                        let chunk = ZERO_CHUNK.min(ex.max_payload);
                        if self.zero.len() < chunk as usize {
                            self.zero = vec![0u8; chunk as usize];
                        }
                        s.cmd = CMD_WRITE;
                        s.cut(len, u64::from(chunk))
                    }
                };
                if !cut {
                    // Over 2^32 requests (2 TiB of zeroes in 512-byte writes): refused.
                    return Some(Err(errno(libc::EINVAL)));
                }
                // Write-through: the server makes the change durable before it answers
                // (FUA applies to TRIM and WRITE_ZEROES as to WRITE), or a FLUSH follows.
                if durable {
                    if ex.has(FLAG_SEND_FUA) {
                        s.flags |= CMD_FLAG_FUA;
                    } else {
                        s.then_flush = ex.has(FLAG_SEND_FLUSH);
                    }
                }
            }
        }
        let Some(idx) = self.free.pop() else {
            // Cannot happen: a free slot exists while fewer than `depth` are in flight.
            return Some(Err(errno(libc::EBUSY)));
        };
        let c = self.rr % self.conns.len();
        self.rr = self.rr.wrapping_add(1);
        s.conn = c as u16;
        // A new use of the slot: no cookie of an earlier one matches it.
        s.gen = self.slots[idx as usize].gen.wrapping_add(1);
        self.slots[idx as usize] = s;
        self.conns[c].sendq.push_back(idx);
        None
    }

    /// The disk's writes are fenced (reconnect.rs, `fence_writes`): fail with EIO every
    /// write, trim, write-zeroes and flush waiting on connection `c` of which nothing is
    /// sent yet (queued before the fence, here or on another engine, or restarted for a
    /// replay). What is partly sent goes on: the server has none of it whole.
    fn drop_fenced(&mut self, c: usize) {
        for _ in 0..self.conns[c].sendq.len() {
            let Some(si) = self.conns[c].sendq.pop_front() else {
                break;
            };
            let s = &self.slots[si as usize];
            let untouched = s.next == 0 && s.sent == 0 && s.base == 0;
            if untouched && matches!(s.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES | CMD_FLUSH) {
                self.complete(si, Err(errno(libc::EIO)));
            } else {
                self.conns[c].sendq.push_back(si);
            }
        }
    }

    /// Finishes slot `si` with `result`.
    pub(super) fn complete(&mut self, si: u32, result: io::Result<u64>) {
        let s = &mut self.slots[si as usize];
        s.busy = false;
        if s.token == DROP_TOKEN && result.is_err() {
            self.dirty = true;
        }
        self.done.push(s.token, result);
        self.free.push(si);
    }

    /// Every piece of slot `si` is answered: the server is making progress.
    fn finish(&mut self, si: u32) {
        let s = &mut self.slots[si as usize];
        self.lives[usize::from(s.conn)].progress();
        if s.error != 0 {
            let (e, cmd) = (s.error, s.cmd);
            if cmd == CMD_FLUSH {
                self.dirty = true;
            }
            self.complete(si, Err(errno(e)));
            return;
        }
        if s.then_flush {
            s.then_flush = false;
            s.cmd = CMD_FLUSH;
            s.flags = 0;
            // A FLUSH carries offset 0 and length 0 (strict servers refuse anything else).
            s.offset = 0;
            s.iov = std::ptr::null();
            s.single();
            let c = usize::from(s.conn);
            self.conns[c].sendq.push_back(si);
            return;
        }
        let (cmd, r) = (s.cmd, s.result);
        if matches!(cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
            self.dirty = true;
        }
        self.complete(si, Ok(r));
    }

    /// Sends what connection `c` can take.
    pub(super) fn flush_conn(&mut self, c: usize, now: Instant) {
        if !matches!(self.lives[c].state, State::Up) {
            return;
        }
        if self.ex.writes_fenced.load(Ordering::Relaxed) {
            self.drop_fenced(c);
        }
        let conn = &mut self.conns[c];
        let now_ms = self.clock.ms(now);
        match conn.flush(
            &mut self.slots,
            &self.zero,
            &mut self.iovs,
            &mut self.hdrs,
            now,
            now_ms,
        ) {
            Ok(empty) => {
                if empty == conn.want_out {
                    let events =
                        libc::EPOLLIN as u32 | if empty { 0 } else { libc::EPOLLOUT as u32 };
                    let fd = conn.raw_fd();
                    conn.want_out = !empty;
                    if let Err(e) =
                        epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, fd, events, c as u64)
                    {
                        self.broke(c, format!("epoll_ctl: {e}").into(), now);
                        return;
                    }
                }
                if self.conns[c].waiting > 0 {
                    self.sent_now(now);
                }
                if self.conns[c].waiting > 0 || !empty {
                    self.ensure_ticking(now);
                }
            }
            Err(why) => self.broke(c, why, now),
        }
    }

    /// Sends, receives and keeps time: everything but handing out completions. Replies
    /// already in a socket are taken before the deadlines are looked at, so a worker late
    /// to reap does not hold a prompt server to be late.
    fn progress(&mut self) {
        let now = Instant::now();
        if self.dialing > 0 {
            self.dialed_any(now);
        }
        for c in 0..self.conns.len() {
            if !matches!(self.lives[c].state, State::Up) {
                continue;
            }
            if self.conns[c].want_out {
                self.flush_conn(c, now);
                if !matches!(self.lives[c].state, State::Up) {
                    continue;
                }
            }
            self.finished.clear();
            let r = self.conns[c].receive(
                c as u16,
                &mut self.slots,
                &mut self.finished,
                &mut self.rscratch,
                now,
            );
            for i in 0..self.finished.len() {
                let si = self.finished[i];
                self.finish(si);
            }
            if let Err(why) = r {
                self.broke(c, why, now);
                continue;
            }
            if !self.conns[c].sendq.is_empty() && !self.conns[c].want_out {
                self.flush_conn(c, now);
            }
        }
        if self.tick_at.is_some_and(|t| now >= t) {
            self.tick(now);
        }
    }
}

impl Engine for NbdEngine {
    fn name(&self) -> &'static str {
        "nbd"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.depth {
            return Err(Full);
        }
        if let Some(r) = self.start(token, op) {
            self.done.push(token, r);
        }
        self.in_flight += 1;
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        let now = Instant::now();
        for c in 0..self.conns.len() {
            if self.conns[c].sendq.is_empty() {
                continue;
            }
            match self.lives[c].state {
                State::Up if !self.conns[c].want_out => self.flush_conn(c, now),
                State::Failed { .. } => self.retry_failed(c, now),
                _ => {}
            }
        }
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        self.progress();
        let n = self.done.drain(f);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        self.wait_until(None)
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl NbdEngine {
    /// `wait`, giving up at `deadline` (None: never).
    fn wait_until(&mut self, deadline: Option<Instant>) -> io::Result<()> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        loop {
            self.submit()?;
            self.progress();
            if !self.done.is_empty() || self.in_flight == 0 {
                return Ok(());
            }
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(());
                    }
                    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
                }
            };
            // SAFETY: `events` is a live array of 8 entries.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 8, ms) };
            if n < 0 {
                let e = os_err();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }

    /// Reaps (and drops) completions until nothing is in flight or `deadline` passes;
    /// returns how many failed.
    fn drain_until(&mut self, deadline: Instant) -> usize {
        let mut failed = 0;
        loop {
            let n = self
                .done
                .drain(&mut |c| failed += usize::from(c.result.is_err()));
            self.in_flight -= n;
            if self.in_flight == 0
                || Instant::now() >= deadline
                || self.wait_until(Some(deadline)).is_err()
            {
                return failed;
            }
        }
    }

    /// Gives up on every operation still in flight: closes the sockets, so that no reply
    /// can reach their buffers any more, and says what was lost.
    fn abandon(&mut self, waited: Duration) {
        let (mut reads, mut writes, mut flushes, mut others) = (0, 0, 0, 0);
        for s in self.slots.iter_mut().filter(|s| s.busy) {
            match s.cmd {
                CMD_READ => reads += 1,
                CMD_WRITE => writes += 1,
                CMD_FLUSH => flushes += 1,
                _ => others += 1,
            }
            s.busy = false;
        }
        for conn in &mut self.conns {
            conn.fd = None;
            conn.sendq.clear();
        }
        error!(
            "{}: closing with {} operations unanswered after waiting {:.1} s ({reads} reads, \
             {writes} writes, {flushes} flushes, {others} trims or write-zeroes): abandoned \
             (a write may or may not have reached the disk); no byte of theirs is read or \
             written any more",
            self.ex.spec,
            reads + writes + flushes + others,
            waited.as_secs_f64()
        );
    }
}

impl Drop for NbdEngine {
    fn drop(&mut self) {
        let start = Instant::now();
        let deadline = start + self.ex.opts.timeout;
        // Everything in flight ends first (the push contract lends buffers until then),
        // but not past the deadline.
        self.drain_until(deadline);
        // Writes completed since the last flush are made durable before hanging up.
        if self.in_flight == 0 && self.dirty && !self.ex.read_only && self.ex.has(FLAG_SEND_FLUSH) {
            // SAFETY: a flush lends no buffer.
            if unsafe { self.push(DROP_TOKEN, Op::Flush) }.is_ok() {
                let _ = self.submit();
                if self.drain_until(deadline) > 0 {
                    error!("{}: the flush at close failed", self.ex.spec);
                }
            }
        }
        if self.in_flight > 0 {
            self.abandon(start.elapsed());
        }
        for c in &self.conns {
            if let Some(fd) = &c.fd {
                disconnect(fd);
            }
        }
        self.ex.remove_engine();
    }
}
