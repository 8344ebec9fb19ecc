//! The exact move: other threads held in missing-page faults while the
//! pages are filled (see the parent module's doc).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::mm::MremapFlags;

use super::super::uffd::{self, UffdioCopy, UffdioRange};
use super::super::uffd::{
    UFFDIO_COPY, UFFDIO_REGISTER_MODE_MISSING, UFFDIO_UNREGISTER, UFFD_FEATURE_EVENT_REMAP,
};
use super::Scratch;

/// How long the helper reads events at most: `mremap` waits for it only
/// a moment, and the copy right after is one ioctl.
const HELPER_BOUND: Duration = Duration::from_secs(30);

/// How long the helper may take to start.
const HELPER_START: Duration = Duration::from_secs(5);

/// A userfaultfd that reports remaps, or `None`.
pub(super) fn open() -> Option<OwnedFd> {
    uffd::open(UFFD_FEATURE_EVENT_REMAP)
}

/// Whether [`open`] gives one that holds the kernel's accesses too (not
/// a user-mode-only one), asked once.
pub(super) fn exact_available() -> bool {
    static EXACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXACT.get_or_init(|| uffd::open_kernel_mode(UFFD_FEATURE_EVENT_REMAP).is_some())
}

/// Moves `[start, start + len)` to private pages holding the bytes `view`
/// maps (`len` readable bytes, a second view of the range's pages),
/// holding other threads off the range meanwhile. `Ok(false)`: a
/// userfaultfd cannot be had here, and nothing was changed.
pub(super) fn move_back(view: *const u8, start: usize, len: usize) -> std::io::Result<bool> {
    let Some(uffd) = open() else { return Ok(false) };
    let mut fresh = Scratch::new(len)?;
    // The untouched private mapping made above.
    if !uffd::register(&uffd, fresh.ptr as usize, len, UFFDIO_REGISTER_MODE_MISSING) {
        return Ok(false);
    }
    // Signals stay blocked in this thread and in the helper (which
    // inherits the mask): a handler touching the range would wait on a
    // fault that only this thread can resolve.
    let signals = uffd::block_signals();
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
        // Joined, not only finished: the scope waits for the helper's
        // closure, but its thread may still be exiting (glibc frees its
        // malloc state then); a fork right after this, in the prepare
        // handler, must not copy an allocator lock that thread holds.
        if let Ok(h) = helper {
            let _ = h.join();
        }
        result
    });
    uffd::restore_signals(&signals);
    moved.transpose().map(|m| m.is_some())
}

/// Moves `fresh` over the range and fills it from `view`; the range's
/// other users wait in a missing-page fault until the copy.
fn fill(
    uffd: &OwnedFd,
    fresh: &mut Scratch,
    view: *const u8,
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
            src: view as u64 + at as u64,
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
