//! Classes about setting vrings up: sizes, addresses, bases, notification fds, enabling.

use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use super::session::{any, Ctx, GPA, MIB};
use crate::support::raw_frontend::{
    as_u64, req, state, u64p, vring_addr, Answer, Conn, NO_FD, VERSION,
};
use crate::support::raw_ring::{self as rr, Guest, Ring, QSZ};
use crate::{Class, Expect, MAX_QUEUE_SIZE, NUM_QUEUES};

/// Ready with memory, then `req` must be refused.
fn bad(cx: &Ctx, what: &str, code: u32, payload: &[u8], fds: &[RawFd]) -> Result<(), String> {
    let (mut c, _g) = cx.with_memory()?;
    c.refused(what, code, payload, fds)
}

/// The addresses of a good ring at the start of the memory.
fn good_addrs() -> (u64, u64, u64) {
    let r = Ring::new(0, 0);
    let g = Guest::new(4096, true, GPA);
    r.addrs(&g)
}

/// Queue 0 with ring addresses `desc`, `used`, `avail`, step by step from SET_VRING_NUM
/// (acknowledged) to SET_VRING_ENABLE: one of the steps from SET_VRING_ADDR on must be
/// refused. If none is, kick it, to show what the daemon does with it.
fn must_not_start(
    c: &mut Conn,
    what: &str,
    (desc, used, avail): (u64, u64, u64),
) -> Result<(), String> {
    c.ok(
        "SET_VRING_NUM",
        req::SET_VRING_NUM,
        &state(0, QSZ.into()),
        &[],
    )?;
    let (kick, call) = (rr::eventfd(0, true), rr::eventfd(0, true));
    let steps: [(u32, Vec<u8>, Option<RawFd>); 5] = [
        (req::SET_VRING_ADDR, vring_addr(0, desc, used, avail), None),
        (req::SET_VRING_BASE, state(0, 0), None),
        (req::SET_VRING_CALL, u64p(0), Some(call.as_raw_fd())),
        (req::SET_VRING_KICK, u64p(0), Some(kick.as_raw_fd())),
        (req::SET_VRING_ENABLE, state(0, 1), None),
    ];
    for (code, p, fd) in steps {
        match c.call(code, &p, fd.as_slice())? {
            Answer::Reply(p) if as_u64(&p) == Some(0) => {}
            Answer::Reply(p) if as_u64(&p).is_none() => {
                return Err(format!(
                    "request {code}: a {}-byte reply, not an ack",
                    p.len()
                ))
            }
            _ => return Ok(()),
        }
    }
    let _ = rr::write_u64(kick.as_raw_fd(), 1);
    std::thread::sleep(Duration::from_millis(200));
    Err(format!(
        "{what}: the ring started (SET_VRING_ADDR to SET_VRING_ENABLE all acknowledged)"
    ))
}

/// Queue 0 set up with a kick message of `kick` (payload) and `kick_fds`, every answer
/// accepted; if it all went through, a write is put on the ring. Then stopping the ring
/// must be answered.
fn start_any(cx: &Ctx, kick: u64, kick_fds: &[RawFd]) -> Result<(), String> {
    let (mut c, g) = cx.with_memory()?;
    let mut ring = Ring::new(0, 0);
    let (desc, used, avail) = ring.addrs(&g);
    let call = rr::eventfd(0, true);
    let steps: [(u32, Vec<u8>, &[RawFd]); 6] = [
        (req::SET_VRING_NUM, state(0, QSZ.into()), &[]),
        (req::SET_VRING_ADDR, vring_addr(0, desc, used, avail), &[]),
        (req::SET_VRING_BASE, state(0, 0), &[]),
        (req::SET_VRING_CALL, u64p(0), &[call.as_raw_fd()]),
        (req::SET_VRING_KICK, u64p(kick), kick_fds),
        (req::SET_VRING_ENABLE, state(0, 1), &[]),
    ];
    let mut all = true;
    for (code, p, fds) in steps {
        let a = any(&mut c, &format!("request {code}"), code, &p, fds)?;
        all &= matches!(a, Answer::Reply(ref p) if as_u64(p) == Some(0));
    }
    if all {
        ring.write_req(&g, 3, 0x3c, None);
        ring.wait_used(&g, 1, Duration::from_millis(500));
    }
    c.call_flags(req::GET_VRING_BASE, VERSION, &state(0, 0), &[])
        .map(|_| ())
}

pub fn classes() -> Vec<Class> {
    use Expect::*;
    vec![
        Class {
            name: "vring_num_zero",
            expect: Refused,
            what: "SET_VRING_NUM 0",
            run: |cx| bad(cx, "SET_VRING_NUM 0", req::SET_VRING_NUM, &state(0, 0), &[]),
        },
        Class {
            name: "vring_num_not_power_of_two",
            expect: Refused,
            what: "SET_VRING_NUM 3",
            run: |cx| bad(cx, "SET_VRING_NUM 3", req::SET_VRING_NUM, &state(0, 3), &[]),
        },
        Class {
            name: "vring_num_above_max",
            expect: Refused,
            what: "SET_VRING_NUM 512 with --queue-size 256",
            run: |cx| {
                let p = state(0, 2 * MAX_QUEUE_SIZE);
                bad(cx, "SET_VRING_NUM 512", req::SET_VRING_NUM, &p, &[])
            },
        },
        Class {
            name: "vring_num_65536",
            expect: Refused,
            what: "SET_VRING_NUM 65536 (more than a u16 index can count)",
            run: |cx| {
                bad(
                    cx,
                    "SET_VRING_NUM 65536",
                    req::SET_VRING_NUM,
                    &state(0, 1 << 16),
                    &[],
                )
            },
        },
        Class {
            name: "vring_num_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_NUM 16 on queue 2 of 2",
            run: |cx| {
                let p = state(NUM_QUEUES, 16);
                bad(cx, "SET_VRING_NUM on queue 2", req::SET_VRING_NUM, &p, &[])
            },
        },
        Class {
            name: "vring_addr_outside_memory",
            expect: Refused,
            what: "a descriptor table 16 MiB past the only region",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let (_, u, a) = good_addrs();
                must_not_start(
                    &mut c,
                    "descriptors outside memory",
                    (GPA + (16 * MIB) as u64, u, a),
                )
            },
        },
        Class {
            name: "vring_addr_misaligned",
            expect: Refused,
            what: "a descriptor table at an 8-byte (not 16-byte) boundary",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let (d, u, a) = good_addrs();
                must_not_start(&mut c, "descriptors at +8", (d + 8, u, a))
            },
        },
        Class {
            name: "vring_used_straddles_region_end",
            expect: Refused,
            what: "a 134-byte used ring starting 64 bytes before the region's end",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let (d, _, a) = good_addrs();
                must_not_start(
                    &mut c,
                    "used ring across the end",
                    (d, GPA + MIB as u64 - 64, a),
                )
            },
        },
        Class {
            name: "vring_addr_before_mem_table",
            expect: Refused,
            what: "a ring set up before any SET_MEM_TABLE",
            run: |cx| must_not_start(&mut cx.ready()?, "a ring without memory", good_addrs()),
        },
        Class {
            name: "vring_addr_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_ADDR on queue 2 of 2",
            run: |cx| {
                let (d, u, a) = good_addrs();
                let p = vring_addr(NUM_QUEUES, d, u, a);
                bad(
                    cx,
                    "SET_VRING_ADDR on queue 2",
                    req::SET_VRING_ADDR,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "vring_base_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_BASE on queue 2 of 2",
            run: |cx| {
                let p = state(NUM_QUEUES, 0);
                bad(
                    cx,
                    "SET_VRING_BASE on queue 2",
                    req::SET_VRING_BASE,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "vring_base_above_16_bits",
            expect: Refused,
            // A base above the ring size is legal (split-ring indices are free-running
            // u16s); one that does not fit 16 bits is not.
            what: "SET_VRING_BASE 0x10000 on a split ring (kernel vhost: EINVAL)",
            run: |cx| {
                bad(
                    cx,
                    "SET_VRING_BASE 0x10000",
                    req::SET_VRING_BASE,
                    &state(0, 1 << 16),
                    &[],
                )
            },
        },
        Class {
            name: "vring_kick_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_KICK on queue 2 of 2",
            run: |cx| {
                let e = rr::eventfd(0, true);
                let p = u64p(NUM_QUEUES.into());
                bad(
                    cx,
                    "SET_VRING_KICK on queue 2",
                    req::SET_VRING_KICK,
                    &p,
                    &[e.as_raw_fd()],
                )
            },
        },
        Class {
            name: "vring_call_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_CALL on queue 2 of 2",
            run: |cx| {
                let e = rr::eventfd(0, true);
                let p = u64p(NUM_QUEUES.into());
                bad(
                    cx,
                    "SET_VRING_CALL on queue 2",
                    req::SET_VRING_CALL,
                    &p,
                    &[e.as_raw_fd()],
                )
            },
        },
        Class {
            name: "vring_err_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_ERR on queue 2 of 2",
            run: |cx| {
                let e = rr::eventfd(0, true);
                let p = u64p(NUM_QUEUES.into());
                bad(
                    cx,
                    "SET_VRING_ERR on queue 2",
                    req::SET_VRING_ERR,
                    &p,
                    &[e.as_raw_fd()],
                )
            },
        },
        Class {
            name: "vring_kick_without_fd_or_flag",
            expect: Refused,
            what: "SET_VRING_KICK with no fd and without the no-fd flag",
            run: |cx| {
                bad(
                    cx,
                    "SET_VRING_KICK without fd",
                    req::SET_VRING_KICK,
                    &u64p(0),
                    &[],
                )
            },
        },
        Class {
            name: "vring_call_without_fd_or_flag",
            expect: Refused,
            what: "SET_VRING_CALL with no fd and without the no-fd flag",
            run: |cx| {
                bad(
                    cx,
                    "SET_VRING_CALL without fd",
                    req::SET_VRING_CALL,
                    &u64p(0),
                    &[],
                )
            },
        },
        Class {
            name: "vring_kick_fd_and_no_fd_flag",
            expect: Refused,
            what: "SET_VRING_KICK with an fd and the no-fd flag",
            run: |cx| {
                let e = rr::eventfd(0, true);
                let what = "SET_VRING_KICK, fd and no-fd flag";
                bad(
                    cx,
                    what,
                    req::SET_VRING_KICK,
                    &u64p(NO_FD),
                    &[e.as_raw_fd()],
                )
            },
        },
        Class {
            name: "vring_enable_2",
            expect: Refused,
            what: "SET_VRING_ENABLE with num 2",
            run: |cx| {
                bad(
                    cx,
                    "SET_VRING_ENABLE 2",
                    req::SET_VRING_ENABLE,
                    &state(0, 2),
                    &[],
                )
            },
        },
        Class {
            name: "vring_enable_queue_out_of_range",
            expect: Refused,
            what: "SET_VRING_ENABLE on queue 2 of 2",
            run: |cx| {
                let p = state(NUM_QUEUES, 1);
                bad(
                    cx,
                    "SET_VRING_ENABLE on queue 2",
                    req::SET_VRING_ENABLE,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "get_vring_base_queue_out_of_range",
            expect: Refused,
            what: "GET_VRING_BASE on queue 2 of 2",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let p = state(NUM_QUEUES, 0);
                match c.call_flags(req::GET_VRING_BASE, VERSION, &p, &[])? {
                    Answer::Reply(p) if p.len() == 8 && p[..4] == NUM_QUEUES.to_le_bytes() => {
                        Err("answered with a vring state for queue 2".into())
                    }
                    _ => Ok(()),
                }
            },
        },
        Class {
            name: "get_vring_base_never_started",
            expect: Survives,
            what: "GET_VRING_BASE on queue 0, never set up",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let p = state(0, 0);
                c.call_flags(req::GET_VRING_BASE, VERSION, &p, &[])
                    .map(|_| ())
            },
        },
        Class {
            name: "vring_kick_no_fd_flag",
            expect: Survives,
            what: "a ring whose SET_VRING_KICK has the no-fd flag (poll the ring)",
            run: |cx| start_any(cx, NO_FD, &[]),
        },
        Class {
            name: "vring_kick_fd_is_a_regular_file",
            expect: Survives,
            what: "a ring whose kick fd is a memfd (always readable, never an eventfd)",
            run: |cx| {
                let f = Guest::new(4096, true, 0);
                start_any(cx, 0, &[f.fd()])
            },
        },
        Class {
            name: "kick_on_queue_never_set_up",
            expect: Survives,
            what: "kick and call fds on queue 1, never sized or placed, kicked three times",
            run: |cx| {
                let (mut c, _g) = cx.with_memory()?;
                let (kick, call) = (rr::eventfd(0, true), rr::eventfd(0, true));
                any(
                    &mut c,
                    "SET_VRING_CALL",
                    req::SET_VRING_CALL,
                    &u64p(1),
                    &[call.as_raw_fd()],
                )?;
                any(
                    &mut c,
                    "SET_VRING_KICK",
                    req::SET_VRING_KICK,
                    &u64p(1),
                    &[kick.as_raw_fd()],
                )?;
                for _ in 0..3 {
                    let _ = rr::write_u64(kick.as_raw_fd(), 1);
                    std::thread::sleep(Duration::from_millis(50));
                }
                c.responsive()
            },
        },
    ]
}
