//! Credit wake-up: a writer that found its peer's ring full is told as
//! soon as the reader gives credits back, instead of at the progress
//! thread's next look (`docs/sockets.md`, "Writing").
//!
//! Credits are a word the peer's reader RDMA-writes into this end's
//! control block: it lands without a sound. So a writer that is about to
//! wait *asks* for a sound: it arms its connection's receive CQ (which
//! reports to the process's completion channel, [`channel`]) and
//! RDMA-writes a nonzero `WANT` word into the reader's control block. A
//! reader, after each credit it sent has landed, looks at its `WANT`
//! word; set, it clears it and answers with a zero-length send, which
//! completes a receive posted at the writer and raises the channel's
//! event. The progress thread ([`crate::progress`]) waits on the
//! channel's descriptor (its periodic look is the fallback), and on an
//! event takes the answer, gives `EPOLLOUT` back to a write-blocked
//! connection and wakes the threads blocked in a write ([`came`]).
//!
//! Why no wake is lost (as the wake bytes' argument): the writer looks
//! at its credits again only after its `WANT` landed; the reader looks at
//! `WANT` only after its credit landed. Either the reader sees `WANT`
//! (and answers) or the writer's second look sees the credit.
//!
//! Two things the argument needs besides. The writer is marked as asking,
//! and listed for the progress thread, before its `WANT` goes: the
//! reader may see the word and answer before the writer reaps the
//! `WANT`'s own completion, and an answer whose event finds no listed
//! connection is lost. And "after its credit landed" must not wait for
//! the reader's next call: an arming posted without waiting lists its
//! connection too, so the progress thread (or a readiness call about to
//! wait) reaps it and answers.
//!
//! At most one answer is owed at a time: the writer asks again only once
//! the last answer was taken (its receive reposted), so the two receives
//! posted per connection never run out (an answer finding none would
//! wait for the RNR timer and hold the reader's later writes back).

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use libc::c_int;

use vrdma::CompletionChannel;

use crate::dev::Dev;

/// Bumped each time answers came (blocked writers wait for a change).
static SEQ: AtomicU32 = AtomicU32::new(0);
/// Threads waiting in [`wait`] (no wake-up call without one).
static WAITERS: AtomicU32 = AtomicU32::new(0);

/// The process's completion channel for answers (created on first use;
/// `None` if it could not be: writers then fall back to looking).
pub fn channel(dev: &Dev) -> Option<&CompletionChannel> {
    dev.credit_chan.get_or_init(|| dev.ctx.create_comp_channel().ok()).as_ref()
}

/// How many answers came so far (read before a writer looks at its
/// credits for the last time, then passed to [`wait`]).
pub fn seq() -> u32 {
    SEQ.load(Ordering::SeqCst)
}

/// Waits until answers came after `seen` ([`seq`]) or `max` passed;
/// whether they came.
pub fn wait(seen: u32, max: Duration) -> bool {
    WAITERS.fetch_add(1, Ordering::SeqCst);
    let ts = libc::timespec { tv_sec: max.as_secs() as _, tv_nsec: max.subsec_nanos() as _ };
    // SAFETY: FUTEX_WAIT on a static word that lives for ever, with a
    // valid relative timeout; it returns at once if the word is no longer
    // `seen`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            SEQ.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &ts as *const libc::timespec,
        )
    };
    WAITERS.fetch_sub(1, Ordering::SeqCst);
    seq() != seen
}

/// Answers came: every thread waiting in [`wait`], and every readiness
/// call waiting with a [`Waiter`], looks again.
pub fn came() {
    SEQ.fetch_add(1, Ordering::SeqCst);
    ring_pollers();
    if WAITERS.load(Ordering::SeqCst) > 0 {
        // SAFETY: FUTEX_WAKE on a static word, no other pointers.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                SEQ.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                i32::MAX,
            )
        };
    }
}

/// The eventfds of `poll`/`select` calls waiting for a carried socket's
/// credits ([`Waiter`]); [`came`] writes to each. One list per process,
/// never freed once published: a child after `fork` makes its own (its
/// parent's lock may have been held by another thread at the fork).
struct Pollers {
    pid: u32,
    fds: Mutex<Vec<c_int>>,
}

/// The lists' total length (any process's), readable without a lock.
static POLLING: AtomicUsize = AtomicUsize::new(0);

fn pollers() -> MutexGuard<'static, Vec<c_int>> {
    static CURRENT: AtomicPtr<Pollers> = AtomicPtr::new(std::ptr::null_mut());
    let pid = crate::pid::get();
    loop {
        let p = CURRENT.load(Ordering::Acquire);
        // SAFETY: a published list is leaked, never freed.
        if let Some(list) = unsafe { p.as_ref() } {
            if list.pid == pid {
                return list.fds.lock().unwrap_or_else(|e| e.into_inner());
            }
        }
        let mine = Box::into_raw(Box::new(Pollers { pid, fds: Mutex::new(Vec::new()) }));
        match CURRENT.compare_exchange(p, mine, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => POLLING.store(0, Ordering::SeqCst),
            // SAFETY: `mine` came from Box::into_raw and was not published.
            Err(_) => drop(unsafe { Box::from_raw(mine) }),
        }
    }
}

/// A readiness call's sound for credits: an eventfd that [`came`] makes
/// readable, which the call polls beside the program's descriptors. The
/// kernel socket of a carried connection is writable whatever its ring
/// holds, and credits land without a sound, so without it the call could
/// only look at the ring again and again (`docs/sockets.md`, "Writing").
///
/// Made before the call asks for its credits (`WANT`): an answer that
/// comes after the ask finds it registered. One per waiting call, so a
/// call that wakes takes nothing from another (a shared one would have
/// to be emptied by someone, and another waiter could miss it).
pub struct Waiter(c_int);

impl Waiter {
    pub fn new() -> Option<Waiter> {
        // SAFETY: eventfd(2), no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return None;
        }
        let mut p = pollers();
        p.push(fd);
        POLLING.store(p.len(), Ordering::SeqCst);
        Some(Waiter(fd))
    }

    pub fn fd(&self) -> c_int {
        self.0
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut p = pollers();
        p.retain(|&x| x != self.0);
        POLLING.store(p.len(), Ordering::SeqCst);
        // Closed under the lock: `came` never writes to a number that is
        // reused meanwhile.
        // SAFETY: close(2) of our own eventfd, taken off the list.
        unsafe { crate::real::close(self.0) };
    }
}

/// Makes every [`Waiter`] readable.
fn ring_pollers() {
    if POLLING.load(Ordering::SeqCst) == 0 {
        return;
    }
    let one = 1u64.to_ne_bytes();
    for &fd in pollers().iter() {
        // SAFETY: write(2) of 8 bytes to one of our eventfds (registered,
        // so not closed yet), straight to the kernel.
        unsafe { libc::syscall(libc::SYS_write, fd, one.as_ptr(), one.len()) };
    }
}
