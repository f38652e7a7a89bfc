//! Writes the seed corpus of the `initiator_handshake` fuzz target:
//! `cargo run -p fastsan-initiator --example initiator_fuzz_seeds -- fuzz/corpus`.
//! Each seed is what a target sends in one whole exchange, so the fuzzer
//! starts from every path through the handshake: open or authenticated,
//! LIST then OPEN, refusals.

use fastsan_brp::auth::server_proof;
use fastsan_brp::handshake::{Message, OpenInfo, VolumeInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use fastsan_brp::{Status, FEATURE_DIGEST};
use fastsan_initiator::fuzz_checks::{NONCE, SECRET};
use std::path::Path;

fn main() {
    let dir = std::env::args().nth(1).expect("usage: initiator_fuzz_seeds DIR");
    let dir = Path::new(&dir).join("initiator_handshake");
    std::fs::create_dir_all(&dir).unwrap();
    let challenge = [0x33; 32];
    let hello = |auth, features| Message::HelloReply { version: 2, auth, features, challenge };
    let auth_ok = Message::AuthOk { proof: server_proof(SECRET, &challenge, &NONCE, "") };
    let list = Message::ListReply {
        volumes: vec![VolumeInfo { name: "vol0".into(), size: 1 << 30, block_size: 512, flags: 2 }],
    };
    let open = Message::OpenReply(OpenInfo {
        session: 7,
        size: 1 << 30,
        block_size: 512,
        max_transfer: 8 << 20,
        queue_depth: 256,
        max_batch: 1024,
        flags: 0,
        instance: 0x5eed,
        generation: 1,
        boot: 1,
    });
    let refuse = |status, message: &str| Message::Error { status, message: message.into() };
    let seeds: [(&str, Vec<Message>); 6] = [
        ("hello_reply", vec![hello(AUTH_NONE, 0)]),
        ("hello_reply_list_open", vec![hello(AUTH_NONE, 0), list.clone(), open.clone()]),
        ("hello_reply_auth_ok", vec![hello(AUTH_HMAC_SHA256, FEATURE_DIGEST), auth_ok.clone()]),
        ("hello_reply_auth_ok_list_open", vec![hello(AUTH_HMAC_SHA256, FEATURE_DIGEST), auth_ok, list, open]),
        ("error_bad_version", vec![refuse(Status::BAD_VERSION, "version 1 only")]),
        ("error_no_such_volume", vec![hello(AUTH_NONE, 0), refuse(Status::NO_SUCH_VOLUME, "no volume 'x'")]),
    ];
    for (name, msgs) in seeds {
        let bytes: Vec<u8> = msgs.iter().flat_map(Message::to_vec).collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
