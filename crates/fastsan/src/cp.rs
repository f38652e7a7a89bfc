//! `fastsan cp`: copy between a local file and a volume, in either direction
//! (or between two volumes), many chunks in flight, with a progress bar; or
//! stream a pipe into a volume, or a volume out to one, in order. Retries
//! and the completion of a partial last block are the initiator's
//! ([`fastsan_initiator::copy`]). A local destination file is written under
//! a temporary name beside it and renamed into place once flushed, so a
//! failed or interrupted copy leaves it as it was (unless `--in-place`).

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
/// A local source is a regular file, a block device, or a stream: `-`
/// (standard input), a named pipe, or a character device. A stream is read
/// in order and must end within the volume (/dev/zero, /dev/full,
/// /dev/random and /dev/urandom are read for as many bytes as the volume
/// holds); an empty one is an error, and one that ends before the volume
/// does is pointed out (use `set -o pipefail` in pipelines). A local
/// destination file is written under a temporary name beside it and
/// renamed over it once complete and flushed (room for both is needed
/// until then): a copy that fails or is interrupted leaves it as it was.
/// With --in-place it is written where it is instead (for a file too big to
/// hold twice, or one with hard links or extended attributes to keep). A
/// block device is written in place; `-` (standard output), a named pipe or
/// a character device gets the volume in order. A source shorter than the
/// destination volume leaves the volume's bytes past its end as they were.
///
/// Examples:
///   fastsan cp disk.img brp://127.0.0.1:10810/vol0
///   fastsan cp brp://127.0.0.1:10810/vol0 backup.img
///   set -o pipefail
///   fastsan cp brp://127.0.0.1:10810/vol0 - | zstd > backup.img.zst
///   zstd -dc backup.img.zst | fastsan cp - brp://127.0.0.1:10810/vol0
///   fastsan cp disk.img 'brp+unix:///vol0?socket=/run/fastsan.sock'
///   fastsan cp disk.img mirror:brp://a:10810/v,brp://b:10810/v,log=/var/lib/fastsan/v.log
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Source: a local path (- for standard input), brp://HOST:PORT/VOLUME
    /// (brps:// with TLS), brp+unix:///VOLUME?socket=PATH,
    /// nbd://HOST:PORT/EXPORT or mirror:LEG,LEG,log=PATH
    src: String,
    /// Destination: a local path (- for standard output) or a volume URL,
    /// as the source
    dst: String,
    /// Write a local destination file where it is, not under a temporary
    /// name renamed over it: a copy that fails leaves it part-written.
    #[arg(long)]
    in_place: bool,
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
    /// A file or block device, read and written anywhere.
    Local(Arc<File>, PathBuf, Local),
    /// Standard input or output, a named pipe, a character device: read or
    /// written in order, of a size known only at its end.
    Stream(Arc<File>, String, Flow),
    Vol(Remote, String),
}

/// What a stream is.
#[derive(Clone, Copy, PartialEq)]
enum Flow {
    /// A pipe or standard input: its end is its size (it must end within
    /// the destination; bytes past it were lost).
    Ends,
    /// A character device (/dev/zero, /dev/urandom) as a source: read for
    /// as many bytes as the destination holds.
    Fills,
    /// A destination: standard output, a pipe, a character device. Made
    /// durable at the end if it is a file after all (`> file`).
    Out,
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
    /// A destination file written where it is (`--in-place`), cut to the
    /// copy's length at the end; `created`: it did not exist before (its
    /// directory is flushed too).
    InPlace { created: bool },
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

/// `--in-place` is for a destination file (new or not): refused, before
/// anything is opened, for a volume, a stream or a device, which are
/// written in place as they are (a pipe's open would wait for its reader).
fn check_in_place(dst: &str) -> anyhow::Result<()> {
    let file = !is_volume(dst)? && dst != "-" && std::fs::metadata(dst).map_or(true, |m| m.is_file());
    if !file {
        bail!("--in-place is for a destination file: {dst} is written in place as it is");
    }
    Ok(())
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
            "{} is in use: a fastsan target serves it, or another fastsan cp writes it (either \
             holds a lock on it); copy into that volume instead, or stop the target first",
            path.display()
        ),
        // A file system without locks: nothing to learn from it.
        Locked::Yes | Locked::Unsupported(_) => Ok(()),
    }
}

/// Whether a character device reads for ever, and so fills a volume: the
/// kernel's memory devices /dev/zero, /dev/full, /dev/random and
/// /dev/urandom. Any other (a tape, /dev/null, a serial line) ends, as a
/// pipe does, and must end within the volume.
fn endless(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let rdev = m.rdev();
    m.file_type().is_char_device() && libc::major(rdev) == 1 && matches!(libc::minor(rdev), 5 | 7 | 8 | 9)
}

/// Whether `f` is the file standard output is (`/dev/stdout`, `> f`): the
/// copy's report must not go there.
fn is_stdout(f: &File) -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Ok(out) = std::io::stdout().as_fd().try_clone_to_owned().map(File::from).and_then(|o| o.metadata())
    else {
        return false;
    };
    f.metadata().is_ok_and(|m| (m.dev(), m.ino()) == (out.dev(), out.ino()))
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
    async fn open(s: &str, dst: bool, in_place: bool, client: &ClientArgs) -> anyhow::Result<End> {
        if is_volume(s)? {
            let v = Remote::connect(s, client.options()?).await.with_context(|| format!("opening {s}"))?;
            if dst && v.read_only() {
                bail!("{s} is read-only");
            }
            return Ok(End::Vol(v, s.to_owned()));
        }
        if s == "-" {
            return Self::standard(dst);
        }
        let path = PathBuf::from(s);
        if dst {
            return Self::create(&path, in_place);
        }
        Self::source(&path)
    }

    /// `-`: standard input as a source, standard output as a destination;
    /// never a terminal (a volume's bytes are not for a screen, and a
    /// source typed by hand is not what was meant).
    fn standard(dst: bool) -> anyhow::Result<End> {
        use std::io::IsTerminal;
        use std::os::fd::AsFd;
        let (fd, name, terminal) = if dst {
            let o = std::io::stdout();
            (o.as_fd().try_clone_to_owned(), "standard output", o.is_terminal())
        } else {
            let i = std::io::stdin();
            (i.as_fd().try_clone_to_owned(), "standard input", i.is_terminal())
        };
        if terminal {
            bail!("{name} is a terminal: cp streams - to or from a pipe or a file (| or < >)");
        }
        let f = File::from(fd.with_context(|| format!("duplicating {name}"))?);
        if dst {
            return Ok(End::Stream(Arc::new(f), name.to_owned(), Flow::Out));
        }
        // `< disk.img` at its start is that file, with its size: checked
        // against the volume's before anything is written, as its path is.
        let m = f.metadata().with_context(|| format!("reading {name}'s metadata"))?;
        let t = m.file_type();
        let at_start = || {
            use std::io::Seek;
            (&f).stream_position().is_ok_and(|p| p == 0)
        };
        if (t.is_file() || std::os::unix::fs::FileTypeExt::is_block_device(&t)) && at_start() {
            return Self::local_source(f, PathBuf::from(name), t);
        }
        let flow = if endless(&m) { Flow::Fills } else { Flow::Ends };
        Ok(End::Stream(Arc::new(f), name.to_owned(), flow))
    }

    /// A local source: a regular file or a block device, whose size is
    /// known, or a named pipe or character device, streamed.
    fn source(path: &Path) -> anyhow::Result<End> {
        use std::io::IsTerminal;
        use std::os::unix::fs::FileTypeExt;
        use std::os::unix::fs::OpenOptionsExt;
        let open = |flags| {
            OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))
        };
        // Without waiting, to learn what it is: opening a pipe waits for a
        // writer (regular files and block devices read alike either way).
        let f = open(libc::O_NONBLOCK)?;
        let m = f.metadata().with_context(|| format!("reading {}'s metadata", path.display()))?;
        let t = m.file_type();
        let name = path.display().to_string();
        if t.is_fifo() || t.is_char_device() {
            if f.is_terminal() {
                bail!("{name} is a terminal: cp streams from a pipe or a device");
            }
            // A pipe waits for its writer now, as cat(1) would; read without
            // O_NONBLOCK, a pipe opened before its writer would read as empty.
            let f = open(0)?;
            let flow = if endless(&m) { Flow::Fills } else { Flow::Ends };
            return Ok(End::Stream(Arc::new(f), name, flow));
        }
        Self::local_source(f, path.to_owned(), t)
    }

    /// A source read at offsets: a regular file or a block device.
    fn local_source(f: File, path: PathBuf, t: std::fs::FileType) -> anyhow::Result<End> {
        use std::os::unix::fs::FileTypeExt;
        let name = path.display();
        if !t.is_file() && !t.is_block_device() {
            bail!("{name} is {}: cp copies from a regular file, a block device or a stream", kind_of(t))
        }
        let local = if t.is_file() {
            Local::File
        } else {
            Local::Device { size: device_size(&f).with_context(|| format!("reading {name}'s size"))? }
        };
        Ok(End::Local(Arc::new(f), path, local))
    }

    /// A local destination: a block device, written in place; a file,
    /// written under a temporary name in its directory (or in place); a
    /// named pipe or character device, streamed to.
    fn create(path: &Path, in_place: bool) -> anyhow::Result<End> {
        use std::os::unix::fs::FileTypeExt;
        let old = match std::fs::metadata(path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
        };
        let local = |f: File, l| Ok(End::Local(Arc::new(f), path.to_owned(), l));
        let mut held = None;
        if let Some(m) = &old {
            let t = m.file_type();
            if t.is_char_device() || t.is_fifo() {
                // (/dev/null: a read of the whole volume, checked and thrown away.)
                let f = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                if std::io::IsTerminal::is_terminal(&f) {
                    bail!(
                        "{} is a terminal: cp streams a volume to a pipe, a file or a device",
                        path.display()
                    );
                }
                return Ok(End::Stream(Arc::new(f), path.display().to_string(), Flow::Out));
            }
            if !t.is_file() && !t.is_block_device() {
                bail!(
                    "{} is {}: cp copies to a file, a block device or a stream",
                    path.display(),
                    kind_of(t)
                );
            }
            // A file or device a fastsan target serves is locked by it: the
            // copy would go behind its back (a file replaced under a target
            // keeps being served from the old one, and every write made
            // there is lost at its next start).
            let f = OpenOptions::new()
                .write(t.is_block_device() || in_place)
                .read(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            exclusive(&f, path)?;
            if t.is_block_device() {
                let size = device_size(&f).with_context(|| format!("reading {}'s size", path.display()))?;
                return local(f, Local::Device { size });
            }
            if in_place {
                return local(f, Local::InPlace { created: false });
            }
            // Held until the copy is in place: no target starts on it meanwhile.
            held = Some(f);
        }
        if in_place {
            let f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .with_context(|| format!("creating {}", path.display()))?;
            exclusive(&f, path)?;
            return local(f, Local::InPlace { created: true });
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
        local(f, Local::Replace { tmp, target, _held: held })
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

    /// Bytes a source holds (`None`: a stream, known at its end).
    fn len(&self) -> anyhow::Result<Option<u64>> {
        Ok(match self {
            End::Local(_, _, Local::Device { size }) => Some(*size),
            End::Local(f, _, _) => Some(f.metadata()?.len()),
            End::Stream(..) => None,
            End::Vol(v, _) => Some(v.size()),
        })
    }

    /// Bytes a destination takes at most (`None`: a file or a stream, any).
    fn room(&self) -> Option<u64> {
        match self {
            End::Local(_, _, Local::Device { size }) => Some(*size),
            End::Local(..) | End::Stream(..) => None,
            End::Vol(v, _) => Some(v.size()),
        }
    }

    /// Reads `n` bytes at `off`; from a stream, its next `n` bytes (fewer
    /// at its end: the caller keeps `off` in order).
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
            End::Stream(f, _, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    use std::io::Read;
                    let mut b = BytesMut::zeroed(n as usize);
                    let mut got = 0;
                    // A pipe gives what its writer wrote so far: read until
                    // the chunk is whole (every chunk but the last starts on
                    // a block of the volume) or the stream ends.
                    while got < b.len() {
                        match (&*f).read(&mut b[got..]) {
                            Ok(0) => break,
                            Ok(k) => got += k,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                    b.truncate(got);
                    Ok(b.freeze())
                })
                .await?
            }
        }
    }

    /// Writes `data` at `off`; to a stream, after what was written before
    /// (the caller keeps `off` in order).
    async fn write(&self, off: u64, data: Bytes) -> anyhow::Result<()> {
        match self {
            End::Vol(v, _) => Ok(copy::write(v, off, data).await?),
            End::Local(f, _, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || f.write_all_at(&data, off)).await??;
                Ok(())
            }
            End::Stream(f, _, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    use std::io::Write;
                    (&*f).write_all(&data)
                })
                .await??;
                Ok(())
            }
        }
    }

    /// Makes the copy durable: what may take long (a volume's flush waits
    /// for its target's return), and may be interrupted. [`End::commit`]
    /// then puts a file's copy in place.
    async fn flush(&mut self, len: u64) -> anyhow::Result<()> {
        let sync = |f: &Arc<File>, len: Option<u64>, dir: Option<PathBuf>| {
            let f = f.clone();
            tokio::task::spawn_blocking(move || {
                if let Some(len) = len {
                    f.set_len(len)?;
                }
                f.sync_all()?;
                // A new name is durable once its directory is.
                match dir {
                    Some(d) => File::open(d)?.sync_all(),
                    None => Ok(()),
                }
            })
        };
        match self {
            End::Vol(v, _) => Ok(copy::finish(v).await?),
            // (A source is never finished.)
            End::Local(_, _, Local::File) | End::Stream(_, _, Flow::Ends | Flow::Fills) => Ok(()),
            End::Stream(f, _, Flow::Out) => {
                // A pipe or a character device keeps nothing to flush; `> file` does.
                use std::os::unix::fs::FileTypeExt;
                let t = f.metadata()?.file_type();
                if t.is_file() || t.is_block_device() {
                    sync(f, None, None).await??;
                }
                Ok(())
            }
            End::Local(f, _, Local::Device { .. }) => Ok(sync(f, None, None).await??),
            End::Local(f, p, Local::InPlace { created }) => {
                let dir = created.then(|| dir_of(p).to_owned());
                Ok(sync(f, Some(len), dir).await??)
            }
            End::Local(f, _, Local::Replace { .. }) => Ok(sync(f, Some(len), None).await??),
        }
    }

    /// Puts a flushed copy in place: a file's copy renamed over it, at
    /// once (not interrupted, so that what is said of it is what is).
    async fn commit(&mut self) -> anyhow::Result<()> {
        if let End::Local(_, _, Local::Replace { tmp, target, .. }) = self {
            let from = tmp.0.clone().expect("not renamed yet");
            let to = target.clone();
            tokio::task::spawn_blocking(move || std::fs::rename(&from, &to)).await??;
            tmp.0 = None;
            // A new name is durable once its directory is.
            let dir = dir_of(target).to_owned();
            tokio::task::spawn_blocking(move || File::open(dir)?.sync_all()).await??;
        }
        Ok(())
    }

    fn name(&self) -> String {
        match self {
            End::Local(_, p, _) => p.display().to_string(),
            End::Vol(_, u) | End::Stream(_, u, _) => u.clone(),
        }
    }

    /// What an unfinished copy left here, in words.
    fn left(&self) -> String {
        match self {
            End::Local(_, p, Local::Replace { tmp, .. }) if tmp.0.is_some() => {
                format!("{} is as it was", p.display())
            }
            End::Local(_, p, Local::Replace { .. }) => {
                format!("{} holds the whole copy, but a crash could still undo its new name", p.display())
            }
            End::Stream(_, name, _) => format!("{name} got part of the copy"),
            e => format!("{} holds part of the copy", e.name()),
        }
    }
}

/// The chunks of a copy of `len` bytes: offset and length.
fn chunks(len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(chunk)).map(move |i| {
        let off = i * chunk;
        (off, chunk.min(len - off))
    })
}

/// Files, devices and volumes: each chunk read and written at its offset,
/// `depth` chunks at once, in any order.
async fn at_offsets(
    src: &End,
    dst: &End,
    len: u64,
    chunk: u64,
    depth: usize,
    pb: &ProgressBar,
) -> anyhow::Result<u64> {
    futures::stream::iter(chunks(len, chunk))
        .map(|(off, n)| async move {
            let data = src.read(off, n).await.with_context(|| format!("reading {} at {off}", src.name()))?;
            dst.write(off, data).await.with_context(|| format!("writing {} at {off}", dst.name()))?;
            pb.inc(n);
            anyhow::Ok(())
        })
        .buffer_unordered(depth)
        .try_collect::<()>()
        .await?;
    Ok(len)
}

/// Out to a stream: `depth` chunks read at once, written in order.
async fn to_stream(
    src: &End,
    dst: &End,
    len: u64,
    chunk: u64,
    depth: usize,
    pb: &ProgressBar,
) -> anyhow::Result<u64> {
    futures::stream::iter(chunks(len, chunk))
        .map(|(off, n)| async move {
            let data = src.read(off, n).await.with_context(|| format!("reading {} at {off}", src.name()))?;
            anyhow::Ok((off, data))
        })
        .buffered(depth)
        .try_for_each(|(off, data)| async move {
            let n = data.len() as u64;
            dst.write(off, data).await.with_context(|| format!("writing {}", dst.name()))?;
            pb.inc(n);
            Ok(())
        })
        .await?;
    Ok(len)
}

/// In from a stream (into a volume): read in order, `depth` chunks written
/// at once. A stream that ends must end within the volume (the bytes past
/// it would be lost); one that fills is read for as much as the volume holds.
async fn from_stream(
    src: &End,
    flow: Flow,
    dst: &End,
    chunk: u64,
    depth: usize,
    pb: &ProgressBar,
) -> anyhow::Result<u64> {
    let room = dst.room().context("a stream is copied into a volume")?;
    futures::stream::try_unfold((0u64, false), |(off, ended)| async move {
        if ended {
            return Ok(None);
        }
        let want = chunk.min(room - off);
        if want == 0 {
            if flow == Flow::Ends {
                let more =
                    src.read(off, 1).await.with_context(|| format!("reading {} at {off}", src.name()))?;
                if !more.is_empty() {
                    bail!("{} holds more than the {room} bytes {} holds", src.name(), dst.name());
                }
            }
            return Ok(None);
        }
        let data = src.read(off, want).await.with_context(|| format!("reading {} at {off}", src.name()))?;
        let n = data.len() as u64;
        Ok((n > 0).then_some(((off, data), (off + n, n < want))))
    })
    .map_ok(|(off, data)| async move {
        let n = data.len() as u64;
        dst.write(off, data).await.with_context(|| format!("writing {} at {off}", dst.name()))?;
        pb.inc(n);
        Ok(n)
    })
    .try_buffer_unordered(depth)
    .try_fold(0, |total, n| async move { Ok(total + n) })
    .await
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
    if a.in_place {
        check_in_place(&a.dst)?;
    }
    let src = End::open(&a.src, false, a.in_place, &a.client).await?;
    src.check_chunk(chunk)?;
    let mut dst = End::open(&a.dst, true, a.in_place, &a.client).await?;
    dst.check_chunk(chunk)?;
    let len = match src {
        End::Stream(_, _, Flow::Fills) => dst.room(),
        _ => src.len()?,
    };
    if let (Some(len), Some(room)) = (len, dst.room()) {
        if len > room {
            bail!("{} has {len} bytes; {} holds only {room}", src.name(), dst.name());
        }
    }
    let pb = match len {
        Some(len) => ProgressBar::new(len).with_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
                .expect("valid template"),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {bytes} {binary_bytes_per_sec} {elapsed}")
                .expect("valid template"),
        ),
    };
    let start = Instant::now();
    // SIGINT and SIGTERM end the copy as an error does: a destination file
    // stays as it was (its temporary copy is removed; --in-place, it holds
    // part of the copy, as a volume or a device does), and the user is told.
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let copied = async {
        match (&src, len) {
            (End::Stream(_, _, flow), _) => from_stream(&src, *flow, &dst, chunk, a.depth, &pb).await,
            (_, None) => bail!("{} has no length", src.name()),
            (_, Some(len)) if matches!(dst, End::Stream(..)) => {
                to_stream(&src, &dst, len, chunk, a.depth, &pb).await
            }
            (_, Some(len)) => at_offsets(&src, &dst, len, chunk, a.depth, &pb).await,
        }
    };
    let copied = tokio::select! {
        r = copied => r,
        _ = int.recv() => Err(anyhow::anyhow!("interrupted (SIGINT)")),
        _ = term.recv() => Err(anyhow::anyhow!("interrupted (SIGTERM)")),
    };
    let done = match copied {
        // A pipe whose writer failed at once (`zstd -dc damaged.zst |`)
        // copied nothing: not a success.
        Ok(0) if matches!(src, End::Stream(..)) => {
            pb.finish_and_clear();
            bail!("{} was empty: nothing was copied", src.name())
        }
        Ok(len) => {
            // Interruptible too: a volume's flush may wait minutes for its
            // target (retried), and Ctrl-C did nothing meanwhile.
            let name = dst.name();
            let flushed = tokio::select! {
                r = dst.flush(len) => r.with_context(|| format!("flushing {name}")),
                _ = int.recv() => Err(anyhow::anyhow!("interrupted (SIGINT) while flushing {name}")),
                _ = term.recv() => Err(anyhow::anyhow!("interrupted (SIGTERM) while flushing {name}")),
            };
            match flushed {
                Ok(()) => {
                    dst.commit().await.with_context(|| format!("putting {name} in place")).map(|()| len)
                }
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    pb.finish_and_clear();
    let len = match done {
        Ok(len) => len,
        Err(e) => return Err(e.context(format!("the copy did not finish: {}", dst.left()))),
    };
    let secs = start.elapsed().as_secs_f64();
    let line = format!(
        "copied {} ({len} bytes) from {} to {} in {secs:.2} s ({:.1} MiB/s)",
        indicatif::HumanBytes(len),
        src.name(),
        dst.name(),
        len as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    use std::io::Write;
    if let (End::Stream(..), Some(room)) = (&src, dst.room()) {
        if len < room {
            // A pipe that ended early (its writer failed, a transfer cut)
            // looks like a short image: say what was left as it was.
            let _ = writeln!(
                std::io::stderr(),
                "note: {} ended after {len} bytes; the {} bytes of {} after them are as they were",
                src.name(),
                room - len,
                dst.name()
            );
        }
    }
    let on_stdout = match &dst {
        End::Stream(..) => true,
        End::Local(f, _, _) => is_stdout(f),
        End::Vol(..) => false,
    };
    if on_stdout {
        // Standard output holds the copy (`-`, `/dev/stdout`, a pipe): the
        // report goes beside it, never into it.
        let _ = writeln!(std::io::stderr(), "{line}");
        return Ok(());
    }
    outln!("{line}")
}
