//! The unmodified Debian `ibverbs-utils` binaries, run against a real
//! daemon through this library.
//!
//! Each test points `LD_LIBRARY_PATH` at a private directory holding a
//! `libibverbs.so.1` link to the cdylib cargo built for this package
//! (`target/<profile>/libvrdma_verbs.so`), and `VRDMA_SOCKET` at a daemon
//! this test process runs (the tools are separate processes, so an
//! in-process daemon serves them like any other). `LD_BIND_NOW=1` makes
//! the dynamic linker resolve every imported symbol at load time, so a
//! missing export fails at once instead of when first called.
//!
//! The tests skip, saying so, only when `/usr/bin/ibv_devinfo` is missing
//! (`apt-get install ibverbs-utils`). Every wait is bounded: a process
//! still running at its deadline is killed by pid and the test fails.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{free_port, listening, one_at_a_time, spawn, Finished};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const DEVINFO: &str = "/usr/bin/ibv_devinfo";
const LIMIT: Duration = Duration::from_secs(120);

/// The cdylib cargo built for this test run: beside the test executable
/// in `target/<profile>/deps/` (cargo copies it up to `target/<profile>/`
/// only for `cargo build`).
fn shim() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir");
    let profile = if deps.ends_with("deps") { deps.parent().expect("profile dir") } else { deps };
    [deps, profile]
        .iter()
        .map(|d| d.join("libvrdma_verbs.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvrdma_verbs.so was not built next to {}", exe.display()))
}

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

    /// A command for `program` using the shim and the daemon.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.lib_dir())
            .env("VRDMA_SOCKET", self.socket())
            .env("LD_BIND_NOW", "1")
            .env("VRDMA_VERBS_DEBUG", "1");
        c
    }
}

/// The shared setup, or `None` (with the reason printed) without the tools.
fn setup() -> Option<&'static Setup> {
    if !Path::new(DEVINFO).exists() {
        vrdma_it::skip(format!("{DEVINFO} is missing (apt-get install ibverbs-utils)"));
        return None;
    }
    static SETUP: OnceLock<Setup> = OnceLock::new();
    Some(SETUP.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        std::os::unix::fs::symlink(shim(), lib.join("libibverbs.so.1")).expect("symlink");
        let config =
            vrdmad::DaemonConfig { socket: Some(dir.path().join("vrdma.sock")), ..Default::default() };
        let daemon = vrdmad::Daemon::start(config).expect("start daemon");
        Setup { dir, _daemon: Mutex::new(daemon) }
    }))
}

fn run(setup: &Setup, program: &str, args: &[&str]) -> Finished {
    let mut c = setup.command(program);
    c.args(args);
    spawn(c, &format!("{program} {}", args.join(" "))).finish(LIMIT)
}

/// Runs `program` as server and client on loopback with `args`, and
/// checks that both exit 0 after moving their traffic.
fn pingpong(program: &str, args: &[&str]) {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let port = free_port().to_string();
    let mut common = vec!["-p", port.as_str()];
    common.extend_from_slice(args);
    let mut server_cmd = s.command(program);
    server_cmd.args(&common);
    let mut server = spawn(server_cmd, &format!("{program} (server) {}", common.join(" ")));
    let end = Instant::now() + Duration::from_secs(30);
    let port_num: u16 = port.parse().expect("port");
    while !listening(port_num) {
        if server.exited() || Instant::now() > end {
            panic!("the server never listened\n{}", server.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_cmd = s.command(program);
    client_cmd.args(&common).arg("localhost");
    let client = spawn(client_cmd, &format!("{program} (client) {} localhost", common.join(" ")));
    let client = client.finish(LIMIT);
    let server = server.finish(LIMIT);
    for f in [&client, &server] {
        f.assert_ok();
        assert!(f.stdout.contains(" bytes in ") && f.stdout.contains(" iters in "), "{}", f.describe());
        for bad in ["invalid data", "Failed status", "Couldn't"] {
            let all = format!("{}{}", f.stdout, f.stderr);
            assert!(!all.contains(bad), "{bad:?} in the output\n{}", f.describe());
        }
    }
}

#[test]
fn devices_lists_vrdma0_with_its_guid() {
    let Some(s) = setup() else { return };
    let f = run(s, "/usr/bin/ibv_devices", &[]);
    f.assert_ok();
    let ctx = vrdma::Context::open_at(s.socket()).expect("open");
    let guid = format!("{:016x}", ctx.query_device().expect("query").node_guid);
    let line = f.stdout.lines().find(|l| l.contains("vrdma0")).unwrap_or_else(|| panic!("{}", f.describe()));
    assert!(line.contains(&guid), "GUID {guid} missing\n{}", f.describe());
}

#[test]
fn devinfo_shows_the_active_port() {
    let Some(s) = setup() else { return };
    let f = run(s, DEVINFO, &[]);
    f.assert_ok();
    let ctx = vrdma::Context::open_at(s.socket()).expect("open");
    let port = ctx.query_port(1).expect("port");
    for want in [
        "hca_id:\tvrdma0".to_string(),
        "transport:\t\t\tInfiniBand (0)".to_string(),
        "PORT_ACTIVE (4)".to_string(),
        format!("port_lid:\t\t{}", port.lid),
        "link_layer:\t\tInfiniBand".to_string(),
        "vendor_id:\t\t\t0x5652".to_string(),
    ] {
        assert!(f.stdout.contains(&want), "{want:?} missing\n{}", f.describe());
    }
}

#[test]
fn devinfo_verbose_shows_limits_and_the_gid() {
    let Some(s) = setup() else { return };
    let f = run(s, DEVINFO, &["-v"]);
    f.assert_ok();
    let ctx = vrdma::Context::open_at(s.socket()).expect("open");
    let gid = ctx.query_gid(1, 0).expect("gid");
    let dev = ctx.query_device().expect("device");
    for want in [
        format!("GID[  0]:\t\t{gid}"),
        format!("max_qp_wr:\t\t\t{}", dev.max_qp_wr),
        format!("max_srq:\t\t\t{}", dev.max_srq),
        "phys_state:\t\tLINK_UP (5)".to_string(),
        "num_comp_vectors:\t\t1".to_string(),
        "gid_tbl_len:\t\t1".to_string(),
    ] {
        assert!(f.stdout.contains(&want), "{want:?} missing\n{}", f.describe());
    }
}

#[test]
fn devinfo_lists_device_names() {
    let Some(s) = setup() else { return };
    let f = run(s, DEVINFO, &["-l"]);
    f.assert_ok();
    assert!(f.stdout.contains("1 HCA found:") && f.stdout.contains("vrdma0"), "{}", f.describe());
}

#[test]
fn no_daemon_means_no_device() {
    let Some(s) = setup() else { return };
    let mut c = s.command("/usr/bin/ibv_devices");
    c.env("VRDMA_SOCKET", s.dir.path().join("nobody-listens.sock"));
    let f = spawn(c, "ibv_devices (no daemon)").finish(LIMIT);
    f.assert_ok();
    assert!(!f.stdout.contains("vrdma0"), "{}", f.describe());
    let mut c = s.command(DEVINFO);
    c.env("VRDMA_SOCKET", s.dir.path().join("nobody-listens.sock"));
    let f = spawn(c, "ibv_devinfo (no daemon)").finish(LIMIT);
    assert!(f.stderr.contains("No IB devices found"), "{}", f.describe());
}

#[test]
fn rc_pingpong() {
    pingpong("/usr/bin/ibv_rc_pingpong", &[]);
}

#[test]
fn rc_pingpong_validates_data() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-c"]);
}

#[test]
fn rc_pingpong_with_events() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-e"]);
}

#[test]
fn rc_pingpong_with_events_validates_data() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-e", "-c"]);
}

#[test]
fn rc_pingpong_by_gid_with_small_messages() {
    pingpong("/usr/bin/ibv_rc_pingpong", &["-g", "0", "-s", "64", "-c"]);
}

#[test]
fn srq_pingpong() {
    pingpong("/usr/bin/ibv_srq_pingpong", &[]);
}

#[test]
fn srq_pingpong_with_events() {
    pingpong("/usr/bin/ibv_srq_pingpong", &["-e", "-q", "4"]);
}

#[test]
fn ud_pingpong() {
    pingpong("/usr/bin/ibv_ud_pingpong", &[]);
}

#[test]
fn ud_pingpong_validates_data() {
    pingpong("/usr/bin/ibv_ud_pingpong", &["-c"]);
}

#[test]
fn ud_pingpong_with_events_validates_data() {
    pingpong("/usr/bin/ibv_ud_pingpong", &["-e", "-c"]);
}

/// With `-g 0` the address handles are global: the receiver finds the
/// sender's GID in the GRH of each datagram.
#[test]
fn ud_pingpong_by_gid_with_a_service_level() {
    pingpong("/usr/bin/ibv_ud_pingpong", &["-g", "0", "-l", "3", "-s", "1024", "-c"]);
}

const QPERF: &str = "/usr/bin/qperf";

/// Runs the qperf server on a free port and one client test (`-t 1`)
/// against it, then kills the server (it serves forever) by pid. The
/// client must exit 0 and print each of `figures` (`"bw  ="`, ...); no
/// output of either side may say "failed".
fn qperf(test: &str, figures: &[&str]) {
    let Some(s) = setup() else { return };
    if !Path::new(QPERF).exists() {
        vrdma_it::skip(format!("{QPERF} is missing (apt-get install qperf)"));
        return;
    }
    let _turn = one_at_a_time();
    let port = free_port();
    let lp = port.to_string();
    let mut server_cmd = s.command(QPERF);
    server_cmd.args(["-lp", &lp]);
    let mut server = spawn(server_cmd, &format!("qperf -lp {lp} (server)"));
    let end = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if server.exited() || Instant::now() > end {
            panic!("the qperf server never listened\n{}", server.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_cmd = s.command(QPERF);
    client_cmd.args(["127.0.0.1", "-lp", &lp, "-t", "1", test]);
    let client = spawn(client_cmd, &format!("qperf 127.0.0.1 -lp {lp} -t 1 {test}")).finish(QPERF_LIMIT);
    // The server loops forever: stop it by pid and look at what it said.
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(server.pid(), libc::SIGKILL) };
    let server = server.finish(LIMIT);
    client.assert_ok();
    for want in figures {
        assert!(client.stdout.contains(want), "{want:?} missing\n{}", client.describe());
    }
    for f in [&client, &server] {
        let all = format!("{}{}", f.stdout, f.stderr);
        assert!(!all.contains("failed"), "\"failed\" in the output\n{}", f.describe());
    }
}

/// A qperf client test runs for about a second plus setup.
const QPERF_LIMIT: Duration = Duration::from_secs(60);

#[test]
fn qperf_rc_bw() {
    qperf("rc_bw", &["bw  ="]);
}

#[test]
fn qperf_rc_bi_bw() {
    qperf("rc_bi_bw", &["bw  ="]);
}

#[test]
fn qperf_rc_lat() {
    qperf("rc_lat", &["latency  ="]);
}

#[test]
fn qperf_rc_rdma_read_bw() {
    qperf("rc_rdma_read_bw", &["bw  ="]);
}

#[test]
fn qperf_rc_rdma_read_lat() {
    qperf("rc_rdma_read_lat", &["latency  ="]);
}

#[test]
fn qperf_rc_rdma_write_bw() {
    qperf("rc_rdma_write_bw", &["bw  ="]);
}

#[test]
fn qperf_rc_rdma_write_lat() {
    qperf("rc_rdma_write_lat", &["latency  ="]);
}

#[test]
fn qperf_rc_rdma_write_poll_lat() {
    qperf("rc_rdma_write_poll_lat", &["latency  ="]);
}

#[test]
fn qperf_rc_compare_swap_mr() {
    qperf("rc_compare_swap_mr", &["msg_rate  ="]);
}

#[test]
fn qperf_rc_fetch_add_mr() {
    qperf("rc_fetch_add_mr", &["msg_rate  ="]);
}

#[test]
fn qperf_ud_bw() {
    qperf("ud_bw", &["send_bw  =", "recv_bw  ="]);
}

#[test]
fn qperf_ud_lat() {
    qperf("ud_lat", &["latency  ="]);
}

/// Programs asking for what vRDMA lacks get a clean error, not a crash:
/// UC QPs (refused by the daemon) and XRC domains (a NULL operation in
/// `verbs_context`).
#[test]
fn unsupported_features_fail_cleanly() {
    let Some(s) = setup() else { return };
    for (program, says) in
        [("/usr/bin/ibv_uc_pingpong", "Couldn't create QP"), ("/usr/bin/ibv_xsrq_pingpong", "XRC Domain")]
    {
        let port = free_port().to_string();
        let f = run(s, program, &["-p", &port]);
        assert_eq!(f.status.code(), Some(1), "{}", f.describe());
        assert!(f.stderr.contains(says), "{}", f.describe());
    }
}

/// Exactly the planned symbols, each under its version node.
#[test]
fn exports_carry_rdma_core_versions() {
    let Some(_) = setup() else { return };
    let Some(text) = dynamic_symbols("--defined-only", &shim().to_string_lossy()) else { return };
    let mut got: Vec<String> =
        text.lines().filter_map(|l| l.split_whitespace().nth(2)).map(String::from).collect();
    got.sort();
    let mut want: Vec<String> = EXPECTED.iter().map(|(n, v)| format!("{n}@@{v}")).collect();
    want.sort();
    assert_eq!(got, want);
    let soname = Command::new("readelf").arg("-d").arg(shim()).output();
    if let Ok(o) = soname {
        assert!(String::from_utf8_lossy(&o.stdout).contains("Library soname: [libibverbs.so.1]"));
    }
}

const EXPECTED: &[(&str, &str)] = &[
    ("ibv_create_comp_channel", "IBVERBS_1.0"),
    ("ibv_destroy_comp_channel", "IBVERBS_1.0"),
    ("ibv_get_sysfs_path", "IBVERBS_1.0"),
    ("ibv_read_sysfs_file", "IBVERBS_1.0"),
    ("ibv_rate_to_mult", "IBVERBS_1.0"),
    ("mult_to_ibv_rate", "IBVERBS_1.0"),
    ("ibv_get_device_list", "IBVERBS_1.1"),
    ("ibv_free_device_list", "IBVERBS_1.1"),
    ("ibv_get_device_name", "IBVERBS_1.1"),
    ("ibv_get_device_guid", "IBVERBS_1.1"),
    ("ibv_open_device", "IBVERBS_1.1"),
    ("ibv_close_device", "IBVERBS_1.1"),
    ("ibv_get_async_event", "IBVERBS_1.1"),
    ("ibv_ack_async_event", "IBVERBS_1.1"),
    ("ibv_query_device", "IBVERBS_1.1"),
    ("ibv_query_port", "IBVERBS_1.1"),
    ("ibv_query_gid", "IBVERBS_1.1"),
    ("ibv_query_pkey", "IBVERBS_1.1"),
    ("ibv_alloc_pd", "IBVERBS_1.1"),
    ("ibv_dealloc_pd", "IBVERBS_1.1"),
    ("ibv_reg_mr", "IBVERBS_1.1"),
    ("ibv_dereg_mr", "IBVERBS_1.1"),
    ("ibv_create_cq", "IBVERBS_1.1"),
    ("ibv_resize_cq", "IBVERBS_1.1"),
    ("ibv_destroy_cq", "IBVERBS_1.1"),
    ("ibv_get_cq_event", "IBVERBS_1.1"),
    ("ibv_ack_cq_events", "IBVERBS_1.1"),
    ("ibv_create_srq", "IBVERBS_1.1"),
    ("ibv_modify_srq", "IBVERBS_1.1"),
    ("ibv_query_srq", "IBVERBS_1.1"),
    ("ibv_destroy_srq", "IBVERBS_1.1"),
    ("ibv_create_qp", "IBVERBS_1.1"),
    ("ibv_query_qp", "IBVERBS_1.1"),
    ("ibv_modify_qp", "IBVERBS_1.1"),
    ("ibv_destroy_qp", "IBVERBS_1.1"),
    ("ibv_fork_init", "IBVERBS_1.1"),
    ("ibv_dontfork_range", "IBVERBS_1.1"),
    ("ibv_dofork_range", "IBVERBS_1.1"),
    ("ibv_node_type_str", "IBVERBS_1.1"),
    ("ibv_port_state_str", "IBVERBS_1.1"),
    ("ibv_event_type_str", "IBVERBS_1.1"),
    ("ibv_wc_status_str", "IBVERBS_1.1"),
    ("ibv_rate_to_mbps", "IBVERBS_1.1"),
    ("mbps_to_ibv_rate", "IBVERBS_1.1"),
    ("ibv_get_pkey_index", "IBVERBS_1.5"),
    ("ibv_qp_to_qp_ex", "IBVERBS_1.6"),
    ("ibv_reg_mr_iova", "IBVERBS_1.7"),
    ("ibv_reg_mr_iova2", "IBVERBS_1.8"),
    ("ibv_get_device_index", "IBVERBS_1.9"),
    ("ibv_query_ece", "IBVERBS_1.10"),
    ("ibv_set_ece", "IBVERBS_1.10"),
    ("_ibv_query_gid_ex", "IBVERBS_1.11"),
    ("_ibv_query_gid_table", "IBVERBS_1.11"),
    ("ibv_reg_dmabuf_mr", "IBVERBS_1.12"),
    ("ibv_is_fork_initialized", "IBVERBS_1.13"),
    ("ibv_query_qp_data_in_order", "IBVERBS_1.14"),
    ("ibv_query_gid_type", "IBVERBS_PRIVATE_34"),
    ("vrdma_create_qp_cm_id", "VRDMA_PRIVATE_1"),
    ("ibv_copy_qp_attr_from_kern", "IBVERBS_1.0"),
    ("ibv_copy_path_rec_from_kern", "IBVERBS_1.0"),
    ("ibv_copy_path_rec_to_kern", "IBVERBS_1.0"),
    ("ibv_copy_ah_attr_from_kern", "IBVERBS_1.1"),
    ("ibv_attach_mcast", "IBVERBS_1.1"),
    ("ibv_detach_mcast", "IBVERBS_1.1"),
    ("ibv_create_ah", "IBVERBS_1.1"),
    ("ibv_create_ah_from_wc", "IBVERBS_1.1"),
    ("ibv_init_ah_from_wc", "IBVERBS_1.1"),
    ("ibv_destroy_ah", "IBVERBS_1.1"),
    ("ibv_rereg_mr", "IBVERBS_1.1"),
    ("ibv_resolve_eth_l2_from_gid", "IBVERBS_1.1"),
    ("ibv_import_device", "IBVERBS_1.10"),
    ("ibv_import_pd", "IBVERBS_1.10"),
    ("ibv_import_mr", "IBVERBS_1.10"),
    ("ibv_unimport_pd", "IBVERBS_1.10"),
    ("ibv_unimport_mr", "IBVERBS_1.10"),
    ("ibv_import_dm", "IBVERBS_1.13"),
    ("ibv_unimport_dm", "IBVERBS_1.13"),
];

/// `nm -D <which> --with-symbol-versions` of `file`; `None`, saying so,
/// without binutils.
fn dynamic_symbols(which: &str, file: &str) -> Option<String> {
    match Command::new("nm").args(["-D", which, "--with-symbol-versions"]).arg(file).output() {
        Ok(o) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        _ => {
            eprintln!("skipping: nm (binutils) is not available");
            None
        }
    }
}

/// Every public function of the installed rdma-core libibverbs.so.1 (its
/// default version of each, private provider symbols aside) is exported
/// under the same version, so that no program linked against rdma-core
/// fails to load for a missing symbol.
#[test]
fn every_public_rdma_core_export_is_there() {
    let Some(_) = setup() else { return };
    let real = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1";
    if !Path::new(real).exists() {
        vrdma_it::skip(format!("rdma-core's {real} is not installed"));
        return;
    }
    let Some(text) = dynamic_symbols("--defined-only", real) else { return };
    let public: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (kind, sym) = (f.nth(1)?, f.next()?);
            (kind == "T").then_some(sym)?.split_once("@@")
        })
        .filter(|(_, v)| v.starts_with("IBVERBS_1."))
        .collect();
    assert!(public.len() > 50, "{} public functions found in {real}?", public.len());
    for (name, version) in public {
        assert!(
            EXPECTED.iter().any(|&(n, v)| n == name && v == version),
            "rdma-core exports {name}@@{version}; the library does not"
        );
    }
}

/// Every symbol the tested binaries import resolves to an export of the
/// same version (what `LD_BIND_NOW=1` also proves by loading them), and
/// so does every libibverbs import of Debian's librdmacm, which qperf
/// (and perftest) load.
#[test]
fn tested_binaries_find_every_import() {
    let Some(_) = setup() else { return };
    for bin in [
        "/usr/bin/ibv_devices",
        "/usr/bin/ibv_devinfo",
        "/usr/bin/ibv_rc_pingpong",
        "/usr/bin/ibv_srq_pingpong",
        "/usr/bin/ibv_ud_pingpong",
        QPERF,
        "/usr/lib/x86_64-linux-gnu/librdmacm.so.1",
    ] {
        if !Path::new(bin).exists() {
            eprintln!("skipping {bin}: not installed");
            continue;
        }
        let Some(text) = dynamic_symbols("--undefined-only", bin) else { return };
        for sym in text.lines().filter_map(|l| l.split_whitespace().last()).filter(|s| s.contains("@IBVERBS"))
        {
            let (name, version) = sym.split_once('@').expect("versioned");
            assert!(
                EXPECTED.iter().any(|&(n, v)| n == name && v == version),
                "{bin} imports {sym}, which the library does not export"
            );
        }
    }
}

/// Our own C verbs program (`tests/c/verbs_check.c`): error paths and
/// errno values, `bad_wr`, inline data, RDMA read, atomics, non-blocking
/// events, `EBUSY`. Needs a C compiler and rdma-core's headers
/// (`libibverbs-dev`); skips, saying so, without them. It is linked
/// against this library itself, so it also checks that a program built
/// against the shim binds the same symbol versions.
#[test]
fn c_program_checks_error_paths() {
    c_program("verbs_check");
}

/// `tests/c/qp_ex_check.c`: `ibv_create_qp_ex`, `ibv_qp_to_qp_ex` and the
/// `ibv_wr_*` builders (send, RDMA write and read, atomics, inline data,
/// abort, errors kept until `ibv_wr_complete`) on a loopback RC pair.
#[test]
fn c_program_checks_qp_ex() {
    c_program("qp_ex_check");
}

/// `tests/c/restart_check.c`: the daemon is restarted under a program
/// that holds a context with objects and two threads waiting, one in
/// `ibv_get_async_event`, one in `ibv_get_cq_event`. The first wakes with
/// `IBV_EVENT_DEVICE_FATAL` (and `async_fd` turns readable), later calls
/// fail with `EIO`, the second returns an error, the old context's verbs
/// fail and its destroys succeed; then, in the same process, a fresh
/// device list opens the new daemon's device, which works.
#[test]
fn c_program_sees_device_fatal_and_reopens_after_a_daemon_restart() {
    let Some((s, exe)) = build_c_program("restart_check") else { return };
    let dir = tempfile::tempdir_in(s.dir.path()).expect("dir");
    let sock = dir.path().join("restart.sock");
    let config = || vrdmad::DaemonConfig { socket: Some(sock.clone()), ..Default::default() };
    let daemon = vrdmad::Daemon::start(config()).expect("start daemon");
    let marker = dir.path().join("restart_check.waiting");
    let mut c = s.command(exe.to_str().expect("utf-8 path"));
    c.env("VRDMA_SOCKET", &sock).env_remove("VRDMA_VERBS_DEBUG").arg(&marker);
    let mut run = spawn(c, "restart_check");
    let end = Instant::now() + LIMIT;
    while !marker.exists() && !run.exited() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(daemon);
    let back = vrdmad::Daemon::start(config()).expect("the daemon back on its socket");
    let f = run.finish(LIMIT);
    drop(back);
    f.assert_ok();
    assert!(f.stdout.contains("restart_check: OK"), "{}", f.describe());
}

/// Compiles `tests/c/<name>.c` against rdma-core's headers, links it
/// against this library and runs it; it must exit 0 and print
/// `<name>: OK`. Skips, saying so, without a C compiler or the headers.
fn c_program(name: &str) {
    let Some((s, exe)) = build_c_program(name) else { return };
    let f = run(s, exe.to_str().expect("utf-8 path"), &[]);
    f.assert_ok();
    assert!(f.stdout.contains(&format!("{name}: OK")), "{}", f.describe());
}

/// `tests/c/semantics_check.c`: every opcode's data through plain
/// `ibv_post_send` with multi-SGE gather/scatter and inline data, error
/// statuses and the flush after them, `ENOMEM` on a full send queue,
/// completion events under epoll and async events under poll. Then a
/// holder process allocating device objects is SIGKILLed (by pid) and a
/// fresh process must still get a working device and the same objects.
#[test]
fn c_program_checks_semantics() {
    c_program("semantics_check");
    let Some((s, exe)) = build_c_program("semantics_check") else { return };
    let exe = exe.to_str().expect("utf-8 path");
    let ready = s.dir.path().join("semantics_check.ready");
    let _ = std::fs::remove_file(&ready);
    let mut holder = s.command(exe);
    holder.arg("hold").arg(&ready);
    let mut holder = spawn(holder, "semantics_check hold");
    let end = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(!holder.exited(), "{}", holder.finish(LIMIT).describe());
        assert!(Instant::now() < end, "the holder never got ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(holder.pid(), libc::SIGKILL) };
    let f = holder.finish(LIMIT);
    assert!(!f.status.success() && f.stdout.contains("ready"), "{}", f.describe());
    let f = run(s, exe, &["after"]);
    f.assert_ok();
    assert!(f.stdout.contains("semantics_check: OK"), "{}", f.describe());
}

/// `tests/c/killed_peer_check.c`: two processes connect an RC QP each to
/// the other's; the victim is SIGKILLed (by pid) while it holds its QP.
/// The survivor must get `IBV_EVENT_QP_FATAL` on its async fd, see its QP
/// in `IBV_QPS_ERR` through `ibv_query_qp`, and have its outstanding
/// receives and every WR posted afterwards complete with
/// `IBV_WC_WR_FLUSH_ERR`.
#[test]
fn c_program_checks_a_killed_peer() {
    let Some((s, exe)) = build_c_program("killed_peer_check") else { return };
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir_in(s.dir.path()).expect("exchange dir");
    let role = |r: &str| {
        let mut c = s.command(exe.to_str().expect("utf-8 path"));
        c.arg(r).arg(dir.path());
        spawn(c, &format!("killed_peer_check {r}"))
    };
    let mut survivor = role("survivor");
    let mut victim = role("victim");
    let end = Instant::now() + Duration::from_secs(60);
    for ready in ["victim.ready", "survivor.ready"] {
        while !dir.path().join(ready).exists() {
            if victim.exited() {
                panic!("the victim exited early\n{}", victim.finish(LIMIT).describe());
            }
            if survivor.exited() {
                panic!("the survivor exited early\n{}", survivor.finish(LIMIT).describe());
            }
            assert!(Instant::now() < end, "{ready} never appeared");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(victim.pid(), libc::SIGKILL) };
    let v = victim.finish(LIMIT);
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(v.status.signal(), Some(libc::SIGKILL), "{}", v.describe());
    }
    let f = survivor.finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("killed_peer_check: OK"), "{}", f.describe());
}

/// Compiles `tests/c/<name>.c` against rdma-core's
/// headers and links it against this library: the shared setup and the
/// executable, or `None` (with the reason printed) without a C compiler
/// or the headers.
fn build_c_program(name: &str) -> Option<(&'static Setup, PathBuf)> {
    let s = setup()?;
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        vrdma_it::skip("/usr/include/infiniband/verbs.h is missing (apt-get install libibverbs-dev)");
        return None;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = s.dir.path().join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wno-format-zero-length", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(s.lib_dir())
        .arg("-l:libibverbs.so.1")
        .output();
    match built {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!("{cc} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            vrdma_it::skip(format!("no C compiler ({cc}: {e})"));
            return None;
        }
    }
    Some((s, exe))
}

/// `vrdma run` from the workspace's CLI, when cargo built it (it does for
/// `cargo test --workspace`; alone, this package's tests do not build it)
/// and it is recent enough to have the subcommand.
fn vrdma_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent()?;
    let bin = if deps.ends_with("deps") { deps.parent()? } else { deps }.join("vrdma");
    let has_run = Command::new(&bin)
        .args(["run", "--help"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_run {
        Some(bin)
    } else {
        eprintln!("skipping: {} with `vrdma run` is not built (cargo build -p vrdma-cli)", bin.display());
        None
    }
}

#[test]
fn vrdma_run_with_the_running_daemon() {
    let Some(s) = setup() else { return };
    let Some(vrdma) = vrdma_bin() else { return };
    let mut c = Command::new(&vrdma);
    c.env_remove("LD_LIBRARY_PATH")
        .env("VRDMA_VERBS_LIB", shim())
        .env("VRDMA_SOCKET", s.socket())
        .args(["run", "--", DEVINFO, "-v"]);
    let f = spawn(c, "vrdma run -- ibv_devinfo -v").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("hca_id:\tvrdma0") && f.stdout.contains("GID[  0]"), "{}", f.describe());

    let mut c = Command::new(&vrdma);
    c.env("VRDMA_VERBS_LIB", shim())
        .env("VRDMA_SOCKET", s.socket())
        .args(["run", "--", "sh", "-c", "exit 7"]);
    let f = spawn(c, "vrdma run -- sh -c 'exit 7'").finish(LIMIT);
    assert_eq!(f.status.code(), Some(7), "{}", f.describe());

    let mut c = Command::new(&vrdma);
    c.env("VRDMA_VERBS_LIB", shim()).env("VRDMA_SOCKET", s.socket()).args([
        "run",
        "--",
        "/nonexistent/program",
    ]);
    let f = spawn(c, "vrdma run -- /nonexistent/program").finish(LIMIT);
    assert_eq!(f.status.code(), Some(127), "{}", f.describe());
}

#[test]
fn vrdma_run_starts_a_daemon_when_none_answers() {
    let Some(s) = setup() else { return };
    let Some(vrdma) = vrdma_bin() else { return };
    let mut c = Command::new(&vrdma);
    c.env("VRDMA_VERBS_LIB", shim()).env("VRDMA_SOCKET", s.dir.path().join("nobody-here.sock")).args([
        "run",
        "--",
        "/usr/bin/ibv_devices",
    ]);
    let f = spawn(c, "vrdma run -- ibv_devices (embedded daemon)").finish(LIMIT);
    f.assert_ok();
    assert!(f.stdout.contains("vrdma0"), "{}", f.describe());
}
