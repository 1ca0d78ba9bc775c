//! Latency statistics and CPU accounting.
//!
//! [`Latency`] keeps a log-linear histogram for percentiles plus exact count, min, max, mean and
//! standard deviation; it merges across threads and prints as fio's `clat_ns` object.
//! [`Cpu`] reads CPU time and context switches of the calling thread (`getrusage`) or of any
//! thread or process (`/proc`).

use std::fs;
use std::io;
use std::time::Duration;

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

/// Values below this are counted exactly, one bucket each; above, each power of two is cut
/// into `LINEAR / 2` buckets, so a bucket is at most 1/1024 of its values wide (HDR's "three
/// significant digits", with the same buckets).
const LINEAR: u64 = 2048;
const HALF_BITS: u32 = 10;

/// The bucket of `v` (values above [`MAX_NS`] in [`MAX_NS`]'s).
fn bucket(v: u64) -> usize {
    let v = v.min(MAX_NS);
    if v < LINEAR {
        v as usize
    } else {
        // v has e + 1 significant bits, e >= 11: keep the top 11 (1024..=2047) and count
        // the power of two above them.
        let shift = 63 - v.leading_zeros() - HALF_BITS;
        ((shift as usize) << HALF_BITS) + (v >> shift) as usize
    }
}

/// The smallest and the largest value counted in bucket `i`.
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < LINEAR {
        (i, i)
    } else {
        let shift = (i >> HALF_BITS) - 1;
        let low = (i - (shift << HALF_BITS)) << shift;
        (low, low + (1 << shift) - 1)
    }
}

/// Buckets: every value up to [`MAX_NS`] has one.
const BUCKETS: usize = (((MAX_NS.ilog2() - HALF_BITS) as usize) << HALF_BITS) + LINEAR as usize;

/// Latency statistics in nanoseconds over a log-linear histogram (0 ns .. 1 hour, buckets
/// at most 0.1 % wide, so a percentile is within 0.1 % of the true sample).
///
/// Count, min, max, mean and the sample standard deviation (n - 1, as fio) are exact or
/// nearly so, kept beside the histogram: the sum of the samples, and the sums of their
/// distances from the first sample and of those distances' squares (the shifted-data
/// variance: no cancellation from a large mean, only from a first sample far from it; a
/// first I/O of 1 s before samples 100 ns apart would put 1 % on the spread). Recording one sample costs
/// a few dozen instructions, none of them a division: a benchmark records three per I/O
/// (submission, completion and total latency), at millions of I/Os per second.
#[derive(Clone, Debug)]
pub struct Latency {
    counts: Vec<u64>,
    count: u64,
    min: u64,
    max: u64,
    sum: u128,
    /// The first sample: the origin of the shifted sums.
    origin: u64,
    /// Sum of (sample - origin).
    shifted: i128,
    /// Sum of (sample - origin)^2.
    shifted_sq: f64,
}

impl Default for Latency {
    fn default() -> Latency {
        Latency::new()
    }
}

impl Latency {
    /// An empty set.
    pub fn new() -> Latency {
        Latency {
            // Zeroed memory from the allocator: usually fresh pages, which cost no writes
            // until used.
            counts: vec![0; BUCKETS],
            count: 0,
            min: u64::MAX,
            max: 0,
            sum: 0,
            origin: 0,
            shifted: 0,
            shifted_sq: 0.0,
        }
    }

    /// Record one latency.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        if self.count == 0 {
            self.origin = ns;
        }
        if let Some(c) = self.counts.get_mut(bucket(ns)) {
            *c += 1;
        }
        self.count += 1;
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        self.sum += u128::from(ns);
        // Exact while samples are within 2^63 ns (292 years) of the first.
        let d = (ns as i64).wrapping_sub(self.origin as i64);
        self.shifted += i128::from(d);
        self.shifted_sq += (d as f64) * (d as f64);
    }

    /// Add `other`'s samples to these.
    pub fn merge(&mut self, other: &Latency) {
        if other.count == 0 {
            return;
        }
        if self.count == 0 {
            self.origin = other.origin;
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        // other's distances are from its own origin: move them to ours.
        // sum (d + k)^2 = sum d^2 + 2 k sum d + n k^2, with k = other.origin - self.origin.
        let k = i128::from(other.origin) - i128::from(self.origin);
        let n = other.count as f64;
        let kf = k as f64;
        self.shifted_sq += other.shifted_sq + 2.0 * kf * other.shifted as f64 + n * kf * kf;
        self.shifted += other.shifted + k * i128::from(other.count);
        self.sum += other.sum;
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
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// Sample standard deviation (divided by n - 1, as fio), 0 for fewer than two samples.
    pub fn stddev(&self) -> f64 {
        if self.count < 2 {
            0.0
        } else {
            let n = self.count as f64;
            let s = self.shifted as f64;
            ((self.shifted_sq - s * s / n) / (n - 1.0)).max(0.0).sqrt()
        }
    }

    /// The value that `p`% of samples are at or below (`p` in 0..=100), within the histogram's
    /// precision and clamped to [min, max]; 0 if none.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let q = (p / 100.0).clamp(0.0, 1.0);
        // The sample of rank ceil(q n) (at least the first), as HDR's value_at_quantile:
        // the top of its bucket, or the bottom for the 0th percentile.
        let rank = ((q * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (low, high) = bucket_range(i);
                let v = if q == 0.0 { low } else { high };
                return v.clamp(self.min(), self.max());
            }
        }
        self.max()
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

    /// The part `part / whole` of this (a thread's CPU time shared out among the clones it
    /// ran, by the I/Os each completed).
    pub fn share(&self, part: u64, whole: u64) -> Cpu {
        let f = |x: u64| (u128::from(x) * u128::from(part) / u128::from(whole.max(1))) as u64;
        Cpu {
            user: Duration::from_nanos(f(self.user.as_nanos() as u64)),
            system: Duration::from_nanos(f(self.system.as_nanos() as u64)),
            ctx_voluntary: f(self.ctx_voluntary),
            ctx_involuntary: f(self.ctx_involuntary),
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
