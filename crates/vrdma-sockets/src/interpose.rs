//! The exported functions that stand in front of libc's.
//!
//! Each hands a descriptor it does not carry straight to libc, as it does
//! every call made while this library is already handling one (the guard
//! of [`crate::table`]).

use std::sync::Arc;

use libc::{c_int, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};

use crate::addr;
use crate::blocking::Blocking;
use crate::dev::{debug, dev};
use crate::link::Link;
use crate::listener::Listener;
use crate::owner::Take;
use crate::real;
use crate::stream::{Route, Stream, ENDED};
use crate::table::{self, keep_errno, set_errno, Entry, Guard};

/// Where a data call on `fd` goes.
pub(crate) enum Target {
    Pass,
    Link(Arc<Link>),
    Fail(c_int),
}

pub(crate) fn target(fd: c_int) -> Target {
    let Some(_g) = Guard::enter() else { return Target::Pass };
    match table::get(fd) {
        Some(Entry::Stream(s)) => match s.take() {
            Take::Mine => match s.route() {
                Ok(Route::Link(l)) => Target::Link(l),
                Ok(Route::Tcp) => Target::Pass,
                Err(e) => Target::Fail(e),
            },
            // Another holder (after fork) found it plain TCP.
            Take::Tcp => {
                table::forget_stream(&s);
                Target::Pass
            }
            // Another process (parent or child) drives it: its QP and
            // rings are not this one's (`crate::owner`). Carried before
            // the fork, the driver is asked to demote it
            // (`crate::forkshare`); else the call fails.
            Take::Other => match crate::forkshare::request(&s) {
                Some(Ok(())) => match s.link_now() {
                    Some(l) => Target::Link(l),
                    None => Target::Fail(libc::EIO),
                },
                Some(Err(e)) => Target::Fail(e),
                None => other_drives(fd),
            },
        },
        _ => Target::Pass,
    }
}

/// A call on a connection another process drives, which cannot be asked
/// for: `EIO`, said once.
fn other_drives(fd: c_int) -> Target {
    static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    crate::dev::warn_once(
        &SAID,
        &format!(
            "descriptor {fd}: another process (parent or child, after a fork) carries this connection over \
             vRDMA, and it cannot be shared (not carried before the fork, or a peer library that cannot fall \
             back to TCP): its calls fail with EIO (docs/sockets.md, \"Fork\"). Run such programs without the \
             preload: VRDMA_SOCKETS=0"
        ),
    );
    Target::Fail(libc::EIO)
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no argument.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

fn done(r: Result<usize, c_int>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        // A read of a connection whose peer closed before its first call.
        Err(ENDED) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// As the kernel does for TCP: a write to a connection that is gone raises
/// SIGPIPE unless the caller said MSG_NOSIGNAL, or it is the library's
/// own line (`crate::dev::saying`: a program that does not ignore the
/// signal must not die of a diagnostic, whichever call writes it).
fn done_write(r: Result<usize, c_int>, nosignal: bool) -> ssize_t {
    let r = if r == Err(ENDED) { Err(libc::EPIPE) } else { r };
    if r == Err(libc::EPIPE) && !nosignal && !crate::dev::saying() {
        // SAFETY: raise(3) on this thread.
        unsafe { libc::raise(libc::SIGPIPE) };
    }
    done(r)
}

fn iov_in(iov: *const iovec, n: c_int) -> Result<Vec<(*mut u8, usize)>, c_int> {
    if !(0..=libc::UIO_MAXIOV).contains(&n) || (iov.is_null() && n > 0) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        // (`iov` may be null: no slice of it, even an empty one.)
        return Ok(Vec::new());
    }
    // SAFETY: the caller passes `n` iovecs at `iov` (readv's contract),
    // `iov` not null (checked).
    let v = unsafe { std::slice::from_raw_parts(iov, n as usize) };
    Ok(v.iter().map(|v| (v.iov_base.cast::<u8>(), v.iov_len)).collect())
}

/// A msghdr's vector count as `iov_in` takes it: one above every limit
/// where it does not fit (`msg_iovlen` is a `size_t`; a cast would wrap
/// 2^32 to 0 vectors).
fn iov_count(n: usize) -> c_int {
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

fn iov_out(iov: *const iovec, n: c_int) -> Result<Vec<(*const u8, usize)>, c_int> {
    Ok(iov_in(iov, n)?.into_iter().map(|(p, l)| (p as *const u8, l)).collect())
}

// ---- reading ----

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's read with the caller's arguments.
        Target::Pass => unsafe { real::read(fd, buf, n) },
        Target::Link(l) => done(l.read(&[(buf.cast(), n)], nonblocking(fd), false, false)),
        Target::Fail(e) => done(Err(e)),
    }
}

fn recv_flags(fd: c_int, flags: c_int) -> (bool, bool, bool) {
    (
        flags & libc::MSG_DONTWAIT != 0 || nonblocking(fd),
        flags & libc::MSG_PEEK != 0,
        flags & libc::MSG_WAITALL != 0,
    )
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's recv with the caller's arguments.
        Target::Pass => unsafe { real::recv(fd, buf, n, flags) },
        Target::Link(l) => {
            let (nb, peek, all) = recv_flags(fd, flags);
            done(l.read(&[(buf.cast(), n)], nb, peek, all))
        }
        Target::Fail(e) => done(Err(e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    from: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's recvfrom with the caller's arguments.
        Target::Pass => unsafe { real::recvfrom(fd, buf, n, flags, from, len) },
        Target::Link(l) => {
            let (nb, peek, all) = recv_flags(fd, flags);
            // A connected TCP socket leaves the address alone; so do we.
            done(l.read(&[(buf.cast(), n)], nb, peek, all))
        }
        Target::Fail(e) => done(Err(e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's readv with the caller's arguments.
        Target::Pass => unsafe { real::readv(fd, iov, n) },
        Target::Link(l) => done(iov_in(iov, n).and_then(|v| l.read(&v, nonblocking(fd), false, false))),
        Target::Fail(e) => done(Err(e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's recvmsg with the caller's arguments.
        Target::Pass => unsafe { real::recvmsg(fd, msg, flags) },
        Target::Link(l) if !msg.is_null() => {
            // SAFETY: the caller passes a valid msghdr.
            let m = unsafe { &mut *msg };
            let (nb, peek, all) = recv_flags(fd, flags);
            let r = iov_in(m.msg_iov, iov_count(m.msg_iovlen)).and_then(|v| l.read(&v, nb, peek, all));
            if r.is_ok() {
                // No ancillary data and no address on a stream.
                m.msg_controllen = 0;
                m.msg_flags = 0;
                m.msg_namelen = 0;
            }
            done(r)
        }
        Target::Link(_) => done(Err(libc::EFAULT)),
        Target::Fail(e) => done(Err(e)),
    }
}

// The _FORTIFY_SOURCE forms (Debian builds its packages with it): the
// compiler calls these where it knows the buffer's size.

/// glibc's `__chk_fail`: a read larger than its buffer.
fn overflow() -> ! {
    const MSG: &[u8] = b"*** buffer overflow detected ***: terminated\n";
    // SAFETY: write(2) of a static buffer to stderr, then abort.
    unsafe {
        libc::syscall(libc::SYS_write, 2, MSG.as_ptr(), MSG.len());
        libc::abort()
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        overflow();
    }
    // SAFETY: `read` with the caller's arguments, checked as glibc does.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        overflow();
    }
    // SAFETY: `recv` with the caller's arguments, checked as glibc does.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    from: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        overflow();
    }
    // SAFETY: `recvfrom` with the caller's arguments, checked as glibc does.
    unsafe { recvfrom(fd, buf, n, flags, from, len) }
}

// ---- writing ----

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's write with the caller's arguments.
        Target::Pass => unsafe { real::write(fd, buf, n) },
        Target::Link(l) => done_write(l.write(&[(buf.cast(), n)], &Blocking::of(fd, false)), false),
        Target::Fail(e) => done_write(Err(e), false),
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's send with the caller's arguments.
        Target::Pass => unsafe { real::send(fd, buf, n, flags) },
        Target::Link(l) => {
            let nb = Blocking::of(fd, flags & libc::MSG_DONTWAIT != 0);
            done_write(l.write(&[(buf.cast(), n)], &nb), flags & libc::MSG_NOSIGNAL != 0)
        }
        Target::Fail(e) => done_write(Err(e), flags & libc::MSG_NOSIGNAL != 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    to: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's sendto with the caller's arguments.
        Target::Pass => unsafe { real::sendto(fd, buf, n, flags, to, len) },
        Target::Link(l) => {
            let nb = Blocking::of(fd, flags & libc::MSG_DONTWAIT != 0);
            done_write(l.write(&[(buf.cast(), n)], &nb), flags & libc::MSG_NOSIGNAL != 0)
        }
        Target::Fail(e) => done_write(Err(e), flags & libc::MSG_NOSIGNAL != 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's writev with the caller's arguments.
        Target::Pass => unsafe { real::writev(fd, iov, n) },
        Target::Link(l) => {
            done_write(iov_out(iov, n).and_then(|v| l.write(&v, &Blocking::of(fd, false))), false)
        }
        Target::Fail(e) => done_write(Err(e), false),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: libc's sendmsg with the caller's arguments.
        Target::Pass => unsafe { real::sendmsg(fd, msg, flags) },
        Target::Link(l) if !msg.is_null() => {
            // SAFETY: the caller passes a valid msghdr.
            let m = unsafe { &*msg };
            let nb = Blocking::of(fd, flags & libc::MSG_DONTWAIT != 0);
            let r = iov_out(m.msg_iov, iov_count(m.msg_iovlen)).and_then(|v| l.write(&v, &nb));
            done_write(r, flags & libc::MSG_NOSIGNAL != 0)
        }
        Target::Link(_) => done(Err(libc::EFAULT)),
        Target::Fail(e) => done_write(Err(e), flags & libc::MSG_NOSIGNAL != 0),
    }
}

/// `sendfile` to a carried socket: read from `inp` and write through the
/// link (the kernel would move the file's pages into the TCP socket, past
/// the ring).
#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: the caller's arguments, as sendfile(2) takes them.
    unsafe { sendfile_with(out, inp, off, n, real::sendfile) }
}

/// `sendfile` under its large-file name (programs built with
/// `_FILE_OFFSET_BITS=64` call it; `off_t` is 64 bits on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: the caller's arguments, as sendfile(2) takes them.
    unsafe { sendfile_with(out, inp, off, n, real::sendfile64) }
}

/// # Safety
/// `off` is null or the caller's offset; `libc_fn` is libc's sendfile.
unsafe fn sendfile_with(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    n: size_t,
    libc_fn: unsafe fn(c_int, c_int, *mut off_t, size_t) -> ssize_t,
) -> ssize_t {
    let l = match target(out) {
        // SAFETY: libc's sendfile with the caller's arguments.
        Target::Pass => return unsafe { libc_fn(out, inp, off, n) },
        Target::Fail(e) => return done_write(Err(e), false),
        Target::Link(l) => l,
    };
    // Read at the offset, or at the file's own position, which moves by
    // what was written, not by what was read: a read that advanced it
    // lost whatever a non-blocking `EAGAIN` or a short write left unsent.
    // sendfile(2)'s input supports mmap-like operations (a regular file, a
    // block device), so it has a position; one that has none (a pipe, a
    // socket) is refused as the kernel refuses it.
    let at = if off.is_null() {
        // SAFETY: lseek(2) on the caller's descriptor, moving nothing.
        let at = unsafe { libc::lseek(inp, 0, libc::SEEK_CUR) };
        if at < 0 {
            if table::errno() == libc::ESPIPE {
                set_errno(libc::EINVAL);
            }
            return -1;
        }
        at
    } else {
        // SAFETY: the caller's offset.
        unsafe { *off }
    };
    let mut buf = vec![0u8; n.min(crate::link::RING)];
    // SAFETY: `buf` is valid for its length.
    let got = unsafe { libc::pread(inp, buf.as_mut_ptr().cast(), buf.len(), at) };
    if got <= 0 {
        return got;
    }
    let r = l.write(&[(buf.as_ptr(), got as usize)], &Blocking::of(out, false));
    if let Ok(w) = &r {
        let to = at + *w as off_t;
        if off.is_null() {
            // SAFETY: lseek(2) on the caller's descriptor, to where the
            // bytes written end (a regular file: it cannot fail here).
            unsafe { libc::lseek(inp, to, libc::SEEK_SET) };
        } else {
            // SAFETY: the caller's offset.
            unsafe { *off = to };
        }
    }
    done_write(r, false)
}

// ---- connection set-up ----

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: libc's listen with the caller's arguments.
    let r = unsafe { real::listen(fd, backlog) };
    if r == 0 {
        if let Some(_g) = Guard::enter() {
            keep_errno(|| register_listener(fd));
        }
    }
    r
}

fn register_listener(fd: c_int) {
    if matches!(table::get(fd), Some(Entry::Listener(_))) {
        return;
    }
    let Some(family) = addr::inet_stream(fd) else { return };
    let Some(at) = addr::local_of(fd) else { return };
    // A dual-stack `::` listener owns both families' destinations (two
    // registrations); one that fails leaves that family's clients TCP. A
    // link-local one owns its address with its scope (its interface).
    let owned = addr::listen_addrs(family, at);
    if owned.is_empty() {
        return;
    }
    let Some(d) = dev() else { return };
    // `[::]` owns this host's link-local destinations of its port too
    // (the daemon learns that this library claims them), unless the
    // socket is bound to a device: a plain listener of the same port may
    // sit on another one, and its clients would wait for a claim that
    // never comes. Its global ones are owned as before.
    let link_local = at.is_ipv6() && at.ip().is_unspecified() && addr::bound_dev(fd, at) == 0;
    let mut addrs = Vec::new();
    for a in owned {
        let r =
            if link_local && a.is_ipv6() { d.ctx.sock_listen_link_local(a) } else { d.ctx.sock_listen(a) };
        match r {
            Ok(()) => {
                debug(&format!("listening on {a}"));
                addrs.push(a);
            }
            Err(e) => debug(&format!("listener {a} not registered (its clients stay TCP): {e}")),
        }
    }
    if !addrs.is_empty() {
        table::insert(fd, Entry::Listener(Arc::new(Listener { addrs, pid: crate::pid::get() })));
    }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, to: *const sockaddr, len: socklen_t) -> c_int {
    let announced = match Guard::enter() {
        // SAFETY: the caller's address of `len` bytes.
        Some(_g) => keep_errno(|| unsafe { announce(fd, to, len) }),
        None => None,
    };
    // SAFETY: libc's connect with the caller's arguments.
    let r = unsafe { real::connect(fd, to, len) };
    if let Some(s) = announced {
        let e = table::errno();
        if r == 0 || e == libc::EINPROGRESS || e == libc::EINTR {
            if let Some(_g) = Guard::enter() {
                table::insert(fd, Entry::Stream(s));
            }
        } else {
            let _g = Guard::enter();
            keep_errno(|| s.abandon());
        }
    }
    r
}

/// Announces the connection `fd` is about to make, when a listener of the
/// tenant owns the destination: on this host, or on another host whose
/// daemon this host's daemon asks (`docs/sockets.md`, "Other hosts").
///
/// # Safety
/// `to` must be valid for `len` bytes (or null).
unsafe fn announce(fd: c_int, to: *const sockaddr, len: socklen_t) -> Option<Arc<Stream>> {
    // SAFETY: as the caller promised.
    let to = unsafe { addr::from_raw(to, len) }?;
    if to.port() == 0 || table::get(fd).is_some() {
        return None;
    }
    // Where the kernel sends it depends on the address `fd` is bound to
    // (an unspecified one when unbound).
    let bound = addr::local_of(fd)?;
    // A link-local destination gets the scope the kernel gives it (from
    // the socket's interface when it names none); one the kernel refuses
    // (no scope at all, or another interface's than the socket's) is
    // not announced, and the kernel's connect fails as it would.
    let dst = addr::link_scope(addr::connect_target(to, bound), addr::bound_dev(fd, bound))?;
    // A connection the kernel would refuse (an IPv4 destination of a
    // v6only socket, the other family's address) is not announced; nor
    // is one with a link-local address without its scope at either end.
    // A bound socket's address is the client's, checked before any daemon
    // is asked; an unbound one's is the kernel's pick, checked once known.
    let family = addr::inet_stream(fd).filter(|f| f.reaches(dst))?;
    let known = if bound.ip().is_unspecified() { dst } else { bound };
    if !addr::carriable(known, dst) {
        return None;
    }
    let local = addr::is_local(dst);
    // Another interface's or host's link-local address is nobody's (the
    // daemon would answer no): no call.
    if !local && vrdma::sockets::is_link_local(dst.ip()) {
        debug(&format!("{dst} is not this host's link-local address: TCP"));
        return None;
    }
    let d = dev()?;
    if !d.ctx.sock_lookup(dst, local).ok()? {
        debug(&format!("no vRDMA listener of this tenant at {dst} (local: {local}): TCP"));
        return None;
    }
    let mut me = bound;
    if me.port() == 0 {
        if !addr::bind(fd, addr::any(family)) {
            return None;
        }
        me = addr::local_of(fd)?;
    }
    if me.ip().is_unspecified() {
        // With its port, and a link-local source's scope.
        let mut src = addr::source_for(dst)?;
        src.set_port(me.port());
        me = src;
    }
    if !addr::carriable(me, dst) {
        debug(&format!("{me} -> {dst} is not carried (unscoped link-local, or two families): TCP"));
        return None;
    }
    let tuple = vrdma::sockets::Tuple { client: me, server: dst };
    if !d.ctx.sock_announce(tuple, local).ok()? {
        return None;
    }
    debug(&format!("announced {me} -> {dst}"));
    Stream::announced(fd, tuple)
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, a: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: libc's accept with the caller's arguments.
    let c = unsafe { real::accept(fd, a, len) };
    accepted(fd, c)
}

#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, a: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: libc's accept4 with the caller's arguments.
    let c = unsafe { real::accept4(fd, a, len, flags) };
    accepted(fd, c)
}

/// Claims connection `c` accepted on listener `fd`, if it is one of ours.
fn accepted(fd: c_int, c: c_int) -> c_int {
    if c < 0 {
        return c;
    }
    let Some(_g) = Guard::enter() else { return c };
    keep_errno(|| {
        // An inherited listener (a pre-forked worker) claims as well: the
        // registry knows tenants, and this process has its own device.
        // So does one this program inherited through exec (a master that
        // starts worker programs on its listener, socket activation): the
        // library starts afresh there and registers it at its first
        // accept. Else the master's registration would make its clients
        // announce, nobody would claim, and each would wait its whole
        // claim wait before going TCP.
        if table::get(fd).is_none() && is_listening(fd) {
            register_listener(fd);
        }
        if !matches!(table::get(fd), Some(Entry::Listener(_))) {
            return;
        }
        let (Some(me), Some(peer)) = (addr::local_of(c), addr::peer_of(c)) else { return };
        // Two families, or an unscoped link-local end: never announced,
        // so never claimed (nor counted).
        if !addr::carriable(peer, me) {
            return;
        }
        let Some(d) = dev() else { return };
        let tuple = vrdma::sockets::Tuple { client: peer, server: me };
        if d.ctx.sock_claim(tuple).unwrap_or(false) {
            debug(&format!("claimed {peer} -> {me}"));
            if let Some(s) = Stream::claimed(c, tuple) {
                table::insert(c, Entry::Stream(s));
            }
        }
    });
    c
}

/// Whether `fd` is a listening socket.
fn is_listening(fd: c_int) -> bool {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: `v` is valid for `len` bytes.
    let r = unsafe {
        real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, (&mut v as *mut c_int).cast(), &mut len)
    };
    r == 0 && v != 0
}

// ---- several messages, and splice ----

/// `sendmmsg` on a carried connection: each message in turn through
/// [`sendmsg`] (the kernel's would write into the TCP socket under the
/// ring, which the peer's library reads as wake bytes). As the kernel's:
/// the count of messages sent, each one's `msg_len` set; an error after
/// the first message ends the call with those sent so far.
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
) -> c_int {
    if !is_stream(fd) {
        // SAFETY: libc's sendmmsg with the caller's arguments.
        return unsafe { real::sendmmsg(fd, msgs, n, flags) };
    }
    if msgs.is_null() && n > 0 {
        return done(Err(libc::EFAULT)) as c_int;
    }
    // The kernel's bound on one call (UIO_MAXIOV).
    let n = n.min(1024) as usize;
    let mut sent = 0;
    while sent < n {
        // SAFETY: the caller passes `n` valid mmsghdrs.
        let m = unsafe { &mut *msgs.add(sent) };
        // SAFETY: one of the caller's valid msghdrs.
        let r = unsafe { sendmsg(fd, &m.msg_hdr, flags) };
        if r < 0 {
            return if sent == 0 { -1 } else { sent as c_int };
        }
        m.msg_len = r as libc::c_uint;
        sent += 1;
    }
    sent as c_int
}

/// `recvmmsg` on a carried connection: each message in turn through
/// [`recvmsg`], as the kernel's loop takes them (`MSG_WAITFORONE` makes
/// the ones after the first non-blocking; `timeout` is looked at between
/// messages); the count received, each one's `msg_len` set.
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if !is_stream(fd) {
        // SAFETY: libc's recvmmsg with the caller's arguments.
        return unsafe { real::recvmmsg(fd, msgs, n, flags, timeout) };
    }
    if msgs.is_null() && n > 0 {
        return done(Err(libc::EFAULT)) as c_int;
    }
    let end = if timeout.is_null() {
        None
    } else {
        // SAFETY: a non-null timeout is the caller's valid timespec.
        let t = unsafe { *timeout };
        if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
            return done(Err(libc::EINVAL)) as c_int;
        }
        Some(std::time::Instant::now() + std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
    };
    let n = n.min(1024) as usize;
    let wait_for_one = flags & libc::MSG_WAITFORONE != 0;
    let (mut got, mut flags) = (0, flags & !libc::MSG_WAITFORONE);
    while got < n {
        // SAFETY: the caller passes `n` valid mmsghdrs.
        let m = unsafe { &mut *msgs.add(got) };
        // SAFETY: one of the caller's valid msghdrs.
        let r = unsafe { recvmsg(fd, &mut m.msg_hdr, flags) };
        if r < 0 {
            return if got == 0 { -1 } else { got as c_int };
        }
        m.msg_len = r as libc::c_uint;
        got += 1;
        if end.is_some_and(|e| std::time::Instant::now() >= e) {
            break;
        }
        if wait_for_one {
            flags |= libc::MSG_DONTWAIT;
        }
    }
    got as c_int
}

/// `splice` to or from a carried connection would move the raw TCP
/// socket's bytes (wake bytes) past the ring: refused with `EINVAL`, as
/// the kernel refuses a descriptor it cannot splice, which proxies that
/// splice when they can (HAProxy) take as "copy instead". A connection
/// not decided yet is decided first (it is a data call); a plain one
/// and every other descriptor are libc's.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: libc::c_uint,
) -> ssize_t {
    for fd in [fd_in, fd_out] {
        match target(fd) {
            Target::Pass => {}
            Target::Link(_) => {
                if let Some(_g) = Guard::enter() {
                    debug("splice on a carried connection: EINVAL (read and write it instead)");
                }
                return done(Err(libc::EINVAL));
            }
            Target::Fail(e) => return done(Err(e)),
        }
    }
    // SAFETY: libc's splice with the caller's arguments.
    unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) }
}

/// Whether `fd` is a connection this library carries or may carry (a
/// stream of its table): the calls above then take it message by message.
fn is_stream(fd: c_int) -> bool {
    let Some(_g) = Guard::enter() else { return false };
    matches!(table::get(fd), Some(Entry::Stream(_)))
}

// ---- ioctl ----

/// `ioctl`: `FIONREAD` (the same request as `SIOCINQ`) on a carried
/// connection counts the bytes waiting in its ring, as the kernel counts
/// a TCP socket's unread bytes: the kernel socket under it holds only
/// wake bytes (or, before the first call, the peer's hello), and a
/// program that sizes its reads by it (libevent's `evbuffer_read`,
/// Java's `available()`) would read a byte at a time, or take an idle
/// connection for a busy one. A connection not decided yet is decided
/// first when the peer's first message (its hello, or a decline) is in
/// the socket, so that this does not wait for the peer: the exchange
/// then needs only the peer's ready byte, which it sends on reading
/// ours. Without that message nothing can have been written to it yet
/// (0). Every other request and descriptor is libc's. Declared with the
/// one argument every request takes, as glibc passes it.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: libc::c_ulong, arg: *mut c_void) -> c_int {
    if request == libc::FIONREAD as libc::c_ulong && !arg.is_null() {
        if let Some(n) = ring_bytes(fd) {
            // SAFETY: FIONREAD's argument is an int the caller gave us
            // to fill (checked non-null above), as the kernel writes it.
            unsafe { *arg.cast::<c_int>() = n.min(c_int::MAX as usize) as c_int };
            return 0;
        }
    }
    // SAFETY: libc's ioctl with the caller's arguments.
    unsafe { real::ioctl(fd, request, arg) }
}

/// What `FIONREAD` on `fd` answers, if not the kernel's count.
fn ring_bytes(fd: c_int) -> Option<usize> {
    let negotiate = {
        let _g = Guard::enter()?;
        let s = match table::get(fd) {
            Some(Entry::Stream(s)) => s,
            _ => return None,
        };
        if let Some(l) = s.link_now().filter(|_| s.owner.mine()) {
            return keep_errno(|| l.readable_bytes());
        }
        if !s.undecided() {
            return None;
        }
        keep_errno(|| peer_message_waiting(fd))
    };
    if !negotiate {
        return Some(0);
    }
    // The peer's message is there: deciding now does not wait for it.
    match keep_errno(|| target(fd)) {
        Target::Link(l) => keep_errno(|| l.readable_bytes()),
        Target::Pass | Target::Fail(_) => None,
    }
}

/// Whether a whole first message of the peer (a hello or a decline) is
/// in `fd`'s socket.
fn peer_message_waiting(fd: c_int) -> bool {
    let mut b = [0u8; crate::link::HELLO_LEN];
    // SAFETY: `b` is valid for its length.
    let r = unsafe { real::recv(fd, b.as_mut_ptr().cast(), b.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    r == b.len() as ssize_t
}

// ---- options ----

/// The library's connection on `fd`, for an option at `level`/`name` it
/// keeps (`TCP_NODELAY`, `TCP_CORK`): the library's own connections keep
/// the kernel's value once carried, and the program's aside
/// ([`crate::kept`]).
fn kept_stream(fd: c_int, level: c_int, name: c_int) -> Option<(&'static crate::kept::Kept, Arc<Stream>)> {
    let k = crate::kept::find(level, name)?;
    match table::get(fd) {
        Some(Entry::Stream(s)) => Some((k, s)),
        _ => None,
    }
}

/// The link of `fd` where the option is `SO_LINGER` and the connection
/// is carried (or was: an exec resend's queue may hold its own linger,
/// `link/outq.rs`).
fn linger_link(fd: c_int, level: c_int, name: c_int) -> Option<Arc<Link>> {
    if level != libc::SOL_SOCKET || name != libc::SO_LINGER {
        return None;
    }
    let Some(Entry::Stream(s)) = table::get(fd) else { return None };
    // (`link_now` only tries the stream's lock: a call on another thread
    // may hold it a moment. Tried a bounded while, so that the program's
    // linger is not put past the record of a queue that holds one.)
    for _ in 0..256 {
        match s.link_if_free() {
            Ok(l) => return l,
            Err(()) => std::thread::yield_now(),
        }
    }
    None
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(_g) = Guard::enter() {
        if let Some((k, s)) = kept_stream(fd, level, name) {
            // SAFETY: the caller's arguments, as setsockopt(2) takes them.
            return unsafe { k.set(&s.owner, fd, val, len) };
        }
        if let Some(l) = linger_link(fd, level, name) {
            // SAFETY: the caller's arguments, as setsockopt(2) takes them.
            return unsafe { l.program_sets_linger(fd, val, len) };
        }
    }
    // SAFETY: libc's setsockopt with the caller's arguments.
    unsafe { real::setsockopt(fd, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if let Some(_g) = Guard::enter() {
        if let Some((k, s)) = kept_stream(fd, level, name) {
            // SAFETY: the caller's arguments, as getsockopt(2) takes them.
            return unsafe { k.get(&s.owner, fd, val, len) };
        }
        if let Some(l) = linger_link(fd, level, name) {
            // SAFETY: the caller's arguments, as getsockopt(2) takes them.
            return unsafe { l.program_gets_linger(fd, val, len) };
        }
    }
    // SAFETY: libc's getsockopt with the caller's arguments.
    unsafe { real::getsockopt(fd, level, name, val, len) }
}

// ---- descriptors ----

/// `fd` is closed (or replaced): its entry goes. In a forked child the
/// parent's listeners are not unregistered (see [`Entry::ours`]); a
/// connection's drop leaves another process's link alone itself
/// ([`crate::owner`]).
fn drop_entry(fd: c_int) {
    drop_entry_hooked(fd, &mut |_| {});
}

/// Where a parent's close or copy is between its look at the `vfork`
/// views and its look after its change (tests put a child's racing close,
/// exec or exit there).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Step {
    /// Just after the look.
    Looked,
    /// After it took back what a view kept at its look set aside, just
    /// before its change of the table.
    Aside,
    /// Just after its change of the table.
    Changed,
}

/// [`drop_entry`], calling `hook` at each [`Step`].
fn drop_entry_hooked(fd: c_int, hook: &mut dyn FnMut(Step)) {
    if let Some(_g) = Guard::enter() {
        // Every close of every program comes here: the looks that need no
        // system call first (the table's lock only where it holds
        // entries, as before). Whether this is a `vfork` child (a
        // system call) matters only where the library knows `fd`, or a
        // child's view is kept or was made since the look (which comes
        // first: a child that set the entry aside and put it back between
        // a look at the table and this one would go unseen).
        let look = crate::exec::vfork::look();
        hook(Step::Looked);
        let view = look.active;
        let known = table::contains(fd) || crate::cloexec::knows(fd) || crate::epoll::may_know();
        if !known && !view && !look.moved() {
            crate::exec::left::close();
            return;
        }
        if crate::pid::vforked() {
            // Its parent's table, epoll sets and records stay (the
            // child's descriptors are its own): `crate::exec::vfork`.
            if known {
                crate::cloexec::forget(fd);
                crate::exec::vfork::closed(fd);
            }
            return;
        }
        if view {
            // The parent's own close wins over a child's kept view.
            if let Some(e) = crate::exec::vfork::parent_changed(fd) {
                drop_removed(e);
            }
        }
        hook(Step::Aside);
        crate::cloexec::forget(fd);
        crate::exec::left::close();
        keep_errno(|| crate::epoll::forget(fd));
        if let Some(e) = table::remove(fd) {
            drop_removed(e);
        }
        hook(Step::Changed);
        look.after(fd, None).into_iter().for_each(drop_removed);
    }
}

/// An entry this process no longer maps: a listener of another process's
/// (a forked child's inherited one) is left registered, the rest dropped.
fn drop_removed(e: Entry) {
    match e {
        e @ Entry::Listener(_) if !e.ours() => std::mem::forget(e),
        e => keep_errno(|| drop(e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    drop_entry(fd);
    // SAFETY: libc's close with the caller's argument.
    unsafe { real::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
        if let Target::Link(l) = target(fd) {
            // A resend cut short whose reset could not disconnect the
            // socket: no FIN behind the hole (reset for the program).
            if l.out_stuck() {
                set_errno(libc::ENOTCONN);
                return -1;
            }
            // Behind an exec's resend still queued, the FIN waits for it
            // (sent once the queue is: `link/outq.rs`).
            if l.shut_write() {
                if how == libc::SHUT_WR {
                    return 0;
                }
                // SAFETY: libc's shutdown with the caller's descriptor.
                return unsafe { real::shutdown(fd, libc::SHUT_RD) };
            }
        }
    }
    // SAFETY: libc's shutdown with the caller's arguments.
    unsafe { real::shutdown(fd, how) }
}

fn copy_entry(from: c_int, to: c_int) {
    copy_entry_hooked(from, to, &mut |_| {});
}

/// [`copy_entry`], calling `hook` at each [`Step`].
fn copy_entry_hooked(from: c_int, to: c_int, hook: &mut dyn FnMut(Step)) {
    if to < 0 {
        return;
    }
    if let Some(_g) = Guard::enter() {
        if let Some(e) = table::get(from) {
            // (A `vfork` child's copy is its own: its parent's entry of
            // `to` is kept aside and put back before its exec.)
            let vforked = crate::pid::vforked();
            let look = crate::exec::vfork::look();
            hook(Step::Looked);
            let view = !vforked && look.active;
            if vforked {
                crate::exec::vfork::closed(to);
            } else if view {
                // The parent's own copy wins over a child's kept view.
                if let Some(e) = crate::exec::vfork::parent_changed(to) {
                    drop_removed(e);
                }
            }
            hook(Step::Aside);
            if e.carried() {
                keep_errno(|| table::set_cloexec(to));
            }
            // Ours, told from what a child set aside meanwhile (a child's:
            // its copy, told from the parent's entries at its end).
            let ours = e.clone();
            if let Some(old) = table::insert(to, e) {
                drop_removed(old);
            }
            hook(Step::Changed);
            if vforked {
                crate::exec::vfork::added(to, ours);
            } else {
                look.after(to, Some(&ours)).into_iter().for_each(drop_removed);
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: libc's dup with the caller's argument.
    let r = unsafe { real::dup(fd) };
    copy_entry(fd, r);
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, to: c_int) -> c_int {
    if fd != to && fd >= 0 {
        drop_entry(to);
    }
    // SAFETY: libc's dup2 with the caller's arguments.
    let r = unsafe { real::dup2(fd, to) };
    if fd != to {
        copy_entry(fd, r);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, to: c_int, flags: c_int) -> c_int {
    if fd != to && fd >= 0 {
        drop_entry(to);
    }
    // SAFETY: libc's dup3 with the caller's arguments.
    let r = unsafe { real::dup3(fd, to, flags) };
    copy_entry(fd, r);
    r
}

/// A carried descriptor stays close-on-exec (see [`table::set_cloexec`]).
fn keep_cloexec(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> libc::c_ulong {
    if cmd != libc::F_SETFD {
        return arg;
    }
    match Guard::enter() {
        Some(_g) if table::get(fd).is_some_and(|e| e.carried()) => {
            // What the program asked for is kept (`crate::cloexec`).
            crate::cloexec::forced(fd, Some(arg & libc::FD_CLOEXEC as libc::c_ulong != 0));
            arg | libc::FD_CLOEXEC as libc::c_ulong
        }
        Some(_g) => {
            // The real flag is the program's from now on: a record left
            // (a connection demoted since) must not give back an older
            // wish at the next exec.
            crate::cloexec::forget(fd);
            arg
        }
        None => arg,
    }
}

/// `fcntl` is variadic in C; its one optional argument is an integer or a
/// pointer, which the x86-64 and AArch64 Linux calling conventions pass in
/// the third integer register either way.
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    let arg = keep_cloexec(fd, cmd, arg);
    // SAFETY: libc's fcntl with the caller's arguments.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        copy_entry(fd, r);
    }
    r
}

/// `fcntl` under its 64-bit-offset name (glibc 2.28 and later; programs
/// built with `_FILE_OFFSET_BITS=64` may call it).
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    let arg = keep_cloexec(fd, cmd, arg);
    // SAFETY: libc's fcntl64 with the caller's arguments.
    let r = unsafe { real::fcntl64(fd, cmd, arg) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        copy_entry(fd, r);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two tests below play a `vfork` child's view, which is one per
    /// process: one at a time.
    static ONE_VIEW: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Where the racing child's first close of the number, and its exec,
    /// land in the parent's call.
    const ORDERS: [(Step, Option<Step>); 5] = [
        (Step::Looked, None),
        (Step::Looked, Some(Step::Looked)),
        (Step::Looked, Some(Step::Changed)),
        (Step::Changed, Some(Step::Changed)),
        (Step::Changed, None),
    ];

    /// Plays a `vfork` child (in this memory) whose first close of `fd`
    /// comes at `close` of the parent's call and its exec at `exec` (after
    /// the call where `None`).
    fn child(fd: c_int, close: Step, exec: Option<Step>) -> impl FnMut(Step) {
        move |at| {
            if at == close {
                crate::exec::vfork::closed(fd);
            }
            if exec == Some(at) {
                crate::exec::vfork::end();
            }
        }
    }

    fn foreign_listener() -> Entry {
        use crate::listener::Listener;
        // Another process's listener: forgotten when dropped, never
        // unregistered (no daemon here).
        Entry::Listener(Arc::new(Listener { addrs: vec!["127.0.0.1:1".parse().unwrap()], pid: 0 }))
    }

    /// A parent thread's close of a connection's number racing a `vfork`
    /// child's first close of the same number, the child's close and exec
    /// at each step of the parent's call: the number stays closed in the
    /// parent's table (and a close by the child after the parent's change
    /// leaves it so). Before, the child put the entry back over the closed
    /// number at its exec (a later descriptor of that number was then
    /// taken for the connection).
    #[test]
    fn a_parents_close_racing_a_vfork_childs_first_close_of_the_number_stays_closed() {
        let _one = ONE_VIEW.lock().unwrap_or_else(|e| e.into_inner());
        for (i, (close, exec)) in ORDERS.into_iter().enumerate() {
            let fd = (1 << 20) + 10 + i as c_int;
            std::mem::forget(table::insert(fd, foreign_listener()));
            drop_entry_hooked(fd, &mut child(fd, close, exec));
            if exec.is_none() {
                crate::exec::vfork::end();
            }
            let back = table::contains(fd);
            std::mem::forget(table::remove(fd));
            assert!(!back, "the entry came back over the closed number (close {close:?}, exec {exec:?})");
        }
    }

    /// As above for a parent's `dup2(from, to)` racing a child's first
    /// close of `to`: the parent's copy stays at `to`. Before, the
    /// child's exec put `to`'s older entry back over the copy.
    #[test]
    fn a_parents_dup2_racing_a_vfork_childs_first_close_of_the_number_keeps_the_copy() {
        let _one = ONE_VIEW.lock().unwrap_or_else(|e| e.into_inner());
        for (i, (close, exec)) in ORDERS.into_iter().enumerate() {
            let from = (1 << 20) + 20 + 2 * i as c_int;
            let to = from + 1;
            let copied = foreign_listener();
            std::mem::forget(table::insert(from, copied.clone()));
            std::mem::forget(table::insert(to, foreign_listener()));
            copy_entry_hooked(from, to, &mut child(to, close, exec));
            if exec.is_none() {
                crate::exec::vfork::end();
            }
            let at_to = table::get(to);
            let kept = at_to.as_ref().is_some_and(|e| e.same(&copied));
            std::mem::forget(at_to);
            std::mem::forget(table::remove(to));
            std::mem::forget(table::remove(from));
            assert!(kept, "the copy at `to` was replaced (close {close:?}, exec {exec:?})");
        }
    }

    /// A child whose view was made before the parent's look (a spawn's
    /// file actions: its first `dup2` made it) closes the parent's number
    /// after the parent took back what the view had set aside and before
    /// its change: the number stays closed (a `dup2`: the copy stays).
    /// Before (second review, H-A), the entry came back at the exec.
    #[test]
    fn a_view_made_before_the_parents_look_puts_back_nothing_over_its_change() {
        let _one = ONE_VIEW.lock().unwrap_or_else(|e| e.into_inner());
        let fd = (1 << 20) + 50;
        std::mem::forget(table::insert(fd, foreign_listener()));
        // The child's view, made by its change of another number.
        crate::exec::vfork::closed(fd + 1);
        drop_entry_hooked(fd, &mut child(fd, Step::Aside, None));
        crate::exec::vfork::end();
        let back = table::contains(fd);
        std::mem::forget(table::remove(fd));
        assert!(!back, "the entry came back over the closed number");

        let (from, to) = ((1 << 20) + 60, (1 << 20) + 61);
        let copied = foreign_listener();
        std::mem::forget(table::insert(from, copied.clone()));
        std::mem::forget(table::insert(to, foreign_listener()));
        crate::exec::vfork::closed(to + 5);
        copy_entry_hooked(from, to, &mut child(to, Step::Aside, None));
        crate::exec::vfork::end();
        let at_to = table::get(to);
        let kept = at_to.as_ref().is_some_and(|e| e.same(&copied));
        std::mem::forget(at_to);
        std::mem::forget(table::remove(to));
        std::mem::forget(table::remove(from));
        assert!(kept, "the copy at `to` was replaced");
    }

    /// The child's own copy at a number: taken out at its end where it
    /// still is (its `dup2` onto the number the parent closes at the same
    /// moment: not left over the closed number), and only there (the
    /// parent's new entry at the number, reused after its close, stays).
    /// Before (second review, M1 and M2), the copy stayed, or the
    /// parent's new entry was dropped.
    #[test]
    fn a_childs_own_copy_goes_at_its_end_only_where_it_still_is() {
        let _one = ONE_VIEW.lock().unwrap_or_else(|e| e.into_inner());
        for (i, parent_reuses) in [false, true].into_iter().enumerate() {
            let fd = (1 << 20) + 70 + i as c_int;
            std::mem::forget(table::insert(fd, foreign_listener()));
            let copy = foreign_listener();
            let theirs = copy.clone();
            // The child's dup2 onto fd: its close (set-aside) before the
            // parent's change, or after it, then its copy.
            let close_at = if parent_reuses { Step::Changed } else { Step::Looked };
            drop_entry_hooked(fd, &mut move |at| {
                if at == close_at {
                    crate::exec::vfork::closed(fd);
                }
                if at == Step::Changed {
                    std::mem::forget(table::insert(fd, theirs.clone()));
                    crate::exec::vfork::added(fd, theirs.clone());
                }
            });
            let new = foreign_listener();
            if parent_reuses {
                // The parent's real close, then a new socket at the number.
                std::mem::forget(table::insert(fd, new.clone()));
            }
            crate::exec::vfork::end();
            let at = table::get(fd);
            let ok = match parent_reuses {
                false => at.is_none(),
                true => at.as_ref().is_some_and(|e| e.same(&new)),
            };
            std::mem::forget(at);
            std::mem::forget(table::remove(fd));
            std::mem::forget(copy);
            assert!(ok, "parent reuses the number: {parent_reuses}");
        }
    }

    /// A parent's `dup2(from, to)` (its close of `to`, then its copy)
    /// within a child's window, after the child's own `dup2(from, to)` of
    /// the same connection: the parent's copy stays at `to` after the
    /// child's end. Before (third review, M-2), the child's end took it
    /// out, told from its own copy only by its connection.
    #[test]
    fn a_parents_copy_of_the_connection_the_child_copied_to_the_number_stays() {
        let _one = ONE_VIEW.lock().unwrap_or_else(|e| e.into_inner());
        let (from, to) = ((1 << 20) + 90, (1 << 20) + 91);
        let copied = foreign_listener();
        std::mem::forget(table::insert(from, copied.clone()));
        std::mem::forget(table::insert(to, foreign_listener()));
        // The child's dup2(from, to), whole.
        crate::exec::vfork::closed(to);
        std::mem::forget(table::insert(to, copied.clone()));
        crate::exec::vfork::added(to, copied.clone());
        // The parent's.
        drop_entry(to);
        copy_entry(from, to);
        crate::exec::vfork::end();
        let at_to = table::get(to);
        let kept = at_to.as_ref().is_some_and(|e| e.same(&copied));
        std::mem::forget(at_to);
        std::mem::forget(table::remove(to));
        std::mem::forget(table::remove(from));
        assert!(kept, "the parent's copy at `to` was taken out at the child's end");
    }

    #[test]
    fn a_programs_own_set_fd_drops_a_left_flag_record() {
        let mut p = [0; 2];
        // SAFETY: pipe(2) into an array of two.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        let a = p[0];
        // A record left for a descriptor that is no carried connection
        // (its connection demoted by a spawn's file action): the program
        // then asks for close-on-exec itself.
        crate::cloexec::forced(a, Some(false));
        let arg = keep_cloexec(a, libc::F_SETFD, libc::FD_CLOEXEC as libc::c_ulong);
        // SAFETY: fcntl(2) F_SETFD on the test's descriptor.
        unsafe { real::fcntl(a, libc::F_SETFD, arg) };
        // The next exec's restore keeps the program's flag.
        crate::cloexec::restore(a);
        // SAFETY: fcntl(2) F_GETFD on the test's descriptor.
        assert_ne!(unsafe { real::fcntl(a, libc::F_GETFD, 0) } & libc::FD_CLOEXEC, 0);
        // SAFETY: closes the test's pipe.
        unsafe {
            real::close(p[0]);
            real::close(p[1]);
        }
    }
}
