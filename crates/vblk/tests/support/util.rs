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
