//! Data-integrity suite: a real Linux guest (QEMU 7.2, TCG, 2 vCPUs) runs Debian's fio
//! with `verify=crc32c` on disks served by `vblk serve`, over the matrix
//!
//! - QEMU `queue-size` 64, 128, 256 and 1024: one boot each;
//! - `--cache none` and `--cache writeback` × `--engine io_uring` and `--engine sync`:
//!   four disks of each boot, one daemon each (2 queues, 2 workers, `--queue-size`
//!   1024, 256, 256, 1024: see [`daemon_queue_size`]);
//! - `--engine aio` (which needs `--cache none`) and `--engine threads`: a fifth disk,
//!   one of them per boot ([`FIFTH_DISK`]), so that each meets both daemon queue sizes
//!   and threads both cache modes. A disk adds 1-2 s to a boot (fio writes and reads
//!   all the disks of a boot in one run) where a boot takes 18-35 s, so the two engines
//!   ride on the boots there are rather than multiply the matrix.
//!
//! What the guest does (`support::fio` has the jobs and the reasons):
//! - reads every disk's limits from sysfs and raises `max_sectors_kb`, so that only the
//!   segment limit splits a request;
//! - fragments its memory (`support/frag.c`, `transparent_hugepage=never`, compaction
//!   off), so that fio's buffers are scattered 4 KiB pages and a request carries one
//!   segment per page: Linux builds indirect descriptor tables of up to
//!   `max_segments + 2` entries, whatever the ring size;
//! - runs fio, O_DIRECT, engines io_uring and psync, two clones per job pinned one per
//!   vCPU (so both virtqueues carry I/O), each job on all five disks: 512 B, 3.5 KiB,
//!   4 KiB, 65.5 KiB, 64 KiB, 1 MiB, 1280 KiB and `max_segments` pages, all at once
//!   (some with `verify_backlog`); then 4 MiB writes (more pages than `max_segments`); then
//!   the largest transfer the device advertises (`max_segments × max_segment_size`, at
//!   most [`LARGEST_CAP`]) from one physically contiguous 1 GiB page, on one disk per
//!   boot (it is the costly one: about 10 s for 1022 MiB under TCG; across the four boots
//!   each of the four io_uring and sync disks gets it once, the fifth disk never). Every
//!   block written is read back into fresh buffers and verified.
//!
//! vblk only, a sixth disk per boot: a qcow2 image (`--format qcow2`, io_uring), plain with
//! O_DIRECT on even boots, over a raw backing file through the page cache on odd ones;
//! after the boot, the daemon stops cleanly and `qemu-img check` must find nothing.
//!
//! Asserted, per boot: every fio job ran, wrote and read back the bytes it should, with no
//! error (no verify failure); the 4 MiB writes were split by the segment limit; the
//! largest transfer went as one request; the disks have 2 hardware queues; no I/O error
//! in the guest's kernel log. Per daemon: its per-queue summary at disconnect
//! (`queue N: D requests completed, B rejected, F failed`) shows both queues used and nothing
//! rejected, and its log has no WARN or ERROR line. Every boot runs; the failure lists
//! every failing combination; each boot's whole report (serial log, daemon logs) is kept
//! in `target/tmp/integrity/`.
//!
//! How long, on 2 shared cores: 1.5-2 minutes (boots of 20-35 s; most of it is fio's
//! crc32c and page clearing under TCG). The fifth disk added about 9 s: 106 s and 94 s
//! before, 115 s and 103 s after, in two back-to-back pairs with another guest running
//! beside. The first run also builds the fio layer of the initramfs (fio and its 64
//! libraries, about 85 MB, cached under `target/guest-assets/`) and compiles the
//! fragmenter: a few seconds more.
//!
//! `VBLK_GUEST_BACKEND=qemu-storage-daemon` runs the same suite against
//! qemu-storage-daemon (`cache.direct=on|off`, `aio=io_uring|native|threads`), to validate
//! the suite itself; `VBLK_GUEST_VERBOSE=1` prints every boot's report;
//! `VBLK_GUEST_TIMEOUT_SECS` overrides the per-boot limit (600 s);
//! `VBLK_INTEGRITY_QUEUE_SIZES=64,256` runs only some of the boots (for debugging; the
//! suite runs all of them).
//! Needs (Debian): qemu-system-x86, qemu-system-common, linux-image-amd64, busybox-static,
//! fio, gcc and libc6-dev.

mod support;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::assets::{require_programs, target_dir};
use support::daemon::{queue_summaries, warnings, Backend, Cache, Daemon, Engine, Export};
use support::fio::{check_runs, job_file, layout, phases, run_script, Phase, GUEST_FUNCTIONS};
use support::guest::{Boot, Guest, TempDir};
use support::layer::fio_layer;

const MIB: u64 = 1024 * 1024;

/// QEMU `queue-size` of each boot.
const QUEUE_SIZES: [u16; 4] = [64, 128, 256, 1024];
/// The four disks every boot has.
const DISKS: [(Cache, Engine); 4] = [
    (Cache::None, Engine::IoUring),
    (Cache::None, Engine::Sync),
    (Cache::Writeback, Engine::IoUring),
    (Cache::Writeback, Engine::Sync),
];
/// The fifth disk of each boot (by its place in [`QUEUE_SIZES`]): aio and threads, each
/// at a daemon `--queue-size` of 1024 and of 256 (see [`daemon_queue_size`]).
const FIFTH_DISK: [(Cache, Engine); 4] = [
    (Cache::None, Engine::Aio),
    (Cache::Writeback, Engine::Threads),
    (Cache::None, Engine::Aio),
    (Cache::None, Engine::Threads),
];
const NUM_QUEUES: u16 = 2;
/// The largest transfer tested, whatever the device advertises: its buffer, with fio's
/// alignment slack, must fit in one 1 GiB page. It covers `vblk serve --queue-size 1024`
/// (1022 segments of 1 MiB).
const LARGEST_CAP: u64 = 1022 * MIB;
/// Memory the fragmenter takes; it gives half of it back as isolated pages, which is what
/// fio's buffers are then made of (they need less than 64 MiB at a time).
const FRAG_MIB: u64 = 256;
/// Guest RAM: 2.5 GiB. The 1 GiB page for the largest transfer is reserved at boot and
/// needs a free, aligned 1 GiB: [1 GiB, 2 GiB) is, when the initramfs (which QEMU loads at
/// the top of RAM) and the kernel's early allocations find room above 2 GiB. The rest
/// holds the kernel, the initramfs (fio), the fragmenter and fio's buffers. Pages the
/// guest never touches cost the host nothing.
const GUEST_MIB: u64 = 2560;

/// `vblk serve --queue-size` for the disks of the boot with QEMU `queue-size=qemu`: the
/// daemon offers `seg_max` = its queue size - 2, so Linux builds indirect tables of up to
/// that many + 2 descriptors whatever the ring size: 1024 in a ring of 64, 256 in rings of
/// 128 and 256, 1024 in a ring of 1024. Explicit (not the default), so that what a boot
/// tests and how long its largest transfer takes do not change with the default.
fn daemon_queue_size(qemu: u16) -> u16 {
    match qemu {
        64 | 1024 => 1024,
        _ => 256,
    }
}

/// Runs a QEMU tool; a missing one or a failure panics naming it.
fn run_tool(program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} ({e}): install qemu-utils"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `VBLK_GUEST_VERBOSE=1`: print every boot's report.
fn verbose() -> bool {
    std::env::var_os("VBLK_GUEST_VERBOSE").is_some_and(|v| v != "0")
}

/// The boots to run: all of them, or `$VBLK_INTEGRITY_QUEUE_SIZES`.
fn queue_sizes() -> Vec<u16> {
    match std::env::var("VBLK_INTEGRITY_QUEUE_SIZES") {
        Ok(v) if !v.is_empty() => v
            .split(',')
            .map(|q| {
                let q: u16 = q.trim().parse().unwrap_or_else(|_| {
                    panic!("VBLK_INTEGRITY_QUEUE_SIZES={v}: not a list of numbers")
                });
                assert!(
                    QUEUE_SIZES.contains(&q),
                    "VBLK_INTEGRITY_QUEUE_SIZES={v}: {q} is not one of {QUEUE_SIZES:?}"
                );
                q
            })
            .collect(),
        _ => QUEUE_SIZES.to_vec(),
    }
}

/// The guest script of a boot on `disks`.
fn script(phases: &[Phase], disks: &[String]) -> String {
    let list = disks.join(" ");
    let mut s = GUEST_FUNCTIONS.to_string();
    let _ = write!(
        s,
        r#"
export VBLK_LARGEST_CAP={LARGEST_CAP}
for d in {list}; do
    check_eq $d-hw-queues "$(ls /sys/block/$d/mq | wc -l)" {NUM_QUEUES}
    vblk_limits $d
done
check_eq disks-alike "$(sort -u /tmp/limits | wc -l)" 1

# The 1 GiB page for the largest transfer.
vblk_huge
echo "VBLK-TIME hugepages uptime=$(cut -d' ' -f1 /proc/uptime)"

# Fragment the rest; compaction must not undo it.
echo 0 > /proc/sys/vm/compact_unevictable_allowed
echo 0 > /proc/sys/vm/compaction_proactiveness
vblk-frag {FRAG_MIB} > /tmp/frag.out 2>&1 &
frag=$!
i=0
while ! grep -q ready /tmp/frag.out && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
check frag-ready grep ready /tmp/frag.out
grep -E 'MemFree|HugePages_(Total|Free)' /proc/meminfo
echo "VBLK-TIME fragmented uptime=$(cut -d' ' -f1 /proc/uptime)"
"#
    );
    s.push_str(&run_script(phases, disks));
    let _ = write!(
        s,
        r#"
echo "VBLK-TIME fio-done uptime=$(cut -d' ' -f1 /proc/uptime)"
kill $frag
check_eq io-errors "$(dmesg | grep -c -i -E 'I/O error|blk_update_request|Buffer I/O')" 0
dmesg | grep -i -E 'error|vd[a-z]' | tail -n 20
"#
    );
    s
}

/// The checks every boot must report.
fn expected_checks(phases: &[Phase], disks: &[String]) -> Vec<String> {
    let mut names: Vec<String> = [
        "guest-disks",
        "hugepages-1g",
        "hugetlbfs-1g",
        "disks-alike",
        "frag-ready",
        "io-errors",
    ]
    .map(String::from)
    .to_vec();
    for d in disks {
        names.push(format!("{d}-hw-queues"));
        names.push(format!("{d}-max-sectors-kb"));
    }
    for p in phases {
        names.push(format!("fio-{}", p.name));
        for d in p.disks(disks) {
            match p.name {
                "split" => names.push(format!("{d}-split-requests")),
                "largest" => names.push(format!("{d}-largest-one-request")),
                _ => {}
            }
        }
    }
    names
}

/// Waits (a few seconds at most) for `vblk serve` to log its per-queue summaries after
/// the frontend went away, then checks them and the log's warnings.
fn check_daemon(daemon: &mut Daemon, label: &str, problems: &mut Vec<String>) {
    if let Some(status) = daemon.exit_status() {
        problems.push(format!("{label}: the daemon exited ({status})"));
        return;
    }
    let log = match daemon.backend {
        Backend::Vblk => {
            let start = Instant::now();
            loop {
                let log = daemon.log_text();
                if queue_summaries(&log).len() >= usize::from(NUM_QUEUES)
                    || start.elapsed() > Duration::from_secs(10)
                {
                    break log;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Backend::QemuStorageDaemon => daemon.log_text(),
    };
    match daemon.backend {
        Backend::Vblk => {
            let sums = queue_summaries(&log);
            for q in 0..usize::from(NUM_QUEUES) {
                match sums.iter().find(|s| s.queue == q) {
                    None => problems.push(format!(
                        "{label}: no `queue {q}: .. requests completed, .. rejected, .. failed` line in the log"
                    )),
                    Some(s) if s.rejected != 0 || s.failed != 0 || s.completed == 0 => {
                        problems.push(format!(
                            "{label}: queue {q}: {} requests completed, {} rejected, {} failed (want > 0, 0 and 0)",
                            s.completed, s.rejected, s.failed
                        ))
                    }
                    Some(_) => {}
                }
            }
            let warns = warnings(&log);
            if !warns.is_empty() {
                problems.push(format!(
                    "{label}: {} WARN/ERROR lines in the daemon log, the first ones:\n    {}",
                    warns.len(),
                    warns[..warns.len().min(4)].join("\n    ")
                ));
            }
        }
        Backend::QemuStorageDaemon => {
            let bad: Vec<&str> = log
                .lines()
                .filter(|l| {
                    let l = l.to_ascii_lowercase();
                    l.contains("error") || l.contains("warn")
                })
                .collect();
            if !bad.is_empty() {
                problems.push(format!(
                    "{label}: qemu-storage-daemon complained:\n    {}",
                    bad[..bad.len().min(4)].join("\n    ")
                ));
            }
        }
    }
}

/// Everything wrong with a finished boot (empty: it passed).
fn boot_problems(boot: &Boot, phases: &[Phase], disks: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(why) = &boot.aborted {
        problems.push(format!("boot aborted: {why}"));
    } else if boot.timed_out {
        problems.push(format!("QEMU timed out after {:.1?}", boot.elapsed));
    } else if !boot.status.success() {
        problems.push(format!("QEMU exited with {}", boot.status));
    }
    for c in boot.failed() {
        problems.push(format!("check `{}` failed: {}", c.name, c.detail));
    }
    if !boot.done {
        // What did not run follows; no need to list it.
        problems.push("the guest did not print VBLK-DONE".into());
        return problems;
    }
    for name in expected_checks(phases, disks) {
        if boot.check(&name).is_none() {
            problems.push(format!("check `{name}` did not run"));
        }
    }
    problems.extend(check_runs(phases, disks, &boot.serial));
    problems
}

/// The lines of a serial log worth reading in a failure message.
fn interesting(serial: &str) -> String {
    serial
        .lines()
        .filter(|l| {
            l.contains("VBLK-") && !l.contains("VBLK-RUN") && !l.contains("VBLK-CHECK")
                || l.contains("verify:")
        })
        .take(80)
        .collect::<Vec<_>>()
        .join("\n")
}

fn report_path(backend: Backend, queue_size: u16) -> PathBuf {
    let dir = target_dir().join("tmp").join("integrity");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir.join(format!("{backend:?}-q{queue_size}.log").to_lowercase())
}

/// Boots a guest with QEMU `queue-size=queue_size` on five disks ([`DISKS`] and this
/// boot's [`FIFTH_DISK`]) and returns a summary line and the problems found.
fn run_boot(backend: Backend, queue_size: u16, layer: &Path) -> (String, Vec<String>) {
    let boot_index = QUEUE_SIZES
        .iter()
        .position(|&q| q == queue_size)
        .unwrap_or(0);
    let disks: Vec<(Cache, Engine)> = DISKS.into_iter().chain([FIFTH_DISK[boot_index]]).collect();
    // vblk only: a sixth disk, a qcow2 image (the reference would serve it as raw). Boots
    // alternate a plain one with O_DIRECT and one over a raw backing file (its first
    // 64 MiB a pattern) through the page cache.
    let qcow2 = (backend == Backend::Vblk).then_some(if boot_index % 2 == 0 {
        (Cache::None, false)
    } else {
        (Cache::Writeback, true)
    });
    // Each boot gives the largest transfer to another of the four first disks: across the
    // four boots, each of them gets it once.
    let phases = phases(boot_index % DISKS.len());
    let (offsets, disk_bytes) = layout(&phases, LARGEST_CAP);
    let dir = TempDir::new("integ");
    let images = TempDir::new_in(&target_dir().join("tmp"), "integ-img");
    let names: Vec<String> = (0..disks.len() + usize::from(qcow2.is_some()))
        .map(|i| format!("vd{}", (b'a' + i as u8) as char))
        .collect();
    let mut labels: Vec<String> = disks
        .iter()
        .map(|(c, e)| format!("q{queue_size}/cache={}/engine={}", c.name(), e.name()))
        .collect();
    if let Some((cache, backed)) = qcow2 {
        labels.push(format!(
            "q{queue_size}/qcow2{}/cache={}/engine=io_uring",
            if backed { " over raw" } else { "" },
            cache.name()
        ));
    }

    let mut guest = Guest::new(&format!("integrity-q{queue_size}"))
        .memory_mib(GUEST_MIB as u32)
        .kernel_arg("transparent_hugepage=never")
        .kernel_arg("hugepagesz=1G hugepages=1")
        // TCG speed, measured in the guest: without ERMS/FSRM the kernel clears and copies
        // pages with `rep stosq`/`movsq` instead of byte-wise `rep stosb`/`movsb`, which
        // TCG runs one iteration at a time (the fragmenter: 5.2 s -> 3.5 s); without
        // SSE4.2, fio computes crc32c with its tables instead of the `crc32` instruction,
        // which TCG emulates through a helper call (`fio --crctest=crc32c`: 105 -> 137
        // MiB/s).
        .cpu("max,-erms,-fsrm,-sse4.2")
        .layer(layer)
        .timeout(Duration::from_secs(600));
    let mut exports = Vec::new();
    for (i, (cache, engine)) in disks.iter().enumerate() {
        let image = images.join(format!("{}.img", names[i]));
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(disk_bytes))
            .unwrap_or_else(|e| panic!("{}: {e}", image.display()));
        let mut export = Export::new(&image, NUM_QUEUES)
            .cache(*cache)
            .engine(*engine)
            .args(&["--threads", "2"])
            .args(&["--queue-size", &daemon_queue_size(queue_size).to_string()]);
        if matches!(engine, Engine::Sync | Engine::Threads) {
            // The sync and threads daemons answer every notification without polling, the
            // io_uring and aio ones poll (the default): both ways of draining the rings
            // are exercised.
            export = export.args(&["--poll-us", "0"]);
        }
        exports.push(export);
    }
    let mut qcow2_image = None;
    if let Some((cache, backed)) = qcow2 {
        let name = &names[disks.len()];
        let image = images.join(format!("{name}.qcow2"));
        let base = images.join(format!("{name}-base.raw"));
        let size = disk_bytes.to_string();
        let mut create = vec!["create", "-f", "qcow2"];
        if backed {
            std::fs::File::create(&base)
                .and_then(|f| f.set_len(disk_bytes / 2))
                .unwrap_or_else(|e| panic!("{}: {e}", base.display()));
            let raw = ["-f", "raw", "-c", "write -P 0x5c 0 64M"];
            run_tool("qemu-io", &[&raw[..], &[base.to_str().unwrap()]].concat());
            create.extend(["-b", base.to_str().unwrap(), "-F", "raw"]);
        }
        create.extend([image.to_str().unwrap(), size.as_str()]);
        run_tool("qemu-img", &create);
        let mut export = Export::new(&image, NUM_QUEUES)
            .cache(cache)
            .engine(Engine::IoUring)
            .args(&["--threads", "2", "--format", "qcow2"])
            .args(&["--queue-size", &daemon_queue_size(queue_size).to_string()]);
        if backed {
            export = export.args(&["--backing", base.to_str().unwrap()]);
        }
        exports.push(export);
        qcow2_image = Some(image);
    }
    let mut daemons = Vec::new();
    for (i, export) in exports.iter().enumerate() {
        let name = format!("{}-daemon", names[i]);
        let daemon = Daemon::start(
            backend,
            &name,
            export,
            &dir.join(format!("{}.sock", names[i])),
            &dir.join(format!("{}.log", names[i])),
        );
        guest = guest
            .disk_with_queue_size(&daemon.socket, NUM_QUEUES, queue_size)
            .attach_log(&format!("{} ({})", name, labels[i]), &daemon.log)
            .watch(&name, daemon.pid());
        daemons.push(daemon);
    }
    for p in &phases {
        guest = guest.file(
            &format!("vblk/{}.fio", p.name),
            job_file(p, &names, LARGEST_CAP, &offsets),
        );
    }
    let boot = guest.script(script(&phases, &names)).boot();

    let mut problems = boot_problems(&boot, &phases, &names);
    for (i, daemon) in daemons.iter_mut().enumerate() {
        check_daemon(daemon, &labels[i], &mut problems);
    }
    if let (Some(image), Some(daemon)) = (&qcow2_image, daemons.last_mut()) {
        // A clean stop writes every mapping back: QEMU then finds no error and no leak.
        let label = labels.last().cloned().unwrap_or_default();
        if !daemon.terminate(Duration::from_secs(60)) {
            problems.push(format!("{label}: the daemon did not stop on SIGTERM"));
        }
        let out = std::process::Command::new("qemu-img")
            .arg("check")
            .arg(image)
            .output()
            .expect("qemu-img (qemu-utils)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() || !text.contains("No errors were found") {
            problems.push(format!(
                "{label}: qemu-img check after the daemon stopped: {:?}\n{text}",
                out.status
            ));
        }
    }
    let full = format!(
        "{}\n---- problems ----\n{}\n",
        boot.report(),
        problems.join("\n")
    );
    let path = report_path(backend, queue_size);
    std::fs::write(&path, &full).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if verbose() {
        eprintln!("{full}");
    }
    let summary = format!(
        "queue-size {queue_size} ({backend:?}): {} in {:.1?}; report: {}",
        if problems.is_empty() { "ok" } else { "FAILED" },
        boot.elapsed,
        path.display()
    );
    if !problems.is_empty() {
        problems.push(format!(
            "---- guest output of this boot (VBLK lines) ----\n{}",
            interesting(&boot.serial)
        ));
    }
    (summary, problems)
}

#[test]
fn fio_verifies_every_queue_size_cache_and_engine() {
    let backend = Backend::from_env();
    require_programs(&[
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("timeout", "coreutils"),
        ("fio", "fio"),
    ]);
    let started = Instant::now();
    let layer = fio_layer();
    eprintln!(
        "guest assets and fio layer ready in {:.1?}",
        started.elapsed()
    );
    let mut failures = Vec::new();
    for q in queue_sizes() {
        let (summary, problems) = run_boot(backend, q, layer);
        eprintln!("{summary}");
        if !problems.is_empty() {
            failures.push(format!("{summary}\n{}", problems.join("\n")));
        }
    }
    eprintln!(
        "integrity suite ({backend:?}) finished in {:.1?}",
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "data-integrity suite ({backend:?}): {} of {} boots failed\n\n{}",
        failures.len(),
        queue_sizes().len(),
        failures.join("\n\n")
    );
}
