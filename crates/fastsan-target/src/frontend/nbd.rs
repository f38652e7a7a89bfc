//! The NBD front end: one connection of a standard NBD client (the Linux
//! kernel, QEMU, libnbd's tools, fio) from handshake to close.
//!
//! The request path, as for BRP:
//! 1. **decode**: [`read_loop`] frames every complete request a read brings
//!    ([`fastsan_nbd::transmission::parse_request`]) and [`decode`] applies NBD's wire
//!    rules (known command and flags, structured replies, contexts);
//! 2. **check**, 3. **device**, 4. **reply**: the shared
//!    [`pipeline`](crate::pipeline), with this module's [`NbdEncoder`].
//!
//! Volumes are byte-granular here (NBD's minimum block size is 1) except
//! O_DIRECT files, which need their block size; READ and WRITE go up to
//! 32 MiB. A WRITE above that is refused with EINVAL and its payload is read
//! and dropped, so the connection goes on.

use crate::exec::Outcome;
use crate::pipeline::{read_room, Dispatcher, Encoded, Encoder, Reply, READ_CHUNK};
use crate::request::{Extent, IoKind, IoRequest, Limits, Refusal};
use crate::server::Ctx;
use crate::stats::Stats;
use crate::volume::Volume;
use bytes::{Buf, Bytes, BytesMut};
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{self as hs, InfoRequest, MetaContextRequest, OptionRequest};
use fastsan_nbd::transmission::{chunk_header, parse_request, request_need, simple_reply, Payload, Request};
use fastsan_nbd::{ProtocolError, MAX_PAYLOAD};
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{debug, info, warn};

/// The id of `base:allocation` once a client selects it.
const ALLOCATION_CONTEXT: u32 = 1;

/// Serves one NBD connection, given its two halves.
pub async fn serve<R, W>(mut rd: R, mut wr: W, peer: String, ctx: Arc<Ctx>)
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let hs = tokio::time::timeout(ctx.config.handshake_timeout, handshake(&mut rd, &mut wr, &mut buf, &ctx));
    let neg = match hs.await {
        Err(_) => {
            info!(%peer, "NBD handshake timed out; closing");
            Stats::add(&ctx.stats.protocol_errors, 1);
            return;
        }
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => {
            debug!(%peer, "NBD client left during the handshake");
            return;
        }
        Ok(Err(e)) => {
            info!(%peer, error = %e, "NBD handshake failed; closing");
            Stats::add(&ctx.stats.protocol_errors, 1);
            return;
        }
    };
    info!(%peer, export = %neg.volume.name, structured = neg.structured,
          block_status = neg.allocation_context, "NBD connection open");
    let align = if neg.volume.block_size > 512 { neg.volume.block_size } else { 1 };
    let limits = Limits { align, max_io: MAX_PAYLOAD };
    let encoder = NbdEncoder { structured: neg.structured };
    let (dispatcher, writer) = Dispatcher::new(neg.volume.clone(), ctx.clone(), limits, wr, encoder);
    let writer = tokio::spawn(writer.run());
    let end = read_loop(&dispatcher, &ctx, &neg, rd, buf).await;
    drop(dispatcher);
    let written = writer.await.unwrap_or_else(|e| Err(io::Error::other(e)));
    match (end, written) {
        (Err(ReadError::Protocol(e)), _) => {
            warn!(%peer, error = %e, "malformed NBD request; closing this connection");
            Stats::add(&ctx.stats.protocol_errors, 1);
        }
        (Err(ReadError::Io(e)), _) | (_, Err(e)) => info!(%peer, error = %e, "NBD connection lost"),
        (Ok(End::Disconnect), Ok(())) => info!(%peer, "NBD client disconnected"),
        (Ok(End::Eof), Ok(())) => info!(%peer, "NBD connection closed by peer"),
        (Ok(End::Shutdown), Ok(())) => info!(%peer, "NBD connection drained for shutdown"),
    }
}

/// What the handshake settled.
struct Negotiated {
    volume: Arc<Volume>,
    structured: bool,
    /// The client selected `base:allocation` for this export.
    allocation_context: bool,
}

#[derive(Debug, thiserror::Error)]
enum HandshakeError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("{0}")]
    Refused(String),
}

/// Fixed newstyle: greeting, client flags, then options until EXPORT_NAME or
/// a successful GO. `Ok(None)`: the client aborted or left.
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    buf: &mut BytesMut,
    ctx: &Ctx,
) -> Result<Option<Negotiated>, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    wr.write_all(&hs::greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)).await?;
    if !fill(rd, buf, 4).await? {
        return Ok(None);
    }
    let client_flags = buf.get_u32();
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::Refused(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    // The export for which base:allocation is selected, if any.
    let mut selected: Option<String> = None;
    let mut out = Vec::new();
    loop {
        let opt = match read_option(rd, buf).await {
            Ok(Some(o)) => o,
            Ok(None) => return Ok(None),
            Err(HandshakeError::Protocol(ProtocolError::OptionTooLarge { len, .. })) => {
                let option = u32::from_be_bytes(buf[8..12].try_into().expect("header is there"));
                hs::encode_reply(option, REP_ERR_TOO_BIG, b"option payload too large", &mut out);
                wr.write_all(&out).await?;
                return Err(HandshakeError::Refused(format!("option of {len} bytes")));
            }
            Err(e) => return Err(e),
        };
        out.clear();
        let o = opt.option;
        let err = |out: &mut Vec<u8>, code: u32, msg: &str| hs::encode_reply(o, code, msg.as_bytes(), out);
        match o {
            OPT_EXPORT_NAME => {
                let Ok(name) = hs::parse_export_name(&opt.data) else {
                    return Err(HandshakeError::Refused("malformed export name".into()));
                };
                // No error reply exists for EXPORT_NAME: an unknown export ends the session.
                let Some(volume) = lookup(ctx, &name) else {
                    return Err(HandshakeError::Refused(format!("unknown export {name:?}")));
                };
                wr.write_all(&hs::export_name_reply(volume.size, tflags(&volume, structured), no_zeroes))
                    .await?;
                let allocation_context = selected.as_deref() == Some(name.as_str());
                return Ok(Some(Negotiated { volume, structured, allocation_context }));
            }
            OPT_ABORT => {
                hs::encode_reply(o, REP_ACK, &[], &mut out);
                let _ = wr.write_all(&out).await;
                return Ok(None);
            }
            OPT_LIST if !opt.data.is_empty() => err(&mut out, REP_ERR_INVALID, "LIST takes no data"),
            OPT_LIST => {
                for name in &ctx.order {
                    let v = &ctx.volumes[name];
                    hs::encode_reply(o, REP_SERVER, &hs::rep_server(name, &v.backend.describe()), &mut out);
                }
                hs::encode_reply(o, REP_ACK, &[], &mut out);
            }
            OPT_INFO | OPT_GO => match InfoRequest::parse(&opt.data) {
                Err(e) => err(&mut out, REP_ERR_INVALID, &e.to_string()),
                Ok(req) => match lookup(ctx, &req.name) {
                    None => err(&mut out, REP_ERR_UNKNOWN, &format!("no export named {:?}", req.name)),
                    Some(volume) => {
                        info_replies(o, &volume, &req, structured, &mut out);
                        hs::encode_reply(o, REP_ACK, &[], &mut out);
                        if o == OPT_GO {
                            wr.write_all(&out).await?;
                            let allocation_context = selected.as_deref() == Some(req.name.as_str());
                            return Ok(Some(Negotiated { volume, structured, allocation_context }));
                        }
                    }
                },
            },
            OPT_STRUCTURED_REPLY if !opt.data.is_empty() => {
                err(&mut out, REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
            }
            OPT_STRUCTURED_REPLY if structured => err(&mut out, REP_ERR_INVALID, "already negotiated"),
            OPT_STRUCTURED_REPLY => {
                structured = true;
                hs::encode_reply(o, REP_ACK, &[], &mut out);
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = o == OPT_SET_META_CONTEXT;
                if set {
                    // Every SET replaces the selection, even when it fails.
                    selected = None;
                }
                match meta_context(ctx, &opt, set, structured) {
                    Err((code, msg)) => err(&mut out, code, &msg),
                    Ok((export, matched)) => {
                        if matched {
                            let id = if set { ALLOCATION_CONTEXT } else { 0 };
                            let body = hs::rep_meta_context(id, CONTEXT_BASE_ALLOCATION);
                            hs::encode_reply(o, REP_META_CONTEXT, &body, &mut out);
                            if set {
                                selected = Some(export);
                            }
                        }
                        hs::encode_reply(o, REP_ACK, &[], &mut out);
                    }
                }
            }
            OPT_STARTTLS => err(&mut out, REP_ERR_UNSUP, "TLS is not supported yet"),
            _ => err(&mut out, REP_ERR_UNSUP, "unsupported option"),
        }
        wr.write_all(&out).await?;
    }
}

/// The volume an export name names; `""` is the default export when there is
/// exactly one volume.
fn lookup(ctx: &Ctx, name: &str) -> Option<Arc<Volume>> {
    if name.is_empty() && ctx.order.len() == 1 {
        return Some(ctx.volumes[&ctx.order[0]].clone());
    }
    ctx.volumes.get(name).cloned()
}

/// Transmission flags: what this volume allows.
fn tflags(v: &Volume, structured: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_CAN_MULTI_CONN | TFLAG_SEND_CACHE;
    if structured {
        f |= TFLAG_SEND_DF;
    }
    if v.read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    f
}

/// NBD_REP_INFO replies for INFO and GO: always the export's size and flags,
/// and block sizes; its name and description when asked.
fn info_replies(o: u32, v: &Volume, req: &InfoRequest, structured: bool, out: &mut Vec<u8>) {
    hs::encode_reply(o, REP_INFO, &hs::info_export(v.size, tflags(v, structured)), out);
    let min = if v.block_size > 512 { v.block_size } else { 1 };
    hs::encode_reply(o, REP_INFO, &hs::info_block_size(min, 4096.max(min), MAX_PAYLOAD), out);
    if req.infos.contains(&INFO_NAME) {
        hs::encode_reply(o, REP_INFO, &hs::info_text(INFO_NAME, &v.name), out);
    }
    if req.infos.contains(&INFO_DESCRIPTION) {
        hs::encode_reply(o, REP_INFO, &hs::info_text(INFO_DESCRIPTION, &v.backend.describe()), out);
    }
}

/// LIST/SET_META_CONTEXT: whether `base:allocation` is matched, for which export.
fn meta_context(
    ctx: &Ctx,
    opt: &OptionRequest,
    set: bool,
    structured: bool,
) -> Result<(String, bool), (u32, String)> {
    if set && !structured {
        return Err((REP_ERR_INVALID, "SET_META_CONTEXT needs structured replies".into()));
    }
    let req = MetaContextRequest::parse(&opt.data).map_err(|e| (REP_ERR_INVALID, e.to_string()))?;
    if lookup(ctx, &req.name).is_none() {
        return Err((REP_ERR_UNKNOWN, format!("no export named {:?}", req.name)));
    }
    let matched = if req.queries.is_empty() {
        // LIST with no query lists every context; SET with none selects nothing.
        !set
    } else {
        req.queries.iter().any(|q| q == CONTEXT_BASE_ALLOCATION || (!set && q == "base:"))
    };
    Ok((req.name, matched))
}

/// Reads until `buf` holds `n` bytes; false if the peer closed first.
async fn fill<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut BytesMut, n: usize) -> io::Result<bool> {
    while buf.len() < n {
        buf.reserve(n - buf.len());
        if rd.read_buf(buf).await? == 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

async fn read_option<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
) -> Result<Option<OptionRequest>, HandshakeError> {
    loop {
        if let Some((o, n)) = hs::parse_option(buf)? {
            buf.advance(n);
            return Ok(Some(o));
        }
        buf.reserve(4096);
        if rd.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    }
}

enum End {
    Eof,
    Disconnect,
    Shutdown,
}

enum ReadError {
    Io(io::Error),
    Protocol(ProtocolError),
}

/// What the encoder needs to answer a request.
pub struct NbdMeta {
    command: u16,
    offset: u64,
}

/// Decode: one read, every complete request in it, until DISC or EOF.
async fn read_loop<R: AsyncRead + Unpin, W: AsyncWrite + Unpin + Send + 'static>(
    d: &Dispatcher<W, NbdEncoder>,
    ctx: &Ctx,
    neg: &Negotiated,
    mut rd: R,
    mut buf: BytesMut,
) -> Result<End, ReadError> {
    // Bytes of a refused oversized WRITE still to drop.
    let mut skip: u64 = 0;
    loop {
        loop {
            // Drop what arrived of a refused write's payload; parse on once it is all gone.
            let n = skip.min(buf.len() as u64);
            buf.advance(n as usize);
            skip -= n;
            if skip > 0 {
                break;
            }
            let Some((r, payload, used)) = parse_request(&buf).map_err(ReadError::Protocol)? else { break };
            let frame = buf.split_to(used).freeze();
            if r.command == CMD_DISC {
                return Ok(End::Disconnect);
            }
            let req = match payload {
                Payload::Skip(n) => {
                    skip = n as u64;
                    Err(Refusal::TooLarge)
                }
                Payload::Inline(_) => decode(&r, frame.slice(fastsan_nbd::transmission::REQUEST_LEN..), neg),
                Payload::None => decode(&r, Bytes::new(), neg),
            };
            let meta = NbdMeta { command: r.command, offset: r.offset };
            d.dispatch(r.cookie, meta, req).await.map_err(ReadError::Io)?;
        }
        // Everything this read brought is dispatched: its replies leave together.
        d.flush().await.map_err(ReadError::Io)?;
        if ctx.shutdown.is_cancelled() {
            return Ok(End::Shutdown);
        }
        buf.reserve(read_room(buf.len(), request_need(&buf)));
        let n = tokio::select! {
            r = rd.read_buf(&mut buf) => r.map_err(ReadError::Io)?,
            _ = ctx.shutdown.cancelled() => return Ok(End::Shutdown),
        };
        if n == 0 {
            return Ok(End::Eof);
        }
    }
}

/// NBD's wire rules for one request; the volume's rules come after.
fn decode(r: &Request, payload: Bytes, neg: &Negotiated) -> Result<IoRequest, Refusal> {
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
        CMD_BLOCK_STATUS => {
            (IoKind::BlockStatus { one: r.flags & CMD_FLAG_REQ_ONE != 0 }, CMD_FLAG_FUA | CMD_FLAG_REQ_ONE)
        }
        _ => return Err(Refusal::Unsupported),
    };
    if r.flags & !allowed != 0 {
        return Err(Refusal::Invalid);
    }
    if r.flags & CMD_FLAG_DF != 0 && !neg.structured {
        return Err(Refusal::Invalid);
    }
    if matches!(kind, IoKind::BlockStatus { .. }) && !(neg.structured && neg.allocation_context) {
        return Err(Refusal::Invalid);
    }
    Ok(IoRequest {
        kind,
        offset: r.offset,
        length: r.length as u64,
        fua: r.flags & CMD_FLAG_FUA != 0,
        payload,
    })
}

/// The one mapping from a refusal to an NBD error.
fn errno(r: Refusal, command: u16) -> u32 {
    match r {
        Refusal::OutOfRange if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) => ENOSPC,
        Refusal::ReadOnly => EPERM,
        Refusal::NotFast => ENOTSUP,
        Refusal::NoSpace => ENOSPC,
        Refusal::IoError | Refusal::DigestMismatch => EIO,
        Refusal::ShuttingDown => ESHUTDOWN,
        Refusal::OutOfRange
        | Refusal::Invalid
        | Refusal::Unsupported
        | Refusal::Misaligned
        | Refusal::TooLarge => EINVAL,
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
                let e = errno(*refusal, r.meta.command);
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
