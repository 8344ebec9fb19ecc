//! `vrdma study` as a user runs it: the quick study's report and its
//! files, the vm placement between real QEMU guests, argument errors, and
//! an interrupted study that leaves nothing behind (no namespace, no
//! process).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{Proc, VRDMA};

/// The studies of this file run one at a time (two cores).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Namespaces of the study run by process `pid`.
fn namespaces_of(pid: u32) -> Vec<String> {
    let prefix = format!("vrdma-study-{pid}-");
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose environment names the study run `run_id`.
fn processes_of(run_id: &str) -> Vec<String> {
    let want = format!("VRDMA_STUDY_RUN={run_id}");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if env.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            found.push(format!("{name}: {}", String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    found
}

/// Processes whose environment carries any VRDMA_STUDY_RUN starting with `pid-`.
fn processes_of_pid(pid: u32) -> Vec<String> {
    let want = format!("VRDMA_STUDY_RUN={pid}-");
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if env.split(|b| *b == 0).any(|v| v.starts_with(want.as_bytes())) {
            found.push(e.file_name().to_string_lossy().to_string());
        }
    }
    found
}

fn check_svg(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc =
        roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{}: not XML: {e}", path.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg", "{}", path.display());
    assert!(doc.descendants().count() > 20, "{}: almost empty", path.display());
}

fn check_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(&[0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a]),
        "{}: not a PNG",
        path.display()
    );
    assert!(bytes.len() > 10_000, "{}: only {} bytes", path.display(), bytes.len());
}

#[test]
fn quick_study_writes_the_report() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let started = Instant::now();
    // The host placements (the VMs' have a test of their own, below).
    let p = Proc(
        Command::new(VRDMA)
            .args(["study", "--quick", "--placements", "process,container,hosts", "--out"])
            .arg(&out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = p.pid();
    let (status, _, _) = p.finish(Duration::from_secs(300));
    assert!(status.success(), "vrdma study --quick: {status}");
    eprintln!("vrdma study --quick took {:?}", started.elapsed());

    for f in ["report.md", "report.html", "data.csv", "data.json"] {
        assert!(out.join(f).is_file(), "{f} is missing");
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    for t in ["Table 1. Transfer bandwidth", "Table 2. Latency", "Table 3. Bandwidth set"] {
        assert!(md.contains(t) && html.contains(t), "{t} is missing");
    }
    assert!(md.contains("| run 1 | run 2 | avg | min | max |"), "{md}");
    assert!(md.contains("| process-process (1 host) | vRDMA | 1 | rc_rdma_write_bw |"), "{md}");
    assert!(md.contains("| process-process (1 host) | TCP | 1 | tcp_bw |"), "{md}");
    assert!(md.contains("rc_lat") && md.contains("tcp_lat"), "{md}");
    assert!(
        html.contains("<table>") && html.matches("<svg").count() >= 2,
        "the HTML lacks tables or inline SVGs"
    );

    let mut charts = vec!["bandwidth", "latency"];
    if is_root() {
        charts.push("fairness");
        assert!(md.contains("Table 4. Four tenants at once"), "{md}");
        assert!(md.contains("Table 5. Latency beside a hog"), "{md}");
        assert!(md.contains("Table 6. Latency beside a hog, across hosts"), "{md}");
        assert!(md.contains("beside a 64-QP hog, latency_class \"latency\""), "{md}");
        for p in ["container-container", "host-host"] {
            assert!(md.contains(&format!("| {p}")), "placement {p} is missing: {md}");
        }
    } else {
        assert!(
            md.contains("need root") || md.contains("needs root"),
            "the report does not say what it skipped: {md}"
        );
    }
    for c in &charts {
        check_svg(&out.join("charts").join(format!("{c}.svg")));
        check_png(&out.join("charts").join(format!("{c}.png")));
    }

    let csv = std::fs::read_to_string(out.join("data.csv")).unwrap();
    let mut lines = csv.lines();
    let header = lines.next().unwrap();
    assert!(header.starts_with("section,placement,protocol,tenants,tenant,tool,test,size,run,value,unit"));
    let width = header.split(',').count();
    let rows: Vec<&str> = lines.collect();
    assert!(rows.len() > 10, "{csv}");
    assert!(rows.iter().all(|r| r.split(',').count() == width), "{csv}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("data.json")).unwrap()).unwrap();
    assert!(json["failures"].as_array().unwrap().is_empty(), "failures: {}", json["failures"]);
    assert!(json["records"].as_array().unwrap().len() == rows.len());
    let fairness = json["summary"]["fairness"].as_array().unwrap();
    if is_root() {
        assert!(!fairness.is_empty());
    }
    for f in fairness {
        for j in f["jain_runs"].as_array().unwrap() {
            let j = j.as_f64().expect("every run has its index");
            assert!((0.25..=1.0).contains(&j), "Jain's index {j} out of [0.25, 1]");
        }
    }

    let run_id = json["run_id"].as_str().unwrap();
    assert!(namespaces_of(pid).is_empty(), "namespaces left: {:?}", namespaces_of(pid));
    assert!(processes_of(run_id).is_empty(), "processes left: {:?}", processes_of(run_id));
    assert!(!Path::new(&format!("/tmp/vrdma-study-{pid}")).exists(), "the work directory was left");
}

/// The vm placement, quick: VM pairs booted once (under TCG here), every
/// transfer cell's bytes moved in full, the set's rows, the accelerator
/// named and TCG's figures marked, the data check passed, nothing left.
#[test]
fn vm_placement_between_real_guests() {
    if !is_root() {
        vrdma_it::skip("the vm placement needs root (its VMs are tenants of other uids)");
        return;
    }
    if vrdma_guest::libs::which(vrdma_guest::guest::QEMU).is_none() {
        vrdma_it::skip(
            "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86 busybox-static)",
        );
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let started = Instant::now();
    // The drop-in libraries of this build (those beside `vrdma` are only
    // as fresh as the last `cargo build`), as the guest tests name them.
    let p = Proc(
        Command::new(VRDMA)
            .args(["study", "--quick", "--runs", "1", "--no-anchors", "--placements", "vm", "--out"])
            .arg(&out)
            .env("VRDMA_VERBS_LIB", vrdma_it::harness::built("libvrdma_verbs.so"))
            .env("VRDMA_RDMACM_LIB", vrdma_it::harness::built("libvrdma_rdmacm.so"))
            .env("VRDMA_COMPANIONS_LIB", vrdma_it::harness::built("libvrdma_companions.so"))
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = p.pid();
    let (status, _, _) = p.finish(Duration::from_secs(600));
    assert!(status.success(), "vrdma study --placements vm: {status}");
    eprintln!("vrdma study --quick --runs 1 --placements vm took {:?}", started.elapsed());

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("data.json")).unwrap()).unwrap();
    assert!(json["failures"].as_array().unwrap().is_empty(), "failures: {}", json["failures"]);
    let site = json["placements"][0]["description"].as_str().unwrap().to_string();
    assert_eq!(json["placements"][0]["placement"], "vm", "{site}");
    assert!(site.contains("accelerator kvm") || site.contains("accelerator tcg"), "{site}");
    assert!(site.contains("`ibv_rc_pingpong -c` (data validated) passed between every pair"), "{site}");
    if site.contains("accelerator tcg") {
        assert!(
            md.contains("| VM-VM (1 host, QEMU) under TCG: functional, not comparable with the host's |"),
            "{md}"
        );
    }
    let plan_bytes = json["plan"]["bytes"].as_u64().unwrap();
    let pairs = json["plan"]["vm_pairs"].as_u64().unwrap();
    let records = json["records"].as_array().unwrap();
    let of = |section: &'static str| {
        records.iter().filter(move |r| r["section"] == section && r["placement"] == "vm")
    };
    // Every cell: vRDMA and TCP, one tenant and all pairs at once, its
    // tenants' bytes adding up to the plan's (32 MiB in 64 KiB messages
    // divides evenly), at a positive, finite rate.
    for proto in ["vrdma", "tcp"] {
        for n in [1, pairs] {
            let cell: Vec<_> =
                of("transfer").filter(|r| r["protocol"] == proto && r["tenants"] == n).collect();
            assert_eq!(cell.len(), 1, "{proto} x{n}: {cell:?}");
            let (bytes, gbs) = (cell[0]["bytes"].as_u64().unwrap(), cell[0]["value"].as_f64().unwrap());
            assert_eq!(bytes, plan_bytes, "{proto} x{n} moved {bytes} bytes");
            assert!(gbs > 0.0 && gbs.is_finite(), "{proto} x{n}: {gbs} GB/s");
            if n > 1 {
                let tenants: Vec<_> = of("tenant").filter(|r| r["protocol"] == proto).collect();
                assert_eq!(tenants.len() as u64, n, "{proto}: {tenants:?}");
                let sum: u64 = tenants.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
                assert_eq!(sum, plan_bytes, "{proto}: the tenants moved {sum} bytes");
            }
        }
    }
    for test in ["rc_lat", "rc_rdma_write_lat", "tcp_lat"] {
        let r: Vec<_> = of("latency").filter(|r| r["test"] == test).collect();
        assert_eq!(r.len(), 1, "{test}: {r:?}");
        let us = r[0]["value"].as_f64().unwrap();
        assert!(us > 0.0 && us < 1e6, "{test}: {us} us");
    }
    for test in ["rc_bw", "rc_rdma_write_bw", "tcp_bw"] {
        let r: Vec<_> = of("bandwidth").filter(|r| r["test"] == test).collect();
        assert_eq!(r.len(), 1, "{test}: {r:?}");
        assert!(r[0]["value"].as_f64().unwrap() > 0.0, "{test}: {r:?}");
    }
    if pairs > 1 {
        assert!(md.contains("Table 4. Four tenants at once"), "{md}");
    }
    // Under TCG the VMs' charts are on a scale of their own.
    let mut charts = if site.contains("accelerator tcg") {
        vec!["bandwidth-vm", "latency-vm"]
    } else {
        vec!["bandwidth", "latency"]
    };
    if pairs > 1 {
        charts.push("fairness");
    }
    for c in &charts {
        check_svg(&out.join("charts").join(format!("{c}.svg")));
        check_png(&out.join("charts").join(format!("{c}.png")));
    }
    let run_id = json["run_id"].as_str().unwrap();
    assert!(processes_of(run_id).is_empty(), "processes left (QEMU?): {:?}", processes_of(run_id));
    assert!(!Path::new(&format!("/tmp/vrdma-study-{pid}")).exists(), "the work directory was left");
}

#[test]
fn interrupted_study_leaves_nothing_behind() {
    if !is_root() {
        vrdma_it::skip("the namespaces and tenant uids need root");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let p = Proc(
        Command::new(VRDMA)
            .args([
                "study",
                "--placements",
                "container,hosts",
                "--runs",
                "50",
                "--bytes",
                "64M",
                "--no-anchors",
                "--out",
            ])
            .arg(&out)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = p.pid();
    // Wait until it has made namespaces and started workers.
    let end = Instant::now() + Duration::from_secs(60);
    while namespaces_of(pid).is_empty() || processes_of_pid(pid).len() < 3 {
        assert!(Instant::now() < end, "the study made no namespaces within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill(2) on our unreaped child.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let (status, _, _) = p.finish(Duration::from_secs(60));
    assert!(!status.success(), "an interrupted study exits non-zero");
    assert!(namespaces_of(pid).is_empty(), "namespaces left: {:?}", namespaces_of(pid));
    assert!(processes_of_pid(pid).is_empty(), "processes left: {:?}", processes_of_pid(pid));
    assert!(out.join("report.md").is_file(), "the report of what was measured is written");
}

#[test]
fn bad_arguments_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let full = dir.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("old"), "x").unwrap();
    let fresh = dir.path().join("fresh");
    let fresh_s = fresh.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--runs", "0", "--out", fresh_s], "--runs"),
        (vec!["--bytes", "0", "--out", fresh_s], "1 B to 1 TiB"),
        (vec!["--bytes", "12Q", "--out", fresh_s], "unknown unit"),
        (vec!["--bytes", "100K", "--out", fresh_s], "less than 4 messages"),
        (vec!["--message-size", "100M", "--out", fresh_s], "message size"),
        (vec!["--time", "0", "--out", fresh_s], "time"),
        (vec!["--placements", "moon", "--out", fresh_s], "process, container, hosts"),
        (vec!["--out", file.to_str().unwrap()], "not a directory"),
        (vec!["--out", full.to_str().unwrap()], "not empty"),
        (vec!["--frobnicate"], "unexpected argument"),
    ];
    for (args, want) in cases {
        let o = Command::new(VRDMA).arg("study").args(&args).stdin(Stdio::null()).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
        assert!(err.lines().count() < 15, "{args:?}: a long message: {err}");
    }
    assert!(!fresh.exists(), "a refused study created its output directory");
}

/// The latency-beside-a-hog cell across hosts (two namespaces, a daemon
/// in each): every run has its three rows (unloaded, beside the hog
/// without and with the latency class), consistent with each other (a
/// median above 0, its p99 at least its median, one unit), and the
/// report's table shows each beside the unloaded anchor of the same run
/// as a ratio. The figures themselves are not asserted.
#[test]
fn the_latency_cell_across_hosts_has_its_rows_in_every_run() {
    if !is_root() {
        eprintln!("skipped: the cell needs root (namespaces, tenants as uids)");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report");
    let started = Instant::now();
    let p = Proc(
        Command::new(VRDMA)
            .args(["study", "--quick", "--no-anchors", "--placements", "hosts", "--out"])
            .arg(&out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (status, _, _) = p.finish(Duration::from_secs(300));
    assert!(status.success(), "vrdma study --quick --placements hosts: {status}");
    eprintln!("vrdma study --quick --no-anchors --placements hosts took {:?}", started.elapsed());
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("data.json")).unwrap()).unwrap();
    let records = data["records"].as_array().expect("records");
    let cell: Vec<&serde_json::Value> = records.iter().filter(|r| r["section"] == "protection").collect();
    let tests = [
        "rc_lat 8 B, unloaded (anchor of this cell)",
        "rc_lat 8 B beside a 64-QP hog, latency_class \"normal\"",
        "rc_lat 8 B beside a 64-QP hog, latency_class \"latency\"",
    ];
    assert_eq!(cell.len(), 2 * tests.len(), "two runs of three rows, and no one-host cell: {cell:?}");
    for run in 1..=2u64 {
        for t in tests {
            let r = cell
                .iter()
                .find(|r| r["run"] == run && r["test"] == t)
                .unwrap_or_else(|| panic!("run {run}: no row {t:?}: {cell:?}"));
            assert_eq!(r["placement"], "hosts", "{r}");
            assert_eq!((r["unit"].as_str(), r["size"].as_u64()), (Some("us"), Some(8)), "{r}");
            let median = r["value"].as_f64().unwrap();
            assert!(median > 0.0, "{r}");
            if let Some(p99) = r["p99_us"].as_f64() {
                assert!(p99 >= median, "a p99 below its median: {r}");
            }
        }
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("Table 6. Latency beside a hog, across hosts"), "{md}");
    assert!(!md.contains("Table 5. Latency beside a hog"), "no one-host cell was asked for: {md}");
    for (t, ratio) in tests.iter().zip([Some("1.00x"), None, None]) {
        let row = md
            .lines()
            .find(|l| l.starts_with(&format!("| {t} |")))
            .unwrap_or_else(|| panic!("no row {t:?} in the table: {md}"));
        let last = row.trim_end_matches('|').rsplit('|').next().unwrap().trim();
        assert!(last.ends_with('x'), "the ratio to the unloaded anchor: {row}");
        if let Some(r) = ratio {
            assert_eq!(last, r, "{row}");
        }
    }
}
