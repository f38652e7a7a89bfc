//! Writes the NVMe/TCP seed corpus: `cargo run -p fastsan-nvme --example nvme_fuzz_seeds -- fuzz/corpus`.
//! Each seed: a selector byte (bit 0 header digests, bit 1 data digests), then a host's PDUs.

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
}
