//! The one place where a request touches the device: [`execute`] runs a
//! validated [`Op`] on a backend and maps its errors to [`Refusal`]s. The
//! [`IoPool`] runs blocking (file) I/O on threads, many requests in flight.

use crate::backend::{Backend, ZeroFlags};
use crate::request::{Extent, Refusal};
use bytes::Bytes;
use std::io;

/// A validated operation, ready for the backend.
#[derive(Debug)]
pub enum Op {
    Read { offset: u64, len: u32 },
    Write { offset: u64, data: Bytes, fua: bool },
    Flush,
    Trim { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64, flags: ZeroFlags },
    Cache,
    BlockStatus { offset: u64, len: u64, one: bool },
}

/// What a successful operation gives back.
#[derive(Debug)]
pub enum Outcome {
    Done,
    Data(Bytes),
    Extents(Vec<Extent>),
}

/// Runs `op` on the backend.
pub fn execute(backend: &dyn Backend, op: Op) -> Result<Outcome, Refusal> {
    let done = |r: io::Result<()>| r.map(|()| Outcome::Done);
    let r = match op {
        Op::Read { offset, len } => {
            let mut buf = vec![0u8; len as usize];
            backend.read_at(&mut buf, offset).map(|()| Outcome::Data(Bytes::from(buf)))
        }
        Op::Write { offset, data, fua } => done(backend.write_at(&data, offset, fua)),
        Op::Flush => done(backend.flush()),
        Op::Trim { offset, len } => done(backend.trim(offset, len)),
        Op::WriteZeroes { offset, len, flags } => done(backend.write_zeroes(offset, len, flags)),
        Op::Cache => Ok(Outcome::Done),
        Op::BlockStatus { offset, len, one } => backend.extents(offset, len).map(|mut e| {
            if one {
                e.truncate(1);
            }
            Outcome::Extents(e)
        }),
    };
    r.map_err(|e| io_refusal(&e))
}

/// The one mapping from a backend's error to a refusal.
fn io_refusal(e: &io::Error) -> Refusal {
    if e.kind() == io::ErrorKind::Unsupported {
        return Refusal::NotFast;
    }
    tracing::warn!(error = %e, "backend I/O failed");
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Refusal::NoSpace,
        Some(libc::EROFS) => Refusal::ReadOnly,
        _ => Refusal::IoError,
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads that run blocking device I/O, so that a
/// connection's reader never waits for the device and many I/Os are in flight.
pub struct IoPool {
    tx: Option<crossbeam_channel::Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl IoPool {
    pub fn new(threads: usize) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let threads = (0..threads)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("fastsan-io-{i}"))
                    .spawn(move || {
                        for job in rx {
                            job();
                        }
                    })
                    .expect("spawn an I/O thread")
            })
            .collect();
        IoPool { tx: Some(tx), threads }
    }

    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        if let Some(tx) = &self.tx {
            // The receivers live as long as the pool; send cannot fail before drop.
            let _ = tx.send(Box::new(job));
        }
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
