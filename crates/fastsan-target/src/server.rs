//! The server: opens the volumes, listens (BRP and NBD, on TCP and unix
//! sockets), accepts connections within a cap and hands each to
//! [`crate::driver::serve_connection`] with its front end; shuts down
//! gracefully (stop accepting, finish what is in flight, flush every volume).

use crate::access::{Access, Who, DEFAULT_IDENTITY};
use crate::backend::{Faults, VolumeStatsSnapshot};
use crate::catalog::Catalog;
use crate::config::{BackendSpec, ConfigError, ServerConfig};
use crate::driver::{refuse_busy, serve_connection, Transport};
use crate::frontend::brp::Brp;
use crate::frontend::nbd::Nbd;
use crate::frontend::nvme::{Nvme, Subsystem};
use crate::frontend::Frontend;
use crate::gate::Gate;
use crate::pipeline::{Budget, ConnEnv};
use crate::sessions::Sessions;
use crate::stats::{Stats, StatsSnapshot};
use crate::tls::ServerTls;
use crate::volume::Volume;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("volume {name}")]
    Volume {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot listen for {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: String,
        #[source]
        source: io::Error,
    },
}

pub struct Server {
    /// What BRP connections share; NBD's is the same but for its own
    /// counters (`nbd_env`), so that metrics tell the protocols apart.
    env: Arc<ConnEnv>,
    nbd_env: Arc<ConnEnv>,
    nvme_env: Arc<ConnEnv>,
    catalog: Arc<Catalog>,
    brp: Brp,
    nbd: Nbd,
    nvme: Nvme,
    nvme_tcp: Option<TcpListener>,
    brp_tcp: TcpListener,
    brp_unix: Option<Unix>,
    nbd_tcp: Option<TcpListener>,
    nbd_unix: Option<Unix>,
    gate: Arc<Gate>,
    drain_timeout: Duration,
    metrics: Option<TcpListener>,
}

/// Controls a running server from elsewhere (a signal handler, a test).
#[derive(Clone)]
pub struct ServerHandle {
    env: Arc<ConnEnv>,
    nbd_env: Arc<ConnEnv>,
    nvme_env: Arc<ConnEnv>,
    catalog: Arc<Catalog>,
}

impl ServerHandle {
    /// Starts a graceful shutdown; [`Server::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.env.shutdown.cancel();
    }

    /// The counters of every protocol together.
    pub fn stats(&self) -> StatsSnapshot {
        StatsSnapshot::sum(self.protocol_stats().into_iter().map(|(_, s)| s))
    }

    /// The counters of each protocol.
    pub fn protocol_stats(&self) -> [(&'static str, StatsSnapshot); 3] {
        [
            ("brp", self.env.stats.snapshot()),
            ("nbd", self.nbd_env.stats.snapshot()),
            ("nvme", self.nvme_env.stats.snapshot()),
        ]
    }

    /// The volumes, for metrics.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// Bytes of request and reply payload in flight now, all connections together.
    pub fn payload_in_flight(&self) -> u64 {
        self.env.budget.in_use()
    }

    /// One volume's counters and latency histogram.
    pub fn volume_stats(&self, volume: &str) -> Option<VolumeStatsSnapshot> {
        self.catalog.get(volume).map(|v| v.stats())
    }

    /// The fault rules of a volume that has a faults layer (`,faults=...`).
    pub fn faults(&self, volume: &str) -> Option<Faults> {
        self.catalog.get(volume)?.faults().cloned()
    }
}

impl Server {
    /// Checks the configuration, opens every volume and binds the listeners.
    pub async fn bind(mut config: ServerConfig) -> Result<Server, ServerError> {
        if config.volumes.is_empty() {
            config.volumes.push(ServerConfig::default_volume());
        }
        config.validate()?;
        // The listeners first: an address in use fails at once, before any
        // volume is opened (or logged as ready).
        let bind = |what: &'static str, addr: SocketAddr| async move {
            TcpListener::bind(addr).await.map_err(|source| ServerError::Bind {
                what,
                addr: addr.to_string(),
                source,
            })
        };
        let brp_tcp = bind("BRP (--brp)", config.brp).await?;
        let nbd_tcp = match config.nbd {
            Some(a) => Some(bind("NBD (--nbd)", a).await?),
            None => None,
        };
        let nvme_tcp = match config.nvme {
            Some(a) => Some(bind("NVMe/TCP (--nvme)", a).await?),
            None => None,
        };
        let metrics = match config.metrics {
            Some(a) => Some(bind("metrics (--metrics)", a).await?),
            None => None,
        };
        let brp_unix = config.brp_unix.as_deref().map(|p| Unix::bind("BRP (--brp-unix)", p)).transpose()?;
        let nbd_unix = config.nbd_unix.as_deref().map(|p| Unix::bind("NBD (--nbd-unix)", p)).transpose()?;
        let mut catalog = Catalog::default();
        // Where gateway volumes are served, for their remote sessions.
        let brp_at = brp_tcp.local_addr().map_err(|source| ServerError::Bind {
            what: "BRP (--brp)",
            addr: config.brp.to_string(),
            source,
        })?;
        let boot = config.boot_id.unwrap_or_else(boot_id);
        let origin = format!("{boot:016x}|{}|{brp_at}", host_name());
        for spec in &config.volumes {
            let mut spec = spec.clone();
            if let BackendSpec::Remote { origin: o, .. } = &mut spec.backend {
                *o = Some(origin.clone());
            }
            // Half the payload budget per volume: a stalled one leaves the
            // other half to the rest.
            let v = Volume::open(&spec, config.max_transfer, config.io_threads, config.run_dir.as_deref())
                .map_err(|source| ServerError::Volume { name: spec.name.clone(), source })?
                .with_payload_share(config.memory_budget / 2);
            info!(volume = v.name(), read_only = v.read_only(), "volume ready: {}", v.describe());
            catalog.add(v);
        }
        let stats = Arc::new(Stats::default());
        let access = Arc::new(access(&config)?);
        let queue_depth = if config.serial { 1 } else { config.queue_depth };
        let env = Arc::new(ConnEnv {
            stats: stats.clone(),
            shutdown: CancellationToken::new(),
            queue_depth,
            serial: config.serial,
            handshake_timeout: config.handshake_timeout,
            poll_window: config.poll_window,
            coalesce_window: config.coalesce_window,
            stall_timeout: config.stall_timeout,
            slots: Arc::new(Semaphore::new(config.max_connections)),
            budget: Budget::new(config.memory_budget),
            access: access.clone(),
        });
        // Random per start: a resuming initiator learns that the target restarted.
        let instance = rand::random::<u64>() | 1;
        info!(instance = format_args!("{instance:016x}"), "target instance");
        let catalog = Arc::new(catalog);
        let brp = Brp {
            catalog: catalog.clone(),
            sessions: Arc::new(Sessions::default()),
            access: access.clone(),
            queue_depth,
            stats,
            instance,
            boot,
        };
        let nqn = config.nvme_nqn.clone().unwrap_or_else(Subsystem::default_nqn);
        let nvme = Nvme { subsystem: Arc::new(Subsystem::new(nqn, &catalog, access.clone())) };
        let nbd = Nbd { catalog: catalog.clone(), access };
        let nbd_env = Arc::new(ConnEnv { stats: Arc::new(Stats::default()), ..(*env).clone() });
        let nvme_env = Arc::new(ConnEnv { stats: Arc::new(Stats::default()), ..(*env).clone() });
        Ok(Server {
            env,
            nbd_env,
            nvme_env,
            catalog,
            brp,
            nbd,
            nvme,
            nvme_tcp,
            brp_tcp,
            brp_unix,
            nbd_tcp,
            nbd_unix,
            gate: Arc::new(handshake_gate(config.max_handshakes)),
            drain_timeout: config.drain_timeout,
            metrics,
        })
    }

    /// The BRP listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.brp_tcp.local_addr().expect("a bound listener has an address")
    }

    /// The metrics listener's address, when there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    /// The NBD TCP listener's address, when there is one.
    pub fn nbd_addr(&self) -> Option<SocketAddr> {
        self.nbd_tcp.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    /// The NVMe/TCP listener's address and the subsystem's NQN, when it serves NVMe/TCP.
    pub fn nvme_addr(&self) -> Option<(SocketAddr, String)> {
        let a = self.nvme_tcp.as_ref()?.local_addr().expect("a bound listener has an address");
        Some((a, self.nvme.subsystem.nqn.clone()))
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            env: self.env.clone(),
            nbd_env: self.nbd_env.clone(),
            nvme_env: self.nvme_env.clone(),
            catalog: self.catalog.clone(),
        }
    }

    /// Serves until shutdown is requested, then drains and flushes. Fails
    /// when a volume could not be flushed: acknowledged writes may be lost.
    pub async fn run(self) -> io::Result<()> {
        let handle = self.handle();
        let Server {
            env,
            nbd_env,
            nvme_env,
            catalog,
            brp,
            nbd,
            nvme,
            nvme_tcp,
            brp_tcp,
            brp_unix,
            nbd_tcp,
            nbd_unix,
            gate,
            drain_timeout,
            metrics,
        } = self;
        if let Some(l) = metrics {
            let collector = crate::metrics::TargetCollector { server: handle.clone() };
            let render: crate::metrics::Render = Arc::new(move || crate::metrics::render(&collector));
            tokio::spawn(crate::metrics::serve(l, render, env.shutdown.clone()));
        }
        let tracker = TaskTracker::new();
        let a = &env.access;
        let tls = a.tls.as_ref().map_or("off", |t| match t.mode {
            crate::tls::TlsMode::Require => "required",
            _ => "allowed",
        });
        info!(
            addr = %brp_tcp.local_addr()?,
            identities = a.secrets.len(),
            client_certificates = a.tls.as_ref().is_some_and(|t| t.verify_clients),
            grants = a.grants.len(),
            tls,
            serial = env.serial,
            "BRP listener ready"
        );
        if let Some(u) = &brp_unix {
            info!(path = %u.path.display(), "BRP unix socket ready");
        }
        if let Some(l) = &nbd_tcp {
            info!(addr = %l.local_addr()?, "NBD listener ready");
        }
        if let Some(u) = &nbd_unix {
            info!(path = %u.path.display(), "NBD unix socket ready");
        }
        if let Some(l) = &nvme_tcp {
            let sub = &nvme.subsystem;
            info!(addr = %l.local_addr()?, nqn = sub.nqn, namespaces = sub.namespaces.len(), "NVMe/TCP listener ready");
            if tls == "required" || a.authenticates() {
                warn!(
                    "NVMe/TCP has no TLS or authentication here: its hosts are anonymous, see what \
                     grants give `anonymous`, and are not covered by --tls require"
                );
            }
            tokio::spawn(sub.clone().reaper(env.shutdown.clone()));
        }
        let nvme = Arc::new(nvme);
        let (brp, nbd) = (Arc::new(brp), Arc::new(nbd));
        // The listeners stay bound (refusing) until everything is drained and
        // flushed: a new target started meanwhile on the same address cannot
        // resume sessions while this one's writes may still land.
        let drained = CancellationToken::new();
        let accept = Acceptor { env: &env, tracker: &tracker, gate: &gate, drained: &drained };
        let accept_nbd = Acceptor { env: &nbd_env, ..accept };
        let accept_nvme = Acceptor { env: &nvme_env, ..accept };
        let drain = async {
            env.shutdown.cancelled().await;
            tracker.close();
            info!(
                connections = tracker.len(),
                "shutting down: no new connections; finishing in-flight requests"
            );
            let abandoned = drain_connections(&tracker, drain_timeout).await;
            let unflushed = flush_all(&catalog, drain_timeout).await;
            // Nothing of this server touches its files any more (unless it
            // abandoned requests: then its process is about to exit).
            if abandoned == 0 {
                for v in catalog.iter() {
                    v.unlock();
                }
            }
            drained.cancel();
            (abandoned, unflushed)
        };
        let (_, _, _, _, _, (abandoned, unflushed)) = tokio::join!(
            accept.run(brp_tcp, brp.clone()),
            accept.run_opt(brp_unix, brp),
            accept_nbd.run_opt(nbd_tcp, nbd.clone()),
            accept_nbd.run_opt(nbd_unix, nbd),
            accept_nvme.run_opt(nvme_tcp, nvme),
            drain,
        );
        let s = handle.stats();
        info!(
            requests = s.requests,
            batches = s.batches,
            bytes_read = s.bytes_read,
            bytes_written = s.bytes_written,
            errors = s.errors,
            "stopped"
        );
        if !unflushed.is_empty() {
            return Err(io::Error::other(format!("could not flush volume(s) {}", unflushed.join(", "))));
        }
        if abandoned > 0 {
            return Err(io::Error::other(format!(
                "{abandoned} connection(s) still had requests running after {drain_timeout:?}: \
                 they were left unanswered (a stalled device?)"
            )));
        }
        Ok(())
    }
}

/// Waits up to `limit` for every connection to finish, saying every 5 s
/// how many are left; how many were left at the end.
async fn drain_connections(tracker: &TaskTracker, limit: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let step = (deadline - tokio::time::Instant::now()).min(Duration::from_secs(5));
        if tokio::time::timeout(step, tracker.wait()).await.is_ok() {
            return 0;
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(
                connections = tracker.len(),
                "connections did not finish within {limit:?}; going on without them"
            );
            return tracker.len();
        }
        info!(
            connections = tracker.len(),
            "still finishing in-flight requests (a second signal exits at once)"
        );
    }
}

/// The security settings of `config`, its TLS files loaded.
fn access(config: &ServerConfig) -> Result<Access, ServerError> {
    let mode = config.tls_mode();
    let tls = match &config.tls {
        Some(files) if mode != crate::tls::TlsMode::Off => Some(Arc::new(ServerTls::load(files, mode)?)),
        _ => None,
    };
    let mut secrets = config.secrets.clone();
    if let Some(s) = &config.secret {
        secrets.insert(DEFAULT_IDENTITY.to_owned(), Arc::from(&s[..]));
    }
    Ok(Access {
        secrets,
        grants: config.grants.clone(),
        tls,
        nbd_insecure: config.nbd_insecure,
        insecure_plaintext: config.insecure_plaintext,
        limiter: Default::default(),
    })
}

/// Flushes every volume at once, off the runtime and bounded (a stalled
/// device must not hold the exit forever, nor one volume's the others':
/// one after another, each bounded, they could outlast a supervisor's stop
/// timeout); the names of those that failed.
async fn flush_all(catalog: &Catalog, limit: Duration) -> Vec<String> {
    let flushes = catalog.iter().map(|v| {
        let vol = v.clone();
        async move {
            let flush = tokio::task::spawn_blocking({
                let vol = vol.clone();
                move || vol.flush()
            });
            let failed = match tokio::time::timeout(limit, flush).await {
                Ok(Ok(Ok(()))) => {
                    info!(volume = vol.name(), "flushed");
                    return None;
                }
                Ok(Ok(Err(e))) => e.to_string(),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("did not finish within {limit:?}"),
            };
            error!(
                volume = vol.name(),
                "flush at shutdown failed: {failed}; acknowledged writes may be lost"
            );
            Some(vol.name().to_owned())
        }
    });
    futures::future::join_all(flushes).await.into_iter().flatten().collect()
}

/// A listening socket of any kind.
trait Listener: Send + 'static {
    type Stream: Transport;
    /// The next connection, a name for its peer, and its address (TCP).
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, String, Option<IpAddr>)>> + Send;
    /// The address a connection reached (TCP).
    fn local(s: &Self::Stream) -> Option<SocketAddr>;
}

impl Listener for TcpListener {
    type Stream = TcpStream;
    async fn accept(&self) -> io::Result<(TcpStream, String, Option<IpAddr>)> {
        let (s, peer) = TcpListener::accept(self).await?;
        tune(&s);
        // An IPv4 client of a dual-stack listener ([::]) comes as
        // ::ffff:a.b.c.d: its own address, so that it is loopback when it
        // is and is counted by itself (as an IPv6 /64 every IPv4 client in
        // the world shared one count of failed authentications).
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        Ok((s, peer.to_string(), Some(peer.ip())))
    }
    fn local(s: &TcpStream) -> Option<SocketAddr> {
        s.local_addr().ok().map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
    }
}

/// A unix listener, and its path (removed when the listener stops).
struct Unix {
    listener: UnixListener,
    path: PathBuf,
}

impl Unix {
    /// Binds a unix socket, replacing a stale socket file (never any other
    /// file, and never a socket something still listens on: a second
    /// target took a running one's address, and removed it as it stopped).
    fn bind(what: &'static str, path: &Path) -> Result<Unix, ServerError> {
        use std::os::unix::fs::FileTypeExt;
        let err = |source| ServerError::Bind { what, addr: path.display().to_string(), source };
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(err(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a socket")));
            }
            if listening(path).map_err(err)? {
                return Err(err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another process is listening on it (a running target?)",
                )));
            }
            std::fs::remove_file(path).map_err(err)?;
        }
        Ok(Unix { listener: UnixListener::bind(path).map_err(err)?, path: path.to_owned() })
    }
}

/// Whether something listens on the unix socket at `path`, asked without
/// waiting (a listener whose backlog is full counts as listening). Only a
/// refused connection makes it stale; any other answer (no permission, say)
/// is an error, never a reason to remove someone's socket.
fn listening(path: &Path) -> io::Result<bool> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let s = Socket::new(Domain::UNIX, Type::STREAM.nonblocking(), None)?;
    match s.connect(&SockAddr::unix(path)?) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::EINPROGRESS) => {
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(false),
        Err(e) => Err(e),
    }
}

impl Drop for Unix {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Listener for Unix {
    type Stream = UnixStream;
    async fn accept(&self) -> io::Result<(UnixStream, String, Option<IpAddr>)> {
        let (s, _) = self.listener.accept().await?;
        Ok((s, format!("unix:{}", self.path.display()), None))
    }
    fn local(_: &UnixStream) -> Option<SocketAddr> {
        None
    }
}

/// Accepts connections until shutdown; each runs as a tracked task. Its
/// handshake needs a ticket from the handshake [`Gate`]; its transmission
/// phase one of the `max_connections` slots (taken by the driver).
#[derive(Clone, Copy)]
struct Acceptor<'a> {
    env: &'a Arc<ConnEnv>,
    tracker: &'a TaskTracker,
    gate: &'a Arc<Gate>,
    /// Shutdown is complete: the listeners may close.
    drained: &'a CancellationToken,
}

impl Acceptor<'_> {
    async fn run_opt<F: Frontend, L: Listener>(&self, l: Option<L>, frontend: Arc<F>) {
        if let Some(l) = l {
            self.run(l, frontend).await
        }
    }

    async fn run<F: Frontend, L: Listener>(&self, l: L, frontend: Arc<F>) {
        loop {
            let (stream, peer, ip) = tokio::select! {
                _ = self.env.shutdown.cancelled() => return self.refuse_until_drained(&l).await,
                r = l.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // EMFILE and friends: log, breathe, keep serving the others.
                        warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            Stats::add(&self.env.stats.connections, 1);
            let (frontend, env, gate) = (frontend.clone(), self.env.clone(), self.gate.clone());
            self.tracker.spawn(async move {
                let Some(ticket) = gate.enter(ip) else {
                    Stats::add(&env.stats.refused, 1);
                    return refuse_busy(&*frontend, stream, &peer, "too many connections in their handshake")
                        .await;
                };
                // No address: a unix socket, this host.
                let via = L::local(&stream);
                let who = Who { ip, via, local: ip.is_none_or(|ip| ip.is_loopback()), ..Default::default() };
                serve_connection(frontend, stream, peer.into(), who, env, ticket).await
            });
        }
    }

    /// After shutdown: keeps the address, closing every new connection,
    /// until the drain and the final flush are done.
    async fn refuse_until_drained<L: Listener>(&self, l: &L) {
        loop {
            tokio::select! {
                _ = self.drained.cancelled() => return,
                r = l.accept() => match r {
                    Ok((_, peer, _)) => debug!(%peer, "connection closed: shutting down"),
                    // EMFILE: breathe, as while serving (this task also runs the drain).
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                },
            }
        }
    }
}

/// How long a handshake runs before the gate may close it for a newcomer:
/// a client's takes milliseconds (a few round trips).
const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// The listeners' gate: `total` handshakes at once, a quarter of them from
/// one address (see [`crate::gate`]).
fn handshake_gate(total: usize) -> Gate {
    Gate::new(total, total / 4, EVICTABLE_AFTER)
}

/// The host's boot, as a number: Linux draws a new boot_id at every boot
/// (0 where it cannot be read). FNV-1a, so every build gives the same number.
pub(crate) fn boot_id() -> u64 {
    let Ok(id) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else { return 0 };
    id.trim().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// This host's name (empty if unknown), for what must tell it from other
/// hosts: a gateway's remote sessions, the default NVMe subsystem NQN.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_owned()
}

/// No Nagle delay (replies leave at once), and keepalive probes so that a
/// vanished peer does not hold a connection slot forever.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&ka);
}
