//! The daemon's life with the real binary: live statistics (`--control-socket`, `vblk
//! stats`), a clean stop on SIGTERM with requests in flight, and a disk grown under a
//! running daemon (SIGHUP) followed by the driver library. (A Linux guest following a
//! resize is in `guest_control.rs`.)

mod support;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions, ErrorKind};
use serde_json::Value;
use support::daemon::{Backend, Daemon, Export};
use support::util::{temp_dir, within};

const MIB: u64 = 1 << 20;
const LIMIT: Duration = Duration::from_secs(120);

fn image(dir: &Path, size: u64) -> std::path::PathBuf {
    let p = dir.join("disk.img");
    fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn serve(dir: &Path, img: &Path, args: &[&str]) -> Daemon {
    serve_export(dir, &Export::new(img, 1).args(args))
}

fn serve_export(dir: &Path, export: &Export) -> Daemon {
    Daemon::start(
        Backend::Vblk,
        "vblk",
        export,
        &dir.join("vblk.sock"),
        &dir.join("vblk.log"),
    )
}

fn vblk_stats(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .arg("stats")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn signal(d: &Daemon, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(d.pid() as i32, sig) }, 0);
}

fn wait_exit(d: &mut Daemon, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = d.exit_status() {
            return s;
        }
        assert!(
            t0.elapsed() < limit,
            "the daemon did not exit\n{}",
            d.describe()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn opts() -> DiskOptions {
    DiskOptions {
        num_queues: Some(1),
        ..Default::default()
    }
}

#[test]
fn stats_show_what_a_driver_did() {
    within(LIMIT, "the test", || {
        let dir = temp_dir("control-stats");
        let img = image(dir.path(), 16 * MIB);
        let ctl = dir.path().join("vblk.ctl");
        let d = serve(
            dir.path(),
            &img,
            &["--control-socket", ctl.to_str().unwrap()],
        );
        let disk = Disk::attach(&d.socket, &opts()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        for i in 0..10u64 {
            q.write_at(i * 4096, &[i as u8; 4096]).unwrap();
        }
        let mut buf = vec![0u8; 8192];
        for i in 0..5u64 {
            q.read_at(i * 8192, &mut buf).unwrap();
        }
        q.flush_sync().unwrap();
        q.discard_sync(MIB, MIB).unwrap();
        let (ok, json) = vblk_stats(&[ctl.to_str().unwrap(), "--json"]);
        assert!(ok, "{json}");
        let v: Value = serde_json::from_str(&json).unwrap();
        let q0 = &v["queues"][0];
        let op = |name: &str, f: &str| q0["ops"][name][f].as_u64().unwrap();
        assert_eq!((op("write", "ios"), op("write", "bytes")), (10, 40960));
        assert_eq!((op("read", "ios"), op("read", "bytes")), (5, 40960));
        assert_eq!(op("flush", "ios"), 1);
        assert_eq!((op("discard", "ios"), op("discard", "bytes")), (1, MIB));
        assert_eq!(
            op("get_id", "ios"),
            1,
            "the driver asks the serial when it attaches"
        );
        assert_eq!(q0["rejected"], 0);
        assert_eq!(q0["failed"], 0);
        assert_eq!(q0["in_flight"], 0);
        assert_eq!(v["capacity_bytes"], 16 * MIB);
        let hist: u64 = q0["ops"]["write"]["lat"]["log2_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum();
        assert_eq!(hist, 10, "every write is in the latency histogram");
        let (ok, text) = vblk_stats(&[ctl.to_str().unwrap()]);
        assert!(ok, "{text}");
        for want in [
            "reads",
            "read MiB",
            "writes",
            "w_avg(us)",
            "in_flight",
            "p99",
            "worker 0",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
        let (ok, rates) = vblk_stats(&[ctl.to_str().unwrap(), "--interval", "0.2", "--count", "1"]);
        assert!(ok, "{rates}");
        for want in ["r/s", "rkB/s", "r_await", "w/s", "aqu-sz"] {
            assert!(rates.contains(want), "{want:?} missing from:\n{rates}");
        }
        let (ok, err) = vblk_stats(&[dir.path().join("nope").to_str().unwrap()]);
        assert!(!ok && err.contains("cannot connect"), "{err}");
    });
}

/// A worker that sleeps between requests measures what a sleep costs it and bounds its
/// polling window by it (poll.rs); `--poll-us 0` never measures and spins no longer than
/// its grace (4 µs).
#[test]
fn a_worker_that_sleeps_measures_the_cost_and_narrows_its_window() {
    within(LIMIT, "the test", || {
        let dir = temp_dir("control-poll");
        let img = image(dir.path(), 16 * MIB);
        for (poll, ceiling_ns) in [("200", 200_000u64), ("0", 0)] {
            let ctl = dir.path().join(format!("vblk-{poll}.ctl"));
            let d = serve(
                dir.path(),
                &img,
                &["--control-socket", ctl.to_str().unwrap(), "--poll-us", poll],
            );
            let disk = Disk::attach(&d.socket, &opts()).unwrap();
            let mut q = disk.take_queue(0).unwrap();
            let mut buf = vec![0u8; 4096];
            // Far apart: every window runs out and the worker sleeps before each read.
            for i in 0..48u64 {
                q.read_at(i * 4096, &mut buf).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            let (ok, json) = vblk_stats(&[ctl.to_str().unwrap(), "--json"]);
            assert!(ok, "{json}");
            let v: Value = serde_json::from_str(&json).unwrap();
            let w = &v["workers"][0];
            let n = |f: &str| w[f].as_u64().unwrap();
            assert!(n("sleeps") >= 48, "{w}");
            let regime = w["poll_regime"].as_str().unwrap_or_default();
            assert!(["poll", "adapt", "lean"].contains(&regime), "{w}");
            if ceiling_ns == 0 {
                assert_eq!(regime, "lean", "--poll-us 0 has only the grace: {w}");
                assert_eq!(n("sleep_cost_ns"), 0, "{w}");
                assert!(n("poll_window_ns") <= 4_000, "at most the grace: {w}");
            } else {
                assert!(n("sleep_cost_ns") > 0, "a sleep was measured: {w}");
                // Windows that keep running out do not pay: then one idle period in
                // poll::PROBE_EVERY (8) still spins, the others sleep at once.
                assert!(n("poll_misses") >= 4, "{w}");
                // Under the ceiling, or at it only where a sleep cost that much (a
                // loaded machine): the window is bounded by the measured cost.
                assert!(
                    n("poll_window_ns") < ceiling_ns || n("poll_window_ns") <= n("sleep_cost_ns"),
                    "windows that run out, bounded by a sleep's cost, are under the ceiling: {w}"
                );
            }
            let (ok, text) = vblk_stats(&[ctl.to_str().unwrap()]);
            assert!(ok && text.contains("a sleep costs"), "{text}");
        }
    });
}

/// `--coalesce-us`: the worker's trials try sleeping with the guest's kicks off (the
/// sleeps are counted), the guest's paced, verified I/O all completes correctly through
/// them (kicks off: only the coalescing sleep's deadline wakes the worker for it), and the
/// worker thread's timer slack is set under the sandbox's seccomp filter (a refused
/// prctl would kill the daemon). Out of range, the flag is refused naming its bound.
#[test]
fn coalescing_sleeps_leave_kicks_off_and_lose_nothing() {
    within(LIMIT, "the test", || {
        let dir = temp_dir("control-coalesce");
        let img = image(dir.path(), 16 * MIB);
        let ctl = dir.path().join("vblk.ctl");
        // Coalescing alone (poll::PIN_REGIME_ENV): whether the trials would choose it is
        // their business (poll.rs's tests); here the worker coalesces throughout.
        let d = serve_export(
            dir.path(),
            &Export::new(&img, 1)
                .args(&[
                    "--control-socket",
                    ctl.to_str().unwrap(),
                    "--coalesce-us",
                    "200",
                ])
                .env("VBLK_TEST_POLL_REGIME", "coalesce"),
        );
        let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
            .args(["bench", "--socket", d.socket.to_str().unwrap()])
            .args(["--rw=randrw", "--bs=4k", "--iodepth=16", "--size=16m"])
            .args(["--rate_iops=25000,25000", "--verify=crc32c"])
            .args(["--runtime=2", "--time_based"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "the verified job failed: {text}");
        let (ok, json) = vblk_stats(&[ctl.to_str().unwrap(), "--json"]);
        assert!(ok, "{json}");
        let v: Value = serde_json::from_str(&json).unwrap();
        let w = &v["workers"][0];
        assert_eq!(w["poll_regime"], "coalesce", "{w}");
        let n = |w: &Value, f: &str| w[f].as_u64().unwrap();
        assert!(n(w, "coalesced_sleeps") > 0, "{w}");
        let (ok, text) = vblk_stats(&[ctl.to_str().unwrap()]);
        assert!(ok && text.contains("left kicks off"), "{text}");
        // A guest that goes idle: a coalescing sleep that finds nothing re-arms kicks and
        // the worker sleeps until woken (a worker that kept sleeping 200 µs at a time
        // would count about 1,500 sleeps in 300 ms).
        let disk = Disk::attach(&d.socket, &opts()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        let mut buf = vec![0u8; 4096];
        for i in 0..8u64 {
            q.read_at(i * 4096, &mut buf).unwrap();
        }
        let sleeps = || {
            let (ok, json) = vblk_stats(&[ctl.to_str().unwrap(), "--json"]);
            assert!(ok, "{json}");
            let v: Value = serde_json::from_str(&json).unwrap();
            v["workers"][0].clone()
        };
        let before = sleeps();
        std::thread::sleep(Duration::from_millis(300));
        let after = sleeps();
        assert!(
            n(&after, "sleeps") - n(&before, "sleeps") < 50,
            "an idle guest: the worker sleeps until woken: {before} then {after}"
        );
        drop(q);
        drop(disk);
        let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
            .args(["serve", "--socket-path"])
            .arg(dir.path().join("x.sock"))
            .args(["--blk-file", "null:1M", "--coalesce-us", "1001"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("--coalesce-us 1001: must be at most 1000"),
            "{err}"
        );
    });
}

/// SIGTERM with requests in flight: they finish and are answered, the disk is flushed,
/// the socket the daemon made is removed, and it exits 0.
#[test]
fn sigterm_finishes_requests_in_flight_and_exits_0() {
    within(LIMIT, "the test", || {
        let dir = temp_dir("control-term");
        let img = image(dir.path(), 16 * MIB);
        // Every request 400 ms late: they are surely in flight when the signal comes.
        let mut d = serve(dir.path(), &img, &["--delay-every", "1:400"]);
        let disk = Disk::attach(&d.socket, &opts()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        for i in 0..8u64 {
            let mut b = disk.alloc(4096).unwrap();
            b.fill(0x40 + i as u8);
            q.write(i * 4096, b, i).map_err(|e| e.error).unwrap();
        }
        q.unplug();
        std::thread::sleep(Duration::from_millis(100));
        signal(&d, libc::SIGTERM);
        let mut done = 0;
        while done < 8 {
            let c = q.wait(Some(Duration::from_secs(20))).unwrap();
            c.result
                .unwrap_or_else(|e| panic!("write {} failed: {e}", c.token));
            done += 1;
        }
        let status = wait_exit(&mut d, Duration::from_secs(30));
        assert!(status.success(), "exit status {status}\n{}", d.describe());
        assert!(!d.socket.exists(), "the socket is removed");
        let log = fs::read_to_string(&d.log).unwrap();
        assert!(log.contains("stopping"), "{log}");
        let data = fs::read(&img).unwrap();
        for i in 0..8usize {
            assert!(
                data[i * 4096..(i + 1) * 4096]
                    .iter()
                    .all(|&b| b == 0x40 + i as u8),
                "write {i} did not land"
            );
        }
    });
}

/// A file grown under the daemon: SIGHUP makes it re-read the size and tell the frontend
/// (the backend channel); the driver's capacity follows and I/O past the old end works.
/// Shrinking is refused unless --allow-shrink.
#[test]
fn sighup_grows_the_disk_and_the_driver_follows() {
    within(LIMIT, "the test", || {
        let dir = temp_dir("control-resize");
        let img = image(dir.path(), 8 * MIB);
        let d = serve(dir.path(), &img, &[]);
        let disk = Disk::attach(&d.socket, &opts()).unwrap();
        assert_eq!(disk.capacity_bytes(), 8 * MIB);
        let mut q = disk.take_queue(0).unwrap();
        let e = q.write_at(12 * MIB, &[7u8; 4096]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(16 * MIB)
            .unwrap();
        signal(&d, libc::SIGHUP);
        let t0 = Instant::now();
        while disk.capacity_bytes() != 16 * MIB {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the driver did not see the new capacity\n{}",
                d.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        q.write_at(12 * MIB, &[7u8; 4096]).unwrap();
        let mut back = vec![0u8; 4096];
        q.read_at(12 * MIB, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 7));
        // Shrinking: refused, the capacity stays.
        fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(4 * MIB)
            .unwrap();
        signal(&d, libc::SIGHUP);
        let t0 = Instant::now();
        loop {
            let log = fs::read_to_string(&d.log).unwrap();
            if log.contains("resize refused") {
                assert!(log.contains("--allow-shrink"), "{log}");
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no refusal logged\n{log}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(disk.capacity_bytes(), 16 * MIB);
    });
}
