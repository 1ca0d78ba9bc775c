//! A guest rebooted while its storage holds writes: nothing written before the reboot may
//! land after what the rebooted guest writes.
//!
//! A real Linux guest (QEMU, TCG) on `vblk serve` runs fio random writes (`verify=crc32c`
//! headers) on the first 8 MiB of its disk through storage that holds some writes for
//! [`HOLD`] — the write itself, before it reaches the disk, not only its completion — and
//! is reset mid-write (`echo b > /proc/sysrq-trigger`; QEMU stops the rings with
//! GET_VRING_BASE, frees its inflight region and starts afresh). After the reboot the
//! guest writes the same 8 MiB again with another seed, waits longer than any write can
//! be held, and has fio verify every block: a write from before the reboot that landed
//! late shows as a bad checksum.
//!
//! The storage that holds writes is either vblk's delaying engine
//! (`--delay-every N:MS:hold-writes`) on a file, or an NBD export served by nbdkit's `sh`
//! plugin whose script sleeps on writes to the fio area while the disk's marker says the
//! guest is in its first boot. Each runs twice: with the default drain (the stop waits
//! for the held writes) and with `--drain-timeout-secs 2` (the stop gives up on them; the
//! queues of the rebooted guest are fenced until they land).
//!
//! How the guest knows which boot it is in: the last 4 KiB of the disk hold a marker,
//! `VBLKBOOT1` written before the first fio, `VBLKBOOT2` after the reboot.
//!
//! Needs (Debian): qemu-system-x86, linux-image-amd64, busybox-static, fio, nbdkit.

mod support;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::assets::{require_programs, target_dir};
use support::daemon::{Backend, Daemon, Export};
use support::guest::{Guest, TempDir};
use support::layer::fio_layer;

const MIB: u64 = 1 << 20;
/// The disk.
const DISK_BYTES: u64 = 64 * MIB;
/// fio's area: the first 8 MiB.
const AREA: u64 = 8 * MIB;
/// How long a held write is held. The first boot's fio fills its 16 slots with held
/// writes within its first second; they must land after the rebooted guest has written
/// (about 12 s later: 5 s of fio, the reset, 5 s of boot), so they are held for longer.
const HOLD: Duration = Duration::from_secs(20);

/// The guest's script: which boot it is comes from the marker in the last 4 KiB.
fn script() -> String {
    let mark_block = DISK_BYTES / 4096 - 1;
    let hold = HOLD.as_secs() + 3;
    format!(
        r#"
dev=/dev/vda
mark() {{ printf '%-4096s' "$1" | dd of=$dev bs=4096 seek={mark_block} count=1 iflag=fullblock oflag=direct conv=fsync 2>/dev/null; }}
m=$(dd if=$dev bs=4096 skip={mark_block} count=1 iflag=direct 2>/dev/null | head -c 9)
job="--filename=$dev --size={AREA} --direct=1 --ioengine=libaio --verify=crc32c"
if [ "$m" != "VBLKBOOT1" ]; then
    echo "VBLK-PHASE first boot"
    mark VBLKBOOT1
    fio --name=before $job --rw=randwrite --bs=4k --iodepth=16 --randseed=1 \
        --do_verify=0 --time_based --runtime=120 >/dev/null 2>&1 &
    sleep 5
    echo "VBLK-PHASE resetting with writes held"
    sleep 1
    echo b > /proc/sysrq-trigger
    sleep 120
    echo "VBLK-PHASE the reset did not happen"
else
    echo "VBLK-PHASE second boot"
    mark VBLKBOOT2
    check write_after_reboot fio --name=after $job --rw=write --bs=64k --iodepth=128 \
        --randseed=2 --do_verify=0
    sleep {hold}
    check verify_after_reboot fio --name=after $job --rw=write --bs=64k --iodepth=128 \
        --randseed=2 --verify_only
fi
"#
    )
}

/// The nbdkit `sh` plugin: a file served in parallel, writes below [`AREA`] held for
/// [`HOLD`] while the marker says first boot.
fn plugin(image: &Path) -> String {
    let mark_off = DISK_BYTES - 4096;
    let hold = HOLD.as_secs();
    format!(
        r#"#!/bin/sh
f={image}
case "$1" in
    thread_model) echo parallel ;;
    get_size) stat -c %s "$f" ;;
    can_write|can_flush) exit 0 ;;
    can_trim|can_zero|can_multi_conn) exit 3 ;;
    can_fua) echo none ;;
    pread) dd if="$f" skip="$4" count="$3" iflag=skip_bytes,count_bytes status=none ;;
    pwrite)
        if [ "$4" -lt {AREA} ] &&
           [ "$(dd if="$f" bs=1 skip={mark_off} count=9 status=none)" = VBLKBOOT1 ]; then
            sleep {hold}
        fi
        dd of="$f" seek="$4" oflag=seek_bytes conv=notrunc status=none ;;
    flush) sync "$f" ;;
    *) exit 2 ;;
esac
"#,
        image = image.display()
    )
}

/// nbdkit serving `image` through [`plugin`] on a Unix socket; killed on drop.
struct Nbdkit {
    child: Child,
    sock: PathBuf,
}

impl Nbdkit {
    fn start(dir: &Path, image: &Path) -> Nbdkit {
        require_programs(&[("nbdkit", "nbdkit")]);
        let script = dir.join("hold.sh");
        fs::write(&script, plugin(image)).unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        let sock = dir.join("nbd.sock");
        // 64 threads: the first boot's held writes (16) must not keep the rebooted guest's
        // requests from being served (nbdkit's default is 16 per connection).
        let child = Command::new("nbdkit")
            .args(["-f", "-t", "64", "-U"])
            .arg(&sock)
            .arg("sh")
            .arg(&script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("nbdkit.log")).unwrap())
            .spawn()
            .expect("start nbdkit");
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "nbdkit did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Nbdkit { child, sock }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the held writes are held.
#[derive(Clone, Copy, Debug)]
enum Storage {
    /// vblk's delaying engine on a file: every 8th write held.
    DelayEngine,
    /// An NBD server that holds first-boot writes to the fio area.
    Nbd,
}

/// One reboot under held writes; a failure message or None.
fn run(storage: Storage, drain_secs: Option<u64>) -> Option<String> {
    let name = format!(
        "reboot-{storage:?}-{}",
        drain_secs.map_or("drain".into(), |s| format!("drain{s}s"))
    );
    let dir = TempDir::new_in(&target_dir().join("tmp"), &name);
    let image = dir.join("disk.img");
    fs::File::create(&image)
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    let mut args: Vec<String> = vec!["--format".into(), "raw".into()];
    let mut nbd = None;
    let blk_file = match storage {
        Storage::DelayEngine => {
            let ms = HOLD.as_millis();
            args.extend(["--delay-every".into(), format!("8:{ms}:hold-writes")]);
            image.display().to_string()
        }
        Storage::Nbd => {
            let server = Nbdkit::start(dir.path(), &image);
            let uri = format!("nbd+unix:///?socket={}", server.sock.display());
            nbd = Some(server);
            uri
        }
    };
    if let Some(s) = drain_secs {
        args.extend(["--drain-timeout-secs".into(), s.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let export = Export::new(&blk_file, 2).args(&args);
    let daemon = Daemon::start(
        Backend::Vblk,
        &name,
        &export,
        &dir.join("vblk.sock"),
        &dir.join("vblk.log"),
    );
    let boot = Guest::new(&name)
        .disk(&daemon.socket, 2)
        .layer(fio_layer())
        .allow_reboot()
        .attach_log("vblk serve", &daemon.log)
        .watch("vblk serve", daemon.pid())
        .script(script())
        .timeout(Duration::from_secs(400))
        .boot();
    drop(nbd);
    let log = daemon.log_text();
    let mut problems = Vec::new();
    if !boot
        .serial
        .contains("VBLK-PHASE resetting with writes held")
    {
        problems.push("the first boot did not reach the reset".to_string());
    }
    if !boot.serial.contains("VBLK-PHASE second boot") {
        problems.push("the guest did not come back after the reset".to_string());
    }
    for c in ["write_after_reboot", "verify_after_reboot"] {
        match boot.check(c) {
            Some(ch) if ch.ok => {}
            Some(ch) => problems.push(format!("{c} failed: {}", ch.detail)),
            None => problems.push(format!("{c} did not run")),
        }
    }
    // The reset really found writes held at the storage, and the daemon said what it did
    // with them.
    let held = match drain_secs {
        None => log.contains("after waiting"),
        Some(_) => log.contains("they are fenced") && log.contains("it waited"),
    };
    if !held {
        problems.push(format!(
            "the daemon's log does not show the reset finding held writes ({})",
            if drain_secs.is_some() {
                "a drain that ran out and a fenced queue"
            } else {
                "a stop that waited for them"
            }
        ));
    }
    if problems.is_empty() && boot.done {
        return None;
    }
    Some(format!(
        "{name}: {}\n{}",
        problems.join("; "),
        boot.report()
    ))
}

/// `VBLK_REBOOT_ONLY=DelayEngine-drain2s` runs the cases whose names contain it.
#[test]
fn a_reboot_never_lets_a_held_write_land_after_the_rebooted_guests_writes() {
    let only = std::env::var("VBLK_REBOOT_ONLY").unwrap_or_default();
    let mut failures = Vec::new();
    let mut ran = 0;
    for storage in [Storage::DelayEngine, Storage::Nbd] {
        for drain in [None, Some(2)] {
            let name = format!(
                "{storage:?}-{}",
                drain.map_or("drain".into(), |s| format!("drain{s}s"))
            );
            if !name.contains(&only) {
                continue;
            }
            ran += 1;
            let t0 = Instant::now();
            let outcome = run(storage, drain);
            eprintln!(
                "{name}: {} in {:.0} s",
                if outcome.is_none() { "ok" } else { "FAILED" },
                t0.elapsed().as_secs_f64()
            );
            failures.extend(outcome);
        }
    }
    assert!(ran > 0, "VBLK_REBOOT_ONLY={only} matches no case");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
