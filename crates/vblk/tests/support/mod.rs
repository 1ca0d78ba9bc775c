//! Helpers shared by the end-to-end tests of the `vblk` crate.
//!
//! Each test binary includes this module with `mod support;` and uses a
//! subset of it, hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod assets;
pub mod bench;
pub mod cli;
pub mod daemon;
pub mod fio;
pub mod guest;
pub mod layer;
pub mod migration;
pub mod nbdkit;
pub mod raw_frontend;
pub mod raw_ring;
pub mod util;
