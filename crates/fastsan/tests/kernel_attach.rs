//! `fastsan attach` with the Linux kernel's NBD client, in a throw-away
//! guest: this host has no nbd module, so qemu boots Debian's kernel (with
//! its nbd.ko) under TCG, with an initramfs holding busybox, this fastsan,
//! mkfs.ext4 and e2fsck, and `tests/guest/attach.sh` as /init
//! (`common::guest`). The guest reaches the target on the host's loopback
//! through qemu's user network (restricted: a forward to one port, nothing
//! else).
//!
//! The guest prints what it checked (`@@PASS`, `@@FAIL`); at `@@RESTART`
//! the host kills the target with SIGKILL and starts it again 35 s later on
//! the same port and file while the guest's direct writes wait. Meanwhile
//! each reconnect meets `nc`'s own error text instead of a handshake. At
//! `@@STOP` it stops the target (SIGSTOP) for 10 s, longer than the device
//! timeout the guest attached with (3 s): the kernel gives up on its queues'
//! sockets, and attach must give it new ones without losing a write. At
//! `@@REPLACE` it restarts the target at once: the memory volume the guest
//! attached last comes back empty (another volume), and detach must not
//! leave the device attached for ever. Before that, an attach killed with
//! SIGKILL leaves a device that `detach --force` frees.

mod common;

use common::guest::{self, Guest};
use common::*;
use std::time::Duration;

#[test]
fn the_kernel_nbd_client_on_attach_survives_a_target_restart() {
    if guest::qemu_missing() {
        eprintln!("SKIPPED: qemu-system-x86_64 cannot run here (scripts/test.sh installs qemu-system-x86)");
        return;
    }
    let dir = temp_dir("kernel-attach");
    // `ss`: what a check that stalls reports (attach.sh's `stalled`).
    let image = guest::build_image(&dir, "attach.sh", &[BIN, "ss"], "");

    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    let spec = format!("v=file:{}", img.display());
    let memory = "m=memory:64M";
    let mut target = Some(Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec, "--volume", memory]));
    let addr = target.as_ref().unwrap().addr.clone();
    let port = addr.rsplit(':').next().unwrap().to_owned();

    let mut guest = Guest::boot(&image, "", 10810, &port, Duration::from_secs(420));
    while let Some(event) = guest.next_event() {
        if event == "RESTART" {
            eprintln!("host: the target goes away for 35 s");
            // Let the writes start, then take the target away for 35 s:
            // longer than the kernel's default request timeout (30 s), which
            // with several queues would take each stuck queue for dead.
            std::thread::sleep(Duration::from_millis(500));
            let mut t = target.take().unwrap();
            t.child.kill().unwrap();
            t.child.wait().unwrap();
            std::thread::sleep(Duration::from_secs(35));
            target = Some(Served::start(&["--brp", &addr, "--volume", &spec, "--volume", memory]));
        } else if event == "REPLACE" {
            // Restarted at once: the memory volume comes back empty, another.
            eprintln!("host: the target restarts (its memory volume is replaced)");
            std::thread::sleep(Duration::from_millis(500));
            let mut t = target.take().unwrap();
            t.child.kill().unwrap();
            t.child.wait().unwrap();
            target = Some(Served::start(&["--brp", &addr, "--volume", &spec, "--volume", memory]));
        } else if event == "STOP" {
            // Stopped, not killed: its connections stay, nothing answers
            // for 10 s, longer than the guest's device timeout (3 s).
            eprintln!("host: the target stops for 10 s");
            std::thread::sleep(Duration::from_millis(500));
            let pid = target.as_ref().unwrap().child.id() as libc::pid_t;
            // SAFETY: signals to our own child process.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            std::thread::sleep(Duration::from_secs(10));
            unsafe { libc::kill(pid, libc::SIGCONT) };
        } else if event == "END" {
            break;
        }
    }
    guest.finish(&[
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
        "queues renewed",
        "fails with 'detach --force'",
        "detach --force frees",
        "fails with 'writes may be lost'",
        "a replaced volume's device is detached",
        "attach reports the loss",
    ]);
    drop(target);
}
