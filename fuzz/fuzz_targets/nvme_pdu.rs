#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fastsan_nvme::fuzz_checks::pdu(data));
