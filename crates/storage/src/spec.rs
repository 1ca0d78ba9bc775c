//! The SPEC grammar that names a disk everywhere in vblk (`PATH`, `mem:SIZE`,
//! `null:SIZE`, `hdd:SIZE[:xN][:norot]`) and the size grammar inside it (`512`, `4K`, `1GiB`, ...).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::Error;
use crate::nbd::{NbdError, NbdSpec};

/// The sector size: every disk size and every I/O is a multiple of it.
pub const SECTOR_SIZE: u64 = 512;

/// What a disk is: the SPEC grammar used wherever vblk names a disk.
///
/// `PATH` names a regular file or a block device, `mem:SIZE` a RAM disk of SIZE
/// bytes, `null:SIZE` a disk that reads zeroes and drops writes, `hdd:SIZE` a RAM disk
/// with the timing of a 7200 rpm hard disk (`hdd:SIZE:xN`: N times faster; `:norot`: it
/// does not report that it is rotational), `nbd://...`
/// and `nbd+unix://...` an NBD export. A file whose name starts with `mem:`, `null:`,
/// `hdd:` or `nbd` and a colon is written `./mem:...`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskSpec {
    /// A regular file or a block device.
    File(PathBuf),
    /// A RAM disk of this many bytes.
    Mem(u64),
    /// A null disk of this many bytes.
    Null(u64),
    /// An export on an NBD server: `nbd://HOST[:PORT]/EXPORT` or
    /// `nbd+unix:///EXPORT?socket=PATH`.
    Nbd(NbdSpec),
    /// A simulated rotational disk: RAM-backed, timed like a 7200 rpm disk.
    Hdd {
        /// Bytes.
        size: u64,
        /// Every modelled time is divided by this (1: real time; `hdd:SIZE:xN`).
        speedup: u32,
        /// Whether the device tells its driver that the disk is rotational (false:
        /// `hdd:SIZE:norot`, a hard disk that hides it, as most virtual disks do; the
        /// driver's `auto` then has to find the best path by measuring).
        reports_rotation: bool,
    },
}

/// Parses `hdd:`'s `SIZE[:xN][:norot]`.
fn parse_hdd(s: &str) -> Result<DiskSpec, Error> {
    let mut parts = s.split(':');
    let size = parse_size(parts.next().unwrap_or(""))?;
    let (mut speedup, mut reports_rotation) = (None, true);
    for part in parts {
        let bad = || Error::BadSpeedup {
            input: part.to_owned(),
        };
        if part == "norot" && reports_rotation {
            reports_rotation = false;
            continue;
        }
        let n: u32 = part
            .strip_prefix('x')
            .filter(|_| speedup.is_none() && reports_rotation)
            .ok_or_else(bad)?
            .parse()
            .map_err(|_| bad())?;
        if n == 0 || n > crate::hdd::MAX_SPEEDUP {
            return Err(bad());
        }
        speedup = Some(n);
    }
    Ok(DiskSpec::Hdd {
        size,
        speedup: speedup.unwrap_or(1),
        reports_rotation,
    })
}

impl FromStr for DiskSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        if s.is_empty() {
            return Err(Error::EmptySpec);
        }
        if let Some(size) = s.strip_prefix("mem:") {
            return Ok(DiskSpec::Mem(parse_size(size)?));
        }
        if let Some(size) = s.strip_prefix("null:") {
            return Ok(DiskSpec::Null(parse_size(size)?));
        }
        if NbdSpec::looks_like_uri(s) {
            return NbdSpec::parse(s)
                .map(DiskSpec::Nbd)
                .map_err(|why| Error::Nbd {
                    uri: s.to_owned(),
                    source: NbdError::Uri(why),
                });
        }
        if let Some(rest) = s.strip_prefix("hdd:") {
            return parse_hdd(rest);
        }
        Ok(DiskSpec::File(PathBuf::from(s)))
    }
}

impl fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskSpec::File(path) => {
                let text = path.to_string_lossy();
                let reserved = ["mem:", "null:", "hdd:"];
                if path.is_relative()
                    && (reserved.iter().any(|p| text.starts_with(p))
                        || NbdSpec::looks_like_uri(&text))
                {
                    write!(f, "{}", Path::new(".").join(path).display())
                } else {
                    write!(f, "{}", path.display())
                }
            }
            DiskSpec::Mem(size) => write!(f, "mem:{}", format_size(*size)),
            DiskSpec::Null(size) => write!(f, "null:{}", format_size(*size)),
            DiskSpec::Nbd(spec) => write!(f, "{spec}"),
            DiskSpec::Hdd {
                size,
                speedup,
                reports_rotation,
            } => {
                write!(f, "hdd:{}", format_size(*size))?;
                if *speedup != 1 {
                    write!(f, ":x{speedup}")?;
                }
                if !reports_rotation {
                    write!(f, ":norot")?;
                }
                Ok(())
            }
        }
    }
}

/// Parses a disk size: a decimal number with an optional binary suffix,
/// `K`/`k`/`KiB`, `M`/`m`/`MiB`, `G`/`g`/`GiB`, `T`/`t`/`TiB` (powers of 1024).
///
/// The result is greater than 0 and a multiple of 512:
/// `parse_size("1000")` fails with `size 1000 is not a multiple of 512`.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    if s.is_empty() {
        return Err(Error::EmptySize);
    }
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(digits_end);
    if digits.is_empty() {
        return Err(Error::BadSize {
            input: s.to_owned(),
        });
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => {
            return Err(Error::BadSize {
                input: s.to_owned(),
            })
        }
    };
    let overflow = || Error::SizeOverflow {
        input: s.to_owned(),
    };
    let number: u64 = digits.parse().map_err(|_| overflow())?;
    let size = number.checked_mul(1u64 << shift).ok_or_else(overflow)?;
    if size == 0 {
        return Err(Error::ZeroSize);
    }
    if !size.is_multiple_of(SECTOR_SIZE) {
        return Err(Error::UnalignedSize { size });
    }
    Ok(size)
}

/// Writes a size in the largest unit that divides it exactly: `1G`, `1536K`, `512`.
/// [`parse_size`] reads it back to the same number.
pub fn format_size(size: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
    for (shift, unit) in UNITS {
        if size != 0 && size.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", size >> shift);
        }
    }
    size.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("3g").unwrap(), 3 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("2T").unwrap(), 2 << 40);
        assert_eq!(parse_size("2tib").unwrap(), 2 << 40);
    }

    #[test]
    fn format_round_trips() {
        for size in [512, 1536, 4096, 3 << 20, 1 << 30, 5 << 40, (1 << 30) + 512] {
            assert_eq!(parse_size(&format_size(size)).unwrap(), size, "{size}");
        }
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(1536), "1536");
        assert_eq!(format_size(3 << 19), "1536K");
    }

    #[test]
    fn hdd_specs() {
        let hdd = |size, speedup| DiskSpec::Hdd {
            size,
            speedup,
            reports_rotation: true,
        };
        assert_eq!("hdd:1G".parse::<DiskSpec>().unwrap(), hdd(1 << 30, 1));
        assert_eq!(
            "hdd:64M:x100".parse::<DiskSpec>().unwrap(),
            hdd(64 << 20, 100)
        );
        assert_eq!(
            "hdd:1G:norot".parse::<DiskSpec>().unwrap(),
            DiskSpec::Hdd {
                size: 1 << 30,
                speedup: 1,
                reports_rotation: false
            }
        );
        for s in [
            "hdd:1G",
            "hdd:64M:x100",
            "hdd:512:x1000000",
            "./hdd:1G",
            "hdd:1G:norot",
            "hdd:1G:x4:norot",
        ] {
            assert_eq!(s.parse::<DiskSpec>().unwrap().to_string(), s);
        }
        assert_eq!(hdd(1 << 30, 1).to_string(), "hdd:1G");
        assert_eq!(
            DiskSpec::File("hdd:1G".into()).to_string(),
            "./hdd:1G",
            "a file named like a spec stays a file"
        );
        for (bad, why) in [
            (
                "hdd:1G:100",
                "hdd option \"100\": expected hdd:SIZE[:xN][:norot]",
            ),
            ("hdd:1G:x0", "hdd option \"x0\""),
            ("hdd:1G:x1000001", "\"x1000001\""),
            ("hdd:1G:", "hdd option \"\""),
            ("hdd:1G:x2:x3", "hdd option \"x3\""),
            ("hdd:1G:norot:x2", "hdd option \"x2\""),
            ("hdd:1G:norot:norot", "hdd option \"norot\""),
            ("hdd:1000", "size 1000 is not a multiple of 512"),
            ("hdd:", "empty size"),
        ] {
            let e = bad.parse::<DiskSpec>().unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
