//! The NBD front end through raw bytes: handshake options, replies, and
//! every kind of bad input (right error, or a clean close of that connection
//! alone), while another client keeps being served.

mod common;

use common::{NbdRaw, TestServer};
use fastsan_initiator::{Options, Volume};
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{InfoRequest, MetaContextRequest};
use std::time::Duration;

const VOLS: &[&str] = &["v=memory:128M", "ro=memory:16M,ro"];

fn nbd_addr(s: &TestServer) -> std::net::SocketAddr {
    s.nbd.expect("NBD listener")
}

/// A BRP client doing real work on the same volume meanwhile.
async fn bystander_works(srv: &TestServer) {
    let vol = Volume::connect(&srv.url("v"), Options { connections: 1, ..Default::default() }).await.unwrap();
    vol.write_at(&[9; 4096], 12 << 20, false).await.unwrap();
    assert_eq!(vol.read(12 << 20, 4096).await.unwrap()[..], [9; 4096][..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_options_answer_per_spec() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let mut c = NbdRaw::connect(nbd_addr(&srv)).await;
    // Unknown options: ERR_UNSUP, and the handshake goes on.
    c.option(77, b"whatever").await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_UNSUP);
    c.option(OPT_STARTTLS, &[]).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_UNSUP);
    // LIST: one REP_SERVER per volume, then ACK; LIST with data is invalid.
    c.option(OPT_LIST, &[]).await;
    let mut names = Vec::new();
    loop {
        let (t, d) = c.option_reply().await.unwrap();
        if t == REP_ACK {
            break;
        }
        assert_eq!(t, REP_SERVER);
        let n = u32::from_be_bytes(d[..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(d[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, ["v", "ro"]);
    c.option(OPT_LIST, b"x").await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_INVALID);
    // INFO of an unknown export, of a name over 4096 bytes, of a malformed payload.
    c.option(OPT_INFO, &InfoRequest { name: "nope".into(), infos: vec![] }.encode()).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_UNKNOWN);
    c.option(OPT_INFO, &InfoRequest { name: "a".repeat(5000), infos: vec![] }.encode()).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_INVALID);
    c.option(OPT_GO, &[0, 0, 0, 9, b'v']).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_INVALID);
    // "" is not a default export when there are two volumes.
    c.option(OPT_INFO, &InfoRequest { name: "".into(), infos: vec![] }.encode()).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_UNKNOWN);
    // INFO of the read-only volume: size, flags and block sizes, then ACK.
    c.option(OPT_INFO, &InfoRequest { name: "ro".into(), infos: vec![INFO_NAME, INFO_BLOCK_SIZE] }.encode())
        .await;
    let mut seen = Vec::new();
    loop {
        let (t, d) = c.option_reply().await.unwrap();
        if t == REP_ACK {
            break;
        }
        let kind = u16::from_be_bytes([d[0], d[1]]);
        if kind == INFO_EXPORT {
            let flags = u16::from_be_bytes([d[10], d[11]]);
            assert!(flags & TFLAG_READ_ONLY != 0 && flags & TFLAG_SEND_TRIM == 0, "{flags:#x}");
        }
        if kind == INFO_BLOCK_SIZE {
            assert_eq!(&d[2..], &[0, 0, 0, 1, 0, 0, 16, 0, 4, 0, 0, 0], "min 1, preferred 4096, max 64 MiB");
        }
        seen.push(kind);
    }
    assert!(seen.contains(&INFO_EXPORT) && seen.contains(&INFO_NAME) && seen.contains(&INFO_BLOCK_SIZE));
    // Meta contexts: SET before structured replies is invalid; LIST works.
    let q = |qs: &[&str]| MetaContextRequest {
        name: "v".into(),
        queries: qs.iter().map(|s| s.to_string()).collect(),
    };
    c.option(OPT_SET_META_CONTEXT, &q(&["base:allocation"]).encode()).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_INVALID);
    c.option(OPT_LIST_META_CONTEXT, &q(&["base:"]).encode()).await;
    let (t, d) = c.option_reply().await.unwrap();
    assert_eq!((t, &d[4..]), (REP_META_CONTEXT, CONTEXT_BASE_ALLOCATION.as_bytes()));
    assert_eq!(c.option_reply().await.unwrap().0, REP_ACK);
    c.option(OPT_LIST_META_CONTEXT, &q(&["qemu:dirty-bitmap:x"]).encode()).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ACK, "unknown namespaces are ignored");
    c.option(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ACK);
    c.option(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_INVALID, "only once");
    // ABORT: ACK, then the server closes.
    c.option(OPT_ABORT, &[]).await;
    assert_eq!(c.option_reply().await.unwrap().0, REP_ACK);
    assert!(c.closed_within(Duration::from_secs(5)).await);
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_option_and_default_export() {
    let srv = TestServer::start(&["only=memory:8M"], |_| {}).await;
    let mut c = NbdRaw::connect(nbd_addr(&srv)).await;
    c.option(OPT_EXPORT_NAME, b"").await;
    let r = c.take(10).await.unwrap();
    assert_eq!(u64::from_be_bytes(r[..8].try_into().unwrap()), 8 << 20, "\"\" is the default export");
    c.request(CMD_READ, 0, 1, 0, 512, &[]).await;
    let (e, cookie, d) = c.simple(512).await;
    assert_eq!((e, cookie, d.len()), (0, 1, 512));
    // EXPORT_NAME of an unknown export has no error reply: the server closes.
    let mut c = NbdRaw::connect(nbd_addr(&srv)).await;
    c.option(OPT_EXPORT_NAME, b"nope").await;
    assert!(c.closed_within(Duration::from_secs(5)).await);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_handshakes_are_bounded() {
    let srv = TestServer::start(VOLS, |c| {
        c.handshake_timeout = Duration::from_millis(300);
        // Three handshakes at once from one address.
        c.max_handshakes = 12;
    })
    .await;
    let addr = nbd_addr(&srv);
    // Unknown client flags: closed.
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut greet = [0u8; 18];
    tokio::io::AsyncReadExt::read_exact(&mut raw, &mut greet).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut raw, &0x8000_0000u32.to_be_bytes()).await.unwrap();
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), tokio::io::AsyncReadExt::read(&mut raw, &mut b))
        .await
        .unwrap();
    assert!(matches!(n, Ok(0) | Err(_)), "closed after unknown client flags");
    // An option payload over the cap: ERR_TOO_BIG, then closed (no 4 GiB read).
    let mut c = NbdRaw::connect(addr).await;
    let mut hdr = Vec::new();
    hdr.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hdr.extend_from_slice(&OPT_GO.to_be_bytes());
    hdr.extend_from_slice(&u32::MAX.to_be_bytes());
    tokio::io::AsyncWriteExt::write_all(&mut c.s, &hdr).await.unwrap();
    assert_eq!(c.option_reply().await.unwrap().0, REP_ERR_TOO_BIG);
    assert!(c.closed_within(Duration::from_secs(5)).await);
    // Garbage instead of an option: closed.
    let mut c = NbdRaw::connect(addr).await;
    tokio::io::AsyncWriteExt::write_all(&mut c.s, b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(c.closed_within(Duration::from_secs(5)).await);
    // A client that never finishes the handshake: closed at the timeout.
    let mut c = NbdRaw::connect(addr).await;
    c.option(OPT_LIST, &[]).await;
    let t = std::time::Instant::now();
    assert!(c.closed_within(Duration::from_secs(5)).await);
    assert!(t.elapsed() < Duration::from_secs(3));
    // A flood: past the cap, connections are closed at once.
    let mut flood = Vec::new();
    for _ in 0..3 {
        flood.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut extra = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 32];
    let n = tokio::time::timeout(Duration::from_secs(2), tokio::io::AsyncReadExt::read(&mut extra, &mut b))
        .await
        .unwrap();
    assert!(matches!(n, Ok(0) | Err(_)), "over the cap: closed without a greeting");
    drop(flood);
    tokio::time::sleep(Duration::from_millis(400)).await;
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transmission_errors_keep_the_connection() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let mut c = NbdRaw::connect(nbd_addr(&srv)).await;
    let (size, flags) = c.go("v", false, false).await;
    assert_eq!(size, 128 << 20);
    assert!(flags & TFLAG_SEND_DF == 0, "no DF without structured replies");
    // Each bad request gets its error; a good read follows on the same connection.
    let cases: &[(u16, u16, u64, u32, usize, u32)] = &[
        (CMD_READ, 0, size, 512, 0, EINVAL),                // read beyond the end
        (CMD_WRITE, 0, size - 512, 4096, 4096, ENOSPC),     // write beyond the end; payload consumed
        (CMD_WRITE_ZEROES, 0, size, 512, 0, ENOSPC),        // zeroes beyond the end
        (CMD_TRIM, 0, size, 512, 0, EINVAL),                // trim beyond the end
        (99, 0, 0, 512, 0, EINVAL),                         // unknown command
        (CMD_READ, 0x40, 0, 512, 0, EINVAL),                // unknown flag
        (CMD_READ, CMD_FLAG_DF, 0, 512, 0, EINVAL),         // DF without structured replies
        (CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 512, 512, EINVAL), // a flag that is not WRITE's
        (CMD_BLOCK_STATUS, 0, 0, 512, 0, EINVAL),           // no context negotiated
        (CMD_READ, 0, 0, (64 << 20) + 1, 0, EINVAL),        // read over 64 MiB
    ];
    for (i, &(cmd, fl, off, len, payload, errno)) in cases.iter().enumerate() {
        c.request(cmd, fl, 100 + i as u64, off, len, &vec![0xEE; payload]).await;
        c.request(CMD_READ, 0, 7, 0, 512, &[]).await;
        let (e, cookie, _) = c.simple(0).await;
        assert_eq!((e, cookie), (errno, 100 + i as u64), "case {i}");
        let (e, cookie, d) = c.simple(512).await;
        assert_eq!((e, cookie, d.len()), (0, 7, 512), "after case {i}");
    }
    // A WRITE over 64 MiB: refused, its 65 MiB payload read and dropped, the stream stays in sync.
    let big = vec![0x5Au8; 65 << 20];
    c.request(CMD_WRITE, 0, 200, 0, big.len() as u32, &big).await;
    c.request(CMD_READ, 0, 201, 0, 4096, &[]).await;
    assert_eq!(c.simple(0).await.0, EINVAL);
    let (e, cookie, d) = c.simple(4096).await;
    assert_eq!((e, cookie), (0, 201));
    assert!(d.iter().all(|&b| b == 0), "nothing of the refused write landed");
    // Requests up to 64 MiB are served (nbdkit's limit; the reference server's is higher).
    let max = vec![0x33u8; 64 << 20];
    c.request(CMD_WRITE, CMD_FLAG_FUA, 202, 0, max.len() as u32, &max).await;
    assert_eq!(c.simple(0).await.0, 0);
    c.request(CMD_READ, 0, 203, 0, max.len() as u32, &[]).await;
    assert!(c.simple(max.len()).await.2 == max);
    // Read-only: EPERM for every change.
    let mut r = NbdRaw::connect(nbd_addr(&srv)).await;
    r.go("ro", false, false).await;
    for (i, (cmd, payload)) in
        [(CMD_WRITE, 512usize), (CMD_TRIM, 0), (CMD_WRITE_ZEROES, 0)].into_iter().enumerate()
    {
        r.request(cmd, 0, i as u64, 0, 512, &vec![1; payload]).await;
        assert_eq!(r.simple(0).await.0, EPERM, "{cmd}");
    }
    // DISC: the server closes once replies are out.
    c.request(CMD_DISC, 0, 0, 0, 0, &[]).await;
    assert!(c.closed_within(Duration::from_secs(5)).await);
    assert_eq!(srv.handle.stats().protocol_errors, 0);
    bystander_works(&srv).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_replies_and_block_status() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let mut c = NbdRaw::connect(nbd_addr(&srv)).await;
    let (_, flags) = c.go("v", true, true).await;
    assert!(flags & TFLAG_SEND_DF != 0);
    // A fresh volume: one extent, hole and zero.
    c.request(CMD_BLOCK_STATUS, 0, 1, 0, 1 << 20, &[]).await;
    let (fl, ty, cookie, p) = c.chunk().await;
    assert_eq!((fl, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 1));
    assert_eq!(p[4..], [0, 16, 0, 0, 0, 0, 0, 3], "1 MiB hole|zero");
    // Write 4 KiB at 256 KiB: data where it landed (a 256 KiB chunk), holes around it.
    c.request(CMD_WRITE, 0, 2, 256 << 10, 4096, &[7; 4096]).await;
    assert_eq!(c.simple(0).await.0, 0);
    c.request(CMD_BLOCK_STATUS, 0, 3, 0, 1 << 20, &[]).await;
    let (_, _, _, p) = c.chunk().await;
    let ext: Vec<(u32, u32)> = p[4..]
        .chunks(8)
        .map(|e| {
            (u32::from_be_bytes(e[..4].try_into().unwrap()), u32::from_be_bytes(e[4..].try_into().unwrap()))
        })
        .collect();
    assert_eq!(ext, [(256 << 10, 3), (256 << 10, 0), (512 << 10, 3)]);
    c.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4, 0, 1 << 20, &[]).await;
    let (_, _, _, p) = c.chunk().await;
    assert_eq!(p.len(), 12, "REQ_ONE: one extent");
    // READ: one OFFSET_DATA chunk with the offset; DF is accepted.
    c.request(CMD_READ, CMD_FLAG_DF, 5, 256 << 10, 4096, &[]).await;
    let (fl, ty, cookie, p) = c.chunk().await;
    assert_eq!((fl, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 5));
    assert_eq!(u64::from_be_bytes(p[..8].try_into().unwrap()), 256 << 10);
    assert_eq!(p[8..], [7; 4096]);
    // Errors come as ERROR chunks.
    c.request(CMD_READ, 0, 6, 128 << 20, 512, &[]).await;
    let (fl, ty, cookie, p) = c.chunk().await;
    assert_eq!((fl, ty, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6));
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), EINVAL);
    // Non-data replies stay simple.
    c.request(CMD_FLUSH, 0, 8, 0, 0, &[]).await;
    assert_eq!(c.simple(0).await, (0, 8, vec![]));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_visible_across_connections_and_protocols() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let mut a = NbdRaw::connect(nbd_addr(&srv)).await;
    a.go("v", false, false).await;
    let mut b = NbdRaw::connect(nbd_addr(&srv)).await;
    b.go("v", false, false).await;
    a.request(CMD_WRITE, 0, 1, 8192, 4096, &[0xA1; 4096]).await;
    assert_eq!(a.simple(0).await.0, 0);
    b.request(CMD_FLUSH, 0, 2, 0, 0, &[]).await;
    assert_eq!(b.simple(0).await.0, 0);
    b.request(CMD_READ, 0, 3, 8192, 4096, &[]).await;
    assert_eq!(b.simple(4096).await.2, vec![0xA1; 4096], "CAN_MULTI_CONN: acknowledged writes are seen");
    // NBD and BRP share the volume.
    let vol = Volume::connect(&srv.url("v"), Options::default()).await.unwrap();
    assert_eq!(vol.read(8192, 4096).await.unwrap()[..], [0xA1; 4096][..]);
    vol.write_at(&[0xB2; 4096], 16384, false).await.unwrap();
    a.request(CMD_READ, 0, 4, 16384, 4096, &[]).await;
    assert_eq!(a.simple(4096).await.2, vec![0xB2; 4096]);
    drop(vol);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_listener() {
    let path = std::env::temp_dir().join(format!("fastsan-nbd-{}.sock", std::process::id()));
    let p2 = path.clone();
    let srv = TestServer::start(&["v=memory:1M"], move |c| c.nbd_unix = Some(p2)).await;
    let s = tokio::net::UnixStream::connect(&path).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let mut g = [0u8; 18];
    tokio::io::AsyncReadExt::read_exact(&mut rd, &mut g).await.unwrap();
    assert_eq!(g[..8], NBDMAGIC.to_be_bytes());
    tokio::io::AsyncWriteExt::write_all(&mut wr, &3u32.to_be_bytes()).await.unwrap();
    let mut opt = Vec::new();
    fastsan_nbd::handshake::encode_option(OPT_EXPORT_NAME, b"v", &mut opt);
    tokio::io::AsyncWriteExt::write_all(&mut wr, &opt).await.unwrap();
    let mut r = [0u8; 10];
    tokio::io::AsyncReadExt::read_exact(&mut rd, &mut r).await.unwrap();
    assert_eq!(u64::from_be_bytes(r[..8].try_into().unwrap()), 1 << 20);
    srv.stop().await;
    assert!(!path.exists(), "the socket file is removed at shutdown");
}

/// fastsan's own NBD client with large reads in flight together (each
/// received into a buffer of its own and recycled): every byte as written,
/// across sizes on both sides of the threshold, and the volume goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nbd_client_reads_large_replies_whole() {
    let srv = TestServer::start(VOLS, |_| {}).await;
    let url = format!("nbd://{}/v", nbd_addr(&srv));
    let vol = fastsan_initiator::nbd::NbdVolume::connect(&url, &Options::default()).await.unwrap();
    let data = common::pattern(7, 0, 16 << 20);
    vol.write_at(&data, 0, false).await.unwrap();
    for round in 0..3 {
        let sizes = [65535usize, 65536, 1 << 20, 3 << 20, 4096, 200_000];
        let reads = sizes.iter().enumerate().map(|(i, &n)| {
            let at = (i * 1_234_567 + round * 99_999) % ((16 << 20) - n);
            let vol = &vol;
            async move { (at, n, vol.read(at as u64, n as u64).await.unwrap()) }
        });
        for (at, n, got) in futures::future::join_all(reads).await {
            assert!(got[..] == data[at..at + n], "round {round}: {n} bytes at {at}");
        }
    }
    bystander_works(&srv).await;
    srv.stop().await;
}
