//! IPv4 socket addresses to and from libc's, and what the kernel says
//! about a socket's addresses and type.
//!
//! An IPv6 socket counts where its address is an IPv4 one: v4-mapped
//! (`::ffff:a.b.c.d`, a dual-stack socket's IPv4 connection), or the
//! unspecified `::` of a dual-stack listener, which takes IPv4 clients on
//! every local address as `0.0.0.0` does.

use std::net::{Ipv4Addr, SocketAddrV4};

use libc::{c_int, sockaddr, sockaddr_in, socklen_t};

/// The IPv4 address `addr` points at, if it is one.
///
/// # Safety
/// `addr` must be valid for `len` bytes (or null).
pub unsafe fn from_raw(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddrV4> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<sockaddr_in>() {
        return None;
    }
    // SAFETY: at least a sockaddr_in's bytes are readable (checked above);
    // read unaligned, since the caller's buffer may be any sockaddr.
    let sin: sockaddr_in = unsafe { std::ptr::read_unaligned(addr.cast()) };
    if sin.sin_family == libc::AF_INET6 as libc::sa_family_t
        && (len as usize) >= std::mem::size_of::<libc::sockaddr_in6>()
    {
        // SAFETY: a sockaddr_in6's bytes are readable (checked just above).
        let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read_unaligned(addr.cast()) };
        let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
        let port = u16::from_be(sin6.sin6_port);
        return match ip.to_ipv4_mapped() {
            Some(v4) => Some(SocketAddrV4::new(v4, port)),
            None if ip.is_unspecified() => Some(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)),
            None => None,
        };
    }
    if sin.sin_family != libc::AF_INET as libc::sa_family_t {
        return None;
    }
    Some(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)), u16::from_be(sin.sin_port)))
}

fn to_raw(a: SocketAddrV4) -> sockaddr_in {
    // SAFETY: sockaddr_in is plain data; all zeroes is valid.
    let mut sin: sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as libc::sa_family_t;
    sin.sin_port = a.port().to_be();
    sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
    sin
}

fn name(fd: c_int, peer: bool) -> Option<SocketAddrV4> {
    // SAFETY: sockaddr_storage is plain data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast::<sockaddr>();
    // SAFETY: `p` is valid for `len` bytes, which the kernel updates.
    let r = unsafe {
        if peer {
            libc::getpeername(fd, p, &mut len)
        } else {
            libc::getsockname(fd, p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    // SAFETY: `p` holds `len` bytes the kernel wrote.
    unsafe { from_raw(p, len) }
}

pub fn local_of(fd: c_int) -> Option<SocketAddrV4> {
    name(fd, false)
}

pub fn peer_of(fd: c_int) -> Option<SocketAddrV4> {
    name(fd, true)
}

/// Whether `fd` is a TCP socket that may carry IPv4: an IPv4 one, or an
/// IPv6 one that is not `IPV6_V6ONLY`.
pub fn is_inet_stream(fd: c_int) -> bool {
    let get = |level, opt| {
        let mut v: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: `v` is valid for `len` bytes.
        let r = unsafe { crate::real::getsockopt(fd, level, opt, (&mut v as *mut c_int).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    if get(libc::SOL_SOCKET, libc::SO_TYPE) != Some(libc::SOCK_STREAM) {
        return false;
    }
    match get(libc::SOL_SOCKET, libc::SO_DOMAIN) {
        Some(libc::AF_INET) => true,
        Some(libc::AF_INET6) => get(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) == Some(0),
        _ => false,
    }
}

/// Binds `fd` (an IPv4 socket) to `a`.
pub fn bind(fd: c_int, a: SocketAddrV4) -> bool {
    let sin = to_raw(a);
    // SAFETY: `sin` is a valid sockaddr_in of the given length.
    unsafe {
        libc::bind(fd, (&sin as *const sockaddr_in).cast(), std::mem::size_of::<sockaddr_in>() as socklen_t)
            == 0
    }
}

/// A UDP socket, closed on drop.
struct Udp(c_int);

impl Udp {
    fn new() -> Option<Udp> {
        // SAFETY: socket(2) with constant arguments.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        (fd >= 0).then_some(Udp(fd))
    }
}

impl Drop for Udp {
    fn drop(&mut self) {
        // SAFETY: closes the descriptor this value owns.
        unsafe { crate::real::close(self.0) };
    }
}

/// Whether `ip` is an address of this host (its network namespace): a
/// UDP socket can bind to it.
pub fn is_local(ip: Ipv4Addr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    Udp::new().is_some_and(|u| bind(u.0, SocketAddrV4::new(ip, 0)))
}

/// The source address the kernel picks towards `dst`.
pub fn source_for(dst: SocketAddrV4) -> Option<Ipv4Addr> {
    let u = Udp::new()?;
    let sin = to_raw(dst);
    // SAFETY: `sin` is a valid sockaddr_in of the given length.
    let r = unsafe {
        crate::real::connect(
            u.0,
            (&sin as *const sockaddr_in).cast(),
            std::mem::size_of::<sockaddr_in>() as socklen_t,
        )
    };
    if r != 0 {
        return None;
    }
    local_of(u.0).map(|a| *a.ip())
}
