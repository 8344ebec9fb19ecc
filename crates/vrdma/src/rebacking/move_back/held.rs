//! The exact move: other threads held in missing-page faults while the
//! pages are filled (see the parent module's doc).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::mm::MremapFlags;
use vrdma_shm::Segment;

use super::Scratch;

// From <linux/userfaultfd.h>; x86_64 ioctl numbers.
const UFFD_API: u64 = 0xaa;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;

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
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// How long the helper reads events at most: `mremap` waits for it only
/// a moment, and the copy right after is one ioctl.
const HELPER_BOUND: Duration = Duration::from_secs(30);

/// How long the helper may take to start.
const HELPER_START: Duration = Duration::from_secs(5);

/// A userfaultfd that reports remaps, or `None`.
pub(super) fn open() -> Option<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the userfaultfd system call takes only flags. Without the
    // privilege for kernel-mode faults, one for user-mode faults: a system
    // call another thread makes on the range meanwhile fails (EFAULT).
    let fd = [0, UFFD_USER_MODE_ONLY]
        .into_iter()
        .map(|extra| unsafe { libc::syscall(libc::SYS_userfaultfd, flags | extra) })
        .find(|&fd| fd >= 0)?;
    // SAFETY: a descriptor the call just returned, owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi { api: UFFD_API, features: UFFD_FEATURE_EVENT_REMAP, ioctls: 0 };
    // SAFETY: UFFDIO_API reads and writes a `struct uffdio_api`.
    (unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } == 0).then_some(fd)
}

/// Moves `[start, start + len)` to private pages holding `view`'s bytes,
/// holding other threads off the range meanwhile. `Ok(false)`: a
/// userfaultfd cannot be had here, and nothing was changed.
pub(super) fn move_back(view: &Segment, start: usize, len: usize) -> std::io::Result<bool> {
    let Some(uffd) = open() else { return Ok(false) };
    let mut fresh = Scratch::new(len)?;
    let mut reg = UffdioRegister {
        range: UffdioRange { start: fresh.ptr as u64, len: len as u64 },
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register`;
    // the range is the untouched private mapping made above.
    if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } != 0 {
        return Ok(false);
    }
    // Signals stay blocked in this thread and in the helper (which
    // inherits the mask): a handler touching the range would wait on a
    // fault that only this thread can resolve.
    let signals = block_signals();
    let (ready, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let moved = std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("vrdma-move-back".into())
            .spawn_scoped(scope, || read_events(uffd.as_fd(), &ready, &done));
        // The helper must be past its start, which touches the heap (the
        // range may be heap pages), before the range is held: it would
        // wait there, and the remap for it. No helper (none can be made
        // now, or it did not start): nothing was changed.
        let started = helper.is_ok() && {
            let end = Instant::now() + HELPER_START;
            while !ready.load(Ordering::SeqCst) && Instant::now() < end {
                std::thread::yield_now();
            }
            ready.load(Ordering::SeqCst)
        };
        let result = started.then(|| fill(&uffd, &mut fresh, view, start, len));
        done.store(true, Ordering::SeqCst);
        result
    });
    restore_signals(&signals);
    moved.transpose().map(|m| m.is_some())
}

/// Moves `fresh` over the range and fills it from `view`; the range's
/// other users wait in a missing-page fault until the copy.
fn fill(
    uffd: &OwnedFd,
    fresh: &mut Scratch,
    view: &Segment,
    start: usize,
    len: usize,
) -> std::io::Result<()> {
    // SAFETY: `fresh` is a private mapping of `len` bytes, registered for
    // missing-page faults; moving it over the range replaces the BAR's
    // mapping there in one step. Until the copy below, a thread touching
    // the range waits in the kernel; this thread touches it not at all.
    let moved = unsafe {
        rustix::mm::mremap_fixed(
            fresh.ptr.cast(),
            len,
            len,
            MremapFlags::MAYMOVE,
            start as *mut std::ffi::c_void,
        )
    }?;
    fresh.len = 0;
    if moved as usize != start {
        return Err(std::io::Error::other("mremap moved the pages to a different address"));
    }
    let mut at = 0usize;
    let deadline = Instant::now() + HELPER_BOUND;
    while at < len {
        let mut copy = UffdioCopy {
            dst: (start + at) as u64,
            src: view.as_ptr() as u64 + at as u64,
            len: (len - at) as u64,
            mode: 0,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads and writes a `struct uffdio_copy`; the
        // source is `view`'s readable bytes, the destination the range,
        // registered above, whose missing pages it fills.
        let r = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_COPY, &mut copy) };
        if copy.copy > 0 {
            at += copy.copy as usize;
        }
        if r != 0 {
            let e = std::io::Error::last_os_error();
            // EAGAIN: the remap's event is not read yet, or a partial copy.
            if e.raw_os_error() != Some(libc::EAGAIN) || Instant::now() > deadline {
                return Err(e);
            }
            std::thread::yield_now();
        }
    }
    let mut range = UffdioRange { start: start as u64, len: len as u64 };
    // SAFETY: UFFDIO_UNREGISTER reads a `struct uffdio_range` (the range
    // is filled; closing the descriptor would drop the registration too).
    unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_UNREGISTER, &mut range) };
    Ok(())
}

/// Reads (and drops) the userfaultfd's events until `done`: the remap's,
/// which `mremap` waits for, and the faults of threads that touch the
/// range (the copy wakes them). Says `ready` first; from then on it
/// touches nothing but its stack, `ready`, `done` and the descriptor
/// until `done`.
fn read_events(uffd: BorrowedFd<'_>, ready: &AtomicBool, done: &AtomicBool) {
    let end = Instant::now() + HELPER_BOUND;
    let mut buf = [0u8; 32 * 16];
    ready.store(true, Ordering::SeqCst);
    while !done.load(Ordering::SeqCst) && Instant::now() < end {
        let mut fds = [libc::pollfd { fd: uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: one pollfd, 5 ms at most.
        if unsafe { libc::poll(fds.as_mut_ptr(), 1, 5) } > 0 {
            // SAFETY: reads into the buffer above (non-blocking descriptor).
            unsafe { libc::read(uffd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        }
    }
}

fn block_signals() -> libc::sigset_t {
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

fn restore_signals(old: &libc::sigset_t) {
    // SAFETY: restores a mask `block_signals` saved.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}
