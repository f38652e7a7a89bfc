//! TLS, identities and grants, with the real clients: nbdinfo, nbdcopy,
//! qemu-io and qemu-img over NBD's STARTTLS, and fastsan's own initiator over
//! brps://. Certificates come from GnuTLS's certtool, as the libnbd and qemu
//! documentation make them (ECDSA keys: half of them carry the leading zero
//! byte that the target has to accept).

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A test PKI: a CA, the target's certificate for 127.0.0.1, and one
/// directory per client in the layout libnbd (`tls-certificates=DIR`) and
/// qemu (`tls-creds-x509,dir=DIR`) read: ca-cert.pem, client-cert.pem, client-key.pem.
struct Pki {
    dir: PathBuf,
}

fn certtool(args: &[&str]) {
    let out = Command::new("certtool").args(args).output().expect("certtool runs (gnutls-bin)");
    assert!(out.status.success(), "certtool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let pki = Pki { dir: dir.join("pki") };
        std::fs::create_dir_all(&pki.dir).unwrap();
        pki.ca("ca");
        pki.ca("rogue-ca");
        let tmpl = pki.dir.join("server.info");
        std::fs::write(&tmpl, "cn = 127.0.0.1\nip_address = 127.0.0.1\ndns_name = localhost\ntls_www_server\nsigning_key\nexpiration_days = 2\n").unwrap();
        pki.sign("server", "ca", &tmpl);
        pki
    }

    fn p(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }

    fn key(&self, name: &str) {
        certtool(&[
            "--generate-privkey",
            "--key-type=ecdsa",
            "--no-text",
            "--outfile",
            &self.p(&format!("{name}-key.pem")),
        ]);
    }

    fn ca(&self, name: &str) {
        self.key(name);
        let tmpl = self.dir.join(format!("{name}.info"));
        std::fs::write(&tmpl, format!("cn = {name}\nca\ncert_signing_key\nexpiration_days = 2\n")).unwrap();
        certtool(&[
            "--generate-self-signed",
            "--load-privkey",
            &self.p(&format!("{name}-key.pem")),
            "--template",
            tmpl.to_str().unwrap(),
            "--outfile",
            &self.p(&format!("{name}-cert.pem")),
        ]);
    }

    fn sign(&self, name: &str, ca: &str, tmpl: &Path) {
        self.key(name);
        certtool(&[
            "--generate-certificate",
            "--load-privkey",
            &self.p(&format!("{name}-key.pem")),
            "--load-ca-certificate",
            &self.p(&format!("{ca}-cert.pem")),
            "--load-ca-privkey",
            &self.p(&format!("{ca}-key.pem")),
            "--template",
            tmpl.to_str().unwrap(),
            "--outfile",
            &self.p(&format!("{name}-cert.pem")),
        ]);
    }

    /// A client directory: `who`'s certificate signed by `ca`, and the CA
    /// the client trusts (`trust`). `who` None: no certificate.
    fn client(&self, dir: &str, who: Option<&str>, ca: &str, trust: &str) -> String {
        let d = self.dir.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(self.dir.join(format!("{trust}-cert.pem")), d.join("ca-cert.pem")).unwrap();
        if let Some(who) = who {
            let tmpl = self.dir.join(format!("{dir}.info"));
            std::fs::write(&tmpl, format!("cn = {who}\ntls_www_client\nsigning_key\nexpiration_days = 2\n"))
                .unwrap();
            self.sign(dir, ca, &tmpl);
            std::fs::copy(self.dir.join(format!("{dir}-cert.pem")), d.join("client-cert.pem")).unwrap();
            std::fs::copy(self.dir.join(format!("{dir}-key.pem")), d.join("client-key.pem")).unwrap();
        }
        d.to_str().unwrap().to_owned()
    }

    /// `fastsan serve` flags for TLS with client certificates.
    fn serve_args(&self) -> Vec<String> {
        [
            "--tls-cert",
            &self.p("server-cert.pem"),
            "--tls-key",
            &self.p("server-key.pem"),
            "--tls-ca",
            &self.p("ca-cert.pem"),
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

fn start(args: &[String]) -> Served {
    Served::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `nbds://` for libnbd, with a client directory.
fn nbds(s: &Served, export: &str, dir: &str) -> String {
    format!("nbds://{}/{export}?tls-certificates={dir}", s.nbd)
}

/// qemu-io over NBD with TLS from `dir`; success and output.
fn qemu_io(s: &Served, export: &str, dir: &str, cmds: &[&str], read_only: bool) -> (bool, String) {
    let (host, port) = s.nbd.rsplit_once(':').unwrap();
    let obj = format!("tls-creds-x509,id=tls0,dir={dir},endpoint=client");
    let opts = format!(
        "driver=nbd,server.type=inet,server.host={host},server.port={port},export={export},tls-creds=tls0"
    );
    let mut args = vec!["--object", &obj, "--image-opts"];
    if read_only {
        args.push("-r");
    }
    args.push(&opts);
    for c in cmds {
        args.extend(["-c", c]);
    }
    let (ok, text) = tool("qemu-io", &args);
    // qemu-io reports a failed command on its output and still exits 0.
    (ok && !text.contains("failed") && !text.contains("error"), text)
}

#[test]
fn nbd_over_tls_with_nbdinfo_nbdcopy_qemu_and_refusals() {
    let dir = temp_dir("tls-nbd");
    let pki = Pki::new(&dir);
    let alice = pki.client("alice", Some("alice"), "ca", "ca");
    let anon = pki.client("anon", None, "ca", "ca");
    let wrong_ca = pki.client("wrong-ca", Some("alice"), "ca", "rogue-ca");
    let mallory = pki.client("mallory", Some("alice"), "rogue-ca", "ca");
    let mut args = pki.serve_args();
    args.extend(["--brp", "127.0.0.1:0", "--volume", "v=memory:8M"].map(str::to_owned));
    let s = start(&args);

    // nbdinfo: TLS, with the export's size.
    let info = ok("nbdinfo", &[&nbds(&s, "v", &alice)]);
    assert!(info.contains("with TLS") && info.contains("export-size: 8388608"), "{info}");
    // nbdcopy: 8 MiB of random bytes there and back, over TLS.
    let (src, back) = (dir.join("src"), dir.join("back"));
    let data = random_file(&src, 8 << 20);
    ok("nbdcopy", &[src.to_str().unwrap(), &nbds(&s, "v", &alice)]);
    ok("nbdcopy", &[&nbds(&s, "v", &alice), back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == data, "nbdcopy over TLS read back other bytes");
    // qemu-io and qemu-img with tls-creds-x509.
    let (w, text) = qemu_io(&s, "v", &alice, &["write -P 0x5a 1M 64k", "read -P 0x5a 1M 64k"], false);
    assert!(w, "{text}");
    let obj = format!("tls-creds-x509,id=tls0,dir={alice},endpoint=client");
    let (host, port) = s.nbd.rsplit_once(':').unwrap();
    let img =
        format!("driver=nbd,server.type=inet,server.host={host},server.port={port},export=v,tls-creds=tls0");
    let text = ok("qemu-img", &["info", "--object", &obj, "--image-opts", &img]);
    assert!(text.contains("8 MiB"), "{text}");

    // Plaintext: every option but STARTTLS is answered ERR_TLS_REQD.
    let (plain, text) = tool("nbdinfo", &[&s.nbd_url("v")]);
    assert!(!plain, "plaintext NBD got through: {text}");
    // The client does not trust the target's CA: it refuses the target.
    let (ok_wrong, text) = tool("nbdinfo", &[&nbds(&s, "v", &wrong_ca)]);
    assert!(!ok_wrong, "a client trusting another CA connected: {text}");
    // A certificate from another CA: the target refuses the client.
    let (ok_mallory, text) = tool("nbdinfo", &[&nbds(&s, "v", &mallory)]);
    assert!(!ok_mallory, "a client certificate from another CA was accepted: {text}");
    // TLS without a certificate: anonymous, and this target authenticates.
    let (ok_anon, text) = tool("nbdinfo", &[&nbds(&s, "v", &anon)]);
    assert!(!ok_anon, "an anonymous client opened a volume of a target that authenticates: {text}");
    // And the target goes on serving the good client.
    let (r, text) = qemu_io(&s, "v", &alice, &["read -P 0x5a 1M 64k"], true);
    assert!(r, "{text}");
    let (status, log) = s.signal("TERM");
    assert!(status.success(), "{log}");
    assert!(log.contains("TLS handshake failed"), "the refused certificate is logged: {log}");
    assert!(log.contains("requires authentication"), "the anonymous client's refusal is logged: {log}");
}

/// Raw NBD: reads one option reply header (20 bytes) and its data.
fn option_reply(s: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    let be = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().unwrap());
    let mut data = vec![0; be(16) as usize];
    s.read_exact(&mut data).unwrap();
    (be(8), be(12), data)
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut v = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
    v.extend(opt.to_be_bytes());
    v.extend((data.len() as u32).to_be_bytes());
    v.extend(data);
    v
}

#[test]
fn options_before_starttls_are_refused_and_injected_plaintext_closes() {
    const STARTTLS: u32 = 5;
    const LIST: u32 = 3;
    const GO: u32 = 7;
    const ACK: u32 = 1;
    const ERR_TLS_REQD: u32 = 0x8000_0005;
    let dir = temp_dir("tls-inject");
    let pki = Pki::new(&dir);
    let alice = pki.client("alice", Some("alice"), "ca", "ca");
    let mut args = pki.serve_args();
    args.extend(["--brp", "127.0.0.1:0", "--volume", "v=memory:1M"].map(str::to_owned));
    let s = start(&args);
    let connect = || {
        let mut c = TcpStream::connect(&s.nbd).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        c.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
        c
    };
    // In plaintext, LIST and GO get ERR_TLS_REQD, and the handshake goes on.
    let mut c = connect();
    let mut go = 1u32.to_be_bytes().to_vec();
    go.extend(b"v");
    go.extend(0u16.to_be_bytes());
    c.write_all(&[option(LIST, &[]), option(GO, &go)].concat()).unwrap();
    assert_eq!(option_reply(&mut c).1, ERR_TLS_REQD);
    assert_eq!(option_reply(&mut c).1, ERR_TLS_REQD);
    // STARTTLS with a LIST sent behind it in the same plaintext write (an
    // attacker's injection, CVE-2021-3716): STARTTLS is acknowledged, then
    // the connection closes; the LIST is never answered or carried into TLS.
    c.write_all(&[option(STARTTLS, &[]), option(LIST, &[])].concat()).unwrap();
    let (opt, typ, _) = option_reply(&mut c);
    assert_eq!((opt, typ), (STARTTLS, ACK));
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the target answered after STARTTLS in plaintext: {rest:?}");
    // Other clients go on.
    let info = ok("nbdinfo", &[&nbds(&s, "v", &alice)]);
    assert!(info.contains("with TLS"), "{info}");
    let (_, log) = s.signal("TERM");
    assert!(log.contains("plaintext after STARTTLS"), "{log}");
}

/// Whether the kernel still has `s` established: looked at without reading
/// from it, which would end a stall.
fn established(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain getsockopt into a zeroed tcp_info of the size given.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            &mut info as *mut _ as *mut _,
            &mut len,
        )
    };
    r == 0 && info.tcpi_state == 1 // TCP_ESTABLISHED
}

/// A TLS client that asks for far more than a socket holds and never reads
/// a reply is dropped after the stall timeout, its connection reset (a TLS
/// stream's close_notify would wait for ever for room it never makes), and
/// other TLS clients are served all along.
#[test]
fn a_tls_client_that_stops_reading_is_dropped_and_others_go_on() {
    const STARTTLS: u32 = 5;
    const GO: u32 = 7;
    const ACK: u32 = 1;
    const INFO: u32 = 3;
    let dir = temp_dir("tls-stall");
    let pki = Pki::new(&dir);
    let alice = pki.client("alice", Some("alice"), "ca", "ca");
    let mut args = pki.serve_args();
    args.extend(
        ["--brp", "127.0.0.1:0", "--volume", "v=memory:64M", "--stall-timeout", "1"].map(str::to_owned),
    );
    let s = start(&args);

    let mut tcp = TcpStream::connect(&s.nbd).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A small receive buffer (no autotuning), so the replies fill the
    // sockets whatever this host's TCP memory limits are.
    socket2::SockRef::from(&tcp).set_recv_buffer_size(64 << 10).expect("SO_RCVBUF");
    let mut greeting = [0u8; 18];
    tcp.read_exact(&mut greeting).unwrap();
    tcp.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
    tcp.write_all(&option(STARTTLS, &[])).unwrap();
    assert_eq!(option_reply(&mut tcp).1, ACK);
    let config = fastsan_initiator::tls::client_config(
        Path::new(&format!("{alice}/ca-cert.pem")),
        Some((Path::new(&format!("{alice}/client-cert.pem")), Path::new(&format!("{alice}/client-key.pem")))),
    )
    .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(config, name).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp.try_clone().unwrap());
    let mut go = 1u32.to_be_bytes().to_vec();
    go.extend(b"v");
    go.extend(0u16.to_be_bytes());
    tls.write_all(&option(GO, &go)).unwrap();
    loop {
        match option_reply(&mut tls).1 {
            ACK => break,
            INFO => continue,
            other => panic!("GO over TLS answered {other:#x}"),
        }
    }
    // Four reads of 16 MiB: 64 MiB of replies, far more than the two
    // sockets' buffers; then not one byte read.
    for cookie in 0..4u64 {
        let mut req = 0x2560_9513u32.to_be_bytes().to_vec();
        req.extend(0u16.to_be_bytes()); // flags
        req.extend(0u16.to_be_bytes()); // NBD_CMD_READ
        req.extend(cookie.to_be_bytes());
        req.extend((cookie * (16 << 20)).to_be_bytes());
        req.extend((16u32 << 20).to_be_bytes());
        tls.write_all(&req).unwrap();
    }
    tls.flush().unwrap();
    // Meanwhile another TLS client is served.
    let info = ok("nbdinfo", &[&nbds(&s, "v", &alice)]);
    assert!(info.contains("with TLS"), "{info}");
    // The target drops the reader that stalls: its connection is gone
    // within the stall timeout and the bounded close (1 s each), not kept
    // for ever.
    let t = std::time::Instant::now();
    while established(&tcp) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a TLS client that stopped reading is still connected"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // And the others go on.
    let (r, text) = qemu_io(&s, "v", &alice, &["write -P 0x3c 0 64k", "read -P 0x3c 0 64k"], false);
    assert!(r, "{text}");
    let (status, log) = s.signal("TERM");
    assert!(status.success(), "{log}");
    assert!(log.contains("peer stopped reading replies"), "the drop is logged with its reason: {log}");
}

#[test]
fn brp_over_tls_copies_and_benches_and_refuses_what_it_should() {
    let dir = temp_dir("tls-brp");
    let pki = Pki::new(&dir);
    let _ = pki.client("alice", Some("alice"), "ca", "ca");
    let secrets = dir.join("secrets");
    std::fs::write(&secrets, "alice open sesame\n").unwrap();
    let mut args = pki.serve_args();
    args.extend(
        [
            "--brp",
            "127.0.0.1:0",
            "--no-nbd",
            "--volume",
            "v=memory:16M",
            "--secrets-file",
            secrets.to_str().unwrap(),
        ]
        .map(str::to_owned),
    );
    let s = start(&args);
    let url = format!("brps://{}/v", s.addr);
    let alice_secret = dir.join("alice.secret");
    std::fs::write(&alice_secret, "open sesame").unwrap();
    let ca = pki.p("ca-cert.pem");
    let by_secret = ["--tls-ca", &ca, "--secret-file", alice_secret.to_str().unwrap(), "--identity", "alice"];
    let by_cert =
        ["--tls-ca", &ca, "--tls-cert", &pki.p("alice-cert.pem"), "--tls-key", &pki.p("alice-key.pem")];
    // cp round trip over TLS: out with the secret, back with the certificate.
    let (src, back) = (dir.join("src"), dir.join("back"));
    let data = random_file(&src, 16 << 20);
    let run = |args: &[&str]| {
        let out = fastsan(args);
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok1, err) = run(&[&["cp", src.to_str().unwrap(), &url][..], &by_secret[..]].concat());
    assert!(ok1, "{err}");
    let (ok2, err) = run(&[&["cp", &url, back.to_str().unwrap()][..], &by_cert[..]].concat());
    assert!(ok2, "{err}");
    assert!(std::fs::read(&back).unwrap() == data, "brps:// read back other bytes");
    // bench, verified, over TLS.
    let bench = [
        &[
            "bench",
            &url,
            "--rw",
            "randrw",
            "--verify",
            "--runtime",
            "1",
            "--ramp",
            "0.2",
            "--size",
            "4M",
            "--iodepth",
            "16",
        ][..],
        &by_cert[..],
    ]
    .concat();
    let out = fastsan(&bench);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    // Refusals, each with its reason.
    let plain = format!("brp://{}/v", s.addr);
    let (ok3, err) =
        run(&["ls", &plain, "--secret-file", alice_secret.to_str().unwrap(), "--identity", "alice"]);
    assert!(!ok3 && err.contains("brps://"), "plaintext to a TLS-only target: {err}");
    let (ok4, err) = run(&["ls", &url]);
    assert!(!ok4 && err.contains("--tls-ca"), "brps:// without a CA: {err}");
    let (ok5, err) = run(&["ls", &url, "--tls-ca", &pki.p("rogue-ca-cert.pem")]);
    assert!(!ok5 && err.to_lowercase().contains("certificate"), "a target signed by an untrusted CA: {err}");
    let wrong = dir.join("wrong.secret");
    std::fs::write(&wrong, "guess").unwrap();
    let (ok6, err) =
        run(&["ls", &url, "--tls-ca", &ca, "--secret-file", wrong.to_str().unwrap(), "--identity", "alice"]);
    assert!(!ok6 && err.contains("authentication failed"), "{err}");
    let (status, log) = s.signal("TERM");
    assert!(status.success(), "{log}");
}

#[test]
fn failed_authentications_are_limited_per_address_and_others_go_on() {
    let dir = temp_dir("auth-limit");
    let (secret, wrong) = (dir.join("s"), dir.join("w"));
    std::fs::write(&secret, "right").unwrap();
    std::fs::write(&wrong, "wrong").unwrap();
    let sock = dir.join("brp.sock");
    let s = Served::start(&[
        "--brp",
        "127.0.0.1:0",
        "--brp-unix",
        sock.to_str().unwrap(),
        "--volume",
        "v=memory:1M",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    let url = s.url("v");
    let ls = |url: &str, secret: &Path| fastsan(&["ls", url, "--secret-file", secret.to_str().unwrap()]);
    for i in 0..10 {
        let out = ls(&url, &wrong);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("authentication failed"), "attempt {i}: {err}");
    }
    // The right secret, from the same address, now: refused, with the reason.
    let out = ls(&url, &secret);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("too many failed authentications"), "{err}");
    // Over the unix socket (another client, this host): served.
    let unix = format!("brp+unix:///v?socket={}", sock.display());
    let out = ls(&unix, &secret);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (_, log) = s.signal("TERM");
    assert!(log.contains("refusing its secrets for a minute"), "{log}");
    assert!(log.contains("readable by other users (mode 644)"), "the secrets file is 0644: {log}");

    // A dual-stack listener ([::]) sees IPv4 clients as ::ffff:a.b.c.d: each
    // is still counted by its own address (as one IPv6 /64 they all shared
    // one count with each other and with ::/64), and logged by it.
    let s = Served::start(&[
        "--brp",
        "[::]:0",
        "--insecure-plaintext",
        "--volume",
        "v=memory:1M",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    let port = s.addr.rsplit(':').next().unwrap().to_owned();
    let url = |host: &str| format!("brp://{host}:{port}/v");
    for i in 0..10 {
        let err = String::from_utf8_lossy(&ls(&url("127.0.0.1"), &wrong).stderr).into_owned();
        assert!(err.contains("authentication failed"), "attempt {i}: {err}");
    }
    let err = String::from_utf8_lossy(&ls(&url("127.0.0.1"), &secret).stderr).into_owned();
    assert!(err.contains("too many failed authentications"), "{err}");
    // Another client (::1: as a /64, :: was also every IPv4 client's key).
    let out = ls(&url("[::1]"), &secret);
    assert!(out.status.success(), "another client: {}", String::from_utf8_lossy(&out.stderr));
    let (_, log) = s.signal("TERM");
    assert!(
        log.contains("127.0.0.1") && !log.contains("::ffff:"),
        "peers logged by their IPv4 address: {log}"
    );
}

/// What a client may do with a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Can {
    Nothing,
    Read,
    ReadWrite,
}

#[test]
fn grants_are_enforced_identically_on_brp_and_nbd() {
    let dir = temp_dir("acl");
    let pki = Pki::new(&dir);
    let people = ["alice", "bob", "carol"];
    let dirs: Vec<String> = people.iter().map(|p| pki.client(p, Some(p), "ca", "ca")).collect();
    let mut args = pki.serve_args();
    args.extend(
        [
            "--brp",
            "127.0.0.1:0",
            "--volume",
            "v=memory:1M",
            "--volume",
            "w=memory:1M",
            "--volume",
            "open=memory:1M",
            "--grant",
            "v:alice:rw",
            "--grant",
            "v:bob:ro",
            "--grant",
            "w:bob",
        ]
        .map(str::to_owned),
    );
    let s = start(&args);
    // Who may do what: v and w as granted; `open` names no grant, so every
    // authenticated identity may write it.
    let expect = |who: &str, vol: &str| match (who, vol) {
        ("alice", "v") | ("bob", "w") | (_, "open") => Can::ReadWrite,
        ("bob", "v") => Can::Read,
        _ => Can::Nothing,
    };
    let src = dir.join("block");
    random_file(&src, 1 << 20);
    for (who, cdir) in people.iter().zip(&dirs) {
        let cert = [
            "--tls-ca",
            &pki.p("ca-cert.pem"),
            "--tls-cert",
            &pki.p(&format!("{who}-cert.pem")),
            "--tls-key",
            &pki.p(&format!("{who}-key.pem")),
        ];
        for vol in ["v", "w", "open"] {
            // BRP: fastsan cp out of and into the volume, over brps://.
            let url = format!("brps://{}/{vol}", s.addr);
            let out_file = dir.join(format!("{who}-{vol}"));
            let read = fastsan(&[&["cp", &url, out_file.to_str().unwrap()][..], &cert[..]].concat())
                .status
                .success();
            let write =
                fastsan(&[&["cp", src.to_str().unwrap(), &url][..], &cert[..]].concat()).status.success();
            let brp = match (read, write) {
                (true, true) => Can::ReadWrite,
                (true, false) => Can::Read,
                (false, false) => Can::Nothing,
                (false, true) => panic!("{who} wrote {vol} over BRP and could not read it"),
            };
            // NBD: qemu-io reading, then writing, over STARTTLS.
            let (read, _) = qemu_io(&s, vol, cdir, &["read 0 4k"], true);
            let pattern =
                format!("write -P {} 0 4k", 0x11 * (1 + people.iter().position(|p| p == who).unwrap()));
            let (write, _) = qemu_io(&s, vol, cdir, &[&pattern], false);
            let nbd = match (read, write) {
                (true, true) => Can::ReadWrite,
                (true, false) => Can::Read,
                (false, false) => Can::Nothing,
                (false, true) => panic!("{who} wrote {vol} over NBD and could not read it"),
            };
            assert_eq!((brp, nbd), (expect(who, vol), expect(who, vol)), "{who} on {vol}: (BRP, NBD)");
        }
    }
    // What the refused writes would have left is not there: v holds alice's
    // pattern (17), not bob's (34) or carol's (51); w holds bob's.
    let (r, text) = qemu_io(&s, "v", &dirs[0], &["read -P 17 0 4k"], true);
    assert!(r, "a refused write reached v: {text}");
    let (r, text) = qemu_io(&s, "w", &dirs[1], &["read -P 34 0 4k"], true);
    assert!(r, "{text}");
    let (status, log) = s.signal("TERM");
    assert!(status.success(), "{log}");
    assert!(log.contains("carol has no grant for volume \"v\""), "{log}");
}
