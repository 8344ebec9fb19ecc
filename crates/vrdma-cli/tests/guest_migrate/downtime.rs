//! Issue 19, item 5, as a figure run by hand (`--ignored`): `vrdma bench
//! --migrate` (`src/bench/migrate.rs`, where the hops, B's check and the
//! figures are), its hops from `VRDMA_DOWNTIME_HOPS` (default 5; item 5
//! asks for 20 under load), run as a user would and its JSON read back:
//! the command must succeed (B got every message once, in order, with its
//! bytes, and the guest's stream, checking its own completions, ran
//! through every hop) and report its rows, each beside its anchor.

use std::process::{Command, Stdio};

use super::world::VRDMA;

const HOPS: usize = 5;

/// A hop count from the environment: `default` where unset, 1..=100.
fn hops_from_env(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => default,
        Ok(v) => match v.trim().parse() {
            Ok(n) if (1..=100).contains(&n) => n,
            _ => panic!("{name}={v:?}: a number of hops from 1 to 100"),
        },
        Err(e) => panic!("{name}: {e}"),
    }
}

#[test]
#[ignore = "a figure (issue 19 item 5), not a test: vrdma bench --migrate, 2 x 5 migrations of a TCG guest by \
            default (VRDMA_DOWNTIME_HOPS), about a minute; run by hand with --ignored --nocapture"]
fn downtime_with_and_without_vrdma_traffic() {
    let hops = hops_from_env("VRDMA_DOWNTIME_HOPS", HOPS);
    let out = Command::new(VRDMA)
        .args(["bench", "--migrate", "--json", "--runs", &hops.to_string()])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run vrdma bench --migrate");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "vrdma bench --migrate failed ({}):\n{text}", out.status);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    let figures = v["figures"].as_array().cloned().unwrap_or_default();
    if figures.is_empty() {
        vrdma_it::skip(format!("vrdma bench --migrate measured nothing: {}", v["skipped"]));
        return;
    }
    assert_eq!(v["skipped"].as_array().map_or(0, Vec::len), 0, "{text}");
    for f in &figures {
        let runs = f["value"]["runs"].as_u64().unwrap_or(0);
        assert!((1..=hops as u64).contains(&runs), "a row of the hops: {f}");
        assert!(f["ratio"].as_f64().is_some_and(f64::is_finite), "a ratio to its anchor: {f}");
        eprintln!(
            "  {}: {:.1} {} (median of {hops}; anchor {}: {:.1}; x{:.2})",
            f["name"].as_str().unwrap_or("?"),
            f["value"]["median"].as_f64().unwrap_or(f64::NAN),
            f["unit"].as_str().unwrap_or("?"),
            f["anchor_name"].as_str().unwrap_or("?"),
            f["anchor"]["median"].as_f64().unwrap_or(f64::NAN),
            f["ratio"].as_f64().unwrap_or(f64::NAN)
        );
    }
}
