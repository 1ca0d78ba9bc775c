//! qcow2 images served by `vblk serve --format qcow2 --read-only`: a frontend (vblk's
//! driver) reads what `qemu-img convert` reads from a qcow2 over a smaller raw backing
//! file, writes are refused, `vblk stats` shows the format and the chain; a Linux guest
//! (QEMU, TCG) sees a read-only disk whose bytes hash as QEMU's do, through two queues;
//! an image whose backing file the command line does not name is refused with the way out.

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use driver::{Disk, DiskOptions};
use serde_json::Value;
use support::daemon::{Backend, Daemon, Export};
use support::guest::Guest;
use support::util::{run_to_exit, temp_dir, within};

fn tool(dir: &Path, program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{program} could not run ({e}): install qemu-utils (`apt-get install qemu-utils`)"
            )
        });
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// top.qcow2 (32 MiB, written here and there, some of it compressed-free zeroes) over
/// base.raw (16 MiB of a pattern); returns what QEMU reads from the top.
fn images(d: &Path) -> Vec<u8> {
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "16M"]);
    tool(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x61 0 16M", "base.raw"],
    );
    tool(
        d,
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "top.qcow2",
            "32M",
        ],
    );
    for cmd in [
        "write -P 0x62 1M 3M",
        "write -z 8M 1M",
        "write -P 0x63 15M 2M",
        "write -P 0x64 30M 4k",
    ] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "top.qcow2"]);
    }
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "top.qcow2", "want.raw"],
    );
    fs::read(d.join("want.raw")).unwrap()
}

#[test]
fn a_qcow2_chain_is_served_read_only_as_qemu_reads_it() {
    let dir = temp_dir("qcow2");
    let d = dir.path();
    let want = images(d);
    let ctl = d.join("ctl.sock");
    let base = d.join("base.raw");
    let mut daemon = Daemon::start(
        Backend::Vblk,
        "vblk",
        &Export::new(d.join("top.qcow2"), 2).read_only().args(&[
            "--format",
            "qcow2",
            "--backing",
            base.to_str().unwrap(),
            "--control-socket",
            ctl.to_str().unwrap(),
        ]),
        &d.join("vblk.sock"),
        &d.join("vblk.log"),
    );
    daemon.assert_running("serving a qcow2 image");
    let sock = daemon.socket.clone();
    let (got, write) = within(Duration::from_secs(120), "reading the disk", move || {
        let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
        assert_eq!(disk.capacity_bytes(), 32 << 20, "the virtual size");
        let mut q = disk.take_queue(0).unwrap();
        let mut got = vec![0u8; 32 << 20];
        for (i, chunk) in got.chunks_mut(1 << 20).enumerate() {
            q.read_at((i as u64) << 20, chunk).unwrap();
        }
        let write = q.write_at(0, &[0u8; 4096]).map(|_| ());
        (got, write)
    });
    if let Some(at) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "byte {at} reads {:#x} through vblk, {:#x} through QEMU",
            got[at], want[at]
        );
    }
    assert!(write.is_err(), "a write to a read-only qcow2 was accepted");
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["stats", ctl.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let disk = &v["disks"][0];
    let image = if disk.is_null() {
        &v["image"]
    } else {
        &disk["image"]
    };
    assert_eq!(image["format"], "qcow2", "{v}");
    assert_eq!(image["virtual_size"], 32 << 20);
    assert_eq!(image["backing"][0]["path"], base.to_str().unwrap());
    assert_eq!(image["backing"][0]["format"], "raw");
    let text = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["stats", ctl.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("image: qcow2 version 3, clusters of 64 KiB")
            && text.contains(&format!("backing chain: {} (raw)", base.display())),
        "{text}"
    );
}

#[test]
fn a_backing_file_the_command_line_does_not_name_is_not_opened() {
    let dir = temp_dir("qcow2");
    let d = dir.path();
    images(d);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.args([
        "serve",
        "--socket-path",
        d.join("x.sock").to_str().unwrap(),
        "--format",
        "qcow2",
        "--read-only",
        "--blk-file",
        d.join("top.qcow2").to_str().unwrap(),
    ]);
    let out = run_to_exit(cmd, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served: {err}");
    assert!(
        err.contains("names the backing file \"base.raw\" (format raw)")
            && err.contains("add --backing PATH"),
        "{err}"
    );
    // Writable: not yet, with the way out.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.args([
        "serve",
        "--socket-path",
        d.join("y.sock").to_str().unwrap(),
        "--format",
        "qcow2",
        "--backing",
        d.join("base.raw").to_str().unwrap(),
        "--blk-file",
        d.join("top.qcow2").to_str().unwrap(),
    ]);
    let out = run_to_exit(cmd, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served writable: {err}");
    assert!(err.contains("read-only for now"), "{err}");
}

#[test]
fn a_guest_reads_a_qcow2_chain_as_qemu_reads_it() {
    let dir = temp_dir("qcow2-guest");
    let d = dir.path();
    images(d);
    let out = Command::new("md5sum")
        .arg(d.join("want.raw"))
        .output()
        .expect("md5sum (coreutils)");
    let md5 = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let base = d.join("base.raw");
    let top = d.join("top.qcow2");
    let sock = d.join("vblk.sock");
    let daemon = Daemon::start_vblk(
        "vblk",
        &[
            "--socket-path",
            sock.to_str().unwrap(),
            "--num-queues",
            "2",
            "--format",
            "qcow2",
            "--read-only",
            "--backing",
            base.to_str().unwrap(),
            "--blk-file",
            top.to_str().unwrap(),
        ],
        &sock,
        &d.join("vblk.log"),
    );
    let script = format!(
        r#"
check_eq read-only "$(cat /sys/block/vda/ro)" 1
check_eq size "$(cat /sys/block/vda/size)" {sectors}
check_eq md5 "$(md5sum /dev/vda | cut -d' ' -f1)" {md5}
echo 3 > /proc/sys/vm/drop_caches
check_eq md5-again "$(md5sum /dev/vda | cut -d' ' -f1)" {md5}
check_fails write dd if=/dev/zero of=/dev/vda bs=4096 count=1 conv=fsync
"#,
        sectors = (32 << 20) / 512,
    );
    let boot = Guest::new("qcow2-chain")
        .disk(&daemon.socket, 2)
        .attach_log("vblk serve", &daemon.log)
        .watch("vblk serve", daemon.pid())
        .script(script)
        .boot();
    boot.assert_ok(&["read-only", "size", "md5", "md5-again", "write"]);
}
