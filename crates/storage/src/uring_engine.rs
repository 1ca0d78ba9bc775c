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
//! - O_DIRECT with unaligned buffers goes through a bounce buffer of
//!   [`BOUNCE_CHUNK`](crate::bounce::BOUNCE_CHUNK) bytes, one piece at a time; an
//!   operation that finds every buffer of the pool's budget lent out waits, in order,
//!   until one comes back.
//!
//! The slots and the read/write pieces are [`crate::carry`]'s, shared with the aio engine.
//!
//! Submission: `submit` hands every queued SQE to the kernel; when the kernel refuses
//! (`EAGAIN`/`EBUSY`) or takes only part of them, the rest stay queued and
//! [`Engine::backlog`] says so, so the caller retries rather than sleeps.
//!
//! The ring is restricted (`IORING_REGISTER_RESTRICTIONS`) before it is enabled: its
//! SQEs may carry only the opcodes above and no SQE flag, and no register operation is
//! allowed after that. A seccomp filter cannot see what a ring does; this is what keeps a
//! compromised daemon from using its rings for what seccomp forbids (opening files,
//! sockets, connects, ...). The ring can still read and write the descriptors the process
//! holds, which the allowed system calls can too (docs/security.md). The disk is not
//! registered as a fixed file: a registered file lives until the kernel tears the ring
//! down, after the engine is dropped, and would keep its image locks past the daemon's
//! end.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::backend::Backend;
use crate::bounce::AlignedBuf;
use crate::carry::{Piece, Slots, Work};
use crate::engine::{errno, Completion, Dir, Engine, Full, Op};
use crate::error::Error;
use crate::sysio::{fdatasync, unsupported, SyncIo, PUNCH_HOLE};

/// Bytes one write-zeroes SQE writes when fallocate cannot zero.
const ZERO_CHUNK: usize = 1 << 20;
/// What the ring may do: the opcodes the engine uses, with no SQE flag (none is
/// allowed unless listed).
pub(crate) fn restrictions() -> [io_uring::register::Restriction; 5] {
    use io_uring::register::Restriction;
    [
        Restriction::sqe_op(opcode::Readv::CODE),
        Restriction::sqe_op(opcode::Writev::CODE),
        Restriction::sqe_op(opcode::Write::CODE),
        Restriction::sqe_op(opcode::Fsync::CODE),
        Restriction::sqe_op(opcode::Fallocate::CODE),
    ]
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
    slots: Slots,
    /// Zeroes for write-zeroes without fallocate (allocated on first use).
    zero: Option<AlignedBuf>,
    /// Pushed and not reaped.
    in_flight: usize,
    /// SQEs queued in the SQ that the kernel has not accepted.
    sq_pending: usize,
    /// SQEs the kernel accepted whose CQE has not been seen.
    in_kernel: usize,
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
            .setup_r_disabled()
            .build(depth)
            .map_err(setup)?;
        // SAFETY: plain syscall; flags are valid.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(setup(io::Error::last_os_error()));
        }
        // SAFETY: eventfd just returned this descriptor and nothing else owns it.
        let event = unsafe { OwnedFd::from_raw_fd(efd) };
        let submitter = ring.submitter();
        submitter
            .register_eventfd(event.as_raw_fd())
            .map_err(setup)?;
        submitter
            .register_restrictions(&mut restrictions())
            .map_err(setup)?;
        submitter.register_enable_rings().map_err(setup)?;
        Ok(UringEngine {
            ring,
            event,
            needs_drain: false,
            io: SyncIo::new(backend),
            slots: Slots::new(depth as usize),
            zero: None,
            in_flight: 0,
            sq_pending: 0,
            in_kernel: 0,
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
            Ok(Step::Wait) => self.slots.wait_for_bounce(idx),
            Ok(Step::Done(result)) => self.finish(idx, result),
            Err(e) => self.finish(idx, Err(e)),
        }
    }

    /// What slot `idx` does next.
    fn step(&mut self, idx: usize) -> io::Result<Step> {
        let fd = types::Fd(self.io.fd);
        let slot = self.slots.get_mut(idx);
        Ok(match slot.work {
            Work::Idle | Work::Offloaded { .. } => Step::Done(Err(errno(libc::EINVAL))),
            Work::Rw(_) => match slot.rw_piece(&mut self.io)? {
                Piece::Wait => Step::Wait,
                Piece::Finished { total, sync_after } => {
                    if sync_after {
                        fdatasync(self.io.fd)?;
                    }
                    Step::Done(Ok(total))
                }
                Piece::Io {
                    dir,
                    at,
                    iov,
                    cnt,
                    dsync,
                } => Step::Sqe(match dir {
                    Dir::Read => opcode::Readv::new(fd, iov, cnt).offset(at).build(),
                    Dir::Write => opcode::Writev::new(fd, iov, cnt)
                        .offset(at)
                        .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                        .build(),
                }),
            },
            Work::Flush | Work::SyncThen => Step::Sqe(
                opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
            ),
            Work::Discard { offset, len, .. } => Step::Sqe(
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
                durable,
            } => match stage.mode() {
                Some(mode) => Step::Sqe(
                    opcode::Fallocate::new(fd, len)
                        .offset(offset)
                        .mode(mode)
                        .build(),
                ),
                None if done >= len && durable => {
                    slot.work = Work::SyncThen;
                    Step::Sqe(
                        opcode::Fsync::new(fd)
                            .flags(types::FsyncFlags::DATASYNC)
                            .build(),
                    )
                }
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
        let slot = self.slots.get_mut(idx);
        if matches!(code, Some(libc::EAGAIN | libc::EINTR)) {
            if slot.retry() {
                self.advance(idx);
            } else {
                self.finish(idx, Err(errno(libc::EIO)));
            }
            return;
        }
        slot.retries = 0;
        let result = match &mut slot.work {
            Work::Idle | Work::Offloaded { .. } => Some(Err(errno(libc::EIO))),
            Work::Rw(_) => slot.rw_result(i64::from(res)),
            Work::Flush | Work::SyncThen => Some(code.map_or(Ok(0), |c| Err(errno(c)))),
            Work::Discard { offset, len, .. } => Some(match code {
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
        // A durable discard or write-zeroes that did its work is made durable before it
        // completes: an fdatasync SQE of its own.
        if let (Some(Ok(_)), Some(next)) = (&result, slot.work.then_sync()) {
            slot.work = next;
            self.advance(idx);
            return;
        }
        match result {
            Some(r) => self.finish(idx, r),
            None => self.advance(idx),
        }
    }

    /// Slot `idx` is done: hand its completion over, free it, and let a waiting
    /// operation have its bounce buffer.
    fn finish(&mut self, idx: usize, result: io::Result<u64>) {
        if let Some(next) = self.slots.finish(idx, result, &mut self.io.bounce) {
            self.advance(next);
        }
    }

    /// Hand queued SQEs to the kernel; what it refuses stays queued.
    fn submit_sqes(&mut self) -> io::Result<()> {
        while self.sq_pending > 0 {
            if self.io.backend.take_refusal() {
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
                Ok(idx) if self.slots.busy(idx).is_some() => self.on_cqe(idx, cqe.result()),
                _ => log::error!("io_uring completion for unknown slot {}", cqe.user_data()),
            }
        }
        n
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.slots.len() {
            return Err(Full);
        }
        self.in_flight += 1;
        // SAFETY: the caller's push contract, forwarded. in_flight <= depth and every
        // busy slot is in flight, so a slot is free.
        if let Some(idx) = unsafe { self.slots.plan_and_start(&self.io, token, op) } {
            self.advance(idx);
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
        let n = self.slots.ready.drain(f);
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        loop {
            if self.in_flight == 0 || !self.slots.ready.is_empty() {
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
    use crate::{DiskSpec, OpenOptions};

    /// The ring refuses what the engine never does: an opcode outside its list (OPENAT,
    /// CONNECT), and SQE flags (a linked chain); it does what the engine does.
    #[test]
    fn the_ring_refuses_opcodes_and_files_outside_its_restrictions() {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let dir = tempfile::tempdir_in(target).unwrap();
        let path = dir.path().join("r.img");
        std::fs::write(&path, vec![5u8; 65536]).unwrap();
        let b = Arc::new(Backend::open(&DiskSpec::File(path), &OpenOptions::default()).unwrap());
        let mut e = UringEngine::new(b.clone(), 8).unwrap();
        let mut buf = vec![0u8; 512];
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 512,
        };
        let name = c"/etc/passwd";
        let entries = [
            opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), name.as_ptr())
                .build()
                .user_data(1),
            opcode::Readv::new(types::Fd(b.fd()), &iov, 1)
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data(2),
            opcode::Readv::new(types::Fd(b.fd()), &iov, 1)
                .build()
                .user_data(3),
        ];
        // One at a time: a refused SQE ends the submission of those after it.
        let mut got: Vec<(u64, i32)> = Vec::new();
        for entry in &entries {
            // SAFETY: the path and the iovec's buffer outlive the ring's use of them (we
            // wait for the completion right below).
            unsafe { e.ring.submission().push(entry) }.unwrap();
            e.ring.submitter().submit_and_wait(1).unwrap();
            got.extend(e.ring.completion().map(|c| (c.user_data(), c.result())));
        }
        assert_eq!(got[0], (1, -libc::EACCES), "OPENAT is not allowed");
        assert_eq!(got[1], (2, -libc::EACCES), "SQE flags are not allowed");
        assert_eq!(got[2], (3, 512), "a plain read of the disk is");
        assert_eq!(buf, vec![5u8; 512]);
    }
}
