#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fastsan_initiator::fuzz_checks::handshake(data));
