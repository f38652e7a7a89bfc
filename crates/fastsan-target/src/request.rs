//! Protocol-neutral requests: what every front end decodes its wire
//! requests into, and why a request can be refused. Each front end maps a
//! [`Refusal`] to its own wire code in one function (BRP: a status, NBD: an errno).

use bytes::Bytes;

/// A block request as decoded from any protocol, not yet checked against the volume.
#[derive(Debug, Clone)]
pub struct IoRequest {
    pub kind: IoKind,
    pub offset: u64,
    pub length: u64,
    /// Force unit access: durable before the reply (writes and write-zeroes).
    pub fua: bool,
    /// A WRITE's data (empty for every other kind).
    pub payload: Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
    Flush,
    Trim,
    /// `no_hole`: keep the range allocated; `fast_only`: fail with
    /// [`Refusal::NotFast`] rather than write zeroes slowly.
    WriteZeroes {
        no_hole: bool,
        fast_only: bool,
    },
    /// Prefetch a range (a hint).
    Cache,
    /// Report which parts of a range are allocated; `one`: a single extent is enough.
    BlockStatus {
        one: bool,
    },
}

impl IoKind {
    /// Whether the request changes the volume.
    pub fn writes(self) -> bool {
        matches!(self, IoKind::Write | IoKind::Trim | IoKind::WriteZeroes { .. })
    }
}

/// Why a request was refused before reaching the device, or failed there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Malformed but framed: bad flags, inconsistent lengths, zero length.
    Invalid,
    /// A command this target does not know.
    Unsupported,
    /// Beyond the end of the volume.
    OutOfRange,
    /// Not a multiple of the required alignment.
    Misaligned,
    /// Longer than the front end's maximum transfer.
    TooLarge,
    /// A change to a read-only volume.
    ReadOnly,
    /// The backend failed.
    IoError,
    /// The backend is out of space.
    NoSpace,
    /// A fast zero was asked for and the backend cannot zero fast.
    NotFast,
    /// The payload's digest did not match.
    DigestMismatch,
    /// The target is shutting down.
    ShuttingDown,
}

/// The limits a front end imposes on top of the volume's own.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Offsets and lengths must be multiples of this (1: any byte).
    pub align: u32,
    /// Largest READ or WRITE.
    pub max_io: u32,
}

/// One run of the volume with the same allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Reads as zeros and holds no storage.
    pub hole: bool,
}
