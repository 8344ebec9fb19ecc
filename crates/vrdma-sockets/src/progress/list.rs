//! The progress thread's list and its wake-up rule, without locks,
//! condvars, sockets or threads (the caller, `progress.rs`, holds the
//! list's lock around every call here and owns the condvar).
//!
//! Why a type of its own: the rule is what decides whether a writer's
//! connection is ever looked at again, and a slip in it is a lost
//! wake-up that shows only by chance (a carried `pgbench -i` hung about
//! once in twenty runs before 12f49b0). Kept apart from `Link`, every
//! interleaving that matters can be played step by step in a unit test
//! (`progress/tests.rs`), each step one hold of the lock.
//!
//! The rule:
//!
//! - an entry is on the list exactly while its [`Entry::queued`] flag is
//!   set, seen under the lock; a writer sets the flag without the lock
//!   ([`claim`]: the hot path, one atomic swap) and takes the lock only
//!   when it was clear, to [`ProgressList::list`] the entry;
//! - the thread sleeps only on an empty list ([`ProgressList::may_sleep`]),
//!   and sets `idle` before every wait, first or after a wake-up: a
//!   writer that lists an entry while `idle` is set must notify
//!   ([`ProgressList::list`] says so, and clears it);
//! - an entry that drained leaves the list unless it still needs looks
//!   ([`ProgressList::drained`]); one it keeps is put back if a racing
//!   drain took it off, else its set flag would keep its writer from ever
//!   listing it again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::pace::Pace;

/// What the list asks of a connection.
pub(crate) trait Entry: Clone {
    /// The same connection (`Arc::ptr_eq` for a link).
    fn same(&self, other: &Self) -> bool;
    /// Set while the entry is on the list (under the list's lock); a
    /// writer that finds it set does not take the lock.
    fn queued(&self) -> &AtomicBool;
    /// Writes in flight, a write that found the ring full, or an answer
    /// to take: the thread must keep looking.
    fn needs_watch(&self) -> bool;
    /// Only the peer's answer is awaited, whose event wakes the thread.
    fn awaits_answer_only(&self) -> bool;
}

/// A writer's test, without the lock: whether `e` must be listed (its
/// flag was clear, and is set now). Sequentially consistent with
/// [`ProgressList::drained`]'s look at the flags `needs_watch` reads.
#[inline]
pub(crate) fn claim<T: Entry>(e: &T) -> bool {
    !e.queued().swap(true, Ordering::SeqCst)
}

/// The connections with writes in flight of one process, and whether
/// its thread sleeps on the condvar.
pub(crate) struct ProgressList<T> {
    /// The process that started the thread (0: none; a forked child sees
    /// its parent's).
    pid: u32,
    /// Connections with writes in flight (each with its flag set).
    links: Vec<T>,
    /// The thread waits on the condvar: a new entry must wake it.
    idle: bool,
}

impl<T: Entry> ProgressList<T> {
    /// No process's list yet.
    pub(crate) const fn new() -> Self {
        ProgressList { pid: 0, links: Vec::new(), idle: false }
    }

    /// Entries on the list.
    pub(crate) fn len(&self) -> usize {
        self.links.len()
    }

    /// Whether the thread is (about to be) waiting on the condvar.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> bool {
        self.idle
    }

    /// Whether `e` is on the list.
    #[cfg(test)]
    pub(crate) fn has(&self, e: &T) -> bool {
        self.links.iter().any(|x| x.same(e))
    }

    /// Makes the list `pid`'s: true where it was another's (first use, or
    /// a child after fork, which has no thread), so the caller starts a
    /// thread. The other process's entries are forgotten, not dropped:
    /// they are not this process's to drop (`crate::dev`).
    pub(crate) fn adopt(&mut self, pid: u32) -> bool {
        if self.pid == pid {
            return false;
        }
        std::mem::forget(std::mem::take(&mut self.links));
        self.pid = pid;
        self.idle = false;
        true
    }

    /// No thread could be started: the next writer tries again.
    pub(crate) fn abandon(&mut self) {
        self.pid = 0;
    }

    /// Puts `e` on the list if it is not there (its flag set by the
    /// caller), and says whether the caller must notify the condvar (the
    /// thread is idle; the flag is cleared with the notification).
    #[must_use]
    pub(crate) fn list(&mut self, e: &T) -> bool {
        if !self.links.iter().any(|x| x.same(e)) {
            self.links.push(e.clone());
        }
        std::mem::take(&mut self.idle)
    }

    /// `e` drained (nothing its looker saw left to do): it leaves the list
    /// unless something came since. Returns whether the caller must
    /// notify the condvar (an entry kept was put back while the thread
    /// sleeps).
    ///
    /// Two drains of one entry can race (the thread's, from its copy of
    /// the list, and a readiness call's flush): the earlier takes it off,
    /// a write posted meanwhile makes the later keep it, and its writer's
    /// [`claim`], coming after, finds the flag set and lists nothing. So
    /// an entry kept is listed again here if it is not there, in the
    /// process whose list it is (a forked child's look at its parent's
    /// list leaves it alone). Before 12f49b0 the flag stayed set without
    /// the entry: a writer that asked for credits was never answered
    /// (pgbench -i's COPY, `docs/sockets.md`).
    #[must_use]
    pub(crate) fn drained(&mut self, e: &T, pid: u32) -> bool {
        // Sequentially consistent with `claim` and the flags `needs_watch`
        // reads: either this look sees a flag set just now, or that
        // setter's `claim` sees the entry off the list and lists it.
        e.queued().swap(false, Ordering::SeqCst);
        if e.needs_watch() {
            e.queued().store(true, Ordering::Release);
            return self.pid == pid && self.list(e);
        }
        self.links.retain(|x| !x.same(e));
        false
    }

    /// The entries on the list now (none in a process whose list it is
    /// not: a forked child's is its parent's).
    pub(crate) fn snapshot(&self, pid: u32) -> Vec<T> {
        if self.pid != pid {
            return Vec::new();
        }
        self.links.clone()
    }

    /// Whether every entry only waits for its peer's answer (none: no):
    /// the thread then waits on the channel alone, with a slow look.
    pub(crate) fn quiet(&self) -> bool {
        !self.links.is_empty() && self.links.iter().all(|l| l.awaits_answer_only())
    }

    /// The thread's question before each look, and again each time it
    /// is woken: may it wait on the condvar now? Only on an empty list,
    /// once it lingered ([`Pace::lingered`]). `idle` is set before every
    /// wait, not only the first: a writer's notification clears it, and
    /// an entry drained before the woken thread took the lock back
    /// leaves the list empty again; with the flag left clear the next
    /// writer did not notify and the thread slept on a non-empty list
    /// (before 12f49b0). The caller holds the lock from this answer to
    /// its wait (`Condvar::wait` lets it go), so a writer either listed
    /// before (the list is not empty) or sees `idle` after.
    pub(crate) fn may_sleep(&mut self, pace: &Pace, now: Instant) -> bool {
        self.idle = self.links.is_empty() && pace.lingered(now);
        self.idle
    }

    /// Lets every entry go (the daemon is gone: completions never come;
    /// the program's own calls see the error).
    #[cfg(test)]
    pub(crate) fn clear(&mut self) {
        self.clear_except(|_| false);
    }

    /// As [`Self::clear`], keeping the entries `keep` says (an exec's
    /// resend still queued, `link/outq.rs`: it goes to the kernel socket,
    /// daemon or not, and nobody else pushes it).
    pub(crate) fn clear_except(&mut self, keep: impl Fn(&T) -> bool) {
        self.links.retain(|l| {
            let k = keep(l);
            if !k {
                l.queued().store(false, Ordering::Release);
            }
            k
        });
    }
}
