//! `--metrics ADDR`: the target's counters as Prometheus text at `/metrics`.
//!
//! Everything is read at scrape time from the counters the target keeps
//! anyway ([`crate::stats::Stats`] per protocol, the stats layer of each
//! volume), through a prometheus-client [`Collector`]: nothing is counted
//! twice on the I/O path.
//!
//! The HTTP side is a few lines over tokio, on purpose: one `GET /metrics`
//! per connection, a request head of at most 8 KiB read within 5 s, the
//! answer, and a close. A general HTTP server would bring more code than
//! the endpoint has.

use crate::backend::LATENCY_SAMPLE;
use crate::gate::{Gate, Ticket};
use crate::request::Refusal;
use crate::server::ServerHandle;
use crate::stats::StatsSnapshot;
use fastsan_initiator::metrics::escape;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::io;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

/// Reads a running target's counters for Prometheus.
#[derive(Clone)]
pub struct TargetCollector {
    pub server: ServerHandle,
}

impl std::fmt::Debug for TargetCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TargetCollector")
    }
}

/// One metric with one sample per label set.
fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Vec<(&'static str, String)>, M)>,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in samples {
        value.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A histogram metric from power-of-two nanosecond buckets (bucket `i`:
/// `[2^i, 2^(i+1))` ns); the last bucket takes everything above, so it is +Inf.
fn histogram(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = ([(&'static str, String); 1], [u64; 40])>,
) -> Result<(), std::fmt::Error> {
    let mut h = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, counts) in series {
        let last = counts.len() - 1;
        let bound = |i: usize| if i == last { f64::MAX } else { (1u64 << (i + 1)) as f64 / 1e9 };
        let buckets: Vec<(f64, u64)> = counts.iter().enumerate().map(|(i, &c)| (bound(i), c)).collect();
        let count: u64 = counts.iter().sum();
        // Each bucket's midpoint stands for its calls (the exact sum is not kept).
        let sum: f64 =
            counts.iter().enumerate().map(|(i, &c)| c as f64 * 1.5 * (1u64 << i) as f64 / 1e9).sum();
        h.encode_family(&labels)?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(sum, count, &buckets, None)?;
    }
    Ok(())
}

/// A metric read from the per-protocol counters: name, help, how.
type Series = (&'static str, &'static str, fn(&StatsSnapshot) -> u64);

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(v.min(i64::MAX as u64) as i64)
}

impl Collector for TargetCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let protos = self.server.protocol_stats();
        let per = |f: fn(&StatsSnapshot) -> u64| {
            protos.iter().map(move |(p, s)| (vec![("protocol", p.to_string())], f(s))).collect::<Vec<_>>()
        };
        let counters: [Series; 12] = [
            ("fastsan_requests", "Requests received (a BATCH's sub-requests each count)", |s| s.requests),
            ("fastsan_read_bytes", "Bytes read from volumes for clients", |s| s.bytes_read),
            ("fastsan_written_bytes", "Bytes written to volumes by clients", |s| s.bytes_written),
            ("fastsan_connections", "Connections accepted", |s| s.connections),
            ("fastsan_batches", "BATCH frames received (merged requests)", |s| s.batches),
            ("fastsan_batched_requests", "Requests that arrived inside BATCH frames", |s| s.batched_requests),
            ("fastsan_protocol_errors", "Connections closed for a malformed frame or handshake", |s| {
                s.protocol_errors
            }),
            (
                "fastsan_stalled_connections",
                "Connections dropped for stalling: replies unread, or a request's data stopped, for the stall timeout",
                |s| s.stalled,
            ),
            ("fastsan_auth_failures", "Failed authentications (wrong secret, refused certificate)", |s| {
                s.auth_failures
            }),
            (
                "fastsan_polled_requests",
                "Requests caught by busy polling (a connection at QD1 spinning)",
                |s| s.polled,
            ),
            (
                "fastsan_coalesced_requests",
                "Requests whose replies were held for the next ones and sent with them",
                |s| s.coalesced,
            ),
            ("fastsan_coalesce_rounds", "Rounds a connection held its replies for more requests", |s| {
                s.coalesce_rounds
            }),
        ];
        for (name, help, f) in counters {
            let samples = per(f).into_iter().map(|(l, v)| (l, counter(v)));
            family(&mut enc, name, help, MetricType::Counter, samples)?;
        }
        let refused = per(|s| s.refused).into_iter().map(|(l, v)| (l, counter(v)));
        let help =
            "Connections refused: busy, an address over its failed-authentication budget, access rules";
        family(&mut enc, "fastsan_refused_connections", help, MetricType::Counter, refused)?;
        let errors = protos.iter().flat_map(|(p, s)| {
            Refusal::KINDS.iter().enumerate().map(move |(i, kind)| {
                (vec![("protocol", p.to_string()), ("kind", kind.to_string())], counter(s.errors_by_kind[i]))
            })
        });
        family(
            &mut enc,
            "fastsan_request_errors",
            "Requests refused or failed, by kind",
            MetricType::Counter,
            errors,
        )?;
        let gauges: [Series; 2] = [
            ("fastsan_open_connections", "Connections in their transmission phase", |s| s.open_connections),
            ("fastsan_in_flight_requests", "Requests received and not yet answered", |s| s.in_flight),
        ];
        for (name, help, f) in gauges {
            family(&mut enc, name, help, MetricType::Gauge, per(f).into_iter().map(|(l, v)| (l, gauge(v))))?;
        }
        let budget = [(vec![], gauge(self.server.payload_in_flight()))];
        family(
            &mut enc,
            "fastsan_payload_in_flight_bytes",
            "Request and reply payload held",
            MetricType::Gauge,
            budget,
        )?;

        // Per volume, from each volume's stats layer.
        let vols: Vec<_> = self
            .server
            .catalog()
            .iter()
            .map(|v| (escape(v.name()), v.stats(), v.size(), v.failed()))
            .collect();
        let ops = vols.iter().flat_map(|(name, s, ..)| {
            [
                ("read", s.reads),
                ("write", s.writes),
                ("flush", s.flushes),
                ("trim", s.trims),
                ("write_zeroes", s.zeroes),
            ]
            .map(|(op, n)| (vec![("volume", name.clone()), ("op", op.to_owned())], counter(n)))
        });
        family(&mut enc, "fastsan_volume_ops", "Device operations by kind", MetricType::Counter, ops)?;
        let bytes = vols.iter().flat_map(|(name, s, ..)| {
            [("read", s.bytes_read), ("write", s.bytes_written)]
                .map(|(d, n)| (vec![("volume", name.clone()), ("direction", d.to_owned())], counter(n)))
        });
        family(&mut enc, "fastsan_volume_bytes", "Bytes moved by the device", MetricType::Counter, bytes)?;
        let errs = vols.iter().map(|(name, s, ..)| (vec![("volume", name.clone())], counter(s.errors)));
        family(
            &mut enc,
            "fastsan_volume_errors",
            "Device operations that failed",
            MetricType::Counter,
            errs,
        )?;
        let size = vols.iter().map(|(name, _, size, _)| (vec![("volume", name.clone())], gauge(*size)));
        family(&mut enc, "fastsan_volume_size_bytes", "Volume size", MetricType::Gauge, size)?;
        let failed =
            vols.iter().map(|(name, .., failed)| (vec![("volume", name.clone())], gauge(*failed as u64)));
        family(
            &mut enc,
            "fastsan_volume_failed",
            "1 once a flush of the volume failed: it fails every request until the target reopens it",
            MetricType::Gauge,
            failed,
        )?;
        // Latencies: sampled, in power-of-two buckets of nanoseconds, as the
        // stats layer and the pipeline keep them.
        let help = format!(
            "Time from a request's credit to its reply written: queueing, device and reply; one request \
             in {LATENCY_SAMPLE} sampled; the sum is estimated from bucket midpoints"
        );
        let series = protos.iter().map(|(p, s)| ([("protocol", p.to_string())], s.latency_ns));
        histogram(&mut enc, "fastsan_request_latency_seconds", &help, series)?;
        let help = format!(
            "Device latency of every kind of operation, one call in {LATENCY_SAMPLE} of each kind sampled; \
             the sum is estimated from bucket midpoints"
        );
        let series = vols.iter().map(|(name, s, ..)| ([("volume", name.clone())], s.latency_ns));
        histogram(&mut enc, "fastsan_volume_latency_seconds", &help, series)?;
        Ok(())
    }
}

/// The Prometheus text of `collector` now.
pub fn render(collector: &TargetCollector) -> String {
    fastsan_initiator::metrics::render(collector)
}

/// Metrics requests served at once.
const MAX_SCRAPES: usize = 32;
/// Of them, from one address: silent connections from one host cannot
/// take every place from the scraper.
const MAX_SCRAPES_PER_ADDR: usize = 4;
/// How long a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection waits for its request head before a newcomer
/// without a place may close it (a scraper's head comes within a round
/// trip): a local process renewing silent connections cannot keep the
/// scraper on its own address out.
const EVICTABLE_AFTER: Duration = Duration::from_millis(250);

/// What `/metrics` answers: the text of the moment.
pub type Render = std::sync::Arc<dyn Fn() -> String + Send + Sync>;

/// Serves `/metrics` on `listener` until `shutdown`: the target's own, and
/// any other process's (`fastsan attach --metrics` serves its session's).
pub async fn serve(listener: TcpListener, render: Render, shutdown: tokio_util::sync::CancellationToken) {
    // A bounded number of scrapes at once: silent connections cannot eat
    // the process's file descriptors (the volumes' listeners need them).
    let gate = std::sync::Arc::new(Gate::new(MAX_SCRAPES, MAX_SCRAPES_PER_ADDR, EVICTABLE_AFTER));
    info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "metrics at /metrics");
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(ticket) = gate.enter(Some(peer.ip())) else {
            debug!(%peer, "metrics: every place taken ({MAX_SCRAPES}, {MAX_SCRAPES_PER_ADDR} per address), none silent for long; closed");
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            if let Err(e) = tokio::time::timeout(Duration::from_secs(5), answer(stream, &ticket, &*render))
                .await
                .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "no answer within 5 s")))
            {
                debug!(%peer, "metrics request: {e}");
            }
        });
    }
}

/// Reads one request head (within [`HEAD_TIMEOUT`], unless the gate closes
/// the connection for a newcomer first) and answers it.
async fn answer(
    mut s: TcpStream,
    ticket: &Ticket,
    render: &(dyn Fn() -> String + Send + Sync),
) -> io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let read_head = async {
        // Only the bytes that could finish the head are searched again.
        let ended = |h: &[u8], from: usize| {
            let tail = &h[from.saturating_sub(3)..];
            tail.windows(4).any(|w| w == b"\r\n\r\n") || tail.windows(2).any(|w| w == b"\n\n")
        };
        let mut from = 0;
        while !ended(&head, from) {
            if head.len() >= 8192 {
                return Ok(false);
            }
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before its request"));
            }
            from = head.len();
            head.extend_from_slice(&chunk[..n]);
        }
        Ok(true)
    };
    let head_read = tokio::select! {
        r = tokio::time::timeout(HEAD_TIMEOUT, read_head) => r,
        _ = ticket.closed().cancelled() => {
            return Err(io::Error::other("closed for a newcomer: no request head yet"));
        }
    };
    let whole = match head_read {
        Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "no request within 2 s")),
        Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
        Ok(r) => r?,
    };
    if !ticket.settle() {
        return Err(io::Error::other("closed for a newcomer as its request head came in"));
    }
    if !whole {
        return respond(
            &mut s,
            "431 Request Header Fields Too Large",
            "text/plain",
            "request head too large\n",
        )
        .await;
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => {
            respond(&mut s, "200 OK", "text/plain; version=0.0.4; charset=utf-8", &render()).await
        }
        ("GET", _) => respond(&mut s, "404 Not Found", "text/plain", "metrics are at /metrics\n").await,
        _ => respond(&mut s, "405 Method Not Allowed", "text/plain", "GET only\n").await,
    }
}

async fn respond(s: &mut TcpStream, status: &str, kind: &str, body: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    s.shutdown().await?;
    // A lingering close: what the client still sends (a head cut short) is
    // read and dropped, briefly, so the close does not reset the answer away.
    let mut sink = [0u8; 4096];
    let linger = async {
        let mut left = 64 * 1024;
        while left > 0 {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n.min(left),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), linger).await;
    Ok(())
}
