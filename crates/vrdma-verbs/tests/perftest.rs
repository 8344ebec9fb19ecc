//! Debian's unmodified perftest binaries (`ib_{write,read,send,atomic}_
//! {lat,bw}`), run against a real daemon through this library.
//!
//! The binaries need, besides `libibverbs.so.1`, `libmlx5.so.1` and
//! `libefa.so.1` (linked `BIND_NOW`): the private library directory holds
//! links to this package's cdylib and to the `vrdma-companions` cdylib
//! (a dev-dependency, so cargo builds it first) under those names (and
//! the companions' other two, `libmlx4.so.1` and `libmana.so.1`), as
//! `vrdma run` makes it. `librdmacm.so.1` and `libibumad.so.3` are
//! Debian's own; their imports from libibverbs resolve in this library.
//!
//! Each test runs a server and a client on loopback, on a port of its
//! own (`-p`), with a small iteration count, and passes when both exit 0
//! and print the result table (the `#bytes` header and a numeric row;
//! the server of `ib_read_lat` and `ib_atomic_lat` prints none, as on
//! hardware, since it only serves its memory).
//! perftest takes its generic path on vRDMA (the vendor part id is no
//! Mellanox or EFA one), so it posts with `ibv_post_send` whatever the
//! flags say: the default run and `--use_old_post_send` exercise the same
//! verbs, and `-e` (completion events) is run where perftest allows it
//! (not for RDMA writes).
//!
//! The tests skip, saying so, only when `/usr/bin/ib_write_lat` is missing
//! (`apt-get install perftest`). Every wait is bounded: a process still
//! running at its deadline is killed by pid and the test fails.

// The library exists for x86-64 Linux only (see src/lib.rs).
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod common;

use common::{built, free_port, has_results, listening, one_at_a_time, spawn};
use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const PROBE: &str = "/usr/bin/ib_write_lat";
const LIMIT: Duration = Duration::from_secs(120);

struct Setup {
    dir: tempfile::TempDir,
    _daemon: Mutex<vrdmad::Daemon>,
}

impl Setup {
    /// A command for `program` using the shim, the companions and the daemon.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", self.dir.path().join("lib"))
            .env("VRDMA_SOCKET", self.dir.path().join("vrdma.sock"))
            .env("LD_BIND_NOW", "1")
            .env("VRDMA_VERBS_DEBUG", "1");
        c
    }
}

/// The shared setup, or `None` (with the reason printed) without perftest.
fn setup() -> Option<&'static Setup> {
    if !Path::new(PROBE).exists() {
        vrdma_it::skip(format!("{PROBE} is missing (apt-get install perftest)"));
        return None;
    }
    static SETUP: OnceLock<Setup> = OnceLock::new();
    Some(SETUP.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).expect("lib dir");
        let link = |target: &Path, name: &str| {
            std::os::unix::fs::symlink(target, lib.join(name)).expect("symlink");
        };
        link(&built("libvrdma_verbs.so"), "libibverbs.so.1");
        let companions = built("libvrdma_companions.so");
        for soname in vrdma_companions::SONAMES {
            link(&companions, soname);
        }
        let config =
            vrdmad::DaemonConfig { socket: Some(dir.path().join("vrdma.sock")), ..Default::default() };
        let daemon = vrdmad::Daemon::start(config).expect("start daemon");
        Setup { dir, _daemon: Mutex::new(daemon) }
    }))
}

/// Runs `/usr/bin/<tool>` as server and client on loopback with `args`
/// and a small iteration count; both must exit 0 and print their results.
fn perftest(tool: &str, args: &[&str]) {
    let Some(s) = setup() else { return };
    let _turn = one_at_a_time();
    let program = format!("/usr/bin/{tool}");
    let port = free_port();
    let port_arg = port.to_string();
    // -F: a report is printed even when perftest's clock calibration
    // fails. It busy-loops ~200 ms comparing rdtsc with gettimeofday and,
    // where one sample was preempted (a loaded 2-CPU machine), finds no
    // frequency: without -F the program exits 1 ("Can't produce a
    // report"), the likely cause of one CI failure of ib_send_bw -a.
    let mut common = vec!["-p", port_arg.as_str(), "-d", "vrdma0", "-n", "1000", "-F"];
    common.extend_from_slice(args);
    let mut server_cmd = s.command(&program);
    server_cmd.args(&common);
    let mut server = spawn(server_cmd, &format!("{tool} (server) {}", common.join(" ")));
    let end = Instant::now() + Duration::from_secs(30);
    while !listening(port) {
        if server.exited() || Instant::now() > end {
            panic!("the server never listened\n{}", server.finish(LIMIT).describe());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut client_cmd = s.command(&program);
    client_cmd.args(&common).arg("127.0.0.1");
    let client = spawn(client_cmd, &format!("{tool} (client) {} 127.0.0.1", common.join(" "))).finish(LIMIT);
    let server = server.finish(LIMIT);
    // The passive side of the read and atomic latency tests only serves
    // its memory and prints no results; every other side prints them.
    let server_reports = !matches!(tool, "ib_read_lat" | "ib_atomic_lat");
    for (f, reports) in [(&client, true), (&server, server_reports)] {
        // Both sides' output: one side's failure often shows on the other.
        assert!(
            f.status.success(),
            "{}\n{}",
            f.describe(),
            [&client, &server].map(|f| f.describe()).join("\n")
        );
        assert!(!reports || has_results(&f.stdout), "no result table\n{}", f.describe());
        let all = format!("{}{}", f.stdout, f.stderr);
        for bad in ["Couldn't", "Failed", "failed", "error", "vrdma-verbs:"] {
            assert!(!all.contains(bad), "{bad:?} in the output\n{}", f.describe());
        }
    }
}

#[test]
fn result_table_is_recognised() {
    let table = " #bytes #iterations    t_min[usec]\n 2       1000          18.34\n";
    assert!(has_results(table));
    assert!(!has_results(" #bytes #iterations\n------\n"));
    assert!(!has_results("nothing here\n"));
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
    write_lat: "ib_write_lat" [];
    write_lat_old_post_send: "ib_write_lat" ["--use_old_post_send"];
    write_bw: "ib_write_bw" [];
    write_bw_old_post_send: "ib_write_bw" ["--use_old_post_send"];
    read_lat: "ib_read_lat" [];
    read_lat_old_post_send: "ib_read_lat" ["--use_old_post_send"];
    read_lat_events: "ib_read_lat" ["-e"];
    read_bw: "ib_read_bw" [];
    read_bw_old_post_send: "ib_read_bw" ["--use_old_post_send"];
    read_bw_events: "ib_read_bw" ["-e"];
    send_lat: "ib_send_lat" [];
    send_lat_old_post_send: "ib_send_lat" ["--use_old_post_send"];
    send_lat_events: "ib_send_lat" ["-e"];
    send_bw: "ib_send_bw" [];
    send_bw_old_post_send: "ib_send_bw" ["--use_old_post_send"];
    send_bw_events: "ib_send_bw" ["-e"];
    atomic_lat: "ib_atomic_lat" [];
    atomic_lat_old_post_send: "ib_atomic_lat" ["--use_old_post_send"];
    atomic_lat_events: "ib_atomic_lat" ["-e"];
    atomic_bw: "ib_atomic_bw" [];
    atomic_bw_old_post_send: "ib_atomic_bw" ["--use_old_post_send"];
    atomic_bw_events: "ib_atomic_bw" ["-e"];
    // Every size from 2 bytes to 8 MiB (`-a`; the atomic tools have no
    // sweep), with fewer iterations so that the large sizes stay quick.
    write_lat_all_sizes: "ib_write_lat" ["-a", "-n", "100"];
    write_bw_all_sizes: "ib_write_bw" ["-a", "-n", "100"];
    read_lat_all_sizes: "ib_read_lat" ["-a", "-n", "100"];
    read_bw_all_sizes: "ib_read_bw" ["-a", "-n", "100"];
    send_lat_all_sizes: "ib_send_lat" ["-a", "-n", "100"];
    send_bw_all_sizes: "ib_send_bw" ["-a", "-n", "100"];
    // Several QPs at once (`-q`; only the bandwidth tools take it).
    write_bw_four_qps: "ib_write_bw" ["-q", "4"];
    read_bw_four_qps: "ib_read_bw" ["-q", "4"];
    send_bw_four_qps: "ib_send_bw" ["-q", "4"];
    atomic_bw_four_qps: "ib_atomic_bw" ["-q", "4"];
}
