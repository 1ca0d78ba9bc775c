//! The dispatcher: turns I/Os into virtio requests on the ring (splitting what one request
//! cannot carry, joining what the request path merged), tells the device, reaps the used
//! ring into the in-flight table, and waits for it.
//!
//! Paths decide *what* goes to the ring and *when*; this is the one place that writes
//! descriptors and request headers.
//!
//! This file builds the requests; `completion` publishes them, reaps the used ring and
//! waits for it.

mod completion;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::wire::{req_type, DiscardSegment, RequestHeader, HEADER_LEN, ID_BYTES};
use vmm_sys_util::eventfd::EventFd;

use crate::disk::{Limits, Shared};
use crate::error::{Error, ErrorKind};
use crate::io::{Bufs, Io, Op, SubmitError};
use crate::ring::{Seg, SplitRing};
use crate::table::{Table, NONE};

/// Stands in `segs[0]` until the request's head (and so its header address) is known.
const HEADER_PLACEHOLDER: Seg = Seg {
    addr: 0,
    len: 0,
    writable: false,
};

/// The virtio request type of an operation.
pub(crate) fn wire_type(op: Op) -> u32 {
    match op {
        Op::Read => req_type::IN,
        Op::Write => req_type::OUT,
        Op::Flush => req_type::FLUSH,
        Op::Discard => req_type::DISCARD,
        Op::WriteZeroes { .. } => req_type::WRITE_ZEROES,
    }
}

/// One queue's ring, notifications and in-flight table.
pub(crate) struct Core {
    pub shared: Arc<Shared>,
    pub limits: Limits,
    pub index: u16,
    pub ring: SplitRing,
    kick: EventFd,
    call: EventFd,
    pub table: Table,
    /// Scratch for the segments of the request being built (no allocation per request).
    segs: Vec<Seg>,
    pub spin: Duration,
    /// How long a call waits for the device: room on a full ring, a blocking call's answer.
    pub wait_limit: Duration,
    pub dead: bool,
    idle_polls: u32,
    /// Virtio requests on the ring.
    pub requests: u32,
    /// Bytes of one descriptor at most (the device's size_max).
    pub size_max: u64,
    /// Data descriptors one request may carry.
    pub per_request: u32,
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<Shared>,
        limits: Limits,
        index: u16,
        ring: SplitRing,
        kick: EventFd,
        call: EventFd,
        spin: Duration,
        wait_limit: Duration,
    ) -> Core {
        let max_segs = ring.max_segs();
        let seg_max = (limits.seg_max as usize).max(1);
        let per_request = seg_max.min(max_segs - 2).max(1) as u32;
        Core {
            table: Table::new(ring.size(), limits.write_cache),
            shared,
            size_max: u64::from(limits.size_max.max(512)),
            per_request,
            limits,
            index,
            ring,
            kick,
            call,
            segs: Vec::with_capacity(max_segs + 4),
            spin,
            wait_limit,
            dead: false,
            idle_polls: 0,
            requests: 0,
        }
    }

    // ---- checks ----

    pub(crate) fn check_usable(&self) -> Result<(), Error> {
        if self.dead || self.shared.dead.load(Ordering::Relaxed) {
            return Err(Error::new(
                ErrorKind::Disconnected,
                "the device disconnected".into(),
            ));
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64, write: bool) -> Result<(), Error> {
        let blk = u64::from(self.limits.logical_block_size);
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidInput, "length 0".into()));
        }
        // The block size is a power of two (the attach takes no other): masks, not two
        // 64-bit divisions per I/O.
        let aligned = |x: u64| {
            if blk.is_power_of_two() {
                x & (blk - 1) == 0
            } else {
                x.is_multiple_of(blk)
            }
        };
        if !aligned(offset) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("offset {offset} is not a multiple of the logical block size {blk}"),
            ));
        }
        if !aligned(len) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("length {len} is not a multiple of the logical block size {blk}"),
            ));
        }
        let capacity = self.shared.capacity.load(Ordering::Relaxed);
        if offset.checked_add(len).is_none_or(|end| end > capacity) {
            return Err(Error::new(
                ErrorKind::OutOfRange,
                format!("offset {offset} + length {len} is past the capacity of {capacity} bytes"),
            ));
        }
        if write && self.limits.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                "the disk is read-only".into(),
            ));
        }
        Ok(())
    }

    fn refuse(kind: ErrorKind, what: &str) -> Error {
        Error::new(kind, format!("the device does not offer {what}"))
    }

    /// Check `io` against the device and enter it in the table. `Ok(None)`: it completed
    /// at once (a flush on a device without a cache).
    pub(crate) fn admit(&mut self, io: Io) -> Result<Option<u32>, SubmitError> {
        let bad = |error: Error, io: Io| SubmitError {
            error,
            bufs: io.into_bufs(),
        };
        if let Err(e) = self.check_usable() {
            return Err(bad(e, io));
        }
        let (bytes, pieces) = match io.op {
            Op::Read | Op::Write => {
                let n = io.bufs.total_len();
                (n, io.bufs.pieces(self.size_max))
            }
            Op::Flush => {
                if !self.limits.flush {
                    self.table.complete_at_once(io.token, Ok(()));
                    return Ok(None);
                }
                (0, 0)
            }
            Op::Discard if !self.limits.discard => {
                return Err(bad(Self::refuse(ErrorKind::Unsupported, "DISCARD"), io))
            }
            Op::WriteZeroes { .. } if !self.limits.write_zeroes => {
                return Err(bad(
                    Self::refuse(ErrorKind::Unsupported, "WRITE_ZEROES"),
                    io,
                ))
            }
            Op::Discard | Op::WriteZeroes { .. } => (io.len, 0),
        };
        if io.op != Op::Flush {
            if let Err(e) = self.check_range(io.offset, bytes, io.op.is_write()) {
                return Err(bad(e, io));
            }
        }
        let sector = io.offset / 512;
        let pieces = u32::try_from(pieces).unwrap_or(u32::MAX);
        Ok(Some(self.table.insert(io, sector, bytes, pieces)))
    }

    // ---- the one-request fast path ----

    /// Whether `io` is the I/O most callers send: a read or write of one buffer that fits
    /// one descriptor (at most size_max bytes), so one request of three segments.
    #[inline]
    pub(crate) fn is_single(&self, io: &Io) -> bool {
        matches!(io.op, Op::Read | Op::Write)
            && matches!(&io.bufs, Bufs::One(b) if b.len() as u64 <= self.size_max)
    }

    /// [`Core::admit`] and [`Core::send`] in one pass for an I/O [`Core::is_single`]
    /// accepts: the same checks, the same table entry and the same request, without the
    /// general stages' per-I/O walk (request count, buffer walk, segment scratch list). The
    /// path decides when it is published. On an error nothing was sent.
    pub(crate) fn send_single(&mut self, io: Io) -> Result<(), SubmitError> {
        let Bufs::One(b) = &io.bufs else {
            unreachable!("send_single takes what is_single accepted")
        };
        let (gpa, len) = (b.gpa(), b.len() as u64);
        let write = io.op == Op::Write;
        let checked = self
            .check_usable()
            .and_then(|()| self.check_range(io.offset, len, write));
        if let Err(error) = checked {
            return Err(SubmitError {
                error,
                bufs: io.into_bufs(),
            });
        }
        let need = self.ring.descriptors_for(3);
        if self.ring.num_free() < need {
            if let Err(error) = self.make_room(need) {
                return Err(SubmitError {
                    error,
                    bufs: io.into_bufs(),
                });
            }
        }
        let head = self.ring.next_head();
        let sector = io.offset / 512;
        let aux = self.ring.aux(head);
        let status = self.ring.status(head);
        let hdr = RequestHeader {
            type_: if write { req_type::OUT } else { req_type::IN }.to_le(),
            ioprio: 0,
            sector: sector.to_le(),
        };
        // SAFETY: aux points to head's 64-byte request area in the ring's shared memory and
        // status to its status byte; head is free (the ring has room for this request:
        // checked above, or made by make_room), so the device is not using either.
        unsafe {
            aux.cast::<RequestHeader>().write_volatile(hdr);
            status.write_volatile(0xFF);
        }
        let segs = [
            Seg {
                addr: aux as u64,
                len: HEADER_LEN as u32,
                writable: false,
            },
            Seg {
                addr: gpa,
                len: len as u32,
                writable: !write,
            },
            Seg {
                addr: status as u64,
                len: 1,
                writable: true,
            },
        ];
        let got = self.ring.add(&segs);
        debug_assert_eq!(got, Some(head));
        if got.is_none() {
            return Err(SubmitError {
                error: no_room(),
                bufs: io.into_bufs(),
            });
        }
        let id = self.table.insert(io, sector, len, 1);
        self.table.bind(head, id);
        self.requests += 1;
        Ok(())
    }

    // ---- building requests ----

    /// How many requests `id` needs on its own.
    fn requests_for(&self, id: u32) -> u32 {
        let e = self.table.get(id);
        match e.op {
            Op::Read | Op::Write => e.pieces.div_ceil(self.per_request).max(1),
            Op::Flush => 1,
            Op::Discard => {
                let max = self.range_max(u64::from(self.limits.max_discard_sectors));
                e.bytes.div_ceil(max) as u32
            }
            Op::WriteZeroes { .. } => {
                let max = self.range_max(u64::from(self.limits.max_write_zeroes_sectors));
                e.bytes.div_ceil(max) as u32
            }
        }
    }

    fn range_max(&self, sectors: u64) -> u64 {
        let blk = u64::from(self.limits.logical_block_size);
        (sectors * 512 / blk * blk).max(blk)
    }

    /// Put I/O `id` on the ring by itself, split into as many requests as it needs. An
    /// error before the first request went out leaves the I/O in the table, unsent, for the
    /// caller to withdraw or fail; after, the I/O completes with the error once the sent
    /// requests finish.
    pub(crate) fn send(&mut self, id: u32) -> Result<(), Error> {
        self.check_usable()?;
        let requests = self.requests_for(id);
        {
            let e = self.table.get_mut(id);
            e.remaining = requests;
            e.next = NONE;
        }
        let e = self.table.get(id);
        let (op, sector) = (e.op, e.sector);
        match op {
            Op::Read | Op::Write => self.send_data(id, requests),
            Op::Flush => {
                self.begin();
                self.put(id, req_type::FLUSH, 0, None)
            }
            Op::Discard | Op::WriteZeroes { .. } => {
                let (max, flags) = match op {
                    Op::WriteZeroes { unmap } => (
                        self.range_max(u64::from(self.limits.max_write_zeroes_sectors)),
                        u32::from(unmap && self.limits.write_zeroes_may_unmap),
                    ),
                    _ => (
                        self.range_max(u64::from(self.limits.max_discard_sectors)),
                        0,
                    ),
                };
                let end = sector * 512 + self.table.get(id).bytes;
                let mut at = sector * 512;
                for r in 0..requests {
                    let n = (end - at).min(max);
                    let seg = DiscardSegment {
                        sector: (at / 512).to_le(),
                        num_sectors: ((n / 512) as u32).to_le(),
                        flags: flags.to_le(),
                    };
                    self.begin();
                    if let Err(e) = self.put(id, wire_type(op), 0, Some(&seg)) {
                        return self.abandon(id, requests - r, e);
                    }
                    at += n;
                }
                Ok(())
            }
        }
    }

    /// A data I/O in `requests` requests of at most `per_request` size_max pieces.
    fn send_data(&mut self, id: u32, requests: u32) -> Result<(), Error> {
        let (write, mut sector) = {
            let e = self.table.get(id);
            (e.op == Op::Write, e.sector)
        };
        let type_ = if write { req_type::OUT } else { req_type::IN };
        let (mut bi, mut boff) = (0usize, 0u64);
        for r in 0..requests {
            self.begin();
            let mut bytes = 0;
            let mut n = 0;
            while n < self.per_request {
                let Some(b) = self.table.get(id).bufs.get(bi) else {
                    break;
                };
                let (gpa, len) = (b.gpa(), b.len() as u64);
                if len == 0 {
                    bi += 1;
                    continue;
                }
                let take = (len - boff).min(self.size_max);
                self.segs.push(Seg {
                    addr: gpa + boff,
                    len: take as u32,
                    writable: !write,
                });
                bytes += take;
                n += 1;
                boff += take;
                if boff >= len {
                    bi += 1;
                    boff = 0;
                }
            }
            if let Err(e) = self.put(id, type_, sector, None) {
                return self.abandon(id, requests - r, e);
            }
            sector += bytes / 512;
        }
        Ok(())
    }

    /// Put the merged I/Os listed from `first` (linked through `next`, contiguous, all
    /// reads or all writes, together within one request's limits) on the ring as one
    /// request. On an error nothing was sent and every member fails with it.
    pub(crate) fn send_merged(&mut self, first: u32) -> Result<(), Error> {
        if let Err(e) = self.check_usable() {
            let mut id = first;
            while id != NONE {
                let next = self.table.get(id).next;
                self.table.fail(id, e.kind());
                id = next;
            }
            return Err(e);
        }
        let (write, sector) = {
            let e = self.table.get(first);
            (e.op == Op::Write, e.sector)
        };
        self.begin();
        let mut id = first;
        while id != NONE {
            let e = self.table.get_mut(id);
            e.remaining = 1;
            let next = e.next;
            let e = self.table.get(id);
            for i in 0..e.bufs.count() {
                let Some(b) = e.bufs.get(i) else { break };
                let (gpa, len) = (b.gpa(), b.len() as u64);
                let mut off = 0;
                while off < len {
                    let take = (len - off).min(self.size_max);
                    self.segs.push(Seg {
                        addr: gpa + off,
                        len: take as u32,
                        writable: !write,
                    });
                    off += take;
                }
            }
            id = next;
        }
        let type_ = if write { req_type::OUT } else { req_type::IN };
        let r = self.put(first, type_, sector, None);
        if let Err(e) = &r {
            let mut id = first;
            while id != NONE {
                let next = self.table.get(id).next;
                self.table.account(id, Err(e.kind()));
                id = next;
            }
        }
        r
    }

    /// `unsent` requests of `id` will not be sent. If none was sent, the error is returned
    /// and the I/O stays in the table unsent; otherwise the I/O completes with the error
    /// once the sent ones are accounted for.
    fn abandon(&mut self, id: u32, unsent: u32, e: Error) -> Result<(), Error> {
        let entry = self.table.get_mut(id);
        if entry.remaining == unsent {
            return Err(e);
        }
        entry.remaining -= unsent;
        entry.result = Err(e.kind());
        Ok(())
    }

    /// Start building a request: `segs[0]` is kept for the header.
    fn begin(&mut self) {
        self.segs.clear();
        self.segs.push(HEADER_PLACEHOLDER);
    }

    /// Put one request on the ring for the I/Os listed from `first`: header, the payload
    /// segments already in `self.segs[1..]` (after [`Core::begin`]), the 16-byte range
    /// `segment` if any, the status byte. The path decides when it is published.
    fn put(
        &mut self,
        first: u32,
        type_: u32,
        sector: u64,
        segment: Option<&DiscardSegment>,
    ) -> Result<(), Error> {
        let nsegs = self.segs.len() + 1 + usize::from(segment.is_some());
        let head = self.reserve(nsegs)?;
        let aux = self.ring.aux(head);
        let hdr = RequestHeader {
            type_: type_.to_le(),
            ioprio: 0,
            sector: sector.to_le(),
        };
        // SAFETY: aux points to head's 64-byte request area in the ring's shared memory;
        // head is free, so the device is not using it; the header and segment take 32 of
        // its 48 bytes before the status byte.
        unsafe {
            aux.cast::<RequestHeader>().write_volatile(hdr);
            if let Some(s) = segment {
                aux.add(HEADER_LEN)
                    .cast::<DiscardSegment>()
                    .write_volatile(*s);
            }
            self.ring.status(head).write_volatile(0xFF);
        }
        self.segs[0] = Seg {
            addr: aux as u64,
            len: HEADER_LEN as u32,
            writable: false,
        };
        if segment.is_some() {
            self.segs.push(Seg {
                addr: aux as u64 + HEADER_LEN as u64,
                len: 16,
                writable: false,
            });
        }
        self.segs.push(Seg {
            addr: self.ring.status(head) as u64,
            len: 1,
            writable: true,
        });
        self.add(first, head)
    }

    /// Room for a request of `nsegs` segments; returns the head it will take.
    fn reserve(&mut self, nsegs: usize) -> Result<u16, Error> {
        let need = self.ring.descriptors_for(nsegs);
        self.make_room(need)?;
        Ok(self.ring.next_head())
    }

    fn add(&mut self, first: u32, head: u16) -> Result<(), Error> {
        let got = self.ring.add(&self.segs);
        self.segs.clear();
        debug_assert_eq!(got, Some(head));
        if got.is_none() {
            return Err(no_room());
        }
        self.table.bind(head, first);
        self.requests += 1;
        Ok(())
    }

    /// Wait until `need` descriptors are free, reaping completions into the table.
    fn make_room(&mut self, need: u16) -> Result<(), Error> {
        if need > self.ring.size() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "a request of {need} descriptors does not fit a ring of {}",
                    self.ring.size()
                ),
            ));
        }
        let deadline = Instant::now() + self.wait_limit;
        while self.ring.num_free() < need {
            if self.dead {
                break;
            }
            self.publish();
            if self.reap() == 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the ring had no room for {} s: {need} descriptors needed, {} free, {} requests held by the device (QueueOptions::wait_limit)",
                            self.wait_limit.as_secs_f64(),
                            self.ring.num_free(),
                            self.requests
                        ),
                    ));
                }
                self.block(Some(left))?;
            }
        }
        // A disconnection while waiting fails everything in flight and frees every
        // descriptor, so the loop can end with room on a dead ring: a request put there
        // would never complete.
        if self.dead {
            return Err(Error::new(
                ErrorKind::Disconnected,
                "the device disconnected".into(),
            ));
        }
        Ok(())
    }

    /// Put one raw request on the ring without waiting: header (`type_`, `ioprio`,
    /// `sector`), then `data` (guest address, length, device-writable) cut at size_max,
    /// then the status byte. The head is not bound in the in-flight table: the caller
    /// (passthru) keeps its own. None when the ring has no room now.
    pub(crate) fn put_raw(
        &mut self,
        type_: u32,
        ioprio: u32,
        sector: u64,
        data: Option<(u64, u64, bool)>,
    ) -> Result<Option<u16>, Error> {
        self.check_usable()?;
        self.begin();
        if let Some((gpa, len, writable)) = data {
            let mut off = 0;
            while off < len {
                let take = (len - off).min(self.size_max);
                self.segs.push(Seg {
                    addr: gpa + off,
                    len: take as u32,
                    writable,
                });
                off += take;
            }
        }
        let nsegs = self.segs.len() + 1;
        if nsegs > self.ring.max_segs() {
            let n = self.segs.len() - 1;
            self.segs.clear();
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{n} data descriptors (of at most size_max {} bytes) do not fit one request \
                     of this ring (at most {})",
                    self.size_max,
                    self.ring.max_segs() - 2
                ),
            ));
        }
        if self.ring.num_free() < self.ring.descriptors_for(nsegs) {
            self.segs.clear();
            return Ok(None);
        }
        let head = self.ring.next_head();
        let aux = self.ring.aux(head);
        let hdr = RequestHeader {
            type_: type_.to_le(),
            ioprio: ioprio.to_le(),
            sector: sector.to_le(),
        };
        // SAFETY: aux is head's request area in the ring's shared memory; head is free, so
        // the device is not using it.
        unsafe {
            aux.cast::<RequestHeader>().write_volatile(hdr);
            self.ring.status(head).write_volatile(0xFF);
        }
        self.segs[0] = Seg {
            addr: aux as u64,
            len: HEADER_LEN as u32,
            writable: false,
        };
        self.segs.push(Seg {
            addr: self.ring.status(head) as u64,
            len: 1,
            writable: true,
        });
        self.add(NONE, head)?;
        Ok(Some(head))
    }

    /// Send the hidden flush that completes parked FUA writes, if one is due.
    pub(crate) fn post_flush(&mut self) {
        if !self.table.needs_post_flush() {
            return;
        }
        let id = self.table.take_post_flush();
        self.begin();
        if let Err(e) = self.put(id, req_type::FLUSH, 0, None) {
            self.table.fail_post_flush(id, e.kind());
            return;
        }
        self.publish();
    }

    /// Ask the device for its ID string (GET_ID) and wait for it. The queue must be idle.
    pub(crate) fn get_id(&mut self, token: u64) -> Result<String, Error> {
        self.check_usable()?;
        let id = self.table.insert(Io::flush(token), 0, 0, 0);
        let head = match self.reserve(3) {
            Ok(h) => h,
            Err(e) => {
                self.table.withdraw(id);
                return Err(e);
            }
        };
        let aux = self.ring.aux(head);
        self.begin();
        self.segs.push(Seg {
            addr: aux as u64 + HEADER_LEN as u64,
            len: ID_BYTES as u32,
            writable: true,
        });
        if let Err(e) = self.put(id, req_type::GET_ID, 0, None) {
            self.table.withdraw(id);
            return Err(e);
        }
        self.publish();
        let deadline = Instant::now() + self.wait_limit;
        let c = loop {
            if let Some(c) = self.table.pop_ready() {
                break c;
            }
            if self.reap() == 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    self.table.abandon(token);
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the device did not answer GET_ID within {:.1} s (QueueOptions::wait_limit)",
                            self.wait_limit.as_secs_f64()
                        ),
                    ));
                }
                self.block(Some(left))?;
            }
            if self.dead && self.table.ready.is_empty() {
                return Err(ErrorKind::Disconnected.into());
            }
        };
        c.result.map_err(Error::from)?;
        let mut out = [0u8; ID_BYTES];
        // SAFETY: head's request area holds the 20-byte answer the device wrote; the head
        // is free again and nothing else has been submitted since.
        unsafe { std::ptr::copy_nonoverlapping(aux.add(HEADER_LEN), out.as_mut_ptr(), ID_BYTES) };
        let end = out.iter().position(|&b| b == 0).unwrap_or(ID_BYTES);
        Ok(String::from_utf8_lossy(&out[..end]).into_owned())
    }
}

/// The ring refused a request make_room had made room for (a bug, not the device's doing).
fn no_room() -> Error {
    Error::new(
        ErrorKind::Protocol,
        "ring has no room after make_room".into(),
    )
}
