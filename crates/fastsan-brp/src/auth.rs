//! Challenge-response authentication on a shared secret. The secret never
//! crosses the wire: each side proves it knows the secret with an
//! HMAC-SHA256 over both sides' random nonces, so a proof is never reusable.
//!
//! - client proof = HMAC(secret, "fastsan-brp1-client" || server_challenge || client_nonce [|| id])
//! - server proof = HMAC(secret, "fastsan-brp1-server" || client_nonce || server_challenge [|| id])
//!
//! where `id` is the identity the client names in AUTH (its length as one
//! byte, then its bytes), left out when it names none, so that the proofs
//! of clients from before identities are unchanged. Binding the name means
//! a proof for one identity is never a proof for another.
//!
//! This authenticates the handshake only: it does not protect the frames
//! that follow, and one recorded exchange lets an attacker test guesses of
//! a weak secret offline. Across a network, run BRP over TLS (`brps://`),
//! which covers both (docs/protocol.md, "Security").

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], label: &[u8], a: &[u8; 32], b: &[u8; 32], id: &str) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(a);
    m.update(b);
    if !id.is_empty() {
        // Identities are at most 255 bytes (one length byte on the wire).
        m.update(&[id.len().min(255) as u8]);
        m.update(id.as_bytes());
    }
    m
}

/// The proofs and checks of one exchange: `id` is the identity the client names ("" for none).
pub fn client_proof(secret: &[u8], challenge: &[u8; 32], client_nonce: &[u8; 32], id: &str) -> [u8; 32] {
    mac(secret, b"fastsan-brp1-client", challenge, client_nonce, id).finalize().into_bytes().into()
}

pub fn server_proof(secret: &[u8], challenge: &[u8; 32], client_nonce: &[u8; 32], id: &str) -> [u8; 32] {
    mac(secret, b"fastsan-brp1-server", client_nonce, challenge, id).finalize().into_bytes().into()
}

/// Constant-time check of a client's proof.
pub fn verify_client(
    secret: &[u8],
    challenge: &[u8; 32],
    nonce: &[u8; 32],
    proof: &[u8; 32],
    id: &str,
) -> bool {
    mac(secret, b"fastsan-brp1-client", challenge, nonce, id).verify_slice(proof).is_ok()
}

/// Constant-time check of a server's proof.
pub fn verify_server(
    secret: &[u8],
    challenge: &[u8; 32],
    nonce: &[u8; 32],
    proof: &[u8; 32],
    id: &str,
) -> bool {
    mac(secret, b"fastsan-brp1-server", nonce, challenge, id).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_secret_nonces_and_direction() {
        let (c, n) = ([1u8; 32], [2u8; 32]);
        let p = client_proof(b"s3cret", &c, &n, "");
        assert!(verify_client(b"s3cret", &c, &n, &p, ""));
        assert!(!verify_client(b"wrong", &c, &n, &p, ""));
        assert!(!verify_client(b"s3cret", &[9; 32], &n, &p, ""));
        assert!(!verify_server(b"s3cret", &c, &n, &p, ""), "a client proof is not a server proof");
        let s = server_proof(b"s3cret", &c, &n, "");
        assert!(verify_server(b"s3cret", &c, &n, &s, ""));
        let alice = client_proof(b"s3cret", &c, &n, "alice");
        assert!(verify_client(b"s3cret", &c, &n, &alice, "alice"));
        assert!(!verify_client(b"s3cret", &c, &n, &alice, "bob"), "a proof names its identity");
        assert!(!verify_client(b"s3cret", &c, &n, &alice, ""));
    }
}
