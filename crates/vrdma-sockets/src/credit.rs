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
//! At most one answer is owed at a time: the writer asks again only once
//! the last answer was taken (its receive reposted), so the two receives
//! posted per connection never run out (an answer finding none would
//! wait for the RNR timer and hold the reader's later writes back).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

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

/// Answers came: every thread waiting in [`wait`] looks again.
pub fn came() {
    SEQ.fetch_add(1, Ordering::SeqCst);
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
