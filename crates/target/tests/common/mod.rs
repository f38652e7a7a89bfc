//! Helpers shared by the target's integration tests: a real server on
//! 127.0.0.1:0, and a raw BRP client that sends exactly the bytes a test wants.
#![allow(dead_code)]

use brp::handshake::{parse_message, Message, OpenInfo};
use brp::reply::{parse_reply, ReplyHeader};
use brp::request::{encode_header, RequestHeader};
use std::net::SocketAddr;
use std::time::Duration;
use target::config::{ServerConfig, VolumeSpec};
use target::{Server, ServerHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct TestServer {
    pub addr: SocketAddr,
    pub nbd: Option<SocketAddr>,
    pub handle: ServerHandle,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    pub async fn start(volumes: &[&str], tweak: impl FnOnce(&mut ServerConfig)) -> TestServer {
        let mut c = ServerConfig {
            brp: "127.0.0.1:0".parse().unwrap(),
            nbd: Some("127.0.0.1:0".parse().unwrap()),
            volumes: volumes.iter().map(|v| VolumeSpec::parse(v).unwrap()).collect(),
            ..Default::default()
        };
        tweak(&mut c);
        let server = Server::bind(c).await.expect("server binds");
        let addr = server.local_addr();
        let nbd = server.nbd_addr();
        let handle = server.handle();
        let task = tokio::spawn(server.run());
        TestServer { addr, nbd, handle, task }
    }

    pub fn url(&self, volume: &str) -> String {
        format!("brp://{}/{}", self.addr, volume)
    }

    pub async fn stop(self) {
        self.handle.shutdown();
        tokio::time::timeout(Duration::from_secs(10), self.task).await.unwrap().unwrap().unwrap();
    }
}

/// A BRP client that speaks through raw bytes.
pub struct Raw {
    pub s: TcpStream,
    buf: Vec<u8>,
    pub digests: bool,
}

impl Raw {
    pub async fn connect(addr: SocketAddr) -> Raw {
        Raw { s: TcpStream::connect(addr).await.unwrap(), buf: Vec::new(), digests: false }
    }

    /// Connects, says HELLO (no features) and opens `volume`.
    pub async fn open(addr: SocketAddr, volume: &str) -> (Raw, OpenInfo) {
        Self::open_with(addr, volume, 0).await
    }

    pub async fn open_with(addr: SocketAddr, volume: &str, features: u32) -> (Raw, OpenInfo) {
        let mut r = Raw::connect(addr).await;
        let Message::HelloReply { features, .. } =
            r.ask(&Message::Hello { min_version: 1, max_version: 1, features }).await
        else {
            panic!("expected HELLO_REPLY")
        };
        r.digests = features & brp::FEATURE_DIGEST != 0;
        let Message::OpenReply(info) = r.ask(&Message::Open { session: 0, name: volume.into() }).await else {
            panic!("expected OPEN_REPLY")
        };
        (r, info)
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    pub async fn ask(&mut self, m: &Message) -> Message {
        self.send(&m.to_vec()).await;
        self.message().await.expect("a reply message")
    }

    /// The next handshake message, or None when the server closed.
    pub async fn message(&mut self) -> Option<Message> {
        loop {
            if let Some((m, n)) = parse_message(&self.buf).unwrap() {
                self.buf.drain(..n);
                return Some(m);
            }
            if !self.fill().await {
                return None;
            }
        }
    }

    pub async fn request(&mut self, h: RequestHeader, payload: &[u8]) {
        let mut v = Vec::new();
        encode_header(&h, self.digests, &mut v);
        v.extend_from_slice(payload);
        if self.digests && !payload.is_empty() {
            v.extend(brp::request::encode_data_digest(payload));
        }
        self.send(&v).await;
    }

    /// The next reply and its data.
    pub async fn reply(&mut self) -> (ReplyHeader, Vec<u8>) {
        loop {
            if let Some(f) = parse_reply(&self.buf, self.digests).unwrap() {
                let data = self.buf[f.payload_at..f.payload_at + f.header.payload_len as usize].to_vec();
                self.buf.drain(..f.frame_len);
                return (f.header, data);
            }
            assert!(self.fill().await, "server closed while a reply was expected");
        }
    }

    async fn fill(&mut self) -> bool {
        let mut tmp = vec![0u8; 1 << 20];
        match tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut tmp))
            .await
            .expect("server answers in time")
        {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }

    /// True when the server closes the connection (EOF or reset) within the time given.
    pub async fn closed_within(&mut self, t: Duration) -> bool {
        let mut tmp = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + t;
        loop {
            match tokio::time::timeout_at(deadline, self.s.read(&mut tmp)).await {
                Err(_) => return false,
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
            }
        }
    }
}

/// A pattern that differs by offset and seed, so misplaced data is caught.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((offset + i).wrapping_mul(31) ^ seed.wrapping_mul(0x9E37_79B9)) as u8).collect()
}
