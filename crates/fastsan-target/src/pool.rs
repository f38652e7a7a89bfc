//! Pools: the [`IoPool`] of threads that run blocking (file) device I/O, so
//! a connection's reader never waits for the device and many I/Os are in
//! flight; and [`PooledBuf`], recycled read buffers.

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

/// Read buffers, recycled: a reply's buffer returns here when the last
/// reference to its bytes drops (after the reply is written), so the hot path
/// neither allocates, nor zeroes, nor faults in fresh pages. Buffers come in
/// power-of-two size classes from 4 KiB to 32 MiB; each class keeps at most
/// 32 MiB of idle buffers.
struct BufPool {
    classes: [parking_lot::Mutex<Vec<Vec<u8>>>; POOL_CLASSES],
}

const POOL_MIN_SHIFT: u32 = 12;
const POOL_CLASSES: usize = 14; // 4 KiB .. 32 MiB
const POOL_IDLE_BYTES: usize = 32 << 20;

static POOL: BufPool = BufPool { classes: [const { parking_lot::Mutex::new(Vec::new()) }; POOL_CLASSES] };

fn class_of(len: usize) -> Option<usize> {
    let shift = len.max(1).next_power_of_two().trailing_zeros().max(POOL_MIN_SHIFT);
    let c = (shift - POOL_MIN_SHIFT) as usize;
    (c < POOL_CLASSES).then_some(c)
}

/// A buffer of `len` bytes from the pool. Its contents are stale: the
/// backend overwrites all of it.
pub struct PooledBuf {
    buf: Vec<u8>,
    len: usize,
}

impl PooledBuf {
    pub fn take(len: usize) -> PooledBuf {
        let buf = class_of(len)
            .and_then(|c| POOL.classes[c].lock().pop())
            .unwrap_or_else(|| vec![0u8; class_of(len).map_or(len, |c| 1 << (c as u32 + POOL_MIN_SHIFT))]);
        PooledBuf { buf, len }
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl AsMut<[u8]> for PooledBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let Some(c) =
            class_of(self.buf.len()).filter(|&c| self.buf.len() == 1 << (c as u32 + POOL_MIN_SHIFT))
        else {
            return;
        };
        let mut idle = POOL.classes[c].lock();
        if (idle.len() + 1) * self.buf.len() <= POOL_IDLE_BYTES {
            idle.push(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn pooled_buffers_have_the_asked_length_and_come_back() {
        assert_eq!(class_of(1), Some(0));
        assert_eq!(class_of(4096), Some(0));
        assert_eq!(class_of(4097), Some(1));
        assert_eq!(class_of(32 << 20), Some(13));
        assert_eq!(class_of((32 << 20) + 1), None);
        let mut b = PooledBuf::take(5000);
        assert_eq!(b.as_mut().len(), 5000);
        b.as_mut().fill(7);
        let bytes = Bytes::from_owner(b);
        assert_eq!(bytes.len(), 5000);
        let ptr = bytes.as_ptr();
        drop(bytes);
        let again = PooledBuf::take(6000);
        assert_eq!(again.as_ref().as_ptr(), ptr, "the 8 KiB buffer was reused");
        let huge = PooledBuf::take((32 << 20) + 1);
        assert_eq!(huge.as_ref().len(), (32 << 20) + 1, "beyond the classes: a plain buffer");
    }
}
