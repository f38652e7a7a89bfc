//! Volumes, and the one place where a request is checked against a volume:
//! [`Volume::validate`] turns a decoded [`IoRequest`] into an [`Op`] or a
//! [`Refusal`], before any I/O. An [`Op`] can be made nowhere else, and
//! [`Volume::execute`] (in `exec.rs`, the one place a request touches the
//! device) takes nothing but an [`Op`]: validation cannot be bypassed.

mod exec;
mod flush;

pub use exec::Outcome;
pub use flush::FlushDone;

use crate::backend::{self, Backend, BlockSizes, Faults, VolumeStats, VolumeStatsSnapshot, ZeroFlags};
use crate::config::VolumeSpec;
use crate::pool::IoPool;
use crate::request::{IoKind, IoRequest, Limits, Refusal};
use bytes::Bytes;
use std::io;
use std::sync::Arc;

/// What a volume can do, read once from its stack when it opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub write: bool,
    pub flush: bool,
    pub fua: bool,
    pub trim: bool,
    pub zero: bool,
    pub fast_zero: bool,
    pub extents: bool,
    pub cache: bool,
    /// Large reads are lent from the store's memory, not copied.
    pub share_reads: bool,
    /// Reads whose bytes are at hand (a file's page cache) are served on
    /// the receiving thread ([`Volume::read_now`]), not on the I/O pool.
    pub read_now: bool,
    /// Plain writes the store can take without waiting (a file's page
    /// cache, where the kernel allows) are written on the receiving thread
    /// ([`Volume::write_now`]).
    pub write_now: bool,
    /// Plain reads and writes go to the device without an I/O thread each
    /// ([`Volume::submit`]: a `,direct` file's ring).
    pub submit: bool,
    /// Writes too (a block device's ring).
    pub submit_writes: bool,
}

pub struct Volume {
    name: String,
    backend: Arc<dyn Backend>,
    size: u64,
    granule: u32,
    max_transfer: u32,
    blocks: BlockSizes,
    caps: Caps,
    volatile: bool,
    generation: u64,
    /// See [`crate::backend::Backend::boot`].
    boot: Option<u64>,
    /// The most of the server's payload budget this volume's requests may
    /// hold at once ([`Volume::with_payload_share`]).
    payload: crate::pipeline::Budget,
    description: String,
    stats: Arc<VolumeStats>,
    faults: Option<Faults>,
    /// Its own I/O threads, when its calls may block.
    pool: Option<IoPool>,
    /// Its flushes, in groups, and the latch of a failed one.
    flusher: Arc<flush::Flusher>,
    /// A file volume's lock on its file, until [`Volume::unlock`].
    lock: parking_lot::Mutex<Option<std::fs::File>>,
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume").field("name", &self.name).field("size", &self.size).finish()
    }
}

/// A request that passed [`Volume::validate`], ready for the device.
pub struct Op {
    kind: OpKind,
}

enum OpKind {
    Read { offset: u64, len: u32 },
    Write { offset: u64, data: Bytes, fua: bool },
    Flush,
    Trim { offset: u64, len: u64, fua: bool },
    WriteZeroes { offset: u64, len: u64, flags: ZeroFlags },
    Cache { offset: u64, len: u64 },
    BlockStatus { offset: u64, len: u64, one: bool },
}

/// The most one device call of a TRIM or WRITE_ZEROES covers: a larger one
/// runs in pieces, each queued behind the other clients' work.
pub const SPLIT: u64 = 64 << 20;

impl Op {
    /// Cuts a TRIM or WRITE_ZEROES longer than [`SPLIT`] after its first
    /// piece: `self` becomes that piece (without FUA), the rest is returned
    /// (with the FUA, so durability is promised when the last piece is done).
    pub fn split_off(&mut self) -> Option<Op> {
        match &mut self.kind {
            OpKind::Trim { offset, len, fua } if *len > SPLIT => {
                let rest = OpKind::Trim { offset: *offset + SPLIT, len: *len - SPLIT, fua: *fua };
                (*len, *fua) = (SPLIT, false);
                Some(Op { kind: rest })
            }
            OpKind::WriteZeroes { offset, len, flags } if *len > SPLIT => {
                let rest = OpKind::WriteZeroes { offset: *offset + SPLIT, len: *len - SPLIT, flags: *flags };
                *len = SPLIT;
                flags.fua = false;
                Some(Op { kind: rest })
            }
            _ => None,
        }
    }

    /// Bytes read and written by this op, for counters.
    pub fn moves(&self) -> (u64, u64) {
        match &self.kind {
            OpKind::Read { len, .. } => (*len as u64, 0),
            OpKind::Write { data, .. } => (0, data.len() as u64),
            _ => (0, 0),
        }
    }
}

impl Volume {
    /// Builds the volume's backend stack from its spec and opens it.
    /// A volume whose calls may block gets its own `io_threads` threads; a
    /// file records its failed flushes in `run_dir` too ([`backend::build`]).
    pub fn open(
        spec: &VolumeSpec,
        max_transfer: u32,
        io_threads: usize,
        run_dir: Option<&std::path::Path>,
    ) -> io::Result<Volume> {
        let stack = backend::build(spec, run_dir)?;
        let v = Volume::from_stack(
            spec.name.clone(),
            stack.top,
            stack.stats,
            stack.faults,
            max_transfer,
            io_threads,
        )?;
        *v.lock.lock() = stack.lock;
        Ok(v)
    }

    /// Releases a file volume's lock on its file (a server that stopped
    /// serving it): another target, or this process's next server, may open
    /// it at once, while the store itself may still be held a moment longer
    /// by a thread that is ending.
    pub fn unlock(&self) {
        self.lock.lock().take();
    }

    /// A volume over a ready backend (tests and embedders), with a stats
    /// layer on top. Panics if its I/O threads cannot be started.
    pub fn with_backend(name: String, b: Arc<dyn Backend>, max_transfer: u32) -> Volume {
        let stats = Arc::new(VolumeStats::default());
        let top = Arc::new(backend::StatsLayer::new(b, stats.clone()));
        Volume::from_stack(name, top, stats, None, max_transfer, 4).expect("start the volume's I/O threads")
    }

    fn from_stack(
        name: String,
        b: Arc<dyn Backend>,
        stats: Arc<VolumeStats>,
        faults: Option<Faults>,
        max_transfer: u32,
        io_threads: usize,
    ) -> io::Result<Volume> {
        let blocks = b.block_sizes();
        // The unit every front end can address: BRP's 512-byte sectors, or
        // more when the store needs more (O_DIRECT).
        let granule = blocks.minimum.max(512);
        let size = b.size() / granule as u64 * granule as u64;
        if size != b.size() || size == 0 {
            tracing::warn!(
                volume = name,
                "the store has {} bytes; served: {size} (whole blocks of {granule} bytes)",
                b.size()
            );
        }
        let max_transfer = max_transfer.min(blocks.maximum) / granule * granule;
        let caps = Caps {
            write: b.can_write(),
            flush: b.can_flush(),
            fua: b.can_fua(),
            trim: b.can_write() && b.can_trim(),
            zero: b.can_write() && b.can_zero(),
            fast_zero: b.can_write() && b.can_zero() && b.can_fast_zero(),
            extents: b.can_extents(),
            cache: b.can_cache(),
            share_reads: b.can_share_reads(),
            read_now: b.can_read_now(),
            write_now: b.can_write() && b.can_write_now(),
            submit: b.can_submit(),
            submit_writes: b.can_submit() && b.can_submit_writes(),
        };
        let pool = b.may_block().then(|| IoPool::new(io_threads, &name)).transpose()?;
        let flusher =
            Arc::new(flush::Flusher::new(name.clone(), b.clone(), pool.as_ref().and_then(IoPool::handle)));
        Ok(Volume {
            lock: parking_lot::Mutex::new(None),
            pool,
            flusher,
            name,
            volatile: b.volatile(),
            generation: b.generation(),
            boot: b.boot(),
            payload: crate::pipeline::Budget::new(u64::MAX),
            description: b.describe(),
            backend: b,
            size,
            granule,
            max_transfer,
            blocks,
            caps,
            stats,
            faults,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    /// Usable size in bytes (a whole number of [`Volume::granule`]s).
    pub fn size(&self) -> u64 {
        self.size
    }
    /// Smallest unit every front end can address: at least 512 bytes.
    pub fn granule(&self) -> u32 {
        self.granule
    }
    /// The store's own block sizes (its minimum may be 1: byte-granular).
    pub fn block_sizes(&self) -> BlockSizes {
        self.blocks
    }
    /// Largest READ or WRITE of the target's configuration and the store.
    pub fn max_transfer(&self) -> u32 {
        self.max_transfer
    }
    pub fn caps(&self) -> Caps {
        self.caps
    }
    pub fn read_only(&self) -> bool {
        !self.caps.write
    }
    pub fn volatile(&self) -> bool {
        self.volatile
    }
    /// Caps what this volume's requests hold of the server's payload budget
    /// (`--memory-budget`) at `bytes`. A stalled device (a hung remote
    /// target, a disk that stopped answering) keeps every request sent to
    /// it, with its payload, until it answers: without a share of its own,
    /// enough connections writing to it held the whole budget, and every
    /// other volume's clients waited for it (a helper's review).
    pub fn with_payload_share(mut self, bytes: u64) -> Volume {
        self.payload = crate::pipeline::Budget::new(bytes);
        self
    }

    /// This volume's share of the server's payload budget.
    pub fn payload_share(&self) -> &crate::pipeline::Budget {
        &self.payload
    }

    /// The boot of the host holding the volume's unflushed writes, if not
    /// this one (see [`crate::backend::Backend::boot`]).
    pub fn boot(&self) -> Option<u64> {
        self.boot
    }

    /// Identity of the volume's data (see [`Backend::generation`]).
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// Whether requests run on the connection's task (memory, null) rather
    /// than on the I/O pool.
    pub fn runs_inline(&self) -> bool {
        self.pool.is_none()
    }
    /// The volume's I/O threads (none when it runs inline).
    pub fn pool(&self) -> Option<&IoPool> {
        self.pool.as_ref()
    }
    pub fn describe(&self) -> &str {
        &self.description
    }
    pub fn stats(&self) -> VolumeStatsSnapshot {
        self.stats.snapshot()
    }
    /// The fault rules, when the volume has a faults layer.
    pub fn faults(&self) -> Option<&Faults> {
        self.faults.as_ref()
    }

    /// Whether a flush of the volume failed: then every request fails, until
    /// the volume is reopened (see `flush.rs`, `Flusher::failed`).
    pub fn failed(&self) -> bool {
        self.flusher.failed()
    }

    /// Makes every completed write durable, waiting for it (see [`Volume::flush_then`]).
    pub fn flush(&self) -> Result<(), backend::BackendError> {
        self.flusher.wait()
    }

    /// Makes every write completed before this call durable, then calls
    /// `done` with the result, without waiting for it here: a flush of the
    /// backend, in a group (see `flush.rs`). A failed flush is latched: every
    /// later request fails too, until the volume is reopened.
    pub fn flush_then(&self, done: FlushDone) {
        self.flusher.then(done)
    }

    /// Runs `f`, which promises durability by itself (a native FUA write on
    /// a store that cannot flush), under the same latch as flushes.
    fn durable(
        &self,
        f: impl FnOnce() -> Result<(), backend::BackendError>,
    ) -> Result<(), backend::BackendError> {
        self.flusher.durable(f)
    }

    /// The payload bytes a decoded request will hold while it runs (what
    /// the byte budgets count, taken before [`Volume::validate`]): a READ's
    /// or WRITE's length, where its length and range pass the checks of
    /// `validate`; 0 where they do not (it will be refused at once). Until
    /// 2026-12-07 a READ of 4 GiB - 1 past the end of the volume was
    /// charged its length, clamped to every budget whole: the server's
    /// reads and writes, on every connection and volume, waited behind one
    /// request that was then refused.
    pub fn moves(&self, r: &IoRequest, limits: &Limits) -> u64 {
        match r.kind {
            IoKind::Read | IoKind::Write
                if r.length <= self.data_limit(limits) && self.holds(r.offset, r.length) =>
            {
                r.length
            }
            _ => 0,
        }
    }

    /// Whether the volume takes a write of `range` (offset, length; any
    /// write when not at hand) under `limits`: what [`Volume::moves`] and
    /// [`Volume::validate`] would not refuse it for. A write's payload is
    /// charged to the budgets while it arrives only if so.
    pub fn takes_write(&self, range: Option<(u64, u64)>, limits: &Limits) -> bool {
        self.caps.write
            && !limits.read_only
            && range.is_none_or(|(offset, length)| {
                length <= self.data_limit(limits) && self.holds(offset, length)
            })
    }

    /// The longest READ or WRITE (the front end's limit, the store's).
    fn data_limit(&self, limits: &Limits) -> u64 {
        limits.max_io.min(self.blocks.maximum) as u64
    }

    /// Whether `offset..offset + length` is within the volume.
    fn holds(&self, offset: u64, length: u64) -> bool {
        offset.checked_add(length).is_some_and(|end| end <= self.size)
    }

    /// Checks a decoded request against the volume (size, capabilities,
    /// read-only) and the front end's limits (alignment, largest transfer).
    /// A refused request has no effect.
    pub fn validate(&self, r: IoRequest, limits: &Limits) -> Result<Op, Refusal> {
        let IoRequest { kind, offset, length, fua, payload } = r;
        let caps = &self.caps;
        if kind.writes() && (!caps.write || limits.read_only) {
            return Err(Refusal::ReadOnly);
        }
        match kind {
            IoKind::Flush if !caps.flush => return Err(Refusal::Unsupported("FLUSH")),
            IoKind::Flush => return Ok(Op { kind: OpKind::Flush }),
            IoKind::Trim if !caps.trim => return Err(Refusal::Unsupported("TRIM")),
            IoKind::WriteZeroes { .. } if !caps.zero => return Err(Refusal::Unsupported("WRITE_ZEROES")),
            IoKind::WriteZeroes { fast_only: true, .. } if !caps.fast_zero => return Err(Refusal::NotFast),
            IoKind::Cache if !caps.cache => return Err(Refusal::Unsupported("CACHE")),
            _ => {}
        }
        // FUA is native, or a flush after the change; with neither, durability cannot be promised.
        if fua && kind.writes() && !caps.fua && !caps.flush {
            return Err(Refusal::Unsupported("FUA"));
        }
        if length == 0 {
            return Err(Refusal::Invalid("zero length"));
        }
        // READ and WRITE move data through memory: bound them; the others may
        // span the volume (a long one runs in turns: `Op::split_off`). Until
        // 2026-11-29 they stopped at 4 GiB, which only an NVMe/TCP Dataset
        // Management range can pass (BRP's and NBD's lengths are 32 bits):
        // such a deallocate got Invalid Field.
        let moves_data = matches!(kind, IoKind::Read | IoKind::Write);
        let limit = if moves_data { self.data_limit(limits) } else { u64::MAX };
        if length > limit {
            return Err(Refusal::TooLarge { length, limit });
        }
        let align = limits.align.max(self.blocks.minimum).max(1);
        if !offset.is_multiple_of(align as u64) || !length.is_multiple_of(align as u64) {
            return Err(Refusal::Misaligned { offset, length, align });
        }
        if !self.holds(offset, length) {
            return Err(Refusal::OutOfRange { offset, length, size: self.size });
        }
        let kind = match kind {
            IoKind::Read => OpKind::Read { offset, len: length as u32 },
            IoKind::Write if payload.len() as u64 != length => {
                return Err(Refusal::Invalid("payload length differs from the request's"))
            }
            IoKind::Write => OpKind::Write { offset, data: payload, fua },
            IoKind::Trim => OpKind::Trim { offset, len: length, fua },
            IoKind::WriteZeroes { no_hole, fast_only } => {
                OpKind::WriteZeroes { offset, len: length, flags: ZeroFlags { fua, no_hole, fast_only } }
            }
            IoKind::Cache => OpKind::Cache { offset, len: length },
            IoKind::BlockStatus { one } => OpKind::BlockStatus { offset, len: length, one },
            IoKind::Flush => OpKind::Flush,
        };
        Ok(Op { kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BackendError, MemoryBackend, ReadOnlyLayer};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

    fn vol(read_only: bool) -> Volume {
        let mut b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
        if read_only {
            b = Arc::new(ReadOnlyLayer::new(b));
        }
        Volume::with_backend("v".into(), b, 65536)
    }

    const BRP: Limits = Limits { align: 512, max_io: 65536, read_only: false };

    /// A store whose flushes take 100 ms, the first one failing.
    struct SlowFlush {
        next: Arc<dyn Backend>,
        calls: std::sync::atomic::AtomicU32,
    }

    impl backend::Layer for SlowFlush {
        fn next(&self) -> &dyn Backend {
            &*self.next
        }
        fn flush(&self) -> backend::Result<()> {
            let n = self.calls.fetch_add(1, SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(100));
            if n == 0 {
                Err(BackendError::Io(libc::EIO))
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn flushes_run_in_groups_and_none_answers_ok_past_a_failure() {
        let layer =
            Arc::new(SlowFlush { next: Arc::new(MemoryBackend::new(1 << 20)), calls: Default::default() });
        let v = Arc::new(Volume::with_backend("v".into(), layer.clone(), 65536));
        // A starts the failing flush; B..J arrive while it runs: none may answer OK.
        let a = std::thread::spawn({
            let v = v.clone();
            move || v.flush()
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        let later: Vec<_> = (0..8)
            .map(|_| {
                let v = v.clone();
                std::thread::spawn(move || v.flush())
            })
            .collect();
        assert_eq!(a.join().unwrap(), Err(BackendError::Io(libc::EIO)));
        for t in later {
            assert_eq!(
                t.join().unwrap(),
                Err(BackendError::WritebackLost),
                "latched before they were answered"
            );
        }
        assert_eq!(v.flush(), Err(BackendError::WritebackLost), "and stays so");
        assert!(layer.calls.load(SeqCst) <= 2, "the later ones shared a flush: {}", layer.calls.load(SeqCst));
    }

    /// A store that cannot be reached for its first flush (a remote target
    /// away): that flush fails, and the next one, once it is back, succeeds.
    struct Away {
        next: Arc<dyn Backend>,
        calls: std::sync::atomic::AtomicU32,
    }

    impl backend::Layer for Away {
        fn next(&self) -> &dyn Backend {
            &*self.next
        }
        fn flush(&self) -> backend::Result<()> {
            match self.calls.fetch_add(1, SeqCst) {
                0 => Err(BackendError::Unavailable),
                _ => Ok(()),
            }
        }
    }

    #[test]
    fn a_flush_that_could_not_reach_its_store_is_not_latched() {
        let b = Arc::new(Away { next: Arc::new(MemoryBackend::new(1 << 20)), calls: Default::default() });
        let v = Volume::with_backend("v".into(), b, 65536);
        assert_eq!(v.flush(), Err(BackendError::Unavailable));
        assert_eq!(v.flush(), Ok(()), "the store is back: nothing was known lost");
    }

    /// A store whose flushes take 50 ms; with `panics`, the first one panics.
    struct Flaky {
        next: Arc<dyn Backend>,
        calls: std::sync::atomic::AtomicU32,
        panics: bool,
    }

    impl backend::Layer for Flaky {
        fn next(&self) -> &dyn Backend {
            &*self.next
        }
        fn may_block(&self) -> bool {
            true // a volume with an I/O pool
        }
        fn flush(&self) -> backend::Result<()> {
            let n = self.calls.fetch_add(1, SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!(self.panics && n == 0), "a backend's bug");
            Ok(())
        }
    }

    fn flaky(panics: bool) -> (Arc<Flaky>, Arc<Volume>) {
        let next = Arc::new(MemoryBackend::new(1 << 20));
        let layer = Arc::new(Flaky { next, calls: Default::default(), panics });
        (layer.clone(), Arc::new(Volume::with_backend("v".into(), layer, 65536)))
    }

    /// Asks for a flush with `flush_then`; its answer comes on the receiver.
    fn answer(v: &Volume) -> std::sync::mpsc::Receiver<backend::Result<()>> {
        let (tx, rx) = std::sync::mpsc::channel();
        v.flush_then(Box::new(move |r| {
            let _ = tx.send(r);
        }));
        rx
    }

    /// A flush on another thread, given 10 ms to start (it leads: the volume was idle).
    fn leading(v: &Arc<Volume>) -> std::thread::JoinHandle<backend::Result<()>> {
        let v = v.clone();
        let a = std::thread::spawn(move || v.flush());
        std::thread::sleep(std::time::Duration::from_millis(10));
        a
    }

    #[test]
    fn a_flush_that_panics_fails_everyone_waiting_and_stays_failed() {
        let (_, v) = flaky(true);
        let a = leading(&v);
        let later: Vec<_> = (0..4).map(|_| answer(&v)).collect();
        assert_eq!(a.join().unwrap(), Err(BackendError::Io(libc::EIO)), "the caller that ran it is told");
        for rx in later {
            let r = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("answered, not left waiting");
            assert!(r.is_err(), "a flush that panicked may not have reached the device: {r:?}");
        }
        assert_eq!(v.flush(), Err(BackendError::WritebackLost), "latched");
    }

    #[test]
    fn a_waiter_whose_answer_panics_fails_nothing_else() {
        let (_, v) = flaky(false);
        let a = leading(&v);
        // Both wait for the next flush; the first one's reply path panics.
        v.flush_then(Box::new(|_| panic!("a bug on the reply path")));
        let b = answer(&v);
        assert_eq!(a.join().unwrap(), Ok(()));
        assert_eq!(b.recv_timeout(std::time::Duration::from_secs(5)), Ok(Ok(())));
        assert_eq!(v.flush(), Ok(()), "the volume's flushes are not failed for it");
    }

    #[test]
    fn a_caller_that_waits_is_not_kept_flushing_for_others() {
        let (layer, v) = flaky(false);
        // One caller runs a flush and waits for it; others keep asking for
        // flushes meanwhile (as other clients' FUA writes do).
        let stop = Arc::new(AtomicBool::new(false));
        let others = std::thread::spawn({
            let (v, stop) = (v.clone(), stop.clone());
            move || {
                std::thread::sleep(std::time::Duration::from_millis(10));
                let (mut answers, t) = (Vec::new(), std::time::Instant::now());
                // Bounded: a caller kept flushing for others would otherwise wait forever.
                while !stop.load(SeqCst) && t.elapsed() < std::time::Duration::from_secs(3) {
                    answers.push(answer(&v));
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                answers
            }
        });
        let t = std::time::Instant::now();
        assert_eq!(v.flush(), Ok(()));
        let waited = t.elapsed();
        std::thread::sleep(std::time::Duration::from_millis(500));
        stop.store(true, SeqCst);
        let answers = others.join().unwrap();
        // Its own flush (50 ms): not the flushes of everyone who kept coming
        // after it.
        assert!(waited < std::time::Duration::from_millis(450), "waited {waited:?}");
        for rx in answers {
            assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(5)), Ok(Ok(())));
        }
        assert!(layer.calls.load(SeqCst) >= 3, "flushes went on on the volume's own threads");
    }

    #[test]
    fn concurrent_flushes_share_one_device_flush() {
        let layer = Arc::new(SlowFlush { next: Arc::new(MemoryBackend::new(1 << 20)), calls: 1.into() });
        let v = Arc::new(Volume::with_backend("v".into(), layer.clone(), 65536));
        let all: Vec<_> = (0..8)
            .map(|_| {
                let v = v.clone();
                std::thread::spawn(move || v.flush())
            })
            .collect();
        for t in all {
            assert_eq!(t.join().unwrap(), Ok(()));
        }
        // The first runs alone; all that arrive while it runs share the next.
        assert!(
            layer.calls.load(SeqCst) - 1 <= 2,
            "{} device flushes for 8 calls",
            layer.calls.load(SeqCst) - 1
        );
    }

    /// A store that serves every path without a thread (`read_now`,
    /// `write_now`, `submit`), counts the calls that reach it, and fails
    /// its first flush.
    struct EveryPath {
        next: Arc<dyn Backend>,
        calls: std::sync::atomic::AtomicU32,
        flushes: std::sync::atomic::AtomicU32,
    }

    impl backend::Layer for EveryPath {
        fn next(&self) -> &dyn Backend {
            &*self.next
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> backend::Result<()> {
            self.calls.fetch_add(1, SeqCst);
            self.next.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> backend::Result<()> {
            self.calls.fetch_add(1, SeqCst);
            self.next.write_at(buf, offset, fua)
        }
        fn can_read_now(&self) -> bool {
            true
        }
        fn read_now(&self, buf: &mut [u8], offset: u64) -> backend::Result<bool> {
            backend::Layer::read_at(self, buf, offset).map(|()| true)
        }
        fn can_write_now(&self) -> bool {
            true
        }
        fn write_now(&self, buf: &[u8], offset: u64) -> backend::Result<bool> {
            backend::Layer::write_at(self, buf, offset, false).map(|()| true)
        }
        fn can_submit(&self) -> bool {
            true
        }
        fn can_submit_writes(&self) -> bool {
            true
        }
        fn submit(&self, _client: u64, io: backend::DeviceIo, done: backend::DeviceDone) {
            done(match io {
                backend::DeviceIo::Read { offset, len } => {
                    let mut buf = vec![0; len as usize];
                    backend::Layer::read_at(self, &mut buf, offset).map(|()| Some(Bytes::from(buf).into()))
                }
                backend::DeviceIo::Write { offset, data } => {
                    backend::Layer::write_at(self, &data, offset, false).map(|()| None)
                }
            })
        }
        fn flush(&self) -> backend::Result<()> {
            match self.flushes.fetch_add(1, SeqCst) {
                0 => Err(BackendError::Io(libc::EIO)),
                _ => Ok(()),
            }
        }
    }

    /// Every way a request reaches the store, as (read, write) results.
    fn every_path(v: &Volume) -> Vec<(&'static str, Result<(), Refusal>)> {
        let op = |kind| check(v, kind, 4096, 4096).unwrap();
        let submitted = |kind| {
            let (tx, rx) = std::sync::mpsc::channel();
            v.submit(1, op(kind), Box::new(move |r| tx.send(r.map(drop)).unwrap()));
            rx.recv().unwrap()
        };
        vec![
            ("read_now", v.read_now(&op(IoKind::Read)).expect("served now").map(drop)),
            ("write_now", v.write_now(&op(IoKind::Write)).expect("taken now").map(drop)),
            ("submitted read", submitted(IoKind::Read)),
            ("submitted write", submitted(IoKind::Write)),
            ("read", v.execute(op(IoKind::Read)).map(drop)),
            ("write", v.execute(op(IoKind::Write)).map(drop)),
            ("trim", v.execute(op(IoKind::Trim)).map(drop)),
        ]
    }

    #[test]
    fn after_a_failed_flush_every_request_fails_without_reaching_the_store() {
        let layer = Arc::new(EveryPath {
            next: Arc::new(MemoryBackend::new(1 << 20)),
            calls: Default::default(),
            flushes: Default::default(),
        });
        let v = Volume::with_backend("v".into(), layer.clone(), 65536);
        for (path, r) in every_path(&v) {
            assert_eq!(r, Ok(()), "{path} before the failure");
        }
        assert!(!v.failed());
        assert_eq!(v.flush(), Err(BackendError::Io(libc::EIO)));
        assert!(v.failed());
        let calls = layer.calls.load(SeqCst);
        for (path, r) in every_path(&v) {
            assert_eq!(r, Err(Refusal::Device(BackendError::WritebackLost)), "{path} after it");
        }
        assert_eq!(layer.calls.load(SeqCst), calls, "nothing reached the store");
    }

    /// A store whose first flush fails, and whose record of it waits until
    /// `release` is set.
    struct SlowRecord {
        next: Arc<dyn Backend>,
        flushes: std::sync::atomic::AtomicU32,
        release: AtomicBool,
    }

    impl backend::Layer for SlowRecord {
        fn next(&self) -> &dyn Backend {
            &*self.next
        }
        fn can_read_now(&self) -> bool {
            true
        }
        fn read_now(&self, buf: &mut [u8], offset: u64) -> backend::Result<bool> {
            self.next.read_at(buf, offset).map(|()| true)
        }
        fn flush(&self) -> backend::Result<()> {
            match self.flushes.fetch_add(1, SeqCst) {
                0 => Err(BackendError::Io(libc::EIO)),
                _ => Ok(()),
            }
        }
        fn record_failed_flush(&self) -> std::io::Result<()> {
            let t = std::time::Instant::now();
            while !self.release.load(SeqCst) && t.elapsed() < std::time::Duration::from_secs(5) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Ok(())
        }
    }

    /// While a failed flush is being recorded, reads already fail, but
    /// nobody is told that a flush failed until the record is made (a
    /// target killed meanwhile would let the sessions of before resume).
    #[test]
    fn reads_fail_at_once_and_flushes_are_told_once_the_failure_is_recorded() {
        let layer = Arc::new(SlowRecord {
            next: Arc::new(MemoryBackend::new(1 << 20)),
            flushes: Default::default(),
            release: AtomicBool::new(false),
        });
        let v = Arc::new(Volume::with_backend("v".into(), layer.clone(), 65536));
        let failing = leading(&v);
        let t = std::time::Instant::now();
        while !v.failed() {
            assert!(t.elapsed() < std::time::Duration::from_secs(5), "the failure is seen at once");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let read = v.read_now(&check(&v, IoKind::Read, 0, 4096).unwrap()).expect("served now");
        assert_eq!(read.map(drop), Err(Refusal::Device(BackendError::WritebackLost)));
        let told = std::thread::spawn({
            let v = v.clone();
            move || v.execute(check(&v, IoKind::Flush, 0, 0).unwrap()).map(drop)
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!told.is_finished(), "a FLUSH is not answered before the record is made");
        layer.release.store(true, SeqCst);
        assert_eq!(told.join().unwrap(), Err(Refusal::Device(BackendError::WritebackLost)));
        assert_eq!(failing.join().unwrap(), Err(BackendError::Io(libc::EIO)));
    }

    /// A store whose reads come back 512 bytes short (a bug in it).
    struct Short(Arc<dyn Backend>);

    impl backend::Layer for Short {
        fn next(&self) -> &dyn Backend {
            &*self.0
        }
        fn can_share_reads(&self) -> bool {
            true
        }
        fn read_shared(&self, offset: u64, len: u64) -> backend::Result<crate::request::ReadData> {
            self.0.read_shared(offset, len - 512)
        }
        fn can_submit(&self) -> bool {
            true
        }
        fn submit(&self, _client: u64, io: backend::DeviceIo, done: backend::DeviceDone) {
            let backend::DeviceIo::Read { offset, len } = io else { return done(Ok(None)) };
            done(self.0.read_shared(offset, len as u64 - 512).map(Some))
        }
    }

    #[test]
    fn a_read_the_store_returns_short_is_a_device_error_not_short_data() {
        let v =
            Volume::with_backend("v".into(), Arc::new(Short(Arc::new(MemoryBackend::new(1 << 20)))), 65536);
        let eio = Err(Refusal::Device(BackendError::Io(libc::EIO)));
        assert_eq!(v.execute(check(&v, IoKind::Read, 0, 8192).unwrap()).map(drop), eio);
        let (tx, rx) = std::sync::mpsc::channel();
        v.submit(
            1,
            check(&v, IoKind::Read, 0, 8192).unwrap(),
            Box::new(move |r| tx.send(r.map(drop)).unwrap()),
        );
        assert_eq!(rx.recv().unwrap(), eio);
    }

    fn check(v: &Volume, kind: IoKind, offset: u64, length: u64) -> Result<Op, Refusal> {
        let payload =
            if kind == IoKind::Write { Bytes::from(vec![0u8; length as usize]) } else { Bytes::new() };
        v.validate(IoRequest { kind, offset, length, fua: false, payload }, &BRP)
    }

    #[test]
    fn each_bad_request_gets_its_refusal_with_its_context() {
        let v = vol(false);
        assert!(check(&v, IoKind::Read, 0, 4096).is_ok());
        assert!(check(&v, IoKind::Write, 512, 512).is_ok());
        assert_eq!(check(&v, IoKind::Read, 0, 0).err(), Some(Refusal::Invalid("zero length")));
        assert_eq!(
            check(&v, IoKind::Read, 1, 512).err(),
            Some(Refusal::Misaligned { offset: 1, length: 512, align: 512 })
        );
        assert!(matches!(check(&v, IoKind::Read, 0, 100), Err(Refusal::Misaligned { length: 100, .. })));
        assert_eq!(
            check(&v, IoKind::Read, 1 << 20, 512).err(),
            Some(Refusal::OutOfRange { offset: 1 << 20, length: 512, size: 1 << 20 })
        );
        assert!(matches!(check(&v, IoKind::Read, u64::MAX - 511, 512), Err(Refusal::OutOfRange { .. })));
        assert_eq!(
            check(&v, IoKind::Read, 0, 1 << 17).err(),
            Some(Refusal::TooLarge { length: 1 << 17, limit: 65536 })
        );
        let text = check(&v, IoKind::Read, 1 << 20, 512).err().unwrap().to_string();
        assert!(text.contains("1048576+512") && text.contains("(1048576 bytes)"), "{text}");
        assert!(check(&v, IoKind::Trim, 0, 1 << 20).is_ok(), "trim is not bound by max transfer");
        assert!(check(&v, IoKind::BlockStatus { one: false }, 0, 1 << 20).is_ok());
        let short = IoRequest {
            kind: IoKind::Write,
            offset: 0,
            length: 1024,
            fua: false,
            payload: Bytes::from(vec![0; 512]),
        };
        assert!(matches!(v.validate(short, &BRP), Err(Refusal::Invalid(_))));
        let bytes = Limits { align: 1, max_io: 1 << 20, read_only: false };
        let odd = IoRequest { kind: IoKind::Read, offset: 3, length: 5, fua: false, payload: Bytes::new() };
        assert!(v.validate(odd, &bytes).is_ok(), "byte-granular front ends may read any range");
    }

    #[test]
    fn read_only_refuses_every_change() {
        let v = vol(true);
        assert!(v.read_only());
        assert!(check(&v, IoKind::Read, 0, 512).is_ok());
        assert!(check(&v, IoKind::Flush, 0, 0).is_ok());
        assert!(check(&v, IoKind::Cache, 0, 512).is_ok());
        let zero = IoKind::WriteZeroes { no_hole: false, fast_only: false };
        for k in [IoKind::Write, IoKind::Trim, zero] {
            assert_eq!(check(&v, k, 0, 512).err(), Some(Refusal::ReadOnly), "{k:?}");
        }
    }

    #[test]
    fn executes_what_was_validated() {
        let v = vol(false);
        let w = IoRequest {
            kind: IoKind::Write,
            offset: 512,
            length: 512,
            fua: true,
            payload: Bytes::from(vec![3u8; 512]),
        };
        assert!(matches!(v.execute(v.validate(w, &BRP).unwrap()), Ok(Outcome::Done)));
        let Ok(Outcome::Data(d)) = v.execute(check(&v, IoKind::Read, 0, 1024).unwrap()) else { panic!() };
        let d = d.to_bytes();
        assert_eq!(&d[..512], &[0u8; 512][..]);
        assert_eq!(&d[512..], &[3u8; 512][..]);
        let s = v.stats();
        assert_eq!((s.reads, s.writes, s.bytes_written), (1, 1, 512));
    }

    #[test]
    fn a_large_read_is_what_the_volume_held_when_it_ran() {
        let v = vol(false);
        let write = |byte: u8| IoRequest {
            kind: IoKind::Write,
            offset: 0,
            length: 65536,
            fua: false,
            payload: Bytes::from(vec![byte; 65536]),
        };
        v.execute(v.validate(write(1), &BRP).unwrap()).unwrap();
        let Ok(Outcome::Data(held)) = v.execute(check(&v, IoKind::Read, 0, 65536).unwrap()) else { panic!() };
        // The reply is not sent yet when a write to the same range runs.
        v.execute(v.validate(write(2), &BRP).unwrap()).unwrap();
        assert!(held.to_bytes().iter().all(|&b| b == 1), "a write changed a read's reply");
        let Ok(Outcome::Data(now)) = v.execute(check(&v, IoKind::Read, 0, 65536).unwrap()) else { panic!() };
        assert!(now.to_bytes().iter().all(|&b| b == 2));
        // A 4 KiB read is lent too: held while a write lands on it, it keeps its bytes.
        let Ok(Outcome::Data(small)) = v.execute(check(&v, IoKind::Read, 4096, 4096).unwrap()) else {
            panic!()
        };
        v.execute(v.validate(write(3), &BRP).unwrap()).unwrap();
        assert!(small.to_bytes().iter().all(|&b| b == 2), "a write changed a 4K read's reply");
        // Shorter reads are copied: the same, whichever way they go.
        let Ok(Outcome::Data(tiny)) = v.execute(check(&v, IoKind::Read, 512, 512).unwrap()) else { panic!() };
        assert!(tiny.to_bytes().iter().all(|&b| b == 3));
    }

    #[test]
    fn the_hot_path_result_stays_small() {
        // Every request's outcome crosses a channel; keep it within a cache line.
        assert!(std::mem::size_of::<Result<Outcome, Refusal>>() <= 48);
        assert!(std::mem::size_of::<Refusal>() <= 32);
        let _ = BackendError::NoSpace;
    }
}
