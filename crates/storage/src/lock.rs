//! Image locking the way QEMU does it, so that vblk, QEMU, qemu-storage-daemon and
//! qemu-img keep each other from writing one image at the same time.
//!
//! QEMU (block/file-posix.c, `raw_apply_lock_bytes` and `raw_check_lock_bytes`) describes
//! each user of an image by two sets of block permissions: those it holds and those it
//! shares with other users. Permission `i` is bit `i`: consistent read 0, write 1, write
//! unchanged 2, resize 3. A user takes a shared (read) open-file-description lock on byte
//! `100 + i` for each permission it holds and on byte `200 + i` for each permission it does
//! *not* share. Then it asks the kernel (`F_OFD_GETLK` with a write lock) whether anybody
//! else locks byte `200 + i` for a permission it wants (QEMU: `Failed to get "write" lock`)
//! or byte `100 + i` for a permission it does not share (`Failed to get shared "write"
//! lock`). Read locks never conflict with each other, so taking them never fails on
//! another user's account; only the check decides. Locking before checking means that two
//! users that start at the same moment both see each other and both fail, never both pass.
//!
//! vblk takes what a QEMU virtio-blk disk with the same read-only setting takes. Measured
//! on QEMU 7.2 (`/proc/locks`): a writable `-device virtio-blk-pci` locks bytes 100, 101
//! and 201, a read-only one 100 and 201. Both hold consistent read, the writable one also
//! write, and both share everything but write. qemu-storage-daemon's exports share
//! everything (a writable export locks 100 and 101 only), so vblk and qsd exclude each
//! other through vblk's byte 201 or qsd's byte 101, whichever started first.
//!
//! The locks live as long as the open file description: the [`Backend`](crate::Backend)'s
//! file. They are released when it is closed, including when the process dies.

use std::fmt;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::Error;

/// Whether to take QEMU-compatible image locks on files and block devices.
///
/// There is no `auto` (QEMU's default, `locking=auto`): QEMU's auto means "on when the
/// kernel has open-file-description locks", which every kernel vblk runs on has (Linux
/// 3.15+), so it would be another name for `On`. A file system that refuses locks (NFS
/// without a lock manager, say) is an error naming [`ImageLock::Off`]'s flag, not a
/// silent fallback to no locking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImageLock {
    /// Take the locks at open and refuse the image if another user's locks exclude us.
    #[default]
    On,
    /// Take no locks and check none (QEMU's `locking=off`).
    Off,
}

impl fmt::Display for ImageLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImageLock::On => "on",
            ImageLock::Off => "off",
        })
    }
}

/// Byte `PERM_BASE + i` locked: its owner holds permission `i`.
pub const PERM_BASE: u64 = 100;
/// Byte `SHARED_BASE + i` locked: its owner does not share permission `i`.
pub const SHARED_BASE: u64 = 200;

/// QEMU's block permissions (`BLK_PERM_*`), in bit order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Perm {
    /// `BLK_PERM_CONSISTENT_READ`: reads see what was last written.
    ConsistentRead = 0,
    /// `BLK_PERM_WRITE`: writes that change the guest-visible data.
    Write = 1,
    /// `BLK_PERM_WRITE_UNCHANGED`: writes that do not change it (block jobs).
    WriteUnchanged = 2,
    /// `BLK_PERM_RESIZE`: changing the size.
    Resize = 3,
}

impl Perm {
    /// Every permission, in bit order (QEMU's `PERM_FOREACH`).
    pub const ALL: [Perm; 4] = [
        Perm::ConsistentRead,
        Perm::Write,
        Perm::WriteUnchanged,
        Perm::Resize,
    ];

    fn bit(self) -> u8 {
        1 << self as u8
    }

    /// QEMU's name for it (`bdrv_perm_names`), as its error messages quote it.
    pub fn name(self) -> &'static str {
        match self {
            Perm::ConsistentRead => "consistent read",
            Perm::Write => "write",
            Perm::WriteUnchanged => "write unchanged",
            Perm::Resize => "resize",
        }
    }

    /// The byte whose lock says "holds this permission".
    pub fn perm_byte(self) -> u64 {
        PERM_BASE + self as u64
    }

    /// The byte whose lock says "does not share this permission".
    pub fn shared_byte(self) -> u64 {
        SHARED_BASE + self as u64
    }
}

/// Another user's lock that keeps vblk out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conflict {
    /// vblk wants this permission and the other user does not share it: it locks the
    /// permission's shared byte (`200 + i`). QEMU: `Failed to get "write" lock`.
    NotShared(Perm),
    /// vblk does not share this permission and the other user holds it: it locks the
    /// permission's byte (`100 + i`). QEMU: `Failed to get shared "write" lock`.
    Held(Perm),
}

impl Conflict {
    /// The byte the other user locks.
    pub fn byte(self) -> u64 {
        match self {
            Conflict::NotShared(p) => p.shared_byte(),
            Conflict::Held(p) => p.perm_byte(),
        }
    }

    /// QEMU's words for it: `"write" lock` or `shared "write" lock`.
    pub fn lock_name(self) -> String {
        match self {
            Conflict::NotShared(p) => format!("\"{}\" lock", p.name()),
            Conflict::Held(p) => format!("shared \"{}\" lock", p.name()),
        }
    }
}

/// What one user does with an image, in QEMU's terms: the permissions it holds and the
/// ones it lets others hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Access {
    held: u8,
    shared: u8,
}

impl Access {
    fn of(held: &[Perm], shared: &[Perm]) -> Access {
        let mask = |ps: &[Perm]| ps.iter().fold(0, |m, p| m | p.bit());
        Access {
            held: mask(held),
            shared: mask(shared),
        }
    }

    /// vblk serving a disk: what a QEMU virtio-blk disk with `share-rw=off` holds and
    /// shares. It holds consistent read, and write unless read-only; it shares everything
    /// but write. Sharing resize and write-unchanged (as QEMU does) lets `qemu-img info`
    /// and block jobs that do not change the data run beside it.
    pub(crate) fn vblk(read_only: bool) -> Access {
        let shared = [Perm::ConsistentRead, Perm::WriteUnchanged, Perm::Resize];
        if read_only {
            Access::of(&[Perm::ConsistentRead], &shared)
        } else {
            Access::of(&[Perm::ConsistentRead, Perm::Write], &shared)
        }
    }

    fn holds(self, p: Perm) -> bool {
        self.held & p.bit() != 0
    }

    fn shares(self, p: Perm) -> bool {
        self.shared & p.bit() != 0
    }

    /// The bytes this user locks, ascending: `100 + i` for each permission held, `200 + i`
    /// for each not shared.
    pub(crate) fn lock_bytes(self) -> Vec<u64> {
        let held = Perm::ALL.into_iter().filter(|&p| self.holds(p));
        let unshared = Perm::ALL.into_iter().filter(|&p| !self.shares(p));
        held.map(Perm::perm_byte)
            .chain(unshared.map(Perm::shared_byte))
            .collect()
    }

    /// The first conflict, in QEMU's order (the shared bytes of what we hold, then the
    /// permission bytes of what we do not share); `locked_by_other(byte)` says whether
    /// someone else locks `byte`.
    pub(crate) fn first_conflict(
        self,
        mut locked_by_other: impl FnMut(u64) -> io::Result<bool>,
    ) -> io::Result<Option<Conflict>> {
        let wanted = Perm::ALL.into_iter().filter(|&p| self.holds(p));
        let unshared = Perm::ALL.into_iter().filter(|&p| !self.shares(p));
        let checks = wanted
            .map(Conflict::NotShared)
            .chain(unshared.map(Conflict::Held));
        for c in checks {
            if locked_by_other(c.byte())? {
                return Ok(Some(c));
            }
        }
        Ok(None)
    }
}

/// Why locking failed.
#[derive(Debug)]
pub(crate) enum LockError {
    /// Another user's lock excludes us; `holders` names the processes found holding it.
    Conflict {
        conflict: Conflict,
        holders: Vec<String>,
    },
    /// The kernel or the file system refused the `fcntl` on `byte`.
    Fcntl {
        op: &'static str,
        byte: u64,
        source: io::Error,
    },
}

impl LockError {
    /// The crate error for `path`.
    pub(crate) fn into_error(self, path: &Path) -> Error {
        match self {
            LockError::Conflict { conflict, holders } => Error::Locked {
                path: path.to_owned(),
                conflict,
                holders,
            },
            LockError::Fcntl { op, byte, source } => Error::LockFailed {
                path: path.to_owned(),
                op,
                byte,
                source,
            },
        }
    }
}

/// The message for [`Error::Locked`]: which lock, who holds it, what that means in QEMU's
/// convention, and the way out.
pub(crate) fn conflict_message(path: &Path, conflict: Conflict, holders: &[String]) -> String {
    let who = if holders.is_empty() {
        "another process".to_owned()
    } else {
        holders.join(" and ")
    };
    let meaning = match conflict {
        Conflict::NotShared(Perm::Write) => {
            "it is using the image and lets no one else write to it".to_owned()
        }
        Conflict::Held(Perm::Write) => {
            "it has the image open for writing, and vblk shares an image with no writer".to_owned()
        }
        Conflict::NotShared(p) => format!(
            "it is using the image and does not share the \"{}\" permission, which vblk needs",
            p.name()
        ),
        Conflict::Held(p) => format!(
            "it holds the \"{}\" permission, which vblk does not share",
            p.name()
        ),
    };
    format!(
        "{}: Failed to get {}: {who} holds byte {} of it, which in QEMU's image locking \
         convention (byte 100+i: holds permission i; byte 200+i: does not share it; \"write\" \
         is i=1) means {meaning}. Stop the other user of the image first, or pass \
         --image-lock off if you are sure that sharing it is safe",
        path.display(),
        conflict.lock_name(),
        conflict.byte()
    )
}

/// Takes `access`'s locks on `file` and checks that no other user's lock excludes it.
/// The locks stay until `file` is closed (also on error: the caller drops the file).
pub(crate) fn lock_image(file: &File, access: Access) -> Result<(), LockError> {
    for byte in access.lock_bytes() {
        ofd_lock(file, libc::F_OFD_SETLK, libc::F_RDLCK, byte).map_err(|source| {
            // A read lock conflicts only with a write lock, which QEMU's convention never
            // takes; still, someone might.
            if matches!(source.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) {
                LockError::Conflict {
                    conflict: conflict_for_byte(byte),
                    holders: holders(file, byte),
                }
            } else {
                LockError::Fcntl {
                    op: "F_OFD_SETLK",
                    byte,
                    source,
                }
            }
        })?;
    }
    let mut failed_byte = 0;
    let conflict = access
        .first_conflict(|byte| {
            failed_byte = byte;
            ofd_lock(file, libc::F_OFD_GETLK, libc::F_WRLCK, byte)
                .map(|fl| i32::from(fl.l_type) != libc::F_UNLCK)
        })
        .map_err(|source| LockError::Fcntl {
            op: "F_OFD_GETLK",
            byte: failed_byte,
            source,
        })?;
    match conflict {
        None => Ok(()),
        Some(conflict) => Err(LockError::Conflict {
            conflict,
            holders: holders(file, conflict.byte()),
        }),
    }
}

/// What a lock on `byte` taken by someone else means to us, for the rare case where
/// taking our own read lock fails.
fn conflict_for_byte(byte: u64) -> Conflict {
    let perm = |base| {
        Perm::ALL
            .into_iter()
            .find(|p| *p as u64 == byte - base)
            .unwrap_or(Perm::Write)
    };
    if byte >= SHARED_BASE {
        Conflict::Held(perm(SHARED_BASE))
    } else {
        Conflict::NotShared(perm(PERM_BASE))
    }
}

/// One `fcntl` open-file-description lock call on the single byte `byte`; returns the
/// `flock` as the kernel left it (for `F_OFD_GETLK`: `l_type == F_UNLCK` when nobody else
/// holds a conflicting lock).
fn ofd_lock(file: &File, cmd: libc::c_int, ty: libc::c_int, byte: u64) -> io::Result<libc::flock> {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value
    // (and l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    // SAFETY: fcntl with a lock command reads (and for GETLK writes) one `flock` through
    // the pointer, which points to a live local; the descriptor is owned by `file`.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl)
}

/// The processes that hold a lock covering `byte` on `file`'s inode, as `name (pid N)`,
/// found like lslocks does: every `/proc/PID/fd/N` that is the same inode, whose
/// `/proc/PID/fdinfo/N` lists such a lock. Our own descriptor is skipped; processes we may
/// not inspect (other users, when not root) are not found.
pub(crate) fn holders(file: &File, byte: u64) -> Vec<String> {
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let me = std::process::id();
    let my_fd = file.as_raw_fd().to_string();
    let mut found = Vec::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return found;
    };
    for proc_entry in procs.flatten() {
        let Some(pid) = proc_entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = fs::read_dir(proc_entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let name = fd.file_name();
            if pid == me && name.to_str() == Some(my_fd.as_str()) {
                continue;
            }
            // stat follows the magic link to the open file.
            let same = fs::metadata(fd.path())
                .map(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
                .unwrap_or(false);
            if !same {
                continue;
            }
            let info = fs::read_to_string(proc_entry.path().join("fdinfo").join(&name))
                .unwrap_or_default();
            if info.lines().any(|l| lock_line_covers(l, byte)) {
                found.push(if pid == me {
                    format!(
                        "this process (pid {pid}), which has it open already (as another disk, or twice in one backing chain),"
                    )
                } else {
                    format!("{} (pid {pid})", process_name(pid))
                });
                break;
            }
        }
    }
    found
}

/// Whether an fdinfo `lock:` line (`lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:123 100 101`)
/// is a granted lock whose range covers `byte`.
fn lock_line_covers(line: &str, byte: u64) -> bool {
    let Some(rest) = line.strip_prefix("lock:") else {
        return false;
    };
    if rest.contains("->") {
        return false; // a waiter, not a holder
    }
    let mut fields = rest.split_whitespace().rev();
    let (Some(end), Some(start)) = (fields.next(), fields.next()) else {
        return false;
    };
    let Ok(start) = start.parse::<u64>() else {
        return false;
    };
    let end = if end == "EOF" {
        u64::MAX
    } else {
        match end.parse::<u64>() {
            Ok(e) => e,
            Err(_) => return false,
        }
    };
    (start..=end).contains(&byte)
}

/// The program a process runs: the file name of its `argv[0]`, else its `comm`.
fn process_name(pid: u32) -> String {
    let argv0 = fs::read(format!("/proc/{pid}/cmdline")).ok().and_then(|c| {
        let first = c.split(|&b| b == 0).next()?.to_vec();
        let first = String::from_utf8_lossy(&first).into_owned();
        let base = first.rsplit('/').next()?.to_owned();
        (!base.is_empty()).then_some(base)
    });
    argv0.unwrap_or_else(|| {
        fs::read_to_string(format!("/proc/{pid}/comm"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "?".to_owned())
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The bytes QEMU 7.2 was seen to lock (`/proc/locks`), by user.
    const QEMU_VIRTIO_BLK_RW: &[u64] = &[100, 101, 201];
    const QEMU_VIRTIO_BLK_RO: &[u64] = &[100, 201];
    const QEMU_VIRTIO_BLK_SHARE_RW: &[u64] = &[100, 101];
    const QSD_EXPORT_RW: &[u64] = &[100, 101];
    const QSD_EXPORT_RO: &[u64] = &[100];

    fn conflict_with(access: Access, other: &[u64]) -> Option<Conflict> {
        let other: BTreeSet<u64> = other.iter().copied().collect();
        access.first_conflict(|b| Ok(other.contains(&b))).unwrap()
    }

    #[test]
    fn vblk_locks_what_a_qemu_virtio_blk_disk_locks() {
        assert_eq!(Access::vblk(false).lock_bytes(), QEMU_VIRTIO_BLK_RW);
        assert_eq!(Access::vblk(true).lock_bytes(), QEMU_VIRTIO_BLK_RO);
    }

    #[test]
    fn permission_names_and_bytes_are_qemus() {
        let names: Vec<_> = Perm::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(
            names,
            ["consistent read", "write", "write unchanged", "resize"]
        );
        let bytes: Vec<_> = Perm::ALL
            .iter()
            .map(|p| (p.perm_byte(), p.shared_byte()))
            .collect();
        assert_eq!(bytes, [(100, 200), (101, 201), (102, 202), (103, 203)]);
        assert_eq!(
            Conflict::NotShared(Perm::Write).lock_name(),
            "\"write\" lock"
        );
        assert_eq!(
            Conflict::Held(Perm::Write).lock_name(),
            "shared \"write\" lock"
        );
    }

    #[test]
    fn writers_exclude_each_other_and_readers_share() {
        let (rw, ro) = (Access::vblk(false), Access::vblk(true));
        let not_shared = Some(Conflict::NotShared(Perm::Write));
        let held = Some(Conflict::Held(Perm::Write));
        // A second vblk, after a first one.
        assert_eq!(conflict_with(rw, &rw.lock_bytes()), not_shared);
        assert_eq!(conflict_with(ro, &ro.lock_bytes()), None);
        assert_eq!(conflict_with(rw, &ro.lock_bytes()), not_shared);
        assert_eq!(conflict_with(ro, &rw.lock_bytes()), held);
        // vblk after QEMU's users.
        assert_eq!(conflict_with(rw, QEMU_VIRTIO_BLK_RW), not_shared);
        assert_eq!(conflict_with(rw, QEMU_VIRTIO_BLK_RO), not_shared);
        assert_eq!(conflict_with(ro, QEMU_VIRTIO_BLK_RO), None);
        assert_eq!(conflict_with(rw, QEMU_VIRTIO_BLK_SHARE_RW), held);
        assert_eq!(conflict_with(rw, QSD_EXPORT_RW), held);
        assert_eq!(conflict_with(ro, QSD_EXPORT_RW), held);
        // qsd's read-only export shares everything, writes included, as it does with QEMU.
        assert_eq!(conflict_with(rw, QSD_EXPORT_RO), None);
        assert_eq!(conflict_with(rw, &[]), None);
    }

    #[test]
    fn the_check_follows_qemus_order() {
        // Shared bytes of held permissions first, then permission bytes of unshared ones.
        let mut asked = Vec::new();
        Access::vblk(false)
            .first_conflict(|b| {
                asked.push(b);
                Ok(false)
            })
            .unwrap();
        assert_eq!(asked, [200, 201, 101]);
        let err = Access::vblk(true)
            .first_conflict(|_| Err(io::Error::from_raw_os_error(libc::ENOLCK)))
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOLCK));
    }

    #[test]
    fn conflict_messages_name_the_lock_the_holder_and_the_way_out() {
        let m = conflict_message(
            Path::new("/i/disk.img"),
            Conflict::NotShared(Perm::Write),
            &["qemu-storage-daemon (pid 7)".to_owned()],
        );
        assert_eq!(
            m,
            "/i/disk.img: Failed to get \"write\" lock: qemu-storage-daemon (pid 7) holds byte \
             201 of it, which in QEMU's image locking convention (byte 100+i: holds permission \
             i; byte 200+i: does not share it; \"write\" is i=1) means it is using the image \
             and lets no one else write to it. Stop the other user of the image first, or pass \
             --image-lock off if you are sure that sharing it is safe"
        );
        let m = conflict_message(Path::new("d"), Conflict::Held(Perm::Write), &[]);
        assert!(
            m.starts_with(
                "d: Failed to get shared \"write\" lock: another process holds byte 101 of it"
            ),
            "{m}"
        );
        assert!(m.contains("open for writing"), "{m}");
    }

    #[test]
    fn fdinfo_lock_lines() {
        let l = "lock:\t1: OFDLCK ADVISORY  READ -1 fe:00:9978246 100 101";
        assert!(lock_line_covers(l, 100) && lock_line_covers(l, 101));
        assert!(!lock_line_covers(l, 99) && !lock_line_covers(l, 201));
        assert!(lock_line_covers(
            "lock:\t2: POSIX  ADVISORY  WRITE 7 08:01:5 0 EOF",
            201
        ));
        assert!(!lock_line_covers(
            "lock:\t1: -> OFDLCK ADVISORY  WRITE -1 fe:00:9978246 201 201",
            201
        ));
        assert!(!lock_line_covers("pos:\t0", 0));
    }

    #[test]
    fn conflicts_on_a_real_file_name_this_process() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let first = File::options()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        lock_image(&first, Access::vblk(false)).unwrap();
        // OFD locks belong to the open file description: a second open in this same
        // process is another user.
        let second = File::open(f.path()).unwrap();
        match lock_image(&second, Access::vblk(true)) {
            Err(LockError::Conflict { conflict, holders }) => {
                assert_eq!(conflict, Conflict::Held(Perm::Write));
                let me = format!(
                    "this process (pid {}), which has it open already",
                    std::process::id()
                );
                assert!(holders.iter().any(|h| h.starts_with(&me)), "{holders:?}");
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        drop(second);
        // Closing the first description releases its locks.
        drop(first);
        let third = File::open(f.path()).unwrap();
        lock_image(&third, Access::vblk(false)).unwrap();
        let fourth = File::open(f.path()).unwrap();
        assert!(matches!(
            lock_image(&fourth, Access::vblk(false)),
            Err(LockError::Conflict {
                conflict: Conflict::NotShared(Perm::Write),
                ..
            })
        ));
    }
}
