//! Writes the seed corpus of the BRP fuzz targets: `cargo run -p fastsan-brp --example
//! brp_fuzz_seeds -- fuzz/corpus`. The seeds are valid frames of every kind, so
//! the fuzzers start from the protocol's real shapes.

use fastsan_brp::batch::BatchBuilder;
use fastsan_brp::handshake::{Message, OpenInfo, VolumeInfo};
use fastsan_brp::reply::ReplyHeader;
use fastsan_brp::request::{encode_data_digest, encode_header, RequestHeader, FLAG_FUA};
use fastsan_brp::{Command, Status};
use std::path::Path;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn request_frame(h: &RequestHeader, payload: &[u8], digests: bool) -> Vec<u8> {
    let mut v = vec![digests as u8];
    encode_header(h, digests, &mut v);
    v.extend_from_slice(payload);
    if digests && !payload.is_empty() {
        v.extend(encode_data_digest(payload));
    }
    v
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: fuzz_seeds DIR");
    let dir = Path::new(&dir);
    let reqs = [
        (RequestHeader::new(Command::Read, 0, 1, 4096, 4096), vec![]),
        (RequestHeader::new(Command::Write, FLAG_FUA, 2, 0, 16), vec![0xAB; 16]),
        (RequestHeader::new(Command::Flush, 0, 3, 0, 0), vec![]),
        (RequestHeader::new(Command::Trim, 0, 4, 512, 1 << 20), vec![]),
        (RequestHeader::new(Command::WriteZeroes, 0, 5, 0, 8192), vec![]),
    ];
    for (i, (h, p)) in reqs.iter().enumerate() {
        for digests in [false, true] {
            write(dir, "request", &format!("req{i}-d{}", digests as u8), &request_frame(h, p, digests));
        }
    }
    let mut b = BatchBuilder::default();
    for (h, _) in &reqs {
        b.push(h);
    }
    let (bh, mut body) = b.finish();
    body.extend_from_slice(&reqs[1].1);
    let mut framed = vec![0];
    encode_header(&bh, false, &mut framed);
    framed.extend_from_slice(&body);
    write(dir, "request", "batch", &framed);
    let mut batch_seed = bh.count.to_le_bytes().to_vec();
    batch_seed.extend_from_slice(&body);
    write(dir, "batch", "five", &batch_seed);

    for (i, (status, data)) in
        [(Status::OK, vec![7u8; 64]), (Status::OUT_OF_RANGE, vec![])].iter().enumerate()
    {
        for digests in [false, true] {
            let h = ReplyHeader { status: *status, tag: 99, payload_len: data.len() as u32 };
            let (w, n) = h.encode_wire(digests);
            let mut v = vec![digests as u8];
            v.extend_from_slice(&w[..n]);
            v.extend_from_slice(data);
            if digests && !data.is_empty() {
                v.extend(encode_data_digest(data));
            }
            write(dir, "reply", &format!("reply{i}-d{}", digests as u8), &v);
        }
    }

    let msgs = [
        Message::Hello { min_version: 2, max_version: 2, features: 1 },
        Message::HelloReply { version: 2, auth: 1, features: 1, challenge: [3; 32] },
        Message::Auth { client_nonce: [1; 32], proof: [2; 32], identity: "alice".into() },
        Message::AuthOk { proof: [4; 32] },
        Message::List,
        Message::ListReply {
            volumes: vec![VolumeInfo { name: "vol0".into(), size: 1 << 30, block_size: 512, flags: 2 }],
        },
        Message::Open { session: 0, slot: 0, flags: 0, name: "vol0".into() },
        Message::OpenReply(OpenInfo {
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
        }),
        Message::Error { status: Status::NO_SUCH_VOLUME, message: "no volume".into() },
    ];
    for (i, m) in msgs.iter().enumerate() {
        write(dir, "handshake", &format!("msg{i}"), &m.to_vec());
    }
}
