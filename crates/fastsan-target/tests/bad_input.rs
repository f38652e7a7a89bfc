//! Bad input from the network: each gets the right error reply, or a clean
//! close of that connection alone; the server never falls over and another
//! client keeps being served throughout.

mod common;

use common::{Raw, TestServer};
use fastsan_brp::batch::BatchBuilder;
use fastsan_brp::handshake::Message;
use fastsan_brp::request::{encode_header, RequestHeader};
use fastsan_brp::{Command, Status};
use fastsan_initiator::{Error, Options, Volume};
use std::time::Duration;

const VOLS: &[&str] = &["v=memory:16M", "ro=memory:16M,ro"];

/// Another client, doing real work, while the bad one misbehaves.
async fn bystander_works(srv: &TestServer) {
    let vol = Volume::connect(&srv.url("v"), Options { connections: 1, ..Default::default() }).await.unwrap();
    let data = common::pattern(99, 8192, 8192);
    vol.write_at(&data, 8192, false).await.unwrap();
    assert_eq!(vol.read(8192, 8192).await.unwrap()[..], data[..]);
}

/// Sends one request, expects `status` for it, then checks the same
/// connection still serves a good read.
async fn refused_then_served(raw: &mut Raw, h: RequestHeader, payload: &[u8], status: Status) {
    raw.request(h, payload).await;
    raw.request(RequestHeader::new(Command::Read, 0, 777, 0, 512), &[]).await;
    let (r, data) = raw.reply().await;
    assert_eq!((r.tag, r.status), (h.tag, status), "{h:?}");
    assert!(data.is_empty());
    let (r, data) = raw.reply().await;
    assert_eq!((r.tag, r.status, data.len()), (777, Status::OK, 512), "the connection goes on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn well_formed_but_invalid_requests_get_error_replies() {
    let srv = TestServer::start(VOLS, |c| c.max_transfer = 1 << 20).await;
    let (mut raw, info) = Raw::open(srv.addr, "v").await;
    let size = info.size;
    let read = |tag, off, len| RequestHeader::new(Command::Read, 0, tag, off, len);
    refused_then_served(&mut raw, read(1, size, 512), &[], Status::OUT_OF_RANGE).await;
    refused_then_served(&mut raw, read(2, u64::MAX - 511, 512), &[], Status::OUT_OF_RANGE).await;
    refused_then_served(&mut raw, read(3, 100, 512), &[], Status::MISALIGNED).await;
    refused_then_served(&mut raw, read(4, 0, 1000), &[], Status::MISALIGNED).await;
    refused_then_served(&mut raw, read(5, 0, 2 << 20), &[], Status::TOO_LARGE).await;
    refused_then_served(&mut raw, read(6, 0, 0), &[], Status::INVALID).await;
    refused_then_served(&mut raw, RequestHeader::new(Command::Read, 0x40, 7, 0, 512), &[], Status::INVALID)
        .await;
    // Unknown commands, with and without a payload: consumed, refused, the stream stays in sync.
    refused_then_served(
        &mut raw,
        RequestHeader::new(Command::Unknown(0x77), 0, 8, 0, 512),
        &[],
        Status::UNSUPPORTED,
    )
    .await;
    let mut h = RequestHeader::new(Command::Unknown(200), 0, 9, 0, 512);
    h.payload_len = 1000;
    refused_then_served(&mut raw, h, &[0xEE; 1000], Status::UNSUPPORTED).await;
    // A write out of range: its payload is consumed too.
    let w = RequestHeader::new(Command::Write, 0, 10, size - 512, 4096);
    refused_then_served(&mut raw, w, &[1; 4096], Status::OUT_OF_RANGE).await;
    let st = srv.handle.stats();
    assert_eq!((st.errors, st.protocol_errors), (10, 0));
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_volume_refuses_changes_and_consumes_payload() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let (mut raw, info) = Raw::open(srv.addr, "ro").await;
    assert!(info.read_only());
    refused_then_served(
        &mut raw,
        RequestHeader::new(Command::Write, 0, 1, 0, 65536),
        &[7; 65536],
        Status::READ_ONLY,
    )
    .await;
    refused_then_served(&mut raw, RequestHeader::new(Command::Trim, 0, 2, 0, 4096), &[], Status::READ_ONLY)
        .await;
    refused_then_served(
        &mut raw,
        RequestHeader::new(Command::WriteZeroes, 0, 3, 0, 4096),
        &[],
        Status::READ_ONLY,
    )
    .await;
    // The initiator reports the same status as an error.
    let vol = Volume::connect(&srv.url("ro"), Options::default()).await.unwrap();
    match vol.write_at(&[1; 512], 0, false).await {
        Err(Error::Status(s)) => assert_eq!(s, Status::READ_ONLY),
        other => panic!("expected READ_ONLY, got {other:?}"),
    }
    assert!(vol.read(0, 512).await.unwrap().iter().all(|&b| b == 0), "nothing was written");
    bystander_works(&srv).await;
    srv.stop().await;
}

/// Malformed frames close that connection only.
async fn closes_connection(srv: &TestServer, bytes: Vec<u8>, after_open: bool) {
    let mut raw = if after_open { Raw::open(srv.addr, "v").await.0 } else { Raw::connect(srv.addr).await };
    raw.send(&bytes).await;
    assert!(raw.closed_within(Duration::from_secs(5)).await, "connection closed");
    bystander_works(srv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_only_their_connection() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let keep =
        Volume::connect(&srv.url("v"), Options { connections: 1, ..Default::default() }).await.unwrap();
    // Garbage instead of HELLO, and garbage instead of a request.
    closes_connection(&srv, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false).await;
    closes_connection(&srv, vec![0xA5; 64], true).await;
    // Length fields beyond the limits: refused before any byte of payload arrives.
    let mut h = RequestHeader::new(Command::Write, 0, 1, 0, 4096);
    h.payload_len = u32::MAX;
    closes_connection(&srv, h.encode().to_vec(), true).await;
    let mut hs = Message::List.to_vec();
    hs[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    closes_connection(&srv, hs, false).await;
    // A BATCH whose sizes do not add up, and a BATCH inside a BATCH.
    let mut b = BatchBuilder::default();
    b.push(&RequestHeader::new(Command::Write, 0, 1, 0, 512));
    let (mut bh, subs) = b.finish();
    bh.payload_len -= 1;
    let mut frame = Vec::new();
    encode_header(&bh, false, &mut frame);
    frame.extend_from_slice(&subs);
    frame.extend_from_slice(&[0; 511]);
    closes_connection(&srv, frame, true).await;
    let mut b = BatchBuilder::default();
    b.push(&RequestHeader { command: Command::Batch, ..RequestHeader::new(Command::Read, 0, 1, 0, 512) });
    let (bh, subs) = b.finish();
    let mut frame = Vec::new();
    encode_header(&bh, false, &mut frame);
    frame.extend_from_slice(&subs);
    closes_connection(&srv, frame, true).await;
    // A request before the handshake, and an OPEN before HELLO.
    closes_connection(&srv, RequestHeader::new(Command::Read, 0, 1, 0, 512).encode().to_vec(), false).await;
    let mut raw = Raw::connect(srv.addr).await;
    match raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: "v".into() }).await {
        Message::Error { status, .. } => assert_eq!(status, Status::UNEXPECTED),
        other => panic!("{other:?}"),
    }
    assert!(raw.closed_within(Duration::from_secs(5)).await);
    assert!(srv.handle.stats().protocol_errors >= 7);
    // The connection opened before all this still works.
    keep.write_at(&[3; 4096], 0, true).await.unwrap();
    assert_eq!(keep.read(0, 4096).await.unwrap()[..], [3; 4096][..]);
    drop(keep);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_volume_and_version_are_refused_politely() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let mut raw = Raw::connect(srv.addr).await;
    match raw.ask(&Message::Hello { min_version: 3, max_version: 9, features: 0 }).await {
        Message::Error { status, .. } => assert_eq!(status, Status::BAD_VERSION),
        other => panic!("{other:?}"),
    }
    let mut raw = Raw::connect(srv.addr).await;
    raw.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0xFFFF_FFFF }).await;
    match raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: "nope".into() }).await {
        Message::Error { status, .. } => assert_eq!(status, Status::NO_SUCH_VOLUME),
        other => panic!("{other:?}"),
    }
    // The handshake goes on after a refused OPEN.
    let Message::ListReply { volumes } = raw.ask(&Message::List).await else { panic!() };
    assert_eq!(volumes.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["v", "ro"]);
    assert!(matches!(
        raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: "v".into() }).await,
        Message::OpenReply(_)
    ));
    bystander_works(&srv).await;
    srv.stop().await;
}

/// Silent clients time out; a flood of them from one address fills only
/// that address's handshake places (others still connect), and never takes
/// a connection slot; past the connection cap, OPEN is answered BUSY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_time_out_and_floods_are_capped() {
    let srv = TestServer::start(VOLS, |c| {
        c.handshake_timeout = Duration::from_millis(300);
        // Four handshakes at once from one address.
        c.max_handshakes = 16;
        c.max_connections = 2;
    })
    .await;
    // Connects and says nothing: closed at the handshake timeout.
    let mut silent = Raw::connect(srv.addr).await;
    let t = std::time::Instant::now();
    assert!(silent.closed_within(Duration::from_secs(5)).await);
    assert!(t.elapsed() >= Duration::from_millis(250), "not before the timeout");
    // A flood from one address: past its share, connections are told BUSY and closed.
    let mut flood = Vec::new();
    for _ in 0..4 {
        flood.push(Raw::connect_from(srv.addr, "127.0.0.1").await);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut extra = Raw::connect_from(srv.addr, "127.0.0.1").await;
    match extra.message().await {
        Some(Message::Error { status, .. }) => assert_eq!(status, Status::BUSY),
        other => panic!("expected BUSY, got {other:?}"),
    }
    // Another address gets through the flood, and so do two whole connections.
    let mut a = Raw::connect_from(srv.addr, "127.0.0.2").await;
    assert!(matches!(a.hello_open("v").await, Message::OpenReply(_)));
    let mut b = Raw::connect_from(srv.addr, "127.0.0.3").await;
    assert!(matches!(b.hello_open("v").await, Message::OpenReply(_)));
    // Both connection slots are taken: the next OPEN is answered BUSY.
    let mut c = Raw::connect_from(srv.addr, "127.0.0.4").await;
    match c.hello_open("v").await {
        Message::Error { status, .. } => assert_eq!(status, Status::BUSY),
        other => panic!("expected BUSY, got {other:?}"),
    }
    drop((a, b));
    // When the flood times out, its places come back.
    for mut f in flood {
        assert!(f.closed_within(Duration::from_secs(5)).await);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    bystander_works(&srv).await;
    srv.stop().await;
}

/// Silent clients from four addresses take every handshake place. For a
/// second the gate answers newcomers BUSY; after it, a newcomer closes the
/// oldest silent handshake and takes its place. (Until 2026-11-29 such
/// clients, one connection per address and handshake timeout, kept every
/// other client out, reconnects of live sessions included.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_handshake_gate_makes_room_by_closing_its_oldest_silent_client() {
    let srv = TestServer::start(VOLS, |c| {
        c.max_handshakes = 8; // two at once from one address
        c.handshake_timeout = Duration::from_secs(30);
    })
    .await;
    let mut silent = Vec::new();
    for from in ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"] {
        for _ in 0..2 {
            silent.push(Raw::connect_from(srv.addr, from).await);
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut early = Raw::connect_from(srv.addr, "127.0.0.6").await;
    match early.message().await {
        Some(Message::Error { status, .. }) => assert_eq!(status, Status::BUSY),
        other => panic!("expected BUSY while every handshake is younger than a second, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut late = Raw::connect_from(srv.addr, "127.0.0.6").await;
    assert!(matches!(late.hello_open("v").await, Message::OpenReply(_)), "the newcomer got in");
    let mut closed = 0;
    for s in &mut silent {
        closed += s.closed_within(Duration::from_millis(100)).await as usize;
    }
    assert_eq!(closed, 1, "exactly one silent handshake made room");
    drop(late);
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_digest_mismatch_is_refused_and_the_connection_goes_on() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let (mut raw, _) = Raw::open_with(srv.addr, "v", fastsan_brp::FEATURE_DIGEST).await;
    assert!(raw.digests);
    let h = RequestHeader::new(Command::Write, 0, 5, 0, 512);
    let mut frame = Vec::new();
    encode_header(&h, true, &mut frame);
    frame.extend_from_slice(&[9; 512]);
    frame.extend_from_slice(&[0, 0, 0, 0]); // wrong digest
    raw.send(&frame).await;
    let (r, _) = raw.reply().await;
    assert_eq!((r.tag, r.status), (5, Status::DIGEST_MISMATCH));
    raw.request(RequestHeader::new(Command::Read, 0, 6, 0, 512), &[]).await;
    let (r, data) = raw.reply().await;
    assert_eq!((r.tag, r.status), (6, Status::OK));
    assert_eq!(data, vec![0; 512], "the corrupted write was not applied");
    // A corrupted header digest cannot be trusted: the connection closes.
    let mut frame = Vec::new();
    encode_header(&RequestHeader::new(Command::Read, 0, 7, 0, 512), true, &mut frame);
    frame[10] ^= 1;
    raw.send(&frame).await;
    assert!(raw.closed_within(Duration::from_secs(5)).await);
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication() {
    let srv = TestServer::start(VOLS, |c| {
        c.secret = Some(b"s3cret".to_vec());
        c.nbd = None; // NBD cannot check a secret
    })
    .await;
    let with = |s: &[u8]| Options { secret: Some(s.to_vec()), ..Default::default() };
    // The right secret works.
    let vol = Volume::connect(&srv.url("v"), with(b"s3cret")).await.unwrap();
    vol.write_at(&[4; 512], 0, false).await.unwrap();
    // A wrong secret is refused, and so is no secret.
    match Volume::connect(&srv.url("v"), with(b"guess")).await {
        Err(Error::Refused { status, .. }) => assert_eq!(status, Status::AUTH_FAILED),
        other => panic!("expected AUTH_FAILED, got {:?}", other.err()),
    }
    assert!(matches!(Volume::connect(&srv.url("v"), Options::default()).await, Err(Error::SecretRequired)));
    // A raw client that skips AUTH gets AUTH_REQUIRED and is closed.
    let mut raw = Raw::connect(srv.addr).await;
    let Message::HelloReply { auth, .. } =
        raw.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0 }).await
    else {
        panic!()
    };
    assert_eq!(auth, fastsan_brp::handshake::AUTH_HMAC_SHA256);
    match raw.ask(&Message::List).await {
        Message::Error { status, .. } => assert_eq!(status, Status::AUTH_REQUIRED),
        other => panic!("{other:?}"),
    }
    assert!(raw.closed_within(Duration::from_secs(5)).await);
    assert_eq!(srv.handle.stats().auth_failures, 2);
    // A client holding a secret refuses a target that asks for none.
    let open = TestServer::start(VOLS, |_| {}).await;
    assert!(matches!(
        Volume::connect(&open.url("v"), with(b"s3cret")).await,
        Err(Error::TargetNotAuthenticated)
    ));
    assert_eq!(vol.read(0, 512).await.unwrap()[..], [4; 512][..], "the authenticated client kept working");
    drop(vol);
    srv.stop().await;
    open.stop().await;
}

/// Wrong secrets sent together on many connections from one address (each
/// handshake waiting at AUTH first) are checked ten times at most: the rest
/// are refused without a check and not counted again, and the right secret
/// from another address is served. (That tries in flight count before any
/// finishes is the handshake's unit test `tries_at_a_secret_count_as_they_begin`:
/// over sockets the race is rarely lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_guessed_in_parallel_are_limited_too() {
    let srv = TestServer::start(VOLS, |c| {
        c.secret = Some(b"s3cret".to_vec());
        c.nbd = None;
    })
    .await;
    // 16: as many handshakes as one address may hold at once.
    let mut raws = Vec::new();
    for _ in 0..16 {
        let mut raw = Raw::connect_from(srv.addr, "127.0.0.7").await;
        let Message::HelloReply { auth, .. } =
            raw.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0 }).await
        else {
            panic!("expected HELLO_REPLY")
        };
        assert_eq!(auth, fastsan_brp::handshake::AUTH_HMAC_SHA256);
        raws.push(raw);
    }
    let guess = Message::Auth { client_nonce: [1; 32], proof: [2; 32], identity: String::new() }.to_vec();
    for raw in &mut raws {
        raw.send(&guess).await;
    }
    let (mut checked, mut limited) = (0, 0);
    for raw in &mut raws {
        match raw.message().await {
            Some(Message::Error { status, message }) if status == Status::AUTH_FAILED => {
                if message.contains("too many failed authentications") {
                    limited += 1;
                } else {
                    assert_eq!(message, "authentication failed");
                    checked += 1;
                }
            }
            other => panic!("{other:?}"),
        }
        assert!(raw.closed_within(Duration::from_secs(5)).await);
    }
    assert_eq!((checked, limited), (fastsan_target::access::MAX_FAILURES as usize, 6));
    assert_eq!(srv.handle.stats().auth_failures, 10, "only the checked tries count as failures");
    // Another address, the right secret: served.
    let with = Options { secret: Some(b"s3cret".to_vec()), ..Default::default() };
    let vol = Volume::connect(&srv.url("v"), with).await.unwrap();
    vol.write_at(&[6; 512], 0, false).await.unwrap();
    assert_eq!(vol.read(0, 512).await.unwrap()[..], [6; 512][..]);
    drop(vol);
    srv.stop().await;
}

/// A volume the client has no grant for is answered as one that is not
/// there, in the same words, over BRP and NBD (LIST hides it too): no name
/// can be learnt by trying names. Eight such tries close the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_not_granted_look_missing_and_guessing_is_cut_short() {
    use fastsan_nbd::consts::*;
    use fastsan_nbd::handshake::InfoRequest;
    let srv = TestServer::start(&["open=memory:1M", "hidden=memory:1M"], |c| {
        c.grants = vec![fastsan_target::access::Grant::parse("hidden:alice").unwrap()]
    })
    .await;
    let answer = |m: Message| match m {
        Message::Error { status, message } => {
            (status, message.replace("\"hidden\"", "NAME").replace("\"nope\"", "NAME"))
        }
        other => panic!("{other:?}"),
    };
    let mut raw = Raw::connect(srv.addr).await;
    raw.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0 }).await;
    let hidden =
        answer(raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: "hidden".into() }).await);
    let missing =
        answer(raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: "nope".into() }).await);
    assert_eq!(hidden, missing, "a volume not granted answers as a missing one");
    assert_eq!(hidden.0, Status::NO_SUCH_VOLUME);
    for i in 2..8 {
        let name = format!("guess{i}");
        assert!(matches!(
            raw.ask(&Message::Open { session: 0, slot: 0, flags: 0, name }).await,
            Message::Error { .. }
        ));
    }
    assert!(raw.closed_within(Duration::from_secs(5)).await, "closed after 8 refused OPENs");

    let mut c = common::NbdRaw::connect(srv.nbd.unwrap()).await;
    let mut replies = Vec::new();
    for name in ["hidden", "nope"] {
        c.option(OPT_INFO, &InfoRequest { name: name.into(), infos: vec![] }.encode()).await;
        let (t, d) = c.option_reply().await.unwrap();
        replies.push((t, String::from_utf8_lossy(&d).replace(name, "NAME")));
    }
    assert_eq!(replies[0], replies[1], "the same reply over NBD");
    assert_eq!(replies[0].0, REP_ERR_UNKNOWN);
    drop(c);
    // Another client goes on, with what it may open.
    let v = Volume::connect(&srv.url("open"), Options::default()).await.unwrap();
    v.write_at(&[5; 4096], 0, false).await.unwrap();
    assert_eq!(v.read(0, 4096).await.unwrap()[..], [5; 4096][..]);
    drop(v);
    srv.stop().await;
}
