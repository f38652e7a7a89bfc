#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| brp::fuzz_checks::handshake(data));
