#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| nbd::fuzz_checks::option(data));
