//! `fastsan serve`: run a target.

use anyhow::Context;
use fastsan_target::config::{parse_size, read_secret, ConfigFile, ServerConfig, VolumeSpec};
use fastsan_target::Server;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{info, warn};

/// Serve volumes over BRP and NBD until SIGINT or SIGTERM.
///
/// With no volume given, serves one 1 GiB memory volume named vol0. Every
/// volume is also an NBD export of the same name (and the default export ""
/// when there is exactly one), for qemu, nbd-client, nbdinfo, fio...
/// Examples:
///   fastsan serve
///   fastsan serve --volume data=memory:4G --volume disk=file:/dev/nvme0n1,direct
///   fastsan serve --brp 0.0.0.0:10810 --secret-file /etc/fastsan/secret --volume v=file:/srv/v.img
///   fastsan serve --volume v=brp://10.0.0.5:10810/v     # a gateway: re-exports a remote volume
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// A volume: NAME=memory:SIZE, NAME=file:PATH (file or block device),
    /// NAME=null:SIZE, or NAME=brp://HOST:PORT/VOLUME (another target's volume,
    /// re-exported through the initiator; options ,secret=PATH and
    /// ,connections=N), with options ,ro (read-only), ,direct (O_DIRECT, files),
    /// ,delay=DURATION (added latency: a slow device) and ,faults=RULE (fault
    /// injection for tests; RULE is OPS:EFFECT[@START-END], e.g. write:eio@1M-2M,
    /// read+write:delay=20ms, flush:enospc, any:stall; repeatable).
    /// Repeat --volume for several volumes.
    #[arg(long = "volume", short = 'v', value_name = "SPEC", value_parser = VolumeSpec::parse)]
    volumes: Vec<VolumeSpec>,
    /// TOML configuration file; flags given here override it.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Address of the BRP listener [default: 127.0.0.1:10810].
    #[arg(long, value_name = "ADDR")]
    brp: Option<SocketAddr>,
    /// Also serve BRP on this unix socket (clients: brp+unix:///VOLUME?socket=PATH).
    #[arg(long, value_name = "PATH")]
    brp_unix: Option<PathBuf>,
    /// Address of the NBD listener [default: 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR", conflicts_with = "no_nbd")]
    nbd: Option<SocketAddr>,
    /// Serve no NBD over TCP.
    #[arg(long)]
    no_nbd: bool,
    /// Also serve NBD on this unix socket.
    #[arg(long, value_name = "PATH")]
    nbd_unix: Option<PathBuf>,
    /// Allow NBD on a non-loopback address (NBD has no authentication yet).
    #[arg(long)]
    nbd_allow_remote: bool,
    /// Serve NBD even with --secret-file: NBD cannot authenticate clients (no
    /// TLS yet), so anyone who reaches it bypasses the secret. Without it, a
    /// secret turns the default NBD listener off and refuses an explicit one.
    #[arg(long)]
    nbd_insecure: bool,
    /// File holding the shared secret BRP clients must prove they know. Required
    /// when listening on an address other than loopback. NBD, which cannot
    /// check it, is then off (see --nbd-insecure).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// Requests in flight per connection (credits granted to the initiator) [default: 256].
    #[arg(long, value_name = "N")]
    queue_depth: Option<u32>,
    /// Largest single transfer, e.g. 8M [default: 8M].
    #[arg(long, value_name = "SIZE")]
    max_transfer: Option<String>,
    /// Threads running blocking device I/O, for each file volume [default: 16].
    #[arg(long, value_name = "N")]
    io_threads: Option<usize>,
    /// Seconds a client has to finish the handshake [default: 10].
    #[arg(long, value_name = "SECS")]
    handshake_timeout: Option<f64>,
    /// Seconds a client may leave its replies unread before it is dropped [default: 30].
    #[arg(long, value_name = "SECS")]
    stall_timeout: Option<f64>,
    /// Most connections at once; more are refused as busy [default: 1024].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Most connections still in their handshake at once, a quarter of them
    /// from one address [default: 64].
    #[arg(long, value_name = "N")]
    max_handshakes: Option<usize>,
    /// Most request and reply payload in flight, all clients together, e.g. 2G [default: 1G].
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<String>,
    /// Process each connection's requests one at a time (the paper's BRP-1,
    /// "parallelism off"); for comparisons only.
    #[arg(long)]
    serial: bool,
}

/// A duration given in seconds: more than 0, at most an hour.
fn seconds(what: &str, s: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(s > 0.0 && s <= 3600.0, "{what} must be more than 0 and at most 3600 seconds (got {s})");
    Ok(Duration::from_secs_f64(s))
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let file = match &a.config {
        Some(p) => ConfigFile::load(p)?,
        None => ConfigFile::default(),
    };
    let mut c = ServerConfig::default();
    if let Some(b) = a.brp.or(file.brp) {
        c.brp = b;
    }
    if let Some(n) = a.nbd.or(file.nbd) {
        c.nbd = Some(n);
    }
    if a.no_nbd || (file.no_nbd && a.nbd.is_none()) {
        c.nbd = None;
    }
    c.brp_unix = a.brp_unix.or(file.brp_unix);
    c.nbd_unix = a.nbd_unix.or(file.nbd_unix);
    c.nbd_allow_remote = a.nbd_allow_remote || file.nbd_allow_remote;
    c.nbd_insecure = a.nbd_insecure || file.nbd_insecure;
    if let Some(p) = a.secret_file.as_ref().or(file.secret_file.as_ref()) {
        c.secret = Some(read_secret(p)?);
        // NBD cannot check the secret: the default listener stays off (an
        // explicit one is refused by the config's check, unless insecure).
        if a.nbd.is_none() && file.nbd.is_none() && !c.nbd_insecure && c.nbd.is_some() {
            c.nbd = None;
            info!("NBD is off: it cannot authenticate clients, and a secret is set (--nbd-insecure serves it anyway)");
        }
    }
    if c.nbd_insecure && c.secret.is_some() && (c.nbd.is_some() || c.nbd_unix.is_some()) {
        warn!("serving NBD with a secret set (--nbd-insecure): NBD clients are not authenticated");
    }
    c.volumes = file.volumes.iter().map(|s| VolumeSpec::parse(s)).collect::<Result<_, _>>()?;
    c.volumes.extend(a.volumes);
    if let Some(q) = a.queue_depth.or(file.queue_depth) {
        c.queue_depth = q;
    }
    if let Some(m) = a.max_transfer.as_ref().or(file.max_transfer.as_ref()) {
        c.max_transfer = u32::try_from(parse_size(m)?).context("max transfer too large")?;
    }
    if let Some(n) = a.io_threads.or(file.io_threads) {
        c.io_threads = n;
    }
    if let Some(s) = a.handshake_timeout.or(file.handshake_timeout) {
        c.handshake_timeout = seconds("handshake timeout", s)?;
    }
    if let Some(s) = a.stall_timeout.or(file.stall_timeout) {
        c.stall_timeout = seconds("stall timeout", s)?;
    }
    if let Some(n) = a.max_connections.or(file.max_connections) {
        c.max_connections = n;
    }
    if let Some(n) = a.max_handshakes.or(file.max_handshakes) {
        c.max_handshakes = n;
    }
    if let Some(m) = a.memory_budget.as_ref().or(file.memory_budget.as_ref()) {
        c.memory_budget = parse_size(m)?;
    }
    c.serial = a.serial || file.serial;

    let brp_unix = c.brp_unix.clone();
    let server = Server::bind(c).await?;
    let handle = server.handle();
    // The handlers are in place before the addresses are printed: a signal
    // sent as soon as a supervisor (or a test) sees them is a clean
    // shutdown, not the default action that kills without draining.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => info!("SIGINT received"),
            _ = term.recv() => info!("SIGTERM received"),
        }
        handle.shutdown();
    });
    println!("fastsan: serving BRP on {} (Ctrl-C to stop)", server.local_addr());
    if let Some(p) = &brp_unix {
        println!("fastsan: serving BRP on unix socket {}", p.display());
    }
    if let Some(a) = server.nbd_addr() {
        println!("fastsan: serving NBD on {a}");
    }
    server.run().await?;
    Ok(())
}
