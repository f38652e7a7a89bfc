//! `fastsan serve --nvme` with the Linux kernel's NVMe/TCP host, in a
//! throw-away guest (`common::guest`): qemu boots Debian's kernel under TCG
//! with nvme-tcp (and what it depends on) and nvme-cli in the initramfs, and
//! `tests/guest/nvme.sh` as /init. Every guest connection to
//! 10.0.2.100:4420 (the discovery controller's, the admin queue's, each I/O
//! queue's) becomes its own connection to the target's NVMe/TCP port.
//!
//! The guest discovers the subsystem, connects with 2 I/O queues, makes ext4
//! on namespace 1, writes 64 MiB, reads it back after a remount with the
//! caches dropped, checks the file system and disconnects; then connects
//! again with header and data digests, finds the data there, writes more,
//! and checks it all again.

mod common;

use common::guest::{self, Guest};
use common::*;
use std::process::Command;
use std::time::Duration;

/// The subsystem's name, given to the target (rather than its default,
/// which carries the host's name) and to the guest on its command line.
const NQN: &str = "nqn.2026-11.io.fastsan:kernel-nvme-test";
const SIZE: u64 = 256 << 20;

#[test]
fn the_kernel_nvme_tcp_host_discovers_connects_and_keeps_ext4_with_and_without_digests() {
    if guest::qemu_missing() {
        eprintln!("SKIPPED: qemu-system-x86_64 cannot run here (scripts/test.sh installs qemu-system-x86)");
        return;
    }
    let nvme_cli =
        Command::new("sh").args(["-c", "PATH=$PATH:/usr/sbin:/sbin command -v nvme"]).output().unwrap();
    assert!(nvme_cli.status.success(), "nvme (nvme-cli) is missing: scripts/test.sh installs it");
    let dir = temp_dir("kernel-nvme");
    let image = guest::build_image(&dir, "nvme.sh", &["nvme"], "nvme-tcp");

    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(SIZE).unwrap();
    let spec = format!("v=file:{}", img.display());
    let target = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--nvme",
        "127.0.0.1:0",
        "--nvme-nqn",
        NQN,
        "--volume",
        &spec,
    ]);
    let port = target.nvme.rsplit(':').next().unwrap().to_owned();

    let append = format!("fastsan.nqn={NQN} fastsan.bytes={SIZE}");
    let mut guest = Guest::boot(&image, &append, 4420, &port, Duration::from_secs(420));
    while let Some(event) = guest.next_event() {
        if event == "END" {
            break;
        }
    }
    guest.finish(&[
        "modules loaded",
        &format!("nvme discover lists {NQN}"),
        "connected without digests as /dev/nvme",
        "connected with digests as /dev/nvme",
        "namespace 1 has",
        "2 I/O queues",
        "mkfs.ext4",
        "sha256sum -c /tmp/sums",
        "e2fsck -fn /dev/nvme",
        "nvme disconnect",
        "gone after disconnect",
        "nothing amiss in the kernel log",
    ]);
    // What the guest wrote is in the file, as a clean file system.
    let fsck = ok("fsck.ext4", &["-fn", &img.display().to_string()]);
    assert!(!fsck.contains("UNEXPECTED INCONSISTENCY"), "{fsck}");
    drop(target);
    std::fs::remove_dir_all(dir).unwrap();
}
