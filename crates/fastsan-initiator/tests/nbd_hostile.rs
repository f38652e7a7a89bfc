//! NBD servers that break the protocol, or bend it: fastsan's NBD client
//! cuts a connection whose replies it cannot trust (and sends nothing more
//! on it), refuses block sizes that would multiply requests without end,
//! speaks only the handshake flags the server offers, and shows a server's
//! error text without its control characters.

mod common;

use fastsan_initiator::nbd::NbdVolume;
use fastsan_initiator::{Error, Options};
use fastsan_nbd::consts::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// What a fake server answers to OPT_GO.
enum Go {
    /// The export (1 MiB), with these block sizes if any.
    Export(Option<(u32, u32, u32)>),
    /// An error reply of this kind and text.
    Error(u32, &'static [u8]),
}

/// A server for one client: greets with `flags`, answers OPT_GO as `go`
/// says, hands back the client's flags, then runs `then` on the socket.
async fn fake<F, Fut>(flags: u16, go: Go, then: F) -> (std::net::SocketAddr, oneshot::Receiver<u32>)
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let Some((mut s, client)) = common::accept_and_greet(&l, flags).await else { return };
        let _ = tx.send(client);
        let mut head = [0u8; 16];
        if s.read_exact(&mut head).await.is_err() {
            return;
        }
        let mut data = vec![0u8; u32::from_be_bytes(head[12..16].try_into().unwrap()) as usize];
        s.read_exact(&mut data).await.unwrap();
        let reply = |kind: u32, payload: &[u8]| common::option_reply(OPT_GO, kind, payload);
        match go {
            Go::Export(sizes) => {
                let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                info.extend_from_slice(&(1u64 << 20).to_be_bytes());
                info.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
                s.write_all(&reply(REP_INFO, &info)).await.unwrap();
                if let Some((a, b, c)) = sizes {
                    let mut bs = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    for v in [a, b, c] {
                        bs.extend_from_slice(&v.to_be_bytes());
                    }
                    s.write_all(&reply(REP_INFO, &bs)).await.unwrap();
                }
                s.write_all(&reply(REP_ACK, &[])).await.unwrap();
                then(s).await;
            }
            Go::Error(kind, text) => {
                let _ = s.write_all(&reply(kind, text)).await;
            }
        }
    });
    (addr, rx)
}

fn opts() -> Options {
    Options { request_timeout: Duration::from_secs(10), ..Default::default() }
}

/// A reply with a bad magic: the requests fail, and the connection is cut
/// at once (the server sees its end while the volume is still held), so
/// that no write still queued goes out after the failure. Until
/// 2026-11-29 only a timeout cut it, and the writer went on.
#[tokio::test]
async fn a_bad_reply_cuts_the_connection() {
    let (ended_tx, ended) = oneshot::channel();
    let (addr, _) = fake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, Go::Export(None), |mut s| async move {
        let mut req = [0u8; 28 + 4096];
        s.read_exact(&mut req).await.unwrap();
        s.write_all(&[0xde; 16]).await.unwrap();
        let mut sink = [0u8; 4096];
        let end = tokio::time::timeout(Duration::from_secs(5), async {
            while s.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
        })
        .await;
        let _ = ended_tx.send(end.is_ok());
    })
    .await;
    let vol = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(2), vol.write_at(&[1; 4096], 0, false)).await.unwrap();
    assert!(matches!(r, Err(Error::Lost(_))), "{r:?}");
    assert!(ended.await.unwrap(), "the connection was still open 5 s after a bad reply");
    drop(vol);
}

/// A server that does not offer NO_ZEROES is not sent it (the spec: it
/// must close then), and one without FIXED_NEWSTYLE is refused clearly.
#[tokio::test]
async fn only_offered_handshake_flags_are_used() {
    let (addr, flags) = fake(FLAG_FIXED_NEWSTYLE, Go::Export(None), |_| async {}).await;
    let vol = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.unwrap();
    assert_eq!(flags.await.unwrap(), FLAG_C_FIXED_NEWSTYLE);
    drop(vol);
    let (addr, _) = fake(0, Go::Export(None), |_| async {}).await;
    let e = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.err().expect("refused");
    assert!(e.to_string().contains("fixed newstyle"), "{e}");
}

/// A maximum block size of one byte would make a 1 MiB read a million
/// requests in flight: refused at open.
#[tokio::test]
async fn a_tiny_maximum_block_size_is_refused() {
    let (addr, _) =
        fake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, Go::Export(Some((1, 1, 1))), |_| async {}).await;
    let e = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.err().expect("refused");
    assert!(e.to_string().contains("maximum block size of 1 bytes"), "{e}");
}

/// A server's error text reaches the user without its control characters
/// (a terminal would obey an escape sequence in it).
#[tokio::test]
async fn a_servers_error_text_is_shown_escaped() {
    let go = Go::Error(REP_ERR_UNKNOWN, b"no such export\x1b]0;owned\x07");
    let (addr, _) = fake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, go, |_| async {}).await;
    let e = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.err().expect("refused").to_string();
    assert!(e.contains("no such export") && !e.chars().any(|c| c.is_control()), "{e:?}");
}

/// A volume dropped says goodbye: NBD_CMD_DISC, then the close (a server
/// then finishes what it has, instead of finding its client gone).
#[tokio::test]
async fn a_dropped_volume_sends_disc_before_it_closes() {
    let (said_tx, said) = oneshot::channel();
    let (addr, _) = fake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES, Go::Export(None), |mut s| async move {
        let mut req = [0u8; 28];
        let got = tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut req)).await;
        let command = got.ok().and_then(Result::ok).map(|_| u16::from_be_bytes([req[6], req[7]]));
        let mut rest = [0u8; 1];
        let closed =
            matches!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut rest)).await, Ok(Ok(0)));
        let _ = said_tx.send((command, closed));
    })
    .await;
    let vol = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts()).await.unwrap();
    drop(vol);
    assert_eq!(said.await.unwrap(), (Some(CMD_DISC), true));
}

/// An export the server lists but will not describe (its OPT_INFO refused:
/// a TLS-only export of a server offering TLS to some) is listed as
/// unreadable, and the others are shown. Until 2026-12-07 it failed the
/// whole listing.
#[tokio::test]
async fn a_listed_export_the_server_will_not_describe_is_shown_as_unreadable() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = common::accept_and_greet(&l, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).await.unwrap();
        let reply = common::option_reply;
        loop {
            let mut head = [0u8; 16];
            if s.read_exact(&mut head).await.is_err() {
                return;
            }
            let opt = u32::from_be_bytes(head[8..12].try_into().unwrap());
            let mut data = vec![0u8; u32::from_be_bytes(head[12..16].try_into().unwrap()) as usize];
            s.read_exact(&mut data).await.unwrap();
            let out = match opt {
                OPT_LIST => {
                    let mut out = Vec::new();
                    for name in [&b"secret"[..], b"open"] {
                        let mut d = (name.len() as u32).to_be_bytes().to_vec();
                        d.extend_from_slice(name);
                        out.extend(reply(OPT_LIST, REP_SERVER, &d));
                    }
                    out.extend(reply(OPT_LIST, REP_ACK, &[]));
                    out
                }
                OPT_INFO if data[4..].starts_with(b"secret") => {
                    reply(OPT_INFO, REP_ERR_TLS_REQD, b"this export needs TLS")
                }
                OPT_INFO => {
                    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                    info.extend_from_slice(&(1u64 << 20).to_be_bytes());
                    info.extend_from_slice(&TFLAG_HAS_FLAGS.to_be_bytes());
                    let mut out = reply(OPT_INFO, REP_INFO, &info);
                    out.extend(reply(OPT_INFO, REP_ACK, &[]));
                    out
                }
                _ => return,
            };
            s.write_all(&out).await.unwrap();
        }
    });
    let listed = fastsan_initiator::nbd::list(&format!("nbd://{addr}"), &opts()).await.unwrap();
    let got: Vec<_> = listed.iter().map(|v| (v.name.as_str(), v.size, v.flags)).collect();
    assert_eq!(got, [("secret", 0, fastsan_initiator::VOLUME_UNREADABLE), ("open", 1 << 20, 0)]);
}
