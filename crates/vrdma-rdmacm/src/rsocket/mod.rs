//! The rsocket API (`<rdma/rsocket.h>`, rsocket(7)) on vRDMA's sockets
//! carrier (`docs/sockets.md`, "rsocket").
//!
//! An rsocket is a kernel socket of the carrier: `rsocket` makes an
//! ordinary socket, and each other `r*` function is the carrier's
//! function of the same name without the `r` ([`carrier`]), as a program
//! under `vrdma run --sockets` gets it. So a stream rsocket is negotiated
//! through the daemons and carried over an RC QP pair when the peer is an
//! rsocket or a preloaded program of the tenant on vRDMA, and is plain
//! TCP otherwise (where rdma-core's rsocket fails to connect); `rpoll` and
//! `rselect` take rsockets and ordinary descriptors in one set; a
//! datagram rsocket is a kernel UDP socket.
//!
//! What the rsocket C interface is given is checked before it reaches
//! the carrier (which copies a carried stream's bytes in user space, where
//! a bad pointer would be a crash rather than the kernel's `EFAULT`): null
//! buffers of non-zero length, null or oversized vectors and message
//! headers, poll sets and select sizes out of range, and an unknown
//! `shutdown` or `SOL_RDMA` option fail with -1 and `errno`. A descriptor
//! is taken as the kernel takes it: one not open is `EBADF`, one that is
//! no socket `ENOTSOCK` where the call needs a socket (`rread` of a file
//! reads the file, where rdma-core's refuses it).
//!
//! Direct placement (`riomap`, `riounmap`, `riowrite`: a peer's writes
//! into a buffer this end mapped) is the carrier's too, on carried
//! connections ([`iomap`]). `SOL_RDMA` options are accepted and have no effect (the
//! carrier sizes its own rings and queues), and `rgetsockopt` gives
//! rdma-core's defaults.

mod carrier;
mod check;
mod iomap;
mod options;

use libc::{c_int, c_void, iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t, ssize_t};

use check::{buf_ok, iov_ok, msg_ok};
// Exported from src/lib.rs (which the unit-test build leaves out).
#[cfg_attr(test, allow(unused_imports))]
pub use iomap::{riomap, riounmap, riowrite};
#[cfg_attr(test, allow(unused_imports))]
pub use options::{rgetsockopt, rsetsockopt};

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e };
}

/// Fails a call with `errno` `e` (said under `VRDMA_RDMACM_DEBUG`).
fn fail(what: &str, e: c_int, why: &str) -> c_int {
    if crate::debug() {
        eprintln!("vrdma librdmacm: {what}: {why} (errno {e})");
    }
    set_errno(e);
    -1
}

// ---- set-up ----

/// `int rsocket(int domain, int type, int protocol)`: an IPv4 or IPv6
/// stream (TCP) or datagram (UDP) socket, as rdma-core takes; anything
/// else `ENOTSUP` (`librspreload.so` then makes a plain socket).
pub unsafe extern "C" fn rsocket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    let base = ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    let stream = base == libc::SOCK_STREAM && (protocol == 0 || protocol == libc::IPPROTO_TCP);
    let dgram = base == libc::SOCK_DGRAM && (protocol == 0 || protocol == libc::IPPROTO_UDP);
    if !(domain == libc::AF_INET || domain == libc::AF_INET6) || !(stream || dgram) {
        return fail("rsocket", libc::ENOTSUP, "only IPv4/IPv6 stream or datagram sockets");
    }
    if stream && !carrier::loaded() && crate::debug() {
        eprintln!("vrdma librdmacm: rsocket: no carrier, a plain TCP socket");
    }
    // SAFETY: socket(2) with checked arguments.
    unsafe { carrier::socket(domain, ty, protocol) }
}

pub unsafe extern "C" fn rbind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if addr.is_null() {
        return fail("rbind", libc::EFAULT, "a null address");
    }
    // SAFETY: bind(2) with the caller's address of `len` bytes.
    unsafe { carrier::bind(fd, addr, len) }
}

pub unsafe extern "C" fn rlisten(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: the carrier's listen (it registers the address).
    unsafe { carrier::listen(fd, backlog) }
}

pub unsafe extern "C" fn raccept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if !addr.is_null() && len.is_null() {
        return fail("raccept", libc::EFAULT, "an address without a length");
    }
    // SAFETY: the carrier's accept (it claims the connection); the
    // address null or with its length.
    unsafe { carrier::accept(fd, addr, len) }
}

pub unsafe extern "C" fn rconnect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    if addr.is_null() {
        return fail("rconnect", libc::EFAULT, "a null address");
    }
    // SAFETY: the carrier's connect (it announces the connection) with the
    // caller's address of `len` bytes.
    unsafe { carrier::connect(fd, addr, len) }
}

pub unsafe extern "C" fn rshutdown(fd: c_int, how: c_int) -> c_int {
    if ![libc::SHUT_RD, libc::SHUT_WR, libc::SHUT_RDWR].contains(&how) {
        return fail("rshutdown", libc::EINVAL, "unknown how");
    }
    // SAFETY: the carrier's shutdown.
    unsafe { carrier::shutdown(fd, how) }
}

pub unsafe extern "C" fn rclose(fd: c_int) -> c_int {
    // SAFETY: the carrier's close (the peer reads the end after the last
    // byte).
    unsafe { carrier::close(fd) }
}

// ---- data ----

pub unsafe extern "C" fn rrecv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rrecv", libc::EFAULT, "a null buffer") as ssize_t;
    }
    // SAFETY: the carrier's recv with the caller's buffer of `n` bytes.
    unsafe { carrier::recv(fd, buf, n, flags) }
}

pub unsafe extern "C" fn rrecvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    from: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rrecvfrom", libc::EFAULT, "a null buffer") as ssize_t;
    }
    if !from.is_null() && len.is_null() {
        return fail("rrecvfrom", libc::EFAULT, "an address without a length") as ssize_t;
    }
    // SAFETY: the carrier's recvfrom with the caller's buffers.
    unsafe { carrier::recvfrom(fd, buf, n, flags, from, len) }
}

pub unsafe extern "C" fn rrecvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's msghdr, null or valid.
    if let Err((e, why)) = unsafe { msg_ok(msg) } {
        return fail("rrecvmsg", e, why) as ssize_t;
    }
    // SAFETY: the carrier's recvmsg with the checked header.
    unsafe { carrier::recvmsg(fd, msg, flags) }
}

pub unsafe extern "C" fn rread(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rread", libc::EFAULT, "a null buffer") as ssize_t;
    }
    // SAFETY: the carrier's read with the caller's buffer of `n` bytes.
    unsafe { carrier::read(fd, buf, n) }
}

pub unsafe extern "C" fn rreadv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if n < 0 {
        return fail("rreadv", libc::EINVAL, "a negative count") as ssize_t;
    }
    // SAFETY: the caller's iovecs, null or `n` of them.
    if let Err((e, why)) = unsafe { iov_ok(iov, n as usize) } {
        return fail("rreadv", e, why) as ssize_t;
    }
    // SAFETY: the carrier's readv with the checked iovecs.
    unsafe { carrier::readv(fd, iov, n) }
}

pub unsafe extern "C" fn rsend(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rsend", libc::EFAULT, "a null buffer") as ssize_t;
    }
    // SAFETY: the carrier's send with the caller's buffer of `n` bytes.
    unsafe { carrier::send(fd, buf, n, flags) }
}

pub unsafe extern "C" fn rsendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    to: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rsendto", libc::EFAULT, "a null buffer") as ssize_t;
    }
    // SAFETY: the carrier's sendto with the caller's buffer and address
    // (null or `len` bytes: the kernel checks it).
    unsafe { carrier::sendto(fd, buf, n, flags, to, len) }
}

pub unsafe extern "C" fn rsendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's msghdr, null or valid.
    if let Err((e, why)) = unsafe { msg_ok(msg) } {
        return fail("rsendmsg", e, why) as ssize_t;
    }
    // SAFETY: the carrier's sendmsg with the checked header.
    unsafe { carrier::sendmsg(fd, msg, flags) }
}

pub unsafe extern "C" fn rwrite(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if !buf_ok(buf, n) {
        return fail("rwrite", libc::EFAULT, "a null buffer") as ssize_t;
    }
    // SAFETY: the carrier's write with the caller's buffer of `n` bytes.
    unsafe { carrier::write(fd, buf, n) }
}

pub unsafe extern "C" fn rwritev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if n < 0 {
        return fail("rwritev", libc::EINVAL, "a negative count") as ssize_t;
    }
    // SAFETY: the caller's iovecs, null or `n` of them.
    if let Err((e, why)) = unsafe { iov_ok(iov, n as usize) } {
        return fail("rwritev", e, why) as ssize_t;
    }
    // SAFETY: the carrier's writev with the checked iovecs.
    unsafe { carrier::writev(fd, iov, n) }
}

// ---- readiness ----

pub unsafe extern "C" fn rpoll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    if n > 0 && fds.is_null() {
        return fail("rpoll", libc::EFAULT, "a null pollfd array");
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into our struct.
    let max =
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur } else { 1 << 20 };
    if n > max {
        return fail("rpoll", libc::EINVAL, "more descriptors than RLIMIT_NOFILE");
    }
    // SAFETY: the carrier's poll with the caller's `n` pollfds.
    unsafe { carrier::poll(fds, n, timeout) }
}

pub unsafe extern "C" fn rselect(
    n: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    if !(0..=libc::FD_SETSIZE as c_int).contains(&n) {
        return fail("rselect", libc::EINVAL, "nfds outside 0..=FD_SETSIZE");
    }
    // SAFETY: the carrier's select with the caller's sets (each null or
    // an fd_set) and timeout.
    unsafe { carrier::select(n, r, w, e, tv) }
}

// ---- names and options ----

pub unsafe extern "C" fn rgetpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: getpeername(2); the kernel checks the pointers.
    unsafe { carrier::getpeername(fd, addr, len) }
}

pub unsafe extern "C" fn rgetsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: getsockname(2); the kernel checks the pointers.
    unsafe { carrier::getsockname(fd, addr, len) }
}

/// `int rfcntl(int socket, int cmd, ... /* arg */)`: on x86-64 a variadic
/// argument is passed as a fixed one would be, so the third is taken as
/// an integer (a pointer for the commands that take one), as the carrier's
/// `fcntl` takes it.
pub unsafe extern "C" fn rfcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    // SAFETY: the carrier's fcntl with the caller's arguments.
    unsafe { carrier::fcntl(fd, cmd, arg) }
}

#[cfg(test)]
mod tests {
    //! Calls refused before the carrier is reached (none of these loads
    //! it).

    use super::*;

    fn errno() -> c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn refused_before_the_carrier() {
        // SAFETY: each call fails on its arguments before using them.
        unsafe {
            assert_eq!(rsocket(libc::AF_UNIX, libc::SOCK_STREAM, 0), -1);
            assert_eq!(errno(), libc::ENOTSUP);
            assert_eq!(rsocket(libc::AF_INET, libc::SOCK_DGRAM, libc::IPPROTO_TCP), -1);
            assert_eq!(errno(), libc::ENOTSUP);
            assert_eq!(rshutdown(0, 3), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(
                rselect(
                    libc::FD_SETSIZE as c_int + 1,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut()
                ),
                -1
            );
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rpoll(std::ptr::null_mut(), 1, 0), -1);
            assert_eq!(errno(), libc::EFAULT);
            assert_eq!(rread(0, std::ptr::null_mut(), 1), -1);
            assert_eq!(errno(), libc::EFAULT);
            assert_eq!(rwritev(0, std::ptr::null(), -1), -1);
            assert_eq!(errno(), libc::EINVAL);
        }
    }
}
