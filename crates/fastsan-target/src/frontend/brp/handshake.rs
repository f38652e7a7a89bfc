//! The target's side of the BRP handshake, as a state machine: HELLO, then
//! AUTH when the target has secrets, then any number of LIST and OPEN until
//! one OPEN succeeds. No I/O: the driver feeds it bytes and sends what it
//! writes to `out`.
//!
//! A connection whose first byte is a TLS record (0x16; BRP's magic starts
//! with 0x48) asks the driver for TLS with those bytes replayed into it
//! ([`Step::StartTls`]), then runs the same handshake over TLS. A client
//! with a verified certificate is that certificate's identity and skips
//! AUTH; otherwise AUTH names an identity of the secrets file. Plaintext
//! is refused with `TLS_REQUIRED` under `--tls require`, and for an
//! authenticated session from another host unless `--insecure-plaintext`.
//! LIST shows, and OPEN opens, what the identity's grants allow.

use super::{volume_flags, volume_info, Brp, BrpConn};
use crate::access::{Mode, Who, DEFAULT_IDENTITY};
use crate::frontend::{Handshake, Step, WireError, OUT_CAP};
use crate::tls::TlsMode;
use bytes::{Buf, BytesMut};
use fastsan_brp::handshake::{parse_message, Message, OpenInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use fastsan_brp::Status;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Hello,
    Auth,
    Open,
}

/// The key an unknown identity's proof is checked against: random, per process.
fn dummy_key() -> std::sync::Arc<[u8]> {
    static KEY: std::sync::OnceLock<std::sync::Arc<[u8]>> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let mut k = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut k);
        std::sync::Arc::from(&k[..])
    })
    .clone()
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

pub struct BrpHandshake {
    brp: Brp,
    who: Who,
    challenge: [u8; 32],
    features: u32,
    state: State,
    /// OPENs refused so far: past [`MAX_MISSES`] the connection closes.
    misses: u32,
}

/// OPENs of volumes missing or not granted one connection may try.
const MAX_MISSES: u32 = 8;

impl BrpHandshake {
    /// A handshake whose authentication challenge is `challenge` (random in
    /// service; fixed in tests).
    pub fn new(brp: Brp, who: Who, challenge: [u8; 32]) -> Self {
        BrpHandshake { brp, who, challenge, features: 0, state: State::Hello, misses: 0 }
    }

    /// Why a plaintext session may not go on, if it may not.
    fn plaintext_refused(&self) -> Option<&'static str> {
        let access = &self.brp.access;
        if self.who.tls {
            return None;
        }
        if access.tls.as_ref().is_some_and(|t| t.mode == TlsMode::Require) {
            return Some("this target serves BRP over TLS only: connect with brps://");
        }
        if access.authenticates() && !self.who.local && !access.insecure_plaintext {
            return Some(
                "an authenticated session from another host must use TLS (brps://): in plaintext, \
                 its frames could be altered or injected after the handshake",
            );
        }
        None
    }

    /// Whether the client must answer the challenge: the target has
    /// secrets and TLS gave the client no identity.
    fn needs_auth(&self) -> bool {
        !self.brp.access.secrets.is_empty() && self.who.identity.is_none()
    }

    /// Answers with an ERROR message and closes.
    fn refuse(out: &mut Vec<u8>, status: Status, why: String) -> Step<BrpConn> {
        Message::Error { status, message: why.clone() }.encode(out);
        Step::Refused(why)
    }

    fn on_message(&mut self, m: Message, out: &mut Vec<u8>) -> Step<BrpConn> {
        let brp = &self.brp;
        match (self.state, m) {
            (State::Hello, Message::Hello { min_version, max_version, features }) => {
                if !(min_version..=max_version).contains(&fastsan_brp::VERSION) {
                    let why = format!(
                        "client speaks versions {min_version}..={max_version}, target speaks {}",
                        fastsan_brp::VERSION
                    );
                    return Self::refuse(out, Status::BAD_VERSION, why);
                }
                if let Some(why) = self.plaintext_refused() {
                    return Self::refuse(out, Status::TLS_REQUIRED, why.into());
                }
                self.features = features & fastsan_brp::FEATURES_KNOWN;
                let needs_auth = self.needs_auth();
                let auth = if needs_auth { AUTH_HMAC_SHA256 } else { AUTH_NONE };
                let reply = Message::HelloReply {
                    version: fastsan_brp::VERSION,
                    auth,
                    features: self.features,
                    challenge: self.challenge,
                };
                reply.encode(out);
                self.state = if needs_auth { State::Auth } else { State::Open };
                Step::Continue
            }
            (State::Auth, Message::Auth { client_nonce, proof, identity }) => {
                // The try is counted as it begins (forgiven below when it
                // succeeds): tries in parallel cannot outrun the limit.
                if let Some(wait) = self.who.ip.and_then(|ip| brp.access.limiter.attempt(ip).err()) {
                    let why = format!(
                        "too many failed authentications from this address: try again in {} s",
                        wait.as_secs() + 1
                    );
                    return Self::refuse(out, Status::AUTH_FAILED, why);
                }
                let name = if identity.is_empty() { DEFAULT_IDENTITY } else { identity.as_str() };
                // An unknown name is checked against a random key of the
                // process (never sent), so that it costs about what a wrong
                // secret costs and answers the same; `known` decides.
                let known = brp.access.secrets.contains_key(name);
                let secret = brp.access.secrets.get(name).cloned().unwrap_or_else(dummy_key);
                let ok = fastsan_brp::auth::verify_client(
                    &secret,
                    &self.challenge,
                    &client_nonce,
                    &proof,
                    &identity,
                );
                if !(ok && known) {
                    Message::Error { status: Status::AUTH_FAILED, message: "authentication failed".into() }
                        .encode(out);
                    return Step::AuthFailed(format!(
                        "wrong secret for identity {name:?}, or no such identity"
                    ));
                }
                if let Some(ip) = self.who.ip {
                    brp.access.limiter.succeeded(ip);
                }
                let proof =
                    fastsan_brp::auth::server_proof(&secret, &self.challenge, &client_nonce, &identity);
                Message::AuthOk { proof }.encode(out);
                self.who.identity = Some(name.to_owned());
                self.state = State::Open;
                Step::Continue
            }
            (State::Auth, _) => {
                if let Some(ip) = self.who.ip {
                    brp.access.limiter.failed(ip);
                }
                let message = "this target requires authentication".to_owned();
                Message::Error { status: Status::AUTH_REQUIRED, message: message.clone() }.encode(out);
                Step::AuthFailed(message)
            }
            (State::Open, Message::List) => {
                let volumes = brp
                    .catalog
                    .iter()
                    .filter_map(|v| {
                        let mode = brp.access.mode_for(&self.who, v.name(), false).ok()?;
                        Some(volume_info(v, mode == Mode::ReadOnly))
                    })
                    .collect();
                Message::ListReply { volumes }.encode(out);
                Step::Continue
            }
            (State::Open, Message::Open { session, slot, flags, name }) => {
                let granted =
                    brp.catalog.get(&name).and_then(|v| match brp.access.mode_for(&self.who, &name, false) {
                        Ok(mode) => Some((v, mode)),
                        Err(why) => {
                            let peer = self.who.ip.map_or_else(|| "unix".to_owned(), |ip| ip.to_string());
                            tracing::info!(%peer, who = self.who.name(), "BRP OPEN refused: {why}");
                            None
                        }
                    });
                // A volume not granted is answered as one that is not there
                // (LIST does not show it either): a client cannot learn names
                // by trying them, and after MAX_MISSES tries it is closed.
                let Some((volume, mode)) = granted else {
                    self.misses += 1;
                    let message = format!("no volume named {name:?} that this client may open");
                    if self.misses >= MAX_MISSES {
                        return Self::refuse(
                            out,
                            Status::NO_SUCH_VOLUME,
                            format!("{message} ({MAX_MISSES} times)"),
                        );
                    }
                    Message::Error { status: Status::NO_SUCH_VOLUME, message }.encode(out);
                    return Step::Continue;
                };
                let takeover = flags & fastsan_brp::handshake::OPEN_TAKEOVER != 0;
                let (session, fence) =
                    match brp.sessions.join(session, slot, &name, self.who.name(), takeover) {
                        Ok(s) => s,
                        Err(message) => {
                            Message::Error { status: Status::UNEXPECTED, message }.encode(out);
                            return Step::Continue;
                        }
                    };
                let info = OpenInfo {
                    session: session.id(),
                    size: volume.size(),
                    block_size: volume.granule(),
                    max_transfer: volume.max_transfer(),
                    queue_depth: brp.queue_depth,
                    max_batch: fastsan_brp::limits::MAX_BATCH,
                    flags: volume_flags(volume, mode == Mode::ReadOnly),
                    instance: brp.instance,
                    generation: volume.generation(),
                    boot: volume.boot().unwrap_or(brp.boot),
                };
                // The driver sends this only after the fence.
                Message::OpenReply(info).encode(out);
                let digests = self.features & fastsan_brp::FEATURE_DIGEST != 0;
                let read_only = mode == Mode::ReadOnly;
                Step::Done(BrpConn::new(
                    volume.clone(),
                    session,
                    fence,
                    digests,
                    read_only,
                    brp.stats.clone(),
                ))
            }
            (state, other) => {
                let why = format!("unexpected {} in the {state:?} phase", other.name());
                Self::refuse(out, Status::UNEXPECTED, why)
            }
        }
    }
}

impl Handshake for BrpHandshake {
    type Conn = BrpConn;

    fn start(&mut self, _out: &mut Vec<u8>) {
        // The client speaks first.
    }

    fn tls_started(&mut self, identity: Option<String>) {
        self.who.tls = true;
        self.who.identity = identity;
    }

    fn advance(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<Step<BrpConn>, WireError> {
        if self.state == State::Hello && !self.who.tls && input.first() == Some(&TLS_HANDSHAKE_RECORD) {
            return Ok(match &self.brp.access.tls {
                Some(t) if t.mode != TlsMode::Off => Step::StartTls { replay: true },
                _ => {
                    Step::Refused("a TLS client, but this target serves no TLS (brp://, not brps://)".into())
                }
            });
        }
        while out.len() < OUT_CAP {
            let Some((m, n)) = parse_message(input)? else { break };
            input.advance(n);
            match self.on_message(m, out) {
                Step::Continue => {}
                step => return Ok(step),
            }
        }
        Ok(Step::Continue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{Access, MAX_FAILURES};
    use crate::backend::{Backend, MemoryBackend};
    use crate::catalog::Catalog;
    use crate::frontend::Transmission;
    use crate::sessions::Sessions;
    use crate::stats::Stats;
    use crate::volume::Volume;
    use std::sync::Arc;

    fn local() -> Who {
        Who { local: true, ..Default::default() }
    }

    const CHALLENGE: [u8; 32] = [3; 32];

    fn brp(secret: Option<&[u8]>) -> Brp {
        let mut c = Catalog::default();
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
        c.add(Volume::with_backend("vol0".into(), b, 1 << 16));
        Brp {
            catalog: Arc::new(c),
            sessions: Arc::new(Sessions::default()),
            access: Arc::new(Access {
                secrets: secret
                    .map(|s| [(DEFAULT_IDENTITY.to_owned(), Arc::from(s))].into())
                    .unwrap_or_default(),
                ..Default::default()
            }),
            queue_depth: 32,
            stats: Arc::new(Stats::default()),
            instance: 5,
            boot: 6,
        }
    }

    /// Feeds `msgs` to the machine; returns the last step and the messages it wrote.
    fn run(hs: &mut BrpHandshake, msgs: &[Message]) -> (Step<BrpConn>, Vec<Message>) {
        let mut input = BytesMut::new();
        for m in msgs {
            input.extend_from_slice(&m.to_vec());
        }
        let mut out = Vec::new();
        let step = hs.advance(&mut input, &mut out).unwrap();
        let mut replies = Vec::new();
        let mut at = 0;
        while let Some((m, n)) = parse_message(&out[at..]).unwrap() {
            replies.push(m);
            at += n;
        }
        assert_eq!(at, out.len(), "only whole messages are written");
        (step, replies)
    }

    fn hello() -> Message {
        Message::Hello { min_version: 2, max_version: 2, features: fastsan_brp::FEATURE_DIGEST | 0x8000 }
    }

    #[test]
    fn hello_list_open_without_auth() {
        let b = brp(None);
        let mut hs = BrpHandshake::new(b.clone(), local(), CHALLENGE);
        let (step, out) = run(&mut hs, &[hello(), Message::List]);
        assert!(matches!(step, Step::Continue));
        let Message::HelloReply { auth, features, challenge, .. } = &out[0] else { panic!("{out:?}") };
        assert_eq!(
            (*auth, *features, *challenge),
            (AUTH_NONE, fastsan_brp::FEATURE_DIGEST, CHALLENGE),
            "unknown features are dropped"
        );
        let Message::ListReply { volumes } = &out[1] else { panic!("{out:?}") };
        assert_eq!(volumes[0].name, "vol0");
        let (step, out) =
            run(&mut hs, &[Message::Open { session: 0, slot: 0, flags: 0, name: "nope".into() }]);
        assert!(matches!(step, Step::Continue), "an unknown volume leaves the handshake open");
        assert!(matches!(&out[0], Message::Error { status, .. } if *status == Status::NO_SUCH_VOLUME));
        let (step, out) =
            run(&mut hs, &[Message::Open { session: 0, slot: 0, flags: 0, name: "vol0".into() }]);
        let Step::Done(conn) = step else { panic!("{step:?}") };
        let Message::OpenReply(info) = &out[0] else { panic!("{out:?}") };
        assert_eq!((info.size, info.block_size, info.queue_depth, info.instance), (1 << 20, 512, 32, 5));
        assert_eq!(info.generation, b.catalog.get("vol0").unwrap().generation());
        assert_eq!(b.sessions.connections(info.session), 1);
        assert!(conn.describe().contains("digests true"));
        drop(conn);
        assert_eq!(b.sessions.connections(info.session), 0, "the session ends with its last connection");
    }

    /// The machine counts each try at a secret as it begins: handshakes
    /// from one address that all reach AUTH before any has finished (and
    /// before the driver hears of any failure) are checked ten times at most.
    #[test]
    fn tries_at_a_secret_count_as_they_begin() {
        let b = brp(Some(b"sesame"));
        let who = Who { local: true, ip: Some("127.0.0.9".parse().unwrap()), ..Default::default() };
        let good = fastsan_brp::auth::client_proof(b"sesame", &CHALLENGE, &[9; 32], "");
        let auth = |proof| Message::Auth { client_nonce: [9; 32], proof, identity: String::new() };
        // Good tries are forgiven: they never use up the address's budget.
        for _ in 0..2 * MAX_FAILURES {
            let mut hs = BrpHandshake::new(b.clone(), who.clone(), CHALLENGE);
            assert!(matches!(run(&mut hs, &[hello(), auth(good)]).1[1], Message::AuthOk { .. }));
        }
        let steps: Vec<Step<BrpConn>> = (0..MAX_FAILURES + 2)
            .map(|_| {
                run(&mut BrpHandshake::new(b.clone(), who.clone(), CHALLENGE), &[hello(), auth([0; 32])]).0
            })
            .collect();
        assert!(steps[..MAX_FAILURES as usize].iter().all(|s| matches!(s, Step::AuthFailed(_))), "{steps:?}");
        for s in &steps[MAX_FAILURES as usize..] {
            assert!(matches!(s, Step::Refused(why) if why.contains("too many failed")), "{s:?}");
        }
        // Even the right secret, now; another address goes on.
        let mut hs = BrpHandshake::new(b.clone(), who, CHALLENGE);
        assert!(matches!(run(&mut hs, &[hello(), auth(good)]).0, Step::Refused(_)));
        let other = Who { local: true, ip: Some("127.0.0.10".parse().unwrap()), ..Default::default() };
        let mut hs = BrpHandshake::new(b, other, CHALLENGE);
        assert!(matches!(run(&mut hs, &[hello(), auth(good)]).1[1], Message::AuthOk { .. }));
    }

    #[test]
    fn auth_is_required_and_checked() {
        let secret = b"sesame";
        let nonce = [9u8; 32];
        let good = fastsan_brp::auth::client_proof(secret, &CHALLENGE, &nonce, "");
        // The right proof: AUTH_OK carries the target's proof.
        let mut hs = BrpHandshake::new(brp(Some(secret)), local(), CHALLENGE);
        let (_, out) = run(
            &mut hs,
            &[hello(), Message::Auth { client_nonce: nonce, proof: good, identity: String::new() }],
        );
        assert!(matches!(&out[0], Message::HelloReply { auth: AUTH_HMAC_SHA256, .. }));
        let Message::AuthOk { proof } = &out[1] else { panic!("{out:?}") };
        assert!(fastsan_brp::auth::verify_server(secret, &CHALLENGE, &nonce, proof, ""));
        // A wrong proof: refused, as a failed authentication.
        let b = brp(Some(secret));
        let mut hs = BrpHandshake::new(b.clone(), local(), CHALLENGE);
        let (step, out) = run(
            &mut hs,
            &[hello(), Message::Auth { client_nonce: nonce, proof: [0; 32], identity: String::new() }],
        );
        assert!(matches!(step, Step::AuthFailed(_)));
        assert!(matches!(&out[1], Message::Error { status, .. } if *status == Status::AUTH_FAILED));
        // Skipping AUTH: refused, and OPEN never reached.
        let mut hs = BrpHandshake::new(brp(Some(secret)), local(), CHALLENGE);
        let (step, out) =
            run(&mut hs, &[hello(), Message::Open { session: 0, slot: 0, flags: 0, name: "vol0".into() }]);
        assert!(matches!(step, Step::AuthFailed(_)));
        assert!(matches!(&out[1], Message::Error { status, .. } if *status == Status::AUTH_REQUIRED));
        // An unknown identity whose proof is keyed with the challenge (all it knows): refused.
        let forged = fastsan_brp::auth::client_proof(&CHALLENGE, &CHALLENGE, &nonce, "mallory");
        let mut hs = BrpHandshake::new(brp(Some(secret)), local(), CHALLENGE);
        let auth = Message::Auth { client_nonce: nonce, proof: forged, identity: "mallory".into() };
        assert!(matches!(run(&mut hs, &[hello(), auth]).0, Step::AuthFailed(_)));
        // From another host, in plaintext: refused before any secret is tried.
        let remote = Who { ip: Some("10.1.2.3".parse().unwrap()), ..Default::default() };
        let mut hs = BrpHandshake::new(brp(Some(secret)), remote, CHALLENGE);
        let (step, out) = run(&mut hs, &[hello()]);
        assert!(matches!(&step, Step::Refused(why) if why.contains("TLS")), "{step:?}");
        assert!(matches!(&out[0], Message::Error { status, .. } if *status == Status::TLS_REQUIRED));
        // A TLS ClientHello at a target without TLS: closed with a reason.
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        let step = hs.advance(&mut BytesMut::from(&[0x16u8, 3, 1, 0, 5][..]), &mut Vec::new()).unwrap();
        assert!(matches!(&step, Step::Refused(why) if why.contains("no TLS")), "{step:?}");
    }

    #[test]
    fn bad_versions_and_orders_are_refused_with_a_reason() {
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        let (step, out) = run(&mut hs, &[Message::Hello { min_version: 3, max_version: 4, features: 0 }]);
        assert!(matches!(&step, Step::Refused(why) if why.contains("3..=4")));
        assert!(matches!(&out[0], Message::Error { status, .. } if *status == Status::BAD_VERSION));
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        let (step, _) = run(&mut hs, &[Message::List]);
        assert!(matches!(&step, Step::Refused(why) if why.contains("LIST in the Hello phase")));
        let mut input = BytesMut::from(&b"definitely not BRP"[..]);
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        assert!(hs.advance(&mut input, &mut Vec::new()).is_err(), "bad magic is a protocol error");
    }

    #[test]
    fn pipelined_lists_are_answered_at_the_pace_they_are_read() {
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        let mut input = BytesMut::from(&hello().to_vec()[..]);
        for _ in 0..20_000 {
            input.extend_from_slice(&Message::List.to_vec());
        }
        let mut out = Vec::new();
        let mut rounds = 0;
        loop {
            assert!(matches!(hs.advance(&mut input, &mut out).unwrap(), Step::Continue));
            assert!(out.len() < crate::frontend::OUT_CAP + 4096, "replies stop at the cap");
            if out.is_empty() {
                break;
            }
            out.clear();
            rounds += 1;
        }
        assert!(input.is_empty(), "every LIST was answered");
        assert!(rounds > 5, "in several rounds, not one buffer: {rounds}");
    }

    #[test]
    fn bytes_one_at_a_time_reach_the_same_end() {
        let mut hs = BrpHandshake::new(brp(None), local(), CHALLENGE);
        let mut all = hello().to_vec();
        all.extend(Message::Open { session: 0, slot: 0, flags: 0, name: "vol0".into() }.to_vec());
        let (mut input, mut out) = (BytesMut::new(), Vec::new());
        let mut done = None;
        for b in all {
            input.extend_from_slice(&[b]);
            match hs.advance(&mut input, &mut out).unwrap() {
                Step::Continue => {}
                Step::Done(c) => {
                    done = Some(c);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(done.is_some());
    }
}
