//! Connecting and the fixed newstyle handshake: `NBD_OPT_GO` asking for
//! `NBD_INFO_BLOCK_SIZE`, falling back to `NBD_OPT_EXPORT_NAME` when the server does not
//! know GO (or is not fixed newstyle). Any other error answer to GO is reported by its
//! `NBD_REP_ERR_*` name and the server's message; with `NBD_REP_ERR_UNKNOWN` the server's
//! list of exports (`NBD_OPT_LIST`) is asked for too, and the export is said to be missing
//! only when the list does not name it (nbdkit answers UNKNOWN when its plugin fails to
//! open an export it lists). Only simple replies are negotiated.
//!
//! A connection attempt is blocking code with one deadline for all of it: the name lookup
//! (on a helper thread, since `getaddrinfo` cannot be interrupted: past the deadline the
//! attempt gives up and the thread ends on its own), the connect (non-blocking, then
//! `poll`), and every read and write of the handshake (non-blocking, `poll` for what is
//! left of the deadline), so a server that trickles its handshake a byte at a time is
//! given up on as surely as a silent one.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::sys::os_err;
use super::wire::*;
use super::{NbdAddr, NbdError, NbdSpec};

/// What the handshake learnt about the export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// Minimum block size (1 when the server states none).
    pub min_block: u32,
    /// Preferred block size (4096 when the server states none).
    pub pref_block: u32,
    /// Largest payload of a request (32 MiB when the server states none).
    pub max_payload: u32,
}

impl ExportInfo {
    /// Whether the server sets transmission flag `f`.
    pub fn has(&self, f: u16) -> bool {
        self.flags & FLAG_HAS_FLAGS != 0 && self.flags & f != 0
    }
}

/// Connects to the server and negotiates `spec`'s export, all within `limit`; the socket
/// comes back non-blocking.
pub(crate) fn connect(spec: &NbdSpec, limit: Duration) -> Result<(OwnedFd, ExportInfo), NbdError> {
    let deadline = Instant::now() + limit;
    let failed = |during: &'static str, source: io::Error| {
        if source.kind() == io::ErrorKind::TimedOut {
            NbdError::Timeout { during, limit }
        } else {
            NbdError::Connect { source }
        }
    };
    let fd = match &spec.addr {
        NbdAddr::Unix(path) => connect_unix(path, deadline).map_err(|e| failed("connecting", e))?,
        NbdAddr::Tcp { host, port } => {
            let addrs = resolve(host, *port, deadline).map_err(|e| failed("the name lookup", e))?;
            connect_tcp(&addrs, deadline).map_err(|e| failed("connecting", e))?
        }
    };
    let mut s = Timed { fd, deadline };
    let info = negotiate(&mut s, &spec.export).map_err(|e| match e {
        NbdError::Io { during, source } if source.kind() == io::ErrorKind::TimedOut => {
            NbdError::Timeout { during, limit }
        }
        e => e,
    })?;
    Ok((s.fd, info))
}

/// What is left until `deadline`; `TimedOut` when nothing is.
fn left(deadline: Instant) -> io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    Ok(d)
}

/// Names looked up so far, and what they gave: a name is looked up once per process, the
/// first time (when the disk is opened, before `vblk serve` confines itself: afterwards
/// the files a lookup reads, /etc/hosts and /etc/resolv.conf, cannot be opened), and
/// reconnections use the addresses found then.
static RESOLVED: std::sync::Mutex<Vec<Resolved>> = std::sync::Mutex::new(Vec::new());

/// A name and port, and the addresses they gave.
type Resolved = ((String, u16), Vec<SocketAddr>);

/// The addresses of `host`; a name is looked up on a helper thread, given up on at
/// `deadline`, and only once per process (see [`RESOLVED`]).
fn resolve(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let key = (host.to_owned(), port);
    if let Some((_, a)) = RESOLVED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .find(|(k, _)| *k == key)
    {
        return Ok(a.clone());
    }
    let found = lookup(host, port, deadline)?;
    if !found.is_empty() {
        RESOLVED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((key, found.clone()));
    }
    Ok(found)
}

/// A lookup on a helper thread, given up on at `deadline`.
fn lookup(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let name = host.to_owned();
    std::thread::Builder::new()
        .name("nbd-resolve".into())
        .spawn(move || {
            let r = (name.as_str(), port)
                .to_socket_addrs()
                .map(|a| a.collect::<Vec<_>>());
            let _ = tx.send(r);
        })?;
    match rx.recv_timeout(left(deadline)?) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(io::ErrorKind::TimedOut.into()),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(io::Error::other(
            "the name lookup thread ended without an answer",
        )),
    }
}

/// The first of `addrs` that accepts a connection before `deadline`.
fn connect_tcp(addrs: &[SocketAddr], deadline: Instant) -> io::Result<OwnedFd> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
    for a in addrs {
        match TcpStream::connect_timeout(a, left(deadline)?) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
                return Ok(s.into());
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => return Err(e),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// A non-blocking connection to the Unix socket `path`, made before `deadline` (a
/// listener whose backlog is full answers EAGAIN: tried again every 10 ms).
fn connect_unix(path: &Path, deadline: Instant) -> io::Result<OwnedFd> {
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path of {} bytes (at most {})",
                bytes.len(),
                addr.sun_path.len() - 1
            ),
        ));
    }
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    // SAFETY: plain syscall; flags are valid.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if raw < 0 {
        return Err(os_err());
    }
    // SAFETY: socket just returned this descriptor; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    loop {
        // SAFETY: a live, initialized sockaddr_un and its size.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            return Ok(fd);
        }
        let e = os_err();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => {
                std::thread::sleep(left(deadline)?.min(Duration::from_millis(10)));
            }
            Some(libc::EINPROGRESS) => {
                wait(&fd, libc::POLLOUT, deadline)?;
                let mut err: libc::c_int = 0;
                let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: reads an int-sized option into a live local.
                let rc = unsafe {
                    libc::getsockopt(
                        fd.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_ERROR,
                        (&mut err as *mut libc::c_int).cast(),
                        &mut len,
                    )
                };
                if rc != 0 {
                    return Err(os_err());
                }
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
                return Ok(fd);
            }
            _ => return Err(e),
        }
    }
}

/// Waits until `fd` is ready for `events`, at most until `deadline`.
fn wait(fd: &OwnedFd, events: i16, deadline: Instant) -> io::Result<()> {
    loop {
        let ms = left(deadline)?
            .as_micros()
            .div_ceil(1000)
            .min(i32::MAX as u128) as i32;
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = os_err();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// A non-blocking socket read and written as a blocking one, until a deadline: then every
/// call fails with `TimedOut`.
struct Timed {
    fd: OwnedFd,
    deadline: Instant,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // SAFETY: receives into a live buffer of `buf.len()` bytes.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = os_err();
            match e.kind() {
                io::ErrorKind::WouldBlock => wait(&self.fd, libc::POLLIN, self.deadline)?,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
        }
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            // SAFETY: sends from a live buffer of `buf.len()` bytes.
            let n = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    buf.as_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = os_err();
            match e.kind() {
                io::ErrorKind::WouldBlock => wait(&self.fd, libc::POLLOUT, self.deadline)?,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Reads exactly `buf.len()` bytes; an early end is `Closed`.
fn read_all(f: &mut impl Read, buf: &mut [u8], during: &'static str) -> Result<(), NbdError> {
    f.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => NbdError::Closed { during },
        _ => NbdError::Io { during, source: e },
    })
}

fn read_u64(f: &mut impl Read, during: &'static str) -> Result<u64, NbdError> {
    let mut b = [0u8; 8];
    read_all(f, &mut b, during)?;
    Ok(u64::from_be_bytes(b))
}

fn read_u32(f: &mut impl Read, during: &'static str) -> Result<u32, NbdError> {
    let mut b = [0u8; 4];
    read_all(f, &mut b, during)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u16(f: &mut impl Read, during: &'static str) -> Result<u16, NbdError> {
    let mut b = [0u8; 2];
    read_all(f, &mut b, during)?;
    Ok(u16::from_be_bytes(b))
}

fn send(f: &mut impl Write, buf: &[u8], during: &'static str) -> Result<(), NbdError> {
    f.write_all(buf)
        .map_err(|source| NbdError::Io { during, source })
}

fn send_option(f: &mut impl Write, opt: u32, data: &[u8]) -> Result<(), NbdError> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    send(f, &b, "option")
}

/// One option reply: its type and data (at most 64 KiB kept).
fn option_reply(f: &mut impl Read, opt: u32) -> Result<(u32, Vec<u8>), NbdError> {
    const DURING: &str = "option reply";
    let magic = read_u64(f, DURING)?;
    if magic != REP_MAGIC {
        return Err(NbdError::Protocol(format!(
            "option reply magic {magic:#x}, expected {REP_MAGIC:#x}"
        )));
    }
    let got = read_u32(f, DURING)?;
    if got != opt {
        return Err(NbdError::Protocol(format!(
            "reply for option {got} while option {opt} was asked"
        )));
    }
    let rep = read_u32(f, DURING)?;
    let len = read_u32(f, DURING)? as usize;
    if len > 1 << 16 {
        return Err(NbdError::Protocol(format!(
            "option reply of {len} bytes (at most 65536 expected)"
        )));
    }
    let mut data = vec![0u8; len];
    read_all(f, &mut data, DURING)?;
    Ok((rep, data))
}

/// The newstyle handshake on a connected socket.
pub(crate) fn negotiate<S: Read + Write>(f: &mut S, export: &str) -> Result<ExportInfo, NbdError> {
    const DURING: &str = "greeting";
    let magic = read_u64(f, DURING)?;
    if magic != INIT_MAGIC {
        return Err(NbdError::Protocol(format!(
            "greeting magic {magic:#x}, expected NBDMAGIC ({INIT_MAGIC:#x}): not an NBD server?"
        )));
    }
    let magic = read_u64(f, DURING)?;
    if magic == OLDSTYLE_MAGIC {
        return Err(NbdError::Protocol(
            "the server speaks the oldstyle handshake, which vblk does not".into(),
        ));
    }
    if magic != OPTS_MAGIC {
        return Err(NbdError::Protocol(format!(
            "newstyle magic {magic:#x}, expected IHAVEOPT ({OPTS_MAGIC:#x})"
        )));
    }
    let hflags = read_u16(f, DURING)?;
    let fixed = hflags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
    let mut cflags = 0u32;
    if fixed {
        cflags |= FLAG_C_FIXED_NEWSTYLE;
    }
    if no_zeroes {
        cflags |= FLAG_C_NO_ZEROES;
    }
    send(f, &cflags.to_be_bytes(), DURING)?;
    if fixed {
        if let Some(info) = go(f, export)? {
            return Ok(info);
        }
    }
    export_name(f, export, no_zeroes)
}

/// `NBD_OPT_GO`; `None` when the server does not support it.
fn go<S: Read + Write>(f: &mut S, export: &str) -> Result<Option<ExportInfo>, NbdError> {
    let name = export.as_bytes();
    if name.len() > 4096 {
        return Err(NbdError::Protocol(format!(
            "export name of {} bytes (NBD allows 4096)",
            name.len()
        )));
    }
    let mut data = Vec::with_capacity(8 + name.len());
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    send_option(f, OPT_GO, &data)?;
    let mut size_flags = None;
    let mut block = None;
    loop {
        let (rep, data) = option_reply(f, OPT_GO)?;
        match rep {
            REP_ACK => break,
            REP_INFO if data.len() >= 2 => {
                let kind = u16::from_be_bytes([data[0], data[1]]);
                match kind {
                    INFO_EXPORT if data.len() == 12 => {
                        let size = u64::from_be_bytes(data[2..10].try_into().unwrap_or([0; 8]));
                        let flags = u16::from_be_bytes([data[10], data[11]]);
                        size_flags = Some((size, flags));
                    }
                    INFO_BLOCK_SIZE if data.len() == 14 => {
                        let at = |i: usize| {
                            u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]])
                        };
                        block = Some((at(2), at(6), at(10)));
                    }
                    INFO_EXPORT | INFO_BLOCK_SIZE => {
                        return Err(NbdError::Protocol(format!(
                            "NBD_REP_INFO type {kind} of {} bytes",
                            data.len()
                        )))
                    }
                    _ => {}
                }
            }
            REP_INFO => {
                return Err(NbdError::Protocol("empty NBD_REP_INFO".into()));
            }
            REP_ERR_UNSUP => return Ok(None),
            rep if rep & REP_FLAG_ERROR != 0 => return Err(refused(f, export, rep, &data)),
            other => {
                return Err(NbdError::Protocol(format!(
                    "unexpected reply type {other:#x} to NBD_OPT_GO"
                )))
            }
        }
    }
    let (size, flags) = size_flags.ok_or_else(|| {
        NbdError::Protocol("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into())
    })?;
    let (min_block, pref_block, max_payload) = match block {
        Some((min, pref, max)) => (min, pref, max),
        None => (1, 4096, DEFAULT_MAX_PAYLOAD),
    };
    Ok(Some(ExportInfo {
        size,
        flags,
        min_block,
        pref_block,
        max_payload,
    }))
}

/// The error for an error reply `rep` (with `data`) to `NBD_OPT_GO` for `export`. Only
/// `NBD_REP_ERR_UNKNOWN` means "no such export", and only when the server's list does
/// not name it: nbdkit answers so for an export it lists when its plugin fails to open it.
fn refused<S: Read + Write>(f: &mut S, export: &str, rep: u32, data: &[u8]) -> NbdError {
    let message = String::from_utf8_lossy(data).into_owned();
    let exports = if rep == REP_ERR_UNKNOWN {
        list(f).ok()
    } else {
        None
    };
    let _ = send_option(f, OPT_ABORT, &[]);
    match exports {
        Some(l) if l.iter().any(|n| n == export) => NbdError::GoRefused {
            export: export.to_owned(),
            reply: rep_name(rep),
            message,
            listed: Some(l),
        },
        Some(l) => NbdError::NoExport {
            name: export.to_owned(),
            exports: l,
            message,
        },
        None if rep == REP_ERR_UNKNOWN => NbdError::NoExport {
            name: export.to_owned(),
            exports: Vec::new(),
            message,
        },
        None => NbdError::GoRefused {
            export: export.to_owned(),
            reply: rep_name(rep),
            message,
            listed: None,
        },
    }
}

/// `NBD_OPT_LIST`: the names of the server's exports (as far as it lists them: an error
/// reply ends the list).
fn list<S: Read + Write>(f: &mut S) -> Result<Vec<String>, NbdError> {
    send_option(f, OPT_LIST, &[])?;
    let mut names = Vec::new();
    loop {
        let (rep, data) = option_reply(f, OPT_LIST)?;
        match rep {
            REP_SERVER if data.len() >= 4 => {
                let n = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) as usize;
                let name = data.get(4..4 + n).unwrap_or_default();
                names.push(String::from_utf8_lossy(name).into_owned());
            }
            REP_ACK => return Ok(names),
            _ => return Ok(names),
        }
    }
}

/// `NBD_OPT_EXPORT_NAME`: the old way; a server that has no such export just hangs up.
fn export_name<S: Read + Write>(
    f: &mut S,
    export: &str,
    no_zeroes: bool,
) -> Result<ExportInfo, NbdError> {
    send_option(f, OPT_EXPORT_NAME, export.as_bytes())?;
    let during =
        "NBD_OPT_EXPORT_NAME (the server closes the connection when it has no such export)";
    let size = read_u64(f, during)?;
    let flags = read_u16(f, during)?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        read_all(f, &mut zeroes, during)?;
    }
    Ok(ExportInfo {
        size,
        flags,
        min_block: 1,
        pref_block: 4096,
        max_payload: DEFAULT_MAX_PAYLOAD,
    })
}
