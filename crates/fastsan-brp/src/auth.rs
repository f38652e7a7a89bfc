//! Challenge-response authentication on a shared secret. The secret never
//! crosses the wire: each side proves it knows the secret with an
//! HMAC-SHA256 over both sides' random nonces, so a proof is never reusable.
//!
//! - client proof = HMAC(secret, "fastsan-brp1-client" || server_challenge || client_nonce)
//! - server proof = HMAC(secret, "fastsan-brp1-server" || client_nonce || server_challenge)

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &[u8], a: &[u8; 32], b: &[u8; 32]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(a);
    m.update(b);
    m
}

pub fn client_proof(secret: &[u8], challenge: &[u8; 32], client_nonce: &[u8; 32]) -> [u8; 32] {
    mac(secret, b"fastsan-brp1-client", challenge, client_nonce).finalize().into_bytes().into()
}

pub fn server_proof(secret: &[u8], challenge: &[u8; 32], client_nonce: &[u8; 32]) -> [u8; 32] {
    mac(secret, b"fastsan-brp1-server", client_nonce, challenge).finalize().into_bytes().into()
}

/// Constant-time check of a client's proof.
pub fn verify_client(secret: &[u8], challenge: &[u8; 32], nonce: &[u8; 32], proof: &[u8; 32]) -> bool {
    mac(secret, b"fastsan-brp1-client", challenge, nonce).verify_slice(proof).is_ok()
}

/// Constant-time check of a server's proof.
pub fn verify_server(secret: &[u8], challenge: &[u8; 32], nonce: &[u8; 32], proof: &[u8; 32]) -> bool {
    mac(secret, b"fastsan-brp1-server", nonce, challenge).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_secret_nonces_and_direction() {
        let (c, n) = ([1u8; 32], [2u8; 32]);
        let p = client_proof(b"s3cret", &c, &n);
        assert!(verify_client(b"s3cret", &c, &n, &p));
        assert!(!verify_client(b"wrong", &c, &n, &p));
        assert!(!verify_client(b"s3cret", &[9; 32], &n, &p));
        assert!(!verify_server(b"s3cret", &c, &n, &p), "a client proof is not a server proof");
        let s = server_proof(b"s3cret", &c, &n);
        assert!(verify_server(b"s3cret", &c, &n, &s));
    }
}
