//! Live migration: a running guest moves between two `vblk serve` daemons on one image,
//! back and forth, under fio with `verify=crc32c`, and loses nothing.
//!
//! Two daemons serve the same raw image (shared storage, here one file), both with image
//! locking on: the first owns it, the second starts with `--incoming`. A real Linux guest
//! (QEMU 7.2, TCG, 2 vCPUs, 2 queues) turns its disk's write cache off, then runs fio
//! passes until the host tells it to stop: random writes of 4 KiB to 256 KiB with crc32c
//! headers and `verify_backlog`, two jobs (one per vCPU, so both queues carry I/O) on
//! their own 16 MiB, each pass verified; every other pass is read-heavy (a `verify_only`
//! pass over what the pass before wrote). Meanwhile the host migrates the guest six times:
//! from the first daemon's QEMU to a new QEMU on the second daemon (`-incoming
//! unix:PATH`, QMP `migrate`), and back, three round trips. After the last one the host
//! kills the daemon the guest left (`kill -9`) and tells the guest to stop (a marker in the
//! image's last 4 KiB); the guest's last pass and a final verify must be clean, and its
//! disk must still be write-through.
//!
//! The same run on a qcow2 image of 4 KiB clusters, new at the start: the passes allocate
//! on both daemons, and each must read the image's metadata again when it takes the
//! image over (qcow2/handoff.rs in the storage crate).
//!
//! The same run with every fourth request of each daemon held 200 ms before it reaches
//! the disk (`--delay-every 4:200:hold`): every switchover then finds requests in flight,
//! which must finish (and be logged) before the ring stop is answered. And the same run
//! against qemu-storage-daemon (two instances, default locking), as the reference for the
//! harness, with one difference: its switchovers come while the guest pauses its I/O.
//! qemu-storage-daemon (libvhost-user) answers a ring stop at once and completes the
//! requests in flight afterwards, into the source's memory, after QEMU's last look at the
//! dirty log: the destination never sees them and the guest waits for them for ever (a
//! run with I/O at every switchover hung at the fourth).
//!
//! Every destination QEMU starts with `-S`: after each migration both QEMU processes are
//! stopped and neither daemon runs a ring, so the destination's guest memory must equal
//! the source's byte for byte (read from each QEMU's memfd through /proc). A page that
//! differs is a write that no dirty log carried — the device's, or QEMU's own tracking's —
//! and is reported with its bytes and where the virtqueues are, long before it would
//! corrupt the guest (a fio verify error, or an oops when the page is kernel memory).
//!
//! That comparison needs QEMU's own tracking of the vCPUs' writes to be whole, and QEMU
//! 7.2 under TCG loses such writes when the RAM is a multiple of 64 pages: every VM here
//! has 8 KiB more (`Guest::migratable`, which says why), and the last test checks the
//! premise with a guest that writes memory hard while its disk is idle.
//!
//! Asserted besides the guest's checks: every migration completed; each source daemon
//! logged the switchover (dirty logging on, writes made durable, locks released) and each
//! destination took the image over; no daemon logged an error.
//!
//! Needs (Debian): qemu-system-x86, qemu-system-common, linux-image-amd64,
//! busybox-static, fio.

mod support;

use std::fs;
use std::time::{Duration, Instant};

use support::assets::target_dir;
use support::daemon::{Backend, Daemon, Export};
use support::guest::{Boot, Guest, TempDir};
use support::layer::fio_layer;
use support::migration::Vm;

const MIB: u64 = 1 << 20;
/// The disk: fio uses the first 32 MiB, the stop marker is in the last 4 KiB.
const DISK_BYTES: u64 = 128 * MIB;
/// Migrations: three round trips.
const MIGRATIONS: usize = 6;
/// The most one migration may take.
const MIGRATION_LIMIT: Duration = Duration::from_secs(90);

/// The guest's script; with `gaps`, it stops its I/O for a few seconds after each pass
/// (and says `VBLK-GAP n`), for a backend that cannot stop a ring with requests in flight.
fn script(gaps: bool) -> String {
    let mark = DISK_BYTES / 4096 - 1;
    let gap = if gaps {
        "echo \"VBLK-GAP $i\"; sleep 5"
    } else {
        ":"
    };
    format!(
        r#"
dev=/dev/vda
echo "write through" > /sys/block/vda/cache_type
check_eq cache_off "$(cat /sys/block/vda/cache_type)" "write through"
job="--filename=$dev --direct=1 --ioengine=libaio --iodepth=16 --numjobs=2 \
--cpus_allowed=0-1 --cpus_allowed_policy=split --size=16M --offset_increment=16M \
--group_reporting --verify=crc32c --bsrange=4k-256k --randrepeat=1"
stop() {{ [ "$(dd if=$dev bs=4096 skip={mark} count=1 iflag=direct 2>/dev/null | head -c 4)" = STOP ]; }}
echo VBLK-MIGRATE-READY
i=0
failed=0
while :; do
    seed=$((i / 2 + 1))
    if [ $((i % 2)) -eq 0 ]; then
        fio --name=w $job --rw=randwrite --randseed=$seed --verify_backlog=32 > /tmp/fio.out 2>&1
    else
        fio --name=w $job --rw=randwrite --randseed=$seed --verify_only > /tmp/fio.out 2>&1
    fi
    rc=$?
    echo "VBLK-PASS $i rc=$rc"
    if [ $rc -ne 0 ]; then
        failed=$((failed + 1))
        tail -c 1500 /tmp/fio.out
    fi
    i=$((i + 1))
    {gap}
    if [ $((i % 2)) -eq 0 ] && stop; then break; fi
    if [ $i -ge 400 ]; then break; fi
done
check_eq fio_passes_failed "$failed" 0
check_gt fio_passes "$i" 1
check final_verify fio --name=w $job --rw=randwrite --randseed=$seed --verify_only
check_eq cache_still_off "$(cat /sys/block/vda/cache_type)" "write through"
"#
    )
}

/// Which daemons serve the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Vblk,
    VblkDelayed,
    /// A qcow2 image with 4 KiB clusters: the passes allocate on both daemons, each of
    /// which must read the image's metadata again when it takes the image over.
    VblkQcow2,
    QemuStorageDaemon,
}

/// One run: boot, six migrations, stop, verify. None if everything held.
fn run(kind: Kind) -> Option<String> {
    let name = format!("migrate-{kind:?}");
    let dir = TempDir::new_in(&target_dir().join("tmp"), &name);
    // The file, and where in it the stop marker is.
    let (image, stop_at) = if kind == Kind::VblkQcow2 {
        let (path, hosts) = support::guest::qcow2_with_markers(
            dir.path(),
            "disk.qcow2",
            &DISK_BYTES.to_string(),
            4096,
            &[DISK_BYTES - 4096],
        );
        (path, hosts[0])
    } else {
        let image = dir.join("disk.img");
        fs::File::create(&image)
            .unwrap()
            .set_len(DISK_BYTES)
            .unwrap();
        (image, DISK_BYTES - 4096)
    };
    let (backend, mut extra): (Backend, Vec<&str>) = match kind {
        Kind::Vblk => (Backend::Vblk, vec!["--format", "raw"]),
        Kind::VblkQcow2 => (Backend::Vblk, vec!["--format", "qcow2"]),
        Kind::VblkDelayed => (
            Backend::Vblk,
            vec!["--format", "raw", "--delay-every", "4:200:hold"],
        ),
        Kind::QemuStorageDaemon => (Backend::QemuStorageDaemon, vec![]),
    };
    let export = Export::new(image.display().to_string(), 2).args(&extra);
    let a = Daemon::start(
        backend,
        "daemon a",
        &export,
        &dir.join("a.sock"),
        &dir.join("a.log"),
    );
    extra.push("--incoming");
    let export = Export::new(image.display().to_string(), 2).args(&extra);
    let b = Daemon::start(
        backend,
        "daemon b",
        &export,
        &dir.join("b.sock"),
        &dir.join("b.log"),
    );
    let mut daemons = [a, b];
    let guest = Guest::new(&name)
        .disk(&daemons[0].socket, 2)
        .layer(fio_layer())
        .script(script(kind == Kind::QemuStorageDaemon))
        .timeout(Duration::from_secs(600));
    let (work, initrd) = guest.prepare();
    let mut problems = Vec::new();
    let mut consoles = Vec::new();
    let mut vm = Vm::start(&guest, &initrd, work.path(), "vm0", None);
    let t0 = Instant::now();
    if !vm.wait_console("VBLK-MIGRATE-READY", Duration::from_secs(120)) {
        problems.push("the guest did not start its fio passes".to_string());
    }
    let mut on = 0; // the daemon serving the guest now
    for m in 0..MIGRATIONS {
        if !problems.is_empty() {
            break;
        }
        // Let fio run a while on this side; qemu-storage-daemon answers a ring stop at once
        // and completes the requests in flight later, into the source's memory (lost:
        // the guest waits for them for ever), so its switchovers come in the guest's gaps.
        std::thread::sleep(Duration::from_secs(2));
        if kind == Kind::QemuStorageDaemon {
            let gaps = vm.console().matches("VBLK-GAP").count();
            let deadline = Instant::now() + Duration::from_secs(120);
            while vm.console().matches("VBLK-GAP").count() == gaps && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let to = 1 - on;
        let mig = work.join(format!("mig{m}.sock"));
        let dest_guest = guest.with_socket(0, &daemons[to].socket);
        let mut dest = Vm::start(
            &dest_guest,
            &initrd,
            work.path(),
            &format!("vm{}", m + 1),
            Some(&mig),
        );
        match vm.migrate_to(&dest, &mig, MIGRATION_LIMIT) {
            Ok(r) => {
                eprintln!(
                    "{name}: migration {m} (daemon {on} -> {to}) completed at {:.1} s: total {} ms, downtime {} ms",
                    t0.elapsed().as_secs_f64(),
                    r["total-time"],
                    r["downtime"]
                );
                problems.extend(compare_memory(m, &mut vm, &dest));
                if let Err(e) = dest.resume() {
                    problems.push(format!(
                        "migration {m}: the destination did not resume: {e}"
                    ));
                }
            }
            Err(e) => problems.push(e),
        }
        consoles.push(vm.console());
        let old = std::mem::replace(&mut vm, dest);
        if old.quit(Duration::from_secs(20)).is_none() {
            problems.push(format!("{}: QEMU did not quit", old_name(m)));
        }
        on = to;
    }
    // The daemon the guest left is idle now; killing it must not touch the disk the other
    // one serves.
    if kind != Kind::QemuStorageDaemon && problems.is_empty() {
        daemons[1 - on].kill();
    }
    // Tell the guest to stop: a marker it reads through its disk.
    support::guest::write_at(&image, stop_at, b"STOP");
    if !vm.wait_console("VBLK-DONE", Duration::from_secs(300)) {
        problems.push("the guest did not finish after the migrations".to_string());
    }
    let status = vm.wait(Duration::from_secs(30));
    consoles.push(vm.console());
    let serial = consoles.join("\n---- (migrated) ----\n");
    let boot = Boot::parse(
        &guest,
        vm.command_line.clone(),
        status.unwrap_or_else(|| std::os::unix::process::ExitStatusExt::from_raw(9 << 8)),
        t0.elapsed(),
        serial,
        fs::read_to_string(&vm.stderr).unwrap_or_default(),
    );
    for c in boot.failed() {
        problems.push(format!("check {} failed: {}", c.name, c.detail));
    }
    if let Some(c) = boot.check("fio_passes") {
        let during = consoles[..consoles.len() - 1]
            .iter()
            .map(|c| c.matches("VBLK-PASS").count())
            .sum::<usize>();
        eprintln!(
            "{name}: fio passes {} ({during} finished before the last switchover)",
            c.detail
        );
    }
    for c in [
        "cache_off",
        "fio_passes_failed",
        "fio_passes",
        "final_verify",
        "cache_still_off",
    ] {
        if boot.check(c).is_none() {
            problems.push(format!("check {c} did not run"));
        }
    }
    if kind != Kind::QemuStorageDaemon {
        problems.extend(check_daemon_logs(&daemons));
    }
    if problems.is_empty() {
        return None;
    }
    let mut report = format!("{name}: {}\n{}", problems.join("\n"), boot.report());
    for d in &daemons {
        report.push_str(&format!("\n---- {} ----\n{}", d.name, d.log_text()));
    }
    Some(report)
}

/// The destination's memory must equal the source's: both are stopped (the source after
/// its switchover, the destination by `-S`), and the device of neither runs. A page that
/// differs is a write the dirty log or QEMU's own tracking did not carry.
fn compare_memory(m: usize, source: &mut Vm, dest: &Vm) -> Option<String> {
    let (a, b) = match (source.ram(), dest.ram()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return Some(format!("migration {m}: {e}")),
    };
    if a.len() != b.len() {
        return Some(format!(
            "migration {m}: source RAM {} bytes, destination {}",
            a.len(),
            b.len()
        ));
    }
    let differ: Vec<usize> = (0..a.len() / 4096)
        .filter(|&p| a[p * 4096..(p + 1) * 4096] != b[p * 4096..(p + 1) * 4096])
        .collect();
    if differ.is_empty() {
        return None;
    }
    let mut s = format!(
        "migration {m}: {} pages of guest memory differ between source and destination:",
        differ.len()
    );
    for &p in differ.iter().take(8) {
        let r = p * 4096..(p + 1) * 4096;
        let bytes = a[r.clone()]
            .iter()
            .zip(&b[r.clone()])
            .filter(|(x, y)| x != y)
            .count();
        s.push_str(&format!("\n  gpa {:#x}: {bytes} bytes differ", p * 4096));
        // Each differing 16-byte line, source above destination.
        let lines: Vec<usize> = (r.start / 16..r.end / 16)
            .filter(|&l| a[l * 16..l * 16 + 16] != b[l * 16..l * 16 + 16])
            .collect();
        for &l in lines.iter().take(16) {
            let at = l * 16;
            s.push_str(&format!(
                "\n    {at:#x} source {:02x?}\n    {:>width$} destination {:02x?}",
                &a[at..at + 16],
                "",
                &b[at..at + 16],
                width = format!("{at:#x}").len()
            ));
        }
    }
    s.push_str(&format!("\n  the source's virtqueues: {}", source.queues()));
    Some(s)
}

fn old_name(m: usize) -> String {
    format!("vm{m}")
}

/// What each vblk daemon must have logged: three switchovers each way.
fn check_daemon_logs(daemons: &[Daemon; 2]) -> Vec<String> {
    let mut p = Vec::new();
    for d in daemons {
        let log = d.log_text();
        let handed = log
            .matches("writes made durable, the image's write locks released")
            .count();
        let took = log.matches("took the image over").count();
        if handed < MIGRATIONS / 2 {
            p.push(format!(
                "{}: {handed} switchovers logged, want {}",
                d.name,
                MIGRATIONS / 2
            ));
        }
        // The first daemon owned the image from the start; it takes it back twice, the
        // second takes it three times.
        if took < MIGRATIONS / 2 - 1 {
            p.push(format!("{}: took the image over {took} times", d.name));
        }
        if !log.contains("dirty logging on") {
            p.push(format!("{}: dirty logging never went on", d.name));
        }
    }
    p.extend(check_daemon_errors(daemons));
    p
}

fn run_all(kinds: &[Kind]) {
    let only = std::env::var("VBLK_MIGRATION_ONLY").unwrap_or_default();
    let mut failures = Vec::new();
    let mut ran = 0;
    for &k in kinds {
        if !format!("{k:?}").contains(&only) {
            continue;
        }
        ran += 1;
        let t0 = Instant::now();
        let r = run(k);
        eprintln!(
            "{k:?}: {} in {:.0} s",
            if r.is_none() { "ok" } else { "FAILED" },
            t0.elapsed().as_secs_f64()
        );
        failures.extend(r);
    }
    assert!(ran > 0, "VBLK_MIGRATION_ONLY={only} matches nothing");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_guest_migrates_back_and_forth_between_two_vblk_daemons_under_fio_verify() {
    run_all(&[Kind::Vblk, Kind::VblkDelayed, Kind::VblkQcow2]);
}

#[test]
fn the_same_migrations_pass_against_qemu_storage_daemon() {
    run_all(&[Kind::QemuStorageDaemon]);
}

/// The harness's own premise: a migration carries every page the guest's vCPUs write, so
/// a page that differs after a switchover can only be a device's unlogged write. A guest
/// whose disk (a vblk daemon pair) stays idle writes 48 MiB of tmpfs at random with both
/// vCPUs through fio's mmap engine, and moves four times; after each move the two
/// stopped QEMU processes must hold the same memory. With QEMU 7.2's TCG and a RAM size
/// that is a multiple of 64 pages, most moves lost hundreds to thousands of pages and the
/// guest oopsed after one or two (see `Guest::migratable`).
#[test]
fn a_cpu_busy_guest_migrates_without_losing_a_page() {
    const MOVES: usize = 4;
    let dir = TempDir::new_in(&target_dir().join("tmp"), "migrate-cpu-busy");
    let image = dir.join("disk.img");
    fs::File::create(&image)
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    let export = Export::new(image.display().to_string(), 2).args(&["--format", "raw"]);
    let a = Daemon::start(
        Backend::Vblk,
        "daemon a",
        &export,
        &dir.join("a.sock"),
        &dir.join("a.log"),
    );
    let export =
        Export::new(image.display().to_string(), 2).args(&["--format", "raw", "--incoming"]);
    let b = Daemon::start(
        Backend::Vblk,
        "daemon b",
        &export,
        &dir.join("b.sock"),
        &dir.join("b.log"),
    );
    let daemons = [a, b];
    let guest = Guest::new("migrate-cpu-busy")
        .disk(&daemons[0].socket, 2)
        .layer(fio_layer())
        .script(
            "fio --name=m --ioengine=mmap --filename=/dev/shm/m --size=48M --rw=randwrite \
             --bs=4k --numjobs=2 --cpus_allowed=0-1 --cpus_allowed_policy=split \
             --time_based --runtime=100000 > /dev/null 2>&1 &\n\
             echo VBLK-MIGRATE-READY\nwhile :; do sleep 1; done\n",
        )
        .timeout(Duration::from_secs(600));
    let (work, initrd) = guest.prepare();
    let mut vm = Vm::start(&guest, &initrd, work.path(), "vm0", None);
    assert!(
        vm.wait_console("VBLK-MIGRATE-READY", Duration::from_secs(120)),
        "the guest did not start writing its memory:\n{}",
        vm.console()
    );
    let mut problems = Vec::new();
    let mut on = 0;
    for m in 0..MOVES {
        std::thread::sleep(Duration::from_secs(2));
        let to = 1 - on;
        let mig = work.join(format!("mig{m}.sock"));
        let mut dest = Vm::start(
            &guest.with_socket(0, &daemons[to].socket),
            &initrd,
            work.path(),
            &format!("vm{}", m + 1),
            Some(&mig),
        );
        match vm.migrate_to(&dest, &mig, MIGRATION_LIMIT) {
            Ok(_) => {
                problems.extend(compare_memory(m, &mut vm, &dest));
                if let Err(e) = dest.resume() {
                    problems.push(format!(
                        "migration {m}: the destination did not resume: {e}"
                    ));
                }
            }
            Err(e) => problems.push(e),
        }
        let old = std::mem::replace(&mut vm, dest);
        old.quit(Duration::from_secs(20));
        on = to;
        if !problems.is_empty() {
            break;
        }
    }
    problems.extend(check_daemon_errors(&daemons));
    assert!(
        problems.is_empty(),
        "{}\n---- console ----\n{}",
        problems.join("\n"),
        vm.console()
    );
}

/// Every ERROR a daemon logged.
fn check_daemon_errors(daemons: &[Daemon; 2]) -> Vec<String> {
    let mut p = Vec::new();
    for d in daemons {
        for l in d.log_text().lines().filter(|l| l.contains(" ERROR ")) {
            p.push(format!("{}: {l}", d.name));
        }
    }
    p
}
