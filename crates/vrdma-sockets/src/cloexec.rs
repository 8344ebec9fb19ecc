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
//!
//! Each record holds the socket's inode too: a close the library does not
//! see (`close_range`, `closefrom`, a raw system call) leaves a record
//! behind, and a descriptor that reuses the number is not that socket: a
//! record whose inode is not the descriptor's is stale, and dropped, never
//! applied (it would clear `FD_CLOEXEC` on an unrelated descriptor).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

use libc::c_int;
use rustc_hash::FxHashMap as HashMap;

/// A file's identity: its device and inode numbers.
type Ino = (u64, u64);

/// A record: whether the program asked for close-on-exec, and the
/// socket's identity then.
type Record = (bool, Ino);

/// Records held (0: [`forget`] and [`knows`] take no lock: they run at
/// every close and `F_SETFD` of every program).
static LEN: AtomicUsize = AtomicUsize::new(0);

fn publish(m: &HashMap<c_int, Record>) {
    LEN.store(m.len(), Ordering::Release);
}

/// Whether `fd` has a record.
pub fn knows(fd: c_int) -> bool {
    LEN.load(Ordering::Acquire) != 0 && map().as_ref().is_some_and(|m| m.contains_key(&fd))
}

/// Descriptors whose real flag is forced, with their records.
static FORCED: Mutex<Option<HashMap<c_int, Record>>> = Mutex::new(None);

type Map = MutexGuard<'static, Option<HashMap<c_int, Record>>>;

/// A `vfork` child's changes to the records (it shares this memory with
/// its parent, not its descriptors): each record's value before the
/// child's first change, put back by [`end_vfork`] before its exec.
static VFORK: Mutex<Vec<(c_int, Option<Record>)>> = Mutex::new(Vec::new());

/// Whether [`VFORK`] holds anything: looked at first, without its lock
/// (a child's `_exit` takes no lock unless it changed a record).
static VFORK_KEPT: AtomicBool = AtomicBool::new(false);

/// Whether a `vfork` child's changes to the records are kept.
pub fn vfork_kept() -> bool {
    VFORK_KEPT.load(Ordering::Acquire)
}

/// In a `vfork` child: keeps `fd`'s record as the parent has it, once.
fn touch(m: &HashMap<c_int, Record>, fd: c_int) {
    if crate::pid::vforked() {
        let mut v = VFORK.lock().unwrap_or_else(|e| e.into_inner());
        if !v.iter().any(|&(f, _)| f == fd) {
            v.push((fd, m.get(&fd).copied()));
            VFORK_KEPT.store(true, Ordering::Release);
        }
    }
}

/// A `vfork` child about to exec: its parent's records as they were.
pub fn end_vfork() {
    if !vfork_kept() {
        return;
    }
    let v = {
        let mut g = VFORK.lock().unwrap_or_else(|e| e.into_inner());
        VFORK_KEPT.store(false, Ordering::Release);
        std::mem::take(&mut *g)
    };
    if v.is_empty() {
        return;
    }
    let mut m = map();
    let m = m.get_or_insert_with(HashMap::default);
    for (fd, r) in v {
        match r {
            Some(r) => {
                m.insert(fd, r);
            }
            None => {
                m.remove(&fd);
            }
        }
    }
    publish(m);
}

/// The identity of what `fd` is now (device and inode), if it is open.
pub(crate) fn inode(fd: c_int) -> Option<Ino> {
    // SAFETY: a zeroed stat is valid; fstat(2) writes into ours.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

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
    let Some(ino) = inode(fd) else { return };
    let mut m = map();
    let m = m.get_or_insert_with(HashMap::default);
    touch(m, fd);
    match program {
        Some(p) => {
            m.insert(fd, (p, ino));
        }
        None => {
            let r = m.entry(fd).or_insert((false, ino));
            if r.1 != ino {
                *r = (false, ino);
            }
        }
    }
    publish(m);
}

/// The record of `fd` if it is still that socket's (a stale one goes).
fn current(m: &mut HashMap<c_int, Record>, fd: c_int) -> Option<bool> {
    let (p, ino) = *m.get(&fd)?;
    if inode(fd) == Some(ino) {
        return Some(p);
    }
    touch(m, fd);
    m.remove(&fd);
    publish(m);
    None
}

/// What the program asked for on `fd`, if its real flag is forced.
pub fn program_view(fd: c_int) -> Option<bool> {
    map().as_mut().and_then(|m| current(m, fd))
}

/// The program closed `fd` (or `dup2`ed over it): its record goes.
pub fn forget(fd: c_int) {
    if LEN.load(Ordering::Acquire) == 0 {
        return;
    }
    if let Some(m) = map().as_mut() {
        if m.contains_key(&fd) {
            touch(m, fd);
            m.remove(&fd);
            publish(m);
        }
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
    let p = map().as_mut().and_then(|m| {
        let p = current(m, fd);
        if p.is_some() {
            touch(m, fd);
            m.remove(&fd);
            publish(m);
        }
        p
    });
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

    #[test]
    fn a_record_left_by_an_unseen_close_is_not_applied_to_the_number_reused() {
        let pipe = || {
            let mut p = [0; 2];
            // SAFETY: pipe(2) into an array of two.
            assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
            p
        };
        let (p, q, r) = (pipe(), pipe(), pipe());
        let a = p[0];
        crate::table::set_cloexec(a);
        assert_eq!(program_view(a), Some(false));
        // Closed where the library does not see it; the number now names
        // another pipe (another inode), close-on-exec.
        // SAFETY: the test's descriptors.
        // (libc's calls, past the library's interposed ones.)
        // (dup3 onto `a` at once: no moment where a parallel test could
        // take the number.)
        unsafe {
            assert_eq!(crate::real::dup3(q[0], a, libc::O_CLOEXEC), a);
        }
        assert_eq!(program_view(a), None);
        // Again, with a record made for the second pipe: a restore after
        // the number went to a third one leaves the flag alone.
        forced(a, Some(false));
        // SAFETY: the test's descriptors.
        unsafe {
            assert_eq!(crate::real::dup3(r[0], a, libc::O_CLOEXEC), a);
        }
        restore(a);
        assert!(real_cloexec(a), "a stale record cleared the flag of another file");
        // SAFETY: closes the test's descriptors.
        unsafe {
            for fd in [a, p[1], q[0], q[1], r[0], r[1]] {
                libc::close(fd);
            }
        }
    }
}
