//! TLS, configured once for every front end (rustls, no OpenSSL).
//!
//! - [`TlsFiles`] -> [`ServerTls`]: the target's certificate and key, and,
//!   with a CA, client certificates verified against it (a client without
//!   one may still connect; what it may open is [`crate::access`]'s call).
//! - [`MaybeTls`]: the stream a connection runs on, plaintext or upgraded
//!   in the middle of its handshake (NBD's STARTTLS, BRP's first byte).
//! - [`Prefixed`]: replays bytes the driver read before it knew they were
//!   TLS (BRP's ClientHello), and nothing else: NBD's STARTTLS discards.

use crate::config::ConfigError;
use crate::driver::Transport;
use bytes::{Buf, Bytes};
use fastsan_initiator::tls::{load_certs, load_key, load_roots, provider};
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// When a front end uses TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// No TLS: NBD's STARTTLS is refused, a BRP ClientHello is closed.
    #[default]
    Off,
    /// Clients choose: plaintext and TLS both served (the access rules still apply).
    Allow,
    /// TLS only: NBD answers every option but STARTTLS with `ERR_TLS_REQD`
    /// (the spec's FORCEDTLS); a plaintext BRP HELLO gets an error.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "off" => Ok(TlsMode::Off),
            "allow" => Ok(TlsMode::Allow),
            "require" => Ok(TlsMode::Require),
            _ => Err(ConfigError::Invalid(format!("TLS mode {s:?}: expected off, allow or require"))),
        }
    }
}

/// Where the target's TLS material is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The target's certificate chain (PEM), its own first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) that sign client certificates; `None`: clients present none.
    pub ca: Option<PathBuf>,
}

/// The loaded TLS configuration of a target.
pub struct ServerTls {
    pub acceptor: TlsAcceptor,
    pub mode: TlsMode,
    /// Client certificates are asked for and verified against a CA.
    pub verify_clients: bool,
}

fn loaded<T>(r: io::Result<T>) -> Result<T, ConfigError> {
    r.map_err(|e| ConfigError::Invalid(format!("TLS: {e}")))
}

impl ServerTls {
    pub fn load(files: &TlsFiles, mode: TlsMode) -> Result<ServerTls, ConfigError> {
        let certs = loaded(load_certs(&files.cert))?;
        let key = loaded(load_key(&files.key))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigError::Invalid(format!("TLS: {e}")))?;
        let builder = match &files.ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(loaded(load_roots(ca))?),
                    provider(),
                )
                // A client without a certificate gets through TLS as
                // nobody; the access rules decide what nobody may do.
                .allow_unauthenticated()
                .build()
                .map_err(|e| ConfigError::Invalid(format!("TLS: {}: {e}", ca.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder.with_single_cert(certs, key).map_err(|e| {
            ConfigError::Invalid(format!("TLS: {}: does not match the certificate: {e}", files.key.display()))
        })?;
        Ok(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            mode,
            verify_clients: files.ca.is_some(),
        })
    }
}

/// The identity a verified client certificate carries: its subject's common
/// name (CN), or, with none, the whole subject as text.
pub fn cert_identity(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    if let Some(cn) = subject.iter_common_name().next().and_then(|cn| cn.as_str().ok()) {
        return Some(cn.to_owned());
    }
    Some(subject.to_string()).filter(|s| !s.is_empty())
}

/// A stream that yields `prefix` before its own bytes.
pub struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Bytes, inner: S) -> Self {
        Prefixed { prefix, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, b)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection's stream: as accepted, or upgraded to TLS.
pub enum MaybeTls<S> {
    Plain(S),
    Tls(Box<TlsStream<Prefixed<S>>>),
}

impl<S> MaybeTls<S> {
    pub fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            MaybeTls::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            MaybeTls::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
        }
    };
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        both!(self, s => s.poll_read(cx, buf))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        both!(self, s => s.poll_write(cx, b))
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        both!(self, s => s.poll_write_vectored(cx, bufs))
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => s.poll_flush(cx))
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => s.poll_shutdown(cx))
    }
}

/// Plaintext keeps the socket's own owned halves (no lock between reader
/// and writer); TLS, one state machine for both directions, splits behind a lock.
impl<S: Transport> Transport for MaybeTls<S> {
    type Read = tokio_util::either::Either<S::Read, tokio::io::ReadHalf<TlsStream<Prefixed<S>>>>;
    type Write = tokio_util::either::Either<S::Write, tokio::io::WriteHalf<TlsStream<Prefixed<S>>>>;
    fn split(self) -> (Self::Read, Self::Write) {
        use tokio_util::either::Either;
        match self {
            MaybeTls::Plain(s) => {
                let (r, w) = s.split();
                (Either::Left(r), Either::Left(w))
            }
            MaybeTls::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (Either::Right(r), Either::Right(w))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn prefixed_replays_its_bytes_then_reads_on() {
        let (mut a, b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"world").await.unwrap();
        drop(a);
        let mut p = Prefixed::new(Bytes::from_static(b"hello "), b);
        let mut all = String::new();
        p.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "hello world");
    }

    #[test]
    fn modes_parse_and_bad_files_say_which() {
        assert_eq!("require".parse::<TlsMode>().unwrap(), TlsMode::Require);
        assert!("on".parse::<TlsMode>().is_err());
        let files =
            TlsFiles { cert: "/nonexistent/cert.pem".into(), key: "/nonexistent/key.pem".into(), ca: None };
        let e = ServerTls::load(&files, TlsMode::Require).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/cert.pem"), "{e}");
    }
}
