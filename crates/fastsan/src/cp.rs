//! `fastsan cp`: copy between a local file and a volume, in either direction
//! (or between two volumes), many chunks in flight, with a progress bar.
//! Retries and the completion of a partial last block are the initiator's
//! ([`fastsan_initiator::copy`]). A local destination file is written under
//! a temporary name beside it and renamed into place once flushed, so a
//! failed or interrupted copy leaves it as it was.

use crate::ClientArgs;
use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use fastsan_initiator::{copy, Remote};
use fastsan_target::config::parse_size;
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Copy a local file into a volume, a volume into a local file, or a volume
/// into another volume (between two local files, use cp).
///
/// A local source is a regular file or a block device. A local destination
/// file is written under a temporary name beside it and renamed over it
/// once complete and flushed (room for both is needed until then): a copy
/// that fails or is interrupted leaves it as it was. A block device is
/// written in place. A source shorter than the destination volume leaves
/// the volume's bytes past its end as they were.
///
/// Examples:
///   fastsan cp disk.img brp://127.0.0.1:10810/vol0
///   fastsan cp brp://127.0.0.1:10810/vol0 backup.img
///   fastsan cp disk.img 'brp+unix:///vol0?socket=/run/fastsan.sock'
///   fastsan cp disk.img mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Source: a local path, brp://HOST:PORT/VOLUME (brps:// with TLS),
    /// brp+unix:///VOLUME?socket=PATH, nbd://HOST:PORT/EXPORT or mirror:LEG,LEG,log=PATH
    src: String,
    /// Destination: a local path or a volume URL, as the source
    dst: String,
    /// Size of each request.
    #[arg(long, default_value = "1M", value_name = "SIZE")]
    chunk: String,
    /// Requests in flight.
    #[arg(long, default_value_t = 32, value_name = "N")]
    depth: usize,
    #[command(flatten)]
    client: ClientArgs,
}

enum End {
    Local(Arc<File>, PathBuf, Local),
    Vol(Remote, String),
}

/// What a local end is.
enum Local {
    /// A regular file (a source).
    File,
    /// A block device of `size` bytes: written in place, never truncated.
    Device { size: u64 },
    /// A destination file, written whole under a temporary name next to it
    /// and renamed over it once flushed: an error, a signal or a copy of a
    /// volume onto its own backing file leaves the old file as it was (it
    /// was truncated at the start before). `target`: the file renamed over
    /// (a symbolic link's target, not the link). `_held`: the old file,
    /// locked, so that no target starts serving it meanwhile.
    Replace { tmp: TempFile, target: PathBuf, _held: Option<File> },
    /// A character device (/dev/null), written in place, of any size.
    Char,
}

/// A temporary file that is removed unless it was renamed into place.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Whether `s` names a volume (a URL `cp` takes) rather than a local path;
/// a URL of another scheme is refused, not taken for a file's name.
fn is_volume(s: &str) -> anyhow::Result<bool> {
    if Remote::has_scheme(s) {
        return Ok(true);
    }
    if let Some((scheme, _)) = s.split_once("://") {
        bail!(
            "{s}: cp does not take {scheme}:// URLs; it copies to and from brp://, brps://, \
             brp+unix://, nbd:// and mirror: volumes (a local file is a plain path)"
        );
    }
    Ok(false)
}

/// Refuses the copies that cannot be what was meant: between two local
/// files (that is cp(1)'s job) and from a volume onto itself.
fn check_ends(src: &str, dst: &str) -> anyhow::Result<()> {
    match (is_volume(src)?, is_volume(dst)?) {
        (false, false) => bail!(
            "both {src} and {dst} are local paths: fastsan cp copies to or from a volume \
             (brp://, nbd://, ...); use cp(1) between files"
        ),
        (true, true) if src == dst => bail!("{src} is both the source and the destination"),
        _ => Ok(()),
    }
}

/// What a file that is neither a regular file nor a block device is, in words.
fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a pipe"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Takes `f`'s exclusive lock for as long as it is open, or says who holds
/// it: a fastsan target serving the file or device.
fn exclusive(f: &File, path: &Path) -> anyhow::Result<()> {
    use fastsan_target::backend::{try_lock, Locked};
    match try_lock(f, true).with_context(|| format!("locking {}", path.display()))? {
        Locked::Busy => bail!(
            "{} is in use: a fastsan target serves it (it holds a lock on it); copy into that \
             volume instead, or stop the target first",
            path.display()
        ),
        // A file system without locks: nothing to learn from it.
        Locked::Yes | Locked::Unsupported(_) => Ok(()),
    }
}

/// The directory `p` is in (`.` for a bare name).
fn dir_of(p: &Path) -> &Path {
    p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The size of an open block device.
fn device_size(f: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = f;
    f.seek(SeekFrom::End(0))
}

impl End {
    async fn open(s: &str, dst: bool, client: &ClientArgs) -> anyhow::Result<End> {
        if is_volume(s)? {
            let v = Remote::connect(s, client.options()?).await.with_context(|| format!("opening {s}"))?;
            if dst && v.read_only() {
                bail!("{s} is read-only");
            }
            return Ok(End::Vol(v, s.to_owned()));
        }
        let path = PathBuf::from(s);
        let (f, local) = if dst { Self::create(&path)? } else { Self::source(&path)? };
        Ok(End::Local(Arc::new(f), path, local))
    }

    /// A local source: a regular file or a block device, whose size is
    /// known (a pipe's or a character device's reads as 0: it was copied
    /// as nothing, and reported a success).
    fn source(path: &Path) -> anyhow::Result<(File, Local)> {
        use std::os::unix::fs::FileTypeExt;
        use std::os::unix::fs::OpenOptionsExt;
        // Without waiting: opening a pipe waits for a writer (regular files
        // and block devices read alike either way).
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let t = f.metadata().with_context(|| format!("reading {}'s metadata", path.display()))?.file_type();
        if !t.is_file() && !t.is_block_device() {
            bail!(
                "{} is {}: cp copies from a regular file or a block device, whose size is known \
                 (write a stream to a file first)",
                path.display(),
                kind_of(t)
            )
        }
        if t.is_file() {
            return Ok((f, Local::File));
        }
        let size = device_size(&f).with_context(|| format!("reading {}'s size", path.display()))?;
        Ok((f, Local::Device { size }))
    }

    /// A local destination: a block device, written in place, or a file,
    /// written under a temporary name in its directory.
    fn create(path: &Path) -> anyhow::Result<(File, Local)> {
        use std::os::unix::fs::FileTypeExt;
        let old = match std::fs::metadata(path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let mut held = None;
        if let Some(m) = &old {
            let t = m.file_type();
            if t.is_char_device() {
                // (/dev/null: a read of the whole volume, checked and thrown away.)
                let f = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                return Ok((f, Local::Char));
            }
            if !t.is_file() && !t.is_block_device() {
                bail!("{} is {}: cp copies to a file or a block device", path.display(), kind_of(t));
            }
            // A file or device a fastsan target serves is locked by it: the
            // copy would go behind its back (a file replaced under a target
            // keeps being served from the old one, and every write made
            // there is lost at its next start).
            let f = OpenOptions::new()
                .write(t.is_block_device())
                .read(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            exclusive(&f, path)?;
            if t.is_block_device() {
                let size = device_size(&f).with_context(|| format!("reading {}'s size", path.display()))?;
                return Ok((f, Local::Device { size }));
            }
            // Held until the copy is in place: no target starts on it meanwhile.
            held = Some(f);
        }
        // Through a symbolic link, the file it names is replaced, not the link.
        let target = match &old {
            Some(_) => {
                std::fs::canonicalize(path).with_context(|| format!("resolving {}", path.display()))?
            }
            None => path.to_owned(),
        };
        let name = target.file_name().with_context(|| format!("{} names no file", path.display()))?;
        let tmp =
            dir_of(&target).join(format!(".{}.fastsan-cp-{}", name.to_string_lossy(), std::process::id()));
        let f =
            OpenOptions::new().write(true).create_new(true).open(&tmp).with_context(|| {
                format!("creating {} (to be renamed to {})", tmp.display(), path.display())
            })?;
        let tmp = TempFile(Some(tmp));
        if let Some(m) = old {
            // The copy replaces the file: it keeps the file's permissions,
            // and its owner where this user may give it (root restoring a
            // file the target's user owns).
            use std::os::unix::fs::MetadataExt;
            f.set_permissions(m.permissions())
                .with_context(|| format!("giving {} {}'s permissions", tmp_name(&tmp), path.display()))?;
            let _ = std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid()));
        }
        Ok((f, Local::Replace { tmp, target, _held: held }))
    }

    /// Every chunk but the last starts where the one before ended: on a
    /// volume, each must begin on one of its blocks.
    fn check_chunk(&self, chunk: u64) -> anyhow::Result<()> {
        if let End::Vol(v, u) = self {
            let block = u64::from(v.block_size().max(1));
            if !chunk.is_multiple_of(block) {
                bail!("--chunk {chunk} is not a multiple of {u}'s block size ({block} bytes)");
            }
        }
        Ok(())
    }

    /// Bytes a source holds.
    fn len(&self) -> anyhow::Result<u64> {
        Ok(match self {
            End::Local(_, _, Local::Device { size }) => *size,
            End::Local(f, _, _) => f.metadata()?.len(),
            End::Vol(v, _) => v.size(),
        })
    }

    /// Bytes a destination takes at most (`None`: a file, any).
    fn room(&self) -> Option<u64> {
        match self {
            End::Local(_, _, Local::Device { size }) => Some(*size),
            End::Local(..) => None,
            End::Vol(v, _) => Some(v.size()),
        }
    }

    async fn read(&self, off: u64, n: u64) -> anyhow::Result<Bytes> {
        match self {
            End::Vol(v, _) => Ok(copy::read(v, off, n).await?),
            End::Local(f, _, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    let mut b = BytesMut::zeroed(n as usize);
                    f.read_exact_at(&mut b, off)?;
                    Ok(b.freeze())
                })
                .await?
            }
        }
    }

    async fn write(&self, off: u64, data: Bytes) -> anyhow::Result<()> {
        match self {
            End::Vol(v, _) => Ok(copy::write(v, off, data).await?),
            End::Local(f, _, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || f.write_all_at(&data, off)).await??;
                Ok(())
            }
        }
    }

    /// Makes the copy durable and, for a file, puts it in place.
    async fn finish(&mut self, len: u64) -> anyhow::Result<()> {
        match self {
            End::Vol(v, _) => Ok(copy::finish(v).await?),
            // (A source is never finished; a character device keeps nothing.)
            End::Local(_, _, Local::File | Local::Char) => Ok(()),
            End::Local(f, _, Local::Device { .. }) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || f.sync_all()).await??;
                Ok(())
            }
            End::Local(f, _, Local::Replace { tmp, target, .. }) => {
                let f = f.clone();
                let from = tmp.0.clone().expect("not renamed yet");
                let to = target.clone();
                tokio::task::spawn_blocking(move || {
                    f.set_len(len)?;
                    f.sync_all()?;
                    std::fs::rename(&from, &to)?;
                    // The rename is durable once the directory is.
                    File::open(dir_of(&to))?.sync_all()
                })
                .await??;
                tmp.0 = None;
                Ok(())
            }
        }
    }

    fn name(&self) -> String {
        match self {
            End::Local(_, p, _) => p.display().to_string(),
            End::Vol(_, u) => u.clone(),
        }
    }

    /// What an unfinished copy left here, in words.
    fn left(&self) -> String {
        match self {
            End::Vol(_, u) => format!("{u} holds part of the copy"),
            End::Local(_, p, Local::Device { .. }) => format!("{} holds part of the copy", p.display()),
            End::Local(_, p, _) => format!("{} is as it was", p.display()),
        }
    }
}

fn tmp_name(t: &TempFile) -> String {
    t.0.as_deref().map_or_else(String::new, |p| p.display().to_string())
}

/// Most bytes in flight at once (`--depth` chunks of `--chunk`).
const MAX_IN_FLIGHT: u64 = 1 << 30;

pub async fn run(a: Args) -> anyhow::Result<()> {
    let chunk = parse_size(&a.chunk)?;
    if chunk == 0 || chunk > 64 << 20 {
        bail!("--chunk must be between 1 byte and 64 MiB");
    }
    if a.depth == 0 || a.depth > 4096 {
        bail!("--depth must be 1..=4096");
    }
    if a.depth as u64 * chunk > MAX_IN_FLIGHT {
        bail!("--depth x --chunk is the memory a copy holds in flight: at most 1 GiB");
    }
    check_ends(&a.src, &a.dst)?;
    let src = End::open(&a.src, false, &a.client).await?;
    src.check_chunk(chunk)?;
    let len = src.len()?;
    let mut dst = End::open(&a.dst, true, &a.client).await?;
    dst.check_chunk(chunk)?;
    if let Some(room) = dst.room() {
        if len > room {
            bail!("{} has {len} bytes; {} holds only {room}", src.name(), dst.name());
        }
    }
    let pb = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    let start = Instant::now();
    // SIGINT and SIGTERM end the copy as an error does: a destination file
    // stays as it was (its temporary copy is removed), a volume is told to
    // hold part of it.
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let copied = async {
        let (src, dst) = (&src, &dst);
        futures::stream::iter((0..len.div_ceil(chunk)).map(|i| {
            let off = i * chunk;
            (off, chunk.min(len - off))
        }))
        .map(|(off, n)| {
            let pb = pb.clone();
            async move {
                let data =
                    src.read(off, n).await.with_context(|| format!("reading {} at {off}", src.name()))?;
                dst.write(off, data).await.with_context(|| format!("writing {} at {off}", dst.name()))?;
                pb.inc(n);
                anyhow::Ok(())
            }
        })
        .buffer_unordered(a.depth)
        .try_collect::<()>()
        .await
    };
    let copied = tokio::select! {
        r = copied => r,
        _ = int.recv() => Err(anyhow::anyhow!("interrupted (SIGINT)")),
        _ = term.recv() => Err(anyhow::anyhow!("interrupted (SIGTERM)")),
    };
    let done = match copied {
        Ok(()) => dst.finish(len).await.with_context(|| format!("flushing {}", dst.name())),
        Err(e) => Err(e),
    };
    pb.finish_and_clear();
    if let Err(e) = done {
        return Err(e.context(format!("the copy did not finish: {}", dst.left())));
    }
    let secs = start.elapsed().as_secs_f64();
    outln!(
        "copied {} ({len} bytes) from {} to {} in {secs:.2} s ({:.1} MiB/s)",
        indicatif::HumanBytes(len),
        src.name(),
        dst.name(),
        len as f64 / (1 << 20) as f64 / secs.max(1e-9)
    )?;
    Ok(())
}
