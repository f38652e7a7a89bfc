//! The NBD front end with the real clients from Debian's packages: qemu-img,
//! qemu-io, nbdinfo, nbdcopy, fio's nbd engine, and nbdfuse with a loop
//! device and ext4 on top. `scripts/test.sh` installs them.

mod common;

use common::*;
use fastsan_initiator::{BlockingVolume, Options};
use std::path::Path;
use std::process::Command;

fn serve(volumes: &[&str]) -> Served {
    let mut args = vec!["--brp", "127.0.0.1:0"];
    for v in volumes {
        args.extend(["--volume", v]);
    }
    Served::start(&args)
}

#[test]
fn qemu_img_info_convert_compare() {
    let dir = temp_dir("qemu-img");
    let src = dir.join("src.raw");
    let back = dir.join("back.raw");
    let data = random_file(&src, 32 << 20);
    let s = serve(&["v=memory:32M"]);
    let url = s.nbd_url("v");
    let info = ok("qemu-img", &["info", &url]);
    assert!(info.contains("32 MiB (33554432 bytes)"), "{info}");
    ok("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", src.to_str().unwrap(), &url]);
    let cmp = ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", src.to_str().unwrap(), &url]);
    assert!(cmp.contains("Images are identical"), "{cmp}");
    ok("qemu-img", &["convert", "-f", "raw", "-O", "raw", &url, back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == data);
    // A change made through NBD makes compare fail, as it must.
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x5a 4096 4096", &url]);
    let (same, _) = tool("qemu-img", &["compare", "-f", "raw", "-F", "raw", src.to_str().unwrap(), &url]);
    assert!(!same, "compare notices the difference");
}

#[test]
fn qemu_io_patterns_zeroes_and_discards() {
    let s = serve(&["v=memory:16M"]);
    let url = s.nbd_url("v");
    let cmds = [
        "write -P 0xab 0 1M",
        "read -P 0xab 0 1M",
        "write -P 0xcd -f 1M 64k", // FUA
        "read -P 0xcd 1M 64k",
        "write -z 1M 1M",
        "read -P 0 1M 1M",
        "write -P 0xee 2M 1M",
        "discard 2M 1M",
        "read -P 0 2M 1M",
        "write -P 0x11 513 1000", // byte-granular, unaligned
        "read -P 0x11 513 1000",
        "read -P 0xab 0 513",
        "flush",
    ];
    let mut args = vec!["-f", "raw"];
    for c in &cmds {
        args.extend(["-c", c]);
    }
    args.push(&url);
    let out = ok("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert_eq!(out.matches("read ").count(), 6, "{out}");
    // And a pattern that is not there is reported: the check can fail.
    let (_, out) = tool("qemu-io", &["-f", "raw", "-c", "read -P 0x77 0 4k", &url]);
    assert!(out.contains("Pattern verification failed"), "{out}");
}

#[test]
fn nbdinfo_list_map_and_flags() {
    let s = serve(&["rw=memory:8M", "ro=memory:4M,ro"]);
    let list = ok("nbdinfo", &["--list", &format!("nbd://{}", s.nbd)]);
    assert!(list.contains("export=\"rw\"") && list.contains("export=\"ro\""), "{list}");
    let url = s.nbd_url("rw");
    // A fresh memory volume is one hole that reads as zeros.
    let map = ok("nbdinfo", &["--map", &url]);
    assert!(map.contains("hole,zero") && !map.contains("data"), "{map}");
    ok("qemu-io", &["-f", "raw", "-c", "write -P 1 1M 4k", &url]);
    let map = ok("nbdinfo", &["--map", &url]);
    assert!(map.contains("data") && map.contains("hole,zero"), "{map}");
    for can in ["flush", "fua", "trim", "zero", "fast-zero", "cache", "df", "multi-conn", "structured-reply"]
    {
        let (yes, out) = tool("nbdinfo", &["--can", can, &url]);
        assert!(yes, "rw can {can}: {out}");
    }
    let ro = s.nbd_url("ro");
    assert!(tool("nbdinfo", &["--is", "read-only", &ro]).0);
    assert!(!tool("nbdinfo", &["--is", "read-only", &url]).0);
    for cannot in ["trim", "zero", "fast-zero"] {
        assert!(!tool("nbdinfo", &["--can", cannot, &ro]).0, "ro cannot {cannot}");
    }
    let size = ok("nbdinfo", &["--size", &ro]);
    assert_eq!(size.trim(), "4194304");
}

#[test]
fn capabilities_pass_through_the_stack() {
    // The same layers (faults, delay) over three stores: what NBD advertises
    // is what the store at the bottom can do.
    let dir = temp_dir("caps");
    let img = dir.join("blk.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let dev = LoopDev::over(&img);
    let file = dir.join("ro.img");
    std::fs::File::create(&file).unwrap().set_len(4 << 20).unwrap();
    let s = serve(&[
        "mem=memory:8M,faults=none,delay=1ms",
        &format!("blk=file:{},faults=none,delay=1ms", dev.0),
        &format!("ro=file:{},ro,faults=none,delay=1ms", file.display()),
    ]);
    let can = |export: &str, what: &str| tool("nbdinfo", &["--can", what, &s.nbd_url(export)]).0;
    for what in ["trim", "zero", "fast-zero", "flush", "fua"] {
        assert!(can("mem", what), "memory can {what}");
    }
    assert!(can("blk", "zero") && can("blk", "trim"));
    assert!(!can("blk", "fast-zero"), "a block device cannot promise a fast zero (BLKZEROOUT may write)");
    assert!(tool("nbdinfo", &["--is", "read-only", &s.nbd_url("ro")]).0);
    for what in ["trim", "zero", "fast-zero"] {
        assert!(!can("ro", what), "read-only cannot {what}");
    }
    // And the data path works through the layers on the loop device.
    let url = s.nbd_url("blk");
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x5a 1M 64k", &url]);
    ok("qemu-io", &["-f", "raw", "-c", "read -P 0x5a 1M 64k", &url]);
    drop(s);
    drop(dev);
}

#[test]
fn nbdcopy_round_trip() {
    let dir = temp_dir("nbdcopy");
    let src = dir.join("src.raw");
    let back = dir.join("back.raw");
    let data = random_file(&src, 48 << 20);
    let s = serve(&["v=memory:48M"]);
    let url = s.nbd_url("v");
    ok("nbdcopy", &[src.to_str().unwrap(), &url]);
    ok("nbdcopy", &[&url, back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == data);
}

#[test]
fn fio_nbd_engine_random_writes_verify() {
    let s = serve(&["v=memory:64M"]);
    let uri = format!("--uri={}", s.nbd_url("v"));
    let out = ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--offset_increment=16M",
            "--numjobs=4",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            "--group_reporting",
        ],
    );
    assert!(out.contains("err= 0"), "{out}");
    assert!(!out.contains("verify: bad"), "{out}");
}

/// Unmounts, detaches and kills on every exit path, so a failing test leaves
/// no mount, loop device or FUSE process behind.
struct Stack<'a> {
    fuse_dir: &'a Path,
    mnt: &'a Path,
    loopdev: Option<String>,
    fuse: Option<std::process::Child>,
}

impl Drop for Stack<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.mnt).output();
        if let Some(l) = &self.loopdev {
            let _ = Command::new("losetup").args(["-d", l]).output();
        }
        let _ = Command::new("fusermount3").arg("-u").arg(self.fuse_dir).output();
        if let Some(mut f) = self.fuse.take() {
            let _ = f.kill();
            let _ = f.wait();
        }
    }
}

#[test]
fn nbdfuse_loop_ext4_files_survive_remount_and_fsck() {
    let dir = temp_dir("nbdfuse");
    let fuse_dir = dir.join("fuse");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let s = serve(&["disk=memory:128M"]);
    tool("nbdfuse", &["--version"]);
    let disk = fuse_dir.join("disk");
    let child = Command::new("nbdfuse").arg(&disk).arg(s.nbd_url("disk")).spawn().unwrap();
    let mut stack = Stack { fuse_dir: &fuse_dir, mnt: &mnt, loopdev: None, fuse: Some(child) };
    for _ in 0..100 {
        if std::fs::metadata(&disk).map(|m| m.len()).unwrap_or(0) == 128 << 20 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let dev = ok("losetup", &["-f", "--show", disk.to_str().unwrap()]).trim().to_owned();
    stack.loopdev = Some(dev.clone());
    ok("mkfs.ext4", &["-q", &dev]);
    let m = mnt.to_str().unwrap();
    ok("mount", &[&dev, m]);
    let files: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| {
            (format!("f{i}"), {
                let mut d = vec![0u8; (i + 1) * 700_001];
                rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut d);
                d
            })
        })
        .collect();
    for (name, d) in &files {
        std::fs::write(mnt.join(name), d).unwrap();
    }
    ok("umount", &[m]);
    let fsck = ok("fsck.ext4", &["-fn", &dev]);
    assert!(!fsck.contains("UNEXPECTED INCONSISTENCY"), "{fsck}");
    ok("mount", &[&dev, m]);
    for (name, d) in &files {
        assert!(std::fs::read(mnt.join(name)).unwrap() == *d, "{name} differs after remount");
    }
    drop(stack);
}

#[test]
fn brp_and_nbd_see_the_same_bytes() {
    let s = serve(&["v=memory:16M"]);
    let url = s.nbd_url("v");
    let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    vol.write_at(&[0x42; 65536], 1 << 20, false).unwrap();
    vol.flush().unwrap();
    let out = ok("qemu-io", &["-f", "raw", "-c", "read -P 0x42 1M 64k", &url]);
    assert!(!out.contains("verification failed"), "{out}");
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x24 4M 128k", "-c", "flush", &url]);
    let mut back = vec![0u8; 128 * 1024];
    vol.read_at(&mut back, 4 << 20).unwrap();
    assert!(back.iter().all(|&b| b == 0x24), "a write through NBD reads back through BRP");
}

/// NBD cannot check the BRP secret (no TLS yet): with a secret set, the
/// NBD listener is off, so `qemu-io` cannot write around the secret; an
/// explicit NBD listener is refused at start; `--nbd-insecure` is the
/// operator's explicit opt-out, and then NBD serves (unauthenticated).
#[test]
fn a_secret_is_not_bypassed_over_nbd() {
    let dir = temp_dir("nbd-secret");
    let secret = dir.join("secret");
    std::fs::write(&secret, "only for BRP").unwrap();
    let s = secret.to_str().unwrap();
    // Default NBD: off. Nothing but BRP is served; the secret still guards BRP.
    let locked = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:1M", "--secret-file", s]);
    assert!(locked.nbd.is_empty());
    let (served_nbd, text) = tool("nbdinfo", &["--list", "nbd://127.0.0.1:10809/"]);
    assert!(
        !served_nbd || !text.contains("export=\"v\""),
        "an NBD listener serves v with a secret set: {text}"
    );
    let (signal_status, log) = locked.signal("TERM");
    assert!(signal_status.success(), "{log}");
    assert!(log.contains("NBD is off"), "{log}");
    // Asked for explicitly: refused with the reason.
    let out = fastsan(&[
        "serve",
        "--brp",
        "127.0.0.1:0",
        "--nbd",
        "127.0.0.1:0",
        "--volume",
        "v=memory:1M",
        "--secret-file",
        s,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("TLS client certificates"), "{err}");
    let sock = dir.join("nbd.sock");
    let out = fastsan(&[
        "serve",
        "--brp",
        "127.0.0.1:0",
        "--no-nbd",
        "--nbd-unix",
        sock.to_str().unwrap(),
        "--volume",
        "v=memory:1M",
        "--secret-file",
        s,
    ]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--nbd-insecure"));
    // The explicit opt-out serves NBD, and says what it costs.
    let open = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--volume",
        "v=memory:1M",
        "--secret-file",
        s,
        "--nbd-insecure",
    ]);
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0xaa 0 4k", &open.nbd_url("v")]);
    let (_, log) = open.signal("TERM");
    assert!(log.contains("NBD clients without a certificate are not authenticated"), "{log}");
}
