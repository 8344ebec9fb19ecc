//! Which path a figure measured. A row that names the direct path must
//! have measured it: the client worker reports how many of its QP's work
//! requests its library carried (`QueuePair::direct_stats`), and a row is
//! refused — the bench fails — when the count does not match the path it
//! claims. Without this, a daemon that refused the grants (a tenant at its
//! descriptor share, a peer that was not ready) would print engine-path
//! figures under the direct path's name.

use anyhow::{bail, Result};

use super::suite::Outcome;

/// The path a row claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The library carried (at least 99 % of) the timed work requests.
    Direct,
    /// The library carried none: every work request went through the engine.
    Engine,
}

impl Path {
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Direct => "direct path",
            Path::Engine => "engine path",
        }
    }
}

/// Fails unless every run of `runs` measured `path`. A direct row allows
/// 1 % of its WRs on the engine (the order rule may hand one to the engine
/// while the peer has engine completions unpolled, docs/direct-path.md);
/// an engine row allows none carried.
pub fn check(what: &str, runs: &[Outcome], path: Path) -> Result<()> {
    for (i, o) in runs.iter().enumerate() {
        let ok = match path {
            Path::Direct => o.messages > 0 && o.carried.saturating_mul(100) >= o.messages.saturating_mul(99),
            Path::Engine => o.carried == 0,
        };
        if !ok {
            bail!(
                "{what}: run {} claims the {} but its library carried {} of {} timed work requests",
                i + 1,
                path.as_str(),
                o.carried,
                o.messages
            );
        }
    }
    Ok(())
}

/// The path the runs measured, for a row that does not know it in
/// advance (a send stream may find the peer's receive queue empty and go
/// to the engine, after which the order rule keeps its sends there until
/// the engine's completions are polled): "direct path" where [`check`]
/// would pass for it, "engine path" where nothing was carried, else "both
/// paths" with the carried counts of each run.
pub fn measured(runs: &[Outcome]) -> String {
    if check("", runs, Path::Direct).is_ok() {
        return Path::Direct.as_str().into();
    }
    if check("", runs, Path::Engine).is_ok() {
        return Path::Engine.as_str().into();
    }
    let counts: Vec<String> = runs.iter().map(|o| format!("{} of {}", o.carried, o.messages)).collect();
    format!("both paths (carried per run: {})", counts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(carried: u64, messages: u64) -> Outcome {
        Outcome { carried, messages, ..Default::default() }
    }

    #[test]
    fn a_row_must_have_measured_the_path_it_names() {
        assert!(check("w", &[run(1100, 1000), run(1000, 1000)], Path::Direct).is_ok());
        assert!(check("w", &[run(990, 1000)], Path::Direct).is_ok());
        let e = check("w", &[run(1000, 1000), run(0, 1000)], Path::Direct).unwrap_err();
        assert!(e.to_string().contains("run 2 claims the direct path"), "{e}");
        assert!(check("w", &[run(989, 1000)], Path::Direct).is_err());
        assert!(check("w", &[run(0, 0)], Path::Direct).is_err());
        assert!(check("w", &[run(0, 1000)], Path::Engine).is_ok());
        assert!(check("w", &[run(1, 1000)], Path::Engine).is_err());
        assert_eq!(measured(&[run(1000, 1000)]), "direct path");
        assert_eq!(measured(&[run(0, 1000), run(0, 900)]), "engine path");
        assert_eq!(
            measured(&[run(64, 4087), run(0, 4087)]),
            "both paths (carried per run: 64 of 4087, 0 of 4087)"
        );
    }
}
