//! BATCH: one frame carrying N sub-requests (the paper's jumbo command).
//!
//! The BATCH header has `count` = N (1..=MAX_BATCH), `payload_len` = the body
//! length, and tag, offset, length and flags zero. The body is the N
//! sub-request headers (32 bytes each, the ordinary request header layout),
//! then the payloads of those sub-requests back to back, in order. Each
//! sub-request keeps its own tag and gets its own reply; the BATCH itself gets
//! none. A body whose sizes do not add up, or a BATCH inside a BATCH, is a
//! protocol error (the connection closes): the stream can no longer be trusted.

use crate::limits::MAX_BATCH;
use crate::request::{Command, RequestHeader, REQUEST_HEADER_LEN};
use crate::ProtocolError;

/// One sub-request of a batch, with the position of its payload in the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubRequest {
    pub header: RequestHeader,
    pub payload_at: usize,
}

/// A validated BATCH body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchBody<'a> {
    body: &'a [u8],
    count: usize,
}

impl<'a> BatchBody<'a> {
    /// Checks a body against its BATCH header's `count`: every sub-header
    /// decodes, none is a BATCH, and the payload lengths add up exactly to
    /// the rest of the body.
    pub fn parse(count: u16, body: &'a [u8]) -> Result<Self, ProtocolError> {
        if count == 0 || count > MAX_BATCH {
            return Err(ProtocolError::Batch("count out of range"));
        }
        let count = count as usize;
        let headers_len = count * REQUEST_HEADER_LEN;
        if body.len() < headers_len {
            return Err(ProtocolError::Batch("body shorter than its headers"));
        }
        let mut payloads: usize = 0;
        for i in 0..count {
            let h = sub_header(body, i)?;
            if h.command == Command::Batch {
                return Err(ProtocolError::Batch("nested batch"));
            }
            payloads += h.payload_len as usize;
        }
        if headers_len + payloads != body.len() {
            return Err(ProtocolError::Batch("payload lengths do not add up"));
        }
        Ok(BatchBody { body, count })
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The sub-requests in order, each with where its payload is in the body.
    pub fn iter(&self) -> impl Iterator<Item = SubRequest> + '_ {
        let mut at = self.count * REQUEST_HEADER_LEN;
        (0..self.count).map(move |i| {
            let header = sub_header(self.body, i).expect("validated in parse");
            let sub = SubRequest { header, payload_at: at };
            at += header.payload_len as usize;
            sub
        })
    }
}

fn sub_header(body: &[u8], i: usize) -> Result<RequestHeader, ProtocolError> {
    let at = i * REQUEST_HEADER_LEN;
    let b: &[u8; REQUEST_HEADER_LEN] = body[at..at + REQUEST_HEADER_LEN].try_into().expect("32 bytes");
    RequestHeader::decode(b)
}

/// Builds a BATCH body: call [`BatchBuilder::push`] for each sub-request, then
/// [`BatchBuilder::finish`] to get the BATCH header and the body's parts.
#[derive(Default)]
pub struct BatchBuilder {
    headers: Vec<u8>,
    count: u16,
    payload_len: u32,
}

impl BatchBuilder {
    pub fn push(&mut self, h: &RequestHeader) {
        self.headers.extend_from_slice(&h.encode());
        self.count += 1;
        self.payload_len += h.payload_len;
    }

    pub fn count(&self) -> u16 {
        self.count
    }

    /// The BATCH header and the sub-request headers; the caller sends them,
    /// then the payloads in the order pushed.
    pub fn finish(self) -> (RequestHeader, Vec<u8>) {
        let body_len = self.headers.len() as u32 + self.payload_len;
        let h = RequestHeader {
            command: Command::Batch,
            flags: 0,
            count: self.count,
            tag: 0,
            offset: 0,
            length: 0,
            payload_len: body_len,
        };
        (h, self.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn build(subs: &[(RequestHeader, Vec<u8>)]) -> (RequestHeader, Vec<u8>) {
        let mut b = BatchBuilder::default();
        for (h, _) in subs {
            b.push(h);
        }
        let (h, mut body) = b.finish();
        for (_, p) in subs {
            body.extend_from_slice(p);
        }
        (h, body)
    }

    proptest! {
        #[test]
        fn round_trip(subs in proptest::collection::vec(
            (any::<u64>(), any::<bool>(), proptest::collection::vec(any::<u8>(), 0..600)), 1..40)) {
            let subs: Vec<_> = subs.into_iter().map(|(tag, write, data)| {
                if write {
                    (RequestHeader::new(Command::Write, 0, tag, 0, data.len() as u32), data)
                } else {
                    (RequestHeader::new(Command::Read, 0, tag, 0, data.len() as u32), vec![])
                }
            }).collect();
            let (h, body) = build(&subs);
            prop_assert_eq!(h.payload_len as usize, body.len());
            let parsed = BatchBody::parse(h.count, &body).unwrap();
            prop_assert_eq!(parsed.len(), subs.len());
            for (sub, (sh, data)) in parsed.iter().zip(&subs) {
                prop_assert_eq!(sub.header, *sh);
                prop_assert_eq!(&body[sub.payload_at..sub.payload_at + data.len()], &data[..]);
            }
        }

        #[test]
        fn never_panics_on_garbage(count in any::<u16>(), bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = BatchBody::parse(count, &bytes);
        }
    }

    #[test]
    fn rejects_mismatched_lengths_and_nesting() {
        let w = RequestHeader::new(Command::Write, 0, 1, 0, 4);
        let (h, mut body) = build(&[(w, b"abcd".to_vec())]);
        assert!(BatchBody::parse(h.count, &body).is_ok());
        body.push(0);
        assert!(BatchBody::parse(h.count, &body).is_err());
        let nested = RequestHeader { command: Command::Batch, ..w };
        let (h, body) = build(&[(nested, b"abcd".to_vec())]);
        assert_eq!(BatchBody::parse(h.count, &body), Err(ProtocolError::Batch("nested batch")));
        assert!(BatchBody::parse(0, &[]).is_err());
    }
}
