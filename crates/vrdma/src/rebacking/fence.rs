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

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

// From <linux/userfaultfd.h>; x86_64 ioctl numbers.
const UFFD_API: u64 = 0xaa;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

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
        .find_map(open_with)
        .map(|fd| (fd, Untouched::Protected))
        .or_else(open_populating)
}

/// A userfaultfd that write-protects touched anonymous pages only.
fn open_populating() -> Option<(OwnedFd, Untouched)> {
    open_with(UFFD_FEATURE_PAGEFAULT_FLAG_WP).map(|fd| (fd, Untouched::Populated))
}

fn open_with(features: u64) -> Option<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the userfaultfd system call takes only flags. Without the
    // privilege for kernel-mode faults, a fence for user-mode writes.
    let fd = [0, UFFD_USER_MODE_ONLY]
        .into_iter()
        .map(|extra| unsafe { libc::syscall(libc::SYS_userfaultfd, flags | extra) })
        .find(|&fd| fd >= 0)?;
    // SAFETY: a descriptor the call just returned, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
    // SAFETY: UFFDIO_API reads and writes a `struct uffdio_api`.
    (unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } == 0).then_some(fd)
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
        let mut reg = UffdioRegister { range, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register`;
        // the range is the caller's, mapped, private anonymous memory.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } != 0 {
            return None;
        }
        // SAFETY: MADV_POPULATE_WRITE faults the caller's mapped range in
        // as writes would, leaving its bytes as they are.
        if untouched == Untouched::Populated
            && unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } != 0
        {
            return None;
        }
        // SAFETY: sigset_t is plain data that sigfillset initialises; the
        // old mask is saved to be restored on drop.
        let signals = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
            old
        };
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
        // writer this misses. Then the signal mask saved in `raise` is
        // restored.
        unsafe {
            libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp);
            libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE, &mut range);
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.signals, std::ptr::null_mut());
        }
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
