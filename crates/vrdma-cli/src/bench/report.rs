//! The benchmark's table.

use anyhow::Result;

use super::Figure;

fn fmt(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v >= 10_000.0 => format!("{:.1} us", v / 1000.0),
        "ns" => format!("{v:.0} ns"),
        _ => format!("{v:.2} {unit}"),
    }
}

pub fn print(figures: &[Figure], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(figures)?);
        return Ok(());
    }
    let cores = figures.first().map_or(0, |f| f.cores);
    println!("vRDMA on this host ({cores} cores; medians of the runs, [min-max] of run medians)");
    println!();
    println!("| figure | vRDMA | p99 | anchor | anchor value | ratio | target |");
    println!("|---|---|---|---|---|---|---|");
    for f in figures {
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
    Ok(())
}
