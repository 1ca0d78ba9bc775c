//! `vblk info`: attach to a vhost-user-blk device and print what it offers.

use std::error::Error;
use std::path::PathBuf;

use clap::Args;
use driver::{Disk, DiskInfo, DiskOptions};

/// Attach to a vhost-user-blk device (vblk serve, qemu-storage-daemon, SPDK, ...) and print
/// its capacity, block size, features, limits, queues and serial.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// The device's vhost-user socket.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `vblk info`.
pub fn run(args: InfoArgs) -> Result<(), Box<dyn Error>> {
    let disk = Disk::attach(&args.socket, &DiskOptions::default())?;
    let info = disk.info();
    if args.json {
        println!("{}", serde_json::to_string_pretty(info)?);
    } else {
        print!("{}", render(info));
    }
    Ok(())
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
