//! The session every class starts from, and the classes about messages, features and the
//! configuration space.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::raw_frontend::{
    self as rf, as_u64, config, pf, req, u64p, Answer, Conn, NEED_REPLY, REPLY, VERSION, VERSION_1,
};
use crate::support::raw_ring::{self as rr, Guest, Ring};
use crate::{Class, Expect, NUM_QUEUES};

/// Where the guest memory of a class starts, in guest-physical and frontend addresses.
pub const GPA: u64 = 0x1_0000_0000;
pub const MIB: usize = 1 << 20;
/// Protocol features the classes negotiate (REPLY_ACK always).
pub const WANT: u64 = pf::MQ | pf::CONFIG | pf::CONFIGURE_MEM_SLOTS;
/// How long a started ring may take to complete a valid request.
pub const IO_WAIT: Duration = Duration::from_secs(5);

/// What a class works with; `keep` holds what must outlive it until the next frontend
/// has been served.
pub struct Ctx {
    pub sock: PathBuf,
    pub keep: Vec<Box<dyn Send>>,
}

impl Ctx {
    pub fn new(sock: PathBuf) -> Ctx {
        Ctx {
            sock,
            keep: Vec::new(),
        }
    }

    /// Negotiated: REPLY_ACK, MQ, CONFIG, CONFIGURE_MEM_SLOTS (as offered), features set.
    pub fn ready(&self) -> Result<Conn, String> {
        rf::handshake(&self.sock, WANT, true)
    }

    /// Ready, with 1 MiB of memory given by SET_MEM_TABLE.
    pub fn with_memory(&self) -> Result<(Conn, Guest), String> {
        let mut c = self.ready()?;
        let g = Guest::new(MIB, true, GPA);
        let t = rf::mem_table(1, &[g.region()]);
        c.ok("SET_MEM_TABLE", req::SET_MEM_TABLE, &t, &[g.fd()])?;
        Ok((c, g))
    }
}

/// How a [`Running`] ring gets its memory and its notifications.
pub struct Setup {
    /// ADD_MEM_REG instead of SET_MEM_TABLE.
    pub add_mem_reg: bool,
    /// Seal the memfd against shrinking (as QEMU does).
    pub sealed: bool,
    /// The kick fd given to the device, and the fd this side kicks through (default: one
    /// eventfd for both).
    pub kick: Option<(OwnedFd, OwnedFd)>,
    /// The call fd given to the device (default: an eventfd).
    pub call: Option<OwnedFd>,
    /// Protocol features asked for beyond [`WANT`] (e.g. LOG_SHMFD).
    pub more_protocol: u64,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            add_mem_reg: false,
            sealed: true,
            kick: None,
            call: None,
            more_protocol: 0,
        }
    }
}

/// Queue 0 started on 1 MiB of memory at [`GPA`], the ring at its start, and shown to
/// work: one valid write completed OK.
pub struct Running {
    pub c: Conn,
    pub g: Guest,
    pub ring: Ring,
    kick_via: OwnedFd,
    _fds: Vec<OwnedFd>,
}

impl Running {
    pub fn start(cx: &Ctx, s: Setup) -> Result<Running, String> {
        Running::try_start(cx, s)?.ok_or_else(|| "valid memory was refused".into())
    }

    /// Like [`Running::start`], but None if the device refuses the memory (a daemon may
    /// refuse a memfd that is not sealed against shrinking).
    pub fn try_start(cx: &Ctx, s: Setup) -> Result<Option<Running>, String> {
        let mut c = rf::handshake(&cx.sock, WANT | s.more_protocol, true)?;
        let g = Guest::new(MIB, s.sealed, GPA);
        let (code, p) = if s.add_mem_reg {
            if !c.has(pf::CONFIGURE_MEM_SLOTS) {
                return Err("the daemon does not offer CONFIGURE_MEM_SLOTS".into());
            }
            (req::ADD_MEM_REG, rf::single_region(&g.region()))
        } else {
            (req::SET_MEM_TABLE, rf::mem_table(1, &[g.region()]))
        };
        match c.call(code, &p, &[g.fd()])? {
            Answer::Reply(p) if as_u64(&p) == Some(0) => {}
            Answer::Reply(p) if as_u64(&p).is_none() => {
                return Err(format!("memory: a {}-byte reply, not an ack", p.len()))
            }
            _ => return Ok(None),
        }
        let (kick, kick_via) = s.kick.unwrap_or_else(|| {
            let e = rr::eventfd(0, true);
            (e.try_clone().unwrap(), e)
        });
        let call = s.call.unwrap_or_else(|| rr::eventfd(0, true));
        let ring = Ring::new(0, 0);
        ring.start(&mut c, &g, kick.as_raw_fd(), call.as_raw_fd())?;
        let mut r = Running {
            c,
            g,
            ring,
            kick_via,
            _fds: vec![kick, call],
        };
        let slot = r.ring.write_req(&r.g, 1, 0xa5, None);
        r.kick();
        if !r.ring.wait_used(&r.g, 1, IO_WAIT) {
            return Err("a valid write on a started ring did not complete in 5 s".into());
        }
        if r.ring.status(&r.g, slot) != 0 {
            return Err("a valid write on a started ring failed".into());
        }
        Ok(Some(r))
    }

    /// The kick fd the device was given (the same open file description as its copy).
    pub fn kick_fd(&self) -> RawFd {
        self._fds[0].as_raw_fd()
    }

    /// The call fd the device was given (the same open file description as its copy).
    pub fn call_fd(&self) -> RawFd {
        self._fds[1].as_raw_fd()
    }

    /// Close this side's kick fd (a pipe's write end: the device's end then reads EOF).
    pub fn close_kick(&mut self) {
        self.kick_via = rr::eventfd(0, true);
    }

    /// Notify the device (errors ignored: a full pipe stays full).
    pub fn kick(&self) {
        let _ = rr::write_u64(self.kick_via.as_raw_fd(), 1);
    }

    /// Stopping the ring must be answered in time (a reply or a close).
    pub fn stop(&mut self) -> Result<(), String> {
        self.c
            .call_flags(req::GET_VRING_BASE, VERSION, &rf::state(0, 0), &[])
            .map(|_| ())
            .map_err(|e| format!("GET_VRING_BASE after the hostile ring: {e}"))
    }
}

/// Any answer will do, as long as there is one in time.
pub fn any(
    c: &mut Conn,
    what: &str,
    req: u32,
    payload: &[u8],
    fds: &[RawFd],
) -> Result<Answer, String> {
    c.call(req, payload, fds)
        .map_err(|e| format!("{what}: {e}"))
}

/// GET_CONFIG that must be refused: a close, or a reply without the data asked for.
fn config_refused(c: &mut Conn, what: &str, payload: &[u8]) -> Result<(), String> {
    match c.call_flags(req::GET_CONFIG, VERSION, payload, &[])? {
        Answer::Closed(_) => Ok(()),
        Answer::Reply(p) if p.len() > 12 => Err(format!(
            "{what}: answered with {} bytes of configuration space",
            p.len() - 12
        )),
        Answer::Reply(_) => Ok(()),
    }
}

/// A virtio feature bit the device did not offer.
fn not_offered(offered: u64, candidates: &[u32]) -> Result<u64, String> {
    candidates
        .iter()
        .map(|&b| 1u64 << b)
        .find(|&b| offered & b == 0)
        .ok_or_else(|| format!("every candidate bit {candidates:?} is offered ({offered:#x})"))
}

/// Half a message, then silence with the connection open: the device must not wait for
/// the rest for ever (it closes the connection).
fn half_then_silence(cx: &Ctx) -> Result<(), String> {
    let mut c = cx.ready()?;
    c.send_bytes(&header(req::GET_FEATURES, VERSION, 0)[..6], &[])
        .map_err(|e| format!("sending half a header: {e}"))?;
    c.wait_closed(Duration::from_secs(15))
}

/// Requests that ask for replies, never read: once the socket is full both ways the
/// device cannot send; it must give up on the connection rather than wait for ever.
fn replies_never_read(cx: &Ctx) -> Result<(), String> {
    let mut c = cx.ready()?;
    let msg = header(req::GET_FEATURES, VERSION, 0);
    // Send while the device takes requests: its replies pile up on our side until it
    // can send no more and stops reading; then ours pile up too (the socket is full
    // both ways once sends have failed for half a second).
    let t0 = std::time::Instant::now();
    let mut full_since = None;
    loop {
        if c.send_nowait(&msg) {
            full_since = None;
        } else {
            let since = *full_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > Duration::from_millis(500) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if t0.elapsed() > Duration::from_secs(20) {
            return Err("the device took requests for 20 s while its replies went unread".into());
        }
    }
    // Give it longer than it may wait for a reply to go out, then look.
    std::thread::sleep(Duration::from_secs(7));
    c.wait_closed(Duration::from_secs(20))
}

/// Send `bytes` raw, then close without waiting for anything.
fn send_and_close(cx: &Ctx, bytes: &[u8]) -> Result<(), String> {
    let mut c = cx.ready()?;
    let _ = c.send_bytes(bytes, &[]);
    c.close();
    Ok(())
}

fn header(code: u32, flags: u32, size: u32) -> Vec<u8> {
    [code.to_le_bytes(), flags.to_le_bytes(), size.to_le_bytes()].concat()
}

const BOTH: u64 = VERSION_1 | rf::F_PROTOCOL_FEATURES;

pub fn classes() -> Vec<Class> {
    use Expect::*;
    vec![
        Class {
            name: "half_a_header_then_silence",
            expect: Refused,
            what: "6 bytes of a header, then nothing, the connection left open",
            run: |cx| half_then_silence(cx),
        },
        Class {
            name: "replies_never_read",
            expect: Refused,
            what: "GET_FEATURES until the socket is full both ways, no reply ever read",
            run: |cx| replies_never_read(cx),
        },
        Class {
            name: "unknown_request_9999",
            expect: Refused,
            what: "request code 9999",
            run: |cx| cx.ready()?.refused("request 9999", 9999, &u64p(0), &[]),
        },
        Class {
            name: "request_code_0",
            expect: Refused,
            what: "request code 0 (VHOST_USER_NONE)",
            run: |cx| cx.ready()?.refused("request 0", 0, &[], &[]),
        },
        Class {
            name: "wrong_version_bits",
            expect: Refused,
            what: "a valid SET_FEATURES whose header says version 2",
            run: |cx| {
                let mut c = cx.ready()?;
                match c.call_flags(req::SET_FEATURES, 0x2 | NEED_REPLY, &u64p(BOTH), &[])? {
                    Answer::Reply(p) if as_u64(&p) == Some(0) => Err("acknowledged with 0".into()),
                    _ => Ok(()),
                }
            },
        },
        Class {
            name: "reply_flag_on_request",
            expect: Refused,
            what: "a valid SET_FEATURES flagged as a reply",
            run: |cx| {
                let mut c = cx.ready()?;
                let f = VERSION | REPLY | NEED_REPLY;
                match c.call_flags(req::SET_FEATURES, f, &u64p(BOTH), &[])? {
                    Answer::Reply(p) if as_u64(&p) == Some(0) => Err("acknowledged with 0".into()),
                    _ => Ok(()),
                }
            },
        },
        Class {
            name: "payload_too_short",
            expect: Refused,
            what: "SET_VRING_NUM with a 4-byte payload",
            run: |cx| {
                let p = 0u32.to_le_bytes();
                cx.ready()?
                    .refused("SET_VRING_NUM of 4 bytes", req::SET_VRING_NUM, &p, &[])
            },
        },
        Class {
            name: "payload_too_long",
            expect: Refused,
            what: "SET_FEATURES with a 16-byte payload",
            run: |cx| {
                let p = [u64p(BOTH), u64p(0)].concat();
                cx.ready()?
                    .refused("SET_FEATURES of 16 bytes", req::SET_FEATURES, &p, &[])
            },
        },
        Class {
            name: "size_above_max_message",
            expect: Refused,
            what: "SET_CONFIG whose size is 0x1001 (payload sent in full)",
            run: |cx| {
                let p = config(0, 0x1001 - 12, &vec![0u8; 0x1001 - 12]);
                cx.ready()?
                    .refused("a 0x1001-byte message", req::SET_CONFIG, &p, &[])
            },
        },
        Class {
            name: "size_u32_max",
            expect: Refused,
            what: "a header whose size is 0xffffffff, no payload, the socket left open",
            run: |cx| {
                let mut c = cx.ready()?;
                c.send_bytes(
                    &header(req::SET_FEATURES, VERSION | NEED_REPLY, u32::MAX),
                    &[],
                )
                .map_err(|e| e.to_string())?;
                match c.recv(req::SET_FEATURES)? {
                    Answer::Reply(p) if as_u64(&p) == Some(0) => Err("acknowledged with 0".into()),
                    _ => Ok(()),
                }
            },
        },
        Class {
            name: "size_larger_than_payload_then_close",
            expect: Survives,
            what: "a header that announces 64 bytes, 8 sent, then close",
            run: |cx| {
                let m = [header(req::SET_FEATURES, VERSION, 64), u64p(BOTH)].concat();
                send_and_close(cx, &m)
            },
        },
        Class {
            name: "truncated_header_then_close",
            expect: Survives,
            what: "6 bytes of a header, then close",
            run: |cx| send_and_close(cx, &header(req::GET_FEATURES, VERSION, 0)[..6]),
        },
        Class {
            name: "set_owner_twice",
            expect: Refused,
            what: "a second SET_OWNER (kernel vhost: EBUSY)",
            run: |cx| {
                cx.ready()?
                    .refused("a second SET_OWNER", req::SET_OWNER, &[], &[])
            },
        },
        Class {
            name: "set_features_unknown_bit",
            expect: Refused,
            what: "SET_FEATURES with bit 55, which virtio does not define",
            run: |cx| {
                let p = u64p(BOTH | 1 << 55);
                cx.ready()?
                    .refused("SET_FEATURES bit 55", req::SET_FEATURES, &p, &[])
            },
        },
        Class {
            name: "set_features_not_offered",
            expect: Refused,
            what: "SET_FEATURES with a defined bit the device did not offer (RING_PACKED...)",
            run: |cx| {
                let mut c = cx.ready()?;
                let bit = not_offered(c.features, &[34, 35, 37, 7, 15, 16])?;
                let p = u64p(BOTH | bit);
                c.refused(
                    &format!("SET_FEATURES {bit:#x}"),
                    req::SET_FEATURES,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "set_protocol_features_unknown_bit",
            expect: Refused,
            what: "SET_PROTOCOL_FEATURES with bit 40, which the spec does not define",
            run: |cx| {
                let mut c = cx.ready()?;
                let p = u64p(c.protocol | 1 << 40);
                c.refused("protocol bit 40", req::SET_PROTOCOL_FEATURES, &p, &[])
            },
        },
        Class {
            name: "set_protocol_features_not_offered",
            expect: Refused,
            what: "SET_PROTOCOL_FEATURES with a defined bit not offered (PAGEFAULT...)",
            run: |cx| {
                let mut c = cx.ready()?;
                let offered = c.get_u64("GET_PROTOCOL_FEATURES", req::GET_PROTOCOL_FEATURES)?;
                let bit = not_offered(offered, &[8, 11, 17, 7, 6])?;
                let p = u64p(c.protocol | bit);
                c.refused(
                    &format!("protocol {bit:#x}"),
                    req::SET_PROTOCOL_FEATURES,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "vring_enable_before_set_features",
            expect: Refused,
            what: "SET_VRING_ENABLE before any SET_FEATURES",
            run: |cx| {
                let mut c = rf::handshake(&cx.sock, WANT, false)?;
                let p = rf::state(0, 1);
                c.refused("SET_VRING_ENABLE", req::SET_VRING_ENABLE, &p, &[])
            },
        },
        Class {
            name: "get_queue_num_without_mq",
            expect: Survives,
            what: "GET_QUEUE_NUM with MQ offered but not negotiated",
            run: |cx| {
                let mut c = rf::handshake(&cx.sock, pf::CONFIG, true)?;
                any(&mut c, "GET_QUEUE_NUM", req::GET_QUEUE_NUM, &[], &[]).map(|_| ())
            },
        },
        Class {
            name: "get_config_without_config",
            expect: Refused,
            what: "GET_CONFIG of 8 bytes with CONFIG not negotiated",
            run: |cx| {
                let mut c = rf::handshake(&cx.sock, pf::MQ, true)?;
                config_refused(&mut c, "GET_CONFIG", &config(0, 8, &[0; 8]))
            },
        },
        Class {
            name: "get_config_huge",
            expect: Refused,
            what: "GET_CONFIG of 4084 bytes (virtio-blk's space is under 100, QEMU reads <= 256)",
            run: |cx| {
                let p = config(0, 4084, &[0; 4084]);
                config_refused(&mut cx.ready()?, "GET_CONFIG of 4084 bytes", &p)
            },
        },
        Class {
            name: "get_config_offset_overflow",
            expect: Refused,
            what: "GET_CONFIG at offset 0xfffffff0, 32 bytes",
            run: |cx| {
                let p = config(0xffff_fff0, 32, &[0; 32]);
                config_refused(&mut cx.ready()?, "GET_CONFIG", &p)
            },
        },
        Class {
            name: "get_config_size_disagrees",
            expect: Refused,
            what: "GET_CONFIG whose size field says 256 with 8 bytes sent",
            run: |cx| config_refused(&mut cx.ready()?, "GET_CONFIG", &config(0, 256, &[0; 8])),
        },
        Class {
            name: "set_config_capacity",
            expect: Refused,
            what: "SET_CONFIG of the capacity (read-only); the next frontend checks it",
            run: |cx| {
                let p = config(0, 8, &1u64.to_le_bytes());
                cx.ready()?
                    .refused("SET_CONFIG capacity", req::SET_CONFIG, &p, &[])
            },
        },
        Class {
            name: "set_config_past_config_space",
            expect: Refused,
            what: "SET_CONFIG of one byte at offset 0x200",
            run: |cx| {
                let p = config(0x200, 1, &[1]);
                cx.ready()?
                    .refused("SET_CONFIG at 0x200", req::SET_CONFIG, &p, &[])
            },
        },
        Class {
            name: "set_log_base_not_negotiated",
            expect: Refused,
            what: "SET_LOG_BASE with a memfd, LOG_SHMFD not negotiated",
            run: |cx| {
                let mut c = cx.ready()?;
                let g = Guest::new(64 << 10, true, 0);
                let p = [u64p(64 << 10), u64p(0)].concat();
                c.refused("SET_LOG_BASE", req::SET_LOG_BASE, &p, &[g.fd()])
            },
        },
        Class {
            name: "set_log_fd_not_negotiated",
            expect: Refused,
            what: "SET_LOG_FD with an eventfd, LOG_SHMFD not negotiated",
            run: |cx| {
                let e = rr::eventfd(0, true);
                cx.ready()?
                    .refused("SET_LOG_FD", req::SET_LOG_FD, &[], &[e.as_raw_fd()])
            },
        },
        Class {
            name: "get_inflight_fd_not_negotiated",
            expect: Refused,
            what: "GET_INFLIGHT_FD, INFLIGHT_SHMFD not negotiated",
            run: |cx| {
                let mut c = cx.ready()?;
                match c.call_flags(req::GET_INFLIGHT_FD, VERSION, &inflight(), &[])? {
                    Answer::Reply(p) if p.len() == 24 && as_u64(&p[..8]) != Some(0) => {
                        Err("answered with an inflight area".into())
                    }
                    _ => Ok(()),
                }
            },
        },
        Class {
            name: "set_inflight_fd_not_negotiated",
            expect: Refused,
            what: "SET_INFLIGHT_FD with a memfd, INFLIGHT_SHMFD not negotiated",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                let mut c = cx.ready()?;
                c.refused(
                    "SET_INFLIGHT_FD",
                    req::SET_INFLIGHT_FD,
                    &inflight(),
                    &[g.fd()],
                )
            },
        },
    ]
}

/// VhostUserInflight: mmap_size, mmap_offset, num_queues, queue_size, padding.
fn inflight() -> Vec<u8> {
    let mut p = [u64p(64 << 10), u64p(0)].concat();
    p.extend_from_slice(&(NUM_QUEUES as u16).to_le_bytes());
    p.extend_from_slice(&16u16.to_le_bytes());
    p.extend_from_slice(&[0; 4]);
    p
}

/// One connection of the fd-leak test; `i` picks what it does: a handshake; a ring with
/// a write through SET_MEM_TABLE; the same through ADD_MEM_REG; refused messages that carry
/// fds (more fds than regions, a kick on a queue that does not exist).
pub fn cycle(sock: &Path, i: u32) -> Result<(), String> {
    let cx = Ctx::new(sock.to_path_buf());
    match i % 4 {
        0 => cx.ready()?.responsive(),
        1 | 2 => {
            let setup = Setup {
                add_mem_reg: i % 4 == 2,
                ..Setup::default()
            };
            Running::start(&cx, setup).map(drop)
        }
        _ => {
            let mut c = cx.ready()?;
            let g = Guest::new(64 << 10, true, GPA);
            let e = rr::eventfd(0, true);
            // What the daemon answers is the other test's business; only the fds count here.
            let t = rf::mem_table(1, &[g.region()]);
            let fds = [g.fd(), g.fd(), e.as_raw_fd()];
            c.call(req::SET_MEM_TABLE, &t, &fds)?;
            let p = u64p(NUM_QUEUES.into());
            c.call(req::SET_VRING_KICK, &p, &[e.as_raw_fd()])?;
            Ok(())
        }
    }
}
