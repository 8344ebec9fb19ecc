//! rsocket's direct placement on carried connections, for the drop-in
//! librdmacm's `riomap`, `riounmap` and `riowrite` (which look these up
//! by name; their C prototypes are rsocket's, the errors -1 and `errno`).
//! The work is the connection's ([`crate::link`]); here a descriptor is
//! told apart: a carried connection, or why not (`EBADF` not open,
//! `ENOTSOCK` no socket, `EOPNOTSUPP` a socket that is not carried: plain
//! TCP, UDP, a listener).

use libc::{c_int, c_void, off_t, size_t, ssize_t};

use crate::interpose::{target, Target};
use crate::link::Link;
use crate::real;
use crate::table::set_errno;

/// Why `fd`, which this library does not carry, has no direct placement.
fn not_carried(fd: c_int) -> c_int {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: libc's getsockopt into our integer of `len` bytes.
    let r = unsafe {
        real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut ty as *mut c_int).cast(), &mut len)
    };
    if r == 0 {
        return libc::EOPNOTSUPP;
    }
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EBADF);
    if e == libc::ENOTSOCK {
        libc::ENOTSOCK
    } else {
        libc::EBADF
    }
}

fn with_link<T>(fd: c_int, f: impl FnOnce(&Link) -> Result<T, c_int>) -> Result<T, c_int> {
    match target(fd) {
        Target::Link(l) => f(&l),
        Target::Pass => Err(not_carried(fd)),
        Target::Fail(e) => Err(if e == crate::stream::ENDED { libc::EPIPE } else { e }),
    }
}

fn fail(e: c_int) -> c_int {
    crate::dev::debug(&format!("direct placement: errno {e}"));
    set_errno(e);
    -1
}

/// `riomap` (only `PROT_WRITE` mappings, as the peer writes them; the
/// front end checks `prot`).
#[no_mangle]
pub unsafe extern "C" fn vrdma_sockets_riomap(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    _prot: c_int,
    _flags: c_int,
    offset: off_t,
) -> off_t {
    match with_link(fd, |l| l.iomap(buf.cast(), len, offset)) {
        Ok(o) => o,
        Err(e) => fail(e) as off_t,
    }
}

#[no_mangle]
pub unsafe extern "C" fn vrdma_sockets_riounmap(fd: c_int, buf: *mut c_void, len: size_t) -> c_int {
    match with_link(fd, |l| l.iounmap(buf.cast(), len)) {
        Ok(()) => 0,
        Err(e) => fail(e),
    }
}

/// `riowrite`, -1 on error (rsocket's `size_t` is the front end's cast).
#[no_mangle]
pub unsafe extern "C" fn vrdma_sockets_riowrite(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    offset: off_t,
    _flags: c_int,
) -> ssize_t {
    match with_link(fd, |l| l.iowrite(buf.cast(), n, offset)) {
        Ok(n) => n as ssize_t,
        Err(e) => fail(e) as ssize_t,
    }
}
