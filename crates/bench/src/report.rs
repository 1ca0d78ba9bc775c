//! Reports: fio-like text, JSON with fio's field names (so fio's JSON tooling reads it),
//! plus vblk's own fields (`vblk`: target, path, CPU and IOPS per CPU-second of both sides).

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use crate::run::{CloneResult, DirResult, JobReport};
use crate::stats::{Cpu, Latency, PERCENTILES};

/// 1234567 → "1235k", like fio's IOPS figures.
pub fn human(n: f64) -> String {
    if n >= 10e6 {
        format!("{:.1}M", n / 1e6)
    } else if n >= 10e3 {
        format!("{:.0}k", n / 1e3)
    } else if n >= 1e3 {
        format!("{:.2}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

fn mib(bytes_per_sec: f64) -> String {
    format!("{:.1}MiB/s", bytes_per_sec / (1 << 20) as f64)
}

/// An amount of bytes as fio's summary prints it: three significant figures in the
/// largest binary unit that leaves at least one (7.81MiB, 8.00KiB, 512B, 1.50GiB).
fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    let digits = if u == 0 || v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$}{}", UNITS[u])
}

/// A measured span in milliseconds, with a fraction below ten.
fn msec_text(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.2}msec")
    } else {
        format!("{}msec", d.as_millis())
    }
}

fn pct(cpu: Duration, runtime: Duration) -> f64 {
    if runtime.is_zero() {
        0.0
    } else {
        100.0 * cpu.as_secs_f64() / runtime.as_secs_f64()
    }
}

/// The unit fio would print latencies in, chosen from the mean.
fn lat_unit(l: &Latency) -> (&'static str, f64) {
    let m = l.mean();
    if m >= 10_000_000.0 {
        ("msec", 1e6)
    } else if m >= 10_000.0 {
        ("usec", 1e3)
    } else {
        ("nsec", 1.0)
    }
}

fn lat_line(out: &mut String, name: &str, l: &Latency) {
    if l.count() == 0 {
        return;
    }
    let (unit, div) = lat_unit(l);
    let _ = writeln!(
        out,
        "    {name} ({unit}): min={:.0}, max={:.0}, avg={:.2}, stdev={:.2}",
        l.min() as f64 / div,
        l.max() as f64 / div,
        l.mean() / div,
        l.stddev() / div
    );
}

fn dir_text(out: &mut String, label: &str, d: &DirResult, runtime: Duration) {
    if d.ios == 0 {
        return;
    }
    let secs = runtime.as_secs_f64().max(1e-9);
    let _ = writeln!(
        out,
        "  {label}: IOPS={}, BW={} ({}/{})",
        human(d.ios as f64 / secs),
        mib(d.bytes as f64 / secs),
        bytes_text(d.bytes),
        msec_text(runtime)
    );
    lat_line(out, "slat", &d.slat);
    lat_line(out, "clat", &d.clat);
    lat_line(out, " lat", &d.lat);
    let (unit, div) = lat_unit(&d.clat);
    let _ = writeln!(out, "    clat percentiles ({unit}):");
    for row in PERCENTILES.chunks(4) {
        let cells: Vec<String> = row
            .iter()
            .map(|&p| format!("{p:6.2}th=[{:>6.0}]", d.clat.percentile(p) as f64 / div))
            .collect();
        let _ = writeln!(out, "     | {}", cells.join(", "));
    }
}

/// fio-like text for one job.
pub fn text(r: &JobReport) -> String {
    let mut out = String::new();
    let t = r.total();
    let _ = writeln!(
        out,
        "{}: (jobs={}): rw={}, bs={}, iodepth={}, path={}",
        r.spec.name,
        r.clones.len(),
        r.spec.rw.fio_name(),
        block_sizes(&r.spec),
        r.spec.iodepth,
        r.path
    );
    let _ = writeln!(out, "  target: {}", r.target);
    dir_text(&mut out, "read", &t.read, t.runtime);
    dir_text(&mut out, "write", &t.write, t.runtime);
    let drv = r.driver_cpu();
    let _ = writeln!(
        out,
        "  driver cpu : usr={:.2}%, sys={:.2}%, ctx={}, IOPS per CPU-second={}",
        pct(drv.user, t.runtime),
        pct(drv.system, t.runtime),
        drv.ctx_voluntary + drv.ctx_involuntary,
        human(r.driver_iops_per_cpu_sec())
    );
    match (r.device_cpu, r.device_iops_per_cpu_sec()) {
        (Some(c), Some(ipc)) => {
            let _ = writeln!(
                out,
                "  device cpu : usr={:.2}%, sys={:.2}%, ctx={}, IOPS per CPU-second={}",
                pct(c.user, t.runtime),
                pct(c.system, t.runtime),
                c.ctx_voluntary + c.ctx_involuntary,
                human(ipc)
            );
        }
        _ => {
            let _ = writeln!(
                out,
                "  device cpu : not measured (give --device-pid for an external device)"
            );
        }
    }
    if r.spec.verify.is_some() {
        let _ = writeln!(
            out,
            "  verify     : crc32c, {} sectors checked, no mismatch",
            t.verified
        );
    }
    for n in &r.notes {
        let _ = writeln!(out, "  note: {n}");
    }
    out
}

fn block_sizes(spec: &crate::job::JobSpec) -> String {
    if spec.bssplit.is_empty() {
        spec.bs.to_string()
    } else {
        spec.bssplit
            .iter()
            .map(|(b, p)| format!("{b}/{p}"))
            .collect::<Vec<_>>()
            .join(":")
    }
}

fn dir_json(d: &DirResult, runtime: Duration) -> Value {
    let secs = runtime.as_secs_f64();
    let bw_bytes = if secs > 0.0 {
        d.bytes as f64 / secs
    } else {
        0.0
    };
    let iops = if secs > 0.0 { d.ios as f64 / secs } else { 0.0 };
    json!({
        "io_bytes": d.bytes,
        "io_kbytes": d.bytes / 1024,
        "bw_bytes": bw_bytes as u64,
        "bw": (bw_bytes / 1024.0) as u64,
        "iops": iops,
        "runtime": runtime.as_millis() as u64,
        "total_ios": d.ios,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": d.slat.to_fio_json(),
        "clat_ns": d.clat.to_fio_json(),
        "lat_ns": d.lat.to_fio_json(),
    })
}

fn cpu_json(c: &Cpu, ios: u64, runtime: Duration) -> Value {
    let total = c.total().as_secs_f64();
    json!({
        "usr_cpu": pct(c.user, runtime),
        "sys_cpu": pct(c.system, runtime),
        "usr_sec": c.user.as_secs_f64(),
        "sys_sec": c.system.as_secs_f64(),
        "ctx": c.ctx_voluntary + c.ctx_involuntary,
        "ctx_voluntary": c.ctx_voluntary,
        "iops_per_cpu_sec": if total > 0.0 { ios as f64 / total } else { 0.0 },
    })
}

/// One clone as a fio "jobs" entry.
fn clone_json(r: &JobReport, c: &CloneResult, name: &str) -> Value {
    let ios = c.read.ios + c.write.ios;
    json!({
        "jobname": name,
        "groupid": 0,
        "error": 0,
        "elapsed": c.runtime.as_secs(),
        "job options": {
            "rw": r.spec.rw.fio_name(),
            "bs": block_sizes(&r.spec),
            "iodepth": r.spec.iodepth.to_string(),
            "numjobs": r.spec.numjobs.to_string(),
        },
        "read": dir_json(&c.read, c.runtime),
        "write": dir_json(&c.write, c.runtime),
        "trim": dir_json(&DirResult::new(), c.runtime),
        "usr_cpu": pct(c.cpu.user, c.runtime),
        "sys_cpu": pct(c.cpu.system, c.runtime),
        "ctx": c.cpu.ctx_voluntary + c.cpu.ctx_involuntary,
        "majf": 0,
        "minf": 0,
        "vblk": {
            "clone": c.index,
            "driver": cpu_json(&c.cpu, ios, c.runtime),
            "verified_sectors": c.verified,
        }
    })
}

/// The whole job as JSON: one fio "jobs" entry per clone, the aggregate under "vblk".
pub fn json_report(r: &JobReport) -> Value {
    let t = r.total();
    let ios = t.read.ios + t.write.ios;
    let jobs: Vec<Value> = r
        .clones
        .iter()
        .map(|c| clone_json(r, c, &r.spec.name))
        .collect();
    json!({
        "fio version": concat!("vblk-", env!("CARGO_PKG_VERSION")),
        "timestamp": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        "jobs": jobs,
        "vblk": {
            "job": r.spec.name,
            "target": r.target,
            "path": r.path,
            "aggregate": clone_json(r, &t, &r.spec.name),
            "iops": t.iops(),
            "bw_bytes": t.bw(),
            "driver": cpu_json(&r.driver_cpu(), ios, t.runtime),
            "device": r.device_cpu.map(|c| cpu_json(&c, ios, t.runtime)),
            "notes": r.notes,
        }
    })
}

/// Mean and sample standard deviation.
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (m, 0.0);
    }
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, v.sqrt())
}

/// One row of a comparison: a variant and its repeated runs.
pub struct Row {
    /// e.g. "path=batch".
    pub label: String,
    /// One report per repeat.
    pub runs: Vec<JobReport>,
}

impl Row {
    fn series(&self, f: impl Fn(&JobReport) -> f64) -> (f64, f64) {
        mean_sd(&self.runs.iter().map(f).collect::<Vec<_>>())
    }

    /// IOPS mean and standard deviation.
    pub fn iops(&self) -> (f64, f64) {
        self.series(|r| r.total().iops())
    }
}

/// Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom; beyond, the
/// normal distribution's 1.96.
const T95: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

/// A variant's IOPS against the first variant's, round by round: with `--repeat` the
/// variants take turns, so round i of both saw the machine (its disk above all, which
/// drifts by ±10 % over minutes on a shared VM) in about the same state, and their ratio
/// cancels the drift that a ratio of the two means keeps. Returns the geometric mean of
/// the rounds' ratios and its 95 % interval (Student's t on the log ratios), or None with
/// fewer than two rounds (or a round with no I/O).
pub fn paired_ratio(runs: &[f64], base: &[f64]) -> Option<(f64, f64, f64)> {
    let logs: Vec<f64> = runs
        .iter()
        .zip(base)
        .map(|(&a, &b)| (a > 0.0 && b > 0.0).then(|| (a / b).ln()))
        .collect::<Option<_>>()?;
    let n = logs.len();
    if n < 2 {
        return None;
    }
    let mean = logs.iter().sum::<f64>() / n as f64;
    let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = T95.get(n - 2).copied().unwrap_or(1.96);
    let half = t * var.sqrt() / (n as f64).sqrt();
    Some((mean.exp(), (mean - half).exp(), (mean + half).exp()))
}

/// A bound of a ratio's interval, to two decimals, or to two significant digits below
/// 0.01: a lower bound, always positive, never reads 0.00 (two noisy rounds of 300 ms
/// gave 1.11 (0.0047-383)).
fn interval_bound(x: f64) -> String {
    if x >= 0.01 || x <= 0.0 || !x.is_finite() {
        return format!("{x:.2}");
    }
    let digits = ((-x.log10()).ceil() as usize + 1).min(12);
    format!("{x:.digits$}")
}

/// Each run's IOPS, in the order the rounds ran.
fn run_iops(r: &Row) -> Vec<f64> {
    r.runs.iter().map(|j| j.total().iops()).collect()
}

/// The comparison table: mean ± stddev per variant, the ratio of its mean to the first's,
/// and, with repeats, the paired ratio ([`paired_ratio`]) with its 95 % interval.
pub fn compare_text(rows: &[Row]) -> String {
    let mut out = String::new();
    let base = rows.first().map(|r| r.iops().0).unwrap_or(0.0);
    let base_runs = rows.first().map(run_iops).unwrap_or_default();
    let paired = rows.len() > 1 && rows.iter().all(|r| r.runs.len() > 1);
    // With repeats, the paired ratio and its interval follow the ratio of the means.
    let paired_col = |cell: &str| {
        if paired {
            format!(" {cell:>18}")
        } else {
            String::new()
        }
    };
    let w = rows
        .iter()
        .map(|r| r.label.len())
        .max()
        .unwrap_or(0)
        .max(24);
    let _ = writeln!(
        out,
        "{:<w$} {:>20} {:>7}{} {:>12} {:>10} {:>10} {:>14} {:>14} {:>8}",
        "variant",
        "IOPS (mean ± sd)",
        "ratio",
        paired_col("paired (95 %)"),
        "MiB/s",
        "clat p50",
        "clat p99",
        "drv IOPS/CPU-s",
        "dev IOPS/CPU-s",
        "dev CPU"
    );
    for (i, r) in rows.iter().enumerate() {
        let (m, sd) = r.iops();
        let (bw, _) = r.series(|j| j.total().bw() / (1 << 20) as f64);
        let (p50, _) = r.series(|j| merged_clat(j).percentile(50.0) as f64 / 1e3);
        let (p99, _) = r.series(|j| merged_clat(j).percentile(99.0) as f64 / 1e3);
        let (drv, _) = r.series(|j| j.driver_iops_per_cpu_sec());
        let measured = r.runs.iter().all(|j| j.device_cpu.is_some());
        let dev = if measured {
            human(r.series(|j| j.device_iops_per_cpu_sec().unwrap_or(0.0)).0)
        } else {
            "-".into()
        };
        // The device's CPU time per second of the window, in % of one CPU: what an idle or
        // a paced device costs the host whatever its I/O rate.
        let dev_cpu = if measured {
            format!(
                "{:.1}%",
                100.0 * r.series(|j| j.device_cpu_share().unwrap_or(0.0)).0
            )
        } else {
            "-".into()
        };
        let ratio = if base > 0.0 { m / base } else { 0.0 };
        let pr = match paired_ratio(&run_iops(r), &base_runs) {
            Some((g, lo, hi)) if i > 0 => {
                format!("{g:.2} ({}-{})", interval_bound(lo), interval_bound(hi))
            }
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<w$} {:>20} {:>7.2}{} {:>12.1} {:>8.1}µs {:>8.1}µs {:>14} {:>14} {:>8}",
            r.label,
            spread(m, sd, r.runs.len()),
            ratio,
            paired_col(&pr),
            bw,
            p50,
            p99,
            human(drv),
            dev,
            dev_cpu
        );
    }
    out
}

/// A mean with its spread, or, from one run, the figure and "1 run": a single run has no
/// spread to show, and "± 0" would claim one.
fn spread(mean: f64, sd: f64, runs: usize) -> String {
    if runs > 1 {
        format!("{} ± {}", human(mean), human(sd))
    } else {
        format!("{} (1 run)", human(mean))
    }
}

fn merged_clat(j: &JobReport) -> Latency {
    let t = j.total();
    let mut l = t.read.clat.clone();
    l.merge(&t.write.clat);
    l
}

/// The comparison as JSON.
pub fn compare_json(rows: &[Row]) -> Value {
    let base = rows.first().map(|r| r.iops().0).unwrap_or(0.0);
    let base_runs = rows.first().map(run_iops).unwrap_or_default();
    Value::Array(
        rows.iter()
            .enumerate()
            .map(|(i, r)| {
                let (m, sd) = r.iops();
                json!({
                    "variant": r.label,
                    "iops_mean": m,
                    "iops_stddev": sd,
                    "ratio": if base > 0.0 { m / base } else { 0.0 },
                    // The first variant is the reference: no ratio to itself.
                    "paired_ratio": paired_ratio(&run_iops(r), &base_runs)
                        .filter(|_| i > 0)
                        .map(|(g, lo, hi)| json!({"ratio": g, "low": lo, "high": hi, "rounds": r.runs.len()})),
                    "device_cpu_share": r.runs.iter().all(|j| j.device_cpu.is_some())
                        .then(|| r.series(|j| j.device_cpu_share().unwrap_or(0.0)).0),
                    "runs": r.runs.iter().map(json_report).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// A bar chart of mean IOPS with ±1 sd error bars, as SVG.
pub fn compare_svg(rows: &[Row], title: &str) -> String {
    let w = 160 + 120 * rows.len().max(1);
    let h = 420;
    let top = 50.0;
    let bottom = 340.0;
    let max = rows
        .iter()
        .map(|r| {
            let (m, sd) = r.iops();
            m + sd
        })
        .fold(1.0, f64::max)
        * 1.1;
    let y = |v: f64| bottom - (bottom - top) * v / max;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"13\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n\
         <line x1=\"90\" y1=\"{bottom}\" x2=\"{}\" y2=\"{bottom}\" stroke=\"black\"/>\n\
         <line x1=\"90\" y1=\"{top}\" x2=\"90\" y2=\"{bottom}\" stroke=\"black\"/>\n",
        w / 2,
        xml(title),
        w - 30
    );
    for i in 0..=4 {
        let v = max * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"84\" y=\"{:.1}\" text-anchor=\"end\">{}</text><line x1=\"90\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            y(v) + 4.0,
            human(v),
            y(v),
            w - 30,
            y(v)
        );
    }
    let base = rows.first().map(|r| r.iops().0).unwrap_or(0.0);
    for (i, r) in rows.iter().enumerate() {
        let (m, sd) = r.iops();
        let x = 120.0 + 120.0 * i as f64;
        let _ = writeln!(
            s,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"70\" height=\"{:.1}\" fill=\"#4a7ab5\"/>\n\
             <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\" stroke-width=\"2\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
             <text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n\
             <text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">×{:.2}</text>",
            y(m),
            bottom - y(m),
            x + 35.0,
            y(m + sd),
            x + 35.0,
            y((m - sd).max(0.0)),
            x + 35.0,
            y(m + sd) - 6.0,
            human(m),
            x + 35.0,
            bottom + 20.0,
            xml(&r.label),
            x + 35.0,
            bottom + 38.0,
            if base > 0.0 { m / base } else { 0.0 }
        );
    }
    let _ = writeln!(s, "<text x=\"20\" y=\"{}\" transform=\"rotate(-90 20 {})\" text-anchor=\"middle\">IOPS (mean ± sd)</text>", (top + bottom) / 2.0, (top + bottom) / 2.0);
    s.push_str("</svg>\n");
    s
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The amount moved is rounded to three figures, not cut to whole MiB (2000 I/Os of
    /// 4 KiB showed as "7MiB", 8 KiB as "0MiB" in "0msec").
    #[test]
    fn the_amount_moved_and_its_span_keep_their_figures() {
        assert_eq!(bytes_text(2000 * 4096), "7.81MiB");
        assert_eq!(bytes_text(8192), "8.00KiB");
        assert_eq!(bytes_text(512), "512B");
        assert_eq!(bytes_text(150 << 20), "150MiB");
        assert_eq!(bytes_text(3 << 30), "3.00GiB");
        assert_eq!(msec_text(Duration::from_micros(400)), "0.40msec");
        assert_eq!(msec_text(Duration::from_millis(1998)), "1998msec");
    }

    #[test]
    fn an_interval_bound_below_a_hundredth_keeps_two_figures() {
        assert_eq!(interval_bound(0.0047), "0.0047");
        assert_eq!(interval_bound(0.00031), "0.00031");
        assert_eq!(interval_bound(0.01), "0.01");
        assert_eq!(interval_bound(383.391), "383.39");
        assert_eq!(interval_bound(0.0), "0.00");
    }

    #[test]
    fn paired_ratio_is_the_geometric_mean_of_the_rounds_ratios_with_its_interval() {
        // 1.1x in every round: no spread.
        let (g, lo, hi) = paired_ratio(&[110.0, 99.0, 121.0], &[100.0, 90.0, 110.0]).unwrap();
        assert!((g - 1.1).abs() < 1e-12 && (lo - 1.1).abs() < 1e-12 && (hi - 1.1).abs() < 1e-12);
        // 0.96x, 1.03x, 0.99x (computed by hand: t = 4.303 for 2 degrees of freedom).
        let (g, lo, hi) = paired_ratio(&[100.0, 80.0, 120.0], &[104.0, 78.0, 121.0]).unwrap();
        assert!((g - 0.99263).abs() < 1e-4, "{g}");
        assert!((lo - 0.91613).abs() < 1e-4, "{lo}");
        assert!((hi - 1.07551).abs() < 1e-4, "{hi}");
        // Ratios of 0.5 and 2: a geometric mean of 1, with an interval around it.
        let (g, lo, hi) = paired_ratio(&[50.0, 200.0], &[100.0, 100.0]).unwrap();
        assert!((g - 1.0).abs() < 1e-12 && lo < 0.5 && hi > 2.0);
        // The drift of the rounds cancels: each side spreads by a factor of four from round
        // to round, but the ratio is the same in every round, so its interval has no width.
        let (g, lo, hi) = paired_ratio(&[95.0, 190.0, 47.5], &[100.0, 200.0, 50.0]).unwrap();
        assert!((g - 0.95).abs() < 1e-12 && (hi - 0.95).abs() < 1e-9 && (lo - 0.95).abs() < 1e-9);
        // One round, or a round without I/O, has no interval.
        assert!(paired_ratio(&[1.0], &[2.0]).is_none());
        assert!(paired_ratio(&[1.0, 0.0], &[2.0, 2.0]).is_none());
    }
}
