//! The dirty-region log: one bit per region of the volume (1 MiB by
//! default), in a local file, set and made durable **before** a write to
//! the region leaves for the legs, cleared lazily once the region's writes
//! are on every leg. After a crash of the initiator, or while a leg is away,
//! the set bits are exactly the regions a resync must copy.
//!
//! What it costs, and what keeps the cost down (the Veritas talk's
//! "mirroring overhead: dirty region tracking"):
//! - **a hot region costs nothing**: a region whose bit is already set (on
//!   disk) takes no bitmap I/O; the bit stays set while writes keep coming;
//! - **concurrent writes share one bitmap update**: bits set while an update
//!   is being written go out together in the next one (group commit), one
//!   `pwrite` of the changed pages and one `fdatasync` per batch;
//! - **clearing is delayed**: a region is cleared only after it has been
//!   idle (no write in flight, none begun) for `clear_delay`, and the clears
//!   are batched too, so a region written again soon is not updated twice.
//!
//! The log also keeps the mirror's generation record (DRBD's data
//! generation identifiers, simplified): the mirror's identity, its current
//! generation and the generation each leg is known to hold. A leg whose
//! generation is behind the current one missed writes and is read only after
//! a resync. It is written in two alternating slots with a sequence number,
//! so a torn write leaves the previous record whole.
//!
//! ```text
//! file:   header (4 KiB) | bitmap (one bit per region, little-endian u64 words, 4 KiB pages)
//! header: magic "FSANDRL2" | version u32 | region_size u64 | volume_size u64 | crc32c of the above u32
//!         generation slots at 512 and 1024: magic "FSANGEN1" | seq u64 | uuid [16] | current u64
//!                                          | legs u32 | leg generation u64 x legs | crc32c u32
//! ```

use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const MAGIC: &[u8; 8] = b"FSANDRL2";
const VERSION: u32 = 2;
const GEN_MAGIC: &[u8; 8] = b"FSANGEN1";
const GEN_SLOT: u64 = 512;
/// Most regions a log tracks (a 64 MiB bitmap): 512 TiB in 1 MiB regions.
const MAX_REGIONS: u64 = 1 << 29;
/// Most legs a mirror may have.
pub const MAX_LEGS: usize = 32;
const HEADER: u64 = 4096;
const PAGE: usize = 4096;
const WORDS_PER_PAGE: usize = PAGE / 8;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    /// (The cause is in the message, not a `source` as well: a chain
    /// printed whole said it twice.)
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path} is not a fastsan dirty-region log (bad magic, version or checksum)")]
    NotALog { path: PathBuf },
    #[error("{path} is in use by another process (pid {pid})")]
    InUse { path: PathBuf, pid: String },
    #[error("a mirror has 1 to {MAX_LEGS} legs, not {0}")]
    Legs(usize),
    #[error("the region size must be a power of two of at least 4 KiB (and at most 2^29 regions), not {0}")]
    RegionSize(u64),
    #[error("a write of {len} bytes at {offset} is past the end of the volume")]
    OutOfRange { offset: u64, len: u64 },
}

/// Counters of the log's work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirtyStats {
    /// Bitmap updates written (each one pwrite and one fdatasync).
    pub updates: u64,
    /// Writes that found every region of theirs already dirty on disk.
    pub hot: u64,
    /// Regions set, and cleared.
    pub set: u64,
    pub cleared: u64,
}

/// The mirror's generation record, as the log keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generations {
    /// The mirror's identity, also in every leg's record.
    pub uuid: [u8; 16],
    /// Bumped whenever the set of legs holding every write shrinks.
    pub current: u64,
    /// Per leg, the generation it is known to hold: `current` when in sync.
    pub legs: Vec<u64>,
}

impl Generations {
    fn encode(&self, seq: u64) -> Vec<u8> {
        let mut b = Vec::with_capacity(GEN_SLOT as usize);
        b.extend_from_slice(GEN_MAGIC);
        b.extend_from_slice(&seq.to_le_bytes());
        b.extend_from_slice(&self.uuid);
        b.extend_from_slice(&self.current.to_le_bytes());
        b.extend_from_slice(&(self.legs.len() as u32).to_le_bytes());
        for g in &self.legs {
            b.extend_from_slice(&g.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(GEN_SLOT as usize, 0);
        b
    }

    /// A slot's record and sequence, if it is whole.
    fn decode(b: &[u8]) -> Option<(u64, Generations)> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b.len() < 44 || &b[..8] != GEN_MAGIC {
            return None;
        }
        let n = u32::from_le_bytes(b[40..44].try_into().expect("4 bytes")) as usize;
        if n == 0 || n > MAX_LEGS {
            return None;
        }
        let end = 44 + 8 * n;
        let crc = u32::from_le_bytes(b.get(end..end + 4)?.try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&b[..end]) {
            return None;
        }
        let legs = (0..n).map(|i| u64_at(44 + 8 * i)).collect();
        Some((
            u64_at(8),
            Generations { uuid: b[16..32].try_into().expect("16 bytes"), current: u64_at(32), legs },
        ))
    }
}

struct State {
    /// The bitmap as it is (or is about to be) on disk.
    bits: Vec<u64>,
    /// Pages changed since the last update began.
    changed: BTreeSet<usize>,
    /// The update that will take the next snapshot, and the last one durable.
    next: u64,
    durable: u64,
    updating: bool,
    /// A failed update: no write may rely on the log any more.
    failed: Option<String>,
    /// Regions set in memory whose update may not be durable yet, with the
    /// update that carries them.
    pending: HashMap<u64, u64>,
    /// Writes in flight per region.
    inflight: HashMap<u64, u32>,
    /// Regions a write missed a leg in: dirty until a resync clears them.
    resync: HashSet<u64>,
    /// Regions whose writes are all on every leg, and since when (idle).
    idle: HashMap<u64, Instant>,
    stats: DirtyStats,
}

/// The dirty-region log of one mirrored volume.
pub struct DirtyLog {
    path: PathBuf,
    file: Arc<File>,
    size: u64,
    region: u64,
    /// The generation record and the sequence of its last write.
    gens: Mutex<(u64, Generations)>,
    gen_write: tokio::sync::Mutex<()>,
    /// The optimizations off (for measuring them): one update per write,
    /// none shared, hot regions too, and a clear right after every write.
    naive: std::sync::atomic::AtomicBool,
    naive_one: tokio::sync::Mutex<()>,
    regions: u64,
    clear_delay: Duration,
    state: Mutex<State>,
    done: Notify,
}

/// A write's claim on its regions: taken before the write leaves (its bits
/// are durable then), given back with whether the write reached every leg.
#[must_use = "finish the intent with WriteIntent::done"]
pub struct WriteIntent {
    regions: std::ops::Range<u64>,
    finished: bool,
    log: Arc<DirtyLog>,
}

impl DirtyLog {
    /// Creates a new log at `path` for a volume of `size` bytes in regions
    /// of `region` bytes (a power of two, at least 4 KiB), every region
    /// clean or (`all_dirty`, for a first full sync) every region dirty,
    /// with the generation record `gens`. It is written whole under a
    /// temporary name, synced, renamed into place and the directory synced:
    /// a crash leaves either no log or a whole one. An existing file is not
    /// replaced.
    pub fn create(
        path: &Path,
        size: u64,
        region: u64,
        gens: &Generations,
        all_dirty: bool,
        clear_delay: Duration,
    ) -> Result<Arc<DirtyLog>, DirtyLogError> {
        check_region(region)?;
        if size.div_ceil(region) > MAX_REGIONS {
            return Err(DirtyLogError::RegionSize(region));
        }
        if gens.legs.is_empty() || gens.legs.len() > MAX_LEGS {
            return Err(DirtyLogError::Legs(gens.legs.len()));
        }
        let io = |error| DirtyLogError::Io { path: path.to_owned(), error };
        if path.exists() {
            return Err(io(std::io::Error::from(std::io::ErrorKind::AlreadyExists)));
        }
        // A name of its own (two creates of one log never share it), put in
        // place only if the log is still not there.
        let tmp = path.with_extension(format!("creating-{}-{:x}", std::process::id(), rand::random::<u64>()));
        let f = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io)?;
        let tmp = TempPath(tmp);
        let mut h = vec![0u8; HEADER as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..20].copy_from_slice(&region.to_le_bytes());
        h[20..28].copy_from_slice(&size.to_le_bytes());
        let crc = crc32c::crc32c(&h[..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        // Sequence 1 in the slot sequence 1 picks (as set_generations
        // does): the first update, sequence 2, goes to the other one. Until
        // 2026-11-29 it went to the slot of sequence 2, so a torn first
        // update left no valid record, and the mirror could not be opened.
        let first = (2 * GEN_SLOT) as usize; // GEN_SLOT * (1 + seq % 2), seq 1
        h[first..first + GEN_SLOT as usize].copy_from_slice(&gens.encode(1));
        f.write_all_at(&h, 0).map_err(io)?;
        let mut bits = vec![0u64; pages_for(size, region) * WORDS_PER_PAGE];
        if all_dirty {
            for r in 0..size.div_ceil(region) {
                set_bit(&mut bits, r, true);
            }
        }
        let raw: Vec<u8> = bits.iter().flat_map(|w| w.to_le_bytes()).collect();
        f.write_all_at(&raw, HEADER).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        // Never over a log another `create` made meanwhile (two clients
        // would each own a log of one mirror).
        rename_noreplace(&tmp.0, path).map_err(io)?;
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        Self::open(path, clear_delay)
    }

    /// Opens the log at `path`, for this process alone (an exclusive lock
    /// on the file: two initiators writing one mirror would each believe
    /// its own log). A missing file is an error, never a clean log: the
    /// regions it marked would be forgotten. Every region dirty in it needs
    /// a resync (a crash, or a leg away, left it so).
    pub fn open(path: &Path, clear_delay: Duration) -> Result<Arc<DirtyLog>, DirtyLogError> {
        let (file, size, region, gens) = Self::read_header(path, true)?;
        Self::lock(path, &file)?;
        let regions = size.div_ceil(region);
        let bits = Self::read_bits(path, &file, size, region)?;
        let resync = (0..regions).filter(|r| bit(&bits, *r)).collect();
        let state = State {
            bits,
            changed: BTreeSet::new(),
            next: 1,
            durable: 0,
            updating: false,
            failed: None,
            pending: HashMap::new(),
            inflight: HashMap::new(),
            resync,
            idle: HashMap::new(),
            stats: DirtyStats::default(),
        };
        Ok(Arc::new(DirtyLog {
            path: path.to_owned(),
            file: Arc::new(file),
            size,
            region,
            gens: Mutex::new(gens),
            gen_write: tokio::sync::Mutex::new(()),
            naive: std::sync::atomic::AtomicBool::new(false),
            naive_one: tokio::sync::Mutex::new(()),
            regions,
            clear_delay,
            state: Mutex::new(state),
            done: Notify::new(),
        }))
    }

    /// What a log holds, read without taking it (for a status of a mirror
    /// another process has open): the volume size, the region size, the
    /// generation record and the dirty regions.
    pub fn peek(path: &Path) -> Result<(u64, u64, Generations, Vec<u64>), DirtyLogError> {
        let (file, size, region, (_, gens)) = Self::read_header(path, false)?;
        let bits = Self::read_bits(path, &file, size, region)?;
        let dirty = (0..size.div_ceil(region)).filter(|r| bit(&bits, *r)).collect();
        Ok((size, region, gens, dirty))
    }

    fn read_header(path: &Path, write: bool) -> Result<(File, u64, u64, (u64, Generations)), DirtyLogError> {
        let io = |error| DirtyLogError::Io { path: path.to_owned(), error };
        let not = || DirtyLogError::NotALog { path: path.to_owned() };
        let file = OpenOptions::new().read(true).write(write).open(path).map_err(io)?;
        let mut h = vec![0u8; HEADER as usize];
        file.read_exact_at(&mut h, 0).map_err(|_| not())?;
        let crc = u32::from_le_bytes(h[28..32].try_into().expect("4 bytes"));
        if &h[..8] != MAGIC || h[8..12] != VERSION.to_le_bytes() || crc != crc32c::crc32c(&h[..28]) {
            return Err(not());
        }
        let region = u64::from_le_bytes(h[12..20].try_into().expect("8 bytes"));
        let size = u64::from_le_bytes(h[20..28].try_into().expect("8 bytes"));
        check_region(region).map_err(|_| not())?;
        if size.div_ceil(region) > MAX_REGIONS {
            return Err(not());
        }
        let slot =
            |k: u64| Generations::decode(&h[(GEN_SLOT * (1 + k)) as usize..(GEN_SLOT * (2 + k)) as usize]);
        // The newer whole slot: a torn write leaves the other one.
        let gens = match (slot(0), slot(1)) {
            (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
        Ok((file, size, region, gens.ok_or_else(not)?))
    }

    fn read_bits(path: &Path, file: &File, size: u64, region: u64) -> Result<Vec<u64>, DirtyLogError> {
        let pages = pages_for(size, region);
        let mut raw = vec![0u8; pages * PAGE];
        file.read_exact_at(&mut raw, HEADER).map_err(|_| DirtyLogError::NotALog { path: path.to_owned() })?;
        let mut bits = vec![0u64; pages * WORDS_PER_PAGE];
        for (w, c) in bits.iter_mut().zip(raw.chunks_exact(8)) {
            *w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        }
        // Bits past the last region mean nothing.
        for r in size.div_ceil(region)..(bits.len() as u64 * 64) {
            set_bit(&mut bits, r, false);
        }
        Ok(bits)
    }

    fn lock(path: &Path, file: &File) -> Result<(), DirtyLogError> {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(DirtyLogError::Io { path: path.to_owned(), error: e });
        }
        let pid = std::fs::read_to_string(status_path(path))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v["pid"].as_u64())
            .map_or_else(|| "unknown".to_string(), |p| p.to_string());
        Err(DirtyLogError::InUse { path: path.to_owned(), pid })
    }

    /// The volume's size and the region size.
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn region_size(&self) -> u64 {
        self.region
    }
    pub fn regions(&self) -> u64 {
        self.regions
    }

    pub fn generations(&self) -> Generations {
        self.gens.lock().1.clone()
    }

    /// Replaces the generation record, durably, before returning.
    pub async fn set_generations(self: &Arc<Self>, gens: &Generations) -> Result<(), DirtyLogError> {
        if gens.legs.is_empty() || gens.legs.len() > MAX_LEGS {
            return Err(DirtyLogError::Legs(gens.legs.len()));
        }
        // In a task of its own: a caller that gives up cannot leave the
        // write running while the record in memory (and its sequence, which
        // picks the slot) stays old for the next writer.
        let log = self.clone();
        let gens = gens.clone();
        tokio::spawn(async move {
            let _one = log.gen_write.lock().await;
            let seq = log.gens.lock().0 + 1;
            let bytes = gens.encode(seq);
            let file = log.file.clone();
            let at = GEN_SLOT * (1 + seq % 2);
            tokio::task::spawn_blocking(move || {
                file.write_all_at(&bytes, at)?;
                file.sync_data()
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            .map_err(|error| DirtyLogError::Io { path: log.path.clone(), error })?;
            *log.gens.lock() = (seq, gens);
            Ok(())
        })
        .await
        .unwrap_or_else(|e| {
            Err(DirtyLogError::Io { path: self.path.clone(), error: std::io::Error::other(e) })
        })
    }

    /// The dirty regions, in order.
    pub fn dirty(&self) -> Vec<u64> {
        let s = self.state.lock();
        (0..self.regions).filter(|r| bit(&s.bits, *r)).collect()
    }

    /// How many regions are dirty, and how many wait to be cleared.
    pub fn dirty_count(&self) -> u64 {
        let s = self.state.lock();
        s.bits.iter().map(|w| w.count_ones() as u64).sum()
    }
    pub fn idle_count(&self) -> usize {
        self.state.lock().idle.len()
    }

    pub fn stats(&self) -> DirtyStats {
        self.state.lock().stats
    }

    /// Turns the optimizations off (`naive`) or on: for measuring what
    /// they save. Off, every write costs its own update before it leaves
    /// (no group commit, no free hot regions) and one more after it (the
    /// clear, at once), as a write-intent bitmap without them would.
    pub fn set_naive(&self, naive: bool) {
        self.naive.store(naive, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_naive(&self) -> bool {
        self.naive.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Marks the regions of `[offset, offset + len)` dirty and returns once
    /// that is durable: only then may the write leave for the legs.
    pub async fn begin(self: &Arc<Self>, offset: u64, len: u64) -> Result<WriteIntent, DirtyLogError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.regions * self.region => {}
            _ => return Err(DirtyLogError::OutOfRange { offset, len }),
        }
        let regions = self.regions_of(offset, len);
        if self.is_naive() {
            let _one = self.naive_one.lock().await;
            let epoch = {
                let mut s = self.state.lock();
                if let Some(why) = &s.failed {
                    return Err(self.failed(why));
                }
                for r in regions.clone() {
                    *s.inflight.entry(r).or_insert(0) += 1;
                    s.idle.remove(&r);
                    set_bit(&mut s.bits, r, true);
                    s.changed.insert(page_of(r));
                    s.stats.set += 1;
                }
                s.next
            };
            let intent = WriteIntent { regions, finished: false, log: self.clone() };
            self.wait_durable(epoch).await?;
            return Ok(intent);
        }
        let wait_for = {
            let mut s = self.state.lock();
            if let Some(why) = &s.failed {
                return Err(self.failed(why));
            }
            let durable = s.durable;
            s.pending.retain(|_, e| *e > durable);
            let mut need = None;
            for r in regions.clone() {
                *s.inflight.entry(r).or_insert(0) += 1;
                s.idle.remove(&r);
                if !bit(&s.bits, r) {
                    set_bit(&mut s.bits, r, true);
                    s.changed.insert(page_of(r));
                    s.stats.set += 1;
                    let next = s.next;
                    s.pending.insert(r, next);
                }
                // Set by this write or an earlier one, maybe not durable yet.
                if let Some(e) = s.pending.get(&r) {
                    need = need.max(Some(*e));
                }
            }
            if need.is_none() {
                s.stats.hot += 1;
            }
            need
        };
        let intent = WriteIntent { regions, finished: false, log: self.clone() };
        if let Some(epoch) = wait_for {
            self.wait_durable(epoch).await?;
        }
        Ok(intent)
    }

    /// Clears the regions idle for `clear_delay` (on every leg, no write in
    /// flight or begun since), in one update. Run it now and then (a mirror
    /// runs it on a timer); returns how many were cleared.
    pub async fn clear_idle(self: &Arc<Self>) -> Result<u64, DirtyLogError> {
        self.clear_idle_before(Instant::now()).await
    }

    /// As [`DirtyLog::clear_idle`], only regions idle since before `t` (a
    /// flush of every leg that began at `t` covered their writes).
    pub async fn clear_idle_before(self: &Arc<Self>, t: Instant) -> Result<u64, DirtyLogError> {
        self.clear_idle_since(t, self.clear_delay).await
    }

    /// Clears every region idle since before `t`, however recently: for a
    /// clean close, after a flush of every leg that began at `t`.
    pub async fn clear_all_idle(self: &Arc<Self>, t: Instant) -> Result<u64, DirtyLogError> {
        self.clear_idle_since(t, Duration::ZERO).await
    }

    async fn clear_idle_since(self: &Arc<Self>, t: Instant, delay: Duration) -> Result<u64, DirtyLogError> {
        let epoch = {
            let mut s = self.state.lock();
            let now = Instant::now();
            let ripe: Vec<u64> = s
                .idle
                .iter()
                .filter(|(_, i)| **i <= t && now.duration_since(**i) >= delay)
                .map(|(r, _)| *r)
                .collect();
            if ripe.is_empty() {
                return Ok(0);
            }
            for r in &ripe {
                s.idle.remove(r);
                set_bit(&mut s.bits, *r, false);
                s.changed.insert(page_of(*r));
            }
            s.stats.cleared += ripe.len() as u64;
            (s.next, ripe.len() as u64)
        };
        self.wait_durable(epoch.0).await?;
        Ok(epoch.1)
    }

    /// Marks every region dirty, durably, for a resync (a leg replaced:
    /// everything must be copied to it).
    pub async fn mark_all(self: &Arc<Self>) -> Result<(), DirtyLogError> {
        let epoch = {
            let mut s = self.state.lock();
            for r in 0..self.regions {
                if !bit(&s.bits, r) {
                    set_bit(&mut s.bits, r, true);
                    s.changed.insert(page_of(r));
                    s.stats.set += 1;
                }
                s.idle.remove(&r);
                s.resync.insert(r);
            }
            s.next
        };
        self.wait_durable(epoch).await
    }

    /// Clears regions a resync made identical on every leg. The caller
    /// makes sure no write to them has been sent meanwhile (the mirror holds
    /// the region's lock); a write that has begun but not been sent yet
    /// keeps its region dirty until it is done, and decides then, as any
    /// write does, whether it may become clean.
    pub async fn clear(self: &Arc<Self>, regions: &[u64]) -> Result<(), DirtyLogError> {
        let epoch = {
            let mut s = self.state.lock();
            if let Some(r) = regions.iter().find(|r| **r >= self.regions) {
                return Err(DirtyLogError::OutOfRange {
                    offset: r.saturating_mul(self.region),
                    len: self.region,
                });
            }
            for r in regions {
                s.resync.remove(r);
                if s.inflight.get(r).copied().unwrap_or(0) > 0 {
                    continue;
                }
                if bit(&s.bits, *r) {
                    set_bit(&mut s.bits, *r, false);
                    s.changed.insert(page_of(*r));
                    s.idle.remove(r);
                    s.stats.cleared += 1;
                }
            }
            s.next
        };
        self.wait_durable(epoch).await
    }

    /// Regions a leg may lack (it was just degraded): kept dirty until a
    /// resync says otherwise, however idle they were.
    pub fn missed(&self, regions: &[u64]) {
        let mut s = self.state.lock();
        for r in regions.iter().filter(|r| **r < self.regions) {
            if bit(&s.bits, *r) {
                s.idle.remove(r);
                s.resync.insert(*r);
            }
        }
    }

    /// Regions a resync made identical on every leg, under their locks:
    /// they become idle now, and are cleared like any idle region, after
    /// the delay and a flush of every leg. (A region with a write begun but
    /// not sent yet goes as that write says when it is done.)
    pub fn resynced(&self, regions: &[u64]) {
        let mut s = self.state.lock();
        let now = Instant::now();
        for r in regions.iter().filter(|r| **r < self.regions) {
            s.resync.remove(r);
            if !s.inflight.contains_key(r) && bit(&s.bits, *r) {
                s.idle.insert(*r, now);
            }
        }
    }

    fn regions_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        let first = (offset / self.region).min(self.regions);
        let last = offset.saturating_add(len.max(1)).div_ceil(self.region).min(self.regions);
        first..last
    }

    fn failed(&self, why: &str) -> DirtyLogError {
        DirtyLogError::Io {
            path: self.path.clone(),
            error: std::io::Error::other(format!("an earlier update failed: {why}")),
        }
    }

    /// Waits until update `epoch` (whose snapshot holds the caller's bits)
    /// is durable, writing it if nobody is. One writer at a time; the
    /// others' bits ride along in the next snapshot.
    async fn wait_durable(self: &Arc<Self>, epoch: u64) -> Result<(), DirtyLogError> {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let job = {
                let mut s = self.state.lock();
                if let Some(why) = &s.failed {
                    return Err(self.failed(why));
                }
                if s.durable >= epoch {
                    return Ok(());
                }
                if s.updating {
                    None
                } else {
                    s.updating = true;
                    let this = s.next;
                    s.next += 1;
                    let pages: Vec<(usize, Vec<u8>)> = std::mem::take(&mut s.changed)
                        .into_iter()
                        .map(|p| {
                            let words = &s.bits[p * WORDS_PER_PAGE..(p + 1) * WORDS_PER_PAGE];
                            (p, words.iter().flat_map(|w| w.to_le_bytes()).collect())
                        })
                        .collect();
                    Some((this, pages))
                }
            };
            let Some((this, pages)) = job else {
                notified.await;
                continue;
            };
            // In a task of its own: a caller that gives up (a dropped
            // future) cannot leave the update unfinished and the log stuck.
            let log = self.clone();
            tokio::spawn(async move {
                let file = log.file.clone();
                let written = tokio::task::spawn_blocking(move || {
                    for (p, bytes) in &pages {
                        file.write_all_at(bytes, HEADER + (*p * PAGE) as u64)?;
                    }
                    file.sync_data()
                })
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
                {
                    let mut s = log.state.lock();
                    s.updating = false;
                    match written {
                        Ok(()) => {
                            s.durable = this;
                            s.stats.updates += 1;
                        }
                        Err(e) => s.failed = Some(e.to_string()),
                    }
                }
                log.done.notify_waiters();
            });
            notified.await;
        }
    }
}

impl WriteIntent {
    /// The write is over: `on_every_leg` when every leg in the mirror has
    /// it (the regions may be cleared once idle); otherwise they stay dirty
    /// for the resync.
    pub fn done(mut self, on_every_leg: bool) {
        self.finish(on_every_leg);
    }

    fn finish(&mut self, on_every_leg: bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        let mut s = self.log.state.lock();
        let now = Instant::now();
        for r in self.regions.clone() {
            if !on_every_leg {
                s.resync.insert(r);
            }
            let left = match s.inflight.get_mut(&r) {
                Some(n) => {
                    *n -= 1;
                    *n
                }
                None => 0,
            };
            if left == 0 {
                s.inflight.remove(&r);
                if !s.resync.contains(&r) {
                    if self.log.is_naive() {
                        set_bit(&mut s.bits, r, false);
                        s.changed.insert(page_of(r));
                        s.stats.cleared += 1;
                    } else {
                        s.idle.insert(r, now);
                    }
                }
            }
        }
        drop(s);
        if self.log.is_naive() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let log = self.log.clone();
                rt.spawn(async move {
                    let _one = log.naive_one.lock().await;
                    let epoch = log.state.lock().next;
                    let _ = log.wait_durable(epoch).await;
                });
            }
        }
    }
}

impl Drop for WriteIntent {
    /// A write abandoned halfway may or may not have reached the legs.
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// A file removed when dropped (a log being made; gone once renamed).
struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Renames `from` to `to` unless `to` exists (EEXIST): renameat2's
/// RENAME_NOREPLACE, or, on a file system without it, a check and a plain
/// rename.
fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes());
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: two valid NUL-terminated paths, relative to the working directory.
    let r = unsafe {
        libc::renameat2(libc::AT_FDCWD, f.as_ptr(), libc::AT_FDCWD, t.as_ptr(), libc::RENAME_NOREPLACE)
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) if !to.exists() => std::fs::rename(from, to),
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => {
            Err(std::io::Error::from(std::io::ErrorKind::AlreadyExists))
        }
        _ => Err(e),
    }
}

fn bit(bits: &[u64], r: u64) -> bool {
    bits[(r / 64) as usize] >> (r % 64) & 1 == 1
}

fn set_bit(bits: &mut [u64], r: u64, on: bool) {
    let (w, m) = ((r / 64) as usize, 1u64 << (r % 64));
    if on {
        bits[w] |= m
    } else {
        bits[w] &= !m
    }
}

fn check_region(region: u64) -> Result<(), DirtyLogError> {
    if region.is_power_of_two() && region >= 4096 {
        Ok(())
    } else {
        Err(DirtyLogError::RegionSize(region))
    }
}

/// Bitmap pages for a volume: at least one.
fn pages_for(size: u64, region: u64) -> usize {
    (size.div_ceil(region).div_ceil(64) as usize).div_ceil(WORDS_PER_PAGE).max(1)
}

fn page_of(r: u64) -> usize {
    (r / 64) as usize / WORDS_PER_PAGE
}

/// Where a mirror's process publishes its state for `fastsan mirror status`:
/// next to the log, `LOG.status.json`.
pub fn status_path(log: &Path) -> PathBuf {
    let mut s = log.as_os_str().to_owned();
    s.push(".status.json");
    PathBuf::from(s)
}
