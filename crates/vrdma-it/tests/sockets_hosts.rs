//! The preload library `libvrdma_sockets.so` across two hosts: two
//! network namespaces joined by a veth pair, one daemon in each
//! (`NetnsHosts`), an unmodified std::net client in host a and server in
//! host b. The client's daemon asks the server's daemon (a Sock frame on
//! their link, `docs/sockets.md`, "Other hosts"): carried over vRDMA when
//! both ends run the library as one tenant, plain TCP otherwise. Each
//! test makes and removes its own namespaces; without root or iproute2 it
//! is skipped with a printed notice.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use vrdma::sockets::SockCounts;
use vrdma_it::harness::{self, built, free_port, spawn, Finished, Running};
use vrdma_it::{DaemonProc, NetnsHosts};

/// 16 MiB through the ring (64 times its size).
const BYTES: u64 = 16 << 20;
const LIMIT: Duration = Duration::from_secs(120);
const CARRIED: &str = "carried over vRDMA";
/// What a library says when the daemons found no listener of its tenant.
const NO_LISTENER: &str = "no vRDMA listener of this tenant at";

/// The sockets test program in host `i`'s namespace, on that host's
/// daemon; `uid`: run as that user (and group).
fn sockapp(h: &NetnsHosts, i: usize, preload: bool, uid: Option<u32>, args: &[String]) -> Command {
    let exe = vrdma_it::peer_exe().with_file_name("vrdma-it-sockapp");
    let d: &DaemonProc = if i == 0 { &h.a } else { &h.b };
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &h.net.ns[i]]);
    if let Some(u) = uid {
        c.arg("setpriv").arg(format!("--reuid={u}")).arg(format!("--regid={u}")).arg("--clear-groups");
    }
    c.arg(exe).args(args).env(vrdma::SOCKET_ENV, &d.socket).env("VRDMA_SOCKETS_DEBUG", "1");
    if preload {
        c.env("LD_PRELOAD", built("libvrdma_sockets.so"));
    }
    c
}

/// Whether a socket of process `pid`'s network namespace listens on `port`
/// (its /proc/PID/net/tcp: the test's own namespace is another).
fn listening_in(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default().lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
    })
}

struct Outcome {
    client: Finished,
    server: Finished,
    /// Host b's registry, of the server's tenant.
    counts: SockCounts,
}

/// A server in host b (listening on every address) and a client in host a
/// that connects to b's address and sends [`BYTES`], checked byte by byte
/// by the server; both must succeed.
fn pair(
    h: &NetnsHosts,
    server_preload: bool,
    client_preload: bool,
    client_uid: Option<u32>,
) -> Result<Outcome> {
    let ctx = h.b.context()?;
    let port = free_port();
    let mut sc = sockapp(h, 1, server_preload, None, &["server".into(), port.to_string()]);
    sc.env("SOCKAPP_BIND", "0.0.0.0");
    let s: Running = spawn(sc, "server in b");
    let pid = s.pid();
    // A preloaded server's listener is registered after the kernel's
    // listen: wait for the registration, not only the port.
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening_in(pid, port) && (!server_preload || ctx.sock_counts().ok().map(|c| c.listeners) == Some(1))
    })?;
    let mut cc =
        sockapp(h, 0, client_preload, client_uid, &["client".into(), port.to_string(), BYTES.to_string()]);
    cc.env("SOCKAPP_HOST", &h.net.addr[1]);
    let client = spawn(cc, "client in a").finish(LIMIT);
    let server = s.finish(LIMIT);
    client.assert_ok();
    server.assert_ok();
    Ok(Outcome { client, server, counts: ctx.sock_counts()? })
}

/// `sockapp SERVER PORT ARGS..` in host b (listening on every address,
/// registered) and `sockapp CLIENT PORT ARGS..` in host a towards b, both
/// preloaded; both must succeed with their connection carried.
fn carried_pair(h: &NetnsHosts, server: &[&str], client: &[&str]) -> Result<(Finished, Finished)> {
    let ctx = h.b.context()?;
    let port = free_port().to_string();
    let args = |a: &[&str]| -> Vec<String> {
        let mut v = vec![a[0].to_string(), port.clone()];
        v.extend(a[1..].iter().map(|s| s.to_string()));
        v
    };
    let mut sc = sockapp(h, 1, true, None, &args(server));
    sc.env("SOCKAPP_BIND", "0.0.0.0");
    let s: Running = spawn(sc, &format!("{} in b", server[0]));
    let pid = s.pid();
    let p: u16 = port.parse()?;
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        listening_in(pid, p) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
    })?;
    let mut cc = sockapp(h, 0, true, None, &args(client));
    cc.env("SOCKAPP_HOST", &h.net.addr[1]);
    let c = spawn(cc, &format!("{} in a", client[0])).finish(LIMIT);
    let s = s.finish(LIMIT);
    s.assert_ok();
    c.assert_ok();
    assert!(s.stderr.contains(CARRIED), "{}", s.describe());
    assert!(c.stderr.contains(CARRIED), "{}", c.describe());
    Ok((s, c))
}

fn have_lib() -> bool {
    Path::new(&built("libvrdma_sockets.so")).exists()
}

#[test]
fn sixteen_mib_between_two_hosts_are_carried_over_vrdma() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(mut h) = NetnsHosts::start("")? else { return Ok(()) };
    let o = pair(&h, true, true, None)?;
    // Each library says so once its connection is carried.
    assert!(o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    assert!(o.server.stderr.contains(CARRIED), "{}", o.server.describe());
    // Announced at host b's daemon (by host a's, for its client), claimed
    // by the server there.
    let c = o.counts;
    assert_eq!((c.announced, c.carried, c.refused_claims, c.pending), (1, 1, 0, 0), "{c:?}");
    // Host a's registry held nothing of it: the destination is b's.
    let a = h.a.context()?.sock_counts()?;
    assert_eq!((a.announced, a.carried), (0, 0), "{a:?}");
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn a_plain_server_on_another_host_keeps_a_preloaded_client_on_tcp() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let o = pair(&h, false, true, None)?;
    assert!(!o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    assert!(o.client.stderr.contains(NO_LISTENER), "{}", o.client.describe());
    // The client asked b's daemon, which knows no listener: nothing was
    // announced.
    let c = o.counts;
    assert_eq!((c.listeners, c.announced, c.carried), (0, 0, 0), "{c:?}");
    Ok(())
}

/// A client of another tenant (another uid) on host a: b's daemon answers
/// its daemon "not vRDMA", as it answers a local client of another
/// tenant, and the connection stays plain TCP (the server's claim is
/// refused).
#[test]
fn another_tenants_client_on_another_host_stays_on_tcp() -> Result<()> {
    let _one = harness::one_at_a_time();
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let o = pair(&h, true, true, Some(65534))?;
    // Its library has a device and asked (b's daemon said no).
    assert!(o.client.stderr.contains(NO_LISTENER), "{}", o.client.describe());
    assert!(!o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    assert!(!o.server.stderr.contains(CARRIED), "{}", o.server.describe());
    let c = o.counts;
    assert_eq!((c.announced, c.carried, c.refused_claims), (0, 0, 1), "{c:?}");
    Ok(())
}

/// Issue 20's hang of a timed iperf3 across hosts: a write's completion
/// comes a link round trip after its bytes landed, by when the reader may
/// have read them and armed again; a wake byte sent then made the socket
/// read ready with an empty ring, and a program that waits for
/// readability and then reads blocking (iperf3's server on its control
/// connection) waited for ever. `selectserver` fails on a readiness with
/// nothing behind it (a read bounded by 1 s); 200 rounds of a message
/// written in two writes, carried across the two hosts, waiting with
/// `select`, `poll`, `epoll` and `pselect` in turn (the last two take
/// back a stale readiness since the library keeps epoll registrations).
#[test]
fn readiness_across_hosts_never_comes_without_bytes() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let (server, _) = carried_pair(&h, &["selectserver", "200"], &["msgclient", "200"])?;
    assert!(server.stdout.contains("rounds 200"), "{}", server.describe());
    Ok(())
}

/// A stream as iperf3 runs it (`docs/sockets.md`, "Writing"), carried
/// across the two hosts: a non-blocking writer in host a that waits in
/// `poll` for `POLLOUT` on a full ring, and a reader in host b that
/// waits in `poll` for `POLLIN` before each single read. Neither waits for
/// a sound that never comes: every writer's wait ends with its reader's
/// answer, so the library's slow look (once a second) never finds credits
/// back with an answer still awaited (`late 0` in the writer's counts),
/// and the kernel sockets, which carry only wake bytes, send each at once
/// (`TCP_NODELAY`; with Nagle's algorithm one waited up to 40 ms for the
/// ACK of the one before). iperf3 across hosts ran at 0.01 to 0.5 Gbit/s
/// before: an answer that came before the writer reaped its own `WANT`'s
/// completion (the peer's placement comes a link trip before the ack)
/// found the connection off the progress thread's list and was lost.
#[test]
fn a_poll_driven_stream_across_hosts_never_waits_for_a_lost_credit_answer() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    // 256 ring sizes: the ring fills again and again.
    let bytes = (64u64 << 20).to_string();
    let (server, client) = carried_pair(&h, &["pollserver"], &["nbflood", &bytes])?;
    // Each end's kernel socket is `TCP_NODELAY` and not corked (its
    // library read them back once carried), and each program reads its
    // own `TCP_NODELAY`: 0, as it set none.
    for p in [&client, &server] {
        for said in [
            "TCP_NODELAY 1 on the socket of a connection being carried (the program's: 0)",
            "TCP_CORK 0 on the socket of a connection being carried (the program's: 0)",
        ] {
            assert!(p.stderr.contains(said), "{}", p.describe());
        }
        assert!(p.stdout.contains("nodelay 0"), "{}", p.describe());
    }
    let late: Vec<u64> =
        client.stderr.lines().filter_map(|l| l.split(", late ").nth(1)?.trim().parse().ok()).collect();
    eprintln!("late {late:?}");
    assert!(!late.is_empty(), "the writer's credit counts: {}", client.describe());
    assert!(late.iter().all(|&n| n == 0), "answers lost: late {late:?}: {}", client.describe());
    Ok(())
}

/// A connection carried across hosts before a fork, then used by both
/// processes of the server in host b (`sockapp forkecho PORT
/// early-split`: the child reads, the parent writes back): demoted to
/// plain TCP in band, end to end (the daemons are not involved); the
/// client in host a checks every byte of 1 MiB, then the end.
#[test]
fn a_connection_carried_across_hosts_before_fork_is_shared_by_parent_and_child() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let (s, c) = carried_pair(&h, &["forkecho", "early-split"], &["echoclient", "1048576"])?;
    assert!(c.stdout.contains("echoed 1048576, then the end"), "{}", c.describe());
    assert!(s.stdout.contains("echoed 1048576"), "{}", s.describe());
    assert!(s.stderr.contains("demoted after"), "{}", s.describe());
    assert!(c.stderr.contains("the peer demoted"), "{}", c.describe());
    Ok(())
}

/// An inetd-style server in host b execs its echo program with an
/// accepted connection before any call on it (`sockapp inetd PORT exec`,
/// `docs/sockets.md`, "Exec"), and a carried-capable client in host a
/// sends 1 MiB through it in 16 KiB round trips: the connection falls back
/// to plain TCP cleanly. Declined at b's daemon before the client's first
/// call (its resolve, forwarded there, reads TCP), or, once the client's
/// hello is on its way, the hello answered with a decline.
#[test]
fn an_inetd_server_on_another_host_hands_its_program_a_clean_tcp_stream() -> Result<()> {
    const ECHO: u64 = 1 << 20;
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    let ctx = h.b.context()?;
    for (server_delay, client_delay, said) in [
        ("0", "800", "declined through the daemon before an exec"),
        ("800", "0", "answered with a decline before an exec"),
    ] {
        let port = free_port();
        let mut sc = sockapp(&h, 1, true, None, &["inetd".into(), port.to_string(), "exec".into()]);
        sc.env("SOCKAPP_BIND", "0.0.0.0").env("SOCKAPP_EXEC_DELAY_MS", server_delay);
        let s: Running = spawn(sc, "inetd in b");
        let pid = s.pid();
        vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
            listening_in(pid, port) && ctx.sock_counts().ok().map(|c| c.listeners) == Some(1)
        })?;
        let mut cc = sockapp(&h, 0, true, None, &["echoclient".into(), port.to_string(), ECHO.to_string()]);
        cc.env("SOCKAPP_HOST", &h.net.addr[1]).env("SOCKAPP_CONNECT_DELAY_MS", client_delay);
        let client = spawn(cc, "echoclient in a").finish(LIMIT);
        let server = s.finish(LIMIT);
        client.assert_ok();
        server.assert_ok();
        assert!(client.stdout.contains(&format!("echoed {ECHO}, then the end")), "{}", client.describe());
        assert!(server.stderr.contains(&format!("stdecho {ECHO}")), "{}", server.describe());
        assert!(server.stderr.contains(said), "{}", server.describe());
        assert!(
            !client.stderr.contains(CARRIED) && !server.stderr.contains(CARRIED),
            "{}\n{}",
            client.describe(),
            server.describe()
        );
    }
    Ok(())
}

/// Host a's and b's IPv6 addresses on their veth pair: a unique-local
/// and a link-local one each (`nodad`: usable at once), or `None` where
/// the veth pair takes no IPv6 (skipped, with a notice).
const V6: [&str; 2] = ["fd00:77::1", "fd00:77::2"];
const V6_LINK_LOCAL: [&str; 2] = ["fe80::77:1", "fe80::77:2"];

fn add_ipv6(h: &NetnsHosts) -> Option<()> {
    for (i, (ns, veth)) in h.net.ns.iter().zip(&h.net.veth).enumerate() {
        for cidr in [format!("{}/64", V6[i]), format!("{}/64", V6_LINK_LOCAL[i])] {
            let added = vrdma_it::run_cmd(&["ip", "-n", ns, "addr", "add", &cidr, "dev", veth, "nodad"]);
            if let Err(e) = added {
                println!("skipped: no IPv6 on the veth pair ({e:#})");
                return None;
            }
        }
    }
    Some(())
}

/// A server on `::` in host b (dual-stack; preloaded or not) and a
/// preloaded client in host a that connects to `dst` and sends
/// [`BYTES`], checked byte by byte by the server; both must succeed.
fn ipv6_pair(h: &NetnsHosts, server_preload: bool, dst: &str) -> Result<Outcome> {
    let ctx = h.b.context()?;
    let before = ctx.sock_counts()?.listeners;
    let port = free_port();
    let mut sc = sockapp(h, 1, server_preload, None, &["server".into(), port.to_string()]);
    sc.env("SOCKAPP_BIND", "::");
    let s: Running = spawn(sc, "server in b");
    let pid = s.pid();
    let want = format!(":{port:04X}");
    // A preloaded dual-stack server registers two listening addresses.
    let listeners = if server_preload { before + 2 } else { before };
    vrdma_it::wait_until(Duration::from_secs(20), "the server listens", || {
        let tcp6 = std::fs::read_to_string(format!("/proc/{pid}/net/tcp6")).unwrap_or_default();
        tcp6.lines().skip(1).any(|l| l.split_whitespace().nth(1).is_some_and(|a| a.ends_with(&want)))
            && ctx.sock_counts().ok().map(|c| c.listeners) == Some(listeners)
    })?;
    let mut cc = sockapp(h, 0, true, None, &["client".into(), port.to_string(), BYTES.to_string()]);
    cc.env("SOCKAPP_HOST", dst);
    let client = spawn(cc, "client in a").finish(LIMIT);
    let server = s.finish(LIMIT);
    client.assert_ok();
    server.assert_ok();
    Ok(Outcome { client, server, counts: ctx.sock_counts()? })
}

/// IPv6 across hosts (`docs/sockets.md`, "IPv6" and "Other hosts"): a
/// preloaded client in host a connects to host b's IPv6 address, where a
/// preloaded dual-stack server listens on `::`. Host b's daemon told host
/// a's that it owns the address (wire version 4's `Hosts6`), a's asked
/// b's in the IPv6 kinds, and the connection is carried over vRDMA: 16 MiB
/// checked byte for byte, one announcement claimed at b.
#[test]
fn an_ipv6_destination_on_another_host_is_carried_over_vrdma() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    if add_ipv6(&h).is_none() {
        return Ok(());
    }
    let o = ipv6_pair(&h, true, V6[1])?;
    assert!(o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    assert!(o.server.stderr.contains(CARRIED), "{}", o.server.describe());
    assert!(o.client.stderr.contains(&format!("announced [{}]:", V6[0])), "{}", o.client.describe());
    assert_eq!((o.counts.announced, o.counts.carried, o.counts.pending), (1, 1, 0), "{:?}", o.counts);
    let a = h.a.context()?.sock_counts()?;
    assert_eq!((a.announced, a.carried), (0, 0), "the announcement is b's: {a:?}");
    Ok(())
}

/// What stays plain TCP across hosts over IPv6, with no byte of
/// negotiation in the stream (16 MiB arrive intact each time): a client
/// of host b's IPv6 address whose server there is a plain TCP program
/// (b's daemon, asked, has no listener there), and a client of b's
/// link-local address whose server is preloaded (a link-local
/// destination is nobody's: never announced).
#[test]
fn an_ipv6_destination_on_another_host_stays_tcp_without_a_listener_or_when_link_local() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    if add_ipv6(&h).is_none() {
        return Ok(());
    }
    let o = ipv6_pair(&h, false, V6[1])?;
    assert!(o.client.stderr.contains(NO_LISTENER), "{}", o.client.describe());
    assert!(!o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    let link_local = format!("{}%{}", V6_LINK_LOCAL[1], h.net.veth[0]);
    let o = ipv6_pair(&h, true, &link_local)?;
    assert!(
        !o.client.stderr.contains(CARRIED) && !o.server.stderr.contains(CARRIED),
        "{}",
        o.client.describe()
    );
    assert_eq!((o.counts.announced, o.counts.carried), (0, 0), "{:?}", o.counts);
    let a = h.a.context()?.sock_counts()?;
    assert_eq!((a.announced, a.carried), (0, 0), "{a:?}");
    Ok(())
}

/// Host b's daemon restarted while its last link to host a's was still up
/// (here: a second daemon at b's address links to a's before the first
/// goes): when that first link goes down, a's daemon keeps what the new
/// link told it (b's IPv6 addresses), and a client in a of b's IPv6
/// address is carried to a server on the new daemon (review: the old
/// link's end wiped, by host, what the new link had installed, and the
/// client stayed plain TCP until b's addresses next changed).
#[test]
fn an_old_links_end_leaves_what_a_restarted_peers_new_link_told() -> Result<()> {
    let _one = harness::one_at_a_time();
    assert!(have_lib());
    let Some(mut h) = NetnsHosts::start("")? else { return Ok(()) };
    if add_ipv6(&h).is_none() {
        return Ok(());
    }
    let links_up =
        |d: &DaemonProc| -> Result<usize> { Ok(d.context()?.stat()?.links.iter().filter(|l| l.up).count()) };
    // The new daemon at b's address, on another port (the old one holds
    // b's), dials a's as its configured peer.
    let peer_a = format!("{}:{}", h.net.addr[0], h.port);
    let cfg = vrdma_it::host_config(&h.net.addr[1], h.port + 1, &[peer_a], "");
    let b2 = DaemonProc::start_in(Some(&h.net.ns[1]), &cfg)?;
    vrdma_it::wait_until(Duration::from_secs(20), "a's daemon has both links", || {
        links_up(&h.a).ok() == Some(2) && links_up(&b2).ok() == Some(1)
    })?;
    // (The new link's first message is its host's addresses: let a's
    // daemon read it before the old link ends.)
    std::thread::sleep(Duration::from_millis(500));
    let old = std::mem::replace(&mut h.b, b2);
    drop(old);
    vrdma_it::wait_until(Duration::from_secs(20), "the old link goes down", || {
        links_up(&h.a).ok() == Some(1)
    })?;
    let o = ipv6_pair(&h, true, V6[1])?;
    assert!(o.client.stderr.contains(CARRIED), "{}", o.client.describe());
    assert!(o.server.stderr.contains(CARRIED), "{}", o.server.describe());
    assert_eq!((o.counts.announced, o.counts.carried), (1, 1), "{:?}", o.counts);
    Ok(())
}
