//! Small helpers the end-to-end tests share.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

/// Run `f` on its own thread and fail the test if it does not finish within `limit`, so
/// that a hang is a failure, not a stuck test run. Children (daemons) stay owned by the
/// caller, so they are killed even when `f` is stuck.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) | Err(RecvTimeoutError::Disconnected) => {
            h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
        }
        Err(RecvTimeoutError::Timeout) => panic!("{what} did not finish within {limit:?}: hung"),
    }
}

/// A temporary directory under the target dir (not /tmp, which may be tmpfs: images
/// should live on a real file system, and O_DIRECT must work there).
pub fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

/// Make the child `cmd` starts die with the test process (SIGKILL on parent death), so a
/// test that is killed or panics never leaves a daemon behind.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
    // which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Bytes of a sector.
pub const SECTOR_BYTES: usize = 512;
/// First bytes of a stamped sector.
pub const MAGIC: &[u8; 4] = b"VBLK";

/// Fill `buf` with the stamped sectors of write `id` that start at sector `lba`.
pub fn stamp(buf: &mut [u8], id: u32, lba: u64) {
    for (i, s) in buf.chunks_exact_mut(SECTOR_BYTES).enumerate() {
        stamp_sector(s, id, lba + i as u64);
    }
}

/// A stamped sector: magic, write id, its own sector number, then words that follow from
/// those two, so any misplaced, stale or torn sector is recognised and named.
pub fn stamp_sector(s: &mut [u8], id: u32, lba: u64) {
    s[..4].copy_from_slice(MAGIC);
    s[4..8].copy_from_slice(&id.to_le_bytes());
    s[8..16].copy_from_slice(&lba.to_le_bytes());
    let mut x = ((u64::from(id) << 40) ^ lba).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for w in s[16..].chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
}

/// Run `cmd` to its end with stdout and stderr captured, failing the test if it is still
/// running after `limit` (it is then killed). For commands that are expected to give up
/// at once, such as a daemon refusing its disk.
pub fn run_to_exit(mut cmd: Command, limit: Duration) -> std::process::Output {
    use std::process::Stdio;
    use std::time::Instant;

    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let what = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!(
                "{what} was still running after {limit:?} (killed); its stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("wait")
}

/// In a model of a disk (one `u32` per sector): the sector was discarded, and may read as
/// zeroes or as the write id in the other bits. 0 means zeroes, any other id `stamp(id, lba)`.
pub const DISCARDED: u32 = 1 << 31;

static ZERO_SECTOR: [u8; SECTOR_BYTES] = [0; SECTOR_BYTES];

/// None if every sector of `got`, which starts at sector `lba`, is what `model` says (see
/// [`DISCARDED`]); else the first sector that is not, what it holds and how many more differ.
pub fn check_stamped(got: &[u8], model: &[u32], lba: u64) -> Option<String> {
    let mut want = [0u8; SECTOR_BYTES];
    let mut bad = got
        .chunks(SECTOR_BYTES)
        .zip(model)
        .enumerate()
        .filter(|&(i, (g, &m))| {
            let id = m & !DISCARDED;
            if g == ZERO_SECTOR && (id == 0 || m & DISCARDED != 0) {
                return false;
            }
            if id == 0 {
                return true;
            }
            stamp_sector(&mut want, id, lba + i as u64);
            g != want
        });
    let (i, (g, &m)) = bad.next()?;
    let more = bad.count();
    let expected = match (m & !DISCARDED, m & DISCARDED != 0) {
        (0, _) => "zeroes".to_string(),
        (id, false) => format!("write #{id:#x}"),
        (id, true) => format!("zeroes or write #{id:#x} (discarded)"),
    };
    let at = lba + i as u64;
    let found = describe_sector(g);
    Some(format!(
        "sector {at} (and {more} more) holds {found}, expected {expected}"
    ))
}

/// What a sector holds, in words: zeroes, a write's stamp for some sector, or other bytes.
pub fn describe_sector(s: &[u8]) -> String {
    if s == ZERO_SECTOR {
        return "zeroes".into();
    }
    if &s[..4] != MAGIC {
        return format!("unstamped bytes {:02x?}...", &s[..16]);
    }
    let id = u32::from_le_bytes(s[4..8].try_into().unwrap());
    let lba = u64::from_le_bytes(s[8..16].try_into().unwrap());
    let mut want = [0u8; SECTOR_BYTES];
    stamp_sector(&mut want, id, lba);
    let what = if want[..] == *s {
        "data"
    } else {
        "header on a corrupt sector"
    };
    format!("write #{id:#x}'s {what} for sector {lba}")
}

/// xorshift64: deterministic, so a failure reproduces.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In 0..n.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Run a QEMU tool (`qemu-img`, `qemu-io`) in `dir`; it must succeed. A missing tool is a
/// failure that names the package.
pub fn qemu_tool(dir: &std::path::Path, program: &str, args: &[&str]) {
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
