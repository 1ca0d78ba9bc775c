use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use super::*;
use crate::job::apply_option;

/// Counts the allocations of each thread, so a test can check that a call allocated nothing
/// while other tests run on other threads.
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// is a const-initialised thread-local `Cell` without a destructor, so touching it never
// allocates or re-enters the allocator.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: `ptr` was allocated by this allocator, i.e. by `System`, with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator, i.e. by `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

fn spec(options: &[(&str, &str)]) -> JobSpec {
    let mut spec = JobSpec::default();
    for (k, v) in options {
        apply_option(&mut spec, k, Some(v)).unwrap();
    }
    spec
}

const K: u64 = 1024;

#[test]
fn next_does_not_allocate() {
    for options in [
        &[("rw", "randrw"), ("bssplit", "4k/20:16k/30:64k/50")][..],
        &[("rw", "randrw"), ("norandommap", "1")][..],
        &[("rw", "rw"), ("bssplit", "4k/50:8k/50")][..],
    ] {
        let mut g = Generator::new(&spec(options), 0, 1 << 30, 512, 7).unwrap();
        let before = allocations();
        let mut sum = 0u64;
        for _ in 0..100_000 {
            sum = sum.wrapping_add(g.next().offset);
        }
        assert_eq!(allocations(), before, "{options:?}");
        std::hint::black_box(sum);
    }
    // The counter does see allocations.
    let before = allocations();
    std::hint::black_box(vec![1u8; 16]);
    assert!(allocations() > before);
}

#[test]
fn random_map_visits_every_block_once_per_pass() {
    for blocks in [1u64, 2, 3, 7, 64, 1000, 4097] {
        let s = spec(&[("rw", "randwrite"), ("bs", "4k")]);
        // A tail smaller than a block is never touched.
        let mut g = Generator::new(&s, 1 << 20, blocks * 4 * K + 512, 512, blocks).unwrap();
        assert_eq!(g.blocks_per_pass(), blocks);
        let mut previous: Option<Vec<u64>> = None;
        for _pass in 0..3 {
            let mut seen = vec![0u32; blocks as usize];
            let mut order = Vec::new();
            for _ in 0..blocks {
                let u = g.next();
                assert_eq!(u.dir, IoDir::Write);
                assert_eq!(u.len, 4 * K);
                let rel = u.offset - (1 << 20);
                assert_eq!(rel % (4 * K), 0);
                seen[(rel / (4 * K)) as usize] += 1;
                order.push(rel);
            }
            assert!(seen.iter().all(|&n| n == 1), "{blocks} blocks: {seen:?}");
            // Passes are re-keyed, so large maps change order between passes.
            if blocks >= 64 {
                assert_ne!(previous.as_ref(), Some(&order));
            }
            previous = Some(order);
        }
    }
}

#[test]
fn random_map_order_is_not_sequential() {
    let s = spec(&[("rw", "randread")]);
    let mut g = Generator::new(&s, 0, 100_000 * 4 * K, 512, 1).unwrap();
    let offsets: Vec<u64> = (0..10_000).map(|_| g.next().offset).collect();
    let ascending = offsets.windows(2).filter(|w| w[1] > w[0]).count();
    // About half the steps go up for a random order; a walk would have all of them.
    assert!((4_000..6_000).contains(&ascending), "{ascending}");
}

#[test]
fn sequential_walks_and_wraps() {
    let s = spec(&[("rw", "write"), ("bs", "4k")]);
    // 10k region: 0, 4k, then 8k + 4k would cross the end, so wrap.
    let mut g = Generator::new(&s, 8 * K, 10 * K, 512, 0).unwrap();
    let got: Vec<u64> = (0..6).map(|_| g.next().offset - 8 * K).collect();
    assert_eq!(got, [0, 4 * K, 0, 4 * K, 0, 4 * K]);

    let s = spec(&[("rw", "read"), ("bs", "4k")]);
    let mut g = Generator::new(&s, 0, 12 * K, 4 * K, 0).unwrap();
    let got: Vec<u64> = (0..5).map(|_| g.next().offset).collect();
    assert_eq!(got, [0, 4 * K, 8 * K, 0, 4 * K]);
}

#[test]
fn mixed_sequential_keeps_a_position_per_direction() {
    let s = spec(&[("rw", "rw"), ("bs", "4k")]);
    let mut g = Generator::new(&s, 0, 1 << 20, 512, 3).unwrap();
    let mut next = [0u64; 2];
    let mut dirs = [0u32; 2];
    for _ in 0..1000 {
        let u = g.next();
        let d = u.dir as usize;
        dirs[d] += 1;
        assert_eq!(u.offset, next[d]);
        next[d] = (next[d] + 4 * K) % (1 << 20);
    }
    assert!(dirs[0] > 0 && dirs[1] > 0);
}

#[test]
fn sequential_bssplit_is_contiguous() {
    let s = spec(&[("rw", "read"), ("bssplit", "4k/50:12k/50")]);
    let mut g = Generator::new(&s, 0, 1 << 20, 4 * K, 9).unwrap();
    let mut expect = 0;
    for _ in 0..10_000 {
        let u = g.next();
        if u.len > (1 << 20) - expect {
            expect = 0;
        }
        assert_eq!(u.offset, expect);
        expect += u.len;
    }
}

/// Every unit of every mode is aligned, inside the region, and of a configured size.
#[test]
fn units_are_aligned_and_in_bounds() {
    let start = 3 * 512 * 1024;
    let len = 7 * (1 << 20) + 3 * 4096 + 512; // not a multiple of any block size
    for rw in ["read", "write", "randread", "randwrite", "rw", "randrw"] {
        for norandommap in ["0", "1"] {
            for bs in [
                &[("bs", "4k")][..],
                &[("bssplit", "512/10:4k/30:12k/20:1m/40")][..],
            ] {
                let mut options = vec![("rw", rw), ("norandommap", norandommap)];
                options.extend_from_slice(bs);
                let s = spec(&options);
                let sizes: Vec<u64> = s.block_sizes().collect();
                let mut g = Generator::new(&s, start, len, 512, 42).unwrap();
                assert_eq!(g.max_block(), *sizes.iter().max().unwrap());
                for _ in 0..20_000 {
                    let u = g.next();
                    assert!(sizes.contains(&u.len), "{options:?}: {u:?}");
                    assert_eq!(u.offset % 512, 0, "{options:?}: {u:?}");
                    assert!(u.offset >= start, "{options:?}: {u:?}");
                    assert!(u.offset + u.len <= start + len, "{options:?}: {u:?}");
                    if s.rw.is_random() {
                        assert_eq!((u.offset - start) % u.len, 0, "{options:?}: {u:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn bssplit_random_map_targets_every_min_block() {
    // 4k and 16k units over 64 4k-blocks: a pass is 64 units, each covering its target block.
    let s = spec(&[("rw", "randread"), ("bssplit", "4k/50:16k/50")]);
    let mut g = Generator::new(&s, 0, 256 * K, 4 * K, 5).unwrap();
    assert_eq!(g.blocks_per_pass(), 64);
    let mut covered = [false; 64];
    for _ in 0..64 {
        let u = g.next();
        for b in u.offset / (4 * K)..(u.offset + u.len) / (4 * K) {
            covered[b as usize] = true;
        }
    }
    assert!(covered.iter().all(|&c| c));
}

#[test]
fn same_seed_same_sequence() {
    let s = spec(&[("rw", "randrw"), ("bssplit", "4k/50:64k/50")]);
    let mut a = Generator::new(&s, 0, 1 << 30, 512, 11).unwrap();
    let mut b = Generator::new(&s, 0, 1 << 30, 512, 11).unwrap();
    let mut c = Generator::new(&s, 0, 1 << 30, 512, 12).unwrap();
    let ua: Vec<IoUnit> = (0..1000).map(|_| a.next()).collect();
    let ub: Vec<IoUnit> = (0..1000).map(|_| b.next()).collect();
    let uc: Vec<IoUnit> = (0..1000).map(|_| c.next()).collect();
    assert_eq!(ua, ub);
    assert_ne!(ua, uc);
}

/// Pearson's chi-square statistic of observed counts against expected probabilities.
fn chi_square(observed: &[u64], probabilities: &[f64]) -> f64 {
    let n: u64 = observed.iter().sum();
    observed
        .iter()
        .zip(probabilities)
        .map(|(&o, &p)| {
            let e = p * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

/// The bssplit weights hold over 100,000 units. The chi-square critical value for 3 degrees of
/// freedom at p = 1e-6 is 30.7, so a correct generator fails for fewer than one seed in a
/// million; a weight off by one percentage point gives about 40.
#[test]
fn bssplit_distribution_statistics() {
    let s = spec(&[
        ("rw", "randwrite"),
        ("bssplit", "4k/10:16k/20:64k/30:1m/40"),
    ]);
    for norandommap in [false, true] {
        let mut s = s.clone();
        s.norandommap = norandommap;
        let mut g = Generator::new(&s, 0, 1 << 34, 4096, 20240601).unwrap();
        let mut counts = [0u64; 4];
        for _ in 0..100_000 {
            let i = match g.next().len {
                4096 => 0,
                16384 => 1,
                65536 => 2,
                1048576 => 3,
                other => panic!("unexpected block size {other}"),
            };
            counts[i] += 1;
        }
        let chi2 = chi_square(&counts, &[0.1, 0.2, 0.3, 0.4]);
        assert!(chi2 < 30.7, "chi-square {chi2} for {counts:?}");
    }
}

/// rwmixread holds over 100,000 units: reads are binomial(n, p), so six standard deviations
/// (a false failure about once in 500 million) bound the count.
#[test]
fn rwmixread_statistics() {
    for (rw, mix) in [("randrw", 80u32), ("rw", 30), ("randrw", 50), ("randrw", 1)] {
        let s = spec(&[("rw", rw), ("rwmixread", &mix.to_string())]);
        let mut g = Generator::new(&s, 0, 1 << 30, 512, u64::from(mix)).unwrap();
        let n = 100_000u64;
        let reads = (0..n).filter(|_| g.next().dir == IoDir::Read).count() as f64;
        let p = f64::from(mix) / 100.0;
        let (mean, sd) = (p * n as f64, (n as f64 * p * (1.0 - p)).sqrt());
        assert!(
            (reads - mean).abs() < 6.0 * sd,
            "{rw} rwmixread={mix}: {reads} reads, expected {mean} ± {sd}"
        );
    }
    for (mix, want) in [(0, IoDir::Write), (100, IoDir::Read)] {
        let s = spec(&[("rw", "randrw"), ("rwmixread", &mix.to_string())]);
        let mut g = Generator::new(&s, 0, 1 << 30, 512, 1).unwrap();
        assert!((0..10_000).all(|_| g.next().dir == want));
    }
}

/// Offsets without a random map are uniform: 16 equal bins over 100,000 draws, chi-square
/// with 15 degrees of freedom below its p = 1e-6 critical value 52.6.
#[test]
fn norandommap_offsets_are_uniform() {
    let s = spec(&[("rw", "randread"), ("norandommap", "1")]);
    let len = 1u64 << 30;
    let mut g = Generator::new(&s, 0, len, 512, 99).unwrap();
    let mut bins = [0u64; 16];
    for _ in 0..100_000 {
        bins[(g.next().offset / (len / 16)) as usize] += 1;
    }
    let chi2 = chi_square(&bins, &[1.0 / 16.0; 16]);
    assert!(chi2 < 52.6, "chi-square {chi2} for {bins:?}");
}

#[test]
fn constructor_errors() {
    let s = spec(&[("bs", "64k")]);
    let e = |start, len, align| Generator::new(&s, start, len, align, 0).unwrap_err();
    assert_eq!(
        e(0, 32 * K, 512),
        "region of 32768 bytes is smaller than the largest block size 65536"
    );
    assert_eq!(e(0, 1 << 20, 0), "alignment 0");
    assert_eq!(
        e(100, 1 << 20, 512),
        "region start 100 is not a multiple of the alignment 512"
    );
    assert_eq!(
        e(0, 1 << 20, 3),
        "block size 65536 is not a positive multiple of the alignment 3"
    );
    assert_eq!(
        e(u64::MAX - 511, 1 << 20, 512),
        "region 18446744073709551104 + 1048576 does not fit in 64 bits"
    );
    let mut zero = spec(&[]);
    zero.bssplit = vec![(4096, 0)];
    assert_eq!(
        Generator::new(&zero, 0, 1 << 20, 512, 0).unwrap_err(),
        "bssplit percentages sum to 0"
    );
}

#[test]
fn region_of_exactly_one_block() {
    for rw in ["read", "randread", "randrw"] {
        let s = spec(&[("rw", rw), ("bs", "4k")]);
        let mut g = Generator::new(&s, 4 * K, 4 * K, 4 * K, 0).unwrap();
        assert!((0..10).all(|_| g.next().offset == 4 * K));
    }
}
