//! Helpers for tests that run the `fastsan` binary.
#![allow(dead_code)]

pub mod guest;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_fastsan");

/// A `fastsan serve` process; killed when dropped.
pub struct Served {
    pub child: Child,
    pub addr: String,
    pub nbd: String,
    /// `HOST:PORT` of `/metrics`, with `--metrics`.
    pub metrics: String,
    /// `HOST:PORT` of NVMe/TCP, with `--nvme` (from the line naming NVMe).
    pub nvme: String,
}

impl Served {
    /// Starts `fastsan serve ARGS`, with NBD on a free port unless a secret
    /// turns it off (NBD cannot check one; `--nbd-insecure` keeps it), or
    /// ARGS give its address.
    pub fn start(args: &[&str]) -> Served {
        Served::start_under(&[], args)
    }

    /// [`Served::start`] under a command that runs it (`prlimit ... --`).
    pub fn start_under(under: &[&str], args: &[&str]) -> Served {
        let secret = args.contains(&"--secret-file") || args.contains(&"--secrets-file");
        let given = args.contains(&"--nbd");
        let nbd = given
            || !args.contains(&"--no-nbd")
                && (!secret || args.contains(&"--nbd-insecure") || args.contains(&"--tls-ca"));
        let mut cmd = match under.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let mut child = cmd
            .arg("serve")
            .args(args)
            .args(if nbd && !given { &["--nbd", "127.0.0.1:0"][..] } else { &[][..] })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fastsan runs");
        // One line per listener, each with its address after "on" (a line
        // for a unix socket too, skipped); read by what it names, not by its
        // place, until every address asked for is known.
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let want_metrics = args.contains(&"--metrics");
        let want_nvme = args.contains(&"--nvme");
        let (mut addr, mut nbd_addr, mut metrics, mut nvme) = (None, None, None, None);
        while addr.is_none()
            || (nbd && nbd_addr.is_none())
            || (want_metrics && metrics.is_none())
            || (want_nvme && nvme.is_none())
        {
            let mut line = String::new();
            if out.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("fastsan serve {args:?} ended before printing its addresses:\n{err}");
            }
            if line.contains("unix socket") {
                continue;
            }
            let on = line.split_whitespace().skip_while(|w| *w != "on").nth(1);
            let on = on.unwrap_or_else(|| panic!("no address in {line:?}")).to_owned();
            if line.contains("NVMe") {
                nvme = Some(on);
            } else if line.contains("metrics") {
                metrics = Some(on.trim_start_matches("http://").trim_end_matches("/metrics").to_owned());
            } else if line.contains("NBD") {
                nbd_addr = Some(on);
            } else if line.contains("BRP") {
                addr = Some(on);
            } else {
                panic!("an address of what? {line:?}");
            }
        }
        Served {
            child,
            addr: addr.unwrap(),
            nbd: nbd_addr.unwrap_or_default(),
            metrics: metrics.unwrap_or_default(),
            nvme: nvme.unwrap_or_default(),
        }
    }

    pub fn url(&self, vol: &str) -> String {
        format!("brp://{}/{vol}", self.addr)
    }

    /// Sends a signal and waits for the exit; returns the status and stderr
    /// (empty if the caller took it).
    pub fn signal(mut self, sig: &str) -> (std::process::ExitStatus, String) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-s", sig, &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "fastsan did not exit after SIG{sig}");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            e.read_to_string(&mut err).unwrap();
        }
        (status, err)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn fastsan(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("fastsan runs")
}

/// A directory of the test's own under the system's temp dir (never the
/// source tree), removed with everything in it when dropped, whether the
/// test passed or not: a suite run leaves nothing behind (volume images of
/// up to 256 MiB did, before).
pub struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.path().as_os_str()
    }
}

pub fn temp_dir(name: &str) -> Scratch {
    let prefix = format!("fastsan-cli-{name}-");
    Scratch(tempfile::Builder::new().prefix(&prefix).tempdir().expect("a temp dir"))
}

pub fn random_file(path: &Path, len: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut data = vec![0u8; len];
    rand::thread_rng().fill_bytes(&mut data);
    std::fs::write(path, &data).unwrap();
    data
}

impl Served {
    /// `nbd://HOST:PORT/EXPORT` of this target.
    pub fn nbd_url(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbd)
    }
}

/// Runs a tool (bounded to two minutes); returns success and its output. It runs in the
/// temporary directory, so nothing a tool leaves behind (fio state files) lands in the source tree.
pub fn tool(name: &str, args: &[&str]) -> (bool, String) {
    let found = Command::new("sh").args(["-c", &format!("command -v {name}")]).output().unwrap();
    assert!(found.status.success(), "{name} is missing: scripts/test.sh installs it");
    let out = Command::new("timeout")
        .arg("120")
        .arg(name)
        .args(args)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Runs a tool that must succeed; its output.
pub fn ok(name: &str, args: &[&str]) -> String {
    let (success, text) = tool(name, args);
    assert!(success, "{name} {args:?} failed:\n{text}");
    text
}

/// A loop device over a file, detached on every exit path.
pub struct LoopDev(pub String);

impl LoopDev {
    /// A loop device over `file`.
    pub fn over(file: &Path) -> LoopDev {
        LoopDev(ok("losetup", &["-f", "--show", file.to_str().unwrap()]).trim().to_owned())
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).output();
    }
}

/// One HTTP request to the metrics listener: (status line, body).
pub fn http(addr: &str, request: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Write::write_all(&mut s, request.as_bytes()).unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap_or((&all, ""));
    (head.lines().next().unwrap_or_default().to_owned(), body.to_owned())
}

/// The value of the sample `name{labels}` (labels as written, in order).
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

pub fn scrape(addr: &str) -> String {
    let (status, body) = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    body
}
