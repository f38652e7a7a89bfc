//! BRP v2, the Block Remote Protocol of fastsan: a sans-IO codec.
//!
//! This crate owns the bytes on the wire and nothing else. It never touches a
//! socket or a file: it turns byte slices into typed frames and back, and it
//! says "incomplete" (wait for more bytes) apart from "invalid" (close the
//! connection) without allocating. The target and the initiator share it.
//! The normative specification is `docs/protocol.md`; this code follows it.
//!
//! # Layout
//! - [`limits`] - every hard limit, checked before any allocation.
//! - [`status`] - the status codes a reply or a handshake error carries.
//! - [`request`] - the 32-byte request header, commands and flags, and
//!   [`request::parse_request`], the two-phase framing of one request.
//! - [`batch`] - the BATCH body (N sub-request headers, then their payloads).
//! - [`reply`] - the 24-byte reply header and [`reply::parse_reply`].
//! - [`handshake`] - the messages exchanged before the transmission phase.
//! - [`auth`] - challenge-response proofs on a shared secret (HMAC-SHA256).
//! - [`digest`] - the optional CRC32C header and data digests.

pub mod auth;
pub mod batch;
pub mod digest;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod handshake;
pub mod limits;
pub mod reply;
pub mod request;
pub mod status;

pub use batch::{BatchBody, SubRequest};
pub use handshake::{Message, OpenInfo, VolumeInfo};
pub use reply::{ReplyFrame, ReplyHeader};
pub use request::{Command, RequestFrame, RequestHeader};
pub use status::Status;

/// The protocol version this crate speaks.
/// Version 2 added the connection slot to OPEN and the target instance and
/// volume generation to OPEN_REPLY (the fence and restart detection).
pub const VERSION: u16 = 2;

/// Feature bit: CRC32C digests of every header and every payload.
pub const FEATURE_DIGEST: u32 = 1;
/// Feature bit: the target honours OPEN's
/// [`OPEN_TAKEOVER`](handshake::OPEN_TAKEOVER) flag (a client sets the flag
/// only when HELLO agreed on this feature: an older target refuses it).
pub const FEATURE_TAKEOVER: u32 = 2;
/// All features this implementation understands.
pub const FEATURES_KNOWN: u32 = FEATURE_DIGEST | FEATURE_TAKEOVER;

/// Why a byte stream cannot be a BRP frame. The connection that sent it
/// cannot be trusted to stay in sync and must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("payload of {len} bytes exceeds the limit of {limit}")]
    PayloadTooLarge { len: u64, limit: u64 },
    #[error("reserved field is not zero")]
    Reserved,
    #[error("data digest mismatch in a BATCH (its tags cannot be trusted)")]
    BatchDigest,
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("malformed batch: {0}")]
    Batch(&'static str),
    #[error("malformed handshake message: {0}")]
    Handshake(&'static str),
    #[error("unknown handshake message kind {0}")]
    UnknownMessage(u16),
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
