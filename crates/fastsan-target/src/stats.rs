//! Counters of what the target did, for logs, tests and `--metrics`.

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
    /// Connections closed for a malformed frame or handshake.
    pub protocol_errors: AtomicU64,
    pub auth_failures: AtomicU64,
    /// Connections refused before or in their handshake for a reason other
    /// than their own bad input: busy, an address over its failed-authentication
    /// budget, an access rule.
    pub refused: AtomicU64,
    /// Connections in the transmission phase now.
    pub open_connections: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub connections: u64,
    pub requests: u64,
    pub batches: u64,
    pub batched_requests: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub errors: u64,
    pub protocol_errors: u64,
    pub auth_failures: u64,
    pub refused: u64,
    pub open_connections: u64,
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
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
            protocol_errors: self.protocol_errors.load(Relaxed),
            auth_failures: self.auth_failures.load(Relaxed),
            refused: self.refused.load(Relaxed),
            open_connections: self.open_connections.load(Relaxed),
        }
    }
}
