//! A remote volume as a store: another target's volume, through the
//! initiator (its connections, merging, credits, retries after the fence).
//! It makes `fastsan serve` a gateway: `--volume v=brp://other:10810/v`
//! re-exports a remote volume over BRP and NBD, and every layer (read-only,
//! faults, delay, stats) stacks on it as on any store.
//!
//! Backend calls are synchronous and run on the volume's I/O threads
//! ([`Backend::may_block`]); each waits for its request on a small runtime
//! of the backend's own, where the initiator's connections live. So the
//! requests in flight to the remote target are as many as the volume has
//! I/O threads (`io_threads`, 16 by default).

use super::{Backend, BackendError, BlockSizes, Result, ZeroFlags};
use crate::request::{Extent, ReadData};
use fastsan_initiator::{Error, Options, Status, Volume, VOLUME_VOLATILE};
use std::future::Future;
use std::io;

pub struct RemoteBackend {
    vol: Volume,
    url: String,
    /// Where the initiator's connections run; shut down in the background
    /// when the backend goes (it may go inside another runtime).
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
}

impl RemoteBackend {
    /// Opens `url` (`brp://` or `brp+unix://`).
    pub fn connect(url: &str, opts: Options) -> io::Result<RemoteBackend> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("remote-volume")
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        // On a thread of its own: this may be called inside a runtime,
        // where blocking on another one is not allowed.
        let (h, u) = (handle.clone(), url.to_owned());
        let opened = std::thread::spawn(move || h.block_on(Volume::connect(&u, opts)))
            .join()
            .map_err(|_| io::Error::other("the remote volume's connect thread panicked"))
            .and_then(|r| {
                r.map_err(|e| {
                    io::Error::other(format!(
                        "cannot open the remote volume {url}: {}",
                        fastsan_initiator::error::chain(&e)
                    ))
                })
            });
        match opened {
            Ok(vol) => Ok(RemoteBackend { vol, url: url.to_owned(), rt: Some(rt), handle }),
            Err(e) => {
                // Not dropped here: that blocks, which a runtime forbids.
                rt.shutdown_background();
                Err(e)
            }
        }
    }

    fn wait<T>(&self, f: impl Future<Output = std::result::Result<T, Error>>) -> Result<T> {
        self.handle.block_on(f).map_err(|e| {
            tracing::warn!(volume = %self.url, error = &e as &dyn std::error::Error, "the remote volume failed a request");
            backend_error(&e)
        })
    }
}

/// A remote failure as the store's error. A remote target that cannot be
/// reached (past the reconnect timeout) is [`BackendError::Unavailable`]:
/// a FLUSH that fails so is not latched, so the gateway's volume flushes
/// again once the remote is back (it latched until a restart before); a
/// reboot of the remote's host with unflushed writes is the session's own
/// error (`UnflushedWritesLost`), an I/O error, latched.
fn backend_error(e: &Error) -> BackendError {
    match e {
        Error::Status(s) if *s == Status::NO_SPACE => BackendError::NoSpace,
        Error::Status(s) if *s == Status::READ_ONLY => BackendError::ReadOnly,
        Error::Status(s) if *s == Status::UNSUPPORTED => BackendError::Unsupported,
        Error::Unreachable { .. } | Error::ConnectionLost | Error::Lost(_) | Error::Timeout(_) => {
            BackendError::Unavailable
        }
        _ => BackendError::Io(libc::EIO),
    }
}

impl Drop for RemoteBackend {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The remote session of gateway volume `name` (`url`) served at `origin`
/// (this host's boot and name, and its BRP address): the same for every
/// start of the same gateway on the same boot, so that a restarted one
/// takes over its predecessor's session on the remote target, whose fence
/// then holds its OPENs until every write the predecessor left running
/// there has finished. With a new session each start (until 2026-11-29), a
/// write a killed gateway had sent could land after one its successor
/// acknowledged (a helper's review). Another gateway (another host, boot,
/// address or volume) gets another session; the boot id (random, readable
/// on this host only) and the secret keep it from being guessed by other
/// clients of the remote target, who could otherwise take its slots.
pub fn gateway_session(origin: &str, name: &str, url: &str, secret: Option<&[u8]>) -> u64 {
    use sha2::{Digest, Sha256};
    let h: [u8; 32] = Sha256::new()
        .chain_update(b"fastsan gateway session\0")
        .chain_update(origin)
        .chain_update(b"\0")
        .chain_update(name)
        .chain_update(b"\0")
        .chain_update(url)
        .chain_update(b"\0")
        .chain_update(secret.unwrap_or_default())
        .finalize()
        .into();
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes")).max(1)
}

impl Backend for RemoteBackend {
    fn size(&self) -> u64 {
        self.vol.size()
    }
    fn block_sizes(&self) -> BlockSizes {
        let bs = self.vol.block_size();
        BlockSizes { minimum: bs, preferred: bs.max(4096), maximum: self.vol.info().max_transfer }
    }
    fn can_write(&self) -> bool {
        !self.vol.read_only()
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
        false
    }
    fn can_extents(&self) -> bool {
        false
    }
    fn can_cache(&self) -> bool {
        false
    }
    fn may_block(&self) -> bool {
        true
    }
    fn volatile(&self) -> bool {
        self.vol.info().flags & VOLUME_VOLATILE != 0
    }
    fn generation(&self) -> u64 {
        // The remote volume's own: the same data for as long as it is.
        self.vol.info().generation
    }
    fn boot(&self) -> Option<u64> {
        Some(self.vol.info().boot)
    }
    fn describe(&self) -> String {
        format!("remote {}", self.url)
    }

    fn can_share_reads(&self) -> bool {
        false
    }
    fn read_shared(&self, _offset: u64, _len: u64) -> Result<ReadData> {
        Err(BackendError::Unsupported)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.wait(self.vol.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.wait(self.vol.write_at(buf, offset, fua))
    }
    fn flush(&self) -> Result<()> {
        self.wait(self.vol.flush())
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.wait(self.vol.trim(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        if flags.fast_only {
            return Err(BackendError::Unsupported);
        }
        self.wait(self.vol.write_zeroes(offset, len, flags.fua))
    }
    fn extents(&self, _offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(vec![Extent { len, hole: false }])
    }
    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_away_is_unavailable_and_a_lost_write_is_an_io_error() {
        let away = Error::Unreachable { cause: None, reconnect: std::time::Duration::from_secs(30) };
        assert_eq!(backend_error(&away), BackendError::Unavailable, "a flush failed so is not latched");
        assert_eq!(backend_error(&Error::Timeout("handshake")), BackendError::Unavailable);
        let lost = Error::UnflushedWritesLost { volume: "v".into() };
        assert_eq!(backend_error(&lost), BackendError::Io(libc::EIO), "latched");
        assert_eq!(backend_error(&Error::Status(Status::IO_ERROR)), BackendError::Io(libc::EIO));
        assert_eq!(backend_error(&Error::Status(Status::NO_SPACE)), BackendError::NoSpace);
    }
}
