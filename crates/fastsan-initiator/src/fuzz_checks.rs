//! The property the `initiator_handshake` fuzz target checks, kept here so
//! that the fuzzer (`fuzz/fuzz_targets/initiator_handshake.rs`) and the
//! corpus regression test run the same code.

use crate::handshake::{ClientHandshake, Step};
use crate::Options;

/// The secret of the runs that have one; the seed corpus proves it.
pub const SECRET: &[u8] = b"fuzz-secret";
/// The client nonce of every run, so that a seed can hold a valid AUTH_OK.
pub const NONCE: [u8; 32] = [0x5a; 32];

/// Arbitrary bytes as everything a target sends, fed whole, one byte at a
/// time and in 7-byte pieces, to a client without a secret and one with
/// [`SECRET`] and digests asked for. The client asks LIST once ready, then
/// OPEN. It must never panic, never be ready with a secret unless it sent
/// AUTH, and never accept impossible limits.
pub fn handshake(data: &[u8]) {
    for opts in
        [Options::default(), Options { secret: Some(SECRET.to_vec()), digests: true, ..Options::default() }]
    {
        for piece in [data.len().max(1), 1, 7] {
            run(data, piece, &opts);
        }
    }
}

fn run(data: &[u8], piece: usize, opts: &Options) {
    let mut hs = ClientHandshake::new(opts, NONCE);
    let _ = hs.hello();
    let mut pieces = data.chunks(piece);
    let (mut sent_auth, mut listed) = (false, false);
    let mut step = hs.receive(&[]);
    loop {
        step = match step {
            Err(_) => return,
            Ok(Step::NeedMore) => match pieces.next() {
                Some(p) => hs.receive(p),
                None => return,
            },
            Ok(Step::Send(_)) => {
                sent_auth = true;
                hs.receive(&[])
            }
            Ok(Step::Ready) => {
                assert!(opts.secret.is_none() || sent_auth, "ready with a secret but no AUTH");
                assert!(!listed, "LIST_REPLY leads back to Ready without a second Ready step");
                let _ = hs.list();
                hs.receive(&[])
            }
            Ok(Step::Listed(_)) => {
                listed = true;
                let _ = hs.open("vol0", 0, 0, false);
                hs.receive(&[])
            }
            Ok(Step::Opened(info)) => {
                let bs = info.block_size;
                assert!(bs.is_power_of_two() && info.max_transfer.is_multiple_of(bs) && info.queue_depth > 0);
                let _ = hs.into_leftover();
                return;
            }
        };
    }
}
