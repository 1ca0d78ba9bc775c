//! Listening for frontends: one at a time, and back to listening when one leaves.
//!
//! A connection whose session cannot be set up (the disk refuses a new engine: an NBD
//! server briefly down) is closed and the next one is served; so is a frontend that sends
//! part of a message and then nothing for [`MESSAGE_TIMEOUT`], or does not read its
//! replies. Only the listening socket failing ends the daemon.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use log::{error, info, warn};
use storage::{Backend, OpenOptions};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::{ConfigError, DeviceConfig, Listen};
use crate::fence::Fence;
use crate::session::{Session, SessionEnd};
use crate::socket_file::{SocketError, SocketFile};
use crate::stats::Stats;

/// How long the rest of a message may take once its first byte came, and how long a reply
/// may wait for the frontend to read.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

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
    config: &DeviceConfig,
    listen: &Listen,
    control: Option<&std::path::Path>,
) -> crate::sandbox::Needs {
    let mut removable = Vec::new();
    if let Listen::Path(p) = listen {
        removable.push(p.clone());
    }
    removable.extend(control.map(|p| p.to_path_buf()));
    let tcp_ports = match &config.disk {
        storage::DiskSpec::Nbd(spec) => spec.tcp_port().into_iter().collect(),
        _ => Vec::new(),
    };
    crate::sandbox::Needs {
        removable,
        tcp_ports,
    }
}

/// How the daemon is told to stop or to re-read its disk's size, from another thread or a
/// signal handler thread: set a flag and wake the daemon's poll.
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

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn take_resize(&self) -> bool {
        self.resize.swap(false, Ordering::SeqCst)
    }
}

/// Re-read the disk's size (SIGHUP); tell the frontend if it changed.
fn resize(disk: &Backend, config: &DeviceConfig, session: Option<&mut Session>) {
    match disk.refresh_size(config.allow_shrink) {
        Ok((old, new)) if old == new => info!("resize: the disk is still {new} bytes"),
        Ok((old, new)) => {
            info!("resize: the disk is now {new} bytes (was {old})");
            if let Some(s) = session {
                s.capacity_changed(new >> proto::wire::SECTOR_SHIFT);
            }
        }
        Err(e) => error!("resize refused: {e}"),
    }
}

/// What woke the daemon up.
enum Wake {
    Socket,
    Controls,
}

/// Wait until `fd` is readable or the controls fire.
fn wait(fd: RawFd, controls: &Controls) -> io::Result<Wake> {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: controls.efd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two live pollfd structures.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            let _ = controls.efd.read();
            return Ok(Wake::Controls);
        }
        return Ok(Wake::Socket);
    }
}

/// Serve the disk in `config` on `listen` until `controls` says stop (then the requests
/// in flight finish, a write cache is flushed and a socket the daemon created is removed)
/// or a fatal error happens. `ready` is called once the socket listens.
pub fn serve(
    config: &DeviceConfig,
    listen: &Listen,
    controls: &Controls,
    ready: &mut dyn FnMut(),
) -> Result<(), Error> {
    config.validate()?;
    let disk = Arc::new(Backend::open(
        &config.disk,
        &OpenOptions {
            read_only: config.read_only,
            cache: config.cache,
            prealloc: config.prealloc,
            image: config.image,
            engine_threads: config.engine_threads,
            nbd: config.nbd,
        },
    )?);
    // An engine that cannot work on this disk (aio without O_DIRECT, io_uring or AIO
    // refused by the kernel) is refused now, not when a frontend connects.
    drop(disk.engine(config.engine, 1)?);
    info!(
        "disk {}: {} bytes, logical block {} bytes{}",
        config.disk,
        disk.size(),
        disk.logical_block_size(),
        if config.read_only { ", read-only" } else { "" }
    );
    let (listener, socket_file) = make_listener(listen, config)?;
    let stats = Arc::new(Stats::new(
        usize::from(config.num_queues),
        config.threads.clamp(1, usize::from(config.num_queues)),
        config.disk.to_string(),
    ));
    let control = match &config.control_socket {
        Some(path) => Some(crate::stats::ControlSocket::bind(
            path,
            &config.socket_access,
        )?),
        None => None,
    };
    // Everything is open: the disk, the sockets, the NBD connection's first handshake.
    // From here on the daemon is confined, and every thread it starts inherits it.
    let needs = sandbox_needs(config, listen, control.as_ref().map(|c| c.path()));
    let report = crate::sandbox::confine(&config.sandbox, &needs)?;
    info!("sandbox: {report}");
    if let Ok(what) = std::env::var(SELFTEST_ENV) {
        crate::sandbox::selftest(&what);
    }
    let control = match control {
        Some(c) => {
            let path = c.path().to_path_buf();
            let (s, d) = (stats.clone(), disk.clone());
            let t = crate::stats::serve_control(
                c,
                move || s.snapshot(d.size()),
                controls.stopped.as_raw_fd(),
            )?;
            info!(
                "statistics on {} (vblk stats {})",
                path.display(),
                path.display()
            );
            Some(t)
        }
        None => None,
    };
    info!(
        "listening ({} queues of up to {} entries on {} workers, engine {}, polling {} µs)",
        config.num_queues, config.queue_size, config.threads, config.engine, config.poll_us
    );
    ready();
    let fence = Arc::new(Fence::new(stats.fence.clone()));
    let result = accept_loop(config, &disk, &listener, listen, controls, &stats, &fence);
    if let Some(t) = control {
        controls.stop();
        let _ = t.join();
    }
    if let Err(e) = disk.flush() {
        error!("flushing the disk at exit failed: {e}");
    }
    drop(socket_file);
    result
}

fn accept_loop(
    config: &DeviceConfig,
    disk: &Arc<Backend>,
    listener: &UnixListener,
    listen: &Listen,
    controls: &Controls,
    stats: &Stats,
    fence: &Arc<Fence>,
) -> Result<(), Error> {
    let listen_err = |source| Error::Listen {
        path: describe(listen),
        source,
    };
    while !controls.stopping() {
        match wait(listener.as_raw_fd(), controls).map_err(listen_err)? {
            Wake::Controls => {
                if controls.take_resize() {
                    resize(disk, config, None);
                }
                continue;
            }
            Wake::Socket => {}
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(listen_err(e)),
        };
        serve_one(config, disk, stream, controls, stats, fence);
    }
    info!("stopping");
    Ok(())
}

fn describe(listen: &Listen) -> String {
    match listen {
        Listen::Path(p) => p.display().to_string(),
        Listen::Fd(fd) => format!("fd {fd}"),
    }
}

/// Serve one frontend until it disconnects, breaks the protocol, or the daemon stops.
/// Whatever goes wrong with this connection ends only this connection.
fn serve_one(
    config: &DeviceConfig,
    disk: &Arc<Backend>,
    mut stream: UnixStream,
    controls: &Controls,
    stats: &Stats,
    fence: &Arc<Fence>,
) {
    let prepared = stream
        .set_read_timeout(Some(MESSAGE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(MESSAGE_TIMEOUT)))
        .and_then(|()| stream.try_clone());
    let conn = match prepared {
        Ok(c) => c,
        Err(e) => {
            error!("frontend connection refused: cannot set it up: {e}");
            return;
        }
    };
    let mut session = match Session::new(config, disk, conn, stats, fence) {
        Ok(s) => s,
        Err(e) => {
            stats
                .lifecycle
                .failed_setups
                .fetch_add(1, Ordering::Relaxed);
            error!("frontend connection closed: its session cannot be set up: {e}; waiting for the next");
            return;
        }
    };
    info!("frontend connected");
    loop {
        match wait(stream.as_raw_fd(), controls) {
            Ok(Wake::Socket) => {}
            Ok(Wake::Controls) => {
                if controls.stopping() {
                    session.shutdown();
                    break;
                }
                if controls.take_resize() {
                    resize(disk, config, Some(&mut session));
                }
                continue;
            }
            Err(e) => {
                warn!("frontend session ended: poll failed: {e}");
                break;
            }
        }
        match session.handle(&mut stream) {
            Ok(()) => {}
            Err(SessionEnd::Disconnected) => {
                info!("frontend disconnected");
                break;
            }
            Err(e) => {
                warn!("frontend session ended: {e}");
                break;
            }
        }
        if session.poisoned() {
            error!("the frontend truncated guest memory under the device; connection closed");
            break;
        }
        if let Some(w) = session.lost_worker() {
            stats.lifecycle.lost_workers.fetch_add(1, Ordering::Relaxed);
            error!("worker {w} ended (it panicked); connection closed");
            break;
        }
    }
    let counters = session.counters();
    drop(session);
    for (q, done, bad, failed) in counters {
        info!("queue {q}: {done} requests completed, {bad} rejected, {failed} failed");
    }
}

fn make_listener(
    listen: &Listen,
    config: &DeviceConfig,
) -> Result<(UnixListener, Option<SocketFile>), Error> {
    match listen {
        Listen::Path(path) => {
            let (l, file) = SocketFile::bind(path, &config.socket_access)?;
            info!("listening on {}", path.display());
            Ok((l, Some(file)))
        }
        Listen::Fd(fd) => {
            // SAFETY: fstat on an fd number only reads metadata; a bad fd gives EBADF.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is a valid, writable stat buffer.
            if unsafe { libc::fstat(*fd, &mut st) } != 0 {
                return Err(Error::Listen {
                    path: format!("fd {fd}"),
                    source: io::Error::last_os_error(),
                });
            }
            if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                return Err(Error::Listen {
                    path: format!("fd {fd}"),
                    source: io::Error::new(io::ErrorKind::InvalidInput, "not a socket"),
                });
            }
            info!("listening on inherited fd {fd}");
            // SAFETY: the caller handed us this listening socket (--fd); from here on the
            // daemon owns it and nothing else closes it.
            Ok((unsafe { UnixListener::from_raw_fd(*fd) }, None))
        }
    }
}
