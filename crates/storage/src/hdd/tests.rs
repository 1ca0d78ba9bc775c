//! The model's arithmetic, checked against the datasheet figures it was built from, and
//! the engine's behaviour: data, arrival order, completions on the notify fd.

use super::*;
use crate::{BackendKind, DiskSpec, EngineKind, OpenOptions};

const MS: Duration = Duration::from_millis(1);
const GIB: u64 = 1 << 30;

fn disk(size: u64) -> HddDisk {
    HddDisk::new(size, 1, DESKTOP_7200)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn media(offset: u64, len: u64) -> Access {
    Access::Media { offset, len }
}

#[test]
fn parameters_are_the_datasheets() {
    let p = DESKTOP_7200;
    assert_eq!(p.revolution(), Duration::from_nanos(8_333_333));
    assert_eq!(p.track_bytes(), 1_750_000);
    assert!(
        (ms(p.full_stroke()) - 15.0625).abs() < 1e-9,
        "{:?}",
        p.full_stroke()
    );
    assert_eq!(disk(GIB).tracks, GIB.div_ceil(1_750_000));
}

#[test]
fn seek_time_grows_with_distance_and_averages_to_the_datasheet() {
    let d = disk(64 * GIB);
    let max = d.tracks - 1;
    assert_eq!(d.seek(0), Duration::ZERO, "same track: no seek");
    assert_eq!(
        d.seek(1),
        1000 * Duration::from_micros(1),
        "one track: track-to-track"
    );
    assert!((ms(d.seek(max)) - ms(DESKTOP_7200.full_stroke())).abs() < 0.01);
    let mut last = Duration::ZERO;
    for distance in [1, 2, 10, 100, 1000, max / 4, max / 2, max] {
        let t = d.seek(distance);
        assert!(t > last, "seek({distance}) = {t:?} after {last:?}");
        last = t;
    }
    // The datasheets' average seek: the mean over all pairs of tracks, i.e. distance n
    // weighted by (max + 1 - n).
    let (mut sum, mut weight) = (0.0, 0.0);
    for n in 1..=max {
        let w = (max + 1 - n) as f64;
        sum += w * ms(d.seek(n));
        weight += w;
    }
    let average = sum / weight;
    assert!(
        (average - 8.5).abs() < 0.1,
        "average seek {average:.3} ms, datasheet 8.5 ms"
    );
}

#[test]
fn a_sequential_follow_on_costs_no_positioning() {
    let d = disk(GIB);
    let p = DESKTOP_7200;
    let transfer_4k = Duration::from_secs_f64(4096.0 / 210e6);
    let follow_on = d.service(1 << 20, media(1 << 20, 4096));
    assert_eq!(follow_on, p.overhead + transfer_4k);
    // 4 KiB further on, on the same track: no seek, but the sector must come round.
    let skip = d.service(1 << 20, media((1 << 20) + 4096, 4096));
    assert_eq!(skip, p.overhead + p.revolution() / 2 + transfer_4k);
    // Half the disk away: a seek as well.
    let far = d.service(0, media(GIB / 2, 4096));
    let seek = d.seek(d.track(GIB / 2));
    assert!(seek > 8 * MS && seek < 15 * MS, "{seek:?}");
    assert_eq!(far, p.overhead + seek + p.revolution() / 2 + transfer_4k);
    // Flush and discard: the command overhead only.
    assert_eq!(d.service(0, Access::Command), p.overhead);
}

#[test]
fn one_request_costs_less_than_its_two_halves() {
    let d = disk(GIB);
    for (head, at, len) in [
        (0, 0, 8192),                // sequential: the halves pay the overhead twice
        (0, GIB / 3, 128 << 10),     // random: the second half follows on
        (GIB - 4096, 4096, 1 << 20), // a long seek first
    ] {
        let whole = d.service(head, media(at, len));
        let halves = d.service(head, media(at, len / 2))
            + d.service(at + len / 2, media(at + len / 2, len / 2));
        assert!(whole < halves, "{len} at {at}: {whole:?} vs {halves:?}");
        let saved = halves - whole;
        assert!(
            saved.abs_diff(DESKTOP_7200.overhead) < Duration::from_micros(1),
            "merging saves exactly one command, not {saved:?}"
        );
    }
    // Two requests that are not adjacent (what sorting without merging leaves) cost a
    // positioning each; one merged request covering both costs one.
    let apart =
        d.service(0, media(GIB / 2, 4096)) + d.service(GIB / 2 + 4096, media(GIB / 2 + 8192, 4096));
    let merged = d.service(0, media(GIB / 2, 12288));
    assert!(
        apart > merged + DESKTOP_7200.revolution() / 2,
        "{apart:?} vs {merged:?}"
    );
}

#[test]
fn requests_are_served_one_at_a_time_in_arrival_order() {
    let d = disk(GIB);
    let t0 = Instant::now();
    // A far seek, then a cheap follow-on that arrives at the same time: the cheap one
    // waits for the far one (no reordering), then takes only its own service time.
    let far = d.enqueue_one(t0, media(GIB - (1 << 20), 4096));
    let near = d.enqueue_one(t0, media(GIB - (1 << 20) + 4096, 4096));
    assert_eq!(far - t0, d.service(0, media(GIB - (1 << 20), 4096)));
    assert_eq!(
        near - far,
        d.service(GIB - (1 << 20) + 4096, media(GIB - (1 << 20) + 4096, 4096))
    );
    // A request arriving after the disk went idle starts when it arrives.
    let later = near + 100 * MS;
    let idle = d.enqueue_one(later, Access::Command);
    assert_eq!(idle - later, DESKTOP_7200.overhead);
}

#[test]
fn the_speed_factor_divides_every_time() {
    let slow = HddDisk::new(GIB, 1, DESKTOP_7200);
    let fast = HddDisk::new(GIB, 100, DESKTOP_7200);
    let t0 = Instant::now();
    let a = slow.enqueue_one(t0, media(GIB / 2, 65536)) - t0;
    let b = fast.enqueue_one(t0, media(GIB / 2, 65536)) - t0;
    assert_eq!(b, a / 100);
}

fn open(spec: &str) -> Arc<Backend> {
    Arc::new(Backend::open(&spec.parse().unwrap(), &OpenOptions::default()).unwrap())
}

fn iov(buf: &mut [u8]) -> libc::iovec {
    libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }
}

fn readable(fd: RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
}

/// Waits on the notify fd, as a device worker does, until `n` completions came.
fn collect(e: &mut dyn Engine, n: usize) -> Vec<Completion> {
    let fd = e
        .notify_fd()
        .expect("hdd engines signal completions on a fd");
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            readable(fd, 10_000),
            "no completion within 10 s: {} of {n}",
            got.len()
        );
        e.reap(&mut |c| got.push(c));
    }
    got
}

#[test]
fn data_round_trips_and_completions_come_on_the_notify_fd() {
    let b = open("hdd:64M:x10");
    assert_eq!((b.kind(), b.size()), (BackendKind::Hdd, 64 << 20));
    assert_eq!(b.default_serial(), "vblk-hdd");
    assert_eq!(
        "hdd:64M:x10".parse::<DiskSpec>().unwrap(),
        DiskSpec::Hdd {
            size: 64 << 20,
            speedup: 10,
            reports_rotation: true,
        }
    );
    assert!(b.rotational());
    let mut e = b.engine(EngineKind::IoUring, 8).unwrap();
    assert_eq!(
        e.name(),
        "hdd",
        "any engine kind serves a hdd disk with the hdd engine"
    );
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
    let w = iov(&mut data);
    // SAFETY: `data` and `w` outlive the completion, collected below.
    unsafe {
        e.push(
            1,
            Op::Write {
                offset: 32 << 20,
                iov: &w,
                iovcnt: 1,
                durable: false,
            },
        )
    }
    .unwrap();
    let t0 = Instant::now();
    e.submit().unwrap();
    // The model: from the head at 0 to the middle of the disk, then 64 KiB.
    let took = disk(64 << 20).service(0, media(32 << 20, 65536)) / 10;
    // submit returned without waiting for the disk: nothing can be reaped before it is due.
    let mut done = Vec::new();
    e.reap(&mut |c| done.push(c));
    assert!(
        done.is_empty() || t0.elapsed() >= took,
        "completed before its time"
    );
    assert_eq!(e.in_flight(), 1 - done.len());
    done.extend(collect(e.as_mut(), 1 - done.len()));
    assert!(
        t0.elapsed() >= took,
        "completed after {:?}, the model says {took:?}",
        t0.elapsed()
    );
    assert_eq!(
        (done[0].token, done[0].result.as_ref().ok()),
        (1, Some(&65536))
    );
    assert!(
        !readable(e.notify_fd().unwrap(), 0),
        "the timer is quiet with nothing held"
    );
    let mut back = vec![0u8; 65536];
    let r = iov(&mut back);
    // SAFETY: as above.
    unsafe {
        e.push(
            2,
            Op::Read {
                offset: 32 << 20,
                iov: &r,
                iovcnt: 1,
            },
        )
    }
    .unwrap();
    e.submit().unwrap();
    collect(e.as_mut(), 1);
    assert!(back == data, "read back what was written");
    // Out of range: an error, after the command overhead.
    // SAFETY: as above.
    unsafe {
        e.push(
            3,
            Op::Read {
                offset: 64 << 20,
                iov: &r,
                iovcnt: 1,
            },
        )
    }
    .unwrap();
    e.submit().unwrap();
    let c = collect(e.as_mut(), 1);
    assert_eq!(
        c[0].result.as_ref().unwrap_err().raw_os_error(),
        Some(libc::EINVAL)
    );
}

#[test]
fn completions_keep_arrival_order_across_workers_and_depth_is_enforced() {
    let b = open("hdd:1G:x20");
    let mut first = b.engine(EngineKind::Sync, 2).unwrap();
    let mut second = b.engine(EngineKind::Sync, 2).unwrap();
    let mut bufs = vec![vec![0u8; 4096]; 4];
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(|b| iov(b)).collect();
    let read = |i: usize, offset: u64| Op::Read {
        offset,
        iov: &iovs[i],
        iovcnt: 1,
    };
    // Worker 1: a far random read, then a near one. Worker 2, later: a follow-on.
    // SAFETY: the buffers and iovecs outlive every completion, all collected below.
    unsafe {
        first.push(10, read(0, GIB - 4096)).unwrap();
        first.push(11, read(1, 4096 * 1000)).unwrap();
        assert_eq!(first.push(12, read(2, 0)), Err(Full), "depth 2");
    }
    first.submit().unwrap();
    // SAFETY: as above.
    unsafe { second.push(20, read(3, 4096 * 1001)).unwrap() };
    second.submit().unwrap();
    let mut order = Vec::new();
    let (fa, fb) = (first.notify_fd().unwrap(), second.notify_fd().unwrap());
    while order.len() < 3 {
        let mut p = [
            libc::pollfd {
                fd: fa,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: fb,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two live pollfds.
        let ready = unsafe { libc::poll(p.as_mut_ptr(), 2, 10_000) };
        assert!(ready > 0, "no completion within 10 s");
        first.reap(&mut |c| order.push(c.token));
        second.reap(&mut |c| order.push(c.token));
    }
    assert_eq!(order, vec![10, 11, 20], "one head, first come first served");
}
