//! The qcow2 header parser over arbitrary cluster-0 bytes: see `vblk_fuzz::qcow2_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vblk_fuzz::qcow2_header::run(data));
