//! The fastsan initiator: a client library for BRP volumes.
//!
//! It owns sessions over several connections, tags, credits, adaptive
//! temporal merge and reconnection. It never knows how a target stores data.
//!
//! ```no_run
//! # async fn demo() -> Result<(), fastsan_initiator::Error> {
//! use fastsan_initiator::{Options, Volume};
//! let vol = Volume::connect("brp://127.0.0.1:10810/vol0", Options::default()).await?;
//! vol.write_at(&[7u8; 4096], 0, false).await?;
//! assert_eq!(&vol.read(0, 4096).await?[..], &[7u8; 4096][..]);
//! vol.flush().await?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`url`] - [`BrpUrl`]: `brp://HOST:PORT/VOLUME` and
//!   `brp+unix:///VOLUME?socket=PATH`.
//! - `transport` (private) - the stream under a connection, TCP or unix.
//! - [`options`] - [`Options`], [`MergeMode`].
//! - [`handshake`] - [`handshake::ClientHandshake`], the handshake as a
//!   state machine without I/O (HELLO, AUTH, LIST, OPEN), and
//!   [`handshake::Handshake`], which drives it over a socket.
//! - [`conn`] - one connection: a sender task that merges queued requests
//!   into BATCH frames, a receiver task that matches replies by tag.
//! - [`session`] - [`Volume`]: N connections, load balancing, credits,
//!   splitting of large I/O, reconnection, transparent retry after the
//!   target's fence, restart detection; [`list`].
//! - `order` (private) - writes to overlapping ranges keep their order across retries.
//! - [`stats`] - [`InitiatorStats`], what the connections sent.
//! - [`nbd`] - [`nbd::NbdVolume`]: an export of any NBD server.
//! - [`nvme`] - [`nvme::NvmeVolume`]: a namespace of any NVMe/TCP
//!   controller, one connection per I/O queue.
//! - [`remote`] - [`Remote`]: any volume a URL names (BRP, NBD, mirror);
//!   what the commands open.
//! - [`mirror`] - [`Mirror`]: a volume mirrored across targets, its
//!   dirty-region log, generations, degraded legs and resync.
//! - [`blocking`] - [`BlockingVolume`], the same API without async.
//! - [`copy`] - chunks of a whole-volume copy: retried, a partial last
//!   block padded with zeros.
//! - [`error`] - [`Error`] and whether to retry.
//! - `fuzz_checks` (hidden) - what the `initiator_handshake` fuzz target checks.

pub mod blocking;
pub mod conn;
pub mod copy;
pub mod error;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod handshake;
pub mod metrics;
pub mod mirror;
pub mod nbd;
pub mod nvme;
pub mod options;
mod order;
mod overdue;
pub mod read_plan;
mod recycle;
pub mod remote;
mod runs_to_end;
pub mod session;
pub mod stats;
pub mod tls;
mod transport;
pub mod url;
mod writer;

pub use blocking::BlockingVolume;
pub use error::Error;
pub use fastsan_brp::handshake::{VOLUME_FAILED, VOLUME_READ_ONLY, VOLUME_VOLATILE};
/// A listed volume's flag set by this client, never on the wire: the
/// server named the volume but would not describe it (an NBD export whose
/// OPT_INFO was refused); its size and block size are 0.
pub const VOLUME_UNREADABLE: u32 = 1 << 31;
pub use fastsan_brp::{OpenInfo, Status, VolumeInfo};
pub use mirror::Mirror;
pub use options::{MergeMode, Options};
pub use remote::Remote;
pub use session::{list, Volume};
pub use stats::InitiatorStats;
pub use url::{BrpUrl, Endpoint};
