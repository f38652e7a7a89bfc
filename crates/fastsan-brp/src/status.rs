//! Status codes: the result of a request, or the reason a handshake failed.

use std::fmt;

/// A status code as carried on the wire. Unknown codes from a newer peer are
/// kept as they are, never rejected.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub u32);

impl Status {
    pub const OK: Status = Status(0);
    /// Malformed but framed request: bad flags, WRITE length not equal to its payload, zero length.
    pub const INVALID: Status = Status(1);
    /// Unknown command.
    pub const UNSUPPORTED: Status = Status(2);
    /// Offset + length beyond the end of the volume.
    pub const OUT_OF_RANGE: Status = Status(3);
    /// Offset or length not a multiple of the volume's block size.
    pub const MISALIGNED: Status = Status(4);
    /// Length above the volume's maximum transfer.
    pub const TOO_LARGE: Status = Status(5);
    /// Write, trim or write-zeroes on a read-only volume.
    pub const READ_ONLY: Status = Status(6);
    /// The backend failed.
    pub const IO_ERROR: Status = Status(7);
    /// The backend is out of space.
    pub const NO_SPACE: Status = Status(8);
    /// The payload's data digest did not match.
    pub const DIGEST_MISMATCH: Status = Status(9);
    /// The target is shutting down and takes no new work.
    pub const SHUTTING_DOWN: Status = Status(10);

    /// Handshake: wrong credentials.
    pub const AUTH_FAILED: Status = Status(20);
    /// Handshake: the target requires authentication first.
    pub const AUTH_REQUIRED: Status = Status(21);
    /// Handshake: no volume of that name.
    pub const NO_SUCH_VOLUME: Status = Status(22);
    /// Handshake: no common protocol version.
    pub const BAD_VERSION: Status = Status(23);
    /// Handshake: message not allowed at this point.
    pub const UNEXPECTED: Status = Status(24);
    /// Handshake: the target has no room for another connection.
    pub const BUSY: Status = Status(25);

    pub fn is_ok(self) -> bool {
        self == Status::OK
    }

    /// A short name, for logs and error messages.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "ok",
            1 => "invalid request",
            2 => "unsupported command",
            3 => "out of range",
            4 => "misaligned",
            5 => "too large",
            6 => "read-only volume",
            7 => "I/O error",
            8 => "no space",
            9 => "data digest mismatch",
            10 => "target shutting down",
            20 => "authentication failed",
            21 => "authentication required",
            22 => "no such volume",
            23 => "no common protocol version",
            24 => "unexpected message",
            25 => "target busy",
            _ => "unknown status",
        }
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
