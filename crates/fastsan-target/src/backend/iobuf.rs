//! The buffers of a ring's I/Os ([`super::uring`]): most come from an arena
//! registered with the ring once (io_uring's fixed buffers), the rest from
//! the heap.
//!
//! Why: an O_DIRECT I/O from an ordinary buffer makes the kernel look up
//! and pin its pages for the device, and unpin them after, on every I/O; and
//! a fresh buffer is allocated and zeroed each time. A registered buffer was
//! pinned once, when the ring was made, and an arena's slot is used again
//! as soon as the reply that sent it is gone. Measured before: 4K reads of
//! an ext4 file at fio's QD32 spent ~1.5% of the target's cycles zeroing
//! buffers (`memset`), ~1.8% pinning pages (`gup_fast_fallback`,
//! `bio_iov_iter_get_pages`) and ~1.7% in the allocator
//! (`perf record -g -p TARGET` under `fio --ioengine=nbd --rw=randread
//! --bs=4k --iodepth=32` on a `file:...,direct` volume).
//!
//! The arena has two sizes of slot: 4 KiB ones for the small I/Os that
//! dominate random loads, 64 KiB ones for the rest up to that size. A
//! larger I/O, or one that finds every slot of its size taken (its data
//! still on the way to a client), gets a buffer of its own, as every I/O
//! did before. A ring whose kernel refuses the registration (an older
//! kernel, or a locked-memory limit too small: registered memory counts
//! against `RLIMIT_MEMLOCK` for an unprivileged target) uses the heap only.

use super::file::{AlignedBuf, DIRECT_ALIGN};
use parking_lot::Mutex;
use std::alloc::{self, Layout};
use std::sync::Arc;

/// The slot sizes, smallest first, and how many of each an arena has:
/// 512 x 4 KiB and 32 x 64 KiB, 4 MiB in all. Registered memory counts
/// against the user's `RLIMIT_MEMLOCK` (8 MiB by default, for all of the
/// user's processes together) unless the target has `CAP_IPC_LOCK`: an
/// unprivileged target gets arenas for two direct volumes at most, and the
/// rest use the heap (the ring says so once in its log).
const CLASSES: [(usize, usize); 2] = [(4 << 10, 512), (64 << 10, 32)];
/// The arena's alignment: a huge page's, so that a kernel that backs it
/// with transparent huge pages maps it from a page boundary (some 6.12-6.15
/// kernels mishandled registered buffers that began inside a huge page).
const ARENA_ALIGN: usize = 2 << 20;

/// Memory registered with a ring, handed out in slots. Shared by the ring
/// and every buffer taken from it: it is freed when the last of them goes,
/// never while the kernel or a reply may still use a slot.
pub struct Arena {
    base: *mut u8,
    layout: Layout,
    /// Per class: where its slots begin in the arena, and its free slots.
    classes: [(usize, Mutex<Vec<u32>>); CLASSES.len()],
}

// SAFETY: the arena's memory is only reached through slots, each owned by
// one `FixedBuf` at a time (the free lists hand a slot out once); the
// pointer itself is never written after creation.
unsafe impl Send for Arena {}
// SAFETY: as above; the free lists are behind their locks.
unsafe impl Sync for Arena {}

impl Arena {
    /// A zeroed arena (its bytes are always initialized: a slot used again
    /// holds what its last I/O left there).
    pub fn new() -> Arc<Arena> {
        let size: usize = CLASSES.iter().map(|(len, n)| len * n).sum();
        let layout = Layout::from_size_align(size, ARENA_ALIGN.max(DIRECT_ALIGN)).expect("a valid layout");
        // SAFETY: the layout has a non-zero size.
        let base = unsafe { alloc::alloc_zeroed(layout) };
        if base.is_null() {
            alloc::handle_alloc_error(layout);
        }
        let mut at = 0;
        let classes = CLASSES.map(|(len, n)| {
            let start = at;
            at += len * n;
            // Popped from the end: the lowest slots first.
            (start, Mutex::new((0..n as u32).rev().collect()))
        });
        Arc::new(Arena { base, layout, classes })
    }

    /// What to register with the ring: the whole arena, as fixed buffer 0.
    pub fn iovec(&self) -> libc::iovec {
        libc::iovec { iov_base: self.base.cast(), iov_len: self.layout.size() }
    }

    /// A slot for `len` bytes, of the smallest size that fits and has one
    /// free.
    fn take(self: &Arc<Self>, len: usize) -> Option<FixedBuf> {
        let first = CLASSES.iter().position(|&(size, _)| len <= size)?;
        (first..CLASSES.len()).find_map(|class| {
            let slot = self.classes[class].1.lock().pop()?;
            let (start, size) = (self.classes[class].0, CLASSES[class].0);
            // SAFETY: start + slot * size + len is inside the arena (slot <
            // the class's count, len <= its size).
            let ptr = unsafe { self.base.add(start + slot as usize * size) };
            Some(FixedBuf { arena: self.clone(), class: class as u8, slot, ptr, len })
        })
    }

    /// Slots of every class (tests).
    #[cfg(test)]
    pub fn slots() -> usize {
        CLASSES.iter().map(|(_, n)| n).sum()
    }

    /// Slots of every class free now (tests).
    #[cfg(test)]
    pub fn free(&self) -> usize {
        self.classes.iter().map(|(_, free)| free.lock().len()).sum()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`, freed once.
        unsafe { alloc::dealloc(self.base, self.layout) }
    }
}

/// A slot of an [`Arena`], owned until dropped.
pub struct FixedBuf {
    arena: Arc<Arena>,
    class: u8,
    slot: u32,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the slot is this buffer's alone until its drop gives it back, and
// the arena it points into lives as long as the `Arc` held here.
unsafe impl Send for FixedBuf {}

impl Drop for FixedBuf {
    fn drop(&mut self) {
        self.arena.classes[self.class as usize].1.lock().push(self.slot);
    }
}

/// An I/O's buffer, aligned for O_DIRECT: an arena's slot or the heap's.
pub enum IoBuf {
    Heap(AlignedBuf),
    Fixed(FixedBuf),
}

impl IoBuf {
    /// `len` bytes from `arena` if it has a slot for them, else from the
    /// heap. A heap buffer starts zeroed; a slot holds what its last I/O left
    /// there (this volume's data: each ring has its own arena), so it is for
    /// a read that fills it or a write that copies a whole block into it. A
    /// read is answered only once the kernel reported every byte moved; a
    /// kernel that reported bytes it did not move would send a slot's old
    /// bytes where a heap buffer would have sent zeros (why the ring is kept
    /// off FUSE: `ring_trusts` in file.rs).
    pub fn take(arena: Option<&Arc<Arena>>, len: usize) -> IoBuf {
        match arena.and_then(|a| a.take(len)) {
            Some(fixed) => IoBuf::Fixed(fixed),
            None => IoBuf::Heap(AlignedBuf::new(len)),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            IoBuf::Heap(b) => b.len(),
            IoBuf::Fixed(f) => f.len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        match self {
            IoBuf::Heap(b) => b.as_slice(),
            // SAFETY: the slot's `len` bytes are initialized (the arena was
            // zeroed) and this buffer's alone.
            IoBuf::Fixed(f) => unsafe { std::slice::from_raw_parts(f.ptr, f.len) },
        }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            IoBuf::Heap(b) => b.as_mut_slice(),
            // SAFETY: as above, and `&mut self` makes the access exclusive.
            IoBuf::Fixed(f) => unsafe { std::slice::from_raw_parts_mut(f.ptr, f.len) },
        }
    }
    /// Where the device writes (the buffer must outlive that write).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            IoBuf::Heap(b) => b.as_mut_ptr(),
            IoBuf::Fixed(f) => f.ptr,
        }
    }
    /// The ring's fixed buffer this one lies in, if any.
    pub fn fixed_index(&self) -> Option<u16> {
        matches!(self, IoBuf::Fixed(_)).then_some(0)
    }
}

impl From<AlignedBuf> for IoBuf {
    fn from(b: AlignedBuf) -> IoBuf {
        IoBuf::Heap(b)
    }
}

impl AsRef<[u8]> for IoBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_fit_their_size_are_not_handed_out_twice_and_come_back_when_dropped() {
        let arena = Arena::new();
        let all = Arena::slots();
        assert_eq!(arena.free(), all);
        let small: Vec<IoBuf> = (0..CLASSES[0].1).map(|_| IoBuf::take(Some(&arena), 4096)).collect();
        assert!(small.iter().all(|b| matches!(b, IoBuf::Fixed(_)) && b.len() == 4096));
        // Every small slot taken: a small I/O then takes a large slot, and one
        // larger than any slot, or beyond them all, gets the heap's.
        let mid = IoBuf::take(Some(&arena), 8192);
        assert!(matches!(&mid, IoBuf::Fixed(f) if f.class == 1) && mid.len() == 8192);
        assert!(matches!(IoBuf::take(Some(&arena), (64 << 10) + 4096), IoBuf::Heap(_)));
        let large: Vec<IoBuf> = (1..CLASSES[1].1).map(|_| IoBuf::take(Some(&arena), 4096)).collect();
        assert!(large.iter().all(|b| matches!(b, IoBuf::Fixed(f) if f.class == 1)));
        assert!(matches!(IoBuf::take(Some(&arena), 4096), IoBuf::Heap(_)), "none left");
        assert_eq!(arena.free(), 0);
        // No two buffers overlap: each holds its own mark.
        let mut bufs: Vec<IoBuf> = small.into_iter().chain(large).chain([mid]).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            b.as_mut_slice().fill(i as u8);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as u8), "buffer {i} was written by another");
        }
        drop(bufs);
        assert_eq!(arena.free(), all, "every slot back");
    }

    #[test]
    fn a_buffer_keeps_its_arena_alive() {
        let arena = Arena::new();
        let mut b = IoBuf::take(Some(&arena), 4096);
        drop(arena);
        b.as_mut_slice().fill(9);
        assert!(b.as_slice().iter().all(|&x| x == 9));
    }
}
