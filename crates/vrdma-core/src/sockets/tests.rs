use super::*;

const A: TenantId = TenantId(1);
const B: TenantId = TenantId(2);
const SRV: ContextId = ContextId(10);
const CLI: ContextId = ContextId(11);

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn tuple() -> Tuple {
    Tuple { client: addr("127.0.0.1:40000"), server: addr("127.0.0.1:5000") }
}

fn t(s: u64) -> Instant {
    Instant(s * 1_000_000_000)
}

#[test]
fn announced_then_claimed_is_carried_for_both() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.lookup(A, addr("127.0.0.1:5000"), true));
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(0)), Outcome::Pending);
    assert!(r.claim(A, tuple(), t(1)));
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(1)), Outcome::Carried);
    // Resolved once: the entry is gone, a second claim is refused.
    assert!(!r.claim(A, tuple(), t(1)));
    let c = r.stats(A);
    assert_eq!((c.listeners, c.announced, c.carried, c.refused_claims, c.pending), (1, 1, 1, 1, 0));
}

#[test]
fn a_wildcard_listener_owns_only_local_destinations() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(!r.lookup(A, addr("10.0.0.9:5000"), false));
    assert!(!r.announce(
        CLI,
        A,
        Tuple { client: addr("10.0.0.1:4000"), server: addr("10.0.0.9:5000") },
        false,
        t(0)
    ));
    // A listener on one address owns that address only.
    r.listen(SRV, A, addr("127.0.0.2:6000")).unwrap();
    assert!(r.lookup(A, addr("127.0.0.2:6000"), false));
    assert!(!r.lookup(A, addr("127.0.0.3:6000"), true));
}

#[test]
fn a_plain_client_is_refused_and_nothing_is_announced_without_a_listener() {
    let mut r = Registry::new();
    assert!(!r.announce(CLI, A, tuple(), true, t(0)));
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    // The server accepts a connection nobody announced: plain TCP.
    assert!(!r.claim(A, tuple(), t(0)));
}

#[test]
fn tenants_never_see_each_other() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(!r.lookup(B, addr("127.0.0.1:5000"), true));
    assert!(!r.announce(CLI, B, tuple(), true, t(0)));
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    // B cannot claim or resolve A's announcement.
    assert!(!r.claim(B, tuple(), t(0)));
    assert_eq!(r.resolve(CLI, B, tuple(), true, t(0)), Outcome::Tcp);
    assert!(r.claim(A, tuple(), t(0)));
}

#[test]
fn giving_up_makes_both_ends_tcp() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    assert_eq!(r.resolve(CLI, A, tuple(), true, t(2)), Outcome::Tcp);
    assert!(!r.claim(A, tuple(), t(3)));
    assert_eq!(r.stats(A).abandoned, 1);
}

#[test]
fn pending_announcements_expire_but_claimed_ones_wait_for_the_client() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    let late = t(0) + PENDING_TTL;
    assert!(!r.claim(A, tuple(), late));
    assert_eq!(r.resolve(CLI, A, tuple(), false, late), Outcome::Tcp);

    assert!(r.announce(CLI, A, tuple(), true, t(100)));
    assert!(r.claim(A, tuple(), t(101)));
    let much_later = t(101) + PENDING_TTL * 10;
    assert_eq!(r.resolve(CLI, A, tuple(), false, much_later), Outcome::Carried);
}

#[test]
fn only_the_announcer_resolves() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    assert_eq!(r.resolve(ContextId(99), A, tuple(), true, t(0)), Outcome::Tcp);
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(0)), Outcome::Pending);
}

#[test]
fn closing_a_context_takes_its_listeners_and_announcements() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    r.listen(ContextId(12), A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    r.close_context(CLI);
    assert!(!r.claim(A, tuple(), t(0)));
    r.close_context(SRV);
    // A second process (after fork) still listens.
    assert!(r.lookup(A, addr("127.0.0.1:5000"), true));
    r.close_context(ContextId(12));
    assert!(!r.lookup(A, addr("127.0.0.1:5000"), true));
    assert_eq!(r.stats(A).listeners, 0);
}

#[test]
fn limits_and_bad_ports() {
    let mut r = Registry::new();
    assert_eq!(r.listen(SRV, A, addr("0.0.0.0:0")), Err(SockError::PortZero));
    for p in 1..=MAX_LISTENERS as u16 {
        r.listen(SRV, A, SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), p)).unwrap();
    }
    assert_eq!(r.listen(SRV, A, addr("0.0.0.0:60000")), Err(SockError::TooManyListeners));
    // The same address again is no new listener; another tenant has its own budget.
    r.listen(CLI, A, addr("0.0.0.0:1")).unwrap();
    r.listen(SRV, B, addr("0.0.0.0:60000")).unwrap();
    // A client port of 0 is never announced.
    let t0 = Tuple { client: addr("127.0.0.1:0"), server: addr("127.0.0.1:1") };
    assert!(!r.announce(CLI, A, t0, true, t(0)));
}

/// A client of another host's daemon announces and resolves through it:
/// the same transitions, owned by that host's context, which only that
/// host and context resolve, and which go with the context or the link.
#[test]
fn another_hosts_client_is_owned_by_its_host_and_context() {
    let host = Ipv4Addr::new(10, 0, 0, 1);
    let other = Ipv4Addr::new(10, 0, 0, 3);
    let cli = Owner::Remote { host, link: 1, ctx: 11 };
    let tup = Tuple { client: addr("10.0.0.1:40000"), server: addr("10.0.0.2:5000") };
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(cli, A, tup, true, t(0)));
    // A local context with the same number, or another host's, is not it.
    assert_eq!(r.resolve(ContextId(11), A, tup, false, t(0)), Outcome::Tcp);
    assert_eq!(r.resolve(Owner::Remote { host: other, link: 1, ctx: 11 }, A, tup, false, t(0)), Outcome::Tcp);
    assert_eq!(r.resolve(cli, A, tup, false, t(0)), Outcome::Pending);
    assert!(r.claim(A, tup, t(1)));
    assert_eq!(r.resolve(cli, A, tup, false, t(1)), Outcome::Carried);

    // Closing the context, or the link to its host, drops what it holds.
    assert!(r.announce(cli, A, tup, true, t(2)));
    r.forget_remote(host, 1, Some(12));
    r.forget_remote(other, 1, None);
    r.close_context(ContextId(11));
    assert_eq!(r.stats(A).pending, 1, "another context's or host's end leaves it");
    r.forget_remote(host, 1, Some(11));
    assert_eq!(r.stats(A).pending, 0);
    assert!(!r.claim(A, tup, t(2)));
    assert!(r.announce(cli, A, tup, true, t(3)));
    r.forget_remote(host, 1, None);
    assert!(!r.claim(A, tup, t(3)), "the link went down: plain TCP");
}

/// A daemon of the same address restarted and linked again before its
/// first link was found dead: that link's end (and its contexts' ends)
/// take only what was announced by it, not what the new link announced
/// (review: the old link's end wiped the new one's entries).
#[test]
fn a_links_end_takes_only_what_was_announced_by_it() {
    let host = Ipv4Addr::new(10, 0, 0, 1);
    let (old, new) = (Owner::Remote { host, link: 1, ctx: 11 }, Owner::Remote { host, link: 2, ctx: 11 });
    let tup = Tuple { client: addr("10.0.0.1:40000"), server: addr("10.0.0.2:5000") };
    let tup2 = Tuple { client: addr("10.0.0.1:40001"), server: addr("10.0.0.2:5000") };
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(old, A, tup, true, t(0)));
    assert!(r.announce(new, A, tup2, true, t(0)));
    // The old link's context of the same number, and then the link, end.
    r.forget_remote(host, 1, Some(11));
    r.forget_remote(host, 1, None);
    assert!(!r.claim(A, tup, t(1)));
    assert!(r.claim(A, tup2, t(1)), "the new link's announcement stays");
    assert_eq!(r.resolve(old, A, tup2, false, t(1)), Outcome::Tcp, "not the old link's to resolve");
    assert_eq!(r.resolve(new, A, tup2, false, t(1)), Outcome::Carried);
}

#[test]
fn an_adopted_announcement_is_resolved_by_its_new_context_only() {
    const CHILD: ContextId = ContextId(12);
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(!r.adopt(CHILD, A, tuple()), "nothing announced");
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    assert!(!r.adopt(CHILD, B, tuple()), "another tenant's");
    assert!(r.adopt(CHILD, A, tuple()));
    assert!(r.claim(A, tuple(), t(1)));
    // The parent's context no longer owns it: it reads TCP, and its end
    // takes nothing with it.
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(1)), Outcome::Tcp);
    r.close_context(CLI);
    assert_eq!(r.resolve(CHILD, A, tuple(), false, t(1)), Outcome::Carried);
    // Gone with its announcing context: nothing to adopt.
    assert!(r.announce(CLI, A, tuple(), true, t(2)));
    r.close_context(CLI);
    assert!(!r.adopt(CHILD, A, tuple()));
    // Another host's announcement is not this daemon's to hand over.
    let remote = Owner::Remote { host: Ipv4Addr::new(10, 0, 0, 2), link: 1, ctx: 7 };
    assert!(r.announce(remote, A, tuple(), true, t(3)));
    assert!(!r.adopt(CHILD, A, tuple()));
}

#[test]
fn a_claim_declined_before_the_client_resolved_is_tcp_for_both() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(0)));
    // Not claimed yet: nothing to decline (the claim would be the
    // server's, and it has not made it).
    assert!(!r.decline(A, tuple()));
    assert!(r.claim(A, tuple(), t(1)));
    // Another tenant cannot decline it.
    assert!(!r.decline(B, tuple()));
    assert!(r.decline(A, tuple()));
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(1)), Outcome::Tcp);
    assert!(!r.decline(A, tuple()), "declined twice");
    // Resolved before the decline: carried, and the decline says so.
    assert!(r.announce(CLI, A, tuple(), true, t(2)));
    assert!(r.claim(A, tuple(), t(2)));
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(2)), Outcome::Carried);
    assert!(!r.decline(A, tuple()));
    let c = r.stats(A);
    assert_eq!((c.announced, c.carried, c.abandoned, c.pending), (2, 2, 1, 0));
}

fn tuple6() -> Tuple {
    Tuple { client: addr("[::1]:40000"), server: addr("[::1]:5000") }
}

#[test]
fn an_ipv6_destination_is_owned_by_its_exact_address_or_by_a_local_unspecified_one() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("[fd00::1]:6000")).unwrap();
    assert!(r.lookup(A, addr("[fd00::1]:6000"), false));
    assert!(!r.lookup(A, addr("[fd00::2]:6000"), true));
    // Flow label and scope id are no part of the key.
    assert!(r.lookup(
        A,
        "[fd00::1%3]:6000"
            .parse::<SocketAddrV6>()
            .map(|mut a| {
                a.set_flowinfo(7);
                a.into()
            })
            .unwrap(),
        false
    ));
    r.listen(SRV, A, addr("[::]:5000")).unwrap();
    assert!(r.lookup(A, addr("[::1]:5000"), true));
    assert!(r.lookup(A, addr("[fd00::9]:5000"), true));
    assert!(
        !r.lookup(A, addr("[fd00::9]:5000"), false),
        "not local: the unspecified address does not own it"
    );
    assert!(!r.lookup(B, addr("[::1]:5000"), true));
    // A link-local destination without its scope is nobody's (it names
    // no interface); with one, `[::]` owns it when it is this host's and
    // its library names scopes (an older build's `[::]` owns none: it
    // never claims such a connection, and its client would wait).
    assert!(!r.lookup(A, addr("[fe80::1%3]:5000"), true), "an older library's listener");
    r.listen_with(SRV, A, addr("[::]:5000"), true).unwrap();
    assert!(!r.lookup(A, addr("[fe80::1]:5000"), true));
    assert!(r.lookup(A, addr("[fe80::1%3]:5000"), true));
    assert!(!r.lookup(A, addr("[fe80::1%3]:5000"), false), "not this host's");
    r.unlisten(SRV, A, addr("[::]:5000"));
    r.listen(SRV, A, addr("[::]:5000")).unwrap();
    assert!(!r.lookup(A, addr("[fe80::1%3]:5000"), true), "unlisten forgot it names scopes");
    assert!(r.lookup(A, addr("[fd00::9]:5000"), true));
    r.listen(SRV, A, addr("[fe80::1]:7000")).unwrap();
    assert!(!r.lookup(A, addr("[fe80::1]:7000"), true));
}

/// A link-local address is keyed with its scope: the same address on two
/// interfaces is two keys, each owned by its own listener, and a
/// connection of one is never claimed as the other's. Another host's
/// link-local address (not `local`) is owned by none, even by a listener
/// of that very key, and another host's daemon cannot announce one.
#[test]
fn link_local_addresses_are_keyed_with_their_scope() {
    assert_eq!(key(addr("[fe80::1%3]:80")), addr("[fe80::1%3]:80"));
    assert_eq!(key(addr("[fd00::1%3]:80")), addr("[fd00::1]:80"), "a scope names only a link-local");
    let mut r = Registry::new();
    r.listen(SRV, A, addr("[fe80::1%3]:7000")).unwrap();
    assert!(r.lookup(A, addr("[fe80::1%3]:7000"), true));
    assert!(!r.lookup(A, addr("[fe80::1%4]:7000"), true), "the other interface's");
    assert!(!r.lookup(A, addr("[fe80::1%3]:7000"), false), "not local");
    assert!(!r.lookup(B, addr("[fe80::1%3]:7000"), true), "another tenant's");
    let on = |scope: u32, port: u16| Tuple {
        client: addr(&format!("[fe80::1%{scope}]:{port}")),
        server: addr(&format!("[fe80::1%{scope}]:7000")),
    };
    assert!(r.announce(CLI, A, on(3, 40000), true, t(0)));
    assert!(!r.announce(CLI, A, on(4, 40001), true, t(0)), "nobody listens on the other");
    r.listen(SRV, A, addr("[fe80::1%4]:7000")).unwrap();
    assert!(r.announce(CLI, A, on(4, 40000), true, t(0)));
    // Each claim matches its own interface's announcement only.
    assert!(r.claim(A, on(4, 40000), t(0)));
    assert_eq!(r.resolve(CLI, A, on(3, 40000), false, t(0)), Outcome::Pending);
    assert!(r.claim(A, on(3, 40000), t(0)));
    assert!(!r.claim(A, on(3, 40000), t(0)), "claimed once");
    // Unscoped ends, or another host's daemon's link-local tuple: no.
    let unscoped = Tuple { client: addr("[fe80::1]:40002"), server: addr("[fe80::1%3]:7000") };
    assert!(!r.announce(CLI, A, unscoped, true, t(0)));
    let remote = Owner::Remote { host: Ipv4Addr::new(10, 0, 0, 2), link: 1, ctx: 7 };
    r.listen_with(SRV, A, addr("[::]:7000"), true).unwrap();
    assert!(!r.announce(remote, A, on(3, 40003), true, t(0)));
    assert!(!r.announce(
        remote,
        A,
        Tuple { client: addr("[fe80::9%3]:1"), server: addr("[::1]:7000") },
        true,
        t(0)
    ));
}

/// A tuple the kernel never makes is not announced: a link-local end
/// reaches its own link only, so both ends are link-local on one
/// interface, or neither is.
#[test]
fn link_local_ends_on_two_links_or_with_a_global_end_are_refused() {
    let mut r = Registry::new();
    r.listen_with(SRV, A, addr("[::]:7000"), true).unwrap();
    r.listen(SRV, A, addr("[fe80::1%4]:7000")).unwrap();
    for (client, server) in [
        ("[fe80::1%3]:40000", "[fe80::1%4]:7000"),
        ("[fe80::1%3]:40000", "[fd00::1]:7000"),
        ("[fd00::1]:40000", "[fe80::1%3]:7000"),
    ] {
        let tuple = Tuple { client: addr(client), server: addr(server) };
        assert!(!r.announce(CLI, A, tuple, true, t(0)), "{client} -> {server}");
    }
    let tuple = Tuple { client: addr("[fe80::1%4]:40000"), server: addr("[fe80::1%4]:7000") };
    assert!(r.announce(CLI, A, tuple, true, t(0)));
    assert_eq!(r.stats(A).announced, 1);
}

/// The kernel's listeners: `[::]` with IPV6_V6ONLY owns IPv6 only, a v4
/// one IPv4 only; a dual-stack `::` socket registers both and owns both.
#[test]
fn each_family_has_its_own_unspecified_listener() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("[::]:5000")).unwrap();
    assert!(!r.lookup(A, addr("127.0.0.1:5000"), true), "a v6only listener owns no IPv4 destination");
    assert!(!r.lookup(A, addr("[::ffff:127.0.0.1]:5000"), true), "nor a v4-mapped one");
    r.listen(SRV, A, addr("0.0.0.0:6000")).unwrap();
    assert!(!r.lookup(A, addr("[::1]:6000"), true), "a v4 listener owns no IPv6 destination");
    assert!(r.lookup(A, addr("127.0.0.1:6000"), true));
    assert!(r.lookup(A, addr("[::ffff:127.0.0.1]:6000"), true), "a v4-mapped destination is its IPv4 one");

    // Dual-stack: both registrations, both families owned, one listener
    // going leaves the other family's.
    r.listen(SRV, A, addr("0.0.0.0:7000")).unwrap();
    r.listen(SRV, A, addr("[::]:7000")).unwrap();
    assert!(r.lookup(A, addr("127.0.0.1:7000"), true));
    assert!(r.lookup(A, addr("[::1]:7000"), true));
    assert_eq!(r.stats(A).listeners, 4);
    r.unlisten(SRV, A, addr("[::]:7000"));
    assert!(!r.lookup(A, addr("[::1]:7000"), true));
    assert!(r.lookup(A, addr("127.0.0.1:7000"), true));
    // A v4-mapped registration is the IPv4 one.
    r.listen(SRV, A, addr("[::ffff:127.0.0.2]:8000")).unwrap();
    assert!(r.lookup(A, addr("127.0.0.2:8000"), false));
    r.unlisten(SRV, A, addr("127.0.0.2:8000"));
    assert!(!r.lookup(A, addr("127.0.0.2:8000"), false));
}

#[test]
fn an_ipv6_tuple_is_announced_claimed_and_resolved() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("[::]:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple6(), true, t(0)));
    assert_eq!(r.resolve(CLI, A, tuple6(), false, t(0)), Outcome::Pending);
    // The server names it with a scope id of 0 and maybe a flow label.
    let mut accepted = tuple6();
    if let SocketAddr::V6(ref mut a) = accepted.client {
        a.set_flowinfo(0x12345);
    }
    assert!(r.claim(A, accepted, t(1)));
    assert_eq!(r.resolve(CLI, A, tuple6(), false, t(1)), Outcome::Carried);
    // Given up: TCP for both.
    assert!(r.announce(CLI, A, tuple6(), true, t(2)));
    assert_eq!(r.resolve(CLI, A, tuple6(), true, t(2)), Outcome::Tcp);
    assert!(!r.claim(A, tuple6(), t(3)));
    // An IPv4 tuple of the same ports is another connection.
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    assert!(r.announce(CLI, A, tuple(), true, t(4)));
    assert!(!r.claim(A, tuple6(), t(4)));
    // The v4-mapped names of the IPv4 tuple are that tuple.
    let mapped = Tuple { client: addr("[::ffff:127.0.0.1]:40000"), server: addr("[::ffff:127.0.0.1]:5000") };
    assert!(r.claim(A, mapped, t(4)));
    assert_eq!(r.resolve(CLI, A, tuple(), false, t(4)), Outcome::Carried);
    let c = r.stats(A);
    assert_eq!((c.announced, c.carried, c.abandoned, c.refused_claims, c.pending), (3, 2, 1, 2, 0));
}

/// A tuple whose ends are of two families once keyed names no connection
/// the kernel makes (a library of another build could still send one),
/// nor does one with an unscoped link-local client: both are refused, and counted
/// nowhere.
#[test]
fn a_tuple_of_two_families_or_a_link_local_client_is_not_announced() {
    let mut r = Registry::new();
    r.listen(SRV, A, addr("[::]:5000")).unwrap();
    r.listen(SRV, A, addr("0.0.0.0:5000")).unwrap();
    let mixed = [
        Tuple { client: addr("127.0.0.1:40000"), server: addr("[::1]:5000") },
        Tuple { client: addr("[::1]:40000"), server: addr("127.0.0.1:5000") },
        Tuple { client: addr("[::1]:40000"), server: addr("[::ffff:127.0.0.1]:5000") },
        Tuple { client: addr("[fe80::1]:40000"), server: addr("[::1]:5000") },
        Tuple { client: addr("[fe80::1]:40000"), server: addr("[fe80::1]:5000") },
    ];
    for tuple in mixed {
        assert!(!r.announce(CLI, A, tuple, true, t(0)), "{tuple:?}");
        assert!(!r.claim(A, tuple, t(0)), "{tuple:?}");
    }
    // The same client's tuple of one family is announced.
    assert!(r.announce(CLI, A, tuple6(), true, t(0)));
    assert_eq!(r.stats(A).announced, 1);
}
