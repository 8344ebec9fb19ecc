//! `vrdma bench-hosts`: vRDMA between two hosts beside TCP on the same
//! link, in one run.
//!
//! The two hosts are two network namespaces joined by a veth pair, one
//! vRDMA daemon in each, linked over the daemons' TCP transport (see
//! [`hosts`]). perftest runs through the drop-in library with its server
//! on host 1 and its client on host 2; the anchors run on the same pair:
//!
//! | figure | vRDMA | anchor | target |
//! |---|---|---|---|
//! | RDMA write 1 MiB, 1 QP | `ib_write_bw -s 1048576 -q 1` | `iperf3 -P 1` | ≥ 0.90× |
//! | RDMA write 1 MiB, 4 QPs | `ib_write_bw -s 1048576 -q 4` | `iperf3 -P 4` | ≥ 0.90× |
//! | RDMA write 8 B, one way | `ib_write_lat -s 8`, typical | `qperf tcp_lat -m 8` | ≤ 1.3× |
//! | the same | the same | a busy-polling TCP ping-pong ([`pingpong`]) | reference |
//! | rdma_cm setup, first of a run | create id to ESTABLISHED on both sides, QP included ([`cm_setup`]) | TCP connect + accept, first | ≤ 3× |
//! | rdma_cm setup, each of 100 in a row | the same, median | TCP connect + accept, median | ≤ 3× |
//! | rdma-core's `cmtime -c 1`, create id to ESTABLISHED | through the drop-in librdmacm, server on host 1 ([`cmtime`]) | TCP socket + connect, accepted | ≤ 3× |
//! | `cmtime -c 100` (20 `--quick`), the same per connection | the same | TCP in cmtime's phases, 100 together | ≤ 3× |
//! | `cmtime -c 100`, its connect step alone | the same | TCP's connect phase alone | ≤ 3× |
//! | TCP stream, carried by the sockets preload | `iperf3 -P 1` under `libvrdma_sockets.so` on both hosts | `iperf3 -P 1` | ≥ 2× |
//! | TCP 8 B, one way, carried | the busy-polling ping-pong under the preload | the same, plain TCP | ≤ 0.5× |
//!
//! Both latencies are one way (half a round trip), as the tools report
//! them. Beside each bandwidth figure the report gives what it cost in
//! CPU, per GB moved ([`cpu`]): where CPUs are to spare, what the
//! bandwidth hides. Each run measures every figure and its anchor in turn;
//! the table shows the medians over the runs and the ratio of the
//! medians. The connection setup figures come from one measurement per
//! run (the rdma_cm loop, then the TCP loop, between the same two
//! processes). Needs root (namespaces) and the tools `ip`, `iperf3`, `qperf`,
//! perftest, `cmtime` (`rdmacm-utils`).

pub mod cm_setup;
mod cmtime;
mod cpu;
mod hosts;
pub mod pingpong;
mod qos;
pub mod tcp_phases;
mod tools;

use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use serde::Serialize;

use crate::cmd::run::{check_build_id, find_companions, find_library, find_rdmacm, LibDir};
use cpu::CpuSample;
use hosts::Hosts;
use tools::Plan;

#[derive(clap::Args)]
pub struct Args {
    /// Runs; the table shows the median of each figure.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// One short run (for CI: under a minute in all).
    #[arg(long)]
    quick: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Also print each run's values (and the daemons' logs at info level).
    #[arg(long, short)]
    verbose: bool,
    /// A setting of both daemons' [engine] table, as in their TOML config
    /// (e.g. `--engine yield_us=0`, `--engine busy_poll=true`); repeatable.
    #[arg(long, value_name = "KEY=VALUE")]
    engine: Vec<String>,
    /// A setting of both daemons' [net] table (e.g. `--net
    /// max_queued_kib=64`); repeatable.
    #[arg(long, value_name = "KEY=VALUE")]
    net: Vec<String>,
    /// Measure instead a latency-class tenant's 8 B latency beside a
    /// 64-QP hog across hosts, with and without the class (each beside
    /// its unloaded figure), and the hog's throughput alone and beside.
    #[arg(long)]
    qos: bool,
    /// Measure only these figures (repeatable; default all).
    #[arg(long, value_name = "FIGURE", value_parser = ["write_bw_1qp", "write_bw_4qp", "write_lat_8b", "write_lat_8b_spin", "cm_setup_first", "cm_setup_each", "cmtime_c1", "cmtime_cn", "cmtime_connect", "sockets_stream", "sockets_lat_8b"])]
    only: Vec<String>,
}

/// What a figure is compared with, and how.
#[derive(Clone, Copy, PartialEq)]
enum Goal {
    /// vRDMA / anchor at least this (bandwidth).
    AtLeast(f64),
    /// vRDMA / anchor at most this (latency).
    AtMost(f64),
    /// No target: shown to read the others by.
    Reference,
}

struct Spec {
    key: &'static str,
    /// The programs this figure runs (besides `ip`, which every run needs).
    tools: [&'static str; 2],
    /// `{n}` stands for cmtime's connection count (see [`Spec::names`]).
    figure: &'static str,
    anchor: &'static str,
    unit: &'static str,
    goal: Goal,
}

impl Spec {
    /// The figure's and the anchor's names, `{n}` replaced by `conns`.
    fn names(&self, conns: usize) -> (String, String) {
        let n = conns.to_string();
        (self.figure.replace("{n}", &n), self.anchor.replace("{n}", &n))
    }
}

/// Connections in a row per connection setup measurement (as `vrdma bench
/// --cm-setup` and rdma-core's `cmtime` count them).
const CM_SETUP_COUNT: u32 = 100;

/// cmtime's connections for its `-c N` rows (`--quick`: fewer).
const CMTIME_COUNT: usize = 100;
const CMTIME_COUNT_QUICK: usize = 20;

const SPECS: [Spec; 11] = [
    Spec {
        key: "write_bw_1qp",
        tools: ["ib_write_bw", "iperf3"],
        figure: "RDMA write 1 MiB, 1 QP (ib_write_bw)",
        anchor: "iperf3, 1 stream",
        unit: "Gbit/s",
        goal: Goal::AtLeast(0.90),
    },
    Spec {
        key: "write_bw_4qp",
        tools: ["ib_write_bw", "iperf3"],
        figure: "RDMA write 1 MiB, 4 QPs (ib_write_bw -q 4)",
        anchor: "iperf3, 4 streams",
        unit: "Gbit/s",
        goal: Goal::AtLeast(0.90),
    },
    Spec {
        key: "write_lat_8b",
        tools: ["ib_write_lat", "qperf"],
        figure: "RDMA write 8 B, one way (ib_write_lat, typical)",
        anchor: "TCP ping-pong 8 B, one way (qperf tcp_lat)",
        unit: "us",
        goal: Goal::AtMost(1.3),
    },
    Spec {
        key: "write_lat_8b_spin",
        tools: ["ib_write_lat", "ip"],
        figure: "RDMA write 8 B, one way (ib_write_lat, typical)",
        anchor: "TCP ping-pong 8 B, one way, busy-polling (vrdma tcp-pingpong)",
        unit: "us",
        goal: Goal::Reference,
    },
    Spec {
        key: "cm_setup_first",
        tools: ["ip", "ip"],
        figure: "rdma_cm connect, create id to ESTABLISHED on both sides (QP included), first of a run",
        anchor: "TCP connect + accept, same pair, first",
        unit: "us",
        goal: Goal::AtMost(3.0),
    },
    Spec {
        key: "cm_setup_each",
        tools: ["ip", "ip"],
        figure: "rdma_cm connect, create id to ESTABLISHED on both sides, each of 100 in a row",
        anchor: "TCP connect + accept, same pair, each of 100",
        unit: "us",
        goal: Goal::AtMost(3.0),
    },
    // rdma-core's cmtime through the drop-in librdmacm ([`cmtime`]), as
    // `vrdma bench --cm-setup` runs it on one host.
    Spec {
        key: "cmtime_c1",
        tools: [cmtime::PROGRAM, "ip"],
        figure: "cmtime -c 1 (rdma-core, drop-in librdmacm): create id + resolve addr + resolve route + \
                 create qp + connect steps, one connection (a fresh process's first)",
        anchor: "TCP socket + non-blocking connect, accepted, same pair",
        unit: "us",
        goal: Goal::AtMost(3.0),
    },
    Spec {
        key: "cmtime_cn",
        tools: [cmtime::PROGRAM, "ip"],
        figure: "cmtime -c {n}: the same five steps, per connection of {n} issued together",
        anchor:
            "TCP: {n} sockets, then {n} non-blocking connects issued together, all accepted, per connection",
        unit: "us",
        goal: Goal::AtMost(3.0),
    },
    Spec {
        key: "cmtime_connect",
        tools: [cmtime::PROGRAM, "ip"],
        figure: "cmtime -c {n}: connect step alone ({n} rdma_connect to all ESTABLISHED at the client), \
                 per connection",
        anchor:
            "TCP: {n} non-blocking connects issued together to all connected and accepted, per connection",
        unit: "us",
        goal: Goal::AtMost(3.0),
    },
    // The sockets preload (docs/sockets.md): the same TCP programs, their
    // connections carried over vRDMA between the hosts, beside themselves
    // over the veth (issue 20's targets).
    Spec {
        key: "sockets_stream",
        tools: ["iperf3", "iperf3"],
        figure: "TCP stream carried by the sockets preload (iperf3 -P 1 under libvrdma_sockets.so)",
        anchor: "iperf3, 1 stream, plain TCP",
        unit: "Gbit/s",
        goal: Goal::AtLeast(2.0),
    },
    Spec {
        key: "sockets_lat_8b",
        tools: ["ip", "ip"],
        figure:
            "TCP ping-pong 8 B, one way, busy-polling, carried by the sockets preload (vrdma tcp-pingpong)",
        anchor: "the same, plain TCP",
        unit: "us",
        goal: Goal::AtMost(0.5),
    },
];

#[derive(Serialize, Clone, Copy)]
struct Pair {
    vrdma: f64,
    anchor: f64,
    /// Milliseconds of the whole machine's CPU time per GB moved
    /// (bandwidth figures only).
    vrdma_cpu_ms_per_gb: Option<f64>,
    anchor_cpu_ms_per_gb: Option<f64>,
}

impl Pair {
    fn latency(vrdma: f64, anchor: f64) -> Pair {
        Pair { vrdma, anchor, vrdma_cpu_ms_per_gb: None, anchor_cpu_ms_per_gb: None }
    }
}

#[derive(Serialize)]
struct Figure {
    key: &'static str,
    figure: String,
    anchor_name: String,
    unit: &'static str,
    /// Medians over the runs.
    vrdma: f64,
    anchor: f64,
    /// vrdma / anchor.
    ratio: f64,
    /// Medians of the runs' CPU cost (bandwidth figures), ms per GB.
    vrdma_cpu_ms_per_gb: Option<f64>,
    anchor_cpu_ms_per_gb: Option<f64>,
    target: String,
    /// None for a reference figure, which has no target.
    met: Option<bool>,
    runs: Vec<Pair>,
}

#[derive(Serialize)]
struct Report {
    runs: usize,
    quick: bool,
    bw_secs: u32,
    lat_secs: u32,
    lat_iters: u32,
    /// cmtime's `-c N`.
    cmtime_conns: usize,
    seconds: f64,
    /// The daemons' engine settings given with --engine, if any.
    engine: String,
    /// CPUs and how idle ones wait: what qperf's blocking ping-pong pays.
    machine: String,
    figures: Vec<Figure>,
}

/// "N CPUs, cpuidle <driver>/<governor>[, guest_halt_poll_ns=..]": a
/// blocking ping-pong (qperf) wakes sleeping CPUs, whose cost this names.
fn machine() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut m = format!("{cpus} CPUs");
    let base = "/sys/devices/system/cpu/cpuidle";
    match read(&format!("{base}/current_driver")) {
        Some(driver) => {
            let governor = read(&format!("{base}/current_governor"))
                .or_else(|| read(&format!("{base}/current_governor_ro")))
                .unwrap_or_else(|| "?".into());
            m.push_str(&format!(", cpuidle {driver}/{governor}"));
        }
        None => m.push_str(", no cpuidle driver"),
    }
    if let Some(ns) = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns") {
        m.push_str(&format!(", guest_halt_poll_ns={ns}"));
    }
    m
}

pub fn run(args: Args) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "vrdma bench-hosts needs root: it creates network namespaces and a veth pair (run it with sudo)"
        );
    }
    let needed: Vec<&str> = std::iter::once("ip").chain(selected(&args.only).flat_map(|s| s.tools)).collect();
    let missing = tools::missing_tools(&needed);
    if !missing.is_empty() {
        bail!("vrdma bench-hosts needs tools that are missing: {}", missing.join(", "));
    }
    if args.qos {
        return run_qos(&args);
    }
    let lib = find_library()?;
    let Some(companions) = find_companions()? else {
        bail!(
            "libvrdma_companions.so not found next to the vrdma executable; perftest needs it \
             (cargo build --release -p vrdma-companions, or name it with VRDMA_COMPANIONS_LIB)"
        );
    };
    let (runs, plan) = if args.quick {
        (1, Plan { bw_secs: 2, lat_secs: 2, lat_iters: 2000, cm_conns: CMTIME_COUNT_QUICK })
    } else {
        if args.runs == 0 {
            bail!("--runs must be at least 1");
        }
        (args.runs, Plan { bw_secs: 5, lat_secs: 5, lat_iters: 20000, cm_conns: CMTIME_COUNT })
    };
    hosts::catch_interrupts();
    // The sockets figures' library, as `vrdma run --sockets` finds it.
    let sockets = if selected(&args.only).any(|s| s.key.starts_with("sockets_")) {
        Some(crate::cmd::run::find_sockets()?)
    } else {
        None
    };
    let libs = LibDir::create(&lib, Some(&companions))?;
    // cmtime's rows: the drop-in librdmacm beside libibverbs, both of
    // this build (as `vrdma run` checks them).
    if selected(&args.only).any(|s| s.key.starts_with("cmtime_")) {
        let cm = find_rdmacm()?.context(
            "the drop-in librdmacm (libvrdma_rdmacm.so) is not next to the vrdma executable; cmtime's rows \
             need it (cargo build -p vrdma-verbs -p vrdma-rdmacm, with the same profile, or name it with \
             VRDMA_RDMACM_LIB)",
        )?;
        check_build_id(&lib)?;
        check_build_id(&cm)?;
        libs.add_rdmacm(&cm)?;
    }
    let start = Instant::now();
    let result = measure(libs, sockets.as_deref(), runs, plan, &args);
    if hosts::interrupted() {
        eprintln!("vrdma bench-hosts: interrupted; namespaces and processes removed");
        std::process::exit(130);
    }
    let samples = result?;
    let engine = args.engine.join(", ");
    let figures: Vec<Figure> = selected(&args.only)
        .zip(samples)
        .map(|(s, runs)| {
            let vrdma = median(runs.iter().map(|p| p.vrdma).collect());
            let anchor = median(runs.iter().map(|p| p.anchor).collect());
            let ratio = vrdma / anchor;
            let cpu = |f: fn(&Pair) -> Option<f64>| {
                let v: Vec<f64> = runs.iter().filter_map(f).collect();
                (!v.is_empty()).then(|| median(v))
            };
            let (vrdma_cpu_ms_per_gb, anchor_cpu_ms_per_gb) =
                (cpu(|p| p.vrdma_cpu_ms_per_gb), cpu(|p| p.anchor_cpu_ms_per_gb));
            let (met, target) = match s.goal {
                Goal::AtLeast(t) => (Some(ratio >= t), format!(">= {t:.2}x")),
                Goal::AtMost(t) => (Some(ratio <= t), format!("<= {t:.2}x")),
                Goal::Reference => (None, "reference".to_string()),
            };
            let (figure, anchor_name) = s.names(plan.cm_conns);
            Figure {
                key: s.key,
                figure,
                anchor_name,
                unit: s.unit,
                vrdma,
                anchor,
                ratio,
                vrdma_cpu_ms_per_gb,
                anchor_cpu_ms_per_gb,
                target,
                met,
                runs,
            }
        })
        .collect();
    let report = Report {
        runs,
        quick: args.quick,
        bw_secs: plan.bw_secs,
        lat_secs: plan.lat_secs,
        lat_iters: plan.lat_iters,
        cmtime_conns: plan.cm_conns,
        seconds: start.elapsed().as_secs_f64(),
        engine,
        machine: machine(),
        figures,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report, args.verbose));
    }
    Ok(())
}

/// `--qos`: the latency-beside-a-hog figures, without and with the class.
fn run_qos(args: &Args) -> Result<()> {
    if !crate::bench::attack::may_switch_uid() {
        bail!("vrdma bench-hosts --qos runs the hog as uid 65534: it needs root");
    }
    let lib = find_library()?;
    let (runs, iters, window) = if args.quick {
        (1, 2000, std::time::Duration::from_millis(500))
    } else {
        (args.runs.max(1), 20000, std::time::Duration::from_secs(1))
    };
    hosts::catch_interrupts();
    let mut classes = Vec::new();
    for (class, protected) in [("\"normal\"", false), ("\"latency\"", true)] {
        eprintln!("latency_class = {class}: two namespaces, a daemon each; {runs} run(s) ...");
        let r = qos::measure(&lib, &args.engine, &args.net, protected, runs, iters, window, args.verbose);
        if hosts::interrupted() {
            eprintln!("vrdma bench-hosts: interrupted; namespaces and processes removed");
            std::process::exit(130);
        }
        let r = r?;
        if args.verbose {
            for (i, x) in r.iter().enumerate() {
                eprintln!("  run {}: {x:?}", i + 1);
            }
        }
        classes.push((class, r));
    }
    print!("{}", qos::render(&classes));
    Ok(())
}

/// The figures `--only` names, in table order; all when it names none.
fn selected(only: &[String]) -> impl Iterator<Item = &'static Spec> + '_ {
    SPECS.iter().filter(move |s| only.is_empty() || only.iter().any(|o| o == s.key))
}

/// Sets up the hosts and takes `runs` runs; per selected figure, one pair
/// per run.
fn measure(
    lib: LibDir,
    sockets: Option<&std::path::Path>,
    runs: usize,
    plan: Plan,
    args: &Args,
) -> Result<Vec<Vec<Pair>>> {
    let say = |s: &str| {
        if !args.json || args.verbose {
            eprintln!("{s}");
        }
    };
    say("setting up two namespaces joined by a veth pair, a vRDMA daemon in each ...");
    let mut h = Hosts::create(lib, &args.engine, &args.net, args.verbose)?;
    say(&format!(
        "hosts {} ({}) and {} ({}) linked; {} run(s)",
        h.hosts[0].ns, h.hosts[0].addr, h.hosts[1].ns, h.hosts[1].addr, runs
    ));
    let specs: Vec<&Spec> = selected(&args.only).collect();
    let mut out = vec![Vec::new(); specs.len()];
    let mut stalls = Vec::new();
    for r in 0..runs {
        let mut line = Vec::new();
        // ib_write_lat once per run, for both latency anchors; one
        // connection setup measurement for both of its figures.
        let mut lat: Option<f64> = None;
        let mut setup: Option<[(f64, f64); 2]> = None;
        // One cmtime measurement (-c 1 and -c N) for its three figures.
        let mut cmtime: Option<[(f64, f64); 3]> = None;
        for (spec, v) in specs.iter().zip(out.iter_mut()) {
            let p = match spec.key {
                "write_bw_1qp" => bandwidth(&mut h, 1, plan.bw_secs)?,
                "write_bw_4qp" => bandwidth(&mut h, 4, plan.bw_secs)?,
                "sockets_stream" | "sockets_lat_8b" => {
                    let lib = sockets.context("the sockets library")?;
                    sockets_pair(&mut h, lib, spec.key == "sockets_stream", plan)?
                }
                "write_lat_8b" => {
                    let anchor = tools::tcp_lat(&mut h, plan.lat_secs)?;
                    Pair::latency(cached(&mut lat, || tools::write_lat(&mut h, plan.lat_iters))?, anchor)
                }
                "cm_setup_first" | "cm_setup_each" => {
                    let [cm, tcp] = match setup {
                        Some(s) => s,
                        None => *setup.insert(tools::cm_setup(&mut h, CM_SETUP_COUNT)?),
                    };
                    if spec.key == "cm_setup_first" {
                        Pair::latency(cm.0, tcp.0)
                    } else {
                        Pair::latency(cm.1, tcp.1)
                    }
                }
                "cmtime_c1" | "cmtime_cn" | "cmtime_connect" => {
                    let three = match cmtime {
                        Some(c) => c,
                        None => *cmtime.insert(cmtime::measure(&mut h, plan.cm_conns)?),
                    };
                    let (v, a) = match spec.key {
                        "cmtime_c1" => three[0],
                        "cmtime_cn" => three[1],
                        _ => three[2],
                    };
                    Pair::latency(v, a)
                }
                _ => {
                    let anchor = tools::spin_lat(&mut h, plan.lat_iters)?;
                    Pair::latency(cached(&mut lat, || tools::write_lat(&mut h, plan.lat_iters))?, anchor)
                }
            };
            line.push(format!("{} {:.2} (anchor {:.2}) {}", spec.key, p.vrdma, p.anchor, spec.unit));
            if p.vrdma <= 0.0 {
                stalls.push(format!("run {}: {}", r + 1, spec.key));
            }
            v.push(p);
        }
        say(&format!("run {}: {}", r + 1, line.join(", ")));
    }
    // perftest reports 0 when no completion came within its sample window:
    // the transfer stalled for seconds. Kept in the figures (a median of
    // several runs shrugs off one), and said loudly, never hidden.
    for s in &stalls {
        eprintln!("WARNING: {s}: vRDMA moved nothing within the sample window (a stall)");
    }
    Ok(out)
}

/// iperf3 and ib_write_bw with `streams` streams and QPs, each with the
/// machine's CPU use over its middle.
fn bandwidth(h: &mut Hosts, streams: u32, secs: u32) -> Result<Pair> {
    let sample = CpuSample::start(secs);
    let anchor = tools::iperf3(h, streams, secs)?;
    let anchor_cpu_ms_per_gb = sample.ms_per_gb(anchor);
    let sample = CpuSample::start(secs);
    let vrdma = tools::write_bw(h, streams, secs)?;
    Ok(Pair { vrdma, anchor, vrdma_cpu_ms_per_gb: sample.ms_per_gb(vrdma), anchor_cpu_ms_per_gb })
}

/// A sockets figure and its anchor, the same program over plain TCP, in
/// turn: iperf3's stream (`stream`, with the CPU each cost) or the
/// busy-polling 8-byte ping-pong.
fn sockets_pair(h: &mut Hosts, lib: &std::path::Path, stream: bool, plan: Plan) -> Result<Pair> {
    if !stream {
        let anchor = tools::spin_lat(h, plan.lat_iters)?;
        return Ok(Pair::latency(tools::sockets_lat(h, lib, plan.lat_iters)?, anchor));
    }
    let secs = plan.bw_secs;
    let sample = CpuSample::start(secs);
    let anchor = tools::iperf3(h, 1, secs)?;
    let anchor_cpu_ms_per_gb = sample.ms_per_gb(anchor);
    let sample = CpuSample::start(secs);
    let vrdma = tools::sockets_iperf3(h, lib, secs)?;
    Ok(Pair { vrdma, anchor, vrdma_cpu_ms_per_gb: sample.ms_per_gb(vrdma), anchor_cpu_ms_per_gb })
}

/// The value in `slot`, measured by `f` the first time.
fn cached(slot: &mut Option<f64>, f: impl FnOnce() -> Result<f64>) -> Result<f64> {
    match *slot {
        Some(v) => Ok(v),
        None => Ok(*slot.insert(f()?)),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn value(x: f64, unit: &str) -> String {
    match unit {
        "us" => format!("{x:.2} µs"),
        u => format!("{x:.2} {u}"),
    }
}

fn render(r: &Report, verbose: bool) -> String {
    let mut rows = vec![[
        "figure".to_string(),
        "vRDMA".to_string(),
        "anchor".to_string(),
        "".to_string(),
        "ratio".to_string(),
        "target".to_string(),
        "".to_string(),
    ]];
    for f in &r.figures {
        rows.push([
            f.figure.to_string(),
            value(f.vrdma, f.unit),
            f.anchor_name.to_string(),
            value(f.anchor, f.unit),
            format!("{:.2}x", f.ratio),
            f.target.clone(),
            match f.met {
                None => "",
                Some(true) => "met",
                Some(false) => "NOT met",
            }
            .to_string(),
        ]);
    }
    let mut width = [0usize; 7];
    for row in &rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = format!(
        "vRDMA between two hosts (network namespaces, one veth pair, a daemon each) beside TCP on the same pair\n\
         {} run(s), median shown; bandwidth {} s per figure, tcp_lat {} s, ib_write_lat {} iterations; {:.0} s in all\n\n",
        r.runs, r.bw_secs, r.lat_secs, r.lat_iters, r.seconds
    );
    out.insert_str(out.len() - 1, &format!("machine: {}\n", r.machine));
    if !r.engine.is_empty() {
        out.insert_str(out.len() - 1, &format!("daemons' engine: {}\n", r.engine));
    }
    for row in &rows {
        let cells: Vec<String> =
            row.iter().zip(width).map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count()))).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    let costs: Vec<String> = r
        .figures
        .iter()
        .filter_map(|f| {
            let (v, a) = (f.vrdma_cpu_ms_per_gb?, f.anchor_cpu_ms_per_gb?);
            Some(format!("  {}: vRDMA {v:.0}, {} {a:.0} ({:.2}x)\n", f.figure, f.anchor_name, v / a))
        })
        .collect();
    if !costs.is_empty() {
        out.push_str(
            "\nCPU per GB moved, ms (the whole machine's busy time over the middle of each measurement):\n",
        );
        out.push_str(&costs.concat());
    }
    if verbose {
        out.push_str("\nper run (vRDMA / anchor):\n");
        for f in &r.figures {
            let each: Vec<String> = f
                .runs
                .iter()
                .map(|p| format!("{} / {}", value(p.vrdma, f.unit), value(p.anchor, f.unit)))
                .collect();
            out.push_str(&format!("  {}: {}\n", f.key, each.join(", ")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_line_names_the_cpus_and_the_idle_driver() {
        let m = machine();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert!(m.starts_with(&format!("{cpus} CPUs, ")), "{m}");
        assert!(m.contains("cpuidle ") || m.contains("no cpuidle driver"), "{m}");
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }

    #[test]
    fn every_figure_names_tools_the_benchmark_knows() {
        for s in &SPECS {
            for t in s.tools {
                assert!(tools::TOOLS.iter().any(|k| k.program == t), "{}: unknown tool {t}", s.key);
            }
        }
        // A latency-only run does not ask for the bandwidth tools.
        let lat: Vec<&str> = selected(&["write_lat_8b".to_string()]).flat_map(|s| s.tools).collect();
        assert_eq!(lat, ["ib_write_lat", "qperf"]);
    }

    #[test]
    fn only_selects_figures_in_table_order() {
        let keys = |only: &[&str]| {
            let only: Vec<String> = only.iter().map(|s| s.to_string()).collect();
            selected(&only).map(|s| s.key).collect::<Vec<_>>()
        };
        assert_eq!(
            keys(&[]),
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
            ]
        );
        assert_eq!(keys(&["write_lat_8b", "write_bw_1qp"]), ["write_bw_1qp", "write_lat_8b"]);
    }
}
