//! The real-client suite across two hosts: Debian's unmodified
//! ibverbs-utils, perftest and qperf binaries with the server on one
//! daemon and the client on another, the two daemons joined by the TCP
//! transport.
//!
//! The two hosts are two daemons in this process on the loopback
//! addresses 127.0.0.2 and 127.0.0.3 (all of 127/8 is the loopback
//! interface), each with the other as a configured peer, so that the
//! tools' LID addressing finds a link as it would find a switch route.
//! The tools' own out-of-band TCP exchange runs on 127.0.0.1; their RDMA
//! traffic crosses between the daemons. A test passes only when both
//! sides exit 0 and show that the traffic ran (figures printed, the
//! ping-pong tools' data validation passed), and the daemon reports
//! frames on its link.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{built, free_port, has_results, listening, one_at_a_time, spawn, Finished};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(120);
const PSK: &str = "vrdma two-host tools test key";

struct Hosts {
    dir: tempfile::TempDir,
    /// Kept for the life of the test binary.
    _daemons: Mutex<Vec<vrdmad::Daemon>>,
}

impl Hosts {
    fn socket(&self, host: usize) -> PathBuf {
        self.dir.path().join(format!("host{host}.sock"))
    }

    /// `program` on `host` (0 or 1) through the shim.
    fn command(&self, host: usize, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("VRDMA_SOCKET", self.socket(host))
            .env("LD_BIND_NOW", "1")
            .env("VRDMA_VERBS_DEBUG", "1");
        c
    }

    /// Frames that crossed host 0's links so far.
    fn frames(&self) -> u64 {
        let ctx = vrdma::Context::open_at(self.socket(0)).expect("open");
        ctx.stat().expect("stat").links.iter().map(|l| l.stats.frames_out + l.stats.frames_in).sum()
    }
}

fn hosts() -> Option<&'static Hosts> {
    if !Path::new("/usr/bin/ibv_rc_pingpong").exists() {
        vrdma_it::skip("ibverbs-utils are missing (apt-get install ibverbs-utils)");
        return None;
    }
    static HOSTS: OnceLock<Hosts> = OnceLock::new();
    Some(HOSTS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        let link =
            |target: &Path, name: &str| std::os::unix::fs::symlink(target, lib.join(name)).expect("symlink");
        link(&built("libvrdma_verbs.so"), "libibverbs.so.1");
        let companions = built("libvrdma_companions.so");
        for soname in vrdma_companions::SONAMES {
            link(&companions, soname);
        }
        let port = free_port();
        let ips = ["127.0.0.2", "127.0.0.3"];
        let mut daemons = Vec::new();
        for (i, ip) in ips.iter().enumerate() {
            let peer: std::net::SocketAddr = format!("{}:{port}", ips[1 - i]).parse().expect("addr");
            let config = vrdmad::DaemonConfig {
                socket: Some(dir.path().join(format!("host{i}.sock"))),
                address: Some(ip.parse().expect("ip")),
                net: vrdmad::config::NetConfig {
                    listen: Some(format!("{ip}:{port}").parse().expect("addr")),
                    psk: Some(PSK.into()),
                    port,
                    peers: vec![peer],
                    ..Default::default()
                },
                ..Default::default()
            };
            daemons.push(vrdmad::Daemon::start(config).expect("start daemon"));
        }
        let h = Hosts { dir, _daemons: Mutex::new(daemons) };
        // Both links up before any tool asks for a path.
        let end = Instant::now() + Duration::from_secs(10);
        while vrdma::Context::open_at(h.socket(0)).expect("open").stat().expect("stat").links.is_empty() {
            assert!(Instant::now() < end, "the daemons never linked");
            std::thread::sleep(Duration::from_millis(20));
        }
        h
    }))
}

/// Starts `server_args` on host 0, waits for it to listen on `port`, runs
/// `client_args` on host 1 and returns both results.
fn run_pair(
    h: &Hosts,
    program: &str,
    port: u16,
    server_args: &[&str],
    client_args: &[&str],
    kill_server: bool,
) -> (Finished, Finished) {
    let mut server_cmd = h.command(0, program);
    server_cmd.args(server_args);
    let mut server = spawn(server_cmd, &format!("{program} (server on host 0) {}", server_args.join(" ")));
    let end = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if server.exited() || Instant::now() > end {
            panic!("the server never listened\n{}", server.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_cmd = h.command(1, program);
    client_cmd.args(client_args);
    let client =
        spawn(client_cmd, &format!("{program} (client on host 1) {}", client_args.join(" "))).finish(LIMIT);
    if kill_server {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(server.pid(), libc::SIGKILL) };
    }
    (server.finish(LIMIT), client)
}

fn no_failure(f: &Finished, bad: &[&str]) {
    let all = format!("{}{}", f.stdout, f.stderr);
    for b in bad {
        assert!(!all.contains(b), "{b:?} in the output\n{}", f.describe());
    }
}

fn pingpong(program: &str, args: &[&str]) {
    let Some(h) = hosts() else { return };
    let _turn = one_at_a_time();
    let before = h.frames();
    let port = free_port();
    let p = port.to_string();
    let mut common = vec!["-p", p.as_str()];
    common.extend_from_slice(args);
    let mut client_args = common.clone();
    client_args.push("127.0.0.1");
    let (server, client) = run_pair(h, program, port, &common, &client_args, false);
    for f in [&client, &server] {
        f.assert_ok();
        assert!(f.stdout.contains(" bytes in ") && f.stdout.contains(" iters in "), "{}", f.describe());
        no_failure(f, &["invalid data", "Failed status", "Couldn't"]);
    }
    assert!(h.frames() > before, "no frame crossed between the hosts");
}

#[test]
fn rc_pingpong_across_hosts_validates_its_data() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-c", "-n", "200"]);
}

#[test]
fn rc_pingpong_with_events_across_hosts() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-c", "-e", "-n", "200"]);
}

#[test]
fn srq_pingpong_across_hosts() {
    pingpong("/usr/bin/ibv_srq_pingpong", &["-c", "-n", "200"]);
}

#[test]
fn ud_pingpong_across_hosts() {
    pingpong("/usr/bin/ibv_ud_pingpong", &["-c", "-n", "200", "-s", "1024"]);
}

// With `-g 0` each side addresses the other by the GID it read from its
// own port (a GRH on every packet): the daemon resolves the peer's GID
// to the peer daemon rather than its LID.
#[test]
fn rc_pingpong_by_gid_across_hosts() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-c", "-g", "0", "-n", "200"]);
}

#[test]
fn ud_pingpong_by_gid_across_hosts() {
    pingpong("/usr/bin/ibv_ud_pingpong", &["-c", "-g", "0", "-n", "200", "-s", "1024"]);
}

fn perftest(tool: &str, args: &[&str]) {
    let program = format!("/usr/bin/{tool}");
    if !Path::new(&program).exists() {
        vrdma_it::skip(format!("{program} is missing (apt-get install perftest)"));
        return;
    }
    let Some(h) = hosts() else { return };
    let _turn = one_at_a_time();
    let before = h.frames();
    let port = free_port();
    let p = port.to_string();
    // -F: a report is printed even when perftest's clock calibration
    // fails. It busy-loops ~200 ms comparing rdtsc with gettimeofday and,
    // where one sample was preempted (a loaded 2-CPU machine), finds no
    // frequency: without -F the program exits 1 ("Can't produce a
    // report"), the likely cause of one CI failure of ib_send_bw -a.
    let mut common = vec!["-p", p.as_str(), "-d", "vrdma0", "-n", "1000", "-F"];
    common.extend_from_slice(args);
    let mut client_args = common.clone();
    client_args.push("127.0.0.1");
    let (server, client) = run_pair(h, &program, port, &common, &client_args, false);
    let server_reports = !matches!(tool, "ib_read_lat" | "ib_atomic_lat");
    for (f, reports) in [(&client, true), (&server, server_reports)] {
        assert!(f.status.success(), "{}", f.describe());
        assert!(!reports || has_results(&f.stdout), "no result table\n{}", f.describe());
        no_failure(f, &["Couldn't", "Failed", "failed", "error", "vrdma-verbs:"]);
    }
    assert!(h.frames() > before, "no frame crossed between the hosts");
}

macro_rules! perftests {
    ($($name:ident: $tool:literal $args:expr;)*) => {
        $(
            #[test]
            fn $name() {
                perftest($tool, &$args);
            }
        )*
    };
}

perftests! {
    perftest_write_lat: "ib_write_lat" [];
    perftest_write_bw: "ib_write_bw" [];
    perftest_write_bw_four_qps: "ib_write_bw" ["-q", "4"];
    perftest_read_lat: "ib_read_lat" [];
    perftest_read_bw: "ib_read_bw" [];
    perftest_send_lat: "ib_send_lat" [];
    perftest_send_bw: "ib_send_bw" [];
    perftest_send_bw_events: "ib_send_bw" ["-e"];
    perftest_atomic_lat: "ib_atomic_lat" [];
    perftest_atomic_bw: "ib_atomic_bw" [];
    perftest_write_bw_all_sizes: "ib_write_bw" ["-a", "-n", "100"];
}

fn qperf(test: &str, figure: &str) {
    const QPERF: &str = "/usr/bin/qperf";
    if !Path::new(QPERF).exists() {
        vrdma_it::skip(format!("{QPERF} is missing (apt-get install qperf)"));
        return;
    }
    let Some(h) = hosts() else { return };
    let _turn = one_at_a_time();
    let before = h.frames();
    let port = free_port();
    let lp = port.to_string();
    let (server, client) =
        run_pair(h, QPERF, port, &["-lp", &lp], &["127.0.0.1", "-lp", &lp, "-t", "1", test], true);
    client.assert_ok();
    assert!(client.stdout.contains(figure), "{figure:?} missing\n{}", client.describe());
    for f in [&client, &server] {
        no_failure(f, &["failed"]);
    }
    assert!(h.frames() > before, "no frame crossed between the hosts");
}

macro_rules! qperfs {
    ($($name:ident: $test:literal $figure:literal;)*) => {
        $(
            #[test]
            fn $name() {
                qperf($test, $figure);
            }
        )*
    };
}

qperfs! {
    qperf_rc_bw: "rc_bw" "bw  =";
    qperf_rc_bi_bw: "rc_bi_bw" "bw  =";
    qperf_rc_lat: "rc_lat" "latency  =";
    qperf_rc_rdma_read_bw: "rc_rdma_read_bw" "bw  =";
    qperf_rc_rdma_read_lat: "rc_rdma_read_lat" "latency  =";
    qperf_rc_rdma_write_bw: "rc_rdma_write_bw" "bw  =";
    qperf_rc_rdma_write_lat: "rc_rdma_write_lat" "latency  =";
    qperf_rc_rdma_write_poll_lat: "rc_rdma_write_poll_lat" "latency  =";
    qperf_rc_compare_swap_mr: "rc_compare_swap_mr" "msg_rate  =";
    qperf_rc_fetch_add_mr: "rc_fetch_add_mr" "msg_rate  =";
    qperf_ud_bw: "ud_bw" "send_bw  =";
    qperf_ud_lat: "ud_lat" "latency  =";
}
