//! `TCP_NODELAY` on a carried connection: on in the kernel, the
//! program's in its own view.
//!
//! A carried connection's kernel socket carries only wake bytes, one each
//! time a reader that armed gets bytes, and each must go out at once. With
//! Nagle's algorithm a byte sent while an earlier one is unacked waits for
//! its ACK, which the peer's kernel may delay by up to 40 ms (both ends
//! then sleep: the reader for the byte, the writer for credits the reader
//! gives back only once woken). So the library makes the socket
//! `TCP_NODELAY` when the connection is carried ([`keep`]).
//!
//! The program's own bytes go through the ring, where the option means
//! nothing; but a program that clears it (or never set it, and reads it)
//! must neither turn Nagle back on for the wake bytes nor see a value it
//! did not set. On a carried connection the option is therefore the
//! program's view: the library remembers the program's value (at first
//! what the kernel had when the connection was carried: what the program
//! set before its first call, or what its listener passed on, 0 by
//! default), `getsockopt` reports it, and `setsockopt` records it and
//! leaves the kernel's on. On any other connection (plain TCP, not
//! decided yet) both go to the kernel, as they would without the library.
//!
//! The kernel still checks each call as it would (a short option is
//! `EINVAL`, a bad pointer `EFAULT`): it gets the program's arguments
//! first. A `setsockopt` that clears the option thus turns Nagle on for
//! the instant before the library turns it back on, which sends at once
//! whatever Nagle held meanwhile (the kernel pushes pending segments when
//! `TCP_NODELAY` is set).
//!
//! The remembered value is the option word of the connection's shared
//! page ([`crate::owner::Owner::option`]), which every holder after `fork`
//! sees: 0 while the kernel's is the program's, 1 + the value once kept.
//! Its high bit is a lock, held across a call's kernel calls, so that a
//! change on one thread and the connection being carried on another
//! never undo each other. A holder that dies with it (a process killed
//! between two system calls) is waited for 1 s at most.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use libc::{c_int, c_void, socklen_t};

use crate::dev::debug;
use crate::real;
use crate::table::keep_errno;

/// The kernel's value is the program's (the connection is not carried).
const KERNEL: u32 = 0;
const BUSY: u32 = 1 << 31;

/// The option word, locked; its value is stored back when dropped.
struct Held<'a> {
    word: &'a AtomicU32,
    v: u32,
}

impl Held<'_> {
    /// The program's value, if the library keeps the kernel's on.
    fn kept(&self) -> Option<c_int> {
        (self.v != KERNEL).then(|| (self.v - 1) as c_int)
    }
}

fn lock(word: &AtomicU32) -> Held<'_> {
    let end = Instant::now() + Duration::from_secs(1);
    loop {
        let v = word.load(Ordering::Acquire);
        if v & BUSY == 0 || Instant::now() >= end {
            if word.compare_exchange(v, v | BUSY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Held { word, v: v & !BUSY };
            }
            continue;
        }
        std::thread::yield_now();
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.word.store(self.v, Ordering::Release);
    }
}

/// The kernel's `TCP_NODELAY` of `fd`.
fn kernel(fd: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt(2) into an int of ours, with its size.
    let r = unsafe {
        real::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, (&mut v as *mut c_int).cast(), &mut len)
    };
    (r == 0).then_some(v)
}

fn set_on(fd: c_int) {
    let one: c_int = 1;
    // SAFETY: setsockopt(2) with a valid pointer to an int and its size.
    unsafe {
        real::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const c_int).cast(),
            std::mem::size_of::<c_int>() as socklen_t,
        )
    };
}

/// The connection on `fd` is now carried: the kernel's value becomes the
/// program's, and the kernel's is turned on.
pub fn keep(word: &AtomicU32, fd: c_int) {
    let mut h = lock(word);
    if h.kept().is_none() {
        h.v = 1 + kernel(fd).is_some_and(|v| v != 0) as u32;
    }
    set_on(fd);
    debug(&format!(
        "TCP_NODELAY {} on the carried connection's socket (the program's: {})",
        kernel(fd).unwrap_or(-1),
        h.v - 1
    ));
}

/// `setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, val, len)` on a connection of
/// the library's, whose option word is `word`.
///
/// # Safety
/// `val` and `len` as setsockopt(2) takes them.
pub unsafe fn set(word: &AtomicU32, fd: c_int, val: *const c_void, len: socklen_t) -> c_int {
    let mut h = lock(word);
    // The kernel checks the arguments (and takes the value, for a
    // connection that is not carried).
    // SAFETY: the caller's arguments.
    let r = unsafe { real::setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, val, len) };
    if r != 0 || h.kept().is_none() {
        return r;
    }
    // SAFETY: the kernel just read an int at `val` (it fails otherwise).
    let asked = unsafe { val.cast::<c_int>().read_unaligned() } != 0;
    h.v = 1 + asked as u32;
    keep_errno(|| {
        set_on(fd);
        debug(&format!(
            "TCP_NODELAY kept at {} on a carried connection (the program asked {})",
            kernel(fd).unwrap_or(-1),
            asked as c_int
        ));
    });
    0
}

/// `getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, val, len)` on a connection of
/// the library's, whose option word is `word`.
///
/// # Safety
/// `val` and `len` as getsockopt(2) takes them.
pub unsafe fn get(word: &AtomicU32, fd: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
    let h = lock(word);
    // The kernel checks the arguments and sets `*len` (at most an int).
    // SAFETY: the caller's arguments.
    let r = unsafe { real::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, val, len) };
    if let (0, Some(v)) = (r, h.kept()) {
        let b = v.to_ne_bytes();
        // SAFETY: the kernel just wrote `*len` bytes (at most an int) at
        // `val` and the length at `len`.
        unsafe {
            let n = (*len as usize).min(b.len());
            std::ptr::copy_nonoverlapping(b.as_ptr(), val.cast::<u8>(), n);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, l.accept().unwrap().0)
    }

    fn seen(word: &AtomicU32, fd: c_int) -> c_int {
        let mut v: c_int = -1;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: an int of ours and its size.
        assert_eq!(unsafe { get(word, fd, (&mut v as *mut c_int).cast(), &mut len) }, 0);
        v
    }

    fn asks(word: &AtomicU32, fd: c_int, v: c_int, len: socklen_t) -> Result<(), c_int> {
        // SAFETY: an int of ours, and a length of at most its size.
        match unsafe { set(word, fd, (&v as *const c_int).cast(), len) } {
            0 => Ok(()),
            _ => Err(crate::table::errno()),
        }
    }

    /// Not carried: the kernel's is the program's. Carried: the program
    /// reads what it had and what it sets, the kernel's stays on, and the
    /// kernel still checks each call.
    #[test]
    fn the_kernel_keeps_it_on_and_the_program_sees_its_own() {
        let (c, _s) = pair();
        let fd = c.as_raw_fd();
        let word = AtomicU32::new(KERNEL);
        assert_eq!(seen(&word, fd), 0);
        asks(&word, fd, 0, 4).unwrap();
        assert_eq!(kernel(fd), Some(0));
        keep(&word, fd);
        assert_eq!((seen(&word, fd), kernel(fd)), (0, Some(1)));
        asks(&word, fd, 7, 4).unwrap();
        assert_eq!((seen(&word, fd), kernel(fd)), (1, Some(1)));
        asks(&word, fd, 0, 4).unwrap();
        assert_eq!((seen(&word, fd), kernel(fd)), (0, Some(1)));
        assert_eq!(asks(&word, fd, 1, 2), Err(libc::EINVAL));
        // SAFETY: a null option, which the kernel refuses.
        assert_eq!(unsafe { set(&word, fd, std::ptr::null(), 4) }, -1);
        assert_eq!(crate::table::errno(), libc::EFAULT);
        assert_eq!((seen(&word, fd), kernel(fd)), (0, Some(1)));
        // A one-byte buffer gets one byte of the program's value.
        let (mut b, mut len) = (0xAAu8, 1 as socklen_t);
        // SAFETY: a byte of ours and its size.
        assert_eq!(unsafe { get(&word, fd, (&mut b as *mut u8).cast(), &mut len) }, 0);
        assert_eq!((b, len), (0, 1));
        assert_eq!(word.load(Ordering::Acquire), 1, "unlocked, the program's 0");
    }

    /// What the program set before the connection was carried is its value
    /// after.
    #[test]
    fn a_value_set_before_the_carry_stays_the_programs() {
        let (c, _s) = pair();
        let fd = c.as_raw_fd();
        let word = AtomicU32::new(KERNEL);
        asks(&word, fd, 1, 4).unwrap();
        keep(&word, fd);
        assert_eq!((seen(&word, fd), kernel(fd)), (1, Some(1)));
        // A value kept is never taken from the kernel again.
        asks(&word, fd, 0, 4).unwrap();
        keep(&word, fd);
        assert_eq!((seen(&word, fd), kernel(fd)), (0, Some(1)));
    }
}
