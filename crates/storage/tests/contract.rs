//! The engine contract at its limits, for the four file engines, on real files:
//! - unaligned O_DIRECT operations larger than one bounce buffer, and more of them at once
//!   than the bounce budget holds: every one completes with the right bytes (pieces, and
//!   waiting for a buffer, never an error), and the engine never holds more bounce memory
//!   than its budget;
//! - a write that the kernel cuts short (the process's file-size limit) is continued, not
//!   reported as a success, and fails with the kernel's error for the rest.

mod common;

use common::*;
use vblk_storage::{CacheMode, EngineKind, Op};

const MIB: usize = 1 << 20;

/// 24 unaligned writes of 3 MiB + 512 at once (each needs 4 pieces; together 6x the
/// budget of 16 buffers), then the same as reads, then one 40 MiB unaligned write/read.
fn bounce_budget_and_pieces(kind: EngineKind) {
    let dir = scratch();
    let size = 128 * MIB;
    let path = make_file(dir.path(), "bounce.img", size, 21);
    let mut model = std::fs::read(&path).unwrap();
    let b = open(&path, CacheMode::None, false);
    let lbs = b.logical_block_size() as usize;
    let mut e = engine(&b, kind, 32);
    let mut rng = Rng::new(22);
    let n = 24;
    let len = 3 * MIB + lbs;
    let mut bufs: Vec<Buf> = (0..n).map(|i| Buf::new(len, 1 + i % 7)).collect();
    for (i, buf) in bufs.iter_mut().enumerate() {
        rng.fill(buf.as_mut_slice());
        let at = i * 4 * MIB;
        model[at..at + len].copy_from_slice(buf.as_slice());
    }
    let iovs: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let ops: Vec<(u64, Op)> = iovs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            (
                i as u64,
                Op::Write {
                    offset: (i * 4 * MIB) as u64,
                    iov: v,
                    iovcnt: 1,
                    durable: i % 5 == 0,
                },
            )
        })
        .collect();
    // SAFETY: `bufs` and `iovs` outlive the call, which reaps every op.
    let done = unsafe { run(&mut *e, &ops) };
    for c in &done {
        assert_eq!(
            c.result.as_ref().unwrap(),
            &(len as u64),
            "write {}",
            c.token
        );
    }
    let mut rbufs: Vec<Buf> = (0..n).map(|i| Buf::new(len, 2 + i % 5)).collect();
    let riovs: Vec<libc::iovec> = rbufs.iter_mut().map(Buf::iovec).collect();
    let ops: Vec<(u64, Op)> = riovs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            (
                i as u64,
                Op::Read {
                    offset: (i * 4 * MIB) as u64,
                    iov: v,
                    iovcnt: 1,
                },
            )
        })
        .collect();
    // SAFETY: as above.
    let done = unsafe { run(&mut *e, &ops) };
    for (c, rb) in done.iter().zip(&rbufs) {
        assert_eq!(c.result.as_ref().unwrap(), &(len as u64));
        let at = c.token as usize * 4 * MIB;
        assert!(rb.as_slice() == &model[at..at + len], "read {}", c.token);
    }
    // One operation of 40 pieces, in three unaligned iovecs.
    let big = 40 * MIB;
    let mut data = vec![0u8; big];
    rng.fill(&mut data);
    let lens = [MIB + lbs, 30 * MIB, 9 * MIB - lbs];
    write(&mut *e, 20 * MIB as u64, &data, &lens, 3, false).unwrap();
    model[20 * MIB..20 * MIB + big].copy_from_slice(&data);
    assert!(read(&mut *e, 20 * MIB as u64, &lens, 5).unwrap() == data);
    drop(e);
    assert!(std::fs::read(&path).unwrap() == model, "file differs");
}

/// The file-size limit cuts a write short: the engine must go on with the rest (and fail
/// there with EFBIG) rather than report the short count as success. Runs in a child
/// process, since the limit applies to the whole process.
fn short_write_is_continued(kind: EngineKind) {
    let var = "VBLK_SHORT_WRITE_CHILD";
    let name = format!("{}::short_write_is_continued", module(kind));
    if std::env::var(var).is_err() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &name, "--nocapture", "--test-threads=1"])
            .env(var, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed:\n{text}");
        assert!(text.contains("1 passed"), "the child ran nothing:\n{text}");
        return;
    }
    let dir = scratch();
    let path = make_file(dir.path(), "short.img", 2 * MIB, 23);
    let original = std::fs::read(&path).unwrap();
    // aio exists only with O_DIRECT; the kernel cuts an O_DIRECT write at the limit too.
    let b = open(&path, cache_for(kind, CacheMode::Writeback), false);
    // The limit falls inside the 2 MiB file: the kernel refuses any write at or past it,
    // and cuts one that crosses it short (generic_write_check_limits).
    let limit = MIB as u64 + 64 * 1024;
    // SAFETY: plain libc calls with valid arguments; the child is single-purpose.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: limit,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    // A write from limit - 8 KiB for 24 KiB: the kernel writes 8 KiB, then refuses.
    let mut e = engine(&b, kind, 4);
    let data = vec![0x77u8; 24 * 1024];
    let at = limit - 8192;
    let r = write(&mut *e, at, &data, &[24 * 1024], 0, false);
    let err = r.expect_err("a write cut short must not succeed");
    assert_eq!(err.raw_os_error(), Some(libc::EFBIG), "{err}");
    drop(e);
    let file = std::fs::read(&path).unwrap();
    let at = at as usize;
    assert!(
        file[at..at + 8192].iter().all(|&x| x == 0x77),
        "the part before the limit"
    );
    assert!(
        file[at + 8192..] == original[at + 8192..],
        "nothing past it"
    );
}

fn module(kind: EngineKind) -> &'static str {
    match kind {
        EngineKind::IoUring => "uring",
        EngineKind::Aio => "aio",
        EngineKind::Threads => "threads",
        EngineKind::Sync => "sync",
    }
}

macro_rules! contract_tests {
    ($module:ident, $kind:expr) => {
        mod $module {
            use super::*;
            #[test]
            fn bounce_budget_and_pieces() {
                super::bounce_budget_and_pieces($kind)
            }
            #[test]
            fn short_write_is_continued() {
                super::short_write_is_continued($kind)
            }
        }
    };
}

contract_tests!(uring, EngineKind::IoUring);
contract_tests!(aio, EngineKind::Aio);
contract_tests!(threads, EngineKind::Threads);
contract_tests!(sync, EngineKind::Sync);
