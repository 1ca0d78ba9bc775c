//! `vblk bench`: the command line of the benchmark (the work is in the `bench` crate).

use std::error::Error;
use std::path::PathBuf;
use std::time::Duration;

use bench::job::{apply_option, parse_job_file, JobSpec};
use bench::plan::{self, Format, Plan};
use bench::run::RunConfig;
use bench::target::TargetSpec;
use clap::Args;
use storage::{CacheMode, DiskSpec, EngineKind};

/// Benchmark virtio-blk I/O paths, fio-style.
///
/// With no arguments, starts an embedded vblk device on a 1 GiB RAM disk (io_uring engine),
/// runs 4 KiB random reads at queue depth 32 on each I/O path, and prints a comparison.
///
/// Jobs come from fio job files (`[global]` and named sections; options vblk does not
/// support are named as ignored in each job's notes; direct=1 opens the disk with
/// O_DIRECT unless --cache is given) and/or the fio-named flags below, which apply to
/// every job. Targets: the embedded device (default; --disk, --engine, --engine-threads,
/// --poll-us, --coalesce-us, --threads, --cache), any vhost-user-blk socket (--socket,
/// --device-pid), or --baseline: the same job straight on the disk through the engine with
/// no virtio in between.
///
/// Examples:
///   vblk bench
///   vblk bench --rw=randwrite --bs=4k --iodepth=32 --runtime=5 --time_based --path=batch
///   vblk bench bench/jobs/iometer-file-server.fio --runtime=10
///   vblk bench --socket /tmp/qsd.sock --device-pid 1234 --compare path=bio,batch --repeat 3
///   vblk bench --disk /var/tmp/disk.img --cache none --compare target=embedded,baseline
///   vblk bench --disk /var/tmp/disk.img --cache none --compare engine=io_uring,aio,threads,sync
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct BenchArgs {
    /// fio job files to run (in order).
    #[arg(value_name = "JOBFILE")]
    pub job_files: Vec<PathBuf>,
    /// Run only the job files' sections of this name, as fio's --section (repeatable):
    /// `vblk bench bench/jobs/matrix-16.fio --section write-iops --section rw-iops`.
    #[arg(long = "section", value_name = "NAME")]
    pub sections: Vec<String>,

    /// Job name (for flag-defined jobs).
    #[arg(long)]
    pub name: Option<String>,
    /// read, write, randread, randwrite, rw (readwrite), randrw.
    #[arg(long, value_name = "MODE")]
    pub rw: Option<String>,
    /// Block size, e.g. 4k, 64k, 1m [default: 4k].
    #[arg(long, value_name = "SIZE")]
    pub bs: Option<String>,
    /// Weighted block sizes, e.g. 4k/50:64k/40:1m/10.
    #[arg(long, value_name = "SPLIT")]
    pub bssplit: Option<String>,
    /// I/Os kept in flight per job [default: 1].
    #[arg(long, value_name = "N")]
    pub iodepth: Option<String>,
    /// Submit this many I/Os before notifying the device [default: 1].
    #[arg(
        long = "iodepth_batch_submit",
        alias = "iodepth_batch",
        value_name = "N"
    )]
    pub iodepth_batch_submit: Option<String>,
    /// Reap at least this many completions at a time [default: 1].
    #[arg(
        long = "iodepth_batch_complete",
        alias = "iodepth_batch_complete_min",
        value_name = "N"
    )]
    pub iodepth_batch_complete: Option<String>,
    /// Clones of each job, each on its own thread and its own queue [default: 1].
    #[arg(long, value_name = "N")]
    pub numjobs: Option<String>,
    /// Percentage of reads in mixed workloads [default: 50].
    #[arg(long, value_name = "PCT")]
    pub rwmixread: Option<String>,
    /// Bytes of the device each job covers, or N% [default: the whole device].
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Start of the region on the device [default: 0].
    #[arg(long, value_name = "SIZE")]
    pub offset: Option<String>,
    /// Stop after this long (seconds, or with ms/s/m/h) [default: when size is done].
    #[arg(long, value_name = "TIME")]
    pub runtime: Option<String>,
    /// Run for the whole runtime, wrapping around the region.
    #[arg(long = "time_based", alias = "time-based")]
    pub time_based: bool,
    /// Warm up this long before measuring.
    #[arg(long = "ramp_time", alias = "ramp-time", value_name = "TIME")]
    pub ramp_time: Option<String>,
    /// Pick random blocks with replacement instead of each once per pass.
    #[arg(long)]
    pub norandommap: bool,
    /// crc32c: check every block written when it is read back (and after the run).
    #[arg(long, value_name = "KIND")]
    pub verify: Option<String>,
    /// Issue at most this many I/Os per second per job (`R` or `R,W`: reads, writes; `,W`
    /// limits writes only), like fio: for comparing devices at equal offered load.
    #[arg(long = "rate_iops", alias = "rate-iops", value_name = "R[,W]")]
    pub rate_iops: Option<String>,
    /// Issue at most this many bytes per second per job (`R` or `R,W`, with k/m/g
    /// suffixes).
    #[arg(long, value_name = "R[,W]")]
    pub rate: Option<String>,

    /// A vhost-user-blk device to run against instead of the embedded one. Repeat it to
    /// drive several devices at once: each job's clones are spread over them (clone i on
    /// the (i mod n)-th socket, a queue each), so --numjobs must be at least the number of
    /// sockets: `--socket a.sock --socket b.sock --numjobs 2`.
    #[arg(long, value_name = "PATH", conflicts_with = "baseline")]
    pub socket: Vec<PathBuf>,
    /// The external device's process, to measure its CPU (with several sockets: the one
    /// process serving them all).
    #[arg(long, value_name = "PID", requires = "socket")]
    pub device_pid: Option<i32>,
    /// Run the job on the disk through the engine (--engine) with no virtio in between.
    #[arg(long)]
    pub baseline: bool,
    /// The disk of the embedded device or the baseline: PATH, mem:SIZE, null:SIZE, hdd:SIZE
    /// (a simulated 7200 rpm disk; hdd:SIZE:xN is N times faster), `nbd://HOST[:PORT]/EXPORT`,
    /// `nbd+unix:///EXPORT?socket=PATH`.
    #[arg(long, value_name = "SPEC", default_value = "mem:1G")]
    pub disk: DiskSpec,
    /// Engine of the embedded device or the baseline (files and block devices; RAM and
    /// null disks are served in memory whatever the engine):
    ///   io_uring  batched submission on one ring per worker.
    ///   aio       Linux AIO (io_submit, 32 per call), QEMU's aio=native; needs --cache none.
    ///   threads   a pool of --engine-threads threads per worker, QEMU's aio=threads.
    ///   sync      preadv/pwritev on the worker, one request at a time.
    #[arg(
        long,
        value_name = "ENGINE",
        default_value = "io_uring",
        verbatim_doc_comment
    )]
    pub engine: String,
    /// Threads of each worker's pool with the threads engine (1-64) [default: 16].
    #[arg(long, value_name = "N", default_value_t = storage::DEFAULT_ENGINE_THREADS)]
    pub engine_threads: usize,
    /// Host cache of the embedded device or the baseline: none (O_DIRECT), writeback.
    /// [default: writeback; none when a job says direct=1, as fio's O_DIRECT does]
    #[arg(long, value_name = "MODE")]
    pub cache: Option<String>,
    /// The embedded device's image format, as `vblk serve --format`: raw, or qcow2
    /// (with --backing for its chain) [default: a raw file; one that looks like another
    /// format is refused].
    #[arg(long, value_name = "raw|qcow2", conflicts_with = "baseline")]
    pub format: Option<String>,
    /// qcow2 images: a backing file below the image, read-only; repeat it for each image
    /// further down the chain, in order, as `vblk serve --backing`.
    #[arg(long, value_name = "PATH[,format=F]", conflicts_with = "baseline")]
    pub backing: Vec<storage::qcow2::BackingFile>,
    /// NBD disks: connections per embedded-device worker (or baseline job) when the server
    /// offers multi-conn.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nbd_conns: u32,
    /// Polling window of the embedded device's workers, µs.
    #[arg(long, value_name = "US", default_value_t = device::config::DEFAULT_POLL_US)]
    pub poll_us: u64,
    /// How long the embedded device's workers may leave a paced job's requests waiting to
    /// serve several per wake-up, µs (0: never; `vblk serve --coalesce-us`).
    #[arg(long, value_name = "US", default_value_t = device::config::DEFAULT_COALESCE_US)]
    pub coalesce_us: u64,
    /// Worker threads of the embedded device.
    #[arg(long, value_name = "T", default_value_t = 1)]
    pub threads: usize,

    /// The driver's I/O path: bio (each I/O straight to the ring), batch (one notification
    /// per batch), request (plug, merge, elevator), passthru (raw commands, polled
    /// completions), auto (chosen from the device's hints and trials).
    #[arg(long, value_name = "PATH", default_value = "bio")]
    pub path: String,
    /// The request path's elevator: noop (FIFO with merging), deadline (mq-deadline), bfq
    /// (proportional share between flows).
    #[arg(
        long,
        value_name = "NAME",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub elevator: Option<String>,
    /// deadline: requests served in sector order per batch (default 16).
    #[arg(
        long,
        value_name = "N",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub fifo_batch: Option<String>,
    /// deadline: a read waiting this long is served next, ms (default 500).
    #[arg(
        long,
        value_name = "MS",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub read_expire: Option<String>,
    /// deadline: a write waiting this long is served next, ms (default 5000).
    #[arg(
        long,
        value_name = "MS",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub write_expire: Option<String>,
    /// deadline: read batches that may pass waiting writes (default 2).
    #[arg(
        long,
        value_name = "N",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub writes_starved: Option<String>,
    /// deadline: 0 turns front merges off (default 1).
    #[arg(
        long,
        value_name = "0|1",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub front_merges: Option<String>,
    /// Largest merged request, KiB (default 1280).
    #[arg(
        long,
        value_name = "KIB",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub max_sectors_kb: Option<String>,
    /// 0 merge everywhere, 1 only with the plug's last request, 2 never (default 0).
    #[arg(
        long,
        value_name = "0|1|2",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub nomerges: Option<String>,
    /// Requests the plug gathers before it is flushed (default 32).
    #[arg(
        long,
        value_name = "N",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub plug_count: Option<String>,
    /// Requests on the ring at most; more wait in the elevator (default 0: the ring size).
    #[arg(
        long,
        value_name = "N",
        help_heading = "Request path (Linux's sysfs names)"
    )]
    pub queue_depth: Option<String>,
    /// Entries per virtqueue.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub queue_size: u16,
    /// How long the driver spins on the used ring before sleeping, µs.
    #[arg(long, value_name = "US", default_value_t = 50)]
    pub spin_us: u64,
    /// Run each job's clones on this many threads, clone i on thread i mod N (default: a
    /// thread per clone). A thread with several clones serves them in one loop: it fills
    /// every clone's queue, polls them all, spins for --spin-us while I/O is in flight and
    /// then sleeps on all of their completions at once, as one vCPU or one SPDK reactor
    /// serves several disks. With --numjobs 16 --job-threads 1, sixteen paced clones cost
    /// one thread's wake-ups, not sixteen threads' context switches. Each clone keeps its
    /// own pace, depth and latency figures; the thread's CPU time is shared out among its
    /// clones by the I/Os each completed.
    #[arg(long, value_name = "N")]
    pub job_threads: Option<usize>,
    /// Fail the job when no I/O completes for this long while some are in flight, naming
    /// what is held: a stopped, hung or lost device ends the run with an error rather than
    /// hanging it. Seconds, fractions allowed.
    #[arg(long, value_name = "SECS", default_value = "30")]
    pub io_timeout: f64,
    /// Run each job once per value of an option (any job or bench option), e.g.
    /// path=bio,batch or engine=io_uring,aio,threads,sync or engine_threads=4,16 or
    /// target=embedded,baseline or socket=/run/a.sock@PID,/run/b.sock@PID (devices side by
    /// side). Variants that set several options are separated by ';', their settings by
    /// ',', e.g. "path=bio;path=request,elevator=deadline,queue_depth=2".
    #[arg(long, value_name = "KEY=V1,V2")]
    pub compare: Option<String>,
    /// Runs per variant, taking turns (the table shows mean ± stddev and, against the first
    /// variant, the paired ratio: the geometric mean of the rounds' ratios with its 95 %
    /// interval, which cancels what the machine drifts from round to round).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeat: u32,
    /// normal or json.
    #[arg(long = "output-format", value_name = "FMT", default_value = "normal")]
    pub output_format: String,
    /// Draw the comparison as an SVG bar chart.
    #[arg(long, value_name = "FILE", requires = "compare")]
    pub plot: Option<PathBuf>,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = 0x5eed)]
    pub seed: u64,
    /// Do not pin job threads and the embedded device's workers to separate CPUs (they
    /// are pinned when the machine has a CPU for each).
    #[arg(long)]
    pub no_pin: bool,
}

impl BenchArgs {
    /// The job options given as flags, as fio key/value pairs.
    fn job_flags(&self) -> Vec<(&'static str, Option<&str>)> {
        let mut v: Vec<(&'static str, Option<&str>)> = [
            ("name", &self.name),
            ("rw", &self.rw),
            ("bs", &self.bs),
            ("bssplit", &self.bssplit),
            ("iodepth", &self.iodepth),
            ("iodepth_batch_submit", &self.iodepth_batch_submit),
            ("iodepth_batch_complete", &self.iodepth_batch_complete),
            ("numjobs", &self.numjobs),
            ("rwmixread", &self.rwmixread),
            ("size", &self.size),
            ("offset", &self.offset),
            ("runtime", &self.runtime),
            ("ramp_time", &self.ramp_time),
            ("verify", &self.verify),
            ("rate_iops", &self.rate_iops),
            ("rate", &self.rate),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, Some(v))))
        .collect();
        if self.time_based {
            v.push(("time_based", None));
        }
        if self.norandommap {
            v.push(("norandommap", None));
        }
        v
    }

    fn is_default_run(&self) -> bool {
        self.job_files.is_empty() && self.job_flags().is_empty() && self.compare.is_none()
    }
}

impl TryFrom<&BenchArgs> for Plan {
    type Error = String;

    fn try_from(a: &BenchArgs) -> Result<Plan, String> {
        let engine: EngineKind = a
            .engine
            .parse()
            .map_err(|e: storage::Error| format!("--engine: {e}"))?;
        let cache: Option<CacheMode> = a
            .cache
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e: storage::Error| format!("--cache: {e}"))?;
        let format = match a.output_format.as_str() {
            "normal" => Format::Normal,
            "json" => Format::Json,
            f => return Err(format!("--output-format {f}: expected normal or json")),
        };
        let mut jobs: Vec<JobSpec> = Vec::new();
        for f in &a.job_files {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            let parsed = parse_job_file(&text).map_err(|e| format!("{}: {e}", f.display()))?;
            if parsed.is_empty() {
                return Err(format!("{}: no job sections", f.display()));
            }
            jobs.extend(parsed);
        }
        if !a.sections.is_empty() {
            for want in &a.sections {
                if !jobs.iter().any(|j| &j.name == want) {
                    let have: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
                    return Err(format!(
                        "--section {want}: no such job section in the job files (they have: {})",
                        if have.is_empty() {
                            "none; --section needs a job file".to_string()
                        } else {
                            have.join(", ")
                        }
                    ));
                }
            }
            jobs.retain(|j| a.sections.contains(&j.name));
        }
        let flags = a.job_flags();
        if jobs.is_empty() {
            jobs.push(if a.is_default_run() {
                plan::default_job()
            } else {
                JobSpec {
                    name: "vblk".into(),
                    ..JobSpec::default()
                }
            });
        }
        for j in &mut jobs {
            for (k, v) in &flags {
                apply_option(j, k, *v).map_err(|e| format!("--{k}: {e}"))?;
            }
            j.finish();
        }
        // A job's direct=1 means O_DIRECT unless --cache says otherwise; the cache is the
        // target's, shared by every job.
        let direct = jobs.iter().any(|j| j.direct == Some(true));
        let cache = cache.unwrap_or(if direct {
            CacheMode::None
        } else {
            CacheMode::Writeback
        });
        for j in &mut jobs {
            let wants_direct = j.direct == Some(true);
            if j.direct.is_some() && wants_direct != (cache == CacheMode::None) {
                j.ignored.push(format!(
                    "{} (--cache {cache} is the target's, for every job)",
                    if wants_direct { "direct=1" } else { "direct=0" }
                ));
            } else if j.direct.is_none() && a.cache.is_none() && direct {
                // Said where it applies without the job asking.
                j.notes.push(
                    "O_DIRECT (cache none): another job says direct=1, and the cache is the target's, for every job".into(),
                );
            }
        }
        let target = if let Some((path, also)) = a.socket.split_first() {
            TargetSpec::Socket {
                path: path.clone(),
                device_pid: a.device_pid,
                also: also.to_vec(),
            }
        } else if a.baseline {
            TargetSpec::Baseline {
                disk: a.disk.clone(),
                engine,
                cache,
                engine_threads: a.engine_threads,
            }
        } else {
            let mut e = plan::embedded_defaults();
            e.daemon.poll_us = a.poll_us;
            e.daemon.coalesce_us = a.coalesce_us;
            e.daemon.threads = a.threads;
            let mut image = e.device.image;
            if let Some(f) = &a.format {
                image.format = Some(f.parse().map_err(|e: String| format!("--format: {e}"))?);
            }
            e.device = device::DeviceConfig {
                disk: a.disk.clone(),
                engine,
                cache,
                image,
                backing: a.backing.clone(),
                engine_threads: a.engine_threads,
                nbd: storage::nbd::NbdOptions {
                    conns: a.nbd_conns.clamp(1, 64),
                    ..Default::default()
                },
                ..e.device
            };
            TargetSpec::Embedded(Box::new(e))
        };
        let mut request = driver::RequestOptions::default();
        for (k, v) in [
            ("elevator", &a.elevator),
            ("fifo_batch", &a.fifo_batch),
            ("read_expire", &a.read_expire),
            ("write_expire", &a.write_expire),
            ("writes_starved", &a.writes_starved),
            ("front_merges", &a.front_merges),
            ("max_sectors_kb", &a.max_sectors_kb),
            ("nomerges", &a.nomerges),
            ("plug_count", &a.plug_count),
            ("queue_depth", &a.queue_depth),
        ] {
            if let Some(v) = v {
                request
                    .set(k, v)
                    .map_err(|e| format!("--{}: {e}", k.replace('_', "-")))?;
            }
        }
        let run = RunConfig {
            path: a.path.parse().map_err(|e: String| format!("--path: {e}"))?,
            spin: Duration::from_micros(a.spin_us),
            queue_size: a.queue_size,
            seed: a.seed,
            pin: !a.no_pin,
            job_cpus: Vec::new(),
            job_threads: match a.job_threads {
                Some(0) => return Err("--job-threads 0: must be at least 1".into()),
                Some(n) => n,
                None => 0,
            },
            request,
            io_timeout: match a.io_timeout {
                t if t.is_finite() && t > 0.0 && t <= 86_400.0 => Duration::from_secs_f64(t),
                t => {
                    return Err(format!(
                        "--io-timeout {t}: must be more than 0 and at most 86400 seconds"
                    ))
                }
            },
        };
        let compare = match (&a.compare, a.is_default_run()) {
            (Some(c), _) => Some(plan::Compare::parse(c)?),
            (None, true) => Some(plan::all_paths()),
            (None, false) => None,
        };
        if a.repeat == 0 {
            return Err("--repeat 0: must be at least 1".into());
        }
        Ok(Plan {
            jobs,
            target,
            run,
            compare,
            repeat: a.repeat,
            format,
            plot: a.plot.clone(),
            progress: true,
        })
    }
}

/// `vblk bench`.
pub fn run(args: BenchArgs) -> Result<(), Box<dyn Error>> {
    let plan = Plan::try_from(&args)?;
    let out = plan::execute(&plan)?;
    out!("{out}");
    Ok(())
}
