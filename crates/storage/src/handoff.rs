//! Handing an image from one daemon to another: the two ends of a live migration serve
//! the same image (shared storage), and exactly one of them may write it at a time.
//!
//! A file or block device served with image locks on is either **active** (it holds
//! QEMU's write locks: byte 101, "holds write", and 201, "shares no writer") or
//! **inactive** (it holds none, writes nothing). QEMU's own block layer does the same
//! (`BDRV_O_INACTIVE`): a migration destination opens its images inactive, the source
//! inactivates them at the switchover, after draining and flushing, and the destination
//! activates them before the VM runs.
//!
//! - [`Backend::activate`] takes the locks; another active writer (the other daemon that
//!   has not let go, a QEMU, a qemu-storage-daemon) makes it fail with the message of a
//!   refused open, which names the holder. It also re-reads the size, which the other side
//!   may have changed, and drops the page cache's copy of the image (it may be stale:
//!   the other side wrote behind it).
//! - [`Backend::deactivate`] makes every completed write durable (`fdatasync`) and then
//!   releases the locks, so that the other side sees everything when it takes them.
//!
//! A qcow2 image also hands over the metadata each daemon holds in memory: the owner
//! writes and syncs it before the locks go, and reads it again after they are taken
//! (qcow2/handoff.rs).
//!
//! The write-cache setting the guest chose is state that must move with the image too:
//! QEMU carries a vhost-user-blk device's configuration space in its migration stream but
//! never tells the destination's backend. A guest that turned the cache off would then be
//! served write-back by the destination while it sends no FLUSH. So the setting is kept
//! with the image, in the extended attribute `user.vblk.writeback` of a file
//! ([`Backend::remember_writeback`], [`Backend::remembered_writeback`]); block devices
//! and network disks have nowhere to keep it (the caller says so in its log).

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use crate::backend::{Backend, BackendKind, CacheMode};
use crate::error::Error;
use crate::lock::{lock_image, Access, PERM_BASE, SHARED_BASE};

/// What a backend holds of its image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holding {
    /// Locking is off, or the disk has no image (RAM, null, NBD): nothing to hand over.
    Unlocked,
    /// It holds the write locks: it may write.
    Active,
    /// It holds no lock and must not write until it is activated.
    Inactive,
}

/// The extended attribute that keeps the guest's write-cache choice with a file.
const WRITEBACK_XATTR: &std::ffi::CStr = c"user.vblk.writeback";

impl Backend {
    /// What this backend holds of its image now.
    pub fn holding(&self) -> Holding {
        if let Some(image) = self.qcow2() {
            return image.container.holding();
        }
        *self.holding.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take the image's write locks if this backend is inactive. True if it was inactive
    /// (and is active now); an error, naming the other writer, if another user holds them.
    pub fn activate(&self) -> Result<bool, Error> {
        if let Some(image) = self.qcow2() {
            // The locks first, then the metadata, read again under them.
            if !image.container.take_locks(true)? {
                return Ok(false);
            }
            match image.hand_over(true) {
                // The size its header records now (another program may have resized it).
                Ok(size) => self.size.store(size, Ordering::Relaxed),
                Err(e) => {
                    // Not served: the locks go back, for the other daemon to take again.
                    let _ = image.container.deactivate();
                    return Err(qcow2_error(
                        self,
                        format!("taking the image over: {e} (the daemon's log tells more)"),
                    ));
                }
            }
            return Ok(true);
        }
        self.take_locks(false)
    }

    /// [`Backend::activate`] of a file: the locks, the page cache dropped, the size read
    /// again; of the file that holds a qcow2 image (`format_file`), whose size need not be
    /// a whole number of sectors.
    fn take_locks(&self, format_file: bool) -> Result<bool, Error> {
        let mut h = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        if *h != Holding::Inactive {
            return Ok(false);
        }
        let (Some(file), Some(path)) = (self.file.as_ref(), self.path()) else {
            return Ok(false);
        };
        if let Err(e) = lock_image(file, Access::vblk(self.read_only())) {
            // Drop what was taken before the conflict was found.
            let _ = unlock(file);
            return Err(e.into_error(path));
        }
        *h = Holding::Active;
        drop(h);
        if self.cache() == CacheMode::Writeback {
            // SAFETY: posix_fadvise on our own descriptor; it takes no pointers.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        if format_file {
            // The qcow2 layer reads the file's size as it needs it; this is for stats (a
            // block device's does not change under it).
            if let (BackendKind::File, Ok(m)) = (self.kind(), file.metadata()) {
                self.size.store(m.len(), Ordering::Relaxed);
            }
        } else if let Err(e) = self.refresh_size(true) {
            log::warn!("activating {}: {e}", path.display());
        }
        Ok(true)
    }

    /// Make completed writes durable and release the write locks, if this backend is
    /// active. True if it was active (and is inactive now).
    pub fn deactivate(&self) -> Result<bool, Error> {
        if let Some(image) = self.qcow2() {
            if image.container.holding() != Holding::Active {
                return Ok(false);
            }
            // Everything durable before the locks go.
            image
                .hand_over(false)
                .map_err(|e| qcow2_error(self, format!("handing the image over: {e}")))?;
            return image.container.deactivate();
        }
        let mut h = self.holding.lock().unwrap_or_else(|p| p.into_inner());
        if *h != Holding::Active {
            return Ok(false);
        }
        let (Some(file), Some(path)) = (self.file.as_ref(), self.path()) else {
            return Ok(false);
        };
        let io_err = |op, source| Error::Io {
            path: path.to_owned(),
            op,
            source,
        };
        if !self.read_only() {
            file.sync_data().map_err(|e| io_err("fdatasync", e))?;
        }
        unlock(file).map_err(|e| io_err("fcntl(F_OFD_SETLK, F_UNLCK)", e))?;
        *h = Holding::Inactive;
        Ok(true)
    }

    /// Keep the guest's write-cache choice with the image (files only; false when there
    /// is nowhere to keep it, or the file system refuses extended attributes).
    pub fn remember_writeback(&self, writeback: bool) -> bool {
        if let Some(image) = self.qcow2() {
            return image.container.remember_writeback(writeback);
        }
        let Some(file) = self
            .file
            .as_ref()
            .filter(|_| self.kind() == BackendKind::File)
        else {
            return false;
        };
        let v: &[u8] = if writeback { b"1" } else { b"0" };
        // SAFETY: fsetxattr on our own descriptor with a NUL-terminated name and a live
        // value buffer of its length.
        let rc = unsafe {
            libc::fsetxattr(
                file.as_raw_fd(),
                WRITEBACK_XATTR.as_ptr(),
                v.as_ptr().cast(),
                v.len(),
                0,
            )
        };
        if rc != 0 {
            log::warn!(
                "cannot keep the guest's write-cache setting with the image (xattr {}): {}",
                WRITEBACK_XATTR.to_string_lossy(),
                io::Error::last_os_error()
            );
        }
        rc == 0
    }

    /// The write-cache choice kept with the image, if any.
    pub fn remembered_writeback(&self) -> Option<bool> {
        if let Some(image) = self.qcow2() {
            return image.container.remembered_writeback();
        }
        let file = self
            .file
            .as_ref()
            .filter(|_| self.kind() == BackendKind::File)?;
        let mut v = [0u8; 4];
        // SAFETY: fgetxattr into a live local buffer of its length, on our own descriptor.
        let n = unsafe {
            libc::fgetxattr(
                file.as_raw_fd(),
                WRITEBACK_XATTR.as_ptr(),
                v.as_mut_ptr().cast(),
                v.len(),
            )
        };
        match (n, v[0]) {
            (1, b'0') => Some(false),
            (1, b'1') => Some(true),
            _ => None,
        }
    }
}

fn qcow2_error(b: &Backend, why: String) -> Error {
    Error::Qcow2 {
        path: b.path().map(|p| p.to_owned()).unwrap_or_default(),
        why,
    }
}

/// Release every lock byte vblk may hold (QEMU's 100-103 and 200-203).
fn unlock(file: &std::fs::File) -> io::Result<()> {
    for base in [PERM_BASE, SHARED_BASE] {
        // SAFETY: a zeroed flock is a valid value (l_pid must be 0 for OFD locks).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_UNLCK as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
        fl.l_start = base as libc::off_t;
        fl.l_len = 4;
        // SAFETY: fcntl reads one flock through the pointer, a live local; our own fd.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
