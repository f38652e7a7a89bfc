//! The server: opens the volumes, listens, accepts connections within a cap,
//! tracks sessions, and shuts down gracefully (stop accepting, finish what is
//! in flight, flush every volume).

use crate::config::{ConfigError, ServerConfig};
use crate::exec::IoPool;
use crate::frontend;
use crate::stats::{Stats, StatsSnapshot};
use crate::volume::Volume;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("volume {name}: {source}")]
    Volume { name: String, source: std::io::Error },
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
}

/// A session: the connections an initiator opened to one volume under one id.
pub struct Session {
    pub volume: String,
    pub connections: usize,
}

/// What every connection shares.
pub struct Ctx {
    pub config: ServerConfig,
    pub volumes: HashMap<String, Arc<Volume>>,
    /// Volume names in configuration order, for LIST.
    pub order: Vec<String>,
    pub stats: Stats,
    pub sessions: Mutex<HashMap<u64, Session>>,
    pub pool: IoPool,
    pub shutdown: CancellationToken,
}

pub struct Server {
    ctx: Arc<Ctx>,
    listener: TcpListener,
    nbd: Option<TcpListener>,
    nbd_unix: Option<(UnixListener, PathBuf)>,
}

/// Which protocol a TCP listener speaks.
#[derive(Clone, Copy, Debug)]
enum Proto {
    Brp,
    Nbd,
}

/// Controls a running server from elsewhere (a signal handler, a test).
#[derive(Clone)]
pub struct ServerHandle {
    ctx: Arc<Ctx>,
}

impl ServerHandle {
    /// Starts a graceful shutdown; [`Server::run`] returns when it is done.
    pub fn shutdown(&self) {
        self.ctx.shutdown.cancel();
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.ctx.stats.snapshot()
    }
}

impl Server {
    /// Checks the configuration, opens every volume and binds the listener.
    pub async fn bind(mut config: ServerConfig) -> Result<Server, ServerError> {
        if config.volumes.is_empty() {
            config.volumes.push(ServerConfig::default_volume());
        }
        config.validate()?;
        let mut volumes = HashMap::new();
        let mut order = Vec::new();
        for spec in &config.volumes {
            let v = Volume::open(spec, config.max_transfer)
                .map_err(|source| ServerError::Volume { name: spec.name.clone(), source })?;
            info!(volume = %v.name, read_only = v.read_only, "volume ready: {}", v.backend.describe());
            order.push(v.name.clone());
            volumes.insert(v.name.clone(), Arc::new(v));
        }
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { addr: addr.to_string(), source })
        };
        let listener = bind(config.brp).await?;
        let nbd = match config.nbd {
            Some(a) => Some(bind(a).await?),
            None => None,
        };
        let nbd_unix = match &config.nbd_unix {
            Some(p) => Some((bind_unix(p)?, p.clone())),
            None => None,
        };
        let ctx = Arc::new(Ctx {
            pool: IoPool::new(config.io_threads),
            config,
            volumes,
            order,
            stats: Stats::default(),
            sessions: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
        });
        Ok(Server { ctx, listener, nbd, nbd_unix })
    }

    /// The BRP listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// The NBD TCP listener's address, when there is one.
    pub fn nbd_addr(&self) -> Option<SocketAddr> {
        self.nbd.as_ref().map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle { ctx: self.ctx.clone() }
    }

    /// Serves until shutdown is requested, then drains and flushes.
    pub async fn run(self) -> std::io::Result<()> {
        let Server { ctx, listener, nbd, nbd_unix } = self;
        let tracker = TaskTracker::new();
        let slots = Arc::new(Semaphore::new(ctx.config.max_connections));
        info!(addr = %listener.local_addr()?, auth = ctx.config.secret.is_some(),
              serial = ctx.config.serial, "BRP listener ready");
        if let Some(l) = &nbd {
            info!(addr = %l.local_addr()?, "NBD listener ready");
        }
        if let Some((_, p)) = &nbd_unix {
            info!(path = %p.display(), "NBD unix socket ready");
        }
        let brp = accept_tcp(listener, Proto::Brp, &ctx, &tracker, &slots);
        let nbd = async {
            if let Some(l) = nbd {
                accept_tcp(l, Proto::Nbd, &ctx, &tracker, &slots).await;
            }
        };
        let unix = async {
            if let Some((l, path)) = nbd_unix {
                accept_unix(l, &ctx, &tracker, &slots).await;
                let _ = std::fs::remove_file(path);
            }
        };
        tokio::join!(brp, nbd, unix);
        tracker.close();
        info!(connections = tracker.len(), "shutting down: no new connections; finishing in-flight requests");
        if tokio::time::timeout(ctx.config.drain_timeout, tracker.wait()).await.is_err() {
            warn!("some connections did not finish within {:?}", ctx.config.drain_timeout);
        }
        for name in &ctx.order {
            let v = &ctx.volumes[name];
            match v.backend.flush() {
                Ok(()) => info!(volume = %name, "flushed"),
                Err(e) => warn!(volume = %name, error = %e, "flush at shutdown failed"),
            }
        }
        let s = ctx.stats.snapshot();
        info!(
            requests = s.requests,
            batches = s.batches,
            bytes_read = s.bytes_read,
            bytes_written = s.bytes_written,
            errors = s.errors,
            "stopped"
        );
        Ok(())
    }
}

/// Accepts TCP connections until shutdown; each runs as a tracked task
/// while it holds one of the `max_connections` slots.
async fn accept_tcp(
    l: TcpListener,
    proto: Proto,
    ctx: &Arc<Ctx>,
    tracker: &TaskTracker,
    slots: &Arc<Semaphore>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            r = l.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: log, breathe, keep serving the others.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tune(&stream);
        Stats::add(&ctx.stats.connections, 1);
        let permit = slots.clone().try_acquire_owned().ok();
        let ctx = ctx.clone();
        tracker.spawn(async move {
            let Some(_permit) = permit else {
                return match proto {
                    Proto::Brp => frontend::brp::refuse_busy(stream, peer).await,
                    Proto::Nbd => warn!(%peer, "NBD connection refused: too many connections"),
                };
            };
            match proto {
                Proto::Brp => frontend::brp::serve(stream, peer, ctx).await,
                Proto::Nbd => {
                    let (rd, wr) = stream.into_split();
                    frontend::nbd::serve(rd, wr, peer.to_string(), ctx).await
                }
            }
        });
    }
}

async fn accept_unix(l: UnixListener, ctx: &Arc<Ctx>, tracker: &TaskTracker, slots: &Arc<Semaphore>) {
    loop {
        let stream = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            r = l.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        Stats::add(&ctx.stats.connections, 1);
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            warn!("NBD unix connection refused: too many connections");
            continue;
        };
        let ctx = ctx.clone();
        tracker.spawn(async move {
            let _permit = permit;
            let (rd, wr) = stream.into_split();
            frontend::nbd::serve(rd, wr, "unix".into(), ctx).await
        });
    }
}

/// Binds a unix socket, replacing a stale socket file (never any other file).
fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    use std::os::unix::fs::FileTypeExt;
    let err = |source| ServerError::Bind { addr: path.display().to_string(), source };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            let e = std::io::Error::new(std::io::ErrorKind::AlreadyExists, "exists and is not a socket");
            return Err(err(e));
        }
        std::fs::remove_file(path).map_err(err)?;
    }
    UnixListener::bind(path).map_err(err)
}

/// No Nagle delay (replies leave at once), and keepalive probes so that a
/// vanished peer does not hold a connection slot forever.
pub(crate) fn tune(stream: &tokio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
    let ka = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(30))
        .with_interval(std::time::Duration::from_secs(10))
        .with_retries(3);
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&ka);
}
