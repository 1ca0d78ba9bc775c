//! Hostile frontends against the real `vblk serve` (black box, issue 7 item 9).
//!
//! One daemon serves a raw image. Each *class* of broken vhost-user session runs on a fresh
//! connection, spoken byte by byte ([`support::raw_frontend`]); afterwards the daemon must
//! still be the same live process and a well-behaved frontend (our driver) must attach and
//! read back what it wrote, on every queue. All classes run, a daemon that died or hung is
//! restarted (and that is recorded), and the test fails once, with a table of every class
//! that failed and why. `VBLK_HOSTILE_ONLY=a,b` runs the classes whose names contain `a` or
//! `b`.
//!
//! Expected outcomes:
//! - **refused**: the bad message gets a NACK (REPLY_ACK negotiated, NEED_REPLY set: a u64
//!   reply != 0), an error reply (GET_CONFIG: no payload), or the connection is closed.
//!   It is never acknowledged with 0, and never left unanswered (every read is bounded).
//! - **survives**: the protocol allows more than one answer (or none: a ring's content is
//!   not answered on the socket), so any is fine, but every message is answered or the
//!   connection closed within 5 s, and stopping the ring (GET_VRING_BASE) is answered too.
//!
//! Either way the daemon stays alive and serves the next frontend. The daemon serves a
//! second disk on the same worker thread (`--threads 1`), whose frontend (our driver) does
//! verified writes and reads all along: every class must leave it served, and a class
//! that lasts a second or more must not stop it for that long.
//!
//! The classes (the tables in `hostile/*.rs` say exactly what each one sends):
//! - session: unknown request code, code 0, wrong version bits, REPLY flag on a request,
//!   payload too short / too long, size above 0x1000, size u32::MAX (refused); size
//!   larger than the payload then close, truncated header then close (survives);
//!   SET_OWNER twice; SET_FEATURES with an unknown bit / a bit not offered;
//!   SET_PROTOCOL_FEATURES with an unknown bit / a bit not offered; SET_VRING_ENABLE
//!   before SET_FEATURES; GET_CONFIG without CONFIG; GET_CONFIG of 4084 bytes / with an
//!   overflowing offset / whose size disagrees with the message; SET_CONFIG of
//!   the read-only capacity / past the config space; SET_LOG_BASE, SET_LOG_FD,
//!   GET_INFLIGHT_FD, SET_INFLIGHT_FD not negotiated (refused); GET_QUEUE_NUM without MQ
//!   (survives: the spec allows it when MQ is offered). Half a header and then silence
//!   with the connection open; requests whose replies are never read until the socket is
//!   full both ways (refused: the daemon closes the connection after its 5 s deadline).
//! - memory: SET_MEM_TABLE with 0 regions, overlapping regions, a zero-size or 2^62-byte
//!   region, an unaligned mmap offset, an overflowing offset or address, a count that
//!   disagrees with the payload, more or fewer fds than regions, no fd, a pipe or a socket
//!   for an fd, a region reaching past the end of its memfd, a region larger than its
//!   memfd; ADD_MEM_REG overlapping, duplicated, beyond GET_MAX_MEM_SLOTS, without fd,
//!   with two fds, of size 0, past the end of its memfd; REM_MEM_REG of an unknown region
//!   (refused); a region whose fd is a file on a disk file system, not tmpfs (refused).
//!   A memfd shrunk under a running ring (SET_MEM_TABLE and ADD_MEM_REG; the
//!   daemon may instead refuse memfds not sealed against shrinking), the memory table
//!   replaced or the region removed under a running ring (survives).
//! - vrings: SET_VRING_NUM 0, 3, 512 (above --queue-size 256), 65536, on queue 2 of 2;
//!   rings outside memory, misaligned, straddling the region's end, before SET_MEM_TABLE
//!   (the ring must not start); SET_VRING_ADDR / SET_VRING_BASE / SET_VRING_KICK /
//!   SET_VRING_CALL / SET_VRING_ERR / SET_VRING_ENABLE / GET_VRING_BASE on queue 2;
//!   SET_VRING_BASE above 16 bits; kick or call without an fd and without the no-fd flag,
//!   with an fd and the flag; SET_VRING_ENABLE 2 (refused). A kick with the no-fd flag, a
//!   kick fd that is a regular file, GET_VRING_BASE on a queue never started (survives).
//! - rings (a started ring with hostile content; survives): avail index far ahead, head
//!   out of range, descriptor loop, data outside memory or 4 GiB long (must not complete
//!   OK), kicks on a queue never set up, a saturated call eventfd, a call pipe that is
//!   full, a kick pipe kept full (also while the next frontend runs), a kick pipe whose
//!   writer is gone (EOF for ever), a full kick pipe and a close, a disconnect with
//!   requests in flight, RESET_OWNER with requests in flight. Descriptors the frontend
//!   shares with the device and turns against it after setup (O_NONBLOCK lives in the
//!   shared open file description): a call eventfd made blocking and saturated, a call
//!   pipe filled and made blocking, a call socket nobody reads, an error eventfd made
//!   blocking and saturated before a broken ring signals it, a kick pipe made blocking
//!   whose kicks the frontend takes back at once (the device must never block on any).
//!
//! A second test counts the daemon's open file descriptors around 240 connections
//! (handshakes, rings with I/O through SET_MEM_TABLE and ADD_MEM_REG, refused messages
//! carrying fds): growth must stay within 4.

mod support;

mod hostile {
    pub mod memory;
    pub mod migration;
    pub mod rings;
    pub mod session;
    pub mod vrings;
}

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions};
use hostile::session::{cycle, Ctx};
use support::util::{die_with_parent, stamp, temp_dir};

/// The image served.
const IMAGE_BYTES: u64 = 64 << 20;
/// `--num-queues`.
pub const NUM_QUEUES: u32 = 2;
/// `--queue-size`: the largest ring the daemon accepts.
pub const MAX_QUEUE_SIZE: u32 = 256;
/// The most one class may take.
const CLASS_LIMIT: Duration = Duration::from_secs(60);
/// The most the well-behaved frontend may take to attach, and then for its I/O.
const SERVE_LIMIT: Duration = Duration::from_secs(10);

/// The socket of the second disk of the daemon, served by the same worker thread as the
/// disk the hostile frontends get.
const BYSTANDER: &str = "bystander.sock";

/// A frontend of the bystander disk doing verified 4 KiB writes and reads in a loop until
/// told to stop: the rounds it completed, and the first error it met (it then attaches
/// again, as after a daemon restart).
struct Bystander {
    rounds: std::sync::Arc<std::sync::atomic::AtomicU64>,
    error: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Bystander {
    fn start(sock: PathBuf) -> Bystander {
        use std::sync::atomic::Ordering;
        let rounds = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let error = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, e, st) = (rounds.clone(), error.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !st.load(Ordering::Relaxed) {
                let mut run = || -> Result<(), String> {
                    let disk = Disk::attach(&sock, &DiskOptions::default())
                        .map_err(|x| format!("attach: {x}"))?;
                    let mut q = disk.take_queue(0).ok_or("no queue 0")?;
                    let (mut data, mut back) = (vec![0u8; 4096], vec![0u8; 4096]);
                    while !st.load(Ordering::Relaxed) {
                        let lba = n % 4096 * 8;
                        stamp(&mut data, n as u32, lba);
                        q.write_at(lba * 512, &data)
                            .map_err(|x| format!("write: {x}"))?;
                        q.read_at(lba * 512, &mut back)
                            .map_err(|x| format!("read: {x}"))?;
                        if back != data {
                            return Err(format!("sector {lba} does not read back as written"));
                        }
                        n += 1;
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                };
                if let Err(x) = run() {
                    e.lock().unwrap().get_or_insert(x);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        Bystander {
            rounds,
            error,
            stop,
            thread: Some(thread),
        }
    }

    fn rounds(&self) -> u64 {
        self.rounds.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn take_error(&self) -> Option<String> {
        self.error.lock().unwrap().take()
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the daemon must do with a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The bad message is refused: NACK, error reply or close.
    Refused,
    /// Any answer, but in time, and the daemon lives and serves the next frontend.
    Survives,
}

/// One class of broken session.
pub struct Class {
    pub name: &'static str,
    pub expect: Expect,
    /// What the frontend does.
    pub what: &'static str,
    /// Runs the session; Err says how the daemon misbehaved.
    pub run: fn(&mut Ctx) -> Result<(), String>,
}

/// `vblk serve` as a child, killed on every way out of the test.
struct Serve {
    child: Child,
    dir: PathBuf,
    image: PathBuf,
    sock: PathBuf,
    log: PathBuf,
    generation: u32,
}

impl Serve {
    fn start(dir: &Path, image: &Path, generation: u32) -> Serve {
        let sock = dir.join("vblk.sock");
        let log = dir.join(format!("serve-{generation}.log"));
        // The socket path appearing is the sign the daemon listens (a killed one leaves
        // its file behind, so remove it first).
        let _ = fs::remove_file(&sock);
        let out = fs::File::create(&log).unwrap();
        let bystander = dir.join(BYSTANDER);
        let _ = fs::remove_file(&bystander);
        // Two disks on one worker thread: the hostile frontends get the first; the second,
        // a RAM disk, is the bystander that must be served all along.
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
        cmd.args(["--log-level", "info", "serve", "--threads", "1"])
            .args(["--num-queues", &NUM_QUEUES.to_string()])
            .args(["--queue-size", &MAX_QUEUE_SIZE.to_string()])
            .arg("--disk")
            .arg(format!(
                "socket={},file={}",
                sock.display(),
                image.display()
            ))
            .arg("--disk")
            .arg(format!(
                "socket={},file=mem:16M,num-queues=1",
                bystander.display()
            ))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        die_with_parent(&mut cmd);
        let mut s = Serve {
            child: cmd.spawn().expect("cannot start vblk serve"),
            dir: dir.to_path_buf(),
            image: image.to_path_buf(),
            sock,
            log,
            generation,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !s.sock.exists() || !s.dir.join(BYSTANDER).exists() {
            if let Some(st) = s.exited() {
                panic!("vblk serve {}:\n{}", describe(st), s.log_tail(0, 50));
            }
            assert!(
                Instant::now() < deadline,
                "vblk serve made no socket in 30 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Kill (if need be) and start a new daemon on the same socket.
    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let (dir, image) = (self.dir.clone(), self.image.clone());
        *self = Serve::start(&dir, &image, self.generation + 1);
    }

    fn log_len(&self) -> usize {
        fs::read(&self.log).map(|b| b.len()).unwrap_or(0)
    }

    /// The last `n` lines the daemon logged after byte `from`.
    fn log_tail(&self, from: usize, n: usize) -> String {
        let b = fs::read(&self.log).unwrap_or_default();
        let text = String::from_utf8_lossy(b.get(from..).unwrap_or_default()).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn describe(st: ExitStatus) -> String {
    match st.signal() {
        Some(libc::SIGBUS) => "killed by SIGBUS".into(),
        Some(libc::SIGSEGV) => "killed by SIGSEGV".into(),
        Some(libc::SIGABRT) => "killed by SIGABRT".into(),
        Some(s) => format!("killed by signal {s}"),
        None => format!("exited with {st}"),
    }
}

/// Run `f` on its own thread for at most `limit`. A thread that overruns is left behind
/// (every read it makes is bounded, and the daemon it talks to is killed).
pub fn bounded<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(p)) => Err(format!(
            "panicked: {}",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("?")
        )),
        Err(_) => Err(format!("did not finish within {limit:?}")),
    }
}

/// A well-behaved frontend: our driver attaches, checks the capacity, and on every queue
/// writes stamped sectors (write id `round`) and reads them back.
fn serve_check(sock: &Path, round: u32) -> Result<(), String> {
    let sock = sock.to_path_buf();
    bounded(SERVE_LIMIT * 2, move || {
        let opts = DiskOptions {
            pool_size: 1 << 20,
            attach_timeout: SERVE_LIMIT,
            ..Default::default()
        };
        let disk = Disk::attach(&sock, &opts).map_err(|e| format!("attach: {e}"))?;
        if disk.info().capacity_bytes != IMAGE_BYTES {
            return Err(format!(
                "capacity {} bytes, the image has {IMAGE_BYTES}",
                disk.info().capacity_bytes
            ));
        }
        for mut q in disk.take_queues() {
            let lba = (u64::from(round) * 16 + u64::from(q.index()) * 8) % (IMAGE_BYTES / 512 - 8);
            let mut data = vec![0u8; 4096];
            stamp(&mut data, round, lba);
            let i = q.index();
            q.write_at(lba * 512, &data)
                .map_err(|e| format!("queue {i}: write: {e}"))?;
            let mut back = vec![0u8; 4096];
            q.read_at(lba * 512, &mut back)
                .map_err(|e| format!("queue {i}: read: {e}"))?;
            if back != data {
                return Err(format!(
                    "queue {i}: sector {lba} does not read back as written"
                ));
            }
        }
        Ok(())
    })?
}

fn make_image(dir: &Path) -> PathBuf {
    let image = dir.join("disk.img");
    fs::File::create(&image)
        .unwrap()
        .set_len(IMAGE_BYTES)
        .unwrap();
    image
}

fn all_classes() -> Vec<Class> {
    let mut v = hostile::session::classes();
    v.extend(hostile::memory::classes());
    v.extend(hostile::vrings::classes());
    v.extend(hostile::rings::classes());
    v.extend(hostile::migration::classes());
    v
}

#[test]
fn hostile_frontends_are_refused_and_the_next_frontend_is_served() {
    let classes = all_classes();
    assert!(classes.len() >= 95, "only {} classes", classes.len());
    let mut names: Vec<&str> = classes.iter().map(|c| c.name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), classes.len(), "class names are unique");
    let only = std::env::var("VBLK_HOSTILE_ONLY").unwrap_or_default();
    let filters: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
    let selected: Vec<&Class> = classes
        .iter()
        .filter(|c| filters.is_empty() || filters.iter().any(|f| c.name.contains(f)))
        .collect();
    assert!(
        !selected.is_empty(),
        "VBLK_HOSTILE_ONLY={only:?} matches no class; the classes are: {}",
        names.join(" ")
    );

    let dir = temp_dir("hostile");
    let image = make_image(dir.path());
    let mut serve = Serve::start(dir.path(), &image, 0);
    if let Err(e) = serve_check(&serve.sock, 0) {
        panic!(
            "a fresh daemon does not serve our driver: {e}\n{}",
            serve.log_tail(0, 40)
        );
    }
    let bystander = Bystander::start(dir.path().join(BYSTANDER));
    let started = Instant::now();
    let mut failures: Vec<(&Class, String, String)> = Vec::new();
    for (n, class) in selected.iter().enumerate() {
        let t = Instant::now();
        let log_at = serve.log_len();
        let mut why = Vec::new();
        let before = bystander.rounds();
        let sock = serve.sock.clone();
        let run = class.run;
        let keep = match bounded(CLASS_LIMIT, move || {
            let mut cx = Ctx::new(sock);
            let r = run(&mut cx);
            (r, cx.keep)
        }) {
            Ok((r, keep)) => {
                why.extend(r.err());
                keep
            }
            Err(e) => {
                why.push(format!("the class {e}"));
                Vec::new()
            }
        };
        let mut restart = false;
        if let Some(st) = serve.exited() {
            why.push(format!("the daemon died: {}", describe(st)));
            restart = true;
        } else if let Err(e) = serve_check(&serve.sock, n as u32 + 1) {
            match serve.exited() {
                Some(st) => why.push(format!("the daemon died: {}", describe(st))),
                None => why.push(format!("the next frontend was not served: {e}")),
            }
            restart = true;
        }
        // The other disk on the worker thread was served while the class ran (a class
        // that lasts a second and more is a frontend holding something: a full pipe, a
        // socket nobody reads, half a message).
        if let Some(e) = bystander.take_error() {
            why.push(format!("the other disk's frontend failed: {e}"));
        } else if t.elapsed() > Duration::from_secs(1) && bystander.rounds() == before {
            why.push(format!(
                "the other disk on the same worker thread was not served for the {:.1?} the class ran",
                t.elapsed()
            ));
        }
        // Whatever the class left running (a writer keeping a pipe full) stops only now.
        drop(keep);
        if !restart {
            if let Some(st) = serve.exited() {
                why.push(format!(
                    "the daemon died after the next frontend: {}",
                    describe(st)
                ));
                restart = true;
            }
        }
        let ok = why.is_empty();
        eprintln!(
            "{:<44} {:<8} {} ({:.1?})",
            class.name,
            format!("{:?}", class.expect).to_lowercase(),
            if ok { "ok" } else { "FAILED" },
            t.elapsed()
        );
        if !ok {
            let log = serve.log_tail(log_at, 3);
            if restart {
                why.push(format!(
                    "restarted (daemon generation {})",
                    serve.generation + 1
                ));
                serve.restart();
            }
            failures.push((class, why.join("; "), log));
        }
    }
    let end = serve_check(&serve.sock, u32::MAX / 2);
    let bystander_rounds = bystander.rounds();
    drop(bystander);
    eprintln!(
        "the other disk's frontend did {bystander_rounds} verified writes and reads meanwhile"
    );
    eprintln!(
        "{} classes in {:.1?}, {} failed",
        selected.len(),
        started.elapsed(),
        failures.len()
    );
    let mut report = String::new();
    for (c, why, log) in &failures {
        report += &format!(
            "\n- {} [{}: {}]\n    {why}",
            c.name,
            format!("{:?}", c.expect).to_lowercase(),
            c.what
        );
        for l in log.lines() {
            report += &format!("\n    | {l}");
        }
    }
    assert!(
        failures.is_empty() && end.is_ok(),
        "{} of {} hostile classes failed (daemon log lines of the class under `|`):{report}{}",
        failures.len(),
        selected.len(),
        end.err()
            .map(|e| format!("\nand at the end the daemon does not serve: {e}"))
            .unwrap_or_default()
    );
}

// ---- file descriptors ----

/// The daemon's open fds, by kind (`socket`, `anon_inode:[eventfd]`, `memfd:...`).
fn fds(pid: u32) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for e in fs::read_dir(format!("/proc/{pid}/fd")).expect("/proc/PID/fd") {
        let Ok(target) = fs::read_link(e.unwrap().path()) else {
            continue;
        };
        let t = target.display().to_string();
        let kind = match t.split_once(":[") {
            Some((k, _)) if !k.starts_with("anon_inode") => k.to_string(),
            _ => t.trim_start_matches('/').replace(" (deleted)", ""),
        };
        *m.entry(kind).or_default() += 1;
    }
    m
}

fn total(m: &BTreeMap<String, usize>) -> usize {
    m.values().sum()
}

#[test]
fn two_hundred_connections_leak_no_file_descriptors() {
    const CYCLES: u32 = 240;
    const SLACK: usize = 4;
    let dir = temp_dir("hostile-fds");
    let image = make_image(dir.path());
    let mut serve = Serve::start(dir.path(), &image, 0);
    serve_check(&serve.sock, 0).expect("a fresh daemon serves our driver");
    std::thread::sleep(Duration::from_millis(300));
    let before = fds(serve.pid());
    let t = Instant::now();
    for i in 0..CYCLES {
        let sock = serve.sock.clone();
        let r = bounded(CLASS_LIMIT, move || cycle(&sock, i)).and_then(|r| r);
        if let Err(e) = r {
            let now = fds(serve.pid());
            panic!(
                "connection {i}: {e}\n(the daemon holds {} fds, {} before the first; {})\n{}",
                total(&now),
                total(&before),
                serve.exited().map(describe).unwrap_or("running".into()),
                serve.log_tail(0, 10)
            );
        }
        if i % 60 == 59 {
            serve_check(&serve.sock, i + 1)
                .unwrap_or_else(|e| panic!("after {} connections: {e}", i + 1));
        }
    }
    serve_check(&serve.sock, CYCLES + 1).expect("the daemon serves after the cycles");
    // The last frontend's teardown may still be under way: give it a moment.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut after = fds(serve.pid());
    while total(&after) > total(&before) + SLACK && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        after = fds(serve.pid());
    }
    eprintln!(
        "{CYCLES} connections in {:.1?}: {} fds before, {} after",
        t.elapsed(),
        total(&before),
        total(&after)
    );
    let grown: Vec<String> = after
        .iter()
        .filter_map(|(k, &n)| {
            let b = before.get(k).copied().unwrap_or(0);
            (n > b).then(|| format!("{k} +{}", n - b))
        })
        .collect();
    assert!(
        total(&after) <= total(&before) + SLACK,
        "after {CYCLES} connections the daemon holds {} fds, {} before (more than {SLACK} \
         more): {}",
        total(&after),
        total(&before),
        grown.join(", ")
    );
    assert!(serve.exited().is_none());
}
