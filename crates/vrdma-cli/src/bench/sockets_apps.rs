//! `vrdma bench --sockets`, real applications: Debian's `sockperf`
//! (ping-pong latency and throughput's message rate, 64-byte messages over
//! TCP), `redis-benchmark` (GET and SET requests per second, 4 clients)
//! and PostgreSQL's `pgbench` (select-only transactions per second, 4
//! clients: [`super::sockets_pg`]), each pair run plain and preloaded (on the direct-path
//! daemon of [`super::sockets`]), interleaved in the same run, each figure
//! beside its plain-TCP anchor with the ratio. A program that is not
//! installed leaves its rows out, saying so. A preloaded client must print
//! the library's "carried over vRDMA" line, or the run is an error rather
//! than TCP read as vRDMA. Every process is killed by its pid at the end
//! of its pair ([`Reaped`]).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::anchors::Stat;
use super::reaped::Reaped;
use super::Figure;

/// How long a client may run.
const LIMIT: Duration = Duration::from_secs(60);
/// How long a server may take to listen.
const LISTEN_LIMIT: Duration = Duration::from_secs(10);
const CARRIED: &str = "carried over vRDMA";

fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// A port nobody listens on now (bound then released).
pub(super) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// Whether a socket listens on `port`, from /proc (a probe connection
/// would be a client of the server's).
pub(super) fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).unwrap_or_default().lines().skip(1).any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
    })
}

/// Preloaded on the daemon at `sock`, or plain (`None`).
pub(super) fn command(program: &Path, args: &[&str], preload: Option<(&Path, &Path)>) -> Command {
    let mut c = Command::new(program);
    c.args(args).env_remove("LD_PRELOAD").env_remove("VRDMA_SOCKETS_DEBUG");
    if let Some((lib, sock)) = preload {
        c.env("LD_PRELOAD", lib).env(vrdma::SOCKET_ENV, sock).env("VRDMA_SOCKETS_DEBUG", "1");
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// A server started and listening on `port`.
fn server(mut c: Command, port: u16) -> Result<Reaped> {
    // Its output is not read: nothing into a pipe that could fill.
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let mut s = Reaped(c.spawn().with_context(|| format!("starting {c:?}"))?);
    let end = Instant::now() + LISTEN_LIMIT;
    while !listening(port) {
        if s.0.try_wait()?.is_some() || Instant::now() > end {
            bail!("{c:?} did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(s)
}

/// Runs a client to its end (killed at [`LIMIT`]): its stdout, checked
/// for the carried line when preloaded.
pub(super) fn client(c: Command, preloaded: bool) -> Result<String> {
    let what = format!("{c:?}");
    let mut c = c;
    let mut p = Reaped(c.spawn().with_context(|| format!("starting {what}"))?);
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(p.0.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let err = drain(p.0.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let end = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = p.0.try_wait()? {
            break s;
        }
        if Instant::now() > end {
            bail!("{what} ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    if !status.success() {
        bail!("{what} failed ({status}): {}", err.trim());
    }
    if preloaded && !err.contains(CARRIED) {
        bail!("{what}: its connection was not carried over vRDMA: {}", err.trim());
    }
    Ok(out)
}

/// The number after `key` on the first line holding it.
pub(super) fn after(out: &str, key: &str) -> Result<f64> {
    out.lines()
        .find_map(|l| {
            let rest = &l[l.find(key)? + key.len()..];
            let first = rest.split(|c: char| c.is_whitespace() || c == ',').find(|w| !w.is_empty())?;
            first.trim_matches('"').parse().ok()
        })
        .with_context(|| format!("no {key:?} in {out:?}"))
}

/// sockperf's ping-pong latency (ns, one way as sockperf reports it) and
/// throughput message rate (msg/s).
fn sockperf(bin: &Path, preload: Option<(&Path, &Path)>, secs: &str) -> Result<[f64; 2]> {
    let port = free_port()?;
    let p = port.to_string();
    let _s = server(command(bin, &["server", "--tcp", "-i", "127.0.0.1", "-p", &p], preload), port)?;
    let run = |mode: &str| {
        let args = [mode, "--tcp", "-i", "127.0.0.1", "-p", &p, "-t", secs, "-m", "64"];
        client(command(bin, &args, preload), preload.is_some())
    };
    let lat = after(&run("ping-pong")?, "Summary: Latency is")? * 1e3;
    let rate = after(&run("throughput")?, "Summary: Message Rate is")?;
    Ok([lat, rate])
}

/// redis-benchmark's SET and GET requests per second.
fn redis(server_bin: &Path, bench: &Path, preload: Option<(&Path, &Path)>, n: &str) -> Result<[f64; 2]> {
    let dir = tempfile_dir()?;
    let port = free_port()?;
    let p = port.to_string();
    let d = dir.display().to_string();
    let args = ["--port", &p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", &d];
    let s = server(command(server_bin, &args, preload), port);
    let r = s.and_then(|_s| {
        let args = ["-h", "127.0.0.1", "-p", &p, "-t", "set,get", "-n", n, "-c", "4", "--csv"];
        let out = client(command(bench, &args, preload), preload.is_some())?;
        Ok([after(&out, "\"SET\",")?, after(&out, "\"GET\",")?])
    });
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// A private directory for redis-server's files.
fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("vrdma-bench-redis-{}-{}", std::process::id(), free_port()?));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// A figure's samples: [plain, preloaded].
type Samples = [Vec<f64>; 2];

/// The rows, for the programs installed; `sock` is the daemon the
/// preloaded runs use.
pub fn figures(
    lib: &Path,
    sock: &Path,
    quick: bool,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) -> Result<Vec<Figure>> {
    let (secs, n) = if quick { ("1", "5000") } else { ("3", "50000") };
    let sp = find("sockperf");
    let rd = find("redis-server").zip(find("redis-benchmark"));
    if sp.is_none() {
        progress("sockets: sockperf is not installed (apt-get install sockperf), its rows are left out");
    }
    if rd.is_none() {
        progress("sockets: redis is not installed (apt-get install redis-server redis-tools), its rows are left out");
    }
    let pg = match super::sockets_pg::find() {
        Ok((bin, user)) => Some(super::sockets_pg::Cluster::init(bin, user)?),
        Err(why) => {
            progress(&format!("sockets: {why}, its row is left out"));
            None
        }
    };
    let [mut sp_lat, mut sp_rate, mut set, mut get, mut pg_tps]: [Samples; 5] = Default::default();
    for run in 0..runs {
        progress(&format!("sockets, real applications: run {}/{runs}", run + 1));
        for (i, preload) in [None, Some((lib, sock))].into_iter().enumerate() {
            if let Some(bin) = &sp {
                let [l, r] = sockperf(bin, preload, secs)?;
                sp_lat[i].push(l);
                sp_rate[i].push(r);
            }
            if let Some((srv, bench)) = &rd {
                let [s, g] = redis(srv, bench, preload, n)?;
                set[i].push(s);
                get[i].push(g);
            }
            if let Some(c) = &pg {
                pg_tps[i].push(c.select_tps(preload, secs)?);
            }
        }
    }
    let figure = |name: &str, unit: &'static str, v: &Samples, target: &str| {
        let (value, anchor) = (Stat::from_samples(&v[1]), Stat::from_samples(&v[0]));
        let name = format!("sockets preload, {name}, direct path on");
        Figure::beside(name, unit, value, "the same program, plain TCP, loopback", anchor, target, cores)
    };
    let mut out = Vec::new();
    if sp.is_some() {
        out.push(figure("sockperf ping-pong 64 B (its latency)", "ns", &sp_lat, "<= 0.5x TCP"));
        out.push(figure("sockperf throughput 64 B (its message rate)", "msg/s", &sp_rate, ">= 2x TCP"));
    }
    if rd.is_some() {
        out.push(figure("redis-benchmark SET, 4 clients", "req/s", &set, ">= 1.5x TCP"));
        out.push(figure("redis-benchmark GET, 4 clients", "req/s", &get, ">= 1.5x TCP"));
    }
    if pg.is_some() {
        out.push(figure("pgbench select-only, 4 clients (PostgreSQL)", "tx/s", &pg_tps, ">= 1.5x TCP"));
    }
    Ok(out)
}
