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
//! Not carried: `riomap`, `riounmap` and `riowrite` (rdma-core's direct
//! placement into a peer's mapped buffer) fail with `ENOSYS`, said once
//! on stderr; `SOL_RDMA` options are accepted and have no effect (the
//! carrier sizes its own rings and queues), and `rgetsockopt` gives
//! rdma-core's defaults.

mod carrier;

use std::sync::atomic::{AtomicBool, Ordering};

use libc::{c_int, c_void, iovec, msghdr, nfds_t, off_t, pollfd, size_t, sockaddr, socklen_t, ssize_t};

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

/// Whether a buffer of `n` bytes at `p` can be handed on: not null unless
/// empty.
fn buf_ok(p: *const c_void, n: size_t) -> bool {
    !p.is_null() || n == 0
}

/// Checks `n` iovecs at `iov` as the kernel would before a copy: a count
/// in `0..=UIO_MAXIOV`, no null array or base with a length, a total that
/// fits `ssize_t`.
///
/// # Safety
/// `iov` is null or points to `n` iovecs.
unsafe fn iov_ok(iov: *const iovec, n: usize) -> Result<(), (c_int, &'static str)> {
    if n > libc::UIO_MAXIOV as usize {
        return Err((libc::EINVAL, "more iovecs than UIO_MAXIOV"));
    }
    if n == 0 {
        return Ok(());
    }
    if iov.is_null() {
        return Err((libc::EFAULT, "a null iovec array"));
    }
    // SAFETY: as the caller promised.
    let v = unsafe { std::slice::from_raw_parts(iov, n) };
    if v.iter().any(|v| v.iov_base.is_null() && v.iov_len > 0) {
        return Err((libc::EFAULT, "an iovec with a null base"));
    }
    let total = v.iter().try_fold(0usize, |t, v| t.checked_add(v.iov_len));
    if total.is_none_or(|t| t > isize::MAX as usize) {
        return Err((libc::EINVAL, "the iovecs' lengths overflow"));
    }
    Ok(())
}

/// Checks a message header for `rrecvmsg` / `rsendmsg`.
///
/// # Safety
/// `msg` is null or a valid msghdr whose `msg_iov` holds `msg_iovlen`
/// iovecs.
unsafe fn msg_ok(msg: *const msghdr) -> Result<(), (c_int, &'static str)> {
    // SAFETY: as the caller promised.
    let Some(m) = (unsafe { msg.as_ref() }) else { return Err((libc::EFAULT, "a null msghdr")) };
    if m.msg_control.is_null() && m.msg_controllen > 0 {
        return Err((libc::EFAULT, "a null control buffer with a length"));
    }
    // SAFETY: as the caller promised.
    unsafe { iov_ok(m.msg_iov, m.msg_iovlen) }
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

/// rsocket.h's option level for its RDMA options, and the options.
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;
const RDMA_ROUTE: c_int = 4;

/// rdma-core's default of an integer `SOL_RDMA` option.
fn rdma_default(name: c_int) -> Option<u32> {
    match name {
        RDMA_SQSIZE | RDMA_RQSIZE => Some(384),
        RDMA_INLINE => Some(64),
        RDMA_IOMAPSIZE => Some(0),
        _ => None,
    }
}

/// Whether `fd` is a socket (else the kernel's errno).
fn is_socket(fd: c_int) -> Result<(), c_int> {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt(2) into our int.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&raw mut ty).cast(), &mut len) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EBADF))
    }
}

pub unsafe extern "C" fn rsetsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if level != SOL_RDMA {
        // SAFETY: the carrier's setsockopt (it keeps TCP_NODELAY's and
        // TCP_CORK's values of a carried connection); the kernel checks
        // the rest.
        return unsafe { carrier::setsockopt(fd, level, name, val, len) };
    }
    if let Err(e) = is_socket(fd) {
        return fail("rsetsockopt", e, "not a socket");
    }
    match name {
        RDMA_ROUTE => 0,
        _ if rdma_default(name).is_some() => {
            if val.is_null() || (len as usize) < std::mem::size_of::<u32>() {
                return fail("rsetsockopt", libc::EINVAL, "SOL_RDMA takes an integer");
            }
            // Accepted: the carrier sizes its own queues and rings.
            0
        }
        _ => fail("rsetsockopt", libc::ENOPROTOOPT, "unknown SOL_RDMA option"),
    }
}

pub unsafe extern "C" fn rgetsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level != SOL_RDMA {
        // SAFETY: the carrier's getsockopt; the kernel checks the pointers.
        return unsafe { carrier::getsockopt(fd, level, name, val, len) };
    }
    if let Err(e) = is_socket(fd) {
        return fail("rgetsockopt", e, "not a socket");
    }
    let Some(v) = rdma_default(name) else {
        return fail("rgetsockopt", libc::ENOPROTOOPT, "no such SOL_RDMA option to read");
    };
    if val.is_null() || len.is_null() {
        return fail("rgetsockopt", libc::EFAULT, "a null value or length");
    }
    // SAFETY: the caller's length, not null.
    let room = unsafe { *len } as usize;
    if room < std::mem::size_of::<u32>() {
        return fail("rgetsockopt", libc::EINVAL, "room for less than an integer");
    }
    // SAFETY: `val` has `room` (at least 4) bytes; unaligned is allowed.
    unsafe {
        val.cast::<u32>().write_unaligned(v);
        *len = std::mem::size_of::<u32>() as socklen_t;
    }
    0
}

/// `int rfcntl(int socket, int cmd, ... /* arg */)`: on x86-64 a variadic
/// argument is passed as a fixed one would be, so the third is taken as
/// an integer (a pointer for the commands that take one), as the carrier's
/// `fcntl` takes it.
pub unsafe extern "C" fn rfcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    // SAFETY: the carrier's fcntl with the caller's arguments.
    unsafe { carrier::fcntl(fd, cmd, arg) }
}

// ---- direct placement: not carried ----

fn no_iomap(name: &str, told: &AtomicBool) {
    if !told.swap(true, Ordering::Relaxed) {
        eprintln!(
            "vrdma librdmacm: {name} is not implemented: vRDMA's rsockets carry streams, not writes into a peer's \
             mapped buffer; failing with ENOSYS"
        );
    }
    set_errno(libc::ENOSYS);
}

pub unsafe extern "C" fn riomap(
    _fd: c_int,
    _buf: *mut c_void,
    _len: size_t,
    _prot: c_int,
    _flags: c_int,
    _offset: off_t,
) -> off_t {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riomap", &TOLD);
    -1
}

pub unsafe extern "C" fn riounmap(_fd: c_int, _buf: *mut c_void, _len: size_t) -> c_int {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riounmap", &TOLD);
    -1
}

pub unsafe extern "C" fn riowrite(
    _fd: c_int,
    _buf: *const c_void,
    _n: size_t,
    _offset: off_t,
    _flags: c_int,
) -> size_t {
    static TOLD: AtomicBool = AtomicBool::new(false);
    no_iomap("riowrite", &TOLD);
    size_t::MAX
}

#[cfg(test)]
mod tests {
    //! The checks made before the carrier is reached (none of these
    //! calls loads it).

    use super::*;

    fn errno() -> c_int {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    #[test]
    fn iovecs_are_checked_as_the_kernel_would() {
        let mut b = [0u8; 4];
        let good = [iovec { iov_base: b.as_mut_ptr().cast(), iov_len: 4 }];
        let null_base = [iovec { iov_base: std::ptr::null_mut(), iov_len: 1 }];
        let empty_null = [iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }];
        let huge = [
            iovec { iov_base: b.as_mut_ptr().cast(), iov_len: usize::MAX / 2 + 1 },
            iovec { iov_base: b.as_mut_ptr().cast(), iov_len: usize::MAX / 2 + 1 },
        ];
        // SAFETY: each array holds the count given.
        unsafe {
            assert_eq!(iov_ok(good.as_ptr(), 1), Ok(()));
            assert_eq!(iov_ok(empty_null.as_ptr(), 1), Ok(()));
            assert_eq!(iov_ok(std::ptr::null(), 0), Ok(()));
            assert_eq!(iov_ok(std::ptr::null(), 1).unwrap_err().0, libc::EFAULT);
            assert_eq!(iov_ok(null_base.as_ptr(), 1).unwrap_err().0, libc::EFAULT);
            assert_eq!(iov_ok(good.as_ptr(), libc::UIO_MAXIOV as usize + 1).unwrap_err().0, libc::EINVAL);
            assert_eq!(iov_ok(huge.as_ptr(), 2).unwrap_err().0, libc::EINVAL);
        }
    }

    #[test]
    fn a_message_header_is_checked() {
        // SAFETY: null, or a zeroed msghdr (no iovecs, no control).
        unsafe {
            assert_eq!(msg_ok(std::ptr::null()).unwrap_err().0, libc::EFAULT);
            let mut m: msghdr = std::mem::zeroed();
            assert_eq!(msg_ok(&m), Ok(()));
            m.msg_controllen = 8;
            assert_eq!(msg_ok(&m).unwrap_err().0, libc::EFAULT);
        }
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

    #[test]
    fn sol_rdma_options_are_taken_and_read_back_as_rdma_cores_defaults() {
        // SAFETY: a socket of this test, closed at the end; our buffers.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let v: u32 = 1000;
            let p = (&raw const v).cast();
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 4), 0);
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 2), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rsetsockopt(fd, SOL_RDMA, 42, p, 4), -1);
            assert_eq!(errno(), libc::ENOPROTOOPT);
            for (name, want) in
                [(RDMA_SQSIZE, 384), (RDMA_RQSIZE, 384), (RDMA_INLINE, 64), (RDMA_IOMAPSIZE, 0)]
            {
                let mut got: u32 = 7;
                let mut len: socklen_t = 8;
                assert_eq!(rgetsockopt(fd, SOL_RDMA, name, (&raw mut got).cast(), &mut len), 0);
                assert_eq!((got, len), (want, 4));
            }
            let mut got: u32 = 0;
            let mut len: socklen_t = 2;
            assert_eq!(rgetsockopt(fd, SOL_RDMA, RDMA_INLINE, (&raw mut got).cast(), &mut len), -1);
            assert_eq!(errno(), libc::EINVAL);
            assert_eq!(rgetsockopt(fd, SOL_RDMA, RDMA_ROUTE, (&raw mut got).cast(), &mut len), -1);
            assert_eq!(errno(), libc::ENOPROTOOPT);
            libc::close(fd);
            // A closed descriptor is the kernel's EBADF.
            assert_eq!(rsetsockopt(fd, SOL_RDMA, RDMA_SQSIZE, p, 4), -1);
            assert_eq!(errno(), libc::EBADF);
        }
    }
}
