//! One daemon, many disks, with the real binary: disks on the command line and in a
//! config file, added and removed while it runs (`vblk disk`), a forced removal under
//! load that loses no acknowledged write, and QoS limits that hold — every limit kind,
//! bursts, a group shared fairly, limits changed while running (twice, and back to
//! unlimited). Rates are measured by `vblk bench` over a few seconds after a ramp (the
//! bucket's initial tenth of a second of credit goes in the ramp), and must be within 2 %
//! of the limit: the limits are low enough for any machine to reach them.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};
use serde_json::Value;
use support::daemon::Daemon;
use support::nbdkit::Nbdkit;
use support::util::{temp_dir, within};

const MIB: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(300);

fn vblk(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn ok(args: &[&str]) -> String {
    let (ok, text) = vblk(args);
    assert!(ok, "vblk {args:?} failed: {text}");
    text
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `vblk bench` on `socket`: (IOPS, MiB/s, I/Os completed) of the job's reads and writes.
fn bench(socket: &Path, args: &[&str]) -> (f64, f64, u64) {
    let mut all = vec!["bench", "--socket", s(socket), "--output-format=json"];
    all.extend_from_slice(args);
    let out = ok(&all);
    let start = out.find('{').unwrap_or(0);
    let v: Value = serde_json::from_str(&out[start..])
        .unwrap_or_else(|e| panic!("bench output is not JSON ({e}): {out}"));
    let job = &v["jobs"][0];
    let (mut iops, mut bw, mut ios) = (0.0, 0.0, 0);
    for dir in ["read", "write"] {
        iops += job[dir]["iops"].as_f64().unwrap_or(0.0);
        bw += job[dir]["bw_bytes"].as_f64().unwrap_or(0.0) / MIB as f64;
        ios += job[dir]["total_ios"].as_u64().unwrap_or(0);
    }
    (iops, bw, ios)
}

/// A saturating job: `rw` of `bs` at QD16 for 3 s after a 1 s ramp.
fn saturate<'a>(rw: &'a str, bs: &'a str) -> Vec<String> {
    vec![
        format!("--rw={rw}"),
        format!("--bs={bs}"),
        "--iodepth=16".into(),
        "--size=64m".into(),
        "--runtime=3".into(),
        "--time_based".into(),
        "--ramp_time=1".into(),
    ]
}

/// The tests here measure rates against limits (and one drives a disk as hard as it
/// can): run in parallel on a small machine they measure each other. Each holds this lock.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn within_2pct(what: &str, got: f64, want: f64) {
    eprintln!("{what}: {got:.1} measured, {want} configured");
    assert!(
        (got - want).abs() <= want * 0.02,
        "{what}: {got:.1} measured for {want} configured (more than 2 % off)"
    );
}

fn stats(ctl: &Path) -> Value {
    serde_json::from_str(&ok(&["stats", s(ctl), "--json"])).unwrap()
}

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
        let d = Daemon::start_vblk(
            "vblk",
            &[
                "--threads",
                "2",
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
        // Added live: the image is opened by `vblk disk add`, not by the daemon.
        let added = ok(&[
            "disk",
            "add",
            s(&ctl),
            &format!("socket={},file={},format=raw,num-queues=1", s(&c), s(&img)),
        ]);
        assert!(added.contains("disk c added"), "{added}");
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
        let (bad, why) = vblk(&[
            "disk",
            "add",
            s(&ctl),
            &format!("socket={},file=null:1G,threads=2", s(&c)),
        ]);
        assert!(!bad && why.contains("applies to the whole daemon"), "{why}");
        drop(d);
    });
}

/// Three disks on one worker thread: one whose NBD server takes 3 s for a read, one whose
/// frontend sent half a message and went quiet, and one served normally. The third does a
/// thousand verified writes and reads while the slow read is still at its server, and the
/// quiet frontend's disk serves the next frontend once it is gone.
#[test]
fn a_slow_server_or_a_stuck_frontend_stalls_no_other_disk() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("disks-apart");
        let nbd = Nbdkit::start(dir.path(), &["--filter=delay", "memory", "64M", "rdelay=3"]);
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
        // A read the NBD server holds for 3 s.
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
        fs::File::create(&img).unwrap().set_len(64 * MIB).unwrap();
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
        let writers: Vec<_> = (0..4u64)
            .map(|t| {
                let (disk, stop) = (disk.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut q = disk.take_queue(t as u16).unwrap();
                    let mut acked = Vec::new();
                    // Each queue writes its own 16 MiB, block by block, each block
                    // stamped with its number.
                    for i in 0..4096u64 {
                        if stop.load(Ordering::Relaxed) && i % 64 == 0 {
                            std::thread::yield_now();
                        }
                        let block = t * 4096 + i;
                        let data = [(block % 251) as u8 + 1; 4096];
                        if q.write_at(block * 4096, &data).is_err() {
                            break;
                        }
                        acked.push(block);
                    }
                    acked
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
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

/// The daemon from a config file: its flags, a group, disks with limits.
fn config(dir: &Path, ctl: &Path, disks: &str) -> PathBuf {
    let path = dir.join("disks.toml");
    fs::write(
        &path,
        format!(
            "threads = 2\ncontrol-socket = \"{}\"\n\n[group.g]\niops-total = 3000\n\n{disks}",
            s(ctl)
        ),
    )
    .unwrap();
    path
}

fn disk_table(sock: &Path, extra: &str) -> String {
    format!(
        "[[disk]]\nsocket = \"{}\"\nfile = \"null:1G\"\nnum-queues = 1\n{extra}\n",
        s(sock)
    )
}

/// Every kind of limit holds to within 2 %: IOPS total, read and write, bytes total, read
/// and write, iops-size. Each disk has its own limit; they run at once.
#[test]
fn every_limit_kind_holds() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-kinds");
        let ctl = dir.path().join("ctl.sock");
        // (limit, job rw, block size, the expected IOPS, or MiB/s for byte limits)
        let cases: [(&str, &str, &str, f64, bool); 7] = [
            ("iops-total = 2000", "randread", "4k", 2000.0, false),
            ("iops-read = 1500", "randread", "4k", 1500.0, false),
            ("iops-write = 1000", "randwrite", "4k", 1000.0, false),
            ("bps-total = \"16M\"", "randread", "64k", 16.0, true),
            ("bps-read = \"4M\"", "randread", "4k", 4.0, true),
            ("bps-write = \"8M\"", "randwrite", "128k", 8.0, true),
            // 16 KiB requests count as four: 250 of them a second.
            (
                "iops-total = 1000\niops-size = 4096",
                "randread",
                "16k",
                250.0,
                false,
            ),
        ];
        let socks: Vec<PathBuf> = (0..cases.len())
            .map(|i| dir.path().join(format!("k{i}.sock")))
            .collect();
        let tables: String = cases
            .iter()
            .zip(&socks)
            .map(|((limit, ..), sock)| disk_table(sock, &format!("[disk.throttle]\n{limit}")))
            .collect();
        let cfg = config(dir.path(), &ctl, &tables);
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            socks.last().unwrap(),
            &dir.path().join("vblk.log"),
        );
        let runs: Vec<_> = cases
            .iter()
            .zip(socks)
            .map(|(&(limit, rw, bs, want, bytes), sock)| {
                std::thread::spawn(move || {
                    let args = saturate(rw, bs);
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let (iops, mib, _) = bench(&sock, &args);
                    (limit, if bytes { mib } else { iops }, want)
                })
            })
            .collect();
        for r in runs {
            let (limit, got, want) = r.join().unwrap();
            within_2pct(&limit.replace('\n', ","), got, want);
        }
        let st = stats(&ctl);
        assert!(
            st["disks"][0]["throttle"]["delayed"].as_u64().unwrap() > 0,
            "throttled requests are counted: {}",
            st["disks"][0]["throttle"]
        );
    });
}

/// A burst: `-max` for `-max-length` seconds' worth, then the base rate (QEMU's
/// semantics: iops 500, max 2000 for 2 s: the bucket holds 4000 requests, the burst rate
/// fills it in about 2.5 s, 7000 requests in the first 6 s), and then 500 a second.
#[test]
fn a_burst_delivers_its_credit_then_the_base_rate() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-burst");
        let ctl = dir.path().join("ctl.sock");
        let sock = dir.path().join("b.sock");
        let cfg = config(
            dir.path(),
            &ctl,
            &disk_table(
                &sock,
                "throttle = { iops-total = 500, iops-total-max = 2000, iops-total-max-length = 2 }",
            ),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &sock,
            &dir.path().join("vblk.log"),
        );
        let job = [
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--size=64m",
            "--runtime=6",
            "--time_based",
        ];
        let (_, _, ios) = bench(&sock, &job);
        within_2pct("requests in the first 6 s of a burst", ios as f64, 7000.0);
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (iops, _, _) = bench(&sock, &args);
        within_2pct("IOPS once the burst is spent", iops, 500.0);
    });
}

/// Two saturating disks in a group of 3000 IOPS get 1500 each (± 5 %); alone, one gets
/// all 3000. The group's limit changes while they run.
#[test]
fn a_group_is_shared_fairly_and_changes_live() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-group");
        let ctl = dir.path().join("ctl.sock");
        let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
        let tables =
            disk_table(&a, "group = \"g\"") + &disk_table(&b, "throttle = { group = \"g\" }");
        let cfg = config(dir.path(), &ctl, &tables);
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &b,
            &dir.path().join("vblk.log"),
        );
        // Both disks saturate for 8 s; the rates come from the daemon's own counters over
        // a window in which both are running (two processes never start at the same
        // instant, and a disk alone in the group rightly gets all of it).
        let pair = || {
            let runs: Vec<_> = [a.clone(), b.clone()]
                .into_iter()
                .map(|sock| {
                    std::thread::spawn(move || {
                        let job = ["--rw=randread", "--bs=4k", "--iodepth=16", "--size=64m"];
                        let mut args = job.to_vec();
                        args.extend(["--runtime=8", "--time_based"]);
                        bench(&sock, &args).0
                    })
                })
                .collect();
            let completed = || {
                let st = stats(&ctl);
                let per_disk: Vec<u64> = (0..2)
                    .map(|i| {
                        st["disks"][i]["queues"].as_array().map_or(0, |q| {
                            q.iter().filter_map(|q| q["completed"].as_u64()).sum()
                        })
                    })
                    .collect();
                (per_disk[0], per_disk[1], Instant::now())
            };
            // Wait until both are being served, then let them settle for a second.
            let deadline = Instant::now() + Duration::from_secs(5);
            let first = completed();
            loop {
                std::thread::sleep(Duration::from_millis(50));
                let now = completed();
                if now.0 > first.0 && now.1 > first.1 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the two jobs did not both start within 5 s"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
            let s0 = completed();
            std::thread::sleep(Duration::from_secs(3));
            let s1 = completed();
            let secs = (s1.2 - s0.2).as_secs_f64();
            let rates = ((s1.0 - s0.0) as f64 / secs, (s1.1 - s0.1) as f64 / secs);
            for t in runs {
                t.join().unwrap();
            }
            rates
        };
        let (x, y) = pair();
        within_2pct("the group's total", x + y, 3000.0);
        for (name, got) in [("a", x), ("b", y)] {
            assert!(
                (got - 1500.0).abs() <= 75.0,
                "disk {name}: {got:.0} IOPS of a fair 1500 ({x:.0} + {y:.0})"
            );
        }
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        within_2pct("one disk alone in the group", bench(&a, &args).0, 3000.0);
        ok(&["disk", "group", s(&ctl), "g", "iops-total=1000"]);
        let (x, y) = pair();
        within_2pct("the group's total after a change", x + y, 1000.0);
        let st = stats(&ctl);
        let g = &st["throttle_groups"][0];
        assert_eq!(g["name"], "g");
        assert_eq!(g["limits"]["iops-total"], 1000);
        assert_eq!(g["members"].as_array().unwrap().len(), 2);
        assert!(
            u64_of(&g["delayed"]) > 0,
            "the group's waits are counted: {g}"
        );
        // The same in words: each disk's group and waits, the group's limits and members.
        let text = ok(&["stats", s(&ctl)]);
        assert!(
            text.contains("QoS: limits none, throttle group g; ")
                && text.contains("throttle group g: limits iops-total=1000, disks a b; "),
            "{text}"
        );
    });
}

fn u64_of(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// A disk's limits change while it runs: twice, then back to unlimited, then into a group
/// and out of it.
#[test]
fn limits_change_while_a_disk_runs() {
    let _one_at_a_time = serial();
    within(LIMIT, "the test", || {
        let dir = temp_dir("qos-set");
        let ctl = dir.path().join("ctl.sock");
        let sock = dir.path().join("s.sock");
        let cfg = config(
            dir.path(),
            &ctl,
            &disk_table(&sock, "throttle = { iops-total = 1000 }"),
        );
        let _d = Daemon::start_vblk(
            "vblk",
            &["--config", s(&cfg)],
            &sock,
            &dir.path().join("vblk.log"),
        );
        let args = saturate("randread", "4k");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let id = "s";
        within_2pct("at first", bench(&sock, &args).0, 1000.0);
        ok(&["disk", "set", s(&ctl), id, "throttle.iops-total=2000"]);
        within_2pct("after a first change", bench(&sock, &args).0, 2000.0);
        ok(&["disk", "set", s(&ctl), id, "bps-total=2M"]); // QEMU's bare name
        within_2pct("after a second change (bytes)", bench(&sock, &args).1, 2.0);
        ok(&["disk", "set", s(&ctl), id, "throttle=none"]);
        let free = bench(&sock, &args).0;
        assert!(free > 20_000.0, "unlimited again, yet {free:.0} IOPS");
        ok(&["disk", "set", s(&ctl), id, "throttle.group=g"]);
        within_2pct("in the group", bench(&sock, &args).0, 3000.0);
        ok(&["disk", "set", s(&ctl), id, "group=none"]);
        assert!(bench(&sock, &args).0 > 20_000.0);
        let (bad, why) = vblk(&[
            "disk",
            "set",
            s(&ctl),
            id,
            "throttle.iops-total=1,throttle.iops-read=1",
        ]);
        assert!(
            !bad && why
                .contains("total values and read/write values cannot be used at the same time"),
            "{why}"
        );
        let (bad, why) = vblk(&["disk", "set", s(&ctl), id, "cache=none"]);
        assert!(!bad && why.contains("remove and add it"), "{why}");
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
        within_2pct("disk a after the reload", bench(&a, &args).0, 2000.0);
        let said = ok(&["disk", "sync", "--config", s(&cfg)]);
        assert!(said.trim().is_empty(), "nothing to do twice: {said}");
    });
}
