//! The read-only layer (`,ro`): refuses every change and says so in the
//! capabilities, whatever the store below could do.

use super::{Backend, BackendError, DeviceDone, DeviceIo, Layer, Result, ZeroFlags};
use std::sync::Arc;

pub struct ReadOnlyLayer {
    next: Arc<dyn Backend>,
}

impl ReadOnlyLayer {
    pub fn new(next: Arc<dyn Backend>) -> Self {
        ReadOnlyLayer { next }
    }
}

impl Layer for ReadOnlyLayer {
    fn next(&self) -> &dyn Backend {
        &*self.next
    }
    fn can_write(&self) -> bool {
        false
    }
    fn can_share_reads(&self) -> bool {
        self.next.can_share_reads()
    }
    fn can_read_now(&self) -> bool {
        self.next.can_read_now()
    }
    fn can_submit(&self) -> bool {
        self.next.can_submit()
    }
    fn kick(&self) {
        self.next.kick()
    }
    fn submit(&self, client: u64, io: DeviceIo, done: DeviceDone) {
        match io {
            DeviceIo::Read { .. } => self.next.submit(client, io, done),
            DeviceIo::Write { .. } => done(Err(BackendError::ReadOnly)),
        }
    }
    fn can_trim(&self) -> bool {
        false
    }
    fn can_zero(&self) -> bool {
        false
    }
    fn can_fast_zero(&self) -> bool {
        false
    }
    fn write_at(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        Err(BackendError::ReadOnly)
    }
    fn trim(&self, _offset: u64, _len: u64) -> Result<()> {
        Err(BackendError::ReadOnly)
    }
    fn write_zeroes(&self, _offset: u64, _len: u64, _flags: ZeroFlags) -> Result<()> {
        Err(BackendError::ReadOnly)
    }
}
