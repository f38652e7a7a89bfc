//! The stats layer, always at the top of a volume's stack: per-volume
//! counters of operations, bytes and errors, and a latency histogram (what
//! metrics read). Lock-free: atomics only. Latency is sampled, one call in
//! [`LATENCY_SAMPLE`] of each kind: reading the clock twice per call cost
//! 3.5% of the target's CPU on 4K reads from memory (perf, BRP randread).

use super::{Backend, BackendError, DeviceDone, DeviceIo, Layer, Result, ZeroFlags};
use crate::request::{Extent, ReadData};
use crate::stats::{shard_index, SHARDS};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// One call in this many (per operation kind) is timed.
pub const LATENCY_SAMPLE: u64 = 32;

/// Latencies by power of two of nanoseconds: bucket `i` counts calls that
/// took `[2^i, 2^(i+1))` ns (bucket 0 also takes 0 ns).
pub struct Histogram {
    buckets: [AtomicU64; 40],
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram").field("counts", &self.counts()).finish()
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: [const { AtomicU64::new(0) }; 40] }
    }
}

impl Histogram {
    pub fn record(&self, nanos: u64) {
        let i = (63 - nanos.max(1).leading_zeros() as usize).min(39);
        self.buckets[i].fetch_add(1, Relaxed);
    }

    pub fn counts(&self) -> [u64; 40] {
        std::array::from_fn(|i| self.buckets[i].load(Relaxed))
    }

    /// An upper bound of the latency (ns) below which `q` (0..=1) of the calls fall.
    pub fn quantile(counts: &[u64; 40], q: f64) -> u64 {
        let total: u64 = counts.iter().sum();
        let want = (total as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= want && seen > 0 {
                return 1u64 << (i + 1);
            }
        }
        0
    }
}

/// One shard of a volume's counters, alone on its cache lines.
#[derive(Default)]
#[repr(align(128))]
struct Shard {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    errors: AtomicU64,
}

/// One volume's counters. Each thread counts in a shard of its own, so
/// connections on different cores never contend for a cache line (a shared
/// counter cost the 4K read path measurably); a snapshot sums the shards.
pub struct VolumeStats {
    shards: [Shard; SHARDS],
    /// Sampled: one call in [`LATENCY_SAMPLE`] of each kind (per thread).
    latency: Histogram,
}

impl Default for VolumeStats {
    fn default() -> Self {
        VolumeStats { shards: std::array::from_fn(|_| Shard::default()), latency: Histogram::default() }
    }
}

/// A copy of one volume's counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeStatsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub zeroes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Calls that failed in the device.
    pub errors: u64,
    /// Sampled latencies, by power of two of nanoseconds (see [`Histogram`]).
    pub latency_ns: [u64; 40],
}

impl VolumeStats {
    pub fn snapshot(&self) -> VolumeStatsSnapshot {
        let sum = |f: fn(&Shard) -> &AtomicU64| self.shards.iter().map(|s| f(s).load(Relaxed)).sum();
        VolumeStatsSnapshot {
            reads: sum(|s| &s.reads),
            writes: sum(|s| &s.writes),
            flushes: sum(|s| &s.flushes),
            trims: sum(|s| &s.trims),
            zeroes: sum(|s| &s.zeroes),
            bytes_read: sum(|s| &s.bytes_read),
            bytes_written: sum(|s| &s.bytes_written),
            errors: sum(|s| &s.errors),
            latency_ns: self.latency.counts(),
        }
    }
}

pub struct StatsLayer {
    next: Arc<dyn Backend>,
    stats: Arc<VolumeStats>,
}

/// Which counters a call adds to.
type Counter = fn(&Shard) -> &AtomicU64;

impl StatsLayer {
    pub fn new(next: Arc<dyn Backend>, stats: Arc<VolumeStats>) -> Self {
        StatsLayer { next, stats }
    }

    /// Counts `f` in `ops` (and `bytes` more in `moved` on success), counts
    /// a failure, and times it when its turn to be sampled comes.
    fn count<T>(
        &self,
        ops: Counter,
        moved: Option<(Counter, u64)>,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = self.stats.begin(ops);
        let r = f();
        self.stats.end(start, moved, &r);
        r
    }
}

impl VolumeStats {
    /// A call begins: counted in `ops`, and its start if it is to be timed.
    fn begin(&self, ops: Counter) -> Option<Instant> {
        let n = ops(&self.shards[shard_index()]).fetch_add(1, Relaxed);
        n.is_multiple_of(LATENCY_SAMPLE).then(Instant::now)
    }

    /// A call ended with `r`: its latency if timed, its bytes in `moved` on
    /// success, a failure otherwise (on the shard of the thread it ended on).
    fn end<T>(&self, start: Option<Instant>, moved: Option<(Counter, u64)>, r: &Result<T>) {
        if let Some(start) = start {
            self.latency.record(start.elapsed().as_nanos() as u64);
        }
        let shard = &self.shards[shard_index()];
        match (r, moved) {
            (Ok(_), Some((counter, bytes))) => {
                counter(shard).fetch_add(bytes, Relaxed);
            }
            (Err(_), _) => {
                shard.errors.fetch_add(1, Relaxed);
            }
            _ => {}
        }
    }
}

impl Layer for StatsLayer {
    fn next(&self) -> &dyn Backend {
        &*self.next
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = buf.len() as u64;
        self.count(|s| &s.reads, Some((|s| &s.bytes_read, n)), || self.next.read_at(buf, offset))
    }
    fn can_share_reads(&self) -> bool {
        self.next.can_share_reads()
    }
    fn read_shared(&self, offset: u64, len: u64) -> Result<ReadData> {
        self.count(|s| &s.reads, Some((|s| &s.bytes_read, len)), || self.next.read_shared(offset, len))
    }
    fn can_read_now(&self) -> bool {
        self.next.can_read_now()
    }
    /// Counted as a read only when served or failed here; one that would
    /// wait is counted by the `read_at` that follows it.
    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<bool> {
        let shard = &self.stats.shards[shard_index()];
        let start = shard.reads.load(Relaxed).is_multiple_of(LATENCY_SAMPLE).then(Instant::now);
        let r = self.next.read_now(buf, offset);
        if matches!(r, Ok(false)) {
            return r;
        }
        shard.reads.fetch_add(1, Relaxed);
        if let Some(start) = start {
            self.stats.latency.record(start.elapsed().as_nanos() as u64);
        }
        match r {
            Ok(_) => shard.bytes_read.fetch_add(buf.len() as u64, Relaxed),
            Err(_) => shard.errors.fetch_add(1, Relaxed),
        };
        r
    }
    fn can_write_now(&self) -> bool {
        self.next.can_write_now()
    }
    /// Counted as a write only when taken here; one that would wait is
    /// counted by the `write_at` that follows it.
    fn write_now(&self, buf: &[u8], offset: u64) -> Result<bool> {
        let shard = &self.stats.shards[shard_index()];
        let start = shard.writes.load(Relaxed).is_multiple_of(LATENCY_SAMPLE).then(Instant::now);
        let r = self.next.write_now(buf, offset);
        if !matches!(r, Ok(true)) {
            return r;
        }
        shard.writes.fetch_add(1, Relaxed);
        if let Some(start) = start {
            self.stats.latency.record(start.elapsed().as_nanos() as u64);
        }
        shard.bytes_written.fetch_add(buf.len() as u64, Relaxed);
        r
    }
    fn can_submit(&self) -> bool {
        self.next.can_submit()
    }
    fn can_submit_writes(&self) -> bool {
        self.next.can_submit_writes()
    }
    fn kick(&self) {
        self.next.kick()
    }
    /// Counted as a call is: the operation when
    /// submitted, its bytes, failure and (sampled) latency when it finishes
    /// (from its submission: the wait for the connection's kick and for
    /// room in the store's ring included).
    fn submit(&self, client: u64, io: DeviceIo, done: DeviceDone) {
        let (ops, moved): (Counter, (Counter, u64)) = match &io {
            DeviceIo::Read { len, .. } => (|s| &s.reads, (|s| &s.bytes_read, u64::from(*len))),
            DeviceIo::Write { data, .. } => (|s| &s.writes, (|s| &s.bytes_written, data.len() as u64)),
        };
        let start = self.stats.begin(ops);
        let stats = self.stats.clone();
        self.next.submit(
            client,
            io,
            Box::new(move |r| {
                stats.end(start, Some(moved), &r);
                done(r)
            }),
        )
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let n = buf.len() as u64;
        self.count(|s| &s.writes, Some((|s| &s.bytes_written, n)), || self.next.write_at(buf, offset, fua))
    }
    fn flush(&self) -> Result<()> {
        self.count(|s| &s.flushes, None, || self.next.flush())
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        // A store that cannot trim declines the advice: no device error.
        let start = self.stats.begin(|s| &s.trims);
        let r = self.next.trim(offset, len);
        let declined = r == Err(BackendError::Unsupported);
        self.stats.end(start, None, if declined { &Ok(()) } else { &r });
        r
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.count(|s| &s.zeroes, None, || self.next.write_zeroes(offset, len, flags))
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.next.extents(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendError, Effect, FaultLayer, FaultOps, FaultRule, Faults, MemoryBackend};

    #[test]
    fn counts_operations_bytes_errors_and_latency() {
        let faults = Faults::new(vec![]);
        let bottom = Arc::new(FaultLayer::new(Arc::new(MemoryBackend::new(1 << 20)), faults.clone()));
        let stats = Arc::new(VolumeStats::default());
        let l: Arc<dyn Backend> = Arc::new(StatsLayer::new(bottom, stats.clone()));
        l.write_at(&[1; 8192], 0, false).unwrap();
        let mut b = [0u8; 4096];
        l.read_at(&mut b, 0).unwrap();
        faults.add(FaultRule::new(FaultOps::READ, Effect::Fail(BackendError::Io(libc::EIO))));
        assert!(l.read_at(&mut b, 0).is_err());
        l.flush().unwrap();
        let s = stats.snapshot();
        assert_eq!((s.reads, s.writes, s.flushes), (2, 1, 1));
        assert_eq!(
            (s.bytes_read, s.bytes_written, s.errors),
            (4096, 8192, 1),
            "a failed read moves no bytes"
        );
        assert_eq!(
            s.latency_ns.iter().sum::<u64>(),
            3,
            "the first call of each kind is timed, then one in 32"
        );
        assert!(Histogram::quantile(&s.latency_ns, 1.0) > 0);
    }

    #[test]
    fn quantiles_come_from_the_buckets() {
        let h = Histogram::default();
        for _ in 0..99 {
            h.record(1000); // bucket 9: [512, 1024)... 1000 is in [512,1024)
        }
        h.record(1_000_000);
        let c = h.counts();
        assert_eq!(Histogram::quantile(&c, 0.5), 1024);
        assert_eq!(Histogram::quantile(&c, 1.0), 1 << 20);
    }
}
