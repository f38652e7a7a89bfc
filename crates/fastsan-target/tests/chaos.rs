//! Chaos: connections torn down at random under a verified load. The
//! initiator must behave as a block device: no error reaches the callers and
//! no read returns anything but the last acknowledged write.
//!
//! A proxy sits between the initiator and the target and cuts connection
//! pairs at random: both sides at once, the client side first with the
//! target side left open for a while (the target still holds frames of a
//! connection the initiator already gave up: the fence must stop them), or
//! the target side first; and, where the kernel allows it, `ss -K` resets
//! the target's sockets.

mod common;

use common::{pattern, TestServer};
use fastsan_initiator::{Options, Volume};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// One proxied connection: the two sockets' descriptors, and the token that
/// lets the pumps drop them (only after the chaos task is done with them).
struct Pair {
    client_fd: i32,
    target_fd: i32,
    release: CancellationToken,
}

struct Proxy {
    addr: std::net::SocketAddr,
    pairs: Arc<Mutex<Vec<Pair>>>,
}

impl Proxy {
    async fn start(target: std::net::SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let pairs = Arc::new(Mutex::new(Vec::new()));
        let p = pairs.clone();
        tokio::spawn(async move {
            loop {
                let Ok((c, _)) = l.accept().await else { return };
                let Ok(t) = TcpStream::connect(target).await else { continue };
                let _ = (c.set_nodelay(true), t.set_nodelay(true));
                let release = CancellationToken::new();
                p.lock().push(Pair {
                    client_fd: c.as_raw_fd(),
                    target_fd: t.as_raw_fd(),
                    release: release.clone(),
                });
                let (cr, cw) = c.into_split();
                let (tr, tw) = t.into_split();
                tokio::spawn(pump(cr, tw, release.clone()));
                tokio::spawn(pump(tr, cw, release));
            }
        });
        Proxy { addr, pairs }
    }

    /// Cuts one live pair in one of three ways; false when none is live.
    async fn cut(&self, rng: &mut rand::rngs::StdRng) -> bool {
        let pair = {
            let mut pairs = self.pairs.lock();
            if pairs.is_empty() {
                return false;
            }
            let i = rng.gen_range(0..pairs.len());
            pairs.swap_remove(i)
        };
        let shut = |fd: i32| unsafe {
            // The pumps hold the sockets open until `release`: fd is valid.
            libc::shutdown(fd, libc::SHUT_RDWR);
        };
        let later = Duration::from_millis(rng.gen_range(0..150));
        match rng.gen_range(0..3) {
            0 => {
                shut(pair.client_fd);
                shut(pair.target_fd);
            }
            1 => {
                // The initiator sees the loss; the target still holds the connection.
                shut(pair.client_fd);
                tokio::time::sleep(later).await;
                shut(pair.target_fd);
            }
            _ => {
                shut(pair.target_fd);
                tokio::time::sleep(later).await;
                shut(pair.client_fd);
            }
        }
        pair.release.cancel();
        true
    }
}

/// Copies bytes one way; when either side fails, waits for `release`
/// before dropping its write half (so the chaos task's descriptors stay valid).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    release: CancellationToken,
) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
            _ = release.cancelled() => break,
        };
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    release.cancelled().await;
    drop((from, to));
}

/// Resets the target's side of every proxied connection with `ss -K`, when
/// the kernel supports it; the number of sockets it killed.
fn ss_kill(target_port: u16) -> usize {
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", "src", "127.0.0.1", "sport", "=", &format!(":{target_port}")])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            String::from_utf8_lossy(&o.stdout).lines().skip(1).filter(|l| !l.trim().is_empty()).count()
        }
        _ => 0,
    }
}

const REGION: u64 = 2 << 20;
const REQUESTERS: u64 = 64;
const LOAD: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_torn_down_at_random_lose_nothing_and_fail_nothing() {
    let (_dir, path) = common::temp_file("chaos", REQUESTERS * REGION);
    // Writes to the first requesters' regions are slow: a lost connection's
    // write is then often still running on the target when the initiator retries.
    let spec = format!("v=file:{},faults=write:delay=3ms@0-8M", path.display());
    let srv = TestServer::start(&[spec.as_str()], |_| {}).await;
    let proxy = Proxy::start(srv.addr).await;
    let opts = Options {
        connections: 4,
        reconnect_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let vol = Volume::connect(&format!("brp://{}/v", proxy.addr), opts).await.unwrap();
    let (errors, mismatches, ops) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let end = Instant::now() + LOAD;
    let mut tasks = Vec::new();
    for r in 0..REQUESTERS {
        let (vol, errors, mismatches, ops) = (vol.clone(), errors.clone(), mismatches.clone(), ops.clone());
        tasks.push(tokio::spawn(async move {
            let base = r * REGION;
            let mut model = vec![0u8; REGION as usize];
            let mut rng = rand::rngs::StdRng::seed_from_u64(r);
            let mut i = 0u64;
            while Instant::now() < end {
                i += 1;
                let blocks = 1u64 << rng.gen_range(0..=11);
                let len = rng.gen_range(blocks..=blocks * 2).min(2048) * 512;
                let off = rng.gen_range(0..=(REGION - len) / 512) * 512;
                let result = if rng.gen_bool(0.5) {
                    let data = pattern(r * 1_000_000 + i, off, len as usize);
                    let r = vol.write_at(&data, base + off, rng.gen_bool(0.1)).await;
                    if r.is_ok() {
                        model[off as usize..(off + len) as usize].copy_from_slice(&data);
                    }
                    r
                } else {
                    vol.read(base + off, len).await.map(|got| {
                        if got[..] != model[off as usize..(off + len) as usize] {
                            mismatches.fetch_add(1, Relaxed);
                        }
                    })
                };
                if let Err(e) = result.and(if i.is_multiple_of(16) { vol.flush().await } else { Ok(()) }) {
                    eprintln!("requester {r}: {e}");
                    errors.fetch_add(1, Relaxed);
                }
                ops.fetch_add(1, Relaxed);
            }
            match vol.read(base, REGION).await {
                Ok(all) if all[..] == model[..] => {}
                Ok(_) => {
                    mismatches.fetch_add(1, Relaxed);
                }
                Err(e) => {
                    eprintln!("requester {r}: final read: {e}");
                    errors.fetch_add(1, Relaxed);
                }
            }
        }));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut cuts, mut resets) = (0u64, 0usize);
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(15..60))).await;
        if cuts % 25 == 24 {
            resets += ss_kill(srv.addr.port());
        }
        if proxy.cut(&mut rng).await {
            cuts += 1;
        }
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t).await.expect("requesters finish").unwrap();
    }
    let st = vol.stats();
    eprintln!(
        "chaos: {} ops, {cuts} proxy cuts, {resets} ss -K resets, {} reconnects, {} retries, {} timeouts",
        ops.load(Relaxed),
        st.reconnects,
        st.retries,
        st.timeouts
    );
    assert_eq!(errors.load(Relaxed), 0, "errors reached the callers");
    assert_eq!(mismatches.load(Relaxed), 0, "reads returned something else than the last acknowledged write");
    assert!(cuts as usize + resets >= 100, "at least 100 drops: {cuts} cuts, {resets} resets");
    assert!(st.reconnects >= 50 && st.retries > 0, "{st:?}");
    drop(vol);
    srv.stop().await;
}
