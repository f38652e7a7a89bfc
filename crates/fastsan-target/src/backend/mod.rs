//! Backends: where a volume's bytes live, as a stack (nbdkit's plugins and
//! filters).
//!
//! A **store** (memory, file, null) implements [`Backend`] whole: every
//! method, capabilities included, has no default, so a new store states what
//! it can do. A **layer** (stats, faults, delay, read-only) implements
//! [`Layer`]: every method there forwards to [`Layer::next`] unless the layer
//! overrides it, so a layer changes only what it means to change and can
//! never forget to pass a call or a capability through. [`build`] makes the
//! whole chain of a volume from its spec, in one place.
//!
//! Calls are synchronous and thread-safe; the connection decides where to run
//! them ([`Backend::may_block`]: inline, or on the I/O pool). Requests were
//! checked against the size, the block sizes and the capabilities before any
//! call reaches a backend.

mod blocks;
mod delay;
mod faults;
mod file;
#[cfg(target_os = "linux")]
mod iobuf;
mod memory;
mod null;
mod readonly;
pub mod remote;
mod stats;
#[cfg(target_os = "linux")]
pub mod uring;

pub use delay::DelayLayer;
pub use faults::{Effect, FaultLayer, FaultOps, FaultRule, Faults};
pub use file::FileBackend;
pub use memory::MemoryBackend;
pub use null::NullBackend;
pub use readonly::ReadOnlyLayer;
pub use remote::RemoteBackend;
pub use stats::{Histogram, StatsLayer, VolumeStats, VolumeStatsSnapshot, LATENCY_SAMPLE};

use crate::config::{BackendSpec, VolumeSpec};
use crate::request::{Extent, ReadData};
use std::io;
use std::path::Path;
use std::sync::Arc;

/// Why a backend call failed. Each front end maps it to its wire code in its
/// one mapping function, looking at the command and its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The operation (or this form of it, such as a fast zero) is not possible here.
    #[error("not supported here")]
    Unsupported,
    /// Out of space (ENOSPC, EDQUOT).
    #[error("no space left on the device")]
    NoSpace,
    /// The store refuses changes (EROFS).
    #[error("the store is read-only")]
    ReadOnly,
    /// Any other failure of the device, with its errno.
    #[error("{}", io::Error::from_raw_os_error(*.0))]
    Io(i32),
    /// The store could not be reached for now (a remote target away past
    /// the reconnect timeout): the call failed, but nothing is known lost. A
    /// flush that fails so is not latched (see [`BackendError::WritebackLost`]):
    /// if the store's host did lose writes, the store says so itself when it
    /// is back (a remote session that sees its target's host rebooted).
    #[error("the store is unreachable for now (nothing known lost)")]
    Unavailable,
    /// An earlier flush failed: writes it covered may be lost, and the volume
    /// fails every request (it can neither promise durability nor say which
    /// data a read returns) until it is reopened.
    #[error("an earlier flush of this volume failed (writes may be lost); it fails every request until it is reopened")]
    WritebackLost,
}

impl From<io::Error> for BackendError {
    fn from(e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => BackendError::NoSpace,
            Some(libc::EROFS) => BackendError::ReadOnly,
            Some(libc::EOPNOTSUPP) => BackendError::Unsupported,
            Some(errno) => BackendError::Io(errno),
            None if e.kind() == io::ErrorKind::Unsupported => BackendError::Unsupported,
            // A short read of a file that shrank under us, and other errors without errno.
            None => BackendError::Io(libc::EIO),
        }
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// A read or a write handed to a store that finishes it later ([`Backend::submit`]).
pub enum DeviceIo {
    Read { offset: u64, len: u32 },
    Write { offset: u64, data: bytes::Bytes },
}

/// What a submitted I/O gives back when it finishes: a read's data (`None` for a write).
pub type DeviceDone = Box<dyn FnOnce(Result<Option<ReadData>>) + Send>;

/// How to write zeroes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Durable before returning.
    pub fua: bool,
    /// Keep the range allocated (do not punch a hole).
    pub no_hole: bool,
    /// Fail with [`BackendError::Unsupported`] rather than write zeroes slowly.
    pub fast_only: bool,
}

/// The block sizes a backend works with (NBD's INFO_BLOCK_SIZE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Offsets and lengths must be multiples of this (a power of two).
    pub minimum: u32,
    /// Requests of this size and alignment are efficient.
    pub preferred: u32,
    /// The largest READ or WRITE it takes.
    pub maximum: u32,
}

/// A store or a layer of a volume's stack. Stores implement it directly;
/// layers implement [`Layer`] and get it from the pass-through.
pub trait Backend: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;
    fn block_sizes(&self) -> BlockSizes;
    /// Whether WRITE, TRIM and WRITE_ZEROES may change the volume.
    fn can_write(&self) -> bool;
    /// Whether FLUSH does something (makes completed writes durable).
    fn can_flush(&self) -> bool;
    /// Whether `fua` is honoured natively (else it is emulated with a flush).
    fn can_fua(&self) -> bool;
    fn can_trim(&self) -> bool;
    fn can_zero(&self) -> bool;
    /// Whether a fast zero (one that never falls back to writing zeroes) may succeed.
    fn can_fast_zero(&self) -> bool;
    /// Whether [`Backend::extents`] knows the allocation map.
    fn can_extents(&self) -> bool;
    fn can_cache(&self) -> bool;
    /// True when a call can sleep (run it on the I/O pool); false when it
    /// only touches memory (run it inline).
    fn may_block(&self) -> bool;
    /// True when the data does not survive the target process.
    fn volatile(&self) -> bool;
    /// Identity of the data: the same for as long as the data behind the
    /// volume is the same one (a memory store draws a new one when it is
    /// made; a file has its device and inode). A resuming initiator compares
    /// it, so that a restarted target's empty volume is never taken for the
    /// one it wrote to.
    fn generation(&self) -> u64;
    /// Remembers, for every later target on this store, that a flush of it
    /// failed: writes acknowledged before it may be lost, yet Linux reports
    /// a writeback error to one flush only, so a restarted target's flush
    /// would succeed over them. A store that remembers it opens with another
    /// [`Backend::generation`] from then on, so that no session that wrote
    /// before resumes. Nothing to do for a store whose generation is new at
    /// every start (memory) or whose data another target keeps (a gateway's
    /// remote, which latches its own failures).
    fn record_failed_flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    /// The boot of the host whose memory holds the volume's unflushed
    /// writes, when that is not this one: a remote volume's target, as it
    /// was when the volume opened. OPEN_REPLY reports it instead of this
    /// host's, so that a client whose acknowledged writes a reboot of that
    /// host lost learns of it even across a restart of this one (a gateway
    /// reported its own boot, which such a reboot leaves unchanged, and its
    /// restart forgot that the remote had rebooted), and a reboot of this
    /// host, which holds none of them, is not taken for their loss.
    fn boot(&self) -> Option<u64> {
        None
    }
    /// A one-line description for logs.
    fn describe(&self) -> String;

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Whether [`Backend::read_shared`] works here: the store keeps its bytes
    /// in memory it can lend out, and every layer above passes reads through
    /// unchanged.
    fn can_share_reads(&self) -> bool;
    /// A read without a copy: the bytes of the range as shared pieces of the
    /// store's own memory, which never change once lent (a write to a lent
    /// piece copies it first). Called only where [`Backend::can_share_reads`].
    fn read_shared(&self, offset: u64, len: u64) -> Result<ReadData>;
    /// Whether [`Backend::read_now`] can find bytes at hand: the store can
    /// read without waiting for its device when the bytes are cached, and
    /// every layer above passes reads through unchanged. Stores that cannot
    /// keep the default.
    fn can_read_now(&self) -> bool {
        false
    }
    /// A read that never waits for the device, so that it may run on the
    /// thread that received the request: `Ok(true)` when `buf` is filled,
    /// `Ok(false)` when the bytes are not all at hand (the caller then reads
    /// with [`Backend::read_at`] where waiting is fine: the I/O pool).
    /// Called only where [`Backend::can_read_now`].
    fn read_now(&self, _buf: &mut [u8], _offset: u64) -> Result<bool> {
        Ok(false)
    }
    /// Whether [`Backend::write_now`] may take writes: the store can take a
    /// write without waiting when the kernel has room for it (a buffered
    /// file in the page cache), and every layer above passes writes through
    /// unchanged. Stores that cannot keep the default.
    fn can_write_now(&self) -> bool {
        false
    }
    /// A plain write (no FUA) that never waits, so that it may run on the
    /// thread that received the request: `Ok(true)` when all of `buf` is
    /// written (as [`Backend::write_at`] would have), `Ok(false)` when the
    /// store would have to wait (for the device, a lock, a timestamp's
    /// journal entry, writeback throttling) or fails: then none or part of
    /// it is written and the caller writes it all with
    /// [`Backend::write_at`] where waiting is fine (the I/O pool), which also
    /// gives a failure its definitive error. Called only where
    /// [`Backend::can_write_now`].
    fn write_now(&self, _buf: &[u8], _offset: u64) -> Result<bool> {
        Ok(false)
    }
    /// Whether [`Backend::submit`] takes plain reads and writes: the store
    /// keeps many device I/Os in flight itself (a `,direct` file's ring,
    /// [`uring`]) and every layer above can follow one to its end. Then they
    /// need no I/O thread each. Stores that cannot keep the default.
    fn can_submit(&self) -> bool {
        false
    }
    /// Whether [`Backend::submit`] takes writes too (else only reads).
    fn can_submit_writes(&self) -> bool {
        false
    }
    /// Starts `io`, client `client`'s (a connection: clients whose I/Os
    /// wait for room take turns), and returns at once; `done` runs when it
    /// finishes, on another thread, with a read's data. The store may hold
    /// the I/O until the next [`Backend::kick`] to start several at once.
    /// Called only where [`Backend::can_submit`].
    fn submit(&self, client: u64, io: DeviceIo, done: DeviceDone) {
        let _ = (client, io);
        done(Err(BackendError::Unsupported));
    }
    /// Starts the I/Os [`Backend::submit`] holds (all clients'): a caller
    /// kicks when it has submitted what it has at hand, and before it waits.
    fn kick(&self) {}
    /// With `fua`, the data is durable when this returns.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> Result<()>;
    /// The range's contents become unspecified (here: zeros) and may free space.
    fn trim(&self, offset: u64, len: u64) -> Result<()>;
    /// The range reads as zeros afterwards.
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()>;
    /// The allocation map of a range, in order, covering exactly `len` bytes.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>>;
    /// Prefetches a range (a hint).
    fn cache(&self, offset: u64, len: u64) -> Result<()>;
}

/// Zeros to lend: what a shared read of a hole or of a null store sends.
static ZEROS: [u8; 256 * 1024] = [0; 256 * 1024];

/// `len` bytes of zeros as shared pieces, appended to `out`.
fn push_zeros(out: &mut Vec<bytes::Bytes>, mut len: usize) {
    while len > 0 {
        let n = len.min(ZEROS.len());
        out.push(bytes::Bytes::from_static(&ZEROS[..n]));
        len -= n;
    }
}

/// A layer of the stack: every method forwards to [`Layer::next`] unless
/// overridden (nbdkit's `next->pread(...)`).
pub trait Layer: Send + Sync + 'static {
    /// The backend below this layer.
    fn next(&self) -> &dyn Backend;

    fn size(&self) -> u64 {
        self.next().size()
    }
    fn block_sizes(&self) -> BlockSizes {
        self.next().block_sizes()
    }
    fn can_write(&self) -> bool {
        self.next().can_write()
    }
    fn can_flush(&self) -> bool {
        self.next().can_flush()
    }
    fn can_fua(&self) -> bool {
        self.next().can_fua()
    }
    fn can_trim(&self) -> bool {
        self.next().can_trim()
    }
    fn can_zero(&self) -> bool {
        self.next().can_zero()
    }
    fn can_fast_zero(&self) -> bool {
        self.next().can_fast_zero()
    }
    fn can_extents(&self) -> bool {
        self.next().can_extents()
    }
    fn can_cache(&self) -> bool {
        self.next().can_cache()
    }
    fn may_block(&self) -> bool {
        self.next().may_block()
    }
    fn volatile(&self) -> bool {
        self.next().volatile()
    }
    fn generation(&self) -> u64 {
        self.next().generation()
    }
    fn record_failed_flush(&self) -> std::io::Result<()> {
        self.next().record_failed_flush()
    }
    fn boot(&self) -> Option<u64> {
        self.next().boot()
    }
    fn describe(&self) -> String {
        self.next().describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.next().read_at(buf, offset)
    }
    /// The one capability a layer does **not** pass through unless it says
    /// so: a shared read skips the layers' `read_at`, so a layer that acts on
    /// reads (faults, delay) would be bypassed. A layer that leaves reads
    /// alone (stats, read-only) opts in.
    fn can_share_reads(&self) -> bool {
        false
    }
    fn read_shared(&self, offset: u64, len: u64) -> Result<ReadData> {
        self.next().read_shared(offset, len)
    }
    /// Not passed through either, for the same reason as
    /// [`Layer::can_share_reads`]: a read served at once skips the layers'
    /// `read_at`.
    fn can_read_now(&self) -> bool {
        false
    }
    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<bool> {
        self.next().read_now(buf, offset)
    }
    /// Not passed through either: a write taken at once skips the layers'
    /// `write_at`.
    fn can_write_now(&self) -> bool {
        false
    }
    fn write_now(&self, buf: &[u8], offset: u64) -> Result<bool> {
        self.next().write_now(buf, offset)
    }
    /// Not passed through either: a submitted I/O skips the layers'
    /// `read_at` and `write_at`. A layer that can follow one to its end
    /// (stats: it counts at submission and at completion) opts in.
    fn can_submit(&self) -> bool {
        false
    }
    fn can_submit_writes(&self) -> bool {
        false
    }
    fn submit(&self, client: u64, io: DeviceIo, done: DeviceDone) {
        self.next().submit(client, io, done)
    }
    fn kick(&self) {
        self.next().kick()
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.next().write_at(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.next().flush()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.next().trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.next().write_zeroes(offset, len, flags)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.next().extents(offset, len)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.next().cache(offset, len)
    }
}

/// The pass-through: a layer is a backend.
impl<L: Layer> Backend for L {
    fn size(&self) -> u64 {
        Layer::size(self)
    }
    fn block_sizes(&self) -> BlockSizes {
        Layer::block_sizes(self)
    }
    fn can_write(&self) -> bool {
        Layer::can_write(self)
    }
    fn can_flush(&self) -> bool {
        Layer::can_flush(self)
    }
    fn can_fua(&self) -> bool {
        Layer::can_fua(self)
    }
    fn can_trim(&self) -> bool {
        Layer::can_trim(self)
    }
    fn can_zero(&self) -> bool {
        Layer::can_zero(self)
    }
    fn can_fast_zero(&self) -> bool {
        Layer::can_fast_zero(self)
    }
    fn can_extents(&self) -> bool {
        Layer::can_extents(self)
    }
    fn can_cache(&self) -> bool {
        Layer::can_cache(self)
    }
    fn may_block(&self) -> bool {
        Layer::may_block(self)
    }
    fn volatile(&self) -> bool {
        Layer::volatile(self)
    }
    fn generation(&self) -> u64 {
        Layer::generation(self)
    }
    fn record_failed_flush(&self) -> std::io::Result<()> {
        Layer::record_failed_flush(self)
    }
    fn boot(&self) -> Option<u64> {
        Layer::boot(self)
    }
    fn describe(&self) -> String {
        Layer::describe(self)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Layer::read_at(self, buf, offset)
    }
    fn can_share_reads(&self) -> bool {
        Layer::can_share_reads(self)
    }
    fn read_shared(&self, offset: u64, len: u64) -> Result<ReadData> {
        Layer::read_shared(self, offset, len)
    }
    fn can_read_now(&self) -> bool {
        Layer::can_read_now(self)
    }
    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<bool> {
        Layer::read_now(self, buf, offset)
    }
    fn can_write_now(&self) -> bool {
        Layer::can_write_now(self)
    }
    fn write_now(&self, buf: &[u8], offset: u64) -> Result<bool> {
        Layer::write_now(self, buf, offset)
    }
    fn can_submit(&self) -> bool {
        Layer::can_submit(self)
    }
    fn can_submit_writes(&self) -> bool {
        Layer::can_submit_writes(self)
    }
    fn submit(&self, client: u64, io: DeviceIo, done: DeviceDone) {
        Layer::submit(self, client, io, done)
    }
    fn kick(&self) {
        Layer::kick(self)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        Layer::write_at(self, buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        Layer::flush(self)
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        Layer::trim(self, offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        Layer::write_zeroes(self, offset, len, flags)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        Layer::extents(self, offset, len)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        Layer::cache(self, offset, len)
    }
}

/// A volume's stack, built, with handles on the layers tests and metrics use.
pub struct Stack {
    /// The top of the stack: what requests run on.
    pub top: Arc<dyn Backend>,
    /// The counters of the stats layer (always at the top).
    pub stats: Arc<VolumeStats>,
    /// The fault rules, when the spec asked for a faults layer.
    pub faults: Option<Faults>,
    /// A file volume's lock (see `lock`): the file opened once more, locked;
    /// closing it releases the lock.
    pub lock: Option<std::fs::File>,
}

/// Builds a volume's stack from its spec, bottom up: the store, then
/// `read-only` (`,ro`), `faults` (`,faults=...`), `delay` (`,delay=...`),
/// and `stats` on top (it sees what the client sees, delays included).
/// `run_dir`: where a file records its failed flushes besides on itself
/// (`serve --run-dir`).
pub fn build(spec: &VolumeSpec, run_dir: Option<&Path>) -> io::Result<Stack> {
    let mut lock_file = None;
    let mut b: Arc<dyn Backend> = match &spec.backend {
        BackendSpec::Memory { size } => {
            check_memory(*size)?;
            Arc::new(MemoryBackend::new(*size))
        }
        BackendSpec::Null { size } => Arc::new(NullBackend::new(*size)),
        BackendSpec::File { path, direct } => {
            let f = FileBackend::open_with(path, spec.read_only, *direct, run_dir).map_err(|e| {
                let hint = if e.kind() == io::ErrorKind::NotFound {
                    " (fastsan serves a file that exists; make one with `truncate -s SIZE PATH`)"
                } else {
                    ""
                };
                io::Error::new(e.kind(), format!("opening {}: {e}{hint}", path.display()))
            })?;
            lock_file = Some(lock(&f, path, spec.read_only)?);
            // (A store smaller than one 512-byte block serves nothing.)
            if f.size() < 512 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} holds {} bytes, less than one 512-byte block: give it a size with \
                         `truncate -s SIZE {}`",
                        path.display(),
                        f.size(),
                        path.display()
                    ),
                ));
            }
            Arc::new(f)
        }
        BackendSpec::Remote { url, secret, connections, origin } => {
            let secret =
                secret.as_deref().map(crate::config::read_secret).transpose().map_err(io::Error::other)?;
            let session = origin
                .as_deref()
                .map_or(0, |o| remote::gateway_session(o, &spec.name, url, secret.as_deref()));
            let opts = fastsan_initiator::Options {
                connections: *connections,
                secret,
                session,
                ..Default::default()
            };
            Arc::new(RemoteBackend::connect(url, opts)?)
        }
    };
    if spec.read_only {
        b = Arc::new(ReadOnlyLayer::new(b));
    }
    let mut faults = None;
    if let Some(rules) = &spec.faults {
        let set = Faults::new(rules.clone());
        faults = Some(set.clone());
        b = Arc::new(FaultLayer::new(b, set));
    }
    if let Some(d) = spec.delay {
        b = Arc::new(DelayLayer::new(b, d));
    }
    let stats = Arc::new(VolumeStats::default());
    let top: Arc<dyn Backend> = Arc::new(StatsLayer::new(b, stats.clone()));
    Ok(Stack { top, stats, faults, lock: lock_file })
}

/// Refuses a memory volume larger than the memory this process may use:
/// it could never be filled.
fn check_memory(size: u64) -> io::Result<()> {
    match memory_limit() {
        Some((ram, what)) if size > ram => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a memory volume of {} exceeds {what} ({})", gib(size), gib(ram)),
        )),
        _ => Ok(()),
    }
}

/// This machine's RAM in bytes (`MemTotal`), when it can be read.
pub fn ram() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
}

/// The memory this process may use, and what sets it: the machine's RAM,
/// or its control group's limit where lower (a container's; the kernel's
/// out-of-memory killer acts at that limit, not at the RAM's).
pub fn memory_limit() -> Option<(u64, &'static str)> {
    let ram = ram()?;
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    match cgroup_memory_limit(&groups, |p| std::fs::read_to_string(p).ok()) {
        Some(limit) if limit < ram => Some((limit, "this process's control-group memory limit")),
        _ => Some((ram, "this machine's RAM")),
    }
}

/// The lowest memory limit on the way from this process's control group
/// (`/proc/self/cgroup`'s text) to the root, in cgroup v2 (`memory.max`)
/// or v1 (`memory.limit_in_bytes`) under /sys/fs/cgroup; `read` reads a
/// file. None: no limit.
fn cgroup_memory_limit(groups: &str, read: impl Fn(&str) -> Option<String>) -> Option<u64> {
    let mut lowest: Option<u64> = None;
    for line in groups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let (dir, file) = match controllers {
            "" => ("/sys/fs/cgroup", "memory.max"),
            c if c.split(',').any(|c| c == "memory") => ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
            _ => continue,
        };
        let mut at = std::path::Path::new(path.trim());
        loop {
            let rel = at.to_string_lossy();
            let rel = rel.trim_start_matches('/');
            let file = if rel.is_empty() { format!("{dir}/{file}") } else { format!("{dir}/{rel}/{file}") };
            // "max", or v1's "no limit" (a page-rounded i64::MAX): none.
            if let Some(n) = read(&file).and_then(|t| t.trim().parse::<u64>().ok()).filter(|n| *n < 1 << 62) {
                lowest = Some(lowest.map_or(n, |l| l.min(n)));
            }
            match at.parent() {
                Some(p) => at = p,
                None => break,
            }
        }
    }
    lowest
}

/// `bytes` for a person: GiB with two decimals, and the exact count.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB, {bytes} bytes", bytes as f64 / (1u64 << 30) as f64)
}

/// What [`try_lock`] got.
#[derive(Debug)]
pub enum Locked {
    /// The lock, held while the file stays open.
    Yes,
    /// Someone else holds a conflicting lock (a fastsan target serving it).
    Busy,
    /// The file system has no locks (NFS without its lock service).
    Unsupported(io::Error),
}

/// An advisory `flock` on `f` (exclusive, or shared), without waiting: how
/// a target guards its file volumes and `fastsan cp` learns that one serves
/// a file. Any other failure is an error.
pub fn try_lock(f: &std::fs::File, exclusive: bool) -> io::Result<Locked> {
    let how = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
    // SAFETY: flock on a descriptor `f` owns and keeps open.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(f), how | libc::LOCK_NB) } == 0 {
        return Ok(Locked::Yes);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(Locked::Busy),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => Ok(Locked::Unsupported(e)),
        _ => Err(e),
    }
}

/// Runs `attempt` until it is done (`Some`) or fails; `None` is "busy".
/// A block device is probed by udev (under a shared lock of its own) or
/// rescanned by the kernel as soon as a writer closes it: a target
/// restarted at once may find it held, so on a block device (`block`)
/// it is tried for a second, elsewhere once.
fn while_probed<T>(block: bool, mut attempt: impl FnMut() -> io::Result<Option<T>>) -> io::Result<Option<T>> {
    let tries = if block { 20 } else { 1 };
    for i in 0..tries {
        if i > 0 {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        if let Some(done) = attempt()? {
            return Ok(Some(done));
        }
    }
    Ok(None)
}

/// Takes an advisory lock on a file volume's file: exclusive for a writable
/// volume, shared for a read-only one. Two writers of one file (a second
/// target, or a second volume of this one, on the same file) have no fence
/// between them and would corrupt it, as qemu's image locking also refuses.
/// The lock is on a descriptor of its own (returned; closing it releases
/// the lock), so that a stopped server releases it at once
/// ([`crate::Volume::unlock`]) even while a thread still holds the store.
fn lock(f: &FileBackend, path: &Path, read_only: bool) -> io::Result<std::fs::File> {
    let mine = std::fs::File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("opening {} to lock it: {e}", path.display())))?;
    let locked = while_probed(f.is_block_device(), || {
        match try_lock(&mine, !read_only)
            .map_err(|e| io::Error::new(e.kind(), format!("locking {}: {e}", path.display())))?
        {
            Locked::Yes => Ok(Some(())),
            // A file system without locks (NFS without its lock service):
            // served as before, unguarded, and said.
            Locked::Unsupported(e) => {
                tracing::warn!(path = %path.display(), "cannot lock the file ({e}): nothing stops a second writer of it");
                Ok(Some(()))
            }
            Locked::Busy => Ok(None),
        }
    })?;
    if locked.is_some() {
        return Ok(mine);
    }
    let holder = if read_only { "a volume that writes it" } else { "another volume" };
    Err(io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!(
            "{} is in use: {holder} (of this target or another fastsan) has it open, and two \
             writers without a fence between them would corrupt it",
            path.display()
        ),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_lowest_control_group_memory_limit_on_the_way_to_the_root_counts() {
        use super::cgroup_memory_limit;
        let files = |pairs: &'static [(&'static str, &'static str)]| {
            move |p: &str| pairs.iter().find(|(f, _)| *f == p).map(|(_, t)| t.to_string())
        };
        // v2: the group's own "max", its parent's 2 GiB.
        let v2 = files(&[
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/memory.max", "2147483648\n"),
        ]);
        assert_eq!(cgroup_memory_limit("0::/a/b\n", v2), Some(2 << 30));
        // v1, memory among other controllers, unlimited at the root.
        let v1 = files(&[
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/sys/fs/cgroup/memory/pod/memory.limit_in_bytes", "1073741824\n"),
        ]);
        assert_eq!(cgroup_memory_limit("4:memory,hugetlb:/pod\n1:cpu:/\n0::/\n", v1), Some(1 << 30));
        // No limit anywhere, or nothing to read.
        let none = files(&[("/sys/fs/cgroup/memory.max", "max\n")]);
        assert_eq!(cgroup_memory_limit("0::/\n", none), None);
        assert_eq!(cgroup_memory_limit("", files(&[])), None);
    }

    use super::*;

    /// A layer that overrides nothing.
    struct Nothing(Arc<dyn Backend>);
    impl Layer for Nothing {
        fn next(&self) -> &dyn Backend {
            &*self.0
        }
    }

    fn caps(b: &dyn Backend) -> [bool; 11] {
        [
            b.can_write(),
            b.can_flush(),
            b.can_fua(),
            b.can_trim(),
            b.can_zero(),
            b.can_fast_zero(),
            b.can_extents(),
            b.can_cache(),
            b.may_block(),
            b.volatile(),
            b.block_sizes() == b.block_sizes(),
        ]
    }

    #[test]
    fn a_layer_that_overrides_nothing_changes_nothing() {
        let bottoms: Vec<Arc<dyn Backend>> =
            vec![Arc::new(MemoryBackend::new(1 << 20)), Arc::new(NullBackend::new(1 << 20))];
        for b in bottoms {
            let l: Arc<dyn Backend> = Arc::new(Nothing(b.clone()));
            assert_eq!(caps(&*l), caps(&*b));
            assert_eq!(l.block_sizes(), b.block_sizes());
            assert_eq!(l.size(), b.size());
            assert_eq!(l.describe(), b.describe());
            l.write_at(&[9; 512], 512, false).unwrap();
            let mut back = [0u8; 512];
            l.read_at(&mut back, 512).unwrap();
            let mut direct = [0u8; 512];
            b.read_at(&mut direct, 512).unwrap();
            assert_eq!(back, direct);
        }
    }

    #[test]
    fn the_built_stack_reports_the_stores_capabilities() {
        let spec = VolumeSpec::parse("v=memory:1M,faults=none,delay=0ms").unwrap();
        let s = build(&spec, None).unwrap();
        let m = MemoryBackend::new(1 << 20);
        let mut want = caps(&m);
        want[8] = true; // delay and faults may sleep: they run on the pool
        assert_eq!(caps(&*s.top), want);
        assert!(s.faults.is_some());
        let ro = build(&VolumeSpec::parse("v=null:1M,ro").unwrap(), None).unwrap();
        assert!(!ro.top.can_write() && !ro.top.can_trim() && !ro.top.can_zero() && !ro.top.can_fast_zero());
        assert_eq!(ro.top.write_at(&[0; 512], 0, false), Err(BackendError::ReadOnly));
    }

    #[test]
    fn errnos_map_to_their_kind() {
        let e = |n| BackendError::from(io::Error::from_raw_os_error(n));
        assert_eq!(e(libc::ENOSPC), BackendError::NoSpace);
        assert_eq!(e(libc::EDQUOT), BackendError::NoSpace);
        assert_eq!(e(libc::EROFS), BackendError::ReadOnly);
        assert_eq!(e(libc::EOPNOTSUPP), BackendError::Unsupported);
        assert_eq!(e(libc::EIO), BackendError::Io(libc::EIO));
        assert_eq!(BackendError::from(io::Error::other("x")), BackendError::Io(libc::EIO));
        assert!(BackendError::Io(libc::EIO).to_string().contains("Input/output error"));
    }

    #[test]
    fn huge_memory_volume_is_refused() {
        assert!(check_memory(1 << 60).is_err());
        assert!(check_memory(1 << 20).is_ok());
    }

    #[test]
    fn only_stacks_that_leave_reads_alone_lend_them() {
        let shares =
            |spec: &str| build(&VolumeSpec::parse(spec).unwrap(), None).unwrap().top.can_share_reads();
        assert!(shares("v=memory:1M"));
        assert!(shares("v=memory:1M,ro"));
        assert!(shares("v=null:1M"));
        // A layer that acts on reads is never bypassed.
        assert!(!shares("v=memory:1M,faults=none"));
        assert!(!shares("v=memory:1M,delay=1ms"));
        assert!(!Backend::can_share_reads(&Nothing(Arc::new(MemoryBackend::new(1 << 20)))));
        // Through the stats layer: lent reads are counted like copied ones.
        let s = build(&VolumeSpec::parse("v=memory:4M").unwrap(), None).unwrap();
        s.top.write_at(&[5; 8192], 1 << 20, false).unwrap();
        let d = s.top.read_shared((1 << 20) - 4096, 3 << 20).unwrap().to_bytes();
        assert!(d[..4096].iter().all(|&b| b == 0) && d[4096..12288].iter().all(|&b| b == 5));
        assert!(d[12288..].iter().all(|&b| b == 0));
        let st = s.stats.snapshot();
        assert_eq!((st.reads, st.bytes_read), (1, 3 << 20));
    }
}
