//! Writes the NBD seed corpus: `cargo run -p fastsan-nbd --example nbd_fuzz_seeds -- fuzz/corpus`.

use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{encode_option, InfoRequest, MetaContextRequest};
use fastsan_nbd::transmission::Request;
use std::path::Path;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: fuzz_seeds DIR");
    let dir = Path::new(&dir);
    let reqs = [
        (CMD_READ, 0, 4096),
        (CMD_WRITE, CMD_FLAG_FUA, 8),
        (CMD_FLUSH, 0, 0),
        (CMD_TRIM, 0, 1 << 20),
        (CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO, 65536),
        (CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 1 << 20),
        (CMD_CACHE, 0, 4096),
        (CMD_DISC, 0, 0),
    ];
    for (i, (command, flags, length)) in reqs.into_iter().enumerate() {
        let mut b = Request { flags, command, cookie: i as u64, offset: 512, length }.encode().to_vec();
        if command == CMD_WRITE {
            b.extend_from_slice(&[0xAB; 8]);
        }
        write(dir, "nbd_request", &format!("cmd{i}"), &b);
    }
    let opts: Vec<(u32, Vec<u8>)> = vec![
        (OPT_GO, InfoRequest { name: "vol0".into(), infos: vec![INFO_BLOCK_SIZE, INFO_NAME] }.encode()),
        (OPT_INFO, InfoRequest { name: "".into(), infos: vec![] }.encode()),
        (OPT_EXPORT_NAME, b"vol0".to_vec()),
        (OPT_LIST, vec![]),
        (OPT_STRUCTURED_REPLY, vec![]),
        (
            OPT_SET_META_CONTEXT,
            MetaContextRequest { name: "vol0".into(), queries: vec!["base:allocation".into()] }.encode(),
        ),
        (
            OPT_LIST_META_CONTEXT,
            MetaContextRequest { name: "vol0".into(), queries: vec!["base:".into()] }.encode(),
        ),
        (OPT_ABORT, vec![]),
    ];
    for (i, (o, data)) in opts.iter().enumerate() {
        let mut b = Vec::new();
        encode_option(*o, data, &mut b);
        write(dir, "nbd_option", &format!("opt{i}"), &b);
    }
}
