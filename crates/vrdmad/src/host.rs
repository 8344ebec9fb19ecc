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

/// The host's IPv6 addresses that another host can reach it at, in
/// order: of interfaces that are up, neither loopback, link-local
/// (`fe80::/10`, which names an address only with its interface),
/// v4-mapped, multicast nor unspecified. What the daemon advertises to
/// its peers (`docs/sockets.md`, "Other hosts").
pub fn ipv6_addrs() -> Vec<std::net::Ipv6Addr> {
    let mut found = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `ifap` that we free below
    // with freeifaddrs; we only read the list in between.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return found;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs.
        let ifa = unsafe { &*cur };
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
        let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        // SAFETY: ifa_addr, when non-null, points to a sockaddr of the
        // family it names; we read its family only.
        if up
            && !lo
            && !ifa.ifa_addr.is_null()
            && unsafe { (*ifa.ifa_addr).sa_family } as i32 == libc::AF_INET6
        {
            // SAFETY: the family is AF_INET6, so this is a sockaddr_in6.
            let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            if is_advertisable(ip) {
                found.push(ip);
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `ifap` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found.sort_unstable();
    found.dedup();
    found
}

/// This host's IPv6 addresses ([`ipv6_addrs`]) read every so often on a
/// thread of its own: a read is a netlink dump, about 33 µs on the 2-vCPU
/// machine, which the engine's thread (the data path) should not pay
/// once a second. The engine takes what changed ([`Ipv6Watch::take`]) in
/// its passes; the thread ends when the engine drops its watch.
pub struct Ipv6Watch {
    changed: std::sync::Mutex<Option<Vec<std::net::Ipv6Addr>>>,
    /// Set once `changed` holds a list: the engine's passes look at this
    /// flag, not the lock.
    fresh: std::sync::atomic::AtomicBool,
}

impl Ipv6Watch {
    /// Reads every `every`, starting from `first` (what the caller read);
    /// `None` if no thread could be made (the caller reads them itself).
    pub fn spawn(
        every: std::time::Duration,
        first: Vec<std::net::Ipv6Addr>,
    ) -> Option<std::sync::Arc<Ipv6Watch>> {
        let watch = std::sync::Arc::new(Ipv6Watch {
            changed: std::sync::Mutex::new(None),
            fresh: std::sync::atomic::AtomicBool::new(false),
        });
        let weak = std::sync::Arc::downgrade(&watch);
        let spawned = std::thread::Builder::new().name("vrdma-addrs".into()).spawn(move || {
            let mut last = first;
            loop {
                std::thread::sleep(every);
                let Some(watch) = weak.upgrade() else { return };
                let now = ipv6_addrs();
                if now != last {
                    last = now.clone();
                    *watch.changed.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
                    watch.fresh.store(true, std::sync::atomic::Ordering::Release);
                }
            }
        });
        match spawned {
            Ok(_) => Some(watch),
            Err(e) => {
                tracing::debug!(error = %e, "no thread to watch the host's IPv6 addresses; the engine reads them");
                None
            }
        }
    }

    /// The addresses as read since the last take, if they changed.
    pub fn take(&self) -> Option<Vec<std::net::Ipv6Addr>> {
        if !self.fresh.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return None;
        }
        self.changed.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Whether `ip` is an IPv6 address another host may reach this one at.
pub fn is_advertisable(ip: std::net::Ipv6Addr) -> bool {
    !(ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || ip.to_ipv4_mapped().is_some()
        || vrdma_core::sockets::is_link_local(ip.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_addresses_other_hosts_reach_are_advertised() {
        let a = |s: &str| s.parse::<std::net::Ipv6Addr>().unwrap();
        assert!(is_advertisable(a("fd00:77::2")));
        assert!(is_advertisable(a("2001:db8::1")));
        for no in ["::1", "::", "fe80::1", "febf::1", "ff02::1", "::ffff:10.0.0.1"] {
            assert!(!is_advertisable(a(no)), "{no}");
        }
        // This host's (whatever they are) pass the same test.
        assert!(ipv6_addrs().into_iter().all(is_advertisable));
    }

    #[test]
    fn the_watch_reports_a_change_once_and_its_thread_ends_with_it() {
        // Started from a list that is surely not this host's: the first
        // read differs, and is reported once.
        let bogus = vec!["2001:db8::dead".parse().unwrap()];
        let watch = Ipv6Watch::spawn(std::time::Duration::from_millis(5), bogus).expect("a thread");
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let seen = loop {
            if let Some(a) = watch.take() {
                break a;
            }
            assert!(std::time::Instant::now() < end, "no change reported within 10 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(seen, ipv6_addrs());
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(watch.take(), None, "unchanged since: nothing more");
        let weak = std::sync::Arc::downgrade(&watch);
        drop(watch);
        // The thread holds it only while it reads: gone within a round.
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while weak.upgrade().is_some() {
            assert!(std::time::Instant::now() < end, "the watch outlived its owner");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
