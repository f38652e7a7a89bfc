//! Any volume a URL names: a BRP volume through the initiator's session
//! (merging, connections, retries after the fence), an export of any NBD
//! server (one connection, no retries: NBD has no fence), or a mirror of
//! those ([`Mirror`]). Every command that takes a volume URL (`cp`,
//! `bench`, `attach`) opens it through [`Remote::connect`].

use crate::mirror::{Mirror, MirrorSpec};
use crate::nbd::NbdVolume;
use crate::{BrpUrl, Error, InitiatorStats, Options, Volume};
use bytes::Bytes;
use std::sync::Arc;

/// One volume on one target (what a mirror's legs are).
#[derive(Clone)]
pub enum Single {
    Brp(Volume),
    Nbd(Arc<NbdVolume>),
}

/// Any volume: one, or a mirror of several.
#[derive(Clone)]
pub enum Remote {
    One(Single),
    Mirror(Mirror),
}

/// Calls the same method on either kind of single volume.
macro_rules! single {
    ($self:expr, $v:ident => $e:expr) => {
        match $self {
            Single::Brp($v) => $e,
            Single::Nbd($v) => $e,
        }
    };
}

/// Calls the same method on a single volume or a mirror.
macro_rules! any {
    ($self:expr, $v:ident => $e:expr) => {
        match $self {
            Remote::One($v) => $e,
            Remote::Mirror($v) => $e,
        }
    };
}

impl Single {
    /// Opens `brp://`, `brp+unix://` or `nbd://` (the options apply to BRP).
    pub async fn connect(url: &str, opts: Options) -> Result<Single, Error> {
        if url.starts_with("nbd://") {
            Ok(Single::Nbd(Arc::new(NbdVolume::connect(url, &opts).await?)))
        } else if BrpUrl::has_scheme(url) {
            Ok(Single::Brp(Volume::connect(url, opts).await?))
        } else {
            Err(Error::Url(format!("{url}: expected brp://..., brp+unix://... or nbd://...")))
        }
    }

    pub fn size(&self) -> u64 {
        single!(self, v => v.size())
    }
    pub fn block_size(&self) -> u32 {
        single!(self, v => v.block_size())
    }
    pub fn read_only(&self) -> bool {
        single!(self, v => v.read_only())
    }
    /// Whether TRIM may be offered (an NBD export says; a BRP volume
    /// answers UNSUPPORTED where it cannot).
    pub fn can_trim(&self) -> bool {
        match self {
            Single::Brp(_) => true,
            Single::Nbd(v) => v.can_trim(),
        }
    }
    /// Whether new requests can still be sent on this handle: a BRP session
    /// reconnects by itself (until it ends for good; one that lost
    /// unflushed writes fails every FLUSH, a new one does not), an NBD
    /// connection that ended never comes back (only a new one does).
    pub fn usable(&self) -> bool {
        match self {
            Single::Brp(v) => !v.lost_unflushed_writes(),
            Single::Nbd(v) => v.connected(),
        }
    }
    /// Whether writes this handle had acknowledged may be lost (a BRP
    /// target's host restarted before they were flushed); an NBD server
    /// cannot tell.
    pub fn lost_writes(&self) -> bool {
        match self {
            Single::Brp(v) => v.lost_unflushed_writes(),
            Single::Nbd(_) => false,
        }
    }
    /// Connections up, and in all.
    pub fn connections(&self) -> (usize, usize) {
        match self {
            Single::Brp(v) => v.connections(),
            Single::Nbd(v) => (v.connected() as usize, 1),
        }
    }
    pub fn stats(&self) -> InitiatorStats {
        match self {
            Single::Brp(v) => v.stats(),
            Single::Nbd(_) => InitiatorStats::default(),
        }
    }
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        single!(self, v => v.read(offset, len).await)
    }
    pub async fn write_bytes(&self, data: Bytes, offset: u64, fua: bool) -> Result<(), Error> {
        single!(self, v => v.write_bytes(data, offset, fua).await)
    }
    pub async fn flush(&self) -> Result<(), Error> {
        single!(self, v => v.flush().await)
    }
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        single!(self, v => v.trim(offset, len).await)
    }
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        single!(self, v => v.write_zeroes(offset, len, fua).await)
    }
}

impl Remote {
    /// Whether `url` is one [`Remote::connect`] opens (brp://, brps://,
    /// brp+unix://, nbd:// or mirror:), whatever else is wrong with it.
    pub fn has_scheme(url: &str) -> bool {
        BrpUrl::has_scheme(url) || url.starts_with("nbd://") || MirrorSpec::is_mirror(url)
    }

    /// Opens `brp://`, `brp+unix://`, `nbd://` or `mirror:` (the options
    /// apply to BRP, and to a mirror's BRP legs).
    pub async fn connect(url: &str, opts: Options) -> Result<Remote, Error> {
        // A URL of a scheme spoken here keeps its own error (a bad port, a
        // missing volume); any other is told which schemes are.
        if !Remote::has_scheme(url) {
            return Err(Error::Url(format!(
                "{url}: expected brp://..., brps://..., brp+unix://..., nbd://... or mirror:..."
            )));
        }
        if MirrorSpec::is_mirror(url) {
            return Ok(Remote::Mirror(Mirror::open(url, opts).await?));
        }
        Single::connect(url, opts).await.map(Remote::One)
    }

    /// The volume's name in a URL: the file name under a FUSE mount.
    pub fn name_in(url: &str) -> Result<String, Error> {
        if MirrorSpec::is_mirror(url) {
            let spec = MirrorSpec::parse(url)?;
            let stem = spec.log.file_stem().map(|s| s.to_string_lossy().into_owned());
            Ok(stem.filter(|s| !s.is_empty()).unwrap_or_else(|| "mirror".into()))
        } else if url.starts_with("nbd://") {
            let (_, export) = crate::nbd::parse_url(url)?;
            Ok(if export.is_empty() || export.contains('/') { "disk".into() } else { export })
        } else {
            Ok(BrpUrl::parse(url)?.volume)
        }
    }

    pub fn size(&self) -> u64 {
        any!(self, v => v.size())
    }
    pub fn block_size(&self) -> u32 {
        any!(self, v => v.block_size())
    }
    pub fn read_only(&self) -> bool {
        match self {
            Remote::One(v) => v.read_only(),
            Remote::Mirror(_) => false,
        }
    }
    pub fn can_trim(&self) -> bool {
        match self {
            Remote::One(v) => v.can_trim(),
            Remote::Mirror(m) => m.can_trim(),
        }
    }
    /// Connections (a mirror: legs) up, and in all.
    pub fn connections(&self) -> (usize, usize) {
        any!(self, v => v.connections())
    }
    pub fn stats(&self) -> InitiatorStats {
        match self {
            Remote::One(v) => v.stats(),
            Remote::Mirror(_) => InitiatorStats::default(),
        }
    }

    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, Error> {
        any!(self, v => v.read(offset, len).await)
    }
    pub async fn write_bytes(&self, data: Bytes, offset: u64, fua: bool) -> Result<(), Error> {
        any!(self, v => v.write_bytes(data, offset, fua).await)
    }
    pub async fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(data), offset, fua).await
    }
    pub async fn flush(&self) -> Result<(), Error> {
        any!(self, v => v.flush().await)
    }
    /// Flushes; a mirror also clears its log of what every leg holds (see
    /// [`Mirror::close`]). Call it when done with the volume.
    pub async fn close(&self) -> Result<(), Error> {
        match self {
            Remote::One(v) => v.flush().await,
            Remote::Mirror(m) => m.close().await,
        }
    }
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), Error> {
        any!(self, v => v.trim(offset, len).await)
    }
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), Error> {
        any!(self, v => v.write_zeroes(offset, len, fua).await)
    }
}
