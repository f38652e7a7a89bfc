//! `fastsan attach --fuse`: a volume as one file, under a loop device and
//! ext4, through a target restart; fallocate and O_DIRECT on the file; and
//! the errors a user meets.

mod common;

use common::*;
use fastsan_initiator::{BlockingVolume, Options};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `fastsan attach`, and what the test stacked on it; taken
/// down in order when dropped, whatever happened.
struct Attached {
    child: Option<Child>,
    fuse: PathBuf,
    mnt: PathBuf,
    loopdev: Option<String>,
}

impl Attached {
    /// Attaches `url` in `dir/fuse` and waits for the file to appear with `size` bytes.
    fn start(url: &str, dir: &Path, size: u64) -> Attached {
        let (fuse, mnt) = (dir.join("fuse"), dir.join("mnt"));
        std::fs::create_dir_all(&fuse).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let child = Command::new(BIN)
            .args(["attach", url, "--fuse", fuse.to_str().unwrap(), "--reconnect-timeout", "30"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let a = Attached { child: Some(child), fuse, mnt, loopdev: None };
        let file = a.file(url);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != size {
            assert!(Instant::now() < deadline, "{} did not appear", file.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        a
    }

    fn file(&self, url: &str) -> PathBuf {
        self.fuse.join(url.rsplit('/').next().unwrap())
    }

    /// SIGTERM: unmounts and flushes; its exit status and log. A loop
    /// device may let go of the file a moment after `losetup -d` (the mount
    /// is busy until then, and attach keeps serving): signalled again.
    fn stop(mut self) -> (std::process::ExitStatus, String) {
        self.take_down_stack();
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            assert!(Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()
                .unwrap()
                .success());
            if let Some(s) = wait_exit(&mut child, Duration::from_secs(1)) {
                break s;
            }
            assert!(Instant::now() < deadline, "fastsan attach did not exit");
        };
        let mut log = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
        (status, log)
    }

    fn take_down_stack(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).output();
        if let Some(l) = self.loopdev.take() {
            let _ = Command::new("losetup").args(["-d", &l]).output();
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.take_down_stack();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = Command::new("fusermount3").arg("-u").arg(&self.fuse).output();
        }
    }
}

/// The child's exit status, if it exits within `t`.
fn wait_exit(child: &mut Child, t: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + t;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn random(len: usize) -> Vec<u8> {
    let mut d = vec![0u8; len];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut d);
    d
}

/// ext4 on a loop device on the attached file: files written, synced,
/// checked by fsck, read back after a remount; then the target restarts
/// while the filesystem is mounted and idle, and it keeps working.
#[test]
fn ext4_on_an_attached_volume_survives_remount_fsck_and_a_target_restart() {
    let dir = temp_dir("attach-ext4");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(128 << 20).unwrap();
    let spec = format!("disk=file:{}", img.display());
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
    let (addr, url) = (s.addr.clone(), s.url("disk"));
    let mut a = Attached::start(&url, &dir, 128 << 20);
    let dev = ok("losetup", &["-f", "--show", a.file(&url).to_str().unwrap()]).trim().to_owned();
    a.loopdev = Some(dev.clone());
    ok("mkfs.ext4", &["-q", &dev]);
    let m = a.mnt.to_str().unwrap().to_owned();
    ok("mount", &[&dev, &m]);
    let mut files: Vec<(String, Vec<u8>)> =
        (0..6).map(|i| (format!("f{i}"), random((i + 1) * 900_001))).collect();
    for (name, d) in &files {
        std::fs::write(a.mnt.join(name), d).unwrap();
    }
    ok("sync", &[]);
    ok("umount", &[&m]);
    let fsck = ok("fsck.ext4", &["-fn", &dev]);
    assert!(!fsck.contains("UNEXPECTED INCONSISTENCY"), "{fsck}");
    ok("mount", &[&dev, &m]);
    for (name, d) in &files {
        assert!(std::fs::read(a.mnt.join(name)).unwrap() == *d, "{name} differs after remount");
    }
    // The target restarts while the filesystem is mounted and idle.
    let (status, _) = s.signal("TERM");
    assert!(status.success());
    let s = Served::start(&["--brp", &addr, "--volume", &spec]);
    for i in 6..9 {
        let d = random(500_000 + i * 1000);
        std::fs::write(a.mnt.join(format!("f{i}")), &d).unwrap();
        files.push((format!("f{i}"), d));
    }
    ok("sync", &[]);
    ok("umount", &[&m]);
    // Dropped caches or not, the bytes come from the volume: read them back after a remount.
    ok("mount", &[&dev, &m]);
    for (name, d) in &files {
        assert!(std::fs::read(a.mnt.join(name)).unwrap() == *d, "{name} differs after the target restart");
    }
    ok("umount", &[&m]);
    let fsck = ok("fsck.ext4", &["-fn", &dev]);
    assert!(!fsck.contains("UNEXPECTED INCONSISTENCY"), "{fsck}");
    let (status, log) = a.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("connection re-established") && log.contains("detached"), "{log}");
    assert!(
        !Command::new("mountpoint").arg("-q").arg(dir.join("fuse")).status().unwrap().success(),
        "unmounted"
    );
    // Attached afresh (no page cache of the old mount or loop device): the bytes are the volume's.
    let mut a = Attached::start(&url, &dir, 128 << 20);
    let dev = ok("losetup", &["-f", "--show", a.file(&url).to_str().unwrap()]).trim().to_owned();
    a.loopdev = Some(dev.clone());
    ok("mount", &["-o", "ro", &dev, &m]);
    for (name, d) in &files {
        assert!(std::fs::read(a.mnt.join(name)).unwrap() == *d, "{name} differs when attached again");
    }
    let (status, log) = a.stop();
    assert!(status.success(), "{log}");
    drop(s);
}

/// The file as a program uses it: unaligned writes, O_DIRECT, fsync,
/// fallocate punch-hole (TRIM) and zero-range (WRITE_ZEROES), each seen
/// through BRP; a read-only volume refuses writes.
#[test]
fn the_attached_file_maps_writes_fsync_direct_io_and_fallocate_to_the_volume() {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let dir = temp_dir("attach-file");
    let s =
        Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:16M", "--volume", "ro=memory:1M,ro"]);
    let url = s.url("v");
    let mut a = Attached::start(&url, &dir, 16 << 20);
    let vol = BlockingVolume::connect(&url, Options::default()).unwrap();
    let peek = |off: u64, len: usize| {
        let mut b = vec![0u8; len];
        vol.read_at(&mut b, off).unwrap();
        b
    };
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(a.file(&url)).unwrap();
    // Unaligned: 1000 bytes at 100, inside blocks that keep their other bytes.
    vol.write_at(&[9; 4096], 0, false).unwrap();
    f.write_all_at(&[1; 1000], 100).unwrap();
    f.sync_all().unwrap();
    let back = peek(0, 4096);
    assert!(back[..100].iter().all(|&b| b == 9) && back[100..1100].iter().all(|&b| b == 1));
    assert!(back[1100..].iter().all(|&b| b == 9), "the rest of the blocks is kept");
    // O_DIRECT.
    let mut d = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(a.file(&url))
        .unwrap();
    let layout = std::alloc::Layout::from_size_align(65536, 4096).unwrap();
    // SAFETY: a 64 KiB buffer aligned for O_DIRECT, filled before use, freed below.
    let buf = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc(layout), 65536) };
    buf.fill(0x77);
    d.seek(SeekFrom::Start(1 << 20)).unwrap();
    d.write_all(buf).unwrap();
    assert!(peek(1 << 20, 65536).iter().all(|&b| b == 0x77), "a direct write reaches the volume at once");
    vol.write_at(&[0x55; 65536], 2 << 20, false).unwrap();
    d.read_exact_at(buf, 2 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0x55), "a direct read sees the volume, not a cache");
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf.as_mut_ptr(), layout) };
    // fallocate: punch a hole, zero a range (with unaligned edges).
    vol.write_at(&[0xEE; 1 << 20], 4 << 20, false).unwrap();
    let p = a.file(&url);
    ok("fallocate", &["-p", "-o", &(4u64 << 20).to_string(), "-l", "65536", p.to_str().unwrap()]);
    // Truncation is ignored, as on a block device.
    drop(std::fs::OpenOptions::new().write(true).truncate(true).open(&p).unwrap());
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 16 << 20);
    ok("fallocate", &["-z", "-o", &((5u64 << 20) - 1000).to_string(), "-l", "70000", p.to_str().unwrap()]);
    let back = peek(4 << 20, 1 << 20);
    assert!(back[..65536].iter().all(|&b| b == 0), "the punched hole reads zeros");
    assert!(back[65536..(1 << 20) - 1000].iter().all(|&b| b == 0xEE), "only the hole");
    // From 1536 bytes before 5 MiB (a block boundary): 536 bytes kept, then 70000 zeros.
    let z = peek((5 << 20) - 1536, 142 * 512);
    assert!(z[..536].iter().all(|&b| b == 0xEE) && z[536..536 + 70000].iter().all(|&b| b == 0));
    // Beyond the end: an error, nothing written.
    assert!(f.write_all_at(&[1; 512], 16 << 20).is_err());
    f.flush().unwrap();
    drop(d);
    // Signalled while a file is open: it refuses, stays attached and serving.
    // Its registry entry counts the refusal: waited for, since under load
    // the process acted on the signal later than any fixed pause (once more
    // than 500 ms, after the file was closed: the detach then went through).
    let pid = a.child.as_ref().unwrap().id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let entry = fastsan_attach::registry::dir().join(format!("{pid}.json"));
    let deadline = Instant::now() + Duration::from_secs(20);
    let refusals = || -> u64 {
        let e = std::fs::read(&entry).unwrap_or_default();
        serde_json::from_slice::<serde_json::Value>(&e).map_or(0, |v| v["refusals"].as_u64().unwrap_or(0))
    };
    while refusals() == 0 {
        assert!(Instant::now() < deadline, "the SIGTERM was not refused");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(a.child.as_mut().unwrap().try_wait().unwrap().is_none(), "a busy mount is not cut");
    f.write_all_at(&[3; 4096], 8192).unwrap();
    f.sync_all().unwrap();
    assert!(peek(8192, 4096).iter().all(|&b| b == 3), "still serving");
    drop(f);
    let (status, log) = a.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("is in use") && log.contains("still serving") && log.contains("detached"), "{log}");
    // Read-only: opening for writing is refused.
    let ro = s.url("ro");
    let a = Attached::start(&ro, &dir.join("ro"), 1 << 20);
    let e = std::fs::OpenOptions::new().write(true).open(a.file(&ro)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    assert!(std::fs::read(a.file(&ro)).unwrap().iter().all(|&b| b == 0));
    drop(a);
}

#[test]
fn attach_errors_are_clear() {
    let dir = temp_dir("attach-errors");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:1M"]);
    let d = dir.to_str().unwrap();
    let (nope, v) = (s.url("nope"), s.url("v"));
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["attach", &nope, "--fuse", d], "no such volume"),
        (vec!["attach", &v, "--fuse", "/nonexistent/dir"], "is not a directory"),
        (vec!["attach", "brp://127.0.0.1:1/v", "--fuse", d, "--reconnect-timeout", "0"], "cannot connect"),
    ];
    // This host has no nbd module (tests/kernel_attach.rs has a kernel that does).
    if !Path::new("/sys/module/nbd").exists() {
        cases.push((vec!["attach", &v], "no NBD driver"));
        // Found before the volume is opened.
        cases.push((vec!["attach", "brp://127.0.0.1:1/v"], "no NBD driver"));
    }
    for (args, needle) in cases {
        let out = fastsan(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // The secret: missing, then wrong.
    let secret = dir.join("secret");
    std::fs::write(&secret, "the right one").unwrap();
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "a wrong one").unwrap();
    let locked = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--volume",
        "v=memory:1M",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    for (extra, needle) in [
        (vec![], "requires a secret"),
        (vec!["--secret-file", wrong.to_str().unwrap()], "authentication failed"),
    ] {
        let mut args = vec!["attach", "--fuse", d, "--reconnect-timeout", "0"];
        let url = locked.url("v");
        args.push(&url);
        args.extend(extra);
        let out = fastsan(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{args:?}: {err}");
    }
    // No FUSE device: a regular file bound over /dev/fuse in a private mount namespace.
    let fake = dir.join("not-fuse");
    std::fs::write(&fake, "").unwrap();
    let script =
        format!("mount --bind {} /dev/fuse && exec {BIN} attach {} --fuse {d}", fake.display(), s.url("v"));
    let out = Command::new("unshare").args(["-m", "sh", "-c", &script]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("/dev/fuse is not the FUSE device"), "{err}");
    // detach: nothing attached there.
    let out = fastsan(&["detach", d]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("nothing attached by fastsan"), "{err}");
}

/// `attach --list` shows the attached file; `detach` refuses while a loop
/// device holds it (and attach keeps serving), then detaches.
#[test]
fn attach_list_and_detach() {
    let dir = temp_dir("attach-list");
    let run = dir.join("run");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:16M"]);
    let url = s.url("v");
    let fuse = dir.join("fuse");
    std::fs::create_dir_all(&fuse).unwrap();
    let with_run =
        |args: &[&str]| Command::new(BIN).args(args).env("FASTSAN_RUN_DIR", &run).output().unwrap();
    let out = with_run(&["attach", "--list"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "nothing attached");
    let child = Command::new(BIN)
        .args(["attach", &url, "--fuse", fuse.to_str().unwrap(), "--metrics", "127.0.0.1:0"])
        .env("FASTSAN_RUN_DIR", &run)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Held so that a failed assertion still detaches the loop device, kills
    // attach and unmounts (a stale FUSE mount outlived the test otherwise).
    let mut a = Attached { child: Some(child), fuse: fuse.clone(), mnt: dir.join("mnt"), loopdev: None };
    let child = a.child.as_mut().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)
        .unwrap();
    let metrics =
        line.split_whitespace().last().unwrap().trim_start_matches("http://").trim_end_matches("/metrics");
    let metrics = metrics.to_owned();
    let file = fuse.join("v");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != 16 << 20 {
        assert!(Instant::now() < deadline, "the file did not appear");
        std::thread::sleep(Duration::from_millis(50));
    }
    let list = String::from_utf8_lossy(&with_run(&["attach", "--list"]).stdout).into_owned();
    let row = list.lines().find(|l| l.contains(file.to_str().unwrap())).unwrap_or_else(|| panic!("{list}"));
    for want in ["fuse", "attached", "2/2", url.as_str(), &child.id().to_string()] {
        assert!(row.contains(want), "{want:?} missing in {row:?}");
    }
    let dev = ok("losetup", &["-f", "--show", file.to_str().unwrap()]).trim().to_owned();
    a.loopdev = Some(dev.clone());
    let child = a.child.as_mut().unwrap();
    let out = with_run(&["detach", fuse.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("in use"), "{err}");
    // Still attached and serving.
    assert!(child.try_wait().unwrap().is_none());
    std::fs::write(&file, b"still here").unwrap();
    // The session's own metrics: its connections and the requests it sent.
    let text = {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&metrics).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut t = String::new();
        c.read_to_string(&mut t).unwrap();
        t
    };
    let value = |name: &str| -> f64 {
        let series = format!("{name}{{volume=\"{url}\"}} ");
        let line =
            text.lines().find(|l| l.starts_with(&series)).unwrap_or_else(|| panic!("no {series} in {text}"));
        line[series.len()..].trim().parse().unwrap()
    };
    assert_eq!(value("fastsan_initiator_connections_up"), 2.0, "{text}");
    assert!(value("fastsan_initiator_requests_total") > 0.0, "{text}");
    ok("losetup", &["-d", &dev]);
    a.loopdev = None;
    // The loop device may hold the file a moment after losetup -d.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = with_run(&["detach", fuse.to_str().unwrap()]);
        if out.status.success() {
            assert!(String::from_utf8_lossy(&out.stdout).contains("detached"));
            break;
        }
        assert!(Instant::now() < deadline, "{}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
    let status =
        wait_exit(a.child.as_mut().unwrap(), Duration::from_secs(10)).expect("attach exits after detach");
    assert!(status.success());
    let out = with_run(&["attach", "--list"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "nothing attached");
    // The write went to the volume.
    let vol = BlockingVolume::connect(&url, Options::default()).unwrap();
    let mut b = [0u8; 512];
    vol.read_at(&mut b, 0).unwrap();
    assert_eq!(&b[..10], b"still here");
}

/// A user who is not root (here nobody, through setpriv) detaches a FUSE
/// attachment only once its file is no longer in use: until 2026-11-29 the
/// unmount went through `fusermount -u -z`, which took the mount out of
/// sight at once while the file stayed in use, and the detach waited in
/// vain for the process to end.
#[test]
fn a_user_not_root_detaches_only_a_file_not_in_use() {
    use std::io::BufRead;
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("attach-user");
    std::fs::set_permissions(&*dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (fuse, run) = (dir.join("fuse"), dir.join("run"));
    for d in [&fuse, &run] {
        std::fs::create_dir(d).unwrap();
        std::os::unix::fs::chown(d, Some(65534), Some(65534)).unwrap();
    }
    // Users open /dev/fuse themselves (fusermount3 only mounts): mode 0666,
    // as udev makes it; a container's devtmpfs may give 0600, restored after.
    struct Mode(u32);
    impl Drop for Mode {
        fn drop(&mut self) {
            let _ = std::fs::set_permissions("/dev/fuse", std::fs::Permissions::from_mode(self.0));
        }
    }
    let _mode = Mode(std::fs::metadata("/dev/fuse").unwrap().permissions().mode() & 0o7777);
    std::fs::set_permissions("/dev/fuse", std::fs::Permissions::from_mode(0o666)).unwrap();
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:16M"]);
    let nobody = |program: &str| {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", program]).env("FASTSAN_RUN_DIR", &run);
        c
    };
    // A copy that nobody can run wherever the checkout is (a 0700 home).
    let bin = dir.join("fastsan");
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = bin.to_str().unwrap();
    let child = nobody(bin)
        .args(["attach", &s.url("v"), "--fuse", fuse.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut a = Attached { child: Some(child), fuse: fuse.clone(), mnt: dir.join("mnt"), loopdev: None };
    let mut line = String::new();
    let stdout = a.child.as_mut().unwrap().stdout.take().unwrap();
    std::io::BufReader::new(stdout).read_line(&mut line).unwrap();
    assert!(line.contains("attached as"), "attach as nobody: {line:?}");
    let file = fuse.join("v");
    // The file held open by a process of that user (root may not look into
    // another user's FUSE mount).
    let mut holder =
        nobody("sh").args(["-c", &format!("exec sleep 60 < {}", file.display())]).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(holder.try_wait().unwrap().is_none(), "the holder opened the file");
    let out = nobody(bin).args(["detach", fuse.to_str().unwrap(), "--timeout", "20"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("in use"), "{err}");
    assert!(a.child.as_mut().unwrap().try_wait().unwrap().is_none(), "still attached and serving");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(mounts.contains(fuse.to_str().unwrap()), "still mounted: {mounts}");
    let _ = holder.kill();
    let _ = holder.wait();
    let out = nobody(bin).args(["detach", fuse.to_str().unwrap(), "--timeout", "20"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let status =
        wait_exit(a.child.as_mut().unwrap(), Duration::from_secs(10)).expect("attach exits after detach");
    assert!(status.success());
    assert!(!std::fs::read_to_string("/proc/mounts").unwrap().contains(fuse.to_str().unwrap()));
}

/// Any NBD server's export attaches too (here fastsan's own NBD front end):
/// unaligned writes, fsync and fallocate reach the volume, seen through BRP.
#[test]
fn an_nbd_export_attaches_as_a_file() {
    use std::os::unix::fs::FileExt;
    let dir = temp_dir("attach-nbd");
    let s =
        Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:16M", "--volume", "ro=memory:1M,ro"]);
    let url = s.nbd_url("v");
    let a = Attached::start(&url, &dir, 16 << 20);
    let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    let peek = |off: u64, len: usize| {
        let mut b = vec![0u8; len];
        vol.read_at(&mut b, off).unwrap();
        b
    };
    vol.write_at(&[9; 4096], 0, false).unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(a.file(&url)).unwrap();
    f.write_all_at(&[1; 1000], 100).unwrap();
    let big = random(3 << 20);
    f.write_all_at(&big, 5 << 20).unwrap();
    f.sync_all().unwrap();
    let back = peek(0, 4096);
    assert!(back[..100].iter().all(|&b| b == 9) && back[100..1100].iter().all(|&b| b == 1));
    assert!(back[1100..].iter().all(|&b| b == 9));
    assert!(peek(5 << 20, 3 << 20) == big, "3 MiB through the NBD export");
    let p = a.file(&url);
    ok("fallocate", &["-z", "-o", &(6u64 << 20).to_string(), "-l", "65536", p.to_str().unwrap()]);
    assert!(peek(6 << 20, 65536).iter().all(|&b| b == 0));
    drop(f);
    let (status, log) = a.stop();
    assert!(status.success(), "{log}");
    // A read-only export refuses writers.
    let ro = s.nbd_url("ro");
    let a = Attached::start(&ro, &dir.join("ro"), 1 << 20);
    let e = std::fs::OpenOptions::new().write(true).open(a.file(&ro)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    drop(a);
}
