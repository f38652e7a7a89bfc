//! Counters of what the target did, for logs, tests and `--metrics`.

use crate::backend::Histogram;
use crate::request::Refusal;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Debug, Default)]
pub struct Stats {
    pub connections: AtomicU64,
    pub requests: AtomicU64,
    /// BATCH frames received.
    pub batches: AtomicU64,
    /// Sub-requests that arrived inside BATCH frames.
    pub batched_requests: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    /// Requests answered with an error status.
    pub errors: AtomicU64,
    /// The same, by [`Refusal::kind`].
    pub errors_by_kind: [AtomicU64; Refusal::KINDS.len()],
    /// Requests between their credit and their reply now.
    pub in_flight: AtomicU64,
    /// Sampled time from a request's credit to its reply written (or dropped):
    /// the target's own latency for it, queueing, device and reply included.
    pub latency: Histogram,
    /// Connections closed for a malformed frame or handshake.
    pub protocol_errors: AtomicU64,
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

    /// A request refused or failed.
    pub fn refused_request(&self, r: &Refusal) {
        self.errors.fetch_add(1, Relaxed);
        self.errors_by_kind[r.kind()].fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            connections: self.connections.load(Relaxed),
            requests: self.requests.load(Relaxed),
            batches: self.batches.load(Relaxed),
            batched_requests: self.batched_requests.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            errors: self.errors.load(Relaxed),
            errors_by_kind: std::array::from_fn(|i| self.errors_by_kind[i].load(Relaxed)),
            in_flight: self.in_flight.load(Relaxed),
            latency_ns: self.latency.counts(),
            protocol_errors: self.protocol_errors.load(Relaxed),
            auth_failures: self.auth_failures.load(Relaxed),
            refused: self.refused.load(Relaxed),
            open_connections: self.open_connections.load(Relaxed),
            polled: self.polled.load(Relaxed),
            coalesced: self.coalesced.load(Relaxed),
            coalesce_rounds: self.coalesce_rounds.load(Relaxed),
        }
    }
}
