//! `fastsan bench`: a fio-like load generator for BRP volumes, NBD servers
//! and NVMe/TCP controllers.

use crate::ClientArgs;
use fastsan_target::config::parse_size;
use std::time::Duration;

/// Measure a BRP volume, any NBD server or any NVMe/TCP controller with
/// fio-like jobs.
///
/// Reports IOPS, bandwidth, latency (mean, p50, p99, p99.9 from an HDR
/// histogram), client CPU and, over BRP, how many requests travelled in
/// BATCH frames. Over BRP it behaves as a block device: a request whose
/// connection is lost is retried (after the target's fence) and fails only
/// when no connection comes back within --reconnect-timeout; the report says
/// how many retries and reconnections it saw.
///
/// Examples:
///   fastsan bench brp://127.0.0.1:10810/vol0 --rw randread --bs 4k --iodepth 32 --jobs 4
///   fastsan bench nbd://127.0.0.1:10809/vol0 --rw randwrite --iodepth 32 --json
///   fastsan bench nvme+tcp://127.0.0.1:4420/nqn.2026-11.io.fastsan:HOSTNAME --iodepth 32 --jobs 2
///   fastsan bench brp://127.0.0.1:10810/vol0 --rw randwrite --iodepth 128 --merge off
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// brp://HOST:PORT/VOLUME, brp+unix:///VOLUME?socket=PATH, nbd://HOST:PORT/EXPORT,
    /// nvme+tcp://HOST[:PORT]/SUBSYSTEM_NQN[/NSID][?hdgst=1&ddgst=1] or mirror:LEG,LEG,log=PATH
    url: String,
    /// Access pattern, as fio names it.
    #[arg(long, default_value = "randread", value_name = "PATTERN")]
    rw: fastsan_bench::Rw,
    /// Block size.
    #[arg(long, default_value = "4k", value_name = "SIZE")]
    bs: String,
    /// Requests in flight per job.
    #[arg(long, default_value_t = 1, value_name = "N")]
    iodepth: usize,
    /// Jobs (over NBD, one connection each; over NVMe/TCP, one I/O queue each).
    #[arg(long, default_value_t = 1, value_name = "N")]
    jobs: usize,
    /// Client threads [default: one per job, at most one per CPU]. As in
    /// fio, a job's requests are issued from one thread; a second thread
    /// for one job mostly wakes tasks across cores (on a 2-core machine,
    /// 4K QD32 on one job ran 10-30% slower with two).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
    /// Seconds to measure.
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    runtime: f64,
    /// Seconds of warm-up before measuring.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    ramp: f64,
    /// Bytes of the volume to use [default: all].
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,
    /// Percentage of reads for randrw [default: 50].
    #[arg(long, value_name = "PCT")]
    rwmixread: Option<u8>,
    /// Write offset-dependent data and check every read of a block written in this run.
    #[arg(long)]
    verify: bool,
    /// Writes with FUA: each is durable when acknowledged (as a database's
    /// O_DSYNC writes reach the device).
    #[arg(long)]
    fua: bool,
    /// A FLUSH after every N writes of each job, as fio's fsync=N; the
    /// report gives their count and mean latency.
    #[arg(long, value_name = "N", default_value_t = 0)]
    fsync: u32,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    client: ClientArgs,
}

impl Args {
    /// The client's threads: `--threads`, or one per job up to the CPUs.
    pub fn threads(&self) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.threads.map_or(self.jobs.clamp(1, cpus), usize::from)
    }
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let secs = |s: f64, what: &str| {
        anyhow::ensure!(
            s.is_finite() && (0.0..=86400.0).contains(&s),
            "--{what} must be between 0 and 86400 seconds"
        );
        Ok(Duration::from_secs_f64(s))
    };
    // BRP's session options say nothing to NBD or NVMe/TCP (but NVMe/TCP
    // takes --digests): refused, not ignored.
    let brp = fastsan_initiator::BrpUrl::has_scheme(&a.url) || a.url.starts_with("mirror:");
    let brp_only = [
        (a.client.connections != 2, "--connections"),
        (a.client.merge != fastsan_initiator::MergeMode::Adaptive, "--merge"),
        (a.client.digests && !a.url.starts_with("nvme+tcp://"), "--digests"),
    ];
    if let Some((_, flag)) = brp_only.iter().find(|(given, _)| *given && !brp) {
        anyhow::bail!(
            "{flag} does not apply to {}: over NBD and NVMe/TCP each job is its own connection or \
             queue (--jobs)",
            a.url.split("://").next().unwrap_or("this URL"),
        );
    }
    anyhow::ensure!(
        a.rwmixread.is_none() || a.rw == fastsan_bench::Rw::RandRw,
        "--rwmixread mixes the reads and writes of --rw randrw; this job does not mix them"
    );
    let bs = parse_size(&a.bs)?;
    anyhow::ensure!(bs <= u32::MAX as u64, "--bs too large");
    let spec = fastsan_bench::JobSpec {
        url: a.url,
        rw: a.rw,
        bs: bs as u32,
        iodepth: a.iodepth,
        jobs: a.jobs,
        runtime: {
            let t = secs(a.runtime, "runtime")?;
            anyhow::ensure!(!t.is_zero(), "--runtime must be more than 0 seconds");
            // (A tenth of a second at least: shorter measures nothing but the start.)
            t.max(Duration::from_millis(100))
        },
        ramp: secs(a.ramp, "ramp")?,
        size: a.size.as_deref().map(parse_size).transpose()?,
        rwmixread: a.rwmixread.unwrap_or(50),
        verify: a.verify,
        fua: a.fua,
        fsync: a.fsync,
        brp: a.client.options()?,
        progress: !a.json,
    };
    let report = fastsan_bench::run(spec).await?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        out!("{}", report.human())?;
    }
    anyhow::ensure!(report.verify_mismatches == 0, "{} blocks read back wrong", report.verify_mismatches);
    anyhow::ensure!(report.errors == 0, "{} requests failed", report.errors);
    Ok(())
}
