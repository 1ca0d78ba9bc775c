//! A simulated rotational disk (`hdd:SIZE`, `hdd:SIZE:xN`; `:norot` hides from the
//! driver that it is rotational, as most virtual disks do): the bytes live in RAM like a
//! `mem:` disk's, and every request takes the time a 7200 rpm disk would take to serve it.
//! It is there to reproduce results that only show on a slow, seeking disk, such as the
//! guest's request path (merging and sorting) beating the bio path on sequential I/O.
//!
//! # The model
//!
//! One request's service time is
//!
//! ```text
//! overhead + positioning + len / media_rate
//! positioning = 0                                   if the request starts where the last one ended
//!             = seek(tracks apart) + revolution / 2 otherwise
//! seek(0)     = 0
//! seek(d)     = track_to_track + (full_stroke - track_to_track) * sqrt((d - 1) / (tracks - 1))
//! ```
//!
//! divided by the speed factor N of `hdd:SIZE:xN` (1 by default: real time).
//!
//! - The disk is one actuator serving one command at a time (queue depth 1, no NCQ), in
//!   arrival order: no reordering anywhere below the guest, as with a host scheduler of
//!   `noop`/`none` and a disk without command queueing. Arrival is the engine's `submit`;
//!   requests submitted together arrive in the order they were pushed. The head is shared
//!   by every engine (worker) on the disk, as one spindle is shared by every queue.
//! - A request that starts at the byte where the previous one ended (a sequential
//!   follow-on) needs no positioning: the drive's track buffer streams it, whatever time
//!   passed in between. Any other request pays a seek by distance and the average
//!   rotational latency, half a revolution. Using the average rather than tracking the
//!   platter's angle keeps the model deterministic: the same I/O sequence always costs the
//!   same time, so tests and benchmarks repeat.
//! - The whole stroke spans SIZE: a track holds `media_rate * 60 / rpm` bytes (what passes
//!   under the head in one revolution, 1.75 MB here), and the disk has `SIZE / track` tracks.
//!   Random I/O over the whole of a small `hdd:1G` therefore costs the datasheet's average
//!   seek, as random I/O over a whole real disk does.
//! - The seek curve is the square-root law of an actuator that accelerates for half the
//!   distance and brakes for the other half (Ruemmler and Wilkes, "An introduction to disk
//!   drive modeling", 1994). Its full-stroke time is derived from the datasheet's average
//!   seek, which datasheets define as the mean over all pairs of tracks: that mean of
//!   `sqrt(d / tracks)` is 8/15, so `full_stroke = t2t + (average - t2t) * 15 / 8`
//!   (15.1 ms, within the 14.7-15.7 ms full-stroke seeks of IBM's 7200 rpm Deskstar 75GXP).
//! - Writes go to the platter before they complete (no volatile write cache: what a guest
//!   sees as written is on the media). FLUSH and DISCARD cost the command overhead and do
//!   not move the head; WRITE ZEROES is timed as a write of its length. A request that
//!   fails (out of range, read-only) costs the overhead.
//! - The data moves inside `submit` (memcpy, as for a RAM disk); only the completion is
//!   held back until its due time. Completions are delivered through a timerfd that is the
//!   engine's notify fd, so a worker never sleeps while "the disk is busy": it waits in
//!   epoll like it waits for io_uring.
//!
//! Parameters (a 7200 rpm 3.5-inch desktop disk; the sources are manufacturers'
//! specifications):
//!
//! | parameter | value | source |
//! | --- | --- | --- |
//! | command overhead | 0.3 ms | IBM Deskstar 120GXP spec, "Command overhead": read, cache not hit, command to seek start |
//! | average seek | 8.5 ms | Hitachi Deskstar 7K1000.C spec (2-disk models), average read seek; also the 120GXP's |
//! | track-to-track seek | 1.0 ms | Hitachi 7200 rpm specs (e.g. Travelstar 7K320), single-track read seek |
//! | rotation | 7200 rpm: 8.33 ms a revolution, 4.17 ms average latency | every 7200 rpm datasheet |
//! | media rate | 210 MB/s | Seagate BarraCuda 1 TB (ST1000DM010), maximum sustained rate, outer diameter |
//!
//! The model has no zones: every track transfers at the outer-diameter rate.
//!
//! What that gives at full speed: a random 4 KiB read costs 0.3 + 8.5 (on average) + 4.17 +
//! 0.02 ≈ 13 ms (77 IOPS at any queue depth); sequential 4 KiB reads cost 0.32 ms each
//! (about 12 MiB/s), and sequential 512 KiB requests 2.8 ms each (about 180 MiB/s), so
//! merging adjacent requests pays for itself many times over.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::engine::{iov_slice, iov_total, Completion, Engine, Full, Op};
use crate::inline::InlineEngine;

/// The largest speed factor `hdd:SIZE:xN` accepts.
pub(crate) const MAX_SPEEDUP: u32 = 1_000_000;

/// The modelled disk's parameters (see the module documentation for their sources).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub overhead: Duration,
    pub average_seek: Duration,
    pub track_to_track: Duration,
    pub rpm: u32,
    /// Bytes per second under the head.
    pub media_rate: u64,
}

/// The 7200 rpm disk of the module documentation.
pub(crate) const DESKTOP_7200: Params = Params {
    overhead: Duration::from_micros(300),
    average_seek: Duration::from_micros(8500),
    track_to_track: Duration::from_micros(1000),
    rpm: 7200,
    media_rate: 210_000_000,
};

impl Params {
    /// One revolution.
    pub(crate) fn revolution(&self) -> Duration {
        Duration::from_secs(60) / self.rpm
    }

    /// Bytes that pass under the head in one revolution.
    pub(crate) fn track_bytes(&self) -> u64 {
        self.media_rate * 60 / u64::from(self.rpm)
    }

    /// The seek across the whole stroke, fitted so that the mean over all pairs of
    /// tracks is `average_seek`.
    pub(crate) fn full_stroke(&self) -> Duration {
        self.track_to_track + (self.average_seek - self.track_to_track) * 15 / 8
    }
}

/// What one request asks of the disk, for timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Reads or writes `len` bytes at `offset`: positions the head, transfers, moves it.
    Media { offset: u64, len: u64 },
    /// Costs the command overhead only (flush, discard, a request that failed).
    Command,
}

/// The mechanical state every engine on the disk shares.
#[derive(Debug)]
struct Head {
    /// The byte after the last one transferred: where a sequential follow-on starts.
    end: u64,
    /// When the disk finishes the last request it was given.
    busy_until: Instant,
}

/// The simulated disk behind a `hdd:` backend: the model and its one head.
#[derive(Debug)]
pub(crate) struct HddDisk {
    params: Params,
    tracks: u64,
    speedup: u32,
    /// Whether the device says it is rotational (`hdd:SIZE:norot`: it does not).
    pub(crate) reports_rotation: bool,
    head: Mutex<Head>,
}

impl HddDisk {
    pub(crate) fn new(size: u64, speedup: u32, params: Params) -> HddDisk {
        HddDisk {
            params,
            tracks: size.div_ceil(params.track_bytes()).max(1),
            speedup: speedup.clamp(1, MAX_SPEEDUP),
            reports_rotation: true,
            head: Mutex::new(Head {
                end: 0,
                busy_until: Instant::now(),
            }),
        }
    }

    fn track(&self, byte: u64) -> u64 {
        (byte / self.params.track_bytes()).min(self.tracks - 1)
    }

    /// The seek over `distance` tracks, at full speed.
    pub(crate) fn seek(&self, distance: u64) -> Duration {
        if distance == 0 {
            return Duration::ZERO;
        }
        let p = &self.params;
        let span = (self.tracks - 1).max(1) as f64;
        let frac = ((distance - 1) as f64 / span).min(1.0);
        p.track_to_track + (p.full_stroke() - p.track_to_track).mul_f64(frac.sqrt())
    }

    /// The service time of `access` with the head after byte `head_end`, at full speed.
    pub(crate) fn service(&self, head_end: u64, access: Access) -> Duration {
        let p = &self.params;
        match access {
            Access::Command => p.overhead,
            Access::Media { offset, len } => {
                let positioning = if offset == head_end {
                    Duration::ZERO
                } else {
                    let distance = self.track(offset).abs_diff(self.track(head_end));
                    self.seek(distance) + p.revolution() / 2
                };
                let transfer = Duration::from_secs_f64(len as f64 / p.media_rate as f64);
                p.overhead + positioning + transfer
            }
        }
    }

    /// The head, locked: taken once per submitted batch.
    fn head(&self) -> std::sync::MutexGuard<'_, Head> {
        // A panic while holding it left plain numbers behind: still usable.
        self.head.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue `access`, arrived at `now`, behind everything the disk already has; returns
    /// when it completes.
    fn enqueue(&self, head: &mut Head, now: Instant, access: Access) -> Instant {
        let start = head.busy_until.max(now);
        head.busy_until = start + self.service(head.end, access) / self.speedup;
        if let Access::Media { offset, len } = access {
            head.end = offset + len;
        }
        head.busy_until
    }

    /// [`HddDisk::enqueue`] for one access, taking the lock itself.
    #[cfg(test)]
    pub(crate) fn enqueue_one(&self, now: Instant, access: Access) -> Instant {
        self.enqueue(&mut self.head(), now, access)
    }
}

/// The engine of a `hdd:` disk: data moved inline, completions held until due.
pub(crate) struct HddEngine {
    inner: InlineEngine,
    backend: Arc<Backend>,
    /// What each pushed, not yet submitted, operation asks of the disk, in push order.
    pushed: VecDeque<(u64, Access)>,
    /// Done operations, in the order (and so by the time) they complete.
    held: VecDeque<(Instant, Completion)>,
    timer: OwnedFd,
    depth: usize,
}

impl HddEngine {
    pub(crate) fn new(backend: Arc<Backend>, depth: usize) -> io::Result<HddEngine> {
        // SAFETY: plain syscall creating a new descriptor, owned right below.
        let t = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if t < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: timerfd_create just returned this descriptor and nothing else owns it.
        let timer = unsafe { OwnedFd::from_raw_fd(t) };
        Ok(HddEngine {
            inner: InlineEngine::new(Arc::clone(&backend), depth),
            backend,
            pushed: VecDeque::with_capacity(depth),
            held: VecDeque::with_capacity(depth),
            timer,
            depth,
        })
    }

    /// Arm the timer for the earliest held completion, or disarm it.
    fn arm(&self) {
        // SAFETY: itimerspec is plain data; all-zero disarms.
        let mut spec: libc::itimerspec = unsafe { std::mem::zeroed() };
        if let Some((due, _)) = self.held.front() {
            // Zero would disarm: a completion already due fires after 1 ns.
            let left = due
                .saturating_duration_since(Instant::now())
                .max(Duration::from_nanos(1));
            spec.it_value.tv_sec = left.as_secs() as libc::time_t;
            spec.it_value.tv_nsec = libc::c_long::from(left.subsec_nanos() as i32);
        }
        // SAFETY: our own timerfd and a live itimerspec.
        unsafe { libc::timerfd_settime(self.timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    fn clear_timer(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a local buffer from our non-blocking timerfd.
        unsafe { libc::read(self.timer.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

/// What `op` asks of the disk if it succeeds.
///
/// # Safety
/// The [`Engine::push`] contract holds for `op` (its iovec array is readable).
unsafe fn access_of(op: &Op) -> Access {
    match *op {
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
            match unsafe { iov_slice(iov, iovcnt) }.and_then(iov_total) {
                Ok(len) => Access::Media { offset, len },
                Err(_) => Access::Command,
            }
        }
        Op::WriteZeroes { offset, len, .. } => Access::Media { offset, len },
        Op::Flush | Op::Discard { .. } => Access::Command,
    }
}

impl Engine for HddEngine {
    fn name(&self) -> &'static str {
        "hdd"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight() >= self.depth {
            return Err(Full);
        }
        // SAFETY: the caller's push contract covers reading the iovec array.
        let access = unsafe { access_of(&op) };
        // SAFETY: the caller's contract, forwarded; the completion is handed back only
        // after the inner engine has finished with the buffers.
        unsafe { self.inner.push(token, op) }?;
        self.pushed.push_back((token, access));
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        if self.pushed.is_empty() {
            return Ok(());
        }
        self.inner.submit()?;
        let now = Instant::now();
        let Self {
            inner,
            backend,
            pushed,
            held,
            ..
        } = self;
        let disk = backend.hdd();
        let mut head = disk.map(HddDisk::head);
        inner.reap(&mut |c| {
            // The inline engine completes in push order.
            let (token, access) = pushed.pop_front().unwrap_or((c.token, Access::Command));
            debug_assert_eq!(token, c.token, "inline engine completed out of order");
            let access = if c.result.is_ok() {
                access
            } else {
                Access::Command
            };
            let due = match (disk, head.as_mut()) {
                (Some(disk), Some(head)) => disk.enqueue(head, now, access),
                _ => now,
            };
            held.push_back((due, c));
        });
        drop(head);
        self.arm();
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        self.clear_timer();
        let now = Instant::now();
        let mut n = 0;
        while self.held.front().is_some_and(|(due, _)| *due <= now) {
            if let Some((_, c)) = self.held.pop_front() {
                f(c);
                n += 1;
            }
        }
        self.arm();
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.held.is_empty() && !self.pushed.is_empty() {
            self.submit()?;
        }
        if let Some((due, _)) = self.held.front() {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.timer.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.pushed.len() + self.held.len()
    }
}

impl std::fmt::Debug for HddEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HddEngine")
            .field("disk", &self.backend.hdd())
            .field("pushed", &self.pushed.len())
            .field("held", &self.held.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
