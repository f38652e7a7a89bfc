//! A ring of device I/O (io_uring) for direct file volumes: many reads and
//! writes in flight at once without a thread each, submitted by whoever
//! holds the request and finished by one completion thread.
//!
//! Why: a `,direct` file volume serves every I/O from the device, and on
//! the I/O pool each one is a hand-off to an I/O thread that then blocks in
//! `pread` or `pwrite` until the device answers: ~1.5-3.8 context switches per I/O
//! under fio at QD16-64, 1.2-1.5x qemu-nbd's server CPU per I/O
//! (docs/benchmarks.md, section 12, "With O_DIRECT"). Here a connection's
//! thread pushes the I/O and goes on; the completion thread wakes once for
//! everything that finished meanwhile and calls each I/O's `Done`.
//!
//! A `,direct` [`super::FileBackend`] keeps one ring; its volume sends plain
//! reads and writes here ([`super::Backend::submit`], which the layers that
//! can follow an I/O to its end pass through: stats, read-only), and FLUSH,
//! TRIM, FUA writes and the rest to its I/O pool as before. More I/Os than
//! the ring holds wait in its queues, a queue per client taking turns as on
//! the I/O pool, for completions to free room. A write the kernel cannot
//! start without waiting (one that allocates blocks of a regular file) is
//! refused at once ([`WriteFlags::nowait`]) and written by one of the ring's
//! own threads that may wait, started at the first such write. Buffers
//! come from an arena registered with the ring ([`Ring::buffer`], see
//! `iobuf.rs`), so that the kernel pins no pages per I/O.
//!
//! Pushing an I/O does not enter the kernel: [`Ring::kick`] hands over
//! every I/O pushed since the last one in one system call, so that a
//! connection that read 20 requests at once starts their 20 device I/Os
//! together (one `io_uring_enter`, under one block-layer plug: the reads
//! the kernel can issue at once reach the device as a batch, one
//! notification of a virtual disk rather than 20).
//! A connection kicks when it has dispatched what one read brought, and
//! before it waits for anything; I/Os nobody kicks start at the completion
//! thread's next wake, which is at most 100 ms away.

use crate::pool::FairQueues;
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

pub use super::file::{AlignedBuf, DIRECT_ALIGN as ALIGN};
use super::iobuf::Arena;
pub use super::iobuf::IoBuf;

/// What a finished I/O hands back: its buffer, and whether every byte moved.
pub type Done = Box<dyn FnOnce(IoBuf, io::Result<()>) + Send>;

/// How a write goes to the device.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteFlags {
    /// `RWF_DSYNC`: the write is durable when it completes (FUA).
    pub dsync: bool,
    /// `RWF_NOWAIT`: the kernel takes the write only if it can start it
    /// without waiting (an overwrite of allocated blocks, the inode's lock
    /// free, no timestamp to update, room in the device's queue); else the
    /// rest runs on a thread of the ring's that may wait (a write that
    /// allocates, and the odd overwrite). Without it, io_uring hands such
    /// writes to its own workers, which run one file's one after another.
    /// A file that does not take `RWF_NOWAIT` at all (some network and FUSE
    /// filesystems) has every such write written on those threads.
    pub nowait: bool,
}

/// Threads for the writes the kernel would not start without waiting
/// ([`WriteFlags::nowait`]), started at the first such write.
const WAITING_THREADS: usize = 8;

/// One I/O in flight: owned by the ring from its push until its `Done` runs
/// (its buffer with it, so the device never writes into freed memory).
struct Op {
    /// Whose I/O (a connection): the waiting ones take turns by client.
    client: u64,
    fd: RawFd,
    write: bool,
    /// A write's flags.
    flags: WriteFlags,
    buf: IoBuf,
    offset: u64,
    /// Bytes moved so far (a device may move fewer than asked: the rest is asked again).
    moved: usize,
    done: Done,
}

impl Op {
    /// The submission of what is left of this I/O; `user_data` is the op itself.
    fn entry(self: &mut Box<Op>) -> io_uring::squeue::Entry {
        let me = &mut **self as *mut Op as u64;
        // SAFETY (for the kernel's use of the pointer): the rest of the
        // buffer lives as long as the op, which is not dropped before its
        // completion comes back (`Ring::finish`, `Drop for Ring`).
        let at = unsafe { self.buf.as_mut_ptr().add(self.moved) };
        let left = (self.buf.len() - self.moved) as u32;
        let offset = self.offset + self.moved as u64;
        let fd = types::Fd(self.fd);
        let flags = if self.flags.dsync { libc::RWF_DSYNC } else { 0 }
            | if self.flags.nowait { libc::RWF_NOWAIT } else { 0 };
        // A buffer in the ring's registered arena names it: the kernel
        // neither looks up nor pins its pages.
        let e = match (self.write, self.buf.fixed_index()) {
            (true, Some(i)) => {
                opcode::WriteFixed::new(fd, at, left, i).offset(offset).rw_flags(flags).build()
            }
            (true, None) => opcode::Write::new(fd, at, left).offset(offset).rw_flags(flags).build(),
            (false, Some(i)) => opcode::ReadFixed::new(fd, at, left, i).offset(offset).build(),
            (false, None) => opcode::Read::new(fd, at, left).offset(offset).build(),
        };
        e.user_data(me)
    }
}

/// A `user_data` no op carries: the ring is closing.
const CLOSE: u64 = 0;
/// The longest the completion thread waits before it looks again.
const WAIT: types::Timespec = types::Timespec::new().nsec(100_000_000);

/// The submission side, under one lock: the ring's queue has one producer
/// at a time, and what does not fit waits here.
struct Queue {
    /// Ops the kernel holds (pushed, not yet reaped): at most `Shared::limit`,
    /// so that the completion queue always has room for them.
    in_kernel: usize,
    /// Ops on the threads that may wait ([`WriteFlags::nowait`]).
    blocking: usize,
    /// Ops waiting for room, moved in as completions free it: a queue per
    /// client, the clients in turn, so that one with hundreds waiting
    /// cannot hold back another's single I/O.
    waiting: FairQueues<Box<Op>>,
}

struct Shared {
    ring: IoUring,
    /// The buffers registered with the ring (none if the kernel refused
    /// them). After `ring`: dropped after it, though every buffer taken
    /// holds the arena too.
    arena: Option<Arc<Arena>>,
    queue: Mutex<Queue>,
    limit: usize,
    /// The threads that may wait, once a write needs them.
    waiters: OnceLock<crate::pool::IoPool>,
    /// Writes those threads have written (refused `RWF_NOWAIT`).
    waited: AtomicU64,
    /// The file refuses `RWF_NOWAIT` outright (EOPNOTSUPP).
    nowait_refused: AtomicBool,
    /// Ops pushed into the ring since the last kick (the kernel has not
    /// been told of them yet).
    pushed: AtomicBool,
    closing: AtomicBool,
    reaper: OnceLock<std::thread::ThreadId>,
}

// (Shared is Sync as IoUring is. What keeps its queues sound is that at most
// one SubmissionQueue exists at a time, made and dropped under `queue`'s
// lock, and only the completion thread makes a CompletionQueue.)

/// An io_uring and the thread that finishes its I/Os.
pub struct Ring {
    shared: Arc<Shared>,
    reaper: Option<JoinHandle<()>>,
}

impl Ring {
    /// A ring of `entries` submissions (the kernel rounds up to a power of
    /// two); fails where the kernel has no io_uring or refuses it
    /// (`kernel.io_uring_disabled`, seccomp): the caller keeps its threads.
    pub fn new(entries: u32) -> io::Result<Ring> {
        let ring = IoUring::new(entries)?;
        // Reads and writes at an offset came with kernel 5.6, timed waits
        // with 5.11: an older kernel keeps the volume on its I/O threads.
        let mut probe = io_uring::Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        let ops = [opcode::Read::CODE, opcode::Write::CODE, opcode::Nop::CODE];
        let fixed = [opcode::ReadFixed::CODE, opcode::WriteFixed::CODE];
        if !ops.iter().all(|&op| probe.is_supported(op)) || !ring.params().is_feature_ext_arg() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this kernel's io_uring lacks READ, WRITE or timed waits",
            ));
        }
        let arena = fixed.iter().all(|&op| probe.is_supported(op)).then(Arena::new).and_then(|arena| {
            // SAFETY: the arena's memory stays allocated as long as the ring
            // (`Shared` holds the arena) and every buffer taken from it.
            match unsafe { ring.submitter().register_buffers(&[arena.iovec()]) } {
                Ok(()) => Some(arena),
                Err(e) => {
                    static SAID: AtomicBool = AtomicBool::new(false);
                    if !SAID.swap(true, Relaxed) {
                        tracing::warn!(error = %e, "io_uring refused to register 4 MiB of I/O buffers (the user's locked-memory limit, `ulimit -l`, or systemd's LimitMEMLOCK=): direct volumes without them pin each I/O's pages, which costs 6-10% more CPU per 4K read");
                    }
                    None
                }
            }
        });
        // One completion's room kept for the NOP that closes the ring.
        let limit = ring.params().cq_entries() as usize - 1;
        let shared = Arc::new(Shared {
            ring,
            arena,
            queue: Mutex::new(Queue { in_kernel: 0, blocking: 0, waiting: FairQueues::default() }),
            limit,
            waiters: OnceLock::new(),
            waited: AtomicU64::new(0),
            nowait_refused: AtomicBool::new(false),
            pushed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            reaper: OnceLock::new(),
        });
        let s = shared.clone();
        let reaper = std::thread::Builder::new().name("fastsan-ring".into()).spawn(move || reap(s))?;
        let _ = shared.reaper.set(reaper.thread().id());
        Ok(Ring { shared, reaper: Some(reaper) })
    }

    /// Reads `buf.len()` bytes at `offset` of `fd` into `buf`, as client
    /// `client`'s I/O; `done` runs on the completion thread with the buffer.
    /// `fd` must stay open until then. The read starts at the next
    /// [`Ring::kick`] (or the completion thread's next wake).
    pub fn read(&self, client: u64, fd: RawFd, buf: IoBuf, offset: u64, done: Done) {
        let op = Op { client, fd, write: false, flags: WriteFlags::default(), buf, offset, moved: 0, done };
        self.shared.push(Box::new(op));
    }

    /// Writes `buf` at `offset` of `fd` (durable when it completes, if
    /// `flags.dsync`); as [`Ring::read`], but where the kernel would not
    /// start a `nowait` write at once, the write and its `done` run on one
    /// of the ring's threads that may wait.
    pub fn write(&self, client: u64, fd: RawFd, buf: IoBuf, offset: u64, flags: WriteFlags, done: Done) {
        let op = Box::new(Op { client, fd, write: true, flags, buf, offset, moved: 0, done });
        // A file that refused RWF_NOWAIT once refuses it always: straight to the threads.
        if flags.nowait && self.shared.nowait_refused.load(Relaxed) {
            return self.shared.wait_for(op);
        }
        self.shared.push(op);
    }

    /// A buffer for an I/O of `len` bytes: from the ring's registered arena
    /// when it has a slot that fits (holding what its last I/O left there:
    /// for a read, or a write that fills it), else zeroed from the heap.
    pub fn buffer(&self, len: usize) -> IoBuf {
        IoBuf::take(self.shared.arena.as_ref(), len)
    }

    /// Hands the I/Os pushed since the last kick to the kernel, in one
    /// system call; none when there are none.
    pub fn kick(&self) {
        self.shared.kick()
    }
}

impl Shared {
    fn kick(&self) {
        // (An op pushed after the swap sets the flag again: the next kick's.)
        if self.pushed.swap(false, AcqRel) && self.ring.submit().is_err() {
            // The entries stay queued: the next kick, or the completion
            // thread's next wait, hands them over.
            self.pushed.store(true, Release);
        }
    }

    /// Queues `op` for the kernel (to start at the next kick): into the
    /// ring if there is room, else behind its client's ops already waiting.
    fn push(&self, op: Box<Op>) {
        let mut q = self.queue.lock();
        // Nobody waiting and room: straight in (the usual case, without the
        // fair queues' bookkeeping).
        let op = if q.waiting.is_empty() && q.in_kernel < self.limit {
            match self.enter(&mut q, op) {
                Ok(()) => return,
                Err(op) => op,
            }
        } else {
            op
        };
        q.waiting.push(op.client, op);
        self.fill(&mut q);
    }

    /// The rest of an op the device moved part of: first among its
    /// client's (the completion thread's next wait hands it over).
    fn push_again(&self, op: Box<Op>) {
        let mut q = self.queue.lock();
        q.waiting.push_front(op.client, op);
        self.fill(&mut q);
    }

    /// Moves waiting ops into the ring while it has room (under the lock).
    fn fill(&self, q: &mut Queue) {
        while q.in_kernel < self.limit {
            let Some((client, op)) = q.waiting.pop() else { return };
            if let Err(op) = self.enter(q, op) {
                q.waiting.push_front(client, op);
                return;
            }
        }
    }

    /// Puts `op` into the ring's submission queue (under the lock, with
    /// room counted), or gives it back when the queue is full even after
    /// handing the kernel what it holds.
    fn enter(&self, q: &mut Queue, mut op: Box<Op>) -> Result<(), Box<Op>> {
        let entry = op.entry();
        // SAFETY: the submission queue is ours under the lock (each one made
        // here is dropped, its tail written, at the end of its statement);
        // the entry's buffer and the op it names live until its completion.
        if unsafe { self.ring.submission_shared().push(&entry) }.is_err() {
            // The queue holds entries the kernel has not taken yet: hand them over.
            let _ = self.ring.submit();
            // SAFETY: as above.
            if unsafe { self.ring.submission_shared().push(&entry) }.is_err() {
                return Err(op);
            }
        }
        // The op is the kernel's now (its address is the entry's user_data).
        let _ = Box::into_raw(op);
        q.in_kernel += 1;
        // After the entry's tail is written: a kick that sees the flag sees the entry.
        self.pushed.store(true, Release);
        Ok(())
    }

    /// A completion: the op finished, failed, or moved part of its bytes
    /// (then the rest is asked for again).
    fn finish(self: &Arc<Self>, mut op: Box<Op>, result: i32) {
        let r = match result {
            n if n > 0 => {
                op.moved += n as usize;
                if op.moved < op.buf.len() {
                    return self.push_again(op);
                }
                Ok(())
            }
            // Nothing moved: the file ends before the range does.
            0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ended inside the I/O's range")),
            e if -e == libc::EAGAIN && op.flags.nowait => return self.wait_for(op),
            e if -e == libc::EOPNOTSUPP && op.flags.nowait => {
                if !self.nowait_refused.swap(true, Relaxed) {
                    tracing::info!(
                        "the file takes no RWF_NOWAIT writes: they run on the ring's waiting threads"
                    );
                }
                return self.wait_for(op);
            }
            e if -e == libc::EINTR || -e == libc::EAGAIN => return self.push_again(op),
            e => Err(io::Error::from_raw_os_error(-e)),
        };
        let Op { buf, done, .. } = *op;
        done(buf, r);
    }

    /// The rest of a write the kernel would not start without waiting
    /// ([`WriteFlags::nowait`]): written on a thread that may wait, then
    /// finished as the ring's own are.
    fn wait_for(self: &Arc<Self>, op: Box<Op>) {
        if self.waiters.get().is_none() {
            // Started at the first such write; if the system will not start
            // them (a thread or memory limit), the write fails, answered.
            match crate::pool::IoPool::new(WAITING_THREADS, "ring-wait") {
                Ok(pool) => {
                    let _ = self.waiters.set(pool); // one started meanwhile: this one ends
                }
                Err(e) => {
                    tracing::error!(error = %e, "a write that must wait fails: the ring's threads for such writes cannot start");
                    let Op { buf, done, .. } = *op;
                    return done(buf, Err(e));
                }
            }
        }
        let pool = self.waiters.get().expect("set just above");
        self.waited.fetch_add(1, Relaxed);
        // Counted before it is queued: a closing ring waits for it.
        self.queue.lock().blocking += 1;
        let s = self.clone();
        let client = op.client;
        pool.submit(
            client,
            crate::pool::Job::new(move || {
                let Op { fd, flags, buf, offset, moved, done, .. } = *op;
                // SAFETY: `fd` stays open until `done` has run (the ring's
                // contract with its callers); the File is never dropped, so
                // it never closes the descriptor.
                let file = std::mem::ManuallyDrop::new(unsafe {
                    <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd)
                });
                use std::os::unix::fs::FileExt;
                let r = file.write_all_at(&buf.as_slice()[moved..], offset + moved as u64).and_then(|()| {
                    if flags.dsync {
                        file.sync_data()
                    } else {
                        Ok(())
                    }
                });
                // Done with the descriptor: a ring closing may go now (before
                // `done`, which may drop the ring's last owner, and whose
                // drop waits for this count).
                s.queue.lock().blocking -= 1;
                drop(s);
                // As on the completion thread: a panic in `done` is the request's alone.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| done(buf, r))).is_err() {
                    tracing::error!("an I/O's completion panicked; the ring goes on");
                }
                None
            }),
        );
    }

    fn idle(&self) -> bool {
        let q = self.queue.lock();
        q.in_kernel == 0 && q.blocking == 0 && q.waiting.is_empty()
    }
}

/// The completion thread: waits for completions, finishes their ops, and
/// ends once the ring closes with nothing left in flight or waiting.
fn reap(s: Arc<Shared>) {
    // The completions of one wake, in a list kept from wake to wake.
    let mut done: Vec<(u64, i32)> = Vec::new();
    loop {
        // Submits what is queued and waits for a completion, at most WAIT:
        // entries nobody kicked, or a producer could not submit (the kernel
        // refused for a moment), are handed over here, at the latest after
        // one wait. (The kernel returns at once when it submits fewer
        // entries than counted, as when a producer submitted them meanwhile:
        // one more turn of this loop.) What it submits needs no kick: the
        // flag is cleared before the queue's length is read.
        s.pushed.store(false, Release);
        let args = types::SubmitArgs::new().timespec(&WAIT);
        match s.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) => {}
            Err(e) => {
                tracing::error!(error = %e, "io_uring wait failed; retrying");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        // SAFETY: only this thread reads the completion queue.
        done.extend(unsafe { s.ring.completion_shared() }.map(|c| (c.user_data(), c.result())));
        let ops = done.iter().filter(|(u, _)| *u != CLOSE).count();
        if ops > 0 {
            // Their room first: a partial op asked again below finds it.
            let mut q = s.queue.lock();
            // More completions than ops handed over would mean the queue's
            // memory no longer says what the kernel holds: stop here, loudly,
            // rather than free an op twice.
            q.in_kernel =
                q.in_kernel.checked_sub(ops).expect("an io_uring completed more I/Os than it was given");
            s.fill(&mut q);
            drop(q);
            s.kick();
        }
        for (user_data, result) in done.drain(..) {
            if user_data == CLOSE {
                continue;
            }
            // SAFETY: every other user_data is an op `fill` handed to the
            // kernel, completed once and reclaimed here once.
            let op = unsafe { Box::from_raw(user_data as *mut Op) };
            // A panic in one I/O's completion (its reply) must not stop every
            // other I/O of the volume, as it does not on the I/O threads.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.finish(op, result))).is_err() {
                tracing::error!("an I/O's completion panicked; the ring goes on");
            }
        }
        if s.closing.load(Acquire) && s.idle() {
            return;
        }
    }
}

impl Drop for Ring {
    /// Waits for every I/O in flight or waiting to finish (their buffers are
    /// the device's until then), then ends the completion thread.
    fn drop(&mut self) {
        let s = &*self.shared;
        s.closing.store(true, Release);
        let nop = opcode::Nop::new().build().user_data(CLOSE);
        loop {
            let pushed = {
                let _q = s.queue.lock();
                // SAFETY: the submission queue is ours under the lock; a NOP
                // names no memory. Dropped (its tail written) under the lock.
                let mut sq = unsafe { s.ring.submission_shared() };
                let pushed = unsafe { sq.push(&nop) }.is_ok();
                drop(sq);
                pushed
            };
            let _ = s.ring.submit();
            if pushed {
                break;
            }
            std::thread::yield_now();
        }
        // A `Done` that dropped the ring's last owner runs on the completion
        // thread itself, which then ends on its own once idle.
        if s.reaper.get() == Some(&std::thread::current().id()) {
            // Only the last I/O's completion can drop the last owner (every
            // one holds its volume), so none is left to name the descriptor.
            debug_assert!(s.idle(), "a ring dropped by its own completion with I/Os left");
            return;
        }
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{File, OpenOptions};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A file of `len` bytes in /var/tmp (tmpfs may refuse O_DIRECT), opened
    /// O_DIRECT; removed when dropped.
    struct Direct {
        file: File,
        path: std::path::PathBuf,
    }
    impl Drop for Direct {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
    fn direct_file(tag: &str, len: u64, write: bool) -> Direct {
        let path =
            std::path::Path::new("/var/tmp").join(format!("fastsan-ring-{tag}-{}", std::process::id()));
        File::create(&path).and_then(|f| f.set_len(len)).expect("a file");
        let file = OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("O_DIRECT");
        Direct { file, path }
    }
    /// A block of bytes that `seed` picks, in a buffer of its own.
    fn block(seed: u64) -> IoBuf {
        let mut b = IoBuf::from(AlignedBuf::new(ALIGN));
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (seed.wrapping_mul(31) + i as u64 / 7) as u8;
        }
        b
    }
    /// The same block in a buffer of `ring`'s (a slot of its arena).
    fn block_in(ring: &Ring, seed: u64) -> IoBuf {
        let mut b = ring.buffer(ALIGN);
        b.as_mut_slice().copy_from_slice(block(seed).as_slice());
        b
    }
    type Got = (u64, IoBuf, io::Result<()>);
    /// A `Done` that sends what it got, tagged.
    fn reply(tx: &mpsc::Sender<Got>, tag: u64) -> Done {
        let tx = tx.clone();
        Box::new(move |b, r| {
            let _ = tx.send((tag, b, r));
        })
    }
    fn next(rx: &mpsc::Receiver<Got>) -> Got {
        rx.recv_timeout(Duration::from_secs(20)).expect("the I/O finishes")
    }

    #[test]
    fn many_writes_and_reads_in_flight_from_several_threads_read_back_what_was_written() {
        let f = direct_file("rw", 256 * ALIGN as u64, true);
        // Far fewer entries than I/Os: most wait for room.
        let ring = Ring::new(8).expect("an io_uring");
        let fd = f.file.as_raw_fd();
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|t| {
            for q in 0..4u64 {
                let (ring, tx) = (&ring, tx.clone());
                t.spawn(move || {
                    for i in (q * 64)..(q * 64 + 64) {
                        let flags = WriteFlags { dsync: i % 5 == 0, nowait: i % 3 == 0 };
                        // Half from the ring's registered arena, half from the heap.
                        let b = if i % 2 == 0 { block_in(ring, i) } else { block(i) };
                        ring.write(q, fd, b, i * ALIGN as u64, flags, reply(&tx, i));
                        if i % 8 == 7 {
                            ring.kick();
                        }
                    }
                });
            }
        });
        for _ in 0..256 {
            let (i, _, r) = next(&rx);
            r.unwrap_or_else(|e| panic!("write {i}: {e}"));
        }
        for i in 0..256u64 {
            let b = if i % 4 == 0 { AlignedBuf::new(ALIGN).into() } else { ring.buffer(ALIGN) };
            ring.read(i % 3, fd, b, i * ALIGN as u64, reply(&tx, i));
        }
        ring.kick();
        for _ in 0..256 {
            let (i, b, r) = next(&rx);
            r.unwrap_or_else(|e| panic!("read {i}: {e}"));
            assert!(b.as_slice() == block(i).as_slice(), "block {i} read back other bytes");
        }
        // (Registered memory counts against the user's locked-memory limit,
        // which tests running at once may exhaust without CAP_IPC_LOCK:
        // then every buffer above came from the heap, as it should.)
        match &ring.shared.arena {
            Some(arena) => {
                assert_eq!(arena.free(), Arena::slots(), "every slot back once its buffer is dropped")
            }
            None => eprintln!("no registered buffers here (RLIMIT_MEMLOCK): the heap's were tested"),
        }
    }

    #[test]
    fn writes_the_kernel_would_not_start_at_once_finish_on_threads_that_may_wait() {
        // A sparse file: its first writes allocate blocks, which a write
        // that may not wait cannot do (ext4 and XFS answer EAGAIN).
        let f = direct_file("nowait", 64 * ALIGN as u64, true);
        let ring = Ring::new(8).expect("an io_uring");
        let (tx, rx) = mpsc::channel();
        let fd = f.file.as_raw_fd();
        let nowait = WriteFlags { dsync: false, nowait: true };
        for round in 0..2u64 {
            for i in 0..64u64 {
                ring.write(i % 2, fd, block(i + round), i * ALIGN as u64, nowait, reply(&tx, i));
            }
            ring.kick();
            for _ in 0..64 {
                let (i, _, r) = next(&rx);
                r.unwrap_or_else(|e| panic!("write {i}, round {round}: {e}"));
            }
            let waited = ring.shared.waited.swap(0, SeqCst);
            if round == 0 {
                assert!(waited > 0, "allocating writes went to the threads that may wait");
            } else {
                // Overwrites start in the ring; the odd one waits for a timestamp's update.
                assert!(waited < 48, "{waited} of 64 overwrites went to the threads that may wait");
            }
        }
        // The second round overwrote the first (allocated by then) in the ring.
        for i in 0..64u64 {
            ring.read(0, fd, ring.buffer(ALIGN), i * ALIGN as u64, reply(&tx, i));
        }
        ring.kick();
        for _ in 0..64 {
            let (i, b, r) = next(&rx);
            r.unwrap_or_else(|e| panic!("read {i}: {e}"));
            assert!(b.as_slice() == block(i + 1).as_slice(), "block {i}: the second round's bytes");
        }
        assert_eq!(ring.shared.queue.lock().blocking, 0, "no write left on the waiting threads");
    }

    #[test]
    fn a_file_that_refuses_nowait_writes_has_them_written_on_the_waiting_threads() {
        let f = direct_file("eopnotsupp", 4 * ALIGN as u64, true);
        let ring = Ring::new(8).expect("an io_uring");
        let (tx, rx) = mpsc::channel();
        let fd = f.file.as_raw_fd();
        // As the kernel answers a file without FMODE_NOWAIT (FUSE, some NFS).
        let op = Op {
            client: 0,
            fd,
            write: true,
            flags: WriteFlags { dsync: false, nowait: true },
            buf: block(1),
            offset: 0,
            moved: 0,
            done: reply(&tx, 1),
        };
        ring.shared.finish(Box::new(op), -libc::EOPNOTSUPP);
        let (_, _, r) = next(&rx);
        r.expect("written on a waiting thread");
        assert!(ring.shared.nowait_refused.load(SeqCst), "the refusal is remembered");
        // The next one goes there at once (no ring round trip), and lands.
        ring.write(0, fd, block(2), ALIGN as u64, WriteFlags { dsync: false, nowait: true }, reply(&tx, 2));
        let (_, _, r) = next(&rx);
        r.expect("written");
        assert_eq!(ring.shared.waited.load(SeqCst), 2, "both on the waiting threads");
        for (i, at) in [(1, 0), (2, ALIGN as u64)] {
            ring.read(0, fd, ring.buffer(ALIGN), at, reply(&tx, i));
            ring.kick();
            let (_, b, r) = next(&rx);
            r.expect("read");
            assert!(b.as_slice() == block(i).as_slice(), "block {i} read back");
        }
    }

    #[test]
    fn a_read_past_the_end_and_a_write_the_file_refuses_fail_with_their_causes() {
        let f = direct_file("err", 2 * ALIGN as u64, false);
        let ring = Ring::new(8).expect("an io_uring");
        let (tx, rx) = mpsc::channel();
        let fd = f.file.as_raw_fd();
        // Two blocks from the last one: one moves, the rest finds the end.
        ring.read(0, fd, ring.buffer(2 * ALIGN), ALIGN as u64, reply(&tx, 1));
        ring.kick();
        let (_, _, r) = next(&rx);
        assert_eq!(r.expect_err("past the end").kind(), io::ErrorKind::UnexpectedEof);
        // Opened read-only: the kernel refuses the write.
        ring.write(0, fd, block(3), 0, WriteFlags::default(), reply(&tx, 2));
        ring.kick();
        let (_, _, r) = next(&rx);
        assert_eq!(r.expect_err("a read-only descriptor").raw_os_error(), Some(libc::EBADF));
    }

    /// A pipe: reads of it stay in flight until bytes come.
    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into the array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are ours, each owned once.
        unsafe {
            use std::os::fd::FromRawFd;
            (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
        }
    }

    #[test]
    fn an_io_nobody_kicks_still_starts_at_the_completion_threads_next_wake() {
        let f = direct_file("nokick", 4 * ALIGN as u64, true);
        let ring = Ring::new(8).expect("an io_uring");
        // The completion thread waiting already (else its first wait submits).
        std::thread::sleep(Duration::from_millis(20));
        let (tx, rx) = mpsc::channel();
        ring.write(0, f.file.as_raw_fd(), block(9), ALIGN as u64, WriteFlags::default(), reply(&tx, 1));
        let (_, _, r) = next(&rx);
        r.expect("the write");
        ring.read(0, f.file.as_raw_fd(), ring.buffer(ALIGN), ALIGN as u64, reply(&tx, 2));
        let (_, b, r) = next(&rx);
        r.expect("the read");
        assert!(b.as_slice() == block(9).as_slice(), "the block written");
    }

    #[test]
    fn a_client_with_one_io_waiting_goes_before_the_rest_of_a_client_with_many() {
        let ((busy_rd, busy_wr), (quiet_rd, quiet_wr)) = (pipe(), pipe());
        let ring = Ring::new(2).expect("an io_uring");
        let limit = ring.shared.limit;
        let (tx, rx) = mpsc::channel();
        // Client 1 fills the ring and has 8 more waiting; then client 2 asks once.
        for i in 0..limit as u64 + 8 {
            ring.read(1, busy_rd.as_raw_fd(), ring.buffer(ALIGN), 0, reply(&tx, i));
        }
        ring.read(2, quiet_rd.as_raw_fd(), ring.buffer(ALIGN), 0, reply(&tx, 1000));
        ring.kick();
        let mut quiet_wr = quiet_wr;
        std::io::Write::write_all(&mut quiet_wr, &[5u8; ALIGN]).expect("written");
        // Two of client 1's reads finish: the first frees room for client 1's
        // next (its turn came first), the second for client 2's, not for the
        // next of client 1's eight (in the order they came, it would wait for 9).
        let mut busy_wr = busy_wr;
        std::io::Write::write_all(&mut busy_wr, &[7u8; 2 * ALIGN]).expect("written");
        let mut got = Vec::new();
        while !got.contains(&1000) {
            let (tag, b, r) = rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
                panic!("client 2's read still waits behind client 1's after {got:?} finished")
            });
            r.expect("read");
            assert!(b.as_slice().iter().all(|&x| x == if tag == 1000 { 5 } else { 7 }), "read {tag}");
            got.push(tag);
        }
        assert_eq!(got.len(), 3, "client 2's read finished after two of client 1's: {got:?}");
        assert_eq!(ring.shared.queue.lock().waiting.len(), 6, "client 1's other reads still wait");
        // The rest of client 1's reads get their bytes; dropping the ring waits for them.
        std::io::Write::write_all(&mut busy_wr, &vec![7u8; (limit + 6) * ALIGN]).expect("written");
        drop(ring);
        assert_eq!(rx.try_iter().count(), limit + 6, "every other read finished");
    }

    #[test]
    fn ios_beyond_the_rings_room_wait_their_turn_and_dropping_it_waits_for_them_all() {
        let (rd, wr) = pipe();
        let ring = Ring::new(2).expect("an io_uring");
        let (limit, reads) = (ring.shared.limit, ring.shared.limit + 3);
        let finished = Arc::new(AtomicUsize::new(0));
        for tag in 0..reads {
            let n = finished.clone();
            let done: Done = Box::new(move |b, r| {
                r.expect("read");
                assert!(b.as_slice().iter().all(|&x| x == 7), "read {tag}: the bytes written");
                n.fetch_add(1, SeqCst);
            });
            ring.read(tag as u64 % 2, rd.as_raw_fd(), ring.buffer(ALIGN), 0, done);
        }
        ring.kick();
        {
            let q = ring.shared.queue.lock();
            assert_eq!((q.in_kernel, q.waiting.len()), (limit, 3), "the ring full, the rest waiting");
        }
        assert_eq!(finished.load(SeqCst), 0, "nothing finished before bytes came");
        // The bytes come a while after the ring begins to close.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut wr = wr;
            std::io::Write::write_all(&mut wr, &vec![7u8; ALIGN * reads]).expect("written");
        });
        drop(ring);
        assert_eq!(finished.load(SeqCst), reads, "every read finished before the ring went");
        writer.join().expect("the writer");
    }
}
