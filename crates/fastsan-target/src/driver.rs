//! The connection driver: the one place that touches a connection's socket,
//! for every protocol. [`serve_connection`] runs a front end's handshake
//! state machine, then the transmission loop: one read brings as many bytes
//! as the socket has (within the room a [`ReadPlan`] gives: a large frame is
//! read to its end, so that growing the buffer never copies it), the front
//! end **decodes** every complete request in them, the [`Dispatcher`]
//! checks, executes and answers each, and the replies of one read leave
//! together; then the next read asks the socket itself before it waits for
//! the runtime to say it has data (`Eager`). It waits for credits, stops at
//! shutdown, tells end-of-stream in the middle of a frame (an error) from a
//! clean close, and logs how every connection ended, with its peer.
//!
//! It works over any [`Transport`] (TCP, unix sockets, in-memory streams in
//! tests). An io_uring engine would replace this module and nothing else.

use crate::access::Who;
use crate::coalesce::{Coalesce, Timer};
use crate::fence::Activity;
use crate::frontend::{Decoded, Frontend, Handshake, Step, Transmission, WireError};
use crate::gate::Ticket;
use crate::pipeline::{ConnEnv, Dispatcher, Prepaid, READ_CHUNK, READ_GROWTH};
use crate::stats::Stats;
use crate::tls::{cert_identity, MaybeTls, Prefixed};
use bytes::{BufMut, Bytes, BytesMut};
use fastsan_initiator::read_plan::{ReadPlan, LARGE_FRAME};
use futures::FutureExt;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{debug, info, warn};

/// Replies a front end made itself (no credit, no device: an NVMe Identify,
/// an R2T, a refusal) held at most before they are sent and the socket's
/// back-pressure reaches the client: at most 64 x 4 KiB of NVMe admin pages.
const LOCAL_REPLIES_HELD: u32 = 64;

/// A byte stream a connection can run on, whole (for the handshake and a
/// TLS upgrade) or split into its two halves (for transmission).
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn split(self) -> (Self::Read, Self::Write);
    /// The socket, to reset it when its peer stopped reading; none for
    /// in-memory streams.
    fn socket(&self) -> Option<std::os::fd::RawFd> {
        None
    }
}

impl Transport for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
    fn socket(&self) -> Option<std::os::fd::RawFd> {
        Some(std::os::fd::AsRawFd::as_raw_fd(self))
    }
}

impl Transport for tokio::net::UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn split(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl Transport for tokio::io::DuplexStream {
    type Read = tokio::io::ReadHalf<tokio::io::DuplexStream>;
    type Write = tokio::io::WriteHalf<tokio::io::DuplexStream>;
    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

/// How a handshake ended without reaching transmission.
enum HandshakeEnd {
    Closed,
    Truncated,
    Abort,
    Refused(String),
    /// A failed authentication (a wrong secret, a certificate TLS refused).
    AuthFailed(String),
    Io(io::Error),
    Protocol(WireError),
}

/// How the transmission phase ended.
enum End {
    Eof,
    Truncated,
    Disconnect,
    Shutdown,
    /// Stopped from elsewhere: its reply stream failed, or a reconnect of
    /// its session took its slot.
    Stopped,
    /// The rest of a frame whose budget is held did not come within the stall timeout.
    Silent,
    Io(io::Error),
    Protocol(WireError),
}

/// Serves one connection of front end `F` from its first byte to its close.
/// The handshake runs on `ticket` (a place at the listeners' [`crate::gate::Gate`]); the
/// transmission phase needs one of the server's connection slots.
pub async fn serve_connection<F: Frontend, S: Transport>(
    frontend: Arc<F>,
    stream: S,
    peer: Arc<str>,
    who: Who,
    env: Arc<ConnEnv>,
    ticket: Ticket,
) {
    let name = F::NAME;
    let socket = stream.socket();
    let stream = MaybeTls::Plain(stream);
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let hs = async {
        let mut stream = stream;
        let mut machine = frontend.handshake(who.clone());
        let mut out = Vec::new();
        machine.start(&mut out);
        let (mut conn, last) = loop {
            match handshake(&mut machine, &mut stream, &mut buf, std::mem::take(&mut out), &env.stats).await?
            {
                Ok(done) => break done,
                Err(replay) => {
                    let tls = env
                        .access
                        .tls
                        .clone()
                        .ok_or_else(|| HandshakeEnd::Refused("TLS is not configured".into()))?;
                    // Only BRP's ClientHello, read before it was known to be
                    // TLS, goes on into TLS. What a client sent after NBD's
                    // STARTTLS, before its TLS handshake, is plaintext someone
                    // may have injected (CVE-2021-3716): refused, never read as
                    // options, never carried into TLS.
                    let prefix = match replay {
                        true => buf.split().freeze(),
                        false if !buf.is_empty() => {
                            return Err(HandshakeEnd::Refused(format!(
                                "{} bytes of plaintext after STARTTLS, before the TLS handshake",
                                buf.len()
                            )))
                        }
                        false => Bytes::new(),
                    };
                    let MaybeTls::Plain(plain) = stream else {
                        return Err(HandshakeEnd::Refused("a second TLS upgrade".into()));
                    };
                    let tls_stream =
                        tls.acceptor.accept(Prefixed::new(prefix, plain)).await.map_err(|e| {
                            // A refused certificate is a failed authentication;
                            // a client that left or spoke no TLS is not.
                            let refused = e
                                .get_ref()
                                .and_then(|e| e.downcast_ref::<rustls::Error>())
                                .is_some_and(|e| {
                                    matches!(
                                        e,
                                        rustls::Error::InvalidCertificate(_)
                                            | rustls::Error::NoCertificatesPresented
                                    )
                                });
                            let why = format!("TLS handshake failed: {e}");
                            if refused {
                                Stats::add(&env.stats.auth_failures, 1);
                                if let Some(ip) = who.ip {
                                    env.access.limiter.failed(ip);
                                }
                                HandshakeEnd::AuthFailed(why)
                            } else {
                                HandshakeEnd::Refused(why)
                            }
                        })?;
                    let identity = tls_stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| cert_identity(c));
                    debug!(%peer, identity = identity.as_deref().unwrap_or("none"), "{name} TLS established");
                    machine.tls_started(identity);
                    stream = MaybeTls::Tls(Box::new(tls_stream));
                }
            }
        };
        if !ticket.settle() {
            // Closed for a newcomer as the OPEN came in: nothing fenced, nothing answered.
            return Err(HandshakeEnd::Refused(
                "every handshake place was taken, and this one was the oldest".into(),
            ));
        }
        // A session's reconnect is answered once its lost connections are done (the fence).
        if let Some(fence) = conn.fence() {
            fence.await;
            if conn.activity().is_stopped() {
                return Err(HandshakeEnd::Refused(
                    "replaced by a newer reconnect while waiting for its fence".into(),
                ));
            }
        }
        let Ok(slot) = env.slots.clone().try_acquire_owned() else {
            if let Some(msg) = frontend.busy() {
                let _ = stream.write_all(&msg).await;
            }
            return Err(HandshakeEnd::Refused("too many connections".into()));
        };
        stream.write_all(&last).await.map_err(HandshakeEnd::Io)?;
        stream.flush().await.map_err(HandshakeEnd::Io)?;
        Ok((conn, slot, stream))
    };
    // A connection still in its handshake at shutdown holds no acknowledged
    // data: it is closed at once, not waited for until its timeout (a silent
    // client held a stopping target up to --handshake-timeout).
    let hs = tokio::select! {
        r = tokio::time::timeout(env.handshake_timeout, hs) => r,
        _ = env.shutdown.cancelled() => {
            info!(%peer, "{name} connection closed in its handshake: the target is shutting down");
            return;
        }
        _ = ticket.closed().cancelled() => {
            info!(%peer, "{name} connection closed in its handshake: every place was taken, and this one was the oldest");
            return Stats::add(&env.stats.refused, 1);
        }
    };
    let (conn, _slot, stream) = match hs {
        Ok(Ok(c)) => c,
        Err(_) => {
            info!(%peer, "{name} handshake timed out; closing");
            return Stats::add(&env.stats.protocol_errors, 1);
        }
        Ok(Err(end)) => {
            match end {
                HandshakeEnd::Closed => debug!(%peer, "{name} client left during the handshake"),
                HandshakeEnd::Abort => debug!(%peer, "{name} client aborted the handshake"),
                HandshakeEnd::Refused(why) => {
                    info!(%peer, "{name} handshake refused: {why}");
                    Stats::add(&env.stats.refused, 1);
                }
                HandshakeEnd::AuthFailed(why) => {
                    // Counted where it was found, before the refusal went out.
                    let blocked = who.ip.is_some_and(|ip| env.access.limiter.check(ip).is_err());
                    warn!(%peer, "{name} authentication failed: {why}");
                    if blocked {
                        warn!(%peer, "too many failed authentications from this address: refusing its secrets for a minute");
                    }
                }
                HandshakeEnd::Io(e) => debug!(%peer, "{name} connection lost during the handshake: {e}"),
                HandshakeEnd::Truncated => {
                    info!(%peer, "{name} client closed in the middle of a handshake message");
                    Stats::add(&env.stats.protocol_errors, 1);
                }
                HandshakeEnd::Protocol(e) => {
                    warn!(%peer, "malformed {name} handshake; closing: {e}");
                    Stats::add(&env.stats.protocol_errors, 1);
                }
            }
            return;
        }
    };
    let tls = stream.is_tls();
    let (mut rd, wr) = stream.split();
    drop(ticket);
    let volume = match conn.volumes() {
        [one] => one.name(),
        _ => "-",
    };
    info!(%peer, volume, tls, "{name} connection open: {}", conn.describe());

    let activity = conn.activity();
    let (dispatcher, writer) =
        Dispatcher::new(env.clone(), conn.limits(), peer.clone(), wr, conn.encoder(), activity.clone());
    let writer = tokio::spawn(writer.run());
    let mut conn = conn;
    let open = Open::new(&env.stats);
    // Lent, not given: the socket stays open until the writer is done (below).
    // Its socket, read directly between the runtime's wake-ups (`Eager`):
    // plaintext only (a TLS stream's bytes must go through TLS).
    let fd = socket.filter(|_| !tls);
    let end = transmission(&dispatcher, &mut conn, &mut rd, fd, buf, &env, &activity).await;
    if let (End::Protocol(_), Some(last)) = (&end, conn.farewell()) {
        dispatcher.send_last(&last).await;
    }
    drop(open);
    // Whatever ended it, nothing more is dispatched from this connection
    // (what it started may still run: a session's fence waits for that).
    // Dropping the dispatcher drops its reply sender: the writer finishes the
    // replies still in flight, then stops.
    activity.stop();
    drop(dispatcher);
    let written = writer.await.unwrap_or_else(|e| Err(io::Error::other(e)));
    if matches!(end, End::Silent) {
        // (A stalled reply stream is counted where it stalled, by its sink.)
        Stats::add(&env.stats.stalled, 1);
    }
    if activity.is_abandoned() {
        // Its replies could not be written (the peer stopped reading them):
        // closed with a reset, not a FIN queued behind megabytes the peer
        // will never take, so that the peer learns now and the kernel keeps
        // nothing of it.
        if let Some(fd) = socket {
            reset(fd);
        }
    }
    drop(rd);
    match (end, written) {
        (End::Protocol(e), _) => {
            warn!(%peer, "malformed {name} request; closing this connection: {e}");
            Stats::add(&env.stats.protocol_errors, 1);
        }
        (End::Truncated, _) => {
            warn!(%peer, "{name} connection closed in the middle of a request");
            Stats::add(&env.stats.protocol_errors, 1);
        }
        (End::Silent, _) => warn!(
            %peer,
            "{name} client sent nothing for {:?} in the middle of a request's data; closing this connection (its budget goes back)",
            env.stall_timeout
        ),
        (End::Io(e), _) | (_, Err(e)) => info!(%peer, "{name} connection lost: {e}"),
        (End::Stopped, Ok(())) => {
            info!(%peer, "{name} connection stopped (its BRP session was taken over by a reconnect, its NVMe controller was shut down or torn down, or its replies could not be written); requests still buffered, if any, were dropped")
        }
        (End::Eof, Ok(())) => info!(%peer, "{name} connection closed by peer"),
        (End::Disconnect, Ok(())) => info!(%peer, "{name} client disconnected"),
        (End::Shutdown, Ok(())) => info!(%peer, "{name} connection drained for shutdown"),
    }
    drop(conn);
}

/// A connection counted in [`Stats::open_connections`] while it lives (a
/// guard: whatever ends it, the count comes down).
struct Open<'a>(&'a Stats);

impl<'a> Open<'a> {
    fn new(stats: &'a Stats) -> Self {
        Stats::add(&stats.open_connections, 1);
        Open(stats)
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Tells a client refused at the door that the target is busy, if the
/// protocol can say so, and closes.
pub async fn refuse_busy<F: Frontend, S: Transport>(frontend: &F, stream: S, peer: &str, why: &str) {
    warn!(%peer, "{} connection refused: {why}", F::NAME);
    if let Some(msg) = frontend.busy() {
        let (_, mut wr) = stream.split();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), wr.write_all(&msg)).await;
    }
}

/// Feeds the handshake state machine (`out`: what it has to say already)
/// until it settles: `Ok` with the
/// connection and its last reply, still to send (after the fence), or
/// `Err(replay)` when it asks for TLS ([`Step::StartTls`]).
#[allow(clippy::type_complexity)]
async fn handshake<H: Handshake<Conn = C>, C: Transmission, S: AsyncRead + AsyncWrite + Unpin>(
    hs: &mut H,
    stream: &mut S,
    buf: &mut BytesMut,
    mut out: Vec<u8>,
    stats: &Stats,
) -> Result<Result<(C, Vec<u8>), bool>, HandshakeEnd> {
    loop {
        let step = hs.advance(buf, &mut out);
        if let Ok(Step::AuthFailed(_)) = step {
            // Counted before the refusal is sent: whoever reads the counter
            // after seeing the refusal sees this failure in it.
            Stats::add(&stats.auth_failures, 1);
        }
        let wrote = !out.is_empty();
        if wrote && !matches!(step, Ok(Step::Done(_))) {
            stream.write_all(&out).await.map_err(HandshakeEnd::Io)?;
            stream.flush().await.map_err(HandshakeEnd::Io)?;
            out.clear();
        }
        match step.map_err(HandshakeEnd::Protocol)? {
            Step::Continue => {}
            Step::Done(conn) => return Ok(Ok((conn, out))),
            Step::Abort => return Err(HandshakeEnd::Abort),
            Step::Refused(why) => return Err(HandshakeEnd::Refused(why)),
            Step::AuthFailed(why) => return Err(HandshakeEnd::AuthFailed(why)),
            Step::StartTls { replay } => return Ok(Err(replay)),
        }
        if wrote {
            // It may have stopped at its output cap with messages still buffered.
            continue;
        }
        buf.reserve(4096);
        match stream.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Err(HandshakeEnd::Closed),
            Ok(0) => return Err(HandshakeEnd::Truncated),
            Ok(_) => {}
            Err(e) => return Err(HandshakeEnd::Io(e)),
        }
    }
}

/// Makes closing the socket `fd` (open: its connection's read half is held
/// by the caller) send a reset, dropping whatever it still had to send.
fn reset(fd: std::os::fd::RawFd) {
    // SAFETY: `fd` is the connection's socket, open for as long as this call.
    let socket = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    if let Err(e) = socket2::SockRef::from(&socket).set_linger(Some(Duration::ZERO)) {
        debug!(error = %e, "SO_LINGER");
    }
}

/// Decode: one read, every complete request in it, until the peer leaves.
async fn transmission<C: Transmission, R: AsyncRead + Unpin, W: AsyncWrite + Unpin + Send + 'static>(
    d: &Dispatcher<W, C::Encoder>,
    conn: &mut C,
    mut rd: R,
    fd: Option<std::os::fd::RawFd>,
    mut buf: BytesMut,
    env: &ConnEnv,
    activity: &Activity,
) -> End {
    // Registered once for the connection, not at every read.
    let stopped = activity.stopped();
    let shutdown = env.shutdown.cancelled();
    tokio::pin!(stopped, shutdown);
    let volumes = conn.volumes().to_vec();
    let mut poll = BusyPoll::new(env.poll_window);
    let mut coalesce = Coalesce::new(env.coalesce_window);
    let mut timer: Option<Timer> = None;
    // What a read made while lingering brought instead of requests (the end,
    // an error): seen after the held replies have gone.
    let mut ended: Option<io::Result<usize>> = None;
    let mut plan = ReadPlan::new(READ_CHUNK, READ_GROWTH);
    let mut eager = Eager::new(fd);
    // (Counting from what the handshake's last read left in the buffer.)
    let mut arrival = Arrival { paid: None, received: buf.len() as u64, until: 0 };
    loop {
        // (Replies made here, `locals`, are never held: see below.)
        let (mut requests, mut locals) = (0u32, 0u32);
        let need = loop {
            let r = match conn.decode(&mut buf) {
                Ok(Decoded::Request { volume, tag, meta, req }) => match volumes.get(volume as usize) {
                    Some(v) => {
                        requests += 1;
                        let paid = &mut arrival.paid;
                        let r = match d.dispatch_now(v, tag, meta, req, paid) {
                            Ok(r) => r,
                            Err((meta, req)) => d.dispatch(v, tag, meta, req, paid).await,
                        };
                        match r {
                            // Another frame came in the same read: this one's replies go first.
                            Ok(()) if conn.frame_ended() && !buf.is_empty() => d.flush().await,
                            r => r,
                        }
                    }
                    None => {
                        return End::Protocol(
                            format!("a request on volume {volume} of {}", volumes.len()).into(),
                        )
                    }
                },
                Ok(Decoded::Local { tag, meta, result }) => {
                    d.reply_local(tag, meta, result);
                    // An answer the client needs before it can go on (an
                    // NVMe/TCP R2T for a write's data): never held. Answers
                    // made here hold no credit: past a few, they are sent
                    // before the next is decoded, so that a client that
                    // sends thousands in one read (Identify: 4 KiB of reply
                    // per 72-byte command) and reads none waits on its own
                    // socket instead of filling the target's memory.
                    locals += 1;
                    if locals.is_multiple_of(LOCAL_REPLIES_HELD) {
                        d.flush().await
                    } else {
                        Ok(())
                    }
                }
                Ok(Decoded::Incomplete { need }) => {
                    // Every request this read brought is dispatched: their
                    // device I/Os start together (before any linger below).
                    d.kick();
                    break need;
                }
                Ok(Decoded::Disconnect) => return End::Disconnect,
                Err(e) => return End::Protocol(e),
            };
            if let Err(e) = r {
                return if activity.is_stopped() { End::Stopped } else { End::Io(e) };
            }
        };
        // A large frame's payload is counted against the byte budgets before
        // it is read, not once it is all there (its requests' credits take
        // the budget over): when they are spent, the target stops reading
        // and the client's bytes wait in its socket.
        if arrival.settle(&buf, need) {
            if let Some((a, v)) = conn.arriving(&buf).and_then(|a| Some((a, volumes.get(a.volume as usize)?)))
            {
                let paid = tokio::select! {
                    p = d.prepay(v, a.range, need as u64) => match p {
                        Ok(p) => p,
                        Err(e) => return if activity.is_stopped() { End::Stopped } else { End::Io(e) },
                    },
                    _ = &mut shutdown => return End::Shutdown,
                    _ = &mut stopped => return End::Stopped,
                };
                if let Some(paid) = paid {
                    arrival.paid(paid, &buf, need);
                }
            }
        }
        // A client sending one request at a time, and still sending: its
        // replies wait a round for the next few (crate::coalesce). Only
        // replies of requests run inline wait; the others leave as they finish.
        let mut last = requests;
        if locals == 0 && d.holds_replies() && coalesce.linger(requests) {
            Stats::add(&env.stats.coalesce_rounds, 1);
            if timer.is_none() {
                timer =
                    Timer::new().map_err(|e| debug!(error = %e, "no timer: replies are not coalesced")).ok();
            }
            let waited = match &timer {
                Some(t) => tokio::select! {
                    r = t.sleep(coalesce.window()) => r.is_ok(),
                    _ = &mut shutdown => return End::Shutdown,
                    _ = &mut stopped => return End::Stopped,
                },
                None => false,
            };
            if !waited {
                coalesce = Coalesce::new(Duration::ZERO);
            }
            let (room, most) = plan.next(buf.len(), need);
            buf.reserve(room);
            match eager.read_now(&mut rd, &mut (&mut buf).limit(most)) {
                // More requests (or part of one): decode them, the replies still held.
                Some(Ok(n)) if n > 0 => {
                    arrival.read(n);
                    continue;
                }
                Some(r) => ended = Some(r),
                None => {}
            }
            coalesce.nothing_came();
            // (This read's requests are held already.)
            last = 0;
            if coalesce.backed_off_long() {
                // A client that waits for its replies: no descriptor kept for it.
                timer = None;
            }
        }
        let (requests, held) = coalesce.release(last);
        if held {
            Stats::add(&env.stats.coalesced, requests as u64);
        }
        // Everything this read brought is dispatched: its replies leave together.
        if let Err(e) = d.flush().await {
            return End::Io(e);
        }
        if activity.is_stopped() {
            return End::Stopped;
        }
        if env.shutdown.is_cancelled() {
            return End::Shutdown;
        }
        let (room, most) = plan.next(buf.len(), need);
        buf.reserve(room);
        let paying = arrival.paying(&buf);
        let mut into = (&mut buf).limit(most);
        // What the peer sent meanwhile, without waiting; else spin for it a
        // while if the connection goes request by request (BusyPoll), else
        // sleep until it comes.
        let mut got = ended.take().or_else(|| eager.read_now(&mut rd, &mut into));
        let wait = poll.served(requests, got.is_none());
        if wait.spin {
            let until = Instant::now() + poll.window;
            while got.is_none() && Instant::now() < until && !activity.is_stopped() {
                // Lets the runtime look at its sockets (and run other tasks) in between.
                tokio::task::yield_now().await;
                got = rd.read_buf(&mut into).now_or_never();
            }
            if got.is_some() {
                Stats::add(&env.stats.polled, 1);
            }
        }
        let n = match got {
            Some(r) => r,
            None => tokio::select! {
                r = rd.read_buf(&mut into) => r,
                _ = &mut shutdown => return End::Shutdown,
                _ = &mut stopped => return End::Stopped,
                // A frame whose budget is held must go on arriving: a client
                // silent in the middle of one holds it no longer than one
                // that stops reading its replies holds theirs.
                _ = silent(paying, env.stall_timeout) => return End::Silent,
            },
        };
        poll.arrived(wait);
        match n {
            Ok(0) if conn.mid_frame(&buf) => return End::Truncated,
            Ok(0) => return End::Eof,
            Ok(n) => arrival.read(n),
            Err(e) => return End::Io(e),
        }
    }
}

/// The budget of the large frame at the front of the stream while its
/// payload arrives ([`Dispatcher::prepay`]), kept until the frame is decoded
/// (the credits of its writes take what they need of it). Known by where
/// the frame ends in the stream, so that it is let go however the front end
/// consumed the frame (an NVMe/TCP H2CData PDU that is not a write's last is
/// taken without a request to show for it).
struct Arrival {
    paid: Option<Prepaid>,
    /// Bytes read off the socket so far.
    received: u64,
    /// Where (in them) the frame whose budget is held ends.
    until: u64,
}

impl Arrival {
    fn read(&mut self, n: usize) {
        self.received += n as u64;
    }

    /// Whether the frame at the front of `buf` has its budget held.
    fn paying(&self, buf: &BytesMut) -> bool {
        self.received - (buf.len() as u64) < self.until
    }

    /// At an incomplete frame needing `need` bytes: what is left of the
    /// budget of one decoded since goes back; whether this one's is to be
    /// taken (a large frame, most of it still to come).
    fn settle(&mut self, buf: &BytesMut, need: usize) -> bool {
        if self.paying(buf) {
            return false;
        }
        self.paid = None;
        need >= LARGE_FRAME && need > buf.len()
    }

    /// `paid` holds the budget of the frame at the front of `buf`, `need` bytes long.
    fn paid(&mut self, paid: Prepaid, buf: &BytesMut, need: usize) {
        self.until = self.received - buf.len() as u64 + need as u64;
        self.paid = Some(paid);
    }
}

/// Ends after `timeout` when `paying` (a frame whose budget is held waits
/// for the rest of its payload); else never.
async fn silent(paying: bool, timeout: Duration) {
    match paying {
        true => tokio::time::sleep(timeout).await,
        false => std::future::pending().await,
    }
}

/// Reads what a connection's socket holds now, asking the socket itself
/// when the runtime does not know of any.
///
/// The runtime learns that a socket has data only from `epoll_wait`, which
/// it calls once it has nothing else to run. So after a reader's replies
/// leave, a `read_buf` that finds no readiness recorded returns at once, the
/// reader's task sleeps, the worker calls `epoll_wait`, finds the socket
/// ready (the client sent more while the replies were being made) and wakes
/// the task again: a system call and a trip through the scheduler to learn
/// what one `recv` tells. Under fio at QD32 on one connection, most of the
/// target's `epoll_wait`s returned at once with that socket's event (`perf
/// record -e syscalls:sys_enter_epoll_wait,...`: of 22 K calls a second,
/// 6.6 K slept). `Eager` tries the `recv` first (`MSG_DONTWAIT`), and after
/// one that found nothing, tries again only after a few reads more (doubling
/// up to [`Eager::MOST_SKIPPED`]): a connection whose client waits for its
/// replies (QD1, a paced client) finds nothing there each time, and pays a
/// wasted `recv` on a sixteenth of its requests at most.
///
/// It bypasses the runtime's record of readiness, which stays correct:
/// what it records is only ever a hint that a read confirms (a read that
/// finds nothing clears it), and the socket's next event still comes.
struct Eager {
    fd: Option<std::os::fd::RawFd>,
    /// Reads to let go by before trying the socket again.
    skip: u32,
    /// `skip` after the next miss.
    backoff: u32,
}

impl Eager {
    const MOST_SKIPPED: u32 = 16;

    fn new(fd: Option<std::os::fd::RawFd>) -> Eager {
        Eager { fd, skip: 0, backoff: 1 }
    }

    /// What the socket holds now, into `into`; `None`: nothing yet.
    fn read_now<R: AsyncRead + Unpin, B: BufMut>(
        &mut self,
        rd: &mut R,
        into: &mut B,
    ) -> Option<io::Result<usize>> {
        if let Some(r) = rd.read_buf(into).now_or_never() {
            return Some(r);
        }
        let fd = self.fd?;
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        // A read the runtime does not see still spends the task's budget,
        // as the runtime's reads do: a reader whose socket always has more
        // must still give way (to its connection's writer task, to the
        // worker's other connections and to its sockets and timers) at least
        // every 128 reads (a helper's review). Out of budget: nothing now,
        // and the reader's next wait yields.
        tokio::task::coop::consume_budget().now_or_never()?;
        let r = recv_now(fd, into);
        match r {
            Some(_) => self.backoff = 1,
            None => {
                self.skip = self.backoff;
                self.backoff = (self.backoff * 2).min(Self::MOST_SKIPPED);
            }
        }
        r
    }
}

/// One `recv` of what socket `fd` holds, without waiting; `None`: nothing.
fn recv_now<B: BufMut>(fd: std::os::fd::RawFd, into: &mut B) -> Option<io::Result<usize>> {
    let chunk = into.chunk_mut();
    if chunk.len() == 0 {
        // (A `recv` of nothing would read as the end of the stream.)
        return None;
    }
    // SAFETY: `fd` is the connection's socket, open while its read half
    // lives (the caller holds it); the kernel writes at most `chunk.len()`
    // bytes at `chunk`'s start, memory `into` owns.
    let n = unsafe { libc::recv(fd, chunk.as_mut_ptr().cast(), chunk.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => None,
            _ => Some(Err(e)),
        };
    }
    // SAFETY: the kernel initialised the first `n` bytes of the chunk.
    unsafe { into.advance_mut(n as usize) };
    Some(Ok(n as usize))
}

/// Busy polling for a connection that goes request by request.
///
/// A client at queue depth 1 sends its next request only after it has read
/// the reply to the last, so between two requests the connection has nothing
/// to do; sleeping there costs a wake-up (the runtime parks its thread, the
/// next request's arrival wakes it: tens of microseconds on a virtual
/// machine) on every request. Spinning for the next request instead halves
/// the latency at QD1 (docs/benchmarks.md, "Busy polling at QD1").
///
/// Spinning is not free: it holds a core. Under load it takes that core from
/// whatever else runs (on a small machine, the client), so it pays only when
/// both sides would otherwise wait for each other. The rule: spin (for at
/// most `window`) only after [`STREAK`] reads in a row each brought exactly
/// one request, after a wait of at least [`MIN_GAP`] and at most half the
/// window. A loaded connection breaks the streak at once: a read brings
/// several requests, or the next request is there already, or it comes
/// sooner than [`MIN_GAP`] (the client is busy, not waiting). So does a
/// longer wait: an idle connection, or a client that paces its requests
/// (`fio --rate_iops`) rather than waiting for its replies. Spinning through
/// a paced client's gaps would cost the whole gap on every request: with the
/// whole window as the limit (until 2026-11-26), 4K reads at QD8 paced to
/// 20 K IOPS took 36.5 us of server CPU per I/O against 12.8 us without
/// polling (docs/benchmarks.md, "Busy polling at QD1").
pub struct BusyPoll {
    window: Duration,
    /// Reads in a row that fit the rule.
    streak: u32,
}

/// Reads in a row that must look like a client at queue depth 1.
pub const STREAK: u32 = 8;
/// The shortest wait for a request that counts as the client waiting for its
/// reply (shorter: the client is busy, with more requests in flight).
pub const MIN_GAP: Duration = Duration::from_micros(12);

/// What [`BusyPoll::served`] decided about the coming wait.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    /// Spin for the next request (up to the window).
    pub spin: bool,
    /// When the wait began; `None`: the data was there already.
    since: Option<Instant>,
}

impl BusyPoll {
    pub fn new(window: Duration) -> BusyPoll {
        BusyPoll { window, streak: 0 }
    }

    /// The last read brought `requests`; the next request is not here yet
    /// (`waiting`) or is. Whether to spin for it.
    pub fn served(&mut self, requests: u32, waiting: bool) -> Wait {
        if requests != 1 || !waiting {
            self.streak = 0;
        }
        let polling = waiting && !self.window.is_zero();
        // The clock is read only where the wait's length can matter.
        Wait { spin: polling && self.streak >= STREAK, since: polling.then(Instant::now) }
    }

    /// The wait begun at [`BusyPoll::served`] ended: data arrived.
    pub fn arrived(&mut self, w: Wait) {
        self.arrived_after(w.since.map(|t| t.elapsed()));
    }

    /// [`BusyPoll::arrived`], after `waited` (`None`: no wait at all).
    fn arrived_after(&mut self, waited: Option<Duration>) {
        match waited {
            Some(gap) if gap >= MIN_GAP && gap <= self.window / 2 => {
                self.streak = self.streak.saturating_add(1)
            }
            _ => self.streak = 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, MemoryBackend};
    use crate::catalog::Catalog;
    use crate::frontend::nbd::Nbd;
    use fastsan_nbd::consts::*;
    use tokio_util::sync::CancellationToken;

    /// One exchange as `BusyPoll` sees it: a read brought `requests`, the next
    /// was (not) there yet, and came after `gap`. Whether it spun for it.
    fn exchange(p: &mut BusyPoll, requests: u32, gap: Option<Duration>) -> bool {
        let w = p.served(requests, gap.is_some());
        p.arrived_after(gap);
        w.spin
    }

    #[test]
    fn busy_polling_starts_after_a_streak_at_queue_depth_1_and_stops_under_load_or_idle() {
        let us = Duration::from_micros;
        let mut p = BusyPoll::new(us(50));
        // A client at QD1: one request per read, each after a wait of ~25 us.
        let spins: Vec<bool> = (0..STREAK + 2).map(|_| exchange(&mut p, 1, Some(us(25)))).collect();
        assert!(spins[..=STREAK as usize - 1].iter().all(|s| !s), "{spins:?}");
        assert!(spins[STREAK as usize..].iter().all(|s| *s), "{spins:?}");
        // Each of these breaks the streak, and the next exchange does not spin.
        let breakers: [(&str, u32, Option<Duration>); 6] = [
            ("two requests in a read", 2, Some(us(25))),
            ("the next request there already", 1, None),
            ("a wait shorter than MIN_GAP", 1, Some(us(3))),
            ("a wait longer than the window (idle)", 1, Some(us(400))),
            ("a wait past half the window (a paced client)", 1, Some(us(30))),
            ("no request in a read", 0, Some(us(25))),
        ];
        for (why, requests, gap) in breakers {
            for _ in 0..STREAK {
                exchange(&mut p, 1, Some(us(25)));
            }
            assert!(exchange(&mut p, 1, Some(us(25))), "streak rebuilt before: {why}");
            exchange(&mut p, requests, gap);
            assert!(!exchange(&mut p, 1, Some(us(25))), "spun right after {why}");
        }
        // A zero window never spins.
        let mut off = BusyPoll::new(Duration::ZERO);
        assert!((0..3 * STREAK).all(|_| !exchange(&mut off, 1, Some(us(25)))));
    }

    /// A loopback connection: its client's end (blocking, std), the
    /// accepted end's halves and an `Eager` on its socket.
    async fn eager_socket(
    ) -> (std::net::TcpStream, tokio::net::tcp::OwnedReadHalf, tokio::net::tcp::OwnedWriteHalf, Eager) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let eager = Eager::new(server.socket());
        let (rd, wr) = server.into_split();
        (client, rd, wr, eager)
    }

    /// `Eager` reads what a real socket holds without the runtime's help,
    /// backs off after finding nothing, and reports the peer's close as the
    /// end of the stream. The runtime takes a stream it accepted for ready:
    /// the first read, through the runtime, finds nothing and clears that;
    /// nothing here awaits after the accept, so the runtime never polls its
    /// sockets again and every byte read after it is read by `Eager`.
    #[tokio::test]
    async fn an_eager_read_takes_what_the_socket_holds_and_backs_off_when_it_holds_nothing() {
        use std::io::Write;
        let (mut client, mut rd, _wr, mut eager) = eager_socket().await;
        let mut buf = BytesMut::with_capacity(4096);
        let arrive = || std::thread::sleep(Duration::from_millis(30));
        // Nothing sent: nothing read, and the next read lets the socket be.
        assert!(eager.read_now(&mut rd, &mut buf).is_none());
        client.write_all(b"first").unwrap();
        arrive();
        assert!(eager.read_now(&mut rd, &mut buf).is_none(), "skipped once after a miss");
        assert_eq!(eager.read_now(&mut rd, &mut buf).unwrap().unwrap(), 5);
        assert_eq!(&buf[..], b"first");
        // A limit is kept: at most 3 bytes, the rest stays in the socket.
        client.write_all(b"second").unwrap();
        arrive();
        assert_eq!(eager.read_now(&mut rd, &mut (&mut buf).limit(3)).unwrap().unwrap(), 3);
        assert_eq!(eager.read_now(&mut rd, &mut buf).unwrap().unwrap(), 3);
        assert_eq!(&buf[..], b"firstsecond");
        // Misses in a row skip more and more reads, up to MOST_SKIPPED.
        let mut skipped = Vec::new();
        for _ in 0..6 {
            assert!(eager.read_now(&mut rd, &mut buf).is_none());
            skipped.push(eager.skip);
            for _ in 0..eager.skip {
                assert!(eager.read_now(&mut rd, &mut buf).is_none());
            }
        }
        assert_eq!(skipped, [1, 2, 4, 8, 16, 16]);
        // The peer's close: the end of the stream, a read of 0 bytes.
        drop(client);
        arrive();
        assert_eq!(eager.read_now(&mut rd, &mut buf).unwrap().unwrap(), 0);
        assert_eq!(&buf[..], b"firstsecond");
    }

    /// A reader whose socket always has more spends the task's budget on
    /// `Eager`'s reads as on the runtime's, so it gives way to the worker
    /// (and its connection's writer task) at least every 128 reads; what it
    /// reads after the yield continues where it stopped.
    #[tokio::test]
    async fn eager_reads_spend_the_tasks_budget() {
        use std::io::Write;
        let (mut client, mut rd, _wr, mut eager) = eager_socket().await;
        let mut buf = BytesMut::with_capacity(4096);
        // Clears the readiness the runtime assumed at the accept: from here
        // on, what this task reads without awaiting, `Eager` reads.
        assert!(eager.read_now(&mut rd, &mut buf).is_none());
        let sent: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        // One byte at a time: until the first read (after the miss's skip),
        // then as long as the budget lasts.
        let mut first = 0;
        while eager.read_now(&mut rd, &mut (&mut buf).limit(1)).is_none() {
            first += 1;
            assert!(first < 3, "the socket holds 1000 bytes");
        }
        let mut run = 1;
        while let Some(r) = eager.read_now(&mut rd, &mut (&mut buf).limit(1)) {
            assert_eq!(r.unwrap(), 1);
            run += 1;
            assert!(run <= 128, "read on past the task's budget");
        }
        assert!(run > 16, "stopped after {run} reads, not at the budget");
        // After a yield, the rest, in order.
        while buf.len() < sent.len() {
            tokio::task::yield_now().await;
            while let Some(r) = eager.read_now(&mut rd, &mut buf) {
                assert!(r.unwrap() > 0);
            }
        }
        assert_eq!(&buf[..], &sent[..]);
    }

    /// The whole NBD path, handshake to disconnect, over an in-memory stream.
    #[tokio::test]
    async fn serves_a_connection_over_an_in_memory_stream() {
        let mut catalog = Catalog::default();
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
        catalog.add(crate::volume::Volume::with_backend("v".into(), b, 1 << 16));
        let env = Arc::new(ConnEnv {
            stats: Arc::new(Stats::default()),
            shutdown: CancellationToken::new(),
            queue_depth: 8,
            serial: false,
            handshake_timeout: std::time::Duration::from_secs(5),
            poll_window: crate::config::DEFAULT_POLL_WINDOW,
            coalesce_window: crate::config::DEFAULT_COALESCE_WINDOW,
            stall_timeout: std::time::Duration::from_secs(5),
            slots: Arc::new(tokio::sync::Semaphore::new(4)),
            budget: crate::pipeline::Budget::new(64 << 20),
            access: Default::default(),
        });
        let (client, server) = tokio::io::duplex(1 << 16);
        let nbd = Arc::new(Nbd { catalog: Arc::new(catalog), access: env.access.clone() });
        let gate = Arc::new(crate::gate::Gate::new(4, 1, std::time::Duration::from_secs(1)));
        let ticket = gate.enter(None).unwrap();
        let who = Who { local: true, ..Default::default() };
        let task = tokio::spawn(serve_connection(nbd, server, "memory".into(), who, env.clone(), ticket));
        let (mut rd, mut wr) = tokio::io::split(client);
        let mut greeting = [0u8; 18];
        rd.read_exact(&mut greeting).await.unwrap();
        let mut out = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
        fastsan_nbd::handshake::encode_option(OPT_EXPORT_NAME, b"v", &mut out);
        let w = fastsan_nbd::transmission::Request {
            flags: 0,
            command: CMD_WRITE,
            cookie: 1,
            offset: 512,
            length: 4,
        };
        out.extend(w.encode());
        out.extend(b"abcd");
        let r = fastsan_nbd::transmission::Request {
            flags: 0,
            command: CMD_READ,
            cookie: 2,
            offset: 510,
            length: 8,
        };
        out.extend(r.encode());
        let d = fastsan_nbd::transmission::Request {
            flags: 0,
            command: CMD_DISC,
            cookie: 3,
            offset: 0,
            length: 0,
        };
        out.extend(d.encode());
        wr.write_all(&out).await.unwrap();
        let mut back = Vec::new();
        rd.read_to_end(&mut back).await.unwrap();
        // Export reply (10 bytes), the write's simple reply, the read's with its data.
        assert_eq!(back.len(), 10 + 16 + 16 + 8);
        assert_eq!(&back[10 + 32..], b"\0\0abcd\0\0");
        task.await.unwrap();
        assert_eq!(env.stats.snapshot().requests, 2);
    }
}
