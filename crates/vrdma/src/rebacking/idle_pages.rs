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
//! memory, where no live span covers them, by the exact move a guest's
//! pages take ([`super::move_back`]: other threads touching them wait in
//! the kernel for the one copy), while other threads go on using them.
//! Only the application's own mapping of each such span is moved (the
//! span's file at the span's addresses, as [`Span`]'s drop noted them):
//! other mappings of the same memfds, such as a daemon's running in this
//! process, are not the application's pages. Pages a live region lies on
//! stay shared: the device may write them (docs/vms.md, "fork in a
//! guest", says what that leaves open).
//!
//! The move is made only where it is exact: with a userfaultfd that
//! holds the kernel's own accesses too (root, or
//! `vm.unprivileged_userfaultfd = 1`). A user-mode-only one would fail
//! another thread's system call on those pages (`EFAULT`) meanwhile, and
//! the copy without one can leave a lock word another thread changed at
//! that moment wrong; there the pages stay shared across the fork, as
//! before this sweep, and a warning says so once.
//!
//! Only a fork after some span went pays for the sweep (a read of
//! `/proc/self/maps`). The forking thread holds the list's lock across
//! the `fork`, so that a child never inherits it locked; the live spans
//! it looks at are collected before it takes the lock and released after
//! (a span whose last reference the forking thread dropped under the
//! lock would note itself: a lock taken twice).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::move_back::{exact_move_available, move_shared_back_to_private};
use super::{largest, read_maps, Span, Spans};

/// The host spans that went since the last sweep, by their memfd's
/// inode: `[start, end)` of the application's addresses, mapped from that
/// file at offset `addr - start` (a grown span's generations share the
/// file and the start: the largest end is kept).
type Gone = BTreeMap<u64, (usize, usize)>;

static GONE: Mutex<Gone> = Mutex::new(BTreeMap::new());

/// Spans noted at most; past it the list keeps those whose pages still
/// map their file, and then at most half of it (the newest files: the
/// pages of the others stay shared across a fork, as before this sweep).
const GONE_MAX: usize = 4096;

/// What the forking thread holds across `fork`: the list's lock, and the
/// live spans it swept around (released after the lock).
type Held = (Option<MutexGuard<'static, Gone>>, Vec<Arc<Span>>);

thread_local! {
    static HELD: RefCell<Held> = const { RefCell::new((None, Vec::new())) };
}

impl Drop for Span {
    fn drop(&mut self) {
        if self.guest.is_none() {
            note_gone(self.ino, self.start, self.end());
        }
    }
}

fn note_gone(ino: u64, start: usize, end: usize) {
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    let e = gone.entry(ino).or_insert((start, end));
    e.1 = e.1.max(end);
    if gone.len() > GONE_MAX {
        if let Ok(maps) = read_maps() {
            gone.retain(|&ino, &mut g| !pages_of(&maps, ino, g).is_empty());
        }
        while gone.len() > GONE_MAX / 2 {
            gone.pop_first();
        }
    }
}

/// The application's pages of a span that went (file `ino`, addresses
/// `[start, end)`) still mapped from its file, one range per maps line.
fn pages_of(maps: &[super::MapEntry], ino: u64, (start, end): (usize, usize)) -> Vec<(usize, usize)> {
    maps.iter()
        .filter(|e| e.is_our_memfd() && e.readable_writable() && e.inode == ino)
        // The span's file at the span's addresses: offset `addr - start`.
        .filter(|e| e.start >= start && e.offset == (e.start - start) as u64)
        .map(|e| (e.start, e.end.min(end)))
        .filter(|(s, e)| s < e)
        .collect()
}

/// Called by the forking thread before `fork`, with the registry `reg`
/// held: the pages of the host spans that went, where no live span
/// covers them, move back to private memory (see the module's doc). The
/// list's lock stays held until [`forked`].
pub(super) fn fork_preparing(reg: &Spans) {
    let live: Vec<Arc<Span>> =
        reg.values().filter_map(|gens| largest(gens)).filter(|s| s.guest.is_none()).collect();
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    if !gone.is_empty() {
        sweep(&live, &mut gone);
    }
    HELD.with(|h| *h.borrow_mut() = (Some(gone), live));
}

/// Releases the list's lock, then the live spans, in the parent. In the
/// child (`child`) the lock is this thread's copy, and releasing it is a
/// store; the spans are forgotten, not dropped (no heap).
pub(super) fn forked(child: bool) {
    HELD.with(|h| {
        let (guard, live) = std::mem::take(&mut *h.borrow_mut());
        drop(guard);
        match child {
            true => std::mem::forget(live),
            false => drop(live),
        }
    });
}

fn sweep(live: &[Arc<Span>], gone: &mut Gone) {
    if !exact_move_available() {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "vrdma: no userfaultfd for kernel accesses here (root, or vm.unprivileged_userfaultfd = 1): \
                 deregistered pages stay shared across fork (docs/vms.md, \"fork in a guest\")"
            )
        });
        return;
    }
    let Ok(maps) = read_maps() else { return };
    let live: Vec<(usize, usize)> = live.iter().map(|s| (s.start, s.end())).collect();
    // A span whose pages could not all move stays listed for the next fork.
    gone.retain(|&ino, &mut g| {
        if pages_of(&maps, ino, g).is_empty() {
            return false;
        }
        // Read again right before the move: other threads run on, and
        // may have unmapped those pages since.
        let Ok(now) = read_maps() else { return true };
        let mut all = true;
        for range in pages_of(&now, ino, g) {
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
    use std::sync::mpsc;
    use std::time::Duration;

    use crate::rebacking::{read_maps, reback};

    /// `n` fresh private pages of the test's own (no other test's heap).
    fn pages(n: usize) -> usize {
        // SAFETY: a fresh private mapping at an address the kernel chooses.
        unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                n * vrdma_shm::page_size(),
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .unwrap() as usize
    }

    /// Whether `[start, end)` is private anonymous memory again.
    fn private(start: usize, end: usize) -> bool {
        let maps = read_maps().unwrap();
        super::super::covering(&maps, start, end).is_ok_and(|e| e.iter().all(|e| e.is_private_anonymous()))
    }

    /// The forking thread may hold a span's last reference: it is dropped
    /// (and the span notes itself in the list) after the list's lock is
    /// released, not under it (a lock taken twice: a hang).
    #[test]
    fn a_span_the_forking_thread_holds_last_notes_itself_after_the_lock() {
        let at = pages(2);
        // SAFETY: the test's own pages.
        let r = unsafe { reback(at as *mut u8, 64) }.unwrap();
        let reg = Spans::from([(r.span.start, vec![Arc::downgrade(&r.span)])]);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            fork_preparing(&reg);
            drop(r);
            forked(false);
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(20)).expect("the fork's handlers hung on the list's lock");
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(at as *mut _, 2 * vrdma_shm::page_size()).unwrap() };
    }

    /// A span that grew (two generations over one file, one maps line
    /// once the kernel merged them), both gone: a fork moves all its
    /// pages back, not the first generation's only.
    #[test]
    fn a_grown_spans_pages_all_move_back_at_a_fork() {
        if !exact_move_available() {
            eprintln!("skipping: no kernel-mode userfaultfd here, so deregistered pages stay shared");
            return;
        }
        let p = vrdma_shm::page_size();
        let at = pages(4);
        // SAFETY: the test's own pages, registered and deregistered.
        let first = unsafe { reback((at + p - 64) as *mut u8, 64) }.unwrap();
        // SAFETY: as above: starts in the span, ends two pages past it.
        let grown = unsafe { reback((at + p - 32) as *mut u8, p + 64) }.unwrap();
        assert_eq!(grown.span.end(), at + 3 * p, "the span did not grow");
        drop((first, grown));
        assert!(!private(at, at + 3 * p));
        // SAFETY: the child only leaves.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) }, pid);
        assert!(private(at, at + 3 * p), "some of the grown span's pages stayed shared");
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(at as *mut _, 4 * p).unwrap() };
    }

    #[test]
    fn uncovered_parts_of_a_mapping() {
        assert_eq!(uncovered((0, 100), &[]), vec![(0, 100)]);
        assert_eq!(uncovered((0, 100), &[(0, 100)]), vec![]);
        assert_eq!(uncovered((10, 100), &[(0, 20), (40, 50), (90, 200)]), vec![(20, 40), (50, 90)]);
        assert_eq!(uncovered((10, 20), &[(0, 5), (30, 40)]), vec![(10, 20)]);
    }
}
