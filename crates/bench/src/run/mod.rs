//! Running a job: one lane per clone (numjobs), each clone on a thread of its own or, with
//! `job_threads`, several clones on one thread (`shared.rs`); iodepth I/Os kept in flight,
//! submissions unplugged per `iodepth_batch_submit`, completions reaped per
//! `iodepth_batch_complete`, latencies recorded after the ramp, CPU measured on both sides.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use driver::{PathKind, RequestOptions};

use crate::clock::Clock;
use crate::job::{JobSpec, Size};
use crate::lane::Lane;
use crate::stats::{Cpu, Latency};
use crate::target::{AttachOptions, Geometry, Target};
use crate::workload::Generator;

mod clone;
mod shared;

use clone::CloneArgs;

/// The default of [`RunConfig::io_timeout`]: as long as Linux's SCSI disks wait for a
/// command, far beyond any sane device's latency (a simulated 7200 rpm disk at QD32 takes
/// 0.4 s per random read).
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// CPUs for the job threads: thread i on `job_cpus[i % len]` (empty: not pinned).
    pub job_cpus: Vec<usize>,
    /// Threads the clones run on: clone i on thread `i % job_threads`, each thread serving
    /// its clones in one polling loop (0: a thread per clone).
    pub job_threads: usize,
    /// The request path's tunables (elevator, fifo_batch, ...).
    pub request: RequestOptions,
    /// The longest a clone waits with I/O in flight and none completing before the job
    /// fails: a device that holds its requests (stopped, hung, or slower than this) ends
    /// the run with an error naming it, rather than hanging it.
    pub io_timeout: Duration,
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
            job_threads: 0,
            io_timeout: IO_TIMEOUT,
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
    /// The longest a clone waits with I/O in flight and none completing.
    io_timeout: Duration,
}

/// The clones one thread runs: their arguments and lanes.
type Members = Vec<(CloneArgs, Box<dyn Lane>)>;

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
    // Clone i on thread i % threads: one thread each unless job_threads says fewer.
    let threads = match cfg.job_threads {
        0 => clones,
        t => t.min(clones),
    };
    if threads < clones {
        notes.push(format!(
            "{clones} clones on {threads} thread(s) (--job-threads), each thread serving its clones in one loop"
        ));
    }
    let mut groups: Vec<Members> = (0..threads).map(|_| Vec::new()).collect();
    for (i, (lane, &region)) in lanes.into_iter().zip(&regions).enumerate() {
        let args = CloneArgs {
            index: i as u32,
            region,
            align: geo.block,
            seed: cfg.seed.wrapping_add(i as u64 * 0x9E37_79B9),
        };
        groups[i % threads].push((args, lane));
    }
    let barrier = Arc::new(Barrier::new(threads + 1));
    // Calibrated before the window is set (once per process; it takes 10 ms).
    Clock::get();
    let start = Instant::now() + Duration::from_millis(20);
    let window = Arc::new(Window {
        start,
        ramp_end: start + spec.ramp_time,
        deadline: spec.runtime.map(|r| start + spec.ramp_time + r),
        io_timeout: cfg.io_timeout,
    });
    type Joined = (Result<Vec<CloneResult>, String>, Members);
    let (results, device_cpu, helper_cpu) = std::thread::scope(|s| {
        let handles: Vec<Result<std::thread::ScopedJoinHandle<'_, Joined>, String>> = groups
            .into_iter()
            .enumerate()
            .map(|(t, mut members)| {
                let barrier = barrier.clone();
                let window = window.clone();
                let cpu = (!cfg.job_cpus.is_empty()).then(|| cfg.job_cpus[t % cfg.job_cpus.len()]);
                std::thread::Builder::new()
                    .name(format!("vblk-job{t}"))
                    .spawn_scoped(s, move || {
                        if let Some(c) = cpu {
                            if let Err(e) = device::config::pin_current_thread(c) {
                                log::warn!("cannot pin job thread {t} to CPU {c}: {e}");
                            }
                        }
                        barrier.wait();
                        let r = if let [(args, lane)] = members.as_mut_slice() {
                            clone::run_alone(spec, lane.as_mut(), *args, &window, progress)
                                .map(|r| vec![r])
                        } else {
                            shared::run_together(spec, &mut members, cfg.spin, &window, progress)
                        };
                        // The lanes, and with them the device connections, must outlive
                        // the final CPU sample: the caller drops them.
                        (r, members)
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
        let mut results: Vec<Result<CloneResult, String>> = Vec::new();
        for h in handles {
            let joined = h.and_then(|h| h.join().map_err(|_| "a job thread panicked".to_string()));
            match joined {
                Ok((r, members)) => {
                    for (_, lane) in members {
                        if let Some(d) = lane.describe() {
                            if !lane_notes.contains(&d) {
                                lane_notes.push(d);
                            }
                        }
                        lanes.push(lane);
                    }
                    match r {
                        Ok(rs) => results.extend(rs.into_iter().map(Ok)),
                        Err(e) => results.push(Err(e)),
                    }
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let dev = dev0.and_then(|d0| target.device_sample().map(|d1| d1.since(&d0)));
        let help = target.helper_sample().since(&help0);
        drop(lanes);
        notes.extend(lane_notes);
        (results, dev, help)
    });
    let mut clones_out = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    clones_out.sort_by_key(|c| c.index);
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
