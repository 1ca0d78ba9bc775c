//! A connection's life: up, down (reconnecting) or failed; what a break does to the
//! operations it carried, and when the engine gives up on them.
//!
//! - **A break** — the server hung up, a send or receive failed, a reply broke the
//!   protocol (see `slots`: a reply that matches no request awaiting one), or a wait on
//!   the server passed its deadline (see `deadline`: a request unanswered for
//!   [`NbdOptions::timeout`](super::NbdOptions) after it was sent, one the socket would
//!   not take for as long, or no byte at all while replies were awaited) — closes
//!   the socket and holds the connection's operations, to replay them from their first
//!   piece on a new connection with new cookies. Reads and writes are idempotent, and a
//!   write is completed only by its reply. But a break vblk makes (a deadline, a protocol
//!   violation) leaves the server free to carry out what it has, later: a write it has
//!   and has not answered fails with EIO instead, and fences every later write of the
//!   disk ([`NbdEngine::fence_writes`]), so that it cannot land over a newer acknowledged
//!   one.
//! - **Reconnecting** never blocks the worker: each attempt runs on a thread of its own
//!   (`dial`), bounded by the timeout, one at a time per connection. The delay before an
//!   attempt starts at 10 ms and doubles to 1 s with every break and every failed attempt;
//!   it starts over only when an operation completes, so a server that accepts and breaks
//!   at once is not hammered.
//! - **Giving up.** A connection is *in trouble* from the first break that catches
//!   operations until an operation completes on it (the server answered every piece of
//!   one: progress), or a reconnection finds nothing to replay. A connection that comes up
//!   and breaks again stays in trouble, so a server that accepts connections and breaks the
//!   protocol every time cannot make the engine replay forever: a break or a failed
//!   attempt that comes [`NbdOptions::reconnect`](super::NbdOptions) or more after the
//!   trouble began fails everything the connection holds with `EIO`, and the connection is
//!   failed. A connection down with nothing held is failed after `reconnect` of failed
//!   attempts. Besides, an operation caught by a break fails at a later break or failed
//!   attempt that comes `reconnect` or more after the first that caught it, even if others
//!   complete in between (a server that answers everything but breaks whenever one request
//!   comes cannot keep that one forever).
//! - **Failed**: new work brings one attempt a second. Work that comes while no attempt is
//!   due fails at once; work that comes with an attempt waits for it. A connection that
//!   comes back is still in trouble until an operation completes on it, so work on a
//!   server that breaks again fails at its first break.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};

use std::sync::atomic::Ordering;

use super::conn::Broken;
use super::dial::{self, Dial};
use super::engine::NbdEngine;
use super::sys::{epoll_ctl, settime};
use super::wire::{CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES};
use super::NbdError;
use crate::engine::errno;

/// Timer period while anything waits for the server.
const TICK: Duration = Duration::from_millis(100);
/// First reconnection delay; it doubles up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often a failed connection tries again when new work comes.
const FAILED_RETRY: Duration = Duration::from_secs(1);

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug)]
pub(crate) enum State {
    Up,
    /// Since the trouble began (or, with nothing held, since the break).
    Down {
        since: Instant,
        next_try: Instant,
    },
    Failed {
        last_try: Instant,
    },
}

/// One connection's life.
pub(crate) struct Life {
    pub state: State,
    /// When the trouble began: the first break that caught operations since the last
    /// progress.
    pub trouble: Option<Instant>,
    /// A connection attempt under way.
    pub dial: Option<Dial>,
    /// The delay before the next attempt.
    backoff: Duration,
}

impl Life {
    pub(crate) fn new() -> Life {
        Life {
            state: State::Up,
            trouble: None,
            dial: None,
            backoff: FIRST_BACKOFF,
        }
    }

    /// An operation completed on the connection.
    pub(crate) fn progress(&mut self) {
        self.trouble = None;
        self.backoff = FIRST_BACKOFF;
    }

    /// The delay before the next attempt, doubling the one after.
    fn next_backoff(&mut self) -> Duration {
        let d = self.backoff;
        self.backoff = (d * 2).min(MAX_BACKOFF);
        d
    }
}

impl NbdEngine {
    /// The timer fired: deadlines (`deadline`), reconnection, re-arming.
    pub(super) fn tick(&mut self, now: Instant) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local; the timerfd is non-blocking.
        unsafe { libc::read(self.timer.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        self.tick_at = None;
        self.deadlines(now);
        for c in 0..self.conns.len() {
            match self.lives[c].state {
                State::Down { next_try, .. } if now >= next_try => self.dial(c, now),
                State::Failed { .. } => self.retry_failed(c, now),
                State::Up | State::Down { .. } => {}
            }
        }
        let mut next: Option<Instant> = None;
        for c in 0..self.conns.len() {
            let conn = &self.conns[c];
            let at = match self.lives[c].state {
                State::Up
                    if conn.waiting > 0 || !conn.sendq.is_empty() || conn.receiving().is_some() =>
                {
                    Some(now + TICK)
                }
                // An attempt under way wakes the engine when it ends.
                State::Down { .. } if self.lives[c].dial.is_some() => Some(now + TICK),
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

    pub(super) fn ensure_ticking(&mut self, now: Instant) {
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

    /// Connection `c` is lost: hold its operations for a replay and reconnect, unless it
    /// has been in trouble too long. A break that vblk made (a deadline, a protocol
    /// violation) with writes sent and unanswered fences the disk's writes first
    /// ([`NbdEngine::fence_writes`]).
    pub(super) fn broke(&mut self, c: usize, broken: Broken, now: Instant) {
        let why = broken.why;
        if !broken.server_ended {
            self.fence_writes(c, &why);
        }
        let held = self.requeue(c, now);
        let life = &mut self.lives[c];
        if held > 0 {
            life.trouble.get_or_insert(now);
        }
        let (since, backoff) = (life.trouble.unwrap_or(now), life.next_backoff());
        let window = self.ex.opts.reconnect;
        if now.duration_since(since) >= window {
            error!(
                "{}: connection lost: {why}; no operation completed for {:.1} s of breaks and \
                 reconnections (the limit is {} s): failing {held} operations with EIO",
                self.ex.spec,
                now.duration_since(since).as_secs_f64(),
                window.as_secs_f64()
            );
            self.fail(c);
            self.lives[c].state = State::Failed { last_try: now };
            return;
        }
        let expired = self.expire_held(c, now);
        warn!(
            "{}: connection lost: {why}; reconnecting for up to {:.1} s more ({} operations \
             held{})",
            self.ex.spec,
            (window - now.duration_since(since)).as_secs_f64(),
            held - expired,
            if expired > 0 {
                format!(
                    ", {expired} held since a break {} s ago failed with EIO",
                    window.as_secs_f64()
                )
            } else {
                String::new()
            }
        );
        let next_try = now + backoff;
        self.lives[c].state = State::Down { since, next_try };
        if self.tick_at.is_none_or(|t| t > next_try) {
            self.arm(next_try, now);
        }
    }

    /// If connection `c`, which vblk gives up while the server may still be working on
    /// it, has a write, trim or write-zeroes sent and unanswered: the server may apply it
    /// later, after writes sent on the next connection, and an acknowledged write would
    /// be lost under it (a slow server that answers after the timeout does just that).
    /// So those operations fail with EIO instead of being replayed, and every later
    /// write, trim, write-zeroes and flush of the disk fails with EIO too, on every
    /// engine (reads go on): the disk must be opened again to write, once the server is
    /// sound. A server that ends a connection itself applies nothing more from it, and
    /// its operations are replayed as before.
    fn fence_writes(&mut self, c: usize, why: &str) {
        let unsafe_writes: Vec<u32> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                s.busy
                    && usize::from(s.conn) == c
                    && matches!(s.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
                    && s.sent_any()
            })
            .map(|(i, _)| i as u32)
            .collect();
        if unsafe_writes.is_empty() {
            return;
        }
        if !self.ex.writes_fenced.swap(true, Ordering::Relaxed) {
            error!(
                "{}: connection given up ({why}) with {} writes sent and unanswered: the \
                 server may still apply them, after newer writes, so they fail with EIO \
                 and so does every later write, trim and flush of this disk (reads go on); \
                 to write again, open the disk again once the server is sound (`vblk disk \
                 remove` and `add`, or restart the daemon)",
                self.ex.spec,
                unsafe_writes.len()
            );
        }
        let conn = &mut self.conns[c];
        conn.sendq.retain(|si| !unsafe_writes.contains(si));
        for si in unsafe_writes {
            self.complete(si, Err(errno(libc::EIO)));
        }
    }

    /// Closes connection `c` and puts every operation of it back on its send queue, from
    /// its first piece and with a new use (so no reply to what was sent matches it).
    /// Returns how many.
    fn requeue(&mut self, c: usize, now: Instant) -> usize {
        let conn = &mut self.conns[c];
        if let Some(fd) = conn.fd.take() {
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
        }
        conn.sendq.clear();
        conn.waiting = 0;
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.busy && usize::from(s.conn) == c {
                s.restart();
                s.held.get_or_insert(now);
                conn.sendq.push_back(i as u32);
            }
        }
        conn.sendq.len()
    }

    /// Fails with EIO the operations of connection `c` held since a break at least the
    /// reconnect window ago. Returns how many.
    fn expire_held(&mut self, c: usize, now: Instant) -> usize {
        let window = self.ex.opts.reconnect;
        let mut expired = 0;
        for _ in 0..self.conns[c].sendq.len() {
            let Some(si) = self.conns[c].sendq.pop_front() else {
                break;
            };
            let held = self.slots[si as usize].held;
            if held.is_some_and(|h| now.duration_since(h) >= window) {
                self.complete(si, Err(errno(libc::EIO)));
                expired += 1;
            } else {
                self.conns[c].sendq.push_back(si);
            }
        }
        expired
    }

    /// Starts a connection attempt for `c` (unless one is under way).
    fn dial(&mut self, c: usize, now: Instant) {
        if self.lives[c].dial.is_some() {
            return;
        }
        match Dial::start(&self.ex, &self.wake) {
            Ok(d) => {
                self.lives[c].dial = Some(d);
                self.dialing += 1;
            }
            Err(e) => self.dialed(c, Err(NbdError::Connect { source: e }), now),
        }
    }

    /// Takes the results of the attempts that ended.
    pub(super) fn dialed_any(&mut self, now: Instant) {
        // Reset the eventfd before looking, so a result sent after the look wakes us.
        dial::drain(&self.wake);
        for c in 0..self.conns.len() {
            let Some(r) = self.lives[c].dial.as_ref().and_then(Dial::result) else {
                continue;
            };
            self.lives[c].dial = None;
            self.dialing -= 1;
            self.dialed(c, r, now);
        }
    }

    /// A connection attempt for `c` ended with `r`.
    fn dialed(&mut self, c: usize, r: Result<OwnedFd, NbdError>, now: Instant) {
        let state = self.lives[c].state;
        let since = match state {
            State::Up => return, // cannot happen: attempts are made for connections not up
            State::Down { since, .. } => since,
            State::Failed { .. } => now,
        };
        let window = self.ex.opts.reconnect;
        match (r.and_then(|fd| self.attach(c, fd)), state) {
            (Ok(()), _) => {
                let replay = self.conns[c].sendq.len();
                if replay == 0 {
                    // Nothing is hindered: whatever the trouble was, it is over.
                    self.lives[c].trouble = None;
                }
                if matches!(state, State::Failed { .. }) {
                    info!("{}: connected again", self.ex.spec);
                } else {
                    info!(
                        "{}: reconnected {:.1} s after the first break; replaying {replay} \
                         operations",
                        self.ex.spec,
                        now.duration_since(since).as_secs_f64(),
                    );
                }
                self.flush_conn(c, now);
            }
            (Err(e), State::Down { .. }) if now.duration_since(since) >= window => {
                error!(
                    "{}: no working connection for {:.1} s (the limit is {} s; last attempt: \
                     {e}); failing {} operations with EIO",
                    self.ex.spec,
                    now.duration_since(since).as_secs_f64(),
                    window.as_secs_f64(),
                    self.conns[c].sendq.len()
                );
                self.fail(c);
                self.lives[c].state = State::Failed { last_try: now };
            }
            (Err(e), State::Down { .. }) => {
                debug!("{}: reconnection failed: {e}", self.ex.spec);
                let expired = self.expire_held(c, now);
                if expired > 0 {
                    error!(
                        "{}: {expired} operations held since a break {} s ago failed with EIO",
                        self.ex.spec,
                        window.as_secs_f64()
                    );
                }
                let next_try = now + self.lives[c].next_backoff();
                self.lives[c].state = State::Down { since, next_try };
                if self.tick_at.is_none_or(|t| t > next_try) {
                    self.arm(next_try, now);
                }
            }
            (Err(e), _) => {
                debug!("{}: connection failed: {e}", self.ex.spec);
                self.fail(c);
                self.lives[c].state = State::Failed { last_try: now };
            }
        }
    }

    /// New work for a failed connection: one attempt a second (the work waits for it),
    /// else EIO at once.
    pub(super) fn retry_failed(&mut self, c: usize, now: Instant) {
        let State::Failed { last_try } = self.lives[c].state else {
            return;
        };
        if self.conns[c].sendq.is_empty() || self.lives[c].dial.is_some() {
            return;
        }
        if now.duration_since(last_try) >= FAILED_RETRY {
            self.dial(c, now);
            if self.lives[c].dial.is_some() {
                return;
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
