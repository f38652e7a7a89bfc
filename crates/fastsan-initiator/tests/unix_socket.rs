//! A volume over `brp+unix://`, against a fake target on a unix socket that
//! speaks just enough BRP (built from the codec): the handshake, then plain
//! READ, WRITE and FLUSH frames on a 64 KiB volume in memory.

use fastsan_brp::handshake::{parse_message, Message, OpenInfo, AUTH_NONE};
use fastsan_brp::reply::ReplyHeader;
use fastsan_brp::request::parse_request;
use fastsan_brp::{Command, Status};
use fastsan_initiator::{MergeMode, Options, Volume};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

const SIZE: usize = 64 << 10;

async fn fill(s: &mut UnixStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 4096];
    let n = s.read(&mut chunk).await.unwrap();
    buf.extend_from_slice(&chunk[..n]);
    n > 0
}

async fn fake_target(mut s: UnixStream) {
    let mut buf = Vec::new();
    let mut volume = vec![0u8; SIZE];
    for reply in [
        Message::HelloReply {
            version: fastsan_brp::VERSION,
            auth: AUTH_NONE,
            features: 0,
            challenge: [0; 32],
        },
        Message::OpenReply(OpenInfo {
            session: 1,
            size: SIZE as u64,
            block_size: 512,
            max_transfer: 16 << 10,
            queue_depth: 8,
            max_batch: 8,
            flags: 0,
            instance: 1,
            generation: 1,
            boot: 1,
        }),
    ] {
        while parse_message(&buf).unwrap().is_none() {
            assert!(fill(&mut s, &mut buf).await);
        }
        let (_, n) = parse_message(&buf).unwrap().unwrap();
        buf.drain(..n);
        s.write_all(&reply.to_vec()).await.unwrap();
    }
    loop {
        let Some(f) = parse_request(&buf, false).unwrap() else {
            if !fill(&mut s, &mut buf).await {
                return;
            }
            continue;
        };
        let (h, at) = (f.header, f.header.offset as usize);
        let data = match h.command {
            Command::Read => volume[at..at + h.length as usize].to_vec(),
            Command::Write => {
                volume[at..at + h.length as usize].copy_from_slice(f.payload(&buf));
                vec![]
            }
            Command::Flush => vec![],
            other => panic!("unexpected {other:?}"),
        };
        buf.drain(..f.frame_len);
        let reply = ReplyHeader { status: Status::OK, tag: h.tag, payload_len: data.len() as u32 };
        s.write_all(&reply.encode()).await.unwrap();
        s.write_all(&data).await.unwrap();
    }
}

#[tokio::test]
async fn a_volume_works_over_a_unix_socket() {
    let dir = tempfile::Builder::new().prefix("fastsan-unix-").tempdir().unwrap();
    let path = dir.path().join("target.sock");
    let listener = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        fake_target(s).await;
    });
    let opts = Options {
        connections: 1,
        merge: MergeMode::Off,
        reconnect_timeout: Duration::ZERO,
        ..Default::default()
    };
    let url = format!("brp+unix:///vol0?socket={}", path.display());
    let vol = Volume::connect(&url, opts).await.unwrap();
    assert_eq!(vol.size(), SIZE as u64);
    let data: Vec<u8> = (0..40_960u32).map(|i| i as u8).collect();
    // Larger than max_transfer: split into three requests.
    vol.write_at(&data, 1024, false).await.unwrap();
    vol.flush().await.unwrap();
    assert_eq!(&vol.read(1024, data.len() as u64).await.unwrap()[..], &data[..]);
    assert_eq!(vol.stats().requests, 7);
    drop(vol);
}
