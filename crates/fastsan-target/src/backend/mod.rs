//! Backends: where a volume's bytes live. A backend is a synchronous,
//! thread-safe store with positional I/O; the connection decides where to run
//! it (inline for memory and null, on the I/O pool for files). Wrappers
//! (mirror, fault injection, rate limits) will implement the same trait and
//! call the next layer, as nbdkit's filters do.

mod file;
mod memory;
mod null;

pub use file::FileBackend;
pub use memory::MemoryBackend;
pub use null::NullBackend;

use crate::request::Extent;
use std::io;

/// How to write zeroes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// Durable before returning.
    pub fua: bool,
    /// Keep the range allocated (do not punch a hole).
    pub no_hole: bool,
    /// Fail with `ErrorKind::Unsupported` rather than write zeroes slowly.
    pub fast_only: bool,
}

pub trait Backend: Send + Sync + 'static {
    /// Size in bytes; requests have been checked against it before any call.
    fn size(&self) -> u64;
    /// Smallest unit of I/O this backend accepts (offsets and lengths are multiples).
    fn block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// With `fua`, the data is durable when this returns.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// The range's contents become unspecified (here: zeros) and may free space.
    fn trim(&self, offset: u64, len: u64) -> io::Result<()>;
    /// The range reads as zeros afterwards.
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> io::Result<()>;
    /// The allocation map of a range, in order, covering exactly `len` bytes.
    /// Backends that cannot tell report one allocated extent.
    fn extents(&self, _offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        Ok(vec![Extent { len, hole: false }])
    }
    /// True when a call can sleep on a device (run it on the I/O pool);
    /// false when it only copies memory (run it inline).
    fn may_block(&self) -> bool;
    /// True when the data does not survive the target process.
    fn volatile(&self) -> bool;
    /// A one-line description for logs.
    fn describe(&self) -> String;
}
