//! The engine contract ([`Engine`], [`Op`], [`Completion`]) and the pieces every
//! engine shares: the completion ring, iovec checks, the depth limit.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::str::FromStr;

use crate::error::Error;

/// The largest `depth` an engine accepts (io_uring's limit on SQ entries).
pub const MAX_DEPTH: u32 = 32768;

/// Which engine serves a file or block device. RAM and null disks are always
/// served inline, whatever is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// One io_uring per engine; completions signalled on an eventfd.
    #[default]
    IoUring,
    /// Linux AIO (`io_submit`/`io_getevents`), O_DIRECT only (`cache=none`), as QEMU's
    /// `aio=native`; completions signalled on an eventfd.
    Aio,
    /// A pool of threads per engine doing `preadv2`/`pwritev2`, as QEMU's `aio=threads`;
    /// completions signalled on an eventfd.
    Threads,
    /// `preadv2`/`pwritev2` on the calling thread, inside `submit`.
    Sync,
}

impl EngineKind {
    /// Every engine, in the order the help texts list them.
    pub const ALL: [EngineKind; 4] = [
        EngineKind::IoUring,
        EngineKind::Aio,
        EngineKind::Threads,
        EngineKind::Sync,
    ];
}

impl FromStr for EngineKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "io_uring" | "io-uring" => Ok(EngineKind::IoUring),
            "aio" | "native" => Ok(EngineKind::Aio),
            "threads" => Ok(EngineKind::Threads),
            "sync" => Ok(EngineKind::Sync),
            _ => Err(Error::BadEngineKind {
                input: s.to_owned(),
            }),
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineKind::IoUring => "io_uring",
            EngineKind::Aio => "aio",
            EngineKind::Threads => "threads",
            EngineKind::Sync => "sync",
        })
    }
}

/// One operation. Offsets and lengths are in bytes; the caller has already
/// checked them against [`Backend::size`](crate::Backend::size) and 512-byte
/// alignment (engines check bounds again and answer `EINVAL`). `iov` points to
/// `iovcnt` iovecs.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// Read into the buffers.
    Read {
        /// Byte offset on the disk.
        offset: u64,
        /// The buffers to fill.
        iov: *const libc::iovec,
        /// How many iovecs `iov` points to.
        iovcnt: u32,
    },
    /// Write the buffers.
    Write {
        /// Byte offset on the disk.
        offset: u64,
        /// The data.
        iov: *const libc::iovec,
        /// How many iovecs `iov` points to.
        iovcnt: u32,
        /// Write-through: complete only when the data is durable (`RWF_DSYNC`).
        durable: bool,
    },
    /// Make every completed write durable (`fdatasync`).
    Flush,
    /// Deallocate a range (hole punch / `BLKDISCARD`). A hint: "not supported"
    /// is reported as success.
    Discard {
        /// Byte offset on the disk.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Write-through: complete only when the deallocation is durable (a
        /// `fdatasync` after it; FUA or a FLUSH on NBD).
        durable: bool,
    },
    /// Make a range read as zeroes. `unmap` allows deallocating it; without it
    /// the blocks stay allocated. Falls back to writing zeroes.
    WriteZeroes {
        /// Byte offset on the disk.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Whether the range may be deallocated.
        unmap: bool,
        /// Write-through: complete only when the zeroes are durable (a `fdatasync`
        /// after them; FUA or a FLUSH on NBD).
        durable: bool,
    },
}

// SAFETY: an `Op` is plain data; the buffers its pointers name are lent to the
// engine under the contract of `Engine::push`, which makes the pusher guarantee
// their validity and exclusivity until completion, whichever thread does the I/O.
unsafe impl Send for Op {}

/// A finished operation.
#[derive(Debug)]
pub struct Completion {
    /// The token given to [`Engine::push`].
    pub token: u64,
    /// Bytes transferred (0 for non-data operations), or the errno.
    pub result: io::Result<u64>,
}

/// [`Engine::push`] refused: `depth` operations are already queued or in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

impl fmt::Display for Full {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("engine full: depth operations already in flight")
    }
}

impl std::error::Error for Full {}

/// An I/O engine: queue operations, hand them to the kernel in one go, reap
/// completions. One per worker thread; made by
/// [`Backend::engine`](crate::Backend::engine).
pub trait Engine: Send {
    /// A short name for logs and stats: `io_uring`, `aio`, `threads`, `sync` or `inline`.
    fn name(&self) -> &'static str;
    /// Queue `op`; nothing reaches the kernel before `submit`.
    ///
    /// # Safety
    /// The iovec array and every buffer it points to stay valid, and are not read
    /// (for Read) or written (for Write) by anyone else, until the completion
    /// carrying `token` has been reaped, or the engine is dropped (drop waits for
    /// everything in flight; the NBD engine waits at most its timeout, then abandons
    /// what is left and touches none of its buffers after drop returns).
    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full>;
    /// Hand everything pushed since the last call to the kernel, in as few syscalls as the
    /// engine can: one for io_uring, one per 32 operations for aio, none for threads (a
    /// wake-up of idle pool threads) and sync (which does the work here).
    fn submit(&mut self) -> io::Result<()>;
    /// Call `f` for every finished operation, without blocking; returns how many.
    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize;
    /// Block until at least one operation finishes (or none is in flight).
    fn wait(&mut self) -> io::Result<()>;
    /// Readable when completions are waiting (io_uring's registered eventfd); None
    /// when every operation is finished by the time `submit` returns (sync, mem,
    /// null). The engine drains it in `reap`; it is non-blocking.
    fn notify_fd(&self) -> Option<RawFd>;
    /// Whether its operations are done in memory within `push` (a RAM or null disk), so
    /// that the time from taking a request to completing it is not worth a clock read.
    fn completes_in_memory(&self) -> bool {
        false
    }
    /// Operations pushed and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Operations queued that the kernel has not accepted yet (it answered EAGAIN or
    /// EBUSY, or took part of a batch). The caller must call `submit` again soon — it
    /// cannot count on a completion to wake it while this is not zero.
    fn backlog(&self) -> usize {
        0
    }
}

/// Checks an engine depth and returns it as a count.
pub(crate) fn check_depth(depth: u32) -> Result<usize, Error> {
    if depth == 0 || depth > MAX_DEPTH {
        return Err(Error::Depth {
            depth,
            max: MAX_DEPTH,
        });
    }
    // A u32 up to MAX_DEPTH always fits in usize.
    Ok(depth as usize)
}

/// Finished operations waiting to be reaped. Its capacity is the engine depth,
/// which bounds the number of operations pushed and not reaped, so pushing never
/// allocates.
pub(crate) struct CompletionRing {
    q: VecDeque<Completion>,
}

impl CompletionRing {
    pub(crate) fn new(depth: usize) -> Self {
        CompletionRing {
            q: VecDeque::with_capacity(depth),
        }
    }

    pub(crate) fn push(&mut self, token: u64, result: io::Result<u64>) {
        debug_assert!(
            self.q.len() < self.q.capacity(),
            "completion ring over depth"
        );
        self.q.push_back(Completion { token, result });
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.q.len()
    }

    /// Hands every waiting completion to `f`; returns how many.
    pub(crate) fn drain(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        let mut n = 0;
        while let Some(c) = self.q.pop_front() {
            f(c);
            n += 1;
        }
        n
    }
}

/// An errno as an `io::Error` (no allocation).
pub(crate) fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Views `iovcnt` iovecs at `iov` as a slice.
///
/// # Safety
/// When `iovcnt > 0` and `iov` is not null, `iov` points to `iovcnt` initialised
/// iovecs that stay valid and unchanged for `'a` (the [`Engine::push`] contract).
pub(crate) unsafe fn iov_slice<'a>(
    iov: *const libc::iovec,
    iovcnt: u32,
) -> io::Result<&'a [libc::iovec]> {
    if iovcnt == 0 {
        return Ok(&[]);
    }
    if iov.is_null() {
        return Err(errno(libc::EINVAL));
    }
    // SAFETY: non-null and, by this function's contract, valid for `iovcnt`
    // elements for 'a; u32 -> usize is lossless on Linux targets.
    Ok(unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) })
}

/// The total length of `iov`; `EINVAL` if it overflows.
pub(crate) fn iov_total(iov: &[libc::iovec]) -> io::Result<u64> {
    iov.iter()
        .try_fold(0u64, |sum, v| sum.checked_add(v.iov_len as u64))
        .ok_or_else(|| errno(libc::EINVAL))
}

/// Checks that `offset .. offset + len` lies inside a disk of `size` bytes.
pub(crate) fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(errno(libc::EINVAL)),
    }
}

/// A read or a write, once its iovecs have been checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    Read,
    Write,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_kind_parses_and_prints() {
        assert_eq!(
            "io_uring".parse::<EngineKind>().unwrap(),
            EngineKind::IoUring
        );
        assert_eq!("sync".parse::<EngineKind>().unwrap(), EngineKind::Sync);
        assert_eq!(EngineKind::IoUring.to_string(), "io_uring");
        assert_eq!(EngineKind::Sync.to_string(), "sync");
        for kind in EngineKind::ALL {
            assert_eq!(kind.to_string().parse::<EngineKind>().unwrap(), kind);
        }
        assert_eq!("native".parse::<EngineKind>().unwrap(), EngineKind::Aio);
        assert_eq!(
            "libaio".parse::<EngineKind>().unwrap_err().to_string(),
            "unknown engine \"libaio\" (expected io_uring, aio, threads or sync)"
        );
    }

    #[test]
    fn depth_limits() {
        assert!(check_depth(0).is_err());
        assert_eq!(check_depth(1).unwrap(), 1);
        assert_eq!(check_depth(MAX_DEPTH).unwrap(), MAX_DEPTH as usize);
        assert_eq!(
            check_depth(MAX_DEPTH + 1).unwrap_err().to_string(),
            "engine depth 32769 is out of range 1..=32768"
        );
    }

    #[test]
    fn ranges() {
        assert!(check_range(0, 512, 512).is_ok());
        assert!(check_range(512, 512, 512).is_err());
        assert!(check_range(u64::MAX, 512, u64::MAX).is_err());
    }

    #[test]
    fn iov_totals() {
        let v = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: usize::MAX,
        }; 2];
        assert!(iov_total(&v).is_err());
        // SAFETY: iovcnt is 0, so the pointer is not read.
        assert!(unsafe { iov_slice(std::ptr::null(), 0) }
            .unwrap()
            .is_empty());
        // SAFETY: the pointer is null, which iov_slice rejects without reading.
        assert!(unsafe { iov_slice(std::ptr::null(), 1) }.is_err());
    }
}
