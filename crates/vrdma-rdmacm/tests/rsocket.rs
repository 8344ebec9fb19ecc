//! The rsocket API of the drop-in `librdmacm.so.1`, run by Debian's
//! `rdmacm-utils` (`rstream`, `rcopy`, `udpong`, `riostream`), by a
//! sockets program under rdma-core's `librspreload.so`, and by
//! `tests/c/rsocket_check.c` and `tests/c/riomap_check.c` (bad input and
//! the calls the tools do not make), against a daemon this test process
//! runs.
//!
//! Stream rsockets are the sockets carrier's (`libvrdma_sockets.so`,
//! which cargo builds beside this library as a dev-dependency): each test
//! asks the carrier to say what it decided (`VRDMA_SOCKETS_DEBUG=1`) and
//! checks that both ends' connections were carried over vRDMA, not left
//! TCP. Each server is started first and the client only once the daemon
//! knows its listener (the carrier registers it at `rlisten`; a client
//! before that would connect as plain TCP), or for UDP once the kernel
//! has its port.
//!
//! The tests skip, saying so, where a tool is missing (`apt-get install
//! rdmacm-utils`; under `VRDMA_TEST_STRICT=1`, CI, that fails instead).
//! Every wait is bounded, and every process is killed by pid when its
//! test ends early or it overruns its limit.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{built, free_port, one_at_a_time, spawn, Finished, Running};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const RSTREAM: &str = "/usr/bin/rstream";
const RCOPY: &str = "/usr/bin/rcopy";
const UDPONG: &str = "/usr/bin/udpong";
const RIOSTREAM: &str = "/usr/bin/riostream";
const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";
const LIMIT: Duration = Duration::from_secs(60);
const LISTEN_WAIT: Duration = Duration::from_secs(20);

struct Setup {
    dir: tempfile::TempDir,
    _daemon: Mutex<vrdmad::Daemon>,
}

impl Setup {
    fn lib_dir(&self) -> PathBuf {
        self.dir.path().join("lib")
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("vrdma.sock")
    }

    /// A command for `program` using the drop-in libraries and the daemon,
    /// the carrier saying what it decides.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.lib_dir())
            .env("VRDMA_SOCKET", self.socket())
            .env("LD_BIND_NOW", "1")
            .env("VRDMA_SOCKETS_DEBUG", "1")
            .env_remove("VRDMA_SOCKETS_LIB")
            .env_remove("LD_PRELOAD");
        c
    }

    /// Waits until the daemon knows a listener of ours owning
    /// 127.0.0.1:`port`, as long as `server` runs; true if it came.
    fn wait_listening(&self, port: u16, server: &mut Running) -> bool {
        let Ok(ctx) = vrdma::Context::open_at(self.socket()) else { return false };
        let dst = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
        let end = Instant::now() + LISTEN_WAIT;
        while Instant::now() < end && !server.exited() {
            if ctx.sock_lookup(dst, true).unwrap_or(false) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

/// The shared setup, or `None` (with the reason printed) without `tool`.
fn setup(tool: &str) -> Option<&'static Setup> {
    if !Path::new(tool).exists() {
        vrdma_it::skip(format!("{tool} is missing (apt-get install rdmacm-utils)"));
        return None;
    }
    static SETUP: OnceLock<Setup> = OnceLock::new();
    Some(SETUP.get_or_init(|| {
        let (dir, daemon) = common::drop_in_dir();
        // The carrier, which the library finds beside its own file.
        let carrier = built("libvrdma_sockets.so");
        assert_eq!(
            carrier.parent(),
            std::fs::canonicalize(built("libvrdma_rdmacm.so")).expect("canonical").parent(),
            "the carrier must lie beside libvrdma_rdmacm.so"
        );
        Setup { dir, _daemon: Mutex::new(daemon) }
    }))
}

/// Both ends' connections went over vRDMA, and nothing failed.
fn assert_carried(f: &Finished, connections: usize) {
    f.assert_ok();
    let carried = f.stderr.matches("carried over vRDMA").count();
    assert_eq!(carried, connections, "carried connections\n{}", f.describe());
    // The carrier's decisions for plain TCP end in ": TCP".
    assert!(!f.stderr.lines().any(|l| l.ends_with(": TCP")), "a connection left TCP\n{}", f.describe());
    for bad in ["vrdma librdmacm:", "failed"] {
        assert!(!f.stderr.contains(bad), "{bad:?} on stderr\n{}", f.describe());
    }
}

/// `rstream` server and client with `args` (after the address and port).
fn rstream(s: &Setup, env: &[(&str, &str)], args: &[&str]) -> (Finished, Finished) {
    let port = free_port();
    let p = port.to_string();
    let mut srv = s.command(RSTREAM);
    srv.envs(env.iter().copied()).args(["-b", "127.0.0.1", "-p", &p]).args(args);
    let mut server = spawn(srv, &format!("rstream (server) {}", args.join(" ")));
    assert!(s.wait_listening(port, &mut server), "the rstream server never listened");
    let mut cli = s.command(RSTREAM);
    cli.envs(env.iter().copied()).args(["-s", "127.0.0.1", "-p", &p]).args(args);
    let client = spawn(cli, &format!("rstream (client) {}", args.join(" "))).finish(LIMIT);
    (server.finish(LIMIT), client)
}

fn assert_rstream_ran(f: &Finished, size: &str) {
    let row = f.stdout.lines().find(|l| l.starts_with("custom")).unwrap_or("");
    assert!(row.split_whitespace().nth(1) == Some(size), "no result row\n{}", f.describe());
}

/// rstream's blocking transfer, verified byte for byte (`-T v`), on
/// carried connections.
#[test]
fn rstream_blocking_verified_stream_is_carried() {
    let Some(s) = setup(RSTREAM) else { return };
    let _turn = one_at_a_time();
    let (server, client) = rstream(s, &[], &["-S", "65536", "-C", "50", "-T", "v"]);
    for f in [&server, &client] {
        assert_carried(f, 1);
        assert_rstream_ran(f, "64k");
    }
}

/// rstream's asynchronous mode: non-blocking rsockets (`rfcntl`), every
/// transfer after `rpoll`, the connect completing with EINPROGRESS.
#[test]
fn rstream_nonblocking_with_rpoll_is_carried() {
    let Some(s) = setup(RSTREAM) else { return };
    let _turn = one_at_a_time();
    let (server, client) = rstream(s, &[], &["-S", "4096", "-C", "50", "-T", "v", "-T", "a"]);
    for f in [&server, &client] {
        assert_carried(f, 1);
        assert_rstream_ran(f, "4k");
    }
}

/// rstream with the carrier also preloaded (`vrdma run --sockets` with an
/// rsocket program): the library's `dlopen` gets the preloaded object, one
/// table of connections for both, and the connection is carried once.
#[test]
fn rstream_with_the_carrier_also_preloaded_is_carried() {
    let Some(s) = setup(RSTREAM) else { return };
    let _turn = one_at_a_time();
    let carrier = built("libvrdma_sockets.so");
    let carrier = carrier.to_str().expect("utf-8 path");
    let (server, client) = rstream(s, &[("LD_PRELOAD", carrier)], &["-S", "65536", "-C", "20", "-T", "v"]);
    for f in [&server, &client] {
        assert_carried(f, 1);
        assert_rstream_ran(f, "64k");
    }
}

/// Where rdma-core's rsockets need an rsocket at both ends, ours talk to
/// a plain TCP peer as TCP: rstream's rsocket client to its plain sockets
/// server (`-T s`), and the reverse, verified.
#[test]
fn an_rsocket_and_a_plain_tcp_peer_talk_tcp() {
    let Some(s) = setup(RSTREAM) else { return };
    let _turn = one_at_a_time();
    for (server_mode, client_mode) in [(&["-T", "s"][..], &[][..]), (&[][..], &["-T", "s"][..])] {
        let port = free_port();
        let p = port.to_string();
        let common = ["-p", p.as_str(), "-S", "65536", "-C", "20", "-T", "v"];
        let mut srv = s.command(RSTREAM);
        srv.args(["-b", "127.0.0.1"]).args(common).args(server_mode);
        let mut server = spawn(srv, &format!("rstream (server) {server_mode:?}"));
        let end = Instant::now() + LISTEN_WAIT;
        while !common::listening(port) && !server.exited() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut cli = s.command(RSTREAM);
        cli.args(["-s", "127.0.0.1"]).args(common).args(client_mode);
        let client = spawn(cli, &format!("rstream (client) {client_mode:?}")).finish(LIMIT);
        let server = server.finish(LIMIT);
        for f in [&server, &client] {
            f.assert_ok();
            assert_rstream_ran(f, "64k");
            assert!(!f.stderr.contains("carried over vRDMA"), "{}", f.describe());
        }
        // The rsocket client asked and was told there is no listener.
        if client_mode.is_empty() {
            assert!(client.stderr.contains("no vRDMA listener"), "{}", client.describe());
        }
    }
}

/// A sockets program under rdma-core's `librspreload.so`, which turns its
/// socket calls into rsocket calls of this library: rstream in its plain
/// sockets mode (`-T s`), with `poll` (`-T a`).
#[test]
fn librspreload_carries_a_sockets_program() {
    let Some(s) = setup(RSTREAM) else { return };
    if !Path::new(RSPRELOAD).exists() {
        vrdma_it::skip(format!("{RSPRELOAD} is missing (apt-get install librdmacm1)"));
        return;
    }
    let _turn = one_at_a_time();
    let env = [("LD_PRELOAD", RSPRELOAD)];
    let (server, client) = rstream(s, &env, &["-S", "65536", "-C", "20", "-T", "s", "-T", "v", "-T", "a"]);
    for f in [&server, &client] {
        assert_carried(f, 1);
        assert_rstream_ran(f, "64k");
    }
}

/// rcopy copies a file to its server over a carried rsocket.
#[test]
fn rcopy_copies_a_file_over_a_carried_rsocket() {
    let Some(s) = setup(RCOPY) else { return };
    let _turn = one_at_a_time();
    let port = free_port();
    let p = port.to_string();
    let work = tempfile::tempdir().expect("temp dir");
    let src = work.path().join("src.bin");
    let dst = work.path().join("dst.bin");
    let data: Vec<u8> = (0..1_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&src, &data).expect("write the source");
    let mut srv = s.command(RCOPY);
    srv.args(["-p", &p]);
    // The server serves for ever: it is killed (by pid) when dropped.
    let mut server = spawn(srv, "rcopy (server)");
    assert!(s.wait_listening(port, &mut server), "the rcopy server never listened");
    let mut cli = s.command(RCOPY);
    cli.arg(&src).arg(format!("127.0.0.1:{}", dst.display())).args(["-p", &p]);
    let client = spawn(cli, "rcopy (client)").finish(LIMIT);
    assert_carried(&client, 1);
    assert!(client.stdout.contains("1500000 bytes"), "{}", client.describe());
    assert!(std::fs::read(&dst).expect("the copy") == data, "the copy differs\n{}", client.describe());
    drop(server);
}

/// Whether a UDP socket is bound to `port` (from /proc/net/udp).
fn udp_bound(port: u16) -> bool {
    let want = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/udp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().nth(1).is_some_and(|a| a.ends_with(&want)))
}

/// udpong's datagram rsockets are kernel UDP sockets: its ping-pong runs.
#[test]
fn udpong_ping_pongs_over_datagram_rsockets() {
    let Some(s) = setup(UDPONG) else { return };
    let _turn = one_at_a_time();
    let port = free_port();
    let p = port.to_string();
    let mut srv = s.command(UDPONG);
    srv.args(["-b", "127.0.0.1", "-p", &p]);
    let mut server = spawn(srv, "udpong (server)");
    let end = Instant::now() + LISTEN_WAIT;
    while !udp_bound(port) && !server.exited() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(udp_bound(port), "the udpong server never bound its port");
    let mut cli = s.command(UDPONG);
    cli.args(["-s", "127.0.0.1", "-p", &p, "-C", "100", "-S", "100"]);
    let client = spawn(cli, "udpong (client)").finish(LIMIT);
    client.assert_ok();
    let row = client.stdout.lines().find(|l| l.starts_with("custom")).unwrap_or("");
    assert_eq!(row.split_whitespace().nth(2), Some("100"), "no result row\n{}", client.describe());
    drop(server);
}

/// riostream's direct placement: each end maps its buffer (`riomap`),
/// the other `riowrite`s into it and the receiver watches the buffer's
/// last byte, verified byte for byte (`-T v`); blocking (`-T b`) and
/// asynchronous (`-T a`: non-blocking, `rpoll` before each call), both
/// ends carried, each end's ten transfers `riowrite`s.
#[test]
fn riostream_places_verified_transfers_over_carried_rsockets() {
    let Some(s) = setup(RIOSTREAM) else { return };
    let _turn = one_at_a_time();
    for mode in ["b", "a"] {
        let args = ["-S", "4096", "-C", "10", "-T", "v", "-T", mode];
        let port = free_port();
        let p = port.to_string();
        let mut srv = s.command(RIOSTREAM);
        srv.args(["-b", "127.0.0.1", "-p", &p]).args(args);
        let mut server = spawn(srv, &format!("riostream (server) -T {mode}"));
        assert!(s.wait_listening(port, &mut server), "the riostream server never listened");
        let mut cli = s.command(RIOSTREAM);
        cli.args(["-s", "127.0.0.1", "-p", &p]).args(args);
        let client = spawn(cli, &format!("riostream (client) -T {mode}")).finish(LIMIT);
        let server = server.finish(LIMIT);
        for f in [&server, &client] {
            assert_carried(f, 1);
            assert_rstream_ran(f, "4k");
            assert!(f.stderr.contains("riowrites 10,"), "the transfers were riowrites\n{}", f.describe());
        }
    }
}

/// Compiles `tests/c/NAME.c` against the drop-in libraries; `None` (said)
/// without the header or a C compiler.
fn compile_c(s: &Setup, name: &str) -> Option<PathBuf> {
    if !Path::new("/usr/include/rdma/rsocket.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rsocket.h is missing (apt-get install librdmacm-dev)");
        return None;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = s.dir.path().join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-O2", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(s.lib_dir())
        .args(["-l:librdmacm.so.1", "-l:libibverbs.so.1", "-lpthread"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!("{cc} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("no C compiler ({cc}: {e})"));
            None
        }
    }
}

/// `tests/c/riomap_check.c`: direct placement's bad input and edges (a
/// write before the peer mapped, past the end, after riounmap, a full
/// table, descriptors that carry nothing) fail with errno, and a
/// riowrite's bytes are in place when a message sent after it arrives.
#[test]
fn c_checks_of_direct_placement() {
    let Some(s) = setup(RSTREAM) else { return };
    let _turn = one_at_a_time();
    let Some(exe) = compile_c(s, "riomap_check") else { return };
    let f = spawn(s.command(exe.to_str().expect("utf-8 path")), "riomap_check").finish(LIMIT);
    assert!(f.stdout.contains("riomap_check: OK"), "{}", f.describe());
    assert_carried(&f, 2);
}

/// `tests/c/rsocket_check.c`: bad input fails with errno (also on a
/// carried connection, where the carrier copies in user space), and the
/// calls the tools do not make work.
#[test]
fn c_checks_of_rsocket_calls_and_bad_input() {
    let Some(s) = setup(RSTREAM) else { return };
    let Some(exe) = compile_c(s, "rsocket_check") else { return };
    let f = spawn(s.command(exe.to_str().expect("utf-8 path")), "rsocket_check").finish(LIMIT);
    assert!(f.stdout.contains("rsocket_check: OK"), "{}", f.describe());
    // Its connection's two ends, both in this one process.
    assert_carried(&f, 2);
}

/// Two hosts, each a network namespace with a daemon, joined by a veth
/// pair (`vrdma_it::NetnsHosts`; loopback addresses would not do: the
/// carrier takes a loopback destination for its own host's), each tool's
/// server on the second and its client on the first: `rstream` (`-T v`)
/// and `riostream` (`-T v`, its `riowrite`s staged through the carrier's
/// registered slots, the peer's buffer on the other host) are carried
/// over the link at both ends.
#[test]
fn rstream_and_riostream_across_two_hosts_are_carried() {
    let Some(s) = setup(RIOSTREAM) else { return };
    let _turn = one_at_a_time();
    let Some(hosts) = vrdma_it::NetnsHosts::start("").expect("two hosts in network namespaces") else {
        return;
    };
    let in_ns = |i: usize, tool: &str| {
        let d = if i == 0 { &hosts.a } else { &hosts.b };
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.net.ns[i], tool]);
        let template = s.command(tool);
        for (k, v) in template.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c.env("VRDMA_SOCKET", &d.socket);
        c
    };
    let addr = hosts.net.addr[1].as_str();
    for (tool, args) in [
        (RSTREAM, ["-S", "65536", "-C", "20", "-T", "v"]),
        (RIOSTREAM, ["-S", "65536", "-C", "20", "-T", "v"]),
    ] {
        let port = free_port();
        let p = port.to_string();
        let mut srv = in_ns(1, tool);
        srv.args(["-b", addr, "-p", &p]).args(args);
        let mut server = spawn(srv, &format!("{tool} (server, host B)"));
        // Listening once host B's daemon knows the listener.
        let ctx = vrdma::Context::open_at(&hosts.b.socket).expect("a context on B");
        let dst = SocketAddrV4::new(addr.parse().expect("B's address"), port);
        let end = Instant::now() + LISTEN_WAIT;
        while !ctx.sock_lookup(dst, true).unwrap_or(false) {
            assert!(Instant::now() < end && !server.exited(), "the {tool} server never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut cli = in_ns(0, tool);
        cli.args(["-s", addr, "-p", &p]).args(args);
        let client = spawn(cli, &format!("{tool} (client, host A)")).finish(LIMIT);
        let server = server.finish(LIMIT);
        for f in [&server, &client] {
            assert_carried(f, 1);
            assert_rstream_ran(f, "64k");
        }
        if tool == RIOSTREAM {
            for f in [&server, &client] {
                assert!(f.stderr.contains("riowrites 20,"), "the transfers were riowrites\n{}", f.describe());
            }
        }
    }
}
