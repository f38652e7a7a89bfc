//! What a CapsuleCmd carries (a 64-byte submission queue entry, SQE) and
//! what a CapsuleResp carries (a 16-byte completion queue entry, CQE).

use crate::{le16, le32, le64};

/// Length of a submission queue entry.
pub const SQE_LEN: usize = 64;
/// Length of a completion queue entry.
pub const CQE_LEN: usize = 16;

/// The fabrics command opcode (its kind is `fctype`, in the SQE's byte 4).
pub const OPC_FABRICS: u8 = 0x7f;

/// Fabrics command types (`fctype`).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
}

/// SGL descriptor identifiers (type in the high nibble, subtype in the low).
pub mod sgl {
    /// Data block, subtype offset: data inside the capsule, at `addr` from its start.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Transport SGL data block, subtype transport specific: data moved by
    /// H2CData (after an R2T) or C2HData PDUs.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5a;
}

/// An SGL descriptor (16 bytes, in the SQE's data pointer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SglDesc {
    pub addr: u64,
    pub length: u32,
    /// Type and subtype ([`sgl`]).
    pub id: u8,
}

impl SglDesc {
    #[inline]
    pub fn decode(b: &[u8; 16]) -> SglDesc {
        SglDesc { addr: le64(b, 0), length: le32(b, 8), id: b[15] }
    }

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        b[15] = self.id;
        b
    }
}

/// A submission queue entry, field by field; every byte round-trips.
/// `Default` is the all-zero entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqe {
    pub opcode: u8,
    /// FUSE (bits 0-1) and PSDT (bits 6-7: 0b01 or 0b10, SGLs, on fabrics).
    pub flags: u8,
    /// The command identifier its completion carries back.
    pub cid: u16,
    pub nsid: u32,
    /// Dwords 2 and 3 (command specific; a fabrics command's `fctype` is byte 4).
    pub cdw2: u32,
    pub cdw3: u32,
    pub mptr: u64,
    /// The data pointer: one SGL descriptor on fabrics.
    pub dptr: [u8; 16],
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

impl Sqe {
    #[inline]
    pub fn decode(b: &[u8; SQE_LEN]) -> Sqe {
        Sqe {
            opcode: b[0],
            flags: b[1],
            cid: le16(b, 2),
            nsid: le32(b, 4),
            cdw2: le32(b, 8),
            cdw3: le32(b, 12),
            mptr: le64(b, 16),
            dptr: b[24..40].try_into().expect("16 bytes"),
            cdw10: le32(b, 40),
            cdw11: le32(b, 44),
            cdw12: le32(b, 48),
            cdw13: le32(b, 52),
            cdw14: le32(b, 56),
            cdw15: le32(b, 60),
        }
    }

    pub fn encode(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.cid.to_le_bytes());
        for (at, v) in [(4, self.nsid), (8, self.cdw2), (12, self.cdw3)] {
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..40].copy_from_slice(&self.dptr);
        let dws = [self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15];
        for (i, v) in dws.iter().enumerate() {
            b[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// The data pointer as an SGL descriptor.
    #[inline]
    pub fn sgl(&self) -> SglDesc {
        SglDesc::decode(&self.dptr)
    }

    /// A fabrics command's type (`fctype`), if this is one.
    pub fn fctype(&self) -> Option<u8> {
        (self.opcode == OPC_FABRICS).then_some((self.nsid & 0xff) as u8)
    }
}

/// A completion's status: its type (SCT) and code (SC), and Do Not Retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
}

impl Status {
    pub const SUCCESS: Status = Status { sct: 0, sc: 0, dnr: false };

    /// A failure that retrying cannot fix.
    pub const fn fatal(sct: u8, sc: u8) -> Status {
        Status { sct, sc, dnr: true }
    }

    /// The 15 bits above the phase bit.
    pub fn to_field(self) -> u16 {
        ((self.dnr as u16) << 15) | ((self.sct as u16 & 0x7) << 9) | ((self.sc as u16) << 1)
    }

    pub fn from_field(f: u16) -> Status {
        Status { sct: ((f >> 9) & 0x7) as u8, sc: ((f >> 1) & 0xff) as u8, dnr: f & 0x8000 != 0 }
    }

    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }
}

/// Status codes a target answers with (type, code).
pub mod status {
    /// Generic command status (SCT 0).
    pub const GENERIC: u8 = 0;
    /// Command specific status (SCT 1).
    pub const COMMAND_SPECIFIC: u8 = 1;
    /// Media and data integrity errors (SCT 2).
    pub const MEDIA: u8 = 2;

    pub const INVALID_OPCODE: (u8, u8) = (GENERIC, 0x01);
    pub const INVALID_FIELD: (u8, u8) = (GENERIC, 0x02);
    pub const CID_CONFLICT: (u8, u8) = (GENERIC, 0x03);
    pub const DATA_TRANSFER_ERROR: (u8, u8) = (GENERIC, 0x04);
    pub const INTERNAL: (u8, u8) = (GENERIC, 0x06);
    pub const ABORTED_BY_REQUEST: (u8, u8) = (GENERIC, 0x07);
    pub const INVALID_NAMESPACE: (u8, u8) = (GENERIC, 0x0b);
    pub const COMMAND_SEQUENCE_ERROR: (u8, u8) = (GENERIC, 0x0c);
    pub const SGL_INVALID_DATA_LENGTH: (u8, u8) = (GENERIC, 0x0f);
    pub const SGL_INVALID_TYPE: (u8, u8) = (GENERIC, 0x11);
    pub const SGL_INVALID_OFFSET: (u8, u8) = (GENERIC, 0x16);
    pub const KEEP_ALIVE_INVALID: (u8, u8) = (GENERIC, 0x1a);
    pub const TRANSIENT_TRANSPORT_ERROR: (u8, u8) = (GENERIC, 0x22);
    pub const LBA_OUT_OF_RANGE: (u8, u8) = (GENERIC, 0x80);
    pub const NAMESPACE_NOT_READY: (u8, u8) = (GENERIC, 0x82);
    /// Connect: a record format (RECFMT) this subsystem does not know.
    pub const CONNECT_INCOMPATIBLE_FORMAT: (u8, u8) = (COMMAND_SPECIFIC, 0x80);
    /// Connect: a parameter (queue id, size, host NQN) is wrong.
    pub const CONNECT_INVALID_PARAMETERS: (u8, u8) = (COMMAND_SPECIFIC, 0x82);
    pub const CONNECT_INVALID_HOST: (u8, u8) = (COMMAND_SPECIFIC, 0x84);
    pub const INVALID_LOG_PAGE: (u8, u8) = (COMMAND_SPECIFIC, 0x09);
    /// An I/O command: a write to a read-only namespace (the same code as
    /// Connect's invalid parameters; the opcode tells them apart).
    pub const WRITE_TO_READ_ONLY: (u8, u8) = (COMMAND_SPECIFIC, 0x82);
    pub const WRITE_FAULT: (u8, u8) = (MEDIA, 0x80);
    pub const UNRECOVERED_READ_ERROR: (u8, u8) = (MEDIA, 0x81);
    pub const ACCESS_DENIED: (u8, u8) = (MEDIA, 0x86);
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific (Connect: the controller id; Property Get: the value).
    pub dw0: u32,
    pub dw1: u32,
    /// Submission queue head pointer.
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
    /// The phase tag (bit 0 of the status field; fabrics targets send 0).
    pub phase: bool,
}

impl Cqe {
    #[inline]
    pub fn decode(b: &[u8; CQE_LEN]) -> Cqe {
        let f = le16(b, 14);
        Cqe {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sqhd: le16(b, 8),
            sqid: le16(b, 10),
            cid: le16(b, 12),
            status: Status::from_field(f),
            phase: f & 1 != 0,
        }
    }

    #[inline]
    pub fn encode(&self) -> [u8; CQE_LEN] {
        let mut b = [0u8; CQE_LEN];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        for (at, v) in [(8, self.sqhd), (10, self.sqid), (12, self.cid)] {
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        b[14..16].copy_from_slice(&(self.status.to_field() | self.phase as u16).to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn sqes_round_trip(bytes in proptest::array::uniform32(any::<u8>()), more in proptest::array::uniform32(any::<u8>())) {
            let mut b = [0u8; SQE_LEN];
            b[..32].copy_from_slice(&bytes);
            b[32..].copy_from_slice(&more);
            prop_assert_eq!(Sqe::decode(&b).encode(), b);
        }

        #[test]
        fn cqes_round_trip(bytes in proptest::array::uniform16(any::<u8>())) {
            // Bits 12-14 of the status field (CRD, More) are not modelled: zero them.
            let mut b = bytes;
            b[15] &= 0x8f;
            prop_assert_eq!(Cqe::decode(&b).encode(), b);
        }
    }

    #[test]
    fn status_fields_and_sgl_descriptors() {
        let s = Status::fatal(status::LBA_OUT_OF_RANGE.0, status::LBA_OUT_OF_RANGE.1);
        assert_eq!(s.to_field(), 0x8000 | (0x80 << 1));
        assert_eq!(Status::from_field(s.to_field()), s);
        let media = Status { sct: 2, sc: 0x86, dnr: false };
        assert_eq!(media.to_field(), (2 << 9) | (0x86 << 1));
        let d = SglDesc { addr: 0, length: 4096, id: sgl::DATA_BLOCK_OFFSET };
        let raw = d.encode();
        assert_eq!((raw[8], raw[9], raw[15]), (0x00, 0x10, 0x01));
        assert_eq!(SglDesc::decode(&raw), d);
        assert_eq!(Sqe::default(), Sqe::decode(&[0; 64]), "the default entry is all zeroes");
        let sqe = Sqe { opcode: OPC_FABRICS, nsid: fctype::CONNECT as u32, ..Sqe::default() };
        assert_eq!(sqe.fctype(), Some(fctype::CONNECT));
    }
}
