//! Helpers shared by the target's integration tests: a real server on
//! 127.0.0.1:0, and a raw BRP client that sends exactly the bytes a test wants.
#![allow(dead_code)]

use fastsan_brp::handshake::{parse_message, Message, OpenInfo};
use fastsan_brp::reply::{parse_reply, ReplyHeader};
use fastsan_brp::request::{encode_header, RequestHeader};
use fastsan_target::config::{ServerConfig, VolumeSpec};
use fastsan_target::{Server, ServerHandle};
use std::net::SocketAddr;
use std::time::Duration;
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

    /// Shuts down and gives what `Server::run` returned.
    pub async fn stop_result(self) -> std::io::Result<()> {
        self.handle.shutdown();
        tokio::time::timeout(Duration::from_secs(10), self.task).await.unwrap().unwrap()
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

    /// Connects from another loopback address (127.0.0.0/8), as another host would.
    pub async fn connect_from(addr: SocketAddr, from: &str) -> Raw {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        Raw { s: sock.connect(addr).await.unwrap(), buf: Vec::new(), digests: false }
    }

    /// HELLO (no features), then OPEN of `volume` in a new session: the answer.
    pub async fn hello_open(&mut self, volume: &str) -> Message {
        let Message::HelloReply { .. } =
            self.ask(&Message::Hello { min_version: 2, max_version: 2, features: 0 }).await
        else {
            panic!("expected HELLO_REPLY")
        };
        self.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: volume.into() }).await
    }

    /// Connects, says HELLO (no features) and opens `volume`.
    pub async fn open(addr: SocketAddr, volume: &str) -> (Raw, OpenInfo) {
        Self::open_with(addr, volume, 0).await
    }

    pub async fn open_with(addr: SocketAddr, volume: &str, features: u32) -> (Raw, OpenInfo) {
        let mut r = Raw::connect(addr).await;
        let Message::HelloReply { features, .. } =
            r.ask(&Message::Hello { min_version: 2, max_version: 2, features }).await
        else {
            panic!("expected HELLO_REPLY")
        };
        r.digests = features & fastsan_brp::FEATURE_DIGEST != 0;
        let Message::OpenReply(info) =
            r.ask(&Message::Open { session: 0, slot: 0, flags: 0, name: volume.into() }).await
        else {
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
        let v = self.frame(h, payload);
        self.send(&v).await;
    }

    /// A request's bytes on the wire (to send several in one write).
    pub fn frame(&self, h: RequestHeader, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        encode_header(&h, self.digests, &mut v);
        v.extend_from_slice(payload);
        if self.digests && !payload.is_empty() {
            v.extend(fastsan_brp::request::encode_data_digest(payload));
        }
        v
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
        closed_within(&mut self.s, t).await
    }
}

/// A sparse file of `len` bytes in a directory of its own under the
/// system's temp dir (never the source tree): `(dir, file)`. The directory
/// goes, with the file, when `dir` is dropped, whether the test passed or not.
pub fn temp_file(name: &str, len: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new().prefix(&format!("fastsan-{name}-")).tempdir().expect("a temp dir");
    let path = dir.path().join("v.img");
    std::fs::File::create(&path).unwrap().set_len(len).unwrap();
    (dir, path)
}

/// A pattern that differs by offset and seed, so misplaced data is caught.
pub fn pattern(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((offset + i).wrapping_mul(31) ^ seed.wrapping_mul(0x9E37_79B9)) as u8).collect()
}

/// An NBD client that speaks through raw bytes.
pub struct NbdRaw {
    pub s: TcpStream,
    buf: Vec<u8>,
}

impl NbdRaw {
    /// Connects, checks the greeting and sends client flags.
    pub async fn connect(addr: SocketAddr) -> NbdRaw {
        let mut r = NbdRaw { s: TcpStream::connect(addr).await.unwrap(), buf: Vec::new() };
        let g = r.take(18).await.expect("greeting");
        assert_eq!(
            &g[..16],
            &[
                &fastsan_nbd::consts::NBDMAGIC.to_be_bytes()[..],
                &fastsan_nbd::consts::IHAVEOPT.to_be_bytes()[..]
            ]
            .concat()[..]
        );
        r.s.write_all(
            &(fastsan_nbd::consts::FLAG_C_FIXED_NEWSTYLE | fastsan_nbd::consts::FLAG_C_NO_ZEROES)
                .to_be_bytes(),
        )
        .await
        .unwrap();
        r
    }

    /// Reads exactly n bytes (None if the server closed first).
    pub async fn take(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            let mut tmp = vec![0u8; 1 << 20];
            match tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut tmp))
                .await
                .expect("server answers in time")
            {
                Ok(0) | Err(_) => return None,
                Ok(k) => self.buf.extend_from_slice(&tmp[..k]),
            }
        }
        Some(self.buf.drain(..n).collect())
    }

    pub async fn option(&mut self, option: u32, data: &[u8]) {
        let mut v = Vec::new();
        fastsan_nbd::handshake::encode_option(option, data, &mut v);
        self.s.write_all(&v).await.unwrap();
    }

    /// The next option reply: (type, data), or None if the server closed.
    pub async fn option_reply(&mut self) -> Option<(u32, Vec<u8>)> {
        let h = self.take(20).await?;
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let data = self.take(len).await?;
        Some((u32::from_be_bytes(h[12..16].try_into().unwrap()), data))
    }

    /// Negotiates and enters transmission; returns the export size and flags.
    pub async fn go(&mut self, name: &str, structured: bool, allocation: bool) -> (u64, u16) {
        use fastsan_nbd::consts::*;
        if structured {
            self.option(OPT_STRUCTURED_REPLY, &[]).await;
            assert_eq!(self.option_reply().await.unwrap().0, REP_ACK);
        }
        if allocation {
            let q = fastsan_nbd::handshake::MetaContextRequest {
                name: name.into(),
                queries: vec![CONTEXT_BASE_ALLOCATION.into()],
            };
            self.option(OPT_SET_META_CONTEXT, &q.encode()).await;
            assert_eq!(self.option_reply().await.unwrap().0, REP_META_CONTEXT);
            assert_eq!(self.option_reply().await.unwrap().0, REP_ACK);
        }
        let req = fastsan_nbd::handshake::InfoRequest { name: name.into(), infos: vec![] };
        self.option(OPT_GO, &req.encode()).await;
        let mut export = None;
        loop {
            let (t, d) = self.option_reply().await.expect("GO replies");
            match t {
                REP_INFO if d[..2] == [0, 0] => {
                    export = Some((
                        u64::from_be_bytes(d[2..10].try_into().unwrap()),
                        u16::from_be_bytes([d[10], d[11]]),
                    ))
                }
                REP_INFO => {}
                REP_ACK => return export.expect("INFO_EXPORT before ACK"),
                other => panic!("GO failed with {other:#x}: {}", String::from_utf8_lossy(&d)),
            }
        }
    }

    pub async fn request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let v = Self::frame(command, flags, cookie, offset, length, payload);
        self.s.write_all(&v).await.unwrap();
    }

    /// A request's bytes on the wire (to send several in one write).
    pub fn frame(command: u16, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) -> Vec<u8> {
        let r = fastsan_nbd::transmission::Request { flags, command, cookie, offset, length };
        let mut v = r.encode().to_vec();
        v.extend_from_slice(payload);
        v
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    /// A simple reply: (error, cookie); then `data` bytes when error is 0.
    pub async fn simple(&mut self, data: usize) -> (u32, u64, Vec<u8>) {
        let h = self.take(16).await.expect("a reply");
        assert_eq!(h[..4], fastsan_nbd::consts::SIMPLE_REPLY_MAGIC.to_be_bytes(), "simple reply magic");
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let d = if error == 0 { self.take(data).await.unwrap() } else { vec![] };
        (error, cookie, d)
    }

    /// One structured chunk: (flags, type, cookie, payload).
    pub async fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let h = self.take(20).await.expect("a chunk");
        assert_eq!(h[..4], fastsan_nbd::consts::STRUCTURED_REPLY_MAGIC.to_be_bytes(), "chunk magic");
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let p = self.take(len).await.unwrap();
        (
            u16::from_be_bytes([h[4], h[5]]),
            u16::from_be_bytes([h[6], h[7]]),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
            p,
        )
    }

    /// True when the server closes the connection (EOF or reset) within the time given.
    pub async fn closed_within(&mut self, t: Duration) -> bool {
        closed_within(&mut self.s, t).await
    }
}

/// True when the peer closes `s` (EOF or reset) within `t`; bytes before that are skipped.
pub async fn closed_within(s: &mut TcpStream, t: Duration) -> bool {
    let mut tmp = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + t;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut tmp)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

/// A directory on a disk filesystem (tmpfs may refuse O_DIRECT).
pub fn disk_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("fastsan-test-{name}-"))
        .tempdir_in("/var/tmp")
        .expect("a directory")
}

pub fn sparse(path: &std::path::Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// A small filesystem of its own, mounted for the test (root, loop devices).
pub struct SmallFs {
    pub mnt: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallFs {
    /// An ext4 of `mib` MiB.
    pub fn mount(mib: u64) -> SmallFs {
        SmallFs::mount_as("mkfs.ext4", &["-q", "-F"], mib)
    }

    /// A filesystem of `mib` MiB made by `mkfs` with `args` (and the image).
    pub fn mount_as(mkfs: &str, args: &[&str], mib: u64) -> SmallFs {
        let dir = disk_dir("fs");
        let (img, mnt) = (dir.path().join("fs.img"), dir.path().join("mnt"));
        sparse(&img, mib << 20);
        std::fs::create_dir(&mnt).unwrap();
        let run = |cmd: &str, args: &[&str]| {
            let out =
                std::process::Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
            assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(mkfs, &[args, &[img.to_str().unwrap()]].concat());
        run("mount", &["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()]);
        SmallFs { mnt, _dir: dir }
    }
}

impl Drop for SmallFs {
    /// Unmounts (its loop device goes with it): the stopped target's I/O
    /// threads may hold the volume's file a moment longer, so a busy mount
    /// is tried again, then detached lazily rather than left behind.
    fn drop(&mut self) {
        for _ in 0..50 {
            match std::process::Command::new("umount").arg(&self.mnt).output() {
                Ok(out) if out.status.success() => return,
                _ => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
        }
        eprintln!("{} still busy after 5 s (a descriptor left open?): detached lazily", self.mnt.display());
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.mnt).output();
    }
}

/// 300 writes in flight at once (4 KiB ones, 64 KiB ones, four of 1 MiB;
/// every third 4 KiB step a FUA write), a FLUSH, then as many reads: every
/// byte read through `vol` is the byte written, and so is what the volume's
/// file or device `path` holds (every seventh piece).
pub async fn round_trip(vol: &fastsan_initiator::Volume, path: &std::path::Path, seed: u64) {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    // 300 pieces: 4 KiB at 4 KiB steps, then 64 KiB ones, then four of 1 MiB.
    let mut pieces: Vec<(u64, usize)> = (0..256).map(|i| (i * 4096, 4096)).collect();
    pieces.extend((0..40).map(|i| (2 * MIB + i * 65536, 65536)));
    pieces.extend((0..4).map(|i| (8 * MIB + i * MIB, MIB as usize)));
    let writes = pieces.iter().map(|&(at, len)| {
        let data = pattern(seed, at, len);
        async move { vol.write_at(&data, at, at % (3 * 4096) == 0).await }
    });
    for (r, &(at, _)) in futures::future::join_all(writes).await.into_iter().zip(&pieces) {
        r.unwrap_or_else(|e| panic!("write at {at}: {e}"));
    }
    vol.flush().await.expect("flushed");
    let reads = pieces.iter().map(|&(at, len)| vol.read(at, len as u64));
    for (r, &(at, len)) in futures::future::join_all(reads).await.into_iter().zip(&pieces) {
        let got = r.unwrap_or_else(|e| panic!("read at {at}: {e}"));
        assert!(got[..] == pattern(seed, at, len)[..], "read at {at}+{len}: not the bytes written");
    }
    // On the device itself, where the target put them.
    let file = std::fs::File::open(path).unwrap();
    for &(at, len) in pieces.iter().step_by(7) {
        let mut buf = vec![0; len];
        file.read_exact_at(&mut buf, at).unwrap();
        assert!(buf == pattern(seed, at, len), "the device at {at}+{len}, round {seed}");
    }
}
