//! The target's side of the BRP handshake, as a state machine: HELLO, then
//! AUTH when the target has a secret, then any number of LIST and OPEN until
//! one OPEN succeeds. No I/O: the driver feeds it bytes and sends what it
//! writes to `out`.

use super::{volume_flags, volume_info, Brp, BrpConn};
use crate::frontend::{Handshake, Step, WireError, OUT_CAP};
use crate::stats::Stats;
use bytes::{Buf, BytesMut};
use fastsan_brp::handshake::{parse_message, Message, OpenInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use fastsan_brp::Status;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Hello,
    Auth,
    Open,
}

pub struct BrpHandshake {
    brp: Brp,
    challenge: [u8; 32],
    features: u32,
    state: State,
}

impl BrpHandshake {
    /// A handshake whose authentication challenge is `challenge` (random in
    /// service; fixed in tests).
    pub fn new(brp: Brp, challenge: [u8; 32]) -> Self {
        BrpHandshake { brp, challenge, features: 0, state: State::Hello }
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
                self.features = features & fastsan_brp::FEATURES_KNOWN;
                let auth = if brp.secret.is_some() { AUTH_HMAC_SHA256 } else { AUTH_NONE };
                let reply = Message::HelloReply {
                    version: fastsan_brp::VERSION,
                    auth,
                    features: self.features,
                    challenge: self.challenge,
                };
                reply.encode(out);
                self.state = if brp.secret.is_some() { State::Auth } else { State::Open };
                Step::Continue
            }
            (State::Auth, Message::Auth { client_nonce, proof }) => {
                let secret = brp.secret.as_deref().expect("the Auth state needs a secret");
                if !fastsan_brp::auth::verify_client(secret, &self.challenge, &client_nonce, &proof) {
                    Stats::add(&brp.stats.auth_failures, 1);
                    return Self::refuse(out, Status::AUTH_FAILED, "authentication failed".into());
                }
                let proof = fastsan_brp::auth::server_proof(secret, &self.challenge, &client_nonce);
                Message::AuthOk { proof }.encode(out);
                self.state = State::Open;
                Step::Continue
            }
            (State::Auth, _) => {
                Stats::add(&brp.stats.auth_failures, 1);
                Self::refuse(out, Status::AUTH_REQUIRED, "this target requires authentication".into())
            }
            (State::Open, Message::List) => {
                let volumes = brp.catalog.iter().map(|v| volume_info(v)).collect();
                Message::ListReply { volumes }.encode(out);
                Step::Continue
            }
            (State::Open, Message::Open { session, slot, name }) => {
                let Some(volume) = brp.catalog.get(&name) else {
                    let message = format!("no volume named {name:?}");
                    Message::Error { status: Status::NO_SUCH_VOLUME, message }.encode(out);
                    return Step::Continue;
                };
                let (session, fence) = match brp.sessions.join(session, slot, &name) {
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
                    flags: volume_flags(volume),
                    instance: brp.instance,
                    generation: volume.generation(),
                    boot: brp.boot,
                };
                // The driver sends this only after the fence.
                Message::OpenReply(info).encode(out);
                let digests = self.features & fastsan_brp::FEATURE_DIGEST != 0;
                Step::Done(BrpConn::new(volume.clone(), session, fence, digests, brp.stats.clone()))
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

    fn advance(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<Step<BrpConn>, WireError> {
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
    use crate::backend::{Backend, MemoryBackend};
    use crate::catalog::Catalog;
    use crate::frontend::Transmission;
    use crate::sessions::Sessions;
    use crate::volume::Volume;
    use std::sync::Arc;

    const CHALLENGE: [u8; 32] = [3; 32];

    fn brp(secret: Option<&[u8]>) -> Brp {
        let mut c = Catalog::default();
        let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(1 << 20));
        c.add(Volume::with_backend("vol0".into(), b, 1 << 16));
        Brp {
            catalog: Arc::new(c),
            sessions: Arc::new(Sessions::default()),
            secret: secret.map(Arc::from),
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
        let mut hs = BrpHandshake::new(b.clone(), CHALLENGE);
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
        let (step, out) = run(&mut hs, &[Message::Open { session: 0, slot: 0, name: "nope".into() }]);
        assert!(matches!(step, Step::Continue), "an unknown volume leaves the handshake open");
        assert!(matches!(&out[0], Message::Error { status, .. } if *status == Status::NO_SUCH_VOLUME));
        let (step, out) = run(&mut hs, &[Message::Open { session: 0, slot: 0, name: "vol0".into() }]);
        let Step::Done(conn) = step else { panic!("{step:?}") };
        let Message::OpenReply(info) = &out[0] else { panic!("{out:?}") };
        assert_eq!((info.size, info.block_size, info.queue_depth, info.instance), (1 << 20, 512, 32, 5));
        assert_eq!(info.generation, b.catalog.get("vol0").unwrap().generation());
        assert_eq!(b.sessions.connections(info.session), 1);
        assert!(conn.describe().contains("digests true"));
        drop(conn);
        assert_eq!(b.sessions.connections(info.session), 0, "the session ends with its last connection");
    }

    #[test]
    fn auth_is_required_and_checked() {
        let secret = b"sesame";
        let nonce = [9u8; 32];
        let good = fastsan_brp::auth::client_proof(secret, &CHALLENGE, &nonce);
        // The right proof: AUTH_OK carries the target's proof.
        let mut hs = BrpHandshake::new(brp(Some(secret)), CHALLENGE);
        let (_, out) = run(&mut hs, &[hello(), Message::Auth { client_nonce: nonce, proof: good }]);
        assert!(matches!(&out[0], Message::HelloReply { auth: AUTH_HMAC_SHA256, .. }));
        let Message::AuthOk { proof } = &out[1] else { panic!("{out:?}") };
        assert!(fastsan_brp::auth::verify_server(secret, &CHALLENGE, &nonce, proof));
        // A wrong proof: refused and counted.
        let b = brp(Some(secret));
        let mut hs = BrpHandshake::new(b.clone(), CHALLENGE);
        let (step, out) = run(&mut hs, &[hello(), Message::Auth { client_nonce: nonce, proof: [0; 32] }]);
        assert!(matches!(step, Step::Refused(_)));
        assert!(matches!(&out[1], Message::Error { status, .. } if *status == Status::AUTH_FAILED));
        assert_eq!(b.stats.snapshot().auth_failures, 1);
        // Skipping AUTH: refused, and OPEN never reached.
        let mut hs = BrpHandshake::new(brp(Some(secret)), CHALLENGE);
        let (step, out) =
            run(&mut hs, &[hello(), Message::Open { session: 0, slot: 0, name: "vol0".into() }]);
        assert!(matches!(step, Step::Refused(_)));
        assert!(matches!(&out[1], Message::Error { status, .. } if *status == Status::AUTH_REQUIRED));
    }

    #[test]
    fn bad_versions_and_orders_are_refused_with_a_reason() {
        let mut hs = BrpHandshake::new(brp(None), CHALLENGE);
        let (step, out) = run(&mut hs, &[Message::Hello { min_version: 3, max_version: 4, features: 0 }]);
        assert!(matches!(&step, Step::Refused(why) if why.contains("3..=4")));
        assert!(matches!(&out[0], Message::Error { status, .. } if *status == Status::BAD_VERSION));
        let mut hs = BrpHandshake::new(brp(None), CHALLENGE);
        let (step, _) = run(&mut hs, &[Message::List]);
        assert!(matches!(&step, Step::Refused(why) if why.contains("LIST in the Hello phase")));
        let mut input = BytesMut::from(&b"definitely not BRP"[..]);
        let mut hs = BrpHandshake::new(brp(None), CHALLENGE);
        assert!(hs.advance(&mut input, &mut Vec::new()).is_err(), "bad magic is a protocol error");
    }

    #[test]
    fn pipelined_lists_are_answered_at_the_pace_they_are_read() {
        let mut hs = BrpHandshake::new(brp(None), CHALLENGE);
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
        let mut hs = BrpHandshake::new(brp(None), CHALLENGE);
        let mut all = hello().to_vec();
        all.extend(Message::Open { session: 0, slot: 0, name: "vol0".into() }.to_vec());
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
