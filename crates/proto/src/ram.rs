//! Guest memory as the parser reads it: the host address of a guest range.
//!
//! The walker and the parser turn guest addresses into host pointers several times per
//! request (descriptor tables, header, payload, status byte). [`GuestRam`] is that one
//! question. Any `vm_memory::GuestMemoryBackend` answers it through `find_region` (a
//! binary search over reference-counted regions); the device answers it from a flat,
//! sorted table of its regions, which costs a few instructions for the one or two regions
//! a frontend usually sends.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

/// Host addresses of guest memory.
///
/// # Safety
/// The parser reads and writes through what an implementation answers, so an answer must
/// be true: when `host_span(addr, len)` returns `Some((p, n))`, then `n <= len`, `n > 0`
/// when `len > 0`, and the `n` bytes at `p` are mapped, readable and writable memory that
/// stays mapped while `self` lives (other threads, the guest, may write them at any time).
pub unsafe trait GuestRam {
    /// The host address of guest address `addr` and how many bytes from it, at most
    /// `len`, lie in the same mapping; None when `addr` is not mapped.
    fn host_span(&self, addr: u64, len: u64) -> Option<(*mut u8, u64)>;

    /// The host address of `len` bytes at `addr` when they all lie in one mapping.
    fn host_range(&self, addr: u64, len: u64) -> Option<*mut u8> {
        match self.host_span(addr, len) {
            Some((p, n)) if n == len => Some(p),
            _ => None,
        }
    }
}

// SAFETY: a region vm-memory finds maps `region.len()` bytes from its start for as long as
// the memory object lives; the span is the part of it from `addr`, at most `len` bytes.
unsafe impl<M: GuestMemoryBackend> GuestRam for M {
    fn host_span(&self, addr: u64, len: u64) -> Option<(*mut u8, u64)> {
        let region = self.find_region(GuestAddress(addr))?;
        let off = addr - region.start_addr().0;
        let n = (region.len() - off).min(len);
        let p = region.get_host_address(MemoryRegionAddress(off)).ok()?;
        Some((p, n))
    }
}

/// Fill `out` from guest memory at `p`: volatile, because the guest may be writing there,
/// and 8 bytes to a load where `p` is 8-aligned (a request header is then two loads, not
/// sixteen; a volatile load of a byte array is split into bytes).
///
/// # Safety
/// `out.len()` bytes at `p` lie in one mapped region of guest memory.
pub(crate) unsafe fn read_host(p: *const u8, out: &mut [u8]) {
    let mut done = 0;
    let len = out.len();
    if p.align_offset(8) == 0 {
        let mut words = out.chunks_exact_mut(8);
        for (i, w) in (&mut words).enumerate() {
            // SAFETY: out.len() bytes at p are mapped (the caller's contract) and this word is
            // within them; p + 8 i is 8-aligned.
            let v = unsafe { p.cast::<u64>().add(i).read_volatile() };
            w.copy_from_slice(&v.to_ne_bytes());
        }
        done = len - words.into_remainder().len();
    }
    for (i, b) in out[done..].iter_mut().enumerate() {
        // SAFETY: as above, for the bytes not read as words.
        *b = unsafe { p.add(done + i).read_volatile() };
    }
}

/// Fill `out` from guest address `addr`, across mappings if it must; false if any byte is
/// not mapped (or the range wraps).
pub(crate) fn read_guest<R: GuestRam + ?Sized>(mem: &R, addr: u64, out: &mut [u8]) -> bool {
    let mut done = 0usize;
    while done < out.len() {
        let Some(at) = addr.checked_add(done as u64) else {
            return false;
        };
        let want = (out.len() - done) as u64;
        let Some((p, n)) = mem.host_span(at, want).filter(|&(_, n)| n > 0) else {
            return false;
        };
        let n = n.min(want) as usize;
        // SAFETY: host_span says n bytes at `at` lie in one mapping, at p.
        unsafe { read_host(p, &mut out[done..done + n]) };
        done += n;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn two_regions() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x2000), 0x1000),
        ])
        .unwrap()
    }

    #[test]
    fn spans_stop_at_the_end_of_a_region() {
        let m = two_regions();
        let (_, n) = m.host_span(0x1ff0, 0x100).unwrap();
        assert_eq!(n, 0x10);
        assert!(m.host_range(0x1ff0, 0x100).is_none());
        assert!(m.host_range(0x1ff0, 0x10).is_some());
        assert!(m.host_span(0x3000, 1).is_none());
        assert!(m.host_span(0, 1).is_none());
    }

    #[test]
    fn reads_cross_regions_and_fail_on_holes() {
        let m = two_regions();
        let (p, _) = m.host_span(0x1ff8, 8).unwrap();
        let (q, _) = m.host_span(0x2000, 8).unwrap();
        // SAFETY: both are 8 mapped bytes of the test's own memory.
        unsafe {
            p.cast::<u64>()
                .write_unaligned(0x0807060504030201u64.to_le());
            q.cast::<u64>()
                .write_unaligned(0x100f0e0d0c0b0a09u64.to_le());
        }
        let mut out = [0u8; 16];
        assert!(read_guest(&m, 0x1ff8, &mut out));
        assert_eq!(out, core::array::from_fn(|i| i as u8 + 1));
        assert!(
            !read_guest(&m, 0x2ff8, &mut out),
            "runs past the last region"
        );
        assert!(!read_guest(&m, u64::MAX - 4, &mut out), "wraps");
    }
}
