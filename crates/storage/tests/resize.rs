//! Resizing a disk while engines are open on it (`Backend::resize`, `vblk disk resize`):
//! a qcow2 image grows within its L1 table (the header's size only) and past it (the L1
//! table moved, QEMU's order), written at its new end through the same engine; after
//! close `qemu-img check` finds no error and no leak, `qemu-img info` gives the new size
//! and `qemu-img convert` reads what was written. Shrinking a qcow2, an unaligned size
//! and a read-only disk are refused with the reason. A raw file grows, refuses to shrink
//! unless allowed, and shrinks when allowed.

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
    tool(d, "qemu-img", &["create", "-f", "raw", "base.raw", "2M"]);
    tool(
        d,
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "top.qcow2",
            "1M",
        ],
    );
    let o = common::qcow2_options(&[&d.join("base.raw")], CacheMode::Writeback, false);
    let b = Backend::open(&DiskSpec::File(d.join("top.qcow2")), &o).unwrap();
    let e = refused(&b, 4 << 20, false);
    assert!(e.contains("backing file") && e.contains("larger"), "{e}");

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
