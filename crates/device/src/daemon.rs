//! The daemon: it opens every disk it starts with and takes their sockets, confines
//! itself, starts the shared worker threads and one thread per disk (disk.rs), serves the
//! control socket (statistics and live disk management, control.rs) and waits for a
//! signal: stop, or re-read the disks' sizes.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use log::{error, info};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{ConfigError, DaemonConfig, Listen, ServedDisk};
use crate::disk::OpenedDisk;
pub use crate::disk::MESSAGE_TIMEOUT;
use crate::registry::Registry;
use crate::socket_file::SocketError;
use crate::worker::{Pool, PoolConfig};

/// Why the daemon could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad configuration value.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The disk could not be opened.
    #[error(transparent)]
    Storage(#[from] storage::Error),
    /// The socket path cannot be taken.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// Binding or preparing the socket failed.
    #[error("cannot listen on {path}: {source}")]
    Listen {
        /// The path (or `fd N`).
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A connection could not be set up.
    #[error("vhost-user: {0}")]
    VhostUser(String),
    /// Two disks with one name or one socket.
    #[error("{0}")]
    Duplicate(String),
    /// The sandbox could not be applied.
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::SandboxError),
}

/// A testing aid: once confined, the daemon tries what this names (`execve`,
/// `open-passwd`, `socket-inet`) and logs what happened (with `--seccomp kill` the first
/// and the last end the process).
pub const SELFTEST_ENV: &str = "VBLK_SANDBOX_SELFTEST";

/// What the sandbox must leave: the socket files to remove at exit, the TCP ports of NBD
/// servers.
fn sandbox_needs(
    daemon: &DaemonConfig,
    disks: &[(ServedDisk, Option<std::fs::File>)],
    control: Option<&std::path::Path>,
) -> crate::sandbox::Needs {
    let mut removable = Vec::new();
    let mut tcp_ports = daemon.nbd_ports.clone();
    for (d, _) in disks {
        if let Listen::Path(p) = &d.listen {
            removable.push(p.clone());
        }
        if let storage::DiskSpec::Nbd(spec) = &d.config.disk {
            tcp_ports.extend(spec.tcp_port());
        }
    }
    removable.extend(control.map(|p| p.to_path_buf()));
    tcp_ports.sort_unstable();
    tcp_ports.dedup();
    crate::sandbox::Needs {
        removable,
        tcp_ports,
    }
}

/// How the daemon (or one disk of it) is told to stop or to re-read its disk's size, from
/// another thread or a signal handler thread: set a flag and wake the daemon's poll.
#[derive(Debug)]
pub struct Controls {
    efd: EventFd,
    /// Readable once stopped (never read): wakes every thread that polls it.
    stopped: EventFd,
    stop: AtomicBool,
    resize: AtomicBool,
}

impl Controls {
    /// New controls (an eventfd).
    pub fn new() -> io::Result<Controls> {
        Ok(Controls {
            efd: EventFd::new(EFD_NONBLOCK)?,
            stopped: EventFd::new(EFD_NONBLOCK)?,
            stop: AtomicBool::new(false),
            resize: AtomicBool::new(false),
        })
    }

    /// Stop: finish the requests in flight, flush, remove the socket, return.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.efd.write(1);
        let _ = self.stopped.write(1);
    }

    /// Re-read the disk's size and tell the frontend if it changed.
    pub fn resize(&self) {
        self.resize.store(true, Ordering::SeqCst);
        let _ = self.efd.write(1);
    }

    /// Wake the disk's thread with nothing asked: what waits there for the fence (a
    /// hand-over, a release of the image) looks again.
    pub(crate) fn poke(&self) {
        let _ = self.efd.write(1);
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub(crate) fn take_resize(&self) -> bool {
        self.resize.swap(false, Ordering::SeqCst)
    }

    /// Readable while something is asked ([`Controls::clear_wake`] clears it).
    pub(crate) fn wake_fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    pub(crate) fn clear_wake(&self) {
        let _ = self.efd.read();
    }

    /// Readable once stopped, forever.
    pub(crate) fn stopped_fd(&self) -> RawFd {
        self.stopped.as_raw_fd()
    }
}

/// Serve `disks` (each with its image already open, when a client opened it) until
/// `controls` says stop (then each disk's requests in flight finish, its write cache is
/// flushed and a socket the daemon created is removed) or a disk's listening socket fails.
/// `ready` is called once every socket listens.
pub fn serve(
    daemon: &DaemonConfig,
    disks: Vec<ServedDisk>,
    controls: &Arc<Controls>,
    ready: &mut dyn FnMut(),
) -> Result<(), Error> {
    serve_files(
        daemon,
        disks.into_iter().map(|d| (d, None)).collect(),
        controls,
        ready,
    )
}

/// [`serve`], some disks with their image file already open.
pub fn serve_files(
    daemon: &DaemonConfig,
    disks: Vec<(ServedDisk, Option<std::fs::File>)>,
    controls: &Arc<Controls>,
    ready: &mut dyn FnMut(),
) -> Result<(), Error> {
    daemon.validate()?;
    for (i, (d, _)) in disks.iter().enumerate() {
        d.validate()?;
        for (e, _) in &disks[..i] {
            if e.id == d.id {
                return Err(Error::Duplicate(format!("two disks are named {:?}", d.id)));
            }
            if e.listen == d.listen {
                return Err(Error::Duplicate(format!(
                    "disks {:?} and {:?} have the same socket",
                    e.id, d.id
                )));
            }
        }
    }
    let control = match &daemon.control_socket {
        Some(path) => Some(crate::control::ControlSocket::bind(
            path,
            &daemon.control_access,
        )?),
        None => None,
    };
    let needs = sandbox_needs(daemon, &disks, control.as_ref().map(|c| c.path()));
    let mut opened = Vec::with_capacity(disks.len());
    for (d, file) in disks {
        opened.push(OpenedDisk::open(d, file)?);
    }
    // Everything is open: the disks, the sockets, the NBD connections' first handshakes.
    // From here on the daemon is confined, and every thread it starts inherits it.
    let report = crate::sandbox::confine(&daemon.sandbox, &needs)?;
    info!("sandbox: {report}");
    if let Ok(what) = std::env::var(SELFTEST_ENV) {
        crate::sandbox::selftest(&what);
    }
    let pool = Arc::new(
        Pool::new(&PoolConfig {
            threads: daemon.threads,
            cpus: daemon.cpus.clone(),
            poll_us: daemon.poll_us,
            coalesce_us: daemon.coalesce_us,
        })
        .map_err(|source| Error::Listen {
            path: "worker threads".into(),
            source,
        })?,
    );
    let confined =
        daemon.sandbox.seccomp != crate::sandbox::SeccompMode::Off || daemon.sandbox.landlock;
    let registry = Arc::new(Registry::new(
        pool,
        controls.clone(),
        daemon.socket_access.clone(),
        confined.then(|| needs.tcp_ports.clone()),
    ));
    for (name, limits) in &daemon.throttle_groups {
        registry
            .set_group(name, limits.clone())
            .map_err(|e| Error::VhostUser(format!("throttle group {name}: {e}")))?;
    }
    for o in opened {
        // A group no limits were given for is made, unlimited, by the first disk that
        // names it: likely a name mistyped (QEMU makes groups the same way).
        if let Some(g) = o.config.throttle_group.as_deref() {
            if !daemon.throttle_groups.iter().any(|(n, _)| n == g) {
                log::warn!(
                    "disk {}: throttle group {g:?} has no limits (none given with --group {g}:LIMITS or a [group.{g}] table): it limits nothing until `vblk disk group` gives it some",
                    o.id
                );
            }
        }
        registry.start(o)?;
    }
    let control = match control {
        Some(c) => {
            let path = c.path().to_path_buf();
            let t = crate::control::serve(
                c,
                registry.clone(),
                daemon.disk_parser.clone(),
                controls.stopped_fd(),
            )?;
            info!(
                "statistics and disk management on {} (vblk stats {}, vblk disk list {})",
                path.display(),
                path.display(),
                path.display()
            );
            Some(t)
        }
        None => None,
    };
    let (disks, threads) = (registry.len(), daemon.threads);
    info!(
        "serving {disks} disk{} on {threads} worker thread{} (polling {} µs)",
        if disks == 1 { "" } else { "s" },
        if threads == 1 { "" } else { "s" },
        daemon.poll_us
    );
    ready();
    let result = wait_loop(controls, &registry);
    controls.stop();
    let stopped = registry.stop_all();
    if let Some(t) = control {
        let _ = t.join();
    }
    result.and(stopped)
}

/// Until told to stop: pass resizes on to every disk.
fn wait_loop(controls: &Controls, registry: &Registry) -> Result<(), Error> {
    loop {
        let mut fd = libc::pollfd {
            fd: controls.wake_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd structure.
        let r = unsafe { libc::poll(&mut fd, 1, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            error!("poll failed: {e}; stopping");
            return Ok(());
        }
        controls.clear_wake();
        if controls.stopping() {
            info!("stopping");
            return registry.take_failure().map_or(Ok(()), Err);
        }
        if controls.take_resize() {
            registry.resize_all();
        }
    }
}
