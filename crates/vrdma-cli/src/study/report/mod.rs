//! The study's report: the records summarised into tables laid out like
//! a measurement paper's (per-run figures, then average, min and max),
//! three charts, and the raw data. The document is built once as blocks
//! and rendered as Markdown ([`markdown`]) and HTML ([`html`], with the
//! SVGs inline).

pub mod chart;
mod html;
mod markdown;

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use serde::Serialize;

use super::data::{self, jain, Record, Section, Summary};
use super::plan::{Placement, Protocol, TENANTS};
use super::run::Outcome;
use chart::{Bar, Chart, Group};

/// A piece of the document.
pub enum Block {
    Heading(u8, String),
    Para(String),
    List(Vec<String>),
    Table { caption: String, header: Vec<String>, rows: Vec<Vec<String>>, note: Option<String> },
    Figure { caption: String, name: String },
}

/// One row of a table: a figure's runs and their summary.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
    pub section: Section,
    pub placement: Placement,
    pub protocol: Protocol,
    pub tenants: u32,
    pub tool: &'static str,
    pub test: String,
    pub size: u64,
    pub unit: &'static str,
    /// By run (1-based run r at r-1); None where that run failed or did not run.
    pub runs: Vec<Option<f64>>,
    pub summary: Option<Summary>,
}

/// A four-tenant cell's shares.
#[derive(Serialize, Debug, Clone)]
pub struct Fairness {
    pub placement: Placement,
    pub protocol: Protocol,
    /// Each tenant's average GB/s over the runs.
    pub tenant_gbs: Vec<f64>,
    /// Each tenant's share of their sum, in %.
    pub share_pct: Vec<f64>,
    /// Jain's index of each run.
    pub jain_runs: Vec<Option<f64>>,
    pub jain: Option<Summary>,
}

#[derive(Serialize, Debug, Clone)]
pub struct Model {
    pub rows: Vec<Row>,
    pub fairness: Vec<Fairness>,
}

/// (tenant, GB/s) of each run of a four-tenant cell.
type TenantsByRun = BTreeMap<u32, Vec<(u32, f64)>>;

type Key = (Section, Placement, Protocol, u32, u8, &'static str, String, u64);

fn tool_rank(tool: &str) -> u8 {
    match tool {
        "vrdma bench" => 0,
        "perftest" => 1,
        "qperf" => 2,
        _ => 3,
    }
}

pub fn model(records: &[Record], runs: u32) -> Model {
    let mut groups: BTreeMap<Key, (&'static str, Vec<Option<f64>>)> = BTreeMap::new();
    for r in records.iter().filter(|r| r.section != Section::Tenant) {
        let key = (
            r.section,
            r.placement,
            r.protocol,
            r.tenants,
            tool_rank(r.tool),
            r.tool,
            r.test.clone(),
            r.size,
        );
        let e = groups.entry(key).or_insert_with(|| (r.unit, vec![None; runs as usize]));
        if let Some(slot) = e.1.get_mut(r.run as usize - 1) {
            *slot = Some(r.value);
        }
    }
    let rows = groups
        .into_iter()
        .map(|((section, placement, protocol, tenants, _, tool, test, size), (unit, v))| {
            let vals: Vec<f64> = v.iter().flatten().copied().collect();
            Row {
                section,
                placement,
                protocol,
                tenants,
                tool,
                test,
                size,
                unit,
                runs: v,
                summary: Summary::of(&vals),
            }
        })
        .collect();
    let mut cells: BTreeMap<(Placement, Protocol), TenantsByRun> = BTreeMap::new();
    for r in records.iter().filter(|r| r.section == Section::Tenant) {
        cells
            .entry((r.placement, r.protocol))
            .or_default()
            .entry(r.run)
            .or_default()
            .push((r.tenant.unwrap_or(0), r.value));
    }
    let fairness = cells
        .into_iter()
        .map(|((placement, protocol), by_run)| {
            let mut per_tenant = vec![Vec::new(); TENANTS as usize];
            let mut jain_runs = vec![None; runs as usize];
            for (run, v) in &by_run {
                for &(t, g) in v {
                    if let Some(p) = per_tenant.get_mut(t as usize - 1) {
                        p.push(g);
                    }
                }
                if let Some(slot) = jain_runs.get_mut(*run as usize - 1) {
                    *slot = jain(&v.iter().map(|x| x.1).collect::<Vec<_>>());
                }
            }
            let tenant_gbs: Vec<f64> =
                per_tenant.iter().map(|v| Summary::of(v).map_or(0.0, |s| s.avg)).collect();
            let sum: f64 = tenant_gbs.iter().sum();
            let share_pct =
                tenant_gbs.iter().map(|g| if sum > 0.0 { 100.0 * g / sum } else { 0.0 }).collect();
            let js: Vec<f64> = jain_runs.iter().flatten().copied().collect();
            Fairness { placement, protocol, tenant_gbs, share_pct, jain_runs, jain: Summary::of(&js) }
        })
        .collect();
    Model { rows, fairness }
}

/// A figure with the precision a table wants.
fn fmt(v: f64) -> String {
    if !v.is_finite() {
        "n/a".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn size_name(b: u64) -> String {
    match b {
        0 => "-".into(),
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn runs_header(first: &[&str], runs: u32) -> Vec<String> {
    let mut h: Vec<String> = first.iter().map(|s| s.to_string()).collect();
    h.extend((1..=runs).map(|r| format!("run {r}")));
    h.extend(["avg".into(), "min".into(), "max".into()]);
    h
}

fn runs_cells(r: &Row) -> Vec<String> {
    let mut c: Vec<String> = r.runs.iter().map(|v| v.map_or("-".into(), fmt)).collect();
    match r.summary {
        Some(s) => c.extend([format!("**{}**", fmt(s.avg)), fmt(s.min), fmt(s.max)]),
        None => c.extend(["-".into(), "-".into(), "-".into()]),
    }
    c
}

/// A placement's heading in the tables: the VMs' under TCG marked as
/// not comparable.
fn title(o: &Outcome, p: Placement) -> String {
    match (p, o.vm_accel) {
        (Placement::Vm, Some(vrdma_guest::Accel::Tcg)) => {
            format!("{} under TCG: functional, not comparable with the host's", p.title())
        }
        (Placement::Vm, Some(a)) => format!("{} under {}", p.title(), a.name().to_uppercase()),
        _ => p.title().to_string(),
    }
}

/// A placement's label in the charts, the VMs' with their accelerator.
fn label(p: Placement, vm_accel: Option<vrdma_guest::Accel>) -> String {
    match (p, vm_accel) {
        (Placement::Vm, Some(a)) => {
            format!("vm ({}{})", a.name(), if a == vrdma_guest::Accel::Tcg { ", functional" } else { "" })
        }
        _ => p.name().into(),
    }
}

fn what(r: &Row) -> String {
    if r.tool == "vrdma bench" {
        r.test.clone()
    } else if r.test.starts_with(r.tool) {
        format!("{} (anchor)", r.test)
    } else {
        format!("{} {} (anchor)", r.tool, r.test)
    }
}

/// The charts, by file stem.
fn charts(m: &Model, vm_accel: Option<vrdma_guest::Accel>) -> Vec<(&'static str, String, Chart)> {
    let placements: Vec<Placement> = {
        let mut v: Vec<Placement> = m.rows.iter().map(|r| r.placement).collect();
        v.sort();
        v.dedup();
        v
    };
    // Under TCG the VMs' figures are hundreds of times the host's: a
    // chart of their own, so that neither squashes the other.
    let tcg = vm_accel == Some(vrdma_guest::Accel::Tcg);
    let host: Vec<Placement> = placements.iter().copied().filter(|p| !(tcg && *p == Placement::Vm)).collect();
    let mut v = Vec::new();
    if !host.is_empty() {
        let (bandwidth, latency) = placement_charts(m, &host, vm_accel);
        v.push(("bandwidth", "Transfer bandwidth per cell.".to_string(), bandwidth));
        v.push(("latency", "Latency per placement.".to_string(), latency));
    }
    if tcg && placements.contains(&Placement::Vm) {
        let (bandwidth, latency) = placement_charts(m, &[Placement::Vm], vm_accel);
        let why = "under TCG, on a scale of its own: functional, not comparable with the host's";
        v.push(("bandwidth-vm", format!("VM to VM transfer bandwidth per cell, {why}."), bandwidth));
        v.push(("latency-vm", format!("VM to VM latency, {why}."), latency));
    }
    // Tenants' shares.
    let groups = m
        .fairness
        .iter()
        .map(|f| Group {
            label: format!(
                "{} {} (J={})",
                f.placement.name(),
                f.protocol.name(),
                f.jain.map_or("n/a".into(), |j| format!("{:.3}", j.avg))
            ),
            bars: f
                .share_pct
                .iter()
                .enumerate()
                .map(|(i, s)| Bar { series: i, value: *s, min: *s, max: *s })
                .collect(),
        })
        .collect();
    let fairness = Chart {
        title: "Each tenant's share in the four-tenant cells (J = Jain's index)".into(),
        y_label: "share of the cell's bandwidth, %".into(),
        series: (1..=TENANTS).map(|t| format!("tenant {t}")).collect(),
        groups,
        y_max: Some(100.0),
    };
    if !m.fairness.is_empty() {
        v.push((
            "fairness",
            "Tenants' shares in the four-tenant cells, with Jain's fairness index.".into(),
            fairness,
        ));
    }
    v.into_iter()
        .enumerate()
        .map(|(i, (n, caption, c))| (n, format!("Figure {}. {caption}", i + 1), c))
        .collect()
}

/// Bandwidth per cell and latency per placement, for `placements`.
fn placement_charts(
    m: &Model,
    placements: &[Placement],
    vm_accel: Option<vrdma_guest::Accel>,
) -> (Chart, Chart) {
    let bar = |s: Option<Summary>, series| s.map(|s| Bar { series, value: s.avg, min: s.min, max: s.max });
    // Bandwidth per cell.
    let cells: Vec<(Protocol, u32)> =
        vec![(Protocol::Vrdma, 1), (Protocol::Vrdma, TENANTS), (Protocol::Tcp, 1), (Protocol::Tcp, TENANTS)];
    let series: Vec<String> = cells
        .iter()
        .map(|(p, n)| if *n == 1 { format!("{} x1", p.name()) } else { format!("{} x{n} tenants", p.name()) })
        .collect();
    let groups = placements
        .iter()
        .map(|&pl| Group {
            label: label(pl, vm_accel),
            bars: cells
                .iter()
                .enumerate()
                .filter_map(|(i, (p, n))| {
                    let r = m.rows.iter().find(|r| {
                        r.section == Section::Transfer
                            && r.placement == pl
                            && r.protocol == *p
                            && r.tenants == *n
                            && r.tool == "vrdma bench"
                    })?;
                    bar(r.summary, i)
                })
                .collect(),
        })
        .collect();
    let bandwidth = Chart {
        title: "Transfer bandwidth per cell (average, whiskers min-max)".into(),
        y_label: "GB/s".into(),
        series,
        groups,
        y_max: None,
    };
    // Latency per placement.
    let tests: Vec<(&str, &str)> = vec![
        ("vrdma bench", "rc_lat"),
        ("vrdma bench", "rc_rdma_write_lat"),
        ("perftest", "ib_write_lat"),
        ("vrdma bench", "tcp_lat"),
        ("qperf", "tcp_lat"),
    ];
    let series = tests
        .iter()
        .map(|(tool, t)| if *tool == "vrdma bench" { t.to_string() } else { format!("{tool} {t}") })
        .collect();
    let groups = placements
        .iter()
        .map(|&pl| Group {
            label: label(pl, vm_accel),
            bars: tests
                .iter()
                .enumerate()
                .filter_map(|(i, (tool, t))| {
                    let r = m.rows.iter().find(|r| {
                        r.section == Section::Latency && r.placement == pl && r.tool == *tool && r.test == *t
                    })?;
                    bar(r.summary, i)
                })
                .collect(),
        })
        .collect();
    let latency = Chart {
        title: "Latency per placement, 8 B one way (median per run; average, min-max)".into(),
        y_label: "microseconds".into(),
        series,
        groups,
        y_max: None,
    };
    (bandwidth, latency)
}

fn document(o: &Outcome, m: &Model, figures: &[(&'static str, String)]) -> Vec<Block> {
    let p = &o.plan;
    let mut b = Vec::new();
    b.push(Block::Heading(1, format!("vRDMA study, {}", o.started)));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    b.push(Block::Para(format!(
        "`vrdma study{}` on a host with {cores} cores (Linux {}), vrdma {}; run {} took {:.0} s. \
         Each transfer cell moves {} per run in {}-byte messages ({}); in the four-tenant cells the tenants \
         (uids {}) split it equally and run at once. {} runs per cell; the latency and bandwidth set runs {} s per \
         test. GB/s = 10^9 bytes/s; latency is one way (half a round trip), in microseconds.",
        if p.quick { " --quick" } else { "" },
        kernel.trim(),
        env!("CARGO_PKG_VERSION"),
        o.run_id,
        o.seconds,
        size_name(p.bytes),
        p.message_size,
        "vRDMA: `rc_rdma_write_bw`, RDMA writes; TCP: `tcp_bw`",
        if p.as_uids {
            format!("{}-{}", super::plan::FIRST_UID, super::plan::FIRST_UID + TENANTS - 1)
        } else {
            "not used: not root".into()
        },
        p.runs,
        p.set_seconds,
    )));
    b.push(Block::Heading(2, "Placements".into()));
    b.push(Block::List(o.sites.iter().map(|(pl, d)| format!("**{}**: {d}", title(o, *pl))).collect()));
    b.push(Block::Heading(2, "Skipped".into()));
    let mut skipped: Vec<String> = p.skipped.iter().map(|(w, y)| format!("{w}: {y}")).collect();
    skipped.extend(o.anchor_notes.iter().cloned());
    if p.quick {
        skipped.push("--quick: each anchor runs once per placement (not per run)".into());
    }
    if skipped.is_empty() {
        b.push(Block::Para("Nothing: every placement, protocol, concurrency and anchor ran.".into()));
    } else {
        b.push(Block::List(skipped));
    }

    b.push(Block::Heading(2, "Results".into()));
    let table = |section: Section| m.rows.iter().filter(move |r| r.section == section);
    let rows: Vec<Vec<String>> = table(Section::Transfer)
        .map(|r| {
            let mut c = vec![title(o, r.placement), r.protocol.name().into(), r.tenants.to_string(), what(r)];
            c.extend(runs_cells(r));
            c
        })
        .collect();
    b.push(Block::Table {
        caption: format!("Table 1. Transfer bandwidth (GB/s), {} per cell and run.", size_name(p.bytes)),
        header: runs_header(&["placement", "protocol", "tenants", "test"], p.runs),
        rows,
        note: Some(
            "A cell's figure is all its bytes over the span from the first tenant's start to the last one's end (each tenant's start is its exit less its own transfer time). Anchors: iperf3 moves \
             the same bytes (-n; -P 4: four streams of one process); perftest ib_write_bw moves them through the \
             drop-in libibverbs.so.1 on the same daemons."
                .into(),
        ),
    });
    let rows: Vec<Vec<String>> = table(Section::Latency)
        .map(|r| {
            let mut c = vec![title(o, r.placement), r.protocol.name().into(), what(r)];
            c.extend(runs_cells(r));
            c
        })
        .collect();
    b.push(Block::Table {
        caption: "Table 2. Latency (µs, 8 B, one way; each run's median).".into(),
        header: runs_header(&["placement", "protocol", "test"], p.runs),
        rows,
        note: Some(
            "qperf tcp_lat: its mean over the run; perftest ib_write_lat: t_typical (its median), through the \
             drop-in library."
                .into(),
        ),
    });
    let rows: Vec<Vec<String>> = table(Section::Bandwidth)
        .map(|r| {
            let mut c = vec![title(o, r.placement), r.protocol.name().into(), what(r)];
            c.extend(runs_cells(r));
            c
        })
        .collect();
    b.push(Block::Table {
        caption: format!(
            "Table 3. Bandwidth set (GB/s, {}-byte messages, {} s per test).",
            p.message_size, p.set_seconds
        ),
        header: runs_header(&["placement", "protocol", "test"], p.runs),
        rows,
        note: None,
    });
    if !m.fairness.is_empty() {
        let mut header = vec!["placement".to_string(), "protocol".into()];
        header.extend((1..=TENANTS).map(|t| format!("tenant {t} GB/s (share)")));
        header.extend(["Jain avg".into(), "min".into(), "max".into()]);
        let rows = m
            .fairness
            .iter()
            .map(|f| {
                let mut c = vec![title(o, f.placement), f.protocol.name().to_string()];
                c.extend(
                    f.tenant_gbs.iter().zip(&f.share_pct).map(|(g, s)| format!("{} ({s:.0} %)", fmt(*g))),
                );
                match f.jain {
                    Some(j) => c.extend([
                        format!("**{:.3}**", j.avg),
                        format!("{:.3}", j.min),
                        format!("{:.3}", j.max),
                    ]),
                    None => c.extend(["-".into(), "-".into(), "-".into()]),
                }
                c
            })
            .collect();
        b.push(Block::Table {
            caption: "Table 4. Four tenants at once: each tenant's bandwidth (average over the runs) and share, \
                      Jain's fairness index over the runs."
                .into(),
            header,
            rows,
            note: Some(
                "Jain's index J = (Σx)² / (n·Σx²) over the tenants' bandwidths x: 1 when all get the same, 1/n = \
                 0.25 when one gets everything."
                    .into(),
            ),
        });
    }
    for (number, placement, where_) in [
        (5, Placement::Process, "one host"),
        (6, Placement::Hosts, "across hosts (two namespaces joined by veth, a daemon in each)"),
    ] {
        let protection: Vec<&Row> = table(Section::Protection).filter(|r| r.placement == placement).collect();
        if protection.is_empty() {
            continue;
        }
        let unloaded = protection
            .iter()
            .find(|r| r.test == super::protect::UNLOADED)
            .and_then(|r| r.summary)
            .map(|s| s.avg);
        let mut header = runs_header(&["test"], p.runs);
        header.push("vs unloaded".into());
        let order = [super::protect::UNLOADED, super::protect::BESIDE, super::protect::PROTECTED];
        let mut sorted = protection.clone();
        sorted.sort_by_key(|r| order.iter().position(|t| *t == r.test));
        let rows = sorted
            .iter()
            .map(|r| {
                let mut c = vec![r.test.clone()];
                c.extend(runs_cells(r));
                c.push(match (r.summary, unloaded) {
                    (Some(s), Some(u)) if u > 0.0 => format!("{:.2}x", s.avg / u),
                    _ => "-".into(),
                });
                c
            })
            .collect();
        let hog = if placement == Placement::Hosts {
            "a tenant streaming 64 KiB RDMA writes over 64 QPs from host A to host B (the victims' clients on \
             host A, their servers on host B)"
        } else {
            "a tenant streaming 64 KiB RDMA writes over 64 QPs"
        };
        b.push(Block::Table {
            caption: format!(
                "Table {number}. Latency beside a hog, {where_} (µs, 8 B, one way; each run's median): a victim \
                 tenant unloaded, then beside {hog}, as a tenant of the default class and as one of \
                 latency_class = \"latency\"."
            ),
            header,
            rows,
            note: Some(format!(
                "Daemons of the cell's own (direct path off), uids {} (normal), {} (latency class) and {} (the \
                 hog); the three figures of a run are measured one after the other in that run, the unloaded one \
                 first: it is the anchor of the ratios.",
                super::protect::PLAIN_UID,
                super::protect::PROTECTED_UID,
                super::protect::HOG_UID
            )),
        });
    }
    b.push(Block::Heading(2, "Figures".into()));
    for (name, caption) in figures {
        b.push(Block::Figure { caption: caption.clone(), name: name.to_string() });
    }
    b.push(Block::Heading(2, "Failures".into()));
    if o.failures.is_empty() {
        b.push(Block::Para("None.".into()));
    } else {
        b.push(Block::List(o.failures.iter().map(|f| format!("{}: {}", f.what, f.error)).collect()));
    }
    b.push(Block::Heading(2, "Method".into()));
    b.push(Block::List(vec![
        "Every figure comes from `vrdma bench` processes: a `vrdma bench --server` per tenant in the receiving \
         place, and for each run a client (`vrdma bench HOST:PORT TEST --json`) in the sending place, each on its \
         place's daemon. A run is a new client process: its registration and connection are outside the timed part."
            .into(),
        "Runs are the outer loop: run 1 of every cell, then run 2, ..., so that drift spreads over all cells.".into(),
        "Raw data: data.csv and data.json (every run's figure, each tenant's, the anchors'); logs/ holds every \
         process's stderr."
            .into(),
    ]));
    b
}

/// Writes report.md, report.html, data.csv, data.json and the charts.
pub fn write(o: &Outcome) -> Result<()> {
    let out = &o.plan.out;
    let m = model(&o.records, o.plan.runs);
    let mut figures = Vec::new();
    let mut svgs = BTreeMap::new();
    for (name, caption, chart) in charts(&m, o.vm_accel) {
        let svg = chart.svg().with_context(|| format!("chart {name}"))?;
        std::fs::write(out.join("charts").join(format!("{name}.svg")), &svg)?;
        std::fs::write(out.join("charts").join(format!("{name}.png")), chart.png()?)?;
        svgs.insert(name, svg);
        figures.push((name, caption));
    }
    let blocks = document(o, &m, &figures);
    std::fs::write(out.join("report.md"), markdown::render(&blocks))?;
    std::fs::write(out.join("report.html"), html::render(&blocks, &svgs))?;
    std::fs::write(out.join("data.csv"), data::csv(&o.records))?;
    let json = serde_json::json!({
        "run_id": o.run_id,
        "started": o.started,
        "seconds": o.seconds,
        "plan": o.plan,
        "placements": o.sites.iter().map(|(p, d)| serde_json::json!({"placement": p, "description": d})).collect::<Vec<_>>(),
        "anchor_notes": o.anchor_notes,
        "failures": o.failures,
        "summary": m,
        "records": o.records,
    });
    std::fs::write(out.join("data.json"), serde_json::to_string_pretty(&json)? + "\n")?;
    Ok(())
}
