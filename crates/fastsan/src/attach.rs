//! `fastsan attach` and `fastsan detach`: arguments, the process's life
//! (signals, the registry entry, the last word). The device and the file
//! are `fastsan_attach`'s.

use crate::ClientArgs;
use anyhow::Context;
use fastsan_attach::kernel::{self, DetachError, Interface, KernelOptions};
use fastsan_attach::registry::{self, Entry, Registration};
use fastsan_initiator::Volume;
use std::path::{Path, PathBuf};
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
    /// brp://HOST:PORT/VOLUME or brp+unix:///VOLUME?socket=PATH
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
    /// Attach as a file in DIR over FUSE instead (DIR must exist).
    #[arg(long, value_name = "DIR")]
    fuse: Option<PathBuf>,
    /// FUSE threads serving requests concurrently.
    #[arg(long, default_value_t = 4, value_name = "N", requires = "fuse")]
    threads: usize,
    /// List what is attached on this host (device, URL, state, connections).
    #[arg(long, conflicts_with_all = ["device", "fuse"])]
    list: bool,
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
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    if a.list {
        return list();
    }
    let url = a.url.clone().expect("clap requires a URL unless --list");
    let opts = a.client.options()?;
    if let Some(dir) = &a.fuse {
        anyhow::ensure!((1..=64).contains(&a.threads), "--threads must be 1..=64");
        check_fuse()?;
        anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
    }
    let queues =
        a.queues.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(4));
    anyhow::ensure!((1..=16).contains(&queues), "--queues must be 1..=16");
    let kopts = KernelOptions { device: a.device, queues, interface: a.interface };
    if a.fuse.is_none() {
        kernel::preflight(&kopts)?;
    }
    let vol = Volume::connect(&url, opts).await.with_context(|| format!("cannot open {url}"))?;
    match a.fuse {
        Some(dir) => attach_fuse(vol, &url, dir, a.threads).await,
        None => attach_kernel(vol, &url, &kopts).await,
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

async fn attach_kernel(vol: Volume, url: &str, opts: &KernelOptions) -> anyhow::Result<()> {
    let dev = kernel::attach(vol.clone(), opts).await?;
    let path = dev.path.display().to_string();
    let entry = |state: &str, refusals: u64| {
        let s = vol.stats();
        let (up, all) = vol.connections();
        Entry {
            pid: std::process::id(),
            url: url.to_owned(),
            device: path.clone(),
            kind: "nbd".into(),
            state: state_of(state, up, all),
            connections_up: up,
            connections: all,
            requests: dev.stats.requests.load(Relaxed),
            errors: dev.stats.errors.load(Relaxed),
            retries: s.retries,
            reconnects: s.reconnects,
            refusals,
        }
    };
    let reg = Registration::new(&entry("attached", 0)).context("cannot write the registry entry")?;
    println!("fastsan: {url} attached as {path}");
    let mut signals = Signals::new()?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut refusals = 0;
    loop {
        tokio::select! {
            _ = signals.next() => {}
            _ = tick.tick() => {
                let _ = reg.update(&entry("attached", refusals));
                if dev.finished() {
                    // Disconnected from outside (nbd-client -d, an error).
                    warn!(device = %path, "the kernel disconnected the device");
                    vol.flush().await.context("the final flush failed: writes may be lost")?;
                    info!(device = %path, "detached");
                    return Ok(());
                }
                continue;
            }
        }
        match dev.claim() {
            Ok(claimed) => {
                let _ = reg.update(&entry("detaching", refusals));
                let r = dev.detach(claimed).await;
                drop(reg);
                return match r {
                    Ok(()) => {
                        info!(device = %path, "detached");
                        Ok(())
                    }
                    Err(e @ DetachError::Flush(_)) => Err(e.into()),
                    Err(e) => Err(anyhow::Error::new(e).context("detach failed")),
                };
            }
            Err(e) => {
                warn!("{e}; still serving");
                refusals += 1;
                let _ = reg.update(&entry("attached", refusals));
            }
        }
    }
}

fn state_of(state: &str, up: usize, all: usize) -> String {
    match state {
        "attached" if up == 0 => "down".into(),
        "attached" if up < all => "reconnecting".into(),
        s => s.into(),
    }
}

async fn attach_fuse(vol: Volume, url: &str, dir: PathBuf, threads: usize) -> anyhow::Result<()> {
    let name = fastsan_initiator::BrpUrl::parse(url)?.volume;
    let file = dir.join(&name);
    let mount = dir.clone();
    let (v, n) = (vol.clone(), name.clone());
    let session = tokio::task::spawn_blocking(move || fastsan_attach::fuse::mount(v, &n, &mount, threads))
        .await?
        .with_context(|| format!("cannot mount FUSE at {}", dir.display()))?;
    let entry = |state: &str, refusals: u64| {
        let s = vol.stats();
        let (up, all) = vol.connections();
        Entry {
            pid: std::process::id(),
            url: url.to_owned(),
            device: file.display().to_string(),
            kind: "fuse".into(),
            state: state_of(state, up, all),
            connections_up: up,
            connections: all,
            requests: s.requests,
            errors: 0,
            retries: s.retries,
            reconnects: s.reconnects,
            refusals,
        }
    };
    let reg = Registration::new(&entry("attached", 0)).context("cannot write the registry entry")?;
    info!(url, file = %file.display(), "attached");
    println!("fastsan: {url} attached as {}", file.display());
    let mut signals = Signals::new()?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut refusals = 0;
    loop {
        tokio::select! {
            _ = signals.next() => {}
            _ = tick.tick() => {
                let _ = reg.update(&entry("attached", refusals));
                continue;
            }
        }
        // Unmount first: writes may arrive until then. A busy mount (a loop
        // device, an open file) stays attached and served: cutting it would
        // fail the I/O of whatever uses it.
        match fastsan_attach::fuse::umount(&dir) {
            Ok(()) => break,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                warn!(dir = %dir.display(), "still in use (a loop device, an open file, a shell in it): \
                      detach that first, then signal again; still serving");
                refusals += 1;
                let _ = reg.update(&entry("attached", refusals));
            }
            Err(e) => {
                // Not root: fusermount does it (lazily).
                info!(dir = %dir.display(), "umount: {e}; leaving it to fusermount");
                let _ = reg.update(&entry("detaching", refusals));
                tokio::task::spawn_blocking(move || session.umount_and_join()).await??;
                return finish(&vol, &file).await;
            }
        }
    }
    let _ = reg.update(&entry("detaching", refusals));
    // Unmounted: the FUSE thread sees it and ends.
    tokio::task::spawn_blocking(move || session.join()).await??;
    finish(&vol, &file).await
}

/// After the unmount: the final flush, and the last word.
async fn finish(vol: &Volume, file: &Path) -> anyhow::Result<()> {
    vol.flush().await.context("the final flush failed: writes may be lost")?;
    info!(file = %file.display(), "detached");
    Ok(())
}

/// SIGINT and SIGTERM.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        Ok(Signals { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.int.recv() => info!("SIGINT received"),
            _ = self.term.recv() => info!("SIGTERM received"),
        }
    }
}

fn list() -> anyhow::Result<()> {
    let entries = registry::list();
    if entries.is_empty() {
        println!("nothing attached");
        return Ok(());
    }
    println!(
        "{:<24} {:<5} {:<13} {:>11} {:>10} {:>7} {:>8}  URL",
        "DEVICE", "KIND", "STATE", "CONNECTIONS", "REQUESTS", "ERRORS", "PID"
    );
    for e in entries {
        println!(
            "{:<24} {:<5} {:<13} {:>11} {:>10} {:>7} {:>8}  {}",
            e.device,
            e.kind,
            e.state,
            format!("{}/{}", e.connections_up, e.connections),
            e.requests,
            e.errors,
            e.pid,
            e.url
        );
    }
    Ok(())
}

pub async fn detach(a: DetachArgs) -> anyhow::Result<()> {
    let Some(e) = registry::find(&a.target) else {
        // Not ours: a device some other tool attached.
        let index = kernel::index_of(&a.target)
            .with_context(|| format!("nothing attached by fastsan at {}", a.target.display()))?;
        anyhow::ensure!(kernel::is_connected(index), "{} is not attached", a.target.display());
        let mut nl = fastsan_attach::netlink::NbdNetlink::open()?
            .context("the kernel has no NBD netlink interface to disconnect with")?;
        nl.disconnect(index).with_context(|| format!("cannot disconnect {}", a.target.display()))?;
        println!("fastsan: {} disconnected", a.target.display());
        return Ok(());
    };
    // SAFETY: plain kill(2) of a pid read from the registry.
    if unsafe { libc::kill(e.pid as libc::pid_t, libc::SIGTERM) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("cannot signal process {}", e.pid));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(a.timeout);
    loop {
        match registry::list().into_iter().find(|x| x.pid == e.pid) {
            None => {
                println!("fastsan: {} detached", e.device);
                return Ok(());
            }
            // Counted by the process when it refuses to let go.
            Some(x) if x.refusals > e.refusals => anyhow::bail!(
                "{} is in use (mounted, a loop device, an open file): it stays attached; unmount it first",
                e.device
            ),
            Some(_) if tokio::time::Instant::now() > deadline => {
                anyhow::bail!("{} is still detaching after {} s (process {})", e.device, a.timeout, e.pid)
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
