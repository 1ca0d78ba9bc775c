//! `vblk info`: attach to a vhost-user-blk device and print what it offers, or look at a
//! disk image: its format, virtual size, how much of it is allocated, and its backing
//! chain.

use std::error::Error;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use clap::Args;
use driver::{Disk, DiskInfo, DiskOptions};
use serde_json::{json, Value};
use storage::qcow2::meta::Meta;
use storage::qcow2::{BackingFile, Header};

/// Attach to a vhost-user-blk device (vblk serve, qemu-storage-daemon, SPDK, ...) and print
/// its capacity, block size, features, limits, queues and serial; or, with --disk, look
/// at a disk image as `qemu-img info` does: its format, virtual size, file size, how many
/// of its clusters are allocated (data, zero, compressed), and its backing file (the one
/// its header names, and with --backing the chain vblk would serve).
///
/// Examples:
///
///   vblk info --socket /run/vm1.sock
///   vblk info --disk vm1.qcow2
///   vblk info --disk vm1.qcow2 --backing base.qcow2 --backing base.raw
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["socket", "disk"]))]
pub struct InfoArgs {
    /// The device's vhost-user socket.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// A disk image (a raw or qcow2 file) to look at instead. It is only read, without
    /// image locks (as `qemu-img info -U`): an image served meanwhile shows its last
    /// metadata written.
    #[arg(long, value_name = "PATH", conflicts_with = "socket")]
    pub disk: Option<PathBuf>,

    /// The image's format: raw or qcow2 [default: what its first bytes say].
    #[arg(long, value_name = "raw|qcow2", requires = "disk")]
    pub format: Option<String>,

    /// qcow2 images: the backing chain as `vblk serve --backing` takes it, checked and
    /// shown level by level (without it, the backing file the header names is shown, not
    /// opened).
    #[arg(long, value_name = "PATH[,format=F]", requires = "disk")]
    pub backing: Vec<BackingFile>,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `vblk info`.
pub fn run(args: InfoArgs) -> Result<(), Box<dyn Error>> {
    if let Some(path) = &args.disk {
        let v = image_info(&args, path)?;
        if args.json {
            outln!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            out!("{}", render_image(&v));
        }
        return Ok(());
    }
    let socket = args.socket.as_deref().ok_or("--socket or --disk")?;
    let disk = Disk::attach(socket, &DiskOptions::default())?;
    let info = disk.info();
    if args.json {
        outln!("{}", serde_json::to_string_pretty(info)?);
    } else {
        out!("{}", render(info));
    }
    Ok(())
}

/// What `--disk` shows, as JSON.
fn image_info(a: &InfoArgs, path: &Path) -> Result<Value, Box<dyn Error>> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = file.metadata()?;
    // A block device's size is not in its metadata: where its end is.
    let size = {
        use std::io::Seek;
        (&file).seek(std::io::SeekFrom::End(0))?
    };
    let mut head = vec![0u8; size.min(2 << 20) as usize];
    file.read_exact_at(&mut head, 0)?;
    let qcow2 = match a.format.as_deref() {
        Some("qcow2") => true,
        Some("raw") => false,
        Some(f) => return Err(format!("--format {f}: raw or qcow2").into()),
        None => matches!(
            storage::probe(&head, &[]),
            Some(storage::ImageFormat::Qcow2 { .. })
        ),
    };
    let mut v = json!({
        "file": path.display().to_string(),
        "file_size": size,
        "disk_size": meta.blocks() * 512,
    });
    if !qcow2 {
        if let Some(other) = storage::probe(&head, &[]) {
            v["looks_like"] = json!(other.to_string());
        }
        v["format"] = json!("raw");
        v["virtual_size"] = json!(size);
        return Ok(v);
    }
    let h = Header::parse(&head, size).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut m = Meta::open(&file, h.clone(), 16).map_err(|e| format!("{}: {e}", path.display()))?;
    let alloc = m
        .allocation(&file)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let text = |b: &Option<Vec<u8>>| {
        b.as_deref()
            .map(|n| String::from_utf8_lossy(n).into_owned())
    };
    v["format"] = json!("qcow2");
    v["version"] = json!(h.version);
    v["cluster_size"] = json!(h.cluster_size());
    v["virtual_size"] = json!(h.size);
    v["clusters"] = json!({
        "total": alloc.clusters,
        "data": alloc.data,
        "zero": alloc.zero,
        "zero_allocated": alloc.zero_allocated,
        "compressed": alloc.compressed,
        "corrupt": alloc.corrupt,
    });
    // What keeps `vblk serve` from writing it (Header::check_writable), as qemu-img
    // info shows it.
    v["snapshots"] = json!(h.snapshots);
    v["corrupt"] = json!(h.corrupt());
    v["dirty"] = json!(h.dirty());
    v["writable"] = h
        .check_writable()
        .err()
        .map_or(Value::Bool(true), Value::String);
    v["backing_file"] = json!(text(&h.backing_name));
    v["backing_format"] = json!(text(&h.backing_format));
    if !a.backing.is_empty() {
        // The chain as `vblk serve` would open it: every rule checked, read-only, no locks.
        let opts = storage::OpenOptions {
            read_only: true,
            image: storage::ImageChecks {
                lock: storage::ImageLock::Off,
                format: Some(storage::Format::Qcow2),
                incoming: false,
            },
            backing: a.backing.clone(),
            ..Default::default()
        };
        let b = storage::Backend::open(&storage::DiskSpec::File(path.to_path_buf()), &opts)?;
        let mut chain = Vec::new();
        let mut next = b.qcow2().and_then(|i| i.backing());
        while let Some((level, format)) = next {
            chain.push(json!({
                "path": level.path().map(|p| p.display().to_string()),
                "format": format.to_string(),
                "virtual_size": level.size(),
            }));
            next = level.qcow2().and_then(|i| i.backing());
        }
        v["backing_chain"] = json!(chain);
    }
    Ok(v)
}

/// The text of `--disk`'s report.
fn render_image(v: &Value) -> String {
    let mut s = String::new();
    let mut line = |k: &str, v: String| s.push_str(&format!("{k:<22} {v}\n"));
    let u = |x: &Value| x.as_u64().unwrap_or(0);
    let size = |x: &Value| format!("{} ({} bytes)", crate::disk::size_text(u(x)), u(x));
    line("file", v["file"].as_str().unwrap_or("?").into());
    let format = v["format"].as_str().unwrap_or("?");
    if format == "qcow2" {
        line(
            "format",
            format!(
                "qcow2 version {}, clusters of {}",
                u(&v["version"]),
                crate::disk::size_text(u(&v["cluster_size"]))
            ),
        );
    } else {
        line("format", format.into());
        if let Some(other) = v["looks_like"].as_str() {
            line(
                "looks like",
                format!("{other} (vblk serve refuses it as raw unless --format raw)"),
            );
        }
    }
    line("virtual size", size(&v["virtual_size"]));
    line("file size", size(&v["file_size"]));
    line("disk size", size(&v["disk_size"]));
    if format == "qcow2" {
        let c = &v["clusters"];
        let total = u(&c["total"]).max(1);
        let used = u(&c["data"]) + u(&c["compressed"]) + u(&c["zero_allocated"]);
        line(
            "allocated",
            format!(
                "{used} of {} clusters ({:.1} %): {} data, {} compressed, {} zeroed in place; {} more read as zeroes{}",
                u(&c["total"]),
                100.0 * used as f64 / total as f64,
                u(&c["data"]),
                u(&c["compressed"]),
                u(&c["zero_allocated"]),
                u(&c["zero"]),
                match u(&c["corrupt"]) {
                    0 => String::new(),
                    n => format!("; {n} corrupt entries (`qemu-img check`)"),
                }
            ),
        );
        if u(&v["snapshots"]) > 0 {
            line("snapshots", format!("{} internal", u(&v["snapshots"])));
        }
        let mut flags = Vec::new();
        if v["corrupt"].as_bool() == Some(true) {
            flags.push("corrupt");
        }
        if v["dirty"].as_bool() == Some(true) {
            flags.push("dirty (not closed cleanly, lazy refcounts)");
        }
        if !flags.is_empty() {
            line("marked", flags.join(", "));
        }
        if let Some(why) = v["writable"].as_str() {
            line("vblk serves it", format!("read-only only: {why}"));
        }
        match v["backing_chain"].as_array() {
            Some(chain) => {
                let levels: Vec<String> = chain
                    .iter()
                    .map(|l| {
                        format!(
                            "{} ({}, {})",
                            l["path"].as_str().unwrap_or("?"),
                            l["format"].as_str().unwrap_or("?"),
                            crate::disk::size_text(u(&l["virtual_size"]))
                        )
                    })
                    .collect();
                line("backing chain", levels.join(" over "));
            }
            None => match v["backing_file"].as_str() {
                Some(name) => line(
                    "backing file",
                    format!(
                        "{name:?}{} (not opened: give the chain with --backing, as vblk serve takes it)",
                        v["backing_format"]
                            .as_str()
                            .map(|f| format!(", format {f}"))
                            .unwrap_or_default()
                    ),
                ),
                None => line("backing file", "none".into()),
            },
        }
    }
    s
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// The text report.
pub fn render(i: &DiskInfo) -> String {
    let mut s = String::new();
    let mut line = |k: &str, v: String| s.push_str(&format!("{k:<22} {v}\n"));
    line("socket", i.socket.clone());
    line("serial", format!("{:?}", i.serial));
    line(
        "capacity",
        format!(
            "{} bytes ({} sectors of 512)",
            i.capacity_bytes, i.capacity_sectors
        ),
    );
    line("logical block size", i.logical_block_size.to_string());
    line("read-only", yes(i.read_only).into());
    line(
        "write cache",
        if i.write_cache {
            "writeback"
        } else {
            "writethrough"
        }
        .into(),
    );
    line("flush", yes(i.flush).into());
    line(
        "discard",
        if i.discard {
            format!("yes, up to {} sectors", i.max_discard_sectors)
        } else {
            "no".into()
        },
    );
    line(
        "write zeroes",
        if i.write_zeroes {
            format!(
                "yes, up to {} sectors{}",
                i.max_write_zeroes_sectors,
                if i.write_zeroes_may_unmap {
                    ", may unmap"
                } else {
                    ""
                }
            )
        } else {
            "no".into()
        },
    );
    line("seg_max", i.seg_max.to_string());
    line("size_max", i.size_max.to_string());
    line(
        "queues",
        format!(
            "{} offered, {} attached, {} entries each",
            i.device_queues, i.num_queues, i.queue_size
        ),
    );
    line("indirect descriptors", yes(i.indirect).into());
    line("event index", yes(i.event_idx).into());
    line(
        "device features",
        format!("{:#x} {}", i.device_features, i.feature_names.join(" ")),
    );
    line(
        "protocol features",
        format!(
            "{:#x} {}",
            i.protocol_features,
            i.protocol_feature_names.join(" ")
        ),
    );
    s
}
