//! A volume as `/dev/nbdN`: the kernel's NBD client, connected to this
//! process by one socket pair per queue, each served by a [`bridge`].
//!
//! The device is configured through the NBD netlink interface, or through
//! the older ioctls where the kernel has no netlink family for NBD. If this
//! process dies, the kernel finds the sockets closed and fails the device's
//! I/O; the device stays configured (busy) until `fastsan detach` (or
//! `nbd-client -d`) disconnects it.

use crate::bridge::{self, BridgeStats, End};
use crate::netlink::{self, NbdNetlink};
use crate::Remote;
use fastsan_initiator::remote::Single;
use fastsan_nbd::consts::*;
use std::io;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn, Instrument};

/// How the device is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Interface {
    /// Netlink when the kernel has it, else the ioctls.
    #[default]
    Auto,
    Netlink,
    Ioctl,
}

#[derive(Debug, Clone)]
pub struct KernelOptions {
    /// `/dev/nbdN`, or the first free device.
    pub device: Option<PathBuf>,
    /// Socket pairs (the kernel's hardware queues).
    pub queues: usize,
    pub interface: Interface,
    /// How long the kernel lets a request run before it takes its socket
    /// for dead and sends it again on another (`--device-timeout`). Else
    /// [`NETLINK_DEVICE_TIMEOUT`] through netlink, where a socket taken for
    /// dead is replaced at once, and `initiator_longest` through the ioctls,
    /// where it cannot be: there the kernel must wait out the initiator's
    /// retries through a target restart, or it would kill a queue per stuck
    /// request, then the device.
    pub timeout: Option<Duration>,
    /// The longest the initiator takes to answer a request.
    pub initiator_longest: Duration,
}

/// The device timeout through netlink, unless told: the kernel's own
/// default. A request past it is sent again on a fresh socket (the first
/// copy still runs; a write's copy waits behind it), which also bounds what
/// a request lost inside the kernel costs: once, in the kernel-attach guest,
/// a READ the kernel had started but never sent to any socket (attach had
/// answered all it received, and no socket held an unread byte) waited the
/// whole timeout, then went through at once.
pub const NETLINK_DEVICE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("the kernel has no NBD driver ({0}); attach the volume as a file with --fuse DIR instead")]
    NoDriver(String),
    #[error("{0} is busy: it is attached already (fastsan attach --list shows what fastsan attached)")]
    Busy(String),
    #[error("{0} is not an NBD device (expected /dev/nbdN)")]
    NotNbd(String),
    #[error("no free NBD device (all /dev/nbd* are attached)")]
    NoFreeDevice,
    #[error("the volume's block size {0} is above what the kernel's NBD driver takes (4096)")]
    BlockSize(u32),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> AttachError {
    let what = what.into();
    move |source| AttachError::Io { what, source }
}

/// An attached device: its bridges run until [`Device::detach`] or until
/// the kernel disconnects.
pub struct Device {
    pub index: u32,
    pub path: PathBuf,
    pub stats: Arc<BridgeStats>,
    vol: Remote,
    control: Control,
    queues: Arc<Queues>,
}

/// The bridges of a device's queues. Through netlink, a queue whose socket
/// the kernel closes (it gives up on a request past the device's timeout,
/// shuts that socket and sends the request again on another queue, or waits
/// for a new socket when none is left) gets a new socket pair at once
/// (NBD_CMD_RECONFIGURE), so that the device never runs out of queues. The
/// old socket's requests still in flight are answered into the void, and
/// their copies that the kernel sends again keep their order behind them
/// (the session orders overlapping writes by when they were issued).
struct Queues {
    index: u32,
    device: String,
    vol: Remote,
    stats: Arc<BridgeStats>,
    /// Through netlink: the kernel takes new sockets.
    renew: bool,
    /// New sockets under way (a closed queue whose new bridge is not running yet).
    renewing: AtomicUsize,
    /// Per queue: new sockets in a row that the kernel closed before they
    /// brought a request. Per queue, so that many queues closed at once, idle,
    /// are each renewed.
    barren: Vec<AtomicU32>,
    /// Every bridge started (a closed queue's too: joined at the detach),
    /// and whether the detach has begun (then no new bridge starts).
    tasks: std::sync::Mutex<(bool, Vec<JoinHandle<io::Result<()>>>)>,
}

/// Seconds the kernel's requests wait for a new socket when every queue's is
/// closed at once (attach gives new ones within milliseconds), instead of
/// failing; and how soon they fail if attach itself is gone (killed).
const DEAD_CONN_TIMEOUT: u64 = 10;

/// New sockets in a row that bring no request before the kernel closes them
/// too, after which no more are given (the kernel drops a socket it has no
/// dead slot for, and says yes).
const MAX_BARREN: u32 = 8;

impl Queues {
    fn start(self: &Arc<Self>, queue: usize, stream: tokio::net::UnixStream) {
        let mut tasks = self.tasks.lock().expect("never poisoned");
        if tasks.0 {
            return; // disconnecting: the socket closes, the kernel is letting go
        }
        let me = self.clone();
        let span = tracing::info_span!("nbd", device = %self.device, queue);
        let ended = move |end| me.ended(queue, end);
        let served = bridge::serve_with(stream, self.vol.clone(), self.stats.clone(), ended);
        tasks.1.retain(|t| !t.is_finished());
        tasks.1.push(tokio::spawn(served.instrument(span)));
    }

    /// `queue`'s bridge stopped reading: on NBD_CMD_DISC (a disconnect,
    /// ours or from elsewhere) no new socket is given any more; if the
    /// kernel closed the socket without it, it gets a new one.
    fn ended(self: &Arc<Self>, queue: usize, end: End) {
        let received = match end {
            End::Disconnect => {
                self.tasks.lock().expect("never poisoned").0 = true;
                return;
            }
            End::Closed { received } => received,
        };
        if !self.renew || self.tasks.lock().expect("never poisoned").0 {
            return;
        }
        let Some(streak) = self.barren.get(queue) else { return };
        let barren = match received {
            0 => streak.fetch_add(1, SeqCst) + 1,
            _ => {
                streak.store(0, SeqCst);
                0
            }
        };
        if barren > MAX_BARREN {
            warn!(device = %self.device, queue, "the kernel closes every new socket of this queue at once: no more are given");
            return;
        }
        self.renewing.fetch_add(1, SeqCst);
        let me = self.clone();
        tokio::spawn(async move {
            if barren > 0 {
                tokio::time::sleep(Duration::from_millis(50 << barren.min(5))).await;
            }
            if me.tasks.lock().expect("never poisoned").0 {
                // Disconnected meanwhile: a new socket would undo that.
                me.renewing.fetch_sub(1, SeqCst);
                return;
            }
            let index = me.index;
            let made = tokio::task::spawn_blocking(move || new_socket(index)).await.map_err(io::Error::other);
            match made.and_then(|r| r) {
                Ok(s) => {
                    info!(device = %me.device, queue, "gave the kernel a new socket for the queue it closed");
                    me.start(queue, s);
                }
                Err(e) => warn!(device = %me.device, queue, error = &e as &dyn std::error::Error,
                                "the kernel took no new socket for the queue it closed"),
            }
            me.renewing.fetch_sub(1, SeqCst);
        });
    }

    /// Whether every bridge ended and none is about to start.
    fn finished(&self) -> bool {
        let tasks = self.tasks.lock().expect("never poisoned");
        self.renewing.load(SeqCst) == 0 && tasks.1.iter().all(|t| t.is_finished())
    }

    /// Starts the detach: no bridge starts after this; the ones there are
    /// (finished or not).
    fn detaching(&self) -> Vec<JoinHandle<io::Result<()>>> {
        let mut tasks = self.tasks.lock().expect("never poisoned");
        tasks.0 = true;
        std::mem::take(&mut tasks.1)
    }
}

/// A socket pair for one queue: this process's end (a bridge serves it)
/// and the end the kernel is given.
fn socket_pair() -> io::Result<(tokio::net::UnixStream, OwnedFd)> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    Ok((tokio::net::UnixStream::from_std(ours)?, theirs.into()))
}

/// A socket pair whose far end device `index` takes in place of a socket it
/// closed (NBD_CMD_RECONFIGURE); the near end.
fn new_socket(index: u32) -> io::Result<tokio::net::UnixStream> {
    let (ours, theirs) = socket_pair()?;
    let mut nl = NbdNetlink::open()?.ok_or_else(|| io::Error::other("no NBD netlink family"))?;
    nl.reconfigure(index, theirs.as_raw_fd())?;
    // The kernel holds its own reference now.
    drop(theirs);
    Ok(ours)
}

enum Control {
    /// The socket that connected the device, to disconnect it.
    Netlink(NbdNetlink),
    /// The thread sitting in NBD_DO_IT, and the device it holds open.
    Ioctl { file: Arc<std::fs::File>, doit: std::thread::JoinHandle<io::Result<()>> },
}

/// The transmission flags the kernel gets, from the volume's capabilities.
/// The bridges of all queues share one session, so a FLUSH on any queue
/// covers writes completed on every queue (CAN_MULTI_CONN).
pub fn flags(vol: &Remote) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_CAN_MULTI_CONN;
    if vol.read_only() {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_WRITE_ZEROES;
        if vol.can_trim() {
            f |= TFLAG_SEND_TRIM;
        }
    }
    f
}

/// `/dev/nbdN` -> N.
pub fn index_of(dev: &Path) -> Result<u32, AttachError> {
    let name = dev.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.strip_prefix("nbd")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| AttachError::NotNbd(dev.display().to_string()))
}

/// Whether the kernel serves device N now (its `pid` file exists while it
/// is connected).
pub fn is_connected(index: u32) -> bool {
    Path::new(&format!("/sys/block/nbd{index}/pid")).exists()
}

/// The NBD driver, found before the volume is opened; what [`attach`]
/// connects the device with.
pub struct Driver {
    wanted: Option<u32>,
    /// `None`: the ioctls.
    nl: Option<NbdNetlink>,
}

/// What can be checked before the volume is opened: the driver is there
/// (loaded if need be), the device named is one and is free.
pub fn preflight(opts: &KernelOptions) -> Result<Driver, AttachError> {
    let wanted = opts.device.as_deref().map(index_of).transpose()?;
    let nl = match opts.interface {
        Interface::Ioctl if !Path::new("/dev/nbd0").exists() => {
            return Err(AttachError::NoDriver("no /dev/nbd0".into()))
        }
        Interface::Ioctl => None,
        _ => open_netlink()?,
    };
    if nl.is_none() && opts.interface == Interface::Netlink {
        return Err(AttachError::NoDriver("no NBD netlink family".into()));
    }
    match wanted {
        Some(i) if is_connected(i) => Err(AttachError::Busy(format!("/dev/nbd{i}"))),
        _ => Ok(Driver { wanted, nl }),
    }
}

/// Attaches `vol` as an NBD device through the driver [`preflight`] found.
/// A device taken meanwhile is refused by the kernel (EBUSY): [`AttachError::Busy`].
pub async fn attach(vol: Remote, driver: Driver, opts: &KernelOptions) -> Result<Device, AttachError> {
    let Driver { wanted, nl } = driver;
    let bs = vol.block_size().max(512);
    if bs > 4096 {
        return Err(AttachError::BlockSize(bs));
    }
    let mut ours = Vec::new();
    let mut theirs: Vec<OwnedFd> = Vec::new();
    for _ in 0..opts.queues {
        let (a, b) = socket_pair().map_err(io_err("cannot make a socket pair"))?;
        ours.push(a);
        theirs.push(b);
    }
    let stats = Arc::new(BridgeStats::default());
    let flags = flags(&vol) as u64;
    // The kernel's copy of a request past the timeout is safe only where the
    // session keeps overlapping writes in order, with a fence for retries: a
    // BRP volume. An NBD export (no fence) or a mirror waits it out instead.
    let netlink_default = match &vol {
        Remote::One(Single::Brp(_)) => NETLINK_DEVICE_TIMEOUT,
        _ => opts.initiator_longest,
    };
    let (index, control) = match nl {
        Some(mut nl) => {
            let c = netlink::Connect {
                index: wanted,
                size: vol.size() / bs as u64 * bs as u64,
                block_size: bs as u64,
                server_flags: flags,
                client_flags: 0,
                timeout: opts.timeout.unwrap_or(netlink_default).as_secs().max(1),
                dead_conn_timeout: DEAD_CONN_TIMEOUT,
                sockets: theirs.iter().map(|f| f.as_raw_fd()).collect(),
            };
            let index = nl.connect(&c).map_err(|e| match (e.raw_os_error(), wanted) {
                (Some(libc::EBUSY), Some(i)) => AttachError::Busy(format!("/dev/nbd{i}")),
                _ => {
                    AttachError::Io { what: "the kernel refused to connect the NBD device".into(), source: e }
                }
            })?;
            (index, Control::Netlink(nl))
        }
        None => {
            let index = match wanted {
                Some(i) => i,
                None => free_device()?,
            };
            let timeout = opts.timeout.unwrap_or(opts.initiator_longest).as_secs().max(1);
            let socks = theirs.drain(..).map(|f| f.into_raw_fd());
            let control = ioctl_connect(index, &vol, bs, flags, timeout, socks)?;
            (index, control)
        }
    };
    // The kernel holds its ends now.
    drop(theirs);
    let path = PathBuf::from(format!("/dev/nbd{index}"));
    let queues = Arc::new(Queues {
        index,
        device: path.display().to_string(),
        vol: vol.clone(),
        stats: stats.clone(),
        renew: matches!(control, Control::Netlink(_)),
        renewing: AtomicUsize::new(0),
        barren: (0..ours.len()).map(|_| AtomicU32::new(0)).collect(),
        tasks: std::sync::Mutex::new((false, Vec::new())),
    });
    for (queue, s) in ours.into_iter().enumerate() {
        queues.start(queue, s);
    }
    info!(device = %path.display(), size = vol.size(), block_size = bs, queues = opts.queues,
          interface = match control { Control::Netlink(_) => "netlink", Control::Ioctl { .. } => "ioctl" },
          "NBD device connected");
    Ok(Device { index, path, stats, vol, control, queues })
}

fn open_netlink() -> Result<Option<NbdNetlink>, AttachError> {
    if let Some(nl) = NbdNetlink::open().map_err(io_err("cannot open a generic netlink socket"))? {
        return Ok(Some(nl));
    }
    // The module may only be unloaded: load it, as nbd-client does.
    let loaded = std::process::Command::new("modprobe")
        .arg("nbd")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .output();
    match NbdNetlink::open().map_err(io_err("cannot open a generic netlink socket"))? {
        Some(nl) => Ok(Some(nl)),
        // An old kernel: the ioctls.
        None if Path::new("/dev/nbd0").exists() => Ok(None),
        None => {
            let why = match loaded {
                Ok(o) if o.status.success() => "modprobe nbd loaded nothing".to_string(),
                Ok(o) => format!("modprobe nbd: {}", String::from_utf8_lossy(&o.stderr).trim()),
                Err(e) => format!("cannot run modprobe: {e}"),
            };
            Err(AttachError::NoDriver(why))
        }
    }
}

/// The first `/dev/nbdN` the kernel does not serve.
fn free_device() -> Result<u32, AttachError> {
    (0..1024)
        .take_while(|i| Path::new(&format!("/sys/block/nbd{i}")).exists())
        .find(|i| !is_connected(*i))
        .ok_or(AttachError::NoFreeDevice)
}

// The NBD ioctls (linux/nbd.h): _IO(0xab, n).
const NBD_SET_SOCK: libc::c_ulong = 0xab00;
const NBD_SET_BLKSIZE: libc::c_ulong = 0xab01;
const NBD_DO_IT: libc::c_ulong = 0xab03;
const NBD_CLEAR_SOCK: libc::c_ulong = 0xab04;
const NBD_SET_SIZE_BLOCKS: libc::c_ulong = 0xab07;
const NBD_DISCONNECT: libc::c_ulong = 0xab08;
const NBD_SET_TIMEOUT: libc::c_ulong = 0xab09;
const NBD_SET_FLAGS: libc::c_ulong = 0xab0a;

fn ioctl(fd: RawFd, req: libc::c_ulong, arg: libc::c_ulong) -> io::Result<()> {
    // SAFETY: the NBD ioctls take an integer argument, no pointer.
    if unsafe { libc::ioctl(fd, req as _, arg) } < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The ioctl way: set everything on the open device, hand it the sockets,
/// and leave a thread in NBD_DO_IT, which returns when the device is
/// disconnected.
fn ioctl_connect(
    index: u32,
    vol: &Remote,
    bs: u32,
    flags: u64,
    timeout: u64,
    socks: impl Iterator<Item = RawFd>,
) -> Result<Control, AttachError> {
    let path = format!("/dev/nbd{index}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(io_err(format!("cannot open {path}")))?;
    let fd = file.as_raw_fd();
    let set = |what: &str, req, arg| ioctl(fd, req, arg).map_err(io_err(format!("{path}: {what}")));
    set("set block size", NBD_SET_BLKSIZE, bs as _)?;
    set("set size", NBD_SET_SIZE_BLOCKS, (vol.size() / bs as u64) as _)?;
    set("set flags", NBD_SET_FLAGS, flags as _)?;
    set("set timeout", NBD_SET_TIMEOUT, timeout as _)?;
    for (added, s) in socks.enumerate() {
        let r = ioctl(fd, NBD_SET_SOCK, s as _);
        // SAFETY: we own `s`; the kernel took its own reference.
        unsafe { libc::close(s) };
        if let Err(e) = r {
            if added > 0 {
                // Ours, half set up: let go of it.
                let _ = ioctl(fd, NBD_CLEAR_SOCK, 0);
            }
            return Err(match e.raw_os_error() {
                Some(libc::EBUSY) => AttachError::Busy(path.clone()),
                _ => AttachError::Io { what: format!("{path}: set socket"), source: e },
            });
        }
    }
    let file = Arc::new(file);
    let held = file.clone();
    let doit = std::thread::Builder::new()
        .name(format!("nbd{index}-do-it"))
        .spawn(move || {
            // A signal delivered to this thread would interrupt NBD_DO_IT,
            // and the kernel would tear the device down there and then.
            // SAFETY: a full signal set, applied to this thread only.
            unsafe {
                let mut all: libc::sigset_t = std::mem::zeroed();
                libc::sigfillset(&mut all);
                libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
            }
            let r = ioctl(held.as_raw_fd(), NBD_DO_IT, 0);
            let _ = ioctl(held.as_raw_fd(), NBD_CLEAR_SOCK, 0);
            r
        })
        .map_err(io_err("cannot start the NBD_DO_IT thread"))?;
    Ok(Control::Ioctl { file, doit })
}

/// Why the device would not let go.
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    #[error("{0} is in use (mounted, or held by a loop, md or dm device): unmount it first")]
    InUse(String),
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("the final flush failed: writes may be lost")]
    Flush(#[source] fastsan_initiator::Error),
    /// A device no live fastsan attach serves could not be synced: nobody
    /// may be left to write its cached data.
    #[error(
        "{device} stays attached: the kernel's cached data for it cannot be written (is the process \
         that served it gone, a killed fastsan attach?); `fastsan detach --force {device}` \
         disconnects it, and that data is lost"
    )]
    Unsynced {
        device: String,
        #[source]
        source: Box<DetachError>,
    },
}

impl Device {
    /// Whether the kernel still serves the device (false once it was
    /// disconnected, by `detach`, `nbd-client -d`, or an error).
    pub fn finished(&self) -> bool {
        self.queues.finished()
    }

    /// Asks the kernel to let go of a device whose queues all ended without
    /// a detach (a disconnect from elsewhere: then it has already; or every
    /// socket closed and no new one taken: then it still holds the device,
    /// which would stay busy until `nbd-client -d`). Errors are ignored.
    pub fn release(&mut self) {
        self.queues.detaching();
        self.disconnect();
    }

    /// Tells the kernel to disconnect the device (it sends NBD_CMD_DISC on
    /// every live socket); an error means it let go already.
    fn disconnect(&mut self) {
        let r = match &mut self.control {
            Control::Netlink(nl) => nl.disconnect(self.index),
            Control::Ioctl { file, .. } => ioctl(file.as_raw_fd(), NBD_DISCONNECT, 0),
        };
        if let Err(e) = r {
            debug!(device = %self.path.display(), "disconnect: {e}");
        }
    }

    /// Claims the device for the detach: fails with [`DetachError::InUse`]
    /// while it is mounted or held. `None` when the kernel let go of it already.
    pub fn claim(&self) -> Result<Option<std::fs::File>, DetachError> {
        claim(&self.path)
    }

    /// Detaches cleanly, with the device [`Device::claim`]ed: writes the
    /// kernel's cached data for it and flushes (fsync on the device),
    /// disconnects, waits for every request to be answered, and closes the
    /// volume (flushes it; a mirror clears its log). If the sync fails, the
    /// device is given back, still attached and served: its cached data
    /// must not be dropped. Unless the volume's session is over (its target
    /// restarted without the volume's data, or its host lost acknowledged
    /// writes): then nothing can be made durable any more, a new try would
    /// fail the same way for ever, and the device is disconnected with that
    /// error (it stayed attached, refusing every detach, before).
    pub async fn detach(self, claimed: Option<std::fs::File>) -> Result<(), (Option<Device>, DetachError)> {
        // Held until the end: nobody can mount the device in between.
        let _claimed = match sync(claimed, &self.path).await {
            Ok(f) => f,
            Err(e) => match self.vol.flush().await {
                Err(over) if over.session_over() => {
                    warn!(device = %self.path.display(), "{e}: the volume's session is over, detaching");
                    self.disconnect_and_wait().await;
                    return Err((None, DetachError::Flush(over)));
                }
                _ => return Err((Some(self), e)),
            },
        };
        let vol = self.disconnect_and_wait().await;
        vol.close().await.map_err(|e| (None, DetachError::Flush(e)))
    }

    /// Disconnects, and waits for every queue to end (their requests
    /// answered) and, with the ioctls, for the kernel's thread; the volume.
    async fn disconnect_and_wait(mut self) -> Remote {
        let bridges = self.queues.detaching();
        self.disconnect();
        for b in bridges {
            match tokio::time::timeout(Duration::from_secs(60), b).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => debug!(device = %self.path.display(), "queue ended: {e}"),
                Ok(Err(e)) => warn!(device = %self.path.display(), "queue task failed: {e}"),
                Err(_) => {
                    warn!(device = %self.path.display(), "a queue did not end within 60 s of the disconnect")
                }
            }
        }
        if let Control::Ioctl { doit, .. } = self.control {
            let _ = tokio::task::spawn_blocking(move || doit.join()).await;
        }
        self.vol
    }
}

/// Claims a block device for its detach: O_EXCL on a block device fails
/// with EBUSY while it is mounted or held by a loop, md or dm device (plain
/// openers, a `dd`, are not seen). `None` when the device is gone already.
fn claim(path: &Path) -> Result<Option<std::fs::File>, DetachError> {
    let open = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL | libc::O_CLOEXEC).open(path);
    match open {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            Err(DetachError::InUse(path.display().to_string()))
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO | libc::ENODEV | libc::ENOENT)) => {
            debug!(device = %path.display(), "gone before the final sync: {e}");
            Ok(None)
        }
        Err(e) => Err(DetachError::Io {
            what: format!("cannot open {} for the final sync", path.display()),
            source: e,
        }),
    }
}

/// Writes the kernel's cached data for a claimed device and flushes it
/// (fsync on a block device sends a FLUSH); gives the claim back.
async fn sync(claimed: Option<std::fs::File>, path: &Path) -> Result<Option<std::fs::File>, DetachError> {
    let Some(f) = claimed else { return Ok(None) };
    let synced =
        tokio::task::spawn_blocking(move || f.sync_all().map(|()| f)).await.map_err(io::Error::other);
    synced.and_then(|r| r).map(Some).map_err(|e| DetachError::Io {
        what: format!("{}: writing the kernel's cached data failed", path.display()),
        source: e,
    })
}

/// Detaches a device that no live `fastsan attach` serves (`nbd-client`'s,
/// or one whose `fastsan attach` was killed): refused while it is mounted
/// or held; else synced and disconnected through netlink. A device whose
/// sync fails stays attached ([`DetachError::Unsynced`]) unless `force`:
/// then it is disconnected all the same, and the sync's error returned
/// with the success (the kernel's cached data is lost). A killed attach
/// left its device so, and nothing could free it but `nbd-client -d`.
pub async fn detach_other(path: &Path, force: bool) -> Result<Option<DetachError>, DetachError> {
    let io = |what: String| move |source| DetachError::Io { what, source };
    let index = index_of(path)
        .map_err(|e| DetachError::Io { what: e.to_string(), source: io::ErrorKind::InvalidInput.into() })?;
    let (_claimed, lost) = match sync(claim(path)?, path).await {
        Ok(claimed) => (claimed, None),
        // Claimed again: still nobody may mount it meanwhile.
        Err(e) if force => (claim(path)?, Some(e)),
        Err(e) => {
            return Err(DetachError::Unsynced { device: path.display().to_string(), source: Box::new(e) })
        }
    };
    let mut nl = NbdNetlink::open()
        .and_then(|nl| nl.ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "no NBD netlink family")))
        .map_err(io("cannot reach the kernel's NBD driver".into()))?;
    nl.disconnect(index).map_err(io(format!("cannot disconnect {}", path.display())))?;
    Ok(lost)
}
