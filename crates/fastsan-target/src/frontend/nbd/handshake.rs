//! The target's side of the NBD handshake (fixed newstyle, `doc/proto.md`),
//! as a state machine: the greeting, the client's flags, then options until
//! EXPORT_NAME or a successful GO. No I/O: the driver feeds it bytes and
//! sends what it writes to `out`.
//!
//! TLS follows the spec's TLS section: STARTTLS is acknowledged and the
//! driver upgrades the stream ([`Step::StartTls`]; plaintext the client sent
//! after STARTTLS closes the connection); everything negotiated before it is
//! forgotten. When TLS is required (`--tls require`, or a target that
//! authenticates, unless `--nbd-insecure`), every option but STARTTLS and
//! ABORT is answered `ERR_TLS_REQD`, and EXPORT_NAME closes (FORCEDTLS).
//! Every export is checked against the client's grants
//! ([`Access::mode_for`]): LIST shows what it may open, INFO, GO and the
//! meta-context options answer the rest as exports that are not there
//! (`ERR_UNKNOWN`, the same words: no name can be learnt by trying it; the
//! log says which), and a read-only grant exports it read-only. Such
//! refusals, and policy ones, end the handshake after eight (`MAX_DENIED`).

use super::{tflags, NbdConn, ALLOCATION_CONTEXT};
use crate::access::{Access, Mode, Who};
use crate::catalog::Catalog;
use crate::frontend::{Handshake, Step, WireError, OUT_CAP};
use crate::tls::TlsMode;
use crate::volume::Volume;
use bytes::{Buf, BytesMut};
use fastsan_nbd::consts::*;
use fastsan_nbd::handshake::{self as hs, InfoRequest, MetaContextRequest, OptionRequest};
use fastsan_nbd::{ProtocolError, MAX_PAYLOAD};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
}

pub struct NbdHandshake {
    catalog: Arc<Catalog>,
    access: Arc<Access>,
    who: Who,
    state: State,
    no_zeroes: bool,
    structured: bool,
    /// The export for which `base:allocation` is selected, if any.
    selected: Option<String>,
    /// INFOs and GOs refused by the access rules so far.
    denied: u32,
}

/// A client refused this many INFOs and GOs is closed: it is probing, not negotiating.
const MAX_DENIED: u32 = 8;

impl NbdHandshake {
    pub fn new(catalog: Arc<Catalog>, access: Arc<Access>, who: Who) -> Self {
        NbdHandshake {
            catalog,
            access,
            who,
            state: State::ClientFlags,
            no_zeroes: false,
            structured: false,
            selected: None,
            denied: 0,
        }
    }

    fn conn(&self, volume: &Arc<Volume>, name: &str, mode: Mode) -> NbdConn {
        let allocation_context = self.selected.as_deref() == Some(name);
        NbdConn::new(volume.clone(), self.structured, allocation_context, mode == Mode::ReadOnly)
    }

    /// Options other than STARTTLS and ABORT wait for TLS.
    fn tls_required(&self) -> bool {
        if self.who.tls {
            return false;
        }
        let forced = self.access.tls.as_ref().is_some_and(|t| t.mode == TlsMode::Require);
        forced || (self.access.authenticates() && !self.access.nbd_insecure)
    }

    /// How this client may use the volume behind `name` (a volume's own
    /// name, or "" for the only one), or why not.
    fn mode(&self, volume: &Volume) -> Result<Mode, String> {
        self.access.mode_for(&self.who, volume.name(), self.access.nbd_insecure)
    }

    fn on_option(&mut self, opt: OptionRequest, out: &mut Vec<u8>) -> Step<NbdConn> {
        let o = opt.option;
        let err = |out: &mut Vec<u8>, code: u32, msg: &str| hs::encode_reply(o, code, msg.as_bytes(), out);
        if self.tls_required() && o != OPT_STARTTLS && o != OPT_ABORT {
            if o == OPT_EXPORT_NAME {
                return Step::Refused("EXPORT_NAME before TLS, which this target requires".into());
            }
            err(out, REP_ERR_TLS_REQD, "this server requires TLS: send STARTTLS first");
            return Step::Continue;
        }
        match o {
            OPT_EXPORT_NAME => {
                let Ok(name) = hs::parse_export_name(&opt.data) else {
                    return Step::Refused("malformed export name".into());
                };
                // No error reply exists for EXPORT_NAME: an unknown export ends the session.
                let Some(volume) = self.catalog.export(&name).cloned() else {
                    return Step::Refused(format!("unknown export {name:?}"));
                };
                let mode = match self.mode(&volume) {
                    Ok(m) => m,
                    Err(why) => return Step::Refused(why),
                };
                let flags = tflags(&volume, self.structured, mode == Mode::ReadOnly);
                out.extend_from_slice(&hs::export_name_reply(volume.size(), flags, self.no_zeroes));
                return Step::Done(self.conn(&volume, &name, mode));
            }
            OPT_STARTTLS if !opt.data.is_empty() => err(out, REP_ERR_INVALID, "STARTTLS takes no data"),
            OPT_STARTTLS if self.who.tls => err(out, REP_ERR_INVALID, "TLS is already on"),
            OPT_STARTTLS if !self.access.tls.as_ref().is_some_and(|t| t.mode != TlsMode::Off) => {
                err(out, REP_ERR_UNSUP, "this server has no TLS configured")
            }
            OPT_STARTTLS => {
                hs::encode_reply(o, REP_ACK, &[], out);
                return Step::StartTls { replay: false };
            }
            OPT_ABORT => {
                hs::encode_reply(o, REP_ACK, &[], out);
                return Step::Abort;
            }
            OPT_LIST if !opt.data.is_empty() => err(out, REP_ERR_INVALID, "LIST takes no data"),
            OPT_LIST => {
                for v in self.catalog.iter().filter(|v| self.mode(v).is_ok()) {
                    hs::encode_reply(o, REP_SERVER, &hs::rep_server(v.name(), v.describe()), out);
                }
                hs::encode_reply(o, REP_ACK, &[], out);
            }
            OPT_INFO | OPT_GO => match InfoRequest::parse(&opt.data) {
                Err(e) => err(out, REP_ERR_INVALID, &e.to_string()),
                Ok(req) => match self.granted(&req.name) {
                    Err(why) => {
                        err(out, REP_ERR_UNKNOWN, &why);
                        self.denied += 1;
                        if self.denied >= MAX_DENIED {
                            return Step::Refused(format!("{why} ({MAX_DENIED} times)"));
                        }
                    }
                    Ok((volume, mode)) => {
                        info_replies(o, &volume, &req, self.structured, mode == Mode::ReadOnly, out);
                        hs::encode_reply(o, REP_ACK, &[], out);
                        if o == OPT_GO {
                            return Step::Done(self.conn(&volume, &req.name, mode));
                        }
                    }
                },
            },
            OPT_STRUCTURED_REPLY if !opt.data.is_empty() => {
                err(out, REP_ERR_INVALID, "STRUCTURED_REPLY takes no data")
            }
            OPT_STRUCTURED_REPLY if self.structured => err(out, REP_ERR_INVALID, "already negotiated"),
            OPT_STRUCTURED_REPLY => {
                self.structured = true;
                hs::encode_reply(o, REP_ACK, &[], out);
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = o == OPT_SET_META_CONTEXT;
                if set {
                    // Every SET replaces the selection, even when it fails.
                    self.selected = None;
                }
                match self.meta_context(&opt, set) {
                    Err((code, msg)) => {
                        err(out, code, &msg);
                        if code == REP_ERR_UNKNOWN {
                            self.denied += 1;
                            if self.denied >= MAX_DENIED {
                                return Step::Refused(format!("{msg} ({MAX_DENIED} times)"));
                            }
                        }
                    }
                    Ok((export, matched)) => {
                        if matched {
                            let id = if set { ALLOCATION_CONTEXT } else { 0 };
                            let body = hs::rep_meta_context(id, CONTEXT_BASE_ALLOCATION);
                            hs::encode_reply(o, REP_META_CONTEXT, &body, out);
                            if set {
                                self.selected = Some(export);
                            }
                        }
                        hs::encode_reply(o, REP_ACK, &[], out);
                    }
                }
            }
            _ => err(out, REP_ERR_UNSUP, "unsupported option"),
        }
        Step::Continue
    }

    /// The export `name` and how this client may open it; the same words
    /// whether it is missing or not granted (the log says which).
    fn granted(&self, name: &str) -> Result<(std::sync::Arc<crate::volume::Volume>, Mode), String> {
        let missing = || format!("no export named {name:?} that this client may open");
        let volume = self.catalog.export(name).cloned().ok_or_else(missing)?;
        match self.mode(&volume) {
            Ok(mode) => Ok((volume, mode)),
            Err(why) => {
                let peer = self.who.ip.map_or_else(|| "unix".to_owned(), |ip| ip.to_string());
                tracing::info!(%peer, who = self.who.name(), export = volume.name(), "NBD access refused: {why}");
                Err(missing())
            }
        }
    }

    /// LIST/SET_META_CONTEXT: whether `base:allocation` is matched, for which export.
    fn meta_context(&self, opt: &OptionRequest, set: bool) -> Result<(String, bool), (u32, String)> {
        if set && !self.structured {
            return Err((REP_ERR_INVALID, "SET_META_CONTEXT needs structured replies".into()));
        }
        let req = MetaContextRequest::parse(&opt.data).map_err(|e| (REP_ERR_INVALID, e.to_string()))?;
        self.granted(&req.name).map_err(|why| (REP_ERR_UNKNOWN, why))?;
        let matched = if req.queries.is_empty() {
            // LIST with no query lists every context; SET with none selects nothing.
            !set
        } else {
            req.queries.iter().any(|q| q == CONTEXT_BASE_ALLOCATION || (!set && q == "base:"))
        };
        Ok((req.name, matched))
    }
}

/// NBD_REP_INFO replies for INFO and GO: always the export's size, flags and
/// block sizes; its name and description when asked.
fn info_replies(o: u32, v: &Volume, req: &InfoRequest, structured: bool, read_only: bool, out: &mut Vec<u8>) {
    hs::encode_reply(o, REP_INFO, &hs::info_export(v.size(), tflags(v, structured, read_only)), out);
    let b = v.block_sizes();
    let min = b.minimum.max(1);
    let max = MAX_PAYLOAD.min(b.maximum);
    hs::encode_reply(o, REP_INFO, &hs::info_block_size(min, b.preferred.max(min), max), out);
    if req.infos.contains(&INFO_NAME) {
        hs::encode_reply(o, REP_INFO, &hs::info_text(INFO_NAME, v.name()), out);
    }
    if req.infos.contains(&INFO_DESCRIPTION) {
        hs::encode_reply(o, REP_INFO, &hs::info_text(INFO_DESCRIPTION, v.describe()), out);
    }
}

impl Handshake for NbdHandshake {
    type Conn = NbdConn;

    fn tls_started(&mut self, identity: Option<String>) {
        self.who.tls = true;
        self.who.identity = identity;
        // What was negotiated in plaintext is forgotten (the spec: the
        // client negotiates again over TLS).
        self.structured = false;
        self.selected = None;
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        out.extend_from_slice(&hs::greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    }

    fn advance(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<Step<NbdConn>, WireError> {
        while out.len() < OUT_CAP {
            match self.state {
                State::ClientFlags => {
                    if input.len() < 4 {
                        return Ok(Step::Continue);
                    }
                    let flags = input.get_u32();
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        return Ok(Step::Refused(format!("unknown client flags {flags:#x}")));
                    }
                    self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    self.state = State::Options;
                }
                State::Options => match hs::parse_option(input) {
                    Ok(Some((opt, n))) => {
                        input.advance(n);
                        match self.on_option(opt, out) {
                            Step::Continue => {}
                            step => return Ok(step),
                        }
                    }
                    Ok(None) => return Ok(Step::Continue),
                    Err(ProtocolError::OptionTooLarge { option, len, .. }) => {
                        hs::encode_reply(option, REP_ERR_TOO_BIG, b"option payload too large", out);
                        return Ok(Step::Refused(format!("option {option} of {len} bytes")));
                    }
                    Err(e) => return Err(e.into()),
                },
            }
        }
        Ok(Step::Continue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, MemoryBackend, ReadOnlyLayer};
    use crate::frontend::Transmission;

    fn catalog() -> Arc<Catalog> {
        let mut c = Catalog::default();
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
        c.add(Volume::with_backend("v".into(), b.clone(), 1 << 16));
        c.add(Volume::with_backend("ro".into(), Arc::new(ReadOnlyLayer::new(b)), 1 << 16));
        Arc::new(c)
    }

    /// A client's bytes: flags, then options.
    fn client(opts: &[(u32, Vec<u8>)]) -> BytesMut {
        let mut v = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
        for (o, d) in opts {
            hs::encode_option(*o, d, &mut v);
        }
        BytesMut::from(&v[..])
    }

    /// The option replies in `out` after the 18-byte greeting: (option, type, data).
    fn replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut r = Vec::new();
        let mut at = 0;
        while at + 20 <= out.len() {
            let be = |i: usize| u32::from_be_bytes(out[i..i + 4].try_into().unwrap());
            let len = be(at + 16) as usize;
            r.push((be(at + 8), be(at + 12), out[at + 20..at + 20 + len].to_vec()));
            at += 20 + len;
        }
        assert_eq!(at, out.len());
        r
    }

    fn start() -> (NbdHandshake, Vec<u8>) {
        let mut h = NbdHandshake::new(catalog(), Default::default(), Who::default());
        let mut out = Vec::new();
        h.start(&mut out);
        assert_eq!(out.len(), 18);
        assert_eq!(out[..8], NBDMAGIC.to_be_bytes());
        out.clear();
        (h, out)
    }

    #[test]
    fn go_negotiates_and_flags_follow_capabilities() {
        let (mut h, mut out) = start();
        let go = |name: &str| InfoRequest { name: name.into(), infos: vec![INFO_NAME] }.encode();
        let mut input = client(&[(OPT_STRUCTURED_REPLY, vec![]), (0xdead, vec![]), (OPT_GO, go("ro"))]);
        let Step::Done(conn) = h.advance(&mut input, &mut out).unwrap() else { panic!() };
        let r = replies(&out);
        assert_eq!(r[0].1, REP_ACK);
        assert_eq!(r[1].1, REP_ERR_UNSUP, "unknown options are refused, the handshake goes on");
        let export = r.iter().find(|x| x.1 == REP_INFO && x.2[..2] == [0, 0]).unwrap();
        let flags = u16::from_be_bytes([export.2[10], export.2[11]]);
        assert_ne!(flags & TFLAG_READ_ONLY, 0);
        assert_eq!(flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO), 0);
        assert_ne!(flags & TFLAG_SEND_DF, 0, "structured replies were negotiated");
        assert_eq!(r.last().unwrap().1, REP_ACK);
        assert!(conn.describe().contains("structured replies true"));
    }

    #[test]
    fn export_name_abort_and_unknown_exports() {
        // An unknown export in INFO: ERR_UNKNOWN and the handshake goes on;
        // EXPORT_NAME of one ends it ("" names none: there are two volumes).
        let (mut h, mut out) = start();
        let info = InfoRequest { name: "nope".into(), infos: vec![] }.encode();
        let mut input = client(&[(OPT_INFO, info), (OPT_EXPORT_NAME, vec![])]);
        let step = h.advance(&mut input, &mut out).unwrap();
        assert_eq!(replies(&out)[0].1, REP_ERR_UNKNOWN);
        assert!(matches!(&step, Step::Refused(why) if why.contains("unknown export")), "{step:?}");
        // EXPORT_NAME of a volume: the short reply, size and flags, no zeroes.
        let (mut h, mut out) = start();
        let Step::Done(conn) = h.advance(&mut client(&[(OPT_EXPORT_NAME, b"v".to_vec())]), &mut out).unwrap()
        else {
            panic!()
        };
        assert_eq!(out.len(), 10);
        assert_eq!(u64::from_be_bytes(out[..8].try_into().unwrap()), 1 << 20);
        assert_eq!(conn.volumes()[0].name(), "v");
        // ABORT: acknowledged, then a polite close.
        let (mut h, mut out) = start();
        assert!(matches!(h.advance(&mut client(&[(OPT_ABORT, vec![])]), &mut out).unwrap(), Step::Abort));
        assert_eq!(replies(&out)[0].1, REP_ACK);
    }

    #[test]
    fn oversized_options_and_bad_flags_close_with_a_reason() {
        let (mut h, mut out) = start();
        let mut raw = client(&[]).to_vec();
        raw.extend(IHAVEOPT.to_be_bytes());
        raw.extend(OPT_GO.to_be_bytes());
        raw.extend((1u32 << 30).to_be_bytes());
        let step = h.advance(&mut BytesMut::from(&raw[..]), &mut out).unwrap();
        assert!(matches!(step, Step::Refused(_)));
        let r = replies(&out);
        assert_eq!((r[0].0, r[0].1), (OPT_GO, REP_ERR_TOO_BIG), "the error names the option");
        let (mut h, mut out) = start();
        let step = h.advance(&mut BytesMut::from(&0x80u32.to_be_bytes()[..]), &mut out).unwrap();
        assert!(matches!(&step, Step::Refused(why) if why.contains("client flags")));
        let (mut h, mut out) = start();
        let mut bad = client(&[]);
        bad.extend_from_slice(&[0xff; 16]);
        assert!(h.advance(&mut bad, &mut out).is_err(), "a bad option magic is a protocol error");
    }

    #[test]
    fn bytes_one_at_a_time_reach_the_same_end() {
        let (mut h, mut out) = start();
        let all = client(&[(OPT_LIST, vec![]), (OPT_EXPORT_NAME, b"v".to_vec())]);
        let mut input = BytesMut::new();
        for (i, b) in all.iter().enumerate() {
            input.extend_from_slice(&[*b]);
            match h.advance(&mut input, &mut out).unwrap() {
                Step::Continue => assert!(i + 1 < all.len()),
                Step::Done(_) => assert_eq!(i + 1, all.len()),
                other => panic!("{other:?}"),
            }
        }
        let names: Vec<_> =
            replies(&out[..out.len() - 10]).into_iter().filter(|r| r.1 == REP_SERVER).collect();
        assert_eq!(names.len(), 2, "LIST names both volumes");
    }
}
