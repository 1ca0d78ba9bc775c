//! What `Backend::open` checks on files and block devices before they are served: QEMU's
//! image locks (a second writer is refused, readers share, `ImageLock::Off` opts out)
//! and the format probe (images that are not raw are refused unless declared raw), through
//! the public API, on files and on loop devices with 512- and 4096-byte sectors.

mod common;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use common::*;
use vblk_storage::{
    Backend, CacheMode, Conflict, DiskSpec, Error, Format, ImageChecks, ImageFormat, ImageLock,
    OpenOptions, Perm,
};

const MIB: usize = 1 << 20;

/// The tests here run one at a time. A test that runs a program (losetup) forks, and the
/// child holds copies of every descriptor of this process until it execs: for that moment
/// another test's closed image keeps its OFD locks, and a test that counts on their
/// release would fail. (`vblk serve` never forks.)
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn opts(read_only: bool, cache: CacheMode, image: ImageChecks) -> OpenOptions {
    OpenOptions {
        read_only,
        cache,
        image,
        ..Default::default()
    }
}

fn try_open(path: &Path, o: &OpenOptions) -> Result<Backend, Error> {
    Backend::open(&DiskSpec::File(path.to_owned()), o)
}

fn raw_unlocked() -> ImageChecks {
    ImageChecks {
        lock: ImageLock::Off,
        format: Some(Format::Raw),
        incoming: false,
    }
}

#[test]
fn the_default_is_locked_and_probed() {
    assert_eq!(
        OpenOptions::default().image,
        ImageChecks {
            lock: ImageLock::On,
            format: None,
            incoming: false,
        }
    );
}

#[test]
fn writers_exclude_each_other_and_readers_share() {
    let _serial = serial();
    let dir = scratch();
    let img = make_file(dir.path(), "disk.img", MIB, 1);
    let wb = CacheMode::Writeback;
    let rw = opts(false, wb, ImageChecks::default());
    let ro = opts(true, wb, ImageChecks::default());

    let first = try_open(&img, &rw).unwrap();
    let e = try_open(&img, &rw).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Locked {
                conflict: Conflict::NotShared(Perm::Write),
                ..
            }
        ),
        "{e:?}"
    );
    let text = e.to_string();
    let me = format!("(pid {})", std::process::id());
    assert!(
        text.starts_with(&format!(
            "{}: Failed to get \"write\" lock: ",
            img.display()
        )) && text.contains("byte 201")
            && text.contains(&me),
        "{text}"
    );
    let e = try_open(&img, &ro).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Locked {
                conflict: Conflict::Held(Perm::Write),
                ..
            }
        ),
        "{e:?}"
    );
    // Off takes and checks nothing.
    let unlocked = opts(
        false,
        wb,
        ImageChecks {
            lock: ImageLock::Off,
            format: None,
            incoming: false,
        },
    );
    let beside = try_open(&img, &unlocked).unwrap();
    drop(first);
    // Readers share; a writer after them is refused; the last reader gone, it is not.
    let r1 = try_open(&img, &ro).unwrap();
    let r2 = try_open(&img, &ro).unwrap();
    assert!(matches!(
        try_open(&img, &rw),
        Err(Error::Locked {
            conflict: Conflict::NotShared(Perm::Write),
            ..
        })
    ));
    drop((r1, r2, beside));
    try_open(&img, &rw).unwrap();
}

#[test]
fn images_that_are_not_raw_are_refused_unless_declared_raw() {
    let _serial = serial();
    let dir = scratch();
    // A qcow2 header, then zeroes: 196616 bytes like `qemu-img create -f qcow2 x 8M`,
    // which is not a whole number of sectors: the format is named, not the size.
    let img = dir.path().join("x.qcow2");
    let mut bytes = vec![0u8; 196_616];
    bytes[..8].copy_from_slice(b"QFI\xfb\0\0\0\x03");
    std::fs::write(&img, &bytes).unwrap();
    let e = try_open(&img, &OpenOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotRaw {
                format: ImageFormat::Qcow2 { version: 3 },
                read_only: false,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().starts_with(&format!(
            "{} is a qcow2 image (version 3), not raw",
            img.display()
        )),
        "{e}"
    );
    let raw = opts(
        false,
        CacheMode::Writeback,
        ImageChecks {
            lock: ImageLock::On,
            format: Some(Format::Raw),
            incoming: false,
        },
    );
    let e = try_open(&img, &raw).unwrap_err().to_string();
    assert!(e.ends_with("size 196616 is not a multiple of 512"), "{e}");
    bytes.resize(196_608 + 512, 0);
    std::fs::write(&img, &bytes).unwrap();
    let b = try_open(&img, &raw).unwrap();
    assert_eq!(b.size(), 196_608 + 512);
}

/// Block devices are probed at both ends and locked too, with and without O_DIRECT, on
/// 512- and 4096-byte sectors (the probe's reads must then be aligned).
#[test]
fn block_devices_are_probed_and_locked() {
    let _serial = serial();
    let dir = scratch();
    for sector in [512u32, 4096] {
        let file = dir.path().join(format!("backing-{sector}.img"));
        let mut bytes = vec![0u8; 8 * MIB];
        let end = bytes.len();
        bytes[end - 512..end - 504].copy_from_slice(b"conectix");
        std::fs::write(&file, &bytes).unwrap();
        let lo = Loop::attach(&file, sector);
        for cache in [CacheMode::Writeback, CacheMode::None] {
            let e = try_open(&lo.dev, &opts(false, cache, ImageChecks::default())).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::NotRaw {
                        format: ImageFormat::Vpc { fixed: true },
                        ..
                    }
                ),
                "{sector} {cache:?}: {e:?}"
            );
            let declared = opts(
                false,
                cache,
                ImageChecks {
                    lock: ImageLock::On,
                    format: Some(Format::Raw),
                    incoming: false,
                },
            );
            let first = try_open(&lo.dev, &declared).unwrap();
            let e = try_open(&lo.dev, &declared).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Locked {
                        conflict: Conflict::NotShared(Perm::Write),
                        ..
                    }
                ),
                "{sector} {cache:?}: {e:?}"
            );
            drop(first);
        }
        // A header at the start is found through O_DIRECT on 4096-byte sectors too.
        bytes[..8].copy_from_slice(b"vhdxfile");
        std::fs::write(&file, &bytes).unwrap();
        drop(lo);
        let lo = Loop::attach(&file, sector);
        let e = try_open(
            &lo.dev,
            &opts(true, CacheMode::None, ImageChecks::default()),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::NotRaw {
                    format: ImageFormat::Vhdx,
                    read_only: true,
                    ..
                }
            ),
            "{sector}: {e:?}"
        );
        try_open(&lo.dev, &opts(true, CacheMode::None, raw_unlocked())).unwrap();
    }
}

/// Two daemons on one image, as the two ends of a live migration: the destination opens
/// it inactive (no locks) while the source writes; it can take the write locks only once
/// the source has let go (after making its writes durable), and then the source cannot
/// take them back. A third writer is refused by whichever is active.
#[test]
fn an_image_is_handed_from_one_writer_to_another() {
    let _serial = serial();
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 3);
    let checks = |incoming| ImageChecks {
        lock: ImageLock::On,
        format: Some(Format::Raw),
        incoming,
    };
    let source = try_open(&path, &opts(false, CacheMode::Writeback, checks(false))).unwrap();
    assert_eq!(source.holding(), vblk_storage::Holding::Active);
    // Without `incoming`, a second writer is refused at open, as before.
    assert!(try_open(&path, &opts(false, CacheMode::Writeback, checks(false))).is_err());
    let dest = try_open(&path, &opts(false, CacheMode::Writeback, checks(true))).unwrap();
    assert_eq!(dest.holding(), vblk_storage::Holding::Inactive);
    // The source still writes: the destination cannot start.
    let e = dest.activate().unwrap_err().to_string();
    assert!(e.contains("Failed to get \"write\" lock"), "{e}");
    assert_eq!(dest.holding(), vblk_storage::Holding::Inactive);
    // The switchover.
    assert!(source.deactivate().unwrap());
    assert!(!source.deactivate().unwrap(), "already inactive");
    assert!(dest.activate().unwrap());
    assert!(!dest.activate().unwrap(), "already active");
    // Two active writers: never.
    assert!(source.activate().is_err());
    assert!(try_open(&path, &opts(false, CacheMode::Writeback, checks(false))).is_err());
    // And back.
    assert!(dest.deactivate().unwrap());
    assert!(source.activate().unwrap());
}

/// The guest's write-cache choice is kept with the image file, for the daemon that serves
/// it next (a migration destination).
#[test]
fn the_guests_write_cache_choice_stays_with_the_image() {
    let _serial = serial();
    let dir = scratch();
    let path = make_file(dir.path(), "disk.img", MIB, 3);
    let o = opts(false, CacheMode::Writeback, raw_unlocked());
    let a = try_open(&path, &o).unwrap();
    assert_eq!(a.remembered_writeback(), None, "a fresh image says nothing");
    assert!(a.remember_writeback(false));
    let b = try_open(&path, &o).unwrap();
    assert_eq!(b.remembered_writeback(), Some(false));
    assert!(b.remember_writeback(true));
    assert_eq!(a.remembered_writeback(), Some(true));
    // A RAM disk has nowhere to keep it.
    let mem = Backend::open(&DiskSpec::Mem(MIB as u64), &OpenOptions::default()).unwrap();
    assert!(!mem.remember_writeback(false));
    assert_eq!(mem.remembered_writeback(), None);
}
