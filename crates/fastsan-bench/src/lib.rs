//! Load generation for fastsan: fio-like jobs against BRP volumes (through
//! the initiator library), any NBD server (through the initiator's
//! [`NbdVolume`]) and any NVMe/TCP controller (through [`NvmeVolume`]), with
//! latency histograms, client CPU, and the initiator's BATCH statistics.
//!
//! A job is `iodepth` requesters, each with one request in flight at a time;
//! `jobs` jobs run at once. Over BRP every requester shares one session of
//! `connections` connections (the paper's "threads"); over NBD each job has
//! its own connection, as fio's nbd engine does; over NVMe/TCP each job has
//! its own I/O queue (its own connection) of one controller, as the kernel's
//! host gives each CPU its own.
//!
//! # Layout
//! - [`JobSpec`], [`Rw`]: what to run; [`run`]: runs it; [`Report`]: what it measured.
//! - [`BenchError`], [`ClientError`]: why a run or a request failed.

use bytes::Bytes;
use fastsan_initiator::mirror::MirrorSpec;
use fastsan_initiator::nbd::NbdVolume;
use fastsan_initiator::nvme::{NvmeUrl, NvmeVolume};
use fastsan_initiator::{BrpUrl, Mirror, Options, Volume};
use hdrhistogram::Histogram;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use rand::{Rng, RngCore, SeedableRng};
use serde::Serialize;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The access pattern, named as fio names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum), value(rename_all = "lower"))]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
}

impl Rw {
    fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite | Rw::RandRw)
    }
    /// Whether a job of this pattern writes (`rwmixread`: the share of reads of RandRw).
    fn writes(self, rwmixread: u8) -> bool {
        match self {
            Rw::Read | Rw::RandRead => false,
            Rw::Write | Rw::RandWrite => true,
            Rw::RandRw => rwmixread < 100,
        }
    }
}

#[derive(Debug, Clone)]
pub struct JobSpec {
    /// `brp://HOST:PORT/VOLUME`, `brp+unix:///VOLUME?socket=PATH`,
    /// `nbd://HOST:PORT/EXPORT`,
    /// `nvme+tcp://HOST[:PORT]/SUBSYSTEM_NQN[/NSID][?hdgst=1&ddgst=1]` or
    /// `mirror:LEG,LEG,log=PATH`.
    pub url: String,
    pub rw: Rw,
    pub bs: u32,
    pub iodepth: usize,
    pub jobs: usize,
    pub runtime: Duration,
    /// Warm-up before measuring.
    pub ramp: Duration,
    /// Bytes of the volume to use (default: all of it).
    pub size: Option<u64>,
    /// Percentage of reads in randrw.
    pub rwmixread: u8,
    /// Write a pattern that depends on the offset and check every read of a
    /// block this run has written.
    pub verify: bool,
    /// Writes with FUA: each durable when acknowledged.
    pub fua: bool,
    /// A FLUSH after every this many writes of a job (0: none), as fio's
    /// `fsync=N`: the requester whose write completes the count waits for it.
    pub fsync: u32,
    /// BRP: the session's options (connections, merge mode, secret,
    /// digests, reconnect and request timeouts).
    pub brp: Options,
    /// Show a live progress line on a terminal.
    pub progress: bool,
}

/// Why a run could not start or finish. Causes stay typed: print the
/// chain (anyhow's `{:#}`) to see them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot open {url}")]
    Open {
        url: String,
        #[source]
        source: ClientError,
    },
    /// A requester panicked: a bug in the bench.
    #[error("a requester task failed")]
    Task(#[from] tokio::task::JoinError),
}

/// Why a request failed, as the client that sent it tells (BRP, NBD or NVMe/TCP).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error(transparent)]
    Client(#[from] fastsan_initiator::Error),
}

/// An error and its causes, `: `-separated, as anyhow's `{:#}` prints them.
struct Chain<'a>(&'a dyn std::error::Error);

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(c) = cause {
            write!(f, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    }
}

/// What a run measured. Latencies in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub url: String,
    pub rw: Rw,
    pub bs: u32,
    pub iodepth: usize,
    pub jobs: usize,
    pub requesters: usize,
    pub connections: usize,
    pub merge: String,
    pub runtime_s: f64,
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    pub iops: f64,
    pub mib_s: f64,
    pub lat_mean_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub lat_max_us: f64,
    /// FLUSHes sent in the measured window (`--fsync`), and their mean
    /// latency (not in the I/O latencies above, which are reads' and writes').
    pub flushes: u64,
    pub flush_lat_mean_us: f64,
    /// Client CPU (user + system) as a share of one core.
    pub client_cpu_pct: f64,
    pub client_cpu_us_per_io: f64,
    /// The client's threads (the runtime's workers).
    pub client_threads: usize,
    pub errors: u64,
    pub verify_mismatches: u64,
    /// BRP only: frames sent, BATCH frames among them, requests they carried.
    pub frames: u64,
    pub batches: u64,
    pub batched_requests: u64,
    /// BRP, the whole run: requests sent again after their connection was
    /// lost (after the target's fence), connections re-established, and
    /// connections dropped for a request without a reply in time.
    pub retries: u64,
    pub reconnects: u64,
    pub timeouts: u64,
}

enum Target {
    Brp(Volume),
    /// One connection per job.
    Nbd(Vec<Arc<NbdVolume>>),
    /// One I/O queue per job (fewer if the controller grants fewer: jobs then share).
    Nvme(NvmeVolume),
    Mirror(Mirror),
}

impl Target {
    // Async blocks, not async fns: the arguments are held once, not twice,
    // in every requester's future.
    #[allow(clippy::manual_async_fn)]
    fn read(&self, job: usize, off: u64, len: u32) -> impl Future<Output = Result<Bytes, ClientError>> + '_ {
        async move {
            Ok(match self {
                Target::Brp(v) => v.read(off, len as u64).await?,
                Target::Nbd(c) => c[job].read(off, len as u64).await?,
                Target::Nvme(v) => v.read_on(job, off, len as u64).await?,
                // Boxed: a mirror's future is larger than a single volume's,
                // and every requester's would be as large as the largest.
                Target::Mirror(m) => Box::pin(m.read(off, len as u64)).await?,
            })
        }
    }
    #[allow(clippy::manual_async_fn)]
    fn write(
        &self,
        job: usize,
        off: u64,
        data: Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), ClientError>> + '_ {
        async move {
            match self {
                Target::Brp(v) => Ok(v.write_bytes(data, off, fua).await?),
                Target::Nbd(c) => Ok(c[job].write_bytes(data, off, fua).await?),
                Target::Nvme(v) => Ok(v.write_bytes_on(job, data, off, fua).await?),
                Target::Mirror(m) => Ok(Box::pin(m.write_bytes(data, off, fua)).await?),
            }
        }
    }
    /// A FLUSH on the job's connection (or queue; the session's over BRP).
    async fn flush(&self, job: usize) -> Result<(), ClientError> {
        match self {
            Target::Brp(v) => Ok(v.flush().await?),
            Target::Nbd(c) => Ok(c[job].flush().await?),
            Target::Nvme(v) => Ok(v.flush().await?),
            Target::Mirror(m) => Ok(Box::pin(m.flush()).await?),
        }
    }
    fn read_only(&self) -> bool {
        match self {
            Target::Brp(v) => v.read_only(),
            Target::Nbd(c) => c[0].read_only(),
            Target::Nvme(v) => v.read_only(),
            // A mirror's legs all take writes (it refuses to open otherwise).
            Target::Mirror(_) => false,
        }
    }
    fn size(&self) -> u64 {
        match self {
            Target::Brp(v) => v.size(),
            Target::Nbd(c) => c[0].size(),
            Target::Nvme(v) => v.size(),
            Target::Mirror(m) => m.size(),
        }
    }
}

/// Counters shared by every requester: the rare events.
#[derive(Default)]
struct Shared {
    errors: AtomicU64,
    mismatches: AtomicU64,
}

/// One job's tally of measured I/Os, which its requesters update under one
/// lock per I/O, on cache lines of its own. (Counters shared by every job
/// cost a lock and two atomic adds per I/O, on lines that every client
/// thread wrote; side by side at 4 x QD8 reads, the tally ran 2-4% faster.)
#[repr(align(128))]
struct Tally {
    hist: Histogram<u64>,
    reads: u64,
    writes: u64,
    bytes: u64,
    flushes: u64,
    flush_ns: u64,
}

impl Tally {
    fn new() -> Tally {
        let hist = Histogram::new_with_bounds(100, 120_000_000_000, 3).expect("valid bounds");
        Tally { hist, reads: 0, writes: 0, bytes: 0, flushes: 0, flush_ns: 0 }
    }
}

/// The block content `--verify` writes at `offset`.
fn pattern(offset: u64, len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    for (i, c) in v.chunks_mut(8).enumerate() {
        let x = (offset + i as u64 * 8).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
        c.copy_from_slice(&x[..c.len()]);
    }
    Bytes::from(v)
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass; zeroed is a valid initial value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to a live rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Runs one job description to the end and reports.
pub async fn run(spec: JobSpec) -> Result<Report, BenchError> {
    if spec.bs == 0 || spec.bs > 32 << 20 || !spec.bs.is_multiple_of(512) {
        return Err(BenchError::Invalid("--bs must be a multiple of 512 up to 32M".into()));
    }
    if spec.iodepth == 0 || spec.jobs == 0 || spec.iodepth * spec.jobs > 65536 {
        return Err(BenchError::Invalid(
            "--iodepth and --jobs must be at least 1 (and their product at most 65536)".into(),
        ));
    }
    if spec.rwmixread > 100 {
        return Err(BenchError::Invalid("--rwmixread is a percentage".into()));
    }
    // Options that would do nothing for this job are refused, not ignored.
    let writes = spec.rw.writes(spec.rwmixread);
    if !writes && (spec.verify || spec.fua || spec.fsync > 0) {
        return Err(BenchError::Invalid(
            "--verify, --fua and --fsync act on writes; this job only reads (use --rw randwrite, \
             write or randrw)"
                .into(),
        ));
    }
    let open_err = |e: ClientError| BenchError::Open { url: spec.url.clone(), source: e };
    let target = if BrpUrl::has_scheme(&spec.url) {
        Target::Brp(Volume::connect(&spec.url, spec.brp.clone()).await.map_err(|e| open_err(e.into()))?)
    } else if spec.url.starts_with("nbd://") {
        let mut v = Vec::new();
        for _ in 0..spec.jobs {
            v.push(Arc::new(NbdVolume::connect(&spec.url, &spec.brp).await.map_err(|e| open_err(e.into()))?));
        }
        Target::Nbd(v)
    } else if NvmeUrl::has_scheme(&spec.url) {
        // A queue per job, each as deep as the job's requesters.
        let queues = spec.jobs.min(fastsan_initiator::nvme::MAX_QUEUES);
        let v = NvmeVolume::connect_with(&spec.url, &spec.brp, queues, spec.iodepth.min(0xfffe)).await;
        Target::Nvme(v.map_err(|e| open_err(e.into()))?)
    } else if MirrorSpec::is_mirror(&spec.url) {
        Target::Mirror(Mirror::open(&spec.url, spec.brp.clone()).await.map_err(|e| open_err(e.into()))?)
    } else {
        return Err(BenchError::Invalid(format!(
            "{}: expected brp://..., brp+unix://..., nbd://..., nvme+tcp://... or mirror:...",
            spec.url
        )));
    };
    // Asked for what the volume cannot do: said before a second is spent.
    if spec.rw.writes(spec.rwmixread) && target.read_only() {
        return Err(BenchError::Invalid(format!("{} is read-only: this job writes", spec.url)));
    }
    if let Some(size) = spec.size.filter(|&n| n > target.size()) {
        return Err(BenchError::Invalid(format!("--size {size}: the volume has {} bytes", target.size())));
    }
    let span = spec.size.unwrap_or(u64::MAX).min(target.size()) / spec.bs as u64 * spec.bs as u64;
    if span < spec.bs as u64 {
        return Err(BenchError::Invalid(match spec.size {
            Some(size) if size < target.size() => {
                format!("--size {size} is smaller than one block (--bs {})", spec.bs)
            }
            _ => format!("the volume ({} bytes) is smaller than one block (--bs {})", target.size(), spec.bs),
        }));
    }
    let blocks = span / spec.bs as u64;
    let target = Arc::new(target);
    let shared = Arc::new(Shared::default());
    let written: Arc<Vec<AtomicU64>> =
        Arc::new((0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect());
    let tallies: Vec<Arc<Mutex<Tally>>> =
        (0..spec.jobs).map(|_| Arc::new(Mutex::new(Tally::new()))).collect();
    let cursors: Vec<Arc<AtomicU64>> =
        (0..spec.jobs).map(|j| Arc::new(AtomicU64::new(j as u64 * blocks / spec.jobs as u64))).collect();
    // Each job's writes, for `--fsync`.
    let job_writes: Vec<Arc<AtomicU64>> = (0..spec.jobs).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut fill = vec![0u8; spec.bs as usize];
    rand::thread_rng().fill_bytes(&mut fill);
    let fill = Bytes::from(fill);

    let start = Instant::now();
    let measure_from = start + spec.ramp;
    let end = measure_from + spec.runtime;
    let before_stats = brp_stats(&target);
    let progress = spawn_progress(spec.progress, tallies.clone(), spec.bs, measure_from, end);
    let mut tasks = Vec::new();
    for job in 0..spec.jobs {
        for k in 0..spec.iodepth {
            let (target, shared, written, tally, cursor, fill, job_writes) = (
                target.clone(),
                shared.clone(),
                written.clone(),
                tallies[job].clone(),
                cursors[job].clone(),
                fill.clone(),
                job_writes[job].clone(),
            );
            let spec = spec.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = rand::rngs::SmallRng::seed_from_u64((job * 100_003 + k) as u64);
                // One clock read per I/O: its end is the next one's start
                // (at 400 K I/Os a second, a second read was ~2% of the
                // client), so a latency also counts the tally of the I/O
                // before it (a lock and a histogram add, ~0.1 us).
                let mut now = Instant::now();
                loop {
                    if now >= end {
                        break;
                    }
                    let block = if spec.rw.random() {
                        rng.gen_range(0..blocks)
                    } else {
                        cursor.fetch_add(1, Relaxed) % blocks
                    };
                    let off = block * spec.bs as u64;
                    let is_read = match spec.rw {
                        Rw::Read | Rw::RandRead => true,
                        Rw::Write | Rw::RandWrite => false,
                        Rw::RandRw => rng.gen_range(0..100) < spec.rwmixread as u32,
                    };
                    let (word, bit) = ((block / 64) as usize, 1u64 << (block % 64));
                    let result = if is_read {
                        let check = spec.verify && written[word].load(Relaxed) & bit != 0;
                        match target.read(job, off, spec.bs).await {
                            Ok(d) if check && d != pattern(off, spec.bs as usize) => {
                                shared.mismatches.fetch_add(1, Relaxed);
                                Ok(())
                            }
                            Ok(_) => Ok(()),
                            Err(e) => Err(e),
                        }
                    } else {
                        let data = if spec.verify { pattern(off, spec.bs as usize) } else { fill.clone() };
                        let r = target.write(job, off, data, spec.fua).await;
                        if r.is_ok() && spec.verify {
                            written[word].fetch_or(bit, Relaxed);
                        }
                        r
                    };
                    let (began, done) = (now, Instant::now());
                    now = done;
                    let flush_due = !is_read
                        && result.is_ok()
                        && spec.fsync > 0
                        && (job_writes.fetch_add(1, Relaxed) + 1) % spec.fsync as u64 == 0;
                    let result = match result {
                        Ok(()) if flush_due => {
                            let r = target.flush(job).await;
                            let flushed = Instant::now();
                            if r.is_ok() && done >= measure_from && flushed <= end {
                                let mut t = tally.lock();
                                t.flushes += 1;
                                t.flush_ns += (flushed - done).as_nanos() as u64;
                            }
                            now = flushed;
                            r
                        }
                        r => r,
                    };
                    if began < measure_from || done > end {
                        continue;
                    }
                    match result {
                        Ok(()) => {
                            let mut t = tally.lock();
                            *if is_read { &mut t.reads } else { &mut t.writes } += 1;
                            t.bytes += spec.bs as u64;
                            let _ = t.hist.record((done - began).as_nanos().max(100) as u64);
                        }
                        Err(e) => {
                            if shared.errors.fetch_add(1, Relaxed) == 0 {
                                // Not eprintln!: it panics when stderr's reader is gone.
                                use std::io::Write as _;
                                let _ =
                                    writeln!(std::io::stderr(), "fastsan bench: I/O error: {}", Chain(&e));
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            now = Instant::now();
                        }
                    }
                }
            }));
        }
    }
    // Client CPU is counted over the measured window only.
    let cpu_probe = {
        let at = measure_from;
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            cpu_seconds()
        })
    };
    for t in tasks {
        t.await?;
    }
    let cpu_start = cpu_probe.await.unwrap_or_else(|_| cpu_seconds());
    let cpu = cpu_seconds() - cpu_start;
    if let Some((line, task)) = progress {
        task.abort();
        line.finish_and_clear();
    }
    let after_stats = brp_stats(&target);
    if let Target::Mirror(m) = &*target {
        // Nothing left dirty that every leg holds: the next open resyncs nothing.
        if let Err(e) = m.close().await {
            tracing::warn!(error = %fastsan_initiator::error::chain(&e), "closing the mirror");
        }
    }
    let mut all = Tally::new();
    for t in &tallies {
        let t = t.lock();
        all.hist.add(&t.hist).expect("same bounds");
        all.reads += t.reads;
        all.writes += t.writes;
        all.bytes += t.bytes;
        all.flushes += t.flushes;
        all.flush_ns += t.flush_ns;
    }
    let hist = &all.hist;
    let secs = spec.runtime.as_secs_f64();
    let (reads, writes) = (all.reads, all.writes);
    let ios = reads + writes;
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(Report {
        url: spec.url.clone(),
        rw: spec.rw,
        bs: spec.bs,
        iodepth: spec.iodepth,
        jobs: spec.jobs,
        requesters: spec.iodepth * spec.jobs,
        connections: match &*target {
            Target::Nbd(_) => spec.jobs,
            Target::Nvme(v) => v.queues(),
            Target::Brp(_) | Target::Mirror(_) => spec.brp.connections,
        },
        merge: format!("{:?}", spec.brp.merge).to_lowercase(),
        runtime_s: secs,
        ios,
        reads,
        writes,
        iops: ios as f64 / secs,
        mib_s: all.bytes as f64 / secs / (1 << 20) as f64,
        lat_mean_us: hist.mean() / 1000.0,
        lat_p50_us: us(hist.value_at_quantile(0.5)),
        lat_p99_us: us(hist.value_at_quantile(0.99)),
        lat_p999_us: us(hist.value_at_quantile(0.999)),
        lat_max_us: us(hist.max()),
        flushes: all.flushes,
        flush_lat_mean_us: if all.flushes > 0 {
            all.flush_ns as f64 / all.flushes as f64 / 1000.0
        } else {
            0.0
        },
        client_cpu_pct: cpu / secs * 100.0,
        client_cpu_us_per_io: if ios > 0 { cpu * 1e6 / ios as f64 } else { 0.0 },
        client_threads: tokio::runtime::Handle::current().metrics().num_workers(),
        errors: shared.errors.load(Relaxed),
        verify_mismatches: shared.mismatches.load(Relaxed),
        frames: after_stats.frames - before_stats.frames,
        batches: after_stats.batches - before_stats.batches,
        batched_requests: after_stats.batched_requests - before_stats.batched_requests,
        retries: after_stats.retries,
        reconnects: after_stats.reconnects,
        timeouts: after_stats.timeouts,
    })
}

/// The initiator's counters (all zero over NBD and NVMe/TCP).
fn brp_stats(t: &Target) -> fastsan_initiator::InitiatorStats {
    match t {
        Target::Brp(v) => v.stats(),
        Target::Nbd(_) | Target::Nvme(_) | Target::Mirror(_) => Default::default(),
    }
}

/// A live line on stderr, once a second: the phase, IOPS and bandwidth of
/// the last second, and the time left. indicatif draws it, and draws
/// nothing when stderr is not a terminal.
fn spawn_progress(
    on: bool,
    tallies: Vec<Arc<Mutex<Tally>>>,
    bs: u32,
    from: Instant,
    end: Instant,
) -> Option<(ProgressBar, tokio::task::JoinHandle<()>)> {
    let line = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
        .with_style(ProgressStyle::with_template("  {msg}").expect("valid template"));
    if !on || line.is_hidden() {
        return None;
    }
    let task = tokio::spawn({
        let line = line.clone();
        async move {
            let mut last = 0u64;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let n: u64 = tallies
                    .iter()
                    .map(|t| {
                        let t = t.lock();
                        t.reads + t.writes
                    })
                    .sum();
                let now = Instant::now();
                let phase = if now < from { "warm-up" } else { "measuring" };
                let left = end.saturating_duration_since(now).as_secs();
                let rate = HumanBytes((n - last) * bs as u64);
                line.set_message(format!(
                    "{phase}: {:>9} IOPS {:>12}/s  {left}s left",
                    n - last,
                    rate.to_string()
                ));
                last = n;
            }
        }
    });
    Some((line, task))
}

impl Report {
    /// A human-readable summary, fio-style.
    pub fn human(&self) -> String {
        let mut s = format!(
            "{} {} bs={} iodepth={} jobs={} ({} requesters, {} connection{}{})\n",
            self.url,
            // As fio and --rw name it.
            format!("{:?}", self.rw).to_lowercase(),
            self.bs,
            self.iodepth,
            self.jobs,
            self.requesters,
            self.connections,
            if self.connections == 1 { "" } else { "s" },
            if BrpUrl::has_scheme(&self.url) { format!(", merge {}", self.merge) } else { String::new() }
        );
        s += &format!(
            "  IOPS {:.0}  bandwidth {:.1} MiB/s  ({} reads, {} writes in {:.1} s)\n",
            self.iops, self.mib_s, self.reads, self.writes, self.runtime_s
        );
        s += &format!(
            "  latency us: mean {:.1}  p50 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}\n",
            self.lat_mean_us, self.lat_p50_us, self.lat_p99_us, self.lat_p999_us, self.lat_max_us
        );
        if self.flushes > 0 {
            s += &format!("  flushes {}  latency us: mean {:.1}\n", self.flushes, self.flush_lat_mean_us);
        }
        s += &format!(
            "  client CPU {:.0}% of a core, {:.2} us per I/O, {} thread{}\n",
            self.client_cpu_pct,
            self.client_cpu_us_per_io,
            self.client_threads,
            if self.client_threads == 1 { "" } else { "s" }
        );
        if self.frames > 0 {
            let avg = if self.batches > 0 { self.batched_requests as f64 / self.batches as f64 } else { 0.0 };
            s += &format!(
                "  frames {}  BATCH frames {} carrying {} requests (avg {:.1} per BATCH)\n",
                self.frames, self.batches, self.batched_requests, avg
            );
        }
        if self.retries + self.reconnects + self.timeouts > 0 {
            s += &format!(
                "  connections lost and re-established {}  requests retried {}  request timeouts {}\n",
                self.reconnects, self.retries, self.timeouts
            );
        }
        if self.errors > 0 || self.verify_mismatches > 0 {
            s += &format!("  ERRORS {}  verify mismatches {}\n", self.errors, self.verify_mismatches);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str) -> JobSpec {
        JobSpec {
            url: url.into(),
            rw: Rw::RandRead,
            bs: 4096,
            iodepth: 1,
            jobs: 1,
            runtime: Duration::from_millis(100),
            ramp: Duration::ZERO,
            size: None,
            rwmixread: 50,
            verify: false,
            fua: false,
            fsync: 0,
            brp: Options {
                connections: 1,
                merge: fastsan_initiator::MergeMode::Adaptive,
                ..Default::default()
            },
            progress: false,
        }
    }

    #[tokio::test]
    async fn a_refused_connection_keeps_its_cause() {
        // Port 1 on loopback: nothing listens, the kernel refuses at once.
        let e = run(spec("brp://127.0.0.1:1/v")).await.unwrap_err();
        let BenchError::Open {
            source: ClientError::Client(fastsan_initiator::Error::Connect { .. }), ..
        } = &e
        else {
            panic!("{e:?}")
        };
        let text = Chain(&e).to_string();
        assert!(
            text.starts_with("cannot open brp://127.0.0.1:1/v: cannot connect to 127.0.0.1:1: "),
            "{text}"
        );
        let e = run(spec("nbd://127.0.0.1:1/v")).await.unwrap_err();
        assert!(
            matches!(&e, BenchError::Open { source: ClientError::Client(fastsan_initiator::Error::Connect { source, .. }), .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
        let e = run(spec("nvme+tcp://127.0.0.1:1/nqn.2024-01.io.fastsan:v")).await.unwrap_err();
        assert!(
            matches!(&e, BenchError::Open { source: ClientError::Client(fastsan_initiator::Error::Connect { source, .. }), .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
        let text = Chain(&e).to_string();
        assert!(
            text.starts_with(
                "cannot open nvme+tcp://127.0.0.1:1/nqn.2024-01.io.fastsan:v: cannot connect to 127.0.0.1:1: "
            ),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_unknown_scheme_lists_the_known_ones() {
        let e = run(spec("iscsi://h/v")).await.unwrap_err();
        assert!(e.to_string().contains("nvme+tcp://..."), "{e}");
        let e = run(spec("nvme+tcp://h")).await.unwrap_err();
        assert!(Chain(&e).to_string().contains("subsystem NQN: missing"), "{}", Chain(&e));
    }
}
