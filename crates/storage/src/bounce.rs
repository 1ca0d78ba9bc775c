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

/// The smallest bounce buffer; buffers grow in powers of two from here.
const MIN_BOUNCE: usize = 64 * 1024;

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

/// An engine's bounce buffers. A buffer is taken for one operation and given back
/// on its completion; buffers only ever grow, so once the pool has seen the
/// largest operation no operation allocates.
pub(crate) struct BouncePool {
    free: Vec<AlignedBuf>,
    align: usize,
}

impl BouncePool {
    /// A pool for at most `depth` operations at once, aligned for `dio`.
    pub(crate) fn new(depth: usize, dio: DioAlign) -> Self {
        let align = (dio.mem.max(dio.offset) as usize).max(4096);
        BouncePool {
            free: Vec::with_capacity(depth),
            align,
        }
    }

    /// A buffer of at least `len` bytes.
    pub(crate) fn take(&mut self, len: usize) -> io::Result<AlignedBuf> {
        match self.free.pop() {
            Some(buf) if buf.len() >= len => Ok(buf),
            // Too small (or none yet): replace with a bigger one.
            _ => {
                let size = len
                    .max(MIN_BOUNCE)
                    .checked_next_power_of_two()
                    .unwrap_or(len);
                AlignedBuf::new(size, self.align)
            }
        }
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give(&mut self, buf: AlignedBuf) {
        if self.free.len() < self.free.capacity() {
            self.free.push(buf);
        }
    }
}

/// Copies the data `iov` describes into `dst`, back to back.
///
/// # Safety
/// Every iovec points to `iov_len` readable bytes, `dst` to at least the total
/// length of writable bytes, and the two do not overlap.
pub(crate) unsafe fn gather(iov: &[libc::iovec], dst: *mut u8) {
    let mut at = 0usize;
    for v in iov {
        // SAFETY: by the contract, the source is readable for iov_len bytes and
        // `dst + at .. + iov_len` lies inside `dst`'s total length; no overlap.
        unsafe { std::ptr::copy_nonoverlapping(v.iov_base as *const u8, dst.add(at), v.iov_len) };
        at += v.iov_len;
    }
}

/// Copies the first `len` bytes at `src` out into the buffers of `iov`, in order.
///
/// # Safety
/// `src` points to `len` readable bytes, every iovec to `iov_len` writable bytes,
/// and they do not overlap.
pub(crate) unsafe fn scatter(src: *const u8, len: usize, iov: &[libc::iovec]) {
    let mut at = 0usize;
    for v in iov {
        if at >= len {
            break;
        }
        let n = v.iov_len.min(len - at);
        // SAFETY: `src + at .. + n` is inside `src`'s `len` bytes, the destination
        // is writable for iov_len >= n bytes; no overlap by the contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), v.iov_base as *mut u8, n) };
        at += n;
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
        unsafe { gather(&v, bounce.as_mut_ptr()) };
        // SAFETY: the bounce holds 128 initialised bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(bounce.as_mut_ptr(), 128) };
        assert!(s[..100].iter().all(|&x| x == 1) && s[100..].iter().all(|&x| x == 2));
        s.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        // SAFETY: as above, in the other direction.
        unsafe { scatter(bounce.as_mut_ptr(), 128, &v) };
        assert_eq!(a[99], 99);
        assert_eq!(b[0], 100);
    }

    #[test]
    fn pool_reuses_and_grows() {
        let mut pool = BouncePool::new(
            2,
            DioAlign {
                mem: 512,
                offset: 512,
            },
        );
        let a = pool.take(4096).unwrap();
        assert_eq!(a.len(), MIN_BOUNCE);
        assert_eq!(a.as_mut_ptr() as usize % 4096, 0);
        let p = a.as_mut_ptr();
        pool.give(a);
        let b = pool.take(1000).unwrap();
        assert_eq!(b.as_mut_ptr(), p, "reused");
        pool.give(b);
        let c = pool.take(MIN_BOUNCE + 1).unwrap();
        assert_eq!(c.len(), 2 * MIN_BOUNCE);
    }
}
