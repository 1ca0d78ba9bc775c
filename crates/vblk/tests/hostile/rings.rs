//! Classes about started rings: hostile ring content, notification fds that block or
//! never stop, and frontends that leave or reset with requests in flight.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::session::{any, Ctx, Running, Setup, GPA};
use crate::support::raw_frontend::req;
use crate::support::raw_ring::{self as rr, DESC_NEXT, SLOTS};
use crate::{Class, Expect};

const SETTLE: Duration = Duration::from_millis(300);

/// Kick, let the daemon chew on it, then stopping the ring must be answered.
fn kick_and_stop(r: &mut Running) -> Result<(), String> {
    r.kick();
    std::thread::sleep(SETTLE);
    r.stop()
}

/// A write whose data descriptor is (`addr`, `len`): it must not complete OK.
fn bad_data(cx: &Ctx, addr: u64, len: u32) -> Result<(), String> {
    let mut r = Running::start(cx, Setup::default())?;
    let slot = r.ring.write_req(&r.g, 4, 0x77, Some((addr, len)));
    r.kick();
    if r.ring.wait_used(&r.g, 2, Duration::from_secs(2)) && r.ring.status(&r.g, slot) == 0 {
        return Err(format!("a write of {len} bytes at {addr:#x} completed OK"));
    }
    r.stop()
}

/// Four more writes on a started ring (slots 1-4; slot 0 served the check).
fn writes(r: &mut Running) {
    for i in 0..SLOTS - 1 {
        r.ring.write_req(&r.g, 8 + u64::from(i), i as u8, None);
    }
}

/// A ring whose call fd is `call`; writes, a kick, and the ring stopped.
fn blocked_call(cx: &Ctx, call: OwnedFd) -> Result<(), String> {
    let setup = Setup {
        call: Some(call),
        ..Setup::default()
    };
    let mut r = Running::start(cx, setup)?;
    writes(&mut r);
    kick_and_stop(&mut r)
}

/// A thread that keeps a pipe full until dropped (or until the reader is gone).
struct KeepFull {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KeepFull {
    fn start(w: OwnedFd) -> KeepFull {
        rr::set_nonblock(w.as_raw_fd(), true);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let chunk = [0x11u8; 4096];
            while !s.load(Ordering::Relaxed) {
                // SAFETY: `chunk` is valid for its length during the call; `w` is ours.
                let n = unsafe { libc::write(w.as_raw_fd(), chunk.as_ptr().cast(), chunk.len()) };
                if n < 0 {
                    match std::io::Error::last_os_error().raw_os_error() {
                        Some(libc::EAGAIN) => std::thread::sleep(Duration::from_millis(1)),
                        _ => break,
                    }
                }
            }
        });
        KeepFull {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for KeepFull {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The frontend makes the call fd it shares with the device blocking after the device
/// took it (the flag lives in the shared open file description), and fills it; then
/// writes and a kick. The device must not block on it: it ends the session or answers,
/// in time either way.
fn call_made_blocking(cx: &mut Ctx, call: OwnedFd, fill: impl FnOnce(RawFd)) -> Result<(), String> {
    let setup = Setup {
        call: Some(call),
        ..Setup::default()
    };
    let mut r = Running::start(cx, setup)?;
    fill(r.call_fd());
    rr::set_nonblock(r.call_fd(), false);
    writes(&mut r);
    kick_and_stop(&mut r)
}

pub fn classes() -> Vec<Class> {
    use Expect::*;
    vec![
        Class {
            name: "ring_avail_idx_far_ahead",
            expect: Survives,
            what: "avail index 1000 entries ahead of the 16-entry ring, kick",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                r.ring.set_avail_idx(&r.g, 1001);
                kick_and_stop(&mut r)
            },
        },
        Class {
            name: "ring_head_out_of_range",
            expect: Survives,
            what: "an avail entry naming descriptor 300 of 16, kick",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                r.ring.push(&r.g, 300);
                kick_and_stop(&mut r)
            },
        },
        Class {
            name: "ring_descriptor_loop",
            expect: Survives,
            what: "a chain 0 -> 1 -> 0 -> ..., kick",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                let (hdr, _, buf) = r.ring.slot_addrs(&r.g, 0);
                r.ring.desc(&r.g, 0, hdr, 16, DESC_NEXT, 1);
                r.ring.desc(&r.g, 1, buf, 512, DESC_NEXT, 0);
                r.ring.push(&r.g, 0);
                kick_and_stop(&mut r)
            },
        },
        Class {
            name: "ring_data_outside_memory",
            expect: Survives,
            what: "a write whose data is 64 MiB past the region (must not complete OK)",
            run: |cx| bad_data(cx, GPA + (64 << 20), 512),
        },
        Class {
            name: "ring_data_4_gib_long",
            expect: Survives,
            what: "a write whose data descriptor is 4 GiB - 512 long (must not complete OK)",
            run: |cx| bad_data(cx, GPA + 0x4000, u32::MAX - 511),
        },
        Class {
            name: "call_eventfd_saturated",
            expect: Survives,
            what: "a blocking call eventfd holding 0xffff_ffff_ffff_fffe, writes, kick",
            run: |cx| blocked_call(cx, rr::eventfd(u64::MAX - 1, false)),
        },
        Class {
            name: "call_pipe_full",
            expect: Survives,
            what: "the call fd is a full, blocking pipe nobody reads; writes, kick",
            run: |cx| {
                let (r, w) = rr::pipe();
                rr::fill_pipe(w.as_raw_fd());
                cx.keep.push(Box::new(r));
                blocked_call(cx, w)
            },
        },
        Class {
            name: "kick_pipe_kept_full",
            expect: Survives,
            what: "the kick fd is a pipe kept full (also while the next frontend runs)",
            run: |cx| {
                let (rd, w) = rr::pipe();
                let via = w.try_clone().unwrap();
                let setup = Setup {
                    kick: Some((rd, via)),
                    ..Setup::default()
                };
                let mut r = Running::start(cx, setup)?;
                cx.keep.push(Box::new(KeepFull::start(w)));
                writes(&mut r);
                kick_and_stop(&mut r)
            },
        },
        Class {
            name: "kick_pipe_writer_gone",
            expect: Survives,
            what: "the kick fd is a pipe whose write end is closed (EOF for ever)",
            run: |cx| {
                let (rd, w) = rr::pipe();
                let setup = Setup {
                    kick: Some((rd, w)),
                    ..Setup::default()
                };
                let mut r = Running::start(cx, setup)?;
                writes(&mut r);
                r.kick();
                r.close_kick();
                std::thread::sleep(SETTLE);
                r.stop()
            },
        },
        Class {
            name: "kick_pipe_full_then_close",
            expect: Survives,
            what: "the kick fd is a pipe filled, then the session closed without stopping",
            run: |cx| {
                let (rd, w) = rr::pipe();
                let via = w.try_clone().unwrap();
                let setup = Setup {
                    kick: Some((rd, via)),
                    ..Setup::default()
                };
                let mut r = Running::start(cx, setup)?;
                writes(&mut r);
                rr::fill_pipe(w.as_raw_fd());
                cx.keep.push(Box::new(w));
                r.c.close();
                Ok(())
            },
        },
        Class {
            name: "call_eventfd_made_blocking_after_setup",
            expect: Survives,
            what: "the call eventfd is made blocking and saturated after the device took it",
            run: |cx| {
                call_made_blocking(cx, rr::eventfd(0, true), |fd| {
                    // Empty the counter (the first write's call), then saturate it.
                    let mut b = [0u8; 8];
                    // SAFETY: reads 8 bytes into a live local from our eventfd.
                    unsafe { libc::read(fd, b.as_mut_ptr().cast(), 8) };
                    rr::write_u64(fd, u64::MAX - 1).expect("saturate the call eventfd");
                })
            },
        },
        Class {
            name: "call_pipe_made_blocking_after_setup",
            expect: Survives,
            what: "the call pipe is filled and made blocking after the device took it",
            run: |cx| {
                let (r, w) = rr::pipe();
                cx.keep.push(Box::new(r));
                call_made_blocking(cx, w, rr::fill_pipe)
            },
        },
        Class {
            name: "call_socket_full",
            expect: Survives,
            what: "the call fd is one end of a socket pair nobody reads, filled",
            run: |cx| {
                let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
                cx.keep.push(Box::new(b));
                call_made_blocking(cx, OwnedFd::from(a), |fd| {
                    rr::set_nonblock(fd, true);
                    while rr::write_u64(fd, 1).is_ok() {}
                })
            },
        },
        Class {
            name: "err_eventfd_made_blocking_after_setup",
            expect: Survives,
            what: "SET_VRING_ERR with an eventfd made blocking and saturated, then a head out of range",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                let err = rr::eventfd(0, true);
                any(
                    &mut r.c,
                    "SET_VRING_ERR",
                    req::SET_VRING_ERR,
                    &crate::support::raw_frontend::u64p(0),
                    &[err.as_raw_fd()],
                )?;
                let _ = rr::write_u64(err.as_raw_fd(), u64::MAX - 1);
                rr::set_nonblock(err.as_raw_fd(), false);
                r.ring.push(&r.g, 300);
                let out = kick_and_stop(&mut r);
                cx.keep.push(Box::new(err));
                out
            },
        },
        Class {
            name: "kick_pipe_made_blocking_and_drained",
            expect: Survives,
            what: "the kick pipe is made blocking after setup; 20000 kicks each taken back at once by the frontend",
            run: |cx| {
                let (rd, w) = rr::pipe();
                let via = w.try_clone().unwrap();
                let setup = Setup {
                    kick: Some((rd, via)),
                    ..Setup::default()
                };
                let mut r = Running::start(cx, setup)?;
                let ours = r.kick_fd();
                rr::set_nonblock(ours, false);
                writes(&mut r);
                // Kick and take the kick back at once, many times: the device's poll
                // sees the pipe readable, and its read finds it empty (a read that would
                // wait for the next kick, which never comes).
                let mut b = [0u8; 8];
                let iov = libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: 8,
                };
                for _ in 0..20_000 {
                    let _ = rr::write_u64(w.as_raw_fd(), 1);
                    // SAFETY: one iovec naming a live local; RWF_NOWAIT: our own read never
                    // waits, whatever the shared flags say.
                    unsafe { libc::preadv2(ours, &iov, 1, -1, libc::RWF_NOWAIT) };
                }
                std::thread::sleep(SETTLE);
                let out = r.stop();
                drop(w);
                out
            },
        },
        Class {
            name: "disconnect_with_requests_in_flight",
            expect: Survives,
            what: "four writes kicked, then the socket closed at once",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                writes(&mut r);
                r.kick();
                r.c.close();
                Ok(())
            },
        },
        Class {
            name: "reset_owner_with_requests_in_flight",
            expect: Survives,
            what: "four writes kicked, then RESET_OWNER",
            run: |cx| {
                let mut r = Running::start(cx, Setup::default())?;
                writes(&mut r);
                r.kick();
                any(&mut r.c, "RESET_OWNER", req::RESET_OWNER, &[], &[])?;
                r.c.responsive()
            },
        },
    ]
}
