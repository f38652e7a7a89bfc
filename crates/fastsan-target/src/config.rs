//! Configuration: volume specifications (`NAME=memory:SIZE`, `NAME=file:PATH`,
//! `NAME=null:SIZE`, with options `,ro`, `,direct`, `,delay=DURATION` and
//! `,faults=RULE`), sizes (`512`, `64K`, `1G`, `2TiB`), durations (`500us`,
//! `10ms`, `2s`), and the TOML config file. Command-line flags and the file
//! produce the same [`ServerConfig`].

use crate::backend::FaultRule;
use crate::tls::TlsMode;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default [`ServerConfig::poll_window`]. A connection spins only for a client
/// whose next request came within half of it ([`crate::driver::BusyPoll`]): a
/// client at QD1 on loopback turns around in 12-25 us on this machine, while one
/// pacing its requests at 20 K IOPS leaves longer gaps. A host whose clients turn
/// around more slowly needs a larger window (60 us measured alike here: QD1 1.03x,
/// the paced point's server CPU 13.4 -> 14.4 us per I/O).
pub const DEFAULT_POLL_WINDOW: Duration = Duration::from_micros(50);
/// The default [`ServerConfig::coalesce_window`]: one round of holding the
/// replies of a client that sends one request at a time
/// ([`crate::coalesce`]). 20 us is about a tenth of what such a client (fio's
/// NBD engine at queue depth 32) spends per request on this machine, so a
/// round gathers a few; two rounds at most hold a reply ~40 us past its
/// completion, and only while the client keeps sending.
pub const DEFAULT_COALESCE_WINDOW: Duration = Duration::from_micros(20);
/// The longest coalescing round allowed.
pub const MAX_COALESCE_WINDOW: Duration = Duration::from_millis(1);
/// The longest poll window allowed: a connection notices a stop or a shutdown
/// at the end of its window at the latest.
pub const MAX_POLL_WINDOW: Duration = Duration::from_millis(1);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("volume spec {spec:?}: {why} (expected NAME=memory:SIZE, NAME=file:PATH, NAME=null:SIZE or NAME=brp://HOST:PORT/VOLUME, options ,ro ,direct ,delay=DURATION ,faults=RULE)")]
    Volume { spec: String, why: String },
    #[error("size {0:?}: expected a number with an optional suffix K, M, G, T (powers of 1024), e.g. 512M")]
    Size(String),
    #[error("duration {0:?}: expected a number with a unit us, ms or s, e.g. 10ms")]
    Duration(String),
    #[error("config file {path}: {why}")]
    File { path: String, why: String },
    /// A file of secrets (`--secret-file`, `--secrets`) that cannot be read or parsed.
    #[error("secret file {path}: {why}")]
    SecretFile { path: String, why: String },
    #[error("{0}")]
    Invalid(String),
}

/// What stores a volume's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    Memory {
        size: u64,
    },
    File {
        path: PathBuf,
        direct: bool,
    },
    Null {
        size: u64,
    },
    /// Another target's volume (`brp://HOST:PORT/VOLUME`, `brp+unix://...`):
    /// the gateway store.
    Remote {
        url: String,
        secret: Option<PathBuf>,
        connections: usize,
        /// Where the gateway serves this volume (this host's boot and name,
        /// its BRP address), set by the server: the remote session is
        /// derived from it ([`crate::backend::remote::gateway_session`]), so
        /// that a restarted gateway takes over its predecessor's. `None`: a
        /// new session.
        origin: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    pub name: String,
    pub backend: BackendSpec,
    pub read_only: bool,
    /// A fixed latency added to every data operation (the delay layer).
    pub delay: Option<Duration>,
    /// Fault rules (the faults layer); `Some(empty)`: the layer, no rule yet.
    pub faults: Option<Vec<FaultRule>>,
}

impl VolumeSpec {
    pub fn parse(spec: &str) -> Result<Self, ConfigError> {
        let err = |why: &str| ConfigError::Volume { spec: spec.to_owned(), why: why.to_owned() };
        let (name, rest) = spec.split_once('=').ok_or_else(|| err("missing '='"))?;
        check_name(name).map_err(|why| err(&why))?;
        let (kind, rest) = rest.split_once(':').ok_or_else(|| err("missing ':' after the kind"))?;
        let mut parts = rest.split(',');
        let arg = parts.next().unwrap_or_default();
        let (mut read_only, mut direct, mut delay, mut faults) = (false, false, None, None);
        let (mut secret, mut connections) = (None, 2usize);
        let remote = kind == "brp" || kind == "brp+unix";
        for opt in parts {
            match opt.split_once('=') {
                None if opt == "ro" => read_only = true,
                None if opt == "direct" => direct = true,
                Some(("secret", path)) if remote => secret = Some(PathBuf::from(path)),
                Some(("connections", n)) if remote => {
                    connections = n
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| err("connections must be 1..=64"))?
                }
                Some(("delay", d)) => delay = Some(parse_duration(d).map_err(|e| err(&e.to_string()))?),
                Some(("faults", "none")) => {
                    faults.get_or_insert_with(Vec::new);
                }
                Some(("faults", rule)) => {
                    faults.get_or_insert_with(Vec::new).push(FaultRule::parse(rule).map_err(|e| err(&e))?)
                }
                _ => return Err(err(&format!("unknown option {opt:?}"))),
            }
        }
        if direct && kind != "file" {
            return Err(err("option 'direct' applies to file volumes only"));
        }
        let size = |s: &str| match parse_size(s) {
            Ok(0) => Err(err("size must be above zero")),
            // Served in whole blocks of 512 bytes (BRP's sector): a tail would be cut off.
            Ok(n) if n % 512 != 0 => Err(err("size must be a multiple of 512 bytes")),
            Ok(n) => Ok(n),
            Err(e) => Err(err(&e.to_string())),
        };
        let backend = match kind {
            "memory" => BackendSpec::Memory { size: size(arg)? },
            "null" => BackendSpec::Null { size: size(arg)? },
            "file" if arg.is_empty() => return Err(err("missing path")),
            "file" => BackendSpec::File { path: PathBuf::from(arg), direct },
            "brp" | "brp+unix" => {
                let url = format!("{kind}:{arg}");
                fastsan_initiator::BrpUrl::parse(&url).map_err(|e| err(&e.to_string()))?;
                BackendSpec::Remote { url, secret, connections, origin: None }
            }
            other => return Err(err(&format!("unknown kind {other:?}"))),
        };
        Ok(VolumeSpec { name: name.to_owned(), backend, read_only, delay, faults })
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > fastsan_brp::limits::MAX_NAME {
        return Err(format!("a name has 1 to {} bytes", fastsan_brp::limits::MAX_NAME));
    }
    // ':' separates a grant's fields (VOLUME:IDENTITY[:MODE]) and '*' is a
    // grant's "every volume": a name with either could never be granted
    // alone, and `vm:disk:ro` would grant volume `vm` to identity `disk`.
    if name.chars().any(|c| c.is_control() || matches!(c, '/' | ',' | '=' | ':')) || name == "*" {
        return Err("a name has no control characters, '/', ',', '=' or ':', and is not '*'".into());
    }
    Ok(())
}

/// Parses `4096`, `64K`, `512M`, `1G`, `1GiB`, `2T` (suffixes are powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    let bad = || ConfigError::Size(s.to_owned());
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// Parses `250us`, `10ms`, `2s` (a unit is required).
pub fn parse_duration(s: &str) -> Result<Duration, ConfigError> {
    let bad = || ConfigError::Duration(s.to_owned());
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    match unit {
        "us" => Ok(Duration::from_micros(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "s" if n <= 86_400 => Ok(Duration::from_secs(n)),
        _ => Err(bad()),
    }
}

/// Everything `fastsan serve` needs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub brp: SocketAddr,
    /// BRP listener on a unix socket.
    pub brp_unix: Option<PathBuf>,
    /// NBD listener on TCP; `None` disables it.
    pub nbd: Option<SocketAddr>,
    /// NBD listener on a unix socket.
    pub nbd_unix: Option<PathBuf>,
    /// Allow NBD without client certificates on a non-loopback address.
    pub nbd_allow_remote: bool,
    /// Serve NBD clients that prove no identity although the target
    /// authenticates (secrets, client certificates): they bypass it.
    pub nbd_insecure: bool,
    /// NVMe/TCP listener (I/O and discovery controllers); `None`: off.
    pub nvme: Option<SocketAddr>,
    /// The NVM subsystem's NQN; `None`: derived from the host name.
    pub nvme_nqn: Option<String>,
    /// Allow NVMe/TCP (which authenticates nobody) on a non-loopback address.
    pub nvme_allow_remote: bool,
    pub volumes: Vec<VolumeSpec>,
    /// Shared secret of the identity `default`.
    pub secret: Option<Vec<u8>>,
    /// Named secrets (a secrets file): identity -> secret.
    pub secrets: std::collections::HashMap<String, std::sync::Arc<[u8]>>,
    /// Which identities may open which volumes.
    pub grants: Vec<crate::access::Grant>,
    /// The target's TLS certificate, key and client CA.
    pub tls: Option<crate::tls::TlsFiles>,
    /// When TLS is used; `None`: `require` with TLS files, `off` without.
    pub tls_mode: Option<crate::tls::TlsMode>,
    /// Allow authenticated BRP sessions in plaintext from other hosts.
    pub insecure_plaintext: bool,
    /// Serve Prometheus metrics at `/metrics` on this address.
    pub metrics: Option<SocketAddr>,
    /// Allow metrics on a non-loopback address (they have no authentication).
    pub metrics_allow_remote: bool,
    pub handshake_timeout: Duration,
    /// How long a reply write may make no progress, or a request's data
    /// stop arriving in the middle, before its connection is dropped.
    pub stall_timeout: Duration,
    /// Connections in their transmission phase at once; more are refused as busy.
    pub max_connections: usize,
    /// Connections still in their handshake at once (a quarter of them from
    /// one address at most): silent connections cannot lock clients out.
    pub max_handshakes: usize,
    /// Bytes of request and reply payload in flight, all connections together.
    pub memory_budget: u64,
    /// Requests outstanding per connection (the credits granted).
    pub queue_depth: u32,
    /// How long a connection that serves one request at a time (a client at
    /// queue depth 1) spins for the next one instead of sleeping (zero: never;
    /// see [`crate::driver::BusyPoll`]).
    pub poll_window: Duration,
    /// One round of holding replies for a client that sends one request at a
    /// time and keeps sending (zero: never; see [`crate::coalesce`]).
    pub coalesce_window: Duration,
    /// Largest single transfer.
    pub max_transfer: u32,
    /// Threads that run blocking (file) device I/O, for each volume.
    pub io_threads: usize,
    /// Process each connection's requests one at a time, end to end (the
    /// paper's BRP-1, "parallelism off"), for comparison only.
    pub serial: bool,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// The host's boot identity as OPEN_REPLY tells it; `None` reads Linux's
    /// boot_id. Tests set it to play a host that rebooted.
    pub boot_id: Option<u64>,
    /// Where file volumes record their failed flushes besides on the file
    /// (which a filesystem the failure turned read-only cannot take), for a
    /// target restarted on them before the host reboots; `None`: on the
    /// file only. `serve` defaults it to /run/fastsan (see `serve --help`).
    pub run_dir: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            brp: "127.0.0.1:10810".parse().expect("valid address"),
            brp_unix: None,
            nbd: Some("127.0.0.1:10809".parse().expect("valid address")),
            nbd_unix: None,
            nbd_allow_remote: false,
            nbd_insecure: false,
            nvme: None,
            nvme_nqn: None,
            nvme_allow_remote: false,
            volumes: Vec::new(),
            secret: None,
            secrets: Default::default(),
            grants: Vec::new(),
            tls: None,
            tls_mode: None,
            insecure_plaintext: false,
            metrics: None,
            metrics_allow_remote: false,
            handshake_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_handshakes: 64,
            memory_budget: 1 << 30,
            queue_depth: 256,
            poll_window: DEFAULT_POLL_WINDOW,
            coalesce_window: DEFAULT_COALESCE_WINDOW,
            max_transfer: 8 << 20,
            io_threads: 16,
            serial: false,
            drain_timeout: Duration::from_secs(30),
            boot_id: None,
            run_dir: None,
        }
    }
}

impl ServerConfig {
    /// The default volume when none is configured: 1 GiB of memory named `vol0`.
    pub fn default_volume() -> VolumeSpec {
        VolumeSpec {
            name: "vol0".into(),
            backend: BackendSpec::Memory { size: 1 << 30 },
            read_only: false,
            delay: None,
            faults: None,
        }
    }

    /// When TLS is used: as given, else `require` when TLS files are given.
    pub fn tls_mode(&self) -> TlsMode {
        self.tls_mode.unwrap_or(if self.tls.is_some() { TlsMode::Require } else { TlsMode::Off })
    }

    /// Whether clients must prove an identity (and so whether NBD, which can
    /// only do that with client certificates, may serve anyone without one).
    pub fn authenticates(&self) -> bool {
        self.secret.is_some() || !self.secrets.is_empty() || self.client_certs()
    }

    /// Whether TLS clients are asked for certificates (verified against a CA).
    pub fn client_certs(&self) -> bool {
        self.tls_mode() != TlsMode::Off && self.tls.as_ref().is_some_and(|t| t.ca.is_some())
    }

    /// Checks the whole configuration before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut names = std::collections::HashSet::new();
        for v in &self.volumes {
            if !names.insert(v.name.as_str()) {
                return Err(ConfigError::Invalid(format!("volume name {:?} given twice", v.name)));
            }
        }
        // Memory volumes fill as clients write: together they must fit, or
        // the kernel's OOM killer ends the target, and every memory volume
        // with it, once they fill (each alone is checked at open).
        let sizes: Vec<u64> = self
            .volumes
            .iter()
            .filter_map(|v| match v.backend {
                // (A read-only one stays zeros and takes no memory.)
                BackendSpec::Memory { size } if !v.read_only => Some(size),
                _ => None,
            })
            .collect();
        let memory = sizes.iter().fold(0u64, |a, &s| a.saturating_add(s));
        if let Some((ram, what)) = crate::backend::memory_limit() {
            if memory > ram && sizes.len() > 1 {
                return Err(ConfigError::Invalid(format!(
                    "the memory volumes hold {} together, more than {what} ({}): once clients \
                     fill them, the kernel's out-of-memory killer would end the target and every memory \
                     volume with it",
                    crate::backend::gib(memory),
                    crate::backend::gib(ram)
                )));
            }
        }
        // --serial runs each request on its connection's runtime thread; a
        // remote volume's request waits on a runtime of its own, which a
        // runtime thread may not do (it panicked, and a FLUSH that did
        // latched the volume as failed).
        if let Some(v) =
            self.volumes.iter().find(|v| self.serial && matches!(v.backend, BackendSpec::Remote { .. }))
        {
            return Err(ConfigError::Invalid(format!(
                "--serial cannot serve volume {:?}: another target's volume is served through its own \
                 runtime; leave --serial off (it is for comparisons only)",
                v.name
            )));
        }
        let mode = self.tls_mode();
        if mode != TlsMode::Off && self.tls.is_none() {
            return Err(ConfigError::Invalid("--tls allow|require needs --tls-cert and --tls-key".into()));
        }
        let (client_certs, authenticates) = (self.client_certs(), self.authenticates());
        if !self.brp.ip().is_loopback() {
            if !authenticates {
                return Err(ConfigError::Invalid(format!(
                    "BRP on {} (not loopback) requires authentication (--secret-file, --secrets-file or \
                     --tls-ca for client certificates): anyone on the network could use the volumes",
                    self.brp
                )));
            }
            if mode != TlsMode::Require && !self.insecure_plaintext {
                return Err(ConfigError::Invalid(format!(
                    "BRP on {} (not loopback) would carry sessions in plaintext, open to tampering after \
                     the handshake: give --tls-cert and --tls-key (TLS is then required), or pass \
                     --insecure-plaintext",
                    self.brp
                )));
            }
        }
        if let Some(a) = self.nbd {
            // Every client proves a certificate: nobody anonymous gets in.
            let authenticated = client_certs && mode == TlsMode::Require && !self.nbd_insecure;
            if !(a.ip().is_loopback() || self.nbd_allow_remote || authenticated) {
                return Err(ConfigError::Invalid(format!(
                    "NBD on {a} (not loopback) without TLS client certificates authenticates nobody: \
                     give --tls-cert, --tls-key and --tls-ca, or pass --nbd-allow-remote to serve it anyway"
                )));
            }
        }
        if let Some(a) = self.nvme.filter(|a| !a.ip().is_loopback() && !self.nvme_allow_remote) {
            return Err(ConfigError::Invalid(format!(
                "NVMe/TCP on {a} (not loopback) authenticates nobody: anyone on the network could use \
                 the volumes; pass --nvme-allow-remote to serve it anyway"
            )));
        }
        if let Some(nqn) = &self.nvme_nqn {
            let ok = nqn.starts_with("nqn.") && nqn.len() < 224 && nqn.is_ascii() && !nqn.contains('\0');
            if !ok || nqn == "nqn.2014-08.org.nvmexpress.discovery" {
                return Err(ConfigError::Invalid(format!(
                    "--nvme-nqn {nqn:?}: an NQN starts with \"nqn.\", is ASCII and under 224 bytes \
                     (e.g. nqn.2026-11.com.example:storage), and is not the discovery NQN"
                )));
            }
        }
        let nbd = self.nbd.is_some() || self.nbd_unix.is_some();
        if authenticates && !client_certs && !self.nbd_insecure && nbd {
            return Err(ConfigError::Invalid(
                "NBD clients can prove who they are only with TLS client certificates: with secrets set \
                 and no --tls-ca, anyone who reaches the NBD listener would bypass them; serve no NBD \
                 (--no-nbd), give --tls-ca, or pass --nbd-insecure"
                    .into(),
            ));
        }
        if self.secret.is_some() && self.secrets.contains_key(crate::access::DEFAULT_IDENTITY) {
            return Err(ConfigError::Invalid(
                "the secrets file names \"default\", the identity of --secret-file's secret: give one of them".into(),
            ));
        }
        if matches!(&self.secret, Some(s) if s.is_empty()) {
            return Err(ConfigError::Invalid("the secret file is empty".into()));
        }
        if let Some(a) = self.metrics {
            if !a.ip().is_loopback() && !self.metrics_allow_remote {
                return Err(ConfigError::Invalid(format!(
                    "metrics on {a} (not loopback) would show every volume's name and traffic to anyone \
                     who reaches it, unauthenticated: pass --metrics-allow-remote to serve them anyway"
                )));
            }
        }
        for g in &self.grants {
            if g.volume != "*" && !self.volumes.iter().any(|v| v.name == g.volume) {
                return Err(ConfigError::Invalid(format!(
                    "grant for {:?}: no volume of that name",
                    g.volume
                )));
            }
            // An identity no client can have is a typo that locks everyone
            // out of the volume (it names the volume, so others lose it).
            let named = g.identity != "*" && g.identity != crate::access::ANONYMOUS;
            let known = |id: &str| {
                self.secrets.contains_key(id)
                    || (self.secret.is_some() && id == crate::access::DEFAULT_IDENTITY)
            };
            if named && !self.client_certs() && !known(&g.identity) {
                if self.authenticates() {
                    return Err(ConfigError::Invalid(format!(
                        "grant {}:{}: no client can be {:?}: no secret of the secrets files has that \
                         identity (client certificates, --tls-ca, would be the other source of identities)",
                        g.volume, g.identity, g.identity
                    )));
                }
                // (Such a grant still hides the volume from everyone: a
                // way to take it offline, so only said.)
                tracing::warn!(
                    "grant {}:{}: this target authenticates nobody (no --secret-file, --secrets-file or \
                     --tls-ca), so every client is anonymous and none may open {:?}",
                    g.volume,
                    g.identity,
                    g.volume
                );
            }
        }
        if self.queue_depth == 0 || self.queue_depth > 65536 {
            return Err(ConfigError::Invalid("queue depth must be 1..=65536".into()));
        }
        let max = fastsan_brp::limits::MAX_PAYLOAD - 64 * 1024;
        if self.max_transfer < 4096 || self.max_transfer > max {
            return Err(ConfigError::Invalid(format!("max transfer must be 4096..={max}")));
        }
        if self.io_threads == 0 || self.io_threads > 1024 {
            return Err(ConfigError::Invalid("io threads must be 1..=1024".into()));
        }
        if self.poll_window > MAX_POLL_WINDOW {
            return Err(ConfigError::Invalid(format!(
                "poll window must be at most {} microseconds",
                MAX_POLL_WINDOW.as_micros()
            )));
        }
        if self.coalesce_window > MAX_COALESCE_WINDOW {
            return Err(ConfigError::Invalid(format!(
                "coalesce window must be at most {} microseconds",
                MAX_COALESCE_WINDOW.as_micros()
            )));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Invalid("max connections must be at least 1".into()));
        }
        if self.max_handshakes == 0 {
            return Err(ConfigError::Invalid("max handshakes must be at least 1".into()));
        }
        for (name, d) in [
            ("handshake timeout", self.handshake_timeout),
            ("stall timeout", self.stall_timeout),
            ("drain timeout", self.drain_timeout),
        ] {
            if d.is_zero() || d > Duration::from_secs(3600) {
                return Err(ConfigError::Invalid(format!(
                    "{name} must be more than 0 and at most 3600 seconds"
                )));
            }
        }
        // The largest NBD request (64 MiB) must fit, or such a request could never run.
        let least = 2 * fastsan_nbd::MAX_PAYLOAD as u64;
        if self.memory_budget < least {
            return Err(ConfigError::Invalid(format!("memory budget must be at least {} MiB", least >> 20)));
        }
        Ok(())
    }
}

/// The TOML config file; every key is optional and is the flag of
/// `fastsan serve` with the same name, in the same units.
///
/// ```toml
/// brp = "127.0.0.1:10810"
/// brp_unix = "/run/fastsan/brp.sock"
/// nbd = "127.0.0.1:10809"          # or no_nbd = true
/// nbd_unix = "/run/fastsan/nbd.sock"
/// nbd_allow_remote = false
/// nvme = "127.0.0.1:4420"          # NVMe/TCP; off unless given
/// nvme_nqn = "nqn.2026-11.com.example:storage"
/// nvme_allow_remote = false
/// secret_file = "/etc/fastsan/secret"  # the identity "default"
/// secrets_file = "/etc/fastsan/secrets" # lines of IDENTITY SECRET
/// grants = ["disk:alice:rw", "disk:bob:ro", "*:admin"]
/// tls_cert = "/etc/fastsan/server-cert.pem"
/// tls_key = "/etc/fastsan/server-key.pem"
/// tls_ca = "/etc/fastsan/ca-cert.pem"    # client certificates (CN = identity)
/// tls = "require"                       # off | allow | require
/// insecure_plaintext = false
/// metrics = "127.0.0.1:9810"
/// volumes = ["vol0=memory:1G", "disk=file:/dev/nvme0n1,direct"]
/// queue_depth = 256
/// poll_window_us = 50              # 0: never spin for the next request
/// coalesce_window_us = 20          # 0: never hold replies for more requests
/// max_transfer = "8M"
/// io_threads = 16
/// handshake_timeout = 10           # seconds
/// stall_timeout = 30               # seconds
/// drain_timeout = 30               # seconds
/// run_dir = "/run/fastsan"         # where failed flushes are recorded too
/// max_connections = 1024
/// max_handshakes = 64
/// memory_budget = "1G"
/// serial = false
/// ```
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub brp: Option<SocketAddr>,
    pub brp_unix: Option<PathBuf>,
    pub nbd: Option<SocketAddr>,
    #[serde(default)]
    pub no_nbd: bool,
    pub nbd_unix: Option<PathBuf>,
    #[serde(default)]
    pub nbd_allow_remote: bool,
    #[serde(default)]
    pub nbd_insecure: bool,
    pub nvme: Option<SocketAddr>,
    pub nvme_nqn: Option<String>,
    #[serde(default)]
    pub nvme_allow_remote: bool,
    pub secret_file: Option<PathBuf>,
    pub secrets_file: Option<PathBuf>,
    #[serde(default)]
    pub grants: Vec<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub tls: Option<TlsMode>,
    #[serde(default)]
    pub insecure_plaintext: bool,
    pub metrics: Option<SocketAddr>,
    #[serde(default)]
    pub metrics_allow_remote: bool,
    #[serde(default)]
    pub volumes: Vec<String>,
    pub queue_depth: Option<u32>,
    /// Microseconds.
    pub poll_window_us: Option<u64>,
    /// Microseconds.
    pub coalesce_window_us: Option<u64>,
    pub max_transfer: Option<String>,
    pub io_threads: Option<usize>,
    /// Seconds.
    pub handshake_timeout: Option<f64>,
    /// The same in milliseconds: the key of earlier releases, still read.
    pub handshake_timeout_ms: Option<u64>,
    /// Seconds.
    pub stall_timeout: Option<f64>,
    /// Seconds.
    pub drain_timeout: Option<f64>,
    pub run_dir: Option<PathBuf>,
    pub max_connections: Option<usize>,
    pub max_handshakes: Option<usize>,
    pub memory_budget: Option<String>,
    #[serde(default)]
    pub serial: bool,
}

impl ConfigFile {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let err = |why: String| ConfigError::File { path: path.display().to_string(), why };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let mut f: ConfigFile = toml::from_str(&text).map_err(|e| err(e.to_string()))?;
        f.merge_legacy().map_err(err)?;
        Ok(f)
    }

    /// Folds the keys of earlier releases into today's.
    fn merge_legacy(&mut self) -> Result<(), String> {
        if let Some(ms) = self.handshake_timeout_ms.take() {
            if self.handshake_timeout.is_some() {
                return Err("give handshake_timeout (seconds) or handshake_timeout_ms, not both".into());
            }
            self.handshake_timeout = Some(ms as f64 / 1000.0);
        }
        Ok(())
    }
}

/// Reads a secret file: its bytes, without a trailing newline.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let mut s = std::fs::read(path)
        .map_err(|e| ConfigError::SecretFile { path: path.display().to_string(), why: e.to_string() })?;
    warn_if_others_read(path);
    while matches!(s.last(), Some(b'\n' | b'\r')) {
        s.pop();
    }
    Ok(s)
}

/// Warns when a file of secrets can be read by users other than its owner
/// (as ssh does for keys): whoever reads it can pass for its identities.
pub fn warn_if_others_read(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).map_or(0, |m| m.permissions().mode()) & 0o777;
    if mode & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "the secret file is readable by other users (mode {mode:o}): whoever reads it can pass for \
             its identities; chmod 600 it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("128mb"), Ok(128 << 20));
        assert!(parse_size("").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn volume_specs() {
        let v = VolumeSpec::parse("a=memory:128M").unwrap();
        assert_eq!(v.backend, BackendSpec::Memory { size: 128 << 20 });
        assert!(!v.read_only);
        let v = VolumeSpec::parse("disk=file:/tmp/x.img,direct,ro").unwrap();
        assert_eq!(v.backend, BackendSpec::File { path: "/tmp/x.img".into(), direct: true });
        assert!(v.read_only);
        assert_eq!(VolumeSpec::parse("n=null:1G").unwrap().backend, BackendSpec::Null { size: 1 << 30 });
        let v = VolumeSpec::parse("f=memory:1G,delay=2ms,faults=write:eio@0-4K,faults=flush:enospc").unwrap();
        assert_eq!(v.delay, Some(Duration::from_millis(2)));
        assert_eq!(v.faults.as_ref().map(Vec::len), Some(2));
        assert_eq!(VolumeSpec::parse("f=memory:1G,faults=none").unwrap().faults, Some(vec![]));
        assert_eq!(VolumeSpec::parse("f=memory:1G").unwrap().faults, None);
        for bad in [
            "memory:1G",
            "=memory:1G",
            "a=memory",
            "a=disk:1G",
            "a=memory:0",
            "a=memory:1000",
            "a=null:1000",
            "a=memory:1G,fast",
            "a=memory:1G,direct",
            "a=file:",
            "a/b=memory:1G",
            // A grant's separator and wildcard: `vm:disk:ro` would grant `vm`.
            "vm:disk=memory:1G",
            "*=memory:1G",
            "a=memory:1G,delay=3",
            "a=memory:1G,faults=write",
            "a=memory:1G,ro=1",
        ] {
            assert!(VolumeSpec::parse(bad).is_err(), "{bad} should be refused");
        }
    }

    /// A grant to an identity no secret has is a typo that locks the
    /// volume for everyone: refused (with certificates, identities come
    /// from them and cannot be checked here).
    #[test]
    fn a_grant_to_an_identity_no_client_can_have_is_refused() {
        use crate::access::Grant;
        let mut c = ServerConfig {
            volumes: vec![VolumeSpec::parse("v=memory:1M").unwrap()],
            grants: vec![Grant::parse("v:alcie").unwrap()],
            nbd: None,
            ..Default::default()
        };
        c.secrets.insert("alice".into(), std::sync::Arc::from(&b"s"[..]));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("no client can be \"alcie\""), "{e}");
        for ok in ["v:alice", "v:*", "v:anonymous:ro"] {
            c.grants = vec![Grant::parse(ok).unwrap()];
            c.validate().unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        c.secrets.clear();
        c.secret = Some(b"s".to_vec());
        c.grants = vec![Grant::parse("v:default").unwrap()];
        c.validate().expect("--secret-file's identity is \"default\"");
    }

    /// Memory volumes must fit in RAM together, not only each alone.
    #[test]
    fn memory_volumes_must_fit_together() {
        let (ram, _) = crate::backend::memory_limit().expect("/proc/meminfo");
        let vol =
            |name: &str, size: u64| VolumeSpec::parse(&format!("{name}=memory:{}K", size >> 10)).unwrap();
        let mut c = ServerConfig {
            volumes: vec![vol("a", ram / 5 * 3), vol("b", ram / 5 * 3)],
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("more than this") && e.contains("GiB"), "{e}");
        c.volumes[1] = vol("b", ram / 5);
        c.validate().expect("4/5 of the RAM together");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("10ms"), Ok(Duration::from_millis(10)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        for bad in ["", "10", "ms", "1.5s", "3h", "99999999s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn non_loopback_needs_a_secret_and_tls() {
        let mut c = ServerConfig { brp: "0.0.0.0:10810".parse().unwrap(), ..Default::default() };
        assert!(c.validate().unwrap_err().to_string().contains("requires authentication"));
        c.secret = Some(b"k".to_vec());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("plaintext"), "{e}");
        c.insecure_plaintext = true;
        // NBD (on by default) cannot check the secret: refused, unless off
        // or explicitly insecure.
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("TLS client certificates"), "{e}");
        c.nbd_insecure = true;
        assert!(c.validate().is_ok());
        c.grants = vec![crate::access::Grant::parse("nope:alice").unwrap()];
        assert!(c.validate().unwrap_err().to_string().contains("nope"));
        c.grants.clear();
        c.tls_mode = Some(TlsMode::Allow);
        assert!(c.validate().unwrap_err().to_string().contains("--tls-cert"));
        c.tls_mode = None;
        c.nbd_insecure = false;
        c.nbd = None;
        assert!(c.validate().is_ok());
        c.nbd_unix = Some("/run/n.sock".into());
        assert!(c.validate().is_err());
    }

    #[test]
    fn serial_refuses_another_targets_volume() {
        let volumes = vec![VolumeSpec::parse("g=brp://127.0.0.1:1/v").unwrap()];
        let mut c = ServerConfig { volumes, serial: true, ..Default::default() };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--serial") && e.contains("\"g\""), "{e}");
        c.serial = false;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn config_file_parses_and_rejects_unknown_keys() {
        let c: ConfigFile =
            toml::from_str("brp = \"127.0.0.1:1\"\nvolumes = [\"v=null:1G\"]\nqueue_depth = 8").unwrap();
        assert_eq!(c.volumes, vec!["v=null:1G".to_string()]);
        assert_eq!(c.queue_depth, Some(8));
        assert!(toml::from_str::<ConfigFile>("bogus = 1").is_err());
        let mut old: ConfigFile = toml::from_str("handshake_timeout_ms = 2500").unwrap();
        old.merge_legacy().unwrap();
        assert_eq!(old.handshake_timeout, Some(2.5), "the key of earlier releases still works");
        let mut both: ConfigFile = toml::from_str("handshake_timeout_ms = 1\nhandshake_timeout = 1").unwrap();
        assert!(both.merge_legacy().is_err());
    }
}
