//! The ring around the requests: notification suppression, broken rings, engine
//! backpressure, stopping a ring with requests in flight, new memory tables, and the
//! configuration space.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use storage::{Completion, Full, Op};

use super::*;

fn notifications(call: &EventFd) -> u64 {
    call.read().unwrap_or(0)
}

/// Publish `n` flush requests (heads 0, 2, 4, ...) in one go and run the worker.
fn flush_batch(rig: &mut Rig, n: u16) {
    for r in 0..n {
        let hdr = HDR + 0x20 * u64::from(r);
        rig.write_header(hdr, req_type::FLUSH, 0);
        rig.store_desc(2 * r, d(hdr, 16, F_NEXT, 2 * r + 1));
        rig.store_desc(2 * r + 1, d(STATUS + u64::from(r), 1, F_WRITE, 0));
        rig.set_avail(rig.next_avail, 2 * r);
        rig.next_avail = rig.next_avail.wrapping_add(1);
    }
    rig.set_avail_idx(rig.next_avail);
    let target = rig.used_idx().wrapping_add(n);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), target, "batch of {n} not completed");
}

/// Publish `n` one-sector reads (heads 0, 3, 6, ...; sector r, data at DATA + 512 r,
/// status at STATUS + r).
pub(super) fn read_batch(rig: &mut Rig, n: u16) {
    for r in 0..n {
        let base = r * 3;
        let hdr = HDR + 0x20 * u64::from(r);
        rig.write_header(hdr, req_type::IN, u64::from(r));
        rig.store_desc(base, d(hdr, 16, F_NEXT, base + 1));
        let data = DATA + 512 * u64::from(r);
        rig.store_desc(base + 1, d(data, 512, F_WRITE | F_NEXT, base + 2));
        rig.store_desc(base + 2, d(STATUS + u64::from(r), 1, F_WRITE, 0));
        rig.mem
            .write_obj(0xEEu8, GuestAddress(STATUS + u64::from(r)))
            .unwrap();
        rig.set_avail(rig.next_avail, base);
        rig.next_avail = rig.next_avail.wrapping_add(1);
    }
    rig.set_avail_idx(rig.next_avail);
}

/// Check that reads 0..n of [`read_batch`] completed with the disk's bytes.
fn check_reads(rig: &Rig, n: u16) {
    let disk = rig.disk();
    for r in 0..u64::from(n) {
        let s: u8 = rig.mem.read_obj(GuestAddress(STATUS + r)).unwrap();
        assert_eq!(s, status::OK, "read {r}");
        let mut got = vec![0u8; 512];
        rig.mem
            .read_slice(&mut got, GuestAddress(DATA + 512 * r))
            .unwrap();
        assert_eq!(got, disk[(r * 512) as usize..(r * 512 + 512) as usize]);
    }
}

#[test]
fn head_outside_the_queue_stops_the_queue() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    assert_eq!(rig.submit(&flush_chain(), QSIZE + 3), None);
    assert!(rig.broken());
    assert_eq!(rig.err.read().unwrap_or(0), 1);
    // A later valid request on the stopped queue is not served.
    assert_eq!(rig.submit(&flush_chain(), 0), None);
    assert_eq!(rig.stop(), 0, "the bad head is the next to process");
}

#[test]
fn avail_index_running_ahead_stops_the_queue() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    rig.write_header(HDR, req_type::FLUSH, 0);
    rig.next_avail = QSIZE + 5;
    assert_eq!(rig.submit(&flush_chain(), 0), None);
    assert!(rig.broken());
}

#[test]
fn many_requests_in_one_batch_all_complete() {
    let mut rig = Rig::new(false, EngineKind::IoUring);
    read_batch(&mut rig, 5);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), 5);
    check_reads(&rig, 5);
}

// ---- requests in flight ----

/// An engine that holds operations back until the test releases them, then runs them on
/// a real engine, newest first: a slow disk that completes out of order, with the test
/// deciding when each operation ends.
struct HoldEngine {
    inner: Box<dyn Engine>,
    held: VecDeque<(u64, Op)>,
    release: Arc<AtomicUsize>,
    /// Released operations fail with this errno instead of running (0: they run).
    fail: Arc<AtomicUsize>,
    depth: usize,
    in_flight: usize,
}

impl Engine for HoldEngine {
    fn name(&self) -> &'static str {
        "hold"
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.depth {
            return Err(Full);
        }
        self.in_flight += 1;
        self.held.push_back((token, op));
        Ok(())
    }

    fn submit(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        let mut n = 0;
        while self.release.load(Ordering::SeqCst) > 0 {
            let Some((token, op)) = self.held.pop_back() else {
                break;
            };
            self.release.fetch_sub(1, Ordering::SeqCst);
            let errno = self.fail.load(Ordering::SeqCst);
            if errno != 0 {
                f(Completion {
                    token,
                    result: Err(std::io::Error::from_raw_os_error(errno as i32)),
                });
                n += 1;
                continue;
            }
            // SAFETY: forwarded from our own push contract, which holds until reaped.
            unsafe { self.inner.push(token, op) }.unwrap();
            self.inner.submit().unwrap();
            let mut got = 0;
            while got == 0 {
                self.inner.wait().unwrap();
                got = self.inner.reap(&mut |c| f(c));
            }
            n += got;
        }
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

/// A rig whose engine holds operations until `release` allows them.
pub(super) fn hold_rig(depth: usize) -> (Rig, Arc<AtomicUsize>) {
    let (rig, release, _fail) = hold_rig_failing(depth);
    (rig, release)
}

/// As [`hold_rig`], and the errno released operations fail with (0: none).
fn hold_rig_failing(depth: usize) -> (Rig, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let file = tempfile::NamedTempFile::new().unwrap();
    let pattern: Vec<u8> = (0..DISK_BYTES).map(|i| (i % 251) as u8).collect();
    std::fs::write(file.path(), &pattern).unwrap();
    let config = DeviceConfig {
        disk: DiskSpec::File(file.path().to_path_buf()),
        queue_size: QSIZE,
        ..Default::default()
    };
    let disk = Arc::new(Backend::open(&config.disk, &OpenOptions::default()).unwrap());
    let release = Arc::new(AtomicUsize::new(0));
    let fail = Arc::new(AtomicUsize::new(0));
    let engine = Box::new(HoldEngine {
        inner: disk.engine(EngineKind::Sync, 64).unwrap(),
        held: VecDeque::new(),
        release: release.clone(),
        fail: fail.clone(),
        depth,
        in_flight: 0,
    });
    let rig = Rig::with_engine(&config, &disk, engine, depth, all_features(), file);
    (rig, release, fail)
}

#[test]
fn a_failed_io_is_answered_ioerr() {
    let (mut rig, release, fail) = hold_rig_failing(16);
    fail.store(libc::EIO as usize, Ordering::SeqCst);
    read_batch(&mut rig, 2);
    release.store(2, Ordering::SeqCst);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), 2);
    for r in 0..2u16 {
        let s: u8 = rig
            .mem
            .read_obj(GuestAddress(STATUS + u64::from(r)))
            .unwrap();
        assert_eq!(
            s,
            status::IOERR,
            "read {r}: the status byte says the I/O failed"
        );
    }
    let mut used = [rig.used_elem(0), rig.used_elem(1)];
    used.sort();
    assert_eq!(used, [(0, 1), (3, 1)], "heads 0 and 3, used length 1");
    assert_eq!(rig.stats.failed.load(Ordering::Relaxed), 2);
    assert!(
        !rig.broken(),
        "a failed I/O is an answer, not a broken ring"
    );
}

#[test]
fn a_head_offered_again_while_in_flight_stops_the_queue() {
    let (mut rig, release) = hold_rig(16);
    read_batch(&mut rig, 1);
    step(&mut rig, 3);
    assert_eq!(rig.worker.in_flight(), 1);
    // The driver puts head 0 in the ring again before the device answered it.
    rig.set_avail(rig.next_avail, 0);
    rig.next_avail += 1;
    rig.set_avail_idx(rig.next_avail);
    step(&mut rig, 3);
    assert!(rig.broken());
    assert_eq!(rig.err.read().unwrap_or(0), 1);
    // The first one still completes and is published.
    release.store(10, Ordering::SeqCst);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), 1);
    check_reads(&rig, 1);
    assert_eq!(rig.stop(), 1, "the repeated head is the next to process");
}

pub(super) fn step(rig: &mut Rig, n: usize) {
    for _ in 0..n {
        rig.worker.step();
    }
}

#[test]
fn a_full_engine_leaves_chains_in_the_ring() {
    let (mut rig, release) = hold_rig(2);
    read_batch(&mut rig, 5);
    step(&mut rig, 10);
    assert_eq!(
        rig.worker.in_flight(),
        2,
        "only what the engine holds is popped"
    );
    assert_eq!(rig.used_idx(), 0, "nothing failed for want of room");
    release.store(5, Ordering::SeqCst);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), 5);
    check_reads(&rig, 5);
}

#[test]
fn stopping_a_ring_waits_for_its_requests() {
    let (mut rig, release) = hold_rig(16);
    read_batch(&mut rig, 3);
    step(&mut rig, 3);
    assert_eq!(rig.worker.in_flight(), 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    step(&mut rig, 20);
    assert!(
        rx.try_recv().is_err(),
        "GET_VRING_BASE answered with requests in flight"
    );
    // Chains published after the stop began are not taken.
    rig.write_header(HDR2, req_type::FLUSH, 0);
    rig.store_desc(QSIZE - 2, d(HDR2, 16, F_NEXT, QSIZE - 1));
    rig.store_desc(QSIZE - 1, d(STATUS + 15, 1, F_WRITE, 0));
    rig.set_avail(rig.next_avail, QSIZE - 2);
    rig.set_avail_idx(rig.next_avail + 1);
    release.store(100, Ordering::SeqCst);
    let next = rig.step_until(&rx);
    assert_eq!(
        next, 3,
        "the three popped requests, not the one after the stop"
    );
    assert_eq!(
        rig.used_idx(),
        3,
        "all completions published before the answer"
    );
    check_reads(&rig, 3);
    assert_eq!(rig.worker.in_flight(), 0);
}

#[test]
fn completions_after_a_timed_out_stop_are_never_published() {
    let (mut rig, release) = hold_rig(16);
    rig.worker.set_drain_timeout(Duration::from_millis(30));
    read_batch(&mut rig, 2);
    step(&mut rig, 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    let t0 = std::time::Instant::now();
    let next = rig.step_until_timeout(&rx, Duration::from_secs(10));
    assert!(t0.elapsed() >= Duration::from_millis(30));
    assert_eq!(next, 2);
    assert_eq!(rig.worker.zombies(), 1);
    // The frontend has the ring back (it may re-arm or move it). The late completions
    // must not touch it or the requests' status bytes.
    let before = snapshot(&rig.mem);
    release.store(100, Ordering::SeqCst);
    for _ in 0..100 {
        rig.worker.step();
    }
    assert_eq!(rig.worker.in_flight(), 0, "the engine handed them back");
    assert_eq!(rig.worker.zombies(), 0);
    let after = snapshot(&rig.mem);
    let data = (DATA, DATA + 1024);
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let i = i as u64;
        // The engine itself may land read data in the buffers (that cannot be undone),
        // but nothing of the device's: no status byte, no used element, no index.
        assert!(a == b || (i >= data.0 && i < data.1), "byte {i:#x} changed");
    }
    assert_eq!(rig.used_idx(), 0);
}

#[test]
fn a_new_memory_table_with_requests_in_flight() {
    let (mut rig, release) = hold_rig(16);
    read_batch(&mut rig, 4);
    step(&mut rig, 3);
    assert_eq!(rig.worker.in_flight(), 4);
    // The frontend sends the same memory again (as QEMU does when it adds a region): the
    // requests in flight keep their mapping, the ring moves to the new view.
    let gm = Arc::new(GuestMemory::from_mmap(rig.mem.clone()));
    rig.ask(|reply| Command::Memory { mem: gm, reply });
    release.store(100, Ordering::SeqCst);
    rig.worker.settle();
    assert_eq!(rig.used_idx(), 4);
    check_reads(&rig, 4);
    assert!(!rig.broken());
}

#[test]
fn a_memory_table_without_the_ring_stops_the_queue() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    // Only the second region: the rings (in the first) are gone.
    let second: Mem =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 0x10_0000)]).unwrap();
    let gm = Arc::new(GuestMemory::from_mmap(second));
    rig.ask(|reply| Command::Memory { mem: gm, reply });
    assert!(rig.broken());
    assert_eq!(rig.err.read().unwrap_or(0), 1);
}

// ---- notification suppression ----

#[test]
fn a_batch_is_published_with_one_notification() {
    let mut rig = Rig::with_features(
        false,
        EngineKind::Sync,
        all_features() & !feature::bit(feature::RING_EVENT_IDX),
    );
    flush_batch(&mut rig, 5);
    assert_eq!(rig.used_idx(), 5);
    assert_eq!(
        notifications(&rig.call),
        1,
        "one interrupt for the batch of 5"
    );
}

#[test]
fn no_interrupt_flag_is_honoured_without_event_idx() {
    let mut rig = Rig::with_features(
        false,
        EngineKind::Sync,
        all_features() & !feature::bit(feature::RING_EVENT_IDX),
    );
    rig.mem.write_obj(1u16, GuestAddress(rig.avail)).unwrap(); // VRING_AVAIL_F_NO_INTERRUPT
    flush_batch(&mut rig, 3);
    assert_eq!(
        notifications(&rig.call),
        0,
        "the driver asked not to be interrupted"
    );
    rig.mem.write_obj(0u16, GuestAddress(rig.avail)).unwrap();
    flush_batch(&mut rig, 1);
    assert_eq!(notifications(&rig.call), 1);
}

#[test]
fn used_event_is_honoured_with_event_idx() {
    let mut rig = Rig::new(false, EngineKind::Sync);
    let used_event = GuestAddress(rig.avail + 4 + 2 * u64::from(QSIZE));
    // The driver wants to hear only when the used index passes 10.
    rig.mem.write_obj(10u16, used_event).unwrap();
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&rig.call),
        0,
        "used index 4 has not passed used_event 10"
    );
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&rig.call),
        0,
        "used index 8 has not passed used_event 10"
    );
    flush_batch(&mut rig, 4);
    assert_eq!(
        notifications(&rig.call),
        1,
        "used index 12 passed used_event 10"
    );
    // Re-armed at the current index: the next completion notifies.
    rig.mem.write_obj(rig.used_idx(), used_event).unwrap();
    flush_batch(&mut rig, 1);
    assert_eq!(notifications(&rig.call), 1);
}

// ---- inflight tracking ----

/// Start queue `index` on the rig's ring addresses (the same memory as queue 0's), with
/// `region`'s part for it if given; the heads to resubmit and the next available index.
pub(super) fn start_queue(
    rig: &mut Rig,
    index: usize,
    region: Option<&Arc<crate::inflight::InflightRegion>>,
) -> (Vec<u16>, u16) {
    let gm = Arc::new(GuestMemory::from_mmap(rig.mem.clone()));
    let mut ring = DeviceRing::new(&gm, QSIZE, rig.addrs(), true, rig.next_avail).unwrap();
    let (inflight, resubmit, next) = match region {
        Some(region) => {
            let mut iq = region.queue(index, QSIZE).unwrap();
            let (resubmit, next) = iq.prepare(ring.next_used());
            ring.set_next_avail(next);
            (Some(iq), resubmit, next)
        }
        None => (None, Vec::new(), rig.next_avail),
    };
    let (_k, kick) = eventfd_pair();
    let (_c, call) = eventfd_pair();
    let qs = QueueStart {
        index,
        ring,
        info: RingInfo {
            desc_table: GuestAddress(rig.desc),
            size: QSIZE,
            indirect: true,
            max_indirect: RingInfo::max_indirect_for(QSIZE, 254),
        },
        kick: vfd(kick),
        call: Some(vfd(call)),
        err: None,
        enabled: true,
        stats: rig.stats.clone(),
        inflight,
        resubmit: resubmit.clone(),
        log_used: None,
    };
    Worker::post(&rig.mailbox, Command::Start(Box::new(qs)));
    rig.worker.step();
    (resubmit, next)
}

/// Stopping a ring waits for its requests even when an inflight region would let a later
/// start resubmit them: a guest that reboots must not have a write taken before the
/// reboot land after one taken after it.
#[test]
fn a_stop_waits_for_requests_in_flight_even_with_an_inflight_region() {
    use crate::inflight::InflightRegion;
    let (mut rig, release) = hold_rig(16);
    assert_eq!(rig.stop(), 0);
    let poison = Arc::new(AtomicBool::new(false));
    let region = Arc::new(InflightRegion::create(1, QSIZE, &poison).unwrap());
    assert_eq!(start_queue(&mut rig, 0, Some(&region)), (vec![], 0));
    read_batch(&mut rig, 3);
    step(&mut rig, 3);
    assert_eq!(rig.worker.in_flight(), 3);
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    step(&mut rig, 20);
    assert!(
        rx.try_recv().is_err(),
        "GET_VRING_BASE answered while the queue's requests were still out"
    );
    release.store(100, Ordering::SeqCst);
    assert_eq!(rig.step_until(&rx), 3);
    assert_eq!(rig.used_idx(), 3, "published before the answer");
    assert_eq!(rig.worker.zombies(), 0);
    check_reads(&rig, 3);
    let mut iq = region.queue(0, QSIZE).unwrap();
    assert_eq!(iq.prepare(3), (vec![], 3), "nothing left in flight");
}

/// A stop that ran out of time (storage holding requests for longer than the drain
/// timeout) is answered; the next start of the queue on the same inflight region is
/// fenced: neither the heads to resubmit nor new chains are taken while the old I/O runs;
/// then each unanswered head is answered exactly once.
#[test]
fn inflight_region_resubmits_what_a_timed_out_stop_left_once_the_old_io_ended() {
    use crate::inflight::InflightRegion;
    let (mut rig, release) = hold_rig(16);
    rig.worker.set_drain_timeout(Duration::from_millis(30));
    assert_eq!(rig.stop(), 0);
    let poison = Arc::new(AtomicBool::new(false));
    let region = Arc::new(InflightRegion::create(1, QSIZE, &poison).unwrap());
    assert_eq!(
        start_queue(&mut rig, 0, Some(&region)),
        (vec![], 0),
        "a fresh region"
    );
    read_batch(&mut rig, 4); // heads 0, 3, 6, 9
    step(&mut rig, 3);
    assert_eq!(rig.worker.in_flight(), 4);
    release.store(2, Ordering::SeqCst); // newest first: 9 and 6 complete, 0 and 3 do not
    step(&mut rig, 3);
    assert_eq!(rig.used_idx(), 2);
    assert_eq!((rig.used_elem(0).0, rig.used_elem(1).0), (9, 6));
    let rx = rig.post(|reply| Command::Stop { queue: 0, reply });
    assert_eq!(rig.step_until_timeout(&rx, Duration::from_secs(10)), 4);
    assert_eq!(rig.worker.zombies(), 1, "two requests still out");
    // The next start (the same process, or a new one after a crash).
    rig.next_avail = 4;
    assert_eq!(
        start_queue(&mut rig, 0, Some(&region)),
        (vec![0, 3], 4),
        "0 and 3, in the order taken"
    );
    assert!(rig.worker.queue_fenced(0));
    // A new chain too: it must wait behind the fence as well.
    rig.write_header(HDR2, req_type::FLUSH, 0);
    rig.store_desc(QSIZE - 2, d(HDR2, 16, F_NEXT, QSIZE - 1));
    rig.store_desc(QSIZE - 1, d(STATUS + 15, 1, F_WRITE, 0));
    rig.set_avail(rig.next_avail, QSIZE - 2);
    rig.set_avail_idx(rig.next_avail + 1);
    step(&mut rig, 5);
    assert_eq!(
        rig.worker.in_flight(),
        2,
        "nothing resubmitted or taken while the old I/O runs"
    );
    assert_eq!(rig.used_idx(), 2);
    release.store(100, Ordering::SeqCst);
    rig.worker.settle();
    assert!(!rig.worker.queue_fenced(0));
    assert_eq!(rig.worker.zombies(), 0);
    assert_eq!(
        rig.used_idx(),
        5,
        "each answered exactly once, and the flush"
    );
    let mut ids: Vec<u32> = (0..5).map(|i| rig.used_elem(i).0).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 3, 6, 9, u32::from(QSIZE - 2)]);
    check_reads(&rig, 4);
    let mut iq = region.queue(0, QSIZE).unwrap();
    assert_eq!(iq.prepare(5), (vec![], 5), "nothing left in flight");
}

/// Prefetching reads what the driver left in the ring before anything is checked: heads
/// outside the queue, buffers outside guest memory or at the end of the address space,
/// unaligned indirect tables, tables whose entries point anywhere. It must neither fault
/// nor change what the walk then pops.
#[test]
fn prefetch_survives_any_ring_content() {
    let rig = Rig::new(false, EngineKind::Sync);
    let hostile = [
        d(OUTSIDE, 16, 0, 0),
        d(u64::MAX - 7, 16, F_NEXT, 1),
        d(TABLE + 3, 32, F_INDIRECT, 0),
        d(TABLE, 32, F_INDIRECT, 0),
        d(MEM_END - 8, 4096, F_INDIRECT, 0),
        d(u64::MAX, u32::MAX, F_INDIRECT | F_NEXT | F_WRITE, u16::MAX),
    ];
    for i in 0..QSIZE {
        let desc = hostile[usize::from(i) % hostile.len()];
        rig.mem
            .write_obj(desc, GuestAddress(rig.desc + 16 * u64::from(i)))
            .unwrap();
    }
    // The indirect table at TABLE names buffers outside memory and at its very end.
    rig.mem
        .write_obj(d(OUTSIDE, 16, F_NEXT, 1), GuestAddress(TABLE))
        .unwrap();
    rig.mem
        .write_obj(d(MEM_END - 1, 16, 0, 0), GuestAddress(TABLE + 16))
        .unwrap();
    // Every head of the queue, then heads outside it.
    for slot in 0..QSIZE {
        let head = if slot % 3 == 2 { QSIZE + slot } else { slot };
        rig.mem
            .write_obj(head, GuestAddress(rig.avail + 4 + 2 * u64::from(slot)))
            .unwrap();
    }
    rig.mem
        .write_obj(QSIZE, GuestAddress(rig.avail + 2))
        .unwrap();
    let gm = GuestMemory::from_mmap(rig.mem.clone());
    let mut ring = DeviceRing::new(&gm, QSIZE, rig.addrs(), true, 0).unwrap();
    assert_eq!(ring.refresh(), Ok(QSIZE));
    ring.prefetch(&gm, usize::MAX);
    ring.prefetch(&gm, 2);
    assert_eq!(ring.next_avail(), 0, "prefetching pops nothing");
    let popped: Vec<u16> = std::iter::from_fn(|| ring.pop()).collect();
    let expected: Vec<u16> = (0..QSIZE)
        .map(|s| if s % 3 == 2 { QSIZE + s } else { s })
        .collect();
    assert_eq!(popped, expected);
}

/// A ring's index is masked by its size, so a size that is not a power of two is refused
/// where the ring is made (the session refuses it earlier, at SET_VRING_NUM), and a power
/// of two wraps its indices: a ring started near the end of the u16 range pops the entries
/// of the slots it wraps into.
#[test]
fn ring_sizes_are_powers_of_two_and_indices_wrap() {
    let rig = Rig::new(false, EngineKind::Sync);
    let gm = GuestMemory::from_mmap(rig.mem.clone());
    for size in [0, 3, 12, QSIZE - 1] {
        let err = DeviceRing::new(&gm, size, rig.addrs(), true, 0).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{size}: {err}");
    }
    let base = u16::MAX - 1;
    for i in 0..4u16 {
        let slot = base.wrapping_add(i) % QSIZE;
        rig.mem
            .write_obj(100 + i, GuestAddress(rig.avail + 4 + 2 * u64::from(slot)))
            .unwrap();
    }
    rig.mem
        .write_obj(base.wrapping_add(4), GuestAddress(rig.avail + 2))
        .unwrap();
    let mut ring = DeviceRing::new(&gm, QSIZE, rig.addrs(), true, base).unwrap();
    assert_eq!(ring.refresh(), Ok(4));
    let popped: Vec<u16> = std::iter::from_fn(|| ring.pop()).collect();
    assert_eq!(popped, [100, 101, 102, 103]);
}
