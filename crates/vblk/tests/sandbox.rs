//! `vblk serve` confines itself once set up (docs/security.md), and each layer holds:
//!
//! - /proc/PID/status shows seccomp filtering (`Seccomp: 2`), `NoNewPrivs: 1` and no
//!   capability (effective and bounding set empty) while the daemon serves I/O, resizes on
//!   SIGHUP, serves its statistics and stops cleanly (its sockets removed);
//! - from inside the daemon (`VBLK_SANDBOX_SELFTEST`): `execve` and `socket(AF_INET)`
//!   (no TCP NBD disk) end it with SIGSYS; with `--seccomp trap` the call and the thread
//!   are named on stderr before it exits; opening /etc/passwd fails with EACCES (Landlock)
//!   and the daemon goes on;
//! - as an ordinary user (`setpriv` to nobody) on an image it owns, in a directory only it
//!   may enter, it serves I/O confined the same way.
//!
//! The rest of the suite runs every daemon with the default sandbox too (`--seccomp
//! kill`): a system call missing from the allow-list fails CI there.

mod support;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};
use support::assets::require_programs;
use support::util::{die_with_parent, temp_dir};

const MIB: u64 = 1 << 20;

struct Serve {
    child: Child,
    log: PathBuf,
    sock: PathBuf,
}

impl Serve {
    fn start(dir: &Path, image: &Path, extra: &[&str], env: &[(&str, &str)], user: bool) -> Serve {
        let sock = dir.join("s.sock");
        let log = dir.join("serve.log");
        let out = fs::File::create(&log).unwrap();
        let mut cmd = if user {
            require_programs(&[("setpriv", "util-linux")]);
            let mut c = Command::new("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"]);
            c.arg(env!("CARGO_BIN_EXE_vblk"));
            c
        } else {
            Command::new(env!("CARGO_BIN_EXE_vblk"))
        };
        cmd.args(["--log-level", "info", "serve", "--socket-path"])
            .arg(&sock)
            .arg("--blk-file")
            .arg(image)
            .args(["--format", "raw", "--num-queues", "1", "--control-socket"])
            .arg(dir.join("c.sock"))
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        die_with_parent(&mut cmd);
        Serve::confined(cmd.spawn().expect("start vblk serve"), log, sock)
    }

    /// A started daemon once it has confined itself. Its sockets exist before that (they
    /// are bound, then the sandbox closes the doors), so a socket is no sign of it.
    fn confined(child: Child, log: PathBuf, sock: PathBuf) -> Serve {
        let s = Serve { child, log, sock };
        let log = s.log_with("sandbox:");
        assert!(
            log.contains("sandbox:"),
            "vblk serve did not confine itself:\n{log}"
        );
        s
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log once it holds `needle`, or as it is after 20 s: what the daemon writes
    /// comes some time after what made it write.
    fn log_with(&self, needle: &str) -> String {
        let t0 = Instant::now();
        loop {
            let log = self.log_text();
            if log.contains(needle) || t0.elapsed() > Duration::from_secs(20) {
                return log;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn status(&self) -> String {
        fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default()
    }

    fn field(&self, name: &str) -> String {
        self.status()
            .lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {name} in /proc status"))
    }

    /// Wait for the process to end (at most `within`).
    fn wait(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < within {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn image(dir: &Path) -> PathBuf {
    let p = dir.join("disk.img");
    fs::File::create(&p).unwrap().set_len(16 * MIB).unwrap();
    p
}

/// Write a pattern through the daemon and read it back.
fn io(sock: &Path, fill: u8) {
    let disk = Disk::attach(sock, &DiskOptions::default()).expect("attach");
    let mut q = disk.take_queue(0).unwrap();
    let mut b = q.alloc(64 * 1024).unwrap();
    b.fill(fill);
    q.write(4096, b, 1).unwrap();
    let c = q.wait(Some(Duration::from_secs(10))).unwrap();
    assert!(c.result.is_ok(), "{:?}", c.result);
    q.read(4096, q.alloc(64 * 1024).unwrap(), 2).unwrap();
    let c = q.wait(Some(Duration::from_secs(10))).unwrap();
    assert!(c.result.is_ok(), "{:?}", c.result);
    assert!(c.bufs.into_one().unwrap().iter().all(|&x| x == fill));
    q.flush_sync().unwrap();
}

fn assert_confined(s: &Serve) {
    assert_eq!(s.field("Seccomp:"), "2", "seccomp filtering");
    assert_eq!(s.field("NoNewPrivs:"), "1");
    assert_eq!(s.field("CapEff:"), "0000000000000000", "no capability");
    assert_eq!(s.field("CapPrm:"), "0000000000000000");
    let log = s.log_text();
    assert!(log.contains("filesystem confined"), "{log}");
    assert!(log.contains("seccomp:"), "{log}");
}

#[test]
fn the_default_daemon_is_confined_and_serves_resizes_reports_and_stops() {
    let dir = temp_dir("vblk-sandbox-");
    let img = image(dir.path());
    let mut s = Serve::start(dir.path(), &img, &[], &[], false);
    assert_confined(&s);
    assert_eq!(
        s.field("CapBnd:"),
        "0000000000000000",
        "bounding set emptied (root)"
    );
    io(&s.sock, 0x5a);
    // SIGHUP: the disk's size is read again (fstat and ioctls under the filter).
    fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    s.signal(libc::SIGHUP);
    let log = s.log_with("the disk is now 33554432 bytes");
    assert!(
        log.contains("the disk is now 33554432 bytes"),
        "no resize:\n{log}"
    );
    // Statistics, then a second frontend.
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .arg("stats")
        .arg(dir.path().join("c.sock"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    io(&s.sock, 0xa5);
    s.signal(libc::SIGTERM);
    let st = s.wait(Duration::from_secs(20)).expect("did not stop");
    assert!(st.success(), "{st}:\n{}", s.log_text());
    assert!(!s.sock.exists(), "the socket is removed at exit");
    assert!(!dir.path().join("c.sock").exists());
}

/// Sockets named relative to the working directory, in it (`--socket-path s.sock`): the
/// sandbox grants removing them in "." (a bare name's parent is the empty path, which
/// Landlock cannot open).
#[test]
fn sockets_named_in_the_working_directory_are_served_confined_and_removed() {
    let dir = temp_dir("vblk-sandbox-");
    let img = image(dir.path());
    let log = dir.path().join("serve.log");
    let out = fs::File::create(&log).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.current_dir(dir.path())
        .args(["--log-level", "info", "serve", "--socket-path", "r.sock"])
        .args(["--blk-file", "disk.img", "--format", "raw"])
        .args(["--control-socket", "rc.sock"])
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    die_with_parent(&mut cmd);
    let mut s = Serve::confined(
        cmd.spawn().expect("start vblk serve"),
        log,
        dir.path().join("r.sock"),
    );
    assert!(s.sock.exists(), "no socket:\n{}", s.log_text());
    assert_confined(&s);
    io(&s.sock, 0x3c);
    assert!(img.exists());
    s.signal(libc::SIGTERM);
    let st = s.wait(Duration::from_secs(20)).expect("did not stop");
    assert!(st.success(), "{st}:\n{}", s.log_text());
    assert!(!s.sock.exists(), "the socket is removed at exit");
    assert!(!dir.path().join("rc.sock").exists());
}

#[test]
fn forbidden_calls_from_inside_end_the_daemon_or_fail() {
    let dir = temp_dir("vblk-sandbox-");
    let img = image(dir.path());
    for what in ["execve", "socket-inet"] {
        let mut s = Serve::start(
            dir.path(),
            &img,
            &[],
            &[("VBLK_SANDBOX_SELFTEST", what)],
            false,
        );
        let st = s.wait(Duration::from_secs(20)).expect("the daemon went on");
        assert_eq!(
            st.signal(),
            Some(libc::SIGSYS),
            "{what}: {st}:\n{}",
            s.log_text()
        );
        let _ = fs::remove_file(&s.sock);
    }
    // --seccomp trap names the call and the thread.
    let mut s = Serve::start(
        dir.path(),
        &img,
        &["--seccomp", "trap"],
        &[("VBLK_SANDBOX_SELFTEST", "execve")],
        false,
    );
    let st = s.wait(Duration::from_secs(20)).expect("the daemon went on");
    assert_eq!(st.code(), Some(159), "{st}");
    let log = s.log_text();
    assert!(
        log.contains("thread vblk made system call 59 (execve), which the sandbox does not allow"),
        "{log}"
    );
    let _ = fs::remove_file(&s.sock);
    // Landlock: the file cannot be opened; the daemon serves on.
    let s = Serve::start(
        dir.path(),
        &img,
        &[],
        &[("VBLK_SANDBOX_SELFTEST", "open-passwd")],
        false,
    );
    let log = s.log_with("open(/etc/passwd) refused");
    assert!(
        log.contains("open(/etc/passwd) refused: Permission denied"),
        "{log}"
    );
    io(&s.sock, 0x11);
}

#[test]
fn an_ordinary_user_serves_an_image_it_owns_confined() {
    let dir = temp_dir("vblk-sandbox-");
    // A directory only `nobody` may enter, with its image.
    let home = dir.path().join("nobody");
    fs::create_dir(&home).unwrap();
    let img = image(&home);
    let chown = |p: &Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: chown of a NUL-terminated path we made.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
    };
    chown(&home);
    chown(&img);
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700)).unwrap();
    // The temp dir must be traversable by nobody.
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let s = Serve::start(&home, &img, &[], &[], true);
    assert_confined(&s);
    assert_eq!(s.field("Uid:").split_whitespace().next(), Some("65534"));
    let log = s.log_text();
    assert!(log.contains("no capabilities held"), "{log}");
    io(&s.sock, 0x77);
    let mode = fs::metadata(&s.sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is the user's own");
}
