//! The `fastsan` binary as a user runs it: serve, ls, cp, signals, kill -9.

mod common;

use common::*;
use fastsan_initiator::{BlockingVolume, Options};

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
    std::fs::remove_dir_all(dir).unwrap();
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
    drop(s);
    let d = Served::start(&["--brp", "127.0.0.1:0"]);
    let out = fastsan(&["ls", &format!("brp://{}", d.addr)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l.starts_with("vol0 ") && l.contains("1.00 GiB")), "{text}");
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
    std::fs::remove_dir_all(dir).unwrap();
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
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_command_lines_get_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve", "--volume", "nonsense"], "missing '='"),
        (&["serve", "--volume", "a=memory:12Q"], "size"),
        (&["serve", "--brp", "0.0.0.0:0"], "requires --secret-file"),
        (&["serve", "--brp", "127.0.0.1:0", "--volume", "a=file:/nonexistent/x.img"], "/nonexistent/x.img"),
        (
            &["serve", "--brp", "127.0.0.1:0", "--volume", "a=memory:1M", "--volume", "a=null:1M"],
            "given twice",
        ),
        (&["cp", "/nonexistent/file", "brp://127.0.0.1:1/v"], "/nonexistent/file"),
        (&["ls", "http://x"], "brp://"),
        (&["cp", "a", "b", "--merge", "sometimes"], "possible values: off, adaptive, always"),
    ];
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
    }
    // A bad URL or size is a clear error.
    let out = fastsan(&["bench", "http://x", "--runtime", "0.1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("brp://"));
    let out = fastsan(&["bench", &s.url("v"), "--bs", "1000"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("multiple of 512"));
}
