//! Buffers for large replies (both clients): a reply with at least
//! [`LARGE_REPLY`] bytes of data is received into a buffer of its own,
//! straight from the socket, instead of into the connection's shared receive
//! buffer (which would be regrown for it, moving what had arrived, in fresh
//! memory the kernel has to fault in and zero every time). The buffer comes
//! back to its connection's [`Recycler`] when the caller drops the data.

use bytes::{Buf, Bytes, BytesMut};
use parking_lot::Mutex;
use std::sync::Arc;

/// Replies with at least this much data are received into a buffer of their
/// own ([`Recycler`]), straight from the socket, instead of into the shared
/// receive buffer (which would be regrown for them, moving what had arrived,
/// in fresh memory the kernel has to fault in and zero every time).
pub(crate) const LARGE_REPLY: u32 = 64 * 1024;

/// Buffers of large replies, given back when the caller drops the data and
/// reused for the next large reply: their pages stay mapped.
#[derive(Default)]
pub(crate) struct Recycler {
    kept: Mutex<Vec<Vec<u8>>>,
}

/// Bytes of buffers a connection keeps for reuse, at most (sixteen 1 MiB
/// replies' worth; a gateway volume's sessions hold this per connection).
const RECYCLED_BYTES: usize = 16 << 20;

impl Recycler {
    /// An empty buffer with room for `n` bytes: the smallest kept one that
    /// fits, unless even that is over twice the size (a small reply would pin
    /// a large buffer while its caller holds it).
    pub(crate) fn take(&self, n: usize) -> Vec<u8> {
        let mut kept = self.kept.lock();
        let best = (0..kept.len()).filter(|&i| kept[i].capacity() >= n).min_by_key(|&i| kept[i].capacity());
        match best {
            Some(i) if kept[i].capacity() <= 2 * n => kept.swap_remove(i),
            _ => Vec::with_capacity(n),
        }
    }

    /// A buffer for a reply's `n` bytes of data, holding those already at
    /// the front of `buf` (taken off it); the caller reads the rest into it.
    pub(crate) fn begin(&self, buf: &mut BytesMut, n: usize) -> Vec<u8> {
        let mut data = self.take(n);
        let here = buf.len().min(n);
        data.extend_from_slice(&buf[..here]);
        buf.advance(here);
        data
    }

    /// `v` as a reply's data, coming back here when the caller drops it.
    pub(crate) fn data(self: &Arc<Self>, v: Vec<u8>) -> Bytes {
        Bytes::from_owner(Recycled { v, home: self.clone() })
    }

    fn give_back(&self, mut v: Vec<u8>) {
        let mut kept = self.kept.lock();
        if kept.iter().map(Vec::capacity).sum::<usize>() + v.capacity() <= RECYCLED_BYTES {
            v.clear();
            kept.push(v);
        }
    }
}

/// A large reply's data: back to its connection's [`Recycler`] when dropped.
struct Recycled {
    v: Vec<u8>,
    home: Arc<Recycler>,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.v
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        self.home.give_back(std::mem::take(&mut self.v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recycler_keeps_a_bounded_amount() {
        let r = Recycler::default();
        let v = r.take(1 << 20);
        assert!(v.capacity() >= 1 << 20 && v.is_empty());
        let at = v.as_ptr();
        r.give_back(v);
        let small = r.take(4096);
        assert_ne!(small.as_ptr(), at, "a small reply does not pin a large kept buffer");
        let again = r.take(600_000);
        assert_eq!(again.as_ptr(), at, "a kept buffer that fits is reused");
        for _ in 0..64 {
            r.give_back(Vec::with_capacity(1 << 20));
        }
        assert!(r.kept.lock().iter().map(Vec::capacity).sum::<usize>() <= RECYCLED_BYTES);
    }
}
