//! Data safety under faults, one test per failure found in review: a lost
//! connection's write overtaking a newer one, a reply stream reused after a
//! stalled write, a writeback error consumed by one client, a silent target,
//! clients pinning memory, TRIM with FUA, a slow fsync.

mod common;

use common::{pattern, NbdRaw, Raw, TestServer};
use fastsan_brp::handshake::Message;
use fastsan_brp::reply::parse_reply;
use fastsan_brp::request::{RequestHeader, FLAG_FUA};
use fastsan_brp::{Command, Status};
use fastsan_nbd::consts::*;
use fastsan_target::backend::BackendError;
use fastsan_target::backend::{Effect, FaultOps, FaultRule};
use fastsan_target::config::ServerConfig;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Whether the kernel still has the connection established (the peer has not closed it).
fn established(s: &tokio::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut info as *mut _ as *mut _,
            &mut len,
        )
    };
    r == 0 && info.tcpi_state == 1 // TCP_ESTABLISHED
}

fn temp_file(name: &str, len: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    common::temp_file(&format!("faults-{name}"), len)
}

/// A target serving `v`, a 1 MiB file volume under a faults layer with
/// `rule` (`none`: steered at run time through the handle); the file's
/// directory goes when the returned guard drops.
async fn file_volume_with_faults(
    name: &str,
    rule: &str,
    tweak: impl FnOnce(&mut ServerConfig),
) -> (TestServer, tempfile::TempDir) {
    let (dir, path) = temp_file(name, 1 << 20);
    let spec = format!("v=file:{},faults={rule}", path.display());
    (TestServer::start(&[spec.as_str()], tweak).await, dir)
}

/// HELLO, then OPEN of `volume` as `slot` of `session`, without waiting for the answer.
async fn open_in(raw: &mut Raw, volume: &str, session: u64, slot: u16) {
    open_with(raw, volume, session, slot, 0).await
}

/// [`open_in`] with OPEN's `flags` (HELLO asks for the takeover feature when
/// they hold `OPEN_TAKEOVER`).
async fn open_with(raw: &mut Raw, volume: &str, session: u64, slot: u16, flags: u16) {
    let features = if flags != 0 { fastsan_brp::FEATURE_TAKEOVER } else { 0 };
    let hello = Message::Hello { min_version: 2, max_version: 2, features };
    let Message::HelloReply { features: agreed, .. } = raw.ask(&hello).await else { panic!("HELLO_REPLY") };
    assert_eq!(agreed, features);
    raw.send(&Message::Open { session, slot, flags, name: volume.into() }.to_vec()).await;
}

/// Finding 1: connection C1 of a session has a WRITE running on a slow
/// device and another buffered behind it (no credit); the initiator gives C1
/// up and re-opens its slot. The target stops C1 at once (the buffered write
/// never runs), answers the reconnect only once C1's running write is done,
/// and a newer write acknowledged after that is the one that stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connections_writes_never_land_after_the_retry() {
    let (srv, _dir) = file_volume_with_faults("fence", "none", |c| c.queue_depth = 1).await;
    let faults = srv.handle.faults("v").unwrap();
    let mut c1 = Raw::connect(srv.addr).await;
    open_in(&mut c1, "v", 0, 0).await;
    let Some(Message::OpenReply(info)) = c1.message().await else { panic!("OPEN_REPLY") };
    faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    // 'A' stalls on the device; 'A2' waits in C1's buffer for its credit.
    c1.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &[b'A'; 4096]).await;
    c1.request(RequestHeader::new(Command::Write, 0, 2, 0, 4096), &[b'Z'; 4096]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The initiator gives C1 up (C1 stays open as far as the target knows) and re-opens slot 0.
    let mut c1b = Raw::connect(srv.addr).await;
    open_in(&mut c1b, "v", info.session, 0).await;
    let early = tokio::time::timeout(Duration::from_millis(300), c1b.message()).await;
    assert!(early.is_err(), "OPEN_REPLY must wait for the lost connection's running write");
    faults.clear();
    let Some(Message::OpenReply(again)) = c1b.message().await else { panic!("OPEN_REPLY after the fence") };
    assert_eq!(again.session, info.session);
    // The retry: 'B', acknowledged.
    c1b.request(RequestHeader::new(Command::Write, 0, 3, 0, 4096), &[b'B'; 4096]).await;
    assert_eq!(c1b.reply().await.0.status, Status::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c1b.request(RequestHeader::new(Command::Read, 0, 4, 0, 4096), &[]).await;
    let (r, data) = c1b.reply().await;
    assert_eq!(r.status, Status::OK);
    assert!(data.iter().all(|&b| b == b'B'), "the block holds {:?}, not the acknowledged B", data[0] as char);
    assert!(c1.closed_within(Duration::from_secs(5)).await, "the replaced connection is closed");
    assert_eq!(srv.handle.volume_stats("v").unwrap().writes, 2, "A and B ran; the buffered write never did");
    srv.stop().await;
}

/// A restarted client (a gateway) takes its session over with fewer
/// connections while its predecessor's still look open: OPEN_TAKEOVER stops
/// them all, in every slot, and its OPEN_REPLY waits for the write running
/// in slot 1, so that write cannot land over the new incarnation's. A write
/// the predecessor sends after the takeover never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_fences_the_predecessors_connections_in_every_slot() {
    let (srv, _dir) = file_volume_with_faults("takeover", "none", |_| {}).await;
    let faults = srv.handle.faults("v").unwrap();
    let mut old0 = Raw::connect(srv.addr).await;
    open_in(&mut old0, "v", 0, 0).await;
    let Some(Message::OpenReply(info)) = old0.message().await else { panic!("OPEN_REPLY") };
    let mut old1 = Raw::connect(srv.addr).await;
    open_in(&mut old1, "v", info.session, 1).await;
    assert!(matches!(old1.message().await, Some(Message::OpenReply(_))));
    // The predecessor's 'A' stalls on the device in slot 1.
    faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    old1.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &[b'A'; 4096]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The successor comes back with one connection, in slot 0.
    let mut new0 = Raw::connect(srv.addr).await;
    open_with(&mut new0, "v", info.session, 0, fastsan_brp::handshake::OPEN_TAKEOVER).await;
    let early = tokio::time::timeout(Duration::from_millis(300), new0.message()).await;
    assert!(early.is_err(), "OPEN_REPLY must wait for slot 1's running write");
    // What slot 1 sends now is never run.
    old1.request(RequestHeader::new(Command::Write, 0, 2, 4096, 4096), &[b'Z'; 4096]).await;
    faults.clear();
    let Some(Message::OpenReply(again)) = new0.message().await else { panic!("OPEN_REPLY after the fence") };
    assert_eq!(again.session, info.session);
    new0.request(RequestHeader::new(Command::Write, 0, 3, 0, 4096), &[b'B'; 4096]).await;
    assert_eq!(new0.reply().await.0.status, Status::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    new0.request(RequestHeader::new(Command::Read, 0, 4, 0, 8192), &[]).await;
    let (r, data) = new0.reply().await;
    assert_eq!(r.status, Status::OK);
    assert!(
        data[..4096].iter().all(|&b| b == b'B'),
        "block 0 holds {:?}, not the acknowledged B",
        data[0] as char
    );
    assert!(data[4096..].iter().all(|&b| b == 0), "the predecessor's write after the takeover ran");
    for c in [&mut old0, &mut old1] {
        assert!(c.closed_within(Duration::from_secs(5)).await, "the predecessor's connections are closed");
    }
    srv.stop().await;
}

/// Finding 2: a client stops reading its replies; the target's write
/// stalls in the middle of a reply and gives up. No reply may follow the cut
/// one on that stream (the client would take it for READ data): the stream
/// is whole replies, then at most one cut reply, then the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reply_stream_is_closed_never_continued() {
    let srv = TestServer::start(&["v=memory:256M"], |c| c.stall_timeout = Duration::from_millis(500)).await;
    let (mut raw, _) = Raw::open(srv.addr, "v").await;
    for tag in 1..=200u64 {
        raw.request(RequestHeader::new(Command::Read, 0, tag, (tag % 128) << 20, 1 << 20), &[]).await;
    }
    // Read nothing for well past the stall timeout, then everything to the end.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut stream = Vec::new();
    let got = tokio::time::timeout(Duration::from_secs(10), raw.s.read_to_end(&mut stream)).await;
    assert!(got.is_ok(), "the target closed the connection");
    let mut at = 0;
    let mut whole = 0;
    loop {
        match parse_reply(&stream[at..], false) {
            Ok(Some(f)) => {
                assert_eq!(f.header.status, Status::OK);
                assert!((1..=200).contains(&f.header.tag), "tag {}", f.header.tag);
                assert_eq!(f.header.payload_len, 1 << 20);
                at += f.frame_len;
                whole += 1;
            }
            Ok(None) => break,
            Err(e) => panic!("a reply followed a cut one after {whole} whole replies: {e}"),
        }
    }
    assert!(whole < 200, "the client never read: the target cannot have sent all 200 ({whole})");
    // Others go on.
    let (mut other, _) = Raw::open(srv.addr, "v").await;
    other.request(RequestHeader::new(Command::Read, 0, 1, 0, 4096), &[]).await;
    assert_eq!(other.reply().await.0.status, Status::OK);
    srv.stop().await;
}

/// An I/O thread that finishes a connection's only request writes its
/// reply itself, as far as the socket takes it at once; the rest is the
/// writer task's to finish, before anything else. Here an 8 MiB read of a
/// file volume (longer than is served at once: the pool runs it) meets a
/// client that reads nothing for a while, so the socket takes only part of
/// the reply; a small read sent meanwhile must come after the whole of it,
/// and both carry the bytes written. The part waiting to be written still
/// holds its credit (the payload budgets bound it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_an_io_thread_began_is_finished_before_the_next() {
    let (_dir, path) = temp_file("at-once", 16 << 20);
    let spec = format!("v=file:{}", path.display());
    let srv = TestServer::start(&[spec.as_str()], |_| {}).await;
    let (mut raw, _) = Raw::open(srv.addr, "v").await;
    let data = pattern(5, 0, 8 << 20);
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        let at = (i as u64) << 20;
        raw.request(RequestHeader::new(Command::Write, 0, i as u64, at, piece.len() as u32), piece).await;
        assert_eq!(raw.reply().await.0.status, Status::OK);
    }
    raw.request(RequestHeader::new(Command::Read, 0, 100, 0, 8 << 20), &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // What waits to be written is still counted against the budgets.
    assert_eq!(srv.handle.payload_in_flight(), 8 << 20, "the unwritten reply holds its credit");
    raw.request(RequestHeader::new(Command::Read, 0, 101, 4096, 4096), &[]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (h, got) = raw.reply().await;
    assert_eq!((h.status, h.tag), (Status::OK, 100), "the reply begun first comes first, whole");
    assert!(got == data, "the 8 MiB read carries the bytes written");
    let (h, got) = raw.reply().await;
    assert_eq!((h.status, h.tag), (Status::OK, 101));
    assert!(got[..] == data[4096..8192]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while srv.handle.payload_in_flight() != 0 {
        assert!(Instant::now() < deadline, "credits come back once the replies are written");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    srv.stop().await;
}

/// Finding 3: a failed flush is reported once per open file by Linux, so
/// after it the volume must fail every later FLUSH and FUA write, for every
/// client, on every protocol, until reopened. And every read and write too
/// (since 2026-12-07): the kernel keeps the pages whose writeback failed
/// clean in its cache, so a read would return the lost data until they are
/// evicted and older data after, to clients that never saw a flush fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flush_fails_every_later_flush_for_every_client() {
    let (srv, _dir) = file_volume_with_faults("writeback", "none", |_| {}).await;
    let (mut a, _) = Raw::open(srv.addr, "v").await;
    let (mut b, _) = Raw::open(srv.addr, "v").await;
    b.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &pattern(1, 0, 4096)).await;
    assert_eq!(b.reply().await.0.status, Status::OK);
    // One writeback error, reported to A's FLUSH.
    srv.handle
        .faults("v")
        .unwrap()
        .add(FaultRule::new(FaultOps::FLUSH, Effect::Fail(BackendError::Io(libc::EIO))).times(1));
    a.request(RequestHeader::new(Command::Flush, 0, 2, 0, 0), &[]).await;
    assert_eq!(a.reply().await.0.status, Status::IO_ERROR);
    // B's acknowledged write was in that writeback: B's FLUSH must not say OK.
    b.request(RequestHeader::new(Command::Flush, 0, 3, 0, 0), &[]).await;
    assert_eq!(b.reply().await.0.status, Status::IO_ERROR, "B's flush after the failed writeback");
    b.request(RequestHeader::new(Command::Write, FLAG_FUA, 4, 4096, 4096), &[1; 4096]).await;
    assert_eq!(b.reply().await.0.status, Status::IO_ERROR, "FUA promises durability too");
    b.request(RequestHeader::new(Command::Write, 0, 5, 8192, 4096), &[2; 4096]).await;
    assert_eq!(b.reply().await.0.status, Status::IO_ERROR, "plain writes fail too");
    b.request(RequestHeader::new(Command::Read, 0, 6, 0, 4096), &[]).await;
    let (r, d) = b.reply().await;
    assert_eq!((r.status, d.len()), (Status::IO_ERROR, 0), "reads too: which data they find is unknown");
    // An NBD client is told the same, and one that never flushed cannot read either.
    let mut n = NbdRaw::connect(srv.nbd.unwrap()).await;
    n.go("v", false, false).await;
    n.request(CMD_FLUSH, 0, 7, 0, 0, &[]).await;
    assert_eq!(n.simple(0).await.0, EIO);
    n.request(CMD_READ, 0, 8, 0, 4096, &[]).await;
    assert_eq!(n.simple(0).await.0, EIO);
    // What the operator sees: LIST's flag (`fastsan ls`) and the metric.
    let listed = fastsan_initiator::list(&srv.url("v"), &Default::default()).await.unwrap();
    assert_eq!(listed[0].flags & fastsan_initiator::VOLUME_FAILED, fastsan_initiator::VOLUME_FAILED);
    let collector = fastsan_target::metrics::TargetCollector { server: srv.handle.clone() };
    let text = fastsan_target::metrics::render(&collector);
    assert!(text.contains("fastsan_volume_failed{volume=\"v\"} 1"), "{text}");
    // Shutdown cannot flush either, and says so.
    let e = srv.stop_result().await.expect_err("a failed flush at shutdown is an error");
    assert!(e.to_string().contains("could not flush volume(s) v"), "{e}");
}

/// A request refused for its length or range holds no payload budget.
/// Until 2026-12-07 a READ of 4 GiB - 4 KiB past the end of the volume was
/// charged every budget whole before it was checked: it waited until
/// every byte in flight on the volume had drained, and every other
/// client's reads and writes queued behind it (here: one read stalled in
/// the device stopped them all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_for_its_size_holds_up_nobody() {
    let (srv, _dir) = file_volume_with_faults("oversized", "none", |_| {}).await;
    let faults = srv.handle.faults("v").unwrap();
    faults.add(FaultRule::new(FaultOps::READ, Effect::Stall).range(512 << 10..1 << 20));
    let nbd = srv.nbd.unwrap();
    let client = || async {
        let mut c = NbdRaw::connect(nbd).await;
        c.go("v", false, false).await;
        c
    };
    let mut stalled = client().await;
    stalled.request(CMD_READ, 0, 1, 512 << 10, 4096, &[]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut huge = client().await;
    huge.request(CMD_READ, 0, 2, 0, u32::MAX - 4095, &[]).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), huge.simple(0)).await;
    assert_eq!(answer.expect("refused at once").0, EINVAL);
    let mut other = client().await;
    other.request(CMD_READ, 0, 3, 0, 4096, &[]).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), other.simple(4096)).await;
    assert_eq!(answer.expect("another client's read goes on").0, 0);
    faults.clear();
    assert_eq!(stalled.simple(4096).await.0, 0, "the stalled read ends once released");
    srv.stop().await;
}

/// A slow fsync holds one of its volume's I/O threads however many FLUSH
/// and FUA writes wait for it (until 2026-11-28 each waiter held one, and
/// with as many waiters as threads the volume's reads stopped too): a
/// bystander's read and write go on, and once the fsync returns every
/// waiter is answered, those that arrived during it by one flush they share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_fsync_holds_one_thread_not_one_per_waiter() {
    let (srv, _dir) = file_volume_with_faults("slowsync", "none", |c| c.io_threads = 2).await;
    let (mut by, _) = Raw::open(srv.addr, "v").await;
    by.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &pattern(3, 0, 4096)).await;
    assert_eq!(by.reply().await.0.status, Status::OK);
    let flushes = srv.handle.volume_stats("v").unwrap().flushes;
    srv.handle.faults("v").unwrap().add(FaultRule::new(FaultOps::FLUSH, Effect::Stall));
    // Six clients wait for durability, three times the volume's threads:
    // the first FLUSH stalls in the device, the others arrive behind it.
    let mut waiters = Vec::new();
    for i in 0..6u64 {
        let (mut c, _) = Raw::open(srv.addr, "v").await;
        if i % 2 == 0 {
            c.request(RequestHeader::new(Command::Flush, 0, 10 + i, 0, 0), &[]).await;
        } else {
            let at = (1 + i) * 4096;
            c.request(RequestHeader::new(Command::Write, FLAG_FUA, 10 + i, at, 4096), &pattern(i, at, 4096))
                .await;
        }
        waiters.push(c);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The bystander is served meanwhile.
    let t = Instant::now();
    by.request(RequestHeader::new(Command::Read, 0, 2, 0, 4096), &[]).await;
    let (r, d) = tokio::time::timeout(Duration::from_secs(5), by.reply())
        .await
        .expect("a read waited for a stalled fsync it does not need");
    assert_eq!((r.status, d), (Status::OK, pattern(3, 0, 4096)));
    by.request(RequestHeader::new(Command::Write, 0, 3, 64 << 10, 4096), &[9; 4096]).await;
    let r =
        tokio::time::timeout(Duration::from_secs(5), by.reply()).await.expect("a write waited for the fsync");
    assert_eq!(r.0.status, Status::OK);
    assert!(t.elapsed() < Duration::from_secs(5));
    // The fsync returns: every waiter is answered, by two flushes in all.
    srv.handle.faults("v").unwrap().clear();
    for (i, c) in waiters.iter_mut().enumerate() {
        let (r, _) = c.reply().await;
        assert_eq!((r.tag, r.status), (10 + i as u64, Status::OK));
    }
    let ran = srv.handle.volume_stats("v").unwrap().flushes - flushes;
    assert_eq!(ran, 2, "the stalled one, then one the five behind it shared");
    for i in (1..6u64).step_by(2) {
        let at = (1 + i) * 4096;
        by.request(RequestHeader::new(Command::Read, 0, 20 + i, at, 4096), &[]).await;
        assert_eq!(by.reply().await.1, pattern(i, at, 4096), "FUA write {i} landed");
    }
    srv.stop().await;
}

/// Finding 8: TRIM with FUA over NBD is durable before its reply: the flush
/// behind it runs (and its failure is reported).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbd_trim_with_fua_flushes_before_replying() {
    let (srv, _dir) = file_volume_with_faults("trimfua", "flush:eio", |_| {}).await;
    let mut n = NbdRaw::connect(srv.nbd.unwrap()).await;
    n.go("v", false, false).await;
    n.request(CMD_TRIM, 0, 1, 0, 4096, &[]).await;
    assert_eq!(n.simple(0).await.0, 0, "TRIM alone needs no flush");
    n.request(CMD_TRIM, CMD_FLAG_FUA, 2, 0, 4096, &[]).await;
    assert_eq!(n.simple(0).await.0, EIO, "TRIM with FUA flushed (and the flush failed)");
    assert!(srv.stop_result().await.is_err(), "the flush at shutdown fails too");
}

/// Finding 6: clients that ask for large reads and never take the replies
/// hold at most the server-wide budget; when they stall past the stall
/// timeout they are dropped, and a bystander is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_replies_pin_no_more_than_the_budget() {
    let budget = 128u64 << 20;
    let srv = TestServer::start(&["v=memory:128M"], |c| {
        c.memory_budget = budget;
        c.stall_timeout = Duration::from_secs(1);
    })
    .await;
    let mut hogs = Vec::new();
    for _ in 0..6 {
        let mut n = NbdRaw::connect(srv.nbd.unwrap()).await;
        n.go("v", false, false).await;
        n.request(CMD_READ, 0, 1, 0, 32 << 20, &[]).await;
        n.request(CMD_READ, 0, 2, 32 << 20, 32 << 20, &[]).await;
        hogs.push(n);
    }
    let t = Instant::now();
    let mut peak = 0;
    while t.elapsed() < Duration::from_millis(500) {
        peak = peak.max(srv.handle.payload_in_flight());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(peak > 0 && peak <= budget, "payload in flight {peak} within the budget {budget}");
    // A bystander gets its read once the hogs are dropped for stalling.
    let (mut raw, _) = Raw::open(srv.addr, "v").await;
    raw.request(RequestHeader::new(Command::Read, 0, 9, 0, 1 << 20), &[]).await;
    let (r, _) = raw.reply().await;
    assert_eq!(r.status, Status::OK);
    assert!(t.elapsed() < Duration::from_secs(8));
    // Every hog is dropped for stalling (each in its turn on the budget);
    // looked at without reading, which would end the stall.
    let deadline = Instant::now() + Duration::from_secs(20);
    while hogs.iter().any(|h| established(&h.s)) {
        assert!(Instant::now() < deadline, "a client that stalls is dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(srv.handle.payload_in_flight(), 0, "their budget came back");
    assert_eq!(srv.handle.stats().stalled, 6, "each counted as dropped for stalling");
    srv.stop().await;
}

/// A WRITE's payload counts against the payload budgets from its header
/// on, while it arrives, not once it is all there (until 2026-12-08 an NBD
/// write held up to 64 MiB of a connection's read buffer outside every
/// budget: 64 GiB with 1024 connections). When the budget is spent the
/// target stops reading and the rest waits in the client's socket; a
/// client silent in the middle of its payload is dropped after the stall
/// timeout and its budget comes back; others go on; the bytes written are
/// the bytes read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_payload_is_counted_while_it_arrives() {
    let budget = 128u64 << 20;
    let srv = TestServer::start(&["v=memory:256M", "w=memory:1M", "r=memory:1M,ro"], |c| {
        c.memory_budget = budget;
        c.stall_timeout = Duration::from_secs(2);
    })
    .await;
    let nbd = srv.nbd.unwrap();
    let client = |name: &'static str| async move {
        let mut c = NbdRaw::connect(nbd).await;
        c.go(name, false, false).await;
        c
    };
    let in_flight_reaches = |least: u64, why: &'static str| {
        let handle = srv.handle.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while handle.payload_in_flight() < least {
                assert!(Instant::now() < deadline, "{why}: {} in flight", handle.payload_in_flight());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let big = 48usize << 20;
    let (one, two) = (pattern(1, 0, big), pattern(2, 64 << 20, big));
    // A: the header and a megabyte of its payload.
    let mut a = client("v").await;
    a.send(&NbdRaw::frame(CMD_WRITE, 0, 1, 0, big as u32, &one[..1 << 20])).await;
    in_flight_reaches(big as u64, "a payload counts from its header on").await;
    // B: a second one on the volume, whose share (half the budget) has no
    // room for it: the target does not read it meanwhile.
    let mut b = client("v").await;
    let frame = NbdRaw::frame(CMD_WRITE, 0, 2, 64 << 20, big as u32, &two);
    let b = tokio::spawn(async move {
        b.send(&frame).await;
        b.simple(0).await.0
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = srv.handle.payload_in_flight();
    assert!(held <= budget / 2, "{held} in flight: B's payload was read past the volume's share");
    // A bystander's small write and read on another volume go on meanwhile.
    let mut by = client("w").await;
    by.request(CMD_WRITE, 0, 3, 0, 4096, &[7; 4096]).await;
    assert_eq!(by.simple(0).await.0, 0);
    by.request(CMD_READ, 0, 4, 0, 4096, &[]).await;
    assert_eq!(by.simple(4096).await.2, vec![7; 4096]);
    // A's rest comes: both writes land, A's then B's.
    a.send(&one[1 << 20..]).await;
    assert_eq!(a.simple(0).await, (0, 1, vec![]));
    let b = tokio::time::timeout(Duration::from_secs(10), b).await.expect("B goes on once A is done");
    assert_eq!(b.unwrap(), 0);
    let mut check = client("v").await;
    for (at, want) in [(0u64, &one), (64 << 20, &two)] {
        check.request(CMD_READ, 0, 5, at, big as u32, &[]).await;
        assert!(check.simple(big).await.2 == *want, "the bytes written at {at} are read");
    }
    // C: a header and a megabyte, then silence: dropped after the stall
    // timeout, and its budget comes back.
    let mut c = client("v").await;
    c.send(&NbdRaw::frame(CMD_WRITE, 0, 6, 128 << 20, big as u32, &one[..1 << 20])).await;
    in_flight_reaches(big as u64, "the silent client's payload counts").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while established(&c.s) {
        assert!(Instant::now() < deadline, "a client silent in the middle of its payload is dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(srv.handle.payload_in_flight(), 0, "its budget came back");
    assert_eq!(srv.handle.stats().stalled, 1, "counted as dropped for stalling");
    // A write the volume refuses (read-only) holds none of it, arriving or not.
    let mut ro = client("r").await;
    ro.send(&NbdRaw::frame(CMD_WRITE, 0, 8, 0, big as u32, &one[..1 << 20])).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(srv.handle.payload_in_flight(), 0, "a refused write's header holds no budget");
    ro.send(&one[1 << 20..]).await;
    assert_eq!(ro.simple(0).await.0, EPERM);
    by.request(CMD_READ, 0, 7, 0, 4096, &[]).await;
    assert_eq!(by.simple(4096).await.2, vec![7; 4096], "the others go on");
    srv.stop().await;
}

/// Finding 5: a device that stalls holds only its own volume's threads;
/// one client's thousands of queued jobs do not delay another client's
/// request by more than a turn; a huge TRIM runs in pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_io_is_fair_between_volumes_and_clients() {
    let ((_a, a), (_b, b)) = (temp_file("pool-a", 1 << 30), temp_file("pool-b", 64 << 20));
    let slow = format!("slow=file:{},faults=none", a.display());
    let fast = format!("fast=file:{},delay=5ms", b.display());
    let srv = TestServer::start(&[slow.as_str(), fast.as_str()], |c| c.io_threads = 2).await;
    // 32 writes stuck on `slow`: more than all its threads.
    srv.handle.faults("slow").unwrap().add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    let (mut stuck, _) = Raw::open(srv.addr, "slow").await;
    for tag in 0..32 {
        stuck.request(RequestHeader::new(Command::Write, 0, tag, tag * 4096, 4096), &[1; 4096]).await;
    }
    // A client with 200 writes queued on `fast` (two threads, 5 ms each: a second of work).
    let (mut hog, _) = Raw::open(srv.addr, "fast").await;
    for tag in 0..200 {
        hog.request(RequestHeader::new(Command::Write, 0, tag, tag * 4096, 4096), &[2; 4096]).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (mut by, _) = Raw::open(srv.addr, "fast").await;
    let t = Instant::now();
    by.request(RequestHeader::new(Command::Read, 0, 1, 0, 4096), &[]).await;
    assert_eq!(by.reply().await.0.status, Status::OK);
    let waited = t.elapsed();
    assert!(
        waited < Duration::from_millis(300),
        "the bystander waited {waited:?} behind the hog and the stuck volume"
    );
    for _ in 0..200 {
        assert_eq!(hog.reply().await.0.status, Status::OK);
    }
    // A 1 GiB TRIM reaches the device in 64 MiB pieces, and gets one reply.
    srv.handle.faults("slow").unwrap().clear();
    for _ in 0..32 {
        assert_eq!(stuck.reply().await.0.status, Status::OK);
    }
    let before = srv.handle.volume_stats("slow").unwrap().trims;
    stuck.request(RequestHeader::new(Command::Trim, FLAG_FUA, 99, 0, 1 << 30), &[]).await;
    let (r, _) = stuck.reply().await;
    assert_eq!((r.tag, r.status), (99, Status::OK));
    assert_eq!(srv.handle.volume_stats("slow").unwrap().trims - before, 16);
    srv.stop().await;
}

/// A stalled device keeps every write sent to it, payload and all, until it
/// answers; enough connections writing to it held the whole target's payload
/// budget (`--memory-budget`), and every other volume's clients waited for
/// it. A volume holds at most half the budget: the other half serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_volume_holds_at_most_half_the_payload_budget() {
    let srv = TestServer::start(&["stuck=memory:256M,faults=none", "other=memory:16M"], |c| {
        c.memory_budget = 128 << 20
    })
    .await;
    srv.handle.faults("stuck").unwrap().add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    // Two connections, each up to its own 64 MiB of writes in flight: 128
    // MiB, the whole budget, if nothing stops them. (Each from a task of its
    // own: a connection the target stops reading blocks its sender.)
    let mut stuck = Vec::new();
    for c in 0..2u64 {
        let (mut raw, _) = Raw::open(srv.addr, "stuck").await;
        stuck.push(tokio::spawn(async move {
            let chunk = vec![3u8; 8 << 20];
            for tag in 0..8 {
                let at = (c * 8 + tag) * (8 << 20);
                raw.request(RequestHeader::new(Command::Write, 0, tag, at, 8 << 20), &chunk).await;
            }
            let mut statuses = Vec::new();
            for _ in 0..8 {
                statuses.push(raw.reply().await.0.status);
            }
            statuses
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another volume's client is served at once.
    let (mut by, _) = Raw::open(srv.addr, "other").await;
    let t = Instant::now();
    by.request(RequestHeader::new(Command::Write, 0, 1, 0, 1 << 20), &vec![4u8; 1 << 20]).await;
    let r = tokio::time::timeout(Duration::from_secs(5), by.reply()).await;
    let waited = t.elapsed();
    assert!(matches!(&r, Ok((h, _)) if h.status == Status::OK), "the other volume's write: {waited:?}");
    assert!(waited < Duration::from_secs(2), "the other volume's write waited {waited:?}");
    // The device comes back: every stalled write lands and is answered.
    srv.handle.faults("stuck").unwrap().clear();
    for t in stuck {
        let statuses = tokio::time::timeout(Duration::from_secs(30), t).await.expect("answered").unwrap();
        assert_eq!(statuses, vec![Status::OK; 8]);
    }
    srv.stop().await;
}

/// A target shutting down keeps its address until its last write has
/// landed and its volumes are flushed: a new target on the same address
/// cannot resume a session under a write of the old one still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_target_keeps_its_address_until_its_writes_land() {
    let (srv, _dir) = file_volume_with_faults("drain", "none", |_| {}).await;
    let (addr, handle) = (srv.addr, srv.handle.clone());
    let faults = handle.faults("v").unwrap();
    faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    let (mut raw, _) = Raw::open(addr, "v").await;
    raw.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &[7; 4096]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    handle.shutdown();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        tokio::net::TcpListener::bind(addr).await.is_err(),
        "the address is still held while a write runs"
    );
    let mut late = Raw::connect(addr).await;
    assert!(late.closed_within(Duration::from_secs(5)).await, "new connections are closed meanwhile");
    faults.clear();
    assert_eq!(raw.reply().await.0.status, Status::OK, "the running write finishes and is answered");
    srv.stop().await;
    assert!(tokio::net::TcpListener::bind(addr).await.is_ok(), "then the address is free");
}

/// Clients silent in their handshakes (BRP before and after HELLO, NBD
/// after its greeting) hold no acknowledged data and do not hold up a
/// target that stops: they are closed at once, not after the handshake
/// timeout, while an open connection's running write still lands first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_silent_in_their_handshakes_do_not_hold_up_a_stopping_target() {
    let (srv, dir) = file_volume_with_faults("hs-stop", "none", |c| {
        c.handshake_timeout = Duration::from_secs(30);
    })
    .await;
    let faults = srv.handle.faults("v").unwrap();
    let (mut open, _) = Raw::open(srv.addr, "v").await;
    let mut silent = Raw::connect(srv.addr).await;
    let mut hello = Raw::connect(srv.addr).await;
    hello.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0 }).await;
    let mut nbd = NbdRaw::connect(srv.nbd.unwrap()).await;
    // A write that runs for a while when the shutdown begins.
    faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall));
    open.request(RequestHeader::new(Command::Write, 0, 1, 0, 4096), &[7; 4096]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    srv.handle.shutdown();
    assert!(silent.closed_within(Duration::from_secs(5)).await, "BRP before HELLO");
    assert!(hello.closed_within(Duration::from_secs(5)).await, "BRP after HELLO");
    assert!(nbd.closed_within(Duration::from_secs(5)).await, "NBD after its greeting");
    let closed = t.elapsed();
    assert!(closed < Duration::from_secs(5), "the handshakes closed after {closed:?}");
    faults.clear();
    assert_eq!(open.reply().await.0.status, Status::OK, "the running write lands and is answered");
    let t = Instant::now();
    srv.stop().await;
    assert!(t.elapsed() < Duration::from_secs(5), "stopped after {:?}", t.elapsed());
    // What the write wrote is in the file.
    let back = std::fs::read(dir.path().join("v.img")).unwrap();
    assert_eq!(back[..4096], [7u8; 4096][..]);
}

/// While a target restarts, whatever answers at its address may speak
/// nonsense (here a relay that prints its own error, as `nc` does when
/// the target is not up yet). The session keeps reconnecting through it:
/// the writes issued meanwhile complete once the target answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_the_address_during_a_restart_does_not_end_the_session() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    let srv = TestServer::start(&["v=memory:8M"], |_| {}).await;
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let broken = Arc::new(AtomicBool::new(false));
    let (b, target) = (broken.clone(), srv.addr);
    let conns = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let held = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = relay.accept().await {
            if b.load(SeqCst) {
                let _ =
                    c.write_all(b"nc: can't connect to remote host (127.0.0.1): Connection refused\n").await;
                continue;
            }
            let mut t = tokio::net::TcpStream::connect(target).await.unwrap();
            let task = tokio::spawn(async move {
                let _ = tokio::io::copy_bidirectional(&mut c, &mut t).await;
            });
            held.lock().push(task);
        }
    });
    let opts =
        fastsan_initiator::Options { reconnect_timeout: Duration::from_secs(20), ..Default::default() };
    let vol = fastsan_initiator::Volume::connect(&format!("brp://{relay_addr}/v"), opts).await.unwrap();
    vol.write_at(&pattern(1, 0, 65536), 0, false).await.unwrap();
    // The outage: every connection cut, and garbage for the reconnects, for a second.
    broken.store(true, SeqCst);
    for t in conns.lock().drain(..) {
        t.abort();
    }
    let w = {
        let vol = vol.clone();
        tokio::spawn(async move { vol.write_at(&pattern(2, 65536, 65536), 65536, false).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    broken.store(false, SeqCst);
    w.await.unwrap().expect("the write waits out the outage");
    let back = vol.read(0, 131072).await.unwrap();
    assert!(back[..65536] == pattern(1, 0, 65536)[..] && back[65536..] == pattern(2, 65536, 65536)[..]);
    assert!(vol.stats().reconnects >= 1);
    srv.stop().await;
}

/// A mirror leg whose target's host restarts (a new boot) after it
/// acknowledged writes it had not flushed, within the mirror's failover
/// time (the session resumes instead of failing): the leg may answer reads
/// with what was there before those writes. It is degraded, and the read
/// served by the other leg; until 2026-11-29 the leg served it, and the
/// mirror read back data older than a write it had acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_leg_that_lost_unflushed_writes_serves_no_read() {
    use fastsan_initiator::mirror::Mirror;
    use fastsan_initiator::Options;
    let (_da, a_img) = common::temp_file("mirror-reboot-a", 8 << 20);
    let (_db, b_img) = common::temp_file("mirror-reboot-b", 8 << 20);
    let (a_spec, b_spec) = (format!("v=file:{}", a_img.display()), format!("v=file:{}", b_img.display()));
    // Leg 0, the one that reboots, is the one idle reads go to.
    let a = TestServer::start(&[&a_spec], |c| (c.nbd, c.boot_id) = (None, Some(1))).await;
    let b = TestServer::start(&[&b_spec], |c| c.nbd = None).await;
    let a_addr = a.addr;
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "mirror:brp://{a_addr}/v,brp://{}/v,log={},failover=30",
        b.addr,
        dir.path().join("m.log").display()
    );
    let m = Mirror::create(&spec, Options::default(), true, false).await.unwrap();
    m.write_at(&[0x11; 4096], 0, false).await.unwrap();
    m.flush().await.unwrap();
    // The mirror's keeper flushes every leg about once a second while a
    // region is idle: once it has cleared this one, the next flush is a
    // second away, and the write below stays unflushed until leg 0 stops.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while m.status().dirty > 0 {
        assert!(std::time::Instant::now() < deadline, "the keeper never cleared the region");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    m.write_at(&[0x22; 4096], 0, false).await.unwrap();
    // Leg 0's host reboots and its page cache with the unflushed write is
    // gone: its file holds the flushed bytes again.
    a.stop().await;
    {
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new().write(true).open(&a_img).unwrap().write_all_at(&[0x11; 4096], 0).unwrap();
    }
    let a = TestServer::start(&[&a_spec], |c| (c.brp, c.nbd, c.boot_id) = (a_addr, None, Some(2))).await;
    for _ in 0..4 {
        let got = m.read(0, 4096).await.unwrap();
        assert!(got[..] == [0x22; 4096][..], "read back data older than an acknowledged write");
    }
    assert!(m.status().degraded_events >= 1, "the leg that lost writes was taken out");
    drop(m);
    a.stop().await;
    b.stop().await;
}

/// nbd-server (the reference NBD server, Debian's package) serving files
/// `a` and `b` of `len` bytes: exports that do not offer TRIM, as its
/// default configuration has it. Stopped when dropped.
struct NbdServer {
    dir: tempfile::TempDir,
    port: u16,
}

impl NbdServer {
    fn start(len: u64) -> NbdServer {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut conf = format!("[generic]\n  listenaddr = 127.0.0.1\n  port = {port}\n");
        for name in ["a", "b"] {
            let file = dir.path().join(format!("{name}.img"));
            std::fs::File::create(&file).unwrap().set_len(len).unwrap();
            conf += &format!("[{name}]\n  exportname = {}\n", file.display());
        }
        let conf_path = dir.path().join("nbd-server.conf");
        std::fs::write(&conf_path, conf).unwrap();
        // It forks into the background once it listens.
        let st = std::process::Command::new("nbd-server")
            .arg("-C")
            .arg(&conf_path)
            .arg("-p")
            .arg(dir.path().join("pid"))
            .status()
            .expect("nbd-server (Debian package nbd-server) runs");
        assert!(st.success(), "nbd-server failed to start");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nbd-server does not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        NbdServer { dir, port }
    }

    fn url(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.path().join("pid")) {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                // Its children, one per client, go with their connections.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
}

/// A TRIM is advice (NBD, NVMe's deallocate and SCSI's UNMAP leave the
/// range's contents undefined until written), and a mirror's legs need
/// not all take it: a leg that cannot (an nbd-server export offers no
/// TRIM; a BRP volume on a store that cannot answers UNSUPPORTED) skips
/// it, and stays in sync. It used to be degraded, as for a failed write:
/// after every fstrim the mirror ran on one leg until a resync. A TRIM no
/// leg takes is UNSUPPORTED to the caller, and degrades nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_leg_that_cannot_trim_skips_it_and_stays_in_sync() {
    use fastsan_initiator::mirror::{LegState, Mirror};
    use fastsan_initiator::{Error, Options};
    let brp = TestServer::start(
        &["v=memory:64M", "w=memory:64M,faults=trim:enotsup", "x=memory:64M,faults=trim:enotsup"],
        |c| c.nbd = None,
    )
    .await;
    let nbd = NbdServer::start(64 << 20);
    // And fastsan's NBD front end on a store that cannot: EINVAL, as nbdkit answers.
    let own_nbd = TestServer::start(&["y=memory:64M,faults=trim:enotsup"], |_| {}).await;
    let y = format!("nbd://{}/y", own_nbd.nbd.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let log = |n: &str| dir.path().join(n).display().to_string();
    let spec = format!("mirror:{},{},{},{y},log={}", brp.url("v"), brp.url("w"), nbd.url("a"), log("m.log"));
    let m = Mirror::create(&spec, Options::default(), true, false).await.unwrap();
    let data = pattern(3, 0, 1 << 20);
    m.write_at(&data, 0, false).await.unwrap();
    m.trim(0, 256 << 10).await.unwrap();
    // The trimmed range written again, and the rest untouched: every leg
    // holds the same bytes, whichever one a read comes from.
    m.write_at(&data[..4096], 0, true).await.unwrap();
    m.flush().await.unwrap();
    for _ in 0..8 {
        assert!(m.read(0, 4096).await.unwrap()[..] == data[..4096]);
        assert!(m.read(256 << 10, 768 << 10).await.unwrap()[..] == data[256 << 10..]);
    }
    let s = m.status();
    assert_eq!(s.degraded_events, 0, "a leg was degraded for declining a TRIM: {s:?}");
    assert!(s.legs.iter().all(|l| l.state == LegState::InSync), "{s:?}");
    m.close().await.unwrap();

    // Legs of which none trims: the caller hears UNSUPPORTED, no leg degraded.
    let spec = format!("mirror:{},{},log={}", brp.url("x"), nbd.url("b"), log("n.log"));
    let n = Mirror::create(&spec, Options::default(), true, false).await.unwrap();
    n.write_at(&data[..65536], 0, false).await.unwrap();
    match n.trim(0, 65536).await {
        Err(Error::Status(Status::UNSUPPORTED)) => {}
        other => panic!("a TRIM no leg takes: {other:?}"),
    }
    assert!(n.read(0, 65536).await.unwrap()[..] == data[..65536], "a declined TRIM changed nothing");
    let s = n.status();
    assert_eq!(s.degraded_events, 0, "{s:?}");
    assert!(s.legs.iter().all(|l| l.state == LegState::InSync), "{s:?}");
    n.close().await.unwrap();
    drop((m, n));
    brp.stop().await;
    own_nbd.stop().await;
}

/// A resync never copies from a leg whose target's host restarted with
/// writes it had acknowledged and not flushed (its session resumed within
/// failover): the copy would make the returning leg "in sync" with bytes
/// older than an acknowledged write. Leg 0 reboots that way while leg 2 is
/// away; leg 1 holds every write, and leg 2's resync must copy from it.
/// (Until 2026-11-29 reads avoided such a leg, copies did not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_never_copies_from_a_leg_that_lost_unflushed_writes() {
    use fastsan_initiator::mirror::{LegState, Mirror};
    use fastsan_initiator::{Options, Volume};
    let (_da, a_img) = common::temp_file("mirror-resync-a", 8 << 20);
    let (_db, b_img) = common::temp_file("mirror-resync-b", 8 << 20);
    let (a_spec, b_spec) = (format!("v=file:{}", a_img.display()), format!("v=file:{}", b_img.display()));
    let a = TestServer::start(&[&a_spec], |c| (c.nbd, c.boot_id) = (None, Some(1))).await;
    let b = TestServer::start(&[&b_spec], |c| c.nbd = None).await;
    let c = TestServer::start(&["v=memory:8M,faults=none"], |c| c.nbd = None).await;
    let a_addr = a.addr;
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "mirror:brp://{a_addr}/v,brp://{}/v,brp://{}/v,log={},failover=30",
        b.addr,
        c.addr,
        dir.path().join("m.log").display()
    );
    let m = Mirror::create(&spec, Options::default(), true, false).await.unwrap();
    m.write_at(&[0x11; 4096], 0, false).await.unwrap();
    m.flush().await.unwrap();
    // Once the keeper has cleared the region, its next flush is a second
    // away: the write below stays unflushed until leg 0 stops.
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.status().dirty > 0 {
        assert!(Instant::now() < deadline, "the keeper never cleared the region");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c_faults = c.handle.faults("v").unwrap();
    c_faults.add(FaultRule::new(FaultOps::WRITE, Effect::Fail(BackendError::Io(libc::EIO))));
    m.write_at(&[0x22; 4096], 0, false).await.unwrap();
    assert_eq!(m.status().legs[2].state, LegState::Degraded, "leg 2 missed the write");
    // Leg 0's host reboots; its page cache with the unflushed write is gone.
    a.stop().await;
    {
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new().write(true).open(&a_img).unwrap().write_all_at(&[0x11; 4096], 0).unwrap();
    }
    let a = TestServer::start(&[&a_spec], |c| (c.brp, c.nbd, c.boot_id) = (a_addr, None, Some(2))).await;
    c_faults.clear();
    let deadline = Instant::now() + Duration::from_secs(30);
    while m.status().legs[2].state != LegState::InSync {
        assert!(Instant::now() < deadline, "leg 2 never came back: {:?}", m.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leg2 = Volume::connect(&c.url("v"), Options::default()).await.unwrap();
    let got = leg2.read(0, 4096).await.unwrap();
    assert!(got[..] == [0x22; 4096][..], "leg 2 was resynced with bytes older than an acknowledged write");
    drop((m, leg2));
    for t in [a, b, c] {
        t.stop().await;
    }
}

/// Without reconnection (`--reconnect-timeout 0`) a write whose connection
/// was cut (its device stalled past the request timeout) fails at once,
/// yet may still land on the target. The session's other connection went
/// on, so a later write to the same bytes was acknowledged and then
/// overwritten by the failed one. Now the lost write ends the session: the
/// later write fails and the acknowledged data is never overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_reconnection_a_lost_write_ends_its_session_so_nothing_overtakes_it() {
    use fastsan_initiator::{Error, Options, Volume};
    let srv = TestServer::start(&["v=memory:16M,faults=none"], |_| {}).await;
    let faults = srv.handle.faults("v").unwrap();
    faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall).times(1));
    let opts = Options {
        connections: 2,
        reconnect_timeout: Duration::ZERO,
        request_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
    let lost = vol.write_at(&[1; 4096], 0, false).await;
    assert!(lost.is_err(), "the stalled write failed: {lost:?}");
    let later = vol.write_at(&[2; 4096], 0, false).await;
    assert!(matches!(later, Err(Error::SessionEnded(_))), "the later write was not sent: {later:?}");
    // The device comes back: the lost write lands (it was never known not
    // to), and nothing acknowledged is under it.
    faults.clear();
    let fresh = Volume::connect(&srv.url("v"), Options::default()).await.unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let mut data = [9u8; 4096];
        fresh.read_at(&mut data, 0).await.unwrap();
        if data == [1; 4096] {
            break;
        }
        assert_eq!(data, [0; 4096], "only the lost write's bytes or the old ones");
        assert!(Instant::now() < until, "the stalled write never landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    srv.stop().await;
}

/// A failed flush is remembered on the file. Linux reports a writeback
/// error to one flush only, so a target restarted on the file answered the
/// next flush OK over the writes the failed one lost, and a session that
/// wrote before the failure resumed as if nothing had happened (until
/// 2026-12-07). Now the restarted target gives the volume another
/// generation: that session is told its volume was replaced. A new session
/// works, and resumes across a later restart without a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flush_is_remembered_across_a_restart_of_the_target() {
    let (_dir, path) = temp_file("remembered", 1 << 20);
    let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: both strings are NUL-terminated and live through the call; the value is 1 byte.
    let probe = unsafe {
        libc::setxattr(c_path.as_ptr(), c"user.fastsan.probe".as_ptr(), b"1".as_ptr().cast(), 1, 0)
    };
    if probe != 0 {
        return eprintln!(
            "no user attributes in {}: the record cannot be made there; not checked",
            path.display()
        );
    }
    restart_after_a_failed_flush(&path, None).await;
}

/// The same where the file takes no record (ramfs has no attributes; a
/// filesystem the failure turned read-only takes none either): the record
/// in the run directory does it. Needs root, to mount the ramfs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flush_is_remembered_in_the_run_directory_where_the_file_takes_no_record() {
    let Some(ramfs) = Ramfs::mount() else {
        return eprintln!("cannot mount a ramfs (not root?): not checked");
    };
    let path = ramfs.0.path().join("v.img");
    std::fs::File::create(&path).unwrap().set_len(1 << 20).unwrap();
    let run = tempfile::tempdir().unwrap();
    restart_after_a_failed_flush(&path, Some(run.path())).await;
    let records: Vec<_> = std::fs::read_dir(run.path().join("failed-flushes")).unwrap().collect();
    assert_eq!(records.len(), 1, "one record, for the one file");
    let text = std::fs::read_to_string(records[0].as_ref().unwrap().path()).unwrap();
    assert_eq!(text, format!("1\n{}\n", path.display()), "its count and its file");
}

/// A ramfs mounted on a temp directory, unmounted when dropped.
struct Ramfs(tempfile::TempDir);

impl Ramfs {
    fn mount() -> Option<Ramfs> {
        let dir = tempfile::tempdir().ok()?;
        let target = std::ffi::CString::new(dir.path().to_str()?).ok()?;
        // SAFETY: the strings are NUL-terminated and live through the call; no data argument.
        let r =
            unsafe { libc::mount(c"none".as_ptr(), target.as_ptr(), c"ramfs".as_ptr(), 0, std::ptr::null()) };
        (r == 0).then_some(Ramfs(dir))
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(self.0.path().to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path, alive for the call.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// A target serving `path` (with `run_dir`) fails a flush and is stopped;
/// one started on the file again tells the session that wrote before the
/// failure that its volume was replaced, and resumes a fresh session
/// across a restart without a failure.
async fn restart_after_a_failed_flush(path: &std::path::Path, run_dir: Option<&std::path::Path>) {
    use fastsan_initiator::{Error, Options, Volume};
    let spec = format!("v=file:{},faults=none", path.display());
    let run = |c: &mut ServerConfig| c.run_dir = run_dir.map(Into::into);
    let srv = TestServer::start(&[spec.as_str()], run).await;
    let addr = srv.addr;
    let opts = Options { connections: 1, reconnect_timeout: Duration::from_secs(20), ..Default::default() };
    let wrote = Volume::connect(&srv.url("v"), opts.clone()).await.unwrap();
    let flushed = Volume::connect(&srv.url("v"), opts.clone()).await.unwrap();
    wrote.write_at(&[1; 4096], 0, false).await.unwrap();
    srv.handle
        .faults("v")
        .unwrap()
        .add(FaultRule::new(FaultOps::FLUSH, Effect::Fail(BackendError::Io(libc::EIO))));
    assert!(flushed.flush().await.is_err(), "the injected flush failure");
    assert!(srv.stop_result().await.is_err(), "its shutdown flush fails too (latched)");
    let srv = TestServer::start(&[spec.as_str()], |c| {
        run(c);
        c.brp = addr
    })
    .await;
    let e = wrote.flush().await.expect_err("its write may be lost");
    assert!(matches!(e, Error::VolumeReplaced { .. }), "{e:?}");
    let fresh = Volume::connect(&srv.url("v"), opts).await.unwrap();
    fresh.write_at(&[2; 4096], 0, false).await.unwrap();
    fresh.flush().await.unwrap();
    srv.stop().await;
    let srv = TestServer::start(&[spec.as_str()], |c| {
        run(c);
        c.brp = addr
    })
    .await;
    fresh.write_at(&[3; 4096], 4096, false).await.expect("a restart without a failure resumes");
    fresh.flush().await.unwrap();
    drop((wrote, flushed, fresh));
    srv.stop().await;
}

/// A write whose caller gives up on it (a timeout drops its future) while
/// its device stalls still keeps its place: a later write to the same
/// bytes waits until it has landed, whether its reply then comes or its
/// connection is cut by the request timeout meanwhile (then until that
/// connection's fence). (Until 2026-12-07 the dropped write let the later
/// one go at once; it was acknowledged, and then the stalled one landed
/// over it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_its_caller_gave_up_on_still_lands_before_a_later_overlapping_one() {
    use fastsan_initiator::{Options, Volume};
    for request_timeout in [Duration::from_secs(30), Duration::from_millis(200)] {
        let srv = TestServer::start(&["v=memory:16M,faults=none"], |_| {}).await;
        let faults = srv.handle.faults("v").unwrap();
        faults.add(FaultRule::new(FaultOps::WRITE, Effect::Stall).times(1));
        let opts = Options { connections: 2, request_timeout, ..Default::default() };
        let vol = Volume::connect(&srv.url("v"), opts).await.unwrap();
        let gave_up =
            tokio::time::timeout(Duration::from_millis(100), vol.write_at(&[1; 4096], 0, false)).await;
        assert!(gave_up.is_err(), "the stalled write outlived its caller's patience");
        let later = tokio::spawn({
            let vol = vol.clone();
            async move { vol.write_at(&[2; 4096], 0, false).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!later.is_finished(), "the later write waits for the one given up ({request_timeout:?})");
        faults.clear();
        tokio::time::timeout(Duration::from_secs(10), later).await.unwrap().unwrap().unwrap();
        let mut data = [0u8; 4096];
        vol.read_at(&mut data, 0).await.unwrap();
        assert_eq!(data, [2; 4096], "the acknowledged write is the one that stays ({request_timeout:?})");
        drop(vol);
        srv.stop().await;
    }
}
