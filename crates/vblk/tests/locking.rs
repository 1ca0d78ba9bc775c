//! Image locking with the real programs: `vblk serve` against another `vblk serve` and
//! against qemu-storage-daemon (Debian package qemu-system-common), in both orders. Both
//! follow QEMU's convention (OFD read locks on byte 100+i for each permission held and on
//! 200+i for each one not shared), so a second writer on one image is refused at start
//! with an error that names the lock, the byte, and who holds it.

mod support;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};

use support::assets::find_program;
use support::daemon::{Backend, Daemon, Export};
use support::util::{qemu_tool, run_to_exit, temp_dir};

const MIB: u64 = 1 << 20;
/// A refused start fails at open, in milliseconds; this only bounds a hang.
const REFUSAL_LIMIT: Duration = Duration::from_secs(30);

fn image(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    let f = fs::File::create(&path).unwrap();
    f.set_len(16 * MIB).unwrap();
    path
}

/// `vblk serve` on `image`, running and listening (it locks before it listens).
fn vblk(dir: &Path, name: &str, image: &Path, args: &[&str]) -> Daemon {
    let export = Export::new(image, 1).args(args);
    Daemon::start(
        Backend::Vblk,
        name,
        &export,
        &dir.join(format!("{name}.sock")),
        &dir.join(format!("{name}.log")),
    )
}

/// qemu-storage-daemon exporting `image` writable; it has locked once its socket exists
/// (the export takes its permissions before it listens).
fn qsd(dir: &Path, image: &Path) -> Daemon {
    qsd_program();
    Daemon::start(
        Backend::QemuStorageDaemon,
        "qsd",
        &Export::new(image, 1),
        &dir.join("qsd.sock"),
        &dir.join("qsd.log"),
    )
}

fn qsd_program() -> PathBuf {
    find_program("qemu-storage-daemon").unwrap_or_else(|| {
        panic!(
            "qemu-storage-daemon is not installed: install the Debian package \
             qemu-system-common (`apt-get install qemu-system-common`; scripts/test does this)"
        )
    })
}

/// Runs `vblk serve` on `image`, expecting it to refuse; returns its stderr.
fn vblk_refused(dir: &Path, image: &Path, args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.arg("serve")
        .arg("--socket-path")
        .arg(dir.join("refused.sock"))
        .arg("--blk-file")
        .arg(image)
        .args(args);
    refused("vblk serve", run_to_exit(cmd, REFUSAL_LIMIT))
}

/// Runs a writable qemu-storage-daemon export of `image`, expecting it to refuse.
fn qsd_refused(dir: &Path, image: &Path) -> String {
    let mut cmd = Command::new(qsd_program());
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f,filename={},cache.direct=off",
            image.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on",
            dir.join("qsd-refused.sock").display()
        ));
    refused("qemu-storage-daemon", run_to_exit(cmd, REFUSAL_LIMIT))
}

fn refused(what: &str, out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "{what} should have been refused, but exited with {}; stderr:\n{stderr}",
        out.status
    );
    stderr
}

fn assert_names(stderr: &str, parts: &[&str]) {
    for p in parts {
        assert!(stderr.contains(p), "expected {p:?} in:\n{stderr}");
    }
}

/// The bytes of `path` that /proc/locks shows locked, as QEMU-style single bytes.
fn locked_bytes(path: &Path) -> Vec<u64> {
    let m = fs::metadata(path).unwrap();
    let (major, minor) = (libc::major(m.dev()), libc::minor(m.dev()));
    let id = format!("{major:02x}:{minor:02x}:{}", m.ino());
    let mut bytes = Vec::new();
    for line in fs::read_to_string("/proc/locks").unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let Some(i) = f.iter().position(|t| *t == id) {
            let (start, end): (u64, u64) = (f[i + 1].parse().unwrap(), f[i + 2].parse().unwrap());
            bytes.extend(start..=end);
        }
    }
    bytes.sort_unstable();
    bytes
}

#[test]
fn vblk_locks_the_bytes_a_qemu_virtio_blk_disk_locks() {
    // QEMU 7.2's -device virtio-blk-pci takes 100, 101, 201 writable and 100, 201
    // read-only: consistent read (+ write) held, write not shared.
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let rw = vblk(dir.path(), "rw", &img, &[]);
    assert_eq!(locked_bytes(&img), [100, 101, 201], "{}", rw.describe());
    drop(rw);
    assert_eq!(locked_bytes(&img), [0u64; 0], "released when vblk ends");
    let ro = vblk(dir.path(), "ro", &img, &["--read-only"]);
    assert_eq!(locked_bytes(&img), [100, 201], "{}", ro.describe());
}

/// A daemon whose frontend has gone writes nothing: it makes the image durable and lets
/// its locks go until a frontend starts a ring again. (A paused VM's migration never
/// turns dirty logging on, so the source's daemon never sees a switchover: the
/// destination's took the image only once the source daemon was stopped.) A frontend
/// that comes back takes the locks again, and is refused while another writer has them.
#[test]
fn a_daemon_without_a_frontend_lets_the_image_go() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let first = vblk(dir.path(), "first", &img, &[]);
    assert_eq!(locked_bytes(&img), [100, 101, 201]);
    let write = |sock: &Path, byte: u8| -> Result<(), String> {
        let disk = Disk::attach(sock, &DiskOptions::default()).map_err(|e| e.to_string())?;
        let mut q = disk.take_queue(0).ok_or("no queue")?;
        q.write_at(0, &[byte; 4096]).map_err(|e| e.to_string())?;
        q.flush_sync().map_err(|e| e.to_string())
    };
    write(&first.socket, 7).unwrap();
    wait_for_locks(&img, &[], &first);
    assert!(fs::read(&img).unwrap()[..4096].iter().all(|&b| b == 7));
    // Another writer may take it now; the first daemon's next frontend is refused.
    let second = vblk(dir.path(), "second", &img, &[]);
    assert!(
        write(&first.socket, 8).is_err(),
        "two daemons wrote the image at once"
    );
    write(&second.socket, 9).unwrap();
    drop(second);
    // The second has gone: a frontend of the first takes the image back.
    write(&first.socket, 10).unwrap();
    wait_for_locks(&img, &[], &first);
    assert!(fs::read(&img).unwrap()[..4096].iter().all(|&b| b == 10));
}

/// A qcow2 image an outside program resized while the daemon held no lock on it (no
/// frontend attached): the next frontend is served the image at its new size, with what
/// the program wrote. It was refused until the daemon restarted ("another writer still
/// holds the image"): taking the image over refused a changed virtual size.
#[test]
fn a_qcow2_resized_while_no_frontend_holds_it_is_served_at_its_new_size() {
    let dir = temp_dir("locking");
    let d = dir.path();
    // A frontend that read only: the file is left as qemu-img made it (196616 bytes).
    let (img, daemon) = qcow2_let_go(d, "16M");
    let disk = Disk::attach(&daemon.socket, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    q.write_at(0, &[7; 4096]).unwrap();
    q.flush_sync().unwrap();
    drop((q, disk));
    wait_for_locks(&img, &[], &daemon);
    qemu_tool(d, "qemu-img", &["resize", "disk.qcow2", "32M"]);
    qemu_tool(d, "qemu-io", &["-c", "write -P 0x5a 20M 64k", "disk.qcow2"]);
    let disk = Disk::attach(&daemon.socket, &DiskOptions::default()).unwrap();
    // The frontend read the old capacity with the configuration; the daemon tells it the
    // new one when it takes the image over, as its ring starts.
    let t0 = Instant::now();
    while disk.capacity_bytes() != 32 * MIB {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "capacity {}, not {}: {}",
            disk.capacity_bytes(),
            32 * MIB,
            daemon.describe()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut q = disk
        .take_queue(0)
        .unwrap_or_else(|| panic!("no queue: {}", daemon.describe()));
    let mut buf = vec![0u8; 65536];
    q.read_at(20 * MIB, &mut buf)
        .unwrap_or_else(|e| panic!("reading what qemu-io wrote: {e}: {}", daemon.describe()));
    assert!(
        buf.iter().all(|&b| b == 0x5a),
        "qemu-io's write is not read"
    );
    q.read_at(0, &mut buf[..4096]).unwrap();
    assert!(
        buf[..4096].iter().all(|&b| b == 7),
        "the first write is lost"
    );
    q.write_at(31 * MIB, &[8; 4096]).unwrap();
    q.flush_sync().unwrap();
    // A qcow2 file need not be a whole number of sectors (it was warned about at every
    // take-over).
    let log = daemon.log_text();
    assert!(!log.contains("not a multiple of 512"), "{log}");
}

/// `vblk disk resize` right after a frontend left, while the daemon lets the image go
/// (a qcow2's metadata written and synced): the resize waits for that and takes the
/// image back. It failed with EIO ("handed over to another daemon") when it came in
/// between.
#[test]
fn a_resize_right_after_the_frontend_leaves_is_not_refused() {
    let dir = temp_dir("locking");
    let d = dir.path();
    let img = d.join("disk.qcow2");
    qemu_tool(
        d,
        "qemu-img",
        &["create", "-f", "qcow2", "disk.qcow2", "16M"],
    );
    let ctl = d.join("ctl.sock");
    let daemon = vblk(
        d,
        "q",
        &img,
        &[
            "--format",
            "qcow2",
            "--control-socket",
            ctl.to_str().unwrap(),
        ],
    );
    let mut size = 16 * MIB;
    for round in 0..10u8 {
        let disk = Disk::attach(&daemon.socket, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        // Allocating writes: the release has mappings to write and sync.
        for k in 0..16 {
            q.write_at(k * MIB + u64::from(round) * 65536, &[round; 4096])
                .unwrap();
        }
        q.flush_sync().unwrap();
        drop((q, disk));
        size += MIB;
        let (ok, out) = support::cli::vblk(&[
            "disk",
            "resize",
            ctl.to_str().unwrap(),
            "q",
            &size.to_string(),
        ]);
        assert!(ok, "round {round}: {out}: {}", daemon.describe());
    }
    let disk = Disk::attach(&daemon.socket, &DiskOptions::default()).unwrap();
    assert_eq!(disk.capacity_bytes(), size);
}

/// A migration's switchover while the source's storage still holds a write (past the
/// drain timeout, so the ring stop is answered with the write fenced): the source keeps
/// the image's write locks until the write has landed, and the destination's ring start
/// waits for them, so the destination's newer write lands after it. The source let go at
/// once, the destination wrote, and the source's stale write landed over it seconds later
/// (a guest's flushed data lost).
#[test]
fn a_write_still_at_the_disk_at_the_switchover_lands_before_the_destinations() {
    switchover_with_a_write_held(false);
}

/// The same when the source's frontend leaves right after the switchover (QEMU quits the
/// source once the migration completed), before the held write has landed: the daemon
/// hands the image over once it has (the release was put off and never tried again, so
/// the destination waited for locks that never came).
#[test]
fn a_switchover_put_off_completes_after_its_frontend_left() {
    switchover_with_a_write_held(true);
}

fn switchover_with_a_write_held(source_leaves: bool) {
    use std::os::fd::AsRawFd;
    use support::raw_frontend::{self as rf, pf, req, u64p};
    use support::raw_ring::{self as rr, Guest, StartedRing};
    let dir = temp_dir("locking");
    let d = dir.path();
    let img = image(d);
    // The source holds every write 6 s before it reaches the file; a drain gives up after
    // 1 s, so the stop below (within 2 s of the write) always finds it still held. The
    // destination starts inactive.
    let ctl = d.join("src.ctl");
    let src = vblk(
        d,
        "src",
        &img,
        &[
            "--delay-every",
            "1:6000:hold-writes",
            "--drain-timeout-secs",
            "1",
            "--control-socket",
            ctl.to_str().unwrap(),
        ],
    );
    let dst = vblk(d, "dst", &img, &["--incoming"]);
    // The source's frontend: a ring, dirty logging on, a write of 'X' to sector 8.
    let mut s = StartedRing::start(&src.socket, pf::MQ | pf::CONFIG | pf::LOG_SHMFD);
    // A bitmap for memory at 4 GiB (256 KiB covers 8 GiB), then LOG_ALL.
    let log = Guest::new(256 << 10, true, 0);
    s.c.ok(
        "SET_LOG_BASE",
        req::SET_LOG_BASE,
        &[u64p(256 << 10), u64p(0)].concat(),
        &[log.fd()],
    )
    .unwrap();
    let features = rf::VERSION_1 | rf::F_PROTOCOL_FEATURES | (1 << 26);
    s.c.ok(
        "SET_FEATURES (LOG_ALL)",
        req::SET_FEATURES,
        &u64p(features),
        &[],
    )
    .unwrap();
    s.ring.write_req(&s.g, 8, b'X', None);
    rr::write_u64(s.kick.as_raw_fd(), 1).unwrap();
    let sent = Instant::now();
    // The source has taken the write before the switchover (a stop that comes first
    // leaves it in the ring, for the destination: in CI it did, and nothing was held).
    let taken = || support::cli::stats(&ctl)["disks"][0]["queues"][0]["in_flight"].as_u64();
    while taken() != Some(1) {
        assert!(
            sent.elapsed() < Duration::from_secs(2),
            "the source did not take the write in 2 s: {}",
            src.describe()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The switchover: the ring stops; the write is still held, so the stop is answered
    // after the drain timeout with the write fenced.
    s.stop();
    if source_leaves {
        drop(s);
    }
    // The destination's frontend writes 'Y' there and flushes.
    let disk = Disk::attach(&dst.socket, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    q.write_at(8 * 512, &[b'Y'; 512]).unwrap();
    q.flush_sync().unwrap();
    // Until the source's write has surely landed, had it been let go.
    std::thread::sleep(Duration::from_secs(8).saturating_sub(sent.elapsed()));
    let bytes = fs::read(&img).unwrap();
    assert!(
        bytes[4096..4608].iter().all(|&b| b == b'Y'),
        "the destination's write was overwritten by the source's ({:?}): {}\n{}",
        bytes[4096] as char,
        src.describe(),
        dst.describe()
    );
    let log = src.log_text();
    assert!(
        log.contains(
            "requests are still at the disk: the image's write locks are kept until they end"
        ),
        "{log}"
    );
    if source_leaves {
        assert!(
            log.contains("the requests still at the disk at the switchover have ended"),
            "{log}"
        );
    }
}

/// A daemon keeps the image's locks through a reload (SIGHUP) and a `vblk disk resize`
/// before any frontend came: a second writer is still refused. Every wake-up of the
/// disk's thread let them go.
#[test]
fn a_reload_before_any_frontend_keeps_the_image() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let ctl = dir.path().join("ctl.sock");
    let mut first = vblk(
        dir.path(),
        "first",
        &img,
        &["--control-socket", ctl.to_str().unwrap()],
    );
    assert_eq!(locked_bytes(&img), [100, 101, 201]);
    // SAFETY: kill(2) with a pid this test started and a signal number.
    assert_eq!(unsafe { libc::kill(first.pid() as i32, libc::SIGHUP) }, 0);
    let (ok, out) = support::cli::vblk(&["disk", "resize", ctl.to_str().unwrap(), "first", "32M"]);
    assert!(ok, "{out}");
    let t0 = Instant::now();
    while !first.log_text().contains("resized from") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{}",
            first.describe()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both wake-ups are handled by now; give the thread a moment to act on them.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(locked_bytes(&img), [100, 101, 201], "{}", first.describe());
    vblk_refused(dir.path(), &img, &[]);
    first.assert_running("after a reload");
}

/// A qcow2 image another program shrank while no frontend held it is not served smaller
/// unless --allow-shrink says so (as SIGHUP refuses a shrink): the next ring start is
/// refused, naming both sizes. It was adopted, and the guest told of the smaller disk.
#[test]
fn a_qcow2_shrunk_meanwhile_is_refused_without_allow_shrink() {
    let dir = temp_dir("locking");
    let d = dir.path();
    let (_img, daemon) = qcow2_let_go(d, "32M");
    qemu_tool(d, "qemu-img", &["resize", "--shrink", "disk.qcow2", "16M"]);
    let refused = Disk::attach(&daemon.socket, &DiskOptions::default())
        .ok()
        .and_then(|disk| disk.take_queue(0).map(|mut q| q.read_at(0, &mut [0; 4096])))
        .is_none_or(|r| r.is_err());
    assert!(refused, "a shrunk image was served: {}", daemon.describe());
    let log = daemon.log_text();
    assert!(
        log.contains(
            "the image shrank from 33554432 to 16777216 bytes while another program held it"
        ),
        "{log}"
    );
}

/// A new qcow2 image of `size` in `dir` (disk.qcow2), served by a daemon whose first
/// frontend read from it and left: the daemon has let the image go.
fn qcow2_let_go(dir: &Path, size: &str) -> (PathBuf, Daemon) {
    let img = dir.join("disk.qcow2");
    qemu_tool(
        dir,
        "qemu-img",
        &["create", "-f", "qcow2", "disk.qcow2", size],
    );
    let daemon = vblk(dir, "q", &img, &["--format", "qcow2"]);
    let disk = Disk::attach(&daemon.socket, &DiskOptions::default()).unwrap();
    disk.take_queue(0)
        .unwrap()
        .read_at(0, &mut [0; 4096])
        .unwrap();
    drop(disk);
    wait_for_locks(&img, &[], &daemon);
    (img, daemon)
}

fn wait_for_locks(img: &Path, want: &[u64], daemon: &Daemon) {
    let t0 = Instant::now();
    while locked_bytes(img) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "locks {:?}, not {want:?}: {}",
            locked_bytes(img),
            daemon.describe()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_second_writable_vblk_is_refused_naming_the_first() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let mut first = vblk(dir.path(), "first", &img, &[]);
    let err = vblk_refused(dir.path(), &img, &[]);
    assert_names(
        &err,
        &[
            &format!("{}: Failed to get \"write\" lock", img.display()),
            "byte 201",
            "QEMU's image locking convention",
            &format!("vblk (pid {})", first.pid()),
            "--image-lock off",
        ],
    );
    first.assert_running("after a second vblk was refused");
}

#[test]
fn two_read_only_vblk_share_an_image() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let mut a = vblk(dir.path(), "a", &img, &["--read-only"]);
    let mut b = vblk(dir.path(), "b", &img, &["--read-only"]);
    a.assert_running("beside another reader");
    b.assert_running("beside another reader");
}

#[test]
fn a_reader_and_a_writer_exclude_each_other() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let reader = vblk(dir.path(), "reader", &img, &["--read-only"]);
    let err = vblk_refused(dir.path(), &img, &[]);
    assert_names(
        &err,
        &[
            "Failed to get \"write\" lock",
            "byte 201",
            &format!("vblk (pid {})", reader.pid()),
        ],
    );
    drop(reader);
    let writer = vblk(dir.path(), "writer", &img, &[]);
    let err = vblk_refused(dir.path(), &img, &["--read-only"]);
    assert_names(
        &err,
        &[
            "Failed to get shared \"write\" lock",
            "byte 101",
            "open for writing",
            &format!("vblk (pid {})", writer.pid()),
        ],
    );
}

#[test]
fn qemu_storage_daemon_is_refused_by_a_vblk_writer() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let mut v = vblk(dir.path(), "vblk", &img, &[]);
    let err = qsd_refused(dir.path(), &img);
    // QEMU's own words: it finds byte 201 (write not shared) locked.
    assert_names(&err, &["Failed to get \"write\" lock"]);
    v.assert_running("after qemu-storage-daemon was refused");
}

#[test]
fn vblk_is_refused_by_a_qemu_storage_daemon_writer() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let mut q = qsd(dir.path(), &img);
    let holder = format!("qemu-storage-daemon (pid {})", q.pid());
    for args in [&[][..], &["--read-only"][..]] {
        let err = vblk_refused(dir.path(), &img, args);
        assert_names(
            &err,
            &[
                &format!("{}: Failed to get shared \"write\" lock", img.display()),
                "byte 101",
                &holder,
                "--image-lock off",
            ],
        );
    }
    q.assert_running("after vblk was refused");
}

#[test]
fn image_lock_off_lets_a_second_one_start() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let mut first = vblk(dir.path(), "first", &img, &[]);
    let mut second = vblk(dir.path(), "second", &img, &["--image-lock", "off"]);
    assert_eq!(
        locked_bytes(&img),
        [100, 101, 201],
        "the second takes no locks"
    );
    first.assert_running("beside an unlocked second");
    second.assert_running("beside a locked first");
    // An unlocked vblk excludes nobody: qemu-storage-daemon starts beside it.
    drop(first);
    let mut q = qsd(dir.path(), &img);
    q.assert_running("beside vblk --image-lock off");
}

#[test]
fn locks_die_with_their_holder() {
    let dir = temp_dir("locking");
    let img = image(dir.path());
    let first = vblk(dir.path(), "first", &img, &[]);
    drop(first); // SIGKILL, then reaped
    let mut second = vblk(dir.path(), "second", &img, &[]);
    second.assert_running("after the first was killed");
}
