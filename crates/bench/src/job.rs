//! fio job options and the subset of fio's ini job-file format that `vblk bench` reads.
//!
//! One function, [`apply_option`], knows every option; command-line flags and job files both go
//! through it, so the two can never disagree. Option names and value syntax are fio's (see fio's
//! HOWTO, "Job file parameters"); options that fio has but that would change the workload here in a
//! way `vblk bench` cannot reproduce are an error, harmless ones are recorded in
//! [`JobSpec::ignored`].

use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;

mod fio_options;
mod values;

use fio_options::{changes_workload, harmless, harmless_at, Other};
use values::{
    parse_bs, parse_count, parse_flag, parse_percent, parse_region_size, parse_rw, parse_verify,
};
pub use values::{parse_bssplit, parse_size, parse_time};

/// The I/O pattern of a job (fio's `rw=` / `readwrite=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RwMode {
    /// Sequential reads (`read`).
    Read,
    /// Sequential writes (`write`).
    Write,
    /// Random reads (`randread`).
    RandRead,
    /// Random writes (`randwrite`).
    RandWrite,
    /// Sequential mixed reads and writes (`rw` or `readwrite`).
    ReadWrite,
    /// Random mixed reads and writes (`randrw`).
    RandRw,
}

impl RwMode {
    /// Whether offsets are random.
    pub fn is_random(self) -> bool {
        matches!(self, RwMode::RandRead | RwMode::RandWrite | RwMode::RandRw)
    }

    /// Whether the job issues reads.
    pub fn reads(self) -> bool {
        matches!(
            self,
            RwMode::Read | RwMode::RandRead | RwMode::ReadWrite | RwMode::RandRw
        )
    }

    /// Whether the job issues writes.
    pub fn writes(self) -> bool {
        matches!(
            self,
            RwMode::Write | RwMode::RandWrite | RwMode::ReadWrite | RwMode::RandRw
        )
    }

    /// fio's canonical name (`rw` for both `rw` and `readwrite`).
    pub fn fio_name(self) -> &'static str {
        match self {
            RwMode::Read => "read",
            RwMode::Write => "write",
            RwMode::RandRead => "randread",
            RwMode::RandWrite => "randwrite",
            RwMode::ReadWrite => "rw",
            RwMode::RandRw => "randrw",
        }
    }
}

impl FromStr for RwMode {
    type Err = String;

    fn from_str(s: &str) -> Result<RwMode, String> {
        match s {
            "read" => Ok(RwMode::Read),
            "write" => Ok(RwMode::Write),
            "randread" => Ok(RwMode::RandRead),
            "randwrite" => Ok(RwMode::RandWrite),
            "rw" | "readwrite" => Ok(RwMode::ReadWrite),
            "randrw" => Ok(RwMode::RandRw),
            "trim" | "randtrim" | "trimwrite" | "randtrimwrite" => Err(format!(
                "rw mode '{s}' is not supported (vblk bench does not trim)"
            )),
            _ => Err(format!(
                "unknown rw mode '{s}' (expected read, write, randread, randwrite, rw, readwrite \
                 or randrw)"
            )),
        }
    }
}

/// Data verification (fio's `verify=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Verify {
    /// A CRC-32C per block (`crc32c`, `crc32c-intel`).
    Crc32c,
}

/// The region size of a job (fio's `size=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Size {
    /// A byte count (`size=4g`).
    Bytes(u64),
    /// A percentage of the device, 1..=100 (`size=50%`).
    Percent(u32),
}

/// One job as fio would see it after `[global]` and its own section are applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobSpec {
    /// Section name; `"job"` for the command-line job (`name=` overrides).
    pub name: String,
    /// `description=`, kept for reports.
    pub description: Option<String>,
    /// `rw=` / `readwrite=`; default [`RwMode::Read`].
    pub rw: RwMode,
    /// `bs=` / `blocksize=` in bytes; default 4096.
    pub bs: u64,
    /// `bssplit=`: (block size, percent) sorted by block size, percents summing to 100; empty
    /// means every I/O is `bs` bytes.
    pub bssplit: Vec<(u64, u32)>,
    /// `iodepth=`; default 1.
    pub iodepth: u32,
    /// `iodepth_batch_submit=` / `iodepth_batch=`; default 1 (0 means `iodepth` after
    /// [`JobSpec::finish`]).
    pub iodepth_batch_submit: u32,
    /// `iodepth_batch_complete=` / `iodepth_batch_complete_min=`; default 1.
    pub iodepth_batch_complete: u32,
    /// `numjobs=`; default 1.
    pub numjobs: u32,
    /// `rwmixread=` (or `100 - rwmixwrite=`); default 50.
    pub rwmixread: u32,
    /// `size=`: the region of each job; `None` is the whole device minus `offset`.
    pub size: Option<Size>,
    /// `offset=` in bytes; default 0.
    pub offset: u64,
    /// `runtime=` / `timeout=`; `None` (or 0) means no limit.
    pub runtime: Option<Duration>,
    /// `time_based`: keep going over the region until `runtime` ends.
    pub time_based: bool,
    /// `ramp_time=`: run this long before collecting statistics.
    pub ramp_time: Duration,
    /// `norandommap`: random offsets are drawn independently instead of covering every block
    /// once per pass.
    pub norandommap: bool,
    /// `verify=`.
    pub verify: Option<Verify>,
    /// `rate_iops=R[,W]`: most I/Os per second of each direction (reads, writes); 0 or
    /// absent: no limit.
    pub rate_iops: [u64; 2],
    /// `rate=R[,W]`: most bytes per second of each direction; 0 or absent: no limit.
    pub rate: [u64; 2],
    /// vblk extension `path=`: the driver's I/O path name (`bio`, `batch`, ...), validated by the
    /// runner.
    pub path: Option<String>,
    /// vblk extension `fua=1`: writes are Force Unit Access (complete only once durable;
    /// the driver adds a flush after each on a device with a volatile cache).
    pub fua: bool,
    /// `direct=` (or `buffered=`, its opposite), if the job says: `vblk bench` opens the
    /// embedded device's or the baseline's file with O_DIRECT for `direct=1` unless
    /// `--cache` says otherwise (the cache is the target's, shared by the jobs).
    pub direct: Option<bool>,
    /// What the program set up for this job that the job did not ask for, said in its
    /// report's notes.
    pub notes: Vec<String>,
    /// Names of fio options that were accepted and have no effect here, in first-seen order,
    /// without duplicates.
    pub ignored: Vec<String>,
}

impl Default for JobSpec {
    fn default() -> JobSpec {
        JobSpec {
            name: "job".to_string(),
            description: None,
            rw: RwMode::Read,
            bs: 4096,
            bssplit: Vec::new(),
            iodepth: 1,
            iodepth_batch_submit: 1,
            iodepth_batch_complete: 1,
            numjobs: 1,
            rwmixread: 50,
            size: None,
            offset: 0,
            runtime: None,
            time_based: false,
            ramp_time: Duration::ZERO,
            norandommap: false,
            verify: None,
            rate_iops: [0, 0],
            rate: [0, 0],
            path: None,
            fua: false,
            direct: None,
            notes: Vec::new(),
            ignored: Vec::new(),
        }
    }
}

impl JobSpec {
    /// fio's fix-ups once all options are in: `iodepth_batch_submit` of 0 or above `iodepth`
    /// becomes `iodepth`, `iodepth_batch_complete` above `iodepth` becomes `iodepth`.
    /// [`parse_job_file`] calls it for every job; callers building a job from flags call it after
    /// the last [`apply_option`].
    pub fn finish(&mut self) {
        if self.iodepth_batch_submit == 0 || self.iodepth_batch_submit > self.iodepth {
            self.iodepth_batch_submit = self.iodepth;
        }
        if self.iodepth_batch_complete > self.iodepth {
            self.iodepth_batch_complete = self.iodepth;
        }
    }

    /// The block sizes this job uses: the `bssplit` sizes, or `bs` alone.
    pub fn block_sizes(&self) -> impl Iterator<Item = u64> + '_ {
        let single = self.bssplit.is_empty().then_some(self.bs);
        self.bssplit.iter().map(|&(bs, _)| bs).chain(single)
    }

    fn ignore(&mut self, key: &str) {
        if !self.ignored.iter().any(|k| k == key) {
            self.ignored.push(key.to_string());
        }
    }
}

/// Apply one `key=value` (or bare `key`) option; the same function serves command-line flags and
/// job files.
///
/// Unknown-but-harmless fio options are pushed to [`JobSpec::ignored`] (deduplicated); options
/// that would change the workload's meaning (`rate`, `zonemode`, `thinktime`, ...) and names fio
/// does not know are an error.
pub fn apply_option(spec: &mut JobSpec, key: &str, value: Option<&str>) -> Result<(), String> {
    let key = key.trim();
    let value = value.map(str::trim);
    if let Some(v) = value {
        if v.contains("${") {
            return Err("environment variables (${VAR}) are not supported".to_string());
        }
    }
    let need = || value.ok_or_else(|| format!("option '{key}' needs a value"));
    match key {
        "name" => spec.name = need()?.to_string(),
        "description" => spec.description = Some(need()?.to_string()),
        "rw" | "readwrite" => spec.rw = parse_rw(need()?)?,
        "bs" | "blocksize" => spec.bs = parse_bs(need()?)?,
        "bssplit" => spec.bssplit = parse_bssplit(need()?)?,
        "iodepth" => spec.iodepth = parse_count(need()?, 1)?,
        "iodepth_batch" | "iodepth_batch_submit" => {
            spec.iodepth_batch_submit = parse_count(need()?, 0)?
        }
        "iodepth_batch_complete" | "iodepth_batch_complete_min" => {
            spec.iodepth_batch_complete = parse_count(need()?, 0)?
        }
        "numjobs" => {
            spec.numjobs = parse_count(need()?, 1)?;
            if spec.numjobs > 256 {
                return Err(format!(
                    "numjobs={}: at most 256 (each job clone has a queue of its own, and vhost-user numbers queues with 8 bits)",
                    spec.numjobs
                ));
            }
        }
        "rwmixread" => spec.rwmixread = parse_percent(need()?)?,
        "rwmixwrite" => spec.rwmixread = 100 - parse_percent(need()?)?,
        "size" => spec.size = Some(parse_region_size(need()?)?),
        "offset" => {
            let v = need()?;
            if v.ends_with('%') {
                return Err(format!("offset as a percentage ('{v}') is not supported"));
            }
            spec.offset = parse_size(v)?;
        }
        "runtime" | "timeout" => {
            let t = parse_time(need()?)?;
            spec.runtime = (!t.is_zero()).then_some(t);
        }
        "ramp_time" => spec.ramp_time = parse_time(need()?)?,
        "time_based" => spec.time_based = parse_flag(value)?,
        "norandommap" => spec.norandommap = parse_flag(value)?,
        "verify" => spec.verify = parse_verify(need()?)?,
        "rate_iops" => spec.rate_iops = parse_pair(need()?, |v| parse_count(v, 0).map(u64::from))?,
        "rate" => spec.rate = parse_pair(need()?, parse_size)?,
        // fio's default and only the linear process is implemented.
        "rate_process" if value.map(str::trim) == Some("linear") => spec.ignore(key),
        "path" => spec.path = Some(need()?.to_string()),
        "fua" => spec.fua = parse_flag(value)?,
        "direct" => spec.direct = Some(parse_flag(value)?),
        "buffered" => spec.direct = Some(!parse_flag(value)?),
        _ => {
            let other = if harmless(key) {
                Other::Ignore
            } else if let Some(other) = harmless_at(key, value) {
                other
            } else if changes_workload(key) {
                Other::Unsupported
            } else {
                return Err(format!("unknown option '{key}'"));
            };
            match other {
                Other::Ignore => spec.ignore(key),
                Other::Unsupported => {
                    return Err(format!(
                        "option '{key}' is not supported (it would change the workload)"
                    ))
                }
            }
        }
    }
    Ok(())
}

/// fio's `R[,W]` for per-direction values: `R` alone sets both; `,W` sets writes only.
fn parse_pair(v: &str, f: impl Fn(&str) -> Result<u64, String>) -> Result<[u64; 2], String> {
    match v.split_once(',') {
        None => {
            let x = f(v)?;
            Ok([x, x])
        }
        Some((r, w)) => {
            let one = |s: &str| if s.trim().is_empty() { Ok(0) } else { f(s) };
            Ok([one(r)?, one(w)?])
        }
    }
}

/// A job-file error, naming the 1-based line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("line {line}: {msg}")]
pub struct JobFileError {
    /// 1-based line number.
    pub line: usize,
    /// What was wrong, starting with the offending text.
    pub msg: String,
}

/// Cut a trailing `;` or `#` comment, as fio does, and surrounding blanks.
fn strip_comment(line: &str) -> &str {
    let end = line.find([';', '#']).unwrap_or(line.len());
    line[..end].trim()
}

/// Parse a fio job file: the common subset of fio's ini — `[global]` and named sections,
/// `key=value` and bare `key` lines, `;` and `#` comments (whole-line or trailing), blank lines.
/// `${VAR}` expansion and `include` are not supported (an error).
///
/// Returns the jobs in file order, each with the `[global]` options that came before its section
/// applied (a later `[global]` affects only later jobs) and [`JobSpec::finish`] done. Errors name
/// the 1-based line: `line 7: bs=12x: bad size '12x': ...`.
pub fn parse_job_file(text: &str) -> Result<Vec<JobSpec>, JobFileError> {
    let mut global = JobSpec::default();
    let mut jobs: Vec<JobSpec> = Vec::new();
    // The job whose section we are in; `None` before any section and inside [global].
    let mut current: Option<JobSpec> = None;
    let mut in_global = false;
    let mut lines = 0;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        lines = line_no;
        let err = |msg: String| JobFileError { line: line_no, msg };
        let line = strip_comment(raw);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest
                .strip_suffix(']')
                .map(str::trim)
                .filter(|n| !n.is_empty() && !n.contains(['[', ']']))
                .ok_or_else(|| {
                    err(format!(
                        "malformed section header '{line}' (expected [name])"
                    ))
                })?;
            jobs.extend(current.take());
            in_global = name == "global";
            if !in_global {
                let mut job = global.clone();
                job.name = name.to_string();
                current = Some(job);
            }
            continue;
        }
        let (key, value) = match line.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (line, None),
        };
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(err(format!(
                "malformed line '{line}' (expected key=value, a bare key or [section])"
            )));
        }
        let spec = match (&mut current, in_global) {
            (Some(job), _) => job,
            (None, true) => &mut global,
            (None, false) => {
                return Err(err(format!(
                    "'{line}' is outside any section (start with [global] or [jobname])"
                )))
            }
        };
        apply_option(spec, key, value).map_err(|e| err(format!("{line}: {e}")))?;
    }
    jobs.extend(current);
    if jobs.is_empty() {
        return Err(JobFileError {
            line: lines.max(1),
            msg: "no job sections (expected at least one [jobname])".to_string(),
        });
    }
    for job in &mut jobs {
        job.finish();
    }
    Ok(jobs)
}

#[cfg(test)]
mod tests;
