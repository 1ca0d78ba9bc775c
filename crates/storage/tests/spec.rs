//! The SPEC and size grammars, including the messages for bad input.

use std::path::PathBuf;

use vblk_storage::{format_size, parse_size, DiskSpec};

fn spec(s: &str) -> DiskSpec {
    s.parse().unwrap()
}

fn spec_err(s: &str) -> String {
    s.parse::<DiskSpec>().unwrap_err().to_string()
}

#[test]
fn specs_parse() {
    assert_eq!(spec("disk.img"), DiskSpec::File(PathBuf::from("disk.img")));
    assert_eq!(spec("/dev/vdb"), DiskSpec::File(PathBuf::from("/dev/vdb")));
    assert_eq!(spec("mem:1G"), DiskSpec::Mem(1 << 30));
    assert_eq!(spec("mem:512"), DiskSpec::Mem(512));
    assert_eq!(spec("null:2T"), DiskSpec::Null(2 << 40));
    assert_eq!(spec("null:4KiB"), DiskSpec::Null(4096));
    assert_eq!(spec("./mem:1G"), DiskSpec::File(PathBuf::from("./mem:1G")));
    assert_eq!(spec("mem"), DiskSpec::File(PathBuf::from("mem")));
}

#[test]
fn specs_display_and_round_trip() {
    assert_eq!(DiskSpec::Mem(1 << 30).to_string(), "mem:1G");
    assert_eq!(DiskSpec::Null(1536).to_string(), "null:1536");
    assert_eq!(DiskSpec::Mem(3 << 19).to_string(), "mem:1536K");
    assert_eq!(DiskSpec::File("/a/b.img".into()).to_string(), "/a/b.img");
    assert_eq!(DiskSpec::File("mem:1G".into()).to_string(), "./mem:1G");
    for s in [
        "mem:1G",
        "null:1536",
        "/a/b.img",
        "disk.img",
        "mem:7T",
        "./null:1M",
    ] {
        assert_eq!(spec(s).to_string(), s);
        assert_eq!(spec(&spec(s).to_string()), spec(s));
    }
    assert_eq!(
        spec(&DiskSpec::File("mem:1G".into()).to_string()),
        DiskSpec::File("./mem:1G".into())
    );
}

#[test]
fn bad_specs_say_why() {
    assert_eq!(
        spec_err(""),
        "empty disk spec (expected PATH, mem:SIZE, null:SIZE or an nbd:// URI)"
    );
    assert_eq!(
        spec_err("mem:"),
        "empty size (expected a number with an optional K, M, G or T suffix, e.g. 512, 4K, 1G)"
    );
    assert_eq!(spec_err("mem:1000"), "size 1000 is not a multiple of 512");
    assert_eq!(
        spec_err("null:0"),
        "size 0 is not allowed (a disk holds at least 512 bytes)"
    );
    assert_eq!(
        spec_err("mem:0K"),
        "size 0 is not allowed (a disk holds at least 512 bytes)"
    );
    assert_eq!(
        spec_err("null:4X"),
        "size \"4X\" is not a number with an optional K, M, G or T suffix (e.g. 512, 4K, 1G)"
    );
}

#[test]
fn sizes() {
    let cases = [
        ("512", 512),
        ("1024", 1024),
        ("4K", 4096),
        ("4k", 4096),
        ("4KiB", 4096),
        ("1M", 1 << 20),
        ("1m", 1 << 20),
        ("1MiB", 1 << 20),
        ("1G", 1 << 30),
        ("1g", 1 << 30),
        ("1GiB", 1 << 30),
        ("2T", 2 << 40),
        ("2t", 2 << 40),
        ("2TiB", 2 << 40),
        ("16383T", 16383 << 40),
    ];
    for (s, n) in cases {
        assert_eq!(parse_size(s).unwrap(), n, "{s}");
        assert_eq!(parse_size(&format_size(n)).unwrap(), n);
    }
}

#[test]
fn bad_sizes_say_why() {
    let err = |s: &str| parse_size(s).unwrap_err().to_string();
    assert_eq!(err("1000"), "size 1000 is not a multiple of 512");
    assert_eq!(err("513"), "size 513 is not a multiple of 512");
    assert_eq!(
        err("0"),
        "size 0 is not allowed (a disk holds at least 512 bytes)"
    );
    assert_eq!(
        err(""),
        "empty size (expected a number with an optional K, M, G or T suffix, e.g. 512, 4K, 1G)"
    );
    for bad in [
        "abc", "K", "-1", "1.5G", "4KB", " 4K", "4K ", "4 K", "0x200", "1P", "+512",
    ] {
        assert_eq!(
            err(bad),
            format!("size {bad:?} is not a number with an optional K, M, G or T suffix (e.g. 512, 4K, 1G)"),
            "{bad}"
        );
    }
    assert_eq!(
        err("16777216T"),
        "size \"16777216T\" does not fit in 64 bits"
    );
    assert_eq!(parse_size("16777215T").unwrap(), 16777215 << 40);
    assert_eq!(
        err("18446744073709551616"),
        "size \"18446744073709551616\" does not fit in 64 bits"
    );
    assert_eq!(
        err("99999999999999999999999K"),
        "size \"99999999999999999999999K\" does not fit in 64 bits"
    );
}
