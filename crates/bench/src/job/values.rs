//! fio's value syntax: sizes, times, block sizes, bssplit lists, counts and flags.

use std::time::Duration;

use super::{RwMode, Size, Verify};

pub(super) fn parse_rw(v: &str) -> Result<RwMode, String> {
    match v.split_once(':') {
        Some((_, modifier)) => Err(format!("rw modifier ':{modifier}' is not supported")),
        None => v.parse(),
    }
}

/// fio's `bs=R[,W[,T]]`: an empty part keeps fio's default (4096), a missing write part copies
/// the read part; the trim part is irrelevant here. Reads and writes must agree.
pub(super) fn parse_bs(v: &str) -> Result<u64, String> {
    const DEFAULT: u64 = 4096;
    let mut parts = v.split(',');
    let part = |p: Option<&str>| -> Result<Option<u64>, String> {
        match p.map(str::trim) {
            None => Ok(None),
            Some("") => Ok(Some(DEFAULT)),
            Some(p) => parse_size(p).map(Some),
        }
    };
    let read = part(parts.next())?.unwrap_or(DEFAULT);
    let write = part(parts.next())?.unwrap_or(read);
    if read != write {
        return Err(format!(
            "different read and write block sizes ({read} and {write}) are not supported"
        ));
    }
    if read == 0 {
        return Err("block size 0".to_string());
    }
    Ok(read)
}

/// Parse fio's `bssplit=` value, `bs/percent:bs/percent...` (optionally `read,write[,trim]`,
/// in which case reads and writes must agree), and normalise it: entries without a percent share
/// what the others leave equally (integer division, as fio), what is still missing from 100 goes
/// to the largest block size (as fio's selection loop does), entries are sorted by block size,
/// equal sizes are merged and 0% entries dropped.
pub fn parse_bssplit(v: &str) -> Result<Vec<(u64, u32)>, String> {
    let mut parts = v.split(',');
    let read = parse_bssplit_one(parts.next().unwrap_or(""))?;
    if let Some(write) = parts.next() {
        if parse_bssplit_one(write)? != read {
            return Err("different read and write bssplit lists are not supported".to_string());
        }
    }
    Ok(read)
}

fn parse_bssplit_one(v: &str) -> Result<Vec<(u64, u32)>, String> {
    let v = v.trim();
    if v.is_empty() {
        return Err("empty bssplit list".to_string());
    }
    let mut entries: Vec<(u64, Option<u32>)> = Vec::new();
    for item in v.split(':') {
        let item = item.trim();
        let (bs, perc) = match item.split_once('/') {
            Some((bs, perc)) => (bs.trim(), Some(perc.trim())),
            None => (item, None),
        };
        if bs.is_empty() {
            return Err(format!("bssplit entry '{item}' has no block size"));
        }
        let bs = parse_size(bs)?;
        if bs == 0 {
            return Err(format!("bssplit entry '{item}' has block size 0"));
        }
        let perc = match perc {
            None | Some("") => None,
            Some(p) => Some(p.parse::<u32>().ok().filter(|&p| p <= 100).ok_or_else(|| {
                format!("bssplit entry '{item}': percent '{p}' is not an integer 0..=100")
            })?),
        };
        entries.push((bs, perc));
    }
    let given: u32 = entries.iter().filter_map(|e| e.1).sum();
    if given > 100 {
        return Err(format!(
            "bssplit percentages add up to {given}, more than 100"
        ));
    }
    let missing = entries.iter().filter(|e| e.1.is_none()).count() as u32;
    let share = (100 - given).checked_div(missing).unwrap_or(0);
    let mut out: Vec<(u64, u32)> = Vec::with_capacity(entries.len());
    for (bs, perc) in entries {
        out.push((bs, perc.unwrap_or(share)));
    }
    out.sort_by_key(|e| e.0);
    out.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 += later.1;
        }
        same
    });
    let total: u32 = out.iter().map(|e| e.1).sum();
    if let Some(last) = out.last_mut() {
        last.1 += 100 - total;
    }
    out.retain(|e| e.1 > 0);
    Ok(out)
}

/// A count option with a lower bound.
pub(super) fn parse_count(v: &str, min: u32) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!("{n} is below the minimum {min}")),
        Err(_) => Err(format!("'{v}' is not a number")),
    }
}

pub(super) fn parse_percent(v: &str) -> Result<u32, String> {
    match v.parse::<u32>() {
        Ok(n) if n <= 100 => Ok(n),
        _ => Err(format!("'{v}' is not a percentage 0..=100")),
    }
}

pub(super) fn parse_region_size(v: &str) -> Result<Size, String> {
    if let Some(p) = v.strip_suffix('%') {
        return match p.trim().parse::<u32>() {
            Ok(n) if (1..=100).contains(&n) => Ok(Size::Percent(n)),
            _ => Err(format!("'{v}' is not a percentage 1..=100")),
        };
    }
    match parse_size(v)? {
        0 => Err("size 0".to_string()),
        n => Ok(Size::Bytes(n)),
    }
}

/// fio's boolean options: bare means on, otherwise an integer (non-zero is on).
pub(super) fn parse_flag(value: Option<&str>) -> Result<bool, String> {
    match value {
        None => Ok(true),
        Some(v) => v
            .parse::<u64>()
            .map(|n| n != 0)
            .map_err(|_| format!("'{v}' is not 0 or 1")),
    }
}

pub(super) fn parse_verify(v: &str) -> Result<Option<Verify>, String> {
    match v {
        "crc32c" | "crc32c-intel" => Ok(Some(Verify::Crc32c)),
        "0" | "none" => Ok(None),
        _ => Err(format!(
            "verify '{v}' is not supported (expected crc32c, crc32c-intel, none or 0)"
        )),
    }
}

/// Parse a fio size: a decimal (or `0x` hex) integer with an optional unit `k`, `m`, `g`, `t` or
/// `p`, case-insensitive, optionally followed by `b` or `ib`; all units are powers of 1024
/// (`"4k"` = `"4KiB"` = 4096). A bare `b` means bytes.
///
/// fio's default `kb_base=1024` treats `KiB` as 1000 for compatibility; vblk reads it as 1024.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = |why: &str| format!("bad size '{s}': {why}");
    let (digits, radix, rest) = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => {
            let end = hex
                .find(|c: char| !c.is_ascii_hexdigit())
                .unwrap_or(hex.len());
            (&hex[..end], 16, &hex[end..])
        }
        None => {
            let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
            (&t[..end], 10, &t[end..])
        }
    };
    if digits.is_empty() {
        return Err(bad("expected a number"));
    }
    let n = u64::from_str_radix(digits, radix).map_err(|_| bad("does not fit in 64 bits"))?;
    let shift = match rest.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => {
            return Err(bad(&format!(
                "unknown unit '{}' (expected k, m, g, t or p, optionally followed by b or ib)",
                rest.trim()
            )))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| bad("does not fit in 64 bits"))
}

/// Parse a fio time: an integer with an optional unit `us`, `ms`, `s`, `m`, `h` or `d`
/// (case-insensitive); a bare number is seconds.
pub fn parse_time(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = |why: &str| format!("bad time '{s}': {why}");
    let end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(end);
    if digits.is_empty() {
        return Err(bad("expected a number"));
    }
    let n: u64 = digits.parse().map_err(|_| bad("does not fit in 64 bits"))?;
    let secs = |mul: u64| {
        n.checked_mul(mul)
            .map(Duration::from_secs)
            .ok_or_else(|| bad("too long"))
    };
    match unit.trim().to_ascii_lowercase().as_str() {
        "us" | "usec" => Ok(Duration::from_micros(n)),
        "ms" | "msec" => Ok(Duration::from_millis(n)),
        "" | "s" | "sec" => secs(1),
        "m" | "min" => secs(60),
        "h" => secs(3600),
        "d" => secs(86400),
        u => Err(bad(&format!(
            "unknown unit '{u}' (expected us, ms, s, m, h or d)"
        ))),
    }
}
