//! Which descriptors this library handles, and the per-thread guard that
//! makes its own calls pass through.
//!
//! Every interposed call asks [`get`] about its descriptor. A process that
//! carries nothing pays one atomic load ([`COUNT`] is 0); otherwise the
//! table's lock is held only to clone an `Arc` out, never across another
//! call, so a call made while handling one (the `vrdma` library writing a
//! doorbell, logging to stderr) finds the table free.

use rustc_hash::FxHashMap as HashMap;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock};

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
    T.get_or_init(|| Mutex::new(HashMap::default())).lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The table's lock, held by the forking thread across `fork`.
    static HELD: RefCell<Option<MutexGuard<'static, HashMap<c_int, Entry>>>> = const { RefCell::new(None) };
}

/// A forked child has only the thread that forked, and uses the table it
/// inherited (the connections it shares with its parent, `crate::owner`):
/// a lock another thread of the parent held at that moment would stay
/// held in the child for ever. So the forking thread takes the lock
/// before `fork` (waiting for the holder, who never holds it across a
/// call) and both sides release it after.
fn hold_across_fork() {
    extern "C" fn prepare() {
        // The `vfork` view's lock first (always taken before the table's).
        crate::exec::vfork::hold_across_fork();
        let g = table();
        // During the thread's teardown the guard is dropped at once.
        let _ = HELD.try_with(|h| *h.borrow_mut() = Some(g));
    }
    extern "C" fn release() {
        let _ = HELD.try_with(|h| h.borrow_mut().take());
        crate::exec::vfork::release_after_fork();
    }
    static ONCE: Once = Once::new();
    // SAFETY: handlers that take and release a lock in the forking thread
    // and do not unwind.
    ONCE.call_once(|| unsafe {
        libc::pthread_atfork(Some(prepare), Some(release), Some(release));
    });
}

pub fn get(fd: c_int) -> Option<Entry> {
    if fd < 0 || COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    table().get(&fd).cloned()
}

/// Whether `fd` has an entry (no lock while the table is empty).
pub fn contains(fd: c_int) -> bool {
    fd >= 0 && COUNT.load(Ordering::Acquire) != 0 && table().contains_key(&fd)
}

pub fn insert(fd: c_int, e: Entry) -> Option<Entry> {
    hold_across_fork();
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

/// Removes `fd`'s entry if it is `e` (see [`Entry::same`]).
pub fn remove_if_same(fd: c_int, e: &Entry) -> Option<Entry> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut t = table();
    let old = match t.get(&fd) {
        Some(x) if x.same(e) => t.remove(&fd),
        _ => None,
    };
    COUNT.store(t.len(), Ordering::Release);
    old
}

/// Removes every descriptor of `s` (it turned out plain TCP).
pub fn forget_stream(s: &Arc<Stream>) {
    let mut t = table();
    t.retain(|_, e| !matches!(e, Entry::Stream(x) if Arc::ptr_eq(x, s)));
    COUNT.store(t.len(), Ordering::Release);
}

/// Every connection's descriptors, with their connection.
pub fn streams() -> Vec<(c_int, Arc<Stream>)> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    table()
        .iter()
        .filter_map(|(fd, e)| match e {
            Entry::Stream(s) => Some((*fd, s.clone())),
            Entry::Listener(_) => None,
        })
        .collect()
}

/// Whether `fd` is close-on-exec (or not open).
pub fn is_cloexec(fd: c_int) -> bool {
    // SAFETY: fcntl(2) F_GETFD takes no argument.
    let f = unsafe { crate::real::fcntl(fd, libc::F_GETFD, 0) };
    f < 0 || f & libc::FD_CLOEXEC != 0
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
            // The program's own flag is kept: an exec may give the
            // connection after all, demoted (`crate::exec`).
            crate::cloexec::forced(fd, Some(false));
            crate::real::fcntl(fd, libc::F_SETFD, (f | libc::FD_CLOEXEC) as libc::c_ulong);
        }
    }
}

impl Entry {
    /// Whether it is a connection carried over vRDMA (negotiated).
    pub fn carried(&self) -> bool {
        matches!(self, Entry::Stream(s) if s.is_carried())
    }

    /// Whether both name the same listener or connection.
    pub fn same(&self, other: &Entry) -> bool {
        match (self, other) {
            (Entry::Listener(a), Entry::Listener(b)) => Arc::ptr_eq(a, b),
            (Entry::Stream(a), Entry::Stream(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
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

    /// A connection another process settles now before its exec
    /// ([`crate::owner::Owner::settled_elsewhere`]).
    pub fn settled_elsewhere(&self) -> bool {
        matches!(self, Entry::Stream(s) if s.owner.settled_elsewhere())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listener::Listener;

    /// A thread that looks the table up without pause while this one
    /// forks: every child must find the table free (before the fork
    /// handlers, a child forked while the other thread held the lock
    /// waited for ever).
    #[test]
    fn a_child_forked_while_another_thread_looks_up_finds_the_table_free() {
        let addr = "127.0.0.1:1".parse().unwrap();
        let fd = 1 << 20;
        // Forgotten, never dropped (its drop would ask a daemon).
        std::mem::forget(insert(fd, Entry::Listener(Arc::new(Listener { addrs: vec![addr], pid: 0 }))));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(e) = get(fd) {
                    std::mem::forget(e);
                }
            }
        });
        let mut stuck = 0;
        for _ in 0..100 {
            // SAFETY: fork(2) in a test; the child looks the table up and
            // leaves with _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let found = get(fd).map(std::mem::forget).is_some();
                // SAFETY: _exit(2) in the child.
                unsafe { libc::_exit(if found { 0 } else { 2 }) };
            }
            assert!(pid > 0);
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut status = 0;
            loop {
                // SAFETY: waitpid(2) on our child.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{status:#x}");
                    break;
                }
                if std::time::Instant::now() > end {
                    stuck += 1;
                    // SAFETY: kill(2) and waitpid(2) on our child, not yet reaped.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if stuck > 0 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        std::mem::forget(remove(fd));
        assert_eq!(stuck, 0, "a child found the table's lock held for ever");
    }
}
