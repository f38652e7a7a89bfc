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

/// How a handshake fed in pieces ended, and every byte it answered: the
/// same whatever the pieces its input came in (`tests/fuzz_corpus.rs`).
#[derive(Debug, PartialEq, Eq)]
pub struct Fed {
    pub end: String,
    pub sent: Vec<u8>,
}

/// Feeds `data` in pieces of `cut` bytes, and after each step that took a
/// message asks again (as the driver does: the next may be buffered already).
fn feed<H: Handshake>(mut hs: H, data: &[u8], cut: usize) -> Fed {
    let mut sent = Vec::new();
    hs.start(&mut sent);
    let mut input = BytesMut::new();
    for piece in data.chunks(cut) {
        input.extend_from_slice(piece);
        loop {
            let before = input.len();
            let step = hs.advance(&mut input, &mut sent);
            let end = match step {
                Ok(Step::Continue) => {
                    assert!(input.len() <= before, "a step that grew its input");
                    if input.len() < before {
                        continue;
                    }
                    break;
                }
                Ok(Step::Done(_)) => "done".into(),
                Ok(Step::Abort) => "abort".into(),
                Ok(Step::Refused(why)) => format!("refused: {why}"),
                Ok(Step::AuthFailed(why)) => format!("authentication failed: {why}"),
                Ok(Step::StartTls { replay }) => format!("tls (replay {replay})"),
                Err(e) => format!("error: {e}"),
            };
            return Fed { end, sent };
        }
    }
    Fed { end: "more bytes needed".into(), sent }
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

/// The BRP handshake; the first byte chooses the security settings (its high
/// bits, see `access`) and the size of the pieces the rest comes in (its low
/// four: [`pieces`]).
pub fn brp_handshake(data: &[u8]) -> Fed {
    same_whole(brp_handshake_in(data, pieces(data.first().copied().unwrap_or(0))), || {
        brp_handshake_in(data, usize::MAX)
    })
}

/// A handshake fed in pieces ends as it does fed whole, having answered as
/// many bytes; but for TLS, whose start depends on what came behind it
/// (plaintext buffered after NBD's STARTTLS is refused as an injection).
fn same_whole(fed: Fed, whole: impl FnOnce() -> Fed) -> Fed {
    let w = whole();
    let tls = |f: &Fed| f.end.contains("tls") || f.end.contains("TLS");
    if !tls(&fed) && !tls(&w) {
        assert_eq!((&fed.end, fed.sent.len()), (&w.end, w.sent.len()), "in pieces and whole");
    }
    fed
}

/// [`brp_handshake`] in pieces of `cut` bytes.
pub fn brp_handshake_in(data: &[u8], cut: usize) -> Fed {
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
    feed(BrpHandshake::new(brp, who, [7; 32]), data.get(1..).unwrap_or_default(), cut)
}

/// The NBD handshake; the last byte (a client's own, also fed) chooses the
/// security settings (its high bits, see `access`) and the size of the
/// pieces (its low four: [`pieces`]).
pub fn nbd_handshake(data: &[u8]) -> Fed {
    same_whole(nbd_handshake_in(data, pieces(data.last().copied().unwrap_or(0))), || {
        nbd_handshake_in(data, usize::MAX)
    })
}

/// [`nbd_handshake`] in pieces of `cut` bytes.
pub fn nbd_handshake_in(data: &[u8], cut: usize) -> Fed {
    let (access, who) = access(data.last().copied().unwrap_or(0));
    feed(NbdHandshake::new(catalog(), access, who), data, cut)
}

/// The NVMe/TCP front end, handshake then transmission, on a fresh
/// subsystem with one enabled controller (id 1, 4 I/O queues granted, host
/// [`NVME_HOST`]) so that inputs can join it as an I/O queue. The first
/// byte chooses the security settings (its high bits, see `access`) and the
/// size of the pieces the rest comes in (its low four: [`pieces`]);
/// the rest is a host's bytes. Decode must never panic. Returns how many
/// items (requests and replies) decode gave, so the corpus can be checked
/// to reach past the handshake.
pub fn nvme(data: &[u8]) -> usize {
    use crate::frontend::nvme::{ConnectArgs, NvmeHandshake, Subsystem};
    use crate::frontend::{Decoded, Transmission};
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    // A shutdown (CC.SHN) flushes on a blocking thread: decode runs inside a runtime, as in the driver.
    let rt = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
    });
    let _in_runtime = rt.enter();
    let (access, who) = access(data.first().copied().unwrap_or(0));
    let sub = Arc::new(Subsystem::new(NVME_NQN.into(), &catalog(), access));
    let args = |qid| ConnectArgs {
        qid,
        sqsize: 31,
        cattr: 0,
        kato_ms: 0,
        cntlid: 0xffff,
        subnqn: NVME_NQN.into(),
        hostnqn: NVME_HOST.into(),
        hostid: [0; 16],
        digests: Default::default(),
    };
    let mut admin = sub.connect(args(0), &who).expect("an admin queue");
    let mut enable = BytesMut::from(&nvme_enable()[..]);
    while let Ok(Decoded::Local { .. }) = admin.decode(&mut enable) {}
    let mut hs = NvmeHandshake::new(sub.clone(), who);
    let mut out = Vec::new();
    let mut input = BytesMut::new();
    let cut = pieces(data.first().copied().unwrap_or(0));
    let data = data.get(1..).unwrap_or_default();
    let (mut conn, mut items) = (None, 0);
    for piece in data.chunks(cut) {
        input.extend_from_slice(piece);
        // As the driver does: after a step that took a message, another may
        // be buffered already (a host that sends Connect right behind ICReq).
        while conn.is_none() {
            let before = input.len();
            match hs.advance(&mut input, &mut out) {
                Ok(Step::Continue) if input.len() < before => {}
                Ok(Step::Continue) => break,
                Ok(Step::Done(c)) => conn = Some(c),
                Ok(_) | Err(_) => return items,
            }
        }
        if conn.is_none() {
            continue;
        }
        let c = conn.as_mut().expect("connected");
        loop {
            match c.decode(&mut input) {
                Ok(Decoded::Incomplete { .. }) => break,
                Ok(Decoded::Disconnect) | Err(_) => return items,
                Ok(_) => items += 1,
            }
        }
    }
    items
}

/// The size of the pieces the checks feed ([`nvme`], [`brp_handshake`],
/// [`nbd_handshake`]), from the low four bits of their selector byte: 0, one byte at a time (each PDU framed alone, as the seeds
/// were written); 1 to 14, 2 to 16 KiB (several PDUs, or a PDU and the start
/// of the next, in the buffer at once); 15, all at once. (Until 2026-11-28
/// the size came from the host's first byte, which every ICReq starts with
/// 0: every input that got past the handshake came one byte at a time.)
pub fn pieces(selector: u8) -> usize {
    match selector & 0x0f {
        0 => 1,
        15 => usize::MAX,
        n => 1 << n,
    }
}

/// The subsystem and host of [`nvme`].
pub const NVME_NQN: &str = "nqn.2026-11.io.fastsan:fuzz";
pub const NVME_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";

/// Property Set CC.EN and Set Features (4 I/O queues), as an admin queue receives them.
fn nvme_enable() -> Vec<u8> {
    use fastsan_nvme::command::{fctype, Sqe, OPC_FABRICS};
    use fastsan_nvme::pdu::{encode, Digests, Header};
    let mut v = Vec::new();
    let mut cc = Sqe::decode(&[0; 64]);
    cc.opcode = OPC_FABRICS;
    cc.nsid = fctype::PROPERTY_SET as u32;
    cc.cdw11 = 0x14;
    cc.cdw12 = 0x0046_0001;
    encode(&Header::CapsuleCmd(cc), 0, &[], Digests::default(), 0, &mut v);
    let mut queues = Sqe::decode(&[0; 64]);
    queues.opcode = 0x09;
    queues.cdw10 = 0x07;
    queues.cdw11 = 3 | 3 << 16;
    encode(&Header::CapsuleCmd(queues), 0, &[], Digests::default(), 0, &mut v);
    v
}
