//! vhost-user-blk backends run as child processes: `vblk serve` (the thing
//! under test) or qemu-storage-daemon (the reference, to validate the tests).

use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::assets::{find_program, require_programs};

/// Which program serves the disks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `vblk serve`, the binary of this crate.
    Vblk,
    /// `qemu-storage-daemon --export type=vhost-user-blk`.
    QemuStorageDaemon,
}

impl Backend {
    /// `$VBLK_GUEST_BACKEND`: `vblk` (default) or `qemu-storage-daemon`
    /// (alias `qsd`), which runs the same guest checks against the reference
    /// implementation.
    pub fn from_env() -> Backend {
        match std::env::var("VBLK_GUEST_BACKEND").as_deref() {
            Err(_) | Ok("") | Ok("vblk") => Backend::Vblk,
            Ok("qemu-storage-daemon") | Ok("qsd") => Backend::QemuStorageDaemon,
            Ok(other) => {
                panic!("VBLK_GUEST_BACKEND={other}: expected `vblk` or `qemu-storage-daemon`")
            }
        }
    }
}

/// Whether the backend goes through the host page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// O_DIRECT: `vblk serve --cache none`, qemu-storage-daemon `cache.direct=on`.
    None,
    /// The page cache: `--cache writeback`, `cache.direct=off`.
    Writeback,
}

impl Cache {
    pub fn name(self) -> &'static str {
        match self {
            Cache::None => "none",
            Cache::Writeback => "writeback",
        }
    }
}

/// How the backend submits I/O to the host kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `vblk serve --engine io_uring`, qemu-storage-daemon `aio=io_uring`.
    IoUring,
    /// `--engine sync` (preadv/pwritev on the worker); qemu-storage-daemon `aio=threads`
    /// (preadv/pwritev on a thread pool), its nearest equivalent.
    Sync,
    /// `--engine aio` (Linux AIO; needs [`Cache::None`]), qemu-storage-daemon `aio=native`.
    Aio,
    /// `--engine threads` (preadv/pwritev on a thread pool), qemu-storage-daemon
    /// `aio=threads`.
    Threads,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::IoUring => "io_uring",
            Engine::Sync => "sync",
            Engine::Aio => "aio",
            Engine::Threads => "threads",
        }
    }
}

/// How to serve one disk.
#[derive(Debug, Clone)]
pub struct Export {
    /// An image path (or, for `vblk`, `mem:SIZE` / `null:SIZE`).
    pub blk_file: String,
    pub read_only: bool,
    pub num_queues: u16,
    /// `None`: the backend's default (vblk: see `vblk serve --help`; qemu-storage-daemon
    /// here: the page cache).
    pub cache: Option<Cache>,
    /// `None`: the backend's default (vblk: io_uring; qemu-storage-daemon: threads).
    pub engine: Option<Engine>,
    /// `--serial` (vblk only).
    pub serial: Option<String>,
    /// More `vblk serve` arguments.
    pub extra_args: Vec<String>,
    /// Environment variables for `vblk serve` (testing aids).
    pub env: Vec<(String, String)>,
}

impl Export {
    /// `num_queues` 0: the backend's default (no `--num-queues`; vblk only).
    pub fn new(blk_file: impl AsRef<Path>, num_queues: u16) -> Export {
        Export {
            blk_file: blk_file.as_ref().display().to_string(),
            read_only: false,
            num_queues,
            cache: None,
            engine: None,
            serial: None,
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }

    pub fn read_only(mut self) -> Export {
        self.read_only = true;
        self
    }

    pub fn cache(mut self, cache: Cache) -> Export {
        self.cache = Some(cache);
        self
    }

    pub fn engine(mut self, engine: Engine) -> Export {
        self.engine = Some(engine);
        self
    }

    pub fn serial(mut self, serial: &str) -> Export {
        self.serial = Some(serial.into());
        self
    }

    /// More `vblk serve` arguments (ignored by the reference backend).
    pub fn args(mut self, args: &[&str]) -> Export {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// An environment variable for `vblk serve` (ignored by the reference backend).
    pub fn env(mut self, key: &str, value: &str) -> Export {
        self.env.push((key.into(), value.into()));
        self
    }
}

/// A running backend, killed on drop.
#[derive(Debug)]
pub struct Daemon {
    pub name: String,
    pub backend: Backend,
    pub socket: PathBuf,
    pub log: PathBuf,
    pub command_line: String,
    child: Option<Child>,
}

impl Daemon {
    /// Starts `backend` serving `export` on `socket` and waits until the
    /// socket exists. Output goes to `log`.
    pub fn start(
        backend: Backend,
        name: &str,
        export: &Export,
        socket: &Path,
        log: &Path,
    ) -> Daemon {
        assert!(
            socket.as_os_str().len() < 100,
            "socket path {} is too long for a Unix socket; use a shorter TMPDIR",
            socket.display()
        );
        let _ = fs::remove_file(socket);
        let cmd = match backend {
            Backend::Vblk => {
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
                cmd.arg("serve").arg("--socket-path").arg(socket);
                cmd.arg("--blk-file").arg(&export.blk_file);
                if export.num_queues > 0 {
                    cmd.arg("--num-queues").arg(export.num_queues.to_string());
                }
                if export.read_only {
                    cmd.arg("--read-only");
                }
                if let Some(s) = &export.serial {
                    cmd.arg("--serial").arg(s);
                }
                if let Some(c) = export.cache {
                    cmd.args(["--cache", c.name()]);
                }
                if let Some(e) = export.engine {
                    cmd.args(["--engine", e.name()]);
                }
                cmd.args(["--log-level", "info"]);
                cmd.args(&export.extra_args);
                cmd.envs(export.env.iter().map(|(k, v)| (k, v)));
                cmd
            }
            Backend::QemuStorageDaemon => {
                require_programs(&[("qemu-storage-daemon", "qemu-system-common")]);
                assert!(
                    !export.blk_file.contains(':') && !export.blk_file.contains(','),
                    "qemu-storage-daemon backend: only plain image paths are supported"
                );
                let mut cmd = Command::new(find_program("qemu-storage-daemon").expect("checked"));
                cmd.arg("--blockdev").arg(format!(
                    "driver=file,node-name=f,filename={},cache.direct={},aio={}{}",
                    export.blk_file,
                    match export.cache {
                        Some(Cache::None) => "on",
                        Some(Cache::Writeback) | None => "off",
                    },
                    match export.engine {
                        Some(Engine::IoUring) => "io_uring",
                        Some(Engine::Aio) => "native",
                        Some(Engine::Sync | Engine::Threads) | None => "threads",
                    },
                    if export.read_only {
                        ",read-only=on"
                    } else {
                        ""
                    }
                ));
                cmd.arg("--export").arg(format!(
                    "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},num-queues={},writable={}",
                    socket.display(),
                    export.num_queues,
                    if export.read_only { "off" } else { "on" }
                ));
                cmd
            }
        };
        Daemon::spawn(name, backend, cmd, socket, log)
    }

    /// `vblk serve ARGS --log-level info`, waited for until `socket` (the last socket it
    /// creates) exists: for command lines [`Export`] does not describe (several disks).
    pub fn start_vblk(name: &str, args: &[&str], socket: &Path, log: &Path) -> Daemon {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
        cmd.arg("serve").args(args).args(["--log-level", "info"]);
        Daemon::spawn(name, Backend::Vblk, cmd, socket, log)
    }

    fn spawn(name: &str, backend: Backend, mut cmd: Command, socket: &Path, log: &Path) -> Daemon {
        let out = fs::File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let err = out.try_clone().expect("clone log file");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let command_line = format!("{cmd:?}");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command_line}: {e}"));
        let mut daemon = Daemon {
            name: name.into(),
            backend,
            socket: socket.to_path_buf(),
            log: log.to_path_buf(),
            command_line,
            child: Some(child),
        };
        daemon.wait_for_socket(Duration::from_secs(30));
        daemon
    }

    fn wait_for_socket(&mut self, limit: Duration) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                panic!(
                    "{} exited ({status}) before creating its socket\n{}",
                    self.name,
                    self.describe()
                );
            }
            let is_socket = fs::metadata(&self.socket)
                .map(|m| m.file_type().is_socket())
                .unwrap_or(false);
            if is_socket {
                // The path appears at bind(); give listen() a moment.
                std::thread::sleep(Duration::from_millis(100));
                return;
            }
            if start.elapsed() > limit {
                panic!(
                    "{} did not create {} within {limit:?}\n{}",
                    self.name,
                    self.socket.display(),
                    self.describe()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if the process has ended.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Command line and log, for failure messages.
    pub fn describe(&self) -> String {
        let log = fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(200)..];
        format!(
            "---- {} (pid {}) ----\ncommand: {}\n---- {} log (last {} lines) ----\n{}",
            self.name,
            self.pid(),
            self.command_line,
            self.name,
            tail.len(),
            tail.join("\n")
        )
    }

    /// Asserts that the daemon is still the same running process.
    pub fn assert_running(&mut self, when: &str) {
        if let Some(status) = self.exit_status() {
            panic!(
                "{} (pid {}) is not running {when}: exited with {status}\n{}",
                self.name,
                self.pid(),
                self.describe()
            );
        }
    }

    /// `vblk serve`'s per-queue summary of frontend connection `nth` (1-based), logged when
    /// it ends: (queue, completed, rejected, failed) for each queue that saw requests. Waits
    /// up to 20 s for `queues` of them.
    pub fn queue_summary(&self, nth: usize, queues: usize) -> Vec<(usize, u64, u64, u64)> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let log = fs::read_to_string(&self.log).unwrap_or_default();
            let after = log.split("frontend disconnected").nth(nth).unwrap_or("");
            let lines: Vec<_> = queue_summaries(after)
                .into_iter()
                .map(|q| (q.queue, q.completed, q.rejected, q.failed))
                .collect();
            if lines.len() >= queues {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "no summary of {queues} queue(s) for connection {nth} after 20 s\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The log's lines at level WARN or ERROR.
    pub fn warnings(&self) -> Vec<String> {
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        log.lines()
            .filter(|l| {
                let level = l.split(']').next().unwrap_or("");
                level.contains(" WARN") || level.contains(" ERROR")
            })
            .map(str::to_string)
            .collect()
    }
}

/// Prints the daemon's command line and log if the test fails while this lives.
pub struct ShowLogOnPanic<'a>(pub &'a Daemon);

impl Drop for ShowLogOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.0.describe());
        }
    }
}

impl Daemon {
    /// SIGTERM the daemon and wait up to `limit` for it to exit (a clean stop: requests
    /// finish, disks are flushed); false if it did not.
    pub fn terminate(&mut self, limit: std::time::Duration) -> bool {
        // SAFETY: signals a child process the test started.
        unsafe { libc::kill(self.pid() as i32, libc::SIGTERM) };
        let start = std::time::Instant::now();
        while self.exit_status().is_none() {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        true
    }

    /// SIGKILL the daemon and reap it (its socket stays, as a killed daemon's does).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_file(&self.socket);
    }
}

/// `vblk serve`'s per-queue summary, logged when a frontend disconnects:
/// `disk {id}: queue {q}: {done} requests completed, {bad} rejected, {failed} failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSummary {
    pub queue: usize,
    pub completed: u64,
    pub rejected: u64,
    pub failed: u64,
}

/// Every per-queue summary line in a `vblk serve` log, in order.
pub fn queue_summaries(log: &str) -> Vec<QueueSummary> {
    log.lines()
        .filter_map(|line| {
            // `[time LEVEL target] disk ID: queue ...` (one disk of several) or
            // `[time LEVEL target] queue ...`.
            let msg = &line[line.find("] ")? + 2..];
            let msg = match msg.strip_prefix("disk ") {
                Some(r) => r.split_once(": ")?.1,
                None => msg,
            };
            let rest = msg.strip_prefix("queue ")?;
            let (q, rest) = rest.split_once(": ")?;
            let (done, rest) = rest.split_once(" requests completed, ")?;
            let (bad, rest) = rest.split_once(" rejected, ")?;
            let failed = rest.strip_suffix(" failed")?;
            Some(QueueSummary {
                queue: q.parse().ok()?,
                completed: done.parse().ok()?,
                rejected: bad.parse().ok()?,
                failed: failed.parse().ok()?,
            })
        })
        .collect()
}

/// The lines of a `vblk serve` log (env_logger: `[time LEVEL target] message`) whose
/// level is WARN or ERROR.
pub fn warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| {
            line.strip_prefix('[')
                .and_then(|l| l.split_once(']'))
                .is_some_and(|(header, _)| {
                    header
                        .split_whitespace()
                        .any(|w| w == "WARN" || w == "ERROR")
                })
        })
        .collect()
}
