//! Extra cpio layers unpacked over the base initramfs of [`super::assets`]: host programs
//! copied with every shared library `ldd` names, and small C programs compiled for the
//! guest at test time (`cc -static`). A layer is cached next to the base assets, keyed
//! by a manifest (the files' paths, sizes and mtimes, the C sources and the compiler's
//! version), so that only the first run pays for it.
//!
//! The layer's library directories go to `/etc/vblk-libpath.d/<layer>`, which the base
//! `/init` adds to `LD_LIBRARY_PATH`.
//!
//! Nothing here skips: a missing program or compiler is a test failure that names the
//! Debian package to install.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::assets::{
    add_with_libraries, assets, find_program, require_program, stamp, write_atomic, Cpio,
};

/// Bump when the layout of a layer changes in a way its manifest would not notice.
const LAYER_FORMAT: &str = "vblk-guest-layer v1";

/// The fragmenter of guest physical memory (see the top of the file).
pub const FRAG_SOURCE: &str = include_str!("frag.c");

/// What goes into a layer.
pub struct LayerSpec<'a> {
    /// Names the cached archive and the `/etc/vblk-libpath.d` entry.
    pub name: &'a str,
    /// `(program, Debian package, guest path)`: host programs copied with their libraries.
    pub programs: &'a [(&'a str, &'a str, &'a str)],
    /// `(guest path, C source)`: compiled with `cc -static -O2`.
    pub c_programs: &'a [(&'a str, &'a str)],
}

/// The fio layer: Debian's fio with its libraries as `/usr/bin/fio`, and the memory
/// fragmenter (`frag.c`) as `/usr/bin/vblk-frag`.
pub fn fio_layer() -> &'static Path {
    static LAYER: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let spec = LayerSpec {
        name: "fio",
        programs: &[("fio", "fio", "usr/bin/fio")],
        c_programs: &[("usr/bin/vblk-frag", FRAG_SOURCE)],
    };
    match LAYER.get_or_init(|| build(&spec)) {
        Ok(p) => p,
        Err(e) => panic!("cannot build the guest's fio layer: {e}"),
    }
}

/// The C compiler, with the hint the failure message needs.
fn compiler() -> PathBuf {
    find_program("cc").unwrap_or_else(|| {
        panic!(
            "the guest tests compile a small static C program and need `cc`: install the \
             Debian packages gcc and libc6-dev (static glibc)"
        )
    })
}

fn c_path(out: &Path) -> PathBuf {
    PathBuf::from(format!("{}.c", out.display()))
}

/// Compiles `source` into a static executable at `out`.
fn compile(source: &str, out: &Path) -> Result<(), String> {
    let src = c_path(out);
    fs::write(&src, source).map_err(|e| format!("{}: {e}", src.display()))?;
    let res = Command::new(compiler())
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(out)
        .arg(&src)
        .output()
        .map_err(|e| format!("cannot run cc: {e}"))?;
    if !res.status.success() {
        return Err(format!(
            "cc -static -O2 {} failed ({}): {}{}\n(static linking needs the Debian package \
             libc6-dev)",
            src.display(),
            res.status,
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        ));
    }
    Ok(())
}

/// Builds (unless its manifest matches the cached one) and returns the layer's archive.
pub fn build(spec: &LayerSpec<'_>) -> Result<PathBuf, String> {
    let dir = assets().dir.join(format!("layer-{}", spec.name));
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut files: Vec<(String, PathBuf, u32)> = Vec::new();
    let mut lib_dirs = BTreeSet::new();
    for (program, package, guest) in spec.programs {
        let host = require_program(program, package);
        add_with_libraries(&mut files, &mut lib_dirs, guest, &host)?;
    }

    let mut manifest = format!("{LAYER_FORMAT}\nlibpath={lib_dirs:?}\n");
    for (guest, host, mode) in &files {
        writeln!(manifest, "file {guest} {mode:o} {}", stamp(host)?).expect("string");
    }
    if !spec.c_programs.is_empty() {
        let version = Command::new(compiler())
            .arg("--version")
            .output()
            .map_err(|e| format!("cc --version: {e}"))?;
        let version = String::from_utf8_lossy(&version.stdout);
        writeln!(manifest, "cc {}", version.lines().next().unwrap_or("?")).expect("string");
        for (guest, source) in spec.c_programs {
            writeln!(manifest, "c-program {guest}\n{source}").expect("string");
        }
    }

    let archive = dir.join("layer.cpio");
    let manifest_path = dir.join("layer.manifest");
    if archive.exists() && fs::read_to_string(&manifest_path).ok().as_deref() == Some(&manifest) {
        return Ok(archive);
    }
    let mut cpio = Cpio::default();
    for (guest, host, mode) in &files {
        let data = fs::read(host).map_err(|e| format!("{}: {e}", host.display()))?;
        cpio.file(guest, *mode, &data);
    }
    for (guest, source) in spec.c_programs {
        let name = Path::new(guest)
            .file_name()
            .ok_or_else(|| format!("{guest}: no file name"))?;
        let out = dir.join(format!("{}.{}", name.to_string_lossy(), std::process::id()));
        compile(source, &out)?;
        let data = fs::read(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        let _ = fs::remove_file(&out);
        let _ = fs::remove_file(c_path(&out));
        cpio.file(guest, 0o755, &data);
    }
    let libpath: Vec<&str> = lib_dirs.iter().map(String::as_str).collect();
    cpio.file(
        &format!("etc/vblk-libpath.d/{}", spec.name),
        0o644,
        libpath.join(":").as_bytes(),
    );
    write_atomic(&archive, &cpio.finish())?;
    write_atomic(&manifest_path, manifest.as_bytes())?;
    Ok(archive)
}
