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
//! ```text
//! file:   header (4 KiB) | bitmap (one bit per region, little-endian u64 words, 4 KiB pages)
//! header: magic "FSANDRL1" | version u32 | region_size u64 | volume_size u64 | crc32c of the above u32
//! ```

use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

const MAGIC: &[u8; 8] = b"FSANDRL1";
const VERSION: u32 = 1;
const HEADER: u64 = 4096;
const PAGE: usize = 4096;
const WORDS_PER_PAGE: usize = PAGE / 8;

#[derive(Debug, thiserror::Error)]
pub enum DirtyLogError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a fastsan dirty-region log (bad magic, version or checksum)")]
    NotALog { path: PathBuf },
    #[error(
        "{path} belongs to a volume of {found} bytes in regions of {found_region}, not {size} in {region}"
    )]
    Mismatch { path: PathBuf, found: u64, found_region: u64, size: u64, region: u64 },
    #[error("the region size must be a power of two of at least 4 KiB, not {0}")]
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
    region: u64,
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
    /// Creates a new, all-clean log at `path` for a volume of `size` bytes
    /// in regions of `region` bytes (a power of two, at least 4 KiB). It is
    /// written whole under a temporary name, synced, renamed into place and
    /// the directory synced: a crash leaves either no log or a whole one.
    /// An existing file is not replaced.
    pub fn create(
        path: &Path,
        size: u64,
        region: u64,
        clear_delay: Duration,
    ) -> Result<Arc<DirtyLog>, DirtyLogError> {
        check_region(region)?;
        let io = |source| DirtyLogError::Io { path: path.to_owned(), source };
        if path.exists() {
            return Err(io(std::io::Error::from(std::io::ErrorKind::AlreadyExists)));
        }
        let tmp = path.with_extension("creating");
        let f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).map_err(io)?;
        let mut h = vec![0u8; HEADER as usize];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..20].copy_from_slice(&region.to_le_bytes());
        h[20..28].copy_from_slice(&size.to_le_bytes());
        let crc = crc32c::crc32c(&h[..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&h, 0).map_err(io)?;
        f.write_all_at(&vec![0u8; pages_for(size, region) * PAGE], HEADER).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io)?;
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
        Self::open(path, size, region, clear_delay)
    }

    /// Opens the log at `path` of a volume of `size` bytes in regions of
    /// `region` bytes. A missing file is an error, never a clean log: the
    /// regions it marked would be forgotten. Every region dirty in it needs
    /// a resync (a crash, or a leg away, left it so).
    pub fn open(
        path: &Path,
        size: u64,
        region: u64,
        clear_delay: Duration,
    ) -> Result<Arc<DirtyLog>, DirtyLogError> {
        check_region(region)?;
        let io = |source| DirtyLogError::Io { path: path.to_owned(), source };
        let regions = size.div_ceil(region);
        let pages = pages_for(size, region);
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io)?;
        let mut h = [0u8; 32];
        if file.read_exact_at(&mut h, 0).is_err() {
            return Err(DirtyLogError::NotALog { path: path.to_owned() });
        }
        let crc = u32::from_le_bytes(h[28..32].try_into().expect("4 bytes"));
        if &h[..8] != MAGIC || h[8..12] != VERSION.to_le_bytes() || crc != crc32c::crc32c(&h[..28]) {
            return Err(DirtyLogError::NotALog { path: path.to_owned() });
        }
        let found_region = u64::from_le_bytes(h[12..20].try_into().expect("8 bytes"));
        let found = u64::from_le_bytes(h[20..28].try_into().expect("8 bytes"));
        if found != size || found_region != region {
            return Err(DirtyLogError::Mismatch { path: path.to_owned(), found, found_region, size, region });
        }
        let mut raw = vec![0u8; pages * PAGE];
        file.read_exact_at(&mut raw, HEADER).map_err(|_| DirtyLogError::NotALog { path: path.to_owned() })?;
        let mut bits = vec![0u64; pages * WORDS_PER_PAGE];
        for (w, c) in bits.iter_mut().zip(raw.chunks_exact(8)) {
            *w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        }
        // Bits past the last region mean nothing.
        for r in regions..(bits.len() as u64 * 64) {
            set_bit(&mut bits, r, false);
        }
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
            region,
            regions,
            clear_delay,
            state: Mutex::new(state),
            done: Notify::new(),
        }))
    }

    pub fn region_size(&self) -> u64 {
        self.region
    }

    /// The dirty regions, in order.
    pub fn dirty(&self) -> Vec<u64> {
        let s = self.state.lock();
        (0..self.regions).filter(|r| bit(&s.bits, *r)).collect()
    }

    pub fn stats(&self) -> DirtyStats {
        self.state.lock().stats
    }

    /// Marks the regions of `[offset, offset + len)` dirty and returns once
    /// that is durable: only then may the write leave for the legs.
    pub async fn begin(self: &Arc<Self>, offset: u64, len: u64) -> Result<WriteIntent, DirtyLogError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.regions * self.region => {}
            _ => return Err(DirtyLogError::OutOfRange { offset, len }),
        }
        let regions = self.regions_of(offset, len);
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
        let epoch = {
            let mut s = self.state.lock();
            let now = Instant::now();
            let ripe: Vec<u64> = s
                .idle
                .iter()
                .filter(|(_, t)| now.duration_since(**t) >= self.clear_delay)
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

    /// Clears regions a resync made identical on every leg.
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
                // A write in flight may not be in what the resync copied.
                if s.inflight.get(r).copied().unwrap_or(0) > 0 {
                    continue;
                }
                s.resync.remove(r);
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

    fn regions_of(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        let first = (offset / self.region).min(self.regions);
        let last = offset.saturating_add(len.max(1)).div_ceil(self.region).min(self.regions);
        first..last
    }

    fn failed(&self, why: &str) -> DirtyLogError {
        DirtyLogError::Io {
            path: self.path.clone(),
            source: std::io::Error::other(format!("an earlier update failed: {why}")),
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
                    s.idle.insert(r, now);
                }
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
