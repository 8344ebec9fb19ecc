//! `vrdma run --sockets`: an unmodified iperf3 (select(2), non-blocking
//! sockets, a control and a data connection, a dual-stack IPv6 listener)
//! on both ends, carried over vRDMA (docs/sockets.md), on one host and
//! between two (network namespaces with a daemon each).

use std::process::Command;
use std::time::Duration;

use vrdma_it::harness::{built, free_port, listening, one_at_a_time, spawn};
use vrdma_it::DaemonProc;

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
const LIMIT: Duration = Duration::from_secs(60);

fn have(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| d.join(program).is_file()) {
        return true;
    }
    vrdma_it::skip(format!("{program} is missing (apt-get install {program})"));
    false
}

fn run(d: &DaemonProc, args: &[&str]) -> Command {
    let mut c = Command::new(VRDMA);
    c.arg("--socket")
        .arg(&d.socket)
        .args(["run", "--sockets", "--"])
        .args(args)
        // `vrdma run` also sets up the drop-in verbs libraries, which a
        // test build leaves in deps/, not next to `vrdma` (a fresh clone
        // has no other copy: this test failed there without these).
        .env("VRDMA_VERBS_LIB", built("libvrdma_verbs.so"))
        .env("VRDMA_RDMACM_LIB", built("libvrdma_rdmacm.so"))
        .env("VRDMA_COMPANIONS_LIB", built("libvrdma_companions.so"))
        .env("VRDMA_SOCKETS_LIB", built("libvrdma_sockets.so"))
        .env("VRDMA_SOCKETS_DEBUG", "1");
    c
}

#[test]
fn iperf3_runs_carried_over_vrdma_under_vrdma_run_sockets() {
    if !have("iperf3") {
        return;
    }
    let _one = one_at_a_time();
    let d = DaemonProc::start().expect("daemon");
    let ctx = d.context().expect("context");
    let port = free_port().to_string();
    // iperf3 listens on IPv6's wildcard, dual-stack: registered as
    // 0.0.0.0 and [::] of its port, its IPv4 clients are carried as those
    // of 0.0.0.0 (`docs/sockets.md`, "IPv6"). Where IPv6 is disabled it
    // listens on 0.0.0.0 alone: one registration. 0.0.0.0 is registered
    // first either way, so the IPv4 client may go once one is there.
    let server = spawn(run(&d, &["iperf3", "-s", "-1", "-p", &port]), "iperf3 -s");
    vrdma_it::wait_until(Duration::from_secs(20), "iperf3 listens", || {
        listening(port.parse().unwrap()) && matches!(ctx.sock_counts().ok().map(|c| c.listeners), Some(1 | 2))
    })
    .expect("iperf3 server");
    let client = spawn(run(&d, &["iperf3", "-c", "127.0.0.1", "-p", &port, "-n", "16M"]), "iperf3 -c");
    let c = client.finish(LIMIT);
    let s = server.finish(LIMIT);
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains("iperf Done."), "{}", c.describe());
    // Both connections (control and data) were claimed: carried.
    let carried = c.stderr.matches("carried over vRDMA").count();
    assert_eq!(carried, 2, "{}\n{}", c.describe(), s.describe());
    let counts = ctx.sock_counts().expect("counts");
    assert_eq!((counts.announced, counts.carried), (2, 2), "{counts:?}");
}

/// `vrdma bench --sockets` runs its programs (its own, sockperf and
/// redis-benchmark) plain and preloaded, checks the preloaded ones were
/// carried, and prints each figure beside its anchor with the ratio.
#[test]
fn bench_sockets_prints_its_figures_beside_plain_tcp() {
    let _one = one_at_a_time();
    let mut c = Command::new(VRDMA);
    c.args(["bench", "--sockets", "--quick", "--runs", "1"])
        .env("VRDMA_SOCKETS_LIB", built("libvrdma_sockets.so"));
    let out = spawn(c, "vrdma bench --sockets").finish(Duration::from_secs(240));
    out.assert_ok();
    for path in ["direct path off", "direct path on"] {
        for what in ["64 B request/response", "stream of 256 MiB"] {
            let row = out
                .stdout
                .lines()
                .find(|l| l.contains(what) && l.contains(path))
                .unwrap_or_else(|| panic!("no {what} row, {path}: {}", out.describe()));
            assert!(row.contains("plain TCP, loopback") && row.contains('x'), "{row}");
        }
    }
    // The real applications' rows, for those installed (all under .ci/run).
    let installed = |p: &str| {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).any(|d| d.join(p).is_file())
    };
    for (program, what) in [
        ("sockperf", "sockperf ping-pong"),
        ("sockperf", "sockperf throughput"),
        ("redis-benchmark", "redis-benchmark SET"),
        ("redis-benchmark", "redis-benchmark GET"),
    ] {
        let row = out.stdout.lines().find(|l| l.contains(what));
        if !installed(program) {
            vrdma_it::skip(format!("{program} is missing: no {what} row to check"));
            continue;
        }
        let row = row.unwrap_or_else(|| panic!("no {what} row: {}", out.describe()));
        assert!(row.contains("plain TCP, loopback") && row.contains('x'), "{row}");
    }
}

/// Whether a socket of process `pid`'s network namespace listens on `port`
/// (IPv4 or IPv6).
fn listening_in(pid: i32, port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

/// iperf3 between two hosts (two network namespaces, a daemon in each):
/// both connections carried, the daemons asking each other.
#[test]
fn iperf3_runs_carried_between_two_hosts() {
    if !have("iperf3") {
        return;
    }
    let _one = one_at_a_time();
    let Some(h) = vrdma_it::NetnsHosts::start("").expect("hosts") else { return };
    let ctx = h.b.context().expect("context");
    // `vrdma run` as `run` makes it, in host `i`'s namespace.
    let in_ns = |i: usize, d: &DaemonProc, args: &[&str]| {
        let c = run(d, args);
        let mut ns = Command::new("ip");
        ns.args(["netns", "exec", &h.net.ns[i]]).arg(c.get_program()).args(c.get_args());
        for (k, v) in c.get_envs() {
            if let Some(v) = v {
                ns.env(k, v);
            }
        }
        ns
    };
    let port = free_port().to_string();
    let server = spawn(in_ns(1, &h.b, &["iperf3", "-s", "-1", "-p", &port]), "iperf3 -s in b");
    let pid = server.pid();
    vrdma_it::wait_until(Duration::from_secs(20), "iperf3 listens", || {
        // Dual-stack `::`: 0.0.0.0 and [::] of its port; 0.0.0.0 alone
        // (registered first in both cases) where IPv6 is disabled.
        listening_in(pid, port.parse().unwrap())
            && matches!(ctx.sock_counts().ok().map(|c| c.listeners), Some(1 | 2))
    })
    .expect("iperf3 server");
    let b = h.net.addr[1].as_str();
    let client = spawn(in_ns(0, &h.a, &["iperf3", "-c", b, "-p", &port, "-n", "16M"]), "iperf3 -c in a");
    let c = client.finish(LIMIT);
    let s = server.finish(LIMIT);
    c.assert_ok();
    s.assert_ok();
    assert!(c.stdout.contains("iperf Done."), "{}", c.describe());
    let carried = c.stderr.matches("carried over vRDMA").count();
    assert_eq!(carried, 2, "{}\n{}", c.describe(), s.describe());
    let counts = ctx.sock_counts().expect("counts");
    assert_eq!((counts.announced, counts.carried), (2, 2), "{counts:?}");
}
