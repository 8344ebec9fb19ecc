//! `vrdma bench-hosts --quick --json` as CI runs it: two network
//! namespaces on a veth pair, a daemon in each, perftest through the
//! drop-in library beside iperf3, qperf and a busy-polling TCP ping-pong,
//! rdma_cm connection setup beside TCP connect + accept on the same pair,
//! rdma-core's `cmtime` through the drop-in librdmacm beside TCP in its
//! phases; and nothing left behind.
//!
//! Skips, saying why, when not root or when a tool or the drop-in library
//! is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");

fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join(program).is_file())
}

/// The libraries bench-hosts runs programs with, and the variables that
/// name them.
const LIBS: [(&str, &str); 4] = [
    ("libvrdma_verbs.so", "VRDMA_VERBS_LIB"),
    ("libvrdma_companions.so", "VRDMA_COMPANIONS_LIB"),
    ("libvrdma_sockets.so", "VRDMA_SOCKETS_LIB"),
    ("libvrdma_rdmacm.so", "VRDMA_RDMACM_LIB"),
];

/// Why the test cannot run here, if it cannot: not root, or one of the
/// `tools` (program, package) or [`LIBS`] missing.
fn skip_reason(tools: &[(&str, &str)]) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (network namespaces need it)".into());
    }
    for (program, package) in tools {
        if !on_path(program) {
            return Some(format!("{program} is missing (apt-get install {package})"));
        }
    }
    for (lib, _) in LIBS {
        if built(lib).is_none() {
            return Some(format!(
                "{lib} is not built next to {VRDMA} or the tests \
                 (cargo build -p vrdma-verbs -p vrdma-rdmacm -p vrdma-companions -p vrdma-sockets)"
            ));
        }
    }
    None
}

/// Every tool of the default figures.
const ALL_TOOLS: [(&str, &str); 6] = [
    ("ip", "iproute2"),
    ("iperf3", "iperf3"),
    ("qperf", "qperf"),
    ("ib_write_bw", "perftest"),
    ("ib_write_lat", "perftest"),
    ("cmtime", "rdmacm-utils"),
];

/// The namespaces' name prefix bench-hosts uses (it honours
/// `VRDMA_HOSTBENCH_NS`, which its child inherits from the test).
fn ns_prefix() -> String {
    std::env::var("VRDMA_HOSTBENCH_NS").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "vrdma-hb".into())
}

/// Runs `vrdma bench-hosts ARGS` to its end (bounded), the built
/// libraries named; its pid and output. Fails the test if it fails.
fn bench_hosts(args: &[&str]) -> (u32, String) {
    let mut cmd = Command::new(VRDMA);
    cmd.arg("bench-hosts").args(args);
    for (lib, var) in LIBS {
        cmd.env(var, built(lib).expect("checked by skip_reason"));
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vrdma bench-hosts");
    let pid = child.id();
    // Bounded: --quick takes well under a minute; allow a slow debug build.
    let end = Instant::now() + Duration::from_secs(300);
    while child.try_wait().expect("try_wait").is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("vrdma bench-hosts {args:?} did not finish in 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-hosts failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
    (pid, stdout)
}

/// Nothing of run `pid` left: namespaces, processes, its directory.
fn assert_nothing_left(pid: u32) {
    let ns = namespaces();
    assert!(!ns.contains(&format!("{}{pid}-", ns_prefix())), "namespaces left behind:\n{ns}");
    let left = leftovers(pid);
    assert!(left.is_empty(), "processes left behind: {left:#?}");
    assert!(
        !std::env::temp_dir().join(format!("vrdma-hostbench-{pid}")).exists(),
        "work directory left behind"
    );
}

/// Where `cargo build` put library `name`: next to the `vrdma` binary, or
/// (`cargo test` on a fresh tree) among the test binaries' dependencies.
fn built(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().expect("current exe");
    let dirs: Vec<std::path::PathBuf> =
        [Path::new(VRDMA).parent(), exe.parent()].into_iter().flatten().map(Path::to_path_buf).collect();
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

fn namespaces() -> String {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Processes whose environment carries the run's marker (every process
/// bench-hosts starts does) or whose command line names its directory.
fn leftovers(pid: u32) -> Vec<String> {
    let marker = format!("VRDMA_HOSTBENCH={pid}");
    let dir = format!("vrdma-hostbench-{pid}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()).is_none() {
            continue;
        }
        let p: PathBuf = e.path();
        let env = std::fs::read(p.join("environ")).unwrap_or_default();
        let cmdline =
            String::from_utf8_lossy(&std::fs::read(p.join("cmdline")).unwrap_or_default()).replace('\0', " ");
        if env.split(|&b| b == 0).any(|v| v == marker.as_bytes()) || cmdline.contains(&dir) {
            found.push(format!("{}: {cmdline}", e.file_name().to_string_lossy()));
        }
    }
    found
}

#[test]
fn bench_hosts_quick_reports_each_figure_beside_its_anchor_and_leaves_nothing_behind() {
    if let Some(why) = skip_reason(&ALL_TOOLS) {
        vrdma_it::skip(format!("bench-hosts: {why}"));
        return;
    }
    let (pid, stdout) = bench_hosts(&["--quick", "--json"]);

    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // The machine line names the CPUs (and how idle ones wait, where sysfs says).
    assert!(v["machine"].as_str().is_some_and(|m| m.contains(" CPUs")), "{stdout}");
    let figures = v["figures"].as_array().expect("figures");
    let keys: Vec<&str> = figures.iter().map(|f| f["key"].as_str().expect("key")).collect();
    assert_eq!(
        keys,
        [
            "write_bw_1qp",
            "write_bw_4qp",
            "write_lat_8b",
            "write_lat_8b_spin",
            "cm_setup_first",
            "cm_setup_each",
            "cmtime_c1",
            "cmtime_cn",
            "cmtime_connect",
            "sockets_stream",
            "sockets_lat_8b"
        ],
        "{stdout}"
    );
    // The vRDMA figures beside their anchors (iperf3 with 1 and 4
    // streams, qperf tcp_lat, and for reference a busy-polling TCP
    // ping-pong): every value and ratio positive; the three with a target
    // say whether it was met, the reference does not.
    for f in figures {
        for k in ["vrdma", "anchor", "ratio"] {
            let x = f[k].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{} {k} = {x}\n{stdout}", f["key"]);
        }
        // Bandwidth figures say what they cost in CPU per GB, latency ones do not.
        let bandwidth = f["unit"] == "Gbit/s";
        for k in ["vrdma_cpu_ms_per_gb", "anchor_cpu_ms_per_gb"] {
            match f[k].as_f64() {
                Some(x) => assert!(bandwidth && x.is_finite() && x > 0.0, "{} {k} = {x}\n{stdout}", f["key"]),
                None => assert!(!bandwidth && f[k].is_null(), "{} {k}\n{stdout}", f["key"]),
            }
        }
        let reference = f["key"] == "write_lat_8b_spin";
        assert_eq!(f["met"].is_boolean(), !reference, "{stdout}");
        assert_eq!(f["runs"].as_array().map(Vec::len), Some(1), "{stdout}");
    }
    // One ib_write_lat per run serves both latency anchors.
    assert_eq!(figures[2]["vrdma"], figures[3]["vrdma"], "{stdout}");
    // rdma_cm connection setup across the hosts, each beside TCP connect +
    // accept on the same pair (measured in the same run), with the ratio
    // and the target (at most 3x); no timing is asserted.
    for f in &figures[4..6] {
        assert_eq!(f["unit"], "us", "{stdout}");
        assert!(
            f["anchor_name"].as_str().is_some_and(|a| a.starts_with("TCP connect + accept, same pair")),
            "{stdout}"
        );
        assert_eq!(f["target"], "<= 3.00x", "{stdout}");
    }
    // cmtime through the drop-in librdmacm across the hosts, beside TCP in
    // its phases (the rows' text is checked by the test below).
    for f in &figures[6..9] {
        assert_eq!(f["unit"], "us", "{stdout}");
        assert_eq!(f["target"], "<= 3.00x", "{stdout}");
    }
    assert_eq!(v["cmtime_conns"], 20, "{stdout}");
    // The sockets preload's figures across the hosts, each beside the
    // same program over plain TCP on the same veth (issue 20's targets);
    // the bench fails rather than report a connection it did not carry.
    assert_eq!(figures[9]["unit"], "Gbit/s", "{stdout}");
    assert_eq!(figures[9]["target"], ">= 2.00x", "{stdout}");
    assert_eq!(figures[10]["unit"], "us", "{stdout}");
    assert_eq!(figures[10]["target"], "<= 0.50x", "{stdout}");

    assert_nothing_left(pid);
}

/// A number and its unit, as the table prints a value ("12.34 µs").
fn micros(cell: &str) -> f64 {
    let n = cell.strip_suffix(" µs").unwrap_or_else(|| panic!("not a value in µs: {cell:?}"));
    n.parse().unwrap_or_else(|e| panic!("{cell:?}: {e}"))
}

/// rdma-core's cmtime between the two hosts through the drop-in librdmacm
/// (server on host 1's daemon, client on host 2's), each row beside TCP
/// in cmtime's phases on the same veth in the same run: the three rows
/// are printed with both figures, the ratio of the two and the target,
/// and nothing is left behind. No timing is asserted.
#[test]
fn bench_hosts_prints_cmtime_rows_beside_tcp_in_its_phases() {
    if let Some(why) = skip_reason(&[("ip", "iproute2"), ("cmtime", "rdmacm-utils")]) {
        vrdma_it::skip(format!("bench-hosts cmtime rows: {why}"));
        return;
    }
    let (pid, stdout) = bench_hosts(&[
        "--only",
        "cmtime_c1",
        "--only",
        "cmtime_cn",
        "--only",
        "cmtime_connect",
        "--quick",
        "--runs",
        "1",
    ]);
    let rows = [
        (
            "cmtime -c 1 (rdma-core, drop-in librdmacm): create id + resolve addr",
            "TCP socket + non-blocking connect",
        ),
        (
            "cmtime -c 20: the same five steps, per connection of 20",
            "TCP: 20 sockets, then 20 non-blocking connects",
        ),
        ("cmtime -c 20: connect step alone", "TCP: 20 non-blocking connects issued together"),
    ];
    for (figure, anchor) in rows {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(figure))
            .unwrap_or_else(|| panic!("no row {figure:?}:\n{stdout}"));
        // Columns are two spaces or more apart: figure, value, anchor,
        // its value, ratio, target, met.
        let cells: Vec<&str> = line.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        let [_, value, anchor_name, anchor_value, ratio, target, met] = cells[..] else {
            panic!("not seven columns: {cells:?}\n{stdout}");
        };
        assert!(anchor_name.starts_with(anchor), "{line}");
        let (v, a) = (micros(value), micros(anchor_value));
        assert!(v > 0.0 && a > 0.0, "{line}");
        let r: f64 = ratio.strip_suffix('x').and_then(|r| r.parse().ok()).unwrap_or_else(|| panic!("{line}"));
        // The ratio is the two figures' (each printed to 0.01).
        assert!((r - v / a).abs() <= 0.01 + 0.01 * r, "{r} against {v} / {a}: {line}");
        assert_eq!(target, "<= 3.00x", "{line}");
        if (r - 3.0).abs() > 0.005 {
            assert_eq!(met, if r < 3.0 { "met" } else { "NOT met" }, "{line}");
        }
    }
    assert_nothing_left(pid);
}
