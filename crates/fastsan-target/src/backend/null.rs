//! The null backend: reads zeros, discards writes. It measures the network
//! path alone.

use super::{push_zeros, Backend, BlockSizes, Result, ZeroFlags};
use crate::request::{Extent, ReadData};

pub struct NullBackend {
    size: u64,
}

impl NullBackend {
    pub fn new(size: u64) -> Self {
        NullBackend { size }
    }
}

impl Backend for NullBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes { minimum: 1, preferred: 4096, maximum: u32::MAX }
    }
    fn can_write(&self) -> bool {
        true
    }
    fn can_flush(&self) -> bool {
        true
    }
    fn can_fua(&self) -> bool {
        true
    }
    fn can_trim(&self) -> bool {
        true
    }
    fn can_zero(&self) -> bool {
        true
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn can_extents(&self) -> bool {
        true
    }
    fn can_cache(&self) -> bool {
        true
    }
    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    fn read_at(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn can_share_reads(&self) -> bool {
        true
    }
    fn read_shared(&self, _offset: u64, len: u64) -> Result<ReadData> {
        let mut out = Vec::new();
        push_zeros(&mut out, len as usize);
        Ok(out.into())
    }
    fn write_at(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        Ok(())
    }
    fn extents(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent { len, hole: true }])
    }
    fn may_block(&self) -> bool {
        false
    }
    fn volatile(&self) -> bool {
        true
    }
    fn generation(&self) -> u64 {
        // Always zeros: every instance holds the same data.
        0
    }
    fn describe(&self) -> String {
        format!("null, {} bytes", self.size)
    }
}
