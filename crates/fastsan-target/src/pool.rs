//! Pools: the [`IoPool`] of threads that run a volume's blocking (file)
//! device I/O, so a connection's reader never waits for the device and many
//! I/Os are in flight; and [`PooledBuf`], recycled read buffers.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A unit of device work. It may leave a continuation (the rest of a large
/// TRIM or WRITE_ZEROES), which queues again behind the other clients' work.
pub struct Job(Box<dyn FnOnce() -> Option<Job> + Send>);

impl Job {
    pub fn new(f: impl FnOnce() -> Option<Job> + Send + 'static) -> Job {
        Job(Box::new(f))
    }
}

/// Each client's work in its own queue, and the clients with work in a
/// ring: the next item comes from the client at the front, which then goes
/// to the back. A client with thousands of items queued gets one turn in
/// each round, like everybody else. (Each client's queue is bounded by its
/// credits: the queue depth of its connection.) The I/O pool's jobs wait
/// here, and so do the I/Os a volume's io_uring has no room for yet.
pub(crate) struct FairQueues<T> {
    ring: VecDeque<u64>,
    items: HashMap<u64, VecDeque<T>>,
}

impl<T> Default for FairQueues<T> {
    fn default() -> Self {
        FairQueues { ring: VecDeque::new(), items: HashMap::new() }
    }
}

impl<T> FairQueues<T> {
    pub fn push(&mut self, client: u64, item: T) {
        let mine = self.items.entry(client).or_default();
        mine.push_back(item);
        if mine.len() == 1 {
            self.ring.push_back(client);
        }
    }

    /// The rest of an item (a job's continuation, an I/O's bytes asked
    /// again) or one that could not go on: first in its client's queue,
    /// the client still behind the others.
    pub fn push_front(&mut self, client: u64, item: T) {
        let mine = self.items.entry(client).or_default();
        mine.push_front(item);
        if mine.len() == 1 {
            self.ring.push_back(client);
        }
    }

    pub fn pop(&mut self) -> Option<(u64, T)> {
        let client = self.ring.pop_front()?;
        let mine = self.items.get_mut(&client).expect("a client in the ring has items");
        let item = mine.pop_front().expect("a client in the ring has items");
        if mine.is_empty() {
            self.items.remove(&client);
        } else {
            self.ring.push_back(client);
        }
        Some((client, item))
    }

    /// Items queued, all clients together.
    pub fn len(&self) -> usize {
        self.items.values().map(VecDeque::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }
}

type Queues = FairQueues<Job>;

/// The threads of one volume: a device that stalls holds only its own
/// threads, never another volume's I/O. The fair queues say which job runs
/// next; a channel of tokens (one per job queued) wakes the threads, so
/// that idle threads park and wake as cheaply as on a plain channel.
pub struct IoPool {
    /// None once dropped: the threads finish what is queued, then exit.
    handle: Option<PoolHandle>,
}

/// Queues jobs on a pool, also from its own jobs (a volume's flusher queues
/// the next group's flush): the pool's threads live as long as a handle.
#[derive(Clone)]
pub struct PoolHandle {
    queues: Arc<Mutex<Queues>>,
    tokens: crossbeam_channel::Sender<()>,
}

impl PoolHandle {
    /// Queues `job` as client `client`'s (a connection).
    pub fn submit(&self, client: u64, job: Job) {
        self.queues.lock().push(client, job);
        let _ = self.tokens.send(());
    }
}

impl IoPool {
    /// `threads` threads named after `name` (the volume); an error when the
    /// system will not start them (a thread or memory limit): those started
    /// end with it.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        let queues = Arc::new(Mutex::new(Queues::default()));
        let (tx, rx) = crossbeam_channel::unbounded::<()>();
        for i in 0..threads.max(1) {
            let (queues, rx) = (queues.clone(), rx.clone());
            std::thread::Builder::new()
                .name(format!("fastsan-io-{name}-{i}"))
                .spawn(move || {
                    // One token, one job. A job's continuation is queued behind
                    // the others, and this thread takes the next job in its
                    // place (the continuation has no token of its own).
                    for () in rx {
                        let mut next = queues.lock().pop();
                        while let Some((client, job)) = next {
                            // A job that panics (a bug) loses its reply, never the thread (a
                            // flush job answers its waiters first: volume/flush.rs).
                            let rest = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job.0))
                                .unwrap_or_else(|_| {
                                    tracing::error!(
                                        "an I/O job panicked (a bug): the request it ran gets no reply"
                                    );
                                    None
                                });
                            next = rest.and_then(|rest| {
                                let mut q = queues.lock();
                                q.push_front(client, rest);
                                q.pop()
                            });
                        }
                    }
                })
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot start I/O thread {i} of {name}: {e}"))
                })?;
        }
        Ok(IoPool { handle: Some(PoolHandle { queues, tokens: tx }) })
    }

    /// Queues `job` as client `client`'s (a connection).
    pub fn submit(&self, client: u64, job: Job) {
        if let Some(h) = &self.handle {
            h.submit(client, job);
        }
    }

    /// A handle that queues jobs here.
    pub fn handle(&self) -> Option<PoolHandle> {
        self.handle.clone()
    }

    /// Jobs waiting (not running), all clients together.
    pub fn queued(&self) -> usize {
        self.handle.as_ref().map_or(0, |h| h.queues.lock().len())
    }
}

impl Drop for IoPool {
    /// The threads finish what is queued, then exit (once no handle is
    /// left either). They are not joined: a job may hold the last
    /// reference to the volume that owns this pool.
    fn drop(&mut self) {
        self.handle = None;
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
    use std::sync::mpsc;

    #[test]
    fn clients_take_turns_and_continuations_queue_behind_others() {
        let pool = IoPool::new(1, "t").unwrap();
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (tx, rx) = mpsc::channel();
        // Hold the one thread while the queues fill.
        pool.submit(
            0,
            Job::new(move || {
                started_tx.send(()).unwrap();
                gate_rx.recv().unwrap();
                None
            }),
        );
        started_rx.recv().unwrap();
        for i in 0..5 {
            let tx = tx.clone();
            pool.submit(
                1,
                Job::new(move || {
                    tx.send((1, i)).unwrap();
                    None
                }),
            );
        }
        let tx2 = tx.clone();
        // Client 2: one job in two pieces, and one more after it.
        pool.submit(
            2,
            Job::new(move || {
                tx2.send((2, 0)).unwrap();
                Some(Job::new(move || {
                    tx2.send((2, 1)).unwrap();
                    None
                }))
            }),
        );
        let tx3 = tx.clone();
        pool.submit(
            2,
            Job::new(move || {
                tx3.send((2, 2)).unwrap();
                None
            }),
        );
        assert_eq!(pool.queued(), 7);
        gate_tx.send(()).unwrap();
        let order: Vec<_> = (0..8).map(|_| rx.recv().unwrap()).collect();
        // Clients alternate; client 2's second piece comes before its next job.
        assert_eq!(order, [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (1, 4)]);
    }

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
