//! Counters of what the target did, for logs, tests and `--metrics`.

use crate::backend::Histogram;
use crate::request::Refusal;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Shards of a set of counters that every request moves (a front end's
/// here, a volume's in the stats layer): each thread counts in its own
/// (threads beyond this share), and a snapshot sums them.
pub(crate) const SHARDS: usize = 16;

/// The shard of the calling thread.
pub(crate) fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Relaxed) % SHARDS;
    }
    INDEX.with(|i| *i)
}

#[derive(Debug, Default)]
pub struct Stats {
    pub connections: AtomicU64,
    /// What every request counts ([`Stats::request`], [`Stats::moved`],
    /// [`Stats::began`], [`Stats::ended`]): requests, bytes, requests in
    /// flight, one shard per thread. One counter shared by every connection
    /// was a cache line passed between the cores at every request.
    shards: [Shard; SHARDS],
    /// BATCH frames received.
    pub batches: AtomicU64,
    /// Sub-requests that arrived inside BATCH frames.
    pub batched_requests: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
    /// The same, by [`Refusal::kind`].
    pub errors_by_kind: [AtomicU64; Refusal::KINDS.len()],
    /// Sampled time from a request's credit to its reply written (or dropped):
    /// the target's own latency for it, queueing, device and reply included.
    pub latency: Histogram,
    /// Connections closed for a malformed frame or handshake.
    pub protocol_errors: AtomicU64,
    /// Connections dropped for stalling: their replies unread, or their
    /// data stopped in the middle of a request, for the stall timeout.
    pub stalled: AtomicU64,
    pub auth_failures: AtomicU64,
    /// Connections refused before or in their handshake for a reason other
    /// than their own bad input: busy, an address over its failed-authentication
    /// budget, an access rule.
    pub refused: AtomicU64,
    /// Connections in the transmission phase now.
    pub open_connections: AtomicU64,
    /// Requests that arrived while their connection spun for them
    /// ([`crate::driver::BusyPoll`]) instead of sleeping.
    pub polled: AtomicU64,
    /// Requests whose replies were held for the next ones and went out with
    /// them ([`crate::coalesce`]), and the rounds waited for them.
    pub coalesced: AtomicU64,
    pub coalesce_rounds: AtomicU64,
}

/// One thread's share of the per-request counters, alone on its cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    requests: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    /// Requests that began here less those that ended here (wrapping: a
    /// request may end on another thread); the shards' sum is what is in flight.
    in_flight: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub connections: u64,
    pub requests: u64,
    pub batches: u64,
    pub batched_requests: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub errors: u64,
    pub errors_by_kind: [u64; Refusal::KINDS.len()],
    pub in_flight: u64,
    /// [`Stats::latency`]'s buckets.
    pub latency_ns: [u64; 40],
    pub protocol_errors: u64,
    pub stalled: u64,
    pub auth_failures: u64,
    pub refused: u64,
    pub open_connections: u64,
    pub polled: u64,
    pub coalesced: u64,
    pub coalesce_rounds: u64,
}

impl Default for StatsSnapshot {
    fn default() -> Self {
        Stats::default().snapshot()
    }
}

impl StatsSnapshot {
    /// The counters of several (one per protocol) together.
    pub fn sum(all: impl IntoIterator<Item = StatsSnapshot>) -> StatsSnapshot {
        all.into_iter().fold(StatsSnapshot::default(), |a, b| StatsSnapshot {
            connections: a.connections + b.connections,
            requests: a.requests + b.requests,
            batches: a.batches + b.batches,
            batched_requests: a.batched_requests + b.batched_requests,
            bytes_read: a.bytes_read + b.bytes_read,
            bytes_written: a.bytes_written + b.bytes_written,
            errors: a.errors + b.errors,
            errors_by_kind: std::array::from_fn(|i| a.errors_by_kind[i] + b.errors_by_kind[i]),
            in_flight: a.in_flight + b.in_flight,
            latency_ns: std::array::from_fn(|i| a.latency_ns[i] + b.latency_ns[i]),
            protocol_errors: a.protocol_errors + b.protocol_errors,
            stalled: a.stalled + b.stalled,
            auth_failures: a.auth_failures + b.auth_failures,
            refused: a.refused + b.refused,
            open_connections: a.open_connections + b.open_connections,
            polled: a.polled + b.polled,
            coalesced: a.coalesced + b.coalesced,
            coalesce_rounds: a.coalesce_rounds + b.coalesce_rounds,
        })
    }
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    fn shard(&self) -> &Shard {
        &self.shards[shard_index()]
    }

    /// A request received (a BATCH's sub-requests each count).
    pub fn request(&self) {
        self.shard().requests.fetch_add(1, Relaxed);
    }

    /// Bytes a request read and wrote.
    pub fn moved(&self, read: u64, written: u64) {
        let s = self.shard();
        s.bytes_read.fetch_add(read, Relaxed);
        s.bytes_written.fetch_add(written, Relaxed);
    }

    /// A request took its credit: in flight until [`Stats::ended`].
    pub fn began(&self) {
        self.shard().in_flight.fetch_add(1, Relaxed);
    }

    /// Its reply was written (or dropped).
    pub fn ended(&self) {
        self.shard().in_flight.fetch_sub(1, Relaxed);
    }

    fn sum(&self, field: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards.iter().fold(0u64, |a, s| a.wrapping_add(field(s).load(Relaxed)))
    }

    /// A request refused or failed.
    pub fn refused_request(&self, r: &Refusal) {
        self.errors.fetch_add(1, Relaxed);
        self.errors_by_kind[r.kind()].fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            connections: self.connections.load(Relaxed),
            requests: self.sum(|s| &s.requests),
            batches: self.batches.load(Relaxed),
            batched_requests: self.batched_requests.load(Relaxed),
            bytes_read: self.sum(|s| &s.bytes_read),
            bytes_written: self.sum(|s| &s.bytes_written),
            errors: self.errors.load(Relaxed),
            errors_by_kind: std::array::from_fn(|i| self.errors_by_kind[i].load(Relaxed)),
            // The shards are read one after another: a request that began on
            // a shard already read and ended on one not yet read leaves the
            // sum one short, below zero when nothing else is in flight.
            in_flight: (self.sum(|s| &s.in_flight) as i64).max(0) as u64,
            latency_ns: self.latency.counts(),
            protocol_errors: self.protocol_errors.load(Relaxed),
            stalled: self.stalled.load(Relaxed),
            auth_failures: self.auth_failures.load(Relaxed),
            refused: self.refused.load(Relaxed),
            open_connections: self.open_connections.load(Relaxed),
            polled: self.polled.load(Relaxed),
            coalesced: self.coalesced.load(Relaxed),
            coalesce_rounds: self.coalesce_rounds.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests begin on one thread and end on another (a pool's, or the
    /// writer's): each shard then holds part of the count, some below zero,
    /// and the snapshot still says how many are in flight.
    #[test]
    fn requests_in_flight_are_counted_across_threads() {
        let stats = std::sync::Arc::new(Stats::default());
        for _ in 0..10 {
            stats.request();
            stats.began();
            stats.moved(4096, 512);
        }
        let s = stats.clone();
        std::thread::spawn(move || {
            for _ in 0..7 {
                s.ended();
            }
        })
        .join()
        .unwrap();
        let snap = stats.snapshot();
        assert_eq!((snap.requests, snap.in_flight), (10, 3));
        assert_eq!((snap.bytes_read, snap.bytes_written), (40960, 5120));
        let s = stats.clone();
        std::thread::spawn(move || {
            s.request();
            s.began();
            s.ended();
            s.ended();
            s.ended();
            s.ended();
        })
        .join()
        .unwrap();
        let snap = stats.snapshot();
        assert_eq!((snap.requests, snap.in_flight), (11, 0));
        // A snapshot taken between the two halves of such a pair: never
        // below zero (a gauge of 18e18 requests, or an overflow in sum).
        stats.ended();
        assert_eq!(stats.snapshot().in_flight, 0);
        assert_eq!(StatsSnapshot::sum([stats.snapshot(), stats.snapshot()]).in_flight, 0);
    }
}
