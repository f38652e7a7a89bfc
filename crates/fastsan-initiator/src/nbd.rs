//! A volume on any NBD server (nbdkit, qemu-nbd, nbd-server, fastsan's own
//! NBD front end): `nbd://HOST[:PORT]/EXPORT`. Fixed newstyle, OPT_GO (size,
//! transmission flags, block sizes), simple replies, many requests in flight
//! on one connection, each request sent as one frame (as libnbd does, so a
//! benchmark loads a server the way fio's nbd engine does).
//!
//! What the server cannot do is done here or refused: FUA without
//! SEND_FUA is a write then a flush; WRITE_ZEROES without its flag writes
//! zeros; TRIM without its flag is UNSUPPORTED; reads and writes above the
//! server's maximum are split.
//!
//! No reconnection: NBD has no fence (nothing tells when a lost
//! connection's writes have all landed), so resending a write could let an
//! older one land after a newer one. A request whose connection is lost
//! fails with [`Error::Lost`], which says why, as with `nbd-client`; so
//! does one without a reply within the request timeout (the connection is
//! then cut, since nobody can tell whether it landed).
//!
//! Frames go out through one writer task, whole: a caller that gives up (a
//! dropped future) never leaves half a request on the wire. A request split
//! in pieces reports its outcome only once every piece is answered, so no
//! piece of a write reported failed lands after the report.

use crate::error::Cause;
use crate::overdue::{is_overdue, overdue, Clock, Ticker};
use crate::recycle::{Recycler, LARGE_REPLY};
use crate::session::{all, chunks, read_pieces};
use crate::{Error, Options, Status, VolumeInfo};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{encode_option, InfoRequest};
use fastsan_nbd::transmission::{Request, SIMPLE_REPLY_LEN};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// The most one request carries when the server names no maximum (the
/// NBD spec's safe default).
const DEFAULT_MAX: u32 = 32 << 20;
/// The largest minimum block size the NBD spec allows.
const MAX_MIN_BLOCK: u32 = 64 << 10;
/// Zeros written by WRITE_ZEROES on a server without it, a piece at a time.
const ZERO_PIECE: usize = 1 << 20;

/// A request's reply length, the tick it was sent at ([`Clock`]), and its caller.
type Waiter = (usize, u32, oneshot::Sender<Result<Bytes, Error>>);
type Pending = Arc<Mutex<HashMap<u64, Waiter>>>;

pub struct NbdVolume {
    url: String,
    /// Whole frames to the writer task; `None` asks it to cut the connection.
    frames: mpsc::UnboundedSender<Option<Bytes>>,
    pending: Pending,
    next: AtomicU64,
    /// False once the connection ended.
    up: Arc<AtomicBool>,
    /// Why it ended, for the requests that fail.
    cause: Arc<Cause>,
    /// Its request clock: the reader cuts the connection when a request
    /// waits past the request timeout ([`crate::overdue`]).
    clock: Arc<Clock>,
    size: u64,
    flags: u16,
    block: u32,
    max: u32,
    zeros: Bytes,
}

impl Drop for NbdVolume {
    /// A polite end: NBD_CMD_DISC after whatever is queued (the server
    /// answers what it has and closes, instead of finding a client gone
    /// mid-stream); then the writer, its channel closed, shuts the socket.
    fn drop(&mut self) {
        if self.up.load(Acquire) {
            let cookie = self.next.fetch_add(1, Relaxed);
            let disc = Request { flags: 0, command: CMD_DISC, cookie, offset: 0, length: 0 }.encode();
            let _ = self.frames.send(Some(Bytes::copy_from_slice(&disc)));
        }
    }
}

fn bad(msg: String) -> Error {
    Error::Nbd(msg)
}

/// Splits `nbd://HOST[:PORT]/EXPORT` into the address and the export name.
pub fn parse_url(url: &str) -> Result<(String, String), Error> {
    let rest = url
        .strip_prefix("nbd://")
        .ok_or_else(|| Error::Url(format!("{url}: expected nbd://HOST:PORT/EXPORT")))?;
    let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(Error::Url(format!("{url}: no host")));
    }
    let host = if host.contains(':') { host.to_owned() } else { format!("{host}:10809") };
    Ok((host, export.to_owned()))
}

/// What an NBD error code means to a caller.
fn status_of(errno: u32) -> Status {
    match errno as i32 {
        libc::EPERM | libc::EROFS => Status::READ_ONLY,
        libc::ENOSPC => Status::NO_SPACE,
        libc::EINVAL | libc::EOVERFLOW => Status::INVALID,
        libc::ENOTSUP => Status::UNSUPPORTED,
        libc::ESHUTDOWN => Status::SHUTTING_DOWN,
        _ => Status::IO_ERROR,
    }
}

/// Connects to the NBD server at `addr` and does the fixed-newstyle
/// greeting: the connection, ready for options.
async fn greet(addr: &str) -> Result<TcpStream, Error> {
    let mut s =
        TcpStream::connect(addr).await.map_err(|source| Error::Connect { addr: addr.to_owned(), source })?;
    s.set_nodelay(true)?;
    socket2::SockRef::from(&s).set_keepalive(true)?;
    let mut greet = [0u8; 18];
    s.read_exact(&mut greet).await?;
    if greet[..8] != NBDMAGIC.to_be_bytes() || greet[8..16] != IHAVEOPT.to_be_bytes() {
        return Err(bad(format!("{addr} is not a newstyle NBD server")));
    }
    let server = u16::from_be_bytes([greet[16], greet[17]]);
    if server & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad(format!("{addr} does not speak fixed newstyle NBD (a server older than 2012)")));
    }
    // NO_ZEROES only if offered: a server that does not know it must close.
    let ours = FLAG_C_FIXED_NEWSTYLE | if server & FLAG_NO_ZEROES != 0 { FLAG_C_NO_ZEROES } else { 0 };
    s.write_all(&ours.to_be_bytes()).await?;
    Ok(s)
}

/// One option reply: its type and data (at most 64 KiB, as the NBD spec's
/// replies are).
async fn option_reply(s: &mut TcpStream, addr: &str, option: u32) -> Result<(u32, Vec<u8>), Error> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).await?;
    if h[..8] != REPLY_MAGIC.to_be_bytes() || h[8..12] != option.to_be_bytes() {
        return Err(bad(format!("{addr} sent a malformed option reply")));
    }
    let kind = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes")) as usize;
    if len > 1 << 16 {
        return Err(bad(format!("an option reply of {len} bytes")));
    }
    let mut d = vec![0u8; len];
    s.read_exact(&mut d).await?;
    Ok((kind, d))
}

/// What an option's error reply means.
fn option_error(addr: &str, export: &str, kind: u32, d: &[u8]) -> Error {
    // The server's words, as text a terminal shows as it is: control
    // characters escaped, at most 4096 bytes (the spec's longest string).
    let why: String = String::from_utf8_lossy(&d[..d.len().min(4096)]).escape_default().collect();
    match kind {
        REP_ERR_UNKNOWN => {
            Error::Refused { status: Status::NO_SUCH_VOLUME, message: format!("export {export:?}: {why}") }
        }
        REP_ERR_UNSUP => bad(format!("{addr} does not know OPT_GO (a server older than 2016)")),
        REP_ERR_TLS_REQD => bad(format!("{addr} requires TLS, which this client does not speak")),
        e => bad(format!("export {export:?} refused (NBD reply {e:#x}): {why}")),
    }
}

/// What [`info`] learns of an export: its size, transmission flags and, if
/// the server gives them, its minimum, preferred and maximum block sizes.
type ExportInfo = (u64, u16, Option<(u32, u32, u32)>);

/// Asks for `export`'s information with `option` (OPT_INFO, or OPT_GO to
/// start using it). The inner error is the server's refusal of this
/// export (an error reply: its kind and text), after which the connection
/// may go on with other options; the outer one ends the connection.
async fn info(
    s: &mut TcpStream,
    addr: &str,
    option: u32,
    export: &str,
) -> Result<Result<ExportInfo, (u32, Vec<u8>)>, Error> {
    let mut opt = Vec::new();
    let go = InfoRequest { name: export.to_owned(), infos: vec![INFO_BLOCK_SIZE] };
    encode_option(option, &go.encode(), &mut opt);
    s.write_all(&opt).await?;
    let (mut export_info, mut sizes) = (None, None);
    loop {
        let (kind, d) = option_reply(s, addr, option).await?;
        let be32 = |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().expect("4 bytes"));
        match kind {
            REP_INFO if d.len() >= 12 && d[..2] == INFO_EXPORT.to_be_bytes() => {
                let size = u64::from_be_bytes(d[2..10].try_into().expect("8 bytes"));
                export_info = Some((size, u16::from_be_bytes([d[10], d[11]])));
            }
            REP_INFO if d.len() >= 14 && d[..2] == INFO_BLOCK_SIZE.to_be_bytes() => {
                sizes = Some((be32(2), be32(6), be32(10)));
            }
            REP_INFO => {}
            REP_ACK => break,
            e if e & REP_FLAG_ERROR != 0 => return Ok(Err((e, d.to_vec()))),
            e => return Err(option_error(addr, export, e, &d)),
        }
    }
    let (size, flags) = export_info.ok_or_else(|| bad("no NBD_INFO_EXPORT in the reply to OPT_GO".into()))?;
    Ok(Ok((size, flags, sizes)))
}

/// Most exports [`list`] takes from one server.
const MAX_LISTED: usize = 4096;
/// The smallest maximum block size an export may have here.
const MIN_MAX_BLOCK: u32 = 4096;

/// Lists the exports of the NBD server at `url`, with their sizes
/// (OPT_LIST, then OPT_INFO for each), or the one export the URL names
/// (from a server that does not list its exports, too). Of the options,
/// the connect timeout applies.
pub async fn list(url: &str, opts: &Options) -> Result<Vec<VolumeInfo>, Error> {
    let work = async {
        let (addr, export) = parse_url(url)?;
        let mut s = greet(&addr).await?;
        // nbd://HOST:PORT lists them all; nbd://HOST:PORT/ names the default export.
        let named = url.strip_prefix("nbd://").is_some_and(|r| r.contains('/'));
        let names = if named {
            vec![export]
        } else {
            let mut opt = Vec::new();
            encode_option(OPT_LIST, &[], &mut opt);
            s.write_all(&opt).await?;
            let mut names = Vec::new();
            loop {
                match option_reply(&mut s, &addr, OPT_LIST).await? {
                    (REP_SERVER, _) if names.len() >= MAX_LISTED => {
                        return Err(bad(format!("{addr} lists more than {MAX_LISTED} exports")))
                    }
                    (REP_SERVER, d) if d.len() >= 4 => {
                        let n = u32::from_be_bytes(d[..4].try_into().expect("4 bytes")) as usize;
                        // The spec's strings are at most 4096 bytes.
                        let name = d
                            .get(4..4 + n)
                            .filter(|_| n <= 4096)
                            .ok_or_else(|| bad(format!("{addr} sent a malformed export name")))?;
                        names.push(String::from_utf8_lossy(name).into_owned());
                    }
                    (REP_ACK, _) => break,
                    (REP_ERR_POLICY | REP_ERR_UNSUP, _) => {
                        return Err(bad(format!(
                            "{addr} does not list its exports: name one (nbd://{addr}/EXPORT)"
                        )))
                    }
                    (kind, d) => return Err(option_error(&addr, "", kind, &d)),
                }
            }
            names
        };
        let mut all = Vec::with_capacity(names.len());
        for name in names {
            // One export the server will not describe (a TLS-only export of
            // a server that offers TLS to some, one this client may not
            // see) is listed as such, and the others shown; until
            // 2026-12-07 it failed the whole listing.
            let (size, flags, sizes) = match info(&mut s, &addr, OPT_INFO, &name).await? {
                Ok(i) => i,
                // The one export the URL names: its refusal is the answer.
                Err((kind, d)) if named => return Err(option_error(&addr, &name, kind, &d)),
                Err((kind, d)) => {
                    let e = option_error(&addr, &name, kind, &d);
                    tracing::warn!(export = name, "{e}");
                    all.push(VolumeInfo { name, size: 0, block_size: 0, flags: crate::VOLUME_UNREADABLE });
                    continue;
                }
            };
            let mut volume_flags = 0;
            if flags & TFLAG_READ_ONLY != 0 {
                volume_flags |= crate::VOLUME_READ_ONLY;
            }
            // The preferred size: the minimum of a server that takes any
            // byte range (fastsan's, nbdkit's) is 1.
            let block_size = sizes.map_or(1, |(_, preferred, _)| preferred);
            all.push(VolumeInfo { name, size, block_size, flags: volume_flags });
        }
        let mut opt = Vec::new();
        encode_option(OPT_ABORT, &[], &mut opt);
        // (The server's answer to ABORT, if any, is of no use.)
        let _ = s.write_all(&opt).await;
        Ok(all)
    };
    tokio::time::timeout(opts.connect_timeout, work).await.map_err(|_| Error::Timeout("NBD handshake"))?
}

impl NbdVolume {
    /// Opens the export (the handshake up to OPT_GO, within the connect
    /// timeout), then starts the reader and writer tasks. Of the options,
    /// the connect and request timeouts apply.
    pub async fn connect(url: &str, opts: &Options) -> Result<NbdVolume, Error> {
        let work = Self::open(url, opts.request_timeout);
        tokio::time::timeout(opts.connect_timeout, work).await.map_err(|_| Error::Timeout("NBD handshake"))?
    }

    async fn open(url: &str, request_timeout: Duration) -> Result<NbdVolume, Error> {
        let (addr, export) = parse_url(url)?;
        let mut s = greet(&addr).await?;
        let (size, flags, sizes) = info(&mut s, &addr, OPT_GO, &export)
            .await?
            .map_err(|(kind, d)| option_error(&addr, &export, kind, &d))?;
        let (block, _, max) = sizes.unwrap_or((1, 1, DEFAULT_MAX));
        if !block.is_power_of_two() || block > MAX_MIN_BLOCK || max < block {
            return Err(bad(format!("impossible block sizes: minimum {block}, maximum {max}")));
        }
        if size > i64::MAX as u64 {
            return Err(bad(format!("an export of {size} bytes (more than a file or a device can hold)")));
        }
        if max < MIN_MAX_BLOCK {
            // Every large read or write would be split into thousands of
            // requests, all in flight at once.
            return Err(bad(format!(
                "a maximum block size of {max} bytes (less than {MIN_MAX_BLOCK}): not served through this client"
            )));
        }
        let max = max.min(fastsan_nbd::MAX_PAYLOAD) / block * block;
        let (rd, wr) = s.into_split();
        let pending: Pending = Arc::default();
        let up = Arc::new(AtomicBool::new(true));
        let cause = Arc::new(Cause::default());
        let clock = Arc::new(Clock::default());
        let (frames, rx) = mpsc::unbounded_channel();
        let reader = Reader {
            url: url.to_owned(),
            pending: pending.clone(),
            up: up.clone(),
            cause: cause.clone(),
            clock: clock.clone(),
            timeout: request_timeout,
        };
        tokio::spawn(read_replies(rd, reader, frames.downgrade()));
        let (p, u) = (pending.clone(), up.clone());
        let c = cause.clone();
        tokio::spawn(async move { crate::writer::run(wr, rx, &u, &c, || p.lock().len()).await });
        Ok(NbdVolume {
            url: url.to_owned(),
            frames,
            pending,
            next: AtomicU64::new(1),
            up,
            cause,
            clock,
            size,
            flags,
            block,
            max,
            zeros: Bytes::from(vec![0u8; ZERO_PIECE]),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    /// Offsets and lengths must be multiples of this.
    pub fn block_size(&self) -> u32 {
        self.block
    }
    pub fn read_only(&self) -> bool {
        self.flags & TFLAG_READ_ONLY != 0
    }
    /// Whether the export takes TRIM.
    pub fn can_trim(&self) -> bool {
        self.flags & TFLAG_SEND_TRIM != 0
    }
    /// Whether the connection is still up.
    pub fn connected(&self) -> bool {
        self.up.load(Relaxed)
    }
    /// The export's transmission flags.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    async fn call(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<Bytes, Error> {
        let cookie = self.next.fetch_add(1, Relaxed);
        let (tx, rx) = oneshot::channel();
        let reply_len = if command == CMD_READ { length as usize } else { 0 };
        self.pending.lock().insert(cookie, (reply_len, self.clock.now(), tx));
        // After the insert: a reader that ended drained the map after it
        // cleared `up`, so a request it did not fail sees `up` false here.
        if !self.up.load(Acquire) {
            self.pending.lock().remove(&cookie);
            return Err(self.cause.error());
        }
        let h = Request { flags, command, cookie, offset, length }.encode();
        let mut frame = BytesMut::with_capacity(h.len() + payload.len());
        frame.extend_from_slice(&h);
        frame.extend_from_slice(payload);
        if self.frames.send(Some(frame.freeze())).is_err() {
            self.pending.lock().remove(&cookie);
            return Err(self.cause.error());
        }
        // A reply that does not come in time: the reader cuts the
        // connection, and every request on it fails.
        rx.await.map_err(|_| self.cause.error())?
    }

    /// Reads `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        if len <= self.max as u64 {
            return self.call(CMD_READ, 0, offset, len as u32, &[]).await;
        }
        read_pieces(offset, len, self.max as u64, |o, n| self.read(o, n)).await
    }

    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        let data = self.read(offset, buf.len() as u64).await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`; with `fua` it is durable when this returns.
    ///
    /// (An async block, not an async fn: `data` is held once, not twice; and
    /// the rare paths are boxed, so that a one-request write's future is
    /// little more than its request's.)
    #[allow(clippy::manual_async_fn)]
    pub fn write_bytes(
        &self,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + '_ {
        async move {
            self.check(offset, data.len() as u64)?;
            let native = fua && self.flags & TFLAG_SEND_FUA != 0;
            let flags = if native { CMD_FLAG_FUA } else { 0 };
            if data.is_empty() {
                // Nothing to send (as the join of no pieces below).
            } else if data.len() <= self.max as usize {
                // One request: no join of one (an allocation and a future's move per write).
                self.call(CMD_WRITE, flags, offset, data.len() as u32, &data).await?;
            } else {
                Box::pin(all(chunks(offset, data.len() as u64, self.max as u64).map(|(o, n)| {
                    let at = (o - offset) as usize;
                    let piece = data.slice(at..at + n as usize);
                    async move { self.call(CMD_WRITE, flags, o, n as u32, &piece).await }
                })))
                .await?;
            }
            if fua && !native {
                Box::pin(self.flush()).await?;
            }
            Ok(())
        }
    }

    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }

    /// Makes completed writes durable (nothing to do on a server without a cache).
    pub async fn flush(&self) -> Result<(), Error> {
        if self.flags & TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.call(CMD_FLUSH, 0, 0, 0, &[]).await.map(drop)
    }

    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        if !self.can_trim() {
            return Err(Error::Status(Status::UNSUPPORTED));
        }
        self.ranged(CMD_TRIM, 0, offset, len).await
    }

    /// Makes the range read as zeros (writing zeros where the server has no WRITE_ZEROES).
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        let end = offset.checked_add(len).ok_or(Error::Status(Status::OUT_OF_RANGE))?;
        if self.flags & TFLAG_SEND_WRITE_ZEROES == 0 {
            let mut at = offset;
            while at < end {
                let n = (end - at).min(ZERO_PIECE as u64);
                self.write_bytes(self.zeros.slice(..n as usize), at, false).await?;
                at += n;
            }
            return if fua { self.flush().await } else { Ok(()) };
        }
        let native = fua && self.flags & TFLAG_SEND_FUA != 0;
        self.ranged(CMD_WRITE_ZEROES, if native { CMD_FLAG_FUA } else { 0 }, offset, len).await?;
        if fua && !native {
            self.flush().await?;
        }
        Ok(())
    }

    /// TRIM or WRITE_ZEROES, in pieces no larger than the server's maximum.
    /// A range within the export (nothing sent for one beyond it, nor an
    /// offset that would wrap).
    fn check(&self, offset: u64, len: u64) -> Result<(), Error> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::Status(Status::OUT_OF_RANGE)),
        }
    }

    async fn ranged(&self, command: u16, flags: u16, offset: u64, len: u64) -> Result<(), Error> {
        let end = offset.checked_add(len).ok_or(Error::Status(Status::OUT_OF_RANGE))?;
        let mut at = offset;
        while at < end {
            let n = (end - at).min(self.max as u64);
            self.call(command, flags, at, n as u32, &[]).await?;
            at += n;
        }
        Ok(())
    }
}

/// What the reader task shares with the volume.
struct Reader {
    url: String,
    pending: Pending,
    up: Arc<AtomicBool>,
    cause: Arc<Cause>,
    clock: Arc<Clock>,
    timeout: Duration,
}

/// Ends a reader's connection however the reader ends (by a panic too):
/// `up` cleared, and every request still waiting failed with its `cause`.
struct Ending<'a> {
    pending: &'a Pending,
    up: &'a AtomicBool,
    cause: &'a Cause,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.up.store(false, Relaxed);
        for (_, (_, _, tx)) in self.pending.lock().drain() {
            let _ = tx.send(Err(self.cause.error()));
        }
    }
}

/// Reads replies until the connection ends, handing each to its waiter;
/// then fails every request still waiting. A request that waits past the
/// timeout cuts the connection (the socket shut down, and the writer told
/// through `frames`).
async fn read_replies(mut rd: OwnedReadHalf, r: Reader, frames: mpsc::WeakUnboundedSender<Option<Bytes>>) {
    let Reader { url, pending, up, cause, clock, timeout } = r;
    let ending = Ending { pending: &pending, up: &up, cause: &cause };
    let mut buf = BytesMut::with_capacity(1 << 20);
    let recycler = Arc::new(Recycler::default());
    let mut ticker = Ticker::new(timeout);
    let any_overdue = |now| pending.lock().values().any(|(_, sent, _)| overdue(now, *sent));
    // Once large replies come, a read into the shared buffer takes at most
    // LARGE_REPLY: a large reply's data then mostly goes straight from the
    // socket into its own buffer, instead of most of it landing here first
    // and being copied over (27% of the client's CPU under 1M reads).
    let mut most = usize::MAX;
    let r: io::Result<()> = async {
        loop {
            while buf.len() >= SIMPLE_REPLY_LEN {
                if buf[..4] != SIMPLE_REPLY_MAGIC.to_be_bytes() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "bad NBD reply magic"));
                }
                let error = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes"));
                let cookie = u64::from_be_bytes(buf[8..16].try_into().expect("8 bytes"));
                let Some(&(want, _, _)) = pending.lock().get(&cookie) else {
                    let why = format!("reply for unknown cookie {cookie}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, why));
                };
                let data_len = if error == 0 { want } else { 0 };
                if buf.len() < SIMPLE_REPLY_LEN + data_len && data_len >= LARGE_REPLY as usize {
                    // Its data goes into a buffer of its own: what is here
                    // already, then straight from the socket.
                    buf.advance(SIMPLE_REPLY_LEN);
                    most = LARGE_REPLY as usize;
                    let mut data = recycler.begin(&mut buf, data_len);
                    while data.len() < data_len {
                        let room = data_len - data.len();
                        if ticker.read(&mut rd, &mut (&mut data).limit(room), &clock, any_overdue).await? == 0
                        {
                            return Err(io::ErrorKind::UnexpectedEof.into());
                        }
                    }
                    if let Some((_, _, tx)) = pending.lock().remove(&cookie) {
                        let _ = tx.send(Ok(recycler.data(data)));
                    }
                    continue;
                }
                if buf.len() < SIMPLE_REPLY_LEN + data_len {
                    buf.reserve(SIMPLE_REPLY_LEN + data_len);
                    break;
                }
                let frame = buf.split_to(SIMPLE_REPLY_LEN + data_len).freeze();
                if let Some((_, _, tx)) = pending.lock().remove(&cookie) {
                    let _ = tx.send(match error {
                        0 => Ok(frame.slice(SIMPLE_REPLY_LEN..)),
                        e => Err(Error::Status(status_of(e))),
                    });
                }
            }
            buf.reserve(64 * 1024);
            if ticker.read(&mut rd, &mut (&mut buf).limit(most), &clock, any_overdue).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
    .await;
    // Read before the cut below: the writer clears `up` first only when this
    // side closed the connection (the volume was dropped).
    let ours = !up.load(Acquire);
    let timed_out = r.as_ref().is_err_and(is_overdue);
    if let Err(e) = &r {
        // Why, first: before the cut (the writer then clears `up`) and
        // before `ending` fails the requests, so that each says why.
        cause.set_io(e, timeout, ours);
        match ours || timed_out {
            true => tracing::debug!(%url, "the NBD connection closed: {e}"),
            false => tracing::warn!(%url, "the NBD connection ended: {e}"),
        }
    }
    if timed_out {
        // Whether it landed is unknown: the connection is cut, and every
        // request on it fails.
        tracing::warn!(%url, ?timeout, "an NBD request got no reply in time; cutting the connection");
    }
    if r.is_err() && !ours {
        // Cut on any end this side did not choose (a bad reply, an unknown
        // cookie, a timeout): the requests fail below, and no write still
        // queued may go out after them on this connection (a mirror's
        // resync may meanwhile write newer data on a new one). Until
        // 2026-11-29 only a timeout cut it; after a bad reply the writer
        // went on sending.
        crate::writer::cut(&rd, &frames);
    }
    up.store(false, Release);
    drop(ending);
}
