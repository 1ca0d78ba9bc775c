//! `--engine` end to end: every engine serves a real O_DIRECT file through the embedded
//! device and through the baseline, with every block verified (`--verify=crc32c`), side by
//! side in one `--compare`; and the aio engine is refused, with the way out, where it
//! cannot work (the page cache), by `vblk serve` before it listens and by `vblk bench`.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::util::{run_to_exit, temp_dir};

/// How long a command that should refuse at once may take.
const REFUSAL_LIMIT: Duration = Duration::from_secs(30);

fn vblk() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vblk"));
    c.args(["--log-level", "warn"]);
    c
}

fn image(dir: &Path) -> String {
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0u8; 32 << 20]).unwrap();
    img.to_str().unwrap().to_owned()
}

/// `vblk bench ARGS`; its stdout.
fn bench(args: &[&str]) -> String {
    let out = vblk().arg("bench").args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "vblk bench {args:?} failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

const JOB: &[&str] = &[
    "--rw=randrw",
    "--bs=4k",
    "--iodepth=8",
    "--size=16m",
    "--runtime=300ms",
    "--time_based",
    "--verify=crc32c",
];

#[test]
fn every_engine_in_one_comparison() {
    let dir = temp_dir("engines");
    let img = image(dir.path());
    for target in [&[][..], &["--baseline"][..]] {
        let mut args = JOB.to_vec();
        args.extend(target);
        args.extend(["--disk", &img, "--cache", "none", "--engine-threads", "4"]);
        args.extend(["--compare", "engine=io_uring,aio,threads,sync"]);
        let text = bench(&args);
        for engine in ["io_uring", "aio", "threads", "sync"] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("engine={engine} "))),
                "{target:?}: no row for {engine}:\n{text}"
            );
        }
    }
}

#[test]
fn aio_without_o_direct_is_refused_with_the_way_out() {
    let dir = temp_dir("engines");
    let img = image(dir.path());
    let sock = dir.path().join("refused.sock");
    let mut cmd = vblk();
    cmd.args(["serve", "--socket-path", sock.to_str().unwrap()])
        .args(["--blk-file", &img, "--engine", "aio"]);
    let out = run_to_exit(cmd, REFUSAL_LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served: {stderr}");
    assert!(
        stderr.contains("the aio engine requires cache=none (O_DIRECT)")
            && stderr.contains("use --cache none"),
        "{stderr}"
    );
    assert!(!sock.exists(), "refused before listening");

    let mut cmd = vblk();
    cmd.arg("bench")
        .args(JOB)
        .args(["--disk", &img, "--engine", "aio"]);
    let out = run_to_exit(cmd, REFUSAL_LIMIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ran: {stderr}");
    assert!(
        stderr.contains("the aio engine requires cache=none"),
        "{stderr}"
    );
}
