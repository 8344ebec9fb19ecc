//! The readiness calls, interposed only to settle writes in flight before
//! the program waits: `poll`, `ppoll`, `select`, `pselect`,
//! `epoll_wait`, `epoll_pwait` (and `__poll_chk`, their
//! `_FORTIFY_SOURCE` form).
//!
//! What they report stays the kernel's (`docs/sockets.md`: wake bytes
//! keep a carried socket's `POLLIN` right). But a write returns before its
//! bytes landed, and only a look at its completion afterwards sends the
//! wake byte an asleep reader needs ([`crate::progress`]). A program that
//! wrote and now waits for its peer's answer would wait for the progress
//! thread's next look; so a call that may wait first waits for this
//! process's writes in flight to land (an engine round trip at most), and
//! a call that does not wait (timeout 0) reaps what completed. A process
//! with nothing in flight pays one lock and an empty list.

use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};

use crate::real;
use crate::table::{keep_errno, Guard};

/// Settles the writes in flight; `wait`: the call may block.
fn settle(wait: bool) {
    if let Some(_g) = Guard::enter() {
        keep_errno(|| crate::progress::flush_all(wait));
    }
}

fn waits_ms(timeout: c_int) -> bool {
    timeout != 0
}

/// A null timespec waits for ever; a zero one does not wait.
fn waits_ts(ts: *const timespec) -> bool {
    // SAFETY: the caller's timespec, null or valid (the call's contract).
    unsafe { ts.as_ref() }.is_none_or(|t| t.tv_sec != 0 || t.tv_nsec != 0)
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    settle(waits_ms(timeout));
    // SAFETY: libc's poll with the caller's arguments.
    unsafe { real::poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, len: usize) -> c_int {
    if (n as usize).saturating_mul(std::mem::size_of::<pollfd>()) > len {
        const MSG: &[u8] = b"*** buffer overflow detected ***: terminated\n";
        // SAFETY: write(2) of a static buffer to stderr, then abort, as
        // glibc's __chk_fail does.
        unsafe {
            libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len());
            libc::abort()
        }
    }
    // SAFETY: `poll` with the caller's arguments, checked as glibc does.
    unsafe { poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ts(ts));
    // SAFETY: libc's ppoll with the caller's arguments.
    unsafe { real::ppoll(fds, n, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    // SAFETY: the caller's timeval, null or valid (select's contract).
    let wait = unsafe { tv.as_ref() }.is_none_or(|t| t.tv_sec != 0 || t.tv_usec != 0);
    settle(wait);
    // SAFETY: libc's select with the caller's arguments.
    unsafe { real::select(n, r, w, e, tv) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ts(ts));
    // SAFETY: libc's pselect with the caller's arguments.
    unsafe { real::pselect(n, r, w, e, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int) -> c_int {
    settle(waits_ms(timeout));
    // SAFETY: libc's epoll_wait with the caller's arguments.
    unsafe { real::epoll_wait(ep, ev, max, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    ep: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    settle(waits_ms(timeout));
    // SAFETY: libc's epoll_pwait with the caller's arguments.
    unsafe { real::epoll_pwait(ep, ev, max, timeout, mask) }
}
