//! Operations carried in pieces: the slot table the asynchronous engines (io_uring, aio)
//! share, and the read/write logic that does not depend on how a piece reaches the
//! kernel.
//!
//! An operation lives in one preallocated [`Slot`] from push to completion. A read or a
//! write goes to the kernel one piece at a time ([`Slot::rw_piece`]), each started when the
//! previous one completes ([`Slot::rw_result`]):
//! - a short transfer continues where it stopped; a read that meets the end of the file
//!   fills the rest with zeroes (QEMU's `qemu_laio_process_completion` does the same), a
//!   write that makes no progress is EIO;
//! - more than `IOV_MAX` iovecs go `IOV_MAX` at a time;
//! - with O_DIRECT and buffers the file cannot take, each piece goes through a bounce
//!   buffer of [`BOUNCE_CHUNK`] bytes from the engine's bounded pool; a slot that finds
//!   every buffer lent out waits, in order, for one to come back ([`Slots::finish`]).
//!
//! Each engine keeps what is its own: how a piece is described to the kernel (an SQE, an
//! iocb), what the kernel cannot do asynchronously, and how completions are signalled.

use std::collections::VecDeque;
use std::io;

use crate::bounce::{gather, scatter, zero_from, AlignedBuf, BouncePool, BOUNCE_CHUNK, IOV_MAX};
use crate::engine::{check_range, errno, iov_slice, iov_total, CompletionRing, Dir, Op};
use crate::sysio::{SyncIo, ZeroStage};

/// Consecutive EAGAIN completions of one piece before it is failed with EIO.
pub(crate) const MAX_RETRIES: u32 = 10_000;

/// A read or a write in progress.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rw {
    pub dir: Dir,
    pub offset: u64,
    pub iov: *const libc::iovec,
    pub iovcnt: u32,
    pub total: u64,
    pub durable: bool,
    /// Bytes transferred so far.
    pub done: u64,
    /// RWF_DSYNC was refused: make the data durable once all bytes are written.
    pub sync_after: bool,
}

/// What a slot is doing.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Work {
    Idle,
    Rw(Rw),
    Flush,
    Discard {
        offset: u64,
        len: u64,
        durable: bool,
    },
    Zeroes {
        offset: u64,
        len: u64,
        stage: ZeroStage,
        /// Bytes written so far (the Write stage).
        done: u64,
        durable: bool,
    },
    /// A durable discard or write-zeroes whose work is done: an fdatasync completes it.
    SyncThen,
    /// Handed whole to a helper thread (work the kernel interface cannot do
    /// asynchronously); completes with `ok` bytes on success.
    Offloaded {
        ok: u64,
    },
}

/// The state of one operation in flight.
pub(crate) struct Slot {
    pub token: u64,
    pub work: Work,
    /// Consecutive EAGAIN answers to the current piece.
    pub retries: u32,
    /// The bounce buffer, while O_DIRECT needs one.
    pub bounce: Option<AlignedBuf>,
    /// The single iovec a piece points to when it cannot point into the caller's array
    /// (the bounce buffer, or the rest of a partly transferred iovec). The kernel may read
    /// it until the piece is submitted (io_uring: until it completes), so it must not move:
    /// slots live in a boxed slice that is never resized.
    pub biov: libc::iovec,
}

/// What a read or write does next.
pub(crate) enum Piece {
    /// Transfer `cnt` iovecs at `iov` at byte `at` of the disk.
    Io {
        dir: Dir,
        at: u64,
        iov: *const libc::iovec,
        cnt: u32,
        /// Ask for RWF_DSYNC.
        dsync: bool,
    },
    /// Wait for a bounce buffer.
    Wait,
    /// Every byte is transferred; `sync_after`: it still has to be made durable.
    Finished { total: u64, sync_after: bool },
}

/// Checks `op` and turns it into a slot's work, for a disk of `size` bytes.
///
/// # Safety
/// The [`Engine::push`](crate::Engine::push) contract holds for `op`.
pub(crate) unsafe fn plan(io: &SyncIo, op: Op) -> io::Result<Work> {
    let size = io.backend.size();
    Ok(match op {
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
            // SAFETY: the push contract keeps the iovec array valid.
            let total = iov_total(unsafe { iov_slice(iov, iovcnt) }?)?;
            check_range(offset, total, size)?;
            usize::try_from(total).map_err(|_| errno(libc::EINVAL))?;
            let (dir, durable) = match op {
                Op::Write { durable, .. } => (Dir::Write, durable),
                _ => (Dir::Read, false),
            };
            Work::Rw(Rw {
                dir,
                offset,
                iov,
                iovcnt,
                total,
                durable,
                done: 0,
                sync_after: false,
            })
        }
        Op::Flush => Work::Flush,
        Op::Discard {
            offset,
            len,
            durable,
        } => {
            check_range(offset, len, size)?;
            Work::Discard {
                offset,
                len,
                durable,
            }
        }
        Op::WriteZeroes {
            offset,
            len,
            unmap,
            durable,
        } => {
            check_range(offset, len, size)?;
            Work::Zeroes {
                offset,
                len,
                stage: ZeroStage::first(&io.backend.caps, unmap),
                done: 0,
                durable,
            }
        }
    })
}

impl Work {
    /// What a durable discard or write-zeroes does once its own work succeeded: make it
    /// durable. None for everything else.
    pub(crate) fn then_sync(&self) -> Option<Work> {
        match self {
            Work::Discard { durable: true, .. } | Work::Zeroes { durable: true, .. } => {
                Some(Work::SyncThen)
            }
            _ => None,
        }
    }
}

impl Slot {
    fn new() -> Slot {
        Slot {
            token: 0,
            work: Work::Idle,
            retries: 0,
            bounce: None,
            biov: libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
        }
    }

    /// The next piece of this slot's read or write (its work must be [`Work::Rw`]).
    pub(crate) fn rw_piece(&mut self, io: &mut SyncIo) -> io::Result<Piece> {
        let Work::Rw(rw) = self.work else {
            return Err(errno(libc::EINVAL));
        };
        if rw.done >= rw.total {
            return Ok(Piece::Finished {
                total: rw.total,
                sync_after: rw.sync_after,
            });
        }
        // SAFETY: checked in `plan`; the push contract keeps it valid.
        let user = unsafe { iov_slice(rw.iov, rw.iovcnt) }?;
        let (ptr, cnt) = match io.dio {
            Some(dio) if !dio.fits(user) => {
                if self.bounce.is_none() {
                    match io.bounce.take() {
                        Some(buf) => self.bounce = Some(buf),
                        None => return Ok(Piece::Wait),
                    }
                }
                let Some(buf) = self.bounce.as_ref() else {
                    return Ok(Piece::Wait);
                };
                // plan() checked that total fits in usize.
                let n = ((rw.total - rw.done) as usize).min(BOUNCE_CHUNK);
                if rw.dir == Dir::Write {
                    // SAFETY: the caller's buffers are readable for `total` bytes and
                    // done + n <= total; the bounce holds BOUNCE_CHUNK >= n.
                    unsafe { gather(user, rw.done as usize, n, buf.as_mut_ptr()) };
                }
                self.biov = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: n,
                };
                (&self.biov as *const libc::iovec, 1)
            }
            _ => {
                let (i, skip) = locate(user, rw.done);
                if skip > 0 {
                    let v = user[i];
                    // SAFETY: skip < iov_len, so the pointer stays in the buffer.
                    let base = unsafe { v.iov_base.cast::<u8>().add(skip) };
                    self.biov = libc::iovec {
                        iov_base: base.cast(),
                        iov_len: v.iov_len - skip,
                    };
                    (&self.biov as *const libc::iovec, 1)
                } else {
                    (
                        &user[i] as *const libc::iovec,
                        (user.len() - i).min(IOV_MAX),
                    )
                }
            }
        };
        Ok(Piece::Io {
            dir: rw.dir,
            at: rw.offset + rw.done,
            iov: ptr,
            cnt: cnt as u32,
            dsync: rw.durable,
        })
    }

    /// The current piece of this slot's read or write ended with `res` (bytes, or
    /// -errno; not EAGAIN/EINTR, which the engine retries). None: go on with the next
    /// piece; Some: the operation is finished with this result.
    pub(crate) fn rw_result(&mut self, res: i64) -> Option<io::Result<u64>> {
        let Work::Rw(rw) = &mut self.work else {
            return Some(Err(errno(libc::EIO)));
        };
        if res < 0 {
            let code = i32::try_from(-res).unwrap_or(libc::EIO);
            if code == libc::EOPNOTSUPP && rw.durable {
                // No RWF_DSYNC here: write plainly, make it durable at the end.
                rw.durable = false;
                rw.sync_after = true;
                return None;
            }
            return Some(Err(errno(code)));
        }
        if res == 0 && rw.dir == Dir::Write {
            return Some(Err(errno(libc::EIO)));
        }
        // SAFETY: checked at push; the push contract keeps the caller's iovecs valid and
        // their buffers writable for a read.
        let user = match unsafe { iov_slice(rw.iov, rw.iovcnt) } {
            Ok(user) => user,
            Err(e) => return Some(Err(e)),
        };
        if res == 0 {
            // End of file: the rest reads as zeroes.
            // SAFETY: as above; done < total fits in usize.
            unsafe { zero_from(user, rw.done as usize) };
            rw.done = rw.total;
            return None;
        }
        let n = (res as u64).min(rw.total - rw.done);
        if let (Dir::Read, Some(buf)) = (rw.dir, &self.bounce) {
            // SAFETY: the bounce holds the `n` bytes just read; the caller's buffers are
            // writable (a read) for done + n <= total.
            unsafe { scatter(buf.as_mut_ptr(), n as usize, user, rw.done as usize) };
        }
        rw.done += n;
        None
    }

    /// Counts one more EAGAIN for the current piece; false once it has had too many.
    pub(crate) fn retry(&mut self) -> bool {
        self.retries += 1;
        self.retries <= MAX_RETRIES
    }
}

/// The iovec holding byte `pos` of `iov`, and how far into it.
pub(crate) fn locate(iov: &[libc::iovec], mut pos: u64) -> (usize, usize) {
    for (i, v) in iov.iter().enumerate() {
        let len = v.iov_len as u64;
        if pos < len {
            return (i, pos as usize);
        }
        pos -= len;
    }
    (iov.len(), 0)
}

/// An engine's slots: one per operation it may hold, a free list, the finished
/// operations not yet reaped, and the slots waiting for a bounce buffer.
pub(crate) struct Slots {
    slots: Box<[Slot]>,
    free: Vec<u32>,
    /// Finished operations not yet reaped.
    pub ready: CompletionRing,
    /// Slots waiting for a bounce buffer, oldest first.
    waiting: VecDeque<u32>,
}

impl Slots {
    /// `depth` slots (at most [`MAX_DEPTH`](crate::MAX_DEPTH), so indexes fit in u32).
    pub(crate) fn new(depth: usize) -> Slots {
        Slots {
            slots: (0..depth).map(|_| Slot::new()).collect(),
            free: (0..depth as u32).rev().collect(),
            ready: CompletionRing::new(depth),
            waiting: VecDeque::with_capacity(depth),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Slot `idx`, if it exists and holds an operation.
    pub(crate) fn busy(&mut self, idx: usize) -> Option<&mut Slot> {
        self.slots
            .get_mut(idx)
            .filter(|s| !matches!(s.work, Work::Idle))
    }

    pub(crate) fn get_mut(&mut self, idx: usize) -> &mut Slot {
        &mut self.slots[idx]
    }

    /// Takes a free slot for `token`; None when all are busy.
    pub(crate) fn start(&mut self, token: u64, work: Work) -> Option<usize> {
        let idx = self.free.pop()? as usize;
        let slot = &mut self.slots[idx];
        slot.token = token;
        slot.work = work;
        slot.retries = 0;
        Some(idx)
    }

    /// Plans `op` (see [`plan`]) and gives it a slot: the slot to advance, or None when the
    /// operation was answered at once (a bad request, or no free slot, which the caller's
    /// in-flight count rules out) and its completion is already in `ready`.
    ///
    /// # Safety
    /// The [`Engine::push`](crate::Engine::push) contract holds for `op`.
    pub(crate) unsafe fn plan_and_start(
        &mut self,
        io: &SyncIo,
        token: u64,
        op: Op,
    ) -> Option<usize> {
        // SAFETY: the caller's push contract, forwarded.
        match unsafe { plan(io, op) } {
            Ok(work) => match self.start(token, work) {
                Some(idx) => Some(idx),
                None => {
                    self.ready.push(token, Err(errno(libc::EAGAIN)));
                    None
                }
            },
            Err(e) => {
                self.ready.push(token, Err(e));
                None
            }
        }
    }

    /// Slot `idx` waits for a bounce buffer.
    pub(crate) fn wait_for_bounce(&mut self, idx: usize) {
        // idx < depth <= MAX_DEPTH fits in u32.
        self.waiting.push_back(idx as u32);
    }

    /// Slot `idx` is done: hand its completion over and free it. Its bounce buffer goes
    /// back to `pool`; returns the waiting slot that should now try again, if any.
    pub(crate) fn finish(
        &mut self,
        idx: usize,
        result: io::Result<u64>,
        pool: &mut BouncePool,
    ) -> Option<usize> {
        let slot = &mut self.slots[idx];
        let token = slot.token;
        slot.work = Work::Idle;
        slot.retries = 0;
        let freed = slot.bounce.take();
        // idx < depth <= MAX_DEPTH fits in u32.
        self.free.push(idx as u32);
        self.ready.push(token, result);
        let buf = freed?;
        pool.give(buf);
        self.waiting.pop_front().map(|i| i as usize)
    }
}
