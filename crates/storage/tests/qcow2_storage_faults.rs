//! A qcow2 image on storage that fails, from real faults.
//!
//! A full file system: the image lives on a small tmpfs, beside a file that takes most of
//! it. Writes that need new space fail with ENOSPC; the guest's earlier writes read back;
//! once the file is removed, writes succeed again, and `qemu-img check` finds no
//! corruption (a cluster counted for a batch that could not be written may leak).
//!
//! A failing `fdatasync`: the image is on ext4 on a loop device whose backing file lives on
//! a tmpfs that is full. Writes land in the page cache; their writeback needs new pages of
//! the tmpfs, which fail (ENOSPC in the loop driver, EIO to ext4), and the next
//! `fdatasync` of the image says so — once. Once the tmpfs has room again, a later
//! `fdatasync` succeeds although the writes it was about were dropped. So after one failed
//! sync vblk must fail every write and flush, whoever asked for the sync: the refcount
//! code syncs on its own, to order a new refcount block or table before what points at
//! it, and that failure counts as much as the writer's.

mod common;

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::{engine, run1, scratch, Loop};
use vblk_storage::{Backend, CacheMode, DiskSpec, EngineKind, Op};

/// Runs `program` (from Debian package `package`); a missing program or a failure
/// panics, naming what to install or what it said.
fn sh(program: &str, package: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("{program} could not run ({e}): this test needs root and {program} (`apt-get install {package}`)")
        });
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A tmpfs of a given size, mounted at `dir`; unmounted on drop (also when the test
/// fails).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    fn mount(dir: PathBuf, size: &str) -> Tmpfs {
        fs::create_dir(&dir).unwrap();
        let opt = format!("size={size}");
        sh(
            "mount",
            "mount",
            &["-t", "tmpfs", "-o", &opt, "tmpfs", p(&dir)],
        );
        Tmpfs { dir }
    }

    /// Take every free page with the file `name`.
    fn fill(&self, name: &str) {
        let mut f = File::create(self.dir.join(name)).unwrap();
        let chunk = vec![0x55u8; 4096];
        let mut filled = 0u64;
        while f.write_all(&chunk).is_ok() {
            filled += chunk.len() as u64;
        }
        assert!(filled > 0, "the tmpfs had no room to fill");
    }

    /// Give back the room the file `name` takes.
    fn unfill(&self, name: &str) {
        fs::remove_file(self.dir.join(name)).unwrap();
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// A tmpfs of `size`, an ext4 on a loop device over a sparse file in it; unmounted and
/// detached on drop (in that order, also when the test fails).
struct Stack {
    fs: PathBuf,
    dev: Option<Loop>,
    tmpfs: Tmpfs,
}

impl Stack {
    fn new(d: &Path, size: &str) -> Stack {
        let fs = d.join("ext4");
        fs::create_dir(&fs).unwrap();
        let mut stack = Stack {
            fs,
            dev: None,
            tmpfs: Tmpfs::mount(d.join("tmpfs"), size),
        };
        let disk = stack.tmpfs.dir.join("disk");
        File::create(&disk).unwrap().set_len(128 << 20).unwrap();
        let dev = stack.dev.insert(Loop::attach(&disk, 512)).dev.clone();
        // Everything ext4 will ever write for itself is written now (no lazy inode table
        // initialisation later, no journal): afterwards only the image's new blocks need
        // new pages of the tmpfs.
        sh(
            "mkfs.ext4",
            "e2fsprogs",
            &[
                "-q",
                "-O",
                "^has_journal",
                "-E",
                "lazy_itable_init=0,nodiscard",
                p(&dev),
            ],
        );
        sh("mount", "mount", &[p(&dev), p(&stack.fs)]);
        stack
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.fs).status();
        self.dev = None;
    }
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The first allocating write on a fresh image of 512-byte clusters counts a batch of
/// clusters past the image's one refcount block: the refcount code writes a new block and
/// syncs before pointing the table at it, and that sync fails. The tmpfs then gets room
/// again. Every later write and flush must fail; before, the writer did not know of the
/// failure and the next write and flush succeeded over the dropped block.
#[test]
fn after_a_failed_sync_in_the_refcount_code_every_write_and_flush_fails() {
    let dir = scratch();
    let stack = Stack::new(dir.path(), "24m");
    common::create_qcow2(&stack.fs, "img.qcow2", "cluster_size=512", "64M");
    sh("sync", "coreutils", &["-f", p(&stack.fs.join("img.qcow2"))]);
    stack.tmpfs.fill("fill");
    let backend = Arc::new(
        Backend::open(
            &DiskSpec::File(stack.fs.join("img.qcow2")),
            &common::qcow2_options(&[], CacheMode::Writeback, false),
        )
        .unwrap(),
    );
    let mut e = engine(&backend, EngineKind::Sync, 4);
    let first = common::write(&mut *e, 0, &[0xa1; 65536], &[65536], 0, false);
    assert!(
        first.is_err(),
        "the first allocating write succeeded: the fault did not happen (the full tmpfs \
         under the loop device should have failed the refcount block's fdatasync)"
    );
    stack.tmpfs.unfill("fill");
    let second = common::write(&mut *e, 1 << 20, &[0xb2; 65536], &[65536], 0, false);
    // SAFETY: a flush names no buffer.
    let flush = unsafe { run1(&mut *e, Op::Flush) };
    assert!(
        second.is_err() && flush.is_err(),
        "after a failed fdatasync a write gave {second:?} and a flush {flush:?}: the writes \
         the failed sync was about may be lost, and every write and flush must fail"
    );
    drop(e);
    drop(backend);
    drop(stack);
}

/// The image's file system fills up under a stream of 64 KiB writes (512-byte clusters:
/// data, L2 tables and refcount blocks all need new space), each followed by a flush:
/// part of the way (the data finds no room), and from the start (the first batch of
/// counted clusters finds no room for its refcount blocks). The first failure is ENOSPC
/// or EIO, never another error; everything acknowledged before it reads back. Once there
/// is room again, writes and flushes succeed, and after close `qemu-img check` finds no
/// corruption and `qemu-img convert` reads every acknowledged write.
#[test]
fn a_full_file_system_fails_writes_cleanly_and_they_work_again_once_there_is_room() {
    full_file_system(false);
    full_file_system(true);
}

fn full_file_system(from_the_start: bool) {
    let _ = env_logger::builder().is_test(true).try_init();
    let dir = scratch();
    let t = Tmpfs::mount(dir.path().join("tmpfs"), "3m");
    common::create_qcow2(&t.dir, "img.qcow2", "cluster_size=512", "16M");
    // The room that is given back later.
    if from_the_start {
        t.fill("spare");
    } else {
        let mut f = File::create(t.dir.join("spare")).unwrap();
        f.write_all(&vec![0x33u8; 1 << 20]).unwrap();
    }
    let backend = Arc::new(
        Backend::open(
            &DiskSpec::File(t.dir.join("img.qcow2")),
            &common::qcow2_options(&[], CacheMode::Writeback, false),
        )
        .unwrap(),
    );
    let mut e = engine(&backend, EngineKind::IoUring, 4);
    let mut shadow = vec![0u8; 16 << 20];
    let chunk = 65536usize;
    let mut next = 0usize;
    let fill = |i: usize| (i % 251) as u8 + 1;
    let put = |e: &mut dyn vblk_storage::Engine, shadow: &mut [u8], i: usize| {
        let data = vec![fill(i); chunk];
        let w = common::write(e, (i * chunk) as u64, &data, &[chunk], 0, false);
        // SAFETY: a flush names no buffer.
        let f = w.and_then(|_| unsafe { run1(e, Op::Flush) });
        if f.is_ok() {
            shadow[i * chunk..][..chunk].copy_from_slice(&data);
        }
        f
    };
    let failure = loop {
        assert!(
            next < 64,
            "16 MiB written to a 3 MiB tmpfs without a failure"
        );
        match put(&mut *e, &mut shadow, next) {
            Ok(_) => next += 1,
            Err(err) => break err,
        }
    };
    assert!(
        matches!(failure.raw_os_error(), Some(libc::ENOSPC | libc::EIO)),
        "the write that found the file system full failed with {failure:?}, not ENOSPC or EIO"
    );
    assert!(
        (next == 0) == from_the_start,
        "{next} writes fitted (full from the start: {from_the_start})"
    );
    // The file is as long as the image thinks (clusters are handed out only over a file
    // grown to hold them, even when the write that would have grown it failed).
    let known = backend.qcow2().unwrap().stats().file_size;
    let len = fs::metadata(t.dir.join("img.qcow2")).unwrap().len();
    assert!(
        len >= known,
        "the file is {len} bytes, the image counts on {known}: clusters past its end were handed out"
    );
    // The failed write may have landed in part: each of its clusters reads as before
    // (zeroes) or as written, never a mix.
    let got = common::read(&mut *e, (next * chunk) as u64, &[chunk], 0).unwrap();
    for (k, c) in got.chunks(512).enumerate() {
        assert!(
            c.iter().all(|&b| b == 0) || c.iter().all(|&b| b == fill(next)),
            "cluster {k} of the failed write holds a mix of old and new bytes"
        );
    }
    shadow[next * chunk..][..chunk].copy_from_slice(&got);
    let back = common::read(&mut *e, 0, &[16 << 20], 0).unwrap();
    assert!(
        back == shadow,
        "acknowledged writes read back differently once the disk was full"
    );
    t.unfill("spare");
    for i in next + 1..next + 9 {
        put(&mut *e, &mut shadow, i)
            .unwrap_or_else(|err| panic!("write {i} failed with room again: {err:?}"));
    }
    let back = common::read(&mut *e, 0, &[16 << 20], 0).unwrap();
    assert!(back == shadow, "acknowledged writes read back differently");
    drop(e);
    drop(backend);
    common::check_no_corruption(&t.dir, "img.qcow2");
    // Every mapped cluster lies inside the file (the file was grown over every cluster
    // handed out, even when a write that would have grown it failed).
    let len = fs::metadata(t.dir.join("img.qcow2")).unwrap().len();
    let map = Command::new("qemu-img")
        .args(["map", "--output=json", "img.qcow2"])
        .current_dir(&t.dir)
        .output()
        .expect("qemu-img (qemu-utils)");
    let map: serde_json::Value = serde_json::from_slice(&map.stdout).unwrap();
    for run in map.as_array().unwrap() {
        if let (Some(host), Some(n)) = (run["offset"].as_u64(), run["length"].as_u64()) {
            assert!(
                host + n <= len,
                "guest bytes mapped at {host}..{} past the end of the {len}-byte file: {run}",
                host + n
            );
        }
    }
    // out.raw may not fit beside the image on the tmpfs: it goes to the scratch dir.
    let raw = dir.path().join("out.raw");
    common::tool(
        &t.dir,
        "qemu-img",
        &["convert", "-O", "raw", "img.qcow2", p(&raw)],
    );
    let out = fs::read(&raw).unwrap();
    assert!(
        out == shadow,
        "qemu-img reads other bytes than were acknowledged"
    );
}
