//! Default log levels: `vblk info` and `vblk bench` print results on stdout and log only
//! warnings on stderr, so no INFO line (one per attach, the embedded device's summaries)
//! interleaves with their output; `--log-level info` brings INFO back. The daemon's INFO
//! default is checked where it runs as a service (`systemd.rs`).

mod support;

use std::process::{Command, Output};

use support::daemon::{Backend, Daemon, Export};
use support::util::temp_dir;

fn vblk(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vblk {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn info_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains(" INFO "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn info_and_bench_log_no_info_lines_by_default() {
    let dir = temp_dir("logging");
    let socket = dir.path().join("vblk.sock");
    let _d = Daemon::start(
        Backend::Vblk,
        "vblk",
        &Export::new("mem:16M", 1),
        &socket,
        &dir.path().join("vblk.log"),
    );
    let sock = socket.to_str().unwrap();
    let out = vblk(&["info", "--socket", sock]);
    assert!(!out.stdout.is_empty(), "vblk info printed nothing");
    assert_eq!(info_lines(&out), Vec::<String>::new(), "vblk info");
    let loud = vblk(&["--log-level", "info", "info", "--socket", sock]);
    assert!(
        info_lines(&loud).iter().any(|l| l.contains("attached to")),
        "--log-level info still wins: {}",
        String::from_utf8_lossy(&loud.stderr)
    );
    let bench = vblk(&[
        "bench",
        "--disk",
        "mem:16M",
        "--rw=read",
        "--bs=4k",
        "--size=1m",
        "--path=bio",
    ]);
    assert!(!bench.stdout.is_empty(), "vblk bench printed nothing");
    assert_eq!(info_lines(&bench), Vec::<String>::new(), "vblk bench");
}
