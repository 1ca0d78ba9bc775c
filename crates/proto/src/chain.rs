//! A strict walker of split-ring descriptor chains (virtio 1.2 §2.7.5).
//!
//! virtio-queue's own chain iterator stops quietly on a bad descriptor, which makes a
//! truncated chain look like a complete one. The device must tell the two apart (a broken
//! chain has no trustworthy status byte), so vblk walks chains itself and names every way a
//! chain can be wrong.

use vm_memory::{Address, GuestAddress};

use crate::ram::{read_guest, GuestRam};

use virtio_queue::desc::split::Descriptor;

const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const DESC_F_INDIRECT: u16 = 4;
const DESC_SIZE: u64 = 16;

/// Where a queue's descriptor table is and what the driver negotiated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingInfo {
    /// Guest address of the descriptor table.
    pub desc_table: GuestAddress,
    /// Queue size (number of descriptors in the table).
    pub size: u16,
    /// Whether VIRTIO_F_RING_INDIRECT_DESC was negotiated.
    pub indirect: bool,
    /// Most descriptors an indirect table may hold: see [`RingInfo::max_indirect_for`].
    pub max_indirect: u16,
}

impl RingInfo {
    /// The indirect-table bound for a queue of `size` entries on a device advertising
    /// `seg_max`. The spec bounds a chain by the queue size, but Linux builds tables of
    /// `seg_max + 2` entries (header, data, status) whatever the queue size, and QEMU
    /// and libvhost-user walk tables of up to 1024 (VIRTQUEUE_MAX_SIZE). The largest of
    /// the three, at most 32768: every table a driver may build is walked, and a
    /// request with too many data segments is answered (IOERR) rather than dropped.
    pub fn max_indirect_for(size: u16, seg_max: u32) -> u16 {
        let want = seg_max.saturating_add(2).max(u32::from(size)).max(1024);
        want.min(32768) as u16
    }

    /// The most buffers one chain of this ring can hold: a direct part of at most `size`
    /// descriptors and one indirect table.
    pub fn max_segments(&self) -> usize {
        usize::from(self.size) + usize::from(self.max_indirect)
    }
}

/// One buffer of a chain, in guest terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub writable: bool,
}

/// Everything that can be wrong with a chain's structure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The available ring named a head outside the descriptor table.
    #[error("head index {head} is outside the queue of size {size}")]
    HeadOutOfRange {
        /// The head index.
        head: u16,
        /// The queue size.
        size: u16,
    },
    /// A `next` field points outside the (direct or indirect) table.
    #[error("descriptor {index} links to {next}, outside the table of {size} entries")]
    NextOutOfRange {
        /// The descriptor holding the link.
        index: u16,
        /// The link.
        next: u16,
        /// Entries in the table.
        size: u16,
    },
    /// The chain is longer than its table: a loop or a runaway link.
    #[error("chain is longer than the {size} descriptors its table holds (a loop?)")]
    TooLong {
        /// Entries in the table.
        size: u16,
    },
    /// A descriptor could not be read from guest memory.
    #[error("descriptor at guest address {addr:#x} is not in guest memory")]
    Unreadable {
        /// Its guest address.
        addr: u64,
    },
    /// An indirect descriptor, but VIRTIO_F_RING_INDIRECT_DESC was not negotiated.
    #[error("indirect descriptor, but indirect descriptors were not negotiated")]
    IndirectNotNegotiated,
    /// An indirect descriptor also has the NEXT flag.
    #[error("indirect descriptor also has the NEXT flag")]
    IndirectWithNext,
    /// An indirect table contains another indirect descriptor.
    #[error("indirect table contains an indirect descriptor")]
    NestedIndirect,
    /// An indirect table whose length is zero, not a multiple of 16 or too large.
    #[error("indirect table of {len} bytes (must be a non-zero multiple of 16, at most {max})")]
    IndirectBadLength {
        /// Its length in bytes.
        len: u32,
        /// The largest table allowed.
        max: u32,
    },
    /// More buffers than the walker may hold.
    #[error("chain has more than {max} buffers")]
    TooManySegments {
        /// The most allowed.
        max: usize,
    },
}

/// Host address of a descriptor table of `entries` entries, when it lies inside one
/// memory region (then descriptors are read with one load each); None otherwise, and the
/// slow path checks every read.
fn host_table<M: GuestRam + ?Sized>(
    mem: &M,
    table: GuestAddress,
    entries: u16,
) -> Option<*const u8> {
    mem.host_range(table.0, DESC_SIZE * u64::from(entries))
        .map(|p| p as *const u8)
}

/// Descriptor `index` of a table at guest address `table_addr + 16 * index` (`addr`).
fn read_desc<M: GuestRam + ?Sized>(
    mem: &M,
    host: Option<*const u8>,
    index: u16,
    addr: GuestAddress,
) -> Result<Descriptor, ChainError> {
    match host {
        Some(p) => {
            // SAFETY: host_table checked that the whole table (index < entries) lies in one
            // mapped region.
            let at = unsafe { p.add(DESC_SIZE as usize * usize::from(index)) };
            let (lo, hi) = if at.align_offset(8) == 0 {
                // SAFETY: as above, and `at` is 8-aligned: two aligned words (the spec
                // aligns the table to 16; a volatile load of a byte array would be split
                // into sixteen byte loads). A volatile read of guest memory the driver may
                // be writing yields some bytes, never undefined behaviour here.
                unsafe {
                    let w = at.cast::<u64>();
                    (w.read_volatile(), w.add(1).read_volatile())
                }
            } else {
                // SAFETY: as above; [u8; 8] has alignment 1.
                unsafe {
                    (
                        u64::from_ne_bytes(at.cast::<[u8; 8]>().read_volatile()),
                        u64::from_ne_bytes(at.add(8).cast::<[u8; 8]>().read_volatile()),
                    )
                }
            };
            let (addr, hi) = (u64::from_le(lo), u64::from_le(hi));
            Ok(Descriptor::new(
                addr,
                hi as u32,
                (hi >> 32) as u16,
                (hi >> 48) as u16,
            ))
        }
        None => {
            let mut raw = [0u8; DESC_SIZE as usize];
            if !read_guest(mem, addr.0, &mut raw) {
                return Err(ChainError::Unreadable { addr: addr.0 });
            }
            let lo = u64::from_le_bytes(raw[..8].try_into().expect("8 bytes"));
            let hi = u64::from_le_bytes(raw[8..].try_into().expect("8 bytes"));
            Ok(Descriptor::new(
                lo,
                hi as u32,
                (hi >> 32) as u16,
                (hi >> 48) as u16,
            ))
        }
    }
}

/// Walk the chain that starts at `head`, appending its buffers to `out` (cleared first).
/// `out`'s capacity bounds the walk: it never grows. A capacity of
/// [`RingInfo::max_segments`] holds every chain the walker accepts.
pub fn walk<M: GuestRam + ?Sized>(
    mem: &M,
    ring: RingInfo,
    head: u16,
    out: &mut Vec<Segment>,
) -> Result<(), ChainError> {
    out.clear();
    if head >= ring.size {
        return Err(ChainError::HeadOutOfRange {
            head,
            size: ring.size,
        });
    }
    let mut table = ring.desc_table;
    let mut table_size = ring.size;
    let mut host = host_table(mem, table, table_size);
    let mut in_indirect = false;
    let mut index = head;
    let mut ttl = ring.size;
    loop {
        if ttl == 0 {
            return Err(ChainError::TooLong { size: table_size });
        }
        ttl -= 1;
        let addr = table
            .checked_add(u64::from(index) * DESC_SIZE)
            .ok_or(ChainError::Unreadable { addr: u64::MAX })?;
        let desc = read_desc(mem, host, index, addr)?;
        let flags = desc.flags();
        if flags & DESC_F_INDIRECT != 0 {
            if in_indirect {
                return Err(ChainError::NestedIndirect);
            }
            if !ring.indirect {
                return Err(ChainError::IndirectNotNegotiated);
            }
            if flags & DESC_F_NEXT != 0 {
                return Err(ChainError::IndirectWithNext);
            }
            let max = u32::from(ring.max_indirect) * DESC_SIZE as u32;
            let len = desc.len();
            if len == 0 || !len.is_multiple_of(DESC_SIZE as u32) || len > max {
                return Err(ChainError::IndirectBadLength { len, max });
            }
            table = desc.addr();
            table_size = (len / DESC_SIZE as u32) as u16;
            host = host_table(mem, table, table_size);
            in_indirect = true;
            index = 0;
            ttl = table_size;
            continue;
        }
        if out.len() == out.capacity() {
            return Err(ChainError::TooManySegments {
                max: out.capacity(),
            });
        }
        out.push(Segment {
            addr: desc.addr(),
            len: desc.len(),
            writable: flags & DESC_F_WRITE != 0,
        });
        if flags & DESC_F_NEXT == 0 {
            return Ok(());
        }
        let next = desc.next();
        if next >= table_size {
            return Err(ChainError::NextOutOfRange {
                index,
                next,
                size: table_size,
            });
        }
        index = next;
    }
}
