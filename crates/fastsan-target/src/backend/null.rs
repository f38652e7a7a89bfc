//! The null backend: reads zeros, discards writes. It measures the network
//! path alone.

use super::{Backend, ZeroFlags};
use crate::request::Extent;
use std::io;

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
    fn read_at(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, _buf: &[u8], _offset: u64, _fua: bool) -> io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> io::Result<()> {
        Ok(())
    }
    fn extents(&self, _offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        Ok(vec![Extent { len, hole: true }])
    }
    fn may_block(&self) -> bool {
        false
    }
    fn volatile(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        format!("null, {} bytes", self.size)
    }
}
