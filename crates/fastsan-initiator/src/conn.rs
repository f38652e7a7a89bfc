//! One connection of a session: a sender task and a receiver task.
//!
//! The sender implements temporal merge. It waits for a request; when one
//! comes it takes it and, in adaptive mode, every other small request already
//! queued behind it, and sends them in one write: alone as a plain frame, or
//! together as one BATCH. While that write is in flight new requests queue,
//! so the heavier the load the bigger the batches, and at low load a request
//! leaves at once. The receiver matches replies to requests by tag.

use crate::handshake::Handshake;
use crate::options::MergeMode;
use crate::overdue::{is_overdue, overdue, Clock, Ticker};
use crate::read_plan::ReadPlan;
use crate::recycle::{Recycler, LARGE_REPLY};
use crate::stats::Stats;
use crate::transport::Stream;
use crate::Error;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use fastsan_brp::batch::BatchBuilder;
use fastsan_brp::digest::{self, DIGEST_LEN};
use fastsan_brp::reply::{parse_reply, parse_reply_head, ReplyHeader};
use fastsan_brp::request::{encode_header, RequestHeader};
use fastsan_brp::Command;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

pub(crate) type Done = oneshot::Sender<Result<Option<Bytes>, Error>>;

/// A request on its way to the sender.
pub(crate) struct Submit {
    pub header: RequestHeader,
    pub payload: Bytes,
    pub pending: Pending,
}

/// What waits for a reply: the caller's channel and the credit it holds.
pub(crate) struct Pending {
    pub done: Done,
    pub _credit: OwnedSemaphorePermit,
}

/// The requests sent and not yet answered. Once closed, nothing more is
/// registered: a late request fails at once instead of waiting forever.
///
/// Each request notes the connection's [`Clock`] when it was sent; the
/// receiver gives up on one that waits past its timeout ([`crate::overdue`]).
#[derive(Default)]
struct Inflight {
    /// Closed, and each tag's request with the tick it was sent at.
    state: Mutex<(bool, HashMap<u64, Sent>)>,
    clock: Clock,
}

type Sent = (Pending, u32);

impl Inflight {
    fn register(&self, tag: u64, p: Pending) {
        let mut st = self.state.lock();
        if st.0 {
            let _ = p.done.send(Err(Error::ConnectionLost));
        } else {
            st.1.insert(tag, (p, self.clock.now()));
        }
    }
    fn take(&self, tag: u64) -> Option<Pending> {
        self.state.lock().1.remove(&tag).map(|(p, _)| p)
    }
    fn contains(&self, tag: u64) -> bool {
        self.state.lock().1.contains_key(&tag)
    }
    fn fail_all(&self) {
        let drained: Vec<Pending> = {
            let mut st = self.state.lock();
            st.0 = true;
            st.1.drain().map(|(_, (p, _))| p).collect()
        };
        for p in drained {
            let _ = p.done.send(Err(Error::ConnectionLost));
        }
    }
    /// Whether a request has waited its whole timeout at tick `now`.
    fn any_overdue(&self, now: u32) -> bool {
        self.state.lock().1.values().any(|(_, sent)| overdue(now, *sent))
    }
}

pub(crate) struct Limits {
    pub mode: MergeMode,
    pub max_batch: usize,
    pub merge_max_request: u32,
    /// Credits granted by the target, to tell how loaded the connection is.
    pub queue_depth: u32,
    pub merge_max_bytes: u32,
    /// The session's only connection: a frame takes at most half the window,
    /// so that two are in flight (see `send_loop`).
    pub alone: bool,
}

pub(crate) struct Conn {
    tx: mpsc::UnboundedSender<Submit>,
    pub credits: Arc<Semaphore>,
    dead: CancellationToken,
    /// Which connection of the session this is, and how many times that
    /// slot was re-established before it.
    pub slot: usize,
    pub epoch: u64,
    /// The target it was opened on: (instance, host boot).
    pub target: (u64, u64),
    /// Why it was lost, once it was (set before its requests fail).
    cause: Arc<OnceLock<String>>,
}

/// Where a connection sits in its session, its request timeout, and the
/// target it was opened on.
pub(crate) struct Place {
    pub slot: usize,
    pub epoch: u64,
    pub request_timeout: std::time::Duration,
    pub target: (u64, u64),
}

/// What an opened connection's loops run on: the socket's owned halves,
/// the bytes the handshake read past OPEN_REPLY, and whether digests are on.
struct Io<R, W> {
    rd: R,
    wr: W,
    leftover: BytesMut,
    digests: bool,
}

impl Conn {
    /// Starts the sender and receiver of an opened connection. `on_dead` runs
    /// once, when the connection fails (not when it is dropped).
    pub fn start(
        hs: Handshake,
        place: Place,
        limits: Limits,
        stats: Arc<Stats>,
        on_dead: Box<dyn FnOnce() + Send>,
    ) -> Conn {
        let (stream, leftover, digests) = hs.into_parts();
        // One copy of the loops per kind of socket: no dispatch per read or write.
        match stream {
            Stream::Tcp(s) => {
                let (rd, wr) = s.into_split();
                Conn::start_on(Io { rd, wr, leftover, digests }, place, limits, stats, on_dead)
            }
            Stream::Unix(s) => {
                let (rd, wr) = s.into_split();
                Conn::start_on(Io { rd, wr, leftover, digests }, place, limits, stats, on_dead)
            }
            Stream::Tls(s) => {
                let (rd, wr) = tokio::io::split(*s);
                Conn::start_on(Io { rd, wr, leftover, digests }, place, limits, stats, on_dead)
            }
        }
    }

    fn start_on<R, W>(
        io: Io<R, W>,
        place: Place,
        limits: Limits,
        stats: Arc<Stats>,
        on_dead: Box<dyn FnOnce() + Send>,
    ) -> Conn
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let Io { rd, wr, leftover, digests } = io;
        let (tx, rx) = mpsc::unbounded_channel();
        let credits = Arc::new(Semaphore::new(limits.queue_depth.max(1) as usize));
        let dead = CancellationToken::new();
        let inflight = Arc::new(Inflight::default());
        let on_dead = Arc::new(Mutex::new(Some(on_dead)));
        let cause = Arc::new(OnceLock::new());
        let die = {
            let (dead, inflight, credits, cause) =
                (dead.clone(), inflight.clone(), credits.clone(), cause.clone());
            let timeout = place.request_timeout;
            move |e: Option<Error>| {
                // Before the requests fail: a request that gives up says why.
                if let Some(e) = &e {
                    let _ = cause.set(why_lost(e, timeout));
                }
                dead.cancel();
                credits.close();
                inflight.fail_all();
                if let Some(e) = e {
                    // A timeout was reported where it was found, with the timeout: once.
                    if !matches!(e, Error::Timeout(_)) {
                        tracing::warn!(error = &e as &dyn std::error::Error, "connection to the target lost");
                    }
                    if let Some(f) = on_dead.lock().take() {
                        f();
                    }
                }
            }
        };
        let sender = {
            let (die, dead, inflight, stats) = (die.clone(), dead.clone(), inflight.clone(), stats.clone());
            let credits_s = credits.clone();
            async move {
                let mut rx = rx;
                let r = tokio::select! {
                    biased;
                    _ = dead.cancelled() => Ok(()),
                    r = send_loop(wr, &mut rx, &inflight, &credits_s, digests, limits, &stats) => r,
                };
                die(r.err().map(Error::from));
                fail_queued(rx, &inflight).await;
            }
        };
        let receiver = {
            let (die, dead) = (die.clone(), dead.clone());
            let timeout = place.request_timeout;
            async move {
                let r = tokio::select! {
                    biased;
                    _ = dead.cancelled() => None,
                    r = recv_loop(rd, leftover, &inflight, digests, timeout) => Some(r),
                };
                if matches!(r, Some(Error::Timeout(_))) {
                    stats.timeouts.fetch_add(1, Relaxed);
                }
                die(r);
            }
        };
        tokio::spawn(sender);
        tokio::spawn(receiver);
        Conn { tx, credits, dead, slot: place.slot, epoch: place.epoch, target: place.target, cause }
    }

    /// Whether it still takes requests. Read off the credits, closed right
    /// after `dead` is cancelled (and whenever the connection dies): a load
    /// of the line every request touches anyway, where the token's check
    /// takes a lock (4-5% of `fastsan bench`'s CPU at 128 requesters, in
    /// `best`, with the two client threads bouncing it).
    pub fn is_alive(&self) -> bool {
        !self.credits.is_closed()
    }

    /// Why the connection was lost, if it was (and the cause is known).
    pub fn cause(&self) -> Option<String> {
        self.cause.get().cloned()
    }

    /// Queues a request; gives it back if the connection is gone.
    pub fn submit(&self, s: Submit) -> Result<(), Submit> {
        self.tx.send(s).map_err(|e| e.0)
    }
}

/// What a lost connection's requests say when they give up.
fn why_lost(e: &Error, request_timeout: std::time::Duration) -> String {
    match e {
        Error::Timeout(_) => format!("no reply within the request timeout ({request_timeout:?})"),
        Error::ConnectionLost => "the target closed it".to_string(),
        other => crate::error::chain(other),
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.dead.cancel();
        self.credits.close();
    }
}

/// Requests in flight on a connection from which the adaptive sender lingers
/// to merge: two, so that moderate loads merge too. With 8 (until
/// 2026-11-24) adaptive merged nothing at 4 requesters over 2 connections
/// and trailed merge-off at 16; with 2 it gains 15% at 4 and 8% at 16 and
/// is unchanged from 64 up (`fastsan bench --rw randwrite --bs 4k
/// --iodepth N --merge adaptive`, docs/benchmarks.md). One request in
/// flight (QD1) still leaves at once.
pub(crate) const MERGE_LOAD: usize = 2;

/// A connection whose window was this deep lately (requests with a credit
/// and no reply, as a frame leaves) is loaded even at an instant when
/// a burst of replies has emptied it: the requesters behind the burst come
/// back together, so the adaptive sender lingers for them as long as its
/// last frame carried several. Below this depth, lingering on an empty
/// window costs more than it merges (a convoy). 16 until 2026-11-26: 16
/// requesters over 2 connections (8 deep each) then sent half their frames
/// alone after each burst; at 8 they merge, 233-235 K -> 303-331 K IOPS
/// (4K random writes, docs/benchmarks.md, "Adaptive merge at 16 requesters").
const DEEP_LOAD: usize = 8;

/// How soon after the last frame a request still belongs to the load that
/// sent it: a round trip at depth (the requesters behind a burst of replies
/// come back one round trip after their frame left, ~0.1 ms on loopback at
/// 64 requesters); a request after a longer pause (a lone flush after an
/// idle minute) leaves at once.
const BURST_GAP: std::time::Duration = std::time::Duration::from_millis(1);

/// How the depth of a connection's window went lately: the deepest of the
/// last frames sent (two windows of [`Depth::SPAN`] frames).
#[derive(Default)]
struct Depth {
    now: usize,
    before: usize,
    frames: u32,
}

impl Depth {
    const SPAN: u32 = 64;

    fn saw(&mut self, depth: usize) {
        self.now = self.now.max(depth);
        self.frames += 1;
        if self.frames == Self::SPAN {
            (self.before, self.now, self.frames) = (self.now, 0, 0);
        }
    }

    fn recent(&self) -> usize {
        self.now.max(self.before)
    }
}

/// Whether the adaptive sender lingers to merge, with `in_flight` requests in
/// the window now (the one about to leave included), a window `recent` deep
/// lately ([`Depth::recent`]), and its last frame a group that left less
/// than [`BURST_GAP`] ago (`after_burst`).
///
/// Loaded: [`MERGE_LOAD`] requests in flight on a window that has been deeper
/// than that lately, or right after a burst on a deep window. A connection
/// whose window never goes past two (4 requesters over 2 connections, which
/// the session's least-loaded choice keeps at two each) sends at once: there
/// the requester behind the other request is waiting for its reply, not about
/// to send, and lingering for it cost 6-18% against merge-off (2026-11-26,
/// docs/benchmarks.md, "Two adaptive-merge tweaks").
fn loaded(in_flight: usize, recent: usize, after_burst: bool) -> bool {
    in_flight >= MERGE_LOAD && recent > MERGE_LOAD || after_burst && recent >= DEEP_LOAD
}

/// Requests with a credit taken and no reply yet: the connection's window.
fn window(l: &Limits, credits: &Semaphore) -> usize {
    (l.queue_depth as usize).saturating_sub(credits.available_permits())
}

fn mergeable(s: &Submit, l: &Limits) -> bool {
    s.header.length <= l.merge_max_request || s.header.command == Command::Flush
}

async fn send_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    rx: &mut mpsc::UnboundedReceiver<Submit>,
    inflight: &Inflight,
    credits: &Semaphore,
    digests: bool,
    l: Limits,
    stats: &Stats,
) -> io::Result<()> {
    let mut carry: Option<Submit> = None;
    let mut group: Vec<(RequestHeader, Bytes)> = Vec::new();
    let mut heads: Vec<u8> = Vec::new();
    let (mut last_group, mut depth) = (0usize, Depth::default());
    let mut last_sent = std::time::Instant::now();
    loop {
        let first = match carry.take() {
            Some(s) => s,
            None => match rx.recv().await {
                Some(s) => s,
                // The session is gone: end quietly, the receiver with us.
                None => return Ok(()),
            },
        };
        // Heavy load (the paper's condition for merging): many requests are in
        // flight, so replies keep arriving and their requesters are about to
        // send again. Then the adaptive sender lets them run a scheduler turn
        // or two before it gathers, and the batch holds what they queue
        // meanwhile. At light load it sends at once: no added latency.
        let after_burst = last_sent.elapsed() < BURST_GAP && last_group >= MERGE_LOAD;
        let busy = loaded(window(&l, credits), depth.recent(), after_burst);
        let merge = l.mode != MergeMode::Off && mergeable(&first, &l);
        let mut bytes = first.payload.len();
        push(&mut group, inflight, first);
        if merge {
            // On a session's only connection, a frame of the whole window would
            // leave client and target taking turns (the target runs it while
            // the requesters wait, then they all wake at once): at most half of
            // it, so that one frame runs while the next gathers.
            let cap = match l.alone {
                true => (window(&l, credits) / 2).max(2).min(l.max_batch),
                false => l.max_batch,
            };
            let mut rounds = match l.mode {
                MergeMode::Always => 3,
                MergeMode::Adaptive if busy => 2,
                _ => 0,
            };
            loop {
                while group.len() < cap {
                    let Ok(s) = rx.try_recv() else { break };
                    if !mergeable(&s, &l) || bytes + s.payload.len() > l.merge_max_bytes as usize {
                        carry = Some(s);
                        break;
                    }
                    bytes += s.payload.len();
                    push(&mut group, inflight, s);
                }
                if rounds == 0 || carry.is_some() || group.len() >= cap {
                    break;
                }
                rounds -= 1;
                tokio::task::yield_now().await;
            }
        }
        let as_batch = group.len() > 1 || l.mode == MergeMode::Always && merge;
        heads.clear();
        let mut trailer = [0u8; DIGEST_LEN];
        if as_batch {
            let mut b = BatchBuilder::default();
            for (h, _) in &group {
                b.push(h);
            }
            let (bh, subs) = b.finish();
            encode_header(&bh, digests, &mut heads);
            let sub_at = heads.len();
            heads.extend_from_slice(&subs);
            if digests {
                let parts = std::iter::once(&heads[sub_at..]).chain(group.iter().map(|(_, p)| &p[..]));
                trailer = digest::crc_parts(parts).to_le_bytes();
            }
            stats.batches.fetch_add(1, Relaxed);
            stats.batched_requests.fetch_add(group.len() as u64, Relaxed);
        } else {
            encode_header(&group[0].0, digests, &mut heads);
            if digests && !group[0].1.is_empty() {
                trailer = digest::crc(&group[0].1).to_le_bytes();
            }
        }
        let has_payload = as_batch || !group[0].1.is_empty();
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(group.len() + 2);
        slices.push(IoSlice::new(&heads));
        slices.extend(group.iter().filter(|(_, p)| !p.is_empty()).map(|(_, p)| IoSlice::new(p)));
        if digests && has_payload {
            slices.push(IoSlice::new(&trailer));
        }
        stats.frames.fetch_add(1, Relaxed);
        crate::writer::write_all_vectored(&mut wr, &mut slices).await?;
        drop(slices);
        last_group = group.len();
        // The window as this frame leaves (this frame's requests included).
        depth.saw(window(&l, credits));
        last_sent = std::time::Instant::now();
        group.clear();
    }
}

/// Fails the requests queued on a dead connection and never sent (its
/// `inflight` is closed: [`Inflight::register`] fails each at once), also one
/// whose send was under way as the connection died. Dropping the receiver
/// instead would not do: tokio's channel drains what it holds when the
/// receiver drops, and a send that had taken its place before the close but
/// stores its message after the drain leaves it in the channel until the last
/// sender goes, which the request itself holds (its `Arc<Conn>`): it would
/// wait forever, and its write's place in the order with it. A closed
/// receiver instead waits for such a send to finish.
async fn fail_queued(mut rx: mpsc::UnboundedReceiver<Submit>, inflight: &Inflight) {
    rx.close();
    while let Some(s) = rx.recv().await {
        inflight.register(s.header.tag, s.pending);
    }
}

/// Registers the request as in flight, keeping what the sender must write.
fn push(group: &mut Vec<(RequestHeader, Bytes)>, inflight: &Inflight, s: Submit) {
    inflight.register(s.header.tag, s.pending);
    group.push((s.header, s.payload));
}

/// Reads what the socket has into `into` (at least one byte), advancing the
/// request-timeout clock while it waits.
async fn read_some<R: AsyncRead + Unpin>(
    rd: &mut R,
    into: &mut impl BufMut,
    ticker: &mut Ticker,
    inflight: &Inflight,
    timeout: std::time::Duration,
) -> Result<(), Error> {
    match ticker.read(rd, into, &inflight.clock, |now| inflight.any_overdue(now)).await {
        Err(e) if is_overdue(&e) => {
            tracing::warn!(?timeout, "a request got no reply in time; dropping the connection");
            Err(Error::Timeout("request"))
        }
        Ok(0) => Err(Error::ConnectionLost),
        Ok(_) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Answers the request `h` is the reply to.
fn deliver(inflight: &Inflight, h: &ReplyHeader, payload_ok: bool, data: Bytes) -> Result<(), Error> {
    let Some(p) = inflight.take(h.tag) else {
        return Err(Error::UnknownTag(h.tag));
    };
    let result = if !h.status.is_ok() {
        Err(Error::Status(h.status))
    } else if !payload_ok {
        Err(Error::DigestMismatch)
    } else if !data.is_empty() {
        Ok(Some(data))
    } else {
        Ok(None)
    };
    let _ = p.done.send(result);
    Ok(())
}

/// Matches replies to requests until the connection fails; a request
/// without a reply for `timeout` fails it too (the target is stuck or gone).
async fn recv_loop<R: AsyncRead + Unpin>(
    mut rd: R,
    mut buf: BytesMut,
    inflight: &Inflight,
    digests: bool,
    timeout: std::time::Duration,
) -> Error {
    let mut ticker = Ticker::new(timeout);
    let recycler = Arc::new(Recycler::default());
    let mut plan = ReadPlan::new(256 * 1024, 1 << 20);
    loop {
        loop {
            let f = match parse_reply(&buf, digests) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return e.into(),
            };
            let bytes = buf.split_to(f.frame_len).freeze();
            let n = f.header.payload_len as usize;
            if let Err(e) =
                deliver(inflight, &f.header, f.payload_ok, bytes.slice(f.payload_at..f.payload_at + n))
            {
                return e;
            }
        }
        // The next reply is not all here. Its header, once whole and checked:
        let head = match parse_reply_head(&buf, digests) {
            Ok(h) => h,
            Err(e) => return e.into(),
        };
        if let Some(h) = head.filter(|h| h.payload_len >= LARGE_REPLY) {
            // A large reply: its data goes into a buffer of its own: what is here already,
            // then straight from the socket; then the data digest, if any.
            if !inflight.contains(h.tag) {
                return Error::UnknownTag(h.tag);
            }
            buf.advance(ReplyHeader::wire_len(digests));
            let n = h.payload_len as usize;
            let mut data = recycler.begin(&mut buf, n);
            while data.len() < n {
                let room = n - data.len();
                if let Err(e) =
                    read_some(&mut rd, &mut (&mut data).limit(room), &mut ticker, inflight, timeout).await
                {
                    return e;
                }
            }
            if digests {
                while buf.len() < DIGEST_LEN {
                    buf.reserve(4096);
                    if let Err(e) = read_some(&mut rd, &mut buf, &mut ticker, inflight, timeout).await {
                        return e;
                    }
                }
            }
            let payload_ok = !digests || digest::verify(&data, &buf.split_to(DIGEST_LEN));
            let data = recycler.data(data);
            if let Err(e) = deliver(inflight, &h, payload_ok, data) {
                return e;
            }
            continue;
        }
        let need = head.map_or(0, |h| ReplyHeader::wire_len(digests) + h.payload_len as usize + DIGEST_LEN);
        // Room toward the reply as its bytes arrive (large ones went above).
        let (room, most) = plan.next(buf.len(), need);
        buf.reserve(room);
        if let Err(e) = read_some(&mut rd, &mut (&mut buf).limit(most), &mut ticker, inflight, timeout).await
        {
            return e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recent depth is the deepest window of the last one to two spans
    /// of frames: a deep burst counts for a while, then is forgotten.
    #[test]
    fn the_recent_depth_remembers_a_deep_window_for_one_to_two_spans() {
        let mut d = Depth::default();
        assert_eq!(d.recent(), 0);
        d.saw(32);
        for _ in 1..Depth::SPAN {
            d.saw(1);
        }
        assert_eq!(d.recent(), 32, "still within the span that saw it");
        for _ in 0..Depth::SPAN - 1 {
            d.saw(3);
        }
        assert_eq!(d.recent(), 32, "remembered through the next span");
        d.saw(3);
        assert_eq!(d.recent(), 3, "forgotten two spans on");
        d.saw(DEEP_LOAD);
        assert!(d.recent() >= DEEP_LOAD);
    }

    #[test]
    fn the_adaptive_sender_lingers_only_on_a_window_deeper_than_two() {
        // QD1 and a lone request never linger.
        assert!(!loaded(1, 1, false));
        assert!(!loaded(1, 40, false), "one in flight on a once-deep window, no burst");
        // Two per connection, never more (4 requesters on 2 connections): at once.
        assert!(!loaded(2, 2, false));
        assert!(!loaded(2, 2, true), "a burst on a shallow window");
        // Moderate and heavy loads: two in flight on a window that went deeper.
        assert!(loaded(2, 3, false));
        assert!(loaded(7, 8, false));
        // After a burst on a deep window, even an emptied one.
        assert!(loaded(1, DEEP_LOAD, true));
        assert!(!loaded(1, DEEP_LOAD - 1, true));
    }

    fn reply(tag: u64, status: fastsan_brp::Status, data: &[u8], digests: bool, spoil: bool) -> Vec<u8> {
        let h = ReplyHeader { status, tag, payload_len: data.len() as u32 };
        let (hw, n) = h.encode_wire(digests);
        let mut v = hw[..n].to_vec();
        v.extend_from_slice(data);
        if digests && !data.is_empty() {
            v.extend((digest::crc(data) ^ spoil as u32).to_le_bytes());
        }
        v
    }

    async fn pending(inflight: &Inflight, tag: u64) -> oneshot::Receiver<Result<Option<Bytes>, Error>> {
        let (done, rx) = oneshot::channel();
        let credit = Arc::new(Semaphore::new(1)).acquire_owned().await.unwrap();
        inflight.register(tag, Pending { done, _credit: credit });
        rx
    }

    /// A connection that dies while requests are being sent on it from
    /// another thread answers every one of them (here: fails it), also one
    /// whose send was under way at that instant. Each round, a thread sends
    /// as fast as it can until the connection refuses, while the target goes
    /// away; then every request sent must get its answer. (Until 2026-11-27
    /// the dead connection dropped its queue, and a request whose send was
    /// under way could stay in it, unanswered, for as long as it waited.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_sent_as_the_connection_dies_are_all_answered() {
        let limits = || Limits {
            mode: MergeMode::Adaptive,
            max_batch: 64,
            merge_max_request: 64 << 10,
            queue_depth: 256,
            merge_max_bytes: 1 << 20,
            alone: false,
        };
        let mut sent = 0usize;
        for round in 0..500u64 {
            let (target, cli) = tokio::io::duplex(1 << 16);
            let (rd, wr) = tokio::io::split(cli);
            let io = Io { rd, wr, leftover: BytesMut::new(), digests: false };
            let place = Place {
                slot: 0,
                epoch: 0,
                request_timeout: std::time::Duration::from_secs(60),
                target: (0, 0),
            };
            let conn =
                Arc::new(Conn::start_on(io, place, limits(), Arc::new(Stats::default()), Box::new(|| {})));
            let (c, credits) = (conn.clone(), Arc::new(Semaphore::new(Semaphore::MAX_PERMITS)));
            let sender = std::thread::spawn(move || {
                let mut answers = Vec::new();
                for tag in 0.. {
                    let (done, answer) = oneshot::channel();
                    let credit = credits.clone().try_acquire_owned().expect("credits enough");
                    let header = RequestHeader::new(Command::Read, 0, tag, 0, 512);
                    let s =
                        Submit { header, payload: Bytes::new(), pending: Pending { done, _credit: credit } };
                    if c.submit(s).is_err() {
                        return answers;
                    }
                    answers.push(answer);
                }
                unreachable!()
            });
            tokio::time::sleep(std::time::Duration::from_micros(100 + round * 7 % 400)).await;
            drop(target);
            let answers = tokio::task::spawn_blocking(move || sender.join().unwrap()).await.unwrap();
            sent += answers.len();
            for (i, a) in answers.into_iter().enumerate() {
                // The connection (and so its channel) is still held here, as
                // a request in flight holds it.
                let got = tokio::time::timeout(std::time::Duration::from_secs(10), a).await;
                let got = got.unwrap_or_else(|_| panic!("round {round}: request {i} was never answered"));
                assert!(matches!(got, Ok(Err(Error::ConnectionLost)) | Err(_)), "round {round}: {got:?}");
            }
            drop(conn);
        }
        assert!(sent > 200, "requests were sent: {sent}");
    }

    /// Large replies arriving in odd pieces, between small ones, with and
    /// without digests: each answer is its bytes exactly; a spoiled data
    /// digest fails only its request; the buffer of a dropped answer is
    /// reused for the next large one; a stream cut inside a large reply's
    /// data ends the loop with ConnectionLost, and a large reply nobody asked
    /// for with UnknownTag.
    #[tokio::test]
    async fn large_replies_are_read_whole_into_recycled_buffers() {
        use tokio::io::AsyncWriteExt;
        let big = |seed: u8, n: usize| (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect::<Vec<u8>>();
        for digests in [false, true] {
            let inflight = Arc::new(Inflight::default());
            let (mut srv, cli) = tokio::io::duplex(16 * 1024);
            let looped = {
                let inflight = inflight.clone();
                tokio::spawn(async move {
                    recv_loop(cli, BytesMut::new(), &inflight, digests, std::time::Duration::from_secs(30))
                        .await
                })
            };
            let ok = fastsan_brp::Status::OK;
            let (a, b, c, d) = (big(1, 1 << 20), big(2, 4096), big(3, 65536), big(4, 700_000));
            let mut wire = reply(1, ok, &a, digests, false);
            wire.extend(reply(2, ok, &d, digests, false));
            wire.extend(reply(3, ok, &b, digests, false));
            wire.extend(reply(4, ok, &c, digests, digests));
            let rx: Vec<_> = futures::future::join_all((1..=4).map(|t| pending(&inflight, t))).await;
            let mut rx = rx.into_iter();
            let mut cuts = [1usize, 7, 19, 4096, 70_000, 3].iter().cycle();
            let mut at = 0;
            let mut send = |upto: usize| {
                let mut pieces = Vec::new();
                while at < upto {
                    let n = (*cuts.next().unwrap()).min(upto - at);
                    pieces.push(wire[at..at + n].to_vec());
                    at += n;
                }
                pieces
            };
            // The first reply alone, so its buffer is back before the next large one arrives.
            let first_len = reply(1, ok, &a, digests, false).len();
            for p in send(first_len) {
                srv.write_all(&p).await.unwrap();
            }
            let got_a = rx.next().unwrap().await.unwrap().unwrap().unwrap();
            assert!(got_a[..] == a[..], "digests {digests}: the first large reply");
            let a_at = got_a.as_ptr();
            drop(got_a);
            for p in send(wire.len()) {
                srv.write_all(&p).await.unwrap();
            }
            let got_d = rx.next().unwrap().await.unwrap().unwrap().unwrap();
            assert!(got_d[..] == d[..]);
            assert_eq!(got_d.as_ptr(), a_at, "the first reply's buffer is reused");
            assert_eq!(rx.next().unwrap().await.unwrap().unwrap().unwrap()[..], b[..]);
            let last = rx.next().unwrap().await.unwrap();
            match digests {
                true => assert!(matches!(last, Err(Error::DigestMismatch)), "{last:?}"),
                false => assert_eq!(last.unwrap().unwrap()[..], c[..]),
            }
            // A large reply nobody asked for.
            srv.write_all(&reply(9, ok, &d, digests, false)[..4096]).await.unwrap();
            assert!(matches!(looped.await.unwrap(), Error::UnknownTag(9)));
        }
        // Cut inside a large reply's data.
        let inflight = Arc::new(Inflight::default());
        let (mut srv, cli) = tokio::io::duplex(16 * 1024);
        let _rx = pending(&inflight, 5).await;
        let looped = {
            let inflight = inflight.clone();
            tokio::spawn(async move {
                recv_loop(cli, BytesMut::new(), &inflight, false, std::time::Duration::from_secs(30)).await
            })
        };
        srv.write_all(&reply(5, fastsan_brp::Status::OK, &big(5, 200_000), false, false)[..100_000])
            .await
            .unwrap();
        drop(srv);
        assert!(matches!(looped.await.unwrap(), Error::ConnectionLost));
    }
}
