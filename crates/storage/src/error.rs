//! The crate's error type: everything that can go wrong while naming, opening or
//! setting up a disk. Errors of single operations are errnos in
//! [`Completion::result`](crate::Completion), never this type.

use std::io;
use std::path::PathBuf;

use crate::format::{refusal, ImageFormat};
use crate::lock::{conflict_message, Conflict};
use crate::spec::format_size;

/// Why a disk could not be named, opened or given an engine.
///
/// Messages say what was expected and what was found, with the numbers and the
/// path: `/x/y.img: size 1000 is not a multiple of 512`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A disk spec was the empty string.
    #[error("empty disk spec (expected PATH, mem:SIZE, null:SIZE or an nbd:// URI)")]
    EmptySpec,
    /// A size was the empty string.
    #[error(
        "empty size (expected a number with an optional K, M, G or T suffix, e.g. 512, 4K, 1G)"
    )]
    EmptySize,
    /// A size that is not a number with a known suffix.
    #[error(
        "size {input:?} is not a number with an optional K, M, G or T suffix (e.g. 512, 4K, 1G)"
    )]
    BadSize {
        /// The text that was given.
        input: String,
    },
    /// A size larger than 2^64 - 1 bytes.
    #[error("size {input:?} does not fit in 64 bits")]
    SizeOverflow {
        /// The text that was given.
        input: String,
    },
    /// A size of 0 bytes.
    #[error("size 0 is not allowed (a disk holds at least 512 bytes)")]
    ZeroSize,
    /// A size that is not a multiple of the 512-byte sector.
    #[error("size {size} is not a multiple of 512")]
    UnalignedSize {
        /// The size in bytes.
        size: u64,
    },
    /// A cache mode other than `none` or `writeback`.
    #[error("unknown cache mode {input:?} (expected none or writeback)")]
    BadCacheMode {
        /// The text that was given.
        input: String,
    },
    /// An engine name other than `io_uring`, `aio`, `threads` or `sync`.
    #[error("unknown engine {input:?} (expected io_uring, aio, threads or sync)")]
    BadEngineKind {
        /// The text that was given.
        input: String,
    },
    /// The file or device could not be opened.
    #[error("{}: {}", path.display(), errno_text(source))]
    Open {
        /// The path that was opened.
        path: PathBuf,
        /// What `open(2)` said.
        #[source]
        source: io::Error,
    },
    /// A system call on an opened file or device failed.
    #[error("{}: {op}: {}", path.display(), errno_text(source))]
    Io {
        /// The file or device.
        path: PathBuf,
        /// The call that failed, e.g. `ioctl(BLKGETSIZE64)`.
        op: &'static str,
        /// What it said.
        #[source]
        source: io::Error,
    },
    /// The path names a directory, character device, FIFO or socket.
    #[error("{}: not a regular file or block device", path.display())]
    NotADisk {
        /// The path.
        path: PathBuf,
    },
    /// A file or device whose size is not a whole number of blocks.
    #[error("{}: size {size} is not a multiple of {block}", path.display())]
    UnalignedFile {
        /// The file or device.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// The block size it must be a multiple of: 512, or the O_DIRECT block size.
        block: u32,
    },
    /// A resize was asked of a disk whose size is fixed.
    #[error("{kind}: its size is fixed; only files and block devices can be resized")]
    Resize {
        /// What the disk is.
        kind: crate::BackendKind,
    },
    /// A resize that cannot be done.
    #[error("resize refused: {why}")]
    ResizeRefused {
        /// Why, with the way out.
        why: String,
    },
    /// The file or device shrank and shrinking was not allowed.
    #[error("{} shrank from {old} to {new} bytes; refusing to shrink the disk under the guest (--allow-shrink allows it)", path.display())]
    Shrink {
        /// The file or device.
        path: PathBuf,
        /// The size in use, in bytes.
        old: u64,
        /// The size found now.
        new: u64,
    },
    /// `cache=none` on a file system that has no O_DIRECT.
    #[error("{}: the file system does not support O_DIRECT (cache=none); use cache=writeback", path.display())]
    DirectUnsupported {
        /// The file.
        path: PathBuf,
    },
    /// The O_DIRECT block size reported for the file is unusable.
    #[error("{}: O_DIRECT block size {size} is not a power of two from 512 to 65536", path.display())]
    BadBlockSize {
        /// The file or device.
        path: PathBuf,
        /// The block size that was reported.
        size: u32,
    },
    /// Another user of the image holds a lock, in QEMU's image locking convention, that
    /// excludes vblk: it writes the image, or it refuses writers and vblk would write.
    #[error("{}", conflict_message(path, *conflict, holders))]
    Locked {
        /// The file or device.
        path: PathBuf,
        /// Which lock, on which byte.
        conflict: Conflict,
        /// The processes found holding it (`name (pid N)`); empty when none could be
        /// inspected.
        holders: Vec<String>,
    },
    /// The kernel or the file system refused an image lock.
    #[error(
        "{}: cannot take QEMU's image locks ({op} on byte {byte}): {}; pass --image-lock off \
         to serve it without image locking",
        path.display(),
        errno_text(source)
    )]
    LockFailed {
        /// The file or device.
        path: PathBuf,
        /// The `fcntl` command: `F_OFD_SETLK` or `F_OFD_GETLK`.
        op: &'static str,
        /// The byte it was about.
        byte: u64,
        /// What it said.
        #[source]
        source: io::Error,
    },
    /// A qcow2 image that cannot be served as asked: its header, its tables or its
    /// backing chain.
    #[error("{}: {why}", path.display())]
    Qcow2 {
        /// The image.
        path: PathBuf,
        /// What is wrong, with the numbers and the way out.
        why: String,
    },
    /// The file or device holds an image format other than raw.
    #[error("{}", refusal(path, *format, *read_only))]
    NotRaw {
        /// The file or device.
        path: PathBuf,
        /// What the probe found.
        format: ImageFormat,
        /// Whether it was to be served read-only (the harm differs).
        read_only: bool,
    },
    /// A RAM disk could not be created.
    #[error("mem:{}: {op}: {}", format_size(*size), errno_text(source))]
    Mem {
        /// Its size in bytes.
        size: u64,
        /// The call that failed, e.g. `mmap`.
        op: &'static str,
        /// What it said.
        #[source]
        source: io::Error,
    },
    /// An engine depth of 0, or more than an engine can hold.
    #[error("engine depth {depth} is out of range 1..={max}")]
    Depth {
        /// The depth that was asked for.
        depth: u32,
        /// The largest depth allowed.
        max: u32,
    },
    /// The aio engine on a file or block device opened through the page cache. Linux AIO
    /// is asynchronous only with O_DIRECT; on the page cache `io_submit` does each request
    /// itself, so the worker would block as with the sync engine. QEMU refuses the same
    /// (`aio=native` without `cache.direct=on`).
    #[error(
        "{}: the aio engine requires cache=none (O_DIRECT): Linux AIO on the page cache \
         does every request inside io_submit, blocking the worker; use --cache none, or \
         --engine io_uring, threads or sync with --cache writeback",
        path.display()
    )]
    AioNeedsDirect {
        /// The disk.
        path: PathBuf,
    },
    /// `io_setup` refused for want of AIO events system-wide (`fs.aio-max-nr`).
    #[error(
        "aio engine with depth {depth}: io_setup: the system's limit on AIO events is \
         reached (/proc/sys/fs/aio-max-nr {max_nr}, in use {in_use}); raise fs.aio-max-nr, \
         or lower --queue-size, --num-queues or --threads"
    )]
    AioLimit {
        /// The depth that was asked for.
        depth: u32,
        /// `/proc/sys/fs/aio-max-nr` (0 if unreadable).
        max_nr: u64,
        /// `/proc/sys/fs/aio-nr` (0 if unreadable).
        in_use: u64,
    },
    /// A thread pool size out of range.
    #[error("--engine-threads {threads}: must be between 1 and {max}")]
    EngineThreads {
        /// The size asked for.
        threads: usize,
        /// The largest size allowed.
        max: usize,
    },
    /// An NBD export could not be named, reached or served.
    #[error("{uri}: {source}")]
    Nbd {
        /// The URI, as given or as vblk writes it.
        uri: String,
        /// What went wrong.
        #[source]
        source: crate::nbd::NbdError,
    },
    /// The kernel refused to set up an engine (e.g. io_uring disabled).
    #[error("{engine} engine with depth {depth}: {}", errno_text(source))]
    EngineSetup {
        /// The engine's name.
        engine: &'static str,
        /// The depth that was asked for.
        depth: u32,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// A part after `hdd:SIZE:` is neither a speed factor `xN` (N from 1 to 1000000)
    /// nor `norot`, or is given twice, or comes in another order.
    #[error("hdd option {input:?}: expected hdd:SIZE[:xN][:norot] with N from 1 to 1000000 (e.g. hdd:1G:x10, hdd:1G:norot)")]
    BadSpeedup {
        /// The text that was given.
        input: String,
    },
}

impl Error {
    /// The errno behind this error, when a system call failed.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Open { source, .. }
            | Error::Io { source, .. }
            | Error::LockFailed { source, .. }
            | Error::Mem { source, .. }
            | Error::EngineSetup { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// `io::Error`'s text without the trailing ` (os error N)`, so that messages read
/// like the C tools': `/x/y.img: No such file or directory`.
fn errno_text(e: &io::Error) -> String {
    let text = e.to_string();
    match e.raw_os_error() {
        Some(code) => {
            let suffix = format!(" (os error {code})");
            text.strip_suffix(&suffix).unwrap_or(&text).to_owned()
        }
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_error_reads_like_c() {
        let e = Error::Open {
            path: "/x/y.img".into(),
            source: io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert_eq!(e.to_string(), "/x/y.img: No such file or directory");
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn unaligned_file_names_the_numbers() {
        let e = Error::UnalignedFile {
            path: "/x/y.img".into(),
            size: 1000,
            block: 512,
        };
        assert_eq!(
            e.to_string(),
            "/x/y.img: size 1000 is not a multiple of 512"
        );
    }

    #[test]
    fn mem_error_names_the_size() {
        let e = Error::Mem {
            size: 1 << 30,
            op: "mmap",
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        assert_eq!(e.to_string(), "mem:1G: mmap: Cannot allocate memory");
    }
}
