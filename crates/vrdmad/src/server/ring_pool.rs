//! A host context's ring pool: its CQ, QP and SRQ rings carved out of a
//! few shared chunks instead of a memfd each.
//!
//! A memfd per ring cost 12–18 µs of a ring's creation (`memfd_create`,
//! `ftruncate`, seals, the daemon's `mmap`, `SCM_RIGHTS`, the library's
//! `mmap`), four of them in an rdma_cm connection's setup. A context's pool
//! makes a chunk of [`CHUNK_LEN`] bytes when it first needs one (and
//! another when that is full), maps it once, and hands the library its
//! descriptor with the first ring in it; a ring is then an offset and a
//! length in a chunk the library has mapped already, and its creation
//! sends no descriptor.
//!
//! Space is managed as a buddy system of power-of-two blocks of at least a
//! page: a block is split to fit, and a freed block merges with its free
//! buddy, so that a chunk whose rings are all gone is one free block again
//! and the pool grows only when its live rings need it. The next ring
//! placed in a freed block starts from zeros, as a new memfd's would. A
//! small block (at most [`ZERO_IN_PLACE`], as an rdma_cm connection's
//! CQ and QP rings are) is zeroed in place: punching its pages out
//! (`MADV_REMOVE`) cost a TLB shootdown across the daemon's CPUs per ring
//! destroyed, and the next ring there took page faults on both sides at
//! its creation (rdma-core's `cmtime`, 200 connections on two cores:
//! its destroy step 33–64 µs a connection before, 13–27 µs after). Memory
//! still goes back to the system: a freed
//! region that merges into a block larger than that is punched out
//! whole, once, before anything can be placed in it, and a larger block
//! is punched when it is freed.
//!
//! Isolation: a pool belongs to one session, hence one context of one
//! tenant, and is dropped with it; nothing of it is shared across
//! contexts. Every placement is made here, never taken from the library.
//! The direct path grants a peer process of the *same tenant* a ring by
//! the descriptor of the chunk it lies in (`docs/direct-path.md`: grants
//! never cross tenants), which exposes that context's other rings to it,
//! no more than that tenant could reach by `ptrace`.
//!
//! Budgets: each chunk's mapping is charged to the tenant's mapping budget
//! and the descriptor the daemon keeps of it to the tenant's descriptors;
//! the bytes of its rings stay charged by the core (`max_queue_bytes`),
//! ring by ring. A ring larger than a chunk, or one the budgets refuse a
//! new chunk for, gets a memfd of its own as before.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use vrdma_core::memory::Backing;
use vrdma_shm::{page_size, Mapping, MappingBudget, Segment};

use super::admission::KeptDescriptor;

/// Bytes of one chunk (a power of two); rings larger than this get a
/// memfd of their own. Only touched pages cost memory.
pub(crate) const CHUNK_LEN: usize = 4 << 20;

/// Freed blocks up to this many bytes are zeroed in place rather than
/// punched out of the memfd (see the module's notes).
pub(crate) const ZERO_IN_PLACE: usize = 64 << 10;

/// Most chunks one pool holds (each a mapping and a descriptor in the
/// daemon, also charged to the tenant's budgets).
pub(crate) const MAX_CHUNKS: usize = 256;

/// One chunk: its memfd (kept to hand to the library and to direct-path
/// peers), the daemon's mapping of it and the descriptor's charge.
pub(crate) struct Chunk {
    id: u32,
    fd: Arc<OwnedFd>,
    map: Mapping,
    _charge: Option<KeptDescriptor>,
}

impl Chunk {
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Its memfd, shared (what the direct path keeps of a ring in it).
    pub fn shared_fd(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }
}

struct PoolState {
    chunks: Vec<Arc<Chunk>>,
    /// Whether the library has been sent each chunk's descriptor.
    sent: Vec<bool>,
    /// Per size class (`page << class`): free blocks as (chunk, offset).
    free: Vec<BTreeSet<(u32, u64)>>,
}

/// One context's ring pool.
pub(crate) struct RingPool {
    state: Mutex<PoolState>,
    page: usize,
    classes: usize,
}

/// A ring's place in the pool, given back (and its pages reset) on drop.
pub(crate) struct Block {
    pool: Arc<RingPool>,
    chunk: Arc<Chunk>,
    offset: u64,
    class: usize,
}

impl Block {
    pub fn chunk(&self) -> &Arc<Chunk> {
        &self.chunk
    }

    /// Where the block starts in its chunk.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

// SAFETY: the block lies inside its chunk's live mapping (`alloc` placed
// it there, `offset + size <= chunk length`), which the `Arc<Chunk>` keeps
// mapped for as long as the block lives.
unsafe impl Backing for Block {
    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: see the impl's comment: in bounds of the mapping.
        unsafe { self.chunk.map.as_ptr().add(self.offset as usize) }
    }
    fn len(&self) -> usize {
        self.pool.class_len(self.class)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let len = self.pool.class_len(self.class);
        if len <= ZERO_IN_PLACE {
            // SAFETY: the block's own bytes in its chunk's live, writable
            // shared mapping; the tenant may write them meanwhile, which a
            // byte fill tolerates (its rings are untrusted anyway).
            unsafe { std::ptr::write_bytes(self.as_ptr(), 0, len) };
        } else {
            punch(self.as_ptr(), len);
        }
        self.pool.give_back(&self.chunk, self.offset, self.class);
    }
}

/// Empties `[ptr, ptr + len)` of a shared memfd mapping: its pages are
/// punched out of the file (reads give zeros, the memory goes back to
/// the system), or zeroed if that fails.
fn punch(ptr: *mut u8, len: usize) {
    // SAFETY: `ptr` is page-aligned (blocks are multiples of a page in a
    // page-aligned mapping) and `[ptr, ptr + len)` lies in a live shared
    // mapping of a memfd; MADV_REMOVE frees its pages in the file, which
    // changes bytes only, not the mapping.
    let removed = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_REMOVE) } == 0;
    if !removed {
        // SAFETY: as above, a live writable mapping of `len` bytes; the
        // tenant may write it meanwhile, which a byte fill tolerates.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
    }
}

impl RingPool {
    pub fn new() -> Arc<RingPool> {
        let page = page_size();
        let classes = (CHUNK_LEN / page).trailing_zeros() as usize + 1;
        Arc::new(RingPool {
            state: Mutex::new(PoolState {
                chunks: Vec::new(),
                sent: Vec::new(),
                free: vec![BTreeSet::new(); classes],
            }),
            page,
            classes,
        })
    }

    fn class_len(&self, class: usize) -> usize {
        self.page << class
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The size class that holds `len` bytes, if a chunk can.
    fn class_of(&self, len: usize) -> Option<usize> {
        let pages = len.max(1).div_ceil(self.page).checked_next_power_of_two()?;
        let class = pages.trailing_zeros() as usize;
        (class < self.classes).then_some(class)
    }

    /// A zeroed block of at least `len` bytes, or `None` when the ring is
    /// too large for a chunk or no chunk can be added (`charge` refused:
    /// the tenant's descriptors are spent, or the pool holds
    /// [`MAX_CHUNKS`]): the caller makes a memfd of its own then.
    /// `charge` is asked only when a new chunk is needed.
    pub fn alloc(
        self: &Arc<Self>,
        len: usize,
        budget: Option<&Arc<MappingBudget>>,
        charge: impl FnOnce() -> Option<KeptDescriptor>,
    ) -> std::io::Result<Option<Block>> {
        let Some(class) = self.class_of(len) else { return Ok(None) };
        let free_from = |st: &PoolState| (class..self.classes).find(|&c| !st.free[c].is_empty());
        let mut st = self.lock();
        let mut from = match free_from(&st) {
            Some(c) => c,
            None => {
                if st.chunks.len() >= MAX_CHUNKS {
                    return Ok(None);
                }
                // Made unlocked: a ring given back meanwhile (on the
                // engine's thread) does not wait for the system calls.
                // Only this session allocates, so nothing else adds one.
                drop(st);
                let Some(charge) = charge() else { return Ok(None) };
                let (fd, map) = Segment::create_in("vrdma-ring-pool", CHUNK_LEN, budget)?.into_parts();
                st = self.lock();
                let id = st.chunks.len() as u32;
                st.chunks.push(Arc::new(Chunk { id, fd: Arc::new(fd), map, _charge: Some(charge) }));
                st.sent.push(false);
                let top = self.classes - 1;
                st.free[top].insert((id, 0));
                free_from(&st).expect("a new chunk is free")
            }
        };
        let (chunk, offset) = st.free[from].pop_first().expect("a class found non-empty");
        // Split down to the class: the upper halves stay free.
        while from > class {
            from -= 1;
            st.free[from].insert((chunk, offset + self.class_len(from) as u64));
        }
        let chunk = st.chunks[chunk as usize].clone();
        Ok(Some(Block { pool: self.clone(), chunk, offset, class }))
    }

    /// Returns a block, merged with its free buddies. A block zeroed in
    /// place whose merge makes a block larger than [`ZERO_IN_PLACE`] has
    /// that block punched out here, under the lock, before it is free to
    /// be placed again (its larger parts were punched when they formed).
    fn give_back(&self, chunk: &Chunk, mut offset: u64, mut class: usize) {
        let mut st = self.lock();
        let zeroed = self.class_len(class) <= ZERO_IN_PLACE;
        while class + 1 < self.classes {
            let buddy = offset ^ self.class_len(class) as u64;
            if !st.free[class].remove(&(chunk.id, buddy)) {
                break;
            }
            offset = offset.min(buddy);
            class += 1;
        }
        let len = self.class_len(class);
        if zeroed && len > ZERO_IN_PLACE {
            // SAFETY: `[offset, offset + len)` is a free block of the
            // chunk (the buddy system keeps blocks inside it), in its
            // live mapping, which `chunk` keeps mapped.
            punch(unsafe { chunk.map.as_ptr().add(offset as usize) }, len);
        }
        st.free[class].insert((chunk.id, offset));
    }

    /// The descriptor of `chunk` for a reply, the first time the library
    /// is to get it (`None` after: it has the chunk mapped). Marked sent
    /// here, so call it only for a reply that goes out.
    pub fn fd_for_reply(&self, chunk: u32) -> std::io::Result<Option<OwnedFd>> {
        let mut st = self.lock();
        let i = chunk as usize;
        if i >= st.sent.len() || st.sent[i] {
            return Ok(None);
        }
        let fd = st.chunks[i].fd.try_clone()?;
        st.sent[i] = true;
        Ok(Some(fd))
    }

    /// Chunks the pool holds.
    #[cfg(test)]
    fn chunks(&self) -> usize {
        self.lock().chunks.len()
    }

    /// Bytes free in the pool (for tests and statistics).
    #[cfg(test)]
    fn free_bytes(&self) -> usize {
        let st = self.lock();
        st.free.iter().enumerate().map(|(c, s)| s.len() * self.class_len(c)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(pool: &Arc<RingPool>, len: usize) -> Block {
        pool.alloc(len, None, || Some(test_charge())).unwrap().expect("room in the pool")
    }

    fn test_charge() -> KeptDescriptor {
        KeptDescriptor::for_test()
    }

    #[test]
    fn rings_share_one_chunk_and_never_overlap() {
        let pool = RingPool::new();
        let blocks: Vec<Block> = (0..64).map(|i| alloc(&pool, 4096 * (1 + i % 3))).collect();
        assert_eq!(pool.chunks(), 1, "64 small rings fit one chunk");
        let mut spans: Vec<(u64, u64)> =
            blocks.iter().map(|b| (b.offset(), b.offset() + b.len() as u64)).collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "blocks overlap: {:?}", w);
        }
        assert!(spans.last().unwrap().1 <= CHUNK_LEN as u64);
    }

    #[test]
    fn a_freed_block_is_reused_and_comes_back_zeroed() {
        let pool = RingPool::new();
        let a = alloc(&pool, 8192);
        let at = a.offset();
        // SAFETY: the block's own bytes, in a live mapping.
        unsafe { std::ptr::write_bytes(a.as_ptr(), 0xab, a.len()) };
        drop(a);
        let b = alloc(&pool, 8192);
        assert_eq!(b.offset(), at, "the freed block is the first one reused");
        // SAFETY: the block's own bytes, in a live mapping.
        let bytes = unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) };
        assert!(bytes.iter().all(|&x| x == 0), "a reused block starts from zeros");
    }

    /// How many of the `len` bytes' pages at `ptr` are in memory.
    fn resident_pages(ptr: *const u8, len: usize) -> usize {
        let page = page_size();
        let mut v = vec![0u8; len.div_ceil(page)];
        // SAFETY: `[ptr, ptr + len)` is page-aligned and mapped (a chunk's
        // live mapping); mincore writes one byte per page into `v`.
        let r = unsafe { libc::mincore(ptr as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn a_small_freed_block_is_zeroed_in_place_and_a_region_freed_whole_is_punched() {
        let pool = RingPool::new();
        let a = alloc(&pool, 4096);
        // Its buddy, in use: `a` freed merges with nothing.
        let buddy = alloc(&pool, 4096);
        let (base, at) = (a.chunk().clone(), a.offset());
        // SAFETY: the block's own bytes, in a live mapping.
        unsafe { std::ptr::write_bytes(a.as_ptr(), 0xab, a.len()) };
        drop(a);
        // SAFETY: inside the chunk's live mapping.
        let page = unsafe { base.map.as_ptr().add(at as usize) };
        assert_eq!(
            resident_pages(page, 4096),
            1,
            "a small block's page stays (no shootdown, no fault after)"
        );
        drop(buddy);
        assert_eq!(resident_pages(page, 4096), 0, "merged into the whole chunk: punched");
        // Every block of the first 256 KiB used, then freed: the region
        // merges past ZERO_IN_PLACE and its memory goes back.
        let span = 4 * ZERO_IN_PLACE;
        let blocks: Vec<Block> = (0..span / 4096).map(|_| alloc(&pool, 4096)).collect();
        for b in &blocks {
            // SAFETY: the block's own bytes, in a live mapping.
            unsafe { std::ptr::write_bytes(b.as_ptr(), 0xcd, b.len()) };
        }
        assert!(blocks.iter().all(|b| (b.offset() as usize) < span), "placed from the chunk's start");
        let start = base.map.as_ptr();
        assert_eq!(resident_pages(start, span), span / 4096);
        drop(blocks);
        assert_eq!(resident_pages(start, span), 0, "a region freed whole is punched out");
        let again = alloc(&pool, 4096);
        // SAFETY: the block's own bytes, in a live mapping.
        let bytes = unsafe { std::slice::from_raw_parts(again.as_ptr(), again.len()) };
        assert!(bytes.iter().all(|&x| x == 0), "a reused block starts from zeros");
    }

    #[test]
    fn freed_blocks_merge_back_into_a_whole_chunk() {
        let pool = RingPool::new();
        let blocks: Vec<Block> = (0..40).map(|i| alloc(&pool, 4096 << (i % 4))).collect();
        drop(blocks);
        assert_eq!(pool.free_bytes(), CHUNK_LEN * pool.chunks());
        // A ring as large as a chunk fits again without a new one.
        let whole = alloc(&pool, CHUNK_LEN);
        assert_eq!((whole.offset(), pool.chunks()), (0, 1));
    }

    #[test]
    fn a_ring_larger_than_a_chunk_or_a_refused_chunk_is_not_pooled() {
        let pool = RingPool::new();
        assert!(pool.alloc(CHUNK_LEN + 1, None, || Some(test_charge())).unwrap().is_none());
        assert!(pool.alloc(4096, None, || None).unwrap().is_none(), "no charge, no chunk");
        assert_eq!(pool.chunks(), 0);
    }

    #[test]
    fn a_ring_view_of_a_block_cannot_reach_past_it() {
        let pool = RingPool::new();
        let block = Arc::new(alloc(&pool, 4096));
        let _neighbour = alloc(&pool, 4096);
        // A ring that fits the block is made; one placed so that it ends
        // past the block, in the neighbour's, is refused.
        assert!(vrdma_shm::RingView::in_segment(block.clone(), 0, 32, 64).is_ok());
        let fits = (4096 - vrdma_shm::ring_bytes(32, 64)) / 64 * 64;
        assert!(vrdma_shm::RingView::in_segment(block.clone(), fits + 64, 32, 64).is_err());
        assert!(vrdma_shm::RingView::in_segment(block, 4096, 1, 64).is_err());
    }

    #[test]
    fn the_library_gets_a_chunks_descriptor_once() {
        let pool = RingPool::new();
        let a = alloc(&pool, 4096);
        let id = a.chunk().id();
        assert!(pool.fd_for_reply(id).unwrap().is_some());
        assert!(pool.fd_for_reply(id).unwrap().is_none());
        assert!(pool.fd_for_reply(id + 7).unwrap().is_none(), "no such chunk: nothing");
    }
}
