//! Runs the plan: per placement, its daemons and namespaces, one
//! `vrdma bench --server` per tenant in the receiving place, then for each
//! run the transfer cells, the latency/bandwidth set and the anchors
//! (runs outermost, so that drift over time spreads over every cell).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use super::anchors;
use super::data::{Failure, Record, Section};
use super::placement::{Env, Place, Site};
use super::plan::{Placement, Plan, Protocol, BANDWIDTH_SET, LATENCY_SET, TENANTS};
use super::proc::{self, Proc};
use super::progress::{fmt_duration, Progress};
use super::report;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether SIGINT or SIGTERM asked the study to stop.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// What the study found, for the report.
pub struct Outcome {
    pub plan: Plan,
    pub run_id: String,
    pub started: String,
    pub seconds: f64,
    pub records: Vec<Record>,
    pub failures: Vec<Failure>,
    /// Placement descriptions, as set up.
    pub sites: Vec<(Placement, String)>,
    /// Anchors that could not run at all, and why.
    pub anchor_notes: Vec<String>,
    /// The accelerator the vm placement's guests ran under, if it ran.
    pub vm_accel: Option<vrdma_guest::Accel>,
}

/// A directory under /tmp every tenant uid can reach, removed on drop.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(plan: Plan) -> Result<()> {
    let start = Instant::now();
    let started = super::plan::timestamp();
    let run_id = format!("{}-{started}", std::process::id());
    std::fs::create_dir_all(plan.out.join("logs"))
        .with_context(|| format!("creating the output directory {}", plan.out.display()))?;
    std::fs::create_dir_all(plan.out.join("charts"))?;
    let logs = plan.out.join("logs").canonicalize()?;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    let old = unsafe {
        [
            libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t),
            libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t),
        ]
    };
    let result = execute(plan, &run_id, &started, &logs, start);
    // SAFETY: restoring the handlers signal(2) returned.
    unsafe {
        libc::signal(libc::SIGINT, old[0]);
        libc::signal(libc::SIGTERM, old[1]);
    }
    let outcome = result?;
    let out = outcome.plan.out.clone();
    report::write(&outcome)?;
    eprintln!(
        "vrdma study: done in {}; {} records, {} failures; report in {}",
        fmt_duration(start.elapsed()),
        outcome.records.len(),
        outcome.failures.len(),
        out.join("report.html").display()
    );
    if interrupted() {
        bail!("interrupted: the report holds what was measured until then");
    }
    Ok(())
}

fn execute(plan: Plan, run_id: &str, started: &str, logs: &Path, start: Instant) -> Result<Outcome> {
    if plan.placements.iter().any(|p| *p != Placement::Process) {
        let n = super::netns::remove_stale();
        if n > 0 {
            eprintln!("vrdma study: removed {n} namespaces left by an earlier study that was killed");
        }
    }
    let work = WorkDir(std::env::temp_dir().join(format!("vrdma-study-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&work.0);
    std::fs::create_dir_all(&work.0)?;
    std::fs::set_permissions(&work.0, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let exe = worker_exe(&work.0, plan.as_uids)?;

    let mut anchor_notes = Vec::new();
    let lib = if plan.anchors { perftest_lib(&mut anchor_notes) } else { None };
    let has = |tool: &str, notes: &mut Vec<String>| {
        let ok = plan.anchors && anchors::which(tool).is_some();
        if plan.anchors && !ok {
            notes.push(format!("{tool} is not installed: its anchor is left out"));
        }
        ok
    };
    let (qperf, iperf3) = (has("qperf", &mut anchor_notes), has("iperf3", &mut anchor_notes));
    let perftest = lib.is_some();
    let anchor_runs = if plan.quick { 1 } else { plan.runs };

    // The steps and their estimates, for the progress bar.
    let est = Estimates::new(&plan);
    let per_run = est.transfer_all(&plan) + est.set;
    let anchors_per_run = est.anchors(qperf, iperf3, perftest);
    let host_placements = plan.placements.iter().filter(|p| **p != Placement::Vm).count();
    let has_vm = plan.placements.contains(&Placement::Vm);
    let total = host_placements as u32 * (est.setup + per_run * plan.runs + anchors_per_run * anchor_runs)
        + if has_vm { super::vm::Estimate::new(&plan).total(&plan) } else { Duration::ZERO };
    let mut steps = host_placements
        * (1 + (plan.runs as usize) * (plan.concurrency().len() * 2 + 1) + anchor_runs as usize)
        + if has_vm {
            1 + (plan.runs as usize) * (plan.vm_concurrency().len() * 2 + 1) + anchor_runs as usize
        } else {
            0
        };
    // The latency-beside-a-hog cells: one host, and across hosts (two
    // namespaces, a daemon in each), tenants as uids.
    let protect = plan.as_uids && plan.placements.contains(&Placement::Process);
    let protect_hosts = plan.as_uids && plan.placements.contains(&Placement::Hosts);
    let protect_est =
        Duration::from_secs_f64(5.0 + f64::from(plan.runs) * (3.0 * (plan.set_seconds + 1.5) + 1.5));
    let total = total
        + if protect { protect_est } else { Duration::ZERO }
        + if protect_hosts { protect_est } else { Duration::ZERO };
    steps += usize::from(protect) + usize::from(protect_hosts);
    let mut progress = Progress::new(total, steps);

    let mut st = State { records: Vec::new(), failures: Vec::new() };
    let mut sites = Vec::new();
    let env = Env { exe: &exe, dir: &work.0, logs, run_id };
    let actx = anchors::Ctx { logs, run_id, lib_dir: lib.as_ref().map(|l| l.path()) };
    let mut vm_accel = None;
    for &p in &plan.placements {
        if interrupted() {
            break;
        }
        if p == Placement::Vm {
            vm_accel =
                super::vm::placement(&env, &plan, &mut st, &mut progress, &mut anchor_notes, &mut sites);
            continue;
        }
        progress.start(&format!("{}: setting up", p.name()));
        let mut site = match Site::setup(p, &env) {
            Ok(s) => s,
            Err(e) => {
                progress.note(&format!("placement {} could not be set up: {e:#}", p.name()));
                st.failures
                    .push(Failure { what: format!("placement {}", p.name()), error: format!("{e:#}") });
                progress.done(est.setup + per_run * plan.runs + anchors_per_run * anchor_runs);
                continue;
            }
        };
        sites.push((p, site.description.clone()));
        let tenants = if plan.four_tenants { TENANTS } else { 1 };
        let servers =
            match (0..tenants).map(|i| Server::start(&env, &plan, &site, i)).collect::<Result<Vec<_>>>() {
                Ok(s) => s,
                Err(e) => {
                    st.failures.push(Failure {
                        what: format!("placement {}: bench servers", p.name()),
                        error: format!("{e:#}"),
                    });
                    progress.done(est.setup + per_run * plan.runs + anchors_per_run * anchor_runs);
                    continue;
                }
            };
        progress.done(est.setup);
        for run in 1..=plan.runs {
            for &proto in &Protocol::ALL {
                for &n in &plan.concurrency() {
                    if interrupted() {
                        break;
                    }
                    progress.start(&format!("{}: {} x{n} run {run}/{}", p.name(), proto.name(), plan.runs));
                    let r = transfer(&env, &plan, &site, &servers, proto, n, run);
                    st.take(r, format!("{} {} x{n} run {run}", p.name(), proto.name()), &progress);
                    progress.done(est.transfer(proto, n));
                }
            }
            if interrupted() {
                break;
            }
            progress.start(&format!("{}: latency/bandwidth set run {run}/{}", p.name(), plan.runs));
            let r = set(&env, &plan, &site, &servers[0], run);
            st.take(r, format!("{} latency/bandwidth set run {run}", p.name()), &progress);
            progress.done(est.set);
            if run <= anchor_runs && !interrupted() {
                progress.start(&format!("{}: anchors run {run}/{anchor_runs}", p.name()));
                let (send, recv) = (&site.senders[0], &site.receivers[0]);
                let size = plan.message_size;
                let secs = plan.set_seconds;
                let rec = |section, proto, tenants, tool, test: &str, size, value, unit| {
                    anchor_record(p, run, section, proto, tenants, tool, test, size, value, unit)
                };
                let what = |t: &str| format!("{} {t} run {run}", p.name());
                if qperf {
                    let r = anchors::qperf(&actx, send, recv, "tcp_lat", 8, secs).map(|v| {
                        vec![rec(Section::Latency, Protocol::Tcp, 1, "qperf", "tcp_lat", 8, v, "us")]
                    });
                    st.take(r, what("qperf tcp_lat"), &progress);
                    let r = anchors::qperf(&actx, send, recv, "tcp_bw", size, secs).map(|v| {
                        vec![rec(Section::Bandwidth, Protocol::Tcp, 1, "qperf", "tcp_bw", size, v, "GB/s")]
                    });
                    st.take(r, what("qperf tcp_bw"), &progress);
                }
                if iperf3 {
                    for &n in &plan.concurrency() {
                        let r = anchors::iperf3(&actx, send, recv, plan.bytes, n).map(|v| {
                            let test = format!("iperf3 -P {n}");
                            vec![rec(Section::Transfer, Protocol::Tcp, n, "iperf3", &test, 0, v, "GB/s")]
                        });
                        st.take(r, what(&format!("iperf3 -P {n}")), &progress);
                    }
                }
                if perftest {
                    let iters = (plan.bytes / size).max(1);
                    let r = anchors::perftest(&actx, send, recv, "ib_write_bw", size, iters).map(|v| {
                        vec![rec(
                            Section::Transfer,
                            Protocol::Vrdma,
                            1,
                            "perftest",
                            "ib_write_bw",
                            size,
                            v,
                            "GB/s",
                        )]
                    });
                    st.take(r, what("ib_write_bw"), &progress);
                    let n = if plan.quick { 1000 } else { 10_000 };
                    let r = anchors::perftest(&actx, send, recv, "ib_write_lat", 8, n).map(|v| {
                        vec![rec(
                            Section::Latency,
                            Protocol::Vrdma,
                            1,
                            "perftest",
                            "ib_write_lat",
                            8,
                            v,
                            "us",
                        )]
                    });
                    st.take(r, what("ib_write_lat"), &progress);
                }
                progress.done(anchors_per_run);
            }
        }
        if !site.alive() {
            st.failures.push(Failure {
                what: format!("placement {}", p.name()),
                error: "a daemon exited during the placement (see logs/)".into(),
            });
        }
        drop(servers);
        drop(site);
    }
    if protect && !interrupted() {
        progress.start("process: 8 B latency beside a 64-QP hog, with and without latency_class");
        let r = super::protect::cell(&env, &plan, &interrupted);
        st.take(r, "latency beside a hog".into(), &progress);
        progress.done(protect_est);
    }
    if protect_hosts && !interrupted() {
        progress.start("hosts: 8 B latency across hosts beside a 64-QP hog, with and without latency_class");
        let r = super::protect::cell_hosts(&env, &plan, &interrupted);
        st.take(r, "latency beside a hog across hosts".into(), &progress);
        progress.done(protect_est);
    }
    progress.finish();
    Ok(Outcome {
        plan,
        run_id: run_id.to_string(),
        started: started.to_string(),
        seconds: start.elapsed().as_secs_f64(),
        records: st.records,
        failures: st.failures,
        sites,
        anchor_notes,
        vm_accel,
    })
}

/// An anchor's figure as a record.
#[allow(clippy::too_many_arguments)]
pub(super) fn anchor_record(
    placement: Placement,
    run: u32,
    section: Section,
    protocol: Protocol,
    tenants: u32,
    tool: &'static str,
    test: &str,
    size: u64,
    value: f64,
    unit: &'static str,
) -> Record {
    Record {
        section,
        placement,
        protocol,
        tenants,
        tenant: None,
        tool,
        test: test.to_string(),
        size,
        run,
        value,
        unit,
        bytes: None,
        seconds: None,
        average_us: None,
        p99_us: None,
    }
}

pub(super) struct State {
    pub records: Vec<Record>,
    pub failures: Vec<Failure>,
}

impl State {
    pub(super) fn take(&mut self, r: Result<Vec<Record>>, what: String, progress: &Progress) {
        match r {
            Ok(mut v) => self.records.append(&mut v),
            Err(e) => {
                progress.note(&format!("{what} failed: {e:#}"));
                self.failures.push(Failure { what, error: format!("{e:#}") });
            }
        }
    }
}

/// The vrdma executable the workers run. Tenant uids must reach it; if
/// some directory above it is closed to them, a copy in `work` is used.
fn worker_exe(work: &Path, as_uids: bool) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    if !as_uids || reachable_by_others(&exe) {
        return Ok(exe);
    }
    let copy = work.join("vrdma");
    std::fs::copy(&exe, &copy).with_context(|| format!("copying {} for the tenant uids", exe.display()))?;
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(copy)
}

/// Whether "others" may execute `file` and search every directory above it.
fn reachable_by_others(file: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| p.metadata().map(|m| m.permissions().mode()).unwrap_or(0);
    mode(file) & 0o005 == 0o005
        && file.ancestors().skip(1).all(|d| d.as_os_str().is_empty() || mode(d) & 0o001 != 0)
}

/// The library directory perftest runs with, if it can run.
fn perftest_lib(notes: &mut Vec<String>) -> Option<crate::cmd::run::LibDir> {
    if anchors::which("ib_write_bw").is_none() || anchors::which("ib_write_lat").is_none() {
        notes.push("perftest is not installed (apt-get install perftest): its anchor is left out".into());
        return None;
    }
    let lib = match crate::cmd::run::find_library() {
        Ok(l) => l,
        Err(e) => {
            notes.push(format!("perftest is left out: {e:#} (cargo build --release --workspace)"));
            return None;
        }
    };
    let Some(companions) = crate::cmd::run::find_companions().ok().flatten() else {
        notes.push(
            "perftest is left out: libvrdma_companions.so, which it needs to load, is not next to the vrdma \
             executable (cargo build --release --workspace)"
                .into(),
        );
        return None;
    };
    match crate::cmd::run::LibDir::create(&lib, Some(&companions)) {
        Ok(d) => Some(d),
        Err(e) => {
            notes.push(format!("perftest is left out: {e:#}"));
            None
        }
    }
}

/// A tenant's `vrdma bench --server` in its receiving place.
struct Server {
    addr: SocketAddr,
    _proc: Proc,
}

impl Server {
    fn start(env: &Env, plan: &Plan, site: &Site, tenant: u32) -> Result<Server> {
        let place = &site.receivers[tenant as usize];
        let mut cmd = Command::new(env.exe);
        cmd.args(["bench", "--server", "--listen", &SocketAddr::new(place.addr, 0).to_string()])
            .env(vrdma::SOCKET_ENV, &place.socket)
            .env("VRDMA_LOG", "warn");
        let name = format!("{} server {}", site.placement.name(), tenant + 1);
        let log = env.logs.join(format!("{}-server-{}.log", site.placement.name(), tenant + 1));
        let mut p = proc::spawn(&name, cmd, &place.at(plan.uid(tenant)), env.run_id, &log)?;
        let line = p.line(Duration::from_secs(20))?;
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| anyhow!("{name} said {line:?}"))?;
        Ok(Server { addr, _proc: p })
    }
}

/// A `vrdma bench` client in `place` as `uid`, against `server`.
pub(super) fn client(
    env: &Env,
    place: &Place,
    uid: Option<u32>,
    server: SocketAddr,
    args: &[String],
    name: &str,
) -> Result<Proc> {
    let mut cmd = Command::new(env.exe);
    cmd.arg("bench").arg(server.to_string()).args(args).arg("--json");
    cmd.env(vrdma::SOCKET_ENV, &place.socket).env("VRDMA_LOG", "warn");
    let log = env.logs.join(format!("{}.log", name.replace(' ', "-")));
    proc::spawn(name, cmd, &place.at(uid), env.run_id, &log)
}

/// The rows of a `vrdma bench --json` output.
pub(super) fn rows(out: &str) -> Result<Vec<serde_json::Value>> {
    let v: serde_json::Value = serde_json::from_str(out).context("vrdma bench's JSON")?;
    v["results"].as_array().cloned().ok_or_else(|| anyhow!("no results in vrdma bench's JSON"))
}

/// One run of a transfer cell: `n` tenants at once, together moving the
/// plan's bytes.
fn transfer(
    env: &Env,
    plan: &Plan,
    site: &Site,
    servers: &[Server],
    proto: Protocol,
    n: u32,
    run: u32,
) -> Result<Vec<Record>> {
    let args = transfer_args(plan, proto, n);
    let mut procs = Vec::new();
    for i in 0..n {
        let name = format!("{}-{}-x{n}-t{}-run{run}", site.placement.name(), proto.name(), i + 1);
        procs.push(client(
            env,
            &site.senders[i as usize],
            plan.uid(i),
            servers[i as usize].addr,
            &args,
            &name,
        )?);
    }
    // At 20 MB/s (far below any path here) plus the start.
    let limit = Duration::from_secs(60 + plan.bytes / 20_000_000);
    let mut per = Vec::new();
    for (out, exit) in proc::finish_all(procs, limit) {
        per.push(transfer_result(&out?, exit)?);
    }
    Ok(transfer_records(site.placement, proto, n, plan.message_size, run, &per))
}

/// A transfer client's arguments: tenant `n`'s share of the plan's bytes.
pub(super) fn transfer_args(plan: &Plan, proto: Protocol, n: u32) -> Vec<String> {
    let size = plan.message_size;
    let iters = (plan.bytes / u64::from(n) / size).max(1);
    [proto.transfer_test(), "--size", &size.to_string(), "--iters", &iters.to_string()]
        .map(String::from)
        .to_vec()
}

/// One tenant's transfer: (GB/s, bytes, seconds, when its client exited).
pub(super) type TenantResult = (f64, u64, f64, Instant);

/// A transfer client's `--json` output and exit time, read.
pub(super) fn transfer_result(out: &str, exit: Instant) -> Result<TenantResult> {
    let row = rows(out)?.into_iter().next().ok_or_else(|| anyhow!("no result row"))?;
    let bw = &row["bandwidth"];
    match (bw["gb_per_s"].as_f64(), bw["bytes"].as_u64(), bw["seconds"].as_f64()) {
        (Some(g), Some(b), Some(s)) => Ok((g, b, s, exit)),
        _ => bail!("no bandwidth in {row}"),
    }
}

/// A transfer cell's records: each tenant's (with several) and the cell's.
pub(super) fn transfer_records(
    placement: Placement,
    proto: Protocol,
    n: u32,
    size: u64,
    run: u32,
    per: &[TenantResult],
) -> Vec<Record> {
    let base = Record {
        section: Section::Transfer,
        placement,
        protocol: proto,
        tenants: n,
        tenant: None,
        tool: "vrdma bench",
        test: proto.transfer_test().to_string(),
        size,
        run,
        value: 0.0,
        unit: "GB/s",
        bytes: None,
        seconds: None,
        average_us: None,
        p99_us: None,
    };
    let mut out = Vec::new();
    if n > 1 {
        for (i, &(g, b, s, _)) in per.iter().enumerate() {
            out.push(Record {
                section: Section::Tenant,
                tenant: Some(i as u32 + 1),
                value: g,
                bytes: Some(b),
                seconds: Some(s),
                ..base.clone()
            });
        }
    }
    // The cell's bandwidth: all its bytes over the span from the first
    // start (an exit less its transfer time) to the last exit.
    let bytes: u64 = per.iter().map(|p| p.1).sum();
    let last = per.iter().map(|p| p.3).max().unwrap_or_else(Instant::now);
    let secs = per.iter().map(|p| (last - p.3).as_secs_f64() + p.2).fold(0.0, f64::max);
    let value = if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 };
    out.push(Record { value, bytes: Some(bytes), seconds: Some(secs), ..base });
    out
}

/// One run of the latency and bandwidth set, as tenant 1.
fn set(env: &Env, plan: &Plan, site: &Site, server: &Server, run: u32) -> Result<Vec<Record>> {
    let (send, uid) = (&site.senders[0], plan.uid(0));
    let (lat, bw) = set_args(plan);
    let limit = Duration::from_secs_f64(60.0 + 6.0 * plan.set_seconds);
    let name = format!("{}-set-lat-run{run}", site.placement.name());
    let lat_out = client(env, send, uid, server.addr, &lat, &name)?.finish(limit)?;
    let name = format!("{}-set-bw-run{run}", site.placement.name());
    let bw_out = client(env, send, uid, server.addr, &bw, &name)?.finish(limit)?;
    set_records(site.placement, run, &lat_out, &bw_out)
}

/// The latency set's client arguments and the bandwidth set's.
pub(super) fn set_args(plan: &Plan) -> (Vec<String>, Vec<String>) {
    let time = format!("{}", plan.set_seconds);
    let mut lat: Vec<String> = LATENCY_SET.iter().map(|t| t.0.to_string()).collect();
    lat.extend(["--time".into(), time.clone()]);
    let mut bw: Vec<String> = BANDWIDTH_SET.iter().map(|t| t.0.to_string()).collect();
    bw.extend(["--time".into(), time, "--size".into(), plan.message_size.to_string()]);
    (lat, bw)
}

/// The set's records from its two clients' `--json` outputs.
pub(super) fn set_records(
    placement: Placement,
    run: u32,
    lat_out: &str,
    bw_out: &str,
) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    for row in rows(lat_out)?.into_iter().chain(rows(bw_out)?) {
        let test = row["test"].as_str().unwrap_or("?").to_string();
        let proto = if test.starts_with("tcp") { Protocol::Tcp } else { Protocol::Vrdma };
        let size = row["size"].as_u64().unwrap_or(0);
        let base = Record {
            section: Section::Latency,
            placement,
            protocol: proto,
            tenants: 1,
            tenant: None,
            tool: "vrdma bench",
            test,
            size,
            run,
            value: 0.0,
            unit: "us",
            bytes: None,
            seconds: None,
            average_us: None,
            p99_us: None,
        };
        if let Some(l) = row["latency"].as_object() {
            let f = |k: &str| l.get(k).and_then(|v| v.as_f64());
            let median = f("median_us").ok_or_else(|| anyhow!("no median in {row}"))?;
            out.push(Record { value: median, average_us: f("average_us"), p99_us: f("p99_us"), ..base });
        } else if let Some(b) = row["bandwidth"].as_object() {
            let g = b.get("gb_per_s").and_then(|v| v.as_f64()).ok_or_else(|| anyhow!("no GB/s in {row}"))?;
            out.push(Record {
                section: Section::Bandwidth,
                value: g,
                unit: "GB/s",
                bytes: b.get("bytes").and_then(|v| v.as_u64()),
                seconds: b.get("seconds").and_then(|v| v.as_f64()),
                ..base
            });
        }
    }
    Ok(out)
}

/// What each step is expected to take, for the time left.
struct Estimates {
    setup: Duration,
    set: Duration,
    bytes: u64,
    secs: f64,
}

impl Estimates {
    fn new(plan: &Plan) -> Estimates {
        let set = Duration::from_secs_f64(6.0 * (plan.set_seconds + 0.2) + 0.6);
        Estimates { setup: Duration::from_millis(1500), set, bytes: plan.bytes, secs: plan.set_seconds }
    }

    fn transfer(&self, proto: Protocol, n: u32) -> Duration {
        let rate = match proto {
            Protocol::Vrdma => 4e9,
            Protocol::Tcp => 1.5e9,
        };
        Duration::from_secs_f64(0.3 + 0.1 * f64::from(n) + self.bytes as f64 / rate)
    }

    fn transfer_all(&self, plan: &Plan) -> Duration {
        Protocol::ALL
            .iter()
            .flat_map(|&p| plan.concurrency().into_iter().map(move |n| (p, n)))
            .map(|(p, n)| self.transfer(p, n))
            .sum()
    }

    fn anchors(&self, qperf: bool, iperf3: bool, perftest: bool) -> Duration {
        let mut s = 0.0;
        if qperf {
            s += 2.0 * (self.secs.ceil().max(1.0) + 0.4);
        }
        if iperf3 {
            s += 2.0 * (0.4 + self.bytes as f64 / 1.5e9);
        }
        if perftest {
            s += 1.0 + self.bytes as f64 / 4e9 + 1.5;
        }
        Duration::from_secs_f64(s)
    }
}
