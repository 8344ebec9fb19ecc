//! Whether a call may wait, asked of the descriptor only when it would.
//!
//! A socket call blocks unless it passed `MSG_DONTWAIT` or the descriptor
//! has `O_NONBLOCK`, which lives in the kernel's open file description
//! (shared by `dup`s and across `fork`, set by `fcntl`, `ioctl(FIONBIO)`,
//! `accept4` or `socket`), so the library does not keep a copy of it: it
//! asks (`fcntl(F_GETFL)`, a system call). Most writes on a carried
//! connection find room in the peer's ring at once and never need the
//! answer; asking on every write was about a quarter of a sender's CPU in
//! `sockperf throughput` (64-byte messages). So the question waits until
//! a call would wait, and is asked at most once per call.

use std::cell::Cell;

use libc::c_int;

use crate::real;

/// How one call on a descriptor treats waiting.
pub struct Blocking {
    fd: c_int,
    /// The call's own `MSG_DONTWAIT`.
    dontwait: bool,
    /// The descriptor's answer, once asked.
    asked: Cell<Option<bool>>,
}

impl Blocking {
    /// A call on `fd`, with `MSG_DONTWAIT` or without.
    pub fn of(fd: c_int, dontwait: bool) -> Blocking {
        Blocking { fd, dontwait, asked: Cell::new(None) }
    }

    /// Whether the call must not wait: `MSG_DONTWAIT`, or `O_NONBLOCK` on
    /// the descriptor (asked the first time only).
    pub fn nonblocking(&self) -> bool {
        if self.dontwait {
            return true;
        }
        if let Some(nb) = self.asked.get() {
            return nb;
        }
        // SAFETY: F_GETFL takes no argument.
        let fl = unsafe { real::fcntl(self.fd, libc::F_GETFL, 0) };
        let nb = fl >= 0 && fl & libc::O_NONBLOCK != 0;
        self.asked.set(Some(nb));
        nb
    }

    /// Whether the descriptor was asked (for tests).
    #[cfg(test)]
    pub fn was_asked(&self) -> bool {
        self.fd >= 0 && self.asked.get().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn the_descriptor_is_asked_once_and_only_when_needed() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        let b = Blocking::of(fd, false);
        assert!(!b.was_asked());
        assert!(!b.nonblocking());
        assert!(b.was_asked());
        // The answer is the call's: a change after the first question is
        // not seen by this call (the next call asks again).
        a.set_nonblocking(true).unwrap();
        assert!(!b.nonblocking());
        assert!(Blocking::of(fd, false).nonblocking());
        // MSG_DONTWAIT needs no question.
        let d = Blocking::of(fd, true);
        assert!(d.nonblocking());
        assert!(!d.was_asked());
    }
}
