//! Pieces of the fake NBD servers the client's tests talk to.

use fastsan_nbd::consts::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Accepts one client on `l` and greets it (fixed newstyle) with the
/// handshake `flags`: its connection and the flags it answered, or `None`
/// if it left before answering.
pub async fn accept_and_greet(l: &TcpListener, flags: u16) -> Option<(TcpStream, u32)> {
    let (mut s, _) = l.accept().await.ok()?;
    let mut greet = NBDMAGIC.to_be_bytes().to_vec();
    greet.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greet.extend_from_slice(&flags.to_be_bytes());
    s.write_all(&greet).await.ok()?;
    let mut client = [0u8; 4];
    s.read_exact(&mut client).await.ok()?;
    Some((s, u32::from_be_bytes(client)))
}

/// An option reply: to option `opt`, of `kind`, carrying `payload`.
pub fn option_reply(opt: u32, kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = REPLY_MAGIC.to_be_bytes().to_vec();
    for v in [opt, kind, payload.len() as u32] {
        r.extend_from_slice(&v.to_be_bytes());
    }
    r.extend_from_slice(payload);
    r
}
