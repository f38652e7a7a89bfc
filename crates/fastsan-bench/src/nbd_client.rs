//! A small NBD client for benchmarks: fixed newstyle, OPT_GO, simple replies,
//! many requests in flight over one connection. Like libnbd (which fio's nbd
//! engine uses) it sends each request with its own write, so the two clients
//! load a server the same way.

use bytes::{Bytes, BytesMut};
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{encode_option, InfoRequest};
use fastsan_nbd::transmission::{Request, SIMPLE_REPLY_LEN};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::oneshot;

type Waiter = (usize, oneshot::Sender<io::Result<Bytes>>);

pub struct NbdClient {
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Arc<Mutex<HashMap<u64, Waiter>>>,
    next: AtomicU64,
    pub size: u64,
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Splits `nbd://HOST:PORT/EXPORT` into the address and the export name.
pub fn parse_url(url: &str) -> io::Result<(String, String)> {
    let rest =
        url.strip_prefix("nbd://").ok_or_else(|| bad(format!("{url}: expected nbd://HOST:PORT/EXPORT")))?;
    let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
    let host = if host.contains(':') { host.to_owned() } else { format!("{host}:10809") };
    Ok((host, export.to_owned()))
}

impl NbdClient {
    pub async fn connect(url: &str) -> io::Result<NbdClient> {
        let (addr, export) = parse_url(url)?;
        let mut s = TcpStream::connect(&addr).await?;
        s.set_nodelay(true)?;
        let mut greet = [0u8; 18];
        s.read_exact(&mut greet).await?;
        if greet[..8] != NBDMAGIC.to_be_bytes() || greet[8..16] != IHAVEOPT.to_be_bytes() {
            return Err(bad("not a newstyle NBD server".into()));
        }
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes()).await?;
        let mut opt = Vec::new();
        encode_option(OPT_GO, &InfoRequest { name: export.clone(), infos: vec![] }.encode(), &mut opt);
        s.write_all(&opt).await?;
        let mut size = None;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h).await?;
            let kind = u32::from_be_bytes(h[12..16].try_into().expect("4"));
            let len = u32::from_be_bytes(h[16..20].try_into().expect("4")) as usize;
            if len > 1 << 16 {
                return Err(bad("option reply too long".into()));
            }
            let mut d = vec![0u8; len];
            s.read_exact(&mut d).await?;
            match kind {
                REP_INFO if len >= 12 && d[..2] == [0, 0] => {
                    size = Some(u64::from_be_bytes(d[2..10].try_into().expect("8")))
                }
                REP_INFO => {}
                REP_ACK => break,
                e => {
                    return Err(bad(format!(
                        "export {export:?} refused: {e:#x} {}",
                        String::from_utf8_lossy(&d)
                    )))
                }
            }
        }
        let size = size.ok_or_else(|| bad("no export size".into()))?;
        let (mut rd, wr) = s.into_split();
        let pending: Arc<Mutex<HashMap<u64, Waiter>>> = Arc::default();
        let p = pending.clone();
        tokio::spawn(async move {
            let mut buf = BytesMut::with_capacity(1 << 20);
            let r: io::Result<()> = async {
                loop {
                    while buf.len() >= SIMPLE_REPLY_LEN {
                        if buf[..4] != SIMPLE_REPLY_MAGIC.to_be_bytes() {
                            return Err(bad("bad reply magic".into()));
                        }
                        let error = u32::from_be_bytes(buf[4..8].try_into().expect("4"));
                        let cookie = u64::from_be_bytes(buf[8..16].try_into().expect("8"));
                        let Some(&(want, _)) = p.lock().get(&cookie) else {
                            return Err(bad(format!("reply for unknown cookie {cookie}")));
                        };
                        let data_len = if error == 0 { want } else { 0 };
                        if buf.len() < SIMPLE_REPLY_LEN + data_len {
                            buf.reserve(SIMPLE_REPLY_LEN + data_len);
                            break;
                        }
                        let frame = buf.split_to(SIMPLE_REPLY_LEN + data_len).freeze();
                        let (_, tx) = p.lock().remove(&cookie).expect("present");
                        let _ = tx.send(if error == 0 {
                            Ok(frame.slice(SIMPLE_REPLY_LEN..))
                        } else {
                            Err(io::Error::other(format!("NBD error {error}")))
                        });
                    }
                    buf.reserve(64 * 1024);
                    if rd.read_buf(&mut buf).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                }
            }
            .await;
            for (_, (_, tx)) in p.lock().drain() {
                let _ = tx.send(Err(io::Error::other(format!("connection lost: {r:?}"))));
            }
        });
        Ok(NbdClient { wr: tokio::sync::Mutex::new(wr), pending, next: AtomicU64::new(1), size })
    }

    async fn call(
        &self,
        command: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        reply_len: usize,
    ) -> io::Result<Bytes> {
        let cookie = self.next.fetch_add(1, Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().insert(cookie, (reply_len, tx));
        let h = Request { flags: 0, command, cookie, offset, length }.encode();
        {
            let mut w = self.wr.lock().await;
            if payload.is_empty() {
                w.write_all(&h).await?;
            } else {
                let mut v = Vec::with_capacity(h.len() + payload.len());
                v.extend_from_slice(&h);
                v.extend_from_slice(payload);
                w.write_all(&v).await?;
            }
        }
        rx.await.map_err(|_| io::Error::other("connection lost"))?
    }

    pub async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        self.call(CMD_READ, offset, len, &[], len as usize).await
    }

    pub async fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.call(CMD_WRITE, offset, data.len() as u32, data, 0).await.map(drop)
    }
}
