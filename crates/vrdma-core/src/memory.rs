//! The bytes the device moves: regions of tenant memory mapped into the
//! daemon, and the one copy between them.
//!
//! This is the only place in the core that touches raw memory. A region is
//! shared with a tenant process that may write it at any moment, so the
//! core never forms a Rust reference into it: bytes move with raw copies
//! and 8-byte atomics, which is what a DMA engine does to host memory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Memory the device can reach: a mapping that stays valid while this
/// value lives.
///
/// # Safety
/// `as_ptr()..as_ptr()+len()` must be a live, readable and writable mapping
/// for as long as the implementor is alive, and must not move.
pub unsafe trait Backing: Send + Sync {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Heap memory standing in for a mapping, for tests and embedded use.
pub struct HeapBacking {
    words: Box<[AtomicU64]>,
    len: usize,
}

impl HeapBacking {
    pub fn new(len: usize) -> Self {
        let words = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        HeapBacking { words, len }
    }
}

// SAFETY: the boxed slice is owned, never reallocated, and lives as long as
// `self`; `AtomicU64` permits shared mutation through a shared reference.
unsafe impl Backing for HeapBacking {
    fn as_ptr(&self) -> *mut u8 {
        self.words.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A window `[offset, offset+len)` of a backing: the bytes of one memory
/// region as the device sees them.
///
/// Clones share one revocation flag: deregistering a memory region
/// revokes every clone in flight (a payload half placed, frames queued for
/// a socket), so that a driver can stop touching memory the tenant may
/// already have reused.
#[derive(Clone)]
pub struct Region {
    backing: Arc<dyn Backing>,
    offset: usize,
    len: usize,
    revoked: Arc<AtomicBool>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("offset", &self.offset).field("len", &self.len).finish()
    }
}

/// An access outside a region, which callers have already ruled out; kept
/// as an error so that a bug can never become an out-of-bounds copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("access [{offset}, +{len}) outside a region of {region_len} bytes")]
pub struct OutOfBounds {
    pub offset: usize,
    pub len: usize,
    pub region_len: usize,
}

impl Region {
    /// The window `[offset, offset+len)` of `backing`, if it fits.
    pub fn new(backing: Arc<dyn Backing>, offset: usize, len: usize) -> Result<Self, OutOfBounds> {
        match offset.checked_add(len) {
            Some(end) if end <= backing.len() => {
                Ok(Region { backing, offset, len, revoked: Arc::new(AtomicBool::new(false)) })
            }
            _ => Err(OutOfBounds { offset, len, region_len: backing.len() }),
        }
    }

    /// A whole heap-backed region (tests, examples).
    pub fn heap(len: usize) -> Self {
        let b: Arc<dyn Backing> = Arc::new(HeapBacking::new(len));
        Region::new(b, 0, len).expect("whole backing")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The memory region is gone (deregistered): no device access may
    /// touch these bytes any more. Seen by every clone.
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
    }

    pub fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<*mut u8, OutOfBounds> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                // SAFETY: offset+len <= self.len and the window lies inside
                // the backing (checked in `new`), so the pointer stays in the
                // mapping.
                Ok(unsafe { self.backing.as_ptr().add(self.offset + offset) })
            }
            _ => Err(OutOfBounds { offset, len, region_len: self.len }),
        }
    }

    /// The address of `[offset, offset+len)`, for a driver that moves bytes
    /// between a socket and the region with `readv`/`writev`. The pointer
    /// is valid for `len` bytes while `self` (or a clone) lives; the memory
    /// is shared with the tenant, so it must only be handed to the kernel
    /// or copied with raw copies, never turned into a Rust reference.
    pub fn io_ptr(&self, offset: usize, len: usize) -> Result<*mut u8, OutOfBounds> {
        self.check(offset, len)
    }

    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        let src = self.check(offset, dst.len())?;
        // SAFETY: `src` is valid for dst.len() bytes (checked); `dst` is a
        // distinct local buffer, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        let dst = self.check(offset, src.len())?;
        // SAFETY: `dst` is valid for src.len() bytes (checked); `src` is a
        // Rust slice that cannot alias the shared mapping mutably.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_off` to `self` at `dst_off`: the
    /// device's single copy between two regions, with no staging buffer.
    pub fn copy_from(
        &self,
        dst_off: usize,
        src: &Region,
        src_off: usize,
        len: usize,
    ) -> Result<(), OutOfBounds> {
        let d = self.check(dst_off, len)?;
        let s = src.check(src_off, len)?;
        // SAFETY: both ranges are valid for `len` bytes (checked). They may
        // overlap (a loopback QP writing into its own region), so use the
        // overlapping copy.
        unsafe { std::ptr::copy(s, d, len) };
        Ok(())
    }

    fn atomic(&self, offset: usize) -> Result<&AtomicU64, OutOfBounds> {
        let p = self.check(offset, 8)?;
        if !(p as usize).is_multiple_of(8) {
            return Err(OutOfBounds { offset, len: 8, region_len: self.len });
        }
        // SAFETY: `p` is 8-aligned and valid for 8 bytes for as long as
        // `self` (and so the backing) lives; AtomicU64 has the layout of u64,
        // and every access the device makes to these bytes is atomic.
        Ok(unsafe { &*(p as *const AtomicU64) })
    }

    /// Compare-and-swap on the 8 bytes at `offset`; returns the old value.
    /// Values are in host order, as verbs atomics are on little-endian hosts.
    pub fn compare_swap(&self, offset: usize, compare: u64, swap: u64) -> Result<u64, OutOfBounds> {
        let a = self.atomic(offset)?;
        Ok(match a.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(v) | Err(v) => v,
        })
    }

    /// Fetch-and-add on the 8 bytes at `offset`; returns the old value.
    pub fn fetch_add(&self, offset: usize, add: u64) -> Result<u64, OutOfBounds> {
        Ok(self.atomic(offset)?.fetch_add(add, Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_bounds() {
        let a = Region::heap(64);
        let b = Region::heap(64);
        a.write(3, b"hello").unwrap();
        b.copy_from(10, &a, 3, 5).unwrap();
        let mut out = [0u8; 5];
        b.read(10, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(b.copy_from(60, &a, 0, 5).is_err());
        assert!(a.read(usize::MAX, &mut out).is_err());
    }

    #[test]
    fn revoking_a_region_revokes_its_clones_and_no_other_region() {
        let backing: Arc<dyn Backing> = Arc::new(HeapBacking::new(64));
        let a = Region::new(backing.clone(), 0, 64).unwrap();
        let in_flight = a.clone();
        let other = Region::new(backing, 0, 64).unwrap();
        assert!(!in_flight.is_revoked());
        a.revoke();
        assert!(in_flight.is_revoked(), "a clone in flight must see the revocation");
        assert!(!other.is_revoked(), "another registration of the same memory stays");
    }

    #[test]
    fn atomics_need_alignment() {
        let a = Region::heap(64);
        assert_eq!(a.fetch_add(8, 5).unwrap(), 0);
        assert_eq!(a.compare_swap(8, 5, 9).unwrap(), 5);
        assert_eq!(a.compare_swap(8, 5, 1).unwrap(), 9);
        assert!(a.fetch_add(4, 1).is_err());
    }
}
