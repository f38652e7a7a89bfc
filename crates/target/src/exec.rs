//! The one place where a request touches the device: [`execute`] runs a
//! validated [`Op`] on a backend and maps its errors to wire statuses. The
//! [`IoPool`] runs blocking (file) I/O on threads, many requests in flight.

use crate::backend::Backend;
use brp::Status;
use bytes::Bytes;
use std::io;

/// A validated operation, ready for the backend.
#[derive(Debug)]
pub enum Op {
    Read { offset: u64, len: u32 },
    Write { offset: u64, data: Bytes, fua: bool },
    Flush,
    Trim { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64, fua: bool },
}

/// Runs `op`; a READ returns its data.
pub fn execute(backend: &dyn Backend, op: Op) -> Result<Option<Bytes>, Status> {
    let r = match op {
        Op::Read { offset, len } => {
            let mut buf = vec![0u8; len as usize];
            return match backend.read_at(&mut buf, offset) {
                Ok(()) => Ok(Some(Bytes::from(buf))),
                Err(e) => Err(io_status(&e, "read")),
            };
        }
        Op::Write { offset, data, fua } => backend.write_at(&data, offset, fua),
        Op::Flush => backend.flush(),
        Op::Trim { offset, len } => backend.trim(offset, len),
        Op::WriteZeroes { offset, len, fua } => backend.write_zeroes(offset, len, fua),
    };
    r.map(|()| None).map_err(|e| io_status(&e, "write"))
}

/// The one mapping from a backend's error to the status on the wire.
fn io_status(e: &io::Error, what: &str) -> Status {
    tracing::warn!(error = %e, "backend {what} failed");
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Status::NO_SPACE,
        Some(libc::EROFS) => Status::READ_ONLY,
        _ => Status::IO_ERROR,
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
        IoPool {
            tx: Some(tx),
            threads,
        }
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
