//! The fastsan target: serves volumes to initiators over the network.
//!
//! It owns listeners, connections, sessions, volumes and their backends,
//! authentication and counters. It never knows how a client batches: a BATCH
//! frame is unpacked into ordinary requests at the door.
//!
//! # Layout
//! - [`config`] - volume specs, sizes, the TOML file, [`config::ServerConfig`].
//! - [`server`] - [`Server`]: binds, accepts within a cap, shuts down gracefully.
//! - [`frontend::brp`] - one BRP connection: handshake, then **decode**
//!   (`read_loop`, `decode`: wire rules into an [`request::IoRequest`]).
//! - [`pipeline`] - what every front end shares after decoding: credits,
//!   **check** ([`volume::Volume::validate`]) → **device** ([`exec::execute`])
//!   → **reply** ([`pipeline::write_replies`], one `writev` for all ready replies).
//! - [`request`] - protocol-neutral requests and refusals.
//! - [`volume`] - a named backend with its limits; the one place requests are checked.
//! - [`exec`] - the one place a request touches the device, and the I/O thread pool.
//! - [`backend`] - memory (sparse, chunk-locked), file or block device (O_DIRECT optional), null.
//! - [`stats`] - counters.

pub mod backend;
pub mod config;
pub mod exec;
pub mod frontend;
pub mod pipeline;
pub mod request;
pub mod server;
pub mod stats;
pub mod volume;

pub use config::{ServerConfig, VolumeSpec};
pub use server::{Server, ServerError, ServerHandle};
