//! Handing work to the kernel, for the four file engines: the kernel refusing submissions
//! (EAGAIN) leaves work queued, never failed; one operation refused in the middle of a
//! batch fails alone; and the engines' setup options (aio needs O_DIRECT, the threads
//! engine's pool size).

mod common;

use std::sync::Arc;

use common::*;
use vblk_storage::{
    Backend, CacheMode, DiskSpec, Engine, EngineKind, Op, OpenOptions, DEFAULT_ENGINE_THREADS,
    MAX_ENGINE_THREADS,
};

const MIB: usize = 1 << 20;

/// The kernel refusing submissions (EAGAIN; simulated with `Backend::refuse_submits`)
/// leaves the work queued and counted in `backlog()`, never failed; the next submit hands
/// it over, and `wait` keeps retrying refused work. Engines without a kernel queue
/// (threads, sync) ignore the refusals.
fn refused_submissions(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 17);
    let original = std::fs::read(&path).unwrap();
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    let mut e = engine(&b, kind, 8);
    let mut bufs: Vec<Buf> = (0..4).map(|_| Buf::new(4096, 0)).collect();
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let push_all = |e: &mut dyn Engine| {
        for (i, v) in iovs.iter().enumerate() {
            let op = Op::Read {
                offset: 8192 * i as u64,
                iov: v,
                iovcnt: 1,
            };
            // SAFETY: `bufs` and `iovs` outlive the engine's use (reaped below).
            unsafe { e.push(i as u64, op) }.unwrap();
        }
    };
    let reap_all = |e: &mut dyn Engine| {
        let mut got = Vec::new();
        while got.len() < 4 {
            e.reap(&mut |c| got.push((c.token, c.result.unwrap())));
            if got.len() < 4 {
                e.wait().unwrap();
            }
        }
        got.sort();
        assert_eq!(got, vec![(0, 4096), (1, 4096), (2, 4096), (3, 4096)]);
    };
    b.refuse_submits(3);
    push_all(&mut *e);
    e.submit().unwrap();
    if kernel_queue(kind) {
        assert_eq!(e.backlog(), 4, "refused: still queued");
        assert_eq!(e.in_flight(), 4);
        e.submit().unwrap();
        e.submit().unwrap();
        assert_eq!(e.backlog(), 4);
        e.submit().unwrap();
        assert_eq!(e.backlog(), 0, "accepted on the next try");
    } else {
        assert_eq!(e.backlog(), 0);
    }
    reap_all(&mut *e);
    // Refused again, and left to `wait`, which must retry rather than sleep forever.
    b.refuse_submits(2);
    push_all(&mut *e);
    e.submit().unwrap();
    reap_all(&mut *e);
    b.refuse_submits(0);
    for (i, buf) in bufs.iter().enumerate() {
        assert!(
            buf.as_slice() == &original[8192 * i..8192 * i + 4096],
            "read {i}"
        );
    }
}

/// One operation the kernel refuses in the middle of a batch (a write on a read-only
/// disk, which Linux AIO refuses inside `io_submit`) fails alone: the operations before
/// it and after it are done, in the same submit call.
fn refused_in_batch(kind: EngineKind) {
    let dir = scratch();
    let path = make_file(dir.path(), "ro.img", MIB, 18);
    let original = std::fs::read(&path).unwrap();
    let b = open(&path, cache_for(kind, CacheMode::Writeback), true);
    let mut e = engine(&b, kind, 8);
    let mut bufs: Vec<Buf> = (0..5).map(|_| Buf::new(4096, 0)).collect();
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    for (i, v) in iovs.iter().enumerate() {
        let op = if i == 2 {
            Op::Write {
                offset: 0,
                iov: v,
                iovcnt: 1,
                durable: false,
            }
        } else {
            Op::Read {
                offset: 4096 * i as u64,
                iov: v,
                iovcnt: 1,
            }
        };
        // SAFETY: `bufs` and `iovs` outlive the engine's use (reaped below).
        unsafe { e.push(i as u64, op) }.unwrap();
    }
    e.submit().unwrap();
    assert_eq!(
        e.backlog(),
        0,
        "the rest of the batch went in the same call"
    );
    let mut got: Vec<(u64, Result<u64, i32>)> = Vec::new();
    while got.len() < 5 {
        e.reap(&mut |c| got.push((c.token, c.result.map_err(|e| e.raw_os_error().unwrap_or(0)))));
        if got.len() < 5 {
            e.wait().unwrap();
        }
    }
    got.sort();
    for (token, result) in got {
        if token == 2 {
            assert_eq!(result, Err(libc::EBADF));
        } else {
            assert_eq!(result, Ok(4096), "read {token}");
            let at = 4096 * token as usize;
            assert!(bufs[token as usize].as_slice() == &original[at..at + 4096]);
        }
    }
    drop(e);
    assert!(std::fs::read(&path).unwrap() == original);
}

macro_rules! submission_tests {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;
            #[test]
            fn refused_submissions() {
                super::refused_submissions($kind)
            }
            #[test]
            fn refused_in_batch() {
                super::refused_in_batch($kind)
            }
        }
    };
}

submission_tests!(uring, EngineKind::IoUring);
submission_tests!(aio, EngineKind::Aio);
submission_tests!(threads, EngineKind::Threads);
submission_tests!(sync, EngineKind::Sync);

/// The aio engine refuses the page cache, as QEMU refuses `aio=native` without
/// `cache.direct=on`: Linux AIO would do each request inside `io_submit`.
#[test]
fn aio_needs_o_direct() {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 19);
    let b = open(&path, CacheMode::Writeback, false);
    let err = b.engine(EngineKind::Aio, 8).err().expect("refused");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "{}: the aio engine requires cache=none",
            path.display()
        )),
        "{text}"
    );
    // RAM and null disks are served inline whatever the engine.
    let mem = Arc::new(Backend::open(&"mem:1M".parse().unwrap(), &Default::default()).unwrap());
    assert_eq!(mem.engine(EngineKind::Aio, 8).unwrap().name(), "inline");
}

/// The threads engine's pool size comes from the backend's options, within 1..=64.
#[test]
fn engine_threads_range() {
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 20);
    for (threads, ok) in [
        (0, false),
        (1, true),
        (MAX_ENGINE_THREADS, true),
        (65, false),
    ] {
        let opts = OpenOptions {
            engine_threads: threads,
            ..Default::default()
        };
        let b = Arc::new(Backend::open(&DiskSpec::File(path.clone()), &opts).unwrap());
        assert_eq!(b.engine_threads(), threads);
        match b.engine(EngineKind::Threads, 4) {
            Ok(mut e) => {
                assert!(ok, "{threads} accepted");
                assert_eq!(read(&mut *e, 0, &[4096], 0).unwrap().len(), 4096);
            }
            Err(err) => {
                assert!(!ok, "{threads} refused: {err}");
                assert_eq!(
                    err.to_string(),
                    format!("--engine-threads {threads}: must be between 1 and 64")
                );
            }
        }
    }
    assert_eq!(
        OpenOptions::default().engine_threads,
        DEFAULT_ENGINE_THREADS
    );
}
