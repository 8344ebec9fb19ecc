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
/// its peers (`docs/sockets.md`, "Other hosts"). A read that fails
/// (`getifaddrs`: out of memory, of descriptors) returns the last list
/// read, not an empty one: "no addresses" would be told to every peer,
/// and this host's IPv6 connections from other hosts would go plain TCP
/// until the next change.
pub fn ipv6_addrs() -> Vec<std::net::Ipv6Addr> {
    kept(&LAST_READ, read_ipv6_addrs(), std::time::Instant::now())
}

/// The last list [`ipv6_addrs`] read (the host has one), and when a
/// failed read was last warned of.
static LAST_READ: std::sync::Mutex<LastRead> = std::sync::Mutex::new(LastRead { addrs: None, warned: None });

struct LastRead {
    addrs: Option<Vec<std::net::Ipv6Addr>>,
    warned: Option<std::time::Instant>,
}

/// A failed read is warned of at most once per this.
const WARN_FAILED_READ: std::time::Duration = std::time::Duration::from_secs(60);

/// `read`, kept in `last` when it is a list; else the last list kept
/// (none yet: empty), the failure warned of at most once per
/// [`WARN_FAILED_READ`].
fn kept(
    last: &std::sync::Mutex<LastRead>,
    read: std::io::Result<Vec<std::net::Ipv6Addr>>,
    now: std::time::Instant,
) -> Vec<std::net::Ipv6Addr> {
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    match read {
        Ok(addrs) => {
            last.addrs = Some(addrs.clone());
            addrs
        }
        Err(e) => {
            if last.warned.is_none_or(|t| now.saturating_duration_since(t) >= WARN_FAILED_READ) {
                last.warned = Some(now);
                tracing::warn!(
                    error = %e,
                    "cannot read this host's IPv6 addresses; the last ones read stand (said at most once a minute)"
                );
            }
            last.addrs.clone().unwrap_or_default()
        }
    }
}

/// One read of [`ipv6_addrs`]' list.
fn read_ipv6_addrs() -> std::io::Result<Vec<std::net::Ipv6Addr>> {
    let mut found = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `ifap` that we free below
    // with freeifaddrs; we only read the list in between.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(std::io::Error::last_os_error());
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
    Ok(found)
}

/// This host's IPv6 addresses ([`ipv6_addrs`]) read every so often on a
/// thread of its own: a read is a netlink dump, about 33 µs on the 2-vCPU
/// machine, which the engine's thread (the data path) should not pay
/// once a second. The engine takes what changed ([`Ipv6Watch::take`]) in
/// its passes; the thread ends when the engine drops its watch.
///
/// A read the engine needs at once ([`Ipv6Watch::read_now`]) goes through
/// the same list as the thread's rounds: the thread compares its next
/// read with the newest read by either, so an address that comes and goes
/// again between two rounds is reported (with a list of its own per
/// reader, the thread's round found "no change" against its older read,
/// and the engine kept the forced read's list). The reads themselves are
/// made off the lock (a forced read, under the engine's lock, does not
/// wait for the thread's dump), and each is kept only if it began after
/// the one kept: the newest read wins whichever ends last. Forced reads
/// are at most one per gap: a caller within it is served by the last
/// read (a caller that came while one was under way waits for that one),
/// and a caller is served by any read that began after it was called.
pub struct Ipv6Watch {
    state: std::sync::Mutex<WatchState>,
    /// Wakes the callers that wait for a forced read under way.
    forced: std::sync::Condvar,
    /// Set once `state.changed` holds a list: the engine's passes look at
    /// this flag, not the lock.
    fresh: std::sync::atomic::AtomicBool,
    read: fn() -> Vec<std::net::Ipv6Addr>,
}

struct WatchState {
    /// The newest read, by the thread or forced, and when it began
    /// (`None`: the list the watch started from).
    last: Vec<std::net::Ipv6Addr>,
    began: Option<std::time::Instant>,
    /// A change the thread found that the engine has not taken.
    changed: Option<Vec<std::net::Ipv6Addr>>,
    /// When the last forced read began, and whether it is under way.
    forced_at: Option<std::time::Instant>,
    forcing: bool,
}

impl WatchState {
    /// Keeps `addrs`, read from `began`, if no read that began later was
    /// kept; whether it did.
    fn keep(&mut self, began: std::time::Instant, addrs: Vec<std::net::Ipv6Addr>) -> bool {
        if self.began.is_some_and(|t| t > began) {
            return false;
        }
        self.began = Some(began);
        self.last = addrs;
        true
    }
}

impl Ipv6Watch {
    /// Reads every `every`, starting from `first` (what the caller read);
    /// `None` if no thread could be made (the caller reads them itself).
    pub fn spawn(
        every: std::time::Duration,
        first: Vec<std::net::Ipv6Addr>,
    ) -> Option<std::sync::Arc<Ipv6Watch>> {
        let watch = Ipv6Watch::unthreaded(ipv6_addrs, first);
        let weak = std::sync::Arc::downgrade(&watch);
        let spawned = std::thread::Builder::new().name("vrdma-addrs".into()).spawn(move || loop {
            std::thread::sleep(every);
            let Some(watch) = weak.upgrade() else { return };
            watch.poll();
        });
        match spawned {
            Ok(_) => Some(watch),
            Err(e) => {
                tracing::debug!(error = %e, "no thread to watch the host's IPv6 addresses; the engine reads them");
                None
            }
        }
    }

    /// A watch with no thread, reading with `read` when [`Ipv6Watch::poll`]
    /// is called (the engine's passes where no thread could be made;
    /// tests, with a reader of their own).
    pub fn unthreaded(
        read: fn() -> Vec<std::net::Ipv6Addr>,
        first: Vec<std::net::Ipv6Addr>,
    ) -> std::sync::Arc<Ipv6Watch> {
        let st = WatchState { last: first, began: None, changed: None, forced_at: None, forcing: false };
        std::sync::Arc::new(Ipv6Watch {
            state: std::sync::Mutex::new(st),
            forced: std::sync::Condvar::new(),
            fresh: std::sync::atomic::AtomicBool::new(false),
            read,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One round of the thread: reads (off the lock), and keeps the list
    /// for [`Ipv6Watch::take`] if it differs from the newest read (and no
    /// read that began later was kept meanwhile).
    pub fn poll(&self) {
        let began = std::time::Instant::now();
        let now = (self.read)();
        let mut st = self.lock();
        let differs = now != st.last;
        if st.keep(began, now) && differs {
            st.changed = Some(st.last.clone());
            self.fresh.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// The addresses now: read (off the lock), unless a read began since
    /// this call did, or a forced read began less than `gap` ago (then the
    /// newest read's, the thread's or that one's, waiting for that one if
    /// it is under way). The thread's next round compares with what this
    /// returns, and a change it found before is taken with it.
    pub fn read_now(&self, gap: std::time::Duration) -> Vec<std::net::Ipv6Addr> {
        let called = std::time::Instant::now();
        let mut st = self.lock();
        loop {
            if st.began.is_some_and(|t| t >= called) {
                break;
            }
            if st.forcing {
                st = self.forced.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            if st.forced_at.is_some_and(|t| t.elapsed() < gap) {
                break;
            }
            let began = std::time::Instant::now();
            st.forced_at = Some(began);
            st.forcing = true;
            drop(st);
            let addrs = (self.read)();
            st = self.lock();
            st.forcing = false;
            st.keep(began, addrs);
            self.forced.notify_all();
            break;
        }
        st.changed = None;
        self.fresh.store(false, std::sync::atomic::Ordering::Release);
        st.last.clone()
    }

    /// The addresses as read since the last take, if they changed.
    pub fn take(&self) -> Option<Vec<std::net::Ipv6Addr>> {
        if !self.fresh.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return None;
        }
        self.lock().changed.take()
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
        assert!(read_ipv6_addrs().is_ok());
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

    static ADDRS: std::sync::Mutex<Vec<std::net::Ipv6Addr>> = std::sync::Mutex::new(Vec::new());
    static READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn a(s: &str) -> std::net::Ipv6Addr {
        s.parse().unwrap()
    }

    /// An address that went and came back between two of the thread's
    /// rounds, with a forced read in between that saw it gone: the next
    /// round reports it back (review: the thread compared with its own
    /// last read, saw no change, and the engine kept the forced read's
    /// list, without the address, until the next change).
    #[test]
    fn a_forced_read_is_the_threads_last_too() {
        let read: fn() -> Vec<std::net::Ipv6Addr> = || ADDRS.lock().unwrap().clone();
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        *ADDRS.lock().unwrap() = vec![a("fd00::1")];
        let watch = Ipv6Watch::unthreaded(read, vec![a("fd00::1")]);
        ADDRS.lock().unwrap().clear();
        assert_eq!(watch.read_now(std::time::Duration::ZERO), Vec::<std::net::Ipv6Addr>::new());
        *ADDRS.lock().unwrap() = vec![a("fd00::1")];
        watch.poll();
        assert_eq!(watch.take(), Some(vec![a("fd00::1")]), "the address came back");
        watch.poll();
        assert_eq!(watch.take(), None);
        // A change the thread found and the engine did not take yet goes
        // with a forced read, which returns the newer list.
        *ADDRS.lock().unwrap() = vec![a("fd00::2")];
        watch.poll();
        *ADDRS.lock().unwrap() = vec![a("fd00::3")];
        assert_eq!(watch.read_now(std::time::Duration::ZERO), vec![a("fd00::3")]);
        assert_eq!(watch.take(), None);
    }

    /// Forced reads are one per gap: callers within it, also ones that
    /// waited on the lock meanwhile, get that read's list (or the
    /// thread's newer one), with no read of their own.
    #[test]
    fn forced_reads_are_one_per_gap() {
        let read: fn() -> Vec<std::net::Ipv6Addr> = || {
            READS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            ADDRS.lock().unwrap().clone()
        };
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        *ADDRS.lock().unwrap() = vec![a("fd00::1")];
        READS.store(0, std::sync::atomic::Ordering::SeqCst);
        let watch = Ipv6Watch::unthreaded(read, Vec::new());
        let hour = std::time::Duration::from_secs(3600);
        let callers: Vec<_> = (0..8)
            .map(|_| {
                let w = watch.clone();
                std::thread::spawn(move || w.read_now(hour))
            })
            .collect();
        for c in callers {
            assert_eq!(c.join().unwrap(), vec![a("fd00::1")]);
        }
        assert_eq!(READS.load(std::sync::atomic::Ordering::SeqCst), 1, "one read for eight callers");
        // Within the gap, a change is seen by the thread's round, and
        // the next forced call gets that.
        *ADDRS.lock().unwrap() = vec![a("fd00::2")];
        assert_eq!(watch.read_now(hour), vec![a("fd00::1")], "served by the last read");
        watch.poll();
        assert_eq!(watch.read_now(hour), vec![a("fd00::2")]);
        assert_eq!(READS.load(std::sync::atomic::Ordering::SeqCst), 2);
        // Past the gap (none here), a forced call reads.
        assert_eq!(watch.read_now(std::time::Duration::ZERO), vec![a("fd00::2")]);
        assert_eq!(READS.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    /// The thread's dump is made off the watch's lock: a forced read
    /// meanwhile makes its own at once, and the thread's, which began
    /// before it, is not kept when it ends after it (review: the lock
    /// was held through the dump, so a forced read under the engine's
    /// lock waited for the thread's, then made its own).
    #[test]
    fn a_forced_read_does_not_wait_for_the_threads_dump() {
        static GATE: (std::sync::Mutex<u8>, std::sync::Condvar) =
            (std::sync::Mutex::new(0), std::sync::Condvar::new());
        static WAITED_OUT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        // The first read (the thread's) says it began, then holds until
        // let go (10 s at most: then the forced read waited for it).
        let read: fn() -> Vec<std::net::Ipv6Addr> = || {
            let addrs = ADDRS.lock().unwrap().clone();
            if READS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                let (m, c) = &GATE;
                let mut g = m.lock().unwrap();
                *g = 1;
                c.notify_all();
                let ten = std::time::Duration::from_secs(10);
                let (_g, t) = c.wait_timeout_while(g, ten, |g| *g != 2).unwrap();
                WAITED_OUT.store(t.timed_out(), std::sync::atomic::Ordering::SeqCst);
            }
            addrs
        };
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        READS.store(0, std::sync::atomic::Ordering::SeqCst);
        *ADDRS.lock().unwrap() = vec![a("fd00::1")];
        let watch = Ipv6Watch::unthreaded(read, Vec::new());
        let w = watch.clone();
        let round = std::thread::spawn(move || w.poll());
        let (m, c) = &GATE;
        drop(c.wait_while(m.lock().unwrap(), |g| *g != 1).unwrap());
        // The thread is in its dump; the addresses change; a forced read.
        *ADDRS.lock().unwrap() = vec![a("fd00::2")];
        assert_eq!(watch.read_now(std::time::Duration::ZERO), vec![a("fd00::2")]);
        *m.lock().unwrap() = 2;
        c.notify_all();
        round.join().unwrap();
        assert!(!WAITED_OUT.load(std::sync::atomic::Ordering::SeqCst), "the forced read waited for the dump");
        assert_eq!(watch.take(), None, "the thread's older read is not kept");
        assert_eq!(watch.read_now(std::time::Duration::from_secs(3600)), vec![a("fd00::2")]);
    }

    /// A read that fails leaves the last list read (review: it returned
    /// an empty one, told to every peer as "no addresses"), and is warned
    /// of at most once per [`WARN_FAILED_READ`].
    #[test]
    fn a_failed_read_keeps_the_last_list() {
        let last = std::sync::Mutex::new(LastRead { addrs: None, warned: None });
        let t = std::time::Instant::now();
        let failed = || Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        assert_eq!(kept(&last, failed(), t), Vec::<std::net::Ipv6Addr>::new(), "none read yet");
        assert_eq!(kept(&last, Ok(vec![a("fd00::1")]), t), vec![a("fd00::1")]);
        let lines = crate::testing::traced(|| {
            for s in [1, 2, 61] {
                let at = t + std::time::Duration::from_secs(s);
                assert_eq!(kept(&last, failed(), at), vec![a("fd00::1")]);
            }
        });
        assert_eq!(lines.matches("cannot read this host's IPv6 addresses").count(), 1, "{lines}");
        let none = Vec::<std::net::Ipv6Addr>::new();
        assert_eq!(kept(&last, Ok(none.clone()), t), none);
        assert_eq!(kept(&last, failed(), t), none, "an empty list read is the last too");
    }

    /// The tests that share `ADDRS` run one at a time.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
}
