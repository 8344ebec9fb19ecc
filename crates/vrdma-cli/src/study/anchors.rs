//! The anchors, run between the same two places as the study's own
//! figures: qperf's tcp_bw/tcp_lat and iperf3 beside the TCP figures,
//! perftest (ib_write_bw, ib_write_lat on the drop-in libibverbs.so.1,
//! with each side on its place's daemon) beside the vRDMA figures.
//! A tool that is not installed is skipped with a note.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};

use super::placement::Place;
use super::proc::{self, free_port, wait_listening};
use crate::tool_output::{perftest_column, qperf_figure, QperfUnit};

/// What the anchors need from the run.
pub struct Ctx<'a> {
    pub logs: &'a Path,
    pub run_id: &'a str,
    /// The directory holding libibverbs.so.1 (and the companions), if perftest can run.
    pub lib_dir: Option<&'a Path>,
}

const LISTEN: Duration = Duration::from_secs(20);

/// `program` on PATH, if it is there.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

fn log(ctx: &Ctx, name: &str) -> PathBuf {
    ctx.logs.join(format!("anchor-{name}.log"))
}

/// qperf `test` (tcp_bw or tcp_lat) with `-m size` for `secs`: GB/s or one-way µs.
pub fn qperf(ctx: &Ctx, send: &Place, recv: &Place, test: &str, size: u64, secs: f64) -> Result<f64> {
    let qperf = which("qperf").ok_or_else(|| anyhow!("qperf is not installed"))?;
    let port = free_port(recv.netns.as_deref(), recv.addr)?;
    let mut server = proc::spawn(
        "qperf server",
        {
            let mut c = Command::new(&qperf);
            c.args(["-lp", &port.to_string()]);
            c
        },
        &recv.at(None),
        ctx.run_id,
        &log(ctx, "qperf"),
    )?;
    wait_listening(&mut server, port, LISTEN)?;
    let mut c = Command::new(&qperf);
    c.arg(recv.addr.to_string())
        .args(["-lp", &port.to_string(), "-t", &format!("{:.0}", secs.ceil().max(1.0))])
        .args(["-m", &size.to_string(), test]);
    let out = proc::spawn("qperf", c, &send.at(None), ctx.run_id, &log(ctx, "qperf"))?
        .finish(Duration::from_secs_f64(secs + 30.0))?;
    drop(server);
    qperf_value(&out)
}

/// qperf's figure: GB/s, or one-way µs.
pub fn qperf_value(out: &str) -> Result<f64> {
    let (v, unit) = qperf_figure(out)?;
    Ok(match unit {
        QperfUnit::GbPerS => v,
        QperfUnit::Ns => v / 1e3,
    })
}

/// iperf3 moving `bytes` in `streams` parallel streams: GB/s received.
pub fn iperf3(ctx: &Ctx, send: &Place, recv: &Place, bytes: u64, streams: u32) -> Result<f64> {
    let iperf3 = which("iperf3").ok_or_else(|| anyhow!("iperf3 is not installed"))?;
    let port = free_port(recv.netns.as_deref(), recv.addr)?;
    let mut s = Command::new(&iperf3);
    s.args(["-s", "-1", "-B", &recv.addr.to_string(), "-p", &port.to_string()]);
    let mut server = proc::spawn("iperf3 server", s, &recv.at(None), ctx.run_id, &log(ctx, "iperf3"))?;
    wait_listening(&mut server, port, LISTEN)?;
    let mut c = Command::new(&iperf3);
    c.args(["-c", &recv.addr.to_string(), "-p", &port.to_string(), "-J"]).args([
        "-n",
        &bytes.to_string(),
        "-P",
        &streams.to_string(),
    ]);
    // At 10 MB/s (far below any loopback) plus the start.
    let limit = Duration::from_secs(30 + bytes / 10_000_000);
    let out = proc::spawn("iperf3", c, &send.at(None), ctx.run_id, &log(ctx, "iperf3"))?.finish(limit)?;
    let _ = server.finish(Duration::from_secs(5));
    iperf3_value(&out)
}

/// iperf3's `-J` output: GB/s received.
pub fn iperf3_value(out: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_str(out).context("iperf3's JSON")?;
    if let Some(e) = v["error"].as_str() {
        bail!("iperf3: {e}");
    }
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| anyhow!("no end.sum_received.bits_per_second in iperf3's JSON"))?;
    Ok(bps / 8e9)
}

/// perftest `tool` (ib_write_bw or ib_write_lat) through the drop-in
/// library, `iters` messages of `size` bytes: GB/s (BW average) or
/// one-way µs (t_typical, its median).
pub fn perftest(ctx: &Ctx, send: &Place, recv: &Place, tool: &str, size: u64, iters: u64) -> Result<f64> {
    let lib_dir = ctx.lib_dir.ok_or_else(|| anyhow!("the drop-in library is not built"))?;
    let program = which(tool).ok_or_else(|| anyhow!("{tool} is not installed (apt-get install perftest)"))?;
    let port = free_port(recv.netns.as_deref(), recv.addr)?;
    let common = ["-d", "vrdma0", "-p", &port.to_string(), "-s", &size.to_string(), "-n", &iters.to_string()]
        .map(String::from);
    let cmd = |place: &Place| {
        let mut c = Command::new(&program);
        c.args(&common).env("LD_LIBRARY_PATH", lib_dir).env(vrdma::SOCKET_ENV, &place.socket);
        c
    };
    let mut server =
        proc::spawn(&format!("{tool} server"), cmd(recv), &recv.at(None), ctx.run_id, &log(ctx, tool))?;
    wait_listening(&mut server, port, LISTEN)?;
    let mut c = cmd(send);
    c.arg(recv.addr.to_string());
    let limit = Duration::from_secs(60 + size * iters / 10_000_000);
    let out = proc::spawn(tool, c, &send.at(None), ctx.run_id, &log(ctx, tool))?.finish(limit)?;
    let _ = server.finish(Duration::from_secs(15));
    perftest_value(tool, &out)
}

/// perftest `tool`'s figure: one-way µs (t_typical) or GB/s (BW average).
pub fn perftest_value(tool: &str, out: &str) -> Result<f64> {
    if tool.ends_with("_lat") {
        perftest_column(out, "t_typical[usec]")
    } else {
        // perftest's MB/sec is MiB/s.
        Ok(perftest_column(out, "BW_average[MB/sec]")? * 1_048_576.0 / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_outputs_parse() {
        let (v, _) = qperf_figure("tcp_lat:\n    latency  =  12.8 us\n").unwrap();
        assert_eq!(v, 12_800.0);
        let (v, _) = qperf_figure("tcp_bw:\n    bw  =  950 MB/sec\n").unwrap();
        assert!((v - 0.95).abs() < 1e-12);
        assert!(qperf_figure("failed\n").is_err());
        let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                  65536      2000             33903.70            31261.12\t\t   0.500178\n";
        assert_eq!(perftest_column(bw, "BW_average[MB/sec]").unwrap(), 31261.12);
        assert!(perftest_column("nothing\n", "t_typical[usec]").is_err());
    }
}
