//! Per-request deadlines: a server that answers everything but one request (a piece of a
//! write, or a read), that trickles one read's payload, or that stops reading a request.
//! A read fails with EIO in about the timeout plus the reconnect window, while other
//! operations complete; a write fails at the first timeout and fences the disk's writes
//! (the server may still carry it out, after newer ones), while reads go on. And the
//! control: a server slow to answer, but within the timeout, keeps its connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::server::{Export, Server, Session, CMD_READ, CMD_WRITE};
use super::{engine, greet, iov, open_uri, opts, pattern, read, secs, within, write, BLOCK, EX};
use vblk_storage::Op;

/// The timeout and reconnect window of these tests.
const TIMEOUT: f64 = 1.0;
const RECONNECT: f64 = 2.0;
/// The operation the server loses: a 256 KiB write at 512 KiB (four 64 KiB pieces), or a
/// read there.
const LOST_AT: u64 = 512 << 10;
const LOST_LEN: usize = 256 << 10;
/// Its third piece is the one never answered.
const LOST_PIECE: u64 = LOST_AT + (128 << 10);

/// What `drive` saw.
struct Run {
    /// The operation the server loses.
    lost: std::io::Result<u64>,
    /// How long it took to end.
    took: Duration,
    /// Other operations that completed, and those that failed.
    others: usize,
    failed: Vec<std::io::Error>,
    /// How long dropping the engine took.
    dropped: Duration,
}

/// Pushes `lost` (token 1) and keeps one 4 KiB read or write below `LOST_AT` in flight
/// until it ends (reads only unless `other_writes`: a write in flight at the break would
/// be failed and fence the disk's writes, rightly); then drops the engine.
fn drive(b: Arc<vblk_storage::Backend>, write_lost: bool, other_writes: bool) -> Run {
    let mut e = engine(&b, 4);
    let mut lbuf = pattern(LOST_LEN, 7);
    let lv = iov(&mut lbuf);
    let mut obuf = vec![0u8; BLOCK];
    let ov = iov(&mut obuf);
    let op = if write_lost {
        Op::Write {
            offset: LOST_AT,
            iov: &lv,
            iovcnt: 1,
            durable: false,
        }
    } else {
        Op::Read {
            offset: LOST_AT,
            iov: &lv,
            iovcnt: 1,
        }
    };
    let start = Instant::now();
    // SAFETY: the buffers and iovecs live until both are reaped below (or the engine is
    // dropped, which waits for them).
    unsafe { e.push(1, op) }.unwrap();
    let (mut lost, mut busy, mut n) = (None, false, 0u64);
    let (mut others, mut failed) = (0, Vec::new());
    while lost.is_none() || busy {
        if !busy && lost.is_none() {
            let offset = (n % 64) * BLOCK as u64;
            let op = if n % 2 == 0 || !other_writes {
                Op::Read {
                    offset,
                    iov: &ov,
                    iovcnt: 1,
                }
            } else {
                Op::Write {
                    offset,
                    iov: &ov,
                    iovcnt: 1,
                    durable: false,
                }
            };
            // SAFETY: as above; one at a time.
            unsafe { e.push(2, op) }.unwrap();
            busy = true;
            n += 1;
        }
        e.submit().unwrap();
        e.wait().unwrap();
        e.reap(&mut |c| match c.token {
            1 => lost = Some((c.result, start.elapsed())),
            _ => {
                busy = false;
                match c.result {
                    Ok(_) => others += 1,
                    Err(err) => failed.push(err),
                }
            }
        });
    }
    let t = Instant::now();
    drop(e);
    let (lost, took) = lost.unwrap();
    Run {
        lost,
        took,
        others,
        failed,
        dropped: t.elapsed(),
    }
}

/// A server that answers every request but `lost`'s: on every connection.
fn loses(lost: fn(&super::server::Req) -> bool) -> impl Fn(&mut Session) + Send + Sync {
    move |s| {
        if !greet(s) {
            return;
        }
        while let Ok(Some(r)) = s.request() {
            if lost(&r) {
                continue;
            }
            if s.answer(&r).is_err() {
                return;
            }
        }
    }
}

fn check(run: Run, what: &str) {
    assert_eq!(
        run.lost.as_ref().map_err(|e| e.raw_os_error()),
        Err(Some(libc::EIO)),
        "the {what} the server never answers"
    );
    // Replayed until the reconnect window after the first break (a timeout after it was
    // sent) has passed: about TIMEOUT + RECONNECT.
    assert!(
        run.took >= secs(TIMEOUT + RECONNECT - 0.2) && run.took < secs(12.0),
        "the {what} failed after {:?}",
        run.took
    );
    assert!(
        run.failed.is_empty(),
        "operations the server answered failed: {:?}",
        run.failed
    );
    assert!(run.others > 10, "only {} other operations", run.others);
    assert!(run.dropped < secs(1.0), "drop took {:?}", run.dropped);
}

#[test]
fn a_write_piece_the_server_never_answers_fails_and_fences_writes() {
    let s = Server::unix(EX, loses(|r| r.cmd == CMD_WRITE && r.offset == LOST_PIECE));
    let b = open_uri(s.uri(), &opts(TIMEOUT, RECONNECT)).unwrap();
    let run = within(secs(25.0), "the lost write", move || drive(b, true, true));
    assert_eq!(
        run.lost.as_ref().map_err(|e| e.raw_os_error()),
        Err(Some(libc::EIO)),
        "the write the server never answers"
    );
    // At the first timeout, not replayed through the reconnect window: the server has the
    // piece and may still write it.
    assert!(
        run.took >= secs(TIMEOUT - 0.2) && run.took < secs(TIMEOUT + RECONNECT),
        "the write failed after {:?}",
        run.took
    );
    // At most the other write in flight at the break fails with it; everything before
    // completed.
    assert!(
        run.failed.len() <= 1
            && run
                .failed
                .iter()
                .all(|e| e.raw_os_error() == Some(libc::EIO)),
        "{:?}",
        run.failed
    );
    assert!(run.others > 10, "only {} other operations", run.others);
    assert!(run.dropped < secs(1.0), "drop took {:?}", run.dropped);
    assert!(
        s.bytes(LOST_PIECE as usize, 64 << 10)
            .iter()
            .all(|&x| x == 0),
        "the lost piece was written"
    );
}

#[test]
fn a_read_the_server_never_answers_fails_while_others_complete() {
    let s = Server::unix(EX, loses(|r| r.cmd == CMD_READ && r.offset == LOST_AT));
    let b = open_uri(s.uri(), &opts(TIMEOUT, RECONNECT)).unwrap();
    let run = within(secs(25.0), "the lost read", move || drive(b, false, false));
    check(run, "read");
}

#[test]
fn a_read_reply_whose_payload_trickles_fails() {
    let s = Server::unix(EX, |s| {
        if !greet(s) {
            return;
        }
        while let Ok(Some(r)) = s.request() {
            if r.cmd != CMD_READ || r.offset != 0 {
                if s.answer(&r).is_err() {
                    return;
                }
                continue;
            }
            // The header at once, then a byte of the payload every 0.2 s: bytes keep
            // coming, but the reply is never all in.
            let payload = s.serve(&r);
            if s.reply(r.cookie, 0, &[]).is_err() {
                return;
            }
            s.trickle(secs(0.2));
            let _ = s.send_raw(&payload);
            return;
        }
    });
    let b = open_uri(s.uri(), &opts(TIMEOUT, RECONNECT)).unwrap();
    let (r, took) = within(secs(25.0), "the trickled read", move || {
        let mut e = engine(&b, 4);
        let mut buf = vec![0u8; BLOCK];
        let t = Instant::now();
        let r = read(&mut *e, 0, &mut buf);
        (r, t.elapsed())
    });
    assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(
        took >= secs(TIMEOUT + RECONNECT - 0.2) && took < secs(12.0),
        "failed after {took:?}"
    );
}

#[test]
fn a_request_the_server_stops_reading_fails() {
    // One 1 MiB write is one request, larger than a Unix socket's buffer.
    let ex = Export {
        size: 4 << 20,
        max_payload: 1 << 20,
    };
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let s = Server::unix(ex, move |s| {
        if !greet(s) {
            return;
        }
        if s.n == 0 {
            return s.honest();
        }
        // Read nothing more.
        let start = Instant::now();
        while !d.load(Ordering::Acquire) && start.elapsed() < secs(30.0) {
            std::thread::sleep(secs(0.02));
        }
    });
    let b = open_uri(s.uri(), &opts(TIMEOUT, RECONNECT)).unwrap();
    let (r, took, dropped) = within(secs(25.0), "the unread write", move || {
        let mut e = engine(&b, 4);
        let t = Instant::now();
        let r = write(&mut *e, 0, &pattern(1 << 20, 8));
        let took = t.elapsed();
        let t = Instant::now();
        drop(e);
        (r, took, t.elapsed())
    });
    done.store(true, Ordering::Release);
    assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EIO));
    assert!(
        took >= secs(TIMEOUT + RECONNECT - 0.2) && took < secs(12.0),
        "failed after {took:?}"
    );
    assert!(dropped < secs(1.0), "drop took {dropped:?}");
}

#[test]
fn a_server_slow_within_the_timeout_keeps_its_connection() {
    // Pieces of 4 KiB: a 640 KiB write is 160 requests, more than its window of 64, so
    // its later pieces are sent as the earlier ones are answered.
    let ex = Export {
        max_payload: 4096,
        ..EX
    };
    // Twice the other tests' timeout, each answer at under half of it: the large write
    // (three windows of answers) outlasts the timeout, while a server thread stalled for
    // a second on a loaded machine still answers each request within it.
    let timeout = 2.0 * TIMEOUT;
    let delay = secs(0.45 * timeout);
    let s = Server::unix(ex, move |s| {
        if !greet(s) {
            return;
        }
        // Each request answered `delay` after it came, whatever else is waiting.
        let mut due = std::collections::VecDeque::new();
        loop {
            let wait = due.front().map_or(secs(0.05), |(at, _): &(Instant, _)| {
                at.saturating_duration_since(Instant::now())
            });
            if !s.quiet_for(wait) {
                match s.request() {
                    Ok(Some(r)) => due.push_back((Instant::now() + delay, r)),
                    _ => return,
                }
            }
            while due.front().is_some_and(|(at, _)| *at <= Instant::now()) {
                let Some((_, r)) = due.pop_front() else { break };
                if s.answer(&r).is_err() {
                    return;
                }
            }
        }
    });
    let b = open_uri(s.uri(), &opts(timeout, RECONNECT)).unwrap();
    let big = pattern(160 * BLOCK, 9);
    let small = pattern(BLOCK, 10);
    let (big2, small2) = (big.clone(), small.clone());
    let results = within(secs(30.0), "the slow operations", move || {
        let mut e = engine(&b, 4);
        let mut results = vec![write(&mut *e, 0, &big2)];
        let start = Instant::now();
        let mut n = 0;
        while start.elapsed() < secs(3.0 * timeout) {
            let at = (200 + n % 32) * BLOCK;
            results.push(write(&mut *e, at, &small2));
            let mut buf = vec![0u8; BLOCK];
            let r = read(&mut *e, at, &mut buf);
            assert!(r.is_err() || buf == small2, "read back wrong bytes");
            results.push(r);
            n += 1;
        }
        results
    });
    for r in &results {
        assert!(r.is_ok(), "{r:?}");
    }
    assert!(s.bytes(0, big.len()) == big, "the large write differs");
    assert_eq!(
        s.connections(),
        2,
        "a server answering within the timeout had its connection broken"
    );
}
