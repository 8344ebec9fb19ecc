//! libfabric (Debian's 1.17, package `libfabric-bin`) over vRDMA: its
//! `verbs` provider and `ofi_rxm` on top of it, run unmodified through
//! this library and vRDMA's libibverbs:
//!
//! - `fi_info -p verbs` lists MSG and RDM (`verbs;ofi_rxm`) endpoints of
//!   the domain `vrdma0`;
//! - `fi_pingpong -p verbs -e msg -c` and `-e rdm -c` (every size from
//!   64 B to 1 MiB, ten round trips each, data checked) on one host, and
//!   across two hosts: two network namespaces joined by a veth pair, a
//!   daemon in each (libfabric publishes the listener's interface
//!   address to the client, which must name the server's host);
//! - `tests/c/fabric_cm.c`: the rdma_cm behaviour libfabric relies on
//!   (a synchronous id moved to a channel becomes asynchronous; no
//!   device behind a loopback bind), and a CQ as deep as `ofi_rxm` asks.
//!
//! fi_pingpong's out-of-band TCP port (47592 unless `-B`/`-P`) is a free
//! one per pair, and the client starts once the server listens there
//! (its `/proc/PID/net/tcp`, which is its namespace's). The tests skip,
//! saying so, only when a tool is missing; under `VRDMA_TEST_STRICT=1`
//! (CI) that fails instead. Every process is killed by pid at its
//! deadline or when its test ends early; the namespaces go when their
//! test ends.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{free_port, one_at_a_time, spawn, Finished, Running};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const FI_INFO: &str = "/usr/bin/fi_info";
const FI_PINGPONG: &str = "/usr/bin/fi_pingpong";
const LIMIT: Duration = Duration::from_secs(60);
/// How long the client waits for the server's out-of-band port.
const LISTEN_WAIT: Duration = Duration::from_secs(30);
/// fi_pingpong's sizes without `-S`: its table has a row for each.
const SIZES: [&str; 6] = ["64", "256", "1k", "4k", "64k", "1m"];
const ITERATIONS: &str = "10";

/// The library directory and the one-host daemon the tests share.
struct Setup {
    dir: tempfile::TempDir,
    daemon: Mutex<vrdmad::Daemon>,
}

impl Setup {
    fn lib_dir(&self) -> PathBuf {
        self.dir.path().join("lib")
    }

    fn socket(&self) -> PathBuf {
        self.daemon.lock().unwrap_or_else(|p| p.into_inner()).socket_path().to_path_buf()
    }
}

/// The shared setup, or `None` (with the reason printed) without
/// libfabric's tools.
fn setup() -> Option<&'static Setup> {
    for tool in [FI_INFO, FI_PINGPONG] {
        if !Path::new(tool).exists() {
            vrdma_it::skip(format!("{tool} is missing (apt-get install libfabric-bin)"));
            return None;
        }
    }
    static SETUP: OnceLock<Setup> = OnceLock::new();
    // (libfabric links rdma-core's libefa.so.1, its efa provider, which
    // needs rdma-core's libibverbs: the stand-in, as `vrdma run` links.)
    Some(SETUP.get_or_init(|| {
        let (dir, daemon) = common::drop_in_dir();
        Setup { dir, daemon: Mutex::new(daemon) }
    }))
}

/// Where a program runs: a daemon's socket, and the network namespace
/// (`None`: ours).
#[derive(Clone)]
struct Host {
    socket: PathBuf,
    netns: Option<String>,
}

/// `program args` on `host`, with the drop-in libraries and their debug
/// lines (one for each call that fails) on.
fn command(s: &Setup, host: &Host, program: &str, args: &[&str]) -> Command {
    let mut c = match &host.netns {
        // `ip netns exec` execs the program: the pid is the program's.
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    };
    c.args(args)
        .env("LD_LIBRARY_PATH", s.lib_dir())
        .env("VRDMA_SOCKET", &host.socket)
        .env("LD_BIND_NOW", "1")
        .env("VRDMA_RDMACM_DEBUG", "1")
        .env("VRDMA_VERBS_DEBUG", "1")
        // The listener's address is said at this level.
        .env("FI_LOG_LEVEL", "info");
    c
}

/// Whether `pid`'s network namespace has a TCP socket listening on
/// `port` (its `/proc/PID/net/tcp`; looking must not connect, or the
/// server would take us for its client).
fn listening_in(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default().lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
    })
}

/// No line of the drop-in libraries but libfabric's probe of the largest
/// inline size (it creates QPs with less and less until one is granted),
/// and no error of fi_pingpong's.
fn check_clean(f: &Finished, other: &Finished) {
    let all = format!("{}{}", f.stdout, f.stderr);
    for line in all.lines() {
        let ours = line.contains("vrdma librdmacm:")
            || line.contains("vrdma-verbs:") && !line.contains("inline bytes");
        assert!(!ours && !line.contains("[error]"), "{line:?}\n{}\n{}", f.describe(), other.describe());
    }
}

/// fi_pingpong's table, checked: every size, each with ten messages sent
/// and acknowledged.
fn check_table(f: &Finished, other: &Finished) {
    let mut rows = f.stdout.lines().skip_while(|l| !l.starts_with("bytes")).skip(1);
    for size in SIZES {
        let row = rows.next().unwrap_or_default();
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert!(
            cols.len() == 8
                && cols[0] == size
                && cols[1] == ITERATIONS
                && cols[2] == format!("={ITERATIONS}"),
            "no row for {size} in\n{}\n{}",
            f.describe(),
            other.describe()
        );
    }
}

/// `fi_pingpong -p verbs -e EP -c` as server on `server` and client on
/// `client` connecting (out of band) to `to`; checks both and returns
/// their output.
fn pingpong(s: &Setup, ep: &str, server: &Host, client: &Host, to: &str) -> (Finished, Finished) {
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let common = ["-p", "verbs", "-e", ep, "-c", "-I", ITERATIONS];
    let mut server_args = common.to_vec();
    server_args.extend_from_slice(&["-B", &port]);
    let mut client_args = common.to_vec();
    client_args.extend_from_slice(&["-P", &port, to]);
    let name = |role: &str| format!("fi_pingpong -e {ep} -c ({role})");
    let mut srv: Running = spawn(command(s, server, FI_PINGPONG, &server_args), &name("server"));
    let end = Instant::now() + LISTEN_WAIT;
    while !listening_in(srv.pid(), port.parse().expect("port")) {
        if srv.exited() || Instant::now() > end {
            panic!("the server never listened on {port}\n{}", srv.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let cli = spawn(command(s, client, FI_PINGPONG, &client_args), &name("client")).finish(LIMIT);
    let srv = srv.finish(LIMIT);
    for (f, other) in [(&srv, &cli), (&cli, &srv)] {
        assert!(f.status.success(), "{}\n{}", f.describe(), other.describe());
        check_clean(f, other);
        check_table(f, other);
    }
    (srv, cli)
}

/// The address libfabric's listener is bound to, from its log line
/// `listening on: fi_sockaddr_in://A.B.C.D:PORT`.
fn listener_address(server: &Finished) -> Option<String> {
    let at = server.stderr.find("listening on: fi_sockaddr_in://")?;
    let rest = &server.stderr[at + "listening on: fi_sockaddr_in://".len()..];
    Some(rest.split(':').next()?.to_string())
}

fn one_host() -> Option<(&'static Setup, Host)> {
    let s = setup()?;
    Some((s, Host { socket: s.socket(), netns: None }))
}

// ---------------------------------------------------------------------
// One host

#[test]
fn fi_info_lists_msg_and_rdm_endpoints_of_vrdma0() {
    let Some((s, host)) = one_host() else { return };
    let mut c = command(s, &host, FI_INFO, &["-p", "verbs"]);
    c.env_remove("FI_LOG_LEVEL");
    let f = spawn(c, "fi_info -p verbs").finish(LIMIT);
    f.assert_ok();
    // One block per fi_info: "provider: P", then "    key: value" lines.
    let blocks: Vec<Vec<(&str, &str)>> = f
        .stdout
        .split("provider: ")
        .skip(1)
        .map(|b| {
            let mut lines = b.lines();
            let mut kv = vec![("provider", lines.next().unwrap_or_default().trim())];
            kv.extend(lines.filter_map(|l| l.trim().split_once(": ")));
            kv
        })
        .collect();
    let has = |provider: &str, ty: &str| {
        blocks.iter().any(|b| {
            b.contains(&("provider", provider))
                && b.contains(&("domain", "vrdma0"))
                && b.contains(&("type", ty))
        })
    };
    assert!(has("verbs", "FI_EP_MSG"), "no MSG endpoint of vrdma0\n{}", f.describe());
    assert!(has("verbs;ofi_rxm", "FI_EP_RDM"), "no RDM endpoint of vrdma0\n{}", f.describe());
}

#[test]
fn fi_pingpong_msg_with_data_checks() {
    let Some((s, host)) = one_host() else { return };
    pingpong(s, "msg", &host, &host, "127.0.0.1");
}

#[test]
fn fi_pingpong_rdm_with_data_checks() {
    let Some((s, host)) = one_host() else { return };
    pingpong(s, "rdm", &host, &host, "127.0.0.1");
}

/// The C checks of `tests/c/fabric_cm.c` (see its comment), compiled
/// against rdma-core's headers and linked against both drop-in libraries.
#[test]
fn c_checks_of_what_libfabric_needs_from_rdma_cm() {
    let Some((s, host)) = one_host() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/fabric_cm.c");
    let exe = s.dir.path().join("fabric_cm");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-O2", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(s.lib_dir())
        .args(["-l:librdmacm.so.1", "-l:libibverbs.so.1"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("{cc} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("no C compiler ({cc}: {e})"));
            return;
        }
    }
    let port = free_port().to_string();
    let mut c = command(s, &host, exe.to_str().expect("utf-8 path"), &[&port]);
    // The connect it makes fails on purpose.
    c.env_remove("VRDMA_RDMACM_DEBUG");
    let f = spawn(c, "fabric_cm").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("fabric_cm: OK"), "{}", f.describe());
}

/// `ofi_rxm` opens its CQ for (128 receives + 128 sends) × a universe of
/// 1024 peers: a tenant under the default quota gets one that deep.
#[test]
fn a_cq_as_deep_as_ofi_rxm_asks_is_granted() {
    let Some((s, _)) = one_host() else { return };
    let ctx = vrdma::Context::open_at(s.socket()).expect("context");
    let want = (128 + 128) * 1024;
    assert!(ctx.query_device().expect("query").max_cqe >= want);
    let cq = ctx.create_cq(want, None).expect("a CQ of 262144 entries");
    assert!(cq.depth() >= want);
}

// ---------------------------------------------------------------------
// Two hosts

/// Two network namespaces joined by a veth pair, a daemon of this process
/// in each (started from a thread in the namespace, so that its threads
/// and sockets are that host's), linked by the transport. The daemons go
/// first on drop, then the namespaces.
struct TwoHosts {
    daemons: Vec<vrdmad::Daemon>,
    net: vrdma_it::Netns,
    _dir: tempfile::TempDir,
}

impl TwoHosts {
    fn start() -> Option<TwoHosts> {
        if let Some(why) = vrdma_it::netns_unavailable() {
            vrdma_it::skip(format!("network namespaces need root and iproute2 ({why})"));
            return None;
        }
        let net = match vrdma_it::Netns::create() {
            Ok(n) => n,
            Err(e) => {
                vrdma_it::skip(format!("network namespaces cannot be made here: {e:#}"));
                return None;
            }
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let port = vrdma_it::DEFAULT_WIRE_PORT;
        let mut daemons = Vec::new();
        for i in 0..2 {
            let peer = format!("{}:{port}", net.addr[1 - i]);
            let toml = vrdma_it::host_config(&net.addr[i], port, &[peer], "");
            let mut config = vrdmad::DaemonConfig::from_toml(&toml).expect("config");
            config.socket = Some(dir.path().join(format!("host{i}.sock")));
            let d = net
                .on_host(i, LIMIT, move || Ok(vrdmad::Daemon::start(config)?))
                .unwrap_or_else(|e| panic!("the daemon of host {i}: {e:#}"));
            daemons.push(d);
        }
        Some(TwoHosts { daemons, net, _dir: dir })
    }

    fn host(&self, i: usize) -> Host {
        Host { socket: self.daemons[i].socket_path().to_path_buf(), netns: Some(self.net.ns[i].clone()) }
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        self.daemons.clear();
    }
}

/// The server on host B, the client on host A: the listener publishes
/// B's veth address (not loopback, which would name A itself there).
fn pingpong_across(ep: &str) {
    let Some(s) = setup() else { return };
    let Some(h) = TwoHosts::start() else { return };
    let (server, _) = pingpong(s, ep, &h.host(1), &h.host(0), &h.net.addr[1]);
    assert_eq!(listener_address(&server).as_deref(), Some(h.net.addr[1].as_str()), "{}", server.describe());
    drop(h);
}

#[test]
fn fi_pingpong_msg_with_data_checks_across_two_hosts() {
    pingpong_across("msg");
}

#[test]
fn fi_pingpong_rdm_with_data_checks_across_two_hosts() {
    pingpong_across("rdm");
}
