//! qcow2 images served by `vblk serve --format qcow2 --read-only`: a frontend (vblk's
//! driver) reads what `qemu-img convert` reads from a qcow2 over a smaller raw backing
//! file, writes are refused, `vblk stats` shows the format and the chain; a Linux guest
//! (QEMU, TCG) sees a read-only disk whose bytes hash as QEMU's do, through two queues;
//! an image whose backing file the command line does not name is refused with the way out;
//! a writable qcow2 killed with SIGKILL ten times under allocating writes keeps every write
//! it acknowledged, and `qemu-img check` finds no corruption each time (leaked clusters
//! only: the clusters counted ahead of their use that a crash leaves unused); two daemons
//! share one base read-only, which QEMU's locks keep it from writing meanwhile.

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

use support::util::qemu_tool as tool;

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
        text.contains("image: qcow2 version 3, clusters of 64.0 KiB")
            && text.contains(&format!("backing chain: {} (raw)", base.display())),
        "{text}"
    );
}

/// A chain three qcow2 images deep over a raw file, each level with its own quarter of
/// the disk, served on io_uring with the default queue size: each level's engines get
/// room for the pieces of the level above, which must not multiply down the chain (an
/// io_uring of 32768 entries failed to set up, and no frontend could start a queue).
#[test]
fn a_chain_of_three_qcow2_images_reads_as_qemu_reads_it() {
    let dir = temp_dir("qcow2-chain3");
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "8M"]);
    tool(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x41 0 8M", "base.raw"],
    );
    let mut prev = ("base.raw", "raw");
    for (name, at, pattern) in [
        ("l1.qcow2", "4M", "0x42"),
        ("l2.qcow2", "2M", "0x43"),
        ("top.qcow2", "0", "0x44"),
    ] {
        tool(
            d,
            "qemu-img",
            &[
                "create", "-f", "qcow2", "-b", prev.0, "-F", prev.1, name, "8M",
            ],
        );
        let cmd = format!("write -P {pattern} {at} 2M");
        tool(d, "qemu-io", &["-f", "qcow2", "-c", &cmd, name]);
        prev = (name, "qcow2");
    }
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "top.qcow2", "want.raw"],
    );
    let want = fs::read(d.join("want.raw")).unwrap();
    let path = |f: &str| d.join(f).to_str().unwrap().to_owned();
    let mut daemon = Daemon::start(
        Backend::Vblk,
        "vblk",
        &Export::new(d.join("top.qcow2"), 1).read_only().args(&[
            "--format",
            "qcow2",
            "--engine",
            "io_uring",
            "--backing",
            &path("l2.qcow2"),
            "--backing",
            &path("l1.qcow2"),
            "--backing",
            &format!("{},format=raw", path("base.raw")),
        ]),
        &d.join("vblk.sock"),
        &d.join("vblk.log"),
    );
    let sock = daemon.socket.clone();
    let got = within(Duration::from_secs(60), "reading the chain", move || {
        let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        let mut got = vec![0u8; 8 << 20];
        for (i, chunk) in got.chunks_mut(256 << 10).enumerate() {
            q.read_at((i as u64) * (256 << 10), chunk).unwrap();
        }
        got
    });
    if let Some(at) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "byte {at} reads {:#x} through vblk, {:#x} through QEMU",
            got[at], want[at]
        );
    }
    daemon.assert_running("serving a chain of three qcow2 images");
}

#[test]
fn a_backing_file_the_command_line_does_not_name_is_not_opened() {
    let dir = temp_dir("qcow2");
    let d = dir.path();
    images(d);
    // `vblk serve` of top.qcow2, read-only, with `extra` flags: its error (it must fail).
    let refused = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
        let sock = d.join("x.sock");
        cmd.args(["serve", "--socket-path", sock.to_str().unwrap()])
            .args(["--format", "qcow2", "--read-only"])
            .args(extra)
            .args(["--blk-file", d.join("top.qcow2").to_str().unwrap()]);
        let out = run_to_exit(cmd, Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "served: {err}");
        err
    };
    let err = refused(&[]);
    assert!(
        err.contains("names the backing file \"base.raw\" (format raw)")
            && err.contains("add --backing PATH"),
        "{err}"
    );
    // A format= that contradicts the header's record is refused: the guest would read
    // the base through the wrong format.
    let backing = format!("{},format=qcow2", d.join("base.raw").display());
    let err = refused(&["--backing", &backing]);
    assert!(
        err.contains("its header records the backing format raw")
            && err.contains("format=qcow2 says otherwise"),
        "{err}"
    );
}

/// `vblk info --disk` shows an image's format, size, allocation (as `qemu-img check`
/// counts it) and backing file; with --backing, the chain vblk would serve.
#[test]
fn info_shows_the_format_the_allocation_and_the_chain() {
    let dir = temp_dir("qcow2-info");
    let d = dir.path();
    images(d);
    // A written cluster zeroed in place: it keeps its host cluster (allocated for QEMU).
    tool(
        d,
        "qemu-io",
        &["-f", "qcow2", "-c", "write -z 1M 64k", "top.qcow2"],
    );
    let info = |extra: &[&str]| -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
            .args([
                "info",
                "--json",
                "--disk",
                d.join("top.qcow2").to_str().unwrap(),
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let v = info(&[]);
    assert_eq!(v["format"], "qcow2");
    assert_eq!(v["virtual_size"], 32 << 20);
    assert_eq!(v["backing_file"], "base.raw");
    assert_eq!(v["backing_format"], "raw");
    // qemu-img check: "N/M = P% allocated".
    let (_, text) = qemu_img_check(d, "top.qcow2");
    let counts = text
        .lines()
        .find_map(|l| l.split_once(" = ").map(|(c, _)| c.to_owned()))
        .and_then(|c| {
            let (n, m) = c.split_once('/')?;
            Some((n.trim().parse::<u64>().ok()?, m.trim().parse::<u64>().ok()?))
        })
        .unwrap_or_else(|| panic!("no allocation in qemu-img check's output: {text}"));
    let c = &v["clusters"];
    let used = c["data"].as_u64().unwrap()
        + c["compressed"].as_u64().unwrap()
        + c["zero_allocated"].as_u64().unwrap();
    assert!(c["zero_allocated"].as_u64().unwrap() > 0, "{v}");
    assert_eq!((used, c["total"].as_u64().unwrap()), counts, "{v}");
    assert!(
        c["zero"].as_u64().unwrap() > 0,
        "the 1 MiB written as zeroes: {v}"
    );
    let base = d.join("base.raw");
    let v = info(&["--backing", base.to_str().unwrap()]);
    assert_eq!(v["backing_chain"][0]["format"], "raw", "{v}");
    assert_eq!(v["backing_chain"][0]["virtual_size"], 16 << 20, "{v}");
    assert_eq!(v["writable"], true, "{v}");
    // What keeps vblk from writing it is shown, as qemu-img info shows it (it was not).
    tool(d, "qemu-img", &["snapshot", "-c", "s1", "top.qcow2"]);
    let v = info(&[]);
    assert_eq!(v["snapshots"], 1, "{v}");
    assert!(
        v["writable"]
            .as_str()
            .is_some_and(|w| w.contains("1 internal snapshots")),
        "{v}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["info", "--disk", d.join("top.qcow2").to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("snapshots              1 internal")
            && text.contains(
                "vblk serves it         read-only only: the image has 1 internal snapshots"
            ),
        "{text}"
    );
}

/// `vblk disk add` of a qcow2 over a backing file, to a confined daemon (Landlock: it
/// can open no file): the client opens the chain and hands it over with the image, and
/// the disk reads as QEMU reads the chain. (The daemon opened the backing file itself,
/// which its sandbox refused.)
#[test]
fn a_qcow2_chain_added_live_is_opened_by_the_client() {
    let dir = temp_dir("qcow2-add");
    let d = dir.path();
    let want = images(d);
    // The daemon's own directory: its sockets, not the images.
    let run = temp_dir("qcow2-add-run");
    let (first, ctl) = (run.path().join("first.sock"), run.path().join("ctl.sock"));
    let mut daemon = Daemon::start_vblk(
        "vblk",
        &[
            "--control-socket",
            ctl.to_str().unwrap(),
            "--socket-path",
            first.to_str().unwrap(),
            "--blk-file",
            "mem:1M",
        ],
        &first,
        &d.join("vblk.log"),
    );
    let sock = run.path().join("chain.sock");
    let spec = format!(
        "socket={},file={},format=qcow2,read-only=on,backing={}",
        sock.display(),
        d.join("top.qcow2").display(),
        d.join("base.raw").display()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["disk", "add", ctl.to_str().unwrap(), &spec])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "disk add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = within(Duration::from_secs(60), "reading the chain", move || {
        let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        let mut got = vec![0u8; 32 << 20];
        for (i, chunk) in got.chunks_mut(1 << 20).enumerate() {
            q.read_at((i as u64) << 20, chunk).unwrap();
        }
        got
    });
    assert!(
        got == want,
        "the chain added live does not read as QEMU reads it"
    );
    daemon.assert_running("serving a chain added live");
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

/// `qemu-img check`: its exit code and output. A daemon killed a moment ago may still
/// hold the image's locks: its open file lives on until the kernel has finished the
/// io_uring requests it had in flight. So a lock conflict is retried, for up to 10 s.
fn qemu_img_check(d: &Path, image: &str) -> (i32, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new("qemu-img")
            .args(["check", image])
            .current_dir(d)
            .output()
            .expect("qemu-img (qemu-utils)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if text.contains("Failed to get shared \"write\" lock")
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        return (out.status.code().unwrap_or(-1), text);
    }
}

/// Block `i` of round `r`: 4 KiB, each byte saying which.
fn block_data(r: u64, i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|k| (r * 31 + i * 7 + k / 512) as u8 | 1)
        .collect()
}

const BLOCK: u64 = 4096;
/// Blocks a round writes: 24 MiB of its own (384 fresh clusters of 64 KiB).
const ROUND_BLOCKS: u64 = 6144;

#[test]
fn kill_9_under_allocating_writes_loses_no_acknowledged_write_and_corrupts_nothing() {
    kill_9_under_allocating_writes("qcow2-kill", 65536);
}

/// The same with 512-byte clusters: the refcount table qemu-img made covers 8 MiB of
/// file, so the daemons grow it (and move it) while they are killed.
#[test]
fn kill_9_while_the_refcount_table_grows_loses_nothing_and_corrupts_nothing() {
    kill_9_under_allocating_writes("qcow2-kill-512", 512);
}

fn kill_9_under_allocating_writes(name: &str, cluster: u64) {
    let dir = temp_dir(name);
    let d = dir.path();
    images(d);
    let base = d.join("base.raw");
    let opts = format!("cluster_size={cluster}");
    tool(
        d,
        "qemu-img",
        &[
            "create", "-f", "qcow2", "-o", &opts, "-b", "base.raw", "-F", "raw", "k.qcow2", "256M",
        ],
    );
    let sock = d.join("vblk.sock");
    let args = |sock: &Path| {
        vec![
            "--socket-path".to_owned(),
            sock.display().to_string(),
            "--format".into(),
            "qcow2".into(),
            "--backing".into(),
            base.display().to_string(),
            "--blk-file".into(),
            d.join("k.qcow2").display().to_string(),
        ]
    };
    // Round r writes 4 KiB blocks over its own 24 MiB of the disk (fresh clusters: the
    // first write to each allocates, over the backing file or past its end), in a
    // shuffled order, flushing after every 16th; it is killed while it writes. Every
    // write vblk acknowledged must be there after the restart, flushed or not: a killed
    // process loses nothing it wrote into the file, and vblk writes a new mapping there
    // before it acknowledges the write.
    let mut acked: Vec<(u64, u64, u64)> = Vec::new();
    for r in 0..10u64 {
        let a = args(&sock);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let mut daemon = Daemon::start_vblk("vblk", &a, &sock, &d.join(format!("vblk{r}.log")));
        let s = sock.clone();
        let writer = std::thread::spawn(move || {
            let mut done = Vec::new();
            let Ok(disk) = Disk::attach(&s, &DiskOptions::default()) else {
                return done;
            };
            let Some(mut q) = disk.take_queue(0) else {
                return done;
            };
            let mut order: Vec<u64> = (0..ROUND_BLOCKS).collect();
            let mut x = r * 2654435761 + 1;
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            for (n, &i) in order.iter().enumerate() {
                let at = (r * ROUND_BLOCKS + i) * BLOCK;
                if q.write_at(at, &block_data(r, i)).is_err() {
                    break;
                }
                done.push((r, i, at));
                if n % 16 == 15 && q.flush_sync().is_err() {
                    break;
                }
            }
            done
        });
        std::thread::sleep(Duration::from_millis(200 + 60 * r));
        daemon.kill();
        let got = writer.join().unwrap();
        eprintln!(
            "round {r}: {} of {ROUND_BLOCKS} writes acknowledged before the kill",
            got.len()
        );
        assert!(
            (got.len() as u64) < ROUND_BLOCKS,
            "round {r}: every write was done before the kill: it did not kill under load"
        );
        acked.extend(got);
        let (code, text) = qemu_img_check(d, "k.qcow2");
        assert!(
            (code == 0 || code == 3) && !text.contains("ERROR"),
            "round {r}: qemu-img check after kill -9 exited {code}:\n{text}"
        );
        eprintln!("round {r}: qemu-img check exit {code}");
        // Each kill leaks at most what the batches had not handed out (a sixteenth of the
        // 256 MiB disk, the cap on a disk this small) and what the write in flight had
        // been handed but not yet mapped: its data clusters (eight of 512 bytes for 4 KiB)
        // and a new L2 table. This writer has one write in flight. One bound per round.
        let leaked: u64 = text
            .split_once(" leaked clusters were found")
            .and_then(|(before, _)| before.rsplit(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(
            leaked * cluster <= (r + 1) * ((16 << 20) + (BLOCK.div_ceil(cluster) + 1) * cluster),
            "round {r}: {leaked} clusters of {cluster} bytes leaked after {} kills:\n{text}",
            r + 1
        );
    }
    assert!(
        !acked.is_empty(),
        "no write was ever acknowledged before a kill"
    );
    // Every acknowledged write is in the image, as QEMU reads it and as vblk serves it again.
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "k.qcow2", "after.raw"],
    );
    let after = fs::read(d.join("after.raw")).unwrap();
    for &(r, i, at) in &acked {
        assert!(
            after[at as usize..(at + BLOCK) as usize] == block_data(r, i)[..],
            "round {r}, block {i} at {at}: acknowledged before the kill, not in the image"
        );
    }
    let a = args(&sock);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let daemon = Daemon::start_vblk("vblk", &a, &sock, &d.join("vblk-final.log"));
    let s = daemon.socket.clone();
    let f = acked.clone();
    within(
        Duration::from_secs(60),
        "reading the acknowledged writes",
        move || {
            let disk = Disk::attach(&s, &DiskOptions::default()).unwrap();
            let mut q = disk.take_queue(0).unwrap();
            let mut buf = vec![0u8; BLOCK as usize];
            for &(r, i, at) in &f {
                q.read_at(at, &mut buf).unwrap();
                assert!(
                    buf == block_data(r, i),
                    "vblk reads round {r}, block {i} wrong"
                );
            }
        },
    );
    // A clean stop (SIGTERM) writes everything back: `qemu-img check` then finds nothing
    // but the leaks the kills left.
    let mut daemon = daemon;
    assert!(
        daemon.terminate(Duration::from_secs(30)),
        "vblk did not stop on SIGTERM"
    );
    let (code, text) = qemu_img_check(d, "k.qcow2");
    assert!(
        (code == 0 || code == 3) && !text.contains("ERROR"),
        "after a clean stop: qemu-img check exited {code}:\n{text}"
    );
    eprintln!("after a clean stop: qemu-img check exit {code}: {text}");
}

#[test]
fn a_frontend_writes_a_qcow2_and_qemu_reads_what_it_wrote() {
    let dir = temp_dir("qcow2-write");
    let d = dir.path();
    let mut want = images(d);
    let base = d.join("base.raw");
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
            "--backing",
            base.to_str().unwrap(),
            "--blk-file",
            d.join("top.qcow2").to_str().unwrap(),
            "--control-socket",
            d.join("ctl.sock").to_str().unwrap(),
        ],
        &sock,
        &d.join("vblk.log"),
    );
    let s = daemon.socket.clone();
    // Writes over the backing file, over the image's own clusters, over zero clusters,
    // across clusters, and a discard; on two queues.
    let writes: Vec<(u64, Vec<u8>)> = vec![
        (512, vec![0x71; 4096]),
        (2 << 20, vec![0x72; 200 << 10]),
        ((8 << 20) + 4096, vec![0x73; 8192]),
        ((16 << 20) - 4096, vec![0x74; 16384]),
        ((31 << 20) + 65536, vec![0x75; 65536]),
    ];
    for (at, data) in &writes {
        want[*at as usize..*at as usize + data.len()].copy_from_slice(data);
    }
    want[(20 << 20)..(21 << 20)].fill(0);
    let w = writes.clone();
    within(Duration::from_secs(60), "writing", move || {
        let disk = Disk::attach(&s, &DiskOptions::default()).unwrap();
        let mut q0 = disk.take_queue(0).unwrap();
        let mut q1 = disk.take_queue(1).unwrap();
        for (n, (at, data)) in w.iter().enumerate() {
            let q = if n % 2 == 0 { &mut q0 } else { &mut q1 };
            q.write_at(*at, data).unwrap();
        }
        q1.discard_sync(20 << 20, 1 << 20).unwrap();
        q0.flush_sync().unwrap();
    });
    // The statistics: writable, the clusters the writes allocated (over the backing
    // file at 512, the zero cluster at 8 MiB, unallocated at 31 MiB; the others are the
    // image's own clusters), the FLUSH's writeback.
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["stats", d.join("ctl.sock").to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let image = &v["image"];
    assert_eq!(image["read_only"], false, "{v}");
    assert_eq!(image["clusters_allocated"], 3, "{v}");
    assert!(image["writebacks"].as_u64() >= Some(1), "{v}");
    assert_eq!(image["cache_bytes"], 8 << 20, "{v}");
    let mut daemon = daemon;
    assert!(
        daemon.terminate(Duration::from_secs(30)),
        "vblk did not stop on SIGTERM"
    );
    let (code, text) = qemu_img_check(d, "top.qcow2");
    assert!(code == 0 && text.contains("No errors were found"), "{text}");
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "top.qcow2", "after.raw"],
    );
    let after = fs::read(d.join("after.raw")).unwrap();
    if let Some(at) = (0..after.len()).find(|&i| after[i] != want[i]) {
        panic!(
            "byte {at}: QEMU reads {:#x}, vblk was given {:#x}",
            after[at], want[at]
        );
    }
}

/// One base shared read-only by two daemons, each serving its own qcow2 image over it:
/// both start (their locks on the base let readers share it), QEMU can read the base
/// beside them but cannot open it for writing while they run (qemu-io names the "write"
/// lock they refuse to share), and can once they are gone.
#[test]
fn two_daemons_share_a_base_that_qemu_cannot_write_meanwhile() {
    let dir = temp_dir("qcow2-shared-base");
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "8M"]);
    for top in ["a.qcow2", "b.qcow2"] {
        tool(
            d,
            "qemu-img",
            &[
                "create", "-f", "qcow2", "-b", "base.raw", "-F", "raw", top, "8M",
            ],
        );
    }
    let base = d.join("base.raw");
    let start = |name: &str| {
        let sock = d.join(format!("{name}.sock"));
        let top = d.join(format!("{name}.qcow2"));
        let args = [
            "--socket-path",
            sock.to_str().unwrap(),
            "--format",
            "qcow2",
            "--backing",
            base.to_str().unwrap(),
            "--blk-file",
            top.to_str().unwrap(),
        ];
        Daemon::start_vblk(name, &args, &sock, &d.join(format!("{name}.log")))
    };
    let mut a = start("a");
    let mut b = start("b");
    a.assert_running("serving a.qcow2 over the shared base");
    b.assert_running("serving b.qcow2 over the same base");
    let qemu_io = |args: &[&str]| {
        Command::new("qemu-io")
            .args(args)
            .arg(&base)
            .output()
            .expect("qemu-io (qemu-utils)")
    };
    let write = qemu_io(&["-f", "raw", "-c", "write 0 4k"]);
    let err = String::from_utf8_lossy(&write.stderr);
    assert!(
        !write.status.success() && err.contains("Failed to get \"write\" lock"),
        "QEMU wrote the base two daemons read: {write:?}"
    );
    let read = qemu_io(&["-r", "-f", "raw", "-c", "read 0 4k"]);
    assert!(
        read.status.success(),
        "QEMU could not read the base: {read:?}"
    );
    drop(a);
    drop(b);
    let write = qemu_io(&["-f", "raw", "-c", "write 0 4k"]);
    assert!(
        write.status.success(),
        "QEMU could not write the base after the daemons ended: {write:?}"
    );
}
