//! The byte stream under a connection: TCP, TLS over TCP, or a unix socket.
//!
//! The handshake reads and writes a [`Stream`]; the transmission phase
//! splits it into owned halves and runs its loops generic over them (see
//! [`crate::conn`]), so each kind of socket gets its own compiled loops and
//! TCP's path costs nothing more than before unix sockets existed.

use crate::url::Endpoint;
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

pub(crate) enum Stream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `endpoint`; TCP without Nagle's delay, as every request
    /// is one write that should leave at once.
    pub async fn connect(endpoint: &Endpoint, tls: Option<&Arc<rustls::ClientConfig>>) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Tcp { tls: want_tls, host, .. } => {
                let s = TcpStream::connect(endpoint.to_string()).await?;
                s.set_nodelay(true)?;
                // A target that vanished without a word (power, network) is
                // noticed even when no request is waiting for it.
                let ka = socket2::TcpKeepalive::new()
                    .with_time(std::time::Duration::from_secs(15))
                    .with_interval(std::time::Duration::from_secs(5))
                    .with_retries(3);
                socket2::SockRef::from(&s).set_tcp_keepalive(&ka)?;
                if !want_tls {
                    return Ok(Stream::Tcp(s));
                }
                let config = tls.ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "brps:// needs the CA that signed the target's certificate (--tls-ca)",
                    )
                })?;
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{host}: {e}")))?;
                let s = tokio_rustls::TlsConnector::from(config.clone()).connect(name, s).await?;
                Ok(Stream::Tls(Box::new(s)))
            }
            Endpoint::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
        }
    }

    pub async fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(bytes).await,
            Stream::Tls(s) => {
                s.write_all(bytes).await?;
                s.flush().await
            }
            Stream::Unix(s) => s.write_all(bytes).await,
        }
    }

    pub async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf).await,
            Stream::Tls(s) => s.read(buf).await,
            Stream::Unix(s) => s.read(buf).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_missing_socket_is_an_error() {
        let e =
            Stream::connect(&Endpoint::Unix("/nonexistent/fastsan.sock".into()), None).await.err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
