//! Volumes, and the one place where a request is checked against a volume:
//! [`Volume::validate`] turns a decoded [`IoRequest`] into an [`Op`] or a
//! [`Refusal`], before any I/O.

use crate::backend::{Backend, FileBackend, MemoryBackend, NullBackend, ZeroFlags};
use crate::config::{BackendSpec, VolumeSpec};
use crate::exec::Op;
use crate::request::{IoKind, IoRequest, Limits, Refusal};
use fastsan_brp::handshake::{VolumeInfo, VOLUME_READ_ONLY, VOLUME_VOLATILE};
use std::io;
use std::sync::Arc;

pub struct Volume {
    pub name: String,
    pub backend: Arc<dyn Backend>,
    pub read_only: bool,
    pub size: u64,
    pub block_size: u32,
    pub max_transfer: u32,
}

impl Volume {
    pub fn open(spec: &VolumeSpec, max_transfer: u32) -> io::Result<Volume> {
        let backend: Arc<dyn Backend> = match &spec.backend {
            BackendSpec::Memory { size } => {
                check_memory(*size)?;
                Arc::new(MemoryBackend::new(*size))
            }
            BackendSpec::Null { size } => Arc::new(NullBackend::new(*size)),
            BackendSpec::File { path, direct } => {
                let f = FileBackend::open(path, spec.read_only, *direct)
                    .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
                Arc::new(f)
            }
        };
        Ok(Volume::new(spec.name.clone(), backend, spec.read_only, max_transfer))
    }

    pub fn new(name: String, backend: Arc<dyn Backend>, read_only: bool, max_transfer: u32) -> Self {
        let block_size = backend.block_size();
        // Round the usable size down to whole blocks.
        let size = backend.size() / block_size as u64 * block_size as u64;
        let max_transfer = max_transfer / block_size * block_size;
        Volume { name, backend, read_only, size, block_size, max_transfer }
    }

    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.read_only {
            f |= VOLUME_READ_ONLY;
        }
        if self.backend.volatile() {
            f |= VOLUME_VOLATILE;
        }
        f
    }

    pub fn info(&self) -> VolumeInfo {
        VolumeInfo {
            name: self.name.clone(),
            size: self.size,
            block_size: self.block_size,
            flags: self.flags(),
        }
    }

    /// Checks a decoded request against the volume and the front end's
    /// limits: read-only, length, alignment, range. A refused request has no effect.
    pub fn validate(&self, r: IoRequest, limits: &Limits) -> Result<Op, Refusal> {
        if r.kind.writes() && self.read_only {
            return Err(Refusal::ReadOnly);
        }
        let IoRequest { kind, offset, length, fua, payload } = r;
        if kind == IoKind::Flush {
            return Ok(Op::Flush);
        }
        // READ and WRITE move data through memory: bound them; the others may span the volume.
        let moves_data = matches!(kind, IoKind::Read | IoKind::Write);
        let max = if moves_data { limits.max_io as u64 } else { u32::MAX as u64 };
        if length == 0 {
            return Err(Refusal::Invalid);
        }
        if length > max {
            return Err(Refusal::TooLarge);
        }
        let align = limits.align.max(1) as u64;
        if !offset.is_multiple_of(align) || !length.is_multiple_of(align) {
            return Err(Refusal::Misaligned);
        }
        match offset.checked_add(length) {
            Some(end) if end <= self.size => {}
            _ => return Err(Refusal::OutOfRange),
        }
        Ok(match kind {
            IoKind::Read => Op::Read { offset, len: length as u32 },
            IoKind::Write if payload.len() as u64 != length => return Err(Refusal::Invalid),
            IoKind::Write => Op::Write { offset, data: payload, fua },
            IoKind::Trim => Op::Trim { offset, len: length },
            IoKind::WriteZeroes { no_hole, fast_only } => {
                Op::WriteZeroes { offset, len: length, flags: ZeroFlags { fua, no_hole, fast_only } }
            }
            IoKind::Cache => Op::Cache,
            IoKind::BlockStatus { one } => Op::BlockStatus { offset, len: length, one },
            IoKind::Flush => Op::Flush,
        })
    }
}

/// Refuses a memory volume larger than the machine's RAM: it could never be filled.
fn check_memory(size: u64) -> io::Result<()> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    match total {
        Some(ram) if size > ram => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a memory volume of {size} bytes exceeds this machine's RAM ({ram} bytes)"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn vol(read_only: bool) -> Volume {
        Volume::new("v".into(), Arc::new(MemoryBackend::new(1 << 20)), read_only, 65536)
    }

    const BRP: Limits = Limits { align: 512, max_io: 65536 };

    fn check(v: &Volume, kind: IoKind, offset: u64, length: u64) -> Result<Op, Refusal> {
        let payload =
            if kind == IoKind::Write { Bytes::from(vec![0u8; length as usize]) } else { Bytes::new() };
        v.validate(IoRequest { kind, offset, length, fua: false, payload }, &BRP)
    }

    #[test]
    fn each_bad_request_gets_its_refusal() {
        let v = vol(false);
        assert!(check(&v, IoKind::Read, 0, 4096).is_ok());
        assert!(check(&v, IoKind::Write, 512, 512).is_ok());
        assert_eq!(check(&v, IoKind::Read, 0, 0).err(), Some(Refusal::Invalid));
        assert_eq!(check(&v, IoKind::Read, 1, 512).err(), Some(Refusal::Misaligned));
        assert_eq!(check(&v, IoKind::Read, 0, 100).err(), Some(Refusal::Misaligned));
        assert_eq!(check(&v, IoKind::Read, 1 << 20, 512).err(), Some(Refusal::OutOfRange));
        assert_eq!(check(&v, IoKind::Read, u64::MAX - 511, 512).err(), Some(Refusal::OutOfRange));
        assert_eq!(check(&v, IoKind::Read, 0, 1 << 17).err(), Some(Refusal::TooLarge));
        assert!(check(&v, IoKind::Trim, 0, 1 << 20).is_ok(), "trim is not bound by max transfer");
        assert!(check(&v, IoKind::BlockStatus { one: false }, 0, 1 << 20).is_ok());
        let short = IoRequest {
            kind: IoKind::Write,
            offset: 0,
            length: 1024,
            fua: false,
            payload: Bytes::from(vec![0; 512]),
        };
        assert_eq!(v.validate(short, &BRP).err(), Some(Refusal::Invalid));
        let bytes = Limits { align: 1, max_io: 1 << 20 };
        let odd = IoRequest { kind: IoKind::Read, offset: 3, length: 5, fua: false, payload: Bytes::new() };
        assert!(v.validate(odd, &bytes).is_ok(), "byte-granular front ends may read any range");
    }

    #[test]
    fn read_only_refuses_every_change() {
        let v = vol(true);
        assert!(check(&v, IoKind::Read, 0, 512).is_ok());
        assert!(check(&v, IoKind::Flush, 0, 0).is_ok());
        assert!(check(&v, IoKind::Cache, 0, 512).is_ok());
        let zero = IoKind::WriteZeroes { no_hole: false, fast_only: false };
        for k in [IoKind::Write, IoKind::Trim, zero] {
            assert_eq!(check(&v, k, 0, 512).err(), Some(Refusal::ReadOnly), "{k:?}");
        }
    }

    #[test]
    fn huge_memory_volume_is_refused() {
        assert!(check_memory(1 << 60).is_err());
        assert!(check_memory(1 << 20).is_ok());
    }
}
