//! `fastsan attach` with the Linux kernel's NBD client, in a throw-away
//! guest: this host has no nbd module, so qemu boots Debian's kernel (with
//! its nbd.ko) under TCG, with an initramfs holding busybox, this fastsan,
//! mkfs.ext4 and e2fsck, and `tests/guest/attach.sh` as /init. The guest
//! reaches the target on the host's loopback through qemu's user network
//! (restricted: a forward to one port, nothing else).
//!
//! The guest prints what it checked (`@@PASS`, `@@FAIL`); at `@@RESTART`
//! the host kills the target with SIGKILL and starts it again 35 s later on
//! the same port and file while the guest's direct writes wait. Meanwhile
//! each reconnect meets `nc`'s own error text instead of a handshake.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[test]
fn the_kernel_nbd_client_on_attach_survives_a_target_restart() {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        eprintln!("SKIPPED: qemu-system-x86_64 cannot run here (scripts/test.sh installs qemu-system-x86)");
        return;
    }
    let dir = temp_dir("kernel-attach");
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(format!("{root}/../../scripts/guest-image.sh"))
        .arg(dir.join("image"))
        .arg(format!("{root}/tests/guest/attach.sh"))
        .arg(BIN)
        .output()
        .unwrap();
    assert!(out.status.success(), "guest image: {}", String::from_utf8_lossy(&out.stderr));

    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    let spec = format!("v=file:{}", img.display());
    let mut target = Some(Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]));
    let addr = target.as_ref().unwrap().addr.clone();
    let port = addr.rsplit(':').next().unwrap().to_owned();

    let image = dir.join("image");
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg", "-m", "1024", "-smp", "2", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(image.join("vmlinuz"))
        .arg("-initrd")
        .arg(image.join("initrd.gz"))
        .args(["-append", "console=ttyS0 quiet panic=-1"])
        // Every guest connection to 10.0.2.100:10810 becomes a connection to the target.
        .arg("-netdev")
        .arg(format!("user,id=n,restrict=on,guestfwd=tcp:10.0.2.100:10810-cmd:busybox nc 127.0.0.1 {port}"))
        .args(["-device", "e1000,netdev=n,romfile="])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu starts");
    let (tx, rx) = mpsc::channel();
    let stdout = qemu.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(420);
    let (mut passed, mut failed, mut console, mut ended) = (Vec::new(), Vec::new(), Vec::new(), false);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let line = line.trim_end_matches('\r').to_owned();
        console.push(line.clone());
        let Some(msg) = line.find("@@").map(|i| line[i + 2..].to_owned()) else { continue };
        if let Some(p) = msg.strip_prefix("PASS ") {
            passed.push(p.to_owned());
        } else if msg.starts_with("FAIL") {
            failed.push(msg);
        } else if msg == "RESTART" {
            eprintln!("host: the target goes away for 35 s");
            // Let the writes start, then take the target away for 35 s:
            // longer than the kernel's default request timeout (30 s), which
            // with several queues would take each stuck queue for dead.
            std::thread::sleep(Duration::from_millis(500));
            let mut t = target.take().unwrap();
            t.child.kill().unwrap();
            t.child.wait().unwrap();
            std::thread::sleep(Duration::from_secs(35));
            target = Some(Served::start(&["--brp", &addr, "--volume", &spec]));
        } else if msg == "END" {
            ended = true;
            break;
        }
    }
    let _ = qemu.kill();
    let _ = qemu.wait();
    // What the guest checked, in the test's output (shown on failure, or with --no-capture).
    for l in console.iter().filter(|l| l.contains("@@")) {
        eprintln!("guest: {l}");
    }
    let tail = console.iter().rev().take(40).rev().cloned().collect::<Vec<_>>().join("\n");
    assert!(ended, "the guest did not finish within 420 s; its console ended with:\n{tail}");
    assert!(failed.is_empty(), "failed in the guest: {failed:#?}\nconsole:\n{tail}");
    for want in [
        "fails with 'no NBD driver'",
        "attached",
        "attach --list",
        "fails with 'busy'",
        "fails with 'in use'",
        "e2fsck -fn /dev/nbd0",
        "sha256sum -c /tmp/sums",
        "attach exited cleanly",
        "fails with 'is not attached'",
        "reconnected",
        "SIGTERM detaches",
    ] {
        assert!(passed.iter().any(|p| p.contains(want)), "no pass for {want:?}: {passed:#?}");
    }
    drop(target);
    std::fs::remove_dir_all(dir).unwrap();
}
