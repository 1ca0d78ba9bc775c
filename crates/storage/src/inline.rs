//! The inline engine for RAM and null disks: every operation is done inside
//! `submit` (memcpy/memset on the shared mapping, or nothing), so completions are
//! ready at once and there is no notify fd.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::backend::Backend;
use crate::engine::{
    check_range, errno, iov_slice, iov_total, Completion, CompletionRing, Engine, Full, Op,
};
use crate::sysio::{fallocate, PUNCH_HOLE};

/// Serves [`BackendKind::Mem`](crate::BackendKind::Mem) and
/// [`BackendKind::Null`](crate::BackendKind::Null) backends, and moves the data of
/// [`BackendKind::Hdd`](crate::BackendKind::Hdd) ones.
pub(crate) struct InlineEngine {
    backend: Arc<Backend>,
    /// Start of the RAM disk's mapping; null for a null disk.
    base: *mut u8,
    queued: VecDeque<(u64, Op)>,
    done: CompletionRing,
    depth: usize,
}

// SAFETY: `base` points into the Backend's shared mapping, which the Arc keeps
// alive and which is only accessed through raw-pointer copies; the queued Ops carry
// pointers lent under the `Engine::push` contract, valid from any thread.
unsafe impl Send for InlineEngine {}

impl InlineEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: usize) -> Self {
        // RAM-backed disks (mem, hdd) have a mapping; a null disk has none.
        let base = backend.map().map_or(std::ptr::null_mut(), |m| m.as_ptr());
        InlineEngine {
            backend,
            base,
            queued: VecDeque::with_capacity(depth),
            done: CompletionRing::new(depth),
            depth,
        }
    }

    /// Does one operation.
    ///
    /// # Safety
    /// The [`Engine::push`] contract holds for `op`.
    unsafe fn run(&self, op: Op) -> io::Result<u64> {
        let size = self.backend.size();
        let writes = matches!(
            op,
            Op::Write { .. } | Op::Discard { .. } | Op::WriteZeroes { .. }
        );
        if writes && self.backend.read_only() {
            return Err(errno(libc::EBADF));
        }
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
                // SAFETY: the push contract keeps the iovec array valid.
                let iov = unsafe { iov_slice(iov, iovcnt) }?;
                let total = iov_total(iov)?;
                check_range(offset, total, size)?;
                let is_read = matches!(op, Op::Read { .. });
                let mut at = offset as usize; // offset + total <= size, which fits in usize.
                for v in iov {
                    if self.base.is_null() {
                        if is_read {
                            // SAFETY: the buffer is writable for iov_len bytes (push contract).
                            unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
                        }
                    } else if is_read {
                        // SAFETY: `at + iov_len <= size` = the mapping's length; the
                        // buffer is writable and is caller memory, not the mapping.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                self.base.add(at),
                                v.iov_base.cast(),
                                v.iov_len,
                            )
                        };
                    } else {
                        // SAFETY: as above; the mapping is writable (not read-only).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                v.iov_base.cast::<u8>(),
                                self.base.add(at),
                                v.iov_len,
                            )
                        };
                    }
                    at += v.iov_len;
                }
                Ok(total)
            }
            Op::Flush => Ok(0),
            // Durability is moot for RAM; a null disk keeps nothing.
            Op::Discard { offset, len, .. } => {
                check_range(offset, len, size)?;
                if !self.base.is_null() {
                    // A hint: a memfd that cannot punch holes just keeps the bytes.
                    let _ = fallocate(self.backend.fd(), PUNCH_HOLE, offset, len);
                }
                Ok(0)
            }
            Op::WriteZeroes {
                offset, len, unmap, ..
            } => {
                check_range(offset, len, size)?;
                if self.base.is_null() {
                    return Ok(0);
                }
                if unmap && fallocate(self.backend.fd(), PUNCH_HOLE, offset, len).is_ok() {
                    return Ok(0);
                }
                // SAFETY: the range is inside the writable mapping (checked above).
                unsafe { std::ptr::write_bytes(self.base.add(offset as usize), 0, len as usize) };
                Ok(0)
            }
        }
    }
}

impl Engine for InlineEngine {
    fn name(&self) -> &'static str {
        "inline"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight() >= self.depth {
            return Err(Full);
        }
        self.queued.push_back((token, op));
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        while let Some((token, op)) = self.queued.pop_front() {
            // SAFETY: `op` was pushed under the push contract, which lasts until
            // its completion is reaped.
            let result = unsafe { self.run(op) };
            self.done.push(token, result);
        }
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        self.done.drain(f)
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.done.is_empty() {
            self.submit()?;
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        None
    }

    fn completes_in_memory(&self) -> bool {
        true
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.done.len()
    }
}
