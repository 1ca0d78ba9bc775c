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

/// Lines of the next operation's range of the RAM disk asked for ahead of its copy: one
/// or two did as well as each other, and better than four or more (they take the line
/// fill buffers the running copy needs).
const PREFETCH_LINES: usize = 2;

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

    /// Start bringing in what `op` will copy first, while the operation before it copies:
    /// the first lines of its range of the RAM disk and of its first buffer, each in the
    /// state the copy wants (written lines owned). A random 4 KiB read of a large RAM
    /// disk misses the TLB as well as the cache; a prefetch walks the page tables, so the
    /// next copy starts on a translated page (docs/design-notes.md, "The RAM disk's
    /// copies prefetch the next one's first lines").
    ///
    /// # Safety
    /// The [`Engine::push`] contract holds for `op`.
    unsafe fn prefetch(&self, op: Op) {
        let (offset, iov, iovcnt, read) = match op {
            Op::Read {
                offset,
                iov,
                iovcnt,
            } => (offset, iov, iovcnt, true),
            Op::Write {
                offset,
                iov,
                iovcnt,
                ..
            } => (offset, iov, iovcnt, false),
            _ => return,
        };
        if self.base.is_null() || offset >= self.backend.size() {
            return;
        }
        let disk = self.base.wrapping_add(offset as usize);
        // SAFETY: the push contract keeps the iovec array valid.
        let first = unsafe { iov_slice(iov, iovcnt) }
            .ok()
            .and_then(|v| v.first())
            .map(|v| v.iov_base.cast::<u8>());
        for line in 0..PREFETCH_LINES {
            prefetch(disk.wrapping_add(line * 64), !read);
        }
        if let Some(buf) = first {
            prefetch(buf, read);
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
            if let Some(&(_, next)) = self.queued.front() {
                // SAFETY: `next` was pushed under the push contract.
                unsafe { self.prefetch(next) };
            }
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

/// A hint to bring the cache line at `p` in (owned if `write`); never faults, whatever `p`
/// is, so an address past the disk's end (an operation that `run` will refuse) is harmless.
#[inline(always)]
fn prefetch(p: *const u8, write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 and PREFETCHW are hints: they do not fault on any address and
    // change no register, flag or memory. PREFETCHW is written as an instruction because
    // `_mm_prefetch(_MM_HINT_ET0)` compiles to a read prefetch without the `prfchw`
    // target feature; CPUs before Broadwell execute its encoding as a no-op.
    unsafe {
        if write {
            std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        } else {
            std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, write);
}
