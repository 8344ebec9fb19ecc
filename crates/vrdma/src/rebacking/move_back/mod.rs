//! Moving a guest's re-backed pages back to private memory while other
//! threads use them.
//!
//! In a guest the pages are mapped from the VM's BAR, a PFN mapping that a
//! userfaultfd cannot write-protect, so the host's fence
//! ([`super::fence`]) cannot hold other threads off while the pages move.
//! They must stay usable throughout: they are usually heap pages, and
//! `malloc` in another thread reads and writes its chunk headers there.
//! (An earlier version copied the bytes out, mapped fresh private pages
//! over the range and copied the bytes back: between the two, other
//! threads read zeros, and a guest's `rping` died of a corrupted heap.)
//!
//! So the new pages are filled *before* anyone sees them. Where this
//! process may use a userfaultfd (as root in a guest), the move is exact:
//! an untouched private mapping, registered for missing-page faults, is
//! moved over the range with one `mremap` (under the kernel's lock of the
//! address space); from then on a thread touching the range waits in the
//! kernel until one `UFFDIO_COPY` has filled the pages with the BAR's
//! bytes, read through a second view of the extent that nothing else
//! writes any more. Nothing is lost and no zeros are seen; the wait lasts
//! one copy. (A helper thread reads the userfaultfd's events: `mremap`
//! waits until its event is read.)
//!
//! Without a userfaultfd the bytes are copied into a private mapping
//! elsewhere, which `mremap` moves over the range: every read sees either
//! the BAR's page or its copy. A write another thread makes to the BAR's
//! page between the copy and the move lands in the BAR only: the BAR's
//! bytes are compared afterwards with a snapshot of the copy, and each
//! byte that changed meanwhile is carried over to the private page with
//! a compare-and-swap that gives way where the private page was written
//! since. A write in that window followed by another write to the same
//! byte before the carry-over is still lost there.
//!
//! Moving pages back is the rare path: deregistration keeps them in the
//! BAR (see [`super::guest`]); they move when their context closes or a
//! registration needs their place.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::mm::{MapFlags, MremapFlags, ProtFlags};
use vrdma_shm::Segment;

mod held;

/// A private anonymous mapping of `len` bytes at an address the kernel
/// chooses, unmapped on drop unless taken.
struct Scratch {
    ptr: *mut u8,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> std::io::Result<Scratch> {
        // SAFETY: a fresh private mapping at an address the kernel
        // chooses: nothing else refers to it.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }?;
        Ok(Scratch { ptr: p.cast(), len })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the mapping made in `new`, used by nothing else (a
        // taken one has length 0).
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            tracing::warn!("vrdma: cannot unmap a scratch mapping: {e}");
        }
    }
}

/// Replaces the pages `[start, start + len)`, mapped from `bar` at
/// `offset`, with private anonymous pages holding their bytes (see the
/// module's doc). Returns whether it did: where it did not, the pages are
/// still the BAR's and its extent must not be given back.
pub(super) fn move_back_to_private(bar: BorrowedFd<'_>, offset: u64, start: usize, len: usize) -> bool {
    match move_back(bar, offset, start, len) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(start, len, "vrdma: cannot move guest pages back to private memory: {e}");
            false
        }
    }
}

fn move_back(bar: BorrowedFd<'_>, offset: u64, start: usize, len: usize) -> std::io::Result<()> {
    // A second view of the BAR's bytes: the source of the copy, and where
    // writes that land after it are seen.
    let view = Segment::map_trusted_at(bar.try_clone_to_owned()?, offset, len)?;
    move_back_from(view.as_ptr(), start, len)
}

/// Whether a move back is exact here: a userfaultfd that holds the
/// kernel's accesses too can be had (see `held`).
pub(super) fn exact_move_available() -> bool {
    held::exact_available()
}

/// Replaces the pages `[start, start + len)`, a shared mapping of a
/// memfd whose descriptor may be gone (a host's re-backed pages that no
/// region uses any more), with private anonymous pages holding their
/// bytes, as [`move_back_to_private`] does for a guest's. The range must
/// lie in one mapping (one line of `/proc/self/maps`): the second view
/// maps the file linearly from the range's first page. Returns whether
/// it did; where it did not, the pages are still the memfd's.
pub(super) fn move_shared_back_to_private(start: usize, len: usize) -> bool {
    let moved = Alias::of(start, len).and_then(|view| move_back_from(view.ptr, start, len));
    if let Err(e) = &moved {
        tracing::warn!(start, len, "vrdma: cannot move re-backed pages back to private memory: {e}");
    }
    moved.is_ok()
}

/// A second mapping of the same pages as a shared mapping, made from the
/// mapping itself (`mremap` with an old size of 0), unmapped on drop.
struct Alias {
    ptr: *mut u8,
    len: usize,
}

impl Alias {
    fn of(start: usize, len: usize) -> std::io::Result<Alias> {
        // SAFETY: with an old size of 0, `mremap` maps the pages of the
        // shared mapping at `start` a second time, at an address the
        // kernel chooses; the range stays as it is.
        let p = unsafe { rustix::mm::mremap(start as *mut std::ffi::c_void, 0, len, MremapFlags::MAYMOVE) }?;
        Ok(Alias { ptr: p.cast(), len })
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, used by nothing else.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) } {
            tracing::warn!("vrdma: cannot unmap a second view of re-backed pages: {e}");
        }
    }
}

/// Moves `[start, start + len)` back to private pages holding the bytes
/// of `view`, a second mapping of the same `len` bytes.
fn move_back_from(view: *const u8, start: usize, len: usize) -> std::io::Result<()> {
    if held::move_back(view, start, len)? {
        return Ok(());
    }
    let mut copy = Scratch::new(len)?;
    let snap = Scratch::new(len)?;
    // SAFETY: `view` maps `len` readable bytes (the same pages as the
    // range) and `copy` and `snap` are separate mappings of `len` bytes
    // that only this thread knows yet.
    unsafe {
        std::ptr::copy_nonoverlapping(view, copy.ptr, len);
        std::ptr::copy_nonoverlapping(copy.ptr, snap.ptr, len);
    }
    // SAFETY: `copy` is a private mapping of `len` bytes holding the
    // range's bytes; moving it over the range replaces the shared mapping
    // there in one step, so every pointer into the range stays valid and
    // sees the same bytes.
    let moved = unsafe {
        rustix::mm::mremap_fixed(
            copy.ptr.cast(),
            len,
            len,
            MremapFlags::MAYMOVE,
            start as *mut std::ffi::c_void,
        )
    }?;
    // The mapping lives at the range now; it is the application's.
    copy.len = 0;
    if moved as usize != start {
        return Err(std::io::Error::other("mremap moved the pages to a different address"));
    }
    // SAFETY: `view` and `snap` map `len` bytes each; the range is mapped
    // readable and writable (the move above), shared with other threads.
    unsafe { carry_over(view, snap.ptr, start as *mut u8, len) };
    Ok(())
}

/// Carries each byte that changed in the BAR (`now`) since the copy
/// (`was`) over to the private pages at `page`, unless the byte there was
/// written since (it no longer holds `was`).
///
/// # Safety
/// `now` and `was` are readable for `len` bytes; `page` readable and
/// writable for `len` bytes, which other threads may access concurrently.
unsafe fn carry_over(now: *const u8, was: *const u8, page: *mut u8, len: usize) {
    for i in 0..len {
        // SAFETY: `i < len`: inside both (the caller's contract).
        let (n, w) = unsafe { (now.add(i).read_volatile(), was.add(i).read()) };
        if n != w {
            // SAFETY: inside the pages (the caller's contract); other
            // threads may access them, so only atomically.
            let at = unsafe { AtomicU8::from_ptr(page.add(i)) };
            let _ = at.compare_exchange(w, n, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::fd::OwnedFd;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    /// A stand-in BAR of `len` bytes (a memfd).
    fn test_bar(len: usize) -> OwnedFd {
        let bar = rustix::fs::memfd_create("vrdma-test-bar", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&bar, len as u64).unwrap();
        bar
    }

    /// Maps `len` bytes of `bar` at `offset`, where the kernel chooses or
    /// (`MapFlags::FIXED`) over the test's own range at `at`.
    fn map_test_bar(
        bar: &OwnedFd,
        at: *mut std::ffi::c_void,
        len: usize,
        flags: MapFlags,
        offset: u64,
    ) -> usize {
        // SAFETY: a shared mapping of the test's memfd, at an address the
        // kernel chooses or over the test's own range.
        unsafe {
            rustix::mm::mmap(
                at,
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | flags,
                bar,
                offset,
            )
        }
        .unwrap() as usize
    }

    /// A write that reached the BAR between the copy and the move is
    /// carried over to the private page, unless that byte was written
    /// on the private page since (the later write wins).
    #[test]
    fn writes_that_landed_in_the_bar_meanwhile_are_carried_over() {
        let was = [1u8, 2, 3, 4];
        let now = [1u8, 9, 3, 8];
        // Byte 3 was written again on the private page after the move.
        let mut page = [1u8, 2, 3, 7];
        // SAFETY: four bytes each, this thread's.
        unsafe { carry_over(now.as_ptr(), was.as_ptr(), page.as_mut_ptr(), 4) };
        assert_eq!(page, [1, 9, 3, 7]);
    }

    /// Pages mapped from a memfd whose descriptor is closed (a host's
    /// span after its last region) move back to private memory with
    /// their bytes: from then on the file no longer sees their writes.
    #[test]
    fn shared_pages_of_a_closed_memfd_move_back_with_their_bytes() {
        let page = vrdma_shm::page_size();
        let len = 3 * page;
        let fd = test_bar(len);
        let addr = map_test_bar(&fd, std::ptr::null_mut(), len, MapFlags::empty(), 0);
        let watch = map_test_bar(&fd, std::ptr::null_mut(), len, MapFlags::empty(), 0);
        drop(fd);
        for i in 0..len {
            // SAFETY: inside the test's mapping.
            unsafe { *((addr + i) as *mut u8) = (i % 251) as u8 };
        }
        assert!(move_shared_back_to_private(addr, len));
        for i in 0..len {
            // SAFETY: inside the range, mapped (now privately).
            assert_eq!(unsafe { *((addr + i) as *const u8) }, (i % 251) as u8, "byte {i}");
        }
        // SAFETY: inside the range.
        unsafe { *((addr + page) as *mut u8) = 0xee };
        // SAFETY: inside the watching mapping.
        assert_eq!(unsafe { *((watch + page) as *const u8) }, (page % 251) as u8, "the file saw a write");
        let maps = super::super::read_maps().unwrap();
        let e = maps.iter().find(|e| e.start <= addr && addr < e.end).unwrap();
        assert!(e.is_private_anonymous(), "{e:?}");
        // SAFETY: the test's mappings.
        unsafe {
            rustix::mm::munmap(addr as *mut _, len).unwrap();
            rustix::mm::munmap(watch as *mut _, len).unwrap();
        }
    }

    /// While pages move back, another thread reading them sees their
    /// bytes every time, never the zeros of fresh pages (it did when the
    /// bytes were copied out and back around a fresh mapping).
    #[test]
    fn readers_see_the_bytes_throughout_a_move_back() {
        let page = vrdma_shm::page_size();
        let len = 4 * page;
        let bar = test_bar(len);
        const WORD: u64 = 0x5a5a_1234_8765_a5a5;
        let map_bar = |at: *mut std::ffi::c_void, flags: MapFlags| map_test_bar(&bar, at, len, flags, 0);
        let addr = map_bar(std::ptr::null_mut(), MapFlags::empty());
        let word = (addr + page + 64) as *mut u64;
        // SAFETY: inside the mapping, which lives until the end of the test.
        unsafe { AtomicU64::from_ptr(word).store(WORD, Ordering::SeqCst) };
        let word = word as usize;
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut reads, mut bad) = (0u64, 0u64);
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                    // SAFETY: inside the range, mapped throughout (from the
                    // BAR or privately).
                    let w = unsafe { AtomicU64::from_ptr(word as *mut u64).load(Ordering::SeqCst) };
                    bad += u64::from(w != WORD);
                    reads += 1;
                }
                (reads, bad)
            })
        };
        for _ in 0..300 {
            assert!(move_back_to_private(bar.as_fd(), 0, addr, len));
            // The BAR over the range again, as a registration maps it (it
            // still holds the same bytes).
            assert_eq!(map_bar(addr as *mut _, MapFlags::FIXED), addr);
        }
        stop.store(true, Ordering::SeqCst);
        let (reads, bad) = reader.join().unwrap();
        assert!(reads > 0);
        assert_eq!(bad, 0, "a reader saw other bytes while the pages moved back ({reads} reads)");
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(addr as *mut _, len).unwrap() };
    }

    /// Where a userfaultfd can be had (as root: in CI, and in guests), a
    /// move back is exact: a thread incrementing a counter in the pages
    /// throughout loses no increment (the copy-and-carry-over fallback
    /// can lose one written twice around the move).
    #[test]
    fn a_writer_loses_nothing_while_pages_move_back() {
        if held::open().is_none() {
            eprintln!("skipping: no userfaultfd here; a move back carries writes over instead");
            return;
        }
        let page = vrdma_shm::page_size();
        let len = 4 * page;
        let bar = test_bar(2 * len);
        let map_bar = |at: *mut std::ffi::c_void, flags: MapFlags, offset: u64| {
            map_test_bar(&bar, at, len, flags, offset)
        };
        let addr = map_bar(std::ptr::null_mut(), MapFlags::empty(), 0);
        let counter = addr + 2 * page + 256;
        let (stop, pause, paused) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let writer = {
            let (stop, pause, paused) = (stop.clone(), pause.clone(), paused.clone());
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                    if pause.load(Ordering::SeqCst) {
                        paused.store(true, Ordering::SeqCst);
                        while pause.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                            std::hint::spin_loop();
                        }
                        paused.store(false, Ordering::SeqCst);
                        continue;
                    }
                    // SAFETY: inside the range, mapped throughout.
                    unsafe { AtomicU64::from_ptr(counter as *mut u64).fetch_add(1, Ordering::SeqCst) };
                    n += 1;
                }
                n
            })
        };
        let mut offset = 0;
        for _ in 0..200 {
            std::thread::sleep(std::time::Duration::from_micros(200));
            assert!(move_back_to_private(bar.as_fd(), offset, addr, len));
            // The BAR over the range again, at the other offset, with the
            // writer paused: as a registration maps it.
            pause.store(true, Ordering::SeqCst);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !paused.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                std::hint::spin_loop();
            }
            assert!(paused.load(Ordering::SeqCst), "the writer did not pause");
            offset = len as u64 - offset;
            let other = map_bar(std::ptr::null_mut(), MapFlags::empty(), offset);
            // SAFETY: both map `len` bytes; the writer is paused.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, other as *mut u8, len) };
            // SAFETY: the test's own mapping.
            unsafe { rustix::mm::munmap(other as *mut _, len).unwrap() };
            assert_eq!(map_bar(addr as *mut _, MapFlags::FIXED, offset), addr);
            pause.store(false, Ordering::SeqCst);
        }
        stop.store(true, Ordering::SeqCst);
        let n = writer.join().unwrap();
        // SAFETY: inside the range; the writer is gone.
        let seen = unsafe { AtomicU64::from_ptr(counter as *mut u64).load(Ordering::SeqCst) };
        assert!(n > 0);
        assert_eq!(seen, n, "increments lost while the pages moved back");
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(addr as *mut _, len).unwrap() };
    }
}
