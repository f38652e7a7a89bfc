//! Front ends: one module per wire protocol. A front end is three things,
//! and nothing else (the connection itself is [`crate::driver`]'s):
//! - a **handshake**, a sans-IO state machine ([`Handshake`]): bytes in,
//!   bytes out, no awaits, so it is unit-tested and fuzzed without sockets;
//! - **decode** ([`Transmission::decode`]): the protocol's wire rules, from
//!   a frame to a protocol-neutral [`IoRequest`] (not yet checked against the
//!   volume: [`Volume::validate`](crate::volume::Volume::validate) does that);
//! - an **encoder** ([`Encoder`]) for its replies, and the one function that
//!   maps a [`Refusal`] to its wire code.

pub mod brp;
pub mod nbd;
pub mod nvme;

use crate::access::Who;
use crate::fence::Activity;
use crate::pipeline::Encoder;
use crate::request::{IoRequest, Limits, Refusal};
use crate::sessions::Fence;
use crate::volume::{Outcome, Volume};
use bytes::BytesMut;
use std::sync::Arc;

/// A handshake stops consuming messages once it has this many bytes of
/// replies to send, so a client that pipelines thousands of LISTs gets them
/// answered at the pace it reads them, not buffered in the target.
pub const OUT_CAP: usize = 64 * 1024;

/// A protocol error: the peer broke the protocol and the connection closes.
pub type WireError = Box<dyn std::error::Error + Send + Sync>;

/// A protocol the target serves.
pub trait Frontend: Send + Sync + 'static {
    type Handshake: Handshake<Conn = Self::Conn>;
    type Conn: Transmission;
    /// For logs: `BRP`, `NBD`.
    const NAME: &'static str;
    /// A new connection's handshake, for the client `who` (its address; no
    /// identity yet).
    fn handshake(&self, who: Who) -> Self::Handshake;
    /// What to send a client refused for being over the connection cap, if
    /// the protocol has a way to say it.
    fn busy(&self) -> Option<Vec<u8>>;
}

/// What a handshake step decided.
#[derive(Debug)]
pub enum Step<C> {
    /// Send what is in `out` (if anything) and feed more bytes.
    Continue,
    /// Send what is in `out`; the transmission phase starts with `C`.
    Done(C),
    /// Send what is in `out`, then close: the client left politely (NBD's ABORT).
    Abort,
    /// Send what is in `out`, then close: the request was refused, for this reason.
    Refused(String),
    /// Send what is in `out`, then close: the client failed to authenticate
    /// (counted against its address).
    AuthFailed(String),
    /// Send what is in `out`, then run a TLS handshake and go on over it
    /// ([`Handshake::tls_started`]). `replay`: the bytes buffered are the
    /// client's first TLS bytes (BRP); otherwise nothing may be buffered
    /// (NBD's STARTTLS: plaintext sent after it is an injection attempt).
    StartTls { replay: bool },
}

/// A handshake as a state machine. The driver calls [`Handshake::start`]
/// once, then [`Handshake::advance`] whenever bytes arrive.
pub trait Handshake: Send {
    type Conn;
    /// What the target says first, before reading anything (NBD's greeting).
    fn start(&mut self, out: &mut Vec<u8>);
    /// Consumes complete messages at the front of `input`, appending replies
    /// to `out`, until `input` holds no complete message or `out` reaches
    /// [`OUT_CAP`] (the driver sends `out` and calls again before reading).
    /// An error closes the connection (after `out` is sent).
    fn advance(&mut self, input: &mut BytesMut, out: &mut Vec<u8>) -> Result<Step<Self::Conn>, WireError>;
    /// TLS is up after [`Step::StartTls`]; `identity` is the verified client
    /// certificate's, if the client presented one.
    fn tls_started(&mut self, identity: Option<String>);
}

/// What [`Transmission::decode`] found at the front of the buffer.
#[derive(Debug)]
pub enum Decoded<M> {
    /// A request on the connection's volume number `volume` (an index into
    /// [`Transmission::volumes`]), refused already when its wire form is wrong.
    Request { volume: u32, tag: u64, meta: M, req: Result<IoRequest, Refusal> },
    /// Answered by the front end itself, without a volume (NVMe's admin
    /// commands, an R2T asking for a write's data): the reply is queued with
    /// the others, holds no credit and is not counted as a request.
    Local { tag: u64, meta: M, result: Result<Outcome, Refusal> },
    /// The next frame is not all there: it needs `need` bytes in all (0 if unknown).
    Incomplete { need: usize },
    /// The client said goodbye (NBD's DISC).
    Disconnect,
}

/// The write a large frame carries, seen from its header before the rest
/// of it arrives ([`Transmission::arriving`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arriving {
    /// An index into [`Transmission::volumes`].
    pub volume: u32,
    /// Its offset and length in bytes; none when the frame holds several
    /// (BRP's BATCH) or they are not at hand.
    pub range: Option<(u64, u64)>,
}

/// A connection in its transmission phase, as a front end sees it.
pub trait Transmission: Send + 'static {
    type Encoder: Encoder;
    /// The volumes its [`Decoded::Request`]s may name, by index: BRP's and
    /// NBD's one (the export), or an NVMe subsystem's namespaces (NSID - 1:
    /// one I/O queue reaches every namespace). Fixed for the connection's
    /// life, so the driver takes them once and a request names its volume
    /// without touching a reference count.
    fn volumes(&self) -> &[Arc<Volume>];
    /// The front end's limits on top of the volume's.
    fn limits(&self) -> Limits;
    fn encoder(&self) -> Self::Encoder;
    /// The settings negotiated, for the "connection open" log line.
    fn describe(&self) -> String;
    /// Takes the next request off the front of `buf`.
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded<<Self::Encoder as Encoder>::Meta>, WireError>;
    /// The connection's activity (stopped when the connection is lost or
    /// replaced; see [`crate::fence`]).
    fn activity(&self) -> Arc<Activity>;
    /// What the last handshake reply must wait for, once (BRP's session fence).
    fn fence(&mut self) -> Option<Fence> {
        None
    }
    /// What to send before closing after [`Transmission::decode`] failed,
    /// if the protocol has a way to say why (NVMe/TCP's C2HTermReq).
    fn farewell(&mut self) -> Option<Vec<u8>> {
        None
    }
    /// What the payload of the incomplete frame at the front of `buf`
    /// writes, when its header says: the driver holds its byte budget while
    /// it arrives. None: nothing to charge (a frame that writes nothing, or
    /// that will be refused whatever it holds).
    fn arriving(&self, _buf: &BytesMut) -> Option<Arriving> {
        None
    }
    /// Whether the stream ending now would cut a frame in half.
    fn mid_frame(&self, buf: &BytesMut) -> bool {
        !buf.is_empty()
    }
    /// Whether the request just decoded was the last of a frame that carried
    /// several (BRP's BATCH): its replies may leave before the next frame of
    /// the same read runs, so that a client with two frames in flight gets
    /// the first frame's answers while the target runs the second.
    fn frame_ended(&self) -> bool {
        false
    }
}
