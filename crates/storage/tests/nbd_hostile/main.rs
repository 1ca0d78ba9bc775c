//! The NBD client against a hostile server (`server.rs`: scripted, in this test): a reply
//! repeated, a reply for a finished operation, for an earlier use of a slot (with a read
//! payload that must land nowhere), for a request sent before a replay; a server that
//! breaks the protocol on every connection; one that trickles its handshake a byte a
//! second, at open and on reconnection; one that never answers while the engine is
//! dropped; per-request deadlines (`deadline.rs`); error answers to `NBD_OPT_GO`
//! (`handshake.rs`). A protocol violation must break the connection and complete nothing
//! wrongly: a read is replayed and completes by its genuine reply; a write the server has
//! and has not answered fails with EIO and fences the disk's writes (the server may still
//! carry it out, after newer writes). Every wait must end by its deadline. Deadlines are asserted with wide margins; a test whose engine
//! waits forever fails by `within`'s limit instead of hanging.

mod deadline;
mod handshake;
mod server;

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use server::{Export, Server, Session};
use vblk_storage::nbd::NbdOptions;
use vblk_storage::{Backend, DiskSpec, Engine, EngineKind, Op, OpenOptions};

const BLOCK: usize = 4096;
/// The export: 1 MiB, payloads of up to 64 KiB.
const EX: Export = Export {
    size: 1 << 20,
    max_payload: 64 << 10,
};
/// Bytes a forged reply carries; they must never reach a caller buffer.
const POISON: u8 = 0xee;
/// What a read buffer holds before the read.
const UNTOUCHED: u8 = 0x5a;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

fn opts(timeout: f64, reconnect: f64) -> OpenOptions {
    // RUST_LOG=debug shows every break, attempt and replay.
    let _ = env_logger::builder().is_test(true).try_init();
    OpenOptions {
        nbd: NbdOptions {
            timeout: secs(timeout),
            reconnect: secs(reconnect),
            conns: 1,
        },
        ..Default::default()
    }
}

fn open_uri(uri: &str, o: &OpenOptions) -> Result<Arc<Backend>, String> {
    let spec: DiskSpec = uri.parse().map_err(|e| format!("{e}"))?;
    Backend::open(&spec, o)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

fn engine(b: &Arc<Backend>, depth: u32) -> Box<dyn Engine> {
    b.engine(EngineKind::IoUring, depth).unwrap()
}

/// Runs `f` on a thread of its own and returns what it returns; a test failure if that
/// takes longer than `limit` (the engine waited on the server with no deadline).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            let _ = t.join();
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not end within {limit:?}: a wait with no deadline")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the thread ended without sending"),
        },
    }
}

fn iov(buf: &mut [u8]) -> libc::iovec {
    libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }
}

/// Pushes `op`, submits it and waits for its completion.
///
/// # Safety
/// The buffers `op` names stay valid until this returns.
unsafe fn run(e: &mut dyn Engine, op: Op) -> io::Result<u64> {
    // SAFETY: forwarded to the caller.
    unsafe { e.push(1, op) }.expect("engine full");
    e.submit().unwrap();
    let mut result = None;
    while result.is_none() {
        e.reap(&mut |c| result = Some(c.result));
        if result.is_none() {
            e.wait().unwrap();
        }
    }
    result.unwrap()
}

fn write(e: &mut dyn Engine, offset: usize, data: &[u8]) -> io::Result<u64> {
    let mut buf = data.to_vec();
    let v = iov(&mut buf);
    let op = Op::Write {
        offset: offset as u64,
        iov: &v,
        iovcnt: 1,
        durable: false,
    };
    // SAFETY: `buf` and `v` outlive the call.
    unsafe { run(e, op) }
}

fn read(e: &mut dyn Engine, offset: usize, buf: &mut [u8]) -> io::Result<u64> {
    let v = iov(buf);
    let op = Op::Read {
        offset: offset as u64,
        iov: &v,
        iovcnt: 1,
    };
    // SAFETY: `buf` and `v` outlive the call.
    unsafe { run(e, op) }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A script's start: the handshake; `false` when the client went away during it.
fn greet(s: &mut Session) -> bool {
    s.handshake().is_ok()
}

#[test]
fn a_repeated_reply_completes_nothing() {
    // Pieces of at most 4 KiB: an 8 KiB write is two requests.
    let ex = Export {
        max_payload: 4096,
        ..EX
    };
    let s = Server::unix(ex, |s| {
        if !greet(s) {
            return;
        }
        if s.n != 1 {
            return s.honest();
        }
        // The engine's first connection: piece 0 done and answered twice; piece 1 never.
        let (Ok(Some(p0)), Ok(Some(_p1))) = (s.request(), s.request()) else {
            return;
        };
        let _ = s.answer(&p0);
        let _ = s.reply(p0.cookie, 0, &[]);
        s.until_closed();
    });
    let b = open_uri(s.uri(), &opts(5.0, 5.0)).unwrap();
    let data = pattern(2 * BLOCK, 1);
    let d = data.clone();
    let r = within(secs(30.0), "the write", move || {
        let mut e = engine(&b, 4);
        write(&mut *e, 2 * BLOCK, &d)
    });
    // The repeated reply broke the connection with piece 1 sent and unanswered: the
    // server may still write it, so the write fails (it is not acknowledged on piece 0's
    // replies) and the disk's writes are fenced.
    let err = r.expect_err("the write was acknowledged before its second piece was answered");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}

#[test]
fn a_reply_for_a_finished_operation_completes_nothing() {
    let s = Server::unix(EX, |s| {
        if !greet(s) {
            return;
        }
        if s.n != 1 {
            return s.honest();
        }
        // W1 done and answered; then W1's reply again in place of W2's, W2 never done.
        let Ok(Some(w1)) = s.request() else { return };
        let _ = s.answer(&w1);
        let Ok(Some(_w2)) = s.request() else { return };
        let _ = s.reply(w1.cookie, 0, &[]);
        s.until_closed();
    });
    let b = open_uri(s.uri(), &opts(5.0, 5.0)).unwrap();
    let (a, c) = (pattern(BLOCK, 2), pattern(BLOCK, 3));
    let (a2, c2) = (a.clone(), c.clone());
    // Depth 1: both writes use the same slot.
    let (r1, r2) = within(secs(30.0), "the writes", move || {
        let mut e = engine(&b, 1);
        (write(&mut *e, 0, &a2), write(&mut *e, BLOCK, &c2))
    });
    assert_eq!(r1.unwrap(), BLOCK as u64);
    assert!(s.bytes(0, BLOCK) == a, "the first write is lost");
    // W2 was sent and never answered when the stray reply broke the connection: it fails,
    // not acknowledged by W1's reply.
    let err = r2.expect_err("the second write was acknowledged by the first one's reply");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}

#[test]
fn a_reply_for_an_earlier_use_of_a_slot_lands_in_no_buffer() {
    let release = Arc::new(AtomicBool::new(false));
    let rel = release.clone();
    let s = Server::unix(EX, move |s| {
        if !greet(s) {
            return;
        }
        match s.n {
            1 => {
                // R1 answered; then R1's cookie again, with a poisoned payload, in place of
                // R2's reply.
                let Ok(Some(r1)) = s.request() else { return };
                let _ = s.answer(&r1);
                let Ok(Some(_r2)) = s.request() else { return };
                let _ = s.reply(r1.cookie, 0, &[POISON; BLOCK]);
                s.until_closed();
            }
            2 => {
                // The replay's connection answers once the test has looked at the buffer.
                let start = Instant::now();
                while !rel.load(Ordering::Acquire) && start.elapsed() < secs(30.0) {
                    std::thread::sleep(secs(0.01));
                }
                s.honest();
            }
            _ => s.honest(),
        }
    });
    s.disk.lock().unwrap()[..BLOCK].fill(0x11);
    s.disk.lock().unwrap()[BLOCK..2 * BLOCK].fill(0x22);
    let b = open_uri(s.uri(), &opts(5.0, 5.0)).unwrap();
    // Depth 1: both reads use the same slot. Only `reap` and `submit` are called here,
    // which never block.
    let mut e = engine(&b, 1);
    let mut b1 = vec![UNTOUCHED; BLOCK];
    read(&mut *e, 0, &mut b1).unwrap();
    assert!(b1.iter().all(|&x| x == 0x11));
    let mut b2 = vec![UNTOUCHED; BLOCK];
    let v = iov(&mut b2);
    // SAFETY: `b2` and `v` live until the read is reaped below (or the engine dropped).
    unsafe {
        e.push(
            2,
            Op::Read {
                offset: BLOCK as u64,
                iov: &v,
                iovcnt: 1,
            },
        )
    }
    .unwrap();
    e.submit().unwrap();
    let mut result = None;
    let start = Instant::now();
    // Until the replay's connection comes: the forged reply broke the first.
    while s.connections() < 3 {
        e.reap(&mut |c| result = Some(c.result));
        assert!(
            result.is_none(),
            "the read completed by a reply to the earlier read: {result:?}, buffer {:#x}..",
            b2[0]
        );
        assert!(
            start.elapsed() < secs(20.0),
            "the forged reply broke nothing"
        );
        e.submit().unwrap();
        std::thread::sleep(secs(0.01));
    }
    // Nothing landed in the buffer (the engine runs only inside reap and submit).
    assert!(
        b2.iter().all(|&x| x == UNTOUCHED),
        "the forged payload reached the new read's buffer"
    );
    release.store(true, Ordering::Release);
    while result.is_none() {
        assert!(
            start.elapsed() < secs(30.0),
            "the replayed read never completed"
        );
        e.reap(&mut |c| result = Some(c.result));
        e.submit().unwrap();
        std::thread::sleep(secs(0.01));
    }
    assert_eq!(result.unwrap().unwrap(), BLOCK as u64);
    assert!(
        b2.iter().all(|&x| x == 0x22),
        "the replayed read read wrong bytes"
    );
}

#[test]
fn a_reply_to_a_request_sent_before_a_replay_completes_nothing() {
    let first = Arc::new(Mutex::new(None::<u64>));
    let f = first.clone();
    let s = Server::unix(EX, move |s| {
        if !greet(s) {
            return;
        }
        match s.n {
            1 => {
                // Take the write and hang up without an answer: the engine replays it.
                if let Ok(Some(w)) = s.request() {
                    *f.lock().unwrap() = Some(w.cookie);
                }
            }
            2 => {
                // Answer the replay with the cookie the write had on the first connection.
                let Ok(Some(_w)) = s.request() else { return };
                let Some(old) = *f.lock().unwrap() else {
                    return;
                };
                let _ = s.reply(old, 0, &[]);
                s.until_closed();
            }
            _ => s.honest(),
        }
    });
    let b = open_uri(s.uri(), &opts(5.0, 5.0)).unwrap();
    let data = pattern(BLOCK, 4);
    let d = data.clone();
    let r = within(secs(30.0), "the write", move || {
        let mut e = engine(&b, 1);
        write(&mut *e, 2 * BLOCK, &d)
    });
    // The first connection ended by the server: the write was replayed. The replay was
    // answered with the old cookie, which breaks the second connection with the replay
    // unanswered: it fails (fenced), never acknowledged by the stale reply.
    assert!(s.connections() >= 2, "{} connections", s.connections());
    let err = r.expect_err("the replayed write was acknowledged by a reply from before the replay");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}

#[test]
fn a_large_operation_has_at_most_64_requests_awaiting_replies() {
    // 640 KiB in 4 KiB pieces: 160 requests.
    let ex = Export {
        max_payload: 4096,
        ..EX
    };
    let most = Arc::new(AtomicUsize::new(0));
    let m = most.clone();
    let s = Server::unix(ex, move |s| {
        if !greet(s) {
            return;
        }
        // Take requests until the client stops sending, then answer them last first.
        loop {
            let mut batch = Vec::new();
            loop {
                match s.request() {
                    Ok(Some(r)) => batch.push(r),
                    _ => return,
                }
                // A second of quiet: the client has sent all it may (a stall of the
                // client shorter than that does not split its window in two).
                if s.quiet_for(secs(1.0)) {
                    break;
                }
            }
            m.fetch_max(batch.len(), Ordering::AcqRel);
            for r in batch.iter().rev() {
                if s.answer(r).is_err() {
                    return;
                }
            }
        }
    });
    let b = open_uri(s.uri(), &opts(5.0, 5.0)).unwrap();
    let data = pattern(160 * BLOCK, 5);
    let d = data.clone();
    let r = within(secs(30.0), "the write", move || {
        let mut e = engine(&b, 1);
        write(&mut *e, 0, &d)
    });
    assert_eq!(r.unwrap(), data.len() as u64);
    assert!(s.bytes(0, data.len()) == data, "the disk differs");
    assert_eq!(most.load(Ordering::Acquire), 64);
}

#[test]
fn a_server_that_always_breaks_the_protocol_fails_operations_in_bounded_time() {
    let s = Server::unix(EX, |s| {
        if !greet(s) {
            return;
        }
        // Every request answered with the cookie of a piece never sent.
        while let Ok(Some(r)) = s.request() {
            if s.reply(r.cookie ^ (1 << 40), 0, &[]).is_err() {
                return;
            }
        }
    });
    let b = open_uri(s.uri(), &opts(2.0, 2.0)).unwrap();
    let (first, took, second, took2, dropped) =
        within(secs(40.0), "failing the writes", move || {
            let mut e = engine(&b, 4);
            let t = Instant::now();
            let mut buf = vec![UNTOUCHED; BLOCK];
            let first = read(&mut *e, 0, &mut buf);
            let took = t.elapsed();
            let t = Instant::now();
            let second = write(&mut *e, 0, &[2; BLOCK]);
            let took2 = t.elapsed();
            let t = Instant::now();
            drop(e);
            (first, took, second, took2, t.elapsed())
        });
    // A read is replayed on every new connection, which breaks again, until the
    // reconnect window has passed: then it fails.
    assert_eq!(first.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(
        took >= secs(1.5) && took < secs(20.0),
        "failed after {took:?}"
    );
    // The connection is failed: the next operation fails at its first break, or at once
    // (a write the server has unanswered also fences the disk's writes).
    assert_eq!(second.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(took2 < secs(5.0), "the second write failed after {took2:?}");
    assert!(dropped < secs(5.0), "drop took {dropped:?}");
    assert!(s.bytes(0, BLOCK).iter().all(|&x| x == 0));
    // Attempts back off (10 ms doubling) across breaks: no storm of connections.
    assert!(s.connections() < 40, "{} connections", s.connections());
}

#[test]
fn an_operation_the_server_always_breaks_on_fails_though_others_complete() {
    let s = Server::unix(EX, |s| {
        if !greet(s) {
            return;
        }
        // Everything is answered but the read of block 0: once one was asked for, the
        // connection is dropped after the next answer.
        let mut seen = false;
        while let Ok(Some(r)) = s.request() {
            if r.offset == 0 && r.cmd == 0 {
                seen = true;
                continue;
            }
            if s.answer(&r).is_err() || seen {
                return;
            }
        }
    });
    let b = open_uri(s.uri(), &opts(2.0, 2.0)).unwrap();
    let (result, took, writes) = within(secs(40.0), "the read", move || {
        let mut e = engine(&b, 4);
        let mut rbuf = vec![UNTOUCHED; BLOCK];
        let rv = iov(&mut rbuf);
        let mut wbuf = vec![9u8; BLOCK];
        let wv = iov(&mut wbuf);
        let start = Instant::now();
        // SAFETY: the buffers and iovecs live until both operations are reaped below.
        unsafe {
            e.push(
                1,
                Op::Read {
                    offset: 0,
                    iov: &rv,
                    iovcnt: 1,
                },
            )
        }
        .unwrap();
        // Writes keep completing (progress) while the read is replayed.
        let (mut read, mut writing, mut writes) = (None, false, 0);
        while read.is_none() || writing {
            if !writing && read.is_none() {
                // SAFETY: as above; one write at a time.
                unsafe {
                    e.push(
                        2,
                        Op::Write {
                            offset: BLOCK as u64,
                            iov: &wv,
                            iovcnt: 1,
                            durable: false,
                        },
                    )
                }
                .unwrap();
                writing = true;
            }
            e.submit().unwrap();
            e.wait().unwrap();
            e.reap(&mut |c| match c.token {
                1 => read = Some(c.result),
                _ => {
                    writing = false;
                    writes += usize::from(c.result.is_ok());
                }
            });
        }
        (read.unwrap(), start.elapsed(), writes)
    });
    assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(
        took >= secs(1.5) && took < secs(20.0),
        "failed after {took:?}"
    );
    assert!(writes > 1, "only {writes} writes completed meanwhile");
}

#[test]
fn a_break_long_after_an_idle_one_is_replayed() {
    let s = Server::unix(EX, |s| {
        if !greet(s) {
            return;
        }
        match s.n {
            // The engine's first connection is closed at once, while it is idle.
            1 => {}
            // The second takes a request and hangs up.
            2 => {
                let _ = s.request();
            }
            _ => s.honest(),
        }
    });
    let b = open_uri(s.uri(), &opts(5.0, 1.0)).unwrap();
    let data = pattern(BLOCK, 6);
    let d = data.clone();
    let r = within(secs(30.0), "the write", move || {
        let mut e = engine(&b, 4);
        // Idle, longer than the reconnect window: the engine finds the first connection
        // closed and makes another.
        let start = Instant::now();
        while start.elapsed() < secs(2.0) {
            e.reap(&mut |c| panic!("completed: {:?}", c.result));
            std::thread::sleep(secs(0.02));
        }
        write(&mut *e, 0, &d)
    });
    // That old break with nothing held is no trouble: the write is replayed.
    let n = r.unwrap_or_else(|e| panic!("the write was not replayed: {e}"));
    assert_eq!(n, BLOCK as u64);
    assert!(s.bytes(0, BLOCK) == data);
    assert!(s.connections() >= 4, "{} connections", s.connections());
}

/// A server that sends every byte of its handshake a second after the last.
fn trickler(s: &mut Session) {
    s.trickle(secs(1.0));
    let _ = s.handshake();
}

#[test]
fn a_server_trickling_its_handshake_is_given_up_on_at_open() {
    for s in [Server::unix(EX, trickler), Server::tcp(EX, trickler)] {
        let uri = s.uri().to_owned();
        let (err, took) = within(secs(30.0), "opening the disk", move || {
            let t = Instant::now();
            let r = open_uri(&uri, &opts(2.0, 2.0));
            (r.err(), t.elapsed())
        });
        let err = err.expect("the disk opened");
        assert!(
            err.starts_with(s.uri()) && err.contains("greeting did not finish within 2 s"),
            "{err}"
        );
        assert!(
            took >= secs(1.5) && took < secs(15.0),
            "gave up after {took:?}"
        );
    }
}

#[test]
fn a_server_trickling_its_handshake_on_reconnection_does_not_stall_the_worker() {
    let s = Server::unix(EX, |s| {
        if s.n >= 2 {
            return trickler(s);
        }
        if !greet(s) {
            return;
        }
        if s.n == 0 {
            return s.honest();
        }
        // The engine's first connection: hang up on the first request.
        let _ = s.request();
    });
    let b = open_uri(s.uri(), &opts(3.0, 3.0)).unwrap();
    let (result, took, longest) = within(secs(60.0), "the write", move || {
        let mut e = engine(&b, 4);
        let mut buf = vec![7u8; BLOCK];
        let v = iov(&mut buf);
        // SAFETY: `buf` and `v` live until the write is reaped below.
        unsafe {
            e.push(
                1,
                Op::Write {
                    offset: 0,
                    iov: &v,
                    iovcnt: 1,
                    durable: false,
                },
            )
        }
        .unwrap();
        e.submit().unwrap();
        let start = Instant::now();
        let (mut result, mut longest) = (None, Duration::ZERO);
        while result.is_none() {
            let t = Instant::now();
            e.reap(&mut |c| result = Some(c.result));
            e.submit().unwrap();
            longest = longest.max(t.elapsed());
            std::thread::sleep(secs(0.02));
        }
        (result.unwrap(), start.elapsed(), longest)
    });
    assert_eq!(result.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(
        took >= secs(2.5) && took < secs(20.0),
        "failed after {took:?}"
    );
    // A reconnection handshake on the worker would hold reap or submit for the whole
    // 3 s attempt.
    assert!(
        longest < secs(1.5),
        "reap or submit blocked for {longest:?} while the engine reconnected"
    );
}

#[test]
fn dropping_the_engine_with_an_unanswered_operation_returns_by_the_deadline() {
    let dropped = Arc::new(AtomicBool::new(false));
    let d = dropped.clone();
    let s = Server::unix(EX, move |s| {
        if !greet(s) {
            return;
        }
        if s.n != 1 {
            return s.until_closed();
        }
        // Never answer; once the engine is gone, try to answer with poison.
        let Ok(Some(r)) = s.request() else { return };
        let start = Instant::now();
        while !d.load(Ordering::Acquire) && start.elapsed() < secs(30.0) {
            std::thread::sleep(secs(0.01));
        }
        let _ = s.reply(r.cookie, 0, &[POISON; BLOCK]);
        s.until_closed();
    });
    let b = open_uri(s.uri(), &opts(2.0, 30.0)).unwrap();
    let (buf, took) = within(secs(30.0), "dropping the engine", move || {
        let mut buf = vec![UNTOUCHED; BLOCK];
        let v = iov(&mut buf);
        let mut e = engine(&b, 4);
        // SAFETY: `buf` (its heap block) and `v` live until the engine is dropped below.
        unsafe {
            e.push(
                1,
                Op::Read {
                    offset: 0,
                    iov: &v,
                    iovcnt: 1,
                },
            )
        }
        .unwrap();
        e.submit().unwrap();
        e.reap(&mut |c| panic!("completed: {:?}", c.result));
        let t = Instant::now();
        drop(e);
        (buf, t.elapsed())
    });
    assert!(took >= secs(1.5) && took < secs(10.0), "drop took {took:?}");
    // The server answers now: nothing reads its socket any more.
    dropped.store(true, Ordering::Release);
    std::thread::sleep(secs(0.3));
    assert!(
        buf.iter().all(|&x| x == UNTOUCHED),
        "a reply reached the buffer after drop"
    );
}
