//! The delay layer (`,delay=DURATION`): adds a fixed latency to every
//! operation that touches data (read, write, flush, trim, zero), like
//! nbdkit's delay filter. It is how a slow device is simulated in tests and
//! benchmarks. It sleeps, so the volume runs on the I/O pool.

use super::{Backend, Layer, Result, ZeroFlags};
use std::sync::Arc;
use std::time::Duration;

pub struct DelayLayer {
    next: Arc<dyn Backend>,
    delay: Duration,
}

impl DelayLayer {
    pub fn new(next: Arc<dyn Backend>, delay: Duration) -> Self {
        DelayLayer { next, delay }
    }

    fn wait(&self) {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
    }
}

impl Layer for DelayLayer {
    fn next(&self) -> &dyn Backend {
        &*self.next
    }
    fn may_block(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        format!("{}, delayed {:?}", self.next.describe(), self.delay)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.wait();
        self.next.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.wait();
        self.next.write_at(buf, offset, fua)
    }
    fn flush(&self) -> Result<()> {
        self.wait();
        self.next.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.wait();
        self.next.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.wait();
        self.next.write_zeroes(offset, len, flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    #[test]
    fn every_data_operation_waits_and_still_happens() {
        let d: Arc<dyn Backend> =
            Arc::new(DelayLayer::new(Arc::new(MemoryBackend::new(1 << 20)), Duration::from_millis(20)));
        let t = std::time::Instant::now();
        d.write_at(&[5; 4096], 0, false).unwrap();
        let mut back = [0u8; 4096];
        d.read_at(&mut back, 0).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(40), "two delayed operations");
        assert_eq!(back, [5; 4096]);
        assert!(d.may_block(), "a sleeping layer must not run on the reactor");
    }
}
