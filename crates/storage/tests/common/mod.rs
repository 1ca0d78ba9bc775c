//! Helpers shared by the storage integration tests.
#![allow(dead_code)]

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use vblk_storage::{Backend, CacheMode, Completion, DiskSpec, Engine, EngineKind, Op, OpenOptions};

/// tmpfs has no O_DIRECT before Linux 6.6 and no real block allocation, so the
/// tests' files live in the target dir (or /var/tmp), never on tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;

pub fn is_tmpfs(path: &Path) -> bool {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statfs is plain old data; all-zero is valid.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a live out-parameter.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == TMPFS_MAGIC
}

/// A fresh directory on a real file system.
pub fn scratch() -> tempfile::TempDir {
    for base in [env!("CARGO_TARGET_TMPDIR"), "/var/tmp"] {
        let base = Path::new(base);
        if std::fs::create_dir_all(base).is_ok() && !is_tmpfs(base) {
            return tempfile::Builder::new()
                .prefix("vblk-storage-")
                .tempdir_in(base)
                .unwrap();
        }
    }
    panic!("no directory outside tmpfs for the tests' files");
}

/// xorshift64*: a small deterministic generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
}

/// Creates `name` in `dir` with `size` random bytes.
pub fn make_file(dir: &Path, name: &str, size: usize, seed: u64) -> PathBuf {
    let path = dir.join(name);
    let mut data = vec![0u8; size];
    Rng::new(seed).fill(&mut data);
    std::fs::write(&path, &data).unwrap();
    path
}

pub fn open(path: &Path, cache: CacheMode, read_only: bool) -> Arc<Backend> {
    let opts = OpenOptions {
        read_only,
        cache,
        prealloc: false,
        ..Default::default()
    };
    Arc::new(Backend::open(&DiskSpec::File(path.to_owned()), &opts).unwrap())
}

/// An engine of `kind` on a file backend; its name is the kind's.
pub fn engine(backend: &Arc<Backend>, kind: EngineKind, depth: u32) -> Box<dyn Engine> {
    let e = backend.engine(kind, depth).unwrap();
    assert_eq!(e.name(), kind.to_string());
    e
}

/// The cache mode a test asking for `want` runs `kind` with: aio needs O_DIRECT.
pub fn cache_for(kind: EngineKind, want: CacheMode) -> CacheMode {
    match kind {
        EngineKind::Aio => CacheMode::None,
        _ => want,
    }
}

/// Whether `kind` hands work to a kernel queue that can refuse it (EAGAIN).
pub fn kernel_queue(kind: EngineKind) -> bool {
    matches!(kind, EngineKind::IoUring | EngineKind::Aio)
}

pub fn has_o_direct(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on a descriptor the backend keeps open.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert!(flags >= 0);
    flags & libc::O_DIRECT != 0
}

pub fn st_blocks(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks()
}

/// A buffer whose address is `misalign` bytes past a 4096-byte boundary.
pub struct Buf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    pub fn new(len: usize, misalign: usize) -> Self {
        let storage = vec![0u8; len + 4096 + misalign];
        let base = storage.as_ptr() as usize;
        let start = (4096 - base % 4096) % 4096 + misalign;
        Buf {
            storage,
            start,
            len,
        }
    }
    pub fn with_data(data: &[u8], misalign: usize) -> Self {
        let mut b = Buf::new(data.len(), misalign);
        b.as_mut_slice().copy_from_slice(data);
        b
    }
    pub fn as_slice(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
    pub fn iovec(&mut self) -> libc::iovec {
        libc::iovec {
            iov_base: self.as_mut_slice().as_mut_ptr().cast(),
            iov_len: self.len,
        }
    }
}

/// Splits `len` into up to `parts` pieces at random points (each piece >= 1 byte).
pub fn split(rng: &mut Rng, len: usize, parts: usize) -> Vec<usize> {
    if len < 2 || parts < 2 {
        return vec![len];
    }
    let mut cuts: Vec<usize> = (0..parts.saturating_sub(1))
        .map(|_| 1 + rng.below(len as u64 - 1) as usize)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in cuts.into_iter().chain([len]) {
        out.push(c - prev);
        prev = c;
    }
    out
}

/// Pushes `ops`, submits them and waits for all of them; returns the completions
/// ordered by token.
///
/// # Safety
/// Every buffer the ops name stays valid until this returns.
pub unsafe fn run(engine: &mut dyn Engine, ops: &[(u64, Op)]) -> Vec<Completion> {
    for &(token, op) in ops {
        // SAFETY: the caller keeps the buffers valid until every op is reaped here.
        unsafe { engine.push(token, op) }.expect("engine full");
    }
    engine.submit().unwrap();
    let mut out = Vec::new();
    while out.len() < ops.len() {
        engine.reap(&mut |c| out.push(c));
        if out.len() < ops.len() {
            engine.wait().unwrap();
        }
    }
    assert_eq!(engine.in_flight(), 0);
    out.sort_by_key(|c| c.token);
    out
}

/// One op, run to completion; its result.
///
/// # Safety
/// As for [`run`].
pub unsafe fn run1(engine: &mut dyn Engine, op: Op) -> std::io::Result<u64> {
    // SAFETY: forwarded.
    let mut c = unsafe { run(engine, &[(7, op)]) };
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].token, 7);
    c.pop().unwrap().result
}

/// Writes `data` at `offset` from buffers split into `parts` iovecs, each
/// `misalign` bytes off a page boundary.
pub fn write(
    engine: &mut dyn Engine,
    offset: u64,
    data: &[u8],
    lens: &[usize],
    misalign: usize,
    durable: bool,
) -> std::io::Result<u64> {
    let mut bufs = Vec::new();
    let mut at = 0;
    for &len in lens {
        bufs.push(Buf::with_data(&data[at..at + len], misalign));
        at += len;
    }
    assert_eq!(at, data.len());
    let iov: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let op = Op::Write {
        offset,
        iov: iov.as_ptr(),
        iovcnt: iov.len() as u32,
        durable,
    };
    // SAFETY: `bufs` and `iov` outlive the call.
    unsafe { run1(engine, op) }
}

/// Reads `sum(lens)` bytes at `offset` into buffers split as `lens`.
pub fn read(
    engine: &mut dyn Engine,
    offset: u64,
    lens: &[usize],
    misalign: usize,
) -> std::io::Result<Vec<u8>> {
    let mut bufs: Vec<Buf> = lens
        .iter()
        .map(|&len| {
            let mut b = Buf::new(len, misalign);
            b.as_mut_slice().fill(0xa5);
            b
        })
        .collect();
    let iov: Vec<libc::iovec> = bufs.iter_mut().map(Buf::iovec).collect();
    let op = Op::Read {
        offset,
        iov: iov.as_ptr(),
        iovcnt: iov.len() as u32,
    };
    // SAFETY: `bufs` and `iov` outlive the call.
    let n = unsafe { run1(engine, op) }?;
    assert_eq!(n, lens.iter().sum::<usize>() as u64);
    Ok(bufs
        .iter()
        .flat_map(|b| b.as_slice().iter().copied())
        .collect())
}

/// A loop device over a file; detached on drop.
pub struct Loop {
    pub dev: PathBuf,
}

impl Loop {
    /// Attaches `file` with `sector_size`-byte sectors. A machine that cannot make loop
    /// devices fails the test, naming what is missing: there is no skipping.
    pub fn attach(file: &Path, sector_size: u32) -> Loop {
        let need = "these tests need root, the loop driver (modprobe loop) \
                    and losetup (Debian package util-linux)";
        let out = Command::new("losetup")
            .args([
                "--find",
                "--show",
                "--sector-size",
                &sector_size.to_string(),
            ])
            .arg(file)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot make a loop device: cannot run losetup: {e}; {need}")
            });
        if !out.status.success() {
            // losetup's words, and whether /dev/loop-control (which makes loop devices) opens.
            let control = match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/loop-control")
            {
                Ok(_) => "/dev/loop-control opens".to_owned(),
                Err(e) => format!("/dev/loop-control: {e}"),
            };
            panic!(
                "cannot make a loop device ({sector_size}-byte sectors): {control}; losetup: {}; \
                 {need}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        Loop { dev: dev.into() }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// Runs a QEMU tool (qemu-img, qemu-io) in `dir`; a missing tool or a failure panics
/// with what to install or what it said.
pub fn tool(dir: &Path, program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{program} could not run ({e}): install qemu-utils (`apt-get install qemu-utils`)"
            )
        });
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img check` on the image: its exit status and what it said.
fn qemu_img_check(d: &Path, image: &str) -> (Option<i32>, String) {
    let out = std::process::Command::new("qemu-img")
        .args(["check", image])
        .current_dir(d)
        .output()
        .expect("qemu-img (qemu-utils)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

/// `qemu-img check` on the image: no errors, no leaks.
pub fn check_clean(d: &Path, image: &str) {
    let (code, text) = qemu_img_check(d, image);
    assert!(
        code == Some(0) && text.contains("No errors were found"),
        "qemu-img check {image}: exit status {code:?}\n{text}"
    );
}

/// `qemu-img check` on the image: no corruption; leaked clusters are allowed (exit
/// status 3: "waste of disk space, but no harm to data").
pub fn check_no_corruption(d: &Path, image: &str) {
    let (code, text) = qemu_img_check(d, image);
    assert!(
        matches!(code, Some(0 | 3)) && !text.contains("ERROR"),
        "qemu-img check {image}: exit status {code:?}\n{text}"
    );
}

/// `qemu-img create -f qcow2 -o OPTIONS NAME SIZE` in `dir`.
pub fn create_qcow2(dir: &Path, name: &str, options: &str, size: &str) {
    tool(
        dir,
        "qemu-img",
        &["create", "-f", "qcow2", "-o", options, name, size],
    );
}

/// Options opening a qcow2 image over the backing chain `backing` (in order).
pub fn qcow2_options(
    backing: &[&Path],
    cache: CacheMode,
    read_only: bool,
) -> vblk_storage::OpenOptions {
    let mut o = OpenOptions {
        read_only,
        cache,
        backing: backing
            .iter()
            .map(|p| vblk_storage::qcow2::BackingFile {
                path: p.to_path_buf(),
                format: None,
            })
            .collect(),
        ..OpenOptions::default()
    };
    o.image.format = Some(vblk_storage::Format::Qcow2);
    o
}
