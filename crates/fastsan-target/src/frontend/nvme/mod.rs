//! The NVMe/TCP front end: the Linux kernel's `nvme-tcp` (driven by
//! nvme-cli), SPDK and other NVMe over Fabrics hosts. Its handshake
//! ([`handshake`]: ICReq and Connect), **decode** ([`NvmeConn::decode`]:
//! PDUs to admin commands answered here, I/O commands to requests on the
//! namespace's volume, write data solicited by R2T), its reply format
//! ([`NvmeEncoder`]: C2HData and CapsuleResp) and the one mapping from a
//! refusal to an NVMe status ([`status_for`]). The connection itself is
//! [`crate::driver`]'s: each queue is one TCP connection through the shared
//! pipeline, its credits the pipeline's, its completions out of order.
//!
//! The subsystem ([`Subsystem`]) has one namespace per volume, NSIDs in
//! configuration order, each with an NGUID and a UUID derived from the
//! subsystem's NQN and the volume's name (stable across restarts and
//! reordering). A controller lives while its admin queue does, or until
//! its host sends nothing for its keep-alive timeout ([`Subsystem::reap`]).
//! A discovery controller (`nqn.2014-08.org.nvmexpress.discovery`) is
//! served on the same port. Byte-level notes with sources: docs/nvme-tcp.md.

pub mod admin;
pub mod handshake;

pub use handshake::NvmeHandshake;

use crate::access::{Access, Mode, Who};
use crate::backend::BackendError;
use crate::catalog::Catalog;
use crate::fence::Activity;
use crate::frontend::{Arriving, Decoded, Frontend, Transmission, WireError};
use crate::pipeline::{Encoded, Encoder, Reply};
use crate::request::{IoKind, IoRequest, Limits, Refusal};
use crate::volume::{Outcome, Volume};
use bytes::{Buf, Bytes, BytesMut};
use fastsan_nvme::command::{fctype, sgl, status, Cqe, Sqe, Status, OPC_FABRICS};
use fastsan_nvme::pdu::{self, fes, flag, DataHeader, Digests, Header, R2t, TermReq};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// The bytes an I/O command's SLBA and NLB (0's based) name, for blocks of
/// `1 << shift` bytes; past the end is the volume's refusal.
fn lba_range(sqe: &Sqe, shift: u8) -> (u64, u64) {
    let slba = sqe.cdw10 as u64 | (sqe.cdw11 as u64) << 32;
    let blocks = (sqe.cdw12 & 0xffff) as u64 + 1;
    (slba.saturating_mul(1 << shift), blocks << shift)
}

/// The well-known NQN of discovery controllers.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// In-capsule data on I/O queues (IOCCSZ): every write a host can send
/// (MDTS) travels with its command, no R2T round trip. Targets that keep a
/// buffer per queue entry keep this small (Linux's nvmet 16 KiB, SPDK 4 KiB);
/// here the data lands in the connection's read buffer, and what a host may
/// send unasked is bounded as with NBD's writes: by the connection's credits
/// and byte budget (the target stops reading). At 8 KiB, 1 MiB writes by
/// R2T ran 10-18% slower than in the capsule and 128 KiB writes 9-26%
/// (docs/benchmarks.md, "NVMe/TCP writes in the capsule").
pub const IN_CAPSULE: u32 = MAX_TRANSFER;
/// In-capsule data on the admin queue and for Connect (the Linux host's 8 KiB).
pub const ADMIN_IN_CAPSULE: u32 = 8192;
/// Most data in one H2CData PDU (MAXH2CDATA).
pub const MAX_H2C_DATA: u32 = 1 << 20;
/// Entries per queue (CAP.MQES + 1, MAXCMD).
pub const QUEUE_ENTRIES: u16 = 128;
/// Most I/O queues a controller grants.
pub const MAX_IO_QUEUES: u16 = 16;
/// Largest transfer (MDTS), if the volumes allow it: 1 MiB.
const MAX_TRANSFER: u32 = 1 << 20;
/// Write data asked for by R2T and not yet arrived, per queue: what a host
/// can make the target buffer.
const R2T_BYTES: u64 = 8 << 20;

/// The NVMe/TCP protocol as the target serves it.
pub struct Nvme {
    pub subsystem: Arc<Subsystem>,
}

impl Frontend for Nvme {
    type Handshake = NvmeHandshake;
    type Conn = NvmeConn;
    const NAME: &'static str = "NVMe/TCP";

    fn handshake(&self, who: Who) -> NvmeHandshake {
        NvmeHandshake::new(self.subsystem.clone(), who)
    }

    fn busy(&self) -> Option<Vec<u8>> {
        // Nothing may precede ICResp: the host sees a close.
        None
    }
}

/// A volume as a namespace.
pub struct Namespace {
    pub nsid: u32,
    pub volume: Arc<Volume>,
    /// log2 of the LBA size: the volume's granule (at least 512 bytes).
    pub lba_shift: u8,
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
}

/// A host as fences know it: its NQN and host identifier.
type Host = (String, [u8; 16]);

/// The NVM subsystem: its NQN, its namespaces, its live controllers.
pub struct Subsystem {
    pub nqn: String,
    pub serial: String,
    pub namespaces: Vec<Namespace>,
    /// Each namespace's volume, by NSID - 1 ([`Transmission::volumes`]).
    volumes: Vec<Arc<Volume>>,
    pub access: Arc<Access>,
    /// MDTS: the largest transfer is 4 KiB << mdts.
    pub mdts: u8,
    controllers: Mutex<HashMap<u16, Arc<Controller>>>,
    /// Queues of deleted controllers, by host, that may still have device
    /// work running (see [`NvmeConn::fence`]).
    departed: Mutex<Vec<(Host, Arc<Activity>)>>,
    next_cntlid: Mutex<u16>,
}

/// Why a Connect is refused: its status, the field at fault (the
/// response's DW0: [`connect_field`]) and, for the log, the reason.
#[derive(Debug)]
pub struct ConnectRefusal {
    pub status: (u8, u8),
    pub at: u32,
    pub why: String,
}

/// Where a Connect's fields lie, as its response's DW0 names one that is
/// wrong (NVMe over Fabrics, Connect response: IATTR in bit 16, set for the
/// Connect data, clear for the command; IPO, the byte offset, below).
pub mod connect_field {
    const IN_DATA: u32 = 1 << 16;
    /// RECFMT: CDW10 bits 15:0 of the command.
    pub const RECFMT: u32 = 40;
    /// QID: CDW10 bits 31:16.
    pub const QID: u32 = 42;
    /// SQSIZE: CDW11 bits 15:0.
    pub const SQSIZE: u32 = 44;
    pub const CNTLID: u32 = IN_DATA | 16;
    pub const SUBNQN: u32 = IN_DATA | 256;
    pub const HOSTNQN: u32 = IN_DATA | 512;
}

/// The keep-alive timeout of a discovery controller whose host asked for
/// none (KATO 0), as Linux's nvmet gives it: such a host holds a connection
/// slot and names no namespace, so it must not hold it forever.
pub const DISCOVERY_KATO_MS: u32 = 120_000;

/// The fields of a Connect command the subsystem checks.
pub struct ConnectArgs {
    pub qid: u16,
    /// Queue entries, 0's based.
    pub sqsize: u16,
    pub cattr: u8,
    pub kato_ms: u32,
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
    /// The host identifier (Connect data bytes 0-15).
    pub hostid: [u8; 16],
    pub digests: Digests,
}

/// A controller: one host's association, its admin queue and I/O queues.
pub struct Controller {
    pub cntlid: u16,
    pub hostnqn: String,
    /// Who made it: its I/O queues must come from the same host identifier and address.
    hostid: [u8; 16],
    ip: Option<std::net::IpAddr>,
    pub discovery: bool,
    /// By NSID - 1: whether this host sees the namespace, and how.
    pub access: Vec<Option<Mode>>,
    state: Mutex<CtrlState>,
    /// Milliseconds since the subsystem's epoch when the host last sent a command.
    last_seen: AtomicU64,
}

struct CtrlState {
    cc: u32,
    csts: u32,
    io_queues: u16,
    kato_ms: u32,
    aers: u16,
    async_config: u32,
    /// Each connected queue's activity, by queue id (stopped on teardown).
    queues: HashMap<u16, Arc<Activity>>,
    /// A shutdown's flush is running; `flush_again`: the host asked for
    /// another shutdown meanwhile (its writes since then are flushed by a
    /// second round of the same task, not by a task each).
    flushing: bool,
    flush_again: bool,
}

/// CC and CSTS bits.
const CC_EN: u32 = 1;
const CC_SHN: u32 = 3 << 14;
const CSTS_RDY: u32 = 1;
const CSTS_CFS: u32 = 1 << 1;
const CSTS_SHST_DONE: u32 = 2 << 2;
const CSTS_SHST_BUSY: u32 = 1 << 2;

impl Subsystem {
    pub fn new(nqn: String, catalog: &Catalog, access: Arc<Access>) -> Subsystem {
        let id = |what: &str, name: &str| -> [u8; 32] {
            Sha256::new()
                .chain_update(b"fastsan nvme\0")
                .chain_update(what)
                .chain_update(b"\0")
                .chain_update(&nqn)
                .chain_update(b"\0")
                .chain_update(name)
                .finalize()
                .into()
        };
        let namespaces: Vec<Namespace> = catalog
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let h = id("namespace", v.name());
                let mut uuid: [u8; 16] = h[16..].try_into().expect("16 bytes");
                uuid[6] = (uuid[6] & 0x0f) | 0x80; // version 8: name-based, custom hash
                uuid[8] = (uuid[8] & 0x3f) | 0x80; // RFC 4122 variant
                Namespace {
                    nsid: i as u32 + 1,
                    volume: v.clone(),
                    lba_shift: v.granule().max(512).ilog2() as u8,
                    nguid: h[..16].try_into().expect("16 bytes"),
                    uuid,
                }
            })
            .collect();
        let largest = namespaces.iter().map(|n| n.volume.max_transfer()).min().unwrap_or(MAX_TRANSFER);
        let mdts = (largest.min(MAX_TRANSFER) / 4096).max(2).ilog2() as u8;
        let serial = id("serial", "").iter().take(10).map(|b| format!("{b:02x}")).collect();
        Subsystem {
            nqn,
            serial,
            volumes: namespaces.iter().map(|n| n.volume.clone()).collect(),
            namespaces,
            access,
            mdts,
            controllers: Mutex::new(HashMap::new()),
            departed: Mutex::new(Vec::new()),
            next_cntlid: Mutex::new(1),
        }
    }

    /// The default NQN: this host's name under fastsan's naming authority.
    pub fn default_nqn() -> String {
        let host = crate::server::host_name();
        format!("nqn.2026-11.io.fastsan:{}", if host.is_empty() { "target" } else { &host })
    }

    /// Milliseconds on CLOCK_MONOTONIC_COARSE (the kernel's tick, a few
    /// ms: a vDSO read, no system call): what a command stamps on its
    /// controller. Until 2026-12-07 commands stamped the reaper's last
    /// tick, so a reaper held up more than about a second could tear down
    /// a controller whose host had sent its keep-alive in time.
    fn now_ms(&self) -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes a timespec into the pointer; the clock id is valid on Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
    }

    /// Checks a Connect and makes (queue 0) or joins (queue N) a controller.
    pub fn connect(self: &Arc<Self>, a: ConnectArgs, who: &Who) -> Result<NvmeConn, ConnectRefusal> {
        // Which field was wrong, in the completion's DW0 (Connect response:
        // IATTR, bit 16, set when the field is in the Connect data; IPO, its
        // byte offset): hosts tell their users (Linux: "Connect Invalid Data
        // Parameter, subsysnqn ..."; fastsan's: "no NVMe subsystem ...").
        let invalid =
            |at: u32, why: String| ConnectRefusal { status: status::CONNECT_INVALID_PARAMETERS, at, why };
        let discovery = a.subnqn == DISCOVERY_NQN;
        if !discovery && a.subnqn != self.nqn {
            let why = format!("no subsystem {:?} here (this one is {:?})", a.subnqn, self.nqn);
            return Err(invalid(connect_field::SUBNQN, why));
        }
        if a.hostnqn.is_empty() {
            let why = "a Connect without a host NQN".into();
            return Err(ConnectRefusal { status: status::CONNECT_INVALID_HOST, at: 0, why });
        }
        if a.sqsize == 0 || a.sqsize >= QUEUE_ENTRIES {
            return Err(invalid(
                connect_field::SQSIZE,
                format!("queue size {} (1 to {} allowed)", a.sqsize as u32 + 1, QUEUE_ENTRIES),
            ));
        }
        let activity = Activity::new();
        let ctrl = if a.qid == 0 {
            let access: Vec<Option<Mode>> = if discovery {
                Vec::new()
            } else {
                self.namespaces
                    .iter()
                    .map(|n| self.access.mode_for(who, n.volume.name(), false).ok())
                    .collect()
            };
            // A host that may see no namespace has nothing to do here but
            // hold a connection slot: refused, as Linux's nvmet refuses a
            // host not allowed on the subsystem.
            if !discovery && access.iter().all(Option::is_none) {
                let why = format!("host {:?} has no grant for any namespace of {:?}", a.hostnqn, self.nqn);
                return Err(ConnectRefusal {
                    status: status::CONNECT_INVALID_HOST,
                    at: connect_field::HOSTNQN,
                    why,
                });
            }
            let kato_ms = if discovery && a.kato_ms == 0 { DISCOVERY_KATO_MS } else { a.kato_ms };
            let mut ctrls = self.controllers.lock();
            let cntlid = {
                let mut next = self.next_cntlid.lock();
                let mut id = *next;
                while ctrls.contains_key(&id) {
                    id = if id >= 0xffef { 1 } else { id + 1 };
                }
                *next = if id >= 0xffef { 1 } else { id + 1 };
                id
            };
            let ctrl = Arc::new(Controller {
                cntlid,
                hostnqn: a.hostnqn.clone(),
                hostid: a.hostid,
                ip: who.ip,
                discovery,
                access,
                state: Mutex::new(CtrlState {
                    cc: 0,
                    csts: 0,
                    io_queues: 0,
                    kato_ms,
                    aers: 0,
                    async_config: 0,
                    queues: HashMap::from([(0, activity.clone())]),
                    flushing: false,
                    flush_again: false,
                }),
                last_seen: AtomicU64::new(self.now_ms()),
            });
            ctrls.insert(cntlid, ctrl.clone());
            let visible = ctrl.access.iter().filter(|a| a.is_some()).count();
            info!(
                cntlid,
                hostnqn = a.hostnqn,
                kato_ms,
                namespaces = visible,
                "NVMe {} controller created",
                if discovery { "discovery" } else { "I/O" }
            );
            ctrl
        } else {
            let ctrls = self.controllers.lock();
            // The controller's own host only: another host cannot take its queue slots.
            let mine = |c: &&Arc<Controller>| {
                !c.discovery && c.hostnqn == a.hostnqn && c.hostid == a.hostid && c.ip == who.ip
            };
            let Some(ctrl) = ctrls.get(&a.cntlid).filter(mine) else {
                let why = format!("no controller {} for host {:?}", a.cntlid, a.hostnqn);
                return Err(invalid(connect_field::CNTLID, why));
            };
            let mut st = ctrl.state.lock();
            if st.csts & CSTS_RDY == 0 {
                return Err(invalid(
                    connect_field::CNTLID,
                    format!("controller {} is not enabled", a.cntlid),
                ));
            }
            if a.qid > st.io_queues {
                return Err(invalid(
                    connect_field::QID,
                    format!("queue {} of {} granted", a.qid, st.io_queues),
                ));
            }
            if st.queues.contains_key(&a.qid) {
                return Err(invalid(connect_field::QID, format!("queue {} is connected already", a.qid)));
            }
            st.queues.insert(a.qid, activity.clone());
            ctrl.clone()
        };
        Ok(NvmeConn {
            sub: self.clone(),
            ctrl,
            qid: a.qid,
            entries: a.sqsize + 1,
            digests: a.digests,
            head: Arc::new(AtomicU16::new(1)),
            sqflow_off: a.cattr & (1 << 2) != 0,
            activity,
            writes: HashMap::new(),
            waiting: VecDeque::new(),
            solicited: 0,
            ready: VecDeque::new(),
            farewell: None,
            via: who.via,
        })
    }

    /// A queue's connection ended: the admin queue takes its controller (and
    /// every I/O queue of it) along.
    fn disconnected(&self, ctrl: &Controller, qid: u16) {
        if qid == 0 {
            self.teardown(ctrl);
            return;
        }
        // Its device work may still run (its replies could not be written):
        // the host's next Connect waits for it. Under the controllers' lock
        // from its queues to `departed`, as `stopped_queues` looks: a Connect
        // checking in between found the queue in neither, and went ahead of
        // its writes. (The state lock is released before `departed` is
        // taken: teardown takes them the other way.)
        let _ctrls = self.controllers.lock();
        let gone = ctrl.state.lock().queues.remove(&qid);
        self.depart(ctrl.host(), gone);
    }

    fn teardown(&self, ctrl: &Controller) {
        let mut ctrls = self.controllers.lock();
        if ctrls.get(&ctrl.cntlid).is_some_and(|c| std::ptr::eq(&**c, ctrl)) {
            ctrls.remove(&ctrl.cntlid);
            info!(cntlid = ctrl.cntlid, hostnqn = ctrl.hostnqn, "NVMe controller deleted");
        }
        let queues: Vec<Arc<Activity>> = ctrl.state.lock().queues.values().cloned().collect();
        for a in &queues {
            a.stop();
        }
        self.depart(ctrl.host(), queues);
    }

    /// Keeps the stopped queues of `host` that still run device work, for
    /// [`NvmeConn::fence`]; forgets those that drained.
    fn depart(&self, host: Host, queues: impl IntoIterator<Item = Arc<Activity>>) {
        let mut departed = self.departed.lock();
        departed.retain(|(_, a)| !a.is_drained());
        departed.extend(queues.into_iter().filter(|a| !a.is_drained()).map(|a| (host.clone(), a)));
    }

    /// Tears down every controller whose host sent nothing for its
    /// keep-alive timeout; run every half second by [`Subsystem::reaper`].
    pub fn reap(&self) {
        let now = self.now_ms();
        let expired: Vec<Arc<Controller>> = self
            .controllers
            .lock()
            .values()
            .filter(|c| {
                // Whole seconds and one more, as Linux's target: a host that
                // sends its keep-alive every KATO (older kernels) is not cut off.
                let kato = c.state.lock().kato_ms as u64;
                kato > 0 && now.saturating_sub(c.last_seen.load(Relaxed)) > kato.div_ceil(1000) * 1000 + 1000
            })
            .cloned()
            .collect();
        for c in expired {
            let kato = c.state.lock().kato_ms;
            warn!(
                cntlid = c.cntlid,
                hostnqn = c.hostnqn,
                "NVMe host sent nothing for its keep-alive timeout ({kato} ms): controller torn down"
            );
            self.teardown(&c);
        }
    }

    /// Runs [`Subsystem::reap`] until `shutdown`.
    pub async fn reaper(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => self.reap(),
            }
        }
    }

    /// The queues of `host`'s controllers that stopped with device work
    /// still running.
    fn stopped_queues(&self, host: &Host) -> Vec<Arc<Activity>> {
        let ctrls = self.controllers.lock();
        let mine = ctrls.values().filter(|c| c.hostnqn == host.0 && c.hostid == host.1);
        let mut v: Vec<Arc<Activity>> = mine
            .flat_map(|c| {
                let st = c.state.lock();
                st.queues.values().filter(|a| a.is_stopped() && !a.is_drained()).cloned().collect::<Vec<_>>()
            })
            .collect();
        let departed = self.departed.lock();
        v.extend(departed.iter().filter(|(h, a)| h == host && !a.is_drained()).map(|(_, a)| a.clone()));
        v
    }

    /// How many controllers are live.
    pub fn controllers(&self) -> usize {
        self.controllers.lock().len()
    }
}

impl Controller {
    /// The namespace `nsid` if this host sees it, and whether it may write.
    pub fn namespace(&self, nsid: u32) -> Option<Mode> {
        let i = usize::try_from(nsid).ok()?.checked_sub(1)?;
        *self.access.get(i)?
    }

    /// The host it serves, as fences know it: its NQN and host identifier
    /// (both unauthenticated; the NQN alone is shared by cloned images, and
    /// one host's stopped queues held another's reconnects).
    fn host(&self) -> Host {
        (self.hostnqn.clone(), self.hostid)
    }

    /// Stamps the controller as heard from at `now` (a coarse clock's ms):
    /// a plain load for every command but the first of each millisecond.
    fn touch(&self, now: u64) {
        if self.last_seen.load(Relaxed) < now {
            self.last_seen.fetch_max(now, Relaxed);
        }
    }
}

/// A C2HTermReq: the target closes the connection, for this reason.
pub fn term_req(fes: u16, fei: u32) -> Vec<u8> {
    let mut out = Vec::new();
    pdu::encode(&Header::C2hTermReq(TermReq { fes, fei }), 0, &[], Digests::default(), 0, &mut out);
    out
}

/// A write (or a Dataset Management range list) whose data comes by R2T.
struct Solicited {
    cid: u16,
    nsid: u32,
    /// The byte offset and FUA of a write; `None`: Dataset Management.
    write: Option<(u64, bool)>,
    length: u32,
    /// The data so far when it comes in several H2CData PDUs: copied here,
    /// not kept as slices of the reads that brought it (each slice would
    /// hold its whole receive buffer, 256 KiB, for as long as the write
    /// waits for the rest: a host sending a byte per PDU of many writes
    /// pinned megabytes per queue). Empty while a single PDU brings it all.
    parts: BytesMut,
    received: u32,
    digest_ok: bool,
    /// The R2T went out (else it waits in [`NvmeConn::waiting`]).
    asked: bool,
}

/// One queue (one TCP connection) in its transmission phase.
pub struct NvmeConn {
    sub: Arc<Subsystem>,
    ctrl: Arc<Controller>,
    qid: u16,
    /// Queue entries (SQSIZE + 1).
    entries: u16,
    digests: Digests,
    /// The submission queue head after the last command taken, shared with the encoder.
    head: Arc<AtomicU16>,
    /// The host disabled SQ flow control: a read's data may say SUCCESS and
    /// carry no completion, and completions report no head (SQHD 0).
    sqflow_off: bool,
    activity: Arc<Activity>,
    /// Writes waiting for their data, by transfer tag.
    writes: HashMap<u16, Solicited>,
    /// Transfer tags whose R2T waits for room in [`R2T_BYTES`].
    waiting: VecDeque<u16>,
    /// Bytes asked for by R2T and not yet arrived.
    solicited: u64,
    /// Decoded items not yet handed to the driver.
    ready: VecDeque<Decoded<NvmeMeta>>,
    farewell: Option<Vec<u8>>,
    /// The address the host connected to.
    via: Option<SocketAddr>,
}

impl Drop for NvmeConn {
    fn drop(&mut self) {
        self.sub.disconnected(&self.ctrl, self.qid);
    }
}

impl std::fmt::Debug for NvmeConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeConn").field("cntlid", &self.ctrl.cntlid).field("qid", &self.qid).finish()
    }
}

/// What the encoder needs to answer a command.
pub struct NvmeMeta {
    cid: u16,
    answer: Answer,
}

enum Answer {
    /// A request on a namespace: its status from the outcome.
    Io { write: bool },
    /// Answered here: the status and result are known; data, if any, in the outcome.
    Admin { status: Status, dw0: u32, dw1: u32 },
    /// Not a completion: the R2T that asks for a write's data.
    R2t(R2t),
}

/// An NVMe protocol error from the host: the connection closes.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Violation(String);

impl NvmeConn {
    fn fail(&mut self, fes: u16, fei: u32, why: String) -> WireError {
        self.farewell = Some(term_req(fes, fei));
        Box::new(Violation(why))
    }

    /// Bytes that are no PDU: a C2HTermReq with the error's status, then close.
    fn refuse(&mut self, e: fastsan_nvme::ProtocolError) -> WireError {
        let (fes, fei) = e.fes();
        self.farewell = Some(term_req(fes, fei));
        Box::new(e)
    }

    /// Takes one command off the submission queue (its completions report
    /// the head as it is when they are sent). A host that disabled SQ flow
    /// control does not read the head: nothing is tracked (as Linux's nvmet
    /// does), so the reader stores nothing the writer's thread must fetch.
    fn take(&mut self) {
        if self.sqflow_off {
            return;
        }
        let next = (self.head.load(Relaxed) + 1) % self.entries;
        self.head.store(next, Relaxed);
    }

    fn local(&self, cid: u16, st: (u8, u8), dnr: bool) -> Decoded<NvmeMeta> {
        let status = Status { sct: st.0, sc: st.1, dnr };
        let meta = NvmeMeta { cid, answer: Answer::Admin { status, dw0: 0, dw1: 0 } };
        Decoded::Local { tag: cid as u64, meta, result: Ok(Outcome::Done) }
    }

    fn done(&self, cid: u16, dw0: u32, dw1: u32, data: Option<Vec<u8>>) -> Decoded<NvmeMeta> {
        let meta = NvmeMeta { cid, answer: Answer::Admin { status: Status::SUCCESS, dw0, dw1 } };
        let result = Ok(data.map_or(Outcome::Done, |d| Outcome::Data(Bytes::from(d).into())));
        Decoded::Local { tag: cid as u64, meta, result }
    }

    fn invalid(&self, cid: u16) -> Decoded<NvmeMeta> {
        self.local(cid, status::INVALID_FIELD, true)
    }

    /// An admin command: answered here, or held (an asynchronous event request).
    fn admin(&mut self, sqe: &Sqe) -> Option<Decoded<NvmeMeta>> {
        self.take();
        let cid = sqe.cid;
        if sqe.flags & 0x3 != 0 {
            return Some(self.invalid(cid));
        }
        // Commands that return data name its length in a transport SGL.
        let out_len = || {
            let d = sqe.sgl();
            (d.id == sgl::TRANSPORT_DATA_BLOCK).then_some(d.length as usize)
        };
        let ctrl = self.ctrl.clone();
        Some(match (sqe.opcode, sqe.fctype()) {
            (OPC_FABRICS, Some(fctype::PROPERTY_GET)) => {
                let st = ctrl.state.lock();
                let v = match sqe.cdw11 {
                    0x00 => admin::cap(),
                    0x08 => admin::VERSION as u64,
                    0x14 => st.cc as u64,
                    0x1c => st.csts as u64,
                    _ => return Some(self.invalid(cid)),
                };
                self.done(cid, v as u32, (v >> 32) as u32, None)
            }
            (OPC_FABRICS, Some(fctype::PROPERTY_SET)) => match sqe.cdw11 {
                0x14 => {
                    self.set_cc(sqe.cdw12);
                    self.done(cid, 0, 0, None)
                }
                // NSSR (0x20) among them: CAP.NSSRS is 0, so a subsystem
                // reset is not a property here (as Linux's nvmet answers).
                _ => self.invalid(cid),
            },
            (OPC_FABRICS, Some(fctype::CONNECT)) => self.local(cid, status::COMMAND_SEQUENCE_ERROR, true),
            (OPC_FABRICS, _) => self.local(cid, status::INVALID_OPCODE, true),
            // Identify
            (0x06, _) => {
                let Some(len) = out_len() else { return Some(self.invalid(cid)) };
                let (cns, csi) = (sqe.cdw10 & 0xff, sqe.cdw11 >> 24);
                let ns = || {
                    self.ctrl.namespace(sqe.nsid).map(|m| (&self.sub.namespaces[sqe.nsid as usize - 1], m))
                };
                let mut page = match (cns, csi) {
                    (0x01, _) => admin::identify_controller(&self.sub, &ctrl),
                    (0x00, _) => match ns() {
                        Some((n, mode)) => {
                            admin::identify_namespace(n, mode == Mode::ReadOnly || n.volume.read_only())
                        }
                        // Inactive but valid NSIDs read as zeros.
                        None if !ctrl.discovery
                            && sqe.nsid >= 1
                            && sqe.nsid as usize <= self.sub.namespaces.len() =>
                        {
                            vec![0; admin::PAGE]
                        }
                        None => return Some(self.local(cid, status::INVALID_NAMESPACE, true)),
                    },
                    (0x02, _) if !ctrl.discovery => admin::active_namespaces(&ctrl, sqe.nsid),
                    (0x03, _) => match ns() {
                        Some((n, _)) => admin::namespace_descriptors(n),
                        None => return Some(self.local(cid, status::INVALID_NAMESPACE, true)),
                    },
                    (0x05, 0) if ns().is_some() => vec![0; admin::PAGE],
                    (0x06, 0) if !ctrl.discovery => admin::identify_controller_nvm(),
                    _ => return Some(self.invalid(cid)),
                };
                page.truncate(len);
                self.done(cid, 0, 0, Some(page))
            }
            // Get Log Page
            (0x02, _) => {
                let lid = sqe.cdw10 & 0xff;
                let dwords = ((sqe.cdw11 & 0xffff) << 16 | sqe.cdw10 >> 16) as usize + 1;
                let offset = sqe.cdw12 as u64 | (sqe.cdw13 as u64) << 32;
                match out_len() {
                    Some(len) if len == dwords * 4 && len <= MAX_TRANSFER as usize => {}
                    _ => return Some(self.invalid(cid)),
                }
                let visible: Vec<&Namespace> =
                    self.sub.namespaces.iter().filter(|n| ctrl.namespace(n.nsid).is_some()).collect();
                let page = match lid {
                    0x01 => vec![0; 64],
                    0x02 => admin::smart_log(&visible),
                    0x03 => vec![0; 512],
                    0x04 => vec![0; admin::PAGE],
                    0x70 if ctrl.discovery => admin::discovery_log(&self.sub, self.via()),
                    _ => return Some(self.local(cid, status::INVALID_LOG_PAGE, true)),
                };
                // Past the page: zeros, but no more than a page's worth of them.
                if dwords * 4 > page.len().max(admin::PAGE) {
                    return Some(self.invalid(cid));
                }
                match admin::slice_of(&page, offset, dwords * 4) {
                    Some(p) => self.done(cid, 0, 0, Some(p)),
                    None => self.invalid(cid),
                }
            }
            // Set Features, Get Features
            (0x09 | 0x0a, _) => {
                let set = sqe.opcode == 0x09;
                let fid = sqe.cdw10 & 0xff;
                let mut st = ctrl.state.lock();
                let dw0 = match (fid, set) {
                    (0x07, true) => {
                        let (nsq, ncq) = (sqe.cdw11 & 0xffff, sqe.cdw11 >> 16);
                        if nsq == 0xffff || ncq == 0xffff || ctrl.discovery {
                            drop(st);
                            return Some(self.invalid(cid));
                        }
                        // Once an I/O queue is connected its count is fixed
                        // (a queue past a smaller count would live on).
                        if st.queues.iter().any(|(q, a)| *q != 0 && !a.is_stopped()) {
                            drop(st);
                            return Some(self.local(cid, status::COMMAND_SEQUENCE_ERROR, true));
                        }
                        st.io_queues = (nsq.min(ncq) + 1).min(MAX_IO_QUEUES as u32) as u16;
                        let n = st.io_queues as u32 - 1;
                        n | n << 16
                    }
                    (0x07, false) => {
                        let n = (st.io_queues.max(1) - 1) as u32;
                        n | n << 16
                    }
                    // Volatile write cache: always on (FLUSH makes writes durable);
                    // it cannot be turned off (the host would stop flushing).
                    (0x06, false) => 1,
                    (0x06, true) => {
                        drop(st);
                        return Some(self.local(cid, (status::COMMAND_SPECIFIC, 0x0e), true));
                    }
                    (0x0b, true) => {
                        st.async_config = sqe.cdw11;
                        sqe.cdw11
                    }
                    (0x0b, false) => st.async_config,
                    (0x0f, true) => {
                        st.kato_ms = sqe.cdw11;
                        sqe.cdw11
                    }
                    (0x0f, false) => st.kato_ms,
                    _ => {
                        drop(st);
                        return Some(self.invalid(cid));
                    }
                };
                drop(st);
                self.done(cid, dw0, 0, None)
            }
            // Keep Alive: every command restarts the timer (decode touched it).
            (0x18, _) => self.done(cid, 0, 0, None),
            // Asynchronous Event Request: held; this target raises no events yet.
            (0x0c, _) => {
                let mut st = ctrl.state.lock();
                if st.aers >= admin::AER_LIMIT {
                    drop(st);
                    return Some(self.local(cid, (status::COMMAND_SPECIFIC, 0x05), true));
                }
                st.aers += 1;
                return None;
            }
            // Abort: commands run to completion here; "not aborted".
            (0x08, _) => self.done(cid, 1, 0, None),
            _ => self.local(cid, status::INVALID_OPCODE, true),
        })
    }

    /// The address the host reached this target at, for the discovery log.
    fn via(&self) -> Option<SocketAddr> {
        self.via
    }

    /// A write of the controller configuration: enable, reset, shutdown.
    fn set_cc(&mut self, cc: u32) {
        let mut st = self.ctrl.state.lock();
        let was = st.cc;
        st.cc = cc;
        if cc & CC_EN != 0 && was & CC_EN == 0 {
            // The host's queue entry sizes (IOSQES 6, IOCQES 4) and 4 KiB pages.
            let sizes_ok = (cc >> 16) & 0xf == 6 && (cc >> 20) & 0xf == 4 || self.ctrl.discovery;
            let ok = sizes_ok && (cc >> 7) & 0xf == 0 && (cc >> 4) & 0x7 == 0 && (cc >> 11) & 0x7 == 0;
            st.csts = if ok { CSTS_RDY } else { CSTS_CFS };
        } else if cc & CC_EN == 0 && was & CC_EN != 0 {
            // A reset: the I/O queues go, the admin queue stays.
            for (qid, a) in &st.queues {
                if *qid != 0 {
                    a.stop();
                }
            }
            st.csts = 0;
            st.aers = 0;
        }
        if cc & CC_SHN != 0 && was & CC_SHN == 0 {
            // Shutdown: flush every namespace this host sees, then report it
            // done. One flush task per controller at most: a host toggling
            // CC.SHN started one blocking thread per toggle (hundreds of
            // threads, each in an fsync of a volume other hosts share).
            st.csts = (st.csts & !(3 << 2)) | CSTS_SHST_BUSY;
            if st.flushing {
                st.flush_again = true;
                return;
            }
            st.flushing = true;
            let ctrl = self.ctrl.clone();
            let sub = self.sub.clone();
            tokio::task::spawn_blocking(move || {
                // A flush that panics must not leave the controller "flushing"
                // for good (every later shutdown would stay busy).
                struct Ends(Arc<Controller>);
                impl Drop for Ends {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            let mut st = self.0.state.lock();
                            st.flushing = false;
                            st.flush_again = false;
                        }
                    }
                }
                let _ends = Ends(ctrl.clone());
                let mut failed = false;
                loop {
                    for n in sub.namespaces.iter().filter(|n| ctrl.namespace(n.nsid).is_some()) {
                        if let Err(e) = n.volume.flush() {
                            warn!(volume = n.volume.name(), "flush at the host's shutdown failed: {e}");
                            failed = true;
                        }
                    }
                    let mut st = ctrl.state.lock();
                    if std::mem::take(&mut st.flush_again) {
                        continue;
                    }
                    st.flushing = false;
                    if st.cc & CC_SHN != 0 {
                        st.csts = (st.csts & !(3 << 2)) | CSTS_SHST_DONE;
                        // Writes may be lost: the controller reports a fatal status, not a clean shutdown.
                        if failed {
                            st.csts |= CSTS_CFS;
                        }
                    }
                    return;
                }
            });
        } else if cc & CC_SHN == 0 {
            st.csts &= !(3 << 2);
        }
    }

    /// An I/O command: a request on its namespace's volume, or its R2T.
    fn io(
        &mut self,
        sqe: &Sqe,
        data: Bytes,
        digest_ok: bool,
    ) -> Result<Option<Decoded<NvmeMeta>>, WireError> {
        self.take();
        let cid = sqe.cid;
        // Fused operations are not supported (FUSES 0): never run half of one.
        if sqe.flags & 0x3 != 0 {
            return Ok(Some(self.invalid(cid)));
        }
        if sqe.opcode == OPC_FABRICS {
            let st = if sqe.fctype() == Some(fctype::CONNECT) {
                status::COMMAND_SEQUENCE_ERROR
            } else {
                status::INVALID_OPCODE
            };
            return Ok(Some(self.local(cid, st, true)));
        }
        let Some(mode) = self.ctrl.namespace(sqe.nsid) else {
            return Ok(Some(self.local(cid, status::INVALID_NAMESPACE, true)));
        };
        let sub = &*self.sub;
        let ns = &sub.namespaces[sqe.nsid as usize - 1];
        let volume = &ns.volume;
        let shift = ns.lba_shift;
        let read_only = mode == Mode::ReadOnly;
        // SLBA and NLB (0's based) in bytes; past the end is the volume's refusal.
        let range = || lba_range(sqe, shift);
        let fua = sqe.cdw12 & (1 << 30) != 0;
        let d = sqe.sgl();
        let on = |kind: IoKind, offset: u64, length: u64, fua: bool, payload: Bytes, write: bool| {
            let req = if write && read_only {
                Err(Refusal::ReadOnly)
            } else {
                Ok(IoRequest { kind, offset, length, fua, payload })
            };
            // A failed flush is a write fault too: writes it covered may be lost.
            let meta = NvmeMeta { cid, answer: Answer::Io { write: write || kind == IoKind::Flush } };
            Decoded::Request { volume: sqe.nsid - 1, tag: cid as u64, meta, req }
        };
        // Data in the capsule of a command that takes none (a read, a flush,
        // write zeroes): refused, as Linux's nvmet does, not dropped unseen.
        if !data.is_empty() && !matches!(sqe.opcode, 0x01 | 0x09) {
            return Ok(Some(self.invalid(cid)));
        }
        Ok(Some(match sqe.opcode {
            // Flush: nothing to do on a volume with nothing volatile.
            0x00 if !volume.caps().flush => self.done(cid, 0, 0, None),
            0x00 => on(IoKind::Flush, 0, 0, false, Bytes::new(), false),
            0x02 => {
                let (offset, length) = range();
                if d.id != sgl::TRANSPORT_DATA_BLOCK {
                    return Ok(Some(self.local(cid, status::SGL_INVALID_TYPE, true)));
                }
                if d.length as u64 != length {
                    return Ok(Some(self.local(cid, status::SGL_INVALID_DATA_LENGTH, true)));
                }
                on(IoKind::Read, offset, length, false, Bytes::new(), false)
            }
            0x01 | 0x09 => {
                let dsm = sqe.opcode == 0x09;
                // Dataset Management's data is its ranges, 16 bytes each; Linux
                // always sends room for 256 (4 KiB), whatever NR says.
                let ranges = ((sqe.cdw10 & 0xff) as u64 + 1) * 16;
                let (offset, length) = match dsm {
                    true if (ranges..=4096).contains(&(d.length as u64)) => (0, d.length as u64),
                    true => (0, ranges),
                    false => range(),
                };
                if dsm && sqe.cdw11 & (1 << 2) == 0 {
                    // Access hints only (no Deallocate): nothing to change.
                    return Ok(Some(self.done(cid, 0, 0, None)));
                }
                if dsm && sqe.cdw10 & 0xff != 0 {
                    // One range per command (DMRL 1 in the NVM Identify page).
                    return Ok(Some(self.invalid(cid)));
                }
                if d.length as u64 != length || length > 4096u64 << self.sub.mdts {
                    return Ok(Some(self.local(cid, status::SGL_INVALID_DATA_LENGTH, true)));
                }
                let write = (!dsm).then_some((offset, fua));
                match d.id {
                    // In-capsule data: at offset 0 (where the PDU's data
                    // starts), as long as the descriptor says.
                    sgl::DATA_BLOCK_OFFSET if d.addr != 0 => {
                        self.local(cid, status::SGL_INVALID_OFFSET, true)
                    }
                    sgl::DATA_BLOCK_OFFSET if data.len() as u64 != length => {
                        self.local(cid, status::SGL_INVALID_DATA_LENGTH, true)
                    }
                    sgl::DATA_BLOCK_OFFSET => {
                        if !digest_ok {
                            return Ok(Some(self.local(cid, status::TRANSIENT_TRANSPORT_ERROR, false)));
                        }
                        self.written(cid, sqe.nsid, write, data)
                    }
                    // Data to be solicited (R2T) comes after, not in the capsule.
                    sgl::TRANSPORT_DATA_BLOCK if !data.is_empty() => self.invalid(cid),
                    sgl::TRANSPORT_DATA_BLOCK => {
                        return self.solicit(Solicited {
                            cid,
                            nsid: sqe.nsid,
                            write,
                            length: length as u32,
                            parts: BytesMut::new(),
                            received: 0,
                            digest_ok: true,
                            asked: false,
                        })
                    }
                    _ => self.local(cid, status::SGL_INVALID_TYPE, true),
                }
            }
            0x08 => {
                let (offset, length) = range();
                let deallocate = sqe.cdw12 & (1 << 25) != 0;
                let kind = IoKind::WriteZeroes { no_hole: !deallocate, fast_only: false };
                on(kind, offset, length, fua, Bytes::new(), true)
            }
            _ => self.local(cid, status::INVALID_OPCODE, true),
        }))
    }

    /// A write's (or a deallocate's) data is all here: its request.
    /// Always inlined: its result is built where the decoder returns it,
    /// not copied out of a callee's frame (a store-forwarding stall per write).
    #[inline(always)]
    fn written(&self, cid: u16, nsid: u32, write: Option<(u64, bool)>, data: Bytes) -> Decoded<NvmeMeta> {
        let Some(mode) = self.ctrl.namespace(nsid) else {
            return self.local(cid, status::INVALID_NAMESPACE, true);
        };
        let ns = &self.sub.namespaces[nsid as usize - 1];
        let (volume, shift) = (&ns.volume, ns.lba_shift);
        let meta = NvmeMeta { cid, answer: Answer::Io { write: true } };
        let req = if mode == Mode::ReadOnly {
            Err(Refusal::ReadOnly)
        } else if let Some((offset, fua)) = write {
            Ok(IoRequest { kind: IoKind::Write, offset, length: data.len() as u64, fua, payload: data })
        } else {
            // Dataset Management, one range: context attributes, blocks (1's based), start.
            let blocks = u32::from_le_bytes(data[4..8].try_into().expect("4 bytes")) as u64;
            let slba = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
            // Deallocation is a hint: on a volume that cannot trim, or of nothing, it does nothing.
            if blocks == 0 || !volume.caps().trim {
                return self.done(cid, 0, 0, None);
            }
            let offset = slba.saturating_mul(1 << shift);
            Ok(IoRequest {
                kind: IoKind::Trim,
                offset,
                length: blocks << shift,
                fua: false,
                payload: Bytes::new(),
            })
        };
        Decoded::Request { volume: nsid - 1, tag: cid as u64, meta, req }
    }

    /// Registers a write whose data comes by R2T; asks for it when the
    /// bytes already asked for leave room.
    fn solicit(&mut self, w: Solicited) -> Result<Option<Decoded<NvmeMeta>>, WireError> {
        // Transfer tags are the command's slot; a host never has more commands
        // outstanding than its queue has entries.
        if self.writes.len() >= self.entries as usize {
            return Err(self.fail(
                fes::PDU_SEQUENCE_ERROR,
                0,
                "more writes outstanding than the queue has entries".into(),
            ));
        }
        let ttag = (0..self.entries).find(|t| !self.writes.contains_key(t)).expect("a free tag");
        self.writes.insert(ttag, w);
        self.waiting.push_back(ttag);
        self.ask();
        // Its R2T, unless it waits for room: then decoding goes on.
        Ok(self.ready.pop_front())
    }

    /// Sends the R2Ts waiting, while the data asked for stays within [`R2T_BYTES`].
    fn ask(&mut self) {
        while let Some(&ttag) = self.waiting.front() {
            let w = self.writes.get_mut(&ttag).expect("waiting writes are registered");
            if self.solicited > 0 && self.solicited + w.length as u64 > R2T_BYTES {
                return;
            }
            self.waiting.pop_front();
            w.asked = true;
            self.solicited += w.length as u64;
            let r2t = R2t { cccid: w.cid, ttag, r2to: 0, r2tl: w.length };
            let meta = NvmeMeta { cid: w.cid, answer: Answer::R2t(r2t) };
            self.ready.push_back(Decoded::Local { tag: w.cid as u64, meta, result: Ok(Outcome::Done) });
        }
    }

    /// Write data for an R2T.
    fn h2c(&mut self, h: DataHeader, flags: u8, data: Bytes, digest_ok: bool) -> Result<(), WireError> {
        let Some(w) = self.writes.get_mut(&h.ttag).filter(|w| w.asked && w.cid == h.cccid) else {
            let why =
                format!("H2CData for transfer tag {} (command {}) that no R2T asked for", h.ttag, h.cccid);
            return Err(self.fail(fes::INVALID_HEADER_FIELD, 10, why));
        };
        if h.datao != w.received || h.datal > w.length - w.received {
            let why = format!(
                "H2CData at {}+{} where {} of {} bytes arrived",
                h.datao, h.datal, w.received, w.length
            );
            return Err(self.fail(fes::DATA_OUT_OF_RANGE, 12, why));
        }
        if h.datal == 0 {
            return Err(self.fail(fes::INVALID_HEADER_FIELD, 16, "an empty H2CData".into()));
        }
        // LAST_PDU marks the R2T's last PDU and no other: a host that says
        // it is done with data missing would leave its write waiting forever.
        let last = w.received + h.datal == w.length;
        if (flags & flag::LAST_PDU != 0) != last {
            let why = format!(
                "H2CData at {}+{} of {} bytes {} LAST_PDU",
                h.datao,
                h.datal,
                w.length,
                if last { "without" } else { "with" }
            );
            return Err(self.fail(fes::INVALID_HEADER_FIELD, 1, why));
        }
        w.received += h.datal;
        w.digest_ok &= digest_ok;
        if w.received < w.length {
            if w.parts.is_empty() {
                w.parts.reserve(w.length as usize);
            }
            w.parts.extend_from_slice(&data);
            return Ok(());
        }
        let w = self.writes.remove(&h.ttag).expect("present");
        self.solicited -= w.length as u64;
        let item = if !w.digest_ok {
            self.local(w.cid, status::TRANSIENT_TRANSPORT_ERROR, false)
        } else {
            let data = if w.parts.is_empty() {
                data
            } else {
                let mut b = w.parts;
                b.extend_from_slice(&data);
                b.freeze()
            };
            self.written(w.cid, w.nsid, w.write, data)
        };
        self.ready.push_back(item);
        self.ask();
        Ok(())
    }
}

impl Transmission for NvmeConn {
    type Encoder = NvmeEncoder;

    fn volumes(&self) -> &[Arc<Volume>] {
        &self.sub.volumes
    }

    fn limits(&self) -> Limits {
        Limits { align: 1, max_io: 4096 << self.sub.mdts, read_only: false }
    }

    fn encoder(&self) -> NvmeEncoder {
        NvmeEncoder {
            digests: self.digests,
            sqid: self.qid,
            sqflow_off: self.sqflow_off,
            head: self.head.clone(),
        }
    }

    fn describe(&self) -> String {
        let d = self.digests;
        format!(
            "controller {} ({}), queue {} of {} entries, header digest {}, data digest {}",
            self.ctrl.cntlid, self.ctrl.hostnqn, self.qid, self.entries, d.header, d.data
        )
    }

    fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// NVMe/TCP has no fence of its own: a host that lost a connection
    /// reconnects and sends its writes again, and a write of the lost queue
    /// still waiting for the device would then land after the newer one. So
    /// a Connect from a host is answered once every queue of that host that
    /// has stopped (its connection ended, or its controller was torn down)
    /// has drained: what the host resends can no longer be overtaken.
    fn fence(&mut self) -> Option<crate::sessions::Fence> {
        let stopped = self.sub.stopped_queues(&self.ctrl.host());
        if stopped.is_empty() {
            return None;
        }
        info!(
            hostnqn = self.ctrl.hostnqn,
            queues = stopped.len(),
            "NVMe Connect waits for the host's lost queues to drain"
        );
        let (sub, ctrl) = (self.sub.clone(), self.ctrl.clone());
        Some(Box::pin(async move {
            let drained = async {
                for a in stopped {
                    a.drained().await;
                }
            };
            tokio::pin!(drained);
            // The host waits for this answer: its controller is not silent
            // meanwhile. (The reaper tore down a new controller whose Connect
            // waited longer than its keep-alive timeout, and the Connect
            // failed: a host could not reconnect while old writes drained.)
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = &mut drained => break,
                    _ = tick.tick() => ctrl.touch(sub.now_ms()),
                }
            }
            ctrl.touch(sub.now_ms());
        }))
    }

    fn farewell(&mut self) -> Option<Vec<u8>> {
        self.farewell.take()
    }

    fn arriving(&self, buf: &BytesMut) -> Option<Arriving> {
        let (nsid, range) = match *buf.first()? {
            // A Write with its data in the capsule (its entry follows the
            // 8-byte common header).
            pdu::kind::CAPSULE_CMD => {
                let sqe = Sqe::decode(buf.get(pdu::CH_LEN..)?.first_chunk()?);
                let ns = self.sub.namespaces.get((sqe.nsid as usize).checked_sub(1)?)?;
                (sqe.opcode == 0x01).then_some((sqe.nsid, Some(lba_range(&sqe, ns.lba_shift))))?
            }
            // Data for a write an R2T asked for (by transfer tag).
            pdu::kind::H2C_DATA => {
                let ttag = u16::from_le_bytes(buf.get(10..12)?.try_into().ok()?);
                (self.writes.get(&ttag)?.nsid, None)
            }
            _ => return None,
        };
        // Only where this host may write (else the write is refused).
        let volume = nsid.checked_sub(1)?;
        (self.ctrl.namespace(nsid)? == Mode::ReadWrite).then_some(Arriving { volume, range })
    }

    fn mid_frame(&self, buf: &BytesMut) -> bool {
        !buf.is_empty() || self.writes.values().any(|w| w.asked)
    }

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded<NvmeMeta>, WireError> {
        loop {
            if let Some(d) = self.ready.pop_front() {
                return Ok(d);
            }
            let max_data = if self.qid == 0 { ADMIN_IN_CAPSULE } else { MAX_H2C_DATA.max(IN_CAPSULE) };
            let f = match pdu::frame(buf, self.digests, max_data) {
                Ok(Some(f)) => f,
                Ok(None) => {
                    let need =
                        buf.get(4..8).map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4")) as usize);
                    return Ok(Decoded::Incomplete { need });
                }
                Err(e) => return Err(self.refuse(e)),
            };
            self.ctrl.touch(self.sub.now_ms());
            // The hot path: a command, its entry read in place (no Header
            // built). One without data (a read, a flush) is consumed where it
            // lies: no frame split off the buffer and shared (two atomic
            // reference counts per command, one of NBD's costs NVMe/TCP did not
            // have to pay: docs/benchmarks.md, the run of 20261128-005815).
            if let Some(sqe) = f.sqe(&buf[..f.len]) {
                let data = match f.data.is_empty() {
                    true => {
                        buf.advance(f.len);
                        Bytes::new()
                    }
                    // Cut to the data in place: no second reference to drop.
                    false => {
                        let mut frame = buf.split_to(f.len);
                        frame.truncate(f.data.end);
                        frame.advance(f.data.start);
                        frame.freeze()
                    }
                };
                let d = if self.qid == 0 { self.admin(&sqe) } else { self.io(&sqe, data, f.data_digest_ok)? };
                match d {
                    Some(d) => return Ok(d),
                    None => continue,
                }
            }
            let frame = buf.split_to(f.len).freeze();
            let data = frame.slice(f.data.clone());
            let header = match f.header(&frame) {
                Ok(h) => h,
                Err(e) => return Err(self.refuse(e)),
            };
            match header {
                Header::H2cData(h) => self.h2c(h, f.flags, data, f.data_digest_ok)?,
                Header::H2cTermReq(t) => {
                    info!(
                        cntlid = self.ctrl.cntlid,
                        qid = self.qid,
                        "the host ended the queue (H2CTermReq, status {:#x})",
                        t.fes
                    );
                    return Ok(Decoded::Disconnect);
                }
                h => {
                    let why = format!("{} from a host", h.name());
                    return Err(self.fail(fes::PDU_SEQUENCE_ERROR, 0, why));
                }
            }
        }
    }
}

/// The one mapping from a refusal to an NVMe status; `write`: the command
/// changes the namespace.
pub fn status_for(r: &Refusal, write: bool) -> Status {
    let (st, dnr) = match r {
        Refusal::OutOfRange { .. } => (status::LBA_OUT_OF_RANGE, true),
        Refusal::ReadOnly | Refusal::Device(BackendError::ReadOnly) => (status::ACCESS_DENIED, true),
        Refusal::Device(BackendError::NoSpace) => ((status::GENERIC, 0x81), true),
        // (A store's EOPNOTSUPP on what the namespace offers is a device
        // failure, below: a TRIM a store cannot do comes as Unsupported.)
        Refusal::Unsupported(_) | Refusal::NotFast => (status::INVALID_OPCODE, true),
        Refusal::Device(_) if write => (status::WRITE_FAULT, true),
        Refusal::Device(_) => (status::UNRECOVERED_READ_ERROR, true),
        Refusal::DigestMismatch => (status::TRANSIENT_TRANSPORT_ERROR, false),
        // Not ready: the host retries (after the target is back, on another path).
        Refusal::ShuttingDown => (status::NAMESPACE_NOT_READY, false),
        Refusal::UnknownCommand(_) => (status::INVALID_OPCODE, true),
        Refusal::Invalid(_) | Refusal::Misaligned { .. } | Refusal::TooLarge { .. } => {
            (status::INVALID_FIELD, true)
        }
    };
    Status { sct: st.0, sc: st.1, dnr }
}

/// NVMe/TCP replies: a read's data as one C2HData PDU (never padded: the
/// Linux host ignores the data offset) followed by its CapsuleResp, or, when
/// the host disabled SQ flow control, the C2HData alone marked SUCCESS.
pub struct NvmeEncoder {
    digests: Digests,
    sqid: u16,
    sqflow_off: bool,
    head: Arc<AtomicU16>,
}

impl Encoder for NvmeEncoder {
    type Meta = NvmeMeta;

    fn encode(&mut self, r: &Reply<NvmeMeta>, scratch: &mut Vec<u8>) -> Encoded {
        let start = scratch.len();
        let m = &r.meta;
        let (status, dw0, dw1) = match (&m.answer, &r.result) {
            (Answer::R2t(t), _) => {
                pdu::encode_head(&Header::R2t(*t), 0, 0, self.digests, 0, scratch);
                let end = scratch.len();
                return Encoded { head: start..end, data: None, tail: end..end };
            }
            (Answer::Admin { status, dw0, dw1 }, _) => (*status, *dw0, *dw1),
            (Answer::Io { .. }, Ok(_)) => (Status::SUCCESS, 0, 0),
            (Answer::Io { write }, Err(e)) => (status_for(e, *write), 0, 0),
        };
        let data = match &r.result {
            Ok(Outcome::Data(d)) if status.is_success() && !d.is_empty() => Some(d.clone()),
            _ => None,
        };
        let mut head_end = start;
        let mut resp = true;
        if let Some(d) = &data {
            let success = self.sqflow_off && dw0 == 0 && dw1 == 0;
            let flags = flag::LAST_PDU | if success { flag::SUCCESS } else { 0 };
            let h = Header::C2hData(DataHeader { cccid: m.cid, ttag: 0, datao: 0, datal: d.len() as u32 });
            pdu::encode_head(&h, flags, d.len(), self.digests, 0, scratch);
            head_end = scratch.len();
            if let Some(dd) = pdu::data_digest_parts(&h, d.pieces(), self.digests) {
                scratch.extend_from_slice(&dd);
            }
            resp = !success;
        }
        if resp {
            let sqhd = if self.sqflow_off { 0 } else { self.head.load(Relaxed) };
            let cqe = Cqe { dw0, dw1, sqhd, sqid: self.sqid, cid: m.cid, status, phase: false };
            pdu::encode_head(&Header::CapsuleResp(cqe), 0, 0, self.digests, 0, scratch);
        }
        let end = scratch.len();
        if data.is_none() {
            return Encoded { head: start..end, data: None, tail: end..end };
        }
        Encoded { head: start..head_end, data, tail: head_end..end }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A host that keeps sending is never torn down, however late the
    /// reaper runs: a command stamps the clock of its arrival. (Until
    /// 2026-12-07 it stamped the reaper's last tick: a reaper held up 3 s
    /// while the host sent every 100 ms found the stamp 3 s old.)
    #[test]
    fn a_late_reaper_spares_a_host_that_kept_sending() {
        let sub =
            Arc::new(Subsystem::new("nqn.test".into(), &Catalog::default(), Arc::new(Access::default())));
        let args = ConnectArgs {
            qid: 0,
            sqsize: 31,
            cattr: 0,
            kato_ms: 1000,
            cntlid: 0xffff,
            subnqn: DISCOVERY_NQN.into(),
            hostnqn: "nqn.host".into(),
            hostid: [1; 16],
            digests: Digests::default(),
        };
        let mut conn = sub.connect(args, &Who { local: true, ..Default::default() }).unwrap();
        let keep_alive = Sqe { opcode: 0x18, cid: 1, ..Default::default() };
        let mut out = Vec::new();
        pdu::encode(&Header::CapsuleCmd(keep_alive), 0, &[], Digests::default(), 0, &mut out);
        sub.reap();
        // The reaper is held up for 3 s; the host sends every 100 ms.
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            let mut buf = BytesMut::from(&out[..]);
            assert!(matches!(conn.decode(&mut buf), Ok(Decoded::Local { .. })), "a Keep Alive, answered");
            std::thread::sleep(Duration::from_millis(100));
        }
        sub.reap();
        assert_eq!(sub.controllers(), 1, "torn down though its host kept sending");
        // It stops: torn down past its timeout (whole seconds and one more).
        std::thread::sleep(Duration::from_millis(2100));
        sub.reap();
        assert_eq!(sub.controllers(), 0, "kept though its host went silent");
    }
}
