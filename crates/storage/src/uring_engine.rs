//! The io_uring engine: one ring per engine (SQ sized to the depth, CQ twice that), an
//! eventfd registered for completions, one preallocated slot per operation in flight whose
//! index is the SQE's `user_data`. Reads and writes are `IORING_OP_READV`/`WRITEV`
//! (`RWF_DSYNC` when durable), flush is `FSYNC` with `DATASYNC`, discard and write-zeroes
//! are `FALLOCATE`, and writing zeroes (when fallocate cannot) is `WRITE` from a shared zero
//! buffer.
//!
//! An operation is carried by as many SQEs as it needs, one at a time, each started when
//! the previous one completes — never finished synchronously on the worker, so one slow or
//! short operation stalls nothing else:
//! - a short read or write continues from where it stopped (a read that meets the end of
//!   the file fills the rest with zeroes, as QEMU does; a write that makes no progress is
//!   EIO);
//! - `EAGAIN`/`EINTR` in a completion resubmits the same piece;
//! - more than `IOV_MAX` iovecs go `IOV_MAX` at a time;
//! - O_DIRECT with unaligned buffers goes through a bounce buffer of [`BOUNCE_CHUNK`]
//!   bytes, one piece at a time; an operation that finds every buffer of the pool's budget
//!   lent out waits, in order, until one comes back.
//!
//! Submission: `submit` hands every queued SQE to the kernel; when the kernel refuses
//! (`EAGAIN`/`EBUSY`) or takes only part of them, the rest stay queued and
//! [`Engine::backlog`] says so, so the caller retries rather than sleeps.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::backend::Backend;
use crate::bounce::{gather, scatter, zero_from, AlignedBuf, BOUNCE_CHUNK, IOV_MAX};
use crate::engine::{
    check_range, errno, iov_slice, iov_total, Completion, CompletionRing, Dir, Engine, Full, Op,
};
use crate::error::Error;
use crate::sysio::{fdatasync, unsupported, SyncIo, ZeroStage, PUNCH_HOLE};

/// Bytes one write-zeroes SQE writes when fallocate cannot zero.
const ZERO_CHUNK: usize = 1 << 20;
/// Consecutive EAGAIN completions of one piece before it is failed with EIO.
const MAX_RETRIES: u32 = 10_000;

/// What a slot is doing.
#[derive(Clone, Copy, Debug)]
enum Work {
    Idle,
    Rw {
        dir: Dir,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        total: u64,
        durable: bool,
        /// Bytes transferred so far.
        done: u64,
        /// RWF_DSYNC was refused: fdatasync once all bytes are written.
        sync_after: bool,
    },
    Flush,
    Discard {
        offset: u64,
        len: u64,
    },
    Zeroes {
        offset: u64,
        len: u64,
        stage: ZeroStage,
        /// Bytes written so far (the Write stage).
        done: u64,
    },
}

/// The state of one operation in flight.
struct Slot {
    token: u64,
    work: Work,
    /// Consecutive EAGAIN answers to the current piece.
    retries: u32,
    /// The bounce buffer, while O_DIRECT needs one.
    bounce: Option<AlignedBuf>,
    /// The single iovec the SQE points to when it cannot point into the caller's array
    /// (the bounce buffer, or the rest of a partly transferred iovec). The SQE points
    /// here, so it must not move: slots live in a boxed slice that is never resized.
    biov: libc::iovec,
}

/// What happens next to a slot.
enum Step {
    /// Queue this SQE.
    Sqe(squeue::Entry),
    /// Wait for a bounce buffer.
    Wait,
    /// Finished.
    Done(io::Result<u64>),
}

/// io_uring engine for files and block devices.
pub(crate) struct UringEngine {
    ring: IoUring,
    event: OwnedFd,
    /// Whether the eventfd may have been signalled since it was last drained.
    needs_drain: bool,
    io: SyncIo,
    slots: Box<[Slot]>,
    free: Vec<u32>,
    /// Finished operations not yet reaped.
    ready: CompletionRing,
    /// Slots waiting for a bounce buffer, oldest first.
    waiting: VecDeque<u32>,
    /// Zeroes for write-zeroes without fallocate (allocated on first use).
    zero: Option<AlignedBuf>,
    /// Pushed and not reaped.
    in_flight: usize,
    /// SQEs queued in the SQ that the kernel has not accepted.
    sq_pending: usize,
    /// SQEs the kernel accepted whose CQE has not been seen.
    in_kernel: usize,
    depth: usize,
    /// Tests: how many upcoming submits answer EAGAIN without reaching the kernel.
    #[cfg(test)]
    fail_submits: usize,
}

// SAFETY: the raw pointers in slots (iovec arrays, buffers) are lent under the
// `Engine::push` contract and valid from any thread; the ring, eventfd and bounce
// buffers are owned by the engine and used by one thread at a time (`&mut self`).
unsafe impl Send for UringEngine {}

impl UringEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: u32) -> Result<Self, Error> {
        let setup = |source| Error::EngineSetup {
            engine: "io_uring",
            depth,
            source,
        };
        let ring = IoUring::builder()
            .setup_cqsize(depth * 2)
            .build(depth)
            .map_err(setup)?;
        // SAFETY: plain syscall; flags are valid.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(setup(io::Error::last_os_error()));
        }
        // SAFETY: eventfd just returned this descriptor and nothing else owns it.
        let event = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter()
            .register_eventfd(event.as_raw_fd())
            .map_err(setup)?;

        let n = depth as usize;
        let slots = (0..n)
            .map(|_| Slot {
                token: 0,
                work: Work::Idle,
                retries: 0,
                bounce: None,
                biov: libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                },
            })
            .collect();
        Ok(UringEngine {
            ring,
            event,
            needs_drain: false,
            io: SyncIo::new(backend),
            slots,
            free: (0..depth).rev().collect(),
            ready: CompletionRing::new(n),
            waiting: VecDeque::with_capacity(n),
            zero: None,
            in_flight: 0,
            sq_pending: 0,
            in_kernel: 0,
            depth: n,
            #[cfg(test)]
            fail_submits: 0,
        })
    }

    /// Checks `op` and turns it into a slot's work.
    ///
    /// # Safety
    /// The push contract holds for `op`.
    unsafe fn plan(&self, op: Op) -> io::Result<Work> {
        let size = self.io.backend.size();
        Ok(match op {
            Op::Read {
                offset,
                iov,
                iovcnt,
            }
            | Op::Write {
                offset,
                iov,
                iovcnt,
                ..
            } => {
                // SAFETY: the push contract keeps the iovec array valid.
                let total = iov_total(unsafe { iov_slice(iov, iovcnt) }?)?;
                check_range(offset, total, size)?;
                usize::try_from(total).map_err(|_| errno(libc::EINVAL))?;
                let (dir, durable) = match op {
                    Op::Write { durable, .. } => (Dir::Write, durable),
                    _ => (Dir::Read, false),
                };
                Work::Rw {
                    dir,
                    offset,
                    iov,
                    iovcnt,
                    total,
                    durable,
                    done: 0,
                    sync_after: false,
                }
            }
            Op::Flush => Work::Flush,
            Op::Discard { offset, len } => {
                check_range(offset, len, size)?;
                Work::Discard { offset, len }
            }
            Op::WriteZeroes { offset, len, unmap } => {
                check_range(offset, len, size)?;
                Work::Zeroes {
                    offset,
                    len,
                    stage: ZeroStage::first(&self.io.backend.caps, unmap),
                    done: 0,
                }
            }
        })
    }

    /// Start the next piece of slot `idx`, or finish it.
    fn advance(&mut self, idx: usize) {
        match self.step(idx) {
            Ok(Step::Sqe(entry)) => {
                let entry = entry.user_data(idx as u64);
                // SAFETY: everything the SQE points to stays valid until its CQE is seen:
                // the caller's iovecs and buffers by the push contract, the slot's iovec
                // and bounce buffer because slot `idx` is neither reused nor dropped
                // before that CQE (Drop waits for all of them), the zero buffer because
                // it lives as long as the engine.
                if unsafe { self.ring.submission().push(&entry) }.is_err() {
                    // Cannot happen: a slot has at most one SQE queued or in the kernel,
                    // and the SQ holds `depth` entries.
                    log::error!(
                        "io_uring submission queue full with {} in flight",
                        self.in_flight
                    );
                    self.finish(idx, Err(errno(libc::EAGAIN)));
                    return;
                }
                self.sq_pending += 1;
            }
            Ok(Step::Wait) => self.waiting.push_back(idx as u32),
            Ok(Step::Done(result)) => self.finish(idx, result),
            Err(e) => self.finish(idx, Err(e)),
        }
    }

    /// What slot `idx` does next.
    fn step(&mut self, idx: usize) -> io::Result<Step> {
        let fd = types::Fd(self.io.fd);
        let dio = self.io.dio;
        let slot = &mut self.slots[idx];
        Ok(match slot.work {
            Work::Idle => Step::Done(Err(errno(libc::EINVAL))),
            Work::Rw {
                dir,
                offset,
                iov,
                iovcnt,
                total,
                durable,
                done,
                sync_after,
            } => {
                if done >= total {
                    if sync_after {
                        fdatasync(self.io.fd)?;
                    }
                    return Ok(Step::Done(Ok(total)));
                }
                // SAFETY: checked in `plan`; the push contract keeps it valid.
                let user = unsafe { iov_slice(iov, iovcnt) }?;
                let at = offset + done;
                let (ptr, cnt) = match dio {
                    Some(dio) if !dio.fits(user) => {
                        if slot.bounce.is_none() {
                            match self.io.bounce.take() {
                                Some(buf) => slot.bounce = Some(buf),
                                None => return Ok(Step::Wait),
                            }
                        }
                        let Some(buf) = slot.bounce.as_ref() else {
                            return Ok(Step::Wait);
                        };
                        // plan() checked that total fits in usize.
                        let n = ((total - done) as usize).min(BOUNCE_CHUNK);
                        if dir == Dir::Write {
                            // SAFETY: the caller's buffers are readable for `total` bytes
                            // and done + n <= total; the bounce holds BOUNCE_CHUNK >= n.
                            unsafe { gather(user, done as usize, n, buf.as_mut_ptr()) };
                        }
                        slot.biov = libc::iovec {
                            iov_base: buf.as_mut_ptr().cast(),
                            iov_len: n,
                        };
                        (&slot.biov as *const libc::iovec, 1)
                    }
                    _ => {
                        let (i, skip) = locate(user, done);
                        if skip > 0 {
                            let v = user[i];
                            // SAFETY: skip < iov_len, so the pointer stays in the buffer.
                            let base = unsafe { v.iov_base.cast::<u8>().add(skip) };
                            slot.biov = libc::iovec {
                                iov_base: base.cast(),
                                iov_len: v.iov_len - skip,
                            };
                            (&slot.biov as *const libc::iovec, 1)
                        } else {
                            (
                                &user[i] as *const libc::iovec,
                                (user.len() - i).min(IOV_MAX),
                            )
                        }
                    }
                };
                let cnt = cnt as u32;
                Step::Sqe(match dir {
                    Dir::Read => opcode::Readv::new(fd, ptr, cnt).offset(at).build(),
                    Dir::Write => opcode::Writev::new(fd, ptr, cnt)
                        .offset(at)
                        .rw_flags(if durable { libc::RWF_DSYNC } else { 0 })
                        .build(),
                })
            }
            Work::Flush => Step::Sqe(
                opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
            ),
            Work::Discard { offset, len } => Step::Sqe(
                opcode::Fallocate::new(fd, len)
                    .offset(offset)
                    .mode(PUNCH_HOLE)
                    .build(),
            ),
            Work::Zeroes {
                offset,
                len,
                stage,
                done,
            } => match stage.mode() {
                Some(mode) => Step::Sqe(
                    opcode::Fallocate::new(fd, len)
                        .offset(offset)
                        .mode(mode)
                        .build(),
                ),
                None if done >= len => Step::Done(Ok(0)),
                None => {
                    if self.zero.is_none() {
                        self.zero = Some(AlignedBuf::new(ZERO_CHUNK, 4096)?);
                    }
                    let zero = self
                        .zero
                        .as_ref()
                        .map_or(std::ptr::null(), |z| z.as_mut_ptr());
                    let n = (len - done).min(ZERO_CHUNK as u64) as u32;
                    Step::Sqe(
                        opcode::Write::new(fd, zero, n)
                            .offset(offset + done)
                            .build(),
                    )
                }
            },
        })
    }

    /// Slot `idx`'s SQE completed with `res` (bytes or -errno).
    fn on_cqe(&mut self, idx: usize, res: i32) {
        let code = (res < 0).then_some(-res);
        let retry = matches!(code, Some(libc::EAGAIN | libc::EINTR));
        let slot = &mut self.slots[idx];
        if retry {
            slot.retries += 1;
            if slot.retries > MAX_RETRIES {
                self.finish(idx, Err(errno(libc::EIO)));
            } else {
                self.advance(idx);
            }
            return;
        }
        slot.retries = 0;
        let result = match &mut slot.work {
            Work::Idle => Some(Err(errno(libc::EIO))),
            Work::Rw {
                dir,
                iov,
                iovcnt,
                total,
                durable,
                done,
                sync_after,
                ..
            } => match code {
                Some(libc::EOPNOTSUPP) if *durable => {
                    // No RWF_DSYNC here: write plainly, fdatasync at the end.
                    *durable = false;
                    *sync_after = true;
                    None
                }
                Some(c) => Some(Err(errno(c))),
                None if res == 0 && *dir == Dir::Write => Some(Err(errno(libc::EIO))),
                None if res == 0 => {
                    // End of file: the rest reads as zeroes.
                    // SAFETY: checked at push; the push contract keeps the caller's
                    // buffers valid and writable (a read).
                    match unsafe { iov_slice(*iov, *iovcnt) } {
                        Ok(user) => {
                            // SAFETY: as above; done < total fits in usize.
                            unsafe { zero_from(user, *done as usize) };
                            *done = *total;
                            None
                        }
                        Err(e) => Some(Err(e)),
                    }
                }
                None => {
                    let n = (res as u64).min(*total - *done);
                    let mut failed = None;
                    if let (Dir::Read, Some(buf)) = (*dir, &slot.bounce) {
                        // SAFETY: checked at push; the push contract keeps it valid.
                        match unsafe { iov_slice(*iov, *iovcnt) } {
                            // SAFETY: the bounce holds the `n` bytes just read; the
                            // caller's buffers are writable (a read) for done + n <= total.
                            Ok(user) => unsafe {
                                scatter(buf.as_mut_ptr(), n as usize, user, *done as usize)
                            },
                            Err(e) => failed = Some(e),
                        }
                    }
                    match failed {
                        Some(e) => Some(Err(e)),
                        None => {
                            *done += n;
                            None
                        }
                    }
                }
            },
            Work::Flush => Some(code.map_or(Ok(0), |c| Err(errno(c)))),
            Work::Discard { offset, len } => Some(match code {
                Some(c) => self.io.discard_failed(errno(c), *offset, *len),
                None => Ok(0),
            }),
            Work::Zeroes {
                len, stage, done, ..
            } => match (stage.mode(), code) {
                (Some(_), Some(c)) if unsupported(c) => {
                    *stage = stage.after(c, &self.io.backend.caps);
                    None
                }
                (Some(_), Some(c)) => Some(Err(errno(c))),
                (Some(_), None) => Some(Ok(0)),
                (None, Some(c)) => Some(Err(errno(c))),
                (None, None) if res == 0 => Some(Err(errno(libc::EIO))),
                (None, None) => {
                    *done = (*done + res as u64).min(*len);
                    None
                }
            },
        };
        match result {
            Some(r) => self.finish(idx, r),
            None => self.advance(idx),
        }
    }

    /// Slot `idx` is done: hand its completion over, free it, and let a waiting
    /// operation have its bounce buffer.
    fn finish(&mut self, idx: usize, result: io::Result<u64>) {
        let slot = &mut self.slots[idx];
        let token = slot.token;
        slot.work = Work::Idle;
        slot.retries = 0;
        let freed = slot.bounce.take();
        // idx < depth <= MAX_DEPTH, so it fits in u32.
        self.free.push(idx as u32);
        self.ready.push(token, result);
        if let Some(buf) = freed {
            self.io.bounce.give(buf);
            if let Some(next) = self.waiting.pop_front() {
                self.advance(next as usize);
            }
        }
    }

    /// Hand queued SQEs to the kernel; what it refuses stays queued.
    fn submit_sqes(&mut self) -> io::Result<()> {
        while self.sq_pending > 0 {
            #[cfg(test)]
            if self.fail_submits > 0 {
                self.fail_submits -= 1;
                break;
            }
            match self.ring.submit() {
                Ok(n) => {
                    self.needs_drain = true;
                    let n = n.min(self.sq_pending);
                    self.sq_pending -= n;
                    self.in_kernel += n;
                    if n == 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of resources: the SQEs stay queued for the next submit.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Empties the eventfd (non-blocking), so a level-triggered poll on it sleeps
    /// until the next completion.
    fn drain_eventfd(&mut self) {
        if !self.needs_drain {
            return;
        }
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        unsafe { libc::read(self.event.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        // Completions can signal it again only while operations are in the kernel.
        self.needs_drain = self.in_kernel > 0;
    }

    /// Process every CQE that has arrived; returns how many.
    fn process_cqes(&mut self) -> usize {
        let mut n = 0;
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                break;
            };
            n += 1;
            self.in_kernel = self.in_kernel.saturating_sub(1);
            match usize::try_from(cqe.user_data()) {
                Ok(idx) if idx < self.depth && !matches!(self.slots[idx].work, Work::Idle) => {
                    self.on_cqe(idx, cqe.result())
                }
                _ => log::error!("io_uring completion for unknown slot {}", cqe.user_data()),
            }
        }
        n
    }
}

/// The iovec holding byte `pos` of `iov`, and how far into it.
fn locate(iov: &[libc::iovec], mut pos: u64) -> (usize, usize) {
    for (i, v) in iov.iter().enumerate() {
        let len = v.iov_len as u64;
        if pos < len {
            return (i, pos as usize);
        }
        pos -= len;
    }
    (iov.len(), 0)
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.depth {
            return Err(Full);
        }
        self.in_flight += 1;
        // SAFETY: the caller's push contract, forwarded.
        match unsafe { self.plan(op) } {
            Ok(work) => {
                // in_flight <= depth and every busy slot is in flight, so one is free.
                let Some(idx) = self.free.pop() else {
                    self.ready.push(token, Err(errno(libc::EAGAIN)));
                    return Ok(());
                };
                let slot = &mut self.slots[idx as usize];
                slot.token = token;
                slot.work = work;
                slot.retries = 0;
                self.advance(idx as usize);
            }
            Err(e) => self.ready.push(token, Err(e)),
        }
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        self.submit_sqes()
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        // Drain the eventfd only when there is something to reap: a poller calling reap
        // in a loop would otherwise make a syscall per call. Draining before reading the
        // CQ means a completion posted afterwards signals the eventfd again.
        if !self.ring.completion().is_empty() {
            self.drain_eventfd();
            self.process_cqes();
            if self.sq_pending > 0 {
                // Continuations (the next piece of a short or split transfer).
                if let Err(e) = self.submit_sqes() {
                    log::warn!("io_uring: submitting continuations failed: {e}");
                }
            }
        }
        let n = self.ready.drain(f);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        loop {
            if self.in_flight == 0 || !self.ready.is_empty() {
                return Ok(());
            }
            self.submit_sqes()?;
            if !self.ring.completion().is_empty() {
                self.process_cqes();
                continue;
            }
            if self.in_kernel == 0 {
                // Everything left is queued and the kernel refuses it for now.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(n) => {
                    self.needs_drain = true;
                    let n = n.min(self.sq_pending);
                    self.sq_pending -= n;
                    self.in_kernel += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn backlog(&self) -> usize {
        self.sq_pending
    }
}

impl Drop for UringEngine {
    /// Waits for every submitted SQE to complete: the kernel may still be reading or
    /// writing the caller's buffers and our bounce buffers until then. Queued SQEs the
    /// kernel never took are dropped with the ring.
    fn drop(&mut self) {
        while self.in_kernel > 0 {
            if let Err(e) = self.ring.submitter().submit_and_wait(1) {
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!(
                        "io_uring engine drop: waiting for {} operations: {e}",
                        self.in_kernel
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            while let Some(_cqe) = self.ring.completion().next() {
                self.in_kernel -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheMode, DiskSpec, OpenOptions};

    fn scratch() -> tempfile::TempDir {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        tempfile::Builder::new()
            .prefix("vblk-uring-")
            .tempdir_in(target)
            .unwrap()
    }

    /// The kernel refusing submissions (EAGAIN) leaves work queued and visible as
    /// backlog; nothing is lost, and the next submit hands it over.
    #[test]
    fn refused_submissions_stay_queued() {
        let dir = scratch();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0x5au8; 1 << 20]).unwrap();
        let b = Arc::new(
            Backend::open(
                &DiskSpec::File(path),
                &OpenOptions {
                    read_only: false,
                    cache: CacheMode::Writeback,
                    prealloc: false,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let mut e = UringEngine::new(b, 8).unwrap();
        let mut bufs = vec![vec![0u8; 4096]; 4];
        let iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        e.fail_submits = 3;
        for (i, v) in iovs.iter().enumerate() {
            // SAFETY: the buffers and iovecs outlive the engine's use of them (reaped
            // below before they drop).
            unsafe {
                e.push(
                    i as u64,
                    Op::Read {
                        offset: 4096 * i as u64,
                        iov: v,
                        iovcnt: 1,
                    },
                )
            }
            .unwrap();
        }
        e.submit().unwrap();
        assert_eq!(e.backlog(), 4, "refused: still queued");
        e.submit().unwrap();
        e.submit().unwrap();
        assert_eq!(e.backlog(), 4);
        e.submit().unwrap();
        assert_eq!(e.backlog(), 0, "accepted on the next try");
        let mut got = Vec::new();
        while got.len() < 4 {
            e.wait().unwrap();
            e.reap(&mut |c| got.push((c.token, c.result.unwrap())));
        }
        got.sort();
        assert_eq!(got, vec![(0, 4096), (1, 4096), (2, 4096), (3, 4096)]);
        assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0x5a)));
    }
}
