//! One operation in flight, as NBD requests: an operation is cut into pieces of at most
//! `chunk` bytes (the server's largest payload for reads and writes), each a request whose
//! cookie is `slot | piece << 32`. The slot counts pieces sent and answered; it completes
//! when every piece is answered (the first error wins). A durable write on a server without
//! FUA has a second stage, a FLUSH, sent once every piece of the write is answered.

use super::wire::{request, CMD_READ, CMD_WRITE, REQUEST_LEN};

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
    /// Pieces whose request is wholly sent.
    pub next: u32,
    /// Bytes of piece `next` already sent.
    pub sent: u32,
    pub answered: u32,
    /// The first errno answered (0: none).
    pub error: i32,
    /// Durable write without FUA: a FLUSH follows once the write is answered.
    pub then_flush: bool,
    /// What the completion reports on success.
    pub result: u64,
    /// The connection it is sent on.
    pub conn: u16,
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
        answered: 0,
        error: 0,
        then_flush: false,
        result: 0,
        conn: 0,
    };

    /// Sets up the pieces for `len` bytes in chunks of `chunk`.
    pub(crate) fn cut(&mut self, len: u64, chunk: u64) {
        self.len = len;
        self.chunk = chunk.max(1);
        self.pieces = if len == 0 {
            1
        } else {
            len.div_ceil(self.chunk) as u32
        };
        self.restart();
    }

    /// Forgets every piece sent or answered: the operation starts again (a replay).
    pub(crate) fn restart(&mut self) {
        self.next = 0;
        self.sent = 0;
        self.answered = 0;
        self.error = 0;
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
        let cookie = u64::from(index) | (u64::from(p) << 32);
        request(
            self.flags,
            self.cmd,
            cookie,
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
        s.cut(10 << 20, 4 << 20);
        assert_eq!(s.pieces, 3);
        assert_eq!(s.piece(0), (0, 4 << 20));
        assert_eq!(s.piece(2), (8 << 20, 2 << 20));
        assert_eq!(s.payload(2), 2 << 20);
        assert_eq!(s.reply_payload(2), 0);
        s.cut(0, 4096);
        assert_eq!(s.pieces, 1);
        s.offset = 512;
        s.cut(4096, 4096);
        let h = s.header(7, 0);
        assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), 7);
        assert_eq!(u64::from_be_bytes(h[16..24].try_into().unwrap()), 512);
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
