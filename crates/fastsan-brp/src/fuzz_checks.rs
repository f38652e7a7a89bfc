//! The properties the fuzz targets check, kept here so that the fuzzers
//! (`fuzz/fuzz_targets/*`) and the corpus regression test run the same code.
//! Each takes arbitrary bytes; it must never panic, and whatever decodes must
//! encode back to the very bytes it came from.

use crate::batch::BatchBody;
use crate::handshake::parse_message;
use crate::reply::{parse_reply, ReplyHeader, REPLY_HEADER_LEN};
use crate::request::{parse_request, RequestHeader, REQUEST_HEADER_LEN};

/// First byte: digests on (odd) or off; the rest: a request stream.
pub fn request(data: &[u8]) {
    let Some((&mode, bytes)) = data.split_first() else {
        return;
    };
    let digests = mode & 1 == 1;
    if let Ok(Some(f)) = parse_request(bytes, digests) {
        assert!(f.frame_len <= bytes.len());
        let h: &[u8; REQUEST_HEADER_LEN] = bytes[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(&f.header.encode(), h);
        assert_eq!(RequestHeader::decode(h), Ok(f.header));
        let _ = f.payload(bytes);
    }
}

/// As [`request`], for replies.
pub fn reply(data: &[u8]) {
    let Some((&mode, bytes)) = data.split_first() else {
        return;
    };
    let digests = mode & 1 == 1;
    if let Ok(Some(f)) = parse_reply(bytes, digests) {
        assert!(f.frame_len <= bytes.len());
        let h: &[u8; REPLY_HEADER_LEN] = bytes[..REPLY_HEADER_LEN].try_into().unwrap();
        assert_eq!(&f.header.encode(), h);
        assert_eq!(ReplyHeader::decode(h), Ok(f.header));
    }
}

/// First two bytes: the BATCH count; the rest: the body.
pub fn batch(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let count = u16::from_le_bytes([data[0], data[1]]);
    let body = &data[2..];
    if let Ok(b) = BatchBody::parse(count, body) {
        let mut end = count as usize * REQUEST_HEADER_LEN;
        for sub in b.iter() {
            assert!(sub.payload_at >= end);
            end = sub.payload_at + sub.header.payload_len as usize;
            assert!(end <= body.len());
        }
        assert_eq!(end, body.len());
    }
}

/// A stream of handshake messages.
pub fn handshake(data: &[u8]) {
    if let Ok(Some((m, n))) = parse_message(data) {
        assert_eq!(m.to_vec(), &data[..n], "decode then encode gives the input back");
    }
}
