//! The memory backend: a sparse RAM disk. The volume is cut into 256 KiB
//! chunks, each behind its own read-write lock and allocated on first write,
//! so a large volume costs nothing until used, readers of different chunks
//! never contend, and trimmed or zeroed whole chunks are freed again.
//!
//! A chunk is reference-counted so that a read (of 4 KiB or more) can be
//! sent straight from it ([`Backend::read_shared`]) instead of being copied
//! into a reply buffer first. Lent bytes never change: a write to a chunk
//! that a reply still holds copies the chunk first and writes the copy (copy
//! on write), so a reply carries exactly what the volume held when the read
//! ran. The copy goes into a spare block, the one an earlier copy replaced
//! ([`super::blocks`]), and at most [`LEND_AT_MOST`] bytes of chunks are lent
//! at once (past that, reads are copied), which bounds the RAM that copies
//! can add.
//!
//! Chunks come from a [`Pool`] of their own, in regions the kernel can back
//! with huge pages (see [`super::blocks`]).

use super::blocks::{Block, Pool, BLOCK};
use super::{push_zeros, Backend, BlockSizes, Result, ZeroFlags};
use crate::pool::PooledBuf;
use crate::request::{Extent, ReadData};
use bytes::Bytes;
use parking_lot::RwLock;
use std::sync::Arc;

const CHUNK: u64 = BLOCK as u64;

type Chunk = Arc<Block>;

/// Most bytes of chunks lent to replies at once, per volume
/// ([`Pool::lend`]); past that, reads are copied. A 4K read lends its whole
/// 256 KiB chunk, so this is 512 small reads in flight, and the most RAM
/// that copies on write can add while they are.
const LEND_AT_MOST: u64 = 128 << 20;

/// A piece of a chunk, lent to a reply (counted as a whole chunk).
struct Lent {
    chunk: Chunk,
    at: usize,
    len: usize,
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.chunk.pool().unlend(CHUNK);
    }
}

/// Bytes counted as lent that no [`Lent`] took over, given back when dropped.
struct Unlent<'a> {
    pool: &'a Pool,
    bytes: u64,
}

impl Drop for Unlent<'_> {
    fn drop(&mut self) {
        self.pool.unlend(self.bytes);
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.chunk[self.at..self.at + self.len]
    }
}

/// The chunk's bytes to change in place: allocated (zeroed) when missing,
/// copied first when a reply still holds them (the lent block, retired,
/// comes back as a spare for the next copy once the last reply drops it).
fn writable<'a>(slot: &'a mut Option<Chunk>, pool: &Arc<Pool>) -> &'a mut [u8] {
    let chunk = slot.get_or_insert_with(|| Arc::new(pool.take()));
    if Arc::get_mut(chunk).is_none() {
        chunk.retire();
        *chunk = Arc::new(Block::clone(chunk));
    }
    Arc::get_mut(chunk).expect("a chunk nobody else holds")
}

/// Copies at least this many bytes into a chunk with non-temporal stores:
/// a block. From 64 KiB until 2026-11-26; at 4 KiB, random 4K writes took
/// 17% less of the target's CPU (docs/benchmarks.md, "Large writes copied
/// around the cache").
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STREAM_FROM: usize = 4096;

/// `dst.copy_from_slice(src)`; a copy of a block or more (a 4K random write,
/// a 1 MiB write's pieces) goes around the cache on x86-64 (non-temporal
/// stores): an ordinary store first reads every destination line from
/// memory, a third memory transfer per line for data nobody reads back soon
/// (and the chunk's lock cannot be released before those reads are done),
/// and evicts what the connection's buffers keep hot.
fn copy_into(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "a copy between slices of one length");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_FROM {
        // SAFETY: two valid slices of the same length (checked above) that
        // do not overlap (`dst` is borrowed mutably while `src` is borrowed).
        return unsafe { stream_copy(dst.as_mut_ptr(), src.as_ptr(), dst.len()) };
    }
    dst.copy_from_slice(src);
}

/// Copies `len` bytes from `src` to `dst` with SSE2 non-temporal stores
/// (every x86-64 has SSE2), then fences them so that whoever takes the
/// chunk's lock next sees them.
///
/// # Safety
/// `src` and `dst` are valid for `len` bytes and do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Up to the first 16-byte boundary of `dst`, an ordinary copy.
    let head = dst.align_offset(16).min(len);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (mut d, mut s, mut left) = (dst.add(head), src.add(head), len - head);
    while left >= 64 {
        for k in 0..4 {
            let v = _mm_loadu_si128(s.add(16 * k) as *const __m128i);
            _mm_stream_si128(d.add(16 * k) as *mut __m128i, v);
        }
        (d, s, left) = (d.add(64), s.add(64), left - 64);
    }
    std::ptr::copy_nonoverlapping(s, d, left);
    _mm_sfence();
}

pub struct MemoryBackend {
    size: u64,
    chunks: Vec<RwLock<Option<Chunk>>>,
    pool: Arc<Pool>,
    /// Drawn at creation: this memory's data exists nowhere else.
    generation: u64,
}

impl MemoryBackend {
    pub fn new(size: u64) -> Self {
        let n = size.div_ceil(CHUNK) as usize;
        let generation = rand::random::<u64>() | 1;
        let chunks = (0..n).map(|_| RwLock::new(None)).collect();
        MemoryBackend { size, chunks, pool: Pool::new(), generation }
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
            } else if r.len() as u64 == CHUNK && chunk.is_some() {
                // Kept allocated: a fresh zeroed chunk, not a copy to zero (if lent).
                *chunk = Some(Arc::new(self.pool.take()));
            } else if chunk.is_some() {
                writable(&mut chunk, &self.pool)[at..at + r.len()].fill(0);
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
    fn can_share_reads(&self) -> bool {
        true
    }
    fn read_shared(&self, offset: u64, len: u64) -> Result<ReadData> {
        let chunks = match len {
            0 => 0,
            _ => (offset + len - 1) / CHUNK - offset / CHUNK + 1,
        };
        if !self.pool.lend(chunks * CHUNK, LEND_AT_MOST) {
            // Copied as a read shorter than `SHARE_READS_FROM` is.
            let mut copy = PooledBuf::take(len as usize);
            self.read_at(copy.as_mut(), offset)?;
            return Ok(Bytes::from_owner(copy).into());
        }
        // What no piece takes over (holes) is given back here, whatever happens.
        let mut left = Unlent { pool: &self.pool, bytes: chunks * CHUNK };
        let mut out = Vec::with_capacity(chunks as usize + 1);
        Self::pieces(offset, len, |i, at, r| match self.chunks[i].read().as_ref() {
            Some(c) => {
                left.bytes -= CHUNK;
                out.push(Bytes::from_owner(Lent { chunk: c.clone(), at, len: r.len() }))
            }
            None => push_zeros(&mut out, r.len()),
        });
        Ok(out.into())
    }
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        Self::pieces(offset, buf.len() as u64, |i, at, r| {
            let n = r.len();
            let mut chunk = self.chunks[i].write();
            copy_into(&mut writable(&mut chunk, &self.pool)[at..at + n], &buf[r]);
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
    fn large_copies_stream_every_byte_whatever_the_alignment() {
        let src: Vec<u8> = (0..STREAM_FROM + 300).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0u8; src.len() + 64];
        // Every start of the destination within 16 bytes, lengths around the threshold.
        for off in 0..17 {
            for len in [STREAM_FROM - 1, STREAM_FROM, STREAM_FROM + 63, STREAM_FROM + 300 - off] {
                dst.fill(0xEE);
                copy_into(&mut dst[off..off + len], &src[..len]);
                assert_eq!(&dst[off..off + len], &src[..len], "offset {off}, length {len}");
                assert!(dst[..off].iter().all(|&b| b == 0xEE), "nothing before the copy");
                assert!(dst[off + len..].iter().all(|&b| b == 0xEE), "nothing after the copy");
            }
        }
    }

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

    #[test]
    fn lent_bytes_never_change_and_a_chunk_is_copied_only_while_lent() {
        let m = MemoryBackend::new(4 * CHUNK);
        let old: Vec<u8> = (0..2 * CHUNK as usize).map(|i| (i % 253) as u8).collect();
        m.write_at(&old, CHUNK / 2, false).unwrap();
        // Across three chunks, and a hole after them reads as zeros.
        let lent = m.read_shared(CHUNK / 2, 3 * CHUNK).unwrap();
        assert_eq!(lent.len(), 3 * CHUNK as usize);
        let whole = lent.to_bytes();
        assert_eq!(&whole[..old.len()], &old[..]);
        assert!(whole[old.len()..].iter().all(|&b| b == 0));
        let first_piece = lent.pieces().next().unwrap().as_ptr();
        // Writes and a partial zeroing over what is lent: the reply keeps the old bytes...
        m.write_at(&vec![0xee; CHUNK as usize], CHUNK / 2, false).unwrap();
        m.write_zeroes(CHUNK + CHUNK / 2, 4096, ZeroFlags::default()).unwrap();
        assert_eq!(lent.to_bytes(), whole, "lent bytes changed under the reply");
        // ...and the volume has the new ones.
        let mut now = vec![0u8; 2 * CHUNK as usize];
        m.read_at(&mut now, CHUNK / 2).unwrap();
        assert!(now[..CHUNK as usize].iter().all(|&b| b == 0xee));
        assert!(now[CHUNK as usize..CHUNK as usize + 4096].iter().all(|&b| b == 0));
        assert_eq!(&now[CHUNK as usize + 4096..], &old[CHUNK as usize + 4096..]);
        // The write copied the lent chunk; with nothing lent, writes go in place.
        let again = m.read_shared(CHUNK / 2, 4096).unwrap();
        let copied = again.pieces().next().unwrap().as_ptr();
        assert_ne!(copied, first_piece, "a write to a lent chunk must copy it");
        drop((lent, again));
        m.write_at(&[1; 4096], CHUNK / 2, false).unwrap();
        let after = m.read_shared(CHUNK / 2, 4096).unwrap();
        assert_eq!(after.pieces().next().unwrap().as_ptr(), copied, "an unlent chunk is written in place");
        assert_eq!(after.to_bytes()[..], [1; 4096][..]);
        drop(after);
        assert_eq!(m.pool.lent(), 0, "every lent chunk came back");
    }

    #[test]
    fn a_copy_on_write_reuses_the_block_it_replaced_before() {
        let m = MemoryBackend::new(2 * CHUNK);
        m.write_at(&[7; 4096], 0, false).unwrap();
        let first = m.read_shared(0, 4096).unwrap();
        let a = first.pieces().next().unwrap().as_ptr();
        m.write_at(&[8; 4096], 0, false).unwrap();
        // The reply still holds block A; dropped, A is kept for the next copy.
        drop(first);
        let second = m.read_shared(0, 4096).unwrap();
        assert_ne!(second.pieces().next().unwrap().as_ptr(), a);
        m.write_at(&[9; 4096], 4096, false).unwrap();
        let third = m.read_shared(0, 8192).unwrap();
        assert_eq!(third.pieces().next().unwrap().as_ptr(), a, "the copy went into the spare");
        assert_eq!(second.to_bytes()[..], [8; 4096][..], "the reply kept its bytes");
        let now = third.to_bytes();
        assert_eq!(now[..4096], [8; 4096][..]);
        assert_eq!(now[4096..], [9; 4096][..]);
    }

    #[test]
    fn past_the_lending_limit_reads_are_copied_and_correct() {
        let m = MemoryBackend::new(CHUNK);
        m.write_at(&[5; 8192], 0, false).unwrap();
        let most = (LEND_AT_MOST / CHUNK) as usize;
        let lent: Vec<ReadData> = (0..most).map(|_| m.read_shared(4096, 4096).unwrap()).collect();
        let chunk = lent[0].pieces().next().unwrap().as_ptr();
        assert!(lent.iter().all(|d| d.pieces().next().unwrap().as_ptr() == chunk), "all lent");
        assert_eq!(m.pool.lent(), LEND_AT_MOST);
        let copied = m.read_shared(4096, 4096).unwrap();
        assert_ne!(copied.pieces().next().unwrap().as_ptr(), chunk, "past the limit: a copy");
        assert_eq!(copied.to_bytes()[..], [5; 4096][..]);
        // A write now copies the lent chunk; the copy's reads are right too.
        m.write_at(&[6; 4096], 4096, false).unwrap();
        assert_eq!(lent[most - 1].to_bytes()[..], [5; 4096][..]);
        drop(lent);
        assert_eq!(m.pool.lent(), 0);
        let again = m.read_shared(0, 8192).unwrap();
        assert_eq!(m.pool.lent(), CHUNK, "lending again");
        let b = again.to_bytes();
        assert_eq!((&b[..4096], &b[4096..]), (&[5u8; 4096][..], &[6u8; 4096][..]));
    }
}
