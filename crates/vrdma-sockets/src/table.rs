//! Which descriptors this library handles, and the per-thread guard that
//! makes its own calls pass through.
//!
//! Every interposed call asks [`get`] about its descriptor. A process that
//! carries nothing pays one atomic load ([`COUNT`] is 0); otherwise the
//! table's lock is held only to clone an `Arc` out, never across another
//! call, so a call made while handling one (the `vrdma` library writing a
//! doorbell, logging to stderr) finds the table free.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use libc::c_int;

use crate::listener::Listener;
use crate::stream::Stream;

/// A descriptor this library handles.
#[derive(Clone)]
pub enum Entry {
    /// Held for its drop, which unregisters the listener.
    #[allow(dead_code)]
    Listener(Arc<Listener>),
    Stream(Arc<Stream>),
}

/// Entries in the table: 0 lets every call pass through without a lock.
static COUNT: AtomicUsize = AtomicUsize::new(0);

fn table() -> MutexGuard<'static, HashMap<c_int, Entry>> {
    static T: OnceLock<Mutex<HashMap<c_int, Entry>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner())
}

pub fn get(fd: c_int) -> Option<Entry> {
    if fd < 0 || COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    table().get(&fd).cloned()
}

pub fn insert(fd: c_int, e: Entry) -> Option<Entry> {
    let mut t = table();
    let old = t.insert(fd, e);
    COUNT.store(t.len(), Ordering::Release);
    old
}

pub fn remove(fd: c_int) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut t = table();
    let old = t.remove(&fd);
    COUNT.store(t.len(), Ordering::Release);
    old
}

/// Removes every descriptor of `s` (it turned out plain TCP).
pub fn forget_stream(s: &Arc<Stream>) {
    let mut t = table();
    t.retain(|_, e| !matches!(e, Entry::Stream(x) if Arc::ptr_eq(x, s)));
    COUNT.store(t.len(), Ordering::Release);
}

/// The descriptors of `s`.
pub fn fds_of(s: &Arc<Stream>) -> Vec<c_int> {
    table()
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Stream(x) if Arc::ptr_eq(x, s)))
        .map(|(fd, _)| *fd)
        .collect()
}

/// Makes `fd` close-on-exec. A carried connection's descriptor must not
/// reach an exec'd program, which would read and write the raw socket
/// past the rings (its wake bytes as data, its bytes dropped as wake
/// bytes): there it is closed instead, a clean failure.
pub fn set_cloexec(fd: c_int) {
    // SAFETY: fcntl(2) flag calls on a descriptor of the caller's.
    unsafe {
        let f = crate::real::fcntl(fd, libc::F_GETFD, 0);
        if f >= 0 && f & libc::FD_CLOEXEC == 0 {
            crate::real::fcntl(fd, libc::F_SETFD, (f | libc::FD_CLOEXEC) as libc::c_ulong);
        }
    }
}

impl Entry {
    /// Whether it is a connection carried over vRDMA (negotiated).
    pub fn carried(&self) -> bool {
        matches!(self, Entry::Stream(s) if s.is_carried())
    }

    /// Whether this process may use it: a listener it made (a child
    /// after fork inherits its parent's entries, whose daemon connection
    /// it must neither use nor destroy: see [`crate::dev`]), a connection
    /// it drives or that nobody took yet ([`crate::owner`]).
    pub fn ours(&self) -> bool {
        match self {
            Entry::Listener(l) => l.pid == crate::pid::get(),
            Entry::Stream(s) => s.owner.may_use(),
        }
    }
}

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Held while this library handles a call: calls it makes meanwhile pass
/// straight to libc. `None` when already inside (or the thread is being
/// torn down), which means: pass through.
pub struct Guard(());

impl Guard {
    pub fn enter() -> Option<Guard> {
        INSIDE.try_with(|i| if i.replace(true) { None } else { Some(Guard(())) }).ok().flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|i| i.set(false));
    }
}

/// Runs `f` with `errno` as it was before (the daemon calls and the
/// bookkeeping around a libc call must not change what the caller sees).
pub fn keep_errno<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: errno is thread-local; reading and restoring it is sound.
    let saved = unsafe { *libc::__errno_location() };
    let r = f();
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved };
    r
}

pub fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

pub fn errno() -> c_int {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() }
}
