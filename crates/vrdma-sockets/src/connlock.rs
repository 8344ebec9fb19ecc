//! The locks of a connection (its send and receive state, its exec
//! resend's queue, its phase), whose holder's library lines are held back
//! until this thread holds none of them.
//!
//! Why: a line of the library's own is written to descriptor 2 through
//! the library (`crate::dev`), and descriptor 2 may be the very connection
//! whose lock this thread holds (an inetd-style server's stderr is its
//! socket). Its write would take that lock again and wait for it for
//! ever. Every guard counts itself in a per-thread depth
//! (`crate::dev::hold`); a line said while the depth is not 0 is kept and
//! said by the guard whose drop brings it back to 0, after the lock is
//! let go. The depth is per thread, so a guard must not move to another
//! thread: it is `!Send`, as `MutexGuard` is.

use std::sync::{Mutex, MutexGuard, TryLockError};

/// A connection's lock (poison is ignored: the state is plain data, and
/// a panicking call is a bug reported on its own).
#[derive(Debug, Default)]
pub(crate) struct ConnLock<T>(Mutex<T>);

/// A [`ConnLock`] held (see the module's docs).
pub(crate) struct ConnGuard<'a, T> {
    g: Option<MutexGuard<'a, T>>,
}

/// [`ConnLock::try_lock`] found it held.
#[derive(Debug)]
pub(crate) struct Busy;

impl<T> ConnLock<T> {
    pub(crate) const fn new(t: T) -> Self {
        Self(Mutex::new(t))
    }

    /// The state, without locking (`&mut`: nobody else can hold it).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for the lock.
    pub(crate) fn lock(&self) -> ConnGuard<'_, T> {
        let g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        ConnGuard::hold(g)
    }

    /// The lock if it is free now.
    pub(crate) fn try_lock(&self) -> Result<ConnGuard<'_, T>, Busy> {
        match self.0.try_lock() {
            Ok(g) => Ok(ConnGuard::hold(g)),
            Err(TryLockError::Poisoned(p)) => Ok(ConnGuard::hold(p.into_inner())),
            Err(TryLockError::WouldBlock) => Err(Busy),
        }
    }
}

impl<'a, T> ConnGuard<'a, T> {
    fn hold(g: MutexGuard<'a, T>) -> Self {
        crate::dev::hold();
        Self { g: Some(g) }
    }
}

impl<T> std::ops::Deref for ConnGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.g.as_ref().expect("held until dropped")
    }
}

impl<T> std::ops::DerefMut for ConnGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.g.as_mut().expect("held until dropped")
    }
}

impl<T> Drop for ConnGuard<'_, T> {
    fn drop(&mut self) {
        // The lock first, then the lines (their write may take it).
        drop(self.g.take());
        crate::dev::let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line said under a connection's lock is said once every such
    /// lock of the thread is let go, with the lock free, and only then.
    #[test]
    fn a_line_said_under_a_connections_lock_waits_until_the_last_is_let_go() {
        static A: ConnLock<u32> = ConnLock::new(0);
        static B: ConnLock<u32> = ConnLock::new(0);
        let a = A.lock();
        let b = B.try_lock().expect("free");
        assert!(B.try_lock().is_err());
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        crate::dev::warn_once(&SAID, "vrdma-sockets unit test: a line under two connection locks");
        drop(b);
        assert_eq!(crate::dev::held_lines(), 1, "still held under A");
        drop(a);
        assert_eq!(crate::dev::held_lines(), 0, "said once A is let go");
        assert!(A.try_lock().is_ok());
    }

    /// A line said under a connection's lock in an exit handler (the
    /// exit's flush of a resend's queue) is said: the held lines have no
    /// thread-local destructor, which glibc runs before the exit handlers
    /// (review L1: such a warning was dropped). In a forked child, its
    /// descriptor 2 a pipe, the held list used once before as a rule.
    #[test]
    fn a_line_held_in_an_exit_handler_is_said() {
        extern "C" fn at_exit() {
            static L: ConnLock<u32> = ConnLock::new(0);
            static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let g = L.lock();
            crate::dev::warn_once(&SAID, "vrdma-sockets unit test: said at the exit");
            drop(g);
        }
        let mut pipe = [0; 2];
        // SAFETY: pipe(2) writes two descriptors into `pipe`.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: fork(2); the child uses only its own thread's state.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            static ONCE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            static L: ConnLock<u32> = ConnLock::new(0);
            // SAFETY: the child's own descriptors and exit handlers.
            unsafe {
                libc::dup2(pipe[1], 2);
                let g = L.lock();
                crate::dev::warn_once(&ONCE, "vrdma-sockets unit test: before");
                drop(g);
                libc::atexit(at_exit);
                libc::exit(0);
            }
        }
        // SAFETY: our copy of the child's end.
        unsafe { libc::close(pipe[1]) };
        let mut status = 0;
        // SAFETY: waitpid(2) on our child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            // SAFETY: read(2) into our buffer.
            let n = unsafe { libc::read(pipe[0], buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            got.extend_from_slice(&buf[..n as usize]);
        }
        // SAFETY: our end.
        unsafe { libc::close(pipe[0]) };
        let got = String::from_utf8_lossy(&got);
        assert!(got.contains("before") && got.contains("said at the exit"), "{got:?}");
    }
}
