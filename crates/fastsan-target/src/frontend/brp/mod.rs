//! The BRP front end (`docs/protocol.md`): its handshake ([`handshake`]),
//! **decode** ([`BrpConn::decode`]: a frame, or a BATCH unpacked one
//! sub-request at a time, into an [`IoRequest`] under BRP's wire rules),
//! its reply format ([`BrpEncoder`]) and the one mapping from a refusal to a
//! BRP status ([`status`]). The connection itself is [`crate::driver`]'s.

pub mod handshake;

pub use handshake::BrpHandshake;

use crate::access::{Access, Who};
use crate::backend::BackendError;
use crate::catalog::Catalog;
use crate::fence::Activity;
use crate::frontend::{Arriving, Decoded, Frontend, Transmission, WireError};
use crate::pipeline::{Encoded, Encoder, Reply};
use crate::request::{IoKind, IoRequest, Limits, Refusal};
use crate::sessions::{Fence, SessionGuard, Sessions};
use crate::stats::Stats;
use crate::volume::{Outcome, Volume};
use bytes::{Bytes, BytesMut};
use fastsan_brp::batch::BatchBody;
use fastsan_brp::handshake::{Message, VolumeInfo, VOLUME_FAILED, VOLUME_READ_ONLY, VOLUME_VOLATILE};
use fastsan_brp::reply::ReplyHeader;
use fastsan_brp::request::{parse_request, RequestHeader, FLAGS_KNOWN, REQUEST_HEADER_LEN};
use fastsan_brp::{Command, ProtocolError, Status};
use rand::RngCore;
use std::sync::Arc;

/// The BRP protocol as the target serves it: what its handshakes need.
#[derive(Clone)]
pub struct Brp {
    pub catalog: Arc<Catalog>,
    pub sessions: Arc<Sessions>,
    /// TLS, identities and grants.
    pub access: Arc<Access>,
    /// Credits granted per connection.
    pub queue_depth: u32,
    pub stats: Arc<Stats>,
    /// Random per process start (OPEN_REPLY's `instance`).
    pub instance: u64,
    /// The host's boot (OPEN_REPLY's `boot`).
    pub boot: u64,
}

impl Frontend for Brp {
    type Handshake = BrpHandshake;
    type Conn = BrpConn;
    const NAME: &'static str = "BRP";

    fn handshake(&self, who: Who) -> BrpHandshake {
        let mut challenge = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut challenge);
        BrpHandshake::new(self.clone(), who, challenge)
    }

    fn busy(&self) -> Option<Vec<u8>> {
        Some(Message::Error { status: Status::BUSY, message: "too many connections".into() }.to_vec())
    }
}

/// A volume as LIST_REPLY describes it.
pub fn volume_info(v: &Volume, read_only: bool) -> VolumeInfo {
    VolumeInfo {
        name: v.name().to_owned(),
        size: v.size(),
        block_size: v.granule(),
        flags: volume_flags(v, read_only),
    }
}

/// The volume flags of LIST_REPLY and OPEN_REPLY; `read_only`: the client's grant is.
pub fn volume_flags(v: &Volume, read_only: bool) -> u32 {
    let mut flags = 0;
    if v.read_only() || read_only {
        flags |= VOLUME_READ_ONLY;
    }
    if v.volatile() {
        flags |= VOLUME_VOLATILE;
    }
    if v.failed() {
        flags |= VOLUME_FAILED;
    }
    flags
}

/// The BATCH being unpacked: its body, and where the next sub-request is.
struct BatchCursor {
    body: Bytes,
    count: usize,
    next: usize,
    /// Where the next sub-request's payload starts in the body.
    data_at: usize,
}

/// One BRP connection in its transmission phase.
pub struct BrpConn {
    volume: Arc<Volume>,
    session: SessionGuard,
    /// Sent OPEN_REPLY waits for it (taken by the driver).
    fence: Option<Fence>,
    digests: bool,
    /// The client's grant is read-only.
    read_only: bool,
    stats: Arc<Stats>,
    batch: Option<BatchCursor>,
}

impl std::fmt::Debug for BrpConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrpConn")
            .field("volume", &self.volume.name())
            .field("session", &self.session.id())
            .field("digests", &self.digests)
            .finish()
    }
}

impl BrpConn {
    fn new(
        volume: Arc<Volume>,
        session: SessionGuard,
        fence: Fence,
        digests: bool,
        read_only: bool,
        stats: Arc<Stats>,
    ) -> Self {
        BrpConn { volume, session, fence: Some(fence), digests, read_only, stats, batch: None }
    }

    /// The next sub-request of the BATCH being unpacked, if any is left.
    fn next_in_batch(&mut self) -> Option<Result<Decoded<()>, WireError>> {
        let b = self.batch.as_mut()?;
        if b.next == b.count {
            self.batch = None;
            return None;
        }
        let at = b.next * REQUEST_HEADER_LEN;
        let raw: &[u8; REQUEST_HEADER_LEN] =
            b.body[at..at + REQUEST_HEADER_LEN].try_into().expect("32 bytes");
        // BatchBody::parse checked every sub-header and that the payloads add up.
        let h = match RequestHeader::decode(raw) {
            Ok(h) => h,
            Err(e) => return Some(Err(e.into())),
        };
        let payload = b.body.slice(b.data_at..b.data_at + h.payload_len as usize);
        b.next += 1;
        b.data_at += h.payload_len as usize;
        Some(Ok(Decoded::Request { volume: 0, tag: h.tag, meta: (), req: decode(&h, payload, true) }))
    }
}

impl Transmission for BrpConn {
    type Encoder = BrpEncoder;

    fn volumes(&self) -> &[Arc<Volume>] {
        std::slice::from_ref(&self.volume)
    }

    fn limits(&self) -> Limits {
        Limits { align: self.volume.granule(), max_io: self.volume.max_transfer(), read_only: self.read_only }
    }

    fn encoder(&self) -> BrpEncoder {
        BrpEncoder { digests: self.digests }
    }

    fn describe(&self) -> String {
        format!("session {:016x}, digests {}", self.session.id(), self.digests)
    }

    fn activity(&self) -> Arc<Activity> {
        self.session.activity().clone()
    }

    fn fence(&mut self) -> Option<Fence> {
        self.fence.take()
    }

    fn arriving(&self, buf: &BytesMut) -> Option<Arriving> {
        let h = RequestHeader::decode(buf.first_chunk()?).ok()?;
        let range = match h.command {
            Command::Write => Some((h.offset, h.length as u64)),
            // Its writes' ranges are inside it.
            Command::Batch => None,
            _ => return None,
        };
        Some(Arriving { volume: 0, range })
    }

    fn frame_ended(&self) -> bool {
        self.batch.as_ref().is_some_and(|b| b.next == b.count)
    }

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded<()>, WireError> {
        if let Some(sub) = self.next_in_batch() {
            return sub;
        }
        let Some(frame) = parse_request(buf, self.digests)? else {
            return Ok(Decoded::Incomplete { need: frame_need(buf, self.digests) });
        };
        let bytes = buf.split_to(frame.frame_len).freeze();
        let h = frame.header;
        let payload = bytes.slice(frame.payload_at..frame.payload_at + h.payload_len as usize);
        if h.command != Command::Batch {
            return Ok(Decoded::Request {
                volume: 0,
                tag: h.tag,
                meta: (),
                req: decode(&h, payload, frame.payload_ok),
            });
        }
        if !frame.payload_ok {
            return Err(ProtocolError::BatchDigest.into());
        }
        let count = BatchBody::parse(h.count, &payload)?.len();
        Stats::add(&self.stats.batches, 1);
        Stats::add(&self.stats.batched_requests, count as u64);
        self.batch = Some(BatchCursor { body: payload, count, next: 0, data_at: count * REQUEST_HEADER_LEN });
        self.next_in_batch().expect("a BATCH holds at least one request")
    }
}

/// The wire rules of one BRP request: known command, known flags, a payload
/// only on WRITE and exactly as long as it. The volume's rules come after.
fn decode(h: &RequestHeader, payload: Bytes, payload_ok: bool) -> Result<IoRequest, Refusal> {
    let kind = match h.command {
        Command::Read => IoKind::Read,
        Command::Write => IoKind::Write,
        Command::Flush => IoKind::Flush,
        Command::Trim => IoKind::Trim,
        Command::WriteZeroes => IoKind::WriteZeroes { no_hole: false, fast_only: false },
        Command::Batch => return Err(Refusal::Invalid("BATCH inside a BATCH")),
        Command::Unknown(c) => return Err(Refusal::UnknownCommand(c as u32)),
    };
    if h.flags & !FLAGS_KNOWN != 0 {
        return Err(Refusal::Invalid("unknown flags"));
    }
    if kind != IoKind::Write && h.payload_len != 0 {
        return Err(Refusal::Invalid("a payload on a command that takes none"));
    }
    if !payload_ok {
        return Err(Refusal::DigestMismatch);
    }
    Ok(IoRequest { kind, offset: h.offset, length: h.length as u64, fua: h.is_fua(), payload })
}

/// The one mapping from a refusal to a BRP status.
pub fn status(r: &Refusal) -> Status {
    match r {
        Refusal::Invalid(_) => Status::INVALID,
        Refusal::UnknownCommand(_) | Refusal::Unsupported(_) => Status::UNSUPPORTED,
        Refusal::OutOfRange { .. } => Status::OUT_OF_RANGE,
        Refusal::Misaligned { .. } => Status::MISALIGNED,
        Refusal::TooLarge { .. } => Status::TOO_LARGE,
        Refusal::ReadOnly | Refusal::Device(BackendError::ReadOnly) => Status::READ_ONLY,
        Refusal::Device(BackendError::NoSpace) => Status::NO_SPACE,
        Refusal::NotFast | Refusal::Device(_) => Status::IO_ERROR,
        Refusal::DigestMismatch => Status::DIGEST_MISMATCH,
        Refusal::ShuttingDown => Status::SHUTTING_DOWN,
    }
}

/// How many bytes the frame at the start of `buf` needs in all, when its
/// header is there (so that one reserve makes room for a large write).
fn frame_need(buf: &[u8], digests: bool) -> usize {
    match buf.first_chunk().map(RequestHeader::decode) {
        Some(Ok(h)) => fastsan_brp::request::frame_len(h.payload_len, digests),
        _ => 0,
    }
}

/// BRP replies: a 24-byte header, the data, and digests when negotiated.
pub struct BrpEncoder {
    digests: bool,
}

impl Encoder for BrpEncoder {
    type Meta = ();

    fn encode(&mut self, r: &Reply<()>, scratch: &mut Vec<u8>) -> Encoded {
        let (st, data) = match &r.result {
            Ok(Outcome::Data(d)) => (Status::OK, Some(d.clone())),
            Ok(_) => (Status::OK, None),
            Err(refusal) => (status(refusal), None),
        };
        let payload_len = data.as_ref().map_or(0, |d| d.len() as u32);
        let start = scratch.len();
        let (h, n) = ReplyHeader { status: st, tag: r.tag, payload_len }.encode_wire(self.digests);
        scratch.extend_from_slice(&h[..n]);
        let head = start..scratch.len();
        if let Some(d) = data.as_ref().filter(|_| self.digests && payload_len > 0) {
            scratch.extend(fastsan_brp::digest::crc_parts(d.pieces()).to_le_bytes());
        }
        Encoded { head: head.clone(), data, tail: head.end..scratch.len() }
    }
}
