//! The fixed newstyle handshake.
//!
//! ```text
//! S: NBDMAGIC u64, IHAVEOPT u64, handshake flags u16
//! C: client flags u32
//! C: IHAVEOPT u64, option u32, length u32, data        (repeated)
//! S: REPLY_MAGIC u64, option u32, type u32, length u32, data
//! ```

use crate::consts::*;
use crate::{be16, be32, be64, ProtocolError, MAX_OPTION, MAX_STRING};

/// The server's first 18 bytes.
pub fn greeting(flags: u16) -> [u8; 18] {
    let mut b = [0u8; 18];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&flags.to_be_bytes());
    b
}

/// A client's option request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionRequest {
    pub option: u32,
    pub data: Vec<u8>,
}

pub const OPTION_HEADER_LEN: usize = 16;

/// Two-phase framing of an option request: `Ok(None)` until it is whole.
/// A payload over [`MAX_OPTION`] is refused before it arrives.
pub fn parse_option(buf: &[u8]) -> Result<Option<(OptionRequest, usize)>, ProtocolError> {
    if buf.len() < OPTION_HEADER_LEN {
        return Ok(None);
    }
    let magic = be64(buf, 0);
    if magic != IHAVEOPT {
        return Err(ProtocolError::BadMagic(magic));
    }
    let option = be32(buf, 8);
    let len = be32(buf, 12);
    if len > MAX_OPTION {
        return Err(ProtocolError::OptionTooLarge { option, len, limit: MAX_OPTION });
    }
    let total = OPTION_HEADER_LEN + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((OptionRequest { option, data: buf[OPTION_HEADER_LEN..total].to_vec() }, total)))
}

/// Encodes an option request (the client side).
pub fn encode_option(option: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Appends one option reply.
pub fn encode_reply(option: u32, reply_type: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// An option reply, as a client reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

/// Two-phase framing of an option reply (the client side).
pub fn parse_reply(buf: &[u8]) -> Result<Option<(OptionReply, usize)>, ProtocolError> {
    if buf.len() < 20 {
        return Ok(None);
    }
    let magic = be64(buf, 0);
    if magic != REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic));
    }
    let len = be32(buf, 16);
    if len > MAX_OPTION {
        return Err(ProtocolError::ReplyTooLarge { len, limit: MAX_OPTION });
    }
    let total = 20 + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((
        OptionReply { option: be32(buf, 8), reply_type: be32(buf, 12), data: buf[20..total].to_vec() },
        total,
    )))
}

/// Why an option's payload is unacceptable (answered with `REP_ERR_INVALID`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("option payload is malformed: {0}")]
    Malformed(&'static str),
}

/// A cursor that fails instead of reading past the end.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], OptionError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or(OptionError::Malformed("shorter than its lengths say"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, OptionError> {
        Ok(be16(self.take(2)?, 0))
    }
    fn u32(&mut self) -> Result<u32, OptionError> {
        Ok(be32(self.take(4)?, 0))
    }
    fn string(&mut self, n: usize) -> Result<String, OptionError> {
        if n > MAX_STRING {
            return Err(OptionError::Malformed("string longer than 4096 bytes"));
        }
        let b = self.take(n)?;
        if b.contains(&0) {
            return Err(OptionError::Malformed("string contains NUL"));
        }
        String::from_utf8(b.to_vec()).map_err(|_| OptionError::Malformed("string is not UTF-8"))
    }
    fn end(&self) -> Result<(), OptionError> {
        if self.at == self.b.len() {
            Ok(())
        } else {
            Err(OptionError::Malformed("trailing bytes"))
        }
    }
}

/// The payload of NBD_OPT_EXPORT_NAME: the whole payload is the name.
pub fn parse_export_name(data: &[u8]) -> Result<String, OptionError> {
    Reader { b: data, at: 0 }.string(data.len())
}

/// The payload of NBD_OPT_INFO and NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

impl InfoRequest {
    pub fn parse(data: &[u8]) -> Result<Self, OptionError> {
        let mut r = Reader { b: data, at: 0 };
        let n = r.u32()? as usize;
        let name = r.string(n)?;
        let count = r.u16()? as usize;
        let mut infos = Vec::with_capacity(count.min(data.len() / 2));
        for _ in 0..count {
            infos.push(r.u16()?);
        }
        r.end()?;
        Ok(InfoRequest { name, infos })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        v.extend_from_slice(self.name.as_bytes());
        v.extend_from_slice(&(self.infos.len() as u16).to_be_bytes());
        for i in &self.infos {
            v.extend_from_slice(&i.to_be_bytes());
        }
        v
    }
}

/// The payload of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

impl MetaContextRequest {
    pub fn parse(data: &[u8]) -> Result<Self, OptionError> {
        let mut r = Reader { b: data, at: 0 };
        let n = r.u32()? as usize;
        let name = r.string(n)?;
        let count = r.u32()? as usize;
        let mut queries = Vec::with_capacity(count.min(data.len() / 4));
        for _ in 0..count {
            let n = r.u32()? as usize;
            queries.push(r.string(n)?);
        }
        r.end()?;
        Ok(MetaContextRequest { name, queries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        v.extend_from_slice(self.name.as_bytes());
        v.extend_from_slice(&(self.queries.len() as u32).to_be_bytes());
        for q in &self.queries {
            v.extend_from_slice(&(q.len() as u32).to_be_bytes());
            v.extend_from_slice(q.as_bytes());
        }
        v
    }
}

/// NBD_REP_INFO NBD_INFO_EXPORT: size and transmission flags.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = INFO_EXPORT.to_be_bytes().to_vec();
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

/// NBD_REP_INFO NBD_INFO_NAME or NBD_INFO_DESCRIPTION.
pub fn info_text(kind: u16, text: &str) -> Vec<u8> {
    let mut v = kind.to_be_bytes().to_vec();
    v.extend_from_slice(text.as_bytes());
    v
}

/// NBD_REP_INFO NBD_INFO_BLOCK_SIZE.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut v = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for x in [min, preferred, max] {
        v.extend_from_slice(&x.to_be_bytes());
    }
    v
}

/// NBD_REP_SERVER: one export of a LIST.
pub fn rep_server(name: &str, description: &str) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(description.as_bytes());
    v
}

/// NBD_REP_META_CONTEXT: a context id and its name.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut v = id.to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// The reply to NBD_OPT_EXPORT_NAME: size, flags, and 124 zero bytes
/// unless the client set NO_ZEROES.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut v = size.to_be_bytes().to_vec();
    v.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        v.extend_from_slice(&[0u8; 124]);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn option_framing() {
        let mut b = Vec::new();
        encode_option(
            OPT_GO,
            &InfoRequest { name: "vol0".into(), infos: vec![INFO_BLOCK_SIZE] }.encode(),
            &mut b,
        );
        for cut in 0..b.len() {
            assert_eq!(parse_option(&b[..cut]), Ok(None));
        }
        let (o, n) = parse_option(&b).unwrap().unwrap();
        assert_eq!((o.option, n), (OPT_GO, b.len()));
        assert_eq!(InfoRequest::parse(&o.data).unwrap(), InfoRequest { name: "vol0".into(), infos: vec![3] });
        let mut huge = b[..12].to_vec();
        huge.extend_from_slice(&(MAX_OPTION + 1).to_be_bytes());
        assert!(matches!(parse_option(&huge), Err(ProtocolError::OptionTooLarge { .. })));
    }

    #[test]
    fn malformed_payloads_are_errors() {
        assert!(InfoRequest::parse(&[0, 0, 0, 9, b'a']).is_err());
        assert!(InfoRequest::parse(&[0, 0, 0, 0, 0, 2, 0, 1]).is_err(), "promises 2 infos, has 1");
        assert!(InfoRequest::parse(&[0, 0, 0, 0, 0, 0, 7]).is_err(), "trailing byte");
        assert!(
            MetaContextRequest::parse(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_err(),
            "4G queries, no bytes"
        );
        assert!(parse_export_name(&[b'a', 0, b'b']).is_err());
        assert!(parse_export_name(&vec![b'a'; 4097]).is_err());
    }

    proptest! {
        #[test]
        fn info_round_trip(name in "[a-z0-9]{0,40}", infos in proptest::collection::vec(any::<u16>(), 0..10)) {
            let r = InfoRequest { name, infos };
            prop_assert_eq!(InfoRequest::parse(&r.encode()), Ok(r));
        }

        #[test]
        fn meta_round_trip(name in "[a-z0-9]{0,40}", queries in proptest::collection::vec("[a-z:]{0,20}", 0..6)) {
            let r = MetaContextRequest { name, queries };
            prop_assert_eq!(MetaContextRequest::parse(&r.encode()), Ok(r));
        }

        #[test]
        fn reply_round_trip(option in any::<u32>(), t in any::<u32>(), data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut b = Vec::new();
            encode_reply(option, t, &data, &mut b);
            prop_assert_eq!(parse_reply(&b), Ok(Some((OptionReply { option, reply_type: t, data }, b.len()))));
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_option(&bytes);
            let _ = parse_reply(&bytes);
            let _ = InfoRequest::parse(&bytes);
            let _ = MetaContextRequest::parse(&bytes);
        }
    }
}
