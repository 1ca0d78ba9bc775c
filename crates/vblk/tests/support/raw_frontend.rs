//! A raw vhost-user frontend, for tests that must send what no real frontend would.
//!
//! Messages are encoded by hand (header: request u32, flags u32, size u32; then the
//! payload; file descriptors in SCM_RIGHTS), so any field can be wrong. Every read is
//! bounded by [`REPLY_TIMEOUT`]: a device that does not answer is reported, never waited
//! on. Guest memory and rings are in [`super::raw_ring`].
//!
//! Layouts follow QEMU's docs/interop/vhost-user.rst.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The most the device may take to answer one message.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Request codes (frontend to backend).
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
}

/// Header flags: the version (bits 0-1), REPLY, NEED_REPLY.
pub const VERSION: u32 = 0x1;
pub const REPLY: u32 = 0x4;
pub const NEED_REPLY: u32 = 0x8;
/// The largest message the protocol allows (header excluded).
pub const MAX_MSG_SIZE: u32 = 0x1000;
/// SET_VRING_KICK/CALL/ERR: no fd attached (poll instead).
pub const NO_FD: u64 = 0x100;

/// Virtio feature bits used here.
pub const VERSION_1: u64 = 1 << 32;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;

/// Protocol feature bits.
pub mod pf {
    pub const MQ: u64 = 1 << 0;
    pub const LOG_SHMFD: u64 = 1 << 1;
    pub const REPLY_ACK: u64 = 1 << 3;
    pub const CONFIG: u64 = 1 << 9;
    pub const INFLIGHT_SHMFD: u64 = 1 << 12;
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
}

// ---- payload encoders ----

pub fn u64p(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// VhostUserVringState: index, num.
pub fn state(index: u32, num: u32) -> Vec<u8> {
    [index.to_le_bytes(), num.to_le_bytes()].concat()
}

/// VhostUserVringAddr: index, flags, descriptor, used, available, log (frontend addresses).
pub fn vring_addr(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut p = [index.to_le_bytes(), 0u32.to_le_bytes()].concat();
    for a in [desc, used, avail, 0] {
        p.extend_from_slice(&a.to_le_bytes());
    }
    p
}

/// One memory region as the frontend describes it.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    pub gpa: u64,
    pub size: u64,
    pub uaddr: u64,
    pub offset: u64,
}

impl Region {
    fn bytes(&self) -> Vec<u8> {
        [self.gpa, self.size, self.uaddr, self.offset]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }
}

/// SET_MEM_TABLE: num_regions u32, padding u32, then the regions.
pub fn mem_table(num_regions: u32, regions: &[Region]) -> Vec<u8> {
    let mut p = [num_regions.to_le_bytes(), 0u32.to_le_bytes()].concat();
    for r in regions {
        p.extend(r.bytes());
    }
    p
}

/// ADD_MEM_REG / REM_MEM_REG: padding u64, then one region.
pub fn single_region(r: &Region) -> Vec<u8> {
    [vec![0u8; 8], r.bytes()].concat()
}

/// GET_CONFIG / SET_CONFIG: offset, size, flags, then `data`.
pub fn config(offset: u32, size: u32, data: &[u8]) -> Vec<u8> {
    let mut p = [offset.to_le_bytes(), size.to_le_bytes(), 0u32.to_le_bytes()].concat();
    p.extend_from_slice(data);
    p
}

/// A little-endian u64 from the start of `p`, if it holds exactly eight bytes.
pub fn as_u64(p: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(p.try_into().ok()?))
}

// ---- the connection ----

/// What the device did with a message that needs an answer.
#[derive(Debug)]
pub enum Answer {
    /// A reply with this payload.
    Reply(Vec<u8>),
    /// The connection was closed (or reset) instead.
    Closed(String),
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Reply(p) => match as_u64(p) {
                Some(v) => write!(f, "reply {v:#x}"),
                None => write!(f, "reply of {} bytes", p.len()),
            },
            Answer::Closed(how) => write!(f, "connection closed ({how})"),
        }
    }
}

/// One connection to the device, spoken to byte by byte.
pub struct Conn {
    sock: UnixStream,
    closed: Option<String>,
    /// Virtio features the device offered.
    pub features: u64,
    /// Protocol features negotiated.
    pub protocol: u64,
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

impl Conn {
    /// Connect, retrying for a while if the socket is not listening yet.
    pub fn connect(path: &Path) -> Result<Conn, String> {
        let deadline = Instant::now() + REPLY_TIMEOUT;
        let sock = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() < deadline && e.kind() != io::ErrorKind::PermissionDenied =>
                {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(format!("cannot connect to {}: {e}", path.display())),
            }
        };
        sock.set_read_timeout(Some(REPLY_TIMEOUT)).unwrap();
        sock.set_write_timeout(Some(REPLY_TIMEOUT)).unwrap();
        Ok(Conn {
            sock,
            closed: None,
            features: 0,
            protocol: 0,
        })
    }

    /// Whether protocol feature `bit` was negotiated.
    pub fn has(&self, bit: u64) -> bool {
        self.protocol & bit != 0
    }

    /// Send raw bytes, with `fds` attached to the first of them.
    pub fn send_bytes(&mut self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let sent = if fds.is_empty() {
            0
        } else {
            self.sock
                .send_with_fds(&[bytes], fds)
                .map_err(|e| io::Error::from_raw_os_error(e.errno()))?
        };
        self.sock.write_all(&bytes[sent..])
    }

    /// Send a message whose header says `size`, whatever the payload's length.
    pub fn send_sized(
        &mut self,
        req: u32,
        flags: u32,
        size: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> io::Result<()> {
        let mut m = [req.to_le_bytes(), flags.to_le_bytes(), size.to_le_bytes()].concat();
        m.extend_from_slice(payload);
        self.send_bytes(&m, fds)
    }

    /// Send a well-framed message.
    pub fn send(&mut self, req: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        self.send_sized(req, flags, payload.len() as u32, payload, fds)
    }

    /// Read and drop whatever the device sends until it closes the connection; an error
    /// if it has not within `within`.
    pub fn wait_closed(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the device kept the connection open for more than {within:?}"
                ));
            }
            self.sock
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match self.sock.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if is_closed(&e) => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(format!("reading: {e}")),
            }
        }
    }

    /// Send without waiting: false once the socket's buffer is full.
    pub fn send_nowait(&mut self, bytes: &[u8]) -> bool {
        // SAFETY: sends a live buffer of its length; MSG_DONTWAIT never blocks.
        let n = unsafe {
            libc::send(
                self.sock.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        n == bytes.len() as isize
    }

    /// Shut both directions down (the daemon sees the frontend leave).
    pub fn close(self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Read the reply to `req`: Ok(Closed) if the device closed the connection; Err if it
    /// did not answer in time or answered something malformed.
    pub fn recv(&mut self, req: u32) -> Result<Answer, String> {
        if let Some(how) = &self.closed {
            return Ok(Answer::Closed(how.clone()));
        }
        let mut hdr = [0u8; 12];
        let mut got = 0;
        while got < hdr.len() {
            match self.sock.read(&mut hdr[got..]) {
                Ok(0) if got == 0 => return Ok(self.mark_closed("EOF")),
                Ok(0) => return Err(format!("reply header cut after {got} bytes")),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_closed(&e) && got == 0 => return Ok(self.mark_closed(&e.to_string())),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(format!(
                        "no answer to request {req} within {REPLY_TIMEOUT:?} (hung)"
                    ))
                }
                Err(e) => return Err(format!("reading the reply to request {req}: {e}")),
            }
        }
        let word = |i: usize| u32::from_le_bytes(hdr[i * 4..i * 4 + 4].try_into().unwrap());
        let (code, flags, size) = (word(0), word(1), word(2));
        if code != req || flags & 0x3 != VERSION || flags & REPLY == 0 || size > MAX_MSG_SIZE {
            return Err(format!(
                "malformed reply to request {req}: code {code}, flags {flags:#x}, size {size}"
            ));
        }
        let mut payload = vec![0u8; size as usize];
        self.sock
            .read_exact(&mut payload)
            .map_err(|e| format!("reply to request {req}: payload of {size} bytes: {e}"))?;
        Ok(Answer::Reply(payload))
    }

    fn mark_closed(&mut self, how: &str) -> Answer {
        self.closed = Some(how.to_string());
        Answer::Closed(how.to_string())
    }

    /// Send `req` asking for an answer (NEED_REPLY) and read it.
    pub fn call(&mut self, req: u32, payload: &[u8], fds: &[RawFd]) -> Result<Answer, String> {
        self.call_flags(req, VERSION | NEED_REPLY, payload, fds)
    }

    /// Like [`Conn::call`], with the header flags given.
    pub fn call_flags(
        &mut self,
        req: u32,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<Answer, String> {
        if let Some(how) = &self.closed {
            return Ok(Answer::Closed(how.clone()));
        }
        match self.send(req, flags, payload, fds) {
            Ok(()) => self.recv(req),
            Err(e) if is_closed(&e) => Ok(self.mark_closed(&e.to_string())),
            Err(e) => Err(format!("sending request {req}: {e}")),
        }
    }

    /// A valid request: it must be acknowledged with 0.
    pub fn ok(
        &mut self,
        what: &str,
        req: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<(), String> {
        match self.call(req, payload, fds)? {
            Answer::Reply(p) if as_u64(&p) == Some(0) => Ok(()),
            a => Err(format!("valid {what} was not acknowledged: {a}")),
        }
    }

    /// A bad request: it must be refused (a non-zero ack) or the connection closed.
    pub fn refused(
        &mut self,
        what: &str,
        req: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<(), String> {
        match self.call(req, payload, fds)? {
            Answer::Closed(_) => Ok(()),
            Answer::Reply(p) => match as_u64(&p) {
                Some(0) => Err(format!("{what}: accepted (acknowledged with 0)")),
                Some(_) => Ok(()),
                None => Err(format!(
                    "{what}: answered with a {}-byte reply, not an ack",
                    p.len()
                )),
            },
        }
    }

    /// A request with a reply of its own: the payload, or an error if there is none.
    pub fn get(&mut self, what: &str, req: u32, payload: &[u8]) -> Result<Vec<u8>, String> {
        match self.call_flags(req, VERSION, payload, &[])? {
            Answer::Reply(p) => Ok(p),
            a => Err(format!("{what}: {a}")),
        }
    }

    /// A u64 reply.
    pub fn get_u64(&mut self, what: &str, req: u32) -> Result<u64, String> {
        let p = self.get(what, req, &[])?;
        as_u64(&p).ok_or_else(|| format!("{what}: a {}-byte reply, not a u64", p.len()))
    }

    /// Still answering? GET_FEATURES must get a reply (or the connection be closed) in time.
    pub fn responsive(&mut self) -> Result<(), String> {
        self.call_flags(req::GET_FEATURES, VERSION, &[], &[])
            .map(|_| ())
            .map_err(|e| format!("the control socket stopped answering: {e}"))
    }
}

/// Connect and negotiate like QEMU: SET_OWNER, GET_FEATURES, GET_PROTOCOL_FEATURES,
/// SET_PROTOCOL_FEATURES (REPLY_ACK and what of `want` is offered), and, when
/// `set_features`, SET_FEATURES (VERSION_1 | PROTOCOL_FEATURES).
pub fn handshake(path: &Path, want: u64, set_features: bool) -> Result<Conn, String> {
    let mut c = Conn::connect(path)?;
    c.send(req::SET_OWNER, VERSION, &[], &[])
        .map_err(|e| format!("SET_OWNER: {e}"))?;
    c.features = c.get_u64("GET_FEATURES", req::GET_FEATURES)?;
    let need = VERSION_1 | F_PROTOCOL_FEATURES;
    if c.features & need != need {
        return Err(format!(
            "the device offers {:#x}, without VERSION_1 or PROTOCOL_FEATURES",
            c.features
        ));
    }
    let offered = c.get_u64("GET_PROTOCOL_FEATURES", req::GET_PROTOCOL_FEATURES)?;
    if offered & pf::REPLY_ACK == 0 {
        return Err(format!(
            "the device offers protocol features {offered:#x}, without REPLY_ACK"
        ));
    }
    c.protocol = offered & (want | pf::REPLY_ACK);
    // Like QEMU, without NEED_REPLY: whether the message that turns REPLY_ACK on is itself
    // acknowledged is not settled.
    c.send(req::SET_PROTOCOL_FEATURES, VERSION, &u64p(c.protocol), &[])
        .map_err(|e| format!("SET_PROTOCOL_FEATURES: {e}"))?;
    if set_features {
        c.ok("SET_FEATURES", req::SET_FEATURES, &u64p(need), &[])?;
    }
    Ok(c)
}
