//! This process's id, cached: the library asks for it in nearly every
//! interposed call (a child after `fork` must not use its parent's
//! connections, `crate::dev`), and glibc's `getpid` is a system call
//! (about 0.4 µs here; five of them per 64-byte round trip and side).
//!
//! The cache is set at load (`.init_array`) and, in a child made by
//! `fork`, by a `pthread_atfork` handler (the same handler gives the child empty
//! epoll registrations: `crate::epoll::forked`). A child made without glibc's fork
//! handlers (a raw `clone`, `_Fork`, or `vfork`) would see its parent's
//! id: `vfork` and `posix_spawn` children only `exec`, which loads the
//! library afresh (a `vfork` child settles the connections it hands on
//! first, and tells itself from its parent by the real id:
//! `crate::dev::call_before_exec`); a program that clones a process by
//! hand and uses its carried sockets in it is not supported.

use std::sync::atomic::{AtomicU32, Ordering};

static PID: AtomicU32 = AtomicU32::new(0);

/// The real id, by the system call (glibc caches nothing).
fn real() -> u32 {
    // SAFETY: getpid(2) takes no argument and cannot fail
    // (async-signal-safe).
    unsafe { libc::getpid() as u32 }
}

extern "C" fn forked() {
    // The child's own id at once (a child made by glibc's `fork` is never
    // a `vfork` child: its memory is its own).
    PID.store(real(), Ordering::SeqCst);
    crate::epoll::forked();
}

/// Registers [`forked`] as a child handler when the library is loaded,
/// before any thread of the program runs. (Registered lazily, under a
/// `Once`, at the first [`get`], a child forked while another thread was
/// inside that `Once` inherited it running and waited for ever at its own
/// first call; one forked between another thread's store of the id and
/// the handler's registration kept its parent's id. Both were seen in
/// this crate's parallel fork tests.)
///
/// The id is stored here too, once, at load: a `vfork` child shares its
/// parent's memory, so a lazy store from its first call (its `_exit`, its
/// exec's settling) would leave the parent with the child's id for good:
/// the parent would then take itself for a `vfork` child, set its closes
/// aside, and its peers would never read the end.
extern "C" fn register() {
    // The handler first: a thread that another library's constructor
    // started may fork between the two, and its child must store its own
    // id then, not keep the parent's.
    // SAFETY: registers a child handler that only stores to a static
    // atomic (async-signal-safe); no prepare or parent handler.
    unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    PID.store(real(), Ordering::SeqCst);
}

#[used]
#[link_section = ".init_array"]
static REGISTER: extern "C" fn() = register;

/// This process's id (its parent's in a `vfork` child): stored at load
/// and by the `fork` child handler, never here (a caller may be a `vfork`
/// child, whose store would be its parent's). Unset only before the
/// library's load ran: the real id, not stored.
pub fn get() -> u32 {
    match PID.load(Ordering::Acquire) {
        0 => real(),
        p => p,
    }
}

/// Whether this is a `vfork` child (made without glibc's fork handlers,
/// sharing its parent's memory until it execs): its real id is not the
/// cached one. A system call: for the descriptor calls, not the data
/// path.
pub fn vforked() -> bool {
    get() != std::process::id()
}

/// Runs `check` in a forked child and gives back its answer (a test's
/// way to look from the other side of a `fork`).
#[cfg(test)]
pub(crate) fn in_forked_child(check: impl FnOnce() -> bool) -> bool {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) into our array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fork(2) in a test; the child only runs `check`, writes one
    // byte to the pipe and leaves with _exit.
    match unsafe { libc::fork() } {
        0 => {
            let b = [check() as u8];
            // SAFETY: write(2) of one byte to our pipe, then _exit.
            unsafe {
                libc::write(fds[1], b.as_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        child => {
            assert!(child > 0);
            let mut b = [0u8; 1];
            // SAFETY: read(2) of one byte from our pipe, whose write end
            // is closed here first (a child killed before it answers, by
            // a test's alarm, then reads as no); waitpid on our child;
            // the pipe's two ends closed once.
            let got = unsafe {
                libc::close(fds[1]);
                let got = libc::read(fds[0], b.as_mut_ptr().cast(), 1);
                libc::waitpid(child, std::ptr::null_mut(), 0);
                libc::close(fds[0]);
                got
            };
            got == 1 && b[0] == 1
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_forked_child_gets_its_own_id() {
        let parent = super::get();
        assert_eq!(parent, std::process::id());
        let ok = super::in_forked_child(|| super::get() == std::process::id() && super::get() != parent);
        assert!(ok, "the child saw its parent's id");
        assert_eq!(super::get(), parent);
    }
}
