//! Status codes: the result of a request, or the reason a handshake failed.

use std::fmt;

/// A status code as carried on the wire. Unknown codes from a newer peer are
/// kept as they are, never rejected.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub u32);

/// Declares every status once: its constant, its code, what it means, and
/// its name in messages.
macro_rules! statuses {
    ($($(#[$doc:meta])* $name:ident = $code:literal => $text:literal,)+) => {
        impl Status {
            $($(#[$doc])* pub const $name: Status = Status($code);)+

            /// The status's name in messages ("unknown status" for codes from a newer peer).
            pub fn name(self) -> &'static str {
                match self.0 {
                    $($code => $text,)+
                    _ => "unknown status",
                }
            }
        }
    };
}

statuses! {
    OK = 0 => "ok",
    /// Malformed but framed request: bad flags, WRITE length not equal to its payload, zero length.
    INVALID = 1 => "invalid request",
    /// Unknown command, or one the volume cannot do.
    UNSUPPORTED = 2 => "unsupported command",
    /// Offset + length beyond the end of the volume.
    OUT_OF_RANGE = 3 => "out of range",
    /// Offset or length not a multiple of the volume's block size.
    MISALIGNED = 4 => "misaligned",
    /// Length above the volume's maximum transfer.
    TOO_LARGE = 5 => "too large",
    /// Write, trim or write-zeroes on a read-only volume.
    READ_ONLY = 6 => "read-only volume",
    /// The backend failed.
    IO_ERROR = 7 => "I/O error",
    /// The backend is out of space.
    NO_SPACE = 8 => "no space",
    /// The payload's data digest did not match.
    DIGEST_MISMATCH = 9 => "data digest mismatch",
    /// The target is shutting down and takes no new work.
    SHUTTING_DOWN = 10 => "target shutting down",
    /// Handshake: wrong credentials.
    AUTH_FAILED = 20 => "authentication failed",
    /// Handshake: the target requires authentication first.
    AUTH_REQUIRED = 21 => "authentication required",
    /// Handshake: no volume of that name.
    NO_SUCH_VOLUME = 22 => "no such volume",
    /// Handshake: no common protocol version.
    BAD_VERSION = 23 => "no common protocol version",
    /// Handshake: message not allowed at this point.
    UNEXPECTED = 24 => "unexpected message",
    /// Handshake: the client's identity may not open this volume (the target's grants).
    ACCESS_DENIED = 27 => "access denied",
    /// Handshake: this target serves BRP over TLS only (`brps://`), or requires TLS
    /// for an authenticated session from another host.
    TLS_REQUIRED = 28 => "TLS required",
    /// Handshake: the target has no room for another connection.
    BUSY = 25 => "target busy",
}

impl Status {
    pub fn is_ok(self) -> bool {
        self == Status::OK
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
