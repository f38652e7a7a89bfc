//! Reply coalescing (`fastsan_target::coalesce`): a connection whose client
//! sends one request at a time, and keeps sending, holds its replies a round
//! or two so that one write answers several. Holding changes no byte, backs
//! off from a client that waits for what is held, and loses no reply when the
//! client closes meanwhile.

mod common;

use common::{pattern, NbdRaw, TestServer};
use fastsan_initiator::{MergeMode, Options, Volume};
use fastsan_nbd::consts::{CMD_READ, CMD_WRITE, SIMPLE_REPLY_MAGIC};
use std::io::{Read, Write};
use std::time::Duration;

/// The longest round: a slow test machine's trickle still lands in it.
const ROUND: Duration = Duration::from_millis(1);
const BLOCK: usize = 4096;

/// An NBD client in transmission on `v`, as a blocking socket, so that a
/// thread can send its requests at a pace of its own choosing.
async fn nbd_client(srv: &TestServer) -> std::net::TcpStream {
    let mut r = NbdRaw::connect(srv.nbd.unwrap()).await;
    r.go("v", false, false).await;
    let s = r.s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Sends `n` requests of `command` on block `first + i` (cookie `i`), each
/// in a write of its own, `gap` apart, from one thread while another reads
/// the replies; returns the data each read's reply brought, by cookie.
fn trickle(s: std::net::TcpStream, command: u16, first: u64, n: u64, gap: Duration) -> Vec<Vec<u8>> {
    let mut tx = s.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        for i in 0..n {
            let at = (first + i) * BLOCK as u64;
            let data = if command == CMD_WRITE { pattern(7, at, BLOCK) } else { vec![] };
            tx.write_all(&NbdRaw::frame(command, 0, i, at, BLOCK as u32, &data)).unwrap();
            std::thread::sleep(gap);
        }
    });
    let mut rx = s;
    let mut got = vec![Vec::new(); n as usize];
    for _ in 0..n {
        let mut h = [0u8; 16];
        rx.read_exact(&mut h).expect("a reply");
        assert_eq!(h[..4], SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(u32::from_be_bytes(h[4..8].try_into().unwrap()), 0, "error in reply");
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        assert!(cookie < n && got[cookie as usize].is_empty(), "cookie {cookie} unknown or answered twice");
        let mut data = vec![0u8; if command == CMD_READ { BLOCK } else { 0 }];
        rx.read_exact(&mut data).unwrap();
        got[cookie as usize] = if command == CMD_READ { data } else { vec![1] };
    }
    sender.join().unwrap();
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_of_requests_has_its_replies_coalesced_and_every_byte_right() {
    let srv = TestServer::start(&["v=memory:16M"], |c| c.coalesce_window = ROUND).await;
    let s = nbd_client(&srv).await;
    let n = 200u64;
    // Five requests to a round: the rounds bring more as long as the client sends.
    let (written, read) = tokio::task::spawn_blocking(move || {
        let w = trickle(s.try_clone().unwrap(), CMD_WRITE, 0, n, ROUND / 5);
        (w, trickle(s, CMD_READ, 0, n, ROUND / 5))
    })
    .await
    .unwrap();
    assert!(written.iter().all(|w| !w.is_empty()));
    for (i, data) in read.iter().enumerate() {
        assert!(data[..] == pattern(7, i as u64 * BLOCK as u64, BLOCK)[..], "block {i} read back wrong");
    }
    let st = srv.handle.stats();
    assert!(st.coalesced > 0 && st.coalesce_rounds > 0, "{st:?}");
    assert!(st.coalesced <= 2 * n, "{} coalesced of {} requests", st.coalesced, 2 * n);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_at_queue_depth_1_makes_lingering_back_off_and_a_zero_window_never_lingers() {
    let srv = TestServer::start(&["v=memory:16M"], |c| c.coalesce_window = ROUND).await;
    let one = Options { connections: 1, merge: MergeMode::Off, ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), one).await.unwrap();
    // 600 requests one at a time: each linger's round brings nothing, and
    // lingering waits 8, 16, 32, ... reads before it tries again.
    for i in 0..300u64 {
        let data = pattern(3, i * 4096, 4096);
        vol.write_at(&data, i * 4096, false).await.unwrap();
        assert_eq!(vol.read(i * 4096, 4096).await.unwrap()[..], data[..], "block {i}");
    }
    let st = srv.handle.stats();
    assert!(st.coalesce_rounds >= 1 && st.coalesce_rounds <= 8, "{st:?}");
    srv.stop().await;

    // With a zero window, even a trickle is answered request by request.
    let srv = TestServer::start(&["v=memory:16M"], |c| c.coalesce_window = Duration::ZERO).await;
    let s = nbd_client(&srv).await;
    let w = tokio::task::spawn_blocking(move || trickle(s, CMD_WRITE, 0, 50, ROUND / 5)).await.unwrap();
    assert!(w.iter().all(|w| !w.is_empty()));
    let st = srv.handle.stats();
    assert_eq!((st.coalesced, st.coalesce_rounds), (0, 0), "{st:?}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_sending_while_replies_are_held_gets_them_and_others_go_on() {
    let srv = TestServer::start(&["v=memory:16M"], |c| c.coalesce_window = ROUND).await;
    let other = Volume::connect(&srv.url("v"), Options::default()).await.unwrap();

    // Half-closed right after its write: the linger's round reads the end,
    // and the reply held for it still comes before the connection closes.
    for round in 0..5u64 {
        let rounds = srv.handle.stats().coalesce_rounds;
        let mut s = nbd_client(&srv).await;
        let at = round * BLOCK as u64;
        let data = pattern(11, at, BLOCK);
        s.write_all(&NbdRaw::frame(CMD_WRITE, 0, round, at, BLOCK as u32, &data)).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).expect("the reply, then the end");
        assert_eq!(reply.len(), 16, "one reply");
        assert_eq!(reply[..4], SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(u64::from_be_bytes(reply[8..16].try_into().unwrap()), round);
        assert_eq!(srv.handle.stats().coalesce_rounds, rounds + 1, "its reply was held a round");
        assert_eq!(other.read(at, BLOCK as u64).await.unwrap()[..], data[..], "write {round} landed");
    }
    // Gone for good, mid-linger: the server notices and serves the others.
    for round in 0..5u64 {
        let mut s = nbd_client(&srv).await;
        let at = (100 + round) * BLOCK as u64;
        s.write_all(&NbdRaw::frame(CMD_WRITE, 0, 1, at, BLOCK as u32, &pattern(12, at, BLOCK))).unwrap();
        drop(s);
        // (Its write may land any time: the bystander writes elsewhere.)
        let at = at + 64 * BLOCK as u64;
        let data = pattern(13, at, BLOCK);
        other.write_at(&data, at, false).await.unwrap();
        assert_eq!(other.read(at, BLOCK as u64).await.unwrap()[..], data[..]);
    }
    // And a new client's trickle is held and answered as ever.
    let s = nbd_client(&srv).await;
    let trickling = tokio::task::spawn_blocking(move || trickle(s, CMD_WRITE, 200, 20, ROUND / 5));
    assert!(trickling.await.unwrap().iter().all(|w| !w.is_empty()));
    let st = srv.handle.stats();
    assert!(st.coalesce_rounds > 0, "{st:?}");
    srv.stop().await;
}
