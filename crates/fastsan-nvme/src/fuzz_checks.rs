//! The property the NVMe/TCP fuzz target checks (shared with the corpus
//! replay test): any bytes, with any digest setting, either frame a PDU that
//! encodes back to exactly those bytes, or are refused; never a panic.

use crate::pdu::{encode, flag, parse, Digests};

/// The first byte chooses the digests (bit 0 header, bit 1 data) and the
/// alignment; the rest is a stream of PDUs.
pub fn pdu(data: &[u8]) {
    let Some((&sel, mut rest)) = data.split_first() else { return };
    let digests = Digests { header: sel & 1 != 0, data: sel & 2 != 0 };
    while let Ok(Some((p, used))) = parse(rest, digests, 1 << 16) {
        assert!(used <= rest.len() && p.data.end <= used);
        let raw = &rest[..used];
        if p.data_digest_ok {
            // Re-encoding with the same data offset gives the same bytes back
            // (padding is zeros when we write it: compare all but the padding).
            let mut out = Vec::new();
            let extra = p.flags & (flag::LAST_PDU | flag::SUCCESS);
            encode(&p.header, extra, &raw[p.data.clone()], digests, 1, &mut out);
            let reparsed = parse(&out, digests, 1 << 16).expect("what we encode parses").expect("whole");
            assert_eq!(reparsed.0.header, p.header);
            assert_eq!(&out[reparsed.0.data.clone()], &raw[p.data.clone()]);
        }
        rest = &rest[used..];
    }
}
