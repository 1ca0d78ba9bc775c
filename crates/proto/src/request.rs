//! A checked virtio-blk request, parsed from a descriptor chain.
//!
//! The chain is read as the spec frames it (§2.7.4: the device must not assume any particular
//! arrangement of descriptors): a device-readable byte stream followed by a device-writable one.
//! The first 16 readable bytes are the header, the last writable byte is the status, and what
//! lies between is payload. Payload buffers become host iovecs into guest memory; nothing is
//! copied.

use vm_memory::{Address, GuestAddress};

use crate::ram::{read_guest, read_host, GuestRam};

use crate::chain::{self, ChainError, RingInfo, Segment};
use crate::wire::{
    req_type, status, DiscardSegment, RequestHeader, HEADER_LEN, SECTOR_SHIFT, SECTOR_SIZE,
    SEGMENT_FLAG_UNMAP, SEGMENT_LEN,
};

/// What the device offers and has negotiated; every request is checked against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Disk size in 512-byte sectors.
    pub capacity: u64,
    /// Most payload buffers in one request (`seg_max`). A buffer of any length is
    /// served: `size_max` is advice to the driver, not a limit the device enforces.
    pub seg_max: u32,
    /// The disk refuses writes.
    pub read_only: bool,
    /// FLUSH was negotiated.
    pub flush: bool,
    /// DISCARD was negotiated.
    pub discard: bool,
    /// WRITE_ZEROES was negotiated.
    pub write_zeroes: bool,
    /// Most sectors in one discard segment.
    pub max_discard_sectors: u32,
    /// Most sectors in one write-zeroes segment.
    pub max_write_zeroes_sectors: u32,
}

/// The kind of a parsed request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RequestKind {
    /// Read into the payload iovecs.
    #[default]
    In,
    /// Write from the payload iovecs.
    Out,
    /// Make completed writes durable.
    Flush,
    /// Write the device ID into the payload iovecs.
    GetId,
    /// Discard a range.
    Discard,
    /// Write zeroes to a range.
    WriteZeroes {
        /// The driver allows deallocation.
        unmap: bool,
    },
}

/// Why a request is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The chain itself is malformed.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// No device-writable byte at the end of the chain to put a status in.
    #[error("chain has no device-writable status byte at its end")]
    NoStatus,
    /// A device-readable buffer follows a device-writable one.
    #[error("device-readable buffer after a device-writable one")]
    ReadableAfterWritable,
    /// Fewer than 16 readable bytes for the header.
    #[error("request header needs 16 readable bytes, chain has {len}")]
    HeaderShort {
        /// Readable bytes in the chain.
        len: u64,
    },
    /// A buffer lies (partly) outside guest memory.
    #[error("buffer at guest address {addr:#x} + {len} is outside guest memory")]
    BadAddress {
        /// Guest address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Unknown request type.
    #[error("unknown request type {type_:#x}")]
    UnknownType {
        /// The type.
        type_: u32,
    },
    /// A request type whose feature was not negotiated.
    #[error("request type {type_} needs a feature that was not negotiated")]
    NotNegotiated {
        /// The type.
        type_: u32,
    },
    /// Payload in the wrong direction for the request type.
    #[error("request type {type_} carries {readable} device-readable and {writable} device-writable payload bytes")]
    Direction {
        /// The type.
        type_: u32,
        /// Readable payload bytes.
        readable: u64,
        /// Writable payload bytes.
        writable: u64,
    },
    /// Payload length not a multiple of 512.
    #[error("payload of {len} bytes is not a multiple of 512")]
    Unaligned {
        /// The length.
        len: u64,
    },
    /// Sector range past the end of the disk.
    #[error("sector {sector} + {sectors} is past capacity {capacity}")]
    PastCapacity {
        /// First sector.
        sector: u64,
        /// Sectors.
        sectors: u64,
        /// Disk capacity in sectors.
        capacity: u64,
    },
    /// A write-type request to a read-only disk.
    #[error("write to a read-only disk")]
    ReadOnly,
    /// More payload buffers than `seg_max` (or than the device can map).
    #[error("request has more than {max} payload buffers")]
    TooManySegments {
        /// The most allowed.
        max: u32,
    },
    /// The payload needs more host iovecs than the device keeps per request (its
    /// buffers cross more memory-region boundaries than two iovecs per buffer cover).
    #[error(
        "payload needs more than {max} host iovecs (buffers split at memory-region boundaries)"
    )]
    TooManyIovecs {
        /// The most allowed.
        max: usize,
    },
    /// The payload is larger than a used length can report.
    #[error("payload of {len} bytes is larger than 4 GiB - 2")]
    TooLarge {
        /// Payload bytes.
        len: u64,
    },
    /// Discard / write-zeroes payload is not 1..=max whole segments.
    #[error("discard/write-zeroes payload of {len} bytes: expected exactly one 16-byte segment")]
    SegmentCount {
        /// Payload bytes.
        len: u64,
    },
    /// Unknown or forbidden flags in a discard / write-zeroes segment.
    #[error("discard/write-zeroes segment flags {flags:#x} are not supported")]
    SegmentFlags {
        /// The flags.
        flags: u32,
    },
    /// A discard / write-zeroes segment larger than the device allows.
    #[error("segment of {sectors} sectors exceeds the limit of {max}")]
    SegmentSectors {
        /// Sectors asked for.
        sectors: u32,
        /// The limit.
        max: u32,
    },
    /// Zero GET_ID payload.
    #[error("GET_ID without room for the answer")]
    NoIdRoom,
}

impl RequestError {
    /// The status byte this error is answered with.
    pub fn status(&self) -> u8 {
        match self {
            RequestError::UnknownType { .. }
            | RequestError::NotNegotiated { .. }
            | RequestError::SegmentFlags { .. } => status::UNSUPP,
            _ => status::IOERR,
        }
    }
}

/// A request that cannot be carried out.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected {
    /// Answer with `status` in the status byte at `status_ptr`.
    Answer {
        /// Host address of the status byte.
        status_ptr: *mut u8,
        /// Why.
        error: RequestError,
    },
    /// Nothing can be answered: return the head with a used length of 0.
    Unanswerable(RequestError),
}

impl Rejected {
    /// The reason.
    pub fn error(&self) -> RequestError {
        match self {
            Rejected::Answer { error, .. } | Rejected::Unanswerable(error) => *error,
        }
    }
}

/// A request ready to run. Reused for every request of one slot: its iovec vector keeps
/// the largest capacity it needed (at most [`Request::max_iovecs`]), so a warm slot never
/// allocates.
#[derive(Debug)]
pub struct Request {
    /// What to do.
    pub kind: RequestKind,
    /// First sector (for data, discard and write-zeroes requests).
    pub sector: u64,
    /// Payload bytes, or the range in bytes for discard / write-zeroes.
    pub len: u64,
    /// Host iovecs of the payload (reads, writes, GET_ID).
    pub iov: Vec<libc::iovec>,
    /// Host address of the status byte.
    pub status_ptr: *mut u8,
}

// SAFETY: the raw pointers in a Request point into guest memory that the device keeps mapped
// while the request is in flight; they carry no thread affinity and are only dereferenced by
// the one thread that owns the request at a time.
unsafe impl Send for Request {}

impl Request {
    /// Host iovecs one request may need on a device advertising `seg_max`: each buffer
    /// may straddle one memory-region boundary, plus slack for GET_ID.
    pub fn max_iovecs(seg_max: u32) -> usize {
        2 * seg_max as usize + 4
    }

    /// A request with room for `max_iov` payload iovecs before it first grows.
    pub fn with_capacity(max_iov: usize) -> Request {
        Request {
            kind: RequestKind::In,
            sector: 0,
            len: 0,
            iov: Vec::with_capacity(max_iov),
            status_ptr: std::ptr::null_mut(),
        }
    }

    /// Offset of the request on the disk in bytes.
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }

    /// The used length to report when the request succeeds: payload written to the driver
    /// plus the status byte.
    pub fn used_len_ok(&self) -> u32 {
        match self.kind {
            RequestKind::In | RequestKind::GetId => (self.len as u32).saturating_add(1),
            _ => 1,
        }
    }
}

/// Parses chains; owns the scratch space for walking them.
#[derive(Debug)]
pub struct Parser {
    segs: Vec<Segment>,
}

impl Parser {
    /// A parser for chains of at most `max_descriptors` buffers.
    pub fn new(max_descriptors: usize) -> Parser {
        Parser {
            segs: Vec::with_capacity(max_descriptors),
        }
    }

    /// Parse and check the chain at `head` into `req`.
    pub fn parse<M: GuestRam + ?Sized>(
        &mut self,
        mem: &M,
        ring: RingInfo,
        head: u16,
        limits: &Limits,
        req: &mut Request,
    ) -> Result<(), Rejected> {
        req.iov.clear();
        req.len = 0;
        req.sector = 0;
        req.status_ptr = std::ptr::null_mut();
        // Grows only when a queue larger than any before starts (not per request).
        self.segs
            .reserve(ring.max_segments().saturating_sub(self.segs.len()));
        chain::walk(mem, ring, head, &mut self.segs)
            .map_err(|e| Rejected::Unanswerable(e.into()))?;
        let segs = &self.segs[..];

        // The status byte: the last byte of the last buffer, which must be device-writable.
        let last = match segs.last() {
            Some(s) if s.writable && s.len > 0 => *s,
            _ => return Err(Rejected::Unanswerable(RequestError::NoStatus)),
        };
        let status_addr = last
            .addr
            .checked_add(u64::from(last.len) - 1)
            .ok_or(Rejected::Unanswerable(RequestError::NoStatus))?;
        let status_ptr = host_ptr(mem, status_addr, 1).map_err(Rejected::Unanswerable)?;
        req.status_ptr = status_ptr;
        let answer = |error| Rejected::Answer { status_ptr, error };

        let first_writable = segs.iter().position(|s| s.writable).unwrap_or(segs.len());
        if segs[first_writable..].iter().any(|s| !s.writable) {
            return Err(answer(RequestError::ReadableAfterWritable));
        }
        let (readable, writable) = segs.split_at(first_writable);
        let readable_len: u64 = readable.iter().map(|s| u64::from(s.len)).sum();
        let writable_len: u64 = writable.iter().map(|s| u64::from(s.len)).sum();
        if readable_len < HEADER_LEN as u64 {
            return Err(answer(RequestError::HeaderShort { len: readable_len }));
        }
        let mut hdr = RequestHeader::default();
        copy_from_guest(
            mem,
            readable,
            0,
            vm_memory::ByteValued::as_mut_slice(&mut hdr),
        )
        .map_err(answer)?;
        let type_ = u32::from_le(hdr.type_);
        req.sector = u64::from_le(hdr.sector);
        let data_in = readable_len - HEADER_LEN as u64; // payload the device reads
        let data_out = writable_len - 1; // payload the device writes
        let direction = |ok_in: bool, ok_out: bool| {
            if (!ok_in && data_in > 0) || (!ok_out && data_out > 0) {
                Err(answer(RequestError::Direction {
                    type_,
                    readable: data_in,
                    writable: data_out,
                }))
            } else {
                Ok(())
            }
        };

        match type_ {
            req_type::IN | req_type::OUT => {
                let write = type_ == req_type::OUT;
                if write && limits.read_only {
                    // virtio 1.2 §5.2.6.2: IOERR for any write to a read-only device.
                    return Err(answer(RequestError::ReadOnly));
                }
                direction(write, !write)?;
                req.kind = if write {
                    RequestKind::Out
                } else {
                    RequestKind::In
                };
                let (segs, skip, len) = if write {
                    (readable, HEADER_LEN as u64, data_in)
                } else {
                    (writable, 0, data_out)
                };
                if !len.is_multiple_of(SECTOR_SIZE) {
                    return Err(answer(RequestError::Unaligned { len }));
                }
                if len >= u64::from(u32::MAX) {
                    return Err(answer(RequestError::TooLarge { len }));
                }
                check_range(req.sector, len / SECTOR_SIZE, limits.capacity).map_err(answer)?;
                req.len = len;
                map_payload(mem, segs, skip, len, limits, &mut req.iov).map_err(answer)?;
            }
            req_type::FLUSH => {
                if !limits.flush {
                    return Err(answer(RequestError::NotNegotiated { type_ }));
                }
                direction(false, false)?;
                req.kind = RequestKind::Flush;
            }
            req_type::GET_ID => {
                direction(false, true)?;
                if data_out == 0 {
                    return Err(answer(RequestError::NoIdRoom));
                }
                req.kind = RequestKind::GetId;
                req.len = data_out.min(crate::wire::ID_BYTES as u64);
                map_payload(mem, writable, 0, req.len, limits, &mut req.iov).map_err(answer)?;
            }
            req_type::DISCARD | req_type::WRITE_ZEROES => {
                let discard = type_ == req_type::DISCARD;
                let (negotiated, max) = if discard {
                    (limits.discard, limits.max_discard_sectors)
                } else {
                    (limits.write_zeroes, limits.max_write_zeroes_sectors)
                };
                if !negotiated {
                    return Err(answer(RequestError::NotNegotiated { type_ }));
                }
                if limits.read_only {
                    // Like a write (§5.2.6.2), and as qemu-storage-daemon answers.
                    return Err(answer(RequestError::ReadOnly));
                }
                direction(true, false)?;
                if data_in != SEGMENT_LEN as u64 {
                    return Err(answer(RequestError::SegmentCount { len: data_in }));
                }
                let mut seg = DiscardSegment::default();
                copy_from_guest(
                    mem,
                    readable,
                    HEADER_LEN as u64,
                    vm_memory::ByteValued::as_mut_slice(&mut seg),
                )
                .map_err(answer)?;
                let flags = u32::from_le(seg.flags);
                let allowed = if discard { 0 } else { SEGMENT_FLAG_UNMAP };
                if flags & !allowed != 0 {
                    return Err(answer(RequestError::SegmentFlags { flags }));
                }
                let sectors = u32::from_le(seg.num_sectors);
                if sectors > max {
                    return Err(answer(RequestError::SegmentSectors { sectors, max }));
                }
                req.sector = u64::from_le(seg.sector);
                check_range(req.sector, u64::from(sectors), limits.capacity).map_err(answer)?;
                req.len = u64::from(sectors) << SECTOR_SHIFT;
                req.kind = if discard {
                    RequestKind::Discard
                } else {
                    RequestKind::WriteZeroes {
                        unmap: flags & SEGMENT_FLAG_UNMAP != 0,
                    }
                };
            }
            _ => return Err(answer(RequestError::UnknownType { type_ })),
        }
        Ok(())
    }
}

fn check_range(sector: u64, sectors: u64, capacity: u64) -> Result<(), RequestError> {
    match sector.checked_add(sectors) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(RequestError::PastCapacity {
            sector,
            sectors,
            capacity,
        }),
    }
}

/// Host address of `len` bytes at `addr`, which must lie inside one region.
fn host_ptr<M: GuestRam + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    len: u64,
) -> Result<*mut u8, RequestError> {
    mem.host_range(addr.0, len)
        .ok_or(RequestError::BadAddress { addr: addr.0, len })
}

/// Append host iovecs for `len` bytes of `segs`, starting `skip` bytes into them.
fn map_payload<M: GuestRam + ?Sized>(
    mem: &M,
    segs: &[Segment],
    mut skip: u64,
    len: u64,
    limits: &Limits,
    iov: &mut Vec<libc::iovec>,
) -> Result<(), RequestError> {
    let max_iov = Request::max_iovecs(limits.seg_max);
    let mut left = len;
    let mut buffers = 0u32;
    for s in segs {
        if left == 0 {
            break;
        }
        let seg_len = u64::from(s.len);
        if skip >= seg_len {
            skip -= seg_len;
            continue;
        }
        let n = (seg_len - skip).min(left);
        if n == 0 {
            continue;
        }
        buffers += 1;
        if buffers > limits.seg_max {
            return Err(RequestError::TooManySegments {
                max: limits.seg_max,
            });
        }
        let start = s.addr.checked_add(skip).ok_or(RequestError::BadAddress {
            addr: s.addr.0,
            len: seg_len,
        })?;
        map_buffer(mem, start, n, max_iov, iov)?;
        skip = 0;
        left -= n;
    }
    Ok(())
}

/// Append host iovecs for one guest buffer, split where it crosses memory regions; at
/// most `max_iov` in all.
fn map_buffer<M: GuestRam + ?Sized>(
    mem: &M,
    addr: GuestAddress,
    len: u64,
    max_iov: usize,
    iov: &mut Vec<libc::iovec>,
) -> Result<(), RequestError> {
    let bad = RequestError::BadAddress { addr: addr.0, len };
    let mut at = addr;
    let mut left = len;
    while left > 0 {
        let (host, n) = mem.host_span(at.0, left).ok_or(bad)?;
        if n == 0 {
            return Err(bad);
        }
        if iov.len() >= max_iov {
            return Err(RequestError::TooManyIovecs { max: max_iov });
        }
        // Grows only the first time this slot sees a request this fragmented.
        iov.push(libc::iovec {
            iov_base: host.cast(),
            iov_len: n as usize,
        });
        at = at.checked_add(n).ok_or(bad)?;
        left -= n;
    }
    Ok(())
}

/// Copy `out.len()` bytes that start `skip` bytes into `segs` out of guest memory.
fn copy_from_guest<M: GuestRam + ?Sized>(
    mem: &M,
    segs: &[Segment],
    mut skip: u64,
    out: &mut [u8],
) -> Result<(), RequestError> {
    let mut done = 0usize;
    for s in segs {
        if done == out.len() {
            break;
        }
        let seg_len = u64::from(s.len);
        if skip >= seg_len {
            skip -= seg_len;
            continue;
        }
        let n = ((seg_len - skip) as usize).min(out.len() - done);
        let bad = RequestError::BadAddress {
            addr: s.addr.0,
            len: seg_len,
        };
        let at = s.addr.checked_add(skip).ok_or(bad)?;
        match mem.host_range(at.0, n as u64) {
            // SAFETY: host_range checked that n bytes at `at` lie in one mapped region.
            Some(p) => unsafe { read_host(p, &mut out[done..done + n]) },
            None => {
                if !read_guest(mem, at.0, &mut out[done..done + n]) {
                    return Err(bad);
                }
            }
        }
        done += n;
        skip = 0;
    }
    Ok(())
}
