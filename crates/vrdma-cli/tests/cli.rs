//! The `vrdma` command as a user runs it: a real daemon process, real
//! signals, real output.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "cli/stand_in.rs"]
mod stand_in;
#[path = "cli/vm_migrate.rs"]
mod vm_migrate;
#[path = "cli/vm_snapshot.rs"]
mod vm_snapshot;

const VRDMA: &str = env!("CARGO_BIN_EXE_vrdma");

/// A daemon process, killed by pid if the test did not stop it.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn vrdma(socket: &Path, args: &[&str]) -> Output {
    Command::new(VRDMA).arg("--socket").arg(socket).args(args).output().expect("run vrdma")
}

/// A command's stdout and stderr, as text.
fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Starts `vrdma daemon` with the config file `config` (socket in `dir`),
/// which it must refuse: its stderr (bounded by timeout(1), should it
/// start after all).
fn refused_config(dir: &Path, config: &Path) -> String {
    let out = Command::new("timeout")
        .args(["20", VRDMA, "daemon", "--socket"])
        .arg(dir.join("bad.sock"))
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    let (_, se) = text(&out);
    assert!(!out.status.success(), "the daemon took {}: {se}", config.display());
    se
}

fn start_daemon(socket: &Path, extra: &[&str]) -> Daemon {
    let child = Command::new(VRDMA)
        .args(["daemon", "--socket"])
        .arg(socket)
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn daemon");
    let d = Daemon(child);
    let end = Instant::now() + Duration::from_secs(20);
    while !socket.exists() || vrdma(socket, &["devinfo"]).status.code() != Some(0) {
        assert!(Instant::now() < end, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < end, "process did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn devinfo_shows_the_device_like_ibv_devinfo() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = start_daemon(&sock, &["--address", "10.1.2.3"]);
    let out = vrdma(&sock, &["devinfo"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("hca_id:\tvrdma0"), "{text}");
    assert!(text.contains("PORT_ACTIVE (4)"), "{text}");
    assert!(text.contains("max_qp_wr:"), "{text}");
    // GID[0] carries the host address, RoCE v2 style; the LID comes from it.
    assert!(text.contains("0000:0000:0000:0000:0000:ffff:0a01:0203"), "{text}");
    assert!(text.contains("port_lid:\t\t515"), "{text}");
    assert!(text.contains("vendor_id:\t\t\t0x5652"), "{text}");
}

#[test]
fn sigterm_stops_the_daemon_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let mut d = start_daemon(&sock, &[]);
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(d.0.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut d.0, Duration::from_secs(10));
    assert!(status.success(), "{status}");
    assert!(!sock.exists(), "the socket file is removed on shutdown");
}

#[test]
fn a_second_daemon_on_the_same_socket_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let _d = start_daemon(&sock, &[]);
    let out = Command::new(VRDMA).args(["daemon", "--socket"]).arg(&sock).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already listens"));
}

#[test]
fn devinfo_without_a_daemon_says_how_to_start_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = vrdma(&dir.path().join("none.sock"), &["devinfo"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no vRDMA daemon answers") && err.contains("vrdma daemon"), "{err}");
}

#[test]
fn bad_arguments_and_config_are_clear_errors() {
    let out = Command::new(VRDMA).args(["bench", "--runs", "many"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value"));

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[quota]\nmax_objects = \"lots\"\n").unwrap();
    let out = Command::new(VRDMA)
        .args(["daemon", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid configuration"));
}

/// `vrdma stat` shows the path each QP of the caller's tenant takes (a
/// link to another host's daemon, or shared memory on this one) and the
/// links; `vrdma devinfo` shows the links too.
#[test]
fn stat_shows_each_qps_path_and_devinfo_the_links() {
    let h = vrdma_it::TwoHosts::start(true).expect("two daemons");
    let (across, _peer) = vrdma_it::across::pair(&h.a, &h.b, false).expect("a pair across the hosts");
    let ctx = h.a.context().expect("a context on host a");
    let (l1, l2) = (vrdma_it::Side::new(&ctx, 4096).unwrap(), vrdma_it::Side::new(&ctx, 4096).unwrap());
    l1.qp.connect(&l2.endpoint().unwrap(), vrdma_it::access_all()).unwrap();
    l2.qp.connect(&l1.endpoint().unwrap(), vrdma_it::access_all()).unwrap();

    let out = vrdma(&h.a.socket, &["stat"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let qp_line = |qpn: u32| {
        let head = format!("qp {qpn:#08x}:");
        text.lines().find(|l| l.starts_with(&head)).unwrap_or_else(|| panic!("no line for {head}:\n{text}"))
    };
    assert!(qp_line(across.qp.qpn()).contains(", tcp link "), "{text}");
    for q in [&l1, &l2] {
        assert!(qp_line(q.qp.qpn()).ends_with(", shared memory (same host)"), "{text}");
    }
    let link = text.lines().find(|l| l.starts_with("link ")).unwrap_or_else(|| panic!("no link:\n{text}"));
    assert!(link.contains("ffff:7f00:0003 lid 3 ") && link.contains(" UP, 1 QPs,"), "{link}");

    let out = vrdma(&h.a.socket, &["devinfo"]);
    let dev = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(dev.lines().any(|l| l.trim_start().starts_with("link ") && l.contains(" UP, 1 QPs,")), "{dev}");
}

/// `vrdma stat --prometheus` (no `--metrics`): the caller's own figures in
/// the endpoint's names and labels. A link's counters are the caller's
/// tenant's own traffic: another tenant (uid 65534, when we are root)
/// sees the link and none of our bytes, nor the operator-only families;
/// we, the operator (the daemon's uid), see the totals.
#[test]
fn stat_prometheus_shows_the_callers_own_traffic_on_each_link() {
    use std::os::unix::process::CommandExt;
    use vrdma::wr::{self, SendWrExt};
    const LEN: usize = 50_000;
    let h = vrdma_it::TwoHosts::start(true).expect("two daemons");
    let (a, b) = vrdma_it::across::pair(&h.a, &h.b, false).expect("a pair across the hosts");
    b.qp.post_recv(&[wr::recv(1, &[b.mr.sge(0, LEN).unwrap()]).unwrap()]).unwrap();
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, LEN).unwrap()]).unwrap().signaled()]).unwrap();
    let wc = vrdma_it::poll_n(&a.cq, 1, vrdma_it::WAIT).unwrap();
    assert_eq!(wc[0].status, vrdma::WcStatus::Success, "{wc:?}");
    let prometheus = |uid: Option<u32>| {
        let mut cmd = Command::new(VRDMA);
        if let Some(u) = uid {
            cmd.uid(u).gid(u);
        }
        let out = cmd.arg("--socket").arg(&h.a.socket).args(["stat", "--prometheus"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    // The sum of a family's samples.
    let sum = |text: &str, name: &str| -> f64 {
        let head = format!("{name}{{");
        text.lines()
            .filter(|l| l.starts_with(&head))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let ours = prometheus(None);
    assert!(sum(&ours, "vrdma_link_bytes_sent_total") >= LEN as f64, "{ours}");
    assert!(sum(&ours, "vrdma_tenant_bytes_sent_total") >= LEN as f64, "{ours}");
    assert!(ours.contains("vrdma_engine_missed_wakeups_total "), "the daemon's count: {ours}");

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        vrdma_it::skip("the other tenant needs root (to run vrdma stat as uid 65534)");
        return;
    }
    let theirs = prometheus(Some(65534));
    assert_eq!(sum(&theirs, "vrdma_link_up"), 1.0, "the link shows: {theirs}");
    for name in
        ["vrdma_link_bytes_sent_total", "vrdma_link_frames_sent_total", "vrdma_link_frames_received_total"]
    {
        assert_eq!(sum(&theirs, name), 0.0, "another tenant sees {name}: {theirs}");
    }
    assert!(theirs.contains("vrdma_tenant_bytes_sent_total{tenant=\"uid:65534\"} 0"), "{theirs}");
    for never in [
        "uid:0",
        "vrdma_link_retransmissions_total",
        "vrdma_link_rtt",
        "vrdma_link_throttled",
        "vrdma_engine_",
    ] {
        assert!(!theirs.contains(never), "another tenant sees {never}: {theirs}");
    }
}

/// `vrdma run` ended by SIGTERM or SIGHUP (a service manager, `kill`)
/// hands the signal to its program, which ends, and still removes its
/// library folder; before, the program ran on and the folder stayed.
#[test]
fn vrdma_run_ended_by_a_signal_ends_its_program_and_removes_its_folder() {
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vrdma.sock");
        let _d = start_daemon(&socket, &[]);
        // Any file stands in for the library: `sleep` never loads it.
        let mut run = Command::new(VRDMA)
            .args(["--socket"])
            .arg(&socket)
            .args(["run", "--", "sleep", "30"])
            .env("TMPDIR", dir.path())
            .env("VRDMA_VERBS_LIB", VRDMA)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn vrdma run");
        let folder = dir.path().join(format!("vrdma-run-{}", run.id()));
        let children = format!("/proc/{0}/task/{0}/children", run.id());
        let end = Instant::now() + Duration::from_secs(20);
        let program = loop {
            let kids = std::fs::read_to_string(&children).unwrap_or_default();
            if let (true, Some(pid)) = (folder.exists(), kids.split_whitespace().next()) {
                break pid.parse::<i32>().unwrap();
            }
            assert!(Instant::now() < end, "vrdma run did not start its program");
            std::thread::sleep(Duration::from_millis(10));
        };
        // SAFETY: kill(2) of our own child process by its pid; it has not
        // been reaped (we wait for it below).
        assert_eq!(unsafe { libc::kill(run.id() as i32, sig) }, 0);
        let status = wait_exit(&mut run, Duration::from_secs(10));
        assert_eq!(status.code(), Some(128 + sig), "the program's end, as a shell reports it");
        assert!(!folder.exists(), "signal {sig}: the library folder is left behind");
        assert!(!Path::new(&format!("/proc/{program}")).exists(), "signal {sig}: the program still runs");
    }
}

/// `vrdma vm`: the arguments of a configured VM, QEMU exec'd with them
/// (here a script standing in for QEMU, which reports what it got and
/// that the region descriptor reached it open), and the errors an
/// operator meets.
#[test]
fn vm_args_and_run_hand_qemu_the_vms_region_and_ports() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let config = dir.path().join("vms.toml");
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    std::fs::write(&config, format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 2\n")).unwrap();
    let _d = start_daemon(&sock, &["--config", config.to_str().unwrap()]);

    let out = vrdma(&sock, &["vm", "args", "t", "--fd", "9"]);
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    let vm_sock = dir.path().join("vm-t.sock");
    for want in [
        "memory-backend-file,id=vrdma-mem,share=on,mem-path=/proc/self/fd/9,size=8388608".to_string(),
        "ivshmem-plain,memdev=vrdma-mem,master=on".into(),
        format!("socket,id=vrdma-p1,path={}", vm_sock.display()),
        "name=org.vrdma.1".into(),
    ] {
        assert!(so.contains(&want), "{want:?} missing from {so}");
    }
    assert!(!so.contains("org.vrdma.2"), "two ports: {so}");

    // A stand-in QEMU: prints its arguments one a line, then the size of
    // the file its mem-path names (the region, inherited open).
    let qemu = dir.path().join("fake-qemu");
    std::fs::write(
        &qemu,
        "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n\
         p=$(echo \"$*\" | grep -o 'mem-path=[^,]*' | cut -d= -f2)\n\
         echo \"region: $(stat -L -c %s \"$p\")\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = vrdma(
        &sock,
        &["vm", "run", "t", "--qemu", qemu.to_str().unwrap(), "--", "-m", "64", "-append", "a b"],
    );
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    let lines: Vec<&str> = so.lines().collect();
    assert_eq!(lines[0], "-object", "{so}");
    assert_eq!(lines[lines.len() - 5..], ["-m", "64", "-append", "a b", "region: 8388608"], "{so}");
    assert!(
        se.contains(&format!("vrdma vm run: {} -object ", qemu.display())) && se.contains("-append 'a b'"),
        "{se}"
    );

    // Errors: an unknown VM, no QEMU, no daemon, a region QEMU refuses.
    let out = vrdma(&sock, &["vm", "args", "nope", "--fd", "3"]);
    let (_, se) = text(&out);
    assert!(!out.status.success() && se.contains("has no VM \"nope\"") && se.contains("[vms.nope]"), "{se}");
    let out = vrdma(&sock, &["vm", "run", "t", "--qemu", "/nonexistent/qemu"]);
    let (_, se) = text(&out);
    assert!(!out.status.success() && se.contains("cannot run /nonexistent/qemu"), "{se}");
    let out = vrdma(&dir.path().join("none.sock"), &["vm", "run", "t"]);
    let (_, se) = text(&out);
    assert!(
        !out.status.success() && se.contains("no vRDMA daemon answers") && se.contains("[vms.t]"),
        "{se}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, format!("[vms.t]\ntenant = {uid}\nmemory_mib = 100\n")).unwrap();
    let se = refused_config(dir.path(), &bad);
    assert!(se.contains("memory_mib 100 is not a power of two"), "{se}");
}

/// With `metrics_token_file`, the metrics endpoint answers a scrape only
/// with the token: `vrdma stat --metrics` says how to give it, and with
/// `--metrics-token-file` shows the figures; a plain scrape (`curl`,
/// where installed) gets 401 and none of them.
#[test]
fn a_metrics_endpoint_with_a_token_answers_only_scrapes_that_send_it() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("metrics.token");
    std::fs::write(&token, "t0k3n-for-the-test\n").unwrap();
    let wrong = dir.path().join("wrong.token");
    std::fs::write(&wrong, "another").unwrap();
    let port = vrdma_it::free_port().expect("a free port");
    let addr = format!("127.0.0.1:{port}");
    let config = format!("metrics_listen = \"{addr}\"\nmetrics_token_file = \"{}\"\n", token.display());
    let d = vrdma_it::DaemonProc::start_with_config(&config).expect("a daemon");
    let _ctx = d.context().expect("a context");
    let out = vrdma(&d.socket, &["stat", "--metrics", &addr]);
    let (_, se) = text(&out);
    assert!(!out.status.success() && se.contains("--metrics-token-file"), "{se}");
    let out =
        vrdma(&d.socket, &["stat", "--metrics", &addr, "--metrics-token-file", wrong.to_str().unwrap()]);
    let (_, se) = text(&out);
    assert!(!out.status.success() && se.contains("the one given is not it"), "{se}");
    let out = vrdma(
        &d.socket,
        &["stat", "--metrics", &addr, "--prometheus", "--metrics-token-file", token.to_str().unwrap()],
    );
    let (so, se) = text(&out);
    assert!(out.status.success(), "{se}");
    assert!(so.contains("# TYPE vrdma_tenant_objects gauge"), "{so}");
    if let Ok(o) = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20"])
        .arg(format!("http://{addr}/metrics"))
        .output()
    {
        assert_eq!(String::from_utf8_lossy(&o.stdout), "401");
    }
    // A token file the daemon cannot take: it does not start (bounded,
    // should it start after all).
    std::fs::write(&wrong, "two words").unwrap();
    let bad = dir.path().join("bad.toml");
    let other = vrdma_it::free_port().expect("a free port");
    std::fs::write(
        &bad,
        format!("metrics_listen = \"127.0.0.1:{other}\"\nmetrics_token_file = \"{}\"\n", wrong.display()),
    )
    .unwrap();
    let se = refused_config(dir.path(), &bad);
    assert!(se.contains("characters a bearer token cannot have"), "{se}");
}

/// `vrdma stat --json` run as `uid` (or as we are), parsed.
fn stat_json(socket: &Path, uid: Option<u32>) -> serde_json::Value {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(VRDMA);
    if let Some(u) = uid {
        cmd.uid(u).gid(u);
    }
    let out = cmd.arg("--socket").arg(socket).args(["stat", "--json"]).output().expect("run vrdma stat");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("vrdma stat --json prints JSON")
}

fn counter(v: &serde_json::Value, name: &str) -> u64 {
    v["tenant"]["counters"][name].as_u64().unwrap_or_else(|| panic!("no counter {name}: {v}"))
}

/// `vrdma stat` without `--metrics` shows the caller's own tenant's
/// figures, from the daemon over the control socket (no metrics endpoint
/// configured): they move by what the tenant sent, in JSON and in text;
/// another tenant (uid 65534, when we are root) sees its own figures,
/// none of ours.
#[test]
fn stat_shows_the_callers_own_tenants_figures_and_no_other_tenants() {
    use vrdma::wr::{self, SendWrExt};
    const N: usize = 150;
    const LEN: usize = 1000;
    // The engine counts what it carries: the direct path (which skips it
    // for one tenant's QPs on one host) is off.
    let d = vrdma_it::DaemonProc::start_with_config("[direct]\nenabled = false\n").expect("a daemon");
    let ctx = d.context().expect("a context");
    let us = ctx.tenant();
    let (a, b) = (vrdma_it::Side::new(&ctx, 1 << 16).unwrap(), vrdma_it::Side::new(&ctx, 1 << 16).unwrap());
    vrdma_it::connect(&a, &b).unwrap();
    let before = stat_json(&d.socket, None);
    assert_eq!(before["tenant"]["tenant"].as_u64(), Some(u64::from(us)), "{before}");
    assert!(before["tenant"]["objects"].as_u64().unwrap() >= 8, "two PDs, MRs, CQs, QPs: {before}");
    assert!(before["tenant"]["registered_bytes"].as_u64().unwrap() >= 2 << 16, "{before}");
    let mut done = 0;
    while done < N {
        let k = (N - done).min(64);
        for i in 0..k {
            b.qp.post_recv(&[wr::recv(i as u64, &[b.mr.sge(0, LEN).unwrap()]).unwrap()]).unwrap();
        }
        for i in 0..k {
            a.qp.post_send(&[wr::send(i as u64, &[a.mr.sge(0, LEN).unwrap()]).unwrap().signaled()]).unwrap();
        }
        for cq in [&a.cq, &b.cq] {
            let wcs = vrdma_it::poll_n(cq, k, vrdma_it::WAIT).unwrap();
            assert!(wcs.iter().all(|w| w.status == vrdma::WcStatus::Success), "{wcs:?}");
        }
        done += k;
    }
    let after = stat_json(&d.socket, None);
    let moved = |name: &str| counter(&after, name) - counter(&before, name);
    for (name, at_least) in [
        ("messages_sent", N),
        ("bytes_sent", N * LEN),
        ("messages_received", N),
        ("bytes_received", N * LEN),
        ("turns", 1),
    ] {
        assert!(moved(name) >= at_least as u64, "{name} moved {} < {at_least}: {after}", moved(name));
    }
    assert!(counter(&after, "engine_ns") > 0, "{after}");
    assert_eq!(counter(&after, "completions_error"), 0);
    let latency = &after["tenant"]["counters"]["latency"];
    assert!(latency["count"].as_u64().unwrap() >= N as u64, "{latency}");
    let q = &after["tenant"]["latency_quantiles"];
    let (p50, p99) = (q["p50_ns_at_most"].as_u64().unwrap(), q["p99_ns_at_most"].as_u64().unwrap());
    assert!(p50 > 0 && p50 <= p99, "{q}");

    let out = vrdma(&d.socket, &["stat"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(&format!("tenant:\t\tuid:{us} (")), "{text}");
    assert!(text.lines().any(|l| l.contains("sent:") && l.contains(" messages / ")), "{text}");
    assert!(text.lines().any(|l| l.contains("latency:") && l.contains("p99 <= ")), "{text}");

    // A reader that went away (`vrdma stat --json | head -1`) ends the
    // output quietly: the read end is closed before vrdma writes at all.
    let (read_end, write_end) = std::io::pipe().expect("a pipe");
    drop(read_end);
    let closed = Command::new(VRDMA)
        .arg("--socket")
        .arg(&d.socket)
        .args(["stat", "--json"])
        .stdout(write_end)
        .output()
        .expect("run vrdma");
    assert_eq!(closed.status.code(), Some(0), "{}", String::from_utf8_lossy(&closed.stderr));

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        vrdma_it::skip("the other tenant needs root (to run vrdma stat as uid 65534)");
        return;
    }
    const NOBODY: u32 = 65534;
    let theirs = stat_json(&d.socket, Some(NOBODY));
    assert_eq!(theirs["tenant"]["tenant"].as_u64(), Some(u64::from(NOBODY)), "{theirs}");
    for name in ["messages_sent", "bytes_sent", "messages_received", "bytes_received", "turns", "engine_ns"] {
        assert_eq!(counter(&theirs, name), 0, "another tenant sees {name}: {theirs}");
    }
    assert_eq!(theirs["tenant"]["counters"]["latency"]["count"].as_u64(), Some(0), "{theirs}");
    assert!(theirs["qps"].as_array().is_some_and(|q| q.is_empty()), "none of our QPs: {theirs}");
    assert!(theirs["tenant"]["registered_bytes"].as_u64() < Some(2 << 16), "{theirs}");
}

/// `vrdma migrate` says clearly what it refused: a tenant with nothing on
/// the daemon, a VM it does not have, no tenant at all, a snapshot that is not a regular file, a file that is not a
/// snapshot, a file that is not there, a region's bytes without a VM or
/// of another length than its region.
#[test]
fn migrate_steps_refuse_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let cfg = dir.path().join("v.toml");
    std::fs::write(&cfg, "[vms.t]\ntenant = 4343\nmemory_mib = 8\nports = 1\n").unwrap();
    let _d = start_daemon(&sock, &["--address", "10.1.2.3", "--config", cfg.to_str().unwrap()]);
    let fails = |args: &[&str], says: &str| {
        let out = vrdma(&sock, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    };
    fails(&["migrate", "pause", "--tenant", "4242"], "tenant 4242 has no context on this host");
    fails(&["migrate", "pause", "--vm", "nope"], "no VM \"nope\" is configured");
    // A VM by name is its configured tenant (here with nothing attached).
    fails(&["migrate", "pause", "--vm", "t"], "tenant 4343 has no context on this host");
    fails(&["migrate", "pause"], "--tenant <TENANT>|--vm <NAME>");
    fails(&["migrate", "export", "--tenant", "4242", "--out", "/dev/null"], "tenant 4242 has no context");
    fails(&["migrate", "resume", "--tenant", "4242"], "tenant 4242 has no context");
    fails(&["migrate", "import", "--in", "/dev/null"], "must come as a regular file");
    let junk = dir.path().join("junk");
    std::fs::write(&junk, b"not a snapshot at all").unwrap();
    fails(&["migrate", "import", "--in", junk.to_str().unwrap()], "not a vRDMA snapshot (bad magic)");
    fails(&["migrate", "import", "--in", "/nonexistent/snap"], "opening /nonexistent/snap");
    // A region's bytes go with a VM only, and only of its region's length
    // (refused before anything is written or imported).
    let j = junk.to_str().unwrap();
    fails(&["migrate", "export", "--tenant", "4242", "--out", "/dev/null", "--region", j], "--vm");
    fails(&["migrate", "import", "--in", j, "--region", j], "--vm");
    fails(
        &["migrate", "import", "--in", j, "--vm", "t", "--region", j],
        "holds 21 bytes, VM \"t\"'s region here",
    );
    fails(&["migrate", "import", "--in", j, "--vm", "nope", "--region", j], "no VM \"nope\" is configured");
    fails(
        &["migrate", "import", "--in", j, "--vm", "t", "--region", "/nonexistent/r"],
        "opening /nonexistent/r",
    );

    // An export writes the whole snapshot (it once wrote an empty file:
    // the daemon's memfd came with its offset at the end), which an
    // import reads back: here it collides with the tenant still here.
    let ctx = vrdma::Context::open_at(&sock).expect("open");
    let _pd = ctx.alloc_pd().expect("a PD");
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() }.to_string();
    let ok = |args: &[&str]| {
        let out = vrdma(&sock, args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let snap = dir.path().join("t.snap");
    ok(&["migrate", "pause", "--tenant", &uid]);
    ok(&["migrate", "export", "--tenant", &uid, "--out", snap.to_str().unwrap()]);
    let bytes = std::fs::read(&snap).unwrap();
    assert!(bytes.len() > 4 && bytes.starts_with(b"vRMS"), "the exported file: {bytes:?}");
    fails(&["migrate", "import", "--in", snap.to_str().unwrap()], "collides with this host");
    ok(&["migrate", "resume", "--tenant", &uid]);
}
