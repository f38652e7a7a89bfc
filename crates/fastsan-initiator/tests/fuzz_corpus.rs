//! Runs every file of the committed `initiator_handshake` fuzz corpus
//! (seeds, and any crash reproducer saved there) through the fuzz target's
//! check, so that CI guards them without a fuzzer.

use std::path::Path;

#[test]
fn initiator_handshake_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/initiator_handshake");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        fastsan_initiator::fuzz_checks::handshake(&bytes);
        // Every prefix too: a cut exchange must end in "need more", never a panic.
        for cut in 0..bytes.len().min(256) {
            fastsan_initiator::fuzz_checks::handshake(&bytes[..cut]);
        }
        n += 1;
    }
    assert!(n > 0, "no corpus in {}", dir.display());
}
