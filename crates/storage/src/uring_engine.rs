//! The io_uring engine: one ring per engine (SQ sized to the depth, CQ twice
//! that), an eventfd registered for completions, one preallocated slot per
//! operation in flight whose index is the SQE's `user_data`. Reads and writes are
//! `IORING_OP_READV`/`WRITEV` (`RWF_DSYNC` when durable), flush is `FSYNC` with
//! `DATASYNC`, discard and write-zeroes are `FALLOCATE`. What the ring cannot
//! finish — a short transfer, an unsupported fallocate mode — is finished
//! synchronously when its completion is reaped.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring};

use crate::backend::Backend;
use crate::bounce::{gather, scatter, AlignedBuf, IOV_MAX};
use crate::engine::{
    check_range, errno, iov_slice, iov_total, Completion, CompletionRing, Dir, Engine, Full, Op,
};
use crate::error::Error;
use crate::sysio::{rw_from, unsupported, SyncIo, ZeroStage, PUNCH_HOLE};

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
    },
}

/// The state of one operation in flight.
struct Slot {
    token: u64,
    work: Work,
    /// The bounce buffer, when O_DIRECT needed one.
    bounce: Option<AlignedBuf>,
    /// The single iovec naming `bounce`; the SQE points here, so it must not move
    /// (slots live in a boxed slice that is never resized).
    biov: libc::iovec,
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
    /// Completions that did not come from the ring (checks that failed at push,
    /// work done synchronously in submit).
    ready: CompletionRing,
    /// Slots whose work is done synchronously in `submit`.
    deferred: Vec<u32>,
    /// Pushed and not reaped.
    in_flight: usize,
    /// SQEs pushed to the ring whose CQE has not been seen.
    in_kernel: usize,
    depth: usize,
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
            io: SyncIo::new(backend, n),
            slots,
            free: (0..depth).rev().collect(),
            ready: CompletionRing::new(n),
            deferred: Vec::with_capacity(n),
            in_flight: 0,
            in_kernel: 0,
            depth: n,
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
                }
            }
        })
    }

    /// Puts `work` in a free slot and queues its SQE (or defers it).
    fn start(&mut self, token: u64, work: Work) -> io::Result<()> {
        let Some(idx) = self.free.pop() else {
            return Err(errno(libc::EAGAIN));
        };
        let slot = &mut self.slots[idx as usize];
        slot.token = token;
        slot.work = work;
        let entry = match self.entry(idx as usize, work) {
            Ok(Some(entry)) => entry.user_data(u64::from(idx)),
            Ok(None) => {
                // Done synchronously in `submit`.
                self.deferred.push(idx);
                return Ok(());
            }
            Err(e) => {
                self.release(idx as usize);
                return Err(e);
            }
        };
        // SAFETY: everything the SQE points to stays valid until its CQE is seen:
        // the caller's iovecs and buffers by the push contract, the bounce iovec and
        // buffer because they live in slot `idx`, which is neither reused nor
        // dropped before that CQE (Drop waits for all of them).
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            // Cannot happen: the SQ holds at least `depth` entries.
            log::error!(
                "io_uring submission queue full with {} in flight",
                self.in_flight
            );
            self.release(idx as usize);
            return Err(errno(libc::EAGAIN));
        }
        self.in_kernel += 1;
        Ok(())
    }

    /// The SQE for slot `idx` doing `work` (gathering a write into a bounce buffer
    /// when O_DIRECT needs one); None when the work is done synchronously instead.
    fn entry(&mut self, idx: usize, work: Work) -> io::Result<Option<squeue::Entry>> {
        let fd = types::Fd(self.io.fd);
        let slot = &mut self.slots[idx];
        Ok(Some(match work {
            Work::Idle => return Err(errno(libc::EINVAL)),
            Work::Rw {
                dir,
                offset,
                iov,
                iovcnt,
                total,
                durable,
            } => {
                // SAFETY: checked in `plan`; the push contract keeps it valid.
                let user = unsafe { iov_slice(iov, iovcnt) }?;
                let (ptr, cnt) = match self.io.dio {
                    Some(dio) if !dio.fits(user) => {
                        let len = usize::try_from(total).map_err(|_| errno(libc::EINVAL))?;
                        let buf = self.io.bounce.take(len)?;
                        if dir == Dir::Write {
                            // SAFETY: the caller's buffers are readable; the bounce
                            // holds at least `len` bytes.
                            unsafe { gather(user, buf.as_mut_ptr()) };
                        }
                        slot.biov = libc::iovec {
                            iov_base: buf.as_mut_ptr().cast(),
                            iov_len: len,
                        };
                        slot.bounce = Some(buf);
                        (&slot.biov as *const libc::iovec, 1)
                    }
                    // Too many iovecs for one READV/WRITEV: done in pieces.
                    _ if user.len() > IOV_MAX => return Ok(None),
                    _ => (iov, iovcnt),
                };
                match dir {
                    Dir::Read => opcode::Readv::new(fd, ptr, cnt).offset(offset).build(),
                    Dir::Write => opcode::Writev::new(fd, ptr, cnt)
                        .offset(offset)
                        .rw_flags(if durable { libc::RWF_DSYNC } else { 0 })
                        .build(),
                }
            }
            Work::Flush => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Work::Discard { offset, len } => opcode::Fallocate::new(fd, len)
                .offset(offset)
                .mode(PUNCH_HOLE)
                .build(),
            Work::Zeroes { offset, len, stage } => match stage.mode() {
                Some(mode) => opcode::Fallocate::new(fd, len)
                    .offset(offset)
                    .mode(mode)
                    .build(),
                None => return Ok(None),
            },
        }))
    }

    /// Frees slot `idx` and returns its bounce buffer to the pool.
    fn release(&mut self, idx: usize) {
        let slot = &mut self.slots[idx];
        slot.work = Work::Idle;
        if let Some(buf) = slot.bounce.take() {
            self.io.bounce.give(buf);
        }
        // idx < depth <= MAX_DEPTH, so it fits in u32.
        self.free.push(idx as u32);
    }

    /// Finishes slot `idx` whose ring operation returned `res` (bytes or -errno),
    /// completing synchronously what the ring left undone.
    fn finish(&mut self, idx: usize, res: i32) -> io::Result<u64> {
        let slot = &mut self.slots[idx];
        let failed = (res < 0).then(|| errno(-res));
        match slot.work {
            Work::Idle => Err(errno(libc::EIO)),
            Work::Rw {
                dir,
                offset,
                iov,
                iovcnt,
                total,
                durable,
            } => {
                let done = u64::try_from(res).unwrap_or(0);
                // SAFETY: checked at push; the push contract keeps it valid.
                let user = unsafe { iov_slice(iov, iovcnt) }?;
                let bounced = slot.bounce.is_some();
                let target = if bounced {
                    std::slice::from_ref(&slot.biov)
                } else {
                    user
                };
                let result = match failed {
                    Some(e) if !matches!(-res, libc::EAGAIN | libc::EINTR) => Err(e),
                    _ if done >= total => Ok(total),
                    // SAFETY: `target` names the caller's buffers (push contract) or
                    // this slot's bounce buffer, idle now that its CQE is in.
                    _ => unsafe { rw_from(self.io.fd, dir, offset, target, total, done, durable) },
                };
                if let (true, Dir::Read, Ok(_)) = (bounced, dir, &result) {
                    // SAFETY: the bounce holds `total` bytes just read; the caller's
                    // buffers are writable (push contract) and distinct from it.
                    unsafe { scatter(slot.biov.iov_base.cast(), total as usize, user) };
                }
                result
            }
            Work::Flush => failed.map_or(Ok(0), Err),
            Work::Discard { offset, len } => match failed {
                Some(e) => self.io.discard_failed(e, offset, len),
                None => Ok(0),
            },
            Work::Zeroes { offset, len, stage } => match failed {
                Some(_) if unsupported(-res) => {
                    let next = stage.after(-res, &self.io.backend.caps);
                    self.io.write_zeroes_from(next, offset, len)
                }
                Some(e) => Err(e),
                None => Ok(0),
            },
        }
    }

    /// Does the deferred slots' work now.
    fn run_deferred(&mut self) {
        while let Some(idx) = self.deferred.pop() {
            let idx = idx as usize;
            let slot = &self.slots[idx];
            let token = slot.token;
            let result = match slot.work {
                Work::Rw {
                    dir,
                    offset,
                    iov,
                    iovcnt,
                    total,
                    durable,
                } => {
                    // SAFETY: checked at push; the push contract keeps the iovecs and
                    // their buffers valid until this completion is reaped.
                    unsafe { iov_slice(iov, iovcnt) }.and_then(|user| unsafe {
                        // SAFETY: as above.
                        rw_from(self.io.fd, dir, offset, user, total, 0, durable)
                    })
                }
                Work::Zeroes { offset, len, stage } => {
                    self.io.write_zeroes_from(stage, offset, len)
                }
                _ => Err(errno(libc::EINVAL)),
            };
            self.release(idx);
            self.ready.push(token, result);
        }
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
        let started = unsafe { self.plan(op) }.and_then(|work| self.start(token, work));
        if let Err(e) = started {
            self.ready.push(token, Err(e));
        }
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        let mut result = Ok(());
        while !self.ring.submission().is_empty() {
            match self.ring.submit() {
                Ok(n) => {
                    self.needs_drain = true;
                    if n == 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Out of resources: the SQEs stay queued for the next submit or wait.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.run_deferred();
        result
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        let mut n = self.ready.drain(f);
        // Drain the eventfd only when there is something to reap: a poller calling reap
        // in a loop would otherwise make a syscall per call. Draining before reading the
        // CQ means a completion posted afterwards signals the eventfd again.
        if !self.ring.completion().is_empty() {
            self.drain_eventfd();
        }
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                break;
            };
            self.in_kernel = self.in_kernel.saturating_sub(1);
            let idx = match usize::try_from(cqe.user_data()) {
                Ok(idx) if idx < self.depth && !matches!(self.slots[idx].work, Work::Idle) => idx,
                _ => {
                    log::error!("io_uring completion for unknown slot {}", cqe.user_data());
                    continue;
                }
            };
            let result = self.finish(idx, cqe.result());
            let token = self.slots[idx].token;
            self.release(idx);
            f(Completion { token, result });
            n += 1;
        }
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.in_flight == 0 || !self.ready.is_empty() {
            return Ok(());
        }
        self.submit()?;
        while self.ready.is_empty() && self.in_kernel > 0 && self.ring.completion().is_empty() {
            match self.ring.submit_and_wait(1) {
                Ok(_) => self.needs_drain = true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for UringEngine {
    /// Waits for every SQE to complete: the kernel may still be reading or writing
    /// the caller's buffers and our bounce buffers until then.
    fn drop(&mut self) {
        while self.in_kernel > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!(
                        "io_uring engine drop: waiting for {} operations: {e}",
                        self.in_kernel
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            loop {
                let Some(cqe) = self.ring.completion().next() else {
                    break;
                };
                self.in_kernel -= 1;
                if let Ok(idx) = usize::try_from(cqe.user_data()) {
                    if idx < self.depth {
                        self.release(idx);
                    }
                }
            }
        }
    }
}
