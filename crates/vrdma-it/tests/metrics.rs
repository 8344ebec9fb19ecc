//! The metrics endpoint, scraped with a real client (`curl`) while
//! traffic runs: the counters of the tenant that sent move by at least
//! what it sent, a second tenant (uid 65534, when we are root) has its
//! own series, and with `metrics_listen` unset the daemon listens on no
//! TCP port at all.

use std::process::Command as OsCommand;

use anyhow::{bail, Context as _, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_it::protocol::{Command, Said};
use vrdma_it::{connect, poll_n, DaemonProc, PeerProc, Side, WAIT};

const NOBODY: u32 = 65534;
const LEN: usize = 1000;

fn have_curl() -> bool {
    if OsCommand::new("curl").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    vrdma_it::skip("no `curl` (the real client the metrics test scrapes with)");
    false
}

fn scrape(port: u16) -> Result<String> {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let out = OsCommand::new("curl").args(["-sS", "--fail", "--max-time", "20", &url]).output()?;
    if !out.status.success() {
        bail!("curl {url}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The value of `name{tenant="uid:N"}`, or 0 if the series is absent.
fn value(text: &str, name: &str, uid: u32) -> f64 {
    let prefix = format!("{name}{{tenant=\"uid:{uid}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// `n` signaled sends of `LEN` bytes from `a` to `b`, every completion
/// checked.
fn traffic(a: &Side, b: &Side, n: usize) -> Result<()> {
    // In batches that fit the queues.
    let mut done = 0;
    while done < n {
        let k = (n - done).min(64);
        for i in 0..k {
            b.qp.post_recv(&[wr::recv(i as u64, &[b.mr.sge(0, LEN)?])?]).map_err(|e| e.error)?;
        }
        for i in 0..k {
            a.qp.post_send(&[wr::send(i as u64, &[a.mr.sge(0, LEN)?])?.signaled()]).map_err(|e| e.error)?;
        }
        check(&poll_n(&a.cq, k, WAIT)?)?;
        check(&poll_n(&b.cq, k, WAIT)?)?;
        done += k;
    }
    Ok(())
}

fn check(wcs: &[vrdma::WorkCompletion]) -> Result<()> {
    match wcs.iter().find(|w| w.status != WcStatus::Success) {
        Some(w) => bail!("a completion failed: {w:?}"),
        None => Ok(()),
    }
}

const COUNTERS: [&str; 4] = [
    "vrdma_tenant_messages_sent_total",
    "vrdma_tenant_bytes_sent_total",
    "vrdma_tenant_messages_received_total",
    "vrdma_tenant_bytes_received_total",
];

#[test]
fn a_scrape_shows_each_tenants_traffic_under_its_own_label() -> Result<()> {
    if !have_curl() {
        return Ok(());
    }
    let port = vrdma_it::free_port()?;
    // The engine's per-tenant counters: with the direct path on, sends
    // between this tenant's QPs on this host never reach the engine and
    // are not counted (docs/direct-path.md, "What the daemon cannot see"),
    // so the path is off here whatever `VRDMA_DIRECT` says.
    let config = format!("metrics_listen = \"127.0.0.1:{port}\"\n[direct]\nenabled = false\n");
    let d = DaemonProc::start_with_config(&config)?;
    let ctx = d.context()?;
    let uid = ctx.tenant();
    let (a, b) = (Side::new(&ctx, 1 << 16)?, Side::new(&ctx, 1 << 16)?);
    connect(&a, &b)?;
    let before = scrape(port)?;
    for family in COUNTERS {
        assert!(before.contains(&format!("# TYPE {family} counter\n")), "{before}");
    }
    assert!(before.contains("# TYPE vrdma_tenant_message_latency_seconds histogram\n"));
    for family in ["vrdma_tenant_link_throttled_seconds_total", "vrdma_link_throttled_seconds_total"] {
        assert!(before.contains(&format!("# TYPE {family} counter\n")), "{before}");
    }
    assert!(value(&before, "vrdma_tenant_objects", uid) >= 6.0, "two PDs, MRs, CQs, QPs: {before}");
    let mut last = before;
    for round in 0..2 {
        let n = 200 + round * 100;
        traffic(&a, &b, n)?;
        let now = scrape(port)?;
        let moved = |name: &str| value(&now, name, uid) - value(&last, name, uid);
        let (n, bytes) = (n as f64, (n * LEN) as f64);
        for (name, at_least) in [
            ("vrdma_tenant_messages_sent_total", n),
            ("vrdma_tenant_bytes_sent_total", bytes),
            ("vrdma_tenant_messages_received_total", n),
            ("vrdma_tenant_bytes_received_total", bytes),
            ("vrdma_tenant_message_latency_seconds_count", n),
            ("vrdma_tenant_engine_turns_total", 1.0),
        ] {
            assert!(
                moved(name) >= at_least,
                "round {round}: {name} moved {} < {at_least}\n{now}",
                moved(name)
            );
        }
        let plus_inf =
            format!("vrdma_tenant_message_latency_seconds_bucket{{tenant=\"uid:{uid}\",le=\"+Inf\"}} ");
        let inf: f64 = now.lines().find_map(|l| l.strip_prefix(&plus_inf)).context("+Inf bucket")?.parse()?;
        assert_eq!(inf, value(&now, "vrdma_tenant_message_latency_seconds_count", uid));
        assert!(value(&now, "vrdma_tenant_engine_seconds_total", uid) > 0.0, "{now}");
        last = now;
    }
    let passes = |t: &str| -> f64 {
        t.lines()
            .find_map(|l| l.strip_prefix("vrdma_engine_passes_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(passes(&last) > 0.0, "{last}");
    // On one host no link holds anything back.
    assert_eq!(value(&last, "vrdma_tenant_link_throttled_seconds_total", uid), 0.0, "{last}");

    // A second tenant, of another uid: its own series, its own counts.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        vrdma_it::skip(format!("the second tenant needs root (to run it as uid {NOBODY})"));
        return Ok(());
    }
    let mut other = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(NOBODY))?;
    let hello = other.hello()?;
    assert_eq!(hello.tenant, NOBODY);
    other.call_ok(&Command::Connect { peer: hello.endpoint })?;
    const THEIRS: usize = 7;
    other.call_ok(&Command::PostRecv { count: THEIRS, offset: 0, len: 64 })?;
    for i in 0..THEIRS {
        other.call_ok(&Command::Send { wr_id: i as u64, offset: 4096, len: 10, imm: None })?;
    }
    match other.call(&Command::Poll { count: 2 * THEIRS, timeout_ms: 20_000 })? {
        Said::Completions(c) if c.len() == 2 * THEIRS => {}
        said => bail!("the second tenant's completions: {said:?}"),
    }
    let now = scrape(port)?;
    assert_eq!(value(&now, "vrdma_tenant_messages_sent_total", NOBODY), THEIRS as f64, "{now}");
    assert_eq!(value(&now, "vrdma_tenant_bytes_sent_total", NOBODY), (THEIRS * 10) as f64);
    assert_eq!(value(&now, "vrdma_tenant_messages_received_total", NOBODY), THEIRS as f64);
    assert_eq!(value(&now, "vrdma_tenant_message_latency_seconds_count", NOBODY), THEIRS as f64);
    assert_eq!(
        value(&now, "vrdma_tenant_messages_sent_total", uid),
        value(&last, "vrdma_tenant_messages_sent_total", uid),
        "the other tenant's messages are not ours"
    );
    Ok(())
}

/// The inodes of the TCP sockets in LISTEN state on this host's (our
/// namespace's) tables.
fn listening_inodes() -> Result<Vec<String>> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for l in text.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" {
                out.push(f[9].to_string());
            }
        }
    }
    Ok(out)
}

/// `vrdma_vm_*{vm="t",tenant="uid:N"}`'s value, if the series is there.
fn vm_value(text: &str, name: &str, uid: u32) -> Option<f64> {
    let prefix = format!("{name}{{vm=\"t\",tenant=\"uid:{uid}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok())
}

/// A configured VM's ports, sessions and region use are series of their
/// own: a guest's context (emulated: a process whose library runs in
/// guest mode over the VM's port and region) shows as a port connected,
/// a session and bytes of the region held, and they go back when it
/// closes.
#[test]
fn a_vms_ports_sessions_and_region_use_are_scraped() -> Result<()> {
    use std::os::fd::AsRawFd;
    if !have_curl() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let port = vrdma_it::free_port()?;
    let config = format!(
        "metrics_listen = \"127.0.0.1:{port}\"\n[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 2\n"
    );
    let d = DaemonProc::start_with_config(&config)?;
    let idle = scrape(port)?;
    let v = |text: &str, name: &str| vm_value(text, name, uid);
    assert_eq!(v(&idle, "vrdma_vm_region_bytes"), Some((8u64 << 20) as f64), "{idle}");
    for name in ["vrdma_vm_ports_connected", "vrdma_vm_sessions", "vrdma_vm_region_used_bytes"] {
        assert!(idle.contains(&format!("# TYPE {name} gauge\n")), "{idle}");
        assert_eq!(v(&idle, name), Some(0.0), "{name}: {idle}");
    }
    let vm = vrdma::vm::attach_at(&d.socket, "t")?;
    let cfg = vrdma::guest::GuestConfig {
        ports: vec![vm.port_socket.clone()],
        bar: format!("/proc/self/fd/{}", vm.region.as_raw_fd()).into(),
    };
    let ctx = vrdma::Context::open_guest(&cfg)?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(1 << 16, vrdma_it::access_all())?;
    let busy = scrape(port)?;
    assert_eq!(v(&busy, "vrdma_vm_ports_connected"), Some(1.0), "{busy}");
    assert_eq!(v(&busy, "vrdma_vm_sessions"), Some(1.0), "{busy}");
    let used = v(&busy, "vrdma_vm_region_used_bytes").unwrap_or(0.0);
    assert!(used >= (1u64 << 16) as f64, "the context's ring and a 64 KiB region: {used}");
    drop((mr, pd, ctx));
    vrdma_it::wait_until(WAIT, "the session's end to show", || {
        scrape(port).is_ok_and(|t| {
            ["vrdma_vm_ports_connected", "vrdma_vm_sessions", "vrdma_vm_region_used_bytes"]
                .iter()
                .all(|name| v(&t, name) == Some(0.0))
        })
    })?;
    Ok(())
}

#[test]
fn without_metrics_listen_the_daemon_listens_on_no_tcp_port() -> Result<()> {
    let d = DaemonProc::start()?;
    let listening = listening_inodes()?;
    let mut sockets = 0;
    for fd in std::fs::read_dir(format!("/proc/{}/fd", d.proc.pid()))? {
        let Ok(target) = std::fs::read_link(fd?.path()) else { continue };
        let t = target.to_string_lossy().into_owned();
        if let Some(inode) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
            sockets += 1;
            assert!(!listening.iter().any(|l| l == inode), "the daemon listens on a TCP socket ({t})");
        }
    }
    assert!(sockets > 0, "the control socket at least");
    Ok(())
}

/// Inputs the connection manager refuses are counted by the log line
/// that reports them, like every other limited line: a tenant's
/// connection to a host this daemon cannot reach (its transport is off).
#[test]
fn the_connection_managers_refusals_are_counted() -> Result<()> {
    use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
    if !have_curl() {
        return Ok(());
    }
    let port = vrdma_it::free_port()?;
    let d = DaemonProc::start_with_config(&format!("metrics_listen = \"127.0.0.1:{port}\""))?;
    let ctx = d.context()?;
    let line = "message=\"an rdma_cm message cannot reach its host: its connections end\"";
    assert!(!scrape(port)?.contains(line), "counted before it happened");
    let ch = EventChannel::create(&ctx)?;
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    let event = |want: EventKind| -> Result<()> {
        let ev = ch.get_event(Some(WAIT))?.context("no rdma_cm event")?;
        anyhow::ensure!(ev.kind == want, "{ev:?}, not {want:?}");
        Ok(())
    };
    id.resolve_addr(None, "10.99.99.99:7471".parse()?)?;
    event(EventKind::AddrResolved)?;
    id.resolve_route()?;
    event(EventKind::RouteResolved)?;
    id.connect(&ConnParam::default())?;
    event(EventKind::Unreachable)?;
    let text = scrape(port)?;
    let counted = text
        .lines()
        .find(|l| l.starts_with("vrdma_limited_inputs_total{") && l.contains(line))
        .with_context(|| format!("no count of the refusal: {text}"))?;
    let n: f64 = counted.rsplit(' ').next().unwrap_or("").parse()?;
    assert!(n >= 1.0, "{counted}");
    Ok(())
}

/// The engine's `vrdma_engine_sleeps_total`, without labels.
fn engine_sleeps(text: &str) -> Result<f64> {
    let line = text
        .lines()
        .find(|l| l.starts_with("vrdma_engine_sleeps_total "))
        .with_context(|| format!("no vrdma_engine_sleeps_total: {text}"))?;
    Ok(line.rsplit(' ').next().unwrap_or("").parse()?)
}

/// A receive posted to a QP that is not in ERR does not wake a sleeping
/// engine (issue 17: on the direct path a SEND's receive was reposted
/// each message, and each post woke the engine, a third party for the
/// two CPUs of a ping-pong). The engine sleeps at once when idle here;
/// each of 40 posts comes after a pause it sleeps in, so posts that woke
/// it would add about 40 sleeps. Its 1 s sleep limit and the scrapes
/// account for a few.
#[test]
fn posting_a_receive_leaves_a_sleeping_engine_asleep() -> Result<()> {
    if !have_curl() {
        return Ok(());
    }
    let port = vrdma_it::free_port()?;
    let config = format!("metrics_listen = \"127.0.0.1:{port}\"\n[engine]\nspin_us = 0\nyield_us = 0\n");
    let d = DaemonProc::start_with_config(&config)?;
    let ctx = d.context()?;
    let (a, b) = (Side::new(&ctx, 4096)?, Side::new(&ctx, 4096)?);
    connect(&a, &b)?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = engine_sleeps(&scrape(port)?)?;
    for i in 0..40 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.qp.post_recv(&[wr::recv(i, &[b.mr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    let woke = engine_sleeps(&scrape(port)?)? - before;
    assert!(woke < 10.0, "the engine went to sleep {woke} times more over 40 receives posted");
    // The receives are there for the engine path all the same.
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 64)?])?.signaled()]).map_err(|e| e.error)?;
    check(&poll_n(&a.cq, 1, WAIT)?)?;
    check(&poll_n(&b.cq, 1, WAIT)?)?;
    Ok(())
}
