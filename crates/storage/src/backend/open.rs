//! Opening a backend: a file (probed, locked, sized, its O_DIRECT alignment found, a
//! qcow2 image and its backing chain opened over it), a RAM or null disk, a simulated
//! hard disk or an NBD export.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use super::{
    Backend, BackendKind, CacheMode, FallocCaps, MemMap, OpenOptions, BLKGETSIZE64, SERIAL_MAX,
};
use crate::bounce::{probe_dio, DioAlign, DioProbe};
use crate::error::Error;
use crate::format::{probe_file, Format};
use crate::hdd::{HddDisk, DESKTOP_7200};
use crate::lock::{lock_image, Access, ImageLock};
use crate::nbd::Export;
use crate::spec::{DiskSpec, SECTOR_SIZE};

impl Backend {
    /// Opens the disk `spec` names.
    pub fn open(spec: &DiskSpec, opts: &OpenOptions) -> Result<Backend, Error> {
        match spec {
            DiskSpec::File(path) => open_in_chain(path, opts, &mut Vec::new()),
            DiskSpec::Mem(size) => open_mem(*size, opts),
            DiskSpec::Null(size) => {
                check_sector_multiple(*size)?;
                Ok(Backend::bare(BackendKind::Null, *size, "vblk-null", opts))
            }
            DiskSpec::Nbd(spec) => {
                let ex = Export::open(spec, opts.read_only, opts.nbd)?;
                let mut b = Backend::bare(BackendKind::Nbd, ex.info.size, "", opts);
                b.logical_block_size = ex.block;
                b.serial = nbd_serial(spec);
                b.nbd = Some(Arc::new(ex));
                Ok(b)
            }
            DiskSpec::Hdd {
                size,
                speedup,
                reports_rotation,
            } => {
                let mut backend = open_mem(*size, opts)?;
                backend.kind = BackendKind::Hdd;
                backend.serial = "vblk-hdd".to_owned();
                let mut hdd = HddDisk::new(*size, *speedup, DESKTOP_7200);
                hdd.reports_rotation = *reports_rotation;
                backend.hdd = Some(hdd);
                Ok(backend)
            }
        }
    }

    /// Opens the image file or block device `spec` names from `file`, a descriptor of it
    /// someone else opened (a client of a confined daemon, which opens nothing itself).
    /// Its access mode must allow what `opts` asks (read and write unless read-only); the
    /// cache mode is set on it (O_DIRECT on or off).
    pub fn open_file(spec: &DiskSpec, file: File, opts: &OpenOptions) -> Result<Backend, Error> {
        let DiskSpec::File(path) = spec else {
            return Err(Error::NotADisk {
                path: PathBuf::from(spec.to_string()),
            });
        };
        adopt_flags(path, &file, opts)?;
        from_file(path, file, opts, &mut Vec::new())
    }

    fn bare(kind: BackendKind, size: u64, serial: &str, opts: &OpenOptions) -> Backend {
        Backend {
            kind,
            path: None,
            file: None,
            map: None,
            size: AtomicU64::new(size),
            logical_block_size: SECTOR_SIZE as u32,
            dio: None,
            read_only: opts.read_only,
            cache: opts.cache,
            serial: serial.to_owned(),
            caps: FallocCaps::default(),
            engine_threads: opts.engine_threads,
            refusals: AtomicUsize::new(0),
            nbd: None,
            hdd: None,
            holding: std::sync::Mutex::new(crate::handoff::Holding::Unlocked),
            qcow2: None,
        }
    }
}

fn check_sector_multiple(size: u64) -> Result<(), Error> {
    if size == 0 {
        return Err(Error::ZeroSize);
    }
    if !size.is_multiple_of(SECTOR_SIZE) {
        return Err(Error::UnalignedSize { size });
    }
    Ok(())
}

/// Make a descriptor handed over (opened by another process) what `opts` asks: open for
/// writing if the disk is writable, O_DIRECT set or cleared as the cache mode says.
fn adopt_flags(path: &Path, file: &File, opts: &OpenOptions) -> Result<(), Error> {
    let io_err = |op, source| Error::Io {
        path: path.to_owned(),
        op,
        source,
    };
    // SAFETY: F_GETFL on a descriptor we own reads its status flags.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io_err("fcntl(F_GETFL)", io::Error::last_os_error()));
    }
    if !opts.read_only && flags & libc::O_ACCMODE != libc::O_RDWR {
        return Err(Error::Open {
            path: path.to_owned(),
            source: io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the descriptor handed over is not open for reading and writing",
            ),
        });
    }
    let direct = opts.cache == CacheMode::None;
    let want = if direct {
        flags | libc::O_DIRECT
    } else {
        flags & !libc::O_DIRECT
    };
    // SAFETY: F_SETFL on a descriptor we own sets its status flags.
    if want != flags && unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, want) } != 0 {
        let source = io::Error::last_os_error();
        return Err(if direct && source.raw_os_error() == Some(libc::EINVAL) {
            Error::DirectUnsupported {
                path: path.to_owned(),
            }
        } else {
            io_err("fcntl(F_SETFL)", source)
        });
    }
    Ok(())
}

/// A backing file handed over open (`OpenOptions::backing_files`), in a chain: as
/// [`open_in_chain`] without opening anything.
pub(crate) fn handed_in_chain(
    path: &Path,
    file: &File,
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
) -> Result<Backend, Error> {
    let file = file.try_clone().map_err(|source| Error::Io {
        path: path.to_owned(),
        op: "dup",
        source,
    })?;
    adopt_flags(path, &file, opts)?;
    from_file(path, file, opts, chain)
}

/// Open the file at `path`; `chain` holds the (device, inode) of the qcow2 images above
/// it, when it is a backing file.
pub(crate) fn open_in_chain(
    path: &Path,
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
) -> Result<Backend, Error> {
    let direct = opts.cache == CacheMode::None;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .custom_flags(if direct { libc::O_DIRECT } else { 0 })
        .open(path)
        .map_err(|source| {
            if direct && source.raw_os_error() == Some(libc::EINVAL) {
                Error::DirectUnsupported {
                    path: path.to_owned(),
                }
            } else {
                Error::Open {
                    path: path.to_owned(),
                    source,
                }
            }
        })?;
    from_file(path, file, opts, chain)
}

/// The rest of [`open_in_chain`] once the file is open as `opts` asks.
fn from_file(
    path: &Path,
    file: File,
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
) -> Result<Backend, Error> {
    let direct = opts.cache == CacheMode::None;
    let io_err = |op, source| Error::Io {
        path: path.to_owned(),
        op,
        source,
    };
    let meta = file.metadata().map_err(|e| io_err("fstat", e))?;
    // A loop is named as one before this file's locks are asked for: they would
    // conflict with the locks the chain above already holds on it.
    if chain.contains(&(
        std::os::unix::fs::MetadataExt::dev(&meta),
        std::os::unix::fs::MetadataExt::ino(&meta),
    )) {
        return Err(crate::qcow2::image::chain_loop(path));
    }
    let ft = meta.file_type();
    let (kind, size) = if ft.is_file() {
        (BackendKind::File, meta.len())
    } else if ft.is_block_device() {
        let mut bytes: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to
        // a live local.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut bytes) };
        if rc != 0 {
            return Err(io_err("ioctl(BLKGETSIZE64)", io::Error::last_os_error()));
        }
        (BackendKind::BlockDevice, bytes)
    } else {
        return Err(Error::NotADisk {
            path: path.to_owned(),
        });
    };
    // Locks first: a second writer is refused before anything is read. The format probe
    // comes before the size checks, so that a qcow2 file of 196616 bytes is named as
    // qcow2, not as a size that is not a multiple of 512.
    let holding = match opts.image.lock {
        ImageLock::On if opts.image.incoming => {
            log::info!(
                "{}: opened inactive (a migration destination): its write locks are taken when the frontend starts the rings",
                path.display()
            );
            crate::handoff::Holding::Inactive
        }
        ImageLock::On => {
            lock_image(&file, Access::vblk(opts.read_only)).map_err(|e| e.into_error(path))?;
            crate::handoff::Holding::Active
        }
        ImageLock::Off => {
            log::info!(
                "{}: image locking is off: other programs may open it for writing at the same time",
                path.display()
            );
            crate::handoff::Holding::Unlocked
        }
    };
    if opts.image.format.is_none() {
        let found = probe_file(&file, size).map_err(|e| io_err("read (format probe)", e))?;
        if let Some(format) = found {
            return Err(Error::NotRaw {
                path: path.to_owned(),
                format,
                read_only: opts.read_only,
            });
        }
    }

    let unaligned = |block: u32| Error::UnalignedFile {
        path: path.to_owned(),
        size,
        block,
    };
    // A qcow2 file's size is what its clusters and compressed data took; its virtual size
    // is what must be aligned.
    let qcow2 = opts.image.format == Some(Format::Qcow2);
    if !qcow2 && !size.is_multiple_of(SECTOR_SIZE) {
        return Err(unaligned(SECTOR_SIZE as u32));
    }

    let mut logical_block_size = SECTOR_SIZE as u32;
    let mut dio = None;
    if direct {
        let align = match probe_dio(file.as_raw_fd()) {
            DioProbe::Reported { mem, offset } => DioAlign { mem, offset },
            DioProbe::Unsupported => {
                return Err(Error::DirectUnsupported {
                    path: path.to_owned(),
                })
            }
            DioProbe::Unknown if kind == BackendKind::BlockDevice => {
                let lbs = block_sector_size(&file).map_err(|e| io_err("ioctl(BLKSSZGET)", e))?;
                DioAlign {
                    mem: lbs,
                    offset: lbs,
                }
            }
            DioProbe::Unknown => DioAlign {
                mem: 512,
                offset: 512,
            },
        };
        let lbs = align.offset.max(SECTOR_SIZE as u32);
        if !lbs.is_power_of_two() || lbs > 65536 || !align.mem.is_power_of_two() {
            return Err(Error::BadBlockSize {
                path: path.to_owned(),
                size: align.offset,
            });
        }
        if !qcow2 && !size.is_multiple_of(u64::from(lbs)) {
            return Err(unaligned(lbs));
        }
        logical_block_size = lbs;
        dio = Some(DioAlign {
            mem: align.mem,
            offset: lbs,
        });
    }

    let backend = Backend {
        kind,
        path: Some(path.to_owned()),
        file: Some(file),
        map: None,
        size: AtomicU64::new(size),
        logical_block_size,
        dio,
        read_only: opts.read_only,
        cache: opts.cache,
        serial: serial_from_path(path),
        caps: FallocCaps::default(),
        engine_threads: opts.engine_threads,
        refusals: AtomicUsize::new(0),
        nbd: None,
        hdd: None,
        holding: std::sync::Mutex::new(holding),
        qcow2: None,
    };
    if opts.image.format != Some(Format::Qcow2) {
        if let Some(b) = opts.backing.first() {
            let why = if chain.is_empty() {
                format!(
                    "--backing {} is for qcow2 images (--format qcow2, and one per image in the chain); this one is served raw",
                    b.path.display()
                )
            } else {
                format!(
                    "the chain ends here, at a raw file, which has no backing file: --backing {} is one too many",
                    b.path.display()
                )
            };
            return Err(Error::Qcow2 {
                path: path.to_owned(),
                why,
            });
        }
        return Ok(backend);
    }
    qcow2_over(backend, opts, chain)
}

/// The qcow2 image in the raw file `container`: a backend of the image's virtual size
/// whose engines translate through its tables.
fn qcow2_over(
    container: Backend,
    opts: &OpenOptions,
    chain: &mut Vec<(u64, u64)>,
) -> Result<Backend, Error> {
    let path = container.path.clone().unwrap_or_default();
    // O_DIRECT: buffers aligned to `mem`, file offsets and lengths to `offset`.
    let align = container
        .dio
        .map_or((1, 1), |d| (u64::from(d.mem), u64::from(d.offset)));
    let (kind, lbs, serial) = (
        container.kind,
        container.logical_block_size,
        container.serial.clone(),
    );
    let image = crate::qcow2::image::open(&path, container, align, opts, chain)?;
    let mut b = Backend::bare(kind, image.size(), &serial, opts);
    b.path = Some(path);
    // The chain's largest block: what O_DIRECT needs of every file in it.
    let mut lbs = lbs;
    let mut below = image.backing.clone();
    while let Some(bk) = below {
        lbs = lbs.max(bk.logical_block_size);
        below = bk.qcow2().and_then(|i| i.backing.clone());
    }
    b.logical_block_size = lbs;
    b.qcow2 = Some(Arc::new(image));
    Ok(b)
}

/// `BLKSSZGET`: the logical block size of a block device.
fn block_sector_size(file: &File) -> io::Result<u32> {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points to a live local.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut lbs) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(lbs).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn open_mem(size: u64, opts: &OpenOptions) -> Result<Backend, Error> {
    check_sector_multiple(size)?;
    let mem_err = |op, source| Error::Mem { size, op, source };
    let len = usize::try_from(size)
        .map_err(|_| mem_err("mmap", io::Error::from_raw_os_error(libc::ENOMEM)))?;
    let off = libc::off_t::try_from(size)
        .map_err(|_| mem_err("ftruncate", io::Error::from_raw_os_error(libc::EFBIG)))?;
    // SAFETY: the name is a NUL-terminated string literal; flags are valid.
    let fd = unsafe { libc::memfd_create(c"vblk-mem".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(mem_err("memfd_create", io::Error::last_os_error()));
    }
    // SAFETY: memfd_create just returned this descriptor and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(file.as_raw_fd(), off) } != 0 {
        return Err(mem_err("ftruncate", io::Error::last_os_error()));
    }
    if opts.prealloc {
        // SAFETY: plain syscall on a descriptor we own; allocates the memfd's pages.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, off) } != 0 {
            return Err(mem_err("fallocate", io::Error::last_os_error()));
        }
    }
    let prot = if opts.read_only {
        libc::PROT_READ
    } else {
        libc::PROT_READ | libc::PROT_WRITE
    };
    let populate = if opts.prealloc { libc::MAP_POPULATE } else { 0 };
    // SAFETY: a fresh shared mapping of our own memfd, `len` bytes (> 0) from
    // offset 0, at an address of the kernel's choice; it aliases no Rust object.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED | populate,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(mem_err("mmap", io::Error::last_os_error()));
    }
    let ptr = NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| mem_err("mmap", io::Error::from_raw_os_error(libc::ENOMEM)))?;
    let mut backend = Backend::bare(BackendKind::Mem, size, "vblk-mem", opts);
    backend.file = Some(file);
    backend.map = Some(MemMap { ptr, len });
    Ok(backend)
}

/// An NBD disk's serial: the export name, or the socket's or host's name, at most 20
/// bytes (the last ones).
fn nbd_serial(spec: &crate::nbd::NbdSpec) -> String {
    let name = if !spec.export.is_empty() {
        spec.export.clone()
    } else {
        match &spec.addr {
            crate::nbd::NbdAddr::Unix(p) => p
                .file_name()
                .map_or_else(|| "nbd".to_owned(), |n| n.to_string_lossy().into_owned()),
            crate::nbd::NbdAddr::Tcp { host, .. } => host.clone(),
        }
    };
    let mut start = name.len().saturating_sub(SERIAL_MAX);
    while !name.is_char_boundary(start) {
        start += 1;
    }
    name[start..].to_owned()
}

/// The file name, or its last 20 bytes (cut at a character boundary) if longer.
fn serial_from_path(path: &Path) -> String {
    let name = match path.file_name() {
        Some(name) => name.to_string_lossy().into_owned(),
        None => return "vblk-disk".to_owned(),
    };
    let mut start = name.len().saturating_sub(SERIAL_MAX);
    while !name.is_char_boundary(start) {
        start += 1;
    }
    name[start..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials() {
        assert_eq!(serial_from_path(Path::new("/a/disk.img")), "disk.img");
        assert_eq!(
            serial_from_path(Path::new("/a/a-very-long-disk-image-name.qcow")),
            "disk-image-name.qcow"
        );
        assert_eq!(serial_from_path(Path::new("/dev/loop0")), "loop0");
        let s = serial_from_path(Path::new("/ééééééééééééé.img"));
        assert!(s.len() <= SERIAL_MAX && s.ends_with(".img"), "{s}");
    }
}
