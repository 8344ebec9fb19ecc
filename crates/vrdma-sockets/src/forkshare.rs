//! Sharing a connection carried before a `fork`: who asks for its
//! demotion, and who does the driver's part (`docs/sockets.md`,
//! "Sharing a carried connection after fork"; the demotion itself:
//! `link/demote.rs`).
//!
//! After a fork only the driver may post on the connection's QP, and its
//! program may be blocked anywhere, or make no call at all: so a process
//! that forks while it drives carried connections starts a *watcher*
//! thread (its `pthread_atfork` parent handler), which looks at their
//! request words every millisecond and demotes the ones asked for. It
//! ends when none is left to watch. Another holder's call on such a
//! connection asks ([`request`]) and waits for the demotion, a bounded
//! time: a driver that is stopped, or gone, makes it fail with
//! `ECONNRESET`, the connection untouched.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

use libc::c_int;

use crate::owner::{D_DEMOTED, D_DEMOTING, D_DONE, D_FAILED, D_NONE, TCP};
use crate::stream::Stream;

/// The connections the watcher looks at.
static LIST: Mutex<Vec<Weak<Stream>>> = Mutex::new(Vec::new());
/// Whether the watcher runs.
static RUNNING: AtomicBool = AtomicBool::new(false);

fn list() -> std::sync::MutexGuard<'static, Vec<Weak<Stream>>> {
    LIST.lock().unwrap_or_else(|e| e.into_inner())
}

/// The list, for a fork handler: a child inherits the lock held if its
/// parent's watcher held it at the fork (it holds it only for a moment),
/// so a handler waits a while at most (`None`: no watching; a request
/// then times out with `ECONNRESET`, as for a stopped driver).
fn list_in_fork() -> Option<std::sync::MutexGuard<'static, Vec<Weak<Stream>>>> {
    for _ in 0..1000 {
        match LIST.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    None
}

/// Once a connection was carried: the fork handler.
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler with no pointers but the function;
        // it runs in the parent after each fork.
        unsafe { libc::pthread_atfork(Some(prepare), Some(forked), Some(child)) };
    });
}

/// Before a fork (in the process that forks; before the table's own
/// prepare handler takes its lock): the child will hold every carried
/// connection, once its handler ran ([`child`]).
extern "C" fn prepare() {
    let Some(_g) = crate::table::Guard::enter() else { return };
    for (_, s) in crate::table::streams() {
        if let (Some(_), Some(d)) = (s.link_now(), s.owner.demote()) {
            d.forking();
        }
    }
}

/// In the parent after a fork: every carried connection it drives may be
/// asked for by the child; the watcher looks at them.
extern "C" fn forked() {
    let Some(_g) = crate::table::Guard::enter() else { return };
    let mut added = false;
    for (_, s) in crate::table::streams() {
        if !s.owner.mine() {
            continue;
        }
        let (Some(l), Some(d)) = (s.link_now(), s.owner.demote()) else { continue };
        if !l.can_demote() {
            continue;
        }
        d.forked.store(1, Ordering::Release);
        let Some(mut w) = list_in_fork() else { return };
        if !w.iter().any(|x| std::ptr::eq(x.as_ptr(), Arc::as_ptr(&s))) {
            w.push(Arc::downgrade(&s));
            added = true;
        }
    }
    if added && !RUNNING.swap(true, Ordering::AcqRel) {
        let spawned = std::thread::Builder::new().name("vrdma-forkshare".into()).spawn(watch);
        if spawned.is_err() {
            // No watcher: requests time out (ECONNRESET), as for a stopped
            // driver; the next fork tries again.
            RUNNING.store(false, Ordering::Release);
        }
    }
}

/// In a child after a fork: it holds every connection carried in the
/// parent (the parent's close demotes rather than ends such a one while
/// the child may still hold it).
extern "C" fn child() {
    let Some(_g) = crate::table::Guard::enter() else { return };
    // The parent's watcher is not this process's, nor its list.
    RUNNING.store(false, Ordering::Release);
    if let Some(mut w) = list_in_fork() {
        w.clear();
    }
    let me = crate::pid::get();
    for (_, s) in crate::table::streams() {
        if let (Some(_), Some(d)) = (s.link_now(), s.owner.demote()) {
            d.hold(me);
        }
    }
}

/// This process lets `s` go (its close of its last descriptor, or an
/// exec, which closes its carried connections): the driver's close need
/// not demote it for this process.
pub fn leaving(s: &Stream) {
    if let Some(d) = s.owner.demote() {
        d.unhold(crate::pid::get());
    }
}

fn watch() {
    // Every call this thread makes goes straight to libc.
    let _g = crate::table::Guard::enter();
    loop {
        std::thread::sleep(Duration::from_millis(1));
        // (Every `Arc` taken here is dropped after the list's lock: the
        // last one runs the stream's drop, whose close may wait.)
        let mut dropped: Vec<Arc<Stream>> = Vec::new();
        let streams: Vec<Arc<Stream>> = {
            let mut w = list();
            w.retain(|x| match x.upgrade() {
                Some(s) => {
                    let keep = watched(&s);
                    dropped.push(s);
                    keep
                }
                None => false,
            });
            if w.is_empty() {
                RUNNING.store(false, Ordering::Release);
                drop(w);
                drop(dropped);
                return;
            }
            w.iter().filter_map(Weak::upgrade).collect()
        };
        drop(dropped);
        for s in streams {
            let Some(d) = s.owner.demote() else { continue };
            if d.req.load(Ordering::Acquire) == 0 {
                continue;
            }
            let Some(l) = s.link_now() else { continue };
            // A `riomap` made after the fork: not demoted (the request
            // times out, `ECONNRESET`).
            if !l.can_demote() {
                continue;
            }
            if d.state.compare_exchange(D_NONE, D_DEMOTING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                crate::dev::debug("another process asks for this connection: demoting it");
                l.demote_as_driver();
            }
        }
    }
}

/// Whether the watcher still looks at `s`: this process drives it, it
/// is not demoted yet, and another process may still hold it (a child
/// that exec'd or closed its copy does not).
fn watched(s: &Stream) -> bool {
    s.owner.mine()
        && s.owner.demote().is_some_and(|d| {
            d.state.load(Ordering::Acquire) == D_NONE
                && (d.held_elsewhere() || d.req.load(Ordering::Acquire) != 0)
        })
}

/// In a process that holds `s` and does not drive it, before it waits
/// for its readiness (`poll`, `select`, `epoll_wait`): asks the driver
/// to demote it, without waiting (the wait then sees the demoted
/// connection's readiness: the kernel socket's). A connection carried
/// before the fork may hold bytes that no wake byte announces (the
/// driver's reader had not armed): the peer's marker, which follows the
/// demotion, makes the socket readable.
pub fn nudge(s: &Stream) {
    let (Some(d), Some(l)) = (s.owner.demote(), s.link_now()) else { return };
    if l.may_ask() && d.state.load(Ordering::Acquire) == D_NONE {
        let _ = d.req.compare_exchange(0, crate::pid::get(), Ordering::AcqRel, Ordering::Acquire);
    }
}

/// In a process that holds `s` and does not drive it, at a call on it:
/// asks the driver to demote it and waits for that. `None`: it cannot be
/// asked for (not carried in this process's copy, a peer that does not
/// answer demotions, a page of the creator's own): the call fails with
/// `EIO`, as before. `Some(Ok)`: the call goes the demoted way.
pub fn request(s: &Arc<Stream>) -> Option<Result<(), c_int>> {
    let d = s.owner.demote()?;
    let l = s.link_now()?;
    if !l.may_ask() {
        return None;
    }
    let me = crate::pid::get();
    let bound = crate::link::demote_wait();
    let start = Instant::now();
    let mut asked = false;
    loop {
        match d.state.load(Ordering::Acquire) {
            D_DEMOTED | D_DONE => return Some(Ok(())),
            D_FAILED => return Some(Err(libc::ECONNRESET)),
            // The driver's own waits are bounded; twice the bound at most.
            D_DEMOTING if start.elapsed() > 2 * bound => return Some(Err(libc::ECONNRESET)),
            // A driver that died mid-demotion finishes nothing.
            D_DEMOTING
                if s.owner.driver() != crate::owner::FREE
                    && s.owner.driver() != TCP
                    && !crate::owner::exists(s.owner.driver()) =>
            {
                crate::dev::debug("the driver of this connection died while it demoted it: ECONNRESET");
                return Some(Err(libc::ECONNRESET));
            }
            D_DEMOTING => {}
            _ => {
                let driver = s.owner.driver();
                if driver == TCP {
                    return Some(Ok(()));
                }
                if !asked {
                    // Another holder's request is as good as this one's.
                    let _ = d.req.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire);
                    asked = true;
                }
                let gone = driver != crate::owner::FREE && !crate::owner::exists(driver);
                if gone || start.elapsed() > bound {
                    // Taken back unless the driver took it meanwhile (then
                    // it demotes: this call still fails, the next ones
                    // go on).
                    let _ = d.req.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
                    crate::dev::debug(&format!(
                        "the driver of this connection (process {driver}) {} its demotion: ECONNRESET",
                        if gone { "is gone before" } else { "did not answer" }
                    ));
                    return Some(Err(libc::ECONNRESET));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
