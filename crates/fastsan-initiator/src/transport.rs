//! The byte stream under a connection: TCP or a unix socket.
//!
//! The handshake reads and writes a [`Stream`]; the transmission phase
//! splits it into owned halves and runs its loops generic over them (see
//! [`crate::conn`]), so each kind of socket gets its own compiled loops and
//! TCP's path costs nothing more than before unix sockets existed.

use crate::url::Endpoint;
use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `endpoint`; TCP without Nagle's delay, as every request
    /// is one write that should leave at once.
    pub async fn connect(endpoint: &Endpoint) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Tcp { .. } => {
                let s = TcpStream::connect(endpoint.to_string()).await?;
                s.set_nodelay(true)?;
                // A target that vanished without a word (power, network) is
                // noticed even when no request is waiting for it.
                let ka = socket2::TcpKeepalive::new()
                    .with_time(std::time::Duration::from_secs(15))
                    .with_interval(std::time::Duration::from_secs(5))
                    .with_retries(3);
                socket2::SockRef::from(&s).set_tcp_keepalive(&ka)?;
                Ok(Stream::Tcp(s))
            }
            Endpoint::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
        }
    }

    pub async fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(bytes).await,
            Stream::Unix(s) => s.write_all(bytes).await,
        }
    }

    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf).await,
            Stream::Unix(s) => s.read(buf).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_socket_is_an_error() {
        let e = Stream::connect(&Endpoint::Unix("/nonexistent/fastsan.sock".into())).await.err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
