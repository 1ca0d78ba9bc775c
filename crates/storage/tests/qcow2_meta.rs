//! qcow2 mapping lookups against QEMU: an image written by qemu-io (data, zeroes,
//! discards, over a backing file), read through `Meta::lookup` cluster by cluster, gives
//! the bytes `qemu-img convert -O raw` gives; compressed clusters are found as such; and
//! metadata that points where it must not is refused by name.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use vblk_storage::qcow2::entry::Mapping;
use vblk_storage::qcow2::meta::{Meta, MetaError};
use vblk_storage::qcow2::Header;

mod common;
use common::{scratch, tool as run};

fn open(path: &Path, slots: usize) -> (File, Meta) {
    let file = File::open(path).unwrap();
    let mut head = vec![0u8; 2 << 20];
    let n = file.read_at(&mut head, 0).unwrap();
    let h = Header::parse(&head[..n], file.metadata().unwrap().len()).unwrap();
    let meta = Meta::open(&file, h, slots).unwrap();
    (file, meta)
}

/// The guest's bytes through `meta`, with `backing` for unallocated clusters.
fn read_all(file: &File, meta: &mut Meta, backing: Option<&[u8]>) -> Vec<u8> {
    let size = meta.header().size;
    let mut out = vec![0u8; size as usize];
    let mut at = 0;
    while at < size {
        let run = meta.lookup(file, at, size - at).unwrap();
        let dst = &mut out[at as usize..(at + run.len) as usize];
        match run.mapping {
            Mapping::Data { .. } if !run.past_eof => {
                file.read_exact_at(dst, run.host_offset).unwrap();
            }
            Mapping::Unallocated => {
                if let Some(b) = backing {
                    dst.copy_from_slice(&b[at as usize..(at + run.len) as usize]);
                }
            }
            Mapping::Compressed { .. } => panic!("no compressed clusters in this image"),
            _ => {}
        }
        at += run.len;
    }
    out
}

#[test]
fn lookups_give_the_bytes_qemu_gives() {
    let dir = scratch();
    let d = dir.path();
    // A base with a pattern, and a top over it with data, zeroes and a discard, in
    // clusters of 4 KiB so that one L2 table spans several slices.
    run(d, "qemu-img", &["create", "-f", "raw", "base.raw", "8M"]);
    run(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x11 0 8M", "base.raw"],
    );
    run(
        d,
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=4096",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "top.qcow2",
        ],
    );
    for cmd in [
        "write -P 0x22 0 64k",
        "write -P 0x33 3000 10000",
        "write -z 1M 256k",
        "write -P 0x44 5M 1M",
        "discard 5M 64k",
        "write -P 0x55 8380416 4096",
    ] {
        run(d, "qemu-io", &["-f", "qcow2", "-c", cmd, "top.qcow2"]);
    }
    run(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "top.qcow2", "want.raw"],
    );
    let want = std::fs::read(d.join("want.raw")).unwrap();
    let base = std::fs::read(d.join("base.raw")).unwrap();
    for slots in [1, 3, 64] {
        let (file, mut meta) = open(&d.join("top.qcow2"), slots);
        let got = read_all(&file, &mut meta, Some(&base));
        assert!(
            got == want,
            "{slots} slots: the bytes differ from qemu-img convert's"
        );
        // 8 MiB of 4 KiB clusters: four L2 tables of one slice each, three of them
        // allocated (the writes touch 0-2 MiB, 4-6 MiB and 6-8 MiB). A second pass
        // reads them again only when the cache cannot hold all three.
        assert_eq!(meta.loads, 3, "{slots} slots");
        let again = read_all(&file, &mut meta, Some(&base));
        assert!(again == want);
        assert_eq!(meta.loads, if slots < 3 { 6 } else { 3 }, "{slots} slots");
    }
}

#[test]
fn compressed_clusters_are_found() {
    let dir = scratch();
    let d = dir.path();
    run(d, "qemu-img", &["create", "-f", "raw", "a.raw", "1M"]);
    run(
        d,
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 0 1M", "a.raw"],
    );
    run(
        d,
        "qemu-img",
        &["convert", "-c", "-O", "qcow2", "a.raw", "c.qcow2"],
    );
    let (file, mut meta) = open(&d.join("c.qcow2"), 4);
    let run = meta.lookup(&file, 0, 4096).unwrap();
    assert!(matches!(run.mapping, Mapping::Compressed { .. }), "{run:?}");
}

/// x.qcow2 (64 MiB) in `d` with its first cluster written: its path, its bytes, its
/// header, and where its L1 table and its first L2 table are.
fn one_cluster_written(d: &Path) -> (std::path::PathBuf, Vec<u8>, Header, usize, usize) {
    run(d, "qemu-img", &["create", "-f", "qcow2", "x.qcow2", "64M"]);
    run(
        d,
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 1 0 64k", "x.qcow2"],
    );
    let path = d.join("x.qcow2");
    let bytes = std::fs::read(&path).unwrap();
    let h = Header::parse(&bytes[..65536], bytes.len() as u64).unwrap();
    let l1_at = h.l1_offset as usize;
    let l2_at = (u64::from_be_bytes(bytes[l1_at..l1_at + 8].try_into().unwrap())
        & 0x00ff_ffff_ffff_fe00) as usize;
    (path, bytes, h, l1_at, l2_at)
}

#[test]
fn metadata_pointing_at_metadata_is_refused() {
    let dir = scratch();
    let d = dir.path();
    let (_, bytes, h, l1_at, l2_at) = one_cluster_written(d);
    let patch = |at: usize, value: u64| {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&value.to_be_bytes());
        let p = d.join("patched.qcow2");
        std::fs::write(&p, &b).unwrap();
        let file = File::open(&p).unwrap();
        let h = Header::parse(&b[..65536], b.len() as u64).unwrap();
        Meta::open(&file, h, 4).and_then(|mut m| m.lookup(&file, 0, 4096).map(|_| ()))
    };
    let cases: [(usize, u64, &str); 5] = [
        (
            l1_at,
            (1 << 63) | 0x10001,
            "L1 entry 0: entry 0x8000000000010001 has reserved bits",
        ),
        (
            l1_at,
            (1 << 63) | (1 << 40),
            "an L2 table at offset 0x10000000000: past the end",
        ),
        (l1_at, 1 << 63, ""),
        (
            l2_at,
            (1 << 63) | h.reftable_offset,
            "it overlaps the refcount table",
        ),
        (l2_at, (1 << 63) | 0x10200, "is not cluster-aligned"),
    ];
    for (at, value, want) in cases {
        let r = patch(at, value);
        if want.is_empty() {
            // An L1 entry with COPIED and offset 0: no L2 table, reads as unallocated.
            assert!(r.is_ok(), "{r:?}");
            continue;
        }
        let e = r.unwrap_err();
        assert!(
            matches!(e, MetaError::Entry { .. } | MetaError::Placement { .. })
                && e.to_string().contains(want),
            "want {want:?}: {e}"
        );
    }
}

/// One corrupt L2 entry fails its own cluster only: the slice's other clusters (here the
/// one written before it) still map, in a slice and by lookup.
#[test]
fn a_corrupt_l2_entry_fails_its_cluster_alone() {
    let dir = scratch();
    let (path, mut bytes, h, _, l2_at) = one_cluster_written(dir.path());
    // Guest cluster 3 mapped onto the refcount table.
    let bad = (1u64 << 63) | h.reftable_offset;
    bytes[l2_at + 24..l2_at + 32].copy_from_slice(&bad.to_be_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let (file, mut meta) = open(&path, 4);
    let mut out = Vec::new();
    meta.slice(&file, 0, &mut out).unwrap();
    assert!(matches!(out[0], Ok(Mapping::Data { .. })), "{:?}", out[0]);
    assert!(matches!(out[1], Ok(Mapping::Unallocated)), "{:?}", out[1]);
    let e = out[3].as_ref().unwrap_err().to_string();
    assert!(e.contains("it overlaps the refcount table"), "{e}");
    assert!(meta.lookup(&file, 0, 4096).is_ok());
    assert!(meta.lookup(&file, 4 * 65536, 4096).is_ok());
    assert!(meta.lookup(&file, 3 * 65536, 4096).is_err());
}
