//! The bench's tests again through unmodified tools (Debian's perftest
//! and qperf) on the drop-in `libibverbs.so.1`, against the same daemon,
//! so that their figures print beside vrdma bench's own: the ratio shows
//! what the shim costs on the data path.
//!
//! The library directory is made as `vrdma run` makes it (its helpers).
//! Every process runs under a deadline and is killed by pid past it; a
//! missing tool or library makes its section say "not available" and the
//! bench goes on.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::Serialize;

use crate::cmd::run::{check_build_id, find_companions, find_library, LibDir};
use crate::tool_output::{listening, perftest_column, qperf_figure};

/// vrdma bench's own figures for the compared tests (latency in ns, with
/// the definitions of [`SPECS`]; bandwidth in GB/s = 1e9 B/s).
#[derive(Debug, Default, Clone)]
pub struct Own {
    pub write_lat_ns: Option<f64>,
    pub read_lat_ns: Option<f64>,
    pub send_lat_ns: Option<f64>,
    pub write_bw_gbs: Option<f64>,
    pub read_bw_gbs: Option<f64>,
    pub send_bw_gbs: Option<f64>,
}

/// One tool's figure for one test.
#[derive(Debug, Clone, Serialize)]
pub struct ToolFigure {
    pub command: String,
    /// perftest latency: t_typical (its median); qperf: its mean; perftest
    /// bandwidth: BW average. In the row's unit.
    pub value: Option<f64>,
    /// perftest latency only: t_avg, in the row's unit.
    pub avg: Option<f64>,
    /// value / vrdma bench's own.
    pub ratio: Option<f64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub test: &'static str,
    pub unit: &'static str,
    pub definition: &'static str,
    pub own: Option<f64>,
    pub perftest: Option<ToolFigure>,
    pub qperf: Option<ToolFigure>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tools {
    /// Why perftest's column is empty, if it is.
    pub perftest_unavailable: Option<String>,
    pub qperf_unavailable: Option<String>,
    pub rows: Vec<Row>,
}

struct Spec {
    test: &'static str,
    unit: &'static str,
    definition: &'static str,
    perftest: &'static str,
    qperf: &'static str,
    own: fn(&Own) -> Option<f64>,
}

const LAT_ONE_WAY: &str = "one way = round trip / 2 (all three halve their ping-pong)";
const LAT_READ: &str =
    "whole read per op = a round trip, not halved (ib_read_lat, rc_rdma_read_lat and vrdma bench alike)";
const BW: &str = "GB/s = 1e9 B/s (perftest's MB/sec is MiB/s, converted)";

const SPECS: [Spec; 6] = [
    Spec {
        test: "RDMA write 8 B latency",
        unit: "ns",
        definition: LAT_ONE_WAY,
        perftest: "ib_write_lat",
        qperf: "rc_rdma_write_lat",
        own: |o| o.write_lat_ns,
    },
    Spec {
        test: "RDMA read 8 B latency",
        unit: "ns",
        definition: LAT_READ,
        perftest: "ib_read_lat",
        qperf: "rc_rdma_read_lat",
        own: |o| o.read_lat_ns,
    },
    Spec {
        test: "send 8 B latency",
        unit: "ns",
        definition: LAT_ONE_WAY,
        perftest: "ib_send_lat",
        qperf: "rc_lat",
        own: |o| o.send_lat_ns,
    },
    Spec {
        test: "RDMA write 64 KiB bandwidth",
        unit: "GB/s",
        definition: BW,
        perftest: "ib_write_bw",
        qperf: "rc_rdma_write_bw",
        own: |o| o.write_bw_gbs,
    },
    Spec {
        test: "RDMA read 64 KiB bandwidth",
        unit: "GB/s",
        definition: BW,
        perftest: "ib_read_bw",
        qperf: "rc_rdma_read_bw",
        own: |o| o.read_bw_gbs,
    },
    Spec {
        test: "send 64 KiB bandwidth",
        unit: "GB/s",
        definition: BW,
        perftest: "ib_send_bw",
        qperf: "rc_bw",
        own: |o| o.send_bw_gbs,
    },
];

const BUILD_HINT: &str = "build it with `cargo build --release --workspace`";

/// Runs the tools that are installed against the daemon at `sock`.
pub fn compare(sock: &Path, own: &Own, quick: bool, progress: bool) -> Tools {
    let mut tools = Tools {
        perftest_unavailable: None,
        qperf_unavailable: None,
        rows: SPECS
            .iter()
            .map(|s| Row {
                test: s.test,
                unit: s.unit,
                definition: s.definition,
                own: (s.own)(own),
                perftest: None,
                qperf: None,
            })
            .collect(),
    };
    let lib = match find_library() {
        Ok(l) => l,
        Err(e) => {
            let why = format!("the drop-in library is missing ({e:#}); {BUILD_HINT}");
            tools.perftest_unavailable = Some(why.clone());
            tools.qperf_unavailable = Some(why);
            return tools;
        }
    };
    if let Err(e) = check_build_id(&lib) {
        let why = format!("{e:#}");
        tools.perftest_unavailable = Some(why.clone());
        tools.qperf_unavailable = Some(why);
        return tools;
    }
    let companions = find_companions().ok().flatten();
    let dir = match LibDir::create(&lib, companions.as_deref()) {
        Ok(d) => d,
        Err(e) => {
            let why = format!("cannot set up the library directory: {e:#}");
            tools.perftest_unavailable = Some(why.clone());
            tools.qperf_unavailable = Some(why);
            return tools;
        }
    };
    let env = Env { lib_dir: dir.path().to_owned(), sock: sock.to_owned() };

    let perftest_missing = SPECS.iter().find_map(|s| which(s.perftest).is_none().then_some(s.perftest));
    if let Some(t) = perftest_missing {
        tools.perftest_unavailable = Some(format!("{t} is not on PATH (apt-get install perftest)"));
    } else if companions.is_none() {
        tools.perftest_unavailable = Some(format!(
            "libvrdma_companions.so (perftest needs it to load) is not next to the vrdma executable; \
             {BUILD_HINT}"
        ));
    } else {
        let (lat_n, bw_n) = if quick { (2_000, 2_000) } else { (10_000, 10_000) };
        for (spec, row) in SPECS.iter().zip(&mut tools.rows) {
            if progress {
                eprintln!("  perftest {} ...", spec.perftest);
            }
            let (size, n) = if spec.unit == "ns" { ("8", lat_n) } else { ("65536", bw_n) };
            row.perftest = Some(figure(row.own, env.perftest(spec.perftest, size, n)));
        }
    }

    match which("qperf") {
        None => tools.qperf_unavailable = Some("qperf is not on PATH (apt-get install qperf)".into()),
        Some(qperf) => match QperfServer::start(&env, &qperf) {
            Err(e) => tools.qperf_unavailable = Some(format!("the qperf server did not start: {e:#}")),
            Ok(server) => {
                let secs = if quick { "1" } else { "2" };
                for (spec, row) in SPECS.iter().zip(&mut tools.rows) {
                    if progress {
                        eprintln!("  qperf {} ...", spec.qperf);
                    }
                    let size = if spec.unit == "ns" { "8" } else { "64k" };
                    row.qperf = Some(figure(row.own, server.run(&env, &qperf, spec.qperf, size, secs)));
                }
            }
        },
    }
    tools
}

/// Whether perftest's `ib_write_lat` is installed.
pub fn write_lat_installed() -> bool {
    which("ib_write_lat").is_some()
}

/// perftest's `ib_write_lat` 8 B, `n` iterations, through the drop-in
/// library against the daemon at `sock`: its t_typical (median) in ns. A
/// stale drop-in library is refused with the reason.
pub fn write_lat_ns(sock: &Path, n: u64) -> Result<f64> {
    let lib = find_library()?;
    check_build_id(&lib)?;
    let companions = find_companions()?.ok_or_else(|| {
        anyhow!("libvrdma_companions.so (perftest needs it to load) is not next to the vrdma executable; {BUILD_HINT}")
    })?;
    let dir = LibDir::create(&lib, Some(&companions))?;
    let env = Env { lib_dir: dir.path().to_owned(), sock: sock.to_owned() };
    let (line, got) = env.perftest("ib_write_lat", "8", n);
    got.map(|(t, _)| t).with_context(|| line)
}

/// A measured (value, avg, command) or the error, as a table cell.
fn figure(own: Option<f64>, got: (String, Result<(f64, Option<f64>)>)) -> ToolFigure {
    let (command, got) = got;
    match got {
        Ok((value, avg)) => ToolFigure {
            command,
            value: Some(value),
            avg,
            ratio: own.filter(|o| *o > 0.0).map(|o| value / o),
            error: None,
        },
        Err(e) => ToolFigure { command, value: None, avg: None, ratio: None, error: Some(format!("{e:#}")) },
    }
}

/// `program` on PATH, if it is there.
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

struct Env {
    lib_dir: PathBuf,
    sock: PathBuf,
}

/// Limits: a server must listen within `LISTEN`; a client finishes within
/// `CLIENT`; a perftest server exits within `SERVER` after its client.
const LISTEN: Duration = Duration::from_secs(20);
const CLIENT: Duration = Duration::from_secs(90);
const SERVER: Duration = Duration::from_secs(15);

impl Env {
    fn command(&self, program: &Path) -> Command {
        let mut path = self.lib_dir.clone().into_os_string();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
            path.push(":");
            path.push(old);
        }
        let mut c = Command::new(program);
        c.env("LD_LIBRARY_PATH", path).env(vrdma::SOCKET_ENV, &self.sock);
        c
    }

    /// One perftest pair; returns the command line and (value, avg) in the
    /// row's unit.
    fn perftest(&self, tool: &str, size: &str, n: u64) -> (String, Result<(f64, Option<f64>)>) {
        let port = free_port();
        // -F: a failed clock calibration (a preempted sample) still gives
        // a report rather than exit 1.
        let common = ["-d", "vrdma0", "-p", &port.to_string(), "-s", size, "-n", &n.to_string(), "-F"]
            .map(String::from);
        let line = format!("{tool} {} 127.0.0.1", common.join(" "));
        let run = || -> Result<(f64, Option<f64>)> {
            let program = which(tool).ok_or_else(|| anyhow!("{tool} vanished"))?;
            let mut server = Proc::spawn(self.command(&program).args(&common))?;
            server.wait_listening(port)?;
            let client =
                Proc::spawn(self.command(&program).args(&common).arg("127.0.0.1"))?.finish(CLIENT)?;
            let _ = server.finish(SERVER);
            if size == "8" {
                let t = perftest_column(&client, "t_typical[usec]")?;
                Ok((t * 1e3, perftest_column(&client, "t_avg[usec]").ok().map(|a| a * 1e3)))
            } else {
                let mib = perftest_column(&client, "BW_average[MB/sec]")?;
                Ok((mib * 1_048_576.0 / 1e9, None))
            }
        };
        (line, run())
    }
}

/// The qperf server: it serves forever, so dropping it kills it by pid
/// (as [`Proc`]'s drop does).
struct QperfServer {
    _proc: Proc,
    port: u16,
}

impl QperfServer {
    fn start(env: &Env, qperf: &Path) -> Result<QperfServer> {
        let port = free_port();
        let mut proc = Proc::spawn(env.command(qperf).args(["-lp", &port.to_string()]))?;
        proc.wait_listening(port)?;
        Ok(QperfServer { _proc: proc, port })
    }

    fn run(
        &self,
        env: &Env,
        qperf: &Path,
        test: &str,
        size: &str,
        secs: &str,
    ) -> (String, Result<(f64, Option<f64>)>) {
        let port = self.port.to_string();
        let args = ["127.0.0.1", "-lp", &port, "-cp1", "-t", secs, "-m", size, test];
        let line = format!("qperf {}", args.join(" "));
        let run = || -> Result<(f64, Option<f64>)> {
            let out = Proc::spawn(env.command(qperf).args(args))?.finish(CLIENT)?;
            Ok((qperf_figure(&out)?.0, None))
        };
        (line, run())
    }
}

/// A child with its output collected; killed by pid if dropped running.
struct Proc {
    child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
}

fn reader(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

impl Proc {
    fn spawn(cmd: &mut Command) -> Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {:?}", cmd.get_program()))?;
        let out = child.stdout.take().map(reader);
        let err = child.stderr.take().map(reader);
        Ok(Proc { child, out, err })
    }

    /// Waits until something listens on `port` (looking, not connecting,
    /// or the server would take us for its client).
    fn wait_listening(&mut self, port: u16) -> Result<()> {
        let end = Instant::now() + LISTEN;
        while !listening(None, port) {
            if let Some(s) = self.child.try_wait()? {
                bail!("the server exited ({s}) before listening: {}", self.stderr_tail());
            }
            if Instant::now() > end {
                bail!("the server did not listen on port {port} within {LISTEN:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn stderr_tail(&mut self) -> String {
        let err = self.err.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(2)..].join(" / ")
    }

    /// Waits for the exit within `limit` (else kills it by pid); returns
    /// stdout if it exited 0.
    fn finish(mut self, limit: Duration) -> Result<String> {
        let end = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("pid {} did not finish within {limit:?}; killed", self.child.id());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let out = self.out.take().and_then(|h| h.join().ok()).unwrap_or_default();
        if !status.success() {
            bail!("exited with {status}: {}", self.stderr_tail());
        }
        Ok(out)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A TCP port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_or(18515, |a| a.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_tables_parse() {
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
                   t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
                   8       2000          2.15           5994.80      2.28     \t       119.57      \t606.65 \t\t3996.98 \t\t5982.82\n";
        assert_eq!(perftest_column(lat, "t_typical[usec]").unwrap(), 2.28);
        assert_eq!(perftest_column(lat, "t_avg[usec]").unwrap(), 119.57);
        assert_eq!(perftest_column(lat, "99.9%_percentile[usec]").unwrap(), 5982.82);
        let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                  65536      2000             33903.70            31261.12\t\t   0.500178\n";
        assert_eq!(perftest_column(bw, "BW_average[MB/sec]").unwrap(), 31261.12);
        assert!(perftest_column("nothing\n", "t_avg[usec]").is_err());
    }

    #[test]
    fn qperf_figures_parse() {
        assert_eq!(qperf_figure("rc_lat:\n    latency  =  12.8 us\n").unwrap().0, 12_800.0);
        assert_eq!(qperf_figure("rc_bw:\n    bw  =  18 GB/sec\n").unwrap().0, 18.0);
        assert!((qperf_figure("rc_bw:\n    bw  =  950 MB/sec\n").unwrap().0 - 0.95).abs() < 1e-12);
        assert!(qperf_figure("rc_bw:\nfailed\n").is_err());
    }
}
