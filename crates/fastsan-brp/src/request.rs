//! Requests: the fixed 32-byte header and the framing of one request.
//!
//! ```text
//! offset size field
//!  0      4   magic        0x42525051 ("QPRB" in memory, little-endian "BRPQ")
//!  4      1   opcode       Command
//!  5      1   flags        FLAG_FUA
//!  6      2   count        BATCH: number of sub-requests; otherwise 0
//!  8      8   tag          chosen by the initiator, echoed in the reply
//! 16      8   offset       byte offset in the volume
//! 24      4   length       bytes of I/O (READ, WRITE, TRIM, WRITE_ZEROES)
//! 28      4   payload_len  bytes that follow the header in this frame
//! ```
//! All integers are little-endian. The frame is the header, then (with the
//! DIGEST feature) a 4-byte header digest, then `payload_len` bytes, then
//! (with DIGEST and a non-empty payload) a 4-byte data digest.

use crate::digest::{self, DIGEST_LEN};
use crate::limits::MAX_PAYLOAD;
use crate::{u16_at, u32_at, u64_at, ProtocolError};

pub const REQUEST_MAGIC: u32 = 0x4252_5051;
pub const REQUEST_HEADER_LEN: usize = 32;

/// Write flag: the data is durable before the reply (Force Unit Access).
pub const FLAG_FUA: u8 = 0x01;
/// Every flag bit this version defines.
pub const FLAGS_KNOWN: u8 = FLAG_FUA;

/// Declares the commands once: each variant with its opcode, decoded and
/// encoded from the same table.
macro_rules! commands {
    ($($(#[$doc:meta])* $name:ident = $op:literal,)+) => {
        /// A command, as decoded from its opcode. Unknown opcodes are kept, so the
        /// target can answer them with `UNSUPPORTED` and go on.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Command {
            $($(#[$doc])* $name,)+
            Unknown(u8),
        }

        impl Command {
            pub fn from_opcode(op: u8) -> Command {
                match op {
                    $($op => Command::$name,)+
                    other => Command::Unknown(other),
                }
            }

            pub fn opcode(self) -> u8 {
                match self {
                    $(Command::$name => $op,)+
                    Command::Unknown(op) => op,
                }
            }
        }
    };
}

commands! {
    Read = 1,
    Write = 2,
    Flush = 3,
    Trim = 4,
    WriteZeroes = 5,
    /// N sub-requests in one frame (see [`crate::batch`]).
    Batch = 6,
}

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub command: Command,
    pub flags: u8,
    pub count: u16,
    pub tag: u64,
    pub offset: u64,
    pub length: u32,
    pub payload_len: u32,
}

impl RequestHeader {
    /// A single request (not a BATCH). WRITE carries its data as payload.
    pub fn new(command: Command, flags: u8, tag: u64, offset: u64, length: u32) -> Self {
        let payload_len = if command == Command::Write { length } else { 0 };
        RequestHeader { command, flags, count: 0, tag, offset, length, payload_len }
    }

    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
        b[4] = self.command.opcode();
        b[5] = self.flags;
        b[6..8].copy_from_slice(&self.count.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..28].copy_from_slice(&self.length.to_le_bytes());
        b[28..32].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes a header from exactly 32 bytes, checking the magic and the
    /// payload limit (the only fields that decide whether the stream stays in sync).
    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, ProtocolError> {
        let magic = u32_at(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(ProtocolError::BadMagic(magic));
        }
        let payload_len = u32_at(b, 28);
        if payload_len > MAX_PAYLOAD {
            return Err(ProtocolError::PayloadTooLarge {
                len: payload_len as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        Ok(RequestHeader {
            command: Command::from_opcode(b[4]),
            flags: b[5],
            count: u16_at(b, 6),
            tag: u64_at(b, 8),
            offset: u64_at(b, 16),
            length: u32_at(b, 24),
            payload_len,
        })
    }

    pub fn is_fua(&self) -> bool {
        self.flags & FLAG_FUA != 0
    }
}

/// Where the parts of one complete request frame lie in the buffer it was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFrame {
    pub header: RequestHeader,
    /// Offset of the payload from the start of the frame.
    pub payload_at: usize,
    /// Total bytes of the frame, digests included.
    pub frame_len: usize,
    /// False when the DIGEST feature is on and the payload's digest did not
    /// match: the frame is consumed and answered with `DIGEST_MISMATCH`.
    pub payload_ok: bool,
}

impl RequestFrame {
    pub fn payload<'a>(&self, frame: &'a [u8]) -> &'a [u8] {
        &frame[self.payload_at..self.payload_at + self.header.payload_len as usize]
    }
}

/// Length of the whole frame for a header, with or without digests.
pub fn frame_len(payload_len: u32, digests: bool) -> usize {
    let d = if digests { DIGEST_LEN } else { 0 };
    let data_digest = if digests && payload_len > 0 { DIGEST_LEN } else { 0 };
    REQUEST_HEADER_LEN + d + payload_len as usize + data_digest
}

/// Two-phase framing: looks at the start of `buf` and returns
/// `Ok(None)` when more bytes are needed (nothing is allocated), `Ok(Some)`
/// when a whole frame is there, `Err` when the bytes cannot be a frame.
pub fn parse_request(buf: &[u8], digests: bool) -> Result<Option<RequestFrame>, ProtocolError> {
    let Some(hb) = buf.first_chunk::<REQUEST_HEADER_LEN>() else {
        return Ok(None);
    };
    let header = RequestHeader::decode(hb)?;
    let mut at = REQUEST_HEADER_LEN;
    if digests {
        let Some(trailer) = buf.get(at..at + DIGEST_LEN) else {
            return Ok(None);
        };
        if !digest::verify(hb, trailer) {
            return Err(ProtocolError::HeaderDigest);
        }
        at += DIGEST_LEN;
    }
    let frame_len = frame_len(header.payload_len, digests);
    if buf.len() < frame_len {
        return Ok(None);
    }
    let payload = &buf[at..at + header.payload_len as usize];
    let payload_ok =
        !digests || payload.is_empty() || digest::verify(payload, &buf[frame_len - DIGEST_LEN..frame_len]);
    Ok(Some(RequestFrame { header, payload_at: at, frame_len, payload_ok }))
}

/// Encodes a request frame's header part (header, and header digest when
/// `digests`) into `out`. The caller appends the payload, then
/// [`encode_data_digest`] when `digests` and the payload is not empty.
pub fn encode_header(h: &RequestHeader, digests: bool, out: &mut impl Extend<u8>) {
    let b = h.encode();
    out.extend(b);
    if digests {
        out.extend(digest::crc(&b).to_le_bytes());
    }
}

/// The 4-byte data digest trailer of a payload.
pub fn encode_data_digest(payload: &[u8]) -> [u8; DIGEST_LEN] {
    digest::crc(payload).to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(h: &RequestHeader, payload: &[u8], digests: bool) -> Vec<u8> {
        let mut v = Vec::new();
        encode_header(h, digests, &mut v);
        v.extend_from_slice(payload);
        if digests && !payload.is_empty() {
            v.extend(encode_data_digest(payload));
        }
        v
    }

    #[test]
    fn incomplete_then_complete() {
        let h = RequestHeader::new(Command::Write, FLAG_FUA, 7, 4096, 5);
        let f = frame(&h, b"hello", false);
        for cut in 0..f.len() {
            assert_eq!(parse_request(&f[..cut], false), Ok(None), "cut at {cut}");
        }
        let got = parse_request(&f, false).unwrap().unwrap();
        assert_eq!(got.header, h);
        assert_eq!(got.payload(&f), b"hello");
        assert_eq!(got.frame_len, f.len());
    }

    #[test]
    fn bad_magic_is_invalid() {
        let mut f = frame(&RequestHeader::new(Command::Read, 0, 1, 0, 512), &[], false);
        f[0] ^= 0xff;
        assert!(matches!(parse_request(&f, false), Err(ProtocolError::BadMagic(_))));
    }

    #[test]
    fn oversized_payload_is_invalid_before_it_arrives() {
        let mut h = RequestHeader::new(Command::Write, 0, 1, 0, 0);
        h.payload_len = MAX_PAYLOAD + 1;
        let b = h.encode();
        assert!(matches!(parse_request(&b, false), Err(ProtocolError::PayloadTooLarge { .. })));
    }

    #[test]
    fn digests_catch_corruption() {
        let h = RequestHeader::new(Command::Write, 0, 9, 0, 4);
        let f = frame(&h, b"data", true);
        assert!(parse_request(&f, true).unwrap().unwrap().payload_ok);
        let mut bad_data = f.clone();
        bad_data[REQUEST_HEADER_LEN + DIGEST_LEN] ^= 1;
        assert!(!parse_request(&bad_data, true).unwrap().unwrap().payload_ok);
        let mut bad_header = f.clone();
        bad_header[8] ^= 1;
        assert_eq!(parse_request(&bad_header, true), Err(ProtocolError::HeaderDigest));
    }

    fn any_header() -> impl Strategy<Value = RequestHeader> {
        (any::<u8>(), any::<u8>(), any::<u16>(), any::<u64>(), any::<u64>(), any::<u32>(), 0..=MAX_PAYLOAD)
            .prop_map(|(op, flags, count, tag, offset, length, payload_len)| RequestHeader {
                command: Command::from_opcode(op),
                flags,
                count,
                tag,
                offset,
                length,
                payload_len,
            })
    }

    proptest! {
        #[test]
        fn header_round_trip(h in any_header()) {
            prop_assert_eq!(RequestHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn opcode_round_trip(op in any::<u8>()) {
            prop_assert_eq!(Command::from_opcode(op).opcode(), op);
        }

        #[test]
        fn frame_round_trip(payload in proptest::collection::vec(any::<u8>(), 0..2048),
                            tag in any::<u64>(), digests in any::<bool>()) {
            let mut h = RequestHeader::new(Command::Write, 0, tag, 0, payload.len() as u32);
            h.payload_len = payload.len() as u32;
            let f = frame(&h, &payload, digests);
            let got = parse_request(&f, digests).unwrap().unwrap();
            prop_assert_eq!(got.header, h);
            prop_assert_eq!(got.payload(&f), &payload[..]);
            prop_assert!(got.payload_ok);
            prop_assert_eq!(got.frame_len, f.len());
        }

        #[test]
        fn never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..128), digests in any::<bool>()) {
            let _ = parse_request(&bytes, digests);
        }
    }
}
