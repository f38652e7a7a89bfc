//! Counters of what the initiator sent, shared by a session's connections.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The live counters; connections add to them as they send.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub requests: AtomicU64,
    /// Frames written (a BATCH counts once).
    pub frames: AtomicU64,
    pub batches: AtomicU64,
    pub batched_requests: AtomicU64,
    pub reconnects: AtomicU64,
    /// Requests sent again after their connection was lost (after the fence).
    pub retries: AtomicU64,
    /// Connections declared lost because a request got no reply in time.
    pub timeouts: AtomicU64,
}

/// A copy of the initiator's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InitiatorStats {
    pub requests: u64,
    pub frames: u64,
    pub batches: u64,
    pub batched_requests: u64,
    pub reconnects: u64,
    pub retries: u64,
    pub timeouts: u64,
}

impl Stats {
    pub fn snapshot(&self) -> InitiatorStats {
        InitiatorStats {
            requests: self.requests.load(Relaxed),
            frames: self.frames.load(Relaxed),
            batches: self.batches.load(Relaxed),
            batched_requests: self.batched_requests.load(Relaxed),
            reconnects: self.reconnects.load(Relaxed),
            retries: self.retries.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
        }
    }
}
