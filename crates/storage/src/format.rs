//! Refusing images that are not raw. vblk serves bytes as they are: a qcow2 (or VMDK, VDI,
//! ...) file served raw shows the guest the format's metadata, and a guest that writes to
//! its "disk" overwrites that metadata and destroys the image. So files and block devices
//! are probed at open, the way QEMU's format drivers probe (`bdrv_probe` in each of
//! block/qcow2.c, qcow.c, qed.c, vmdk.c, vhdx.c, vdi.c, vpc.c, parallels.c, bochs.c, cloop.c
//! and crypto.c for LUKS), and refused unless the user declares the format raw.
//!
//! Beyond QEMU's probes, two trailers are checked: a fixed-size VHD has its only footer in
//! the last 512 bytes (QEMU probes such a file as raw; a guest sees the footer as its last
//! sector), and a DMG (UDIF) image ends in a `koly` trailer (QEMU probes DMG by file name).
//!
//! Declaring the format matters for disks a guest owns: the guest can write a qcow2 header
//! into sector 0 of its raw disk, and the next start without `--format raw` would refuse the
//! disk. QEMU warns about the same thing when it probes ("Automatically detecting the
//! format is dangerous for raw images").

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The format the user declares a disk to be in; declaring it turns the probe off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The bytes are the disk.
    Raw,
    /// A qcow2 image, with its backing chain as named on the command line.
    Qcow2,
}

impl std::str::FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "raw" => Ok(Format::Raw),
            "qcow2" => Ok(Format::Qcow2),
            _ => Err(format!("{s:?}: vblk serves raw and qcow2 images")),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        })
    }
}

/// An image format that is not raw, found by probing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImageFormat {
    /// QEMU copy-on-write v2/v3: `QFI\xfb`, version >= 2.
    Qcow2 {
        /// The header's version field.
        version: u32,
    },
    /// QEMU copy-on-write v1: `QFI\xfb`, version 1.
    Qcow,
    /// QEMU enhanced disk: `QED\0`.
    Qed,
    /// A VMDK sparse extent: `KDMV` (VMDK4) or `COWD` (VMDK3).
    Vmdk,
    /// A VMDK text descriptor: comments, then `version=1|2|3`.
    VmdkDescriptor,
    /// Hyper-V VHDX: `vhdxfile`.
    Vhdx,
    /// VirtualBox VDI: signature `0xbeda107f` at offset 0x40.
    Vdi,
    /// Virtual PC VHD: `conectix` at offset 0 (dynamic or differencing), or only in the
    /// 512-byte footer at the end (fixed).
    Vpc {
        /// Only the footer was found: a fixed-size VHD.
        fixed: bool,
    },
    /// A LUKS encrypted volume: `LUKS\xba\xbe`.
    Luks {
        /// The header's version field (1 or 2).
        version: u16,
    },
    /// Parallels: `WithoutFreeSpace` or `WithouFreSpacExt`, version 2.
    Parallels,
    /// Apple disk image: a `koly` trailer in the last 512 bytes.
    Dmg,
    /// Bochs growing or volatile image: `Bochs Virtual HD Image`.
    Bochs,
    /// Compressed loop image: its V2.0 shell-script header.
    Cloop,
}

impl ImageFormat {
    /// qemu-img's name for the format (`qemu-img convert -f NAME`).
    pub fn qemu_name(self) -> &'static str {
        match self {
            ImageFormat::Qcow2 { .. } => "qcow2",
            ImageFormat::Qcow => "qcow",
            ImageFormat::Qed => "qed",
            ImageFormat::Vmdk | ImageFormat::VmdkDescriptor => "vmdk",
            ImageFormat::Vhdx => "vhdx",
            ImageFormat::Vdi => "vdi",
            ImageFormat::Vpc { .. } => "vpc",
            ImageFormat::Luks { .. } => "luks",
            ImageFormat::Parallels => "parallels",
            ImageFormat::Dmg => "dmg",
            ImageFormat::Bochs => "bochs",
            ImageFormat::Cloop => "cloop",
        }
    }
}

impl fmt::Display for ImageFormat {
    /// What it is, after "is": `a qcow2 image (version 3)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageFormat::Qcow2 { version } => write!(f, "a qcow2 image (version {version})"),
            ImageFormat::Qcow => f.write_str("a qcow image (QEMU copy-on-write version 1)"),
            ImageFormat::Qed => f.write_str("a QED image"),
            ImageFormat::Vmdk => f.write_str("a VMDK image (sparse extent)"),
            ImageFormat::VmdkDescriptor => f.write_str(
                "a VMDK descriptor (a text file naming the extent files that hold the data)",
            ),
            ImageFormat::Vhdx => f.write_str("a VHDX image"),
            ImageFormat::Vdi => f.write_str("a VDI image (VirtualBox)"),
            ImageFormat::Vpc { fixed: false } => f.write_str("a VHD image (vpc, dynamic)"),
            ImageFormat::Vpc { fixed: true } => f.write_str(
                "a fixed-size VHD image (vpc: raw data followed by a 512-byte footer, which the \
                 guest would see as its last sector)",
            ),
            ImageFormat::Luks { version } => write!(f, "a LUKS{version} encrypted volume"),
            ImageFormat::Parallels => f.write_str("a Parallels image"),
            ImageFormat::Dmg => f.write_str("a DMG image (Apple UDIF)"),
            ImageFormat::Bochs => f.write_str("a Bochs image"),
            ImageFormat::Cloop => f.write_str("a cloop image"),
        }
    }
}

/// How many leading bytes the probe looks at: QEMU's `BLOCK_PROBE_BUF_SIZE`, so that the
/// VMDK descriptor scan sees what QEMU's sees.
pub const PROBE_HEAD: usize = 2048;
/// How many trailing bytes it looks at: one footer sector.
pub const PROBE_TAIL: usize = 512;

/// The format `head` (the first [`PROBE_HEAD`] bytes, or all of a smaller disk) and `tail`
/// (the last [`PROBE_TAIL`] bytes, or empty) show, if not raw.
pub fn probe(head: &[u8], tail: &[u8]) -> Option<ImageFormat> {
    let head = &head[..head.len().min(PROBE_HEAD)];
    let be32 = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    };
    let le32 = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    };
    if head.starts_with(b"QFI\xfb") {
        match be32(head, 4) {
            Some(1) => return Some(ImageFormat::Qcow),
            Some(version) if version >= 2 => return Some(ImageFormat::Qcow2 { version }),
            _ => {}
        }
    }
    if head.starts_with(b"QED\0") {
        return Some(ImageFormat::Qed);
    }
    if head.starts_with(b"KDMV") || head.starts_with(b"COWD") {
        return Some(ImageFormat::Vmdk);
    }
    if is_vmdk_descriptor(head) {
        return Some(ImageFormat::VmdkDescriptor);
    }
    if head.starts_with(b"vhdxfile") {
        return Some(ImageFormat::Vhdx);
    }
    if le32(head, 0x40) == Some(0xbeda_107f) {
        return Some(ImageFormat::Vdi);
    }
    if head.starts_with(b"conectix") {
        return Some(ImageFormat::Vpc { fixed: false });
    }
    if head.starts_with(b"LUKS\xba\xbe") && head.len() >= 8 {
        let version = u16::from_be_bytes([head[6], head[7]]);
        return Some(ImageFormat::Luks { version });
    }
    if (head.starts_with(b"WithoutFreeSpace") || head.starts_with(b"WithouFreSpacExt"))
        && le32(head, 16) == Some(2)
    {
        return Some(ImageFormat::Parallels);
    }
    if head.starts_with(b"Bochs Virtual HD Image\0") {
        return Some(ImageFormat::Bochs);
    }
    if head.starts_with(CLOOP_MAGIC) {
        return Some(ImageFormat::Cloop);
    }
    if tail.len() == PROBE_TAIL {
        if tail.starts_with(b"conectix") {
            return Some(ImageFormat::Vpc { fixed: true });
        }
        // UDIF trailer: signature, version 4, header size 512 (all big-endian).
        if tail.starts_with(b"koly") && be32(tail, 4) == Some(4) && be32(tail, 8) == Some(512) {
            return Some(ImageFormat::Dmg);
        }
    }
    None
}

/// block/cloop.c's `magic_version_2_0`.
const CLOOP_MAGIC: &[u8] =
    b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";

/// block/vmdk.c's `vmdk_probe` for text descriptors: `#` comment lines and blank lines
/// (spaces, an optional `\r`), then a line that is exactly `version=1`, `2` or `3`.
fn is_vmdk_descriptor(buf: &[u8]) -> bool {
    let mut p = 0;
    while p < buf.len() {
        match buf[p] {
            b'#' => {
                while p < buf.len() && buf[p] != b'\n' {
                    p += 1;
                }
                p += 1;
            }
            b' ' => {
                while p < buf.len() && buf[p] == b' ' {
                    p += 1;
                }
                if p < buf.len() && buf[p] == b'\r' {
                    p += 1;
                }
                if p == buf.len() || buf[p] != b'\n' {
                    return false;
                }
                p += 1;
            }
            _ => {
                let rest = &buf[p..];
                return [b'1', b'2', b'3'].iter().any(|v| {
                    let line = [b"version=".as_slice(), &[*v]].concat();
                    rest.starts_with(&line)
                        && (rest[line.len()..].starts_with(b"\n")
                            || rest[line.len()..].starts_with(b"\r\n"))
                });
            }
        }
    }
    false
}

/// Reads at this alignment and granularity: the largest O_DIRECT block size vblk
/// accepts, so the probe works on descriptors opened with or without O_DIRECT.
const WINDOW: usize = 65536;

/// Probes an opened file or block device of `size` bytes.
pub(crate) fn probe_file(file: &File, size: u64) -> io::Result<Option<ImageFormat>> {
    // Three windows of room: one to align the start, two to read the tail, which may
    // straddle a window boundary.
    let mut room = vec![0u8; 3 * WINDOW];
    let start = (WINDOW - room.as_ptr() as usize % WINDOW) % WINDOW;
    let buf = &mut room[start..start + 2 * WINDOW];

    let n = read_from(file, 0, &mut buf[..WINDOW])?;
    let head = buf[..n.min(PROBE_HEAD)].to_vec();
    let mut tail = Vec::new();
    if size >= PROBE_TAIL as u64 {
        let at = size - PROBE_TAIL as u64;
        let window = at / WINDOW as u64 * WINDOW as u64;
        let n = read_from(file, window, buf)?;
        let skip = (at - window) as usize;
        if n >= skip + PROBE_TAIL {
            tail = buf[skip..skip + PROBE_TAIL].to_vec();
        }
    }
    Ok(probe(&head, &tail))
}

/// Fills `buf` from `offset` until it is full or the file ends. With O_DIRECT a short read
/// means the end of the file, and the next (unaligned) read fails: that ends the read too.
fn read_from(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) if done > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The message for a refused image: what it is, why serving it raw is wrong, and the way
/// out (`qemu-img convert`, or declaring the format raw).
pub(crate) fn refusal(path: &Path, format: ImageFormat, read_only: bool) -> String {
    let p = path.display();
    let out = converted_name(path);
    let o = out.display();
    let harm = if read_only {
        "the guest would see the format's metadata, not the disk it describes"
    } else {
        "serving it raw would let the guest overwrite its metadata"
    };
    match format {
        ImageFormat::Luks { .. } => format!(
            "{p} is {format}, not raw: {harm}. If the guest encrypted its disk itself, the disk \
             is raw: pass --format raw. If it is a QEMU luks image, decrypt it: qemu-img convert \
             --object secret,id=key,file=KEYFILE --image-opts \
             driver=luks,key-secret=key,file.filename={p} -O raw {o}"
        ),
        ImageFormat::Qcow2 { .. } => format!(
            "{p} is {format}, not raw: {harm}. Serve it as qcow2 with --format qcow2 (and \
             --backing for its backing chain), or convert it: qemu-img convert -f qcow2 -O \
             raw {p} {o}, or pass --format raw if you really mean to serve the bytes as \
             they are"
        ),
        _ => format!(
            "{p} is {format}, not raw: {harm}. Convert it: qemu-img convert -f {} -O raw {p} \
             {o}, or pass --format raw if you really mean to serve the bytes as they are",
            format.qemu_name()
        ),
    }
}

/// `disk.qcow2` → `disk.raw`; `disk.raw` → `disk.converted.raw`.
fn converted_name(path: &Path) -> PathBuf {
    let out = path.with_extension("raw");
    if out == path {
        path.with_extension("converted.raw")
    } else {
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(at: usize, bytes: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; PROBE_HEAD];
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    }

    fn head(bytes: &[u8]) -> Option<ImageFormat> {
        probe(&with(0, bytes), &[0u8; PROBE_TAIL])
    }

    #[test]
    fn header_magics() {
        assert_eq!(
            head(b"QFI\xfb\0\0\0\x03"),
            Some(ImageFormat::Qcow2 { version: 3 })
        );
        assert_eq!(
            head(b"QFI\xfb\0\0\0\x02"),
            Some(ImageFormat::Qcow2 { version: 2 })
        );
        assert_eq!(head(b"QFI\xfb\0\0\0\x01"), Some(ImageFormat::Qcow));
        assert_eq!(head(b"QFI\xfb\0\0\0\0"), None, "no qcow version 0");
        assert_eq!(head(b"QED\0"), Some(ImageFormat::Qed));
        assert_eq!(head(b"KDMV\x01\0\0\0"), Some(ImageFormat::Vmdk));
        assert_eq!(head(b"COWD\x01\0\0\0"), Some(ImageFormat::Vmdk));
        assert_eq!(head(b"vhdxfile"), Some(ImageFormat::Vhdx));
        assert_eq!(
            probe(&with(0x40, &0xbeda_107fu32.to_le_bytes()), &[]),
            Some(ImageFormat::Vdi)
        );
        assert_eq!(head(b"conectix"), Some(ImageFormat::Vpc { fixed: false }));
        assert_eq!(
            head(b"LUKS\xba\xbe\0\x01"),
            Some(ImageFormat::Luks { version: 1 })
        );
        assert_eq!(
            head(b"LUKS\xba\xbe\0\x02"),
            Some(ImageFormat::Luks { version: 2 })
        );
        assert_eq!(
            head(b"WithoutFreeSpace\x02\0\0\0"),
            Some(ImageFormat::Parallels)
        );
        assert_eq!(
            head(b"WithouFreSpacExt\x02\0\0\0"),
            Some(ImageFormat::Parallels)
        );
        assert_eq!(head(b"WithoutFreeSpace\x03\0\0\0"), None, "version 2 only");
        assert_eq!(head(b"Bochs Virtual HD Image\0"), Some(ImageFormat::Bochs));
        assert_eq!(head(CLOOP_MAGIC), Some(ImageFormat::Cloop));
    }

    #[test]
    fn trailers() {
        let zeros = vec![0u8; PROBE_HEAD];
        let mut footer = [0u8; PROBE_TAIL];
        footer[..8].copy_from_slice(b"conectix");
        assert_eq!(
            probe(&zeros, &footer),
            Some(ImageFormat::Vpc { fixed: true })
        );
        let mut koly = [0u8; PROBE_TAIL];
        koly[..4].copy_from_slice(b"koly");
        koly[4..8].copy_from_slice(&4u32.to_be_bytes());
        koly[8..12].copy_from_slice(&512u32.to_be_bytes());
        assert_eq!(probe(&zeros, &koly), Some(ImageFormat::Dmg));
        koly[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert_eq!(probe(&zeros, &koly), None, "UDIF trailers are version 4");
        assert_eq!(
            probe(&zeros, &footer[..100]),
            None,
            "a partial tail is no footer"
        );
    }

    #[test]
    fn vmdk_descriptors_as_qemu_reads_them() {
        let desc = |s: &str| probe(s.as_bytes(), &[]);
        let d = Some(ImageFormat::VmdkDescriptor);
        assert_eq!(desc("# Disk DescriptorFile\nversion=1\nCID=fffffffe\n"), d);
        assert_eq!(desc("# Disk DescriptorFile\r\nversion=3\r\n"), d);
        assert_eq!(desc("#c\n   \n  \r\nversion=2\n"), d);
        assert_eq!(desc("version=1\n"), d);
        assert_eq!(desc("version=4\n"), None);
        assert_eq!(desc("version=1"), None, "needs its line end");
        assert_eq!(desc("# comment only\n"), None);
        assert_eq!(desc("  x\nversion=1\n"), None, "text before the version");
        assert_eq!(desc("\nversion=1\n"), None, "QEMU skips no bare newline");
        // Only the first 2048 bytes count, as in QEMU.
        let long = format!("{}\nversion=1\n", "#".repeat(PROBE_HEAD));
        assert_eq!(desc(&long), None);
    }

    #[test]
    fn raw_disks_are_raw() {
        assert_eq!(probe(&[0u8; PROBE_HEAD], &[0u8; PROBE_TAIL]), None);
        assert_eq!(probe(&[], &[]), None);
        // An MBR boot sector and random sectors are not formats.
        let mut mbr = vec![0u8; PROBE_HEAD];
        mbr[0..3].copy_from_slice(&[0xeb, 0x63, 0x90]);
        mbr[510..512].copy_from_slice(&[0x55, 0xaa]);
        assert_eq!(probe(&mbr, &[0u8; PROBE_TAIL]), None);
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..1000 {
            let bytes: Vec<u8> = (0..PROBE_HEAD + PROBE_TAIL)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let (h, t) = bytes.split_at(PROBE_HEAD);
            assert_eq!(probe(h, t), None);
        }
    }

    #[test]
    fn refusals_name_the_format_and_the_way_out() {
        let m = refusal(
            Path::new("disk.img"),
            ImageFormat::Qcow2 { version: 3 },
            false,
        );
        assert_eq!(
            m,
            "disk.img is a qcow2 image (version 3), not raw: serving it raw would let the guest \
             overwrite its metadata. Serve it as qcow2 with --format qcow2 (and --backing for \
             its backing chain), or convert it: qemu-img convert -f qcow2 -O raw disk.img \
             disk.raw, or pass --format raw if you really mean to serve the bytes as they are"
        );
        let m = refusal(Path::new("/v/x.raw"), ImageFormat::Vdi, true);
        assert!(
            m.contains("qemu-img convert -f vdi -O raw /v/x.raw /v/x.converted.raw"),
            "{m}"
        );
        assert!(
            m.contains("the guest would see the format's metadata"),
            "{m}"
        );
        let m = refusal(Path::new("c.img"), ImageFormat::Luks { version: 1 }, false);
        assert!(
            m.starts_with("c.img is a LUKS1 encrypted volume, not raw"),
            "{m}"
        );
        assert!(
            m.contains("pass --format raw") && m.contains("driver=luks"),
            "{m}"
        );
    }

    #[test]
    fn files_are_probed_at_both_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        // A fixed VHD whose footer straddles a 64 KiB boundary in the tail read.
        let mut data = vec![0u8; WINDOW + 300];
        let at = data.len() - PROBE_TAIL;
        data[at..at + 8].copy_from_slice(b"conectix");
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(
            probe_file(&f, data.len() as u64).unwrap(),
            Some(ImageFormat::Vpc { fixed: true })
        );
        // A file smaller than a footer: only the head counts.
        std::fs::write(&path, b"QFI\xfb\0\0\0\x03").unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(
            probe_file(&f, 8).unwrap(),
            Some(ImageFormat::Qcow2 { version: 3 })
        );
        std::fs::write(&path, b"").unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(probe_file(&f, 0).unwrap(), None);
    }
}
