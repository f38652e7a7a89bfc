//! A leg's record: 4 KiB right after the mirror's data on every leg (at
//! offset `size`, the mirror's size), saying which mirror the leg belongs
//! to, which leg it is and the generation it holds. It lets an open refuse a
//! leg of another mirror, legs given in another order, and a leg written by
//! someone with a newer log than ours (DRBD's generation identifiers,
//! simplified).
//!
//! ```text
//! magic "FSANLEG1" | uuid [16] | leg u32 | legs u32 | generation u64 | crc32c u32 | zeros to 4 KiB
//! ```

use bytes::Bytes;

pub const RECORD_SIZE: u64 = 4096;
const MAGIC: &[u8; 8] = b"FSANLEG1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegRecord {
    pub uuid: [u8; 16],
    pub leg: u32,
    pub legs: u32,
    pub generation: u64,
}

impl LegRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(RECORD_SIZE as usize);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.uuid);
        b.extend_from_slice(&self.leg.to_le_bytes());
        b.extend_from_slice(&self.legs.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(RECORD_SIZE as usize, 0);
        Bytes::from(b)
    }

    /// `Ok(None)` when the block holds no record (a fresh volume), an error
    /// text when it holds a damaged one.
    pub fn decode(b: &[u8]) -> Result<Option<LegRecord>, String> {
        if b.len() < 44 || &b[..8] != MAGIC {
            return Ok(None);
        }
        let crc = u32::from_le_bytes(b[40..44].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&b[..40]) {
            return Err("its mirror record is damaged (bad checksum)".into());
        }
        Ok(Some(LegRecord {
            uuid: b[8..24].try_into().expect("16 bytes"),
            leg: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
            legs: u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")),
            generation: u64::from_le_bytes(b[32..40].try_into().expect("8 bytes")),
        }))
    }
}

pub fn uuid_text(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}
