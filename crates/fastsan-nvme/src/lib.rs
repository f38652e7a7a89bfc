//! NVMe over Fabrics on TCP (the NVMe/TCP transport binding), as a sans-IO
//! codec: byte slices in, typed PDUs, commands and completions out, and back.
//! Every integer on the wire is little-endian.
//!
//! # Layout
//! - [`pdu`] - the PDUs (ICReq, ICResp, CapsuleCmd, CapsuleResp, H2CData,
//!   C2HData, R2T, H2CTermReq, C2HTermReq): the 8-byte common header, each
//!   type's header, PDU data offset and padding, and the CRC32C header and
//!   data digests; two-phase framing with every length checked before use.
//! - [`command`] - the 64-byte submission queue entry inside a CapsuleCmd,
//!   its SGL data descriptor, and the 16-byte completion inside a CapsuleResp
//!   with its status codes.
//!
//! The transport's rules a target needs beyond the bytes (which PDU may come
//! when, credits, R2T flow) belong to the target; this crate only refuses what
//! can never be valid.

pub mod command;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod pdu;

/// Why bytes cannot be an NVMe/TCP PDU. The connection cannot stay in step:
/// the target answers with a C2HTermReq carrying [`ProtocolError::fes`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("unknown PDU type {0:#x}")]
    UnknownType(u8),
    #[error("PDU type {kind:#x} with a header length of {hlen} (it is {want})")]
    HeaderLength { kind: u8, hlen: u8, want: u8 },
    #[error("PDU of {plen} bytes: {why}")]
    Length { plen: u32, why: &'static str },
    #[error("PDU data offset {pdo} in a PDU of {plen} bytes with a header of {hlen}")]
    DataOffset { pdo: u8, hlen: u8, plen: u32 },
    #[error("PDU of {plen} bytes exceeds the limit of {limit}")]
    TooLarge { plen: u32, limit: u32 },
    #[error("PDU flags {flags:#x}: {why}")]
    Flags { flags: u8, why: &'static str },
    #[error("header digest mismatch")]
    HeaderDigest,
}

impl ProtocolError {
    /// The Fatal Error Status a C2HTermReq (or H2CTermReq) reports for it,
    /// and the offset of the field in error (the FEI) where there is one.
    pub fn fes(&self) -> (u16, u32) {
        use pdu::fes;
        match self {
            ProtocolError::HeaderDigest => (fes::HEADER_DIGEST, 0),
            ProtocolError::UnknownType(_) => (fes::INVALID_HEADER_FIELD, 0),
            ProtocolError::HeaderLength { .. } => (fes::INVALID_HEADER_FIELD, 2),
            ProtocolError::DataOffset { .. } => (fes::INVALID_HEADER_FIELD, 3),
            ProtocolError::Length { .. } | ProtocolError::TooLarge { .. } => (fes::INVALID_HEADER_FIELD, 4),
            ProtocolError::Flags { .. } => (fes::INVALID_HEADER_FIELD, 1),
        }
    }
}

#[inline]
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

#[inline]
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
