//! The benchmark's tables.

use anyhow::Result;

use super::verbs::{ToolFigure, Tools};
use super::Figure;

fn fmt(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v >= 10_000.0 => format!("{:.1} us", v / 1000.0),
        "ns" => format!("{v:.0} ns"),
        _ => format!("{v:.2} {unit}"),
    }
}

/// Figures the report has no value for, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Skipped {
    pub figures: String,
    pub reason: String,
}

/// Prints the report; fails after printing it whole if any row failed
/// (so that `vrdma bench` exits non-zero), naming them.
pub fn print(figures: &[Figure], skipped: &[Skipped], tools: Option<&Tools>, json: bool) -> Result<()> {
    write(figures, skipped, tools, json)?;
    let failed: Vec<&str> = figures.iter().filter(|f| f.error.is_some()).map(|f| f.name.as_str()).collect();
    if !failed.is_empty() {
        anyhow::bail!("{} row(s) of the report failed: {}", failed.len(), failed.join("; "));
    }
    Ok(())
}

fn write(figures: &[Figure], skipped: &[Skipped], tools: Option<&Tools>, json: bool) -> Result<()> {
    if json {
        let all = serde_json::json!({ "figures": figures, "skipped": skipped, "tools": tools });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    let cores = figures.first().map_or(0, |f| f.cores);
    println!("vRDMA on this host ({cores} cores; medians of the runs, [min-max] of run medians)");
    println!();
    println!("| figure | vRDMA | p99 | anchor | anchor value | ratio | target |");
    println!("|---|---|---|---|---|---|---|");
    for f in figures {
        if let Some(e) = &f.error {
            println!("| {} | failed: {} | | | | | |", f.name, e.replace('|', "/").replace('\n', " "));
            continue;
        }
        let v = format!(
            "{} [{}-{}]",
            fmt(f.value.median, f.unit),
            fmt(f.value.min, f.unit),
            fmt(f.value.max, f.unit)
        );
        let a = f.anchor.map_or("n/a".to_string(), |a| fmt(a.median, f.unit));
        let r = f.ratio.map_or("n/a".to_string(), |r| format!("{r:.2}x"));
        let p99 = f.p99.map_or("".to_string(), |p| fmt(p, f.unit));
        println!("| {} | {} | {} | {} | {} | {} | {} |", f.name, v, p99, f.anchor_name, a, r, f.target);
    }
    for s in skipped {
        println!();
        println!("Not measured: {}: {}", s.figures, s.reason);
    }
    if let Some(tools) = tools {
        print_tools(tools);
    }
    Ok(())
}

fn cell(f: &Option<ToolFigure>, unit: &str) -> (String, String) {
    match f {
        None => ("n/a".into(), "".into()),
        Some(ToolFigure { value: Some(v), avg, ratio, .. }) => {
            let avg = avg.map_or(String::new(), |a| format!(" (avg {})", fmt(a, unit)));
            (format!("{}{avg}", fmt(*v, unit)), ratio.map_or("n/a".into(), |r| format!("{r:.2}x")))
        }
        Some(ToolFigure { error, .. }) => {
            (format!("failed: {}", error.as_deref().unwrap_or("?").replace('|', "/")), "".into())
        }
    }
}

fn print_tools(tools: &Tools) {
    println!();
    println!("The same tests through unmodified tools on the drop-in libibverbs.so.1 (same daemon)");
    println!();
    for (name, why) in [("perftest", &tools.perftest_unavailable), ("qperf", &tools.qperf_unavailable)] {
        if let Some(why) = why {
            println!("{name}: not available: {why}");
        }
    }
    println!("| test | definition | vrdma bench | perftest | perftest/own | qperf | qperf/own |");
    println!("|---|---|---|---|---|---|---|");
    for r in &tools.rows {
        let own = r.own.map_or("n/a".to_string(), |v| fmt(v, r.unit));
        let (p, pr) = cell(&r.perftest, r.unit);
        let (q, qr) = cell(&r.qperf, r.unit);
        println!("| {} | {} | {own} | {p} | {pr} | {q} | {qr} |", r.test, r.definition);
    }
    println!();
    println!("vrdma bench: the native Rust API, median of run medians. perftest (-d vrdma0, -n bounded): latency is");
    println!("t_typical (its median; t_avg in parentheses), bandwidth is BW average. qperf (-cp1: CQ polling): its mean");
    println!("over -t seconds. Latency: ratio > 1 means the tool took longer; bandwidth: ratio < 1 means it moved less.");
    println!(
        "The methods differ beyond the shim: ib_*_bw keep up to 128 requests in flight, vrdma bench 16."
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::anchors::Stat;

    /// A failed row does not end the report: it is printed in its place
    /// and the report fails only after every row was printed.
    #[test]
    fn a_failed_row_fails_the_report_after_printing_it_whole() {
        let ok =
            Figure::beside("a", "ns", Stat::from_samples(&[1.0]), "b", Stat::from_samples(&[2.0]), "t", 2);
        assert!(print(std::slice::from_ref(&ok), &[], None, false).is_ok());
        let bad = Figure::failed("the MPI row", &anyhow::anyhow!("libvrdma_verbs.so is stale"), 2);
        let e = print(&[ok.clone(), bad, ok], &[], None, true).unwrap_err().to_string();
        assert!(e.contains("1 row(s)") && e.contains("the MPI row"), "{e}");
    }
}
