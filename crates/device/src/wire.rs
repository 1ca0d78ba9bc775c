//! vhost-user messages on the socket (QEMU docs/interop/vhost-user.rst): reading one
//! request with its file descriptors, decoding its payload, writing replies, and sending
//! the backend's own requests on the backend channel.
//!
//! A message is a 12-byte header (request code, flags, payload size), the payload (at most
//! [`MAX_PAYLOAD`] bytes) and, for some requests, file descriptors in the ancillary data of
//! the header's bytes. Everything is little-endian and decoded field by field from bytes:
//! nothing the frontend sends is cast into a Rust type. A message that is malformed
//! (wrong version, a reply where a request belongs, more payload than allowed, file
//! descriptors where none belong) is an error that ends the connection; the fds that came
//! with it are closed.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Largest payload accepted (the `vhost` crate's and QEMU's bound).
pub(crate) const MAX_PAYLOAD: usize = 0x1000;
/// Most file descriptors one message may carry.
const MAX_FDS: usize = 32;
const HEADER_LEN: usize = 12;
/// Header flags.
const VERSION: u32 = 0x1;
const VERSION_MASK: u32 = 0x3;
const FLAG_REPLY: u32 = 0x4;
const FLAG_NEED_REPLY: u32 = 0x8;
/// The "no file descriptor" bit of a vring fd message (SET_VRING_KICK/CALL/ERR).
pub(crate) const VRING_NOFD: u64 = 0x100;

/// Request codes (frontend to backend).
pub(crate) mod req {
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
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;

    /// A name for logs.
    pub fn name(code: u32) -> &'static str {
        match code {
            GET_FEATURES => "GET_FEATURES",
            SET_FEATURES => "SET_FEATURES",
            SET_OWNER => "SET_OWNER",
            RESET_OWNER => "RESET_OWNER",
            SET_MEM_TABLE => "SET_MEM_TABLE",
            SET_LOG_BASE => "SET_LOG_BASE",
            SET_LOG_FD => "SET_LOG_FD",
            SET_VRING_NUM => "SET_VRING_NUM",
            SET_VRING_ADDR => "SET_VRING_ADDR",
            SET_VRING_BASE => "SET_VRING_BASE",
            GET_VRING_BASE => "GET_VRING_BASE",
            SET_VRING_KICK => "SET_VRING_KICK",
            SET_VRING_CALL => "SET_VRING_CALL",
            SET_VRING_ERR => "SET_VRING_ERR",
            GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
            SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
            GET_QUEUE_NUM => "GET_QUEUE_NUM",
            SET_VRING_ENABLE => "SET_VRING_ENABLE",
            SET_BACKEND_REQ_FD => "SET_BACKEND_REQ_FD",
            GET_CONFIG => "GET_CONFIG",
            SET_CONFIG => "SET_CONFIG",
            GET_INFLIGHT_FD => "GET_INFLIGHT_FD",
            SET_INFLIGHT_FD => "SET_INFLIGHT_FD",
            RESET_DEVICE => "RESET_DEVICE",
            GET_MAX_MEM_SLOTS => "GET_MAX_MEM_SLOTS",
            ADD_MEM_REG => "ADD_MEM_REG",
            REM_MEM_REG => "REM_MEM_REG",
            _ => "unknown request",
        }
    }
}

/// Backend-to-frontend request codes (the backend channel).
const BACKEND_CONFIG_CHANGE_MSG: u32 = 2;

/// VHOST_F_LOG_ALL, the virtio feature bit (26) a frontend sets to turn dirty logging on.
pub(crate) const VHOST_F_LOG_ALL: u64 = 1 << 26;
/// SET_VRING_ADDR flag: log the ring's used-ring writes at `log_guest_addr`.
pub(crate) const VRING_F_LOG: u32 = 1;

/// Protocol feature bits.
pub(crate) mod protocol {
    pub const MQ: u64 = 1 << 0;
    pub const LOG_SHMFD: u64 = 1 << 1;
    pub const REPLY_ACK: u64 = 1 << 3;
    pub const BACKEND_REQ: u64 = 1 << 5;
    pub const CONFIG: u64 = 1 << 9;
    pub const INFLIGHT_SHMFD: u64 = 1 << 12;
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
}

/// What can go wrong with the connection itself.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error("the frontend disconnected")]
    Disconnected,
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    /// A read or write on the socket ran out of its deadline (SO_RCVTIMEO/SO_SNDTIMEO).
    #[error("the frontend {0} within {timeout:?}", timeout = crate::disk::MESSAGE_TIMEOUT)]
    Deadline(&'static str),
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// One request from the frontend.
#[derive(Debug)]
pub(crate) struct Message {
    pub code: u32,
    flags: u32,
    pub payload: Vec<u8>,
    pub fds: Vec<File>,
}

impl Message {
    /// The frontend asked for an ack (REPLY_ACK).
    pub(crate) fn need_reply(&self) -> bool {
        self.flags & FLAG_NEED_REPLY != 0
    }

    fn malformed(&self, what: impl std::fmt::Display) -> WireError {
        WireError::Malformed(format!("{} ({}): {what}", req::name(self.code), self.code))
    }

    /// The payload must be exactly `len` bytes.
    pub(crate) fn expect_len(&self, len: usize) -> Result<(), WireError> {
        if self.payload.len() != len {
            return Err(self.malformed(format_args!(
                "payload of {} bytes, expected {len}",
                self.payload.len()
            )));
        }
        Ok(())
    }

    /// The message must carry `n` file descriptors.
    pub(crate) fn expect_fds(&self, n: usize) -> Result<(), WireError> {
        if self.fds.len() != n {
            return Err(self.malformed(format_args!(
                "{} file descriptors, expected {n}",
                self.fds.len()
            )));
        }
        Ok(())
    }

    /// A little-endian u64 payload.
    pub(crate) fn u64(&self) -> Result<u64, WireError> {
        self.expect_len(8)?;
        Ok(le64(&self.payload, 0))
    }

    /// A vring state payload: (index, num).
    pub(crate) fn state(&self) -> Result<(u32, u32), WireError> {
        self.expect_len(8)?;
        Ok((le32(&self.payload, 0), le32(&self.payload, 4)))
    }

    /// An error for a payload that cannot be what it claims.
    pub(crate) fn bad(&self, what: impl std::fmt::Display) -> WireError {
        self.malformed(what)
    }
}

/// A little-endian u32 at `off` (the caller checked the length).
pub(crate) fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// A little-endian u64 at `off` (the caller checked the length).
pub(crate) fn le64(b: &[u8], off: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(x)
}

/// A little-endian u16 at `off` (the caller checked the length).
pub(crate) fn le16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Which requests may carry file descriptors.
fn takes_fds(code: u32) -> bool {
    matches!(
        code,
        req::SET_MEM_TABLE
            | req::SET_LOG_BASE
            | req::SET_LOG_FD
            | req::SET_VRING_KICK
            | req::SET_VRING_CALL
            | req::SET_VRING_ERR
            | req::SET_BACKEND_REQ_FD
            | req::SET_INFLIGHT_FD
            | req::ADD_MEM_REG
            | req::REM_MEM_REG
    )
}

/// Read one request (blocking).
pub(crate) fn read_message(sock: &mut UnixStream) -> Result<Message, WireError> {
    let mut hdr = [0u8; HEADER_LEN];
    let mut raw_fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    }];
    // SAFETY: the iovec names `hdr`, a live local buffer of its length, which may receive
    // any bytes; `raw_fds` receives at most its length of descriptors.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut raw_fds) }.map_err(sys)?;
    // Own the fds first, so that every way out closes them.
    let mut fds: Vec<File> = raw_fds[..nfds]
        .iter()
        // SAFETY: the kernel just installed these descriptors for us; nothing else owns
        // them.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    if n == 0 {
        return Err(WireError::Disconnected);
    }
    if n < HEADER_LEN {
        sock.read_exact(&mut hdr[n..]).map_err(eof)?;
    }
    let code = le32(&hdr, 0);
    let flags = le32(&hdr, 4);
    let size = le32(&hdr, 8) as usize;
    let mut msg = Message {
        code,
        flags,
        payload: Vec::new(),
        fds: Vec::new(),
    };
    if flags & VERSION_MASK != VERSION {
        return Err(msg.malformed(format_args!("version bits {:#x}, expected 1", flags & 3)));
    }
    if flags & FLAG_REPLY != 0 {
        return Err(msg.malformed("a reply where a request belongs"));
    }
    if size > MAX_PAYLOAD {
        return Err(msg.malformed(format_args!(
            "payload of {size} bytes, more than {MAX_PAYLOAD}"
        )));
    }
    if !fds.is_empty() && !takes_fds(code) {
        return Err(msg.malformed(format_args!(
            "{} file descriptors on a request that takes none",
            fds.len()
        )));
    }
    msg.payload = vec![0u8; size];
    sock.read_exact(&mut msg.payload).map_err(eof)?;
    msg.fds = std::mem::take(&mut fds);
    Ok(msg)
}

fn sys(e: vmm_sys_util::errno::Error) -> WireError {
    eof(io::Error::from_raw_os_error(e.errno()))
}

/// A read's error: the end of the stream, a deadline the frontend let pass, or another.
fn eof(e: io::Error) -> WireError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => WireError::Disconnected,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            WireError::Deadline("did not finish its message")
        }
        _ => WireError::Io(e),
    }
}

/// A write's error: a deadline the frontend let pass (it reads no replies), or another.
fn unsent(e: io::Error) -> WireError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            WireError::Deadline("did not read the reply")
        }
        _ => WireError::Io(e),
    }
}

/// Send a reply to `msg` with `payload` (and `fd`, if any).
pub(crate) fn reply(
    sock: &mut UnixStream,
    msg: &Message,
    payload: &[u8],
    fd: Option<RawFd>,
) -> Result<(), WireError> {
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(&msg.code.to_le_bytes());
    buf.extend_from_slice(&(VERSION | FLAG_REPLY).to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    match fd {
        Some(fd) => {
            let n = sock
                .send_with_fds(&[&buf[..]], &[fd])
                .map_err(|e| unsent(io::Error::from_raw_os_error(e.errno())))?;
            if n < buf.len() {
                sock.write_all(&buf[n..]).map_err(unsent)?;
            }
        }
        None => sock.write_all(&buf).map_err(unsent)?,
    }
    Ok(())
}

/// Send a REPLY_ACK answer (0: success).
pub(crate) fn ack(sock: &mut UnixStream, msg: &Message, ok: bool) -> Result<(), WireError> {
    reply(sock, msg, &u64::from(!ok).to_le_bytes(), None)
}

/// The backend channel (SET_BACKEND_REQ_FD): requests the device sends the frontend.
#[derive(Debug)]
pub(crate) struct BackendChannel {
    sock: UnixStream,
}

impl BackendChannel {
    pub(crate) fn new(sock: UnixStream) -> BackendChannel {
        BackendChannel { sock }
    }

    /// Tell the frontend the configuration space changed
    /// (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG). No answer is asked for, as libvhost-user
    /// does: QEMU reads the new configuration (GET_CONFIG, on the main socket) before it
    /// would answer, and the daemon must be free to serve that read.
    ///
    /// The socket is the frontend's too (it passed it), so it may have changed its
    /// timeouts or flags: the message goes with MSG_DONTWAIT, whole or not at all. A
    /// frontend that does not read its channel loses the channel.
    pub(crate) fn config_changed(&mut self) -> io::Result<()> {
        let mut buf = [0u8; HEADER_LEN];
        buf[0..4].copy_from_slice(&BACKEND_CONFIG_CHANGE_MSG.to_le_bytes());
        buf[4..8].copy_from_slice(&VERSION.to_le_bytes());
        // SAFETY: sends a live local buffer of its length; never blocks (MSG_DONTWAIT).
        let n = unsafe {
            libc::send(
                self.sock.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != buf.len() {
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
            return Err(io::Error::other(format!(
                "the frontend's backend channel took {n} of {} bytes; channel closed",
                buf.len()
            )));
        }
        Ok(())
    }
}

/// Whether `f` is a connected Unix stream socket (what SET_BACKEND_REQ_FD must carry).
pub(crate) fn unix_stream(f: File) -> Option<UnixStream> {
    let fd = f.as_raw_fd();
    let get = |opt| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, a live c_int.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(v)
    };
    if get(libc::SO_DOMAIN)? != libc::AF_UNIX || get(libc::SO_TYPE)? != libc::SOCK_STREAM {
        return None;
    }
    Some(UnixStream::from(std::os::fd::OwnedFd::from(f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(sock: &mut UnixStream, code: u32, flags: u32, payload: &[u8], fds: &[RawFd]) {
        let mut buf = Vec::new();
        buf.extend_from_slice(&code.to_le_bytes());
        buf.extend_from_slice(&flags.to_le_bytes());
        buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        buf.extend_from_slice(payload);
        sock.send_with_fds(&[&buf[..]], fds).unwrap();
    }

    #[test]
    fn messages_are_framed_and_checked() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        send(
            &mut a,
            req::SET_FEATURES,
            1 | FLAG_NEED_REPLY,
            &7u64.to_le_bytes(),
            &[],
        );
        let m = read_message(&mut b).unwrap();
        assert_eq!((m.code, m.u64().unwrap(), m.need_reply()), (2, 7, true));

        let efd = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        send(
            &mut a,
            req::SET_VRING_CALL,
            1,
            &0u64.to_le_bytes(),
            &[efd.as_raw_fd()],
        );
        let m = read_message(&mut b).unwrap();
        assert_eq!(m.fds.len(), 1);

        send(&mut a, req::GET_FEATURES, 1, &[], &[efd.as_raw_fd()]);
        assert!(matches!(read_message(&mut b), Err(WireError::Malformed(_))));
        send(&mut a, req::GET_FEATURES, 2, &[], &[]);
        assert!(matches!(read_message(&mut b), Err(WireError::Malformed(_))));
        send(&mut a, req::GET_FEATURES, 1 | FLAG_REPLY, &[], &[]);
        assert!(matches!(read_message(&mut b), Err(WireError::Malformed(_))));
        let mut big = Vec::new();
        big.extend_from_slice(&req::SET_CONFIG.to_le_bytes());
        big.extend_from_slice(&1u32.to_le_bytes());
        big.extend_from_slice(&0x2000u32.to_le_bytes());
        a.write_all(&big).unwrap();
        assert!(matches!(read_message(&mut b), Err(WireError::Malformed(_))));
        drop(a);
        // The peer is gone: end of the connection, not an error to log loudly.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(&[1, 0, 0]).unwrap();
        drop(a);
        assert!(matches!(read_message(&mut b), Err(WireError::Disconnected)));
    }

    /// The frontend keeps a copy of the backend channel's socket, makes it blocking and
    /// lets it fill up: telling it about a config change returns at once with an error.
    #[test]
    fn a_full_backend_channel_never_blocks() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let frontend_copy = ours.try_clone().unwrap();
        frontend_copy.set_nonblocking(true).unwrap();
        let chunk = [0u8; 4096];
        while (&frontend_copy).write(&chunk).is_ok() {}
        frontend_copy.set_nonblocking(false).unwrap();
        frontend_copy.set_write_timeout(None).unwrap();
        let mut ch = BackendChannel::new(ours);
        let t0 = std::time::Instant::now();
        assert!(ch.config_changed().is_err());
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        drop(theirs);
    }
}
