//! Initiator errors, each with a decision about retrying.
//!
//! A message never repeats the error it wraps: the wrapped error is the
//! `source()`, so a chain printer (`anyhow`'s `{:#}`, or a `tracing` field
//! given as `&dyn Error`) shows each cause once.

use fastsan_brp::{OpenInfo, ProtocolError, Status};
use std::io;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("bad URL {0}")]
    Url(String),
    #[error("cannot connect to {addr}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("target refused: {}", refusal(.status, .message))]
    Refused { status: Status, message: String },
    #[error("the target requires a secret (--secret-file)")]
    SecretRequired,
    #[error("the target did not prove it knows the secret")]
    TargetNotAuthenticated,
    /// HELLO_REPLY chose a version this initiator did not offer.
    #[error("the target chose protocol version {0}, which was not offered")]
    BadVersion(u16),
    /// HELLO_REPLY enabled feature bits the initiator did not ask for.
    #[error("the target enabled features {0:#x} that were never asked for")]
    UnrequestedFeatures(u32),
    /// HELLO_REPLY named an authentication method this initiator does not know.
    #[error("the target asks for unknown authentication method {0}")]
    UnknownAuth(u8),
    /// OPEN_REPLY announced limits no request could satisfy.
    #[error("the target announced impossible limits: {0:?}")]
    ImpossibleLimits(OpenInfo),
    /// A handshake message of the wrong kind for this point of the exchange.
    #[error("unexpected handshake message: expected {expected}, got {got}")]
    UnexpectedMessage { expected: &'static str, got: &'static str },
    /// A reply carried a tag no request in flight holds.
    #[error("reply for unknown tag {0}")]
    UnknownTag(u64),
    /// A successful READ reply carried fewer or more bytes than asked.
    #[error("read of {asked} bytes returned {got}")]
    ShortRead { asked: u64, got: u64 },
    /// A connection opened to join a session found a volume of another shape.
    #[error(
        "volume changed: size {old_size} -> {new_size}, block size {old_block_size} -> {new_block_size}"
    )]
    VolumeChanged { old_size: u64, new_size: u64, old_block_size: u32, new_block_size: u32 },
    /// A reconnect found another volume behind the name: the target
    /// restarted and the volume was volatile (its data is gone), or the
    /// volume was replaced. Resuming would return the new volume's data as
    /// if it were the old one's, so the session is refused.
    #[error("{}", replaced_text(volume, *restarted, *volatile))]
    VolumeReplaced { volume: String, restarted: bool, volatile: bool },
    /// A reconnect met a refusal that will not change (the volume is gone,
    /// the secret is wrong...): the session is over.
    #[error("the session cannot be resumed: {0}")]
    SessionEnded(String),
    /// The target's host restarted while writes it had acknowledged were not
    /// yet flushed: they may be lost, so no FLUSH of this session can promise
    /// durability any more. Reopen the volume.
    #[error("the target of volume {volume:?} went down with its host while acknowledged writes were not yet flushed: they may be lost; reopen the volume")]
    UnflushedWritesLost { volume: String },
    #[error("request failed: {0}")]
    Status(Status),
    /// An NBD server broke the protocol, or its handshake made no sense.
    #[error("NBD server: {0}")]
    Nbd(String),
    /// An NVMe command completed with an error status: its type (SCT) and
    /// code (SC); `dnr` (Do Not Retry) when the controller says the same
    /// command would fail again.
    #[error("NVMe {command} failed: {}", crate::nvme::status_text(command, *sct, *sc))]
    Nvme { command: &'static str, sct: u8, sc: u8, dnr: bool },
    /// An NVMe/TCP controller broke the protocol (a malformed PDU, a digest
    /// mismatch, data or an R2T no command asked for, a C2HTermReq), or its
    /// answers while connecting make no sense. The connection is cut.
    #[error("NVMe/TCP: {0}")]
    NvmeTcp(String),
    /// The request's connection was lost before its reply came. Within a
    /// session this means "send again after the fence"; a request that gives
    /// up fails with [`Error::Unreachable`], which says why.
    #[error("connection lost")]
    ConnectionLost,
    /// A request's connection was lost (`cause`, when known: no reply within
    /// the request timeout, the target closing it...) and no connection came
    /// back within the reconnect timeout (`reconnect`; zero: reconnection is
    /// off). Requests whose connection is lost are retried until then, after
    /// the target's fence. A write that fails so may or may not have reached
    /// the volume, as with any block device whose transport fails.
    #[error("{}", unreachable_text(cause.as_deref(), *reconnect))]
    Unreachable { cause: Option<String>, reconnect: std::time::Duration },
    /// An NBD or NVMe/TCP connection ended (`0`: why: no reply within the
    /// request timeout, the server closing it, a reset...) before the
    /// request's reply came; those clients do not reconnect (neither
    /// protocol has a fence), so a write that fails so may or may not have
    /// reached the volume.
    #[error("connection lost: {0}")]
    Lost(String),
    #[error("data digest mismatch in a reply")]
    DigestMismatch,
    #[error("protocol error")]
    Protocol(#[from] ProtocolError),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("I/O error")]
    Io(#[from] io::Error),
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// A mirror cannot serve (no leg holds every write, a leg belongs to
    /// another mirror, the legs diverged...).
    #[error("mirror: {0}")]
    Mirror(String),
    #[error("dirty-region log")]
    DirtyLog(#[from] crate::mirror::DirtyLogError),
}

/// [`Error::Unreachable`]'s text.
fn unreachable_text(cause: Option<&str>, reconnect: std::time::Duration) -> String {
    match (cause, reconnect.is_zero()) {
        (Some(c), true) => format!("connection lost: {c} (reconnection is off)"),
        (Some(c), false) => {
            format!(
                "connection lost: {c}; no connection came back within the reconnect timeout ({reconnect:?})"
            )
        }
        (None, true) => "connection lost (reconnection is off)".to_string(),
        (None, false) => format!("no connection to the target within the reconnect timeout ({reconnect:?})"),
    }
}

impl Error {
    /// Whether the volume's session is over for good: the volume behind the
    /// name is another now, or writes it acknowledged may be lost; nothing
    /// it holds can be made durable any more (reopen the volume).
    pub fn session_over(&self) -> bool {
        matches!(
            self,
            Error::VolumeChanged { .. }
                | Error::VolumeReplaced { .. }
                | Error::SessionEnded(_)
                | Error::UnflushedWritesLost { .. }
        )
    }

    /// Whether the same request may succeed if sent again.
    pub fn is_retryable(&self) -> bool {
        match self {
            // The request may not have reached the target; the session reconnects.
            Error::ConnectionLost | Error::Unreachable { .. } | Error::Lost(_) => true,
            // Corruption in transit; the next try usually arrives whole.
            Error::DigestMismatch => true,
            // The target was not there or not ready; it may be soon.
            Error::Connect { .. } | Error::Timeout(_) | Error::Io(_) => true,
            // The target is busy or shutting down: try again, perhaps elsewhere.
            Error::Refused { status, .. } => *status == Status::BUSY,
            Error::Status(s) => *s == Status::SHUTTING_DOWN || *s == Status::DIGEST_MISMATCH,
            // The NVMe controller says whether the same command may succeed.
            Error::Nvme { dnr, .. } => !dnr,
            // A malformed URL or argument stays malformed.
            Error::Url(_) | Error::InvalidArgument(_) => false,
            // Authentication fails the same way until someone changes a secret.
            Error::SecretRequired | Error::TargetNotAuthenticated => false,
            // The target speaks another dialect (version, features, auth
            // method): asking again gets the same answer.
            Error::BadVersion(_) | Error::UnrequestedFeatures(_) | Error::UnknownAuth(_) => false,
            // The target announces the same limits to every connection.
            Error::ImpossibleLimits(_) => false,
            // The target broke the protocol (bytes, message order, tags or
            // reply length): a bug there, which a new try would meet again.
            Error::Protocol(_)
            | Error::Nbd(_)
            | Error::NvmeTcp(_)
            | Error::UnexpectedMessage { .. }
            | Error::UnknownTag(_)
            | Error::ShortRead { .. } => false,
            // The session's geometry is fixed; the volume behind the name is now another.
            Error::VolumeChanged { .. } | Error::VolumeReplaced { .. } | Error::SessionEnded(_) => false,
            // Durability was lost once; trying again does not bring it back.
            Error::UnflushedWritesLost { .. } => false,
            // A mirror's refusal, or its log failing: nothing a retry changes.
            Error::Mirror(_) | Error::DirtyLog(_) => false,
        }
    }
}

/// An error and its causes, each once: what `anyhow`'s `{:#}` prints.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

/// Why a connection of the NBD or NVMe/TCP client ended, set once by its
/// reader before it fails the requests in flight; read by those and by every
/// request that comes after ([`Error::Lost`]).
#[derive(Default)]
pub(crate) struct Cause(std::sync::OnceLock<String>);

impl Cause {
    /// Records why the reader's connection ended: `e` as the reader met it
    /// (`ours`: this side closed it), `timeout` the request timeout. The
    /// first end recorded stays.
    pub(crate) fn set_io(&self, e: &io::Error, timeout: std::time::Duration, ours: bool) {
        // Overdue first: the reader that found it cut the connection itself.
        let why = if crate::overdue::is_overdue(e) {
            format!("no reply within the request timeout ({timeout:?})")
        } else if ours {
            "this side closed the volume".to_string()
        } else if e.kind() == io::ErrorKind::UnexpectedEof {
            "the server closed the connection".to_string()
        } else {
            e.to_string()
        };
        self.set(why);
    }

    /// Records why the connection ended, in words.
    pub(crate) fn set(&self, why: String) {
        let _ = self.0.set(why);
    }

    /// The error of a request the connection's end failed (with a cause
    /// not recorded, or none to record: "the connection ended").
    pub(crate) fn error(&self) -> Error {
        Error::Lost(self.0.get().cloned().unwrap_or_else(|| "the connection ended".to_string()))
    }
}

fn replaced_text(volume: &str, restarted: bool, volatile: bool) -> String {
    match (restarted, volatile) {
        (true, true) => format!(
            "the target restarted and volume {volume:?} is volatile (memory): the data written before is gone; \
             the session is not resumed"
        ),
        (true, false) => format!(
            "the target restarted with another volume named {volume:?} (its generation changed); \
             the session is not resumed"
        ),
        (false, _) => {
            format!("volume {volume:?} was replaced on the target (its generation changed); the session is not resumed")
        }
    }
}

/// A refusal in words: the target's message, then the status it came with
/// (once: "authentication failed (20): authentication failed" said it twice).
fn refusal(status: &Status, message: &str) -> String {
    let name = status.name();
    if message.is_empty() || message == name {
        status.to_string()
    } else {
        format!("{message} ({name}, {})", status.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn wrapped_errors_appear_once_in_the_chain() {
        let refused = io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused");
        let e = Error::Connect { addr: "h:1".into(), source: refused };
        assert_eq!(chain(&e), "cannot connect to h:1: connection refused");
        // A refusal says its words once, its status after them.
        let said = |message: &str| {
            Error::Refused { status: Status::AUTH_FAILED, message: message.into() }.to_string()
        };
        let name = Status::AUTH_FAILED.name();
        assert_eq!(said(name), format!("target refused: {}", Status::AUTH_FAILED));
        assert_eq!(said(""), format!("target refused: {}", Status::AUTH_FAILED));
        assert_eq!(
            said("try again in 7 s"),
            format!("target refused: try again in 7 s ({name}, {})", Status::AUTH_FAILED.0)
        );
        let e = Error::from(ProtocolError::BadMagic(7));
        assert_eq!(chain(&e), "protocol error: bad magic 0x00000007");
        let e = Error::from(io::Error::other("disk on fire"));
        assert_eq!(chain(&e), "I/O error: disk on fire");
        assert!(Error::ShortRead { asked: 4096, got: 0 }.source().is_none());
    }

    #[test]
    fn a_lost_connection_says_why() {
        let why = |e: io::Error, ours| {
            let c = Cause::default();
            c.set_io(&e, std::time::Duration::from_millis(300), ours);
            c.error().to_string()
        };
        let overdue = io::Error::new(io::ErrorKind::TimedOut, crate::overdue::Overdue);
        assert_eq!(why(overdue, false), "connection lost: no reply within the request timeout (300ms)");
        assert_eq!(
            why(io::ErrorKind::UnexpectedEof.into(), false),
            "connection lost: the server closed the connection"
        );
        let reset = io::Error::from_raw_os_error(libc::ECONNRESET);
        assert_eq!(
            why(reset, false),
            format!("connection lost: {}", io::Error::from_raw_os_error(libc::ECONNRESET))
        );
        assert_eq!(
            why(io::Error::other("bad NBD reply magic"), false),
            "connection lost: bad NBD reply magic"
        );
        assert_eq!(
            why(io::ErrorKind::UnexpectedEof.into(), true),
            "connection lost: this side closed the volume"
        );
        // The first end counts: a later one does not overwrite it.
        let c = Cause::default();
        c.set_io(&io::ErrorKind::UnexpectedEof.into(), std::time::Duration::ZERO, false);
        c.set_io(&io::Error::other("later"), std::time::Duration::ZERO, false);
        c.set("later still".into());
        assert_eq!(c.error().to_string(), "connection lost: the server closed the connection");
        assert_eq!(Cause::default().error().to_string(), "connection lost: the connection ended");
    }

    #[test]
    fn retry_decisions() {
        assert!(Error::ConnectionLost.is_retryable());
        let gone = |cause: Option<&str>, secs| Error::Unreachable {
            cause: cause.map(String::from),
            reconnect: std::time::Duration::from_secs(secs),
        };
        assert!(gone(None, 30).is_retryable());
        assert_eq!(
            gone(Some("the target closed it"), 30).to_string(),
            "connection lost: the target closed it; no connection came back within the reconnect timeout (30s)"
        );
        assert_eq!(gone(Some("x"), 0).to_string(), "connection lost: x (reconnection is off)");
        assert_eq!(
            gone(None, 2).to_string(),
            "no connection to the target within the reconnect timeout (2s)"
        );
        assert_eq!(gone(None, 0).to_string(), "connection lost (reconnection is off)");
        assert!(Error::Lost("x".into()).is_retryable());
        assert!(Error::Refused { status: Status::BUSY, message: String::new() }.is_retryable());
        assert!(!Error::Refused { status: Status::AUTH_FAILED, message: String::new() }.is_retryable());
        assert!(!Error::BadVersion(9).is_retryable());
        assert!(!Error::UnknownTag(3).is_retryable());
        assert!(!Error::UnexpectedMessage { expected: "OPEN_REPLY", got: "LIST_REPLY" }.is_retryable());
    }
}
