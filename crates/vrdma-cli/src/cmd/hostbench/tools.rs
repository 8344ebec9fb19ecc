//! The measurements of `vrdma bench-hosts`, each a server in host 1's
//! namespace and a client in host 2's, and the parsers of their output.
//!
//! vRDMA: perftest's `ib_write_bw` and `ib_write_lat` through the drop-in
//! library, each side on its own host's daemon. Anchors: `iperf3` (TCP
//! bandwidth) and `qperf tcp_lat` (TCP ping-pong) on the same veth pair,
//! with vrdma's own busy-polling ping-pong ([`super::pingpong`]) for
//! reference.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use super::hosts::Hosts;
use crate::tool_output::{perftest_column, qperf_figure, QperfUnit};

/// A program the benchmark needs, and the Debian package that has it.
pub struct Tool {
    pub program: &'static str,
    pub package: &'static str,
}

pub const TOOLS: [Tool; 6] = [
    Tool { program: "ip", package: "iproute2" },
    Tool { program: "iperf3", package: "iperf3" },
    Tool { program: "qperf", package: "qperf" },
    Tool { program: "ib_write_bw", package: "perftest" },
    Tool { program: "ib_write_lat", package: "perftest" },
    Tool { program: super::cmtime::PROGRAM, package: "rdmacm-utils" },
];

/// Which of the `needed` programs are missing from `PATH`, as "program
/// (apt-get install package)".
pub fn missing_tools(needed: &[&str]) -> Vec<String> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    TOOLS
        .iter()
        .filter(|t| needed.contains(&t.program))
        .filter(|t| !std::env::split_paths(&path).any(|d| is_executable(&d.join(t.program))))
        .map(|t| format!("{} (apt-get install {})", t.program, t.package))
        .collect()
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Durations and sizes of one run.
#[derive(Clone, Copy)]
pub struct Plan {
    /// Seconds of each bandwidth measurement (iperf3 -t, perftest -D).
    pub bw_secs: u32,
    /// Seconds of qperf's tcp_lat.
    pub lat_secs: u32,
    /// Iterations of ib_write_lat.
    pub lat_iters: u32,
    /// Connections of cmtime's `-c N` row and its TCP anchor.
    pub cm_conns: usize,
}

/// TCP ports inside the namespaces (private to them, so fixed ones do).
const IPERF_PORT: u16 = 5201;
const QPERF_PORT: u16 = 19765;
const PINGPONG_PORT: u16 = 19766;
/// perftest's port; a new one per measurement, so that no socket of the
/// previous one in TIME_WAIT is in the way.
static PERFTEST_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(18515);

fn next_perftest_port() -> u16 {
    PERFTEST_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// `vrdma cm-setup`'s three ports (rdma_cm, TCP, control), new ones per
/// measurement for the same reason.
static CM_SETUP_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(19800);

/// How long past its nominal duration a client may take before it is
/// counted as hung.
const SLACK: Duration = Duration::from_secs(60);
/// How long a server that exits by itself after one client may take.
const GRACE: Duration = Duration::from_secs(5);

/// Runs the client in host 2 to completion (bounded), then gives the
/// server `grace` to finish on its own before stopping it; returns the
/// client's stdout.
fn client(
    h: &mut Hosts,
    program: &str,
    args: &[&str],
    shim: bool,
    secs: u32,
    grace: Duration,
) -> Result<String> {
    let mut c = h.spawn(1, program, args, shim)?;
    let r = c.wait(Duration::from_secs(secs.into()) + SLACK);
    h.stop_servers(grace);
    let status = r?;
    if !status.success() {
        h.check_daemons()?;
        bail!("{} failed ({status}){}", c.name, c.tail());
    }
    Ok(c.output())
}

/// iperf3 with `streams` parallel streams: Gbit/s received.
pub fn iperf3(h: &mut Hosts, streams: u32, secs: u32) -> Result<f64> {
    let port = IPERF_PORT.to_string();
    h.server("iperf3", &["-s", "-1", "-p", &port], false, IPERF_PORT)?;
    let server = h.hosts[0].addr.to_string();
    let (p, t) = (streams.to_string(), secs.to_string());
    let out =
        client(h, "iperf3", &["-c", &server, "-p", &port, "-P", &p, "-t", &t, "-J"], false, secs, GRACE)?;
    parse_iperf3(&out).context("iperf3's JSON report")
}

/// iperf3 with one stream, both ends under the sockets preload `lib`
/// (docs/sockets.md, "Other hosts"): Gbit/s received. Both of its
/// connections must be carried, or this fails rather than read TCP as
/// vRDMA.
pub fn sockets_iperf3(h: &mut Hosts, lib: &Path, secs: u32) -> Result<f64> {
    let port = IPERF_PORT.to_string();
    h.server_sockets("iperf3", &["-s", "-1", "-p", &port], lib, IPERF_PORT)?;
    let server = h.hosts[0].addr.to_string();
    let t = secs.to_string();
    let out = sockets_client(h, lib, "iperf3", &["-c", &server, "-p", &port, "-t", &t, "-J"], secs, 2)?;
    parse_iperf3(&out).context("iperf3's JSON report, under the sockets preload")
}

/// vrdma's busy-polling TCP ping-pong ([`spin_lat`]'s) with 8-byte
/// messages, both ends under the sockets preload `lib`: median one-way
/// latency in µs, its connection carried. (Not qperf: its server serves
/// each client in a forked child, and a carried connection is not shared
/// with a child yet, docs/sockets.md.)
pub fn sockets_lat(h: &mut Hosts, lib: &Path, iters: u32) -> Result<f64> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let exe = exe.to_str().context("the vrdma executable's path is not UTF-8")?.to_string();
    let listen = format!("{}:{PINGPONG_PORT}", h.hosts[0].addr);
    h.server_sockets(&exe, &["tcp-pingpong", "--listen", &listen], lib, PINGPONG_PORT)?;
    let n = iters.to_string();
    let out = sockets_client(h, lib, &exe, &["tcp-pingpong", "--connect", &listen, "--iters", &n], 10, 1)?;
    parse_pingpong(&out).with_context(|| format!("tcp-pingpong's report:\n{out}"))
}

/// [`client`] under the sockets preload: its output, once at least
/// `carried` of its connections said they were carried over vRDMA.
fn sockets_client(
    h: &mut Hosts,
    lib: &Path,
    program: &str,
    args: &[&str],
    secs: u32,
    carried: usize,
) -> Result<String> {
    let mut c = h.spawn_sockets(1, program, args, lib)?;
    let r = c.wait(Duration::from_secs(secs.into()) + SLACK);
    h.stop_servers(GRACE);
    let status = r?;
    if !status.success() {
        h.check_daemons()?;
        bail!("{} failed ({status}){}", c.name, c.tail());
    }
    let stderr = std::fs::read_to_string(&c.stderr).unwrap_or_default();
    let said = stderr.matches("carried over vRDMA").count();
    // The library's line for a failed work completion: the connection
    // broke (whatever the program made of it).
    if stderr.contains("work completion") {
        bail!("{}: a carried connection's work failed{}", c.name, c.tail());
    }
    if said < carried {
        bail!("{}: {said} of its connections carried over vRDMA, not {carried}{}", c.name, c.tail());
    }
    Ok(c.output())
}

/// qperf tcp_lat with 8-byte messages: one-way latency in µs.
pub fn tcp_lat(h: &mut Hosts, secs: u32) -> Result<f64> {
    let port = QPERF_PORT.to_string();
    h.server("qperf", &["-lp", &port], false, QPERF_PORT)?;
    let server = h.hosts[0].addr.to_string();
    let t = secs.to_string();
    let out = client(
        h,
        "qperf",
        &[&server, "-lp", &port, "-t", &t, "-m", "8", "tcp_lat"],
        false,
        secs,
        Duration::ZERO,
    )?;
    parse_qperf_latency(&out).with_context(|| format!("qperf's tcp_lat report:\n{out}"))
}

/// ib_write_bw with 1 MiB messages on `qps` QPs: Gbit/s.
pub fn write_bw(h: &mut Hosts, qps: u32, secs: u32) -> Result<f64> {
    let port = next_perftest_port();
    let (p, q, d) = (port.to_string(), qps.to_string(), secs.to_string());
    let args = ["-d", "vrdma0", "-p", &p, "-s", "1048576", "-q", &q, "-D", &d, "--report_gbits", "-F"];
    h.server("ib_write_bw", &args, true, port)?;
    let server = h.hosts[0].addr.to_string();
    let mut cargs = args.to_vec();
    cargs.push(&server);
    let out = client(h, "ib_write_bw", &cargs, true, secs, GRACE)?;
    parse_perftest_bw(&out).with_context(|| format!("ib_write_bw's report:\n{out}"))
}

/// ib_write_lat with 8-byte messages: perftest's typical (median)
/// one-way latency in µs.
pub fn write_lat(h: &mut Hosts, iters: u32) -> Result<f64> {
    let port = next_perftest_port();
    let (p, n) = (port.to_string(), iters.to_string());
    let args = ["-d", "vrdma0", "-p", &p, "-s", "8", "-n", &n, "-F"];
    h.server("ib_write_lat", &args, true, port)?;
    let server = h.hosts[0].addr.to_string();
    let mut cargs = args.to_vec();
    cargs.push(&server);
    let out = client(h, "ib_write_lat", &cargs, true, 10, GRACE)?;
    parse_perftest_lat(&out).with_context(|| format!("ib_write_lat's report:\n{out}"))
}

/// vrdma's own busy-polling TCP ping-pong (`vrdma tcp-pingpong`) with
/// 8-byte messages: median one-way latency in µs.
pub fn spin_lat(h: &mut Hosts, iters: u32) -> Result<f64> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let exe = exe.to_str().context("the vrdma executable's path is not UTF-8")?.to_string();
    let listen = format!("{}:{PINGPONG_PORT}", h.hosts[0].addr);
    h.server(&exe, &["tcp-pingpong", "--listen", &listen], false, PINGPONG_PORT)?;
    let n = iters.to_string();
    let out = client(h, &exe, &["tcp-pingpong", "--connect", &listen, "--iters", &n], false, 10, GRACE)?;
    parse_pingpong(&out).with_context(|| format!("tcp-pingpong's report:\n{out}"))
}

/// rdma_cm connection setup (`vrdma cm-setup`, its listener in host 1,
/// its client in host 2, `count` connections in a row) and TCP connect +
/// accept between the same two processes: (first, each) in µs for rdma_cm,
/// then for TCP.
pub fn cm_setup(h: &mut Hosts, count: u32) -> Result<[(f64, f64); 2]> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let exe = exe.to_str().context("the vrdma executable's path is not UTF-8")?.to_string();
    let port = CM_SETUP_PORT.fetch_add(3, std::sync::atomic::Ordering::Relaxed);
    let (addr, p, n) = (h.hosts[0].addr.to_string(), port.to_string(), count.to_string());
    // The control port opens last: when it listens, everything does.
    h.server(&exe, &["cm-setup", "--listen", &addr, "--port", &p, "--count", &n], true, port + 2)?;
    let out =
        client(h, &exe, &["cm-setup", "--connect", &addr, "--port", &p, "--count", &n], true, 10, GRACE)?;
    let parse =
        |name| super::cm_setup::parse(&out, name).with_context(|| format!("cm-setup's report:\n{out}"));
    Ok([parse("rdma_cm")?, parse("tcp")?])
}

/// `one-way median: X us`.
pub fn parse_pingpong(out: &str) -> Result<f64> {
    out.lines()
        .find_map(|l| l.strip_prefix("one-way median:")?.trim().strip_suffix("us")?.trim().parse().ok())
        .context("no \"one-way median\" line")
}

/// `end.sum_received.bits_per_second`, in Gbit/s.
pub fn parse_iperf3(json: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_str(json).context("not JSON")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("iperf3: {e}");
    }
    let bps = v
        .pointer("/end/sum_received/bits_per_second")
        .and_then(|b| b.as_f64())
        .context("no end.sum_received.bits_per_second")?;
    Ok(bps / 1e9)
}

/// qperf's `latency = X unit`, in µs.
pub fn parse_qperf_latency(out: &str) -> Result<f64> {
    match qperf_figure(out)? {
        (ns, QperfUnit::Ns) => Ok(ns / 1e3),
        _ => bail!("no \"latency =\" line"),
    }
}

/// ib_write_bw's "BW average" column (the fourth: bytes, iterations, peak,
/// average, message rate), in Gbit/s as `--report_gbits` prints it.
pub fn parse_perftest_bw(out: &str) -> Result<f64> {
    perftest_column(out, "BW_average[Gb/sec]")
}

/// ib_write_lat's `t_typical` column (its median), in µs.
pub fn parse_perftest_lat(out: &str) -> Result<f64> {
    perftest_column(out, "t_typical[usec]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_iperf3_json() {
        let j = r#"{"start":{},"end":{"sum_sent":{"bits_per_second":2.1e10},
                   "sum_received":{"bits_per_second":2.0e10}}}"#;
        assert_eq!(parse_iperf3(j).unwrap(), 20.0);
        assert!(parse_iperf3(r#"{"error":"unable to connect"}"#).is_err());
    }

    #[test]
    fn parses_pingpong() {
        assert_eq!(parse_pingpong("one-way median: 7.125 us\n").unwrap(), 7.125);
        assert!(parse_pingpong("nothing here\n").is_err());
    }

    #[test]
    fn parses_qperf_latency() {
        let out = "tcp_lat:\n    latency  =  15.3 us\n";
        assert_eq!(parse_qperf_latency(out).unwrap(), 15.3);
        let out = "tcp_lat:\n    latency  =  980 ns\n";
        assert!((parse_qperf_latency(out).unwrap() - 0.98).abs() < 1e-9);
        assert!(parse_qperf_latency("tcp_lat:\n").is_err());
    }

    #[test]
    fn parses_perftest_rows() {
        let bw = "---\n #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n \
                  1048576    12345            0.00               9.87                 0.001176\n---\n";
        assert_eq!(parse_perftest_bw(bw).unwrap(), 9.87);
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
                   t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n\
                   8       1000          20.10          85.00        25.50              26.00       \
                   3.00            40.00                    80.00\n";
        assert_eq!(parse_perftest_lat(lat).unwrap(), 25.5);
        assert!(parse_perftest_bw(lat).is_err());
    }
}
