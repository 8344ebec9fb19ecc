//! A page-granular allocator of extents in one region, without I/O.
//!
//! A VM's shared region (its ivshmem BAR) holds everything its guest
//! shares with the daemon: the rings the daemon would otherwise create as
//! memfds and the guest's registered memory. The daemon hands out pieces
//! of it with this allocator, first fit over a free list, and takes them
//! back when their object or session ends. It only does arithmetic: who
//! owns which extent is the caller's business.

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
        Extents { page, len, free, used: BTreeMap::new() }
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
    /// length, or `None` if no free range is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<(u64, u64)> {
        if len == 0 {
            return None;
        }
        let want = len.checked_next_multiple_of(self.page)?;
        let (&start, &have) = self.free.iter().find(|(_, &l)| l >= want)?;
        self.free.remove(&start);
        if have > want {
            self.free.insert(start + want, have - want);
        }
        self.used.insert(start, want);
        Some((start, want))
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
