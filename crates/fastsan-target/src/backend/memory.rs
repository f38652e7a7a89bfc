//! The memory backend: a sparse RAM disk. The volume is cut into 256 KiB
//! chunks, each behind its own read-write lock and allocated on first write,
//! so a large volume costs nothing until used, readers of different chunks
//! never contend, and trimmed or zeroed whole chunks are freed again.

use super::{Backend, BlockSizes, Result, ZeroFlags};
use crate::request::Extent;
use parking_lot::RwLock;

const CHUNK: u64 = 256 * 1024;

pub struct MemoryBackend {
    size: u64,
    chunks: Vec<RwLock<Option<Box<[u8]>>>>,
    /// Drawn at creation: this memory's data exists nowhere else.
    generation: u64,
}

impl MemoryBackend {
    pub fn new(size: u64) -> Self {
        let n = size.div_ceil(CHUNK) as usize;
        let generation = rand::random::<u64>() | 1;
        MemoryBackend { size, chunks: (0..n).map(|_| RwLock::new(None)).collect(), generation }
    }

    /// Bytes of RAM the volume holds now.
    pub fn allocated(&self) -> u64 {
        self.chunks.iter().filter(|c| c.read().is_some()).count() as u64 * CHUNK
    }

    /// Calls `f(chunk index, offset in chunk, range in the request)` for each
    /// piece of `[offset, offset + len)`.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(usize, usize, std::ops::Range<usize>)) {
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let in_chunk = at % CHUNK;
            let n = (CHUNK - in_chunk).min(len - done);
            f((at / CHUNK) as usize, in_chunk as usize, done as usize..(done + n) as usize);
            done += n;
        }
    }

    /// Zeroes a range; whole chunks are freed unless `keep` asks to keep them allocated.
    fn zero_range(&self, offset: u64, len: u64, keep: bool) {
        Self::pieces(offset, len, |i, at, r| {
            let mut chunk = self.chunks[i].write();
            if r.len() as u64 == CHUNK && !keep {
                *chunk = None;
            } else if let Some(c) = chunk.as_mut() {
                c[at..at + r.len()].fill(0);
            }
        });
    }
}

impl Backend for MemoryBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes { minimum: 1, preferred: 4096, maximum: u32::MAX }
    }
    fn can_write(&self) -> bool {
        true
    }
    fn can_flush(&self) -> bool {
        // Nothing to make durable, and nothing to do: a flush succeeds at once.
        true
    }
    fn can_fua(&self) -> bool {
        true
    }
    fn can_trim(&self) -> bool {
        true
    }
    fn can_zero(&self) -> bool {
        true
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn can_extents(&self) -> bool {
        true
    }
    fn can_cache(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Self::pieces(offset, buf.len() as u64, |i, at, r| {
            let n = r.len();
            match self.chunks[i].read().as_ref() {
                Some(c) => buf[r].copy_from_slice(&c[at..at + n]),
                None => buf[r].fill(0),
            }
        });
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        Self::pieces(offset, buf.len() as u64, |i, at, r| {
            let n = r.len();
            let mut chunk = self.chunks[i].write();
            let c = chunk.get_or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
            c[at..at + n].copy_from_slice(&buf[r]);
        });
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.zero_range(offset, len, false);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.zero_range(offset, len, flags.no_hole);
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let mut out: Vec<Extent> = Vec::new();
        Self::pieces(offset, len, |i, _, r| {
            let hole = self.chunks[i].read().is_none();
            match out.last_mut() {
                Some(e) if e.hole == hole => e.len += r.len() as u64,
                _ => out.push(Extent { len: r.len() as u64, hole }),
            }
        });
        Ok(out)
    }
    fn cache(&self, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }
    fn may_block(&self) -> bool {
        false
    }
    fn volatile(&self) -> bool {
        true
    }
    fn generation(&self) -> u64 {
        self.generation
    }
    fn describe(&self) -> String {
        format!("memory, {} bytes (volatile)", self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_across_chunks_read_back_and_zeroing_frees() {
        let m = MemoryBackend::new(3 * CHUNK + 512);
        let data: Vec<u8> = (0..(CHUNK as usize + 1024)).map(|i| (i % 251) as u8).collect();
        let off = CHUNK - 512;
        m.write_at(&data, off, false).unwrap();
        let mut back = vec![0u8; data.len()];
        m.read_at(&mut back, off).unwrap();
        assert_eq!(back, data);
        assert_eq!(m.allocated(), 3 * CHUNK);
        m.write_zeroes(CHUNK, CHUNK, ZeroFlags::default()).unwrap();
        assert_eq!(m.allocated(), 2 * CHUNK, "a whole zeroed chunk is freed");
        let holes = |e: Vec<Extent>| e.iter().map(|e| (e.len, e.hole)).collect::<Vec<_>>();
        assert_eq!(
            holes(m.extents(0, 3 * CHUNK + 512).unwrap()),
            [(CHUNK, false), (CHUNK, true), (CHUNK, false), (512, true)]
        );
        m.read_at(&mut back, off).unwrap();
        assert_eq!(&back[..512], &data[..512]);
        assert!(back[512..512 + CHUNK as usize].iter().all(|&b| b == 0));
        assert_eq!(&back[512 + CHUNK as usize..], &data[512 + CHUNK as usize..]);
        m.trim(off, 512).unwrap();
        m.read_at(&mut back[..512], off).unwrap();
        assert!(back[..512].iter().all(|&b| b == 0));
    }
}
