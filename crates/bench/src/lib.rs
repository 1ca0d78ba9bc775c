//! `vblk bench`: the benchmark that judges virtio-blk I/O paths, fio-compatible, on vblk's
//! driver, against an embedded device, any vhost-user-blk socket, or the bare disk.
//!
//! Module map:
//! - [`job`]: fio job options and the fio job-file subset.
//! - [`workload`]: the I/O units a job issues (sequential, random with a full-period map,
//!   bssplit, rwmix).
//! - [`stats`]: latency histograms and CPU accounting.
//! - [`clock`]: the job loop's clock (the time-stamp counter where the kernel trusts it).
//! - [`target`]: an embedded device, a socket, or the baseline (no virtio).
//! - [`lane`]: one job thread's I/O channel: the driver's queue, or a storage engine.
//! - [`pace`]: fio's `rate_iops=` and `rate=` (equal offered load for comparisons).
//! - [`run`]: running a job (numjobs threads, iodepth, batching, ramp, verify).
//! - [`verify`]: crc32c sector headers and the written map.
//! - [`report`]: fio-like text, fio-shaped JSON, comparison tables and SVG charts.
//! - [`plan`]: jobs × variants × repeats, and the default run.
#![deny(missing_docs)]

pub mod clock;
pub mod job;
pub mod lane;
pub mod pace;
pub mod plan;
pub mod report;
pub mod run;
pub mod stats;
pub mod target;
pub mod verify;
pub mod workload;
