//! The initiator's side of the handshake: HELLO, AUTH, LIST, OPEN.

use crate::{Error, Options};
use bytes::BytesMut;
use fastsan_brp::handshake::{parse_message, Message, OpenInfo, VolumeInfo, AUTH_HMAC_SHA256, AUTH_NONE};
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A connection in the handshake phase.
pub struct Handshake {
    pub stream: TcpStream,
    /// Bytes read past the last message (none, in a well-behaved exchange).
    pub buf: BytesMut,
    pub digests: bool,
}

impl Handshake {
    /// Connects, agrees on version and features, and authenticates.
    pub async fn start(addr: &str, opts: &Options) -> Result<Handshake, Error> {
        let connect = tokio::time::timeout(opts.connect_timeout, TcpStream::connect(addr));
        let stream = match connect.await {
            Err(_) => return Err(Error::Timeout("connect")),
            Ok(Err(source)) => return Err(Error::Connect { addr: addr.to_owned(), source }),
            Ok(Ok(s)) => s,
        };
        stream.set_nodelay(true)?;
        let mut hs = Handshake { stream, buf: BytesMut::with_capacity(4096), digests: false };
        let hello = Message::Hello {
            min_version: fastsan_brp::VERSION,
            max_version: fastsan_brp::VERSION,
            features: hello_features(opts),
        };
        let reply = tokio::time::timeout(opts.connect_timeout, hs.ask(&hello)).await;
        let (auth, challenge, features) = match reply.map_err(|_| Error::Timeout("handshake"))?? {
            Message::HelloReply { version, auth, features, challenge } => {
                if version != fastsan_brp::VERSION {
                    return Err(Error::BadVersion(version));
                }
                if features & !hello_features(opts) != 0 {
                    return Err(Error::UnrequestedFeatures(features & !hello_features(opts)));
                }
                (auth, challenge, features)
            }
            other => return Err(unexpected("HELLO_REPLY", other)),
        };
        hs.digests = features & fastsan_brp::FEATURE_DIGEST != 0;
        match (auth, &opts.secret) {
            (AUTH_NONE, None) => {}
            (AUTH_NONE, Some(_)) => return Err(Error::TargetNotAuthenticated),
            (AUTH_HMAC_SHA256, None) => return Err(Error::SecretRequired),
            (AUTH_HMAC_SHA256, Some(secret)) => {
                let mut nonce = [0u8; 32];
                rand::thread_rng().fill_bytes(&mut nonce);
                let proof = fastsan_brp::auth::client_proof(secret, &challenge, &nonce);
                match hs.ask(&Message::Auth { client_nonce: nonce, proof }).await? {
                    Message::AuthOk { proof }
                        if fastsan_brp::auth::verify_server(secret, &challenge, &nonce, &proof) => {}
                    Message::AuthOk { .. } => return Err(Error::TargetNotAuthenticated),
                    other => return Err(unexpected("AUTH_OK", other)),
                }
            }
            (other, _) => return Err(Error::UnknownAuth(other)),
        }
        Ok(hs)
    }

    pub async fn list(&mut self) -> Result<Vec<VolumeInfo>, Error> {
        match self.ask(&Message::List).await? {
            Message::ListReply { volumes } => Ok(volumes),
            other => Err(unexpected("LIST_REPLY", other)),
        }
    }

    /// Opens a volume, checking that the limits the target announces make sense.
    pub async fn open(&mut self, name: &str, session: u64) -> Result<OpenInfo, Error> {
        let info = match self.ask(&Message::Open { session, name: name.to_owned() }).await? {
            Message::OpenReply(info) => info,
            other => return Err(unexpected("OPEN_REPLY", other)),
        };
        let bs = info.block_size;
        let sane = bs.is_power_of_two()
            && info.max_transfer >= bs
            && info.max_transfer.is_multiple_of(bs)
            && info.size.is_multiple_of(bs as u64)
            && info.queue_depth >= 1
            && info.max_batch >= 1;
        if !sane {
            return Err(Error::ImpossibleLimits(info));
        }
        Ok(info)
    }

    async fn ask(&mut self, m: &Message) -> Result<Message, Error> {
        self.stream.write_all(&m.to_vec()).await?;
        loop {
            if let Some((m, n)) = parse_message(&self.buf)? {
                let _ = self.buf.split_to(n);
                return Ok(m);
            }
            self.buf.reserve(4096);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(Error::ConnectionLost);
            }
        }
    }
}

fn hello_features(opts: &Options) -> u32 {
    if opts.digests {
        fastsan_brp::FEATURE_DIGEST
    } else {
        0
    }
}

/// The error for message `m` arriving where `expected` should have: the
/// target's own refusal when it sent ERROR.
fn unexpected(expected: &'static str, m: Message) -> Error {
    match m {
        Message::Error { status, message } => Error::Refused { status, message },
        other => Error::UnexpectedMessage { expected, got: kind_name(&other) },
    }
}

/// The name `docs/protocol.md` gives a message kind.
fn kind_name(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "HELLO",
        Message::HelloReply { .. } => "HELLO_REPLY",
        Message::Auth { .. } => "AUTH",
        Message::AuthOk { .. } => "AUTH_OK",
        Message::List => "LIST",
        Message::ListReply { .. } => "LIST_REPLY",
        Message::Open { .. } => "OPEN",
        Message::OpenReply(_) => "OPEN_REPLY",
        Message::Error { .. } => "ERROR",
    }
}
