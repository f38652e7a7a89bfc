//! Writes the seed corpus of the target's handshake fuzz targets:
//! `cargo run -p fastsan-target --example target_fuzz_seeds -- fuzz/corpus`.
//! The seeds are real client conversations, so the fuzzers start from the
//! protocols' shapes. (See `fastsan_target::fuzz_checks` for the byte layout:
//! a BRP seed starts with a byte choosing the security settings: 0x80 a
//! secret, 0x40 grants, 0x20 NBD opted out, 0x10 a local client.)

use fastsan_brp::handshake::Message;
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{encode_option, InfoRequest, MetaContextRequest};
use std::path::Path;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn brp(selector: u8, msgs: &[Message]) -> Vec<u8> {
    let mut v = vec![selector];
    for m in msgs {
        v.extend(m.to_vec());
    }
    v
}

fn nbd(opts: &[(u32, Vec<u8>)]) -> Vec<u8> {
    let mut v = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
    for (o, d) in opts {
        encode_option(*o, d, &mut v);
    }
    v
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: target_fuzz_seeds DIR");
    let dir = Path::new(&dir);
    let hello = |features| Message::Hello { min_version: 2, max_version: 2, features };
    let open = |name: &str| Message::Open { session: 0, slot: 0, flags: 0, name: name.into() };
    // fuzz_checks::brp_handshake uses challenge [7; 32] and secret "secret".
    let nonce = [1u8; 32];
    let proof = fastsan_brp::auth::client_proof(b"secret", &[7; 32], &nonce, "");
    let seeds = [
        ("list-open", brp(0x00, &[hello(0), Message::List, open("vol0")])),
        ("digests-open-missing-then-ro", brp(0x01, &[hello(1), open("nope"), open("ro")])),
        (
            "auth-open",
            brp(
                0x90,
                &[
                    hello(0),
                    Message::Auth { client_nonce: nonce, proof, identity: String::new() },
                    open("vol0"),
                ],
            ),
        ),
        ("auth-skipped", brp(0x95, &[hello(0), open("vol0")])),
        (
            "auth-granted-read-only",
            brp(
                0xd0,
                &[
                    hello(0),
                    Message::Auth { client_nonce: nonce, proof, identity: String::new() },
                    Message::List,
                    open("ro"),
                    open("vol0"),
                ],
            ),
        ),
        (
            "auth-named-identity",
            brp(
                0x90,
                &[
                    hello(0),
                    Message::Auth {
                        client_nonce: nonce,
                        proof: fastsan_brp::auth::client_proof(b"secret", &[7; 32], &nonce, "default"),
                        identity: "default".into(),
                    },
                    open("vol0"),
                ],
            ),
        ),
        ("auth-from-another-host-in-plaintext", brp(0x80, &[hello(0)])),
        (
            "tls-client-hello-without-tls",
            vec![0x10, 0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00],
        ),
        (
            "bad-proof",
            brp(
                0x93,
                &[hello(0), Message::Auth { client_nonce: nonce, proof: [0; 32], identity: String::new() }],
            ),
        ),
        ("bad-version", brp(0x02, &[Message::Hello { min_version: 5, max_version: 9, features: 0 }])),
        ("open-before-hello", brp(0x04, &[open("vol0")])),
    ];
    for (name, bytes) in seeds {
        write(dir, "target_brp_handshake", name, &bytes);
    }
    let go = |name: &str, infos: Vec<u16>| InfoRequest { name: name.into(), infos }.encode();
    let meta =
        |name: &str, q: &str| MetaContextRequest { name: name.into(), queries: vec![q.into()] }.encode();
    let mut huge = nbd(&[]);
    huge.extend(IHAVEOPT.to_be_bytes());
    huge.extend(OPT_GO.to_be_bytes());
    huge.extend((1u32 << 30).to_be_bytes());
    let seeds = [
        ("list-go", nbd(&[(OPT_LIST, vec![]), (OPT_GO, go("vol0", vec![INFO_NAME, INFO_DESCRIPTION]))])),
        (
            "structured-meta-go",
            nbd(&[
                (OPT_STRUCTURED_REPLY, vec![]),
                (OPT_LIST_META_CONTEXT, meta("vol0", "base:")),
                (OPT_SET_META_CONTEXT, meta("vol0", CONTEXT_BASE_ALLOCATION)),
                (OPT_GO, go("vol0", vec![])),
            ]),
        ),
        (
            "info-unknown-export-name",
            nbd(&[(OPT_INFO, go("nope", vec![])), (OPT_EXPORT_NAME, b"ro".to_vec())]),
        ),
        ("unknown-starttls-abort", nbd(&[(0x77, vec![1, 2]), (OPT_STARTTLS, vec![]), (OPT_ABORT, vec![])])),
        ("oversized-option", huge),
        // The last byte chooses the settings: 0x80, a secret (so TLS is required).
        ("tls-required-list-go", {
            let mut v = nbd(&[(OPT_LIST, vec![]), (OPT_GO, go("vol0", vec![])), (OPT_STARTTLS, vec![])]);
            v.push(0x80);
            v
        }),
        ("grants-go-ro", {
            let mut v = nbd(&[(OPT_INFO, go("vol0", vec![])), (OPT_GO, go("ro", vec![]))]);
            v.push(0x60);
            v
        }),
    ];
    for (name, bytes) in seeds {
        write(dir, "target_nbd_handshake", name, &bytes);
    }
}
