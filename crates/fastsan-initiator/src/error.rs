//! Initiator errors, each with a decision about retrying.

use fastsan_brp::{ProtocolError, Status};
use std::io;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("bad URL {0}")]
    Url(String),
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("target refused: {status}: {message}")]
    Refused { status: Status, message: String },
    #[error("the target requires a secret (--secret-file)")]
    SecretRequired,
    #[error("the target did not prove it knows the secret")]
    TargetNotAuthenticated,
    #[error("request failed: {0}")]
    Status(Status),
    /// The connection failed with the request in flight: its outcome is
    /// unknown (a write may or may not have reached the volume), as with any
    /// block device whose transport fails. Known limit: the target does not
    /// yet fence a dead connection's queued writes against the session's new
    /// connections, so a write of the lost connection still queued on a file
    /// volume's I/O pool may land after a newer write to the same range.
    #[error("connection lost")]
    ConnectionLost,
    #[error("data digest mismatch in a reply")]
    DigestMismatch,
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("unexpected handshake message: {0}")]
    Unexpected(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("timed out: {0}")]
    Timeout(&'static str),
}

impl Error {
    /// Whether the same request may succeed if sent again.
    pub fn is_retryable(&self) -> bool {
        match self {
            // The request may not have reached the target; the session reconnects.
            Error::ConnectionLost => true,
            // Corruption in transit; the next try usually arrives whole.
            Error::DigestMismatch => true,
            // The target was not there or not ready; it may be soon.
            Error::Connect { .. } | Error::Timeout(_) | Error::Io(_) => true,
            // The target is busy or shutting down: try again, perhaps elsewhere.
            Error::Refused { status, .. } => *status == Status::BUSY,
            Error::Status(s) => *s == Status::SHUTTING_DOWN || *s == Status::DIGEST_MISMATCH,
            // The same request will fail the same way.
            Error::Url(_)
            | Error::SecretRequired
            | Error::TargetNotAuthenticated
            | Error::Protocol(_)
            | Error::Unexpected(_)
            | Error::InvalidArgument(_) => false,
        }
    }
}
