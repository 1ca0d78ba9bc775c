//! What a caller hands a [`Queue`](crate::Queue) and gets back: an [`Io`] (operation,
//! range, buffers, token, flags), a [`Completion`] per I/O, a [`SubmitError`] when an I/O
//! is refused before anything reached the device.

use crate::error::Error;
use crate::mem::Buffer;
use crate::ErrorKind;

/// Buffers that travel with an I/O and come back with its completion.
#[derive(Debug, Default)]
pub enum Bufs {
    /// No payload (flush, discard, write-zeroes).
    #[default]
    None,
    /// One buffer (read, write).
    One(Buffer),
    /// Several buffers (readv, writev).
    Many(Vec<Buffer>),
}

impl Bufs {
    /// The single buffer, if there is exactly one.
    pub fn into_one(self) -> Option<Buffer> {
        match self {
            Bufs::One(b) => Some(b),
            Bufs::Many(mut v) if v.len() == 1 => v.pop(),
            _ => None,
        }
    }

    /// All buffers, in order.
    pub fn into_vec(self) -> Vec<Buffer> {
        match self {
            Bufs::None => Vec::new(),
            Bufs::One(b) => vec![b],
            Bufs::Many(v) => v,
        }
    }

    /// How many buffers.
    pub fn count(&self) -> usize {
        match self {
            Bufs::None => 0,
            Bufs::One(_) => 1,
            Bufs::Many(v) => v.len(),
        }
    }

    /// Buffer `i`.
    pub fn get(&self, i: usize) -> Option<&Buffer> {
        match self {
            Bufs::None => None,
            Bufs::One(b) => (i == 0).then_some(b),
            Bufs::Many(v) => v.get(i),
        }
    }

    /// Bytes in all buffers.
    pub fn total_len(&self) -> u64 {
        match self {
            Bufs::None => 0,
            Bufs::One(b) => b.len() as u64,
            Bufs::Many(v) => v.iter().map(|b| b.len() as u64).sum(),
        }
    }

    /// Pieces of at most `size_max` bytes the buffers make (descriptors they need).
    pub(crate) fn pieces(&self, size_max: u64) -> u64 {
        match self {
            Bufs::None => 0,
            Bufs::One(b) => (b.len() as u64).div_ceil(size_max),
            Bufs::Many(v) => v.iter().map(|b| (b.len() as u64).div_ceil(size_max)).sum(),
        }
    }
}

/// A finished I/O.
#[derive(Debug)]
pub struct Completion {
    /// The caller's token.
    pub token: u64,
    /// Success, or why not.
    pub result: Result<(), ErrorKind>,
    /// The buffers the I/O was given.
    pub bufs: Bufs,
}

/// A submission refused before anything was sent; the buffers come back.
#[derive(Debug)]
pub struct SubmitError {
    /// Why.
    pub error: Error,
    /// The buffers that were passed in.
    pub bufs: Bufs,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SubmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The operation of an [`Io`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Read into the buffers.
    Read,
    /// Write the buffers.
    Write,
    /// Make every completed write durable.
    Flush,
    /// Discard a range (a hint: it may read back as zeroes or not).
    Discard,
    /// Make a range read as zeroes; `unmap` lets the device deallocate.
    WriteZeroes {
        /// The device may deallocate the range.
        unmap: bool,
    },
}

impl Op {
    /// The operation changes the disk's contents.
    pub fn is_write(self) -> bool {
        !matches!(self, Op::Read | Op::Flush)
    }
}

/// One I/O as the caller describes it. Built with [`Io::read`], [`Io::write`], ...; flags
/// added with [`Io::fua`] and [`Io::flow`]; submitted with
/// [`Queue::submit`](crate::Queue::submit).
#[derive(Debug)]
pub struct Io {
    pub(crate) op: Op,
    pub(crate) offset: u64,
    /// Bytes of a range operation (discard, write-zeroes); data operations use their
    /// buffers' length.
    pub(crate) len: u64,
    pub(crate) bufs: Bufs,
    pub(crate) token: u64,
    pub(crate) fua: bool,
    pub(crate) flow: u16,
}

impl Io {
    fn new(op: Op, offset: u64, len: u64, bufs: Bufs, token: u64) -> Io {
        Io {
            op,
            offset,
            len,
            bufs,
            token,
            fua: false,
            flow: 0,
        }
    }

    /// Read `buf.len()` bytes at `offset` into `buf`.
    pub fn read(offset: u64, buf: Buffer, token: u64) -> Io {
        Io::new(Op::Read, offset, 0, Bufs::One(buf), token)
    }

    /// Write `buf` at `offset`.
    pub fn write(offset: u64, buf: Buffer, token: u64) -> Io {
        Io::new(Op::Write, offset, 0, Bufs::One(buf), token)
    }

    /// Read into several buffers, in order, from `offset`.
    pub fn readv(offset: u64, bufs: Vec<Buffer>, token: u64) -> Io {
        Io::new(Op::Read, offset, 0, Bufs::Many(bufs), token)
    }

    /// Write several buffers, in order, at `offset`.
    pub fn writev(offset: u64, bufs: Vec<Buffer>, token: u64) -> Io {
        Io::new(Op::Write, offset, 0, Bufs::Many(bufs), token)
    }

    /// Make every completed write durable.
    pub fn flush(token: u64) -> Io {
        Io::new(Op::Flush, 0, 0, Bufs::None, token)
    }

    /// Discard `len` bytes at `offset`.
    pub fn discard(offset: u64, len: u64, token: u64) -> Io {
        Io::new(Op::Discard, offset, len, Bufs::None, token)
    }

    /// Make `len` bytes at `offset` read as zeroes; `unmap` lets the device deallocate.
    pub fn write_zeroes(offset: u64, len: u64, unmap: bool, token: u64) -> Io {
        Io::new(Op::WriteZeroes { unmap }, offset, len, Bufs::None, token)
    }

    /// Force Unit Access: the write completes only once it is durable. With a volatile
    /// write cache (writeback) the driver emulates it with a flush after the write (virtio
    /// has no FUA bit); with writethrough it is a plain write. Ignored on reads.
    pub fn fua(mut self) -> Io {
        self.fua = true;
        self
    }

    /// The submitter this I/O belongs to, for the proportional-share elevator (`bfq`):
    /// flows share the device by the weights set with
    /// [`Queue::set_flow_weight`](crate::Queue::set_flow_weight). Flow 0 is the default.
    pub fn flow(mut self, flow: u16) -> Io {
        self.flow = flow;
        self
    }

    /// The operation.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Give the buffers back (for a caller that built an I/O and will not submit it).
    pub fn into_bufs(self) -> Bufs {
        self.bufs
    }
}
