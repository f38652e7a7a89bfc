//! `fastsan cp`: copy between a local file and a volume, in either direction
//! (or between two volumes), many chunks in flight, with a progress bar.
//! Retries and the padding of a partial last block are the initiator's
//! ([`fastsan_initiator::copy`]).

use crate::ClientArgs;
use anyhow::{bail, Context};
use bytes::{Bytes, BytesMut};
use fastsan_initiator::{copy, Remote};
use fastsan_target::config::parse_size;
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Copy a local file into a volume, a volume into a local file, or a volume
/// into another volume (between two local files, use cp).
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
    Local(Arc<File>, PathBuf),
    Vol(Remote, String),
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
/// files (that is cp(1)'s job; a file copied onto itself would be
/// truncated before it is read) and from a volume onto itself.
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
        let f = if dst {
            OpenOptions::new().write(true).create(true).truncate(true).open(&path)
        } else {
            File::open(&path)
        };
        let f = f.with_context(|| format!("opening {}", path.display()))?;
        Ok(End::Local(Arc::new(f), path))
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

    fn len(&self) -> anyhow::Result<u64> {
        Ok(match self {
            End::Local(f, _) => f.metadata()?.len(),
            End::Vol(v, _) => v.size(),
        })
    }

    async fn read(&self, off: u64, n: u64) -> anyhow::Result<Bytes> {
        match self {
            End::Vol(v, _) => Ok(copy::read(v, off, n).await?),
            End::Local(f, _) => {
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
            End::Local(f, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || f.write_all_at(&data, off)).await??;
                Ok(())
            }
        }
    }

    async fn finish(&self, len: u64) -> anyhow::Result<()> {
        match self {
            End::Vol(v, _) => Ok(copy::finish(v).await?),
            End::Local(f, _) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || {
                    f.set_len(len)?;
                    f.sync_all()
                })
                .await??;
                Ok(())
            }
        }
    }

    fn name(&self) -> String {
        match self {
            End::Local(_, p) => p.display().to_string(),
            End::Vol(_, u) => u.clone(),
        }
    }
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let chunk = parse_size(&a.chunk)?;
    if chunk == 0 || chunk > 64 << 20 {
        bail!("--chunk must be between 1 byte and 64 MiB");
    }
    if a.depth == 0 || a.depth > 4096 {
        bail!("--depth must be 1..=4096");
    }
    check_ends(&a.src, &a.dst)?;
    let src = End::open(&a.src, false, &a.client).await?;
    src.check_chunk(chunk)?;
    let len = src.len()?;
    // (Checked before a local destination is opened, which truncates it.)
    let dst = End::open(&a.dst, true, &a.client).await?;
    dst.check_chunk(chunk)?;
    if let End::Vol(v, u) = &dst {
        if len > v.size() {
            bail!("{} has {len} bytes; {u} holds only {}", src.name(), v.size());
        }
    }
    let pb = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    let start = Instant::now();
    let (src, dst) = (&src, &dst);
    futures::stream::iter((0..len.div_ceil(chunk)).map(|i| {
        let off = i * chunk;
        (off, chunk.min(len - off))
    }))
    .map(|(off, n)| {
        let pb = pb.clone();
        async move {
            let data = src.read(off, n).await.with_context(|| format!("reading {} at {off}", src.name()))?;
            dst.write(off, data).await.with_context(|| format!("writing {} at {off}", dst.name()))?;
            pb.inc(n);
            anyhow::Ok(())
        }
    })
    .buffer_unordered(a.depth)
    .try_collect::<()>()
    .await?;
    dst.finish(len).await?;
    pb.finish_and_clear();
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
