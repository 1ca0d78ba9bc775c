//! The NBD engine: one worker's connection (or several, with multi-conn) to the server.
//!
//! `push` turns an operation into a slot (its pieces become requests) on a connection's
//! send queue; `submit` sends what the sockets take; `reap` reads replies, matches their
//! cookies to slots (replies come in any order; each piece is taken once, see `slots`),
//! and hands out finished operations. Nothing is allocated per operation: slots, queues
//! and scratch vectors are sized at creation.
//!
//! The notify fd is an epoll set of the engine's own: the sockets (readable: replies;
//! writable, while a send is unfinished), and a timerfd that ticks while anything waits
//! for the server. A worker sleeping on it wakes for replies, for a socket that drains,
//! and for the ticks that detect a silent server and drive reconnection — it never spins.
//!
//! When a connection breaks (the server hung up, a send or receive failed, a reply broke
//! the protocol, or no byte came for [`NbdOptions::timeout`](super::NbdOptions) while
//! replies were awaited) its operations are held, the engine reconnects with backoff (10
//! ms doubling to 1 s) and replays every operation not yet answered — reads and writes
//! are idempotent, and a write is only completed by its reply, so nothing acknowledged is
//! lost. After [`NbdOptions::reconnect`](super::NbdOptions) without success they fail with
//! `EIO`; later operations try one connection a second and fail at once when it does not
//! come up.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{error, info, warn};

use super::conn::{disconnect, Conn, HDRS_MAX, IOV_MAX};
use super::slots::Slot;
use super::sys::{epoll_ctl, os_err, settime};
use super::wire::*;
use super::Export;
use crate::engine::{
    check_range, errno, iov_slice, iov_total, Completion, CompletionRing, Engine, Full, Op,
};

/// Timer period while anything waits for the server.
const TICK: Duration = Duration::from_millis(100);
/// First reconnection delay; it doubles up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often an engine whose server is gone tries again when new work comes.
const FAILED_RETRY: Duration = Duration::from_secs(1);
/// Bytes per trim or write-zeroes request.
const BIG_CHUNK: u64 = 1 << 30;
/// The zero buffer for writing zeroes on servers without WRITE_ZEROES.
const ZERO_CHUNK: u32 = 1 << 20;
/// The token of the flush an engine sends when it is dropped.
const DROP_TOKEN: u64 = u64::MAX;
/// epoll data of the timer (sockets use their connection index).
const EV_TIMER: u64 = u64::MAX;

/// A connection's life.
#[derive(Clone, Copy, Debug)]
enum State {
    Up,
    Down {
        since: Instant,
        next_try: Instant,
        backoff: Duration,
    },
    Failed {
        last_try: Instant,
    },
}

/// The engine of an NBD disk.
pub(crate) struct NbdEngine {
    ex: Arc<Export>,
    slots: Box<[Slot]>,
    free: Vec<u32>,
    conns: Vec<Conn>,
    states: Vec<State>,
    done: CompletionRing,
    finished: Vec<u32>,
    in_flight: usize,
    depth: usize,
    epoll: OwnedFd,
    timer: OwnedFd,
    /// When the timer fires next (None: disarmed).
    tick_at: Option<Instant>,
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
        ex.add_engine()?;
        let n = ex.conns();
        let mut engine = NbdEngine {
            slots: vec![Slot::IDLE; depth].into_boxed_slice(),
            free: (0..depth as u32).rev().collect(),
            conns: (0..n).map(|_| Conn::new(depth)).collect(),
            states: vec![State::Up; n],
            done: CompletionRing::new(depth + 1),
            finished: Vec::with_capacity(depth),
            in_flight: 0,
            depth,
            epoll,
            timer,
            tick_at: None,
            iovs: Vec::with_capacity(IOV_MAX),
            hdrs: Vec::with_capacity(HDRS_MAX),
            rscratch: Vec::with_capacity(IOV_MAX),
            zero: Vec::new(),
            rr: 0,
            dirty: false,
            ex,
        };
        for c in 0..n {
            // A worker's engine starts connected; a server that is down now is an error
            // here, not a stall.
            if let Err(e) = engine.connect(c) {
                engine.ex.remove_engine();
                return Err(crate::Error::Nbd {
                    uri: engine.ex.spec.to_string(),
                    source: e,
                });
            }
        }
        Ok(engine)
    }

    /// Opens connection `c` (within the timeout) and watches it.
    fn connect(&mut self, c: usize) -> Result<(), super::NbdError> {
        let fd = self.ex.connect()?;
        let io = |source| super::NbdError::Io {
            during: "setting up the connection",
            source,
        };
        epoll_ctl(
            &self.epoll,
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            libc::EPOLLIN as u32,
            c as u64,
        )
        .map_err(io)?;
        self.conns[c].attach(fd);
        self.states[c] = State::Up;
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
                s.cmd = CMD_FLUSH;
                s.single();
                self.dirty = false;
            }
            Op::Discard { offset, len, .. } | Op::WriteZeroes { offset, len, .. } => {
                if ex.read_only {
                    return Some(Err(errno(libc::EROFS)));
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

    /// Finishes slot `si` with `result`.
    fn complete(&mut self, si: u32, result: io::Result<u64>) {
        let s = &mut self.slots[si as usize];
        s.busy = false;
        if s.token == DROP_TOKEN && result.is_err() {
            self.dirty = true;
        }
        self.done.push(s.token, result);
        self.free.push(si);
    }

    /// Every piece of slot `si` is answered.
    fn finish(&mut self, si: u32) {
        let s = &mut self.slots[si as usize];
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
    fn flush_conn(&mut self, c: usize, now: Instant) {
        if !matches!(self.states[c], State::Up) {
            return;
        }
        let conn = &mut self.conns[c];
        match conn.flush(&mut self.slots, &self.zero, &mut self.iovs, &mut self.hdrs) {
            Ok(empty) => {
                if empty == conn.want_out {
                    let events =
                        libc::EPOLLIN as u32 | if empty { 0 } else { libc::EPOLLOUT as u32 };
                    let fd = conn.raw_fd();
                    conn.want_out = !empty;
                    if let Err(e) =
                        epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, fd, events, c as u64)
                    {
                        self.broke(c, format!("epoll_ctl: {e}"), now);
                        return;
                    }
                }
                if self.conns[c].waiting > 0 {
                    self.ensure_ticking(now);
                }
            }
            Err(why) => self.broke(c, why, now),
        }
    }

    /// Sends, receives and keeps time: everything but handing out completions.
    fn progress(&mut self) {
        let now = Instant::now();
        if self.tick_at.is_some_and(|t| now >= t) {
            self.tick(now);
        }
        for c in 0..self.conns.len() {
            if !matches!(self.states[c], State::Up) {
                continue;
            }
            if self.conns[c].want_out {
                self.flush_conn(c, now);
                if !matches!(self.states[c], State::Up) {
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
    }

    /// The timer fired: silent servers, reconnection, re-arming.
    fn tick(&mut self, now: Instant) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local; the timerfd is non-blocking.
        unsafe { libc::read(self.timer.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        self.tick_at = None;
        let timeout = self.ex.opts.timeout;
        for c in 0..self.conns.len() {
            match self.states[c] {
                State::Up => {
                    let conn = &self.conns[c];
                    if conn.waiting > 0 && now.duration_since(conn.last_rx) >= timeout {
                        let why = format!(
                            "no reply for {} s ({} requests waiting)",
                            timeout.as_secs_f64(),
                            conn.waiting
                        );
                        self.broke(c, why, now);
                    }
                }
                State::Down { next_try, .. } if now >= next_try => self.retry(c, now),
                State::Down { .. } => {}
                State::Failed { .. } => self.retry_failed(c, now),
            }
        }
        let mut next: Option<Instant> = None;
        for c in 0..self.conns.len() {
            let at = match self.states[c] {
                State::Up if self.conns[c].waiting > 0 || !self.conns[c].sendq.is_empty() => {
                    Some(now + TICK)
                }
                State::Down { next_try, .. } => Some(next_try.min(now + TICK)),
                _ => None,
            };
            next = match (next, at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        match next {
            Some(at) => self.arm(at, now),
            None => self.arm_raw(Duration::ZERO),
        }
    }

    fn ensure_ticking(&mut self, now: Instant) {
        if self.tick_at.is_none() {
            self.arm(now + TICK, now);
        }
    }

    fn arm(&mut self, at: Instant, now: Instant) {
        let d = at
            .saturating_duration_since(now)
            .max(Duration::from_micros(1));
        self.arm_raw(d);
        self.tick_at = Some(at);
    }

    /// One-shot timer in `d` (zero: disarm).
    fn arm_raw(&mut self, d: Duration) {
        if let Err(e) = settime(&self.timer, d) {
            error!("nbd: timerfd_settime failed: {e}");
        }
        if d.is_zero() {
            self.tick_at = None;
        }
    }

    /// Connection `c` is lost: hold its operations for a replay and start reconnecting.
    fn broke(&mut self, c: usize, why: String, now: Instant) {
        let held = self.requeue(c);
        warn!(
            "{}: connection lost: {why}; reconnecting for up to {} s ({held} operations held)",
            self.ex.spec,
            self.ex.opts.reconnect.as_secs_f64()
        );
        self.states[c] = State::Down {
            since: now,
            next_try: now + FIRST_BACKOFF,
            backoff: FIRST_BACKOFF,
        };
        if self.tick_at.is_none_or(|t| t > now + FIRST_BACKOFF) {
            self.arm(now + FIRST_BACKOFF, now);
        }
    }

    /// Closes connection `c` and puts every operation of it back on its send queue, from
    /// its first piece. Returns how many.
    fn requeue(&mut self, c: usize) -> usize {
        let conn = &mut self.conns[c];
        if let Some(fd) = conn.fd.take() {
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
        }
        conn.sendq.clear();
        conn.waiting = 0;
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.busy && usize::from(s.conn) == c {
                s.restart();
                conn.sendq.push_back(i as u32);
            }
        }
        conn.sendq.len()
    }

    /// A reconnection attempt for a connection that is down.
    fn retry(&mut self, c: usize, now: Instant) {
        let State::Down { since, backoff, .. } = self.states[c] else {
            return;
        };
        match self.connect(c) {
            Ok(()) => {
                info!(
                    "{}: reconnected after {:.1} s; replaying {} operations",
                    self.ex.spec,
                    now.duration_since(since).as_secs_f64(),
                    self.conns[c].sendq.len()
                );
                self.flush_conn(c, Instant::now());
            }
            Err(e) if now.duration_since(since) >= self.ex.opts.reconnect => {
                error!(
                    "{}: no connection for {} s (last attempt: {e}); failing {} operations with EIO",
                    self.ex.spec,
                    self.ex.opts.reconnect.as_secs_f64(),
                    self.conns[c].sendq.len()
                );
                self.fail(c);
                self.states[c] = State::Failed { last_try: now };
            }
            Err(e) => {
                log::debug!("{}: reconnection failed: {e}", self.ex.spec);
                let backoff = (backoff * 2).min(MAX_BACKOFF);
                self.states[c] = State::Down {
                    since,
                    next_try: Instant::now() + backoff,
                    backoff,
                };
            }
        }
    }

    /// New work for a connection whose server is gone: one attempt a second, else EIO.
    fn retry_failed(&mut self, c: usize, now: Instant) {
        let State::Failed { last_try } = self.states[c] else {
            return;
        };
        if self.conns[c].sendq.is_empty() {
            return;
        }
        if now.duration_since(last_try) >= FAILED_RETRY {
            match self.connect(c) {
                Ok(()) => {
                    info!("{}: connected again", self.ex.spec);
                    self.flush_conn(c, now);
                    return;
                }
                Err(e) => {
                    log::debug!("{}: connection failed: {e}", self.ex.spec);
                    self.states[c] = State::Failed { last_try: now };
                }
            }
        }
        self.fail(c);
    }

    /// Fails every operation of connection `c` with EIO.
    fn fail(&mut self, c: usize) {
        while let Some(si) = self.conns[c].sendq.pop_front() {
            self.complete(si, Err(errno(libc::EIO)));
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
            match self.states[c] {
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
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        loop {
            self.submit()?;
            self.progress();
            if !self.done.is_empty() || self.in_flight == 0 {
                return Ok(());
            }
            // SAFETY: `events` is a live array of 8 entries.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 8, -1) };
            if n < 0 {
                let e = os_err();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for NbdEngine {
    fn drop(&mut self) {
        // Everything in flight ends first (the push contract lends buffers until then).
        while self.in_flight > 0 {
            if self.wait().is_err() {
                break;
            }
            let n = self.done.drain(&mut |_| {});
            self.in_flight -= n;
        }
        // Writes completed since the last flush are made durable before hanging up.
        if self.dirty && !self.ex.read_only && self.ex.has(FLAG_SEND_FLUSH) {
            // SAFETY: a flush lends no buffer.
            if unsafe { self.push(DROP_TOKEN, Op::Flush) }.is_ok() {
                let _ = self.submit();
                while self.in_flight > 0 && self.wait().is_ok() {
                    let mut failed = false;
                    let n = self.done.drain(&mut |c| failed |= c.result.is_err());
                    self.in_flight -= n;
                    if failed {
                        error!("{}: the flush at close failed", self.ex.spec);
                    }
                }
            }
        }
        for c in &self.conns {
            if let Some(fd) = &c.fd {
                disconnect(fd);
            }
        }
        self.ex.remove_engine();
    }
}
