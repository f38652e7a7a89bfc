#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fastsan_nbd::fuzz_checks::request(data));
