//! O_DIRECT alignment: what a file needs ([`DioAlign`], from `statx`'s
//! `STATX_DIOALIGN` or the logical block size), and the aligned bounce buffers
//! that carry an operation whose buffers do not meet it.

use std::alloc::{self, Layout};
use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;

use crate::engine::errno;

/// The most iovecs one `preadv`/`pwritev`/`IORING_OP_READV` takes.
pub(crate) const IOV_MAX: usize = libc::UIO_MAXIOV as usize;

/// What O_DIRECT demands of an operation on one file. Both are powers of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DioAlign {
    /// Alignment of each buffer's address.
    pub mem: u32,
    /// Alignment of the file offset and of each buffer's length: the logical
    /// block size.
    pub offset: u32,
}

impl DioAlign {
    /// Whether `iov` can go to the kernel as it is. Conservative: it asks every
    /// segment's length to be a multiple of the logical block size, as kernels
    /// before 6.0 did.
    pub(crate) fn fits(&self, iov: &[libc::iovec]) -> bool {
        let mem_mask = self.mem as usize - 1;
        let len_mask = self.offset as usize - 1;
        iov.len() <= IOV_MAX
            && iov
                .iter()
                .all(|v| (v.iov_base as usize) & mem_mask == 0 && v.iov_len & len_mask == 0)
    }
}

/// What `statx(STATX_DIOALIGN)` says about an open file.
pub(crate) enum DioProbe {
    /// The kernel reports the alignment (`stx_dio_mem_align`, `stx_dio_offset_align`).
    Reported { mem: u32, offset: u32 },
    /// The kernel reports that this file has no O_DIRECT.
    Unsupported,
    /// The kernel (or file system) does not say.
    Unknown,
}

/// Asks the kernel what O_DIRECT needs on `fd` (Linux 6.1+ for files, 6.11+ for
/// block devices).
pub(crate) fn probe_dio(fd: RawFd) -> DioProbe {
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is an open descriptor, the path is an empty NUL-terminated string
    // used with AT_EMPTY_PATH, and `stx` is a valid out-parameter for the call.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return DioProbe::Unknown;
    }
    if stx.stx_dio_offset_align == 0 {
        return DioProbe::Unsupported;
    }
    DioProbe::Reported {
        mem: stx.stx_dio_mem_align.max(1),
        offset: stx.stx_dio_offset_align,
    }
}

/// A heap buffer with a chosen alignment, zero-filled when made.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation; nothing else points into it except I/O
// the owning engine waits for before it drops or reuses the buffer.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes (at least 1) aligned to `align` (a power of two).
    /// `ENOMEM` when the allocator refuses, `EINVAL` for a bad alignment.
    pub(crate) fn new(len: usize, align: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| errno(libc::EINVAL))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| errno(libc::ENOMEM))?;
        Ok(AlignedBuf { ptr, layout })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is
        // freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Size of one bounce buffer: an unaligned operation larger than this is carried in
/// pieces of this size.
pub(crate) const BOUNCE_CHUNK: usize = 1 << 20;

/// Most bounce buffers one engine holds: at most `BOUNCE_BUDGET * BOUNCE_CHUNK` bytes
/// (16 MiB) per worker, whatever the guest sends. An operation that needs one when all
/// are lent out waits until one comes back.
pub(crate) const BOUNCE_BUDGET: usize = 16;

/// An engine's bounce buffers: at most [`BOUNCE_BUDGET`] of [`BOUNCE_CHUNK`] bytes,
/// allocated the first time they are needed and reused after.
pub(crate) struct BouncePool {
    free: Vec<AlignedBuf>,
    lent: usize,
    align: usize,
}

impl BouncePool {
    /// A pool aligned for `dio`.
    pub(crate) fn new(dio: DioAlign) -> Self {
        let align = (dio.mem.max(dio.offset) as usize).max(4096);
        BouncePool {
            free: Vec::with_capacity(BOUNCE_BUDGET),
            lent: 0,
            align,
        }
    }

    /// A buffer of [`BOUNCE_CHUNK`] bytes, or None when all are lent out (or the
    /// allocator refused one).
    pub(crate) fn take(&mut self) -> Option<AlignedBuf> {
        if self.lent >= BOUNCE_BUDGET {
            return None;
        }
        let buf = match self.free.pop() {
            Some(buf) => buf,
            None => AlignedBuf::new(BOUNCE_CHUNK, self.align).ok()?,
        };
        self.lent += 1;
        Some(buf)
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give(&mut self, buf: AlignedBuf) {
        self.lent = self.lent.saturating_sub(1);
        self.free.push(buf);
    }
}

/// Copies `len` bytes of the data `iov` describes, starting `pos` bytes in, to `dst`.
///
/// # Safety
/// Every iovec points to `iov_len` readable bytes, `dst` to at least `len` writable
/// bytes, `pos + len` is at most the total length, and the two do not overlap.
pub(crate) unsafe fn gather(iov: &[libc::iovec], pos: usize, len: usize, dst: *mut u8) {
    // SAFETY: forwarded contract; `copy` copies from the iovec side to dst.
    unsafe { copy_iov(iov, pos, len, dst, false) }
}

/// Copies `len` bytes at `src` into the buffers of `iov`, starting `pos` bytes in.
///
/// # Safety
/// `src` points to `len` readable bytes, every iovec to `iov_len` writable bytes,
/// `pos + len` is at most the total length, and they do not overlap.
pub(crate) unsafe fn scatter(src: *const u8, len: usize, iov: &[libc::iovec], pos: usize) {
    // SAFETY: forwarded contract; the copy goes from `src` to the iovec side.
    unsafe { copy_iov(iov, pos, len, src.cast_mut(), true) }
}

/// Zeroes the buffers of `iov` from `pos` bytes in to the end.
///
/// # Safety
/// Every iovec points to `iov_len` writable bytes.
pub(crate) unsafe fn zero_from(iov: &[libc::iovec], mut pos: usize) {
    for v in iov {
        if pos >= v.iov_len {
            pos -= v.iov_len;
            continue;
        }
        // SAFETY: pos < iov_len; writable for iov_len bytes by the contract.
        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>().add(pos), 0, v.iov_len - pos) };
        pos = 0;
    }
}

/// The copy behind [`gather`] (`into_iov` false) and [`scatter`] (true).
///
/// # Safety
/// As for those two.
unsafe fn copy_iov(iov: &[libc::iovec], mut pos: usize, len: usize, flat: *mut u8, into_iov: bool) {
    let mut done = 0usize;
    for v in iov {
        if done == len {
            break;
        }
        if pos >= v.iov_len {
            pos -= v.iov_len;
            continue;
        }
        let n = (v.iov_len - pos).min(len - done);
        // SAFETY: `pos + n <= iov_len`, so the iovec side is in bounds; `done + n <=
        // len`, so the flat side is; the caller promises validity and no overlap.
        unsafe {
            let side = v.iov_base.cast::<u8>().add(pos);
            if into_iov {
                std::ptr::copy_nonoverlapping(flat.add(done), side, n);
            } else {
                std::ptr::copy_nonoverlapping(side, flat.add(done), n);
            }
        }
        done += n;
        pos = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(ptr: *mut u8, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        }
    }

    #[test]
    fn fits_checks_address_and_length() {
        let dio = DioAlign {
            mem: 512,
            offset: 512,
        };
        let buf = AlignedBuf::new(8192, 4096).unwrap();
        let p = buf.as_mut_ptr();
        assert!(dio.fits(&[iov(p, 4096), iov(p, 512)]));
        // SAFETY: the offset stays inside the 8192-byte buffer.
        assert!(!dio.fits(&[iov(unsafe { p.add(1) }, 512)]));
        assert!(!dio.fits(&[iov(p, 513)]));
        let fine = DioAlign {
            mem: 4,
            offset: 512,
        };
        // SAFETY: the offset stays inside the 8192-byte buffer.
        assert!(fine.fits(&[iov(unsafe { p.add(4) }, 1024)]));
        assert!(!fine.fits(&vec![iov(p, 512); IOV_MAX + 1]));
    }

    #[test]
    fn gather_scatter_round_trip() {
        let mut a = vec![1u8; 100];
        let mut b = vec![2u8; 28];
        let v = [iov(a.as_mut_ptr(), 100), iov(b.as_mut_ptr(), 28)];
        let bounce = AlignedBuf::new(128, 4096).unwrap();
        // SAFETY: the iovecs name live vectors; the bounce holds 128 bytes.
        unsafe { gather(&v, 0, 128, bounce.as_mut_ptr()) };
        // SAFETY: the bounce holds 128 initialised bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(bounce.as_mut_ptr(), 128) };
        assert!(s[..100].iter().all(|&x| x == 1) && s[100..].iter().all(|&x| x == 2));
        s.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        // SAFETY: as above, in the other direction.
        unsafe { scatter(bounce.as_mut_ptr(), 128, &v, 0) };
        assert_eq!(a[99], 99);
        assert_eq!(b[0], 100);
        // A window that starts inside the first buffer and ends inside the second.
        // SAFETY: 90 + 20 <= 128; the bounce holds 128 bytes.
        unsafe { gather(&v, 90, 20, bounce.as_mut_ptr()) };
        assert_eq!(&s[..20], &(90u8..110).collect::<Vec<_>>()[..]);
        s[..20].fill(0xee);
        // SAFETY: as above.
        unsafe { scatter(bounce.as_mut_ptr(), 20, &v, 95) };
        assert_eq!(
            (a[94], a[95], a[99], b[14], b[15]),
            (94, 0xee, 0xee, 0xee, 115)
        );
    }

    #[test]
    fn pool_is_bounded_and_reuses() {
        let mut pool = BouncePool::new(DioAlign {
            mem: 512,
            offset: 512,
        });
        let a = pool.take().unwrap();
        assert_eq!(a.len(), BOUNCE_CHUNK);
        assert_eq!(a.as_mut_ptr() as usize % 4096, 0);
        let p = a.as_mut_ptr();
        pool.give(a);
        let b = pool.take().unwrap();
        assert_eq!(b.as_mut_ptr(), p, "reused");
        let mut held = vec![b];
        while let Some(x) = pool.take() {
            held.push(x);
        }
        assert_eq!(held.len(), BOUNCE_BUDGET, "never more than the budget");
        pool.give(held.pop().unwrap());
        assert!(pool.take().is_some());
        assert!(pool.take().is_none());
    }
}
