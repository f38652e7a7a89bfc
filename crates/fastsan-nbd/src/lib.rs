//! The NBD protocol, both sides, as a sans-IO codec: byte slices in, typed
//! messages out, and back. It follows the NetworkBlockDevice project's
//! `doc/proto.md`; every integer on the wire is big-endian.
//!
//! # Layout
//! - [`consts`] - magics, options, reply types, flags, commands, errnos.
//! - [`handshake`] - greeting, option requests and replies, and the payloads
//!   of INFO/GO and of the meta-context options.
//! - [`transmission`] - the 28-byte request, simple replies, structured
//!   reply chunks, with two-phase framing of requests and replies.

pub mod consts;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod handshake;
pub mod transmission;

/// Why bytes cannot be an NBD message. The connection cannot stay in sync.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("option {option} with a payload of {len} bytes exceeds the limit of {limit}")]
    OptionTooLarge { option: u32, len: u32, limit: u32 },
    #[error("reply payload of {len} bytes exceeds the limit of {limit}")]
    ReplyTooLarge { len: u32, limit: u32 },
}

/// Longest string (export name, query, message) the protocol allows.
pub const MAX_STRING: usize = 4096;
/// Largest option payload accepted: a name, and meta-context queries.
pub const MAX_OPTION: u32 = 16 * 1024;
/// Largest READ or WRITE served (as nbdkit's; advertised in
/// NBD_INFO_BLOCK_SIZE). A larger WRITE is refused with its payload drained.
pub const MAX_PAYLOAD: u32 = 64 << 20;

pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
