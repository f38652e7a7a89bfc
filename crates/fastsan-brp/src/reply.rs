//! Replies: the fixed 24-byte header and the framing of one reply.
//!
//! ```text
//! offset size field
//!  0      4   magic        0x42525052 (little-endian "RPRB")
//!  4      4   status       Status (0 = ok)
//!  8      8   tag          the request's tag
//! 16      4   payload_len  bytes of data that follow (a READ's data; else 0)
//! 20      4   reserved     0
//! ```
//! Digests as for requests: header digest after the header, data digest after
//! a non-empty payload. Replies come in any order; the tag matches them.

use crate::digest::{self, DIGEST_LEN};
use crate::limits::MAX_PAYLOAD;
use crate::status::Status;
use crate::{u32_at, u64_at, ProtocolError};

pub const REPLY_MAGIC: u32 = 0x4252_5052;
pub const REPLY_HEADER_LEN: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHeader {
    pub status: Status,
    pub tag: u64,
    pub payload_len: u32,
}

impl ReplyHeader {
    pub fn encode(&self) -> [u8; REPLY_HEADER_LEN] {
        let mut b = [0u8; REPLY_HEADER_LEN];
        b[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.status.0.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..20].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REPLY_HEADER_LEN]) -> Result<Self, ProtocolError> {
        let magic = u32_at(b, 0);
        if magic != REPLY_MAGIC {
            return Err(ProtocolError::BadMagic(magic));
        }
        if u32_at(b, 20) != 0 {
            return Err(ProtocolError::Reserved);
        }
        let payload_len = u32_at(b, 16);
        if payload_len > MAX_PAYLOAD {
            return Err(ProtocolError::PayloadTooLarge {
                len: payload_len as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        Ok(ReplyHeader { status: Status(u32_at(b, 4)), tag: u64_at(b, 8), payload_len })
    }

    /// Bytes of the header part on the wire (with its digest when `digests`).
    pub fn wire_len(digests: bool) -> usize {
        REPLY_HEADER_LEN + if digests { DIGEST_LEN } else { 0 }
    }

    /// The header part on the wire: header, then its digest when `digests`.
    pub fn encode_wire(&self, digests: bool) -> ([u8; REPLY_HEADER_LEN + DIGEST_LEN], usize) {
        let mut out = [0u8; REPLY_HEADER_LEN + DIGEST_LEN];
        let h = self.encode();
        out[..REPLY_HEADER_LEN].copy_from_slice(&h);
        if digests {
            out[REPLY_HEADER_LEN..].copy_from_slice(&digest::crc(&h).to_le_bytes());
        }
        (out, Self::wire_len(digests))
    }
}

/// Where the parts of one complete reply frame lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyFrame {
    pub header: ReplyHeader,
    pub payload_at: usize,
    pub frame_len: usize,
    /// False when digests are on and the data digest did not match.
    pub payload_ok: bool,
}

/// The first phase of [`parse_reply`]: the header at the front of `buf`,
/// checked (and its digest, when `digests`), once it is all there; the data
/// may still be on its way.
pub fn parse_reply_head(buf: &[u8], digests: bool) -> Result<Option<ReplyHeader>, ProtocolError> {
    let Some(hb) = buf.first_chunk::<REPLY_HEADER_LEN>() else {
        return Ok(None);
    };
    let header = ReplyHeader::decode(hb)?;
    if digests {
        let Some(trailer) = buf.get(REPLY_HEADER_LEN..REPLY_HEADER_LEN + DIGEST_LEN) else {
            return Ok(None);
        };
        if !digest::verify(hb, trailer) {
            return Err(ProtocolError::HeaderDigest);
        }
    }
    Ok(Some(header))
}

/// Two-phase framing of a reply, as [`crate::request::parse_request`].
pub fn parse_reply(buf: &[u8], digests: bool) -> Result<Option<ReplyFrame>, ProtocolError> {
    let Some(header) = parse_reply_head(buf, digests)? else {
        return Ok(None);
    };
    let at = ReplyHeader::wire_len(digests);
    let n = header.payload_len as usize;
    let data_digest = if digests && n > 0 { DIGEST_LEN } else { 0 };
    let frame_len = at + n + data_digest;
    if buf.len() < frame_len {
        return Ok(None);
    }
    let payload_ok = data_digest == 0 || digest::verify(&buf[at..at + n], &buf[at + n..frame_len]);
    Ok(Some(ReplyFrame { header, payload_at: at, frame_len, payload_ok }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(status in any::<u32>(), tag in any::<u64>(),
                      data in proptest::collection::vec(any::<u8>(), 0..1024), digests in any::<bool>()) {
            let h = ReplyHeader { status: Status(status), tag, payload_len: data.len() as u32 };
            let (hw, n) = h.encode_wire(digests);
            let mut f = hw[..n].to_vec();
            f.extend_from_slice(&data);
            if digests && !data.is_empty() {
                f.extend(digest::crc(&data).to_le_bytes());
            }
            for cut in 0..f.len() {
                prop_assert_eq!(parse_reply(&f[..cut], digests), Ok(None));
            }
            let got = parse_reply(&f, digests).unwrap().unwrap();
            prop_assert_eq!(got.header, h);
            prop_assert!(got.payload_ok);
            prop_assert_eq!(&f[got.payload_at..got.payload_at + data.len()], &data[..]);
            prop_assert_eq!(got.frame_len, f.len());
        }

        #[test]
        fn never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..128), digests in any::<bool>()) {
            let _ = parse_reply(&bytes, digests);
        }
    }
}
