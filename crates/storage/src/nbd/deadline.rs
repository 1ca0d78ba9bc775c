//! Deadlines on a connection that is up: every wait on the server ends within
//! [`NbdOptions::timeout`](super::NbdOptions), or the connection is broken (its operations
//! are held and replayed, see `reconnect`). Three rules, checked by the engine's timer
//! (every 100 ms while anything waits):
//!
//! - **Each request is answered within the timeout of being wholly sent**: its reply
//!   header and, for a read, the whole payload. A server that keeps answering the other
//!   requests but loses one cannot keep that one in flight: it is replayed on a new
//!   connection, and once it has been held for the reconnect window
//!   ([`NbdOptions::reconnect`](super::NbdOptions)) it fails with `EIO`, even while other
//!   operations complete.
//! - **A request is wholly sent within the timeout of reaching the head of the send
//!   queue with the socket full**: a server that stops reading (or reads a byte now and
//!   then) cannot hold a request that was never wholly sent.
//! - **A silent server**: no byte received for the timeout while replies are awaited.
//!
//! The trade-off: one request that legitimately takes longer than the timeout to be sent
//! or answered (a 32 MiB write to a very slow server, or over a slow link) is broken off
//! and replayed, and fails after the reconnect window; such servers need a larger
//! timeout (`--nbd-timeout-secs`). A request waiting in the send queue behind others, or
//! in the socket buffer unread by a busy server, is timed from when it was wholly sent
//! into the socket.
//!
//! Cost: nothing per request but a 32-bit timestamp written when a piece is wholly sent
//! (`Slot::sent_at`: the pieces of one slot are sent in order, so piece `base` is the
//! oldest awaiting a reply). The timer looks at the slots only when the earliest deadline
//! it found last time comes: pieces sent later have later deadlines and replies only
//! remove pieces, so with replies quicker than the timeout that is about once a timeout,
//! and at most once a tick.

use std::time::{Duration, Instant};

use super::engine::NbdEngine;
use super::reconnect::State;
use super::wire::{CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES};

/// The longest per-request deadline: ages are kept in 32-bit milliseconds (about 24 days,
/// half the range, so that a wrapped difference is never taken for a small one).
const MAX_LIMIT_MS: u32 = 1 << 31;

/// Milliseconds on the engine's own clock, 32 bits, wrapping every 49 days; only
/// differences are used, and no piece waits longer than `MAX_LIMIT_MS` plus a tick.
pub(crate) struct Clock {
    epoch: Instant,
    /// The per-request deadline in ms (the timeout, at most `MAX_LIMIT_MS`).
    limit_ms: u32,
}

impl Clock {
    pub(crate) fn new(timeout: Duration) -> Clock {
        Clock {
            epoch: Instant::now(),
            limit_ms: timeout.as_millis().min(u128::from(MAX_LIMIT_MS)) as u32,
        }
    }

    /// `t` on this clock (truncated to 32 bits: wrapping).
    pub(crate) fn ms(&self, t: Instant) -> u32 {
        t.saturating_duration_since(self.epoch).as_millis() as u32
    }

    /// The per-request deadline.
    pub(crate) fn limit(&self) -> Duration {
        Duration::from_millis(u64::from(self.limit_ms))
    }
}

/// The oldest request of a connection awaiting its reply: slot, piece, age in ms.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Oldest {
    slot: u32,
    piece: u32,
    age: u32,
}

impl NbdEngine {
    /// Breaks every connection up that waits on the server past a deadline.
    pub(super) fn deadlines(&mut self, now: Instant) {
        let timeout = self.ex.opts.timeout;
        for c in 0..self.conns.len() {
            if !matches!(self.lives[c].state, State::Up) {
                continue;
            }
            let conn = &self.conns[c];
            if conn.waiting > 0 && now.duration_since(conn.last_rx) >= timeout {
                let why = format!(
                    "no reply for {} s ({} requests waiting)",
                    timeout.as_secs_f64(),
                    conn.waiting
                );
                self.broke(c, why.into(), now);
            } else if let Some(since) = conn
                .send_since
                .filter(|&t| now.duration_since(t) >= timeout)
            {
                let why = format!(
                    "the server took no whole request for {:.1} s (the socket stayed full; \
                     the limit is {} s)",
                    now.duration_since(since).as_secs_f64(),
                    timeout.as_secs_f64()
                );
                self.broke(c, why.into(), now);
            }
        }
        if self.due.is_some_and(|d| now >= d) {
            self.overdue(now);
        }
    }

    /// A piece was wholly sent at `now`: its deadline is no earlier than one already due.
    pub(super) fn sent_now(&mut self, now: Instant) {
        if self.due.is_none() {
            self.due = Some(now + self.clock.limit());
        }
    }

    /// Finds each connection's oldest request awaiting a reply; breaks the connections
    /// where it is past the deadline, and notes when the next one is due.
    fn overdue(&mut self, now: Instant) {
        let now_ms = self.clock.ms(now);
        let limit = self.clock.limit_ms;
        self.oldest.clear();
        self.oldest.resize(self.conns.len(), None);
        let older = |oldest: &mut Option<Oldest>, slot: u32, piece: u32, sent: u32| {
            let age = now_ms.wrapping_sub(sent);
            if oldest.is_none_or(|o| age > o.age) {
                *oldest = Some(Oldest { slot, piece, age });
            }
        };
        for (si, s) in self.slots.iter().enumerate() {
            if let Some((piece, sent)) = s.oldest_waiting() {
                if let Some(o) = self.oldest.get_mut(usize::from(s.conn)) {
                    older(o, si as u32, piece, sent);
                }
            }
        }
        for (c, conn) in self.conns.iter().enumerate() {
            if let Some((slot, piece, sent)) = conn.receiving() {
                older(&mut self.oldest[c], slot, piece, sent);
            }
        }
        self.due = None;
        for c in 0..self.conns.len() {
            let Some(o) = self.oldest[c] else { continue };
            if !matches!(self.lives[c].state, State::Up) {
                continue;
            }
            if o.age < limit {
                let at = now + Duration::from_millis(u64::from(limit - o.age));
                self.due = Some(self.due.map_or(at, |d| d.min(at)));
                continue;
            }
            let s = &self.slots[o.slot as usize];
            let why = format!(
                "a {} request (slot {}, piece {} of {}) has had no reply for {:.1} s, the \
                 limit of one request",
                cmd_name(s.cmd),
                o.slot,
                o.piece + 1,
                s.pieces,
                f64::from(o.age) / 1000.0,
            );
            self.broke(c, why.into(), now);
        }
    }
}

fn cmd_name(cmd: u16) -> &'static str {
    match cmd {
        CMD_READ => "read",
        CMD_WRITE => "write",
        CMD_FLUSH => "flush",
        CMD_TRIM => "trim",
        CMD_WRITE_ZEROES => "write-zeroes",
        _ => "other",
    }
}
