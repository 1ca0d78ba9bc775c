//! An nbdkit server on a Unix socket, for the tests of NBD disks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::assets::{find_program, require_programs};
use super::util::die_with_parent;

/// An nbdkit serving on a Unix socket; killed on drop.
pub struct Nbdkit {
    child: Child,
    /// The server's socket.
    pub sock: PathBuf,
}

impl Nbdkit {
    /// `nbdkit -U DIR/nbdkit.sock ARGS` (plugin, filters, parameters), once it listens.
    pub fn start(dir: &Path, args: &[&str]) -> Nbdkit {
        require_programs(&[("nbdkit", "nbdkit")]);
        let sock = dir.join("nbdkit.sock");
        let pidfile = dir.join("nbdkit.pid");
        // A server killed before (a restart) leaves both behind.
        let _ = std::fs::remove_file(&sock);
        let _ = std::fs::remove_file(&pidfile);
        let mut cmd = Command::new(find_program("nbdkit").expect("checked"));
        cmd.arg("-f")
            .arg("-P")
            .arg(&pidfile)
            .arg("-U")
            .arg(&sock)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().expect("cannot start nbdkit");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::metadata(&pidfile).is_ok_and(|m| m.len() > 0) {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("nbdkit {args:?} exited with {st}");
            }
            assert!(Instant::now() < deadline, "nbdkit never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nbdkit { child, sock }
    }

    /// The export's URI for `--blk-file`.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
