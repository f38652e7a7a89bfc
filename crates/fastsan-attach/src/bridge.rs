//! The bridge: fastsan is the NBD server of the kernel's NBD client, on one
//! end of a local socket pair per queue. Every request the kernel sends goes
//! to the volume ([`Remote`]: over BRP, the initiator merging into BATCH frames, several
//! connections, credits, retries after the fence) and is answered by its
//! cookie as soon as it completes, in any order.
//!
//! The kernel speaks the transmission phase only (no handshake: the size and
//! flags were given when the device was configured) with simple replies.
//! - **decode**: [`fastsan_nbd::transmission::parse_request`], in [`serve`];
//! - **execute**: `execute`, one task per request, at most
//!   [`MAX_IN_FLIGHT`] at once per queue;
//! - **reply**: one writer task per queue, `write_replies`, which sends
//!   every reply that is ready in one vectored write.

use crate::errno;
use crate::Remote;
use bytes::{Buf, Bytes, BytesMut};
use fastsan_initiator::Error;
use fastsan_nbd::consts::*;
use fastsan_nbd::transmission::{parse_request, simple_reply, Payload, Request, REQUEST_LEN};
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use tracing::{debug, warn};

/// Requests of one socket executing at once: as many as the kernel can have
/// in flight on a whole device (128 per queue, at most 16 queues), since it
/// sends a dead queue's requests to a live socket. So the reader never waits
/// here in practice; it bounds what a misbehaving peer can start. It must
/// not wait: a write left unread in the socket is not yet in the session's
/// write order, and if the kernel gives up on the socket meanwhile and sends
/// the write again elsewhere, the stale one read later would land after it,
/// and after whatever the kernel wrote there since.
pub const MAX_IN_FLIGHT: usize = 128 * 16;

/// What the bridges of one device have done.
#[derive(Debug, Default)]
pub struct BridgeStats {
    /// Requests of the kernel received.
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    /// Replies written back to the kernel: `requests - replies` are in
    /// flight (`attach --list` shows them; a number that stays up while
    /// nothing moves is a stuck request, and says on which side).
    pub replies: AtomicU64,
}

impl BridgeStats {
    /// Requests received and not yet answered.
    pub fn in_flight(&self) -> u64 {
        // Replies first: a request counted between the two loads is in flight.
        let replies = self.replies.load(Relaxed);
        self.requests.load(Relaxed).saturating_sub(replies)
    }
}

/// One reply: its 16-byte header, and a READ's data. Counted as answered
/// (`replies`) when it is dropped: once written, or when it cannot be
/// (the socket failed, the writer ended), exactly once either way.
struct Reply {
    head: [u8; 16],
    data: Bytes,
    stats: Arc<BridgeStats>,
}

impl Reply {
    /// A simple reply: `error` (0 or an errno), and a READ's data.
    fn new(error: i32, cookie: u64, data: Bytes, stats: &Arc<BridgeStats>) -> Reply {
        Reply { head: simple_reply(error as u32, cookie), data, stats: stats.clone() }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        self.stats.replies.fetch_add(1, Relaxed);
    }
}

/// How a bridge's reading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// NBD_CMD_DISC: the device is being disconnected.
    Disconnect,
    /// The socket closed or failed without NBD_CMD_DISC: the kernel gave up
    /// on this queue (a request past the device's timeout shuts its socket),
    /// after `received` requests.
    Closed { received: u64 },
}

/// Serves the kernel's requests arriving on `stream` until the kernel
/// disconnects (NBD_CMD_DISC, or the socket closes), then waits for every
/// request already started to be answered.
pub async fn serve<S>(stream: S, vol: Remote, stats: Arc<BridgeStats>) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    serve_with(stream, vol, stats, |_| {}).await
}

/// [`serve`], telling `ended` how the reading ended as soon as it does:
/// NBD_CMD_DISC, or the socket closing or failing without it (the kernel
/// gave up on the queue); the requests already started are answered after
/// that (into the void if the socket is gone), while the caller may give
/// the kernel a new socket.
pub async fn serve_with<S>(
    stream: S,
    vol: Remote,
    stats: Arc<BridgeStats>,
    ended: impl FnOnce(End),
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, wr) = tokio::io::split(stream);
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let writer = tokio::spawn(write_replies(wr, rx));
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut buf = BytesMut::with_capacity(256 * 1024);
    let mut skip = 0u64;
    let size = vol.size();
    let mut received = 0u64;
    let read = loop {
        if skip > 0 {
            let n = skip.min(buf.len() as u64);
            buf.advance(n as usize);
            skip -= n;
        }
        let parsed = match skip {
            0 => parse_request(&buf),
            _ => Ok(None),
        };
        let (req, payload, used) = match parsed {
            Ok(Some(p)) => p,
            Ok(None) => {
                if buf.capacity() - buf.len() < 64 * 1024 {
                    buf.reserve(256 * 1024);
                }
                match rd.read_buf(&mut buf).await {
                    Ok(0) => {
                        // Without NBD_CMD_DISC first: the kernel gave up on this
                        // queue (a request past the device's timeout shuts its
                        // socket), or it is going away. Said when it happens.
                        warn!(unread = buf.len(), "the kernel closed this queue without a disconnect");
                        break Ok(());
                    }
                    Ok(_) => continue,
                    Err(e) => break Err(e),
                }
            }
            Err(e) => break Err(io::Error::new(io::ErrorKind::InvalidData, e)),
        };
        let frame = buf.split_to(used).freeze();
        if req.command == CMD_DISC {
            debug!("the kernel disconnected");
            ended(End::Disconnect);
            return finish(tx, writer, slots, Ok(())).await;
        }
        stats.requests.fetch_add(1, Relaxed);
        received += 1;
        if let Payload::Skip(n) = payload {
            // Larger than any WRITE the kernel sends: refused, its data discarded.
            skip = n as u64;
            stats.errors.fetch_add(1, Relaxed);
            reply(&tx, Reply::new(libc::EINVAL, req.cookie, Bytes::new(), &stats));
            continue;
        }
        if let Some(code) = refuse(&req, size) {
            stats.errors.fetch_add(1, Relaxed);
            reply(&tx, Reply::new(code, req.cookie, Bytes::new(), &stats));
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else { break Ok(()) };
        let (vol, tx, stats) = (vol.clone(), tx.clone(), stats.clone());
        tokio::spawn(async move {
            let reply = match execute(&vol, &req, frame.slice(REQUEST_LEN..)).await {
                Ok(data) => Reply::new(0, req.cookie, data, &stats),
                Err(e) => {
                    stats.errors.fetch_add(1, Relaxed);
                    // NBD's codes: EPERM for a read-only device.
                    let code = match errno(&e) {
                        libc::EROFS => libc::EPERM,
                        c => c,
                    };
                    warn!(
                        error = &e as &dyn std::error::Error,
                        command = req.command,
                        offset = req.offset,
                        length = req.length,
                        "a request of the kernel failed"
                    );
                    Reply::new(code, req.cookie, Bytes::new(), &stats)
                }
            };
            self::reply(&tx, reply);
            drop(permit);
        });
    };
    if let Err(e) = &read {
        warn!(error = e as &dyn std::error::Error, "this queue of the device failed");
    }
    ended(End::Closed { received });
    finish(tx, writer, slots, read).await
}

/// The end of [`serve_with`], its reading done with `read`: waits for every
/// request started to be answered, then for the writer.
async fn finish(
    tx: mpsc::UnboundedSender<Reply>,
    writer: tokio::task::JoinHandle<io::Result<()>>,
    slots: Arc<Semaphore>,
    read: io::Result<()>,
) -> io::Result<()> {
    // Every request started is answered (or its answer fails to send)
    // before this returns; then the writer ends after the last reply.
    let _all = slots.acquire_many(MAX_IN_FLIGHT as u32).await;
    drop(tx);
    let written = writer.await.map_err(io::Error::other)?;
    read.and(written)
}

/// Hands a reply to the writer; one that cannot go (the writer ended: the
/// socket failed) is dropped, answered into the void.
fn reply(tx: &mpsc::UnboundedSender<Reply>, r: Reply) {
    let _ = tx.send(r);
}

/// The largest READ served: twice what the kernel ever asks (its NBD driver
/// sends at most 32 MiB), as much as a WRITE may carry.
const MAX_READ: u32 = fastsan_nbd::MAX_PAYLOAD;

/// The errno for a request no volume could serve: past the end (or an
/// offset that overflows), or a READ too large to hold.
fn refuse(r: &Request, size: u64) -> Option<i32> {
    if !matches!(r.command, CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
        return None;
    }
    if r.command == CMD_READ && r.length > MAX_READ {
        return Some(libc::EINVAL);
    }
    match r.offset.checked_add(r.length as u64) {
        Some(end) if end <= size => None,
        _ => Some(libc::ENOSPC),
    }
}

/// One request, through the initiator. A READ returns its data.
async fn execute(vol: &Remote, r: &Request, data: Bytes) -> Result<Bytes, Error> {
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let (offset, len) = (r.offset, r.length as u64);
    match r.command {
        CMD_READ => vol.read(offset, len).await,
        CMD_WRITE => vol.write_bytes(data, offset, fua).await.map(|()| Bytes::new()),
        CMD_FLUSH => vol.flush().await.map(|()| Bytes::new()),
        CMD_TRIM => vol.trim(offset, len).await.map(|()| Bytes::new()),
        CMD_WRITE_ZEROES => vol.write_zeroes(offset, len, fua).await.map(|()| Bytes::new()),
        // Not advertised to the kernel (CACHE, BLOCK_STATUS) or unknown.
        _ => Err(Error::InvalidArgument(format!("NBD command {} is not served here", r.command))),
    }
}

/// Sends replies as they come, every one that is ready in one write. Each
/// is dropped (counted as answered) once written; once the socket fails,
/// those left go with the channel, answered into the void (the kernel sent
/// their requests again elsewhere): none stays counted in flight.
async fn write_replies<W: AsyncWrite>(wr: W, mut rx: mpsc::UnboundedReceiver<Reply>) -> io::Result<()> {
    tokio::pin!(wr);
    let mut out: VecDeque<Bytes> = VecDeque::new();
    let mut batch: Vec<Reply> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(r) = next {
            out.push_back(Bytes::copy_from_slice(&r.head));
            if !r.data.is_empty() {
                out.push_back(r.data.clone());
            }
            batch.push(r);
            next = if out.len() < 128 { rx.try_recv().ok() } else { None };
        }
        write_out(wr.as_mut(), &mut out).await?;
        batch.clear();
    }
    wr.shutdown().await
}

/// Writes all of `out`, a vectored write at a time.
async fn write_out<W: AsyncWrite>(
    mut wr: std::pin::Pin<&mut W>,
    out: &mut VecDeque<Bytes>,
) -> io::Result<()> {
    while !out.is_empty() {
        let slices: Vec<IoSlice> = out.iter().take(64).map(|b| IoSlice::new(b)).collect();
        let mut n = wr.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let front = out.front_mut().expect("written bytes were queued");
            if n >= front.len() {
                n -= front.len();
                out.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }
    Ok(())
}
