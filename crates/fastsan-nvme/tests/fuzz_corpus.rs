//! Replays the committed NVMe/TCP fuzz corpus through the fuzz target's check.

use fastsan_nvme::pdu::{parse, Digests};
use std::path::Path;

#[test]
fn pdu_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/nvme_pdu");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if path.file_name().unwrap().to_string_lossy().starts_with("host-session") {
            // The seeds are whole, valid conversations: every PDU frames.
            let d = Digests { header: bytes[0] & 1 != 0, data: bytes[0] & 2 != 0 };
            let (mut rest, mut pdus) = (&bytes[1..], 0);
            while let Some((_, used)) = parse(rest, d, 1 << 16).unwrap() {
                rest = &rest[used..];
                pdus += 1;
            }
            assert!(
                rest.is_empty() && pdus == 5,
                "{}: {pdus} PDUs, {} bytes left",
                path.display(),
                rest.len()
            );
        }
        for cut in 0..=bytes.len().min(256) {
            fastsan_nvme::fuzz_checks::pdu(&bytes[..cut]);
        }
        fastsan_nvme::fuzz_checks::pdu(&bytes);
        n += 1;
    }
    assert!(n > 0, "no corpus");
}
