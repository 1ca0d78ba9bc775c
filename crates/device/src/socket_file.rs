//! A listening Unix socket at a path the daemon creates: the vhost-user socket and the
//! statistics socket.
//!
//! - What is at the path before is checked: nothing, or a socket nobody listens on
//!   (`connect` refused: a daemon that died left it) is replaced; a socket someone listens
//!   on, anything that is not a socket, or a socket that cannot be probed (permission
//!   denied, ...) is refused with the reason.
//! - Permissions do not come from the umask: the socket is created owner-only (0600), or
//!   0660 with the group set to `--socket-group`, as virtiofsd's `--socket-group` does.
//!   A frontend running as another user (libvirt's qemu user) is let in by that group.
//! - At exit the path is removed only if it is still the socket the daemon made (same
//!   device and inode): a second daemon that took the path over is left alone.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Who may connect to a socket the daemon creates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SocketAccess {
    /// The group that may connect too (mode 0660); None: the owner only (0600).
    pub group: Option<String>,
}

/// Why a socket path could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another process listens there.
    #[error("socket path {0} is taken: a process listens on it (a daemon serving a disk there?)")]
    Taken(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("socket path {0} exists and is not a socket (not removed)")]
    NotASocket(PathBuf),
    /// A socket whose owner cannot be told apart from a dead one.
    #[error("socket path {path} exists and cannot be probed ({source}); not removed")]
    Unprobed {
        /// The path.
        path: PathBuf,
        /// Why `connect` failed.
        #[source]
        source: io::Error,
    },
    /// The group does not exist.
    #[error("--socket-group {0}: no such group")]
    NoGroup(String),
    /// Binding, chmod or chown failed.
    #[error("cannot listen on {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// A socket the daemon made at a path, removed when dropped if it is still ours.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// Bind a listening socket at `path` for `access`.
    pub fn bind(
        path: &Path,
        access: &SocketAccess,
    ) -> Result<(UnixListener, SocketFile), SocketError> {
        let gid = match &access.group {
            Some(g) => Some(group_id(g)?),
            None => None,
        };
        clear_stale(path)?;
        let io_err = |source| SocketError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Created with no permissions for anyone but the owner from the first instant: the
        // umask is not trusted (a 0 umask would open the socket to every local user).
        let listener = with_umask(0o177, || UnixListener::bind(path)).map_err(io_err)?;
        let meta = std::fs::symlink_metadata(path).map_err(io_err)?;
        let file = SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        };
        if let Some(gid) = gid {
            let c = CString::new(path.as_os_str().as_encoded_bytes())
                .map_err(|_| io_err(io::Error::from(io::ErrorKind::InvalidInput)))?;
            // SAFETY: lchown on a NUL-terminated path; -1 keeps the owner.
            if unsafe { libc::lchown(c.as_ptr(), u32::MAX, gid) } != 0 {
                return Err(io_err(io::Error::last_os_error()));
            }
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
                .map_err(io_err)?;
        }
        Ok((listener, file))
    }

    /// The socket someone else bound at `path` and handed to the daemon: removed when
    /// dropped, if it is still that socket.
    pub fn adopt(path: &Path) -> Result<SocketFile, SocketError> {
        let meta = std::fs::symlink_metadata(path).map_err(|source| SocketError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if !meta.file_type().is_socket() {
            return Err(SocketError::Io {
                path: path.to_path_buf(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "not a socket"),
            });
        }
        Ok(SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// Leave the socket file in place (another process serves it now).
    pub fn release(self) -> PathBuf {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so its path is read out exactly once.
        unsafe { std::ptr::read(&me.path) }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still holds the socket this daemon made.
    pub fn still_ours(&self) -> bool {
        std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && m.dev() == self.dev && m.ino() == self.ino)
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if !self.still_ours() {
            log::warn!(
                "socket {} is no longer the one this daemon made; left in place",
                self.path.display()
            );
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.path) {
            log::warn!("cannot remove the socket {}: {e}", self.path.display());
        }
    }
}

/// Remove a socket file left by a daemon that is gone; refuse anything else.
fn clear_stale(path: &Path) -> Result<(), SocketError> {
    if remove_if_stale(path)? {
        log::warn!("removing stale socket {}", path.display());
    }
    Ok(())
}

/// Remove the socket file at `path` if nobody listens on it any more (a daemon that died,
/// or one whose sandbox kept it from removing it): `Ok(true)` if removed, `Ok(false)` if
/// there was none; an error for anything else (a live socket, not a socket at all).
pub fn remove_if_stale(path: &Path) -> Result<bool, SocketError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(SocketError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(SocketError::NotASocket(path.to_path_buf()));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(SocketError::Taken(path.to_path_buf())),
        // Nobody listens.
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => std::fs::remove_file(path)
            .map(|()| true)
            .map_err(|source| SocketError::Io {
                path: path.to_path_buf(),
                source,
            }),
        Err(source) => Err(SocketError::Unprobed {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The id of group `name` (or a number).
fn group_id(name: &str) -> Result<u32, SocketError> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = CString::new(name).map_err(|_| SocketError::NoGroup(name.to_string()))?;
    // SAFETY: a zeroed group struct and a buffer for getgrnam_r to fill; `out` is set to
    // point at `grp` on success or to null.
    unsafe {
        let mut grp: libc::group = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 16384];
        let mut out: *mut libc::group = std::ptr::null_mut();
        let rc = libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out);
        if rc != 0 || out.is_null() {
            return Err(SocketError::NoGroup(name.to_string()));
        }
        Ok(grp.gr_gid)
    }
}

/// Run `f` with the process umask set to `mask`, then restore it. The daemon creates its
/// sockets before it starts serving, from one thread.
fn with_umask<T>(mask: libc::mode_t, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask has no preconditions.
    let old = unsafe { libc::umask(mask) };
    let r = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_only_by_default_and_removed_only_if_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let (l, f) = SocketFile::bind(&p, &SocketAccess::default()).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A live socket is refused; a stale one replaced.
        let e = SocketFile::bind(&p, &SocketAccess::default()).unwrap_err();
        assert!(matches!(e, SocketError::Taken(_)), "{e}");
        drop(l);
        drop(f);
        assert!(!p.exists(), "removed at the end");
        let (l, f) = SocketFile::bind(&p, &SocketAccess::default()).unwrap();
        drop(l);
        std::mem::forget(f);
        let (_l2, f2) = SocketFile::bind(&p, &SocketAccess::default()).unwrap();
        // Someone else's socket at the path now: ours is not removed over it.
        std::fs::remove_file(&p).unwrap();
        let (_l3, f3) = SocketFile::bind(&p, &SocketAccess::default()).unwrap();
        drop(f2);
        assert!(p.exists(), "not ours any more: left in place");
        drop(f3);
        assert!(!p.exists());
    }

    #[test]
    fn anything_else_in_the_way_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("file");
        std::fs::write(&p, b"data").unwrap();
        let e = SocketFile::bind(&p, &SocketAccess::default()).unwrap_err();
        assert!(matches!(e, SocketError::NotASocket(_)), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"data");
        let e = SocketFile::bind(
            &dir.path().join("g.sock"),
            &SocketAccess {
                group: Some("no-such-group-vblk".into()),
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("no such group"), "{e}");
    }

    #[test]
    fn a_group_gets_0660() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.sock");
        // SAFETY: getgid has no preconditions.
        let gid = unsafe { libc::getgid() };
        let (_l, _f) = SocketFile::bind(
            &p,
            &SocketAccess {
                group: Some(gid.to_string()),
            },
        )
        .unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o660);
        assert_eq!(m.gid(), gid);
    }
}
