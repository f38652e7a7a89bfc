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
    let key =
        PrivateKeyDer::from_pem_file(path).map_err(|e| bad(path, format!("no usable private key: {e}")))?;
    Ok(match key {
        PrivateKeyDer::Sec1(k) => PrivateKeyDer::Sec1(sec1_minimal(k.secret_sec1_der()).into()),
        other => other,
    })
}

/// GnuTLS's `certtool` writes about half of its ECDSA keys (SEC1) with the
/// private scalar one byte too long, a leading zero (as if it were a DER
/// INTEGER); ring accepts only the exact length. Drops that byte and
/// re-encodes the outer length; any other key is returned as it is.
fn sec1_minimal(der: &[u8]) -> Vec<u8> {
    // SEQUENCE { INTEGER 1, OCTET STRING key, ... }
    let (body_at, body_len) = match der {
        [0x30, n, ..] if *n < 0x80 => (2, *n as usize),
        [0x30, 0x81, n, ..] => (3, *n as usize),
        _ => return der.to_vec(),
    };
    let body = &der[body_at..];
    let ok = body.len() == body_len && body.len() > 5 && body[..3] == [0x02, 0x01, 0x01] && body[3] == 0x04;
    let key_len = if ok { body[4] as usize } else { 0 };
    if !(ok && key_len < 0x80 && key_len % 2 == 1 && body.len() > 5 + key_len && body[5] == 0) {
        return der.to_vec();
    }
    let mut inner = vec![0x02, 0x01, 0x01, 0x04, (key_len - 1) as u8];
    inner.extend_from_slice(&body[6..]);
    let mut out = vec![0x30];
    if inner.len() < 0x80 {
        out.push(inner.len() as u8);
    } else {
        out.extend([0x81, inner.len() as u8]);
    }
    out.extend(inner);
    out
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_sec1_key_with_a_leading_zero_is_trimmed_and_others_are_kept() {
        // version 1, a 33-byte key starting with zero, then [0] params (kept as they are).
        let mut long = vec![0x30, 40, 0x02, 0x01, 0x01, 0x04, 33, 0x00];
        long.extend([0xcd; 32]);
        long.extend([0xa0, 0x00]);
        let fixed = super::sec1_minimal(&long);
        assert_eq!(fixed[..7], [0x30, 39, 0x02, 0x01, 0x01, 0x04, 32]);
        assert_eq!(fixed[7..39], [0xcd; 32]);
        assert_eq!(fixed[39..], [0xa0, 0x00]);
        assert_eq!(super::sec1_minimal(&fixed), fixed, "an exact key is left alone");
        assert_eq!(super::sec1_minimal(&[0x30, 0x05, 1]), vec![0x30, 0x05, 1], "garbage is passed on");
    }
}
