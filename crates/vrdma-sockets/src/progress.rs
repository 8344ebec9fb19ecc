//! The progress thread: reaps the completions of writes that a program
//! left in flight and did not come back for.
//!
//! A write returns once posted ([`Link::write`]); the wake protocol
//! (`docs/sockets.md`) reads the reader's arming only after the bytes
//! landed, so someone must look at the completion later. The connection's
//! next call does; a program that wrote its answer and went to wait in
//! `poll`/`epoll_wait` (not interposed) makes no such call, and its peer
//! would sleep on bytes that wait in its ring. This thread covers that
//! case: one per process, started on the first write left in flight,
//! asleep while no connection has writes in flight.
//!
//! It lets the program's own calls go first: once told of a connection it
//! sleeps [`DELAY`] (the timer slack of this thread is set to 1 µs, so the
//! sleep is that long, not 50 µs more) and then reaps only connections
//! whose lock it gets at once. A request/response or streaming program
//! reaps its completions itself in its next call and never has this
//! thread run for long; a program in `poll` sees its peer woken at most
//! [`DELAY`] plus the completion's own time later.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crate::link::Link;

/// How long the thread leaves a connection to its program's next call.
const DELAY: Duration = Duration::from_micros(20);

struct Queue {
    /// The process that started the thread (a forked child has none).
    pid: u32,
    links: Vec<Arc<Link>>,
    /// The thread waits on the condvar.
    idle: bool,
}

fn queue() -> &'static (Mutex<Queue>, Condvar) {
    static Q: OnceLock<(Mutex<Queue>, Condvar)> = OnceLock::new();
    Q.get_or_init(|| (Mutex::new(Queue { pid: 0, links: Vec::new(), idle: false }), Condvar::new()))
}

fn lock(m: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `link` has writes in flight: the thread watches it until they landed.
pub fn watch(link: &Arc<Link>) {
    if link.queued.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return;
    }
    let (m, cv) = queue();
    let mut q = lock(m);
    let pid = std::process::id();
    if q.pid != pid {
        // First use, or a child after fork, which has no thread: the
        // parent's entries are not this process's to drop (see
        // `crate::dev`).
        std::mem::forget(std::mem::take(&mut q.links));
        q.pid = pid;
        q.idle = false;
        if std::thread::Builder::new().name("vrdma-sockets".into()).spawn(run).is_err() {
            // No thread: the program's next call (or close) reaps.
            q.pid = 0;
            link.queued.store(false, std::sync::atomic::Ordering::Release);
            return;
        }
    }
    q.links.push(link.clone());
    if q.idle {
        cv.notify_one();
    }
}

fn run() {
    // Every call this thread makes goes straight to libc.
    let _g = crate::table::Guard::enter();
    // SAFETY: prctl(PR_SET_TIMERSLACK) on the calling thread, no pointers.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
    let (m, cv) = queue();
    let mut mine: Vec<Arc<Link>> = Vec::new();
    let mut rounds = 0u32;
    loop {
        {
            let mut q = lock(m);
            while mine.is_empty() && q.links.is_empty() {
                q.idle = true;
                q = cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            q.idle = false;
            let fresh = !q.links.is_empty();
            mine.append(&mut q.links);
            drop(q);
            if fresh {
                std::thread::sleep(DELAY);
            }
        }
        mine.retain(|l| {
            if l.progress() {
                return true;
            }
            // Done; a write posted meanwhile either saw the flag still set
            // (and is seen by the look below) or sets it again itself.
            l.queued.store(false, std::sync::atomic::Ordering::Release);
            l.in_flight() && !l.queued.swap(true, std::sync::atomic::Ordering::AcqRel)
        });
        if mine.is_empty() {
            rounds = 0;
            continue;
        }
        rounds += 1;
        // Completions that never come (the daemon is gone): give up on
        // them; the program's own calls see the error.
        if rounds.is_multiple_of(4096) && crate::dev::dev().is_none_or(|d| d.ctx.daemon_gone()) {
            for l in mine.drain(..) {
                l.queued.store(false, std::sync::atomic::Ordering::Release);
            }
            continue;
        }
        if rounds < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(DELAY);
        }
    }
}
