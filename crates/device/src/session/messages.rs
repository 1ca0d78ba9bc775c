//! Decoding each request's payload, calling the session's handler for it, and answering:
//! one arm per request, its payload and file descriptors checked at the top. Requests
//! that belong to a protocol feature are refused unless the frontend acked it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use log::debug;

use super::{refuse, Refusal, Session};
use crate::memory::{RegionDesc, MAX_MEM_SLOTS};
use crate::wire::{
    self, le16, le32, le64, protocol, req, Message, WireError, VRING_F_LOG, VRING_NOFD,
};

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionEnd {
    #[error("the frontend disconnected")]
    Disconnected,
    #[error("{0}")]
    Wire(WireError),
    #[error("request refused: {0}")]
    Refused(String),
}

impl From<WireError> for SessionEnd {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Disconnected => SessionEnd::Disconnected,
            e => SessionEnd::Wire(e),
        }
    }
}

/// How a request went.
enum Fail {
    Refused(Refusal),
    Wire(WireError),
}

impl From<Refusal> for Fail {
    fn from(r: Refusal) -> Self {
        Fail::Refused(r)
    }
}

impl From<WireError> for Fail {
    fn from(e: WireError) -> Self {
        Fail::Wire(e)
    }
}

/// What a handled request still needs.
enum Done {
    /// Nothing but the REPLY_ACK answer, if the frontend asked for one.
    Ack,
    /// A reply was sent.
    Replied,
}

/// Size of one memory region description on the wire.
const REGION_LEN: usize = 32;

fn region_at(b: &[u8], off: usize) -> RegionDesc {
    RegionDesc {
        gpa: le64(b, off),
        size: le64(b, off + 8),
        user_addr: le64(b, off + 16),
        mmap_offset: le64(b, off + 24),
    }
}

impl Session {
    /// Read one request from `sock` and answer it. An error ends the session.
    pub(crate) fn handle(&mut self, sock: &mut UnixStream) -> Result<(), SessionEnd> {
        let mut msg = wire::read_message(sock)?;
        let reply_ack = self.acked_protocol & protocol::REPLY_ACK != 0;
        match self.dispatch(sock, &mut msg) {
            Ok(Done::Ack) => {
                if msg.need_reply() && reply_ack {
                    wire::ack(sock, &msg, true)?;
                }
                Ok(())
            }
            Ok(Done::Replied) => Ok(()),
            Err(Fail::Refused(Refusal(why))) => {
                if msg.need_reply() && reply_ack {
                    let _ = wire::ack(sock, &msg, false);
                }
                Err(SessionEnd::Refused(why))
            }
            Err(Fail::Wire(e)) => Err(e.into()),
        }
    }

    fn require(&self, feature: u64, msg: &Message) -> Result<(), Refusal> {
        if self.acked_protocol & feature == 0 {
            return Err(refuse(format!(
                "{}: its protocol feature ({feature:#x}) was not negotiated",
                req::name(msg.code)
            )));
        }
        Ok(())
    }

    fn dispatch(&mut self, sock: &mut UnixStream, msg: &mut Message) -> Result<Done, Fail> {
        debug!(
            "frontend request {} ({} bytes, {} fds)",
            req::name(msg.code),
            msg.payload.len(),
            msg.fds.len()
        );
        let reply_u64 = |sock: &mut UnixStream, msg: &Message, v: u64| -> Result<Done, Fail> {
            wire::reply(sock, msg, &v.to_le_bytes(), None)?;
            Ok(Done::Replied)
        };
        match msg.code {
            req::GET_FEATURES => {
                msg.expect_len(0)?;
                reply_u64(sock, msg, self.blk.features)
            }
            req::SET_FEATURES => {
                let f = msg.u64()?;
                self.set_features(f)?;
                Ok(Done::Ack)
            }
            req::SET_OWNER => {
                msg.expect_len(0)?;
                self.set_owner()?;
                Ok(Done::Ack)
            }
            req::RESET_OWNER => {
                msg.expect_len(0)?;
                self.reset_owner()?;
                Ok(Done::Ack)
            }
            req::GET_PROTOCOL_FEATURES => {
                msg.expect_len(0)?;
                reply_u64(sock, msg, self.protocol_offered)
            }
            req::SET_PROTOCOL_FEATURES => {
                let f = msg.u64()?;
                self.set_protocol_features(f)?;
                Ok(Done::Ack)
            }
            req::GET_QUEUE_NUM => {
                msg.expect_len(0)?;
                reply_u64(sock, msg, self.vrings.len() as u64)
            }
            req::GET_MAX_MEM_SLOTS => {
                self.require(protocol::CONFIGURE_MEM_SLOTS, msg)?;
                msg.expect_len(0)?;
                reply_u64(sock, msg, MAX_MEM_SLOTS as u64)
            }
            req::SET_MEM_TABLE => {
                let p = &msg.payload;
                if p.len() < 8 {
                    return Err(msg.bad("payload shorter than its 8-byte header").into());
                }
                let n = le32(p, 0) as usize;
                if p.len() != 8 + n * REGION_LEN {
                    return Err(msg
                        .bad(format_args!(
                            "{n} regions in a payload of {} bytes",
                            p.len()
                        ))
                        .into());
                }
                if n == 0 {
                    return Err(refuse("SET_MEM_TABLE with no memory regions".into()).into());
                }
                msg.expect_fds(n)?;
                let regions: Vec<RegionDesc> =
                    (0..n).map(|i| region_at(p, 8 + i * REGION_LEN)).collect();
                let files = std::mem::take(&mut msg.fds);
                self.set_mem_table(regions.into_iter().zip(files).collect())?;
                Ok(Done::Ack)
            }
            req::ADD_MEM_REG | req::REM_MEM_REG => {
                self.require(protocol::CONFIGURE_MEM_SLOTS, msg)?;
                msg.expect_len(8 + REGION_LEN)?;
                let d = region_at(&msg.payload, 8);
                if msg.code == req::ADD_MEM_REG {
                    msg.expect_fds(1)?;
                    let fd = msg.fds.remove(0);
                    self.add_mem_region(d, fd)?;
                } else {
                    // QEMU may attach the region's fd; it is not needed (and closed).
                    self.remove_mem_region(d)?;
                }
                Ok(Done::Ack)
            }
            req::SET_VRING_NUM => {
                let (index, num) = msg.state()?;
                self.set_vring_num(index, num)?;
                Ok(Done::Ack)
            }
            req::SET_VRING_BASE => {
                let (index, num) = msg.state()?;
                self.set_vring_base(index, num)?;
                Ok(Done::Ack)
            }
            req::GET_VRING_BASE => {
                let (index, _) = msg.state()?;
                let next = self.get_vring_base(index)?;
                let mut out = [0u8; 8];
                out[..4].copy_from_slice(&index.to_le_bytes());
                out[4..].copy_from_slice(&u32::from(next).to_le_bytes());
                wire::reply(sock, msg, &out, None)?;
                Ok(Done::Replied)
            }
            req::SET_VRING_ADDR => {
                msg.expect_len(40)?;
                let p = &msg.payload;
                let (index, flags) = (le32(p, 0), le32(p, 4));
                if flags & !VRING_F_LOG != 0 {
                    return Err(msg.bad(format_args!("unknown flags {flags:#x}")).into());
                }
                let log_used = (flags & VRING_F_LOG != 0).then(|| le64(p, 32));
                if log_used.is_some() && self.acked_protocol & protocol::LOG_SHMFD == 0 {
                    return Err(refuse(format!(
                        "SET_VRING_ADDR: queue {index} asks for dirty logging, but LOG_SHMFD was not negotiated"
                    ))
                    .into());
                }
                let addrs = (le64(p, 8), le64(p, 16), le64(p, 24));
                self.set_vring_addr(index, addrs, log_used)?;
                Ok(Done::Ack)
            }
            req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => {
                let v = msg.u64()?;
                if v & !(0xff | VRING_NOFD) != 0 {
                    return Err(msg.bad(format_args!("unknown bits in {v:#x}")).into());
                }
                let index = (v & 0xff) as u32;
                let fd = if v & VRING_NOFD != 0 {
                    msg.expect_fds(0)?;
                    None
                } else {
                    msg.expect_fds(1)?;
                    Some(msg.fds.remove(0))
                };
                match msg.code {
                    req::SET_VRING_KICK => self.set_vring_kick(index, fd)?,
                    req::SET_VRING_CALL => self.set_vring_call(index, fd)?,
                    _ => self.set_vring_err(index, fd)?,
                }
                Ok(Done::Ack)
            }
            req::SET_VRING_ENABLE => {
                let (index, num) = msg.state()?;
                if !self.protocol_acked() {
                    return Err(refuse(format!(
                        "SET_VRING_ENABLE: queue {index} before VHOST_USER_F_PROTOCOL_FEATURES was acked"
                    ))
                    .into());
                }
                let enable = match num {
                    0 => false,
                    1 => true,
                    _ => return Err(msg.bad(format_args!("enable value {num}")).into()),
                };
                self.set_vring_enable(index, enable)?;
                Ok(Done::Ack)
            }
            req::GET_CONFIG | req::SET_CONFIG => {
                self.require(protocol::CONFIG, msg)?;
                let p = &msg.payload;
                if p.len() < 12 {
                    return Err(msg.bad("payload shorter than its 12-byte header").into());
                }
                let (offset, size, flags) = (le32(p, 0), le32(p, 4), le32(p, 8));
                if p.len() - 12 != size as usize {
                    return Err(msg
                        .bad(format_args!(
                            "size {size} but {} payload bytes",
                            p.len() - 12
                        ))
                        .into());
                }
                if flags & !3 != 0 {
                    return Err(msg.bad(format_args!("unknown flags {flags:#x}")).into());
                }
                if msg.code == req::SET_CONFIG {
                    let data = p[12..].to_vec();
                    self.set_config(offset, &data)?;
                    return Ok(Done::Ack);
                }
                let data = self.get_config(offset, size)?;
                let mut out = Vec::with_capacity(12 + data.len());
                out.extend_from_slice(&p[..12]);
                out.extend_from_slice(&data);
                wire::reply(sock, msg, &out, None)?;
                Ok(Done::Replied)
            }
            req::GET_INFLIGHT_FD | req::SET_INFLIGHT_FD => {
                self.require(protocol::INFLIGHT_SHMFD, msg)?;
                let p = &msg.payload;
                if !(20..=24).contains(&p.len()) {
                    return Err(msg
                        .bad(format_args!("payload of {} bytes, expected 24", p.len()))
                        .into());
                }
                let (size, offset) = (le64(p, 0), le64(p, 8));
                let (queues, qsize) = (le16(p, 16), le16(p, 18));
                if msg.code == req::SET_INFLIGHT_FD {
                    msg.expect_fds(1)?;
                    let f = msg.fds.remove(0);
                    self.set_inflight_fd(f, offset, size, queues, qsize)?;
                    return Ok(Done::Ack);
                }
                msg.expect_fds(0)?;
                let region = self.get_inflight_fd(queues, qsize)?;
                let (len, n, qs) = region.shape();
                let mut out = [0u8; 24];
                out[0..8].copy_from_slice(&len.to_le_bytes());
                out[16..18].copy_from_slice(&n.to_le_bytes());
                out[18..20].copy_from_slice(&qs.to_le_bytes());
                wire::reply(sock, msg, &out, Some(region.fd().as_raw_fd()))?;
                Ok(Done::Replied)
            }
            req::SET_LOG_BASE => {
                self.require(protocol::LOG_SHMFD, msg)?;
                msg.expect_len(16)?;
                msg.expect_fds(1)?;
                let (size, offset) = (le64(&msg.payload, 0), le64(&msg.payload, 8));
                let f = msg.fds.remove(0);
                self.set_log_base(f, size, offset)?;
                // With LOG_SHMFD the frontend waits for an answer once the log is mapped:
                // a message of the same request code (libvhost-user sends a u64 0).
                wire::reply(sock, msg, &0u64.to_le_bytes(), None)?;
                Ok(Done::Replied)
            }
            req::SET_LOG_FD => {
                self.require(protocol::LOG_SHMFD, msg)?;
                msg.expect_len(0)?;
                msg.expect_fds(1)?;
                let f = msg.fds.remove(0);
                self.set_log_fd(f);
                Ok(Done::Ack)
            }
            req::SET_BACKEND_REQ_FD => {
                self.require(protocol::BACKEND_REQ, msg)?;
                msg.expect_len(0)?;
                msg.expect_fds(1)?;
                let f: File = msg.fds.remove(0);
                let Some(stream) = wire::unix_stream(f) else {
                    return Err(refuse(
                        "SET_BACKEND_REQ_FD: the fd is not a Unix stream socket".into(),
                    )
                    .into());
                };
                debug!("backend channel on fd {}", stream.as_raw_fd());
                self.set_backend_req_fd(stream);
                Ok(Done::Ack)
            }
            code => Err(refuse(format!(
                "{} ({code}): not supported (its feature was not offered)",
                req::name(code)
            ))
            .into()),
        }
    }
}
