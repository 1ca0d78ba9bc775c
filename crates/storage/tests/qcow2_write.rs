//! qcow2 images written through the engines, against QEMU: random writes (inside and
//! across clusters, split into misaligned iovecs), write-zeroes and discards, with and
//! without a backing file, on every engine, over clusters of 512 bytes to 64 KiB and over
//! compressed clusters; the bytes read back, and after close `qemu-img check` finds no
//! error and no leak and `qemu-img convert` reads what was written. And what is refused
//! for writing: 8-bit refcounts (a migration destination's too), internal snapshots, a
//! refcount table that points into the image's own metadata.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vblk_storage::{Backend, CacheMode, DiskSpec, Engine, EngineKind, Op, OpenOptions};

mod common;
use common::{check_clean, engine, run, run1, scratch, tool, Buf, Rng};

fn options(backing: &[&Path], cache: CacheMode) -> OpenOptions {
    common::qcow2_options(backing, cache, false)
}

fn raw_of(d: &Path, image: &str) -> Vec<u8> {
    let _ = fs::remove_file(d.join("out.raw"));
    tool(d, "qemu-img", &["convert", "-O", "raw", image, "out.raw"]);
    fs::read(d.join("out.raw")).unwrap()
}

/// Random writes, write-zeroes and discards over `shadow`, in batches, each followed by
/// a read of what was written; then a flush.
fn exercise(
    e: &mut dyn Engine,
    shadow: &mut [u8],
    block: u64,
    cluster: u64,
    seed: u64,
    rounds: usize,
) {
    let size = shadow.len() as u64;
    let mut rng = Rng::new(seed);
    let misalign = if block > 512 { 0 } else { 8 };
    for round in 0..rounds {
        let batch = 1 + rng.below(12) as usize;
        let mut bufs: Vec<Vec<Buf>> = Vec::new();
        let mut iovs: Vec<Vec<libc::iovec>> = Vec::new();
        let mut ops = Vec::new();
        // Writes in one batch do not overlap: their order is the engine's.
        let mut taken: Vec<(u64, u64)> = Vec::new();
        for t in 0..batch {
            let len = block * (1 + rng.below(256 * 512 / block));
            let offset = block * rng.below((size - len) / block + 1);
            if taken
                .iter()
                .any(|&(a, l)| offset < a + l && a < offset + len)
            {
                continue;
            }
            taken.push((offset, len));
            let kind = rng.below(10);
            let op = if kind < 8 {
                let mut data = vec![0u8; len as usize];
                rng.fill(&mut data);
                shadow[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                let mut parts = vec![len as usize];
                if len >= 2 * block && rng.below(2) == 0 {
                    let a = (block * (1 + rng.below(len / block - 1))) as usize;
                    parts = vec![a, len as usize - a];
                }
                let mut at = 0;
                let mut b: Vec<Buf> = Vec::new();
                for p in parts {
                    b.push(Buf::with_data(&data[at..at + p], misalign));
                    at += p;
                }
                let iov: Vec<libc::iovec> = b.iter_mut().map(Buf::iovec).collect();
                let op = Op::Write {
                    offset,
                    iov: iov.as_ptr(),
                    iovcnt: iov.len() as u32,
                    durable: rng.below(8) == 0,
                };
                bufs.push(b);
                iovs.push(iov);
                op
            } else if kind == 8 {
                shadow[offset as usize..(offset + len) as usize].fill(0);
                Op::WriteZeroes {
                    offset,
                    len,
                    unmap: rng.below(2) == 0,
                    durable: false,
                }
            } else {
                // A discard: whole clusters read as zeroes afterwards (unmapped, or the
                // zero flag over a backing file); the rest stays as it was.
                let first = offset.div_ceil(cluster) * cluster;
                let end = (offset + len) / cluster * cluster;
                if end > first {
                    shadow[first as usize..end as usize].fill(0);
                }
                Op::Discard {
                    offset,
                    len,
                    durable: false,
                }
            };
            ops.push((t as u64, op));
        }
        // SAFETY: `bufs` and `iovs` outlive the call.
        let done = unsafe { run(e, &ops) };
        for c in &done {
            assert!(c.result.is_ok(), "round {round}: {:?}", c.result);
        }
        for &(offset, len) in &taken {
            let got = common::read(e, offset, &[len as usize], misalign).unwrap();
            let want = &shadow[offset as usize..(offset + len) as usize];
            if got[..] != want[..] {
                let i = (0..got.len()).find(|&i| got[i] != want[i]).unwrap_or(0);
                panic!(
                    "round {round}: {len} bytes at {offset}: byte {} (guest offset {}) reads {:#x}, written {:#x}",
                    i,
                    offset + i as u64,
                    got[i],
                    want[i]
                );
            }
        }
    }
    // SAFETY: a flush names no buffer.
    unsafe { run1(e, Op::Flush) }.unwrap();
}

fn whole(e: &mut dyn Engine, size: u64, misalign: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size as usize);
    let mut at = 0;
    while at < size {
        let n = (1u64 << 20).min(size - at);
        out.extend(common::read(e, at, &[n as usize], misalign).unwrap());
        at += n;
    }
    out
}

#[test]
fn writes_read_back_and_qemu_finds_them_and_no_error() {
    let _ = env_logger::builder().is_test(true).try_init();
    let dir = scratch();
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "6M"]);
    tool(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x11 0 6M", "base.raw"],
    );
    // The owner's metadata cache: the default, or 2 slices (8 KiB), so that slices are
    // evicted and reloaded between a change and its writeback, and written back from
    // the file rather than the cache.
    const TINY: usize = 8192;
    const DEFAULT: usize = vblk_storage::qcow2::DEFAULT_CACHE_BYTES;
    for (kind, cache, cluster, backed, meta_cache) in [
        (
            EngineKind::IoUring,
            CacheMode::Writeback,
            "65536",
            true,
            DEFAULT,
        ),
        (EngineKind::IoUring, CacheMode::None, "65536", false, TINY),
        (EngineKind::Aio, CacheMode::None, "4096", true, TINY),
        (EngineKind::Threads, CacheMode::Writeback, "512", true, TINY),
        (EngineKind::Sync, CacheMode::Writeback, "2M", false, DEFAULT),
    ] {
        let name = format!("w-{kind}-{cluster}.qcow2");
        let opts = format!("cluster_size={cluster}");
        let mut args = vec!["create", "-f", "qcow2", "-o", &opts];
        if backed {
            args.extend(["-b", "base.raw", "-F", "raw"]);
        }
        args.extend([name.as_str(), "8M"]);
        tool(d, "qemu-img", &args);
        tool(
            d,
            "qemu-io",
            &["-f", "qcow2", "-c", "write -P 0x22 1M 200k", &name],
        );
        let mut shadow = raw_of(d, &name);
        let base = d.join("base.raw");
        let backing: Vec<&Path> = if backed { vec![&base] } else { vec![] };
        let o = OpenOptions {
            qcow2_cache: meta_cache,
            ..options(&backing, cache)
        };
        let b = Arc::new(
            Backend::open(&DiskSpec::File(d.join(&name)), &o)
                .unwrap_or_else(|e| panic!("{name}: {e}")),
        );
        assert!(!b.read_only());
        let block = u64::from(b.logical_block_size());
        let misalign = if block > 512 { 0 } else { 8 };
        eprintln!("{name}: {kind}, cache {cache:?}, metadata cache {meta_cache} bytes");
        {
            let mut e = engine(&b, kind, 32);
            let cluster = b.qcow2().unwrap().header().cluster_size();
            exercise(e.as_mut(), &mut shadow, block, cluster, 3, 30);
            let all = whole(e.as_mut(), 8 << 20, misalign);
            assert!(
                all == shadow,
                "{name}: the whole disk differs from what was written"
            );
        }
        drop(b);
        check_clean(d, &name);
        assert!(
            raw_of(d, &name) == shadow,
            "{name}: QEMU reads something else than was written"
        );
    }
}

#[test]
fn writing_over_compressed_clusters_copies_them() {
    let dir = scratch();
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "a.raw", "4M"]);
    tool(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 0 4M", "a.raw"],
    );
    tool(
        d,
        "qemu-img",
        &["convert", "-c", "-O", "qcow2", "a.raw", "c.qcow2"],
    );
    let mut shadow = fs::read(d.join("a.raw")).unwrap();
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(d.join("c.qcow2")),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    {
        let mut e = engine(&b, EngineKind::IoUring, 16);
        exercise(e.as_mut(), &mut shadow, 512, 65536, 9, 20);
    }
    drop(b);
    check_clean(d, "c.qcow2");
    assert!(raw_of(d, "c.qcow2") == shadow);
}

fn refusal(path: &Path, o: &OpenOptions) -> String {
    match Backend::open(&DiskSpec::File(path.to_path_buf()), o) {
        Ok(_) => panic!("{} was opened for writing", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn images_vblk_cannot_write_safely_are_refused_for_writing() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "r8.qcow2", "refcount_bits=8", "1M");
    let e = refusal(&d.join("r8.qcow2"), &options(&[], CacheMode::Writeback));
    assert!(
        e.contains("8 bits") && e.contains("refcount_bits=16"),
        "{e}"
    );
    tool(d, "qemu-img", &["create", "-f", "qcow2", "s.qcow2", "1M"]);
    tool(d, "qemu-img", &["snapshot", "-c", "snap", "s.qcow2"]);
    let e = refusal(&d.join("s.qcow2"), &options(&[], CacheMode::Writeback));
    assert!(e.contains("internal snapshots"), "{e}");
    // Persistent dirty bitmaps would be made inconsistent (and the backups built on them
    // with them): refused, the image left as it was; read-only is served.
    tool(d, "qemu-img", &["create", "-f", "qcow2", "bm.qcow2", "1M"]);
    tool(d, "qemu-img", &["bitmap", "--add", "bm.qcow2", "b0"]);
    let before = fs::read(d.join("bm.qcow2")).unwrap();
    let e = refusal(&d.join("bm.qcow2"), &options(&[], CacheMode::Writeback));
    assert!(
        e.contains("persistent dirty bitmaps") && e.contains("--read-only"),
        "{e}"
    );
    assert!(
        fs::read(d.join("bm.qcow2")).unwrap() == before,
        "the image changed"
    );
    let mut ro = options(&[], CacheMode::Writeback);
    ro.read_only = true;
    Backend::open(&DiskSpec::File(d.join("bm.qcow2")), &ro).expect("read-only is served");
    // A migration destination refuses them at open too, though it reads no refcount
    // until it takes the image over.
    let mut o = options(&[], CacheMode::Writeback);
    o.image.incoming = true;
    let e = refusal(&d.join("r8.qcow2"), &o);
    assert!(e.contains("8 bits"), "{e}");
    // A refcount table that puts a block over itself: writing refcounts there would
    // destroy it.
    tool(d, "qemu-img", &["create", "-f", "qcow2", "lie.qcow2", "1M"]);
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(d.join("lie.qcow2"))
            .unwrap();
        let mut b8 = [0u8; 8];
        f.read_exact_at(&mut b8, 48).unwrap();
        let reftable = u64::from_be_bytes(b8);
        f.write_all_at(&reftable.to_be_bytes(), reftable).unwrap();
    }
    let e = refusal(&d.join("lie.qcow2"), &options(&[], CacheMode::Writeback));
    assert!(e.contains("over the image's header, L1 table"), "{e}");
    // All of them serve read-only.
    for name in ["r8.qcow2", "s.qcow2", "lie.qcow2"] {
        let mut o = options(&[], CacheMode::Writeback);
        o.read_only = true;
        Backend::open(&DiskSpec::File(d.join(name)), &o).unwrap();
    }
}

/// An image whose file outgrows what its refcount table covers gets a larger table, as
/// QEMU gives it: qemu-img sizes the table for the file it creates, which for 512-byte
/// clusters covers 8 MiB of file (4 GiB with 4 KiB clusters). Writing 48 MiB moves the
/// table (more than once), after which `qemu-img check` finds no error and no leak and
/// `qemu-img convert` reads what was written; before, the writes failed once the file
/// reached the end of what the table covered.
#[test]
fn the_refcount_table_grows_when_the_file_outgrows_it() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "g.qcow2", "cluster_size=512", "64M");
    let path = d.join("g.qcow2");
    let header = |p: &Path| {
        let b = fs::read(p).unwrap();
        (
            u64::from_be_bytes(b[48..56].try_into().unwrap()),
            u32::from_be_bytes(b[56..60].try_into().unwrap()),
        )
    };
    let before = header(&path);
    let backend = Arc::new(
        Backend::open(
            &DiskSpec::File(path.clone()),
            &options(&[], CacheMode::None),
        )
        .unwrap(),
    );
    let mut e = engine(&backend, EngineKind::IoUring, 16);
    let mut shadow = vec![0u8; 64 << 20];
    let mut rng = Rng::new(11);
    for i in 0..48u64 {
        let mut data = vec![0u8; 1 << 20];
        rng.fill(&mut data);
        common::write(&mut *e, i << 20, &data, &[1 << 20], 0, false).unwrap();
        shadow[(i << 20) as usize..][..1 << 20].copy_from_slice(&data);
    }
    let back = common::read(&mut *e, 0, &[64 << 20], 0).unwrap();
    assert!(
        back == shadow,
        "the disk reads other bytes than were written"
    );
    drop(e);
    drop(backend);
    let after = header(&path);
    assert!(
        after.0 != before.0 && after.1 > before.1,
        "the refcount table did not move and grow: {before:?} -> {after:?}"
    );
    check_clean(d, "g.qcow2");
    assert!(raw_of(d, "g.qcow2") == shadow, "qemu-img reads other bytes");
}

/// Zero clusters that keep a cluster of their own (QEMU makes them for a write-zeroes
/// without unmap over an allocated cluster) are written where they are, as QEMU writes
/// them: no cluster is allocated, the file does not grow, and the bytes around a small
/// write read as zeroes although the cluster still holds its old bytes. Before, each
/// first write took a new cluster and gave the old one back.
#[test]
fn zero_clusters_with_a_cluster_of_their_own_are_written_in_place() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "z.qcow2", "cluster_size=65536", "8M");
    for cmd in ["write -P 0xee 0 64k", "write -z 0 64k"] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "z.qcow2"]);
    }
    let map = || -> serde_json::Value {
        let out = Command::new("qemu-img")
            .args(["map", "--output=json", "z.qcow2"])
            .current_dir(d)
            .output()
            .expect("qemu-img (qemu-utils)");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let before = map();
    let host = before[0]["offset"].as_u64();
    assert!(
        host.is_some() && before[0]["zero"] == true,
        "not a zero cluster with a cluster of its own: {before}"
    );
    let path = d.join("z.qcow2");
    let size_before = fs::metadata(&path).unwrap().len();
    let backend = Arc::new(
        Backend::open(
            &DiskSpec::File(path.clone()),
            &options(&[], CacheMode::None),
        )
        .unwrap(),
    );
    let mut e = engine(&backend, EngineKind::IoUring, 8);
    common::write(&mut *e, 4096, &[0x5a; 4096], &[4096], 0, false).unwrap();
    let mut want = vec![0u8; 65536];
    want[4096..8192].fill(0x5a);
    let got = common::read(&mut *e, 0, &[65536], 0).unwrap();
    if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "the cluster reads {:#x} at byte {at}, want {:#x}",
            got[at], want[at]
        );
    }
    let stats = backend.qcow2().unwrap().stats();
    assert_eq!(
        stats.clusters_allocated, 0,
        "a cluster was allocated: {stats:?}"
    );
    drop(e);
    drop(backend);
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        size_before,
        "the file grew"
    );
    check_clean(d, "z.qcow2");
    let mut all = vec![0u8; 8 << 20];
    all[4096..8192].fill(0x5a);
    assert!(raw_of(d, "z.qcow2") == all, "qemu-img reads other bytes");
    let after = map();
    assert_eq!(
        after[0]["offset"].as_u64(),
        host,
        "the cluster moved: {after}"
    );
    assert_eq!(after[0]["zero"], false, "{after}");
}

/// Clusters are counted ahead of their use in batches that grow while writes allocate
/// fast, but never past a sixteenth of a small disk (8 MiB at least): what a crash leaks
/// is what the last batch had not handed out, and a 256 MiB disk once leaked 248 MiB.
/// 500 clusters of 64 KiB written at once to a 32 MiB disk leave the file at most 8 MiB
/// (one batch) past what they and the metadata take (batches of 8, 16 and 32 MiB had
/// counted 24 MiB more).
#[test]
fn a_small_disk_counts_small_batches_ahead() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "small.qcow2", "cluster_size=65536", "32M");
    let path = d.join("small.qcow2");
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(path.clone()),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    let mut e = engine(&b, EngineKind::IoUring, 16);
    let data = vec![0x5au8; 4096];
    for c in 0..500u64 {
        common::write(
            e.as_mut(),
            c * 65536 + 512 * (c % 8),
            &data,
            &[4096],
            0,
            false,
        )
        .unwrap();
    }
    let len = fs::metadata(&path).unwrap().len();
    // The header, the L1 and refcount tables, a refcount block and an L2 table: 5
    // clusters; the data: 500.
    let used = (5 + 500) * 65536;
    assert!(
        len <= used + (8 << 20),
        "the file is {len} bytes for {used} in use: more than one 8 MiB batch counted ahead"
    );
    drop(e);
    drop(b);
    check_clean(d, "small.qcow2");
}

/// Writes `pieces` of 4 KiB at `offsets`, all pushed before one submit; panics unless
/// each succeeds.
fn write_together(e: &mut dyn Engine, offsets: &[u64], fill: u8) {
    let mut bufs: Vec<Buf> = offsets
        .iter()
        .map(|&o| Buf::with_data(&[fill ^ (o >> 12) as u8; 4096], 0))
        .collect();
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let ops: Vec<(u64, Op)> = offsets
        .iter()
        .zip(&iovs)
        .map(|(&offset, iov)| {
            let op = Op::Write {
                offset,
                iov,
                iovcnt: 1,
                durable: false,
            };
            (offset, op)
        })
        .collect();
    // SAFETY: `bufs` and `iovs` outlive the call.
    for c in unsafe { run(e, &ops) } {
        assert!(c.result.is_ok(), "write at {}: {:?}", c.token, c.result);
    }
}

/// A cluster the owner gives a guest cluster may be written in place by the workers only
/// once the mapping is in the file: a write acknowledged before that is lost to a SIGKILL
/// (the data lands in a cluster nothing maps). The owner is held after it gave the cluster
/// for a first write and before it wrote the mapping; a second write to the cluster, sent
/// then, must not complete until the owner goes on (it completed at once in place, when the
/// table said the cluster was the guest's as soon as the owner gave it).
#[test]
fn a_new_cluster_is_written_in_place_only_once_its_mapping_is_in_the_file() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "t.qcow2", "cluster_size=65536", "64M");
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(d.join("t.qcow2")),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    let mut e = engine(&b, EngineKind::IoUring, 16);
    // The slice in the table first: unallocated.
    assert_eq!(common::read(e.as_mut(), 0, &[4096], 0).unwrap(), [0; 4096]);
    let held = b.qcow2().unwrap().hold_mappings();
    let mut bufs = [
        Buf::with_data(&[0x11; 4096], 0),
        Buf::with_data(&[0x22; 4096], 0),
    ];
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let write = |i: usize| Op::Write {
        offset: 4096 * i as u64,
        iov: &iovs[i],
        iovcnt: 1,
        durable: false,
    };
    // SAFETY: `bufs` and `iovs` outlive every write: they are all reaped below.
    unsafe { e.push(0, write(0)) }.unwrap();
    e.submit().unwrap();
    assert!(
        held.wait_until_stopped(Duration::from_secs(20)),
        "the owner never reached the end of the batch of the first write"
    );
    // SAFETY: as above.
    unsafe { e.push(1, write(1)) }.unwrap();
    e.submit().unwrap();
    let mut done = Vec::new();
    let watch = Instant::now() + Duration::from_millis(300);
    while Instant::now() < watch {
        e.reap(&mut |c| done.push((c.token, c.result.map_err(|e| e.kind()))));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        done.is_empty(),
        "completed while the cluster's mapping was not in the file: {done:?}"
    );
    drop(held);
    while done.len() < 2 {
        e.reap(&mut |c| done.push((c.token, c.result.map_err(|e| e.kind()))));
        if done.len() < 2 {
            e.wait().unwrap();
        }
    }
    done.sort();
    assert_eq!(done, [(0, Ok(4096)), (1, Ok(4096))]);
    let back = common::read(e.as_mut(), 0, &[8192], 0).unwrap();
    assert!(back[..4096].iter().all(|&x| x == 0x11) && back[4096..].iter().all(|&x| x == 0x22));
    // Both were written by the engine, not on the owner's thread; and once the mapping is
    // in the file a write goes in place, the owner held or not.
    assert_eq!(b.qcow2().unwrap().stats().owner_writes, 0);
    let held = b.qcow2().unwrap().hold_mappings();
    common::write(e.as_mut(), 8192, &[0x33; 4096], &[4096], 0, false).unwrap();
    drop(held);
    drop(e);
    drop(b);
    check_clean(d, "t.qcow2");
}

/// Sequential writes into a new cluster arrive together: the first is given the cluster,
/// and the ones queued behind it (which the table cannot send in place yet) are written by
/// the engines too, in parallel, not one at a time on the owner's thread (15 of 16 were:
/// sequential 4 KiB writes into a new image ran at a quarter of qemu-storage-daemon's rate).
#[test]
fn writes_queued_behind_a_clusters_first_write_are_not_written_by_the_owner() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "s.qcow2", "cluster_size=65536", "64M");
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(d.join("s.qcow2")),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    let mut e = engine(&b, EngineKind::IoUring, 64);
    let offsets: Vec<u64> = (0..32).map(|i| 4096 * i).collect();
    write_together(e.as_mut(), &offsets, 0x40);
    let st = b.qcow2().unwrap().stats();
    assert_eq!(st.clusters_allocated, 2);
    assert_eq!(
        st.owner_writes, 0,
        "writes done one at a time on the metadata thread"
    );
    for &o in &offsets {
        let got = common::read(e.as_mut(), o, &[4096], 0).unwrap();
        assert!(got.iter().all(|&x| x == 0x40 ^ (o >> 12) as u8), "at {o}");
    }
    drop(e);
    drop(b);
    check_clean(d, "s.qcow2");
}

/// Clusters are counted a batch ahead: the next batch's refcounts and its `fdatasync` go
/// out while the current batch still lasts, so allocating writes do not stop for that
/// sync (tens to hundreds of milliseconds under writes) when a batch runs out. After 70
/// of a first batch's 128 clusters (8 MiB of 64 KiB clusters) are given, the file already
/// reaches past a second batch; at close both batches' unused clusters are given back.
#[test]
fn the_next_batch_of_clusters_is_counted_before_this_one_runs_out() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "ahead.qcow2", "cluster_size=65536", "64G");
    let path = d.join("ahead.qcow2");
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(path.clone()),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    let mut e = engine(&b, EngineKind::IoUring, 16);
    for c in 0..70u64 {
        common::write(e.as_mut(), c << 16, &[c as u8 + 1; 4096], &[4096], 0, false).unwrap();
    }
    let len = fs::metadata(&path).unwrap().len();
    assert!(
        len > 16 << 20,
        "the file is {len} bytes: the next batch was not counted while this one lasted"
    );
    for c in 0..70u64 {
        let got = common::read(e.as_mut(), c << 16, &[4096], 0).unwrap();
        assert!(got.iter().all(|&x| x == c as u8 + 1), "cluster {c}");
    }
    drop(e);
    drop(b);
    check_clean(d, "ahead.qcow2");
}

/// Guest cluster `gc`'s host cluster index, from `qemu-img map` on a live image.
fn host_cluster(d: &Path, image: &str, gc: u64) -> u64 {
    let out = Command::new("qemu-img")
        .args(["map", "-U", "--output=json", image])
        .current_dir(d)
        .output()
        .expect("qemu-img (qemu-utils)");
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let at = gc << 16;
    map.as_array()
        .unwrap()
        .iter()
        .find(|r| {
            let (s, l) = (r["start"].as_u64().unwrap(), r["length"].as_u64().unwrap());
            s <= at && at < s + l && r["data"] == true
        })
        .map(|r| (r["offset"].as_u64().unwrap() + at - r["start"].as_u64().unwrap()) >> 16)
        .unwrap_or_else(|| panic!("guest cluster {gc} is not mapped: {map}"))
}

/// The periodic writeback (a second after a change, with no FLUSH) makes the changed
/// mappings durable with an `fdatasync` that goes out on an io_uring while the owner goes
/// on serving; what it made durable is taken up when it completes: the new clusters become
/// owned (a write-through write then goes in place, not to the owner), and a discarded
/// cluster's refcount is dropped (`qemu-img check` on the live image lists the batch's
/// unused clusters as leaked, and not that one).
#[test]
fn the_periodic_writeback_takes_up_its_sync_when_it_completes() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "wb.qcow2", "cluster_size=65536", "64M");
    let b = Arc::new(
        Backend::open(
            &DiskSpec::File(d.join("wb.qcow2")),
            &options(&[], CacheMode::Writeback),
        )
        .unwrap(),
    );
    let img = b.qcow2().unwrap();
    let mut e = engine(&b, EngineKind::IoUring, 16);
    for c in 0..3u64 {
        common::write(e.as_mut(), c << 16, &[0x70; 4096], &[4096], 0, false).unwrap();
    }
    let dropped = host_cluster(d, "wb.qcow2", 2);
    let discard = Op::Discard {
        offset: 2 << 16,
        len: 1 << 16,
        durable: false,
    };
    // SAFETY: a discard names no buffer.
    unsafe { run1(e.as_mut(), discard) }.unwrap();
    let before = img.stats().writebacks;
    let deadline = Instant::now() + Duration::from_secs(20);
    while img.stats().writebacks == before {
        assert!(
            Instant::now() < deadline,
            "no periodic writeback within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    common::write(e.as_mut(), 0, &[0x71; 4096], &[4096], 0, true).unwrap();
    assert_eq!(
        img.stats().owner_writes,
        0,
        "a write-through write to a cluster made durable went to the owner"
    );
    let out = Command::new("qemu-img")
        .args(["check", "-U", "wb.qcow2"])
        .current_dir(d)
        .output()
        .expect("qemu-img (qemu-utils)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("ERROR") && text.contains("Leaked cluster"),
        "qemu-img check -U: {text}"
    );
    assert!(
        !text.contains(&format!("Leaked cluster {dropped} ")),
        "the discarded cluster {dropped} is still counted: {text}"
    );
    assert_eq!(
        common::read(e.as_mut(), 0, &[4096], 0).unwrap(),
        [0x71; 4096]
    );
    drop(e);
    drop(b);
    check_clean(d, "wb.qcow2");
}
