//! Runs every file of the committed fuzz corpus (seeds, and any crash
//! reproducer saved there) through the fuzz targets' checks, so that CI
//! guards them without a fuzzer.

use std::path::Path;

fn run(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        check(&bytes);
        // Every prefix too: the framing must say "incomplete", never panic.
        for cut in 0..bytes.len().min(256) {
            check(&bytes[..cut]);
        }
        n += 1;
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn request_corpus() {
    run("request", fastsan_brp::fuzz_checks::request);
}

#[test]
fn reply_corpus() {
    run("reply", fastsan_brp::fuzz_checks::reply);
}

#[test]
fn batch_corpus() {
    run("batch", fastsan_brp::fuzz_checks::batch);
}

#[test]
fn handshake_corpus() {
    run("handshake", fastsan_brp::fuzz_checks::handshake);
}
