//! The `fastsan` binary as a user runs it: serve, ls, cp, signals, kill -9.

mod common;

use common::*;
use fastsan_initiator::{BlockingVolume, Options};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn cp_128_mib_into_a_volume_and_back_is_identical() {
    let dir = temp_dir("cp");
    let src = dir.join("src.bin");
    let back = dir.join("back.bin");
    let data = random_file(&src, 128 << 20);
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "big=memory:128M"]);
    let out = fastsan(&["cp", src.to_str().unwrap(), &s.url("big")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.contains("copied 128.00 MiB") && line.contains("MiB/s"), "{line}");
    let out = fastsan(&["cp", &s.url("big"), back.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&back).unwrap() == data, "bytes differ after the round trip");
    // Too big for the volume: a clear error, nothing sent.
    let huge = dir.join("huge.bin");
    std::fs::File::create(&huge).unwrap().set_len((128 << 20) + 512).unwrap();
    let out = fastsan(&["cp", huge.to_str().unwrap(), &s.url("big")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds only"));
}

/// Copies that cannot be what was meant are refused before anything is
/// opened for writing: a file onto itself (it was truncated, then read as
/// empty), two local files, a URL of a scheme cp does not speak (it was
/// taken for a file's name), a volume onto itself, a chunk off the
/// volume's blocks (it failed at the second chunk, the first written).
#[test]
fn cp_refuses_copies_that_would_lose_data_and_says_why() {
    let dir = temp_dir("cp-refused");
    let file = dir.join("same.bin");
    let data = random_file(&file, 3_000_000);
    let path = file.to_str().unwrap();
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:8M"]);
    let vol = s.url("v");
    let dotted = format!("{}/./same.bin", dir.display());
    let cases: &[(&[&str], &str)] = &[
        (&["cp", path, path], "both"),
        (&["cp", path, &dotted], "use cp(1)"),
        (&["cp", path, "htp://x/y"], "cp does not take htp:// URLs"),
        (&["cp", path, "nvme+tcp://127.0.0.1:4420/nqn.x/1"], "cp does not take nvme+tcp:// URLs"),
        (&["cp", &vol, &vol], "both the source and the destination"),
        (&["cp", path, &vol, "--chunk", "1000"], "not a multiple of"),
        (&["cp", path, &vol, "--in-place"], "--in-place is for a destination file"),
    ];
    for (args, needle) in cases {
        let out = fastsan(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    assert!(std::fs::read(&file).unwrap() == data, "the file is as it was");
    let v = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    let mut got = vec![1u8; 1 << 20];
    v.read_at(&mut got, 0).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing was written to the volume");
}

/// A copy is reported only when it was made: a source that is no file, device or
/// stream (a directory) is refused; a target whose socket breaks in the handshake
/// is an error (the broken pipe was taken for a closed stdout: exit 0, nothing
/// copied); a block device is copied whole in both directions (its size read as
/// 0 before).
#[test]
fn cp_never_reports_a_copy_it_did_not_make() {
    let dir = temp_dir("cp-made");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:4M", "--volume", "w=memory:4M"]);
    let out = fastsan(&["cp", dir.to_str().unwrap(), &s.url("v")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is a directory"), "{err}");
    // An NBD server that greets and hangs up: the client's next write breaks.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let greeter = std::thread::spawn(move || {
        for _ in 0..2 {
            use std::io::Write;
            let (mut c, _) = l.accept().unwrap();
            let mut g = b"NBDMAGIC".to_vec();
            g.extend_from_slice(&0x49484156454F5054u64.to_be_bytes());
            g.extend_from_slice(&3u16.to_be_bytes());
            c.write_all(&g).unwrap();
        }
    });
    let file = dir.join("f.bin");
    random_file(&file, 1 << 20);
    let back = dir.join("back.bin");
    for (src, dst) in [
        (file.to_str().unwrap(), format!("nbd://{addr}/x")),
        (&format!("nbd://{addr}/x")[..], back.display().to_string()),
    ] {
        let out = fastsan(&["cp", src, &dst]);
        assert!(!out.status.success(), "cp {src} {dst} succeeded: {}", String::from_utf8_lossy(&out.stdout));
        assert!(!String::from_utf8_lossy(&out.stderr).is_empty());
    }
    greeter.join().unwrap();
    assert!(!back.exists(), "no file for a copy that did not happen");
    // A block device, both ways.
    let img = dir.join("dev.img");
    std::fs::File::create(&img).unwrap().set_len(4 << 20).unwrap();
    let dev = LoopDev::over(&img);
    let data = random_file(&file, 4 << 20);
    let out = fastsan(&["cp", file.to_str().unwrap(), &s.url("v")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = fastsan(&["cp", &s.url("v"), &dev.0]);
    assert!(out.status.success(), "to {}: {}", dev.0, String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&img).unwrap() == data, "the device holds the volume");
    let out = fastsan(&["cp", &dev.0, &s.url("w")]);
    assert!(out.status.success(), "from {}: {}", dev.0, String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("(4194304 bytes)"), "not as 0 bytes");
    assert!(fastsan(&["cp", &s.url("w"), back.to_str().unwrap()]).status.success());
    assert!(std::fs::read(&back).unwrap() == data, "the device copied whole");
    // A device too small for the volume: refused before anything is written.
    let small = dir.join("small.img");
    std::fs::File::create(&small).unwrap().set_len(1 << 20).unwrap();
    let small_dev = LoopDev::over(&small);
    let out = fastsan(&["cp", &s.url("v"), &small_dev.0]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("holds only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A target with volumes `bad` (a read error at 2 MiB), `good` and `own`,
/// a file in `dir` (returned with its bytes): what a copy to a file meets.
fn serve_bad_good_own(dir: &Path) -> (Served, std::path::PathBuf, Vec<u8>) {
    let own = dir.join("own.img");
    let own_data = random_file(&own, 4 << 20);
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--volume",
        "bad=memory:4M,faults=read:eio@2M-3M",
        "--volume",
        "good=memory:4M",
        "--volume",
        &format!("own=file:{}", own.display()),
    ]);
    (s, own, own_data)
}

/// A local destination file is replaced only by a whole, flushed copy: a
/// copy that fails half-way (a read error at 2 MiB) leaves it as it was,
/// with its permissions and no temporary file behind; through a symbolic
/// link the linked file is replaced. A file a target serves is not
/// replaced at all (the target would go on serving the old one, and lose
/// every write made there at its next start; before, the file was
/// truncated and the volume's data destroyed).
#[test]
fn cp_replaces_a_file_only_with_a_whole_copy() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("cp-replace");
    let backup = dir.join("backup.img");
    let old = random_file(&backup, 3_000_000);
    std::fs::set_permissions(&backup, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (s, own, own_data) = serve_bad_good_own(&dir);
    let listing = |d: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        v.sort();
        v
    };
    let before = listing(&dir);
    let out = fastsan(&["cp", &s.url("bad"), backup.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is as it was"), "{err}");
    assert!(std::fs::read(&backup).unwrap() == old, "the backup is untouched");
    assert_eq!(listing(&dir), before, "no temporary file left behind");
    // A whole copy replaces it, keeping its permissions, through a link.
    let link = dir.join("link.img");
    std::os::unix::fs::symlink(&backup, &link).unwrap();
    let src = dir.join("src.bin");
    let data = random_file(&src, 4 << 20);
    assert!(fastsan(&["cp", src.to_str().unwrap(), &s.url("good")]).status.success());
    let out = fastsan(&["cp", &s.url("good"), link.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays a link");
    assert!(std::fs::read(&backup).unwrap() == data, "the linked file holds the copy");
    assert_eq!(std::fs::metadata(&backup).unwrap().permissions().mode() & 0o777, 0o640);
    // A file a target serves (here the volume's own): refused, untouched.
    let out = fastsan(&["cp", &s.url("own"), own.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is in use: a fastsan target serves it"), "{err}");
    assert!(std::fs::read(&own).unwrap() == own_data);
    let out = fastsan(&["cp", src.to_str().unwrap(), &s.url("own")]);
    assert!(out.status.success(), "the volume itself takes it: {}", String::from_utf8_lossy(&out.stderr));
    // A whole volume read and thrown away (/dev/null) is a copy too.
    let out = fastsan(&["cp", &s.url("good"), "/dev/null"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `fastsan cp ARGS` with `input` on its standard input; its output.
fn cp_piped(args: &[&str], input: Vec<u8>) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut c = Command::new(BIN)
        .arg("cp")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = c.stdin.take().unwrap();
    // (A copy that refuses the stream stops reading it: a broken pipe here.)
    let feeder = std::thread::spawn(move || drop(stdin.write_all(&input)));
    let out = c.wait_with_output().unwrap();
    feeder.join().unwrap();
    out
}

/// A stream is copied in order: standard input, of a length that ends inside a
/// block, into a volume (the rest of that block and of the volume as they were,
/// and said so), the volume out to standard output (the report beside it, on
/// stderr, even when stdout is named by its path), a named pipe in, /dev/zero
/// filling a volume. A stream longer than the volume, an empty one, or a reader
/// that goes away, is an error, never a copy cut short in silence. (A stream was
/// refused before: it has no size.)
#[test]
fn cp_streams_through_standard_input_output_and_pipes() {
    use std::io::Read;
    let dir = temp_dir("cp-stream");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:4M", "--volume", "w=memory:4M"]);
    let v = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    v.write_at(&vec![0xff; 4 << 20], 0, false).unwrap();
    let data = random_file(&dir.join("data"), 3_000_100);
    let out = cp_piped(&["-", &s.url("v"), "--chunk", "64K"], data.clone());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("(3000100 bytes) from standard input"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ended after 3000100 bytes; the 1194204 bytes"),
        "a short stream is pointed out: {err}"
    );
    for to in ["-", "/dev/stdout"] {
        let out = cp_piped(&[&s.url("v"), to], Vec::new());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout.len(), 4 << 20, "the whole volume, and nothing else, on stdout ({to})");
        assert!(out.stdout[..data.len()] == data[..], "the stream's bytes, in order");
        assert!(out.stdout[data.len()..].iter().all(|&b| b == 0xff), "the volume's other bytes as they were");
        assert!(String::from_utf8_lossy(&out.stderr).contains("copied 4.00 MiB"), "the report on stderr");
    }
    // Longer than the volume: an error that says so; from a file on
    // standard input, before anything is written.
    let out = cp_piped(&["-", &s.url("w")], vec![7; (4 << 20) + 1]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("holds more than the 4194304 bytes"), "{err}");
    let big = dir.join("big");
    random_file(&big, (4 << 20) + 1);
    let out = Command::new(BIN)
        .args(["cp", "-", &s.url("v")])
        .stdin(std::fs::File::open(&big).unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("holds only 4194304"), "{err}");
    // Nothing at all (a pipe whose writer failed, /dev/null): not a copy.
    let out = cp_piped(&["-", &s.url("v")], Vec::new());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("standard input was empty"), "{err}");
    let out = fastsan(&["cp", "/dev/null", &s.url("v")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("/dev/null was empty"), "{err}");
    let mut got = vec![0u8; 4 << 20];
    v.read_at(&mut got, 0).unwrap();
    assert!(got[..data.len()] == data[..], "the volume untouched by the refused copies");
    // A named pipe, opened before its writer.
    let fifo = dir.join("fifo");
    ok("mkfifo", &[fifo.to_str().unwrap()]);
    let piped = data[..1 << 20].to_vec();
    let writer = {
        let (fifo, piped) = (fifo.clone(), piped.clone());
        std::thread::spawn(move || {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            use std::os::unix::io::AsRawFd;
            // Opened without waiting (ENXIO until cp opens it to read), so
            // that a cp that never does fails the test instead of hanging it.
            std::thread::sleep(Duration::from_millis(300));
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut f = loop {
                match std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&fifo) {
                    Ok(f) => break f,
                    Err(e) if e.raw_os_error() == Some(libc::ENXIO) && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => panic!("cp never opened the pipe: {e}"),
                }
            };
            // SAFETY: clears O_NONBLOCK on a descriptor this thread owns.
            unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, 0) };
            f.write_all(&piped).unwrap();
        })
    };
    let out = fastsan(&["cp", fifo.to_str().unwrap(), &s.url("w")]);
    writer.join().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let w = BlockingVolume::connect(&s.url("w"), Options::default()).unwrap();
    let mut got = vec![0u8; 1 << 20];
    w.read_at(&mut got, 0).unwrap();
    assert!(got == piped, "the pipe's bytes");
    // A character device fills the volume.
    let out = fastsan(&["cp", "/dev/zero", &s.url("v")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut got = vec![1u8; 4 << 20];
    v.read_at(&mut got, 0).unwrap();
    assert!(got.iter().all(|&b| b == 0), "zeros to the end");
    // A reader that stops after 10 bytes: the copy failed, and says so.
    let mut c = Command::new(BIN)
        .args(["cp", &s.url("w"), "-"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    c.stdout.take().unwrap().read_exact(&mut first).unwrap();
    let out = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("standard output got part of the copy"), "{err}");
}

/// --in-place writes the destination file itself: its hard links see the copy,
/// and it is cut to the volume's length; a copy that fails says the file holds
/// part of it; a file a target serves is refused all the same.
#[test]
fn cp_in_place_writes_the_file_itself() {
    use std::os::unix::fs::MetadataExt;
    let dir = temp_dir("cp-in-place");
    let (s, own, own_data) = serve_bad_good_own(&dir);
    let src = dir.join("src.bin");
    let data = random_file(&src, 4 << 20);
    assert!(fastsan(&["cp", src.to_str().unwrap(), &s.url("good")]).status.success());
    let file = dir.join("f.img");
    random_file(&file, 6 << 20);
    let link = dir.join("link.img");
    std::fs::hard_link(&file, &link).unwrap();
    let ino = std::fs::metadata(&file).unwrap().ino();
    let out = fastsan(&["cp", "--in-place", &s.url("good"), file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::metadata(&file).unwrap().ino(), ino, "the same file");
    assert!(std::fs::read(&link).unwrap() == data, "its other name sees the copy, cut to the volume's size");
    let out = fastsan(&["cp", "--in-place", &s.url("bad"), file.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("f.img holds part of the copy"), "{err}");
    let out = fastsan(&["cp", "--in-place", &s.url("good"), own.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("a fastsan target serves it"), "{err}");
    assert!(std::fs::read(&own).unwrap() == own_data, "the served file is untouched");
    let new = dir.join("new.img");
    let out = fastsan(&["cp", "--in-place", &s.url("good"), new.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&new).unwrap() == data, "a new file made in place");
}

/// A source shorter than the volume's last block leaves the rest of that
/// block as it was (it was padded with zeros, wiping what followed: a boot
/// loader copied onto a disk took its partition table).
#[test]
fn cp_of_a_partial_block_keeps_the_rest_of_the_block() {
    let dir = temp_dir("cp-tail");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:1M"]);
    let v = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    v.write_at(&[0xff; 4096], 0, false).unwrap();
    let src = dir.join("boot.bin");
    let data = random_file(&src, 1000);
    let out = fastsan(&["cp", src.to_str().unwrap(), &s.url("v")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut got = vec![0u8; 4096];
    v.read_at(&mut got, 0).unwrap();
    assert!(got[..1000] == data[..], "the source's bytes");
    assert!(got[1000..].iter().all(|&b| b == 0xff), "the block's other bytes are as they were");
}

/// A job the volume cannot run is refused at once, not run for its whole
/// runtime collecting errors (writes to a read-only volume) or quietly
/// shrunk (a --size past the end).
#[test]
fn bench_refuses_jobs_the_volume_cannot_run() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "r=memory:8M,ro"]);
    let brp = s.url("r");
    let nbd = format!("nbd://{}/r", s.nbd);
    let cases: &[(&[&str], &str)] = &[
        (&["bench", &brp, "--rw", "randwrite"], "is read-only: this job writes"),
        (&["bench", &nbd, "--rw", "randrw", "--rwmixread", "90"], "is read-only: this job writes"),
        (&["bench", &brp, "--size", "16M"], "--size 16777216: the volume has 8388608 bytes"),
    ];
    for (args, needle) in cases {
        let out = fastsan(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // What it can run, it runs: reads of the read-only volume.
    let out =
        fastsan(&["bench", &nbd, "--rw", "randrw", "--rwmixread", "100", "--runtime", "0.2", "--ramp", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `--fua` writes are FUA and `--fsync N` sends a FLUSH every N writes, over
/// each protocol: a volume whose flushes fail fails such writes (FUA is a
/// write then a flush there) and such jobs, and serves plain writes.
#[test]
fn bench_sends_fua_writes_and_flushes_when_asked() {
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--nvme",
        "127.0.0.1:0",
        "--nvme-nqn",
        "nqn.2026-11.io.fastsan:t",
        "--volume",
        "ok=memory:8M",
        "--volume",
        "bad=memory:8M,faults=flush:eio",
    ]);
    let nvme = |ns: u32| format!("nvme+tcp://{}/nqn.2026-11.io.fastsan:t/{ns}", s.nvme);
    let urls = |vol: &str, ns: u32| [s.url(vol), format!("nbd://{}/{vol}", s.nbd), nvme(ns)];
    let bench = |url: &str, extra: &[&str]| {
        let mut args =
            vec!["bench", url, "--rw", "randwrite", "--iodepth", "4", "--runtime", "0.3", "--ramp", "0"];
        args.extend_from_slice(extra);
        args.push("--json");
        fastsan(&args)
    };
    for url in urls("ok", 1) {
        let out = bench(&url, &["--fsync", "4"]);
        assert!(out.status.success(), "{url}: {}", String::from_utf8_lossy(&out.stderr));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let (writes, flushes) = (r["writes"].as_u64().unwrap(), r["flushes"].as_u64().unwrap());
        assert!(
            writes > 100 && (flushes * 4).abs_diff(writes) <= 32,
            "{url}: {writes} writes, {flushes} flushes"
        );
        let out = bench(&url, &["--fua"]);
        assert!(out.status.success(), "{url}: {}", String::from_utf8_lossy(&out.stderr));
    }
    for url in urls("bad", 2) {
        assert!(bench(&url, &[]).status.success(), "{url}: plain writes need no flush");
    }
    // Once a flush failed, every request of the volume fails, plain writes too.
    for url in urls("bad", 2) {
        for extra in [&["--fua"][..], &["--fsync", "4"], &[]] {
            let out = bench(&url, extra);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains("requests failed"), "{url} {extra:?}: {err}");
        }
    }
}

/// A target whose log nobody reads (a pipe left full: a supervisor that
/// stopped draining it) goes on serving. Until 2026-11-29 each line was
/// written where it was made, so after 64 KiB of warnings the worker
/// threads stopped at their next line, and every client with them.
#[test]
fn a_log_nobody_reads_never_stops_the_target() {
    // (Served pipes stderr and reads it only at a signal: nobody reads it here.)
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--volume",
        "ok=memory:8M",
        "--volume",
        "bad=memory:8M,faults=write:eio",
    ]);
    let bad = format!("nbd://{}/bad", s.nbd);
    let bench = |url: &str| {
        fastsan(&[
            "bench",
            url,
            "--rw",
            "randwrite",
            "--jobs",
            "4",
            "--iodepth",
            "8",
            "--runtime",
            "0.3",
            "--ramp",
            "0",
            "--request-timeout",
            "5",
            "--reconnect-timeout",
            "5",
        ])
    };
    // Each connection logs its first 64 device errors: ~20 KiB; 4 per run.
    for _ in 0..4 {
        let out = bench(&bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("requests failed") && !err.contains("no reply"), "{err}");
    }
    for url in [format!("nbd://{}/ok", s.nbd), s.url("ok")] {
        let out = bench(&url);
        assert!(out.status.success(), "{url}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn ls_lists_volumes_with_sizes_and_default_volume_exists() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "a=memory:64M", "--volume", "n=null:2G,ro"]);
    let out = fastsan(&["ls", &format!("brp://{}", s.addr)]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let a = text.lines().find(|l| l.starts_with("a ")).unwrap_or_else(|| panic!("{text}"));
    assert!(a.contains("67108864") && a.contains("64.00 MiB"), "{a}");
    let n = text.lines().find(|l| l.starts_with("n ")).unwrap();
    assert!(n.contains("2.00 GiB") && n.contains("read-only"), "{n}");
    // A URL that names a volume lists it alone; one the target lacks is an error.
    let out = fastsan(&["ls", &s.url("n")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.lines().count() == 2 && text.contains("\nn "), "{text}");
    let out = fastsan(&["ls", &s.url("nope")]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the target lists no volume \"nope\""));
    // The same volumes as NBD exports.
    let out = fastsan(&["ls", &format!("nbd://{}", s.nbd)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = text.lines().find(|l| l.starts_with("a ")).unwrap_or_else(|| panic!("{text}"));
    assert!(a.contains("67108864") && !a.contains("read-only"), "{a}");
    let n = text.lines().find(|l| l.starts_with("n ")).unwrap_or_else(|| panic!("{text}"));
    assert!(n.contains("2.00 GiB") && n.contains("read-only"), "{n}");
    let out = fastsan(&["ls", &s.nbd_url("n")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.lines().count() == 2 && text.contains("\nn "), "{text}");
    let out = fastsan(&["ls", &s.nbd_url("nope")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no such volume"), "{err}");
    drop(s);
    let d = Served::start(&["--brp", "127.0.0.1:0"]);
    let out = fastsan(&["ls", &format!("brp://{}", d.addr)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l.starts_with("vol0 ") && l.contains("1.00 GiB")), "{text}");
}

/// `fastsan ls nbd://` lists another server's exports (qemu-nbd's), as
/// nbdinfo --list does.
#[test]
fn ls_lists_the_exports_of_any_nbd_server() {
    let dir = temp_dir("ls-nbd");
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(3 << 20).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut qemu = Command::new("qemu-nbd")
        .args(["-f", "raw", "-r", "-t", "-b", "127.0.0.1", "-p", &port, "-x", "disk"])
        .arg(&img)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("qemu-nbd (qemu-utils) runs");
    let url = format!("nbd://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = fastsan(&["ls", &url]);
        if out.status.success() || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = qemu.kill();
    let _ = qemu.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let disk = text.lines().find(|l| l.starts_with("disk ")).unwrap_or_else(|| panic!("{text}"));
    assert!(disk.contains("3145728") && disk.contains("read-only"), "{disk}");
}

/// `fastsan ls | head -0` and the like: output to a reader that has gone
/// ends the command quietly, never with a panic.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "a=memory:64M"]);
    let url = format!("brp://{}", s.addr);
    let runs: [&[&str]; 2] = [&["ls", &url], &["bench", &format!("{url}/a"), "--runtime", "0.2", "--json"]];
    for args in runs {
        let mut child = std::process::Command::new(common::BIN)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader leaves before anything is written
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // An error nobody reads is still exit code 1, not a panic's 101.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader); // gone before anything is written
    let status = std::process::Command::new(common::BIN)
        .args(["cp", "/nonexistent/file", "brp://127.0.0.1:1/v"])
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1), "an error with stderr closed: {status:?}");
    // A target whose log reader has gone (`fastsan serve 2>&1 | tee log`,
    // tee killed) goes on serving, and stops cleanly on SIGTERM.
    let mut t = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:4M"]);
    drop(t.child.stderr.take());
    let dir = temp_dir("closed-log");
    let (src, back) = (dir.join("src"), dir.join("back"));
    let data = random_file(&src, 4 << 20);
    for (from, to) in [(src.display().to_string(), t.url("v")), (t.url("v"), back.display().to_string())] {
        let out = fastsan(&["cp", &from, &to]);
        assert!(out.status.success(), "cp {from} {to}: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(std::fs::read(&back).unwrap() == data, "the bytes written are the bytes read");
    let (status, _) = t.signal("TERM");
    assert!(status.success(), "{status:?}");
}

#[test]
fn file_volume_data_survives_kill_9_and_restart() {
    let dir = temp_dir("kill9");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let spec = format!("v={}", format_args!("file:{}", img.display()));
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
    let addr = s.addr.clone();
    let expect: Vec<(u64, Vec<u8>)> =
        (0..32u64).map(|i| (i * (2 << 20) + 4096, vec![(i * 7 + 1) as u8; 256 * 1024])).collect();
    {
        let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
        for (off, d) in &expect[..31] {
            vol.write_at(d, *off, false).unwrap();
        }
        vol.flush().unwrap();
        let (off, d) = &expect[31];
        vol.write_at(d, *off, true).unwrap(); // FUA: durable without a flush
    }
    let (status, _) = s.signal("KILL");
    assert!(!status.success());
    let s = Served::start(&["--brp", &addr, "--volume", &spec]);
    let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    for (off, d) in &expect {
        let mut got = vec![0u8; d.len()];
        vol.read_at(&mut got, *off).unwrap();
        assert!(got == *d, "data at {off} lost");
    }
    drop(vol);
    drop(s);
}

#[test]
fn sigterm_drains_flushes_and_exits_cleanly() {
    let dir = temp_dir("term");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
    let spec = format!("v=file:{}", img.display());
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
    let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
    vol.write_at(&[5; 8192], 0, false).unwrap();
    let (status, log) = s.signal("TERM");
    assert!(status.success(), "{log}");
    assert!(log.contains("SIGTERM received") && log.contains("flushed") && log.contains("stopped"), "{log}");
    assert_eq!(&std::fs::read(&img).unwrap()[..8192], &[5; 8192][..]);
    // A volume that cannot be flushed: the target says so and exits non-zero,
    // and the failure is recorded in the run directory too.
    let spec = format!("v=file:{},faults=flush:eio", img.display());
    let run = dir.join("run");
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec, "--run-dir", run.to_str().unwrap()]);
    let (status, log) = s.signal("TERM");
    assert!(!status.success(), "{log}");
    assert!(log.contains("flush at shutdown failed") && log.contains("could not flush volume(s) v"), "{log}");
    let records: Vec<_> = std::fs::read_dir(run.join("failed-flushes")).unwrap().collect();
    let text = std::fs::read_to_string(records[0].as_ref().unwrap().path()).unwrap();
    assert!(records.len() == 1 && text == format!("1\n{}\n", img.display()), "{text}");
}

/// A stop held up by a stalled device says so while it waits, exits
/// non-zero once --drain-timeout has passed (the request left unanswered),
/// and a second signal ends it at once.
#[test]
fn a_stop_held_up_by_a_stalled_device_is_bounded_and_says_so() {
    for second_signal in [false, true] {
        let drain = if second_signal { "60" } else { "6" };
        let s = Served::start(&[
            "--brp",
            "127.0.0.1:0",
            "--drain-timeout",
            drain,
            "--volume",
            "v=memory:1M,faults=read:stall",
        ]);
        let url = s.url("v");
        // A read that never ends, in a thread of its own (left behind).
        std::thread::spawn(move || {
            let opts = Options { reconnect_timeout: Duration::from_secs(1), ..Default::default() };
            let v = BlockingVolume::connect(&url, opts).unwrap();
            let _ = v.read_at(&mut [0u8; 4096], 0);
        });
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        let pid = s.child.id().to_string();
        if second_signal {
            assert!(Command::new("kill").args(["-s", "TERM", &pid]).status().unwrap().success());
            std::thread::sleep(Duration::from_millis(500));
        }
        let (status, log) = s.signal(if second_signal { "INT" } else { "TERM" });
        assert_eq!(status.code(), Some(1), "{log}");
        if second_signal {
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
            assert!(log.contains("second signal: exiting now"), "{log}");
        } else {
            assert!(
                t.elapsed() >= Duration::from_secs(6),
                "left before the drain timeout: {:?}",
                t.elapsed()
            );
            assert!(log.contains("still finishing in-flight requests"), "{log}");
            assert!(log.contains("still had requests running after 6s"), "{log}");
        }
    }
    // A flush that never ends: given up after the drain timeout, and the
    // process exits (the runtime waited for the flush's thread for ever).
    let dir = temp_dir("stop-flush");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(1 << 20).unwrap();
    let spec = format!("v=file:{},faults=flush:stall", img.display());
    let s = Served::start(&["--brp", "127.0.0.1:0", "--drain-timeout", "2", "--volume", &spec]);
    let t = Instant::now();
    let (status, log) = s.signal("TERM");
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("did not finish within 2s") && log.contains("could not flush volume(s) v"), "{log}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// A RUST_LOG that does not parse keeps the default log and says so (it
/// silenced every line).
#[test]
fn a_bad_rust_log_is_said_not_obeyed() {
    let out = Command::new(env!("CARGO_BIN_EXE_fastsan"))
        .args(["ls", "brp://127.0.0.1:1"])
        .env("RUST_LOG", "verbose=loud")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a log filter") && err.contains("Connection refused"), "{err}");
    // A filter that parses but turns on nothing of fastsan's is pointed out
    // (its own warning would be silenced by it); one that does is not.
    for (filter, said) in
        [("verbose", true), ("rustls=debug", true), ("debug", false), ("fastsan_initiator=info", false)]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_fastsan"))
            .args(["ls", "brp://127.0.0.1:1"])
            .env("RUST_LOG", filter)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.contains("names no level and no fastsan module"), said, "{filter}: {err}");
    }
}

/// A volume given by flag replaces the config file's volume of the same
/// name (it was "given twice"), the file's others stay.
#[test]
fn a_flag_overrides_the_config_files_volume_of_the_same_name() {
    let dir = temp_dir("override");
    let conf = dir.join("f.toml");
    std::fs::write(&conf, "volumes = [\"a=memory:4M\", \"b=memory:1M\"]\n").unwrap();
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--config",
        conf.to_str().unwrap(),
        "--volume",
        "a=memory:8M",
    ]);
    let out = fastsan(&["ls", &format!("brp://{}", s.addr)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("8388608") && !text.contains("4194304") && text.contains("1048576"), "{text}");
    // ls at an NBD port says what answers there.
    let out = fastsan(&["ls", &format!("brp://{}", s.nbd)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("use nbd://"), "{err}");
}

#[test]
fn bad_command_lines_get_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve", "--volume", "nonsense"], "missing '='"),
        (&["serve", "--volume", "a=memory:12Q"], "size"),
        (&["serve", "--brp", "0.0.0.0:0"], "requires authentication"),
        (&["serve", "--brp", "127.0.0.1:0", "--volume", "a=file:/nonexistent/x.img"], "/nonexistent/x.img"),
        (
            &["serve", "--brp", "127.0.0.1:0", "--volume", "a=memory:1M", "--volume", "a=null:1M"],
            "given twice",
        ),
        (&["cp", "/nonexistent/file", "brp://127.0.0.1:1/v"], "/nonexistent/file"),
        (&["ls", "http://x"], "brp://"),
        (&["cp", "a", "b", "--merge", "sometimes"], "possible values: off, adaptive, always"),
        (&["serve", "--brp", "127.0.0.1:0", "--max-connections", "0"], "max connections must be at least 1"),
        (&["serve", "--brp", "127.0.0.1:0", "--max-handshakes", "0"], "max handshakes must be at least 1"),
        (
            &["serve", "--brp", "127.0.0.1:0", "--handshake-timeout", "0"],
            "handshake timeout must be more than 0",
        ),
        (&["serve", "--brp", "127.0.0.1:0", "--stall-timeout", "0"], "stall timeout must be more than 0"),
        (
            &["serve", "--brp", "127.0.0.1:0", "--memory-budget", "1M"],
            "memory budget must be at least 128 MiB",
        ),
        (
            &["bench", "brp://127.0.0.1:1/v", "--request-timeout", "0"],
            "--request-timeout must be more than 0",
        ),
        (&["bench", "brp://127.0.0.1:1/v", "--threads", "0"], "0 is not in 1..=1024"),
        (&["bench", "brp://127.0.0.1:1/v", "--runtime", "0"], "--runtime must be more than 0 seconds"),
        (&["bench", "nbd://127.0.0.1:1/v", "--connections", "4"], "--connections does not apply to nbd"),
        (&["bench", "nvme+tcp://127.0.0.1:1/nqn.x", "--merge", "off"], "--merge does not apply to nvme+tcp"),
        (&["bench", "nbd://127.0.0.1:1/v", "--digests"], "--digests does not apply to nbd"),
        (&["bench", "brp://127.0.0.1:1/v", "--verify"], "act on writes; this job only reads"),
        (&["bench", "brp://127.0.0.1:1/v", "--rw", "read", "--fsync", "4"], "act on writes"),
        (&["bench", "brp://127.0.0.1:1/v", "--rw", "randwrite", "--rwmixread", "70"], "--rw randrw"),
        (&["attach", "--list", "brp://127.0.0.1:1/v"], "cannot be used with"),
        (&["attach", "nbd://127.0.0.1:1/v", "--device-timeout", "3"], "only a brp:// session orders"),
        (&["attach", "brp://127.0.0.1:1/v", "--metrics", "0.0.0.0:9100"], "--metrics-allow-remote"),
        (&["ls", "brp://127.0.0.1:1", "--connections", "4"], "unexpected argument '--connections'"),
    ];
    let dir = temp_dir("badconf");
    let zero = dir.join("zero.toml");
    std::fs::write(&zero, "brp = \"127.0.0.1:0\"\nhandshake_timeout_ms = 0\nmax_connections = 0\n").unwrap();
    let zero_args = ["serve", "--config", zero.to_str().unwrap()];
    let empty = dir.join("empty.img");
    std::fs::File::create(&empty).unwrap();
    let empty_vol = format!("e=file:{}", empty.display());
    let empty_args = ["serve", "--brp", "127.0.0.1:0", "--volume", &empty_vol];
    let drain_args = ["serve", "--brp", "127.0.0.1:0", "--drain-timeout", "0"];
    let cases = cases.iter().copied().chain([
        (&zero_args[..], "handshake timeout must be more than 0"),
        (&empty_args[..], "less than one 512-byte block: give it a size with `truncate -s SIZE"),
        (&drain_args[..], "drain timeout must be more than 0"),
    ]);
    for (args, needle) in cases {
        let out = fastsan(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn help_explains_each_subcommand() {
    for (sub, needle) in
        [("serve", "NAME=memory:SIZE"), ("ls", "brp://HOST"), ("cp", "brp://HOST:PORT/VOLUME")]
    {
        let out = fastsan(&[sub, "--help"]);
        assert!(out.status.success());
        assert!(String::from_utf8_lossy(&out.stdout).contains(needle), "{sub} --help");
    }
}

#[test]
fn bench_measures_and_verifies_over_brp_and_nbd() {
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:64M"]);
    for url in [s.url("v"), s.nbd_url("v")] {
        let out = fastsan(&[
            "bench",
            &url,
            "--rw",
            "randrw",
            "--bs",
            "8k",
            "--iodepth",
            "8",
            "--jobs",
            "2",
            "--runtime",
            "0.5",
            "--ramp",
            "0",
            "--size",
            "4M",
            "--verify",
            "--json",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{url}: {text} {}", String::from_utf8_lossy(&out.stderr));
        let get = |k: &str| -> f64 {
            let at =
                text.find(&format!("\"{k}\": ")).unwrap_or_else(|| panic!("{k} in {text}")) + k.len() + 4;
            text[at..].split([',', '\n']).next().unwrap().trim().parse().unwrap()
        };
        assert!(get("reads") > 0.0 && get("writes") > 0.0, "{text}");
        assert_eq!(get("verify_mismatches"), 0.0);
        assert_eq!(get("errors"), 0.0);
        assert!(get("lat_p99_us") >= get("lat_p50_us") && get("lat_p50_us") > 0.0, "{text}");
        assert_eq!(get("requesters"), 16.0);
        // A thread per job, as fio runs them, at most one per CPU.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(get("client_threads"), 2.min(cpus) as f64, "{text}");
    }
    let out = fastsan(&["bench", &s.url("v"), "--threads", "3", "--runtime", "0.2", "--ramp", "0", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("\"client_threads\": 3,"), "{text}");
    // A bad URL or size is a clear error.
    let out = fastsan(&["bench", "http://x", "--runtime", "0.1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("brp://"));
    let out = fastsan(&["bench", &s.url("v"), "--bs", "1000"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("multiple of 512"));
}

/// kill -9 of the target in the middle of a write load with FLUSH and FUA,
/// restart, verify: every write acknowledged and then flushed (or written
/// with FUA) is there, in every round. Rounds: `FASTSAN_KILL9_ROUNDS`
/// (default 20; docs/faults.md records a run of 100).
#[test]
fn kill_9_during_a_write_load_loses_no_flushed_write() {
    use rand::{Rng, SeedableRng};
    use std::sync::{Arc, Mutex};
    const WRITERS: u64 = 8;
    const BLOCKS: u64 = 256; // per writer
    const BS: u64 = 4096;
    let rounds: u64 = std::env::var("FASTSAN_KILL9_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let dir = temp_dir("kill9-rounds");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(WRITERS * BLOCKS * BS).unwrap();
    let spec = format!("v=file:{}", img.display());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Per block: the version known durable, and the newest version sent.
    let state: Arc<Mutex<Vec<(u64, u64)>>> = Arc::new(Mutex::new(vec![(0, 0); (WRITERS * BLOCKS) as usize]));
    let block = |w: u64, b: u64, version: u64| -> Vec<u8> {
        let mut v = Vec::with_capacity(BS as usize);
        while v.len() < BS as usize {
            v.extend_from_slice(&(w * BLOCKS + b).to_le_bytes());
            v.extend_from_slice(&version.to_le_bytes());
        }
        v
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (mut lost, mut checked) = (0u64, 0u64);
    for round in 0..rounds {
        let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
        let url = s.url("v");
        // The load: each writer writes versioned blocks of its own; every few
        // writes a FLUSH, or a FUA write. No reconnection: the kill ends it.
        let opts = Options { reconnect_timeout: std::time::Duration::ZERO, ..Default::default() };
        let vol = rt.block_on(fastsan_initiator::Volume::connect(&url, opts)).unwrap();
        let tasks: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (vol, state) = (vol.clone(), state.clone());
                let seed = round * 100 + w;
                rt.spawn(async move {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                    let mut unflushed: Vec<(usize, u64)> = Vec::new();
                    loop {
                        let b = rng.gen_range(0..BLOCKS);
                        let i = (w * BLOCKS + b) as usize;
                        let version = {
                            let mut st = state.lock().unwrap();
                            st[i].1 += 1;
                            st[i].1
                        };
                        let fua = rng.gen_bool(0.1);
                        if vol.write_at(&block(w, b, version), i as u64 * BS, fua).await.is_err() {
                            return;
                        }
                        if fua {
                            let mut st = state.lock().unwrap();
                            st[i].0 = st[i].0.max(version);
                        } else {
                            unflushed.push((i, version));
                        }
                        if rng.gen_bool(0.15) {
                            if vol.flush().await.is_err() {
                                return;
                            }
                            let mut st = state.lock().unwrap();
                            for (i, v) in unflushed.drain(..) {
                                st[i].0 = st[i].0.max(v);
                            }
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(rng.gen_range(100..400)));
        let (status, _) = s.signal("KILL");
        assert!(!status.success());
        for t in tasks {
            rt.block_on(t).unwrap();
        }
        drop(vol);
        // Restart and verify: each block holds its durable version or a newer one sent.
        let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
        let vol = BlockingVolume::connect(&s.url("v"), Options::default()).unwrap();
        let mut all = vec![0u8; (WRITERS * BLOCKS * BS) as usize];
        vol.read_at(&mut all, 0).unwrap();
        let st = state.lock().unwrap();
        for (i, &(durable, sent)) in st.iter().enumerate() {
            if sent == 0 {
                continue;
            }
            let at = i * BS as usize;
            let id = u64::from_le_bytes(all[at..at + 8].try_into().unwrap());
            let version = u64::from_le_bytes(all[at + 8..at + 16].try_into().unwrap());
            let whole = all[at..at + BS as usize].chunks(16).all(|c| c == &all[at..at + 16]);
            checked += 1;
            if durable > 0 && (id != i as u64 || version < durable || version > sent || !whole) {
                eprintln!("round {round}: block {i} holds id {id} version {version}; durable {durable}, sent {sent}");
                lost += 1;
            }
        }
        drop(vol);
        drop(s);
    }
    eprintln!("kill -9: {rounds} rounds, {checked} block checks, {lost} flushed writes lost");
    assert_eq!(lost, 0, "acknowledged and flushed writes lost");
}

/// `fastsan bench` over BRP behaves as a block device: the target killed
/// and restarted in the middle of a verified run costs no error and no
/// mismatch (the report counts the reconnections and retries); a target
/// that never comes back fails the run once the reconnect timeout passes.
#[test]
fn bench_rides_out_a_target_restart_and_fails_only_past_the_reconnect_timeout() {
    let dir = temp_dir("bench-restart");
    let img = dir.join("v.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let spec = format!("v=file:{}", img.display());
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", &spec]);
    let (addr, url) = (s.addr.clone(), s.url("v"));
    let args = |runtime: &str, reconnect: &str| -> Vec<String> {
        [
            "bench",
            &url,
            "--rw",
            "randrw",
            "--bs",
            "4k",
            "--iodepth",
            "16",
            "--jobs",
            "2",
            "--runtime",
            runtime,
            "--ramp",
            "0",
            "--size",
            "16M",
            "--verify",
            "--json",
            "--reconnect-timeout",
            reconnect,
        ]
        .map(String::from)
        .to_vec()
    };
    let bench = std::process::Command::new(BIN)
        .args(args("3", "20"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(800));
    let (status, _) = s.signal("KILL");
    assert!(!status.success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    let s = Served::start(&["--brp", &addr, "--volume", &spec]);
    let out = bench.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    let get = |k: &str| -> u64 {
        let at = text.find(&format!("\"{k}\": ")).unwrap_or_else(|| panic!("{k} in {text}")) + k.len() + 4;
        text[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    assert_eq!((get("errors"), get("verify_mismatches")), (0, 0), "{text}");
    assert!(get("reconnects") >= 1 && get("retries") >= 1, "{text}");
    // Killed for good: the run fails after its reconnect timeout, with a clear error.
    let bench = std::process::Command::new(BIN)
        .args(args("5", "1"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let t = std::time::Instant::now();
    let (status, _) = s.signal("KILL");
    assert!(!status.success());
    let out = bench.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requests failed"), "{err}");
    assert!(t.elapsed() >= std::time::Duration::from_millis(900), "not before the reconnect timeout");
}

#[test]
fn a_request_timeout_is_reported_once_and_the_copy_fails_in_time() {
    // Reads that never finish: every connection the copy makes times out.
    let s = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:1M,faults=read:stall"]);
    let dir = temp_dir("timeout");
    let out_file = dir.join("out.img");
    let t = std::time::Instant::now();
    let out = fastsan(&[
        "cp",
        &s.url("v"),
        out_file.to_str().unwrap(),
        "--request-timeout",
        "0.3",
        "--reconnect-timeout",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(20), "{err}");
    // Each lost connection is one warning that names its cause, not two.
    let timeouts = err.matches("got no reply in time").count();
    assert!(timeouts >= 1, "{err}");
    assert!(!err.contains("connection to the target lost"), "{err}");
    // And the copy's own error says why, not just "connection lost".
    assert!(
        err.contains("connection lost: no reply within the request timeout (300ms); no connection came back"),
        "{err}"
    );
}

/// Under a low limit on open files (`prlimit`), `serve` lowers its
/// connection cap to what fits, and says so: every client past it is
/// answered (NBD: a close before the greeting, or after EXPORT_NAME), none
/// waits unanswered. Before, past the limit accept failed (EMFILE) and
/// clients sat in the backlog with no answer, a warning twenty times a
/// second in the log.
#[test]
fn past_the_open_file_limit_clients_are_refused_not_left_waiting() {
    use std::io::{Read, Write};
    let s = Served::start_under(
        &["prlimit", "--nofile=256:256", "--"],
        &["--brp", "127.0.0.1:0", "--max-handshakes", "8", "--volume", "v=memory:16M"],
    );
    let mut open = Vec::new();
    let mut refused = 0;
    for i in 0..300 {
        let mut c = std::net::TcpStream::connect(&s.nbd).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut greeting = [0u8; 18];
        let answered = match c.read_exact(&mut greeting) {
            Ok(()) => {
                // Fixed newstyle, no zeroes; EXPORT_NAME "v": size and flags, or a close.
                let mut m = 3u32.to_be_bytes().to_vec();
                m.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
                m.extend_from_slice(&1u32.to_be_bytes());
                m.extend_from_slice(&1u32.to_be_bytes());
                m.push(b'v');
                c.write_all(&m).unwrap();
                let mut info = [0u8; 10];
                match c.read_exact(&mut info) {
                    Ok(()) => Some(true),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Some(false),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(false),
                    Err(_) => None,
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Some(false),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(false),
            Err(_) => None,
        };
        match answered {
            Some(true) => open.push(c),
            Some(false) => refused += 1,
            None => {
                panic!("connection {i} got no answer within 5 s ({} open, {refused} refused)", open.len())
            }
        }
    }
    assert!(refused > 0 && !open.is_empty(), "{} open, {refused} refused", open.len());
    let n = open.len();
    drop(open);
    let (_, err) = s.signal("TERM");
    assert!(err.contains(&format!("serving at most {n} connections")), "{n} open; stderr:\n{err}");
}

/// Ctrl-C ends a copy at once, also while the destination's flush waits
/// (here its target stalls every flush): the copy says it was interrupted
/// and did not finish, and exits 1. Before, the flush (retried, each try
/// up to the reconnect timeout) held Ctrl-C for minutes.
#[test]
fn cp_is_interrupted_by_ctrl_c_even_while_flushing() {
    let dir = temp_dir("cp-interrupted");
    let src = dir.join("src.bin");
    random_file(&src, 1 << 20);
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--volume",
        "v=memory:16M,faults=flush:stall",
    ]);
    // How many flushes the volume's device has begun (the stalled one counts).
    let flushes = || {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&s.metrics).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        let series = "fastsan_volume_ops_total{volume=\"v\",op=\"flush\"} ";
        let line =
            text.lines().find_map(|l| l.strip_prefix(series)).unwrap_or_else(|| panic!("{text}")).to_owned();
        line.trim().parse::<f64>().unwrap()
    };
    let before = flushes();
    let mut cp = Command::new(BIN)
        .args(["cp", src.to_str().unwrap(), &s.url("v")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while flushes() <= before {
        assert!(t.elapsed() < Duration::from_secs(20), "cp never reached its flush");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = cp.id().to_string();
    assert!(Command::new("kill").args(["-s", "INT", &pid]).status().unwrap().success());
    let t = Instant::now();
    while cp.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(5) {
            let _ = cp.kill();
            panic!("cp still running 5 s after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = cp.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("interrupted (SIGINT) while flushing") && err.contains("did not finish"), "{err}");
}

/// In a control group with a memory limit (a container's), a memory volume
/// larger than the limit is refused at start, as one larger than the RAM
/// is: filled, it would have the out-of-memory killer end the target. (The
/// check read only the machine's RAM before.) The group is made here, under
/// this process's own, with a 256 MiB limit (cgroup v1 or v2).
#[test]
fn a_memory_volume_over_the_control_groups_limit_is_refused() {
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let path_of = |want: &dyn Fn(&str) -> bool| {
        groups.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, c, p) = (f.next()?, f.next()?, f.next()?);
            want(c).then(|| p.trim_end_matches('/').to_owned())
        })
    };
    let name = format!("fastsan-test-{}", std::process::id());
    let v1 = path_of(&|c| c.split(',').any(|c| c == "memory"))
        .map(|p| (format!("/sys/fs/cgroup/memory{p}/{name}"), "memory.limit_in_bytes"));
    let v2 = path_of(&|c| c.is_empty()).map(|p| (format!("/sys/fs/cgroup{p}/{name}"), "memory.max"));
    let Some((dir, _)) = [v1, v2].into_iter().flatten().find(|(dir, file)| {
        std::fs::create_dir(dir).is_ok()
            && (std::fs::write(format!("{dir}/{file}"), "268435456").is_ok() || {
                let _ = std::fs::remove_dir(dir);
                false
            })
    }) else {
        eprintln!("no control group with a memory limit can be made here: nothing to check");
        return;
    };
    let mut serve = Command::new("sh")
        .args(["-c", &format!("echo $$ > {dir}/cgroup.procs && exec \"$0\" \"$@\""), BIN])
        .args(["serve", "--brp", "127.0.0.1:0", "--no-nbd", "--volume", "v=memory:1G"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let served = loop {
        if serve.try_wait().unwrap().is_some() {
            break false;
        }
        if t.elapsed() > Duration::from_secs(10) {
            let _ = serve.kill();
            break true;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = serve.wait_with_output().unwrap();
    let _ = std::fs::remove_dir(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!served && !out.status.success(), "a 1 GiB memory volume in a 256 MiB group was served: {err}");
    assert!(err.contains("exceeds this process's control-group memory limit (0.25 GiB"), "{err}");
}
