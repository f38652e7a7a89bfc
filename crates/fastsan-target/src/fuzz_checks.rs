//! What the target's handshake fuzz targets run (`fuzz/fuzz_targets/`), and
//! the suite replays over the committed corpus: arbitrary client bytes, cut
//! at arbitrary points, fed to each handshake state machine, must never
//! panic, and every step must leave the machine consistent.

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

/// The BRP handshake; the first byte chooses whether the target has a secret.
pub fn brp_handshake(data: &[u8]) {
    let secret = data.first().is_some_and(|b| b & 0x80 != 0).then(|| Arc::from(&b"secret"[..]));
    let brp = Brp {
        catalog: catalog(),
        sessions: Arc::new(Sessions::default()),
        secret,
        queue_depth: 8,
        stats: Arc::new(Stats::default()),
        instance: 1,
        boot: 1,
    };
    feed(BrpHandshake::new(brp, [7; 32]), data.get(1..).unwrap_or_default());
}

/// The NBD handshake.
pub fn nbd_handshake(data: &[u8]) {
    feed(NbdHandshake::new(catalog()), data);
}
