//! A namespace of any NVMe/TCP controller (the Linux kernel's nvmet, SPDK,
//! fastsan's own NVMe/TCP front end):
//! `nvme+tcp://HOST[:PORT]/SUBSYSTEM_NQN[/NSID][?hdgst=1&ddgst=1&hostnqn=NQN]`.
//!
//! The host side of NVMe over Fabrics on TCP, with the `fastsan-nvme` codec:
//! an admin queue (ICReq/ICResp, Connect, CC.EN and CSTS.RDY through
//! Property Set/Get, Identify Controller and Namespace, Set Features Number
//! of Queues), then one TCP connection per I/O queue, each with its own
//! Connect. Reads come back in C2HData PDUs; writes travel in the capsule
//! when they fit the controller's in-capsule size (IOCCSZ), otherwise in
//! H2CData PDUs as the controller asks for them with R2Ts. Requests above
//! the controller's maximum transfer (MDTS) are split.
//!
//! As with [`crate::nbd`], there is no reconnection: a lost connection's
//! commands cannot be fenced, so resending a write could let an older one
//! land after a newer one. A command whose connection is lost fails with
//! [`Error::Lost`], which says why; so does one without a completion within the
//! request timeout (the connection is then cut: nobody can tell whether it
//! landed). A controller that breaks the protocol (a malformed PDU, a
//! digest mismatch, data or an R2T for no command, a C2HTermReq) has its
//! connection cut, and every command on it fails with [`Error::NvmeTcp`]
//! saying why. A command the controller completes with an error status
//! fails with [`Error::Nvme`].
//!
//! Keep Alive is not sent: the admin Connect asks for no keep-alive timer
//! (KATO 0), which the NVMe-oF specification allows and Linux's nvmet and
//! SPDK accept.
//!
//! Each queue's PDUs go out through one writer task, whole: a caller that
//! gives up (a dropped future) never leaves half a PDU on the wire, and a
//! command's identifier returns to the free list only once its completion
//! arrives (so it is never reused while the controller still knows it). The
//! reader task answers R2Ts itself, from the data the command keeps, so a
//! write whose caller went away still finishes as the controller expects.

use crate::error::Cause;
use crate::overdue::{is_overdue, overdue, Clock, Ticker};
use crate::read_plan::ReadPlan;
use crate::session::{all, chunks, read_pieces};
use crate::{Error, Options, Status};
use bytes::{BufMut, Bytes, BytesMut};
use fastsan_nvme::command::{fctype, sgl, Cqe, SglDesc, Sqe, Status as NvmeStatus, OPC_FABRICS};
use fastsan_nvme::pdu::{self, fes, flag, DataHeader, Digests, Frame, Header, IcReq, R2t, TermReq};
use futures::FutureExt;
use parking_lot::Mutex;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Notify};

/// The port IANA assigned to NVMe over Fabrics.
pub const DEFAULT_PORT: u16 = 4420;
/// Admin queue entries, 0's based (32 entries, as Linux's host asks).
const ADMIN_SQSIZE: u16 = 31;
/// Commands in flight per I/O queue unless the caller says
/// ([`NvmeVolume::connect_with`]): 128 entries, Linux's default queue size.
pub const DEFAULT_QUEUE_DEPTH: usize = 127;
/// Most I/O queues one volume opens (a sanity bound on the caller's wish).
pub const MAX_QUEUES: usize = 1024;
/// The most one command moves, whatever MDTS allows: a read's buffer is
/// allocated whole when it is sent, and bigger pieces gain nothing.
const MAX_TRANSFER: u64 = 4 << 20;
/// Identify data, and the most any admin command of ours reads back.
const IDENTIFY_LEN: u32 = 4096;
/// Connect's in-capsule data.
const CONNECT_DATA_LEN: usize = 1024;
/// The longest NQN the specification allows (the 256-byte fields keep a NUL).
const MAX_NQN: usize = 223;
/// PSDT = 01 (SGLs): every fabrics command describes its data with an SGL.
const PSDT_SGL: u8 = 0x40;
/// CC: EN, with 64-byte SQ entries (IOSQES 6), 16-byte CQ entries (IOCQES
/// 4), 4 KiB pages (MPS 0), round robin (AMS 0), the NVM command set (CSS 0).
const CC_ENABLE: u32 = 0x0046_0001;

/// Command opcodes this host sends.
mod opc {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
}

/// Controller properties (register offsets).
mod prop {
    pub const CAP: u32 = 0x00;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1c;
}

/// What an `nvme+tcp://` URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeUrl {
    /// `HOST:PORT`, ready for `TcpStream::connect` (an IPv6 address keeps its brackets).
    pub addr: String,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// The namespace (1 unless the URL names another).
    pub nsid: u32,
    /// Header and data digests when the URL asks (`hdgst=`, `ddgst=`);
    /// `None` follows [`Options::digests`].
    pub hdgst: Option<bool>,
    pub ddgst: Option<bool>,
    /// The host NQN to present (`hostnqn=`, for targets that allow named
    /// hosts only); otherwise a fresh `nqn.2014-08.org.nvmexpress:uuid:...`.
    pub hostnqn: Option<String>,
}

impl NvmeUrl {
    pub const SCHEME: &'static str = "nvme+tcp://";

    pub fn has_scheme(url: &str) -> bool {
        url.starts_with(Self::SCHEME)
    }

    /// Parses `nvme+tcp://HOST[:PORT]/SUBSYSTEM_NQN[/NSID][?QUERY]`; the
    /// query takes `hdgst`, `ddgst` (0 or 1) and `hostnqn`.
    pub fn parse(url: &str) -> Result<NvmeUrl, Error> {
        let bad = |why: &str| Error::Url(format!("{url}: {why}"));
        let rest = url
            .strip_prefix(Self::SCHEME)
            .ok_or_else(|| bad("expected nvme+tcp://HOST[:PORT]/SUBSYSTEM_NQN[/NSID][?hdgst=1&ddgst=1]"))?;
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let addr = host_port(host).map_err(|why| bad(&why))?;
        let (subnqn, nsid) = match path.rsplit_once('/') {
            Some((nqn, ns)) => {
                let nsid = ns.parse::<u32>().ok().filter(|n| (1..=0xffff_fffe).contains(n));
                (
                    nqn,
                    nsid.ok_or_else(|| {
                        bad(&format!("namespace {ns:?} is not a number from 1 to 4294967294"))
                    })?,
                )
            }
            None => (path, 1),
        };
        check_nqn(subnqn).map_err(|why| bad(&format!("subsystem NQN: {why}")))?;
        let mut u =
            NvmeUrl { addr, subnqn: subnqn.to_owned(), nsid, hdgst: None, ddgst: None, hostnqn: None };
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let flag = || match v {
                "1" | "true" | "on" => Ok(true),
                "0" | "false" | "off" => Ok(false),
                _ => Err(bad(&format!("{k}={v}: expected 0 or 1"))),
            };
            match k {
                "hdgst" => u.hdgst = Some(flag()?),
                "ddgst" => u.ddgst = Some(flag()?),
                "hostnqn" => {
                    check_nqn(v).map_err(|why| bad(&format!("host NQN: {why}")))?;
                    u.hostnqn = Some(v.to_owned());
                }
                _ => return Err(bad(&format!("unknown parameter {k:?} (known: hdgst, ddgst, hostnqn)"))),
            }
        }
        Ok(u)
    }
}

/// `HOST`, `HOST:PORT`, `[V6]` or `[V6]:PORT` as `HOST:PORT`.
fn host_port(host: &str) -> Result<String, String> {
    let (name, port) = if let Some(v6) = host.strip_prefix('[') {
        let (a, rest) = v6.split_once(']').ok_or("an IPv6 address without its closing ]")?;
        if a.is_empty() {
            return Err("no host".into());
        }
        match rest {
            "" => (host, None),
            p => (&host[..a.len() + 2], Some(p.strip_prefix(':').ok_or("junk after the IPv6 address")?)),
        }
    } else if host.matches(':').count() > 1 {
        return Err("an IPv6 address must be in brackets: [ADDR]:PORT".into());
    } else {
        match host.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host, None),
        }
    };
    if name.is_empty() {
        return Err("no host".into());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p != 0).ok_or(format!("bad port {p:?}"))?,
    };
    Ok(format!("{name}:{port}"))
}

fn check_nqn(nqn: &str) -> Result<(), String> {
    if nqn.is_empty() {
        return Err("missing".into());
    }
    if nqn.len() > MAX_NQN {
        return Err(format!("{} bytes, the limit is {MAX_NQN}", nqn.len()));
    }
    if nqn.chars().any(|c| c.is_control()) {
        return Err(format!("{nqn:?} holds a control character"));
    }
    Ok(())
}

/// What a status means, for [`Error::Nvme`]'s message. Command specific
/// codes mean different things for different commands, hence `command`.
pub fn status_text(command: &str, sct: u8, sc: u8) -> String {
    let connect = command == "Connect";
    let what = match (sct, sc) {
        (0, 0x01) => "invalid opcode",
        (0, 0x02) => "invalid field in command",
        (0, 0x03) => "command identifier conflict",
        (0, 0x04) => "data transfer error",
        (0, 0x06) => "internal error",
        (0, 0x07) => "aborted by request",
        (0, 0x0b) => "invalid namespace or format",
        (0, 0x0c) => "command sequence error",
        (0, 0x0f) => "invalid SGL data block length",
        (0, 0x11) => "invalid SGL descriptor type",
        (0, 0x16) => "invalid SGL offset",
        (0, 0x22) => "transient transport error",
        (0, 0x80) => "LBA out of range",
        (0, 0x81) => "capacity exceeded",
        (0, 0x82) => "namespace not ready",
        (1, 0x80) if connect => "incompatible Connect format",
        (1, 0x81) if connect => "controller busy",
        (1, 0x82) if connect => "invalid Connect parameters",
        (1, 0x84) if connect => "host not allowed",
        (1, 0x82) if command.starts_with("Write") => "write to a read-only namespace",
        (2, 0x80) => "write fault",
        (2, 0x81) => "unrecovered read error",
        (2, 0x85) => "compare failure",
        (2, 0x86) => "access denied",
        _ => "status",
    };
    format!("{what} (status type {sct:#x}, code {sc:#04x})")
}

/// What a Termination Request's Fatal Error Status means.
fn fes_text(code: u16) -> &'static str {
    match code {
        fes::INVALID_HEADER_FIELD => "invalid PDU header field",
        fes::PDU_SEQUENCE_ERROR => "PDU sequence error",
        fes::HEADER_DIGEST => "header digest error",
        fes::DATA_OUT_OF_RANGE => "data transfer out of range",
        fes::R2T_LIMIT_EXCEEDED => "data transfer limit exceeded",
        fes::UNSUPPORTED_PARAMETER => "unsupported parameter",
        _ => "unknown fatal error status",
    }
}

/// How a command's data moves.
enum Data {
    None,
    /// Host to controller, inside the capsule.
    InCapsule(Bytes),
    /// Host to controller in H2CData PDUs, as the controller asks with R2Ts.
    OnRequest(Bytes),
    /// Controller to host in C2HData PDUs: this many bytes.
    Back(u32),
}

/// What a command in flight needs when its PDUs arrive.
struct Cmd {
    /// Bytes the controller sends back (C2HData), and what came so far.
    want: u32,
    /// The data's first piece (usually all of it), then the others.
    first: Option<Bytes>,
    got: Vec<Bytes>,
    got_len: u32,
    /// Bytes the controller asks for (R2T), and up to where it asked.
    out: Bytes,
    asked: u32,
    tx: oneshot::Sender<Result<(Cqe, Bytes), Error>>,
    /// The tick of the queue's [`Clock`] it was sent at.
    sent: u32,
}

impl Cmd {
    fn data(&mut self) -> Bytes {
        let first = self.first.take().unwrap_or_default();
        if self.got.is_empty() {
            return first;
        }
        let mut all = BytesMut::with_capacity(self.got_len as usize);
        all.extend_from_slice(&first);
        for p in self.got.drain(..) {
            all.extend_from_slice(&p);
        }
        all.freeze()
    }

    fn push(&mut self, piece: Bytes) {
        self.got_len += piece.len() as u32;
        match self.first {
            None => self.first = Some(piece),
            Some(_) => self.got.push(piece),
        }
    }
}

/// Commands in flight, indexed by their identifier (identifiers are
/// `0..depth`, so a table, not a hash map), and the identifiers free.
struct Slots {
    free: Vec<u16>,
    pending: Vec<Option<Cmd>>,
    /// Callers waiting for an identifier: only then does a completion
    /// notify (the `Notify` is otherwise one more cache line that the
    /// reader and the callers would pass back and forth per command).
    waiting: usize,
}

impl Slots {
    fn new(depth: u16) -> Slots {
        Slots { free: (0..depth).rev().collect(), pending: (0..depth).map(|_| None).collect(), waiting: 0 }
    }

    /// A free identifier for `cmd`, sent at tick `now`, if one is left
    /// (else `cmd` comes back).
    fn take(&mut self, mut cmd: Cmd, now: u32) -> Result<u16, Cmd> {
        match self.free.pop() {
            Some(cid) => {
                cmd.sent = now;
                self.pending[cid as usize] = Some(cmd);
                Ok(cid)
            }
            None => Err(cmd),
        }
    }

    fn get_mut(&mut self, cid: u16) -> Option<&mut Cmd> {
        self.pending.get_mut(cid as usize)?.as_mut()
    }

    /// Command `cid` leaves the table and its identifier is free again
    /// (tell a waiting caller: [`Slots::waiting`]).
    fn finish(&mut self, cid: u16) -> Option<Cmd> {
        let cmd = self.pending.get_mut(cid as usize)?.take()?;
        self.free.push(cid);
        Some(cmd)
    }

    fn in_flight(&self) -> usize {
        self.pending.len() - self.free.len()
    }

    fn drain(&mut self) -> impl Iterator<Item = Cmd> + '_ {
        self.pending.iter_mut().filter_map(Option::take)
    }
}

/// What a queue's caller side and its reader task share.
struct QueueState {
    /// `HOST:PORT queue N`, for messages.
    name: String,
    slots: Mutex<Slots>,
    /// Woken when an identifier is freed while callers wait for one
    /// ([`Slots::waiting`]), and (all waiters) when the connection ends. A
    /// plain list under `slots` and this, rather than a semaphore: freeing
    /// costs nothing more when nobody waits.
    freed: Notify,
    /// False once the connection ended.
    up: AtomicBool,
    /// Why it ended, for the commands that fail.
    cause: Cause,
    /// Its command clock: the reader cuts the connection when a command
    /// waits past the request timeout ([`crate::overdue`]).
    clock: Clock,
    digests: Digests,
    /// The most data one H2CData PDU may carry (ICResp).
    maxh2cdata: u32,
}

/// One queue pair: one TCP connection to the controller.
struct Queue {
    /// Whole PDUs to the writer task; `None` asks it to cut the connection.
    frames: mpsc::UnboundedSender<Option<Bytes>>,
    state: Arc<QueueState>,
}

/// A protocol violation by the controller: why, and the Termination
/// Request to send before closing, if one applies (FES, FEI, the
/// offending header).
struct Violation {
    why: String,
    term: Option<(u16, u32, Bytes)>,
}

fn violation(why: String) -> Violation {
    Violation { why, term: None }
}

/// A violation answered with an H2CTermReq carrying `header`.
fn fatal(why: String, code: u16, fei: u32, raw: &[u8]) -> Violation {
    let hlen = raw.get(2).map_or(raw.len(), |&h| h as usize).clamp(pdu::CH_LEN, pdu::MAX_TERM_DATA);
    let header = Bytes::copy_from_slice(&raw[..hlen.min(raw.len())]);
    Violation { why, term: Some((code, fei, header)) }
}

/// How a connection's reader ended.
enum Ended {
    Io(io::Error),
    Violation(Violation),
}

impl From<io::Error> for Ended {
    fn from(e: io::Error) -> Ended {
        Ended::Io(e)
    }
}

fn blank(opcode: u8) -> Sqe {
    Sqe { opcode, ..Sqe::default() }
}

/// Where a command's completion comes (from the reader).
type Completion = oneshot::Receiver<Result<(Cqe, Bytes), Error>>;

/// A command being sent once an identifier is free ([`Queue::submit`]), or
/// the error of a send that failed at once.
type Sending<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send + 'a>>;

/// A command ready to go but for its identifier.
struct Submission {
    sqe: Sqe,
    /// Data in the capsule.
    icd: Bytes,
    cmd: Cmd,
}

/// Describes `data` in `sqe` (an SGL descriptor); returns the data that
/// goes in the capsule and what the command's PDUs will need, its
/// completion to go to `tx`.
fn prepare(sqe: &mut Sqe, data: Data, tx: oneshot::Sender<Result<(Cqe, Bytes), Error>>) -> (Bytes, Cmd) {
    let (icd, desc, want, out) = match data {
        Data::None => {
            (Bytes::new(), SglDesc { addr: 0, length: 0, id: sgl::TRANSPORT_DATA_BLOCK }, 0, Bytes::new())
        }
        Data::InCapsule(d) => {
            let desc = SglDesc { addr: 0, length: d.len() as u32, id: sgl::DATA_BLOCK_OFFSET };
            (d, desc, 0, Bytes::new())
        }
        Data::OnRequest(d) => {
            let desc = SglDesc { addr: 0, length: d.len() as u32, id: sgl::TRANSPORT_DATA_BLOCK };
            (Bytes::new(), desc, 0, d)
        }
        Data::Back(n) => {
            (Bytes::new(), SglDesc { addr: 0, length: n, id: sgl::TRANSPORT_DATA_BLOCK }, n, Bytes::new())
        }
    };
    sqe.flags |= PSDT_SGL;
    sqe.dptr = desc.encode();
    (icd, Cmd { want, first: None, got: Vec::new(), got_len: 0, out, asked: 0, tx, sent: 0 })
}

/// A command on its way ([`Queue::call`]): sent, or waiting for an
/// identifier, then waiting for its completion. Written out by hand to stay
/// small (40 bytes), since every read and write future holds one. The
/// combinator it replaces (an async block holding the submission's result,
/// mapped by the status check) made a 4K read's future 184 bytes, moved
/// with `memmove` as each layer of the request's future was built, and
/// polled through one more call: `perf` of `fastsan bench` at 4 x QD8
/// reads had 7.7% of the client's samples there, 4.3% with this (88 bytes).
struct Call<'a> {
    /// Sends the command once an identifier is free; or the submission's error.
    sending: Option<Sending<'a>>,
    completion: Completion,
    /// Checks the status, naming the command in the error ([`Queue::run`]).
    check: Option<&'static str>,
}

impl std::future::Future for Call<'_> {
    type Output = Result<(Cqe, Bytes), Error>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::{ready, Poll};
        let this = &mut *self;
        if let Some(s) = &mut this.sending {
            ready!(s.as_mut().poll(cx))?;
            this.sending = None;
        }
        // A completion that does not come in time: the reader cuts the
        // connection, and every command on it fails.
        let (cqe, data) = ready!(std::pin::Pin::new(&mut this.completion).poll(cx))
            .map_err(|_| Cause::default().error())??;
        if let Some(command) = this.check {
            check(command, &cqe)?;
        }
        Poll::Ready(Ok((cqe, data)))
    }
}

impl Queue {
    /// Opens the connection and exchanges ICReq/ICResp; `depth`: commands
    /// in flight at most; `max_data`: the most data one PDU from the
    /// controller may carry (larger lengths are refused before anything is
    /// buffered); a command without its completion after `timeout` cuts
    /// the connection ([`crate::overdue`]).
    async fn open(
        addr: &str,
        qid: u16,
        digests: Digests,
        depth: u16,
        max_data: u32,
        timeout: Duration,
    ) -> Result<Queue, Error> {
        let name = format!("{addr} queue {qid}");
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|source| Error::Connect { addr: addr.to_owned(), source })?;
        s.set_nodelay(true)?;
        socket2::SockRef::from(&s).set_keepalive(true)?;
        let mut out = Vec::with_capacity(pdu::IC_LEN as usize);
        let ic = IcReq { pfv: pdu::PFV, hpda: 0, digests, maxr2t: 0 };
        pdu::encode(&Header::IcReq(ic), 0, &[], Digests::default(), 0, &mut out);
        s.write_all(&out).await?;
        let mut buf = BytesMut::with_capacity(1024);
        let (p, _) = loop {
            // No digests before ICResp; nothing but ICResp or C2HTermReq may come.
            match pdu::parse(&buf, Digests::default(), pdu::MAX_TERM_DATA as u32) {
                Ok(Some((p, used))) => break (p, buf.split_to(used).freeze()),
                Ok(None) => {}
                Err(e) => return Err(Error::NvmeTcp(format!("{name}: bad answer to ICReq: {e}"))),
            }
            if s.read_buf(&mut buf).await? == 0 {
                return Err(Error::NvmeTcp(format!(
                    "{name}: the controller closed the connection after ICReq"
                )));
            }
        };
        let bad = |why: String| Err(Error::NvmeTcp(format!("{name}: {why}")));
        let r = match p.header {
            Header::IcResp(r) => r,
            Header::C2hTermReq(t) => {
                return bad(format!("ICReq refused: {} (FEI {:#x})", fes_text(t.fes), t.fei));
            }
            h => return bad(format!("a {} in answer to ICReq", h.name())),
        };
        if r.pfv != pdu::PFV {
            return bad(format!("PDU format version {} (this host speaks {})", r.pfv, pdu::PFV));
        }
        if r.digests != digests {
            return bad(format!("digests {:?} agreed, {:?} asked", r.digests, digests));
        }
        if r.cpda != 0 {
            return bad(format!("controller PDU data alignment {} (only 0 is supported)", r.cpda));
        }
        if r.maxh2cdata == 0 {
            return bad("MAXH2CDATA 0".into());
        }
        let (rd, wr) = s.into_split();
        let state = Arc::new(QueueState {
            name,
            slots: Mutex::new(Slots::new(depth)),
            freed: Notify::new(),
            up: AtomicBool::new(true),
            cause: Cause::default(),
            clock: Clock::default(),
            digests,
            maxh2cdata: r.maxh2cdata,
        });
        let (frames, rx) = mpsc::unbounded_channel();
        // A receive buffer of its own (see RECEIVE_BUFFER).
        let mut rbuf = BytesMut::with_capacity(RECEIVE_BUFFER);
        rbuf.extend_from_slice(&buf);
        tokio::spawn(read_pdus(rd, rbuf, state.clone(), frames.downgrade(), max_data, timeout));
        let st = state.clone();
        tokio::spawn(async move {
            crate::writer::run(wr, rx, &st.up, &st.cause, || st.slots.lock().in_flight()).await
        });
        Ok(Queue { frames, state })
    }

    fn connected(&self) -> bool {
        self.state.up.load(Relaxed)
    }

    /// Sends `sqe` with its data and waits for its completion, whatever its
    /// status (Connect's failures say more in DW0, so the caller decides).
    /// With an identifier free the command is sent at once, and the future
    /// holds neither the command nor its data; else the future holds them
    /// and sends them once polled and an identifier is freed (dropped
    /// unpolled, it sends nothing). Every caller awaits it at once.
    fn call(
        &self,
        sqe: Sqe,
        data: Data,
    ) -> impl std::future::Future<Output = Result<(Cqe, Bytes), Error>> + Send + '_ {
        self.submit(sqe, data, None)
    }

    /// [`Queue::call`], with an error status as [`Error::Nvme`].
    fn run(
        &self,
        command: &'static str,
        sqe: Sqe,
        data: Data,
    ) -> impl std::future::Future<Output = Result<(Cqe, Bytes), Error>> + Send + '_ {
        self.submit(sqe, data, Some(command))
    }

    /// Sends the command if an identifier is free, else leaves that to the
    /// returned future (boxed: the rare path), which then waits for the
    /// completion.
    fn submit(&self, mut sqe: Sqe, data: Data, check: Option<&'static str>) -> Call<'_> {
        let (tx, completion) = oneshot::channel();
        let (icd, cmd) = prepare(&mut sqe, data, tx);
        // The lock is released at the end of this statement: `send` may take it again.
        let taken = self.state.slots.lock().take(cmd, self.state.clock.now());
        let sending: Option<Sending<'_>> = match taken {
            Ok(cid) => match self.send(cid, sqe, &icd) {
                Ok(()) => None,
                Err(e) => Some(Box::pin(std::future::ready(Err(e)))),
            },
            Err(cmd) => Some(Box::pin(self.send_when_free(Submission { sqe, icd, cmd }))),
        };
        Call { sending, completion, check }
    }

    /// Sends `sub` once an identifier is free. Identifiers are freed only by
    /// the reader when a completion arrives, so a caller that gives up never
    /// returns an identifier still in use.
    async fn send_when_free(&self, mut sub: Submission) -> Result<(), Error> {
        let st = &self.state;
        loop {
            {
                let mut s = st.slots.lock();
                match s.take(sub.cmd, st.clock.now()) {
                    Ok(cid) => {
                        drop(s);
                        return self.send(cid, sub.sqe, &sub.icd);
                    }
                    Err(back) => sub.cmd = back,
                }
                s.waiting += 1;
            }
            // Counted under the lock that found no identifier, so the next
            // completion notifies (a permit, if it comes before this waits);
            // uncounted however this ends, also when the caller gives up.
            let _waiting = Waiting(st);
            // Made before `up` is read: the reader's end (`notify_waiters`,
            // after it cleared `up`) wakes it even if it comes next.
            let freed = st.freed.notified();
            if !st.up.load(Acquire) {
                return Err(st.cause.error());
            }
            freed.await;
        }
    }

    /// Sends command `cid` (in the table already) as a capsule.
    fn send(&self, cid: u16, mut sqe: Sqe, icd: &Bytes) -> Result<(), Error> {
        let st = &self.state;
        // After the insert: a reader that ended drained the table after it
        // cleared `up`, so a command it did not fail sees `up` false here.
        if !st.up.load(Acquire) {
            st.slots.lock().finish(cid);
            return Err(st.cause.error());
        }
        sqe.cid = cid;
        // Exactly the PDU's length: a Vec with spare room becomes a Bytes
        // through a second allocation (and a shared drop), one per command.
        let capsule = Header::CapsuleCmd(sqe);
        let mut frame = Vec::with_capacity(pdu::encoded_len(&capsule, icd.len(), st.digests, 0));
        pdu::encode(&capsule, 0, icd, st.digests, 0, &mut frame);
        if self.frames.send(Some(frame.into())).is_err() {
            st.slots.lock().finish(cid);
            return Err(st.cause.error());
        }
        Ok(())
    }

    /// Connect: makes this connection the admin queue of a new controller
    /// (`qid` 0, `cntlid` 0xFFFF), or an I/O queue of controller `cntlid`.
    /// Returns the controller's id.
    async fn connect(
        &self,
        qid: u16,
        sqsize: u16,
        cntlid: u16,
        u: &NvmeUrl,
        host: &Host,
    ) -> Result<u16, Error> {
        let mut sqe = blank(OPC_FABRICS);
        sqe.nsid = fctype::CONNECT as u32;
        // RECFMT 0 in bits 15:0; KATO 0 (no keep-alive timer). CATTR bit 2 on
        // I/O queues: SQ flow control off (identifiers bound what is in
        // flight here), so a read's data may carry SUCCESS and save its
        // completion PDU (as SPDK's hosts and Linux's --disable-sqflow do).
        sqe.cdw10 = (qid as u32) << 16;
        sqe.cdw11 = sqsize as u32 | if qid > 0 { 1 << 18 } else { 0 };
        let mut d = vec![0u8; CONNECT_DATA_LEN];
        d[..16].copy_from_slice(&host.id);
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        d[256..256 + u.subnqn.len()].copy_from_slice(u.subnqn.as_bytes());
        d[512..512 + host.nqn.len()].copy_from_slice(host.nqn.as_bytes());
        let (cqe, _) = self.call(sqe, Data::InCapsule(d.into())).await?;
        let s = cqe.status;
        if s.is_success() {
            return Ok(cqe.dw0 as u16);
        }
        let refused = |status, message| Err(Error::Refused { status, message });
        match (s.sct, s.sc) {
            // Invalid parameters: DW0 names the field (IATTR bit 16: in the data).
            (1, 0x82) if cqe.dw0 == 0x1_0000 | 256 => refused(
                Status::NO_SUCH_VOLUME,
                format!(
                    "no NVMe subsystem {:?} at {} (the target logs its NQN at start; \
                     `nvme discover` lists it)",
                    u.subnqn, self.state.name
                ),
            ),
            (1, 0x82) if cqe.dw0 == 0x1_0000 | 512 => refused(
                Status::ACCESS_DENIED,
                format!("host {:?} may not connect to {:?}", host.nqn, u.subnqn),
            ),
            (1, 0x84) => refused(
                Status::ACCESS_DENIED,
                format!("host {:?} may not connect to {:?}", host.nqn, u.subnqn),
            ),
            (1, 0x81) => refused(Status::BUSY, format!("controller busy (queue {qid})")),
            _ => Err(Error::Nvme { command: "Connect", sct: s.sct, sc: s.sc, dnr: s.dnr }),
        }
    }

    /// Property Get: a 4-byte (or with `wide`, 8-byte) controller property.
    async fn get(&self, offset: u32, wide: bool) -> Result<u64, Error> {
        let mut sqe = blank(OPC_FABRICS);
        sqe.nsid = fctype::PROPERTY_GET as u32;
        sqe.cdw10 = wide as u32;
        sqe.cdw11 = offset;
        let (cqe, _) = self.run("Property Get", sqe, Data::None).await?;
        Ok(if wide { cqe.dw0 as u64 | (cqe.dw1 as u64) << 32 } else { cqe.dw0 as u64 })
    }

    /// Property Set of a 4-byte property.
    async fn set(&self, offset: u32, value: u32) -> Result<(), Error> {
        let mut sqe = blank(OPC_FABRICS);
        sqe.nsid = fctype::PROPERTY_SET as u32;
        sqe.cdw11 = offset;
        sqe.cdw12 = value;
        self.run("Property Set", sqe, Data::None).await.map(drop)
    }

    /// Identify: the 4096 bytes of CNS `cns` about namespace `nsid`.
    async fn identify(&self, cns: u8, nsid: u32) -> Result<Bytes, Error> {
        let mut sqe = blank(opc::IDENTIFY);
        sqe.nsid = nsid;
        sqe.cdw10 = cns as u32;
        let (_, data) = self.run("Identify", sqe, Data::Back(IDENTIFY_LEN)).await?;
        Ok(data)
    }
}

/// An error status as [`Error::Nvme`].
fn check(command: &'static str, cqe: &Cqe) -> Result<(), Error> {
    let s = cqe.status;
    if s.is_success() {
        Ok(())
    } else {
        Err(Error::Nvme { command, sct: s.sct, sc: s.sc, dnr: s.dnr })
    }
}

/// Who this host says it is: a host identifier and a host NQN.
struct Host {
    id: [u8; 16],
    nqn: String,
}

impl Host {
    /// A fresh random (version 4) UUID as the host identifier, and the NQN
    /// made from it unless one is given.
    fn new(nqn: Option<String>) -> Host {
        let mut id: [u8; 16] = rand::random();
        id[6] = (id[6] & 0x0f) | 0x40;
        id[8] = (id[8] & 0x3f) | 0x80;
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let uuid = format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]);
        Host { id, nqn: nqn.unwrap_or_else(|| format!("nqn.2014-08.org.nvmexpress:uuid:{uuid}")) }
    }
}

/// A namespace of an NVMe/TCP controller: an admin queue and one or more I/O
/// queues, each its own TCP connection.
pub struct NvmeVolume {
    url: String,
    /// Kept open: closing it would end the controller (and its I/O queues).
    admin: Queue,
    io: Vec<Queue>,
    /// The next I/O queue for a call that does not pick one.
    next: AtomicUsize,
    nsid: u32,
    controller: u16,
    size: u64,
    /// log2 of the block (LBA) size.
    lbads: u32,
    /// The most bytes one command moves (MDTS, the 16-bit block count, and
    /// [`MAX_TRANSFER`]); a multiple of the block size.
    max_transfer: u32,
    /// The most bytes a write carries in its capsule (IOCCSZ); above it, R2T.
    in_capsule: u32,
    read_only: bool,
    volatile_cache: bool,
}

impl Drop for NvmeVolume {
    /// This side closes every queue: their readers must not report the
    /// end as a lost connection. The controller may end the I/O queues as
    /// soon as it sees the admin queue go, before their own writers close.
    fn drop(&mut self) {
        for q in self.io.iter().chain([&self.admin]) {
            q.state.up.store(false, Relaxed);
        }
    }
}

impl NvmeVolume {
    /// Connects to the controller (the admin queue, enabling, Identify),
    /// asks for `queues` I/O queues and connects each; all within the
    /// connect timeout. The controller may grant fewer I/O queues
    /// ([`NvmeVolume::queues`]). Of the options, the connect and request
    /// timeouts apply, and `digests` when the URL does not say.
    pub async fn connect(url: &str, opts: &Options, queues: usize) -> Result<NvmeVolume, Error> {
        Self::connect_with(url, opts, queues, DEFAULT_QUEUE_DEPTH).await
    }

    /// [`NvmeVolume::connect`], with up to `depth` commands in flight on
    /// each I/O queue (queues of `depth + 1` entries; the controller's
    /// CAP.MQES and MAXCMD may lower it). More concurrent requests wait
    /// for a free command identifier.
    pub async fn connect_with(
        url: &str,
        opts: &Options,
        queues: usize,
        depth: usize,
    ) -> Result<NvmeVolume, Error> {
        let u = NvmeUrl::parse(url)?;
        if queues == 0 || queues > MAX_QUEUES {
            return Err(Error::InvalidArgument(format!("{queues} I/O queues: from 1 to {MAX_QUEUES}")));
        }
        if depth == 0 || depth >= 0xffff {
            return Err(Error::InvalidArgument(format!("queue depth {depth}: from 1 to 65534")));
        }
        let work = Self::open(url, u, opts, queues, depth as u32);
        tokio::time::timeout(opts.connect_timeout, work)
            .await
            .map_err(|_| Error::Timeout("NVMe/TCP connect"))?
    }

    async fn open(
        url: &str,
        u: NvmeUrl,
        opts: &Options,
        queues: usize,
        depth: u32,
    ) -> Result<NvmeVolume, Error> {
        let t = opts.request_timeout;
        let digests =
            Digests { header: u.hdgst.unwrap_or(opts.digests), data: u.ddgst.unwrap_or(opts.digests) };
        let host = Host::new(u.hostnqn.clone());
        let admin = Queue::open(&u.addr, 0, digests, ADMIN_SQSIZE, IDENTIFY_LEN, t).await?;
        let controller = admin.connect(0, ADMIN_SQSIZE, 0xffff, &u, &host).await?;
        let name = format!("{} controller {controller}", u.addr);
        let bad = |why: String| Error::NvmeTcp(format!("{name}: {why}"));

        let cap = admin.get(prop::CAP, true).await?;
        let mqes = (cap & 0xffff) as u32;
        let ready_within = Duration::from_millis(500 * (((cap >> 24) & 0xff) + 1));
        let mpsmin = ((cap >> 48) & 0xf) as u32;
        admin.set(prop::CC, CC_ENABLE).await?;
        let deadline = Instant::now() + ready_within;
        loop {
            let csts = admin.get(prop::CSTS, false).await?;
            if csts & 2 != 0 {
                return Err(bad("the controller failed when enabled (CSTS.CFS)".into()));
            }
            if csts & 1 != 0 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("waiting for the NVMe controller to become ready (CSTS.RDY)"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        let ctrl = admin.identify(1, 0).await?;
        let le16 = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        let le32 = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let le64 = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let mdts = ctrl[77] as u32;
        let maxcmd = le16(&ctrl, 514) as u32;
        let volatile_cache = ctrl[525] & 1 != 0;
        let ioccsz = le32(&ctrl, 1792);

        let ns = match admin.identify(0, u.nsid).await {
            Err(Error::Nvme { sct: 0, sc: 0x0b, .. }) => Bytes::new(),
            r => r?,
        };
        // An inactive namespace reads as zeros (NCAP 0: not allocated).
        if ns.is_empty() || le64(&ns, 8) == 0 {
            return Err(Error::Refused {
                status: Status::NO_SUCH_VOLUME,
                message: format!("no active namespace {} in {:?}", u.nsid, u.subnqn),
            });
        }
        let nsze = le64(&ns, 0);
        let flbas = ns[26];
        let format = (flbas & 0x0f) as usize | (((flbas >> 5) & 3) as usize) << 4;
        let lbaf = 128 + 4 * format;
        let (ms, lbads) = (le16(&ns, lbaf), ns[lbaf + 2] as u32);
        if !(9..=16).contains(&lbads) {
            return Err(bad(format!("namespace {}: LBA format {format} has 2^{lbads}-byte blocks", u.nsid)));
        }
        if ms != 0 {
            return Err(bad(format!("namespace {}: {ms} bytes of metadata per block (unsupported)", u.nsid)));
        }
        let size = nsze
            .checked_mul(1 << lbads)
            .ok_or_else(|| bad(format!("namespace {}: {nsze} blocks is too large", u.nsid)))?;
        let read_only = ns[99] & 1 != 0;

        // Transfers: MDTS in units of the minimum page size; at most 65536
        // blocks (the 0's based 16-bit NLB); at most MAX_TRANSFER.
        let page = 4096u64 << mpsmin;
        let mdts_bytes = if mdts == 0 { u64::MAX } else { page.checked_shl(mdts).unwrap_or(u64::MAX) };
        let max_transfer = mdts_bytes.min(65536 << lbads).min(MAX_TRANSFER) >> lbads << lbads;
        if max_transfer == 0 {
            return Err(bad(format!("MDTS {mdts} allows less than one {}-byte block", 1u32 << lbads)));
        }
        let max_transfer = max_transfer as u32;
        // IOCCSZ counts 16-byte units of the whole capsule, the 64-byte SQE included.
        let in_capsule = ioccsz.saturating_mul(16).saturating_sub(64);
        let mut entries = (depth + 1).min(mqes + 1);
        if maxcmd != 0 {
            entries = entries.min(maxcmd);
        }
        if entries < 2 {
            return Err(bad(format!("queues of {entries} entries (CAP.MQES {mqes}, MAXCMD {maxcmd})")));
        }

        let mut sqe = blank(opc::SET_FEATURES);
        let n = queues as u32 - 1;
        sqe.cdw10 = 0x07; // Number of Queues
        sqe.cdw11 = n | n << 16;
        let (cqe, _) = admin.run("Set Features", sqe, Data::None).await?;
        // The controller grants both counts, 0's based; it may grant fewer.
        let granted = ((cqe.dw0 & 0xffff).min(cqe.dw0 >> 16) + 1) as usize;
        if granted < queues {
            tracing::info!(controller = %name, asked = queues, granted, "fewer NVMe I/O queues than asked");
        }
        let queues = queues.min(granted);
        let sqsize = (entries - 1) as u16;
        let (u, host) = (&u, &host);
        let open_io = move |qid: u16| {
            let addr = &u.addr;
            async move {
                // One fewer command in flight than entries: a full circular
                // queue would look empty.
                let q = Queue::open(addr, qid, digests, sqsize, max_transfer, t).await?;
                let id = q.connect(qid, sqsize, controller, u, host).await?;
                if id != controller {
                    return Err(Error::NvmeTcp(format!(
                        "{addr}: I/O queue {qid} joined controller {id}, not {controller}"
                    )));
                }
                Ok(q)
            }
        };
        let io = all((1..=queues as u16).map(open_io)).await?;
        tracing::debug!(
            controller = %name, size, block = 1u32 << lbads, queues, entries, max_transfer, in_capsule,
            "NVMe/TCP namespace {} connected", u.nsid
        );
        Ok(NvmeVolume {
            url: url.to_owned(),
            admin,
            io,
            next: AtomicUsize::new(0),
            nsid: u.nsid,
            controller,
            size,
            lbads,
            max_transfer,
            in_capsule,
            read_only,
            volatile_cache,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }
    /// The namespace's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
    /// Offsets and lengths must be multiples of this (the LBA size).
    pub fn block_size(&self) -> u32 {
        1 << self.lbads
    }
    /// The namespace is write protected (NSATTR).
    pub fn read_only(&self) -> bool {
        self.read_only
    }
    /// The controller has a volatile write cache (VWC): without one, Flush
    /// and FUA change nothing.
    pub fn volatile_cache(&self) -> bool {
        self.volatile_cache
    }
    /// I/O queues (connections besides the admin queue).
    pub fn queues(&self) -> usize {
        self.io.len()
    }
    pub fn nsid(&self) -> u32 {
        self.nsid
    }
    /// The controller id Connect gave.
    pub fn controller_id(&self) -> u16 {
        self.controller
    }
    /// The most bytes one command moves; larger requests are split.
    pub fn max_transfer(&self) -> u32 {
        self.max_transfer
    }
    /// The most bytes a write carries in its command capsule; larger writes
    /// wait for the controller's R2T.
    pub fn in_capsule_limit(&self) -> u32 {
        self.in_capsule
    }
    /// Whether every connection (admin and I/O) is still up.
    pub fn connected(&self) -> bool {
        self.admin.connected() && self.io.iter().all(Queue::connected)
    }

    /// I/O queue `queue` (modulo their number), or the next in turn.
    fn queue(&self, queue: Option<usize>) -> &Queue {
        let i = queue.unwrap_or_else(|| self.next.fetch_add(1, Relaxed));
        &self.io[i % self.io.len()]
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), Error> {
        let mask = (1u64 << self.lbads) - 1;
        if offset & mask != 0 || len & mask != 0 {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} and length {len} must be multiples of the block size {}",
                self.block_size()
            )));
        }
        offset.checked_add(len).map(drop).ok_or(Error::Status(Status::OUT_OF_RANGE))
    }

    /// A Read or Write command of `len` bytes (at most `max_transfer`) at `offset`.
    fn rw(&self, opcode: u8, offset: u64, len: u64, fua: bool) -> Sqe {
        let mut sqe = blank(opcode);
        let slba = offset >> self.lbads;
        sqe.nsid = self.nsid;
        sqe.cdw10 = slba as u32;
        sqe.cdw11 = (slba >> 32) as u32;
        sqe.cdw12 = ((len >> self.lbads) - 1) as u32 | (fua as u32) << 30;
        sqe
    }

    /// Reads `len` bytes at `offset`, on the next I/O queue in turn.
    pub fn read(
        &self,
        offset: u64,
        len: u64,
    ) -> impl std::future::Future<Output = Result<Bytes, Error>> + Send + '_ {
        self.read_from(self.queue(None), offset, len)
    }

    /// Reads `len` bytes at `offset` on I/O queue `queue` (modulo their number).
    pub fn read_on(
        &self,
        queue: usize,
        offset: u64,
        len: u64,
    ) -> impl std::future::Future<Output = Result<Bytes, Error>> + Send + '_ {
        self.read_from(self.queue(Some(queue)), offset, len)
    }

    // Not an async fn: its arguments would be held twice (clippy's rewrite undoes the point).
    #[allow(clippy::manual_async_fn)]
    fn read_from<'a>(
        &'a self,
        q: &'a Queue,
        offset: u64,
        len: u64,
    ) -> impl std::future::Future<Output = Result<Bytes, Error>> + Send + 'a {
        async move {
            self.check_range(offset, len)?;
            if len == 0 {
                return Ok(Bytes::new());
            }
            if len <= self.max_transfer as u64 {
                return self.read_one(q, offset, len).await;
            }
            // Several commands: a future of their own (boxed), which a
            // one-command read does not carry.
            let max = self.max_transfer as u64;
            Box::pin(read_pieces(offset, len, max, |o, n| self.read_one(q, o, n))).await
        }
    }

    /// One Read command.
    fn read_one<'a>(
        &'a self,
        q: &'a Queue,
        offset: u64,
        len: u64,
    ) -> impl std::future::Future<Output = Result<Bytes, Error>> + Send + 'a {
        let sqe = self.rw(opc::READ, offset, len, false);
        q.run("Read", sqe, Data::Back(len as u32)).map(|r| r.map(|(_, data)| data))
    }

    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        let data = self.read(offset, buf.len() as u64).await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Writes `data` at `offset`, on the next I/O queue in turn; with `fua`
    /// it is durable when this returns.
    pub fn write_bytes(
        &self,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + '_ {
        self.write_to(self.queue(None), data, offset, fua)
    }

    /// Writes `data` at `offset` on I/O queue `queue` (modulo their number).
    pub fn write_bytes_on(
        &self,
        queue: usize,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + '_ {
        self.write_to(self.queue(Some(queue)), data, offset, fua)
    }

    /// A write split in pieces reports its outcome once every piece is
    /// answered, so no piece of a write reported failed lands after the report.
    /// (An async block, not an async fn, here and in [`NvmeVolume::read_from`]:
    /// the arguments are held once, not twice.)
    #[allow(clippy::manual_async_fn)]
    fn write_to<'a>(
        &'a self,
        q: &'a Queue,
        data: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'a {
        async move {
            self.check_range(offset, data.len() as u64)?;
            if data.is_empty() {
                return Ok(());
            }
            if data.len() as u64 <= self.max_transfer as u64 {
                return self.write_one(q, data, offset, fua).await;
            }
            // Several commands: a future of their own (boxed), as for reads.
            let max = self.max_transfer as u64;
            let pieces = all(chunks(offset, data.len() as u64, max).map(|(o, n)| {
                let at = (o - offset) as usize;
                self.write_one(q, data.slice(at..at + n as usize), o, fua)
            }));
            Box::pin(pieces).await.map(drop)
        }
    }

    /// One Write command: its data in the capsule when it fits, else by R2T.
    fn write_one<'a>(
        &'a self,
        q: &'a Queue,
        piece: Bytes,
        offset: u64,
        fua: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'a {
        let n = piece.len() as u64;
        let sqe = self.rw(opc::WRITE, offset, n, fua);
        let how = if n <= self.in_capsule as u64 { Data::InCapsule(piece) } else { Data::OnRequest(piece) };
        q.run("Write", sqe, how).map(|r| r.map(drop))
    }

    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }

    /// Makes completed writes durable (Flush: the controller's whole write
    /// cache for the namespace, whichever queue the writes used).
    pub async fn flush(&self) -> Result<(), Error> {
        let mut sqe = blank(opc::FLUSH);
        sqe.nsid = self.nsid;
        self.queue(None).run("Flush", sqe, Data::None).await.map(drop)
    }
}

/// The receive buffer's capacity. `BytesMut` remembers what it was created
/// with and grows by that when the data handed out still shares it: big
/// enough chunks that the allocator hands them out and takes them back
/// whole (the 1 KiB handshake buffer made every read allocate, and glibc
/// trim its heap, a TLB shootdown each time).
const RECEIVE_BUFFER: usize = 1 << 20;

/// Room each read asks for, at least: many PDUs.
const RECEIVE_ROOM: usize = 64 << 10;

/// Reads PDUs until the connection ends or the controller breaks the
/// protocol, completing commands; then fails every command still waiting.
/// Holds the frame sender weakly: dropping the volume ends the writer,
/// which closes the socket, which ends this.
async fn read_pdus(
    mut rd: OwnedReadHalf,
    buf: BytesMut,
    state: Arc<QueueState>,
    frames: mpsc::WeakUnboundedSender<Option<Bytes>>,
    max_data: u32,
    timeout: Duration,
) {
    let mut ending = Ending { state: &state, why: None };
    let ended = receive(&mut rd, buf, &state, &frames, max_data, timeout).await;
    // Read before the cut below: the writer clears `up` first only when this
    // side closed the connection (the volume was dropped).
    let ours = !state.up.load(Acquire);
    // Why, first: before the cut (the writer then clears `up`) and before
    // `ending` fails the commands, so that each says why.
    if let Ended::Io(e) = &ended {
        state.cause.set_io(e, timeout, ours);
    }
    if matches!(&ended, Ended::Io(e) if is_overdue(e)) {
        // Whether it landed is unknown: the connection is cut, and every
        // command on it fails.
        tracing::warn!(queue = %state.name, ?timeout, "an NVMe command got no completion in time; cutting the connection");
        crate::writer::cut(&rd, &frames);
    }
    ending.why = match ended {
        Ended::Io(e) if ours || is_overdue(&e) => {
            tracing::debug!(queue = %state.name, "the NVMe/TCP connection closed: {e}");
            None
        }
        Ended::Io(e) => {
            tracing::warn!(queue = %state.name, "the NVMe/TCP connection ended: {e}");
            None
        }
        Ended::Violation(v) => {
            state.cause.set(format!("the controller broke the protocol: {}", v.why));
            tracing::warn!(queue = %state.name, "the NVMe/TCP controller broke the protocol: {}", v.why);
            if let Some(tx) = frames.upgrade() {
                if let Some((code, fei, header)) = v.term {
                    let mut out = Vec::new();
                    let t = TermReq { fes: code, fei };
                    pdu::encode(&Header::H2cTermReq(t), 0, &header, Digests::default(), 0, &mut out);
                    let _ = tx.send(Some(out.into()));
                }
                let _ = tx.send(None);
            }
            Some(v.why)
        }
    };
    state.up.store(false, Release);
}

/// Ends a queue's connection however its reader ends (by a panic too):
/// `up` cleared, the callers waiting for an identifier woken, and every
/// command still waiting failed: with the controller's protocol violation
/// (`why`) if that ended it, else as a lost connection, with its cause.
struct Ending<'a> {
    state: &'a QueueState,
    why: Option<String>,
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let state = self.state;
        state.up.store(false, Relaxed);
        state.freed.notify_waiters();
        let err = || match &self.why {
            Some(why) => Error::NvmeTcp(format!("{}: {why}", state.name)),
            None => state.cause.error(),
        };
        for cmd in state.slots.lock().drain() {
            let _ = cmd.tx.send(Err(err()));
        }
    }
}

async fn receive(
    rd: &mut OwnedReadHalf,
    mut buf: BytesMut,
    state: &QueueState,
    frames: &mpsc::WeakUnboundedSender<Option<Bytes>>,
    max_data: u32,
    timeout: Duration,
) -> Ended {
    let mut ticker = Ticker::new(timeout);
    let any_overdue = |now| state.slots.lock().pending.iter().flatten().any(|c| overdue(now, c.sent));
    let mut plan = ReadPlan::new(RECEIVE_ROOM, RECEIVE_BUFFER);
    loop {
        loop {
            // Framed only: `handle` decodes what each type needs (no Pdu built and moved).
            match pdu::frame(&buf, state.digests, max_data) {
                Ok(Some(f)) => {
                    let raw = buf.split_to(f.len).freeze();
                    if let Err(v) = handle(state, &f, raw, frames) {
                        return Ended::Violation(v);
                    }
                }
                Ok(None) => break,
                Err(e) => return Ended::Violation(malformed(e, &buf)),
            }
        }
        // A PDU under way: its length (checked by parse) says how much to
        // make room for; a large one is read to its end (see ReadPlan).
        let need = match buf.get(4..8) {
            Some(p) => u32::from_le_bytes(p.try_into().expect("4 bytes")) as usize,
            None => 0,
        };
        let (room, most) = plan.next(buf.len(), need);
        buf.reserve(room);
        match ticker.read(rd, &mut (&mut buf).limit(most), &state.clock, any_overdue).await {
            Ok(0) => return Ended::Io(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => {}
            Err(e) => return Ended::Io(e),
        }
    }
}

/// Removes command `cid` from the queue and frees its identifier.
fn finish(state: &QueueState, cid: u16) -> Option<Cmd> {
    let mut s = state.slots.lock();
    let cmd = s.finish(cid)?;
    wake_waiter(state, s);
    Some(cmd)
}

/// An identifier was freed under `s`: wakes a caller waiting for one.
fn wake_waiter(state: &QueueState, s: parking_lot::MutexGuard<'_, Slots>) {
    let wake = s.waiting > 0;
    drop(s);
    if wake {
        state.freed.notify_one();
    }
}

/// A caller counted in [`Slots::waiting`] until dropped.
struct Waiting<'a>(&'a QueueState);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.slots.lock().waiting -= 1;
    }
}

/// One PDU from the controller. The two that complete commands (a
/// CapsuleResp, a C2HData) have their fields read in place; the others are
/// decoded whole.
fn handle(
    state: &QueueState,
    p: &Frame,
    raw: Bytes,
    frames: &mpsc::WeakUnboundedSender<Option<Bytes>>,
) -> Result<(), Violation> {
    if let Some(cqe) = p.cqe(&raw) {
        return capsule_resp(state, cqe, &raw);
    }
    if let Some(d) = p.c2h_data(&raw) {
        return c2h_data(state, d.map_err(|e| malformed(e, &raw))?, p, &raw);
    }
    match p.header(&raw).map_err(|e| malformed(e, &raw))? {
        Header::R2t(r) => r2t(state, r, &raw, frames),
        Header::C2hTermReq(t) => Err(violation(format!(
            "the controller ended the connection (C2HTermReq): {} (FEI {:#x})",
            fes_text(t.fes),
            t.fei
        ))),
        h => Err(out_of_sequence(format!("an unexpected {} PDU", h.name()), &raw)),
    }
}

/// Bytes that are no valid PDU, answered with the status the codec names.
fn malformed(e: fastsan_nvme::ProtocolError, raw: &[u8]) -> Violation {
    let (code, fei) = e.fes();
    fatal(format!("a malformed PDU: {e}"), code, fei, raw)
}

/// A PDU naming a command not in flight, or out of turn.
fn out_of_sequence(why: String, raw: &[u8]) -> Violation {
    fatal(why, fes::PDU_SEQUENCE_ERROR, 0, raw)
}

/// A command's completion.
fn capsule_resp(state: &QueueState, cqe: Cqe, raw: &Bytes) -> Result<(), Violation> {
    let seq = |why: String| out_of_sequence(why, raw);
    let cid = cqe.cid;
    let mut cmd = finish(state, cid)
        .ok_or_else(|| seq(format!("a CapsuleResp for command {cid}, which is not in flight")))?;
    // Data short of what was asked, on success: the controller lost
    // count (an error status may come early, with any data).
    let short = if !cqe.status.is_success() {
        None
    } else if cmd.got_len != cmd.want {
        Some(format!("command {cid} completed with {} of {} bytes read", cmd.got_len, cmd.want))
    } else if cmd.asked as usize != cmd.out.len() {
        Some(format!("command {cid} completed with {} of {} bytes asked for", cmd.asked, cmd.out.len()))
    } else {
        None
    };
    if let Some(why) = short {
        let _ = cmd.tx.send(Err(Error::NvmeTcp(format!("{}: {why}", state.name))));
        return Err(violation(why));
    }
    let data = cmd.data();
    let _ = cmd.tx.send(Ok((cqe, data)));
    Ok(())
}

/// A read's data (marked SUCCESS: its completion too).
fn c2h_data(state: &QueueState, d: DataHeader, p: &Frame, raw: &Bytes) -> Result<(), Violation> {
    let seq = |why: String| out_of_sequence(why, raw);
    let cid = d.cccid;
    if !p.data_digest_ok {
        return Err(violation(format!("data digest mismatch in C2HData for command {cid}")));
    }
    let mut s = state.slots.lock();
    let cmd =
        s.get_mut(cid).ok_or_else(|| seq(format!("C2HData for command {cid}, which is not in flight")))?;
    // In order, as Linux's host requires (it ignores DATAO).
    if d.datao != cmd.got_len || d.datal > cmd.want - cmd.got_len {
        let why = format!(
            "C2HData for command {cid} at {}+{}: {} of {} bytes came before",
            d.datao, d.datal, cmd.got_len, cmd.want
        );
        return Err(fatal(why, fes::DATA_OUT_OF_RANGE, 12, raw));
    }
    if d.datal > 0 {
        cmd.push(raw.slice(p.data.clone()));
    }
    if p.flags & flag::SUCCESS != 0 {
        // The command succeeded; no CapsuleResp follows.
        if p.flags & flag::LAST_PDU == 0 || cmd.got_len != cmd.want {
            let why = format!("C2HData SUCCESS for command {cid} before its last byte");
            return Err(fatal(why, fes::INVALID_HEADER_FIELD, 1, raw));
        }
        let mut cmd = s.finish(cid).expect("in flight: checked under the lock");
        wake_waiter(state, s);
        let cqe = Cqe { dw0: 0, dw1: 0, sqhd: 0, sqid: 0, cid, status: NvmeStatus::SUCCESS, phase: false };
        let data = cmd.data();
        let _ = cmd.tx.send(Ok((cqe, data)));
    }
    Ok(())
}

/// The controller asks for a write's data: H2CData PDUs of at most MAXH2CDATA each.
fn r2t(
    state: &QueueState,
    r: R2t,
    raw: &Bytes,
    frames: &mpsc::WeakUnboundedSender<Option<Bytes>>,
) -> Result<(), Violation> {
    let seq = |why: String| out_of_sequence(why, raw);
    let cid = r.cccid;
    let mut s = state.slots.lock();
    let cmd =
        s.get_mut(cid).ok_or_else(|| seq(format!("an R2T for command {cid}, which is not in flight")))?;
    let len = cmd.out.len() as u64;
    let end = r.r2to as u64 + r.r2tl as u64;
    // In order, one R2T at a time (MAXR2T 0), all within the data.
    if r.r2tl == 0 || r.r2to != cmd.asked || end > len {
        let why = format!(
            "an R2T for command {cid} asks for {}+{} of {len} bytes ({} asked before)",
            r.r2to, r.r2tl, cmd.asked
        );
        return Err(fatal(why, fes::DATA_OUT_OF_RANGE, 12, raw));
    }
    cmd.asked = end as u32;
    let mut out = Vec::with_capacity(r.r2tl as usize + 64);
    let step = state.maxh2cdata as u64;
    let mut at = r.r2to as u64;
    while at < end {
        let n = (end - at).min(step);
        let last = if at + n == end { flag::LAST_PDU } else { 0 };
        let h = DataHeader { cccid: cid, ttag: r.ttag, datao: at as u32, datal: n as u32 };
        let data = &cmd.out[at as usize..(at + n) as usize];
        pdu::encode(&Header::H2cData(h), last, data, state.digests, 0, &mut out);
        at += n;
    }
    drop(s);
    if let Some(tx) = frames.upgrade() {
        let _ = tx.send(Some(out.into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastsan_nvme::command::sgl::{DATA_BLOCK_OFFSET, TRANSPORT_DATA_BLOCK};
    use fastsan_nvme::pdu::{IcResp, Pdu};
    use std::collections::VecDeque;
    use tokio::net::TcpListener;

    const NQN: &str = "nqn.2024-01.io.fastsan:test";
    const CNTLID: u16 = 7;

    #[test]
    fn urls() {
        let u = NvmeUrl::parse("nvme+tcp://10.0.0.1/nqn.2024-01.io.fastsan:vol0").unwrap();
        let want = NvmeUrl {
            addr: "10.0.0.1:4420".into(),
            subnqn: "nqn.2024-01.io.fastsan:vol0".into(),
            nsid: 1,
            hdgst: None,
            ddgst: None,
            hostnqn: None,
        };
        assert_eq!(u, want);
        let u = NvmeUrl::parse(
            "nvme+tcp://h:4421/nqn.x:y/3?hdgst=1&ddgst=0&hostnqn=nqn.2014-08.org.nvmexpress:uuid:1",
        )
        .unwrap();
        assert_eq!((u.addr.as_str(), u.subnqn.as_str(), u.nsid), ("h:4421", "nqn.x:y", 3));
        assert_eq!((u.hdgst, u.ddgst), (Some(true), Some(false)));
        assert_eq!(u.hostnqn.as_deref(), Some("nqn.2014-08.org.nvmexpress:uuid:1"));
        assert_eq!(NvmeUrl::parse("nvme+tcp://[::1]/n").unwrap().addr, "[::1]:4420");
        assert_eq!(NvmeUrl::parse("nvme+tcp://[fe80::1]:9/n/2").unwrap().addr, "[fe80::1]:9");
        for (url, why) in [
            ("nbd://h/x", "expected nvme+tcp://"),
            ("nvme+tcp://h", "subsystem NQN: missing"),
            ("nvme+tcp://h/", "subsystem NQN: missing"),
            ("nvme+tcp:///nqn.x", "no host"),
            ("nvme+tcp://h:port/nqn.x", "bad port \"port\""),
            ("nvme+tcp://h:0/nqn.x", "bad port"),
            ("nvme+tcp://::1/nqn.x", "in brackets"),
            ("nvme+tcp://[::1/nqn.x", "closing ]"),
            ("nvme+tcp://h/nqn.x/0", "namespace \"0\""),
            ("nvme+tcp://h/nqn.x/ns1", "namespace \"ns1\""),
            ("nvme+tcp://h/nqn.x/", "namespace \"\""),
            ("nvme+tcp://h/nqn.x?hdgst=2", "hdgst=2: expected 0 or 1"),
            ("nvme+tcp://h/nqn.x?digest=1", "unknown parameter \"digest\""),
            ("nvme+tcp://h/nqn.x?hostnqn=", "host NQN: missing"),
        ] {
            let e = NvmeUrl::parse(url).unwrap_err();
            assert!(matches!(e, Error::Url(_)), "{url}: {e:?}");
            assert!(e.to_string().contains(why), "{url}: {e}");
        }
        let long = format!("nvme+tcp://h/{}", "n".repeat(224));
        assert!(NvmeUrl::parse(&long).unwrap_err().to_string().contains("the limit is 223"));
    }

    #[test]
    fn status_messages_name_the_common_codes() {
        let e = Error::Nvme { command: "Read", sct: 0, sc: 0x80, dnr: true };
        assert_eq!(e.to_string(), "NVMe Read failed: LBA out of range (status type 0x0, code 0x80)");
        assert!(!e.is_retryable());
        assert!(Error::Nvme { command: "Read", sct: 0, sc: 0x82, dnr: false }.is_retryable());
        let text = |c, sct, sc| status_text(c, sct, sc);
        assert!(text("Write", 1, 0x82).starts_with("write to a read-only namespace"));
        assert!(text("Connect", 1, 0x82).starts_with("invalid Connect parameters"));
        assert!(text("Write", 0, 0x02).starts_with("invalid field in command"));
        assert!(text("Identify", 0, 0x0b).starts_with("invalid namespace"));
        assert!(text("Write", 2, 0x86).starts_with("access denied"));
        assert!(text("Write", 2, 0x80).starts_with("write fault"));
        assert_eq!(text("Read", 3, 0x01), "status (status type 0x3, code 0x01)");
    }

    /// How the fake controller misbehaves when asked to read.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Misbehave {
        None,
        TermReqOnRead,
        UnknownCidOnRead,
        BadDigestOnRead,
        SilentOnRead,
        /// ICResp agrees to no digests, whatever was asked.
        NoDigests,
    }

    /// A scripted NVMe/TCP controller with one namespace in memory: enough
    /// of the protocol to check the host's framing, with asserts on what
    /// the host sends.
    struct Fake {
        mdts: u8,
        /// In 16-byte units: the in-capsule limit is this * 16 - 64.
        ioccsz: u32,
        maxh2cdata: u32,
        /// Read data goes back in C2HData PDUs of this size...
        c2h_piece: usize,
        /// ... the last with SUCCESS instead of a CapsuleResp.
        c2h_success: bool,
        /// Write data is asked for in R2Ts of this size.
        r2t_piece: u32,
        /// I/O queues granted at most.
        grant: u32,
        misbehave: Misbehave,
        disk: Mutex<Vec<u8>>,
        /// What the host asked for, one line a command.
        log: Mutex<Vec<String>>,
        cc: Mutex<u32>,
    }

    const LBADS: u32 = 9;
    const BLOCKS: u64 = 2048;

    impl Default for Fake {
        fn default() -> Fake {
            Fake {
                mdts: 0,
                ioccsz: (8192 + 64) / 16,
                maxh2cdata: 16384,
                c2h_piece: 16384,
                c2h_success: false,
                r2t_piece: 32768,
                grant: 64,
                misbehave: Misbehave::None,
                disk: Mutex::new(vec![0; (BLOCKS << LBADS) as usize]),
                log: Mutex::default(),
                cc: Mutex::new(0),
            }
        }
    }

    struct Wire {
        s: TcpStream,
        buf: BytesMut,
        d: Digests,
    }

    impl Wire {
        async fn next(&mut self) -> Option<(Pdu, Bytes)> {
            loop {
                if let Some((p, used)) =
                    pdu::parse(&self.buf, self.d, 1 << 24).expect("the host sends valid PDUs")
                {
                    return Some((p, self.buf.split_to(used).freeze()));
                }
                if self.s.read_buf(&mut self.buf).await.ok()? == 0 {
                    return None;
                }
            }
        }

        async fn send(&mut self, h: Header, flags: u8, data: &[u8]) {
            let mut out = Vec::new();
            pdu::encode(&h, flags, data, self.d, 0, &mut out);
            let _ = self.s.write_all(&out).await;
        }

        async fn resp(&mut self, cid: u16, (sct, sc): (u8, u8), dw0: u32, dw1: u32) {
            let status = NvmeStatus { sct, sc, dnr: sct != 0 || sc != 0 };
            let cqe = Cqe { dw0, dw1, sqhd: 0, sqid: 0, cid, status, phase: false };
            self.send(Header::CapsuleResp(cqe), 0, &[]).await;
        }
    }

    fn cstr(b: &[u8]) -> String {
        String::from_utf8_lossy(&b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]).into_owned()
    }

    async fn serve(fake: Fake) -> (Arc<Fake>, String) {
        let fake = Arc::new(fake);
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let f = fake.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(f.clone().conn(s));
            }
        });
        (fake, addr)
    }

    impl Fake {
        fn log(&self, line: String) {
            self.log.lock().push(line);
        }

        fn logged(&self, prefix: &str) -> Vec<String> {
            self.log.lock().iter().filter(|l| l.starts_with(prefix)).cloned().collect()
        }

        async fn conn(self: Arc<Self>, s: TcpStream) {
            let mut w = Wire { s, buf: BytesMut::new(), d: Digests::default() };
            let Some((p, _)) = w.next().await else { return };
            let Header::IcReq(ic) = p.header else { panic!("{} before ICReq", p.header.name()) };
            assert_eq!((ic.pfv, ic.hpda, ic.maxr2t), (0, 0, 0));
            let digests =
                if self.misbehave == Misbehave::NoDigests { Digests::default() } else { ic.digests };
            let r = IcResp { pfv: 0, cpda: 0, digests, maxh2cdata: self.maxh2cdata };
            w.send(Header::IcResp(r), 0, &[]).await;
            w.d = ic.digests;
            // Commands that came while a write's data was awaited.
            let mut stash = VecDeque::new();
            let mut qid = None;
            loop {
                let (sqe, icd) = match stash.pop_front() {
                    Some(c) => c,
                    None => match w.next().await {
                        None => return,
                        Some((p, raw)) => {
                            let Header::CapsuleCmd(sqe) = p.header else { panic!("a {}", p.header.name()) };
                            assert!(p.data_digest_ok);
                            (sqe, raw.slice(p.data))
                        }
                    },
                };
                assert_eq!(sqe.flags & 0xc0, PSDT_SGL, "SGLs");
                if !self.command(&mut w, &mut qid, sqe, icd, &mut stash).await {
                    return;
                }
            }
        }

        /// Answers one command; false to drop the connection.
        async fn command(
            &self,
            w: &mut Wire,
            qid: &mut Option<u16>,
            sqe: Sqe,
            icd: Bytes,
            stash: &mut VecDeque<(Sqe, Bytes)>,
        ) -> bool {
            let (cid, desc) = (sqe.cid, sqe.sgl());
            if sqe.opcode != OPC_FABRICS {
                assert!(icd.is_empty() || desc.id == DATA_BLOCK_OFFSET);
                assert!(qid.is_some(), "a command before Connect");
            }
            match (sqe.opcode, sqe.fctype()) {
                (OPC_FABRICS, Some(fctype::CONNECT)) => {
                    assert_eq!(
                        (desc.id, desc.addr, desc.length, icd.len()),
                        (DATA_BLOCK_OFFSET, 0, 1024, 1024)
                    );
                    let q = (sqe.cdw10 >> 16) as u16;
                    assert_eq!(sqe.cdw10 & 0xffff, 0, "RECFMT");
                    let cntlid = u16::from_le_bytes([icd[16], icd[17]]);
                    let (subnqn, hostnqn) = (cstr(&icd[256..512]), cstr(&icd[512..768]));
                    self.log(format!(
                        "connect qid={q} sqsize={} cntlid={cntlid:#x} kato={} host={hostnqn}",
                        sqe.cdw11 & 0xffff,
                        sqe.cdw12
                    ));
                    if subnqn != NQN {
                        w.resp(cid, (1, 0x82), 0x1_0100, 0).await;
                    } else {
                        *qid = Some(q);
                        w.resp(cid, (0, 0), CNTLID as u32, 0).await;
                    }
                }
                (OPC_FABRICS, Some(fctype::PROPERTY_GET)) => {
                    assert_eq!((desc.id, desc.length), (TRANSPORT_DATA_BLOCK, 0));
                    let v: u64 = match (sqe.cdw11, sqe.cdw10 & 7) {
                        // MQES 1023, TO 1 (1 s).
                        (0x00, 1) => 1023 | 1 << 24 | 1 << 37,
                        (0x1c, 0) => (*self.cc.lock() & 1) as u64,
                        other => panic!("Property Get {other:?}"),
                    };
                    w.resp(cid, (0, 0), v as u32, (v >> 32) as u32).await;
                }
                (OPC_FABRICS, Some(fctype::PROPERTY_SET)) => {
                    assert_eq!((sqe.cdw10 & 7, sqe.cdw11), (0, 0x14), "a 4-byte CC");
                    *self.cc.lock() = sqe.cdw12;
                    self.log(format!("cc {:#x}", sqe.cdw12));
                    w.resp(cid, (0, 0), 0, 0).await;
                }
                (opc::IDENTIFY, _) => {
                    assert_eq!(*qid, Some(0));
                    assert_eq!((desc.id, desc.length), (TRANSPORT_DATA_BLOCK, 4096));
                    let mut page = vec![0u8; 4096];
                    match (sqe.cdw10 & 0xff, sqe.nsid) {
                        (1, _) => {
                            page[77] = self.mdts;
                            page[78..80].copy_from_slice(&CNTLID.to_le_bytes());
                            page[525] = 1;
                            page[536] = 1;
                            page[1792..1796].copy_from_slice(&self.ioccsz.to_le_bytes());
                            page[1796] = 1;
                        }
                        (0, 1) => {
                            for at in [0, 8, 16] {
                                page[at..at + 8].copy_from_slice(&BLOCKS.to_le_bytes());
                            }
                            page[130] = LBADS as u8;
                        }
                        // Another namespace: inactive, all zeros.
                        (0, _) => {}
                        other => panic!("Identify {other:?}"),
                    }
                    let h = DataHeader { cccid: cid, ttag: 0, datao: 0, datal: 4096 };
                    w.send(Header::C2hData(h), flag::LAST_PDU, &page).await;
                    w.resp(cid, (0, 0), 0, 0).await;
                }
                (opc::SET_FEATURES, _) => {
                    assert_eq!(sqe.cdw10 & 0xff, 7, "Number of Queues");
                    let (sq, cq) = (sqe.cdw11 & 0xffff, sqe.cdw11 >> 16);
                    assert_eq!(sq, cq);
                    let g = sq.min(self.grant - 1);
                    w.resp(cid, (0, 0), g | g << 16, 0).await;
                }
                (opc::READ | opc::WRITE, _) => {
                    assert_ne!(*qid, Some(0), "I/O on the admin queue");
                    assert_eq!(sqe.nsid, 1);
                    let slba = sqe.cdw10 as u64 | (sqe.cdw11 as u64) << 32;
                    let len = (((sqe.cdw12 & 0xffff) as u64 + 1) << LBADS) as usize;
                    let fua = sqe.cdw12 & 1 << 30 != 0;
                    let at = (slba << LBADS) as usize;
                    let write = sqe.opcode == opc::WRITE;
                    self.log(format!("{} {at}+{len} fua={fua}", if write { "write" } else { "read" }));
                    assert_eq!(desc.length as usize, len);
                    let fits = slba + (len as u64 >> LBADS) <= BLOCKS;
                    if !write {
                        assert_eq!(desc.id, TRANSPORT_DATA_BLOCK);
                        return self.read(w, cid, at, len, fits).await;
                    }
                    if !fits {
                        w.resp(cid, (0, 0x80), 0, 0).await;
                        return true;
                    }
                    let data = if desc.id == DATA_BLOCK_OFFSET {
                        assert_eq!(icd.len(), len);
                        icd.to_vec()
                    } else {
                        assert_eq!((desc.id, icd.len()), (TRANSPORT_DATA_BLOCK, 0));
                        let Some(d) = self.collect(w, cid, len, stash).await else { return false };
                        d
                    };
                    self.disk.lock()[at..at + len].copy_from_slice(&data);
                    w.resp(cid, (0, 0), 0, 0).await;
                }
                (opc::FLUSH, _) => {
                    assert_eq!((sqe.nsid, desc.id, desc.length), (1, TRANSPORT_DATA_BLOCK, 0));
                    self.log("flush".into());
                    w.resp(cid, (0, 0), 0, 0).await;
                }
                other => panic!("unexpected command {other:?}"),
            }
            true
        }

        async fn read(&self, w: &mut Wire, cid: u16, at: usize, len: usize, fits: bool) -> bool {
            if !fits {
                w.resp(cid, (0, 0x80), 0, 0).await;
                return true;
            }
            let data = self.disk.lock()[at..at + len].to_vec();
            match self.misbehave {
                Misbehave::TermReqOnRead => {
                    let t = TermReq { fes: fes::PDU_SEQUENCE_ERROR, fei: 0 };
                    w.send(Header::C2hTermReq(t), 0, &[0; 24]).await;
                    return false;
                }
                Misbehave::UnknownCidOnRead => {
                    w.resp(cid.wrapping_add(1000), (0, 0), 0, 0).await;
                    return true;
                }
                Misbehave::BadDigestOnRead => {
                    let h = DataHeader { cccid: cid, ttag: 0, datao: 0, datal: len as u32 };
                    let mut out = Vec::new();
                    pdu::encode(&Header::C2hData(h), flag::LAST_PDU, &data, w.d, 0, &mut out);
                    let n = out.len();
                    out[n - 5] ^= 1;
                    let _ = w.s.write_all(&out).await;
                    return true;
                }
                Misbehave::SilentOnRead => return true,
                Misbehave::None | Misbehave::NoDigests => {}
            }
            let mut off = 0;
            while off < len {
                let n = self.c2h_piece.min(len - off);
                let last = off + n == len;
                let flags = match (last, self.c2h_success) {
                    (true, true) => flag::LAST_PDU | flag::SUCCESS,
                    (true, false) => flag::LAST_PDU,
                    _ => 0,
                };
                let h = DataHeader { cccid: cid, ttag: 0, datao: off as u32, datal: n as u32 };
                w.send(Header::C2hData(h), flags, &data[off..off + n]).await;
                off += n;
            }
            if !self.c2h_success {
                w.resp(cid, (0, 0), 0, 0).await;
            }
            true
        }

        /// A write's data, asked for with R2Ts of `r2t_piece` bytes, each
        /// answered with H2CData PDUs; commands arriving meanwhile are stashed.
        async fn collect(
            &self,
            w: &mut Wire,
            cid: u16,
            len: usize,
            stash: &mut VecDeque<(Sqe, Bytes)>,
        ) -> Option<Vec<u8>> {
            let mut data = Vec::with_capacity(len);
            let ttag = cid ^ 0x5a5a;
            while data.len() < len {
                let r2to = data.len() as u32;
                let r2tl = self.r2t_piece.min((len - data.len()) as u32);
                w.send(Header::R2t(R2t { cccid: cid, ttag, r2to, r2tl }), 0, &[]).await;
                self.log(format!("r2t {r2to}+{r2tl}"));
                let end = data.len() + r2tl as usize;
                loop {
                    let (p, raw) = w.next().await?;
                    match p.header {
                        Header::CapsuleCmd(sqe) => stash.push_back((sqe, raw.slice(p.data))),
                        Header::H2cData(d) => {
                            assert!(p.data_digest_ok);
                            assert_eq!((d.cccid, d.ttag, d.datao as usize), (cid, ttag, data.len()));
                            assert!(d.datal > 0 && d.datal <= self.maxh2cdata, "DATAL {}", d.datal);
                            data.extend_from_slice(&raw[p.data]);
                            let last = p.flags & flag::LAST_PDU != 0;
                            assert_eq!(last, data.len() == end, "LAST_PDU on the R2T's last PDU only");
                            if last {
                                break;
                            }
                        }
                        h => panic!("a {} while waiting for H2CData", h.name()),
                    }
                }
            }
            Some(data)
        }
    }

    fn opts() -> Options {
        Options {
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            ..Default::default()
        }
    }

    /// The host NQN of the admin Connect.
    fn host(fake: &Fake) -> String {
        fake.logged("connect qid=0")[0].split(" host=").nth(1).unwrap().to_owned()
    }

    fn pattern(seed: u64, len: usize) -> Bytes {
        (0..len).map(|i| ((i as u64 * 31 + seed * 7) >> 3) as u8).collect::<Vec<u8>>().into()
    }

    #[tokio::test]
    async fn reads_and_writes_reach_a_fake_controller() {
        for digests in [false, true] {
            let fake = Fake { c2h_success: digests, ..Default::default() };
            let (fake, addr) = serve(fake).await;
            let d = digests as u8;
            let url = format!("nvme+tcp://{addr}/{NQN}?hdgst={d}&ddgst={d}");
            let v = NvmeVolume::connect(&url, &opts(), 2).await.unwrap();
            assert_eq!(
                (v.size(), v.block_size(), v.queues(), v.controller_id()),
                (BLOCKS << 9, 512, 2, CNTLID)
            );
            assert_eq!((v.in_capsule_limit(), v.max_transfer(), v.read_only()), (8192, 4 << 20, false));
            assert!(v.volatile_cache() && v.connected());

            // In the capsule; then by R2T (64 KiB > 8 KiB): two R2Ts of 32 KiB,
            // each answered by two 16 KiB H2CData PDUs.
            let small = pattern(1, 4096);
            v.write_bytes_on(0, small.clone(), 0, false).await.unwrap();
            let big = pattern(2, 65536);
            v.write_bytes_on(1, big.clone(), 8192, true).await.unwrap();
            assert_eq!(fake.logged("r2t"), ["r2t 0+32768", "r2t 32768+32768"]);
            assert_eq!(v.read_on(1, 0, 4096).await.unwrap(), small);
            assert_eq!(v.read_on(0, 8192, 65536).await.unwrap(), big, "four C2HData PDUs");
            let all = v.read(0, 8192 + 65536).await.unwrap();
            assert_eq!(
                (&all[..4096], &all[4096..8192], &all[8192..]),
                (&small[..], &[0u8; 4096][..], &big[..])
            );
            v.flush().await.unwrap();

            // Many at once on one queue: completions out of order, writes'
            // data interleaved with other commands.
            let writes = (0..16u64).map(|i| {
                let v = &v;
                async move {
                    let len = if i % 2 == 0 { 4096 } else { 12288 };
                    v.write_bytes_on(0, pattern(i + 10, len), 131072 + i * 16384, false).await
                }
            });
            for r in futures::future::join_all(writes).await {
                r.unwrap();
            }
            let reads =
                (0..16u64).map(|i| v.read_on(0, 131072 + i * 16384, if i % 2 == 0 { 4096 } else { 12288 }));
            for (i, r) in futures::future::join_all(reads).await.into_iter().enumerate() {
                let len = if i % 2 == 0 { 4096 } else { 12288 };
                assert_eq!(r.unwrap(), pattern(i as u64 + 10, len), "block {i}");
            }

            let connects = fake.logged("connect");
            assert_eq!(connects.len(), 3);
            let host = host(&fake);
            assert!(host.starts_with("nqn.2014-08.org.nvmexpress:uuid:"), "{host}");
            assert_eq!(connects[0], format!("connect qid=0 sqsize=31 cntlid=0xffff kato=0 host={host}"));
            let mut io: Vec<_> = connects[1..].to_vec();
            io.sort();
            assert_eq!(
                io,
                [1, 2].map(|q| format!("connect qid={q} sqsize=127 cntlid=0x7 kato=0 host={host}"))
            );
            assert_eq!(fake.logged("cc"), ["cc 0x460001"]);
            assert_eq!(fake.logged("write 8192"), ["write 8192+65536 fua=true"]);
            assert_eq!(fake.logged("flush").len(), 1);
            // An empty write is done without a command (a Write's block count cannot say 0).
            v.write_bytes(Bytes::new(), 4096, false).await.unwrap();
            assert_eq!(fake.logged("write").len(), 18, "2 + 16 writes above, none for the empty one");
        }
    }

    #[tokio::test]
    async fn requests_above_mdts_are_split() {
        // MDTS 1: 8 KiB per command; IOCCSZ 4: nothing in the capsule.
        let (fake, addr) = serve(Fake { mdts: 1, ioccsz: 4, ..Default::default() }).await;
        // A queue of 4 entries (3 in flight) for 5 pieces: some wait for a free identifier.
        let v = NvmeVolume::connect_with(&format!("nvme+tcp://{addr}/{NQN}/1"), &opts(), 1, 3).await.unwrap();
        assert_eq!((v.max_transfer(), v.in_capsule_limit()), (8192, 0));
        let data = pattern(3, 40960);
        v.write_bytes(data.clone(), 4096, false).await.unwrap();
        assert_eq!(v.read(4096, 40960).await.unwrap(), data);
        let mut writes = fake.logged("write");
        writes.sort();
        let mut want = [4096, 12288, 20480, 28672, 36864].map(|at| format!("write {at}+8192 fua=false"));
        want.sort();
        assert_eq!(writes, want);
        assert_eq!(fake.logged("read").len(), 5);
        assert_eq!(fake.logged("r2t").len(), 5, "an R2T for every piece");
        assert_eq!(
            fake.logged("connect qid=1"),
            [format!("connect qid=1 sqsize=3 cntlid=0x7 kato=0 host={}", host(&fake))]
        );
    }

    #[tokio::test]
    async fn refusals_and_error_statuses_are_clear() {
        let (_fake, addr) = serve(Fake { grant: 2, ..Default::default() }).await;
        let v = NvmeVolume::connect(&format!("nvme+tcp://{addr}/{NQN}"), &opts(), 4).await.unwrap();
        assert_eq!(v.queues(), 2, "the controller granted two I/O queues");
        let e = v.read(BLOCKS << 9, 4096).await.unwrap_err();
        assert!(matches!(e, Error::Nvme { command: "Read", sct: 0, sc: 0x80, dnr: true }), "{e:?}");
        assert!(e.to_string().contains("LBA out of range"), "{e}");
        let e = v.write_at(&[1; 8192], (BLOCKS - 1) << 9, false).await.unwrap_err();
        assert!(matches!(e, Error::Nvme { command: "Write", sc: 0x80, .. }), "{e:?}");
        let e = v.read(100, 512).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(v.connected(), "an error status leaves the connection up");
        assert_eq!(v.read(0, 512).await.unwrap().len(), 512);

        let e =
            NvmeVolume::connect(&format!("nvme+tcp://{addr}/nqn.x:other"), &opts(), 1).await.err().unwrap();
        assert!(matches!(&e, Error::Refused { status, .. } if *status == Status::NO_SUCH_VOLUME), "{e:?}");
        assert!(e.to_string().contains("no NVMe subsystem \"nqn.x:other\""), "{e}");
        let e = NvmeVolume::connect(&format!("nvme+tcp://{addr}/{NQN}/2"), &opts(), 1).await.err().unwrap();
        assert!(e.to_string().contains("no active namespace 2"), "{e}");
        let e = NvmeVolume::connect(&format!("nvme+tcp://{addr}/{NQN}"), &opts(), 0).await.err().unwrap();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let e =
            NvmeVolume::connect_with(&format!("nvme+tcp://{addr}/{NQN}"), &opts(), 1, 0).await.err().unwrap();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }

    #[tokio::test]
    async fn a_protocol_violation_cuts_the_connection() {
        for (misbehave, why) in [
            (Misbehave::TermReqOnRead, "C2HTermReq): PDU sequence error"),
            (Misbehave::UnknownCidOnRead, "not in flight"),
            (Misbehave::BadDigestOnRead, "data digest mismatch"),
        ] {
            let (_fake, addr) = serve(Fake { misbehave, ..Default::default() }).await;
            let url = format!("nvme+tcp://{addr}/{NQN}?ddgst=1");
            let v = NvmeVolume::connect(&url, &opts(), 1).await.unwrap();
            v.write_at(&[5; 4096], 0, false).await.unwrap();
            let e = v.read(0, 4096).await.unwrap_err();
            assert!(matches!(&e, Error::NvmeTcp(m) if m.contains(why)), "{misbehave:?}: {e:?}");
            assert!(!v.io[0].connected(), "{misbehave:?}");
            // Commands after it say what ended the connection.
            let e = v.read(0, 4096).await.unwrap_err();
            assert!(
                matches!(&e, Error::Lost(m) if m.starts_with("the controller broke the protocol") && m.contains(why)),
                "{misbehave:?}: {e:?}"
            );
        }
        let (_fake, addr) = serve(Fake { misbehave: Misbehave::NoDigests, ..Default::default() }).await;
        let e =
            NvmeVolume::connect(&format!("nvme+tcp://{addr}/{NQN}?hdgst=1"), &opts(), 1).await.err().unwrap();
        assert!(matches!(&e, Error::NvmeTcp(m) if m.contains("digests")), "{e:?}");
    }

    #[tokio::test]
    async fn a_command_without_a_completion_cuts_the_connection() {
        let (_fake, addr) = serve(Fake { misbehave: Misbehave::SilentOnRead, ..Default::default() }).await;
        let o = Options { request_timeout: Duration::from_millis(300), ..opts() };
        let v = NvmeVolume::connect(&format!("nvme+tcp://{addr}/{NQN}"), &o, 1).await.unwrap();
        let both = async { tokio::join!(v.read(0, 4096), v.read(4096, 4096)) };
        let (a, b) = tokio::time::timeout(Duration::from_secs(10), both).await.expect("given up on in time");
        for r in [a, b] {
            let e = r.unwrap_err();
            assert_eq!(e.to_string(), "connection lost: no reply within the request timeout (300ms)");
            assert!(e.is_retryable());
        }
        for _ in 0..100 {
            if !v.connected() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!v.connected());
        let e = v.read(0, 4096).await.unwrap_err();
        assert_eq!(e.to_string(), "connection lost: no reply within the request timeout (300ms)");
    }

    #[tokio::test]
    async fn a_refused_connection_keeps_its_cause() {
        let e = NvmeVolume::connect("nvme+tcp://127.0.0.1:1/nqn.x", &opts(), 1).await.err().unwrap();
        assert!(
            matches!(&e, Error::Connect { source, .. } if source.kind() == io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
    }
}
