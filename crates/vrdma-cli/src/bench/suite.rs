//! The default report (`vrdma bench` without test names): vRDMA's latency
//! and bandwidth on this host, each figure beside the anchor it should be
//! read against, measured in the same run.
//!
//! Absolute numbers drift between machines and runs; the ratio to a raw
//! shared-memory ping-pong (for latency) and to memcpy (for bandwidth) is
//! what transfers. Each vRDMA test runs between two worker processes, as
//! real RDMA programs do, so the figures include the cross-process
//! handoffs through the engine.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{Deserialize, Serialize};

use super::path::{self, Path};
use super::worker::{self, Role};
use super::{anchors, attack, cm_setup, report, verbs, Args};

/// One figure: vRDMA's value, its anchor and their ratio.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub name: String,
    pub unit: &'static str,
    pub value: anchors::Stat,
    pub anchor_name: String,
    pub anchor: Option<anchors::Stat>,
    /// value / anchor (latency: lower is better; bandwidth: higher is better).
    pub ratio: Option<f64>,
    pub target: String,
    pub cores: usize,
    /// Latency only: the 99th percentile over every sample of every run.
    pub p99: Option<f64>,
    /// The row failed: why (printed in its place; the report goes on and
    /// `vrdma bench` exits non-zero at its end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Figure {
    /// A figure beside its anchor measured in the same run, with the
    /// ratio of their medians.
    pub fn beside(
        name: impl Into<String>,
        unit: &'static str,
        value: anchors::Stat,
        anchor_name: impl Into<String>,
        anchor: anchors::Stat,
        target: impl Into<String>,
        cores: usize,
    ) -> Figure {
        Figure {
            name: name.into(),
            unit,
            ratio: Some(value.median / anchor.median),
            value,
            anchor_name: anchor_name.into(),
            anchor: Some(anchor),
            target: target.into(),
            cores,
            p99: None,
            error: None,
        }
    }

    /// A row that could not be measured: `error` in place of its figures.
    pub fn failed(name: impl Into<String>, error: &anyhow::Error, cores: usize) -> Figure {
        Figure {
            name: name.into(),
            unit: "ns",
            value: anchors::Stat::from_samples(&[]),
            anchor_name: String::new(),
            anchor: None,
            ratio: None,
            target: String::new(),
            cores,
            p99: None,
            error: Some(format!("{error:#}")),
        }
    }
}

/// `got`'s value, or, if it failed, `None` with a failed row named `name`
/// pushed to `figures` (the report goes on; `report::print` then fails).
pub(super) fn row<T>(figures: &mut Vec<Figure>, name: &str, cores: usize, got: Result<T>) -> Option<T> {
    match got {
        Ok(v) => Some(v),
        Err(e) => {
            figures.push(Figure::failed(name, &e, cores));
            None
        }
    }
}

/// What a worker reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Outcome {
    /// Latency samples: one way (half a round trip) for the ping-pongs,
    /// the whole operation for reads.
    pub lat_ns: Vec<f64>,
    pub bytes: u64,
    pub seconds: f64,
    pub messages: u64,
    /// How many of the client QP's work requests its library carried on
    /// the direct path (`QueuePair::direct_stats`), warm-up included for
    /// the latency tests, excluded for the streams (a warm-up carried
    /// made up for timed WRs that were not): the proof of which path a
    /// figure measured (`bench/path.rs`).
    #[serde(default)]
    pub carried: u64,
}

pub fn run(socket: Option<PathBuf>, args: &Args) -> Result<()> {
    let runs = args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.vm {
        let progress = |what: &str| {
            if !args.json {
                eprintln!("{what} ...");
            }
        };
        let figures = super::vm::figures(args, runs, cores, &progress)?;
        return report::print(&figures, &[], None, args.json);
    }
    if args.migrate {
        let progress = |what: &str| {
            if !args.json {
                eprintln!("{what} ...");
            }
        };
        let out = super::migrate::figures(runs, cores, &progress);
        report::print(&out.figures, &out.skipped, None, args.json)?;
        if let Some(fault) = out.fault {
            bail!("the migration bench ended early: {fault}");
        }
        return Ok(());
    }
    if args.sockets {
        let progress = |what: &str| {
            if !args.json {
                eprintln!("measuring {what} ...");
            }
        };
        let lib = super::sockets::library()?;
        let figures =
            super::sockets::figures(&super::engine_config(args), &lib, args.quick, runs, cores, &progress)?;
        return report::print(&figures, &[], None, args.json);
    }
    let device = crate::embedded::device(socket, super::engine_config(args))?;
    let sock = device.socket().to_owned();
    let (lat_iters, bw_bytes) = if args.quick { (5_000u64, 1u64 << 30) } else { (20_000, 4 << 30) };
    let anchor_time = Duration::from_millis(if args.quick { 300 } else { 1000 });

    let progress = |what: &str| {
        if !args.json {
            eprintln!("measuring {what} ...");
        }
    };
    let mut figures = Vec::new();
    if args.cm_setup {
        progress("rdma_cm connection setup, and TCP connect/accept");
        let n = if args.quick { 20 } else { 100 };
        figures.extend(cm_setup_figures(&sock, n, runs, cores)?);
        let mut skipped = Vec::new();
        cmtime_figures(&sock, n, runs, cores, &progress, &mut figures, &mut skipped);
        drop(device);
        return report::print(&figures, &skipped, None, args.json);
    }

    let qos_plan = super::qos::Plan {
        runs,
        window: Duration::from_millis(if args.quick { 300 } else { 1000 }),
        lat_iters: if args.quick { 1_000 } else { 2_000 },
        cores,
    };
    let qos_group = "tenant QoS: fairness, weights, a rate limit, a latency class beside a hog";
    let qos_figures = |figures: &mut Vec<Figure>, skipped: &mut Vec<report::Skipped>| {
        let skip = |reason: String| report::Skipped { figures: qos_group.into(), reason };
        if !attack::may_switch_uid() {
            let why = format!(
                "needs root, to run tenants as uids {} and below (a tenant is a uid)",
                attack::NOBODY
            );
            skipped.push(skip(why));
            return;
        }
        match super::qos::figures(&super::engine_config(args), &qos_plan, &progress) {
            Ok(f) => figures.extend(f),
            Err(e) => skipped.push(skip(format!("{e:#}"))),
        }
    };
    if args.qos {
        let mut skipped = Vec::new();
        qos_figures(&mut figures, &mut skipped);
        drop(device);
        return report::print(&figures, &skipped, None, args.json);
    }
    let attack_figures = |figures: &mut Vec<Figure>, skipped: &mut Vec<report::Skipped>| {
        let cases = attack::cases(if args.quick { 1000 } else { 3000 });
        let group =
            format!("send 8 B, one way (poll CQ), beside a tenant that misbehaves ({} figures)", cases.len());
        if !attack::may_switch_uid() {
            let reason = format!(
                "needs root, to run the other tenant as uid {} (a tenant is a uid; our own uid would be one tenant)",
                attack::NOBODY
            );
            skipped.push(report::Skipped { figures: group, reason });
            return;
        }
        // A daemon of the group's own with the direct path off: the
        // victim's two QPs are of one tenant on one host, which the
        // default path would carry without the engine, whose pass over
        // the tenants is what these attacks aim at. A daemon that refuses
        // the other tenant (its max_tenants reached, say) costs this
        // group, not the report.
        let dev = match crate::embedded::private_device(super::engine_config(args), false) {
            Ok(d) => d,
            Err(e) => {
                skipped.push(report::Skipped { figures: group, reason: format!("{e:#}") });
                return;
            }
        };
        match beside_attacks(dev.socket(), &cases, lat_iters, runs, cores, &progress) {
            Ok(f) => figures.extend(f),
            Err(e) => skipped.push(report::Skipped { figures: group, reason: format!("{e:#}") }),
        }
    };
    if args.attacks {
        let mut skipped = Vec::new();
        attack_figures(&mut figures, &mut skipped);
        drop(device);
        return report::print(&figures, &skipped, None, args.json);
    }
    if args.direct_bw {
        let bw = super::direct_bw::figures(args, runs, cores, &progress);
        let bw = row(&mut figures, "direct path bandwidth rows", cores, bw);
        figures.extend(bw.unwrap_or_default());
        drop(device);
        return report::print(&figures, &[], None, args.json);
    }
    progress("shared-memory ping-pong anchor");
    let pingpong = anchors::shm_pingpong_one_way_ns(anchor_time, runs, None).ok();
    if args.direct || args.direct_lat {
        direct_figures(&mut figures, args, pingpong, lat_iters, runs, cores, &progress);
        drop(device);
        return report::print(&figures, &[], None, args.json);
    }
    // Each row below that fails prints its error in its place and the
    // report goes on (rows read against a failed one lose their anchor).
    let write_name = "RDMA write 8 B, one way (poll on memory)";
    progress("8 B RDMA write latency (memory polling)");
    let write_lat =
        row(&mut figures, write_name, cores, measure(&sock, worker::Test::WriteLat, 8, lat_iters, runs));
    if let Some(lat) = &write_lat {
        figures.push(latency(write_name, lat.clone(), "2-process shm ping-pong", pingpong, cores));
    }
    direct_figures(&mut figures, args, pingpong, lat_iters, runs, cores, &progress);
    let send_name = "send 8 B, one way (poll CQ)";
    progress("8 B send latency (CQ polling)");
    let send_lat =
        row(&mut figures, send_name, cores, measure(&sock, worker::Test::SendLat, 8, lat_iters, runs));
    let send_stat = send_lat.as_deref().map(median_of);
    if let Some(lat) = send_lat {
        figures.push(latency(send_name, lat, "2-process shm ping-pong", pingpong, cores));
    }
    let idle_n = if args.quick { 1024 } else { 4096 };
    progress(&format!("8 B send latency with up to {idle_n} idle QPs on the device"));
    let idle_name = format!("send 8 B, one way (poll CQ), up to {idle_n} idle QPs");
    let crowded = (|| {
        let idle = super::idle::IdleQps::create_up_to(&sock, idle_n)?;
        let lat = measure(&sock, worker::Test::SendLat, 8, lat_iters, runs)?;
        Ok((idle.len(), lat))
    })();
    if let Some((n, crowded)) = row(&mut figures, &idle_name, cores, crowded) {
        let mut f = latency(
            &format!("send 8 B, one way (poll CQ), {n} idle QPs"),
            crowded,
            "send 8 B, poll CQ, no idle QPs",
            send_stat,
            cores,
        );
        f.target = "<= 1.2x without them".into();
        figures.push(f);
    }
    let mut skipped = Vec::new();
    attack_figures(&mut figures, &mut skipped);
    qos_figures(&mut figures, &mut skipped);
    progress("8 B send latency (completion channel)");
    let event_name = "send 8 B, one way (completion channel)";
    let event_lat = measure(&sock, worker::Test::SendLatEvent, 8, lat_iters / 4, runs);
    if let Some(lat) = row(&mut figures, event_name, cores, event_lat) {
        figures.push(latency(event_name, lat, "send 8 B, poll CQ", send_stat, cores));
    }
    progress("rdma_cm connection setup, and TCP connect/accept");
    let cm_n = if args.quick { 20 } else { 100 };
    let cm = cm_setup_figures(&sock, cm_n, runs, cores);
    let cm = row(&mut figures, "rdma_cm connection setup", cores, cm);
    figures.extend(cm.unwrap_or_default());
    cmtime_figures(&sock, cm_n, runs, cores, &progress, &mut figures, &mut skipped);
    progress("8 B RDMA read latency (CQ polling)");
    let read_name = "RDMA read 8 B, whole read (poll CQ)";
    let read_lat =
        row(&mut figures, read_name, cores, measure(&sock, worker::Test::ReadLat, 8, lat_iters, runs));
    let mut own = verbs::Own {
        write_lat_ns: write_lat.as_deref().map(|l| median_of(l).median),
        send_lat_ns: send_stat.map(|s| s.median),
        ..Default::default()
    };
    if let Some(lat) = read_lat {
        // A read is a round trip: read it against the ping-pong's round trip.
        let round_trip = pingpong.map(|p| anchors::Stat {
            median: 2.0 * p.median,
            min: 2.0 * p.min,
            max: 2.0 * p.max,
            ..p
        });
        let f = latency(read_name, lat, "2-process shm ping-pong, round trip", round_trip, cores);
        own.read_lat_ns = Some(f.value.median);
        figures.push(f);
    }
    let bw_tests = [
        (worker::Test::WriteBw, "RDMA write", 64usize << 10),
        (worker::Test::ReadBw, "RDMA read", 64 << 10),
        (worker::Test::SendBw, "send", 64 << 10),
        (worker::Test::WriteBw, "RDMA write", 1 << 20),
    ];
    let mut memcpy = std::collections::HashMap::new();
    for (test, what, size) in bw_tests {
        progress(&format!("{} {what} bandwidth", human(size)));
        let name = format!("{what} {} bandwidth", human(size));
        let iters = (bw_bytes / size as u64).max(16);
        let Some(bw) = row(&mut figures, &name, cores, measure(&sock, test, size, iters, runs)) else {
            continue;
        };
        let anchor =
            *memcpy.entry(size).or_insert_with(|| anchors::memcpy_bandwidth(size, anchor_time, runs));
        let f = bandwidth(&name, bw, anchor, cores);
        if size == 64 << 10 {
            let v = Some(f.value.median);
            match test {
                worker::Test::WriteBw => own.write_bw_gbs = v,
                worker::Test::ReadBw => own.read_bw_gbs = v,
                _ => own.send_bw_gbs = v,
            }
        }
        figures.push(f);
    }
    progress("the same tests through perftest and qperf on the drop-in libibverbs.so.1");
    let tools = verbs::compare(&sock, &own, args.quick, !args.json);
    drop(device);
    report::print(&figures, &skipped, Some(&tools), args.json)
}

/// Connection setup through rdma_cm, `n` connections in a row per run,
/// beside TCP's connect and accept on loopback in the same runs: the
/// first connection of a run, and each of the rest (median).
fn cm_setup_figures(sock: &std::path::Path, n: usize, runs: usize, cores: usize) -> Result<Vec<Figure>> {
    let (mut cm_first, mut cm_each, mut tcp_first, mut tcp_each) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let cm = cm_setup::rdma_cm(sock, n)?;
        let tcp = cm_setup::tcp(n)?;
        cm_first.push(cm.first.as_nanos() as f64);
        cm_each.push(cm.each.median);
        tcp_first.push(tcp.first.as_nanos() as f64);
        tcp_each.push(tcp.each.median);
    }
    let figure = |name: String, value: &[f64], anchor_name: &str, anchor: &[f64]| {
        let (value, anchor) = (anchors::Stat::from_samples(value), anchors::Stat::from_samples(anchor));
        Figure::beside(name, "ns", value, anchor_name, anchor, "<= 3x TCP", cores)
    };
    Ok(vec![
        figure(
            "rdma_cm connect, create id to ESTABLISHED on both sides (QP included), first of a run".into(),
            &cm_first,
            "TCP connect + accept, loopback, first",
            &tcp_first,
        ),
        figure(
            format!("rdma_cm connect, create id to ESTABLISHED on both sides, each of {n} in a row"),
            &cm_each,
            &format!("TCP connect + accept, loopback, each of {n}"),
            &tcp_each,
        ),
    ])
}

/// rdma-core's `cmtime` through the drop-in librdmacm beside TCP in its
/// phases ([`super::cmtime`]), or why not (not installed, the drop-in
/// libraries not built).
fn cmtime_figures(
    sock: &std::path::Path,
    n: usize,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
    figures: &mut Vec<Figure>,
    skipped: &mut Vec<report::Skipped>,
) {
    match super::cmtime::figures(sock, n, runs, cores, progress) {
        Ok(f) => figures.extend(f),
        Err(reason) => skipped.push(report::Skipped {
            figures: "rdma-core's cmtime through the drop-in librdmacm, beside TCP in its phases".into(),
            reason: format!("skipped: {reason}"),
        }),
    }
}

/// The victim's 8 B send latency beside each of `cases`, a fresh attacker
/// per run (so that each run sees the attack from its start, and a
/// scribbler's closed context is not the next run's), each run right
/// after one without the attacker: the anchor of a case is the median of
/// its own unloaded runs, so that a machine whose latency drifts between
/// modes (2.3 and 6.6 µs were both seen in one report on 2 cores) is
/// compared with itself. At least three runs a case, also with `--quick`:
/// one unloaded run read against one attacked run gave ratios from 0.5x
/// to 3.7x for the same attack from one report to the next.
fn beside_attacks(
    sock: &std::path::Path,
    cases: &[attack::Case],
    iters: u64,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) -> Result<Vec<Figure>> {
    let runs = runs.max(3);
    let mut figures = Vec::new();
    for case in cases {
        progress(&case.name(case.qps as usize).replace("send 8 B, one way (poll CQ)", "8 B send latency"));
        // Beside an attack, as many round trips as unloaded: a window of
        // 50 ms (--quick) to 200 ms, so that what the engine does now and
        // then (its 100 ms sweep) falls in it. Beside the hog, where a
        // round trip may take a millisecond, 2000 give a steady median
        // without taking the report into minutes.
        let iters = if case.how == attack::How::Stream { iters.min(2_000) } else { iters };
        let (mut outcomes, mut unloaded, mut held, mut kept) = (Vec::new(), Vec::new(), 0, 0);
        for _ in 0..runs {
            unloaded.push(measure_once(sock, worker::Test::SendLat, 8, iters)?);
            let other = attack::Attacker::start(sock, case.how, case.qps)?;
            held = other.qps;
            // Let the attack take hold (and the daemon find a scribbled ring).
            std::thread::sleep(Duration::from_millis(100));
            outcomes.push(measure_once(sock, worker::Test::SendLat, 8, iters)?);
            if case.how == attack::How::Scribble && !other.closed_within(Duration::from_secs(5)) {
                kept += 1;
            }
            other.stop();
        }
        let mut name = case.name(held);
        if kept > 0 {
            // A figure, but not of the attack it names: say so.
            name.push_str(&format!(" (the daemon did not close its context in {kept} of {runs} runs)"));
        }
        let anchor = median_of(&unloaded);
        let mut f =
            latency(&name, outcomes, "send 8 B, poll CQ, unloaded, runs between", Some(anchor), cores);
        f.target = case.target.into();
        figures.push(f);
    }
    Ok(figures)
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

/// The 8 B write, send, write with immediate, read and fetch-and-add
/// latencies on daemons of our own with the direct path on and off
/// (docs/direct-path.md), whatever the daemon of the rest does, and the
/// send latency waiting on a completion channel beside polling on each
/// path (issue 17: at most 2x). A read and an atomic are round trips,
/// beside the ping-pong's. When `ucx_perftest` is installed, UCX's posix
/// `tag_lat` is measured in the same run and the direct path's 8 B write
/// and send are printed again against it (issue 17: at most 2x).
fn direct_figures(
    out: &mut Vec<Figure>,
    args: &Args,
    pingpong: Option<anchors::Stat>,
    lat_iters: u64,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) {
    let round_trip =
        pingpong.map(|p| anchors::Stat { median: 2.0 * p.median, min: 2.0 * p.min, max: 2.0 * p.max, ..p });
    let mut against_ucx = Vec::new();
    let mut sends = Vec::new();
    let mut writes = Vec::new();
    for (direct, switch) in [(true, "direct path on"), (false, "direct path off")] {
        let dev = crate::embedded::private_device(super::engine_config(args), direct);
        let Some(dev) = row(out, &format!("the daemon with the {switch}"), cores, dev) else { continue };
        let claimed = if direct { Path::Direct } else { Path::Engine };
        // Each row's runs, proved to have taken the path its name claims;
        // a row that fails says why in its place.
        let run =
            |out: &mut Vec<Figure>, name: &str, test: worker::Test, iters: u64| -> Option<Vec<Outcome>> {
                progress(name);
                let lat = measure(dev.socket(), test, 8, iters, runs).and_then(|lat| {
                    path::check(name, &lat, claimed)?;
                    Ok(lat)
                });
                row(out, name, cores, lat)
            };
        let write = format!("RDMA write 8 B, one way, {switch} (poll on memory)");
        if let Some(lat) = run(out, &write, worker::Test::WriteLat, lat_iters) {
            writes.push((switch, median_of(&lat)));
            if direct {
                against_ucx.push((write.clone(), lat.clone()));
            }
            out.push(latency(&write, lat, "2-process shm ping-pong", pingpong, cores));
        }
        let send = format!("send 8 B, one way, {switch} (poll CQ)");
        let polled = run(out, &send, worker::Test::SendLat, lat_iters).map(|lat| {
            let polled = median_of(&lat);
            if direct {
                against_ucx.push((send.clone(), lat.clone()));
            }
            out.push(latency(&send, lat, "2-process shm ping-pong", pingpong, cores));
            polled
        });
        sends.push(polled);
        if let (true, Some(polled)) = (direct, polled) {
            let idle = beside_idle_qps(args, lat_iters, runs, cores, polled, progress);
            let idle = row(out, "send 8 B beside idle QPs, direct path on", cores, idle);
            out.extend(idle.unwrap_or_default());
        }
        let event = format!("send 8 B, one way, {switch} (completion channel)");
        if let Some(lat) = run(out, &event, worker::Test::SendLatEvent, lat_iters / 4) {
            out.push(latency(&event, lat, &format!("send 8 B, poll CQ, {switch}"), polled, cores));
        }
        let imm = format!("RDMA write with immediate 8 B, one way, {switch} (poll CQ)");
        if let Some(lat) = run(out, &imm, worker::Test::WriteImmLat, lat_iters) {
            out.push(latency(&imm, lat, "2-process shm ping-pong", pingpong, cores));
        }
        let read = format!("RDMA read 8 B, whole read, {switch} (poll CQ)");
        if let Some(lat) = run(out, &read, worker::Test::ReadLat, lat_iters) {
            out.push(latency(&read, lat, "2-process shm ping-pong, round trip", round_trip, cores));
        }
        let atomic = format!("fetch-and-add 8 B, whole atomic, {switch} (poll CQ)");
        if let Some(lat) = run(out, &atomic, worker::Test::FetchAddLat, lat_iters) {
            out.push(latency(&atomic, lat, "2-process shm ping-pong, round trip", round_trip, cores));
        }
        if !args.direct_lat {
            let own = writes.iter().find(|w| w.0 == switch).map(|w| w.1);
            perftest_beside_own(out, dev.socket(), switch, own, args.quick, runs, cores, progress);
        }
    }
    if super::ucx::available() {
        progress("UCX posix tag_lat 8 B (ucx_perftest, UCX_TLS=posix,self)");
        match super::ucx::posix_tag_lat_ns(lat_iters, runs) {
            Ok(ucx) => {
                for (name, lat) in against_ucx {
                    out.push(latency(&name, lat, UCX_ANCHOR, Some(ucx), cores));
                }
            }
            Err(e) => eprintln!("UCX posix tag_lat not measured: {e:#}"),
        }
    } else if !args.json {
        eprintln!("ucx_perftest not installed (ucx-utils): no UCX posix anchor");
    }
    if !args.direct_lat {
        let bw = super::direct_bw::figures(args, runs, cores, progress);
        let bw = row(out, "direct path bandwidth rows", cores, bw);
        out.extend(bw.unwrap_or_default());
        let mpi = super::mpi::figures(args, runs, cores, &sends, progress);
        let mpi = row(out, "Open MPI 8 B ping-pong over UCX over vRDMA", cores, mpi);
        out.extend(mpi.unwrap_or_default());
    }
}

/// perftest's `ib_write_lat` (8 B, its t_typical) through the drop-in
/// library on the daemon at `sock`, beside `vrdma bench`'s own 8 B write
/// on the same daemon (`own`): issue 17's check that an unmodified verbs
/// program gets the library's latency, within 1.5x. When perftest is
/// installed; a failed run (a stale drop-in library, say) is the row's.
#[allow(clippy::too_many_arguments)]
fn perftest_beside_own(
    out: &mut Vec<Figure>,
    sock: &std::path::Path,
    switch: &str,
    own: Option<anchors::Stat>,
    quick: bool,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) {
    if !verbs::write_lat_installed() {
        return;
    }
    let name = format!("perftest ib_write_lat 8 B, t_typical, one way, {switch} (drop-in libibverbs.so.1)");
    progress(&name);
    let n = if quick { 2_000 } else { 10_000 };
    let got = (0..runs)
        .map(|_| verbs::write_lat_ns(sock, n).map(|t| Outcome { lat_ns: vec![t], ..Default::default() }))
        .collect::<Result<Vec<_>>>();
    if let Some(lat) = row(out, &name, cores, got) {
        let anchor = format!("vrdma bench RDMA write 8 B, {switch}");
        let mut f = latency(&name, lat, &anchor, own, cores);
        (f.p99, f.target) = (None, "<= 1.5x vrdma bench".into());
        out.push(f);
    }
}

/// The direct path's 8 B send with 63 and 1023 idle QPs (each with an
/// inbox) on each worker's CQ beside the same send with none (`polled`):
/// what a CQ's poll pays for the inboxes it looks at (issue 17, item 3).
/// Fewer idle QPs where the tenant's share of QPs is smaller; the row
/// names how many. On a daemon of its own that admits two tenants, so
/// that the tenant's descriptor share holds every QP's kept segment
/// (with the default sixteen, 2 × 1024 QPs used it up and the pair took
/// the engine path: round 8).
fn beside_idle_qps(
    args: &Args,
    lat_iters: u64,
    runs: usize,
    cores: usize,
    polled: anchors::Stat,
    progress: &dyn Fn(&str),
) -> Result<Vec<Figure>> {
    let dev = crate::embedded::private_device_with(super::engine_config(args), true, "max_tenants = 2\n")?;
    let sock = dev.socket();
    let max_qp = vrdma::Context::open_at(sock)?.query_device()?.max_qp as usize;
    // Two workers, each with its idle QPs and one of its own.
    let room = (max_qp.saturating_sub(64) / 2) as u32;
    let mut out = Vec::new();
    for want in [63u32, 1023] {
        let idle = want.min(room);
        let what = format!("send 8 B, one way, direct path on (poll CQ), {idle} idle QPs on each side's CQ");
        progress(&what);
        let lat = measure_beside_idle(sock, worker::Test::SendLat, 8, lat_iters, runs, idle)?;
        // Each QP keeps descriptors charged to the tenant's share; a share
        // that many QPs used up leaves the pair on the engine path
        // ("Descriptors" in docs/direct-path.md): the row says which.
        let name = format!("{what}: {}", path::measured(&lat));
        let mut f =
            latency(&name, lat, "send 8 B, poll CQ, direct path on, no idle QPs", Some(polled), cores);
        f.target = "none (O(QPs) poll shows as growth)".into();
        out.push(f);
    }
    Ok(out)
}

/// The anchor name of the direct path's figures against UCX.
const UCX_ANCHOR: &str = "UCX posix tag_lat 8 B, one way (ucx_perftest, UCX_TLS=posix,self)";

pub(super) fn median_of(outcomes: &[Outcome]) -> anchors::Stat {
    let per_run: Vec<f64> = outcomes.iter().map(|o| anchors::Stat::from_samples(&o.lat_ns).median).collect();
    anchors::Stat::from_samples(&per_run)
}

pub(super) fn latency(
    name: &str,
    runs: Vec<Outcome>,
    anchor_name: &str,
    anchor: Option<anchors::Stat>,
    cores: usize,
) -> Figure {
    let value = median_of(&runs);
    let ratio = anchor.map(|a| value.median / a.median);
    let mut all: Vec<f64> = runs.iter().flat_map(|o| o.lat_ns.iter().copied()).collect();
    all.sort_by(f64::total_cmp);
    let p99 = (!all.is_empty()).then(|| all[((all.len() - 1) as f64 * 0.99).round() as usize]);
    let target = if anchor_name.starts_with("send") {
        "<= 2x polling".to_string()
    } else if anchor_name == UCX_ANCHOR {
        "<= 2x UCX posix tag_lat".to_string()
    } else if cores > 2 {
        "<= 3x anchor".to_string()
    } else if anchor_name.ends_with("round trip") {
        "<= 10 us per read on 2 cores".to_string()
    } else {
        "<= 5 us one way on 2 cores".to_string()
    };
    Figure {
        name: name.into(),
        unit: "ns",
        value,
        anchor_name: anchor_name.into(),
        anchor,
        ratio,
        target,
        cores,
        p99,
        error: None,
    }
}

fn bandwidth(name: &str, runs: Vec<Outcome>, memcpy: anchors::Stat, cores: usize) -> Figure {
    Figure::beside(name, "GB/s", gb_per_s(&runs), "memcpy, 1 thread", memcpy, ">= 0.70x memcpy", cores)
}

/// The runs' bandwidths in GB/s (1e9 B/s).
pub fn gb_per_s(runs: &[Outcome]) -> anchors::Stat {
    let per_run: Vec<f64> = runs.iter().map(|o| o.bytes as f64 / o.seconds / 1e9).collect();
    anchors::Stat::from_samples(&per_run)
}

/// Runs one test `runs` times between two worker processes.
pub(super) fn measure(
    sock: &std::path::Path,
    test: worker::Test,
    size: usize,
    iters: u64,
    runs: usize,
) -> Result<Vec<Outcome>> {
    measure_beside_idle(sock, test, size, iters, runs, 0)
}

/// [`measure`] with `idle` idle QPs on each worker's CQ.
pub(super) fn measure_beside_idle(
    sock: &std::path::Path,
    test: worker::Test,
    size: usize,
    iters: u64,
    runs: usize,
    idle: u32,
) -> Result<Vec<Outcome>> {
    (0..runs).map(|_| measure_once_beside_idle(sock, test, size, iters, idle)).collect()
}

/// A worker process, killed by pid if it is still running when dropped.
pub(super) struct WorkerProc {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl WorkerProc {
    fn spawn(
        sock: &std::path::Path,
        role: Role,
        test: worker::Test,
        size: usize,
        iters: u64,
        idle: u32,
    ) -> Result<WorkerProc> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["bench", "--worker", role.as_str(), "--worker-test", test.as_str()])
            .args(["--worker-size", &size.to_string(), "--worker-iters", &iters.to_string()])
            .args(["--worker-idle-qps", &idle.to_string()])
            .env("VRDMA_SOCKET", sock)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        WorkerProc::start(cmd).context("starting a benchmark worker")
    }

    /// Spawns `cmd` (its stdin and stdout piped) and reads its lines.
    pub(super) fn start(mut cmd: Command) -> Result<WorkerProc> {
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().ok_or_else(|| anyhow!("the child's stdout is not piped"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(WorkerProc { child, lines: rx })
    }

    pub(super) fn line(&self, limit: Duration) -> Result<String> {
        self.lines
            .recv_timeout(limit)
            .map_err(|_| anyhow!("a benchmark worker said nothing within {limit:?}"))
    }

    pub(super) fn tell(&mut self, line: &str) -> Result<()> {
        let stdin = self.child.stdin.as_mut().ok_or_else(|| anyhow!("worker stdin closed"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    pub(super) fn finish(mut self, limit: Duration) -> Result<()> {
        drop(self.child.stdin.take());
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait()? {
                if !s.success() {
                    bail!("benchmark worker failed: {s}");
                }
                return Ok(());
            }
            if Instant::now() > end {
                bail!("benchmark worker {} did not exit within {limit:?}", self.child.id());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub(super) fn measure_once(
    sock: &std::path::Path,
    test: worker::Test,
    size: usize,
    iters: u64,
) -> Result<Outcome> {
    measure_once_beside_idle(sock, test, size, iters, 0)
}

fn measure_once_beside_idle(
    sock: &std::path::Path,
    test: worker::Test,
    size: usize,
    iters: u64,
    idle: u32,
) -> Result<Outcome> {
    let mut server = WorkerProc::spawn(sock, Role::Server, test, size, iters, idle)?;
    let mut client = WorkerProc::spawn(sock, Role::Client, test, size, iters, idle)?;
    // A worker makes its idle QPs before its hello: on a loaded 2-core
    // machine 1024 of them once took the 20 s meant for none (a CI run's
    // report failed on that row), so each adds to the wait.
    let setup = Duration::from_secs(20) + Duration::from_millis(40) * idle;
    let s_hello = server.line(setup)?;
    let c_hello = client.line(setup)?;
    server.tell(&c_hello)?;
    client.tell(&s_hello)?;
    for w in [&server, &client] {
        let l = w.line(setup)?;
        if l != "connected" {
            bail!("a benchmark worker said {l:?} instead of \"connected\"");
        }
    }
    server.tell("go")?;
    client.tell("go")?;
    // Generous: the slowest test on a loaded 2-core machine.
    let result = client.line(Duration::from_secs(300))?;
    let outcome: Outcome =
        serde_json::from_str(&result).with_context(|| format!("worker printed {result:?}"))?;
    client.finish(Duration::from_secs(10))?;
    server.finish(Duration::from_secs(10))?;
    Ok(outcome)
}
