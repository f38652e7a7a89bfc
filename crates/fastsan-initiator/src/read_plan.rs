//! How a connection's read buffer grows, for the target's driver, the
//! NVMe/TCP host and the BRP initiator alike (each had its own formula):
//! how much room to reserve before each read, and how much that read may
//! take.
//!
//! A frame must lie whole in one buffer to be decoded, so a frame that a
//! read leaves cut at the end of the buffer's room is copied, all of the
//! part that arrived, when the buffer grows for the rest. With megabyte
//! frames that was a copy of nearly every frame: on the target, an NVMe/TCP
//! write by R2T (1 MiB + 24) arrived after a few 72-byte commands, the read
//! filled the buffer, and the frame missed its last 216 bytes (18% of the
//! target's CPU in `memcpy` under 1M writes); on the NVMe/TCP host, 1M reads
//! (23% of the client's). So:
//! - an incomplete frame of [`LARGE_FRAME`] or more gets room for its rest
//!   (grown by at most `growth` or the size that arrived at a time, so a
//!   header that announces 16 MiB costs memory only as the bytes really
//!   arrive), and the read stops at its end: the next frame starts at the
//!   front of fresh room;
//! - between frames, the buffer keeps room for the largest frame seen
//!   lately (capped) plus a chunk, and a read takes at most the largest
//!   frame's worth, so that a large frame starting within the first chunk
//!   ends within the room.

/// A frame this large is read to its end and no further, and the read
/// buffer keeps room for the largest such frame seen.
pub const LARGE_FRAME: usize = 64 * 1024;

pub struct ReadPlan {
    /// The room offered to a read between frames (before any large one).
    chunk: usize,
    /// The most the buffer grows by ahead of what arrived.
    growth: usize,
    /// The largest frame over [`LARGE_FRAME`] announced lately (capped at
    /// `growth + LARGE_FRAME`): forgotten after [`FORGET_AFTER`] reads
    /// without one, so that a connection back to small frames holds
    /// buffers of a chunk again, not of a large frame.
    large: usize,
    /// Reads since the last large frame.
    since: u32,
}

/// Reads without a large frame after which the plan forgets it.
const FORGET_AFTER: u32 = 64;

impl ReadPlan {
    pub fn new(chunk: usize, growth: usize) -> ReadPlan {
        ReadPlan { chunk, growth, large: 0, since: 0 }
    }

    /// The room to reserve before the next read and the most it may take,
    /// when `buffered` bytes are held and the frame they begin needs `need`
    /// in all (0 or at most `buffered`: not known yet).
    pub fn next(&mut self, buffered: usize, need: usize) -> (usize, usize) {
        if need >= LARGE_FRAME && need > buffered {
            self.since = 0;
            self.large = self.large.max(need.min(self.growth + LARGE_FRAME));
            let grown = need.min(buffered + buffered.max(self.growth));
            return (grown - buffered, need - buffered);
        }
        self.since += 1;
        if self.since > FORGET_AFTER {
            self.large = 0;
        }
        let room = (self.chunk + self.large).max(need).saturating_sub(buffered).max(4096);
        // Once large frames come, a read takes at most one's worth.
        let most = match self.large {
            0 => usize::MAX,
            large => large.max(4096),
        };
        (room, most)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};

    const CHUNK: usize = 256 * 1024;
    const GROWTH: usize = 1 << 20;

    /// Reads through a [`ReadPlan`] as a connection does, from a peer that
    /// always has more than the room (the socket is never the limit): how
    /// many bytes were copied when the buffer grew, for frames of `sizes`,
    /// each decoded (split off and dropped) as soon as it is whole.
    fn copied_by_growth(sizes: &[usize]) -> usize {
        let total: usize = sizes.iter().sum();
        let (mut plan, mut buf) = (ReadPlan::new(CHUNK, GROWTH), BytesMut::with_capacity(CHUNK));
        let (mut copied, mut arrived, mut frames) = (0, 0, sizes.iter().peekable());
        while arrived < total || frames.peek().is_some() {
            while let Some(&&n) = frames.peek() {
                if buf.len() < n {
                    break;
                }
                drop(buf.split_to(n));
                frames.next();
            }
            let need = frames.peek().map_or(0, |&&n| n);
            let (room, most) = plan.next(buf.len(), need);
            if room > 0 && buf.capacity() - buf.len() < room {
                copied += buf.len();
            }
            buf.reserve(room);
            let n = (buf.capacity() - buf.len()).min(most).min(total - arrived);
            if n == 0 {
                break;
            }
            buf.put_bytes(7, n);
            arrived += n;
        }
        assert_eq!(arrived, total, "every byte read");
        assert!(frames.peek().is_none(), "every frame decoded");
        copied
    }

    #[test]
    fn a_large_frame_is_never_copied_whole_when_the_buffer_grows() {
        // NVMe/TCP writes by R2T: a few 72-byte commands, then their data,
        // 1 MiB + 24 each. Before the plan nearly every frame was copied.
        let mut r2t = Vec::new();
        for _ in 0..32 {
            r2t.extend([72, 72, 72, 1048600, 1048600, 1048600]);
        }
        let copied = copied_by_growth(&r2t);
        assert!(copied < 4 * (1 << 20), "copied {copied} bytes of {} MiB", 96);
        // Megabyte frames back to back (NBD writes, NVMe/TCP reads).
        assert!(copied_by_growth(&[(1 << 20) + 28; 64]) < 2 * (1 << 20));
        // Small frames: at most the piece of one frame left at each chunk's end.
        let small = 4096 + 28;
        assert!(copied_by_growth(&[small; 4096]) <= (4096 * small / CHUNK + 1) * small);
    }

    #[test]
    fn the_plan_reads_a_large_frame_to_its_end_and_grows_as_it_arrives() {
        let mut p = ReadPlan::new(CHUNK, GROWTH);
        // The rest of a large frame, and no further.
        assert_eq!(p.next(100, 1048600), (1048500, 1048500));
        // Between frames: room for the largest seen, and a chunk.
        assert_eq!(p.next(0, 0), (1048600 + CHUNK, 1048600));
        // A header announcing 32 MiB: room grows with what arrived, not with the claim.
        let mut p = ReadPlan::new(CHUNK, GROWTH);
        assert_eq!(p.next(100, 32 << 20).0, GROWTH);
        assert_eq!(p.next(4 << 20, 32 << 20).0, 4 << 20);
        // ...and the claim does not make every later read's room that large.
        let (room, _) = p.next(0, 0);
        assert!(room <= CHUNK + GROWTH + LARGE_FRAME, "{room}");
        // Small frames: a chunk, every byte that comes.
        assert_eq!(ReadPlan::new(CHUNK, GROWTH).next(10, 72), (CHUNK - 10, usize::MAX));
        // Back to small frames after large ones: the large room is kept a
        // while (large frames come between small ones), then forgotten.
        let mut p = ReadPlan::new(CHUNK, GROWTH);
        p.next(100, 1048600);
        for _ in 0..FORGET_AFTER {
            assert_eq!(p.next(0, 72).0, CHUNK + 1048600);
        }
        assert_eq!(p.next(0, 72), (CHUNK, usize::MAX));
    }
}
