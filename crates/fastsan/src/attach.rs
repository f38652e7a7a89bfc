//! `fastsan attach` and `fastsan detach`: arguments, the process's life
//! (signals, the registry entry, the last word). The device and the file
//! are `fastsan_attach`'s.

use crate::ClientArgs;
use anyhow::Context;
use fastsan_attach::bridge::BridgeStats;
use fastsan_attach::kernel::{self, Interface, KernelOptions};
use fastsan_attach::registry::{self, Entry, Registration};
use fastsan_attach::Remote;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

/// Attach a volume as a local block device (/dev/nbdN) or file (FUSE).
///
/// The kernel's NBD client sends its requests to this process over a local
/// socket pair per queue; each goes through the initiator (merging,
/// connections, retries: while the target is away, I/O waits up to
/// --reconnect-timeout, so a filesystem on top survives a target restart).
/// With --fuse DIR (where the kernel has no NBD driver), DIR holds one file
/// named after the volume instead: fsync is FLUSH, fallocate punch-hole and
/// zero-range are WRITE_ZEROES, O_DIRECT works.
/// It runs until SIGINT or SIGTERM (or `fastsan detach`), which detach
/// after writing what the kernel caches and flushing; not while the device
/// is mounted or the file in use: it says so and keeps serving.
/// Examples:
///   fastsan attach brp://10.0.0.5:10810/vol0                # prints /dev/nbdN
///   fastsan attach brp://10.0.0.5:10810/vol0 --device /dev/nbd3 --queues 2
///   fastsan attach brp://127.0.0.1:10810/vol0 --fuse /mnt/fastsan
///   fastsan attach --list
///   fastsan detach /dev/nbd3
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// brp://HOST:PORT/VOLUME, brp+unix:///VOLUME?socket=PATH,
    /// nbd://HOST:PORT/EXPORT (any NBD server: one connection, no retries), or
    /// mirror:LEG,LEG,log=PATH (a mirrored volume; see `fastsan mirror --help`)
    #[arg(required_unless_present = "list")]
    url: Option<String>,
    /// The NBD device to use (default: the first free one).
    #[arg(long, value_name = "/dev/nbdN", conflicts_with = "fuse")]
    device: Option<PathBuf>,
    /// Socket pairs to the kernel (its queues); default the number of CPUs, at most 4.
    #[arg(long, value_name = "N", conflicts_with = "fuse")]
    queues: Option<usize>,
    /// How the NBD device is configured.
    #[arg(long, value_enum, default_value = "auto", value_name = "HOW", conflicts_with = "fuse")]
    interface: Interface,
    /// Seconds the kernel lets a request of the device wait before it gives
    /// up on that queue's socket and sends the request again on another.
    /// Default: through netlink 30 (attach gives the kernel a new socket at
    /// once); through the ioctls longer than the initiator ever takes,
    /// 2 x (request + reconnect timeout) + 30 (no new socket can be given).
    #[arg(long, value_name = "SECS", conflicts_with = "fuse")]
    device_timeout: Option<u64>,
    /// Attach as a file in DIR over FUSE instead (DIR must exist).
    #[arg(long, value_name = "DIR")]
    fuse: Option<PathBuf>,
    /// FUSE threads serving requests concurrently.
    #[arg(long, default_value_t = 4, value_name = "N", requires = "fuse")]
    threads: usize,
    /// List what is attached on this host (device, URL, state, connections).
    #[arg(long, conflicts_with_all = ["url", "device", "fuse"])]
    list: bool,
    /// Serve the session's metrics (connections, requests, merging,
    /// reconnects, retries) as Prometheus text at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// Allow --metrics on a non-loopback address: the metrics have no
    /// authentication and name the volume and its target.
    #[arg(long, requires = "metrics")]
    metrics_allow_remote: bool,
    #[command(flatten)]
    client: ClientArgs,
}

/// Detach what `fastsan attach` attached: a device or a FUSE directory.
///
/// Signals the attaching process and waits until it has written the
/// kernel's cached data, flushed and let go. A device attached by another
/// tool (nbd-client) is disconnected directly. Refused while the device is
/// mounted or the file in use.
/// Examples:
///   fastsan detach /dev/nbd0
///   fastsan detach /mnt/fastsan
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct DetachArgs {
    /// /dev/nbdN, or the FUSE directory (or its file).
    target: PathBuf,
    /// Seconds to wait for the attaching process to finish.
    #[arg(long, default_value_t = 120, value_name = "SECS")]
    timeout: u64,
    /// For a device no live fastsan attach serves (its attach was killed):
    /// disconnect it even when the kernel's cached data for it cannot be
    /// written, dropping that data. Still refused while it is mounted.
    #[arg(long)]
    force: bool,
}

/// Marks this process as serving a block device (PR_SET_IO_FLUSHER), as
/// prctl(2) asks of "a user process involved in the block layer or
/// filesystem I/O path": its memory allocations then never wait for I/O
/// (which might be the kernel's requests to this very process: a deadlock
/// under memory pressure), and it is not throttled as a writer of dirty
/// pages. Threads created after this inherit it. Needs CAP_SYS_RESOURCE;
/// without it (or on kernels before 5.6) attach runs as before, and says so
/// in its debug log (the refusal is returned: this runs before the log's
/// thread exists, so that it inherits the mark too).
pub fn io_flusher(a: &Args) -> Option<std::io::Error> {
    if a.list {
        return None;
    }
    const PR_SET_IO_FLUSHER: libc::c_int = 57;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) } != 0 {
        return Some(std::io::Error::last_os_error());
    }
    None
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    if a.list {
        return list();
    }
    let url = a.url.clone().expect("clap requires a URL unless --list");
    // Before anything else: a SIGTERM during the set-up is a detach once
    // attached, never the default death with a device or mount half made.
    let waits = Waits::new()?;
    let opts = a.client.options()?;
    if let Some(m) = a.metrics {
        // As `serve --metrics`: never on the network unless asked.
        anyhow::ensure!(
            m.ip().is_loopback() || a.metrics_allow_remote,
            "metrics on {m} (not loopback) would show the volume and its target to anyone who reaches it, \
             unauthenticated: pass --metrics-allow-remote to serve them anyway"
        );
    }
    if let Some(dir) = &a.fuse {
        anyhow::ensure!((1..=64).contains(&a.threads), "--threads must be 1..=64");
        check_fuse()?;
        anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
    }
    let queues =
        a.queues.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(4));
    anyhow::ensure!((1..=16).contains(&queues), "--queues must be 1..=16");
    // The initiator's longest answer: a request may wait for an earlier
    // overlapping write and then for its own retries, each bounded by the
    // request and reconnect timeouts.
    let initiator_longest = (opts.request_timeout + opts.reconnect_timeout) * 2 + Duration::from_secs(30);
    let timeout = match a.device_timeout {
        Some(s) => {
            anyhow::ensure!((1..=86400).contains(&s), "--device-timeout must be 1..=86400 seconds");
            // A request the kernel gives up on is sent again; the first may
            // still land, over a later write to the same place, unless the
            // session orders overlapping writes (BRP's does; an NBD server's
            // and a mirror's log do not).
            anyhow::ensure!(
                fastsan_initiator::BrpUrl::has_scheme(&url) || Duration::from_secs(s) >= initiator_longest,
                "--device-timeout {s} is shorter than the longest a request to {url} may take ({} s): \
                 the kernel would send a write again while the first may still land over a later \
                 one (only a brp:// session orders overlapping writes)",
                initiator_longest.as_secs()
            );
            Some(Duration::from_secs(s))
        }
        None => None,
    };
    let kopts =
        KernelOptions { device: a.device, queues, interface: a.interface, timeout, initiator_longest };
    let driver = match a.fuse {
        None => Some(kernel::preflight(&kopts)?),
        Some(_) => None,
    };
    let vol = Remote::connect(&url, opts).await.with_context(|| format!("cannot open {url}"))?;
    if let Some(addr) = a.metrics {
        let l =
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        say!("fastsan: serving metrics on http://{}/metrics", l.local_addr()?);
        let collector =
            fastsan_initiator::metrics::SessionCollector { volume: vol.clone(), url: url.clone() };
        let render: fastsan_target::metrics::Render =
            std::sync::Arc::new(move || fastsan_initiator::metrics::render(&collector));
        // It lives as long as the process: attach exits when detached.
        tokio::spawn(fastsan_target::metrics::serve(l, render, Default::default()));
    }
    match (a.fuse, driver) {
        (Some(dir), _) => attach_fuse(vol, &url, dir, a.threads, waits).await,
        (None, Some(driver)) => attach_kernel(vol, &url, driver, &kopts, waits).await,
        (None, None) => unreachable!("the kernel path has its driver"),
    }
}

fn check_fuse() -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata("/dev/fuse") {
        Ok(m) if m.file_type().is_char_device() => Ok(()),
        Ok(_) => anyhow::bail!("/dev/fuse is not the FUSE device (not a character device)"),
        Err(e) => anyhow::bail!(
            "no /dev/fuse ({e}): load the fuse module (modprobe fuse) or use a machine with FUSE"
        ),
    }
}

/// What the registry entry says besides its state: refused detaches.
#[derive(Default)]
struct Refusals {
    count: u64,
    note: String,
}

impl Refusals {
    fn add(&mut self, why: impl std::fmt::Display) {
        warn!("{why}; still serving");
        self.count += 1;
        self.note = why.to_string();
    }
}

/// The entry of an attachment as it is now.
fn entry(base: &Entry, vol: &Remote, state: &str, r: &Refusals, bridge: Option<&BridgeStats>) -> Entry {
    let s = vol.stats();
    let (up, all) = vol.connections();
    let state = match state {
        "attached" if up == 0 => "down",
        "attached" if up < all => "reconnecting",
        s => s,
    };
    Entry {
        state: state.into(),
        connections_up: up,
        connections: all,
        requests: bridge.map_or(s.requests, |b| b.requests.load(Relaxed)),
        errors: bridge.map_or(0, |b| b.errors.load(Relaxed)),
        in_flight: bridge.map(|b| b.in_flight()),
        retries: s.retries,
        reconnects: s.reconnects,
        refusals: r.count,
        note: r.note.clone(),
        ..base.clone()
    }
}

async fn attach_kernel(
    vol: Remote,
    url: &str,
    driver: kernel::Driver,
    opts: &KernelOptions,
    mut waits: Waits,
) -> anyhow::Result<()> {
    let mut base = registry::this_process(url, "nbd");
    base.device = opts.device.as_ref().map(|d| d.display().to_string()).unwrap_or_default();
    let mut refused = Refusals::default();
    // Registered before the device exists: no device is ever left without an entry.
    let reg = Registration::new(&entry(&base, &vol, "attaching", &refused, None))
        .with_context(|| format!("cannot write the registry entry in {}", registry::dir().display()))?;
    let mut dev = kernel::attach(vol.clone(), driver, opts).await?;
    base.device = dev.path.display().to_string();
    let stats = dev.stats.clone();
    let now = |state: &str, r: &Refusals| entry(&base, &vol, state, r, Some(&stats));
    reg.update(&now("attached", &refused))?;
    say!("fastsan: {url} attached as {}", base.device);
    loop {
        if let Wake::Tick = waits.next().await {
            let _ = reg.update(&now("attached", &refused));
            if dev.finished() {
                // Disconnected from outside (nbd-client -d, an error).
                warn!(device = %base.device, "the kernel disconnected the device");
                dev.release();
                return finish(&vol, &base.device, reg, now("failed", &refused)).await;
            }
            continue;
        }
        let claimed = match dev.claim() {
            Ok(c) => c,
            Err(e) => {
                refused.add(&e);
                let _ = reg.update(&now("attached", &refused));
                continue;
            }
        };
        let _ = reg.update(&now("detaching", &refused));
        match dev.detach(claimed).await {
            Ok(()) => {
                info!(device = %base.device, "detached");
                return Ok(());
            }
            // The sync failed: still attached and served, its cache kept.
            Err((Some(d), e)) => {
                dev = d;
                refused.add(&e);
                let _ = reg.update(&now("attached", &refused));
            }
            Err((None, e)) => {
                let why = e.to_string();
                reg.fail(now("failed", &refused), &why);
                return Err(anyhow::Error::new(e).context("detach failed"));
            }
        }
    }
}

async fn attach_fuse(
    vol: Remote,
    url: &str,
    dir: PathBuf,
    threads: usize,
    mut waits: Waits,
) -> anyhow::Result<()> {
    let name = Remote::name_in(url)?;
    let file = dir.join(&name);
    let mut base = registry::this_process(url, "fuse");
    base.device = file.display().to_string();
    let mut refused = Refusals::default();
    let now = |state: &str, r: &Refusals| entry(&base, &vol, state, r, None);
    let reg = Registration::new(&now("attaching", &refused))
        .with_context(|| format!("cannot write the registry entry in {}", registry::dir().display()))?;
    let mount = dir.clone();
    let (v, n) = (vol.clone(), name.clone());
    let session = tokio::task::spawn_blocking(move || fastsan_attach::fuse::mount(v, &n, &mount, threads))
        .await?
        .with_context(|| format!("cannot mount FUSE at {}", dir.display()))?;
    reg.update(&now("attached", &refused))?;
    info!(url, file = %file.display(), "attached");
    say!("fastsan: {url} attached as {}", file.display());
    loop {
        if let Wake::Tick = waits.next().await {
            let _ = reg.update(&now("attached", &refused));
            continue;
        }
        // Unmount first: writes may arrive until then. A busy mount (a loop
        // device, an open file) stays attached and served: cutting it would
        // fail the I/O of whatever uses it.
        match fastsan_attach::fuse::umount(&dir) {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                refused.add(format!(
                    "{} is in use (a loop device, an open file, a shell in it): detach that first",
                    dir.display()
                ));
                let _ = reg.update(&now("attached", &refused));
            }
            Err(e) => {
                // Not root: fusermount does it (lazily).
                info!(dir = %dir.display(), "umount: {e}; leaving it to fusermount");
                let _ = reg.update(&now("detaching", &refused));
                tokio::task::spawn_blocking(move || session.umount_and_join()).await??;
                return finish(&vol, &base.device, reg, now("failed", &refused)).await;
            }
        }
    }
    let _ = reg.update(&now("detaching", &refused));
    // Unmounted: the FUSE thread sees it and ends.
    tokio::task::spawn_blocking(move || session.join()).await??;
    finish(&vol, &base.device, reg, now("failed", &refused)).await
}

/// After the unmount: the final flush, and the last word.
async fn finish(vol: &Remote, device: &str, reg: Registration, last: Entry) -> anyhow::Result<()> {
    if let Err(e) = vol.close().await {
        reg.fail(last, "the final flush failed: writes may be lost");
        return Err(anyhow::Error::new(e).context("the final flush failed: writes may be lost"));
    }
    info!(device, "detached");
    Ok(())
}

/// What an attaching process wakes up for.
enum Wake {
    /// SIGINT or SIGTERM: detach.
    Detach,
    /// Once a second: refresh the registry entry.
    Tick,
}

struct Waits {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    tick: tokio::time::Interval,
}

impl Waits {
    fn new() -> anyhow::Result<Waits> {
        Ok(Waits {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            tick: tokio::time::interval(Duration::from_secs(1)),
        })
    }

    async fn next(&mut self) -> Wake {
        tokio::select! {
            _ = self.int.recv() => {
                info!("SIGINT received");
                Wake::Detach
            }
            _ = self.term.recv() => {
                info!("SIGTERM received");
                Wake::Detach
            }
            _ = self.tick.tick() => Wake::Tick,
        }
    }
}

fn list() -> anyhow::Result<()> {
    let entries = registry::list();
    if entries.is_empty() {
        outln!("nothing attached")?;
        return Ok(());
    }
    outln!(
        "{:<24} {:<5} {:<13} {:>11} {:>10} {:>9} {:>7} {:>8}  URL",
        "DEVICE",
        "KIND",
        "STATE",
        "CONNECTIONS",
        "REQUESTS",
        "IN FLIGHT",
        "ERRORS",
        "PID"
    )?;
    for e in entries {
        outln!(
            "{:<24} {:<5} {:<13} {:>11} {:>10} {:>9} {:>7} {:>8}  {}",
            e.device,
            e.kind,
            e.state,
            format!("{}/{}", e.connections_up, e.connections),
            e.requests,
            e.in_flight.map_or("-".to_string(), |n| n.to_string()),
            e.errors,
            e.pid,
            e.url
        )?;
    }
    Ok(())
}

pub async fn detach(a: DetachArgs) -> anyhow::Result<()> {
    let Some(e) = registry::find(&a.target) else {
        // Not served by a live fastsan attach: nbd-client's, or one whose attach was killed.
        let index = kernel::index_of(&a.target)
            .with_context(|| format!("nothing attached by fastsan at {}", a.target.display()))?;
        anyhow::ensure!(kernel::is_connected(index), "{} is not attached", a.target.display());
        if let Some(lost) = kernel::detach_other(&a.target, a.force).await? {
            let lost = fastsan_initiator::error::chain(&lost);
            warn!(device = %a.target.display(), "disconnected without the kernel's cached data (--force): {lost}");
        }
        outln!("fastsan: {} disconnected", a.target.display())?;
        return Ok(());
    };
    if let Some(why) = e.state.strip_prefix("failed: ") {
        anyhow::bail!("the attachment of {} ended with an error: {why}", e.device);
    }
    anyhow::ensure!(
        !a.force,
        "--force is for a device whose attach is gone; process {} serves {}: detach it without --force",
        e.pid,
        e.device
    );
    // SAFETY: plain kill(2) of a pid the registry vouches for (same start time).
    if unsafe { libc::kill(e.pid as libc::pid_t, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("cannot signal process {}", e.pid));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.timeout);
    loop {
        match registry::list().into_iter().find(|x| x.pid == e.pid && x.started == e.started) {
            None => {
                outln!("fastsan: {} detached", e.device)?;
                return Ok(());
            }
            Some(x) if x.state.starts_with("failed") => anyhow::bail!("detaching {} {}", e.device, x.state),
            // Counted by the process when it refuses to let go.
            Some(x) if x.refusals > e.refusals => anyhow::bail!("{} stays attached: {}", e.device, x.note),
            Some(_) if tokio::time::Instant::now() > deadline => {
                anyhow::bail!("{} is still detaching after {} s (process {})", e.device, a.timeout, e.pid)
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
