//! What the anchor tools print, read back: perftest's result table,
//! qperf's figures, and whether a server listens yet. `vrdma bench`,
//! `bench-hosts` and `study` all run these tools beside vRDMA; one reader
//! each keeps their figures comparable.

use anyhow::{anyhow, bail, Context as _, Result};

/// The value under `column` in perftest's result table (the `#bytes`
/// header and the row after it). Multi-word headings ("BW average[MB/sec]",
/// "99% percentile[usec]") are joined with `_` first.
pub fn perftest_column(out: &str, column: &str) -> Result<f64> {
    let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
    let header = lines.next().ok_or_else(|| anyhow!("no result table in perftest's output"))?;
    let header = header.replace("BW ", "BW_").replace("% percentile", "%_percentile");
    let at = header
        .split_whitespace()
        .position(|h| h == column)
        .ok_or_else(|| anyhow!("no {column} column in perftest's output"))?;
    let row = lines.next().ok_or_else(|| anyhow!("no result row in perftest's output"))?;
    let cell = row.split_whitespace().nth(at).ok_or_else(|| anyhow!("short result row {row:?}"))?;
    cell.parse().with_context(|| format!("{column} = {cell:?}"))
}

/// The unit of a qperf figure as [`qperf_figure`] returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QperfUnit {
    Ns,
    GbPerS,
}

/// qperf's figure: "latency = X us" (as ns) or "bw = X GB/sec" (as GB/s).
pub fn qperf_figure(out: &str) -> Result<(f64, QperfUnit)> {
    for line in out.lines() {
        let Some((key, value)) = line.split_once('=') else { continue };
        let mut v = value.split_whitespace();
        let (Some(num), Some(unit)) = (v.next(), v.next()) else { continue };
        let Ok(num) = num.parse::<f64>() else { continue };
        let (scale, u) = match (key.trim(), unit) {
            ("latency", "ns") => (1.0, QperfUnit::Ns),
            ("latency", "us") => (1e3, QperfUnit::Ns),
            ("latency", "ms") => (1e6, QperfUnit::Ns),
            ("latency", "sec") => (1e9, QperfUnit::Ns),
            ("bw", "GB/sec") => (1.0, QperfUnit::GbPerS),
            ("bw", "MB/sec") => (1e-3, QperfUnit::GbPerS),
            ("bw", "KB/sec") => (1e-6, QperfUnit::GbPerS),
            ("bw", "bytes/sec") => (1e-9, QperfUnit::GbPerS),
            _ => continue,
        };
        return Ok((num * scale, u));
    }
    bail!("no latency or bw figure in qperf's output: {:?}", out.trim())
}

/// Whether a socket listens on TCP `port`: in this network namespace, or
/// in the one process `pid` is in (`/proc/PID/net/tcp{,6}` shows that).
pub fn listening(pid: Option<u32>, port: u16) -> bool {
    let want = format!(":{port:04X}");
    let dir = pid.map_or_else(|| "/proc/net".to_string(), |p| format!("/proc/{p}/net"));
    ["tcp", "tcp6"].iter().any(|f| {
        std::fs::read_to_string(format!("{dir}/{f}")).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_seen_and_a_closed_port_is_not() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening(None, port));
        assert!(listening(Some(std::process::id()), port));
        drop(l);
        assert!(!listening(None, port));
    }
}
