//! Opening disks: RAM and null disks through the inline engine, errors with their
//! messages, and a real block device (a loop device) through both file engines.

mod common;

use std::sync::Arc;

use common::*;
use vblk_storage::{Backend, BackendKind, CacheMode, DiskSpec, EngineKind, Full, Op, OpenOptions};

const MIB: usize = 1 << 20;
const KINDS: [EngineKind; 2] = [EngineKind::IoUring, EngineKind::Sync];

fn open_spec(spec: &str, read_only: bool) -> Arc<Backend> {
    let opts = OpenOptions {
        read_only,
        cache: CacheMode::Writeback,
        prealloc: false,
        ..Default::default()
    };
    Arc::new(Backend::open(&spec.parse().unwrap(), &opts).unwrap())
}

fn open_err(spec: &DiskSpec, opts: &OpenOptions) -> String {
    Backend::open(spec, opts).unwrap_err().to_string()
}

#[test]
fn mem_disk() {
    let b = open_spec("mem:1M", false);
    assert_eq!(b.kind(), BackendKind::Mem);
    assert_eq!(b.size(), MIB as u64);
    assert_eq!(b.logical_block_size(), 512);
    assert_eq!(b.default_serial(), "vblk-mem");
    assert!(b.raw_fd().is_some() && b.supports_discard() && b.supports_write_zeroes());
    let mut model = vec![0u8; MIB];
    let mut rng = Rng::new(21);
    for kind in KINDS {
        let mut e = b.engine(kind, 8).unwrap();
        assert_eq!(e.name(), "inline");
        assert!(e.notify_fd().is_none());
        assert!(
            read(&mut *e, 0, &[MIB], 0).unwrap() == model,
            "starts (or stays) as the model"
        );
        for _ in 0..50 {
            let len = (1 + rng.below(32) as usize) * 512;
            let off = rng.below(((MIB - len) / 512) as u64 + 1) as usize * 512;
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            let lens = split(&mut rng, len, 4);
            assert_eq!(
                write(&mut *e, off as u64, &data, &lens, 3, false).unwrap(),
                len as u64
            );
            model[off..off + len].copy_from_slice(&data);
            let lens = split(&mut rng, len, 3);
            assert!(read(&mut *e, off as u64, &lens, 1).unwrap() == data);
        }
        // Discard, write-zeroes (both ways) and flush.
        let ops = [
            Op::Discard {
                offset: 0,
                len: 65536,
                durable: false,
            },
            Op::WriteZeroes {
                offset: 65536,
                len: 4096,
                unmap: true,
                durable: false,
            },
            Op::WriteZeroes {
                offset: 131072,
                len: 1024,
                unmap: false,
                durable: false,
            },
            Op::Flush,
        ];
        for op in ops {
            // SAFETY: these ops lend no buffer.
            assert_eq!(unsafe { run1(&mut *e, op) }.unwrap(), 0);
        }
        model[..65536].fill(0);
        model[65536..65536 + 4096].fill(0);
        model[131072..131072 + 1024].fill(0);
        assert!(read(&mut *e, 0, &[MIB], 0).unwrap() == model);
        // Out of range.
        let err = read(&mut *e, MIB as u64, &[512], 0).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }
}

/// Operations submitted together: the inline engine prefetches each one's first lines
/// while the one before it copies, so every kind of neighbour must come out as if it were
/// alone, an operation past the end (refused) and one with no buffer among them.
#[test]
fn mem_ops_submitted_together_match_the_model() {
    const SIZE: usize = 4 * MIB;
    let b = open_spec("mem:4M", false);
    let mut e = b.engine(EngineKind::IoUring, 64).unwrap();
    let mut model = vec![0u8; SIZE];
    let mut rng = Rng::new(77);
    for _ in 0..20 {
        let mut bufs: Vec<Buf> = Vec::new();
        let mut ops: Vec<(u64, Op)> = Vec::new();
        let mut expect: Vec<Option<Vec<u8>>> = Vec::new();
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(32);
        for token in 0..32u64 {
            let len = (1 + rng.below(16) as usize) * 512;
            let off = rng.below(((SIZE - len) / 512) as u64 + 1) as usize * 512;
            let mut buf = Buf::new(len, 0);
            let op = match rng.below(6) {
                0 | 1 => {
                    iovs.push(buf.iovec());
                    Op::Read {
                        offset: off as u64,
                        iov: iovs.last().unwrap(),
                        iovcnt: 1,
                    }
                }
                2 | 3 => {
                    rng.fill(buf.as_mut_slice());
                    iovs.push(buf.iovec());
                    Op::Write {
                        offset: off as u64,
                        iov: iovs.last().unwrap(),
                        iovcnt: 1,
                        durable: false,
                    }
                }
                4 => {
                    iovs.push(buf.iovec());
                    Op::Read {
                        offset: (SIZE + off) as u64,
                        iov: iovs.last().unwrap(),
                        iovcnt: 1,
                    }
                }
                _ => Op::Read {
                    offset: off as u64,
                    iov: std::ptr::null(),
                    iovcnt: 0,
                },
            };
            ops.push((token, op));
            bufs.push(buf);
            expect.push(None);
        }
        // SAFETY: `bufs` and `iovs` (never reallocated: capacity 32) outlive the run.
        let done = unsafe { run(&mut *e, &ops) };
        // The model, applied in order (the engine runs them in order).
        for (i, &(_, op)) in ops.iter().enumerate() {
            match op {
                Op::Read { offset, iovcnt, .. } if iovcnt == 1 && (offset as usize) < SIZE => {
                    let len = bufs[i].as_slice().len();
                    let at = offset as usize;
                    expect[i] = Some(model[at..at + len].to_vec());
                }
                Op::Write { offset, .. } => {
                    let at = offset as usize;
                    let data = bufs[i].as_slice();
                    model[at..at + data.len()].copy_from_slice(data);
                }
                _ => {}
            }
        }
        for (c, &(_, op)) in done.iter().zip(&ops) {
            match op {
                Op::Read { offset, .. } if offset as usize >= SIZE => {
                    assert_eq!(
                        c.result.as_ref().unwrap_err().raw_os_error(),
                        Some(libc::EINVAL)
                    )
                }
                Op::Read { iovcnt: 0, .. } => assert_eq!(*c.result.as_ref().unwrap(), 0),
                _ => assert!(c.result.is_ok(), "{:?}", c.result),
            }
        }
        for (i, want) in expect
            .into_iter()
            .enumerate()
            .filter_map(|(i, w)| w.map(|w| (i, w)))
        {
            assert!(
                bufs[i].as_slice() == want,
                "read {i} differs from the model"
            );
        }
    }
    assert!(read(&mut *e, 0, &[SIZE], 0).unwrap() == model);
}

#[test]
fn mem_depth_full() {
    let b = open_spec("mem:64K", false);
    let mut e = b.engine(EngineKind::IoUring, 2).unwrap();
    // SAFETY: Flush lends no buffer.
    unsafe {
        e.push(1, Op::Flush).unwrap();
        e.push(2, Op::Flush).unwrap();
        assert!(matches!(e.push(3, Op::Flush), Err(Full)));
    }
    e.submit().unwrap();
    assert_eq!(e.in_flight(), 2, "finished but not reaped");
    // SAFETY: as above.
    assert!(matches!(unsafe { e.push(3, Op::Flush) }, Err(Full)));
    assert_eq!(e.reap(&mut |c| assert!(c.result.is_ok())), 2);
    assert_eq!(e.in_flight(), 0);
}

#[test]
fn mem_read_only() {
    let b = open_spec("mem:64K", true);
    assert!(b.read_only() && !b.supports_discard());
    let mut e = b.engine(EngineKind::Sync, 4).unwrap();
    assert!(read(&mut *e, 0, &[4096], 0)
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    let err = write(&mut *e, 0, &[1u8; 512], &[512], 0, false).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF));
    // SAFETY: lends no buffer.
    let zero = unsafe {
        run1(
            &mut *e,
            Op::WriteZeroes {
                offset: 0,
                len: 512,
                unmap: true,
                durable: false,
            },
        )
    };
    assert_eq!(zero.unwrap_err().raw_os_error(), Some(libc::EBADF));
}

#[test]
fn null_disk() {
    let b = open_spec("null:1G", false);
    assert_eq!(b.kind(), BackendKind::Null);
    assert_eq!(b.size(), 1 << 30);
    assert_eq!(b.default_serial(), "vblk-null");
    assert!(b.raw_fd().is_none());
    for kind in KINDS {
        let mut e = b.engine(kind, 4).unwrap();
        assert_eq!(e.name(), "inline");
        assert!(e.notify_fd().is_none());
        assert_eq!(
            write(&mut *e, 4096, &[7u8; 8192], &[100, 8092], 1, true).unwrap(),
            8192
        );
        // `read` fills its buffers with 0xa5 first: the null disk must zero them.
        let got = read(&mut *e, 4096, &[1000, 7192], 0).unwrap();
        assert!(got.iter().all(|&x| x == 0));
        for op in [
            Op::Flush,
            Op::Discard {
                offset: 0,
                len: 1 << 30,
                durable: false,
            },
            Op::WriteZeroes {
                offset: 0,
                len: 512,
                unmap: false,
                durable: false,
            },
        ] {
            // SAFETY: these ops lend no buffer.
            assert_eq!(unsafe { run1(&mut *e, op) }.unwrap(), 0);
        }
        assert!(read(&mut *e, 1 << 30, &[512], 0).is_err(), "past the end");
    }
    let ro = open_spec("null:1M", true);
    let mut e = ro.engine(EngineKind::IoUring, 4).unwrap();
    let err = write(&mut *e, 0, &[1u8; 512], &[512], 0, false).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF));
}

#[test]
fn bad_sizes_are_refused_at_open() {
    let opts = OpenOptions::default();
    assert_eq!(
        open_err(&DiskSpec::Mem(1000), &opts),
        "size 1000 is not a multiple of 512"
    );
    assert_eq!(
        open_err(&DiskSpec::Null(0), &opts),
        "size 0 is not allowed (a disk holds at least 512 bytes)"
    );
    // Too big to map: an error naming the size, not a crash.
    let huge = open_err(&DiskSpec::Mem(1 << 62), &opts);
    assert!(huge.starts_with("mem:4194304T: "), "{huge}");
}

#[test]
fn file_open_errors_name_the_path() {
    let dir = scratch();
    let missing = dir.path().join("missing.img");
    let opts = OpenOptions::default();
    assert_eq!(
        open_err(&DiskSpec::File(missing.clone()), &opts),
        format!("{}: No such file or directory", missing.display())
    );
    let odd = dir.path().join("odd.img");
    std::fs::write(&odd, vec![0u8; 1000]).unwrap();
    assert_eq!(
        open_err(&DiskSpec::File(odd.clone()), &opts),
        format!("{}: size 1000 is not a multiple of 512", odd.display())
    );
    assert_eq!(
        open_err(
            &DiskSpec::File(dir.path().to_owned()),
            &OpenOptions {
                read_only: true,
                ..opts.clone()
            }
        ),
        format!(
            "{}: not a regular file or block device",
            dir.path().display()
        )
    );
    assert_eq!(
        open_err(&DiskSpec::File("/dev/null".into()), &opts),
        "/dev/null: not a regular file or block device"
    );
}

#[test]
fn file_serials() {
    let dir = scratch();
    let short = make_file(dir.path(), "disk.img", 4096, 1);
    assert_eq!(
        open(&short, CacheMode::Writeback, false).default_serial(),
        "disk.img"
    );
    let long = make_file(dir.path(), "a-rather-long-disk-image-name.raw", 4096, 1);
    let serial = open(&long, CacheMode::Writeback, false).default_serial();
    assert_eq!(serial, "-disk-image-name.raw");
    assert!(serial.len() <= 20);
}

/// A block device: size by BLKGETSIZE64, both engines, both cache modes, and a
/// 4096-byte-sector device whose O_DIRECT block size is 4096. Fails, naming what is
/// missing, where loop devices cannot be made.
#[test]
fn block_device() {
    let dir = scratch();
    let size = 8 * MIB;
    let file = make_file(dir.path(), "backing.img", size, 31);
    let lo = Loop::attach(&file, 512);
    let mut rng = Rng::new(32);
    for cache in [CacheMode::Writeback, CacheMode::None] {
        let b = open(&lo.dev, cache, false);
        assert_eq!(b.kind(), BackendKind::BlockDevice);
        assert_eq!(b.size(), size as u64);
        assert_eq!(b.logical_block_size(), 512);
        assert_eq!(
            b.default_serial(),
            lo.dev.file_name().unwrap().to_string_lossy()
        );
        assert_eq!(has_o_direct(b.raw_fd().unwrap()), cache == CacheMode::None);
        for kind in KINDS {
            let mut e = b.engine(kind, 8).unwrap();
            let off = rng.below(1000) * 4096;
            let mut data = vec![0u8; 12288];
            rng.fill(&mut data);
            assert_eq!(
                write(&mut *e, off, &data, &[4096, 1536, 6656], 1, false).unwrap(),
                12288
            );
            // SAFETY: these ops lend no buffer.
            unsafe {
                assert_eq!(run1(&mut *e, Op::Flush).unwrap(), 0);
            }
            assert!(
                read(&mut *e, off, &[512, 11776], 1).unwrap() == data,
                "{cache:?} {kind}"
            );
            let backing = std::fs::read(&file).unwrap();
            assert!(
                backing[off as usize..off as usize + 12288] == data[..],
                "flushed to the backing file"
            );
            // SAFETY: these ops lend no buffer.
            unsafe {
                assert_eq!(
                    run1(
                        &mut *e,
                        Op::Discard {
                            offset: off,
                            len: 4096,
                            durable: false,
                        }
                    )
                    .unwrap(),
                    0
                );
                for unmap in [true, false] {
                    let op = Op::WriteZeroes {
                        offset: off + 4096,
                        len: 8192,
                        unmap,
                        durable: false,
                    };
                    assert_eq!(run1(&mut *e, op).unwrap(), 0);
                }
            }
            let got = read(&mut *e, off + 4096, &[8192], 0).unwrap();
            assert!(got.iter().all(|&x| x == 0), "{cache:?} {kind}: zeroed");
        }
    }
    drop(lo);

    // 4096-byte sectors: O_DIRECT needs 4096-aligned offsets and lengths.
    let lo = Loop::attach(&file, 4096);
    let b = open(&lo.dev, CacheMode::None, false);
    assert_eq!(b.logical_block_size(), 4096);
    for kind in KINDS {
        let mut e = b.engine(kind, 4).unwrap();
        let data: Vec<u8> = (0..8192).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            write(&mut *e, 8192, &data, &[8192], 1, false).unwrap(),
            8192,
            "bounced"
        );
        assert!(read(&mut *e, 8192, &[8192], 3).unwrap() == data);
        let err = read(&mut *e, 512, &[4096], 0).unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(libc::EINVAL),
            "{kind}: offset not a multiple of 4096"
        );
    }
    // One writer at a time: the image lock refuses a second while the first lives.
    drop(b);
    let b = open(&lo.dev, CacheMode::Writeback, false);
    assert_eq!(
        b.logical_block_size(),
        512,
        "the page cache takes 512-byte I/O"
    );
    let mut e = b.engine(EngineKind::IoUring, 4).unwrap();
    assert_eq!(
        write(&mut *e, 512, &[9u8; 512], &[512], 0, true).unwrap(),
        512
    );
    assert!(read(&mut *e, 512, &[512], 0).unwrap() == [9u8; 512]);
}

/// The resident kilobytes of this process's mappings of the RAM disk memfd whose size is
/// `kib`, from /proc/self/smaps (the tests of this binary run in parallel: the process's
/// RSS moves with theirs, this mapping's does not).
fn ram_disk_rss_kib(kib: u64) -> Vec<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out = Vec::new();
    let mut lines = smaps.lines().peekable();
    while let Some(l) = lines.next() {
        if !l.contains("memfd:vblk-mem") {
            continue;
        }
        let (mut size, mut rss) = (0, 0);
        while let Some(f) = lines.peek() {
            let mut it = f.split_whitespace();
            match it.next() {
                Some("Size:") => size = it.next().unwrap().parse().unwrap(),
                Some("Rss:") => rss = it.next().unwrap().parse().unwrap(),
                Some(k) if k.ends_with(':') => {}
                _ => break,
            }
            lines.next();
        }
        if size == kib {
            out.push(rss);
        }
    }
    out
}

#[test]
fn prealloc_maps_every_page_of_a_ram_disk_at_open() {
    let opts = OpenOptions {
        read_only: false,
        cache: CacheMode::Writeback,
        prealloc: true,
        ..Default::default()
    };
    // A size no other test of this binary uses.
    let b = Backend::open(&"mem:72M".parse().unwrap(), &opts).unwrap();
    let rss = ram_disk_rss_kib(72 << 10);
    assert_eq!(
        rss,
        [72 << 10],
        "a preallocated 72 MiB RAM disk is resident (its mappings' Rss in KiB)"
    );
    assert_eq!(b.size(), 72 << 20);
}
