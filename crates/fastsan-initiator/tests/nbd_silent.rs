//! An NBD server that answers the handshake and then nothing: a request
//! fails after the request timeout (the connection is cut, since nobody
//! can tell whether it landed), and every request after fails at once.

mod common;

use fastsan_initiator::nbd::NbdVolume;
use fastsan_initiator::{Error, Options};
use fastsan_nbd::consts::*;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

async fn silent_nbd_server() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = common::accept_and_greet(&l, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).await.unwrap();
        let mut head = [0u8; 16];
        s.read_exact(&mut head).await.unwrap();
        let len = u32::from_be_bytes(head[12..16].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data).await.unwrap();
        let reply = |kind: u32, payload: &[u8]| common::option_reply(OPT_GO, kind, payload);
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&(1u64 << 20).to_be_bytes());
        info.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH).to_be_bytes());
        s.write_all(&reply(REP_INFO, &info)).await.unwrap();
        s.write_all(&reply(REP_ACK, &[])).await.unwrap();
        // Then silence: read requests, answer none, until the client cuts.
        let mut sink = vec![0u8; 65536];
        while s.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    addr
}

#[tokio::test]
async fn a_silent_nbd_server_fails_requests_in_time_and_for_good() {
    let addr = silent_nbd_server().await;
    let opts = Options { request_timeout: Duration::from_millis(500), ..Default::default() };
    let vol = NbdVolume::connect(&format!("nbd://{addr}/x"), &opts).await.unwrap();
    assert_eq!(vol.size(), 1 << 20);
    assert!(vol.connected());
    // An empty write has nothing to send and nothing to wait for: done at once.
    let r = tokio::time::timeout(Duration::from_millis(200), vol.write_at(&[], 0, false)).await;
    assert!(matches!(r, Ok(Ok(()))), "{r:?}");
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), vol.write_at(&[1; 4096], 0, false)).await.unwrap();
    let lost = |r: &Result<(), Error>| matches!(r, Err(e @ Error::Lost(_)) if e.to_string() == "connection lost: no reply within the request timeout (500ms)");
    assert!(lost(&r), "{r:?}");
    assert!(t.elapsed() >= Duration::from_millis(400), "not before the request timeout");
    let deadline = Instant::now() + Duration::from_secs(5);
    while vol.connected() {
        assert!(Instant::now() < deadline, "the cut connection is still taken for up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = Instant::now();
    let r = vol.read(0, 4096).await.map(drop);
    assert!(lost(&r) && t.elapsed() < Duration::from_millis(100), "{r:?}");
}
