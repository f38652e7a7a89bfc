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

/// GnuTLS's `certtool` writes the private scalar of its ECDSA keys (SEC1)
/// at its minimal length as a DER INTEGER would: about half of them one byte
/// too long (a leading zero), one in 256 one byte short (a leading zero
/// dropped). ring accepts only the curve's exact length, so the key is
/// brought to it (the curve is named in the key's parameters: P-256, P-384,
/// P-521), its outer length re-encoded. Any other key is returned as it is.
fn sec1_minimal(der: &[u8]) -> Vec<u8> {
    sec1_exact(der).unwrap_or_else(|| der.to_vec())
}

/// [`sec1_minimal`]'s work: `None` when there is nothing to change (or
/// nothing it understands).
fn sec1_exact(der: &[u8]) -> Option<Vec<u8>> {
    // SEQUENCE { INTEGER 1, OCTET STRING key, [0] { OID curve }, [1] public key }
    let (body_at, body_len) = match der {
        [0x30, n, ..] if *n < 0x80 => (2, *n as usize),
        [0x30, 0x81, n, ..] => (3, *n as usize),
        _ => return None,
    };
    let body = der.get(body_at..)?;
    if body.len() != body_len || body.get(..4)? != [0x02, 0x01, 0x01, 0x04] {
        return None;
    }
    let key_len = *body.get(4)? as usize;
    let key = body.get(5..5 + key_len)?;
    let rest = &body[5 + key_len..];
    // [0] { OBJECT IDENTIFIER }: the curve, so its scalar's length.
    let oid = match rest {
        [0xa0, n, 0x06, m, oid @ ..] if *n as usize == *m as usize + 2 => oid.get(..*m as usize)?,
        _ => return None,
    };
    let want = match oid {
        [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07] => 32, // P-256
        [0x2b, 0x81, 0x04, 0x00, 0x22] => 48,                   // P-384
        [0x2b, 0x81, 0x04, 0x00, 0x23] => 66,                   // P-521
        _ => return None,
    };
    let digits = &key[key.iter().take_while(|b| **b == 0).count()..];
    if key_len == want || digits.len() > want {
        return None;
    }
    let mut inner = vec![0x02, 0x01, 0x01, 0x04, want as u8];
    inner.resize(inner.len() + want - digits.len(), 0);
    inner.extend_from_slice(digits);
    inner.extend_from_slice(rest);
    let mut out = vec![0x30];
    match inner.len() {
        n if n < 0x80 => out.push(n as u8),
        n if n < 0x100 => out.extend([0x81, n as u8]),
        _ => return None,
    }
    out.extend(inner);
    Some(out)
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
    /// A P-256 key (SEC1) with a scalar of `len` bytes: `0xcd`s after `zeros` zero bytes.
    fn p256(len: usize, zeros: usize) -> Vec<u8> {
        let curve = [0xa0, 0x0a, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
        let public = [0xa1, 0x03, 0x03, 0x01, 0x00];
        let mut body = vec![0x02, 0x01, 0x01, 0x04, len as u8];
        body.extend(std::iter::repeat_n(0u8, zeros).chain(std::iter::repeat_n(0xcd, len - zeros)));
        body.extend(curve);
        body.extend(public);
        let mut der = vec![0x30, body.len() as u8];
        der.extend(body);
        der
    }

    #[test]
    fn a_sec1_key_is_brought_to_its_curves_length_and_others_are_kept() {
        let exact = p256(32, 1);
        assert_eq!(super::sec1_minimal(&exact), exact, "an exact key is left alone");
        // One byte long (a leading zero, as certtool writes half of them), one short.
        assert_eq!(super::sec1_minimal(&p256(33, 2)), exact);
        assert_eq!(super::sec1_minimal(&p256(31, 0)), exact);
        // Too many digits for the curve, another curve, garbage: as they are.
        assert_eq!(super::sec1_minimal(&p256(33, 0)), p256(33, 0));
        let mut other = p256(31, 0);
        let curve_last = other.len() - 6; // the OID's last byte, before the 5-byte public key
        other[curve_last] = 0x99;
        assert_eq!(super::sec1_minimal(&other), other);
        assert_eq!(super::sec1_minimal(&[0x30, 0x05, 1]), vec![0x30, 0x05, 1], "garbage is passed on");
        assert_eq!(super::sec1_minimal(&exact[..20]), exact[..20].to_vec());
    }

    /// Keys from GnuTLS's certtool (the tool the interop tests use), with
    /// their scalar 33, 31 and 32 bytes long: every one loads.
    #[test]
    fn certtool_keys_of_every_length_load() {
        let keys = [
            include_str!("../tests/keys/certtool-33.pem"),
            include_str!("../tests/keys/certtool-31.pem"),
            include_str!("../tests/keys/certtool-32.pem"),
        ];
        let provider = super::provider();
        for (i, pem) in keys.iter().enumerate() {
            let dir = std::env::temp_dir().join(format!("fastsan-key-{}-{i}", std::process::id()));
            std::fs::write(&dir, pem).unwrap();
            let key = super::load_key(&dir).unwrap();
            std::fs::remove_file(&dir).unwrap();
            assert!(provider.key_provider.load_private_key(key).is_ok(), "key {i} does not load");
        }
    }
}
