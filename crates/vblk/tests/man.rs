//! The manual pages: `vblk man --out DIR` writes vblk(1) and one page per subcommand from
//! the clap definitions, and `man` and groff render every one of them without a warning.

mod support;

use std::fs;
use std::process::Command;

use support::assets::require_program;
use support::util::temp_dir;

const PAGES: [&str; 13] = [
    "vblk",
    "vblk-serve",
    "vblk-info",
    "vblk-bench",
    "vblk-stats",
    "vblk-disk",
    "vblk-disk-list",
    "vblk-disk-add",
    "vblk-disk-remove",
    "vblk-disk-set",
    "vblk-disk-resize",
    "vblk-disk-group",
    "vblk-disk-sync",
];

#[test]
fn man_pages_are_generated_and_render() {
    let man = require_program("man", "man-db");
    let groff = require_program("groff", "groff-base");
    let dir = temp_dir("man");
    let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
        .args(["man", "--out"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vblk man: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(listed.lines().count(), PAGES.len(), "{listed}");
    for page in PAGES {
        let path = dir.path().join(format!("{page}.1"));
        assert!(
            path.is_file(),
            "{} missing; written:\n{listed}",
            path.display()
        );
        // groff itself, every warning on: the roff must be clean (-k: UTF-8 input through
        // preconv, as man does).
        let g = Command::new(&groff)
            .args(["-k", "-man", "-Tutf8", "-ww", "-z"])
            .arg(&path)
            .output()
            .unwrap();
        let warnings = String::from_utf8_lossy(&g.stderr);
        assert!(
            g.status.success() && warnings.is_empty(),
            "{page}: {warnings}"
        );
        // man -l: what a user sees.
        let m = Command::new(&man)
            .arg("-l")
            .arg(&path)
            .env("MANWIDTH", "80")
            .env("MAN_KEEP_FORMATTING", "0")
            .env("PAGER", "cat")
            .output()
            .unwrap();
        assert!(
            m.status.success(),
            "man -l {page}.1: {}",
            String::from_utf8_lossy(&m.stderr)
        );
        // Without a terminal man emboldens by overstriking ("N\bN"): keep the letters.
        let raw = String::from_utf8_lossy(&m.stdout);
        let mut text = String::new();
        for c in raw.chars() {
            if c == '\u{8}' {
                text.pop();
            } else {
                text.push(c);
            }
        }
        for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "SEE ALSO"] {
            assert!(text.contains(section), "{page}: no {section} in:\n{text}");
        }
        assert!(
            text.contains("--log-level"),
            "{page}: the global flag is documented"
        );
    }
    let serve = fs::read_to_string(dir.path().join("vblk-serve.1")).unwrap();
    for flag in [
        "blk\\-file",
        "socket\\-path",
        "control\\-socket",
        "hdd:SIZE",
    ] {
        assert!(serve.contains(flag), "vblk-serve(1) lacks {flag}");
    }
}
