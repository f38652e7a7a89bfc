//! A mirrored volume: N legs (BRP or NBD volumes on different targets)
//! holding the same data, and a dirty-region log on this host.
//!
//! The life of a request (`mutate` for writes, TRIM and WRITE_ZEROES;
//! `read`; `flush`):
//! 1. a write's regions are marked in the [`DirtyLog`], durably, before it
//!    leaves (a hot region costs nothing, concurrent writes share one update);
//! 2. it takes its regions' locks shared (a resync copying a region holds
//!    the region's lock alone, so a write never lands between the copy's
//!    read and its write);
//! 3. it goes to every leg not degraded, in parallel, and is acknowledged
//!    when all of them have it; a leg that fails it is **degraded** (its
//!    generation left behind, durably, before the write is acknowledged)
//!    and I/O goes on without it; the regions it misses are remembered;
//! 4. reads go to the in-sync leg with the fewest requests in flight; a
//!    leg that fails a read is degraded and the read tried on another.
//!
//! A background keeper probes degraded legs; one that answers with its
//! record intact is resynced: only the regions it misses are copied, from
//! an in-sync leg, rate-limited, while I/O goes on, and it is in sync again
//! when none is left (its data flushed, its record and the log updated).
//! Regions written on every leg and idle for a while are cleared from the
//! log, after a flush of every leg covered them.
//!
//! After a crash of the initiator, the open resyncs the regions dirty in
//! the log from one chosen in-sync leg to the others, which are read only
//! after that. Generations (in the log, and in a record on every leg, see
//! [`record`]) make sure a leg that missed writes is never read before its
//! resync, and refuse a leg of another mirror or one written by someone
//! with a newer log.

pub mod dirty_log;
pub mod record;
pub mod spec;

pub use dirty_log::{DirtyLog, DirtyLogError, DirtyStats, Generations, WriteIntent};
pub use spec::MirrorSpec;

use crate::error::chain;
use crate::remote::Single;
use crate::runs_to_end::RunsToEnd;
use crate::{Error, Options};
use bytes::Bytes;
use parking_lot::Mutex;
use record::{LegRecord, RECORD_SIZE};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long a region stays dirty after its last write (so that a region
/// written again soon is not cleared and set again).
const CLEAR_DELAY: Duration = Duration::from_secs(2);
/// Lock stripes: regions share a lock when equal modulo this.
const STRIPES: u64 = 1024;
/// How often the keeper looks at the legs, and publishes the status.
const TICK: Duration = Duration::from_millis(250);
/// How long a probe of a degraded leg may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LegState {
    /// Holds every acknowledged write: reads may go here.
    InSync,
    /// Gets every write; regions it missed are being copied to it.
    Resyncing,
    /// Gets nothing; waits for its target to come back.
    Degraded,
}

struct Leg {
    url: String,
    remote: Option<Single>,
    state: LegState,
    /// Regions this leg may lack (while not in sync): one bit each.
    needs: Vec<u64>,
    needed: u64,
    /// Why it is degraded, or last failed to come back.
    why: Option<String>,
    /// The session is unusable (ended, or its durability lost): the next
    /// probe opens a new one.
    fresh: bool,
    probing: bool,
    resyncing: bool,
    progress: Progress,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Progress {
    /// Regions to copy when the pass began, and copied since.
    pub total: u64,
    pub copied: u64,
    pub bytes: u64,
    /// Bytes per second over the pass.
    pub rate: f64,
}

impl Leg {
    fn needs(&self, r: u64) -> bool {
        self.needs.get((r / 64) as usize).is_some_and(|w| w >> (r % 64) & 1 == 1)
    }
    fn need(&mut self, r: u64) {
        let w = &mut self.needs[(r / 64) as usize];
        if *w >> (r % 64) & 1 == 0 {
            *w |= 1 << (r % 64);
            self.needed += 1;
        }
    }
    fn unneed(&mut self, r: u64) {
        let w = &mut self.needs[(r / 64) as usize];
        if *w >> (r % 64) & 1 == 1 {
            *w &= !(1 << (r % 64));
            self.needed -= 1;
        }
    }
    fn first_needed(&self) -> Option<u64> {
        let (i, w) = self.needs.iter().enumerate().find(|(_, w)| **w != 0)?;
        Some(i as u64 * 64 + w.trailing_zeros() as u64)
    }
}

#[derive(Default)]
struct Counters {
    degraded: AtomicU64,
    resynced_regions: AtomicU64,
    resynced_bytes: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
}

struct Inner {
    spec: MirrorSpec,
    /// The legs' session options (reconnect timeout = the failover time).
    opts: Options,
    size: u64,
    block_size: u32,
    region: u64,
    log: Arc<DirtyLog>,
    legs: Mutex<Vec<Leg>>,
    in_flight: Vec<AtomicU64>,
    leg_reads: Vec<AtomicU64>,
    /// Held while the generations change (a degrade, a resync's end).
    gen_change: tokio::sync::Mutex<()>,
    stripes: Vec<RwLock<()>>,
    /// The writes running (see `Inner::mutate`): what `close` waits for.
    writes: tokio_util::task::TaskTracker,
    counters: Counters,
    stop: CancellationToken,
}

/// A mirrored volume. Cloning is cheap and shares it; when the last clone
/// is dropped its background work stops.
#[derive(Clone)]
pub struct Mirror {
    handle: Arc<Handle>,
}

struct Handle {
    inner: Arc<Inner>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.inner.stop.cancel();
        self.inner.publish(false);
    }
}

/// What `fastsan mirror status` shows, and what a mirror's process
/// publishes next to its log every quarter second.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MirrorStatus {
    pub pid: u32,
    /// Whether a process has the mirror open (false: read from the log).
    pub open: bool,
    pub size: u64,
    pub region: u64,
    pub generation: u64,
    pub dirty: u64,
    pub legs: Vec<LegStatus>,
    pub degraded_events: u64,
    pub resynced_regions: u64,
    pub resynced_bytes: u64,
    pub log_updates: u64,
    pub log_hot: u64,
    pub writes: u64,
    pub reads: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LegStatus {
    pub url: String,
    pub state: LegState,
    /// The generation the log says the leg holds.
    pub generation: u64,
    /// Regions it lacks.
    pub needs: u64,
    pub why: Option<String>,
    pub in_flight: u64,
    pub reads: u64,
    pub resync: Option<Progress>,
}

fn mirror_err(s: impl Into<String>) -> Error {
    Error::Mirror(s.into())
}

/// An error the request itself earned (the same on any leg), not a sign
/// that the leg is failing.
fn request_error(e: &Error) -> bool {
    use fastsan_brp::Status;
    match e {
        Error::InvalidArgument(_) => true,
        Error::Status(s) => [
            Status::INVALID,
            Status::UNSUPPORTED,
            Status::OUT_OF_RANGE,
            Status::MISALIGNED,
            Status::TOO_LARGE,
        ]
        .contains(s),
        _ => false,
    }
}

async fn read_record(leg: &Single, size: u64) -> Result<Option<LegRecord>, Error> {
    let b = leg.read(size, RECORD_SIZE).await?;
    LegRecord::decode(&b).map_err(mirror_err)
}

/// Writes leg `i`'s record (durably: FUA) right after the mirror's data.
async fn write_record(
    leg: &Single,
    size: u64,
    g: &Generations,
    i: usize,
    generation: u64,
) -> Result<(), Error> {
    let rec = LegRecord { uuid: g.uuid, leg: i as u32, legs: g.legs.len() as u32, generation };
    leg.write_bytes(rec.encode(), size, true).await
}

/// A log that cannot be opened; a missing one says how to make one.
fn log_error(ms: &MirrorSpec, e: DirtyLogError) -> Error {
    match e {
        DirtyLogError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
            mirror_err(format!(
                "{} not found: make the mirror first with `fastsan mirror create` (a mirror never \
             starts without its log: the regions it marked would be forgotten)",
                ms.log.display()
            ))
        }
        e => e.into(),
    }
}

/// Opens the mirror's log (for this process alone) and checks it names as
/// many legs as the spec; a missing log says how to make one.
fn open_log(ms: &MirrorSpec) -> Result<(Arc<DirtyLog>, Generations), Error> {
    let log = DirtyLog::open(&ms.log, CLEAR_DELAY).map_err(|e| log_error(ms, e))?;
    let gens = log.generations();
    if gens.legs.len() != ms.legs.len() {
        return Err(mirror_err(format!(
            "{} is the log of a mirror of {} legs, not {}",
            ms.log.display(),
            gens.legs.len(),
            ms.legs.len()
        )));
    }
    Ok((log, gens))
}

impl Mirror {
    /// Makes a new mirror of the legs in `spec`: writes the log and every
    /// leg's record. Every leg but the first is then copied whole from the
    /// first by the open that follows, unless `assume_clean` (legs known to
    /// be identical, such as fresh zeroed volumes). Legs that carry another
    /// mirror's record are refused unless `force`.
    pub async fn create(spec: &str, opts: Options, assume_clean: bool, force: bool) -> Result<Mirror, Error> {
        let ms = MirrorSpec::parse(spec)?;
        if ms.log.exists() {
            return Err(mirror_err(format!(
                "{} exists: this mirror was made already (remove the log to make it anew)",
                ms.log.display()
            )));
        }
        let lo = leg_options(&opts, &ms);
        let legs = futures::future::join_all(ms.legs.iter().map(|u| Single::connect(u, lo.clone()))).await;
        let mut opened = Vec::new();
        for (u, l) in ms.legs.iter().zip(legs) {
            let l = l.map_err(|e| mirror_err(format!("leg {u}: {}", chain(&e))))?;
            if l.read_only() {
                return Err(mirror_err(format!("leg {u} is read-only")));
            }
            opened.push(l);
        }
        let smallest = opened.iter().map(|l| l.size()).min().unwrap_or(0);
        let size = smallest.saturating_sub(RECORD_SIZE) / RECORD_SIZE * RECORD_SIZE;
        if size == 0 {
            return Err(mirror_err(format!(
                "the smallest leg ({smallest} bytes) has no room for data and a record"
            )));
        }
        for (u, l) in ms.legs.iter().zip(&opened) {
            if let Ok(Some(r)) = read_record(l, size).await {
                if !force {
                    return Err(mirror_err(format!(
                        "leg {u} belongs to mirror {} already (leg {} of {}, generation {}): \
                         give --force to make a new mirror of it (its data will be overwritten)",
                        record::uuid_text(&r.uuid),
                        r.leg,
                        r.legs,
                        r.generation
                    )));
                }
            }
        }
        let mut uuid = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut uuid);
        let n = opened.len();
        let gens = Generations {
            uuid,
            current: 1,
            legs: (0..n).map(|i| if i == 0 || assume_clean { 1 } else { 0 }).collect(),
        };
        let log = DirtyLog::create(&ms.log, size, ms.region, &gens, !assume_clean, CLEAR_DELAY)?;
        drop(log);
        for (i, l) in opened.iter().enumerate() {
            write_record(l, size, &gens, i, gens.legs[i]).await.map_err(|e| {
                mirror_err(format!("writing the record of leg {}: {}", ms.legs[i], chain(&e)))
            })?;
        }
        info!(log = %ms.log.display(), size, legs = n, assume_clean, "mirror created");
        drop(opened);
        Mirror::open(spec, opts).await
    }

    /// Takes back leg `leg` whose volume was replaced or emptied (it carries
    /// no record; `force` also takes a leg that carries one): every region
    /// is marked dirty and the leg behind, durably, then its record is
    /// written; the open that follows copies everything to it from an
    /// in-sync leg. Refused unless another leg holds every write.
    pub async fn replace(spec: &str, opts: Options, leg: usize, force: bool) -> Result<Mirror, Error> {
        let ms = MirrorSpec::parse(spec)?;
        let url = ms.legs.get(leg).ok_or_else(|| mirror_err(format!("the mirror has no leg {leg}")))?.clone();
        let (log, mut gens) = open_log(&ms)?;
        if !(0..gens.legs.len()).any(|j| j != leg && gens.legs[j] == gens.current) {
            return Err(mirror_err(format!("no leg but {leg} holds every write: nothing to copy from")));
        }
        let l = Single::connect(&url, leg_options(&opts, &ms)).await?;
        check_leg(&l, &url, log.size())?;
        if let Some(rec) = read_record(&l, log.size()).await? {
            if !force {
                let whose = if rec.uuid == gens.uuid { "this mirror's" } else { "another mirror's" };
                return Err(mirror_err(format!(
                    "leg {leg} ({url}) carries {whose} record (generation {}): `mirror resync` brings a leg \
                     back; give --force to copy it whole anyway",
                    rec.generation
                )));
            }
        }
        // Everything dirty first, then the leg behind: a crash between
        // leaves a leg that is at worst copied whole, never one taken as a
        // copy of regions the log no longer marks.
        log.mark_all().await?;
        gens.legs[leg] = 0;
        log.set_generations(&gens).await?;
        write_record(&l, log.size(), &gens, leg, 0).await?;
        info!(leg, %url, "mirror leg replaced: it will be copied whole");
        drop((l, log));
        Mirror::open(spec, opts).await
    }

    /// Opens the mirror named by `spec` (see [`MirrorSpec`]). Legs that
    /// cannot be reached are degraded; at least one leg holding every write
    /// must answer. Regions dirty in the log are copied from one in-sync
    /// leg to the others before those are read.
    pub async fn open(spec: &str, opts: Options) -> Result<Mirror, Error> {
        let ms = MirrorSpec::parse(spec)?;
        let (log, mut gens) = open_log(&ms)?;
        log.set_naive(ms.naive);
        let size = log.size();
        let lo = leg_options(&opts, &ms);
        let conns = futures::future::join_all(ms.legs.iter().map(|u| Single::connect(u, lo.clone()))).await;
        let dirty = log.dirty();
        let regions = log.regions();
        let words = regions.div_ceil(64) as usize;
        let mut legs = Vec::new();
        let mut block_size = 512;
        for (i, (url, conn)) in ms.legs.iter().zip(conns).enumerate() {
            let mut leg = Leg {
                url: url.clone(),
                remote: None,
                state: LegState::Degraded,
                needs: vec![0; words],
                needed: 0,
                why: None,
                fresh: false,
                probing: false,
                resyncing: false,
                progress: Progress::default(),
            };
            match conn {
                Err(e) => leg.why = Some(format!("unreachable at open: {}", chain(&e))),
                Ok(r) => {
                    check_leg(&r, url, size)?;
                    match read_record(&r, size).await {
                        Err(e) => leg.why = Some(format!("its record cannot be read: {}", chain(&e))),
                        Ok(None) => {
                            // Emptied (a memory volume restarted, a volume
                            // replaced): not a copy of anything; the others serve.
                            leg.why = check_record(None, &gens, i, url).err().map(|e| e.to_string());
                        }
                        Ok(rec) => {
                            check_record(rec, &gens, i, url)?;
                            block_size = block_size.max(r.block_size());
                            leg.state = if gens.legs[i] == gens.current {
                                LegState::InSync
                            } else {
                                LegState::Resyncing
                            };
                            leg.remote = Some(r);
                        }
                    }
                }
            }
            legs.push(leg);
        }
        let Some(source) = legs.iter().position(|l| l.state == LegState::InSync) else {
            let why: Vec<String> = legs
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    format!(
                        "leg {} ({}): {}",
                        i,
                        l.url,
                        l.why.clone().unwrap_or_else(|| "missed writes".into())
                    )
                })
                .collect();
            return Err(mirror_err(format!(
                "no leg holding every write answers, so no leg can be read: {}",
                why.join("; ")
            )));
        };
        // The chosen source stays in sync; any other leg may differ from
        // it in the dirty regions (a crash left writes half done), and is
        // read only after they are copied to it.
        let mut behind = false;
        for (i, leg) in legs.iter_mut().enumerate() {
            if i != source && (!dirty.is_empty() || leg.state != LegState::InSync) {
                for r in &dirty {
                    leg.need(*r);
                }
                if leg.state == LegState::InSync {
                    leg.state = LegState::Resyncing;
                }
                behind |= gens.legs[i] == gens.current;
            }
        }
        if behind {
            gens.current += 1;
            for (i, leg) in legs.iter().enumerate() {
                if leg.state == LegState::InSync {
                    gens.legs[i] = gens.current;
                }
            }
            log.set_generations(&gens).await?;
        }
        // The in-sync legs' records say the current generation (a crash
        // may have come between the log's update and theirs).
        for (i, leg) in legs.iter().enumerate() {
            if let (LegState::InSync, Some(r)) = (leg.state, &leg.remote) {
                if let Err(e) = write_record(r, size, &gens, i, gens.current).await {
                    warn!(leg = i, error = %chain(&e), "cannot update a leg's record");
                }
            }
        }
        let n = legs.len();
        let inner = Arc::new(Inner {
            region: log.region_size(),
            spec: ms,
            opts: lo,
            size,
            block_size,
            log,
            legs: Mutex::new(legs),
            in_flight: (0..n).map(|_| AtomicU64::new(0)).collect(),
            leg_reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            gen_change: tokio::sync::Mutex::new(()),
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            writes: tokio_util::task::TaskTracker::new(),
            counters: Counters::default(),
            stop: CancellationToken::new(),
        });
        {
            let legs = inner.legs.lock();
            let states: Vec<String> = legs
                .iter()
                .map(|l| format!("{} {:?} ({} regions to copy)", l.url, l.state, l.needed))
                .collect();
            info!(log = %inner.spec.log.display(), size, legs = %states.join(", "), "mirror open");
        }
        tokio::spawn(keeper(Arc::downgrade(&inner), inner.stop.clone()));
        inner.publish(true);
        Ok(Mirror { handle: Arc::new(Handle { inner }) })
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.handle.inner
    }

    pub fn size(&self) -> u64 {
        self.inner().size
    }
    pub fn block_size(&self) -> u32 {
        self.inner().block_size
    }
    /// Legs answering, and legs in all.
    pub fn connections(&self) -> (usize, usize) {
        let legs = self.inner().legs.lock();
        (legs.iter().filter(|l| l.state != LegState::Degraded).count(), legs.len())
    }

    pub fn status(&self) -> MirrorStatus {
        self.inner().status(true)
    }
    /// Whether TRIM may be offered: unless every leg here says it cannot
    /// (a leg away may come back able to).
    pub fn can_trim(&self) -> bool {
        self.inner().legs.lock().iter().any(|l| l.remote.as_ref().is_none_or(Single::can_trim))
    }

    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        let inner = self.inner();
        inner.check_range(offset, len)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        inner.counters.reads.fetch_add(1, Relaxed);
        loop {
            let (i, leg) = inner
                .least_busy_in_sync(&inner.legs.lock())
                .ok_or_else(|| mirror_err("no leg holding every write is reachable"))?;
            // Counted down even when the caller gives up (a count left up
            // would keep reads off the leg for good).
            let counted = Counted::up(&inner.in_flight[i]);
            let r = leg.read(offset, len).await;
            drop(counted);
            match r {
                // A leg whose host restarted with writes it had not flushed
                // may answer with what was there before them: degraded (its
                // FLUSH would fail too, but only at the next one), the read
                // goes to another. Until 2026-11-29 such a read was served.
                Ok(b) if leg.lost_writes() => {
                    let volume = inner.legs.lock()[i].url.clone();
                    if let Err(e) = inner.degrade(i, &Error::UnflushedWritesLost { volume }).await {
                        // No other leg holds every write: nothing better to
                        // read from (the next FLUSH fails, as it would for a
                        // plain volume), so this one serves.
                        warn!(leg = i, error = %chain(&e), "read from a leg that may have lost writes");
                        inner.leg_reads[i].fetch_add(1, Relaxed);
                        return Ok(b);
                    }
                }
                Ok(b) => {
                    inner.leg_reads[i].fetch_add(1, Relaxed);
                    return Ok(b);
                }
                Err(e) if request_error(&e) => return Err(e),
                Err(e) => inner.degrade(i, &e).await?,
            }
        }
    }

    pub async fn write_bytes(&self, data: Bytes, offset: u64, fua: bool) -> Result<(), Error> {
        let len = data.len() as u64;
        self.inner().mutate(offset, len, Op::Write(data, fua)).await
    }
    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.inner().mutate(offset, len, Op::Trim).await
    }
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        self.inner().mutate(offset, len, Op::Zeroes(fua)).await
    }

    /// Flushes every leg that gets writes.
    pub async fn flush(&self) -> Result<(), Error> {
        self.inner().flush_all().await.map(drop)
    }

    /// A clean end: every leg flushed, and then every region whose writes
    /// are on every leg cleared from the log at once, so that the next open
    /// has nothing to resync. (Without it, the regions of the last couple of
    /// seconds stay dirty and the next open copies them: safe, only slower.)
    pub async fn close(&self) -> Result<(), Error> {
        let inner = self.inner();
        // Writes their callers gave up on run to their end first: the
        // flush below covers them, and the log is cleared of their regions.
        inner.writes.close();
        inner.writes.wait().await;
        inner.writes.reopen();
        let t = Instant::now();
        if inner.flush_all().await? {
            inner.log.clear_all_idle(t).await?;
        }
        inner.publish(true);
        Ok(())
    }
}

/// One request in flight on a leg, for as long as it lives.
struct Counted<'a>(&'a AtomicU64);

impl<'a> Counted<'a> {
    fn up(n: &'a AtomicU64) -> Counted<'a> {
        n.fetch_add(1, Relaxed);
        Counted(n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// A write dropped before its legs answered (only as its runtime shuts
/// down: a caller that gives up leaves it running, see `Inner::mutate`):
/// every leg it went to but one in sync may now differ in its regions;
/// they wait for a resync.
struct Abandoned<'a> {
    inner: &'a Inner,
    targets: Vec<usize>,
    regions: std::ops::Range<u64>,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        let mut legs = self.inner.legs.lock();
        let keep = self.targets.iter().copied().find(|i| legs[*i].state == LegState::InSync);
        for i in &self.targets {
            let leg = &mut legs[*i];
            if Some(*i) == keep || leg.state == LegState::Degraded {
                continue;
            }
            self.regions.clone().for_each(|r| leg.need(r));
            leg.state = LegState::Resyncing;
        }
        let regions: Vec<u64> = self.regions.clone().collect();
        self.inner.log.missed(&regions);
    }
}

#[derive(Clone)]
enum Op {
    Write(Bytes, bool),
    Trim,
    Zeroes(bool),
}

impl Op {
    async fn run(&self, leg: &Single, offset: u64, len: u64) -> Result<(), Error> {
        match self {
            Op::Write(data, fua) => leg.write_bytes(data.clone(), offset, *fua).await,
            Op::Trim => leg.trim(offset, len).await,
            Op::Zeroes(fua) => leg.write_zeroes(offset, len, *fua).await,
        }
    }
}

fn leg_options(opts: &Options, ms: &MirrorSpec) -> Options {
    let mut o = opts.clone();
    o.reconnect_timeout = ms.failover;
    o.request_timeout = o.request_timeout.min(ms.failover.max(Duration::from_secs(1)));
    o
}

fn check_leg(r: &Single, url: &str, size: u64) -> Result<(), Error> {
    if r.read_only() {
        return Err(mirror_err(format!("leg {url} is read-only")));
    }
    if r.size() < size + RECORD_SIZE {
        return Err(mirror_err(format!(
            "leg {url} has {} bytes, less than the mirror's {size} and its record",
            r.size()
        )));
    }
    if !RECORD_SIZE.is_multiple_of(r.block_size() as u64) {
        return Err(mirror_err(format!("leg {url} has blocks of {} bytes (at most 4 KiB)", r.block_size())));
    }
    Ok(())
}

/// Refuses a leg that is not this mirror's leg `i`, or was written by
/// someone with a newer log: merging it would return or spread data the
/// log knows nothing about.
fn check_record(rec: Option<LegRecord>, gens: &Generations, i: usize, url: &str) -> Result<(), Error> {
    let uuid = record::uuid_text(&gens.uuid);
    let Some(rec) = rec else {
        return Err(mirror_err(format!(
            "leg {i} ({url}) carries no record of mirror {uuid}: its volume was replaced or emptied \
             (a memory volume restarted?); refusing to use it as a copy"
        )));
    };
    if rec.uuid != gens.uuid {
        return Err(mirror_err(format!(
            "leg {i} ({url}) belongs to mirror {}, not {uuid}",
            record::uuid_text(&rec.uuid)
        )));
    }
    if rec.leg as usize != i || rec.legs as usize != gens.legs.len() {
        return Err(mirror_err(format!(
            "{url} is leg {} of {} of this mirror, given as leg {i} of {}: keep the legs in their order",
            rec.leg,
            rec.legs,
            gens.legs.len()
        )));
    }
    if rec.generation > gens.current {
        return Err(mirror_err(format!(
            "leg {i} ({url}) is at generation {}, newer than this log's {}: it was written through \
             another copy of the log; the legs diverged, refusing to merge them",
            rec.generation, gens.current
        )));
    }
    Ok(())
}

impl Inner {
    fn check_range(&self, offset: u64, len: u64) -> Result<(), Error> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::Status(fastsan_brp::Status::OUT_OF_RANGE)),
        }
    }

    /// The in-sync leg with the fewest requests in flight: where reads,
    /// and a resync's copies, come from. A leg whose session found its
    /// target's host restarted with writes it had not flushed is taken
    /// only when no other is in sync.
    fn least_busy_in_sync(&self, legs: &[Leg]) -> Option<(usize, Single)> {
        legs.iter()
            .enumerate()
            .filter(|(_, l)| l.state == LegState::InSync)
            .filter_map(|(i, l)| l.remote.clone().map(|r| (i, r)))
            .min_by_key(|(i, r)| (r.lost_writes(), self.in_flight[*i].load(Relaxed)))
    }

    /// Whether a leg other than `i` is in sync and lost no writes.
    fn another_sound_in_sync(&self, i: usize) -> bool {
        let legs = self.legs.lock();
        legs.iter().enumerate().any(|(j, l)| {
            j != i && l.state == LegState::InSync && l.remote.as_ref().is_some_and(|r| !r.lost_writes())
        })
    }

    fn regions_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        let regions = self.log.regions();
        (offset / self.region).min(regions)
            ..offset.saturating_add(len.max(1)).div_ceil(self.region).min(regions)
    }

    /// A write, TRIM or WRITE_ZEROES, run to its end: a caller that gives
    /// up (its future dropped) leaves it running in a task of its own: its
    /// requests are on the wire, and until every leg has answered, the
    /// regions' locks keep a resync from copying them. (Until 2026-11-29
    /// the locks went with the caller's future: a resync then copied a
    /// region from a leg the write had not reached yet, the write landed
    /// there after, and the legs differed in a region the log called
    /// clean.)
    async fn mutate(self: &Arc<Self>, offset: u64, len: u64, op: Op) -> Result<(), Error> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.counters.writes.fetch_add(1, Relaxed);
        let inner = self.clone();
        RunsToEnd::new(self.writes.track_future(async move { inner.mutate_to_end(offset, len, op).await }))
            .await
    }

    async fn mutate_to_end(self: &Arc<Self>, offset: u64, len: u64, op: Op) -> Result<(), Error> {
        let intent = self.log.begin(offset, len).await?;
        let regions = self.regions_of(offset, len);
        let _shared = self.lock_shared(regions.clone()).await;
        // Which legs get it; the others will need these regions.
        // A TRIM is advice (NBD's TRIM, NVMe's deallocate and SCSI's UNMAP
        // all leave the range's contents undefined until written): a leg
        // that cannot trim skips it and misses nothing. (Degrading it, as
        // any failed write does, left a mirror with such a leg on one leg
        // after every fstrim.)
        let trim = matches!(op, Op::Trim);
        let mut unable = 0;
        let targets: Vec<(usize, Single)> = {
            let mut legs = self.legs.lock();
            let mut t = Vec::new();
            for (i, leg) in legs.iter_mut().enumerate() {
                match (&leg.remote, leg.state) {
                    (Some(r), LegState::InSync | LegState::Resyncing) if trim && !r.can_trim() => unable += 1,
                    (Some(r), LegState::InSync | LegState::Resyncing) => t.push((i, r.clone())),
                    _ => regions.clone().for_each(|r| leg.need(r)),
                }
            }
            t
        };
        // Dropped halfway (the runtime shutting down), the write may be on
        // some legs and not others: all but one then wait for a resync.
        let abandoned = Abandoned {
            inner: self,
            targets: targets.iter().map(|t| t.0).collect(),
            regions: regions.clone(),
        };
        let results = futures::future::join_all(targets.iter().map(|(i, leg)| {
            let op = op.clone();
            async move {
                let _counted = Counted::up(&self.in_flight[*i]);
                op.run(leg, offset, len).await
            }
        }))
        .await;
        std::mem::forget(abandoned);
        let took = results.iter().filter(|r| r.is_ok()).count();
        let mut request_err = None;
        let mut refused = None;
        for ((i, _), r) in targets.iter().zip(results) {
            let e = match r {
                Ok(()) => continue,
                // A leg that refuses a TRIM (UNSUPPORTED; an NBD server's
                // EINVAL, as nbdkit and fastsan answer for a store that
                // cannot) declined the advice: it misses nothing.
                Err(e) if trim && request_error(&e) => {
                    unable += 1;
                    if took == 0 {
                        request_err.get_or_insert(e);
                    }
                    continue;
                }
                // The request's own fault, the same on every leg: nothing
                // differs. If another leg took it, this leg now differs.
                Err(e) if request_error(&e) && took == 0 => {
                    request_err.get_or_insert(e);
                    continue;
                }
                Err(e) => e,
            };
            // Its regions are dirty in the log: a degraded leg needs them.
            if let Err(e) = self.degrade(*i, &e).await {
                refused.get_or_insert(e);
            }
        }
        let on_every_leg = took + unable == self.in_flight.len() && {
            let legs = self.legs.lock();
            !legs.iter().any(|l| regions.clone().any(|r| l.needs(r)))
        };
        intent.done(on_every_leg);
        match (refused, request_err) {
            (Some(e), _) | (None, Some(e)) => Err(e),
            // No leg would trim: the caller learns that TRIM does nothing here.
            (None, None) if took == 0 && unable > 0 => Err(Error::Status(fastsan_brp::Status::UNSUPPORTED)),
            (None, None) if took + unable == 0 => Err(mirror_err("no leg took the write")),
            (None, None) => Ok(()),
        }
    }

    /// Flushes every leg that gets writes; a leg that fails is degraded.
    /// Whether every leg of the mirror (none degraded) was flushed.
    async fn flush_all(self: &Arc<Self>) -> Result<bool, Error> {
        let targets: Vec<(usize, Single)> = {
            let legs = self.legs.lock();
            legs.iter()
                .enumerate()
                .filter(|(_, l)| l.state != LegState::Degraded)
                .filter_map(|(i, l)| l.remote.clone().map(|r| (i, r)))
                .collect()
        };
        let results = futures::future::join_all(targets.iter().map(|(_, r)| r.flush())).await;
        // Every leg (none degraded) flushed: what each holds of the idle
        // regions is durable. (A resyncing leg lacks regions, but those are
        // never idle: a region a leg needs stays in the log's resync set.)
        let mut all = targets.len() == self.in_flight.len();
        for ((i, _), r) in targets.iter().zip(results) {
            if let Err(e) = r {
                all = false;
                self.degrade(*i, &e).await?;
            }
        }
        Ok(all)
    }

    async fn lock_shared(&self, regions: std::ops::Range<u64>) -> Vec<tokio::sync::RwLockReadGuard<'_, ()>> {
        let mut stripes: Vec<u64> = if regions.end - regions.start >= STRIPES {
            (0..STRIPES).collect()
        } else {
            regions.map(|r| r % STRIPES).collect()
        };
        stripes.sort_unstable();
        stripes.dedup();
        let mut guards = Vec::with_capacity(stripes.len());
        for s in stripes {
            guards.push(self.stripes[s as usize].read().await);
        }
        guards
    }

    /// Takes leg `i` out: it gets no more I/O until it comes back and is
    /// resynced. When it held every write, the generation moves on first
    /// (durably): after a crash the log still knows the leg missed writes.
    /// Refused for the last leg holding every write.
    async fn degrade(self: &Arc<Self>, i: usize, e: &Error) -> Result<(), Error> {
        // In a task of its own: a caller that gives up halfway must not
        // leave the log's generations and the legs' states apart.
        let this = self.clone();
        let (why, fresh) = (chain(e), !e.is_retryable());
        tokio::spawn(async move { this.degrade_now(i, why, fresh).await })
            .await
            .unwrap_or_else(|e| Err(mirror_err(format!("degrading leg {i}: {e}"))))
    }

    async fn degrade_now(&self, i: usize, why: String, fresh: bool) -> Result<(), Error> {
        let _g = self.gen_change.lock().await;
        let (was_in_sync, url) = {
            let legs = self.legs.lock();
            let in_sync = legs.iter().filter(|l| l.state == LegState::InSync).count();
            let leg = &legs[i];
            if leg.state == LegState::Degraded {
                return Ok(());
            }
            if leg.state == LegState::InSync && in_sync == 1 {
                return Err(mirror_err(format!(
                    "leg {i} ({}) failed, and no other leg holds every write: {why}",
                    leg.url
                )));
            }
            // Whether the log still counts the leg as holding every write:
            // an in-sync leg, and also one moved to resync without a new
            // generation (a write given up on half-way). Until 2026-11-29
            // only the first was asked: the second, degraded, kept the
            // current generation in the log while writes went on without
            // it, and after a crash it could be taken as the source.
            let g = self.log.generations();
            (g.legs[i] == g.current, leg.url.clone())
        };
        // The log says the leg is behind before any write may skip it: a
        // crash (or this future dropped) before this point leaves the leg
        // in sync in memory and getting every write; after it, behind.
        if was_in_sync {
            self.bump_generation(Some(i)).await?;
        }
        {
            let mut legs = self.legs.lock();
            let leg = &mut legs[i];
            leg.state = LegState::Degraded;
            leg.fresh = fresh;
            leg.why = Some(why.clone());
            let dirty = self.log.dirty();
            for r in &dirty {
                leg.need(*r);
            }
            // Regions it may lack are not idle any more: never cleared before its resync.
            self.log.missed(&dirty);
        }
        self.counters.degraded.fetch_add(1, Relaxed);
        warn!(leg = i, %url, error = %why, "mirror leg degraded; I/O goes on without it");
        self.publish(true);
        Ok(())
    }

    /// A new generation held by the in-sync legs (but `leaving`) alone: in
    /// the log first, then in their records. The caller holds `gen_change`.
    async fn bump_generation(&self, leaving: Option<usize>) -> Result<(), Error> {
        let mut g = self.log.generations();
        g.current += 1;
        let in_sync: Vec<(usize, Option<Single>)> = {
            let legs = self.legs.lock();
            legs.iter()
                .enumerate()
                .filter(|(i, l)| l.state == LegState::InSync && Some(*i) != leaving)
                .map(|(i, l)| (i, l.remote.clone()))
                .collect()
        };
        for (i, _) in &in_sync {
            g.legs[*i] = g.current;
        }
        self.log.set_generations(&g).await?;
        for (i, r) in in_sync {
            if let Some(r) = r {
                if let Err(e) = write_record(&r, self.size, &g, i, g.current).await {
                    // The log is what decides; the record only guards against
                    // foreign and newer logs, and is rewritten at the next open.
                    warn!(leg = i, error = %chain(&e), "cannot update a leg's record");
                }
            }
        }
        Ok(())
    }

    fn status(&self, open: bool) -> MirrorStatus {
        let g = self.log.generations();
        let d = self.log.stats();
        let legs = self.legs.lock();
        MirrorStatus {
            pid: std::process::id(),
            open,
            size: self.size,
            region: self.region,
            generation: g.current,
            dirty: self.log.dirty_count(),
            legs: legs
                .iter()
                .enumerate()
                .map(|(i, l)| LegStatus {
                    url: l.url.clone(),
                    state: l.state,
                    generation: g.legs[i],
                    needs: l.needed,
                    why: l.why.clone(),
                    in_flight: self.in_flight[i].load(Relaxed),
                    reads: self.leg_reads[i].load(Relaxed),
                    resync: (l.state == LegState::Resyncing || l.progress.total > 0).then_some(l.progress),
                })
                .collect(),
            degraded_events: self.counters.degraded.load(Relaxed),
            resynced_regions: self.counters.resynced_regions.load(Relaxed),
            resynced_bytes: self.counters.resynced_bytes.load(Relaxed),
            log_updates: d.updates,
            log_hot: d.hot,
            writes: self.counters.writes.load(Relaxed),
            reads: self.counters.reads.load(Relaxed),
        }
    }

    /// Writes the status next to the log (atomically: a reader never sees
    /// half of it).
    fn publish(&self, open: bool) {
        let path = dirty_log::status_path(&self.spec.log);
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec_pretty(&self.status(open)).unwrap_or_default();
        if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path)) {
            warn!(path = %path.display(), error = %e, "cannot publish the mirror's status");
        }
    }

    /// Brings degraded leg `i` back if its target answers: a new session
    /// when the old one cannot serve, its record checked, then a resync.
    async fn probe(self: Arc<Self>, i: usize) {
        let (url, old, fresh) = {
            let legs = self.legs.lock();
            (legs[i].url.clone(), legs[i].remote.clone(), legs[i].fresh)
        };
        let attempt = async {
            // An NBD leg whose connection ended needs a new one: its old
            // handle failed every probe with a retryable error (until
            // 2026-11-29 such a leg never came back before a reopen).
            let leg = match old {
                Some(r) if !fresh && r.usable() => r,
                _ => Single::connect(&url, self.opts.clone()).await?,
            };
            check_leg(&leg, &url, self.size)?;
            if leg.block_size() > self.block_size {
                return Err(mirror_err(format!(
                    "its blocks are of {} bytes, the mirror's of {}: reopen the mirror to take it back",
                    leg.block_size(),
                    self.block_size
                )));
            }
            let rec = read_record(&leg, self.size).await?;
            check_record(rec, &self.log.generations(), i, &url)?;
            Ok::<Single, Error>(leg)
        };
        let result = tokio::time::timeout(PROBE_TIMEOUT, attempt).await;
        let mut legs = self.legs.lock();
        let leg = &mut legs[i];
        leg.probing = false;
        match result {
            Ok(Ok(r)) => {
                info!(leg = i, %url, regions = leg.needed, "mirror leg is back; resyncing what it missed");
                leg.remote = Some(r);
                leg.fresh = false;
                leg.state = LegState::Resyncing;
                leg.why = None;
            }
            Ok(Err(e)) => {
                if !e.is_retryable() {
                    leg.fresh = true;
                }
                leg.why = Some(format!("still away: {}", chain(&e)));
            }
            Err(_) => leg.why = Some("still away: no answer to a probe".into()),
        }
    }

    /// Copies to leg `i` every region it needs, from an in-sync leg, then
    /// declares it in sync. Ends early (the leg left degraded, or the copy
    /// to be retried) on a failure.
    async fn resync(self: Arc<Self>, i: usize) {
        let r = self.copy_needed(i).await;
        let r = match r {
            Ok(()) => self.finish_resync(i).await,
            Err(e) => Err(e),
        };
        self.legs.lock()[i].resyncing = false;
        if let Err((e, leg_failed)) = r {
            warn!(leg = i, error = %chain(&e), "mirror resync stopped");
            if leg_failed {
                let _ = self.degrade(i, &e).await;
            }
        }
    }

    /// The error, and whether it is the resynced leg's.
    async fn copy_needed(self: &Arc<Self>, i: usize) -> Result<(), (Error, bool)> {
        let started = Instant::now();
        {
            let mut legs = self.legs.lock();
            let total = legs[i].needed;
            legs[i].progress = Progress { total, ..Progress::default() };
        }
        loop {
            if self.stop.is_cancelled() {
                return Err((mirror_err("the mirror was closed"), false));
            }
            let (r, dst, src) = {
                let legs = self.legs.lock();
                if legs[i].state != LegState::Resyncing {
                    return Err((mirror_err("the leg is no longer resyncing"), false));
                }
                let Some(r) = legs[i].first_needed() else { return Ok(()) };
                let Some(src) = self.least_busy_in_sync(&legs) else {
                    return Err((mirror_err("no in-sync leg to copy from"), false));
                };
                (r, legs[i].remote.clone().expect("a resyncing leg has a session"), src)
            };
            let off = r * self.region;
            let len = self.region.min(self.size - off);
            let copied = {
                let _alone = self.stripes[(r % STRIPES) as usize].write().await;
                // While we waited for the lock the source may have failed a
                // write (and been degraded), or the leg left its resync.
                {
                    let legs = self.legs.lock();
                    if legs[src.0].state != LegState::InSync
                        || legs[i].state != LegState::Resyncing
                        || !legs[i].needs(r)
                    {
                        continue;
                    }
                }
                let data = match src.1.read(off, len).await {
                    // The source's host restarted with writes it had not
                    // flushed (its session resumed): what it read may be
                    // older than them. Taken out, and the copy comes from
                    // another leg; the only one left is copied from, as a
                    // read is served from it. Until 2026-11-29 the copy
                    // made the returning leg "in sync" with the old bytes.
                    Ok(_) if src.1.lost_writes() && self.another_sound_in_sync(src.0) => {
                        drop(_alone);
                        let volume = self.legs.lock()[src.0].url.clone();
                        self.degrade(src.0, &Error::UnflushedWritesLost { volume })
                            .await
                            .map_err(|e| (e, false))?;
                        continue;
                    }
                    Ok(d) => d,
                    Err(e) => {
                        drop(_alone);
                        self.degrade(src.0, &e).await.map_err(|e| (e, false))?;
                        continue;
                    }
                };
                dst.write_bytes(data, off, false).await.map_err(|e| (e, true))?;
                let copied = {
                    let mut legs = self.legs.lock();
                    legs[i].unneed(r);
                    let p = &mut legs[i].progress;
                    p.copied += 1;
                    p.bytes += len;
                    p.rate = p.bytes as f64 / started.elapsed().as_secs_f64().max(1e-3);
                    let copied = p.bytes;
                    let clean = !legs.iter().any(|l| l.needs(r));
                    if clean {
                        // Under the region's lock: no write can have missed a
                        // leg here since. And under the legs' lock, as a
                        // degrade marks what a leg may lack: one between the
                        // check and the mark was undone by it (until
                        // 2026-11-29). Cleared later, by the keeper, after a
                        // flush of every leg covered the copy (so a resync's
                        // progress survives the process).
                        self.log.resynced(&[r]);
                    }
                    copied
                };
                copied
            };
            self.counters.resynced_regions.fetch_add(1, Relaxed);
            self.counters.resynced_bytes.fetch_add(len, Relaxed);
            if self.spec.rate > 0 {
                let due = Duration::from_secs_f64(copied as f64 / self.spec.rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Leg `i` has every region: its data flushed, its record and then the
    /// log say it holds the current generation, and it serves reads.
    async fn finish_resync(self: &Arc<Self>, i: usize) -> Result<(), (Error, bool)> {
        let dst = self.legs.lock()[i].remote.clone().expect("a resyncing leg has a session");
        dst.flush().await.map_err(|e| (e, true))?;
        let _g = self.gen_change.lock().await;
        {
            let legs = self.legs.lock();
            if legs[i].state != LegState::Resyncing || legs[i].needed != 0 {
                return Err((mirror_err("the leg changed during its resync"), false));
            }
        }
        let mut g = self.log.generations();
        write_record(&dst, self.size, &g, i, g.current).await.map_err(|e| (e, true))?;
        g.legs[i] = g.current;
        self.log.set_generations(&g).await.map_err(|e| (e.into(), false))?;
        let mut legs = self.legs.lock();
        // A write given up while the record and the log were written (it
        // takes no generation lock) may have left the leg a region to copy:
        // it stays resyncing, current in the log as it may be (a degrade
        // handles that), and the keeper copies what it lacks. It was
        // declared in sync regardless until 2026-11-29, and the region
        // never copied.
        if legs[i].needed != 0 {
            return Err((
                mirror_err("a write given up during the leg's resync left it regions to copy"),
                false,
            ));
        }
        legs[i].state = LegState::InSync;
        let p = legs[i].progress;
        info!(leg = i, url = %legs[i].url, regions = p.copied, bytes = p.bytes, "mirror leg in sync");
        Ok(())
    }
}

/// The mirror's background work: probing degraded legs, starting resyncs,
/// clearing idle regions after a flush of every leg covered them, and
/// publishing the status.
async fn keeper(weak: Weak<Inner>, stop: CancellationToken) {
    let mut last_clear = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
        let Some(inner) = weak.upgrade() else { return };
        {
            let mut legs = inner.legs.lock();
            for (i, leg) in legs.iter_mut().enumerate() {
                if leg.state == LegState::Degraded && !leg.probing {
                    leg.probing = true;
                    tokio::spawn(stop_with(stop.clone(), inner.clone().probe(i)));
                }
                if leg.state == LegState::Resyncing && !leg.resyncing {
                    leg.resyncing = true;
                    tokio::spawn(stop_with(stop.clone(), inner.clone().resync(i)));
                }
            }
        }
        if last_clear.elapsed() >= CLEAR_DELAY / 2 && inner.log.idle_count() > 0 {
            last_clear = Instant::now();
            let flushed = Instant::now();
            if let Ok(true) = inner.flush_all().await {
                if let Err(e) = inner.log.clear_idle_before(flushed).await {
                    warn!(error = %e, "cannot clear the dirty-region log");
                }
            }
        }
        inner.publish(true);
    }
}

async fn stop_with(stop: CancellationToken, work: impl std::future::Future<Output = ()>) {
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = work => {}
    }
}

/// The status of the mirror whose log is at `log`: what its process
/// publishes while it has it open; or else what the log says, with the
/// counters of the last process that had it open.
pub fn status_of(spec: &MirrorSpec) -> Result<MirrorStatus, Error> {
    let (size, region, gens, dirty) = DirtyLog::peek(&spec.log).map_err(|e| log_error(spec, e))?;
    let published = std::fs::read(dirty_log::status_path(&spec.log))
        .ok()
        .and_then(|b| serde_json::from_slice::<MirrorStatus>(&b).ok());
    if let Some(s) = &published {
        if s.open && std::path::Path::new(&format!("/proc/{}", s.pid)).exists() {
            return Ok(s.clone());
        }
    }
    let last = published.filter(|s| s.legs.len() == gens.legs.len());
    let count = |f: fn(&MirrorStatus) -> u64| last.as_ref().map_or(0, f);
    Ok(MirrorStatus {
        pid: 0,
        open: false,
        size,
        region,
        generation: gens.current,
        dirty: dirty.len() as u64,
        legs: spec
            .legs
            .iter()
            .zip(&gens.legs)
            .enumerate()
            .map(|(i, (u, g))| LegStatus {
                url: u.clone(),
                state: if *g == gens.current { LegState::InSync } else { LegState::Degraded },
                generation: *g,
                needs: if *g == gens.current { 0 } else { dirty.len() as u64 },
                why: (*g != gens.current).then(|| "missed writes: resynced at the next open".to_string()),
                in_flight: 0,
                reads: last.as_ref().map_or(0, |s| s.legs[i].reads),
                resync: None,
            })
            .collect(),
        degraded_events: count(|s| s.degraded_events),
        resynced_regions: count(|s| s.resynced_regions),
        resynced_bytes: count(|s| s.resynced_bytes),
        log_updates: count(|s| s.log_updates),
        log_hot: count(|s| s.log_hot),
        writes: count(|s| s.writes),
        reads: count(|s| s.reads),
    })
}
