//! `fastsan top`: a live view of a target, from its `--metrics` endpoint.

use anyhow::{bail, Context};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Paragraph, Row, Table};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Watch a target: volumes with IOPS, bandwidth and device latency,
/// protocols with requests, connections, merging, request latency at the
/// target and errors, refreshed every second.
///
/// Reads the Prometheus text the target serves with `fastsan serve
/// --metrics ADDR`. Keys: q or Esc quits. Without a terminal, prints the
/// same tables as text at every refresh.
/// Example:
///   fastsan serve --metrics 127.0.0.1:9810 &
///   fastsan top http://127.0.0.1:9810/metrics
#[derive(clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The target's metrics: http://HOST:PORT/metrics (or HOST:PORT).
    #[arg(default_value = "http://127.0.0.1:9810/metrics", value_name = "METRICS_URL")]
    url: String,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    interval: f64,
}

/// One sample of the exposition: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Parses Prometheus text: `name{k="v",...} value` lines; comments skipped.
fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let (name, labels) = match series.split_once('{') {
            None => (series, Vec::new()),
            Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'))),
        };
        out.push(Sample { name: name.to_owned(), labels, value });
    }
    out
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| if c == 'n' { '\n' } else { c })),
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.push((key.trim_start_matches(',').trim().to_owned(), value));
        rest = &after[end..];
    }
    labels
}

/// What one scrape says, keyed for the view.
#[derive(Default, Clone)]
struct Snapshot {
    at: Option<Instant>,
    /// volume -> (ops, read bytes, written bytes, size, latency buckets (le -> cumulative))
    volumes: BTreeMap<String, Volume>,
    protocols: BTreeMap<String, Protocol>,
}

#[derive(Default, Clone)]
struct Volume {
    ops: f64,
    read: f64,
    written: f64,
    size: f64,
    latency: Vec<(f64, f64)>,
    /// A flush of it failed: it fails every request until the target restarts.
    failed: bool,
}

#[derive(Default, Clone)]
struct Protocol {
    requests: f64,
    open: f64,
    in_flight: f64,
    batches: f64,
    batched: f64,
    errors: f64,
    auth_failures: f64,
    latency: Vec<(f64, f64)>,
}

impl Snapshot {
    fn from_text(text: &str) -> Snapshot {
        let mut s = Snapshot { at: Some(Instant::now()), ..Default::default() };
        for m in parse(text) {
            if let Some(v) = m.label("volume") {
                let vol = s.volumes.entry(v.to_owned()).or_default();
                match (m.name.as_str(), m.label("op"), m.label("direction")) {
                    ("fastsan_volume_ops_total", Some("read" | "write"), _) => vol.ops += m.value,
                    ("fastsan_volume_bytes_total", _, Some("read")) => vol.read = m.value,
                    ("fastsan_volume_bytes_total", _, Some("write")) => vol.written = m.value,
                    ("fastsan_volume_size_bytes", _, _) => vol.size = m.value,
                    ("fastsan_volume_failed", _, _) => vol.failed = m.value > 0.0,
                    ("fastsan_volume_latency_seconds_bucket", _, _) => {
                        let le = m.label("le").and_then(|l| l.parse().ok()).unwrap_or(f64::INFINITY);
                        vol.latency.push((le, m.value));
                    }
                    _ => {}
                }
            } else if let Some(p) = m.label("protocol") {
                let proto = s.protocols.entry(p.to_owned()).or_default();
                match m.name.as_str() {
                    "fastsan_requests_total" => proto.requests = m.value,
                    "fastsan_open_connections" => proto.open = m.value,
                    "fastsan_in_flight_requests" => proto.in_flight = m.value,
                    "fastsan_batches_total" => proto.batches = m.value,
                    "fastsan_batched_requests_total" => proto.batched = m.value,
                    "fastsan_request_errors_total" => proto.errors += m.value,
                    "fastsan_auth_failures_total" => proto.auth_failures = m.value,
                    "fastsan_request_latency_seconds_bucket" => {
                        let le = m.label("le").and_then(|l| l.parse().ok()).unwrap_or(f64::INFINITY);
                        proto.latency.push((le, m.value));
                    }
                    _ => {}
                }
            }
        }
        s
    }
}

/// The upper bound (seconds) below which `q` of the calls between two
/// histograms fell; `None` without calls.
fn quantile(now: &[(f64, f64)], before: &[(f64, f64)], q: f64) -> Option<f64> {
    // By bound, not by a search per bucket: a hostile endpoint's million
    // buckets cost a million steps, not a million squared.
    let before: std::collections::HashMap<u64, f64> = before.iter().map(|b| (b.0.to_bits(), b.1)).collect();
    let delta: Vec<(f64, f64)> =
        now.iter().map(|&(le, c)| (le, c - before.get(&le.to_bits()).copied().unwrap_or(0.0))).collect();
    let total = delta.iter().map(|d| d.1).fold(0.0, f64::max);
    if total <= 0.0 {
        return None;
    }
    delta.iter().find(|d| d.1 >= total * q).map(|d| d.0)
}

fn rate(now: f64, before: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        (now - before).max(0.0) / secs
    } else {
        0.0
    }
}

fn micros(s: Option<f64>) -> String {
    match s {
        None => "-".into(),
        Some(s) if s.is_infinite() => "inf".into(),
        Some(s) => format!("{:.1}", s * 1e6),
    }
}

/// The two tables: headers and rows, as text.
type Tables = [(Vec<&'static str>, Vec<Vec<String>>); 2];

fn tables(now: &Snapshot, before: &Snapshot) -> Tables {
    let secs = match (now.at, before.at) {
        (Some(a), Some(b)) => a.duration_since(b).as_secs_f64(),
        _ => 0.0,
    };
    let mib = 1024.0 * 1024.0;
    let vols = now
        .volumes
        .iter()
        .map(|(name, v)| {
            let b = before.volumes.get(name).cloned().unwrap_or_default();
            vec![
                if v.failed { format!("{name} FAILED") } else { name.clone() },
                format!("{:.0}", rate(v.ops, b.ops, secs)),
                format!("{:.1}", rate(v.read, b.read, secs) / mib),
                format!("{:.1}", rate(v.written, b.written, secs) / mib),
                micros(quantile(&v.latency, &b.latency, 0.5)),
                micros(quantile(&v.latency, &b.latency, 0.99)),
                format!("{:.0}", v.size / mib),
            ]
        })
        .collect();
    let protos = now
        .protocols
        .iter()
        .map(|(name, p)| {
            let b = before.protocols.get(name).cloned().unwrap_or_default();
            let (batches, batched) = (p.batches - b.batches, p.batched - b.batched);
            let req = p.requests - b.requests;
            // A counter that went down: the target restarted between the scrapes.
            let restarted = req < 0.0 || batches < 0.0 || batched < 0.0;
            // Requests per frame: each BATCH carries `batched`; the rest came one a frame.
            let frames = batches + (req - batched).max(0.0);
            vec![
                name.to_uppercase(),
                format!("{:.0}", rate(p.requests, b.requests, secs)),
                format!("{:.0}", p.open),
                format!("{:.0}", p.in_flight),
                if frames > 0.0 && !restarted { format!("{:.2}", req / frames) } else { "-".into() },
                micros(quantile(&p.latency, &b.latency, 0.5)),
                micros(quantile(&p.latency, &b.latency, 0.99)),
                format!("{:.0}", rate(p.errors, b.errors, secs)),
                format!("{:.0}", p.auth_failures),
            ]
        })
        .collect();
    [
        (vec!["VOLUME", "IOPS", "READ MiB/s", "WRITE MiB/s", "DEV p50 us", "DEV p99 us", "SIZE MiB"], vols),
        (
            vec![
                "PROTOCOL",
                "REQ/s",
                "CONNS",
                "IN FLIGHT",
                "REQ/FRAME",
                "p50 us",
                "p99 us",
                "ERR/s",
                "AUTH FAIL",
            ],
            protos,
        ),
    ]
}

/// `http://HOST:PORT/PATH` or `HOST:PORT` -> (authority, path).
fn split_url(url: &str) -> anyhow::Result<(String, String)> {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    if url.starts_with("https://") {
        bail!("{url}: only http:// (the target serves metrics in plaintext)");
    }
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/metrics".to_owned()),
    };
    if authority.is_empty() {
        bail!("{url}: no host");
    }
    Ok((authority.to_owned(), path))
}

/// The most an answer may hold: a target with a thousand volumes says
/// about 5 MiB.
const MAX_ANSWER: usize = 16 << 20;

/// One GET, bounded: the body of a 200, whole within 5 s (a server that
/// trickles a byte now and then is cut off at 5 s all the same).
fn fetch(authority: &str, path: &str) -> anyhow::Result<String> {
    use std::net::ToSocketAddrs;
    let addr = authority.to_socket_addrs()?.next().context("no address")?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut all = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        anyhow::ensure!(!left.is_zero(), "no whole answer from {authority} within 5 s");
        s.set_read_timeout(Some(left))?;
        let n = match s.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // A read timeout reads as EAGAIN ("Resource temporarily unavailable").
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                bail!("no whole answer from {authority} within 5 s")
            }
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            break;
        }
        anyhow::ensure!(
            all.len() + n <= MAX_ANSWER,
            "the answer of {authority} is over {} MiB",
            MAX_ANSWER >> 20
        );
        all.extend_from_slice(&chunk[..n]);
    }
    let all = String::from_utf8_lossy(&all);
    let (head, body) = all.split_once("\r\n\r\n").context("no HTTP answer")?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{status}");
    }
    Ok(body.to_owned())
}

pub fn run(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.interval >= 0.1 && a.interval <= 3600.0, "--interval must be 0.1..=3600 seconds");
    let (authority, path) = split_url(&a.url)?;
    let every = Duration::from_secs_f64(a.interval);
    let scrape = || fetch(&authority, &path).map(|t| Snapshot::from_text(&t));
    // A first scrape before the screen changes: a wrong URL is a plain error.
    let first = scrape().with_context(|| {
        format!("reading {} (is a target serving its metrics there? `fastsan serve --metrics ADDR`)", a.url)
    })?;
    if !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        return plain(first, every, &scrape);
    }
    let mut terminal = ratatui::init();
    let result = live(&mut terminal, first, every, &a.url, &scrape);
    ratatui::restore();
    result
}

/// Without a terminal: the tables as text, every interval, until the
/// reader goes away (a closed pipe ends it quietly).
fn plain(
    mut before: Snapshot,
    every: Duration,
    scrape: &dyn Fn() -> anyhow::Result<Snapshot>,
) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    loop {
        std::thread::sleep(every);
        let now = match scrape() {
            Ok(s) => s,
            Err(e) => {
                // On stderr: stdout holds the tables a script reads.
                let _ = writeln!(std::io::stderr(), "fastsan top: scrape failed: {e:#}");
                continue;
            }
        };
        let mut text = String::new();
        for (head, rows) in tables(&now, &before) {
            text += &head.join("\t");
            text.push('\n');
            for r in rows {
                text += &r.join("\t");
                text.push('\n');
            }
        }
        if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
            return Ok(());
        }
        before = now;
    }
}

fn live(
    terminal: &mut ratatui::DefaultTerminal,
    first: Snapshot,
    every: Duration,
    url: &str,
    scrape: &dyn Fn() -> anyhow::Result<Snapshot>,
) -> anyhow::Result<()> {
    let (mut before, mut now) = (first.clone(), first);
    let mut error: Option<String> = None;
    let mut next = Instant::now() + every;
    loop {
        let [vols, protos] = tables(&now, &before);
        terminal.draw(|f| {
            let [top, mid, bottom] =
                Layout::vertical([Constraint::Length(2), Constraint::Min(4), Constraint::Length(6)])
                    .areas(f.area());
            let status = match &error {
                Some(e) => format!("fastsan top - {url} - scrape failed: {e}   (q quits)"),
                None => format!("fastsan top - {url} - every {:.1} s   (q quits)", every.as_secs_f64()),
            };
            f.render_widget(Paragraph::new(status), top);
            let table = |(head, rows): (Vec<&'static str>, Vec<Vec<String>>), title: &'static str| {
                let mut widths = vec![Constraint::Length(12); head.len()];
                // The first column as wide as its longest cell (a volume's
                // name, and "FAILED" after it), within reason.
                let first = rows.iter().filter_map(|r| r.first()).map(|c| c.chars().count()).max();
                if let (Some(w), Some(n)) = (widths.first_mut(), first) {
                    *w = Constraint::Length((n as u16).saturating_add(1).clamp(12, 48));
                }
                Table::new(rows.into_iter().map(Row::new), widths)
                    .header(Row::new(head).style(Style::default().add_modifier(Modifier::BOLD)))
                    .block(Block::bordered().title(title))
            };
            f.render_widget(table(vols, "volumes"), mid);
            f.render_widget(table(protos, "protocols"), bottom);
        })?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                let ctrl_c = k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if k.kind == KeyEventKind::Press
                    && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                {
                    return Ok(());
                }
            }
            continue;
        }
        next = Instant::now() + every;
        match scrape() {
            Ok(s) => {
                before = std::mem::replace(&mut now, s);
                error = None;
            }
            Err(e) => error = Some(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x\nfastsan_volume_ops_total{volume=\"v\",op=\"read\"} 100\n\
        fastsan_volume_ops_total{volume=\"v\",op=\"write\"} 50\n\
        fastsan_volume_latency_seconds_bucket{le=\"0.000001\",volume=\"v\"} 10\n\
        fastsan_volume_latency_seconds_bucket{le=\"0.000002\",volume=\"v\"} 100\n\
        fastsan_volume_latency_seconds_bucket{le=\"+Inf\",volume=\"v\"} 100\n\
        fastsan_volume_failed{volume=\"v\"} 0\nfastsan_volume_failed{volume=\"w\"} 1\n\
        fastsan_requests_total{protocol=\"brp\"} 1000\nfastsan_batches_total{protocol=\"brp\"} 10\n\
        fastsan_batched_requests_total{protocol=\"brp\"} 500\n";

    #[test]
    fn parses_samples_with_labels() {
        let s = parse("a 1\nb{x=\"q\\\"uote\",y=\"2\"} 3.5\n# c 4\nbad\n");
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].label("x"), Some("q\"uote"));
        assert_eq!((s[1].label("y"), s[1].value), (Some("2"), 3.5));
    }

    #[test]
    fn rates_quantiles_and_merge_ratio_between_two_scrapes() {
        let before = Snapshot { at: Some(Instant::now() - Duration::from_secs(2)), ..Default::default() };
        let now = Snapshot::from_text(TEXT);
        let [vols, protos] = tables(&now, &before);
        let v = &vols.1[0];
        assert_eq!((v[0].as_str(), v[1].as_str()), ("v", "75"), "150 ops in 2 s");
        assert_eq!((v[4].as_str(), v[5].as_str()), ("2.0", "2.0"), "p50 and p99 in the 2 us bucket");
        assert_eq!(vols.1[1][0], "w FAILED", "a volume whose flush failed says so");
        // 1000 requests: 500 in 10 BATCHes, 500 alone: 510 frames.
        assert_eq!(protos.1[0][4], format!("{:.2}", 1000.0 / 510.0));
        assert!(split_url("https://x/metrics").is_err());
        assert_eq!(split_url("h:1").unwrap(), ("h:1".to_owned(), "/metrics".to_owned()));
    }
}
