//! Writes the NVMe/TCP seed corpora: `cargo run -p fastsan-nvme --example nvme_fuzz_seeds -- fuzz/corpus`.
//! `nvme_pdu`: a selector byte (bit 0 header digests, bit 1 data digests), then a host's PDUs.
//! `target_nvme`: a byte of security settings, then a host's whole conversation with the
//! target's front end: an admin queue's bring-up, or an I/O queue joining controller 1 (which
//! the fuzz check creates for the host `nqn.2014-08.org.nvmexpress:uuid:fuzz`).

use fastsan_nvme::command::{fctype, sgl, SglDesc, Sqe, OPC_FABRICS};
use fastsan_nvme::pdu::{encode, flag, DataHeader, Digests, Header, IcReq, TermReq};

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: nvme_fuzz_seeds DIR"))
        .join("nvme_pdu");
    std::fs::create_dir_all(&dir).unwrap();
    let ic =
        Header::IcReq(IcReq { pfv: 0, hpda: 0, digests: Digests { header: true, data: true }, maxr2t: 0 });
    let mut connect = Sqe::decode(&[0; 64]);
    connect.opcode = OPC_FABRICS;
    connect.nsid = fctype::CONNECT as u32;
    connect.dptr = SglDesc { addr: 0, length: 1024, id: sgl::DATA_BLOCK_OFFSET }.encode();
    let mut write = Sqe::decode(&[0; 64]);
    write.opcode = 0x01;
    write.cid = 3;
    write.nsid = 1;
    write.dptr = SglDesc { addr: 0, length: 8192, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
    write.cdw12 = 15;
    for sel in [0u8, 1, 3] {
        let d = Digests { header: sel & 1 != 0, data: sel & 2 != 0 };
        let mut v = vec![sel];
        encode(&ic, 0, &[], Digests::default(), 0, &mut v);
        encode(&Header::CapsuleCmd(connect), 0, &[0x41; 1024], d, 0, &mut v);
        encode(&Header::CapsuleCmd(write), 0, &[], d, 0, &mut v);
        let h2c = DataHeader { cccid: 3, ttag: 1, datao: 0, datal: 8192 };
        encode(&Header::H2cData(h2c), flag::LAST_PDU, &[7; 8192], d, 4, &mut v);
        encode(&Header::H2cTermReq(TermReq { fes: 1, fei: 4 }), 0, &[0; 24], d, 0, &mut v);
        std::fs::write(dir.join(format!("host-session-{sel}")), v).unwrap();
    }
    target_nvme(&dir.with_file_name("target_nvme"));
}

fn sqe(opcode: u8, cid: u16, f: impl FnOnce(&mut Sqe)) -> Sqe {
    let mut s = Sqe::decode(&[0; 64]);
    s.opcode = opcode;
    s.cid = cid;
    f(&mut s);
    s
}

fn target_nvme(dir: &std::path::Path) {
    const NQN: &str = "nqn.2026-11.io.fastsan:fuzz";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";
    std::fs::create_dir_all(dir).unwrap();
    let connect_data = |cntlid: u16| {
        let mut d = vec![0u8; 1024];
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        d[256..256 + NQN.len()].copy_from_slice(NQN.as_bytes());
        d[512..512 + HOST.len()].copy_from_slice(HOST.as_bytes());
        d
    };
    let icd = |len: u32| SglDesc { addr: 0, length: len, id: sgl::DATA_BLOCK_OFFSET }.encode();
    let xfer = |len: u32| SglDesc { addr: 0, length: len, id: sgl::TRANSPORT_DATA_BLOCK }.encode();
    for (name, qid, d) in [
        ("admin", 0u16, Digests::default()),
        ("admin-digests", 0, Digests { header: true, data: true }),
        ("io", 1, Digests::default()),
        ("io-digests", 2, Digests { header: true, data: true }),
    ] {
        let mut v = vec![0u8];
        let ic = Header::IcReq(IcReq { pfv: 0, hpda: 0, digests: d, maxr2t: 0 });
        encode(&ic, 0, &[], Digests::default(), 0, &mut v);
        let connect = sqe(OPC_FABRICS, 1, |s| {
            s.nsid = fctype::CONNECT as u32;
            s.cdw10 = (qid as u32) << 16;
            s.cdw11 = 31;
            s.dptr = icd(1024);
        });
        encode(
            &Header::CapsuleCmd(connect),
            0,
            &connect_data(if qid == 0 { 0xffff } else { 1 }),
            d,
            0,
            &mut v,
        );
        let mut cmds: Vec<(Sqe, Vec<u8>)> = Vec::new();
        if qid == 0 {
            let prop = |cid, set: bool, off: u32, val: u32| {
                sqe(OPC_FABRICS, cid, |s| {
                    s.nsid = if set { fctype::PROPERTY_SET } else { fctype::PROPERTY_GET } as u32;
                    s.cdw10 = 1;
                    s.cdw11 = off;
                    s.cdw12 = val;
                })
            };
            cmds.push((prop(2, false, 0, 0), vec![]));
            cmds.push((prop(3, true, 0x14, 0x0046_0001), vec![]));
            cmds.push((prop(4, false, 0x1c, 0), vec![]));
            for (cid, cns, nsid) in [(5u16, 1u32, 0u32), (6, 2, 0), (7, 0, 1), (8, 3, 1), (9, 6, 0)] {
                cmds.push((
                    sqe(0x06, cid, |s| {
                        s.cdw10 = cns;
                        s.nsid = nsid;
                        s.dptr = xfer(4096);
                    }),
                    vec![],
                ));
            }
            cmds.push((
                sqe(0x02, 10, |s| {
                    s.cdw10 = 0x02 | (127 << 16);
                    s.dptr = xfer(512);
                }),
                vec![],
            ));
            cmds.push((
                sqe(0x09, 11, |s| {
                    s.cdw10 = 0x07;
                    s.cdw11 = 1 | 1 << 16;
                }),
                vec![],
            ));
            cmds.push((sqe(0x0a, 12, |s| s.cdw10 = 0x0f), vec![]));
            for cid in 13..19 {
                cmds.push((sqe(0x0c, cid, |_| {}), vec![]));
            }
            cmds.push((sqe(0x18, 20, |_| {}), vec![]));
            cmds.push((prop(21, true, 0x14, 0x0046_4001), vec![]));
        } else {
            cmds.push((
                sqe(0x01, 2, |s| {
                    s.nsid = 1;
                    s.cdw12 = 7;
                    s.dptr = icd(4096);
                }),
                vec![0x5a; 4096],
            ));
            cmds.push((
                sqe(0x02, 3, |s| {
                    s.nsid = 1;
                    s.cdw12 = 7;
                    s.dptr = xfer(4096);
                }),
                vec![],
            ));
            cmds.push((sqe(0x00, 4, |s| s.nsid = 1), vec![]));
            cmds.push((
                sqe(0x08, 5, |s| {
                    s.nsid = 1;
                    s.cdw12 = 3 | 1 << 25;
                }),
                vec![],
            ));
            let mut range = vec![0u8; 16];
            range[4] = 8;
            cmds.push((
                sqe(0x09, 6, |s| {
                    s.nsid = 1;
                    s.cdw11 = 4;
                    s.dptr = icd(16);
                }),
                range,
            ));
            cmds.push((
                sqe(0x01, 7, |s| {
                    s.nsid = 1;
                    s.cdw12 = 31;
                    s.dptr = xfer(16384);
                }),
                vec![],
            ));
        }
        for (c, data) in cmds {
            encode(&Header::CapsuleCmd(c), 0, &data, d, 0, &mut v);
        }
        if qid != 0 {
            // The R2T for command 7 has transfer tag 0: its data in two PDUs.
            for (off, last) in [(0u32, 0u8), (8192, flag::LAST_PDU)] {
                let h = DataHeader { cccid: 7, ttag: 0, datao: off, datal: 8192 };
                encode(&Header::H2cData(h), last, &[0xa5; 8192], d, 0, &mut v);
            }
        }
        std::fs::write(dir.join(name), v).unwrap();
    }
}
