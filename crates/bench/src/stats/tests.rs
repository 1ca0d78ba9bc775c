use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::*;

fn uniform(range: std::ops::RangeInclusive<u64>) -> Latency {
    let mut l = Latency::new();
    for ns in range {
        l.record(ns);
    }
    l
}

/// Within HDR's 3-significant-digit precision (0.1%).
fn near(got: u64, want: u64) -> bool {
    got.abs_diff(want) as f64 <= want as f64 * 1e-3
}

#[test]
fn percentiles_of_uniform_data() {
    let l = uniform(1..=10_000);
    assert_eq!(l.count(), 10_000);
    assert_eq!(l.min(), 1);
    assert_eq!(l.max(), 10_000);
    assert!((l.mean() - 5000.5).abs() < 1e-9, "{}", l.mean());
    // Sample standard deviation of 1..=n is sqrt(n (n + 1) / 12).
    let sd = (10_000.0f64 * 10_001.0 / 12.0).sqrt();
    assert!((l.stddev() - sd).abs() < 1e-6, "{} vs {sd}", l.stddev());
    for (p, want) in [
        (1.0, 100),
        (50.0, 5000),
        (90.0, 9000),
        (99.0, 9900),
        (99.9, 9990),
        (99.99, 9999),
        (100.0, 10_000),
    ] {
        let got = l.percentile(p);
        assert!(near(got, want), "p{p}: {got}, want {want}");
    }
    // Below 2048 the histogram is exact.
    assert_eq!(l.percentile(10.0), 1000);
    assert_eq!(l.percentile(0.0), 1);
}

#[test]
fn percentiles_are_clamped_to_exact_extremes() {
    let mut l = Latency::new();
    l.record(1_000_001);
    l.record(1_000_003);
    // Both lie in one 512-wide bucket (999_936..=1_000_447): its top is above max and its
    // bottom below min, and neither may be reported.
    assert_eq!(l.percentile(100.0), 1_000_003);
    assert_eq!(l.percentile(1.0), 1_000_003);
    assert_eq!(l.percentile(0.0), 1_000_001);
    assert_eq!(l.stddev(), 2f64.sqrt());
}

#[test]
fn empty_and_single() {
    let l = Latency::new();
    assert_eq!(
        (l.count(), l.min(), l.max(), l.percentile(50.0)),
        (0, 0, 0, 0)
    );
    assert_eq!((l.mean(), l.stddev()), (0.0, 0.0));
    let mut l = Latency::new();
    l.record(42);
    assert_eq!((l.min(), l.max(), l.percentile(99.0)), (42, 42, 42));
    assert_eq!((l.mean(), l.stddev()), (42.0, 0.0));
}

#[test]
fn values_beyond_an_hour_saturate_in_percentiles_only() {
    let mut l = Latency::new();
    l.record(0);
    l.record(u64::MAX / 2);
    assert_eq!(l.min(), 0);
    assert_eq!(l.max(), u64::MAX / 2);
    assert!(l.percentile(100.0) >= 3_600_000_000_000);
}

#[test]
fn merge_equals_recording_everything() {
    let mut a = uniform(1..=3000);
    let b = uniform(3001..=10_000);
    a.merge(&b);
    let all = uniform(1..=10_000);
    assert_eq!(a.count(), all.count());
    assert_eq!((a.min(), a.max()), (1, 10_000));
    assert!((a.mean() - all.mean()).abs() < 1e-9);
    assert!((a.stddev() - all.stddev()).abs() < 1e-6);
    for p in PERCENTILES {
        assert_eq!(a.percentile(p), all.percentile(p), "p{p}");
    }
    // Merging into or from an empty set.
    let mut empty = Latency::new();
    empty.merge(&all);
    assert_eq!(
        (empty.count(), empty.min(), empty.percentile(50.0)),
        (10_000, 1, all.percentile(50.0))
    );
    let before = (a.count(), a.mean());
    a.merge(&Latency::new());
    assert_eq!((a.count(), a.mean()), before);
}

#[test]
fn fio_json_shape() {
    let l = uniform(1..=10_000);
    let v = l.to_fio_json();
    let obj = v.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["N", "max", "mean", "min", "percentile", "stddev"]);
    assert_eq!(v["N"], 10_000);
    assert_eq!(v["min"], 1);
    assert_eq!(v["max"], 10_000);
    assert_eq!(v["mean"], 5000.5);
    assert!(v["stddev"].as_f64().unwrap() > 2886.0);
    let pct = v["percentile"].as_object().unwrap();
    assert_eq!(pct.len(), 17);
    for key in [
        "1.000000",
        "5.000000",
        "10.000000",
        "50.000000",
        "99.000000",
        "99.500000",
        "99.900000",
        "99.950000",
        "99.990000",
    ] {
        assert!(pct.contains_key(key), "{key} missing from {pct:?}");
    }
    assert_eq!(pct["50.000000"].as_u64(), Some(l.percentile(50.0)));
    // fio leaves the percentiles out of an empty direction.
    let empty = Latency::new().to_fio_json();
    assert_eq!(
        empty,
        serde_json::json!({"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0})
    );
}

/// Spin until this thread has used `cpu` more CPU time (bounded by a generous wall-clock limit,
/// which only a stalled machine reaches).
fn burn(cpu: Duration) {
    let start = Cpu::this_thread().total();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut x = 0u64;
    while Cpu::this_thread().total() < start + cpu {
        for i in 0..10_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(Instant::now() < deadline, "no CPU time accounted");
    }
}

#[test]
fn this_thread_grows_after_burning_cpu() {
    let before = Cpu::this_thread();
    burn(Duration::from_millis(50));
    let used = Cpu::this_thread().since(&before);
    assert!(used.total() >= Duration::from_millis(50), "{used:?}");
    assert!(used.user > Duration::ZERO, "{used:?}");
}

#[test]
fn process_reads_real_numbers() {
    burn(Duration::from_millis(50));
    let pid = std::process::id() as i32;
    let cpu = Cpu::process(pid).unwrap();
    // This thread alone has used 50 ms; /proc counts in clock ticks (10 ms at 100 Hz).
    assert!(cpu.total() >= Duration::from_millis(30), "{cpu:?}");
    // The test harness's threads block on channels: some voluntary switches happened.
    assert!(cpu.ctx_voluntary + cpu.ctx_involuntary > 0, "{cpu:?}");
    assert!(Cpu::process(-1).is_err());
}

#[test]
fn thread_by_tid() {
    burn(Duration::from_millis(50));
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let cpu = Cpu::thread(std::process::id() as i32, tid).unwrap();
    let own = Cpu::this_thread();
    assert!(cpu.total() >= Duration::from_millis(30), "{cpu:?}");
    // Same thread, two sources: ticks lag microseconds by at most a few ticks.
    assert!(
        cpu.total() <= own.total() + Duration::from_millis(50),
        "{cpu:?} vs {own:?}"
    );
}

#[test]
fn threads_named_finds_a_named_thread() {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let worker = std::thread::Builder::new()
        .name("vblkstatstest".to_string())
        .spawn(move || {
            burn(Duration::from_millis(60));
            ready_tx.send(()).unwrap();
            stop_rx.recv().ok();
        })
        .unwrap();
    ready_rx.recv().unwrap();
    let pid = std::process::id() as i32;
    let named = Cpu::threads_named(pid, "vblkstats").unwrap();
    assert!(named.total() >= Duration::from_millis(40), "{named:?}");
    assert!(named.ctx_voluntary + named.ctx_involuntary > 0, "{named:?}");
    let none = Cpu::threads_named(pid, "no-such-thread-name").unwrap();
    assert_eq!(none, Cpu::default());
    stop_tx.send(()).unwrap();
    worker.join().unwrap();
}

#[test]
fn cpu_arithmetic() {
    let a = Cpu {
        user: Duration::from_millis(30),
        system: Duration::from_millis(20),
        ctx_voluntary: 5,
        ctx_involuntary: 1,
    };
    let b = Cpu {
        user: Duration::from_millis(10),
        system: Duration::from_millis(25),
        ctx_voluntary: 2,
        ctx_involuntary: 3,
    };
    assert_eq!(
        a.since(&b),
        Cpu {
            user: Duration::from_millis(20),
            system: Duration::ZERO,
            ctx_voluntary: 3,
            ctx_involuntary: 0,
        }
    );
    assert_eq!(a.add(&b).since(&b), a);
    assert_eq!(a.total(), Duration::from_millis(50));
}

#[test]
fn every_value_lies_in_its_bucket_and_buckets_are_a_thousandth_wide() {
    let mut v = 0u64;
    let mut last = 0;
    while v <= MAX_NS {
        let i = bucket(v);
        assert!(i < BUCKETS, "{v}: bucket {i} of {BUCKETS}");
        assert!(i >= last, "buckets ascend with values: {v}");
        last = i;
        let (low, high) = bucket_range(i);
        assert!(low <= v && v <= high, "{v} outside {low}..={high}");
        assert!(
            (high - low) as f64 <= v as f64 / 1024.0,
            "{v}: {low}..={high}"
        );
        // Both ends map back to the bucket (no gaps, no overlaps).
        assert_eq!((bucket(low), bucket(high)), (i, i), "{v}");
        v = v + 1 + v / 777;
    }
    assert_eq!(bucket(u64::MAX), bucket(MAX_NS));
}

#[test]
fn percentiles_and_spread_of_wide_data_match_the_sorted_samples() {
    // A deterministic spread over six orders of magnitude, around a large mean.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut samples: Vec<u64> = (0..20_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1_000 + (x % 1_000_000_000) / (1 + x % 1000)
        })
        .collect();
    let mut l = Latency::new();
    for &s in &samples {
        l.record(s);
    }
    samples.sort_unstable();
    for p in PERCENTILES {
        let rank = ((p / 100.0 * samples.len() as f64).ceil() as usize).max(1);
        let want = samples[rank - 1];
        assert!(
            near(l.percentile(p), want),
            "p{p}: {} vs {want}",
            l.percentile(p)
        );
    }
    let n = samples.len() as f64;
    let mean = samples.iter().map(|&s| s as f64).sum::<f64>() / n;
    let var = samples
        .iter()
        .map(|&s| (s as f64 - mean).powi(2))
        .sum::<f64>()
        / (n - 1.0);
    assert!((l.mean() - mean).abs() < 1e-6 * mean);
    assert!((l.stddev() - var.sqrt()).abs() < 1e-9 * var.sqrt());
}

#[test]
fn spread_stays_exact_around_a_large_mean() {
    // Samples near an hour apart by a few ns: the shifted sums keep the spread that a sum of
    // squares (1e25 against differences of 1) would lose.
    let mut l = Latency::new();
    for d in [5, 1, 3, 2, 4] {
        l.record(3_000_000_000_000 + d);
    }
    assert_eq!(l.mean(), 3_000_000_000_003.0);
    assert!((l.stddev() - 2.5f64.sqrt()).abs() < 1e-9, "{}", l.stddev());
}
