//! vhost-user messages as a frontend writes them (QEMU docs/interop/vhost-user.rst),
//! encoded by hand so that any field can be wrong.

use std::io;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;

use std::os::fd::AsRawFd;

/// Request codes (`VhostUserRequest`).
#[allow(missing_docs)]
pub mod code {
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
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
    /// Codes the device has nothing to do with (net, crypto, postcopy, status, migration,
    /// GPU, shared objects): each must be refused without harm.
    pub const OTHERS: [u32; 19] = [
        19, 20, 21, 22, 23, 26, 27, 28, 29, 30, 33, 35, 39, 40, 41, 42, 43, 44, 45,
    ];
}

/// Header flags.
pub mod flags {
    /// Protocol version 1.
    pub const VERSION: u32 = 0x1;
    /// A reply (never from a frontend).
    pub const REPLY: u32 = 0x4;
    /// The frontend wants an ack (REPLY_ACK).
    pub const NEED_REPLY: u32 = 0x8;
}

/// One message to send.
#[derive(Debug, Default)]
pub struct Msg {
    /// Request code.
    pub code: u32,
    /// Header flags.
    pub flags: u32,
    /// Payload.
    pub payload: Vec<u8>,
    /// Size field, when it is not the payload's length.
    pub size: Option<u32>,
    /// File descriptors sent with it.
    pub fds: Vec<RawFd>,
}

impl Msg {
    /// A version-1 message with `payload`.
    pub fn new(code: u32, payload: Vec<u8>) -> Msg {
        Msg {
            code,
            flags: flags::VERSION,
            payload,
            ..Msg::default()
        }
    }

    /// The bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12 + self.payload.len());
        b.extend_from_slice(&self.code.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        let size = self.size.unwrap_or(self.payload.len() as u32);
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(&self.payload);
        b
    }

    /// Send it on `sock` in one `sendmsg` (header, payload and fds together, as QEMU
    /// does). Err(WouldBlock) when the socket buffer is full.
    pub fn send(&self, sock: &UnixStream) -> io::Result<()> {
        let bytes = self.encode();
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let fd_bytes = std::mem::size_of_val(self.fds.as_slice());
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
        // u64 elements: cmsghdr needs 8-byte alignment.
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !self.fds.is_empty() {
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: msg_control points at `space` bytes, enough for one cmsghdr carrying
            // `fd_bytes` of data (CMSG_SPACE); CMSG_FIRSTHDR/CMSG_DATA stay inside it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
                std::ptr::copy_nonoverlapping(
                    self.fds.as_ptr().cast::<u8>(),
                    libc::CMSG_DATA(c),
                    fd_bytes,
                );
            }
        }
        // SAFETY: msg points at the live iovec and control buffer above; the socket is ours.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != bytes.len() {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "partial send"));
        }
        Ok(())
    }
}

/// Little-endian payload building.
#[derive(Debug, Default)]
pub struct Payload(pub Vec<u8>);

impl Payload {
    /// Append a u16.
    pub fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Append a u32.
    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Append a u64.
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Append bytes.
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// One memory region as SET_MEM_TABLE, ADD_MEM_REG and REM_MEM_REG carry it.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    /// Guest physical address.
    pub gpa: u64,
    /// Size.
    pub size: u64,
    /// Frontend virtual address.
    pub user_addr: u64,
    /// Offset into the fd.
    pub offset: u64,
}

impl Region {
    /// Append it to `p`.
    pub fn put(&self, p: Payload) -> Payload {
        p.u64(self.gpa)
            .u64(self.size)
            .u64(self.user_addr)
            .u64(self.offset)
    }
}
