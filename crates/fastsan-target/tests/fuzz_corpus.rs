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

#[test]
fn nvme_corpus() {
    run("target_nvme", |d| {
        fastsan_target::fuzz_checks::nvme(d);
    });
    // The seeds reach past the handshake: every command of theirs is decoded
    // (the admin seed's 15 answers: AERs beyond the 4 held are refused; the
    // I/O seed's 5 commands, an R2T for the sixth, and the write its data completes).
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/target_nvme");
    // And so does every command whatever pieces the bytes come in: one byte
    // at a time, or several PDUs (and the start of the next) in one buffer,
    // which decode takes off the front in place.
    for (seed, want) in [("admin", 15), ("admin-digests", 15), ("io", 7), ("io-digests", 7)] {
        let mut bytes = std::fs::read(corpus.join(seed)).unwrap();
        for pieces in 0..16u8 {
            bytes[0] = bytes[0] & 0xf0 | pieces;
            let size = fastsan_target::fuzz_checks::nvme_pieces(pieces);
            assert_eq!(fastsan_target::fuzz_checks::nvme(&bytes), want, "{seed} in pieces of {size}");
        }
    }
}
