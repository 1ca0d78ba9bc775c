//! Where vblk's bytes live: disk backends and the I/O engines that move bytes
//! between them and the buffers a device hands over. Nothing here knows virtio.
//!
//! A disk is named by a [`DiskSpec`] (`PATH`, `mem:SIZE`, `null:SIZE`, `hdd:SIZE`, `nbd://...`), opened
//! once as a [`Backend`] shared behind an `Arc`, and each worker thread gets its
//! own [`Engine`] from [`Backend::engine`]: push [`Op`]s with tokens, `submit`
//! them in one go, `reap` [`Completion`]s.
//!
//! Module map:
//!
//! | module | holds |
//! | --- | --- |
//! | `spec` | [`DiskSpec`] and [`parse_size`]: the SPEC and size grammars |
//! | `error` | [`Error`]: everything that fails while naming, opening or setting up |
//! | `backend` | [`Backend`], [`OpenOptions`], [`ImageChecks`], [`CacheMode`], [`BackendKind`]: opening files, block devices (`BLKGETSIZE64`, `BLKSSZGET`), RAM disks (memfd + mmap) and null disks |
//! | `lock` | [`ImageLock`]: QEMU's image locking convention (OFD locks on bytes 100+i and 200+i), so that vblk and QEMU exclude each other as writers |
//! | `format` | [`Format`], [`ImageFormat`], [`probe`]: refusing qcow2, VMDK, VDI and the other formats that must not be served raw |
//! | `engine` | the contract: [`Engine`], [`Op`], [`Completion`], [`Full`], [`EngineKind`]; the completion ring and iovec checks the engines share |
//! | `uring_engine` | the io_uring engine: one ring per engine, eventfd, slots indexed by `user_data` |
//! | `aio_engine` | the aio engine: Linux AIO on O_DIRECT, batched `io_submit`, eventfd, a helper thread for what AIO cannot do |
//! | `aio_sys` | the Linux AIO system interface: context, `io_submit`, `io_getevents`, the completion ring's head and tail |
//! | `threads_engine` | the threads engine: a pool of threads per engine doing synchronous I/O |
//! | `carry` | slots and operations carried in pieces (short transfers, bounce pieces), shared by io_uring and aio |
//! | `pool` | the per-engine thread pool (threads engine, aio helper): one lock per engine, exact eventfd signalling |
//! | `sync_engine` | the sync engine: `preadv2`/`pwritev2` inside `submit` |
//! | `inline` | the RAM and null disks' engine: memcpy/memset inside `submit` |
//! | `sysio` | synchronous I/O both file engines share: short transfers, flush, discard and write-zeroes with their fallbacks |
//! | `hdd` | the simulated 7200 rpm disk (`hdd:SIZE`): its documented timing model, and the engine that serves a RAM disk's bytes with that disk's timing, completions delivered on a timerfd |
//! | `delay` | [`Delay`] and [`delayed`]: a testing aid that holds every Nth completion back, for out-of-order completions |
//! | [`nbd`] | NBD disks: the URI grammar, our client (handshake, pipelined requests matched by cookie, reconnect and replay) and its engine |
//! | [`qcow2`] | qcow2 images, groundwork (issue 22): the header and table entries parsed and checked as QEMU checks them, and a read-only mapping lookup with a bounded L2 slice cache; nothing is served from it yet |
//! | `bounce` | O_DIRECT alignment (`statx` `STATX_DIOALIGN`) and pooled aligned bounce buffers |
//!
//! Rules the engines keep: no heap allocation per operation once warm (slots,
//! completion rings and bounce buffers are preallocated or pooled and reused);
//! short reads and writes are finished, never reported as success; every error
//! is an errno in [`Completion::result`], never a panic.

#![deny(missing_docs)]

mod aio_engine;
mod aio_sys;
mod backend;
mod bounce;
mod carry;
mod delay;
mod engine;
mod error;
mod format;
mod handoff;
mod hdd;
mod inline;
mod lock;
pub mod nbd;
mod pool;
pub mod qcow2;
mod spec;
mod sync_engine;
mod sysio;
mod threads_engine;
mod uring_engine;

pub use backend::{Backend, BackendKind, CacheMode, ImageChecks, OpenOptions};
pub use delay::{delayed, Delay, Hold};
pub use engine::{Completion, Engine, EngineKind, Full, Op, MAX_DEPTH};
pub use error::Error;
pub use format::{probe, Format, ImageFormat, PROBE_HEAD, PROBE_TAIL};
pub use handoff::Holding;
pub use lock::{Conflict, ImageLock, Perm, PERM_BASE, SHARED_BASE};
pub use pool::POOL_THREAD_PREFIX;
pub use spec::{format_size, parse_size, DiskSpec, SECTOR_SIZE};
pub use threads_engine::{DEFAULT_ENGINE_THREADS, MAX_ENGINE_THREADS};
