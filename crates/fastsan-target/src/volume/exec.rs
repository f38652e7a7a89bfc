//! The one place where a request touches the device: [`Volume::execute`]
//! runs a validated [`Op`] on the volume's backend stack.

use super::{Op, OpKind, Volume};
use crate::backend::{BackendError, DeviceIo};
use crate::pool::PooledBuf;
use crate::request::{Extent, ReadData, Refusal};
use bytes::Bytes;

/// Reads at least this long are sent from the store's own memory where it
/// can lend it ([`crate::backend::Backend::read_shared`]), not copied into a
/// reply buffer. From 64 KiB until 2026-11-27: at 4 KiB, random 4K reads
/// took 9-15% less of the target's CPU, the copy out of a cold volume being
/// a quarter of it (docs/benchmarks.md, "4K reads sent from the volume's
/// memory"). A write to a lent chunk copies it; the memory backend keeps
/// that cheap (spare blocks) and bounded (a cap on what it lends). Shorter
/// reads are copied: a reference per piece costs more than a few hundred
/// bytes.
pub const SHARE_READS_FROM: u32 = 4 * 1024;

/// What a successful operation gives back.
#[derive(Debug)]
pub enum Outcome {
    Done,
    Data(ReadData),
    Extents(Vec<Extent>),
}

/// Longest read [`Volume::read_now`] serves (and write
/// [`Volume::write_now`] takes): a longer copy would hold the receiving
/// thread (and the connections it serves) for long; the pool copies it
/// instead.
pub const READ_NOW_AT_MOST: u32 = 128 * 1024;

impl Volume {
    /// Serves a read on the calling thread when its bytes are all at hand
    /// (a file's page cache): no hand-off to the I/O pool and back, which is
    /// most of what a small cached read costs (two thread wake-ups). `None`
    /// when it would have to wait for the device, or is not such a read: run
    /// it with [`Volume::execute`] on the pool.
    pub fn read_now(&self, op: &Op) -> Option<Result<Outcome, Refusal>> {
        let OpKind::Read { offset, len } = op.kind else { return None };
        if !self.caps.read_now || len > READ_NOW_AT_MOST {
            return None;
        }
        if self.failed() {
            return Some(Err(BackendError::WritebackLost.into()));
        }
        let mut buf = PooledBuf::take(len as usize);
        match self.backend.read_now(buf.as_mut(), offset) {
            Ok(true) => Some(Ok(Outcome::Data(Bytes::from_owner(buf).into()))),
            Ok(false) => None,
            Err(e) => Some(Err(e.into())),
        }
    }

    /// Writes a plain write on the calling thread when the store takes it
    /// without waiting (a buffered file's page cache, on file systems whose
    /// kernel allows it: XFS, not ext4): no hand-off to the I/O pool and
    /// back, as for [`Volume::read_now`]. `None` when it would wait, or is
    /// not such a write (FUA keeps its flush logic on the pool): run it with
    /// [`Volume::execute`] on the pool, which writes it whole again if part
    /// of it got in.
    pub fn write_now(&self, op: &Op) -> Option<Result<Outcome, Refusal>> {
        let OpKind::Write { offset, ref data, fua: false } = op.kind else { return None };
        if !self.caps.write_now || data.len() > READ_NOW_AT_MOST as usize {
            return None;
        }
        if self.failed() {
            return Some(Err(BackendError::WritebackLost.into()));
        }
        match self.backend.write_now(data, offset) {
            Ok(true) => Some(Ok(Outcome::Done)),
            Ok(false) | Err(_) => None,
        }
    }

    /// Whether `op` can go to the device without an I/O thread
    /// ([`Volume::submit`]): a plain read, or a plain write where the store
    /// takes writes too (FUA and the rest keep their flush logic on the I/O
    /// pool), of a volume whose store keeps its own I/Os in flight.
    pub fn can_submit(&self, op: &Op) -> bool {
        match op.kind {
            OpKind::Read { .. } => self.caps.submit,
            OpKind::Write { fua: false, .. } => self.caps.submit_writes,
            _ => false,
        }
    }

    /// Starts an operation [`Volume::can_submit`] takes, client `client`'s,
    /// and returns at once; `done` gets its outcome, as [`Volume::execute`]
    /// would give it, on a thread of the store's (its ring's completion
    /// thread, or one that may wait). The device may see it only at the next
    /// [`Volume::kick`].
    pub fn submit(&self, client: u64, op: Op, done: Box<dyn FnOnce(Result<Outcome, Refusal>) + Send>) {
        if self.failed() {
            return done(Err(BackendError::WritebackLost.into()));
        }
        let (io, reads) = match op.kind {
            OpKind::Read { offset, len } => (DeviceIo::Read { offset, len }, len),
            OpKind::Write { offset, data, fua: false } => (DeviceIo::Write { offset, data }, 0),
            _ => return done(Err(BackendError::Unsupported.into())),
        };
        self.backend.submit(
            client,
            io,
            Box::new(move |r| {
                done(match r {
                    Ok(Some(data)) => whole(data, reads).map(Outcome::Data),
                    Ok(None) => Ok(Outcome::Done),
                    Err(e) => Err(e.into()),
                })
            }),
        )
    }

    /// Starts the operations [`Volume::submit`] has handed to the store
    /// since the last kick, all together (one system call for a ring).
    pub fn kick(&self) {
        self.backend.kick()
    }

    /// Runs a validated operation, waiting for the flush it needs, if any
    /// (see [`Volume::execute_before_flush`]).
    pub fn execute(&self, op: Op) -> Result<Outcome, Refusal> {
        let (outcome, flush) = self.execute_before_flush(op)?;
        if flush {
            self.flush()?;
        }
        Ok(outcome)
    }

    /// Runs a validated operation up to the flush that makes it durable,
    /// and says whether that flush is still owed ([`Volume::flush_then`]):
    /// a FLUSH is nothing but that flush, and FUA is a write followed by
    /// one where the volume can flush (a TRIM with FUA always is one). A
    /// volume that cannot map its extents reports its range as one
    /// allocated extent. After a failed flush every operation fails
    /// ([`Volume::failed`]), once the failure is recorded.
    pub fn execute_before_flush(&self, op: Op) -> Result<(Outcome, bool), Refusal> {
        if self.failed() {
            return Err(self.flusher.refusal().into());
        }
        let b = &*self.backend;
        let done = Outcome::Done;
        let flushed = |outcome| Ok((outcome, true));
        Ok((
            match op.kind {
                OpKind::Read { offset, len } if len >= SHARE_READS_FROM && self.caps.share_reads => {
                    Outcome::Data(whole(b.read_shared(offset, len.into())?, len)?)
                }
                OpKind::Read { offset, len } => {
                    let mut buf = PooledBuf::take(len as usize);
                    b.read_at(buf.as_mut(), offset)?;
                    Outcome::Data(Bytes::from_owner(buf).into())
                }
                OpKind::Write { offset, data, fua: false } => {
                    b.write_at(&data, offset, false)?;
                    done
                }
                // FUA: the write, then a flush, so that a failed write (ENOSPC)
                // is told apart from a failed writeback (latched by `Volume::flush`).
                OpKind::Write { offset, data, fua: true } if self.caps.flush => {
                    b.write_at(&data, offset, false)?;
                    return flushed(done);
                }
                OpKind::Write { offset, data, fua: true } => {
                    self.durable(|| b.write_at(&data, offset, true))?;
                    done
                }
                OpKind::Flush => return flushed(done),
                OpKind::Trim { offset, len, fua } => {
                    // A store that cannot (a file system that punches no
                    // holes) answers as a volume without TRIM does: the
                    // client may go on without it (a mirror's leg is not
                    // degraded for it); it is no I/O error.
                    b.trim(offset, len).map_err(|e| match e {
                        crate::backend::BackendError::Unsupported => Refusal::Unsupported("TRIM"),
                        e => e.into(),
                    })?;
                    return Ok((done, fua));
                }
                OpKind::WriteZeroes { offset, len, mut flags } if flags.fua && self.caps.flush => {
                    flags.fua = false;
                    zero(b, offset, len, flags)?;
                    return flushed(done);
                }
                OpKind::WriteZeroes { offset, len, flags } if flags.fua => {
                    self.durable(|| zero(b, offset, len, flags))?;
                    done
                }
                OpKind::WriteZeroes { offset, len, flags } => {
                    zero(b, offset, len, flags)?;
                    done
                }
                OpKind::Cache { offset, len } => {
                    b.cache(offset, len)?;
                    done
                }
                OpKind::BlockStatus { offset, len, one } => {
                    let mut e = if self.caps.extents {
                        b.extents(offset, len)?
                    } else {
                        vec![Extent { len, hole: false }]
                    };
                    if one {
                        e.truncate(1);
                    }
                    Outcome::Extents(e)
                }
            },
            false,
        ))
    }
}

/// A read's data, checked to be as long as the read: a store that gave
/// less (or more) is a device failure, not a reply whose length differs
/// from the request's, which would put the client's stream out of step
/// (an NBD client would take the next reply's header for data).
fn whole(data: ReadData, len: u32) -> Result<ReadData, Refusal> {
    if data.len() == len as usize {
        return Ok(data);
    }
    tracing::error!(asked = len, got = data.len(), "a store's read returned another length: failed as EIO");
    Err(BackendError::Io(libc::EIO).into())
}

/// WRITE_ZEROES: the store's own, or, where it cannot (EOPNOTSUPP: a file
/// system without zero ranges), zeros written in pieces of at most 1 MiB,
/// as nbdkit falls back. A fast zero never falls back: it fails.
fn zero(
    b: &dyn crate::backend::Backend,
    offset: u64,
    len: u64,
    flags: crate::backend::ZeroFlags,
) -> Result<(), BackendError> {
    match b.write_zeroes(offset, len, flags) {
        Err(BackendError::Unsupported) if !flags.fast_only => {
            let zeros = vec![0u8; len.min(1 << 20) as usize];
            let end = offset + len;
            let mut at = offset;
            while at < end {
                let n = (end - at).min(zeros.len() as u64) as usize;
                b.write_at(&zeros[..n], at, flags.fua)?;
                at += n as u64;
            }
            Ok(())
        }
        r => r,
    }
}
