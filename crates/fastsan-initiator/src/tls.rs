//! TLS for `brps://` (rustls): the client's configuration, and the PEM
//! loading the target shares. The initiator verifies the target's
//! certificate against the CA it is given (`--tls-ca`) and the host name
//! of the URL; it presents its own certificate when given one (the target
//! then knows it by the certificate's CN).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::Path;
use std::sync::Arc;

fn bad(path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()))
}

/// The crypto every TLS configuration here uses (ring).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file (at least one).
pub fn load_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| bad(path, format!("no usable private key: {e}")))
}

/// A root store of the CA certificates in a PEM file.
pub fn load_roots(path: &Path) -> io::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| bad(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// A client configuration that trusts the CA in `ca` and, with `identity`
/// (certificate and key), presents that certificate.
pub fn client_config(ca: &Path, identity: Option<(&Path, &Path)>) -> io::Result<Arc<rustls::ClientConfig>> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(load_roots(ca)?);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| bad(key, format!("does not match the certificate: {e}")))?,
    };
    Ok(Arc::new(config))
}
