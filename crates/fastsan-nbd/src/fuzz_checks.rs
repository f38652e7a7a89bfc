//! The properties the NBD fuzz targets check (shared with the corpus replay test).

use crate::handshake::{parse_option, InfoRequest, MetaContextRequest};
use crate::transmission::{parse_reply_head, parse_request, Payload, Request, REQUEST_LEN};

/// A stream of transmission requests: whatever frames must encode back.
pub fn request(data: &[u8]) {
    if let Ok(Some((r, payload, used))) = parse_request(data) {
        assert_eq!(&r.encode()[..], &data[..REQUEST_LEN]);
        match payload {
            Payload::Inline(n) => assert_eq!(used, REQUEST_LEN + n as usize),
            Payload::None | Payload::Skip(_) => assert_eq!(used, REQUEST_LEN),
        }
        assert!(used <= data.len());
        assert_eq!(Request::decode(data[..REQUEST_LEN].try_into().unwrap()), Ok(r));
    }
    let _ = parse_reply_head(data);
}

/// A stream of handshake options, and their payload parsers.
pub fn option(data: &[u8]) {
    if let Ok(Some((o, used))) = parse_option(data) {
        assert_eq!(used, 16 + o.data.len());
        if let Ok(i) = InfoRequest::parse(&o.data) {
            assert_eq!(i.encode(), o.data);
        }
        if let Ok(m) = MetaContextRequest::parse(&o.data) {
            assert_eq!(m.encode(), o.data);
        }
    }
}
