//! The vhost-user message stream against the device: see `vblk_fuzz::vhost_user`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vblk_fuzz::vhost_user::run(data));
