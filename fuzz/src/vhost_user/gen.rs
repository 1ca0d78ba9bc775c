//! The message stream of one input: QEMU's handshake, then operations decoded from the
//! fuzzer's bytes, each a message sent at once or a step the harness takes later.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use proto::wire::feature;

use super::guest::{self, Driver, Writes, GPA_B, MEM, QUEUES, UA, UB};
use super::wire::{code, flags, Msg, Payload, Region};
use crate::input::Input;

/// Most operations one input may make.
pub(super) const MAX_OPS: usize = 64;

/// The virtio features the device offers (what a frontend acks by default).
fn offered() -> u64 {
    [
        feature::VERSION_1,
        feature::RING_EVENT_IDX,
        feature::RING_INDIRECT_DESC,
        feature::SEG_MAX,
        feature::SIZE_MAX,
        feature::BLK_SIZE,
        feature::TOPOLOGY,
        feature::FLUSH,
        feature::CONFIG_WCE,
        feature::MQ,
        feature::DISCARD,
        feature::WRITE_ZEROES,
        feature::VHOST_USER_PROTOCOL_FEATURES,
    ]
    .iter()
    .fold(0, |acc, &f| acc | feature::bit(f))
}

/// Protocol features the device offers: MQ, REPLY_ACK, CONFIG, CONFIGURE_MEM_SLOTS.
const PROTOCOL: u64 = 1 << 0 | 1 << 3 | 1 << 9 | 1 << 15;

/// What the harness does between two messages.
#[derive(Debug)]
pub(super) enum Step {
    /// Let the device handle the next message (of this code); what it means to the
    /// harness if handled.
    Msg(u32, Effect),
    /// Write into guest memory.
    Write(Writes),
    /// Requests put on a queue.
    Fill(guest::Fill),
    /// Kick queue q and, if asked, wait (briefly) until its requests are used; without
    /// the wait the messages that follow race with the worker serving them. Then, if
    /// the session so far was clean (nothing but fills, kicks and questions), check how
    /// the device answered them.
    Kick(usize, bool, bool),
    /// Truncate memfd A.
    Truncate(u64),
}

/// What a handled message changes in the harness's view of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Effect {
    None,
    Started(usize),
    Stopped(usize),
    Enabled(usize, bool),
    Reset,
}

/// The fds of one input, owned by the harness (the device gets duplicates).
pub(super) struct Fds {
    pub(super) mem: [File; 3],
    pub(super) kick: [File; QUEUES],
    pub(super) call: [File; QUEUES],
    pub(super) err: File,
    pub(super) pipe: (OwnedFd, OwnedFd),
}

impl Fds {
    pub(super) fn new() -> Fds {
        let (r, w) = std::io::pipe().expect("pipe");
        Fds {
            mem: [guest::memfd(MEM), guest::memfd(MEM), guest::memfd(0x1000)],
            kick: [guest::eventfd(), guest::eventfd()],
            call: [guest::eventfd(), guest::eventfd()],
            err: guest::eventfd(),
            pipe: (r.into(), w.into()),
        }
    }
}

/// Builds the message stream and the steps from the input.
pub(super) struct Gen<'a, 'b> {
    pub(super) inp: &'b mut Input<'a>,
    pub(super) sock: &'b UnixStream,
    pub(super) fds: &'b Fds,
    pub(super) steps: Vec<Step>,
    pub(super) drivers: [Driver; QUEUES],
    pub(super) full: bool,
    /// Nothing but the handshake, fills, waited kicks and questions so far.
    pub(super) clean: bool,
}

impl Gen<'_, '_> {
    /// Send `m` now; the device handles it when the steps reach it.
    fn send(&mut self, m: Msg, effect: Effect) {
        if self.full {
            return;
        }
        match m.send(self.sock) {
            Ok(()) => self.steps.push(Step::Msg(m.code, effect)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.full = true,
            Err(e) => panic!("cannot send to the device: {e}"),
        }
    }

    /// Put requests on queue `q` and kick it.
    pub(super) fn fill_and_kick(&mut self, q: usize) {
        let f = self.drivers[q].fill(q, self.inp);
        self.steps.push(Step::Fill(f));
        self.steps.push(Step::Kick(q, true, self.clean));
    }

    /// Header flags: version 1, sometimes NEED_REPLY, rarely anything; and rarely a size
    /// field that lies.
    fn framing(&mut self, m: &mut Msg) {
        let b = self.inp.u8();
        if b & 1 != 0 {
            m.flags |= flags::NEED_REPLY;
        }
        match b {
            0xf8.. => m.flags = self.inp.u32(),
            0xf4..=0xf7 => {
                let len = m.payload.len() as u32;
                m.size = Some(
                    self.inp
                        .pick(&[0, len.wrapping_sub(1), len + 1, 0x1000, 0x1001]),
                )
            }
            0xf2 | 0xf3 => m.flags |= flags::REPLY,
            _ => {}
        }
    }

    fn queue(&mut self) -> u32 {
        match self.inp.u8() {
            b @ 0..=0xef => u32::from(b & 1),
            0xf0..=0xf7 => QUEUES as u32,
            _ => self.inp.u32(),
        }
    }

    fn region(&mut self) -> (Region, RawFd) {
        let fds = self.fds;
        let mem = |i: usize| fds.mem[i].as_raw_fd();
        let a = Region {
            gpa: 0,
            size: MEM,
            user_addr: UA,
            offset: 0,
        };
        match self.inp.below(8) {
            0 | 1 => (a, mem(0)),
            2 => (
                Region {
                    gpa: GPA_B,
                    user_addr: UB,
                    ..a
                },
                mem(1),
            ),
            3 => (
                Region {
                    gpa: MEM / 2,
                    size: MEM / 2,
                    user_addr: UA + MEM / 2,
                    offset: MEM / 2,
                },
                mem(0),
            ),
            // A memfd shorter than the region.
            4 => (
                Region {
                    gpa: 2 * GPA_B,
                    user_addr: UB + GPA_B,
                    ..a
                },
                mem(2),
            ),
            5 => (
                Region {
                    offset: self.inp.pick(&[0x10, 0x1000, MEM, u64::MAX - 0xfff]),
                    ..a
                },
                mem(0),
            ),
            6 => {
                let r = Region {
                    gpa: self.inp.pick(&[0, GPA_B, u64::MAX - 0xffff, 0x8000, 1]),
                    size: self.inp.pick(&[MEM, 0, 0x1000, u64::MAX, 1]),
                    user_addr: self.inp.pick(&[UA, UB, 0, u64::MAX - 0xffff, UA + 8]),
                    offset: 0,
                };
                (r, mem(usize::from(self.inp.u8() % 3)))
            }
            _ => {
                let fd = match self.inp.u8() % 3 {
                    0 => self.fds.pipe.0.as_raw_fd(),
                    1 => self.fds.err.as_raw_fd(),
                    _ => self.fds.kick[0].as_raw_fd(),
                };
                (a, fd)
            }
        }
    }

    fn vring_fd(&mut self, c: u32) {
        let q = self.queue();
        let qi = (q as usize).min(QUEUES - 1);
        let own = match c {
            code::SET_VRING_KICK => self.fds.kick[qi].as_raw_fd(),
            code::SET_VRING_CALL => self.fds.call[qi].as_raw_fd(),
            _ => self.fds.err.as_raw_fd(),
        };
        let (value, fds) = match self.inp.below(8) {
            0..=4 => (u64::from(q & 0xff), vec![own]),
            5 => (u64::from(q & 0xff) | 0x100, vec![]), // no fd: polling mode
            6 => (u64::from(q & 0xff), vec![self.fds.pipe.1.as_raw_fd()]),
            _ => match self.inp.u8() % 3 {
                0 => (u64::from(q & 0xff) | 0x100, vec![own]),
                1 => (u64::from(q & 0xff), vec![]),
                _ => (u64::from(q), vec![own, own]),
            },
        };
        let mut m = Msg::new(c, Payload::default().u64(value).0);
        m.fds = fds;
        self.framing(&mut m);
        let effect = if c == code::SET_VRING_KICK && m.fds.len() == 1 && q < QUEUES as u32 {
            Effect::Started(q as usize)
        } else {
            Effect::None
        };
        self.send(m, effect);
    }

    fn vring_addr(&mut self, q: u32) -> Msg {
        let (d, a, u) = guest::ring_gpa((q as usize).min(QUEUES - 1));
        let addr = |std: u64, this: &mut Self| {
            if this.inp.rare() {
                let raw = this.inp.u64();
                this.inp
                    .pick(&[UA + std + 1, UA + MEM - 8, 0, UB + std, raw])
            } else {
                UA + std
            }
        };
        let (d, u, a) = (addr(d, self), addr(u, self), addr(a, self));
        let fl = if self.inp.rare() { self.inp.u32() } else { 0 };
        Msg::new(
            code::SET_VRING_ADDR,
            Payload::default()
                .u32(q)
                .u32(fl)
                .u64(d)
                .u64(u)
                .u64(a)
                .u64(0)
                .0,
        )
    }

    /// What QEMU sends before the guest runs: negotiation, memory, and `queues` rings.
    pub(super) fn handshake(&mut self) {
        let drop = self.inp.u8();
        let droppable = [
            feature::RING_EVENT_IDX,
            feature::RING_INDIRECT_DESC,
            feature::FLUSH,
            feature::DISCARD,
            feature::WRITE_ZEROES,
            feature::CONFIG_WCE,
            feature::VHOST_USER_PROTOCOL_FEATURES,
            feature::VERSION_1,
        ];
        let acked = droppable
            .iter()
            .enumerate()
            .filter(|(i, _)| drop & (1 << i) != 0)
            .fold(offered(), |acc, (_, &f)| acc & !feature::bit(f));
        let queues = 1 + usize::from(self.inp.u8() & 1);
        let fds = self.fds;
        self.send(Msg::new(code::GET_FEATURES, vec![]), Effect::None);
        let m = Msg::new(code::SET_FEATURES, Payload::default().u64(acked).0);
        self.send(m, Effect::None);
        self.send(Msg::new(code::GET_PROTOCOL_FEATURES, vec![]), Effect::None);
        let m = Msg::new(
            code::SET_PROTOCOL_FEATURES,
            Payload::default().u64(PROTOCOL).0,
        );
        self.send(m, Effect::None);
        self.send(Msg::new(code::SET_OWNER, vec![]), Effect::None);
        self.send(Msg::new(code::GET_QUEUE_NUM, vec![]), Effect::None);
        self.send(Msg::new(code::GET_MAX_MEM_SLOTS, vec![]), Effect::None);
        let a = Region {
            gpa: 0,
            size: MEM,
            user_addr: UA,
            offset: 0,
        };
        let mut m = Msg::new(
            code::SET_MEM_TABLE,
            a.put(Payload::default().u32(1).u32(0)).0,
        );
        m.fds = vec![fds.mem[0].as_raw_fd()];
        self.send(m, Effect::None);
        for q in 0..queues {
            let state = |n: u32| Payload::default().u32(q as u32).u32(n).0;
            self.send(Msg::new(code::SET_VRING_NUM, state(16)), Effect::None);
            self.send(Msg::new(code::SET_VRING_BASE, state(0)), Effect::None);
            let (d, av, u) = guest::ring_gpa(q);
            let m = Msg::new(
                code::SET_VRING_ADDR,
                Payload::default()
                    .u32(q as u32)
                    .u32(0)
                    .u64(UA + d)
                    .u64(UA + u)
                    .u64(UA + av)
                    .u64(0)
                    .0,
            );
            self.send(m, Effect::None);
            for (c, fd) in [
                (code::SET_VRING_CALL, fds.call[q].as_raw_fd()),
                (code::SET_VRING_ERR, fds.err.as_raw_fd()),
                (code::SET_VRING_KICK, fds.kick[q].as_raw_fd()),
            ] {
                let mut m = Msg::new(c, Payload::default().u64(q as u64).0);
                m.fds = vec![fd];
                let effect = if c == code::SET_VRING_KICK {
                    Effect::Started(q)
                } else {
                    Effect::None
                };
                self.send(m, effect);
            }
            self.send(
                Msg::new(code::SET_VRING_ENABLE, state(1)),
                Effect::Enabled(q, true),
            );
        }
    }

    /// One operation.
    pub(super) fn op(&mut self) {
        let state = |q: u32, n: u32| Payload::default().u32(q).u32(n).0;
        let mut effect = Effect::None;
        let op = self.inp.below(32);
        // Fills and questions keep the session clean.
        if !matches!(op, 0..=2 | 6 | 18 | 20 | 22) {
            self.clean = false;
        }
        let m = match op {
            0..=2 => {
                let q = (self.inp.u8() & 1) as usize;
                self.fill_and_kick(q);
                return;
            }
            3 => {
                let q = (self.inp.u8() & 1) as usize;
                self.steps.push(Step::Kick(q, false, false));
                return;
            }
            4 => {
                let at = self.inp.below(MEM);
                let n = 1 + self.inp.below(32) as usize;
                self.steps.push(Step::Write(vec![(at, self.inp.bytes(n))]));
                return;
            }
            5 => {
                if self.inp.u8() >= 0xc0 {
                    let len = self.inp.pick(&[0x1000, 0, MEM / 2, 0x3000]);
                    self.steps.push(Step::Truncate(len));
                }
                return;
            }
            6 => Msg::new(code::GET_FEATURES, vec![]),
            7 => {
                let v = if self.inp.rare() {
                    self.inp.u64()
                } else {
                    offered() & !(u64::from(self.inp.u8()) << 28)
                };
                Msg::new(code::SET_FEATURES, Payload::default().u64(v).0)
            }
            8 => Msg::new(code::SET_OWNER, vec![]),
            9 => {
                effect = Effect::Reset;
                Msg::new(
                    self.inp.pick(&[code::RESET_OWNER, code::RESET_DEVICE]),
                    vec![],
                )
            }
            10 => {
                let n = self.inp.below(3) as usize + 1;
                let mut p = Payload::default().u32(n as u32).u32(0);
                let mut fds = Vec::new();
                for _ in 0..n {
                    let (r, fd) = self.region();
                    p = r.put(p);
                    fds.push(fd);
                }
                if self.inp.rare() {
                    fds.pop();
                }
                let mut m = Msg::new(code::SET_MEM_TABLE, p.0);
                m.fds = fds;
                m
            }
            11 => {
                let q = self.queue();
                let n = self
                    .inp
                    .pick(&[16, 16, 256, 1, 2, 4, 8, 64, 128, 512, 3, 0, 32768]);
                if let Some(d) = self.drivers.get_mut(q as usize) {
                    d.size = n as u16;
                }
                Msg::new(code::SET_VRING_NUM, state(q, n))
            }
            12 => {
                let q = self.queue();
                self.vring_addr(q)
            }
            13 => {
                let q = self.queue();
                let base = self.inp.pick(&[0, 0, 1, 0xffff, 0x1_0000]);
                Msg::new(code::SET_VRING_BASE, state(q, base))
            }
            14 => {
                let q = self.queue();
                if (q as usize) < QUEUES {
                    effect = Effect::Stopped(q as usize);
                }
                Msg::new(code::GET_VRING_BASE, state(q, 0))
            }
            15..=17 => {
                let c = [
                    code::SET_VRING_KICK,
                    code::SET_VRING_CALL,
                    code::SET_VRING_ERR,
                ][self.inp.below(3) as usize];
                self.vring_fd(c);
                return;
            }
            18 => Msg::new(code::GET_PROTOCOL_FEATURES, vec![]),
            19 => {
                let v = if self.inp.rare() {
                    self.inp.u64()
                } else {
                    PROTOCOL & !u64::from(self.inp.u8())
                };
                Msg::new(code::SET_PROTOCOL_FEATURES, Payload::default().u64(v).0)
            }
            20 => Msg::new(
                self.inp
                    .pick(&[code::GET_QUEUE_NUM, code::GET_MAX_MEM_SLOTS]),
                vec![],
            ),
            21 => {
                let q = self.queue();
                let on = self.inp.pick(&[1, 0, 2]);
                if (q as usize) < QUEUES && on < 2 {
                    effect = Effect::Enabled(q as usize, on == 1);
                }
                Msg::new(code::SET_VRING_ENABLE, state(q, on))
            }
            22 => {
                let offset = self.inp.pick(&[0, 0, 32, 20, 56, 60, 64, 0x1000]);
                let size = self.inp.pick(&[60, 8, 1, 4, 0, 0x100, 64]);
                let fl = self.inp.pick(&[0, 0, 1, 2, 4]);
                let mut p = Payload::default().u32(offset).u32(size).u32(fl);
                p.0.resize(12 + size as usize, 0);
                Msg::new(code::GET_CONFIG, p.0)
            }
            23 => {
                let offset = self.inp.pick(&[32, 32, 0, 33, 20]);
                let size = self.inp.pick(&[1, 1, 2, 0, 8]);
                let mut p = Payload::default().u32(offset).u32(size).u32(0);
                let bytes = self.inp.bytes(size as usize);
                p = p.bytes(&bytes);
                Msg::new(code::SET_CONFIG, p.0)
            }
            24 => {
                let (r, fd) = self.region();
                let mut m = Msg::new(code::ADD_MEM_REG, r.put(Payload::default().u64(0)).0);
                m.fds = vec![fd];
                m
            }
            25 => {
                let (r, fd) = self.region();
                let mut m = Msg::new(code::REM_MEM_REG, r.put(Payload::default().u64(0)).0);
                if self.inp.rare() {
                    m.fds = vec![fd];
                }
                m
            }
            26 => {
                let p = Payload::default().u64(0x1000).u64(0).u16(2).u16(16).0;
                let mut m = Msg::new(
                    self.inp
                        .pick(&[code::GET_INFLIGHT_FD, code::SET_INFLIGHT_FD]),
                    p,
                );
                if m.code == code::SET_INFLIGHT_FD {
                    m.fds = vec![self.fds.mem[2].as_raw_fd()];
                }
                m
            }
            27 => {
                let mut m = if self.inp.u8() & 1 == 0 {
                    Msg::new(code::SET_LOG_BASE, Payload::default().u64(0x1000).u64(0).0)
                } else {
                    Msg::new(code::SET_LOG_FD, vec![])
                };
                m.fds = vec![self.fds.mem[2].as_raw_fd()];
                m
            }
            28 | 29 => {
                let c = self.inp.pick(&code::OTHERS);
                let len = self.inp.pick(&[0, 8, 16, 40]);
                let mut m = Msg::new(c, self.inp.bytes(len));
                if self.inp.rare() {
                    m.fds = vec![self.fds.mem[2].as_raw_fd()];
                }
                m
            }
            _ => {
                // Anything: code, flags, size and payload from the input.
                let c = if self.inp.u8() & 1 == 0 {
                    self.inp.below(48) as u32
                } else {
                    self.inp.u32()
                };
                let fl = self.inp.u32();
                let size = self.inp.below(0x1010) as u32;
                let n = self.inp.below(u64::from(size.min(256)) + 1) as usize;
                let mut m = Msg {
                    code: c,
                    flags: fl,
                    payload: self.inp.bytes(n),
                    size: Some(size),
                    fds: vec![],
                };
                if self.inp.rare() {
                    m.fds = vec![self.fds.mem[0].as_raw_fd()];
                }
                self.send(m, Effect::None);
                return;
            }
        };
        let mut m = m;
        self.framing(&mut m);
        self.send(m, effect);
    }
}
