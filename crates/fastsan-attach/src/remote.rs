//! The volume an attachment serves: a BRP volume through the initiator's
//! session (merging, connections, retries after the fence), or an export
//! of any NBD server (one connection, no retries: NBD has no fence).

use bytes::Bytes;
use fastsan_initiator::nbd::NbdVolume;
use fastsan_initiator::{BrpUrl, Error, InitiatorStats, Options, Volume};
use std::sync::Arc;

#[derive(Clone)]
pub enum Remote {
    Brp(Volume),
    Nbd(Arc<NbdVolume>),
}

impl Remote {
    /// Opens `brp://`, `brp+unix://` or `nbd://` (the options apply to BRP).
    pub async fn connect(url: &str, opts: Options) -> Result<Remote, Error> {
        if url.starts_with("nbd://") {
            Ok(Remote::Nbd(Arc::new(NbdVolume::connect(url, &opts).await?)))
        } else {
            Ok(Remote::Brp(Volume::connect(url, opts).await?))
        }
    }

    /// The volume's name in a URL: the file name under a FUSE mount.
    pub fn name_in(url: &str) -> Result<String, Error> {
        if url.starts_with("nbd://") {
            let (_, export) = fastsan_initiator::nbd::parse_url(url)?;
            Ok(if export.is_empty() || export.contains('/') { "disk".into() } else { export })
        } else {
            Ok(BrpUrl::parse(url)?.volume)
        }
    }

    pub fn size(&self) -> u64 {
        match self {
            Remote::Brp(v) => v.size(),
            Remote::Nbd(v) => v.size(),
        }
    }
    pub fn block_size(&self) -> u32 {
        match self {
            Remote::Brp(v) => v.block_size(),
            Remote::Nbd(v) => v.block_size(),
        }
    }
    pub fn read_only(&self) -> bool {
        match self {
            Remote::Brp(v) => v.read_only(),
            Remote::Nbd(v) => v.read_only(),
        }
    }
    /// Whether TRIM may be offered (an NBD export says; a BRP volume
    /// answers UNSUPPORTED where it cannot).
    pub fn can_trim(&self) -> bool {
        match self {
            Remote::Brp(_) => true,
            Remote::Nbd(v) => v.can_trim(),
        }
    }
    /// Connections up, and in all.
    pub fn connections(&self) -> (usize, usize) {
        match self {
            Remote::Brp(v) => v.connections(),
            Remote::Nbd(v) => (v.connected() as usize, 1),
        }
    }
    pub fn stats(&self) -> InitiatorStats {
        match self {
            Remote::Brp(v) => v.stats(),
            Remote::Nbd(_) => InitiatorStats::default(),
        }
    }

    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        match self {
            Remote::Brp(v) => v.read(offset, len).await,
            Remote::Nbd(v) => v.read(offset, len).await,
        }
    }
    pub async fn write_bytes(&self, data: Bytes, offset: u64, fua: bool) -> Result<(), Error> {
        match self {
            Remote::Brp(v) => v.write_bytes(data, offset, fua).await,
            Remote::Nbd(v) => v.write_bytes(data, offset, fua).await,
        }
    }
    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }
    pub async fn flush(&self) -> Result<(), Error> {
        match self {
            Remote::Brp(v) => v.flush().await,
            Remote::Nbd(v) => v.flush().await,
        }
    }
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        match self {
            Remote::Brp(v) => v.trim(offset, len).await,
            Remote::Nbd(v) => v.trim(offset, len).await,
        }
    }
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        match self {
            Remote::Brp(v) => v.write_zeroes(offset, len, fua).await,
            Remote::Nbd(v) => v.write_zeroes(offset, len, fua).await,
        }
    }
}
