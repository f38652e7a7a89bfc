//! A throw-away guest for the kernel-client tests: qemu boots Debian's
//! kernel under TCG with an initramfs from `scripts/guest-image.sh` and a
//! test script as /init. The guest reaches one port of the host's loopback
//! through qemu's user network (restricted: that forward, nothing else), and
//! reports on its console: `@@PASS what`, `@@FAIL what`, other `@@WORD`
//! events for the host to act on, and `@@END` when done.
//!
//! A kernel oops in the guest panics it (`oops=panic`), which ends qemu at
//! once (`panic=-1` reboots, `-no-reboot` exits): a crashed guest is reported
//! as one ([`Guest::crash`]) within seconds, not as a guest that went quiet
//! until the test's time limit.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Whether qemu cannot run here (the tests then skip, saying so).
pub fn qemu_missing() -> bool {
    Command::new("qemu-system-x86_64").arg("--version").output().map(|o| !o.status.success()).unwrap_or(true)
}

/// Builds the guest's kernel and initramfs in `dir/image` with
/// `tests/guest/INIT` as /init, the given programs (with their libraries)
/// and the kernel modules `modules` (space-separated, with what they depend
/// on) besides those every guest has; returns the image directory.
pub fn build_image(dir: &Path, init: &str, programs: &[&str], modules: &str) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let image = dir.join("image");
    let out = Command::new(format!("{root}/../../scripts/guest-image.sh"))
        .env("GUEST_MODULES", modules)
        .arg(&image)
        .arg(format!("{root}/tests/guest/{init}"))
        .args(programs)
        .output()
        .unwrap();
    assert!(out.status.success(), "guest image: {}", String::from_utf8_lossy(&out.stderr));
    image
}

/// A running guest; killed when dropped.
pub struct Guest {
    qemu: Child,
    lines: mpsc::Receiver<String>,
    started: Instant,
    deadline: Instant,
    limit: Duration,
    /// The console so far, each line with the seconds since qemu started.
    pub console: Vec<(f64, String)>,
    pub passed: Vec<String>,
    pub failed: Vec<String>,
    pub ended: bool,
    /// The first line of a kernel crash on the console (an oops, a `BUG:`,
    /// a panic), if the guest's kernel crashed.
    pub crash: Option<String>,
}

/// Whether a console line is the start of a kernel crash report.
fn is_crash(line: &str) -> bool {
    ["BUG: ", "Oops: ", "Kernel panic", "general protection fault"].iter().any(|m| line.contains(m))
}

impl Guest {
    /// Boots `image` (from [`build_image`]) with `append` added to the
    /// kernel command line; every guest connection to 10.0.2.100:`guest_port`
    /// becomes a connection (through its own `busybox nc`) to
    /// 127.0.0.1:`host_port`. The guest has `limit` to reach `@@END`.
    pub fn boot(image: &Path, append: &str, guest_port: u16, host_port: &str, limit: Duration) -> Guest {
        let mut qemu = Command::new("qemu-system-x86_64")
            .args(["-accel", "tcg", "-m", "1024", "-smp", "2", "-nographic", "-no-reboot"])
            .arg("-kernel")
            .arg(image.join("vmlinuz"))
            .arg("-initrd")
            .arg(image.join("initrd.gz"))
            .arg("-append")
            .arg(format!("console=ttyS0 quiet oops=panic panic=-1 {append}").trim_end())
            .arg("-netdev")
            .arg(format!(
                "user,id=n,restrict=on,guestfwd=tcp:10.0.2.100:{guest_port}-cmd:busybox nc 127.0.0.1 {host_port}"
            ))
            .args(["-device", "e1000,netdev=n,romfile="])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("qemu starts");
        let started = Instant::now();
        let (tx, lines) = mpsc::channel();
        let stdout = qemu.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Guest {
            qemu,
            lines,
            started,
            deadline: started + limit,
            limit,
            console: Vec::new(),
            passed: Vec::new(),
            failed: Vec::new(),
            ended: false,
            crash: None,
        }
    }

    /// Reads the console, collecting passes and failures, up to the next
    /// other `@@` event, which it returns (`END` sets `ended`); `None` when
    /// the console closes or the time is up.
    pub fn next_event(&mut self) -> Option<String> {
        while let Ok(line) = self.lines.recv_timeout(self.deadline.saturating_duration_since(Instant::now()))
        {
            let line = line.trim_end_matches('\r').to_owned();
            self.console.push((self.started.elapsed().as_secs_f64(), line.clone()));
            if self.crash.is_none() && is_crash(&line) {
                self.crash = Some(line.clone());
            }
            let Some(msg) = line.find("@@").map(|i| line[i + 2..].to_owned()) else { continue };
            if let Some(p) = msg.strip_prefix("PASS ") {
                self.passed.push(p.to_owned());
            } else if msg.starts_with("FAIL") {
                self.failed.push(msg);
            } else {
                self.ended |= msg == "END";
                return Some(msg);
            }
        }
        None
    }

    /// Stops the guest and checks it: it ended in time, nothing failed, and
    /// each of `wants` is part of a pass. The guest's console (what it
    /// checked, the kernel's messages, what a stalled check reported) is in
    /// the test's output, shown on failure or with --no-capture.
    pub fn finish(mut self, wants: &[&str]) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
        for (t, l) in self.console.iter().take(2000) {
            eprintln!("guest {t:6.1}s: {l}");
        }
        let tail =
            self.console.iter().rev().take(40).rev().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n");
        let (ended, limit, passed, failed) = (self.ended, self.limit.as_secs(), &self.passed, &self.failed);
        if let Some(crash) = &self.crash {
            let report = self.crash_report();
            panic!("the guest's kernel crashed ({crash}); its console from there:\n{report}");
        }
        assert!(ended, "the guest did not finish within {limit} s; its console ended with:\n{tail}");
        assert!(failed.is_empty(), "failed in the guest: {failed:#?}\nconsole:\n{tail}");
        for want in wants {
            assert!(passed.iter().any(|p| p.contains(want)), "no pass for {want:?}: {passed:#?}");
        }
    }
}

impl Guest {
    /// The console from the crash on (at most 60 lines), or its last 40 lines.
    pub fn crash_report(&self) -> String {
        let from = self
            .console
            .iter()
            .position(|(_, l)| is_crash(l))
            .unwrap_or(self.console.len().saturating_sub(40));
        self.console[from..].iter().take(60).map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }
}
