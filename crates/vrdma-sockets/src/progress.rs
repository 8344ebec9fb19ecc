//! Writes left in flight: who reaps their completions when the program
//! does not call on the connection again.
//!
//! A write returns once posted ([`Link::write`]); the wake protocol
//! (`docs/sockets.md`) reads the reader's arming only after the bytes
//! landed, so someone must look at the completion later. The connection's
//! next call does. A program that wrote and then waits elsewhere makes no
//! such call, and its peer would sleep on bytes that wait in its ring:
//!
//! - before it waits in `poll`, `ppoll`, `select`, `pselect` or
//!   `epoll_wait`/`epoll_pwait` (interposed, [`crate::readiness`]), every
//!   connection with writes in flight is flushed ([`flush_all`]): an event
//!   loop's peer is woken as soon as its bytes land;
//! - anywhere else (a blocking call on another descriptor, a sleep, a
//!   lock), a thread of the library's, one per process, started on the
//!   first write left in flight, reaps them within [`interval`] (500 µs
//!   by default, `VRDMA_SOCKETS_PROGRESS_US`).
//!
//! The same thread takes the answers of readers that give credits back
//! to a writer that asked for them ([`crate::credit`]): between its looks
//! it waits on the process's completion channel, not in a sleep, so a
//! writer blocked on a full ring (in a write, or in `epoll_wait` for
//! `EPOLLOUT`) goes on as soon as the credits landed, not at its next
//! look.
//!
//! The thread costs little while programs call back: it is not woken per
//! write. While every connection on its list only waits for an answer
//! (a writer on a full ring, nothing in flight), it waits on the channel
//! alone (looking every [`pace::QUIET_LOOK`] in case an answer never comes), so
//! a program idle on a full ring is not woken. Otherwise, once told of a
//! connection it looks every [`interval`], and
//! keeps looking for [`pace::LINGER`] after the last one drained, so that a
//! steady exchange adds connections to its list without waking it; then
//! it sleeps on its condvar until the next. (Reaping on every write in a
//! thread of its own, woken each time, doubled a 64-byte round trip on 2
//! cores: `docs/sockets.md`.)
//!
//! This file holds the lock, the condvar and the thread; what they
//! decide is in [`list`] (which connections stay listed, when the thread
//! may sleep, when a writer must notify: the `idle` flag) and [`pace`]
//! (linger, slow look, daemon check, with the time passed in), without
//! locks, sockets or threads, so that `progress/tests.rs` plays the
//! interleavings that matter step by step (the lost wake-up fixed in
//! 12f49b0 among them) instead of hoping a loaded `pgbench -i` hits them.

mod list;
mod pace;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::link::Link;
use list::{claim, Entry, ProgressList};
use pace::Pace;

/// Connections on the list (any process's): 0 lets a readiness call pass
/// without a lock.
static LISTED: AtomicUsize = AtomicUsize::new(0);

/// The process whose list it is (`ProgressList`'s pid, readable without
/// the lock: a forked child must not take a lock its parent's thread may
/// have held at the fork just to learn that the list is not its own).
static OWNER: AtomicU32 = AtomicU32::new(0);

/// How often the thread looks at the connections with writes in flight.
fn interval() -> Duration {
    static D: OnceLock<Duration> = OnceLock::new();
    *D.get_or_init(|| {
        let us = std::env::var("VRDMA_SOCKETS_PROGRESS_US").ok().and_then(|s| s.parse().ok()).unwrap_or(500);
        Duration::from_micros(us)
    })
}

impl Entry for Arc<Link> {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }
    fn queued(&self) -> &AtomicBool {
        &self.queued
    }
    fn needs_watch(&self) -> bool {
        Link::needs_watch(self)
    }
    fn awaits_answer_only(&self) -> bool {
        Link::awaits_answer_only(self)
    }
}

type Queue = ProgressList<Arc<Link>>;

fn queue() -> &'static (Mutex<Queue>, Condvar) {
    static Q: (Mutex<Queue>, Condvar) = (Mutex::new(ProgressList::new()), Condvar::new());
    &Q
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `link` has writes in flight: it is on the list until they landed.
pub fn watch(link: &Arc<Link>) {
    if !claim(link) {
        return;
    }
    let (m, cv) = queue();
    let mut q = lock(m);
    let pid = crate::pid::get();
    if q.adopt(pid) {
        // First use, or a child after fork, which has no thread.
        LISTED.store(0, Ordering::Release);
        OWNER.store(pid, Ordering::Release);
        if std::thread::Builder::new().name("vrdma-sockets".into()).spawn(run).is_err() {
            // No thread (the next write tries again): the program's next
            // call on the connection, or its close, reaps.
            q.abandon();
            OWNER.store(0, Ordering::Release);
            link.queued.store(false, Ordering::Release);
            return;
        }
    }
    let notify = q.list(link);
    LISTED.store(q.len(), Ordering::Release);
    if notify {
        cv.notify_one();
    }
}

/// The connections on the list now (none in a forked child, whose list
/// is its parent's).
fn listed() -> Vec<Arc<Link>> {
    lock(&queue().0).snapshot(crate::pid::get())
}

/// The connections on the list now, for the exit's flush of exec
/// resends still queued (`link/outq.rs`): none where the list is another
/// process's.
pub(crate) fn listed_now() -> Vec<Arc<Link>> {
    if OWNER.load(Ordering::Acquire) != crate::pid::get() {
        return Vec::new();
    }
    listed()
}

/// Takes `l` off the list unless a write was posted since it drained
/// (`ProgressList::drained`: one it keeps is put back if a racing drain
/// took it off).
fn drained(l: &Arc<Link>) {
    let (m, cv) = queue();
    let mut q = lock(m);
    let notify = q.drained(l, crate::pid::get());
    LISTED.store(q.len(), Ordering::Release);
    if notify {
        cv.notify_one();
    }
}

/// Before the program waits for readiness: every write in flight lands
/// and wakes its reader (`wait`), or, for a poll that does not wait, the
/// completions there are are reaped.
pub fn flush_all(wait: bool) {
    if LISTED.load(Ordering::Acquire) == 0 || OWNER.load(Ordering::Acquire) != crate::pid::get() {
        return;
    }
    for l in listed() {
        let more = if wait { l.flush_all_writes() } else { l.progress() };
        if !more {
            drained(&l);
        }
    }
}

fn run() {
    // Every call this thread makes goes straight to libc.
    let _g = crate::table::Guard::enter();
    // SAFETY: prctl(PR_SET_TIMERSLACK) on the calling thread, no pointers:
    // its sleeps last what they ask, not 50 µs more.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
    let (m, cv) = queue();
    let mut pace = Pace::new(Instant::now());
    loop {
        // Sleeps only on an empty list, `idle` set before each wait
        // (`ProgressList::may_sleep`); only answers to wait for: no
        // periodic look (an idle writer on a full ring costs no
        // wake-ups), only a slow one in case an answer never comes.
        let quiet = {
            let mut q = lock(m);
            while q.may_sleep(&pace, Instant::now()) {
                q = cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            q.quiet()
        };
        let fired = wait_for_answers(Pace::wait(quiet, interval()));
        let links = listed();
        if !fired.is_empty() {
            answers(&links, &fired);
        } else if quiet {
            // The slow look: whoever waits for credits looks again.
            for l in &links {
                l.note_slow_look();
            }
            crate::credit::came();
        }
        if links.is_empty() {
            continue;
        }
        let check = pace.busy(Instant::now());
        for l in &links {
            if !l.progress() {
                drained(l);
            }
        }
        // Completions that never come (the daemon is gone): the list is
        // let go; the program's own calls see the error. (Not an exec's
        // resend still queued: the kernel socket's, pushed here.)
        if check && crate::dev::dev().is_none_or(|d| d.ctx.daemon_gone()) {
            let mut q = lock(m);
            q.clear_except(|l| l.out_queued());
            LISTED.store(q.len(), Ordering::Release);
        }
    }
}

/// Waits `d` at most for events of the connections' receive CQs (the
/// peers' answers, [`crate::credit`]), and returns the CQs that fired;
/// sleeps `d` where the process has no channel.
fn wait_for_answers(d: Duration) -> Vec<u32> {
    let Some(ch) = crate::dev::dev().and_then(crate::credit::channel) else {
        std::thread::sleep(d);
        return Vec::new();
    };
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: ch.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ts = libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ };
    // SAFETY: ppoll(2) on one pollfd of ours and a valid timeout, no mask.
    let r = unsafe { crate::real::ppoll(&mut p, 1, &ts, std::ptr::null()) };
    let mut fired = Vec::new();
    if r <= 0 {
        return fired;
    }
    // Bounded: the channel's ring holds finitely many events.
    for _ in 0..4096 {
        match ch.get_cq_event(Some(Duration::ZERO)) {
            Ok(Some(cqn)) => fired.push(cqn),
            _ => break,
        }
    }
    if fired.is_empty() {
        // Readable with no event (a wake-up the channel takes as stale
        // after a while): not a spin on it, nor a whole interval asleep
        // (an answer may come meanwhile).
        crate::dev::debug("credit channel readable without an event");
        std::thread::sleep(d.min(Duration::from_micros(200)));
    }
    fired
}

/// The peers' answers on the CQs that `fired`: taken, and each connection
/// blocked on credits looks again: a write-blocked one gets `EPOLLOUT`
/// back if credits came (else asks again), and threads blocked in a
/// write wake up.
fn answers(links: &[Arc<Link>], fired: &[u32]) {
    for l in links {
        if !l.answer_cq().is_some_and(|c| fired.contains(&c)) {
            continue;
        }
        l.take_answers();
        if l.still_blocked() && l.ask_credits() == crate::link::Ask::Sent {
            // Credits that came before the new ask landed.
            let _ = l.still_blocked();
        }
    }
    crate::credit::came();
}
