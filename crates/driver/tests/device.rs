//! The driver against vblk's own device, in one process over a Unix socket in a temp dir.

use std::path::PathBuf;
use std::time::Duration;

use device::DeviceConfig;
use storage::{DiskSpec, EngineKind};
use vblk_driver::disk::supported_protocol_features;
use vblk_driver::{Disk, DiskOptions, ErrorKind, PathKind, QueueOptions};
use vhost::vhost_user::message::VhostUserProtocolFeatures;

mod common;
use common::{mem_device, pattern, start, start_with, Rng};

#[test]
fn info_reports_what_the_device_offers() {
    let (_d, sock) = start(DeviceConfig {
        serial: Some("vblk-test-serial".into()),
        ..mem_device(2)
    });
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    let i = disk.info();
    assert_eq!(i.capacity_bytes, 64 << 20);
    assert_eq!(i.capacity_sectors, (64 << 20) / 512);
    assert_eq!(i.logical_block_size, 512);
    assert_eq!(i.num_queues, 2);
    assert_eq!(i.device_queues, 2);
    assert_eq!(i.serial, "vblk-test-serial");
    assert!(i.flush && i.discard && i.write_zeroes && !i.read_only);
    assert!(i.indirect && i.event_idx);
    assert_eq!(i.seg_max, 254);
    assert_eq!(i.size_max, 1 << 20);
    assert!(i.max_discard_sectors > 0 && i.max_write_zeroes_sectors > 0);
    for f in ["FLUSH", "DISCARD", "WRITE_ZEROES", "MQ", "VERSION_1"] {
        assert!(i.feature_names.iter().any(|n| n == f), "{f} missing");
    }
    // Every protocol feature negotiated is named (BACKEND_REQ, bit 5, was left out).
    assert_eq!(
        i.protocol_feature_names,
        [
            "MQ",
            "REPLY_ACK",
            "BACKEND_REQ",
            "CONFIG",
            "CONFIGURE_MEM_SLOTS"
        ]
    );
    assert_eq!(
        i.protocol_feature_names.len() as u32,
        i.protocol_features.count_ones(),
        "{:#x}",
        i.protocol_features
    );
}

/// Random offsets and sizes written on every queue, then read back and compared.
fn integrity(sock: &PathBuf, opts: &DiskOptions, rounds: usize) {
    let disk = Disk::attach(sock, opts).unwrap();
    let cap = disk.info().capacity_bytes;
    let queues = disk.take_queues();
    assert_eq!(queues.len(), usize::from(disk.info().num_queues));
    let mut handles = Vec::new();
    for (qi, mut q) in queues.into_iter().enumerate() {
        // Each queue owns a disjoint stripe of the disk.
        let stripe = cap / u64::from(disk.info().num_queues);
        let base = stripe * qi as u64;
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9E37_79B9 + qi as u64);
            let mut written = Vec::new();
            for r in 0..rounds {
                let sectors = 1 + rng.next() % 64;
                let len = (sectors * 512) as usize;
                let off = base + (rng.next() % ((stripe - len as u64) / 512)) * 512;
                let seed = (qi * 100_000 + r) as u64;
                let mut buf = q.alloc(len).unwrap();
                buf.copy_from_slice(&pattern(seed, len));
                q.write(off, buf, r as u64).unwrap();
                let c = q.wait(Some(Duration::from_secs(10))).unwrap();
                assert_eq!(c.token, r as u64);
                c.result.unwrap();
                written.retain(|&(o, l, _): &(u64, usize, u64)| {
                    off + len as u64 <= o || o + l as u64 <= off
                });
                written.push((off, len, seed));
            }
            q.flush_sync().unwrap();
            for (off, len, seed) in written {
                let mut got = vec![0u8; len];
                q.read_at(off, &mut got).unwrap();
                assert!(
                    got == pattern(seed, len),
                    "queue {qi}: mismatch at {off} + {len}"
                );
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn data_written_reads_back_on_every_queue() {
    let daemon = device::DaemonConfig {
        threads: 2,
        ..Default::default()
    };
    let (_d, sock) = start_with(daemon, mem_device(4));
    integrity(&sock, &DiskOptions::default(), 200);
}

#[test]
fn integrity_holds_without_indirect_or_event_idx_and_on_the_batch_path() {
    let (_d, sock) = start(mem_device(2));
    let opts = DiskOptions {
        indirect: false,
        event_idx: false,
        queue: QueueOptions {
            path: PathKind::Batch,
            batch: 4,
            ..Default::default()
        },
        ..Default::default()
    };
    integrity(&sock, &opts, 100);
}

#[test]
fn file_disk_with_io_uring_and_o_direct() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![0u8; 16 << 20]).unwrap();
    let (_d, sock) = start(DeviceConfig {
        disk: DiskSpec::File(img.clone()),
        cache: storage::CacheMode::None,
        engine: EngineKind::IoUring,
        ..Default::default()
    });
    integrity(&sock, &DiskOptions::default(), 100);
    // What the driver wrote is in the file.
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    q.write_at(4096, &pattern(7, 8192)).unwrap();
    q.flush_sync().unwrap();
    drop(q);
    let bytes = std::fs::read(&img).unwrap();
    assert!(bytes[4096..4096 + 8192] == pattern(7, 8192)[..]);
}

#[test]
fn big_io_is_split_and_completes_once() {
    let (_d, sock) = start(mem_device(1));
    // A small seg_max (queue size 16 → seg_max 14) with 1 MiB size_max: 32 MiB needs 3 requests.
    let opts = DiskOptions {
        queue_size: 16,
        ..Default::default()
    };
    let disk = Disk::attach(&sock, &opts).unwrap();
    assert_eq!(disk.info().seg_max, 254, "device offers its own seg_max");
    let mut q = disk.take_queue(0).unwrap();
    let len = 32 << 20;
    let mut buf = q.alloc(len).unwrap();
    buf.copy_from_slice(&pattern(11, len));
    q.write(0, buf, 42).unwrap();
    let c = q.wait(None).unwrap();
    assert_eq!((c.token, c.result), (42, Ok(())));
    assert!(q.poll().is_none(), "one completion for one I/O");
    let back = q.alloc(len).unwrap();
    q.read(0, back, 43).unwrap();
    let c = q.wait(None).unwrap();
    assert_eq!(c.token, 43);
    assert!(*c.bufs.into_one().unwrap() == pattern(11, len)[..]);
    // readv across several buffers of odd (but aligned) sizes.
    let bufs = vec![
        q.alloc(512).unwrap(),
        q.alloc(3 << 20).unwrap(),
        q.alloc(1536).unwrap(),
    ];
    q.readv(0, bufs, 44).unwrap();
    let c = q.wait(None).unwrap();
    let all: Vec<u8> = c.bufs.into_vec().iter().flat_map(|b| b.to_vec()).collect();
    assert!(all == pattern(11, len)[..all.len()]);
}

/// bio and batch send a one-buffer read or write of at most size_max bytes in one pass,
/// and anything bigger through the stages (split at size_max). Both sides of that edge,
/// on both paths, at the offset where the disk ends: every byte lands where it belongs,
/// one completion per I/O, and one block past the end is refused with the buffer back.
#[test]
fn one_buffer_at_size_max_and_one_block_more_on_bio_and_batch() {
    let (_d, sock) = start(mem_device(1));
    for path in [PathKind::Bio, PathKind::Batch] {
        let opts = DiskOptions {
            queue: QueueOptions {
                path,
                batch: 4,
                ..Default::default()
            },
            ..Default::default()
        };
        let disk = Disk::attach(&sock, &opts).unwrap();
        let (size_max, capacity) = (disk.info().size_max as usize, disk.info().capacity_bytes);
        let mut q = disk.take_queue(0).unwrap();
        for (i, len) in [size_max, size_max + 512].into_iter().enumerate() {
            let at = capacity - len as u64;
            let data = pattern(i as u64 + 20, len);
            let mut b = q.alloc(len).unwrap();
            b.copy_from_slice(&data);
            q.write(at, b, 1).unwrap();
            let c = q.wait(Some(Duration::from_secs(10))).unwrap();
            assert_eq!((c.token, c.result), (1, Ok(())), "{path:?}, {len} bytes");
            assert!(q.poll().is_none(), "one completion for one write");
            q.read(at, q.alloc(len).unwrap(), 2).unwrap();
            let c = q.wait(Some(Duration::from_secs(10))).unwrap();
            assert_eq!((c.token, c.result), (2, Ok(())));
            assert!(
                *c.bufs.into_one().unwrap() == data[..],
                "{path:?}, {len} bytes read back"
            );
            // A small read of the last block, through the fast path, sees the tail.
            let mut tail = [0u8; 512];
            q.read_at(capacity - 512, &mut tail).unwrap();
            assert!(tail[..] == data[len - 512..]);
            let e = q.write(at + 512, q.alloc(len).unwrap(), 3).unwrap_err();
            assert_eq!(e.error.kind(), ErrorKind::OutOfRange, "{}", e.error);
            assert_eq!(e.bufs.into_one().map(|b| b.len()), Some(len));
            assert_eq!(q.in_flight(), 0);
        }
    }
}

#[test]
fn full_ring_backpressure_waits_instead_of_failing() {
    let (_d, sock) = start(mem_device(1));
    let opts = DiskOptions {
        queue_size: 8,
        indirect: false,
        ..Default::default()
    };
    let disk = Disk::attach(&sock, &opts).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    // 500 writes of 4 KiB with no waiting in between: the ring holds 2 at a time.
    for i in 0..500u64 {
        let mut b = q.alloc(4096).unwrap();
        b.fill(i as u8);
        q.write(i * 4096, b, i).unwrap();
    }
    let mut seen = vec![false; 500];
    while q.in_flight() > 0 {
        let c = q.wait(Some(Duration::from_secs(10))).unwrap();
        c.result.unwrap();
        assert!(!seen[c.token as usize], "token {} completed twice", c.token);
        seen[c.token as usize] = true;
    }
    assert!(seen.iter().all(|&s| s));
    let mut got = vec![0u8; 4096];
    q.read_at(499 * 4096, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == (499 % 256) as u8));
}

/// Queue 0 of a RAM disk whose engine holds operations as `delay` says (`N:MS:hold...`),
/// attached with `opts` and a wait limit of 1 s.
fn queue_on_held_device(
    delay: &str,
    opts: DiskOptions,
) -> (tempfile::TempDir, Disk, vblk_driver::Queue) {
    let (d, sock) = start(DeviceConfig {
        delay: Some(delay.parse().unwrap()),
        ..mem_device(1)
    });
    let opts = DiskOptions {
        queue: QueueOptions {
            wait_limit: Duration::from_secs(1),
            ..opts.queue
        },
        ..opts
    };
    let disk = Disk::attach(&sock, &opts).unwrap();
    let q = disk.take_queue(0).unwrap();
    (d, disk, q)
}

/// A full ring whose device holds its requests (every operation held 60 s) does not hold
/// the submitter forever: after `wait_limit` the submission fails with a timeout naming the
/// numbers, and hands its buffer back. (It waited without limit before.)
#[test]
fn full_ring_wait_for_room_has_a_deadline() {
    let opts = DiskOptions {
        queue_size: 8,
        indirect: false,
        ..Default::default()
    };
    let (_d, _disk, mut q) = queue_on_held_device("1:60000:hold", opts);
    // Three descriptors a request without indirect ones: the ring of 8 holds two.
    for i in 0..2u64 {
        q.write(i * 4096, q.alloc(4096).unwrap(), i).unwrap();
    }
    let t0 = std::time::Instant::now();
    let e = q.write(2 * 4096, q.alloc(4096).unwrap(), 2).unwrap_err();
    let waited = t0.elapsed();
    assert_eq!(e.error.kind(), ErrorKind::Timeout, "{}", e.error);
    assert!(
        e.error
            .to_string()
            .contains("no room for 1 s: 3 descriptors needed, 2 free"),
        "{}",
        e.error
    );
    assert_eq!(e.bufs.into_one().map(|b| b.len()), Some(4096));
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "failed after {waited:?}"
    );
    assert_eq!(q.in_flight(), 2, "the two held writes are still in flight");
}

/// A blocking call whose request the device holds fails after `wait_limit` instead of
/// waiting forever. Its request stays with the device: the queue refuses other blocking
/// calls, saying why, and hands out nothing when the request completes (its answer is
/// dropped, its buffer freed); then the queue serves blocking calls again, and what the
/// abandoned write carried is on the disk.
#[test]
fn a_blocking_call_gives_up_after_its_wait_limit() {
    let (_d, _disk, mut q) = queue_on_held_device("1:3000:hold-writes", DiskOptions::default());
    let t0 = std::time::Instant::now();
    let e = q.write_at(0, &[0xAB; 4096]).unwrap_err();
    let waited = t0.elapsed();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("did not answer within 1.0 s"), "{e}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_millis(2900),
        "gave up after {waited:?}"
    );
    assert_eq!(q.in_flight(), 0, "the abandoned write is not the caller's");
    let mut got = [0u8; 4096];
    let e = q.read_at(0, &mut got).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("timed out left its request"), "{e}");
    let served = loop {
        assert!(
            q.poll().is_none(),
            "the abandoned write's answer was handed out"
        );
        if q.read_at(0, &mut got).is_ok() {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the held write never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        served >= Duration::from_millis(2900),
        "served after {served:?}"
    );
    assert!(
        got.iter().all(|&b| b == 0xAB),
        "the held write did not land"
    );
}

#[test]
fn discard_write_zeroes_and_flush() {
    let (_d, sock) = start(mem_device(1));
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    q.write_at(0, &vec![0xCD; 1 << 20]).unwrap();
    q.write_zeroes_sync(4096, 8192, false).unwrap();
    q.discard_sync(65536, 65536).unwrap();
    q.write_zeroes_sync(131072, 4096, true).unwrap();
    q.flush_sync().unwrap();
    let mut got = vec![0u8; 1 << 20];
    q.read_at(0, &mut got).unwrap();
    assert!(got[..4096].iter().all(|&b| b == 0xCD));
    assert!(got[4096..12288].iter().all(|&b| b == 0));
    assert!(got[12288..65536].iter().all(|&b| b == 0xCD));
    assert!(got[131072..135168].iter().all(|&b| b == 0));
    assert!(got[135168..].iter().all(|&b| b == 0xCD));
}

#[test]
fn bad_requests_are_refused_before_sending_with_the_numbers() {
    let (_d, sock) = start(mem_device(1));
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    let mut q = disk.take_queue(0).unwrap();
    let b = q.alloc(4096).unwrap();
    let e = q.read(100, b, 1).unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        e.error.to_string(),
        "offset 100 is not a multiple of the logical block size 512"
    );
    assert_eq!(e.error.errno(), libc::EINVAL);
    let b = e.bufs.into_one().expect("the buffer comes back");
    let e = q.write(64 << 20, b, 2).unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::OutOfRange);
    assert_eq!(
        e.error.to_string(),
        "offset 67108864 + length 4096 is past the capacity of 67108864 bytes"
    );
    let b = q.alloc(1000).unwrap();
    let e = q.write(0, b, 3).unwrap_err();
    assert!(e.error.to_string().contains("length 1000"), "{}", e.error);
    assert_eq!(q.in_flight(), 0);
}

#[test]
fn read_only_device_refuses_writes() {
    let (_d, sock) = start(DeviceConfig {
        read_only: true,
        ..mem_device(1)
    });
    let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
    assert!(disk.info().read_only);
    // Offered as qemu-storage-daemon offers them on a read-only export; refused like writes.
    assert!(disk.info().discard && disk.info().write_zeroes);
    let mut q = disk.take_queue(0).unwrap();
    let e = q.write_at(0, &[1u8; 512]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    let e = q.discard_sync(0, 4096).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    let mut got = vec![1u8; 512];
    q.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));
}

#[test]
fn a_frontend_that_negotiates_only_config_is_served() {
    let (_d, sock) = start(mem_device(2));
    let opts = DiskOptions {
        protocol_features: VhostUserProtocolFeatures::CONFIG,
        ..Default::default()
    };
    let disk = Disk::attach(&sock, &opts).unwrap();
    assert_eq!(disk.info().protocol_feature_names, ["CONFIG"]);
    assert_eq!(
        disk.info().num_queues,
        2,
        "queue count from the config space"
    );
    drop(disk);
    integrity(&sock, &opts, 50);
    // And with everything again on the same daemon: it went back to listening.
    let full = DiskOptions {
        protocol_features: supported_protocol_features(),
        ..Default::default()
    };
    integrity(&sock, &full, 20);
}

#[test]
fn the_daemon_serves_one_frontend_after_another() {
    let (_d, sock) = start(mem_device(1));
    for i in 0..5u8 {
        let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
        let mut q = disk.take_queue(0).unwrap();
        if i > 0 {
            let mut got = [0u8; 512];
            q.read_at(0, &mut got).unwrap();
            assert_eq!(got[0], i - 1, "data from the previous connection");
        }
        q.write_at(0, &[i; 512]).unwrap();
    }
}

#[test]
fn a_device_that_never_answers_fails_the_attach_instead_of_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // Accept, then say nothing for longer than the attach may take.
    std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_secs(5));
        drop(conn);
    });
    let t0 = std::time::Instant::now();
    let opts = DiskOptions {
        attach_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let e = Disk::attach(&sock, &opts).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Connect);
    assert!(
        e.to_string()
            .contains("did not complete the handshake within 300ms (a vhost-user device serves one frontend at a time: is another one attached?)"),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_device_that_hangs_up_at_once_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("rude.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || drop(listener.accept()));
    let e = Disk::attach(&sock, &DiskOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Connect);
    assert!(
        e.to_string().starts_with("SET_OWNER") || e.to_string().starts_with("GET_FEATURES"),
        "{e}"
    );
}

/// A path that is no socket is named as such (connect(2) says only "Connection refused").
#[test]
fn a_path_that_is_not_a_socket_is_named_so() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk.img");
    std::fs::write(&file, [0u8; 512]).unwrap();
    for (path, what) in [
        (&file, "a file"),
        (&dir.path().to_path_buf(), "a directory"),
    ] {
        let e = Disk::attach(path, &DiskOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Connect);
        let text = e.to_string();
        assert!(
            text.contains(&format!("it is not a socket ({what})")),
            "{text}"
        );
    }
}
