#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fastsan_target::fuzz_checks::nbd_handshake(data);
});
