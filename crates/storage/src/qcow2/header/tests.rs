use super::*;

const CLUSTER: u64 = 65536;

/// A valid version 3 image's cluster 0, as `qemu-img create -f qcow2 x 1G` lays it out:
/// 64 KiB clusters, reftable at cluster 1, L1 (2 entries) at cluster 3.
fn v3() -> Vec<u8> {
    let mut b = vec![0u8; CLUSTER as usize];
    b[..4].copy_from_slice(&MAGIC);
    put32(&mut b, 4, 3);
    put32(&mut b, 20, 16);
    put64(&mut b, 24, 1 << 30);
    put32(&mut b, 36, 2);
    put64(&mut b, 40, 3 * CLUSTER);
    put64(&mut b, 48, CLUSTER);
    put32(&mut b, 56, 1);
    put32(&mut b, 96, 4);
    put32(&mut b, 100, 112);
    b
}

const FILE: u64 = 4 * CLUSTER;

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

fn err(b: &[u8]) -> String {
    Header::parse(b, FILE).unwrap_err().to_string()
}

#[test]
fn a_plain_image_parses() {
    let h = Header::parse(&v3(), FILE).unwrap();
    assert_eq!(
        (
            h.version,
            h.cluster_size(),
            h.size,
            h.l1_entries,
            h.refcount_order
        ),
        (3, CLUSTER, 1 << 30, 2, 4)
    );
    assert_eq!((&h.backing_name, &h.backing_format), (&None, &None));
    assert!(h.check_writable().is_ok());
}

#[test]
fn a_backing_file_and_its_format_are_read_from_cluster_0() {
    let mut b = v3();
    // Backing format extension right after the header, then the end marker.
    put32(&mut b, 112, ext::BACKING_FORMAT);
    put32(&mut b, 116, 3);
    b[120..123].copy_from_slice(b"raw");
    let name = b"base.img";
    put64(&mut b, 8, 512);
    put32(&mut b, 16, name.len() as u32);
    b[512..512 + name.len()].copy_from_slice(name);
    let h = Header::parse(&b, FILE).unwrap();
    assert_eq!(h.backing_name.as_deref(), Some(&name[..]));
    assert_eq!(h.backing_format.as_deref(), Some(&b"raw"[..]));
}

#[test]
fn hostile_headers_get_a_clear_error_with_the_numbers() {
    type Patch = fn(&mut Vec<u8>);
    let cases: &[(Patch, &str)] = &[
        (|b| b[0] = b'X', "no qcow2 magic"),
        (|b| put32(b, 4, 4), "qcow2 version 4 is not supported"),
        (|b| put32(b, 4, 1), "qcow2 version 1"),
        (|b| put32(b, 20, 8), "cluster_bits 8"),
        (|b| put32(b, 20, 22), "cluster_bits 22"),
        (|b| put32(b, 20, 255), "cluster_bits 255"),
        (|b| put32(b, 100, 96), "header_length 96"),
        (|b| put32(b, 100, 108), "header_length 108"),
        (|b| put32(b, 100, 70000), "header_length 70000"),
        (
            |b| {
                put64(b, 8, 65000);
                put32(b, 16, 1000);
            },
            "backing file name at 65000, 1000 bytes",
        ),
        (
            |b| {
                put64(b, 8, 512);
                put32(b, 16, 1024);
            },
            "at most 1023 bytes",
        ),
        (
            |b| {
                put64(b, 8, u64::MAX - 3);
                put32(b, 16, 8);
            },
            "backing file name at 18446744073709551612",
        ),
        (
            |b| {
                put32(b, 112, 0x1234_5678);
                put32(b, 116, u32::MAX);
            },
            "header extension 0x12345678 at offset 112: it runs past",
        ),
        (
            |b| {
                put32(b, 112, ext::BACKING_FORMAT);
                put32(b, 116, 3);
                put32(b, 128, ext::BACKING_FORMAT);
                put32(b, 132, 3);
            },
            "a second backing format",
        ),
        (|b| put64(b, 72, incompat::DATA_FILE), "external data file"),
        (
            |b| put64(b, 72, incompat::EXTENDED_L2),
            "extended L2 entries",
        ),
        (|b| put64(b, 72, 1 << 40), "unknown bits 0x10000000000"),
        (
            |b| {
                put64(b, 72, incompat::COMPRESSION);
                b[104] = 1;
            },
            "zstd compression",
        ),
        (
            |b| b[104] = 1,
            "compression type 1 with the compression feature bit clear",
        ),
        (|b| put32(b, 96, 7), "refcount_order 7"),
        (|b| put32(b, 96, 300), "refcount_order 300"),
        (|b| put32(b, 32, 2), "encrypted image (crypt_method 2)"),
        (
            |b| put32(b, 56, 0),
            "refcount table at offset 65536, 0 bytes: empty",
        ),
        (|b| put32(b, 56, 129), "larger than QEMU allows"),
        (
            |b| put64(b, 48, 1000),
            "refcount table at offset 1000, 65536 bytes: not cluster-aligned",
        ),
        (|b| put64(b, 48, 4 * CLUSTER), "past the end of the file"),
        (|b| put64(b, 48, 0), "it would overlap the header"),
        (|b| put64(b, 48, !(CLUSTER - 1)), "past the end of the file"),
        (
            |b| put32(b, 36, u32::MAX),
            "L1 table at offset 196608, 34359738360 bytes: larger",
        ),
        (
            |b| put64(b, 40, 4 * CLUSTER),
            "L1 table at offset 262144, 16 bytes: past the end",
        ),
        (
            |b| put32(b, 36, 1),
            "the L1 table's 1 entries do not cover the virtual size of 1073741824",
        ),
        (|b| put64(b, 24, u64::MAX), "do not cover the virtual size"),
        (|b| put32(b, 60, 70000), "70000 internal snapshots"),
        (
            |b| {
                put32(b, 60, 1);
                put64(b, 64, 100);
            },
            "1 internal snapshots at offset 100",
        ),
    ];
    for (patch, want) in cases {
        let mut b = v3();
        patch(&mut b);
        let e = err(&b);
        assert!(e.contains(want), "want {want:?}, got {e:?}");
    }
}

#[test]
fn short_and_truncated_files_are_refused_without_reading_past_them() {
    let b = v3();
    for n in [0, 3, 4, 71, 72, 103] {
        let e = Header::parse(&b[..n], FILE).unwrap_err();
        assert!(
            matches!(e, HeaderError::Short { .. } | HeaderError::Magic),
            "{n}: {e}"
        );
    }
    // An extension area that the file cuts off.
    let mut b = v3();
    put32(&mut b, 112, ext::FEATURE_NAMES);
    put32(&mut b, 116, 48);
    assert!(matches!(
        Header::parse(&b[..130], FILE),
        Err(HeaderError::Short { .. })
    ));
}

#[test]
fn version_2_has_fixed_fields_and_no_features() {
    let mut b = v3();
    put32(&mut b, 4, 2);
    // The v3 fields are not read in version 2: an incompatible bit there is padding.
    put64(&mut b, 72, incompat::EXTENDED_L2);
    put32(&mut b, 96, 300);
    let h = Header::parse(&b, FILE).unwrap();
    assert_eq!(
        (h.header_length, h.refcount_order, h.incompatible),
        (72, 4, 0)
    );
}

#[test]
fn dirty_corrupt_and_snapshotted_images_are_read_only() {
    for (bit, want) in [
        (incompat::CORRUPT, "marked corrupt"),
        (incompat::DIRTY, "not closed cleanly"),
    ] {
        let mut b = v3();
        put64(&mut b, 72, bit);
        let h = Header::parse(&b, FILE).unwrap();
        assert!(h.check_writable().unwrap_err().contains(want));
    }
    let mut b = v3();
    put32(&mut b, 60, 2);
    put64(&mut b, 64, 2 * CLUSTER);
    let h = Header::parse(&b, FILE).unwrap();
    assert!(h
        .check_writable()
        .unwrap_err()
        .contains("2 internal snapshots"));
}

#[test]
fn the_size_is_whole_sectors() {
    let mut b = v3();
    put64(&mut b, 24, (1 << 30) - 1);
    assert_eq!(Header::parse(&b, FILE).unwrap().size, (1 << 30) - 512);
}
