//! A writable qcow2 image handed between two daemons, as a live migration over shared
//! storage does (storage::handoff, qcow2/handoff.rs): the destination opens it inactive
//! while the source writes, cannot take it while the source holds it, takes it once the
//! source lets go, and then sees every cluster the source allocated after the
//! destination opened; and back again, with the first daemon's cached mappings stale.
//! After both close, `qemu-img check` finds no error and no leak, and `qemu-img convert`
//! reads what was written.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use vblk_storage::{Backend, CacheMode, DiskSpec, Engine, EngineKind, Holding, OpenOptions};

mod common;
use common::{engine, read, scratch, tool, write};

const CLUSTER: u64 = 4096;
const SIZE: u64 = 8 << 20;

fn open(path: &Path, cache: CacheMode, incoming: bool) -> Arc<Backend> {
    let mut o: OpenOptions = common::qcow2_options(&[], cache, false);
    o.image.incoming = incoming;
    Arc::new(Backend::open(&DiskSpec::File(path.to_owned()), &o).unwrap())
}

/// Writes `fill` over `len` bytes at `offset` through `e`, and into `shadow`.
fn put(e: &mut dyn Engine, shadow: &mut [u8], offset: u64, len: usize, fill: u8) {
    let data = vec![fill; len];
    write(e, offset, &data, &[len], 0, false).unwrap();
    shadow[offset as usize..][..len].copy_from_slice(&data);
}

/// Every byte of the disk through `e` equals `shadow`.
fn same(e: &mut dyn Engine, shadow: &[u8], who: &str) {
    for (i, want) in shadow.chunks(1 << 20).enumerate() {
        let got = read(e, (i << 20) as u64, &[want.len()], 0).unwrap();
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "{who}: byte {} reads {:#x}, was written {:#x}",
                (i << 20) + at,
                got[at],
                want[at]
            );
        }
    }
}

fn handoff(cache: CacheMode) {
    let dir = scratch();
    let d = dir.path();
    let opts = format!("cluster_size={CLUSTER}");
    tool(
        d,
        "qemu-img",
        &["create", "-f", "qcow2", "-o", &opts, "disk.qcow2", "8M"],
    );
    let path = d.join("disk.qcow2");
    let mut shadow = vec![0u8; SIZE as usize];

    let a = open(&path, cache, false);
    let mut ea = engine(&a, EngineKind::IoUring, 32);
    put(&mut *ea, &mut shadow, 0, 64 << 10, 0x11);
    // The destination opens while the source writes; it holds nothing and writes
    // nothing.
    let b = open(&path, cache, true);
    let mut eb = engine(&b, EngineKind::IoUring, 32);
    assert_eq!(
        (a.holding(), b.holding()),
        (Holding::Active, Holding::Inactive)
    );
    let e = write(&mut *eb, 1 << 20, &[0x99; 4096], &[4096], 0, false)
        .expect_err("an inactive image refuses writes");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    // Written after the destination read the L1 table: new L2 tables and clusters, in
    // place and allocating, a write-through one, no FLUSH.
    put(&mut *ea, &mut shadow, 3 << 20, 200 << 10, 0x12);
    put(&mut *ea, &mut shadow, 6 << 20, 8 << 10, 0x13);
    put(&mut *ea, &mut shadow, 4096, 512, 0x14);
    let e = b.activate().expect_err("the source still holds the image");
    assert!(e.to_string().contains("write"), "{e}");
    assert_eq!(b.holding(), Holding::Inactive);

    assert!(a.deactivate().unwrap());
    assert_eq!(a.holding(), Holding::Inactive);
    write(&mut *ea, 0, &[1; 512], &[512], 0, false).expect_err("handed over: no writes");
    assert!(b.activate().unwrap());
    assert_eq!(b.holding(), Holding::Active);
    same(&mut *eb, &shadow, "the destination after taking over");
    put(&mut *eb, &mut shadow, 5 << 20, 300 << 10, 0x21);
    put(&mut *eb, &mut shadow, 3 << 20, 4096, 0x22);
    put(&mut *eb, &mut shadow, 0, 512, 0x23);

    // Back to the first daemon, whose mappings of those clusters are stale.
    assert!(b.deactivate().unwrap());
    assert!(a.activate().unwrap());
    same(
        &mut *ea,
        &shadow,
        "the first daemon after taking the image back",
    );
    put(&mut *ea, &mut shadow, 7 << 20, 64 << 10, 0x31);
    same(&mut *ea, &shadow, "the first daemon after writing again");
    drop((ea, eb));
    drop((a, b));

    common::check_clean(d, "disk.qcow2");
    tool(
        d,
        "qemu-img",
        &["convert", "-O", "raw", "disk.qcow2", "out.raw"],
    );
    assert!(
        fs::read(d.join("out.raw")).unwrap() == shadow,
        "qemu-img reads other bytes"
    );
}

#[test]
fn a_qcow2_image_goes_to_a_migration_destination_and_back_with_nothing_lost_or_leaked() {
    handoff(CacheMode::Writeback);
}

#[test]
fn the_same_with_o_direct() {
    handoff(CacheMode::None);
}

/// Handing a qcow2 image over goes with its locks: a destination that would take none
/// (`--incoming` with locking off) is refused at open, as it could neither wait for the
/// source to let go nor know when it did.
#[test]
fn a_qcow2_destination_without_image_locks_is_refused() {
    let dir = scratch();
    let d = dir.path();
    common::create_qcow2(d, "m.qcow2", "cluster_size=65536", "8M");
    let mut o: OpenOptions = common::qcow2_options(&[], CacheMode::Writeback, false);
    o.image.incoming = true;
    o.image.lock = vblk_storage::ImageLock::Off;
    let e = Backend::open(&DiskSpec::File(d.join("m.qcow2")), &o)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("--incoming needs locking on"), "{e}");
}
