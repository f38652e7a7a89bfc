//! Session options.

use std::time::Duration;

/// How queued requests leave for the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MergeMode {
    /// Every request is its own frame and its own write (the paper's BRP-2).
    #[cfg_attr(feature = "clap", value(help = "every request is its own frame (BRP-2)"))]
    Off,
    /// A request leaves at once at light load (one in flight: no added
    /// latency at QD1); under load, small requests queued together leave as
    /// one BATCH, and once `conn::MERGE_LOAD` requests are in flight on a
    /// window that has lately been deeper than that (or right after a burst
    /// on a deep window) the sender lingers two scheduler turns to gather
    /// more (`conn::loaded`). No timer (BRP-3).
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(help = "merge small requests under load, lingering two scheduler turns (BRP-3)")
    )]
    Adaptive,
    /// Every send is a BATCH, and the sender lingers a few scheduler turns to
    /// gather more before sending (BRP-3T): more merging, more latency at low load.
    #[cfg_attr(feature = "clap", value(help = "every send is a BATCH, lingering to gather more (BRP-3T)"))]
    Always,
}

#[derive(Debug, Clone)]
pub struct Options {
    /// Connections in the session (queue pairs), spread with least-loaded balancing.
    pub connections: usize,
    pub merge: MergeMode,
    /// Shared secret, when the target requires authentication. With a secret
    /// set, a target that does not prove it knows it is refused too.
    pub secret: Option<Vec<u8>>,
    /// The identity the secret belongs to, as the target's secrets file
    /// names it; empty: the target's one secret (`default`).
    pub identity: String,
    /// TLS for `brps://`: the CA to verify the target against, and the
    /// client's certificate if it has one ([`crate::tls::client_config`]).
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    /// Ask for CRC32C digests of headers and data.
    pub digests: bool,
    pub connect_timeout: Duration,
    /// How long a request waits for a lost connection to come back before it
    /// fails with a retryable error; zero disables reconnection (and so
    /// transparent retry). Until then a request whose connection is lost is
    /// sent again, after the target's fence, and the caller sees nothing.
    pub reconnect_timeout: Duration,
    /// How long a request may wait for its reply; past it the connection is
    /// taken for lost (closed, re-established, the request retried; NBD and
    /// NVMe/TCP fail it). Checked on a coarse clock: a request is given up
    /// between this and 1.25 times it (`overdue.rs`).
    pub request_timeout: Duration,
    /// Largest request that may be merged into a BATCH.
    pub merge_max_request: u32,
    /// Largest BATCH body.
    pub merge_max_bytes: u32,
    /// The session to open: 0 for a new one, else one this initiator's
    /// predecessor had (a restarted gateway's). The target then takes over
    /// its connections' slots and answers each OPEN only once what they
    /// started on the device has finished, so that nothing the predecessor
    /// sent can land after what this one writes (the fence).
    pub session: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            connections: 2,
            merge: MergeMode::Adaptive,
            secret: None,
            identity: String::new(),
            tls: None,
            digests: false,
            connect_timeout: Duration::from_secs(10),
            reconnect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            merge_max_request: 128 * 1024,
            merge_max_bytes: 4 << 20,
            session: 0,
        }
    }
}
