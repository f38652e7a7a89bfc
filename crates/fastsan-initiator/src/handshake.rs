//! The initiator's side of the handshake: HELLO, AUTH, LIST and OPEN.
//!
//! [`ClientHandshake`] makes every decision and does no I/O: it hands out
//! the bytes to send, takes the bytes that arrive, and answers with a
//! [`Step`] or an [`Error`]. [`Handshake`] drives it over a socket, with
//! the timeouts of [`Options`]. Tests feed the machine fabricated target
//! messages; the `initiator_handshake` fuzz target feeds it anything.

use crate::transport::Stream;
use crate::url::Endpoint;
use crate::{Error, Options};
use bytes::BytesMut;
use fastsan_brp::auth;
use fastsan_brp::handshake::{parse_message, Message, OpenInfo, VolumeInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use rand::RngCore;

/// What the caller of [`ClientHandshake::receive`] does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send these bytes to the target, then call `receive` again (with no
    /// new bytes, or with what arrived meanwhile).
    Send(Vec<u8>),
    /// No whole message yet: read more bytes and pass them to `receive`.
    NeedMore,
    /// Version and features agreed, the target authenticated if a secret is
    /// set: [`ClientHandshake::list`] or [`ClientHandshake::open`] may follow.
    Ready,
    /// The target's answer to LIST; the handshake is [`Step::Ready`] again.
    Listed(Vec<VolumeInfo>),
    /// The target's answer to OPEN, with limits that make sense. The
    /// handshake is over: [`ClientHandshake::into_leftover`] gives the bytes
    /// that arrived after OPEN_REPLY, if any, to the transmission phase.
    Opened(OpenInfo),
}

/// What the machine waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    HelloReply,
    AuthOk {
        challenge: [u8; 32],
    },
    /// Nothing: the caller may send LIST or OPEN.
    Ready,
    ListReply,
    OpenReply,
    /// OPEN_REPLY came, or an error did: nothing more.
    Done,
}

impl State {
    fn expects(self) -> &'static str {
        match self {
            State::HelloReply => "HELLO_REPLY",
            State::AuthOk { .. } => "AUTH_OK",
            State::ListReply => "LIST_REPLY",
            State::OpenReply => "OPEN_REPLY",
            State::Ready | State::Done => "no message",
        }
    }
}

/// The initiator's handshake as a state machine, without I/O.
///
/// Send [`hello`](Self::hello); pass every byte the target sends to
/// [`receive`](Self::receive) and act on the [`Step`] it returns until
/// [`Step::Ready`]; then ask with [`list`](Self::list) or
/// [`open`](Self::open) and keep receiving until [`Step::Listed`] or
/// [`Step::Opened`].
///
/// # Panics
/// Like a future polled after it completed, the machine panics when used
/// out of order: `list` or `open` before [`Step::Ready`], or `receive`
/// after [`Step::Opened`] or after it returned an error.
pub struct ClientHandshake {
    state: State,
    /// The features HELLO asks for.
    features: u32,
    /// The target agreed on `FEATURE_TAKEOVER`.
    takeover: bool,
    secret: Option<Vec<u8>>,
    identity: String,
    /// The connection runs over TLS: the target proved itself with its certificate.
    tls: bool,
    nonce: [u8; 32],
    /// Bytes received and not yet parsed.
    buf: BytesMut,
    digests: bool,
}

impl ClientHandshake {
    /// A handshake with the version, features and secret of `opts`;
    /// `client_nonce` must be random (tests pass a fixed one).
    pub fn new(opts: &Options, client_nonce: [u8; 32]) -> ClientHandshake {
        ClientHandshake {
            state: State::HelloReply,
            features: if opts.digests { fastsan_brp::FEATURE_DIGEST } else { 0 }
                // A session taken over from a predecessor is opened with OPEN_TAKEOVER.
                | if opts.session != 0 { fastsan_brp::FEATURE_TAKEOVER } else { 0 },
            takeover: false,
            secret: opts.secret.clone(),
            identity: opts.identity.clone(),
            tls: false,
            nonce: client_nonce,
            buf: BytesMut::new(),
            digests: false,
        }
    }

    /// The HELLO message that opens the exchange.
    pub fn hello(&self) -> Vec<u8> {
        Message::Hello {
            min_version: fastsan_brp::VERSION,
            max_version: fastsan_brp::VERSION,
            features: self.features,
        }
        .to_vec()
    }

    /// LIST, to send once [`Step::Ready`].
    pub fn list(&mut self) -> Vec<u8> {
        self.ask(State::ListReply, Message::List)
    }

    /// OPEN of `name`, to send once [`Step::Ready`]; `session` 0 starts a
    /// new session, another value joins that one as connection `slot`.
    /// `takeover`: this process takes `session` over from a predecessor
    /// (its first OPEN of it): the target is asked to stop and fence every
    /// connection the predecessor left, in every slot (`OPEN_TAKEOVER`),
    /// when it agreed on that feature.
    pub fn open(&mut self, name: &str, session: u64, slot: u16, takeover: bool) -> Vec<u8> {
        let takeover = takeover && session != 0;
        if takeover && !self.takeover {
            tracing::warn!(
                session = format_args!("{session:016x}"),
                "the target cannot take a session over (no FEATURE_TAKEOVER): \
                 only the predecessor's connection in slot {slot} is fenced"
            );
        }
        let flags = if takeover && self.takeover { fastsan_brp::handshake::OPEN_TAKEOVER } else { 0 };
        self.ask(State::OpenReply, Message::Open { session, slot, flags, name: name.to_owned() })
    }

    fn ask(&mut self, next: State, m: Message) -> Vec<u8> {
        assert_eq!(self.state, State::Ready, "ClientHandshake: LIST or OPEN before the handshake is ready");
        self.state = next;
        m.to_vec()
    }

    /// Takes bytes from the target (possibly none) and handles at most one
    /// whole message. After any step but `NeedMore`, call again with no
    /// bytes: more than one message may have arrived at once.
    pub fn receive(&mut self, data: &[u8]) -> Result<Step, Error> {
        assert_ne!(self.state, State::Done, "ClientHandshake::receive after the handshake ended");
        self.buf.extend_from_slice(data);
        let r = match parse_message(&self.buf) {
            Ok(None) => return Ok(Step::NeedMore),
            Ok(Some((m, n))) => {
                let _ = self.buf.split_to(n);
                self.handle(m)
            }
            // An NBD server's greeting ("NBDMAGIC") where a BRP target's
            // HELLO_REPLY should be: say what the address serves.
            Err(fastsan_brp::ProtocolError::BadMagic(m)) if m == u32::from_le_bytes(*b"NBDM") => {
                Err(Error::InvalidArgument(
                    "the address answers as an NBD server, not a BRP target: use nbd://HOST:PORT/EXPORT"
                        .into(),
                ))
            }
            Err(e) => Err(e.into()),
        };
        if r.is_err() {
            self.state = State::Done;
        }
        r
    }

    fn handle(&mut self, m: Message) -> Result<Step, Error> {
        match (self.state, m) {
            (_, Message::Error { status, message }) => Err(Error::Refused { status, message }),
            (State::HelloReply, Message::HelloReply { version, auth, features, challenge }) => {
                self.hello_reply(version, auth, features, challenge)
            }
            (State::AuthOk { challenge }, Message::AuthOk { proof }) => {
                let secret = self.secret.as_deref().expect("AUTH is sent only with a secret");
                if !auth::verify_server(secret, &challenge, &self.nonce, &proof, &self.identity) {
                    return Err(Error::TargetNotAuthenticated);
                }
                self.state = State::Ready;
                Ok(Step::Ready)
            }
            (State::ListReply, Message::ListReply { volumes }) => {
                self.state = State::Ready;
                Ok(Step::Listed(volumes))
            }
            (State::OpenReply, Message::OpenReply(info)) => {
                if !limits_make_sense(&info) {
                    return Err(Error::ImpossibleLimits(info));
                }
                self.state = State::Done;
                Ok(Step::Opened(info))
            }
            (state, other) => Err(Error::UnexpectedMessage { expected: state.expects(), got: other.name() }),
        }
    }

    fn hello_reply(
        &mut self,
        version: u16,
        method: u8,
        features: u32,
        challenge: [u8; 32],
    ) -> Result<Step, Error> {
        if version != fastsan_brp::VERSION {
            return Err(Error::BadVersion(version));
        }
        if features & !self.features != 0 {
            return Err(Error::UnrequestedFeatures(features & !self.features));
        }
        self.digests = features & fastsan_brp::FEATURE_DIGEST != 0;
        self.takeover = features & fastsan_brp::FEATURE_TAKEOVER != 0;
        match (method, &self.secret) {
            (AUTH_NONE, None) => {
                self.state = State::Ready;
                Ok(Step::Ready)
            }
            // Over TLS the target proved itself with its certificate, and
            // took the client's certificate for its identity.
            (AUTH_NONE, Some(_)) if self.tls => {
                self.state = State::Ready;
                Ok(Step::Ready)
            }
            // A client holding a secret trusts only a target that proves it knows it.
            (AUTH_NONE, Some(_)) => Err(Error::TargetNotAuthenticated),
            (AUTH_HMAC_SHA256, None) => Err(Error::SecretRequired),
            (AUTH_HMAC_SHA256, Some(secret)) => {
                let proof = auth::client_proof(secret, &challenge, &self.nonce, &self.identity);
                self.state = State::AuthOk { challenge };
                let identity = self.identity.clone();
                Ok(Step::Send(Message::Auth { client_nonce: self.nonce, proof, identity }.to_vec()))
            }
            (other, _) => Err(Error::UnknownAuth(other)),
        }
    }

    /// Whether HELLO_REPLY enabled CRC32C digests.
    pub fn digests(&self) -> bool {
        self.digests
    }

    /// The bytes received after the last message handled.
    pub fn into_leftover(self) -> BytesMut {
        self.buf
    }
}

/// Whether every request could meet the limits OPEN_REPLY announces, and
/// its reply the protocol's: a transfer limit over the largest payload a
/// reply may carry made every large read's reply a protocol error (its
/// connection cut and the read sent again, until the reconnect timeout).
fn limits_make_sense(info: &OpenInfo) -> bool {
    let bs = info.block_size;
    bs.is_power_of_two()
        && info.max_transfer >= bs
        && info.max_transfer <= fastsan_brp::limits::MAX_PAYLOAD
        && info.max_transfer.is_multiple_of(bs)
        && info.size.is_multiple_of(bs as u64)
        && info.queue_depth >= 1
        && info.max_batch >= 1
}

/// A connection in the handshake phase: a [`ClientHandshake`] driven over a socket.
pub struct Handshake {
    stream: Stream,
    machine: ClientHandshake,
    /// Bound on each exchange (LIST, OPEN): a silent target is an error, never a hang.
    step_timeout: std::time::Duration,
}

impl Handshake {
    /// Connects, agrees on version and features, and authenticates, each
    /// of connecting and the exchange within `opts.connect_timeout`.
    pub async fn start(endpoint: &Endpoint, opts: &Options) -> Result<Handshake, Error> {
        let connect =
            tokio::time::timeout(opts.connect_timeout, Stream::connect(endpoint, opts.tls.as_ref()));
        let stream = match connect.await {
            Err(_) => return Err(Error::Timeout("connect")),
            Ok(Err(source)) => return Err(Error::Connect { addr: endpoint.to_string(), source }),
            Ok(Ok(s)) => s,
        };
        let mut nonce = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut nonce);
        let step_timeout = opts.connect_timeout;
        let mut machine = ClientHandshake::new(opts, nonce);
        machine.tls = matches!(stream, Stream::Tls(_));
        let mut hs = Handshake { stream, machine, step_timeout };
        let hello = hs.machine.hello();
        match hs.exchange(hello, "HELLO").await? {
            Step::Ready => Ok(hs),
            other => unreachable!("HELLO ends in Ready, not {other:?}"),
        }
    }

    pub async fn list(&mut self) -> Result<Vec<VolumeInfo>, Error> {
        let list = self.machine.list();
        match self.exchange(list, "LIST").await? {
            Step::Listed(volumes) => Ok(volumes),
            other => unreachable!("LIST ends in Listed, not {other:?}"),
        }
    }

    /// Opens a volume as connection `slot` of `session` (0: a new session),
    /// checking that the limits the target announces make sense;
    /// `takeover`: see [`ClientHandshake::open`].
    pub async fn open(
        &mut self,
        name: &str,
        session: u64,
        slot: u16,
        takeover: bool,
    ) -> Result<OpenInfo, Error> {
        let open = self.machine.open(name, session, slot, takeover);
        match self.exchange(open, "OPEN").await? {
            Step::Opened(info) => Ok(info),
            other => unreachable!("OPEN ends in Opened, not {other:?}"),
        }
    }

    /// Sends `out`, then feeds what arrives to the machine, sending what it
    /// asks to on the way, until it answers, within the step timeout.
    async fn exchange(&mut self, out: Vec<u8>, what: &'static str) -> Result<Step, Error> {
        let timeout = self.step_timeout;
        tokio::time::timeout(timeout, self.exchange_now(out)).await.map_err(|_| Error::Timeout(what))?
    }

    async fn exchange_now(&mut self, out: Vec<u8>) -> Result<Step, Error> {
        self.stream.write_all(&out).await?;
        let mut chunk = [0u8; 4096];
        let mut step = self.machine.receive(&[])?;
        loop {
            step = match step {
                Step::Send(bytes) => {
                    self.stream.write_all(&bytes).await?;
                    self.machine.receive(&[])?
                }
                Step::NeedMore => match self.stream.read(&mut chunk).await? {
                    0 => return Err(Error::ConnectionLost),
                    n => self.machine.receive(&chunk[..n])?,
                },
                answer => return Ok(answer),
            };
        }
    }

    /// The socket, the bytes read past OPEN_REPLY (none from a well-behaved
    /// target), and whether digests are on.
    pub(crate) fn into_parts(self) -> (Stream, BytesMut, bool) {
        let digests = self.machine.digests();
        (self.stream, self.machine.into_leftover(), digests)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastsan_brp::{Status, FEATURE_DIGEST};

    const NONCE: [u8; 32] = [5; 32];
    const CHALLENGE: [u8; 32] = [9; 32];
    const SECRET: &[u8] = b"s3cret";

    fn machine(secret: Option<&[u8]>) -> ClientHandshake {
        ClientHandshake::new(&Options { secret: secret.map(<[u8]>::to_vec), ..Default::default() }, NONCE)
    }

    fn hello_reply(auth: u8, features: u32) -> Vec<u8> {
        Message::HelloReply { version: fastsan_brp::VERSION, auth, features, challenge: CHALLENGE }.to_vec()
    }

    fn info() -> OpenInfo {
        OpenInfo {
            session: 7,
            size: 1 << 20,
            block_size: 512,
            max_transfer: 1 << 20,
            queue_depth: 64,
            max_batch: 32,
            flags: 0,
            instance: 1,
            generation: 1,
            boot: 1,
        }
    }

    fn sent(bytes: &[u8]) -> Message {
        let (m, n) = parse_message(bytes).unwrap().unwrap();
        assert_eq!(n, bytes.len());
        m
    }

    /// A machine past HELLO_REPLY without authentication.
    fn ready() -> ClientHandshake {
        let mut hs = machine(None);
        assert_eq!(hs.receive(&hello_reply(AUTH_NONE, 0)).unwrap(), Step::Ready);
        hs
    }

    #[test]
    fn success_without_auth() {
        let mut hs = machine(None);
        assert_eq!(sent(&hs.hello()), Message::Hello { min_version: 2, max_version: 2, features: 0 });
        assert_eq!(hs.receive(&[]).unwrap(), Step::NeedMore);
        assert_eq!(hs.receive(&hello_reply(AUTH_NONE, 0)).unwrap(), Step::Ready);
        assert!(!hs.digests());
        assert_eq!(
            sent(&hs.open("vol0", 0, 0, false)),
            Message::Open { session: 0, slot: 0, flags: 0, name: "vol0".into() }
        );
        assert_eq!(hs.receive(&Message::OpenReply(info()).to_vec()).unwrap(), Step::Opened(info()));
        assert!(hs.into_leftover().is_empty());
    }

    /// A session given in the options is taken over: HELLO asks for the
    /// feature, and the first OPEN carries OPEN_TAKEOVER only when the
    /// target agreed (an older target would refuse the flag).
    #[test]
    fn a_session_taken_over_is_opened_with_the_takeover_flag_when_agreed() {
        use fastsan_brp::{handshake::OPEN_TAKEOVER, FEATURE_TAKEOVER};
        let opts = Options { session: 7, ..Default::default() };
        for (agreed, flags) in [(FEATURE_TAKEOVER, OPEN_TAKEOVER), (0, 0)] {
            let mut hs = ClientHandshake::new(&opts, NONCE);
            assert_eq!(
                sent(&hs.hello()),
                Message::Hello { min_version: 2, max_version: 2, features: FEATURE_TAKEOVER }
            );
            assert_eq!(hs.receive(&hello_reply(AUTH_NONE, agreed)).unwrap(), Step::Ready);
            let Message::Open { session, flags: f, .. } = sent(&hs.open("v", 7, 0, true)) else { panic!() };
            assert_eq!((session, f), (7, flags), "agreed {agreed}");
        }
        // A reconnect of one slot never takes over.
        let mut hs = ClientHandshake::new(&opts, NONCE);
        hs.receive(&hello_reply(AUTH_NONE, FEATURE_TAKEOVER)).unwrap();
        let Message::Open { flags, .. } = sent(&hs.open("v", 7, 2, false)) else { panic!() };
        assert_eq!(flags, 0);
    }

    #[test]
    fn success_with_auth_then_list() {
        let mut hs = machine(Some(SECRET));
        let Step::Send(auth) = hs.receive(&hello_reply(AUTH_HMAC_SHA256, 0)).unwrap() else { panic!() };
        let Message::Auth { client_nonce, proof, identity } = sent(&auth) else { panic!() };
        assert_eq!((client_nonce, identity.as_str()), (NONCE, ""));
        assert!(
            auth::verify_client(SECRET, &CHALLENGE, &NONCE, &proof, ""),
            "the target can check the proof"
        );
        let ok = Message::AuthOk { proof: auth::server_proof(SECRET, &CHALLENGE, &NONCE, "") };
        assert_eq!(hs.receive(&ok.to_vec()).unwrap(), Step::Ready);
        assert_eq!(sent(&hs.list()), Message::List);
        let volumes = vec![VolumeInfo { name: "v".into(), size: 4096, block_size: 512, flags: 0 }];
        let reply = Message::ListReply { volumes: volumes.clone() }.to_vec();
        assert_eq!(hs.receive(&reply).unwrap(), Step::Listed(volumes));
        // Ready again: OPEN may follow LIST.
        hs.open("v", 0, 0, false);
        assert_eq!(hs.receive(&Message::OpenReply(info()).to_vec()).unwrap(), Step::Opened(info()));
    }

    #[test]
    fn wrong_server_proof_is_refused() {
        let mut hs = machine(Some(SECRET));
        assert!(matches!(hs.receive(&hello_reply(AUTH_HMAC_SHA256, 0)), Ok(Step::Send(_))));
        let forged = Message::AuthOk { proof: auth::server_proof(b"guess", &CHALLENGE, &NONCE, "") };
        assert!(matches!(hs.receive(&forged.to_vec()), Err(Error::TargetNotAuthenticated)));
    }

    #[test]
    fn target_refusals_carry_status_and_message() {
        let refuse = |status| Message::Error { status, message: "no".into() }.to_vec();
        let mut hs = machine(None);
        match hs.receive(&refuse(Status::BAD_VERSION)) {
            Err(Error::Refused { status, message }) => {
                assert_eq!((status, &*message), (Status::BAD_VERSION, "no"))
            }
            other => panic!("{other:?}"),
        }
        // A wrong secret: the target answers AUTH with ERROR.
        let mut hs = machine(Some(SECRET));
        hs.receive(&hello_reply(AUTH_HMAC_SHA256, 0)).unwrap();
        let r = hs.receive(&refuse(Status::AUTH_FAILED));
        assert!(matches!(r, Err(Error::Refused { status: Status::AUTH_FAILED, .. })), "{r:?}");
        let mut hs = ready();
        hs.open("nope", 0, 0, false);
        let r = hs.receive(&refuse(Status::NO_SUCH_VOLUME));
        assert!(matches!(r, Err(Error::Refused { status: Status::NO_SUCH_VOLUME, .. })), "{r:?}");
    }

    #[test]
    fn secrets_on_one_side_only_are_refused() {
        let r = machine(None).receive(&hello_reply(AUTH_HMAC_SHA256, 0));
        assert!(matches!(r, Err(Error::SecretRequired)), "{r:?}");
        let r = machine(Some(SECRET)).receive(&hello_reply(AUTH_NONE, 0));
        assert!(matches!(r, Err(Error::TargetNotAuthenticated)), "{r:?}");
    }

    #[test]
    fn hello_reply_must_match_what_was_offered() {
        let reply = |version, auth, features| {
            Message::HelloReply { version, auth, features, challenge: CHALLENGE }.to_vec()
        };
        let v = fastsan_brp::VERSION;
        let r = machine(None).receive(&reply(v + 1, AUTH_NONE, 0));
        assert!(matches!(r, Err(Error::BadVersion(3))), "{r:?}");
        let r = machine(None).receive(&reply(v, AUTH_NONE, FEATURE_DIGEST | 8));
        assert!(matches!(r, Err(Error::UnrequestedFeatures(9))), "{r:?}");
        let r = machine(None).receive(&reply(v, 7, 0));
        assert!(matches!(r, Err(Error::UnknownAuth(7))), "{r:?}");
        // Asked for digests: the target may enable them.
        let mut hs = ClientHandshake::new(&Options { digests: true, ..Default::default() }, NONCE);
        assert_eq!(
            sent(&hs.hello()),
            Message::Hello { min_version: 2, max_version: 2, features: FEATURE_DIGEST }
        );
        assert_eq!(hs.receive(&reply(v, AUTH_NONE, FEATURE_DIGEST)).unwrap(), Step::Ready);
        assert!(hs.digests());
    }

    #[test]
    fn messages_out_of_order_are_unexpected() {
        let r = machine(None).receive(&Message::OpenReply(info()).to_vec());
        assert!(matches!(r, Err(Error::UnexpectedMessage { expected: "HELLO_REPLY", got: "OPEN_REPLY" })));
        let mut hs = ready();
        hs.list();
        let r = hs.receive(&Message::OpenReply(info()).to_vec());
        assert!(matches!(r, Err(Error::UnexpectedMessage { expected: "LIST_REPLY", got: "OPEN_REPLY" })));
        // Nothing asked, yet the target speaks.
        let r = ready().receive(&Message::AuthOk { proof: [0; 32] }.to_vec());
        assert!(matches!(r, Err(Error::UnexpectedMessage { got: "AUTH_OK", .. })), "{r:?}");
        // A client's message coming back.
        let r = machine(None).receive(&Message::List.to_vec());
        assert!(matches!(r, Err(Error::UnexpectedMessage { got: "LIST", .. })), "{r:?}");
    }

    #[test]
    fn impossible_limits_are_refused() {
        let bad = [
            OpenInfo { block_size: 1000, ..info() },
            OpenInfo { block_size: 0, ..info() },
            OpenInfo { max_transfer: 256, ..info() },
            OpenInfo { max_transfer: 4096 + 512 + 1, ..info() },
            OpenInfo { max_transfer: 32 << 20, ..info() },
            OpenInfo { size: (1 << 20) + 1, ..info() },
            OpenInfo { queue_depth: 0, ..info() },
            OpenInfo { max_batch: 0, ..info() },
        ];
        for limits in bad {
            let mut hs = ready();
            hs.open("v", 0, 0, false);
            match hs.receive(&Message::OpenReply(limits).to_vec()) {
                Err(Error::ImpossibleLimits(i)) => assert_eq!(i, limits),
                other => panic!("{limits:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn bytes_may_arrive_one_at_a_time() {
        let mut hs = machine(Some(SECRET));
        let ok = Message::AuthOk { proof: auth::server_proof(SECRET, &CHALLENGE, &NONCE, "") }.to_vec();
        let open = Message::OpenReply(info()).to_vec();
        let feed = |hs: &mut ClientHandshake, bytes: &[u8]| {
            for &b in &bytes[..bytes.len() - 1] {
                assert_eq!(hs.receive(&[b]).unwrap(), Step::NeedMore);
            }
            hs.receive(&bytes[bytes.len() - 1..]).unwrap()
        };
        assert!(matches!(feed(&mut hs, &hello_reply(AUTH_HMAC_SHA256, 0)), Step::Send(_)));
        assert_eq!(feed(&mut hs, &ok), Step::Ready);
        hs.open("v", 0, 0, false);
        assert_eq!(feed(&mut hs, &open), Step::Opened(info()));
    }

    #[test]
    fn messages_arriving_together_are_handled_one_per_call() {
        let mut hs = machine(None);
        let mut both = hello_reply(AUTH_NONE, 0);
        both.extend(Message::ListReply { volumes: vec![] }.to_vec());
        assert_eq!(hs.receive(&both).unwrap(), Step::Ready);
        // The target answered a LIST never sent.
        let r = hs.receive(&[]);
        assert!(matches!(r, Err(Error::UnexpectedMessage { got: "LIST_REPLY", .. })), "{r:?}");
        // Bytes past OPEN_REPLY go to the transmission phase untouched.
        let mut hs = ready();
        hs.open("v", 0, 0, false);
        let mut reply = Message::OpenReply(info()).to_vec();
        reply.extend_from_slice(b"next");
        assert_eq!(hs.receive(&reply).unwrap(), Step::Opened(info()));
        assert_eq!(&hs.into_leftover()[..], b"next");
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        let r = machine(None).receive(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        assert!(matches!(r, Err(Error::Protocol(fastsan_brp::ProtocolError::BadMagic(_)))), "{r:?}");
        let mut truncated = hello_reply(AUTH_NONE, 0);
        truncated[8] -= 1; // the payload is a byte shorter than HELLO_REPLY's
        truncated.pop();
        assert!(matches!(machine(None).receive(&truncated), Err(Error::Protocol(_))));
    }

    /// The next whole message a fake target receives.
    async fn next_message(s: &mut tokio::net::UnixStream, buf: &mut Vec<u8>) -> Message {
        use tokio::io::AsyncReadExt;
        loop {
            if let Some((m, n)) = parse_message(buf).unwrap() {
                buf.drain(..n);
                return m;
            }
            let mut chunk = [0u8; 64];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the initiator hung up");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// The driver over a unix socket, against a fake target built from the codec.
    #[tokio::test]
    async fn driver_opens_a_volume_over_a_unix_socket() {
        use tokio::io::AsyncWriteExt;
        let dir = std::env::temp_dir().join(format!("fastsan-handshake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.sock");
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let target = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            assert!(matches!(next_message(&mut s, &mut buf).await, Message::Hello { .. }));
            s.write_all(&hello_reply(AUTH_NONE, 0)).await.unwrap();
            let open = next_message(&mut s, &mut buf).await;
            assert_eq!(open, Message::Open { session: 0, slot: 0, flags: 0, name: "v".into() });
            s.write_all(&Message::OpenReply(info()).to_vec()).await.unwrap();
            s
        });
        let mut hs = Handshake::start(&Endpoint::Unix(path), &Options::default()).await.unwrap();
        assert_eq!(hs.open("v", 0, 0, false).await.unwrap(), info());
        let (stream, leftover, digests) = hs.into_parts();
        assert!(matches!(stream, Stream::Unix(_)) && leftover.is_empty() && !digests);
        drop(target.await.unwrap());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    #[should_panic(expected = "before the handshake is ready")]
    fn open_before_ready_is_a_bug() {
        machine(None).open("v", 0, 0, false);
    }

    #[test]
    #[should_panic(expected = "after the handshake ended")]
    fn receive_after_an_error_is_a_bug() {
        let mut hs = machine(None);
        let _ = hs.receive(b"garbage garbage");
        let _ = hs.receive(&[]);
    }
}
