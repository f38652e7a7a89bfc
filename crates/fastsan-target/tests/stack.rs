//! The backend stack seen from the wire: a fault injected in a volume's
//! stack reaches BRP and NBD clients as each protocol's own error, the
//! connection goes on, and other clients (of the same volume, outside the
//! fault, and of other volumes) are not affected. Also: BRP on a unix socket,
//! and large reads lent from a memory volume (no copy) over BRP and NBD.

mod common;

use common::{pattern, NbdRaw, Raw, TestServer};
use fastsan_brp::request::RequestHeader;
use fastsan_brp::{Command, Status};
use fastsan_initiator::{Options, Volume};
use fastsan_nbd::consts::*;
use fastsan_target::backend::{BackendError, Effect, FaultOps, FaultRule};

const MIB: u64 = 1 << 20;

/// An error and its sources, as the command line prints them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut at = e.source();
    while let Some(c) = at {
        s += &format!(": {c}");
        at = c.source();
    }
    s
}

/// Writes and reads back a pattern through the initiator, `rounds` times.
async fn bystander(url: String, at: u64, rounds: u64) {
    let vol = Volume::connect(&url, Options { connections: 1, ..Default::default() }).await.unwrap();
    for i in 0..rounds {
        let data = pattern(i, at, 64 << 10);
        vol.write_at(&data, at, false).await.unwrap();
        assert_eq!(vol.read(at, 64 << 10).await.unwrap()[..], data[..]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_eio_reaches_brp_and_nbd_as_their_error_and_others_go_on() {
    let srv = TestServer::start(&["f=memory:16M,faults=read+write:eio@1M-2M", "g=memory:16M"], |_| {}).await;
    let others = tokio::spawn(futures::future::join(
        bystander(srv.url("f"), 8 * MIB, 50),
        bystander(srv.url("g"), MIB, 50),
    ));

    // BRP: the faulty range answers IO_ERROR, the rest OK, on one connection.
    let (mut b, _) = Raw::open(srv.addr, "f").await;
    b.request(RequestHeader::new(Command::Write, 0, 1, MIB, 4096), &[7; 4096]).await;
    assert_eq!(b.reply().await.0.status, Status::IO_ERROR);
    b.request(RequestHeader::new(Command::Read, 0, 2, MIB + 4096, 512), &[]).await;
    assert_eq!(b.reply().await.0.status, Status::IO_ERROR);
    b.request(RequestHeader::new(Command::Write, 0, 3, 4 * MIB, 4096), &[7; 4096]).await;
    assert_eq!(b.reply().await.0.status, Status::OK);
    b.request(RequestHeader::new(Command::Read, 0, 4, 4 * MIB, 4096), &[]).await;
    let (h, data) = b.reply().await;
    assert_eq!((h.status, data), (Status::OK, vec![7; 4096]));

    // NBD, simple and structured replies: EIO, and the connection goes on.
    let nbd = srv.nbd.unwrap();
    let mut n = NbdRaw::connect(nbd).await;
    n.go("f", false, false).await;
    n.request(CMD_READ, 0, 10, MIB, 4096, &[]).await;
    assert_eq!(n.simple(4096).await, (EIO, 10, vec![]));
    n.request(CMD_WRITE, 0, 11, 2 * MIB - 512, 1024, &[1; 1024]).await;
    assert_eq!(n.simple(0).await.0, EIO, "a write overlapping the range fails whole");
    n.request(CMD_READ, 0, 12, 4 * MIB, 4096, &[]).await;
    assert_eq!(n.simple(4096).await, (0, 12, vec![7; 4096]));
    let mut s = NbdRaw::connect(nbd).await;
    s.go("f", true, false).await;
    s.request(CMD_READ, 0, 13, MIB, 512, &[]).await;
    let (flags, kind, cookie, p) = s.chunk().await;
    assert_eq!((flags & REPLY_FLAG_DONE, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 13));
    assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), EIO);

    // The failed write changed nothing; clearing the rule heals the range.
    let faults = srv.handle.faults("f").expect("f has a faults layer");
    assert!(faults.injected() >= 5);
    faults.clear();
    n.request(CMD_READ, 0, 14, MIB, 4096, &[]).await;
    assert_eq!(n.simple(4096).await, (0, 14, vec![0; 4096]));
    // A rule added at run time: an ENOSPC on write reaches NBD as ENOSPC and BRP as NO_SPACE.
    // (On flush it would be latched: tests/faults.rs.)
    faults.add(
        FaultRule::new(FaultOps::WRITE, Effect::Fail(BackendError::NoSpace))
            .range(14 * MIB..15 * MIB)
            .times(2),
    );
    n.request(CMD_WRITE, 0, 15, 14 * MIB, 512, &[1; 512]).await;
    assert_eq!(n.simple(0).await.0, ENOSPC);
    b.request(RequestHeader::new(Command::Write, 0, 5, 14 * MIB, 512), &[1; 512]).await;
    assert_eq!(b.reply().await.0.status, Status::NO_SPACE);
    b.request(RequestHeader::new(Command::Write, 0, 6, 14 * MIB, 512), &[1; 512]).await;
    assert_eq!(b.reply().await.0.status, Status::OK, "the rule fired twice and expired");

    tokio::time::timeout(std::time::Duration::from_secs(60), others).await.unwrap().unwrap();
    let st = srv.handle.volume_stats("f").unwrap();
    assert!(st.errors >= 5 && st.writes >= 50, "{st:?}");
    assert_eq!(srv.handle.volume_stats("g").unwrap().errors, 0);
    srv.stop().await;
}

/// A file volume serves reads whose bytes are cached on the thread that
/// received them, not on its I/O pool; a faults layer above the file still
/// sees every read (it does not pass that shortcut through), so an injected
/// EIO reaches the client even for cached bytes. The bytes are the ones
/// written, through BRP and NBD, and each read is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_file_reads_are_served_at_once_and_faults_still_fire() {
    let (_dir, a) = common::temp_file("stack-at-once", 16 * MIB);
    let b = a.with_extension("faulty");
    std::fs::File::create(&b).unwrap().set_len(16 * MIB).unwrap();
    let specs = [format!("c=file:{}", a.display()), format!("f=file:{},faults=read:eio@1M-2M", b.display())];
    let srv = TestServer::start(&[specs[0].as_str(), specs[1].as_str()], |_| {}).await;
    let caps = |v: &str| srv.handle.catalog().get(v).unwrap().caps();
    assert!(caps("c").read_now, "a plain file volume serves cached reads at once");
    assert!(!caps("f").read_now, "a faults layer does not pass it through");

    let data = pattern(3, 0, 256 << 10);
    for v in ["c", "f"] {
        let (mut r, _) = Raw::open(srv.addr, v).await;
        r.request(RequestHeader::new(Command::Write, 0, 1, MIB, data.len() as u32), &data).await;
        assert_eq!(r.reply().await.0.status, Status::OK);
        for (tag, at) in [(2u64, 0u64), (3, 4096), (4, 128 << 10)] {
            r.request(RequestHeader::new(Command::Read, 0, tag, MIB + at, 4096), &[]).await;
            let (h, got) = r.reply().await;
            if v == "f" {
                assert_eq!(h.status, Status::IO_ERROR, "cached or not, the fault fires");
            } else {
                assert_eq!((h.status, h.tag), (Status::OK, tag));
                assert!(got[..] == data[at as usize..at as usize + 4096], "read {tag}: the bytes written");
            }
        }
    }
    // A read longer than what is served at once goes to the pool: the same bytes.
    let mut n = NbdRaw::connect(srv.nbd.unwrap()).await;
    n.go("c", false, false).await;
    n.request(CMD_READ, 0, 9, MIB, data.len() as u32, &[]).await;
    let (error, cookie, got) = n.simple(data.len()).await;
    assert_eq!((error, cookie), (0, 9));
    assert!(got == data, "a 256 KiB read through the pool");
    let st = srv.handle.volume_stats("c").unwrap();
    assert_eq!(
        (st.reads, st.bytes_read, st.errors),
        (4, 3 * 4096 + (256 << 10), 0),
        "each read counted once"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_zero_follows_the_capabilities_of_the_stack() {
    // A read-only store under faults and delay: NBD advertises no writes, and
    // a fast zero the volume cannot do fails with ENOTSUP before any device call.
    let srv =
        TestServer::start(&["ro=memory:4M,ro,faults=none,delay=1ms", "w=memory:4M,faults=none"], |_| {})
            .await;
    let mut c = NbdRaw::connect(srv.nbd.unwrap()).await;
    let (_, flags) = c.go("ro", false, false).await;
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO), 0);
    let mut c = NbdRaw::connect(srv.nbd.unwrap()).await;
    let (_, flags) = c.go("w", false, false).await;
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(flags & TFLAG_SEND_FAST_ZERO, 0);
    // A device that cannot zero fast: ENOTSUP for FAST_ZERO only (nbdkit's rule), data intact.
    c.request(CMD_WRITE, 0, 1, 0, 4096, &[5; 4096]).await;
    assert_eq!(c.simple(0).await.0, 0);
    let faults = srv.handle.faults("w").unwrap();
    faults.add(FaultRule::new(FaultOps::ZERO, Effect::Fail(BackendError::Unsupported)));
    c.request(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 2, 0, 4096, &[]).await;
    assert_eq!(c.simple(0).await.0, ENOTSUP);
    c.request(CMD_READ, 0, 4, 0, 4096, &[]).await;
    assert_eq!(c.simple(4096).await.2, vec![5; 4096], "a failed fast zero changed nothing");
    // Without FAST_ZERO, never ENOTSUP: zeros are written instead (as nbdkit does).
    c.request(CMD_WRITE_ZEROES, 0, 3, 0, 4096, &[]).await;
    assert_eq!(c.simple(0).await.0, 0, "a zero the store cannot do is written");
    c.request(CMD_READ, 0, 5, 0, 4096, &[]).await;
    assert_eq!(c.simple(4096).await.2, vec![0; 4096]);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brp_over_a_unix_socket() {
    use fastsan_brp::handshake::{parse_message, Message};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let path = std::env::temp_dir().join(format!("fastsan-brp-{}.sock", std::process::id()));
    let p2 = path.clone();
    let srv = TestServer::start(&["v=memory:4M"], move |c| c.brp_unix = Some(p2)).await;
    let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
    let mut out = Message::Hello { min_version: 2, max_version: 2, features: 0 }.to_vec();
    out.extend(Message::Open { session: 0, slot: 0, flags: 0, name: "v".into() }.to_vec());
    let data = pattern(1, 4096, 8192);
    let mut w = Vec::new();
    fastsan_brp::request::encode_header(&RequestHeader::new(Command::Write, 0, 1, 4096, 8192), false, &mut w);
    w.extend_from_slice(&data);
    fastsan_brp::request::encode_header(&RequestHeader::new(Command::Read, 0, 2, 4096, 8192), false, &mut w);
    out.extend(w);
    s.write_all(&out).await.unwrap();
    // HELLO_REPLY, OPEN_REPLY, then the two replies (24-byte headers), the read's data last.
    let mut buf = Vec::new();
    let want = 2 * 24 + 8192;
    let mut msgs = 0;
    loop {
        let mut tmp = [0u8; 65536];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut tmp))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the target closed");
        buf.extend_from_slice(&tmp[..n]);
        while msgs < 2 {
            let Some((m, used)) = parse_message(&buf).unwrap() else { break };
            assert!(matches!(m, Message::HelloReply { .. } | Message::OpenReply(_)), "{m:?}");
            buf.drain(..used);
            msgs += 1;
        }
        if msgs == 2 && buf.len() >= want {
            break;
        }
    }
    let f = fastsan_brp::reply::parse_reply(&buf, false).unwrap().unwrap();
    assert_eq!((f.header.tag, f.header.status), (1, Status::OK));
    let r = fastsan_brp::reply::parse_reply(&buf[f.frame_len..], false).unwrap().unwrap();
    assert_eq!((r.header.tag, r.header.status), (2, Status::OK));
    assert_eq!(&buf[f.frame_len + r.payload_at..][..8192], &data[..]);
    // The initiator library over the same socket sees the raw client's write, and its own.
    let url = format!("brp+unix:///v?socket={}", path.display());
    let vol = Volume::connect(&url, Options::default()).await.unwrap();
    assert_eq!(vol.read(4096, 8192).await.unwrap()[..], data[..]);
    let mine = pattern(2, 1 << 20, 65536);
    vol.write_at(&mine, 1 << 20, true).await.unwrap();
    assert_eq!(vol.read(1 << 20, 65536).await.unwrap()[..], mine[..]);
    // A second target asking for the same socket is refused while this one
    // listens (it took the address and removed it when it stopped).
    let mut c = fastsan_target::config::ServerConfig {
        brp: "127.0.0.1:0".parse().unwrap(),
        nbd: None,
        brp_unix: Some(path.clone()),
        volumes: vec![fastsan_target::config::VolumeSpec::parse("w=memory:1M").unwrap()],
        ..Default::default()
    };
    let err = fastsan_target::Server::bind(c.clone()).await.err().expect("the socket is in use");
    assert!(chain(&err).contains("listening on it"), "{}", chain(&err));
    assert_eq!(vol.read(4096, 8192).await.unwrap()[..], data[..], "the first target still serves");
    drop(vol);
    srv.stop().await;
    assert!(!path.exists(), "the socket file is removed at shutdown");
    // A stale socket file (nothing listening) is replaced.
    let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
    drop(stale);
    c.brp_unix = Some(path.clone());
    let again = fastsan_target::Server::bind(c).await.expect("a stale socket file is replaced");
    drop(again);
}

/// A file volume's file is locked while it is served: a second writer (a
/// volume of another target, or a second volume of the same one, on the
/// same file) is refused, since nothing would fence the two; read-only
/// volumes share it; once the writer stops, the file is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_served_for_writing_is_not_served_twice() {
    use fastsan_target::config::{ServerConfig, VolumeSpec};
    let (_dir, path) = common::temp_file("lock", 1 << 20);
    let spec = |s: String| VolumeSpec::parse(&s).unwrap();
    let config = |vols: &[String]| ServerConfig {
        brp: "127.0.0.1:0".parse().unwrap(),
        nbd: None,
        volumes: vols.iter().map(|v| spec(v.clone())).collect(),
        ..Default::default()
    };
    let rw = format!("a=file:{}", path.display());
    let ro = format!("b=file:{},ro", path.display());
    let in_use = |r: Result<fastsan_target::Server, fastsan_target::server::ServerError>| match r {
        Err(e) => assert!(chain(&e).contains("is in use"), "{}", chain(&e)),
        Ok(_) => panic!("a second writer of {} was let in", path.display()),
    };
    in_use(fastsan_target::Server::bind(config(&[rw.clone(), format!("c=file:{}", path.display())])).await);
    in_use(fastsan_target::Server::bind(config(&[rw.clone(), ro.clone()])).await);
    let srv = TestServer::start(&[rw.as_str()], |_| {}).await;
    in_use(fastsan_target::Server::bind(config(&[format!("x=file:{}", path.display())])).await);
    in_use(fastsan_target::Server::bind(config(std::slice::from_ref(&ro))).await);
    bystander(srv.url("a"), 0, 2).await;
    srv.stop().await;
    // Read-only volumes share the file; a writer waits for them to go.
    let readers =
        fastsan_target::Server::bind(config(&[ro.clone(), format!("c=file:{},ro", path.display())]))
            .await
            .expect("read-only volumes share a file");
    in_use(fastsan_target::Server::bind(config(std::slice::from_ref(&rw))).await);
    drop(readers);
    fastsan_target::Server::bind(config(&[rw])).await.expect("the file is free once its volumes are gone");
}

/// Large reads of a memory volume are sent from its chunks without a copy.
/// Each protocol gets, in one write: a 1 MiB read across five chunks, a write
/// over its start, and the same read again. The first reply must hold the
/// old bytes (the write runs while that reply still holds the chunks, so it
/// must copy them), the second the new; a large read of a hole is zeros.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_reads_are_lent_and_a_write_after_them_never_reaches_their_reply() {
    let srv = TestServer::start(&["v=memory:64M"], |_| {}).await;
    let at = 100 << 10;
    let len = MIB as usize;
    let mut round = 0u64;
    let mut fresh = |vol: &str| {
        round += 1;
        let url = srv.url(vol);
        async move {
            let vol = Volume::connect(&url, Options { connections: 1, ..Default::default() }).await.unwrap();
            let old = pattern(round, at, len);
            vol.write_at(&old, at, false).await.unwrap();
            old
        }
    };
    let new = pattern(99, at, 128 << 10);
    let expect_after = |old: &[u8]| [&new[..], &old[new.len()..]].concat();

    // BRP, with digests (the reply's data digest covers every lent piece).
    for features in [0, fastsan_brp::FEATURE_DIGEST] {
        let old = fresh("v").await;
        let (mut b, _) = Raw::open_with(srv.addr, "v", features).await;
        let mut wire = b.frame(RequestHeader::new(Command::Read, 0, 1, at, len as u32), &[]);
        wire.extend(b.frame(RequestHeader::new(Command::Write, 0, 2, at, new.len() as u32), &new));
        wire.extend(b.frame(RequestHeader::new(Command::Read, 0, 3, at, len as u32), &[]));
        wire.extend(b.frame(RequestHeader::new(Command::Read, 0, 4, 32 * MIB, len as u32), &[]));
        b.send(&wire).await;
        let mut got = std::collections::BTreeMap::new();
        for _ in 0..4 {
            let (h, data) = b.reply().await;
            assert_eq!(h.status, Status::OK, "tag {}", h.tag);
            got.insert(h.tag, data);
        }
        assert!(got[&1] == old, "BRP (features {features}): the first read saw the later write");
        assert!(got[&3] == expect_after(&old), "BRP (features {features}): the second read missed the write");
        assert!(got[&4].len() == len && got[&4].iter().all(|&x| x == 0), "a hole reads as zeros");
    }

    // NBD, simple and structured replies (in order: memory runs inline).
    for structured in [false, true] {
        let old = fresh("v").await;
        let mut n = NbdRaw::connect(srv.nbd.unwrap()).await;
        n.go("v", structured, false).await;
        let mut wire = NbdRaw::frame(CMD_READ, 0, 1, at, len as u32, &[]);
        wire.extend(NbdRaw::frame(CMD_WRITE, 0, 2, at, new.len() as u32, &new));
        wire.extend(NbdRaw::frame(CMD_READ, 0, 3, at, len as u32, &[]));
        n.send(&wire).await;
        // Replies come in order here (memory runs inline); a write's is a
        // simple reply whether or not structured replies are on.
        let mut got = std::collections::BTreeMap::new();
        for i in 0..3 {
            if i == 1 {
                assert_eq!(n.simple(0).await, (0, 2, vec![]));
            } else if structured {
                let (flags, kind, cookie, p) = n.chunk().await;
                assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
                assert_eq!(p[..8], at.to_be_bytes(), "the chunk's offset");
                got.insert(cookie, p[8..].to_vec());
            } else {
                let (err, cookie, d) = n.simple(len).await;
                assert_eq!(err, 0);
                got.insert(cookie, d);
            }
        }
        assert!(got[&1] == old, "NBD (structured {structured}): the first read saw the later write");
        assert!(
            got[&3] == expect_after(&old),
            "NBD (structured {structured}): the second read missed the write"
        );
    }
    srv.stop().await;
}

/// 4 KiB reads are lent too (each holds its whole 256 KiB chunk): in one
/// burst, reads, writes over them and reads again of the same chunk, each
/// write copying the chunk its read still holds. Every first read has the
/// old bytes, every second the new, and the volume ends with every write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_reads_are_lent_and_a_write_in_the_same_burst_never_reaches_their_reply() {
    let srv = TestServer::start(&["v=memory:64M"], |_| {}).await;
    let (at, block, n) = (512u64 << 10, 4096usize, 32u64);
    let url = srv.url("v");
    let vol = Volume::connect(&url, Options { connections: 1, ..Default::default() }).await.unwrap();
    let old = pattern(1, at, n as usize * block);
    vol.write_at(&old, at, false).await.unwrap();
    for features in [0, fastsan_brp::FEATURE_DIGEST] {
        let now = vol.read(at, n * block as u64).await.unwrap().to_vec();
        let (mut b, _) = Raw::open_with(srv.addr, "v", features).await;
        let mut wire = Vec::new();
        let mut new = Vec::new();
        for i in 0..n {
            let off = at + i * block as u64;
            let data = pattern(100 + i + features as u64, off, block);
            wire.extend(b.frame(RequestHeader::new(Command::Read, 0, 3 * i, off, block as u32), &[]));
            wire.extend(b.frame(RequestHeader::new(Command::Write, 0, 3 * i + 1, off, block as u32), &data));
            wire.extend(b.frame(RequestHeader::new(Command::Read, 0, 3 * i + 2, off, block as u32), &[]));
            new.push(data);
        }
        b.send(&wire).await;
        let mut got = std::collections::BTreeMap::new();
        for _ in 0..3 * n {
            let (h, data) = b.reply().await;
            assert_eq!(h.status, Status::OK, "tag {}", h.tag);
            got.insert(h.tag, data);
        }
        for i in 0..n {
            let before = &now[i as usize * block..(i as usize + 1) * block];
            assert!(got[&(3 * i)] == before, "features {features}: read {i} saw the write after it");
            assert!(got[&(3 * i + 2)] == new[i as usize], "features {features}: read {i} missed the write");
        }
        assert!(vol.read(at, n * block as u64).await.unwrap() == new.concat(), "the volume has every write");
    }
    srv.stop().await;
}
