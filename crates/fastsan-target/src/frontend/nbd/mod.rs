//! The NBD front end: standard NBD clients (the Linux kernel, QEMU, libnbd's
//! tools, fio). Its handshake ([`handshake`]), **decode**
//! ([`NbdConn::decode`]: NBD's wire rules, known command and flags,
//! structured replies, contexts), its reply format ([`NbdEncoder`]) and the
//! one mapping from a refusal to an NBD error ([`errno`]). The connection
//! itself is [`crate::driver`]'s.
//!
//! Volumes are byte-granular here (NBD's minimum block size is 1) except
//! O_DIRECT files, which need their block size; READ and WRITE go up to
//! 64 MiB. A WRITE above that is refused with EINVAL and its payload is read
//! and dropped, so the connection goes on. Transmission flags come from the
//! volume's capabilities ([`tflags`]).

pub mod handshake;

pub use handshake::NbdHandshake;

use crate::access::{Access, Who};
use crate::backend::BackendError;
use crate::catalog::Catalog;
use crate::fence::Activity;
use crate::frontend::{Arriving, Decoded, Frontend, Transmission, WireError};
use crate::pipeline::{Encoded, Encoder, Reply};
use crate::request::{Extent, IoKind, IoRequest, Limits, Refusal};
use crate::volume::{Outcome, Volume};
use bytes::{Buf, Bytes, BytesMut};
use fastsan_nbd::consts::*;
use fastsan_nbd::transmission::{chunk_header, parse_request, request_need, simple_reply, Payload, Request};
use fastsan_nbd::MAX_PAYLOAD;
use std::sync::Arc;

/// The id of `base:allocation` once a client selects it.
const ALLOCATION_CONTEXT: u32 = 1;

/// The NBD protocol as the target serves it.
#[derive(Clone)]
pub struct Nbd {
    pub catalog: Arc<Catalog>,
    pub access: Arc<Access>,
}

impl Frontend for Nbd {
    type Handshake = NbdHandshake;
    type Conn = NbdConn;
    const NAME: &'static str = "NBD";

    fn handshake(&self, who: Who) -> NbdHandshake {
        NbdHandshake::new(self.catalog.clone(), self.access.clone(), who)
    }

    fn busy(&self) -> Option<Vec<u8>> {
        // NBD has no way to say "busy" before the handshake: the client sees a close.
        None
    }
}

/// Transmission flags: what this volume can do, from its capabilities.
pub fn tflags(v: &Volume, structured: bool, read_only: bool) -> u16 {
    let mut c = v.caps();
    // A read-only grant: the volume, as this client sees it, cannot write.
    c.write &= !read_only;
    let mut f = TFLAG_HAS_FLAGS | TFLAG_CAN_MULTI_CONN;
    let mut set = |on: bool, flag: u16| {
        if on {
            f |= flag;
        }
    };
    set(!c.write, TFLAG_READ_ONLY);
    set(c.flush, TFLAG_SEND_FLUSH);
    // FUA is emulated with a flush where the store cannot do it.
    set(c.write && c.flush, TFLAG_SEND_FUA);
    // Changes, only where this client may write (they got EPERM on a
    // read-only grant, which a client that was told it may send them takes
    // for a failure of the device).
    set(c.write && c.trim, TFLAG_SEND_TRIM);
    set(c.write && c.zero, TFLAG_SEND_WRITE_ZEROES);
    set(c.write && c.fast_zero, TFLAG_SEND_FAST_ZERO);
    set(c.cache, TFLAG_SEND_CACHE);
    set(structured, TFLAG_SEND_DF);
    f
}

/// One NBD connection in its transmission phase.
pub struct NbdConn {
    volume: Arc<Volume>,
    structured: bool,
    /// The client selected `base:allocation` for this export.
    allocation_context: bool,
    /// Bytes of a refused oversized WRITE still to drop.
    skip: u64,
    /// The client's grant is read-only.
    read_only: bool,
    activity: Arc<Activity>,
}

impl std::fmt::Debug for NbdConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdConn")
            .field("volume", &self.volume.name())
            .field("structured", &self.structured)
            .field("allocation_context", &self.allocation_context)
            .finish()
    }
}

impl NbdConn {
    fn new(volume: Arc<Volume>, structured: bool, allocation_context: bool, read_only: bool) -> Self {
        NbdConn { volume, structured, allocation_context, skip: 0, read_only, activity: Activity::new() }
    }
}

/// What the encoder needs to answer a request.
pub struct NbdMeta {
    command: u16,
    flags: u16,
    offset: u64,
}

impl Transmission for NbdConn {
    type Encoder = NbdEncoder;

    fn volumes(&self) -> &[Arc<Volume>] {
        std::slice::from_ref(&self.volume)
    }

    fn limits(&self) -> Limits {
        Limits { align: 1, max_io: MAX_PAYLOAD, read_only: self.read_only }
    }

    fn encoder(&self) -> NbdEncoder {
        NbdEncoder { structured: self.structured }
    }

    fn describe(&self) -> String {
        format!("structured replies {}, block status {}", self.structured, self.allocation_context)
    }

    fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded<NbdMeta>, WireError> {
        // Drop what arrived of a refused write's payload; parse on once it is all gone.
        let n = self.skip.min(buf.len() as u64);
        buf.advance(n as usize);
        self.skip -= n;
        if self.skip > 0 {
            return Ok(Decoded::Incomplete { need: 0 });
        }
        let Some((r, payload, used)) = parse_request(buf)? else {
            return Ok(Decoded::Incomplete { need: request_need(buf) });
        };
        let frame = buf.split_to(used).freeze();
        if r.command == CMD_DISC {
            return Ok(Decoded::Disconnect);
        }
        let req = match payload {
            Payload::Skip(n) => {
                self.skip = n as u64;
                Err(Refusal::TooLarge { length: n as u64, limit: MAX_PAYLOAD as u64 })
            }
            Payload::Inline(_) => {
                self.decode_request(&r, frame.slice(fastsan_nbd::transmission::REQUEST_LEN..))
            }
            Payload::None => self.decode_request(&r, Bytes::new()),
        };
        let meta = NbdMeta { command: r.command, flags: r.flags, offset: r.offset };
        Ok(Decoded::Request { volume: 0, tag: r.cookie, meta, req })
    }

    fn arriving(&self, buf: &BytesMut) -> Option<Arriving> {
        // (A refused write's rest, skipped as it comes, is held nowhere.)
        let r =
            Request::decode(buf.first_chunk()?).ok().filter(|r| self.skip == 0 && r.command == CMD_WRITE)?;
        Some(Arriving { volume: 0, range: Some((r.offset, r.length as u64)) })
    }

    fn mid_frame(&self, buf: &BytesMut) -> bool {
        !buf.is_empty() || self.skip > 0
    }
}

impl NbdConn {
    /// NBD's wire rules for one request; the volume's rules come after.
    fn decode_request(&self, r: &Request, payload: Bytes) -> Result<IoRequest, Refusal> {
        let (kind, allowed) = match r.command {
            CMD_READ => (IoKind::Read, CMD_FLAG_FUA | CMD_FLAG_DF),
            CMD_WRITE => (IoKind::Write, CMD_FLAG_FUA),
            CMD_FLUSH => (IoKind::Flush, CMD_FLAG_FUA),
            CMD_TRIM => (IoKind::Trim, CMD_FLAG_FUA),
            CMD_CACHE => (IoKind::Cache, CMD_FLAG_FUA),
            CMD_WRITE_ZEROES => (
                IoKind::WriteZeroes {
                    no_hole: r.flags & CMD_FLAG_NO_HOLE != 0,
                    fast_only: r.flags & CMD_FLAG_FAST_ZERO != 0,
                },
                CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            ),
            CMD_BLOCK_STATUS => (
                IoKind::BlockStatus { one: r.flags & CMD_FLAG_REQ_ONE != 0 },
                CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
            ),
            other => return Err(Refusal::UnknownCommand(other as u32)),
        };
        if r.flags & !allowed != 0 {
            return Err(Refusal::Invalid("a flag this command does not take"));
        }
        if r.flags & CMD_FLAG_DF != 0 && !self.structured {
            return Err(Refusal::Invalid("DF without structured replies"));
        }
        if matches!(kind, IoKind::BlockStatus { .. }) && !(self.structured && self.allocation_context) {
            return Err(Refusal::Invalid("BLOCK_STATUS without a selected meta context"));
        }
        Ok(IoRequest {
            kind,
            offset: r.offset,
            length: r.length as u64,
            fua: r.flags & CMD_FLAG_FUA != 0,
            payload,
        })
    }
}

/// The one mapping from a refusal to an NBD error, by command and flags
/// (as nbdkit's `nbd_errno`): ENOTSUP only where the client asked for a
/// fast zero, ENOSPC for writes past the end.
pub fn errno(r: &Refusal, command: u16, flags: u16) -> u32 {
    let fast_zero = command == CMD_WRITE_ZEROES && flags & CMD_FLAG_FAST_ZERO != 0;
    match r {
        Refusal::OutOfRange { .. } if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) => ENOSPC,
        Refusal::ReadOnly | Refusal::Device(BackendError::ReadOnly) => EPERM,
        Refusal::NotFast | Refusal::Device(BackendError::Unsupported) if fast_zero => ENOTSUP,
        Refusal::Device(BackendError::NoSpace) => ENOSPC,
        Refusal::Device(_) | Refusal::DigestMismatch => EIO,
        Refusal::ShuttingDown => ESHUTDOWN,
        Refusal::NotFast
        | Refusal::OutOfRange { .. }
        | Refusal::Invalid(_)
        | Refusal::UnknownCommand(_)
        | Refusal::Unsupported(_)
        | Refusal::Misaligned { .. }
        | Refusal::TooLarge { .. } => EINVAL,
    }
}

/// NBD replies: simple ones, or structured chunks once negotiated (READ
/// data as one OFFSET_DATA chunk, errors as ERROR chunks, block status).
pub struct NbdEncoder {
    structured: bool,
}

impl Encoder for NbdEncoder {
    type Meta = NbdMeta;

    fn encode(&mut self, r: &Reply<NbdMeta>, scratch: &mut Vec<u8>) -> Encoded {
        let start = scratch.len();
        let cookie = r.tag;
        let data = match &r.result {
            Ok(Outcome::Data(d)) if self.structured => {
                let len = 8 + d.len() as u32;
                scratch.extend_from_slice(&chunk_header(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    cookie,
                    len,
                ));
                scratch.extend_from_slice(&r.meta.offset.to_be_bytes());
                Some(d.clone())
            }
            Ok(Outcome::Data(d)) => {
                scratch.extend_from_slice(&simple_reply(0, cookie));
                Some(d.clone())
            }
            Ok(Outcome::Extents(extents)) => {
                block_status(cookie, extents, scratch);
                None
            }
            Ok(Outcome::Done) => {
                scratch.extend_from_slice(&simple_reply(0, cookie));
                None
            }
            Err(refusal) => {
                let e = errno(refusal, r.meta.command, r.meta.flags);
                if self.structured {
                    scratch.extend_from_slice(&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6));
                    scratch.extend_from_slice(&e.to_be_bytes());
                    scratch.extend_from_slice(&0u16.to_be_bytes());
                } else {
                    scratch.extend_from_slice(&simple_reply(e, cookie));
                }
                None
            }
        };
        let end = scratch.len();
        Encoded { head: start..end, data, tail: end..end }
    }
}

/// One BLOCK_STATUS chunk for `base:allocation`.
fn block_status(cookie: u64, extents: &[Extent], out: &mut Vec<u8>) {
    let len = 4 + 8 * extents.len() as u32;
    out.extend_from_slice(&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, len));
    out.extend_from_slice(&ALLOCATION_CONTEXT.to_be_bytes());
    for e in extents {
        // The request's length is a u32, so is every extent of it.
        out.extend_from_slice(&(e.len as u32).to_be_bytes());
        let flags = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_only_grant_is_offered_no_change() {
        let v =
            Volume::with_backend("v".into(), Arc::new(crate::backend::MemoryBackend::new(1 << 20)), 65536);
        let changes = TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO | TFLAG_SEND_FUA;
        let rw = tflags(&v, true, false);
        let offered = TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FUA;
        assert_eq!(rw & (offered | TFLAG_READ_ONLY), offered, "{rw:#x}");
        let ro = tflags(&v, true, true);
        assert_eq!(ro & changes, 0, "{ro:#x}");
        assert_eq!(ro & (TFLAG_READ_ONLY | TFLAG_SEND_FLUSH), TFLAG_READ_ONLY | TFLAG_SEND_FLUSH);
    }

    #[test]
    fn enotsup_only_for_a_fast_zero() {
        let unsup = Refusal::Device(BackendError::Unsupported);
        assert_eq!(errno(&unsup, CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO), ENOTSUP);
        assert_eq!(errno(&Refusal::NotFast, CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO), ENOTSUP);
        // Otherwise a store's EOPNOTSUPP is its failure (a client's mirror
        // fails over), and a TRIM it cannot do is refused as nbdkit does.
        assert_eq!(errno(&unsup, CMD_WRITE_ZEROES, 0), EIO);
        assert_eq!(errno(&unsup, CMD_READ, 0), EIO, "never ENOTSUP for a READ");
        assert_eq!(errno(&Refusal::Unsupported("TRIM"), CMD_TRIM, 0), EINVAL);
        assert_eq!(errno(&Refusal::Device(BackendError::Io(5)), CMD_READ, 0), EIO);
        assert_eq!(errno(&Refusal::Device(BackendError::NoSpace), CMD_WRITE, 0), ENOSPC);
        let past = Refusal::OutOfRange { offset: 10, length: 1, size: 10 };
        assert_eq!(errno(&past, CMD_WRITE, 0), ENOSPC);
        assert_eq!(errno(&past, CMD_READ, 0), EINVAL);
    }
}
