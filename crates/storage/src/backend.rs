//! Backends: where a disk's bytes live. [`Backend::open`] turns a
//! [`DiskSpec`](crate::spec::DiskSpec) into an opened regular file, block device, RAM disk
//! (a memfd mapped shared), null disk or simulated hard disk (a RAM disk with a timing
//! model, `hdd.rs`), and [`Backend::engine`] gives each worker its own engine on it.
//! Opening (probing, locking, sizing, the qcow2 chain) is in `backend/open.rs`.

mod open;

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::aio_engine::AioEngine;
use crate::bounce::DioAlign;
use crate::engine::{check_depth, Engine, EngineKind};
use crate::error::Error;
use crate::format::Format;
use crate::hdd::{HddDisk, HddEngine};
use crate::inline::InlineEngine;
use crate::lock::ImageLock;
use crate::nbd::{Export, NbdEngine, NbdOptions};
use crate::sync_engine::SyncEngine;
use crate::threads_engine::{ThreadsEngine, DEFAULT_ENGINE_THREADS, MAX_ENGINE_THREADS};
use crate::uring_engine::UringEngine;

pub(crate) use open::{handed_in_chain, open_in_chain};

/// `BLKGETSIZE64`: the size of a block device in bytes (`_IOR(0x12, 114, size_t)`).
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<u64>(0x12, 114);

/// The longest serial number virtio-blk carries.
const SERIAL_MAX: usize = 20;

/// How the host page cache is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// O_DIRECT: bypass the page cache.
    None,
    /// Through the page cache; flushes make it durable.
    #[default]
    Writeback,
}

impl FromStr for CacheMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "none" => Ok(CacheMode::None),
            "writeback" => Ok(CacheMode::Writeback),
            _ => Err(Error::BadCacheMode {
                input: s.to_owned(),
            }),
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheMode::None => "none",
            CacheMode::Writeback => "writeback",
        })
    }
}

/// How to open a disk.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Open read-only: writes, discards and write-zeroes fail with `EBADF`.
    pub read_only: bool,
    /// Page cache use (files and block devices; RAM and null disks ignore it).
    pub cache: CacheMode,
    /// RAM disks only: allocate and map every page at open (like QEMU's `prealloc=on`),
    /// so that no I/O pays for a first-touch page fault and running out of memory is an
    /// error at open rather than later.
    pub prealloc: bool,
    /// Files and block devices only: image locking and the format probe.
    pub image: ImageChecks,
    /// The size of each `threads` engine's pool (one pool per engine, so per worker):
    /// 1..=[`MAX_ENGINE_THREADS`]; [`DEFAULT_ENGINE_THREADS`] by default.
    pub engine_threads: usize,
    /// NBD disks only: reconnection, timeouts, connections per engine.
    pub nbd: NbdOptions,
    /// qcow2 images only: the backing chain below the image, in order (the image's
    /// backing file first). vblk opens no file an image names on its own.
    pub backing: Vec<crate::qcow2::BackingFile>,
    /// qcow2 images only: `backing`'s files already open, in the same order (the first
    /// ones; a file without one here is opened by its path). A confined daemon opens
    /// nothing: `vblk disk add` opens the chain and hands it over.
    pub backing_files: Vec<std::sync::Arc<File>>,
    /// qcow2 images only: the most bytes of L2 entries the metadata owner caches
    /// ([`crate::qcow2::DEFAULT_CACHE_BYTES`] by default, as QEMU's `l2-cache-size`; at
    /// least one slice of 4 KiB is kept).
    pub qcow2_cache: usize,
}

/// The most operations a qcow2 engine's wrapped engines (the image file's, the backing
/// file's) take at once.
const PIECE_DEPTH: u32 = 4096;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            cache: CacheMode::default(),
            prealloc: false,
            image: ImageChecks::default(),
            engine_threads: DEFAULT_ENGINE_THREADS,
            nbd: NbdOptions::default(),
            backing: Vec::new(),
            backing_files: Vec::new(),
            qcow2_cache: crate::qcow2::DEFAULT_CACHE_BYTES,
        }
    }
}

/// What is checked, and held, on a file or block device before it is served. The default
/// is the safe one: QEMU-compatible locks on, and images that are not raw refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImageChecks {
    /// Take QEMU's image locks for as long as the backend lives, and refuse the image when
    /// another user's locks exclude this one (a second writer, or a writer beside a reader
    /// that refuses writers).
    pub lock: ImageLock,
    /// The format the user declared. `None` probes the first 2 KiB and the last 512 bytes
    /// and refuses qcow2, VMDK, VDI and the other image formats QEMU knows (a guest
    /// writing to one served raw destroys it); `Some(Format::Raw)` skips the probe.
    pub format: Option<Format>,
    /// Open the image inactive: without its write locks, as the destination of a live
    /// migration does while the source still writes ([`Backend::activate`] takes them when
    /// its rings start). Without it, an image another writer holds is refused at open.
    pub incoming: bool,
}

/// What kind of thing holds the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// A regular file.
    File,
    /// A block device.
    BlockDevice,
    /// A RAM disk: a memfd mapped into the process.
    Mem,
    /// Reads zeroes, drops writes.
    Null,
    /// An export on an NBD server.
    Nbd,
    /// A simulated 7200 rpm disk: a RAM disk whose requests take a hard disk's time.
    Hdd,
}

impl std::fmt::Display for BackendKind {
    /// What an operator calls it, as the disk SPEC names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::File => "file",
            BackendKind::BlockDevice => "block device",
            BackendKind::Mem => "RAM disk (mem:)",
            BackendKind::Null => "null disk (null:)",
            BackendKind::Nbd => "NBD disk",
            BackendKind::Hdd => "simulated hard disk (hdd:)",
        })
    }
}

/// What `fallocate` modes turned out to be unsupported, learnt once per backend so
/// later operations go straight to the fallback.
#[derive(Debug, Default)]
pub(crate) struct FallocCaps {
    pub no_punch: AtomicBool,
    pub no_zero_range: AtomicBool,
}

/// The shared mapping of a RAM disk.
pub(crate) struct MemMap {
    ptr: NonNull<u8>,
    len: usize,
}

impl MemMap {
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for MemMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; the Backend owning
        // this map outlives every engine (they hold an Arc), so nothing uses it now.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An opened disk. Send + Sync; shared by all device workers behind an `Arc`.
pub struct Backend {
    kind: BackendKind,
    path: Option<PathBuf>,
    pub(crate) file: Option<File>,
    map: Option<MemMap>,
    /// Bytes; changes only through [`Backend::refresh_size`], [`Backend::resize`] and
    /// [`Backend::activate`] (a qcow2 header another program changed).
    pub(crate) size: AtomicU64,
    logical_block_size: u32,
    dio: Option<DioAlign>,
    read_only: bool,
    cache: CacheMode,
    serial: String,
    pub(crate) caps: FallocCaps,
    /// Pool size of `threads` engines.
    engine_threads: usize,
    /// Testing aid: submit calls still to be refused ([`Backend::refuse_submits`]).
    refusals: AtomicUsize,
    nbd: Option<Arc<Export>>,
    /// The timing model and head position of a simulated hard disk.
    hdd: Option<HddDisk>,
    /// Whether this backend writes the image now (holds its write locks): see
    /// [`crate::handoff`].
    pub(crate) holding: std::sync::Mutex<crate::handoff::Holding>,
    /// A qcow2 image: the format layer over the file (which it holds, with its locks).
    qcow2: Option<Arc<crate::qcow2::Image>>,
}

// SAFETY: the only field that is not Send + Sync is the RAM disk's mapping, a
// MAP_SHARED region owned by the Backend for its whole life. Engines access it only
// through raw-pointer copies (never references), the way guest memory is accessed;
// concurrent overlapping writes leave unspecified bytes, as on a real disk.
unsafe impl Send for Backend {}
// SAFETY: as for Send: all shared access is through raw-pointer copies into the
// mapping, or through the file descriptor and atomics.
unsafe impl Sync for Backend {}

impl Backend {
    /// What kind of thing holds the bytes.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// Size in bytes; always a multiple of 512.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// Read the size of the file or block device again (it may have been grown or shrunk
    /// by someone else, e.g. `truncate` or `lvextend`), and use it from now on unless it
    /// shrank and `allow_shrink` is false. Returns (old, new) sizes in bytes.
    pub fn refresh_size(&self, allow_shrink: bool) -> Result<(u64, u64), Error> {
        let old = self.size();
        let path = self.path.clone().unwrap_or_default();
        if self.qcow2.is_some() {
            // Its size is in its header, which only this daemon writes
            // (`Backend::resize`): nobody else changed it.
            return Ok((old, old));
        }
        let new = match (self.kind, self.file.as_ref()) {
            (BackendKind::File, Some(f)) => f
                .metadata()
                .map_err(|source| Error::Io {
                    path: path.clone(),
                    op: "fstat",
                    source,
                })?
                .len(),
            (BackendKind::BlockDevice, Some(f)) => {
                let mut bytes: u64 = 0;
                // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points
                // to a live local.
                let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut bytes) };
                if rc != 0 {
                    return Err(Error::Io {
                        path,
                        op: "ioctl(BLKGETSIZE64)",
                        source: io::Error::last_os_error(),
                    });
                }
                bytes
            }
            _ => return Err(Error::Resize { kind: self.kind }),
        };
        let block = u64::from(self.logical_block_size);
        if !new.is_multiple_of(block) {
            return Err(Error::UnalignedFile {
                path,
                size: new,
                block: self.logical_block_size,
            });
        }
        if new < old && !allow_shrink {
            return Err(Error::Shrink { path, old, new });
        }
        self.size.store(new, Ordering::Relaxed);
        Ok((old, new))
    }

    /// Make the disk `size` bytes (`vblk disk resize`): a file is truncated to it, a
    /// qcow2 image grown (qcow2/resize.rs). Smaller only for a raw file and with
    /// `allow_shrink`; a qcow2 image only grows. Block devices are resized by their owner
    /// (`lvextend`), then re-read (`refresh_size`, SIGHUP). Returns (old, new) in bytes.
    pub fn resize(&self, size: u64, allow_shrink: bool) -> Result<(u64, u64), Error> {
        let old = self.size();
        let path = self.path.clone().unwrap_or_default();
        let refuse = |why: String| Error::Qcow2 {
            path: path.clone(),
            why,
        };
        if self.read_only {
            return Err(Error::ResizeRefused {
                why: "the disk is served read-only".into(),
            });
        }
        if self.holding() == crate::Holding::Inactive {
            return Err(Error::ResizeRefused {
                why: "the disk is another daemon's to write now (a live migration's destination before it starts, or its source after)".into(),
            });
        }
        let block = u64::from(self.logical_block_size);
        if size == 0 || !size.is_multiple_of(block) {
            return Err(Error::ResizeRefused {
                why: format!(
                    "{size} bytes is not a positive multiple of the disk's {block}-byte blocks"
                ),
            });
        }
        if let Some(image) = self.qcow2() {
            if size < old {
                return Err(refuse(format!(
                    "{size} bytes is smaller than its {old} bytes: vblk grows qcow2 images only (shrink one nobody serves with `qemu-img resize --shrink`)"
                )));
            }
            // The new space must read as zeroes: the old last cluster's tail was never
            // the guest's (QEMU zeroes it; vblk refuses), and over a backing file longer
            // than the old size the owner makes zero clusters (qcow2/resize.rs).
            let backing = image.backing().map_or(0, |(b, _)| b.size());
            if size > old && backing > old && image.header().version < 3 {
                return Err(refuse(format!(
                    "its backing file ({backing} bytes) is larger than it ({old} bytes), and a version 2 image has no zero clusters to hide the backing file's bytes in the new space (QEMU refuses this too); `qemu-img amend -f qcow2 -o compat=1.1` makes it version 3"
                )));
            }
            if size > old && !old.is_multiple_of(image.header().cluster_size()) {
                return Err(refuse(format!(
                    "its size ({old} bytes) is not a whole number of its {}-byte clusters; grow it with `qemu-img resize` while nobody serves it",
                    image.header().cluster_size()
                )));
            }
            let l1 = size.div_ceil(image.header().l2_entries() * image.header().cluster_size()) * 8;
            if l1 > crate::qcow2::header::MAX_L1_BYTES {
                return Err(refuse(format!(
                    "{size} bytes would need an L1 table of {l1} bytes, more than the {} QEMU reads",
                    crate::qcow2::header::MAX_L1_BYTES
                )));
            }
            image.grow(size).map_err(|e| {
                refuse(format!(
                    "growing it to {size} bytes: {e} (the daemon's log tells more)"
                ))
            })?;
            self.size.store(size, Ordering::Relaxed);
            return Ok((old, size));
        }
        match (self.kind, self.file.as_ref()) {
            (BackendKind::File, Some(f)) => {
                if size < old && !allow_shrink {
                    return Err(Error::ResizeRefused {
                        why: format!("{size} bytes is smaller than its {old} bytes: shrinking the disk under the guest loses what it wrote there (--shrink allows it)"),
                    });
                }
                f.set_len(size).map_err(|source| Error::Io {
                    path: path.clone(),
                    op: "ftruncate",
                    source,
                })?;
                self.size.store(size, Ordering::Relaxed);
                Ok((old, size))
            }
            (BackendKind::BlockDevice, _) => Err(Error::ResizeRefused {
                why: "a block device is resized by its owner (e.g. `lvextend`); then send the daemon SIGHUP and it reads the new size".into(),
            }),
            _ => Err(Error::Resize { kind: self.kind }),
        }
    }

    /// 512, or what O_DIRECT needs for offsets and lengths on this file or device
    /// (`cache=none`); a power of two. Operations not aligned to it fail with `EINVAL`.
    pub fn logical_block_size(&self) -> u32 {
        self.logical_block_size
    }

    /// Whether the disk seeks, as far as vblk knows for sure: `hdd:` does (unless it is
    /// `hdd:SIZE:norot`, which hides it). Files and block devices are not assumed to:
    /// sysfs's `rotational` is 1 for most virtual disks (virtio-blk sets no flag),
    /// whatever lies under them.
    pub fn rotational(&self) -> bool {
        self.hdd.as_ref().is_some_and(|h| h.reports_rotation)
    }

    /// Whether writes are refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The cache mode asked for at open.
    pub fn cache(&self) -> CacheMode {
        self.cache
    }

    /// Whether [`Op::Discard`](crate::Op::Discard) is worth sending (false when
    /// read-only, or on an NBD export whose server does not take NBD_CMD_TRIM).
    pub fn supports_discard(&self) -> bool {
        !self.read_only && self.nbd.as_ref().is_none_or(|ex| ex.can_trim())
    }

    /// The (device, inode) of the file or block device this backend serves (a qcow2
    /// image's own file), from its open descriptor.
    pub fn file_id(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let file = match self.qcow2() {
            Some(image) => image.container.file.as_ref(),
            None => self.file.as_ref(),
        }?;
        file.metadata().ok().map(|m| (m.dev(), m.ino()))
    }

    /// A writable NBD export whose server offers no multi-conn: one engine (so one
    /// worker) may write to it, since a flush on one connection would not cover writes
    /// on another.
    pub fn one_writer_only(&self) -> bool {
        self.nbd.as_ref().is_some_and(|e| e.one_writer_only())
    }

    /// What the NBD handshake learnt (NBD disks only).
    pub fn nbd_export(&self) -> Option<crate::nbd::ExportInfo> {
        self.nbd.as_ref().map(|ex| ex.info)
    }

    /// Whether [`Op::WriteZeroes`](crate::Op::WriteZeroes) works (false when
    /// read-only; otherwise always, falling back to writing zeroes).
    pub fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }

    /// A serial number of at most 20 bytes: the file name (its last 20 bytes if
    /// longer), `vblk-mem`, `vblk-null` or `vblk-hdd`.
    pub fn default_serial(&self) -> String {
        self.serial.clone()
    }

    /// The file grew to at least `end` bytes (a qcow2 image's owner allocated clusters at
    /// its end): engines' bounds follow.
    pub(crate) fn grow_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::Relaxed);
    }

    /// The qcow2 image this backend serves, if it is one.
    pub fn qcow2(&self) -> Option<&crate::qcow2::Image> {
        self.qcow2.as_deref()
    }

    /// The path of a file or block device.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The descriptor of a file, block device or RAM disk (its memfd), for
    /// inspection or for sharing a RAM disk; None for a null disk.
    pub fn raw_fd(&self) -> Option<RawFd> {
        self.file.as_ref().map(|f| f.as_raw_fd())
    }

    /// A per-worker engine; `depth` = the most operations ever in flight at once
    /// (1..=[`MAX_DEPTH`](crate::MAX_DEPTH)). RAM and null disks get the inline
    /// engine, NBD disks the NBD engine (its own connection), simulated hard disks the
    /// `hdd` engine (data moved inline, completions when the model says they are due),
    /// whatever `kind` says. The aio engine needs `cache=none` ([`Error::AioNeedsDirect`]).
    pub fn engine(
        self: &Arc<Self>,
        kind: EngineKind,
        depth: u32,
    ) -> Result<Box<dyn Engine>, Error> {
        let depth_n = check_depth(depth)?;
        if let Some(image) = &self.qcow2 {
            // Pieces of a request may outnumber requests: the wrapped engines get room,
            // up to PIECE_DEPTH (a chain would otherwise multiply it at every level, and
            // an io_uring of 32768 entries needs memory the kernel may not find in one
            // piece); a piece that does not fit waits in the qcow2 engine.
            let room = depth.saturating_mul(4).min(PIECE_DEPTH).max(depth);
            let inner = image.container.engine(kind, room)?;
            let backing = match &image.backing {
                Some(b) => Some(b.engine(kind, room)?),
                None => None,
            };
            let e =
                crate::qcow2::engine::Qcow2Engine::new(Arc::clone(image), inner, backing, depth)
                    .map_err(|source| Error::EngineSetup {
                        engine: "qcow2",
                        depth,
                        source,
                    })?;
            return Ok(Box::new(e));
        }
        if let Some(ex) = &self.nbd {
            return Ok(Box::new(NbdEngine::new(Arc::clone(ex), depth_n)?));
        }
        match (self.kind, kind) {
            (BackendKind::Mem | BackendKind::Null, _) => {
                Ok(Box::new(InlineEngine::new(Arc::clone(self), depth_n)))
            }
            (BackendKind::Hdd, _) => HddEngine::new(Arc::clone(self), depth_n)
                .map(|e| Box::new(e) as Box<dyn Engine>)
                .map_err(|source| Error::EngineSetup {
                    engine: "hdd",
                    depth,
                    source,
                }),
            (_, EngineKind::Sync) => Ok(Box::new(SyncEngine::new(Arc::clone(self), depth_n))),
            (_, EngineKind::IoUring) => Ok(Box::new(UringEngine::new(Arc::clone(self), depth)?)),
            (_, EngineKind::Aio) => Ok(Box::new(AioEngine::new(Arc::clone(self), depth)?)),
            (_, EngineKind::Threads) => {
                let threads = self.engine_threads;
                if threads == 0 || threads > MAX_ENGINE_THREADS {
                    return Err(Error::EngineThreads {
                        threads,
                        max: MAX_ENGINE_THREADS,
                    });
                }
                Ok(Box::new(ThreadsEngine::new(
                    Arc::clone(self),
                    depth,
                    threads,
                )?))
            }
        }
    }

    /// The pool size of this backend's `threads` engines.
    pub fn engine_threads(&self) -> usize {
        self.engine_threads
    }

    /// Testing aid: the next `n` calls that hand queued work to the kernel (`io_submit`,
    /// `io_uring_enter`), in any engine on this backend, are answered as if the kernel had
    /// said EAGAIN, without reaching it. The work stays queued and counted in
    /// [`Engine::backlog`]; nothing may be lost or failed. Engines that hand nothing to a
    /// kernel queue (sync, threads, inline) ignore it.
    pub fn refuse_submits(&self, n: usize) {
        self.refusals.store(n, Ordering::Relaxed);
    }

    /// Whether this submit call is to be refused ([`Backend::refuse_submits`]); one relaxed
    /// load when none are.
    pub(crate) fn take_refusal(&self) -> bool {
        self.refusals.load(Ordering::Relaxed) > 0
            && self
                .refusals
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
    }

    /// Make every completed write durable (`fdatasync`); nothing to do for RAM and null
    /// disks. For a clean shutdown: engines flush only when asked.
    pub fn flush(&self) -> io::Result<()> {
        if let Some(image) = &self.qcow2 {
            return image.flush();
        }
        match (self.kind, self.read_only) {
            (BackendKind::File | BackendKind::BlockDevice, false) => {
                crate::sysio::fdatasync(self.fd())
            }
            _ => Ok(()),
        }
    }

    /// The descriptor engines do I/O on; -1 for a null disk (which never uses it).
    pub(crate) fn fd(&self) -> RawFd {
        self.raw_fd().unwrap_or(-1)
    }

    /// The O_DIRECT alignment, when opened with `cache=none`.
    pub(crate) fn dio(&self) -> Option<DioAlign> {
        self.dio
    }

    /// The RAM disk's mapping.
    pub(crate) fn map(&self) -> Option<&MemMap> {
        self.map.as_ref()
    }

    /// The simulated hard disk's model and head.
    pub(crate) fn hdd(&self) -> Option<&HddDisk> {
        self.hdd.as_ref()
    }
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("kind", &self.kind)
            .field("path", &self.path)
            .field("size", &self.size())
            .field("logical_block_size", &self.logical_block_size)
            .field("read_only", &self.read_only)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_mode_parses() {
        assert_eq!("none".parse::<CacheMode>().unwrap(), CacheMode::None);
        assert_eq!(
            "writeback".parse::<CacheMode>().unwrap(),
            CacheMode::Writeback
        );
        assert_eq!(
            "direct".parse::<CacheMode>().unwrap_err().to_string(),
            "unknown cache mode \"direct\" (expected none or writeback)"
        );
        assert_eq!(CacheMode::default(), CacheMode::Writeback);
    }
}
