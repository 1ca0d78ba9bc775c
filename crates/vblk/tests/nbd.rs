//! NBD disks end to end: `vblk serve --blk-file nbd+unix:///...` on nbdkit, with our driver
//! doing verified I/O through the vhost-user device and the NBD client into the server's
//! file; `vblk bench --disk nbd+unix://...` (embedded device) with verification; the
//! comparison with qemu-storage-daemon serving the same nbdkit export; a read-only export
//! refused with a clear error unless served `--read-only`.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};
use support::assets::{find_program, require_programs};
use support::daemon::{Backend, Daemon, Export};
use support::nbdkit::Nbdkit;
use support::util::{die_with_parent, temp_dir};

const MIB: usize = 1 << 20;
const IO_TIMEOUT: Duration = Duration::from_secs(60);

fn vblk() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vblk"));
    c.args(["--log-level", "warn"]);
    c
}

/// `vblk bench ARGS`; its stdout.
fn bench(args: &[&str]) -> String {
    let out = vblk().arg("bench").args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "vblk bench {args:?} failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The driver writes patterns through `vblk serve` on nbdkit's file plugin, reads them
/// back, flushes, and the image file holds them.
#[test]
fn serve_on_nbdkit_file_with_verified_driver_io() {
    verified_driver_io(&[]);
}

/// The same on a server that offers no multi-conn: the disk's two queues are served by
/// one worker whatever `--threads` says (every frontend was refused with two).
#[test]
fn a_server_without_multi_conn_is_served_by_one_worker() {
    verified_driver_io(&["--filter=multi-conn"]);
}

/// `vblk serve --threads 2` with two queues on nbdkit's file plugin (and `filters`):
/// 64 writes in flight per queue, read back, flushed, and the file is what was written.
fn verified_driver_io(filters: &[&str]) {
    let dir = temp_dir("vblk-nbd-");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 64 * MIB]).unwrap();
    let mut args = filters.to_vec();
    args.extend(["file", img.to_str().unwrap()]);
    if !filters.is_empty() {
        args.push("multi-conn-mode=disable");
    }
    let nbd = Nbdkit::start(dir.path(), &args);
    let sock = dir.path().join("vblk.sock");
    let d = Daemon::start(
        Backend::Vblk,
        "vblk serve (nbd)",
        &Export::new(nbd.uri(), 2).args(&["--threads", "2"]),
        &sock,
        &dir.path().join("serve.log"),
    );
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    assert_eq!(disk.info().capacity_bytes, 64 * MIB as u64);
    let mut model = vec![0u8; 64 * MIB];
    let mut queues = disk.take_queues();
    for (qi, q) in queues.iter_mut().enumerate() {
        // 64 writes of 64 KiB each in flight at once per queue, then read back.
        let stripe = 32 * MIB * qi;
        for i in 0..64u64 {
            let mut b = q.alloc(64 * 1024).unwrap();
            let fill = (qi as u8) * 64 + i as u8 + 1;
            b.fill(fill);
            let off = stripe + (i as usize) * 256 * 1024;
            model[off..off + 64 * 1024].fill(fill);
            q.write(off as u64, b, i).unwrap();
        }
        for _ in 0..64 {
            let c = q.wait(Some(IO_TIMEOUT)).unwrap();
            assert!(
                c.result.is_ok(),
                "queue {qi}: write {}: {:?}",
                c.token,
                c.result
            );
        }
        for i in 0..64u64 {
            let off = stripe + (i as usize) * 256 * 1024;
            q.read(off as u64, q.alloc(128 * 1024).unwrap(), i).unwrap();
        }
        for _ in 0..64 {
            let c = q.wait(Some(IO_TIMEOUT)).unwrap();
            assert!(c.result.is_ok(), "queue {qi}: read: {:?}", c.result);
            let off = stripe + (c.token as usize) * 256 * 1024;
            let got = c.bufs.into_one().unwrap();
            assert!(
                got[..] == model[off..off + 128 * 1024],
                "queue {qi}: read at {off} differs"
            );
        }
        q.flush_sync().unwrap();
    }
    drop(queues);
    drop(disk);
    let file = std::fs::read(&img).unwrap();
    assert!(
        file == model,
        "the image file differs from what the driver wrote"
    );
    drop(d);
}

/// `vblk bench --disk nbd+unix://...`: the embedded device on an NBD disk, verified.
#[test]
fn bench_embedded_device_on_nbd_disk_verifies() {
    let dir = temp_dir("vblk-nbd-");
    let nbd = Nbdkit::start(dir.path(), &["memory", "256M"]);
    let out = bench(&[
        "--disk",
        &nbd.uri(),
        "--rw=randrw",
        "--bs=4k",
        "--iodepth=16",
        "--size=64m",
        "--runtime=1",
        "--time_based",
        "--verify=crc32c",
    ]);
    assert!(out.contains("no mismatch"), "{out}");
}

/// The comparison the BENCHMARKS.md figures come from, run short: vblk serve and
/// qemu-storage-daemon on the same nbdkit export, side by side.
#[test]
fn compare_with_qemu_storage_daemon_on_the_same_export() {
    let dir = temp_dir("vblk-nbd-");
    let nbd = Nbdkit::start(dir.path(), &["memory", "256M"]);
    let vsock = dir.path().join("vblk.sock");
    let v = Daemon::start(
        Backend::Vblk,
        "vblk serve (nbd)",
        &Export::new(nbd.uri(), 1),
        &vsock,
        &dir.path().join("serve.log"),
    );
    require_programs(&[("qemu-storage-daemon", "qemu-system-common")]);
    let qsock = dir.path().join("qsd.sock");
    let mut cmd = Command::new(find_program("qemu-storage-daemon").expect("checked"));
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=nbd,node-name=n,server.type=unix,server.path={}",
            nbd.sock.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=n,addr.type=unix,addr.path={},writable=on,num-queues=1",
            qsock.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    die_with_parent(&mut cmd);
    let mut qsd = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !qsock.exists() {
        assert!(
            qsd.try_wait().unwrap().is_none(),
            "qemu-storage-daemon exited"
        );
        assert!(
            Instant::now() < deadline,
            "qemu-storage-daemon never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let compare = format!(
        "socket={}@{},{}@{}",
        vsock.display(),
        v.pid(),
        qsock.display(),
        qsd.id()
    );
    let out = bench(&[
        "--socket",
        vsock.to_str().unwrap(),
        "--rw=randread",
        "--bs=4k",
        "--iodepth=32",
        "--runtime=1",
        "--time_based",
        "--compare",
        &compare,
    ]);
    assert!(out.contains("qsd.sock"), "{out}");
    assert!(out.contains("vblk.sock"), "{out}");
    let _ = qsd.kill();
    let _ = qsd.wait();
}

/// A read-only export: `vblk serve` refuses it with a clear error unless `--read-only`.
#[test]
fn read_only_export_needs_read_only() {
    let dir = temp_dir("vblk-nbd-");
    let nbd = Nbdkit::start(dir.path(), &["-r", "memory", "16M"]);
    let out = vblk()
        .args(["serve", "--socket-path"])
        .arg(dir.path().join("v.sock"))
        .args(["--blk-file", &nbd.uri()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the export is read-only") && err.contains("--read-only"),
        "{err}"
    );
    let sock = dir.path().join("ro.sock");
    let _d = Daemon::start(
        Backend::Vblk,
        "vblk serve (nbd, read-only)",
        &Export::new(nbd.uri(), 1).read_only(),
        &sock,
        &dir.path().join("ro.log"),
    );
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    assert!(disk.info().read_only);
    let mut q = disk.take_queue(0).unwrap();
    q.read(0, q.alloc(4096).unwrap(), 1).unwrap();
    let c = q.wait(Some(IO_TIMEOUT)).unwrap();
    assert!(c.result.is_ok());
    assert!(c.bufs.into_one().unwrap().iter().all(|&b| b == 0));
}

/// A frontend that connects while the NBD server is down cannot be served (its session
/// needs a connection to the server), but the daemon is not taken down with it: once the
/// server is back, the next frontend is served.
#[test]
fn a_session_that_cannot_reach_the_server_ends_only_itself() {
    let dir = temp_dir("vblk-nbd-");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 16 * MIB]).unwrap();
    let nbd = Nbdkit::start(dir.path(), &["file", img.to_str().unwrap()]);
    let uri = nbd.uri();
    let sock = dir.path().join("vblk.sock");
    let mut d = Daemon::start(
        Backend::Vblk,
        "vblk serve (nbd)",
        &Export::new(&uri, 1).args(&["--nbd-timeout-secs", "2"]),
        &sock,
        &dir.path().join("serve.log"),
    );
    // The server goes away; the daemon keeps listening.
    drop(nbd);
    let refused = Disk::attach(&sock, &DiskOptions::default());
    assert!(refused.is_err(), "a session without a server was set up");
    std::thread::sleep(Duration::from_millis(300));
    d.assert_running("after a frontend whose session could not be set up");
    assert!(
        d.log_text().contains("its session cannot be set up"),
        "the daemon did not say why:\n{}",
        d.log_text()
    );
    // The server comes back (same socket): the next frontend is served.
    let nbd = Nbdkit::start(dir.path(), &["file", img.to_str().unwrap()]);
    assert_eq!(nbd.uri(), uri);
    let disk =
        Disk::attach(&sock, &DiskOptions::default()).expect("served once the server is back");
    let mut q = disk.take_queue(0).unwrap();
    let mut b = q.alloc(4096).unwrap();
    b.fill(0x3c);
    q.write(0, b, 1).unwrap();
    let c = q.wait(Some(IO_TIMEOUT)).unwrap();
    assert!(c.result.is_ok(), "{:?}", c.result);
    q.flush_sync().unwrap();
    drop(q);
    drop(disk);
    assert_eq!(std::fs::read(&img).unwrap()[..4096], [0x3c; 4096]);
    d.assert_running("at the end");
}

/// An NBD server over TCP, named by host name, restarted while `vblk serve` (confined:
/// seccomp, Landlock, no capabilities) serves it: the daemon reconnects (a TCP socket to
/// the server's port, the name's addresses found when it started) and the data is there.
#[test]
fn a_tcp_server_by_name_is_reconnected_to_from_inside_the_sandbox() {
    let dir = temp_dir("vblk-nbd-");
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 16 * MIB]).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nbdkit = find_program("nbdkit").expect("nbdkit (Debian package nbdkit)");
    let start = || {
        let mut cmd = Command::new(&nbdkit);
        cmd.args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "file"])
            .arg(&img)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        die_with_parent(&mut cmd);
        let child = cmd.spawn().unwrap();
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "nbdkit did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    };
    let mut server = start();
    let sock = dir.path().join("vblk.sock");
    let uri = format!("nbd://localhost:{port}/");
    let d = Daemon::start(
        Backend::Vblk,
        "vblk serve (nbd tcp)",
        &Export::new(&uri, 1).args(&["--nbd-reconnect-secs", "20"]),
        &sock,
        &dir.path().join("serve.log"),
    );
    assert!(d.log_text().contains("seccomp:"), "{}", d.log_text());
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    let write = |q: &mut driver::Queue, fill: u8, at: u64| {
        let mut b = q.alloc(8192).unwrap();
        b.fill(fill);
        q.write(at, b, u64::from(fill)).unwrap();
        let c = q.wait(Some(IO_TIMEOUT)).unwrap();
        assert!(c.result.is_ok(), "{:?}", c.result);
        q.flush_sync().unwrap();
    };
    write(&mut q, 0x21, 0);
    // The server restarts: the next write waits for the reconnection.
    let _ = server.kill();
    let _ = server.wait();
    server = start();
    write(&mut q, 0x42, 65536);
    drop(q);
    drop(disk);
    let data = std::fs::read(&img).unwrap();
    assert!(data[..8192].iter().all(|&b| b == 0x21));
    assert!(data[65536..65536 + 8192].iter().all(|&b| b == 0x42));
    assert!(!d.log_text().contains(" ERROR "), "{}", d.log_text());
    let _ = server.kill();
    let _ = server.wait();
}
