//! The vblk driver: attach to any vhost-user-blk device (vblk's own, qemu-storage-daemon,
//! SPDK, ...) and do block I/O from an application, through the I/O path of your choice.
//!
//! Module map, in the order an I/O meets them:
//! - [`disk`]: attaching — vhost-user negotiation, shared memory, queue setup — and
//!   [`DiskInfo`], what the device offers (with vblk's [`DeviceHints`]).
//! - [`io`]: what the caller hands in and gets back: [`Io`], [`Completion`], [`Bufs`].
//! - [`queue`]: [`Queue`], one virtqueue owned by one thread: submit I/Os tagged with
//!   tokens, reap completions by polling or waiting.
//! - [`path`]: the I/O paths (bio, batch, request with its elevators, auto): what goes to
//!   the ring and when.
//! - `dispatch`: building virtio requests (splitting, joining merged I/Os), notifying,
//!   reaping, waiting; `table`: the in-flight table (one request may serve many I/Os; FUA
//!   emulation).
//! - [`passthru`]: raw virtio-blk commands on a submission/completion ring pair, polled.
//! - `ring`: the driver side of the split ring, with EVENT_IDX and indirect tables.
//! - [`mem`]: the shared memory region and the owned [`Buffer`]s carved out of it.
//! - [`error`]: [`Error`] and [`ErrorKind`] (with errnos).
//!
//! ```no_run
//! use vblk_driver::{Disk, DiskOptions, Io};
//! let disk = Disk::attach("/tmp/vblk.sock", &DiskOptions::default())?;
//! let mut q = disk.take_queue(0).unwrap();
//! let mut buf = q.alloc(4096)?;
//! buf.fill(0xAB);
//! q.submit(Io::write(0, buf, 1).fua()).map_err(|e| e.error)?;
//! let done = q.wait(None)?;
//! assert_eq!(done.token, 1);
//! done.result?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod disk;
mod dispatch;
pub mod error;
pub mod io;
pub mod mem;
pub mod passthru;
pub mod path;
pub mod queue;
mod ring;
mod table;
mod watch;

pub use disk::{DeviceHints, Disk, DiskInfo, DiskOptions};
pub use error::{Error, ErrorKind};
pub use io::{Bufs, Completion, Io, Op, SubmitError};
pub use mem::Buffer;
pub use passthru::{Cmd, Cqe, Data, NotIdle, Passthru, PassthruOptions};
pub use path::auto::{AutoReport, AutoTrial};
pub use path::request::RequestStats;
pub use path::{ElevatorKind, PathKind, RequestOptions};
pub use queue::{Queue, QueueOptions};
