//! Images that are not raw, made by the real `qemu-img` (Debian package qemu-utils), are
//! refused by `vblk serve` and `vblk bench --disk` with a message that names the format and
//! the way out; `--format raw` serves their bytes as they are; raw images of any content
//! are served.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use driver::{Disk, DiskOptions};
use support::assets::find_program;
use support::daemon::{Backend, Daemon, Export};
use support::util::{run_to_exit, temp_dir, within};

/// A refused start fails at open, in milliseconds; this only bounds a hang.
const REFUSAL_LIMIT: Duration = Duration::from_secs(30);

fn qemu_img() -> PathBuf {
    find_program("qemu-img").unwrap_or_else(|| {
        panic!(
            "qemu-img is not installed: install the Debian package qemu-utils \
             (`apt-get install qemu-utils`; scripts/test does this)"
        )
    })
}

/// One image `qemu-img create` makes, and what vblk must call it.
struct Case {
    file: &'static str,
    format: &'static str,
    create: &'static [&'static str],
    named: &'static str,
}

const CASES: &[Case] = &[
    Case {
        file: "d.qcow2",
        format: "qcow2",
        create: &[],
        named: "is a qcow2 image (version 3), not raw",
    },
    Case {
        file: "d.qcow",
        format: "qcow",
        create: &[],
        named: "is a qcow image",
    },
    Case {
        file: "d.qed",
        format: "qed",
        create: &[],
        named: "is a QED image",
    },
    Case {
        file: "d.vmdk",
        format: "vmdk",
        create: &[],
        named: "is a VMDK image (sparse extent)",
    },
    Case {
        file: "stream.vmdk",
        format: "vmdk",
        create: &["-o", "subformat=streamOptimized"],
        named: "is a VMDK image (sparse extent)",
    },
    Case {
        file: "flat.vmdk",
        format: "vmdk",
        create: &["-o", "subformat=monolithicFlat"],
        named: "is a VMDK descriptor",
    },
    Case {
        file: "d.vhdx",
        format: "vhdx",
        create: &[],
        named: "is a VHDX image",
    },
    Case {
        file: "d.vdi",
        format: "vdi",
        create: &[],
        named: "is a VDI image",
    },
    Case {
        file: "d.vhd",
        format: "vpc",
        create: &[],
        named: "is a VHD image (vpc, dynamic)",
    },
    Case {
        file: "fixed.vhd",
        format: "vpc",
        create: &["-o", "subformat=fixed"],
        named: "is a fixed-size VHD image",
    },
    Case {
        file: "d.parallels",
        format: "parallels",
        create: &[],
        named: "is a Parallels image",
    },
    Case {
        file: "d.luks",
        format: "luks",
        create: &[
            "--object",
            "secret,id=s0,data=vblk",
            "-o",
            "key-secret=s0,iter-time=10",
        ],
        named: "is a LUKS1 encrypted volume",
    },
];

fn create(dir: &Path, case: &Case) -> PathBuf {
    let path = dir.join(case.file);
    let run = || {
        Command::new(qemu_img())
            .args(["create", "-q", "-f", case.format])
            .args(case.create)
            .arg(&path)
            .arg("8M")
            .output()
            .expect("run qemu-img")
    };
    let mut out = run();
    // LUKS: qemu-img times its PBKDF on the thread's CPU clock and gives up when its first
    // round measures 0 ms, which on this VM's tick-sampled CPU clock happens in about a
    // third of the runs, idle or not (6 of 20 measured). Only that is retried, until it
    // succeeds or fails otherwise (a failed try returns at once).
    for _ in 0..50 {
        if !String::from_utf8_lossy(&out.stderr).contains("Unable to get accurate CPU usage") {
            break;
        }
        out = run();
    }
    assert!(
        out.status.success(),
        "qemu-img create -f {} failed: {}",
        case.format,
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// Runs `vblk ARGS`, expecting it to fail; returns its stderr.
fn vblk_refused(args: &[&str], disk: &Path) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.args(args).arg(disk);
    let out = run_to_exit(cmd, REFUSAL_LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "vblk {args:?} {} should have refused the disk; stderr:\n{stderr}",
        disk.display()
    );
    stderr
}

fn serve_refused(dir: &Path, disk: &Path, extra: &[&str]) -> String {
    let sock = dir.join("refused.sock");
    let mut args = vec!["serve", "--socket-path", sock.to_str().unwrap()];
    args.extend(extra);
    args.push("--blk-file");
    vblk_refused(&args, disk)
}

fn serve(dir: &Path, name: &str, disk: &Path, args: &[&str]) -> Daemon {
    Daemon::start(
        Backend::Vblk,
        name,
        &Export::new(disk, 1).args(args),
        &dir.join(format!("{name}.sock")),
        &dir.join(format!("{name}.log")),
    )
}

#[test]
fn every_image_format_is_refused_by_name_with_the_way_out() {
    let dir = temp_dir("formats");
    for case in CASES {
        let img = create(dir.path(), case);
        let err = serve_refused(dir.path(), &img, &[]);
        let named = format!("{} {}", img.display(), case.named);
        assert!(
            err.contains(&named),
            "{}: expected {named:?} in:\n{err}",
            case.file
        );
        assert!(err.contains("--format raw"), "{}: {err}", case.file);
        if case.format != "luks" {
            let convert = format!(
                "qemu-img convert -f {} -O raw {}",
                case.format,
                img.display()
            );
            assert!(
                err.contains(&convert),
                "{}: expected {convert:?} in:\n{err}",
                case.file
            );
        }
    }
}

#[test]
fn read_only_does_not_make_a_qcow2_servable() {
    let dir = temp_dir("formats");
    let img = create(dir.path(), &CASES[0]);
    let err = serve_refused(dir.path(), &img, &["--read-only"]);
    assert!(err.contains("is a qcow2 image"), "{err}");
    assert!(
        err.contains("the guest would see the format's metadata"),
        "{err}"
    );
}

#[test]
fn format_raw_serves_the_bytes_as_they_are() {
    let dir = temp_dir("formats");
    for case in CASES {
        let img = create(dir.path(), case);
        // qcow2 and qcow files end mid-sector; a disk is whole sectors.
        let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len.div_ceil(4096) * 4096).unwrap();
        drop(f);
        let mut d = serve(dir.path(), "raw", &img, &["--format", "raw"]);
        d.assert_running(&format!("serving {} with --format raw", case.file));
        if case.format == "qcow2" {
            // The guest sees the file's first sector: the qcow2 header.
            let sock = d.socket.clone();
            let sector = within(Duration::from_secs(60), "read sector 0", move || {
                let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
                let mut q = disk.take_queue(0).unwrap();
                let mut sector = vec![0u8; 512];
                q.read_at(0, &mut sector).unwrap();
                sector
            });
            assert_eq!(sector[..], fs::read(&img).unwrap()[..512]);
            assert!(sector.starts_with(b"QFI\xfb"));
        }
    }
}

#[test]
fn raw_images_of_any_content_are_served() {
    let dir = temp_dir("formats");
    let img = dir.path().join("random.img");
    let mut x: u64 = 0x243F_6A88_85A3_08D3;
    let bytes: Vec<u8> = (0..4 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    fs::write(&img, &bytes).unwrap();
    let mut d = serve(dir.path(), "random", &img, &[]);
    d.assert_running("serving random bytes");
    drop(d);
    // A VMDK flat extent (the data file beside a descriptor) is raw.
    let case = CASES.iter().find(|c| c.file == "flat.vmdk").unwrap();
    create(dir.path(), case);
    let extent = dir.path().join("flat-flat.vmdk");
    let mut d = serve(dir.path(), "extent", &extent, &[]);
    d.assert_running("serving a VMDK flat extent");
}

#[test]
fn bench_refuses_a_qcow2_disk() {
    // vblk bench writes to its disk; a qcow2 given by mistake must survive.
    let dir = temp_dir("formats");
    let img = create(dir.path(), &CASES[0]);
    let before = fs::read(&img).unwrap();
    for baseline in [false, true] {
        let mut args = vec!["bench", "--rw=randwrite", "--runtime=1"];
        if baseline {
            args.push("--baseline");
        }
        args.push("--disk");
        let err = vblk_refused(&args, &img);
        assert!(
            err.contains("is a qcow2 image"),
            "baseline={baseline}: {err}"
        );
    }
    assert!(fs::read(&img).unwrap() == before, "the image is untouched");
}
