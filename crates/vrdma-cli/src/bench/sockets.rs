//! `vrdma bench --sockets`: unmodified std::net programs over plain TCP
//! and under the sockets preload library (`libvrdma_sockets.so`,
//! docs/sockets.md), in the same run, on daemons of our own with the
//! direct path off (the engine carries the bytes) and on.
//!
//! The programs are this executable's hidden `vrdma bench --sock-app`
//! roles ([`app`]): plain std::net, nothing vRDMA in them, so the preload
//! is the only difference between a run and its anchor. Two pairs:
//! 64-byte blocking request/response (the client's median round trip) and
//! a stream (64 KiB writes, the client's bytes over the time from its
//! first write to the server's answer after the end). A preloaded pair
//! must say it was carried (the library's debug line), or the figure is
//! an error rather than TCP read as vRDMA. Every process is killed by its
//! pid if it outlives its limit.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::anchors::Stat;
use super::reaped::Reaped;
use super::Figure;

/// How long one server/client pair may take.
const LIMIT: Duration = Duration::from_secs(60);
/// The library's line for a carried connection.
const CARRIED: &str = "carried over vRDMA";

/// The hidden program roles (`vrdma bench --sock-app ROLE`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum App {
    /// Echoes 64-byte requests until the end.
    RrServer,
    /// `--sock-n` 64-byte round trips; prints `rtt_ns MEDIAN`.
    RrClient,
    /// Reads to the end, answers the count.
    StreamServer,
    /// Writes `--sock-n` bytes in 64 KiB writes; prints `gbit_s RATE`.
    StreamClient,
}

/// Runs one role: a server binds 127.0.0.1:0 and prints `listening PORT`.
pub fn app(role: App, port: u16, n: u64) -> Result<()> {
    match role {
        App::RrServer | App::StreamServer => {
            let l = TcpListener::bind(("127.0.0.1", 0))?;
            println!("listening {}", l.local_addr()?.port());
            std::io::stdout().flush()?;
            let (mut s, _) = l.accept()?;
            s.set_nodelay(true)?;
            if role == App::RrServer {
                let mut b = [0u8; 64];
                loop {
                    match s.read_exact(&mut b) {
                        Ok(()) => s.write_all(&b)?,
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            let mut buf = vec![0u8; 1 << 16];
            let mut count = 0u64;
            loop {
                let k = s.read(&mut buf)?;
                if k == 0 {
                    break;
                }
                count += k as u64;
            }
            s.write_all(format!("{count}\n").as_bytes())?;
            Ok(())
        }
        App::RrClient => {
            let mut s = TcpStream::connect(("127.0.0.1", port))?;
            s.set_nodelay(true)?;
            let (msg, mut got) = ([5u8; 64], [0u8; 64]);
            let mut times = Vec::with_capacity(n.min(1 << 24) as usize);
            for _ in 0..n {
                let t = Instant::now();
                s.write_all(&msg)?;
                s.read_exact(&mut got)?;
                times.push(t.elapsed().as_nanos() as f64);
            }
            s.shutdown(Shutdown::Write)?;
            times.sort_by(f64::total_cmp);
            println!("rtt_ns {}", times.get(times.len() / 2).copied().unwrap_or(0.0));
            Ok(())
        }
        App::StreamClient => {
            let mut s = TcpStream::connect(("127.0.0.1", port))?;
            let buf = vec![7u8; 1 << 16];
            let t = Instant::now();
            let mut sent = 0u64;
            while sent < n {
                let k = (n - sent).min(buf.len() as u64) as usize;
                s.write_all(&buf[..k])?;
                sent += k as u64;
            }
            s.shutdown(Shutdown::Write)?;
            let mut answer = String::new();
            s.read_to_string(&mut answer)?;
            let secs = t.elapsed().as_secs_f64();
            if answer.trim() != n.to_string() {
                bail!("the server counted {answer:?}, not {n}");
            }
            println!("gbit_s {}", n as f64 * 8.0 / secs / 1e9);
            Ok(())
        }
    }
}

/// How the pair runs: plain, or preloaded on the daemon at a socket.
enum Mode<'a> {
    Plain,
    Preloaded { lib: &'a Path, sock: &'a Path },
}

fn command(mode: &Mode, role: App, port: u16, n: u64) -> Result<Command> {
    let exe = std::env::current_exe().context("where is the vrdma executable")?;
    let mut c = Command::new(exe);
    let role = clap::ValueEnum::to_possible_value(&role).context("role name")?;
    let (port, n) = (port.to_string(), n.to_string());
    c.args(["bench", "--sock-app", role.get_name(), "--sock-port", &port, "--sock-n", &n]);
    c.env_remove("LD_PRELOAD").env_remove("VRDMA_SOCKETS_DEBUG");
    if let Mode::Preloaded { lib, sock } = mode {
        c.env("LD_PRELOAD", lib).env(vrdma::SOCKET_ENV, sock).env("VRDMA_SOCKETS_DEBUG", "1");
    }
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    Ok(c)
}

/// Reads a child's stream to its end on a thread (so that a full pipe
/// never stalls it).
fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

/// One pair: the client's figure (the number after its key).
fn pair(mode: &Mode, server: App, client: App, n: u64, key: &str) -> Result<f64> {
    let end = Instant::now() + LIMIT;
    let mut srv = Reaped(command(mode, server, 0, 0)?.spawn().context("starting the server program")?);
    let srv_err = drain(srv.0.stderr.take());
    let mut out = BufReader::new(srv.0.stdout.take().context("server stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let port: u16 = line
        .strip_prefix("listening ")
        .and_then(|p| p.trim().parse().ok())
        .with_context(|| format!("the server program said {line:?}"))?;
    let mut cli = Reaped(command(mode, client, port, n)?.spawn().context("starting the client program")?);
    let (cli_out, cli_err) = (drain(cli.0.stdout.take()), drain(cli.0.stderr.take()));
    let status = loop {
        if let Some(s) = cli.0.try_wait()? {
            break s;
        }
        if Instant::now() > end {
            bail!("the {client:?} program ran past {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    while srv.0.try_wait()?.is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(srv);
    let (stdout, stderr) = (cli_out.join().unwrap_or_default(), cli_err.join().unwrap_or_default());
    let srv_stderr = srv_err.join().unwrap_or_default();
    if !status.success() {
        bail!("the {client:?} program failed ({status}): {} / server: {}", stderr.trim(), srv_stderr.trim());
    }
    if matches!(mode, Mode::Preloaded { .. }) && !stderr.contains(CARRIED) {
        bail!("the preloaded {client:?} connection was not carried over vRDMA: {}", stderr.trim());
    }
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
        .with_context(|| format!("the {client:?} program printed {stdout:?}"))
}

/// The figures: request/response and stream, each preloaded on a daemon
/// with the direct path off and one with it on, beside plain TCP, runs
/// interleaved so that load drifting over the run hits both alike.
pub fn figures(
    engine: &vrdmad::EngineConfig,
    lib: &Path,
    quick: bool,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) -> Result<Vec<Figure>> {
    let (rounds, bytes) = if quick { (2_000u64, 256u64 << 20) } else { (20_000, 1 << 30) };
    let engine_dev = crate::embedded::private_device(engine.clone(), false)?;
    let direct_dev = crate::embedded::private_device(engine.clone(), true)?;
    let socks = [engine_dev.socket().to_owned(), direct_dev.socket().to_owned()];
    // [plain, engine, direct] samples for each pair.
    let (mut rr, mut bw): ([Vec<f64>; 3], [Vec<f64>; 3]) = Default::default();
    for run in 0..runs {
        progress(&format!("sockets: run {}/{runs}", run + 1));
        for (i, m) in [None, Some(&socks[0]), Some(&socks[1])].into_iter().enumerate() {
            let mode = match m {
                None => Mode::Plain,
                Some(sock) => Mode::Preloaded { lib, sock },
            };
            rr[i].push(pair(&mode, App::RrServer, App::RrClient, rounds, "rtt_ns")?);
            bw[i].push(pair(&mode, App::StreamServer, App::StreamClient, bytes, "gbit_s")?);
        }
    }
    let figure = |name: String, unit: &'static str, v: &[f64], a: &[f64], target: &str| {
        let (value, anchor) = (Stat::from_samples(v), Stat::from_samples(a));
        Figure::beside(name, unit, value, "the same programs, plain TCP, loopback", anchor, target, cores)
    };
    let mut out = Vec::new();
    for (i, path) in [(1, "direct path off"), (2, "direct path on")] {
        out.push(figure(
            format!("sockets preload, 64 B request/response round trip (std::net, blocking), {path}"),
            "ns",
            &rr[i],
            &rr[0],
            "<= 0.5x TCP",
        ));
        out.push(figure(
            format!("sockets preload, stream of {} MiB in 64 KiB writes, {path}", bytes >> 20),
            "Gbit/s",
            &bw[i],
            &bw[0],
            ">= 2x TCP",
        ));
    }
    // Real applications (sockperf, redis-benchmark) on the direct path's
    // daemon, where installed.
    out.extend(super::sockets_apps::figures(lib, &socks[1], quick, runs, cores, progress)?);
    Ok(out)
}

/// The library, as `vrdma run --sockets` finds it.
pub fn library() -> Result<PathBuf> {
    crate::cmd::run::find_sockets()
}
