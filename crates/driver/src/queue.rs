//! A [`Queue`]: one virtqueue, owned by one thread, and the I/O API on it.
//!
//! Every I/O the caller submits is tagged with a token and completes exactly once, with its
//! buffers handed back. An I/O larger than the device's `size_max` × `seg_max` is split into
//! several requests and still completes once. When the ring is full the submitter reaps
//! completions (waiting if it must) until there is room: submission never fails for lack of
//! descriptors. When the device goes away, every outstanding and later I/O completes with
//! [`ErrorKind::Disconnected`].

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::error;
use proto::wire::{req_type, status, RequestHeader, HEADER_LEN, ID_BYTES, SEGMENT_FLAG_UNMAP};
use vmm_sys_util::eventfd::EventFd;

use crate::disk::{Limits, Shared};
use crate::error::{Error, ErrorKind};
use crate::mem::Buffer;
use crate::path::{Path, PathKind};
use crate::ring::{Seg, SplitRing};

/// Buffers that travel with an I/O and come back with its completion.
#[derive(Debug, Default)]
pub enum Bufs {
    /// No payload (flush, discard, write-zeroes).
    #[default]
    None,
    /// One buffer (read, write).
    One(Buffer),
    /// Several buffers (readv, writev).
    Many(Vec<Buffer>),
}

impl Bufs {
    /// The single buffer, if there is exactly one.
    pub fn into_one(self) -> Option<Buffer> {
        match self {
            Bufs::One(b) => Some(b),
            Bufs::Many(mut v) if v.len() == 1 => v.pop(),
            _ => None,
        }
    }

    /// All buffers, in order.
    pub fn into_vec(self) -> Vec<Buffer> {
        match self {
            Bufs::None => Vec::new(),
            Bufs::One(b) => vec![b],
            Bufs::Many(v) => v,
        }
    }

    fn count(&self) -> usize {
        match self {
            Bufs::None => 0,
            Bufs::One(_) => 1,
            Bufs::Many(v) => v.len(),
        }
    }

    fn get(&self, i: usize) -> Option<&Buffer> {
        match self {
            Bufs::None => None,
            Bufs::One(b) => (i == 0).then_some(b),
            Bufs::Many(v) => v.get(i),
        }
    }

    fn total_len(&self) -> u64 {
        (0..self.count())
            .filter_map(|i| self.get(i))
            .map(|b| b.len() as u64)
            .sum()
    }
}

/// A finished I/O.
#[derive(Debug)]
pub struct Completion {
    /// The caller's token.
    pub token: u64,
    /// Success, or why not.
    pub result: Result<(), ErrorKind>,
    /// The buffers the I/O was given.
    pub bufs: Bufs,
}

/// A submission refused before anything was sent; the buffers come back.
#[derive(Debug)]
pub struct SubmitError {
    /// Why.
    pub error: Error,
    /// The buffers that were passed in.
    pub bufs: Bufs,
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SubmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Tuning of a queue.
#[derive(Clone, Copy, Debug)]
pub struct QueueOptions {
    /// The I/O path.
    pub path: PathKind,
    /// Requests per notification on the batch path.
    pub batch: u16,
    /// How long `wait` spins on the used ring before it sleeps on the call eventfd.
    pub spin: Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            path: PathKind::Bio,
            batch: 16,
            spin: Duration::from_micros(50),
        }
    }
}

/// Refuse a request type the device does not offer.
fn require(offered: bool, what: &str) -> Result<(), SubmitError> {
    if offered {
        return Ok(());
    }
    Err(SubmitError {
        error: Error::new(
            ErrorKind::Unsupported,
            format!("the device does not offer {what}"),
        ),
        bufs: Bufs::None,
    })
}

const NO_PARENT: u32 = u32::MAX;
/// Stands in `segs[0]` until the request's head (and so its header address) is known.
const HEADER_PLACEHOLDER: Seg = Seg {
    addr: 0,
    len: 0,
    writable: false,
};
const INTERNAL_TOKEN: u64 = u64::MAX;
/// Looks at the used ring between two reads of the clock while spinning.
const SPIN_CHECKS: u32 = 64;
/// Empty polls between two checks that the device is still connected.
const LIVENESS_EVERY: u32 = 4096;

#[derive(Debug)]
struct Parent {
    token: u64,
    remaining: u32,
    result: Result<(), ErrorKind>,
    bufs: Bufs,
}

/// One virtqueue and the I/O submitted on it. `Send`, not shared: one thread drives it.
pub struct Queue {
    shared: Arc<Shared>,
    limits: Limits,
    index: u16,
    ring: SplitRing,
    kick: EventFd,
    call: EventFd,
    /// Per head: the user I/O (parent) the request belongs to.
    slots: Vec<u32>,
    parents: Vec<Parent>,
    free_parents: Vec<u32>,
    ready: VecDeque<Completion>,
    segs: Vec<Seg>,
    path: Path,
    spin: Duration,
    in_flight: usize,
    dead: bool,
    idle_polls: u32,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("index", &self.index)
            .field("size", &self.ring.size())
            .field("path", &self.path.kind())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl Queue {
    pub(crate) fn new(
        shared: Arc<Shared>,
        limits: Limits,
        index: u16,
        ring: SplitRing,
        kick: EventFd,
        call: EventFd,
        opts: QueueOptions,
    ) -> Queue {
        let n = usize::from(ring.size());
        let max_segs = ring.max_segs();
        Queue {
            shared,
            limits,
            index,
            ring,
            kick,
            call,
            slots: vec![NO_PARENT; n],
            parents: Vec::with_capacity(n + 1),
            free_parents: Vec::with_capacity(n + 1),
            ready: VecDeque::with_capacity(2 * n),
            segs: Vec::with_capacity(max_segs + 4),
            path: Path::new(opts.path, opts.batch),
            spin: opts.spin,
            in_flight: 0,
            dead: false,
            idle_polls: 0,
        }
    }

    /// This queue's index on the device.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The ring size.
    pub fn size(&self) -> u16 {
        self.ring.size()
    }

    /// The I/O path in use.
    pub fn path(&self) -> PathKind {
        self.path.kind()
    }

    /// I/Os submitted whose completion the caller has not yet taken.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Allocate a buffer in memory shared with the device.
    pub fn alloc(&self, len: usize) -> Result<Buffer, Error> {
        self.shared.pool.alloc(len)
    }

    // ---- submission ----

    /// Read `buf.len()` bytes at `offset` into `buf`.
    pub fn read(&mut self, offset: u64, buf: Buffer, token: u64) -> Result<(), SubmitError> {
        self.submit_data(false, offset, Bufs::One(buf), token)
    }

    /// Write `buf` at `offset`.
    pub fn write(&mut self, offset: u64, buf: Buffer, token: u64) -> Result<(), SubmitError> {
        self.submit_data(true, offset, Bufs::One(buf), token)
    }

    /// Read into several buffers, in order, from `offset`.
    pub fn readv(&mut self, offset: u64, bufs: Vec<Buffer>, token: u64) -> Result<(), SubmitError> {
        self.submit_data(false, offset, Bufs::Many(bufs), token)
    }

    /// Write several buffers, in order, at `offset`.
    pub fn writev(
        &mut self,
        offset: u64,
        bufs: Vec<Buffer>,
        token: u64,
    ) -> Result<(), SubmitError> {
        self.submit_data(true, offset, Bufs::Many(bufs), token)
    }

    /// Make every completed write durable. Completes at once on a device without a
    /// volatile cache (no FLUSH feature).
    pub fn flush(&mut self, token: u64) -> Result<(), SubmitError> {
        self.check_usable(Bufs::None)?;
        if !self.limits.flush {
            self.in_flight += 1;
            self.ready.push_back(Completion {
                token,
                result: Ok(()),
                bufs: Bufs::None,
            });
            return Ok(());
        }
        let p = self.new_parent(token, 1, Bufs::None);
        self.submit_request(p, req_type::FLUSH, 0, &[], None)
            .map_err(|e| self.fail_parent(p, e))
    }

    /// Discard `len` bytes at `offset` (a hint: the range may read back as zeroes or not).
    pub fn discard(&mut self, offset: u64, len: u64, token: u64) -> Result<(), SubmitError> {
        require(self.limits.discard, "DISCARD")?;
        let max = u64::from(self.limits.max_discard_sectors) * 512;
        self.submit_range(req_type::DISCARD, offset, len, 0, max, token)
    }

    /// Make `len` bytes at `offset` read as zeroes; `unmap` lets the device deallocate.
    pub fn write_zeroes(
        &mut self,
        offset: u64,
        len: u64,
        unmap: bool,
        token: u64,
    ) -> Result<(), SubmitError> {
        require(self.limits.write_zeroes, "WRITE_ZEROES")?;
        let flags = if unmap && self.limits.write_zeroes_may_unmap {
            SEGMENT_FLAG_UNMAP
        } else {
            0
        };
        let max = u64::from(self.limits.max_write_zeroes_sectors) * 512;
        self.submit_range(req_type::WRITE_ZEROES, offset, len, flags, max, token)
    }

    /// Publish gathered requests and notify the device (the batch path's unplug; harmless
    /// on the bio path).
    pub fn unplug(&mut self) {
        if self.ring.unpublished() == 0 {
            return;
        }
        self.ring.publish();
        if self.ring.needs_kick() {
            if let Err(e) = self.kick.write(1) {
                error!("queue {}: cannot notify the device: {e}", self.index);
            }
        }
    }

    fn check_usable(&self, bufs: Bufs) -> Result<Bufs, SubmitError> {
        if self.dead || self.shared.dead.load(Ordering::Relaxed) {
            return Err(SubmitError {
                error: Error::new(ErrorKind::Disconnected, "the device disconnected".into()),
                bufs,
            });
        }
        Ok(bufs)
    }

    fn check_range(&self, offset: u64, len: u64, write: bool) -> Result<(), Error> {
        let info = &self.limits;
        let blk = u64::from(info.logical_block_size);
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidInput, "length 0".into()));
        }
        if !offset.is_multiple_of(blk) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("offset {offset} is not a multiple of the logical block size {blk}"),
            ));
        }
        if !len.is_multiple_of(blk) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("length {len} is not a multiple of the logical block size {blk}"),
            ));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.shared.capacity.load(Ordering::Relaxed))
        {
            return Err(Error::new(
                ErrorKind::OutOfRange,
                format!(
                    "offset {offset} + length {len} is past the capacity of {} bytes",
                    self.shared.capacity.load(Ordering::Relaxed)
                ),
            ));
        }
        if write && info.read_only {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                "the disk is read-only".into(),
            ));
        }
        Ok(())
    }

    fn submit_data(
        &mut self,
        write: bool,
        offset: u64,
        bufs: Bufs,
        token: u64,
    ) -> Result<(), SubmitError> {
        let bufs = self.check_usable(bufs)?;
        let total = bufs.total_len();
        if let Err(error) = self.check_range(offset, total, write) {
            return Err(SubmitError { error, bufs });
        }
        let size_max = u64::from(self.limits.size_max.max(512));
        let pieces: u64 = (0..bufs.count())
            .filter_map(|i| bufs.get(i))
            .map(|b| (b.len() as u64).div_ceil(size_max))
            .sum();
        let per_req = self.data_segs_per_request() as u64;
        let requests = pieces.div_ceil(per_req) as u32;
        let p = self.new_parent(token, requests, bufs);
        let type_ = if write { req_type::OUT } else { req_type::IN };
        // Walk the buffers in size_max pieces, per_req pieces per request.
        let (mut bi, mut boff) = (0usize, 0u64);
        let mut sector = offset / 512;
        for r in 0..requests {
            let mut n = 0u64;
            let mut bytes = 0u64;
            self.segs.clear();
            self.segs.push(HEADER_PLACEHOLDER);
            while n < per_req {
                let Some(b) = self.parents[p as usize].bufs.get(bi) else {
                    break;
                };
                let left = b.len() as u64 - boff;
                let take = left.min(size_max);
                self.segs.push(Seg {
                    addr: b.gpa() + boff,
                    len: take as u32,
                    writable: !write,
                });
                bytes += take;
                n += 1;
                boff += take;
                if boff == b.len() as u64 {
                    bi += 1;
                    boff = 0;
                }
            }
            if let Err(e) = self.submit_prepared(p, type_, sector, None) {
                // The requests not yet sent will never complete: account for them.
                let unsent = requests - r;
                return self.abandon(p, unsent, e);
            }
            sector += bytes / 512;
        }
        Ok(())
    }

    fn submit_range(
        &mut self,
        type_: u32,
        offset: u64,
        len: u64,
        flags: u32,
        max: u64,
        token: u64,
    ) -> Result<(), SubmitError> {
        self.check_usable(Bufs::None)?;
        if let Err(error) = self.check_range(offset, len, true) {
            return Err(SubmitError {
                error,
                bufs: Bufs::None,
            });
        }
        let blk = u64::from(self.limits.logical_block_size);
        let max = (max / blk * blk).max(blk);
        let requests = len.div_ceil(max) as u32;
        let p = self.new_parent(token, requests, Bufs::None);
        let mut at = offset;
        for r in 0..requests {
            let n = (offset + len - at).min(max);
            let mut seg = [0u8; 16];
            seg[0..8].copy_from_slice(&(at / 512).to_le_bytes());
            seg[8..12].copy_from_slice(&((n / 512) as u32).to_le_bytes());
            seg[12..16].copy_from_slice(&flags.to_le_bytes());
            if let Err(e) = self.submit_request(p, type_, 0, &[], Some(&seg)) {
                return self.abandon(p, requests - r, e);
            }
            at += n;
        }
        Ok(())
    }

    /// Payload buffers one request may carry.
    fn data_segs_per_request(&self) -> usize {
        let seg_max = (self.limits.seg_max as usize).max(1);
        seg_max.min(self.ring.max_segs() - 2).max(1)
    }

    fn new_parent(&mut self, token: u64, remaining: u32, bufs: Bufs) -> u32 {
        self.in_flight += 1;
        let parent = Parent {
            token,
            remaining,
            result: Ok(()),
            bufs,
        };
        match self.free_parents.pop() {
            Some(i) => {
                self.parents[i as usize] = parent;
                i
            }
            None => {
                self.parents.push(parent);
                (self.parents.len() - 1) as u32
            }
        }
    }

    /// Submission of an I/O failed before any request was sent: give the buffers back.
    fn fail_parent(&mut self, p: u32, error: Error) -> SubmitError {
        self.in_flight -= 1;
        let bufs = std::mem::take(&mut self.parents[p as usize].bufs);
        self.free_parents.push(p);
        SubmitError { error, bufs }
    }

    /// `unsent` requests of parent `p` will not be sent (the device is gone). If none was
    /// sent the submission fails; otherwise the I/O completes with the error once the sent
    /// ones are accounted for.
    fn abandon(&mut self, p: u32, unsent: u32, e: Error) -> Result<(), SubmitError> {
        let parent = &mut self.parents[p as usize];
        if parent.remaining == unsent {
            return Err(self.fail_parent(p, e));
        }
        parent.remaining -= unsent;
        parent.result = Err(e.kind());
        Ok(())
    }

    /// Send one request whose payload is `data` (or, for discard / write-zeroes, the
    /// 16-byte `segment`).
    fn submit_request(
        &mut self,
        p: u32,
        type_: u32,
        sector: u64,
        data: &[Seg],
        segment: Option<&[u8; 16]>,
    ) -> Result<(), Error> {
        self.segs.clear();
        self.segs.push(HEADER_PLACEHOLDER);
        self.segs.extend_from_slice(data);
        self.submit_prepared(p, type_, sector, segment)
    }

    /// Send one request whose payload buffers are in `self.segs[1..]` (`segs[0]` is
    /// reserved for the header).
    fn submit_prepared(
        &mut self,
        p: u32,
        type_: u32,
        sector: u64,
        segment: Option<&[u8; 16]>,
    ) -> Result<(), Error> {
        let nsegs = self.segs.len()
            + 1
            + usize::from(segment.is_some())
            + usize::from(type_ == req_type::GET_ID);
        let need = self.ring.descriptors_for(nsegs);
        self.make_room(need)?;
        let head = self.ring.next_head();
        let aux = self.ring.aux(head);
        let status_ptr = self.ring.status(head);
        let hdr = RequestHeader {
            type_: type_.to_le(),
            ioprio: 0,
            sector: sector.to_le(),
        };
        // SAFETY: aux points to head's 48-byte request area in the ring's shared memory;
        // head is free, so the device is not using it.
        unsafe {
            aux.cast::<RequestHeader>().write_volatile(hdr);
            if let Some(s) = segment {
                std::ptr::copy_nonoverlapping(s.as_ptr(), aux.add(HEADER_LEN), 16);
            }
            status_ptr.write_volatile(0xFF);
        }
        // Header first, then payload, then the segment, then the status byte.
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
        if type_ == req_type::GET_ID {
            self.segs.push(Seg {
                addr: aux as u64 + HEADER_LEN as u64,
                len: ID_BYTES as u32,
                writable: true,
            });
        }
        self.segs.push(Seg {
            addr: status_ptr as u64,
            len: 1,
            writable: true,
        });
        let got = self.ring.add(&self.segs);
        debug_assert_eq!(got, Some(head));
        if got.is_none() {
            return Err(Error::new(
                ErrorKind::Protocol,
                "ring has no room after make_room".into(),
            ));
        }
        self.slots[usize::from(head)] = p;
        if self.path.after_add(self.ring.unpublished()) {
            self.unplug();
        }
        Ok(())
    }

    /// Wait until `need` descriptors are free, reaping completions into `ready`.
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
        while self.ring.num_free() < need {
            if self.dead {
                return Err(Error::new(
                    ErrorKind::Disconnected,
                    "the device disconnected".into(),
                ));
            }
            self.unplug();
            if self.reap_ring() == 0 {
                self.block(None)?;
            }
        }
        Ok(())
    }

    // ---- completion ----

    /// Reap every used entry; returns how many requests finished.
    fn reap_ring(&mut self) -> usize {
        let mut n = 0;
        while let Some(r) = self.ring.pop_used() {
            match r {
                Ok((head, _len)) => {
                    // SAFETY: status points to head's status byte in the ring's memory; the
                    // device has returned the head, so it no longer writes it.
                    let st = unsafe { self.ring.status(head).read_volatile() };
                    let result = match st {
                        status::OK => Ok(()),
                        status::IOERR => Err(ErrorKind::Io),
                        status::UNSUPP => Err(ErrorKind::Unsupported),
                        _ => Err(ErrorKind::Protocol),
                    };
                    self.finish(head, result);
                    n += 1;
                }
                Err(e) => {
                    error!("queue {}: device broke the ring: {e}", self.index);
                    self.fail_all(ErrorKind::Protocol);
                    return n;
                }
            }
        }
        n
    }

    /// Request `head` finished with `result`.
    fn finish(&mut self, head: u16, result: Result<(), ErrorKind>) {
        let p = std::mem::replace(&mut self.slots[usize::from(head)], NO_PARENT);
        let Some(parent) = self.parents.get_mut(p as usize) else {
            return;
        };
        if parent.result.is_ok() {
            parent.result = result;
        }
        parent.remaining -= 1;
        if parent.remaining == 0 {
            let c = Completion {
                token: parent.token,
                result: parent.result,
                bufs: std::mem::take(&mut parent.bufs),
            };
            self.free_parents.push(p);
            self.ready.push_back(c);
        }
    }

    /// Fail every outstanding request with `kind` and stop using the ring.
    fn fail_all(&mut self, kind: ErrorKind) {
        self.dead = true;
        self.shared.dead.store(true, Ordering::Relaxed);
        let heads: Vec<u16> = self.ring.outstanding_heads().collect();
        for h in heads {
            self.finish(h, Err(kind));
        }
        self.ring.reset_outstanding();
    }

    /// Take a finished I/O without blocking.
    pub fn poll(&mut self) -> Option<Completion> {
        if self.ready.is_empty() && self.reap_ring() == 0 && self.in_flight > 0 {
            self.idle_polls += 1;
            if self.idle_polls >= LIVENESS_EVERY {
                self.idle_polls = 0;
                if !self.dead && self.peer_gone(0) {
                    self.fail_all(ErrorKind::Disconnected);
                }
            }
        }
        let c = self.ready.pop_front()?;
        self.in_flight -= 1;
        self.idle_polls = 0;
        Some(c)
    }

    /// Wait for a finished I/O: publish anything gathered, spin on the used ring for the
    /// spin bound, then sleep on the call eventfd. `None` waits without limit.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Completion, Error> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.unplug();
        loop {
            if let Some(c) = self.poll() {
                return Ok(c);
            }
            if self.in_flight == 0 {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    "wait with nothing in flight".into(),
                ));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("no completion within {timeout:?}"),
                ));
            }
            self.block(left)?;
        }
    }

    /// Spin, then sleep until the used ring may have entries, the device leaves, or
    /// `timeout` passes (Ok either way; the caller re-checks).
    fn block(&mut self, timeout: Option<Duration>) -> Result<(), Error> {
        if self.dead {
            return Ok(());
        }
        let spin = self.spin.min(timeout.unwrap_or(self.spin));
        if !spin.is_zero() {
            // The clock is read once per SPIN_CHECKS looks at the ring: reading it costs
            // more than a look, and the spin bound need not be exact.
            let spin_until = Instant::now() + spin;
            loop {
                for _ in 0..SPIN_CHECKS {
                    if self.ring.has_used() {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
                if Instant::now() >= spin_until {
                    break;
                }
            }
        }
        if self.ring.enable_interrupts() {
            self.ring.disable_interrupts();
            return Ok(());
        }
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
        let mut fds = [
            libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.sock_fd,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        // SAFETY: fds is a valid array of two pollfd structs for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        self.ring.disable_interrupts();
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Error::os(ErrorKind::Io, "poll", e));
        }
        if fds[0].revents & libc::POLLIN != 0 {
            // The count is of no interest; this only clears the eventfd.
            let _ = self.call.read();
        }
        if fds[1].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            self.fail_all(ErrorKind::Disconnected);
        }
        Ok(())
    }

    /// Whether the device's end of the socket is closed (waiting up to `ms`).
    fn peer_gone(&self, ms: i32) -> bool {
        if self.shared.dead.load(Ordering::Relaxed) {
            return true;
        }
        let mut fd = libc::pollfd {
            fd: self.shared.sock_fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: a valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut fd, 1, ms) };
        r > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    // ---- blocking convenience API ----

    fn run_sync(&mut self, submitted: Result<(), SubmitError>) -> Result<Completion, Error> {
        submitted.map_err(|e| e.error)?;
        let c = self.wait(None)?;
        if c.token != INTERNAL_TOKEN {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "blocking calls need an idle queue".into(),
            ));
        }
        c.result.map_err(Error::from)?;
        Ok(c)
    }

    fn require_idle(&self) -> Result<(), Error> {
        if self.in_flight > 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "blocking calls need an idle queue; {} I/Os are in flight",
                    self.in_flight
                ),
            ));
        }
        Ok(())
    }

    /// Read `out.len()` bytes at `offset` (copies through a shared buffer). The queue must
    /// have nothing else in flight.
    pub fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        self.require_idle()?;
        let buf = self.alloc(out.len())?;
        let submitted = self.read(offset, buf, INTERNAL_TOKEN);
        let c = self.run_sync(submitted)?;
        let buf = c
            .bufs
            .into_one()
            .ok_or_else(|| Error::new(ErrorKind::Protocol, "buffer lost".into()))?;
        out.copy_from_slice(&buf);
        Ok(())
    }

    /// Write `data` at `offset` (copies through a shared buffer). The queue must have
    /// nothing else in flight.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.require_idle()?;
        let mut buf = self.alloc(data.len())?;
        buf.copy_from_slice(data);
        let submitted = self.write(offset, buf, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Flush and wait.
    pub fn flush_sync(&mut self) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.flush(INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Discard and wait.
    pub fn discard_sync(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.discard(offset, len, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Write zeroes and wait.
    pub fn write_zeroes_sync(&mut self, offset: u64, len: u64, unmap: bool) -> Result<(), Error> {
        self.require_idle()?;
        let submitted = self.write_zeroes(offset, len, unmap, INTERNAL_TOKEN);
        self.run_sync(submitted).map(drop)
    }

    /// Ask the device for its ID string (GET_ID). The queue must be idle.
    pub fn get_id(&mut self) -> Result<String, Error> {
        self.require_idle()?;
        if self.dead {
            return Err(ErrorKind::Disconnected.into());
        }
        let p = self.new_parent(INTERNAL_TOKEN, 1, Bufs::None);
        self.make_room(self.ring.descriptors_for(3))?;
        let head = self.ring.next_head();
        if let Err(e) = self.submit_request(p, req_type::GET_ID, 0, &[], None) {
            return Err(self.fail_parent(p, e).error);
        }
        let c = self.wait(None)?;
        c.result.map_err(Error::from)?;
        let mut id = [0u8; ID_BYTES];
        // SAFETY: head's request area holds the 20-byte answer the device wrote; the head
        // is free again and nothing else has been submitted since.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ring.aux(head).add(HEADER_LEN),
                id.as_mut_ptr(),
                ID_BYTES,
            )
        };
        let end = id.iter().position(|&b| b == 0).unwrap_or(ID_BYTES);
        Ok(String::from_utf8_lossy(&id[..end]).into_owned())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        // Buffers still lent to the device must not return to the pool while it may write
        // them: wait a little for outstanding requests, then leak what is left.
        self.unplug();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.ring.is_idle() && !self.dead && Instant::now() < deadline {
            if self.reap_ring() == 0 {
                let _ = self.block(Some(Duration::from_millis(100)));
            }
        }
        if !self.ring.is_idle() && !self.dead {
            error!(
                "queue {}: dropped with requests outstanding; their buffers are leaked",
                self.index
            );
            for p in self.parents.drain(..) {
                std::mem::forget(p.bufs);
            }
        }
    }
}
