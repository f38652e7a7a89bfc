//! The BRP front end: one connection from handshake to close.
//!
//! The request path, in order:
//! 1. **decode**: [`Connection::read_loop`] reads as many bytes as the socket
//!    has and frames every complete request in them ([`brp::request::parse_request`]);
//! 2. **check**: [`Connection::dispatch`] asks [`Volume::validate`];
//! 3. **device**: [`crate::exec::execute`], inline for memory and null
//!    volumes, on the I/O pool for files, many requests in flight;
//! 4. **reply**: [`write_replies`] gathers every ready reply into one
//!    `writev`, in completion order (tags match them up).
//!
//! A request holds a credit from decode until its reply is written, so one
//! connection never has more than its queue depth, nor more than its byte
//! budget, in flight; when credits run out the reader simply stops reading.

use crate::exec::{execute, Op};
use crate::server::{Ctx, Session};
use crate::stats::Stats;
use crate::volume::Volume;
use brp::batch::BatchBody;
use brp::digest::DIGEST_LEN;
use brp::handshake::{parse_message, Message, OpenInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use brp::reply::ReplyHeader;
use brp::request::{parse_request, RequestHeader};
use brp::{Command, ProtocolError, Status};
use bytes::{Bytes, BytesMut};
use rand::RngCore;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

/// Bytes of payload one connection may hold in flight.
const BYTE_BUDGET: u32 = 64 << 20;
/// Credits on the byte budget are counted in KiB.
const BUDGET_UNIT: u32 = 1024;
/// Most replies gathered into one write.
const MAX_REPLIES_PER_WRITE: usize = 256;
const READ_CHUNK: usize = 256 * 1024;

/// Tells a client over the connection cap that the target is busy.
pub async fn refuse_busy(mut stream: TcpStream, peer: SocketAddr) {
    warn!(%peer, "connection refused: too many connections");
    let msg = Message::Error {
        status: Status::BUSY,
        message: "too many connections".into(),
    };
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(1),
        stream.write_all(&msg.to_vec()),
    )
    .await;
}

/// Serves one connection until the peer leaves, breaks the protocol, or the
/// server shuts down.
pub async fn serve(mut stream: TcpStream, peer: SocketAddr, ctx: Arc<Ctx>) {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let hs = tokio::time::timeout(
        ctx.config.handshake_timeout,
        handshake(&mut stream, &mut buf, &ctx),
    );
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
    let Opened {
        volume,
        session,
        digests,
    } = opened;
    info!(%peer, volume = %volume.name, session = format_args!("{session:016x}"), digests, "connection open");

    let (rd, wr) = stream.into_split();
    let (tx, rx) = mpsc::unbounded_channel();
    let queue_depth = if ctx.config.serial {
        1
    } else {
        ctx.config.queue_depth as usize
    };
    let conn = Connection {
        volume,
        ctx: ctx.clone(),
        tx,
        credits: Arc::new(Semaphore::new(queue_depth)),
        budget: Arc::new(Semaphore::new((BYTE_BUDGET / BUDGET_UNIT) as usize)),
        digests,
    };
    let writer = tokio::spawn(write_replies(wr, rx, digests));
    let end = conn.read_loop(rd, buf).await;
    // Dropping the connection drops its reply sender: the writer finishes the
    // replies still in flight, then stops.
    drop(conn);
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
    let mut sessions = ctx.sessions.lock();
    if let Some(s) = sessions.get_mut(&session) {
        s.connections -= 1;
        if s.connections == 0 {
            sessions.remove(&session);
        }
    }
}

struct Opened {
    volume: Arc<Volume>,
    session: u64,
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
    let m = Message::Error {
        status,
        message: why.clone(),
    };
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
    ctx: &Ctx,
) -> Result<Opened, HandshakeEnd> {
    let features = match read_message(stream, buf).await? {
        Message::Hello {
            min_version,
            max_version,
            features,
        } => {
            if !(min_version..=max_version).contains(&brp::VERSION) {
                let why = format!(
                    "client speaks versions {min_version}..={max_version}, target speaks {}",
                    brp::VERSION
                );
                return Err(refuse(stream, Status::BAD_VERSION, why).await);
            }
            features & brp::FEATURES_KNOWN
        }
        other => {
            return Err(refuse(
                stream,
                Status::UNEXPECTED,
                format!("expected HELLO, got {other:?}"),
            )
            .await)
        }
    };
    let mut challenge = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut challenge);
    let auth = if ctx.config.secret.is_some() {
        AUTH_HMAC_SHA256
    } else {
        AUTH_NONE
    };
    send(
        stream,
        &Message::HelloReply {
            version: brp::VERSION,
            auth,
            features,
            challenge,
        },
    )
    .await?;

    if let Some(secret) = &ctx.config.secret {
        match read_message(stream, buf).await? {
            Message::Auth {
                client_nonce,
                proof,
            } => {
                if !brp::auth::verify_client(secret, &challenge, &client_nonce, &proof) {
                    Stats::add(&ctx.stats.auth_failures, 1);
                    return Err(refuse(
                        stream,
                        Status::AUTH_FAILED,
                        "authentication failed".into(),
                    )
                    .await);
                }
                let proof = brp::auth::server_proof(secret, &challenge, &client_nonce);
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
                        send(
                            stream,
                            &Message::Error {
                                status: Status::UNEXPECTED,
                                message: why,
                            },
                        )
                        .await?;
                        continue;
                    }
                };
                let info = OpenInfo {
                    session,
                    size: volume.size,
                    block_size: volume.block_size,
                    max_transfer: volume.max_transfer,
                    queue_depth: if ctx.config.serial {
                        1
                    } else {
                        ctx.config.queue_depth
                    },
                    max_batch: brp::limits::MAX_BATCH,
                    flags: volume.flags(),
                };
                send(stream, &Message::OpenReply(info)).await?;
                return Ok(Opened {
                    volume: volume.clone(),
                    session,
                    digests: features & brp::FEATURE_DIGEST != 0,
                });
            }
            other => {
                return Err(
                    refuse(stream, Status::UNEXPECTED, format!("unexpected {other:?}")).await,
                )
            }
        }
    }
}

/// Joins session `id` (0: a new one). An unknown id is taken as given, so an
/// initiator keeps its session across a target restart.
fn join_session(ctx: &Ctx, id: u64, volume: &str) -> Result<u64, String> {
    let mut sessions = ctx.sessions.lock();
    let id = if id == 0 {
        loop {
            let r = rand::random::<u64>();
            if r != 0 && !sessions.contains_key(&r) {
                break r;
            }
        }
    } else {
        id
    };
    let s = sessions.entry(id).or_insert_with(|| Session {
        volume: volume.to_owned(),
        connections: 0,
    });
    if s.volume != volume {
        return Err(format!(
            "session {id:016x} belongs to volume {:?}",
            s.volume
        ));
    }
    s.connections += 1;
    Ok(id)
}

/// One reply on its way to the writer, with the credits it returns once written.
struct Reply {
    tag: u64,
    status: Status,
    data: Option<Bytes>,
    _credit: Credit,
}

struct Credit {
    _slot: OwnedSemaphorePermit,
    _bytes: Option<OwnedSemaphorePermit>,
}

enum ReadEnd {
    Eof,
    Shutdown,
    Io(io::Error),
    Protocol(ProtocolError),
}

struct Connection {
    volume: Arc<Volume>,
    ctx: Arc<Ctx>,
    tx: mpsc::UnboundedSender<Reply>,
    credits: Arc<Semaphore>,
    budget: Arc<Semaphore>,
    digests: bool,
}

impl Connection {
    /// Decode: one read, every complete frame in it, until the peer leaves.
    async fn read_loop(
        &self,
        mut rd: tokio::net::tcp::OwnedReadHalf,
        mut buf: BytesMut,
    ) -> ReadEnd {
        loop {
            let need = loop {
                match parse_request(&buf, self.digests) {
                    Ok(Some(frame)) => {
                        let bytes = buf.split_to(frame.frame_len).freeze();
                        let payload = bytes.slice(
                            frame.payload_at..frame.payload_at + frame.header.payload_len as usize,
                        );
                        if let Err(e) = self.on_frame(frame.header, payload, frame.payload_ok).await
                        {
                            return ReadEnd::Protocol(e);
                        }
                    }
                    Ok(None) => break frame_need(&buf, self.digests),
                    Err(e) => return ReadEnd::Protocol(e),
                }
            };
            if self.ctx.shutdown.is_cancelled() {
                return ReadEnd::Shutdown;
            }
            buf.reserve(need.max(READ_CHUNK).saturating_sub(buf.len()));
            let n = tokio::select! {
                r = rd.read_buf(&mut buf) => r,
                _ = self.ctx.shutdown.cancelled() => return ReadEnd::Shutdown,
            };
            match n {
                Ok(0) => return ReadEnd::Eof,
                Ok(_) => {}
                Err(e) => return ReadEnd::Io(e),
            }
        }
    }

    async fn on_frame(
        &self,
        h: RequestHeader,
        payload: Bytes,
        payload_ok: bool,
    ) -> Result<(), ProtocolError> {
        if h.command != Command::Batch {
            self.dispatch(h, payload, payload_ok).await;
            return Ok(());
        }
        let body = BatchBody::parse(h.count, &payload)?;
        Stats::add(&self.ctx.stats.batches, 1);
        Stats::add(&self.ctx.stats.batched_requests, body.len() as u64);
        for sub in body.iter() {
            let at = sub.payload_at;
            let p = payload.slice(at..at + sub.header.payload_len as usize);
            self.dispatch(sub.header, p, payload_ok).await;
        }
        Ok(())
    }

    /// Check, then hand to the device: inline or on the pool.
    async fn dispatch(&self, h: RequestHeader, payload: Bytes, payload_ok: bool) {
        let credit = self.credit(&h).await;
        Stats::add(&self.ctx.stats.requests, 1);
        let op = if payload_ok {
            self.volume.validate(&h, payload)
        } else {
            Err(Status::DIGEST_MISMATCH)
        };
        let op = match op {
            Ok(op) => op,
            Err(status) => {
                debug!(tag = h.tag, command = ?h.command, %status, "request refused");
                Stats::add(&self.ctx.stats.errors, 1);
                let _ = self.tx.send(Reply {
                    tag: h.tag,
                    status,
                    data: None,
                    _credit: credit,
                });
                return;
            }
        };
        let stats_len = match &op {
            Op::Read { len, .. } => (*len as u64, 0),
            Op::Write { data, .. } => (0, data.len() as u64),
            _ => (0, 0),
        };
        let backend = self.volume.backend.clone();
        let tx = self.tx.clone();
        let ctx = self.ctx.clone();
        let run = move || {
            let (status, data) = match execute(&*backend, op) {
                Ok(data) => {
                    Stats::add(&ctx.stats.bytes_read, stats_len.0);
                    Stats::add(&ctx.stats.bytes_written, stats_len.1);
                    (Status::OK, data)
                }
                Err(status) => {
                    Stats::add(&ctx.stats.errors, 1);
                    (status, None)
                }
            };
            let _ = tx.send(Reply {
                tag: h.tag,
                status,
                data,
                _credit: credit,
            });
        };
        if self.volume.backend.may_block() && !self.ctx.config.serial {
            self.ctx.pool.submit(run);
        } else {
            run();
        }
    }

    /// Waits for a queue slot and, for data-carrying requests, byte budget.
    async fn credit(&self, h: &RequestHeader) -> Credit {
        let slot = self
            .credits
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        let moves_data = matches!(h.command, Command::Read | Command::Write);
        let bytes = if moves_data {
            let units = (h.length / BUDGET_UNIT).clamp(1, BYTE_BUDGET / BUDGET_UNIT);
            Some(
                self.budget
                    .clone()
                    .acquire_many_owned(units)
                    .await
                    .expect("never closed"),
            )
        } else {
            None
        };
        Credit {
            _slot: slot,
            _bytes: bytes,
        }
    }
}

/// How many bytes the frame at the start of `buf` needs in all, when its
/// header is there (so that one reserve makes room for a large write).
fn frame_need(buf: &[u8], digests: bool) -> usize {
    match buf.first_chunk() {
        Some(h) => match RequestHeader::decode(h) {
            Ok(h) => brp::request::frame_len(h.payload_len, digests),
            Err(_) => 0,
        },
        None => 0,
    }
}

/// Reply: gathers every reply that is ready into one vectored write.
async fn write_replies(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    digests: bool,
) -> io::Result<()> {
    let mut batch: Vec<Reply> = Vec::with_capacity(MAX_REPLIES_PER_WRITE);
    let mut heads: Vec<u8> = Vec::with_capacity(MAX_REPLIES_PER_WRITE * 32);
    let mut trailers: Vec<[u8; DIGEST_LEN]> = Vec::with_capacity(MAX_REPLIES_PER_WRITE);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_REPLIES_PER_WRITE {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        heads.clear();
        trailers.clear();
        let hlen = ReplyHeader::wire_len(digests);
        for r in &batch {
            let payload_len = r.data.as_ref().map_or(0, |d| d.len() as u32);
            let (h, n) = ReplyHeader {
                status: r.status,
                tag: r.tag,
                payload_len,
            }
            .encode_wire(digests);
            heads.extend_from_slice(&h[..n]);
            if digests {
                trailers.push(brp::request::encode_data_digest(
                    r.data.as_deref().unwrap_or(&[]),
                ));
            }
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 3);
        for (i, r) in batch.iter().enumerate() {
            slices.push(IoSlice::new(&heads[i * hlen..(i + 1) * hlen]));
            if let Some(d) = r.data.as_deref().filter(|d| !d.is_empty()) {
                slices.push(IoSlice::new(d));
                if digests {
                    slices.push(IoSlice::new(&trailers[i]));
                }
            }
        }
        write_all_vectored(&mut w, &mut slices).await?;
        drop(slices);
        batch.clear();
    }
    w.shutdown().await
}

pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}
