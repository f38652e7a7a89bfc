#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fastsan_brp::fuzz_checks::request(data));
