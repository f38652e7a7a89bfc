//! The NVMe/TCP front end from a raw socket: a scripted host (the codec's
//! PDUs, nothing else) goes through the Linux host's bring-up (ICReq,
//! Connect, CC.EN, Identify, Set Features, I/O queues), reads and writes in
//! capsules and by R2T, and sends what a broken or hostile host would:
//! malformed PDUs, commands before Connect, unknown opcodes, missing
//! namespaces, LBAs past the end, data without an R2T, bad digests. Each
//! gets its status, or a C2HTermReq and a close, and another host's queue
//! goes on working throughout.

mod common;

use common::*;
use fastsan_nvme::command::{fctype, sgl, status, Cqe, SglDesc, Sqe, OPC_FABRICS};
use fastsan_nvme::pdu::{self, flag, DataHeader, Digests, Header, IcReq, Pdu};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const NQN: &str = "nqn.2026-11.io.fastsan:test";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

/// A scripted NVMe/TCP host on one queue.
struct Host {
    s: TcpStream,
    d: Digests,
    buf: Vec<u8>,
    cid: u16,
    /// Connect's CATTR (bit 2: SQ flow control disabled).
    cattr: u8,
}

fn sqe(opcode: u8) -> Sqe {
    Sqe::decode(&[0; 64]).with(|s| s.opcode = opcode)
}

trait With: Sized {
    fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}
impl With for Sqe {}

impl Host {
    /// A host on connection `s`, nothing sent yet.
    fn over(s: TcpStream) -> Host {
        Host { s, d: Digests::default(), buf: Vec::new(), cid: 0, cattr: 0 }
    }

    /// Connects and exchanges ICReq/ICResp.
    fn ic(addr: &str, d: Digests) -> Host {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut h = Host::over(s);
        h.send(&Header::IcReq(IcReq { pfv: 0, hpda: 0, digests: d, maxr2t: 0 }), 0, &[]);
        match h.recv() {
            (Header::IcResp(r), _) => {
                assert_eq!((r.pfv, r.cpda, r.digests), (0, 0, d));
                assert!(r.maxh2cdata >= 4096 && r.maxh2cdata % 4 == 0);
            }
            other => panic!("expected ICResp, got {other:?}"),
        }
        h.d = d;
        h
    }

    /// ICReq, then Connect on queue `qid` of controller `cntlid` (0xffff: a new one).
    fn connect(addr: &str, d: Digests, nqn: &str, qid: u16, cntlid: u16, kato_ms: u32) -> (Host, Cqe) {
        let mut h = Host::ic(addr, d);
        let cqe = h.try_connect(nqn, qid, cntlid, kato_ms);
        (h, cqe)
    }

    fn try_connect(&mut self, nqn: &str, qid: u16, cntlid: u16, kato_ms: u32) -> Cqe {
        self.try_connect_as([0; 16], nqn, qid, cntlid, kato_ms)
    }

    /// Connect with host identifier `hostid`.
    fn try_connect_as(&mut self, hostid: [u8; 16], nqn: &str, qid: u16, cntlid: u16, kato_ms: u32) -> Cqe {
        let mut data = vec![0u8; 1024];
        data[..16].copy_from_slice(&hostid);
        data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        data[256..256 + nqn.len()].copy_from_slice(nqn.as_bytes());
        data[512..512 + HOSTNQN.len()].copy_from_slice(HOSTNQN.as_bytes());
        let c = sqe(OPC_FABRICS).with(|s| {
            s.nsid = fctype::CONNECT as u32;
            s.cdw10 = (qid as u32) << 16;
            s.cdw11 = 31 | (self.cattr as u32) << 16;
            s.cdw12 = kato_ms;
        });
        self.command(c, &data)
    }

    fn send(&mut self, h: &Header, flags: u8, data: &[u8]) {
        let mut out = Vec::new();
        pdu::encode(h, flags, data, self.d, 0, &mut out);
        self.s.write_all(&out).unwrap();
    }

    /// The next PDU (panics on a close or a timeout).
    fn recv(&mut self) -> (Header, Vec<u8>) {
        self.try_recv().expect("a PDU before the connection closed")
    }

    /// The next PDU, or `None` when the target closed the connection.
    fn try_recv(&mut self) -> Option<(Header, Vec<u8>)> {
        self.try_recv_flags().map(|(h, _, d)| (h, d))
    }

    /// [`Host::try_recv`], with the PDU's flags.
    fn try_recv_flags(&mut self) -> Option<(Header, u8, Vec<u8>)> {
        loop {
            if let Some((p, used)) = pdu::parse(&self.buf, self.d, 1 << 24).unwrap() {
                let Pdu { header, flags, data, data_digest_ok } = p;
                assert!(data_digest_ok);
                let d = self.buf[data].to_vec();
                self.buf.drain(..used);
                return Some((header, flags, d));
            }
            let mut chunk = [0u8; 65536];
            match self.s.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("reading from the target: {e}"),
            }
        }
    }

    /// Sends a command (with in-capsule `data`) and returns its completion.
    fn command(&mut self, mut c: Sqe, data: &[u8]) -> Cqe {
        self.submit(&mut c, data);
        self.complete(c.cid).0
    }

    fn submit(&mut self, c: &mut Sqe, data: &[u8]) {
        self.cid = self.cid.wrapping_add(1);
        c.cid = self.cid;
        if !data.is_empty() {
            c.dptr = SglDesc { addr: 0, length: data.len() as u32, id: sgl::DATA_BLOCK_OFFSET }.encode();
        }
        self.send(&Header::CapsuleCmd(*c), 0, data);
    }

    /// Reads until command `cid` completes: its completion and the data sent for it.
    fn complete(&mut self, cid: u16) -> (Cqe, Vec<u8>) {
        let mut got = Vec::new();
        loop {
            match self.recv() {
                (Header::C2hData(h), d) => {
                    assert_eq!((h.cccid, h.datao as usize), (cid, got.len()));
                    got.extend_from_slice(&d);
                }
                (Header::CapsuleResp(c), _) => {
                    assert_eq!(c.cid, cid, "completion for another command");
                    return (c, got);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// A command that returns `len` bytes.
    fn fetch(&mut self, mut c: Sqe, len: u32) -> (Cqe, Vec<u8>) {
        c.dptr = SglDesc { addr: 0, length: len, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        self.submit(&mut c, &[]);
        self.complete(c.cid)
    }

    fn property_set(&mut self, offset: u32, value: u32) -> Cqe {
        let c = sqe(OPC_FABRICS).with(|s| {
            s.nsid = fctype::PROPERTY_SET as u32;
            s.cdw11 = offset;
            s.cdw12 = value;
        });
        self.command(c, &[])
    }

    fn property_get(&mut self, offset: u32) -> u64 {
        let c = sqe(OPC_FABRICS).with(|s| {
            s.nsid = fctype::PROPERTY_GET as u32;
            s.cdw10 = 1;
            s.cdw11 = offset;
        });
        let cqe = self.command(c, &[]);
        assert!(cqe.status.is_success());
        cqe.dw0 as u64 | (cqe.dw1 as u64) << 32
    }

    fn read(&mut self, nsid: u32, slba: u64, blocks: u32) -> (Cqe, Vec<u8>) {
        let c = sqe(0x02).with(|s| {
            s.nsid = nsid;
            s.cdw10 = slba as u32;
            s.cdw11 = (slba >> 32) as u32;
            s.cdw12 = blocks - 1;
        });
        self.fetch(c, blocks * 512)
    }

    fn write_cmd(nsid: u32, slba: u64, blocks: u32) -> Sqe {
        sqe(0x01).with(|s| {
            s.nsid = nsid;
            s.cdw10 = slba as u32;
            s.cdw11 = (slba >> 32) as u32;
            s.cdw12 = blocks - 1;
        })
    }

    /// A write with its data in the capsule.
    fn write(&mut self, nsid: u32, slba: u64, data: &[u8]) -> Cqe {
        self.command(Host::write_cmd(nsid, slba, data.len() as u32 / 512), data)
    }

    /// A write whose data goes by R2T and H2CData PDUs of `piece` bytes.
    fn write_r2t(&mut self, nsid: u32, slba: u64, data: &[u8], piece: usize) -> Cqe {
        let mut c = Host::write_cmd(nsid, slba, data.len() as u32 / 512);
        c.dptr = SglDesc { addr: 0, length: data.len() as u32, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        self.submit(&mut c, &[]);
        let r2t = match self.recv() {
            (Header::R2t(r), _) => r,
            other => panic!("expected an R2T, got {other:?}"),
        };
        assert_eq!((r2t.cccid, r2t.r2to, r2t.r2tl as usize), (c.cid, 0, data.len()));
        let pieces = data.chunks(piece).count();
        for (i, p) in data.chunks(piece).enumerate() {
            let h =
                DataHeader { cccid: c.cid, ttag: r2t.ttag, datao: (i * piece) as u32, datal: p.len() as u32 };
            let last = if i + 1 == pieces { flag::LAST_PDU } else { 0 };
            self.send(&Header::H2cData(h), last, p);
        }
        self.complete(c.cid).0
    }

    /// Admin bring-up as Linux does it: CC.EN, RDY, Identify, queues.
    fn enable(&mut self, queues: u32) -> Vec<u8> {
        assert!(self.property_set(0x14, 0x0046_0001).status.is_success());
        assert_eq!(self.property_get(0x1c) & 1, 1, "CSTS.RDY");
        let (cqe, id) = self.fetch(sqe(0x06).with(|s| s.cdw10 = 1), 4096);
        assert!(cqe.status.is_success());
        let set = sqe(0x09).with(|s| {
            s.cdw10 = 0x07;
            s.cdw11 = (queues - 1) | (queues - 1) << 16;
        });
        let cqe = self.command(set, &[]);
        assert_eq!(cqe.dw0 & 0xffff, queues - 1);
        id
    }
}

fn sc(c: &Cqe) -> (u8, u8) {
    (c.status.sct, c.status.sc)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A target serving NVMe/TCP (subsystem [`NQN`]) on a free port, with `args`.
fn nvme_target(args: &[&str]) -> Served {
    let mut all = vec!["--brp", "127.0.0.1:0", "--nvme", "127.0.0.1:0", "--nvme-nqn", NQN];
    all.extend_from_slice(args);
    Served::start(&all)
}

fn serve(dir: &std::path::Path) -> Served {
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
    let file = format!("f=file:{}", img.display());
    nvme_target(&["--volume", "v=memory:8M", "--volume", &file, "--volume", "r=memory:1M,ro"])
}

const BOTH: Digests = Digests { header: true, data: true };

#[test]
fn a_host_brings_up_a_controller_and_reads_what_it_wrote() {
    let dir = temp_dir("nvme-io");
    let t = serve(&dir);
    for d in [Digests::default(), BOTH] {
        let (mut admin, cqe) = Host::connect(&t.nvme, d, NQN, 0, 0xffff, 0);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let cntlid = cqe.dw0 as u16;
        let id = admin.enable(2);
        assert_eq!(u16::from_le_bytes([id[78], id[79]]), cntlid, "Identify's CNTLID is Connect's");
        assert!(id[768..].starts_with(NQN.as_bytes()));
        assert_eq!(u32::from_le_bytes(id[516..520].try_into().unwrap()), 3, "NN: one namespace per volume");
        // IOCCSZ (16-byte units): the command and the largest transfer, 2^MDTS pages.
        let ioccsz = u32::from_le_bytes(id[1792..1796].try_into().unwrap()) as usize;
        assert_eq!((ioccsz * 16 - 64, 4096 << id[77]), (1 << 20, 1 << 20), "every write fits in the capsule");
        // The active namespaces, and each one's size and LBA format.
        let (_, list) = admin.fetch(sqe(0x06).with(|s| s.cdw10 = 2), 4096);
        assert_eq!(&list[..16], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        let (_, ns) = admin.fetch(sqe(0x06).with(|s| s.nsid = 1), 4096);
        assert_eq!(u64::from_le_bytes(ns[..8].try_into().unwrap()), (8 << 20) / 512);
        assert_eq!((ns[99], ns[130]), (0, 9), "writable, 512-byte LBAs");
        let (_, ro) = admin.fetch(sqe(0x06).with(|s| s.nsid = 3), 4096);
        assert_eq!(ro[99], 1, "the ,ro volume is write protected");
        let (_, desc) = admin.fetch(
            sqe(0x06).with(|s| {
                s.nsid = 1;
                s.cdw10 = 3;
            }),
            4096,
        );
        assert_eq!((desc[0], desc[1]), (2, 16), "an NGUID first");
        assert_ne!(&desc[4..20], &[0; 16]);

        let (mut io, cqe) = Host::connect(&t.nvme, d, NQN, 1, cntlid, 0);
        assert!(cqe.status.is_success(), "{cqe:?}");
        let (mut io2, cqe) = Host::connect(&t.nvme, d, NQN, 2, cntlid, 0);
        assert!(cqe.status.is_success(), "{cqe:?}");
        // A queue past those granted, and one connected twice, are refused.
        // DW0 names the field at fault: QID, at byte 42 of the command.
        let (_, cqe) = Host::connect(&t.nvme, d, NQN, 3, cntlid, 0);
        assert_eq!((sc(&cqe), cqe.dw0), (status::CONNECT_INVALID_PARAMETERS, 42));
        let (_, cqe) = Host::connect(&t.nvme, d, NQN, 1, cntlid, 0);
        assert_eq!((sc(&cqe), cqe.dw0), (status::CONNECT_INVALID_PARAMETERS, 42));
        // Another host (same NQN, another host identifier) cannot take this controller's queues.
        let mut other = Host::ic(&t.nvme, d);
        assert_eq!(sc(&other.try_connect_as([9; 16], NQN, 3, cntlid, 0)), status::CONNECT_INVALID_PARAMETERS);
        // The queue count is fixed once I/O queues are connected, and the
        // count stays what was granted.
        let set = sqe(0x09).with(|s| {
            s.cdw10 = 0x07;
            s.cdw11 = 7 | 7 << 16;
        });
        assert_eq!(sc(&admin.command(set, &[])), status::COMMAND_SEQUENCE_ERROR);
        let cqe = admin.command(sqe(0x0a).with(|s| s.cdw10 = 0x07), &[]);
        assert_eq!(cqe.dw0, 1 | 1 << 16, "two I/O queues, 0's based");
        // NSSR: CAP.NSSRS is 0, so a subsystem reset is no property here.
        assert_eq!(admin.property_get(0x00) >> 36 & 1, 0);
        assert_eq!(sc(&admin.property_set(0x20, 0x4E56_4D65)), status::INVALID_FIELD);

        for nsid in [1, 2] {
            let small = pattern(nsid as u8, 4096);
            assert!(io.write(nsid, 8, &small).status.is_success());
            let big = pattern(nsid as u8 + 100, 256 << 10);
            // By R2T: one H2CData PDU, then several.
            assert!(io2.write_r2t(nsid, 64, &big, 256 << 10).status.is_success());
            assert!(io.write_r2t(nsid, 1024, &big, 24 << 10).status.is_success());
            // In the capsule, up to the largest transfer (IOCCSZ offers 1 MiB).
            let huge = pattern(nsid as u8 + 50, 1 << 20);
            assert!(io.write(nsid, 4096, &huge).status.is_success());
            let (cqe, back) = io2.read(nsid, 4096, 2048);
            assert!(cqe.status.is_success());
            assert!(back == huge, "the 1 MiB in-capsule write reads back");
            let (cqe, back) = io2.read(nsid, 8, 8);
            assert!(cqe.status.is_success());
            assert_eq!(back, small);
            let (_, back) = io.read(nsid, 64, 512);
            assert_eq!(back, big);
            let (_, back) = io.read(nsid, 1024, 512);
            assert_eq!(back, big);
            // Flush, Write Zeroes, and a deallocate.
            assert!(io.command(sqe(0x00).with(|s| s.nsid = nsid), &[]).status.is_success());
            let wz = Host::write_cmd(nsid, 8, 4).with(|s| s.opcode = 0x08);
            assert!(io.command(wz, &[]).status.is_success());
            let (_, back) = io.read(nsid, 8, 8);
            assert_eq!((&back[..2048], &back[2048..]), (&[0u8; 2048][..], &small[2048..]));
            // As Linux sends it: one range, in room for 256.
            let mut range = vec![0u8; 4096];
            range[4..8].copy_from_slice(&8u32.to_le_bytes());
            range[8..16].copy_from_slice(&64u64.to_le_bytes());
            let dsm = sqe(0x09).with(|s| {
                s.nsid = nsid;
                s.cdw11 = 1 << 2;
            });
            assert!(io.command(dsm, &range).status.is_success());
            // Access hints without Deallocate change nothing.
            let hint = sqe(0x09).with(|s| {
                s.nsid = nsid;
                s.cdw11 = 1;
            });
            let mut r = vec![0u8; 16];
            r[4..8].copy_from_slice(&8u32.to_le_bytes());
            r[8..16].copy_from_slice(&1024u64.to_le_bytes());
            assert!(io.command(hint, &r).status.is_success());
            assert_eq!(io.read(nsid, 1024, 8).1, big[..4096]);
        }
        // The right status for each bad command, and the queue goes on.
        let blocks = (8 << 20) / 512;
        assert_eq!(sc(&io.read(1, blocks - 4, 8).0), status::LBA_OUT_OF_RANGE);
        assert_eq!(sc(&io.write(1, blocks, &[1; 512])), status::LBA_OUT_OF_RANGE);
        assert_eq!(sc(&io.read(9, 0, 1).0), status::INVALID_NAMESPACE);
        assert_eq!(sc(&io.command(sqe(0x7e).with(|s| s.nsid = 1), &[])), status::INVALID_OPCODE);
        assert_eq!(sc(&admin.command(sqe(0xc5), &[])), status::INVALID_OPCODE);
        // A fused pair is not supported: its write must not run alone.
        let fused = Host::write_cmd(1, 8, 1).with(|s| s.flags = 2);
        assert_eq!(sc(&io.command(fused, &[0xff; 512])), status::INVALID_FIELD);
        // The write cache cannot be turned off (the host would stop flushing).
        let vwc = sqe(0x09).with(|s| s.cdw10 = 0x06);
        assert_eq!(sc(&admin.command(vwc, &[])), (status::COMMAND_SPECIFIC, 0x0e));
        // A log page far longer than the page: refused, not a megabyte of zeros.
        let dwords: u32 = (1 << 20) / 4 - 1;
        let huge = sqe(0x02).with(|s| {
            s.cdw10 = 0x02 | (dwords & 0xffff) << 16;
            s.cdw11 = dwords >> 16;
        });
        assert_eq!(sc(&admin.fetch(huge, 1 << 20).0), status::INVALID_FIELD);
        assert_eq!(sc(&io.write(3, 0, &[1; 512])), status::ACCESS_DENIED, "a read-only namespace");
        let bad_sgl = Host::write_cmd(1, 0, 8).with(|s| s.dptr = [0; 16]);
        assert!(!io.command(bad_sgl, &[]).status.is_success());
        assert!(io.command(bad_sgl, &[]).status.dnr);
        // Descriptors that do not match the command: each its own status, no
        // byte of them written, and the queue goes on.
        let with_sgl = |c: Sqe, id: u8, addr: u64, length: u32| {
            c.with(|s| s.dptr = SglDesc { addr, length, id }.encode())
        };
        let mut raw = |c: Sqe, data: &[u8]| {
            let mut c = c;
            io.cid = io.cid.wrapping_add(1);
            c.cid = io.cid;
            io.send(&Header::CapsuleCmd(c), 0, data);
            io.complete(c.cid)
        };
        let read8 = sqe(0x02).with(|s| {
            s.nsid = 1;
            s.cdw10 = 8;
        });
        let (cqe, got) = raw(with_sgl(read8, sgl::DATA_BLOCK_OFFSET, 0, 512), &[0xee; 512]);
        assert_eq!((sc(&cqe), got.len()), (status::INVALID_FIELD, 0), "a read carrying data");
        let flush = sqe(0x00).with(|s| s.nsid = 1);
        let (cqe, _) = raw(with_sgl(flush, sgl::DATA_BLOCK_OFFSET, 0, 512), &[0xee; 512]);
        assert_eq!(sc(&cqe), status::INVALID_FIELD, "a flush carrying data");
        let zeroes = sqe(0x08).with(|s| s.nsid = 1);
        let (cqe, _) = raw(with_sgl(zeroes, sgl::DATA_BLOCK_OFFSET, 0, 512), &[0xee; 512]);
        assert_eq!(sc(&cqe), status::INVALID_FIELD, "write zeroes carrying data");
        let (cqe, _) = raw(with_sgl(read8, sgl::DATA_BLOCK_OFFSET, 0, 512), &[]);
        assert_eq!(sc(&cqe), status::SGL_INVALID_TYPE, "a read to be sent in the capsule");
        let w = Host::write_cmd(1, 8, 1);
        let (cqe, _) = raw(with_sgl(w, sgl::DATA_BLOCK_OFFSET, 16, 512), &[0xee; 512]);
        assert_eq!(sc(&cqe), status::SGL_INVALID_OFFSET, "in-capsule data past offset 0");
        let (cqe, _) = raw(with_sgl(Host::write_cmd(1, 8, 2), sgl::DATA_BLOCK_OFFSET, 0, 1024), &[0xee; 512]);
        assert_eq!(sc(&cqe), status::SGL_INVALID_DATA_LENGTH, "half the data the descriptor names");
        let (cqe, _) = raw(with_sgl(w, sgl::TRANSPORT_DATA_BLOCK, 0, 512), &[0xee; 512]);
        assert_eq!(sc(&cqe), status::INVALID_FIELD, "data to solicit sent in the capsule");
        let (cqe, back) = io.read(1, 8, 2);
        assert!(cqe.status.is_success());
        assert_eq!(back, vec![0; 1024], "no refused command wrote");
        let (cqe, back) = io.read(1, 8, 1);
        assert!(cqe.status.is_success());
        assert_eq!(back, vec![0; 512]);
        if d.data {
            // A data digest that does not match: the command fails (transient), the queue goes on.
            let mut c = Host::write_cmd(1, 0, 1);
            io.cid += 1;
            c.cid = io.cid;
            c.dptr = SglDesc { addr: 0, length: 512, id: sgl::DATA_BLOCK_OFFSET }.encode();
            let mut out = Vec::new();
            pdu::encode(&Header::CapsuleCmd(c), 0, &[7; 512], d, 0, &mut out);
            let n = out.len();
            out[n - 1] ^= 0xff;
            io.s.write_all(&out).unwrap();
            let cqe = io.complete(c.cid).0;
            assert_eq!(sc(&cqe), status::TRANSIENT_TRANSPORT_ERROR);
            assert!(!cqe.status.dnr, "the host may retry");
            assert_eq!(io.read(1, 0, 1).1, vec![0; 512], "the bad write left nothing");
        }
        // Shutdown: SHST goes to "complete" once the volumes are flushed.
        assert!(admin.property_set(0x14, 0x0046_4001).status.is_success());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while admin.property_get(0x1c) >> 2 & 3 != 2 {
            assert!(std::time::Instant::now() < deadline, "shutdown never completed");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Closing the admin queue deletes the controller: its I/O queues close.
        drop(admin);
        assert!(io.try_recv().is_none(), "the I/O queue closes with its controller");
        assert!(io2.try_recv().is_none());
    }
    drop(t);
}

/// SQ flow control: with it (Linux's default), each completion reports the
/// submission queue's head after the commands taken so far, wrapping at the
/// queue's size; a host that disabled it at Connect (CATTR bit 2, as SPDK's
/// hosts and `fastsan bench` do) gets each read completed by its data alone
/// (C2HData marked SUCCESS, no CapsuleResp) and completions without a head.
#[test]
fn the_queue_head_is_reported_unless_the_host_disabled_sq_flow_control() {
    let dir = temp_dir("nvme-sqhd");
    let t = serve(&dir);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    let cntlid = cqe.dw0 as u16;
    admin.enable(2);
    // 32 entries (SQSIZE 31); Connect was the first command, so the head is 1.
    let (mut io, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cntlid, 0);
    assert_eq!((cqe.status.is_success(), cqe.sqhd), (true, 1));
    let data = pattern(7, 4096);
    for i in 0..70u16 {
        let cqe = if i % 2 == 0 { io.write(1, i as u64 * 8, &data) } else { io.read(1, 0, 8).0 };
        assert!(cqe.status.is_success());
        assert_eq!(cqe.sqhd, (2 + i) % 32, "the head after command {i}");
    }

    let mut quiet = Host::ic(&t.nvme, Digests::default());
    quiet.cattr = 1 << 2;
    let cqe = quiet.try_connect(NQN, 2, cntlid, 0);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(cqe.sqhd, 0xffff, "Connect says SQ flow control is off");
    for i in 0..40u16 {
        let cqe = quiet.write(1, 1024 + i as u64 * 8, &pattern(i as u8, 4096));
        assert_eq!((cqe.status.is_success(), cqe.sqhd), (true, 0));
        let mut c = sqe(0x02).with(|s| {
            s.nsid = 1;
            s.cdw10 = 1024 + i as u32 * 8;
            s.cdw12 = 7;
        });
        c.dptr = SglDesc { addr: 0, length: 4096, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        quiet.submit(&mut c, &[]);
        match quiet.try_recv_flags() {
            Some((Header::C2hData(h), flags, d)) => {
                assert_eq!((h.cccid, h.datao, flags & (flag::LAST_PDU | flag::SUCCESS)), (c.cid, 0, 0x0c));
                assert!(d == pattern(i as u8, 4096), "read {i} returns what was written");
            }
            other => panic!("expected the read's data, got {other:?}"),
        }
    }
    // Nothing else came for those reads: the next PDU answers the next command.
    let cqe = quiet.command(sqe(0x00).with(|s| s.nsid = 1), &[]);
    assert!(cqe.status.is_success());
    // The first queue goes on counting.
    assert_eq!(io.write(1, 0, &data).sqhd, (2 + 70) % 32);
}

#[test]
fn broken_hosts_get_a_termination_and_other_hosts_go_on() {
    let dir = temp_dir("nvme-bad");
    let t = serve(&dir);
    // A good host, checked between every bad one.
    let (mut admin, cqe) = Host::connect(&t.nvme, BOTH, NQN, 0, 0xffff, 0);
    let cntlid = cqe.dw0 as u16;
    admin.enable(1);
    let (mut good, _) = Host::connect(&t.nvme, BOTH, NQN, 1, cntlid, 0);
    let mut n = 0u8;
    let mut check = |good: &mut Host| {
        n += 1;
        let data = pattern(n, 4096);
        assert!(good.write(1, 100, &data).status.is_success());
        assert_eq!(good.read(1, 100, 8).1, data);
    };
    check(&mut good);

    let terminated = |h: &mut Host| match h.try_recv() {
        Some((Header::C2hTermReq(t), _)) => {
            assert!(h.try_recv().is_none(), "closed after the C2HTermReq");
            t.fes
        }
        other => panic!("expected a C2HTermReq, got {other:?}"),
    };
    // A PDU with a wrong header length, before ICReq.
    let mut h = Host::over(TcpStream::connect(&t.nvme).unwrap());
    h.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    h.s.write_all(&[0, 0, 64, 0, 128, 0, 0, 0]).unwrap();
    assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
    check(&mut good);
    // An unknown PDU type, after ICReq.
    let mut h = Host::ic(&t.nvme, Digests::default());
    h.s.write_all(&[0x7f, 0, 24, 0, 24, 0, 0, 0]).unwrap();
    assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
    // A command before Connect: Command Sequence Error, then a close.
    let mut h = Host::ic(&t.nvme, Digests::default());
    let cqe = h.command(Host::write_cmd(1, 0, 1), &[0; 512]);
    assert_eq!(sc(&cqe), status::COMMAND_SEQUENCE_ERROR);
    assert!(h.try_recv().is_none());
    // Connect to a subsystem that is not here, or to a controller that does not exist.
    let (mut h, cqe) =
        Host::connect(&t.nvme, Digests::default(), "nqn.2026-11.io.example:nope", 0, 0xffff, 0);
    // DW0: the field at fault is in the Connect data (bit 16), SUBNQN at 256, CNTLID at 16.
    assert_eq!((sc(&cqe), cqe.dw0), (status::CONNECT_INVALID_PARAMETERS, 0x1_0000 | 256));
    assert!(h.try_recv().is_none());
    let (_, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 1, 999, 0);
    assert_eq!((sc(&cqe), cqe.dw0), (status::CONNECT_INVALID_PARAMETERS, 0x1_0000 | 16));
    check(&mut good);
    // A plen far beyond any limit: refused from the 8-byte header, nothing buffered.
    let (mut h, _) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    h.s.write_all(&[4, 0, 72, 72, 0xff, 0xff, 0xff, 0x7f]).unwrap();
    assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
    // Data no R2T asked for.
    let (mut h, _) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    let dh = DataHeader { cccid: 1, ttag: 0, datao: 0, datal: 512 };
    h.send(&Header::H2cData(dh), flag::LAST_PDU, &[1; 512]);
    assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
    // Data beyond what the R2T asked for.
    let (mut a2, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    a2.enable(1);
    let (mut h, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    let mut c = Host::write_cmd(1, 0, 16);
    c.dptr = SglDesc { addr: 0, length: 8192, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
    h.submit(&mut c, &[]);
    let Header::R2t(r) = h.recv().0 else { panic!("an R2T") };
    let dh = DataHeader { cccid: c.cid, ttag: r.ttag, datao: 4096, datal: 4096 };
    h.send(&Header::H2cData(dh), flag::LAST_PDU, &[1; 4096]);
    assert_eq!(terminated(&mut h), pdu::fes::DATA_OUT_OF_RANGE);
    check(&mut good);
    // LAST_PDU on a PDU that leaves data missing (the write could never
    // complete), and missing on the PDU that completes it.
    for (first, flags) in [(4096, flag::LAST_PDU), (8192, 0)] {
        let (mut a, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
        a.enable(1);
        let (mut h, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
        let mut c = Host::write_cmd(1, 0, 16);
        c.dptr = SglDesc { addr: 0, length: 8192, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        h.submit(&mut c, &[]);
        let Header::R2t(r) = h.recv().0 else { panic!("an R2T") };
        let dh = DataHeader { cccid: c.cid, ttag: r.ttag, datao: 0, datal: first };
        h.send(&Header::H2cData(dh), flags, &vec![1; first as usize]);
        assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
        check(&mut good);
    }
    // A header digest that does not match.
    let (mut h, _) = Host::connect(&t.nvme, BOTH, NQN, 0, 0xffff, 0);
    let mut out = Vec::new();
    pdu::encode(&Header::CapsuleCmd(sqe(0x18)), 0, &[], BOTH, 0, &mut out);
    out[72] ^= 1;
    h.s.write_all(&out).unwrap();
    assert_eq!(terminated(&mut h), pdu::fes::HEADER_DIGEST);
    // Digest flags that differ from what was agreed.
    let (mut h, _) = Host::connect(&t.nvme, BOTH, NQN, 0, 0xffff, 0);
    let mut out = Vec::new();
    pdu::encode(&Header::CapsuleCmd(sqe(0x18)), 0, &[], Digests::default(), 0, &mut out);
    h.s.write_all(&out).unwrap();
    assert_eq!(terminated(&mut h), pdu::fes::INVALID_HEADER_FIELD);
    // A host that leaves in the middle of a PDU.
    let (mut h, _) = Host::connect(&t.nvme, BOTH, NQN, 0, 0xffff, 0);
    h.s.write_all(&[4, 1, 72, 0, 76, 0, 0, 0, 0x18]).unwrap();
    drop(h);
    check(&mut good);
    let log = t.signal("TERM").1;
    assert!(log.contains("NVMe/TCP"), "{log}");
}

/// NVMe/TCP hosts prove no identity: they see the namespaces granted to
/// `anonymous` (read-only where the grant says so), and a host that may see
/// none is refused at Connect instead of holding a connection slot.
#[test]
fn hosts_see_only_what_anonymous_is_granted_and_with_nothing_are_refused() {
    let t = nvme_target(&[
        "--volume",
        "a=memory:1M",
        "--volume",
        "b=memory:1M",
        "--grant",
        "a:anonymous:ro",
        "--grant",
        "b:alice",
    ]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    assert!(cqe.status.is_success(), "{cqe:?}");
    admin.enable(1);
    let (_, list) = admin.fetch(sqe(0x06).with(|s| s.cdw10 = 2), 4096);
    assert_eq!(&list[..8], &[1, 0, 0, 0, 0, 0, 0, 0], "only a (NSID 1) is active");
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    assert_eq!(sc(&io.write(1, 0, &[1; 512])), status::ACCESS_DENIED, "a is read-only to anonymous");
    assert!(io.read(1, 0, 1).0.status.is_success());
    assert_eq!(sc(&io.read(2, 0, 1).0), status::INVALID_NAMESPACE, "b is alice's");
    drop((io, admin));
    let log = t.signal("TERM").1;
    assert!(log.contains("NVMe I/O controller created"), "{log}");

    // A target whose BRP clients prove identities (alice's secret): NVMe/TCP
    // hosts still prove none, and the log says so.
    let dir = temp_dir("nvme-grants");
    let secrets = dir.join("secrets");
    std::fs::write(&secrets, "alice a-secret\n").unwrap();
    let t = nvme_target(&[
        "--volume",
        "b=memory:1M",
        "--grant",
        "b:alice",
        "--secrets-file",
        secrets.to_str().unwrap(),
    ]);
    let (mut h, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    // Connect Invalid Host; DW0: the host NQN (in the Connect data, at 512).
    assert_eq!((sc(&cqe), cqe.dw0), (status::CONNECT_INVALID_HOST, 0x1_0000 | 512));
    assert!(h.try_recv().is_none(), "and closed");
    // Discovery still answers (it names no namespace).
    let disc = "nqn.2014-08.org.nvmexpress.discovery";
    assert!(Host::connect(&t.nvme, Digests::default(), disc, 0, 0xffff, 0).1.status.is_success());
    let log = t.signal("TERM").1;
    assert!(log.contains("has no grant for any namespace"), "{log}");
    assert!(log.contains("NVMe/TCP has no TLS or authentication here"), "{log}");
}

#[test]
fn discovery_lists_the_subsystem_and_keep_alive_tears_down_silent_hosts() {
    let dir = temp_dir("nvme-disc");
    let t = serve(&dir);
    let disc = "nqn.2014-08.org.nvmexpress.discovery";
    let (mut h, cqe) = Host::connect(&t.nvme, Digests::default(), disc, 0, 0xffff, 0);
    assert!(cqe.status.is_success());
    assert!(h.property_set(0x14, 0x0046_0001).status.is_success());
    let (_, id) = h.fetch(sqe(0x06).with(|s| s.cdw10 = 1), 4096);
    assert_eq!(id[111], 2, "a discovery controller");
    // The log as nvme-cli reads it: the header, then the entries.
    let log = |h: &mut Host, offset: u64, len: u32| {
        let c = sqe(0x02).with(|s| {
            s.cdw10 = 0x70 | ((len / 4 - 1) << 16);
            s.cdw12 = offset as u32;
        });
        h.fetch(c, len).1
    };
    let head = log(&mut h, 0, 1024);
    assert_eq!(u64::from_le_bytes(head[8..16].try_into().unwrap()), 2, "NUMREC");
    let entries = log(&mut h, 1024, 2048);
    let e = &entries[1024..];
    assert_eq!((e[0], e[2]), (3, 2), "TCP, an NVM subsystem");
    assert!(e[256..].starts_with(NQN.as_bytes()));
    let port = t.nvme.rsplit(':').next().unwrap();
    assert!(e[32..64].starts_with(port.as_bytes()), "TRSVCID is the port the host reached");
    assert!(e[512..].starts_with(b"127.0.0.1"));
    // Identify Namespace means nothing here.
    let (cqe, _) = h.fetch(sqe(0x06).with(|s| s.nsid = 1), 4096);
    assert!(!cqe.status.is_success());
    // A discovery host that asked for no keep-alive gets nvmet's 120 s: it
    // holds a connection slot, and cannot hold it forever.
    let cqe = h.command(sqe(0x0a).with(|s| s.cdw10 = 0x0f), &[]);
    assert_eq!(cqe.dw0, 120_000, "KATO of a discovery controller connected with 0");

    // A controller with a 1 s keep-alive: alive while the host sends, torn down when it stops.
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 1000);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(400));
        assert!(admin.command(sqe(0x18), &[]).status.is_success(), "keep-alive");
    }
    assert!(io.write(1, 0, &[5; 512]).status.is_success());
    let start = std::time::Instant::now();
    assert!(admin.try_recv().is_none(), "closed after its keep-alive timeout");
    assert!(io.try_recv().is_none());
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(900) && waited < Duration::from_secs(5), "{waited:?}");
    let log = t.signal("TERM").1;
    assert!(log.contains("keep-alive timeout"), "{log}");
}

#[test]
fn device_errors_get_their_status_and_a_failed_flush_fails_every_host() {
    let t = nvme_target(&[
        "--volume",
        "e=memory:4M,faults=write:eio@1M-2M",
        "--volume",
        "fl=memory:1M,faults=flush:eio",
    ]);
    let host = |queues: u32| {
        let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
        admin.enable(queues);
        let (io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
        (admin, io)
    };
    let (mut a1, mut io) = host(1);
    let (_a2, mut other) = host(1);
    // A write the device fails: Write Fault, do not retry; nothing of it is read back.
    let bad = (1 << 20) / 512 + 8;
    let cqe = io.write(1, bad, &pattern(9, 4096));
    assert_eq!(sc(&cqe), status::WRITE_FAULT);
    assert!(cqe.status.dnr);
    assert_eq!(io.read(1, bad, 8).1, vec![0; 4096]);
    // Writes around it land, and the queue goes on.
    let good = pattern(3, 4096);
    assert!(io.write(1, 16, &good).status.is_success());
    assert_eq!(other.read(1, 16, 8).1, good);
    // A failed flush: this host's flush fails, and so does every later one, the other host's too.
    let flush = |h: &mut Host| h.command(sqe(0x00).with(|s| s.nsid = 2), &[]);
    let smart = sqe(0x02).with(|s| {
        s.nsid = 0xffff_ffff;
        s.cdw10 = 0x02 | 127 << 16; // SMART / health, 512 bytes
    });
    let critical = |a: &mut Host| {
        let (cqe, log) = a.fetch(smart, 512);
        assert!(cqe.status.is_success());
        log[0]
    };
    assert_eq!(critical(&mut a1), 0, "healthy so far");
    assert!(other.write(2, 0, &good).status.is_success());
    assert_eq!(sc(&flush(&mut io)), status::WRITE_FAULT);
    assert_eq!(sc(&flush(&mut other)), status::WRITE_FAULT);
    assert_eq!(sc(&flush(&mut io)), status::WRITE_FAULT);
    // FUA writes promise durability too: refused the same way.
    let fua = Host::write_cmd(2, 8, 8).with(|s| s.cdw12 |= 1 << 30);
    assert_eq!(sc(&other.command(fua, &good)), status::WRITE_FAULT);
    // And every read and write of that namespace: which data a read would
    // find is unknown once a writeback failed.
    let (cqe, data) = other.read(2, 0, 8);
    assert_eq!((sc(&cqe), data.len()), (status::UNRECOVERED_READ_ERROR, 0));
    assert_eq!(sc(&io.write(2, 16, &good)), status::WRITE_FAULT);
    assert_eq!(critical(&mut a1), 1 << 2, "the health log says reliability is degraded");
    // Namespace 1 is not affected.
    assert!(flush_ok(&mut io, 1));
    // A shutdown whose flush fails does not report a clean shutdown: CSTS.CFS.
    assert!(a1.property_set(0x14, 0x0046_4001).status.is_success());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let csts = loop {
        let c = a1.property_get(0x1c);
        if c >> 2 & 3 == 2 {
            break c;
        }
        assert!(std::time::Instant::now() < deadline, "shutdown never finished");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(csts & 2, 2, "controller fatal status after a failed shutdown flush");
    let log = t.signal("TERM").1;
    assert!(log.contains("flush failed"), "{log}");
}

fn flush_ok(h: &mut Host, nsid: u32) -> bool {
    h.command(sqe(0x00).with(|s| s.nsid = nsid), &[]).status.is_success()
}

/// A deallocate of one range past 4 GiB (Linux's block layer never sends
/// one, SPDK and `nvme dsm` may) trims it all: it got Invalid Field until
/// 2026-11-29.
#[test]
fn a_deallocate_of_a_range_past_4_gib_trims_it() {
    let t = nvme_target(&["--volume", "big=memory:16G"]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    let (inside, outside) = ((9u64 << 30) / 512, (11u64 << 30) / 512);
    for lba in [inside, outside] {
        assert!(io.write(1, lba, &pattern(7, 4096)).status.is_success());
    }
    // One range: 10 GiB (its length, a count of blocks) from LBA 0.
    let mut range = vec![0u8; 16];
    range[4..8].copy_from_slice(&(((10u64 << 30) / 512) as u32).to_le_bytes());
    let dsm = sqe(0x09).with(|s| {
        s.nsid = 1;
        s.cdw11 = 1 << 2;
    });
    let cqe = io.command(dsm, &range);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(io.read(1, inside, 8).1, vec![0u8; 4096], "trimmed");
    assert_eq!(io.read(1, outside, 8).1, pattern(7, 4096), "past the range: kept");
}

/// The target's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap();
    kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// Hosts that send thousands of admin commands in one go and read none of
/// the answers (each Identify: 72 bytes asked, 4 KiB answered) make the
/// target wait on their sockets, not queue the answers in its memory: until
/// 2026-11-29 a connection decoded a whole read (~3,600 of them, ~15 MiB of
/// answers) before sending any. Another host goes on meanwhile.
#[test]
fn hosts_that_flood_admin_commands_and_read_nothing_pin_little_memory() {
    let t = nvme_target(&["--volume", "v=memory:8M"]);
    let disc = "nqn.2014-08.org.nvmexpress.discovery";
    let before = rss(t.child.id());
    let mut floods = Vec::new();
    for _ in 0..8 {
        let (mut h, cqe) = Host::connect(&t.nvme, Digests::default(), disc, 0, 0xffff, 0);
        assert!(cqe.status.is_success());
        assert!(h.property_set(0x14, 0x0046_0001).status.is_success());
        let mut out = Vec::new();
        for cid in 0..20_000u16 {
            let mut c = sqe(0x06).with(|s| s.cdw10 = 1);
            c.cid = cid;
            c.dptr = SglDesc { addr: 0, length: 4096, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
            pdu::encode(&Header::CapsuleCmd(c), 0, &[], h.d, 0, &mut out);
        }
        // Whatever the target takes before it stops reading: it stops when
        // its answers fill the socket, and the rest of the write times out.
        h.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
        floods.push(std::thread::spawn(move || {
            let _ = h.s.write_all(&out);
            h
        }));
    }
    let floods: Vec<Host> = floods.into_iter().map(|f| f.join().unwrap()).collect();
    // (The kernel took the commands at once: give the target time to decode them.)
    std::thread::sleep(Duration::from_secs(1));
    let grown = rss(t.child.id()).saturating_sub(before);
    // (8 such hosts: 8-14 MiB here; 4 of them grew it by 34 MiB before the fix.)
    assert!(grown < 32 << 20, "the target grew by {} MiB", grown >> 20);
    // Another host is served all along.
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    assert!(io.write(1, 8, &pattern(3, 4096)).status.is_success());
    assert_eq!(io.read(1, 8, 8).1, pattern(3, 4096));
    drop(floods);
}

/// A host that stops reading while a large read's answer is half-written
/// (the target's writer waits on its socket) and goes on sending commands the
/// target answers itself (here with Invalid Namespace) makes the target
/// wait too: until 2026-11-29 those answers, holding no credit, went to the
/// writer's unbounded queue while the reader kept reading, so one host could
/// grow the target's memory without end. Another host goes on meanwhile.
#[test]
fn a_host_that_reads_nothing_cannot_queue_answers_without_end() {
    let t = nvme_target(&["--volume", "v=memory:64M,faults=read:delay=1ms"]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut h, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    // 16 MiB of answers to reads, more than the sockets hold.
    for i in 0..16u64 {
        let mut c = sqe(0x02).with(|s| {
            s.nsid = 1;
            s.cdw10 = (i * 2048) as u32;
            s.cdw12 = 2047;
        });
        c.dptr = SglDesc { addr: 0, length: 1 << 20, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        h.submit(&mut c, &[]);
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = rss(t.child.id());
    // Then 1 MiB after 1 MiB of reads of namespace 0, for at most 3 s.
    let mut flood = Vec::new();
    for cid in 0..(1u32 << 20) / 72 {
        let mut c = sqe(0x02).with(|s| s.nsid = 0);
        c.cid = 100 + (cid % 30_000) as u16;
        c.dptr = SglDesc { addr: 0, length: 512, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        pdu::encode(&Header::CapsuleCmd(c), 0, &[], h.d, 0, &mut flood);
    }
    h.s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
    let (start, mut sent) = (Instant::now(), 0usize);
    while start.elapsed() < Duration::from_secs(3) && sent < 256 << 20 {
        match h.s.write(&flood) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss(t.child.id()).saturating_sub(before);
    // What the sockets' buffers take, no more (a few MiB here; before the
    // fix, all 256 MiB went in, and the target grew by hundreds of MiB).
    assert!(sent < 48 << 20, "the target took {} MiB of commands", sent >> 20);
    assert!(grown < 64 << 20, "the target grew by {} MiB", grown >> 20);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    assert!(io.write(1, 8, &pattern(5, 4096)).status.is_success());
    assert_eq!(io.read(1, 8, 8).1, pattern(5, 4096));
    drop(h);
}

/// The number of threads of process `pid`.
fn threads(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// A host that toggles CC.SHN over and over gets one shutdown flush at a
/// time, the last one after its last toggle: until 2026-11-29 each toggle
/// started a blocking thread of its own, and a few hundred toggles kept
/// hundreds of threads in the fsync of a volume every host shares.
#[test]
fn a_host_toggling_shutdown_runs_one_flush_at_a_time() {
    let t = nvme_target(&["--volume", "v=memory:8M,faults=flush:delay=50ms"]);
    let (mut admin, _) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let before = threads(t.child.id());
    let mut most = before;
    for i in 0..300 {
        assert!(admin.property_set(0x14, 0x0046_4001).status.is_success(), "CC.SHN set");
        assert!(admin.property_set(0x14, 0x0046_0001).status.is_success(), "CC.SHN clear");
        if i % 20 == 0 {
            most = most.max(threads(t.child.id()));
        }
    }
    assert!(admin.property_set(0x14, 0x0046_4001).status.is_success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin.property_get(0x1c) >> 2 & 3 != 2 {
        assert!(Instant::now() < deadline, "the last shutdown never completed");
        most = most.max(threads(t.child.id()));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(most < before + 8, "{before} threads before, {most} at most while toggling");
}

/// A write whose data comes in many small H2CData PDUs, each in a read of
/// its own, holds only its data: until 2026-11-29 each piece was a slice of
/// the read that brought it and held that read's whole buffer (256 KiB) until
/// the write was complete. And such writes land whole.
#[test]
fn writes_whose_data_trickles_in_pin_only_their_data_and_land_whole() {
    let t = nvme_target(&["--volume", "v=memory:8M"]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(4);
    let mut queues: Vec<Host> =
        (1..=4).map(|q| Host::connect(&t.nvme, Digests::default(), NQN, q, cqe.dw0 as u16, 0).0).collect();
    let before = rss(t.child.id());
    // On each of 4 queues, 30 writes of 4 KiB by R2T (a queue holds 32);
    // each gets its first 512 bytes, one PDU per read.
    let mut writes = Vec::new();
    for i in 0..120u32 {
        let (q, io) = (i as usize % 4, &mut queues[i as usize % 4]);
        io.s.set_nodelay(true).unwrap();
        let mut c = Host::write_cmd(1, i as u64 * 8, 8);
        c.dptr = SglDesc { addr: 0, length: 4096, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
        io.submit(&mut c, &[]);
        let r2t = match io.recv() {
            (Header::R2t(r), _) => r,
            other => panic!("expected an R2T, got {other:?}"),
        };
        let data = pattern(i as u8, 4096);
        let h = DataHeader { cccid: c.cid, ttag: r2t.ttag, datao: 0, datal: 512 };
        io.send(&Header::H2cData(h), 0, &data[..512]);
        std::thread::sleep(Duration::from_millis(2));
        writes.push((q, c.cid, r2t.ttag, data));
    }
    std::thread::sleep(Duration::from_millis(200));
    let grown = rss(t.child.id()).saturating_sub(before);
    assert!(
        grown < 12 << 20,
        "120 writes of 4 KiB, 512 bytes each so far, grew the target by {} KiB (4 MiB with the fix: the \
         allocator's granularity; 14 MiB for half as many writes before it)",
        grown >> 10
    );
    // The rest of each, in two more pieces: every write lands whole.
    for (q, cid, ttag, data) in &writes {
        let io = &mut queues[*q];
        for (at, len) in [(512, 1536), (2048, 2048)] {
            let h = DataHeader { cccid: *cid, ttag: *ttag, datao: at, datal: len };
            let last = if at == 2048 { flag::LAST_PDU } else { 0 };
            io.send(&Header::H2cData(h), last, &data[at as usize..(at + len) as usize]);
        }
        let (cqe, _) = io.complete(*cid);
        assert!(cqe.status.is_success(), "{cqe:?}");
    }
    for (i, (_, _, _, data)) in writes.iter().enumerate() {
        assert_eq!(&queues[0].read(1, i as u64 * 8, 8).1, data, "write {i}");
    }
}

/// A target over a 4 MiB file whose one device thread takes 100 ms a
/// write: a lost queue's writes wait their turn on the device (the fence's
/// tests).
fn slow_device_target(name: &str) -> (Scratch, Served) {
    let dir = temp_dir(name);
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(4 << 20).unwrap();
    let spec = format!("v=file:{},delay=100ms", img.display());
    (dir, nvme_target(&["--io-threads", "1", "--volume", &spec]))
}

#[test]
fn a_reconnecting_host_is_answered_after_its_lost_queues_writes_land() {
    let (_dir, t) = slow_device_target("nvme-fence");
    let host = || {
        let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
        assert!(cqe.status.is_success());
        admin.enable(1);
        let (io, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
        assert!(cqe.status.is_success());
        (admin, io)
    };
    let (a_admin, mut a) = host();
    // Five writes elsewhere, then the old content of block 0; the host loses
    // its connections before any completes.
    for i in 0..5u64 {
        a.submit(&mut Host::write_cmd(1, 8 + 8 * i, 8), &pattern(i as u8, 4096));
    }
    a.submit(&mut Host::write_cmd(1, 0, 8), &pattern(0xee, 4096));
    std::thread::sleep(Duration::from_millis(50));
    drop(a);
    drop(a_admin);
    // It reconnects (same host NQN) and writes the new content of block 0.
    let start = std::time::Instant::now();
    let (_b_admin, mut b) = host();
    let waited = start.elapsed();
    let new = pattern(0x11, 4096);
    assert!(b.write(1, 0, &new).status.is_success());
    // Read once every write of the lost queue has surely had its turn.
    std::thread::sleep(Duration::from_millis(800));
    let back = b.read(1, 0, 8).1;
    assert!(
        back == new,
        "a lost queue's older write landed after the newer one (block 0 starts {:?})",
        &back[..4]
    );
    for i in 0..5u64 {
        assert_eq!(b.read(1, 8 + 8 * i, 8).1, pattern(i as u8, 4096), "the lost queue's writes all ran");
    }
    assert!(waited >= Duration::from_millis(200), "the Connect did not wait for the lost queue: {waited:?}");
    let log = t.signal("TERM").1;
    assert!(log.contains("waits for the host's lost queues to drain"), "{log}");
}

/// Nothing follows a C2HTermReq: a read still running when the host broke
/// the protocol is not answered after it (the target's writer sent the
/// replies in flight after the goodbye until 2026-12-07; a host takes no
/// PDU after it).
#[test]
fn nothing_follows_a_termination() {
    let t = nvme_target(&["--volume", "v=memory:8M,delay=300ms"]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    let mut read = sqe(0x02).with(|s| {
        s.nsid = 1;
        s.cdw12 = 7;
    });
    read.dptr = SglDesc { addr: 0, length: 4096, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
    io.submit(&mut read, &[]);
    std::thread::sleep(Duration::from_millis(50));
    io.s.write_all(&[0x7f, 0, 24, 0, 24, 0, 0, 0]).unwrap();
    match io.try_recv() {
        Some((Header::C2hTermReq(_), _)) => {}
        other => panic!("expected a C2HTermReq, got {other:?}"),
    }
    assert!(io.try_recv().is_none(), "closed after the C2HTermReq, the read not answered");
}

/// A Connect that waits for the host's lost queues longer than its own
/// keep-alive timeout is answered once they drained: the host waits for
/// its answer, it is not silent. (The reaper tore that new controller down
/// after the keep-alive timeout, and the Connect failed: a host could not
/// reconnect while its old writes drained.) The fence is that host's: one
/// with the same NQN and its own host identifier does not wait.
#[test]
fn a_connect_waiting_on_the_fence_outlives_its_keep_alive_timeout() {
    // 30 lost writes take 3 s to drain.
    let (_dir, t) = slow_device_target("nvme-fence-kato");
    let (admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    let mut admin = admin;
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    for i in 0..30u64 {
        io.submit(&mut Host::write_cmd(1, 8 * i, 8), &pattern(i as u8, 4096));
    }
    std::thread::sleep(Duration::from_millis(50));
    drop((io, admin));
    // Another host (its own host identifier) sharing the NQN, as cloned
    // images do, is not held by this one's fence.
    let start = std::time::Instant::now();
    let cqe = Host::ic(&t.nvme, Digests::default()).try_connect_as([7; 16], NQN, 0, 0xffff, 0);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert!(start.elapsed() < Duration::from_millis(1500), "held: {:?}", start.elapsed());
    // A keep-alive timeout of 1 s: torn down after 2 s of silence.
    let start = std::time::Instant::now();
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 1000);
    let waited = start.elapsed();
    assert!(cqe.status.is_success(), "{cqe:?} after {waited:?}");
    assert!(waited >= Duration::from_millis(2500), "it waited for the lost writes: {waited:?}");
    admin.enable(1);
    let (mut io, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    assert!(cqe.status.is_success(), "{cqe:?}");
    assert_eq!(io.read(1, 8 * 29, 8).1, pattern(29, 4096), "the lost queue's last write landed");
}

/// `fastsan bench` over NVMe/TCP: one I/O queue per job, every read of a
/// block written in the run checked, and the end of the run is this side's
/// close, not a lost connection (no warning when the controller ends the
/// I/O queues after seeing the admin queue go).
#[test]
fn bench_over_nvme_tcp_verifies_its_reads_and_closes_quietly() {
    let t = nvme_target(&["--volume", "v=memory:16M"]);
    let url = format!("nvme+tcp://{}/{NQN}", t.nvme);
    // Small blocks, and megabyte ones: writes of 1 MiB in the capsule, reads
    // of 1 MiB each as one C2HData PDU (the host's read plan).
    for bs in ["4k", "4k", "1m"] {
        let out = fastsan(&[
            "bench",
            &url,
            "--rw",
            "randrw",
            "--bs",
            bs,
            "--iodepth",
            "4",
            "--jobs",
            "4",
            "--runtime",
            "0.3",
            "--ramp",
            "0",
            "--verify",
            "--json",
        ]);
        let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text} {err}");
        for want in ["\"connections\": 4,", "\"verify_mismatches\": 0,", "\"errors\": 0,"] {
            assert!(text.contains(want), "{want} in {text}");
        }
        assert!(!text.contains("\"reads\": 0,") && !text.contains("\"writes\": 0,"), "{text}");
        assert!(!err.contains("WARN") && !err.contains("ERROR"), "{err}");
    }
}

/// An in-capsule write's data counts against the payload budget while it
/// arrives, before it is read (until 2026-12-08 only once all of it was
/// there), charged to the namespace its command names, one of several the
/// queue reaches; it lands whole once the rest comes, and the budget goes
/// back.
#[test]
fn a_write_in_the_capsule_is_counted_while_it_arrives() {
    let t = nvme_target(&["--volume", "a=memory:8M", "--volume", "b=memory:8M", "--metrics", "127.0.0.1:0"]);
    let (mut admin, cqe) = Host::connect(&t.nvme, Digests::default(), NQN, 0, 0xffff, 0);
    admin.enable(1);
    let (mut io, _) = Host::connect(&t.nvme, Digests::default(), NQN, 1, cqe.dw0 as u16, 0);
    let in_flight = || sample(&scrape(&t.metrics), "fastsan_payload_in_flight_bytes{}");
    let data = pattern(9, 1 << 20);
    let mut c = Host::write_cmd(2, 0, data.len() as u32 / 512);
    c.cid = 77;
    c.dptr = SglDesc { addr: 0, length: data.len() as u32, id: sgl::DATA_BLOCK_OFFSET }.encode();
    let mut pdu = Vec::new();
    pdu::encode(&Header::CapsuleCmd(c), 0, &data, io.d, 0, &mut pdu);
    io.s.write_all(&pdu[..256 << 10]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while in_flight() < data.len() as f64 {
        assert!(Instant::now() < deadline, "the write's data is counted from its header on");
        std::thread::sleep(Duration::from_millis(20));
    }
    io.s.write_all(&pdu[256 << 10..]).unwrap();
    assert!(io.complete(77).0.status.is_success());
    assert_eq!(io.read(2, 0, 2048).1, data, "the write lands whole");
    assert_eq!(in_flight(), 0.0, "its budget came back");
    // By R2T, in four H2CData PDUs: each counted as it arrives, none after.
    let more = pattern(10, 1 << 20);
    assert!(io.write_r2t(2, 2048, &more, 256 << 10).status.is_success());
    assert_eq!(io.read(2, 2048, 2048).1, more);
    assert_eq!(in_flight(), 0.0, "nothing is left held");
}
