//! Socket addresses to and from libc's, and what the kernel says about a
//! socket's addresses, family and type.
//!
//! IPv4 and IPv6 are carried alike, each named as the registry keys it
//! (`vrdma::sockets::key`): a v4-mapped IPv6 address
//! (`::ffff:a.b.c.d`, a dual-stack socket's IPv4 connection) is its IPv4
//! address, so that a v4 client and a dual-stack server name their
//! connection alike; an IPv6 one has no flow label and no scope id.
//! Listeners register as the kernel routes to them: a dual-stack `::`
//! socket (`IPV6_V6ONLY` off) both `0.0.0.0` and `[::]` of its port, one
//! with `IPV6_V6ONLY` `[::]` only ([`listen_addrs`]). A link-local IPv6
//! address (`fe80::/10`) keeps its scope id, its interface: the kernel
//! names a link-local end with it, the same at both ends of a connection
//! on one host, and the registry keys it. The scope a connect gets is
//! the kernel's ([`link_scope`]), and a link-local destination with none
//! is not announced (the kernel refuses it).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use libc::{c_int, sockaddr, sockaddr_in, sockaddr_in6, socklen_t};
use vrdma::sockets::{is_link_local, key};

/// Whether `a` is a link-local address without its scope id.
fn unscoped(a: SocketAddr) -> bool {
    matches!(a, SocketAddr::V6(v6) if is_link_local(a.ip()) && v6.scope_id() == 0)
}

/// The IPv4 or IPv6 address `addr` points at, if it is one (as
/// [`key`] names it).
///
/// # Safety
/// `addr` must be valid for `len` bytes (or null).
pub unsafe fn from_raw(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<sockaddr_in>() {
        return None;
    }
    // SAFETY: at least a sockaddr_in's bytes are readable (checked above);
    // read unaligned, since the caller's buffer may be any sockaddr.
    let sin: sockaddr_in = unsafe { std::ptr::read_unaligned(addr.cast()) };
    if sin.sin_family == libc::AF_INET6 as libc::sa_family_t {
        if (len as usize) < std::mem::size_of::<sockaddr_in6>() {
            return None;
        }
        // SAFETY: a sockaddr_in6's bytes are readable (checked just above).
        let sin6: sockaddr_in6 = unsafe { std::ptr::read_unaligned(addr.cast()) };
        let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
        let port = u16::from_be(sin6.sin6_port);
        let a = std::net::SocketAddrV6::new(ip, port, 0, sin6.sin6_scope_id);
        return Some(key(SocketAddr::V6(a)));
    }
    if sin.sin_family != libc::AF_INET as libc::sa_family_t {
        return None;
    }
    let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
    Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
}

/// `a` as libc's sockaddr, in storage, with its length.
fn to_raw(a: SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeroes is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_in is plain data; all zeroes is valid.
            let mut sin: sockaddr_in = unsafe { std::mem::zeroed() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            // SAFETY: a sockaddr_in fits in a sockaddr_storage, which is
            // aligned for any sockaddr.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_in6 is plain data; all zeroes is valid.
            let mut sin6: sockaddr_in6 = unsafe { std::mem::zeroed() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_flowinfo = v6.flowinfo();
            sin6.sin6_scope_id = v6.scope_id();
            // SAFETY: as above, for a sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

fn name(fd: c_int, peer: bool) -> Option<SocketAddr> {
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

pub fn local_of(fd: c_int) -> Option<SocketAddr> {
    name(fd, false)
}

pub fn peer_of(fd: c_int) -> Option<SocketAddr> {
    name(fd, true)
}

/// A TCP socket's family, as far as the registry cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    /// An IPv6 socket; `v6only`: `IPV6_V6ONLY` on (no IPv4 connection).
    V6 {
        v6only: bool,
    },
}

impl Family {
    /// Whether a connection of this socket may go to (or come from) `a`.
    pub fn reaches(self, a: SocketAddr) -> bool {
        matches!(
            (self, a),
            (Family::V4 | Family::V6 { v6only: false }, SocketAddr::V4(_))
                | (Family::V6 { .. }, SocketAddr::V6(_))
        )
    }
}

/// `fd`'s family, when it is a TCP socket of IPv4 or IPv6.
pub fn inet_stream(fd: c_int) -> Option<Family> {
    let get = |level, opt| {
        let mut v: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: `v` is valid for `len` bytes.
        let r = unsafe { crate::real::getsockopt(fd, level, opt, (&mut v as *mut c_int).cast(), &mut len) };
        (r == 0).then_some(v)
    };
    if get(libc::SOL_SOCKET, libc::SO_TYPE) != Some(libc::SOCK_STREAM) {
        return None;
    }
    match get(libc::SOL_SOCKET, libc::SO_DOMAIN)? {
        libc::AF_INET => Some(Family::V4),
        libc::AF_INET6 => Some(Family::V6 { v6only: get(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)? != 0 }),
        _ => None,
    }
}

/// The interface `fd` is bound to (`SO_BINDTOIFINDEX`: by a bind to a
/// link-local address with its scope, or `SO_BINDTODEVICE`), 0 for none;
/// where the kernel cannot say (before Linux 5.0), the scope of its bound
/// address `bound`.
pub fn bound_dev(fd: c_int, bound: SocketAddr) -> u32 {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: `v` is valid for `len` bytes.
    let r = unsafe {
        crate::real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_BINDTOIFINDEX,
            (&mut v as *mut c_int).cast(),
            &mut len,
        )
    };
    match (r, bound) {
        (0, _) => v.max(0) as u32,
        (_, SocketAddr::V6(v6)) => v6.scope_id(),
        _ => 0,
    }
}

/// The link-local destination `dst` with the scope the kernel connects it
/// on from a socket bound to interface `dev` (0: none), as Linux's
/// `tcp_v6_connect` does (checked with plain sockets on Linux 6): its own
/// scope, which a socket bound to another interface may not use; or,
/// with none, the socket's interface. `None`: the kernel refuses the
/// connect (`EINVAL`), and it is left to. Any other address as it is.
pub fn link_scope(dst: SocketAddr, dev: u32) -> Option<SocketAddr> {
    let SocketAddr::V6(mut v6) = dst else { return Some(dst) };
    if !is_link_local(dst.ip()) {
        return Some(dst);
    }
    match (v6.scope_id(), dev) {
        (0, 0) => return None,
        (0, dev) => v6.set_scope_id(dev),
        (s, dev) if dev != 0 && dev != s => return None,
        _ => {}
    }
    Some(SocketAddr::V6(v6))
}

/// The addresses a listener of `family` bound at `at` owns, as the
/// registry keys them: a dual-stack `::` one IPv4's `0.0.0.0` and IPv6's
/// `[::]`; a link-local one its address with its scope (none without:
/// the kernel binds no such socket).
pub fn listen_addrs(family: Family, at: SocketAddr) -> Vec<SocketAddr> {
    if unscoped(at) {
        return Vec::new();
    }
    match (family, at) {
        (Family::V6 { v6only: false }, SocketAddr::V6(v6)) if v6.ip().is_unspecified() => {
            vec![SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), at.port()), at]
        }
        _ => vec![at],
    }
}

/// Where a connection to `dst` goes from a socket whose local address
/// is `me` (as [`key`] names it; unspecified when unbound), as the
/// kernel routes an unspecified destination: IPv4's `0.0.0.0` goes to
/// the socket's bound source address, or to `127.0.0.1` when it has
/// none; IPv6's `::` to `127.0.0.1` from a v4-mapped source (IPv4 here)
/// and to `::1` from any other, even one bound to another address.
pub fn connect_target(dst: SocketAddr, me: SocketAddr) -> SocketAddr {
    let ip: IpAddr = match dst.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => match me.ip() {
            IpAddr::V4(src) if !src.is_unspecified() => src.into(),
            _ => Ipv4Addr::LOCALHOST.into(),
        },
        IpAddr::V6(ip) if ip.is_unspecified() => match me {
            SocketAddr::V4(_) => Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => Ipv6Addr::LOCALHOST.into(),
        },
        _ => return dst,
    };
    SocketAddr::new(ip, dst.port())
}

/// Whether a connection between `a` and `b` (as [`key`] names them) may
/// be carried: both of one family (the kernel connects no other) and
/// neither a link-local address without its scope (which names no
/// interface; the kernel gives every link-local end of a connection its
/// scope), and either both link-local on one interface or neither. Both
/// ends ask it, the client of its own address and the server of its
/// accepted peer's.
pub fn carriable(a: SocketAddr, b: SocketAddr) -> bool {
    let scope = |x: SocketAddr| match x {
        SocketAddr::V6(v6) if is_link_local(x.ip()) => Some(v6.scope_id()),
        _ => None,
    };
    // A link-local end with a global one (a client bound to one of them
    // and connecting to the other) is left to TCP: both ends' names of it
    // were not checked; two link-local ends are on one interface.
    a.is_ipv4() == b.is_ipv4() && !unscoped(a) && !unscoped(b) && scope(a) == scope(b)
}

/// Binds `fd` to `a` (`fd` of `a`'s family).
pub fn bind(fd: c_int, a: SocketAddr) -> bool {
    let (ss, len) = to_raw(a);
    // SAFETY: `ss` holds a valid sockaddr of `len` bytes.
    unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) == 0 }
}

/// The unspecified address of `family`, port 0: what an unbound socket
/// of that family binds to.
pub fn any(family: Family) -> SocketAddr {
    match family {
        Family::V4 => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
        Family::V6 { .. } => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
    }
}

/// A UDP socket, closed on drop.
struct Udp(c_int);

impl Udp {
    fn new(v6: bool) -> Option<Udp> {
        let domain = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        // SAFETY: socket(2) with constant arguments.
        let fd = unsafe { libc::socket(domain, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        (fd >= 0).then_some(Udp(fd))
    }

    /// One of the family `a` needs (a v4-mapped address is IPv4 already).
    fn for_addr(a: SocketAddr) -> Option<Udp> {
        Udp::new(a.is_ipv6())
    }
}

impl Drop for Udp {
    fn drop(&mut self) {
        // SAFETY: closes the descriptor this value owns.
        unsafe { crate::real::close(self.0) };
    }
}

/// Whether `a`'s address is one of this host (its network namespace): a
/// UDP socket can bind to it. A link-local address is this host's only
/// on the interface its scope names (an address of the other end of a
/// link, or this host's on another interface, is not).
pub fn is_local(a: SocketAddr) -> bool {
    if a.ip().is_loopback() {
        return true;
    }
    if unscoped(a) {
        return false;
    }
    let mut a = a;
    a.set_port(0);
    Udp::for_addr(a).is_some_and(|u| bind(u.0, a))
}

/// The source address the kernel picks towards `dst` (port 0; a
/// link-local one with its scope, the interface towards `dst`).
pub fn source_for(dst: SocketAddr) -> Option<SocketAddr> {
    let u = Udp::for_addr(dst)?;
    let (ss, len) = to_raw(dst);
    // SAFETY: `ss` holds a valid sockaddr of `len` bytes.
    let r = unsafe { crate::real::connect(u.0, (&ss as *const libc::sockaddr_storage).cast(), len) };
    if r != 0 {
        return None;
    }
    local_of(u.0).map(|mut a| {
        a.set_port(0);
        a
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn addresses_round_trip_through_libc_as_the_registry_keys_them() {
        for s in ["127.0.0.1:5000", "[::1]:5000", "[fd00::1]:1"] {
            let (ss, len) = to_raw(a(s));
            // SAFETY: `ss` holds `len` bytes of a sockaddr.
            let back = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) };
            assert_eq!(back, Some(a(s)));
        }
        let (ss, len) = to_raw(a("[::ffff:127.0.0.1]:5000"));
        // SAFETY: as above.
        let back = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) };
        assert_eq!(back, Some(a("127.0.0.1:5000")), "v4-mapped is IPv4");
        let (ss, _) = to_raw(a("[::1]:5000"));
        // SAFETY: as above, and too short for a sockaddr_in6.
        let short = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), 20) };
        assert_eq!(short, None);
    }

    #[test]
    fn a_dual_stack_listener_owns_both_families_and_a_v6only_one_ipv6() {
        let dual = Family::V6 { v6only: false };
        assert_eq!(listen_addrs(dual, a("[::]:80")), [a("0.0.0.0:80"), a("[::]:80")]);
        assert_eq!(listen_addrs(Family::V6 { v6only: true }, a("[::]:80")), [a("[::]:80")]);
        assert_eq!(listen_addrs(dual, a("[::1]:80")), [a("[::1]:80")]);
        assert_eq!(listen_addrs(Family::V4, a("0.0.0.0:80")), [a("0.0.0.0:80")]);
        assert!(listen_addrs(dual, a("[fe80::1]:80")).is_empty(), "no scope");
        assert!(!Family::V6 { v6only: true }.reaches(a("127.0.0.1:80")));
        assert!(dual.reaches(a("127.0.0.1:80")) && dual.reaches(a("[::1]:80")));
        assert!(!Family::V4.reaches(a("[::1]:80")));
    }

    /// As the kernel routes them (checked with plain sockets on Linux 6):
    /// IPv4's `0.0.0.0` to the bound source, IPv6's `::` to loopback of
    /// the source's family whatever it is bound to.
    #[test]
    fn an_unspecified_destination_goes_where_the_kernel_sends_it() {
        let t = |dst, me| connect_target(a(dst), a(me));
        assert_eq!(t("0.0.0.0:80", "0.0.0.0:0"), a("127.0.0.1:80"));
        assert_eq!(t("0.0.0.0:80", "0.0.0.0:4000"), a("127.0.0.1:80"));
        assert_eq!(t("0.0.0.0:80", "127.0.0.2:4000"), a("127.0.0.2:80"));
        assert_eq!(t("0.0.0.0:80", "192.0.2.7:0"), a("192.0.2.7:80"));
        // A dual-stack socket's `::ffff:0.0.0.0` is `0.0.0.0` once keyed.
        assert_eq!(t("0.0.0.0:80", "[::]:0"), a("127.0.0.1:80"));
        assert_eq!(t("[::]:80", "[::]:0"), a("[::1]:80"));
        assert_eq!(t("[::]:80", "[fd00::2]:4000"), a("[::1]:80"));
        // Bound to `::ffff:127.0.0.2`, keyed `127.0.0.2`.
        assert_eq!(t("[::]:80", "127.0.0.2:4000"), a("127.0.0.1:80"));
        assert_eq!(t("127.0.0.3:80", "127.0.0.2:4000"), a("127.0.0.3:80"));
        assert_eq!(t("[::1]:80", "127.0.0.2:4000"), a("[::1]:80"));
    }

    #[test]
    fn an_unscoped_link_local_end_or_two_families_are_not_carried() {
        assert!(carriable(a("127.0.0.2:4000"), a("127.0.0.1:80")));
        assert!(carriable(a("[fd00::2]:4000"), a("[::1]:80")));
        assert!(!carriable(a("[fe80::1]:4000"), a("[fd00::2]:80")), "a link-local client");
        assert!(!carriable(a("[fd00::2]:4000"), a("[fe80::2]:80")), "a link-local server");
        assert!(carriable(a("[fe80::1%3]:4000"), a("[fe80::1%3]:80")), "with their scope");
        assert!(!carriable(a("[fe80::1%3]:4000"), a("[fe80::1%4]:80")), "two interfaces");
        assert!(!carriable(a("[fe80::1%3]:4000"), a("[fd00::2]:80")), "with a global end");
        assert!(!carriable(a("127.0.0.2:4000"), a("[::1]:80")));
        assert!(!carriable(a("[::1]:4000"), a("127.0.0.1:80")));
    }

    #[test]
    fn loopback_is_local_and_unscoped_link_local_is_not() {
        assert!(is_local(a("[::1]:0")));
        assert!(is_local(a("127.0.0.1:5000")));
        assert!(!is_local(a("[fe80::1]:0")));
        assert!(!is_local(a("[2001:db8::1]:0")), "a documentation address is nobody's");
    }

    /// As `tcp_v6_connect` scopes a link-local destination (checked with
    /// plain sockets on Linux 6): its own scope, or the bound interface's
    /// when it has none; none at all, or another than the bound
    /// interface's, is refused (`EINVAL`).
    #[test]
    fn a_link_local_destination_is_scoped_as_the_kernel_connects_it() {
        assert_eq!(link_scope(a("[fe80::1%3]:80"), 0), Some(a("[fe80::1%3]:80")));
        assert_eq!(link_scope(a("[fe80::1%3]:80"), 3), Some(a("[fe80::1%3]:80")));
        assert_eq!(link_scope(a("[fe80::1]:80"), 5), Some(a("[fe80::1%5]:80")));
        assert_eq!(link_scope(a("[fe80::1]:80"), 0), None);
        assert_eq!(link_scope(a("[fe80::1%3]:80"), 5), None);
        assert_eq!(link_scope(a("[fd00::1]:80"), 5), Some(a("[fd00::1]:80")));
        assert_eq!(link_scope(a("127.0.0.1:80"), 5), Some(a("127.0.0.1:80")));
    }

    #[test]
    fn a_link_local_address_keeps_its_scope_through_libc() {
        let (ss, len) = to_raw(a("[fe80::1%7]:5000"));
        // SAFETY: `ss` holds `len` bytes of a sockaddr.
        let back = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) };
        assert_eq!(back, Some(a("[fe80::1%7]:5000")));
        let (ss, len) = to_raw(a("[fd00::1%7]:5000"));
        // SAFETY: as above.
        let back = unsafe { from_raw((&ss as *const libc::sockaddr_storage).cast(), len) };
        assert_eq!(back, Some(a("[fd00::1]:5000")), "only a link-local keeps a scope");
        let dual = Family::V6 { v6only: false };
        assert_eq!(listen_addrs(dual, a("[fe80::1%7]:80")), [a("[fe80::1%7]:80")]);
    }
}
