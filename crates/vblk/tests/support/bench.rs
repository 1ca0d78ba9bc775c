//! `vblk bench`'s JSON output, for the tests that run it or render pages from it.

use std::process::Command;

use serde_json::Value;

/// Run `vblk bench ARGS --output-format=json` and parse its output.
pub fn bench_json(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["--log-level", "warn", "bench"])
        .args(args)
        .arg("--output-format=json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vblk bench {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}
