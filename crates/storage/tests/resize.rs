//! Resizing a disk while engines are open on it (`Backend::resize`, `vblk disk resize`):
//! a qcow2 image grows within its L1 table (the header's size only) and past it (the L1
//! table moved, QEMU's order), written at its new end through the same engine; after
//! close `qemu-img check` finds no error and no leak, `qemu-img info` gives the new size
//! and `qemu-img convert` reads what was written. Over a backing file longer than the
//! image, the new space reads zeroes. A new L1 table whose clusters meet a growing
//! refcount table is placed after it. Shrinking a qcow2, an unaligned size and a
//! read-only disk are refused with the reason. A raw file grows, refuses to shrink unless
//! allowed, and shrinks when allowed.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use vblk_storage::{Backend, CacheMode, DiskSpec, Engine, EngineKind, OpenOptions};

mod common;
use common::{engine, read, scratch, tool, write};

fn qcow2(path: &Path, read_only: bool) -> Arc<Backend> {
    let o: OpenOptions = common::qcow2_options(&[], CacheMode::None, read_only);
    Arc::new(Backend::open(&DiskSpec::File(path.to_owned()), &o).unwrap())
}

fn put(e: &mut dyn Engine, shadow: &mut [u8], offset: u64, len: usize, fill: u8) {
    let data = vec![fill; len];
    write(e, offset, &data, &[len], 0, false).unwrap();
    shadow[offset as usize..][..len].copy_from_slice(&data);
}

fn refused(b: &Backend, size: u64, shrink: bool) -> String {
    b.resize(size, shrink)
        .expect_err("the resize is refused")
        .to_string()
}

#[test]
fn a_served_qcow2_image_grows_inside_and_past_its_l1_table() {
    let dir = scratch();
    let d = dir.path();
    // 512-byte clusters: an L2 table maps 32 KiB, the one-cluster L1 table 2 MiB.
    common::create_qcow2(d, "g.qcow2", "cluster_size=512", "1M");
    let path = d.join("g.qcow2");
    let b = qcow2(&path, false);
    let mut e = engine(&b, EngineKind::IoUring, 16);
    let mut shadow = vec![0u8; 1 << 20];
    put(&mut *e, &mut shadow, 0, 8192, 0x11);
    put(&mut *e, &mut shadow, (1 << 20) - 4096, 4096, 0x12);
    write(&mut *e, 1 << 20, &[1; 512], &[512], 0, false).expect_err("past the end");

    // Inside what the L1 table maps: the header's size.
    assert_eq!(b.resize(1536 << 10, false).unwrap(), (1 << 20, 1536 << 10));
    assert_eq!(b.size(), 1536 << 10);
    shadow.resize(1536 << 10, 0);
    put(&mut *e, &mut shadow, (1536 << 10) - 1024, 1024, 0x13);

    // Past it: 64 MiB needs 2048 L1 entries, 32 clusters, moved to the end of the file.
    assert_eq!(b.resize(64 << 20, false).unwrap(), (1536 << 10, 64 << 20));
    shadow.resize(64 << 20, 0);
    put(&mut *e, &mut shadow, (64 << 20) - 8192, 8192, 0x14);
    put(&mut *e, &mut shadow, 40 << 20, 65536, 0x15);
    put(&mut *e, &mut shadow, 4096, 512, 0x16);
    for (at, len) in [
        (0u64, 1 << 20),
        ((1 << 20) - 4096, 1 << 20),
        ((63 << 20), 1 << 20),
    ] {
        let got = read(&mut *e, at, &[len], 0).unwrap();
        assert!(
            got == shadow[at as usize..][..len],
            "bytes at {at} read back differently"
        );
    }

    let e1 = refused(&b, 32 << 20, true);
    assert!(
        e1.contains("grows qcow2 images only") && e1.contains("--shrink"),
        "{e1}"
    );
    let e2 = refused(&b, (64 << 20) + 100, false);
    assert!(e2.contains("multiple"), "{e2}");
    assert_eq!(b.size(), 64 << 20);
    drop(e);
    drop(b);

    common::check_clean(d, "g.qcow2");
    let info = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "g.qcow2"])
        .current_dir(d)
        .output()
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["virtual-size"], 64 << 20, "{info}");
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "g.qcow2", "out.raw"],
    );
    assert!(
        fs::read(d.join("out.raw")).unwrap() == shadow,
        "qemu-img reads other bytes"
    );

    // The grown image opens again at its new size; read-only, it is not resized.
    let b = qcow2(&path, true);
    assert_eq!(b.size(), 64 << 20);
    let e3 = refused(&b, 128 << 20, false);
    assert!(e3.contains("read-only"), "{e3}");
}

#[test]
fn a_raw_file_grows_and_shrinks_only_when_allowed() {
    let dir = scratch();
    let path = common::make_file(dir.path(), "r.img", 1 << 20, 3);
    let b = common::open(&path, CacheMode::Writeback, false);
    let mut e = engine(&b, EngineKind::IoUring, 8);
    assert_eq!(b.resize(2 << 20, false).unwrap(), (1 << 20, 2 << 20));
    assert_eq!(fs::metadata(&path).unwrap().len(), 2 << 20);
    write(&mut *e, (2 << 20) - 512, &[7; 512], &[512], 0, false).unwrap();
    let e1 = refused(&b, 1 << 20, false);
    assert!(e1.contains("smaller") && e1.contains("--shrink"), "{e1}");
    assert_eq!(b.resize(1 << 20, true).unwrap(), (2 << 20, 1 << 20));
    assert_eq!(fs::metadata(&path).unwrap().len(), 1 << 20);
    assert_eq!(b.size(), 1 << 20);
}

/// What growing a qcow2 refuses, each with its reason: a backing file larger than the
/// image (the new space would show its bytes: QEMU writes zeroes there, vblk does not),
/// a size that is not whole clusters (the old last cluster's tail was never the
/// guest's). And a raw file opened inactive (a migration's destination) is not resized:
/// the other daemon still owns it.
#[test]
fn growing_refuses_what_would_show_bytes_the_guest_never_wrote() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "odd.qcow2", "cluster_size=65536", "100K");
    let b = qcow2(&d.join("odd.qcow2"), false);
    let e = refused(&b, 1 << 20, false);
    assert!(e.contains("whole number"), "{e}");

    let path = common::make_file(d, "r.img", 1 << 20, 5);
    let mut o = OpenOptions::default();
    o.image.incoming = true;
    let b = Backend::open(&DiskSpec::File(path.clone()), &o).unwrap();
    let e = refused(&b, 2 << 20, false);
    assert!(e.contains("another daemon"), "{e}");
    assert_eq!(fs::metadata(&path).unwrap().len(), 1 << 20);
}

/// The first byte where `got` and `want` differ, for the failure message.
fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// `qemu-img check` finds `image` (in `d`) clean, and `qemu-img convert` reads `want`.
fn clean_and_reads(d: &Path, image: &str, want: &[u8]) {
    common::check_clean(d, image);
    let _ = fs::remove_file(d.join("out.raw"));
    tool(d, "qemu-img", &["convert", "-O", "raw", image, "out.raw"]);
    let out = fs::read(d.join("out.raw")).unwrap();
    if let Some(at) = first_difference(&out, want) {
        panic!(
            "{image}: qemu-img reads {:#x} at byte {at}, want {:#x}",
            out[at], want[at]
        );
    }
}

/// Growing a qcow2 over a backing file longer than it: the new space reads zeroes, not
/// the backing file's bytes (QEMU makes it so), through the engine and for qemu-img; a
/// write into it keeps the zeroes around it. Version 3 gets zero clusters; version 2 has
/// none and is refused, as QEMU refuses it, the image unchanged. Before, both were
/// refused.
#[test]
fn growing_over_a_longer_backing_file_shows_zeroes_in_the_new_space() {
    for compat in ["1.1", "0.10"] {
        let dir = scratch();
        let d = dir.path();
        common::make_file(d, "base.raw", 3 << 20, 9);
        let base = fs::read(d.join("base.raw")).unwrap();
        let options = format!("compat={compat}");
        tool(
            d,
            "qemu-img",
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                &options,
                "-b",
                "base.raw",
                "-F",
                "raw",
                "top.qcow2",
                "1M",
            ],
        );
        let o = common::qcow2_options(&[&d.join("base.raw")], CacheMode::None, false);
        let b = Arc::new(Backend::open(&DiskSpec::File(d.join("top.qcow2")), &o).unwrap());
        let mut e = engine(&b, EngineKind::IoUring, 8);
        let mut shadow = vec![0u8; 4 << 20];
        shadow[..1 << 20].copy_from_slice(&base[..1 << 20]);
        put(&mut *e, &mut shadow, 4096, 8192, 0x3c);
        if compat == "0.10" {
            // No zero clusters in version 2: refused, as QEMU refuses it.
            let why = refused(&b, 4 << 20, false);
            assert!(why.contains("version 2") && why.contains("amend"), "{why}");
            assert_eq!(b.size(), 1 << 20);
            shadow.truncate(1 << 20);
            let got = read(&mut *e, 0, &[1 << 20], 0).unwrap();
            assert!(
                got == shadow,
                "compat=0.10: the refused resize changed the bytes"
            );
            drop(e);
            drop(b);
            clean_and_reads(d, "top.qcow2", &shadow);
            continue;
        }
        assert_eq!(b.resize(4 << 20, false).unwrap(), (1 << 20, 4 << 20));
        put(&mut *e, &mut shadow, (2 << 20) + 512, 4096, 0x7e);
        let got = read(&mut *e, 0, &[4 << 20], 0).unwrap();
        if let Some(at) = first_difference(&got, &shadow) {
            panic!(
                "compat={compat}: byte {at} reads {:#x}, want {:#x} (the backing file has {:#x})",
                got[at],
                shadow[at],
                base.get(at).copied().unwrap_or(0)
            );
        }
        drop(e);
        drop(b);
        clean_and_reads(d, "top.qcow2", &shadow);
    }
}

/// A new L1 table placed where reserving its clusters grows the refcount table: the
/// image's file ends a few clusters before the 8 MiB its one-cluster refcount table covers
/// (512-byte clusters), and growing it from 64 to 128 MiB needs a 64-cluster L1 table.
/// The larger refcount table lands in the run's way; the run starts again after it.
/// Before, the resize failed ("no room for the new L1 table in one piece").
#[test]
fn a_new_l1_table_is_placed_after_a_refcount_table_grown_in_its_way() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "l.qcow2", "cluster_size=512", "64M");
    let path = d.join("l.qcow2");
    let covered = 16384u64; // 64 refcount blocks of 256 clusters each
    let mut shadow = vec![0u8; 128 << 20];
    let mut at = 0u64;
    let clusters = || fs::metadata(&path).unwrap().len().div_ceil(512);
    // Guest data until the file ends within 40 clusters of what the table covers (each
    // round writes a little less than what is left: L2 tables and refcount blocks come
    // with it).
    while clusters() < covered - 40 {
        let k = ((covered - 40 - clusters()) * 60 / 64).max(1);
        let cmd = format!("write -P 0x5d {at} {}", k * 512);
        tool(d, "qemu-io", &["-f", "qcow2", "-c", &cmd, "l.qcow2"]);
        shadow[at as usize..][..(k * 512) as usize].fill(0x5d);
        at += k * 512;
    }
    let end = clusters();
    assert!(
        (covered - 64..covered).contains(&end),
        "the file ends at cluster {end}: not within the 64 clusters before {covered}, so the \
         new L1 table would not meet the refcount table's growth"
    );
    let b = qcow2(&path, false);
    let mut e = engine(&b, EngineKind::IoUring, 8);
    assert_eq!(b.resize(128 << 20, false).unwrap(), (64 << 20, 128 << 20));
    put(&mut *e, &mut shadow, (128 << 20) - 4096, 4096, 0x6e);
    put(&mut *e, &mut shadow, 0, 1024, 0x6f);
    let got = read(&mut *e, 0, &[128 << 20], 0).unwrap();
    if let Some(at) = first_difference(&got, &shadow) {
        panic!("byte {at} reads {:#x}, want {:#x}", got[at], shadow[at]);
    }
    drop(e);
    drop(b);
    clean_and_reads(d, "l.qcow2", &shadow);
}
