//! Mirrored volumes as a user runs them: two `fastsan serve` processes on
//! file volumes, `fastsan mirror`, and `fastsan bench --verify` through the
//! mirror while a target is killed with kill -9 and restarted, or while the
//! initiator itself is killed. At the end the legs' backing files are
//! compared byte for byte (the data area: each leg ends with its 4 KiB
//! record, which names the leg).

mod common;

use common::{fastsan, temp_dir, Served, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LEG: u64 = 256 << 20;

struct Legs {
    dir: common::Scratch,
    files: [PathBuf; 2],
    targets: [Option<Served>; 2],
    addrs: [String; 2],
}

impl Legs {
    fn start(name: &str) -> Legs {
        let dir = temp_dir(name);
        let files = [dir.join("a.img"), dir.join("b.img")];
        for f in &files {
            std::fs::File::create(f).unwrap().set_len(LEG).unwrap();
        }
        let a = serve(&files[0], "127.0.0.1:0");
        let b = serve(&files[1], "127.0.0.1:0");
        let addrs = [a.addr.clone(), b.addr.clone()];
        Legs { dir, files, targets: [Some(a), Some(b)], addrs }
    }

    fn spec(&self, extra: &str) -> String {
        format!(
            "mirror:brp://{}/v,brp://{}/v,log={}{extra}",
            self.addrs[0],
            self.addrs[1],
            self.dir.join("m.log").display()
        )
    }

    fn kill(&mut self, i: usize) {
        let mut t = self.targets[i].take().expect("running");
        t.child.kill().unwrap(); // SIGKILL
        t.child.wait().unwrap();
    }

    fn restart(&mut self, i: usize) {
        self.targets[i] = Some(serve(&self.files[i], &self.addrs[i]));
    }

    /// Whether the legs hold the same data (the record after it aside).
    fn identical(&self, size: u64) -> bool {
        let out = Command::new("cmp").arg("-n").arg(size.to_string()).args(&self.files).output().unwrap();
        if !out.status.success() {
            eprintln!("cmp: {}", String::from_utf8_lossy(&out.stdout));
        }
        out.status.success()
    }
}

impl Drop for Legs {
    fn drop(&mut self) {
        // The targets first: the directory goes after them (with `dir`).
        self.targets = [None, None];
    }
}

fn serve(file: &Path, addr: &str) -> Served {
    Served::start(&["--brp", addr, "--volume", &format!("v=file:{}", file.display())])
}

fn ok(args: &[&str]) -> String {
    let out = fastsan(args);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fastsan {args:?} failed:\n{text}");
    text
}

fn status(spec: &str) -> serde_json::Value {
    let out = fastsan(&["mirror", "status", "--json", spec]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn bench(spec: &str, args: &[&str]) -> std::process::Child {
    Command::new(BIN)
        .args(["bench", spec, "--json", "--bs", "4k"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The acceptance run: verified random reads and writes through a 2-leg
/// mirror on file volumes; one target killed with kill -9 and restarted
/// after its leg was degraded: no error reaches the caller, nothing reads
/// back wrong, the resync copies only the regions written meanwhile (the
/// bench writes the first 24 MiB of a 256 MiB volume), and the legs end
/// byte-identical.
#[test]
fn a_target_killed_mid_run_costs_no_error_and_a_dirty_only_resync() {
    let mut legs = Legs::start("mirror-kill");
    let spec = legs.spec(",failover=1");
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let run =
        bench(&spec, &["--rw", "randrw", "--iodepth", "16", "--size", "24M", "--runtime", "9", "--verify"]);
    std::thread::sleep(Duration::from_millis(2500));
    legs.kill(1);
    // Longer than the failover time: the leg is degraded, I/O goes on.
    std::thread::sleep(Duration::from_secs(3));
    let mid = status(&spec);
    assert_eq!(mid["legs"][1]["state"], "degraded", "{mid:#}");
    assert_eq!(mid["legs"][0]["state"], "insync");
    legs.restart(1);
    let out = run.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!((r["errors"].as_u64(), r["verify_mismatches"].as_u64()), (Some(0), Some(0)), "{r:#}");
    assert!(r["reads"].as_u64().unwrap() > 1000 && r["writes"].as_u64().unwrap() > 1000, "{r:#}");

    let s = status(&spec);
    eprintln!("after the run: {s:#}");
    assert!(s["legs"].as_array().unwrap().iter().all(|l| l["state"] == "insync"), "{s:#}");
    assert_eq!(s["dirty"], 0, "a clean close leaves nothing dirty");
    assert!(s["degraded_events"].as_u64().unwrap() >= 1);
    for l in s["legs"].as_array().unwrap() {
        assert!(l["reads"].as_u64().unwrap() > 100, "reads are spread over both legs: {s:#}");
    }
    let copied = s["resynced_regions"].as_u64().unwrap();
    assert!(
        (1..=24).contains(&copied),
        "the resync copied {copied} regions of 1 MiB; only 24 were ever written"
    );
    assert!(s["resynced_bytes"].as_u64().unwrap() <= 24 << 20);
    assert!(legs.identical(s["size"].as_u64().unwrap()), "the legs differ after the resync");
}

/// Legs on `nbd://` (here fastsan's own NBD front end): a server killed
/// mid-run and restarted on the same port is taken back and resynced while
/// the run goes on. Its connection had ended, and every probe reused it:
/// until 2026-11-29 such a leg stayed "still away" until the mirror was
/// opened again, and the mirror ran on one leg.
#[test]
fn an_nbd_leg_comes_back_when_its_server_does() {
    let dir = temp_dir("mirror-nbd");
    let files = [dir.join("a.img"), dir.join("b.img")];
    let ports: Vec<String> = files
        .iter()
        .map(|f| {
            std::fs::File::create(f).unwrap().set_len(LEG).unwrap();
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        })
        .collect();
    let serve_nbd = |i: usize| {
        let vol = format!("v=file:{}", files[i].display());
        Served::start(&["--brp", "127.0.0.1:0", "--nbd", &ports[i], "--volume", &vol])
    };
    let mut targets = [Some(serve_nbd(0)), Some(serve_nbd(1))];
    let spec = format!(
        "mirror:nbd://{}/v,nbd://{}/v,log={},failover=1",
        ports[0],
        ports[1],
        dir.join("m.log").display()
    );
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let run =
        bench(&spec, &["--rw", "randrw", "--iodepth", "16", "--size", "24M", "--runtime", "25", "--verify"]);
    std::thread::sleep(Duration::from_millis(2500));
    let mut t = targets[1].take().unwrap();
    t.child.kill().unwrap();
    t.child.wait().unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(status(&spec)["legs"][1]["state"], "degraded");
    targets[1] = Some(serve_nbd(1));
    // (Back, then resynced while the run goes on: seconds on 2 busy cores.)
    let deadline = Instant::now() + Duration::from_secs(20);
    let back = loop {
        let s = status(&spec);
        if s["legs"][1]["state"] == "insync" || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(back["legs"][1]["state"], "insync", "the leg never came back: {back:#}");
    let out = run.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed:\n{report}\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!((r["errors"].as_u64(), r["verify_mismatches"].as_u64()), (Some(0), Some(0)), "{r:#}");
    let s = status(&spec);
    let out =
        Command::new("cmp").arg("-n").arg(s["size"].as_u64().unwrap().to_string()).args(&files).output();
    assert!(out.unwrap().status.success(), "the legs differ after the resync");
}

/// A write its caller gives up on (a timeout, Ctrl-C) is on the wire: it
/// runs to its end on every leg before its region is free for a resync's
/// copy. Until 2026-11-29 the region's lock went with the caller: the leg
/// the write had reached was moved to resync, the copy read the region
/// from the leg still waiting for the write, and the write landed there
/// after it. The legs then differed in a region the log called clean, and
/// reads alternated between the two.
#[test]
fn a_write_given_up_by_its_caller_lands_on_every_leg_before_a_resync_copies_around_it() {
    use fastsan_initiator::mirror::{LegState, Mirror};
    use fastsan_initiator::{Options, Volume};
    use fastsan_target::backend::{Effect, FaultOps, FaultRule};
    use fastsan_target::config::{ServerConfig, VolumeSpec};
    // The targets in this process (their faults steered).
    let targets = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let start = || {
        let config = ServerConfig {
            brp: "127.0.0.1:0".parse().unwrap(),
            nbd: None,
            volumes: vec![VolumeSpec::parse("v=memory:16M,faults=none").unwrap()],
            ..Default::default()
        };
        let server = targets.block_on(fastsan_target::Server::bind(config)).unwrap();
        let (addr, handle) = (server.local_addr(), server.handle());
        targets.spawn(server.run());
        (addr, handle)
    };
    let ((a, a_handle), (b, b_handle)) = (start(), start());
    let dir = temp_dir("mirror-given-up");
    let spec = format!("mirror:brp://{a}/v,brp://{b}/v,log={}", dir.join("m.log").display());
    let client = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    client.block_on(async {
        let m = Mirror::create(&spec, Options::default(), true, false).await.unwrap();
        m.write_at(&[0x11; 4096], 1 << 20, false).await.unwrap();
        m.flush().await.unwrap();
        // Leg 0 holds the next write up for 2 s; its caller gives up first.
        let a_faults = a_handle.faults("v").unwrap();
        a_faults.add(FaultRule::new(FaultOps::WRITE, Effect::Delay(Duration::from_secs(2))));
        let given_up =
            tokio::time::timeout(Duration::from_millis(300), m.write_at(&[0x22; 4096], 1 << 20, false));
        assert!(given_up.await.is_err(), "the write was given up");
        // The delayed write lands, the keeper does what it does; then the
        // legs are compared through sessions of their own.
        tokio::time::sleep(Duration::from_secs(3)).await;
        a_faults.clear();
        let deadline = Instant::now() + Duration::from_secs(20);
        while m.status().legs.iter().any(|l| l.state != LegState::InSync) || m.status().dirty > 0 {
            assert!(Instant::now() < deadline, "the mirror did not settle: {:?}", m.status());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut seen = Vec::new();
        for url in [format!("brp://{a}/v"), format!("brp://{b}/v")] {
            let leg = Volume::connect(&url, Options::default()).await.unwrap();
            seen.push(leg.read(1 << 20, 4096).await.unwrap());
        }
        assert!(
            seen[0] == seen[1],
            "the legs differ in a region the log calls clean: {:#x} / {:#x}",
            seen[0][0],
            seen[1][0]
        );
        assert!(seen[0][..] == [0x22; 4096][..], "the given-up write landed");
        assert_eq!(m.status().degraded_events, 0, "{:?}", m.status());
        m.close().await.unwrap();
    });
    drop(client);
    a_handle.shutdown();
    b_handle.shutdown();
}

/// kill -9 of the initiator in the middle of a write load: the log keeps
/// the regions that had writes in flight; the next open (here `mirror
/// resync`) copies exactly those, and the legs end identical.
#[test]
fn an_initiator_killed_mid_write_resyncs_exactly_its_dirty_regions() {
    let legs = Legs::start("mirror-crash");
    let spec = legs.spec("");
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let mut run = bench(&spec, &["--rw", "randwrite", "--iodepth", "32", "--size", "16M", "--runtime", "30"]);
    std::thread::sleep(Duration::from_secs(2));
    run.kill().unwrap();
    run.wait().unwrap();
    let before = status(&spec);
    let dirty = before["dirty"].as_u64().unwrap();
    assert!((1..=16).contains(&dirty), "{before:#}");
    assert!(!before["open"].as_bool().unwrap());
    let text = ok(&["mirror", "resync", &spec]);
    assert!(text.contains("every leg in sync"), "{text}");
    let after = status(&spec);
    assert_eq!(after["resynced_regions"].as_u64(), Some(dirty), "exactly the dirty regions: {after:#}");
    assert_eq!(after["dirty"], 0);
    assert!(legs.identical(after["size"].as_u64().unwrap()), "the legs differ after the resync");
}

/// A leg away when the mirror opens: it opens degraded and serves; what is
/// written meanwhile reaches the leg when it is back. Legs given in another
/// order, legs of another mirror, a stale copy of the log, and a missing
/// log are refused with errors that say why.
#[test]
fn a_leg_away_at_open_and_legs_that_do_not_match_the_log() {
    let mut legs = Legs::start("mirror-refuse");
    let spec = legs.spec(",failover=1");
    let log = legs.dir.join("m.log");
    let e = fastsan(&["mirror", "resync", &spec]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("make the mirror first"), "{e:?}");
    ok(&["mirror", "create", "--assume-clean", &spec]);
    std::fs::copy(&log, legs.dir.join("old.log")).unwrap();

    // Legs swapped: refused.
    let swapped = format!("mirror:brp://{}/v,brp://{}/v,log={}", legs.addrs[1], legs.addrs[0], log.display());
    let e = fastsan(&["cp", &swapped, legs.dir.join("x").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("keep the legs in their order"), "{e:?}");
    // Another mirror of the same legs: refused without --force.
    let other = spec.replace("m.log", "other.log");
    let e = fastsan(&["mirror", "create", &other]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("belongs to mirror"), "{e:?}");

    // Leg 1 away: the mirror opens degraded; a copy into it succeeds.
    legs.kill(1);
    let data = common::random_file(&legs.dir.join("in.img"), 3 << 20);
    ok(&["cp", legs.dir.join("in.img").to_str().unwrap(), &spec]);
    let s = status(&spec);
    assert_eq!(s["legs"][1]["state"], "degraded", "{s:#}");
    assert!(s["dirty"].as_u64().unwrap() >= 3, "{s:#}");
    // The stale log (before leg 0 moved on without leg 1): refused.
    let stale = spec.replace("m.log", "old.log");
    let e = fastsan(&["cp", &stale, legs.dir.join("x").to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("newer than this log"), "{e:?}");

    legs.restart(1);
    let text = ok(&["mirror", "resync", &spec]);
    assert!(text.contains("every leg in sync"), "{text}");
    let s = status(&spec);
    assert_eq!(s["resynced_regions"].as_u64(), Some(3), "the three regions written: {s:#}");
    assert!(legs.identical(s["size"].as_u64().unwrap()));
    let back = legs.dir.join("back.img");
    ok(&["cp", &spec, back.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&back).unwrap()[..data.len()], &data[..]);
    // While one process has the mirror, another cannot open it.
    let started = Instant::now();
    let mut holder = bench(&spec, &["--rw", "randread", "--runtime", "3"]);
    std::thread::sleep(Duration::from_millis(700));
    let e = fastsan(&["mirror", "resync", &spec]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("in use by another process"), "{e:?}");
    let s = status(&spec);
    assert!(s["open"].as_bool().unwrap(), "{s:#}");
    holder.wait().unwrap();
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A leg whose device fails writes (EIO in one range) is degraded at the
/// first failure; the caller sees no error and reads back what it wrote.
#[test]
fn a_leg_with_io_errors_is_degraded_and_the_caller_sees_none() {
    let dir = temp_dir("mirror-eio");
    let a = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:64M"]);
    let b = Served::start(&["--brp", "127.0.0.1:0", "--volume", "v=memory:64M,faults=write:eio@2M-3M"]);
    let spec = format!("mirror:{},{},log={}", a.url("v"), b.url("v"), dir.join("m.log").display());
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let data = common::random_file(&dir.join("in.img"), 4 << 20);
    let text = ok(&["cp", dir.join("in.img").to_str().unwrap(), &spec]);
    assert!(text.contains("copied"), "{text}");
    let s = status(&spec);
    assert!(s["degraded_events"].as_u64().unwrap() >= 1, "{s:#}");
    assert_eq!(s["legs"][0]["state"], "insync");
    let back = dir.join("back.img");
    ok(&["cp", &spec, back.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&back).unwrap()[..data.len()], &data[..]);
}

/// `create` without --assume-clean copies leg 0 whole to the others, here
/// two more (3 legs), with data already on leg 0.
#[test]
fn a_first_full_sync_makes_three_legs_identical() {
    let dir = temp_dir("mirror-full");
    let files: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("{i}.img"))).collect();
    let mut targets = Vec::new();
    for f in &files {
        std::fs::File::create(f).unwrap().set_len(64 << 20).unwrap();
        targets.push(serve(f, "127.0.0.1:0"));
    }
    let data = common::random_file(&dir.join("in.img"), 40 << 20);
    ok(&["cp", dir.join("in.img").to_str().unwrap(), &targets[0].url("v")]);
    let legs: Vec<String> = targets.iter().map(|t| t.url("v")).collect();
    let spec = format!("mirror:{},log={}", legs.join(","), dir.join("m.log").display());
    let text = ok(&["mirror", "create", &spec]);
    assert!(text.contains("every leg in sync; 128 regions"), "two legs of 64 regions copied: {text}");
    let s = status(&spec);
    let size = s["size"].as_u64().unwrap();
    for f in &files[1..] {
        let out = Command::new("cmp").arg("-n").arg(size.to_string()).arg(&files[0]).arg(f).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    }
    let back = dir.join("back.img");
    ok(&["cp", &spec, back.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&back).unwrap()[..data.len()], &data[..]);
    drop(targets);
}

/// A mirror attached as a file (FUSE): writes through it while one target
/// is killed and restarted; the file reads back what was written, and the
/// legs end identical after the attachment's clean end.
#[test]
fn an_attached_mirror_rides_out_a_target_restart() {
    use std::os::unix::fs::FileExt;
    let mut legs = Legs::start("mirror-attach");
    let spec = legs.spec(",failover=1");
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let fuse = legs.dir.join("fuse");
    std::fs::create_dir_all(&fuse).unwrap();
    let child = Command::new(BIN)
        .args(["attach", &spec, "--fuse", fuse.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let file = fuse.join("m");
    let size = LEG - 4096;
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != size {
        assert!(Instant::now() < deadline, "{} did not appear", file.display());
        std::thread::sleep(Duration::from_millis(50));
    }
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let first = vec![0x5a; 3 << 20];
    f.write_all_at(&first, 10 << 20).unwrap();
    f.sync_all().unwrap();
    legs.kill(0);
    let second = vec![0xa5; 2 << 20];
    f.write_all_at(&second, 100 << 20).unwrap();
    f.sync_all().unwrap();
    legs.restart(0);
    let mut back = vec![0u8; 3 << 20];
    f.read_exact_at(&mut back, 10 << 20).unwrap();
    assert!(back == first);
    let mut back = vec![0u8; 2 << 20];
    f.read_exact_at(&mut back, 100 << 20).unwrap();
    assert!(back == second);
    drop(f);
    // Wait for the resync, then a clean end.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !status(&spec)["legs"].as_array().unwrap().iter().all(|l| l["state"] == "insync") {
        assert!(Instant::now() < deadline, "never back in sync: {:#}", status(&spec));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = status(&spec);
    assert_eq!(s["dirty"], 0, "{s:#}");
    // The regions written while it was away (2), and those still dirty
    // when it left (the 3 written just before: cleared after 2 s idle).
    assert!(s["resynced_regions"].as_u64().unwrap() <= 5, "only dirty regions: {s:#}");
    assert!(legs.identical(size));
}

/// A leg whose volume is replaced (here its file emptied and the target
/// restarted over it) carries no record: the mirror serves from the other
/// leg, and `mirror replace` copies everything back to it.
#[test]
fn a_replaced_leg_is_taken_back_by_a_whole_copy() {
    let mut legs = Legs::start("mirror-replace");
    let spec = legs.spec(",failover=1");
    ok(&["mirror", "create", "--assume-clean", &spec]);
    let data = common::random_file(&legs.dir.join("in.img"), 5 << 20);
    ok(&["cp", legs.dir.join("in.img").to_str().unwrap(), &spec]);
    legs.kill(1);
    std::fs::File::create(&legs.files[1]).unwrap().set_len(LEG).unwrap(); // a new, empty disk
    legs.restart(1);
    // Leg 0 still carries this mirror's record: replacing it is refused.
    let e = fastsan(&["mirror", "replace", "--leg", "0", &spec]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("carries this mirror's record"), "{e:?}");
    let text = ok(&["mirror", "replace", "--leg", "1", &spec]);
    assert!(text.contains("every leg in sync; 256 regions"), "{text}");
    let s = status(&spec);
    assert!(s["legs"].as_array().unwrap().iter().all(|l| l["state"] == "insync"), "{s:#}");
    assert!(legs.identical(s["size"].as_u64().unwrap()));
    let back = legs.dir.join("back.img");
    ok(&["cp", &spec, back.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&back).unwrap()[..data.len()], &data[..]);
}
