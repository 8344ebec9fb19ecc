//! A live region's page that holds a thread arena's header, private
//! for the moment of a `fork`.
//!
//! In the child of a `fork`, glibc resets every malloc arena's lock,
//! free-list link and thread count (in the arena's header, at the start of
//! its first heap) before any `pthread_atfork` child handler runs. A
//! re-backed page is a shared mapping, so a header on one takes those
//! writes for the parent, whose thread of that arena then aborts at its
//! exit ("malloc assertion failure in `__malloc_arena_thread_freeres`:
//! `a->attached_threads > 0`"). A thread's first allocations lie on that
//! page: a worker thread that allocates its buffer first and registers it
//! shares the header. Real hardware does not have this problem: the kernel
//! gives the child its own copy of pinned pages at the fork. Pages no
//! region uses any more go back to private memory for good before a fork
//! ([`super::idle_pages`]); a live region's page cannot, since the device
//! writes it.
//!
//! So the prepare handler *parks* such a page: it notes its bytes, moves
//! it to private memory by the exact move ([`super::move_back`]), and
//! the fork copies it for the child as any private page, so the child's
//! reset lands in the child. Right after the fork the parent's handler
//! puts the page back into the span's memfd: each byte the parent changed
//! meanwhile (glibc's own locking, other threads' allocations) goes into
//! the file unless the device changed that byte too (the device's write
//! wins, as in a move back), then the file is mapped over the page again
//! under the write fence ([`super::fence`]). While it is parked (the time
//! of one fork) the parent reads the page's device writes late, not never.
//!
//! A header is recognised by glibc's layout on 64-bit Linux: a thread
//! arena's heaps start at multiples of 64 MiB with a `heap_info` whose
//! first word points right after it (at the arena) and whose second (the
//! previous heap) is null for an arena's first heap. A page of the
//! program's own data that looks so is parked too, which costs a copy
//! and nothing else. A guest's pages are parked the same way, the VM's
//! BAR in the place of the memfd.

use std::cell::RefCell;
use std::os::fd::AsFd;
use std::sync::Arc;

use vrdma_shm::Segment;

use super::fence::WriteFence;
use super::guest::in_bar;
use super::move_back::{carry_over, move_back_to_private_noting};
use super::{largest, read_maps, Span, Spans};

/// glibc reserves a thread arena's heaps at multiples of this
/// (`HEAP_MAX_SIZE`, 64 MiB on 64-bit).
const HEAP_MAX: usize = 64 << 20;

/// A page moved to private memory for a fork.
struct Parked {
    span: Arc<Span>,
    page: usize,
    /// The bytes the private page started with (the file's then).
    before: Vec<u8>,
}

thread_local! {
    /// The pages the forking thread parked; put back by the same thread.
    static PARKED: RefCell<Vec<Parked>> = const { RefCell::new(Vec::new()) };
}

/// Whether the page at `at` (a multiple of [`HEAP_MAX`], mapped
/// readable) begins with a thread arena's first `heap_info`.
///
/// # Safety
/// The page at `at` must be mapped readable.
unsafe fn holds_an_arena_header(at: usize) -> bool {
    // SAFETY: the first three words of the page (the caller's contract).
    let (arena, prev, size) = unsafe {
        let w = at as *const usize;
        (w.read_volatile(), w.add(1).read_volatile(), w.add(2).read_volatile())
    };
    (at + 16..=at + 128).contains(&arena) && prev == 0 && size > 0 && size <= HEAP_MAX
}

/// Called by the forking thread before `fork`, with the registry `reg`
/// held: parks the pages of live spans that hold an arena's header.
pub(super) fn fork_preparing(reg: &Spans) {
    if !cfg!(all(target_os = "linux", target_pointer_width = "64")) {
        return;
    }
    let page = vrdma_shm::page_size();
    let mut candidates: Vec<(Arc<Span>, usize)> = Vec::new();
    for span in reg.values().filter_map(|gens| largest(gens)) {
        let mut at = span.start.next_multiple_of(HEAP_MAX);
        while at < span.end() {
            candidates.push((span.clone(), at));
            at += HEAP_MAX;
        }
    }
    if candidates.is_empty() {
        return;
    }
    // A span's page is read only where it is still the span's mapping: a
    // guest's kept span whose pages moved back, or memory the program
    // unmapped while registered (its bug), is not parked.
    let Ok(maps) = read_maps() else { return };
    let mut parked = Vec::new();
    for (span, at) in candidates {
        let base = span.guest.as_ref().map_or(0, |g| g.maps_offset) + (at - span.start) as u64;
        if !in_bar(&maps, at, at + page, span.ino, base) {
            continue;
        }
        // SAFETY: mapped readable and writable from the span's file
        // (checked just now, under the registry's lock).
        if unsafe { holds_an_arena_header(at) } {
            // Taken as the page moves: an allocation (the header's
            // page!) between a copy and the move would differ.
            let mut before = vec![0; page];
            parked.reserve(1);
            match move_back_to_private_noting(span.fd(), file_offset(&span, at), at, &mut before) {
                Ok(()) => parked.push(Parked { span: span.clone(), page: at, before }),
                Err(e) => tracing::warn!(page = at, "vrdma: cannot park a page for a fork: {e}"),
            }
        }
    }
    PARKED.with(|p| *p.borrow_mut() = parked);
}

/// In the parent after `fork`: the parked pages go back into their files.
pub(super) fn forked_parent() {
    for p in PARKED.with(|p| std::mem::take(&mut *p.borrow_mut())) {
        if let Err(e) = put_back(&p) {
            tracing::error!(
                page = p.page,
                "vrdma: a page of a registered region stays private after a fork (the device's writes to it \
                 are not seen): {e}"
            );
        }
    }
}

/// In the child after `fork`: its copies of the parked pages stay its
/// own; the list is left alone (no heap is touched in the child).
pub(super) fn forked_child() {
    PARKED.with(|p| std::mem::forget(std::mem::take(&mut *p.borrow_mut())));
}

/// Where the page at `at` of `span` lies in the span's file (a guest's:
/// in the VM's BAR, from the extent's offset).
fn file_offset(span: &Span, at: usize) -> u64 {
    span.guest.as_ref().map_or(0, |g| g.offset) + (at - span.start) as u64
}

fn put_back(p: &Parked) -> std::io::Result<()> {
    let len = p.before.len();
    let offset = file_offset(&p.span, p.page);
    let file = Segment::map_trusted_at(p.span.fd().try_clone_to_owned()?, offset, len)?;
    // Other threads' writes to the page wait from here until the file is
    // mapped over it; this thread neither allocates nor writes the page.
    let fence = WriteFence::raise(p.page, len);
    // SAFETY: the page is this process's private mapping of `len` bytes
    // (parked), `before` holds `len` bytes, and `file` maps `len` bytes
    // of the span's file, which the device may write concurrently.
    unsafe { carry_over(p.page as *const u8, p.before.as_ptr(), file.as_ptr(), len) };
    // SAFETY: the file now holds the page's bytes (but where the device
    // wrote since the park), so every pointer into the page stays valid
    // and sees the same contents, shared with the device again.
    let mapped = unsafe {
        rustix::mm::mmap(
            p.page as *mut std::ffi::c_void,
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED | rustix::mm::MapFlags::FIXED,
            p.span.fd.as_fd(),
            offset,
        )
    };
    drop(fence);
    match mapped {
        Ok(at) if at as usize == p.page => Ok(()),
        Ok(_) => Err(std::io::Error::other("MAP_FIXED mapping landed at a different address")),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rebacking::{read_maps, reback, still_mapped, REGISTRY};

    /// A page that looks like a thread arena's first heap, registered:
    /// parked for a fork, it takes both the parent's write and the
    /// device's (through the span's file) made while it was parked, and is
    /// shared with the device again after.
    /// A registry of `r`'s span alone (other tests' spans are not parked
    /// here; the global registry's lock, held by the tests, keeps other
    /// tests' forks from parking it meanwhile).
    fn only(r: &crate::rebacking::Rebacked) -> Spans {
        Spans::from([(r.span.start, vec![Arc::downgrade(&r.span)])])
    }

    /// A mapping of `2 * HEAP_MAX` bytes and, in it, a page at a multiple
    /// of [`HEAP_MAX`] that looks like a thread arena's first heap (arena
    /// right after its `heap_info`, no previous heap, 132 KiB), the rest of
    /// the page 0x11.
    fn fake_first_heap() -> (usize, usize) {
        let page = vrdma_shm::page_size();
        // SAFETY: a fresh private mapping, twice the alignment wanted.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                2 * HEAP_MAX,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::NORESERVE,
            )
        }
        .unwrap() as usize;
        let at = base.next_multiple_of(HEAP_MAX);
        let words = at as *mut usize;
        // SAFETY: inside the mapping.
        unsafe {
            words.write(at + 48);
            words.add(1).write(0);
            words.add(2).write(132 << 10);
            std::ptr::write_bytes((at + 64) as *mut u8, 0x11, page - 64);
        }
        (base, at)
    }

    /// That page registered: parked for a fork, it takes both the parent's
    /// write and the device's (through the span's file) made while it was
    /// parked, and is shared with the device again after.
    #[test]
    fn a_parked_page_keeps_the_parents_and_the_devices_writes() {
        let (base, at) = fake_first_heap();
        // SAFETY: the test's memory; the region lives to the end.
        let r = unsafe { reback((at + 1024) as *mut u8, 256) }.unwrap();
        // Held to the end: a fork elsewhere in this binary parks pages too.
        let reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        {
            fork_preparing(&only(&r));
            assert_eq!(PARKED.with(|p| p.borrow().len()), 1, "the page was not parked");
            let maps = read_maps().unwrap();
            assert!(
                !still_mapped(&maps, r.span.start, r.span.end(), r.span.ino),
                "still shared while parked"
            );
            // The device writes byte 2000, the parent byte 3000.
            rustix::io::pwrite(r.span.fd(), &[0x22], (at + 2000 - r.span.start) as u64).unwrap();
            // SAFETY: inside the parked page.
            unsafe { ((at + 3000) as *mut u8).write_volatile(0x33) };
            forked_parent();
        }
        let maps = read_maps().unwrap();
        assert!(still_mapped(&maps, r.span.start, r.span.end(), r.span.ino), "not shared again");
        // SAFETY: inside the page, mapped from the file again.
        let byte = |i: usize| unsafe { ((at + i) as *const u8).read_volatile() };
        assert_eq!((byte(2000), byte(3000), byte(1000)), (0x22, 0x33, 0x11));
        // The device's writes land again.
        rustix::io::pwrite(r.span.fd(), &[0x44], (at + 2500 - r.span.start) as u64).unwrap();
        assert_eq!(byte(2500), 0x44);
        drop(reg);
        drop(r);
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(base as *mut _, 2 * HEAP_MAX).unwrap() };
    }

    /// A registered page the program unmapped (its bug) is not read.
    #[test]
    fn an_unmapped_registered_page_is_left_alone() {
        let (base, at) = fake_first_heap();
        // SAFETY: the test's memory; the region lives to the end.
        let r = unsafe { reback((at + 1024) as *mut u8, 256) }.unwrap();
        // SAFETY: the test's mapping (the region dangles now).
        unsafe { rustix::mm::munmap(at as *mut _, vrdma_shm::page_size()).unwrap() };
        let reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        fork_preparing(&only(&r));
        assert_eq!(PARKED.with(|p| p.borrow().len()), 0);
        forked_parent();
        drop(reg);
        drop(r);
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(base as *mut _, 2 * HEAP_MAX).unwrap() };
    }

    #[test]
    fn recognises_a_first_heaps_header_only() {
        let page = vrdma_shm::page_size();
        let mut buf = vec![0usize; page / 8];
        let at = buf.as_mut_ptr() as usize;
        let mut check = |w: [usize; 3]| {
            buf[..3].copy_from_slice(&w);
            // SAFETY: `buf` is a readable page's worth of words.
            unsafe { holds_an_arena_header(at) }
        };
        assert!(check([at + 48, 0, 1 << 20]));
        assert!(!check([at + 48, 0x7f00_0000_0000, 1 << 20]), "a later heap");
        assert!(!check([at + 4096, 0, 1 << 20]), "points elsewhere");
        assert!(!check([at + 48, 0, 0]));
        assert!(!check([at + 48, 0, HEAP_MAX + 1]));
    }
}
