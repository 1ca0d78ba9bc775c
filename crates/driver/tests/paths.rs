//! The I/O paths against vblk's own device: what each promises, asserted on behaviour
//! (merges happen and every I/O completes once, deadline expiry and sector order, shares
//! by weight, FUA durable before completion, flush ordering, auto's choices).

use std::collections::HashMap;
use std::time::Duration;

use device::DeviceConfig;
use storage::{Delay, DiskSpec, EngineKind};
use vblk_driver::{
    Completion, Disk, DiskOptions, ElevatorKind, Io, PathKind, Queue, QueueOptions, RequestOptions,
};

mod common;
use common::{device_count, mem_device, pattern, start, start_with, with_stats, Rng};

fn options(path: PathKind, request: RequestOptions) -> DiskOptions {
    DiskOptions {
        num_queues: Some(1),
        queue: QueueOptions {
            path,
            request,
            ..QueueOptions::default()
        },
        ..DiskOptions::default()
    }
}

fn one_queue(sock: &std::path::Path, opts: &DiskOptions) -> (Disk, Queue) {
    let disk = Disk::attach(sock, opts).unwrap();
    let q = disk.take_queue(0).unwrap();
    (disk, q)
}

/// Wait for `n` completions; each must succeed.
fn complete(q: &mut Queue, n: usize) -> Vec<Completion> {
    (0..n)
        .map(|_| {
            let c = q.wait(Some(Duration::from_secs(30))).unwrap();
            assert_eq!(c.result, Ok(()), "token {}", c.token);
            c
        })
        .collect()
}

/// A device that serves one request at a time, in ring order, `ms` each: completion order
/// is dispatch order.
fn serial_slow_device(ms: u64) -> DeviceConfig {
    DeviceConfig {
        engine: EngineKind::Sync,
        delay: Some(Delay {
            every: 1,
            by: Duration::from_millis(ms),
            hold: Default::default(),
        }),
        ..mem_device(1)
    }
}

#[test]
fn adjacent_ios_merge_into_few_requests_and_each_completes_once_with_its_data() {
    let (_d, sock) = start(mem_device(1));
    for elevator in ElevatorKind::ALL {
        let req = RequestOptions {
            elevator,
            ..RequestOptions::default()
        };
        let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
        // 32 sequential 4 KiB writes in one plug, then a gap and 8 more going backwards
        // (front merges).
        let mut expect = HashMap::new();
        for i in 0..32u64 {
            let data = pattern(i, 4096);
            let mut b = q.alloc(4096).unwrap();
            b.copy_from_slice(&data);
            q.submit(Io::write(i * 4096, b, i)).unwrap();
            expect.insert(i * 4096, data);
        }
        for i in (0..8u64).rev() {
            let off = (1 << 20) + i * 4096;
            let data = pattern(100 + i, 4096);
            let mut b = q.alloc(4096).unwrap();
            b.copy_from_slice(&data);
            q.submit(Io::write(off, b, 100 + i)).unwrap();
            expect.insert(off, data);
        }
        q.unplug();
        let done = complete(&mut q, 40);
        let mut tokens: Vec<u64> = done.iter().map(|c| c.token).collect();
        tokens.sort_unstable();
        let want: Vec<u64> = (0..32).chain(100..108).collect();
        assert_eq!(tokens, want, "{elevator}: every I/O completes exactly once");
        assert_eq!(q.in_flight(), 0);
        let st = q.request_stats().unwrap();
        assert_eq!(st.back_merges, 31, "{elevator}: {st:?}");
        if elevator == ElevatorKind::Bfq {
            // bfq merges only behind the head of a flow's queue and in the plug.
            assert!(st.front_merges >= 1, "{elevator}: {st:?}");
        } else {
            assert_eq!(st.front_merges, 7, "{elevator}: {st:?}");
        }
        assert!(st.dispatched <= 3, "{elevator}: {st:?}");
        for (off, data) in &expect {
            let mut got = vec![0u8; 4096];
            q.read_at(*off, &mut got).unwrap();
            assert_eq!(&got, data, "{elevator}: data at {off}");
        }
    }
}

#[test]
fn merges_stop_at_max_sectors_kb_at_the_kind_and_at_fua() {
    let (_d, sock) = start(mem_device(1));
    let req = RequestOptions {
        max_sectors_kb: 16,
        ..RequestOptions::default()
    };
    {
        let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
        for i in 0..16u64 {
            let b = q.alloc(4096).unwrap();
            q.submit(Io::write(i * 4096, b, i)).unwrap();
        }
        q.unplug();
        complete(&mut q, 16);
        let st = q.request_stats().unwrap();
        // 16 KiB per request: 4 I/Os each, 3 merges each.
        assert_eq!((st.back_merges, st.dispatched), (12, 4), "{st:?}");
    }

    // Reads after writes at adjacent sectors, and FUA writes, do not merge.
    let (_disk2, mut q) = one_queue(
        &sock,
        &options(PathKind::Request, RequestOptions::default()),
    );
    let b = q.alloc(4096).unwrap();
    q.submit(Io::write(0, b, 0)).unwrap();
    let b = q.alloc(4096).unwrap();
    q.submit(Io::read(4096, b, 1)).unwrap();
    let b = q.alloc(4096).unwrap();
    q.submit(Io::write(8192, b, 2).fua()).unwrap();
    let b = q.alloc(4096).unwrap();
    q.submit(Io::write(12288, b, 3)).unwrap();
    q.unplug();
    complete(&mut q, 4);
    let st = q.request_stats().unwrap();
    assert_eq!(
        (st.back_merges + st.front_merges, st.dispatched),
        (0, 4),
        "{st:?}"
    );
}

#[test]
fn deadline_serves_in_sector_order_until_a_read_expires() {
    let (_d, sock) = start(serial_slow_device(5));
    {
        let req = RequestOptions {
            elevator: ElevatorKind::Deadline,
            queue_depth: 1,
            fifo_batch: 4,
            ..RequestOptions::default()
        };
        let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
        // 24 reads with gaps (no merging), in a scrambled order: served in sector order.
        let mut order: Vec<u64> = (0..24).collect();
        let mut rng = Rng(11);
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        for &i in &order {
            let b = q.alloc(4096).unwrap();
            q.submit(Io::read(i * 8192, b, i)).unwrap();
        }
        q.unplug();
        let got: Vec<u64> = complete(&mut q, 24).iter().map(|c| c.token).collect();
        assert_eq!(got, (0..24).collect::<Vec<u64>>());
    }

    // Now the far read arrives while the near ones are queued: with a 20 ms expiry and
    // 5 ms per request it is served at the end of the first batch that follows its
    // expiry, long before its turn in sector order (last, 25th).
    let req = RequestOptions {
        elevator: ElevatorKind::Deadline,
        queue_depth: 1,
        fifo_batch: 4,
        read_expire: Duration::from_millis(20),
        ..RequestOptions::default()
    };
    let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
    let b = q.alloc(4096).unwrap();
    q.submit(Io::read(0, b, 0)).unwrap();
    q.unplug();
    let b = q.alloc(4096).unwrap();
    q.submit(Io::read(32 << 20, b, 1000)).unwrap();
    for i in 1..24u64 {
        let b = q.alloc(4096).unwrap();
        q.submit(Io::read(i * 8192, b, i)).unwrap();
    }
    q.unplug();
    let order: Vec<u64> = complete(&mut q, 25).iter().map(|c| c.token).collect();
    let at = order.iter().position(|&t| t == 1000).unwrap();
    assert!(
        (4..=12).contains(&at),
        "the expired read is served at a batch boundary after 20 ms, not last: {order:?}"
    );
    // Everything else still in sector order.
    let rest: Vec<u64> = order.iter().copied().filter(|&t| t != 1000).collect();
    assert_eq!(rest, (0..24).collect::<Vec<u64>>());
}

#[test]
fn bfq_shares_the_device_by_weight_between_backlogged_flows() {
    let (_d, sock) = start(serial_slow_device(1));
    let req = RequestOptions {
        elevator: ElevatorKind::Bfq,
        queue_depth: 1,
        ..RequestOptions::default()
    };
    let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
    q.set_flow_weight(1, 300);
    q.set_flow_weight(2, 100);
    // Each flow keeps 16 I/Os queued: every completion is replaced by one of the same flow.
    let mut rng = Rng(7);
    let mut submit = |q: &mut Queue, flow: u16, token: u64| {
        let b = q.alloc(4096).unwrap();
        let off = (rng.next() % 8192) * 4096;
        q.submit(Io::read(off, b, token).flow(flow)).unwrap();
    };
    let mut token = 0u64;
    for flow in [1u16, 2] {
        for _ in 0..16 {
            submit(&mut q, flow, token << 8 | u64::from(flow));
            token += 1;
        }
    }
    q.unplug();
    let mut served = [0u32; 3];
    for _ in 0..400 {
        let c = q.wait(Some(Duration::from_secs(30))).unwrap();
        c.result.unwrap();
        let flow = (c.token & 0xff) as u16;
        served[usize::from(flow)] += 1;
        submit(&mut q, flow, token << 8 | u64::from(flow));
        token += 1;
        q.unplug();
    }
    let ratio = f64::from(served[1]) / f64::from(served[2]);
    assert!(
        (2.7..=3.3).contains(&ratio),
        "weights 300:100 served {served:?} (ratio {ratio:.2})"
    );
    // Drain.
    while q.in_flight() > 0 {
        q.wait(Some(Duration::from_secs(30))).unwrap();
    }
}

#[test]
fn a_flush_is_not_overtaken_and_overtakes_nothing_on_the_request_path() {
    let (_d, sock) = start(serial_slow_device(2));
    let req = RequestOptions {
        elevator: ElevatorKind::Deadline,
        queue_depth: 1,
        ..RequestOptions::default()
    };
    let (_disk, mut q) = one_queue(&sock, &options(PathKind::Request, req));
    for (off, t) in [(800 * 4096, 1), (8 * 4096, 2), (400 * 4096, 3)] {
        let b = q.alloc(4096).unwrap();
        q.submit(Io::write(off, b, t)).unwrap();
    }
    q.submit(Io::flush(4)).unwrap();
    let b = q.alloc(4096).unwrap();
    q.submit(Io::write(0, b, 5)).unwrap();
    q.unplug();
    let order: Vec<u64> = complete(&mut q, 5).iter().map(|c| c.token).collect();
    // The writes before the flush in sector order, the flush, then the write after it —
    // though its sector comes first.
    assert_eq!(order, vec![2, 3, 1, 4, 5]);
    assert_eq!(q.request_stats().unwrap().barriers, 1);
}

#[test]
fn fua_writes_are_durable_before_they_complete_on_every_path() {
    for path in [
        PathKind::Bio,
        PathKind::Batch,
        PathKind::Request,
        PathKind::Auto,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, control) = with_stats(dir.path());
        let (_d, sock) = start_with(daemon, mem_device(1));
        let (disk, mut q) = one_queue(&sock, &options(path, RequestOptions::default()));
        assert!(disk.info().write_cache, "the device starts in writeback");
        let b = q.alloc(4096).unwrap();
        q.submit(Io::write(0, b, 1)).unwrap();
        complete(&mut q, 1);
        assert_eq!(device_count(&control, "flush"), 0, "{path}: a plain write");
        for i in 0..4u64 {
            let b = q.alloc(4096).unwrap();
            q.submit(Io::write(i * 8192, b, 10 + i).fua()).unwrap();
        }
        q.unplug();
        let mut flushes_seen = Vec::new();
        for _ in 0..4 {
            let c = q.wait(Some(Duration::from_secs(30))).unwrap();
            assert_eq!(c.result, Ok(()));
            // When a FUA write completes, a flush has already been carried out.
            flushes_seen.push(device_count(&control, "flush"));
        }
        assert!(
            flushes_seen.iter().all(|&n| n >= 1),
            "{path}: flushes seen at FUA completions: {flushes_seen:?}"
        );
        assert_eq!(device_count(&control, "write"), 5);
        drop(q);
        drop(disk);

        // Writethrough: a FUA write is a plain write.
        let opts = DiskOptions {
            write_cache: Some(false),
            ..options(path, RequestOptions::default())
        };
        let (disk, mut q) = one_queue(&sock, &opts);
        assert!(!disk.info().write_cache);
        let before = device_count(&control, "flush");
        let b = q.alloc(4096).unwrap();
        q.submit(Io::write(0, b, 1).fua()).unwrap();
        complete(&mut q, 1);
        assert_eq!(
            device_count(&control, "flush"),
            before,
            "{path}: writethrough"
        );
    }
}

#[test]
fn every_path_keeps_the_data_under_a_random_mix() {
    let (_d, sock) = start(mem_device(1));
    for path in [
        PathKind::Bio,
        PathKind::Batch,
        PathKind::Request,
        PathKind::Auto,
    ] {
        for elevator in ElevatorKind::ALL {
            if path != PathKind::Request && elevator != ElevatorKind::Deadline {
                continue;
            }
            let req = RequestOptions {
                elevator,
                queue_depth: 4,
                ..RequestOptions::default()
            };
            let (_disk, mut q) = one_queue(&sock, &options(path, req));
            let mut rng = Rng(0xfeed);
            let blocks = 64u64;
            let mut model: Vec<u64> = vec![0; blocks as usize];
            let mut gen = 1u64;
            // Rounds of up to 48 I/Os: writes of 1-4 blocks often adjacent, FUA now and
            // then; reads only of blocks no write in the round touches.
            for _ in 0..40 {
                let mut touched = vec![false; blocks as usize];
                let mut n = 0;
                let mut start_block = rng.next() % blocks;
                for _ in 0..48 {
                    let len = 1 + rng.next() % 4;
                    if start_block + len > blocks {
                        start_block = 0;
                    }
                    let range = start_block..start_block + len;
                    if range.clone().any(|b| touched[b as usize]) {
                        start_block = rng.next() % blocks;
                        continue;
                    }
                    let mut b = q.alloc((len * 4096) as usize).unwrap();
                    for (i, blk) in range.clone().enumerate() {
                        b[i * 4096..(i + 1) * 4096].fill((gen + blk) as u8);
                        touched[blk as usize] = true;
                        model[blk as usize] = gen + blk;
                    }
                    let io = Io::write(start_block * 4096, b, n);
                    q.submit(if rng.next().is_multiple_of(8) {
                        io.fua()
                    } else {
                        io
                    })
                    .unwrap();
                    n += 1;
                    start_block += len;
                    if rng.next().is_multiple_of(3) {
                        start_block = rng.next() % blocks;
                    }
                }
                q.unplug();
                let mut tokens: Vec<u64> = complete(&mut q, n as usize)
                    .iter()
                    .map(|c| c.token)
                    .collect();
                tokens.sort_unstable();
                assert_eq!(tokens, (0..n).collect::<Vec<u64>>(), "{path}/{elevator}");
                gen += 1000;
            }
            for blk in 0..blocks {
                let mut got = vec![0u8; 4096];
                q.read_at(blk * 4096, &mut got).unwrap();
                assert!(
                    got.iter().all(|&x| x == model[blk as usize] as u8),
                    "{path}/{elevator}: block {blk}"
                );
            }
        }
    }
}

#[test]
fn auto_follows_the_devices_hint_and_otherwise_measures_and_remeasures() {
    // A device that says its disk is rotational: the request path, no trials.
    let (_d, sock) = start(DeviceConfig {
        rotational: Some(true),
        ..mem_device(1)
    });
    let (disk, q) = one_queue(&sock, &options(PathKind::Auto, RequestOptions::default()));
    assert!(disk.info().hints.rotational);
    let r = q.auto_report().unwrap();
    assert_eq!(r.current, PathKind::Request);
    assert!(r.reason.contains("rotational"), "{r:?}");
    // ... with a shallow dispatch depth, so that sequential I/Os submitted one at a time
    // wait in the elevator and merge there (the device serves one request at a time).
    assert!(r.reason.contains("queue depth 2"), "{r:?}");
    let mut q = q;
    for i in 0..64u64 {
        let mut b = q.alloc(4096).unwrap();
        b.fill(i as u8);
        q.submit(Io::write(i * 4096, b, i)).unwrap();
        q.unplug();
    }
    complete(&mut q, 64);
    let st = q.request_stats().unwrap();
    assert!(
        st.dispatched <= 16 && st.back_merges >= 48,
        "64 sequential writes, submitted one by one, should merge: {st:?}"
    );
    drop(q);
    drop(disk);

    // No hint: trials, then a choice; a different workload later makes it choose again.
    let (_d2, sock) = start(mem_device(1));
    let (disk, mut q) = one_queue(&sock, &options(PathKind::Auto, RequestOptions::default()));
    assert!(!disk.info().hints.rotational);
    let mut bufs: Vec<_> = (0..8).map(|_| Some(q.alloc(65536).unwrap())).collect();
    let mut rng = Rng(3);
    // A phase runs its workload until `done` says so (rounds are timed: 100 ms after the
    // first I/Os, then eighteen 30 ms slots and one to settle), at most 60 s.
    let mut phase = |q: &mut Queue,
                     bufs: &mut Vec<Option<vblk_driver::Buffer>>,
                     big: bool,
                     done: &dyn Fn(&vblk_driver::AutoReport) -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut seq = 0u64;
        for i in 0.. {
            if i % 256 == 0 && done(&q.auto_report().unwrap()) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{:?}",
                q.auto_report()
            );
            let slot = i % bufs.len();
            if bufs[slot].is_none() {
                let c = q.wait(Some(Duration::from_secs(30))).unwrap();
                c.result.unwrap();
                bufs[c.token as usize] = c.bufs.into_one();
            }
            let mut slot = slot;
            if bufs[slot].is_none() {
                slot = bufs.iter().position(Option::is_some).unwrap();
            }
            let mut b = bufs[slot].take().unwrap();
            let io = if big {
                b.set_len(65536).unwrap();
                seq = (seq + 16) % 8192;
                Io::write(seq * 4096, b, slot as u64)
            } else {
                b.set_len(4096).unwrap();
                Io::read((rng.next() % 8192) * 4096, b, slot as u64)
            };
            q.submit(io).unwrap();
            q.unplug();
        }
        while q.in_flight() > 0 {
            let c = q.wait(Some(Duration::from_secs(30))).unwrap();
            c.result.unwrap();
            bufs[c.token as usize] = c.bufs.into_one();
        }
    };
    phase(&mut q, &mut bufs, false, &|r| r.choices >= 1);
    let r = q.auto_report().unwrap();
    assert_eq!(r.trials.len(), 4, "{r:?}");
    assert!(r.trials.iter().all(|t| t.iops > 0.0), "{r:?}");
    // The same workload for another second: no new round (the next is due after 8 s).
    let first = r.choices;
    let until = std::time::Instant::now() + Duration::from_secs(1);
    phase(&mut q, &mut bufs, false, &|_| {
        std::time::Instant::now() >= until
    });
    assert_eq!(
        q.auto_report().unwrap().choices,
        first,
        "an unchanged workload"
    );
    // 64 KiB sequential writes instead of 4 KiB random reads: measured again.
    phase(&mut q, &mut bufs, true, &|r| r.choices > first);
}

#[test]
fn auto_chooses_once_for_the_whole_disk_with_every_queue_in_the_same_slots() {
    // Four queues on four threads, more than this machine's CPUs: each thread gets the CPU
    // in bursts, so trials on one queue alone would measure the scheduler. The disk runs
    // one round: every queue runs the same path in the same slot and takes the same choice.
    let (_d, sock) = start(mem_device(4));
    let opts = DiskOptions {
        num_queues: Some(4),
        queue: QueueOptions {
            path: PathKind::Auto,
            ..QueueOptions::default()
        },
        ..DiskOptions::default()
    };
    let disk = Disk::attach(&sock, &opts).unwrap();
    let queues: Vec<Queue> = (0..4).map(|i| disk.take_queue(i).unwrap()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let reports: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(i, mut q)| {
                s.spawn(move || {
                    let mut rng = Rng(i as u64 + 7);
                    let mut free: Vec<_> = (0..8).map(|_| q.alloc(4096).unwrap()).collect();
                    let mut after_choice = 0;
                    while after_choice < 2000 {
                        assert!(std::time::Instant::now() < deadline, "no choice in 60 s");
                        while let Some(b) = free.pop() {
                            q.submit(Io::read((rng.next() % 16384) * 4096, b, 0))
                                .unwrap();
                        }
                        q.unplug();
                        let c = q.wait(Some(Duration::from_secs(30))).unwrap();
                        c.result.unwrap();
                        free.push(c.bufs.into_one().unwrap());
                        let r = q.auto_report().unwrap();
                        if r.choices >= 1 && r.reason != "trials in progress" {
                            after_choice += 1;
                        }
                    }
                    while q.in_flight() > 0 {
                        q.wait(Some(Duration::from_secs(30))).unwrap();
                    }
                    q.auto_report().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = &reports[0];
    assert_eq!(first.trials.len(), 4, "{first:?}");
    assert!(first.trials.iter().all(|t| t.iops > 0.0), "{first:?}");
    for r in &reports {
        assert!(r.choices >= 1, "{r:?}");
        assert_eq!(
            r.current, first.current,
            "one choice for the disk: {reports:?}"
        );
    }
}

#[test]
fn auto_finds_the_shallow_request_path_on_a_hard_disk_that_hides_it() {
    // The simulated 7200 rpm disk serves one request at a time in arrival order, and does
    // not say it is rotational. At QD32, bio, batch and the request path at the ring's
    // depth all leave the disk a queue of 32 unmerged, unsorted requests (S4: 3.1k IOPS
    // sequential, 72 random); with two on the ring the rest merge and are sorted in the
    // elevator (21k, and 126). Only measurement can find that here, and auto has to.
    let (_d, sock) = start(DeviceConfig {
        disk: DiskSpec::Hdd {
            size: 1 << 30,
            speedup: 1,
            reports_rotation: false,
        },
        num_queues: 1,
        ..Default::default()
    });
    let (disk, mut q) = one_queue(&sock, &options(PathKind::Auto, RequestOptions::default()));
    assert!(!disk.info().hints.rotational);
    let mut free: Vec<_> = (0..32).map(|_| q.alloc(4096).unwrap()).collect();
    let mut rng = Rng(11);
    let mut next = 0u64;
    // Runs QD32 4 KiB reads (sequential or random) until auto has decided `rounds`
    // rounds, at most `limit`; returns the report.
    let mut run = |q: &mut Queue, sequential: bool, rounds: u64, limit: Duration| {
        let deadline = std::time::Instant::now() + limit;
        loop {
            while let Some(b) = free.pop() {
                let block = if sequential {
                    next = (next + 1) % 262_144;
                    next
                } else {
                    rng.next() % 262_144
                };
                q.submit(Io::read(block * 4096, b, 0)).unwrap();
            }
            q.unplug();
            let c = q.wait(Some(Duration::from_secs(30))).unwrap();
            c.result.unwrap();
            free.push(c.bufs.into_one().unwrap());
            let r = q.auto_report().unwrap();
            if r.choices >= rounds && r.reason != "trials in progress" {
                return r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no choice within {limit:?}: {r:?}"
            );
        }
    };
    // Auto uses the request path at depth 2, its trials say it is the best candidate,
    // and by at least `factor` over every candidate at the ring's depth.
    let shallow_wins = |r: &vblk_driver::AutoReport, factor: f64, what: &str| {
        assert_eq!(r.trials.len(), 4, "{r:?}");
        assert_eq!(
            (r.current, r.queue_depth),
            (PathKind::Request, Some(2)),
            "{what}: {r:?}"
        );
        let best = r
            .trials
            .iter()
            .max_by(|a, b| a.iops.total_cmp(&b.iops))
            .unwrap();
        assert_eq!(best.queue_depth, Some(2), "{what}: {r:?}");
        assert!(
            r.trials
                .iter()
                .filter(|t| t.queue_depth.is_none())
                .all(|t| t.iops * factor < best.iops),
            "{what}: the shallow depth should be worth {factor}x: {r:?}"
        );
    };
    // Sequential reads merge in the elevator: several times the IOPS.
    let r = run(&mut q, true, 1, Duration::from_secs(30));
    shallow_wins(&r, 3.0, "sequential");
    // Random reads: a new workload, a new round. Switching from 32 on the ring to 2
    // takes the disk about 0.4 s to drain, more than a slot: auto lengthens its slots
    // until the drain is a small part of them, and still finds the shallow depth (the
    // elevator sorts what waits: shorter seeks).
    let r = run(&mut q, false, r.choices + 1, Duration::from_secs(60));
    shallow_wins(&r, 1.3, "random");
    while q.in_flight() > 0 {
        q.wait(Some(Duration::from_secs(30))).unwrap();
    }
}
