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
//! alone (looking every [`QUIET_LOOK`] in case an answer never comes), so
//! a program idle on a full ring is not woken. Otherwise, once told of a
//! connection it looks every [`interval`], and
//! keeps looking for [`LINGER`] after the last one drained, so that a
//! steady exchange adds connections to its list without waking it; then
//! it sleeps on its condvar until the next. (Reaping on every write in a
//! thread of its own, woken each time, doubled a 64-byte round trip on 2
//! cores: `docs/sockets.md`.)

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::link::Link;

/// Connections on the list (any process's): 0 lets a readiness call pass
/// without a lock.
static LISTED: AtomicUsize = AtomicUsize::new(0);

/// The process whose list it is ([`Queue::pid`], readable without the
/// lock: a forked child must not take a lock its parent's thread may have
/// held at the fork just to learn that the list is not its own).
static OWNER: AtomicU32 = AtomicU32::new(0);

/// How long the thread keeps looking after its list emptied.
const LINGER: Duration = Duration::from_millis(20);

/// How often the thread looks while every connection on its list only
/// waits for its peer's answer ([`crate::credit`]), which wakes it.
const QUIET_LOOK: Duration = Duration::from_secs(1);

/// How often the thread looks at the connections with writes in flight.
fn interval() -> Duration {
    static D: OnceLock<Duration> = OnceLock::new();
    *D.get_or_init(|| {
        let us = std::env::var("VRDMA_SOCKETS_PROGRESS_US").ok().and_then(|s| s.parse().ok()).unwrap_or(500);
        Duration::from_micros(us)
    })
}

struct Queue {
    /// The process that started the thread (a forked child has none).
    pid: u32,
    /// Connections with writes in flight (each with its `queued` flag).
    links: Vec<Arc<Link>>,
    /// The thread waits on the condvar (a new connection must wake it).
    idle: bool,
}

fn queue() -> &'static (Mutex<Queue>, Condvar) {
    static Q: OnceLock<(Mutex<Queue>, Condvar)> = OnceLock::new();
    Q.get_or_init(|| (Mutex::new(Queue { pid: 0, links: Vec::new(), idle: false }), Condvar::new()))
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `link` has writes in flight: it is on the list until they landed.
pub fn watch(link: &Arc<Link>) {
    if link.queued.swap(true, Ordering::SeqCst) {
        return;
    }
    let (m, cv) = queue();
    let mut q = lock(m);
    let pid = crate::pid::get();
    if q.pid != pid {
        // First use, or a child after fork, which has no thread: the
        // parent's entries are not this process's to drop (see
        // `crate::dev`).
        std::mem::forget(std::mem::take(&mut q.links));
        LISTED.store(0, Ordering::Release);
        q.pid = pid;
        OWNER.store(pid, Ordering::Release);
        q.idle = false;
        if std::thread::Builder::new().name("vrdma-sockets".into()).spawn(run).is_err() {
            // No thread (the next write tries again): the program's next
            // call on the connection, or its close, reaps.
            q.pid = 0;
            OWNER.store(0, Ordering::Release);
            link.queued.store(false, Ordering::Release);
            return;
        }
    }
    list(&mut q, link, cv);
}

/// Puts `l` on the list if it is not there (under the list's lock, with
/// its `queued` flag set by the caller), and wakes an idle thread.
fn list(q: &mut Queue, l: &Arc<Link>, cv: &Condvar) {
    if !q.links.iter().any(|x| Arc::ptr_eq(x, l)) {
        q.links.push(l.clone());
        LISTED.store(q.links.len(), Ordering::Release);
    }
    if q.idle {
        q.idle = false;
        cv.notify_one();
    }
}

/// The connections on the list now (none in a forked child, whose list
/// is its parent's).
fn listed() -> Vec<Arc<Link>> {
    let q = lock(&queue().0);
    if q.pid != crate::pid::get() {
        return Vec::new();
    }
    q.links.clone()
}

/// Takes `l` off the list unless a write was posted since it drained.
///
/// `queued` set means "on the list", under the list's lock: a `watch`
/// that finds it set does not list the link again. So where the link
/// still needs watching this puts it back on the list if it is not
/// there: two `drained` of one link can race (the thread's, from its
/// copy of the list, and a readiness call's `flush_all`), and the later
/// one may find the link already taken off by the earlier. Keeping the
/// flag without the entry lost the link for good: its writer asked for
/// credits (`asked`, then `watch`, which saw the flag and returned), the
/// thread slept on an empty list instead of waiting for the answer's
/// event, and the writer in `poll` waited for ever with credits back
/// (pgbench -i's COPY, about one run in twenty, 2026-11-28).
fn drained(l: &Arc<Link>) {
    let (m, cv) = queue();
    let mut q = lock(m);
    // Sequentially consistent with `watch` and the flags `needs_watch`
    // reads: either this look sees a flag set just now, or that setter's
    // `watch` sees the link off the list and puts it back.
    l.queued.swap(false, Ordering::SeqCst);
    if l.needs_watch() {
        l.queued.store(true, Ordering::Release);
        if q.pid == crate::pid::get() {
            list(&mut q, l, cv);
        }
        return;
    }
    q.links.retain(|x| !Arc::ptr_eq(x, l));
    LISTED.store(q.links.len(), Ordering::Release);
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
    let mut last_busy = Instant::now();
    let mut rounds = 0u32;
    loop {
        {
            let mut q = lock(m);
            if q.links.is_empty() && last_busy.elapsed() > LINGER {
                // `idle` is set again before each wait: a `watch` clears it
                // when it notifies, and a link drained before this thread
                // took the lock back leaves the list empty again. With the
                // flag left clear, the next `watch` did not notify, and
                // this thread slept on a non-empty list: a writer waiting
                // for the answer to its ask for credits waited for ever
                // (pgbench -i's COPY under a loaded CPU, about one run in
                // ten, 2026-11-28).
                while q.links.is_empty() {
                    q.idle = true;
                    q = cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
                q.idle = false;
            }
        }
        // Only answers to wait for: no periodic look (an idle writer on a
        // full ring costs no wake-ups), only a slow one in case an
        // answer never comes.
        let quiet = {
            let links = listed();
            !links.is_empty() && links.iter().all(|l| l.awaits_answer_only())
        };
        let fired = wait_for_answers(if quiet { QUIET_LOOK } else { interval() });
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
        last_busy = Instant::now();
        for l in &links {
            if !l.progress() {
                drained(l);
            }
        }
        // Completions that never come (the daemon is gone): the list is
        // let go; the program's own calls see the error.
        rounds = rounds.wrapping_add(1);
        if rounds.is_multiple_of(1024) && crate::dev::dev().is_none_or(|d| d.ctx.daemon_gone()) {
            let mut q = lock(m);
            for l in q.links.drain(..) {
                l.queued.store(false, Ordering::Release);
            }
            LISTED.store(0, Ordering::Release);
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
