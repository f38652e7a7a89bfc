//! What the target's handshake fuzz targets run (`fuzz/fuzz_targets/`), and
//! the suite replays over the committed corpus: arbitrary client bytes, cut
//! at arbitrary points, fed to each handshake state machine, must never
//! panic, and every step must leave the machine consistent.

use crate::access::{Access, Grant, Who, DEFAULT_IDENTITY};
use crate::backend::{Backend, MemoryBackend};
use crate::catalog::Catalog;
use crate::frontend::brp::{Brp, BrpHandshake};
use crate::frontend::nbd::NbdHandshake;
use crate::frontend::{Handshake, Step};
use crate::sessions::Sessions;
use crate::stats::Stats;
use crate::volume::Volume;
use bytes::BytesMut;
use std::sync::Arc;

/// The volumes every input sees, made once (handshakes never change them).
fn catalog() -> Arc<Catalog> {
    static CATALOG: std::sync::OnceLock<Arc<Catalog>> = std::sync::OnceLock::new();
    CATALOG
        .get_or_init(|| {
            let mut c = Catalog::default();
            for name in ["vol0", "ro"] {
                let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
                c.add(Volume::with_backend(name.into(), b, 1 << 16));
            }
            Arc::new(c)
        })
        .clone()
}

/// Feeds `data` in pieces whose sizes come from `data` itself.
fn feed<H: Handshake>(mut hs: H, data: &[u8]) {
    let mut out = Vec::new();
    hs.start(&mut out);
    let mut input = BytesMut::new();
    let cut = data.first().map_or(1, |&b| (b as usize % 13) + 1);
    for piece in data.chunks(cut) {
        input.extend_from_slice(piece);
        let before = input.len();
        match hs.advance(&mut input, &mut out) {
            Ok(Step::Continue) => assert!(input.len() <= before),
            Ok(_) | Err(_) => return,
        }
    }
}

/// Security settings chosen by a byte: a secret (0x80), grants (0x40),
/// NBD opted out of authentication (0x20); and whether the client is local (0x10).
fn access(b: u8) -> (Arc<Access>, Who) {
    let mut a = Access::default();
    if b & 0x80 != 0 {
        a.secrets.insert(DEFAULT_IDENTITY.into(), Arc::from(&b"secret"[..]));
    }
    if b & 0x40 != 0 {
        a.grants = vec![Grant::parse("vol0:default:ro").unwrap(), Grant::parse("ro:anonymous").unwrap()];
    }
    a.nbd_insecure = b & 0x20 != 0;
    (Arc::new(a), Who { local: b & 0x10 != 0, ..Default::default() })
}

/// The BRP handshake; the first byte chooses the security settings (see `access`).
pub fn brp_handshake(data: &[u8]) {
    let (access, who) = access(data.first().copied().unwrap_or(0));
    let brp = Brp {
        catalog: catalog(),
        sessions: Arc::new(Sessions::default()),
        access,
        queue_depth: 8,
        stats: Arc::new(Stats::default()),
        instance: 1,
        boot: 1,
    };
    feed(BrpHandshake::new(brp, who, [7; 32]), data.get(1..).unwrap_or_default());
}

/// The NBD handshake; the last byte chooses the security settings (see `access`).
pub fn nbd_handshake(data: &[u8]) {
    let (access, who) = access(data.last().copied().unwrap_or(0));
    feed(NbdHandshake::new(catalog(), access, who), data);
}
