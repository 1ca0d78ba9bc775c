//! Classes about live migration's dirty log (LOG_SHMFD negotiated): bitmaps that are not
//! memory, of no size or too large, reaching past their file, at an unaligned offset, on a
//! disk file system; a bitmap shrunk under a running, logging ring; a running ring whose
//! addresses change; logging turned on with no bitmap. And the well-behaved case: a
//! logging ring whose write marks the used ring's page in the bitmap.

use std::os::fd::AsRawFd;
use std::time::Duration;

use super::session::{any, Ctx, Running, Setup, WANT};
use crate::support::raw_frontend::{self as rf, pf, req, u64p, VERSION_1};
use crate::support::raw_ring::{self as rr, Guest};
use crate::{Class, Expect};

/// VHOST_F_LOG_ALL.
const LOG_ALL: u64 = 1 << 26;

fn log_base(size: u64, offset: u64) -> Vec<u8> {
    [u64p(size), u64p(offset)].concat()
}

/// A session with LOG_SHMFD; SET_LOG_BASE with `fd`, `size`, `offset` must be refused.
fn bad_log(cx: &Ctx, fd: i32, size: u64, offset: u64) -> Result<(), String> {
    let mut c = rf::handshake(&cx.sock, WANT | pf::LOG_SHMFD, true)?;
    if !c.has(pf::LOG_SHMFD) {
        return Err("the daemon does not offer LOG_SHMFD".into());
    }
    c.refused(
        "SET_LOG_BASE",
        req::SET_LOG_BASE,
        &log_base(size, offset),
        &[fd],
    )
}

/// A running ring with LOG_SHMFD negotiated.
fn logging_ring(cx: &Ctx) -> Result<Running, String> {
    Running::start(
        cx,
        Setup {
            more_protocol: pf::LOG_SHMFD,
            ..Setup::default()
        },
    )
}

/// SET_FEATURES with VHOST_F_LOG_ALL on top of what the session acked.
fn log_all(r: &mut Running) -> Result<(), String> {
    let f = VERSION_1 | rf::F_PROTOCOL_FEATURES | LOG_ALL;
    r.c.ok("SET_FEATURES (LOG_ALL)", req::SET_FEATURES, &u64p(f), &[])
}

/// SET_VRING_ADDR for queue 0 at its current addresses, with the log flag and the used
/// ring's guest address.
fn log_ring_addr(r: &mut Running) -> Result<(), String> {
    let (desc, used, avail) = r.ring.addrs(&r.g);
    let mut p = [0u32.to_le_bytes(), 1u32.to_le_bytes()].concat();
    for v in [desc, used, avail, used] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    r.c.ok("SET_VRING_ADDR (log)", req::SET_VRING_ADDR, &p, &[])
}

pub fn classes() -> Vec<Class> {
    use Expect::*;
    vec![
        Class {
            name: "log_base_pipe",
            expect: Refused,
            what: "SET_LOG_BASE whose fd is a pipe",
            run: |cx| {
                let (r, _w) = rr::pipe();
                bad_log(cx, r.as_raw_fd(), 4096, 0)
            },
        },
        Class {
            name: "log_base_size_zero",
            expect: Refused,
            what: "SET_LOG_BASE of 0 bytes",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                bad_log(cx, g.fd(), 0, 0)
            },
        },
        Class {
            name: "log_base_past_its_file",
            expect: Refused,
            what: "SET_LOG_BASE of 128 KiB on a 64 KiB memfd",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                bad_log(cx, g.fd(), 128 << 10, 0)
            },
        },
        Class {
            name: "log_base_offset_overflows",
            expect: Refused,
            what: "SET_LOG_BASE at offset 2^64 - 4096",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                bad_log(cx, g.fd(), 8192, u64::MAX - 4095)
            },
        },
        Class {
            name: "log_base_unaligned_offset",
            expect: Refused,
            what: "SET_LOG_BASE at offset 100",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                bad_log(cx, g.fd(), 4096, 100)
            },
        },
        Class {
            name: "log_base_huge",
            expect: Refused,
            what: "SET_LOG_BASE of 2^40 bytes",
            run: |cx| {
                let g = Guest::new(64 << 10, true, 0);
                bad_log(cx, g.fd(), 1 << 40, 0)
            },
        },
        Class {
            name: "log_base_on_a_disk_file_system",
            expect: Refused,
            what: "SET_LOG_BASE whose fd is a file on a disk file system",
            run: |cx| {
                let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
                std::fs::create_dir_all(dir).unwrap();
                let f = tempfile::tempfile_in(dir).unwrap();
                f.set_len(64 << 10).unwrap();
                bad_log(cx, f.as_raw_fd(), 4096, 0)
            },
        },
        Class {
            name: "vring_addr_moved_while_running",
            expect: Refused,
            what: "SET_VRING_ADDR on a running ring with other addresses",
            run: |cx| {
                let mut r = logging_ring(cx)?;
                let (desc, used, avail) = r.ring.addrs(&r.g);
                let mut p = [0u32.to_le_bytes(), 0u32.to_le_bytes()].concat();
                for v in [desc, used + 4096, avail, 0] {
                    p.extend_from_slice(&v.to_le_bytes());
                }
                r.c.refused("SET_VRING_ADDR", req::SET_VRING_ADDR, &p, &[])
            },
        },
        Class {
            name: "log_all_without_a_log_base",
            expect: Survives,
            what: "VHOST_F_LOG_ALL acked with no bitmap, writes, kick",
            run: |cx| {
                let mut r = logging_ring(cx)?;
                log_all(&mut r)?;
                r.ring.write_req(&r.g, 3, 0x11, None);
                r.kick();
                if !r.ring.wait_used(&r.g, 2, Duration::from_secs(5)) {
                    return Err("a write with logging on and no bitmap did not complete".into());
                }
                r.stop()
            },
        },
        Class {
            name: "log_base_shrunk_while_logging",
            expect: Survives,
            what: "a logging ring whose bitmap memfd is truncated to nothing, then writes",
            run: |cx| {
                let mut r = logging_ring(cx)?;
                let mut log = Guest::new(64 << 10, false, 0);
                let fd = log.fd();
                any(
                    &mut r.c,
                    "SET_LOG_BASE",
                    req::SET_LOG_BASE,
                    &log_base(64 << 10, 0),
                    &[fd],
                )?;
                log_all(&mut r)?;
                log_ring_addr(&mut r)?;
                log.shrink(0);
                r.ring.write_req(&r.g, 3, 0x22, None);
                r.kick();
                std::thread::sleep(Duration::from_millis(300));
                r.stop()
            },
        },
        Class {
            name: "logging_ring_marks_its_used_ring",
            expect: Survives,
            what: "a valid bitmap, LOG_ALL, the log flag on the ring, a write: the used ring's page is marked",
            run: |cx| {
                let mut r = logging_ring(cx)?;
                // Memory sits at 4 GiB: a 256 KiB bitmap covers 8 GiB.
                let len = 256 << 10;
                let log = Guest::new(len, true, 0);
                r.c.ok(
                    "SET_LOG_BASE",
                    req::SET_LOG_BASE,
                    &log_base(len as u64, 0),
                    &[log.fd()],
                )?;
                log_all(&mut r)?;
                log_ring_addr(&mut r)?;
                r.ring.write_req(&r.g, 3, 0x33, None);
                r.kick();
                if !r.ring.wait_used(&r.g, 2, Duration::from_secs(5)) {
                    return Err("a write with logging on did not complete".into());
                }
                let (_, used, _) = r.ring.addrs(&r.g);
                let page = used / 4096;
                let byte = log.read_u8((page / 8) as usize);
                if byte & (1 << (page % 8)) == 0 {
                    return Err(format!(
                        "the used ring's page {page} (guest address {used:#x}) is not marked"
                    ));
                }
                r.stop()
            },
        },
    ]
}
