//! Hard limits of BRP v1. Every length read from the wire is checked against
//! one of these before it sizes anything.

/// Largest payload one request or reply frame may carry (a WRITE's data, a
/// BATCH body, a READ reply's data): 16 MiB plus room for batch headers.
pub const MAX_PAYLOAD: u32 = 16 * 1024 * 1024 + 64 * 1024;
/// Largest number of sub-requests in one BATCH.
pub const MAX_BATCH: u16 = 1024;
/// Largest handshake message payload.
pub const MAX_HANDSHAKE: u32 = 1024 * 1024;
/// Longest volume name, in bytes (UTF-8).
pub const MAX_NAME: usize = 255;
/// Longest error message in a handshake ERROR.
pub const MAX_MESSAGE: usize = 1024;
/// Most volumes a LIST reply may describe.
pub const MAX_VOLUMES: u32 = 4096;
