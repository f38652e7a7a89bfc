//! The fastsan target: serves volumes to initiators over the network.
//!
//! It owns listeners, connections, sessions, volumes and their backend
//! stacks, authentication and counters. It never knows how a client batches:
//! a BATCH frame is unpacked into ordinary requests at the door.
//!
//! # Layout
//! The life of a request, in order:
//! 1. [`driver`] - [`driver::serve_connection`], the one connection driver
//!    and the only code that touches a socket: runs a front end's handshake,
//!    then reads, and hands every complete frame to the front end to **decode**;
//! 2. [`frontend`] - one module per protocol ([`frontend::brp`],
//!    [`frontend::nbd`]): a sans-IO handshake, `decode` (the wire rules, into
//!    a protocol-neutral [`request::IoRequest`]), an encoder for replies, and
//!    the one function mapping a refusal to the protocol's wire code;
//! 3. [`pipeline`] - [`pipeline::Dispatcher::dispatch`]: credits, then
//!    **validated** by [`volume::Volume::validate`] (the only place volume
//!    rules live, the only maker of a [`volume::Op`]), **executed** by
//!    [`volume::Volume::execute`] (the only place a request touches the
//!    backend: inline for memory and null, on the volume's own
//!    [`pool::IoPool`] otherwise, fair between connections),
//!    **answered** by [`pipeline::Dispatcher::flush`] and [`pipeline::Writer`]
//!    (every ready reply in one `writev`). Refusals are logged there, once.
//!
//! Around it:
//! - [`server`] - [`Server`]: binds, admits handshakes through a [`gate`]
//!   (caps in total and per address; the oldest silent one closed for a
//!   newcomer), shuts down gracefully.
//! - [`config`] - volume specs, sizes, durations, the TOML file, [`config::ServerConfig`].
//! - [`catalog`] - the volumes by name; [`sessions`] - BRP sessions, their
//!   slots and the fence; [`fence`] - what a connection has started on the
//!   device, and the switch that stops it (a lost connection never lands a
//!   write after the initiator's retry).
//! - [`backend`] - the backend stack: stores (memory, file, null) and layers
//!   (stats, faults, delay, read-only), with capabilities; built in [`backend::build`].
//! - [`request`] - protocol-neutral requests and refusals (with their context).
//! - [`stats`] - counters per protocol; [`metrics`] - all of them, and each
//!   volume's, as Prometheus text at `--metrics ADDR`.
//! - [`tls`] - TLS (rustls) for every front end, and the stream a
//!   connection runs on; [`access`] - identities, grants, and the limiter
//!   of failed authentications: who may open what, the same on every protocol.
//! - [`fuzz_checks`] - what the handshake fuzz targets run.

pub mod access;
pub mod backend;
pub mod catalog;
pub mod coalesce;
pub mod config;
pub mod driver;
pub mod fence;
pub mod frontend;
#[doc(hidden)]
pub mod fuzz_checks;
pub mod gate;
pub mod metrics;
pub mod pipeline;
pub mod pool;
pub mod request;
pub mod server;
pub mod sessions;
pub mod stats;
pub mod tls;
pub mod volume;

pub use config::{ServerConfig, VolumeSpec};
pub use server::{Server, ServerError, ServerHandle};
