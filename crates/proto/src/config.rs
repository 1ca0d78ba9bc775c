//! The virtio-blk configuration space (`struct virtio_blk_config`, virtio 1.2 §5.2.4).
//!
//! The layout is written out by hand, little-endian, field by field, so that no padding or
//! host endianness can leak into what the driver reads.

/// Offset of `capacity` (le64, sectors).
pub const CAPACITY_OFFSET: usize = 0;
/// Offset of the `writeback` byte, the only field a driver may write.
pub const WRITEBACK_OFFSET: usize = 32;
/// Offset of `num_queues` (le16).
pub const NUM_QUEUES_OFFSET: usize = 34;
/// Bytes of configuration space this device defines (up to and including the secure-erase
/// fields, which stay zero). Reads past it return zeroes.
pub const CONFIG_LEN: usize = 72;

/// Where vblk's hint block lies in vhost-user's configuration address space: past every
/// virtio-blk configuration field, where no standard frontend reads.
pub const HINT_OFFSET: u32 = 0x100;
/// The hint block's first bytes.
pub const HINT_MAGIC: [u8; 8] = *b"vblkhint";
/// Bytes of the hint block: magic, le16 version, le16 flags, 4 reserved.
pub const HINT_LEN: usize = 16;
/// Version of the hint block's layout.
pub const HINT_VERSION: u16 = 1;
/// Hint flag: the disk is rotational and the host does not reorder.
pub const HINT_ROTATIONAL: u16 = 1;

/// What a vblk device says about its disk beyond virtio-blk's configuration (read by the
/// driver's `auto` path; never part of the virtio configuration space a guest sees).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    /// The disk seeks; merging and sorting in the driver pay.
    pub rotational: bool,
}

impl Hints {
    /// The hint block as the device sends it.
    pub fn to_bytes(&self) -> [u8; HINT_LEN] {
        let mut b = [0u8; HINT_LEN];
        b[..8].copy_from_slice(&HINT_MAGIC);
        b[8..10].copy_from_slice(&HINT_VERSION.to_le_bytes());
        let flags = if self.rotational { HINT_ROTATIONAL } else { 0 };
        b[10..12].copy_from_slice(&flags.to_le_bytes());
        b
    }

    /// Decode a hint block; None when the magic does not match (not a vblk device) or it
    /// is too short. Unknown flags and later versions' extra bytes are ignored.
    pub fn from_bytes(b: &[u8]) -> Option<Hints> {
        if b.len() < 12 || b[..8] != HINT_MAGIC {
            return None;
        }
        let flags = u16::from_le_bytes([b[10], b[11]]);
        Some(Hints {
            rotational: flags & HINT_ROTATIONAL != 0,
        })
    }
}

/// The values the device publishes in its configuration space.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlkConfig {
    /// Size of the disk in 512-byte sectors.
    pub capacity: u64,
    /// Maximum bytes in one segment.
    pub size_max: u32,
    /// Maximum number of data segments in one request.
    pub seg_max: u32,
    /// Logical block size in bytes.
    pub blk_size: u32,
    /// log2 of logical blocks per physical block.
    pub physical_block_exp: u8,
    /// Offset of the first aligned logical block.
    pub alignment_offset: u8,
    /// Suggested minimum I/O size, in logical blocks.
    pub min_io_size: u16,
    /// Optimal I/O size, in logical blocks.
    pub opt_io_size: u32,
    /// 1 when the write cache is in writeback mode, 0 for writethrough.
    pub writeback: u8,
    /// Number of request virtqueues.
    pub num_queues: u16,
    /// Maximum sectors in one discard segment.
    pub max_discard_sectors: u32,
    /// Maximum discard segments in one request.
    pub max_discard_seg: u32,
    /// Discard alignment, in sectors.
    pub discard_sector_alignment: u32,
    /// Maximum sectors in one write-zeroes segment.
    pub max_write_zeroes_sectors: u32,
    /// Maximum write-zeroes segments in one request.
    pub max_write_zeroes_seg: u32,
    /// 1 when a write-zeroes request with the unmap flag may deallocate.
    pub write_zeroes_may_unmap: u8,
}

impl BlkConfig {
    /// The configuration space as the driver sees it.
    pub fn to_bytes(&self) -> [u8; CONFIG_LEN] {
        let mut b = [0u8; CONFIG_LEN];
        let mut put = |off: usize, bytes: &[u8]| b[off..off + bytes.len()].copy_from_slice(bytes);
        put(CAPACITY_OFFSET, &self.capacity.to_le_bytes());
        put(8, &self.size_max.to_le_bytes());
        put(12, &self.seg_max.to_le_bytes());
        // 16..20: geometry, not offered.
        put(20, &self.blk_size.to_le_bytes());
        put(24, &[self.physical_block_exp, self.alignment_offset]);
        put(26, &self.min_io_size.to_le_bytes());
        put(28, &self.opt_io_size.to_le_bytes());
        put(WRITEBACK_OFFSET, &[self.writeback]);
        put(NUM_QUEUES_OFFSET, &self.num_queues.to_le_bytes());
        put(36, &self.max_discard_sectors.to_le_bytes());
        put(40, &self.max_discard_seg.to_le_bytes());
        put(44, &self.discard_sector_alignment.to_le_bytes());
        put(48, &self.max_write_zeroes_sectors.to_le_bytes());
        put(52, &self.max_write_zeroes_seg.to_le_bytes());
        put(56, &[self.write_zeroes_may_unmap]);
        b
    }

    /// Decode a configuration space read from a device (the driver's side). Short input
    /// leaves the missing fields zero.
    pub fn from_bytes(bytes: &[u8]) -> BlkConfig {
        let mut b = [0u8; CONFIG_LEN];
        let n = bytes.len().min(CONFIG_LEN);
        b[..n].copy_from_slice(&bytes[..n]);
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut cap = [0u8; 8];
        cap.copy_from_slice(&b[0..8]);
        BlkConfig {
            capacity: u64::from_le_bytes(cap),
            size_max: u32_at(8),
            seg_max: u32_at(12),
            blk_size: u32_at(20),
            physical_block_exp: b[24],
            alignment_offset: b[25],
            min_io_size: u16_at(26),
            opt_io_size: u32_at(28),
            writeback: b[WRITEBACK_OFFSET],
            num_queues: u16_at(NUM_QUEUES_OFFSET),
            max_discard_sectors: u32_at(36),
            max_discard_seg: u32_at(40),
            discard_sector_alignment: u32_at(44),
            max_write_zeroes_sectors: u32_at(48),
            max_write_zeroes_seg: u32_at(52),
            write_zeroes_may_unmap: b[56],
        }
    }

    /// `size` bytes of configuration space from `offset`, zeroes past [`CONFIG_LEN`]; None
    /// when the range overflows or is larger than a vhost-user config message can carry.
    pub fn read(&self, offset: u32, size: u32) -> Option<Vec<u8>> {
        const MAX_READ: u32 = 256;
        let end = offset.checked_add(size)?;
        if end > MAX_READ {
            return None;
        }
        let bytes = self.to_bytes();
        Some(
            (offset..end)
                .map(|i| bytes.get(i as usize).copied().unwrap_or(0))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_offsets() {
        let c = BlkConfig {
            capacity: 2_097_152,
            size_max: 1 << 20,
            seg_max: 254,
            blk_size: 4096,
            physical_block_exp: 3,
            alignment_offset: 0,
            min_io_size: 1,
            opt_io_size: 8,
            writeback: 1,
            num_queues: 4,
            max_discard_sectors: 0x3f_ffff,
            max_discard_seg: 1,
            discard_sector_alignment: 8,
            max_write_zeroes_sectors: 0x3f_ffff,
            max_write_zeroes_seg: 1,
            write_zeroes_may_unmap: 1,
        };
        let b = c.to_bytes();
        assert_eq!(&b[0..8], &2_097_152u64.to_le_bytes());
        assert_eq!(b[WRITEBACK_OFFSET], 1);
        assert_eq!(&b[34..36], &4u16.to_le_bytes());
        assert_eq!(BlkConfig::from_bytes(&b), c);
        assert_eq!(c.read(32, 1), Some(vec![1]));
        assert_eq!(c.read(70, 4), Some(vec![0, 0, 0, 0]));
        assert_eq!(c.read(u32::MAX, 2), None);
        assert_eq!(c.read(0, 1024), None);
    }
}
