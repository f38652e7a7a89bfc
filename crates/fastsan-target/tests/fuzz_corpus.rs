//! Replays the committed corpus of the target's handshake fuzz targets (and
//! every prefix of each file) through their checks, so CI guards them
//! without a fuzzer.

use fastsan_target::fuzz_checks::{
    brp_handshake, brp_handshake_in, nbd_handshake, nbd_handshake_in, pieces, Fed,
};
use std::path::Path;

/// Seeds that are whole handshakes, of each protocol's corpus (the others
/// end at a refusal, a failed authentication or TLS, or want more bytes).
/// BRP's went from 4 to 5 when an OPEN of a volume not granted stopped
/// closing the connection (it is answered as a missing one, and the seed's
/// next OPEN finishes).
const BRP_FINISHED: usize = 5;
const NBD_FINISHED: usize = 4;

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

/// Every seed ends the same way, with as many bytes answered, whatever
/// pieces it comes in (one byte at a time, several messages in one buffer,
/// all at once); and the seeds that are whole handshakes finish. (As many,
/// not the same: a BRP session's identifier is random.)
fn same_in_any_pieces(target: &str, check: fn(&[u8], usize) -> Fed, finished: usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut done = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let whole = check(&bytes, usize::MAX);
        for selector in 0..15u8 {
            let size = pieces(selector);
            let got = check(&bytes, size);
            assert_eq!(
                (&got.end, got.sent.len()),
                (&whole.end, whole.sent.len()),
                "{} in pieces of {size}",
                path.display()
            );
        }
        done += (whole.end == "done") as usize;
    }
    assert_eq!(done, finished, "{target}: seeds that finish their handshake");
}

#[test]
fn brp_handshake_corpus() {
    run("target_brp_handshake", |d| {
        brp_handshake(d);
    });
    same_in_any_pieces("target_brp_handshake", brp_handshake_in, BRP_FINISHED);
}

#[test]
fn nbd_handshake_corpus() {
    run("target_nbd_handshake", |d| {
        nbd_handshake(d);
    });
    same_in_any_pieces("target_nbd_handshake", nbd_handshake_in, NBD_FINISHED);
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
        for p in 0..16u8 {
            bytes[0] = bytes[0] & 0xf0 | p;
            let size = pieces(p);
            assert_eq!(fastsan_target::fuzz_checks::nvme(&bytes), want, "{seed} in pieces of {size}");
        }
    }
}
