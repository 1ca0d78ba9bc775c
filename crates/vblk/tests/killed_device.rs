//! The device dies under the driver: `vblk serve` runs as a child and is SIGKILLed while
//! I/O is outstanding. Every outstanding I/O must complete — with
//! `ErrorKind::Disconnected`, or OK if the device finished it first — within a bounded
//! time, later submissions must fail with `Disconnected`, nothing may hang, and a daemon
//! restarted on the same (stale) socket path must serve a new attach, with every write
//! that was acknowledged before the kill still there.
//!
//! A watchdog ([`within`]) turns any hang into a test failure.

mod support;

use std::sync::mpsc;

use support::util::{die_with_parent, stamp, temp_dir, within, MAGIC};

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use driver::{Disk, DiskOptions, ErrorKind, Queue};

const SECTOR: usize = 512;
const MIB: usize = 1 << 20;
/// The most one wait may take before the driver is called hung.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a test body may take.
const TEST_LIMIT: Duration = Duration::from_secs(120);

// ---- the daemon ----

/// `vblk serve` as a child, killed and reaped on every way out of the test.
struct Serve {
    child: Child,
    log: PathBuf,
}

impl Serve {
    /// Serve `blk_file` with `num_queues` queues on `sock`; returns once it listens.
    fn start(sock: &Path, blk_file: &str, num_queues: u16, log: PathBuf) -> Serve {
        let out = fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
        cmd.args(["--log-level", "info", "serve", "--socket-path"])
            .arg(sock)
            .args(["--blk-file", blk_file, "--num-queues"])
            .arg(num_queues.to_string())
            .args(["--threads", "2"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        die_with_parent(&mut cmd);
        let mut s = Serve {
            child: cmd.spawn().expect("cannot start vblk serve"),
            log,
        };
        // "listening on PATH" is logged once the socket is bound and listening (the file
        // alone proves nothing: a stale one may be there from a killed daemon).
        let deadline = Instant::now() + Duration::from_secs(20);
        while !s.log_text().contains("listening on") {
            if let Some(st) = s.child.try_wait().unwrap() {
                panic!(
                    "vblk serve exited ({st}) before listening:\n{}",
                    s.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "vblk serve not listening after 20 s:\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the (killed) daemon is gone; it must have died of SIGKILL.
    fn reap(&mut self) {
        use std::os::unix::process::ExitStatusExt;
        let st = self.child.wait().unwrap();
        assert_eq!(st.signal(), Some(libc::SIGKILL), "vblk serve: {st}");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // An error means it is already gone, which is what we want.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Send `sig` to process `pid`, a child of this test that has not been reaped.
fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) touches no memory of ours. `pid` is an unreaped child (Serve reaps
    // only in reap/Drop, after the last signal), so it cannot name another process.
    let r = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        r,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// Stop child `pid` (SIGSTOP) and wait until every one of its threads has stopped: kill
/// returns at once, and a device thread busy polling its ring would otherwise still pick
/// up what is submitted next.
fn freeze(pid: i32) {
    signal(pid, libc::SIGSTOP);
    let mut status = 0;
    // SAFETY: waitpid writes only `status`, a valid c_int. A stopped child is reported,
    // not reaped, so `Child` still owns the pid afterwards.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFSTOPPED(status),
        "vblk serve did not stop (status {status:#x})"
    );
}

fn attach(sock: &Path, pool_size: usize) -> Disk {
    Disk::attach(
        sock,
        &DiskOptions {
            pool_size,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("cannot attach to {}: {e}", sock.display()))
}

// ---- stamped data ----

/// What sector `lba` holds: None for zeroes, Some(write id) for an intact stamp of that
/// sector; anything else (torn, misplaced, garbage) is an error that says what it is.
fn sector_owner(s: &[u8], lba: u64) -> Result<Option<u32>, String> {
    if s.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    if &s[..4] != MAGIC {
        return Err(format!("unstamped bytes {:02x?}...", &s[..16]));
    }
    let id = u32::from_le_bytes(s[4..8].try_into().unwrap());
    let mut want = [0u8; SECTOR];
    stamp(&mut want, id, lba);
    if want[..] == *s {
        Ok(Some(id))
    } else {
        let at = u64::from_le_bytes(s[8..16].try_into().unwrap());
        Err(format!(
            "a sector that claims write #{id}, sector {at}, and does not match it"
        ))
    }
}

// ---- tests ----

/// The device is frozen (SIGSTOP) so nothing it was given can complete, 64 writes of 1 MiB
/// go on queue 0 and a read on queue 1 whose thread then sleeps in `wait`, and the device
/// is killed: all 65 complete with Disconnected, promptly, and the queues refuse new work.
#[test]
fn outstanding_ios_fail_with_disconnected_when_the_device_is_killed() {
    let dir = temp_dir("killed");
    let sock = dir.path().join("vblk.sock");
    let serve = Serve::start(&sock, "mem:256M", 2, dir.path().join("serve.log"));
    let pid = serve.pid();
    within(TEST_LIMIT, "I/O against a killed device", move || {
        let disk = attach(&sock, 160 * MIB);
        let mut q0 = disk.take_queue(0).unwrap();
        let mut q1 = disk.take_queue(1).unwrap();
        q0.write_at(0, &[1u8; 4096]).unwrap();
        freeze(pid);

        let (tx, rx) = mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let buf = q1.alloc(64 << 10).unwrap();
            q1.read(0, buf, 7).unwrap();
            tx.send(()).unwrap();
            let c = q1.wait(Some(IO_TIMEOUT));
            (q1, c)
        });
        for i in 0..64u64 {
            let mut b = q0.alloc(MIB).unwrap();
            b.fill(i as u8);
            q0.write(i * MIB as u64, b, i).unwrap();
        }
        assert_eq!(q0.in_flight(), 64);
        rx.recv_timeout(IO_TIMEOUT).unwrap();
        // Let the waiter get past its spin and fall asleep in poll.
        std::thread::sleep(Duration::from_millis(200));
        signal(pid, libc::SIGKILL);

        let mut seen = [false; 64];
        while q0.in_flight() > 0 {
            let c = q0
                .wait(Some(IO_TIMEOUT))
                .unwrap_or_else(|e| panic!("{} writes never completed: {e}", q0.in_flight()));
            let t = c.token as usize;
            assert_eq!(
                c.result,
                Err(ErrorKind::Disconnected),
                "write {t} (the device was frozen, so it cannot have done it)"
            );
            assert!(!seen[t], "write {t} completed twice");
            seen[t] = true;
            let b = c.bufs.into_one().expect("the buffer comes back");
            assert!(b.len() == MIB && b.iter().all(|&x| x == t as u8));
        }
        assert!(seen.iter().all(|&s| s), "every write completed");
        assert!(q0.poll().is_none());

        let (mut q1, c) = waiter.join().unwrap();
        let c = c.unwrap_or_else(|e| panic!("the waiter on queue 1 was not woken: {e}"));
        assert_eq!((c.token, c.result), (7, Err(ErrorKind::Disconnected)));
        assert_eq!(c.bufs.into_one().map(|b| b.len()), Some(64 << 10));

        // From now on every submission is refused at once, and buffers come back.
        for q in [&mut q0, &mut q1] {
            let i = q.index();
            let e = q.write(0, q.alloc(4096).unwrap(), 1).unwrap_err();
            assert_eq!(
                e.error.kind(),
                ErrorKind::Disconnected,
                "queue {i}: {}",
                e.error
            );
            assert_eq!(e.bufs.into_one().map(|b| b.len()), Some(4096));
            let e = q.readv(0, vec![q.alloc(512).unwrap()], 2).unwrap_err();
            assert_eq!(e.error.kind(), ErrorKind::Disconnected);
            assert_eq!(e.bufs.into_vec().len(), 1);
            for e in [
                q.flush(3).unwrap_err(),
                q.discard(0, 4096, 4).unwrap_err(),
                q.write_zeroes(0, 4096, false, 5).unwrap_err(),
            ] {
                assert_eq!(
                    e.error.kind(),
                    ErrorKind::Disconnected,
                    "queue {i}: {}",
                    e.error
                );
            }
            let mut b = [0u8; 512];
            assert_eq!(
                q.read_at(0, &mut b).unwrap_err().kind(),
                ErrorKind::Disconnected
            );
            assert_eq!(
                q.write_at(0, &b).unwrap_err().kind(),
                ErrorKind::Disconnected
            );
            assert_eq!(q.flush_sync().unwrap_err().kind(), ErrorKind::Disconnected);
            assert_eq!(
                q.in_flight(),
                0,
                "queue {i}: refused I/Os are not in flight"
            );
            assert!(q.poll().is_none());
            let e = q.wait(Some(Duration::from_secs(1))).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        }
        // Dropping queues and disk of a dead device does not wait for it.
        let t = Instant::now();
        drop((q0, q1, disk));
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "drop took {:?}",
            t.elapsed()
        );
    });
    drop(serve);
}

/// What one queue's writer did before and after the kill.
#[derive(Default)]
struct Log {
    /// Per slot, the writes sent to it in order, with whether each was acknowledged.
    slots: Vec<Vec<(u32, bool)>>,
    ok: usize,
    disconnected: usize,
    refused: usize,
}

/// Keep `depth` writes of `slot_size` in flight on `q`, cycling over `nslots` slots from
/// byte `base`, until the device is found gone; then collect every outstanding I/O. Each
/// write names its slot's sectors (see [`stamp`]). `warm` is signalled once `depth` writes
/// have completed.
fn writer(
    q: &mut Queue,
    base: u64,
    slot_size: usize,
    nslots: usize,
    depth: usize,
    warm: mpsc::Sender<()>,
) -> Log {
    let qi = q.index();
    let mut log = Log {
        slots: vec![Vec::new(); nslots],
        ..Default::default()
    };
    let mut sent: HashMap<u64, (usize, usize)> = HashMap::new();
    let mut free = Vec::new();
    let mut next: u32 = u32::from(qi) << 24;
    let mut gone = false;
    let mut warm = Some(warm);
    loop {
        while !gone && q.in_flight() < depth {
            let slot = next as usize % nslots;
            let off = base + (slot * slot_size) as u64;
            let mut b = match free.pop() {
                Some(b) => b,
                None => q.alloc(slot_size).unwrap(),
            };
            stamp(&mut b, next, off / SECTOR as u64);
            match q.write(off, b, u64::from(next)) {
                Ok(()) => {
                    sent.insert(u64::from(next), (slot, log.slots[slot].len()));
                    log.slots[slot].push((next, false));
                }
                Err(e) => {
                    assert_eq!(
                        e.error.kind(),
                        ErrorKind::Disconnected,
                        "queue {qi}: {}",
                        e.error
                    );
                    free.extend(e.bufs.into_one());
                    log.refused += 1;
                    gone = true;
                }
            }
            next += 1;
        }
        if q.in_flight() == 0 {
            break;
        }
        let c = q.wait(Some(IO_TIMEOUT)).unwrap_or_else(|e| {
            panic!(
                "queue {qi}: {} writes outstanding, none completes: {e}",
                q.in_flight()
            )
        });
        let (slot, i) = sent
            .remove(&c.token)
            .unwrap_or_else(|| panic!("queue {qi}: token {} unknown or completed twice", c.token));
        match c.result {
            Ok(()) => {
                log.slots[slot][i].1 = true;
                log.ok += 1;
                if log.ok >= depth {
                    if let Some(w) = warm.take() {
                        let _ = w.send(());
                    }
                }
            }
            Err(ErrorKind::Disconnected) => {
                log.disconnected += 1;
                gone = true;
            }
            Err(e) => panic!(
                "queue {qi}: write {} failed with {e:?}, not Disconnected",
                c.token
            ),
        }
        free.extend(c.bufs.into_one());
    }
    assert!(
        sent.is_empty(),
        "queue {qi}: {} writes never completed",
        sent.len()
    );
    // After the device is gone every new submission is refused.
    let e = q.write(base, free.pop().unwrap(), 0).unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::Disconnected, "{}", e.error);
    log
}

/// Check `data` (bytes from `base`, slots of `slot_size`) against what `log` says was
/// written: a slot whose last write was acknowledged holds it exactly; any other sector
/// holds its slot's last acknowledged write or a later unacknowledged one (or zeroes if
/// none was acknowledged) — never anything torn or misplaced.
fn check_slots(data: &[u8], base: u64, slot_size: usize, log: &Log) -> (usize, usize) {
    let (mut exact, mut either) = (0, 0);
    for (slot, writes) in log.slots.iter().enumerate() {
        let last_ok = writes.iter().rposition(|&(_, ok)| ok);
        let allowed: Vec<u32> = writes[last_ok.unwrap_or(0)..]
            .iter()
            .map(|&(id, _)| id)
            .collect();
        let at = slot * slot_size;
        for (i, s) in data[at..at + slot_size].chunks(SECTOR).enumerate() {
            let lba = (base as usize + at) as u64 / SECTOR as u64 + i as u64;
            let owner = sector_owner(s, lba).unwrap_or_else(|e| panic!("sector {lba}: {e}"));
            let fine = match (last_ok, owner) {
                (Some(k), Some(id)) if k + 1 == writes.len() => id == writes[k].0,
                (Some(_), Some(id)) => allowed.contains(&id),
                (Some(_), None) => false,
                (None, None) => true,
                (None, Some(id)) => allowed.contains(&id),
            };
            assert!(
                fine,
                "sector {lba} (slot {slot}) holds {owner:?}; its writes were {writes:?}: an \
                 acknowledged write was lost"
            );
        }
        match last_ok {
            Some(k) if k + 1 == writes.len() => exact += 1,
            _ if !writes.is_empty() => either += 1,
            _ => {}
        }
    }
    (exact, either)
}

/// Two queues writing flat out to a file (1 MiB × 64 in flight on one, 64 KiB × 32 on the
/// other) when the device is SIGKILLed: every I/O completes once (OK or Disconnected),
/// nothing hangs, later submissions are refused. A daemon restarted on the stale socket
/// then serves a new attach, and every acknowledged write is in the file.
#[test]
fn killed_under_load_every_io_completes_once_and_acked_writes_survive_a_restart() {
    let dir = temp_dir("killed");
    let sock = dir.path().join("vblk.sock");
    let img = dir.path().join("disk.img");
    let capacity = 192 * MIB;
    fs::File::create(&img)
        .unwrap()
        .set_len(capacity as u64)
        .unwrap();
    let spec = img.to_str().unwrap().to_string();
    let mut serve = Serve::start(&sock, &spec, 2, dir.path().join("serve.log"));
    let pid = serve.pid();
    let s = sock.clone();
    let (log0, log1) = within(
        TEST_LIMIT,
        "I/O under load against a killed device",
        move || {
            let disk = attach(&s, 100 * MIB);
            let mut q0 = disk.take_queue(0).unwrap();
            let mut q1 = disk.take_queue(1).unwrap();
            let (tx, rx) = mpsc::channel();
            let tx1 = tx.clone();
            let t0 = std::thread::spawn(move || writer(&mut q0, 0, MIB, 128, 64, tx));
            let t1 = std::thread::spawn(move || {
                writer(&mut q1, 128 * MIB as u64, 64 << 10, 1024, 32, tx1)
            });
            for _ in 0..2 {
                rx.recv_timeout(IO_TIMEOUT).expect("the writers got going");
            }
            signal(pid, libc::SIGKILL);
            let join = |t: std::thread::JoinHandle<Log>| {
                t.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
            };
            let logs = (join(t0), join(t1));
            drop(disk);
            logs
        },
    );
    serve.reap();
    for (q, l) in [(0, &log0), (1, &log1)] {
        eprintln!(
            "queue {q}: {} writes acknowledged, {} completed Disconnected, {} refused",
            l.ok, l.disconnected, l.refused
        );
        assert!(l.ok > 0 && l.disconnected + l.refused > 0);
    }

    // The killed daemon left its socket file behind; attaching to it fails at once.
    assert!(sock.exists(), "the killed daemon's socket file is there");
    let s = sock.clone();
    within(
        Duration::from_secs(20),
        "attach to a dead socket",
        move || {
            let e = Disk::attach(&s, &DiskOptions::default()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Connect, "{e}");
        },
    );

    // Restarted on the same path, the daemon replaces the stale socket and serves.
    let serve2 = Serve::start(&sock, &spec, 2, dir.path().join("serve2.log"));
    assert!(serve2.log_text().contains("removing stale socket"));
    let s = sock.clone();
    within(TEST_LIMIT, "attach after restart", move || {
        let disk = attach(&s, 16 * MIB);
        assert_eq!(disk.info().capacity_bytes, capacity as u64);
        let mut q = disk.take_queue(1).unwrap();
        let mut data = vec![0u8; capacity];
        for (i, chunk) in data.chunks_mut(8 * MIB).enumerate() {
            q.read_at((i * 8 * MIB) as u64, chunk).unwrap();
        }
        let (e0, a0) = check_slots(&data[..128 * MIB], 0, MIB, &log0);
        let (e1, a1) = check_slots(&data[128 * MIB..], 128 * MIB as u64, 64 << 10, &log1);
        eprintln!("slots checked exactly: {e0} + {e1}; last write unacknowledged: {a0} + {a1}");
        assert!(e0 + e1 > 0);
        // And it takes new writes.
        q.write_at(0, &[0x5A; 8192]).unwrap();
        q.flush_sync().unwrap();
        let mut back = [0u8; 8192];
        q.read_at(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0x5A));
    });
    drop(serve2);
}

/// Killed while nothing is outstanding: the next I/O notices, whether the application
/// waits or only polls.
/// A submitter waits for room on a full ring when the device is killed. The kill fails
/// what was in flight and so frees the whole ring: the waiting submission must then be
/// refused with Disconnected (its buffers back), not put on the dead ring, where it would
/// never complete. Once for a single-buffer write (bio's one-pass fast path) and once for
/// a two-buffer write (the staged path).
#[test]
fn a_submission_waiting_for_room_when_the_device_dies_is_refused() {
    for vector in [false, true] {
        let dir = temp_dir("killed");
        let sock = dir.path().join("vblk.sock");
        let serve = Serve::start(&sock, "mem:64M", 2, dir.path().join("serve.log"));
        let pid = serve.pid();
        within(TEST_LIMIT, "a submission waiting for room", move || {
            // Four descriptors and no indirect tables: one 4 KiB write (header, data,
            // status) leaves one free, and any second write must wait for room.
            let disk = Disk::attach(
                &sock,
                &DiskOptions {
                    num_queues: Some(1),
                    queue_size: 4,
                    indirect: false,
                    pool_size: 4 * MIB,
                    ..Default::default()
                },
            )
            .unwrap_or_else(|e| panic!("cannot attach to {}: {e}", sock.display()));
            let mut q = disk.take_queue(0).unwrap();
            q.write_at(0, &[1u8; 4096]).unwrap();
            freeze(pid);
            q.write(0, q.alloc(4096).unwrap(), 1).unwrap();
            assert_eq!(q.in_flight(), 1);

            let (tx, rx) = mpsc::channel();
            let waiter = std::thread::spawn(move || {
                tx.send(()).unwrap();
                let r = if vector {
                    let bufs = vec![q.alloc(4096).unwrap(), q.alloc(4096).unwrap()];
                    q.writev(8192, bufs, 2)
                } else {
                    q.write(8192, q.alloc(4096).unwrap(), 2)
                };
                (q, r)
            });
            rx.recv_timeout(IO_TIMEOUT).unwrap();
            // Let the submitter get past its spin and fall asleep waiting for room.
            std::thread::sleep(Duration::from_millis(300));
            signal(pid, libc::SIGKILL);

            let (mut q, r) = waiter.join().unwrap();
            let e = r.expect_err("a submission accepted after the device died");
            assert_eq!(e.error.kind(), ErrorKind::Disconnected, "{}", e.error);
            let back = if vector {
                e.bufs.into_vec().len()
            } else {
                usize::from(e.bufs.into_one().is_some())
            };
            assert_eq!(back, 1 + usize::from(vector), "the buffers come back");
            let c = q
                .wait(Some(IO_TIMEOUT))
                .unwrap_or_else(|e| panic!("the write in flight never completed: {e}"));
            assert_eq!((c.token, c.result), (1, Err(ErrorKind::Disconnected)));
            assert_eq!(q.in_flight(), 0, "nothing else is in flight");
            drop(disk);
        });
        drop(serve);
    }
}

#[test]
fn a_device_killed_while_idle_is_noticed_by_the_next_io() {
    let dir = temp_dir("killed");
    let sock = dir.path().join("vblk.sock");
    let mut serve = Serve::start(&sock, "mem:64M", 2, dir.path().join("serve.log"));
    let pid = serve.pid();
    let s = sock.clone();
    let disk = within(TEST_LIMIT, "attach", move || attach(&s, 8 * MIB));
    let mut q0 = disk.take_queue(0).unwrap();
    let mut q1 = disk.take_queue(1).unwrap();
    let (q0, q1, disk) = within(TEST_LIMIT, "I/O after the kill", move || {
        q0.write_at(0, &[7u8; 4096]).unwrap();
        q1.write_at(4096, &[8u8; 4096]).unwrap();
        signal(pid, libc::SIGKILL);
        // Let the process die and its socket close.
        std::thread::sleep(Duration::from_millis(300));

        // A poll-only application: nothing sleeps on the socket, yet the I/O completes.
        let b = q1.alloc(4096).unwrap();
        match q1.read(0, b, 1) {
            Ok(()) => {
                let deadline = Instant::now() + IO_TIMEOUT;
                let c = loop {
                    if let Some(c) = q1.poll() {
                        break c;
                    }
                    assert!(Instant::now() < deadline, "poll never returned the read");
                    std::hint::spin_loop();
                };
                assert_eq!((c.token, c.result), (1, Err(ErrorKind::Disconnected)));
            }
            Err(e) => assert_eq!(e.error.kind(), ErrorKind::Disconnected, "{}", e.error),
        }
        // The other queue learns it too: refused at once, or completed Disconnected.
        match q0.write(0, q0.alloc(4096).unwrap(), 2) {
            Ok(()) => {
                let c = q0.wait(Some(IO_TIMEOUT)).unwrap();
                assert_eq!((c.token, c.result), (2, Err(ErrorKind::Disconnected)));
            }
            Err(e) => assert_eq!(e.error.kind(), ErrorKind::Disconnected, "{}", e.error),
        }
        assert_eq!(q0.flush_sync().unwrap_err().kind(), ErrorKind::Disconnected);
        (q0, q1, disk)
    });
    drop((q0, q1, disk));
    serve.reap();

    // A new daemon on the stale socket serves a new attach (a fresh RAM disk).
    let serve2 = Serve::start(&sock, "mem:64M", 2, dir.path().join("serve2.log"));
    let s = sock.clone();
    within(TEST_LIMIT, "attach after restart", move || {
        let disk = attach(&s, 8 * MIB);
        let mut q = disk.take_queue(0).unwrap();
        let mut b = [1u8; 4096];
        q.read_at(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "a fresh RAM disk");
        q.write_at(0, &[9u8; 4096]).unwrap();
        q.read_at(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 9));
    });
    drop(serve2);
}
