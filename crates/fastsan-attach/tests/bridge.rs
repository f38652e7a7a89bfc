//! The bridge between the kernel's NBD client and the initiator, with the
//! test in the kernel's place: raw NBD requests on one end of a socket
//! pair, a real target (in this process, on 127.0.0.1) behind the initiator.

use fastsan_attach::bridge::{self, BridgeStats};
use fastsan_attach::Remote;
use fastsan_initiator::Options;
use fastsan_nbd::consts::*;
use fastsan_nbd::transmission::{parse_reply_head, ReplyHead, Request};
use fastsan_target::config::{ServerConfig, VolumeSpec};
use fastsan_target::Server;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const MIB: u64 = 1 << 20;

/// A target on 127.0.0.1: `brp://ADDR` and `nbd://ADDR` (append `/VOLUME`).
async fn target(volumes: &[&str]) -> (String, fastsan_target::ServerHandle) {
    let (base, _, h) = target_both(volumes).await;
    (base, h)
}

async fn target_both(volumes: &[&str]) -> (String, String, fastsan_target::ServerHandle) {
    let c = ServerConfig {
        brp: "127.0.0.1:0".parse().unwrap(),
        nbd: Some("127.0.0.1:0".parse().unwrap()),
        volumes: volumes.iter().map(|v| VolumeSpec::parse(v).unwrap()).collect(),
        ..Default::default()
    };
    let server = Server::bind(c).await.unwrap();
    let (addr, nbd, handle) = (server.local_addr(), server.nbd_addr().unwrap(), server.handle());
    tokio::spawn(server.run());
    (format!("brp://{addr}"), format!("nbd://{nbd}"), handle)
}

/// The kernel's side: requests out, replies (with a READ's data) back.
struct Kernel {
    s: UnixStream,
    buf: Vec<u8>,
    /// Lengths of READs in flight, by cookie: a simple reply's data length.
    reads: HashMap<u64, usize>,
    next: u64,
}

impl Kernel {
    fn new(s: UnixStream) -> Kernel {
        Kernel { s, buf: Vec::new(), reads: HashMap::new(), next: 1 }
    }

    async fn send(&mut self, command: u16, flags: u16, offset: u64, length: u32, data: &[u8]) -> u64 {
        let cookie = self.next;
        self.next += 1;
        let r = Request { flags, command, cookie, offset, length };
        self.s.write_all(&r.encode()).await.unwrap();
        self.s.write_all(data).await.unwrap();
        if command == CMD_READ {
            self.reads.insert(cookie, length as usize);
        }
        cookie
    }

    /// The next reply: cookie, error, data.
    async fn reply(&mut self) -> (u64, u32, Vec<u8>) {
        loop {
            if let Some((ReplyHead::Simple { error, cookie }, n)) = parse_reply_head(&self.buf).unwrap() {
                let len = match error {
                    0 => self.reads.get(&cookie).copied().unwrap_or(0),
                    _ => 0,
                };
                if self.buf.len() >= n + len {
                    let data = self.buf[n..n + len].to_vec();
                    self.buf.drain(..n + len);
                    self.reads.remove(&cookie);
                    return (cookie, error, data);
                }
            }
            let mut chunk = vec![0u8; 256 * 1024];
            let n = tokio::time::timeout(Duration::from_secs(30), self.s.read(&mut chunk))
                .await
                .expect("a reply within 30 s")
                .unwrap();
            assert!(n > 0, "the bridge closed with requests in flight");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn call(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        data: &[u8],
    ) -> (u32, Vec<u8>) {
        let c = self.send(command, flags, offset, length, data).await;
        let (cookie, error, data) = self.reply().await;
        assert_eq!(cookie, c);
        (error, data)
    }
}

async fn bridged(url: &str) -> (Kernel, tokio::task::JoinHandle<std::io::Result<()>>, Arc<BridgeStats>) {
    let vol = Remote::connect(url, Options::default()).await.unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let stats = Arc::new(BridgeStats::default());
    let task = tokio::spawn(bridge::serve(a, vol, stats.clone()));
    (Kernel::new(b), task, stats)
}

#[tokio::test]
async fn pipelined_requests_are_answered_by_cookie_with_the_bytes_written() {
    let (brp, nbd, _h) = target_both(&["v=memory:64M", "w=memory:64M"]).await;
    // Over BRP (the initiator), and over NBD (any NBD server's export).
    pipelined(&format!("{brp}/v")).await;
    pipelined(&format!("{nbd}/w")).await;
}

async fn pipelined(url: &str) {
    let (mut k, task, stats) = bridged(url).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // 256 writes in flight at once, 4 KiB to 256 KiB, at random block offsets.
    let mut model = vec![0u8; (64 * MIB) as usize];
    let mut sent = HashMap::new();
    for _ in 0..256 {
        let len = rng.gen_range(1..=64usize) * 4096;
        let off = rng.gen_range(0..(64 * MIB as usize - len) / 4096) * 4096;
        let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        model[off..off + len].copy_from_slice(&data);
        let flags = if rng.gen_bool(0.1) { CMD_FLAG_FUA } else { 0 };
        let c = k.send(CMD_WRITE, flags, off as u64, len as u32, &data).await;
        sent.insert(c, ());
    }
    // Overlapping writes in flight together may land in any order, as on a
    // disk: the model is only right where they do not overlap. So wait
    // for all, then compare reads with what a second, serial pass wrote.
    for _ in 0..256 {
        let (c, e, _) = k.reply().await;
        assert_eq!(e, 0);
        assert!(sent.remove(&c).is_some(), "a reply for cookie {c} that was not asked or answered twice");
    }
    for i in 0..64u64 {
        let data: Vec<u8> = (0..MIB).map(|j| (i + j * 7) as u8).collect();
        model[(i * MIB) as usize..((i + 1) * MIB) as usize].copy_from_slice(&data);
        assert_eq!(k.call(CMD_WRITE, 0, i * MIB, MIB as u32, &data).await.0, 0);
    }
    assert_eq!(k.call(CMD_FLUSH, 0, 0, 0, &[]).await.0, 0);
    // Reads in flight together, checked against the model.
    let mut want = HashMap::new();
    for _ in 0..128 {
        let len = rng.gen_range(1..=32usize) * 4096;
        let off = rng.gen_range(0..(64 * MIB as usize - len) / 4096) * 4096;
        want.insert(k.send(CMD_READ, 0, off as u64, len as u32, &[]).await, (off, len));
    }
    for _ in 0..128 {
        let (c, e, data) = k.reply().await;
        assert_eq!(e, 0);
        let (off, len) = want.remove(&c).expect("a reply for a read in flight");
        assert!(data == model[off..off + len], "read at {off} of {len} differs from what was written");
    }
    // WRITE_ZEROES and TRIM: zeros after (a memory volume frees the range).
    assert_eq!(k.call(CMD_WRITE_ZEROES, 0, 4 * MIB, MIB as u32, &[]).await.0, 0);
    assert_eq!(k.call(CMD_TRIM, 0, 8 * MIB, MIB as u32, &[]).await.0, 0);
    for at in [4 * MIB, 8 * MIB] {
        let (e, data) = k.call(CMD_READ, 0, at, MIB as u32, &[]).await;
        assert_eq!(e, 0);
        assert!(data.iter().all(|b| *b == 0));
    }
    // DISC: the bridge ends cleanly.
    k.send(CMD_DISC, 0, 0, 0, &[]).await;
    tokio::time::timeout(Duration::from_secs(10), task).await.unwrap().unwrap().unwrap();
    assert_eq!(stats.errors.load(Relaxed), 0);
    assert!(stats.requests.load(Relaxed) >= 256 + 64 + 128);
}

#[tokio::test]
async fn bad_requests_get_errors_and_the_bridge_keeps_serving() {
    let (base, _h) = target(&["v=memory:4M", "ro=memory:4M,ro"]).await;
    let (mut k, _task, stats) = bridged(&format!("{base}/v")).await;
    // Past the end; misaligned; a command never advertised; a WRITE too
    // large to take (its data is discarded, the stream stays in sync).
    assert_eq!(k.call(CMD_READ, 0, 4 * MIB, 4096, &[]).await.0, libc::ENOSPC as u32);
    assert_eq!(k.call(CMD_WRITE, 0, u64::MAX - 100, 4096, &[1; 4096]).await.0, libc::ENOSPC as u32);
    assert_eq!(k.call(CMD_TRIM, 0, u64::MAX - 100, 4096, &[]).await.0, libc::ENOSPC as u32);
    // A READ no kernel sends: 4 GiB is refused, not allocated.
    assert_eq!(k.call(CMD_READ, 0, 0, u32::MAX, &[]).await.0, libc::EINVAL as u32);
    assert_eq!(k.call(CMD_WRITE, 0, 100, 4096, &[1; 4096]).await.0, libc::EINVAL as u32);
    assert_eq!(k.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await.0, libc::EINVAL as u32);
    assert_eq!(k.call(42, 0, 0, 4096, &[]).await.0, libc::EINVAL as u32);
    let big = fastsan_nbd::MAX_PAYLOAD + 4096;
    let c = k.send(CMD_WRITE, 0, 0, big, &vec![9u8; big as usize]).await;
    assert_eq!(k.reply().await.1, libc::EINVAL as u32);
    assert_eq!(k.next - 1, c);
    // Still serving, and nothing was changed by the refused ones.
    assert_eq!(k.call(CMD_WRITE, 0, 0, 4096, &[5; 4096]).await.0, 0);
    let (e, data) = k.call(CMD_READ, 0, 0, 8192, &[]).await;
    assert_eq!(e, 0);
    assert!(data[..4096].iter().all(|b| *b == 5) && data[4096..].iter().all(|b| *b == 0));
    assert_eq!(stats.errors.load(Relaxed), 8);

    // A read-only volume: EPERM for writes, reads served.
    let (mut k, _task, _) = bridged(&format!("{base}/ro")).await;
    assert_eq!(k.call(CMD_WRITE, 0, 0, 4096, &[1; 4096]).await.0, libc::EPERM as u32);
    assert_eq!(k.call(CMD_READ, 0, 0, 4096, &[]).await.0, 0);
}

#[tokio::test]
async fn the_socket_closing_ends_the_bridge() {
    let (base, _h) = target(&["v=memory:4M"]).await;
    let (k, task, _) = bridged(&format!("{base}/v")).await;
    drop(k);
    tokio::time::timeout(Duration::from_secs(10), task).await.unwrap().unwrap().unwrap();
}

/// A volume whose reads never finish (writes do), opened with a request
/// timeout of `ms` and no reconnection: a read fails after its timeout.
async fn stalling_reads(ms: u64) -> (Remote, fastsan_target::ServerHandle) {
    let (base, h) = target(&["slow=memory:4M,faults=read:stall"]).await;
    let opts = Options {
        request_timeout: Duration::from_millis(ms),
        reconnect_timeout: Duration::ZERO,
        ..Default::default()
    };
    (Remote::connect(&format!("{base}/slow"), opts).await.unwrap(), h)
}

/// A bridge on `vol` whose end (how its reading ended) comes on the receiver.
#[allow(clippy::type_complexity)]
fn bridged_telling_its_end(
    vol: Remote,
) -> (
    Kernel,
    tokio::task::JoinHandle<std::io::Result<()>>,
    Arc<BridgeStats>,
    tokio::sync::oneshot::Receiver<bridge::End>,
) {
    let (a, b) = UnixStream::pair().unwrap();
    let stats = Arc::new(BridgeStats::default());
    let (end_tx, end_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(bridge::serve_with(a, vol, stats.clone(), move |end| {
        let _ = end_tx.send(end);
    }));
    (Kernel::new(b), task, stats, end_rx)
}

/// A request the volume does not answer stays counted in flight (what
/// `attach --list` shows) until its answer, here the error its timeout
/// gives, is written back; others go on meanwhile.
#[tokio::test]
async fn a_stuck_request_is_counted_in_flight_until_it_is_answered() {
    let (vol, _h) = stalling_reads(1500).await;
    let (a, b) = UnixStream::pair().unwrap();
    let stats = Arc::new(BridgeStats::default());
    let _task = tokio::spawn(bridge::serve(a, vol, stats.clone()));
    let mut k = Kernel::new(b);
    let stuck = k.send(CMD_READ, 0, 0, 4096, &[]).await;
    // Writes on the same volume are answered around it.
    assert_eq!(k.call(CMD_WRITE, 0, 8192, 4096, &[3; 4096]).await.0, 0);
    assert_eq!(stats.requests.load(Relaxed), 2);
    assert_eq!(stats.in_flight(), 1, "the stalled read");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stats.in_flight(), 1, "still waiting");
    // Its timeout fails it (no reconnection): an error, and nothing in flight.
    let (cookie, error, _) = k.reply().await;
    assert_eq!((cookie, error), (stuck, libc::EIO as u32));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while stats.in_flight() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the answered read is still counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stats.replies.load(Relaxed), 2);
}

/// The kernel closing a queue's socket without NBD_CMD_DISC (what its
/// request timeout does) is reported at once, with the requests the socket
/// brought, while a request still runs; that request's reply then goes
/// nowhere, and it leaves the count of requests in flight all the same.
#[tokio::test]
async fn a_socket_closed_under_a_running_request_is_reported_and_the_request_still_leaves_the_count() {
    let (vol, _h) = stalling_reads(1000).await;
    let (mut k, task, stats, closed_rx) = bridged_telling_its_end(vol);
    k.send(CMD_READ, 0, 0, 4096, &[]).await;
    k.send(CMD_READ, 0, 4096, 4096, &[]).await;
    while stats.requests.load(Relaxed) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(k);
    let told = tokio::time::timeout(Duration::from_millis(500), closed_rx).await;
    assert_eq!(told.expect("told before the reads end").unwrap(), bridge::End::Closed { received: 2 });
    assert_eq!(stats.in_flight(), 2, "both reads still run");
    // They fail by their timeout; their replies cannot be written.
    let ended = tokio::time::timeout(Duration::from_secs(10), task).await.expect("the bridge ends");
    assert!(ended.unwrap().is_err(), "its replies had nowhere to go");
    assert_eq!(stats.in_flight(), 0);
}

/// The reader never stops reading for requests in flight, up to what a
/// whole device can have (128 per queue, 16 queues; the kernel sends a dead
/// queue's requests to a live socket): a write left unread would not be in
/// the session's write order, and could land after its own copy sent again
/// elsewhere. NBD_CMD_DISC is then reported as the end.
#[tokio::test]
async fn the_reader_takes_every_request_a_device_can_have_in_flight_and_reports_a_disconnect() {
    let (vol, _h) = stalling_reads(3000).await;
    let (mut k, _task, stats, end_rx) = bridged_telling_its_end(vol);
    let n = 4 * 128;
    for i in 0..n {
        k.send(CMD_READ, 0, (i % 512) * 4096, 4096, &[]).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while stats.requests.load(Relaxed) < n {
        assert!(tokio::time::Instant::now() < deadline, "read {} of {n}", stats.requests.load(Relaxed));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stats.in_flight(), n, "all stalled, none answered yet");
    k.send(CMD_DISC, 0, 0, 0, &[]).await;
    let end = tokio::time::timeout(Duration::from_secs(2), end_rx).await.expect("reported at once");
    assert_eq!(end.unwrap(), bridge::End::Disconnect);
}

/// An NBD export has no retries (no fence): when its server goes, requests
/// fail with a clear error, at once and every time after, never hang.
#[tokio::test]
async fn an_nbd_export_whose_server_goes_fails_requests_without_hanging() {
    let (_, nbd, h) = target_both(&["v=memory:4M"]).await;
    let vol = Remote::connect(&format!("{nbd}/v"), Options::default()).await.unwrap();
    vol.write_at(&[7; 4096], 0, true).await.unwrap();
    assert_eq!(&vol.read(0, 4096).await.unwrap()[..], &[7; 4096][..]);
    assert_eq!(vol.connections(), (1, 1));
    h.shutdown();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while vol.connections().0 == 1 {
        assert!(tokio::time::Instant::now() < deadline, "the connection's end was not seen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..3 {
        let r = tokio::time::timeout(Duration::from_secs(5), vol.read(0, 4096)).await.expect("no hang");
        // It says why: the server closed the connection (or reset it).
        let lost = matches!(&r, Err(fastsan_initiator::Error::Lost(m)) if !m.is_empty() && m != "the connection ended");
        assert!(lost, "{r:?}");
    }
}
