//! A volume's flushes, in groups (group commit), and the latch that keeps a
//! failed one failed.
//!
//! A caller of [`Flusher::then`] is queued with a callback and returns at
//! once. When no flush runs, the caller runs one and answers everyone it
//! covered; those who arrived meanwhile share the next one, which runs as a
//! job on the volume's I/O pool, queued like any other work (without a
//! pool, on the same thread). So a slow fsync holds one thread however
//! many FLUSH and FUA writes wait for it, the volume's reads and writes go
//! on in the others (until 2026-11-28 each waiter held a pool thread, and
//! enough of them stopped every read), and no thread flushes for others
//! for long: a caller that waits for its own flush (a shutdown, a serial
//! connection) is done once its group is. None is answered OK by a flush
//! that started before it arrived.
//!
//! Linux reports a writeback error once per open file, so after one failure
//! a later flush may succeed although the writes it covered are lost: the
//! first failure (whatever its errno) is latched before anyone waiting is
//! told, and every later request of the volume fails too (FLUSH and FUA,
//! and since 2026-12-07 reads and writes: see [`Flusher::failed`]), for
//! every client, until the volume is reopened. The store records it (a file: an attribute), so
//! that a target reopening it later gives it another generation and no
//! session of now resumes over the lost writes. A flush that panicked (a
//! bug in a backend) is a failure too: whether it reached the device is
//! unknown.

use crate::backend::{Backend, BackendError};
use crate::pool::{Job, PoolHandle};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

/// What a caller of [`Volume::flush_then`](crate::volume::Volume::flush_then) runs once its flush has ended.
pub type FlushDone = Box<dyn FnOnce(Result<(), BackendError>) + Send>;

/// The fair queues' name for a volume's own flush jobs (connections count from 1).
const FLUSHER: u64 = 0;

pub struct Flusher {
    name: String,
    backend: Arc<dyn Backend>,
    /// Set at once by the first failed flush (or FUA): every request fails
    /// from then on ([`Flusher::failed`]), with
    /// [`BackendError::WritebackLost`] once the failure is recorded on the
    /// store (a call for durability waits for `recording` until then).
    failing: AtomicBool,
    /// Held while a failure is recorded (and `failing` set, under it).
    recording: parking_lot::Mutex<()>,
    state: parking_lot::Mutex<State>,
    /// Where the next group's flush runs; none: on the thread that ran the last.
    pool: Option<PoolHandle>,
}

#[derive(Default)]
struct State {
    /// A flush runs, or is queued to run, for those in `waiting`: whoever
    /// arrives now joins them.
    busy: bool,
    waiting: Vec<FlushDone>,
}

impl Flusher {
    pub fn new(name: String, backend: Arc<dyn Backend>, pool: Option<PoolHandle>) -> Flusher {
        Flusher {
            name,
            backend,
            failing: AtomicBool::new(false),
            recording: Default::default(),
            state: Default::default(),
            pool,
        }
    }

    /// Calls `done` once every write completed before this call is durable,
    /// or with why it may not be.
    pub fn then(self: &Arc<Self>, done: FlushDone) {
        {
            let mut st = self.state.lock();
            st.waiting.push(done);
            if st.busy {
                return;
            }
            st.busy = true;
        }
        self.lead();
    }

    /// Waits for [`Flusher::then`].
    pub fn wait(self: &Arc<Self>) -> Result<(), BackendError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let done = Box::new(move |r| {
            let _ = tx.send(r);
        });
        // A flush this thread led that panicked (a backend's bug) answered
        // everyone, this caller too, with an error: a failed flush here, not
        // a dead shutdown task (an NVMe controller left shutting down forever).
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.then(done)));
        rx.recv().unwrap_or(Err(BackendError::Io(libc::EIO)))
    }

    /// Flushes for everyone waiting and answers them; then leaves the next
    /// group, if anyone came meanwhile, to a job on the pool (without a
    /// pool, flushes for it too).
    fn lead(self: &Arc<Self>) {
        let mut busy = Busy { flusher: self, group: Vec::new().into_iter(), armed: true };
        loop {
            let group = {
                let mut st = self.state.lock();
                let group = std::mem::take(&mut st.waiting);
                if group.is_empty() {
                    // Under the lock that found nobody waiting: whoever comes
                    // next finds the flusher free and leads.
                    st.busy = false;
                    busy.armed = false;
                    return;
                }
                group
            };
            busy.group = group.into_iter();
            let r = self.durable(|| self.backend.flush());
            for done in busy.group.by_ref() {
                answer(done, r);
            }
            if let Some(pool) = &self.pool {
                busy.armed = false;
                {
                    let mut st = self.state.lock();
                    if st.waiting.is_empty() {
                        st.busy = false;
                        return;
                    }
                }
                // Still busy: those who arrive meanwhile join the job's group.
                let me = self.clone();
                pool.submit(
                    FLUSHER,
                    Job::new(move || {
                        me.lead();
                        None
                    }),
                );
                return;
            }
        }
    }

    /// Whether a flush failed (latched until the volume is reopened). Then
    /// the volume fails every request, reads too, as md fails a member:
    /// the kernel leaves the pages whose writeback failed clean in its
    /// cache, so a read returns the lost data until they are evicted and
    /// the older data on the device after, and a client that never flushed
    /// (another host reading the volume) would not know which it got.
    /// (Until 2026-12-07 only FLUSH and FUA failed.)
    pub fn failed(&self) -> bool {
        self.failing.load(SeqCst)
    }

    /// The error of a request of a failed volume, given once the failure is
    /// recorded on the store (see `latch`): a caller may wait for it, so
    /// not on a thread that serves connections.
    pub fn refusal(&self) -> BackendError {
        drop(self.recording.lock());
        BackendError::WritebackLost
    }

    /// Runs `f`, a flush or a call that promises durability by itself (a
    /// native FUA write on a store that cannot flush), under the latch.
    pub fn durable(&self, f: impl FnOnce() -> Result<(), BackendError>) -> Result<(), BackendError> {
        if self.failed() {
            return Err(self.refusal());
        }
        let r = f();
        match &r {
            // Unreached, not failed: the next flush may well succeed, and a
            // loss would be reported by the store itself.
            Err(BackendError::Unavailable) | Ok(()) => {}
            Err(e) => self.latch(e),
        }
        r
    }

    /// Latches the first failure, and records it on the store (before anyone
    /// waiting is told): a target started on it later must not let the
    /// sessions of now resume over writes this flush lost.
    fn latch(&self, e: &BackendError) {
        let _recording = self.recording.lock();
        // Set only here, under the lock: set means latched and recorded.
        if self.failed() {
            return;
        }
        // Reads and writes fail from now on; but no caller is told of the
        // failure (a FUA write racing this flush) before the store holds it:
        // they wait for `recording`.
        self.failing.store(true, SeqCst);
        let recorded = self.backend.record_failed_flush();
        tracing::error!(
            volume = self.name,
            "flush failed ({e}): writes since the last good flush may be lost; \
             the volume now fails every request, reads too, until it is reopened \
             (a restart of the target)"
        );
        if let Err(why) = recorded {
            tracing::error!(
                volume = self.name,
                "the failed flush could not be recorded on the store ({why}): a target restarted \
                 on it would let the sessions of now resume, and their next flush succeed over \
                 the writes this one lost; restart their clients too"
            );
        }
    }
}

/// The flush being led. If its thread unwinds (a backend's flush panicked),
/// the flush counts as failed: latched, and everyone in its group and
/// waiting behind it is told so, so that nobody waits for a leader gone.
struct Busy<'a> {
    flusher: &'a Flusher,
    group: std::vec::IntoIter<FlushDone>,
    armed: bool,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let f = self.flusher;
        let failed = BackendError::Io(libc::EIO);
        f.latch(&failed);
        let waiting = {
            let mut st = f.state.lock();
            st.busy = false;
            std::mem::take(&mut st.waiting)
        };
        for done in self.group.by_ref().chain(waiting) {
            answer(done, Err(failed));
        }
    }
}

/// Answers one waiter. A waiter's callback that panics (a bug on the reply
/// path) loses its own reply, nothing more: the flush is not failed for it,
/// and the others are answered.
fn answer(done: FlushDone, r: Result<(), BackendError>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| done(r))).is_err() {
        tracing::error!("answering a flush's waiter panicked; its request gets no reply");
    }
}
