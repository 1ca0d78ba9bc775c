//! The guest's assets: an uncompressed `vmlinux` extracted from the
//! distribution's bzImage and a base `initramfs.cpio` holding the guest
//! `/init`, a static busybox, the virtio and ext4 modules (with their
//! dependencies from `modules.dep`) and a few dynamically linked
//! e2fsprogs/util-linux tools with their libraries. They are built once and
//! cached under `<target dir>/guest-assets/<kernel version>/`.
//!
//! Also here: the host tools that building them (and booting) needs, and the
//! `newc` cpio writer that builds the base and the per-boot archives.
//!
//! Nothing here skips: a missing tool is a test failure that names the Debian
//! package to install.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Bump when the layout of the cached assets or `/init` changes in a way that
/// the manifest below would not notice.
const ASSET_FORMAT: &str = "vblk-guest-assets v1";

/// Modules the guest needs, loaded with their dependencies (from
/// `modules.dep`) in this order. `crc32c_generic` is a soft dependency of
/// ext4/jbd2 (metadata checksums) that the guest cannot modprobe by alias.
const GUEST_MODULES: &[&str] = &["crc32c_generic", "virtio_pci", "virtio_blk", "ext4"];

/// Dynamically linked tools copied into the guest, with the package that
/// ships them. Busybox has applets of the same names but they lack options
/// we need (`blkdiscard -z`) or are not the real thing (mke2fs, e2fsck).
const GUEST_TOOLS: &[(&str, &str)] = &[
    ("mke2fs", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("blkdiscard", "util-linux"),
];

/// Where the guest finds the tools above (busybox applets shadow bare names).
pub const GUEST_ENV: &str =
    "MKE2FS=/usr/sbin/mke2fs E2FSCK=/usr/sbin/e2fsck BLKDISCARD=/usr/sbin/blkdiscard";

/// The `/init` of the guest. `/vblk/` is filled by the per-boot archive.
const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /mnt
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin:/sbin:/usr/sbin
LD_LIBRARY_PATH="$(cat /etc/vblk-libpath)"
# Extra layers (see `support::layer`) add their library directories here.
for f in /etc/vblk-libpath.d/*; do
    [ -f "$f" ] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(cat "$f")"
done
export LD_LIBRARY_PATH
echo "VBLK-BOOT kernel=$(uname -r) uptime=$(cut -d' ' -f1 /proc/uptime) cpus=$(nproc)"
while read -r m; do
    insmod "/lib/modules/vblk/$m.ko" || echo "VBLK-WARN insmod $m failed"
done < /lib/modules/vblk/order
# Errors (I/O errors, oopses) still reach the serial log, chatter does not.
echo 4 > /proc/sys/kernel/printk
want="$(cat /vblk/disks)"
i=0
while :; do
    missing=""
    for d in $want; do [ -b "/dev/$d" ] || missing="$missing $d"; done
    [ -z "$missing" ] && break
    i=$((i + 1))
    [ $i -ge 200 ] && break
    sleep 0.1
done
if [ -z "$missing" ]; then
    echo "VBLK-CHECK guest-disks ok $want"
else
    echo "VBLK-CHECK guest-disks fail missing:$missing; present: $(ls /sys/block | tr '\n' ' ')"
fi
echo "VBLK-SCRIPT-START uptime=$(cut -d' ' -f1 /proc/uptime)"
sh /vblk/test.sh
echo "VBLK-SCRIPT-EXIT $? uptime=$(cut -d' ' -f1 /proc/uptime)"
sync
echo VBLK-DONE
poweroff -f
sleep 30
"#;

// ---------------------------------------------------------------------------
// Host tools

/// Finds an executable in `PATH` and the sbin directories (which a non-root
/// `PATH` often lacks).
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| {
            fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// Panics, naming the Debian packages to install, unless every `(program,
/// package)` pair is present.
pub fn require_programs(programs: &[(&str, &str)]) {
    let missing: Vec<String> = programs
        .iter()
        .filter(|(prog, _)| find_program(prog).is_none())
        .map(|(prog, pkg)| format!("`{prog}` (Debian package {pkg})"))
        .collect();
    assert!(
        missing.is_empty(),
        "the guest test needs programs that are not installed: {}; install them, e.g. \
         `apt-get install -y qemu-system-x86 qemu-system-common linux-image-amd64 busybox-static \
         e2fsprogs util-linux xz-utils`",
        missing.join(", ")
    );
}

pub fn require_program(name: &str, package: &str) -> PathBuf {
    require_programs(&[(name, package)]);
    find_program(name).expect("checked above")
}

/// Adds the host program `host` as `guest` (a path in the guest, without the leading
/// `/`) to `files`, with every shared library `ldd` names (at their host paths), and
/// records the libraries' directories in `lib_dirs` (for `LD_LIBRARY_PATH`).
pub fn add_with_libraries(
    files: &mut Vec<(String, PathBuf, u32)>,
    lib_dirs: &mut BTreeSet<String>,
    guest: &str,
    host: &Path,
) -> Result<(), String> {
    require_programs(&[("ldd", "libc-bin")]);
    files.push((guest.to_string(), host.to_path_buf(), 0o755));
    let out = Command::new("ldd")
        .arg(host)
        .output()
        .map_err(|e| format!("ldd: {e}"))?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(lib) = line.split_whitespace().find(|t| t.starts_with('/')) else {
            continue;
        };
        let lib = lib.trim_start_matches('/').to_string();
        if let Some(parent) = Path::new(&lib).parent() {
            lib_dirs.insert(format!("/{}", parent.display()));
        }
        if !files.iter().any(|(g, _, _)| *g == lib) {
            files.push((lib.clone(), PathBuf::from(format!("/{lib}")), 0o755));
        }
    }
    Ok(())
}

/// Is `data` a dynamically linked ELF file (has a PT_INTERP header)?
fn elf_is_dynamic(data: &[u8]) -> Option<bool> {
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into().ok()?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let p_type = u32::from_le_bytes(data.get(off..off + 4)?.try_into().ok()?);
        if p_type == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// Feeds `input` to `program args` and returns its stdout (even when it exits
/// non-zero, e.g. gzip's "trailing garbage" warning; the caller validates).
fn filter(program: &Path, args: &[&str], input: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    let mut stdin = child.stdin.take().expect("piped");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        // A decompressor may stop reading early; that is not an error here.
        let _ = stdin.write_all(&input);
    });
    let mut out = Vec::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut err)
        .map_err(|e| e.to_string())?;
    let status = child.wait().map_err(|e| e.to_string())?;
    writer.join().expect("writer thread");
    if out.is_empty() {
        return Err(format!(
            "{} {args:?} produced nothing ({status}): {err}",
            program.display()
        ));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Assets

/// The cached guest kernel and base initramfs.
#[derive(Debug, Clone)]
pub struct Assets {
    pub kernel_version: String,
    pub vmlinux: PathBuf,
    pub initramfs: PathBuf,
    pub dir: PathBuf,
}

/// `<target dir>` of this build (parent of `CARGO_TARGET_TMPDIR`).
pub fn target_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).to_path_buf()
}

/// Builds (once per process, cached on disk across runs) and returns the
/// guest assets. Panics with a clear message when something is missing.
pub fn assets() -> &'static Assets {
    static ASSETS: OnceLock<Result<Assets, String>> = OnceLock::new();
    match ASSETS.get_or_init(build_assets) {
        Ok(a) => a,
        Err(e) => panic!("cannot build the guest assets: {e}"),
    }
}

fn version_key(v: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = v;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            key.push((rest[..digits].parse().unwrap_or(u64::MAX), String::new()));
            rest = &rest[digits..];
        } else {
            let n = rest.len() - rest.trim_start_matches(|c: char| !c.is_ascii_digit()).len();
            key.push((0, rest[..n].to_string()));
            rest = &rest[n..];
        }
    }
    key
}

/// Picks the guest kernel: `$VBLK_GUEST_KERNEL` (a version in /boot) or the
/// newest `/boot/vmlinuz-*` that has its modules installed.
fn pick_kernel() -> Result<(String, PathBuf), String> {
    let hint = "install the Debian package linux-image-amd64";
    if let Ok(v) = std::env::var("VBLK_GUEST_KERNEL") {
        let p = PathBuf::from(format!("/boot/vmlinuz-{v}"));
        return if p.exists() {
            Ok((v, p))
        } else {
            Err(format!("VBLK_GUEST_KERNEL: {} not found", p.display()))
        };
    }
    let mut found = Vec::new();
    for entry in fs::read_dir("/boot").map_err(|e| format!("/boot: {e}; {hint}"))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(v) = name.strip_prefix("vmlinuz-") {
            if Path::new(&format!("/lib/modules/{v}/modules.dep")).exists() {
                found.push(v.to_string());
            }
        }
    }
    found.sort_by_key(|v| version_key(v));
    let v = found
        .pop()
        .ok_or_else(|| format!("no /boot/vmlinuz-* with /lib/modules/*/modules.dep; {hint}"))?;
    let p = PathBuf::from(format!("/boot/vmlinuz-{v}"));
    Ok((v, p))
}

/// What identifies a host file's version in a manifest: path, length and mtime.
pub fn stamp(path: &Path) -> Result<String, String> {
    let m = fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mtime = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    Ok(format!(
        "{} len={} mtime={:?}",
        path.display(),
        m.len(),
        mtime.map(|d| d.as_secs())
    ))
}

/// Writes `data` to `path` atomically (other test processes may race us).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), String> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let tmp = path.with_extension(format!(
        "tmp.{}.{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    fs::write(&tmp, data).map_err(|e| format!("{}: {e}", tmp.display()))?;
    fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

fn build_assets() -> Result<Assets, String> {
    let (kver, vmlinuz) = pick_kernel()?;
    let dir = target_dir().join("guest-assets").join(&kver);
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;

    // QEMU boots an ELF vmlinux through its PVH entry point; without one
    // (CONFIG_PVH unset) boot the bzImage, which decompresses itself (slower).
    let config = fs::read_to_string(format!("/boot/config-{kver}")).unwrap_or_default();
    if !config.is_empty() && !config.lines().any(|l| l == "CONFIG_PVH=y") {
        let (manifest, build) = plan_initramfs(&kver)?;
        let initramfs = cached_initramfs(&dir, &manifest, build)?;
        return Ok(Assets {
            kernel_version: kver,
            vmlinux: vmlinuz,
            initramfs,
            dir,
        });
    }

    let vmlinux = dir.join("vmlinux");
    let vstamp = format!("{ASSET_FORMAT}\n{}\n", stamp(&vmlinuz)?);
    let vstamp_path = dir.join("vmlinux.stamp");
    if !vmlinux.exists() || fs::read_to_string(&vstamp_path).ok().as_deref() != Some(&vstamp) {
        let image = fs::read(&vmlinuz).map_err(|e| {
            format!(
                "cannot read {} ({e}); the guest test must be able to read the kernel image",
                vmlinuz.display()
            )
        })?;
        let elf = extract_vmlinux(&image)?;
        write_atomic(&vmlinux, &elf)?;
        write_atomic(&vstamp_path, vstamp.as_bytes())?;
    }

    let (manifest, build) = plan_initramfs(&kver)?;
    let initramfs = cached_initramfs(&dir, &manifest, build)?;
    Ok(Assets {
        kernel_version: kver,
        vmlinux,
        initramfs,
        dir,
    })
}

/// Returns `dir/initramfs.cpio`, rebuilt first unless its manifest matches.
fn cached_initramfs(dir: &Path, manifest: &str, build: BuildFn) -> Result<PathBuf, String> {
    let initramfs = dir.join("initramfs.cpio");
    let manifest_path = dir.join("initramfs.manifest");
    if !initramfs.exists() || fs::read_to_string(&manifest_path).ok().as_deref() != Some(manifest) {
        let cpio = build()?;
        write_atomic(&initramfs, &cpio)?;
        write_atomic(&manifest_path, manifest.as_bytes())?;
    }
    Ok(initramfs)
}

/// Extracts the uncompressed ELF kernel from a bzImage, so that QEMU boots it
/// through PVH and skips the (slow under TCG) self-decompression.
fn extract_vmlinux(image: &[u8]) -> Result<Vec<u8>, String> {
    if image.starts_with(b"\x7fELF") {
        return Ok(image.to_vec());
    }
    if image.len() < 0x250 || &image[0x202..0x206] != b"HdrS" {
        return Err("the kernel image is not a bzImage (no HdrS header)".into());
    }
    let version = u16::from_le_bytes([image[0x206], image[0x207]]);
    if version < 0x208 {
        return Err(format!("boot protocol {version:#x} has no payload fields"));
    }
    let setup_sects = match image[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let le32 = |o: usize| u32::from_le_bytes(image[o..o + 4].try_into().expect("4 bytes")) as usize;
    let start = (setup_sects + 1) * 512 + le32(0x248);
    // The payload ends with the 4-byte uncompressed size appended by the build.
    let len = le32(0x24c).checked_sub(4).ok_or("empty payload")?;
    let payload = image
        .get(start..start + len)
        .ok_or("payload outside the image")?;
    let (tool, package, args): (&str, &str, &[&str]) = match payload {
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => ("xz", "xz-utils", &["-dc", "--single-stream"]),
        [0x1f, 0x8b, ..] => ("gzip", "gzip", &["-dc"]),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => ("zstd", "zstd", &["-dcq"]),
        [0x02, 0x21, 0x4c, 0x18, ..] => ("lz4", "lz4", &["-dc"]),
        [b'B', b'Z', b'h', ..] => ("bzip2", "bzip2", &["-dc"]),
        [0x5d, 0, 0, ..] => ("xz", "xz-utils", &["-dc", "--format=lzma"]),
        [0x89, b'L', b'Z', b'O', ..] => ("lzop", "lzop", &["-dc"]),
        _ => {
            return Err(format!(
                "unknown kernel compression (magic {:02x?})",
                &payload[..8.min(payload.len())]
            ))
        }
    };
    let elf = filter(&require_program(tool, package), args, payload)?;
    if !elf.starts_with(b"\x7fELF") {
        return Err(format!("{tool} did not produce an ELF vmlinux"));
    }
    Ok(elf)
}

type BuildFn = Box<dyn FnOnce() -> Result<Vec<u8>, String>>;

/// Returns the manifest of the base initramfs (what it is made of, to decide
/// whether the cached one is current) and a closure that builds it.
fn plan_initramfs(kver: &str) -> Result<(String, BuildFn), String> {
    // Static busybox.
    let busybox = ["/usr/bin/busybox", "/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .chain(find_program("busybox"))
        .find(|p| fs::read(p).ok().and_then(|d| elf_is_dynamic(&d)) == Some(false))
        .ok_or("no statically linked busybox found; install the Debian package busybox-static")?;

    // Files copied from the host: (guest path, host path, mode).
    let mut files: Vec<(String, PathBuf, u32)> = vec![("bin/busybox".into(), busybox, 0o755)];
    let mut lib_dirs = BTreeSet::new();
    for (tool, package) in GUEST_TOOLS {
        let host = require_program(tool, package);
        add_with_libraries(
            &mut files,
            &mut lib_dirs,
            &format!("usr/sbin/{tool}"),
            &host,
        )?;
    }
    if Path::new("/etc/mke2fs.conf").exists() {
        files.push(("etc/mke2fs.conf".into(), "/etc/mke2fs.conf".into(), 0o644));
    }

    // Kernel modules, dependencies first.
    let moddir = PathBuf::from(format!("/lib/modules/{kver}"));
    let dep =
        fs::read_to_string(moddir.join("modules.dep")).map_err(|e| format!("modules.dep: {e}"))?;
    let builtin = fs::read_to_string(moddir.join("modules.builtin")).unwrap_or_default();
    let modname = |p: &str| {
        let file = p.rsplit('/').next().unwrap_or(p);
        file.split(".ko").next().unwrap_or(file).replace('-', "_")
    };
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in dep.lines() {
        if let Some((m, d)) = line.split_once(':') {
            deps.insert(
                modname(m),
                (m.to_string(), d.split_whitespace().map(modname).collect()),
            );
        }
    }
    let builtin: BTreeSet<String> = builtin.lines().map(modname).collect();
    let mut order: Vec<String> = Vec::new();
    fn visit(
        m: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        builtin: &BTreeSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), String> {
        if order.iter().any(|o| o == m) || builtin.contains(m) {
            return Ok(());
        }
        let (_, ds) = deps
            .get(m)
            .ok_or_else(|| format!("kernel module {m} is neither in modules.dep nor built in"))?;
        for d in ds {
            visit(d, deps, builtin, order)?;
        }
        order.push(m.to_string());
        Ok(())
    }
    for m in GUEST_MODULES {
        visit(m, &deps, &builtin, &mut order)?;
    }
    let modules: Vec<(String, PathBuf)> = order
        .iter()
        .map(|m| (m.clone(), moddir.join(&deps[m].0)))
        .collect();

    let mut manifest = format!("{ASSET_FORMAT}\n{INIT_SCRIPT}\nlibpath={lib_dirs:?}\n");
    for (guest, host, mode) in &files {
        writeln!(manifest, "file {guest} {mode:o} {}", stamp(host)?).expect("string");
    }
    for (m, path) in &modules {
        writeln!(manifest, "module {m} {}", stamp(path)?).expect("string");
    }

    let build = move || -> Result<Vec<u8>, String> {
        let mut cpio = Cpio::default();
        for d in [
            "dev",
            "proc",
            "sys",
            "tmp",
            "mnt",
            "etc",
            "vblk",
            "lib/modules/vblk",
        ] {
            cpio.dir(d);
        }
        cpio.node("dev/console", 0o020600, 5, 1);
        cpio.file("init", 0o755, INIT_SCRIPT.as_bytes());
        let libpath: Vec<&str> = lib_dirs.iter().map(String::as_str).collect();
        cpio.file("etc/vblk-libpath", 0o644, libpath.join(":").as_bytes());
        for (guest, host, mode) in &files {
            let data = fs::read(host).map_err(|e| format!("{}: {e}", host.display()))?;
            cpio.file(guest, *mode, &data);
        }
        for (m, path) in &modules {
            let p = path.to_string_lossy();
            let data = if p.ends_with(".ko") {
                fs::read(path).map_err(|e| format!("{p}: {e}"))?
            } else {
                let (tool, package) = match p.rsplit('.').next() {
                    Some("xz") => ("xz", "xz-utils"),
                    Some("zst") => ("zstd", "zstd"),
                    Some("gz") => ("gzip", "gzip"),
                    _ => return Err(format!("unknown module compression: {p}")),
                };
                let raw = fs::read(path).map_err(|e| format!("{p}: {e}"))?;
                filter(&require_program(tool, package), &["-dc"], &raw)?
            };
            cpio.file(&format!("lib/modules/vblk/{m}.ko"), 0o644, &data);
        }
        cpio.file(
            "lib/modules/vblk/order",
            0o644,
            (order.join("\n") + "\n").as_bytes(),
        );
        Ok(cpio.finish())
    };
    Ok((manifest, Box::new(build)))
}

/// A writer of `newc` cpio archives, the format the kernel unpacks.
#[derive(Default)]
pub struct Cpio {
    buf: Vec<u8>,
    ino: u32,
    dirs: BTreeSet<String>,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0,
            0,
            nlink,
            0,
            data.len() as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        self.buf.resize(self.buf.len().next_multiple_of(4), 0);
    }

    fn parents(&mut self, path: &str) {
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
    }

    /// A directory (and its parents).
    pub fn dir(&mut self, path: &str) {
        let path = path.trim_matches('/');
        if path.is_empty() || self.dirs.contains(path) {
            return;
        }
        self.parents(path);
        self.dirs.insert(path.to_string());
        self.entry(path, 0o040755, (0, 0), &[]);
    }

    /// A regular file (parents are created).
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) {
        let path = path.trim_start_matches('/');
        self.parents(path);
        self.entry(path, 0o100000 | perm, (0, 0), data);
    }

    /// A device node; `mode` includes the file type bits.
    pub fn node(&mut self, path: &str, mode: u32, major: u32, minor: u32) {
        let path = path.trim_start_matches('/');
        self.parents(path);
        self.entry(path, mode, (major, minor), &[]);
    }

    /// Ends the archive and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.buf
    }
}
