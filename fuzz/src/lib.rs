//! vblk's fuzz targets, as library code the thin `fuzz_targets/*.rs` binaries call.
//!
//! - [`chain`]: descriptor-chain walking and request parsing over guest memory.
//! - [`vhost_user`]: the vhost-user message stream against the device's control plane.
//! - [`qcow2_header`]: the qcow2 header parser over arbitrary bytes.
//! - [`qcow2_image`]: a whole qcow2 image, its tables included, opened and written.
//! - [`input`]: how both read decisions out of the fuzzer's bytes.
//!
//! See README.md for how to run them and how a crash becomes a regression test.

pub mod chain;
pub mod input;
pub mod qcow2_header;
pub mod qcow2_image;
pub mod vhost_user;

/// `VBLK_FUZZ_TRACE=1`: the targets print what they build and what came of it (for
/// replaying one input; far too much output for a campaign).
pub fn trace() -> bool {
    static T: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *T.get_or_init(|| std::env::var_os("VBLK_FUZZ_TRACE").is_some())
}
