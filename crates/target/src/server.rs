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
use std::sync::Arc;
use tokio::net::TcpListener;
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
    Bind { addr: SocketAddr, source: std::io::Error },
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

    pub fn session_count(&self) -> usize {
        self.ctx.sessions.lock().len()
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
        let addr = config.brp;
        let listener = TcpListener::bind(addr).await.map_err(|source| ServerError::Bind { addr, source })?;
        let ctx = Arc::new(Ctx {
            pool: IoPool::new(config.io_threads),
            config,
            volumes,
            order,
            stats: Stats::default(),
            sessions: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
        });
        Ok(Server { ctx, listener })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle { ctx: self.ctx.clone() }
    }

    /// Serves until shutdown is requested, then drains and flushes.
    pub async fn run(self) -> std::io::Result<()> {
        let ctx = self.ctx;
        let tracker = TaskTracker::new();
        let slots = Arc::new(Semaphore::new(ctx.config.max_connections));
        info!(addr = %self.listener.local_addr()?, auth = ctx.config.secret.is_some(),
              serial = ctx.config.serial, "BRP listener ready");
        loop {
            let (stream, peer) = tokio::select! {
                _ = ctx.shutdown.cancelled() => break,
                r = self.listener.accept() => match r {
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
                match permit {
                    Some(_permit) => frontend::brp::serve(stream, peer, ctx).await,
                    None => frontend::brp::refuse_busy(stream, peer).await,
                }
            });
        }
        drop(self.listener);
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
