//! `vblk bench` end to end: short verified jobs against the embedded device, `vblk serve`
//! and qemu-storage-daemon over sockets, and the baseline; the JSON figures are present and
//! plausible (bytes = IOPS × bs × time).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use support::bench::bench_json;
use support::daemon::{Backend, Daemon, Export};
use support::util::temp_dir;

fn vblk() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vblk"));
    c.args(["--log-level", "warn"]);
    c
}

/// Whether a run succeeded, and all it said (stdout, then stderr).
fn outcome(out: &std::process::Output) -> (bool, String) {
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

const SHORT: &[&str] = &[
    "--rw=randrw",
    "--bs=4k",
    "--iodepth=8",
    "--size=16m",
    "--runtime=1",
    "--time_based",
    "--ramp_time=200ms",
    "--verify=crc32c",
];

/// The fio-shaped figures of a one-clone job are present and add up.
fn check_job(v: &Value, bs: u64, device_side: bool) {
    let job = &v["jobs"][0];
    assert_eq!(job["jobname"], "vblk");
    let mut total_ios = 0;
    for dir in ["read", "write"] {
        let d = &job[dir];
        let iops = d["iops"].as_f64().unwrap();
        let bytes = d["io_bytes"].as_u64().unwrap();
        let runtime_ms = d["runtime"].as_u64().unwrap();
        let ios = d["total_ios"].as_u64().unwrap();
        assert!(iops > 0.0, "{dir}: IOPS {iops}");
        // The measured span of a 1 s job: from its first measured I/O to its last, so
        // never longer than the job (plus a completion's tail), and never empty. (Not a
        // lower bound near 1 s: on a loaded machine the first I/O can come late.)
        assert!(
            runtime_ms > 0 && runtime_ms <= 3000,
            "{dir}: runtime {runtime_ms} ms for a 1 s job"
        );
        assert_eq!(bytes, ios * bs, "{dir}: bytes = I/Os × bs");
        let expect = iops * bs as f64 * runtime_ms as f64 / 1000.0;
        let err = (bytes as f64 - expect).abs() / expect;
        assert!(
            err < 0.02,
            "{dir}: {bytes} bytes vs IOPS × bs × time = {expect:.0}"
        );
        for lat in ["slat_ns", "clat_ns", "lat_ns"] {
            let l = &d[lat];
            let (min, mean, max) = (
                l["min"].as_f64().unwrap(),
                l["mean"].as_f64().unwrap(),
                l["max"].as_f64().unwrap(),
            );
            assert!(0.0 < min && min <= mean && mean <= max, "{dir} {lat}: {l}");
        }
        let p = &d["clat_ns"]["percentile"];
        let p50 = p["50.000000"].as_f64().unwrap();
        let p99 = p["99.000000"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 <= p99, "{dir}: p50 {p50} p99 {p99}");
        total_ios += ios;
    }
    let mix = job["read"]["total_ios"].as_f64().unwrap() / total_ios as f64;
    assert!((0.4..0.6).contains(&mix), "rwmixread 50: read share {mix}");
    let vb = &v["vblk"];
    assert!(
        vb["aggregate"]["vblk"]["verified_sectors"]
            .as_u64()
            .unwrap()
            > 0,
        "verify checked nothing"
    );
    assert!(vb["driver"]["iops_per_cpu_sec"].as_f64().unwrap() > 0.0);
    if device_side {
        assert!(
            vb["device"]["iops_per_cpu_sec"].as_f64().unwrap() > 0.0,
            "device CPU: {}",
            vb["device"]
        );
    }
}

#[test]
fn embedded_device_job_is_verified_and_adds_up() {
    let v = bench_json(SHORT);
    check_job(&v, 4096, true);
    assert!(v["vblk"]["target"]
        .as_str()
        .unwrap()
        .starts_with("embedded vblk device"));
}

/// Verified random reads and writes of 4 KiB and 64 KiB on a fresh file, 16 deep, with
/// every third completion held 5 ms (`--delay-every 3:5`), so that a read can reach the
/// disk before a write of its sectors and finish after it: an I/O that overlaps one in
/// flight waits for it (fio's serialize_overlap), or the check races the write and
/// reports a written sector lost.
#[test]
fn verified_mixed_sizes_never_race_their_own_writes() {
    let dir = temp_dir("bench-overlap");
    let img: PathBuf = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let sock = dir.path().join("vblk.sock");
    let _d = Daemon::start_vblk(
        "vblk",
        &[
            "--socket-path",
            sock.to_str().unwrap(),
            "--blk-file",
            img.to_str().unwrap(),
            "--delay-every",
            "3:5",
        ],
        &sock,
        &dir.path().join("vblk.log"),
    );
    for _ in 0..2 {
        let v = bench_json(&[
            "--socket",
            sock.to_str().unwrap(),
            "--rw=randrw",
            "--bssplit=4k/50:64k/50",
            "--iodepth=16",
            "--size=16m",
            "--runtime=1",
            "--time_based",
            "--verify=crc32c",
        ]);
        let checked = v["vblk"]["aggregate"]["vblk"]["verified_sectors"]
            .as_u64()
            .unwrap_or(0);
        assert!(checked > 0, "verify checked nothing: {}", v["vblk"]);
    }
}

/// The embedded device serves a qcow2 image with `--format qcow2`, as `vblk serve` does
/// (bench named that flag in its error but had none): a verified job, then `qemu-img
/// check` finds the image clean.
#[test]
fn the_embedded_device_serves_qcow2() {
    let dir = temp_dir("bench-qcow2");
    let img = dir.path().join("disk.qcow2");
    let made = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "32M"])
        .status()
        .expect("qemu-img (apt-get install qemu-utils)");
    assert!(made.success());
    let mut args = SHORT.to_vec();
    args.extend(["--disk", img.to_str().unwrap(), "--format", "qcow2"]);
    let v = bench_json(&args);
    check_job(&v, 4096, true);
    let out = Command::new("qemu-img")
        .args(["check", img.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A short verified job against `backend` serving a file, over its socket, with its pid.
fn socket_job(backend: Backend, name: &str) {
    let dir = temp_dir("bench");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 32 << 20]).unwrap();
    let sock = dir.path().join(format!("{name}.sock"));
    let d = Daemon::start(
        backend,
        name,
        &Export::new(&img, 1),
        &sock,
        &dir.path().join("log"),
    );
    let pid = d.pid().to_string();
    let mut args = SHORT.to_vec();
    args.extend(["--socket", sock.to_str().unwrap(), "--device-pid", &pid]);
    let v = bench_json(&args);
    check_job(&v, 4096, true);
}

#[test]
fn vblk_serve_over_a_socket_with_its_pid() {
    socket_job(Backend::Vblk, "vblk");
}

#[test]
fn qemu_storage_daemon_over_a_socket() {
    socket_job(Backend::QemuStorageDaemon, "qsd");
}

#[test]
fn baseline_on_an_o_direct_file() {
    let dir = temp_dir("bench");
    let img: PathBuf = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 32 << 20]).unwrap();
    let mut args = SHORT.to_vec();
    let disk = img.to_str().unwrap();
    args.extend(["--baseline", "--disk", disk, "--cache", "none"]);
    let v = bench_json(&args);
    check_job(&v, 4096, false);
    assert_eq!(v["vblk"]["path"], "baseline");
}

#[test]
fn compare_prints_a_table_with_ratios_and_plots_it() {
    let dir = temp_dir("bench");
    let svg = dir.path().join("paths.svg");
    let out = vblk()
        .args([
            "bench",
            "--rw=randread",
            "--bs=4k",
            "--iodepth=4",
            "--size=8m",
            "--runtime=300ms",
            "--time_based",
        ])
        .args(["--compare", "path=bio,batch", "--repeat", "2", "--plot"])
        .arg(&svg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bio = text
        .lines()
        .find(|l| l.starts_with("path=bio"))
        .expect(&text);
    assert!(
        bio.contains(" 1.00 "),
        "first variant has ratio 1.00: {bio}"
    );
    assert!(text.lines().any(|l| l.starts_with("path=batch")), "{text}");
    assert!(text.contains("2 run(s) per variant"), "{text}");
    // With repeats, the paired ratio to the first variant and its 95 % interval: none for
    // the first, "low-high" around the figure for the others.
    assert!(text.contains(" paired (95 %) "), "{text}");
    let batch = text
        .lines()
        .find(|l| l.starts_with("path=batch"))
        .expect(&text);
    let cells: Vec<&str> = batch.split_whitespace().collect();
    let g: f64 = cells[5].parse().expect(batch);
    let (lo, hi) = cells[6]
        .trim_matches(|c| c == '(' || c == ')')
        .split_once('-')
        .expect(batch);
    let (lo, hi): (f64, f64) = (lo.parse().unwrap(), hi.parse().unwrap());
    assert!(lo <= g && g <= hi && lo > 0.0, "{batch}");
    // The embedded device's CPU is measured: its share of a CPU ends each row, as a
    // percentage between 0 and 100 (one worker thread).
    assert!(text.contains(" dev CPU\n"), "{text}");
    let share: f64 = bio
        .split_whitespace()
        .last()
        .and_then(|c| c.strip_suffix('%'))
        .expect(bio)
        .parse()
        .unwrap();
    assert!((0.0..=100.5).contains(&share), "{bio}");
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("path=batch"));
}

/// One run per variant has no spread: the table says "1 run", never "± 0".
#[test]
fn a_single_run_shows_no_spread() {
    let out = vblk()
        .args([
            "bench",
            "--rw=randread",
            "--bs=4k",
            "--iodepth=4",
            "--size=8m",
            "--runtime=200ms",
            "--time_based",
        ])
        .args(["--compare", "path=bio,batch"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for variant in ["path=bio", "path=batch"] {
        let row = text.lines().find(|l| l.starts_with(variant)).expect(&text);
        assert!(row.contains("(1 run)") && !row.contains('±'), "{row}");
    }
    // Nor a paired ratio: one round has no interval.
    assert!(!text.contains("paired"), "{text}");
}

fn write_job(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn the_iometer_job_file_runs_unchanged_and_reports_what_it_ignores() {
    let dir = temp_dir("bench");
    let file = write_job(
        dir.path(),
        "iometer.fio",
        include_str!("../../../bench/jobs/iometer-file-server.fio"),
    );
    // The file's own 60 s timeout is shortened from the command line.
    let out = vblk()
        .args(["bench", "--disk", "mem:256M", "--runtime=1"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with("/dev/xvda: (jobs=2): rw=randrw"), "{text}");
    // direct=1 is honoured (O_DIRECT where the disk is a file), not ignored.
    assert!(!text.contains("option direct"), "{text}");
    assert_eq!(text.matches("option ioengine ignored").count(), 1, "{text}");
    assert!(text.contains("size 4294967296 is larger than"), "{text}");
    assert!(
        text.contains("read: IOPS=") && text.contains("write: IOPS="),
        "{text}"
    );
}

#[test]
fn bad_job_file_names_the_line() {
    let dir = temp_dir("bench");
    let file = write_job(
        dir.path(),
        "bad.fio",
        "[global]\nbs=4k\n[job1]\nrw=sideways\n",
    );
    let out = vblk().arg("bench").arg(&file).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.fio: line 4:"), "{err}");
    assert!(err.contains("sideways"), "{err}");
}

/// `--section` runs only the named sections of a job file, as fio's does; a name the files
/// do not have is refused, naming the sections they do have.
#[test]
fn section_picks_jobs_from_a_job_file() {
    let dir = temp_dir("bench");
    let file = write_job(
        dir.path(),
        "matrix-16.fio",
        include_str!("../../../bench/jobs/matrix-16.fio"),
    );
    let file = file.to_str().unwrap();
    let v = bench_json(&[
        file,
        "--section",
        "write-iops",
        "--section",
        "rw-iops",
        "--numjobs=1",
        "--size=8m",
        "--runtime=200ms",
        "--ramp_time=0",
    ]);
    let names: Vec<&str> = v["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["jobname"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["write-iops", "rw-iops"], "{v}");
    let out = vblk()
        .args(["bench", file, "--section", "nope"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--section nope: no such job section")
            && err.contains("read-iops, write-iops"),
        "{err}"
    );
}

/// A read job on a file its user may only read (fio opens a read job's file read-only):
/// the embedded device and the baseline open it read-only, and the job runs. It failed
/// with "Permission denied" (the file was always opened for writing); a write job there
/// still fails, naming the file.
#[test]
fn a_read_job_reads_a_file_its_user_may_only_read() {
    use std::os::unix::fs::PermissionsExt;
    support::assets::require_programs(&[("setpriv", "util-linux")]);
    let dir = temp_dir("bench-ro");
    // The temp dir must be traversable by nobody; the file is readable, not writable.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let img = dir.path().join("ro.img");
    std::fs::write(&img, vec![0x33u8; 4 << 20]).unwrap();
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_vblk"))
            .args(["--log-level", "warn", "bench", "--disk"])
            .arg(&img)
            .args(["--bs=4k", "--size=4m", "--runtime=200ms", "--time_based"])
            .args(extra)
            .output()
            .unwrap();
        outcome(&out)
    };
    for path in [&["--rw=randread"][..], &["--rw=read", "--baseline"][..]] {
        let (ok, text) = run(path);
        assert!(ok, "{path:?}: {text}");
        assert!(text.contains("IOPS="), "{path:?}: {text}");
    }
    let (ok, text) = run(&["--rw=randwrite"]);
    assert!(!ok && text.contains("ro.img"), "{text}");
}

/// What bench changes of a job it says, and a job that cannot be measured is an error:
/// an offset off the block size is rounded up with a note, an iodepth above the queue's
/// entries is capped with a note, numjobs above 256 names numjobs (it named
/// --num-queues), and a job that ends within its ramp fails instead of reporting zeroes.
#[test]
fn what_bench_changes_it_says_and_what_it_cannot_measure_fails() {
    let run = |args: &[&str]| {
        let out = vblk()
            .args(["bench", "--disk", "mem:16M", "--bs=4k"])
            .args(args)
            .output()
            .unwrap();
        outcome(&out)
    };
    let (ok, text) = run(&["--offset=1000", "--iodepth=300", "--size=1m"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("offset 1000 is not a multiple of the device's 512-byte blocks; using 1024"),
        "{text}"
    );
    assert!(
        text.contains("iodepth=300 is more than the queue's 256 entries"),
        "{text}"
    );
    let (ok, text) = run(&["--numjobs=300"]);
    assert!(!ok && text.contains("numjobs=300: at most 256"), "{text}");
    assert!(!text.contains("--num-queues"), "{text}");
    let (ok, text) = run(&["--size=1m", "--ramp_time=2s"]);
    assert!(!ok && text.contains("ended within its ramp time"), "{text}");
}

/// A write job writes pseudo-random bytes, as fio does by default (it wrote zeroes, which
/// a target that compresses, deduplicates or skips zeroes serves faster than data).
#[test]
fn a_write_job_writes_data_not_zeroes() {
    let dir = temp_dir("bench-payload");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    let out = vblk()
        .args(["bench", "--disk"])
        .arg(&img)
        .args(["--rw=write", "--bs=64k", "--iodepth=4", "--size=4m"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = std::fs::read(&img).unwrap();
    let zero_blocks = data
        .chunks(4096)
        .filter(|b| b.iter().all(|&x| x == 0))
        .count();
    assert_eq!(
        zero_blocks, 0,
        "{zero_blocks} of 1024 blocks written as zeroes"
    );
}

/// A job file's direct=1 opens a file disk with O_DIRECT, as fio does (it was ignored and
/// the job ran on the page cache); an explicit --cache wins, and the job says so.
#[test]
fn a_job_files_direct_means_o_direct_unless_cache_says_otherwise() {
    let dir = temp_dir("bench-direct");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 8 << 20]).unwrap();
    let file = write_job(
        dir.path(),
        "direct.fio",
        "[global]\nbs=4k\nsize=4m\n[r]\nrw=randread\ndirect=1\n[s]\nrw=read\n",
    );
    let run = |extra: &[&str]| {
        let out = vblk()
            .args(["bench", "--disk"])
            .arg(&img)
            .args(extra)
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = run(&[]);
    assert!(text.contains("(cache none)"), "{text}");
    assert!(!text.contains("option direct"), "{text}");
    // The job that did not ask is told (the cache is the target's, for every job).
    assert!(
        text.contains("O_DIRECT (cache none): another job says direct=1"),
        "{text}"
    );
    for base in [&["--baseline"][..], &["--cache", "writeback"][..]] {
        let text = run(base);
        if base[0] == "--baseline" {
            assert!(text.contains("(cache none)"), "{text}");
        } else {
            assert!(text.contains("(cache writeback)"), "{text}");
            assert!(
                text.contains("option direct=1 (--cache writeback is the target's"),
                "{text}"
            );
        }
    }
}

/// The zero-filled files of `n` disks served by one `vblk serve`, each on its own socket.
fn many_disks(dir: &Path, n: usize, mb: u64) -> (Daemon, Vec<PathBuf>, Vec<PathBuf>) {
    let mut args = vec!["--threads".to_string(), "1".into()];
    let (mut imgs, mut socks) = (Vec::new(), Vec::new());
    for i in 0..n {
        let img = dir.join(format!("d{i}.img"));
        std::fs::File::create(&img)
            .unwrap()
            .set_len(mb << 20)
            .unwrap();
        let sock = dir.join(format!("d{i}.sock"));
        args.extend([
            "--disk".into(),
            format!("socket={},file={}", sock.display(), img.display()),
        ]);
        imgs.push(img);
        socks.push(sock);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = Daemon::start_vblk("vblk", &args, &socks[n - 1], &dir.join("vblk.log"));
    (d, imgs, socks)
}

/// `--socket` given three times and `--job-threads 1`: six verified clones on one thread,
/// clone i on disk i mod 3 and in sixth i of the region. Every clone measures and
/// verifies its own I/O, and each disk holds written data exactly in its own clones'
/// sixths (so the clones went where they were sent, and nowhere else).
#[test]
fn one_thread_drives_clones_on_several_devices() {
    let dir = temp_dir("bench-shared");
    let (_d, imgs, socks) = many_disks(dir.path(), 3, 12);
    let mut args = vec![
        "--rw=randrw",
        "--bs=4k",
        "--iodepth=4",
        "--numjobs=6",
        "--job-threads=1",
        "--runtime=1",
        "--time_based",
        "--verify=crc32c",
    ];
    for s in &socks {
        args.extend(["--socket", s.to_str().unwrap()]);
    }
    let v = bench_json(&args);
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 6, "{}", v["vblk"]);
    for (i, j) in jobs.iter().enumerate() {
        assert_eq!(j["vblk"]["clone"], i as u64);
        let ios =
            j["read"]["total_ios"].as_u64().unwrap() + j["write"]["total_ios"].as_u64().unwrap();
        assert!(ios > 0, "clone {i} did no I/O: {j}");
        assert!(
            j["vblk"]["verified_sectors"].as_u64().unwrap() > 0,
            "clone {i} verified nothing"
        );
    }
    let notes = v["vblk"]["notes"].to_string();
    assert!(notes.contains("6 clones on 1 thread(s)"), "notes: {notes}");
    let sixth = (12u64 << 20) / 6;
    for (k, img) in imgs.iter().enumerate() {
        let data = std::fs::read(img).unwrap();
        for i in 0..6 {
            let part = &data[(i * sixth) as usize..((i + 1) * sixth) as usize];
            let written = part.iter().any(|&b| b != 0);
            assert_eq!(
                written,
                i as usize % 3 == k,
                "disk {k}, sixth {i} (clone {i}): written {written}"
            );
        }
    }
}

/// Four clones paced at 400 IOPS each on one thread keep their pace, each of them: a
/// thread that served one clone before the others, or slept past another's due time,
/// would leave some behind. (The lower bound leaves room for a loaded test machine that
/// keeps the thread off its CPU now and then; a starved clone falls far below it.)
#[test]
fn one_thread_keeps_each_clones_pace() {
    let dir = temp_dir("bench-shared-pace");
    let (_d, _imgs, socks) = many_disks(dir.path(), 2, 8);
    let v = bench_json(&[
        "--rw=randread",
        "--bs=4k",
        "--iodepth=2",
        "--numjobs=4",
        "--job-threads=1",
        "--rate_iops=400",
        "--runtime=2",
        "--time_based",
        "--ramp_time=200ms",
        "--socket",
        socks[0].to_str().unwrap(),
        "--socket",
        socks[1].to_str().unwrap(),
    ]);
    for j in v["jobs"].as_array().unwrap() {
        let iops = j["read"]["iops"].as_f64().unwrap();
        assert!(
            (340.0..=440.0).contains(&iops),
            "clone {}: {iops:.0} IOPS for 400 offered",
            j["vblk"]["clone"]
        );
    }
}

/// `vblk bench` with `args`, its output piped.
fn spawn_bench(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["--log-level", "warn", "bench"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Send `sig` to the test's own child process `pid`.
fn signal(pid: libc::pid_t, sig: libc::c_int) {
    // SAFETY: kill(2) takes plain integers; pid is a child this test started and has not
    // reaped, so it names no other process.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// `child`'s exit status, once it has exited; if it still runs after `secs`, kill it, run
/// `cleanup` and fail the test, saying it was still running `when`.
fn exit_within(
    child: &mut std::process::Child,
    secs: u64,
    when: &str,
    cleanup: impl FnOnce(),
) -> std::process::ExitStatus {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > std::time::Duration::from_secs(secs) {
            let _ = child.kill();
            cleanup();
            panic!("bench still running {secs} s {when}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A device killed while the thread sleeps on it and another device: the job fails with
/// the disconnection, promptly, instead of sleeping forever on the dead device's eventfd.
#[test]
fn one_thread_fails_promptly_when_a_device_dies() {
    let dir = temp_dir("bench-shared-kill");
    let (mut d, _imgs, socks) = many_disks(dir.path(), 1, 8);
    let other_dir = dir.path().join("b");
    std::fs::create_dir(&other_dir).unwrap();
    let other = many_disks(&other_dir, 1, 8);
    let mut child = spawn_bench(&[
        "--rw=randread",
        "--iodepth=1",
        "--numjobs=2",
        "--job-threads=1",
        "--rate_iops=50",
        "--runtime=60",
        "--time_based",
        "--socket",
        socks[0].to_str().unwrap(),
        "--socket",
        other.2[0].to_str().unwrap(),
    ]);
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(child.try_wait().unwrap().is_none(), "bench ended early");
    d.kill();
    let status = exit_within(&mut child, 20, "after its device was killed", || {});
    let out = child.wait_with_output().unwrap();
    let (_, text) = outcome(&out);
    assert!(!status.success(), "bench succeeded: {text}");
    assert!(
        text.to_lowercase().contains("disconnect"),
        "no disconnection named: {text}"
    );
}

/// A device that stops answering (its daemon SIGSTOPped: alive, socket open, requests on
/// the ring) ends the job with an error naming the held I/O within `--io-timeout`, on
/// every kind of client loop: a thread per clone sleeping in the queue's wait, one thread
/// sleeping on several clones' queues at once, and passthru's polled rings. Without the
/// bound each of these waits forever.
#[test]
fn a_stopped_device_fails_the_job_within_its_io_timeout() {
    let cases: [(&str, &[&str]); 3] = [
        ("thread per clone", &["--numjobs=1"]),
        (
            "one thread, two clones",
            &["--numjobs=2", "--job-threads=1"],
        ),
        ("passthru", &["--numjobs=1", "--path=passthru"]),
    ];
    for (case, extra) in cases {
        let dir = temp_dir("bench-stall");
        let (mut d, _imgs, socks) = many_disks(dir.path(), 1, 8);
        let sock = socks[0].to_str().unwrap();
        let common = [
            "--rw=randread",
            "--iodepth=4",
            "--runtime=60",
            "--time_based",
        ];
        let args = [&common[..], &["--io-timeout=2", "--socket", sock], extra].concat();
        let mut child = spawn_bench(&args);
        std::thread::sleep(std::time::Duration::from_secs(1));
        assert!(
            child.try_wait().unwrap().is_none(),
            "{case}: bench ended early"
        );
        let pid = d.pid() as libc::pid_t;
        signal(pid, libc::SIGSTOP);
        let t0 = std::time::Instant::now();
        let status = exit_within(
            &mut child,
            20,
            &format!("{case}: after its device stopped"),
            || signal(pid, libc::SIGCONT),
        );
        let waited = t0.elapsed();
        signal(pid, libc::SIGCONT);
        d.kill();
        let out = child.wait_with_output().unwrap();
        let (_, text) = outcome(&out);
        assert!(!status.success(), "{case}: bench succeeded: {text}");
        assert!(
            text.contains("no I/O completed for 2.0 s"),
            "{case}: the stall is not named: {text}"
        );
        assert!(
            waited >= std::time::Duration::from_millis(1900),
            "{case}: failed after {waited:?}, before its 2 s timeout: {text}"
        );
    }
}
