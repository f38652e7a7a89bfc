//! `fastsan`: the command line. Each subcommand lives in its own module; it
//! parses arguments, opens local files, shows progress and calls the
//! `fastsan_target`, `fastsan_initiator` or `fastsan_bench` crates. No
//! protocol or storage logic lives here: not the wire format, not retries,
//! not block alignment.

/// A status line on stdout that never panics: a long-running command (serve,
/// attach) goes on when whoever started it stopped reading its output (a
/// panic there would take a target, or a mounted device, down with it).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

/// `print!` to standard output that returns an error, rather than panic,
/// when the reader has gone (`fastsan ls | head`): `main` then ends quietly.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        $crate::stdout_result(write!(std::io::stdout(), $($t)*))
    }};
}

/// [`out!`] with a newline.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        $crate::stdout_result(writeln!(std::io::stdout(), $($t)*))
    }};
}

/// Standard output's reader went away: the one error `main` ends quietly on.
/// Only [`out!`] and [`outln!`] make it, so a broken pipe anywhere else (a
/// socket to a target, a local file) is still an error and exits non-zero.
#[derive(Debug)]
struct StdoutGone;

impl std::fmt::Display for StdoutGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("standard output was closed")
    }
}

impl std::error::Error for StdoutGone {}

/// A write to standard output: a broken pipe becomes [`StdoutGone`].
fn stdout_result(r: std::io::Result<()>) -> anyhow::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutGone.into()),
        r => Ok(r?),
    }
}

mod attach;
mod bench;
mod cp;
mod ls;
mod mirror;
mod serve;
mod top;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// fastsan: a fast network block-storage system (a SAN in user space).
///
/// Serve volumes (RAM, files, block devices) over BRP, NBD and NVMe/TCP, and
/// use them from the command line.
#[derive(Parser)]
#[command(version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Serve(Box<serve::Args>),
    Ls(ls::Args),
    Cp(cp::Args),
    Bench(bench::Args),
    Attach(attach::Args),
    Detach(attach::DetachArgs),
    Mirror(mirror::Args),
    Top(top::Args),
}

/// How a client proves who it is (BRP): every client subcommand takes these.
#[derive(clap::Args, Clone)]
pub struct AccessArgs {
    /// File holding the shared secret, when the target requires authentication.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// The identity the secret belongs to, as the target's secrets file
    /// names it [default: the target's one secret].
    #[arg(long, value_name = "NAME", requires = "secret_file")]
    pub identity: Option<String>,
    /// CA certificate(s) (PEM) to verify a brps:// target's certificate against.
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) to present to a brps:// target, which then
    /// knows this client by its CN.
    #[arg(long, value_name = "PATH", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl AccessArgs {
    /// The initiator's options with these credentials, the rest default.
    pub fn options(&self) -> anyhow::Result<fastsan_initiator::Options> {
        let secret = match &self.secret_file {
            Some(p) => Some(fastsan_target::config::read_secret(p)?),
            None => None,
        };
        let tls = match &self.tls_ca {
            None => None,
            Some(ca) => {
                let id = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
                Some(fastsan_initiator::tls::client_config(ca, id)?)
            }
        };
        Ok(fastsan_initiator::Options {
            secret,
            identity: self.identity.clone().unwrap_or_default(),
            tls,
            ..Default::default()
        })
    }
}

/// Options every client subcommand that opens a volume shares.
#[derive(clap::Args, Clone)]
pub struct ClientArgs {
    #[command(flatten)]
    pub access: AccessArgs,
    /// Connections per BRP session (over NBD and NVMe/TCP, bench makes
    /// one connection or queue per job: --jobs).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub connections: usize,
    /// How small requests are merged into BATCH frames (BRP).
    #[arg(long, default_value = "adaptive", value_name = "MODE")]
    pub merge: fastsan_initiator::MergeMode,
    /// Ask for CRC32C digests of headers and data.
    #[arg(long)]
    pub digests: bool,
    /// Seconds a request waits for a lost connection to come back (it is
    /// retried meanwhile) before it fails; 0 turns reconnection off.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    pub reconnect_timeout: f64,
    /// Seconds a request may wait for its reply before its connection is
    /// taken for lost.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    pub request_timeout: f64,
}

impl ClientArgs {
    pub fn options(&self) -> anyhow::Result<fastsan_initiator::Options> {
        let secs = |s: f64, what: &str| {
            anyhow::ensure!(
                s.is_finite() && (0.0..=86400.0).contains(&s),
                "--{what} must be 0..=86400 seconds"
            );
            Ok(std::time::Duration::from_secs_f64(s))
        };
        let request_timeout = secs(self.request_timeout, "request-timeout")?;
        anyhow::ensure!(!request_timeout.is_zero(), "--request-timeout must be more than 0");
        Ok(fastsan_initiator::Options {
            connections: self.connections,
            merge: self.merge,
            digests: self.digests,
            reconnect_timeout: secs(self.reconnect_timeout, "reconnect-timeout")?,
            request_timeout,
            ..self.access.options()?
        })
    }
}

/// mimalloc rather than glibc's malloc. An initiator receives replies into a
/// 256 KiB buffer that it hands out in slices; a slice still held when the
/// buffer fills sends the next one to the allocator, and glibc gave the freed
/// ones back to the kernel (a thread arena's heap is trimmed), so every new
/// buffer was fresh memory to fault in and zero: `perf` of `fastsan bench`
/// under BRP 4K reads at 512 requesters put 11% of its CPU in page faults,
/// clearing and unmapping pages. mimalloc keeps them: that client's CPU per
/// I/O 2.32 -> 1.90 us, IOPS 1.20x (docs/benchmarks.md, "The allocator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Before any thread exists (the log's and the runtime's): they inherit it.
    let io_flusher = match &cli.cmd {
        Cmd::Attach(a) => attach::io_flusher(a),
        _ => None,
    };
    // The log is written by a thread of its own: a reader of stderr that
    // stops reading (a full pipe) stalls that thread, never a connection.
    // Until 2026-11-29 each log line was written where it was made, so a
    // pipe nobody drained stopped the target's worker threads at their next
    // line, and every client with them (found by a test that ran into 64
    // KiB of device-error warnings). Lines past 128 K waiting are dropped.
    // The guard writes what is waiting when main returns (for a second at
    // most, if the reader still does not read).
    let (log_writer, _log_guard) = tracing_appender::non_blocking(std::io::stderr());
    // A RUST_LOG that does not parse (RUST_LOG=debug,x=loud) keeps the
    // default and says so: it silenced every line, shutdown's too.
    let (filter, bad_filter) = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(f) => (f, None),
        Err(e) => {
            let set = std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty());
            (tracing_subscriber::EnvFilter::new(default_log(&cli.cmd)), set.map(|v| (v, e)))
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(log_writer)
        // A log nobody reads any more (the pipe's reader gone) is dropped
        // quietly. By default the subscriber reports a failed write with
        // `eprintln!`, to the same closed stderr, which panics: every task
        // that logged died there, so a target whose log reader had gone
        // dropped each connection at its first log line and never handled
        // SIGTERM (tests/cli.rs, `output_to_a_closed_pipe_ends_quietly`).
        .log_internal_errors(false)
        // Colour codes only for a terminal (not in log files and pipes),
        // and not when NO_COLOR is set (no-color.org).
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        )
        .init();
    if let Some((v, e)) = bad_filter {
        tracing::warn!("RUST_LOG={v:?} is not a log filter ({e}); using the default (e.g. RUST_LOG=debug)");
    } else if let Some(v) = std::env::var("RUST_LOG").ok().filter(|v| names_no_fastsan_log(v)) {
        // Said straight to stderr: the filter itself silences the log.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "fastsan: RUST_LOG={v:?} names no level and no fastsan module, so it silences fastsan's \
             log (e.g. RUST_LOG=debug, or RUST_LOG=fastsan_target=debug)"
        );
    }
    if let Some(e) = io_flusher {
        tracing::debug!("PR_SET_IO_FLUSHER: {e}");
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Cmd::Bench(a) = &cli.cmd {
        rt.worker_threads(a.threads());
    }
    let rt = rt.enable_all().build().expect("tokio runtime");
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Serve(a) => serve::run(*a).await,
            Cmd::Top(a) => tokio::task::spawn_blocking(move || top::run(a)).await?,
            Cmd::Ls(a) => ls::run(a).await,
            Cmd::Cp(a) => cp::run(a).await,
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::Attach(a) => attach::run(a).await,
            Cmd::Detach(a) => attach::detach(a).await,
            Cmd::Mirror(a) => mirror::run(a).await,
        }
    });
    // Blocking work still running is not waited for (for long): a flush the
    // target gave up on at shutdown (a stalled device) would hold the exit
    // for ever, since dropping a runtime waits for its blocking threads.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    // Not any broken pipe: a target's socket breaking mid-handshake is one
    // too, and taking it for a closed stdout ended `cp` with 0, nothing copied.
    let stdout_gone = |e: &anyhow::Error| e.chain().any(|c| c.is::<StdoutGone>());
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // Whoever read the output stopped reading (`| head`): nothing to report.
        Err(e) if stdout_gone(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: a closed stderr would turn the exit code 1 into a panic's 101.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "fastsan: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether a log filter that parses turns on nothing of fastsan's: none of
/// its directives is a bare level (`debug`) or names a fastsan module (or
/// none: `[span]=debug`). `RUST_LOG=verbose` is such a filter: it asks for
/// the module "verbose", and silenced every line.
fn names_no_fastsan_log(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let enables = |d: &str| {
        let d = d.trim();
        let target = d.split(['=', '[']).next().unwrap_or("");
        LEVELS.iter().any(|l| d.eq_ignore_ascii_case(l)) || target.is_empty() || target.starts_with("fastsan")
    };
    !filter.trim().is_empty() && !filter.split(',').filter(|d| !d.trim().is_empty()).any(enables)
}

/// The target logs what it does; client commands stay quiet unless warned.
fn default_log(cmd: &Cmd) -> &'static str {
    match cmd {
        // rustls warns of every IP address sent as SNI (qemu and libnbd do).
        Cmd::Serve(_) => "info,rustls=error",
        // fuser warns when its own unmount finds the mount already gone (ours).
        Cmd::Attach(_) => "info,fuser=error",
        Cmd::Detach(_) => "warn",
        // What a resync copies and which legs come and go.
        Cmd::Mirror(_) => "info",
        _ => "warn",
    }
}
