//! The BRP front end: one connection from handshake to close.
//!
//! The request path, in order:
//! 1. **decode**: [`read_loop`] reads as many bytes as the socket has, frames
//!    every complete request in them ([`fastsan_brp::request::parse_request`]) and
//!    turns each into an [`IoRequest`] ([`decode`]: wire rules);
//! 2. **check**: [`Volume::validate`](crate::volume::Volume::validate) (volume rules);
//! 3. **device**: [`crate::exec::execute`], via the shared [`pipeline`](crate::pipeline);
//! 4. **reply**: [`crate::pipeline`]'s batched writes, with this module's [`BrpEncoder`].

use crate::exec::Outcome;
use crate::pipeline::{Dispatcher, Encoded, Encoder, Reply, READ_CHUNK};
use crate::request::{IoKind, IoRequest, Limits, Refusal};
use crate::server::{Ctx, Session};
use crate::stats::Stats;
use crate::volume::Volume;
use bytes::{Bytes, BytesMut};
use fastsan_brp::batch::BatchBody;
use fastsan_brp::handshake::{parse_message, Message, OpenInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use fastsan_brp::reply::ReplyHeader;
use fastsan_brp::request::{parse_request, RequestHeader, FLAGS_KNOWN};
use fastsan_brp::{Command, ProtocolError, Status};
use rand::RngCore;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tracing::{debug, info, warn};

/// Tells a client over the connection cap that the target is busy.
pub async fn refuse_busy(mut stream: TcpStream, peer: SocketAddr) {
    warn!(%peer, "connection refused: too many connections");
    let msg = Message::Error { status: Status::BUSY, message: "too many connections".into() };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(&msg.to_vec())).await;
}

/// Serves one connection until the peer leaves, breaks the protocol, or the
/// server shuts down.
pub async fn serve(mut stream: TcpStream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let hs = tokio::time::timeout(ctx.config.handshake_timeout, handshake(&mut stream, &mut buf, &ctx));
    let opened = match hs.await {
        Err(_) => {
            info!(%peer, "handshake timed out; closing");
            Stats::add(&ctx.stats.protocol_errors, 1);
            return;
        }
        Ok(Err(HandshakeEnd::Closed)) => return,
        Ok(Err(HandshakeEnd::Refused(why))) => {
            info!(%peer, "handshake refused: {why}");
            return;
        }
        Ok(Err(HandshakeEnd::Io(e))) => {
            debug!(%peer, error = %e, "connection lost during handshake");
            return;
        }
        Ok(Err(HandshakeEnd::Protocol(e))) => {
            warn!(%peer, error = %e, "malformed handshake; closing");
            Stats::add(&ctx.stats.protocol_errors, 1);
            return;
        }
        Ok(Ok(o)) => o,
    };
    let Opened { volume, session, digests } = opened;
    info!(%peer, volume = %volume.name, session = format_args!("{:016x}", session.id), digests, "connection open");

    let (rd, wr) = stream.into_split();
    let limits = Limits { align: volume.block_size, max_io: volume.max_transfer };
    let (dispatcher, writer) = Dispatcher::new(volume, ctx.clone(), limits, wr, BrpEncoder { digests });
    let writer = tokio::spawn(writer.run());
    let end = read_loop(&dispatcher, &ctx, rd, buf, digests).await;
    // Dropping the dispatcher drops its reply sender: the writer finishes the
    // replies still in flight, then stops.
    drop(dispatcher);
    let written = writer.await.unwrap_or_else(|e| Err(io::Error::other(e)));
    match (end, written) {
        (ReadEnd::Protocol(e), _) => {
            warn!(%peer, error = %e, "malformed frame; closing this connection");
            Stats::add(&ctx.stats.protocol_errors, 1);
        }
        (ReadEnd::Io(e), _) | (_, Err(e)) => info!(%peer, error = %e, "connection lost"),
        (ReadEnd::Eof, Ok(())) => info!(%peer, "connection closed by peer"),
        (ReadEnd::Shutdown, Ok(())) => info!(%peer, "connection drained for shutdown"),
    }
    drop(session);
}

struct Opened {
    volume: Arc<Volume>,
    session: SessionGuard,
    digests: bool,
}

enum HandshakeEnd {
    Closed,
    Refused(String),
    Io(io::Error),
    Protocol(ProtocolError),
}

impl From<io::Error> for HandshakeEnd {
    fn from(e: io::Error) -> Self {
        HandshakeEnd::Io(e)
    }
}

async fn read_message(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<Message, HandshakeEnd> {
    loop {
        match parse_message(buf) {
            Ok(Some((m, n))) => {
                let _ = buf.split_to(n);
                return Ok(m);
            }
            Ok(None) => {}
            Err(e) => return Err(HandshakeEnd::Protocol(e)),
        }
        buf.reserve(4096);
        if stream.read_buf(buf).await? == 0 {
            return Err(HandshakeEnd::Closed);
        }
    }
}

async fn send(stream: &mut TcpStream, m: &Message) -> io::Result<()> {
    stream.write_all(&m.to_vec()).await
}

async fn refuse(stream: &mut TcpStream, status: Status, why: String) -> HandshakeEnd {
    let m = Message::Error { status, message: why.clone() };
    if let Err(e) = send(stream, &m).await {
        return HandshakeEnd::Io(e);
    }
    HandshakeEnd::Refused(why)
}

/// HELLO, then AUTH when the target has a secret, then any number of LIST
/// and OPEN until one OPEN succeeds.
async fn handshake(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    ctx: &Arc<Ctx>,
) -> Result<Opened, HandshakeEnd> {
    let features = match read_message(stream, buf).await? {
        Message::Hello { min_version, max_version, features } => {
            if !(min_version..=max_version).contains(&fastsan_brp::VERSION) {
                let why = format!(
                    "client speaks versions {min_version}..={max_version}, target speaks {}",
                    fastsan_brp::VERSION
                );
                return Err(refuse(stream, Status::BAD_VERSION, why).await);
            }
            features & fastsan_brp::FEATURES_KNOWN
        }
        other => {
            return Err(refuse(stream, Status::UNEXPECTED, format!("expected HELLO, got {other:?}")).await)
        }
    };
    let mut challenge = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut challenge);
    let auth = if ctx.config.secret.is_some() { AUTH_HMAC_SHA256 } else { AUTH_NONE };
    send(stream, &Message::HelloReply { version: fastsan_brp::VERSION, auth, features, challenge }).await?;

    if let Some(secret) = &ctx.config.secret {
        match read_message(stream, buf).await? {
            Message::Auth { client_nonce, proof } => {
                if !fastsan_brp::auth::verify_client(secret, &challenge, &client_nonce, &proof) {
                    Stats::add(&ctx.stats.auth_failures, 1);
                    return Err(refuse(stream, Status::AUTH_FAILED, "authentication failed".into()).await);
                }
                let proof = fastsan_brp::auth::server_proof(secret, &challenge, &client_nonce);
                send(stream, &Message::AuthOk { proof }).await?;
            }
            _ => {
                Stats::add(&ctx.stats.auth_failures, 1);
                return Err(refuse(
                    stream,
                    Status::AUTH_REQUIRED,
                    "this target requires authentication".into(),
                )
                .await);
            }
        }
    }

    loop {
        match read_message(stream, buf).await? {
            Message::List => {
                let volumes = ctx.order.iter().map(|n| ctx.volumes[n].info()).collect();
                send(stream, &Message::ListReply { volumes }).await?;
            }
            Message::Open { session, name } => {
                let Some(volume) = ctx.volumes.get(&name) else {
                    let m = Message::Error {
                        status: Status::NO_SUCH_VOLUME,
                        message: format!("no volume named {name:?}"),
                    };
                    send(stream, &m).await?;
                    continue;
                };
                let session = match join_session(ctx, session, &name) {
                    Ok(s) => s,
                    Err(why) => {
                        send(stream, &Message::Error { status: Status::UNEXPECTED, message: why }).await?;
                        continue;
                    }
                };
                let info = OpenInfo {
                    session: session.id,
                    size: volume.size,
                    block_size: volume.block_size,
                    max_transfer: volume.max_transfer,
                    queue_depth: if ctx.config.serial { 1 } else { ctx.config.queue_depth },
                    max_batch: fastsan_brp::limits::MAX_BATCH,
                    flags: volume.flags(),
                };
                send(stream, &Message::OpenReply(info)).await?;
                return Ok(Opened {
                    volume: volume.clone(),
                    session,
                    digests: features & fastsan_brp::FEATURE_DIGEST != 0,
                });
            }
            other => return Err(refuse(stream, Status::UNEXPECTED, format!("unexpected {other:?}")).await),
        }
    }
}

/// Joins session `id` (0: a new one). An unknown id is taken as given, so an
/// initiator keeps its session across a target restart. The connection
/// leaves the session when the guard drops, whatever path it ends by.
fn join_session(ctx: &Arc<Ctx>, id: u64, volume: &str) -> Result<SessionGuard, String> {
    let mut sessions = ctx.sessions.lock();
    let id = if id != 0 {
        id
    } else {
        loop {
            let r = rand::random::<u64>();
            if r != 0 && !sessions.contains_key(&r) {
                break r;
            }
        }
    };
    let s = sessions.entry(id).or_insert_with(|| Session { volume: volume.to_owned(), connections: 0 });
    if s.volume != volume {
        return Err(format!("session {id:016x} belongs to volume {:?}", s.volume));
    }
    s.connections += 1;
    Ok(SessionGuard { ctx: ctx.clone(), id })
}

/// A connection's membership in a session.
struct SessionGuard {
    ctx: Arc<Ctx>,
    id: u64,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        let mut sessions = self.ctx.sessions.lock();
        if let Some(s) = sessions.get_mut(&self.id) {
            s.connections -= 1;
            if s.connections == 0 {
                sessions.remove(&self.id);
            }
        }
    }
}

enum ReadEnd {
    Eof,
    Shutdown,
    Io(io::Error),
    Protocol(ProtocolError),
}

/// Decode: one read, every complete frame in it, until the peer leaves.
type BrpDispatcher = Dispatcher<OwnedWriteHalf, BrpEncoder>;

async fn read_loop(
    d: &BrpDispatcher,
    ctx: &Ctx,
    mut rd: OwnedReadHalf,
    mut buf: BytesMut,
    digests: bool,
) -> ReadEnd {
    loop {
        let need = loop {
            match parse_request(&buf, digests) {
                Ok(Some(frame)) => {
                    let bytes = buf.split_to(frame.frame_len).freeze();
                    let at = frame.payload_at;
                    let payload = bytes.slice(at..at + frame.header.payload_len as usize);
                    if let Err(end) = on_frame(d, ctx, frame.header, payload, frame.payload_ok).await {
                        return end;
                    }
                }
                Ok(None) => break frame_need(&buf, digests),
                Err(e) => return ReadEnd::Protocol(e),
            }
        };
        // Everything this read brought is dispatched: its replies leave together.
        if let Err(e) = d.flush().await {
            return ReadEnd::Io(e);
        }
        if ctx.shutdown.is_cancelled() {
            return ReadEnd::Shutdown;
        }
        buf.reserve(crate::pipeline::read_room(buf.len(), need));
        let n = tokio::select! {
            r = rd.read_buf(&mut buf) => r,
            _ = ctx.shutdown.cancelled() => return ReadEnd::Shutdown,
        };
        match n {
            Ok(0) => return ReadEnd::Eof,
            Ok(_) => {}
            Err(e) => return ReadEnd::Io(e),
        }
    }
}

/// A frame is one request, or a BATCH of them unpacked here.
async fn on_frame(
    d: &BrpDispatcher,
    ctx: &Ctx,
    h: RequestHeader,
    payload: Bytes,
    ok: bool,
) -> Result<(), ReadEnd> {
    if h.command != Command::Batch {
        return d.dispatch(h.tag, (), decode(&h, payload, ok)).await.map_err(ReadEnd::Io);
    }
    if !ok {
        return Err(ReadEnd::Protocol(ProtocolError::BatchDigest));
    }
    let body = BatchBody::parse(h.count, &payload).map_err(ReadEnd::Protocol)?;
    Stats::add(&ctx.stats.batches, 1);
    Stats::add(&ctx.stats.batched_requests, body.len() as u64);
    for sub in body.iter() {
        let at = sub.payload_at;
        let p = payload.slice(at..at + sub.header.payload_len as usize);
        d.dispatch(sub.header.tag, (), decode(&sub.header, p, ok)).await.map_err(ReadEnd::Io)?;
    }
    Ok(())
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
        Command::Batch => return Err(Refusal::Invalid),
        Command::Unknown(_) => return Err(Refusal::Unsupported),
    };
    if h.flags & !FLAGS_KNOWN != 0 || (kind != IoKind::Write && h.payload_len != 0) {
        return Err(Refusal::Invalid);
    }
    if !payload_ok {
        return Err(Refusal::DigestMismatch);
    }
    Ok(IoRequest { kind, offset: h.offset, length: h.length as u64, fua: h.is_fua(), payload })
}

/// The one mapping from a refusal to a BRP status.
fn status(r: Refusal) -> Status {
    match r {
        Refusal::Invalid => Status::INVALID,
        Refusal::Unsupported => Status::UNSUPPORTED,
        Refusal::OutOfRange => Status::OUT_OF_RANGE,
        Refusal::Misaligned => Status::MISALIGNED,
        Refusal::TooLarge => Status::TOO_LARGE,
        Refusal::ReadOnly => Status::READ_ONLY,
        Refusal::IoError | Refusal::NotFast => Status::IO_ERROR,
        Refusal::NoSpace => Status::NO_SPACE,
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
            Err(refusal) => (status(*refusal), None),
        };
        let payload_len = data.as_ref().map_or(0, |d| d.len() as u32);
        let start = scratch.len();
        let (h, n) = ReplyHeader { status: st, tag: r.tag, payload_len }.encode_wire(self.digests);
        scratch.extend_from_slice(&h[..n]);
        let head = start..scratch.len();
        if self.digests && payload_len > 0 {
            scratch.extend(fastsan_brp::request::encode_data_digest(data.as_deref().unwrap_or_default()));
        }
        Encoded { head: head.clone(), data, tail: head.end..scratch.len() }
    }
}
