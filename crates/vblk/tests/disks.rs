//! One daemon, many disks, with the real binary: disks on the command line and in a
//! config file, added and removed while it runs (`vblk disk`), a forced removal under
//! load that loses no acknowledged write, one disk's slow server or stuck frontend
//! stalling no other, a config file reloaded. QoS limits: tests/qos.rs.

mod support;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};
use serde_json::Value;
use support::cli::{
    bench, config, disk_table, ok, rate_within_2pct, s, saturate, serial, stats, vblk,
};
use support::daemon::Daemon;
use support::nbdkit::Nbdkit;
use support::util::{temp_dir, within};

const MIB: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(300);

/// Disks given with --disk (and defaults outside it), listed, their statistics apart;
/// a disk added live is served at once; a disk attached to a frontend is not removed
/// unless forced; a removed disk's socket is gone.
#[test]
fn disks_come_and_go_while_the_daemon_runs() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-live");
        // The disk added later lives in a directory the daemon's sandbox does not cover
        // (its own sockets' directories are those it can remove sockets from).
        let later = temp_dir("disks-later");
        let (a, b, c) = (
            dir.path().join("a.sock"),
            dir.path().join("b.sock"),
            later.path().join("c.sock"),
        );
        let ctl = dir.path().join("ctl.sock");
        let img = dir.path().join("c.img");
        fs::File::create(&img).unwrap().set_len(16 * MIB).unwrap();
        // A group the sockets can be given: any as root (group `daemon`), else one of
        // this user's (its own effective group, by number).
        // SAFETY: geteuid and getegid take nothing and cannot fail.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let group = if euid == 0 {
            "daemon".to_string()
        } else {
            egid.to_string()
        };
        let d = Daemon::start_vblk(
            "vblk",
            &[
                "--threads",
                "2",
                "--socket-group",
                &group,
                "--control-socket",
                s(&ctl),
                "--num-queues",
                "2",
                "--disk",
                &format!("socket={},file=mem:16M", s(&a)),
                "--disk",
                &format!("id=second,socket={},file=null:1G,num-queues=1", s(&b)),
            ],
            &b,
            &dir.path().join("vblk.log"),
        );
        // --socket-group covers the disks' sockets: mode 0660, that group. Not the
        // control socket: whoever reaches it manages every disk, and the frontends'
        // group (QEMU's) must not (it did: any QEMU could shrink another VM's disk).
        let access = |p: &std::path::Path| {
            let m = fs::metadata(p).unwrap();
            (m.permissions().mode() & 0o777, m.gid())
        };
        let daemon_gid = access(&a).1;
        if euid == 0 {
            assert_ne!(daemon_gid, 0, "the disk's socket is in group daemon");
        } else {
            assert_eq!(daemon_gid, egid, "the disk's socket is in group {group}");
        }
        for sock in [&a, &b] {
            assert_eq!(access(sock), (0o660, daemon_gid), "{}", sock.display());
        }
        assert_eq!(
            access(&ctl).0,
            0o600,
            "the control socket is the daemon's user's"
        );
        let list = ok(&["disk", "list", s(&ctl)]);
        assert!(list.contains("a ") && list.contains("second "), "{list}");
        assert!(
            list.contains("16.0 MiB") && list.contains("1.0 GiB"),
            "{list}"
        );
        let v: Value = serde_json::from_str(&ok(&["disk", "list", s(&ctl), "--json"])).unwrap();
        assert_eq!(
            v["disks"][0]["num_queues"], 2,
            "a default given outside --disk"
        );
        assert_eq!(v["disks"][1]["num_queues"], 1, "a key inside --disk wins");
        // I/O on one disk shows in its statistics only.
        let disk = Disk::attach(&a, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        q.write_at(0, &[7u8; 4096]).unwrap();
        let st = stats(&ctl);
        let ios = |i: usize| {
            st["disks"][i]["queues"]
                .as_array()
                .map(|qs| {
                    qs.iter()
                        .map(|q| q["ops"]["write"]["ios"].as_u64().unwrap())
                        .sum::<u64>()
                })
                .unwrap_or(0)
        };
        assert_eq!((ios(0), ios(1)), (1, 0), "{st}");
        let one: Value =
            serde_json::from_str(&ok(&["stats", s(&ctl), "--disk", "second", "--json"])).unwrap();
        assert_eq!(one["id"], "second");
        // Attached: refused, then forced.
        let (refused, why) = vblk(&["disk", "remove", s(&ctl), "a"]);
        assert!(!refused && why.contains("attached"), "{why}");
        ok(&["disk", "remove", s(&ctl), "a", "--force"]);
        assert!(!a.exists(), "the removed disk's socket is gone");
        assert!(
            q.write_at(0, &[8u8; 4096]).is_err(),
            "the frontend lost the disk"
        );
        drop(q);
        drop(disk);
        // Added live: the image is opened by `vblk disk add`, not by the daemon. (Well
        // after the daemon started: its statistics count from when it was added.)
        std::thread::sleep(Duration::from_millis(1500));
        let added = ok(&[
            "disk",
            "add",
            s(&ctl),
            &format!("socket={},file={},format=raw,num-queues=1", s(&c), s(&img)),
        ]);
        assert!(added.contains("disk c added"), "{added}");
        assert_eq!(
            access(&c),
            (0o660, daemon_gid),
            "a disk added without --socket-group takes the daemon's"
        );
        let text = ok(&["stats", s(&ctl), "--disk", "c"]);
        let up: f64 = text
            .split_once(", up ")
            .and_then(|(_, r)| r.split_once(" s,"))
            .and_then(|(x, _)| x.parse().ok())
            .unwrap_or_else(|| panic!("no uptime in {text}"));
        let daemon_up = stats(&ctl)["uptime_ns"].as_u64().unwrap() as f64 / 1e9;
        assert!(
            up + 1.0 < daemon_up,
            "disk c shows the daemon's uptime ({up} s, the daemon's {daemon_up} s): {text}"
        );
        assert!(text.contains("(16.0 MiB)"), "{text}");
        // The same image again, as another disk: refused, naming the disk that has it.
        let (bad, why) = vblk(&[
            "disk",
            "add",
            s(&ctl),
            &format!(
                "socket={},file={},format=raw",
                s(&later.path().join("again.sock")),
                s(&img)
            ),
        ]);
        assert!(
            !bad && why.contains("disk \"c\" serves this image already"),
            "{why}"
        );
        // Two read-only disks may share an image (their locks do).
        let base = later.path().join("base.img");
        fs::File::create(&base).unwrap().set_len(MIB).unwrap();
        for name in ["ro1", "ro2"] {
            let spec = format!(
                "socket={},file={},format=raw,read-only=on",
                s(&later.path().join(format!("{name}.sock"))),
                s(&base)
            );
            ok(&["disk", "add", s(&ctl), &spec]);
        }
        for name in ["ro1", "ro2"] {
            ok(&["disk", "remove", s(&ctl), name]);
        }
        let disk = Disk::attach(&c, &DiskOptions::default()).unwrap();
        assert_eq!(disk.capacity_bytes(), 16 * MIB);
        let mut q = disk.take_queue(0).unwrap();
        q.write_at(MIB, &[9u8; 4096]).unwrap();
        q.flush_sync().unwrap();
        drop(q);
        drop(disk);
        let on_disk = fs::read(&img).unwrap();
        assert!(on_disk[MIB as usize..MIB as usize + 4096]
            .iter()
            .all(|&x| x == 9));
        // Its frontend gone, the disk lets the image go; a resize takes it back.
        let log = dir.path().join("vblk.log");
        let t0 = Instant::now();
        while !fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("disk c: no frontend: writes made durable")
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "disk c kept its image"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let said = ok(&["disk", "resize", s(&ctl), "c", "32M"]);
        assert!(said.contains("33554432 bytes"), "{said}");
        assert_eq!(fs::metadata(&img).unwrap().len(), 32 * MIB);
        // Detached: removed without --force, and its socket goes with it.
        let t0 = std::time::Instant::now();
        loop {
            let (done, why) = vblk(&["disk", "remove", s(&ctl), "c"]);
            if done {
                break;
            }
            assert!(
                why.contains("attached") && t0.elapsed() < Duration::from_secs(10),
                "{why}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(!c.exists(), "the removed disk's socket is gone");
        let (bad, why) = vblk(&["disk", "remove", s(&ctl), "nosuch"]);
        assert!(!bad && why.contains("no disk is named \"nosuch\""), "{why}");
        let why = add_refused(&ctl, &format!("socket={},file=null:1G,threads=2", s(&c)));
        assert!(why.contains("applies to the whole daemon"), "{why}");
        // A name already served is refused before the daemon takes the socket over.
        let why = add_refused(&ctl, &format!("socket={},file=null:1G,id=second", s(&c)));
        assert!(
            why.contains("a disk named \"second\" is served already"),
            "{why}"
        );
        assert!(!c.exists(), "the refused disk's socket is gone");
        // An NBD server on a TCP port the sandbox was not opened for: refused, naming
        // --nbd-ports (connecting anyway was a system call seccomp killed the daemon for).
        let why = add_refused(
            &ctl,
            &format!("socket={},file=nbd://127.0.0.1:10999/", s(&c)),
        );
        assert!(
            why.contains("--nbd-ports 10999") && why.contains("sandbox"),
            "{why}"
        );
        assert!(
            ok(&["disk", "list", s(&ctl)]).contains("second "),
            "the daemon lives"
        );
        // Settings given twice are refused, not the last one taken.
        let why = add_refused(
            &ctl,
            &format!("socket={},file=null:1G,num-queues=2,num-queues=3", s(&c)),
        );
        assert!(why.contains("num-queues is given twice"), "{why}");
        let (bad, why) = vblk(&[
            "disk",
            "set",
            s(&ctl),
            "second",
            "iops-total=5,throttle.iops-total=6",
        ]);
        assert!(
            !bad && why.contains("iops-total and throttle.iops-total are the same setting"),
            "{why}"
        );
        let (bad, why) = vblk(&["disk", "set", s(&ctl), "second", ""]);
        assert!(!bad && why.contains("nothing to set"), "{why}");
        drop(d);
        let log = fs::read_to_string(dir.path().join("vblk.log")).unwrap();
        assert!(!log.contains("no longer the one this daemon made"), "{log}");
    });
}

/// Three disks on one worker thread: one whose NBD server takes 10 s for a read, one whose
/// frontend sent half a message and went quiet, and one served normally. The third does a
/// thousand verified writes and reads while the slow read is still at its server, and the
/// quiet frontend's disk serves the next frontend once it is gone.
#[test]
fn a_slow_server_or_a_stuck_frontend_stalls_no_other_disk() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-apart");
        let nbd = Nbdkit::start(
            dir.path(),
            &["--filter=delay", "memory", "64M", "rdelay=10"],
        );
        let ctl = dir.path().join("ctl.sock");
        let (slow, fast, stuck) = (
            dir.path().join("slow.sock"),
            dir.path().join("fast.sock"),
            dir.path().join("stuck.sock"),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--threads",
                "1",
                "--num-queues",
                "1",
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!("socket={},file={}", s(&slow), nbd.uri()),
                "--disk",
                &format!("socket={},file=mem:16M", s(&fast)),
                "--disk",
                &format!("socket={},file=null:1G", s(&stuck)),
            ],
            &stuck,
            &dir.path().join("vblk.log"),
        );
        // Half a vhost-user header, then nothing.
        let mut quiet = std::os::unix::net::UnixStream::connect(&stuck).unwrap();
        std::io::Write::write_all(&mut quiet, &[1, 0, 0, 0]).unwrap();
        // A read the NBD server holds for 10 s: the thousand round trips below take two
        // wake-ups each, a few ms apiece on a loaded machine.
        let slow_done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (slow, done) = (slow.clone(), slow_done.clone());
            std::thread::spawn(move || {
                let disk = Disk::attach(&slow, &DiskOptions::default()).unwrap();
                let mut q = disk.take_queue(0).unwrap();
                let mut buf = vec![0u8; 4096];
                q.read_at(0, &mut buf).unwrap();
                done.store(true, Ordering::SeqCst);
            })
        };
        let in_flight = |id: &str| {
            let st = stats(&ctl);
            let disk = st["disks"]
                .as_array()
                .and_then(|d| d.iter().find(|d| d["id"] == id).cloned())
                .unwrap_or(Value::Null);
            disk["queues"][0]["in_flight"].as_u64().unwrap_or(0)
        };
        let t0 = Instant::now();
        while in_flight("slow") == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the slow read never reached the daemon"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let disk = Disk::attach(&fast, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        let mut back = vec![0u8; 4096];
        for i in 0..1000u64 {
            let block = vec![(i % 251) as u8; 4096];
            let at = (i % 4096) * 4096;
            q.write_at(at, &block).unwrap();
            q.read_at(at, &mut back).unwrap();
            assert_eq!(back, block, "block {i}");
        }
        assert!(
            !slow_done.load(Ordering::SeqCst) && in_flight("slow") == 1,
            "the slow read ended before the other disk's thousand requests did: this test \
             shows nothing (the server's delay is too short for this machine)"
        );
        drop(q);
        drop(disk);
        reader.join().unwrap();
        assert!(slow_done.load(Ordering::SeqCst));
        // The quiet frontend goes; the next one is served.
        drop(quiet);
        let next = Disk::attach(&stuck, &DiskOptions::default()).unwrap();
        let mut q = next.take_queue(0).unwrap();
        q.write_at(0, &[1u8; 4096]).unwrap();
    });
}

/// A disk removed by force while four queues write to it: every write acknowledged
/// before the removal is on the disk afterwards.
#[test]
fn a_forced_removal_under_load_loses_no_acknowledged_write() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-remove");
        let sock = dir.path().join("w.sock");
        let ctl = dir.path().join("ctl.sock");
        let img = dir.path().join("w.img");
        fs::File::create(&img).unwrap().set_len(128 * MIB).unwrap();
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!(
                    "socket={},file={},format=raw,num-queues=4",
                    s(&sock),
                    s(&img)
                ),
            ],
            &sock,
            &dir.path().join("vblk.log"),
        );
        let disk = Arc::new(
            Disk::attach(
                &sock,
                &DiskOptions {
                    num_queues: Some(4),
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicUsize::new(0));
        let writers: Vec<_> = (0..4u64)
            .map(|t| {
                let (disk, stop, written) = (disk.clone(), stop.clone(), written.clone());
                std::thread::spawn(move || {
                    let mut q = disk.take_queue(t as u16).unwrap();
                    let mut acked = Vec::new();
                    // Each queue writes its own 32 MiB, block by block, each block
                    // stamped with its number.
                    for i in 0..8192u64 {
                        if stop.load(Ordering::Relaxed) && i % 64 == 0 {
                            std::thread::yield_now();
                        }
                        let block = t * 8192 + i;
                        let data = [(block % 251) as u8 + 1; 4096];
                        if q.write_at(block * 4096, &data).is_err() {
                            break;
                        }
                        acked.push(block);
                        written.fetch_add(1, Ordering::Relaxed);
                    }
                    acked
                })
            })
            .collect();
        // Removed a sixteenth of the way through, whatever the machine's speed.
        let t0 = Instant::now();
        while written.load(Ordering::Relaxed) < 2048 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the writers did not get going: {} writes in 60 s",
                written.load(Ordering::Relaxed)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        ok(&["disk", "remove", s(&ctl), "w", "--force"]);
        stop.store(true, Ordering::Relaxed);
        let acked: Vec<u64> = writers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        assert!(
            !acked.is_empty(),
            "no write was acknowledged before the removal"
        );
        assert!(
            acked.len() < 4 * 8192,
            "all {} writes were acknowledged before the removal: it did not remove under \
             load, and this test shows nothing",
            acked.len()
        );
        let on_disk = fs::read(&img).unwrap();
        for block in &acked {
            let at = (*block * 4096) as usize;
            assert!(
                on_disk[at..at + 4096]
                    .iter()
                    .all(|&x| x == (*block % 251) as u8 + 1),
                "block {block} was acknowledged before the removal and is not on the disk"
            );
        }
        eprintln!("{} acknowledged writes all on the disk", acked.len());
    });
}

/// The control socket answers while a slow request is under way: statistics and the
/// list come at once while a forced removal waits 8 s for the disk's write in flight.
#[test]
fn the_control_socket_answers_during_a_slow_removal() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-slow-remove");
        let (x, y) = (dir.path().join("x.sock"), dir.path().join("y.sock"));
        let ctl = dir.path().join("ctl.sock");
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!("socket={},file=mem:16M,delay-every=1:8000:hold", s(&x)),
                "--disk",
                &format!("socket={},file=null:1G", s(&y)),
            ],
            &y,
            &dir.path().join("vblk.log"),
        );
        let disk = Disk::attach(&x, &DiskOptions::default()).unwrap();
        let writer = std::thread::spawn(move || {
            let mut q = disk.take_queue(0).unwrap();
            q.write_at(0, &[5u8; 4096])
        });
        // The write is held at the device; the removal waits for it.
        one_request_in_flight(&ctl);
        let ctl2 = ctl.clone();
        let removal =
            std::thread::spawn(move || vblk(&["disk", "remove", s(&ctl2), "x", "--force"]));
        // The removal is under way once x has left the list (it waits for the write
        // there): the list answers meanwhile, as do the statistics.
        let t0 = Instant::now();
        let list = loop {
            let list = ok(&["disk", "list", s(&ctl)]);
            if !list.contains("x ") {
                break list;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the removal never began: {list}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            !removal.is_finished(),
            "the removal did not wait for the write"
        );
        assert!(list.contains("y "), "{list}");
        let st = stats(&ctl);
        assert!(st["disks"].as_array().is_some(), "{st}");
        assert!(
            !removal.is_finished(),
            "statistics and the list answered only after the removal"
        );
        let (removed, why) = removal.join().unwrap();
        assert!(removed, "{why}");
        writer
            .join()
            .unwrap()
            .expect("the write in flight finished before the removal");
    });
}

/// A forced removal of a disk whose NBD server holds a write (for 60 s): the removal ends
/// after the drain timeout, and the frontend learns at once that the disk is gone (its
/// connection stayed open while the worker that held the write lived, so its requests
/// hung until the server answered).
#[test]
fn a_forced_removal_of_a_hung_disk_lets_its_frontend_go() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-hung");
        let nbd = Nbdkit::start(
            dir.path(),
            &["--filter=delay", "memory", "16M", "wdelay=60"],
        );
        let ctl = dir.path().join("ctl.sock");
        let (hung, other) = (dir.path().join("hung.sock"), dir.path().join("other.sock"));
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!(
                    "socket={},file={},num-queues=1,drain-timeout-secs=2",
                    s(&hung),
                    nbd.uri()
                ),
                "--disk",
                &format!("socket={},file=null:1G", s(&other)),
            ],
            &other,
            &dir.path().join("vblk.log"),
        );
        let writer = {
            let hung = hung.clone();
            std::thread::spawn(move || {
                let disk = Disk::attach(&hung, &DiskOptions::default()).unwrap();
                let mut q = disk.take_queue(0).unwrap();
                let r = q.write_at(0, &[1u8; 4096]);
                (r.is_ok(), Instant::now())
            })
        };
        one_request_in_flight(&ctl);
        ok(&["disk", "remove", s(&ctl), "hung", "--force"]);
        let removed = Instant::now();
        let (written, ended) = writer.join().unwrap();
        assert!(
            !written,
            "a write the server never answered was acknowledged"
        );
        let late = ended.saturating_duration_since(removed);
        assert!(
            late < Duration::from_secs(5),
            "the frontend learned {late:?} after the removal that its disk was gone"
        );
    });
}

/// `vblk disk sync` makes the daemon serve what its config file says: a disk added, one
/// removed, one's limits changed; nothing done twice.
#[test]
fn a_config_file_reloaded_adds_removes_and_relimits() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-sync");
        let ctl = dir.path().join("ctl.sock");
        let (a, b, c) = (
            dir.path().join("a.sock"),
            dir.path().join("b.sock"),
            dir.path().join("c.sock"),
        );
        let cfg = config(
            dir.path(),
            &ctl,
            &(disk_table(&a, "") + &disk_table(&b, "")),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &b,
            &dir.path().join("vblk.log"),
        );
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.trim().is_empty(), "nothing to do: {said}");
        config(
            dir.path(),
            &ctl,
            &(disk_table(&a, "throttle = { iops-total = 2000 }") + &disk_table(&c, "")),
        );
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.contains("disk b removed"), "{said}");
        assert!(said.contains("disk c added"), "{said}");
        assert!(said.contains("disk a: QoS set"), "{said}");
        assert!(c.exists() && !b.exists());
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rate_within_2pct("disk a after the reload", 2000.0, || bench(&a, &args).0);
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.trim().is_empty(), "nothing to do twice: {said}");
        // The file's groups: one changed, one new (with a disk moved into it), one that
        // loses its limits when the file no longer names it.
        let text = fs::read_to_string(&cfg).unwrap();
        let moved = text
            .replace("iops-total = 3000", "iops-total = 1500")
            .replace(&disk_table(&c, ""), &disk_table(&c, "group = \"h\""))
            + "\n[group.h]\niops-total = 300\n";
        fs::write(&cfg, &moved).unwrap();
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(
            said.contains("throttle group g: iops-total=1500")
                && said.contains("throttle group h: iops-total=300")
                && said.contains("disk c: QoS set"),
            "{said}"
        );
        let groups = || {
            let v: Value = serde_json::from_str(&ok(&["disk", "list", s(&ctl), "--json"])).unwrap();
            v["groups"].clone()
        };
        let g = groups();
        assert_eq!(g[0]["name"], "g", "{g}");
        assert_eq!(g[0]["throttle"], "iops-total=1500", "{g}");
        assert_eq!(g[1]["name"], "h", "{g}");
        assert_eq!(g[1]["throttle"], "iops-total=300", "{g}");
        assert_eq!(g[1]["members"][0], "c", "{g}");
        rate_within_2pct("disk c in group h", 300.0, || bench(&c, &args).0);
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.trim().is_empty(), "nothing to do again: {said}");
        fs::write(&cfg, text.replace("[group.g]\niops-total = 3000\n", "")).unwrap();
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(
            said.contains("throttle group g: none") && said.contains("disk c: QoS set"),
            "{said}"
        );
        let g = groups();
        assert_eq!(
            g[0]["throttle"], "none",
            "group g, no longer in the file: {g}"
        );
        assert_eq!(
            g.as_array().unwrap().len(),
            1,
            "group h went with its last disk: {g}"
        );
        // A file that names two disks alike is refused before anything changes, and a
        // change that needs the disk re-added names what changed.
        fs::write(
            &cfg,
            text.clone() + &disk_table(&dir.path().join("other").join("c.sock"), ""),
        )
        .unwrap();
        let (done, why) = vblk(&["disk", "sync", "--config", s(&cfg)]);
        assert!(!done && why.contains("two disks are named \"c\""), "{why}");
        fs::write(&cfg, text.replace("num-queues = 1\n", "num-queues = 2\n")).unwrap();
        let (done, why) = vblk(&["disk", "sync", "--config", s(&cfg)]);
        assert!(
            !done && why.contains("num-queues: 1 served, 2 in the file"),
            "{why}"
        );
    });
}

/// Wait until the first disk's first queue has one request in flight.
fn one_request_in_flight(ctl: &std::path::Path) {
    let t0 = Instant::now();
    while stats(ctl)["disks"][0]["queues"][0]["in_flight"].as_u64() != Some(1) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the write never arrived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `vblk disk add CTL SPEC`, which must be refused: what it said.
fn add_refused(ctl: &std::path::Path, spec: &str) -> String {
    let (added, why) = vblk(&["disk", "add", s(ctl), spec]);
    assert!(!added, "disk add {spec} was not refused: {why}");
    why
}

/// Clients that trickle their requests a byte at a time do not keep the control socket:
/// each request must arrive whole within its deadline (2 s), so once the sixteen
/// answering slots' tricklers are cut off the list answers, while they still trickle.
/// With a deadline per read, they held every slot for as long as they went on.
#[test]
fn clients_that_trickle_their_requests_do_not_keep_the_control_socket() {
    use std::io::Write as _;
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-trickle");
        let (x, ctl) = (dir.path().join("x.sock"), dir.path().join("ctl.sock"));
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!("socket={},file=null:1G", s(&x)),
            ],
            &x,
            &dir.path().join("vblk.log"),
        );
        let t0 = Instant::now();
        let tricklers: Vec<_> = (0..16)
            .map(|_| {
                let ctl = ctl.clone();
                std::thread::spawn(move || {
                    let mut c = std::os::unix::net::UnixStream::connect(&ctl).unwrap();
                    // A byte every 200 ms for 8 s (well under the 2 s per read that
                    // kept it), until the daemon cuts it off.
                    for b in br#"{"op":"list"                                         "#
                        .iter()
                        .take(40)
                    {
                        if c.write_all(&[*b]).is_err() {
                            return true;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    false
                })
            })
            .collect();
        // Past the deadline of every trickler's request (the last connected within a
        // second or so), long before they would stop on their own.
        std::thread::sleep(Duration::from_secs(4).saturating_sub(t0.elapsed()));
        let list = ok(&["disk", "list", s(&ctl)]);
        assert!(list.contains("x "), "{list}");
        let cut = tricklers
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|&c| c)
            .count();
        assert_eq!(cut, 16, "tricklers the daemon cut off");
    });
}

/// A daemon out of descriptors refuses the frontend that came then, and serves the next
/// once it has them again: running out in `accept` stopped the daemon, every disk with
/// it.
#[test]
fn a_daemon_out_of_descriptors_goes_on_serving() {
    use support::assets::require_programs;
    require_programs(&[("prlimit", "util-linux")]);
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-emfile");
        let x = dir.path().join("x.sock");
        let mut d = Daemon::start_vblk(
            "vblk",
            &["--disk", &format!("socket={},file=null:1G", s(&x))],
            &x,
            &dir.path().join("vblk.log"),
        );
        let pid = d.pid().to_string();
        // The lowest descriptor number free in the daemon: a limit there leaves none.
        let used: Vec<usize> = fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let open = (0..).find(|n| !used.contains(n)).unwrap();
        let limit = |n: usize| {
            let st = std::process::Command::new("prlimit")
                .args(["--pid", &pid, &format!("--nofile={n}:")])
                .status()
                .unwrap();
            assert!(st.success(), "prlimit --nofile={n}");
        };
        // No descriptor left for a connection.
        limit(open);
        let c = std::os::unix::net::UnixStream::connect(&x).unwrap();
        let t0 = Instant::now();
        while !d.log_text().contains("cannot take a frontend's connection") {
            assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.describe());
            std::thread::sleep(Duration::from_millis(20));
        }
        // Said once, not at every retry (the connection waiting fires poll at once).
        std::thread::sleep(Duration::from_millis(500));
        let said = d
            .log_text()
            .matches("cannot take a frontend's connection")
            .count();
        assert_eq!(said, 1, "{}", d.describe());
        drop(c);
        d.assert_running("after running out of descriptors");
        limit(1024);
        let disk = Disk::attach(&x, &DiskOptions::default())
            .unwrap_or_else(|e| panic!("{e}: {}", d.describe()));
        let mut q = disk.take_queue(0).unwrap();
        q.write_at(0, &[1u8; 4096]).unwrap();
    });
}

/// The disk flags a daemon's command line gives outside `--disk` are every disk's
/// defaults: a disk added live takes them (it took none: `--throttle` and
/// `--throttle-group` were bypassed by adding the disk), and `vblk disk sync` compares
/// the file's disks with them applied (its first reload reset a default limit to none).
/// A reload whose disk changed a setting that needs it re-added still applies its QoS
/// change (it skipped it).
#[test]
fn disk_defaults_reach_disks_added_and_reloaded() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-defaults");
        let ctl = dir.path().join("ctl.sock");
        let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let cfg = config(dir.path(), &ctl, &disk_table(&a, ""));
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--config",
                s(&cfg),
                "--throttle",
                "iops-total=1000",
                "--throttle-group",
                "g",
            ],
            &a,
            &dir.path().join("vblk.log"),
        );
        let qos = |id: &str| {
            let v: Value = serde_json::from_str(&ok(&["disk", "list", s(&ctl), "--json"])).unwrap();
            let d = v["disks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["id"] == id)
                .cloned()
                .unwrap_or_else(|| panic!("no disk {id}: {v}"));
            (d["throttle"].clone(), d["throttle_group"].clone())
        };
        let default = (Value::from("iops-total=1000"), Value::from("g"));
        assert_eq!(qos("a"), default, "a disk of the file");
        ok(&[
            "disk",
            "add",
            s(&ctl),
            &format!("socket={},file=null:1G,num-queues=1", s(&b)),
        ]);
        assert_eq!(qos("b"), default, "a disk added live");
        ok(&["disk", "remove", s(&ctl), "b"]);
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.trim().is_empty(), "nothing to do: {said}");
        assert_eq!(qos("a"), default, "after a reload");
        // A change that needs the disk re-added, and a new limit, in one edit.
        config(
            dir.path(),
            &ctl,
            &disk_table(&a, "cache = \"none\"\nthrottle = { iops-total = 1500 }"),
        );
        let (done, why) = vblk(&["disk", "sync", "--config", s(&cfg)]);
        assert!(
            !done && why.contains("cache: - served, none in the file"),
            "{why}"
        );
        assert_eq!(qos("a").0, "iops-total=1500", "{why}");
    });
}

/// A command whose reader goes away (`vblk stats CTL | head -1`) ends quietly with
/// SIGPIPE's status; it panicked with a backtrace ("failed printing to stdout").
#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-pipe");
        let (x, ctl) = (dir.path().join("x.sock"), dir.path().join("ctl.sock"));
        let _d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!("socket={},file=null:1G", s(&x)),
            ],
            &x,
            &dir.path().join("vblk.log"),
        );
        for args in [&["stats", s(&ctl)][..], &["disk", "list", s(&ctl)][..]] {
            let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_vblk"))
                .args(args)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            drop(child.stdout.take()); // the reader is gone before the first line
            let out = child.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!err.contains("panicked"), "{args:?}: {err}");
            assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        }
    });
}

/// Sessions a frontend breaks are counted in `vblk stats` (the README says so; only
/// wedged descriptors, lost workers and failed setups were), and a deadline it lets pass
/// is logged as one (it was "Resource temporarily unavailable (os error 11)").
#[test]
fn sessions_a_frontend_breaks_are_counted_and_named() {
    use std::io::Write as _;
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-broken");
        let (x, ctl) = (dir.path().join("x.sock"), dir.path().join("ctl.sock"));
        let d = Daemon::start_vblk(
            "vblk",
            &[
                "--control-socket",
                s(&ctl),
                "--disk",
                &format!("socket={},file=null:1G", s(&x)),
            ],
            &x,
            &dir.path().join("vblk.log"),
        );
        let broken = || stats(&ctl)["disks"][0]["lifecycle"]["broken_sessions"].as_u64();
        assert_eq!(broken(), Some(0), "{}", stats(&ctl));
        // A header with the wrong version bits.
        let mut c = std::os::unix::net::UnixStream::connect(&x).unwrap();
        let hdr = [1u32.to_le_bytes(), 2u32.to_le_bytes(), 0u32.to_le_bytes()].concat();
        c.write_all(&hdr).unwrap();
        // Half a header, then silence: the message deadline (5 s) ends the session.
        let mut h = std::os::unix::net::UnixStream::connect(&x).unwrap();
        let t0 = Instant::now();
        while broken() != Some(1) {
            assert!(t0.elapsed() < Duration::from_secs(10), "{}", stats(&ctl));
            std::thread::sleep(Duration::from_millis(20));
        }
        h.write_all(&1u32.to_le_bytes()).unwrap();
        while broken() != Some(2) {
            assert!(t0.elapsed() < Duration::from_secs(20), "{}", stats(&ctl));
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = d.log_text();
        assert!(
            log.contains("the frontend did not finish its message within 5s"),
            "{log}"
        );
        assert!(!log.contains("os error 11"), "{log}");
        let text = ok(&["stats", s(&ctl)]);
        assert!(text.contains("2 broken by the frontend"), "{text}");
    });
}

/// In a daemon of several disks every log line of a disk's session and of its queues
/// names the disk (a ring's stop, the memory table, said without it, could not be told
/// apart between disks).
#[test]
fn log_lines_name_their_disk() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-log");
        let (x, y) = (dir.path().join("x.sock"), dir.path().join("y.sock"));
        let d = Daemon::start_vblk(
            "vblk",
            &[
                "--threads",
                "1",
                "--disk",
                &format!("socket={},file=null:1G,num-queues=1", s(&x)),
                "--disk",
                &format!("id=second,socket={},file=null:1G,num-queues=1", s(&y)),
            ],
            &y,
            &dir.path().join("vblk.log"),
        );
        // A frontend spoken by hand: memory, a ring started, then stopped.
        {
            use support::raw_frontend::pf;
            support::raw_ring::StartedRing::start(&y, pf::MQ | pf::CONFIG).stop();
        }
        let t0 = Instant::now();
        while !d.log_text().contains("frontend disconnected") {
            assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.describe());
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = d.log_text();
        for line in [
            "disk second: memory table: 1 regions",
            "disk second: queue 0: stopped at available index 0",
        ] {
            assert!(log.contains(line), "{line:?} in:\n{log}");
        }
        // A line that names its disk already is not named twice.
        assert!(!log.contains("disk second: disk second"), "{log}");
    });
}

/// SIGHUP (what every `systemctl reload` sends) on disks whose size is fixed is no
/// error: it logged "ERROR … resize refused: RAM disk: its size is fixed" for each.
#[test]
fn sighup_on_fixed_size_disks_logs_no_error() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-hup");
        let (x, y) = (dir.path().join("x.sock"), dir.path().join("y.sock"));
        let d = Daemon::start_vblk(
            "vblk",
            &[
                "--disk",
                &format!("socket={},file=mem:16M", s(&x)),
                "--disk",
                &format!("socket={},file=null:1G", s(&y)),
            ],
            &y,
            &dir.path().join("vblk.log"),
        );
        // SAFETY: kill(2) with a pid this test started and a signal number.
        assert_eq!(unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) }, 0);
        let t0 = Instant::now();
        while d.log_text().matches("its size is fixed").count() < 2 {
            assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.describe());
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = d.log_text();
        assert!(!log.contains("ERROR"), "{log}");
    });
}

/// A throttle group named by a disk and given no limits anywhere is said to limit
/// nothing, at start and by `vblk disk sync` (a mistyped name made an unlimited group
/// silently).
#[test]
fn a_group_without_limits_is_warned_about() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-nogroup");
        let ctl = dir.path().join("ctl.sock");
        let a = dir.path().join("a.sock");
        let cfg = config(dir.path(), &ctl, &disk_table(&a, "group = \"tenats\""));
        let d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &a,
            &dir.path().join("vblk.log"),
        );
        let log = d.log_text();
        assert!(
            log.contains("throttle group \"tenats\" has no limits"),
            "{log}"
        );
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(
            said.contains("throttle group \"tenats\" has no limits"),
            "{said}"
        );
        // Named in the file's groups: no warning.
        let said = {
            let text = fs::read_to_string(&cfg).unwrap() + "\n[group.tenats]\niops-total = 500\n";
            fs::write(&cfg, text).unwrap();
            ok(&["disk", "sync", "--config", s(&cfg)])
        };
        assert!(!said.contains("has no limits"), "{said}");
    });
}
