//! `fastsan serve`: run a target.

use anyhow::Context;
use fastsan_target::access::{read_secrets, Grant};
use fastsan_target::config::{parse_size, read_secret, BackendSpec, ConfigFile, ServerConfig, VolumeSpec};
use fastsan_target::tls::{TlsFiles, TlsMode};
use fastsan_target::Server;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{info, warn};

/// Serve volumes over BRP, NBD and NVMe/TCP (with --nvme) until SIGINT or SIGTERM.
///
/// With no volume given, serves one 1 GiB memory volume named vol0. Every
/// volume is also an NBD export of the same name (and the default export ""
/// when there is exactly one), for qemu, nbd-client, nbdinfo, fio...
/// Examples:
///   fastsan serve
///   fastsan serve --volume data=memory:4G --volume disk=file:/dev/nvme0n1,direct
///   fastsan serve --brp 0.0.0.0:10810 --secrets-file /etc/fastsan/secrets \
///       --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem \
///       --grant v:alice:rw --grant v:bob:ro --volume v=file:/srv/v.img
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
    /// read+write:delay=20ms, flush:enospc, trim:enotsup, any:stall; repeatable).
    /// Repeat --volume for several volumes.
    #[arg(long = "volume", short = 'v', value_name = "SPEC", value_parser = VolumeSpec::parse)]
    volumes: Vec<VolumeSpec>,
    /// TOML configuration file; flags given here override it (a --volume
    /// replaces the file's volume of the same name, a --grant the file's grant
    /// of the same volume to the same identity; the others stay, and a
    /// client's mode is the highest of the grants that match it).
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
    /// Allow NBD on a non-loopback address without TLS client certificates
    /// (which is then unauthenticated).
    #[arg(long)]
    nbd_allow_remote: bool,
    /// Serve NBD clients that prove no identity although the target
    /// authenticates: they bypass the secrets. Without it, secrets without
    /// --tls-ca turn the default NBD listener off and refuse an explicit one.
    #[arg(long)]
    nbd_insecure: bool,
    /// Serve NVMe/TCP (the Linux kernel's nvme-tcp, SPDK...) on this
    /// address, 127.0.0.1:4420 when given without one: one namespace per
    /// volume (NSIDs in volume order) and a discovery controller.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:4420")]
    nvme: Option<SocketAddr>,
    /// The NVM subsystem's NQN [default: nqn.2026-11.io.fastsan:HOSTNAME].
    #[arg(long, value_name = "NQN")]
    nvme_nqn: Option<String>,
    /// Allow NVMe/TCP on a non-loopback address (it authenticates nobody).
    #[arg(long)]
    nvme_allow_remote: bool,
    /// File holding the shared secret BRP clients must prove they know (the
    /// identity "default"). Authentication (this, --secrets-file or --tls-ca)
    /// is required when listening on an address other than loopback.
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// File of named secrets, one "IDENTITY SECRET" per line; BRP clients
    /// name theirs with --identity.
    #[arg(long, value_name = "PATH")]
    secrets_file: Option<PathBuf>,
    /// Who may open what: VOLUME:IDENTITY[:ro|rw] (rw when left out); VOLUME
    /// may be *, IDENTITY * (anyone authenticated) or anonymous. A volume no
    /// grant names is open to every authenticated client. Repeatable.
    #[arg(long = "grant", value_name = "RULE", value_parser = |s: &str| Grant::parse(s))]
    grants: Vec<Grant>,
    /// The target's TLS certificate chain (PEM), for BRP (brps://) and NBD (STARTTLS).
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA certificate(s) (PEM) of client certificates: clients that present
    /// one signed by it are known by its subject CN; others are anonymous.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// When TLS is used: off, allow (clients choose) or require
    /// [default: require with --tls-cert, off without].
    #[arg(long, value_name = "MODE", value_parser = |s: &str| s.parse::<TlsMode>())]
    tls: Option<TlsMode>,
    /// Allow authenticated BRP sessions in plaintext from other hosts (their
    /// frames are not protected after the handshake).
    #[arg(long)]
    insecure_plaintext: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (per protocol and per
    /// volume; `fastsan top` shows them).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Allow --metrics on a non-loopback address: the metrics have no
    /// authentication and name every volume.
    #[arg(long)]
    metrics_allow_remote: bool,
    /// Requests in flight per connection (credits granted to the initiator) [default: 256].
    #[arg(long, value_name = "N")]
    queue_depth: Option<u32>,
    /// Largest single transfer, e.g. 8M [default: 8M].
    #[arg(long, value_name = "SIZE")]
    max_transfer: Option<String>,
    /// Microseconds a connection serving one request at a time (a client at
    /// queue depth 1) spins for the next request instead of sleeping; 0 never
    /// spins [default: 50, at most 1000].
    #[arg(long, value_name = "US")]
    poll_window: Option<u64>,
    /// Microseconds a connection holds its replies, per round (two at most),
    /// for a client that sends its requests one at a time and keeps sending,
    /// so that one write answers several; 0 never holds them
    /// [default: 20, at most 1000].
    #[arg(long, value_name = "US")]
    coalesce_window: Option<u64>,
    /// Threads running blocking device I/O, for each file volume [default: 16].
    #[arg(long, value_name = "N")]
    io_threads: Option<usize>,
    /// Seconds a client has to finish the handshake [default: 10].
    #[arg(long, value_name = "SECS")]
    handshake_timeout: Option<f64>,
    /// Seconds a client may leave its replies unread, or stop in the middle of a
    /// request's data, before it is dropped [default: 30].
    #[arg(long, value_name = "SECS")]
    stall_timeout: Option<f64>,
    /// Seconds a stop waits for in-flight requests, and again for the flushes
    /// of the volumes (all at once), before it exits non-zero without them;
    /// keep both under a supervisor's stop timeout. A second SIGTERM or
    /// SIGINT exits at once [default: 30].
    #[arg(long, value_name = "SECS")]
    drain_timeout: Option<f64>,
    /// Where file volumes record a failed flush besides on the file itself
    /// (which a filesystem the failure turned read-only cannot take), so
    /// that a target restarted on them before the host reboots does not
    /// resume the sessions of before over the writes it lost. It must
    /// outlive restarts of the target: under systemd's RuntimeDirectory=,
    /// set RuntimeDirectoryPreserve=yes [default: $RUNTIME_DIRECTORY, else
    /// /run/fastsan as root, else $XDG_RUNTIME_DIR/fastsan (which lasts only
    /// while the user is logged in)].
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Most connections at once; more are refused as busy [default: 1024].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Most connections still in their handshake at once, a quarter of them
    /// from one address; when all are taken (or its address's quarter), a
    /// newcomer closes the oldest one still unsettled after a second (of its
    /// own address) [default: 64].
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

/// The run directory by default: systemd's (`RuntimeDirectory=fastsan`
/// sets `$RUNTIME_DIRECTORY`), /run/fastsan for root, the user's runtime
/// directory otherwise. All are emptied at boot, as a record there may be.
fn default_run_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    // (systemd may list several, separated by colons: the first.)
    if let Some(dirs) = var("RUNTIME_DIRECTORY") {
        return dirs.to_str().and_then(|d| d.split(':').next()).map(PathBuf::from).or(Some(dirs));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Some(PathBuf::from("/run/fastsan"));
    }
    var("XDG_RUNTIME_DIR").map(|d| d.join("fastsan"))
}

/// Descriptors the target needs besides its connections' and handshakes':
/// listeners, metrics scrapes (32 at most), the log and spares, and per
/// volume its file, an io_uring and its threads' timers, and a gateway's
/// connections to its remote (with its runtime's).
fn reserved_files(c: &ServerConfig) -> u64 {
    let volumes = c.volumes.iter().map(|v| match v.backend {
        fastsan_target::config::BackendSpec::Remote { connections, .. } => 8 + connections as u64 + 4,
        _ => 8,
    });
    volumes.fold(96u64, u64::saturating_add)
}

/// The connections that fit in `limit` open files, if fewer than
/// `max_connections`: past the limit, accept fails (EMFILE) and a client
/// waits unanswered in the backlog, where past `max_connections` it is
/// told BUSY. A connection may hold two (its socket, and the timer of
/// its reply coalescing). `None`: they all fit.
fn connections_within(c: &ServerConfig, limit: u64) -> anyhow::Result<Option<usize>> {
    let other = reserved_files(c).saturating_add(c.max_handshakes as u64);
    if other.saturating_add(2u64.saturating_mul(c.max_connections as u64)) <= limit {
        return Ok(None);
    }
    let fit = limit.saturating_sub(other) / 2;
    anyhow::ensure!(
        fit >= 16,
        "the open-file limit ({limit}) leaves room for {fit} connections beside {} volumes and \
         --max-handshakes {}: raise it (ulimit -n), or serve fewer",
        c.volumes.len(),
        c.max_handshakes
    );
    Ok(Some(fit as usize))
}

/// Raises the soft limit on open files to the hard one (as most servers
/// do: the soft default, 1024, is below what the default caps need), then
/// lowers `--max-connections` to what fits, saying so.
fn fit_open_files(c: &mut ServerConfig) -> anyhow::Result<()> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a struct of ours.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Ok(());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    if let Some(fit) = connections_within(c, lim.rlim_cur)? {
        warn!(
            "the open-file limit ({}) is below what --max-connections {} and --max-handshakes {} need: \
             serving at most {fit} connections (raise `ulimit -n` for more)",
            lim.rlim_cur, c.max_connections, c.max_handshakes
        );
        c.max_connections = fit;
    }
    Ok(())
}

/// Where a virtual machine's cpuidle-haltpoll says how long an idle vCPU
/// polls before it halts.
const HALT_POLL: &str = "/sys/module/haltpoll/parameters/guest_halt_poll_ns";

/// What to tell the operator of a virtual machine whose idle vCPUs halt at
/// once (guest halt polling 0, read from `path`): every thread that sleeps
/// is woken through the hypervisor, tens of microseconds on each request at
/// low queue depths (on this project's test machines fio's 4K reads at QD1
/// took 76-99 us instead of 20-23: docs/benchmarks.md, "Wake-ups are the
/// machine's idle policy"). `None` elsewhere.
fn idle_note(path: &str) -> Option<String> {
    let ns = std::fs::read_to_string(path).ok()?;
    (ns.trim() == "0").then(|| {
        format!(
            "idle vCPUs here halt without polling ({path} is 0): every wake-up goes through the \
             hypervisor, which adds tens of microseconds to each request at low queue depths \
             (README, \"On a virtual machine\")"
        )
    })
}

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
    c.nvme = a.nvme.or(file.nvme);
    c.nvme_nqn = a.nvme_nqn.or(file.nvme_nqn);
    c.nvme_allow_remote = a.nvme_allow_remote || file.nvme_allow_remote;
    if let Some(p) = a.secret_file.as_ref().or(file.secret_file.as_ref()) {
        c.secret = Some(read_secret(p)?);
    }
    if let Some(p) = a.secrets_file.as_ref().or(file.secrets_file.as_ref()) {
        c.secrets = read_secrets(p)?;
    }
    // Lists merge, a flag overriding the file's entry of the same name (a
    // volume, or a grant of a volume to an identity).
    c.grants = file.grants.iter().map(|g| Grant::parse(g)).collect::<Result<Vec<_>, _>>()?;
    c.grants.retain(|g| !a.grants.iter().any(|f| f.volume == g.volume && f.identity == g.identity));
    c.grants.extend(a.grants);
    let cert = a.tls_cert.or(file.tls_cert);
    let key = a.tls_key.or(file.tls_key);
    c.tls = match (cert, key) {
        (Some(cert), Some(key)) => Some(TlsFiles { cert, key, ca: a.tls_ca.or(file.tls_ca) }),
        (None, None) => None,
        _ => anyhow::bail!("give both tls_cert and tls_key, or neither"),
    };
    c.tls_mode = a.tls.or(file.tls);
    c.insecure_plaintext = a.insecure_plaintext || file.insecure_plaintext;
    c.metrics = a.metrics.or(file.metrics);
    c.metrics_allow_remote = a.metrics_allow_remote || file.metrics_allow_remote;
    if c.authenticates() && !c.client_certs() && !c.nbd_insecure {
        // NBD clients could prove who they are only with client
        // certificates: the default listener stays off (an explicit one is
        // refused by the config's check, unless insecure).
        if a.nbd.is_none() && file.nbd.is_none() && c.nbd.is_some() {
            c.nbd = None;
            info!("NBD is off: its clients cannot authenticate without --tls-ca (--nbd-insecure serves it anyway)");
        }
    }
    if c.nbd_insecure && c.authenticates() && (c.nbd.is_some() || c.nbd_unix.is_some()) {
        warn!("serving NBD with --nbd-insecure: NBD clients without a certificate are not authenticated");
    }
    c.volumes = file.volumes.iter().map(|s| VolumeSpec::parse(s)).collect::<Result<Vec<_>, _>>()?;
    c.volumes.retain(|v| !a.volumes.iter().any(|f| f.name == v.name));
    c.volumes.extend(a.volumes);
    if let Some(q) = a.queue_depth.or(file.queue_depth) {
        c.queue_depth = q;
    }
    if let Some(m) = a.max_transfer.as_ref().or(file.max_transfer.as_ref()) {
        c.max_transfer = u32::try_from(parse_size(m)?).context("max transfer too large")?;
    }
    if let Some(us) = a.poll_window.or(file.poll_window_us) {
        c.poll_window = std::time::Duration::from_micros(us);
    }
    if let Some(us) = a.coalesce_window.or(file.coalesce_window_us) {
        c.coalesce_window = std::time::Duration::from_micros(us);
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
    if let Some(s) = a.drain_timeout.or(file.drain_timeout) {
        c.drain_timeout = seconds("drain timeout", s)?;
    }
    c.run_dir = a.run_dir.or(file.run_dir).or_else(default_run_dir);
    if c.volumes.iter().any(|v| matches!(v.backend, BackendSpec::File { .. })) {
        use std::os::unix::fs::DirBuilderExt;
        let unusable = match &c.run_dir {
            None => Some("none given (--run-dir), and no $XDG_RUNTIME_DIR".to_owned()),
            Some(dir) => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .err()
                .map(|e| format!("{}: {e}", dir.display())),
        };
        if let Some(why) = unusable {
            warn!(
                "no run directory ({why}): a failed flush is recorded only on the file, which a \
                 filesystem the failure turned read-only cannot take"
            );
        }
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
    fit_open_files(&mut c)?;

    let brp_unix = c.brp_unix.clone();
    let server = Server::bind(c).await?;
    if let Some(note) = idle_note(HALT_POLL) {
        info!("{note}");
    }
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
        // A second signal while requests drain (a stalled device) ends the
        // process at once: what is unanswered stays unacknowledged, and what
        // file volumes took is in the page cache, unflushed.
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        // Straight to stderr: the log thread's queue is not written out by
        // process::exit, and this line would be lost with it.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "fastsan: second signal: exiting now, without finishing in-flight requests or flushing volumes"
        );
        std::process::exit(1);
    });
    // Where it listens, for people and supervisors (say! never panics on a closed pipe).
    let stop = if std::io::IsTerminal::is_terminal(&std::io::stdout()) { " (Ctrl-C to stop)" } else { "" };
    say!("fastsan: serving BRP on {}{stop}", server.local_addr());
    if let Some(p) = &brp_unix {
        say!("fastsan: serving BRP on unix socket {}", p.display());
    }
    if let Some(a) = server.nbd_addr() {
        say!("fastsan: serving NBD on {a}");
    }
    if let Some((a, nqn)) = server.nvme_addr() {
        say!("fastsan: serving NVMe/TCP on {a} (subsystem {nqn})");
    }
    if let Some(a) = server.metrics_addr() {
        say!("fastsan: serving metrics on http://{a}/metrics");
    }
    server.run().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_capped_by_the_open_file_limit() {
        let mut c = ServerConfig { max_connections: 1024, max_handshakes: 64, ..Default::default() };
        c.volumes = vec![VolumeSpec::parse("v=memory:1M").unwrap()];
        let other = reserved_files(&c) + 64;
        assert_eq!(connections_within(&c, 1 << 20).unwrap(), None, "a high limit");
        assert_eq!(connections_within(&c, other + 2048).unwrap(), None, "just enough");
        let usual = connections_within(&c, 1024).unwrap();
        assert_eq!(usual, Some(((1024 - other) / 2) as usize), "the usual soft limit");
        let e = connections_within(&c, other + 20).unwrap_err().to_string();
        assert!(e.contains("ulimit -n") && e.contains("--max-handshakes"), "{e}");
        // A gateway's connections to its remote count.
        let one = reserved_files(&c);
        c.volumes.push(VolumeSpec::parse("g=brp://127.0.0.1:1/v,connections=64").unwrap());
        assert_eq!(reserved_files(&c), one + 76);
        c.max_connections = usize::MAX;
        assert!(connections_within(&c, u64::MAX).unwrap().is_none(), "no overflow");
        assert!(e.contains("ulimit -n") && e.contains("--max-handshakes"), "{e}");
    }

    #[test]
    fn only_a_machine_whose_idle_vcpus_halt_at_once_gets_the_note() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("guest_halt_poll_ns");
        let path = p.to_str().unwrap();
        assert_eq!(idle_note(path), None, "no cpuidle-haltpoll: nothing to say");
        std::fs::write(&p, "200000\n").unwrap();
        assert_eq!(idle_note(path), None, "polling 200 us");
        std::fs::write(&p, "0\n").unwrap();
        let note = idle_note(path).expect("halting at once");
        assert!(note.contains(path) && note.contains("hypervisor"), "{note}");
    }
}
