//! The vblk driver: attach to any vhost-user-blk device (vblk's own, qemu-storage-daemon,
//! SPDK, ...) and do block I/O from an application, through the I/O path of your choice.
//!
//! Module map:
//! - [`disk`]: attaching — vhost-user negotiation, shared memory, queue setup —
//!   and [`DiskInfo`], what the device offers.
//! - [`queue`]: [`Queue`], one virtqueue owned by one thread: submit reads, writes, flushes,
//!   discards and write-zeroes tagged with tokens; reap completions by polling or waiting.
//! - [`path`]: the I/O paths (bio, batch): when requests are published and the device told.
//! - `ring`: the driver side of the split ring, ours, with EVENT_IDX and indirect tables.
//! - [`mem`]: the shared memory region and the owned [`Buffer`]s carved out of it.
//! - [`error`]: [`Error`] and [`ErrorKind`] (with errnos).
//!
//! ```no_run
//! use vblk_driver::{Disk, DiskOptions};
//! let disk = Disk::attach("/tmp/vblk.sock", &DiskOptions::default())?;
//! let mut q = disk.take_queue(0).unwrap();
//! let mut buf = q.alloc(4096)?;
//! buf.fill(0xAB);
//! q.write(0, buf, 1).map_err(|e| e.error)?;
//! let done = q.wait(None)?;
//! assert_eq!(done.token, 1);
//! done.result?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod disk;
pub mod error;
pub mod mem;
pub mod path;
pub mod queue;
mod ring;
mod watch;

pub use disk::{Disk, DiskInfo, DiskOptions};
pub use error::{Error, ErrorKind};
pub use mem::Buffer;
pub use path::PathKind;
pub use queue::{Bufs, Completion, Queue, QueueOptions, SubmitError};
