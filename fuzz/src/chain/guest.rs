//! The guest memory the chain target builds requests in: a few regions, two pairs of
//! them adjacent (buffers and tables may straddle the boundary), one at the very top of
//! the address space (so that `address + length` overflows), and holes between them.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Buffers: two adjacent 16 KiB regions.
pub const BUF_START: u64 = 0;
/// The boundary between the two buffer regions.
pub const BUF_SPLIT: u64 = 0x4000;
/// End of the buffer area (a hole follows).
pub const BUF_END: u64 = 0x8000;
/// The descriptor table (256 entries), alone in a 4 KiB region.
pub const TABLE: u64 = 0x10_0000;
/// The region after the table's, adjacent to it: a table placed late in the first
/// straddles into it.
pub const TABLE_SPILL: u64 = 0x10_1000;
/// Indirect tables (up to 768 entries), after room for a spilled direct table.
pub const INDIRECT: u64 = 0x10_2000;
/// End of the table regions (a hole follows).
pub const TABLES_END: u64 = 0x10_5000;
/// A region at the top of the address space.
pub const TOP: u64 = 0xffff_ffff_ffff_d000;
/// Its end: the highest end a region may have is below 2^64.
pub const TOP_END: u64 = 0xffff_ffff_ffff_f000;

/// The regions: (guest address, size).
pub const REGIONS: [(u64, usize); 5] = [
    (BUF_START, (BUF_SPLIT - BUF_START) as usize),
    (BUF_SPLIT, (BUF_END - BUF_SPLIT) as usize),
    (TABLE, (TABLE_SPILL - TABLE) as usize),
    (TABLE_SPILL, (TABLES_END - TABLE_SPILL) as usize),
    (TOP, (TOP_END - TOP) as usize),
];

/// Guest memory that remembers what was written, so that it can be zeroed again cheaply
/// before the next input (an input must not see the previous one's bytes).
///
/// The harness reads and writes it through its own region table rather than through
/// vm-memory: that keeps the instrumented vm-memory code (which `proto` uses) for the code
/// under test, and it makes the model's reads independent of it.
#[derive(Debug)]
pub struct Guest {
    /// The memory.
    pub mem: GuestMemoryMmap<()>,
    /// (guest address, length, host address) of each region, by address.
    regions: Vec<(u64, u64, usize)>,
    dirty: Vec<(u64, usize)>,
}

impl Default for Guest {
    fn default() -> Self {
        Self::new()
    }
}

impl Guest {
    /// Fresh, zeroed memory.
    pub fn new() -> Guest {
        let ranges: Vec<(GuestAddress, usize)> =
            REGIONS.iter().map(|&(a, n)| (GuestAddress(a), n)).collect();
        let mem = GuestMemoryMmap::from_ranges(&ranges).expect("fixed, valid ranges");
        let regions = mem
            .iter()
            .map(|r| {
                let host = r
                    .get_host_address(vm_memory::MemoryRegionAddress(0))
                    .expect("mapped") as usize;
                (r.start_addr().0, r.len(), host)
            })
            .collect();
        Guest {
            mem,
            regions,
            dirty: Vec::new(),
        }
    }

    /// The region holding `gpa`: (its guest address, its length, its host address).
    pub fn region_of(&self, gpa: u64) -> Option<(u64, u64, usize)> {
        self.regions
            .iter()
            .copied()
            .find(|&(start, len, _)| gpa >= start && gpa - start < len)
    }

    /// Copy between guest memory at `gpa` and `len` bytes at `buf`, across adjacent
    /// regions; false (after a partial copy) when a byte is outside guest memory.
    fn copy(&self, gpa: u64, buf: *mut u8, len: usize, to_guest: bool) -> bool {
        let mut done = 0usize;
        while done < len {
            let Some(at) = gpa.checked_add(done as u64) else {
                return false;
            };
            let Some((start, rlen, host)) = self.region_of(at) else {
                return false;
            };
            let off = at - start;
            let n = ((rlen - off) as usize).min(len - done);
            let g = (host + off as usize) as *mut u8;
            // SAFETY: [g, g + n) lies inside one mapped region (off + n <= rlen) that lives
            // as long as self; `buf` has `len` bytes (callers pass a slice) and done + n <= len.
            // Guest memory and `buf` never overlap (buf is harness memory).
            unsafe {
                if to_guest {
                    std::ptr::copy_nonoverlapping(buf.add(done), g, n);
                } else {
                    std::ptr::copy_nonoverlapping(g, buf.add(done), n);
                }
            }
            done += n;
        }
        true
    }

    /// Write `bytes` at `gpa`, as much of them as lies in memory.
    pub fn write(&mut self, gpa: u64, bytes: &[u8]) {
        self.dirty.push((gpa, bytes.len()));
        self.copy(gpa, bytes.as_ptr().cast_mut(), bytes.len(), true);
    }

    /// Read `buf.len()` bytes at `gpa`; false if any lies outside guest memory.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        self.copy(gpa, buf.as_mut_ptr(), buf.len(), false)
    }

    /// Zero everything written since the last reset.
    pub fn reset(&mut self) {
        const ZEROES: [u8; 64] = [0; 64];
        for (gpa, len) in std::mem::take(&mut self.dirty) {
            let mut at = 0;
            while at < len {
                let n = (len - at).min(ZEROES.len());
                let p = ZEROES.as_ptr().cast_mut();
                // `copy` only reads from `p` when writing to the guest.
                self.copy(gpa.wrapping_add(at as u64), p, n, true);
                at += n;
            }
        }
    }

    /// The guest address of host pointer `p`, with the room left in its region; None
    /// when `p` is not in guest memory.
    pub fn gpa_of(&self, p: *const u8) -> Option<(u64, u64)> {
        let p = p as usize;
        self.regions.iter().find_map(|&(start, len, host)| {
            (p >= host && ((p - host) as u64) < len)
                .then(|| (start + (p - host) as u64, len - (p - host) as u64))
        })
    }

    /// Host address of `len` bytes at `gpa` when they lie in one region.
    pub fn host(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        let (start, rlen, host) = self.region_of(gpa)?;
        let off = gpa - start;
        if off.checked_add(len)? > rlen {
            return None;
        }
        Some((host + off as usize) as *mut u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_zeroes_what_was_written() {
        let mut g = Guest::new();
        g.write(BUF_SPLIT - 4, &[1; 8]);
        g.write(TOP_END - 2, &[2; 4]); // partly outside
        g.reset();
        let mut b = [9u8; 8];
        assert!(g.read(BUF_SPLIT - 4, &mut b));
        assert_eq!(b, [0; 8]);
        assert!(!g.read(BUF_END - 4, &mut b));
        let p = g.host(BUF_SPLIT + 3, 1).unwrap();
        assert_eq!(g.gpa_of(p), Some((BUF_SPLIT + 3, BUF_END - BUF_SPLIT - 3)));
        assert!(g.host(BUF_SPLIT - 1, 2).is_none());
    }
}
