//! `--metrics`: Prometheus text scraped while `fastsan bench` runs agrees
//! with the bench's own counts, per protocol; the endpoint refuses what it
//! should and keeps serving.

mod common;

use common::*;
use std::io::Read;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

fn json_u64(json: &str, key: &str) -> f64 {
    let at = json.find(&format!("\"{key}\": ")).unwrap_or_else(|| panic!("no {key} in {json}"));
    let rest = &json[at + key.len() + 4..];
    rest[..rest.find([',', '\n']).unwrap()].trim().parse().unwrap()
}

/// Runs `fastsan bench URL --json ...` while scraping; returns its report.
fn bench_while_scraping(metrics: &str, url: &str, extra: &[&str]) -> String {
    let child = Command::new(BIN)
        .args(["bench", url, "--rw", "randrw", "--runtime", "2", "--ramp", "0", "--json", "--size", "16M"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Mid-run: requests are moving and some are in flight or just answered.
    std::thread::sleep(Duration::from_millis(800));
    let mid = scrape(metrics);
    assert!(mid.contains("fastsan_in_flight_requests"), "{mid}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn metrics_agree_with_the_bench_within_one_percent() {
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--volume",
        "v=memory:64M",
        "--volume",
        "q\"x=memory:1M",
        "--metrics",
        "127.0.0.1:0",
    ]);
    let before = scrape(&s.metrics);
    let brp = |t: &str, name: &str| sample(t, &format!("{name}{{protocol=\"brp\"}}"));
    let nbd = |t: &str, name: &str| sample(t, &format!("{name}{{protocol=\"nbd\"}}"));
    assert_eq!(brp(&before, "fastsan_requests_total"), 0.0);

    // BRP, with merging on: requests and BATCHes as the bench counted them.
    let report = bench_while_scraping(&s.metrics, &s.url("v"), &["--iodepth", "16", "--merge", "always"]);
    let after = scrape(&s.metrics);
    let ios = json_u64(&report, "ios");
    let got = brp(&after, "fastsan_requests_total");
    assert!(ios > 1000.0, "{report}");
    assert!((got - ios).abs() <= ios * 0.01, "BRP requests: metrics {got}, bench {ios}");
    let batched = json_u64(&report, "batched_requests");
    let got = brp(&after, "fastsan_batched_requests_total");
    assert!(
        (got - batched).abs() <= batched * 0.01 + 1.0,
        "BATCHed requests: metrics {got}, bench {batched}"
    );
    let moved = (json_u64(&report, "reads") + json_u64(&report, "writes")) * 4096.0;
    let bytes = brp(&after, "fastsan_read_bytes_total") + brp(&after, "fastsan_written_bytes_total");
    assert!((bytes - moved).abs() <= moved * 0.01, "bytes: metrics {bytes}, bench {moved}");
    let vol = sample(&after, "fastsan_volume_ops_total{volume=\"v\",op=\"read\"}");
    assert!((vol - json_u64(&report, "reads")).abs() <= ios * 0.01, "volume reads {vol}");
    assert_eq!(brp(&after, "fastsan_in_flight_requests"), 0.0, "nothing in flight once the bench is done");
    // Request latency at the target: one request in 32 per thread sampled.
    let timed = brp(&after, "fastsan_request_latency_seconds_count");
    assert!(timed >= ios / 64.0 && timed <= ios / 16.0, "{timed} of {ios} requests timed");
    assert_eq!(nbd(&after, "fastsan_requests_total"), 0.0, "no NBD was used");

    // NBD: counted under its own label.
    let report = bench_while_scraping(&s.metrics, &s.nbd_url("v"), &["--iodepth", "8"]);
    let end = scrape(&s.metrics);
    let ios = json_u64(&report, "ios");
    let got = nbd(&end, "fastsan_requests_total");
    assert!((got - ios).abs() <= ios * 0.01, "NBD requests: metrics {got}, bench {ios}");
    assert_eq!(brp(&end, "fastsan_requests_total"), brp(&after, "fastsan_requests_total"));

    // Bad requests: answered, and the endpoint goes on.
    assert_eq!(http(&s.metrics, "GET /nope HTTP/1.1\r\n\r\n").0, "HTTP/1.1 404 Not Found");
    assert_eq!(http(&s.metrics, "POST /metrics HTTP/1.1\r\n\r\n").0, "HTTP/1.1 405 Method Not Allowed");
    let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(10_000));
    assert!(http(&s.metrics, &huge).0.contains("431"));
    let text = scrape(&s.metrics);
    assert!(text.contains("fastsan_volume_latency_seconds_bucket{le=\"+Inf\",volume=\"v\"}"), "{text}");
    // A quote in a volume's name is escaped (the text stays parseable).
    assert!(text.contains("fastsan_volume_size_bytes{volume=\"q\\\"x\"} 1048576"), "{text}");
}

/// Closed (EOF or reset) within `t`; a read timeout is not a close.
fn closed_within(c: &mut TcpStream, t: Duration) -> bool {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    c.set_read_timeout(Some(t)).unwrap();
    match c.read(&mut [0u8; 64]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), WouldBlock | TimedOut),
    }
}

/// Silent connections from one address hold at most four of the endpoint's
/// places, and only for the two seconds a request head may take: a scrape
/// from elsewhere is answered meanwhile. (Before, 32 silent connections
/// from one host held every place, 5 s at a time, and each scrape was
/// closed unanswered.)
#[test]
fn silent_connections_from_one_address_leave_the_scraper_its_place() {
    use socket2::{Domain, Socket, Type};
    let s = Served::start(&["--brp", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--volume", "v=memory:1M"]);
    let target: std::net::SocketAddr = s.metrics.parse().unwrap();
    let from = |ip: &str| -> TcpStream {
        let sock = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        sock.bind(&format!("{ip}:0").parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        sock.connect(&target.into()).unwrap();
        sock.into()
    };
    let mut silent: Vec<TcpStream> = (0..40).map(|_| from("127.0.0.2")).collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let scraped = scrape(&s.metrics);
    assert!(scraped.contains("fastsan_volume_size_bytes"), "{scraped}");
    assert!(t.elapsed() < Duration::from_secs(1), "the scrape waited {:?}", t.elapsed());
    let mut held = Vec::new();
    for (i, c) in silent.iter_mut().enumerate() {
        if !closed_within(c, Duration::from_millis(100)) {
            held.push(i);
        }
    }
    assert_eq!(held.len(), 4, "silent connections held open: {held:?}");
    for i in held {
        assert!(
            closed_within(&mut silent[i], Duration::from_secs(4)),
            "a silent connection outlived the head timeout"
        );
    }
    assert!(t.elapsed() >= Duration::from_millis(1500), "closed before its 2 s: {:?}", t.elapsed());
}

/// A process holding every place of the scraper's own address with silent
/// connections (renewing them as each times out) does not keep the
/// scraper out: a newcomer from that address closes the oldest connection
/// still without a request head after 250 ms and takes its place. (Before,
/// a local process could hold 127.0.0.1's four places and every local
/// scrape was closed unanswered.)
#[test]
fn a_scraper_closes_the_oldest_silent_connection_of_its_own_address() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--volume", "v=memory:1M"]);
    let mut silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&s.metrics).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(400));
    let t = std::time::Instant::now();
    let scraped = scrape(&s.metrics);
    assert!(scraped.contains("fastsan_volume_size_bytes"), "{scraped}");
    assert!(t.elapsed() < Duration::from_secs(1), "the scrape waited {:?}", t.elapsed());
    // (The closed one says so at once; the others are given 100 ms each.)
    let limits = [5000, 100, 100, 100].map(Duration::from_millis);
    let closed: Vec<bool> = silent.iter_mut().zip(limits).map(|(c, t)| closed_within(c, t)).collect();
    assert_eq!(closed, [true, false, false, false], "the oldest silent connection made room, and only it");
}
