//! Wire constants and structures of virtio-blk (virtio 1.2, section 5.2).

use vm_memory::ByteValued;

/// Sector size of the virtio-blk protocol: `sector` fields always count 512-byte units.
pub const SECTOR_SIZE: u64 = 512;
/// log2 of [`SECTOR_SIZE`].
pub const SECTOR_SHIFT: u32 = 9;
/// Length of the GET_ID answer.
pub const ID_BYTES: usize = 20;

/// Feature bits (bit numbers) of virtio-blk and the transport-independent ones we use.
pub mod feature {
    /// Maximum size of any single segment is in `size_max`.
    pub const SIZE_MAX: u32 = 1;
    /// Maximum number of segments in a request is in `seg_max`.
    pub const SEG_MAX: u32 = 2;
    /// Disk-style geometry is in `geometry`.
    pub const GEOMETRY: u32 = 4;
    /// The device is read-only.
    pub const RO: u32 = 5;
    /// Block size of the disk is in `blk_size`.
    pub const BLK_SIZE: u32 = 6;
    /// Cache flush command support.
    pub const FLUSH: u32 = 9;
    /// Topology information is available.
    pub const TOPOLOGY: u32 = 10;
    /// The driver can toggle the cache between writeback and writethrough.
    pub const CONFIG_WCE: u32 = 11;
    /// More than one virtqueue.
    pub const MQ: u32 = 12;
    /// DISCARD requests.
    pub const DISCARD: u32 = 13;
    /// WRITE_ZEROES requests.
    pub const WRITE_ZEROES: u32 = 14;
    /// Indirect descriptors.
    pub const RING_INDIRECT_DESC: u32 = 28;
    /// `used_event` / `avail_event` notification suppression.
    pub const RING_EVENT_IDX: u32 = 29;
    /// Virtio 1.0 or later.
    pub const VERSION_1: u32 = 32;
    /// vhost-user: the protocol-features handshake is available.
    pub const VHOST_USER_PROTOCOL_FEATURES: u32 = 30;

    /// The mask of one feature bit.
    pub const fn bit(n: u32) -> u64 {
        1u64 << n
    }
}

/// Request types (`type` field of the header).
pub mod req_type {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush the volatile write cache.
    pub const FLUSH: u32 = 4;
    /// Read the device ID string.
    pub const GET_ID: u32 = 8;
    /// Read the device's lifetime (wear) information.
    pub const GET_LIFETIME: u32 = 10;
    /// Discard sectors.
    pub const DISCARD: u32 = 11;
    /// Write zeroes to sectors.
    pub const WRITE_ZEROES: u32 = 13;
    /// Securely erase sectors.
    pub const SECURE_ERASE: u32 = 14;
}

/// Status byte values.
pub mod status {
    /// Success.
    pub const OK: u8 = 0;
    /// Device or driver error.
    pub const IOERR: u8 = 1;
    /// Request unsupported by the device.
    pub const UNSUPP: u8 = 2;
}

/// The `unmap` flag of a discard / write-zeroes segment.
pub const SEGMENT_FLAG_UNMAP: u32 = 1;

/// The request header that starts every request (`struct virtio_blk_outhdr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHeader {
    /// One of [`req_type`].
    pub type_: u32,
    /// Priority hint (ignored).
    pub ioprio: u32,
    /// Offset in 512-byte sectors.
    pub sector: u64,
}

// SAFETY: RequestHeader is repr(C) plain old data with no padding (4 + 4 + 8 bytes);
// every bit pattern is a valid value.
unsafe impl ByteValued for RequestHeader {}

/// One range of a DISCARD or WRITE_ZEROES request
/// (`struct virtio_blk_discard_write_zeroes`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscardSegment {
    /// First sector.
    pub sector: u64,
    /// Number of sectors.
    pub num_sectors: u32,
    /// [`SEGMENT_FLAG_UNMAP`] and reserved bits.
    pub flags: u32,
}

// SAFETY: DiscardSegment is repr(C) plain old data with no padding (8 + 4 + 4 bytes);
// every bit pattern is a valid value.
unsafe impl ByteValued for DiscardSegment {}

/// Size of the request header on the wire.
pub const HEADER_LEN: usize = std::mem::size_of::<RequestHeader>();
/// Size of one discard / write-zeroes segment on the wire.
pub const SEGMENT_LEN: usize = std::mem::size_of::<DiscardSegment>();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_sizes_match_the_spec() {
        assert_eq!(HEADER_LEN, 16);
        assert_eq!(SEGMENT_LEN, 16);
    }
}
