//! The aio engine: Linux AIO (`io_setup`, `io_submit`, `io_getevents`), as QEMU's
//! `aio=native`. One AIO context per engine (per worker) sized to the depth, one
//! preallocated iocb per slot, every iocb with `IOCB_FLAG_RESFD` on the engine's eventfd.
//!
//! Linux AIO is asynchronous only with O_DIRECT: on the page cache `io_submit` does each
//! request itself before it returns. So the engine needs `cache=none` and refuses a
//! backend opened without it ([`Error::AioNeedsDirect`]), as QEMU refuses `aio=native`
//! without `cache.direct=on`.
//!
//! What goes where:
//! - reads and writes: `IOCB_CMD_PREADV`/`PWRITEV` (`RWF_DSYNC` in `aio_rw_flags` when
//!   durable), carried in pieces by [`crate::carry`] as the io_uring engine carries them:
//!   a short transfer continues where it stopped (a read at end of file fills the rest with
//!   zeroes, a write that makes no progress is EIO), EAGAIN in a completion resubmits the
//!   piece, more than `IOV_MAX` iovecs go `IOV_MAX` at a time, unaligned buffers go through
//!   the engine's bounded bounce pool. QEMU instead pads every short read with zeroes and
//!   fails every short write with ENOSPC; continuing is what the other engines do.
//! - flush: `IOCB_CMD_FDSYNC`, which the kernel runs on a workqueue (Linux 4.18+). Where
//!   the kernel refuses it (EINVAL: older kernels, files without `fsync`), this flush and
//!   every later one go to the helper thread as `fdatasync`. QEMU always sends flushes of
//!   `aio=native` disks to its thread pool: it predates `FDSYNC` support.
//! - discard and write-zeroes: AIO has no fallocate, so they go whole to a helper thread
//!   (one per engine, started on first use) that does what the sync engine does
//!   (`fallocate`, `BLKDISCARD`, writing zeroes). Doing them on the worker would stall
//!   every other request of its queues for as long as a `fallocate` takes.
//!
//! Submission is a small state machine (QEMU's `ioq_submit`): queued iocbs go to
//! `io_submit` at most [`MAX_BATCH`] per call, all of them in one `submit`; a partial
//! accept goes on with the rest; EAGAIN stops, leaves the rest queued and counted in
//! [`Engine::backlog`] (never an error to the guest); any other error fails the first
//! iocb of the call (the one the kernel refused) and goes on.
//!
//! Completions: the kernel adds 1 to the eventfd after each event it puts in the ring, and
//! the helper after each completion it files. `reap` reads the eventfd and takes exactly
//! as many completions as it read signals, so the eventfd is readable exactly while
//! completions wait (see [`crate::pool`]). Whether anything waits is checked without a
//! syscall, on the ring's head and tail (the context id is the address of the ring the
//! kernel maps into the process, which libaio's and QEMU's peeks read too); events are
//! taken with `io_getevents(min_nr 0)`.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use vmm_sys_util::aio::{
    IoControlBlock, IoEvent, IOCB_CMD_FDSYNC, IOCB_CMD_PREADV, IOCB_CMD_PWRITEV, IOCB_FLAG_RESFD,
};

use crate::aio_sys::Context;
use crate::backend::Backend;
use crate::carry::{Piece, Slots, Work};
use crate::engine::{errno, Completion, Dir, Engine, Full, Op};
use crate::error::Error;
use crate::pool::{drain_eventfd, new_eventfd, wait_readable, Job, Pool};
use crate::sysio::{unsupported, SyncIo, ZeroStage};

/// Most iocbs per `io_submit` (QEMU's default `aio-max-batch`).
pub(crate) const MAX_BATCH: usize = 32;
/// Most events per `io_getevents`.
const EVENTS: usize = 256;

/// What happens next to a slot.
enum Step {
    /// Its iocb is filled: queue it for `io_submit`.
    Iocb,
    /// Hand this to the helper thread (the slot's work is now `Offloaded`).
    Offload(Op),
    /// Wait for a bounce buffer.
    Wait,
    /// Finished.
    Done(io::Result<u64>),
}

/// Linux AIO engine for files and block devices opened with O_DIRECT.
pub(crate) struct AioEngine {
    /// Declared first: dropped (its thread joined) before `event` is closed.
    helper: Pool,
    ctx: Context,
    event: OwnedFd,
    io: SyncIo,
    slots: Slots,
    /// One iocb per slot (same index). The kernel reads one during `io_submit` only, but
    /// the pointers to them in `batch` must stay valid: a boxed slice is never moved.
    iocbs: Box<[IoControlBlock]>,
    /// Slots whose iocb is filled and not yet taken by the kernel, oldest first.
    pending: VecDeque<u32>,
    /// The iocb pointers of one `io_submit`.
    batch: [*mut IoControlBlock; MAX_BATCH],
    events: Box<[IoEvent]>,
    /// Jobs for the helper, handed over in `submit`.
    helper_jobs: VecDeque<Job>,
    /// Completions taken from the helper, to process.
    helper_done: VecDeque<Completion>,
    /// Signals read from the eventfd whose completions have not been taken.
    credit: u64,
    /// Whether `IOCB_CMD_FDSYNC` works here (false once the kernel refused it).
    fdsync: bool,
    /// Pushed and not reaped.
    in_flight: usize,
    /// iocbs the kernel took whose event has not been read.
    in_kernel: usize,
}

// SAFETY: the raw pointers (iovec arrays and buffers in slots and iocbs, the iocb pointers
// in `batch`) are lent under the `Engine::push` contract or point into memory the engine
// owns; all are valid from any thread, and the engine is used by one thread at a time
// (`&mut self`).
unsafe impl Send for AioEngine {}

impl AioEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: u32) -> Result<Self, Error> {
        if backend.dio().is_none() {
            return Err(Error::AioNeedsDirect {
                path: backend.path().map(|p| p.to_owned()).unwrap_or_default(),
            });
        }
        let setup = |source| Error::EngineSetup {
            engine: "aio",
            depth,
            source,
        };
        let ctx = Context::setup(depth).map_err(|e| {
            if e.raw_os_error() == Some(libc::EAGAIN) {
                Error::AioLimit {
                    depth,
                    max_nr: read_proc("/proc/sys/fs/aio-max-nr"),
                    in_use: read_proc("/proc/sys/fs/aio-nr"),
                }
            } else {
                setup(e)
            }
        })?;
        if !ctx.has_ring() {
            log::info!("aio engine: unknown completion ring layout; checking it by syscall");
        }
        let n = depth as usize;
        let event = new_eventfd().map_err(setup)?;
        let helper =
            Pool::new(Arc::clone(&backend), n, 1, 0, event.as_raw_fd(), "aio").map_err(setup)?;
        Ok(AioEngine {
            helper,
            ctx,
            event,
            io: SyncIo::new(backend),
            slots: Slots::new(n),
            iocbs: vec![IoControlBlock::default(); n].into_boxed_slice(),
            pending: VecDeque::with_capacity(n),
            batch: [std::ptr::null_mut(); MAX_BATCH],
            events: vec![IoEvent::default(); n.min(EVENTS)].into_boxed_slice(),
            helper_jobs: VecDeque::with_capacity(n),
            helper_done: VecDeque::with_capacity(n),
            credit: 0,
            fdsync: true,
            in_flight: 0,
            in_kernel: 0,
        })
    }

    /// Start the next piece of slot `idx`, or finish it.
    fn advance(&mut self, idx: usize) {
        match self.step(idx) {
            // idx < depth <= MAX_DEPTH fits in u32.
            Ok(Step::Iocb) => self.pending.push_back(idx as u32),
            Ok(Step::Offload(op)) => self.helper_jobs.push_back(Job {
                tag: idx as u64,
                op,
            }),
            Ok(Step::Wait) => self.slots.wait_for_bounce(idx),
            Ok(Step::Done(result)) => self.finish(idx, result),
            Err(e) => self.finish(idx, Err(e)),
        }
    }

    /// What slot `idx` does next; fills its iocb when that is an iocb.
    fn step(&mut self, idx: usize) -> io::Result<Step> {
        let slot = self.slots.get_mut(idx);
        let offload = |slot: &mut crate::carry::Slot, ok, op| {
            slot.work = Work::Offloaded { ok };
            Ok(Step::Offload(op))
        };
        let (opcode, buf, nbytes, offset, rw_flags) = match slot.work {
            Work::Idle | Work::Offloaded { .. } => return Ok(Step::Done(Err(errno(libc::EINVAL)))),
            Work::Rw(_) => match slot.rw_piece(&mut self.io)? {
                Piece::Wait => return Ok(Step::Wait),
                Piece::Finished {
                    total,
                    sync_after: false,
                } => return Ok(Step::Done(Ok(total))),
                // The kernel refused RWF_DSYNC: written, now fdatasync.
                Piece::Finished {
                    total,
                    sync_after: true,
                } => return offload(slot, total, Op::Flush),
                Piece::Io {
                    dir,
                    at,
                    iov,
                    cnt,
                    dsync,
                } => {
                    let opcode = match dir {
                        Dir::Read => IOCB_CMD_PREADV,
                        Dir::Write => IOCB_CMD_PWRITEV,
                    };
                    let flags = if dsync { libc::RWF_DSYNC as u32 } else { 0 };
                    (opcode, iov as u64, u64::from(cnt), at, flags)
                }
            },
            Work::Flush | Work::SyncThen if self.fdsync => (IOCB_CMD_FDSYNC, 0, 0, 0, 0),
            Work::Flush | Work::SyncThen => return offload(slot, 0, Op::Flush),
            // The helper thread makes them durable too (SyncIo::run).
            Work::Discard {
                offset,
                len,
                durable,
            } => {
                return offload(
                    slot,
                    0,
                    Op::Discard {
                        offset,
                        len,
                        durable,
                    },
                )
            }
            Work::Zeroes {
                offset,
                len,
                stage,
                durable,
                ..
            } => {
                let unmap = stage == ZeroStage::Punch;
                return offload(
                    slot,
                    0,
                    Op::WriteZeroes {
                        offset,
                        len,
                        unmap,
                        durable,
                    },
                );
            }
        };
        let offset = i64::try_from(offset).map_err(|_| errno(libc::EINVAL))?;
        self.iocbs[idx] = IoControlBlock {
            aio_data: idx as u64,
            // aio_rw_flags (Linux 4.13+; "reserved1" in the bindings).
            aio_reserved1: rw_flags,
            aio_lio_opcode: opcode as u16,
            aio_fildes: self.io.fd as u32,
            aio_buf: buf,
            aio_nbytes: nbytes,
            aio_offset: offset,
            aio_flags: IOCB_FLAG_RESFD,
            aio_resfd: self.event.as_raw_fd() as u32,
            ..Default::default()
        };
        Ok(Step::Iocb)
    }

    /// Slot `idx`'s iocb completed with `res` (bytes or -errno).
    fn on_event(&mut self, idx: usize, res: i64) {
        let Some(slot) = self.slots.busy(idx) else {
            log::error!("aio completion for unknown slot {idx}");
            return;
        };
        if res == -i64::from(libc::EAGAIN) || res == -i64::from(libc::EINTR) {
            if slot.retry() {
                self.advance(idx);
            } else {
                self.finish(idx, Err(errno(libc::EIO)));
            }
            return;
        }
        slot.retries = 0;
        let code = (res < 0).then(|| i32::try_from(-res).unwrap_or(libc::EIO));
        let result = match slot.work {
            Work::Rw(_) => slot.rw_result(res),
            Work::Flush | Work::SyncThen => match code {
                Some(c) if unsupported(c) => {
                    self.fdsync = false;
                    None
                }
                Some(c) => Some(Err(errno(c))),
                None => Some(Ok(0)),
            },
            _ => Some(Err(errno(libc::EIO))),
        };
        match result {
            Some(r) => self.finish(idx, r),
            None => self.advance(idx),
        }
    }

    /// The kernel refused slot `idx`'s iocb at submission with `code`.
    fn refused(&mut self, idx: usize, code: i32) {
        let slot = self.slots.get_mut(idx);
        match &mut slot.work {
            Work::Flush | Work::SyncThen if unsupported(code) => {
                log::info!(
                    "aio engine: IOCB_CMD_FDSYNC refused ({}); flushing on the helper thread",
                    errno(code)
                );
                self.fdsync = false;
                self.advance(idx);
            }
            // A kernel without aio_rw_flags (before 4.13) or without RWF_DSYNC.
            Work::Rw(rw) if rw.durable && matches!(code, libc::EOPNOTSUPP | libc::EINVAL) => {
                rw.durable = false;
                rw.sync_after = true;
                self.advance(idx);
            }
            _ => self.finish(idx, Err(errno(code))),
        }
    }

    /// Slot `idx` is done: hand its completion over, free it, and let a waiting
    /// operation have its bounce buffer.
    fn finish(&mut self, idx: usize, result: io::Result<u64>) {
        if let Some(next) = self.slots.finish(idx, result, &mut self.io.bounce) {
            self.advance(next);
        }
    }

    /// Hands queued iocbs to the kernel, [`MAX_BATCH`] per call, and queued jobs to the
    /// helper. What the kernel refuses with EAGAIN stays queued.
    fn submit_pending(&mut self) {
        while !self.pending.is_empty() {
            if self.io.backend.take_refusal() {
                break;
            }
            let n = self.pending.len().min(MAX_BATCH);
            let base = self.iocbs.as_mut_ptr();
            for (i, &idx) in self.pending.iter().take(n).enumerate() {
                // SAFETY: idx < depth = iocbs.len(), so the pointer stays in the slice.
                self.batch[i] = unsafe { base.add(idx as usize) };
            }
            // SAFETY: each pointer names the filled iocb of a busy slot, whose buffers and
            // iovecs (the caller's under the push contract, or the slot's own bounce buffer
            // and iovec, neither moved nor reused before the slot's event) stay valid until
            // its event is read; Drop waits for every event.
            match unsafe { self.ctx.submit(&self.batch[..n]) } {
                Ok(0) => break,
                Ok(k) => {
                    self.pending.drain(..k.min(n));
                    self.in_kernel += k.min(n);
                }
                Err(e) => match e.raw_os_error().unwrap_or(libc::EIO) {
                    // Out of resources: stop; the rest goes after completions.
                    libc::EAGAIN => break,
                    libc::EINTR => {}
                    // The first iocb is the one refused: fail it, go on with the rest.
                    code => {
                        if let Some(idx) = self.pending.pop_front() {
                            self.refused(idx as usize, code);
                        }
                    }
                },
            }
        }
        if !self.helper_jobs.is_empty() {
            // SAFETY: helper jobs are discard, write-zeroes and flush: they lend no buffer.
            unsafe { self.helper.submit(&mut self.helper_jobs) };
        }
    }

    /// Whether a completion may be waiting: checked on the ring without a syscall.
    fn visible(&self) -> bool {
        if self.credit > 0 || self.helper.has_done() {
            return true;
        }
        self.ctx.ring_has_events().unwrap_or(self.in_kernel > 0)
    }

    /// Takes the completions the eventfd has signalled (helper first, then the kernel's).
    fn collect(&mut self) {
        self.credit += drain_eventfd(self.event.as_raw_fd());
        if self.credit > 0 && self.helper.has_done() {
            let done = &mut self.helper_done;
            self.credit -= self.helper.take(self.credit, &mut |c| done.push_back(c));
            while let Some(c) = self.helper_done.pop_front() {
                self.on_helper(c);
            }
        }
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        while self.credit > 0 && self.in_kernel > 0 {
            let want = (self.credit as usize).min(self.events.len());
            match self.ctx.getevents(0, &mut self.events[..want], Some(&zero)) {
                Ok(0) => break,
                Ok(n) => {
                    self.credit -= n as u64;
                    self.in_kernel -= n.min(self.in_kernel);
                    for i in 0..n {
                        let ev = self.events[i];
                        self.on_event(ev.data as usize, ev.res);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::error!("aio engine: io_getevents: {e}");
                    break;
                }
            }
        }
        if self.in_kernel == 0 && self.helper.outstanding() == 0 {
            // No signal can be owed any more.
            self.credit = 0;
        }
    }

    /// The helper finished slot `c.token`'s job.
    fn on_helper(&mut self, c: Completion) {
        let idx = c.token as usize;
        match self.slots.busy(idx).map(|s| s.work) {
            Some(Work::Offloaded { ok }) => self.finish(idx, c.result.map(|_| ok)),
            _ => log::error!("aio helper completion for unknown slot {idx}"),
        }
    }
}

/// A number from a /proc file, 0 if unreadable.
fn read_proc(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

impl Engine for AioEngine {
    fn name(&self) -> &'static str {
        "aio"
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
        self.submit_pending();
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        if self.visible() {
            self.collect();
            // Continuations (the next piece of a short or split transfer).
            self.submit_pending();
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
            self.submit_pending();
            if self.visible() {
                self.collect();
                self.submit_pending();
                if !self.slots.ready.is_empty() {
                    return Ok(());
                }
            }
            if self.in_kernel == 0 && self.helper.outstanding() == 0 {
                if self.pending.is_empty() && self.helper_jobs.is_empty() {
                    // Nothing can complete (cannot happen: a slot waiting for a bounce
                    // buffer waits for one that is in the kernel).
                    log::error!("aio engine: {} in flight, none under way", self.in_flight);
                    return Ok(());
                }
                // Everything left is queued and the kernel refuses it for now.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            wait_readable(self.event.as_raw_fd())?;
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn backlog(&self) -> usize {
        self.pending.len()
    }
}

impl Drop for AioEngine {
    /// Waits for every iocb the kernel took: it may still be reading or writing the
    /// caller's buffers and the bounce buffers. The helper's running job finishes when the
    /// pool drops (first field); queued iocbs the kernel never took are dropped.
    fn drop(&mut self) {
        while self.in_kernel > 0 {
            let n = self.in_kernel.min(self.events.len());
            match self.ctx.getevents(1, &mut self.events[..n], None) {
                Ok(got) => self.in_kernel -= got.min(self.in_kernel),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // io_destroy (the context's drop) still waits for them.
                    log::error!(
                        "aio engine drop: waiting for {} operations: {e}",
                        self.in_kernel
                    );
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheMode, DiskSpec, OpenOptions};

    fn engine(size: usize) -> (tempfile::TempDir, std::path::PathBuf, AioEngine) {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("vblk-aio-")
            .tempdir_in(target)
            .unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0x5au8; size]).unwrap();
        let opts = OpenOptions {
            cache: CacheMode::None,
            ..Default::default()
        };
        let b = Arc::new(Backend::open(&DiskSpec::File(path.clone()), &opts).unwrap());
        let e = AioEngine::new(b, 8).unwrap();
        (dir, path, e)
    }

    fn run(e: &mut AioEngine, n: usize) -> Vec<(u64, io::Result<u64>)> {
        e.submit().unwrap();
        let mut got = Vec::new();
        while got.len() < n {
            e.reap(&mut |c| got.push((c.token, c.result)));
            if got.len() < n {
                e.wait().unwrap();
            }
        }
        got
    }

    /// This kernel's completion ring has the known layout, so `reap` checks it without
    /// a syscall; flush is an FDSYNC iocb, not a helper job; discard starts the helper.
    #[test]
    fn ring_fdsync_and_helper() {
        let (_dir, _path, mut e) = engine(1 << 20);
        assert!(e.ctx.has_ring(), "the aio ring layout is the known one");
        // SAFETY: Flush lends no buffer.
        unsafe { e.push(1, Op::Flush) }.unwrap();
        assert_eq!(e.pending.len(), 1, "flush is an iocb");
        assert_eq!(run(&mut e, 1)[0].1.as_ref().unwrap(), &0);
        assert!(e.fdsync, "the kernel took IOCB_CMD_FDSYNC");
        assert_eq!(e.helper.outstanding(), 0);
        let discard = Op::Discard {
            offset: 4096,
            len: 8192,
            durable: false,
        };
        // SAFETY: Discard lends no buffer.
        unsafe { e.push(2, discard) }.unwrap();
        assert_eq!(e.helper_jobs.len(), 1, "discard goes to the helper");
        assert_eq!(run(&mut e, 1)[0].1.as_ref().unwrap(), &0);
        assert_eq!(e.credit, 0);
    }

    /// Where the kernel refuses FDSYNC, flushes go to the helper as fdatasync; where it
    /// refuses RWF_DSYNC, a durable write is written plainly, then flushed by the helper,
    /// and completes with its length.
    #[test]
    fn refused_fdsync_and_dsync_fall_back() {
        let (_dir, path, mut e) = engine(1 << 20);
        e.fdsync = false;
        // SAFETY: Flush lends no buffer.
        unsafe { e.push(1, Op::Flush) }.unwrap();
        assert_eq!(e.helper_jobs.len(), 1, "flush goes to the helper");
        assert_eq!(run(&mut e, 1)[0].1.as_ref().unwrap(), &0);

        let buf = crate::bounce::AlignedBuf::new(8192, 4096).unwrap();
        // SAFETY: the buffer holds 8192 bytes.
        unsafe { std::ptr::write_bytes(buf.as_mut_ptr(), 0x77, 8192) };
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 8192,
        };
        let op = Op::Write {
            offset: 65536,
            iov: &iov,
            iovcnt: 1,
            durable: true,
        };
        // SAFETY: `buf` and `iov` outlive the engine's use (reaped below).
        unsafe { e.push(2, op) }.unwrap();
        let idx = e.pending.pop_front().unwrap() as usize;
        e.refused(idx, libc::EOPNOTSUPP);
        let got = run(&mut e, 1);
        assert_eq!(got[0].0, 2);
        assert_eq!(got[0].1.as_ref().unwrap(), &8192);
        drop(e);
        let file = std::fs::read(&path).unwrap();
        assert!(file[65536..65536 + 8192].iter().all(|&x| x == 0x77));
    }
}
