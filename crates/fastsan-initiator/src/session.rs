//! A session: one opened volume over N connections.
//!
//! Each request picks the live connection with the most free credits (least
//! loaded), waits for a credit there (never more in flight than the target's
//! queue depth), gets a tag and is queued to that connection's sender. I/O
//! larger than the target's maximum transfer is split and run in parallel.
//! A lost connection fails its in-flight requests with a retryable error and
//! is re-established in the background under the same session id.

use crate::conn::{Conn, Limits, Pending, Submit};
use crate::handshake::Handshake;
use crate::stats::{InitiatorStats, Stats};
use crate::{BrpUrl, Error, Options};
use bytes::{Bytes, BytesMut};
use fastsan_brp::request::{RequestHeader, FLAG_FUA};
use fastsan_brp::{Command, OpenInfo, VolumeInfo};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit};
use tracing::{info, warn};

struct Shared {
    url: BrpUrl,
    opts: Options,
    info: OpenInfo,
    slots: Vec<RwLock<Option<Arc<Conn>>>>,
    next_tag: AtomicU64,
    stats: Arc<Stats>,
    /// Woken when a connection comes back.
    changed: Notify,
}

/// An opened volume. Cloning is cheap and shares the session.
#[derive(Clone)]
pub struct Volume {
    shared: Arc<Shared>,
}

/// Lists the volumes of the target at `url` (its volume part is ignored).
pub async fn list(url: &str, opts: &Options) -> Result<Vec<VolumeInfo>, Error> {
    let url = BrpUrl::parse(url)?;
    Handshake::start(&url.endpoint, opts).await?.list().await
}

impl Volume {
    /// Opens `brp://HOST:PORT/VOLUME` or `brp+unix:///VOLUME?socket=PATH`
    /// with `opts.connections` connections.
    pub async fn connect(url: &str, opts: Options) -> Result<Volume, Error> {
        let url = BrpUrl::parse(url)?;
        if url.volume.is_empty() {
            return Err(Error::InvalidArgument(format!("{url} names no volume")));
        }
        if opts.connections == 0 || opts.connections > 256 {
            return Err(Error::InvalidArgument("connections must be 1..=256".into()));
        }
        let (hs, info) = open_handshake(&url, &opts, 0).await?;
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let stats = Arc::new(Stats::default());
            let first = start_conn(weak, 0, hs, &info, &opts, &stats);
            let mut slots = vec![RwLock::new(Some(Arc::new(first)))];
            slots.extend((1..opts.connections).map(|_| RwLock::new(None)));
            Shared { url, opts, info, slots, next_tag: AtomicU64::new(1), stats, changed: Notify::new() }
        });
        for i in 1..shared.opts.connections {
            let conn = open_conn(&shared, i).await?;
            *shared.slots[i].write() = Some(Arc::new(conn));
        }
        info!(url = %shared.url, size = info.size, connections = shared.opts.connections,
              merge = ?shared.opts.merge, session = format_args!("{:016x}", info.session), "volume open");
        Ok(Volume { shared })
    }

    pub fn info(&self) -> &OpenInfo {
        &self.shared.info
    }
    pub fn size(&self) -> u64 {
        self.shared.info.size
    }
    pub fn block_size(&self) -> u32 {
        self.shared.info.block_size
    }
    pub fn read_only(&self) -> bool {
        self.shared.info.read_only()
    }

    pub fn stats(&self) -> InitiatorStats {
        self.shared.stats.snapshot()
    }

    /// Reads `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        let max = self.shared.info.max_transfer as u64;
        if len <= max {
            let h = RequestHeader::new(Command::Read, 0, 0, offset, to_u32(len)?);
            let data = self.call(h, Bytes::new()).await?.unwrap_or_default();
            if data.len() as u64 != len {
                return Err(Error::ShortRead { asked: len, got: data.len() as u64 });
            }
            return Ok(data);
        }
        let parts =
            futures::future::try_join_all(chunks(offset, len, max).map(|(o, n)| self.read(o, n))).await?;
        let mut out = BytesMut::with_capacity(len as usize);
        for p in parts {
            out.extend_from_slice(&p);
        }
        Ok(out.freeze())
    }

    /// Reads exactly `buf.len()` bytes at `offset` into `buf`.
    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        let data = self.read(offset, buf.len() as u64).await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`; with `fua` it is durable when this returns.
    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }

    /// As [`Volume::write_at`], without copying the data.
    pub async fn write_bytes(&self, data: Bytes, offset: u64, fua: bool) -> Result<(), Error> {
        let max = self.shared.info.max_transfer as u64;
        let flags = if fua { FLAG_FUA } else { 0 };
        if data.len() as u64 <= max {
            let h = RequestHeader::new(Command::Write, flags, 0, offset, to_u32(data.len() as u64)?);
            return self.call(h, data).await.map(drop);
        }
        futures::future::try_join_all(chunks(offset, data.len() as u64, max).map(|(o, n)| {
            let at = (o - offset) as usize;
            self.write_bytes(data.slice(at..at + n as usize), o, fua)
        }))
        .await
        .map(drop)
    }

    /// Makes every write completed before this call durable.
    pub async fn flush(&self) -> Result<(), Error> {
        self.call(RequestHeader::new(Command::Flush, 0, 0, 0, 0), Bytes::new()).await.map(drop)
    }

    /// Tells the target the range is no longer needed; it reads as zeros after.
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.ranged(Command::Trim, 0, offset, len).await
    }

    /// Makes the range read as zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        self.ranged(Command::WriteZeroes, if fua { FLAG_FUA } else { 0 }, offset, len).await
    }

    async fn ranged(&self, cmd: Command, flags: u8, offset: u64, len: u64) -> Result<(), Error> {
        // The largest u32 that is a multiple of the block size.
        let max = (u32::MAX / self.block_size() * self.block_size()) as u64;
        futures::future::try_join_all(chunks(offset, len, max).map(|(o, n)| async move {
            let h = RequestHeader::new(cmd, flags, 0, o, n as u32);
            self.call(h, Bytes::new()).await
        }))
        .await
        .map(drop)
    }

    /// Sends one request on the least-loaded live connection and waits for its reply.
    async fn call(&self, mut h: RequestHeader, payload: Bytes) -> Result<Option<Bytes>, Error> {
        let (conn, credit) = self.pick().await?;
        h.tag = self.shared.next_tag.fetch_add(1, Relaxed);
        let (done, reply) = oneshot::channel();
        self.shared.stats.requests.fetch_add(1, Relaxed);
        let s = Submit { header: h, payload, pending: Pending { done, _credit: credit } };
        if conn.submit(s).is_err() {
            return Err(Error::ConnectionLost);
        }
        reply.await.unwrap_or(Err(Error::ConnectionLost))
    }

    async fn pick(&self) -> Result<(Arc<Conn>, OwnedSemaphorePermit), Error> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.opts.reconnect_timeout;
        loop {
            let changed = sh.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let best = sh
                .slots
                .iter()
                .filter_map(|s| s.read().clone())
                .filter(|c| c.is_alive())
                .max_by_key(|c| c.credits.available_permits());
            if let Some(c) = best {
                match c.credits.clone().acquire_owned().await {
                    Ok(permit) => return Ok((c, permit)),
                    Err(_) => continue, // it died while we waited: pick again
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::ConnectionLost);
            }
            let _ = tokio::time::timeout(left, changed).await;
        }
    }
}

fn to_u32(n: u64) -> Result<u32, Error> {
    u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("length {n} too large")))
}

/// Cuts `[offset, offset + len)` into pieces of at most `max` bytes.
fn chunks(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |i| {
        let o = i * max;
        (offset + o, max.min(len - o))
    })
}

fn start_conn(
    shared: &Weak<Shared>,
    slot: usize,
    hs: Handshake,
    info: &OpenInfo,
    opts: &Options,
    stats: &Arc<Stats>,
) -> Conn {
    let limits = Limits {
        mode: opts.merge,
        max_batch: info.max_batch.max(1) as usize,
        merge_max_request: opts.merge_max_request,
        queue_depth: info.queue_depth,
        merge_max_bytes: opts.merge_max_bytes.min(fastsan_brp::limits::MAX_PAYLOAD / 2),
    };
    let weak = shared.clone();
    let on_dead = Box::new(move || {
        if let Some(sh) = weak.upgrade() {
            if !sh.opts.reconnect_timeout.is_zero() {
                tokio::spawn(reconnect(Arc::downgrade(&sh), slot));
            }
        }
    });
    Conn::start(hs, info.queue_depth, limits, stats.clone(), on_dead)
}

async fn open_conn(sh: &Arc<Shared>, slot: usize) -> Result<Conn, Error> {
    let (hs, info) = open_handshake(&sh.url, &sh.opts, sh.info.session).await?;
    if info.size != sh.info.size || info.block_size != sh.info.block_size {
        return Err(Error::VolumeChanged {
            old_size: sh.info.size,
            new_size: info.size,
            old_block_size: sh.info.block_size,
            new_block_size: info.block_size,
        });
    }
    Ok(start_conn(&Arc::downgrade(sh), slot, hs, &info, &sh.opts, &sh.stats))
}

/// Connects and opens the URL's volume, all within the connect timeout.
async fn open_handshake(url: &BrpUrl, opts: &Options, session: u64) -> Result<(Handshake, OpenInfo), Error> {
    let work = async {
        let mut hs = Handshake::start(&url.endpoint, opts).await?;
        let info = hs.open(&url.volume, session).await?;
        Ok((hs, info))
    };
    tokio::time::timeout(opts.connect_timeout, work).await.map_err(|_| Error::Timeout("handshake"))?
}

/// Re-opens connection `slot` until it works or the volume is dropped.
async fn reconnect(weak: Weak<Shared>, slot: usize) {
    let mut backoff = Duration::from_millis(20);
    loop {
        tokio::time::sleep(backoff).await;
        let Some(sh) = weak.upgrade() else { return };
        match open_conn(&sh, slot).await {
            Ok(conn) => {
                *sh.slots[slot].write() = Some(Arc::new(conn));
                sh.stats.reconnects.fetch_add(1, Relaxed);
                sh.changed.notify_waiters();
                info!(url = %sh.url, slot, "connection re-established");
                return;
            }
            Err(e) => {
                warn!(url = %sh.url, slot, error = &e as &dyn std::error::Error, "reconnect failed; will retry");
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}
