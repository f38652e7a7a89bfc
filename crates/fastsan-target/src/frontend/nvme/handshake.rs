//! The NVMe/TCP handshake, sans-IO: ICReq -> ICResp (digests as the host
//! asks, no padding, MAXH2CDATA), then the Connect command -> its
//! completion. Connect on queue 0 makes a controller (the admin queue, or a
//! discovery controller); on queue N it joins the controller it names as
//! an I/O queue. Anything else before Connect is refused: a command with
//! Command Sequence Error, any other PDU with a C2HTermReq, then a close.

use super::{
    connect_field, term_req, ConnectArgs, ConnectRefusal, NvmeConn, Subsystem, ADMIN_IN_CAPSULE, MAX_H2C_DATA,
};
use crate::access::Who;
use crate::frontend::{Handshake, Step, WireError};
use bytes::BytesMut;
use fastsan_nvme::command::{fctype, sgl, status, Cqe, Status, OPC_FABRICS};
use fastsan_nvme::pdu::{self, fes, Digests, Header, IcResp, PFV};
use std::sync::Arc;

/// The Connect command's data: host id, controller id, subsystem and host NQNs.
const CONNECT_DATA: usize = 1024;

enum State {
    IcReq,
    Connect,
}

pub struct NvmeHandshake {
    sub: Arc<Subsystem>,
    who: Who,
    state: State,
    digests: Digests,
}

impl NvmeHandshake {
    pub fn new(sub: Arc<Subsystem>, who: Who) -> Self {
        NvmeHandshake { sub, who, state: State::IcReq, digests: Digests::default() }
    }

    /// Refuses the Connect command `cid` with `st`, then closes.
    fn refuse(&self, cid: u16, st: (u8, u8), why: String, out: &mut Vec<u8>) -> Step<NvmeConn> {
        self.refuse_at(cid, ConnectRefusal { status: st, at: 0, why }, out)
    }

    /// Refuses with the wrong field named in DW0 (see [`connect_field`]).
    fn refuse_at(&self, cid: u16, r: ConnectRefusal, out: &mut Vec<u8>) -> Step<NvmeConn> {
        let (st, dw0, why) = (r.status, r.at, r.why);
        let cqe = Cqe { dw0, dw1: 0, sqhd: 1, sqid: 0, cid, status: Status::fatal(st.0, st.1), phase: false };
        pdu::encode(&Header::CapsuleResp(cqe), 0, &[], self.digests, 0, out);
        Step::Refused(why)
    }
}

impl Handshake for NvmeHandshake {
    type Conn = NvmeConn;

    fn start(&mut self, _out: &mut Vec<u8>) {}

    fn advance(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<Step<NvmeConn>, WireError> {
        let (p, used) = match pdu::parse(input, self.digests, ADMIN_IN_CAPSULE) {
            Ok(Some(x)) => x,
            Ok(None) => return Ok(Step::Continue),
            Err(e) => {
                let (fes, fei) = e.fes();
                out.extend(term_req(fes, fei));
                return Ok(Step::Refused(format!("malformed PDU: {e}")));
            }
        };
        let frame = input.split_to(used).freeze();
        let data = frame.slice(p.data.clone());
        match (&self.state, p.header) {
            (State::IcReq, Header::IcReq(ic)) => {
                if ic.pfv != PFV {
                    out.extend(term_req(fes::INVALID_HEADER_FIELD, 8));
                    return Ok(Step::Refused(format!(
                        "PDU format version {} (this target speaks 0)",
                        ic.pfv
                    )));
                }
                // Data aligned for the host: the Linux host asks for none,
                // and the C2H data of this target is never padded.
                if ic.hpda != 0 {
                    out.extend(term_req(fes::INVALID_HEADER_FIELD, 10));
                    return Ok(Step::Refused(format!(
                        "host PDU data alignment {} (only 0 is served)",
                        ic.hpda
                    )));
                }
                self.digests = ic.digests;
                let resp = IcResp { pfv: PFV, cpda: 0, digests: ic.digests, maxh2cdata: MAX_H2C_DATA };
                pdu::encode(&Header::IcResp(resp), 0, &[], Digests::default(), 0, out);
                self.state = State::Connect;
                Ok(Step::Continue)
            }
            (State::Connect, Header::CapsuleCmd(sqe)) => {
                if sqe.opcode != OPC_FABRICS || sqe.fctype() != Some(fctype::CONNECT) {
                    let why = format!("command {:#04x} before Connect", sqe.opcode);
                    return Ok(self.refuse(sqe.cid, status::COMMAND_SEQUENCE_ERROR, why, out));
                }
                let d = sqe.sgl();
                if d.id != sgl::DATA_BLOCK_OFFSET || d.addr != 0 || d.length as usize != CONNECT_DATA {
                    let why = "Connect without its 1024 bytes of in-capsule data".to_owned();
                    return Ok(self.refuse(sqe.cid, status::SGL_INVALID_TYPE, why, out));
                }
                if data.len() != CONNECT_DATA || !p.data_digest_ok {
                    let why = "Connect data of the wrong length or with a bad digest".to_owned();
                    return Ok(self.refuse(sqe.cid, status::INVALID_FIELD, why, out));
                }
                if sqe.cdw10 & 0xffff != 0 {
                    let why = format!("Connect record format {}", sqe.cdw10 & 0xffff);
                    let (status, at) = (status::CONNECT_INCOMPATIBLE_FORMAT, connect_field::RECFMT);
                    return Ok(self.refuse_at(sqe.cid, ConnectRefusal { status, at, why }, out));
                }
                let text = |r: std::ops::Range<usize>| {
                    let f = &data[r];
                    let end = f.iter().position(|&c| c == 0).unwrap_or(f.len());
                    String::from_utf8_lossy(&f[..end]).into_owned()
                };
                let args = ConnectArgs {
                    qid: (sqe.cdw10 >> 16) as u16,
                    sqsize: (sqe.cdw11 & 0xffff) as u16,
                    cattr: (sqe.cdw11 >> 16) as u8,
                    kato_ms: sqe.cdw12,
                    cntlid: u16::from_le_bytes([data[16], data[17]]),
                    subnqn: text(256..512),
                    hostnqn: text(512..768),
                    hostid: data[..16].try_into().expect("16 bytes"),
                    digests: self.digests,
                };
                match self.sub.connect(args, &self.who) {
                    Ok(conn) => {
                        let cqe = Cqe {
                            dw0: conn.ctrl.cntlid as u32,
                            dw1: 0,
                            // FFFFh tells the host its "SQ flow control
                            // disabled" was accepted (NVMe over Fabrics,
                            // Connect response; nvmet does the same).
                            sqhd: if conn.sqflow_off { 0xffff } else { 1 },
                            sqid: conn.qid,
                            cid: sqe.cid,
                            status: Status::SUCCESS,
                            phase: false,
                        };
                        pdu::encode(&Header::CapsuleResp(cqe), 0, &[], self.digests, 0, out);
                        Ok(Step::Done(conn))
                    }
                    Err(refusal) => Ok(self.refuse_at(sqe.cid, refusal, out)),
                }
            }
            (_, Header::H2cTermReq(t)) => {
                Ok(Step::Refused(format!("the host ended the connection (H2CTermReq, status {:#x})", t.fes)))
            }
            (_, h) => {
                out.extend(term_req(fes::PDU_SEQUENCE_ERROR, 0));
                Ok(Step::Refused(format!("{} where the handshake expects another PDU", h.name())))
            }
        }
    }

    fn tls_started(&mut self, _identity: Option<String>) {}
}
