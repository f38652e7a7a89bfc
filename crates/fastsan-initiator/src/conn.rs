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
use crate::stats::Stats;
use crate::transport::Stream;
use crate::Error;
use bytes::{Bytes, BytesMut};
use fastsan_brp::batch::BatchBuilder;
use fastsan_brp::digest::{self, DIGEST_LEN};
use fastsan_brp::reply::{parse_reply, ReplyHeader, REPLY_HEADER_LEN};
use fastsan_brp::request::{encode_header, RequestHeader};
use fastsan_brp::Command;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
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
/// Each request notes the clock's tick when it was sent: a coarse clock that
/// the receiver advances [`TICKS`] times per request timeout, so the hot
/// path reads no time at all.
#[derive(Default)]
struct Inflight {
    /// Closed, and each tag's request with the tick it was sent at.
    state: Mutex<(bool, HashMap<u64, Sent>)>,
    tick: std::sync::atomic::AtomicU32,
}

type Sent = (Pending, u32);

/// Ticks of the coarse clock per request timeout.
const TICKS: u32 = 4;

impl Inflight {
    fn register(&self, tag: u64, p: Pending) {
        let mut st = self.state.lock();
        if st.0 {
            let _ = p.done.send(Err(Error::ConnectionLost));
        } else {
            st.1.insert(tag, (p, self.tick.load(Relaxed)));
        }
    }
    fn take(&self, tag: u64) -> Option<Pending> {
        self.state.lock().1.remove(&tag).map(|(p, _)| p)
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
    /// Advances the clock; whether a request has waited a whole timeout.
    fn tick_finds_overdue(&self) -> bool {
        let now = self.tick.fetch_add(1, Relaxed) + 1;
        self.state.lock().1.values().any(|(_, sent)| now.wrapping_sub(*sent) > TICKS)
    }
}

pub(crate) struct Limits {
    pub mode: MergeMode,
    pub max_batch: usize,
    pub merge_max_request: u32,
    /// Credits granted by the target, to tell how loaded the connection is.
    pub queue_depth: u32,
    pub merge_max_bytes: u32,
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
        let die = {
            let (dead, inflight, credits) = (dead.clone(), inflight.clone(), credits.clone());
            move |e: Option<Error>| {
                dead.cancel();
                credits.close();
                inflight.fail_all();
                if let Some(e) = e {
                    tracing::warn!(error = &e as &dyn std::error::Error, "connection to the target lost");
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
                let r = tokio::select! {
                    biased;
                    _ = dead.cancelled() => Ok(()),
                    r = send_loop(wr, rx, &inflight, &credits_s, digests, limits, &stats) => r,
                };
                die(r.err().map(Error::from));
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
        Conn { tx, credits, dead, slot: place.slot, epoch: place.epoch, target: place.target }
    }

    pub fn is_alive(&self) -> bool {
        !self.dead.is_cancelled()
    }

    /// Queues a request; gives it back if the connection is gone.
    pub fn submit(&self, s: Submit) -> Result<(), Submit> {
        self.tx.send(s).map_err(|e| e.0)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.dead.cancel();
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
/// window costs more than it merges (a convoy).
const DEEP_LOAD: usize = 16;

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

/// Requests with a credit taken and no reply yet: the connection's window.
fn window(l: &Limits, credits: &Semaphore) -> usize {
    (l.queue_depth as usize).saturating_sub(credits.available_permits())
}

fn mergeable(s: &Submit, l: &Limits) -> bool {
    s.header.length <= l.merge_max_request || s.header.command == Command::Flush
}

async fn send_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::UnboundedReceiver<Submit>,
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
        let in_flight = window(&l, credits);
        let after_burst = last_sent.elapsed() < BURST_GAP && last_group >= MERGE_LOAD;
        let busy = in_flight >= MERGE_LOAD || after_burst && depth.recent() >= DEEP_LOAD;
        let merge = l.mode != MergeMode::Off && mergeable(&first, &l);
        let mut bytes = first.payload.len();
        push(&mut group, inflight, first);
        if merge {
            let mut rounds = match l.mode {
                MergeMode::Always => 3,
                MergeMode::Adaptive if busy => 2,
                _ => 0,
            };
            loop {
                while group.len() < l.max_batch {
                    let Ok(s) = rx.try_recv() else { break };
                    if !mergeable(&s, &l) || bytes + s.payload.len() > l.merge_max_bytes as usize {
                        carry = Some(s);
                        break;
                    }
                    bytes += s.payload.len();
                    push(&mut group, inflight, s);
                }
                if rounds == 0 || carry.is_some() || group.len() >= l.max_batch {
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

/// Registers the request as in flight, keeping what the sender must write.
fn push(group: &mut Vec<(RequestHeader, Bytes)>, inflight: &Inflight, s: Submit) {
    inflight.register(s.header.tag, s.pending);
    group.push((s.header, s.payload));
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
    let period = (timeout / TICKS).max(std::time::Duration::from_millis(1));
    let mut clock = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        loop {
            let f = match parse_reply(&buf, digests) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return e.into(),
            };
            let bytes = buf.split_to(f.frame_len).freeze();
            let Some(p) = inflight.take(f.header.tag) else {
                return Error::UnknownTag(f.header.tag);
            };
            let n = f.header.payload_len as usize;
            let result = if !f.header.status.is_ok() {
                Err(Error::Status(f.header.status))
            } else if !f.payload_ok {
                Err(Error::DigestMismatch)
            } else if n > 0 {
                Ok(Some(bytes.slice(f.payload_at..f.payload_at + n)))
            } else {
                Ok(None)
            };
            let _ = p.done.send(result);
        }
        let need = match buf.first_chunk::<REPLY_HEADER_LEN>().map(ReplyHeader::decode) {
            Some(Ok(h)) => ReplyHeader::wire_len(digests) + h.payload_len as usize + DIGEST_LEN,
            _ => 0,
        };
        // Grow toward a large reply a megabyte at a time, as its bytes arrive.
        buf.reserve(need.min(buf.len() + (1 << 20)).max(256 * 1024).saturating_sub(buf.len()).max(4096));
        let read = loop {
            tokio::select! {
                r = rd.read_buf(&mut buf) => break r,
                _ = clock.tick() => {
                    if inflight.tick_finds_overdue() {
                        tracing::warn!(?timeout, "a request got no reply in time; dropping the connection");
                        return Error::Timeout("request");
                    }
                }
            }
        };
        match read {
            Ok(0) => return Error::ConnectionLost,
            Ok(_) => {}
            Err(e) => return e.into(),
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
}
