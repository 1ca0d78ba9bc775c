//! What `vblk bench` runs: jobs × variants × repeats on a target, and the output.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use driver::PathKind;
use storage::{CacheMode, DiskSpec, EngineKind};

use crate::job::{apply_option, JobSpec};
use crate::report::{self, Row};
use crate::run::{run_job, JobReport, Progress, RunConfig};
use crate::target::{EmbeddedDevice, Target, TargetSpec};

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Format {
    /// fio-like text.
    #[default]
    Normal,
    /// JSON with fio's field names.
    Json,
}

/// A whole benchmark invocation.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The jobs, in order.
    pub jobs: Vec<JobSpec>,
    /// Where to run.
    pub target: TargetSpec,
    /// How to run.
    pub run: RunConfig,
    /// `--compare`: run each job once per variant.
    pub compare: Option<Compare>,
    /// Runs per variant.
    pub repeat: u32,
    /// Output format.
    pub format: Format,
    /// Write an SVG chart of the comparison here.
    pub plot: Option<PathBuf>,
    /// Show a live progress line (when stdout is a terminal).
    pub progress: bool,
}

/// The job `vblk bench` runs when given no job: 4 KiB random reads at QD32 for 2 s after a
/// 0.5 s ramp.
pub fn default_job() -> JobSpec {
    let mut j = JobSpec {
        name: "randread-4k-qd32".into(),
        ..JobSpec::default()
    };
    for (k, v) in [
        ("rw", "randread"),
        ("bs", "4k"),
        ("iodepth", "32"),
        ("runtime", "2"),
        ("ramp_time", "500ms"),
        ("time_based", ""),
    ] {
        let v = (!v.is_empty()).then_some(v);
        if let Err(e) = apply_option(&mut j, k, v) {
            unreachable!("the default job's option {k} is invalid: {e}");
        }
    }
    j.finish();
    j
}

/// Apply one `key=value` of a variant: bench keys change the target or the run, anything
/// else is a job option.
pub fn apply_variant(
    key: &str,
    value: &str,
    jobs: &mut [JobSpec],
    target: &mut TargetSpec,
    run: &mut RunConfig,
) -> Result<(), String> {
    let key_n = key.replace('-', "_");
    let bad = |what: &str| format!("--compare {key}={value}: {what}");
    match (key_n.as_str(), target) {
        ("path", _) => run.path = value.parse().map_err(|e: String| bad(&e))?,
        ("pin", _) => {
            run.pin = match value {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => return Err(bad("expected 0 or 1")),
            }
        }
        (
            "elevator" | "scheduler" | "fifo_batch" | "read_expire" | "write_expire"
            | "writes_starved" | "front_merges" | "max_sectors_kb" | "nomerges" | "plug_count"
            | "queue_depth",
            _,
        ) => run.request.set(&key_n, value).map_err(|e| bad(&e))?,
        ("queue_size", _) => run.queue_size = value.parse().map_err(|_| bad("not a number"))?,
        ("spin_us", _) => {
            run.spin = Duration::from_micros(value.parse().map_err(|_| bad("not a number"))?)
        }
        ("job_threads", _) => run.job_threads = value.parse().map_err(|_| bad("not a number"))?,
        ("engine", TargetSpec::Embedded(c)) => {
            c.engine = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("engine", TargetSpec::Baseline { engine, .. }) => {
            *engine = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("engine_threads", TargetSpec::Embedded(c)) => {
            c.engine_threads = value.parse().map_err(|_| bad("not a number"))?
        }
        ("engine_threads", TargetSpec::Baseline { engine_threads, .. }) => {
            *engine_threads = value.parse().map_err(|_| bad("not a number"))?
        }
        ("poll_us", TargetSpec::Embedded(c)) => {
            c.daemon.poll_us = value.parse().map_err(|_| bad("not a number"))?
        }
        ("coalesce_us", TargetSpec::Embedded(c)) => {
            c.daemon.coalesce_us = value.parse().map_err(|_| bad("not a number"))?
        }
        ("threads", TargetSpec::Embedded(c)) => {
            c.daemon.threads = value.parse().map_err(|_| bad("not a number"))?
        }
        ("submit_batch", TargetSpec::Embedded(c)) => {
            c.submit_batch = Some(value.parse().map_err(|_| bad("not a number"))?)
        }
        ("disk", TargetSpec::Embedded(c)) => {
            c.disk = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("disk", TargetSpec::Baseline { disk, .. }) => {
            *disk = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("cache", TargetSpec::Embedded(c)) => {
            c.cache = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("cache", TargetSpec::Baseline { cache, .. }) => {
            *cache = value
                .parse()
                .map_err(|e: storage::Error| bad(&e.to_string()))?
        }
        ("target", t) => *t = switch_target(t, value).map_err(|e| bad(&e))?,
        ("socket", t) => {
            // PATH or PATH@PID: compare devices side by side in one run.
            let (path, pid) = match value.rsplit_once('@') {
                Some((p, pid)) => (
                    p,
                    Some(pid.parse().map_err(|_| bad("expected PATH or PATH@PID"))?),
                ),
                None => (value, None),
            };
            *t = TargetSpec::Socket {
                path: path.into(),
                device_pid: pid,
                also: Vec::new(),
            };
        }
        (
            "engine" | "engine_threads" | "poll_us" | "coalesce_us" | "threads" | "submit_batch"
            | "disk" | "cache",
            _,
        ) => {
            return Err(bad(
                "this option applies to the embedded device or the baseline only",
            ))
        }
        _ => {
            for j in jobs.iter_mut() {
                apply_option(j, key, Some(value)).map_err(|e| bad(&e))?;
                j.finish();
            }
        }
    }
    Ok(())
}

/// `target=embedded|baseline`, keeping the disk and engine.
fn switch_target(t: &TargetSpec, to: &str) -> Result<TargetSpec, String> {
    let (disk, engine, cache, engine_threads) = match t {
        TargetSpec::Embedded(c) => (c.disk.clone(), c.engine, c.cache, c.engine_threads),
        TargetSpec::Baseline {
            disk,
            engine,
            cache,
            engine_threads,
        } => (disk.clone(), *engine, *cache, *engine_threads),
        TargetSpec::Socket { .. } => return Err("cannot switch away from --socket".into()),
    };
    match to {
        "embedded" => {
            let mut e = embedded_defaults();
            e.device = device::DeviceConfig {
                disk,
                engine,
                cache,
                engine_threads,
                ..e.device
            };
            Ok(TargetSpec::Embedded(Box::new(e)))
        }
        "baseline" => Ok(TargetSpec::Baseline {
            disk,
            engine,
            cache,
            engine_threads,
        }),
        _ => Err("expected embedded or baseline".into()),
    }
}

/// The embedded device vblk bench starts by default: a 1 GiB RAM disk on io_uring,
/// preallocated so that no measurement pays for first-touch page faults.
pub fn embedded_defaults() -> EmbeddedDevice {
    EmbeddedDevice {
        daemon: device::DaemonConfig {
            // Nothing to confine: the device runs in the benchmark's own process.
            sandbox: device::sandbox::SandboxConfig::none(),
            ..Default::default()
        },
        device: device::DeviceConfig {
            disk: DiskSpec::Mem(1 << 30),
            engine: EngineKind::IoUring,
            cache: CacheMode::Writeback,
            prealloc: true,
            ..Default::default()
        },
    }
}

/// A comparison: the variants each job runs under, side by side in one table.
#[derive(Clone, Debug, PartialEq)]
pub struct Compare {
    /// What the user wrote (the JSON report's `compare`).
    pub text: String,
    /// The variants, in order.
    pub variants: Vec<Variant>,
}

/// One column of a comparison: a label and the `key=value` settings it applies.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    /// The row's label in the table.
    pub label: String,
    /// Settings applied, in order, on top of the plan's.
    pub settings: Vec<(String, String)>,
}

impl Compare {
    /// Parse `--compare`: either `KEY=V1,V2,...` (one key, one variant per value) or
    /// `K1=A,K2=B;K1=C;...` (variants separated by `;`, each one or more `key=value`).
    pub fn parse(text: &str) -> Result<Compare, String> {
        let bad = |what: &str| format!("--compare {text}: {what}");
        let variants = if text.contains(';') {
            let mut variants = Vec::new();
            for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
                let mut settings = Vec::new();
                for kv in part.split(',') {
                    let (k, v) = kv.split_once('=').ok_or_else(|| {
                        bad(&format!("{kv:?} in variant {part:?} is not KEY=VALUE"))
                    })?;
                    settings.push((k.trim().to_string(), v.trim().to_string()));
                }
                variants.push(Variant {
                    label: part.to_string(),
                    settings,
                });
            }
            variants
        } else {
            let (k, vs) = text
                .split_once('=')
                .ok_or_else(|| bad("expected KEY=V1,V2,... or K1=A,K2=B;K1=C;..."))?;
            vs.split(',')
                .filter(|v| !v.is_empty())
                .map(|v| Variant {
                    label: format!("{k}={v}"),
                    settings: vec![(k.to_string(), v.to_string())],
                })
                .collect()
        };
        if variants.is_empty() {
            return Err(bad("no values"));
        }
        Ok(Compare {
            text: text.to_string(),
            variants,
        })
    }
}

/// Every I/O path the driver has, as the default comparison.
pub fn all_paths() -> Compare {
    let text = format!(
        "path={}",
        PathKind::ALL
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    Compare::parse(&text).expect("the paths parse")
}

/// CPUs for the job threads and the embedded device's workers, disjoint, when the machine
/// has enough: jobs from CPU 0 up, device workers from the last CPU down.
pub fn auto_pin(
    jobs: usize,
    device_threads: usize,
    cpus: usize,
) -> Option<(Vec<usize>, Vec<usize>)> {
    (jobs + device_threads <= cpus).then(|| {
        (
            (0..jobs).collect(),
            (0..device_threads).map(|t| cpus - 1 - t).collect(),
        )
    })
}

fn run_one(
    job: &JobSpec,
    target: &TargetSpec,
    run: &RunConfig,
    show: bool,
    label: &str,
) -> Result<JobReport, String> {
    let jobs = job.numjobs.max(1) as usize;
    let mut target = target.clone();
    let mut run = run.clone();
    if let (true, TargetSpec::Embedded(c)) = (run.pin, &mut target) {
        let threads = c.daemon.threads.clamp(1, jobs);
        let job_threads = match run.job_threads {
            0 => jobs,
            t => t.min(jobs),
        };
        if let Some((j, d)) = auto_pin(job_threads, threads, device::config::cpu_count()) {
            run.job_cpus = j;
            c.daemon.cpus = d;
        }
    }
    let (target, run) = (&target, &run);
    let t = Target::open(target, jobs as u16, job.rw.writes())?;
    let progress = Progress::default();
    let expected = job.runtime.map(|r| r + job.ramp_time);
    let started = Instant::now();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        if show {
            let progress = &progress;
            let done = &done;
            s.spawn(move || {
                let mut last = (0u64, 0u64, Instant::now());
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(250));
                    let (ios, bytes) = (
                        progress.ios.load(Ordering::Relaxed),
                        progress.bytes.load(Ordering::Relaxed),
                    );
                    let dt = last.2.elapsed().as_secs_f64().max(1e-3);
                    let el = started.elapsed();
                    let eta = expected.map_or("?".to_string(), |e| {
                        format!("{:.0}s", e.saturating_sub(el).as_secs_f64())
                    });
                    print!(
                        "\r[{label}] {:.1}s  IOPS={}  BW={:.1}MiB/s  ETA {eta}   ",
                        el.as_secs_f64(),
                        report::human((ios - last.0) as f64 / dt),
                        (bytes - last.1) as f64 / dt / (1 << 20) as f64
                    );
                    let _ = std::io::stdout().flush();
                    last = (ios, bytes, Instant::now());
                }
                print!("\r{:80}\r", "");
                let _ = std::io::stdout().flush();
            });
        }
        let r = run_job(job, &t, run, &progress);
        done.store(true, Ordering::Relaxed);
        r
    })
}

/// Several jobs' reports as one fio JSON document: every clone under `jobs`, vblk's
/// per-job aggregates under `vblk.jobs` (one job's report is returned as it is).
fn merge_fio_json(mut reports: Vec<serde_json::Value>) -> serde_json::Value {
    if reports.len() == 1 {
        return reports.remove(0);
    }
    let mut it = reports.into_iter();
    let Some(mut first) = it.next() else {
        return serde_json::Value::Null;
    };
    let mut vblk = vec![first["vblk"].take()];
    for mut r in it {
        if let (Some(all), Some(more)) = (first["jobs"].as_array_mut(), r["jobs"].as_array_mut()) {
            all.append(more);
        }
        vblk.push(r["vblk"].take());
    }
    first["vblk"] = serde_json::json!({ "jobs": vblk });
    first
}

/// The order in which a comparison runs its variants: `(repeat, variant)` pairs, the first
/// run of every variant, then the second of every variant in the reverse order, the third
/// in order again, and so on (at least one round). A steady drift of the machine then
/// favours no variant over two rounds: what the first variant of one round gains by
/// running first, it gives back by running last in the next, so it cancels out of the
/// paired ratios (`report::paired_ratio`).
fn run_order(variants: usize, repeat: u32) -> impl Iterator<Item = (u32, usize)> {
    (0..repeat.max(1)).flat_map(move |i| {
        (0..variants).map(move |v| (i, if i % 2 == 1 { variants - 1 - v } else { v }))
    })
}

/// Run the plan and return what to print.
pub fn execute(plan: &Plan) -> Result<String, String> {
    let show = plan.progress && std::io::stdout().is_terminal() && plan.format == Format::Normal;
    let mut out = String::new();
    let mut json_jobs = Vec::new();
    for job in &plan.jobs {
        match &plan.compare {
            None => {
                let r = run_one(job, &plan.target, &plan.run, show, &job.name)?;
                match plan.format {
                    Format::Normal => out.push_str(&report::text(&r)),
                    Format::Json => json_jobs.push(report::json_report(&r)),
                }
            }
            Some(compare) => {
                let mut variants = Vec::new();
                for variant in &compare.variants {
                    let mut jobs = vec![job.clone()];
                    let mut target = plan.target.clone();
                    let mut run = plan.run.clone();
                    for (key, v) in &variant.settings {
                        apply_variant(key, v, &mut jobs, &mut target, &mut run)?;
                    }
                    variants.push((variant.label.clone(), jobs.remove(0), target, run));
                }
                // Repeats go round the variants (1st run of each, then 2nd of each in the
                // reverse order, ...), so that a machine drifting over the minutes of a
                // comparison drifts for every variant alike rather than for the last ones.
                let mut rows: Vec<Row> = variants
                    .iter()
                    .map(|(label, ..)| Row {
                        label: label.clone(),
                        runs: Vec::new(),
                    })
                    .collect();
                for (i, v) in run_order(variants.len(), plan.repeat) {
                    let (label, job_v, target, run) = &variants[v];
                    let shown = format!("{} {label} #{}", job.name, i + 1);
                    rows[v]
                        .runs
                        .push(run_one(job_v, target, run, show, &shown)?);
                }
                match plan.format {
                    Format::Normal => {
                        let first = &rows[0].runs[0];
                        out.push_str(&format!(
                            "{}: rw={} bs={} iodepth={} numjobs={}, {} run(s) per variant\n  target: {}\n",
                            job.name,
                            job.rw.fio_name(),
                            job.bs,
                            job.iodepth,
                            job.numjobs,
                            plan.repeat.max(1),
                            first.target
                        ));
                        out.push_str(&report::compare_text(&rows));
                        out.push('\n');
                    }
                    Format::Json => json_jobs.push(serde_json::json!({
                        "job": job.name,
                        "compare": compare.text,
                        "variants": report::compare_json(&rows),
                    })),
                }
                if let Some(p) = &plan.plot {
                    let title = format!("{}: {}", job.name, compare.text);
                    let svg = report::compare_svg(&rows, &title);
                    let path = if plan.jobs.len() > 1 {
                        p.with_file_name(format!(
                            "{}-{}",
                            job.name.replace('/', "_"),
                            p.file_name().and_then(|f| f.to_str()).unwrap_or("plot.svg")
                        ))
                    } else {
                        p.clone()
                    };
                    std::fs::write(&path, svg).map_err(|e| format!("{}: {e}", path.display()))?;
                }
            }
        }
    }
    if plan.format == Format::Json {
        let v = if plan.compare.is_none() {
            merge_fio_json(json_jobs)
        } else {
            serde_json::Value::Array(json_jobs)
        };
        out = serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?;
        out.push('\n');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_repeats_take_turns() {
        let order: Vec<_> = run_order(3, 2).collect();
        assert_eq!(order, [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0)]);
        let three: Vec<_> = run_order(2, 3).collect();
        assert_eq!(three, [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]);
        let once: Vec<_> = run_order(2, 0).collect();
        assert_eq!(once, [(0, 0), (0, 1)]);
    }

    #[test]
    fn compare_parses_one_key_or_variants_with_several_settings() {
        let c = Compare::parse("path=bio,batch").unwrap();
        assert_eq!(c.variants.len(), 2);
        assert_eq!(c.variants[1].label, "path=batch");
        assert_eq!(c.variants[1].settings, [("path".into(), "batch".into())]);
        let c = Compare::parse("path=bio; path=request,elevator=deadline,queue_depth=2;").unwrap();
        assert_eq!(c.variants.len(), 2);
        assert_eq!(
            c.variants[1].label,
            "path=request,elevator=deadline,queue_depth=2"
        );
        assert_eq!(c.variants[1].settings.len(), 3);
        assert_eq!(
            c.variants[1].settings[2],
            ("queue_depth".into(), "2".into())
        );
        for bad in ["path", "path=", "path=bio;request", ";"] {
            assert!(Compare::parse(bad).is_err(), "{bad}");
        }
        // Every setting is applied, in order.
        let mut jobs = vec![default_job()];
        let mut target = TargetSpec::Embedded(Box::new(embedded_defaults()));
        let mut run = RunConfig::default();
        for (k, v) in &Compare::parse("path=request,elevator=bfq,queue_depth=2;")
            .unwrap()
            .variants[0]
            .settings
        {
            apply_variant(k, v, &mut jobs, &mut target, &mut run).unwrap();
        }
        assert_eq!(run.path, PathKind::Request);
        assert_eq!(run.request.queue_depth, 2);
        assert_eq!(run.request.elevator, driver::ElevatorKind::Bfq);
    }

    #[test]
    fn every_preset_job_file_parses() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/jobs");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "fio") {
                let text = std::fs::read_to_string(&p).unwrap();
                assert!(
                    text.starts_with("; Experiment:"),
                    "{}: names its experiment",
                    p.display()
                );
                let jobs = crate::job::parse_job_file(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(!jobs.is_empty(), "{}", p.display());
                n += 1;
            }
        }
        assert!(n >= 4, "{n} presets");
    }

    #[test]
    fn several_jobs_make_one_fio_document() {
        let a = serde_json::json!({"jobs": [{"jobname": "a"}], "vblk": {"job": "a"}});
        let b =
            serde_json::json!({"jobs": [{"jobname": "b"}, {"jobname": "b"}], "vblk": {"job": "b"}});
        let m = merge_fio_json(vec![a, b]);
        assert_eq!(m["jobs"].as_array().unwrap().len(), 3);
        assert_eq!(m["vblk"]["jobs"][1]["job"], "b");
    }

    #[test]
    fn default_job_is_4k_randread_qd32_time_based() {
        let j = default_job();
        assert_eq!(j.rw, crate::job::RwMode::RandRead);
        assert_eq!((j.bs, j.iodepth), (4096, 32));
        assert!(j.time_based);
        assert_eq!(j.runtime, Some(Duration::from_secs(2)));
        assert_eq!(j.ramp_time, Duration::from_millis(500));
    }

    #[test]
    fn variants_reach_the_target_the_run_or_the_jobs() {
        let mut jobs = vec![default_job()];
        let mut t = TargetSpec::Embedded(Box::new(embedded_defaults()));
        let mut r = RunConfig::default();
        assert_eq!(auto_pin(1, 1, 2), Some((vec![0], vec![1])));
        assert_eq!(auto_pin(2, 1, 2), None);
        apply_variant("path", "batch", &mut jobs, &mut t, &mut r).unwrap();
        assert_eq!(r.path, PathKind::Batch);
        apply_variant("poll-us", "7", &mut jobs, &mut t, &mut r).unwrap();
        apply_variant("coalesce-us", "20", &mut jobs, &mut t, &mut r).unwrap();
        assert!(
            matches!(&t, TargetSpec::Embedded(c) if c.daemon.poll_us == 7 && c.daemon.coalesce_us == 20)
        );
        apply_variant("iodepth", "8", &mut jobs, &mut t, &mut r).unwrap();
        assert_eq!(jobs[0].iodepth, 8);
        apply_variant("target", "baseline", &mut jobs, &mut t, &mut r).unwrap();
        assert!(matches!(t, TargetSpec::Baseline { .. }));
        apply_variant("socket", "/run/a.sock@42", &mut jobs, &mut t, &mut r).unwrap();
        assert!(
            matches!(&t, TargetSpec::Socket { path, device_pid: Some(42), also } if path.to_str() == Some("/run/a.sock") && also.is_empty())
        );
        assert!(apply_variant("socket", "/run/a.sock@x", &mut jobs, &mut t, &mut r).is_err());
        let mut t = TargetSpec::Baseline {
            disk: DiskSpec::Mem(1 << 20),
            engine: EngineKind::Sync,
            cache: CacheMode::Writeback,
            engine_threads: 16,
        };
        for engine in ["io_uring", "aio", "threads", "sync"] {
            apply_variant("engine", engine, &mut jobs, &mut t, &mut r).unwrap();
            assert!(
                matches!(&t, TargetSpec::Baseline { engine: e, .. } if e.to_string() == engine)
            );
        }
        apply_variant("engine-threads", "4", &mut jobs, &mut t, &mut r).unwrap();
        assert!(matches!(
            &t,
            TargetSpec::Baseline {
                engine_threads: 4,
                ..
            }
        ));
        let mut e = TargetSpec::Embedded(Box::new(embedded_defaults()));
        apply_variant("engine_threads", "32", &mut jobs, &mut e, &mut r).unwrap();
        assert!(matches!(&e, TargetSpec::Embedded(c) if c.engine_threads == 32));
        for key in ["poll_us", "coalesce_us"] {
            let e = apply_variant(key, "7", &mut jobs, &mut t, &mut r).unwrap_err();
            assert!(e.contains("embedded device"), "{e}");
        }
        assert!(apply_variant("path", "elevator", &mut jobs, &mut t, &mut r).is_err());
    }
}
