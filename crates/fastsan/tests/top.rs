//! `fastsan top` in a real terminal (tmux): it starts, shows a volume's
//! IOPS under load, and quits on `q`.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// tmux on a socket of its own (the test's tmux server, not the user's).
fn tmux(socket: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new("tmux").args(["-L", socket]).args(args).output().expect("tmux runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn top_shows_iops_under_load_and_quits_on_q() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:64M", "--metrics", "127.0.0.1:0"]);
    let mut bench = Command::new(BIN)
        .args(["bench", &s.url("v"), "--rw", "randread", "--runtime", "8", "--ramp", "0", "--iodepth", "4"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let socket = format!("fastsan-top-{}", std::process::id());
    let cmd = format!("{BIN} top http://{}/metrics", s.metrics);
    let (started, _) = tmux(&socket, &["new-session", "-d", "-s", "top", "-x", "120", "-y", "30", &cmd]);
    assert!(started, "tmux could not start fastsan top");
    // Wait for a refresh that shows v with IOPS in the thousands.
    let deadline = Instant::now() + Duration::from_secs(6);
    let (iops, screen) = loop {
        std::thread::sleep(Duration::from_millis(300));
        let screen = tmux(&socket, &["capture-pane", "-p", "-t", "top"]).1;
        let row = screen.lines().find(|l| l.contains("│v ") || l.split_whitespace().nth(1) == Some("v"));
        let n = row.and_then(|r| {
            r.split(|c: char| c.is_whitespace() || c == '│')
                .filter(|w| !w.is_empty())
                .nth(1)?
                .parse::<u64>()
                .ok()
        });
        match n {
            Some(n) if n > 1000 => break (n, screen),
            _ if Instant::now() > deadline => panic!("no IOPS for v on the screen:\n{screen}"),
            _ => {}
        }
    };
    assert!(screen.contains("volumes") && screen.contains("BRP"), "{screen}");
    assert!(iops > 1000, "{screen}");
    // q quits: the session (whose only program is top) goes away.
    tmux(&socket, &["send-keys", "-t", "top", "q"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while tmux(&socket, &["has-session", "-t", "top"]).0 {
        assert!(Instant::now() < deadline, "fastsan top did not quit on q");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = tmux(&socket, &["kill-server"]);
    let _ = bench.kill();
    let _ = bench.wait();
}

#[test]
fn top_without_a_terminal_prints_tables_and_a_bad_url_is_a_plain_error() {
    let out = fastsan(&["top", "http://127.0.0.1:1/metrics"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("reading http://127.0.0.1:1/metrics"), "{err}");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:1M", "--metrics", "127.0.0.1:0"]);
    let mut top = Command::new(BIN)
        .args(["top", &s.metrics, "--interval", "0.2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let _ = top.kill();
    let out = top.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("VOLUME\tIOPS") && text.contains("\nv\t0\t"), "{text}");
}

/// An endpoint that trickles its answer, a byte a second, is cut off at
/// 5 s in all (before, each byte restarted a 5 s read timeout, and top,
/// whose Ctrl-C is a key in raw mode, could not be left); one that answers
/// more than 16 MiB is refused, not held in memory.
#[test]
fn top_cuts_off_an_endpoint_that_trickles_or_floods() {
    use std::io::Write;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        // First client: a byte a second, for 30 s at most, until it leaves.
        let (mut c, _) = l.accept().unwrap();
        l.set_nonblocking(true).unwrap();
        let mut next = None;
        for _ in 0..30 {
            if c.write_all(b"H").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
            // The second client (top run again) may be here already.
            if let Ok((n, _)) = l.accept() {
                next = Some(n);
                break;
            }
        }
        drop(c);
        l.set_nonblocking(false).unwrap();
        // Second client: a 200 with 17 MiB of samples.
        let mut c = next.unwrap_or_else(|| l.accept().unwrap().0);
        c.set_nonblocking(false).unwrap();
        // Its request read first: a close with unread bytes would reset the
        // connection, and the answer with it, before top counts 16 MiB.
        use std::io::Read;
        let _ = c.read(&mut [0u8; 4096]);
        let _ = c.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
        let line = b"fastsan_requests_total{protocol=\"brp\"} 1\n";
        let mib: Vec<u8> = line.iter().copied().cycle().take(line.len() * ((1 << 20) / line.len())).collect();
        for _ in 0..17 {
            if c.write_all(&mib).is_err() {
                break;
            }
        }
        // Open until top leaves.
        let _ = c.read(&mut [0u8; 16]);
    });
    let run = |what: &str| {
        let t = std::time::Instant::now();
        let mut top = Command::new(BIN)
            .args(["top", &format!("http://{addr}/metrics")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        while top.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(15) {
                let _ = top.kill();
                panic!("top still waiting on an endpoint that {what} after 15 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = top.wait_with_output().unwrap();
        assert!(!out.status.success());
        (String::from_utf8_lossy(&out.stderr).into_owned(), t.elapsed())
    };
    let (err, took) = run("trickles");
    assert!(err.contains("within 5 s") && took < Duration::from_secs(8), "{took:?}: {err}");
    let (err, _) = run("floods");
    assert!(err.contains("over 16 MiB"), "{err}");
    server.join().unwrap();
}
