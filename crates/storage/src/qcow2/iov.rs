//! Byte ranges of an iovec array: the pieces of a guest request that one cluster run
//! covers, filled with zeroes, or copied into.

/// Calls `f(base, len)` for each piece of the buffers covering bytes
/// `[skip, skip + len)` of the array (fewer bytes if the buffers end first).
///
/// # Safety
/// `iov` points to `iovcnt` valid iovecs.
unsafe fn for_each(
    iov: *const libc::iovec,
    iovcnt: u32,
    mut skip: u64,
    mut len: u64,
    mut f: impl FnMut(*mut u8, usize),
) {
    for i in 0..iovcnt as usize {
        if len == 0 {
            return;
        }
        // SAFETY: i < iovcnt, the caller's promise.
        let v = unsafe { *iov.add(i) };
        let n = v.iov_len as u64;
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(len);
        // SAFETY: skip < iov_len: inside the buffer.
        f(
            unsafe { v.iov_base.cast::<u8>().add(skip as usize) },
            take as usize,
        );
        len -= take;
        skip = 0;
    }
}

/// Append to `out` the iovecs covering bytes `[skip, skip + len)` of the array.
///
/// # Safety
/// `iov` points to `iovcnt` valid iovecs.
pub(crate) unsafe fn slice_into(
    iov: *const libc::iovec,
    iovcnt: u32,
    skip: u64,
    len: u64,
    out: &mut Vec<libc::iovec>,
) {
    // SAFETY: passed on from the caller.
    unsafe {
        for_each(iov, iovcnt, skip, len, |base, n| {
            out.push(libc::iovec {
                iov_base: base.cast(),
                iov_len: n,
            })
        })
    };
}

/// Zero bytes `[skip, skip + len)` of the buffers.
///
/// # Safety
/// `iov` points to `iovcnt` iovecs whose buffers are valid for writes and not used by
/// anyone else meanwhile.
pub(crate) unsafe fn zero(iov: *const libc::iovec, iovcnt: u32, skip: u64, len: u64) {
    // SAFETY: each piece lies inside a buffer the caller lends us for writing.
    unsafe {
        for_each(iov, iovcnt, skip, len, |p, n| {
            std::ptr::write_bytes(p, 0, n)
        })
    };
}

/// Copy `src` into the buffers from byte `skip` on.
///
/// # Safety
/// As for [`zero`].
pub(crate) unsafe fn copy_in(iov: *const libc::iovec, iovcnt: u32, skip: u64, src: &[u8]) {
    let mut at = 0usize;
    // SAFETY: each piece lies inside a buffer the caller lends us for writing, and `src`
    // has `src.len()` bytes, of which we copy at most that many.
    unsafe {
        for_each(iov, iovcnt, skip, src.len() as u64, |p, n| {
            std::ptr::copy_nonoverlapping(src.as_ptr().add(at), p, n);
            at += n;
        })
    };
}

/// Copy bytes `[skip, skip + dst.len())` of the buffers into `dst`.
///
/// # Safety
/// `iov` points to `iovcnt` iovecs whose buffers are valid for reads.
pub(crate) unsafe fn copy_out(iov: *const libc::iovec, iovcnt: u32, skip: u64, dst: &mut [u8]) {
    let mut at = 0usize;
    let len = dst.len() as u64;
    // SAFETY: each piece lies inside a buffer the caller lends us for reading, and we
    // copy at most `dst.len()` bytes into `dst`.
    unsafe {
        for_each(iov, iovcnt, skip, len, |p, n| {
            std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr().add(at), n);
            at += n;
        })
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cross_buffers() {
        let (mut a, mut b) = ([1u8; 4], [2u8; 6]);
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: 4,
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 6,
            },
        ];
        let mut out = Vec::new();
        // SAFETY: two live buffers, described exactly.
        unsafe {
            slice_into(iov.as_ptr(), 2, 3, 4, &mut out);
            zero(iov.as_ptr(), 2, 2, 3);
            copy_in(iov.as_ptr(), 2, 8, &[7, 8, 9]);
        }
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].iov_len, out[1].iov_len), (1, 3));
        assert_eq!(a, [1, 1, 0, 0]);
        assert_eq!(b, [0, 2, 2, 2, 7, 8]);
        let mut out = [0u8; 4];
        // SAFETY: as above.
        unsafe { copy_out(iov.as_ptr(), 2, 3, &mut out) };
        assert_eq!(out, [0, 0, 2, 2]);
    }
}
