//! The transmission phase: requests, simple replies, structured chunks.
//!
//! ```text
//! request (28 bytes): magic 0x25609513 u32, flags u16, type u16, cookie u64, offset u64, length u32
//!                     then `length` bytes of data for WRITE
//! simple reply (16):  magic 0x67446698 u32, error u32, cookie u64 [, data of a READ]
//! chunk header (20):  magic 0x668e33ef u32, flags u16, type u16, cookie u64, length u32, payload
//! ```

use crate::consts::*;
use crate::{be16, be32, be64, ProtocolError, MAX_PAYLOAD};

pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, ProtocolError> {
        let magic = be32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(ProtocolError::BadMagic(magic as u64));
        }
        Ok(Request {
            flags: be16(b, 4),
            command: be16(b, 6),
            cookie: be64(b, 8),
            offset: be64(b, 16),
            length: be32(b, 24),
        })
    }
}

/// What follows a request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Nothing.
    None,
    /// `len` bytes, already in the buffer right after the header.
    Inline(u32),
    /// A WRITE too large to hold: the caller reads and discards `len` bytes
    /// (the request is refused, the stream stays in sync).
    Skip(u32),
}

/// Two-phase framing of a request: `Ok(None)` until the header and (for a
/// WRITE up to [`MAX_PAYLOAD`]) its data are in `buf`; then the request, what
/// follows it, and the bytes to consume from `buf`.
pub fn parse_request(buf: &[u8]) -> Result<Option<(Request, Payload, usize)>, ProtocolError> {
    let Some(h) = buf.first_chunk::<REQUEST_LEN>() else {
        return Ok(None);
    };
    let r = Request::decode(h)?;
    if r.command != CMD_WRITE {
        return Ok(Some((r, Payload::None, REQUEST_LEN)));
    }
    if r.length > MAX_PAYLOAD {
        return Ok(Some((r, Payload::Skip(r.length), REQUEST_LEN)));
    }
    let total = REQUEST_LEN + r.length as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((r, Payload::Inline(r.length), total)))
}

/// Bytes the request at the start of `buf` needs in all, when its header is there.
pub fn request_need(buf: &[u8]) -> usize {
    match buf.first_chunk().map(Request::decode) {
        Some(Ok(r)) if r.command == CMD_WRITE && r.length <= MAX_PAYLOAD => REQUEST_LEN + r.length as usize,
        _ => REQUEST_LEN,
    }
}

pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

pub fn chunk_header(flags: u16, kind: u16, cookie: u64, length: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

/// The start of a reply, as a client reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHead {
    /// A simple reply; a successful READ's data follows (its length is the request's).
    Simple { error: u32, cookie: u64 },
    /// A structured chunk with `length` bytes of payload following.
    Chunk { flags: u16, kind: u16, cookie: u64, length: u32 },
}

/// Parses a reply header (the client side): `Ok(None)` until it is whole,
/// then the header and its size. A chunk's payload is bounded before it is read.
pub fn parse_reply_head(buf: &[u8]) -> Result<Option<(ReplyHead, usize)>, ProtocolError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    match be32(buf, 0) {
        SIMPLE_REPLY_MAGIC if buf.len() >= SIMPLE_REPLY_LEN => {
            Ok(Some((ReplyHead::Simple { error: be32(buf, 4), cookie: be64(buf, 8) }, SIMPLE_REPLY_LEN)))
        }
        STRUCTURED_REPLY_MAGIC if buf.len() >= CHUNK_HEADER_LEN => {
            let length = be32(buf, 16);
            // A data chunk carries at most a maximal payload plus its 8-byte offset.
            if length > MAX_PAYLOAD + 8 {
                return Err(ProtocolError::ReplyTooLarge { len: length, limit: MAX_PAYLOAD + 8 });
            }
            let head =
                ReplyHead::Chunk { flags: be16(buf, 4), kind: be16(buf, 6), cookie: be64(buf, 8), length };
            Ok(Some((head, CHUNK_HEADER_LEN)))
        }
        SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC => Ok(None),
        other => Err(ProtocolError::BadMagic(other as u64)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn write_framing_and_skip() {
        let r = Request { flags: CMD_FLAG_FUA, command: CMD_WRITE, cookie: 9, offset: 4096, length: 3 };
        let mut b = r.encode().to_vec();
        b.extend_from_slice(b"abc");
        for cut in 0..b.len() {
            assert_eq!(parse_request(&b[..cut]), Ok(None));
        }
        assert_eq!(parse_request(&b), Ok(Some((r, Payload::Inline(3), 31))));
        let big = Request { length: MAX_PAYLOAD + 1, ..r };
        assert_eq!(parse_request(&big.encode()), Ok(Some((big, Payload::Skip(MAX_PAYLOAD + 1), 28))));
        let read = Request { command: CMD_READ, length: u32::MAX, ..r };
        assert_eq!(parse_request(&read.encode()), Ok(Some((read, Payload::None, 28))));
    }

    #[test]
    fn reply_heads() {
        let s = simple_reply(EINVAL, 5);
        assert_eq!(parse_reply_head(&s), Ok(Some((ReplyHead::Simple { error: EINVAL, cookie: 5 }, 16))));
        let c = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 6, 4104);
        assert_eq!(
            parse_reply_head(&c),
            Ok(Some((ReplyHead::Chunk { flags: 1, kind: 1, cookie: 6, length: 4104 }, 20)))
        );
        assert_eq!(parse_reply_head(&c[..19]), Ok(None));
        assert!(parse_reply_head(&chunk_header(0, 1, 1, u32::MAX)).is_err());
        assert!(parse_reply_head(b"HTTP/1.1").is_err());
    }

    proptest! {
        #[test]
        fn request_round_trip(flags in any::<u16>(), command in any::<u16>(), cookie in any::<u64>(), offset in any::<u64>(), length in any::<u32>()) {
            let r = Request { flags, command, cookie, offset, length };
            prop_assert_eq!(Request::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = parse_request(&bytes);
            let _ = parse_reply_head(&bytes);
            let _ = request_need(&bytes);
        }
    }
}
