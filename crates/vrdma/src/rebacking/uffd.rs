//! The parts of the userfaultfd interface that re-backing uses: holding
//! other threads off pages while they are re-backed ([`super::fence`]) or
//! moved back ([`super::move_back`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

// From <linux/userfaultfd.h>; x86_64 ioctl numbers.
const UFFD_API: u64 = 0xaa;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
pub(super) const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
pub(super) const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub(super) const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub(super) const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub(super) const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
pub(super) const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
pub(super) const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
pub(super) const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
pub(super) const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
pub(super) const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
pub(super) const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UffdioRange {
    pub start: u64,
    pub len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
pub(super) struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}

#[repr(C)]
pub(super) struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}

/// A userfaultfd with `features`, or `None`. Without the privilege for
/// kernel-mode faults, one for user-mode faults only: a system call
/// another thread makes on a range it holds then fails (`EFAULT`).
pub(super) fn open(features: u64) -> Option<OwnedFd> {
    open_with(&[0, UFFD_USER_MODE_ONLY], features)
}

/// [`open`], but only one that holds kernel-mode faults too.
pub(super) fn open_kernel_mode(features: u64) -> Option<OwnedFd> {
    open_with(&[0], features)
}

fn open_with(modes: &[libc::c_int], features: u64) -> Option<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the userfaultfd system call takes only flags.
    let fd = modes
        .iter()
        .map(|&extra| unsafe { libc::syscall(libc::SYS_userfaultfd, flags | extra) })
        .find(|&fd| fd >= 0)?;
    // SAFETY: a descriptor the call just returned, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi { api: UFFD_API, features, ioctls: 0 };
    // SAFETY: UFFDIO_API reads and writes a `struct uffdio_api`.
    (unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } == 0).then_some(fd)
}

/// Registers `[start, start + len)` with `fd` in `mode`; whether it did.
pub(super) fn register(fd: &OwnedFd, start: usize, len: usize, mode: u64) -> bool {
    let mut reg =
        UffdioRegister { range: UffdioRange { start: start as u64, len: len as u64 }, mode, ioctls: 0 };
    // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register`;
    // the kernel checks the range (a mapping of this process it may hold).
    unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) == 0 }
}

/// Blocks every signal in this thread; returns the mask to restore. A
/// handler that touched a held range would wait on its own thread.
pub(super) fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data that sigfillset initialises; the old
    // mask is returned to be restored.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

/// Restores a mask [`block_signals`] returned.
pub(super) fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: sets this thread's mask to one saved before.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}
