//! A page-granular allocator of extents in one region, without I/O.
//!
//! A VM's shared region (its ivshmem BAR) holds everything its guest
//! shares with the daemon: the rings the daemon would otherwise create as
//! memfds and the guest's registered memory. The daemon hands out pieces
//! of it with this allocator, first fit over a free list, and takes them
//! back when their object or session ends. It only does arithmetic: who
//! owns which extent is the caller's business.
//!
//! An extent may *grow* in place ([`Extents::grow`]) into the free bytes
//! right after it: a guest's registration that starts inside a re-backed
//! span and ends past it extends the span's extent (`docs/vms.md`). To
//! make that likely an extent may be given *headroom* when allocated
//! ([`Extents::alloc_with_headroom`]): bytes after it that later
//! allocations leave free while any other free range fits them. Headroom
//! is soft: an allocation that fits nowhere else takes it (plain first
//! fit), so it never makes an allocation fail.

use std::collections::BTreeMap;

/// Extents of `[0, len)` in multiples of `page` bytes.
#[derive(Debug, Clone)]
pub struct Extents {
    page: u64,
    len: u64,
    /// Free ranges: start -> length, never adjacent (merged on free).
    free: BTreeMap<u64, u64>,
    /// Allocated ranges: start -> length.
    used: BTreeMap<u64, u64>,
    /// Headroom wished for after an allocated extent: start -> bytes.
    headroom: BTreeMap<u64, u64>,
}

/// Why [`Extents::grow`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GrowError {
    /// No allocated extent starts at the offset.
    #[error("no extent starts there")]
    NotAnExtent,
    /// The new length overflows.
    #[error("the length overflows")]
    Overflow,
    /// The grown extent would end past the region's end.
    #[error("it would end past the region's end ({len} bytes)")]
    PastEnd {
        /// The region's length.
        len: u64,
    },
    /// The bytes right after the extent are not all free.
    #[error("only {free} bytes after it are free, {need} needed")]
    Taken {
        /// Free bytes right after the extent.
        free: u64,
        /// Bytes the growth needs.
        need: u64,
    },
}

impl Extents {
    /// An allocator over `len` bytes (rounded down to pages); `page` must
    /// be a power of two.
    pub fn new(len: u64, page: u64) -> Extents {
        assert!(page.is_power_of_two(), "page size {page} is not a power of two");
        let len = len - len % page;
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Extents { page, len, free, used: BTreeMap::new(), headroom: BTreeMap::new() }
    }

    /// Bytes the allocator covers.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes free now.
    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// An extent of at least `len` bytes (whole pages): its offset and
    /// length, or `None` if no free range is large enough. It leaves the
    /// headroom of other extents free where it can
    /// ([`alloc_with_headroom`](Self::alloc_with_headroom) with none).
    pub fn alloc(&mut self, len: u64) -> Option<(u64, u64)> {
        self.alloc_with_headroom(len, 0)
    }

    /// As [`alloc`](Self::alloc), wishing for `headroom` free bytes (whole
    /// pages) after the extent, to grow into. First fit among the places
    /// that keep clear of every extent's headroom (this one's included);
    /// where none does, plain first fit.
    pub fn alloc_with_headroom(&mut self, len: u64, headroom: u64) -> Option<(u64, u64)> {
        if len == 0 {
            return None;
        }
        let want = len.checked_next_multiple_of(self.page)?;
        let room = headroom.checked_next_multiple_of(self.page).unwrap_or(u64::MAX - self.page + 1);
        let spaced = self.free.iter().find_map(|(&start, &have)| {
            // The headroom of the extent just before this free range.
            let skip = self
                .used
                .range(..start)
                .next_back()
                .filter(|(&s, &l)| s + l == start)
                .and_then(|(s, _)| self.headroom.get(s))
                .copied()
                .unwrap_or(0);
            let at = start.checked_add(skip)?;
            let need = want.checked_add(room)?;
            (at.checked_add(need)? <= start + have).then_some(at)
        });
        let at = match spaced {
            Some(at) => at,
            None => *self.free.iter().find(|(_, &l)| l >= want)?.0,
        };
        let taken = self.reserve(at, want);
        debug_assert_eq!(taken, Some(want));
        taken?;
        if room > 0 {
            self.headroom.insert(at, room);
        }
        Some((at, want))
    }

    /// Extends the extent that starts at `offset` to at least `len` bytes
    /// (whole pages) in place, into the free bytes right after it: its new
    /// length (its length as it was if that is `len` already).
    pub fn grow(&mut self, offset: u64, len: u64) -> Result<u64, GrowError> {
        let &have = self.used.get(&offset).ok_or(GrowError::NotAnExtent)?;
        let want = len.checked_next_multiple_of(self.page).ok_or(GrowError::Overflow)?;
        if want <= have {
            return Ok(have);
        }
        let end = offset + have;
        let new_end = offset.checked_add(want).ok_or(GrowError::Overflow)?;
        if new_end > self.len {
            return Err(GrowError::PastEnd { len: self.len });
        }
        let free = self.free.get(&end).copied().unwrap_or(0);
        if end + free < new_end {
            return Err(GrowError::Taken { free, need: new_end - end });
        }
        self.free.remove(&end);
        if end + free > new_end {
            self.free.insert(new_end, end + free - new_end);
        }
        self.used.insert(offset, want);
        Ok(want)
    }

    /// The extents allocated, by offset: (offset, length).
    pub fn used(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.used.iter().map(|(&a, &l)| (a, l))
    }

    /// Takes the extent `[at, at + len)` (whole pages, `at` a page's
    /// start), which must be free: for an allocator that resumes where
    /// another left off (a VM that moved). Its length, or `None`.
    pub fn reserve(&mut self, at: u64, len: u64) -> Option<u64> {
        if len == 0 || !at.is_multiple_of(self.page) {
            return None;
        }
        let want = len.checked_next_multiple_of(self.page)?;
        let end = at.checked_add(want)?;
        let (&start, &have) = self.free.range(..=at).next_back()?;
        if end > start + have {
            return None;
        }
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if start + have > end {
            self.free.insert(end, start + have - end);
        }
        self.used.insert(at, want);
        Some(want)
    }

    /// Gives back the extent that starts at `offset`; its length, or
    /// `None` if no extent starts there.
    pub fn free(&mut self, offset: u64) -> Option<u64> {
        let len = self.used.remove(&offset)?;
        self.headroom.remove(&offset);
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            if s + l == start {
                self.free.remove(&s);
                start = s;
            }
        }
        if let Some(l) = self.free.remove(&end) {
            end += l;
        }
        self.free.insert(start, end - start);
        Some(len)
    }

    /// The allocated extent that holds all of `[offset, offset + len)`,
    /// as (start, length); `None` if the range is empty, overflows, or is
    /// not inside one allocated extent.
    pub fn containing(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let end = offset.checked_add(len)?;
        if len == 0 {
            return None;
        }
        let (&s, &l) = self.used.range(..=offset).next_back()?;
        (end <= s + l).then_some((s, l))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_in_place_into_free_bytes_only() {
        let p = 4096;
        let mut e = Extents::new(10 * p, p);
        let (a, _) = e.alloc(p).unwrap();
        let (b, _) = e.alloc(2 * p).unwrap();
        assert_eq!((a, b), (0, p));
        assert_eq!(e.grow(a, 2 * p), Err(GrowError::Taken { free: 0, need: p }), "b follows a");
        assert_eq!(e.grow(b, 3 * p + 1), Ok(4 * p), "whole pages");
        assert_eq!(e.grow(b, p), Ok(4 * p), "already that long");
        assert_eq!(e.grow(p + 1, 5 * p), Err(GrowError::NotAnExtent));
        assert_eq!(e.grow(7 * p, p), Err(GrowError::NotAnExtent), "free space");
        assert_eq!(e.grow(b, 10 * p), Err(GrowError::PastEnd { len: 10 * p }));
        assert_eq!(e.grow(b, u64::MAX), Err(GrowError::Overflow));
        assert_eq!(e.grow(b, u64::MAX - p), Err(GrowError::Overflow), "its end wraps");
        assert_eq!(e.grow(b, u64::MAX - 2 * p), Err(GrowError::PastEnd { len: 10 * p }));
        let (c, _) = e.alloc(p).unwrap();
        assert_eq!(c, 5 * p);
        assert_eq!(e.grow(b, 5 * p), Err(GrowError::Taken { free: 0, need: p }));
        // The grown extent is one: found whole, freed whole.
        assert_eq!(e.containing(b + 3 * p, 100), Some((b, 4 * p)));
        assert_eq!(e.used().collect::<Vec<_>>(), vec![(0, p), (p, 4 * p), (5 * p, p)]);
        assert_eq!(e.free(b), Some(4 * p));
        assert_eq!(e.free(a), Some(p));
        assert_eq!(e.free(c), Some(p));
        assert_eq!(e.free_bytes(), e.len());
    }

    #[test]
    fn headroom_is_left_free_while_anything_else_fits() {
        let p = 4096;
        let mut e = Extents::new(16 * p, p);
        let (a, _) = e.alloc_with_headroom(p, 4 * p).unwrap();
        // The next extents keep clear of a's headroom...
        let (r, _) = e.alloc(2 * p).unwrap();
        assert_eq!((a, r), (0, 5 * p));
        let (m, _) = e.alloc_with_headroom(p, 4 * p).unwrap();
        assert_eq!(m, 7 * p);
        // ... so a grows into it.
        assert_eq!(e.grow(a, 3 * p), Ok(3 * p));
        // Once nothing else fits, an allocation takes headroom.
        let (x, _) = e.alloc(5 * p).unwrap();
        assert_eq!(x, 8 * p, "m's headroom, not past the end");
        let (y, _) = e.alloc(2 * p).unwrap();
        assert_eq!(y, 13 * p, "x has no headroom");
        let (z, _) = e.alloc(2 * p).unwrap();
        assert_eq!(z, 3 * p, "what is left of a's headroom");
        assert_eq!(e.alloc(2 * p), None);
        for at in [a, r, m, x, y, z] {
            assert!(e.free(at).is_some());
        }
        assert_eq!(e.free_bytes(), e.len());
        assert_eq!(e.alloc_with_headroom(16 * p, u64::MAX), Some((0, 16 * p)), "headroom never fails one");
    }

    #[test]
    fn reserves_a_free_extent_where_asked_and_nothing_else() {
        let mut e = Extents::new(10 * 4096, 4096);
        assert_eq!(e.reserve(2 * 4096, 4097), Some(8192));
        assert_eq!(e.reserve(3 * 4096, 4096), None, "taken");
        assert_eq!(e.reserve(4096, 8192), None, "overlaps what is taken");
        assert_eq!(e.reserve(100, 4096), None, "not a page's start");
        assert_eq!(e.reserve(9 * 4096, 8192), None, "past the end");
        assert_eq!(e.reserve(u64::MAX - 4095, 8192), None, "wraps");
        assert_eq!(e.reserve(0, 0), None);
        assert_eq!(e.reserve(9 * 4096, 4096), Some(4096));
        // The holes around are allocated as usual, and all merges back.
        assert_eq!(e.alloc(8192), Some((0, 8192)));
        assert_eq!(e.alloc(4096), Some((4 * 4096, 4096)));
        assert_eq!(e.containing(2 * 4096 + 10, 100), Some((2 * 4096, 8192)));
        for at in [0, 2 * 4096, 4 * 4096, 9 * 4096] {
            assert!(e.free(at).is_some());
        }
        assert_eq!(e.free_bytes(), e.len());
        assert_eq!(e.alloc(10 * 4096), Some((0, 10 * 4096)));
    }

    #[test]
    fn allocates_pages_first_fit_and_merges_on_free() {
        let mut e = Extents::new(10 * 4096 + 100, 4096);
        assert_eq!(e.len(), 10 * 4096);
        assert_eq!(e.alloc(1), Some((0, 4096)));
        assert_eq!(e.alloc(4097), Some((4096, 8192)));
        assert_eq!(e.alloc(4096), Some((3 * 4096, 4096)));
        assert_eq!(e.alloc(0), None);
        assert_eq!(e.alloc(u64::MAX), None);
        assert_eq!(e.free(4096), Some(8192));
        assert_eq!(e.free(4096), None, "freed twice");
        assert_eq!(e.free(5), None, "not an extent's start");
        // The hole is reused first.
        assert_eq!(e.alloc(4096), Some((4096, 4096)));
        assert_eq!(e.free(0), Some(4096));
        assert_eq!(e.free(4096), Some(4096));
        assert_eq!(e.free(3 * 4096), Some(4096));
        // All merged back into one range.
        assert_eq!(e.free_bytes(), e.len());
        assert_eq!(e.alloc(10 * 4096), Some((0, 10 * 4096)));
        assert_eq!(e.alloc(1), None, "full");
    }

    #[test]
    fn containing_needs_the_whole_range_inside_one_extent() {
        let mut e = Extents::new(8 * 4096, 4096);
        let (a, _) = e.alloc(8192).unwrap();
        let (b, _) = e.alloc(4096).unwrap();
        assert_eq!(e.containing(a + 10, 100), Some((a, 8192)));
        assert_eq!(e.containing(a, 8192), Some((a, 8192)));
        assert_eq!(e.containing(a + 1, 8192), None, "runs into the next extent");
        assert_eq!(e.containing(b + 4000, 200), None, "runs past the extent");
        assert_eq!(e.containing(5 * 4096, 1), None, "free space");
        assert_eq!(e.containing(a, 0), None);
        assert_eq!(e.containing(u64::MAX, 2), None);
        assert_eq!(e.containing(100 * 4096, 1), None, "outside the region");
    }
}
