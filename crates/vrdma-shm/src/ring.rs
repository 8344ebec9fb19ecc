//! Single-producer, single-consumer rings of fixed-size slots in shared
//! memory, between two processes that do not trust each other.
//!
//! Layout from the ring's base (64-byte aligned):
//!
//! ```text
//!   0..64    producer index (AtomicU32 at 0), rest of the cache line unused
//!  64..128   consumer index (AtomicU32 at 64)
//! 128..256   32 auxiliary AtomicU32 words (flags such as "armed")
//! 256..      `capacity` slots of `stride` bytes
//! ```
//!
//! Indices are free-running `u32`s compared with wrapping arithmetic; slot
//! `i` lives at `RING_HEADER + (i & (capacity - 1)) * stride`. The producer
//! only advances the producer index and the consumer only the consumer
//! index, each with `Release` after touching the slot, and each reads the
//! other's with `Acquire`.
//!
//! Either index may be scribbled on by a hostile peer. Slot addresses are
//! masked, so no value can make an access leave the ring; and a
//! `producer - consumer` distance above `capacity` is reported as
//! [`RingError::Corrupt`] rather than acted on. A producer reads the
//! consumer's index only when its own copy of it says full (or looks
//! corrupt), so a consumer index scribbled ahead is found up to
//! `capacity` pushes later; until then the pushes go where the copy
//! allows, into that consumer's own ring. Slot bytes are only ever
//! moved with raw copies: no Rust reference into the shared slots is
//! formed, because the peer may be writing them at the same moment.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use vrdma_core::memory::Backing;

/// Bytes before the first slot: two index cache lines and the aux words.
pub const RING_HEADER: usize = 256;
/// Number of auxiliary words.
pub const RING_AUX_WORDS: usize = 32;
/// Required alignment of a ring's base.
pub const RING_ALIGN: usize = 64;

const PRODUCER_OFFSET: usize = 0;
const CONSUMER_OFFSET: usize = 64;
const AUX_OFFSET: usize = 128;

/// Bytes a ring of `capacity` slots of `stride` bytes occupies (saturating
/// at `usize::MAX`, which no mapping can hold).
pub fn ring_bytes(capacity: u32, stride: usize) -> usize {
    checked_ring_bytes(capacity, stride).unwrap_or(usize::MAX)
}

fn checked_ring_bytes(capacity: u32, stride: usize) -> Option<usize> {
    (capacity as usize).checked_mul(stride)?.checked_add(RING_HEADER)
}

/// A ring that cannot be used as asked, or whose shared state is bogus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The indices are more than `capacity` apart: the peer wrote garbage.
    #[error("ring corrupt: producer {producer}, consumer {consumer}, capacity {capacity}")]
    Corrupt { producer: u32, consumer: u32, capacity: u32 },
    /// Capacity is zero or not a power of two.
    #[error("ring capacity {0} is not a non-zero power of two")]
    BadCapacity(u32),
    /// Stride is zero.
    #[error("ring stride must be non-zero")]
    BadStride,
    /// The base is not 64-byte aligned.
    #[error("ring base is not {RING_ALIGN}-byte aligned")]
    Misaligned,
    /// The ring does not fit in its segment.
    #[error("ring of {bytes} bytes at offset {offset} exceeds a segment of {segment_len}")]
    OutOfBounds { offset: usize, bytes: usize, segment_len: usize },
    /// The buffer handed to [`RingView::try_pop`] or
    /// [`RingView::try_push_bytes`] does not match the stride.
    #[error("buffer of {got} bytes for slots of {stride}")]
    BadBuffer { got: usize, stride: usize },
}

/// What [`RingView::try_claim`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Nothing to take.
    Empty,
    /// The oldest entry was shown and refused; it stays.
    Refused,
    /// The oldest entry is ours (in the buffer).
    Taken,
}

/// One side's view of a ring in shared memory.
///
/// The view works for either side: a process uses the producer methods
/// ([`try_push`](Self::try_push), [`free_slots`](Self::free_slots)) on rings
/// it fills and the consumer methods ([`try_pop`](Self::try_pop),
/// [`discard_all`](Self::discard_all)) on rings it drains. Calls of one
/// side are serialised inside the view, so a view can be shared between
/// threads; there must be only one producing and one consuming view per
/// ring in the process.
pub struct RingView {
    base: *mut u8,
    capacity: u32,
    stride: usize,
    /// Keeps the mapping alive when the view was made from a segment.
    _segment: Option<Arc<dyn Backing>>,
    /// Producer lock and private slot buffer that the fill closure writes.
    producer: Mutex<Vec<u8>>,
    /// Consumer lock.
    consumer: Mutex<()>,
    /// The consumer index as this view's producer side last read it (a
    /// private copy, never in shared memory). The consumer index only
    /// moves forward, so entries counted against this copy are never fewer
    /// than those really unread: a producer that finds room by it has room,
    /// and reads the shared index (the consumer's cache line, which the
    /// consumer writes on every pop) only when the copy says full. That is
    /// one cache line less moved between the two processes per entry.
    seen_consumer: AtomicU32,
}

impl fmt::Debug for RingView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingView")
            .field("base", &self.base)
            .field("capacity", &self.capacity)
            .field("stride", &self.stride)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in a fill closure poisons the lock but leaves the ring
    // consistent (the index was not advanced), so carry on.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `copy_nonoverlapping(src, dst, len)` for one slot. The strides most
/// copied (a CQ entry or inbox entry, 64 bytes; a one-SGE receive, 32)
/// go as 16-byte words read and written one by one, which the compiler
/// keeps as a few vector moves: a length known only at run time is a call
/// to `memcpy`, which costs more than these copies themselves. (Arms that
/// copy a fixed size with `copy_nonoverlapping`, or a fixed-size array,
/// are not enough: the compiler turns them into `memcpy` calls and merges
/// those back into the one call with `len`.)
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable
/// for `len` bytes, not overlapping.
#[inline]
unsafe fn copy_slot(src: *const u8, dst: *mut u8, len: usize) {
    let (s, d) = (src.cast::<u128>(), dst.cast::<u128>());
    // SAFETY: the caller's contract; unaligned reads and writes, each arm
    // exactly `len` bytes (word `i` is bytes `16 i .. 16 i + 16`).
    unsafe {
        match len {
            64 => {
                d.write_unaligned(s.read_unaligned());
                d.add(1).write_unaligned(s.add(1).read_unaligned());
                d.add(2).write_unaligned(s.add(2).read_unaligned());
                d.add(3).write_unaligned(s.add(3).read_unaligned());
            }
            32 => {
                d.write_unaligned(s.read_unaligned());
                d.add(1).write_unaligned(s.add(1).read_unaligned());
            }
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}

/// Zeroes one slot's private buffer, the common strides word by word as
/// [`copy_slot`] copies them (a `memset` call otherwise).
#[inline]
fn zero_slot(buf: &mut [u8]) {
    let d = buf.as_mut_ptr().cast::<u128>();
    // SAFETY: each arm writes exactly `buf.len()` bytes of `buf`
    // (unaligned writes).
    unsafe {
        match buf.len() {
            64 => {
                d.write_unaligned(0);
                d.add(1).write_unaligned(0);
                d.add(2).write_unaligned(0);
                d.add(3).write_unaligned(0);
            }
            32 => {
                d.write_unaligned(0);
                d.add(1).write_unaligned(0);
            }
            _ => buf.fill(0),
        }
    }
}

fn check_shape(capacity: u32, stride: usize) -> Result<usize, RingError> {
    if !capacity.is_power_of_two() {
        return Err(RingError::BadCapacity(capacity));
    }
    if stride == 0 {
        return Err(RingError::BadStride);
    }
    checked_ring_bytes(capacity, stride).ok_or(RingError::OutOfBounds {
        offset: 0,
        bytes: usize::MAX,
        segment_len: 0,
    })
}

impl RingView {
    /// A view of the ring at `base`.
    ///
    /// Fails if `capacity` is not a power of two, `stride` is zero, or
    /// `base` is not 64-byte aligned.
    ///
    /// # Safety
    /// `base..base + ring_bytes(capacity, stride)` must be readable and
    /// writable memory (typically a shared mapping) that stays mapped for
    /// as long as the returned view lives, and must be accessed by others
    /// only through this ring protocol (atomics on the header words, slot
    /// bytes by their owner side).
    pub unsafe fn new(base: *mut u8, capacity: u32, stride: usize) -> Result<RingView, RingError> {
        check_shape(capacity, stride)?;
        if base.is_null() || (base as usize) & (RING_ALIGN - 1) != 0 {
            return Err(RingError::Misaligned);
        }
        Ok(RingView::build(base, capacity, stride, None))
    }

    /// A view of the ring at `offset` in `seg` (a [`crate::Segment`] or a
    /// [`crate::Mapping`]), which the view keeps alive.
    pub fn in_segment<B: Backing + 'static>(
        seg: Arc<B>,
        offset: usize,
        capacity: u32,
        stride: usize,
    ) -> Result<RingView, RingError> {
        let bytes = check_shape(capacity, stride)?;
        if offset & (RING_ALIGN - 1) != 0 {
            return Err(RingError::Misaligned);
        }
        match offset.checked_add(bytes) {
            Some(end) if end <= seg.len() => {}
            _ => return Err(RingError::OutOfBounds { offset, bytes, segment_len: seg.len() }),
        }
        // SAFETY: offset + bytes <= seg.len() (checked above), so the
        // pointer stays inside the segment's mapping.
        let base = unsafe { seg.as_ptr().add(offset) };
        // The segment is page-aligned and offset is a multiple of 64.
        debug_assert_eq!(base as usize % RING_ALIGN, 0);
        Ok(RingView::build(base, capacity, stride, Some(seg)))
    }

    fn build(base: *mut u8, capacity: u32, stride: usize, seg: Option<Arc<dyn Backing>>) -> RingView {
        let view = RingView {
            base,
            capacity,
            stride,
            _segment: seg,
            producer: Mutex::new(vec![0; stride]),
            consumer: Mutex::new(()),
            seen_consumer: AtomicU32::new(0),
        };
        view.refresh_consumer_copy();
        view
    }

    /// Number of slots.
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes per slot.
    #[inline]
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The atomic word at `offset` in the header (offset < RING_HEADER,
    /// multiple of 4).
    #[inline]
    fn word(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset < RING_HEADER && offset & 3 == 0);
        // SAFETY: `base` is 64-aligned and valid for RING_HEADER bytes (the
        // contract of `new`/`in_segment`), so `base + offset` is a 4-aligned
        // u32 inside the live mapping for as long as `self`. Both processes
        // access header words only atomically, so a shared `&AtomicU32` is
        // the right type for them.
        unsafe { &*(self.base.add(offset) as *const AtomicU32) }
    }

    #[inline]
    fn producer_index(&self) -> &AtomicU32 {
        self.word(PRODUCER_OFFSET)
    }

    #[inline]
    fn consumer_index(&self) -> &AtomicU32 {
        self.word(CONSUMER_OFFSET)
    }

    /// Overwrites the producer index with `value`, as a buggy or hostile
    /// producer may: for tests that the consumer side survives it.
    #[doc(hidden)]
    pub fn scribble_producer_index(&self, value: u32) {
        self.producer_index().store(value, Ordering::SeqCst);
    }

    /// How many entries were ever pushed (the producer index, wrapping):
    /// the producer's own count, e.g. to compare with a count of entries
    /// the consumer says it finished with.
    #[inline]
    pub fn produced(&self) -> u32 {
        self.producer_index().load(Ordering::Acquire)
    }

    /// How many entries were ever taken (the consumer index, wrapping):
    /// the index of the next entry to take.
    #[inline]
    pub fn consumed(&self) -> u32 {
        self.consumer_index().load(Ordering::Acquire)
    }

    /// Auxiliary word `i` of the header, for flags the users agree on.
    ///
    /// # Panics
    /// If `i >= RING_AUX_WORDS` (32): a programming error, never caused by
    /// the peer.
    #[inline]
    pub fn aux(&self, i: usize) -> &AtomicU32 {
        assert!(i < RING_AUX_WORDS, "ring aux word {i} out of range");
        self.word(AUX_OFFSET + 4 * i)
    }

    /// Pointer to the slot of free-running index `idx`.
    #[inline]
    fn slot(&self, idx: u32) -> *mut u8 {
        let i = (idx & (self.capacity - 1)) as usize;
        // SAFETY: i < capacity, so RING_HEADER + i * stride + stride <=
        // ring_bytes(capacity, stride), which is inside the mapping.
        unsafe { self.base.add(RING_HEADER + i * self.stride) }
    }

    /// `producer - consumer`, or `Corrupt` if that exceeds the capacity.
    #[inline]
    fn distance(&self, producer: u32, consumer: u32) -> Result<u32, RingError> {
        let used = producer.wrapping_sub(consumer);
        if used > self.capacity {
            return Err(RingError::Corrupt { producer, consumer, capacity: self.capacity });
        }
        Ok(used)
    }

    /// Entries the producer has published and the consumer not yet taken.
    #[inline]
    pub fn len(&self) -> Result<u32, RingError> {
        let consumer = self.consumer_index().load(Ordering::Acquire);
        let producer = self.producer_index().load(Ordering::Acquire);
        self.distance(producer, consumer)
    }

    /// Whether [`len`](Self::len) is zero.
    pub fn is_empty(&self) -> Result<bool, RingError> {
        Ok(self.len()? == 0)
    }

    /// Producer side: slots free for [`try_push`](Self::try_push).
    pub fn free_slots(&self) -> Result<u32, RingError> {
        Ok(self.capacity - self.len()?)
    }

    /// Producer side: fills the next slot and publishes it.
    ///
    /// `write` gets a zeroed private buffer of `stride` bytes, which is
    /// copied into the slot before the producer index moves. Returns
    /// `Ok(false)` if the ring is full (and `write` is not called).
    ///
    /// `write` runs under this view's producer lock, so it must not push
    /// to the same view (that would deadlock).
    pub fn try_push(&self, write: impl FnOnce(&mut [u8])) -> Result<bool, RingError> {
        self.try_push_if(|_| true, write)
    }

    /// Producer side: as [`try_push`](Self::try_push), but only if `admit`,
    /// given the producer index (how many entries were ever pushed,
    /// wrapping), says yes; `Ok(false)` otherwise. `admit` runs under the
    /// producer lock, so a limit it checks holds against concurrent pushes
    /// through this view.
    pub fn try_push_if(
        &self,
        admit: impl FnOnce(u32) -> bool,
        write: impl FnOnce(&mut [u8]),
    ) -> Result<bool, RingError> {
        let mut scratch = lock(&self.producer);
        let Some(producer) = self.reserve()? else {
            return Ok(false);
        };
        if !admit(producer) {
            return Ok(false);
        }
        zero_slot(&mut scratch);
        write(&mut scratch);
        self.publish(producer, &scratch);
        Ok(true)
    }

    /// Producer side: copies `src` (exactly `stride` bytes) into the next
    /// slot and publishes it. Returns `Ok(false)` if the ring is full.
    pub fn try_push_bytes(&self, src: &[u8]) -> Result<bool, RingError> {
        if src.len() != self.stride {
            return Err(RingError::BadBuffer { got: src.len(), stride: self.stride });
        }
        let _guard = lock(&self.producer);
        let Some(producer) = self.reserve()? else {
            return Ok(false);
        };
        self.publish(producer, src);
        Ok(true)
    }

    /// Producer side, for a ring with a second producer that may publish
    /// on the first one's behalf (a direct-path inbox, whose entry the
    /// daemon publishes when the requester that wrote it died before it
    /// could, `docs/direct-path.md`): copies `src` (exactly `stride`
    /// bytes) into the next free slot *without* publishing it; returns the
    /// slot's free-running index, `None` if the ring is full. The entry is
    /// published by [`publish_staged`](Self::publish_staged), by whichever
    /// producer gets there first. Staging again before that overwrites it.
    pub fn stage(&self, src: &[u8]) -> Result<Option<u32>, RingError> {
        if src.len() != self.stride {
            return Err(RingError::BadBuffer { got: src.len(), stride: self.stride });
        }
        let _guard = lock(&self.producer);
        self.stage_held(src)
    }

    /// [`stage`](Self::stage) through a view no other thread can reach
    /// (`&mut`): the same, without taking the producer lock, which only
    /// orders this view's users among themselves (a direct-path
    /// requester's inbox view, used under its QP's own lock).
    pub fn stage_mut(&mut self, src: &[u8]) -> Result<Option<u32>, RingError> {
        if src.len() != self.stride {
            return Err(RingError::BadBuffer { got: src.len(), stride: self.stride });
        }
        self.stage_held(src)
    }

    /// `stage` with the producer side held (its lock, or `&mut self`).
    fn stage_held(&self, src: &[u8]) -> Result<Option<u32>, RingError> {
        let Some(producer) = self.reserve()? else {
            return Ok(None);
        };
        // SAFETY: as in `publish`: the slot is `stride` bytes inside the
        // mapping, `src` is `stride` bytes of private memory; the slot is
        // not published, so the consumer does not read it.
        unsafe { copy_slot(src.as_ptr(), self.slot(producer), self.stride) };
        Ok(Some(producer))
    }

    /// Producer side: stores byte `offset` of the staged (unpublished)
    /// slot of free-running index `at` atomically, so that whichever
    /// producer publishes it publishes the slot with the byte either
    /// before or after, never torn. Ignored if `offset` is past the slot.
    #[inline]
    pub fn set_staged_byte(&self, at: u32, offset: usize, value: u8) {
        if offset >= self.stride {
            return;
        }
        // SAFETY: `offset < stride`, so the byte is inside the slot, inside
        // the mapping (see `slot`); an `AtomicU8` has no alignment
        // requirement, and every access to a staged slot's byte that may
        // race (this store, the other producer's publication of the slot,
        // the consumer's copy after it) is atomic or ordered by the
        // producer index.
        let byte = unsafe { &*(self.slot(at).add(offset) as *const std::sync::atomic::AtomicU8) };
        byte.store(value, Ordering::Release);
    }

    /// Producer side: publishes the slot staged at free-running index `at`
    /// ([`stage`](Self::stage)) with a compare-and-swap of the producer
    /// index from `at` to `at + 1`, so that of two producers publishing
    /// the same slot exactly one does. `false` when the index was not
    /// `at` (the other producer published it, or it moved on), or the
    /// slot would not fit (`at` full capacity ahead of the consumer).
    #[inline]
    pub fn publish_staged(&self, at: u32) -> bool {
        // Against this view's copy of the consumer index first, as a push
        // (`below`): the stage just read it when it had to.
        if !matches!(self.below(at, self.capacity), Ok(true)) {
            return false;
        }
        self.producer_index()
            .compare_exchange(at, at.wrapping_add(1), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The producer index of a free slot, `None` if full.
    #[inline]
    fn reserve(&self) -> Result<Option<u32>, RingError> {
        // Our own index: only we advance it (a hostile peer may overwrite
        // it, which `distance` then catches or which only garbles the data
        // sent to that same peer).
        let producer = self.producer_index().load(Ordering::Relaxed);
        Ok(self.below(producer, self.capacity)?.then_some(producer))
    }

    /// Producer side: whether fewer than `limit` (at most the capacity)
    /// entries are published and not yet taken, with `producer` the
    /// producer index just read. Counts against `seen_consumer`
    /// first and reads the shared consumer index only when that says
    /// `limit` or more (or looks corrupt): an older consumer index counts
    /// more entries, never fewer (it only moves forward; one a hostile
    /// consumer moved back, or ahead of the producer, garbles only the
    /// entries it is sent). A consumer index read here was read with
    /// `Acquire` then, so the consumer had finished copying out the slots
    /// it released before that read, as before any later push.
    #[inline]
    fn below(&self, producer: u32, limit: u32) -> Result<bool, RingError> {
        let seen = self.seen_consumer.load(Ordering::Acquire);
        if matches!(self.distance(producer, seen), Ok(used) if used < limit) {
            return Ok(true);
        }
        let consumer = self.refresh_consumer_copy();
        Ok(self.distance(producer, consumer)? < limit)
    }

    /// Producer side: takes a fresh copy of the consumer's index, for a
    /// producer that pushes into this ring rarely while another producer
    /// (in another process, with a copy of its own) moves the producer
    /// index on: a copy older than 2^32 of the other's pushes could count
    /// a full ring as having room (the daemon's flush of an inbox that a
    /// requester has been publishing into). Returns the index it copied.
    pub fn refresh_consumer_copy(&self) -> u32 {
        // Acquire: the consumer finished copying out the slots it released.
        let consumer = self.consumer_index().load(Ordering::Acquire);
        // Release, with the Acquire load above: a thread that counts
        // against the copy without the producer lock (`fewer_than`,
        // `publish_staged`) sees the slots released as this one did.
        self.seen_consumer.store(consumer, Ordering::Release);
        consumer
    }

    /// Producer side: whether fewer than `limit` entries are unread, as
    /// [`len`](Self::len)` < limit` answers it, but reading the consumer's
    /// index only when this view's last copy of it says `limit` or more
    /// (see `seen_consumer`): a producer's check before a push that needs
    /// no cache line the consumer writes on every pop.
    #[inline]
    pub fn fewer_than(&self, limit: u32) -> Result<bool, RingError> {
        let producer = self.producer_index().load(Ordering::Acquire);
        self.below(producer, limit.min(self.capacity))
    }

    fn publish(&self, producer: u32, src: &[u8]) {
        debug_assert_eq!(src.len(), self.stride);
        // SAFETY: the slot is `stride` bytes inside the mapping (see `slot`)
        // and `src` is `stride` bytes of private memory, so the ranges are
        // valid and disjoint. The consumer does not touch a slot the
        // producer owns; a hostile one racing here only garbles its own
        // data, and no reference into the slot exists.
        unsafe { copy_slot(src.as_ptr(), self.slot(producer), self.stride) };
        // Release: the slot bytes are visible before the new index.
        self.producer_index().store(producer.wrapping_add(1), Ordering::Release);
    }

    /// Consumer side: copies the oldest entry into `out[..stride]` and
    /// releases its slot. Returns `Ok(false)` if the ring is empty.
    ///
    /// `out` must be at least `stride` bytes.
    pub fn try_pop(&self, out: &mut [u8]) -> Result<bool, RingError> {
        if out.len() < self.stride {
            return Err(RingError::BadBuffer { got: out.len(), stride: self.stride });
        }
        // Empty, without the consumer lock (two atomic read-modify-writes
        // per poll of an empty ring otherwise): the consumer index is read
        // first and only moves forward, up to the producer index, so equal
        // indices mean the ring was empty when the producer index was
        // read, as the locked look would have answered then. This look is
        // no fence: a waiter that marks itself asleep and then looks here
        // needs its own `fence(SeqCst)` between the two (the engine's
        // sleep, `park_queues` and CQ arming have theirs), or a producer
        // that published meanwhile may not see the mark.
        let consumer = self.consumer_index().load(Ordering::Acquire);
        if self.producer_index().load(Ordering::Acquire) == consumer {
            return Ok(false);
        }
        let _guard = lock(&self.consumer);
        let consumer = self.consumer_index().load(Ordering::Relaxed);
        // Acquire: the slot bytes the producer wrote before publishing.
        let producer = self.producer_index().load(Ordering::Acquire);
        if self.distance(producer, consumer)? == 0 {
            return Ok(false);
        }
        // SAFETY: the slot is `stride` bytes inside the mapping and `out`
        // is at least `stride` bytes of private memory, so both ranges are
        // valid and disjoint. The copy is raw: a hostile producer writing
        // the slot concurrently can only change the bytes we get, which
        // the caller validates anyway.
        unsafe { copy_slot(self.slot(consumer), out.as_mut_ptr(), self.stride) };
        // Release: our reads of the slot happen before the producer may
        // reuse it.
        self.consumer_index().store(consumer.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Consumer side, for a ring with a consumer in each of two processes
    /// (a receive queue that the daemon's engine and a direct-path
    /// requester both take from, `docs/direct-path.md`): copies the oldest
    /// entry into `out[..stride]`, shows it to `take`, and if `take` says
    /// yes claims it with a compare-and-swap on the consumer index, so that
    /// each entry is taken by exactly one consumer. An entry the other
    /// consumer took first is let go and the next one looked at (bounded:
    /// after `capacity` such races it answers `Empty`).
    pub fn try_claim(&self, out: &mut [u8], take: impl FnMut(&[u8]) -> bool) -> Result<Claim, RingError> {
        self.try_claim_noting(out, |_| {}, take)
    }

    /// [`try_claim`](Self::try_claim), telling `note` the consumer index
    /// each attempt is about to claim, before the attempt reads the index
    /// again and before its compare-and-swap (all `SeqCst`). A consumer
    /// that publishes the index it means to claim in `note` (a direct-path
    /// requester on an SRQ, `docs/direct-path.md`) and another that reads
    /// it after its own successful claim form a Dekker pair: if the other
    /// took that index, it sees it noted.
    pub fn try_claim_noting(
        &self,
        out: &mut [u8],
        mut note: impl FnMut(u32),
        mut take: impl FnMut(&[u8]) -> bool,
    ) -> Result<Claim, RingError> {
        if out.len() < self.stride {
            return Err(RingError::BadBuffer { got: out.len(), stride: self.stride });
        }
        let _guard = lock(&self.consumer);
        for _ in 0..=self.capacity {
            let consumer = self.consumer_index().load(Ordering::SeqCst);
            note(consumer);
            let producer = self.producer_index().load(Ordering::Acquire);
            // The other consumer may have moved the index (and the
            // producer refilled) between the two loads: a distance read
            // so is no corruption. Only one read between two equal
            // consumer indices is believed.
            if self.consumer_index().load(Ordering::SeqCst) != consumer {
                continue;
            }
            if self.distance(producer, consumer)? == 0 {
                return Ok(Claim::Empty);
            }
            // SAFETY: as in `try_pop`. The slot may be released by the
            // other consumer meanwhile and refilled; the compare-and-swap
            // below then fails and the copy is dropped.
            unsafe { copy_slot(self.slot(consumer), out.as_mut_ptr(), self.stride) };
            if !take(&out[..self.stride]) {
                return Ok(Claim::Refused);
            }
            if self
                .consumer_index()
                .compare_exchange(consumer, consumer.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Ok(Claim::Taken);
            }
        }
        Ok(Claim::Empty)
    }

    /// How many of the entries still unread are among the first
    /// `produced` ever pushed (a producer index read earlier): 0 when the
    /// consumer is past them, or the indices are corrupt. Bounded by
    /// [`len`](Self::len), whatever either side wrote to the indices.
    pub fn unread_before(&self, produced: u32) -> u32 {
        let Ok(unread) = self.len() else { return 0 };
        let consumed = self.produced().wrapping_sub(unread);
        let before = produced.wrapping_sub(consumed);
        if before <= unread {
            before
        } else {
            0
        }
    }

    /// Consumer side: drops every published entry (a queue reset).
    /// Returns how many were dropped: exactly those this call moved the
    /// consumer index past, so that a second consumer's claim racing it (a
    /// direct-path requester's compare-and-swap on a receive queue being
    /// reset) is counted by whoever made it, never by both. Bounded: a
    /// call that loses the index to the other consumer more than
    /// `capacity` times in a row drops nothing and answers 0.
    pub fn discard_all(&self) -> Result<u32, RingError> {
        self.discard_all_between(|| {})
    }

    /// [`discard_all`](Self::discard_all), running `between` after each
    /// read of the indices and before the compare-and-swap that drops the
    /// entries read: where a test puts the other consumer's claim.
    fn discard_all_between(&self, mut between: impl FnMut()) -> Result<u32, RingError> {
        let _guard = lock(&self.consumer);
        for _ in 0..=self.capacity {
            let consumer = self.consumer_index().load(Ordering::SeqCst);
            let producer = self.producer_index().load(Ordering::Acquire);
            let dropped = self.distance(producer, consumer)?;
            between();
            // A compare-and-swap, not a store: a store would also drop an
            // entry the other consumer claimed meanwhile, and count it.
            if self
                .consumer_index()
                .compare_exchange(consumer, producer, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Ok(dropped);
            }
        }
        Ok(0)
    }
}

// SAFETY: the view holds a raw pointer into a shared mapping that stays
// valid for the view's life (kept alive by the Arc of its backing or promised by
// the caller of `new`); the memory is process-wide, so using it from
// another thread is no different from using it from this one.
unsafe impl Send for RingView {}
// SAFETY: all access through `&RingView` is synchronised: header words are
// atomics, producer and consumer operations each take their own mutex, and
// slot bytes are moved with raw copies between a slot one side owns and
// private buffers, never through shared references.
unsafe impl Sync for RingView {}

#[cfg(test)]
mod tests {
    /// A staged slot is invisible until published, and of two producers
    /// publishing it exactly one does, with the bytes as they stood then.
    #[test]
    fn a_staged_slot_is_published_once_by_either_producer() {
        let seg = std::sync::Arc::new(crate::Segment::create("vrdma-test", ring_bytes(4, 8)).unwrap());
        let r = RingView::in_segment(seg, 0, 4, 8).unwrap();
        let at = r.stage(&[7u8; 8]).unwrap().unwrap();
        assert_eq!(r.len().unwrap(), 0, "staged is not published");
        r.set_staged_byte(at, 0, 9);
        r.set_staged_byte(at, 8, 1); // past the slot: ignored
        assert!(r.publish_staged(at), "the first publication wins");
        assert!(!r.publish_staged(at), "the second finds it published");
        let mut out = [0u8; 8];
        assert!(r.try_pop(&mut out).unwrap());
        assert_eq!(out, [9, 7, 7, 7, 7, 7, 7, 7]);
        assert!(!r.try_pop(&mut out).unwrap(), "once");
        // A full ring stages nothing; an index a capacity ahead of the
        // consumer is never published.
        (0..4).for_each(|_| assert!(r.try_push_bytes(&[1u8; 8]).unwrap()));
        assert_eq!(r.stage(&[2u8; 8]).unwrap(), None);
        assert!(!r.publish_staged(r.produced()));
        assert_eq!(r.len().unwrap(), 4);
    }

    #[test]
    fn unread_before_counts_the_unread_entries_pushed_before_a_mark() {
        let seg = std::sync::Arc::new(crate::Segment::create("vrdma-test", ring_bytes(8, 8)).unwrap());
        let r = RingView::in_segment(seg, 0, 8, 8).unwrap();
        let push = |n: u32| (0..n).for_each(|_| assert!(r.try_push_bytes(&[1u8; 8]).unwrap()));
        let pop = |n: u32| (0..n).for_each(|_| assert!(r.try_pop(&mut [0u8; 8]).unwrap()));
        push(5);
        pop(2);
        let mark = r.produced();
        assert_eq!(r.unread_before(mark), 3);
        push(2);
        assert_eq!(r.unread_before(mark), 3, "pushed after the mark");
        pop(2);
        assert_eq!(r.unread_before(mark), 1);
        pop(2);
        assert_eq!(r.unread_before(mark), 0, "the consumer is past the mark");
        pop(1);
        assert_eq!(r.unread_before(mark), 0);
        // Indices that wrapped count the same.
        for _ in 0..1000 {
            push(1);
            pop(1);
        }
        push(4);
        assert_eq!(r.unread_before(r.produced()), 4);
        assert_eq!(r.unread_before(r.produced().wrapping_sub(100)), 0, "a mark before the oldest unread");
        r.scribble_producer_index(r.produced().wrapping_add(1000));
        assert_eq!(r.unread_before(r.produced()), 0, "corrupt indices");
    }

    use super::*;
    use crate::Segment;

    fn pair(capacity: u32, stride: usize) -> (RingView, RingView) {
        let seg = Arc::new(Segment::create("vrdma-ring", 4096 + ring_bytes(capacity, stride)).unwrap());
        // The consumer maps the same file separately, as another process would.
        let other = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
        let p = RingView::in_segment(seg, 4096, capacity, stride).unwrap();
        let c = RingView::in_segment(other, 4096, capacity, stride).unwrap();
        (p, c)
    }

    #[test]
    fn two_claiming_consumers_take_each_entry_once_in_order() {
        const N: u32 = 20_000;
        // A producer and two consumers, each in "another process" (its
        // own mapping).
        let seg = Arc::new(Segment::create("vrdma-ring", 4096 + ring_bytes(64, 8)).unwrap());
        let view = || {
            let m = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
            RingView::in_segment(m, 4096, 64, 8).unwrap()
        };
        let (p, c, c2) = (view(), view(), view());
        let mut out = [0u8; 8];
        // Refused: stays for the next look.
        assert!(p.try_push_bytes(&7u64.to_le_bytes()).unwrap());
        assert_eq!(c2.try_claim(&mut out, |_| false), Ok(Claim::Refused));
        assert_eq!(c.try_claim(&mut out, |_| true), Ok(Claim::Taken));
        assert_eq!(u64::from_le_bytes(out), 7);
        assert_eq!(c2.try_claim(&mut out, |_| true), Ok(Claim::Empty));
        fn take(v: &RingView) -> Vec<u64> {
            let mut got = Vec::new();
            let mut out = [0u8; 8];
            let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while std::time::Instant::now() < end {
                match v.try_claim(&mut out, |_| true).unwrap() {
                    Claim::Taken => {
                        let x = u64::from_le_bytes(out);
                        if x == u64::MAX {
                            break;
                        }
                        got.push(x);
                    }
                    _ => std::hint::spin_loop(),
                }
            }
            got
        }
        let taken = std::thread::scope(|sc| {
            let (c, c2) = (&c, &c2);
            let t1 = sc.spawn(move || take(c));
            let t2 = sc.spawn(move || take(c2));
            for i in (0..N as u64).chain([u64::MAX, u64::MAX]) {
                while !p.try_push_bytes(&i.to_le_bytes()).unwrap() {
                    std::hint::spin_loop();
                }
            }
            (t1.join().unwrap(), t2.join().unwrap())
        });
        // Each in order, together every entry once.
        assert!(taken.0.windows(2).all(|w| w[0] < w[1]) && taken.1.windows(2).all(|w| w[0] < w[1]));
        let mut all: Vec<u64> = taken.0.into_iter().chain(taken.1).collect();
        all.sort_unstable();
        assert!(all.iter().copied().eq(0..N as u64));
    }

    /// A slot copy copies exactly `len` bytes, in order, for the strides
    /// it copies word by word and for others.
    #[test]
    fn a_slot_copy_copies_exactly_its_length() {
        for len in [0, 1, 16, 31, 32, 33, 48, 64, 65, 100] {
            let src: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(7).wrapping_add(1)).collect();
            let mut dst = vec![0xeeu8; 128];
            // SAFETY: both buffers hold 128 >= len bytes; distinct vectors.
            unsafe { copy_slot(src.as_ptr(), dst.as_mut_ptr(), len) };
            assert_eq!(&dst[..len], &src[..len], "{len} bytes");
            assert!(dst[len..].iter().all(|&b| b == 0xee), "nothing past {len} bytes");
        }
    }

    /// A slot zeroed is zero, whatever its length.
    #[test]
    fn a_zeroed_slot_is_all_zero() {
        for len in [0, 1, 16, 31, 32, 33, 48, 64, 65, 100] {
            let mut buf = vec![0xeeu8; len];
            zero_slot(&mut buf);
            assert!(buf.iter().all(|&b| b == 0), "{len} bytes");
        }
    }

    #[test]
    fn layout() {
        assert_eq!(ring_bytes(8, 64), 256 + 512);
        assert_eq!(ring_bytes(u32::MAX, usize::MAX), usize::MAX);
    }

    #[test]
    fn push_pop_across_mappings() {
        let (p, c) = pair(4, 32);
        let mut out = [0u8; 32];
        assert_eq!(c.try_pop(&mut out), Ok(false));
        assert_eq!(p.free_slots(), Ok(4));
        assert!(p.try_push(|s| s[..5].copy_from_slice(b"hello")).unwrap());
        assert_eq!(c.len(), Ok(1));
        assert!(c.try_pop(&mut out).unwrap());
        assert_eq!(&out[..5], b"hello");
        assert!(out[5..].iter().all(|&b| b == 0));
        assert_eq!(c.try_pop(&mut out), Ok(false));
        assert_eq!(c.is_empty(), Ok(true));
    }

    #[test]
    fn full_and_empty() {
        let (p, c) = pair(4, 8);
        for i in 0..4u8 {
            assert!(p.try_push_bytes(&[i; 8]).unwrap());
        }
        let mut called = false;
        assert_eq!(p.try_push(|_| called = true), Ok(false));
        assert!(!called);
        assert_eq!(p.free_slots(), Ok(0));
        let mut out = [0u8; 8];
        for i in 0..4u8 {
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, [i; 8]);
        }
        assert_eq!(c.try_pop(&mut out), Ok(false));
    }

    #[test]
    fn push_if_sees_the_producer_index() {
        let (p, c) = pair(4, 8);
        let mut seen = Vec::new();
        for _ in 0..3 {
            assert!(p
                .try_push_if(
                    |i| {
                        seen.push(i);
                        true
                    },
                    |_| {}
                )
                .unwrap());
        }
        assert_eq!(seen, [0, 1, 2]);
        let mut called = false;
        assert_eq!(p.try_push_if(|_| false, |_| called = true), Ok(false));
        assert!(!called);
        assert_eq!(c.len(), Ok(3), "a refused push publishes nothing");
        let mut out = [0u8; 8];
        assert!(c.try_pop(&mut out).unwrap());
        assert!(p.try_push_if(|i| i == 3, |_| {}).unwrap());
        assert!(p.try_push_if(|i| i == 4, |_| {}).unwrap());
        // Full: `admit` is not asked.
        assert_eq!(p.try_push_if(|_| panic!("asked while full"), |_| {}), Ok(false));
    }

    #[test]
    fn wraparound() {
        let (p, c) = pair(8, 16);
        // Start near the u32 wrap so the indices cross it.
        p.producer_index().store(u32::MAX - 20, Ordering::Relaxed);
        p.consumer_index().store(u32::MAX - 20, Ordering::Relaxed);
        let mut next_in = 0u64;
        let mut next_out = 0u64;
        let mut out = [0u8; 16];
        for round in 0..10_000u64 {
            let burst = (round % 9) as usize;
            for _ in 0..burst {
                if p.try_push(|s| s[..8].copy_from_slice(&next_in.to_le_bytes())).unwrap() {
                    next_in += 1;
                }
            }
            for _ in 0..(round % 7) {
                if c.try_pop(&mut out).unwrap() {
                    assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), next_out);
                    next_out += 1;
                }
            }
        }
        while c.try_pop(&mut out).unwrap() {
            assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), next_out);
            next_out += 1;
        }
        assert_eq!(next_in, next_out);
        assert!(next_in > 10_000);
    }

    #[test]
    fn threads() {
        let (p, c) = pair(16, 8);
        const N: u64 = 100_000;
        let prod = std::thread::spawn(move || {
            let mut i = 0u64;
            while i < N {
                if p.try_push_bytes(&i.to_le_bytes()).unwrap() {
                    i += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let mut out = [0u8; 8];
        let mut expect = 0u64;
        while expect < N {
            if c.try_pop(&mut out).unwrap() {
                assert_eq!(u64::from_le_bytes(out), expect);
                expect += 1;
            } else {
                std::hint::spin_loop();
            }
        }
        prod.join().unwrap();
    }

    #[test]
    fn corrupt_indices() {
        let (p, c) = pair(4, 8);
        let mut out = [0u8; 8];
        // A hostile producer jumps its index far ahead.
        p.producer_index().store(1000, Ordering::Release);
        assert!(matches!(c.try_pop(&mut out), Err(RingError::Corrupt { producer: 1000, .. })));
        assert!(matches!(c.discard_all(), Err(RingError::Corrupt { .. })));
        assert!(matches!(c.len(), Err(RingError::Corrupt { .. })));
        // Exactly `capacity` ahead is a full ring, not corruption.
        p.producer_index().store(4, Ordering::Release);
        assert_eq!(c.len(), Ok(4));
        // A hostile consumer claims to be ahead of the producer.
        c.consumer_index().store(5, Ordering::Release);
        assert!(matches!(p.try_push(|_| {}), Err(RingError::Corrupt { .. })));
        assert!(matches!(p.try_push_bytes(&[0; 8]), Err(RingError::Corrupt { .. })));
        assert!(matches!(p.free_slots(), Err(RingError::Corrupt { .. })));
    }

    /// A producer counts unread entries against its own copy of the
    /// consumer's index and reads the shared one only when the copy says
    /// full: here the shared index is scribbled (a fresh read would be
    /// `Corrupt`) while the copy still has room, and the push goes
    /// through; with the index back, a push the copy calls full reads it
    /// and finds the room the consumer made. The copy never counts fewer
    /// entries than are unread: a full ring stays full.
    #[test]
    fn a_producer_reads_the_consumer_index_only_when_its_copy_says_full() {
        let (p, c) = pair(4, 8);
        let mut out = [0u8; 8];
        for i in 0..2u8 {
            assert!(p.try_push_bytes(&[i; 8]).unwrap());
        }
        for _ in 0..2 {
            assert!(c.try_pop(&mut out).unwrap());
        }
        // Producer 2, consumer 2, the producer's copy 0.
        c.consumer_index().store(100, Ordering::Release);
        assert_eq!(p.fewer_than(4), Ok(true), "counted against the copy: 2 of 4");
        assert!(p.try_push_bytes(&[2; 8]).unwrap(), "the shared index was not read");
        c.consumer_index().store(2, Ordering::Release);
        assert!(p.try_push_bytes(&[3; 8]).unwrap());
        // Producer 4: the copy (0) says full, the shared index (2) not.
        assert_eq!(p.fewer_than(3), Ok(true), "re-read: 2 unread");
        assert!(p.try_push_bytes(&[4; 8]).unwrap());
        assert!(p.try_push_bytes(&[5; 8]).unwrap());
        assert_eq!(p.try_push_bytes(&[6; 8]), Ok(false), "4 unread: full");
        assert_eq!(p.fewer_than(4), Ok(false));
        for i in 2..6u8 {
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, [i; 8]);
        }
        assert!(p.try_push_bytes(&[6; 8]).unwrap(), "room once popped");
    }

    #[test]
    fn discard_all_resets() {
        let (p, c) = pair(8, 8);
        for _ in 0..5 {
            assert!(p.try_push(|_| {}).unwrap());
        }
        assert_eq!(c.discard_all(), Ok(5));
        assert_eq!(c.len(), Ok(0));
        assert_eq!(p.free_slots(), Ok(8));
    }

    /// A reset's discard racing a second consumer's claim (a direct-path
    /// requester's compare-and-swap on the receive queue being reset),
    /// interleaved deterministically: the claim lands between the
    /// discard's read of the indices and its move of the consumer index.
    /// The discard drops, and counts, only what the claim did not take:
    /// each entry is taken by one of the two and counted by that one
    /// (with a plain store the discard counted the claimed entry too).
    #[test]
    fn a_discard_racing_a_claim_counts_only_what_it_dropped() {
        let seg = Arc::new(Segment::create("vrdma-ring", 4096 + ring_bytes(8, 8)).unwrap());
        let view = || {
            let m = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
            RingView::in_segment(m, 4096, 8, 8).unwrap()
        };
        let (p, engine, requester) = (view(), view(), view());
        for i in 0..3u64 {
            assert!(p.try_push_bytes(&i.to_le_bytes()).unwrap());
        }
        let mut claimed = Vec::new();
        let mut races = 0;
        let dropped = engine
            .discard_all_between(|| {
                if races == 0 {
                    let mut out = [0u8; 8];
                    assert_eq!(requester.try_claim(&mut out, |_| true), Ok(Claim::Taken));
                    claimed.push(u64::from_le_bytes(out));
                }
                races += 1;
            })
            .unwrap();
        assert_eq!(claimed, vec![0], "the claim took the oldest entry");
        assert_eq!(races, 2, "the discard read the indices again after losing them");
        assert_eq!(dropped, 2, "the discard counts only the entries it dropped");
        assert_eq!(engine.consumed(), 3);
        assert_eq!(engine.len(), Ok(0));
        // And a claim after the discard finds nothing.
        assert_eq!(requester.try_claim(&mut [0u8; 8], |_| true), Ok(Claim::Empty));
    }

    /// `try_claim_noting` tells each attempt's index before it re-reads
    /// the index and claims: an attempt whose index another consumer took
    /// in between is noted, then dropped, and the next index noted.
    #[test]
    fn a_noting_claim_notes_every_index_it_tries() {
        let seg = Arc::new(Segment::create("vrdma-ring", 4096 + ring_bytes(8, 8)).unwrap());
        let view = || {
            let m = Arc::new(Segment::map_trusted(seg.try_clone_fd().unwrap(), seg.len()).unwrap());
            RingView::in_segment(m, 4096, 8, 8).unwrap()
        };
        let (p, c, other) = (view(), view(), view());
        for i in 0..3u64 {
            assert!(p.try_push_bytes(&i.to_le_bytes()).unwrap());
        }
        let mut noted = Vec::new();
        let mut out = [0u8; 8];
        let got = c.try_claim_noting(
            &mut out,
            |at| {
                if noted.is_empty() {
                    assert_eq!(other.try_claim(&mut [0u8; 8], |_| true), Ok(Claim::Taken));
                }
                noted.push(at);
            },
            |_| true,
        );
        assert_eq!(got, Ok(Claim::Taken));
        assert_eq!(u64::from_le_bytes(out), 1);
        assert_eq!(noted, vec![0, 1]);
    }

    #[test]
    fn aux_words_shared() {
        let (p, c) = pair(4, 8);
        p.aux(0).store(1, Ordering::Release);
        p.aux(31).store(7, Ordering::Release);
        assert_eq!(c.aux(0).load(Ordering::Acquire), 1);
        assert_eq!(c.aux(31).load(Ordering::Acquire), 7);
        // Aux words do not overlap the indices.
        assert_eq!(c.len(), Ok(0));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            c.aux(32);
        }));
        assert!(r.is_err());
    }

    #[test]
    fn shape_checks() {
        let seg = Arc::new(Segment::create("vrdma-ring", 4096).unwrap());
        let ok = |o, cap, s| RingView::in_segment(seg.clone(), o, cap, s);
        assert!(matches!(ok(0, 3, 8), Err(RingError::BadCapacity(3))));
        assert!(matches!(ok(0, 0, 8), Err(RingError::BadCapacity(0))));
        assert!(matches!(ok(0, 4, 0), Err(RingError::BadStride)));
        assert!(matches!(ok(8, 4, 8), Err(RingError::Misaligned)));
        assert!(matches!(ok(0, 64, 64), Err(RingError::OutOfBounds { .. })));
        assert!(matches!(ok(usize::MAX - 63, 4, 8), Err(RingError::OutOfBounds { .. })));
        assert!(matches!(ok(0, 1 << 31, usize::MAX), Err(RingError::OutOfBounds { .. })));
        let exact = 4096 - ring_bytes(4, 64);
        assert!(ok(exact, 4, 64).is_ok());
        let r = ok(0, 4, 8).unwrap();
        let mut small = [0u8; 7];
        assert!(matches!(r.try_pop(&mut small), Err(RingError::BadBuffer { got: 7, stride: 8 })));
        assert!(matches!(r.try_push_bytes(&[0; 9]), Err(RingError::BadBuffer { got: 9, stride: 8 })));
    }

    #[test]
    fn raw_view() {
        let seg = Segment::create("vrdma-ring", 4096).unwrap();
        // SAFETY: the segment is page-aligned, larger than the ring, and
        // outlives both views (dropped at the end of the test).
        let (p, c) = unsafe {
            (RingView::new(seg.as_ptr(), 2, 4).unwrap(), RingView::new(seg.as_ptr(), 2, 4).unwrap())
        };
        assert!(p.try_push_bytes(&[1, 2, 3, 4]).unwrap());
        let mut out = [0u8; 4];
        assert!(c.try_pop(&mut out).unwrap());
        assert_eq!(out, [1, 2, 3, 4]);
        // SAFETY: as above; the call fails on alignment before any use.
        let e = unsafe { RingView::new(seg.as_ptr().add(4), 2, 4) }.unwrap_err();
        assert_eq!(e, RingError::Misaligned);
    }
}
