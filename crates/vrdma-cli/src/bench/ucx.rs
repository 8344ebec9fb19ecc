//! The UCX anchor of `vrdma bench --direct`: UCX's own shared-memory
//! transport (`ucx_perftest -t tag_lat` with `UCX_TLS=posix,self`, a server
//! and a client process on loopback), the figure issue 17 sets the direct
//! path's 8 B latencies against (at most 2×), and its bandwidth
//! (`ucp_put_bw` beside RDMA writes, `tag_bw` beside sends, of the same
//! size) beside the direct path's 64 KiB and 1 MiB. Measured in the same run,
//! when `ucx_perftest` is installed (`ucx-utils`); absent, the figures that
//! need it are skipped, not failed.
//!
//! Both processes run without vRDMA (posix is UCX's shared memory, no
//! verbs). Each run is bounded in time, and each process is killed by its
//! pid if it outlives it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::anchors::Stat;
use super::reaped::Reaped;

/// How long one server/client pair may take.
const LIMIT: Duration = Duration::from_secs(60);

/// Whether `ucx_perftest` is on the `PATH`.
pub fn available() -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join("ucx_perftest").is_file())
}

/// A TCP port free on loopback now.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(l.local_addr()?.port())
}

/// One server/client pair of `test` (`tag_lat`, `ucp_put_bw`, `tag_bw`)
/// with `iters` messages of `size` bytes; the figure `parse` reads from the
/// client's output.
fn once(test: &str, size: usize, iters: u64, parse: fn(&str) -> Option<f64>) -> Result<f64> {
    let port = free_port()?.to_string();
    let server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .env("UCX_TLS", "posix,self")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the ucx_perftest server")?;
    let _server = Reaped(server);
    let end = Instant::now() + LIMIT;
    // The server listens within moments; the client is retried until then.
    loop {
        let client = Command::new("ucx_perftest")
            .args(["127.0.0.1", "-p", &port, "-t", test, "-s", &size.to_string(), "-n", &iters.to_string()])
            .env("UCX_TLS", "posix,self")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the ucx_perftest client")?;
        let mut client = Reaped(client);
        while matches!(client.0.try_wait(), Ok(None)) {
            if Instant::now() > end {
                bail!("ucx_perftest {test} ran past {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut out = String::new();
        if let Some(mut o) = client.0.stdout.take() {
            use std::io::Read;
            let _ = o.read_to_string(&mut out);
        }
        if let Some(v) = parse(&out) {
            return Ok(v);
        }
        if Instant::now() > end {
            bail!("ucx_perftest {test} printed no result");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The 50th-percentile latency (µs) of ucx_perftest's "Final:" row:
/// `Final: <iterations> <50%ile> <average> <overall> ...`.
pub fn parse_final(out: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let v: f64 = line.split_whitespace().nth(2)?.parse().ok()?;
    (v.is_finite() && v > 0.0).then_some(v)
}

/// The overall bandwidth of ucx_perftest's "Final:" row in GB/s (1e9 B/s):
/// `Final: <iterations> <50%ile> <average> <overall> <bw average> <bw
/// overall> ...`, the bandwidth in MB/s of 2^20 bytes.
pub fn parse_final_bw_gbs(out: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let mib: f64 = line.split_whitespace().nth(6)?.parse().ok()?;
    (mib.is_finite() && mib > 0.0).then_some(mib * 1_048_576.0 / 1e9)
}

/// UCX posix `tag_lat`, 8 B, one way: the median of `runs` runs' medians.
pub fn posix_tag_lat_ns(iters: u64, runs: usize) -> Result<Stat> {
    if !available() {
        return Err(anyhow!("ucx_perftest is not installed (ucx-utils)"));
    }
    let lat_ns = |out: &str| parse_final(out).map(|us| us * 1000.0);
    let samples = (0..runs.max(1)).map(|_| once("tag_lat", 8, iters, lat_ns)).collect::<Result<Vec<_>>>()?;
    Ok(Stat::from_samples(&samples))
}

/// UCX posix bandwidth of `test` (`ucp_put_bw`, the one-sided put that an
/// RDMA write is; `tag_bw`, the tagged send a SEND is) with `size`-byte
/// messages, GB/s: the median of `runs` runs' overall bandwidth.
pub fn posix_bw_gbs(test: &str, size: usize, iters: u64, runs: usize) -> Result<Stat> {
    if !available() {
        return Err(anyhow!("ucx_perftest is not installed (ucx-utils)"));
    }
    let samples =
        (0..runs.max(1)).map(|_| once(test, size, iters, parse_final_bw_gbs)).collect::<Result<Vec<_>>>()?;
    Ok(Stat::from_samples(&samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_rows_median_is_read() {
        let out = "[thread 0]  124  4002.845  4031.911  4031.911  0.00  0.00  248  248\n\
                   Final:                 20000      0.170    13.148    38.064        0.58       0.20       76058       26271\n";
        assert_eq!(parse_final(out), Some(0.170));
        assert_eq!(parse_final("no table"), None);
        assert_eq!(parse_final("Final: 1 nan 2"), None);
        let bw = "Final:                  2000      1.184     3.773     3.773    16563.09   16563.09      265009      265009\n";
        let got = parse_final_bw_gbs(bw).unwrap();
        assert!((got - 16563.09 * 1_048_576.0 / 1e9).abs() < 1e-6, "{got}");
        assert_eq!(parse_final_bw_gbs("Final: 1 2 3 4 5"), None);
    }
}
