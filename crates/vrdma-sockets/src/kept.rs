//! Socket options the library keeps in the kernel, and mirrors for the
//! program: `TCP_NODELAY` (kept on) and `TCP_CORK` (kept off) on a
//! carried connection.
//!
//! A carried connection's kernel socket carries only wake bytes, one each
//! time a reader that armed gets bytes, and each must go out at once:
//!
//! - with Nagle's algorithm a byte sent while an earlier one is unacked
//!   waits for its ACK, which the peer's kernel may delay by up to 40 ms
//!   (both ends then sleep: the reader for the byte, the writer for
//!   credits the reader gives back only once woken); so the socket is
//!   `TCP_NODELAY`;
//! - a corked socket holds a partial segment until it is uncorked or for
//!   200 ms (the kernel's cork timeout), a wake byte with it; so the
//!   socket is never corked. Servers cork around a header and a
//!   `sendfile` (nginx's `tcp_nopush`), which meant a 200 ms sleep for
//!   both ends each time.
//!
//! The program's own bytes go through the ring, where neither option
//! means anything: each write is an RDMA write, sent whole and at once,
//! so nothing is lost by ignoring them (a cork only ever delays bytes, it
//! never changes them or their order). But a program that sets one (or
//! never set it, and reads it) must neither undo the kernel's value the
//! wake bytes need nor see a value it did not set. On a carried
//! connection each option of [`OPTIONS`] is therefore the program's view:
//! the library remembers the program's value (at first what the kernel
//! had when the library began to carry it: what the program set before
//! its first call, or what its listener passed on, 0 by default),
//! `getsockopt` reports it, and `setsockopt` records it and puts the
//! kernel's back. The library's values are set before the two libraries'
//! hellos and ready bytes, which would otherwise wait too (a cork set
//! before the first call held each hello 200 ms); if the connection stays
//! plain TCP after all (the peer declined) the program's go back into the
//! kernel ([`give_back_all`]). On any other connection (plain TCP, not
//! decided yet) both go to the kernel, as they would without the library.
//!
//! The kernel still checks each call as it would (a short option is
//! `EINVAL`, a bad pointer `EFAULT`): it gets the program's arguments
//! first. A `setsockopt` that clears `TCP_NODELAY` (or sets `TCP_CORK`)
//! thus holds segments for the instant before the library puts the
//! kernel's value back, which sends at once whatever was held meanwhile
//! (the kernel pushes pending segments when `TCP_NODELAY` is set or
//! `TCP_CORK` cleared).
//!
//! Each option's remembered value is a word of the connection's shared
//! page ([`crate::owner::Owner::option`]), which every holder after
//! `fork` sees: 0 while the kernel's is the program's, 1 + the value once
//! kept. Its high bit is a lock, held across a call's kernel calls, so
//! that a change on one thread and the connection being carried on
//! another never undo each other. A holder that dies with it (a process
//! killed between two system calls) is waited for 1 s at most.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use libc::{c_int, c_void, socklen_t};

use crate::dev::debug;
use crate::owner::Owner;
use crate::real;
use crate::table::keep_errno;

/// An option of `IPPROTO_TCP` that the library keeps at `kernel` on a
/// carried connection's socket; the program's value is in the option word
/// `slot` of the connection's shared page.
pub struct Kept {
    name: c_int,
    label: &'static str,
    kernel: c_int,
    slot: usize,
}

/// The options kept; each has its own word ([`Owner::option`]).
pub const OPTIONS: [Kept; 2] = [
    Kept { name: libc::TCP_NODELAY, label: "TCP_NODELAY", kernel: 1, slot: 0 },
    Kept { name: libc::TCP_CORK, label: "TCP_CORK", kernel: 0, slot: 1 },
];

/// The option at `level`/`name`, if the library keeps it.
pub fn find(level: c_int, name: c_int) -> Option<&'static Kept> {
    if level != libc::IPPROTO_TCP {
        return None;
    }
    OPTIONS.iter().find(|k| k.name == name)
}

/// The connection on `fd` is now carried: each option's kernel value
/// becomes the program's, and the kernel's is set to the library's.
pub fn keep_all(owner: &Owner, fd: c_int) {
    for k in &OPTIONS {
        k.keep(owner.option(k.slot), fd);
    }
}

/// The connection on `fd` stays plain TCP after all (the peer declined,
/// or the exchange failed) after [`keep_all`]: the program's values go
/// back into the kernel, which holds them from now on.
pub fn give_back_all(owner: &Owner, fd: c_int) {
    give_back_page(&owner.page(), fd);
}

/// [`give_back_all`], from the connection's shared page (a link that
/// falls back to plain TCP mid-stream: `crate::link`'s demotion, once its
/// marker went out at once).
pub fn give_back_page(page: &crate::owner::Page, fd: c_int) {
    for k in &OPTIONS {
        k.give_back(page.option(k.slot), fd);
    }
}

/// The kernel's values of the options on `fd`, for a debug line.
pub fn kernel_values(fd: c_int) -> String {
    let v: Vec<String> =
        OPTIONS.iter().map(|k| format!("{} {}", k.label, k.kernel(fd).unwrap_or(-1))).collect();
    v.join(", ")
}

/// The kernel's value is the program's (the connection is not carried).
const KERNEL: u32 = 0;
const BUSY: u32 = 1 << 31;

/// An option word, locked; its value is stored back when dropped.
struct Held<'a> {
    word: &'a AtomicU32,
    v: u32,
}

impl Held<'_> {
    /// The program's value, if the library keeps the kernel's.
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

impl Kept {
    /// The kernel's value of the option on `fd`.
    fn kernel(&self, fd: c_int) -> Option<c_int> {
        let mut v: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: getsockopt(2) into an int of ours, with its size.
        let r = unsafe {
            real::getsockopt(fd, libc::IPPROTO_TCP, self.name, (&mut v as *mut c_int).cast(), &mut len)
        };
        (r == 0).then_some(v)
    }

    /// Sets the kernel's value to the library's.
    fn put_back(&self, fd: c_int) {
        self.set_kernel(fd, self.kernel);
    }

    /// Sets the kernel's value to `v`.
    fn set_kernel(&self, fd: c_int, v: c_int) {
        // SAFETY: setsockopt(2) with a valid pointer to an int and its size.
        unsafe {
            real::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                self.name,
                (&v as *const c_int).cast(),
                std::mem::size_of::<c_int>() as socklen_t,
            )
        };
    }

    /// The connection on `fd`, whose option word is `word`, is now
    /// carried: the kernel's value becomes the program's (unless one is
    /// kept already), and the kernel's is set to the library's.
    fn keep(&self, word: &AtomicU32, fd: c_int) {
        let mut h = lock(word);
        if h.kept().is_none() {
            h.v = 1 + self.kernel(fd).is_some_and(|v| v != 0) as u32;
        }
        self.put_back(fd);
        debug(&format!(
            "{} {} on the socket of a connection being carried (the program's: {})",
            self.label,
            self.kernel(fd).unwrap_or(-1),
            h.v - 1
        ));
    }

    /// The connection on `fd`, whose option word is `word`, stays plain
    /// TCP: the program's value goes back into the kernel, which is the
    /// program's view again.
    fn give_back(&self, word: &AtomicU32, fd: c_int) {
        let mut h = lock(word);
        if let Some(v) = h.kept() {
            self.set_kernel(fd, v);
            h.v = KERNEL;
            debug(&format!("{} {} given back to the kernel (plain TCP)", self.label, v));
        }
    }

    /// `setsockopt(fd, IPPROTO_TCP, name, val, len)` on a connection of
    /// the library's, whose option word is in `owner`.
    ///
    /// # Safety
    /// `val` and `len` as setsockopt(2) takes them.
    pub unsafe fn set(&self, owner: &Owner, fd: c_int, val: *const c_void, len: socklen_t) -> c_int {
        // SAFETY: the caller's.
        unsafe { self.set_word(owner.option(self.slot), fd, val, len) }
    }

    /// `getsockopt(fd, IPPROTO_TCP, name, val, len)` on a connection of
    /// the library's, whose option word is in `owner`.
    ///
    /// # Safety
    /// `val` and `len` as getsockopt(2) takes them.
    pub unsafe fn get(&self, owner: &Owner, fd: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
        // SAFETY: the caller's.
        unsafe { self.get_word(owner.option(self.slot), fd, val, len) }
    }

    /// # Safety
    /// `val` and `len` as setsockopt(2) takes them.
    unsafe fn set_word(&self, word: &AtomicU32, fd: c_int, val: *const c_void, len: socklen_t) -> c_int {
        let mut h = lock(word);
        // The kernel checks the arguments (and takes the value, for a
        // connection that is not carried).
        // SAFETY: the caller's arguments.
        let r = unsafe { real::setsockopt(fd, libc::IPPROTO_TCP, self.name, val, len) };
        if r != 0 || h.kept().is_none() {
            return r;
        }
        // SAFETY: the kernel just read an int at `val` (it fails otherwise).
        let asked = unsafe { val.cast::<c_int>().read_unaligned() } != 0;
        h.v = 1 + asked as u32;
        keep_errno(|| {
            self.put_back(fd);
            debug(&format!(
                "{} kept at {} on a carried connection (the program asked {})",
                self.label,
                self.kernel(fd).unwrap_or(-1),
                asked as c_int
            ));
        });
        0
    }

    /// # Safety
    /// `val` and `len` as getsockopt(2) takes them.
    unsafe fn get_word(&self, word: &AtomicU32, fd: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
        let h = lock(word);
        // The kernel checks the arguments and sets `*len` (at most an int).
        // SAFETY: the caller's arguments.
        let r = unsafe { real::getsockopt(fd, libc::IPPROTO_TCP, self.name, val, len) };
        if let (0, Some(v)) = (r, h.kept()) {
            let b = v.to_ne_bytes();
            // SAFETY: the kernel just wrote `*len` bytes (at most an int)
            // at `val` and the length at `len`.
            unsafe {
                let n = (*len as usize).min(b.len());
                std::ptr::copy_nonoverlapping(b.as_ptr(), val.cast::<u8>(), n);
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    const NODELAY: &Kept = &OPTIONS[0];
    const CORK: &Kept = &OPTIONS[1];

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (c, l.accept().unwrap().0)
    }

    fn seen(k: &Kept, word: &AtomicU32, fd: c_int) -> c_int {
        let mut v: c_int = -1;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: an int of ours and its size.
        assert_eq!(unsafe { k.get_word(word, fd, (&mut v as *mut c_int).cast(), &mut len) }, 0);
        v
    }

    fn asks(k: &Kept, word: &AtomicU32, fd: c_int, v: c_int, len: socklen_t) -> Result<(), c_int> {
        // SAFETY: an int of ours, and a length of at most its size.
        match unsafe { k.set_word(word, fd, (&v as *const c_int).cast(), len) } {
            0 => Ok(()),
            _ => Err(crate::table::errno()),
        }
    }

    #[test]
    fn the_table_finds_tcp_options_only() {
        assert_eq!(find(libc::IPPROTO_TCP, libc::TCP_NODELAY).map(|k| k.label), Some("TCP_NODELAY"));
        assert_eq!(find(libc::IPPROTO_TCP, libc::TCP_CORK).map(|k| k.label), Some("TCP_CORK"));
        assert!(find(libc::SOL_SOCKET, libc::TCP_NODELAY).is_none());
        assert!(find(libc::IPPROTO_TCP, libc::TCP_MAXSEG).is_none());
        for (i, k) in OPTIONS.iter().enumerate() {
            assert_eq!(k.slot, i, "one word each");
        }
    }

    /// Not carried: the kernel's is the program's. Carried: the program
    /// reads what it had and what it sets, the kernel's stays the
    /// library's, and the kernel still checks each call.
    #[test]
    fn the_kernel_keeps_the_librarys_and_the_program_sees_its_own() {
        for k in &OPTIONS {
            let (c, _s) = pair();
            let fd = c.as_raw_fd();
            let word = AtomicU32::new(KERNEL);
            let lib = k.kernel;
            assert_eq!(seen(k, &word, fd), 0, "{}", k.label);
            asks(k, &word, fd, 0, 4).unwrap();
            assert_eq!(k.kernel(fd), Some(0));
            k.keep(&word, fd);
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (0, Some(lib)), "{}", k.label);
            asks(k, &word, fd, 7, 4).unwrap();
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (1, Some(lib)), "{}", k.label);
            asks(k, &word, fd, 0, 4).unwrap();
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (0, Some(lib)), "{}", k.label);
            assert_eq!(asks(k, &word, fd, 1, 2), Err(libc::EINVAL), "{}", k.label);
            // SAFETY: a null option, which the kernel refuses.
            assert_eq!(unsafe { k.set_word(&word, fd, std::ptr::null(), 4) }, -1);
            assert_eq!(crate::table::errno(), libc::EFAULT, "{}", k.label);
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (0, Some(lib)), "{}", k.label);
            // A one-byte buffer gets one byte of the program's value.
            asks(k, &word, fd, 1, 4).unwrap();
            let (mut b, mut len) = (0xAAu8, 1 as socklen_t);
            // SAFETY: a byte of ours and its size.
            assert_eq!(unsafe { k.get_word(&word, fd, (&mut b as *mut u8).cast(), &mut len) }, 0);
            assert_eq!((b, len), (1, 1), "{}", k.label);
            assert_eq!(word.load(Ordering::Acquire), 2, "{}: unlocked, the program's 1", k.label);
        }
    }

    /// What the program set before the connection was carried is its value
    /// after; a cork set then is taken off the kernel's socket.
    #[test]
    fn a_value_set_before_the_carry_stays_the_programs() {
        for k in &OPTIONS {
            let (c, _s) = pair();
            let fd = c.as_raw_fd();
            let word = AtomicU32::new(KERNEL);
            asks(k, &word, fd, 1, 4).unwrap();
            assert_eq!(k.kernel(fd), Some(1));
            k.keep(&word, fd);
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (1, Some(k.kernel)), "{}", k.label);
            // A value kept is never taken from the kernel again.
            asks(k, &word, fd, 0, 4).unwrap();
            k.keep(&word, fd);
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (0, Some(k.kernel)), "{}", k.label);
        }
    }

    /// A connection that stays plain TCP after its options were kept
    /// gets the program's values back in the kernel, including one set
    /// meanwhile, and the kernel's is the program's view again.
    #[test]
    fn a_connection_that_stays_tcp_gets_the_programs_values_back() {
        for k in &OPTIONS {
            let (c, _s) = pair();
            let fd = c.as_raw_fd();
            let word = AtomicU32::new(KERNEL);
            let programs = 1 - k.kernel;
            asks(k, &word, fd, programs, 4).unwrap();
            k.keep(&word, fd);
            assert_eq!(k.kernel(fd), Some(k.kernel), "{}", k.label);
            k.give_back(&word, fd);
            assert_eq!((seen(k, &word, fd), k.kernel(fd)), (programs, Some(programs)), "{}", k.label);
            assert_eq!(word.load(Ordering::Acquire), KERNEL, "{}", k.label);
            // Set while kept: that is what goes back.
            k.keep(&word, fd);
            asks(k, &word, fd, k.kernel, 4).unwrap();
            k.give_back(&word, fd);
            assert_eq!(k.kernel(fd), Some(k.kernel), "{}", k.label);
            // Nothing kept: nothing changes.
            asks(k, &word, fd, programs, 4).unwrap();
            k.give_back(&word, fd);
            assert_eq!(k.kernel(fd), Some(programs), "{}", k.label);
        }
    }

    /// The options of one connection are kept apart, and a forked child
    /// and its parent see one value each.
    #[test]
    fn each_option_has_its_word_and_a_child_sees_them() {
        let (c, _s) = pair();
        let fd = c.as_raw_fd();
        let owner = Owner::new();
        asks(CORK, owner.option(CORK.slot), fd, 1, 4).unwrap();
        keep_all(&owner, fd);
        assert_eq!((NODELAY.kernel(fd), CORK.kernel(fd)), (Some(1), Some(0)));
        let child = crate::pid::in_forked_child(|| {
            let saw = seen(CORK, owner.option(CORK.slot), fd) == 1
                && seen(NODELAY, owner.option(NODELAY.slot), fd) == 0;
            saw && asks(NODELAY, owner.option(NODELAY.slot), fd, 1, 4).is_ok()
        });
        assert!(child, "the child saw other values");
        // The child's change is its parent's view too.
        assert_eq!(seen(CORK, owner.option(CORK.slot), fd), 1);
        assert_eq!(seen(NODELAY, owner.option(NODELAY.slot), fd), 1);
        assert_eq!((NODELAY.kernel(fd), CORK.kernel(fd)), (Some(1), Some(0)));
    }
}
