//! Volumes, and the one place where a request is checked: [`Volume::validate`]
//! turns a decoded request header into an [`Op`] or a status, before any I/O.

use crate::backend::{Backend, FileBackend, MemoryBackend, NullBackend};
use crate::config::{BackendSpec, VolumeSpec};
use crate::exec::Op;
use brp::handshake::{VolumeInfo, VOLUME_READ_ONLY, VOLUME_VOLATILE};
use brp::request::{RequestHeader, FLAGS_KNOWN};
use brp::{Command, Status};
use bytes::Bytes;
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
                let f = FileBackend::open(path, spec.read_only, *direct).map_err(|e| {
                    io::Error::new(e.kind(), format!("opening {}: {e}", path.display()))
                })?;
                Arc::new(f)
            }
        };
        Ok(Volume::new(
            spec.name.clone(),
            backend,
            spec.read_only,
            max_transfer,
        ))
    }

    pub fn new(
        name: String,
        backend: Arc<dyn Backend>,
        read_only: bool,
        max_transfer: u32,
    ) -> Self {
        let block_size = backend.block_size();
        // Round the usable size down to whole blocks.
        let size = backend.size() / block_size as u64 * block_size as u64;
        let max_transfer = max_transfer / block_size * block_size;
        Volume {
            name,
            backend,
            read_only,
            size,
            block_size,
            max_transfer,
        }
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

    /// Checks one (non-BATCH) request completely: flags, command, read-only,
    /// length, alignment, range. `payload` is the frame's payload, already
    /// consumed from the stream whatever the verdict.
    pub fn validate(&self, h: &RequestHeader, payload: Bytes) -> Result<Op, Status> {
        if let Command::Unknown(_) = h.command {
            return Err(Status::UNSUPPORTED);
        }
        if h.flags & !FLAGS_KNOWN != 0 {
            return Err(Status::INVALID);
        }
        if h.command != Command::Write && h.payload_len != 0 {
            return Err(Status::INVALID);
        }
        let fua = h.is_fua();
        match h.command {
            Command::Read => {
                self.check_range(h, self.max_transfer)?;
                Ok(Op::Read {
                    offset: h.offset,
                    len: h.length,
                })
            }
            Command::Write => {
                self.check_writable()?;
                if h.payload_len != h.length {
                    return Err(Status::INVALID);
                }
                self.check_range(h, self.max_transfer)?;
                Ok(Op::Write {
                    offset: h.offset,
                    data: payload,
                    fua,
                })
            }
            Command::Flush => Ok(Op::Flush),
            Command::Trim => {
                self.check_writable()?;
                self.check_range(h, u32::MAX)?;
                Ok(Op::Trim {
                    offset: h.offset,
                    len: h.length as u64,
                })
            }
            Command::WriteZeroes => {
                self.check_writable()?;
                self.check_range(h, u32::MAX)?;
                Ok(Op::WriteZeroes {
                    offset: h.offset,
                    len: h.length as u64,
                    fua,
                })
            }
            Command::Batch | Command::Unknown(_) => Err(Status::INVALID),
        }
    }

    fn check_writable(&self) -> Result<(), Status> {
        if self.read_only {
            Err(Status::READ_ONLY)
        } else {
            Ok(())
        }
    }

    fn check_range(&self, h: &RequestHeader, max_len: u32) -> Result<(), Status> {
        if h.length == 0 {
            return Err(Status::INVALID);
        }
        if h.length > max_len {
            return Err(Status::TOO_LARGE);
        }
        let bs = self.block_size as u64;
        if !h.offset.is_multiple_of(bs) || !(h.length as u64).is_multiple_of(bs) {
            return Err(Status::MISALIGNED);
        }
        match h.offset.checked_add(h.length as u64) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Status::OUT_OF_RANGE),
        }
    }
}

/// Refuses a memory volume larger than the machine's RAM: it could never be filled.
fn check_memory(size: u64) -> io::Result<()> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kib| kib * 1024)
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
    use brp::request::FLAG_FUA;

    fn vol(read_only: bool) -> Volume {
        Volume::new(
            "v".into(),
            Arc::new(MemoryBackend::new(1 << 20)),
            read_only,
            65536,
        )
    }

    fn check(v: &Volume, cmd: Command, flags: u8, offset: u64, length: u32) -> Result<Op, Status> {
        let mut h = RequestHeader::new(cmd, flags, 1, offset, length);
        if cmd != Command::Write {
            h.payload_len = 0;
        }
        v.validate(&h, Bytes::from(vec![0u8; h.payload_len as usize]))
    }

    #[test]
    fn each_bad_request_gets_its_status() {
        let v = vol(false);
        assert!(check(&v, Command::Read, 0, 0, 4096).is_ok());
        assert!(check(&v, Command::Write, FLAG_FUA, 512, 512).is_ok());
        assert_eq!(
            check(&v, Command::Read, 0x80, 0, 512).err(),
            Some(Status::INVALID)
        );
        assert_eq!(
            check(&v, Command::Read, 0, 0, 0).err(),
            Some(Status::INVALID)
        );
        assert_eq!(
            check(&v, Command::Read, 0, 1, 512).err(),
            Some(Status::MISALIGNED)
        );
        assert_eq!(
            check(&v, Command::Read, 0, 0, 100).err(),
            Some(Status::MISALIGNED)
        );
        assert_eq!(
            check(&v, Command::Read, 0, 1 << 20, 512).err(),
            Some(Status::OUT_OF_RANGE)
        );
        assert_eq!(
            check(&v, Command::Read, 0, u64::MAX - 511, 512).err(),
            Some(Status::OUT_OF_RANGE)
        );
        assert_eq!(
            check(&v, Command::Read, 0, 0, 1 << 17).err(),
            Some(Status::TOO_LARGE)
        );
        assert!(
            check(&v, Command::Trim, 0, 0, 1 << 20).is_ok(),
            "trim is not bound by max transfer"
        );
        assert_eq!(
            check(&v, Command::Unknown(99), 0, 0, 512).err(),
            Some(Status::UNSUPPORTED)
        );
        assert_eq!(
            check(&v, Command::Batch, 0, 0, 512).err(),
            Some(Status::INVALID)
        );
        let mut h = RequestHeader::new(Command::Write, 0, 1, 0, 1024);
        h.payload_len = 512;
        assert_eq!(
            v.validate(&h, Bytes::from(vec![0; 512])).err(),
            Some(Status::INVALID)
        );
    }

    #[test]
    fn read_only_refuses_every_change() {
        let v = vol(true);
        assert!(check(&v, Command::Read, 0, 0, 512).is_ok());
        assert!(check(&v, Command::Flush, 0, 0, 0).is_ok());
        for c in [Command::Write, Command::Trim, Command::WriteZeroes] {
            assert_eq!(
                check(&v, c, 0, 0, 512).err(),
                Some(Status::READ_ONLY),
                "{c:?}"
            );
        }
    }

    #[test]
    fn huge_memory_volume_is_refused() {
        assert!(check_memory(1 << 60).is_err());
        assert!(check_memory(1 << 20).is_ok());
    }
}
