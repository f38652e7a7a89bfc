//! Initiator errors, each with a decision about retrying.

use brp::{ProtocolError, Status};
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
