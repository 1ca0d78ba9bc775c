//! What the client says when the server answers `NBD_OPT_GO` with an error: the
//! `NBD_REP_ERR_*` name and the server's message, and "no export named" only for
//! `NBD_REP_ERR_UNKNOWN` with an export the server does not list. The scripted server
//! answers each way; and nbdkit itself, whose `sh` plugin fails to open the export it
//! lists (it answers `NBD_REP_ERR_UNKNOWN`, with no message).

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::server::{Server, REP_ERR_INVALID, REP_ERR_PLATFORM, REP_ERR_UNKNOWN};
use super::{open_uri, opts, secs, within, EX};

/// The error opening the default export of a server that answers GO with `rep` and
/// `message` and lists `exports`.
fn open_error(rep: u32, message: &'static str, exports: &'static [&'static str]) -> String {
    let s = Server::unix(EX, move |s| {
        let _ = s.refuse_go(rep, message, exports);
    });
    let uri = s.uri().to_owned();
    let err = within(secs(30.0), "opening the disk", move || {
        open_uri(&uri, &opts(5.0, 5.0)).err()
    });
    let err = err.expect("the disk opened");
    assert!(err.starts_with(s.uri()), "{err}");
    err
}

#[test]
fn an_unknown_export_the_server_does_not_list_is_missing() {
    let err = open_error(REP_ERR_UNKNOWN, "no such export", &["disk", "other"]);
    assert!(
        err.ends_with(
            "server offers no export named '' (exports: disk, other): it answered \
             NBD_OPT_GO with NBD_REP_ERR_UNKNOWN: \"no such export\""
        ),
        "{err}"
    );
}

#[test]
fn an_unknown_export_the_server_lists_is_not_called_missing() {
    // nbdkit 1.32 answers so when its plugin fails to open the export (an `sh` plugin
    // whose can_fua exits 3).
    let err = open_error(REP_ERR_UNKNOWN, "", &[""]);
    assert!(!err.contains("no export named"), "{err}");
    assert!(
        err.ends_with(
            "server answered NBD_OPT_GO for export '' with NBD_REP_ERR_UNKNOWN (no message), \
             though it lists that export (exports: '' (default)): it failed to open it, and \
             its log should say why"
        ),
        "{err}"
    );
}

#[test]
fn a_server_that_requires_tls_is_named_so() {
    let err = open_error(0x8000_0005, "", &[""]);
    assert!(
        err.contains("NBD_REP_ERR_TLS_REQD (the server requires TLS, which vblk does not speak"),
        "{err}"
    );
}

#[test]
fn an_empty_export_is_named_so() {
    let ex = super::server::Export { size: 0, ..EX };
    let s = Server::unix(ex, |s| {
        let _ = s.handshake();
    });
    let uri = s.uri().to_owned();
    let err = within(secs(30.0), "opening the disk", move || {
        open_uri(&uri, &opts(5.0, 5.0)).err()
    });
    let err = err.expect("an empty export was opened");
    assert!(
        err.ends_with("the export is empty (its size is 0): there is nothing to serve"),
        "{err}"
    );
}

#[test]
fn other_errors_say_the_reply_and_the_message() {
    let err = open_error(REP_ERR_PLATFORM, "can_fua: plugin failed", &[""]);
    assert!(
        err.ends_with(
            "server answered NBD_OPT_GO for export '' with NBD_REP_ERR_PLATFORM: \
             \"can_fua: plugin failed\""
        ),
        "{err}"
    );
    // No message, and an export list that would not name the export: still no "missing".
    let err = open_error(REP_ERR_INVALID, "", &["disk"]);
    assert!(
        err.ends_with(
            "server answered NBD_OPT_GO for export '' with NBD_REP_ERR_INVALID (no message)"
        ),
        "{err}"
    );
    // An unnamed error, and a message with terminal escapes: shown escaped.
    let err = open_error((1 << 31) | 77, "bad\u{1b}[2J\nthing", &[]);
    assert!(
        err.ends_with(
            "server answered NBD_OPT_GO for export '' with reply type 0x8000004d: \
             \"bad\\u{1b}[2J\\nthing\""
        ),
        "{err}"
    );
}

/// `nbdkit -f -U SOCK ARGS`, killed and reaped on drop. A missing nbdkit fails the test
/// with the Debian package to install.
struct Nbdkit(Child);

impl Nbdkit {
    fn start(sock: &std::path::Path, args: &[&str]) -> Nbdkit {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let nbdkit = std::env::split_paths(&path)
            .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
            .map(|d| d.join("nbdkit"))
            .find(|p| p.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "nbdkit is not installed: this test needs it as a real NBD server. \
                     Install the Debian package nbdkit (`apt-get install nbdkit`; scripts/test \
                     does this)"
                )
            });
        let mut child = Command::new(nbdkit)
            .arg("-f")
            .arg("-U")
            .arg(sock)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nbdkit");
        let start = Instant::now();
        while !sock.exists() {
            if let Ok(Some(st)) = child.try_wait() {
                panic!("nbdkit exited with {st} before listening");
            }
            assert!(start.elapsed() < secs(20.0), "nbdkit never listened");
            std::thread::sleep(secs(0.02));
        }
        Nbdkit(child)
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn nbdkit_failing_to_open_its_export_is_not_called_missing() {
    let dir = tempfile::tempdir().unwrap();
    // A writable export (so nbdkit asks can_fua) whose can_fua exits 3, which is invalid
    // for it: nbdkit cannot open the export. Other methods exit 2, "not implemented".
    let script = dir.path().join("plugin.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\ncase \"$1\" in\n  get_size) echo 1M ;;\n  can_write) exit 0 ;;\n  can_fua) exit 3 ;;\n  *) exit 2 ;;\nesac\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("nbdkit.sock");
    let _server = Nbdkit::start(&sock, &["sh", &script.display().to_string()]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let Err(err) = open_uri(&uri, &opts(5.0, 5.0)) else {
        panic!("the disk opened");
    };
    assert!(!err.contains("no export named"), "{err}");
    assert!(
        err.contains("server answered NBD_OPT_GO for export '' with NBD_REP_ERR_UNKNOWN")
            && err.contains("though it lists that export"),
        "{err}"
    );
}
