//! The NBD client against real servers from Debian: nbdkit (memory and file plugins, and
//! its delay, blocksize-policy and multi-conn filters) and qemu-nbd, over Unix sockets and
//! TCP on localhost. Every test drives the engine as a device worker does (many requests
//! in flight, replies matched by cookie) and checks the bytes against a model.
//!
//! Failures: a server killed (SIGKILL) and restarted mid-write, then a verify of every
//! write; a silent server (SIGSTOP) found by the timeout; a server that never comes back
//! failing requests with EIO after the reconnect limit.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{read, scratch, write, Buf, Rng};
use vblk_storage::nbd::NbdOptions;
use vblk_storage::{Backend, BackendKind, DiskSpec, Engine, EngineKind, Op, OpenOptions};

const MIB: usize = 1 << 20;
const BLOCK: usize = 4096;

// ---- servers ----

/// Where `name` is installed, or a failure that names the Debian package.
fn program(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/usr/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is not installed: these tests need it as a real NBD server. Install \
                 the Debian package {package} (`apt-get install {package}`; scripts/test does this)"
            )
        })
}

/// An NBD server run as a child; killed and reaped on every way out of the test.
struct Server {
    child: Option<Child>,
    cmd: Vec<String>,
    sock: Option<PathBuf>,
    port: Option<u16>,
    /// Written by the server once it listens.
    pidfile: PathBuf,
}

impl Server {
    /// `nbdkit -f ARGS` on a Unix socket in `dir`.
    fn nbdkit(dir: &Path, args: &[&str]) -> Server {
        let sock = dir.join("nbdkit.sock");
        let pidfile = dir.join("nbdkit.pid");
        let mut cmd = vec![
            program("nbdkit", "nbdkit").display().to_string(),
            "-f".into(),
            "-P".into(),
            pidfile.display().to_string(),
            "-U".into(),
            sock.display().to_string(),
        ];
        cmd.extend(args.iter().map(|s| s.to_string()));
        Server::start(cmd, Some(sock), None, pidfile)
    }

    /// `nbdkit -f ARGS` on TCP, 127.0.0.1 and a free port.
    fn nbdkit_tcp(dir: &Path, args: &[&str]) -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pidfile = dir.join("nbdkit-tcp.pid");
        let mut cmd = vec![
            program("nbdkit", "nbdkit").display().to_string(),
            "-f".into(),
            "-P".into(),
            pidfile.display().to_string(),
            "-i".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ];
        cmd.extend(args.iter().map(|s| s.to_string()));
        Server::start(cmd, None, Some(port), pidfile)
    }

    /// `qemu-nbd -t -e 8 -f raw -k SOCK ARGS IMAGE`.
    fn qemu_nbd(dir: &Path, args: &[&str], image: &Path) -> Server {
        let sock = dir.join("qemu-nbd.sock");
        let pidfile = dir.join("qemu-nbd.pid");
        let mut cmd = vec![
            program("qemu-nbd", "qemu-utils").display().to_string(),
            "--pid-file".into(),
            pidfile.display().to_string(),
            "-t".into(),
            "-e".into(),
            "8".into(),
            "-f".into(),
            "raw".into(),
            "-k".into(),
            sock.display().to_string(),
        ];
        cmd.extend(args.iter().map(|s| s.to_string()));
        cmd.push(image.display().to_string());
        Server::start(cmd, Some(sock), None, pidfile)
    }

    fn start(
        cmd: Vec<String>,
        sock: Option<PathBuf>,
        port: Option<u16>,
        pidfile: PathBuf,
    ) -> Server {
        let mut s = Server {
            child: None,
            cmd,
            sock,
            port,
            pidfile,
        };
        s.restart();
        s
    }

    /// Starts the server (again) and waits until it accepts connections.
    fn restart(&mut self) {
        if let Some(sock) = &self.sock {
            let _ = std::fs::remove_file(sock);
        }
        let _ = std::fs::remove_file(&self.pidfile);
        let child = Command::new(&self.cmd[0])
            .args(&self.cmd[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.cmd[0]));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::fs::metadata(&self.pidfile).is_ok_and(|m| m.len() > 0) {
                return;
            }
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("{} exited with {st} before listening", self.cmd.join(" "));
            }
            assert!(Instant::now() < deadline, "{} never listened", self.cmd[0]);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn uri(&self, export: &str) -> String {
        match (&self.sock, self.port) {
            (Some(s), _) => format!("nbd+unix:///{export}?socket={}", s.display()),
            (None, Some(p)) => format!("nbd://127.0.0.1:{p}/{export}"),
            _ => unreachable!(),
        }
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: a signal to our own child, which has not been reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// SIGSTOP, and wait until every thread of the server is stopped: the signal is
    /// delivered asynchronously, and a thread still running could answer one more request.
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let Some(c) = &self.child else { return };
        let deadline = Instant::now() + Duration::from_secs(5);
        let stopped = || {
            std::fs::read_dir(format!("/proc/{}/task", c.id()))
                .unwrap()
                .filter_map(Result::ok)
                .all(|t| {
                    let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    // The state follows the command name's closing parenthesis.
                    stat.rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
                })
        };
        while !stopped() {
            assert!(
                Instant::now() < deadline,
                "the server did not stop within 5 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill();
    }
}

fn opts(read_only: bool, timeout: u64, reconnect: u64) -> OpenOptions {
    // RUST_LOG=info shows connections lost, reconnections and replays.
    let _ = env_logger::builder().is_test(true).try_init();
    OpenOptions {
        read_only,
        nbd: NbdOptions {
            timeout: Duration::from_secs(timeout),
            reconnect: Duration::from_secs(reconnect),
            conns: 1,
        },
        ..Default::default()
    }
}

fn open_with(uri: &str, o: &OpenOptions) -> Result<Arc<Backend>, String> {
    let spec: DiskSpec = uri.parse().map_err(|e| format!("{e}"))?;
    Backend::open(&spec, o)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

fn open(uri: &str) -> Arc<Backend> {
    open_with(uri, &opts(false, 30, 30)).unwrap()
}

fn engine(b: &Arc<Backend>, depth: u32) -> Box<dyn Engine> {
    b.engine(EngineKind::IoUring, depth).unwrap()
}

// ---- a verified random workload ----

/// One operation in flight, with the buffers it lends.
struct Pending {
    op: Kind,
    offset: usize,
    len: usize,
    bufs: Vec<Buf>,
    _iov: Vec<libc::iovec>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Read,
    Write,
    Flush,
    Zeroes,
    Trim,
}

/// Runs `count` random operations with up to `depth` in flight over the first `span` bytes,
/// keeping `model` (and `known`: bytes not trimmed) in step and checking every read.
/// `hook(completed)` runs after each batch of completions. `mix`: include trims.
/// What the disk should hold: bytes, and which of them are known (not trimmed).
struct Model {
    data: Vec<u8>,
    known: Vec<bool>,
}

#[allow(clippy::needless_range_loop)] // tokens index the slots they name
fn workload(
    e: &mut dyn Engine,
    m: &mut Model,
    depth: usize,
    count: usize,
    seed: u64,
    writes_only: bool,
    hook: &mut dyn FnMut(usize),
) {
    let mut rng = Rng::new(seed);
    let (model, known) = (&mut m.data, &mut m.known);
    let blocks = model.len() / BLOCK;
    let mut busy = vec![false; blocks];
    let mut slots: Vec<Option<Pending>> = (0..depth).map(|_| None).collect();
    let (mut issued, mut completed) = (0usize, 0usize);
    while completed < count {
        let mut pushed = false;
        for token in 0..depth {
            if issued == count || slots[token].is_some() {
                continue;
            }
            let nblocks = 1 + rng.below(8) as usize;
            let first = rng.below((blocks - nblocks) as u64) as usize;
            if busy[first..first + nblocks].iter().any(|&b| b) {
                continue;
            }
            let r = rng.below(100);
            let kind = match r {
                _ if writes_only => Kind::Write,
                0..=44 => Kind::Write,
                45..=84 => Kind::Read,
                85..=89 => Kind::Flush,
                90..=94 => Kind::Zeroes,
                _ => Kind::Trim,
            };
            let (offset, len) = (first * BLOCK, nblocks * BLOCK);
            let mut bufs = Vec::new();
            let lens = common::split(&mut rng, len / 512, 3);
            let mut at = offset;
            for l in lens {
                let mut b = Buf::new(l * 512, 0);
                if kind == Kind::Write {
                    rng.fill(b.as_mut_slice());
                    model[at..at + l * 512].copy_from_slice(b.as_slice());
                }
                at += l * 512;
                bufs.push(b);
            }
            let iov: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
            let op = match kind {
                Kind::Read => Op::Read {
                    offset: offset as u64,
                    iov: iov.as_ptr(),
                    iovcnt: iov.len() as u32,
                },
                Kind::Write => Op::Write {
                    offset: offset as u64,
                    iov: iov.as_ptr(),
                    iovcnt: iov.len() as u32,
                    durable: rng.below(10) == 0,
                },
                Kind::Flush => Op::Flush,
                Kind::Zeroes => Op::WriteZeroes {
                    offset: offset as u64,
                    len: len as u64,
                    unmap: rng.below(2) == 0,
                    durable: false,
                },
                Kind::Trim => Op::Discard {
                    offset: offset as u64,
                    len: len as u64,
                    durable: false,
                },
            };
            match kind {
                Kind::Write => known[offset..offset + len].fill(true),
                Kind::Zeroes => {
                    model[offset..offset + len].fill(0);
                    known[offset..offset + len].fill(true);
                }
                Kind::Trim => known[offset..offset + len].fill(false),
                _ => {}
            }
            busy[first..first + nblocks].fill(true);
            // SAFETY: the buffers and iovecs live in `slots` until the completion is reaped.
            unsafe { e.push(token as u64, op) }.expect("engine full");
            slots[token] = Some(Pending {
                op: kind,
                offset,
                len,
                bufs,
                _iov: iov,
            });
            issued += 1;
            pushed = true;
        }
        if pushed {
            e.submit().unwrap();
        }
        let mut done = Vec::new();
        e.reap(&mut |c| done.push(c));
        if done.is_empty() {
            e.wait().unwrap();
            continue;
        }
        for c in done {
            let p = slots[c.token as usize]
                .take()
                .expect("completion for an idle token");
            let n = c
                .result
                .unwrap_or_else(|err| panic!("{:?} at {} + {}: {err}", p.op, p.offset, p.len));
            if matches!(p.op, Kind::Read | Kind::Write) {
                assert_eq!(n, p.len as u64);
            }
            if p.op == Kind::Read {
                let got: Vec<u8> = p.bufs.iter().flat_map(|b| b.as_slice().to_vec()).collect();
                for i in 0..p.len {
                    let at = p.offset + i;
                    if known[at] && got[i] != model[at] {
                        panic!(
                            "read at {}: byte {at} is {:#x}, expected {:#x}",
                            p.offset, got[i], model[at]
                        );
                    }
                }
            }
            busy[p.offset / BLOCK..(p.offset + p.len) / BLOCK].fill(false);
            completed += 1;
        }
        hook(completed);
    }
    assert_eq!(e.in_flight(), 0);
}

/// Reads the model's span back in 1 MiB pieces and compares.
fn verify(e: &mut dyn Engine, m: &Model) {
    let span = m.data.len();
    for at in (0..span).step_by(MIB) {
        let n = MIB.min(span - at);
        let got = read(e, at as u64, &[n], 0).unwrap();
        for (i, &g) in got.iter().enumerate() {
            if m.known[at + i] && g != m.data[at + i] {
                panic!("byte {} is {g:#x}, expected {:#x}", at + i, m.data[at + i]);
            }
        }
    }
}

/// The full check on an opened export: random I/O at depth 32 with trims, then a verify.
fn exercise(b: &Arc<Backend>, initial: Option<&[u8]>, seed: u64) -> Vec<u8> {
    let span = 16 * MIB;
    let mut m = Model {
        data: initial.map_or_else(|| vec![0u8; span], |d| d[..span].to_vec()),
        known: vec![true; span],
    };
    let mut e = engine(b, 64);
    workload(&mut *e, &mut m, 32, 3000, seed, false, &mut |_| {});
    verify(&mut *e, &m);
    // A large write and read: pieces of at most the server's largest payload.
    let big: Vec<u8> = (0..40 * MIB).map(|i| (i * 7 + 3) as u8).collect();
    write(&mut *e, 0, &big, &[13 * MIB, 27 * MIB], 0, false).unwrap();
    assert_eq!(read(&mut *e, 0, &[40 * MIB], 0).unwrap(), big);
    big[..span].to_vec()
}

// ---- tests ----

#[test]
fn nbdkit_memory_over_unix_and_tcp() {
    let dir = scratch();
    let s = Server::nbdkit(dir.path(), &["memory", "64M"]);
    let b = open(&s.uri(""));
    assert_eq!(b.kind(), BackendKind::Nbd);
    assert_eq!(b.size(), 64 << 20);
    assert_eq!(b.logical_block_size(), 512);
    assert!(b.supports_discard());
    exercise(&b, None, 1);

    let t = Server::nbdkit_tcp(dir.path(), &["memory", "64M"]);
    let b = open(&t.uri(""));
    exercise(&b, None, 2);
}

#[test]
fn nbdkit_file_plugin_writes_reach_the_file() {
    let dir = scratch();
    let img = common::make_file(dir.path(), "disk.img", 48 * MIB, 3);
    let initial = std::fs::read(&img).unwrap();
    let s = Server::nbdkit(dir.path(), &["file", &img.display().to_string()]);
    let b = open(&s.uri(""));
    let model = exercise(&b, Some(&initial), 4);
    let mut e = engine(&b, 4);
    // SAFETY: a flush lends no buffer.
    unsafe { common::run1(&mut *e, Op::Flush) }.unwrap();
    let file = std::fs::read(&img).unwrap();
    assert!(
        file[..16 * MIB] == model[..16 * MIB],
        "the file differs from the model"
    );
    assert!(
        file[40 * MIB..] == initial[40 * MIB..],
        "bytes past the writes changed"
    );
}

#[test]
fn qemu_nbd_read_write_read_only_and_discard() {
    let dir = scratch();
    let img = common::make_file(dir.path(), "q.img", 48 * MIB, 5);
    let initial = std::fs::read(&img).unwrap();
    {
        let s = Server::qemu_nbd(dir.path(), &["--discard=unmap", "-x", "disk"], &img);
        let e = open_with(&s.uri("nope"), &opts(false, 30, 30)).unwrap_err();
        assert!(
            e.contains("server offers no export named 'nope' (exports: disk)"),
            "{e}"
        );
        let b = open(&s.uri("disk"));
        assert_eq!(b.size(), 48 << 20);
        assert_eq!(b.default_serial(), "disk");
        exercise(&b, Some(&initial), 6);
    }
    let s = Server::qemu_nbd(dir.path(), &["--read-only"], &img);
    let e = open_with(&s.uri(""), &opts(false, 30, 30)).unwrap_err();
    assert!(e.contains("the export is read-only"), "{e}");
    assert!(e.contains("--read-only"), "{e}");
    let b = open_with(&s.uri(""), &opts(true, 30, 30)).unwrap();
    assert!(b.read_only() && !b.supports_discard());
    let now = std::fs::read(&img).unwrap();
    // Read-only exports allow an engine per worker.
    let mut e = engine(&b, 8);
    let _e2 = engine(&b, 8);
    assert_eq!(
        read(&mut *e, 4096, &[8192], 0).unwrap(),
        now[4096..4096 + 8192]
    );
    let err = write(&mut *e, 0, &[1u8; 4096], &[4096], 0, false).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    // SAFETY: write-zeroes lends no buffer.
    let err = unsafe {
        common::run1(
            &mut *e,
            Op::WriteZeroes {
                offset: 0,
                len: 4096,
                unmap: false,
                durable: false,
            },
        )
    }
    .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
}

#[test]
fn block_size_constraints() {
    let dir = scratch();
    let s = Server::nbdkit(
        dir.path(),
        &[
            "--filter=blocksize-policy",
            "memory",
            "64M",
            "blocksize-minimum=4096",
            "blocksize-preferred=4096",
            "blocksize-maximum=65536",
            "blocksize-error-policy=error",
        ],
    );
    let b = open(&s.uri(""));
    assert_eq!(b.logical_block_size(), 4096);
    let mut e = engine(&b, 64);
    let err = read(&mut *e, 512, &[512], 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    // 1 MiB + 4 KiB: 17 pieces of at most 64 KiB each way.
    let data: Vec<u8> = (0..MIB + 4096).map(|i| (i % 251) as u8).collect();
    write(
        &mut *e,
        8192,
        &data,
        &[300_000 - 300_000 % 512, MIB + 4096 - 299_520],
        0,
        true,
    )
    .unwrap();
    assert_eq!(read(&mut *e, 8192, &[MIB + 4096], 0).unwrap(), data);
    drop(e);
    let mut initial = vec![0u8; 16 * MIB];
    initial[8192..8192 + data.len()].copy_from_slice(&data);
    exercise(&b, Some(&initial), 7);
}

#[test]
fn replies_out_of_order_are_matched_by_cookie() {
    let dir = scratch();
    let s = Server::nbdkit(
        dir.path(),
        &["--filter=delay", "memory", "64M", "delay-read=600ms"],
    );
    let b = open(&s.uri(""));
    let mut e = engine(&b, 64);
    let pattern: Vec<u8> = (0..4096).map(|i| (i % 13) as u8).collect();
    write(&mut *e, 0, &pattern, &[4096], 0, false).unwrap();
    // A slow read first, then 16 fast writes: the writes are answered first.
    let mut rbuf = Buf::new(4096, 0);
    let riov = [rbuf.iovec()];
    let mut wbufs: Vec<Buf> = (0..16)
        .map(|i| Buf::with_data(&[i as u8; 4096], 0))
        .collect();
    let wiov: Vec<libc::iovec> = wbufs.iter_mut().map(Buf::iovec).collect();
    let start = Instant::now();
    // SAFETY: every buffer outlives the loop below, which reaps all 17 operations.
    unsafe {
        e.push(
            100,
            Op::Read {
                offset: 0,
                iov: riov.as_ptr(),
                iovcnt: 1,
            },
        )
        .unwrap();
        for (i, v) in wiov.iter().enumerate() {
            e.push(
                i as u64,
                Op::Write {
                    offset: ((i + 1) * 4096) as u64,
                    iov: v,
                    iovcnt: 1,
                    durable: false,
                },
            )
            .unwrap();
        }
    }
    e.submit().unwrap();
    let mut order = Vec::new();
    while order.len() < 17 {
        e.reap(&mut |c| {
            c.result.unwrap();
            order.push(c.token)
        });
        if order.len() < 17 {
            e.wait().unwrap();
        }
    }
    assert_eq!(*order.last().unwrap(), 100, "completion order {order:?}");
    assert!(start.elapsed() >= Duration::from_millis(500));
    assert_eq!(rbuf.as_slice(), &pattern[..]);
    for i in 0..16 {
        let got = read(&mut *e, ((i + 1) * 4096) as u64, &[4096], 0).unwrap();
        assert!(got.iter().all(|&x| x == i as u8));
    }
}

#[test]
fn one_writer_without_multi_conn() {
    let dir = scratch();
    let s = Server::nbdkit(
        dir.path(),
        &[
            "--filter=multi-conn",
            "memory",
            "64M",
            "multi-conn-mode=disable",
        ],
    );
    let b = open(&s.uri(""));
    let e1 = engine(&b, 8);
    let err = b.engine(EngineKind::IoUring, 8).err().unwrap().to_string();
    assert!(
        err.contains("does not offer multi-conn") && err.contains("--threads 1"),
        "{err}"
    );
    drop(e1);
    let _e3 = engine(&b, 8);

    // With multi-conn, an engine may open several connections.
    let m = Server::nbdkit_tcp(dir.path(), &["memory", "64M"]);
    let mut o = opts(false, 30, 30);
    o.nbd.conns = 4;
    let b = open_with(&m.uri(""), &o).unwrap();
    let _other = engine(&b, 8);
    exercise(&b, None, 8);
}

#[test]
fn server_killed_and_restarted_mid_write_loses_nothing() {
    let dir = scratch();
    let img = common::make_file(dir.path(), "k.img", 32 * MIB, 9);
    let data = std::fs::read(&img).unwrap();
    let mut m = Model {
        known: vec![true; data.len()],
        data,
    };
    let s = Server::nbdkit(dir.path(), &["file", &img.display().to_string()]);
    let b = open_with(&s.uri(""), &opts(false, 10, 8)).unwrap();
    // A thread of its own keeps the server (nbdkit exits when the thread that started it
    // ends): killed three times with writes in flight, it comes back 500 ms later while
    // the engine holds the writes and reconnects.
    let (tx, rx) = std::sync::mpsc::channel::<bool>();
    let keeper = std::thread::spawn(move || {
        let mut s = s;
        while let Ok(again) = rx.recv() {
            s.kill();
            if !again {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
            s.restart();
        }
    });
    let mut e = engine(&b, 64);
    let mut kills = 0;
    let mut hook = |completed: usize| {
        if kills < 3 && completed >= 1500 * (kills + 1) {
            tx.send(true).unwrap();
            kills += 1;
        }
    };
    workload(&mut *e, &mut m, 32, 6000, 10, true, &mut hook);
    assert_eq!(kills, 3);
    verify(&mut *e, &m);
    drop(e);
    tx.send(false).unwrap();
    keeper.join().unwrap();
    assert!(
        std::fs::read(&img).unwrap() == m.data,
        "the file differs from the model"
    );
}

#[test]
fn silent_server_is_found_by_the_timeout() {
    let dir = scratch();
    let s = Server::nbdkit(dir.path(), &["memory", "64M"]);
    let b = open_with(&s.uri(""), &opts(false, 1, 2)).unwrap();
    let mut e = engine(&b, 8);
    read(&mut *e, 0, &[4096], 0).unwrap();
    s.stop();
    let start = Instant::now();
    let err = read(&mut *e, 0, &[4096], 0).unwrap_err();
    let took = start.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert!(took >= Duration::from_secs(2), "failed after {took:?}");
    assert!(took < Duration::from_secs(20), "failed after {took:?}");
    s.signal(libc::SIGCONT);
    // The server answers again: the engine connects again for new work (it tries once a
    // second while the server is away, so a request may still fail at first).
    let back = Instant::now();
    loop {
        match read(&mut *e, 0, &[4096], 0) {
            Ok(_) => break,
            Err(err) if back.elapsed() < Duration::from_secs(15) => {
                assert_eq!(err.raw_os_error(), Some(libc::EIO));
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(err) => panic!("no recovery 15 s after SIGCONT: {err}"),
        }
    }
}

/// A server that is slow but alive: it holds the first write for 3 s, past the timeout,
/// then carries it out. Replaying the write on a new connection and going on let the late
/// write land over newer acknowledged ones (found by checking as a user). Now the write
/// fails with EIO, and so does every later write, write-zeroes and flush of the disk, on
/// every engine; reads go on.
#[test]
fn a_write_the_server_may_still_apply_fences_the_disks_writes() {
    let dir = scratch();
    let d = dir.path();
    let img = d.join("disk.img");
    std::fs::write(&img, vec![0u8; MIB]).unwrap();
    let script = d.join("slow.sh");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
F={img}
case "$1" in
  open) echo h ;;
  get_size) echo {MIB} ;;
  can_write|can_flush) exit 0 ;;
  can_trim|can_zero|can_multi_conn) exit 3 ;;
  can_fua) echo none ;;
  thread_model) echo parallel ;;
  pread) dd if=$F iflag=skip_bytes,count_bytes skip=$4 count=$3 bs=64k 2>/dev/null ;;
  pwrite)
    t=$(mktemp)
    cat > $t
    if [ ! -e $F.slowed ]; then touch $F.slowed; sleep 3; fi
    dd if=$t of=$F oflag=seek_bytes conv=notrunc seek=$4 bs=64k 2>/dev/null
    rm -f $t ;;
  flush) if [ ! -e $F.fslowed ]; then touch $F.fslowed; sleep 3; fi ;;
  *) exit 2 ;;
esac
"#,
            img = img.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let s = Server::nbdkit(d, &["sh", script.to_str().unwrap()]);
    let b = open_with(&s.uri(""), &opts(false, 1, 10)).unwrap();
    let mut e = engine(&b, 8);
    let eio = |r: std::io::Result<u64>, what: &str| {
        let err = r.map(|_| ()).expect_err(what);
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{what}: {err}");
    };
    // The write and a flush after it, both held by the server past the timeout: the
    // write fails; the flush, which a replay would have answered, fails too.
    let data = vec![0xaau8; BLOCK];
    let v = [libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: BLOCK,
    }];
    let w = Op::Write {
        offset: 0,
        iov: v.as_ptr(),
        iovcnt: 1,
        durable: false,
    };
    // SAFETY: `data` and `v` outlive both operations, which are reaped below.
    unsafe {
        e.push(1, w).unwrap();
        e.push(2, Op::Flush).unwrap();
    }
    e.submit().unwrap();
    let mut got = Vec::new();
    let t0 = Instant::now();
    while got.len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(30), "{got:?}");
        e.wait().unwrap();
        e.reap(&mut |c| got.push((c.token, c.result.map_err(|e| e.raw_os_error()))));
    }
    got.sort_unstable_by_key(|(t, _)| *t);
    assert_eq!(
        got,
        [(1, Err(Some(libc::EIO))), (2, Err(Some(libc::EIO)))],
        "the write the server held past the timeout, and the flush behind it"
    );
    eio(
        write(&mut *e, 0, &[0xbb; BLOCK], &[BLOCK], 0, false),
        "a later write",
    );
    // SAFETY: a flush lends no buffer.
    eio(unsafe { common::run1(&mut *e, Op::Flush) }, "a flush");
    let zeroes = Op::WriteZeroes {
        offset: 0,
        len: BLOCK as u64,
        unmap: false,
        durable: false,
    };
    // SAFETY: a write of zeroes lends no buffer.
    let zeroed = unsafe { common::run1(&mut *e, zeroes) };
    eio(zeroed, "a write of zeroes");
    read(&mut *e, 0, &[BLOCK], 0).expect("reads go on");
    // The disk's next engine (a new session) is fenced too (one writer: this server
    // offers no multi-conn).
    drop(e);
    let mut e = engine(&b, 8);
    eio(
        write(&mut *e, BLOCK as u64, &[0xcc; BLOCK], &[BLOCK], 0, false),
        "a write on the disk's next engine",
    );
    read(&mut *e, 0, &[BLOCK], 0).expect("reads go on");
}

#[test]
fn server_that_never_comes_back_fails_with_eio() {
    let dir = scratch();
    let mut s = Server::nbdkit(dir.path(), &["memory", "64M"]);
    let b = open_with(&s.uri(""), &opts(false, 5, 1)).unwrap();
    let mut e = engine(&b, 8);
    write(&mut *e, 0, &[7u8; 4096], &[4096], 0, false).unwrap();
    s.kill();
    let start = Instant::now();
    let err = write(&mut *e, 0, &[8u8; 4096], &[4096], 0, false).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    // Later operations fail at once.
    let start = Instant::now();
    let err = read(&mut *e, 0, &[4096], 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    assert!(start.elapsed() < Duration::from_secs(3));
    // A new engine on a dead server is an error at creation.
    let msg = b.engine(EngineKind::IoUring, 8).err().unwrap().to_string();
    assert!(msg.contains("cannot connect"), "{msg}");
}

#[test]
fn uri_errors_are_clear() {
    let e = "nbd+unix:///x".parse::<DiskSpec>().unwrap_err().to_string();
    assert_eq!(
        e,
        "nbd+unix:///x: not a usable NBD URI: nbd+unix:// needs ?socket=PATH"
    );
    let e = open_with("nbd+unix:///?socket=/nonexistent/sock", &opts(false, 1, 1)).unwrap_err();
    assert!(
        e.starts_with("nbd+unix:///?socket=/nonexistent/sock: cannot connect: "),
        "{e}"
    );
}
