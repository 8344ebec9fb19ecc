//! A host's re-backed pages that no region uses any more, moved back to
//! private memory before a `fork`.
//!
//! When the last region over a span goes, its memfd is closed but the
//! application's pages stay mapped from it (moving them back on every
//! deregistration would cost a copy each time, and a later registration
//! of the same buffer reuses nothing anyway). Across a `fork` such pages
//! are a hazard: glibc resets each malloc arena's lock and thread count
//! in the child (`__malloc_fork_unlock_child`, in the arena's header at
//! the start of its first heap) before any `pthread_atfork` child handler
//! runs, so a header on a page still shared with the parent takes those
//! writes for the parent, whose thread of that arena then aborts at its
//! exit ("malloc assertion failure in `__malloc_arena_thread_freeres`:
//! `a->attached_threads > 0`"). A deregistered heap buffer is what keeps
//! a header on such a page for long.
//!
//! So the prepare handler, with the registry's lock, moves the pages
//! of the host spans that went since the last fork back to private
//! memory, where no live span covers them, by the same exact move as a
//! guest's pages ([`super::move_back`]), while other threads go on using
//! them. Only the application's own mapping of each such span is moved
//! (the span's file at the span's addresses, as [`Span`]'s drop noted
//! them): other mappings of the same memfds, such as a daemon's running
//! in this process, are not the application's pages. Pages a live region
//! lies on stay shared: the device may write them (rdma-core's fork
//! rules leave that case to the program too).
//!
//! Only a fork after some span went pays for the sweep (a read of
//! `/proc/self/maps`). The forking thread holds the list's lock across
//! the `fork`, so that a child never inherits it locked.

use std::cell::RefCell;
use std::sync::{Mutex, MutexGuard};

use super::move_back::move_shared_back_to_private;
use super::{largest, read_maps, Span, Spans};

/// A host span that went: `[start, end)` of the application's addresses,
/// mapped from the memfd with inode `ino` at offset `addr - start`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Gone {
    start: usize,
    end: usize,
    ino: u64,
}

/// The host spans that went since the last sweep.
static GONE: Mutex<Vec<Gone>> = Mutex::new(Vec::new());

/// Spans noted at most before the list is pruned (of spans whose pages
/// no longer map their file), then cut (the oldest's pages stay shared
/// across a fork, as before this sweep).
const GONE_MAX: usize = 4096;

thread_local! {
    /// The list's lock, held by the forking thread across `fork`.
    static HELD: RefCell<Option<MutexGuard<'static, Vec<Gone>>>> = const { RefCell::new(None) };
}

impl Drop for Span {
    fn drop(&mut self) {
        if self.guest.is_none() {
            note_gone(Gone { start: self.start, end: self.end(), ino: self.ino });
        }
    }
}

fn note_gone(g: Gone) {
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    if gone.len() >= GONE_MAX {
        if let Ok(maps) = read_maps() {
            gone.retain(|g| !pages_of(&maps, g).is_empty());
        }
        if gone.len() >= GONE_MAX {
            gone.remove(0);
        }
    }
    gone.push(g);
}

/// The application's pages of span `g` still mapped from its file.
fn pages_of(maps: &[super::MapEntry], g: &Gone) -> Vec<(usize, usize)> {
    maps.iter()
        .filter(|e| e.is_our_memfd() && e.readable_writable() && e.inode == g.ino)
        // The span's file at the span's addresses: offset `addr - start`.
        .filter(|e| e.start >= g.start && e.offset == (e.start - g.start) as u64)
        .map(|e| (e.start.max(g.start), e.end.min(g.end)))
        .filter(|(s, e)| s < e)
        .collect()
}

/// Called by the forking thread before `fork`, with the registry `reg`
/// held: the pages of the host spans that went, where no live span
/// covers them, move back to private memory (see the module's doc). The
/// list's lock stays held until [`forked`].
pub(super) fn fork_preparing(reg: &Spans) {
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    if !gone.is_empty() {
        sweep(reg, &mut gone);
    }
    HELD.with(|h| *h.borrow_mut() = Some(gone));
}

/// Releases the list's lock, in the parent and in the child (where the
/// lock is this thread's copy: releasing it is a store, no heap).
pub(super) fn forked() {
    HELD.with(|h| h.borrow_mut().take());
}

fn sweep(reg: &Spans, gone: &mut Vec<Gone>) {
    let Ok(maps) = read_maps() else { return };
    let live: Vec<(usize, usize)> = reg
        .values()
        .filter_map(|gens| largest(gens))
        .filter(|s| s.guest.is_none())
        .map(|s| (s.start, s.end()))
        .collect();
    // A span whose pages could not all move stays listed for the next fork.
    gone.retain(|g| {
        let mut all = true;
        for range in pages_of(&maps, g) {
            for (start, end) in uncovered(range, &live) {
                all &= move_shared_back_to_private(start, end - start);
            }
        }
        !all
    });
}

/// The parts of `range` that none of the (disjoint) ranges `live` covers.
fn uncovered(range: (usize, usize), live: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut sorted: Vec<_> = live.iter().copied().filter(|&(s, e)| s < range.1 && e > range.0).collect();
    sorted.sort_unstable();
    let mut out = Vec::new();
    let mut at = range.0;
    for (s, e) in sorted {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < range.1 {
        out.push((at, range.1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncovered_parts_of_a_mapping() {
        assert_eq!(uncovered((0, 100), &[]), vec![(0, 100)]);
        assert_eq!(uncovered((0, 100), &[(0, 100)]), vec![]);
        assert_eq!(uncovered((10, 100), &[(0, 20), (40, 50), (90, 200)]), vec![(20, 40), (50, 90)]);
        assert_eq!(uncovered((10, 20), &[(0, 5), (30, 40)]), vec![(10, 20)]);
    }
}
