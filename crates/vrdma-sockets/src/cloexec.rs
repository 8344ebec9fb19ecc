//! The program's own view of `FD_CLOEXEC` on descriptors whose real flag
//! this library forces.
//!
//! A carried connection's descriptors are made close-on-exec for real
//! ([`crate::table::set_cloexec`]): an exec'd program must never get the
//! raw socket under the rings. But before an exec the library demotes a
//! carried connection the program wants its exec'd program to inherit
//! (`crate::exec`), and then gives the real flag back: so what the
//! program asked for is kept here, per descriptor, from the moment its
//! real flag was forced (its `F_SETFD` calls since then included).
//! `F_GETFD` still answers the real flag (close-on-exec while carried).
//! A descriptor absent here has the real flag the program asked for.

use std::cell::RefCell;
use std::sync::{Mutex, MutexGuard, Once};

use libc::c_int;
use rustc_hash::FxHashMap as HashMap;

/// Descriptors whose real flag is forced: whether the program asked for
/// close-on-exec.
static FORCED: Mutex<Option<HashMap<c_int, bool>>> = Mutex::new(None);

type Map = MutexGuard<'static, Option<HashMap<c_int, bool>>>;

fn map() -> Map {
    FORCED.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The lock, held by the forking thread across `fork` (as the table's).
    static HELD: RefCell<Option<Map>> = const { RefCell::new(None) };
}

/// A child of a fork inherits this map with the lock free (another
/// thread of the parent may hold it for a moment): the forking thread
/// takes it before, and both sides release it after.
fn hold_across_fork() {
    extern "C" fn prepare() {
        let g = map();
        let _ = HELD.try_with(|h| *h.borrow_mut() = Some(g));
    }
    extern "C" fn release() {
        let _ = HELD.try_with(|h| h.borrow_mut().take());
    }
    static ONCE: Once = Once::new();
    // SAFETY: handlers that take and release a lock in the forking thread
    // and do not unwind.
    ONCE.call_once(|| unsafe {
        libc::pthread_atfork(Some(prepare), Some(release), Some(release));
    });
}

/// The real flag of `fd` is forced on now; `program` is what the program
/// asked for. A descriptor already forced keeps its record unless the
/// program set its flag again (`Some`).
pub fn forced(fd: c_int, program: Option<bool>) {
    hold_across_fork();
    let mut m = map();
    let m = m.get_or_insert_with(HashMap::default);
    match program {
        Some(p) => {
            m.insert(fd, p);
        }
        None => {
            m.entry(fd).or_insert(false);
        }
    }
}

/// What the program asked for on `fd`, if its real flag is forced.
pub fn program_view(fd: c_int) -> Option<bool> {
    map().as_ref().and_then(|m| m.get(&fd).copied())
}

/// The program closed `fd` (or `dup2`ed over it): its record goes.
pub fn forget(fd: c_int) {
    if let Some(m) = map().as_mut() {
        m.remove(&fd);
    }
}

/// Whether a program exec'd now would get `fd`, as this program sees it.
pub fn inherited(fd: c_int) -> bool {
    match program_view(fd) {
        Some(cloexec) => !cloexec,
        None => !crate::table::is_cloexec(fd),
    }
}

/// Gives `fd` its real flag back (its connection is plain TCP now): what
/// the program asked for.
pub fn restore(fd: c_int) {
    let p = map().as_mut().and_then(|m| m.remove(&fd));
    if p == Some(false) {
        // SAFETY: fcntl(2) flag calls on a descriptor of the program's.
        unsafe {
            let f = crate::real::fcntl(fd, libc::F_GETFD, 0);
            if f >= 0 {
                crate::real::fcntl(fd, libc::F_SETFD, (f & !libc::FD_CLOEXEC) as libc::c_ulong);
            }
        }
    }
}

/// Every descriptor whose real flag is forced.
pub fn all() -> Vec<c_int> {
    map().as_ref().map(|m| m.keys().copied().collect()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real_cloexec(fd: c_int) -> bool {
        // SAFETY: fcntl(2) F_GETFD on a descriptor of the test's.
        unsafe { libc::fcntl(fd, libc::F_GETFD) & libc::FD_CLOEXEC != 0 }
    }

    #[test]
    fn a_forced_flag_keeps_what_the_program_asked_for_and_gives_it_back() {
        let mut p = [0; 2];
        // SAFETY: pipe(2) into an array of two.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        let (a, b) = (p[0], p[1]);
        // The program's flag clear (inherited): forced on, remembered.
        crate::table::set_cloexec(a);
        assert!(real_cloexec(a));
        assert!(inherited(a));
        // The program asks for close-on-exec later: not inherited.
        forced(a, Some(true));
        assert!(!inherited(a));
        forced(a, Some(false));
        // Given back: the real flag is the program's again.
        restore(a);
        assert!(!real_cloexec(a));
        assert_eq!(program_view(a), None);
        // A flag the program set itself is not recorded, and stays.
        // SAFETY: fcntl(2) F_SETFD on a descriptor of the test's.
        unsafe { libc::fcntl(b, libc::F_SETFD, libc::FD_CLOEXEC) };
        crate::table::set_cloexec(b);
        assert_eq!(program_view(b), None);
        assert!(!inherited(b));
        restore(b);
        assert!(real_cloexec(b));
        // A closed descriptor's record goes.
        crate::table::set_cloexec(a);
        forget(a);
        assert_eq!(program_view(a), None);
        // SAFETY: closes the test's pipe.
        unsafe {
            libc::close(a);
            libc::close(b);
        }
    }
}
