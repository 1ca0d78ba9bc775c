//! Latency statistics and CPU accounting.
//!
//! [`Latency`] keeps an HDR histogram for percentiles plus exact count, min, max, mean and
//! standard deviation; it merges across threads and prints as fio's `clat_ns` object.
//! [`Cpu`] reads CPU time and context switches of the calling thread (`getrusage`) or of any
//! thread or process (`/proc`).

use std::fs;
use std::io;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// fio's default percentile list (`percentile_list`).
pub const PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

/// Highest latency the histogram resolves: one hour in nanoseconds. Larger values are counted
/// as one hour in percentiles (min, max and mean stay exact).
const MAX_NS: u64 = 3_600 * 1_000_000_000;

/// Latency statistics in nanoseconds over an HDR histogram (1 ns .. 1 hour, 3 significant
/// digits, so a percentile is within 0.1% of the true sample).
///
/// Count, min, max, mean and the sample standard deviation (n - 1, as fio) are exact, kept
/// beside the histogram (Welford's running mean and squared deviations, merged with Chan's
/// formula).
#[derive(Clone, Debug)]
pub struct Latency {
    hist: Histogram<u64>,
    count: u64,
    min: u64,
    max: u64,
    mean: f64,
    /// Sum of squared deviations from the mean.
    m2: f64,
}

impl Default for Latency {
    fn default() -> Latency {
        Latency::new()
    }
}

impl Latency {
    /// An empty set.
    pub fn new() -> Latency {
        let hist = Histogram::new_with_bounds(1, MAX_NS, 3)
            .expect("constant histogram bounds 1..1h, 3 digits are valid");
        Latency {
            hist,
            count: 0,
            min: u64::MAX,
            max: 0,
            mean: 0.0,
            m2: 0.0,
        }
    }

    /// Record one latency.
    pub fn record(&mut self, ns: u64) {
        self.hist.saturating_record(ns);
        self.count += 1;
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        let x = ns as f64;
        let delta = x - self.mean;
        self.mean += delta / self.count as f64;
        self.m2 += delta * (x - self.mean);
    }

    /// Add `other`'s samples to these.
    pub fn merge(&mut self, other: &Latency) {
        if other.count == 0 {
            return;
        }
        if self.hist.add(&other.hist).is_err() {
            // Both histograms have the same bounds, so this does not happen; stay exact anyway.
            for v in other.hist.iter_recorded() {
                self.hist
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
        let (na, nb) = (self.count as f64, other.count as f64);
        let n = na + nb;
        let delta = other.mean - self.mean;
        self.mean += delta * nb / n;
        self.m2 += other.m2 + delta * delta * na * nb / n;
        self.count += other.count;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Smallest sample, 0 if none.
    pub fn min(&self) -> u64 {
        if self.count == 0 {
            0
        } else {
            self.min
        }
    }

    /// Largest sample, 0 if none.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Mean, 0 if none.
    pub fn mean(&self) -> f64 {
        self.mean
    }

    /// Sample standard deviation (divided by n - 1, as fio), 0 for fewer than two samples.
    pub fn stddev(&self) -> f64 {
        if self.count < 2 {
            0.0
        } else {
            (self.m2 / (self.count - 1) as f64).max(0.0).sqrt()
        }
    }

    /// The value that `p`% of samples are at or below (`p` in 0..=100), within the histogram's
    /// precision and clamped to [min, max]; 0 if none.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let q = (p / 100.0).clamp(0.0, 1.0);
        self.hist.value_at_quantile(q).clamp(self.min(), self.max())
    }

    /// fio's `clat_ns` object: `min`, `max`, `mean`, `stddev`, `N` and, when there are samples,
    /// `percentile` keyed like `"99.990000"` over [`PERCENTILES`].
    pub fn to_fio_json(&self) -> Value {
        let mut obj = json!({
            "min": self.min(),
            "max": self.max(),
            "mean": self.mean(),
            "stddev": self.stddev(),
            "N": self.count(),
        });
        if self.count > 0 {
            let percentiles: Map<String, Value> = PERCENTILES
                .iter()
                .map(|&p| (format!("{p:.6}"), Value::from(self.percentile(p))))
                .collect();
            obj["percentile"] = Value::Object(percentiles);
        }
        obj
    }
}

/// CPU time and context switches of one thread or process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Cpu {
    /// Time in user mode.
    pub user: Duration,
    /// Time in the kernel.
    pub system: Duration,
    /// Voluntary context switches (blocking).
    pub ctx_voluntary: u64,
    /// Involuntary context switches (preemption).
    pub ctx_involuntary: u64,
}

impl Cpu {
    /// The calling thread, from `getrusage(RUSAGE_THREAD)` (microsecond resolution).
    pub fn this_thread() -> Cpu {
        // SAFETY: rusage is plain old data; all-zero bytes are a valid value.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a valid, writable rusage for the duration of the call.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
        if rc != 0 {
            // Only EFAULT/EINVAL are documented, neither possible here.
            return Cpu::default();
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        Cpu {
            user: tv(ru.ru_utime),
            system: tv(ru.ru_stime),
            ctx_voluntary: ru.ru_nvcsw.max(0) as u64,
            ctx_involuntary: ru.ru_nivcsw.max(0) as u64,
        }
    }

    /// Thread `tid` of process `pid`, from `/proc/PID/task/TID/stat` (clock-tick resolution,
    /// usually 10 ms) and `/proc/PID/task/TID/status`.
    pub fn thread(pid: i32, tid: i32) -> io::Result<Cpu> {
        let dir = format!("/proc/{pid}/task/{tid}");
        let (user, system) = read_stat_times(&format!("{dir}/stat"))?;
        let (ctx_voluntary, ctx_involuntary) = read_status_switches(&format!("{dir}/status"))?;
        Ok(Cpu {
            user,
            system,
            ctx_voluntary,
            ctx_involuntary,
        })
    }

    /// Process `pid`: CPU time from `/proc/PID/stat` (all threads, including exited ones);
    /// context switches summed over the live threads' `/proc/PID/task/*/status`
    /// (`/proc/PID/status` counts only the main thread's).
    pub fn process(pid: i32) -> io::Result<Cpu> {
        let (user, system) = read_stat_times(&format!("/proc/{pid}/stat"))?;
        let mut cpu = Cpu {
            user,
            system,
            ..Cpu::default()
        };
        for_each_task(pid, |tid| {
            let (v, i) = read_status_switches(&format!("/proc/{pid}/task/{tid}/status"))?;
            cpu.ctx_voluntary += v;
            cpu.ctx_involuntary += i;
            Ok(())
        })?;
        Ok(cpu)
    }

    /// Sum over the threads of `pid` whose name (`comm`, at most 15 bytes) starts with
    /// `prefix`; zero if none does. Threads that exit while being read are skipped.
    pub fn threads_named(pid: i32, prefix: &str) -> io::Result<Cpu> {
        let mut sum = Cpu::default();
        for_each_task(pid, |tid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))?;
            if comm.trim_end_matches('\n').starts_with(prefix) {
                sum = sum.add(&Cpu::thread(pid, tid)?);
            }
            Ok(())
        })?;
        Ok(sum)
    }

    /// `self - earlier`, each field saturating at zero.
    pub fn since(&self, earlier: &Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
            ctx_voluntary: self.ctx_voluntary.saturating_sub(earlier.ctx_voluntary),
            ctx_involuntary: self.ctx_involuntary.saturating_sub(earlier.ctx_involuntary),
        }
    }

    /// `self + other`, field by field.
    pub fn add(&self, other: &Cpu) -> Cpu {
        Cpu {
            user: self.user.saturating_add(other.user),
            system: self.system.saturating_add(other.system),
            ctx_voluntary: self.ctx_voluntary.saturating_add(other.ctx_voluntary),
            ctx_involuntary: self.ctx_involuntary.saturating_add(other.ctx_involuntary),
        }
    }

    /// User plus system time.
    pub fn total(&self) -> Duration {
        self.user.saturating_add(self.system)
    }
}

fn invalid(path: &str, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{path}: {what} not found or not a number"),
    )
}

/// `utime` and `stime` (fields 14 and 15) of a `/proc/.../stat` file.
fn read_stat_times(path: &str) -> io::Result<(Duration, Duration)> {
    let text = fs::read_to_string(path)?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses; the
    // fields after the last ')' start at field 3 (state).
    let rest = text
        .rfind(')')
        .map(|i| &text[i + 1..])
        .ok_or_else(|| invalid(path, "')' after the command name"))?;
    let mut fields = rest.split_ascii_whitespace().skip(14 - 3);
    let mut ticks = |name: &str| {
        fields
            .next()
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(|| invalid(path, name))
    };
    let utime = ticks("utime")?;
    let stime = ticks("stime")?;
    let hz = clock_ticks_per_second();
    Ok((ticks_to_duration(utime, hz), ticks_to_duration(stime, hz)))
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

fn ticks_to_duration(ticks: u64, hz: u64) -> Duration {
    let nanos = u128::from(ticks) * 1_000_000_000 / u128::from(hz);
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches` of a `/proc/.../status` file.
fn read_status_switches(path: &str) -> io::Result<(u64, u64)> {
    let text = fs::read_to_string(path)?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| invalid(path, name))
    };
    Ok((
        field("voluntary_ctxt_switches")?,
        field("nonvoluntary_ctxt_switches")?,
    ))
}

/// Call `f` with every thread id of `pid`; a thread that exits meanwhile (`NotFound` from `f`)
/// is skipped.
fn for_each_task(pid: i32, mut f: impl FnMut(i32) -> io::Result<()>) -> io::Result<()> {
    for entry in fs::read_dir(format!("/proc/{pid}/task"))? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        match f(tid) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            // A thread that exits between open and read can also yield ESRCH.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
            other => other?,
        }
    }
    Ok(())
}

/// CPU of a set of threads, per thread, at one moment. Differences are taken thread by
/// thread, so threads that start or end between two samples (a previous device's workers
/// winding down) do not distort the figure.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ThreadSample(Vec<(i32, Cpu)>);

impl ThreadSample {
    /// The threads of `pid` whose name starts with one of `prefixes`.
    pub fn take(pid: i32, prefixes: &[&str]) -> io::Result<ThreadSample> {
        let mut v = Vec::new();
        for_each_task(pid, |tid| {
            let Ok(comm) = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")) else {
                return Ok(()); // the thread ended meanwhile
            };
            let comm = comm.trim_end_matches('\n');
            if prefixes.iter().any(|p| comm.starts_with(p)) {
                if let Ok(c) = Cpu::thread(pid, tid) {
                    v.push((tid, c));
                }
            }
            Ok(())
        })?;
        Ok(ThreadSample(v))
    }

    /// A whole process as one entry (its figures include threads that have ended).
    pub fn process(pid: i32) -> io::Result<ThreadSample> {
        Ok(ThreadSample(vec![(pid, Cpu::process(pid)?)]))
    }

    /// CPU used since `earlier` by the threads in this sample (a thread new since then
    /// counts from zero).
    pub fn since(&self, earlier: &ThreadSample) -> Cpu {
        self.0.iter().fold(Cpu::default(), |acc, (tid, now)| {
            let before = earlier
                .0
                .iter()
                .find(|(t, _)| t == tid)
                .map(|(_, c)| *c)
                .unwrap_or_default();
            acc.add(&now.since(&before))
        })
    }

    /// Threads in the sample.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no thread matched.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests;
