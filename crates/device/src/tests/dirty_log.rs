//! Live migration's dirty log as the worker keeps it: every write the device makes into
//! guest memory marks its pages — read payloads, GET_ID strings, status bytes of answered
//! and rejected requests, the used ring — and nothing else does (a write request's payload,
//! headers, descriptors, the available ring are only read). Each case's marked pages are
//! compared with a model of what the request wrote.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::*;
use crate::dirty_log::{test_log, DirtyLog, LOG_PAGE};

/// Pages of `[at, at + len)`.
fn pages(at: u64, len: u64) -> BTreeSet<u64> {
    (at / LOG_PAGE..=(at + len - 1) / LOG_PAGE).collect()
}

/// A rig with logging on: a fresh bitmap, and the used ring logged at its address.
fn logging_rig(engine: EngineKind) -> (Rig, Arc<DirtyLog>) {
    let mut rig = Rig::new(false, engine);
    let log = Arc::new(test_log(4096));
    let l = log.clone();
    rig.ask(|reply| Command::Log {
        log: Some(l),
        reply,
    });
    // SET_VRING_ADDR with the log flag on the running ring: answered once the worker
    // logs there, and the used ring, written before, is marked by then.
    rig.ask(|reply| Command::LogRing {
        queue: 0,
        used_gpa: Some(USED_RING),
        reply,
    });
    assert!(
        used_ring().iter().all(|&p| log.is_marked(p)),
        "the used ring is marked when LogRing is answered"
    );
    (rig, log)
}

/// Marked pages after `run`, minus what turning logging on marked (the used ring).
fn marked(log: &DirtyLog) -> BTreeSet<u64> {
    log.marked_pages().into_iter().collect()
}

fn used_ring() -> BTreeSet<u64> {
    pages(USED_RING, 6 + 8 * u64::from(QSIZE))
}

#[test]
fn every_write_into_guest_memory_marks_its_pages_and_nothing_else_does() {
    for engine in [EngineKind::Sync, EngineKind::IoUring] {
        // A read of 8 KiB spanning pages 8 and 9: payload, status, used ring.
        let (mut rig, log) = logging_rig(engine);
        rig.write_header(HDR, req_type::IN, 3);
        assert_eq!(rig.run(&read_chain(8192), &[(DATA, DATA + 8192)]), ok(8193));
        let want: BTreeSet<u64> = pages(DATA, 8192)
            .into_iter()
            .chain(pages(STATUS, 1))
            .chain(used_ring())
            .collect();
        assert_eq!(marked(&log), want, "{engine:?}: read");

        // A write: its payload is only read; the status byte and the used ring are written.
        let (mut rig, log) = logging_rig(engine);
        rig.write_header(HDR, req_type::OUT, 10);
        fill(&rig, DATA, 4096, 0xAB);
        assert_eq!(rig.run(&write_chain(4096), &[]), ok(1));
        let want: BTreeSet<u64> = pages(STATUS, 1).into_iter().chain(used_ring()).collect();
        assert_eq!(marked(&log), want, "{engine:?}: write");

        // GET_ID (answered on the worker, without the engine): its string and status.
        let (mut rig, log) = logging_rig(engine);
        rig.write_header(HDR, req_type::GET_ID, 0);
        let id_at = DATA + 3 * 4096;
        let chain = chain3(id_at, 20, F_WRITE);
        assert_eq!(rig.run(&chain, &[(id_at, id_at + 20)]), ok(21));
        let want: BTreeSet<u64> = pages(id_at, 20)
            .into_iter()
            .chain(pages(STATUS, 1))
            .chain(used_ring())
            .collect();
        assert_eq!(marked(&log), want, "{engine:?}: get_id");

        // A request rejected by the parser (past the disk's end): its status byte.
        let (mut rig, log) = logging_rig(engine);
        rig.write_header(HDR, req_type::IN, CAPACITY);
        let a = rig.run(&read_chain(512), &[(DATA, DATA + 512)]);
        assert_eq!(a.status, status::IOERR);
        let want: BTreeSet<u64> = pages(STATUS, 1).into_iter().chain(used_ring()).collect();
        assert_eq!(marked(&log), want, "{engine:?}: rejected");
    }
}

/// Logging off: nothing is marked (the bitmap of an earlier migration stays as it was).
#[test]
fn nothing_is_marked_once_logging_is_off() {
    let (mut rig, log) = logging_rig(EngineKind::Sync);
    rig.ask(|reply| Command::Log { log: None, reply });
    let before = marked(&log);
    rig.write_header(HDR, req_type::IN, 3);
    assert_eq!(rig.run(&read_chain(4096), &[(DATA, DATA + 4096)]), ok(4097));
    assert_eq!(marked(&log), before);
}

/// A request still at the disk when its ring stopped (a zombie) is not published, but
/// its payload lands in guest memory: a read's pages are marked when it ends.
#[test]
fn a_zombie_read_marks_what_it_wrote() {
    let (mut rig, release) = super::rings::hold_rig(16);
    rig.worker
        .set_drain_timeout(std::time::Duration::from_millis(20));
    let log = Arc::new(test_log(4096));
    let l = log.clone();
    rig.ask(|reply| Command::Log {
        log: Some(l),
        reply,
    });
    super::rings::read_batch(&mut rig, 1);
    super::rings::step(&mut rig, 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    rig.step_until_timeout(&rx, std::time::Duration::from_secs(10));
    assert!(!log.is_marked(DATA / LOG_PAGE));
    release.store(10, std::sync::atomic::Ordering::SeqCst);
    super::rings::step(&mut rig, 3);
    assert_eq!(rig.worker.zombies(), 0);
    assert!(
        log.is_marked(DATA / LOG_PAGE),
        "the zombie's read data page"
    );
}
