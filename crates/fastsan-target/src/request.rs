//! Protocol-neutral requests: what every front end decodes its wire
//! requests into, and why a request can be refused. Each front end maps a
//! [`Refusal`] to its own wire code in one function (BRP: a status, NBD: an errno).

use crate::backend::BackendError;
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
    /// The command's name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            IoKind::Read => "READ",
            IoKind::Write => "WRITE",
            IoKind::Flush => "FLUSH",
            IoKind::Trim => "TRIM",
            IoKind::WriteZeroes { .. } => "WRITE_ZEROES",
            IoKind::Cache => "CACHE",
            IoKind::BlockStatus { .. } => "BLOCK_STATUS",
        }
    }

    /// Whether the request changes the volume.
    pub fn writes(self) -> bool {
        matches!(self, IoKind::Write | IoKind::Trim | IoKind::WriteZeroes { .. })
    }
}

/// Why a request was refused before reaching the device, or failed there,
/// with what a log line (and an operator) needs to see why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Malformed but framed: bad flags, inconsistent lengths, zero length.
    #[error("malformed request: {0}")]
    Invalid(&'static str),
    /// A command this front end does not know.
    #[error("unknown command {0}")]
    UnknownCommand(u32),
    /// A command this volume cannot do (its capabilities say no).
    #[error("{0} is not supported by this volume")]
    Unsupported(&'static str),
    /// Beyond the end of the volume.
    #[error("range {offset}+{length} goes beyond the end of the volume ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    /// Not a multiple of the required alignment.
    #[error("range {offset}+{length} is not aligned to {align} bytes")]
    Misaligned { offset: u64, length: u64, align: u32 },
    /// Longer than the front end's or the volume's maximum transfer.
    #[error("{length} bytes exceed the limit of {limit}")]
    TooLarge { length: u64, limit: u64 },
    /// A change to a read-only volume.
    #[error("the volume is read-only")]
    ReadOnly,
    /// A fast zero was asked for and the volume cannot zero fast.
    #[error("a fast zero is not possible on this volume")]
    NotFast,
    /// The device failed.
    #[error("device error: {0}")]
    Device(BackendError),
    /// The payload's digest did not match.
    #[error("the payload's digest does not match")]
    DigestMismatch,
    /// The target is shutting down.
    #[error("the target is shutting down")]
    ShuttingDown,
}

impl Refusal {
    /// Its kind, for metrics (`errors_total{kind=...}`): one of [`Refusal::KINDS`].
    pub fn kind(&self) -> usize {
        match self {
            Refusal::Invalid(_) | Refusal::UnknownCommand(_) | Refusal::DigestMismatch => 0,
            Refusal::Unsupported(_) | Refusal::NotFast => 1,
            Refusal::OutOfRange { .. } | Refusal::Misaligned { .. } | Refusal::TooLarge { .. } => 2,
            Refusal::ReadOnly => 3,
            Refusal::Device(_) => 4,
            Refusal::ShuttingDown => 5,
        }
    }

    /// The names of the kinds, by [`Refusal::kind`].
    pub const KINDS: [&'static str; 6] =
        ["invalid", "unsupported", "range", "read_only", "device", "shutdown"];
}

impl From<BackendError> for Refusal {
    fn from(e: BackendError) -> Self {
        Refusal::Device(e)
    }
}

/// The limits a front end imposes on top of the volume's own.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Offsets and lengths must be multiples of this (1: any byte).
    pub align: u32,
    /// Largest READ or WRITE.
    pub max_io: u32,
    /// This connection may not write (a read-only grant), whatever the volume can.
    pub read_only: bool,
}

/// One run of the volume with the same allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Reads as zeros and holds no storage.
    pub hole: bool,
}

/// A READ's bytes: one piece (a buffer the backend filled), or several that
/// are shared rather than copied (a memory volume's chunks, sent as they are:
/// a later write to such a chunk copies it first, so the bytes a reply holds
/// never change under it). The reply writer sends every piece in one `writev`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadData {
    first: Bytes,
    /// Behind one thin pointer: an outcome crosses a channel per request and
    /// stays within 48 bytes (`the_hot_path_result_stays_small`); a `Vec`
    /// or a boxed slice would take two or three words here.
    #[allow(clippy::box_collection)]
    rest: Option<Box<Vec<Bytes>>>,
}

impl ReadData {
    pub fn len(&self) -> usize {
        self.first.len() + self.rest().iter().map(Bytes::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn rest(&self) -> &[Bytes] {
        self.rest.as_deref().map_or(&[], |v| &v[..])
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> impl Iterator<Item = &[u8]> + Clone {
        std::iter::once(&self.first[..]).chain(self.rest().iter().map(|b| &b[..]))
    }

    /// The bytes in one piece (copied only when there are several).
    pub fn to_bytes(&self) -> Bytes {
        if self.rest().is_empty() {
            return self.first.clone();
        }
        let mut v = Vec::with_capacity(self.len());
        self.pieces().for_each(|p| v.extend_from_slice(p));
        v.into()
    }
}

impl From<Bytes> for ReadData {
    fn from(first: Bytes) -> ReadData {
        ReadData { first, rest: None }
    }
}

impl From<Vec<Bytes>> for ReadData {
    fn from(mut pieces: Vec<Bytes>) -> ReadData {
        match pieces.len() {
            0 => ReadData::default(),
            1 => pieces.pop().expect("one piece").into(),
            _ => {
                let first = pieces.remove(0);
                ReadData { first, rest: Some(Box::new(pieces)) }
            }
        }
    }
}
