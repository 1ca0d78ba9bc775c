//! What the device is: the features it offers, its configuration space and the limits every
//! request is checked against. Pure data plus the few atomics the driver may change while the
//! device runs (acknowledged features, the `writeback` byte).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use proto::config::BlkConfig;
use proto::wire::{feature, ID_BYTES, SECTOR_SHIFT};
use proto::Limits;
use storage::Backend;
use vhost::vhost_user::message::VhostUserVirtioFeatures;

use crate::config::{DeviceConfig, MAX_DISCARD_SECTORS, SEG_MAX, SIZE_MAX};

/// The device as configured, shared (read-only but for atomics) by the control plane and
/// the workers of one session.
#[derive(Debug)]
pub(crate) struct Blk {
    /// Limits that do not depend on negotiation (segments, read-only); the capacity is
    /// in `capacity`.
    pub base_limits: Limits,
    /// Disk size in sectors (changes when the disk is resized).
    pub capacity: AtomicU64,
    /// Virtio features offered.
    pub features: u64,
    /// Virtio features the driver acknowledged.
    pub acked: AtomicU64,
    /// The `writeback` byte of the config space (the driver may change it).
    pub writeback: AtomicBool,
    /// The GET_ID answer, zero padded.
    pub serial: [u8; ID_BYTES],
    /// Number of request queues offered.
    pub num_queues: u16,
    /// Largest queue size accepted.
    pub max_queue_size: u16,
    /// Logical block size of the disk.
    pub blk_size: u32,
    /// DISCARD is offered.
    pub discard: bool,
    /// vblk's hint block (outside the virtio configuration space).
    pub hints: proto::config::Hints,
}

impl Blk {
    /// The device for `disk` as `config` asks.
    pub(crate) fn new(config: &DeviceConfig, disk: &Backend) -> Blk {
        let read_only = config.read_only || disk.read_only();
        let base_limits = Limits {
            capacity: disk.size() >> SECTOR_SHIFT,
            seg_max: SEG_MAX,
            read_only,
            flush: false,
            discard: false,
            write_zeroes: false,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
        };
        let mut serial = [0u8; ID_BYTES];
        let id = config
            .serial
            .clone()
            .unwrap_or_else(|| disk.default_serial());
        let n = id.len().min(ID_BYTES);
        serial[..n].copy_from_slice(&id.as_bytes()[..n]);
        let mut features = feature::bit(feature::VERSION_1)
            | feature::bit(feature::RING_EVENT_IDX)
            | feature::bit(feature::RING_INDIRECT_DESC)
            | feature::bit(feature::SEG_MAX)
            | feature::bit(feature::SIZE_MAX)
            | feature::bit(feature::BLK_SIZE)
            | feature::bit(feature::TOPOLOGY)
            | feature::bit(feature::FLUSH)
            | feature::bit(feature::CONFIG_WCE)
            | feature::bit(feature::MQ)
            | crate::wire::VHOST_F_LOG_ALL
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        // Every backend discards and writes zeroes (falling back to writing them). On a
        // read-only disk both stay offered and are answered with IOERR, like writes, as
        // qemu-storage-daemon does: `--read-only` refuses writes, it does not change what
        // kind of disk the guest sees.
        let discard = true;
        features |= feature::bit(feature::DISCARD) | feature::bit(feature::WRITE_ZEROES);
        if read_only {
            features |= feature::bit(feature::RO);
        }
        Blk {
            capacity: AtomicU64::new(base_limits.capacity),
            base_limits,
            features,
            acked: AtomicU64::new(0),
            writeback: AtomicBool::new(true),
            serial,
            num_queues: config.num_queues,
            max_queue_size: config.queue_size,
            blk_size: disk.logical_block_size(),
            discard,
            hints: proto::config::Hints {
                rotational: config.rotational.unwrap_or_else(|| disk.rotational()),
            },
        }
    }

    /// The limits in force for the features acked now.
    pub(crate) fn limits(&self) -> Limits {
        let acked = self.acked.load(Ordering::Relaxed);
        let has = |f| acked & feature::bit(f) != 0;
        Limits {
            capacity: self.capacity.load(Ordering::Relaxed),
            flush: has(feature::FLUSH),
            discard: has(feature::DISCARD),
            write_zeroes: has(feature::WRITE_ZEROES),
            ..self.base_limits
        }
    }

    /// Whether a virtio feature was acknowledged.
    pub(crate) fn acked(&self, f: u32) -> bool {
        self.acked.load(Ordering::Relaxed) & feature::bit(f) != 0
    }

    /// Writes must reach stable storage before they complete (writethrough).
    pub(crate) fn write_through(&self) -> bool {
        if !self.acked(feature::FLUSH) {
            // A driver that cannot flush must get durable writes (virtio 1.2 §5.2.6.1).
            return true;
        }
        !self.writeback.load(Ordering::Relaxed)
    }

    /// The configuration space as it stands.
    pub(crate) fn config_space(&self) -> BlkConfig {
        let limits = self.base_limits;
        let sectors_per_block = (self.blk_size >> SECTOR_SHIFT).max(1);
        BlkConfig {
            capacity: self.capacity.load(Ordering::Relaxed),
            size_max: SIZE_MAX,
            seg_max: limits.seg_max,
            blk_size: self.blk_size,
            physical_block_exp: 0,
            alignment_offset: 0,
            min_io_size: 1,
            opt_io_size: 0,
            writeback: u8::from(self.writeback.load(Ordering::Relaxed)),
            num_queues: self.num_queues,
            max_discard_sectors: limits.max_discard_sectors,
            max_discard_seg: 1,
            discard_sector_alignment: if self.discard { sectors_per_block } else { 0 },
            max_write_zeroes_sectors: limits.max_write_zeroes_sectors,
            max_write_zeroes_seg: 1,
            write_zeroes_may_unmap: 1,
        }
    }
}
