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
//! daemon's operator (the socket is the daemon user's own, or a group's:
//! `--control-socket-group`),
//! but what it sends is still checked: a bad request gets an error, never a panic.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::config::{Listen, ServedDisk};
use crate::disk::OpenedDisk;
use crate::registry::Registry;
use crate::socket_file::{SocketAccess, SocketError, SocketFile};
use crate::throttle::Limits;

/// How long the daemon waits for a client's request before it sends the statistics.
pub const REQUEST_WAIT: Duration = Duration::from_millis(200);
/// How long the rest of a request may take once its first bytes came.
const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// How long a busy answer waits for the request it did not read (see `refuse_busy`).
const BUSY_DRAIN: Duration = Duration::from_millis(50);
/// How long a reply may take to be read.
const REPLY_DEADLINE: Duration = Duration::from_secs(2);
/// Longest request.
const MAX_REQUEST: usize = 64 * 1024;
/// Most descriptors one request carries: the socket, the image, its backing chain.
const MAX_FDS: usize = 2 + MAX_BACKING;
/// Most backing files a disk added live may have.
const MAX_BACKING: usize = 32;

/// The function behind a [`DiskParser`].
pub type ParseDisk = dyn Fn(&str) -> Result<ServedDisk, String> + Send + Sync;

/// Turns a `--disk` SPEC into a disk (the command line's parser, given by the program),
/// with the daemon's disk defaults (the disk flags its command line gave outside
/// `--disk`) applied first, as to the disks it started with. `list` shows the defaults,
/// for `vblk disk sync` to compare a file's disks as the daemon would serve them.
#[derive(Clone)]
pub struct DiskParser(pub Arc<ParseDisk>, pub Vec<String>);

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
    // The rest of a long request, up to its newline, within one deadline for all of it:
    // a client that trickles bytes must not keep its slot (a deadline per read let 16
    // clients at a byte a second hold the control socket for ever).
    let deadline = Instant::now() + REQUEST_DEADLINE;
    while n > 0 && !buf[..n].contains(&b'\n') && n < MAX_REQUEST {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "the request did not arrive whole within {REQUEST_DEADLINE:?}"
            ));
        }
        s.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        match s.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(m) => n += m,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(format!(
                    "the request did not arrive whole within {REQUEST_DEADLINE:?}"
                ))
            }
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
        refuse_busy(s);
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

/// Tell a client the daemon is busy, without reading its request. Its request is
/// drained after the answer (briefly): a Unix socket closed with unread data resets the
/// connection, and the client then read ECONNRESET instead of the answer.
fn refuse_busy(s: UnixStream) {
    let busy = error(format!(
        "busy: {MAX_ANSWERING} requests are being answered; try again"
    ));
    let Ok(mut drain) = s.try_clone() else {
        return reply(s, busy);
    };
    reply(s, busy);
    let _ = drain.shutdown(std::net::Shutdown::Write);
    let _ = drain.set_read_timeout(Some(BUSY_DRAIN));
    let deadline = Instant::now() + BUSY_DRAIN;
    let mut sink = [0u8; 4096];
    while Instant::now() < deadline {
        match drain.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
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

/// Send `answer` (one line of JSON) and close the connection, within one deadline for
/// all of it (a client that reads slowly does not keep the thread).
fn reply(mut s: UnixStream, answer: Value) {
    let mut text = answer.to_string();
    text.push('\n');
    let deadline = Instant::now() + REPLY_DEADLINE;
    let mut rest = text.as_bytes();
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match s.write(rest) {
            Ok(0) | Err(_) => return,
            Ok(m) => rest = &rest[m..],
        }
    }
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
        "list" => {
            let mut v = registry.list();
            v["disk_defaults"] = json!(parser.map(|p| p.1.clone()).unwrap_or_default());
            v
        }
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
    check_listener(&listener)?;
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

/// The descriptor an `add` carries for the disk's socket must be a listening Unix
/// stream socket: the disk's thread accepts on it, and a failure there ended the whole
/// daemon (an unbound socket was taken, answered ok, and every disk went down).
fn check_listener(f: &File) -> Result<(), String> {
    let fd = f.as_raw_fd();
    let opt = |name: libc::c_int| -> Result<libc::c_int, String> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, a live c_int, and the
        // new length into `len`; a descriptor that is no socket gives ENOTSOCK.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(format!(
                "add: the disk's socket is not a socket: {}",
                io::Error::last_os_error()
            ));
        }
        Ok(v)
    };
    if opt(libc::SO_DOMAIN)? != libc::AF_UNIX || opt(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return Err("add: the disk's socket is not a Unix stream socket".into());
    }
    if opt(libc::SO_ACCEPTCONN)? != 1 {
        return Err("add: the disk's socket does not listen (bind it and listen first)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client whose request is already sent when every answering slot is taken reads
    /// the busy answer (it read ECONNRESET: the request left unread reset the socket).
    #[test]
    fn a_busy_answer_reaches_a_client_that_already_sent_its_request() {
        let (server, mut client) = UnixStream::pair().unwrap();
        client.write_all(b"{\"op\":\"list\"}\n").unwrap();
        refuse_busy(server);
        let mut answer = String::new();
        client.read_to_string(&mut answer).unwrap();
        assert!(answer.contains("busy: 16 requests"), "{answer}");
    }

    /// Only a listening Unix stream socket is taken as a disk's socket (an unbound one
    /// was, and its disk's failure to accept stopped the daemon).
    #[test]
    fn a_disks_socket_must_listen() {
        let dir = tempfile::tempdir().unwrap();
        let listening = UnixListener::bind(dir.path().join("l.sock")).unwrap();
        let as_file = |fd: std::os::fd::OwnedFd| File::from(fd);
        assert_eq!(
            check_listener(&as_file(listening.try_clone().unwrap().into())),
            Ok(())
        );
        let (a, _b) = UnixStream::pair().unwrap();
        let e = check_listener(&as_file(a.into())).unwrap_err();
        assert!(e.contains("does not listen"), "{e}");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = check_listener(&as_file(udp.into())).unwrap_err();
        assert!(e.contains("not a Unix stream socket"), "{e}");
        let plain = File::open("/dev/null").unwrap();
        let e = check_listener(&plain).unwrap_err();
        assert!(e.contains("is not a socket"), "{e}");
    }
}
