//! qcow2 images served through the engines, against QEMU: a chain of three (a qcow2 of
//! 64 KiB clusters over a qcow2 of 512-byte clusters over a smaller raw file), written by
//! qemu-io with data, zeroes and discards, and a compressed image, read on every engine
//! in batches of random requests (crossing clusters, split into misaligned iovecs), give
//! the bytes `qemu-img convert -O raw` gives. And what is refused: a backing file the
//! command line does not name, a different one than the header names,
//! a loop, metadata that points at the header.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vblk_storage::{Backend, CacheMode, DiskSpec, EngineKind, Error, Format, Op, OpenOptions};

mod common;
use common::{engine, run, scratch, tool, Buf, Rng};

fn options(backing: &[&Path], cache: CacheMode) -> OpenOptions {
    common::qcow2_options(backing, cache, true)
}

fn open(path: &Path, o: &OpenOptions) -> Result<Backend, Error> {
    Backend::open(&DiskSpec::File(path.to_path_buf()), o)
}

/// The chain: top.qcow2 (64 KiB clusters, 8 MiB) over mid.qcow2 (512-byte clusters,
/// 8 MiB) over base.raw (6 MiB: the last 2 MiB read as zeroes). Returns the directory,
/// the three paths and the bytes QEMU reads from the top.
fn chain() -> (tempfile::TempDir, [PathBuf; 3], Vec<u8>) {
    let dir = scratch();
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "6M"]);
    tool(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x11 0 6M", "base.raw"],
    );
    let create = |name: &str, backing: &str, fmt: &str, cluster: &str| {
        let opts = format!("cluster_size={cluster}");
        tool(
            d,
            "qemu-img",
            &[
                "create", "-f", "qcow2", "-o", &opts, "-b", backing, "-F", fmt, name, "8M",
            ],
        );
    };
    create("mid.qcow2", "base.raw", "raw", "512");
    for cmd in [
        "write -P 0x22 100k 300k",
        "write -z 1M 64k",
        "write -P 0x23 5M 1M",
        "discard 5200k 16k",
    ] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "mid.qcow2"]);
    }
    create("top.qcow2", "mid.qcow2", "qcow2", "65536");
    for cmd in [
        "write -P 0x33 0 64k",
        "write -P 0x34 200k 130k",
        "write -z 2M 128k",
        "write -P 0x35 7M 1M",
        "write -P 0x36 4100k 8k",
    ] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "top.qcow2"]);
    }
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "top.qcow2", "want.raw"],
    );
    let want = fs::read(d.join("want.raw")).unwrap();
    let paths = ["top.qcow2", "mid.qcow2", "base.raw"].map(|n| d.join(n));
    (dir, paths, want)
}

/// Reads the whole disk in batches of `batch` random requests (up to 256 KiB, split
/// into up to 4 iovecs misaligned by 8 bytes when buffered) and compares with `want`;
/// then the whole disk in 1 MiB reads.
fn compare(backend: &Arc<Backend>, kind: EngineKind, want: &[u8], seed: u64) {
    let size = backend.size();
    assert_eq!(size, want.len() as u64);
    let mut e = engine(backend, kind, 32);
    let mut rng = Rng::new(seed);
    let misalign = if backend.cache() == CacheMode::None {
        0
    } else {
        8
    };
    for round in 0..40 {
        let batch = 1 + rng.below(16) as usize;
        let mut bufs: Vec<Vec<Buf>> = Vec::new();
        let mut iovs: Vec<Vec<libc::iovec>> = Vec::new();
        let mut ops = Vec::new();
        for t in 0..batch {
            let len = 512 * (1 + rng.below(512));
            let offset = 512 * rng.below((size - len) / 512 + 1);
            let mut parts = vec![len as usize];
            if rng.below(2) == 0 && len >= 2048 {
                let a = 512 * (1 + rng.below(len / 1024)) as usize;
                parts = vec![a, len as usize - a];
            }
            let mut b: Vec<Buf> = parts
                .iter()
                .map(|&l| {
                    let mut b = Buf::new(l, misalign);
                    b.as_mut_slice().fill(0xa5);
                    b
                })
                .collect();
            let iov: Vec<libc::iovec> = b.iter_mut().map(Buf::iovec).collect();
            ops.push((
                t as u64,
                Op::Read {
                    offset,
                    iov: iov.as_ptr(),
                    iovcnt: iov.len() as u32,
                },
            ));
            bufs.push(b);
            iovs.push(iov);
        }
        // SAFETY: `bufs` and `iovs` outlive the call.
        let done = unsafe { run(e.as_mut(), &ops) };
        for (c, ((_, op), b)) in done.iter().zip(ops.iter().zip(&bufs)) {
            let Op::Read { offset, .. } = *op else {
                unreachable!()
            };
            let got: Vec<u8> = b.iter().flat_map(|b| b.as_slice().to_vec()).collect();
            assert_eq!(
                c.result.as_ref().ok(),
                Some(&(got.len() as u64)),
                "{kind}: round {round}: read at {offset}: {:?}",
                c.result
            );
            let at = offset as usize;
            if got[..] != want[at..at + got.len()] {
                let first = (0..got.len())
                    .find(|&i| got[i] != want[at + i])
                    .unwrap_or(0);
                panic!(
                    "{kind}: round {round}: {} bytes at {offset} differ from QEMU's from byte {} (guest offset {}): {:#x} for {:#x}",
                    got.len(),
                    first,
                    at + first,
                    got[first],
                    want[at + first]
                );
            }
        }
    }
    let mut at = 0;
    while at < size {
        let n = (1 << 20).min(size - at);
        let got = common::read(e.as_mut(), at, &[n as usize], misalign).unwrap();
        assert!(
            got[..] == want[at as usize..(at + n) as usize],
            "{kind}: 1 MiB at {at} differs from QEMU's"
        );
        at += n;
    }
}

#[test]
fn a_backing_chain_reads_as_qemu_reads_it_on_every_engine() {
    let (_dir, [top, mid, base], want) = chain();
    for (kind, cache) in [
        (EngineKind::IoUring, CacheMode::Writeback),
        (EngineKind::IoUring, CacheMode::None),
        (EngineKind::Aio, CacheMode::None),
        (EngineKind::Threads, CacheMode::Writeback),
        (EngineKind::Sync, CacheMode::Writeback),
    ] {
        let b = Arc::new(open(&top, &options(&[&mid, &base], cache)).unwrap());
        assert!(b.read_only(), "served read-only");
        let img = b.qcow2().expect("a qcow2 image");
        assert_eq!(img.header().cluster_size(), 65536);
        let (m, f) = img.backing().unwrap();
        assert_eq!((m.path(), f), (Some(mid.as_path()), Format::Qcow2));
        compare(&b, kind, &want, 7);
    }
}

#[test]
fn compressed_clusters_read_as_qemu_reads_them() {
    let dir = scratch();
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "raw", "a.raw", "4M"]);
    for cmd in [
        "write -P 0x5a 0 1M",
        "write -P 0x5b 1536k 100k",
        "write -P 0x5c 3M 512",
    ] {
        tool(d, "qemu-io", &["-f", "raw", "-c", cmd, "a.raw"]);
    }
    tool(
        d,
        "qemu-img",
        &["convert", "-c", "-O", "qcow2", "a.raw", "c.qcow2"],
    );
    let want = fs::read(d.join("a.raw")).unwrap();
    let b = Arc::new(open(&d.join("c.qcow2"), &options(&[], CacheMode::Writeback)).unwrap());
    compare(&b, EngineKind::IoUring, &want, 11);
    let b = Arc::new(open(&d.join("c.qcow2"), &options(&[], CacheMode::None)).unwrap());
    compare(&b, EngineKind::IoUring, &want, 12);
}

fn refusal(path: &Path, o: &OpenOptions) -> String {
    match open(path, o) {
        Ok(_) => panic!("{} was opened", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn what_the_command_line_does_not_name_is_refused() {
    let (dir, [top, mid, base], _) = chain();
    let d = dir.path();
    // No --backing: the header's name is not opened on its own.
    let e = refusal(&top, &options(&[], CacheMode::Writeback));
    assert!(
        e.contains("\"mid.qcow2\"") && e.contains("add --backing"),
        "{e}"
    );
    // The chain cut short: mid names base.raw.
    let e = refusal(&top, &options(&[&mid], CacheMode::Writeback));
    assert!(e.contains("mid.qcow2") && e.contains("\"base.raw\""), "{e}");
    // One too many.
    let e = refusal(&top, &options(&[&mid, &base, &base], CacheMode::Writeback));
    assert!(
        e.contains("base.raw")
            && e.contains("the chain ends here, at a raw file")
            && e.contains("one too many"),
        "{e}"
    );
    // A different file than the header names.
    let other = d.join("other.raw");
    fs::copy(&base, &other).unwrap();
    let e = refusal(&top, &options(&[&other], CacheMode::Writeback));
    assert!(e.contains("which is not") && e.contains("rebase"), "{e}");
    // A header naming /etc/shadow: refused, whatever is given.
    tool(
        d,
        "qemu-img",
        &["create", "-f", "qcow2", "evil.qcow2", "1M"],
    );
    tool(
        d,
        "qemu-img",
        &[
            "rebase",
            "-u",
            "-b",
            "/etc/shadow",
            "-F",
            "raw",
            "evil.qcow2",
        ],
    );
    let e = refusal(&d.join("evil.qcow2"), &options(&[], CacheMode::Writeback));
    assert!(
        e.contains("\"/etc/shadow\"") && e.contains("add --backing"),
        "{e}"
    );
    let e = refusal(
        &d.join("evil.qcow2"),
        &options(&[&base], CacheMode::Writeback),
    );
    assert!(e.contains("which is not"), "{e}");
    // A loop: an image whose backing file is itself.
    tool(
        d,
        "qemu-img",
        &["create", "-f", "qcow2", "loop.qcow2", "1M"],
    );
    tool(
        d,
        "qemu-img",
        &[
            "rebase",
            "-u",
            "-b",
            "loop.qcow2",
            "-F",
            "qcow2",
            "loop.qcow2",
        ],
    );
    let lp = d.join("loop.qcow2");
    let e = refusal(&lp, &options(&[&lp, &lp], CacheMode::Writeback));
    assert!(e.contains("loop"), "{e}");
    // Writable, the image's own write lock would refuse its second opening as a
    // backing file first, naming this process as the other user: the loop is named.
    let writable = common::qcow2_options(&[&lp], CacheMode::Writeback, false);
    let e = refusal(&lp, &writable);
    assert!(e.contains("loop") && !e.contains("holds"), "{e}");
    // A format the header does not record must be named: evil.qcow2 names base.raw,
    // and its backing format extension is made one QEMU ignores.
    tool(
        d,
        "qemu-img",
        &["rebase", "-u", "-b", "base.raw", "-F", "raw", "evil.qcow2"],
    );
    let evil = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.join("evil.qcow2"))
        .unwrap();
    let mut head = vec![0u8; 4096];
    evil.read_exact_at(&mut head, 0).unwrap();
    let at = head
        .windows(4)
        .position(|w| w == 0xe279_2acau32.to_be_bytes())
        .expect("a backing format extension");
    evil.write_all_at(&0x1111_1111u32.to_be_bytes(), at as u64)
        .unwrap();
    drop(evil);
    let e = refusal(
        &d.join("evil.qcow2"),
        &options(&[&base], CacheMode::Writeback),
    );
    assert!(e.contains("format=raw"), "{e}");
    let mut o = options(&[], CacheMode::Writeback);
    o.backing = vec!["base.raw,format=raw".parse().unwrap()];
    o.backing[0].path = base.clone();
    assert!(open(&d.join("evil.qcow2"), &o).is_ok());
}

#[test]
fn metadata_pointing_at_metadata_fails_that_read_with_eio_only() {
    let dir = scratch();
    let d = dir.path();
    tool(d, "qemu-img", &["create", "-f", "qcow2", "x.qcow2", "64M"]);
    for cmd in ["write -P 0x41 0 64k", "write -P 0x42 32M 64k"] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "x.qcow2"]);
    }
    // L1 entry 0's table, entry 0: point it at the L1 table's cluster. Guest cluster
    // 512 (32 MiB) is in another L2 table (8192 entries per table; 512 per slice).
    let path = d.join("x.qcow2");
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut b8 = [0u8; 8];
    f.read_exact_at(&mut b8, 40).unwrap();
    let l1 = u64::from_be_bytes(b8);
    f.read_exact_at(&mut b8, l1).unwrap();
    let l2 = u64::from_be_bytes(b8) & 0x00ff_ffff_ffff_fe00;
    f.write_all_at(&((1u64 << 63) | l1).to_be_bytes(), l2)
        .unwrap();
    drop(f);
    let b = Arc::new(open(&path, &options(&[], CacheMode::Writeback)).unwrap());
    let mut e = engine(&b, EngineKind::IoUring, 4);
    let err = common::read(e.as_mut(), 0, &[4096], 0)
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let ok = common::read(e.as_mut(), 32 << 20, &[4096], 0).unwrap();
    assert!(ok.iter().all(|&x| x == 0x42));
    drop(e);
    let _ = File::open(&path).unwrap();
}

/// A request spanning more L2 slices than the translation table holds at once (two of
/// them share a slot) completes, in parts, with the bytes QEMU reads: a 512-byte-cluster
/// image of 160 MiB has 5,120 slices of 32 KiB of guest space and a table of 2,048
/// slots, and one read and one write of 72 MiB each span 2,304 of them (its clusters
/// are allocated up front: the write goes in place). A guest may send a request that
/// large; before, the engine spun on it for ever.
#[test]
fn a_request_larger_than_the_translation_table_completes_in_parts() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(
        d,
        "big.qcow2",
        "cluster_size=512,preallocation=falloc",
        "160M",
    );
    for cmd in [
        "write -P 0x41 0 1M",
        "write -P 0x42 70M 2M",
        "write -z 30M 1M",
    ] {
        tool(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "big.qcow2"]);
    }
    let mut o = common::qcow2_options(&[], CacheMode::Writeback, false);
    o.qcow2_cache = 64 << 10;
    let path = d.join("big.qcow2");
    let len = 72usize << 20;
    let data: Vec<u8> = (0..len).map(|i| (i / 4096) as u8).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let written = data.clone();
    // On a thread, with a deadline: the bug this guards against spins for ever.
    std::thread::spawn(move || {
        let b = Arc::new(open(&path, &o).unwrap());
        let mut e = engine(&b, EngineKind::IoUring, 8);
        let first = common::read(&mut *e, 0, &[len], 0).unwrap();
        common::write(&mut *e, 40 << 20, &written, &[len], 0, false).unwrap();
        let second = common::read(&mut *e, 40 << 20, &[len], 0).unwrap();
        // Closed (its image locks released) before the answer: qemu-img comes next.
        drop(e);
        drop(b);
        let _ = tx.send((first, second));
    });
    let (got, back) = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the 72 MiB requests did not complete within 120 s (or failed: see above)");
    let mut want = vec![0u8; len];
    want[..1 << 20].fill(0x41);
    want[70 << 20..].fill(0x42);
    assert!(
        got == want,
        "the 72 MiB read differs from what qemu-io wrote"
    );
    assert!(back == data, "the 72 MiB write read back differently");
    tool(d, "qemu-img", &["check", "big.qcow2"]);
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "big.qcow2", "out.raw"],
    );
    let f = File::open(d.join("out.raw")).unwrap();
    let mut back = vec![0u8; len];
    f.read_exact_at(&mut back, 40 << 20).unwrap();
    assert!(
        back == data,
        "qemu-img reads other bytes where the 72 MiB went"
    );
}
