//! QoS limits with QEMU's names, semantics and checks (`ThrottleLimits` in QEMU's
//! qapi/block-core.json, `throttle_is_valid` in util/throttle.c), so that a libvirt user
//! reads them as they know them: `iops-total`, `iops-read`, `iops-write`, `bps-total`,
//! `bps-read`, `bps-write`, each with `-max` (the burst rate) and `-max-length` (how many
//! seconds the burst may last), and `iops-size`.

use std::fmt;

/// QEMU's largest value (`THROTTLE_VALUE_MAX`).
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;

/// What a bucket counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Bytes (`bps-*`).
    Bytes,
    /// Requests (`iops-*`).
    Ops,
}

/// Which requests a bucket counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Reads and writes.
    Total,
    /// Reads.
    Read,
    /// Writes (with discards and write-zeroes, by their length, as QEMU's throttle filter
    /// counts them).
    Write,
}

/// The six buckets, in QEMU's order.
pub const BUCKETS: [(Unit, Scope); 6] = [
    (Unit::Bytes, Scope::Total),
    (Unit::Bytes, Scope::Read),
    (Unit::Bytes, Scope::Write),
    (Unit::Ops, Scope::Total),
    (Unit::Ops, Scope::Read),
    (Unit::Ops, Scope::Write),
];

/// One bucket's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketLimit {
    /// The rate, units per second (0: none).
    pub avg: u64,
    /// The burst rate (0: none): `max * max_length` units may go at once, then the rate.
    pub max: u64,
    /// Seconds the burst may last at `max` (QEMU's `-max-length`; at least 1).
    pub max_length: u64,
}

impl Default for BucketLimit {
    fn default() -> Self {
        BucketLimit {
            avg: 0,
            max: 0,
            max_length: 1,
        }
    }
}

/// A disk's or a group's limits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// By [`BUCKETS`] order.
    pub buckets: [BucketLimit; 6],
    /// `iops-size`: a request larger than this counts as `size / iops-size` requests
    /// (0: every request counts as one).
    pub iops_size: u64,
}

fn name(unit: Unit, scope: Scope) -> &'static str {
    match (unit, scope) {
        (Unit::Bytes, Scope::Total) => "bps-total",
        (Unit::Bytes, Scope::Read) => "bps-read",
        (Unit::Bytes, Scope::Write) => "bps-write",
        (Unit::Ops, Scope::Total) => "iops-total",
        (Unit::Ops, Scope::Read) => "iops-read",
        (Unit::Ops, Scope::Write) => "iops-write",
    }
}

/// Every key [`Limits::set`] takes.
pub fn keys() -> Vec<String> {
    let mut out = Vec::new();
    for (u, s) in BUCKETS {
        let n = name(u, s);
        out.push(n.to_string());
        out.push(format!("{n}-max"));
        out.push(format!("{n}-max-length"));
    }
    out.push("iops-size".into());
    out
}

/// Parse a number with an optional K, M, G or T suffix, in either case: powers of 1024 for
/// what counts bytes (`bps-*`, `iops-size`: `bps-total=100M`, as vblk's sizes), powers of
/// 1000 for what counts requests (`iops-total=10k`). The key says which: `10m` and `10M`
/// are never two different rates.
fn number(key: &str, v: &str) -> Result<u64, String> {
    let v = v.trim();
    // A burst's length is seconds, whatever it limits.
    let bytes = (key.starts_with("bps") && !key.ends_with("-max-length")) || key == "iops-size";
    let power = |n: u32| {
        if bytes {
            1u64 << (10 * n)
        } else {
            1000u64.pow(n)
        }
    };
    let (digits, mult) = match v.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let n = match c.to_ascii_lowercase() {
                'k' => 1,
                'm' => 2,
                'g' => 3,
                't' => 4,
                _ => 0,
            };
            (&v[..i], if n > 0 { power(n) } else { 0 })
        }
        _ => (v, 1),
    };
    let unit = if bytes {
        "1024s: bytes"
    } else {
        "1000s: requests"
    };
    digits
        .parse::<u64>()
        .ok()
        .filter(|_| mult != 0)
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("{key}={v}: not a number (a count, or with K, M, G or T for {unit})")
        })
}

impl Limits {
    /// Whether nothing is limited (QEMU's `!throttle_enabled`).
    pub fn is_unlimited(&self) -> bool {
        self.buckets.iter().all(|b| b.avg == 0)
    }

    /// Set one key (`iops-total=2000`, `bps-read-max=100M`, `iops-size=4K`).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        if key == "iops-size" {
            self.iops_size = number(key, value)?;
            return Ok(());
        }
        for (i, (u, s)) in BUCKETS.iter().enumerate() {
            let n = name(*u, *s);
            let Some(rest) = key.strip_prefix(n) else {
                continue;
            };
            let b = &mut self.buckets[i];
            match rest {
                "" => b.avg = number(key, value)?,
                "-max" => b.max = number(key, value)?,
                "-max-length" => {
                    let len = number(key, value)?;
                    if len > u64::from(u32::MAX) {
                        return Err(format!(
                            "{key} value must be in the range [0, {}]",
                            u32::MAX
                        ));
                    }
                    b.max_length = len;
                }
                _ => continue,
            }
            return Ok(());
        }
        Err(format!(
            "unknown limit {key:?} (the limits are {})",
            keys().join(", ")
        ))
    }

    /// Parse `KEY=VALUE,...` (QEMU's names; `none` is no limit).
    pub fn parse(s: &str) -> Result<Limits, String> {
        let mut l = Limits::default();
        if s.trim() == "none" {
            return Ok(l);
        }
        for item in s.split(',').filter(|i| !i.trim().is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?}: expected KEY=VALUE (e.g. iops-total=2000)"))?;
            l.set(k.trim(), v)?;
        }
        l.validate()?;
        Ok(l)
    }

    /// QEMU's checks in QEMU's order, with QEMU's messages (`throttle_is_valid`).
    pub fn validate(&self) -> Result<(), String> {
        let b = &self.buckets;
        let names: Vec<&str> = BUCKETS.iter().map(|&(u, s)| name(u, s)).collect();
        // bps: 0 total, 1 read, 2 write; iops: 3 total, 4 read, 5 write. QEMU's messages,
        // after the keys they are about.
        let mixed = |t: usize, r: usize, w: usize, f: fn(&BucketLimit) -> u64, suffix: &str| {
            let other = [r, w].into_iter().find(|&i| f(&b[i]) != 0)?;
            (f(&b[t]) != 0).then(|| format!("{}{suffix} and {}{suffix}", names[t], names[other]))
        };
        let avg: fn(&BucketLimit) -> u64 = |x| x.avg;
        let max: fn(&BucketLimit) -> u64 = |x| x.max;
        if let Some(keys) = mixed(0, 1, 2, avg, "")
            .or_else(|| mixed(3, 4, 5, avg, ""))
            .or_else(|| mixed(0, 1, 2, max, "-max"))
            .or_else(|| mixed(3, 4, 5, max, "-max"))
        {
            return Err(format!(
                "{keys}: bps/iops/max total values and read/write values cannot be used at the same time"
            ));
        }
        if self.iops_size != 0 && b[3].avg == 0 && b[4].avg == 0 && b[5].avg == 0 {
            return Err("iops-size: iops size requires an iops value to be set".into());
        }
        for (x, n) in b.iter().zip(&names) {
            if x.avg > VALUE_MAX || x.max > VALUE_MAX {
                let key = if x.avg > VALUE_MAX {
                    n.to_string()
                } else {
                    format!("{n}-max")
                };
                return Err(format!(
                    "{key}: bps/iops/max values must be within [0, {VALUE_MAX}]"
                ));
            }
            if x.max_length == 0 {
                return Err(format!("{n}-max-length: the burst length cannot be 0"));
            }
            if x.max_length > 1 && x.max == 0 {
                return Err(format!(
                    "{n}-max-length without {n}-max: burst length set without burst rate"
                ));
            }
            if x.max != 0 && x.max_length > VALUE_MAX / x.max {
                return Err(format!(
                    "{n}-max-length: burst length too high for this burst rate"
                ));
            }
            if x.max != 0 && x.avg == 0 {
                return Err(format!(
                    "{n}-max without {n}: bps_max/iops_max require corresponding bps/iops values"
                ));
            }
            if x.max != 0 && x.max < x.avg {
                return Err(format!(
                    "{n}-max below {n}: bps_max/iops_max cannot be lower than bps/iops"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Limits {
    /// `KEY=VALUE,...` of what is set (`none` when nothing is), as [`Limits::parse`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for (i, (u, s)) in BUCKETS.iter().enumerate() {
            let (n, b) = (name(*u, *s), &self.buckets[i]);
            if b.avg != 0 {
                parts.push(format!("{n}={}", b.avg));
            }
            if b.max != 0 {
                parts.push(format!("{n}-max={}", b.max));
            }
            if b.max_length != 1 {
                parts.push(format!("{n}-max-length={}", b.max_length));
            }
        }
        if self.iops_size != 0 {
            parts.push(format!("iops-size={}", self.iops_size));
        }
        if parts.is_empty() {
            return f.write_str("none");
        }
        f.write_str(&parts.join(","))
    }
}

impl Limits {
    /// The limits as JSON (`vblk stats`): each key set, by its name.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for item in self.to_string().split(',') {
            if let Some((k, v)) = item.split_once('=') {
                m.insert(k.into(), v.parse::<u64>().unwrap_or(0).into());
            }
        }
        serde_json::Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_names_parse_and_print_back() {
        let l = Limits::parse("iops-total=2000,iops-total-max=4000,iops-total-max-length=10,bps-read=100M,iops-size=4K").unwrap();
        assert_eq!(l.buckets[3].avg, 2000);
        assert_eq!(l.buckets[3].max, 4000);
        assert_eq!(l.buckets[3].max_length, 10);
        assert_eq!(l.buckets[1].avg, 100 << 20);
        assert_eq!(l.iops_size, 4096);
        assert_eq!(Limits::parse(&l.to_string()).unwrap(), l);
        // Requests count in 1000s, bytes in 1024s, whatever the case of the suffix.
        let one = |s: &str| Limits::parse(s).unwrap();
        for (spec, bucket, want) in [
            ("iops-total=10k", 3, 10_000),
            ("iops-total=10K", 3, 10_000),
            ("iops-read=2m", 4, 2_000_000),
            ("bps-total=10m", 0, 10 << 20),
            ("bps-total=10M", 0, 10 << 20),
            ("bps-write=1t", 2, 1 << 40),
            ("bps-read=3g", 1, 3 << 30),
        ] {
            assert_eq!(one(spec).buckets[bucket].avg, want, "{spec}");
        }
        assert_eq!(one("iops-total=1,iops-size=4k").iops_size, 4096);
        // A burst's length is seconds, in 1000s whatever it limits.
        let l = one("bps-total=1M,bps-total-max=2M,bps-total-max-length=1k");
        assert_eq!(l.buckets[0].max_length, 1000);
        assert!(Limits::parse("iops-total=10x").is_err());
        assert!(Limits::parse("iops-total=k").is_err());
        assert!(Limits::parse("none").unwrap().is_unlimited());
        assert_eq!(Limits::default().to_string(), "none");
    }

    #[test]
    fn qemu_checks_with_qemu_messages() {
        let bad = |s: &str| Limits::parse(s).unwrap_err();
        assert_eq!(
            bad("iops-total=1,iops-read=1"),
            "iops-total and iops-read: bps/iops/max total values and read/write values cannot be used at the same time"
        );
        assert!(
            Limits::parse("bps-total=1,iops-read=1").is_ok(),
            "bps-total with iops-read is allowed"
        );
        assert_eq!(
            bad("bps-total=1,iops-size=4096"),
            "iops-size: iops size requires an iops value to be set"
        );
        assert_eq!(
            bad("iops-total=1,iops-total-max-length=0"),
            "iops-total-max-length: the burst length cannot be 0"
        );
        assert_eq!(
            bad("iops-total=1,iops-total-max-length=2"),
            "iops-total-max-length without iops-total-max: burst length set without burst rate"
        );
        assert_eq!(
            bad("iops-total-max=10"),
            "iops-total-max without iops-total: bps_max/iops_max require corresponding bps/iops values"
        );
        assert_eq!(
            bad("iops-total=10,iops-total-max=5"),
            "iops-total-max below iops-total: bps_max/iops_max cannot be lower than bps/iops"
        );
        assert_eq!(
            bad("iops-total=1000000000000001"),
            "iops-total: bps/iops/max values must be within [0, 1000000000000000]"
        );
        assert!(bad("iops-total=x").contains("not a number"));
        assert!(bad("iopstotal=1").contains("unknown limit"));
        assert!(bad("iops-total").contains("expected KEY=VALUE"));
    }
}
