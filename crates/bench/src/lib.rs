//! `vblk bench`: fio-like jobs on vblk's driver.
#![deny(missing_docs)]

pub mod job;
pub mod stats;
pub mod workload;
