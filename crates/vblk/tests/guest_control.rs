//! The control plane with a real Linux guest under QEMU (TCG):
//!
//! 1. QEMU's defaults: `-device vhost-user-blk-pci,chardev=...` with no properties (one
//!    queue per vCPU) on `vblk serve` with its defaults; then the image grows under the
//!    running guest, SIGHUP, and the guest's `/dev/vda` grows without a reboot (the
//!    backend channel's config-change message, QEMU's config interrupt) and takes I/O past
//!    its old end.
//! 2. A crashing daemon with completions out of order: fio with `verify=crc32c` in the
//!    guest while the daemon (`--delay-every 4:30`: every 4th completion 30 ms late) is
//!    killed with SIGKILL and restarted six times; QEMU reattaches (`reconnect=1`) and the
//!    inflight region makes each new daemon resubmit exactly what the old one had taken and
//!    not answered. fio must finish with no error, no I/O error in the guest, and the logs
//!    must show requests resubmitted.
//! 3. The same without the inflight region (`--no-inflight`): QEMU resumes at the used
//!    index, which is wrong when completions were out of order; the run must not come out
//!    clean (the daemon finds a head offered twice, fio fails, or the guest hangs). This
//!    shows that test 2 tests something.
//!
//! 4. A qcow2 disk grown by `vblk disk resize` under a running guest.
//!
//! About two minutes on 2 cores. Needs (Debian): qemu-system-x86, linux-image-amd64,
//! busybox-static, fio.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::daemon::{Backend, Daemon, Export};
use support::guest::{Guest, TempDir};
use support::layer::fio_layer;

const MIB: u64 = 1 << 20;

fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let p = dir.join(name);
    fs::File::create(&p).unwrap().set_len(size).unwrap();
    p
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a child's pid.
    unsafe { libc::kill(pid as i32, sig) };
}

/// Wait until `path` holds `marker` at `offset` (the guest's way to say "now").
fn wait_for_marker(path: &Path, offset: u64, marker: &[u8], limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Ok(f) = fs::File::open(path) {
            let mut buf = vec![0u8; marker.len()];
            if std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, offset).is_ok()
                && buf == marker
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn qemu_defaults_and_a_disk_grown_under_a_running_guest() {
    let dir = TempDir::new("guest-resize");
    let img = image(dir.path(), "disk.img", 64 * MIB);
    // vblk serve with its defaults: no --num-queues.
    let d = Daemon::start(
        Backend::Vblk,
        "vblk",
        &Export::new(&img, 0),
        &dir.join("vblk.sock"),
        &dir.join("vblk.log"),
    );
    let script = r#"
check_eq hw-queues "$(ls /sys/block/vda/mq | wc -l)" 2
before=$(cat /sys/block/vda/size)
check_eq size-before "$before" 131072
printf 'VBLK-RESIZE-READY' > /tmp/m
dd if=/tmp/m of=/dev/vda bs=512 count=1 conv=sync oflag=direct 2>/dev/null
i=0
while [ $i -lt 600 ]; do
    [ "$(cat /sys/block/vda/size)" != "$before" ] && break
    sleep 0.1; i=$((i + 1))
done
check_eq size-after "$(cat /sys/block/vda/size)" 262144
dd if=/dev/urandom of=/tmp/x bs=1M count=1 2>/dev/null
check write-past-old-end dd if=/tmp/x of=/dev/vda bs=1M seek=100 oflag=direct
check read-past-old-end dd if=/dev/vda of=/tmp/y bs=1M skip=100 count=1 iflag=direct
check same-bytes cmp /tmp/x /tmp/y
"#;
    let img2 = img.clone();
    let pid = d.pid();
    let resizer = std::thread::spawn(move || {
        if !wait_for_marker(&img2, 0, b"VBLK-RESIZE-READY", Duration::from_secs(240)) {
            return false;
        }
        fs::OpenOptions::new()
            .write(true)
            .open(&img2)
            .unwrap()
            .set_len(128 * MIB)
            .unwrap();
        signal(pid, libc::SIGHUP);
        true
    });
    let boot = Guest::new("qemu-defaults-resize")
        .disk_qemu_defaults(&d.socket)
        .attach_log("vblk serve", &d.log)
        .watch("vblk serve", d.pid())
        .script(script)
        .boot();
    assert!(
        resizer.join().unwrap(),
        "the guest never said it was ready\n{}",
        boot.report()
    );
    boot.assert_ok(&[
        "hw-queues",
        "size-before",
        "size-after",
        "write-past-old-end",
        "read-past-old-end",
        "same-bytes",
    ]);
    let log = fs::read_to_string(&d.log).unwrap();
    assert!(
        log.contains("told the frontend the capacity is now 262144 sectors"),
        "{log}"
    );
}

/// A qcow2 disk grown by `vblk disk resize` (the daemon writes the image's header and
/// moves its L1 table: 4 KiB clusters, 64 MiB to 128 MiB needs 64 L1 entries, not 32)
/// under a running guest, whose `/dev/vda` grows and takes I/O past its old end; the
/// image then reads as grown in QEMU's tools, with what the guest wrote there, and
/// `qemu-img check` finds nothing wrong. A shrink is refused with the reason.
#[test]
fn a_qcow2_disk_grown_by_vblk_disk_resize_under_a_running_guest() {
    let dir = TempDir::new("guest-qcow2-resize");
    let (img, hosts) =
        support::guest::qcow2_with_markers(dir.path(), "disk.qcow2", "64M", 4096, &[0]);
    let ctl = dir.join("ctl.sock");
    let d = Daemon::start(
        Backend::Vblk,
        "vblk",
        &Export::new(&img, 1).args(&[
            "--format",
            "qcow2",
            "--control-socket",
            ctl.to_str().unwrap(),
        ]),
        &dir.join("vblk.sock"),
        &dir.join("vblk.log"),
    );
    let script = r#"
before=$(cat /sys/block/vda/size)
check_eq size-before "$before" 131072
printf 'VBLK-RESIZE-READY' > /tmp/m
dd if=/tmp/m of=/dev/vda bs=512 count=1 conv=sync oflag=direct 2>/dev/null
i=0
while [ $i -lt 600 ]; do
    [ "$(cat /sys/block/vda/size)" != "$before" ] && break
    sleep 0.1; i=$((i + 1))
done
check_eq size-after "$(cat /sys/block/vda/size)" 262144
yes VBLK-GROWN | head -c 1048576 > /tmp/x
check write-past-old-end dd if=/tmp/x of=/dev/vda bs=1M seek=100 oflag=direct
check read-past-old-end dd if=/dev/vda of=/tmp/y bs=1M skip=100 count=1 iflag=direct
check same-bytes cmp /tmp/x /tmp/y
"#;
    let (img2, ctl2, marker) = (img.clone(), ctl.clone(), hosts[0]);
    let resizer = std::thread::spawn(move || -> Result<String, String> {
        if !wait_for_marker(
            &img2,
            marker,
            b"VBLK-RESIZE-READY",
            Duration::from_secs(240),
        ) {
            return Err("the guest never said it was ready".into());
        }
        let c = support::cli::s(&ctl2);
        // The disk is named after its socket (vblk.sock).
        let (ok, shrink) = support::cli::vblk(&["disk", "resize", c, "vblk", "32M"]);
        if ok || !shrink.contains("grows qcow2 images only") {
            return Err(format!(
                "a shrink was not refused as it should be: {shrink}"
            ));
        }
        let (ok, out) = support::cli::vblk(&["disk", "resize", c, "vblk", "128M"]);
        if !ok {
            return Err(format!("vblk disk resize failed: {out}"));
        }
        Ok(out)
    });
    let boot = Guest::new("qcow2-resize")
        .disk(&d.socket, 1)
        .attach_log("vblk serve", &d.log)
        .watch("vblk serve", d.pid())
        .script(script)
        .boot();
    let said = resizer.join().unwrap();
    assert!(said.is_ok(), "{said:?}\n{}", boot.report());
    assert!(
        said.as_ref()
            .is_ok_and(|s| s.contains("134217728 bytes (128.0 MiB), was 67108864")),
        "{said:?}"
    );
    boot.assert_ok(&[
        "size-before",
        "size-after",
        "write-past-old-end",
        "read-past-old-end",
        "same-bytes",
    ]);
    // `vblk stats` gives the image's size now, not the one it was opened with.
    let v = support::cli::stats(&ctl);
    let image = if v["image"].is_null() {
        &v["disks"][0]["image"]
    } else {
        &v["image"]
    };
    assert_eq!(image["virtual_size"], 128 << 20, "{v}");
    let log = d.log_text();
    assert!(log.contains("L1 table moved"), "{log}");
    assert!(
        log.contains("told the frontend the capacity is now 262144 sectors"),
        "{log}"
    );
    let mut d = d;
    assert!(
        d.terminate(Duration::from_secs(30)),
        "the daemon did not stop"
    );
    let qemu = |args: &[&str]| {
        let out = Command::new(args[0])
            .args(&args[1..])
            .current_dir(dir.path())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, check) = qemu(&["qemu-img", "check", "disk.qcow2"]);
    assert!(ok && check.contains("No errors were found"), "{check}");
    let (_, info) = qemu(&["qemu-img", "info", "--output=json", "disk.qcow2"]);
    assert!(info.contains("\"virtual-size\": 134217728"), "{info}");
    let (ok, _) = qemu(&["qemu-img", "convert", "-O", "raw", "disk.qcow2", "out.raw"]);
    assert!(ok);
    let back = support::guest::read_at(&dir.join("out.raw"), 100 * MIB, 1 << 20);
    let want: Vec<u8> = b"VBLK-GROWN\n"
        .iter()
        .copied()
        .cycle()
        .take(1 << 20)
        .collect();
    assert!(
        back == want,
        "qemu-img reads other bytes where the guest wrote past the old end"
    );
}

/// The guest side of the crash tests: rounds of fio (random writes of 4-64 KiB, 2 jobs,
/// one per vCPU so both queues, then a verify pass of everything written) until the host
/// has done its kills and writes a stop marker on the disk (at most 30 rounds). Round r
/// writes 56 MiB from FIRST + (r - 1) * STRIDE MiB (the script's caller sets both).
const CRASH_FIO: &str = r#"
printf 'VBLK-FIO-START' > /tmp/m
dd if=/tmp/m of=/dev/vda bs=512 seek=$((96 * 2048)) count=1 conv=sync oflag=direct 2>/dev/null
rc=0; round=0
while [ $round -lt 30 ]; do
    round=$((round + 1))
    echo "VBLK-RUN fio round $round"
    base=$((FIRST + (round - 1) * STRIDE))
    fio --eta=never --name=a --filename=/dev/vda --offset=${base}M --size=24M --cpus_allowed=0 \
        --name=b --filename=/dev/vda --offset=$((base + 32))M --size=24M --cpus_allowed=1 \
        --direct=1 --ioengine=io_uring --iodepth=16 --rw=randwrite --bsrange=4k-64k \
        --verify=crc32c --verify_fatal=1 --do_verify=1 --randrepeat=0 > /tmp/fio.out 2>&1
    rc=$?
    grep -E "err=|verify|error" /tmp/fio.out | head -n 10 | sed "s/^/VBLK-FIOLOG $round /"
    [ $rc -ne 0 ] && break
    dd if=/dev/vda of=/tmp/s bs=512 skip=$((100 * 2048)) count=1 iflag=direct 2>/dev/null
    grep -q VBLK-STOP /tmp/s && break
done
if [ $rc -eq 0 ]; then vblk_report fio ok "$round rounds"; else vblk_report fio fail "round $round: exit $rc"; fi
check_eq io-errors "$(dmesg | grep -c -E 'I/O error|blk_update_request')" 0
"#;

/// The image of a crash test, and where the host finds the guest's markers in its file.
struct CrashImage {
    path: PathBuf,
    /// File offsets of guest offsets 96 MiB (the guest says fio started) and 100 MiB
    /// (the host says stop).
    start_at: u64,
    stop_at: u64,
    /// The guest script's FIRST and STRIDE (MiB).
    first: u64,
    stride: u64,
}

/// A 128 MiB raw image: every round writes the same 56 MiB.
fn raw_crash_image(dir: &Path) -> CrashImage {
    CrashImage {
        path: image(dir, "disk.img", 128 * MIB),
        start_at: 96 * MIB,
        stop_at: 100 * MIB,
        first: 0,
        stride: 0,
    }
}

/// A new 4 GiB qcow2 image with 4 KiB clusters: every round writes 56 MiB nothing wrote
/// before, so every round allocates (14,336 clusters). The two marker clusters are
/// allocated beforehand, so that they stay where `qemu-img map` finds them.
fn qcow2_crash_image(dir: &Path) -> CrashImage {
    let (path, hosts) =
        support::guest::qcow2_with_markers(dir, "disk.qcow2", "4G", 4096, &[96 * MIB, 100 * MIB]);
    CrashImage {
        path,
        start_at: hosts[0],
        stop_at: hosts[1],
        first: 128,
        stride: 64,
    }
}

/// What a crash test left.
struct CrashRun {
    boot: support::guest::Boot,
    /// Every daemon's log.
    logs: String,
    /// A daemon found a broken ring.
    broken: bool,
    image: PathBuf,
    _dir: TempDir,
}

/// Run the crash test: the daemon is killed and restarted `kills` times while fio runs.
fn crash_run(
    name: &str,
    disk: fn(&Path) -> CrashImage,
    extra: &[&'static str],
    kills: usize,
) -> CrashRun {
    let dir = TempDir::new(name);
    let crash = disk(dir.path());
    let img = crash.path.clone();
    let sock = dir.join("vblk.sock");
    let mut args: Vec<&'static str> = vec!["--delay-every", "4:30"];
    args.extend_from_slice(extra);
    let export = Export::new(&img, 2).args(&args);
    let first = Daemon::start(
        Backend::Vblk,
        "vblk-0",
        &export,
        &sock,
        &dir.join("vblk-0.log"),
    );
    // The boot is stopped early (through a watched sentinel) when a daemon finds a broken
    // ring: without inflight tracking the guest would otherwise hang until the timeout.
    let mut sentinel: Child = Command::new("sleep").arg("600").spawn().unwrap();
    let broken = Arc::new(AtomicBool::new(false));
    // Set once the guest is done: the killer stops (a new daemon would wait for a QEMU
    // that is gone).
    let done = Arc::new(AtomicBool::new(false));
    // A kill may catch the guest between requests (a reconnect it is still taking up, a
    // round's verify just done): up to `kills` more kills are made until one restart
    // finds requests in flight, which is what the test is for.
    let most = 2 * kills;
    let logs: Vec<PathBuf> = (0..=most)
        .map(|i| dir.join(format!("vblk-{i}.log")))
        .collect();
    let killer = {
        let (img, sock, logs, broken) = (img.clone(), sock.clone(), logs.clone(), broken.clone());
        let sentinel_pid = sentinel.id();
        let (start_at, stop_at) = (crash.start_at, crash.stop_at);
        let done = done.clone();
        let args = args.clone();
        std::thread::spawn(move || {
            let mut daemon = first;
            if !wait_for_marker(&img, start_at, b"VBLK-FIO-START", Duration::from_secs(240)) {
                return daemon;
            }
            let watch = |logs: &[PathBuf]| {
                logs.iter().any(|l| {
                    fs::read_to_string(l)
                        .is_ok_and(|t| t.contains("it runs again when the frontend restarts it"))
                })
            };
            let resubmitted = |logs: &[PathBuf]| {
                logs.iter().any(|l| {
                    fs::read_to_string(l).is_ok_and(|t| {
                        t.lines()
                            .any(|l| l.contains("resubmitting") && !l.contains("resubmitting 0 "))
                    })
                })
            };
            for k in 1..=most {
                // Each daemon serves for a while before it is killed: QEMU reattaches
                // within a second or so (reconnect=1), then runs the guest's I/O.
                let t0 = Instant::now();
                while !fs::read_to_string(&logs[k - 1])
                    .is_ok_and(|t| t.contains("frontend connected"))
                    && t0.elapsed() < Duration::from_secs(60)
                    && !done.load(Ordering::SeqCst)
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                if done.load(Ordering::SeqCst) {
                    return daemon;
                }
                std::thread::sleep(Duration::from_millis(1500));
                if k > kills && resubmitted(&logs[..k]) {
                    break;
                }
                signal(daemon.pid(), libc::SIGKILL);
                // Dropping a Daemon reaps it and removes its socket path: before the next
                // one binds there.
                drop(daemon);
                std::thread::sleep(Duration::from_millis(200));
                daemon = Daemon::start(
                    Backend::Vblk,
                    &format!("vblk-{k}"),
                    &Export::new(&img, 2).args(&args),
                    &sock,
                    &logs[k],
                );
                if watch(&logs[..=k]) {
                    break;
                }
            }
            // Tell the guest to stop after its current round, then keep watching until it
            // is done (or stopped).
            {
                use std::os::unix::fs::FileExt;
                let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
                f.write_all_at(b"VBLK-STOP", stop_at).unwrap();
                f.sync_all().unwrap();
            }
            for _ in 0..1200 {
                if watch(&logs) {
                    broken.store(true, Ordering::SeqCst);
                    signal(sentinel_pid, libc::SIGKILL);
                    break;
                }
                if sentinel_gone(sentinel_pid) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            daemon
        })
    };
    let script = format!(
        "{}\nFIRST={}\nSTRIDE={}\n{CRASH_FIO}",
        support::fio::GUEST_FUNCTIONS,
        crash.first,
        crash.stride
    );
    let boot = Guest::new(name)
        .disk_reconnecting(&sock, 2)
        .layer(fio_layer())
        .watch("broken-ring sentinel", sentinel.id())
        .timeout(Duration::from_secs(300))
        .script(script)
        .boot();
    done.store(true, Ordering::SeqCst);
    let _ = sentinel.kill();
    let _ = sentinel.wait();
    let last = killer.join().unwrap();
    drop(last);
    let text: String = logs
        .iter()
        .map(|l| fs::read_to_string(l).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n----\n");
    CrashRun {
        boot,
        logs: text,
        broken: broken.load(Ordering::SeqCst),
        image: img,
        _dir: dir,
    }
}

fn sentinel_gone(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z"))
        .unwrap_or(true)
}

#[test]
fn a_guest_survives_repeated_kill_9_with_completions_out_of_order() {
    let CrashRun {
        boot, logs, broken, ..
    } = crash_run("crash-inflight", raw_crash_image, &[], 6);
    assert!(
        !broken,
        "a daemon found a broken ring\n{logs}\n{}",
        boot.report()
    );
    boot.assert_ok(&["fio", "io-errors"]);
    let resubmitted: usize = logs
        .lines()
        .filter(|l| l.contains("resubmitting") && !l.contains("resubmitting 0 "))
        .count();
    assert!(
        resubmitted > 0,
        "no restart found requests in flight to resubmit: the test did not test recovery\n{logs}"
    );
    let connects = logs.matches("frontend connected").count();
    assert!(connects >= 7, "{connects} connections for 6 kills\n{logs}");
    eprintln!(
        "kill -9 test: {connects} daemons, {resubmitted} restarts resubmitted requests; guest: {}",
        boot.check("fio").map_or("", |c| c.detail.as_str())
    );
}

/// The same on a qcow2 image, ten kills, every fio round writing clusters never written
/// before (allocations, whose mappings a kill may catch in memory): fio's verify passes
/// across the restarts, and `qemu-img check` finds no corruption (leaked clusters only).
#[test]
fn a_guest_on_qcow2_survives_ten_kill_9_under_allocating_writes() {
    let run = crash_run("crash-qcow2", qcow2_crash_image, &["--format", "qcow2"], 10);
    let CrashRun {
        boot,
        logs,
        broken,
        image,
        ..
    } = &run;
    assert!(
        !broken,
        "a daemon found a broken ring\n{logs}\n{}",
        boot.report()
    );
    assert!(
        boot.failed().is_empty() && boot.check("fio").is_some(),
        "the guest's checks failed\n---- daemons ----\n{logs}\n{}",
        boot.report()
    );
    let connects = logs.matches("frontend connected").count();
    assert!(
        connects >= 11,
        "{connects} connections for 10 kills\n{logs}"
    );
    let out = Command::new("qemu-img")
        .arg("check")
        .arg(image)
        .output()
        .expect("qemu-img (qemu-utils)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().unwrap_or(-1);
    assert!(
        (code == 0 || code == 3) && !text.contains("ERROR"),
        "qemu-img check after the kills exited {code}:\n{text}"
    );
    eprintln!(
        "qcow2 kill -9 test: {connects} daemons; guest: {}; qemu-img check exit {code}",
        boot.check("fio").map_or("", |c| c.detail.as_str())
    );
}

#[test]
fn without_the_inflight_region_the_same_crashes_are_not_survived() {
    let CrashRun {
        boot, logs, broken, ..
    } = crash_run("crash-no-inflight", raw_crash_image, &["--no-inflight"], 6);
    let fio_ok = boot.check("fio").is_some_and(|c| c.ok);
    let clean = !broken && boot.failed().is_empty() && boot.done && fio_ok;
    assert!(
        !clean,
        "without inflight tracking the run came out clean: the crash test would not catch \
         a lost request\n{logs}\n{}",
        boot.report()
    );
    eprintln!(
        "without inflight: broken ring found: {broken}; fio ok: {fio_ok}; guest done: {}",
        boot.done
    );
}
