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
//! a header on such a page for long. So the prepare handler, with the
//! registry's lock, moves every mapping of our memfd that no live span
//! covers back to private memory, by the same exact move as a guest's
//! pages ([`super::move_back`]), while other threads go on using them.
//! Pages a live region lies on stay shared: the device may write them
//! (rdma-core's fork rules leave that case to the program too).
//!
//! Only a fork after some span went pays for the sweep (a read of
//! `/proc/self/maps`): [`Span`]'s drop notes that there may be idle
//! pages.

use std::sync::atomic::{AtomicBool, Ordering};

use super::move_back::move_shared_back_to_private;
use super::{largest, read_maps, Span, Spans};

/// Whether a host span went since the last sweep: idle pages may exist.
static MAYBE_IDLE: AtomicBool = AtomicBool::new(false);

impl Drop for Span {
    fn drop(&mut self) {
        if self.guest.is_none() {
            MAYBE_IDLE.store(true, Ordering::SeqCst);
        }
    }
}

/// Called by the forking thread before `fork`, with the registry `reg`
/// held: the pages of this library's memfds that no live host span
/// covers move back to private memory (see the module's doc).
pub(super) fn fork_preparing(reg: &Spans) {
    if !MAYBE_IDLE.swap(false, Ordering::SeqCst) {
        return;
    }
    let Ok(maps) = read_maps() else {
        MAYBE_IDLE.store(true, Ordering::SeqCst);
        return;
    };
    let live: Vec<(usize, usize)> = reg
        .values()
        .filter_map(|gens| largest(gens))
        .filter(|s| s.guest.is_none())
        .map(|s| (s.start, s.end()))
        .collect();
    // Mappings the program made other than read-write keep their pages:
    // a move would change their protection.
    for e in maps.iter().filter(|e| e.is_our_memfd() && e.readable_writable()) {
        for (start, end) in uncovered((e.start, e.end), &live) {
            if !move_shared_back_to_private(start, end - start) {
                MAYBE_IDLE.store(true, Ordering::SeqCst);
            }
        }
    }
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
