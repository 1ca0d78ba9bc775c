//! A whole qcow2 image, opened writable and driven by requests: see `vblk_fuzz::qcow2_image`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vblk_fuzz::qcow2_image::run(data));
