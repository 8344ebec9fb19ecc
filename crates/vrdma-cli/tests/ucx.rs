//! UCX and Open MPI, unmodified Debian binaries, through `vrdma run`:
//!
//! - `ucx_info -d` lists the vRDMA device (memory domain `vrdma0`) with
//!   the `rc_verbs` and `ud_verbs` transports and the `rdmacm` connection
//!   manager, with no node made by hand: `vrdma run` (and the daemon)
//!   make `/dev/infiniband/uverbs-vrdma0` (`vrdmad::devnode`);
//! - `ucx_perftest` server/client pairs (`tag_lat`, `tag_bw`,
//!   `ucp_put_lat`, `ucp_put_bw`) with `UCX_TLS=rc_v` (`rc_verbs`, with
//!   `ud_verbs` for wire-up only) and `UCX_TLS=ud_v`: no shared memory,
//!   no TCP, so a pair that runs went through the device;
//! - `io_demo` (ucx-utils), whose client connects to a listener by IP
//!   address through UCX's sockaddr connection manager, limited to
//!   `rdmacm` (`UCX_SOCKADDR_TLS_PRIORITY=rdmacm`): that is UCX's
//!   `rdma_cm` path through vRDMA's `librdmacm.so.1`. (`ucx_perftest`
//!   1.13 exchanges worker addresses over its own TCP socket and never
//!   uses the sockaddr path.)
//! - Open MPI with `--mca pml ucx`: a small C program built with `mpicc`
//!   (`tests/c/mpi_check.c`: 64 MiB MPI_Send/MPI_Recv checked byte for
//!   byte, then an 8-byte ping-pong) under `vrdma run -- mpirun -np 2`,
//!   with TCP and shared-memory BTLs off and `UCX_TLS=rc_v`: on one host,
//!   and across two hosts (network namespaces joined by a veth pair, a
//!   daemon in each; mpirun starts the second host's `orted` through a
//!   `plm_rsh_agent` script that does what ssh would, `ip netns exec`,
//!   and sets that host's `VRDMA_SOCKET`). Across hosts the first
//!   daemon's link must have carried the 64 MiB.
//!
//! Each program runs in a process group of its own (`vrdma run` and its
//! program, mpirun and its ranks), killed by its id at the deadline or
//! when the test ends early. The tests skip, saying so, when a tool is
//! missing; under `VRDMA_TEST_STRICT=1` (CI) that fails instead.

// The drop-in libraries exist for x86-64 Linux only.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use vrdma_it::harness::{built, free_port, listening, one_at_a_time, spawn, Finished, Running};

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");
const LIMIT: Duration = Duration::from_secs(60);
/// How long a server may take to listen.
const LISTEN_WAIT: Duration = Duration::from_secs(20);

/// Whether `program` is on `PATH`; skips (or fails, strict) without it.
fn have(program: &str, package: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| d.join(program).is_file()) {
        return true;
    }
    vrdma_it::skip(format!("{program} is missing (apt-get install {package})"));
    false
}

/// A process group: a program and everything it starts, killed (by the
/// group's id) at its deadline or on drop.
struct Group {
    run: Option<Running>,
    done: bool,
}

impl Group {
    fn spawn(mut cmd: Command, name: &str) -> Group {
        cmd.process_group(0);
        Group { run: Some(spawn(cmd, name)), done: false }
    }

    fn pgid(&self) -> i32 {
        self.run.as_ref().expect("running").pid()
    }

    fn signal(&self, sig: i32) {
        if !self.done {
            // SAFETY: kill(2) of the process group this test made (its
            // leader, our child, is not reaped yet: `done` is false).
            unsafe { libc::kill(-self.pgid(), sig) };
        }
    }

    fn exited(&mut self) -> bool {
        self.run.as_mut().expect("running").exited()
    }

    /// Waits for the leader, killing the group at the deadline.
    fn finish(mut self, limit: Duration) -> Finished {
        let end = Instant::now() + limit;
        let mut killed = false;
        while !self.exited() {
            if Instant::now() > end {
                self.signal(libc::SIGKILL);
                killed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // What the leader left running (an orphaned rank) goes too.
        self.signal(libc::SIGKILL);
        self.done = true;
        let f = self.run.take().expect("running").finish(Duration::from_secs(10));
        assert!(!killed, "timed out after {limit:?}, killed\n{}", f.describe());
        f
    }

    /// Stops a server that runs until told: SIGTERM to the group, then
    /// SIGKILL if it lingers.
    fn stop(self) -> Finished {
        self.signal(libc::SIGTERM);
        let mut g = self;
        let end = Instant::now() + Duration::from_secs(5);
        while !g.exited() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        g.signal(libc::SIGKILL);
        g.done = true;
        g.run.take().expect("running").finish(Duration::from_secs(10))
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.run.is_some() {
            self.signal(libc::SIGKILL);
        }
    }
}

/// The daemon the one-host tests share.
struct Setup {
    _dir: tempfile::TempDir,
    daemon: Mutex<vrdmad::Daemon>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let config =
            vrdmad::DaemonConfig { socket: Some(dir.path().join("vrdma.sock")), ..Default::default() };
        let daemon = vrdmad::Daemon::start(config).expect("start daemon");
        Setup { _dir: dir, daemon: Mutex::new(daemon) }
    })
}

fn socket() -> PathBuf {
    setup().daemon.lock().unwrap_or_else(|p| p.into_inner()).socket_path().to_path_buf()
}

/// The environment `vrdma run` gets in these tests: the drop-in
/// libraries this test run built, and none of UCX's settings that `vrdma
/// run` must make itself.
fn drop_in_env(c: &mut Command) {
    c.env("VRDMA_VERBS_LIB", built("libvrdma_verbs.so"))
        .env("VRDMA_RDMACM_LIB", built("libvrdma_rdmacm.so"))
        .env("VRDMA_COMPANIONS_LIB", built("libvrdma_companions.so"))
        .env("RUST_LOG", "warn")
        .env("UCX_WARN_UNUSED_ENV_VARS", "n");
    for v in ["UCX_IB_ALLOC", "UCX_TLS", "UCX_SOCKADDR_TLS_PRIORITY", "LD_LIBRARY_PATH"] {
        c.env_remove(v);
    }
}

/// `vrdma --socket SOCKET run -- ARGS...`.
fn vrdma_run(socket: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(VRDMA);
    c.arg("--socket").arg(socket).arg("run").arg("--").args(args);
    drop_in_env(&mut c);
    c
}

// ---------------------------------------------------------------------
// ucx_info

#[test]
fn ucx_info_lists_the_device_with_both_verbs_transports() {
    if !have("ucx_info", "ucx-utils") {
        return;
    }
    let f = Group::spawn(vrdma_run(&socket(), &["ucx_info", "-d"]), "ucx_info -d").finish(LIMIT);
    f.assert_ok();
    let out = &f.stdout;
    let domain = out.split("# Memory domain: ").find(|d| d.starts_with("vrdma0\n"));
    let domain = domain.unwrap_or_else(|| panic!("no vrdma0 memory domain\n{}", f.describe()));
    for tl in ["rc_verbs", "ud_verbs"] {
        let want = format!("#      Transport: {tl}\n#         Device: vrdma0:1\n");
        assert!(domain.contains(&want), "{want:?} missing\n{}", f.describe());
    }
    assert!(out.contains("# Connection manager: rdmacm"), "{}", f.describe());
    // The marker UCX needed is there now, and is /dev/null's twin.
    let node = vrdmad::devnode::node_path_in(Path::new(vrdmad::devnode::DEV_DIR), vrdmad::DEVICE_NAME);
    let meta = std::fs::metadata(&node).unwrap_or_else(|e| panic!("{}: {e}", node.display()));
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(&meta.file_type()));
    assert_eq!(std::os::unix::fs::MetadataExt::rdev(&meta), libc::makedev(1, 3));
}

// ---------------------------------------------------------------------
// ucx_perftest

/// One `ucx_perftest` pair with `UCX_TLS=tls`; returns the client's
/// result row.
fn perftest(tls: &str, test: &str, args: &[&str]) -> String {
    let sock = socket();
    let port = free_port().to_string();
    let mut server = vrdma_run(&sock, &["ucx_perftest", "-p", &port]);
    server.env("UCX_TLS", tls);
    let mut server = Group::spawn(server, &format!("ucx_perftest server ({tls})"));
    let end = Instant::now() + LISTEN_WAIT;
    while !listening(port.parse().expect("port")) {
        assert!(!server.exited(), "the server ended before it listened\n{}", server.finish(LIMIT).describe());
        assert!(Instant::now() < end, "the server does not listen after {LISTEN_WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut argv = vec!["ucx_perftest", "127.0.0.1", "-p", &port, "-t", test];
    argv.extend_from_slice(args);
    let mut client = vrdma_run(&sock, &argv);
    client.env("UCX_TLS", tls);
    let client = Group::spawn(client, &format!("ucx_perftest -t {test} ({tls})")).finish(LIMIT);
    let server = server.finish(LIMIT);
    client.assert_ok();
    server.assert_ok();
    let row = client.stdout.lines().find(|l| l.starts_with("Final:")).map(str::to_owned);
    let row = row.unwrap_or_else(|| panic!("no result row\n{}", client.describe()));
    let numbers: Vec<f64> = row.split_whitespace().skip(1).filter_map(|c| c.parse().ok()).collect();
    assert!(numbers.len() >= 8 && numbers[0] > 0.0, "result row {row:?}\n{}", client.describe());
    row
}

/// The four tests of the issue, small: latency with 8 bytes, bandwidth
/// with 64 KiB messages.
fn perftest_suite(tls: &str) {
    if !have("ucx_perftest", "ucx-utils") {
        return;
    }
    let _turn = one_at_a_time();
    for (test, args) in [
        ("tag_lat", ["-n", "500", "-s", "8"]),
        ("tag_bw", ["-n", "200", "-s", "65536"]),
        ("ucp_put_lat", ["-n", "500", "-s", "8"]),
        ("ucp_put_bw", ["-n", "200", "-s", "65536"]),
    ] {
        let row = perftest(tls, test, &args);
        eprintln!("{tls} {test}: {row}");
    }
}

#[test]
fn ucx_perftest_over_rc_verbs() {
    perftest_suite("rc_v");
}

#[test]
fn ucx_perftest_over_ud_verbs() {
    perftest_suite("ud_v");
}

// ---------------------------------------------------------------------
// UCX's rdma_cm connection manager

#[test]
fn io_demo_connects_through_the_rdmacm_connection_manager() {
    if !have("io_demo", "ucx-utils") {
        return;
    }
    let _turn = one_at_a_time();
    let sock = socket();
    let port = free_port();
    let p = port.to_string();
    let env = |c: &mut Command| {
        c.env("UCX_TLS", "rc_v").env("UCX_SOCKADDR_TLS_PRIORITY", "rdmacm");
    };
    let mut server = vrdma_run(&sock, &["io_demo", "-p", &p]);
    env(&mut server);
    let mut server = Group::spawn(server, "io_demo server");
    // rdma_cm listeners show in no socket table: ask the daemon.
    let ctx = vrdma::Context::open_at(&sock).expect("context");
    let end = Instant::now() + LISTEN_WAIT;
    let listens = |ip: Ipv4Addr| {
        vrdma::cm::is_listening(&ctx, vrdma::cm::PortSpace::Tcp, SocketAddrV4::new(ip, port)).unwrap_or(false)
    };
    while !(listens(Ipv4Addr::LOCALHOST) || listens(Ipv4Addr::UNSPECIFIED)) {
        assert!(!server.exited(), "the server ended before it listened\n{}", server.finish(LIMIT).describe());
        assert!(Instant::now() < end, "io_demo does not listen after {LISTEN_WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // 200 write requests, data and transactions checked (-q).
    let mut client = vrdma_run(&sock, &["io_demo", "-p", &p, "-i", "200", "-q", "-c", "1", "127.0.0.1"]);
    env(&mut client);
    let client = Group::spawn(client, "io_demo client").finish(LIMIT);
    let server = server.stop();
    assert!(client.status.success(), "{}\n{}", client.describe(), server.describe());
    assert!(client.stdout.contains("Client exit with status 'OK'"), "{}", client.describe());
    assert!(!client.stdout.contains("ERROR") && !client.stderr.contains("ERROR"), "{}", client.describe());
}

// ---------------------------------------------------------------------
// Open MPI over UCX

/// `tests/c/mpi_check.c`, built once with mpicc.
fn mpi_program() -> Option<PathBuf> {
    if !(have("mpicc", "libopenmpi-dev") && have("mpirun", "openmpi-bin")) {
        return None;
    }
    static BUILT: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, exe) = BUILT.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let exe = dir.path().join("mpi_check");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/mpi_check.c");
        let mut c = Command::new("mpicc");
        c.args(["-O2", "-Wall", "-o"]).arg(&exe).arg(&src);
        Group::spawn(c, "mpicc").finish(LIMIT).assert_ok();
        (dir, exe)
    });
    Some(exe.clone())
}

/// mpirun's arguments: two ranks over UCX only (no TCP or shared-memory
/// byte transfer layer to fall back on), as root on a small machine.
fn mpirun_args(hosts: Option<(&str, &Path)>, program: &Path) -> Vec<String> {
    let mut a: Vec<String> =
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"].map(String::from).into();
    a.extend(["--mca", "pml", "ucx", "--mca", "btl", "^vader,tcp,openib,uct"].map(String::from));
    if let Some((hosts, agent)) = hosts {
        a.extend(["--host".to_string(), hosts.to_string(), "--mca".into(), "plm_rsh_agent".into()]);
        a.push(agent.display().to_string());
    }
    a.push(program.display().to_string());
    a
}

fn check_mpi_output(f: &Finished) {
    f.assert_ok();
    for want in
        ["rank 0 of 2", "rank 1 of 2", "rank 1: 64 MiB received intact", "ping-pong: 1000 round trips"]
    {
        assert!(f.stdout.contains(want), "{want:?} missing\n{}", f.describe());
    }
}

#[test]
fn open_mpi_over_ucx_on_one_host() {
    let Some(program) = mpi_program() else { return };
    let _turn = one_at_a_time();
    let args = mpirun_args(None, &program);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut c = vrdma_run(&socket(), &args);
    c.env("UCX_TLS", "rc_v");
    let f = Group::spawn(c, "vrdma run -- mpirun").finish(LIMIT);
    check_mpi_output(&f);
    eprintln!("{}", f.stdout.lines().find(|l| l.starts_with("ping-pong")).unwrap_or(""));
}

#[test]
fn open_mpi_over_ucx_across_two_hosts() {
    let Some(program) = mpi_program() else { return };
    if let Some(why) = vrdma_it::netns_unavailable() {
        vrdma_it::skip(format!("network namespaces need root and iproute2 ({why})"));
        return;
    }
    let _turn = one_at_a_time();
    let Some(hosts) = vrdma_it::NetnsHosts::start("").expect("two hosts") else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    // What ssh would do for mpirun: run the command line on the other
    // host, which is its network namespace, where the daemon's socket is
    // that host's own (as the default path would be on a real host); the
    // rest of the environment comes from mpirun's.
    let agent = dir.path().join("netns-rsh");
    let script = format!(
        "#!/bin/sh\nhost=\"$1\"\nshift\n[ \"$host\" = \"{addr}\" ] || {{ echo \"netns-rsh: unknown host $host\" >&2; exit 255; }}\n\
         exec ip netns exec {ns} env VRDMA_SOCKET={sock} /bin/sh -c \"$*\"\n",
        addr = hosts.net.addr[1],
        ns = hosts.net.ns[1],
        sock = hosts.b.socket.display(),
    );
    std::fs::write(&agent, script).expect("write the agent");
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let sent = |h: &vrdma_it::DaemonProc| -> u64 {
        let s = h.context().and_then(|c| Ok(c.stat()?)).expect("stat");
        s.links.iter().map(|l| l.stats.payload_out).sum()
    };
    let host_list = format!("{}:1,{}:1", hosts.net.addr[0], hosts.net.addr[1]);
    // Two ways: `vrdma run -- mpirun ...` (the ranks inherit what it set
    // up: here the second host sees the same /tmp, as it would not on a
    // real one), and `mpirun ... vrdma run -- PROGRAM`, each rank through
    // `vrdma run` on its own host (the README's way for real hosts).
    for per_rank in [false, true] {
        let before = sent(&hosts.a);
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &hosts.net.ns[0]]);
        let name = if per_rank {
            let mut args = mpirun_args(Some((&host_list, &agent)), Path::new(VRDMA));
            let prog = args.pop().expect("the program");
            args.extend(["-x".into(), "UCX_TLS".into(), prog, "run".into(), "--".into()]);
            args.push(program.display().to_string());
            c.args(args).env("VRDMA_SOCKET", &hosts.a.socket);
            "mpirun -- vrdma run -- mpi_check across two hosts"
        } else {
            c.args([VRDMA, "--socket"]).arg(&hosts.a.socket).args(["run", "--"]);
            c.args(mpirun_args(Some((&host_list, &agent)), &program));
            "vrdma run -- mpirun across two hosts"
        };
        drop_in_env(&mut c);
        c.env("UCX_TLS", "rc_v");
        let f = Group::spawn(c, name).finish(Duration::from_secs(120));
        // Anything mpirun left in host B's namespace (orted, a rank) goes
        // before the namespaces do: every process there but the daemon.
        kill_leftovers(&hosts.net.ns[1], hosts.b.proc.pid());
        check_mpi_output(&f);
        let moved = sent(&hosts.a) - before;
        assert!(
            moved >= 64 << 20,
            "{name}: host A's daemon sent only {moved} B over its link\n{}",
            f.describe()
        );
        eprintln!("{name}: {}", f.stdout.lines().find(|l| l.starts_with("ping-pong")).unwrap_or(""));
    }
}

/// SIGKILL to every process in network namespace `ns` except `keep`.
fn kill_leftovers(ns: &str, keep: i32) {
    let out = Command::new("ip").args(["netns", "pids", ns]).output().expect("ip netns pids");
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
        if pid != keep {
            // SAFETY: kill(2) of a process in a namespace this test made,
            // which only the test's processes joined.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}
