//! One operation in flight, as NBD requests: an operation is cut into pieces of at most
//! `chunk` bytes (the server's largest payload for reads and writes), each a request. A
//! durable write on a server without FUA has a second stage, a FLUSH, sent once every
//! piece of the write is answered.
//!
//! Replies are matched exactly, in O(1), with no allocation:
//! - The cookie is `slot | use << 16 | piece << 32`. `use` is the slot's 16-bit use
//!   counter, bumped whenever the slot's requests start over: a new operation, a replay
//!   after a broken connection, the FLUSH stage. A reply naming an earlier operation of
//!   the slot, or a request sent on an earlier connection, names another use and matches
//!   nothing (a cookie 65536 uses old would match again; a server can forge a reply for
//!   any cookie it was sent anyway, so the counter tells stale replies from fresh ones,
//!   it is no secret).
//! - Each piece is answered at most once: pieces below `base` are answered, bit `i` of
//!   `acked` is piece `base + i`, and at most [`WINDOW`] pieces past `base` are sent
//!   (`next - base <= WINDOW`), so one word holds the set. A slot whose window is full
//!   leaves the send queue and comes back when a reply moves `base` (one operation as
//!   large as 64 server payloads waits for replies; nothing else does).
//!
//! A reply is accepted only for a piece of the slot's current use with
//! `base <= piece < next` and its bit clear; anything else is a protocol violation.
//!
//! Each piece of the window keeps the time it was wholly sent (`sent_at`, by piece modulo
//! [`WINDOW`]): piece `base` is the oldest awaiting a reply, so its time is what the
//! per-request deadline (`deadline`) looks at.

use std::time::Instant;

use super::wire::{request, CMD_READ, CMD_WRITE, REQUEST_LEN};

/// Pieces of one operation sent and not answered, at most (the bits of `Slot::acked`).
pub(crate) const WINDOW: u32 = 64;

/// The cookie of piece `piece` of use `gen` of slot `slot` (below 65536: the engine depth
/// is at most [`MAX_DEPTH`](crate::MAX_DEPTH)).
pub(crate) fn cookie(slot: u32, gen: u16, piece: u32) -> u64 {
    u64::from(slot & 0xffff) | (u64::from(gen) << 16) | (u64::from(piece) << 32)
}

/// A cookie's slot, use and piece.
pub(crate) fn uncookie(c: u64) -> (u32, u16, u32) {
    ((c & 0xffff) as u32, (c >> 16) as u16, (c >> 32) as u32)
}

/// Why a reply matches no piece awaiting one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stray {
    /// The slot holds no operation on this connection.
    Idle,
    /// The cookie names an earlier use of the slot (a finished operation, or a request
    /// sent before a replay).
    OldUse,
    /// The piece was not (wholly) sent.
    NotSent,
    /// The piece was answered already.
    Repeated,
}

impl std::fmt::Display for Stray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stray::Idle => "its slot holds no operation on this connection",
            Stray::OldUse => "it names an earlier use of its slot (an operation finished, or a request sent before a replay)",
            Stray::NotSent => "that request was not sent",
            Stray::Repeated => "that request was answered already",
        })
    }
}

/// The state of one operation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    pub token: u64,
    pub busy: bool,
    pub cmd: u16,
    pub flags: u16,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Bytes covered by the requests (0 for FLUSH).
    pub len: u64,
    /// The caller's iovecs (reads and writes); null for writes of zeroes, whose payload is
    /// the engine's zero buffer.
    pub iov: *const libc::iovec,
    pub iovcnt: u32,
    /// Bytes per piece.
    pub chunk: u64,
    pub pieces: u32,
    /// Pieces whose request is wholly sent (in this use).
    pub next: u32,
    /// Bytes of piece `next` already sent.
    pub sent: u32,
    /// Every piece below it is answered.
    pub base: u32,
    /// Bit `i`: piece `base + i` is answered (bit 0 is always clear).
    pub acked: u64,
    /// The use the cookies name.
    pub gen: u16,
    /// The first errno answered (0: none).
    pub error: i32,
    /// Durable write without FUA: a FLUSH follows once the write is answered.
    pub then_flush: bool,
    /// What the completion reports on success.
    pub result: u64,
    /// The connection it is sent on.
    pub conn: u16,
    /// When a broken connection first caught the operation (it is replayed until then
    /// plus the reconnect window).
    pub held: Option<Instant>,
    /// When piece `p` was wholly sent, at `p % WINDOW` (the engine's clock, in ms); valid
    /// for the pieces `base .. next`.
    pub sent_at: [u32; WINDOW as usize],
}

impl Slot {
    pub(crate) const IDLE: Slot = Slot {
        token: 0,
        busy: false,
        cmd: 0,
        flags: 0,
        offset: 0,
        len: 0,
        iov: std::ptr::null(),
        iovcnt: 0,
        chunk: 1,
        pieces: 0,
        next: 0,
        sent: 0,
        base: 0,
        acked: 0,
        gen: 0,
        error: 0,
        then_flush: false,
        result: 0,
        conn: 0,
        held: None,
        sent_at: [0; WINDOW as usize],
    };

    /// Sets up the pieces for `len` bytes in chunks of `chunk`; `false` when that takes
    /// more pieces than a cookie can number (2^32).
    #[must_use]
    pub(crate) fn cut(&mut self, len: u64, chunk: u64) -> bool {
        self.len = len;
        self.chunk = chunk.max(1);
        let Ok(pieces) = u32::try_from(len.div_ceil(self.chunk).max(1)) else {
            return false;
        };
        self.pieces = pieces;
        self.restart();
        true
    }

    /// One request with no range and no payload (a FLUSH).
    pub(crate) fn single(&mut self) {
        self.len = 0;
        self.chunk = 1;
        self.pieces = 1;
        self.restart();
    }

    /// Forgets every piece sent or answered, and takes a new use: the operation starts
    /// again (a replay), and replies to what was sent before match nothing.
    pub(crate) fn restart(&mut self) {
        self.next = 0;
        self.sent = 0;
        self.base = 0;
        self.acked = 0;
        self.error = 0;
        self.gen = self.gen.wrapping_add(1);
    }

    /// Some piece of this use is wholly sent and not answered: the server has it, and
    /// may still carry it out.
    pub(crate) fn sent_any(&self) -> bool {
        self.base < self.next
    }

    /// One past the last piece that may be sent now.
    pub(crate) fn window_end(&self) -> u32 {
        self.pieces.min(self.base.saturating_add(WINDOW))
    }

    /// Every piece is answered.
    pub(crate) fn done(&self) -> bool {
        self.base == self.pieces
    }

    /// Piece `p` (the next to send) is wholly sent at `ms`.
    pub(crate) fn mark_sent(&mut self, p: u32, ms: u32) {
        self.sent_at[(p % WINDOW) as usize] = ms;
    }

    /// When piece `p` (sent, in the window) was wholly sent.
    pub(crate) fn sent_time(&self, p: u32) -> u32 {
        self.sent_at[(p % WINDOW) as usize]
    }

    /// The oldest piece awaiting a reply and when it was sent: piece `base`, once sent
    /// (its bit of `acked` is always clear).
    pub(crate) fn oldest_waiting(&self) -> Option<(u32, u32)> {
        (self.busy && self.base < self.next).then(|| (self.base, self.sent_time(self.base)))
    }

    /// Takes the reply for piece `p` of use `gen`. `Ok(true)` when the slot had sent all
    /// its window allowed and has room again (it goes back on the send queue).
    pub(crate) fn claim(&mut self, gen: u16, p: u32) -> Result<bool, Stray> {
        if gen != self.gen {
            return Err(Stray::OldUse);
        }
        if p >= self.next {
            return Err(Stray::NotSent);
        }
        if p < self.base {
            return Err(Stray::Repeated);
        }
        // base <= p < next <= base + WINDOW: the bit exists.
        let bit = 1u64 << (p - self.base);
        if self.acked & bit != 0 {
            return Err(Stray::Repeated);
        }
        let stalled = self.next < self.pieces && self.next == self.window_end();
        self.acked |= bit;
        let answered = self.acked.trailing_ones();
        self.base += answered;
        self.acked = self.acked.checked_shr(answered).unwrap_or(0);
        Ok(stalled && self.next < self.window_end())
    }

    /// Byte range of piece `p` within the operation: (start, length).
    pub(crate) fn piece(&self, p: u32) -> (u64, u64) {
        let start = u64::from(p) * self.chunk;
        (start, self.chunk.min(self.len.saturating_sub(start)))
    }

    /// Payload bytes the request of piece `p` carries.
    pub(crate) fn payload(&self, p: u32) -> u64 {
        if self.cmd == CMD_WRITE {
            self.piece(p).1
        } else {
            0
        }
    }

    /// Payload bytes the reply of piece `p` carries (on success).
    pub(crate) fn reply_payload(&self, p: u32) -> u64 {
        if self.cmd == CMD_READ {
            self.piece(p).1
        } else {
            0
        }
    }

    /// The request header of piece `p` of slot `index`.
    pub(crate) fn header(&self, index: u32, p: u32) -> [u8; REQUEST_LEN] {
        let (start, len) = self.piece(p);
        request(
            self.flags,
            self.cmd,
            cookie(index, self.gen, p),
            self.offset + start,
            len as u32,
        )
    }
}

/// Appends to `out` the iovecs covering bytes `start .. start + len` of `iov`, at most
/// `room` of them; returns the bytes they cover.
///
/// # Safety
/// `iov` points to `iovcnt` valid iovecs (the push contract), or `iovcnt` is 0.
pub(crate) unsafe fn segments(
    iov: *const libc::iovec,
    iovcnt: u32,
    mut start: u64,
    len: u64,
    out: &mut Vec<libc::iovec>,
    room: usize,
) -> u64 {
    if iov.is_null() || iovcnt == 0 {
        return 0;
    }
    // SAFETY: non-null and valid for iovcnt elements by this function's contract.
    let all = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    let mut left = len;
    let mut added = 0;
    for v in all {
        if left == 0 || added == room {
            break;
        }
        let vlen = v.iov_len as u64;
        if start >= vlen {
            start -= vlen;
            continue;
        }
        let take = (vlen - start).min(left);
        out.push(libc::iovec {
            // `start < vlen`, so the pointer stays inside this buffer.
            iov_base: v.iov_base.cast::<u8>().wrapping_add(start as usize).cast(),
            iov_len: take as usize,
        });
        added += 1;
        left -= take;
        start = 0;
    }
    len - left
}

/// Copies `src` into the iovecs at byte `start` of `iov`.
///
/// # Safety
/// `iov` points to `iovcnt` valid iovecs whose buffers are writable and do not overlap
/// `src`, and `start + src.len()` is within their total.
pub(crate) unsafe fn scatter(iov: *const libc::iovec, iovcnt: u32, mut start: u64, src: &[u8]) {
    if iov.is_null() || iovcnt == 0 {
        return;
    }
    // SAFETY: valid for iovcnt elements by this function's contract.
    let all = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    let mut src = src;
    for v in all {
        if src.is_empty() {
            break;
        }
        let vlen = v.iov_len as u64;
        if start >= vlen {
            start -= vlen;
            continue;
        }
        let n = ((vlen - start) as usize).min(src.len());
        // SAFETY: `start + n <= iov_len`: inside a writable caller buffer that does not
        // overlap `src` (this function's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                v.iov_base.cast::<u8>().add(start as usize),
                n,
            )
        };
        src = &src[n..];
        start = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_operation() {
        let mut s = Slot::IDLE;
        s.cmd = CMD_WRITE;
        assert!(s.cut(10 << 20, 4 << 20));
        assert_eq!(s.pieces, 3);
        assert_eq!(s.piece(0), (0, 4 << 20));
        assert_eq!(s.piece(2), (8 << 20, 2 << 20));
        assert_eq!(s.payload(2), 2 << 20);
        assert_eq!(s.reply_payload(2), 0);
        assert!(s.cut(0, 4096));
        assert_eq!(s.pieces, 1);
        s.offset = 512;
        assert!(s.cut(4096, 4096));
        let h = s.header(7, 0);
        let c = u64::from_be_bytes(h[8..16].try_into().unwrap());
        assert_eq!(uncookie(c), (7, s.gen, 0));
        assert_eq!(u64::from_be_bytes(h[16..24].try_into().unwrap()), 512);
        // More pieces than a cookie numbers: refused, not truncated.
        assert!(!s.cut(1 << 42, 512));
    }

    #[test]
    fn cookies_round_trip() {
        let c = cookie(32767, 0xbeef, u32::MAX);
        assert_eq!(uncookie(c), (32767, 0xbeef, u32::MAX));
    }

    /// A slot with `pieces` pieces, `sent` of them sent.
    fn sent(pieces: u64, sent: u32) -> Slot {
        let mut s = Slot::IDLE;
        s.cmd = CMD_WRITE;
        assert!(s.cut(pieces * 512, 512));
        s.next = sent;
        s
    }

    #[test]
    fn each_piece_is_answered_once_in_any_order() {
        let mut s = sent(3, 3);
        let g = s.gen;
        assert_eq!(s.claim(g, 1), Ok(false));
        assert_eq!(s.claim(g, 1), Err(Stray::Repeated));
        assert!(!s.done());
        assert_eq!(s.claim(g, 0), Ok(false));
        assert_eq!(s.base, 2);
        assert_eq!(s.claim(g, 0), Err(Stray::Repeated));
        assert_eq!(s.claim(g, 3), Err(Stray::NotSent));
        assert_eq!(s.claim(g.wrapping_sub(1), 2), Err(Stray::OldUse));
        assert!(!s.done());
        assert_eq!(s.claim(g, 2), Ok(false));
        assert!(s.done());
        // A replay is a new use: the old cookies match nothing.
        s.restart();
        s.next = 1;
        assert_eq!(s.claim(g, 0), Err(Stray::OldUse));
        assert_eq!(s.claim(s.gen, 0), Ok(false));
    }

    #[test]
    fn the_window_bounds_pieces_awaiting_replies() {
        let mut s = sent(200, 0);
        assert_eq!(s.window_end(), WINDOW);
        s.next = WINDOW;
        let g = s.gen;
        // The last piece of the window answered: base stays, no room yet.
        assert_eq!(s.claim(g, WINDOW - 1), Ok(false));
        assert_eq!(s.window_end(), WINDOW);
        // The first: base moves past both, and the stalled slot has room again.
        assert_eq!(s.claim(g, 0), Ok(true));
        assert_eq!(s.base, 1);
        assert_eq!(s.window_end(), WINDOW + 1);
        for p in 1..WINDOW - 1 {
            assert_eq!(s.claim(g, p), Ok(false));
        }
        assert_eq!(s.base, WINDOW);
        assert_eq!(s.acked, 0);
        assert_eq!(s.window_end(), 2 * WINDOW);
    }

    #[test]
    fn the_oldest_piece_awaiting_a_reply_keeps_its_send_time() {
        let mut s = sent(200, 0);
        s.busy = true;
        assert_eq!(s.oldest_waiting(), None);
        // The window sent at 10 ms, piece by piece.
        for p in 0..WINDOW {
            s.mark_sent(p, 10);
            s.next += 1;
        }
        assert_eq!(s.oldest_waiting(), Some((0, 10)));
        let g = s.gen;
        // Piece 0 answered: piece 64 goes out later, in piece 0's place of the ring; the
        // oldest is still piece 1, sent at 10.
        assert_eq!(s.claim(g, 0), Ok(true));
        s.mark_sent(WINDOW, 900);
        s.next += 1;
        assert_eq!(s.oldest_waiting(), Some((1, 10)));
        for p in 1..WINDOW {
            assert!(s.claim(g, p).is_ok());
        }
        assert_eq!(s.oldest_waiting(), Some((WINDOW, 900)));
        assert_eq!(s.claim(g, WINDOW), Ok(false));
        assert_eq!(s.oldest_waiting(), None, "every piece sent is answered");
    }

    #[test]
    fn segments_and_scatter_trim_iovecs() {
        let mut a = [0u8; 8];
        let mut b = [0u8; 8];
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: 8,
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 8,
            },
        ];
        let mut out = Vec::new();
        // SAFETY: two valid iovecs over live arrays.
        let n = unsafe { segments(iov.as_ptr(), 2, 6, 6, &mut out, 8) };
        assert_eq!(n, 6);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].iov_len, out[1].iov_len), (2, 4));
        out.clear();
        // SAFETY: as above; room limits the result to one iovec.
        assert_eq!(unsafe { segments(iov.as_ptr(), 2, 6, 6, &mut out, 1) }, 2);
        // SAFETY: as above; 6 + 4 <= 16 and the source is a separate array.
        unsafe { scatter(iov.as_ptr(), 2, 6, &[1, 2, 3, 4]) };
        assert_eq!(a, [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(b, [3, 4, 0, 0, 0, 0, 0, 0]);
    }
}
