//! The memory backend's chunk memory: blocks of [`BLOCK`] bytes carved out of
//! [`REGION`]-sized mappings of their own, aligned so that the kernel can
//! back each region with one huge page.
//!
//! Why not the allocator: a 4K random read or write touches one chunk of a
//! large volume, and with 4K pages nearly every such access missed the TLB
//! (a nested page walk on a virtual machine). A standalone program on the
//! development machine copying random 4K blocks out of a 1 GiB region took
//! 560 ns per copy on 4K pages and 385 ns on huge pages. The allocator cannot
//! give huge pages: it maps each 256 KiB chunk on its own, unaligned. The
//! reference counts live apart from the data (`Arc<Block>`), so that taking
//! a chunk for a write or lending it to a reply touches a small, hot header
//! rather than a cold line at the start of the chunk.
//!
//! A block given back returns its memory to the kernel at once
//! (`MADV_DONTNEED`: a trimmed chunk of a RAM disk frees its RAM) and is
//! kept for the next block its region hands out, which the kernel then
//! gives as zeros; a region whose blocks are all free is unmapped. (The
//! huge page under a region with a block given back is split; the kernel
//! may merge it again later.)
//!
//! Except a block replaced by its copy (copy on write: a write to a chunk
//! a reply still reads from, `Block::retire`): up to [`SPARES`] of those
//! are kept as they are, for the next copy (`Pool::spare`), which
//! overwrites every byte. So up to 4 MiB of old bytes stay resident, and
//! their regions mapped, after everything else is trimmed (the volume's
//! allocated size does not count them). A copy into a block given back to
//! the kernel paid a page fault and a page clear per 4 KiB, and the
//! give-back a TLB shootdown on every CPU: under 4K random reads and writes
//! mixed, once every 4K read lent its chunk, most of the target's time
//! (docs/benchmarks.md, "4K reads sent from the volume's memory").

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Bytes per block (one chunk of a memory volume).
pub const BLOCK: usize = 256 * 1024;

/// Bytes per region: one huge page on x86-64 and aarch64 with 4K pages.
const REGION: usize = 2 << 20;

/// Blocks per region (at most 8: the masks are bytes).
const PER_REGION: usize = REGION / BLOCK;
const ALL_FREE: u8 = ((1u16 << PER_REGION) - 1) as u8;

/// Retired blocks kept resident for the next copy on write (4 MiB).
pub const SPARES: usize = 16;

/// Where a volume's blocks come from. Blocks hold it (an `Arc`), so it
/// lives until the last block a reply still holds is gone.
pub struct Pool {
    regions: Mutex<Regions>,
    /// Bytes of blocks lent to replies ([`Pool::lend`]).
    lent: AtomicU64,
}

#[derive(Default)]
struct Regions {
    /// Each region by its base address: its free blocks, one bit each.
    map: BTreeMap<usize, u8>,
    /// Regions with a free block.
    partial: BTreeSet<usize>,
    /// Retired blocks, still resident, their bytes stale (at most [`SPARES`]);
    /// in use as far as their regions know.
    spares: Vec<usize>,
}

impl Pool {
    pub fn new() -> Arc<Pool> {
        Arc::new(Pool { regions: Mutex::new(Regions::default()), lent: AtomicU64::new(0) })
    }

    /// Counts `bytes` of blocks as lent to a reply, unless that would make
    /// more than `most`: a write to a lent block copies it, so what is lent
    /// bounds the RAM that copies can add (a reply may hold a whole block
    /// for 4 KiB of it, and a client that stops reading holds its replies).
    pub fn lend(&self, bytes: u64, most: u64) -> bool {
        let before = self.lent.fetch_add(bytes, Relaxed);
        if before.saturating_add(bytes) <= most {
            return true;
        }
        self.lent.fetch_sub(bytes, Relaxed);
        false
    }

    /// The reply holding `bytes` of [`Pool::lend`] let go of them.
    pub fn unlend(&self, bytes: u64) {
        self.lent.fetch_sub(bytes, Relaxed);
    }

    /// Bytes lent now.
    #[cfg(test)]
    pub fn lent(&self) -> u64 {
        self.lent.load(Relaxed)
    }

    /// A block, all zero (fresh from the kernel, or given back to it).
    pub fn take(self: &Arc<Pool>) -> Block {
        let mut r = self.regions.lock();
        let base = match r.partial.first() {
            Some(&b) => b,
            None => {
                let b = map_region();
                r.map.insert(b, ALL_FREE);
                r.partial.insert(b);
                b
            }
        };
        let free = r.map.get_mut(&base).expect("a partial region is mapped");
        let i = free.trailing_zeros() as usize;
        *free &= !(1u8 << i);
        if *free == 0 {
            r.partial.remove(&base);
        }
        let ptr = NonNull::new((base + i * BLOCK) as *mut u8).expect("mapped");
        Block { ptr, pool: self.clone(), retired: AtomicBool::new(false) }
    }

    /// A block whose bytes are unspecified (a spare holds a volume's old
    /// bytes), for a copy that overwrites every one of them: a spare if there
    /// is one (no page faults), else a new one.
    fn spare(self: &Arc<Pool>) -> Block {
        let Some(at) = self.regions.lock().spares.pop() else { return self.take() };
        let ptr = NonNull::new(at as *mut u8).expect("a spare is mapped");
        Block { ptr, pool: self.clone(), retired: AtomicBool::new(false) }
    }

    /// `ptr`'s block is free again: kept as a spare if it was `retired` and
    /// there is room, else its memory goes back to the kernel, and its region
    /// too when none of its blocks is in use.
    fn give(&self, ptr: usize, retired: bool) {
        if retired {
            let mut r = self.regions.lock();
            if r.spares.len() < SPARES {
                return r.spares.push(ptr);
            }
        }
        // Before it is marked free: once it is, another thread may take it
        // and write, and a discard after that would lose those bytes.
        discard(ptr, BLOCK);
        let base = ptr & !(REGION - 1);
        let bit = 1u8 << ((ptr - base) / BLOCK);
        let mut r = self.regions.lock();
        let free = r.map.get_mut(&base).expect("a block's region is mapped");
        debug_assert!(*free & bit == 0, "a block given back twice");
        *free |= bit;
        if *free == ALL_FREE {
            r.map.remove(&base);
            r.partial.remove(&base);
            drop(r);
            unmap(base, REGION);
        } else {
            r.partial.insert(base);
        }
    }

    /// Regions mapped now (for tests).
    #[cfg(test)]
    fn regions(&self) -> usize {
        self.regions.lock().map.len()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Every block holds the pool: none is left, and neither is any region.
        for &base in self.regions.get_mut().map.keys() {
            unmap(base, REGION);
        }
    }
}

/// A new region, aligned to its size, that the kernel may back with a huge
/// page; its bytes are zero and cost nothing until touched.
fn map_region() -> usize {
    // Twice the size, then the unaligned head and tail are given back.
    let len = 2 * REGION;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        // As any allocation that fails: the process cannot go on.
        std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(REGION, REGION).expect("valid"));
    }
    let start = p as usize;
    let base = (start + REGION - 1) & !(REGION - 1);
    if base > start {
        unmap(start, base - start);
    }
    let end = start + len;
    if end > base + REGION {
        unmap(base + REGION, end - (base + REGION));
    }
    // A hint: without transparent huge pages the region is used as it is.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    // SAFETY: `base..base + REGION` is mapped (above).
    unsafe {
        libc::madvise(base as *mut libc::c_void, REGION, libc::MADV_HUGEPAGE)
    };
    base
}

/// Gives the pages of `at..at + len` back to the kernel: they read as zeros
/// from then on, and hold no RAM until written.
fn discard(at: usize, len: usize) {
    // SAFETY: `at..at + len` is a block of a mapped region that its owner
    // gives up (nothing reads or writes it any more).
    let r = unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    if r != 0 {
        // It cannot fail on a range of ours; if it did, the block would keep
        // its old bytes and be handed out as zeros: clear them by hand.
        // SAFETY: as above; the range is writable.
        unsafe { std::ptr::write_bytes(at as *mut u8, 0, len) };
    }
}

fn unmap(at: usize, len: usize) {
    // SAFETY: `at..at + len` is a mapping of this module's that nothing uses any more.
    unsafe { libc::munmap(at as *mut libc::c_void, len) };
}

/// One block of a [`Pool`], owned: given back when dropped.
pub struct Block {
    ptr: NonNull<u8>,
    pool: Arc<Pool>,
    /// Replaced by a copy ([`Block::retire`]).
    retired: AtomicBool,
}

impl Block {
    /// Marks a block that a copy replaces while readers still hold it: when
    /// the last of them drops it, it becomes a spare (`Pool::spare`).
    pub(super) fn retire(&self) {
        self.retired.store(true, Relaxed);
    }

    pub(super) fn pool(&self) -> &Pool {
        &self.pool
    }
}

// SAFETY: a block owns its bytes alone (the pool hands each out once until it
// is given back), so it moves between threads as a `Box<[u8]>` does, and
// `&Block` gives only shared access to them.
unsafe impl Send for Block {}
// SAFETY: see `Send`.
unsafe impl Sync for Block {}

impl std::ops::Deref for Block {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is the start of BLOCK mapped bytes this block owns.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), BLOCK) }
    }
}

impl std::ops::DerefMut for Block {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), BLOCK) }
    }
}

/// A copy in another block of the same pool (copy on write).
impl Clone for Block {
    fn clone(&self) -> Block {
        let mut b = self.pool.spare();
        b.copy_from_slice(self);
        b
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // The last reference's drop follows the retiring store (`Arc`'s count
        // orders them): relaxed is enough.
        self.pool.give(self.ptr.as_ptr() as usize, self.retired.load(Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_zero_and_distinct_and_regions_go_back_when_all_free() {
        let pool = Pool::new();
        let mut blocks: Vec<Block> = (0..2 * PER_REGION).map(|_| pool.take()).collect();
        assert_eq!(pool.regions(), 2, "two regions, full");
        let mut starts: Vec<usize> = blocks.iter().map(|b| b.as_ptr() as usize).collect();
        starts.sort();
        starts.dedup();
        assert_eq!(starts.len(), blocks.len(), "no block handed out twice");
        for (i, b) in blocks.iter_mut().enumerate() {
            assert!(b.iter().all(|&x| x == 0), "block {i} is zero");
            b.fill(i as u8 + 1);
        }
        // A block given back (the only free one) comes out again, as zeros...
        let given = blocks.swap_remove(3).as_ptr() as usize;
        let again = pool.take();
        assert_eq!(again.as_ptr() as usize, given, "the free block is reused");
        assert!(again.iter().all(|&x| x == 0), "a reused block reads as zeros");
        // ...and a clone is a copy in a block of its own.
        let copy = blocks[0].clone();
        assert_ne!(copy.as_ptr(), blocks[0].as_ptr());
        assert!(copy.iter().all(|&x| x == 1));
        drop((again, copy));
        blocks.clear();
        assert_eq!(pool.regions(), 0, "every region went back");
    }

    #[test]
    fn a_block_given_back_holds_no_ram() {
        let pool = Pool::new();
        let (mut first, _second) = (pool.take(), pool.take());
        let at = first.as_ptr() as usize;
        // No huge page for this region: khugepaged may otherwise collapse
        // it between the give-back and the count (a region with any page
        // resident qualifies where max_ptes_none is 511, the default), and
        // the block reads as resident again (zeros); 1 run in 4 failed so
        // under the whole suite.
        // SAFETY: the region is mapped (both blocks are in use); a hint only.
        unsafe { libc::madvise((at & !(REGION - 1)) as *mut libc::c_void, REGION, libc::MADV_NOHUGEPAGE) };
        first.fill(9);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let resident = || {
            let mut pages = vec![0u8; BLOCK / page];
            // SAFETY: `at..at + BLOCK` is within a region the pool keeps mapped
            // (`_second` is in use), and `pages` has one byte per page.
            let r = unsafe { libc::mincore(at as *mut libc::c_void, BLOCK, pages.as_mut_ptr()) };
            assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
            pages.iter().filter(|&&p| p & 1 != 0).count()
        };
        assert_eq!(resident(), BLOCK / page, "written, every page is in RAM");
        drop(first);
        assert_eq!(resident(), 0, "given back, none is");
    }

    #[test]
    fn a_retired_block_comes_back_as_a_spare_and_only_so_many() {
        let pool = Pool::new();
        let _keep = pool.take();
        let mut retired: Vec<Block> = (0..SPARES + 1).map(|_| pool.take()).collect();
        for (i, b) in retired.iter_mut().enumerate() {
            b.fill(i as u8 + 1);
            b.retire();
        }
        let at: Vec<usize> = retired.iter().map(|b| b.as_ptr() as usize).collect();
        drop(retired);
        // The first SPARES kept as they are; the last went back to the kernel.
        let mut spares: Vec<Block> = (0..SPARES).map(|_| pool.spare()).collect();
        let mut got: Vec<usize> = spares.iter().map(|b| b.as_ptr() as usize).collect();
        got.sort();
        let mut kept = at[..SPARES].to_vec();
        kept.sort();
        assert_eq!(got, kept, "the spares are the retired blocks");
        for b in &spares {
            let i = at.iter().position(|&a| a == b.as_ptr() as usize).unwrap();
            assert!(b.iter().all(|&x| x == i as u8 + 1), "a spare keeps its bytes: nothing cleared it");
        }
        // With no spare left, a new block (given back to the kernel: zeros).
        let fresh = pool.spare();
        assert_eq!(fresh.as_ptr() as usize, at[SPARES], "the block not kept was free");
        assert!(fresh.iter().all(|&x| x == 0), "and went back to the kernel");
        // A spare handed out is an ordinary block again: not retired, it goes
        // back to the kernel, and what comes next is zeros.
        spares.remove(0);
        assert!(pool.spare().iter().all(|&x| x == 0), "a block not retired is no spare");
    }

    #[test]
    fn lending_stops_at_its_limit_and_comes_back() {
        let pool = Pool::new();
        assert!(pool.lend(3 * BLOCK as u64, 4 * BLOCK as u64));
        assert!(!pool.lend(2 * BLOCK as u64, 4 * BLOCK as u64), "past the limit");
        assert_eq!(pool.lent(), 3 * BLOCK as u64, "a refusal counts nothing");
        assert!(pool.lend(BLOCK as u64, 4 * BLOCK as u64), "up to the limit");
        pool.unlend(4 * BLOCK as u64);
        assert_eq!(pool.lent(), 0);
    }

    #[test]
    fn a_block_outlives_its_volume_s_other_references_to_the_pool() {
        let pool = Pool::new();
        let mut b = pool.take();
        drop(pool);
        b[BLOCK - 1] = 7;
        assert_eq!(b[BLOCK - 1], 7);
    }
}
