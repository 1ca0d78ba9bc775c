//! A lane: one job's I/O channel with `depth` buffer slots.
//!
//! Three kinds: [`DriverLane`] runs I/O through vblk's driver on a virtqueue (the virtual
//! path being measured: bio, batch, request, auto); [`PassthruLane`] sends raw virtio-blk
//! commands through the driver's passthru rings with polled completions; [`EngineLane`]
//! runs the same I/O straight through a storage engine on the disk, with no virtio in
//! between (`--baseline`), so the cost of the virtual path is a measured ratio.

use std::sync::Arc;
use std::time::Duration;

use driver::{Buffer, Cmd, Cqe, Data, ErrorKind, Io, Passthru, PassthruOptions, Queue};
use proto::wire::req_type;
use storage::{Backend, Engine, EngineKind, Op};

use crate::workload::IoDir;

/// One finished I/O: the slot it used and its result.
pub type Done = (usize, Result<(), String>);

/// One job's I/O channel.
pub trait Lane: Send {
    /// The number of buffer slots (the job's iodepth).
    fn depth(&self) -> usize;
    /// The buffer of `slot` (not in flight), `len` bytes long.
    fn buf(&mut self, slot: usize, len: usize) -> &mut [u8];
    /// Start `dir` of `len` bytes at `offset` using `slot`'s buffer.
    fn submit(&mut self, slot: usize, dir: IoDir, offset: u64, len: u64) -> Result<(), String>;
    /// Make everything submitted reach the device (publish + notify, or the engine's submit).
    fn unplug(&mut self) -> Result<(), String>;
    /// Append at least `min` finished I/Os to `out` (and any others already finished). An
    /// error when none finishes within `limit` while some are in flight: the device holds
    /// them, and the job must not wait forever on it (`--io-timeout`).
    fn wait(&mut self, min: usize, out: &mut Vec<Done>, limit: Duration) -> Result<(), String>;
    /// For a thread serving several lanes: get ready to sleep on this one and return the
    /// descriptors that wake the sleeper (readable, or hung up: `POLLRDHUP`). `None`: poll
    /// the lane rather than sleep (completions are waiting, or this kind of lane is only
    /// ever polled). After the sleep, [`Lane::disarm`].
    fn arm(&mut self) -> Option<[std::os::fd::RawFd; 2]> {
        None
    }
    /// Back to polling after a sleep begun with [`Lane::arm`].
    fn disarm(&mut self) {}
    /// What the lane's path did, for the report (merges, auto's choice), if anything.
    fn describe(&self) -> Option<String> {
        None
    }
}

/// I/O through the driver on one virtqueue.
pub struct DriverLane {
    queue: Queue,
    bufs: Vec<Option<Buffer>>,
    fua: bool,
}

impl DriverLane {
    /// A lane on `queue` with `depth` buffers of `max_block` bytes; writes are FUA if `fua`.
    pub fn new(
        queue: Queue,
        depth: usize,
        max_block: usize,
        fua: bool,
    ) -> Result<DriverLane, String> {
        let bufs = (0..depth)
            .map(|_| queue.alloc(max_block).map(Some).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DriverLane { queue, bufs, fua })
    }
}

fn kind_msg(k: ErrorKind) -> String {
    k.to_string()
}

impl Lane for DriverLane {
    fn depth(&self) -> usize {
        self.bufs.len()
    }

    fn buf(&mut self, slot: usize, len: usize) -> &mut [u8] {
        let b = self.bufs[slot].as_mut().expect("slot buffer is home");
        let _ = b.set_len(len);
        &mut b[..]
    }

    fn submit(&mut self, slot: usize, dir: IoDir, offset: u64, len: u64) -> Result<(), String> {
        let mut b = self.bufs[slot]
            .take()
            .ok_or_else(|| format!("slot {slot} is already in flight"))?;
        b.set_len(len as usize).map_err(|e| e.to_string())?;
        let io = match dir {
            IoDir::Read => Io::read(offset, b, slot as u64),
            IoDir::Write if self.fua => Io::write(offset, b, slot as u64).fua(),
            IoDir::Write => Io::write(offset, b, slot as u64),
        };
        let r = self.queue.submit(io);
        r.map_err(|e| {
            self.bufs[slot] = e.bufs.into_one();
            e.error.to_string()
        })
    }

    fn unplug(&mut self) -> Result<(), String> {
        self.queue.unplug();
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Done>, limit: Duration) -> Result<(), String> {
        let mut got = 0;
        loop {
            while let Some(c) = self.queue.poll() {
                let slot = c.token as usize;
                self.bufs[slot] = c.bufs.into_one();
                out.push((slot, c.result.map_err(kind_msg)));
                got += 1;
            }
            if got >= min || self.queue.in_flight() == 0 {
                return Ok(());
            }
            let in_flight = self.queue.in_flight();
            let c = self.queue.wait(Some(limit)).map_err(|e| match e.kind() {
                ErrorKind::Timeout => stalled(limit, in_flight),
                _ => e.to_string(),
            })?;
            let slot = c.token as usize;
            self.bufs[slot] = c.bufs.into_one();
            out.push((slot, c.result.map_err(kind_msg)));
            got += 1;
        }
    }

    fn arm(&mut self) -> Option<[std::os::fd::RawFd; 2]> {
        self.queue.arm()
    }

    fn disarm(&mut self) {
        self.queue.disarm();
    }

    fn describe(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(a) = self.queue.auto_report() {
            let trials: Vec<String> = a
                .trials
                .iter()
                .map(|t| {
                    format!(
                        "{}{} {:.0} IOPS {:.2} us/IO",
                        t.path,
                        depth_note(t.queue_depth),
                        t.iops,
                        t.cpu_us_per_io
                    )
                })
                .collect();
            parts.push(format!(
                "auto: {}{} ({}; {} choice(s){}{})",
                a.current,
                depth_note(a.queue_depth),
                a.reason,
                a.choices,
                if trials.is_empty() {
                    ""
                } else {
                    "; last trials: "
                },
                trials.join(", ")
            ));
        }
        if let Some(r) = self.queue.request_stats() {
            if r.dispatched > 0 {
                parts.push(format!(
                    "request path: {} back and {} front merges, {} requests dispatched, {} plug flushes",
                    r.back_merges, r.front_merges, r.dispatched, r.plug_flushes
                ));
            }
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Raw commands through the driver's passthru rings, completions polled.
pub struct PassthruLane {
    pt: Passthru,
    cqes: Vec<Cqe>,
}

impl PassthruLane {
    /// A passthru lane on `queue` with `depth` registered buffers of `max_block` bytes.
    pub fn new(queue: Queue, depth: usize, max_block: usize) -> Result<PassthruLane, String> {
        let mut pt =
            Passthru::new(queue, PassthruOptions::default()).map_err(|e| e.error.to_string())?;
        let bufs = (0..depth)
            .map(|_| pt.alloc(max_block).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        pt.register(bufs).map_err(|e| e.to_string())?;
        let cqes = vec![
            Cqe {
                user_data: 0,
                status: Ok(0),
                used_len: 0,
            };
            depth
        ];
        Ok(PassthruLane { pt, cqes })
    }
}

impl Lane for PassthruLane {
    fn depth(&self) -> usize {
        self.cqes.len()
    }

    fn buf(&mut self, slot: usize, len: usize) -> &mut [u8] {
        let b = self
            .pt
            .buffer_mut(slot as u16)
            .expect("slot buffer is registered");
        let len = len.min(b.len());
        &mut b[..len]
    }

    fn submit(&mut self, slot: usize, dir: IoDir, offset: u64, len: u64) -> Result<(), String> {
        let (type_, from_device) = match dir {
            IoDir::Read => (req_type::IN, true),
            IoDir::Write => (req_type::OUT, false),
        };
        self.pt
            .push(Cmd {
                type_,
                ioprio: 0,
                sector: offset / 512,
                data: Some(Data {
                    buf: slot as u16,
                    offset: 0,
                    len: len as u32,
                    from_device,
                }),
                user_data: slot as u64,
            })
            .map_err(|e| e.to_string())
    }

    fn unplug(&mut self) -> Result<(), String> {
        self.pt.submit().map(drop).map_err(|e| e.to_string())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Done>, limit: Duration) -> Result<(), String> {
        let mut got = 0;
        loop {
            if self.pt.queued() > 0 {
                self.pt.submit().map_err(|e| e.to_string())?;
            }
            let want = min.saturating_sub(got).min(self.pt.in_flight());
            let in_flight = self.pt.in_flight();
            let n = self
                .pt
                .wait(want, &mut self.cqes, Some(limit))
                .map_err(|e| match e.kind() {
                    ErrorKind::Timeout => stalled(limit, in_flight),
                    _ => e.to_string(),
                })?;
            for c in &self.cqes[..n] {
                let r = match c.status {
                    Ok(0) => Ok(()),
                    Ok(s) => Err(format!("device status {s}")),
                    Err(k) => Err(k.to_string()),
                };
                out.push((c.user_data as usize, r));
            }
            got += n;
            if got >= min || (self.pt.in_flight() == 0 && self.pt.queued() == 0) {
                return Ok(());
            }
        }
    }
}

/// A page-aligned heap buffer for the engine lane.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is owned by this value alone.
unsafe impl Send for Aligned {}

impl Aligned {
    fn new(len: usize) -> Result<Aligned, String> {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096)
            .map_err(|e| format!("buffer of {len} bytes: {e}"))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("cannot allocate {len} bytes"));
        }
        Ok(Aligned { ptr, layout })
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// I/O straight through a storage engine on the disk: the baseline.
pub struct EngineLane {
    engine: Box<dyn Engine>,
    bufs: Vec<Aligned>,
    iov: Vec<libc::iovec>,
    in_flight: usize,
    pushed: bool,
    fua: bool,
    _backend: Arc<Backend>,
}

// SAFETY: the iovecs point into `bufs`, owned by the lane and moved with it.
unsafe impl Send for EngineLane {}

impl EngineLane {
    /// A lane with its own engine of `kind` on `backend`; writes are durable if `fua`.
    pub fn new(
        backend: Arc<Backend>,
        kind: EngineKind,
        depth: usize,
        max_block: usize,
        fua: bool,
    ) -> Result<EngineLane, String> {
        let engine = backend
            .engine(kind, depth as u32)
            .map_err(|e| e.to_string())?;
        let bufs = (0..depth)
            .map(|_| Aligned::new(max_block))
            .collect::<Result<Vec<_>, _>>()?;
        let iov = bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.ptr.cast(),
                iov_len: max_block,
            })
            .collect();
        Ok(EngineLane {
            engine,
            bufs,
            iov,
            in_flight: 0,
            pushed: false,
            fua,
            _backend: backend,
        })
    }
}

impl Lane for EngineLane {
    fn depth(&self) -> usize {
        self.bufs.len()
    }

    fn buf(&mut self, slot: usize, len: usize) -> &mut [u8] {
        let b = &self.bufs[slot];
        let len = len.min(b.layout.size());
        // SAFETY: the slot is not in flight (the caller only asks for free slots), so the
        // engine does not touch it; len is within the allocation.
        unsafe { std::slice::from_raw_parts_mut(b.ptr, len) }
    }

    fn submit(&mut self, slot: usize, dir: IoDir, offset: u64, len: u64) -> Result<(), String> {
        self.iov[slot].iov_len = len as usize;
        let iov = &self.iov[slot] as *const libc::iovec;
        let op = match dir {
            IoDir::Read => Op::Read {
                offset,
                iov,
                iovcnt: 1,
            },
            IoDir::Write => Op::Write {
                offset,
                iov,
                iovcnt: 1,
                durable: self.fua,
            },
        };
        // SAFETY: the iovec and its buffer belong to `slot`, which stays untouched until its
        // completion is reaped (the runner reuses a slot only after it completes), and both
        // live in `self`, whose engine is dropped first.
        unsafe { self.engine.push(slot as u64, op) }.map_err(|e| e.to_string())?;
        self.in_flight += 1;
        self.pushed = true;
        Ok(())
    }

    fn unplug(&mut self) -> Result<(), String> {
        if std::mem::take(&mut self.pushed) {
            self.engine.submit().map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Done>, limit: Duration) -> Result<(), String> {
        let mut got = 0;
        let mut timed_out = false;
        loop {
            let n = self.engine.reap(&mut |c| {
                out.push((
                    c.token as usize,
                    c.result.map(drop).map_err(|e| e.to_string()),
                ));
            });
            got += n;
            self.in_flight -= n;
            if got >= min || self.in_flight == 0 {
                return Ok(());
            }
            if timed_out && n == 0 {
                return Err(stalled(limit, self.in_flight));
            }
            match self.engine.notify_fd() {
                // Sleep on the engine's completion descriptor, `limit` at most; then one
                // more reap decides.
                Some(fd) => timed_out = !readable_within(fd, limit)?,
                None => self.engine.wait().map_err(|e| e.to_string())?,
            }
        }
    }
}

impl Drop for EngineLane {
    fn drop(&mut self) {
        // Nothing may still write the buffers when they are freed.
        while self.in_flight > 0 {
            let n = self.engine.reap(&mut |_| {});
            self.in_flight -= n;
            if n == 0 && self.engine.wait().is_err() {
                break;
            }
        }
    }
}

/// The error of a lane whose device held its I/O for `limit`.
fn stalled(limit: Duration, in_flight: usize) -> String {
    format!(
        "no I/O completed for {:.1} s with {in_flight} in flight: the device holds them (a stalled or stopped device; --io-timeout sets how long to wait)",
        limit.as_secs_f64()
    )
}

/// Whether `fd` becomes readable within `limit`.
fn readable_within(fd: std::os::fd::RawFd, limit: Duration) -> Result<bool, String> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = limit.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: p is one valid, writable pollfd for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(true);
        }
        return Err(format!("poll: {e}"));
    }
    Ok(r > 0)
}

/// `,queue_depth=N` when auto's request path dispatches at another depth than the one
/// configured (as the variant would be written on the command line).
fn depth_note(depth: Option<u16>) -> String {
    depth.map_or(String::new(), |d| format!(",queue_depth={d}"))
}
