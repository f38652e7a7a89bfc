//! The request pipeline every front end shares, driven by
//! [`crate::driver`]: after a request is decoded, [`Dispatcher::dispatch`]
//! takes a credit, checks it ([`Volume::validate`]), runs it on the device
//! ([`Volume::execute`]: inline for memory and null volumes, on the I/O pool
//! for files and slow layers, except a file's reads whose bytes are cached:
//! [`Volume::read_now`], inline) and queues the [`Reply`]; replies are written
//! in batches ([`Dispatcher::flush`], [`Writer::run`]: one `writev` for all
//! that are ready), encoded by the front end's [`Encoder`], in completion
//! order: by the reader itself when the socket is free, else by the
//! [`Writer`] task; an I/O thread that finishes a connection's only request
//! writes its reply itself (`Replies`). A refusal or a device error is
//! logged here, in one place.
//!
//! A request holds a credit from dispatch until its reply is written, so a
//! connection never has more than its queue depth, nor more than its byte
//! budget, in flight; when credits run out the reader simply stops reading.

use crate::backend::LATENCY_SAMPLE;
use crate::fence::Activity;
use crate::pool::Job;
use crate::request::{IoKind, IoRequest, Limits, ReadData, Refusal};
use crate::stats::Stats;
use crate::volume::{Op, Outcome, Volume};
use std::io::{self, IoSlice};
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Bytes of payload one connection may hold in flight.
const BYTE_BUDGET: u32 = 64 << 20;
/// Credits on the byte budget are counted in KiB.
const BUDGET_UNIT: u32 = 1024;
/// Most bytes the read buffer grows by ahead of the data that arrived.
pub const READ_GROWTH: usize = 1 << 20;
/// Smallest room offered to each read.
pub const READ_CHUNK: usize = 256 * 1024;
/// Most replies gathered into one write.
const MAX_REPLIES_PER_WRITE: usize = 256;
/// A client's bad requests logged at `info` per connection; the rest go to
/// `debug`, so a misbehaving client cannot flood the log.
const LOGGED_REFUSALS: u32 = 16;
/// Device errors logged one by one per connection; past that, one line in
/// [`DEVICE_ERROR_EVERY`] (with the count), so a failing disk is never silent.
const LOGGED_DEVICE_ERRORS: u32 = 64;
const DEVICE_ERROR_EVERY: u32 = 1024;

/// What every connection of a server shares, and nothing more.
#[derive(Clone)]
pub struct ConnEnv {
    pub stats: Arc<Stats>,
    pub shutdown: CancellationToken,
    /// Requests in flight per connection (1 when serial).
    pub queue_depth: u32,
    /// Process requests one at a time, end to end (the paper's BRP-1).
    pub serial: bool,
    pub handshake_timeout: Duration,
    /// How long a connection serving one request at a time spins for the
    /// next ([`crate::driver::BusyPoll`]; zero: never).
    pub poll_window: Duration,
    /// One round of holding replies for a client that trickles its requests
    /// ([`crate::coalesce::Coalesce`]; zero: never).
    pub coalesce_window: Duration,
    /// How long a reply write may make no progress before the connection is dropped.
    pub stall_timeout: Duration,
    /// Connection slots: a connection takes one when its handshake succeeds.
    pub slots: Arc<tokio::sync::Semaphore>,
    /// Payload in flight, all connections together.
    pub budget: Budget,
    /// TLS, identities, grants and the failed-authentication limiter.
    pub access: Arc<crate::access::Access>,
}

/// Bytes of payload in flight, counted in KiB: a request that moves data
/// holds its share from dispatch to its reply's write. Each connection has
/// one (64 MiB) and the server one for all of them, so that many
/// clients that ask for large reads and never take the replies cannot
/// exhaust memory.
#[derive(Clone)]
pub struct Budget {
    units: Arc<Tokens>,
    max_units: u32,
}

impl Budget {
    pub fn new(bytes: u64) -> Budget {
        let max_units = (bytes / BUDGET_UNIT as u64).clamp(1, u32::MAX as u64) as u32;
        Budget { units: Arc::new(Tokens::new(max_units as usize)), max_units }
    }

    /// The units a request moving `bytes` holds (at least one; at most all).
    fn units(&self, bytes: u64) -> u32 {
        (bytes / BUDGET_UNIT as u64).clamp(1, self.max_units as u64) as u32
    }

    /// Bytes in flight now.
    pub fn in_use(&self) -> u64 {
        (self.max_units as u64).saturating_sub(self.units.available() as u64) * BUDGET_UNIT as u64
    }
}

/// Tokens taken and given back without a lock: a connection's queue slots,
/// its byte budget, the server's. Taking is a compare-and-swap on one word,
/// giving back an add, and a wake-up only when someone waits (until
/// 2026-11-26 these were tokio semaphores, whose every release takes the
/// waiters' lock: with the reference counts of three permits per request,
/// ~4% of the target's cycles under 4K loads, docs/benchmarks.md).
///
/// First come, first served, as the semaphores were: while anyone waits,
/// nobody takes ahead of them ([`Tokens::try_take`] fails), and waiters
/// queue on a fair lock so that only the first waits for its count; else a
/// request for a large share of the server's budget (an 8 MiB read) could
/// wait forever behind other clients' stream of small ones. A connection's
/// own slots and budget have one taker, its reader.
pub(crate) struct Tokens {
    free: AtomicUsize,
    /// Takers in [`Tokens::take`]: while there are any, a give notifies and
    /// nobody else takes.
    waiting: AtomicUsize,
    given: Notify,
    /// The waiters' queue (tokio's mutex is fair: first come, first served).
    turn: tokio::sync::Mutex<()>,
}

impl Tokens {
    fn new(n: usize) -> Tokens {
        Tokens {
            free: AtomicUsize::new(n),
            waiting: AtomicUsize::new(0),
            given: Notify::new(),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    fn available(&self) -> usize {
        self.free.load(SeqCst)
    }

    /// Takes `n` if that many are free now and nobody waits.
    fn try_take(&self, n: usize) -> bool {
        self.waiting.load(SeqCst) == 0 && self.grab(n)
    }

    fn grab(&self, n: usize) -> bool {
        let mut free = self.free.load(SeqCst);
        loop {
            if free < n {
                return false;
            }
            match self.free.compare_exchange_weak(free, free - n, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// Takes `n` when that many are free, after those who waited before.
    async fn take(&self, n: usize) {
        // Counted first: from here on nobody takes ahead of this waiter.
        self.waiting.fetch_add(1, SeqCst);
        let _counted = crate::fence::Uncount(&self.waiting);
        let _turn = self.turn.lock().await;
        loop {
            // Armed before the count is read: a give either comes before
            // the read (which finds its tokens) or notifies this waiter.
            let given = self.given.notified();
            tokio::pin!(given);
            given.as_mut().enable();
            if self.grab(n) {
                return;
            }
            given.await;
        }
    }

    fn give(&self, n: usize) {
        self.free.fetch_add(n, SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            self.given.notify_waiters();
        }
    }
}

/// A connection's credits: its queue slots and byte budget, and the
/// server's budget they share.
struct Credits {
    slots: Tokens,
    /// How many slots there are (the connection's queue depth).
    depth: usize,
    budget: Budget,
    server: Budget,
    /// Where a credit is counted in flight (reached through the credits'
    /// reference: no second reference count per request).
    stats: Arc<Stats>,
}

/// What a request holds of [`Credits`], given back when dropped: also when
/// a wait for the rest is cancelled half-way.
struct Held {
    credits: Arc<Credits>,
    slot: bool,
    units: u32,
    server_units: u32,
    /// The volume's share of the server's budget, and the units taken of it.
    volume: Option<(Budget, u32)>,
}

impl Held {
    fn new(credits: &Arc<Credits>) -> Held {
        Held { credits: credits.clone(), slot: false, units: 0, server_units: 0, volume: None }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let c = &self.credits;
        if self.slot {
            c.slots.give(1);
        }
        if self.units > 0 {
            c.budget.units.give(self.units as usize);
        }
        if self.server_units > 0 {
            c.server.units.give(self.server_units as usize);
        }
        if let Some((b, units)) = &self.volume {
            b.units.give(*units as usize);
        }
    }
}

/// The byte budget of a frame whose payload is arriving, taken when its
/// header is there and before the rest is read ([`Dispatcher::prepay`]):
/// the bytes a client sends are counted before the target reads them, as a
/// READ's are before its data is read from the device. (Until 2026-12-08 a
/// WRITE's payload was counted only once it had all arrived: an NBD write
/// held up to 64 MiB of a connection's read buffer outside every budget,
/// and 1024 connections as much as 64 GiB.) The credits of the writes the
/// frame carries draw their budget from it (`Prepaid::draw`); what they do
/// not take (a refused write moves nothing) goes back when it is dropped:
/// once the frame is decoded, or before one of them must wait for more.
pub struct Prepaid(Held);

impl Prepaid {
    /// Moves the budget of `bytes` on `volume` out of `paid` into `held`,
    /// if `paid` holds that much of each part for that volume.
    fn draw(paid: &mut Option<Prepaid>, held: &mut Held, volume: &Volume, bytes: u64) -> bool {
        let Some(Prepaid(p)) = paid else { return false };
        let c = &p.credits;
        let share = volume.payload_share();
        let (units, volume_units, server_units) =
            (c.budget.units(bytes), share.units(bytes), c.server.units(bytes));
        let Some((b, left)) = p.volume.as_mut() else { return false };
        if !Arc::ptr_eq(&b.units, &share.units)
            || *left < volume_units
            || p.units < units
            || p.server_units < server_units
        {
            return false;
        }
        *left -= volume_units;
        p.units -= units;
        p.server_units -= server_units;
        held.units = units;
        held.volume = Some((share.clone(), volume_units));
        held.server_units = server_units;
        true
    }
}

/// Whether a request brought a payload: only such draw on the budget its
/// frame held while it arrived (a READ in the same BATCH does not).
fn carries(req: &Result<IoRequest, Refusal>) -> bool {
    req.as_ref().is_ok_and(|r| !r.payload.is_empty())
}

/// The bytes a request moves through the device (what its byte budget
/// counts): none for one refused already or about to be ([`Volume::moves`]).
fn moves(req: &Result<IoRequest, Refusal>, volume: &Volume, limits: &Limits) -> u64 {
    req.as_ref().map_or(0, |r| volume.moves(r, limits))
}

/// One finished request on its way to the writer. `M` is what the front end
/// needs to encode the reply (its command, offset, ...).
pub struct Reply<M> {
    pub tag: u64,
    pub meta: M,
    pub result: Result<Outcome, Refusal>,
    /// None for a reply the front end made itself ([`Dispatcher::reply_local`]).
    _credit: Option<Credit>,
}

/// A request's credit: what it holds, and its count in flight (the
/// stats' in-flight requests) from its credit to its reply, written or
/// dropped; one in [`LATENCY_SAMPLE`] per thread is also timed over that
/// span, into the stats' latency.
struct Credit {
    held: Held,
    timed: Option<std::time::Instant>,
}

impl Credit {
    fn new(held: Held) -> Credit {
        held.credits.stats.began();
        thread_local! {
            static COUNT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
        }
        let n = COUNT.with(|c| {
            c.set(c.get().wrapping_add(1));
            c.get()
        });
        let timed = n.is_multiple_of(LATENCY_SAMPLE).then(std::time::Instant::now);
        Credit { held, timed }
    }
}

impl Drop for Credit {
    fn drop(&mut self) {
        let stats = &self.held.credits.stats;
        stats.ended();
        if let Some(t) = self.timed {
            stats.latency.record(t.elapsed().as_nanos().min(u64::MAX as u128) as u64);
        }
    }
}

/// Where the bytes of one encoded reply are: `head` and `tail` in the
/// writer's scratch buffer, `data` (a READ's bytes) in between.
pub struct Encoded {
    pub head: Range<usize>,
    pub data: Option<ReadData>,
    pub tail: Range<usize>,
}

/// A front end's reply format.
pub trait Encoder: Send + 'static {
    type Meta: Send + Sync + 'static;
    /// Appends the reply's framing to `scratch` and says where its parts are.
    fn encode(&mut self, r: &Reply<Self::Meta>, scratch: &mut Vec<u8>) -> Encoded;
}

/// The write half of a connection with what encodes replies onto it. The
/// reader writes through it directly when it is free (no hand-off to another
/// task at low load); the writer task writes what the I/O pool completes, and
/// whatever the reader found it busy with.
///
/// A write that fails or stalls may have stopped in the middle of a reply:
/// from then on the sink is broken (nothing more is written, so no reply can
/// follow a cut one and be taken for its data) and the connection is stopped.
struct SinkState<W, E: Encoder> {
    w: W,
    enc: E,
    scratch: Vec<u8>,
    parts: Vec<Encoded>,
    stall: Duration,
    activity: Arc<Activity>,
    /// Where a stalled stream is counted ([`Stats::stalled`]).
    stats: Arc<Stats>,
    broken: bool,
    /// Why it broke, for whoever writes next ([`SinkState::write_at_once`]
    /// fails on a thread that cannot return it).
    failure: Option<io::Error>,
    /// A reply [`SinkState::write_at_once`] began and the socket did not
    /// take whole: written before anything else.
    rest: Option<Rest<E::Meta>>,
    /// The protocol's goodbye is written ([`Dispatcher::send_last`]):
    /// nothing may follow it (an NVMe/TCP host takes no PDU after a
    /// C2HTermReq), so later replies are dropped, as for nobody reading.
    ended: bool,
}

/// The part of a reply the socket did not take at once. The reply is kept
/// whole, not copied: its credit stays held (the payload budget still
/// counts it) and its data stays where the encoding points.
struct Rest<M> {
    _reply: Reply<M>,
    /// Its encoded head and tail ([`SinkState::scratch`] when it was encoded).
    scratch: Vec<u8>,
    part: Encoded,
    /// Bytes of it written.
    sent: usize,
}

/// What [`SinkState::write_at_once`] did with a reply it took.
enum AtOnce {
    /// Written (or dropped: the stream failed, or nobody reads it).
    Done,
    /// Begun: the rest is kept, or the stream still needs a flush, or it
    /// failed; the writer task must finish it (or end the connection).
    Begun,
}

impl<W: AsyncWrite + Unpin, E: Encoder> SinkState<W, E> {
    /// Encodes `batch` and writes it with one vectored write (more if the
    /// socket takes less).
    async fn write(&mut self, batch: &[Reply<E::Meta>]) -> io::Result<()> {
        self.write_then(batch, &[]).await
    }

    /// [`SinkState::write`], then `last` (a protocol's goodbye).
    async fn write_then(&mut self, batch: &[Reply<E::Meta>], last: &[u8]) -> io::Result<()> {
        if self.broken {
            return Err(self.failure.take().unwrap_or_else(|| {
                io::Error::new(io::ErrorKind::BrokenPipe, "the reply stream failed earlier")
            }));
        }
        if self.activity.is_abandoned() || self.ended {
            // Nobody reads them: drop the replies (and what they hold), a
            // reply begun too (the stream is reset, never finished).
            self.rest = None;
            return Ok(());
        }
        // Broken until the write is whole: a write cancelled half-way (its
        // caller gave up: shutdown, the connection stopped) leaves it broken.
        self.broken = true;
        let r = self.write_all_of(batch, last).await;
        match &r {
            Ok(()) => (self.broken, self.ended) = (false, !last.is_empty()),
            Err(e) => self.abandon(e),
        }
        r
    }

    /// The rest of a reply begun, then `batch`, then `last`, then a flush.
    async fn write_all_of(&mut self, batch: &[Reply<E::Meta>], last: &[u8]) -> io::Result<()> {
        if let Some(rest) = self.rest.take() {
            let mut slices = slices(&rest.scratch, std::slice::from_ref(&rest.part));
            let mut bufs = &mut slices[..];
            IoSlice::advance_slices(&mut bufs, rest.sent);
            write_all_vectored(&mut self.w, bufs, self.stall).await?;
        }
        for chunk in batch.chunks(MAX_REPLIES_PER_WRITE) {
            self.encode(chunk);
            let mut slices = slices(&self.scratch, &self.parts);
            write_all_vectored(&mut self.w, &mut slices, self.stall).await?;
        }
        if !last.is_empty() {
            write_all_vectored(&mut self.w, &mut [IoSlice::new(last)], self.stall).await?;
        }
        // TLS may hold records it could not send yet (a no-op on a socket).
        match tokio::time::timeout(self.stall, self.w.flush()).await {
            Ok(r) => r,
            Err(_) => Err(stalled()),
        }
    }

    /// Encodes `replies` into `scratch` and `parts`.
    fn encode(&mut self, replies: &[Reply<E::Meta>]) {
        self.scratch.clear();
        self.parts.clear();
        for r in replies {
            let e = self.enc.encode(r, &mut self.scratch);
            self.parts.push(e);
        }
    }

    /// Writes `reply` now, on whatever thread finished it, as far as the
    /// socket takes it without waiting: an I/O thread that completes a
    /// request sends its reply itself instead of waking the writer task (a
    /// thread hand-off: at queue depth 1 on a file volume, 0.75x nbdkit's
    /// IOPS). What the socket does not take is kept, in order, for the
    /// writer task ([`AtOnce::Begun`]), so this never waits. Gives the reply
    /// back when it cannot be written now (another reply is half-written).
    fn write_at_once(&mut self, reply: Reply<E::Meta>) -> Result<AtOnce, Reply<E::Meta>> {
        if self.broken || self.rest.is_some() {
            return Err(reply);
        }
        if self.activity.is_abandoned() || self.ended {
            return Ok(AtOnce::Done);
        }
        self.encode(std::slice::from_ref(&reply));
        let mut slices = slices(&self.scratch, &self.parts);
        let mut bufs = &mut slices[..];
        let mut sent = 0;
        // None: all of it went; Some(Ok): the socket is full.
        let stopped = loop {
            if bufs.is_empty() {
                break None;
            }
            match futures::FutureExt::now_or_never(self.w.write_vectored(bufs)) {
                Some(Ok(n)) if n > 0 => {
                    sent += n;
                    IoSlice::advance_slices(&mut bufs, n);
                }
                Some(r) => break Some(Err(r.err().unwrap_or_else(|| io::ErrorKind::WriteZero.into()))),
                None => break Some(Ok(())),
            }
        };
        drop(slices);
        match stopped {
            None => {}
            Some(Ok(())) => {
                let part = self.parts.pop().expect("one reply encoded");
                let scratch = std::mem::take(&mut self.scratch);
                self.rest = Some(Rest { _reply: reply, scratch, part, sent });
                return Ok(AtOnce::Begun);
            }
            Some(Err(e)) => {
                self.fail(e);
                return Ok(AtOnce::Begun);
            }
        }
        match futures::FutureExt::now_or_never(self.w.flush()) {
            Some(Ok(())) => Ok(AtOnce::Done),
            Some(Err(e)) => {
                self.fail(e);
                Ok(AtOnce::Begun)
            }
            None => Ok(AtOnce::Begun),
        }
    }

    /// Nobody will read the replies: the connection is abandoned, counted
    /// as stalled when its writes made no progress for the stall timeout.
    fn abandon(&self, e: &io::Error) {
        if e.kind() == io::ErrorKind::TimedOut && !self.activity.is_abandoned() {
            Stats::add(&self.stats.stalled, 1);
        }
        self.activity.abandon();
    }

    /// The stream failed where the error cannot be returned: broken, the
    /// connection abandoned, the error kept for the writer task to end with.
    fn fail(&mut self, e: io::Error) {
        self.broken = true;
        self.failure = Some(e);
        self.activity.abandon();
    }
}

/// The slices of encoded replies: heads and tails in `scratch`, a read's
/// data where it lies.
fn slices<'a>(scratch: &'a [u8], parts: &'a [Encoded]) -> Vec<IoSlice<'a>> {
    let mut slices = Vec::with_capacity(parts.len() * 3);
    for p in parts {
        slices.push(IoSlice::new(&scratch[p.head.clone()]));
        for d in p.data.iter().flat_map(ReadData::pieces).filter(|d| !d.is_empty()) {
            slices.push(IoSlice::new(d));
        }
        if !p.tail.is_empty() {
            slices.push(IoSlice::new(&scratch[p.tail.clone()]));
        }
    }
    slices
}

/// Where a request finished on an I/O thread sends its reply: written at
/// once when it is its connection's only request in flight and the socket's
/// writer is free ([`SinkState::write_at_once`]), else handed to the writer
/// task. Only then: with more in flight, the writer gathers the replies that
/// finish while it wakes into one `writev` (I/O threads each writing their
/// own cost 0.6x the IOPS of 4K reads at queue depth 32 on a file volume).
struct Replies<W, E: Encoder> {
    tx: mpsc::UnboundedSender<Batch<E>>,
    sink: Sink<W, E>,
    credits: Arc<Credits>,
}

impl<W: AsyncWrite + Unpin, E: Encoder> Replies<W, E> {
    fn send(&self, reply: Reply<E::Meta>) {
        // This reply holds a slot: the only one held.
        let alone = self.credits.slots.available() + 1 == self.credits.depth;
        let reply = match alone.then(|| self.sink.try_lock().ok()).flatten() {
            Some(mut sink) => match sink.write_at_once(reply) {
                Ok(AtOnce::Done) => return,
                Ok(AtOnce::Begun) => {
                    drop(sink);
                    // An empty batch: the writer writes the rest, and flushes.
                    let _ = self.tx.send(Vec::new());
                    return;
                }
                Err(reply) => reply,
            },
            None => reply,
        };
        let _ = self.tx.send(vec![reply]);
    }
}

type Sink<W, E> = Arc<tokio::sync::Mutex<SinkState<W, E>>>;
type Batch<E> = Vec<Reply<<E as Encoder>::Meta>>;

/// Dispatches one connection's requests.
pub struct Dispatcher<W, E: Encoder> {
    env: Arc<ConnEnv>,
    limits: Limits,
    peer: Arc<str>,
    tx: mpsc::UnboundedSender<Batch<E>>,
    sink: Sink<W, E>,
    /// Replies without a credit in the writer's queue ([`MAX_LOCAL_HANDED`]).
    handed: Arc<AtomicUsize>,
    credits: Arc<Credits>,
    /// Replies of requests run inline, held until the reader has dispatched
    /// everything one read brought, then written together in one `writev`.
    pending: parking_lot::Mutex<Batch<E>>,
    logged: Arc<Logged>,
    activity: Arc<Activity>,
    /// This connection, as the I/O pools' fair queues know it.
    client: u64,
    /// The volumes whose stores hold I/Os this connection submitted and has
    /// not kicked yet ([`Dispatcher::kick`]); one, mostly (several for an
    /// NVMe/TCP queue that takes turns between namespaces).
    unkicked: parking_lot::Mutex<Vec<Arc<Volume>>>,
}

/// A validated request on its way through a volume's I/O pool, with what
/// its reply needs. A long TRIM or WRITE_ZEROES runs one piece per turn.
struct PoolJob<W, E: Encoder> {
    op: Op,
    answer: Answer<W, E>,
}

/// What a request run off the reader's thread (on the I/O pool, after a
/// flush, through a volume's ring) needs to be answered from wherever it ends.
struct Answer<W, E: Encoder> {
    volume: Arc<Volume>,
    stats: Arc<Stats>,
    peer: Arc<str>,
    logged: Arc<Logged>,
    replies: Replies<W, E>,
    reply: (u64, E::Meta, Option<IoKind>, Credit),
    running: crate::fence::Running,
}

impl<W: AsyncWrite + Unpin, E: Encoder> Answer<W, E> {
    /// Counts and logs the outcome, lets the fence go, and sends the reply.
    fn send(self, moves: (u64, u64), result: Result<Outcome, Refusal>) {
        let Answer { volume, stats, peer, logged, replies, reply: (tag, meta, kind, credit), running } = self;
        let at = Where { peer: &peer, volume: volume.name(), tag, kind };
        let result = account(result, moves, &stats, at, &logged);
        drop(running);
        replies.send(Reply { tag, meta, result, _credit: Some(credit) });
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static, E: Encoder> PoolJob<W, E> {
    fn into_job(self) -> Job {
        Job::new(move || {
            let PoolJob { mut op, answer } = self;
            let rest = op.split_off();
            let moves = op.moves();
            let result = match (answer.volume.execute_before_flush(op), rest) {
                (Ok(_), Some(rest)) if !answer.running.activity().is_abandoned() => {
                    return Some(PoolJob { op: rest, answer }.into_job());
                }
                // Nobody will read the reply: the rest is not worth running
                // (and a reconnect's fence would wait for it).
                (Ok(_), Some(_)) => Err(Refusal::Device(crate::backend::BackendError::Io(libc::ECANCELED))),
                // The flush it owes: answered from whichever thread runs that
                // flush, this one going on with other work meanwhile (a slow
                // fsync holds one thread, not one per FLUSH and FUA write).
                (Ok((outcome, true)), None) => {
                    let v = answer.volume.clone();
                    v.flush_then(Box::new(move |r| {
                        answer.send(moves, r.map(|()| outcome).map_err(Refusal::from))
                    }));
                    return None;
                }
                (result, _) => result.map(|(outcome, _)| outcome),
            };
            answer.send(moves, result);
            None
        })
    }
}

/// Numbers the connections for the I/O pools' fair queues.
static NEXT_CLIENT: AtomicU64 = AtomicU64::new(1);

/// How many refusals and device errors a connection has logged.
#[derive(Default)]
struct Logged {
    refusals: AtomicU32,
    device_errors: AtomicU32,
}

/// The task that writes what the dispatcher hands over; spawn [`Writer::run`].
pub struct Writer<W, E: Encoder> {
    rx: mpsc::UnboundedReceiver<Batch<E>>,
    sink: Sink<W, E>,
    handed: Arc<AtomicUsize>,
}

/// Most replies without a credit (made by the front end itself: an
/// NVMe/TCP R2T, an admin command's answer) waiting in the writer's queue;
/// past it, the reader writes its replies itself, waiting for the socket.
const MAX_LOCAL_HANDED: usize = 1024;

/// Replies in `batch` that hold no credit.
fn local_replies<M>(batch: &[Reply<M>]) -> usize {
    batch.iter().filter(|r| r._credit.is_none()).count()
}

impl<W, E> Dispatcher<W, E>
where
    W: AsyncWrite + Unpin + Send + 'static,
    E: Encoder,
{
    /// A dispatcher writing replies to `w` in `enc`'s format, and the writer
    /// task to spawn beside it.
    pub fn new(
        env: Arc<ConnEnv>,
        limits: Limits,
        peer: Arc<str>,
        w: W,
        enc: E,
        activity: Arc<Activity>,
    ) -> (Self, Writer<W, E>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let depth = env.queue_depth as usize;
        let sink = Arc::new(tokio::sync::Mutex::new(SinkState {
            w,
            enc,
            scratch: Vec::new(),
            parts: Vec::new(),
            stall: env.stall_timeout,
            activity: activity.clone(),
            stats: env.stats.clone(),
            broken: false,
            ended: false,
            failure: None,
            rest: None,
        }));
        let credits = Arc::new(Credits {
            slots: Tokens::new(depth),
            depth,
            budget: Budget::new(BYTE_BUDGET as u64),
            server: env.budget.clone(),
            stats: env.stats.clone(),
        });
        let handed = Arc::new(AtomicUsize::new(0));
        let d = Dispatcher {
            env,
            limits,
            peer,
            tx,
            sink: sink.clone(),
            handed: handed.clone(),
            credits,
            pending: parking_lot::Mutex::new(Vec::with_capacity(64)),
            logged: Arc::new(Logged::default()),
            activity,
            client: NEXT_CLIENT.fetch_add(1, Relaxed),
            unkicked: parking_lot::Mutex::new(Vec::new()),
        };
        (d, Writer { rx, sink, handed })
    }

    /// Check, then hand to `volume`'s device: inline or on the pool. `req`
    /// is an error when decoding already refused the request. Fails when the
    /// connection is stopped (lost, replaced, or its replies failed): then
    /// the request is not run, and nothing after it either.
    ///
    /// The usual case, a credit at hand, is [`Dispatcher::dispatch_now`]:
    /// a reader tries that first and awaits this only when it must wait.
    pub async fn dispatch(
        &self,
        volume: &Arc<Volume>,
        tag: u64,
        meta: E::Meta,
        req: Result<IoRequest, Refusal>,
        paid: &mut Option<Prepaid>,
    ) -> io::Result<()> {
        let moves = moves(&req, volume, &self.limits);
        let mut none = None;
        let paid = if carries(&req) { paid } else { &mut none };
        // Credits come back as I/Os finish: the ones submitted start first.
        self.kick();
        // At shutdown a request still waiting for a credit is dropped unanswered:
        // the connection is closing and the initiator will retry elsewhere.
        let credit = match self.credit_now(volume, moves, paid) {
            Some(c) => c,
            None => tokio::select! {
                biased;
                _ = self.activity.stopped() => return Err(stopped()),
                c = self.credit(volume, moves, paid) => c?,
                _ = self.env.shutdown.cancelled() => return Ok(()),
            },
        };
        self.start(volume, tag, meta, req, credit)
    }

    /// [`Dispatcher::dispatch`] when a credit is at hand now (no waiting, no
    /// wake-up registered); else the request comes back, for `dispatch`.
    /// A plain call: `dispatch`'s future, with its waits for a credit, for
    /// the connection's stop and for shutdown, is over a kilobyte, and a
    /// reader that awaited it for every request built and copied it each
    /// time (two 1.3 KiB `memcpy`s per NBD request, 42 ns of ~2.4 us).
    #[allow(clippy::type_complexity)]
    pub fn dispatch_now(
        &self,
        volume: &Arc<Volume>,
        tag: u64,
        meta: E::Meta,
        req: Result<IoRequest, Refusal>,
        paid: &mut Option<Prepaid>,
    ) -> Result<io::Result<()>, (E::Meta, Result<IoRequest, Refusal>)> {
        let mut none = None;
        let paid = if carries(&req) { paid } else { &mut none };
        match self.credit_now(volume, moves(&req, volume, &self.limits), paid) {
            Some(credit) => Ok(self.start(volume, tag, meta, req, credit)),
            None => Err((meta, req)),
        }
    }

    /// Runs a request that holds its credit (see [`Dispatcher::dispatch`]).
    fn start(
        &self,
        volume: &Arc<Volume>,
        tag: u64,
        meta: E::Meta,
        req: Result<IoRequest, Refusal>,
        credit: Credit,
    ) -> io::Result<()> {
        if self.activity.is_stopped() {
            return Err(stopped());
        }
        let stats = &self.env.stats;
        stats.request();
        let kind = req.as_ref().ok().map(|r| r.kind);
        let op = match req.and_then(|r| volume.validate(r, &self.limits)) {
            Ok(op) => op,
            Err(refusal) => {
                stats.refused_request(&refusal);
                let at = Where { peer: &self.peer, volume: volume.name(), tag, kind };
                at.log(&refusal, &self.logged);
                self.pending.lock().push(Reply { tag, meta, result: Err(refusal), _credit: Some(credit) });
                return Ok(());
            }
        };
        // Counted as running before it may start: a fence waits for it.
        let Some(running) = self.activity.begin() else { return Err(stopped()) };
        let moves = op.moves();
        let result = match volume.pool().filter(|_| !self.env.serial) {
            None => volume.execute(op),
            // A read of bytes at hand, or a write the page cache takes at
            // once, is answered here, as an inline one is.
            Some(pool) => match volume.read_now(&op).or_else(|| volume.write_now(&op)) {
                Some(result) => result,
                // To the device without an I/O thread (a direct file's ring):
                // answered from the thread that sees it finish.
                None if volume.can_submit(&op) => {
                    let answer = self.answer(volume, (tag, meta, kind, credit), running);
                    volume.submit(self.client, op, Box::new(move |result| answer.send(moves, result)));
                    self.unkicked(volume);
                    return Ok(());
                }
                None => {
                    let job = PoolJob { op, answer: self.answer(volume, (tag, meta, kind, credit), running) };
                    pool.submit(self.client, job.into_job());
                    return Ok(());
                }
            },
        };
        let at = Where { peer: &self.peer, volume: volume.name(), tag, kind };
        let result = account(result, moves, &self.env.stats, at, &self.logged);
        drop(running);
        self.pending.lock().push(Reply { tag, meta, result, _credit: Some(credit) });
        Ok(())
    }

    /// Notes that `volume` holds I/Os of this connection not kicked yet.
    fn unkicked(&self, volume: &Arc<Volume>) {
        let mut held = self.unkicked.lock();
        if !held.iter().any(|v| Arc::ptr_eq(v, volume)) {
            held.push(volume.clone());
        }
    }

    /// Starts the device I/Os this connection submitted since the last
    /// kick, together: the reader kicks once it has dispatched what one read
    /// brought, and before it waits (for a credit, for its replies' room).
    /// (Under the lock, which only the reader takes: the list keeps its room.)
    pub fn kick(&self) {
        for v in self.unkicked.lock().drain(..) {
            v.kick();
        }
    }

    /// What a request answered off the reader's thread carries.
    fn answer(
        &self,
        volume: &Arc<Volume>,
        reply: (u64, E::Meta, Option<IoKind>, Credit),
        running: crate::fence::Running,
    ) -> Answer<W, E> {
        Answer {
            volume: volume.clone(),
            stats: self.env.stats.clone(),
            peer: self.peer.clone(),
            logged: self.logged.clone(),
            replies: Replies { tx: self.tx.clone(), sink: self.sink.clone(), credits: self.credits.clone() },
            reply,
            running,
        }
    }

    /// Queues a reply the front end made itself ([`crate::frontend::Decoded::Local`]):
    /// no credit (it moves nothing through a device) and not counted as a
    /// request; it leaves with the next flush, in order with the others.
    pub fn reply_local(&self, tag: u64, meta: E::Meta, result: Result<Outcome, Refusal>) {
        self.pending.lock().push(Reply { tag, meta, result, _credit: None });
    }

    /// Sends the replies held, then `last` (a protocol's goodbye), before
    /// the connection closes; bounded by the stall timeout.
    pub async fn send_last(&self, last: &[u8]) {
        let _ = self.flush().await;
        // After the rest of a reply an I/O thread began, if any; a stream
        // that fails here is broken like any other (nothing follows a cut).
        let _ = self.sink.lock().await.write_then(&[], last).await;
    }

    /// Whether replies wait for [`Dispatcher::flush`] (requests run inline).
    pub fn holds_replies(&self) -> bool {
        !self.pending.lock().is_empty()
    }

    /// Sends the replies held so far: written here at once when the socket's
    /// writer is free, else handed to the writer task (or, when too many
    /// replies without a credit wait there already, written here once the
    /// writer is done). Readers call it after dispatching what one read
    /// brought; it also runs before waiting for a credit (the held replies
    /// are what would free it).
    pub async fn flush(&self) -> io::Result<()> {
        self.kick();
        if self.pending.lock().is_empty() {
            return Ok(());
        }
        // The lock before the replies: a flush given up while it waits
        // (shutdown, a stop) leaves them held, to be sent, not dropped.
        let mut sink = match self.sink.try_lock() {
            Ok(sink) => sink,
            Err(_) => match self.hand_off_or_wait().await {
                Some(sink) => sink,
                None => return Ok(()),
            },
        };
        let mut batch = std::mem::take(&mut *self.pending.lock());
        let r = sink.write(&batch).await;
        drop(sink);
        // The replies (and the credits they hold) go now, as they always
        // did; their room stays for the next read's replies. Until
        // 2026-11-26 every flush left an empty vector behind, which grew
        // again by doubling: a realloc chain per read (`perf record
        // --call-graph dwarf` of NVMe/TCP reads put glibc's
        // `malloc_consolidate` at 0.5% of the target's cycles).
        batch.clear();
        let mut pending = self.pending.lock();
        if pending.is_empty() {
            std::mem::swap(&mut *pending, &mut batch);
        }
        r
    }

    /// With the socket's writer busy: hands the held replies to it (`None`),
    /// or waits for the socket's lock (`Some`) when too many replies
    /// without a credit wait there already.
    async fn hand_off_or_wait(&self) -> Option<tokio::sync::MutexGuard<'_, SinkState<W, E>>> {
        let local = local_replies(&self.pending.lock());
        // Replies the front end made itself hold no credit, so nothing
        // else bounds how many wait for the writer: past a bound the
        // reader waits for the socket's writer (and so for the client
        // to read) before it reads more. Until 2026-11-29 they all went
        // to the writer's unbounded queue, and an NVMe/TCP host that
        // stopped reading during a large read's answer and went on
        // sending commands the target refuses itself (namespace 0) grew
        // its memory without end: 256 MiB of such commands taken in a
        // second (tests/nvme.rs,
        // `a_host_that_reads_nothing_cannot_queue_answers_without_end`).
        if local > 0 && self.handed.load(Relaxed) + local > MAX_LOCAL_HANDED {
            return Some(self.sink.lock().await);
        }
        let batch = std::mem::take(&mut *self.pending.lock());
        self.hand_off(batch);
        None
    }

    /// A queue slot and, for requests that move data, byte budget (the
    /// connection's, the volume's share of the server's, the server's), if
    /// all are free now; the budget comes out of `paid` when it holds it.
    fn credit_now(&self, volume: &Volume, bytes: u64, paid: &mut Option<Prepaid>) -> Option<Credit> {
        let c = &self.credits;
        let mut held = Held::new(c);
        held.slot = c.slots.try_take(1);
        if !held.slot {
            return None;
        }
        if bytes > 0
            && !Prepaid::draw(paid, &mut held, volume, bytes)
            && !self.budget_now(&mut held, volume, bytes)
        {
            return None;
        }
        Some(Credit::new(held))
    }

    /// Waits for a queue slot and, for requests that move data, byte budget
    /// (out of `paid` when it holds it); the replies held are sent first
    /// whenever it must wait (they are what would free it). Cancelled
    /// half-way, it gives back what it took.
    async fn credit(&self, volume: &Volume, bytes: u64, paid: &mut Option<Prepaid>) -> io::Result<Credit> {
        let c = &self.credits;
        let mut held = Held::new(c);
        if !c.slots.try_take(1) {
            self.flush().await?;
            c.slots.take(1).await;
        }
        held.slot = true;
        if bytes > 0 && !Prepaid::draw(paid, &mut held, volume, bytes) {
            // Not out of what the frame holds: what is left of it goes back
            // before waiting, so that nobody waits for budget while holding
            // some (two such readers could wait on each other for good).
            *paid = None;
            self.budget(&mut held, volume, bytes).await?;
        }
        Ok(Credit::new(held))
    }

    /// Holds the budget of a frame of `bytes` whose payload is still
    /// arriving, before it is read: the credits of the writes it carries
    /// take it over ([`Prepaid`]). Waits as a request's credit would, the
    /// replies held sent first. None for a write `volume` will refuse
    /// (read-only, too long, past the end: `range`, when at hand): as such a
    /// request holds no budget when it is decoded, it holds none before.
    pub async fn prepay(
        &self,
        volume: &Volume,
        range: Option<(u64, u64)>,
        bytes: u64,
    ) -> io::Result<Option<Prepaid>> {
        if !volume.takes_write(range, &self.limits) {
            return Ok(None);
        }
        let mut held = Held::new(&self.credits);
        self.budget(&mut held, volume, bytes).await?;
        Ok(Some(Prepaid(held)))
    }

    /// The byte budget of `bytes` into `held`, if all of it is free now.
    fn budget_now(&self, held: &mut Held, volume: &Volume, bytes: u64) -> bool {
        let c = &self.credits;
        let units = c.budget.units(bytes);
        if !c.budget.units.try_take(units as usize) {
            return false;
        }
        held.units = units;
        let share = volume.payload_share();
        let volume_units = share.units(bytes);
        if !share.units.try_take(volume_units as usize) {
            return false;
        }
        held.volume = Some((share.clone(), volume_units));
        let server_units = c.server.units(bytes);
        if !c.server.units.try_take(server_units as usize) {
            return false;
        }
        held.server_units = server_units;
        true
    }

    /// The byte budget of `bytes` into `held`: the connection's, then the
    /// volume's share, then the server's (always in this order, so that a
    /// request waiting on a stalled volume holds none of the server's).
    async fn budget(&self, held: &mut Held, volume: &Volume, bytes: u64) -> io::Result<()> {
        let c = &self.credits;
        let units = c.budget.units(bytes);
        self.share(&c.budget, units).await?;
        held.units = units;
        let share = volume.payload_share();
        let volume_units = share.units(bytes);
        self.share(share, volume_units).await?;
        held.volume = Some((share.clone(), volume_units));
        let server_units = c.server.units(bytes);
        self.share(&c.server, server_units).await?;
        held.server_units = server_units;
        Ok(())
    }

    /// `units` of `budget`; the replies held are sent first when it must wait.
    async fn share(&self, budget: &Budget, units: u32) -> io::Result<()> {
        if budget.units.try_take(units as usize) {
            return Ok(());
        }
        self.flush().await?;
        budget.units.take(units as usize).await;
        Ok(())
    }
}

impl<W, E: Encoder> Dispatcher<W, E> {
    /// Hands `batch` to the writer task, counting its replies without a credit.
    fn hand_off(&self, batch: Batch<E>) {
        if !batch.is_empty() {
            self.handed.fetch_add(local_replies(&batch), Relaxed);
            let _ = self.tx.send(batch);
        }
    }
}

impl<W, E: Encoder> Drop for Dispatcher<W, E> {
    fn drop(&mut self) {
        // A connection that ends mid-read: what it submitted starts now.
        for v in self.unkicked.get_mut().drain(..) {
            v.kick();
        }
        let p = std::mem::take(&mut *self.pending.lock());
        self.hand_off(p);
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static, E: Encoder> Writer<W, E> {
    /// Writes every batch handed over, gathering those that are ready into
    /// one write, until every sender (the dispatcher and the requests in
    /// flight) is gone; then shuts the write side down.
    pub async fn run(mut self) -> io::Result<()> {
        let mut batch = Vec::with_capacity(MAX_REPLIES_PER_WRITE);
        while let Some(first) = self.rx.recv().await {
            batch.extend(first);
            while batch.len() < MAX_REPLIES_PER_WRITE {
                match self.rx.try_recv() {
                    Ok(r) => batch.extend(r),
                    Err(_) => break,
                }
            }
            // Out of the queue (what the dispatcher counts): in hand now.
            self.handed.fetch_sub(local_replies(&batch), Relaxed);
            self.sink.lock().await.write(&batch).await?;
            batch.clear();
        }
        // Bounded like every write: a TLS stream's shutdown writes its
        // close_notify, which waits for room a peer that stopped reading
        // never makes (the connection's socket is reset after this).
        let mut sink = self.sink.lock().await;
        let stall = sink.stall;
        match tokio::time::timeout(stall, sink.w.shutdown()).await {
            Ok(r) => r,
            Err(_) => {
                sink.abandon(&stalled());
                Err(stalled())
            }
        }
    }
}

/// Accounts for an op's result: the bytes it moved (`moves`: read, written),
/// or the failure, counted and logged.
fn account(
    result: Result<Outcome, Refusal>,
    (read, written): (u64, u64),
    stats: &Stats,
    at: Where<'_>,
    logged: &Logged,
) -> Result<Outcome, Refusal> {
    match &result {
        Ok(_) => stats.moved(read, written),
        Err(e) => {
            stats.refused_request(e);
            at.log(e, logged);
        }
    }
    result
}

/// Which request a log line is about.
struct Where<'a> {
    peer: &'a str,
    volume: &'a str,
    tag: u64,
    kind: Option<IoKind>,
}

impl Where<'_> {
    /// The one place a refused or failed request is logged: device errors
    /// at `warn` (every one up to [`LOGGED_DEVICE_ERRORS`] per connection,
    /// then one in [`DEVICE_ERROR_EVERY`]), a client's bad requests at
    /// `info` (up to [`LOGGED_REFUSALS`] per connection, then at `debug`).
    fn log(&self, r: &Refusal, logged: &Logged) {
        let Where { peer, volume, tag, kind } = *self;
        let command = kind.map_or("(undecoded)", IoKind::name);
        if matches!(r, Refusal::Device(_)) {
            let n = logged.device_errors.fetch_add(1, Relaxed) + 1;
            if n <= LOGGED_DEVICE_ERRORS || n.is_multiple_of(DEVICE_ERROR_EVERY) {
                warn!(%peer, volume, tag, command, device_errors = n, "request failed: {r}");
            } else {
                debug!(%peer, volume, tag, command, device_errors = n, "request failed: {r}");
            }
        } else if logged.refusals.fetch_add(1, Relaxed) < LOGGED_REFUSALS {
            info!(%peer, volume, tag, command, "request refused: {r}");
        } else {
            debug!(%peer, volume, tag, command, "request refused: {r}");
        }
    }
}

/// The error of a reply write (or the stream's shutdown) that made no
/// progress for the stall timeout.
fn stalled() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "peer stopped reading replies")
}

/// The error of a dispatch on a stopped connection.
fn stopped() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "connection stopped")
}

/// Writes every slice; a peer that accepts nothing for `stall` is cut off,
/// so a client that stops reading its replies cannot hold a connection forever.
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
    stall: Duration,
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        // Try once without a timer (the usual case: the socket has room); arm
        // the stall timer only when the write has to wait.
        let n = match futures::FutureExt::now_or_never(w.write_vectored(bufs)) {
            Some(r) => r?,
            None => match tokio::time::timeout(stall, w.write_vectored(bufs)).await {
                Ok(r) => r?,
                Err(_) => return Err(stalled()),
            },
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies as one byte each, for a dispatcher under test.
    struct Plain;

    impl Encoder for Plain {
        type Meta = ();
        fn encode(&mut self, _: &Reply<()>, scratch: &mut Vec<u8>) -> Encoded {
            scratch.push(0);
            let end = scratch.len();
            Encoded { head: end - 1..end, data: None, tail: end..end }
        }
    }

    /// A write that finds too little of its frame's hold gives the rest back
    /// before it waits for fresh budget: nobody waits for budget while
    /// holding some (two readers that did could wait on each other for
    /// good). Here the one holding the rest of the server's budget is the
    /// hold itself: kept, the wait would never end.
    #[tokio::test]
    async fn a_write_gives_back_its_frames_hold_before_it_waits_for_more() {
        let env = Arc::new(ConnEnv {
            stats: Arc::new(Stats::default()),
            shutdown: CancellationToken::new(),
            queue_depth: 8,
            serial: false,
            handshake_timeout: Duration::from_secs(5),
            poll_window: Duration::ZERO,
            coalesce_window: Duration::ZERO,
            stall_timeout: Duration::from_secs(5),
            slots: Arc::new(tokio::sync::Semaphore::new(4)),
            budget: Budget::new(8 << 20),
            access: Default::default(),
        });
        let mem = Arc::new(crate::backend::MemoryBackend::new(16 << 20));
        let v = Arc::new(Volume::with_backend("v".into(), mem.clone(), 16 << 20));
        let limits = Limits { align: 1, max_io: 16 << 20, read_only: false };
        let activity = crate::fence::Activity::new();
        let (d, writer) =
            Dispatcher::new(env.clone(), limits, "test".into(), tokio::io::sink(), Plain, activity);
        tokio::spawn(writer.run());
        let mut paid = d.prepay(&v, Some((0, 6 << 20)), 6 << 20).await.unwrap();
        assert!(paid.is_some());
        assert_eq!(env.budget.in_use(), 6 << 20, "the frame's budget is held");
        let data = bytes::Bytes::from(vec![7u8; 7 << 20]);
        let req =
            Ok(IoRequest { kind: IoKind::Write, offset: 0, length: 7 << 20, fua: false, payload: data });
        let done = tokio::time::timeout(Duration::from_secs(5), d.dispatch(&v, 1, (), req, &mut paid)).await;
        done.expect("waited for budget while holding the rest of it").unwrap();
        assert!(paid.is_none(), "the hold went back");
        d.flush().await.unwrap();
        let mut back = vec![0u8; 4096];
        crate::backend::Backend::read_at(&*mem, &mut back, (7 << 20) - 4096).unwrap();
        assert_eq!(back, vec![7u8; 4096], "the write landed");
    }

    /// A taker waits until enough comes back; one whose wait is cancelled
    /// takes nothing; what a request held comes back whole when it is
    /// dropped, also when it held only part (a wait cancelled half-way).
    #[tokio::test]
    async fn tokens_come_back_to_waiters_and_from_whatever_a_request_held() {
        let t = Arc::new(Tokens::new(4));
        assert!(t.try_take(3));
        assert!(!t.try_take(2), "one left");
        let waiter = tokio::spawn({
            let t = t.clone();
            async move { t.take(2).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while one is free");
        t.give(3);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken").unwrap();
        assert_eq!(t.available(), 2);
        // Cancelled while waiting: nothing taken, no waiter left counted.
        assert!(tokio::time::timeout(Duration::from_millis(20), t.take(3)).await.is_err());
        assert_eq!((t.available(), t.waiting.load(SeqCst)), (2, 0));

        // First come, first served: while a large taker waits, small ones
        // do not take what comes back ahead of it.
        let large = tokio::spawn({
            let t = t.clone();
            async move { t.take(4).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!t.try_take(1), "a small taker waits behind the large one");
        t.give(2);
        tokio::time::timeout(Duration::from_secs(5), large).await.expect("served first").unwrap();
        assert_eq!(t.available(), 0);
        t.give(4);

        let server = Budget::new(8 << 20);
        let c = Arc::new(Credits {
            slots: Tokens::new(2),
            depth: 2,
            budget: Budget::new(64 << 20),
            server: server.clone(),
            stats: Arc::default(),
        });
        let mut held = Held::new(&c);
        assert!(c.slots.try_take(1));
        held.slot = true;
        assert!(c.budget.units.try_take(512));
        held.units = 512;
        assert_eq!((c.slots.available(), c.budget.in_use()), (1, 512 << 10));
        drop(held);
        assert_eq!((c.slots.available(), c.budget.in_use(), server.in_use()), (2, 0, 0));
    }

    /// Many takers and givers at once on a small pool, on several threads:
    /// none is left waiting with tokens free (a lost wake-up would hang it
    /// past the bound), and every token comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn tokens_lose_no_wake_up_under_contention() {
        let t = Arc::new(Tokens::new(5));
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let t = t.clone();
                tokio::spawn(async move {
                    for k in 0..2000 {
                        let n = 1 + (i + k) % 3;
                        t.take(n).await;
                        if k % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                        t.give(n);
                    }
                })
            })
            .collect();
        let all = futures::future::join_all(tasks);
        for r in tokio::time::timeout(Duration::from_secs(30), all).await.expect("no taker left hanging") {
            r.unwrap();
        }
        assert_eq!((t.available(), t.waiting.load(SeqCst)), (5, 0));
    }
}
