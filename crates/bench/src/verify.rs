//! `--verify=crc32c`: every 512-byte sector a job writes carries a header naming its own
//! disk offset, a generation and a crc32c of the sector, so any read of it can be checked,
//! and a written-sector map says which sectors must carry one.
//!
//! Sector layout: magic (8 bytes) | offset (8) | generation (8) | crc32c (4) | data (484).
//! The crc covers every byte of the sector except the crc field itself.

const SECTOR: usize = 512;
const MAGIC: u64 = u64::from_le_bytes(*b"vblkVRFY");
const CRC_AT: usize = 24;

/// A verify failure, naming the disk offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// The sector's crc does not match its contents.
    #[error("verify: crc32c mismatch in the sector at offset {offset}")]
    Crc {
        /// Disk offset of the sector.
        offset: u64,
    },
    /// The sector names another offset: data landed in the wrong place.
    #[error("verify: the sector at offset {offset} holds the data written for offset {found}")]
    Misplaced {
        /// Where it was read.
        offset: u64,
        /// Where it says it belongs.
        found: u64,
    },
    /// The sector was written by this job but reads back without a verify header.
    #[error("verify: the sector at offset {offset} was written but reads back without its header")]
    Lost {
        /// Disk offset of the sector.
        offset: u64,
    },
}

/// Which sectors of a job's region have been written (one bit per sector).
#[derive(Debug, Clone)]
pub struct WrittenMap {
    start: u64,
    bits: Vec<u64>,
}

impl WrittenMap {
    /// A map of the region `[start, start + len)`.
    pub fn new(start: u64, len: u64) -> WrittenMap {
        let sectors = len.div_ceil(SECTOR as u64) as usize;
        WrittenMap {
            start,
            bits: vec![0; sectors.div_ceil(64)],
        }
    }

    fn index(&self, offset: u64) -> Option<usize> {
        offset
            .checked_sub(self.start)
            .map(|d| (d / SECTOR as u64) as usize)
            .filter(|&i| i / 64 < self.bits.len())
    }

    /// Mark `[offset, offset + len)` written.
    pub fn mark(&mut self, offset: u64, len: u64) {
        for s in (offset..offset + len).step_by(SECTOR) {
            if let Some(i) = self.index(s) {
                self.bits[i / 64] |= 1 << (i % 64);
            }
        }
    }

    /// Whether the sector at `offset` was written.
    pub fn is_written(&self, offset: u64) -> bool {
        self.index(offset)
            .is_some_and(|i| self.bits[i / 64] & (1 << (i % 64)) != 0)
    }

    /// The written extents, merged, in order: (offset, len).
    pub fn extents(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (w, &word) in self.bits.iter().enumerate() {
            if word == 0 {
                continue;
            }
            for b in 0..64 {
                if word & (1 << b) != 0 {
                    let off = self.start + ((w * 64 + b) * SECTOR) as u64;
                    match out.last_mut() {
                        Some((o, l)) if *o + *l == off => *l += SECTOR as u64,
                        _ => out.push((off, SECTOR as u64)),
                    }
                }
            }
        }
        out
    }
}

fn fill_data(sector: &mut [u8], offset: u64, generation: u64) {
    // xorshift64* from (offset, generation): cheap, deterministic, different per write.
    let mut x = offset ^ generation.rotate_left(32) ^ 0x9E37_79B9_7F4A_7C15;
    for chunk in sector[28..].chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn crc(sector: &[u8]) -> u32 {
    let c = crc32c::crc32c(&sector[..CRC_AT]);
    crc32c::crc32c_append(c, &sector[CRC_AT + 4..])
}

/// Fill `buf` (to be written at `offset`) with verifiable sectors.
pub fn fill(buf: &mut [u8], offset: u64, generation: u64) {
    for (i, sector) in buf.chunks_exact_mut(SECTOR).enumerate() {
        let off = offset + (i * SECTOR) as u64;
        sector[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        sector[8..16].copy_from_slice(&off.to_le_bytes());
        sector[16..24].copy_from_slice(&generation.to_le_bytes());
        fill_data(sector, off, generation);
        let c = crc(sector);
        sector[CRC_AT..CRC_AT + 4].copy_from_slice(&c.to_le_bytes());
    }
}

/// Check `buf`, read at `offset`. Sectors with a header are checked; sectors without one
/// are an error only if `written` says they were written. Returns how many were checked.
pub fn check(buf: &[u8], offset: u64, written: &WrittenMap) -> Result<u64, VerifyError> {
    let mut checked = 0;
    for (i, sector) in buf.chunks_exact(SECTOR).enumerate() {
        let off = offset + (i * SECTOR) as u64;
        let magic = u64::from_le_bytes(sector[0..8].try_into().unwrap_or_default());
        if magic != MAGIC {
            if written.is_written(off) {
                return Err(VerifyError::Lost { offset: off });
            }
            continue;
        }
        let found = u64::from_le_bytes(sector[8..16].try_into().unwrap_or_default());
        if found != off {
            return Err(VerifyError::Misplaced { offset: off, found });
        }
        let stored = u32::from_le_bytes(sector[CRC_AT..CRC_AT + 4].try_into().unwrap_or_default());
        if stored != crc(sector) {
            return Err(VerifyError::Crc { offset: off });
        }
        checked += 1;
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_every_corruption_is_named() {
        let mut map = WrittenMap::new(4096, 1 << 20);
        let mut buf = vec![0u8; 4096];
        fill(&mut buf, 8192, 7);
        map.mark(8192, 4096);
        assert_eq!(check(&buf, 8192, &map), Ok(8));
        // One flipped bit in the data of the third sector.
        let mut bad = buf.clone();
        bad[2 * 512 + 300] ^= 1;
        assert_eq!(
            check(&bad, 8192, &map),
            Err(VerifyError::Crc { offset: 9216 })
        );
        // The right data read from the wrong place.
        assert_eq!(
            check(&buf, 12288, &map),
            Err(VerifyError::Misplaced {
                offset: 12288,
                found: 8192
            })
        );
        // A written sector that reads back as zeroes.
        let zero = vec![0u8; 512];
        assert_eq!(
            check(&zero, 8704, &map),
            Err(VerifyError::Lost { offset: 8704 })
        );
        // A never-written sector is not an error.
        assert_eq!(check(&zero, 4096, &map), Ok(0));
        assert_eq!(map.extents(), vec![(8192, 4096)]);
        assert_eq!(
            VerifyError::Crc { offset: 9216 }.to_string(),
            "verify: crc32c mismatch in the sector at offset 9216"
        );
    }
}
