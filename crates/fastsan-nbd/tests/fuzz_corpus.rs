//! Replays the committed NBD fuzz corpus through the fuzz targets' checks.

use std::path::Path;

fn run(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        for cut in 0..=bytes.len().min(256) {
            check(&bytes[..cut]);
        }
        check(&bytes);
        n += 1;
    }
    assert!(n > 0, "no corpus for {target}");
}

#[test]
fn request_corpus() {
    run("nbd_request", fastsan_nbd::fuzz_checks::request);
}

#[test]
fn option_corpus() {
    run("nbd_option", fastsan_nbd::fuzz_checks::option);
}
