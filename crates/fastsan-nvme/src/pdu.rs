//! NVMe/TCP PDUs: framing, headers, data offset, digests.
//!
//! Every PDU starts with an 8-byte common header:
//! ```text
//!  0  1  type    (pdu::kind)
//!  1  1  flags   HDGSTF=0x01 DDGSTF=0x02 LAST_PDU=0x04 SUCCESS=0x08
//!  2  1  hlen    header length, common header included (fixed per type)
//!  3  1  pdo     PDU data offset: where the data starts (0 without data)
//!  4  4  plen    the whole PDU: header, header digest, padding, data, data digest
//! ```
//! With header digests on, a CRC32C of the `hlen` header bytes follows the
//! header; the data starts at `pdo` (padding in between, for the receiver's
//! alignment); with data digests on, a CRC32C of the data follows it. The
//! Initialize Connection and Termination PDUs never carry digests: they are
//! exchanged before digests are agreed, or when nothing can be trusted.

use crate::command::{Cqe, Sqe, CQE_LEN, SQE_LEN};
use crate::{le16, le32, ProtocolError};

/// PDU types.
pub mod kind {
    pub const IC_REQ: u8 = 0x00;
    pub const IC_RESP: u8 = 0x01;
    pub const H2C_TERM_REQ: u8 = 0x02;
    pub const C2H_TERM_REQ: u8 = 0x03;
    pub const CAPSULE_CMD: u8 = 0x04;
    pub const CAPSULE_RESP: u8 = 0x05;
    pub const H2C_DATA: u8 = 0x06;
    pub const C2H_DATA: u8 = 0x07;
    pub const R2T: u8 = 0x09;
}

/// Common header flags.
pub mod flag {
    /// A header digest follows the header.
    pub const HDGSTF: u8 = 0x01;
    /// A data digest follows the data.
    pub const DDGSTF: u8 = 0x02;
    /// H2CData/C2HData: the last PDU of the transfer.
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command succeeded, no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal Error Status codes of a Termination Request.
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    pub const R2T_LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// Length of the common header.
pub const CH_LEN: usize = 8;
/// Length of a digest (CRC32C).
pub const DIGEST_LEN: usize = 4;
/// Header length of ICReq and ICResp.
pub const IC_LEN: u8 = 128;
/// The PDU format version both sides speak.
pub const PFV: u16 = 0;
/// Most bytes of the offending PDU header a Termination Request carries
/// (a Termination Request is 152 bytes at most).
pub const MAX_TERM_DATA: usize = 128;

/// Which digests the connection agreed on in ICReq/ICResp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// The Initialize Connection Request (host to controller), and Response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment: data in C2H PDUs starts at a multiple of (hpda+1)*4.
    pub hpda: u8,
    pub digests: Digests,
    /// Most outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment: data in H2C PDUs starts at a multiple of (cpda+1)*4.
    pub cpda: u8,
    pub digests: Digests,
    /// Most data bytes in one H2CData PDU.
    pub maxh2cdata: u32,
}

/// H2CData and C2HData headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// The command the data belongs to.
    pub cccid: u16,
    /// H2CData: the R2T's transfer tag.
    pub ttag: u16,
    /// Offset of this data within the command's transfer.
    pub datao: u32,
    /// Bytes of data in this PDU.
    pub datal: u32,
}

/// Ready to Transfer: the controller asks for `r2tl` bytes from `r2to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2t {
    pub cccid: u16,
    pub ttag: u16,
    pub r2to: u32,
    pub r2tl: u32,
}

/// A Termination Request: why the sender closes the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq {
    pub fes: u16,
    /// Fatal error information: the offset of the field in error, or for
    /// an unsupported parameter, its value.
    pub fei: u32,
}

/// A PDU's type-specific header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    IcReq(IcReq),
    IcResp(IcResp),
    H2cTermReq(TermReq),
    C2hTermReq(TermReq),
    CapsuleCmd(Sqe),
    CapsuleResp(Cqe),
    H2cData(DataHeader),
    C2hData(DataHeader),
    R2t(R2t),
}

impl Header {
    pub fn kind(&self) -> u8 {
        match self {
            Header::IcReq(_) => kind::IC_REQ,
            Header::IcResp(_) => kind::IC_RESP,
            Header::H2cTermReq(_) => kind::H2C_TERM_REQ,
            Header::C2hTermReq(_) => kind::C2H_TERM_REQ,
            Header::CapsuleCmd(_) => kind::CAPSULE_CMD,
            Header::CapsuleResp(_) => kind::CAPSULE_RESP,
            Header::H2cData(_) => kind::H2C_DATA,
            Header::C2hData(_) => kind::C2H_DATA,
            Header::R2t(_) => kind::R2T,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Header::IcReq(_) => "ICReq",
            Header::IcResp(_) => "ICResp",
            Header::H2cTermReq(_) => "H2CTermReq",
            Header::C2hTermReq(_) => "C2HTermReq",
            Header::CapsuleCmd(_) => "CapsuleCmd",
            Header::CapsuleResp(_) => "CapsuleResp",
            Header::H2cData(_) => "H2CData",
            Header::C2hData(_) => "C2HData",
            Header::R2t(_) => "R2T",
        }
    }
}

/// The header length of each type, and whether it may carry data and digests.
fn shape(kind: u8) -> Option<(u8, bool, bool)> {
    Some(match kind {
        kind::IC_REQ | kind::IC_RESP => (IC_LEN, false, false),
        // The offending header travels as the Termination Request's data.
        kind::H2C_TERM_REQ | kind::C2H_TERM_REQ => (24, true, false),
        kind::CAPSULE_CMD => ((CH_LEN + SQE_LEN) as u8, true, true),
        kind::CAPSULE_RESP => ((CH_LEN + CQE_LEN) as u8, false, true),
        kind::H2C_DATA | kind::C2H_DATA | kind::R2T => (24, kind != kind::R2T, true),
        _ => return None,
    })
}

/// A whole PDU as framed: its header, flags, and where its data is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    pub header: Header,
    pub flags: u8,
    /// The data's place in the framed bytes (empty when there is none).
    pub data: std::ops::Range<usize>,
    /// Whether the data digest matched (true without one). A mismatch is
    /// not a framing error: the receiver decides (a target fails the command).
    pub data_digest_ok: bool,
}

/// Two-phase framing: `Ok(None)` until the whole PDU is in `buf`, then the
/// PDU and the bytes it used. `digests` as agreed (all off before ICResp);
/// `max_data`: the most data bytes a PDU may carry here (checked before
/// anything is buffered: a bigger `plen` is an error at once).
pub fn parse(buf: &[u8], digests: Digests, max_data: u32) -> Result<Option<(Pdu, usize)>, ProtocolError> {
    let Some(f) = frame(buf, digests, max_data)? else { return Ok(None) };
    let header = f.header(buf)?;
    Ok(Some((Pdu { header, flags: f.flags, data: f.data, data_digest_ok: f.data_digest_ok }, f.len)))
}

/// A whole PDU, framed and checked as [`parse`] does, with its type's
/// header not decoded yet: a receiver's hot path decodes only what it uses
/// ([`Frame::sqe`]), without building and moving a [`Header`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The PDU type ([`kind`]).
    pub kind: u8,
    pub flags: u8,
    /// The data's place in the framed bytes (empty when there is none).
    pub data: std::ops::Range<usize>,
    /// Whether the data digest matched (true without one).
    pub data_digest_ok: bool,
    /// The PDU's whole length: the bytes it used.
    pub len: usize,
}

impl Frame {
    /// The type's header, from the PDU's bytes (`raw` starts with it),
    /// with its own rules checked (DATAL, a Termination Request's length).
    pub fn header(&self, raw: &[u8]) -> Result<Header, ProtocolError> {
        decode_header(self.kind, &raw[..self.len], self.data.len())
    }

    /// A CapsuleCmd's submission queue entry (`None` for other types); a
    /// CapsuleCmd has no header rules beyond the framing.
    #[inline]
    pub fn sqe(&self, raw: &[u8]) -> Option<Sqe> {
        (self.kind == kind::CAPSULE_CMD).then(|| sqe_of(raw))
    }

    /// A CapsuleResp's completion queue entry (`None` for other types): a
    /// host's hot path, as [`Frame::sqe`] is a controller's.
    #[inline]
    pub fn cqe(&self, raw: &[u8]) -> Option<Cqe> {
        (self.kind == kind::CAPSULE_RESP).then(|| cqe_of(raw))
    }

    /// A C2HData PDU's data header (`None` for other types), with DATAL
    /// checked against the data the PDU carries, as [`Frame::header`] does.
    #[inline]
    pub fn c2h_data(&self, raw: &[u8]) -> Option<Result<DataHeader, ProtocolError>> {
        (self.kind == kind::C2H_DATA).then(|| data_header_of(raw, self.data.len()))
    }
}

#[inline]
fn cqe_of(raw: &[u8]) -> Cqe {
    Cqe::decode(raw[CH_LEN..CH_LEN + 16].try_into().expect("a CapsuleResp is framed whole"))
}

/// An H2CData or C2HData PDU's header: DATAL must be the data carried.
#[inline]
fn data_header_of(b: &[u8], data_len: usize) -> Result<DataHeader, ProtocolError> {
    let d = DataHeader { cccid: le16(b, 8), ttag: le16(b, 10), datao: le32(b, 12), datal: le32(b, 16) };
    if d.datal as usize != data_len {
        return Err(ProtocolError::Length {
            plen: le32(b, 4),
            why: "DATAL differs from the data the PDU carries",
        });
    }
    Ok(d)
}

#[inline]
fn sqe_of(raw: &[u8]) -> Sqe {
    Sqe::decode(raw[CH_LEN..CH_LEN + SQE_LEN].try_into().expect("a CapsuleCmd is framed whole"))
}

/// The framing half of [`parse`]: every length, flag and digest checked.
#[inline]
pub fn frame(buf: &[u8], digests: Digests, max_data: u32) -> Result<Option<Frame>, ProtocolError> {
    let Some(ch) = buf.first_chunk::<CH_LEN>() else { return Ok(None) };
    let (kind, flags, hlen, pdo, plen) = (ch[0], ch[1], ch[2], ch[3], le32(ch, 4));
    let (want, carries_data, has_digests) = shape(kind).ok_or(ProtocolError::UnknownType(kind))?;
    if hlen != want {
        return Err(ProtocolError::HeaderLength { kind, hlen, want });
    }
    let limit = (want as u32 + 2 * DIGEST_LEN as u32 + 255).saturating_add(max_data);
    if plen > limit {
        return Err(ProtocolError::TooLarge { plen, limit });
    }
    let hd = has_digests && digests.header;
    if has_digests && (flags & flag::HDGSTF != 0) != hd {
        return Err(ProtocolError::Flags {
            flags,
            why: "the header digest flag differs from what was agreed",
        });
    }
    let header_end = hlen as usize + if hd { DIGEST_LEN } else { 0 };
    if (plen as usize) < header_end {
        return Err(ProtocolError::Length { plen, why: "shorter than its header" });
    }
    let has_data = plen as usize > header_end;
    if has_data && !carries_data {
        return Err(ProtocolError::Length { plen, why: "data in a PDU type that carries none" });
    }
    let dd = has_data && has_digests && digests.data;
    if has_digests && (flags & flag::DDGSTF != 0) != dd {
        return Err(ProtocolError::Flags { flags, why: "the data digest flag differs from what was agreed" });
    }
    if !has_digests && flags & (flag::HDGSTF | flag::DDGSTF) != 0 {
        return Err(ProtocolError::Flags { flags, why: "digests on a PDU that never carries them" });
    }
    let data_start = match (has_data, pdo) {
        (false, 0) => header_end,
        (false, _) => return Err(ProtocolError::DataOffset { pdo, hlen, plen }),
        // Termination Requests put their data right after the header.
        (true, 0) if !has_digests => header_end,
        (true, p) if (p as usize) < header_end => return Err(ProtocolError::DataOffset { pdo, hlen, plen }),
        (true, p) => p as usize,
    };
    let data_end = (plen as usize).checked_sub(if dd { DIGEST_LEN } else { 0 });
    let Some(data_end) = data_end.filter(|&e| e >= data_start && (!has_data || e > data_start)) else {
        return Err(ProtocolError::DataOffset { pdo, hlen, plen });
    };
    if buf.len() < plen as usize {
        return Ok(None);
    }
    let raw = &buf[..plen as usize];
    if hd && crc32c::crc32c(&raw[..hlen as usize]) != le32(raw, hlen as usize) {
        return Err(ProtocolError::HeaderDigest);
    }
    let data_digest_ok = !dd || crc32c::crc32c(&raw[data_start..data_end]) == le32(raw, data_end);
    Ok(Some(Frame { kind, flags, data: data_start..data_end, data_digest_ok, len: plen as usize }))
}

fn decode_header(kind: u8, b: &[u8], data_len: usize) -> Result<Header, ProtocolError> {
    let plen = le32(b, 4);
    let digests = |d: u8| Digests { header: d & 1 != 0, data: d & 2 != 0 };
    Ok(match kind {
        kind::IC_REQ => Header::IcReq(IcReq {
            pfv: le16(b, 8),
            hpda: b[10],
            digests: digests(b[11]),
            maxr2t: le32(b, 12),
        }),
        kind::IC_RESP => Header::IcResp(IcResp {
            pfv: le16(b, 8),
            cpda: b[10],
            digests: digests(b[11]),
            maxh2cdata: le32(b, 12),
        }),
        kind::H2C_TERM_REQ | kind::C2H_TERM_REQ => {
            if data_len > MAX_TERM_DATA {
                return Err(ProtocolError::Length {
                    plen,
                    why: "a Termination Request carries 152 bytes at most",
                });
            }
            let t = TermReq { fes: le16(b, 8), fei: le32(b, 10) };
            if kind == kind::H2C_TERM_REQ {
                Header::H2cTermReq(t)
            } else {
                Header::C2hTermReq(t)
            }
        }
        kind::CAPSULE_CMD => Header::CapsuleCmd(sqe_of(b)),
        kind::CAPSULE_RESP => Header::CapsuleResp(cqe_of(b)),
        kind::H2C_DATA | kind::C2H_DATA => {
            let d = data_header_of(b, data_len)?;
            if kind == kind::H2C_DATA {
                Header::H2cData(d)
            } else {
                Header::C2hData(d)
            }
        }
        kind::R2T => {
            Header::R2t(R2t { cccid: le16(b, 8), ttag: le16(b, 10), r2to: le32(b, 12), r2tl: le32(b, 16) })
        }
        other => return Err(ProtocolError::UnknownType(other)),
    })
}

/// Appends the PDU `header` with `data` to `out`: `extra_flags` (LAST_PDU,
/// SUCCESS) on top of the digest flags; data aligned to a multiple of
/// `align` bytes from the PDU's start (the peer's PDA, (pda+1)*4, at most
/// 128, so the offset fits its byte; 0 or 1: none).
pub fn encode(
    header: &Header,
    extra_flags: u8,
    data: &[u8],
    digests: Digests,
    align: usize,
    out: &mut Vec<u8>,
) {
    let start = out.len();
    encode_head(header, extra_flags, data.len(), digests, align, out);
    out.extend_from_slice(data);
    if let Some(d) = data_digest(header, data, digests) {
        out.extend_from_slice(&d);
    }
    debug_assert_eq!(out.len() - start, le32(&out[start..], 4) as usize);
}

/// Where a PDU's parts fall, as [`encode_head`] lays them out.
struct Layout {
    hlen: u8,
    has_digests: bool,
    /// Header and data digests present.
    hd: bool,
    dd: bool,
    /// Data offset and whole length.
    pdo: usize,
    plen: usize,
}

#[inline]
fn layout(header: &Header, data_len: usize, digests: Digests, align: usize) -> Layout {
    let (hlen, _, has_digests) = shape(header.kind()).expect("every Header has a shape");
    let hd = has_digests && digests.header;
    let dd = has_digests && digests.data && data_len > 0;
    let header_end = hlen as usize + if hd { DIGEST_LEN } else { 0 };
    let align = align.clamp(1, 128);
    let pdo = if data_len == 0 || !has_digests { header_end } else { header_end.next_multiple_of(align) };
    let plen = pdo + data_len + if dd { DIGEST_LEN } else { 0 };
    Layout { hlen, has_digests, hd, dd, pdo, plen }
}

/// The bytes [`encode`] writes for `header` with `data_len` bytes of data:
/// what to allocate for it.
pub fn encoded_len(header: &Header, data_len: usize, digests: Digests, align: usize) -> usize {
    layout(header, data_len, digests, align).plen
}

/// The part of [`encode`] before the data: the header, its digest and the
/// padding, for a PDU that will carry `data_len` bytes sent from elsewhere
/// (a read's data goes out as it is, never copied). The data follows, then
/// [`data_digest`] when there is one.
// Always inlined: a caller names one header type, and the match over the
// others folds away (a target's encoder calls this once per reply).
#[inline(always)]
pub fn encode_head(
    header: &Header,
    extra_flags: u8,
    data_len: usize,
    digests: Digests,
    align: usize,
    out: &mut Vec<u8>,
) {
    let kind = header.kind();
    let Layout { hlen, has_digests, hd, dd, pdo, plen } = layout(header, data_len, digests, align);
    let flags = extra_flags | if hd { flag::HDGSTF } else { 0 } | if dd { flag::DDGSTF } else { 0 };
    let pdo_field = if data_len == 0 || !has_digests { 0 } else { pdo as u8 };
    // Built whole on the stack, then appended once: no per-field growth
    // checks, and the unused header bytes are zero already.
    let mut h = [0u8; IC_LEN as usize];
    h[..4].copy_from_slice(&[kind, flags, hlen, pdo_field]);
    h[4..8].copy_from_slice(&(plen as u32).to_le_bytes());
    let mut put = |at: usize, v: &[u8]| h[at..at + v.len()].copy_from_slice(v);
    let digest_bits = |d: Digests| d.header as u8 | (d.data as u8) << 1;
    match header {
        Header::IcReq(r) => {
            put(8, &r.pfv.to_le_bytes());
            put(10, &[r.hpda, digest_bits(r.digests)]);
            put(12, &r.maxr2t.to_le_bytes());
        }
        Header::IcResp(r) => {
            put(8, &r.pfv.to_le_bytes());
            put(10, &[r.cpda, digest_bits(r.digests)]);
            put(12, &r.maxh2cdata.to_le_bytes());
        }
        Header::H2cTermReq(t) | Header::C2hTermReq(t) => {
            put(8, &t.fes.to_le_bytes());
            put(10, &t.fei.to_le_bytes());
        }
        Header::CapsuleCmd(sqe) => put(8, &sqe.encode()),
        Header::CapsuleResp(cqe) => put(8, &cqe.encode()),
        Header::H2cData(d) | Header::C2hData(d) => {
            put(8, &d.cccid.to_le_bytes());
            put(10, &d.ttag.to_le_bytes());
            put(12, &d.datao.to_le_bytes());
            put(16, &d.datal.to_le_bytes());
        }
        Header::R2t(r) => {
            put(8, &r.cccid.to_le_bytes());
            put(10, &r.ttag.to_le_bytes());
            put(12, &r.r2to.to_le_bytes());
            put(16, &r.r2tl.to_le_bytes());
        }
    }
    let h = &h[..hlen as usize];
    let start = out.len();
    out.reserve(pdo);
    out.extend_from_slice(h);
    if hd {
        out.extend_from_slice(&crc32c::crc32c(h).to_le_bytes());
    }
    // The padding up to the data, if any.
    out.resize(start + pdo, 0);
}

/// The data digest that follows `data` in a PDU of type `header`, when
/// the connection agreed on data digests.
pub fn data_digest(header: &Header, data: &[u8], digests: Digests) -> Option<[u8; 4]> {
    data_digest_parts(header, [data], digests)
}

/// [`data_digest`] of data sent as several pieces, as if they were one.
pub fn data_digest_parts<'a>(
    header: &Header,
    parts: impl IntoIterator<Item = &'a [u8]>,
    digests: Digests,
) -> Option<[u8; 4]> {
    let (_, _, has_digests) = shape(header.kind()).expect("every Header has a shape");
    if !(has_digests && digests.data) {
        return None;
    }
    let (crc, len) =
        parts.into_iter().fold((0, 0), |(crc, len), p| (crc32c::crc32c_append(crc, p), len + p.len()));
    (len > 0).then(|| crc.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Status;

    const BOTH: Digests = Digests { header: true, data: true };

    fn sqe() -> Sqe {
        let mut b = [0u8; 64];
        b[0] = 0x01; // write
        b[2] = 7;
        b[4] = 1;
        Sqe::decode(&b)
    }

    fn round_trip(h: Header, flags: u8, data: &[u8], d: Digests, align: usize) -> Vec<u8> {
        let mut out = Vec::new();
        encode(&h, flags, data, d, align, &mut out);
        for cut in 0..out.len() {
            assert_eq!(parse(&out[..cut], d, 1 << 20), Ok(None), "{} cut at {cut}", h.name());
        }
        let (pdu, used) = parse(&out, d, 1 << 20).unwrap().unwrap();
        assert_eq!((pdu.header, used, &out[pdu.data.clone()]), (h, out.len(), data));
        assert!(pdu.data_digest_ok);
        assert_eq!(pdu.flags & !(flag::HDGSTF | flag::DDGSTF), flags);
        // The framing alone, and the SQE read in place, agree with parse.
        let f = frame(&out, d, 1 << 20).unwrap().unwrap();
        assert_eq!((f.kind, f.len, f.data.clone()), (h.kind(), used, pdu.data.clone()));
        assert_eq!(f.header(&out), Ok(h));
        let sqe = match h {
            Header::CapsuleCmd(s) => Some(s),
            _ => None,
        };
        assert_eq!(f.sqe(&out), sqe);
        out
    }

    #[test]
    fn every_pdu_round_trips_with_and_without_digests() {
        let ic = IcReq { pfv: 0, hpda: 0, digests: BOTH, maxr2t: 0 };
        let out = round_trip(Header::IcReq(ic), 0, &[], BOTH, 0);
        assert_eq!((out.len(), out[2], out[11]), (128, 128, 3), "ICReq: 128 bytes, never a digest");
        let resp = IcResp { pfv: 0, cpda: 0, digests: BOTH, maxh2cdata: 131072 };
        round_trip(Header::IcResp(resp), 0, &[], BOTH, 0);
        for d in [Digests::default(), BOTH, Digests { header: true, data: false }] {
            round_trip(Header::CapsuleCmd(sqe()), 0, &[], d, 0);
            let out = round_trip(Header::CapsuleCmd(sqe()), 0, &[9; 4096], d, 32);
            assert_eq!(out[3] as usize % 32, 0, "in-capsule data aligned");
            let cqe = Cqe { dw0: 1, dw1: 0, sqhd: 3, sqid: 1, cid: 7, status: Status::SUCCESS, phase: false };
            round_trip(Header::CapsuleResp(cqe), 0, &[], d, 0);
            let dh = DataHeader { cccid: 7, ttag: 2, datao: 8192, datal: 512 };
            round_trip(Header::H2cData(dh), flag::LAST_PDU, &[5; 512], d, 4);
            round_trip(Header::C2hData(dh), flag::LAST_PDU | flag::SUCCESS, &[6; 512], d, 0);
            round_trip(Header::R2t(R2t { cccid: 7, ttag: 2, r2to: 0, r2tl: 65536 }), 0, &[], d, 0);
        }
        // A Termination Request carries the offending header as its data, no digests.
        let t = TermReq { fes: fes::HEADER_DIGEST, fei: 0 };
        let out = round_trip(Header::C2hTermReq(t), 0, &[1; 72], BOTH, 0);
        assert_eq!(out.len(), 24 + 72);
        let mut long = Vec::new();
        encode(&Header::H2cTermReq(t), 0, &[0; 129], BOTH, 0, &mut long);
        assert!(matches!(parse(&long, BOTH, 4096), Err(ProtocolError::Length { .. })), "153 bytes");
    }

    proptest::proptest! {
        /// Any header, any data, any digests and alignment: encode, then
        /// parse, gives them back, and every prefix asks for more.
        #[test]
        fn any_pdu_round_trips(
            which in 0u8..5,
            a in proptest::prelude::any::<u16>(),
            b in proptest::prelude::any::<u16>(),
            c in proptest::prelude::any::<u32>(),
            len in 0usize..3000,
            hd in proptest::prelude::any::<bool>(),
            dd in proptest::prelude::any::<bool>(),
            pda in 0usize..33,
        ) {
            let align = pda * 4;
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + a as usize) as u8).collect();
            let dh = DataHeader { cccid: a, ttag: b, datao: c, datal: len.max(1) as u32 };
            let (h, data) = match which {
                0 => (Header::H2cData(dh), if len == 0 { vec![1] } else { data }),
                1 => (Header::C2hData(dh), if len == 0 { vec![1] } else { data }),
                2 => (Header::R2t(R2t { cccid: a, ttag: b, r2to: c, r2tl: len as u32 }), vec![]),
                3 => {
                    let mut raw = [0u8; 64];
                    raw[..4].copy_from_slice(&c.to_le_bytes());
                    raw[60..62].copy_from_slice(&a.to_le_bytes());
                    (Header::CapsuleCmd(Sqe::decode(&raw)), data)
                }
                _ => {
                    let cqe = Cqe { dw0: c, dw1: 0, sqhd: a, sqid: b, cid: a ^ b, status: Status::SUCCESS, phase: false };
                    (Header::CapsuleResp(cqe), vec![])
                }
            };
            let d = Digests { header: hd, data: dd };
            let mut out = Vec::new();
            encode(&h, 0, &data, d, align, &mut out);
            proptest::prop_assert_eq!(parse(&out[..out.len() - 1], d, 4096), Ok(None));
            let (pdu, used) = parse(&out, d, 4096).unwrap().unwrap();
            proptest::prop_assert_eq!((pdu.header, used), (h, out.len()));
            proptest::prop_assert_eq!(&out[pdu.data.clone()], &data[..]);
        }
    }

    #[test]
    fn digests_are_checked() {
        let dh = DataHeader { cccid: 1, ttag: 1, datao: 0, datal: 8 };
        let mut out = Vec::new();
        encode(&Header::H2cData(dh), flag::LAST_PDU, b"abcdefgh", BOTH, 0, &mut out);
        let mut bad_header = out.clone();
        bad_header[12] ^= 1;
        assert_eq!(parse(&bad_header, BOTH, 4096), Err(ProtocolError::HeaderDigest));
        let mut bad_data = out.clone();
        let n = bad_data.len();
        bad_data[n - 5] ^= 1;
        let (pdu, _) = parse(&bad_data, BOTH, 4096).unwrap().unwrap();
        assert!(!pdu.data_digest_ok, "a data digest mismatch is reported, not a framing error");
        // Digests the connection did not agree on: refused.
        assert!(matches!(parse(&out, Digests::default(), 4096), Err(ProtocolError::Flags { .. })));
    }

    #[test]
    fn lies_are_errors_before_anything_is_buffered() {
        let mut out = Vec::new();
        encode(&Header::CapsuleCmd(sqe()), 0, &[1; 64], Digests::default(), 0, &mut out);
        // A plen beyond the limit: refused from the 8-byte header alone.
        let mut big = out[..8].to_vec();
        big[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse(&big, Digests::default(), 8192), Err(ProtocolError::TooLarge { .. })));
        let mut bad = out.clone();
        bad[0] = 0x08;
        assert_eq!(parse(&bad, Digests::default(), 8192), Err(ProtocolError::UnknownType(8)));
        let mut bad = out.clone();
        bad[2] = 70;
        assert!(matches!(parse(&bad, Digests::default(), 8192), Err(ProtocolError::HeaderLength { .. })));
        let mut bad = out.clone();
        bad[3] = 10; // data offset inside the header
        assert!(matches!(parse(&bad, Digests::default(), 8192), Err(ProtocolError::DataOffset { .. })));
        // DATAL that disagrees with the data.
        let mut d = Vec::new();
        let dh = DataHeader { cccid: 1, ttag: 1, datao: 0, datal: 8 };
        encode(&Header::C2hData(dh), 0, b"abcdefgh", Digests::default(), 0, &mut d);
        d[16] = 9;
        assert!(matches!(parse(&d, Digests::default(), 8192), Err(ProtocolError::Length { .. })));
        // Data on a CapsuleResp.
        let cqe = Cqe { dw0: 0, dw1: 0, sqhd: 0, sqid: 0, cid: 0, status: Status::SUCCESS, phase: false };
        let mut r = Vec::new();
        encode(&Header::CapsuleResp(cqe), 0, &[], Digests::default(), 0, &mut r);
        r.extend([0; 4]);
        r[4] = 28;
        assert!(matches!(parse(&r, Digests::default(), 8192), Err(ProtocolError::Length { .. })));
    }
}
