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
//! Where userfaultfd cannot be had (kernels before 6.4, which cannot
//! protect pages not yet touched; seccomp profiles of container runtimes;
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

/// A userfaultfd that can write-protect untouched anonymous pages (and,
/// where the kernel can, shared memory: pages re-backed before), or
/// `None`.
fn open() -> Option<OwnedFd> {
    let wp = UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_UNPOPULATED;
    [wp | UFFD_FEATURE_WP_HUGETLBFS_SHMEM, wp].into_iter().find_map(open_with)
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
        let fd = open()?;
        let range = UffdioRange { start: start as u64, len: len as u64 };
        let mut reg = UffdioRegister { range, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register`;
        // the range is the caller's, mapped, private anonymous memory.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } != 0 {
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
