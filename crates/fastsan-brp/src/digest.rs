//! Optional CRC32C digests (as iSCSI and NVMe/TCP use). When the DIGEST
//! feature is negotiated, every request and reply header is followed by the
//! CRC32C of its bytes, and every non-empty payload by the CRC32C of the payload.

/// Size of one digest on the wire.
pub const DIGEST_LEN: usize = 4;

pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Checks the 4-byte little-endian digest `trailer` against `bytes`.
pub fn verify(bytes: &[u8], trailer: &[u8]) -> bool {
    trailer.len() == DIGEST_LEN && crc(bytes).to_le_bytes() == trailer
}

/// CRC32C of several pieces as if they were one (for a BATCH body sent as parts).
pub fn crc_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    parts.into_iter().fold(0, crc32c::crc32c_append)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parts_equal_whole() {
        assert_eq!(super::crc_parts([&b"hello "[..], b"world"]), super::crc(b"hello world"));
    }
}
