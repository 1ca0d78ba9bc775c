//! The four file engines (io_uring, aio, threads, sync) against real files, in page-cache
//! and O_DIRECT modes. Every test runs once per engine (`uring::*`, `aio::*`,
//! `threads::*`, `sync::*`). The aio engine exists only with O_DIRECT, so where a test
//! uses the page cache the aio run uses O_DIRECT instead ([`cache_for`]).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use vblk_storage::{BackendKind, CacheMode, EngineKind, Full, Op, MAX_DEPTH, POOL_THREAD_PREFIX};

const MIB: usize = 1 << 20;

/// The cache modes a test that covers both runs `kind` with.
fn caches(kind: EngineKind) -> &'static [CacheMode] {
    match kind {
        EngineKind::Aio => &[CacheMode::None],
        _ => &[CacheMode::Writeback, CacheMode::None],
    }
}

/// Random writes and reads with several iovecs of random lengths, checked against
/// a model of the file and, at the end, against the file itself.
fn write_read_random(kind: EngineKind) {
    let dir = scratch();
    let size = 4 * MIB;
    let path = make_file(dir.path(), "disk.img", size, 1);
    let mut model = std::fs::read(&path).unwrap();
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    assert_eq!(b.kind(), BackendKind::File);
    assert_eq!(b.size(), size as u64);
    let lbs = b.logical_block_size() as usize;
    let mut e = engine(&b, kind, 16);
    let mut rng = Rng::new(42);
    for round in 0..150 {
        let sectors = 1 + rng.below(64) as usize;
        let len = sectors * lbs;
        let offset = rng.below(((size - len) / lbs) as u64 + 1) * lbs as u64;
        let parts = 1 + rng.below(6) as usize;
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        let lens = split(&mut rng, len, parts);
        let durable = round % 7 == 0;
        assert_eq!(
            write(&mut *e, offset, &data, &lens, 0, durable).unwrap(),
            len as u64
        );
        model[offset as usize..offset as usize + len].copy_from_slice(&data);

        let rlen = (1 + rng.below(64) as usize) * lbs;
        let roff = rng.below(((size - rlen) / lbs) as u64 + 1) * lbs as u64;
        let rparts = 1 + rng.below(6) as usize;
        let rlens = split(&mut rng, rlen, rparts);
        let got = read(&mut *e, roff, &rlens, 0).unwrap();
        assert!(
            got == model[roff as usize..roff as usize + rlen],
            "round {round}: read {roff}+{rlen} differs"
        );
    }
    drop(e);
    assert!(
        std::fs::read(&path).unwrap() == model,
        "file differs from the model"
    );
}

/// Many operations in flight at once: a batch of `depth` writes to disjoint
/// places, then `depth` reads; `push` beyond depth returns Full. 40 is more than one
/// `io_submit` batch of the aio engine (32).
fn depth_and_full(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", 2 * MIB, 2);
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    let depth = 40;
    let mut e = engine(&b, kind, depth);
    let mut rng = Rng::new(3);
    let blk = 8192;
    let mut datas: Vec<Buf> = (0..depth)
        .map(|_| {
            let mut d = vec![0u8; blk];
            rng.fill(&mut d);
            Buf::with_data(&d, 0)
        })
        .collect();
    let iovs: Vec<libc::iovec> = datas.iter_mut().map(Buf::iovec).collect();
    for (i, iov) in iovs.iter().enumerate() {
        let op = Op::Write {
            offset: (i * blk * 2) as u64,
            iov,
            iovcnt: 1,
            durable: false,
        };
        // SAFETY: `datas` and `iovs` outlive the engine's use (reaped below).
        unsafe { e.push(i as u64, op) }.unwrap();
    }
    assert_eq!(e.in_flight(), depth as usize);
    // SAFETY: the op is refused, so nothing is lent.
    assert!(matches!(unsafe { e.push(99, Op::Flush) }, Err(Full)));
    e.submit().unwrap();
    // SAFETY: as above.
    assert!(matches!(unsafe { e.push(99, Op::Flush) }, Err(Full)));
    let mut seen = vec![false; depth as usize];
    while e.in_flight() > 0 {
        let n = e.reap(&mut |c| {
            assert_eq!(c.result.unwrap(), blk as u64);
            assert!(
                !std::mem::replace(&mut seen[c.token as usize], true),
                "token twice"
            );
        });
        if n == 0 {
            e.wait().unwrap();
        }
    }
    assert!(seen.iter().all(|&s| s));
    // Now read them all back in one batch.
    let mut outs: Vec<Buf> = (0..depth).map(|_| Buf::new(blk, 0)).collect();
    let oiov: Vec<libc::iovec> = outs.iter_mut().map(Buf::iovec).collect();
    let ops: Vec<(u64, Op)> = oiov
        .iter()
        .enumerate()
        .map(|(i, iov)| {
            (
                i as u64,
                Op::Read {
                    offset: (i * blk * 2) as u64,
                    iov,
                    iovcnt: 1,
                },
            )
        })
        .collect();
    // SAFETY: `outs` and `oiov` outlive the call.
    let done = unsafe { run(&mut *e, &ops) };
    for (i, c) in done.iter().enumerate() {
        assert_eq!(c.result.as_ref().unwrap(), &(blk as u64));
        assert!(outs[i].as_slice() == datas[i].as_slice(), "op {i}");
    }
    // wait with nothing in flight returns at once.
    e.wait().unwrap();
}

/// O_DIRECT with aligned buffers, then with buffers 1 byte off alignment and
/// lengths that are multiples of 512 but not 4096 (the bounce path).
fn direct_io(kind: EngineKind) {
    let dir = scratch();
    let size = 2 * MIB;
    let path = make_file(dir.path(), "direct.img", size, 4);
    let mut model = std::fs::read(&path).unwrap();
    let b = open(&path, CacheMode::None, false);
    assert_eq!(b.cache(), CacheMode::None);
    assert!(
        has_o_direct(b.raw_fd().unwrap()),
        "the fd must have O_DIRECT"
    );
    let lbs = b.logical_block_size();
    assert!(lbs.is_power_of_two() && lbs >= 512, "{lbs}");
    eprintln!(
        "O_DIRECT logical block size on {}: {lbs}",
        dir.path().display()
    );
    let lbs = lbs as usize;
    // The kernel itself refuses a buffer 1 byte off alignment on this fd (one that
    // crosses a page; statx's alignment is what the kernel promises), so the
    // misaligned rounds below can only succeed through the bounce path.
    let probe_len = 4096.max(lbs);
    let mut probe = Buf::new(probe_len, 1);
    let fd = b.raw_fd().unwrap();
    // SAFETY: reads at most `probe_len` bytes into a live buffer of that length.
    let rc = unsafe { libc::pread(fd, probe.as_mut_slice().as_mut_ptr().cast(), probe_len, 0) };
    let refused = rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL);
    assert!(
        refused,
        "O_DIRECT should refuse a misaligned buffer (rc {rc})"
    );
    let mut e = engine(&b, kind, 8);
    let mut rng = Rng::new(5);
    for round in 0..40 {
        let misalign = if round % 2 == 0 {
            0
        } else {
            1 + rng.below(7) as usize
        };
        // Lengths: multiples of the block size, many of them not of 4096.
        let blocks = 1 + rng.below(24) as usize;
        let len = blocks * lbs;
        let offset = (rng.below(((size - len) / lbs) as u64 + 1) as usize * lbs) as u64;
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        let lens: Vec<usize> = split(&mut rng, blocks, 3).iter().map(|n| n * lbs).collect();
        let durable = round % 5 == 0;
        assert_eq!(
            write(&mut *e, offset, &data, &lens, misalign, durable).unwrap(),
            len as u64,
            "round {round}"
        );
        model[offset as usize..offset as usize + len].copy_from_slice(&data);
        let rmis = if round % 3 == 0 { 0 } else { 1 };
        let got = read(&mut *e, offset, &lens, rmis).unwrap();
        assert!(got == data, "round {round}: misalign {misalign}/{rmis}");
    }
    // A 512-multiple that is not a 4096-multiple, off by one, in odd pieces.
    if lbs == 512 {
        let mut data = vec![0u8; 3 * 512];
        rng.fill(&mut data);
        write(&mut *e, 4096 + 512, &data, &[1000, 536], 1, false).unwrap();
        model[4608..4608 + 1536].copy_from_slice(&data);
        assert!(read(&mut *e, 4608, &[700, 836], 3).unwrap() == data);
    }
    drop(e);
    assert!(
        std::fs::read(&path).unwrap() == model,
        "file differs from the model"
    );
}

/// Flush and durable writes succeed and the data is in the file.
fn flush_and_durable(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 6);
    for &cache in caches(kind) {
        let b = open(&path, cache, false);
        let mut e = engine(&b, kind, 4);
        let data = vec![0x5au8; 8192];
        assert_eq!(
            write(&mut *e, 65536, &data, &[4096, 4096], 0, true).unwrap(),
            8192
        );
        // SAFETY: Flush lends no buffer.
        assert_eq!(unsafe { run1(&mut *e, Op::Flush) }.unwrap(), 0);
        let file = std::fs::read(&path).unwrap();
        assert!(file[65536..65536 + 8192] == data[..], "{cache:?}");
    }
}

/// Discard reads back as zeroes on a file; the size stays.
fn discard(kind: EngineKind) {
    let dir = scratch();
    let size = 2 * MIB;
    let path = make_file(dir.path(), "disk.img", size, 7);
    for &cache in caches(kind) {
        let b = open(&path, cache, false);
        assert!(b.supports_discard());
        let mut e = engine(&b, kind, 4);
        let (off, len) = (256 * 1024u64, 512 * 1024u64);
        let before = st_blocks(&path);
        // SAFETY: Discard lends no buffer.
        let done = unsafe {
            run1(
                &mut *e,
                Op::Discard {
                    offset: off,
                    len,
                    durable: false,
                },
            )
        };
        assert_eq!(done.unwrap(), 0);
        let got = read(&mut *e, off, &[len as usize], 0).unwrap();
        assert!(
            got.iter().all(|&x| x == 0),
            "{cache:?}: discarded range reads zeroes"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size as u64);
        assert!(
            st_blocks(&path) < before || before == 0,
            "{cache:?}: hole punched"
        );
        // Restore data for the next round.
        let data = vec![1u8; len as usize];
        write(&mut *e, off, &data, &[len as usize], 0, false).unwrap();
    }
}

/// Write-zeroes with unmap deallocates; without unmap the blocks stay allocated.
fn write_zeroes(kind: EngineKind) {
    let dir = scratch();
    let size = 2 * MIB;
    let path = make_file(dir.path(), "disk.img", size, 8);
    for &cache in caches(kind) {
        for unmap in [false, true] {
            let b = open(&path, cache, false);
            assert!(b.supports_write_zeroes());
            let mut e = engine(&b, kind, 4);
            let (off, len) = (512 * 1024u64, 1024 * 1024u64);
            let data = vec![0x77u8; len as usize];
            write(&mut *e, off, &data, &[len as usize], 0, true).unwrap();
            // SAFETY: Flush lends no buffer.
            unsafe { run1(&mut *e, Op::Flush) }.unwrap();
            let before = st_blocks(&path);
            let op = Op::WriteZeroes {
                offset: off,
                len,
                unmap,
                durable: false,
            };
            // SAFETY: WriteZeroes lends no buffer.
            assert_eq!(unsafe { run1(&mut *e, op) }.unwrap(), 0);
            let got = read(&mut *e, off, &[len as usize / 2, len as usize / 2], 0).unwrap();
            assert!(
                got.iter().all(|&x| x == 0),
                "{cache:?} unmap={unmap}: zeroes"
            );
            let edge = read(&mut *e, off - 512, &[512], 0).unwrap();
            assert!(
                edge.iter().any(|&x| x != 0),
                "the range before is untouched"
            );
            assert_eq!(std::fs::metadata(&path).unwrap().len(), size as u64);
            let after = st_blocks(&path);
            if unmap {
                assert!(
                    after + len / 512 <= before,
                    "{cache:?}: unmap frees blocks: {before} -> {after}"
                );
            } else {
                assert!(
                    after >= before,
                    "{cache:?}: !unmap keeps blocks: {before} -> {after}"
                );
            }
        }
    }
}

/// A read-only file opens read-only; writes fail with an error completion.
fn read_only(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "ro.img", MIB, 9);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    let original = std::fs::read(&path).unwrap();
    for &cache in caches(kind) {
        let b = open(&path, cache, true);
        assert!(b.read_only());
        assert!(!b.supports_discard() && !b.supports_write_zeroes());
        let mut e = engine(&b, kind, 4);
        assert!(read(&mut *e, 0, &[4096], 0).unwrap() == original[..4096]);
        let err = write(&mut *e, 0, &[0u8; 4096], &[4096], 0, false).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{cache:?}: {err}");
        // SAFETY: these ops lend no buffer.
        let zero = unsafe {
            run1(
                &mut *e,
                Op::WriteZeroes {
                    offset: 0,
                    len: 4096,
                    unmap: false,
                    durable: false,
                },
            )
        };
        assert!(zero.is_err(), "{cache:?}: write-zeroes on a read-only file");
    }
    assert!(std::fs::read(&path).unwrap() == original);
}

/// Bad operations get an errno, never a panic; empty ones complete with 0.
fn bad_ops(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 10);
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    let mut e = engine(&b, kind, 8);
    let mut buf = Buf::new(4096, 0);
    let iov = [buf.iovec()];
    let past = Op::Read {
        offset: MIB as u64 - 512,
        iov: iov.as_ptr(),
        iovcnt: 1,
    };
    let null = Op::Write {
        offset: 0,
        iov: std::ptr::null(),
        iovcnt: 2,
        durable: false,
    };
    let empty = Op::Read {
        offset: 0,
        iov: std::ptr::null(),
        iovcnt: 0,
    };
    let discard_past = Op::Discard {
        offset: MIB as u64,
        len: 512,
        durable: false,
    };
    let zero_wrap = Op::WriteZeroes {
        offset: u64::MAX - 511,
        len: 1024,
        unmap: true,
        durable: false,
    };
    // SAFETY: `buf` and `iov` outlive the call; the other ops lend nothing.
    let done = unsafe {
        run(
            &mut *e,
            &[
                (0, past),
                (1, null),
                (2, empty),
                (3, discard_past),
                (4, zero_wrap),
            ],
        )
    };
    for (i, c) in done.iter().enumerate() {
        match i {
            2 => assert_eq!(c.result.as_ref().unwrap(), &0),
            _ => assert_eq!(
                c.result.as_ref().unwrap_err().raw_os_error(),
                Some(libc::EINVAL),
                "op {i}"
            ),
        }
    }
}

/// A file that shrinks under us: the read past its new end is short, and the rest
/// reads as zeroes instead of being reported as a short success.
fn short_read_at_eof(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "shrink.img", MIB, 11);
    let original = std::fs::read(&path).unwrap();
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    let mut e = engine(&b, kind, 4);
    let cut = MIB / 2 + 4096;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut as u64)
        .unwrap();
    let start = MIB / 2;
    let got = read(&mut *e, start as u64, &[3000, 20000, 42536], 0).unwrap();
    assert!(got[..4096] == original[start..cut]);
    assert!(got[4096..].iter().all(|&x| x == 0));
}

/// Dropping an engine with operations in flight waits for them.
fn drop_in_flight(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", 4 * MIB, 12);
    let b = open(&path, CacheMode::None, false);
    let mut bufs: Vec<Buf> = (0..16).map(|_| Buf::new(65536, 0)).collect();
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let mut e = engine(&b, kind, 16);
    for (i, iov) in iovs.iter().enumerate() {
        let op = Op::Read {
            offset: (i * 65536) as u64,
            iov,
            iovcnt: 1,
        };
        // SAFETY: `bufs` and `iovs` outlive the engine, which is dropped first.
        unsafe { e.push(i as u64, op) }.unwrap();
    }
    e.submit().unwrap();
    drop(e);
    drop(bufs);
}

/// The notify fd: io_uring's, aio's and threads' becomes readable when completions
/// wait, and is drained by reap; sync has none.
fn notify(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 13);
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    let mut e = engine(&b, kind, 4);
    let Some(fd) = e.notify_fd() else {
        assert_eq!(kind, EngineKind::Sync);
        return;
    };
    let poll = |timeout| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, timeout) }
    };
    assert_eq!(poll(0), 0, "quiet before any I/O");
    let mut buf = Buf::new(4096, 0);
    let iov = [buf.iovec()];
    // SAFETY: `buf` and `iov` outlive the engine's use (reaped below).
    unsafe {
        e.push(
            1,
            Op::Read {
                offset: 0,
                iov: iov.as_ptr(),
                iovcnt: 1,
            },
        )
    }
    .unwrap();
    e.submit().unwrap();
    assert_eq!(poll(5000), 1, "readable once the read completes");
    assert_eq!(e.reap(&mut |c| assert_eq!(c.result.unwrap(), 4096)), 1);
    assert_eq!(poll(0), 0, "drained by reap");
}

fn depth_limits(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 14);
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    assert!(b.engine(kind, 0).is_err());
    assert_eq!(
        b.engine(kind, MAX_DEPTH + 1).err().unwrap().to_string(),
        "engine depth 32769 is out of range 1..=32768"
    );
    let mut e = engine(&b, kind, 1);
    let lbs = b.logical_block_size() as usize;
    assert_eq!(read(&mut *e, 0, &[lbs], 0).unwrap().len(), lbs);
}

/// More iovecs than one READV/WRITEV takes (UIO_MAXIOV = 1024), in page-cache
/// mode (done in pieces) and O_DIRECT mode (bounced into one buffer).
fn many_iovecs(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", 2 * MIB, 15);
    let count = 1500;
    for &cache in caches(kind) {
        let b = open(&path, cache, false);
        let mut e = engine(&b, kind, 4);
        let mut data = vec![0u8; count * 512];
        Rng::new(16).fill(&mut data);
        let lens = vec![512; count];
        assert_eq!(
            write(&mut *e, 4096, &data, &lens, 0, false).unwrap(),
            data.len() as u64
        );
        assert!(read(&mut *e, 4096, &lens, 0).unwrap() == data, "{cache:?}");
    }
}

macro_rules! engine_tests {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;
            #[test]
            fn write_read_random() {
                super::write_read_random($kind)
            }
            #[test]
            fn depth_and_full() {
                super::depth_and_full($kind)
            }
            #[test]
            fn direct_io() {
                super::direct_io($kind)
            }
            #[test]
            fn flush_and_durable() {
                super::flush_and_durable($kind)
            }
            #[test]
            fn discard() {
                super::discard($kind)
            }
            #[test]
            fn write_zeroes() {
                super::write_zeroes($kind)
            }
            #[test]
            fn read_only() {
                super::read_only($kind)
            }
            #[test]
            fn bad_ops() {
                super::bad_ops($kind)
            }
            #[test]
            fn short_read_at_eof() {
                super::short_read_at_eof($kind)
            }
            #[test]
            fn drop_in_flight() {
                super::drop_in_flight($kind)
            }
            #[test]
            fn notify() {
                super::notify($kind)
            }
            #[test]
            fn many_iovecs() {
                super::many_iovecs($kind)
            }
            #[test]
            fn depth_limits() {
                super::depth_limits($kind)
            }
        }
    };
}

engine_tests!(uring, EngineKind::IoUring);
engine_tests!(aio, EngineKind::Aio);
engine_tests!(threads, EngineKind::Threads);
engine_tests!(sync, EngineKind::Sync);

#[test]
fn scratch_is_not_tmpfs() {
    let dir = scratch();
    assert!(!is_tmpfs(dir.path()));
    assert!(!is_tmpfs(Path::new(dir.path())));
}

/// Pool threads carry the name CPU accounting looks for (`vblk bench` counts threads whose
/// name starts with `POOL_THREAD_PREFIX` on the device side).
#[test]
fn pool_threads_are_named_for_accounting() {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 17);
    let b = open(&path, CacheMode::Writeback, false);
    let mut e = engine(&b, EngineKind::Threads, 4);
    assert_eq!(read(&mut *e, 0, &[4096], 0).unwrap().len(), 4096);
    // Reading /proc/self/task while the other tests' threads come and go can skip
    // entries (its position is an index into the thread list): look a few times.
    let named = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == format!("{POOL_THREAD_PREFIX}io"))
            .count()
    };
    let seen = (0..20).any(|_| {
        named() >= 1 || {
            std::thread::sleep(std::time::Duration::from_millis(10));
            false
        }
    });
    assert!(seen, "no thread named {POOL_THREAD_PREFIX}io");
}
