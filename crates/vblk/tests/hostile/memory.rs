//! Classes about guest memory: SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG, and memfds that
//! do not hold what the regions say.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::session::{any, Ctx, Running, Setup, GPA, MIB};
use crate::support::raw_frontend::{mem_table, pf, req, single_region, Conn, Region};
use crate::support::raw_ring::{self as rr, Guest, Ring};
use crate::{Class, Expect};

/// A second frontend address range, far from [`GPA`].
const GPA2: u64 = 0x2_0000_0000;

fn reg(gpa: u64, size: u64, offset: u64) -> Region {
    Region {
        gpa,
        size,
        uaddr: gpa,
        offset,
    }
}

/// SET_MEM_TABLE with `num` regions claimed, `regions` sent and `fds` attached: refused.
fn bad_table(cx: &Ctx, num: u32, regions: &[Region], fds: &[RawFd]) -> Result<(), String> {
    let p = mem_table(num, regions);
    cx.ready()?
        .refused("SET_MEM_TABLE", req::SET_MEM_TABLE, &p, fds)
}

/// One 1 MiB memfd-backed region at [`GPA`], with `regions` describing it: refused.
fn bad_regions(cx: &Ctx, regions: &[Region]) -> Result<(), String> {
    let g = Guest::new(MIB, true, GPA);
    let fds = vec![g.fd(); regions.len()];
    bad_table(cx, regions.len() as u32, regions, &fds)
}

/// Ready, and CONFIGURE_MEM_SLOTS negotiated.
fn slots(cx: &Ctx) -> Result<Conn, String> {
    let c = cx.ready()?;
    if !c.has(pf::CONFIGURE_MEM_SLOTS) {
        return Err("the daemon does not offer CONFIGURE_MEM_SLOTS".into());
    }
    Ok(c)
}

fn add(c: &mut Conn, r: &Region, fd: RawFd) -> Result<(), String> {
    c.ok("ADD_MEM_REG", req::ADD_MEM_REG, &single_region(r), &[fd])
}

/// A region of a `file_len`-byte memfd that reaches past its end must be refused. If it
/// is accepted, show what that costs: a ring at `ring_at` (no file behind it) and a kick.
fn past_eof(cx: &Ctx, file_len: usize, r: Region, ring_at: usize, add: bool) -> Result<(), String> {
    let mut c = if add { slots(cx)? } else { cx.ready()? };
    let g = Guest::new(file_len, true, GPA);
    let (code, p, what) = if add {
        (req::ADD_MEM_REG, single_region(&r), "ADD_MEM_REG")
    } else {
        (req::SET_MEM_TABLE, mem_table(1, &[r]), "SET_MEM_TABLE")
    };
    let what = format!(
        "{what} of {:#x} bytes at file offset {:#x}, {file_len:#x}-byte memfd",
        r.size, r.offset
    );
    let accepted = c.refused(&what, code, &p, &[g.fd()]);
    if accepted.is_err() {
        let (kick, call) = (rr::eventfd(0, true), rr::eventfd(0, true));
        let ring = Ring::new(0, ring_at);
        let _ = ring.start(&mut c, &g, kick.as_raw_fd(), call.as_raw_fd());
        let _ = rr::write_u64(kick.as_raw_fd(), 1);
        std::thread::sleep(Duration::from_millis(300));
        let _ = c.responsive();
    }
    accepted
}

/// A ring runs on an unsealed memfd, which is then truncated to nothing, and kicked. (A
/// daemon may also refuse memfds that are not sealed against shrinking.)
fn shrunk(cx: &Ctx, add_mem_reg: bool) -> Result<(), String> {
    let setup = Setup {
        add_mem_reg,
        sealed: false,
        ..Setup::default()
    };
    let Some(mut r) = Running::try_start(cx, setup)? else {
        return Ok(());
    };
    r.g.shrink(0);
    r.kick();
    std::thread::sleep(Duration::from_millis(300));
    r.stop()
}

/// A running ring's memory goes away (REM_MEM_REG, or a SET_MEM_TABLE without it; any
/// answer); then a write and a kick.
fn pulled(cx: &Ctx, add_mem_reg: bool) -> Result<(), String> {
    let setup = Setup {
        add_mem_reg,
        ..Setup::default()
    };
    let mut r = Running::start(cx, setup)?;
    let g2 = Guest::new(MIB, true, GPA2);
    if add_mem_reg {
        let p = single_region(&r.g.region());
        any(&mut r.c, "REM_MEM_REG", req::REM_MEM_REG, &p, &[])?;
    } else {
        let p = mem_table(1, &[g2.region()]);
        any(
            &mut r.c,
            "SET_MEM_TABLE",
            req::SET_MEM_TABLE,
            &p,
            &[g2.fd()],
        )?;
    }
    r.ring.write_req(&r.g, 2, 0x5a, None);
    r.kick();
    std::thread::sleep(Duration::from_millis(200));
    r.stop()
}

pub fn classes() -> Vec<Class> {
    use Expect::*;
    vec![
        Class {
            name: "mem_table_zero_regions",
            expect: Refused,
            what: "SET_MEM_TABLE with no region",
            run: |cx| bad_table(cx, 0, &[], &[]),
        },
        Class {
            name: "mem_table_overlapping_regions",
            expect: Refused,
            what: "two 1 MiB regions, the second starting 512 KiB into the first",
            run: |cx| {
                let (g1, g2) = (Guest::new(MIB, true, GPA), Guest::new(MIB, true, GPA));
                let mut r2 = reg(GPA + (MIB / 2) as u64, MIB as u64, 0);
                r2.uaddr = GPA2;
                bad_table(cx, 2, &[g1.region(), r2], &[g1.fd(), g2.fd()])
            },
        },
        Class {
            name: "mem_table_zero_size_region",
            expect: Refused,
            what: "a region of 0 bytes",
            run: |cx| bad_regions(cx, &[reg(GPA, 0, 0)]),
        },
        Class {
            name: "mem_table_huge_region",
            expect: Refused,
            what: "a region of 2^62 bytes on a 1 MiB memfd",
            run: |cx| bad_regions(cx, &[reg(GPA, 1 << 62, 0)]),
        },
        Class {
            name: "mem_table_unaligned_mmap_offset",
            expect: Refused,
            what: "mmap_offset 0x123",
            run: |cx| bad_regions(cx, &[reg(GPA, 0x10000, 0x123)]),
        },
        Class {
            name: "mem_table_mmap_offset_overflows",
            expect: Refused,
            what: "mmap_offset 0xffff_ffff_ffff_f000 + 64 KiB",
            run: |cx| bad_regions(cx, &[reg(GPA, 0x10000, !0xfff)]),
        },
        Class {
            name: "mem_table_address_overflows",
            expect: Refused,
            what: "guest address 0xffff_ffff_ffff_f000 + 64 KiB",
            run: |cx| bad_regions(cx, &[reg(!0xfff, 0x10000, 0)]),
        },
        Class {
            name: "mem_table_count_disagrees",
            expect: Refused,
            what: "num_regions 2, one region and one fd sent",
            run: |cx| {
                let g = Guest::new(MIB, true, GPA);
                bad_table(cx, 2, &[g.region()], &[g.fd()])
            },
        },
        Class {
            name: "mem_table_more_fds_than_regions",
            expect: Refused,
            what: "one region, two fds",
            run: |cx| {
                let g = Guest::new(MIB, true, GPA);
                bad_table(cx, 1, &[g.region()], &[g.fd(), g.fd()])
            },
        },
        Class {
            name: "mem_table_fewer_fds_than_regions",
            expect: Refused,
            what: "two regions, one fd",
            run: |cx| {
                let (g1, g2) = (Guest::new(MIB, true, GPA), Guest::new(MIB, true, GPA2));
                bad_table(cx, 2, &[g1.region(), g2.region()], &[g1.fd()])
            },
        },
        Class {
            name: "mem_table_without_fd",
            expect: Refused,
            what: "one region, no fd",
            run: |cx| bad_table(cx, 1, &[reg(GPA, MIB as u64, 0)], &[]),
        },
        Class {
            name: "mem_table_fd_is_a_pipe",
            expect: Refused,
            what: "one region whose fd is a pipe",
            run: |cx| {
                let (r, _w) = rr::pipe();
                bad_table(cx, 1, &[reg(GPA, MIB as u64, 0)], &[r.as_raw_fd()])
            },
        },
        Class {
            name: "mem_table_fd_on_a_disk_file_system",
            expect: Refused,
            what: "one region whose fd is a 1 MiB file on a disk file system (not tmpfs)",
            run: |cx| {
                let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
                std::fs::create_dir_all(dir).unwrap();
                let f = tempfile::tempfile_in(dir).unwrap();
                f.set_len(MIB as u64).unwrap();
                bad_table(cx, 1, &[reg(GPA, MIB as u64, 0)], &[f.as_raw_fd()])
            },
        },
        Class {
            name: "mem_table_fd_is_a_socket",
            expect: Refused,
            what: "one region whose fd is a Unix socket",
            run: |cx| {
                let (a, _b) = UnixStream::pair().unwrap();
                bad_table(cx, 1, &[reg(GPA, MIB as u64, 0)], &[a.as_raw_fd()])
            },
        },
        Class {
            name: "mem_table_region_past_end_of_file",
            expect: Refused,
            what: "a 1 MiB region at offset 64 KiB of a 1 MiB memfd",
            run: |cx| past_eof(cx, MIB, reg(GPA, MIB as u64, 0x10000), 0xf0000, false),
        },
        Class {
            name: "mem_table_region_larger_than_file",
            expect: Refused,
            what: "a 1 MiB region on a 64 KiB memfd",
            run: |cx| past_eof(cx, 64 << 10, reg(GPA, MIB as u64, 0), 0x80000, false),
        },
        Class {
            name: "mem_table_shrunk_under_running_ring",
            expect: Survives,
            what: "SET_MEM_TABLE, ring started, memfd truncated to 0, kick",
            run: |cx| shrunk(cx, false),
        },
        Class {
            name: "mem_table_replaced_under_running_ring",
            expect: Survives,
            what: "ring started, SET_MEM_TABLE without the ring's region, a write and a kick",
            run: |cx| pulled(cx, false),
        },
        Class {
            name: "add_mem_reg_overlap",
            expect: Refused,
            what: "ADD_MEM_REG of a region starting 512 KiB into one already added",
            run: |cx| {
                let mut c = slots(cx)?;
                let (g1, g2) = (Guest::new(MIB, true, GPA), Guest::new(MIB, true, GPA));
                add(&mut c, &g1.region(), g1.fd())?;
                let mut r = reg(GPA + (MIB / 2) as u64, MIB as u64, 0);
                r.uaddr = GPA2;
                c.refused(
                    "overlapping ADD_MEM_REG",
                    req::ADD_MEM_REG,
                    &single_region(&r),
                    &[g2.fd()],
                )
            },
        },
        Class {
            name: "add_mem_reg_duplicate",
            expect: Refused,
            what: "the same ADD_MEM_REG twice",
            run: |cx| {
                let mut c = slots(cx)?;
                let g = Guest::new(MIB, true, GPA);
                add(&mut c, &g.region(), g.fd())?;
                let p = single_region(&g.region());
                c.refused(
                    "a second identical ADD_MEM_REG",
                    req::ADD_MEM_REG,
                    &p,
                    &[g.fd()],
                )
            },
        },
        Class {
            name: "add_mem_reg_beyond_max_slots",
            expect: Refused,
            what: "GET_MAX_MEM_SLOTS regions of 4 KiB added (all acked), then one more",
            run: |cx| {
                let mut c = slots(cx)?;
                let n = c.get_u64("GET_MAX_MEM_SLOTS", req::GET_MAX_MEM_SLOTS)?;
                if n == 0 || n > 4096 {
                    return Err(format!("GET_MAX_MEM_SLOTS says {n}"));
                }
                let g = Guest::new(4096, true, GPA);
                let r = |i: u64| reg(GPA + (i << 16), 4096, 0);
                for i in 0..n {
                    c.ok(
                        &format!("ADD_MEM_REG {} of {n}", i + 1),
                        req::ADD_MEM_REG,
                        &single_region(&r(i)),
                        &[g.fd()],
                    )?;
                }
                let what = format!("ADD_MEM_REG {} with GET_MAX_MEM_SLOTS {n}", n + 1);
                c.refused(&what, req::ADD_MEM_REG, &single_region(&r(n)), &[g.fd()])
            },
        },
        Class {
            name: "add_mem_reg_without_fd",
            expect: Refused,
            what: "ADD_MEM_REG with no fd",
            run: |cx| {
                let p = single_region(&reg(GPA, MIB as u64, 0));
                slots(cx)?.refused("ADD_MEM_REG without fd", req::ADD_MEM_REG, &p, &[])
            },
        },
        Class {
            name: "add_mem_reg_two_fds",
            expect: Refused,
            what: "ADD_MEM_REG with two fds",
            run: |cx| {
                let g = Guest::new(MIB, true, GPA);
                let p = single_region(&g.region());
                slots(cx)?.refused(
                    "ADD_MEM_REG, 2 fds",
                    req::ADD_MEM_REG,
                    &p,
                    &[g.fd(), g.fd()],
                )
            },
        },
        Class {
            name: "add_mem_reg_zero_size",
            expect: Refused,
            what: "ADD_MEM_REG of 0 bytes",
            run: |cx| {
                let g = Guest::new(MIB, true, GPA);
                let p = single_region(&reg(GPA, 0, 0));
                slots(cx)?.refused("ADD_MEM_REG of 0 bytes", req::ADD_MEM_REG, &p, &[g.fd()])
            },
        },
        Class {
            name: "add_mem_reg_past_end_of_file",
            expect: Refused,
            what: "ADD_MEM_REG of 1 MiB on a 64 KiB memfd",
            run: |cx| past_eof(cx, 64 << 10, reg(GPA, MIB as u64, 0), 0x80000, true),
        },
        Class {
            name: "add_mem_reg_shrunk_under_running_ring",
            expect: Survives,
            what: "ADD_MEM_REG, ring started, memfd truncated to 0, kick",
            run: |cx| shrunk(cx, true),
        },
        Class {
            name: "rem_mem_reg_unknown",
            expect: Refused,
            what: "REM_MEM_REG of a region never added",
            run: |cx| {
                let mut c = slots(cx)?;
                let g = Guest::new(MIB, true, GPA);
                add(&mut c, &g.region(), g.fd())?;
                let p = single_region(&reg(GPA + (16 * MIB) as u64, MIB as u64, 0));
                c.refused(
                    "REM_MEM_REG of an unknown region",
                    req::REM_MEM_REG,
                    &p,
                    &[],
                )
            },
        },
        Class {
            name: "rem_mem_reg_under_running_ring",
            expect: Survives,
            what: "ring started, REM_MEM_REG of its region, a write and a kick",
            run: |cx| pulled(cx, true),
        },
    ]
}
