//! Target `vhost_user`: the vhost-user message stream against the device's control plane.
//!
//! Each input is decoded into a session: by default the handshake QEMU does (features,
//! protocol features, owner, memory table, then size, base, addresses, call and kick fds
//! and enable for one or two queues), then a sequence of operations. Most are messages
//! drawn from the real set with mostly valid payloads (queue indexes in range, sizes that
//! are powers of two, ring addresses inside the memory table, regions backed by memfds
//! of the right size) and occasional garbage (bad flags, sizes that lie, wrong or missing
//! fds — a pipe, a memfd shorter than its region —, unknown codes, raw bytes). The others
//! act as the driver and the frontend's host: put requests on a ring and kick it, write
//! raw bytes into guest memory, truncate guest memory under the device.
//!
//! The messages go down one end of a socket pair; a real session (`device::fuzzing`,
//! with its worker thread and a RAM disk) handles them from the other end one at a time,
//! as the daemon does, and the stream ends at the first refusal. Checked: no panic in any
//! thread (libfuzzer-sys aborts on one), no hang (libFuzzer's -timeout), and after every
//! input every file descriptor and guest-memory mapping the session took is released and
//! its worker thread is gone.

mod gen;
pub mod guest;
pub mod wire;

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use device::fuzzing::Connection;
use device::DeviceConfig;
use storage::{Backend, DiskSpec, EngineKind, OpenOptions};

use crate::input::Input;
use gen::{Effect, Fds, Gen, Step, MAX_OPS};
use guest::{Driver, MEM, QUEUES};

/// Longest a kicked queue is waited for.
const KICK_WAIT: Duration = Duration::from_millis(2);

struct Fixture {
    disk: Arc<Backend>,
    configs: [DeviceConfig; 2],
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // The daemon is a Rust program, which ignores SIGPIPE; libFuzzer's main is not.
        // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let spec = DiskSpec::Mem(1 << 20);
        let disk = Backend::open(&spec, &OpenOptions::default()).expect("RAM disk");
        let config = |engine| DeviceConfig {
            disk: spec.clone(),
            num_queues: QUEUES as u16,
            queue_size: 256,
            engine,
            ..DeviceConfig::default()
        };
        Fixture {
            disk: Arc::new(disk),
            configs: [config(EngineKind::Sync), config(EngineKind::IoUring)],
        }
    })
}

/// Run one input.
pub fn run(data: &[u8]) {
    let fx = fixture();
    let fds_before = count_fds();
    session(fx, data);
    let fds_after = count_fds();
    assert_eq!(
        fds_before, fds_after,
        "file descriptors leaked: {fds_before} open before the session, {fds_after} after"
    );
    check_released();
}

fn session(fx: &Fixture, data: &[u8]) {
    let mut inp = Input::new(data);
    let setup = inp.u8();
    let config = &fx.configs[usize::from(setup & 0x80 != 0)];
    let (front, back) = UnixStream::pair().expect("socketpair");
    front.set_nonblocking(true).expect("non-blocking");
    let mut conn = Connection::new(config, &fx.disk, back).expect("session");
    let fds = Fds::new();
    let mut g = Gen {
        inp: &mut inp,
        sock: &front,
        fds: &fds,
        steps: Vec::new(),
        drivers: [Driver::default(); QUEUES],
        full: false,
        clean: true,
    };
    if setup & 1 == 0 {
        g.handshake();
        g.fill_and_kick(0);
    }
    while !g.inp.is_empty() && g.steps.len() < MAX_OPS && !g.full {
        g.op();
    }
    let steps = g.steps;
    // Everything is written: the device reads EOF after the last message, never waits.
    front.shutdown(std::net::Shutdown::Write).expect("shutdown");

    let mut mem_len = MEM;
    let mut started = [false; QUEUES];
    let mut enabled = [true; QUEUES];
    let mut published = [0u16; QUEUES];
    // Per queue: the requests of the last fill while they can be checked, the used
    // index checked up to, and whether anything left the ring in an unknown state.
    let mut pending: [Option<guest::Fill>; QUEUES] = [None, None];
    let mut seen_used = [0u16; QUEUES];
    let mut dirty = [false; QUEUES];
    let mut scratch = vec![0u8; 8192];
    let trace = crate::trace();
    for (i, step) in steps.iter().enumerate() {
        if trace {
            eprintln!("step {i}: {step:?}");
        }
        match step {
            Step::Msg(code, effect) => {
                let r = conn.handle_one();
                if trace {
                    eprintln!("  message {code} -> {r:?}");
                }
                if r.is_err() || conn.poisoned() {
                    break;
                }
                match *effect {
                    Effect::Started(q) => started[q] = true,
                    Effect::Stopped(q) => started[q] = false,
                    Effect::Enabled(q, on) => enabled[q] = on,
                    Effect::Reset => started = [false; QUEUES],
                    Effect::None => {}
                }
                // Replies: read and drop, so that the device never blocks on a full socket.
                while let Ok(n) = (&front).read(&mut scratch) {
                    if n == 0 {
                        break;
                    }
                }
            }
            Step::Write(w) => guest::apply(&fds.mem[0], mem_len, w),
            Step::Fill(f) => {
                guest::apply(&fds.mem[0], mem_len, &f.writes);
                published[f.q] = f.avail;
                pending[f.q] = None;
                if f.checkable {
                    pending[f.q] = Some(guest::Fill {
                        writes: Vec::new(),
                        sent: f.sent.clone(),
                        ..*f
                    });
                }
            }
            Step::Kick(q, wait, check) => {
                let q = *q;
                let _ = (&fds.kick[q]).write(&1u64.to_ne_bytes());
                if !(*wait && started[q] && enabled[q]) {
                    dirty[q] = true;
                    continue;
                }
                let used = || guest::used_idx(&fds.mem[0], q);
                let t = Instant::now();
                while t.elapsed() < KICK_WAIT && used() != Some(published[q]) {
                    std::thread::sleep(Duration::from_micros(20));
                }
                if trace {
                    let (u, p, dt) = (used(), published[q], t.elapsed());
                    eprintln!("  used {u:?} of {p} after {dt:?}");
                }
                if used() != Some(published[q]) {
                    dirty[q] = true; // still working, or the queue stopped
                    continue;
                }
                if let Some(f) = pending[q].take() {
                    if *check && !dirty[q] {
                        check_answers(&fds.mem[0], &f, seen_used[q]);
                    }
                }
                seen_used[q] = published[q];
            }
            Step::Truncate(len) => {
                mem_len = *len;
                fds.mem[0].set_len(*len).expect("truncate");
            }
        }
    }
    if trace {
        eprintln!("poisoned: {}", conn.poisoned());
    }
    // Ends the session: its worker is joined, its mappings and fds released.
    drop(conn);
}

/// The device used exactly the chains of fill `f` (after `from`), each with a status,
/// and completed every request that must succeed with OK and its used length.
fn check_answers(mem: &File, f: &guest::Fill, from: u16) {
    let mut left = f.sent.clone();
    let n = f.avail.wrapping_sub(from);
    assert_eq!(
        usize::from(n),
        left.len(),
        "used index moved by {n} for the {} chains of {f:?}",
        left.len()
    );
    for i in 0..n {
        let Some((id, len)) = guest::used_elem(mem, f.q, f.size, from.wrapping_add(i)) else {
            return; // guest memory truncated: not this check's business
        };
        let k = left
            .iter()
            .position(|s| u32::from(s.head) == id)
            .unwrap_or_else(|| panic!("device used head {id}, not one made available: {f:?}"));
        let s = left.swap_remove(k);
        let status = guest::byte_at(mem, s.status);
        if crate::trace() {
            eprintln!("  checked head {id}: status {status:?}, used length {len}, {s:?}");
        }
        assert!(
            matches!(status, Some(0..=2)),
            "request at head {id} answered with status {status:?} (used length {len}): {f:?}"
        );
        if let Some(ok_len) = s.ok_len {
            assert_eq!(
                (status, len),
                (Some(0), ok_len),
                "request at head {id} must succeed with used length {ok_len}: {f:?}"
            );
        }
    }
}

fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// After a session: no guest memory still mapped and no worker thread left.
fn check_released() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mapped = maps
        .lines()
        .filter(|l| l.contains("memfd:vblk-fuzz"))
        .count();
    assert_eq!(
        mapped, 0,
        "guest memory still mapped after the session:\n{maps}"
    );
    // A joined thread may take a moment to leave /proc.
    for _ in 0..100 {
        if workers() == 0 {
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    panic!(
        "{} worker threads still running after the session",
        workers()
    );
}

fn workers() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| t.ok())
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.starts_with("vblk-worker"))
        })
        .count()
}
