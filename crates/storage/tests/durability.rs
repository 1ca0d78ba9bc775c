//! Write-through durability of discard and write-zeroes, seen from the storage underneath.
//!
//! A write-through disk (the guest turned its write cache off, or never negotiated FLUSH)
//! must complete a request only once it is stable: for writes that is `RWF_DSYNC`; a
//! discard or a write-zeroes must be followed by a `fdatasync` before it completes.
//!
//! The chain that makes this visible is made of real parts: the engine's file is a FUSE
//! file (`nbdfuse`) over an nbdkit memory export whose `log` filter records every request
//! the kernel passes down. A `fallocate` arrives as an NBD TRIM or ZERO, an `fdatasync` as
//! an NBD FLUSH; one connection keeps them in order. Each engine is checked both ways:
//! durable ops are followed by a FLUSH before they complete, plain ones are not.
//!
//! The NBD engine is checked the same way against nbdkit directly: a durable TRIM,
//! WRITE_ZEROES or WRITE carries FUA, or is followed by a FLUSH (offset 0, length 0) on a
//! server without FUA.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{run1, scratch, write};
use vblk_storage::nbd::NbdOptions;
use vblk_storage::{Backend, CacheMode, DiskSpec, EngineKind, Op, OpenOptions};

/// Where `name` is installed, or a failure that names the Debian package.
fn program(name: &str, package: &str) -> PathBuf {
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed: this test needs it to watch what reaches the storage. \
                 Install the Debian package {package} (`apt-get install {package}`; scripts/test \
                 does this)"
            )
        })
}

fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The requests the log filter recorded since the last call, as (name, line).
struct Log {
    path: PathBuf,
    seen: usize,
}

impl Log {
    fn new(path: PathBuf) -> Log {
        Log { path, seen: 0 }
    }

    /// Requests logged since the last call: "Trim fua=1", "Zero fua=0", "Flush", ...
    fn take(&mut self) -> Vec<String> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let new = lines[self.seen.min(lines.len())..].to_vec();
        self.seen = lines.len();
        new.iter()
            .filter(|l| l.ends_with(" ..."))
            .filter_map(|l| {
                let req = l.split_whitespace().find(|w| {
                    matches!(*w, "Read" | "Write" | "Trim" | "Zero" | "Flush" | "Cache")
                })?;
                let fua = l
                    .split_whitespace()
                    .find(|w| w.starts_with("fua="))
                    .map(|f| format!(" {f}"))
                    .unwrap_or_default();
                Some(format!("{req}{fua}"))
            })
            .collect()
    }
}

/// A FUSE file over an nbdkit memory export with a request log; unmounted on drop.
struct FuseDisk {
    child: Child,
    mnt: PathBuf,
    file: PathBuf,
    log: Log,
}

impl FuseDisk {
    fn start(dir: &Path) -> FuseDisk {
        let nbdfuse = program("nbdfuse", "libnbd-bin");
        let nbdkit = program("nbdkit", "nbdkit");
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        let log = dir.join("requests.log");
        let pidfile = dir.join("nbdfuse.pid");
        let child = Command::new(nbdfuse)
            .args(["-C", "1", "-P"])
            .arg(&pidfile)
            .arg(mnt.join("disk"))
            .arg("--command")
            .arg(nbdkit)
            .args(["-s", "--filter=log", "memory", "16M"])
            .arg(format!("logfile={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nbdfuse");
        let file = mnt.join("disk");
        wait_for("nbdfuse to mount", || pidfile.exists() && file.exists());
        FuseDisk {
            child,
            mnt,
            file,
            log: Log::new(log),
        }
    }
}

impl Drop for FuseDisk {
    fn drop(&mut self) {
        let path = std::ffi::CString::new(self.mnt.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: umount2 of our own mount point, by a NUL-terminated path.
        unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The three operations that change the disk without a payload, durable or not.
fn ops(durable: bool) -> [(&'static str, Op); 3] {
    [
        (
            "discard",
            Op::Discard {
                offset: 1 << 20,
                len: 64 << 10,
                durable,
            },
        ),
        (
            "write-zeroes (unmap)",
            Op::WriteZeroes {
                offset: 2 << 20,
                len: 64 << 10,
                unmap: true,
                durable,
            },
        ),
        (
            "write-zeroes (keep allocated)",
            Op::WriteZeroes {
                offset: 3 << 20,
                len: 64 << 10,
                unmap: false,
                durable,
            },
        ),
    ]
}

/// Whether a FLUSH came after the last TRIM or ZERO in `reqs`.
fn flushed_after_change(reqs: &[String]) -> bool {
    let last_change = reqs
        .iter()
        .rposition(|r| r.starts_with("Trim") || r.starts_with("Zero") || r.starts_with("Write"));
    match last_change {
        Some(i) => reqs[i + 1..].iter().any(|r| r == "Flush"),
        None => false,
    }
}

#[test]
fn durable_discard_and_write_zeroes_are_flushed_before_they_complete_on_every_engine() {
    let dir = scratch();
    let mut disk = FuseDisk::start(dir.path());
    let mut failures = Vec::new();
    for kind in EngineKind::ALL {
        let cache = match kind {
            EngineKind::Aio => CacheMode::None,
            _ => CacheMode::Writeback,
        };
        // No image locks: a dropped io_uring engine's ring lets go of the file (and its
        // locks) a moment after the drop, in the kernel, and the next engine would find
        // them held.
        let opts = OpenOptions {
            cache,
            image: vblk_storage::ImageChecks {
                lock: vblk_storage::ImageLock::Off,
                format: Some(vblk_storage::Format::Raw),
                incoming: false,
            },
            ..Default::default()
        };
        let b = Backend::open(&DiskSpec::File(disk.file.clone()), &opts)
            .unwrap_or_else(|e| panic!("{kind}: cannot open the FUSE file: {e}"));
        let b = Arc::new(b);
        let mut e = b.engine(kind, 4).unwrap();
        for durable in [true, false] {
            for (what, op) in ops(durable) {
                disk.log.take();
                // SAFETY: discard and write-zeroes lend no buffer.
                let r = unsafe { run1(&mut *e, op) };
                assert_eq!(r.unwrap(), 0, "{kind} {what}");
                let reqs = disk.log.take();
                let changed = reqs.iter().any(|r| {
                    r.starts_with("Trim") || r.starts_with("Zero") || r.starts_with("Write")
                });
                let flushed = flushed_after_change(&reqs);
                if !changed || flushed != durable {
                    failures.push(format!(
                        "{kind} {what} durable={durable}: the storage saw {reqs:?}"
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "a durable op must reach the storage and be flushed before it completes, a plain one \
         must not be flushed:\n{}",
        failures.join("\n")
    );
}

/// An nbdkit memory export with a request log on a Unix socket; `fua=false` hides FUA
/// (the fua filter, whose default mode does not advertise it), so that durability must
/// come from a FLUSH.
struct Nbdkit {
    child: Child,
    sock: PathBuf,
    log: Log,
}

impl Nbdkit {
    fn start(dir: &Path, fua: bool) -> Nbdkit {
        let sock = dir.join(format!("nbd-{fua}.sock"));
        let log = dir.join(format!("nbd-{fua}.log"));
        let mut cmd = Command::new(program("nbdkit", "nbdkit"));
        cmd.args(["-f", "-U"]).arg(&sock).arg("--filter=log");
        if !fua {
            cmd.arg("--filter=fua");
        }
        cmd.args(["memory", "16M"])
            .arg(format!("logfile={}", log.display()));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nbdkit");
        wait_for("nbdkit to listen", || sock.exists());
        Nbdkit {
            child,
            sock,
            log: Log::new(log),
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn durable_trim_and_write_zeroes_reach_an_nbd_server_with_fua_or_a_flush() {
    let dir = scratch();
    let mut failures = Vec::new();
    for fua in [true, false] {
        let mut server = Nbdkit::start(dir.path(), fua);
        let uri = format!("nbd+unix:///?socket={}", server.sock.display());
        let opts = OpenOptions {
            nbd: NbdOptions::default(),
            ..Default::default()
        };
        let b = Arc::new(Backend::open(&uri.parse::<DiskSpec>().unwrap(), &opts).unwrap());
        let mut e = b.engine(EngineKind::IoUring, 4).unwrap();
        for durable in [true, false] {
            for (what, op) in ops(durable) {
                server.log.take();
                // SAFETY: discard and write-zeroes lend no buffer.
                let r = unsafe { run1(&mut *e, op) };
                assert_eq!(r.unwrap(), 0, "{what}");
                let reqs = server.log.take();
                let change = reqs
                    .iter()
                    .rfind(|r| r.starts_with("Trim") || r.starts_with("Zero"));
                let stable = match change {
                    Some(c) => c.ends_with("fua=1") || flushed_after_change(&reqs),
                    None => false,
                };
                if change.is_none() || stable != durable {
                    failures.push(format!(
                        "server fua={fua}, {what} durable={durable}: the server saw {reqs:?}"
                    ));
                }
                if durable && fua && change.is_some_and(|c| !c.ends_with("fua=1")) {
                    failures.push(format!(
                        "server fua={fua}, {what}: FUA offered but not used: {reqs:?}"
                    ));
                }
            }
            // A write away from offset 0: its FLUSH (no FUA) must still carry offset 0.
            server.log.take();
            let data = vec![0x5au8; 4096];
            write(&mut *e, 5 << 20, &data, &[4096], 0, durable).unwrap();
            let reqs = server.log.take();
            let stable = reqs.iter().any(|r| r == "Write fua=1") || flushed_after_change(&reqs);
            if stable != durable {
                failures.push(format!(
                    "server fua={fua}, write durable={durable}: the server saw {reqs:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
