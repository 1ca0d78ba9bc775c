//! Listening for frontends: one at a time, and back to listening when one leaves.

use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use log::{error, info, warn};
use storage::{Backend, OpenOptions};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::config::{ConfigError, DeviceConfig, Listen};
use crate::session::Session;

/// Why the daemon could not start or had to stop.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad configuration value.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The disk could not be opened.
    #[error(transparent)]
    Storage(#[from] storage::Error),
    /// Another process listens on the socket path.
    #[error("socket path {0} is taken: another process is listening on it")]
    SocketTaken(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("socket path {0} exists and is not a socket")]
    NotASocket(PathBuf),
    /// Binding or preparing the socket failed.
    #[error("cannot listen on {path}: {source}")]
    Listen {
        /// The path (or `fd N`).
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// vhost-user-backend could not set up a connection.
    #[error("vhost-user: {0}")]
    VhostUser(String),
}

/// Serve the disk in `config` on `listen` until `stop` is set (checked between frontends)
/// or a fatal error happens. `ready` is called once the socket listens.
pub fn serve(
    config: &DeviceConfig,
    listen: &Listen,
    stop: &AtomicBool,
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
        },
    )?);
    info!(
        "disk {}: {} bytes, logical block {} bytes{}",
        config.disk,
        disk.size(),
        disk.logical_block_size(),
        if config.read_only { ", read-only" } else { "" }
    );
    let listener = make_listener(listen)?;
    info!(
        "listening ({} queues of up to {} entries on {} workers, engine {}, polling {} µs)",
        config.num_queues, config.queue_size, config.threads, config.engine, config.poll_us
    );
    ready();
    while !stop.load(Ordering::Relaxed) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Error::Listen {
                    path: describe(listen),
                    source: e,
                })
            }
        };
        serve_one(config, &disk, stream)?;
    }
    Ok(())
}

fn describe(listen: &Listen) -> String {
    match listen {
        Listen::Path(p) => p.display().to_string(),
        Listen::Fd(fd) => format!("fd {fd}"),
    }
}

/// Serve one frontend until it disconnects (or breaks the protocol).
fn serve_one(config: &DeviceConfig, disk: &Arc<Backend>, stream: UnixStream) -> Result<(), Error> {
    let conn = stream
        .try_clone()
        .map_err(|e| Error::VhostUser(format!("cannot clone the connection: {e}")))?;
    let session = Arc::new(Mutex::new(Session::new(config, disk, conn)?));
    let mut handler = BackendReqHandler::from_stream(stream, session.clone());
    info!("frontend connected");
    loop {
        match handler.handle_request() {
            Ok(()) => {}
            // A frontend that closes its socket (a VM shutting down) is the normal way out.
            Err(VuError::Disconnected | VuError::PartialMessage) => {
                info!("frontend disconnected");
                break;
            }
            Err(e) => {
                warn!("frontend session ended: {e}");
                break;
            }
        }
        if lock(&session).poisoned() {
            error!("the frontend truncated guest memory under the device; connection closed");
            break;
        }
    }
    drop(handler);
    let session = lock(&session);
    for (q, done, bad, failed) in session.counters() {
        info!("queue {q}: {done} requests completed, {bad} rejected, {failed} failed");
    }
    Ok(())
}

/// A poisoned lock means a thread panicked while holding the session; its state is
/// still consistent message by message, so carry on.
fn lock(m: &Mutex<Session>) -> MutexGuard<'_, Session> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn make_listener(listen: &Listen) -> Result<UnixListener, Error> {
    match listen {
        Listen::Path(path) => {
            clear_stale_socket(path)?;
            let l = UnixListener::bind(path).map_err(|source| Error::Listen {
                path: path.display().to_string(),
                source,
            })?;
            info!("listening on {}", path.display());
            Ok(l)
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
            Ok(unsafe { UnixListener::from_raw_fd(*fd) })
        }
    }
}

/// Remove a socket file left by a daemon that is gone; refuse if one still listens.
fn clear_stale_socket(path: &Path) -> Result<(), Error> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(Error::Listen {
                path: path.display().to_string(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(Error::NotASocket(path.to_path_buf()));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(Error::SocketTaken(path.to_path_buf()));
    }
    warn!("removing stale socket {}", path.display());
    std::fs::remove_file(path).map_err(|source| Error::Listen {
        path: path.display().to_string(),
        source,
    })
}
