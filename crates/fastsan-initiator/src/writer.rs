//! The writer task of the NBD and NVMe/TCP clients: whole frames, in the
//! order they were queued, several per `writev` when they queue together.
//!
//! On loopback a `send` runs the receiver's TCP stack too, so it is most of
//! a client's CPU per request (48% in `perf record` of `fastsan bench` at
//! QD32). Under load the writer therefore lets the requesters woken by the
//! last replies run a scheduler turn or two before it gathers, as BRP's
//! adaptive merge does (`conn::MERGE_LOAD`), and sends what they queued
//! meanwhile in one `writev`: one segment, one wake-up of the target. The
//! frames stay what they are (no protocol change); at light load (fewer
//! than [`LINGER_LOAD`] requests in flight) a frame leaves at once.

use crate::error::Cause;
use bytes::Bytes;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Requests in flight (those already sent) from which the writer lingers:
/// the same threshold as BRP's adaptive merge.
pub(crate) const LINGER_LOAD: usize = crate::conn::MERGE_LOAD;

/// Most frames one `writev` carries (Linux takes up to 1024 slices).
const MAX_GATHER: usize = 256;

/// Most bytes gathered before writing (a large write goes on its own).
const MAX_GATHER_BYTES: usize = 64 << 10;

/// A connection's writer task, to its end however it comes: the channel
/// closed (the volume was dropped), a `None` cut the connection, the
/// connection broke, or the runtime dropped the task at exit. When this
/// side ends it, `up` is cleared before the socket closes, so the reader
/// takes the end that follows for this side's own; when a write found the
/// connection broken, `up` stays for the reader to report the loss. Then
/// the socket is shut both ways.
pub(crate) async fn run(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Option<Bytes>>,
    up: &AtomicBool,
    cause: &Cause,
    in_flight: impl Fn() -> usize,
) {
    /// Clears `up` when dropped: declared after `wr`, it goes first, also
    /// when the task is dropped mid-write (`wr` shuts the socket as it goes).
    struct Ending<'a>(&'a AtomicBool);
    impl Drop for Ending<'_> {
        fn drop(&mut self) {
            self.0.store(false, Relaxed);
        }
    }
    let ending = Ending(up);
    match write_frames(&mut wr, &mut rx, in_flight).await {
        // This side ended it: the reader is to take the close for its own.
        Ok(()) => drop(ending),
        // The connection broke under a write (and the kernel cleared the
        // socket's error as it reported it): the reader must still see a
        // lost connection, not this side's close, and its requests must
        // say why (the reader then meets only the end of the stream).
        Err(e) => {
            cause.set_io(&e, std::time::Duration::ZERO, false);
            std::mem::forget(ending)
        }
    }
    let _ = socket2::SockRef::from(wr.as_ref()).shutdown(std::net::Shutdown::Both);
}

/// Cuts the connection from its reader's side, when a request waited past
/// its timeout: the socket is shut down first, so that nothing more is sent
/// on it after the requests are failed, then the writer is told to stop.
pub(crate) fn cut(rd: &tokio::net::tcp::OwnedReadHalf, frames: &mpsc::WeakUnboundedSender<Option<Bytes>>) {
    let _ = socket2::SockRef::from(rd.as_ref()).shutdown(std::net::Shutdown::Both);
    if let Some(tx) = frames.upgrade() {
        let _ = tx.send(None);
    }
}

/// Writes frames until the channel closes or a `None` asks to cut the
/// connection (both `Ok`), or the connection breaks (`Err`). `in_flight`
/// says how many requests are waiting for a reply.
pub(crate) async fn write_frames<W: AsyncWrite + Unpin>(
    wr: &mut W,
    rx: &mut mpsc::UnboundedReceiver<Option<Bytes>>,
    in_flight: impl Fn() -> usize,
) -> io::Result<()> {
    let mut group: Vec<Bytes> = Vec::new();
    let mut cut = false;
    while !cut {
        match rx.recv().await {
            Some(Some(frame)) => group.push(frame),
            Some(None) | None => return Ok(()),
        }
        let mut rounds = if in_flight() >= LINGER_LOAD { 2 } else { 0 };
        let mut bytes = group[0].len();
        loop {
            while group.len() < MAX_GATHER && bytes < MAX_GATHER_BYTES {
                match rx.try_recv() {
                    Ok(Some(frame)) => {
                        bytes += frame.len();
                        group.push(frame);
                    }
                    // Cut after what was queued before the cut.
                    Ok(None) => {
                        cut = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if rounds == 0 || cut || group.len() >= MAX_GATHER || bytes >= MAX_GATHER_BYTES {
                break;
            }
            rounds -= 1;
            tokio::task::yield_now().await;
        }
        let mut slices: Vec<IoSlice<'_>> = group.iter().map(|f| IoSlice::new(f)).collect();
        write_all_vectored(wr, &mut slices).await?;
        drop(slices);
        group.clear();
    }
    Ok(())
}

/// Writes every byte of `bufs`, then flushes (TLS may hold records it could
/// not send yet; a no-op on a socket).
pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// Frames queued together arrive whole and in order, and a cut sends
    /// what was queued before it, then ends.
    #[tokio::test]
    async fn frames_leave_in_order_and_a_cut_ends_after_them() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let frames: Vec<Bytes> =
            (0..600u32).map(|i| Bytes::from(vec![(i % 251) as u8; 1 + i as usize % 300])).collect();
        for f in &frames {
            tx.send(Some(f.clone())).unwrap();
        }
        tx.send(None).unwrap();
        tx.send(Some(Bytes::from_static(b"after the cut"))).unwrap();
        // Busy: the writer lingers and gathers.
        write_frames(&mut a, &mut rx, || 32).await.unwrap();
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, frames.concat(), "every frame before the cut, in order, nothing after it");
    }

    /// A closed channel ends the writer cleanly; a broken connection is an error.
    #[tokio::test]
    async fn a_broken_connection_is_an_error() {
        let (mut a, b) = tokio::io::duplex(64);
        drop(b);
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(Some(Bytes::from_static(b"lost"))).unwrap();
        assert!(write_frames(&mut a, &mut rx, || 0).await.is_err());
        drop(tx);
        assert!(write_frames(&mut a, &mut rx, || 0).await.is_ok(), "a closed channel is the end");
    }

    /// However the writer ends (its channel closed, or its task dropped by
    /// a runtime shutting down), `up` is clear before the peer can see the
    /// socket close, so the reader takes the end for this side's own.
    #[test]
    fn up_is_cleared_before_the_socket_closes_however_the_writer_ends() {
        for dropped in [false, true] {
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            let up = std::sync::Arc::new(AtomicBool::new(true));
            let (tx, rx) = mpsc::unbounded_channel();
            let mut peer = rt.block_on(async {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
                let (peer, _) = l.accept().await.unwrap();
                let (rd, wr) = c.into_split();
                let u = up.clone();
                tokio::spawn(async move {
                    let _rd = rd;
                    run(wr, rx, &u, &Cause::default(), || 0).await
                });
                tx.send(Some(Bytes::from_static(b"one frame"))).unwrap();
                let peer = peer.into_std().unwrap();
                peer.set_nonblocking(false).unwrap();
                peer
            });
            let mut got = [0u8; 9];
            std::io::Read::read_exact(&mut peer, &mut got).unwrap();
            assert_eq!(&got, b"one frame");
            assert!(up.load(Relaxed), "up while the writer runs");
            if dropped {
                drop(rt);
            } else {
                drop(tx);
            }
            peer.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
            let n = std::io::Read::read(&mut peer, &mut got).unwrap();
            assert_eq!(n, 0, "the socket closed");
            assert!(!up.load(Relaxed), "up cleared by then (task dropped: {dropped})");
        }
    }

    /// A write that finds the connection broken leaves `up` set: the loss is
    /// the reader's to report, not to be taken for this side's close.
    #[tokio::test]
    async fn a_broken_connection_leaves_up_set() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (peer, _) = l.accept().await.unwrap();
        // Closed with unread data in it: the peer answers with a reset.
        socket2::SockRef::from(&peer).set_linger(Some(std::time::Duration::ZERO)).unwrap();
        drop(peer);
        let up = std::sync::Arc::new(AtomicBool::new(true));
        let (tx, rx) = mpsc::unbounded_channel();
        let (rd, wr) = c.into_split();
        let u = up.clone();
        let cause = std::sync::Arc::new(Cause::default());
        let c = cause.clone();
        let writer = tokio::spawn(async move { run(wr, rx, &u, &c, || 0).await });
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !writer.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "the writer never saw the broken connection");
            let _ = tx.send(Some(Bytes::from(vec![7u8; 64 << 10])));
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        drop(rd);
        assert!(up.load(Relaxed), "a broken connection is not this side's close");
        // And its requests will say why: the write's own error, not the end
        // of the stream the reader meets after it.
        let why = cause.error().to_string();
        assert!(why.starts_with("connection lost: ") && !why.contains("closed the connection"), "{why}");
        assert_ne!(why, "connection lost: the connection ended");
    }
}
