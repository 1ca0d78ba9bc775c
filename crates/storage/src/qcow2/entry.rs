//! L1 and L2 table entries: decoded and checked once, when a table is loaded, so that the
//! data path only ever sees mappings that are aligned, inside the 56-bit offset space and
//! free of reserved bits (qcow2.txt, "Cluster mapping"; QEMU's `qcow2_get_cluster_type`
//! and the corruption checks of `qcow2_get_host_offset`).

use std::fmt;

use super::header::MAX_HOST_OFFSET;

/// Bit 63 of L1 and standard L2 entries: the cluster's refcount is exactly 1, so it may
/// be written in place.
pub const COPIED: u64 = 1 << 63;
/// Bit 62 of L2 entries: a compressed cluster.
pub const COMPRESSED: u64 = 1 << 62;
/// Bit 0 of standard L2 entries (version 3): the cluster reads as zeroes.
pub const ZERO: u64 = 1;
/// Bits 9-55: a cluster-aligned host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// L1 entries: everything but COPIED and the offset is reserved.
const L1_RESERVED: u64 = !(COPIED | OFFSET_MASK);
/// Standard L2 entries: bits 1-8 and 56-61 are reserved.
const L2_RESERVED: u64 = 0x3f00_0000_0000_01fe;

/// Where a guest cluster's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// Not allocated here: the backing file's bytes, or zeroes without one.
    Unallocated,
    /// Reads as zeroes.
    Zero {
        /// A cluster kept allocated for it (preallocated), if any.
        host: Option<u64>,
    },
    /// The bytes are in the image file.
    Data {
        /// The host cluster's offset.
        host: u64,
        /// The cluster may be written in place (its refcount is 1).
        copied: bool,
    },
    /// Deflate-compressed bytes, read-only.
    Compressed {
        /// Where the compressed data starts (not aligned).
        host: u64,
        /// How many bytes it may take.
        bytes: u64,
    },
}

/// The standard L2 entry for a mapping vblk writes (never a compressed one: vblk does
/// not compress; that case encodes as unallocated).
pub fn encode_l2(m: Mapping) -> u64 {
    match m {
        Mapping::Unallocated | Mapping::Compressed { .. } => 0,
        Mapping::Zero { host: None } => ZERO,
        Mapping::Zero { host: Some(h) } => h | ZERO | COPIED,
        Mapping::Data { host, copied } => host | if copied { COPIED } else { 0 },
    }
}

/// A table entry that cannot be right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryError {
    /// Reserved bits are set.
    Reserved {
        /// The entry as read.
        entry: u64,
    },
    /// The offset is not cluster-aligned.
    Unaligned {
        /// The offset the entry gives.
        offset: u64,
    },
    /// A zero flag in a version 2 image, where bit 0 is reserved.
    ZeroInV2 {
        /// The entry as read.
        entry: u64,
    },
    /// A compressed flag where it cannot be (an L1 entry).
    Compressed {
        /// The entry as read.
        entry: u64,
    },
}

impl fmt::Display for EntryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryError::Reserved { entry } => {
                write!(f, "entry {entry:#018x} has reserved bits set")
            }
            EntryError::Unaligned { offset } => {
                write!(f, "offset {offset:#x} is not cluster-aligned")
            }
            EntryError::ZeroInV2 { entry } => {
                write!(f, "entry {entry:#018x}: a zero flag in a version 2 image")
            }
            EntryError::Compressed { entry } => {
                write!(f, "entry {entry:#018x}: a compressed flag in an L1 table")
            }
        }
    }
}

/// An L1 entry: the L2 table's offset, if there is one.
pub fn l1(entry: u64, cluster_bits: u32) -> Result<Option<u64>, EntryError> {
    if entry & L1_RESERVED != 0 {
        return Err(if entry & COMPRESSED != 0 {
            EntryError::Compressed { entry }
        } else {
            EntryError::Reserved { entry }
        });
    }
    let offset = entry & OFFSET_MASK;
    if offset == 0 {
        return Ok(None);
    }
    if offset & ((1 << cluster_bits) - 1) != 0 {
        return Err(EntryError::Unaligned { offset });
    }
    Ok(Some(offset))
}

/// A standard (64-bit) L2 entry of an image of `version` with clusters of 2^`cluster_bits`.
pub fn l2(entry: u64, cluster_bits: u32, version: u32) -> Result<Mapping, EntryError> {
    if entry & COMPRESSED != 0 {
        // Bits 0..x-1: host offset, x..61: additional 512-byte sectors, where
        // x = 62 - (cluster_bits - 8).
        let x = 62 - (cluster_bits - 8);
        let host = entry & ((1u64 << x) - 1);
        let sectors = (entry & !COPIED & !COMPRESSED) >> x;
        // The compressed data starts at `host` and ends in the last of `sectors + 1`
        // 512-byte sectors from the one `host` is in.
        let bytes = (sectors + 1) * 512 - (host & 511);
        if entry & COPIED != 0 {
            return Err(EntryError::Reserved { entry });
        }
        return Ok(Mapping::Compressed { host, bytes });
    }
    if entry & L2_RESERVED != 0 {
        return Err(EntryError::Reserved { entry });
    }
    let zero = entry & ZERO != 0;
    if zero && version < 3 {
        return Err(EntryError::ZeroInV2 { entry });
    }
    let host = entry & OFFSET_MASK;
    if host & ((1 << cluster_bits) - 1) != 0 {
        return Err(EntryError::Unaligned { offset: host });
    }
    debug_assert!(host <= MAX_HOST_OFFSET);
    Ok(match (zero, host) {
        (true, 0) => Mapping::Zero { host: None },
        (true, h) => Mapping::Zero { host: Some(h) },
        (false, 0) => Mapping::Unallocated,
        (false, h) => Mapping::Data {
            host: h,
            copied: entry & COPIED != 0,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BITS: u32 = 16;

    #[test]
    fn l1_entries() {
        assert_eq!(l1(0, BITS), Ok(None));
        assert_eq!(l1(COPIED | 0x3_0000, BITS), Ok(Some(0x3_0000)));
        assert_eq!(
            l1(0x3_0200, BITS),
            Err(EntryError::Unaligned { offset: 0x3_0200 })
        );
        assert_eq!(
            l1(0x3_0001, BITS),
            Err(EntryError::Reserved { entry: 0x3_0001 })
        );
        assert!(matches!(
            l1(COMPRESSED | 0x3_0000, BITS),
            Err(EntryError::Compressed { .. })
        ));
        assert!(matches!(
            l1(1 << 60, BITS),
            Err(EntryError::Reserved { .. })
        ));
        // 512-byte clusters: any 512-aligned offset is a cluster.
        assert_eq!(l1(0x200, 9), Ok(Some(0x200)));
    }

    #[test]
    fn l2_entries() {
        assert_eq!(l2(0, BITS, 3), Ok(Mapping::Unallocated));
        assert_eq!(l2(ZERO, BITS, 3), Ok(Mapping::Zero { host: None }));
        assert_eq!(
            l2(COPIED | 0x5_0000 | ZERO, BITS, 3),
            Ok(Mapping::Zero {
                host: Some(0x5_0000)
            })
        );
        assert_eq!(
            l2(COPIED | 0x5_0000, BITS, 3),
            Ok(Mapping::Data {
                host: 0x5_0000,
                copied: true
            })
        );
        assert_eq!(
            l2(0x5_0000, BITS, 2),
            Ok(Mapping::Data {
                host: 0x5_0000,
                copied: false
            })
        );
        assert_eq!(l2(ZERO, BITS, 2), Err(EntryError::ZeroInV2 { entry: ZERO }));
        assert_eq!(
            l2(0x5_0002, BITS, 3),
            Err(EntryError::Reserved { entry: 0x5_0002 })
        );
        assert!(matches!(
            l2(1 << 57, BITS, 3),
            Err(EntryError::Reserved { .. })
        ));
        assert_eq!(
            l2(0x5_0200, BITS, 3),
            Err(EntryError::Unaligned { offset: 0x5_0200 })
        );
    }

    #[test]
    fn compressed_l2_entries() {
        // 64 KiB clusters: x = 62 - 8 = 54 bits of offset, then the extra sectors.
        let host = 0x12_3456u64;
        let entry = COMPRESSED | (3u64 << 54) | host;
        assert_eq!(
            l2(entry, BITS, 3),
            Ok(Mapping::Compressed {
                host,
                bytes: 4 * 512 - (host & 511)
            })
        );
        assert!(matches!(
            l2(entry | COPIED, BITS, 3),
            Err(EntryError::Reserved { .. })
        ));
        // 2 MiB clusters: x = 49.
        let entry = COMPRESSED | (1u64 << 49) | 0x200;
        assert_eq!(
            l2(entry, 21, 3),
            Ok(Mapping::Compressed {
                host: 0x200,
                bytes: 1024
            })
        );
    }
}
