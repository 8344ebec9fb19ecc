//! The unmodified Debian `rdmacm-utils` binaries (`rping`, `ucmatose`),
//! run against a real daemon through this library and vRDMA's
//! libibverbs.
//!
//! Each test points `LD_LIBRARY_PATH` at a private directory holding
//! `librdmacm.so.1` and `libibverbs.so.1` links to the cdylibs cargo
//! built (`libvrdma_rdmacm.so`, and `libvrdma_verbs.so` as a
//! dev-dependency), and `VRDMA_SOCKET` at a daemon this test process runs.
//! `LD_BIND_NOW=1` resolves every import at load time, so a missing
//! export fails at once. `debian_librdmacm_fails_without_the_shim` shows
//! what the others would see without this library.
//!
//! The tests skip, saying so, only when `/usr/bin/rping` is missing
//! (`apt-get install rdmacm-utils`); under `VRDMA_TEST_STRICT=1` (CI)
//! that fails instead. Every wait is bounded: a process still running at
//! its deadline is killed by pid and the test fails; each process is
//! killed by pid when its test ends early.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{built, free_port, one_at_a_time, spawn, Finished, Running};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const RPING: &str = "/usr/bin/rping";
const UCMATOSE: &str = "/usr/bin/ucmatose";
const LIMIT: Duration = Duration::from_secs(60);
/// How long a client is retried while its server is not listening yet.
const LISTEN_WAIT: Duration = Duration::from_secs(30);

/// The daemon and the library directory all tests of this binary share.
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

    /// A command for `program` using both drop-in libraries and the daemon.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.lib_dir())
            .env("VRDMA_SOCKET", self.socket())
            .env("LD_BIND_NOW", "1")
            .env("VRDMA_RDMACM_DEBUG", "1")
            .env("VRDMA_VERBS_DEBUG", "1");
        c
    }
}

/// The shared setup, or `None` (with the reason printed) without the tools.
fn setup() -> Option<&'static Setup> {
    for tool in [RPING, UCMATOSE] {
        if !Path::new(tool).exists() {
            vrdma_it::skip(format!("{tool} is missing (apt-get install rdmacm-utils)"));
            return None;
        }
    }
    static SETUP: OnceLock<Setup> = OnceLock::new();
    Some(SETUP.get_or_init(|| {
        let (dir, daemon) = common::drop_in_dir();
        Setup { dir, _daemon: Mutex::new(daemon) }
    }))
}

/// Runs the client `args` until it is not turned away for want of a
/// listener (the server may not listen yet: rdma_cm listeners show in no
/// socket table), as long as `server` runs and at most [`LISTEN_WAIT`].
fn client_when_listening(
    s: &Setup,
    program: &str,
    args: &[&str],
    server: &mut Running,
    rejected: &str,
) -> Finished {
    // Where the daemon can say so, the client starts once the server
    // listens; the retries below are for the rest.
    if let Some(target) = common::listen_target(program, args) {
        common::wait_listening(&s.socket(), target, server, LISTEN_WAIT);
    }
    let end = Instant::now() + LISTEN_WAIT;
    loop {
        let mut c = s.command(program);
        c.args(args);
        let f = spawn(c, &format!("{program} (client) {}", args.join(" "))).finish(LIMIT);
        let turned_away = !f.status.success() && format!("{}{}", f.stdout, f.stderr).contains(rejected);
        if !turned_away || server.exited() || Instant::now() > end {
            return f;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn check_clean(f: &Finished) {
    let all = format!("{}{}", f.stdout, f.stderr);
    for bad in ["vrdma librdmacm:", "vrdma-verbs:", "data mismatch", "error"] {
        assert!(!all.contains(bad), "{bad:?} in the output\n{}", f.describe());
    }
}

#[test]
fn rping_server_and_client_exchange_ten_pings() {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let common = ["-a", "127.0.0.1", "-p", port.as_str(), "-C", "10", "-v"];
    let mut server_cmd = s.command(RPING);
    server_cmd.arg("-s").args(common);
    let mut server = spawn(server_cmd, &format!("rping -s {}", common.join(" ")));
    let mut client_args = vec!["-c"];
    client_args.extend_from_slice(&common);
    let client = client_when_listening(s, RPING, &client_args, &mut server, "RDMA_CM_EVENT_REJECTED");
    let server = server.finish(LIMIT);
    for (f, prefix) in [(&client, "ping data: rdma-ping-"), (&server, "server ping data: rdma-ping-")] {
        f.assert_ok();
        check_clean(f);
        let lines: Vec<&str> = f.stdout.lines().filter(|l| l.starts_with(prefix)).collect();
        assert_eq!(lines.len(), 10, "{}", f.describe());
        for (n, l) in lines.iter().enumerate() {
            assert!(l.starts_with(&format!("{prefix}{n}: ")), "line {n}: {l:?}\n{}", f.describe());
        }
    }
    assert!(client.stderr.contains("client DISCONNECT EVENT"), "{}", client.describe());
    assert!(server.stderr.contains("server DISCONNECT EVENT"), "{}", server.describe());
}

#[test]
fn ucmatose_four_connections_ten_messages_each() {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let common = ["-p", port.as_str(), "-c", "4", "-C", "10"];
    let mut server_cmd = s.command(UCMATOSE);
    server_cmd.args(common);
    let mut server = spawn(server_cmd, &format!("ucmatose {}", common.join(" ")));
    let mut client_args = vec!["-s", "127.0.0.1"];
    client_args.extend_from_slice(&common);
    let client = client_when_listening(s, UCMATOSE, &client_args, &mut server, "RDMA_CM_EVENT_REJECTED");
    let server = server.finish(LIMIT);
    for f in [&client, &server] {
        f.assert_ok();
        check_clean(f);
        for want in ["data transfers complete", "test complete", "return status 0"] {
            assert!(f.stdout.contains(want), "{want:?} missing\n{}", f.describe());
        }
    }
    assert!(server.stdout.contains("disconnected"), "{}", server.describe());
}

#[test]
fn ucmatose_migrates_its_ids_to_a_new_channel() {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let common = ["-p", port.as_str(), "-c", "2", "-C", "5", "-m"];
    let mut server_cmd = s.command(UCMATOSE);
    server_cmd.args(common);
    let mut server = spawn(server_cmd, &format!("ucmatose {}", common.join(" ")));
    let mut client_args = vec!["-s", "127.0.0.1"];
    client_args.extend_from_slice(&common);
    let client = client_when_listening(s, UCMATOSE, &client_args, &mut server, "RDMA_CM_EVENT_REJECTED");
    let server = server.finish(LIMIT);
    for f in [&client, &server] {
        f.assert_ok();
        check_clean(f);
        assert!(f.stdout.contains("migrating to new event channel"), "{}", f.describe());
        assert!(f.stdout.contains("return status 0"), "{}", f.describe());
    }
}

#[test]
fn rping_to_a_port_without_listener_is_rejected_promptly() {
    let Some(s) = setup() else { return };
    let port = free_port().to_string();
    let mut c = s.command(RPING);
    c.args(["-c", "-a", "127.0.0.1", "-p", port.as_str(), "-C", "1", "-v"]);
    let started = Instant::now();
    let f = spawn(c, "rping -c (nobody listens)").finish(LIMIT);
    assert!(!f.status.success(), "{}", f.describe());
    assert!(f.stderr.contains("RDMA_CM_EVENT_REJECTED"), "{}", f.describe());
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}\n{}", started.elapsed(), f.describe());
}

/// Without this library, Debian's librdmacm looks for the kernel's
/// connection manager and fails at once: what the tests above would show.
#[test]
fn debian_librdmacm_fails_without_the_shim() {
    let Some(s) = setup() else { return };
    if Path::new("/dev/infiniband/rdma_cm").exists() {
        eprintln!("not checked: this host has a kernel rdma_cm, which Debian's librdmacm would use");
        return;
    }
    let lib = s.dir.path().join("verbs-only");
    let _ = std::fs::create_dir(&lib);
    let _ = std::os::unix::fs::symlink(built("libvrdma_verbs.so"), lib.join("libibverbs.so.1"));
    let port = free_port().to_string();
    let mut c = s.command(RPING);
    c.env("LD_LIBRARY_PATH", &lib).args(["-c", "-a", "127.0.0.1", "-p", port.as_str(), "-C", "1"]);
    let f = spawn(c, "rping -c (Debian's librdmacm)").finish(LIMIT);
    assert!(!f.status.success(), "{}", f.describe());
    assert!(f.stderr.contains("failed to create RDMA CM event channel"), "{}", f.describe());
}

/// `tests/c/cm_check.c`, compiled against rdma-core's headers and linked
/// against both drop-in libraries: what the tools do not reach
/// (non-blocking channels, the id's fields, rdma_getaddrinfo, ENOSYS).
#[test]
fn c_checks_of_channels_ids_and_addresses() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_check") else { return };
    let port = free_port().to_string();
    let mut c = s.command(exe.to_str().expect("utf-8 path"));
    c.env_remove("VRDMA_RDMACM_DEBUG").arg(&port);
    let f = spawn(c, "cm_check").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("cm_check: OK"), "{}", f.describe());
    // The one-time notice of a call that is not implemented names it.
    assert!(f.stderr.contains("rdma_notify is not implemented"), "{}", f.describe());
}

/// `tests/c/cm_device_early.c`: the device context is open once the
/// first event channel is (as rdma-core's `ucma_init` lists its devices
/// at the first call), so the first `rdma_resolve_addr` opens no
/// connection to the daemon of its own (it loaded libibverbs, listed and
/// opened the device: about 0.5 ms of a fresh process's first resolve).
#[test]
fn c_the_first_resolve_finds_the_device_open() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_device_early") else { return };
    let mut c = s.command(exe.to_str().expect("utf-8 path"));
    c.arg(free_port().to_string());
    let f = spawn(c, "cm_device_early").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("cm_device_early: OK"), "{}", f.describe());
    check_clean(&f);
}

/// `tests/c/cm_destroy_waiting.c`: a channel destroyed while another
/// thread waits in `rdma_get_cm_event` on it (rping's end) leaves that
/// thread waiting, as the kernel's librdmacm does: no error back (rping
/// exits the process with it), no freed memory touched.
#[test]
fn a_channel_destroyed_under_a_waiting_thread_leaves_it_waiting() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_destroy_waiting") else { return };
    let f = spawn(s.command(exe.to_str().expect("utf-8 path")), "cm_destroy_waiting").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("cm_destroy_waiting: OK"), "{}", f.describe());
    check_clean(&f);
}

/// `tests/c/cm_destroy_race.c`: a thread reads a channel's events,
/// holding each a moment, while the main thread destroys their ids (300
/// rounds): `rdma_destroy_id` waits until the id's events handed out are
/// acknowledged, as librdmacm's does, so no event's id is freed under its
/// reader (it was: the event's lookup of its id raced the destroy).
#[test]
fn c_an_id_is_not_destroyed_under_an_event_a_thread_holds() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_destroy_race") else { return };
    let f = spawn(s.command(exe.to_str().expect("utf-8 path")), "cm_destroy_race").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("cm_destroy_race: OK"), "{}", f.describe());
    check_clean(&f);
}

/// `tests/c/NAME.c` compiled against rdma-core's headers and linked
/// against both drop-in libraries; `None` (the test skips, saying why)
/// without a C compiler.
fn compile_c(s: &Setup, name: &str) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = s.dir.path().join(name);
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
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => panic!("{cc} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("no C compiler ({cc}: {e})"));
            None
        }
    }
}

/// `tests/c/cm_restart.c`: the daemon goes away under a program of this
/// library. Its resolved id hears DEVICE_REMOVAL (the channel's
/// descriptor turns readable), then the channel says ENODEV rather than
/// wait; the daemon then comes back on the same socket.
#[test]
fn c_device_removal_when_the_daemon_goes_away() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_restart") else { return };
    let sock = s.dir.path().join("restart.sock");
    let config = || vrdmad::DaemonConfig { socket: Some(sock.clone()), ..Default::default() };
    let daemon = vrdmad::Daemon::start(config()).expect("start daemon");
    let marker = s.dir.path().join("cm_restart.resolved");
    let mut c = s.command(exe.to_str().expect("utf-8 path"));
    c.env("VRDMA_SOCKET", &sock).env_remove("VRDMA_RDMACM_DEBUG").arg(free_port().to_string()).arg(&marker);
    let mut run = spawn(c, "cm_restart");
    let end = Instant::now() + LIMIT;
    while !marker.exists() && !run.exited() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(daemon);
    let back = vrdmad::Daemon::start(config()).expect("the daemon back on its socket");
    let f = run.finish(LIMIT);
    drop(back);
    f.assert_ok();
    assert!(f.stdout.contains("cm_restart: OK"), "{}", f.describe());
}

/// `tests/c/cm_reconnect.c`: the daemon is restarted under a program of
/// this library, which hears DEVICE_REMOVAL, cleans up (every destroy
/// succeeds, the old device's verbs fail rather than hang), and then, in
/// the same process, connects again through the new daemon and exchanges
/// a message, as a program does after a device reset on rdma-core.
#[test]
fn c_a_program_connects_again_after_the_daemon_restarts() {
    let Some(s) = setup() else { return };
    if !Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vrdma_it::skip("/usr/include/rdma/rdma_cma.h is missing (apt-get install librdmacm-dev)");
        return;
    }
    let Some(exe) = compile_c(s, "cm_reconnect") else { return };
    let sock = s.dir.path().join("reconnect.sock");
    let config = || vrdmad::DaemonConfig { socket: Some(sock.clone()), ..Default::default() };
    let daemon = vrdmad::Daemon::start(config()).expect("start daemon");
    let marker = s.dir.path().join("cm_reconnect.connected");
    let mut c = s.command(exe.to_str().expect("utf-8 path"));
    c.env("VRDMA_SOCKET", &sock)
        .env_remove("VRDMA_RDMACM_DEBUG")
        .env_remove("VRDMA_VERBS_DEBUG")
        .arg(free_port().to_string())
        .arg(free_port().to_string())
        .arg(&marker);
    let mut run = spawn(c, "cm_reconnect");
    let end = Instant::now() + LIMIT;
    while !marker.exists() && !run.exited() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(daemon);
    let back = vrdmad::Daemon::start(config()).expect("the daemon back on its socket");
    let f = run.finish(LIMIT);
    drop(back);
    f.assert_ok();
    assert!(f.stdout.contains("cm_reconnect: OK"), "{}", f.describe());
}

/// The daemon goes away while Debian's rping pings through it, without
/// end: server and client both hear DEVICE_REMOVAL and end on their own
/// with an error exit code (no crash, no hang) before their deadline.
#[test]
fn rping_ends_when_the_daemon_goes_away_mid_run() {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let sock = s.dir.path().join("rping-gone.sock");
    let daemon =
        vrdmad::Daemon::start(vrdmad::DaemonConfig { socket: Some(sock.clone()), ..Default::default() })
            .expect("start daemon");
    let port = free_port().to_string();
    let common = ["-a", "127.0.0.1", "-p", port.as_str()];
    let mut server_cmd = s.command(RPING);
    server_cmd.env("VRDMA_SOCKET", &sock).arg("-s").args(common);
    let mut server = spawn(server_cmd, "rping -s (daemon goes)");
    let target = common::listen_target(RPING, &common).expect("rping's listen address");
    common::wait_listening(&sock, target, &mut server, LISTEN_WAIT);
    let mut client_cmd = s.command(RPING);
    client_cmd.env("VRDMA_SOCKET", &sock).arg("-c").args(common);
    let mut client = spawn(client_cmd, "rping -c (daemon goes)");
    // Pinging for a while (no count: until something ends it).
    let end = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end && !client.exited() {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!client.exited(), "the client ended before the daemon went\n{}", client.finish(LIMIT).describe());
    drop(daemon);
    for f in [client.finish(LIMIT), server.finish(LIMIT)] {
        // An exit code, not a signal (a crash); `finish` fails a hang.
        assert!(f.status.code().is_some_and(|c| c != 0), "{}", f.describe());
        // rping's own report of RDMA_CM_EVENT_DEVICE_REMOVAL.
        assert!(f.stderr.contains("device removal"), "{}", f.describe());
        assert!(!f.stderr.contains("panicked"), "{}", f.describe());
    }
}

/// `vrdma run` from the workspace's CLI, when cargo built it (it does for
/// `cargo test --workspace`; alone, this package's tests do not build it)
/// and it is recent enough to link `librdmacm.so.1`.
fn vrdma_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent()?;
    let bin = if deps.ends_with("deps") { deps.parent()? } else { deps }.join("vrdma");
    let help = Command::new(&bin).args(["run", "--help"]).stdin(Stdio::null()).output();
    match help {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("librdmacm") => Some(bin),
        _ => {
            eprintln!(
                "skipping: {} with `vrdma run` linking librdmacm is not built (cargo build -p vrdma-cli)",
                bin.display()
            );
            None
        }
    }
}

/// `vrdma run` links `librdmacm.so.1` to this library: rping runs through
/// it with nothing else set up.
#[test]
fn vrdma_run_links_librdmacm() {
    let Some(s) = setup() else { return };
    let Some(vrdma) = vrdma_bin() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let run = |role: &str| {
        let mut c = Command::new(&vrdma);
        c.env_remove("LD_LIBRARY_PATH")
            .env("VRDMA_VERBS_LIB", built("libvrdma_verbs.so"))
            .env("VRDMA_RDMACM_LIB", built("libvrdma_rdmacm.so"))
            .env("VRDMA_SOCKET", s.socket())
            .args(["run", "--", RPING, role, "-a", "127.0.0.1", "-p", port.as_str(), "-C", "3", "-v"]);
        c
    };
    let mut server = spawn(run("-s"), "vrdma run -- rping -s");
    let end = Instant::now() + LISTEN_WAIT;
    let client = loop {
        let f = spawn(run("-c"), "vrdma run -- rping -c").finish(LIMIT);
        if f.status.success()
            || !f.stderr.contains("RDMA_CM_EVENT_REJECTED")
            || server.exited()
            || Instant::now() > end
        {
            break f;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let server = server.finish(LIMIT);
    client.assert_ok();
    server.assert_ok();
    assert_eq!(
        client.stdout.lines().filter(|l| l.starts_with("ping data: ")).count(),
        3,
        "{}",
        client.describe()
    );
}

/// Two hosts: a daemon on 127.0.0.2 and one on 127.0.0.3 (each its own
/// host, linked by the transport between daemons with a pre-shared key),
/// rping's server on the second and its client on the first. The
/// connection manager's exchange and the pings ride the link.
#[test]
fn rping_across_two_hosts_exchanges_ten_pings() {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().expect("temp dir");
    let wire = vrdma_it::free_port().expect("a free port");
    let daemon = |ip: &str| {
        let toml = vrdma_it::host_config(ip, wire, &[], "");
        let mut config = vrdmad::DaemonConfig::from_toml(&toml).expect("config");
        config.socket = Some(dir.path().join(format!("{ip}.sock")));
        vrdmad::Daemon::start(config).expect("start daemon")
    };
    let (a, b) = (daemon("127.0.0.2"), daemon("127.0.0.3"));
    let on = |d: &vrdmad::Daemon, program: &str| {
        let mut c = s.command(program);
        c.env("VRDMA_SOCKET", d.socket_path());
        c
    };
    let port = free_port().to_string();
    let common = ["-a", "127.0.0.3", "-p", port.as_str(), "-C", "10", "-v"];
    let mut server_cmd = on(&b, RPING);
    server_cmd.arg("-s").args(common);
    let mut server = spawn(server_cmd, &format!("rping -s {} (host B)", common.join(" ")));
    let end = Instant::now() + LISTEN_WAIT;
    let client = loop {
        let mut c = on(&a, RPING);
        c.arg("-c").args(common);
        let f = spawn(c, &format!("rping -c {} (host A)", common.join(" "))).finish(LIMIT);
        let turned_away = !f.status.success() && format!("{}{}", f.stdout, f.stderr).contains("REJECTED");
        if !turned_away || server.exited() || Instant::now() > end {
            break f;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let server = server.finish(LIMIT);
    for (f, prefix) in [(&client, "ping data: rdma-ping-"), (&server, "server ping data: rdma-ping-")] {
        f.assert_ok();
        check_clean(f);
        assert_eq!(f.stdout.lines().filter(|l| l.starts_with(prefix)).count(), 10, "{}", f.describe());
    }
    drop((a, b));
}
