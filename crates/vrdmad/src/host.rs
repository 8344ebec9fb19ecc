//! The host's identity on the fabric: the IPv4 address its GID carries.

use std::net::Ipv4Addr;

/// The first IPv4 address of an interface that is up and not loopback,
/// else 127.0.0.1 (a network namespace with only `lo`).
pub fn detect_ipv4() -> Ipv4Addr {
    let mut found = None;
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `ifap` that we free below
    // with freeifaddrs; we only read the list in between.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Ipv4Addr::LOCALHOST;
    }
    let mut cur = ifap;
    while !cur.is_null() && found.is_none() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs.
        let ifa = unsafe { &*cur };
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        if up && !lo && !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr is non-null and points to a sockaddr of the
            // family it names; we reinterpret only AF_INET ones.
            let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if fam == libc::AF_INET {
                // SAFETY: the family is AF_INET, so this is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `ifap` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found.unwrap_or(Ipv4Addr::LOCALHOST)
}
