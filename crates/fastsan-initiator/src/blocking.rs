//! The same volume API for code that is not async: each call blocks the
//! calling thread while a small runtime of its own drives the session.

use crate::{Error, Options, Volume};
use fastsan_brp::OpenInfo;

pub struct BlockingVolume {
    rt: tokio::runtime::Runtime,
    vol: Volume,
}

impl BlockingVolume {
    pub fn connect(url: &str, opts: Options) -> Result<Self, Error> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fastsan-initiator")
            .enable_all()
            .build()?;
        let vol = rt.block_on(Volume::connect(url, opts))?;
        Ok(BlockingVolume { rt, vol })
    }

    pub fn info(&self) -> &OpenInfo {
        self.vol.info()
    }
    pub fn size(&self) -> u64 {
        self.vol.size()
    }
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), Error> {
        self.rt.block_on(self.vol.read_at(buf, offset))
    }
    pub fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.rt.block_on(self.vol.write_at(data, offset, fua))
    }
    pub fn flush(&self) -> Result<(), Error> {
        self.rt.block_on(self.vol.flush())
    }
    pub fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        self.rt.block_on(self.vol.trim(offset, len))
    }
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        self.rt.block_on(self.vol.write_zeroes(offset, len, fua))
    }
    /// The async volume underneath, to share with async code.
    pub fn volume(&self) -> &Volume {
        &self.vol
    }
}
