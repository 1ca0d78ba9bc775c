//! Chain walking and request parsing over guest memory: see `vblk_fuzz::chain`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vblk_fuzz::chain::run(data));
