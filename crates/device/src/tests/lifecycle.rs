//! The edges of a VM's life as the worker sees them: a stop that runs out of time and the
//! fence it leaves for every queue started after it, completion tokens that cannot alias
//! however many starts come and go, a worker that panics, a call descriptor the frontend
//! wedges, and the memory a hostile guest can make slots hold.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::rings::{hold_rig, read_batch, start_queue, step};
use super::*;

/// Publish one flush at head `QSIZE - 2` (status at STATUS + 15).
fn flush_at_end(rig: &mut Rig) {
    rig.write_header(HDR2, req_type::FLUSH, 0);
    rig.store_desc(QSIZE - 2, d(HDR2, 16, F_NEXT, QSIZE - 1));
    rig.store_desc(QSIZE - 1, d(STATUS + 15, 1, F_WRITE, 0));
    rig.set_avail(rig.next_avail, QSIZE - 2);
    rig.next_avail += 1;
    rig.set_avail_idx(rig.next_avail);
}

/// Queue 0's stop runs out of time with reads still at the disk. Queue 1, started after it
/// (what a rebooted guest's first queue is), takes nothing until they end — a read from
/// before the reset must not fill memory after a request from after it was taken, a write
/// from before must not land after one from after.
#[test]
fn a_queue_started_after_a_timed_out_stop_waits_for_the_old_requests() {
    let (mut rig, release) = hold_rig(16);
    rig.worker.set_drain_timeout(Duration::from_millis(20));
    read_batch(&mut rig, 2);
    step(&mut rig, 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    assert_eq!(rig.step_until_timeout(&rx, Duration::from_secs(10)), 2);
    assert_eq!(rig.fence.old(), 2, "two old requests in the fence");
    let used_before = rig.used_idx();
    start_queue(&mut rig, 1, None);
    assert!(rig.worker.queue_fenced(1));
    flush_at_end(&mut rig);
    step(&mut rig, 10);
    assert_eq!(rig.worker.in_flight(), 2, "the new queue took nothing");
    assert_eq!(rig.used_idx(), used_before);
    // The old reads end (their data lands, nothing of them is published)...
    release.store(2, Ordering::SeqCst);
    step(&mut rig, 3);
    assert_eq!(rig.fence.old(), 0);
    assert_eq!(rig.worker.zombies(), 0);
    // ...and only then the new queue's flush is taken and answered.
    release.store(100, Ordering::SeqCst);
    rig.worker.settle();
    assert!(!rig.worker.queue_fenced(1));
    assert_eq!(rig.used_idx(), used_before.wrapping_add(1));
    assert_eq!(rig.used_elem(used_before).0, u32::from(QSIZE - 2));
    let st: u8 = rig.mem.read_obj(GuestAddress(STATUS + 15)).unwrap();
    assert_eq!(st, status::OK);
}

/// However many times a queue is started while a stop's requests are still out, no new
/// start gets the generation the old requests carry: their completions go to the zombie,
/// never into a live queue's slot (whose iovecs the engine may still be using).
#[test]
fn generations_never_alias_a_zombie_whatever_the_number_of_starts() {
    let (mut rig, release) = hold_rig(16);
    rig.worker.set_drain_timeout(Duration::from_millis(20));
    read_batch(&mut rig, 1);
    step(&mut rig, 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    rig.step_until_timeout(&rx, Duration::from_secs(10));
    let (_, old) = rig.worker.gens(0);
    assert_eq!(old.len(), 1);
    // The counter comes round to the zombie's generation (as 2^32 starts would make it).
    rig.worker.set_next_gen(old[0]);
    start_queue(&mut rig, 0, None);
    let (live, _) = rig.worker.gens(0);
    assert_ne!(live, Some(old[0]), "the zombie's generation is skipped");
    // Many more starts and stops (each a new generation), past any 16-bit wrap.
    for _ in 0..70_000u32 {
        let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
        rig.step_until(&rx);
        start_queue(&mut rig, 0, None);
        let (live, zombies) = rig.worker.gens(0);
        assert!(!zombies.contains(&live.unwrap()));
    }
    release.store(100, Ordering::SeqCst);
    step(&mut rig, 3);
    assert_eq!(rig.fence.old(), 0, "the old completion went to its zombie");
    assert_eq!(rig.worker.zombies(), 0);
}

/// A worker that panics is reported by the next command, which does not hang, and
/// dropping its handle does not hang either; the thread it ran on goes on serving the
/// other workers it holds (another disk's, in a daemon serving several).
#[test]
fn a_worker_panic_is_reported_not_a_hang() {
    let Rig { worker, .. } = Rig::new(false, EngineKind::Sync);
    let Rig { worker: other, .. } = Rig::new(false, EngineKind::Sync);
    let pool = crate::worker::Pool::new(&crate::worker::PoolConfig::default()).unwrap();
    let handle = pool.attach(0, worker, Duration::from_secs(5)).unwrap();
    let bystander = pool.attach(0, other, Duration::from_secs(5)).unwrap();
    handle.send(Command::Panic);
    let t0 = Instant::now();
    let ask_memory = |h: &crate::worker::WorkerHandle| {
        let mem = Arc::new(GuestMemory::empty());
        h.ask(Duration::from_secs(10), |reply| Command::Memory {
            mem,
            reply,
        })
    };
    let r = ask_memory(&handle);
    assert!(
        matches!(r, Err(crate::worker::Lost::Gone(0))),
        "{r:?}: a worker that panicked is reported gone"
    );
    // It ends once the reaper has dropped it (and its engine).
    while !handle.ended() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the worker did not end"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(handle);
    assert!(t0.elapsed() < Duration::from_secs(5));
    let r = ask_memory(&bystander);
    assert!(
        r.is_ok(),
        "{r:?}: the other worker on the same thread is still served"
    );
    assert!(!bystander.ended());
    drop(bystander);
    drop(pool);
}

/// The frontend clears O_NONBLOCK on the call eventfd it shares with us and saturates it:
/// the worker's signal is interrupted by the watchdog, the queue stops, and the session is
/// ended — the worker does not block.
#[test]
fn a_wedged_call_eventfd_ends_the_session_without_blocking_the_worker() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&rig.call);
    // SAFETY: fcntl on the test's own eventfd (the same open file description as the
    // worker's call fd).
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    rig.call.write(u64::MAX - 1).unwrap();
    rig.write_header(HDR, req_type::FLUSH, 0);
    rig.publish(&flush_chain(), 0);
    let t0 = Instant::now();
    for _ in 0..5 {
        rig.worker.step();
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(rig.killed.load(Ordering::SeqCst), "the session is ended");
    assert!(rig.broken(), "the queue is stopped");
    assert_eq!(rig.used_idx(), 1, "the flush itself was answered");
}

/// Requests with many segments on every head: the worker keeps a bounded number of grown
/// iovec vectors and gives the others back.
#[test]
fn slots_do_not_keep_what_a_hostile_guest_made_them_grow_to() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.worker.set_big_slots_max(2);
    // Reads of 32 one-sector segments through an indirect table, head after head.
    for head in [0u16, 2, 4, 6, 8] {
        let table: Vec<RawDescriptor> = std::iter::once(d(HDR, 16, F_NEXT, 1))
            .chain((0..32u16).map(|i| d(DATA + 512 * u64::from(i), 512, F_WRITE | F_NEXT, i + 2)))
            .chain(std::iter::once(d(STATUS, 1, F_WRITE, 0)))
            .collect();
        for (i, t) in table.iter().enumerate() {
            rig.mem
                .write_obj(*t, GuestAddress(TABLE + 16 * i as u64))
                .unwrap();
        }
        rig.write_header(HDR, req_type::IN, 0);
        let slot = rig.next_avail % QSIZE;
        rig.next_avail = rig.next_avail.wrapping_add(1);
        rig.store_desc(head, d(TABLE, 16 * table.len() as u32, F_INDIRECT, 0));
        rig.set_avail(slot, head);
        rig.set_avail_idx(rig.next_avail);
        rig.worker.settle();
        let st: u8 = rig.mem.read_obj(GuestAddress(STATUS)).unwrap();
        assert_eq!(st, status::OK, "head {head}");
    }
    let (big, held) = rig.worker.iovec_memory();
    assert_eq!(big, 2, "two grown vectors kept");
    let small = usize::from(QSIZE) * crate::worker::SLOT_IOVECS;
    assert!(
        held <= small + 2 * 64,
        "{held} iovecs held: the three others went back to {} each",
        crate::worker::SLOT_IOVECS
    );
}
