//! A session: one opened volume over N connections.
//!
//! Each request picks the live connection with the most free credits (least
//! loaded), waits for a credit there (never more in flight than the target's
//! queue depth), gets a tag and is queued to that connection's sender. I/O
//! larger than the target's maximum transfer is split and run in parallel.
//! A lost connection is re-established in the background under the same
//! session id and slot; its requests wait for that (the target's fence) and
//! are sent again, so the caller sees an error only when the target stays
//! away past the reconnect timeout, or comes back with another volume
//! behind the name (a restarted target's empty memory volume).

use crate::conn::{Conn, Limits, Pending, Place, Submit};
use crate::handshake::Handshake;
use crate::order::{Ticket, WriteOrder};
use crate::stats::{InitiatorStats, Stats};
use crate::{BrpUrl, Error, Options};
use bytes::{Bytes, BytesMut};
use fastsan_brp::handshake::VOLUME_VOLATILE;
use fastsan_brp::request::{RequestHeader, FLAG_FUA};
use fastsan_brp::{Command, OpenInfo, Status, VolumeInfo};
use futures::future::Either;
use futures::FutureExt;
use parking_lot::{Mutex, RwLock};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit};
use tracing::{error, info, warn};

struct Shared {
    url: BrpUrl,
    opts: Options,
    info: OpenInfo,
    slots: Vec<RwLock<Option<Arc<Conn>>>>,
    /// Per slot: how many times it was re-established (its fence passed).
    epochs: Vec<AtomicU64>,
    next_tag: AtomicU64,
    stats: Arc<Stats>,
    /// Woken when a connection comes back (or the session learns it cannot).
    changed: Notify,
    /// Set when a reconnect cannot resume the session (another volume
    /// behind the name, a refusal that will not change): every request
    /// fails with it.
    ended: OnceLock<Ended>,
    order: Arc<WriteOrder>,
    /// Write tickets of requests given up while their connection was not
    /// yet fenced (their write may still land): kept, so that no later
    /// overlapping write passes them, until their slot's epoch passes.
    unfenced: Mutex<Vec<(usize, u64, Ticket)>>,
    /// Writes (WRITE, TRIM, WRITE_ZEROES) acknowledged so far, and how many
    /// of them the last successful FLUSH covered: the target restarting in
    /// between may have lost the difference.
    acked: AtomicU64,
    flushed: AtomicU64,
    /// A restarted target was resumed with acknowledged writes not yet
    /// flushed: FLUSH cannot promise them any more.
    unflushed_lost: AtomicBool,
    /// The target last seen: its instance and its host's boot; and the
    /// instance alone, read without the lock on every acknowledgement (an
    /// instance is drawn at random per process: equal means the same target).
    target: Mutex<(u64, u64)>,
    instance: AtomicU64,
}

/// Why a session cannot be resumed.
#[derive(Debug, Clone)]
enum Ended {
    /// See [`Error::VolumeReplaced`].
    Replaced { restarted: bool, volatile: bool },
    /// Another error that a new try would meet again; its text.
    Refused(String),
}

/// An opened volume. Cloning is cheap and shares the session.
#[derive(Clone)]
pub struct Volume {
    shared: Arc<Shared>,
}

/// Lists the volumes of the target at `url` (its volume part is ignored).
pub async fn list(url: &str, opts: &Options) -> Result<Vec<VolumeInfo>, Error> {
    let url = BrpUrl::parse(url)?;
    let mut all = Handshake::start(&url.endpoint, opts).await?.list().await?;
    // A URL that names a volume lists that one (and fails if there is none).
    if !url.volume.is_empty() {
        all.retain(|v| v.name == url.volume);
        if all.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{url}: the target lists no volume {:?} that this client may open",
                url.volume
            )));
        }
    }
    Ok(all)
}

impl Volume {
    /// Opens `brp://HOST:PORT/VOLUME` or `brp+unix:///VOLUME?socket=PATH`
    /// with `opts.connections` connections.
    pub async fn connect(url: &str, opts: Options) -> Result<Volume, Error> {
        let url = BrpUrl::parse(url)?;
        if url.volume.is_empty() {
            return Err(Error::InvalidArgument(format!("{url} names no volume")));
        }
        if opts.connections == 0 || opts.connections > 256 {
            return Err(Error::InvalidArgument("connections must be 1..=256".into()));
        }
        if opts.request_timeout.is_zero() {
            return Err(Error::InvalidArgument("the request timeout must be more than zero".into()));
        }
        // A session given (a restarted gateway's) is taken over: its first
        // OPEN fences every connection the predecessor left, in every slot.
        let taken_over = opts.session != 0;
        let (hs, info) = if taken_over {
            open_taking_over(&url, &opts).await?
        } else {
            open_handshake(&url, &opts, 0, 0, false).await?
        };
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let stats = Arc::new(Stats::default());
            let first = start_conn(weak, 0, 0, hs, &info, &opts, &stats);
            let mut slots = vec![RwLock::new(Some(Arc::new(first)))];
            slots.extend((1..opts.connections).map(|_| RwLock::new(None)));
            Shared {
                url,
                info,
                slots,
                epochs: (0..opts.connections).map(|_| AtomicU64::new(0)).collect(),
                opts,
                next_tag: AtomicU64::new(1),
                stats,
                changed: Notify::new(),
                ended: OnceLock::new(),
                order: Arc::new(WriteOrder::default()),
                unfenced: Mutex::new(Vec::new()),
                // A session taken over from a predecessor (a restarted
                // gateway's) may hold its writes unflushed: until a FLUSH
                // succeeds, a reboot of the target's host counts as their loss.
                acked: AtomicU64::new(u64::from(taken_over)),
                flushed: AtomicU64::new(0),
                unflushed_lost: AtomicBool::new(false),
                target: Mutex::new((info.instance, info.boot)),
                instance: AtomicU64::new(info.instance),
            }
        });
        for i in 1..shared.opts.connections {
            let conn = open_conn(&shared, i, 0).await?;
            *shared.slots[i].write() = Some(Arc::new(conn));
        }
        info!(url = %shared.url, size = info.size, connections = shared.opts.connections,
              merge = ?shared.opts.merge, session = format_args!("{:016x}", info.session), "volume open");
        Ok(Volume { shared })
    }

    pub fn info(&self) -> &OpenInfo {
        &self.shared.info
    }
    pub fn size(&self) -> u64 {
        self.shared.info.size
    }
    pub fn block_size(&self) -> u32 {
        self.shared.info.block_size
    }
    pub fn read_only(&self) -> bool {
        self.shared.info.read_only()
    }

    pub fn stats(&self) -> InitiatorStats {
        self.shared.stats.snapshot()
    }

    /// Connections up now, and the session's number of connections.
    pub fn connections(&self) -> (usize, usize) {
        let sh = &self.shared;
        let up = sh.slots.iter().filter(|s| s.read().as_ref().is_some_and(|c| c.is_alive())).count();
        (up, sh.slots.len())
    }

    /// The URL the volume was opened with.
    pub fn url(&self) -> String {
        self.shared.url.to_string()
    }

    /// Reads `len` bytes at `offset`.
    ///
    /// (Not async itself, nor [`Volume::write_bytes`]: a one-request read's
    /// future is the call's, and the several requests of a larger one are a
    /// future of their own, boxed.)
    pub fn read(&self, offset: u64, len: u64) -> impl Future<Output = Result<Bytes, Error>> + Send + '_ {
        let max = self.shared.info.max_transfer as u64;
        if len <= max {
            return Either::Left(self.read_one(offset, len as u32));
        }
        Either::Right(Box::pin(read_pieces(offset, len, max, |o, n| self.read_one(o, n as u32))))
    }

    /// One READ request of at most the target's maximum transfer.
    fn read_one(&self, offset: u64, len: u32) -> impl Future<Output = Result<Bytes, Error>> + Send + '_ {
        let h = RequestHeader::new(Command::Read, 0, 0, offset, len);
        self.call(h, Bytes::new()).map(move |r| {
            let data = r?.unwrap_or_default();
            if data.len() != len as usize {
                return Err(Error::ShortRead { asked: len as u64, got: data.len() as u64 });
            }
            Ok(data)
        })
    }

    /// Reads exactly `buf.len()` bytes at `offset` into `buf`.
    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        let data = self.read(offset, buf.len() as u64).await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`; with `fua` it is durable when this returns.
    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }

    /// As [`Volume::write_at`], without copying the data.
    pub fn write_bytes(
        &self,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_ {
        let max = self.shared.info.max_transfer as u64;
        if data.len() as u64 <= max {
            return Either::Left(self.write_one(data, offset, fua));
        }
        Either::Right(Box::pin(async move {
            all(chunks(offset, data.len() as u64, max).map(|(o, n)| {
                let at = (o - offset) as usize;
                self.write_one(data.slice(at..at + n as usize), o, fua)
            }))
            .await
            .map(drop)
        }))
    }

    /// One WRITE request of at most the target's maximum transfer.
    fn write_one(
        &self,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_ {
        let flags = if fua { FLAG_FUA } else { 0 };
        let h = RequestHeader::new(Command::Write, flags, 0, offset, data.len() as u32);
        self.call(h, data).map(|r| r.map(drop))
    }

    /// Makes every write completed before this call durable.
    pub async fn flush(&self) -> Result<(), Error> {
        self.call(RequestHeader::new(Command::Flush, 0, 0, 0, 0), Bytes::new()).await.map(drop)
    }

    /// Tells the target the range is no longer needed; what it reads after
    /// is unspecified (zeros on memory volumes and files that can punch
    /// holes): use [`Volume::write_zeroes`] for zeros.
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.ranged(Command::Trim, 0, offset, len).await
    }

    /// Makes the range read as zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        self.ranged(Command::WriteZeroes, if fua { FLAG_FUA } else { 0 }, offset, len).await
    }

    async fn ranged(&self, cmd: Command, flags: u8, offset: u64, len: u64) -> Result<(), Error> {
        // The largest u32 that is a multiple of the block size.
        let max = (u32::MAX / self.block_size() * self.block_size()) as u64;
        all(chunks(offset, len, max).map(|(o, n)| async move {
            let h = RequestHeader::new(cmd, flags, 0, o, n as u32);
            self.call(h, Bytes::new()).await
        }))
        .await
        .map(drop)
    }

    /// Sends one request and waits for its reply, as a block device would:
    /// when its connection is lost, the request waits for the target's fence
    /// (the lost connection re-established, everything it had started on the
    /// target finished) and is sent again; the caller sees an error only when
    /// no connection comes back within the reconnect timeout. Writes keep
    /// their order against earlier overlapping writes ([`WriteOrder`]).
    ///
    /// Every wait off the fast path (behind an overlapping write, for a
    /// credit or a connection, for a fence) is boxed, and the fast path takes
    /// its connection and credit without awaiting: what a request holds
    /// across its awaits stays small. With the waits inline this future was
    /// 672 bytes, moved into place and spread over more cache lines per
    /// request in flight, which showed at 512 requesters (docs/benchmarks.md).
    // An async block, not an async fn: its arguments are held once, not twice.
    #[allow(clippy::manual_async_fn)]
    fn call(&self, h: RequestHeader, payload: Bytes) -> impl Future<Output = Reply> + Send + '_ {
        async move {
            let sh = &self.shared;
            // An earlier overlapping write may be in flight (a reply on its way)
            // or waiting for its fence: both end within these two timeouts.
            let writes = matches!(h.command, Command::Write | Command::Trim | Command::WriteZeroes);
            let ticket = match writes {
                true => {
                    let (ticket, blocked) = sh.order.clone().enter(h.offset, h.length as u64);
                    if blocked {
                        let until = Instant::now() + sh.opts.request_timeout + sh.opts.reconnect_timeout;
                        Box::pin(ticket.wait(until)).await.map_err(|_| Error::Unreachable {
                            cause: Some(
                                "an earlier write to the same bytes is still waiting for its target".into(),
                            ),
                            reconnect: sh.opts.reconnect_timeout,
                        })?;
                    }
                    Some(ticket)
                }
                false => None,
            };
            let flushed_upto = sh.acked.load(SeqCst);
            // The first try, when a credit is free now: nothing but the reply awaited.
            if h.command == Command::Flush {
                self.check_unflushed()?;
            }
            let mut tries = Tries { sh, unfenced: None, answered_by: (0, 0), ticket, reply: None };
            let result = match self.try_pick() {
                Some((conn, credit)) => {
                    tries.answered_by = conn.target;
                    let (result, sent) = match self.send(&conn, h, payload.clone(), credit) {
                        Ok(rx) => {
                            // Awaited in place (an async fn's future would add its own state).
                            let r = (&mut tries.reply.insert((rx, conn.slot, conn.epoch)).0).await;
                            tries.reply = None;
                            (r.unwrap_or(Err(Error::ConnectionLost)), true)
                        }
                        Err(e) => (Err(e), false),
                    };
                    match again(&result) {
                        None => result,
                        Some(_) => {
                            Box::pin(self.retry(h, &payload, Some((conn, result, sent)), &mut tries)).await
                        }
                    }
                }
                None => Box::pin(self.retry(h, &payload, None, &mut tries)).await,
            };
            // The outcome is known: nothing left for the drop to hand on.
            let (unfenced, answered_by, ticket) =
                (tries.unfenced.take(), tries.answered_by, tries.ticket.take());
            drop(tries);
            match (&result, unfenced, ticket) {
                // A FUA write is durable already: nothing for a restart to lose.
                (Ok(_), _, _) if writes && !h.is_fua() => {
                    sh.acked.fetch_add(1, SeqCst);
                    // Acknowledged by a host that has rebooted since (and the
                    // reconnect that saw it counted before this write).
                    if answered_by.0 != sh.instance.load(SeqCst)
                        && host_rebooted(answered_by.1, sh.target.lock().1)
                    {
                        sh.unflushed_lost.store(true, SeqCst);
                    }
                }
                (Ok(_), _, _) if h.command == Command::Flush => {
                    // Only a flush by the target of now covers what it holds.
                    if answered_by.0 == sh.instance.load(SeqCst) {
                        sh.flushed.fetch_max(flushed_upto, SeqCst);
                    }
                    self.check_unflushed()?;
                }
                // Given up while its connection was not fenced: its write may still land.
                (Err(_), Some((slot, epoch)), Some(t)) => keep_until_fenced(sh, slot, epoch, t),
                _ => {}
            }
            result
        }
    }

    /// [`Volume::call`]'s tries after the first (`first`: its connection,
    /// outcome, and whether it left: a connection found closed as it was
    /// handed over never sent it): on a lost connection, wait for its fence
    /// and send again; on a digest error, send again; until the reconnect
    /// timeout. `tries` says how the last one went.
    async fn retry(
        &self,
        h: RequestHeader,
        payload: &Bytes,
        mut first: Option<(Arc<Conn>, Reply, bool)>,
        tries: &mut Tries<'_>,
    ) -> Reply {
        let sh = &self.shared;
        // Why the last lost connection was lost, for the error if it gives up.
        let mut cause: Option<String> = None;
        // When the reconnect timeout of its first failed try runs out.
        let mut deadline: Option<Instant> = None;
        loop {
            let (conn, result, sent) = match first.take() {
                Some(first) => first,
                None => {
                    if h.command == Command::Flush {
                        self.check_unflushed()?;
                    }
                    let (conn, credit) = match self.try_pick() {
                        Some(c) => c,
                        None => self.pick(deadline).await.map_err(|e| gave_up(e, &cause, sh))?,
                    };
                    tries.unfenced = None;
                    tries.answered_by = conn.target;
                    match self.send(&conn, h, payload.clone(), credit) {
                        Ok(reply) => {
                            let r = (&mut tries.reply.insert((reply, conn.slot, conn.epoch)).0).await;
                            tries.reply = None;
                            (conn, r.unwrap_or(Err(Error::ConnectionLost)), true)
                        }
                        Err(e) => (conn, Err(e), false),
                    }
                }
            };
            let Some(lost) = again(&result) else {
                return result;
            };
            // Only a request that left may still land: one its connection
            // never took needs no fence (and, without reconnection, ends
            // no session).
            let lost = lost && sent;
            if lost {
                tries.unfenced = Some((conn.slot, conn.epoch));
                cause = conn.cause().or(cause);
            }
            let until = *deadline.get_or_insert_with(|| Instant::now() + sh.opts.reconnect_timeout);
            if sh.opts.reconnect_timeout.is_zero() || Instant::now() >= until {
                return result.map_err(|e| gave_up(e, &cause, sh));
            }
            if !sent {
                tokio::task::yield_now().await; // until the closed connection is seen as dead
            }
            if lost {
                self.fence(&conn, until).await.map_err(|e| gave_up(e, &cause, sh))?;
                tries.unfenced = None;
            }
            sh.stats.retries.fetch_add(1, Relaxed);
        }
    }

    /// Whether the target's host restarted while writes it had acknowledged
    /// were not yet flushed: they may be lost (every FLUSH fails from then
    /// on, and a read may return what was there before them).
    pub fn lost_unflushed_writes(&self) -> bool {
        self.shared.unflushed_lost.load(SeqCst)
    }

    /// Fails when a restarted target was resumed with writes acknowledged
    /// but not flushed: durability of those can no longer be promised.
    fn check_unflushed(&self) -> Result<(), Error> {
        if self.shared.unflushed_lost.load(SeqCst) {
            return Err(Error::UnflushedWritesLost { volume: self.shared.url.volume.clone() });
        }
        Ok(())
    }

    /// Sends `h` on `conn`; the reply comes on the receiver.
    fn send(
        &self,
        conn: &Conn,
        mut h: RequestHeader,
        payload: Bytes,
        credit: OwnedSemaphorePermit,
    ) -> Result<oneshot::Receiver<Reply>, Error> {
        h.tag = self.shared.next_tag.fetch_add(1, Relaxed);
        let (done, reply) = oneshot::channel();
        self.shared.stats.requests.fetch_add(1, Relaxed);
        let s = Submit { header: h, payload, pending: Pending { done, _credit: credit } };
        if conn.submit(s).is_err() {
            return Err(Error::ConnectionLost);
        }
        Ok(reply)
    }

    /// Waits until `lost`'s slot is re-established: the target answers a
    /// reconnect only after everything the lost connection had started is
    /// finished, so a request sent after this cannot be overtaken by it.
    async fn fence(&self, lost: &Conn, until: Instant) -> Result<(), Error> {
        self.wait_until(until, |sh| (sh.epochs[lost.slot].load(SeqCst) > lost.epoch).then_some(())).await
    }

    /// The least-loaded live connection and a credit on it, if that is free
    /// now (and the session goes on): [`Volume::pick`] without waiting.
    fn try_pick(&self) -> Option<(Arc<Conn>, OwnedSemaphorePermit)> {
        let sh = &self.shared;
        if sh.ended.get().is_some() {
            return None;
        }
        let c = best(sh)?;
        let permit = c.credits.clone().try_acquire_owned().ok()?;
        Some((c, permit))
    }

    /// The least-loaded live connection and a credit on it; waits for one to
    /// come back until `deadline` (or the reconnect timeout from now).
    async fn pick(&self, deadline: Option<Instant>) -> Result<(Arc<Conn>, OwnedSemaphorePermit), Error> {
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.shared.opts.reconnect_timeout);
        loop {
            let c = self.wait_until(deadline, best).await?;
            match c.credits.clone().acquire_owned().await {
                Ok(permit) => return Ok((c, permit)),
                Err(_) => continue, // it died while we waited: pick again
            }
        }
    }

    /// Waits until `check` finds what it looks for, re-checking whenever a
    /// connection comes or goes; fails at `until`, or when the session ended.
    async fn wait_until<T>(&self, until: Instant, check: impl Fn(&Shared) -> Option<T>) -> Result<T, Error> {
        let sh = &self.shared;
        loop {
            let changed = sh.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(e) = sh.ended.get() {
                return Err(ended_error(sh, e));
            }
            if let Some(found) = check(sh) {
                return Ok(found);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::ConnectionLost);
            }
            let _ = tokio::time::timeout(left, changed).await;
        }
    }
}

/// A request's outcome: its reply's data, if any.
type Reply = Result<Option<Bytes>, Error>;

/// How a request's tries went, for what [`Volume::call`] does after them.
struct Tries<'a> {
    sh: &'a Arc<Shared>,
    /// The slot and epoch of a lost connection whose fence it did not see.
    unfenced: Option<(usize, u64)>,
    /// The target (instance, boot) that answered the last try.
    answered_by: (u64, u64),
    /// A write's place among overlapping writes, until its outcome is known.
    ticket: Option<Ticket>,
    /// The try in flight: its reply to come, and its connection's slot and epoch.
    reply: Option<(oneshot::Receiver<Reply>, usize, u64)>,
}

/// A write whose caller drops it (a timeout, Ctrl-C) before its outcome
/// is known keeps its place among overlapping writes for as long as it
/// may still land: until its reply if it is in flight (and, if its
/// connection is lost, until that connection's fence), until the fence if
/// its connection was lost. (Until 2026-12-07 a write dropped in flight
/// let the next overlapping write go at once, on any connection, and the
/// dropped one could land after it.) Nothing is boxed or cloned unless the
/// request is dropped. A dropped write the target then acknowledges is not
/// counted among the session's acknowledged writes: its caller was never
/// told it succeeded.
impl Drop for Tries<'_> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else { return };
        match (self.reply.take(), self.unfenced) {
            (Some((rx, slot, epoch)), _) => match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let sh = self.sh.clone();
                    rt.spawn(async move {
                        if !answered(rx.await.ok()) {
                            keep_until_fenced(&sh, slot, epoch, ticket)
                        }
                    });
                }
                // No runtime to wait in (dropped on a thread outside it):
                // released if answered already, else kept until the fence.
                Err(_) => {
                    let mut rx = rx;
                    if !answered(rx.try_recv().ok()) {
                        keep_until_fenced(self.sh, slot, epoch, ticket)
                    }
                }
            },
            (None, Some((slot, epoch))) => keep_until_fenced(self.sh, slot, epoch, ticket),
            (None, None) => {} // not in flight: never sent, or fenced already
        }
    }
}

/// Whether a try's reply (none: its connection dropped it, or it has not
/// come) says the target is done with the request: it landed, or never
/// will. A lost connection's says nothing of the sort.
fn answered(reply: Option<Reply>) -> bool {
    reply.is_some_and(|r| !matches!(r, Err(Error::ConnectionLost)))
}

/// Keeps `ticket`, the place of a write sent on connection `slot`'s
/// `epoch`-th incarnation and lost with it, until that slot is fenced: the
/// write may still land until then, so overlapping writes stay behind it
/// (checked under the lock: the reconnect that fences it may have run
/// already). Without reconnection nothing ever fences it, and the other
/// connections go on: a later write to the same bytes could land before it
/// and be overwritten. The session ends then (before the overlapping writes
/// behind this one are let go), so nothing more is sent; until 2026-12-07
/// they were sent.
fn keep_until_fenced(sh: &Shared, slot: usize, epoch: u64, ticket: Ticket) {
    if sh.opts.reconnect_timeout.is_zero() {
        let _ = sh.ended.set(Ended::Refused(
            "a write's connection was lost with reconnection off (--reconnect-timeout 0): \
             the write may still land, so the session sends nothing more; open the volume again"
                .into(),
        ));
        sh.changed.notify_waiters();
        drop(ticket);
        return;
    }
    let mut parked = sh.unfenced.lock();
    if sh.epochs[slot].load(SeqCst) <= epoch && sh.ended.get().is_none() {
        parked.push((slot, epoch, ticket));
    }
}

/// The error of a request that gives up: a lost connection says why it was
/// lost (`cause`: the last lost connection's, when known) and that none came
/// back ([`Error::Unreachable`]); other errors are its own.
fn gave_up(e: Error, cause: &Option<String>, sh: &Shared) -> Error {
    match e {
        Error::ConnectionLost => {
            Error::Unreachable { cause: cause.clone(), reconnect: sh.opts.reconnect_timeout }
        }
        other => other,
    }
}

/// Whether a try's outcome calls for another: `Some(true)` when its
/// connection was lost (send again after the fence), `Some(false)` when the
/// target refused it untouched (a digest broke on the way in) or the
/// reply's data broke on the way back (send again), `None` when it is final.
fn again(result: &Reply) -> Option<bool> {
    match result {
        Err(Error::ConnectionLost) => Some(true),
        Err(Error::Status(s)) if *s == Status::DIGEST_MISMATCH => Some(false),
        Err(Error::DigestMismatch) => Some(false),
        _ => None,
    }
}

/// The live connection with the most free credits (the least loaded).
/// (Ties go to the later slot.) Only the one chosen is cloned.
fn best(sh: &Shared) -> Option<Arc<Conn>> {
    let mut best: Option<(usize, Arc<Conn>)> = None;
    for slot in &sh.slots {
        let conn = slot.read();
        if let Some(c) = conn.as_ref().filter(|c| c.is_alive()) {
            let free = c.credits.available_permits();
            if best.as_ref().is_none_or(|(most, _)| free >= *most) {
                best = Some((free, c.clone()));
            }
        }
    }
    best.map(|(_, c)| c)
}

/// Whether the target's host went down between two boots seen: a process
/// restart keeps the kernel's page cache (a kill -9 loses no acknowledged
/// write, a graceful stop flushes), a reboot may not. An unknown boot (0)
/// is taken for a reboot.
fn host_rebooted(before: u64, now: u64) -> bool {
    before != now || now == 0
}

fn ended_error(sh: &Shared, e: &Ended) -> Error {
    match e {
        Ended::Replaced { restarted, volatile } => Error::VolumeReplaced {
            volume: sh.url.volume.clone(),
            restarted: *restarted,
            volatile: *volatile,
        },
        Ended::Refused(why) => Error::SessionEnded(why.clone()),
    }
}

/// Runs every future to its end (none is abandoned while in flight: a
/// chunk left running could race the caller's next write), then gives their
/// results in order, or the first error.
pub(crate) async fn all<T>(
    futs: impl Iterator<Item = impl std::future::Future<Output = Result<T, Error>>>,
) -> Result<Vec<T>, Error> {
    futures::future::join_all(futs).await.into_iter().collect()
}

/// Reads `[offset, offset + len)` as pieces of at most `max` bytes, all in
/// flight at once ([`all`]), joined in order.
pub(crate) async fn read_pieces<F, Fut>(offset: u64, len: u64, max: u64, read: F) -> Result<Bytes, Error>
where
    F: Fn(u64, u64) -> Fut,
    Fut: std::future::Future<Output = Result<Bytes, Error>>,
{
    let parts = all(chunks(offset, len, max).map(|(o, n)| read(o, n))).await?;
    let mut out = BytesMut::with_capacity(len as usize);
    for p in parts {
        out.extend_from_slice(&p);
    }
    Ok(out.freeze())
}

/// Cuts `[offset, offset + len)` into pieces of at most `max` bytes.
pub(crate) fn chunks(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |i| {
        let o = i * max;
        (offset + o, max.min(len - o))
    })
}

fn start_conn(
    shared: &Weak<Shared>,
    slot: usize,
    epoch: u64,
    hs: Handshake,
    info: &OpenInfo,
    opts: &Options,
    stats: &Arc<Stats>,
) -> Conn {
    let limits = Limits {
        mode: opts.merge,
        max_batch: info.max_batch.max(1) as usize,
        merge_max_request: opts.merge_max_request,
        queue_depth: info.queue_depth,
        merge_max_bytes: opts.merge_max_bytes.min(fastsan_brp::limits::MAX_PAYLOAD / 2),
        alone: opts.connections == 1,
    };
    let weak = shared.clone();
    let on_dead = Box::new(move || {
        if let Some(sh) = weak.upgrade() {
            // Wake requests waiting on this connection: they go elsewhere or wait for the fence.
            sh.changed.notify_waiters();
            if !sh.opts.reconnect_timeout.is_zero() {
                tokio::spawn(reconnect(Arc::downgrade(&sh), slot));
            }
        }
    });
    let place =
        Place { slot, epoch, request_timeout: opts.request_timeout, target: (info.instance, info.boot) };
    Conn::start(hs, place, limits, stats.clone(), on_dead)
}

/// Opens connection `slot` of the session (its `epoch`-th time) and checks
/// that the volume behind the name is still the one the session opened.
async fn open_conn(sh: &Arc<Shared>, slot: usize, epoch: u64) -> Result<Conn, Error> {
    let (hs, info) = open_handshake(&sh.url, &sh.opts, sh.info.session, slot as u16, false).await?;
    let old = &sh.info;
    if info.generation != old.generation {
        let volatile = old.flags & VOLUME_VOLATILE != 0;
        return Err(Error::VolumeReplaced {
            volume: sh.url.volume.clone(),
            restarted: info.instance != old.instance,
            volatile,
        });
    }
    if info.size != old.size || info.block_size != old.block_size {
        return Err(Error::VolumeChanged {
            old_size: old.size,
            new_size: info.size,
            old_block_size: old.block_size,
            new_block_size: info.block_size,
        });
    }
    // A target that put the connection in another session fenced nothing
    // of this one's (a fastsan takes a session it does not know as given);
    // one that lowered its transfer limit would refuse the requests this
    // session cuts by the old one.
    if info.session != old.session {
        return Err(Error::SessionEnded(format!(
            "the target answered the reconnect in session {:016x}, not this one's {:016x}: \
             nothing it fenced covers this session's lost writes",
            info.session, old.session
        )));
    }
    if info.max_transfer < old.max_transfer {
        return Err(Error::SessionEnded(format!(
            "the target's transfer limit fell from {} to {} bytes across the reconnect",
            old.max_transfer, info.max_transfer
        )));
    }
    let mut target = sh.target.lock();
    if *target != (info.instance, info.boot) {
        let rebooted = host_rebooted(target.1, info.boot);
        *target = (info.instance, info.boot);
        sh.instance.store(info.instance, SeqCst);
        if rebooted && sh.acked.load(SeqCst) > sh.flushed.load(SeqCst) {
            sh.unflushed_lost.store(true, SeqCst);
            warn!(url = %sh.url, "the target's host restarted with writes acknowledged but not flushed: \
                  they may be lost, and every FLUSH of this session fails from now on");
        } else {
            info!(url = %sh.url, slot, rebooted, "the target restarted; the volume's data is the same one (same generation): resuming");
        }
    }
    drop(target);
    Ok(start_conn(&Arc::downgrade(sh), slot, epoch, hs, &info, &sh.opts, &sh.stats))
}

/// Connects and opens the URL's volume as connection `slot` of `session`,
/// all within the connect timeout.
async fn open_handshake(
    url: &BrpUrl,
    opts: &Options,
    session: u64,
    slot: u16,
    takeover: bool,
) -> Result<(Handshake, OpenInfo), Error> {
    let work = async {
        let mut hs = Handshake::start(&url.endpoint, opts).await?;
        let info = hs.open(&url.volume, session, slot, takeover).await?;
        Ok((hs, info))
    };
    tokio::time::timeout(opts.connect_timeout, work).await.map_err(|_| Error::Timeout("handshake"))?
}

/// The first OPEN of a session taken over (a restarted gateway's): the
/// target answers it once the predecessor's work has finished (the fence),
/// which a stalled device can make longer than the connect timeout (or
/// than the target's own handshake timeout, after which it closes the
/// connection). A try that fails so, or with any error a new try may not
/// meet, is made again (each one a takeover; the predecessor's connections
/// are stopped already) until the reconnect timeout, as a lost
/// connection's reconnects are. Until 2026-11-29 a fence longer than 10 s
/// failed the gateway's start.
async fn open_taking_over(url: &BrpUrl, opts: &Options) -> Result<(Handshake, OpenInfo), Error> {
    let until = Instant::now() + opts.reconnect_timeout;
    loop {
        match open_handshake(url, opts, opts.session, 0, true).await {
            Err(e) if e.is_retryable() && Instant::now() < until => {
                warn!(
                    %url,
                    "the session's takeover failed ({e}): the target may still be finishing its \
                     predecessor's work (the fence); trying again"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            r => return r,
        }
    }
}

/// Re-opens connection `slot` until it works, the volume is dropped, or the
/// target turns out to hold another volume under the name.
async fn reconnect(weak: Weak<Shared>, slot: usize) {
    let mut backoff = Duration::from_millis(20);
    // Since when the address has answered with garbage, if it does.
    let mut garbage_since: Option<Instant> = None;
    // Failed tries are said once, then every 10 s (each connection retries
    // every second: a target down for a minute filled the log).
    let mut tries = 0u32;
    let mut said: Option<Instant> = None;
    let mut due = || {
        let now = Instant::now();
        let due = said.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10));
        if due {
            said = Some(now);
        }
        due
    };
    loop {
        tokio::time::sleep(backoff).await;
        let Some(sh) = weak.upgrade() else { return };
        let epoch = sh.epochs[slot].load(SeqCst) + 1;
        match open_conn(&sh, slot, epoch).await {
            Ok(conn) => {
                *sh.slots[slot].write() = Some(Arc::new(conn));
                sh.epochs[slot].store(epoch, SeqCst);
                // Writes given up on that slot's lost connection are fenced now.
                sh.unfenced.lock().retain(|(s, e, _)| *s != slot || *e >= epoch);
                sh.stats.reconnects.fetch_add(1, Relaxed);
                sh.changed.notify_waiters();
                info!(url = %sh.url, slot, "connection re-established");
                return;
            }
            // Garbage instead of a handshake means something else answered
            // at the address (a relay's error text, a process still
            // starting): the target may be back soon, so keep trying, for
            // as long as requests wait for it (the reconnect timeout).
            Err(e)
                if matches!(e, Error::Protocol(_) | Error::UnexpectedMessage { .. })
                    && garbage_since.get_or_insert_with(Instant::now).elapsed()
                        < sh.opts.reconnect_timeout =>
            {
                tries += 1;
                if due() {
                    warn!(url = %sh.url, slot, tries, error = &e as &dyn std::error::Error,
                          "no BRP handshake from the target's address; will retry");
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(e) if !e.is_retryable() => {
                error!(url = %sh.url, error = &e as &dyn std::error::Error, "session cannot be resumed");
                let ended = match e {
                    Error::VolumeReplaced { restarted, volatile, .. } => {
                        Ended::Replaced { restarted, volatile }
                    }
                    other => Ended::Refused(crate::error::chain(&other)),
                };
                let _ = sh.ended.set(ended);
                // Nothing will fence the writes given up: let overlapping ones fail on.
                sh.unfenced.lock().clear();
                sh.changed.notify_waiters();
                return;
            }
            Err(e) => {
                tries += 1;
                if due() {
                    warn!(url = %sh.url, slot, tries, error = &e as &dyn std::error::Error,
                          "reconnect failed; will retry (said again every 10 s)");
                }
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}
