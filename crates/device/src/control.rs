//! The control socket (`--control-socket PATH`): statistics and live disk management.
//!
//! A client connects and sends one request, a JSON object on one line, and reads one
//! JSON reply; then the connection is closed. A client that sends nothing for
//! [`REQUEST_WAIT`] (or shuts its side) gets the statistics snapshot, as the first
//! `vblk stats` did. Requests:
//!
//! - `{"op":"stats"}`, `{"op":"stats","id":ID}`: the snapshot (registry.rs).
//! - `{"op":"list"}`: the disks.
//! - `{"op":"add","disk":SPEC,"socket":PATH}`: serve a new disk. SPEC is what
//!   `vblk serve --disk` takes. The message carries the disk's listening socket (bound by
//!   the client at PATH) and, for an image file or block device, the open file, then a
//!   qcow2 image's backing files in the chain's order (`backing=` in SPEC): the daemon
//!   is confined and opens nothing itself (docs/security.md).
//! - `{"op":"remove","id":ID,"force":BOOL}`: stop serving a disk.
//! - `{"op":"set","id":ID,"throttle":LIMITS,"group":NAME}`: a disk's QoS limits (QEMU's
//!   `KEY=VALUE,...`, `none` for none; they replace the old ones) and its throttle group
//!   (`""` for none); either may be left out.
//! - `{"op":"resize","id":ID,"size":BYTES,"shrink":BOOL}`: make a disk that size (a raw
//!   file truncated, a qcow2 image grown) and tell its frontend.
//! - `{"op":"group","name":NAME,"limits":LIMITS}`: a throttle group's limits.
//!
//! Replies are `{"ok":true,...}` or `{"error":MESSAGE}`. The client is trusted as the
//! daemon's operator (the socket is the daemon user's own, or a group's: `--socket-group`),
//! but what it sends is still checked: a bad request gets an error, never a panic.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::config::{Listen, ServedDisk};
use crate::disk::OpenedDisk;
use crate::registry::Registry;
use crate::socket_file::{SocketAccess, SocketError, SocketFile};
use crate::throttle::Limits;

/// How long the daemon waits for a client's request before it sends the statistics.
pub const REQUEST_WAIT: Duration = Duration::from_millis(200);
/// Longest request.
const MAX_REQUEST: usize = 64 * 1024;
/// Most descriptors one request carries: the socket, the image, its backing chain.
const MAX_FDS: usize = 2 + MAX_BACKING;
/// Most backing files a disk added live may have.
const MAX_BACKING: usize = 32;

/// The function behind a [`DiskParser`].
pub type ParseDisk = dyn Fn(&str) -> Result<ServedDisk, String> + Send + Sync;

/// Turns a `--disk` SPEC into a disk (the command line's parser, given by the program).
#[derive(Clone)]
pub struct DiskParser(pub Arc<ParseDisk>);

impl std::fmt::Debug for DiskParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DiskParser")
    }
}

/// The control socket, bound (before the sandbox) and not yet served.
pub(crate) struct ControlSocket {
    listener: UnixListener,
    file: SocketFile,
}

impl ControlSocket {
    /// Bind `path` for `access`.
    pub(crate) fn bind(path: &Path, access: &SocketAccess) -> Result<ControlSocket, SocketError> {
        let (listener, file) = SocketFile::bind(path, access)?;
        listener
            .set_nonblocking(true)
            .map_err(|source| SocketError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(ControlSocket { listener, file })
    }

    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }
}

/// Requests answered at once; one more gets a "busy" error.
const MAX_ANSWERING: usize = 16;

/// Serve requests on `control` until `stop_fd` becomes readable (it stays readable once
/// the daemon stops). Each request is answered on a thread of its own, so that a slow one
/// (a forced removal waits for the disk's requests in flight, a resize syncs a qcow2
/// image) or a client that is slow to send does not hold up the rest: statistics and
/// lists answer while a disk is being removed. At most [`MAX_ANSWERING`] at a time.
pub(crate) fn serve(
    control: ControlSocket,
    registry: Arc<Registry>,
    parser: Option<DiskParser>,
    stop_fd: RawFd,
) -> Result<std::thread::JoinHandle<()>, SocketError> {
    let ControlSocket { listener, file } = control;
    let path = file.path().to_path_buf();
    let io_err = |source| SocketError::Io {
        path: path.clone(),
        source,
    };
    let answering = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("vblk-control".into())
        .spawn(move || loop {
            let mut fds = [
                libc::pollfd {
                    fd: listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two live pollfd structures.
            if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
                continue;
            }
            if fds[1].revents != 0 {
                drop(file);
                return;
            }
            match listener.accept() {
                Ok((s, _)) => answer_apart(s, &registry, parser.as_ref(), &answering),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    log::warn!("control socket {}: {e}", file.path().display());
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        })
        .map_err(io_err)
}

/// One request, read with its descriptors.
struct Request {
    body: Option<Value>,
    fds: Vec<File>,
}

/// Read a request: nothing within [`REQUEST_WAIT`] (or the client's side shut) is none.
fn read_request(s: &mut UnixStream) -> Result<Request, String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(REQUEST_WAIT))
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut raw = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec names `buf`, a live buffer of its length that may receive any
    // bytes; `raw` receives at most its length of descriptors.
    let got = unsafe { s.recv_with_fds(&mut iov, &mut raw) };
    let (mut n, nfds) = match got {
        Ok(v) => v,
        Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EWOULDBLOCK => {
            return Ok(Request {
                body: None,
                fds: Vec::new(),
            })
        }
        Err(e) => return Err(format!("cannot read the request: {e}")),
    };
    let fds = raw[..nfds]
        .iter()
        // SAFETY: the kernel just installed these descriptors for us; nothing else owns
        // them.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    // The rest of a long request, up to its newline.
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    while n > 0 && !buf[..n].contains(&b'\n') && n < MAX_REQUEST {
        match s.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(m) => n += m,
            Err(e) => return Err(format!("cannot read the request: {e}")),
        }
    }
    let text = &buf[..n];
    let line = text.split(|&b| b == b'\n').next().unwrap_or(&[]);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(Request { body: None, fds });
    }
    let body = serde_json::from_slice(line).map_err(|e| format!("not a JSON request: {e}"))?;
    Ok(Request {
        body: Some(body),
        fds,
    })
}

/// Answer `s` on a thread of its own, or say the daemon is busy when
/// [`MAX_ANSWERING`] requests are being answered.
fn answer_apart(
    s: UnixStream,
    registry: &Arc<Registry>,
    parser: Option<&DiskParser>,
    answering: &Arc<AtomicUsize>,
) {
    if answering.fetch_add(1, Ordering::AcqRel) >= MAX_ANSWERING {
        answering.fetch_sub(1, Ordering::AcqRel);
        reply(
            s,
            error(format!(
                "busy: {MAX_ANSWERING} requests are being answered; try again"
            )),
        );
        return;
    }
    // Counted out however the thread ends (a panic too) or if it never starts.
    let slot = Answering(answering.clone());
    let (registry, parser) = (registry.clone(), parser.cloned());
    let spawned = std::thread::Builder::new()
        .name("vblk-control-request".into())
        .spawn(move || {
            let _slot = slot;
            answer(s, &registry, parser.as_ref());
        });
    if let Err(e) = spawned {
        // The connection went with the closure: the client reads no answer.
        log::warn!("control socket: cannot start a thread to answer a request: {e}");
    }
}

/// One request being answered: counted out when dropped.
struct Answering(Arc<AtomicUsize>);

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn answer(mut s: UnixStream, registry: &Arc<Registry>, parser: Option<&DiskParser>) {
    let answer = match read_request(&mut s) {
        Ok(Request { body: None, .. }) => registry.snapshot(None).unwrap_or_else(error),
        Ok(Request {
            body: Some(body),
            fds,
        }) => handle(&body, fds, registry, parser),
        Err(e) => error(e),
    };
    reply(s, answer);
}

/// Send `answer` (one line of JSON) and close the connection.
fn reply(mut s: UnixStream, answer: Value) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    let mut text = answer.to_string();
    text.push('\n');
    let _ = s.write_all(text.as_bytes());
}

fn error(msg: impl ToString) -> Value {
    json!({ "error": msg.to_string() })
}

fn handle(
    body: &Value,
    fds: Vec<File>,
    registry: &Arc<Registry>,
    parser: Option<&DiskParser>,
) -> Value {
    let op = body["op"].as_str().unwrap_or("");
    let id = body["id"].as_str();
    match op {
        "stats" => registry.snapshot(id).unwrap_or_else(error),
        "list" => registry.list(),
        "remove" => {
            let Some(id) = id else {
                return error("remove: which disk? (\"id\")");
            };
            let force = body["force"].as_bool().unwrap_or(false);
            match registry.remove(id, force) {
                Ok(socket) => json!({ "ok": true, "socket": socket }),
                Err(e) => error(e),
            }
        }
        "add" => match add(body, fds, registry, parser) {
            Ok(id) => json!({ "ok": true, "id": id }),
            Err(e) => error(e),
        },
        "set" => {
            let Some(id) = id else {
                return error("set: which disk? (\"id\")");
            };
            let limits = match body["throttle"].as_str().map(Limits::parse) {
                None => None,
                Some(Ok(l)) => Some(l),
                Some(Err(e)) => return error(format!("disk {id}: {e}")),
            };
            let group = body["group"]
                .as_str()
                .map(|g| (!g.is_empty() && g != "none").then(|| g.to_string()));
            match registry.set_disk(id, limits, group) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => error(e),
            }
        }
        "resize" => {
            let Some(id) = id else {
                return error("resize: which disk? (\"id\")");
            };
            let Some(size) = body["size"].as_u64() else {
                return error("resize: what size? (\"size\", in bytes)");
            };
            let shrink = body["shrink"].as_bool().unwrap_or(false);
            match registry.resize_disk(id, size, shrink) {
                Ok((old, new)) => json!({ "ok": true, "old": old, "size": new }),
                Err(e) => error(e),
            }
        }
        "group" => {
            let Some(name) = body["name"].as_str() else {
                return error("group: which group? (\"name\")");
            };
            let limits = match Limits::parse(body["limits"].as_str().unwrap_or("")) {
                Ok(l) => l,
                Err(e) => return error(format!("throttle group {name}: {e}")),
            };
            match registry.set_group(name, limits) {
                Ok(()) => json!({ "ok": true }),
                Err(e) => error(e),
            }
        }
        other => error(format!(
            "unknown request {other:?} (this daemon knows stats, list, add, remove, set, resize, group)"
        )),
    }
}

/// Serve a disk a client opened.
fn add(
    body: &Value,
    fds: Vec<File>,
    registry: &Arc<Registry>,
    parser: Option<&DiskParser>,
) -> Result<String, String> {
    let Some(parser) = parser else {
        return Err("this daemon cannot add disks (it was started without a disk parser)".into());
    };
    let spec = body["disk"]
        .as_str()
        .ok_or("add: no disk SPEC (\"disk\")")?;
    let socket = body["socket"]
        .as_str()
        .map(PathBuf::from)
        .ok_or("add: no socket path (\"socket\")")?;
    let mut served = (parser.0)(spec)?;
    served.spec = spec.to_string();
    registry.check_reachable(&served.config.disk)?;
    // Before anything is adopted: the socket the client bound stays the client's to
    // remove. (`start` checks again, under the registry's lock.)
    if registry.contains(&served.id) {
        return Err(format!("a disk named {:?} is served already", served.id));
    }
    let mut fds = fds.into_iter();
    let listener = fds
        .next()
        .ok_or("add: the message carries no listening socket")?;
    let file = fds.next();
    // Then the backing chain's files, in order.
    let backing: Vec<File> = fds.collect();
    if backing.len() > served.config.backing.len() {
        return Err(format!(
            "add: the message carries {} backing files for a chain of {}",
            backing.len(),
            served.config.backing.len()
        ));
    }
    let file_needed = matches!(served.config.disk, storage::DiskSpec::File(_));
    if file_needed != file.is_some() {
        return Err(if file_needed {
            "add: an image file or block device comes open with the request (the daemon opens nothing itself)".into()
        } else {
            "add: this disk takes no file".into()
        });
    }
    // The same image as a disk served already: its locks would refuse it, naming only
    // "another process" (this one, which its sandbox keeps from looking at /proc).
    if let Some(f) = &file {
        use std::os::unix::fs::MetadataExt;
        if let Some(other) = f
            .metadata()
            .ok()
            .and_then(|m| registry.serving_file((m.dev(), m.ino()), !served.config.read_only))
        {
            return Err(format!("disk {other:?} serves this image already"));
        }
    }
    // From here the listener belongs to the disk (closed with it, or on its failure).
    served.listen = Listen::Fd(std::os::fd::IntoRawFd::into_raw_fd(listener));
    let id = served.id.clone();
    let mut opened = OpenedDisk::open_with(served, file, backing).map_err(|e| e.to_string())?;
    opened.adopt_socket(&socket);
    registry.start(opened).map_err(|e| e.to_string())?;
    Ok(id)
}
