//! Holding other threads' writes off pages while they are re-backed.
//!
//! Re-backing copies a range of pages into a memfd, then maps the memfd
//! over the range. A write another thread makes to those pages between
//! the copy and the remap lands in the old pages and vanishes with them.
//! A userfaultfd in write-protect mode closes that window: while the fence
//! stands, a write to the range blocks in the kernel (reads go on); once
//! the memfd is mapped, the fence wakes the writers, and each retries its
//! write on the new mapping. Nothing is lost.
//!
//! Kernels before 6.4 (a guest's Debian 6.1 among them) cannot protect
//! pages not yet touched: there the range is populated first
//! (`MADV_POPULATE_WRITE`, which faults each page in as a write would,
//! bytes unchanged), then protected. Where userfaultfd cannot be had
//! (seccomp profiles of container runtimes;
//! `vm.unprivileged_userfaultfd = 0` without `CAP_SYS_PTRACE`, which only
//! allows a fence for user-mode writes, so that a system call writing into
//! the range meanwhile fails with `EFAULT`), re-backing runs without it and
//! the window stays open ([`available`] says which).
//!
//! While a fence stands, the thread that raised it must not write to the
//! range itself, nor allocate (the allocator's own pages may be in it):
//! it would wait on itself for ever.

use std::os::fd::{AsRawFd, OwnedFd};

use super::uffd::{self, UffdioRange, UffdioWriteprotect};
use super::uffd::{UFFDIO_REGISTER_MODE_WP, UFFDIO_WAKE, UFFDIO_WRITEPROTECT, UFFDIO_WRITEPROTECT_MODE_WP};
use super::uffd::{
    UFFD_FEATURE_PAGEFAULT_FLAG_WP, UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED,
};

/// Write protection of `[start, start + len)`; dropping it lifts the
/// protection (where the range is still the one protected) and wakes the
/// writers that wait. While it stands, the raising thread's signals are
/// blocked: a handler writing into the range would wait on its own thread.
pub(crate) struct WriteFence {
    fd: OwnedFd,
    range: UffdioRange,
    signals: libc::sigset_t,
}

/// How a fence protects pages not yet touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Untouched {
    /// The kernel protects them (6.4 on).
    Protected,
    /// They are populated first.
    Populated,
}

/// A userfaultfd that can write-protect untouched anonymous pages (and,
/// where the kernel can, shared memory: pages re-backed before), or one
/// that can write-protect touched ones, or `None`.
fn open() -> Option<(OwnedFd, Untouched)> {
    let wp = UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_UNPOPULATED;
    [wp | UFFD_FEATURE_WP_HUGETLBFS_SHMEM, wp]
        .into_iter()
        .find_map(uffd::open)
        .map(|fd| (fd, Untouched::Protected))
        .or_else(open_populating)
}

/// A userfaultfd that write-protects touched anonymous pages only.
fn open_populating() -> Option<(OwnedFd, Untouched)> {
    uffd::open(UFFD_FEATURE_PAGEFAULT_FLAG_WP).map(|fd| (fd, Untouched::Populated))
}

/// Whether re-backing can hold writers off (see the module documentation).
#[cfg(test)]
pub(crate) fn available() -> bool {
    open().is_some()
}

impl WriteFence {
    /// Write-protects the page-aligned range, or `None` where that cannot
    /// be done: then nothing was changed.
    pub(crate) fn raise(start: usize, len: usize) -> Option<WriteFence> {
        Self::raise_with(start, len, open()?)
    }

    fn raise_with(start: usize, len: usize, (fd, untouched): (OwnedFd, Untouched)) -> Option<WriteFence> {
        let range = UffdioRange { start: start as u64, len: len as u64 };
        if !uffd::register(&fd, start, len, UFFDIO_REGISTER_MODE_WP) {
            return None;
        }
        // SAFETY: MADV_POPULATE_WRITE faults the caller's mapped range in
        // as writes would, leaving its bytes as they are.
        if untouched == Untouched::Populated
            && unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } != 0
        {
            return None;
        }
        let signals = uffd::block_signals();
        let mut wp = UffdioWriteprotect { range, mode: UFFDIO_WRITEPROTECT_MODE_WP };
        // SAFETY: UFFDIO_WRITEPROTECT reads and writes a
        // `struct uffdio_writeprotect`.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) } != 0 {
            // Nothing is protected; dropping the fence restores the mask
            // and closes `fd`, which drops the registration.
            drop(WriteFence { fd, range, signals });
            return None;
        }
        Some(WriteFence { fd, range, signals })
    }
}

impl Drop for WriteFence {
    fn drop(&mut self) {
        let mut range = self.range;
        // Lift the protection explicitly (it fails, harmlessly, once the
        // memfd has replaced the range): a process forked meanwhile holds
        // the descriptor too, so closing it would not.
        let mut wp = UffdioWriteprotect { range, mode: 0 };
        // SAFETY: UFFDIO_WRITEPROTECT and UFFDIO_WAKE read (and write) the
        // structs given; closing the descriptor right after wakes any
        // writer this misses.
        unsafe {
            libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp);
            libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut range);
        }
        uffd::restore_signals(&self.signals);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// A fence for a kernel that cannot protect untouched pages (a
    /// guest's 6.1) holds off a write to a page never touched before: it
    /// populates the range first.
    #[test]
    fn a_populating_fence_holds_writes_to_untouched_pages() {
        let Some(fd) = open_populating() else {
            eprintln!("skipping: no userfaultfd write protection here");
            return;
        };
        let page = vrdma_shm::page_size();
        // SAFETY: a fresh private anonymous mapping, untouched.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                2 * page,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .unwrap() as usize;
        let wrote = AtomicBool::new(false);
        std::thread::scope(|s| {
            let fence = WriteFence::raise_with(p, 2 * page, fd).expect("a fence");
            let writer = s.spawn(|| {
                // SAFETY: inside the mapping; the fence holds this write.
                unsafe { AtomicU32::from_ptr((p + page + 4) as *mut u32).store(7, Ordering::SeqCst) };
                wrote.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert!(!wrote.load(Ordering::SeqCst), "a write to an untouched page went through the fence");
            drop(fence);
            writer.join().unwrap();
        });
        assert!(wrote.load(Ordering::SeqCst));
        // SAFETY: inside the mapping; the writer is gone.
        assert_eq!(unsafe { AtomicU32::from_ptr((p + page + 4) as *mut u32).load(Ordering::SeqCst) }, 7);
        // SAFETY: the test's mapping.
        unsafe { rustix::mm::munmap(p as *mut _, 2 * page).unwrap() };
    }
}
