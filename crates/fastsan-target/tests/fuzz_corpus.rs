//! Replays the committed corpus of the target's handshake fuzz targets (and
//! every prefix of each file) through their checks, so CI guards them
//! without a fuzzer.

use std::path::Path;

fn run(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        for cut in 0..=bytes.len().min(512) {
            check(&bytes[..cut]);
        }
        check(&bytes);
        n += 1;
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn brp_handshake_corpus() {
    run("target_brp_handshake", fastsan_target::fuzz_checks::brp_handshake);
}

#[test]
fn nbd_handshake_corpus() {
    run("target_nbd_handshake", fastsan_target::fuzz_checks::nbd_handshake);
}
