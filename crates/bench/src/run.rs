//! Running a job: one thread and one lane per clone (numjobs), iodepth I/Os kept in flight,
//! submissions unplugged per `iodepth_batch_submit`, completions reaped per
//! `iodepth_batch_complete`, latencies recorded after the ramp, CPU measured on both sides.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use driver::{PathKind, RequestOptions};

use crate::clock::{Clock, Mark};
use crate::job::{JobSpec, Size};
use crate::lane::{Done, Lane};
use crate::pace::Pacer;
use crate::stats::{Cpu, Latency};
use crate::target::{AttachOptions, Geometry, Target};
use crate::verify::{self, WrittenMap};
use crate::workload::{Generator, IoDir, IoUnit};

/// How to run (what a job file does not say).
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The driver's I/O path.
    pub path: PathKind,
    /// Spin bound before sleeping on a completion.
    pub spin: Duration,
    /// Entries per virtqueue.
    pub queue_size: u16,
    /// Seed of the workload generators (each clone adds its index).
    pub seed: u64,
    /// Pin job threads and the embedded device's workers to separate CPUs when the
    /// machine has enough (so that the scheduler cannot put both on one CPU mid-run).
    pub pin: bool,
    /// CPUs for the job threads: clone i on `job_cpus[i % len]` (empty: not pinned).
    pub job_cpus: Vec<usize>,
    /// The request path's tunables (elevator, fifo_batch, ...).
    pub request: RequestOptions,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            path: PathKind::Bio,
            spin: Duration::from_micros(50),
            queue_size: 256,
            seed: 0x5eed,
            pin: true,
            job_cpus: Vec::new(),
            request: RequestOptions::default(),
        }
    }
}

/// Figures of one direction (read or write).
#[derive(Clone)]
pub struct DirResult {
    /// I/Os completed in the measured window.
    pub ios: u64,
    /// Bytes completed in the measured window.
    pub bytes: u64,
    /// Submission latency.
    pub slat: Latency,
    /// Completion latency (from submission to completion).
    pub clat: Latency,
    /// Total latency (slat + clat).
    pub lat: Latency,
}

impl Default for DirResult {
    fn default() -> Self {
        DirResult::new()
    }
}

impl DirResult {
    /// No I/O.
    pub fn new() -> DirResult {
        DirResult {
            ios: 0,
            bytes: 0,
            slat: Latency::new(),
            clat: Latency::new(),
            lat: Latency::new(),
        }
    }

    fn merge(&mut self, o: &DirResult) {
        self.ios += o.ios;
        self.bytes += o.bytes;
        self.slat.merge(&o.slat);
        self.clat.merge(&o.clat);
        self.lat.merge(&o.lat);
    }
}

/// Figures of one clone of a job (or of all of them, merged).
#[derive(Clone)]
pub struct CloneResult {
    /// Clone index.
    pub index: u32,
    /// Reads.
    pub read: DirResult,
    /// Writes.
    pub write: DirResult,
    /// The measured window (after the ramp).
    pub runtime: Duration,
    /// CPU of the clone's thread in the measured window (driver side).
    pub cpu: Cpu,
    /// Sectors verified.
    pub verified: u64,
}

impl CloneResult {
    /// I/Os per second, both directions.
    pub fn iops(&self) -> f64 {
        per_sec(self.read.ios + self.write.ios, self.runtime)
    }

    /// Bytes per second, both directions.
    pub fn bw(&self) -> f64 {
        per_sec(self.read.bytes + self.write.bytes, self.runtime)
    }
}

fn per_sec(n: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// Everything measured for one job.
pub struct JobReport {
    /// The job.
    pub spec: JobSpec,
    /// Per clone.
    pub clones: Vec<CloneResult>,
    /// CPU of the device side in the measured window (when it can be measured).
    pub device_cpu: Option<Cpu>,
    /// CPU of kernel helpers of the driver side (baseline's io_uring workers).
    pub helper_cpu: Cpu,
    /// The target, in words.
    pub target: String,
    /// The I/O path ("engine" for the baseline).
    pub path: String,
    /// Things the user should know (clamped sizes, ignored options).
    pub notes: Vec<String>,
}

impl JobReport {
    /// All clones merged (runtime: the longest).
    pub fn total(&self) -> CloneResult {
        let mut t = CloneResult {
            index: 0,
            read: DirResult::new(),
            write: DirResult::new(),
            runtime: Duration::ZERO,
            cpu: Cpu::default(),
            verified: 0,
        };
        for c in &self.clones {
            t.read.merge(&c.read);
            t.write.merge(&c.write);
            t.runtime = t.runtime.max(c.runtime);
            t.cpu = t.cpu.add(&c.cpu);
            t.verified += c.verified;
        }
        t
    }

    /// Driver-side CPU (job threads plus their kernel helpers).
    pub fn driver_cpu(&self) -> Cpu {
        self.total().cpu.add(&self.helper_cpu)
    }

    /// I/Os per CPU-second on the driver side.
    pub fn driver_iops_per_cpu_sec(&self) -> f64 {
        let t = self.total();
        per_sec(t.read.ios + t.write.ios, self.driver_cpu().total())
    }

    /// The device side's CPU time over the measured window, in CPUs (0.25: a quarter of
    /// one CPU; 1.0: one CPU busy all the time), when it was measured.
    pub fn device_cpu_share(&self) -> Option<f64> {
        let runtime = self.total().runtime;
        self.device_cpu
            .filter(|_| !runtime.is_zero())
            .map(|c| c.total().as_secs_f64() / runtime.as_secs_f64())
    }

    /// I/Os per CPU-second on the device side.
    pub fn device_iops_per_cpu_sec(&self) -> Option<f64> {
        let t = self.total();
        self.device_cpu
            .map(|c| per_sec(t.read.ios + t.write.ios, c.total()))
    }
}

/// Live counters for the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// I/Os completed (all clones, including the ramp).
    pub ios: AtomicU64,
    /// Bytes completed.
    pub bytes: AtomicU64,
    /// Set by the caller to stop early (Ctrl-C).
    pub stop: AtomicBool,
}

struct Window {
    start: Instant,
    ramp_end: Instant,
    deadline: Option<Instant>,
}

/// The region each clone works on, and notes about clamping.
fn regions(
    spec: &JobSpec,
    geo: Geometry,
    notes: &mut Vec<String>,
) -> Result<Vec<(u64, u64)>, String> {
    let offset = spec.offset.next_multiple_of(geo.block);
    if offset != spec.offset {
        notes.push(format!(
            "offset {} is not a multiple of the device's {}-byte blocks; using {offset}",
            spec.offset, geo.block
        ));
    }
    if offset >= geo.capacity {
        return Err(format!(
            "offset {} is at or past the end of the device ({} bytes)",
            spec.offset, geo.capacity
        ));
    }
    let avail = geo.capacity - offset;
    let mut len = match spec.size {
        None => avail,
        Some(Size::Bytes(b)) => b,
        Some(Size::Percent(p)) => avail / 100 * u64::from(p),
    };
    if len > avail {
        notes.push(format!(
            "size {len} is larger than the {avail} bytes available from offset {offset}; using {avail}"
        ));
        len = avail;
    }
    len = len / geo.block * geo.block;
    let n = u64::from(spec.numjobs.max(1));
    if spec.verify.is_some() && n > 1 && spec.rw.writes() {
        // Verified writers must not overwrite each other: split the region.
        notes.push(format!(
            "verify with {n} writing clones: each clone gets 1/{n} of the region"
        ));
        let part = len / n / geo.block * geo.block;
        return Ok((0..n).map(|i| (offset + i * part, part)).collect());
    }
    Ok((0..n).map(|_| (offset, len)).collect())
}

/// Run `spec` on `target`.
pub fn run_job(
    spec: &JobSpec,
    target: &Target,
    cfg: &RunConfig,
    progress: &Progress,
) -> Result<JobReport, String> {
    let clones = spec.numjobs.max(1) as usize;
    let depth = spec.iodepth.max(1) as usize;
    let probe = Generator::new(spec, 0, u64::MAX / 4, 512, 0)?;
    let max_block = probe.max_block() as usize;
    let batch = if spec.iodepth_batch_submit > 1 {
        spec.iodepth_batch_submit
    } else {
        spec.iodepth
    };
    let attach = AttachOptions {
        path: cfg.path,
        batch: batch.clamp(1, u32::from(u16::MAX)) as u16,
        spin: cfg.spin,
        queue_size: cfg.queue_size,
        request: cfg.request,
        fua: spec.fua,
    };
    let (lanes, geo) = target.lanes(clones, depth, max_block, attach)?;
    let mut notes: Vec<String> = spec
        .ignored
        .iter()
        .map(|o| format!("option {o} ignored"))
        .chain(spec.notes.iter().cloned())
        .collect();
    if depth > usize::from(cfg.queue_size) {
        notes.push(format!(
            "iodepth={depth} is more than the queue's {} entries: at most {} I/Os are in flight per job (--queue-size raises it, up to 32768)",
            cfg.queue_size, cfg.queue_size
        ));
    }
    let regions = regions(spec, geo, &mut notes)?;
    let barrier = Arc::new(Barrier::new(clones + 1));
    // Calibrated before the window is set (once per process; it takes 10 ms).
    Clock::get();
    let start = Instant::now() + Duration::from_millis(20);
    let window = Arc::new(Window {
        start,
        ramp_end: start + spec.ramp_time,
        deadline: spec.runtime.map(|r| start + spec.ramp_time + r),
    });
    type Joined = (Result<CloneResult, String>, Box<dyn Lane>);
    let (results, device_cpu, helper_cpu) = std::thread::scope(|s| {
        let handles: Vec<Result<std::thread::ScopedJoinHandle<'_, Joined>, String>> = lanes
            .into_iter()
            .zip(&regions)
            .enumerate()
            .map(|(i, (mut lane, &(off, len)))| {
                let barrier = barrier.clone();
                let window = window.clone();
                let seed = cfg.seed.wrapping_add(i as u64 * 0x9E37_79B9);
                let cpu = (!cfg.job_cpus.is_empty()).then(|| cfg.job_cpus[i % cfg.job_cpus.len()]);
                std::thread::Builder::new()
                    .name(format!("vblk-job{i}"))
                    .spawn_scoped(s, move || {
                        if let Some(c) = cpu {
                            if let Err(e) = device::config::pin_current_thread(c) {
                                log::warn!("cannot pin job {i} to CPU {c}: {e}");
                            }
                        }
                        barrier.wait();
                        let r = run_clone(
                            spec,
                            lane.as_mut(),
                            i as u32,
                            (off, len),
                            geo.block,
                            seed,
                            &window,
                            progress,
                        );
                        // The lane, and with it the device connection, must outlive the
                        // final CPU sample: the caller drops it.
                        (r, lane)
                    })
                    .map_err(|e| format!("cannot start a job thread: {e}"))
            })
            .collect();
        barrier.wait();
        // Device CPU is sampled over the window the clones measure in.
        std::thread::sleep(window.ramp_end.saturating_duration_since(Instant::now()));
        let dev0 = target.device_sample();
        let help0 = target.helper_sample();
        let mut lanes = Vec::new();
        let mut lane_notes = Vec::new();
        let results: Vec<Result<CloneResult, String>> = handles
            .into_iter()
            .map(|h| {
                let (r, lane) = h?.join().map_err(|_| "a job thread panicked".to_string())?;
                if let Some(d) = lane.describe() {
                    if !lane_notes.contains(&d) {
                        lane_notes.push(d);
                    }
                }
                lanes.push(lane);
                r
            })
            .collect();
        let dev = dev0.and_then(|d0| target.device_sample().map(|d1| d1.since(&d0)));
        let help = target.helper_sample().since(&help0);
        drop(lanes);
        notes.extend(lane_notes);
        (results, dev, help)
    });
    let clones_out = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    if !spec.ramp_time.is_zero()
        && !spec.time_based
        && clones_out.iter().all(|c| c.read.ios + c.write.ios == 0)
    {
        return Err(format!(
            "the job ended within its ramp time ({:?}): nothing was measured (a job bound by its size must outlast ramp_time: raise size, lower ramp_time, or add time_based with a runtime)",
            spec.ramp_time
        ));
    }
    Ok(JobReport {
        spec: spec.clone(),
        clones: clones_out,
        device_cpu,
        helper_cpu,
        target: target.describe(),
        path: if target.is_baseline() {
            "baseline".into()
        } else {
            cfg.path.to_string()
        },
        notes,
    })
}

struct Slot {
    dir: IoDir,
    offset: u64,
    len: u64,
    /// Before and after its submission, on the [`Clock`].
    t0: u64,
    t1: u64,
}

/// Whether `u` overlaps an I/O in flight: a slot that is not in `free`.
fn overlaps_in_flight(slots: &[Slot], free: &[usize], u: &IoUnit) -> bool {
    slots.iter().enumerate().any(|(i, s)| {
        u.offset < s.offset + s.len && s.offset < u.offset + u.len && !free.contains(&i)
    })
}

/// Fill `buf` with pseudo-random bytes from `seed` (xorshift64*; never all zero).
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

#[allow(clippy::too_many_arguments)]
fn run_clone(
    spec: &JobSpec,
    lane: &mut dyn Lane,
    index: u32,
    (start, len): (u64, u64),
    align: u64,
    seed: u64,
    w: &Window,
    progress: &Progress,
) -> Result<CloneResult, String> {
    let mut gen = Generator::new(spec, start, len, align, seed)?;
    let depth = lane.depth();
    let mut slots: Vec<Slot> = (0..depth)
        .map(|_| Slot {
            dir: IoDir::Read,
            offset: 0,
            len: 0,
            t0: 0,
            t1: 0,
        })
        .collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut done: Vec<Done> = Vec::with_capacity(depth);
    let mut read = DirResult::new();
    let mut write = DirResult::new();
    let verifying = spec.verify.is_some();
    let mut written = verifying.then(|| WrittenMap::new(start, len));
    let mut generation = 0u64;
    let mut verified = 0u64;
    let batch_submit = spec.iodepth_batch_submit.max(1) as usize;
    let batch_complete = spec.iodepth_batch_complete.max(1) as usize;
    let byte_limit = if spec.time_based { None } else { Some(len) };
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut stopping = false;
    let mut measuring = false;
    let mut cpu0 = Cpu::this_thread();
    let clock = Clock::get();
    let mut ramp_mark = Mark::new(clock, w.ramp_end);
    let mut deadline = w.deadline.map(|d| Mark::new(clock, d));
    let mut first_measured: Option<u64> = None;
    let mut last_done = clock.now_ns();
    let mut pacer = Pacer::of(spec, w.start);
    // The next I/O, drawn but held back by the rate.
    let mut pending = None;
    if spec.rw.writes() && !verifying {
        // Written payloads are pseudo-random bytes, filled once, as fio's buffers are by
        // default: a target that compresses, deduplicates or skips zeroes must not be
        // handed zeroes (they were all zero). A mixed job's write may carry what a read
        // brought into its buffer, as in fio.
        let max = gen.max_block() as usize;
        for slot in 0..depth {
            fill_random(lane.buf(slot, max), seed ^ ((slot as u64) << 32));
        }
    }
    std::thread::sleep(w.start.saturating_duration_since(Instant::now()));
    loop {
        let now = clock.now_ns();
        let ramp_end = ramp_mark.ns(clock, now);
        if !measuring && now >= ramp_end {
            measuring = true;
            cpu0 = Cpu::this_thread();
            first_measured = Some(now);
        }
        if deadline.as_mut().is_some_and(|d| now >= d.ns(clock, now))
            || progress.stop.load(Ordering::Relaxed)
        {
            stopping = true;
        }
        // Submit until the depth is full (or the rate says wait).
        let mut unsent = 0;
        let mut due = None;
        while !stopping && in_flight < depth && !free.is_empty() {
            let u = pending.take().unwrap_or_else(|| gen.next());
            // Verified I/O never overlaps I/O in flight (fio's serialize_overlap): a read
            // racing a write of the same sectors may find either, or a sector half
            // written, and the written map would say which it must be only afterwards.
            if verifying && overlaps_in_flight(&slots, &free, &u) {
                pending = Some(u);
                break;
            }
            if let Some(p) = pacer.as_mut() {
                let now = Instant::now();
                if let Some(t) = p.due(u.dir, now) {
                    pending = Some(u);
                    due = Some(t);
                    break;
                }
                p.started(u.dir, u.len, now);
            }
            let Some(slot) = free.pop() else { break };
            if u.dir == IoDir::Write && verifying {
                generation += 1;
                verify::fill(lane.buf(slot, u.len as usize), u.offset, generation);
            }
            let t0 = clock.now_ns();
            lane.submit(slot, u.dir, u.offset, u.len)?;
            let t1 = clock.now_ns();
            slots[slot] = Slot {
                dir: u.dir,
                offset: u.offset,
                len: u.len,
                t0,
                t1,
            };
            in_flight += 1;
            issued += u.len;
            // Counted rather than `n % batch_submit`: no division per I/O.
            unsent += 1;
            if unsent == batch_submit {
                unsent = 0;
                lane.unplug()?;
            }
            if byte_limit.is_some_and(|l| issued >= l) {
                stopping = true;
            }
        }
        lane.unplug()?;
        if in_flight == 0 {
            match due {
                // Held back by the rate with nothing in flight: sleep until it is due.
                Some(t) if !stopping => {
                    std::thread::sleep(t.saturating_duration_since(Instant::now()));
                    continue;
                }
                _ => break,
            }
        }
        done.clear();
        lane.wait(batch_complete.min(in_flight), &mut done)?;
        let tc = clock.now_ns();
        let mut bytes = 0;
        for &(slot, ref result) in &done {
            in_flight -= 1;
            free.push(slot);
            let s = &slots[slot];
            if let Err(e) = result {
                return Err(format!(
                    "{:?} of {} bytes at offset {} failed: {e}",
                    s.dir, s.len, s.offset
                ));
            }
            if let Some(map) = written.as_mut() {
                match s.dir {
                    IoDir::Write => map.mark(s.offset, s.len),
                    IoDir::Read => {
                        verified += verify::check(lane.buf(slot, s.len as usize), s.offset, map)
                            .map_err(|e| e.to_string())?
                    }
                }
            }
            bytes += s.len;
            // Throughput counts every I/O that completes in the measured window (as fio
            // does: its statistics restart at the ramp's end); latency only those sent in
            // it, so that none has part of its latency cut off. (Counting only I/Os sent
            // after the ramp left a window's first QD completions out: 2 % of a 3 s run of
            // a disk limited to 256 IOPS at QD16.)
            if measuring {
                let d = if s.dir == IoDir::Read {
                    &mut read
                } else {
                    &mut write
                };
                d.ios += 1;
                d.bytes += s.len;
                if s.t0 >= ramp_end {
                    let slat = s.t1.saturating_sub(s.t0);
                    let clat = tc.saturating_sub(s.t1);
                    d.slat.record(slat.max(1));
                    d.clat.record(clat.max(1));
                    d.lat.record((slat + clat).max(1));
                }
            }
        }
        last_done = tc;
        progress.ios.fetch_add(done.len() as u64, Ordering::Relaxed);
        progress.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
    let cpu = Cpu::this_thread().since(&cpu0);
    let runtime = first_measured.map_or(Duration::ZERO, |f| {
        Duration::from_nanos(last_done.saturating_sub(f))
    });
    if let Some(map) = &written {
        verified += verify_pass(lane, map, gen.max_block())?;
    }
    Ok(CloneResult {
        index,
        read,
        write,
        runtime,
        cpu,
        verified,
    })
}

/// Read back everything this clone wrote and check it.
fn verify_pass(lane: &mut dyn Lane, map: &WrittenMap, chunk: u64) -> Result<u64, String> {
    let mut checked = 0;
    let mut done = Vec::with_capacity(1);
    for (off, len) in map.extents() {
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(chunk);
            lane.submit(0, IoDir::Read, at, n)?;
            lane.unplug()?;
            done.clear();
            lane.wait(1, &mut done)?;
            if let Some((_, Err(e))) = done.first() {
                return Err(format!(
                    "verify read of {n} bytes at offset {at} failed: {e}"
                ));
            }
            checked +=
                verify::check(lane.buf(0, n as usize), at, map).map_err(|e| e.to_string())?;
            at += n;
        }
    }
    Ok(checked)
}
