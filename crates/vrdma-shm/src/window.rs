//! Words of a small shared page that two parties only touch atomically:
//! the direct path's window (`vrdma_core::proto::DIRECT_WINDOW_*`), which
//! the daemon creates and revokes and a tenant's library reads around
//! every copy it makes into a peer's region.
//!
//! Kept apart from [`crate::ring`] because its protocol is different: no
//! indices to distrust, just flags and a count, each of which either side
//! may find at any value. A reader treats every value as a hint to check
//! (the daemon bounds its wait on the count; the library writes only
//! while the words say so).

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use crate::segment::{Mapping, Segment};

/// A page of 4-byte words in shared memory.
#[derive(Clone)]
pub struct WordPage {
    base: *mut u8,
    words: usize,
    _keep: Arc<dyn Send + Sync>,
}

impl std::fmt::Debug for WordPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WordPage").field("words", &self.words).finish()
    }
}

// SAFETY: the page is only accessed through `&AtomicU32`s, which are Sync;
// the mapping it points into lives as long as `_keep`.
unsafe impl Send for WordPage {}
// SAFETY: see `Send`.
unsafe impl Sync for WordPage {}

impl WordPage {
    /// The words of a segment this process created (the daemon's side).
    pub fn of_segment(seg: Arc<Segment>) -> WordPage {
        WordPage { base: seg.as_ptr(), words: seg.len() / 4, _keep: seg }
    }

    /// The words of a mapping received from the daemon (the library's side).
    pub fn of_mapping(map: Mapping) -> WordPage {
        let (base, words) = (map.as_ptr(), map.len() / 4);
        WordPage { base, words, _keep: Arc::new(map) }
    }

    /// Words in the page.
    pub fn len(&self) -> usize {
        self.words
    }

    /// Whether the page has no word.
    pub fn is_empty(&self) -> bool {
        self.words == 0
    }

    /// Word `i`, or `None` past the page.
    #[inline]
    pub fn word(&self, i: usize) -> Option<&AtomicU32> {
        if i >= self.words {
            return None;
        }
        // SAFETY: `base` is page-aligned and the mapping holds `words`
        // 4-byte words for as long as `_keep` lives (as long as `self`);
        // `i < words`. Both sides access these words only atomically, so
        // `&AtomicU32` is the right view of one.
        Some(unsafe { &*(self.base.add(4 * i) as *const AtomicU32) })
    }
}
