//! The file backend: a regular file or a block device, with positional I/O
//! (`pread`/`pwrite`) from any number of threads at once, and optionally
//! O_DIRECT (then through a 4 KiB-aligned bounce buffer, with a 4 KiB block size).

use super::{Backend, BackendError, BlockSizes, Result, ZeroFlags};
use crate::request::{Extent, ReadData};
use bytes::Bytes;
use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// The alignment O_DIRECT needs of offsets, lengths and buffers on every
/// device fastsan serves (a page).
pub const DIRECT_ALIGN: usize = 4096;
/// Submissions of a direct file's ring: more I/Os than this in flight wait
/// in the ring's queue for room.
#[cfg(target_os = "linux")]
const RING_ENTRIES: u32 = 128;
/// Largest piece written at a time when zeroes must be written out.
const ZERO_PIECE: u64 = 1 << 20;
// ioctls of <linux/fs.h>: _IO(0x12, 119) and _IO(0x12, 127).
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

/// Whether a regular file's filesystem is one whose direct I/O through
/// io_uring reports what happened: the local disk filesystems (ext2/3/4,
/// XFS, btrfs, F2FS) and tmpfs. Elsewhere the ring is not used: on FUSE a
/// 2 MiB O_DIRECT read through io_uring whose second 1 MiB failed with EIO
/// completed as a full read (`fio --ioengine=io_uring --direct=1 --bs=2M`
/// on a file of `fastsan attach --fuse` over a volume with a fault rule;
/// libaio and `preadv` saw the short read), which would have served bytes
/// never read as data; network filesystems' async I/O paths are as little
/// tried.
#[cfg(target_os = "linux")]
fn ring_trusts(file: &File) -> bool {
    const TRUSTED: [i64; 5] = [0xEF53, 0x5846_5342, 0x9123_683E, 0xF2F5_2010, TMPFS];
    fs_type(file).is_some_and(|kind| TRUSTED.contains(&kind))
}

/// Filesystem magic numbers of <linux/magic.h>: those whose files go with the host's memory.
const TMPFS: i64 = 0x0102_1994;
const RAMFS: i64 = 0x8584_58f6;

/// The magic number of the filesystem `file` is on.
fn fs_type(file: &File) -> Option<i64> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs writes a statfs into the pointer on success; the fd is ours and open.
    if unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // (f_type is an i64 here, an i32 on 32-bit targets.)
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: fstatfs succeeded, so it filled the struct.
    Some(unsafe { st.assume_init() }.f_type as i64)
}

/// Whether the store's data goes when the host reboots: a file on tmpfs
/// or ramfs, a RAM disk (brd's `ram*`), zram, or a loop device over a file
/// on one of those.
fn on_volatile_storage(file: &File, meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    let in_memory = |f: &File| fs_type(f).is_some_and(|t| t == TMPFS || t == RAMFS);
    if !meta.file_type().is_block_device() {
        return in_memory(file);
    }
    let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
    let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let Some(name) =
        std::fs::read_link(&sys).ok().and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
    else {
        return false;
    };
    if name.starts_with("ram") || name.starts_with("zram") {
        return true;
    }
    // A loop device over a regular file on tmpfs or ramfs. (Not over a
    // block device: its node is on devtmpfs, whose magic is tmpfs's. A
    // backing file deleted since, or out of this mount namespace, counts
    // as not volatile, as it would at every start.)
    let backing = std::fs::read_to_string(sys.join("loop/backing_file")).unwrap_or_default();
    name.starts_with("loop")
        && File::open(backing.trim_end_matches('\n'))
            .is_ok_and(|f| f.metadata().is_ok_and(|m| m.is_file()) && in_memory(&f))
}

/// Where a file remembers how many of its flushes failed (see
/// [`Backend::record_failed_flush`]): a user attribute on regular files, a
/// trusted one (root only) on block devices' nodes, which take no user
/// attributes.
const FAILED_FLUSHES: [&std::ffi::CStr; 2] =
    [c"user.fastsan.failed-flushes", c"trusted.fastsan.failed-flushes"];

/// How many flushes of `file` failed under any target (0 when never, or
/// where nothing can say).
fn failed_flushes(file: &File) -> u64 {
    FAILED_FLUSHES
        .iter()
        .find_map(|name| {
            let mut v = [0u8; 20];
            // SAFETY: fgetxattr writes at most v.len() bytes into v; the fd is open.
            let n =
                unsafe { libc::fgetxattr(file.as_raw_fd(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
            let n = usize::try_from(n).ok()?;
            std::str::from_utf8(&v[..n]).ok()?.trim().parse().ok()
        })
        .unwrap_or(0)
}

/// Counts one more failed flush of `file` on the file ([`failed_flushes`]).
fn count_failed_flush(file: &File) -> io::Result<()> {
    let count = (failed_flushes(file) + 1).to_string();
    let mut last = io::Error::from_raw_os_error(libc::ENOTSUP);
    for name in FAILED_FLUSHES {
        // SAFETY: the value is count's bytes, alive for the call; the fd is open.
        let r = unsafe {
            libc::fsetxattr(file.as_raw_fd(), name.as_ptr(), count.as_ptr().cast(), count.len(), 0)
        };
        if r == 0 {
            return Ok(());
        }
        last = io::Error::last_os_error();
    }
    Err(last)
}

/// A file's second record of its failed flushes, off its own filesystem:
/// `RUN_DIR/failed-flushes/NAME`, NAME from the file's identity, holding the
/// count and the file's path (for whoever looks). The attribute on the file
/// ([`FAILED_FLUSHES`]) cannot be written where the failure turned the
/// filesystem read-only, the case where it matters most, nor on one
/// without attributes; this one lives where `serve --run-dir` says (by
/// default /run/fastsan, emptied at boot: a record has to outlive a restart
/// of the target, not of the host, whose reboot its sessions learn by
/// themselves, and device and inode numbers hold only until then).
fn record_path(dir: &Path, meta: &std::fs::Metadata) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    let name = if meta.file_type().is_block_device() {
        format!("blockdev-{:x}", meta.rdev())
    } else {
        format!("file-{:x}-{:x}-{:x}", meta.dev(), meta.ino(), born(meta))
    };
    dir.join("failed-flushes").join(name)
}

/// The count a record holds: 0 where there is none; at least 1 where one
/// is there but cannot be read (a record exists only after a failure).
/// Opened without following a link or waiting for a writer (a FIFO), and
/// at most its first 64 bytes read: the directory may be shared.
fn recorded(record: &Path) -> u64 {
    use std::io::Read;
    let read = || -> io::Result<u64> {
        let f =
            OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(record)?;
        if !f.metadata()?.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
        }
        let mut text = String::new();
        f.take(64).read_to_string(&mut text)?;
        text.lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("{text:?} holds no count")))
    };
    match read() {
        Ok(n) => n.max(1),
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => {
            tracing::warn!(record = %record.display(), error = %e, "a record of failed flushes is there but unreadable: counted as one");
            1
        }
    }
}

/// Writes a record: a new file of its own (never one a link points to),
/// synced, renamed over the old, and the directory synced (it may be on a
/// disk).
fn write_record(record: &Path, count: u64, volume: &Path) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::DirBuilderExt;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = record.parent().expect("a record is in a directory");
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let n = NEXT.fetch_add(1, Relaxed);
    let tmp = record.with_extension(format!("{}-{n}.new", std::process::id()));
    let written = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        writeln!(f, "{count}\n{}", volume.display())?;
        f.sync_all()?;
        std::fs::rename(&tmp, record)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)?.sync_all()
}

/// A regular file's birth time in nanoseconds, where the filesystem keeps
/// one (0 elsewhere, and for a block device: its node is made anew at every
/// boot, its data is not).
fn born(meta: &std::fs::Metadata) -> u64 {
    if meta.file_type().is_block_device() {
        return 0;
    }
    meta.created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The identity of a file's data (see [`Backend::generation`]), a fixed mix
/// (not a hasher whose keys may change between builds: the same file must
/// give the same number to every fastsan) of:
/// - its device and inode: another file at the path is another generation;
/// - a regular file's birth time ([`born`]): a file deleted and made again
///   can get its old inode number back;
/// - `boot`, the host's boot, for a store whose data a reboot takes
///   ([`on_volatile_storage`]): made again after a reboot, a tmpfs file or a
///   RAM disk gets the same numbers, and is empty;
/// - how many flushes of it failed, by its two records ([`failed_flushes`]
///   on the file, [`recorded`] off it): a session that wrote before one
///   must not resume (until 2026-12-07 a restarted target's first flush
///   succeeded over the writes the failed one lost).
fn generation(meta: &std::fs::Metadata, boot: Option<u64>, failed: [u64; 2]) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let base = meta.dev().wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ meta.ino().rotate_left(29) ^ meta.rdev();
    let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(23);
    let more = [born(meta), boot.unwrap_or(0), failed[0]];
    let generation = match more {
        // As before 2026-12-07 (a block device, a file without a birth
        // time): a target upgraded over it resumes its sessions.
        [0, 0, 0] => base,
        more => more.into_iter().fold(base, mix),
    };
    // The record off the file only where there is one: a file without
    // keeps the generation it had before records were kept there.
    match failed[1] {
        0 => generation,
        n => mix(generation, n),
    }
}

pub struct FileBackend {
    /// A `,direct` file's ring of device I/O (`None` elsewhere, or where the
    /// kernel refuses io_uring: then every I/O runs on the I/O pool). Before
    /// `file`, so that it drops first: its drop waits for the I/Os in
    /// flight, which name the file's descriptor.
    #[cfg(target_os = "linux")]
    ring: Option<super::uring::Ring>,
    file: File,
    path: PathBuf,
    size: u64,
    direct: bool,
    block_device: bool,
    read_only: bool,
    /// See [`generation`].
    generation: u64,
    /// Where its failed flushes are recorded off the file ([`record_path`]),
    /// when the target has a run directory.
    record: Option<PathBuf>,
    /// Whether reads may be tried without waiting ([`Backend::read_now`]):
    /// buffered (O_DIRECT reads always go to the device), opened without
    /// access times, and the kernel took `RWF_NOWAIT` so far (cleared at its
    /// first refusal).
    nowait: AtomicBool,
    /// Whether writes may be tried without waiting ([`Backend::write_now`]):
    /// buffered and writable, and the kernel took `RWF_NOWAIT` writes so
    /// far (ext4 refuses them outright; XFS takes most; cleared at the first
    /// refusal).
    nowait_writes: AtomicBool,
}

impl FileBackend {
    /// [`FileBackend::open_with`] without a run directory: failed flushes
    /// are recorded on the file only.
    pub fn open(path: &Path, read_only: bool, direct: bool) -> io::Result<Self> {
        Self::open_with(path, read_only, direct, None)
    }

    /// Opens `path`; `run_dir`, where its failed flushes are recorded too
    /// and read back (`failed-flushes/` in it, a file named by the file's
    /// identity).
    pub fn open_with(path: &Path, read_only: bool, direct: bool, run_dir: Option<&Path>) -> io::Result<Self> {
        let open = |flags| {
            let mut opts = OpenOptions::new();
            opts.read(true).write(!read_only).custom_flags(flags | if direct { libc::O_DIRECT } else { 0 });
            opts.open(path)
        };
        // Without access times where the file allows it (its owner, or a
        // privileged target): a read then never writes the inode, which is
        // what lets a cached read run on a connection's thread
        // (`read_now`: an access-time update can wait for the journal).
        let (mut file, noatime) = match open(libc::O_NOATIME) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => (open(0)?, false),
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        let block_device = meta.file_type().is_block_device();
        if !block_device && !meta.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file or a block device"));
        }
        // A writable block device, exclusively: the kernel refuses it while
        // it is mounted or held (md, LVM, another O_EXCL opener), where two
        // writers would corrupt it; the lock taken later stops only another
        // fastsan. (Tried for a second, as the lock is: udev.)
        if block_device && !read_only {
            let noatime_flag = if noatime { libc::O_NOATIME } else { 0 };
            let exclusive = super::while_probed(true, || match open(noatime_flag | libc::O_EXCL) {
                Ok(f) => Ok(Some(f)),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(None),
                Err(e) => Err(e),
            })?;
            file = exclusive.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    "the block device is in use (mounted, held by another program, or \
                     served as another volume): serving it writable would make two writers",
                )
            })?;
        }
        let size = file.seek(SeekFrom::End(0))?;
        let boot = on_volatile_storage(&file, &meta).then(crate::server::boot_id);
        let record = run_dir.map(|d| record_path(d, &meta));
        let failed = [failed_flushes(&file), record.as_deref().map_or(0, recorded)];
        if failed != [0, 0] {
            tracing::warn!(
                path = %path.display(),
                failed_flushes = failed[0].max(failed[1]),
                record = %record.as_deref().filter(|_| failed[1] > 0).map_or("on the file".into(), |r| r.display().to_string()),
                "a flush of this file failed under an earlier target: writes acknowledged before it may \
                 be lost, so the sessions of that time cannot resume here (their clients are told)"
            );
        }
        let generation = generation(&meta, boot, failed);
        #[cfg(target_os = "linux")]
        let ring = if !direct {
            None
        } else if block_device || ring_trusts(&file) {
            super::uring::Ring::new(RING_ENTRIES)
                .map_err(|e| tracing::warn!(path = %path.display(), error = %e, "no io_uring: the volume's direct I/O runs on the I/O threads"))
                .ok()
        } else {
            tracing::info!(path = %path.display(), "not on a local disk filesystem: the volume's direct I/O runs on the I/O threads, not through io_uring");
            None
        };
        Ok(FileBackend {
            #[cfg(target_os = "linux")]
            ring,
            file,
            path: path.to_owned(),
            size,
            direct,
            block_device,
            read_only,
            generation,
            record,
            nowait: AtomicBool::new(noatime && !direct),
            nowait_writes: AtomicBool::new(!direct && !read_only),
        })
    }

    fn fd(&self) -> libc::c_int {
        self.file.as_raw_fd()
    }

    pub(crate) fn is_block_device(&self) -> bool {
        self.block_device
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate only reads its integer arguments; the fd is ours and open.
        let r = unsafe { libc::fallocate(self.fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn blk_ioctl(&self, request: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range = [offset, len];
        // SAFETY: BLKDISCARD and BLKZEROOUT read two u64s from the pointer, which
        // points at a live array of two u64s for the duration of the call.
        let r = unsafe { libc::ioctl(self.fd(), request as _, range.as_ptr()) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// lseek with SEEK_DATA or SEEK_HOLE; `None` past the last data (ENXIO).
    fn seek(&self, at: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
        // SAFETY: lseek only reads its integer arguments; the fd is ours and open.
        let r = unsafe { libc::lseek(self.fd(), at as libc::off_t, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    }

    fn write_zero_bytes(&self, offset: u64, len: u64) -> io::Result<()> {
        let zeros = AlignedBuf::new(ZERO_PIECE.min(len) as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(ZERO_PIECE) as usize;
            self.file.write_all_at(&zeros.as_slice()[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL))
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_sizes(&self) -> BlockSizes {
        // pread/pwrite take any byte range; O_DIRECT wants whole aligned blocks.
        let minimum = if self.direct { DIRECT_ALIGN as u32 } else { 1 };
        BlockSizes { minimum, preferred: DIRECT_ALIGN as u32, maximum: u32::MAX }
    }
    fn can_write(&self) -> bool {
        !self.read_only
    }
    fn can_flush(&self) -> bool {
        true
    }
    fn can_fua(&self) -> bool {
        true
    }
    fn can_trim(&self) -> bool {
        !self.read_only
    }
    fn can_zero(&self) -> bool {
        !self.read_only
    }
    fn can_fast_zero(&self) -> bool {
        // A file zeroes fast with fallocate (or fails at once); BLKZEROOUT
        // may fall back to writing zeroes inside the kernel, slowly.
        !self.read_only && !self.block_device
    }
    fn can_extents(&self) -> bool {
        !self.block_device
    }
    fn can_cache(&self) -> bool {
        true
    }
    fn can_share_reads(&self) -> bool {
        false
    }
    fn read_shared(&self, _offset: u64, _len: u64) -> Result<ReadData> {
        Err(BackendError::Unsupported)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if self.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            self.file.read_exact_at(bounce.as_mut_slice(), offset)?;
            buf.copy_from_slice(bounce.as_slice());
        } else {
            self.file.read_exact_at(buf, offset)?;
        }
        Ok(())
    }
    #[cfg(target_os = "linux")]
    fn can_submit(&self) -> bool {
        self.ring.is_some()
    }
    #[cfg(target_os = "linux")]
    fn can_submit_writes(&self) -> bool {
        self.ring.is_some()
    }
    /// Through the ring: the data in a buffer aligned for O_DIRECT, most
    /// often one the ring registered (a write's copied into it whole; a
    /// read's sent as it is, its slot free again once the reply is gone;
    /// `Volume::validate` keeps both to whole 4 KiB blocks of a direct file).
    #[cfg(target_os = "linux")]
    fn submit(&self, client: u64, io: super::DeviceIo, done: super::DeviceDone) {
        let Some(ring) = &self.ring else { return done(Err(BackendError::Unsupported)) };
        match io {
            super::DeviceIo::Read { offset, len } => ring.read(
                client,
                self.fd(),
                ring.buffer(len as usize),
                offset,
                Box::new(move |buf, r| {
                    done(r.map(|()| Some(Bytes::from_owner(buf).into())).map_err(Into::into))
                }),
            ),
            super::DeviceIo::Write { offset, data } => {
                let mut buf = ring.buffer(data.len());
                buf.as_mut_slice().copy_from_slice(&data);
                drop(data);
                // A regular file's write that cannot start at once (one that
                // allocates blocks, or finds the inode locked) leaves the
                // ring for threads that may wait: io_uring would run such
                // writes to one file one after the other (it hashes them by
                // inode; measured 0.70x of the I/O threads' IOPS at fio 4K
                // random writes, QD32, on a sparse ext4 file). A block
                // device's are never serialized.
                let flags = super::uring::WriteFlags { dsync: false, nowait: !self.block_device };
                ring.write(
                    client,
                    self.fd(),
                    buf,
                    offset,
                    flags,
                    Box::new(move |_, r| done(r.map(|()| None).map_err(Into::into))),
                )
            }
        }
    }
    #[cfg(target_os = "linux")]
    fn kick(&self) {
        if let Some(ring) = &self.ring {
            ring.kick()
        }
    }
    /// Reads from the page cache only, of a file opened without access
    /// times (with them, a read may write the inode).
    fn can_read_now(&self) -> bool {
        self.nowait.load(Relaxed)
    }
    /// `preadv2` with `RWF_NOWAIT`: the bytes if the page cache has them
    /// all, else nothing (the kernel neither waits for the device nor for a
    /// page lock).
    fn read_now(&self, buf: &mut [u8], offset: u64) -> Result<bool> {
        let Ok(at) = libc::off_t::try_from(offset) else { return Ok(false) };
        if !self.nowait.load(Relaxed) {
            return Ok(false);
        }
        let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: the one iovec covers `buf`, ours and writable for the whole call.
        let n = unsafe { libc::preadv2(self.fd(), &iov, 1, at, libc::RWF_NOWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EINTR) => Ok(false),
                // A kernel or file system that does not take it: the pool
                // reads everything from now on.
                Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => {
                    self.nowait.store(false, Relaxed);
                    Ok(false)
                }
                _ => Err(e.into()),
            };
        }
        // Only part of it at hand (or the end of a file shrunk under us):
        // the pool reads the whole again.
        Ok(n as usize == buf.len())
    }
    fn can_write_now(&self) -> bool {
        self.nowait_writes.load(Relaxed)
    }
    /// `pwritev2` with `RWF_NOWAIT`: into the page cache if the kernel can
    /// take it without waiting (XFS takes ~96% of 4K writes over a cached
    /// file; the rest wait for a timestamp update, once per tick), else
    /// nothing. A short or failed write is written whole again by
    /// `write_at` on the pool, which gives a real failure its own error.
    fn write_now(&self, buf: &[u8], offset: u64) -> Result<bool> {
        let Ok(at) = libc::off_t::try_from(offset) else { return Ok(false) };
        if !self.nowait_writes.load(Relaxed) {
            return Ok(false);
        }
        let iov = libc::iovec { iov_base: buf.as_ptr() as *mut libc::c_void, iov_len: buf.len() };
        // SAFETY: the one iovec covers `buf`, ours and readable for the whole call.
        let n = unsafe { libc::pwritev2(self.fd(), &iov, 1, at, libc::RWF_NOWAIT) };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                // A kernel or file system that does not take it (ext4,
                // btrfs before 6.1): the pool writes everything from now on.
                Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => {
                    self.nowait_writes.store(false, Relaxed)
                }
                // A full file system (or quota): XFS then flushes every
                // inode and retries before it answers, RWF_NOWAIT or not,
                // which is no work for a thread that serves connections.
                // The pool writes everything from now on.
                Some(libc::ENOSPC | libc::EDQUOT) if self.nowait_writes.swap(false, Relaxed) => {
                    tracing::info!(path = %self.path.display(), "the file system is full: writes run on the I/O threads from now on");
                }
                _ => {}
            }
            return Ok(false);
        }
        Ok(n as usize == buf.len())
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        if self.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            bounce.as_mut_slice().copy_from_slice(buf);
            self.file.write_all_at(bounce.as_slice(), offset)?;
        } else {
            self.file.write_all_at(buf, offset)?;
        }
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(self.file.sync_data()?)
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        let r = if self.block_device {
            self.blk_ioctl(BLKDISCARD, offset, len)
        } else {
            self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
        };
        match r {
            // Trim is advisory: a device that cannot discard keeps its data.
            Err(e) if unsupported(&e) => Ok(()),
            r => Ok(r?),
        }
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        // ZERO_RANGE keeps the blocks allocated, so it also honours no_hole.
        let r = if self.block_device {
            if flags.fast_only {
                return Err(BackendError::Unsupported);
            }
            self.blk_ioctl(BLKZEROOUT, offset, len)
        } else {
            self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
        };
        let r = match r {
            // tmpfs and others have no ZERO_RANGE, but punch holes, which read as zeros.
            Err(e) if unsupported(&e) && !self.block_device && !flags.no_hole => {
                self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
            }
            r => r,
        };
        match r {
            Err(e) if unsupported(&e) && flags.fast_only => return Err(BackendError::Unsupported),
            Err(e) if unsupported(&e) => self.write_zero_bytes(offset, len)?,
            r => r?,
        }
        if flags.fua {
            self.file.sync_data()?;
        }
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if self.block_device {
            return Ok(vec![Extent { len, hole: false }]);
        }
        // SEEK_DATA / SEEK_HOLE walk the file's allocation map.
        let end = offset + len;
        let mut out: Vec<Extent> = Vec::new();
        let mut at = offset;
        while at < end {
            let data = self.seek(at, libc::SEEK_DATA)?.unwrap_or(end).min(end);
            if data > at {
                out.push(Extent { len: data - at, hole: true });
                at = data;
                continue;
            }
            let hole = self.seek(at, libc::SEEK_HOLE)?.unwrap_or(end).min(end).max(at + 1);
            out.push(Extent { len: hole - at, hole: false });
            at = hole;
        }
        Ok(out)
    }
    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        // SAFETY: posix_fadvise only reads its integer arguments; the fd is ours and open.
        let r = unsafe {
            libc::posix_fadvise(
                self.fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        // A hint: failing to prefetch is not an error of the request.
        let _ = r;
        Ok(())
    }
    fn may_block(&self) -> bool {
        true
    }
    fn volatile(&self) -> bool {
        false
    }
    fn generation(&self) -> u64 {
        self.generation
    }
    /// On the file (an attribute) and in the run directory (a file of its
    /// own); either is enough. (Both: the attribute may fail
    /// where it matters most, a filesystem the failure turned read-only, and
    /// even written it may not reach the disk then.)
    fn record_failed_flush(&self) -> io::Result<()> {
        // The run directory's first: on its own filesystem (tmpfs), it does
        // not wait on the one that just failed.
        let off_file = match &self.record {
            Some(record) => write_record(record, recorded(record) + 1, &self.path)
                .map_err(|e| io::Error::new(e.kind(), format!("in {}: {e}", record.display()))),
            None => Err(io::Error::new(io::ErrorKind::NotFound, "no run directory")),
        };
        let on_file = count_failed_flush(&self.file);
        match (on_file, off_file) {
            (Ok(()), _) | (_, Ok(())) => Ok(()),
            (Err(a), Err(b)) => Err(io::Error::new(a.kind(), format!("on the file: {a}; off it: {b}"))),
        }
    }
    fn describe(&self) -> String {
        format!(
            "{} {}, {} bytes{}",
            if self.block_device { "block device" } else { "file" },
            self.path.display(),
            self.size,
            if self.direct { ", O_DIRECT" } else { "" }
        )
    }
}

/// A zeroed heap buffer aligned for O_DIRECT.
/// A buffer the device may read or write directly (O_DIRECT): zeroed,
/// aligned to [`DIRECT_ALIGN`].
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes (at least one).
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), DIRECT_ALIGN).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points at layout.size() initialized (zeroed) bytes we own.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
    /// Where the device writes (the buffer must outlive that write).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(len: u64) -> PathBuf {
        let p = std::env::temp_dir().join(format!("fastsan-file-{}-{len}", std::process::id()));
        let f = File::create(&p).unwrap();
        f.set_len(len).unwrap();
        p
    }

    /// What a generation is made of: another file at the same path, a
    /// reboot of the host under a file on tmpfs, a failed flush recorded on
    /// the file each give another one; reopening the same file gives the same.
    #[test]
    fn a_generation_changes_with_the_file_a_reboot_of_tmpfs_and_a_failed_flush() {
        let p = temp_file(1 << 16);
        let g = |p: &Path| FileBackend::open(p, false, false).unwrap().generation();
        let first = g(&p);
        assert_eq!(g(&p), first, "the same file, the same generation");
        let b = FileBackend::open(&p, false, false).unwrap();
        match b.record_failed_flush() {
            Ok(()) => {
                assert_eq!(failed_flushes(&b.file), 1);
                assert_ne!(g(&p), first, "a failed flush recorded");
                b.record_failed_flush().unwrap();
                assert_eq!(failed_flushes(&b.file), 2, "counted");
            }
            Err(e) => eprintln!("no attributes on {} ({e}): the record is not checked", p.display()),
        }
        // The record off the file, in a run directory: read back at open.
        let run = std::env::temp_dir().join(format!("fastsan-run-{}", std::process::id()));
        let with_run = |p: &Path| FileBackend::open_with(p, false, false, Some(&run)).unwrap();
        let before = with_run(&p).generation();
        assert_eq!(before, g(&p), "no record there yet: the same generation");
        with_run(&p).record_failed_flush().unwrap();
        let record = record_path(&run, &std::fs::metadata(&p).unwrap());
        assert_eq!(recorded(&record), 1);
        assert_ne!(with_run(&p).generation(), before, "the record is read back");
        std::fs::write(&record, "garbage").unwrap();
        assert_eq!(recorded(&record), 1, "a record there but unreadable counts as a failure");
        std::fs::remove_file(&record).unwrap();
        std::os::unix::fs::symlink(&p, &record).unwrap();
        assert_eq!(recorded(&record), 1, "a link is not followed, and counts");
        std::fs::remove_dir_all(&run).unwrap();

        let before = g(&p);
        std::fs::remove_file(&p).unwrap();
        let p = temp_file(1 << 16);
        assert_ne!(g(&p), before, "a file made again at the same path");
        std::fs::remove_file(p).unwrap();

        let shm = Path::new("/dev/shm").join(format!("fastsan-gen-{}", std::process::id()));
        let Ok(f) = File::create(&shm) else {
            return eprintln!("no /dev/shm: the tmpfs case is not checked");
        };
        let meta = f.metadata().unwrap();
        if fs_type(&f) == Some(TMPFS) {
            assert!(on_volatile_storage(&f, &meta), "a file on tmpfs goes with the host's memory");
            assert_ne!(generation(&meta, Some(1), [0; 2]), generation(&meta, Some(2), [0; 2]), "a reboot");
            assert_eq!(
                FileBackend::open(&shm, false, false).unwrap().generation(),
                generation(&meta, Some(crate::server::boot_id()), [0; 2])
            );
        }
        std::fs::remove_file(shm).unwrap();
    }

    #[test]
    fn write_read_zero_trim() {
        let p = temp_file(1 << 20);
        let b = FileBackend::open(&p, false, false).unwrap();
        assert_eq!(b.size(), 1 << 20);
        b.write_at(&[7u8; 8192], 4096, true).unwrap();
        let mut back = [0u8; 8192];
        b.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, [7u8; 8192]);
        b.write_zeroes(4096, 4096, ZeroFlags::default()).unwrap();
        b.trim(8192, 4096).unwrap();
        b.flush().unwrap();
        b.read_at(&mut back, 4096).unwrap();
        assert!(back.iter().all(|&x| x == 0));
        let map = b.extents(0, 1 << 20).unwrap();
        assert_eq!(map.iter().map(|e| e.len).sum::<u64>(), 1 << 20, "{map:?}");
        assert!(map.iter().any(|e| e.hole), "a sparse file has holes: {map:?}");
        assert!(map.iter().any(|e| !e.hole), "and data: {map:?}");
        std::fs::remove_file(p).unwrap();
    }

    /// Whether `p` is on a tmpfs, which keeps its pages whatever the advice.
    fn on_tmpfs(p: &Path) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: statfs writes only into the struct it is given; the path is a valid C string.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
        st.f_type == libc::TMPFS_MAGIC
    }

    /// A read at once is served from the page cache (the bytes just written)
    /// or declined, never waited for: once the file's pages are dropped it
    /// declines, and `read_at` (the pool's) reads them. The stats layer
    /// counts each read once, where it was served.
    #[test]
    fn a_read_at_once_comes_from_the_page_cache_or_is_declined() {
        use crate::backend::{StatsLayer, VolumeStats};
        use std::sync::Arc;
        let p = temp_file(2 << 20);
        let file = Arc::new(FileBackend::open(&p, false, false).unwrap());
        let stats = Arc::new(VolumeStats::default());
        let b = StatsLayer::new(file.clone(), stats.clone());
        assert!(b.can_read_now(), "a buffered file passes it up through the stats layer");
        let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        b.write_at(&data, 4096, false).unwrap();
        let mut back = vec![0u8; data.len()];
        let served = b.read_now(&mut back, 4096).unwrap();
        if served {
            assert!(back == data, "served at once: the bytes just written");
        } else {
            assert!(
                !file.nowait.load(Relaxed),
                "declined while cached only where the kernel refuses RWF_NOWAIT"
            );
        }
        // Written back, then dropped from the cache: not at hand any more.
        b.flush().unwrap();
        // SAFETY: posix_fadvise only reads its integer arguments; the fd is open.
        assert_eq!(unsafe { libc::posix_fadvise(file.fd(), 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
        if !on_tmpfs(&p) {
            assert_eq!(b.read_now(&mut back, 4096), Ok(false), "the pages are on disk only");
        }
        back.fill(0);
        b.read_at(&mut back, 4096).unwrap();
        assert!(back == data, "read from the device");
        let s = stats.snapshot();
        let reads = 1 + u64::from(served);
        assert_eq!((s.reads, s.bytes_read, s.errors), (reads, reads * 65536, 0), "{s:?}");
        assert!(
            !FileBackend::open(&p, false, true).unwrap().can_read_now(),
            "O_DIRECT reads go to the device"
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn read_only_refuses_writes_at_the_os() {
        let p = temp_file(4096);
        let b = FileBackend::open(&p, true, false).unwrap();
        assert!(b.write_at(&[1u8; 512], 0, false).is_err());
        std::fs::remove_file(p).unwrap();
    }
}
