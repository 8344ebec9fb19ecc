//! `vrdma bench --cm-setup`'s rows for an unmodified C program: rdma-core's
//! own `cmtime` (Debian's `rdmacm-utils`) through the drop-in
//! `librdmacm.so.1` and `libibverbs.so.1`, set up as `vrdma run` sets them
//! up, on the bench's daemon, beside TCP's connect and accept done the
//! same way in the same run.
//!
//! What cmtime (rdma-core 44, `librdmacm/examples/cmtime.c`) counts. Its
//! client takes `-c N` connections through each step for all of them
//! before the next step, and reports a step's wall time over N ("us /
//! conn"), a throughput-style figure where the connections overlap:
//!
//! - *create id*: N `rdma_create_id` in a loop (before its event thread
//!   starts);
//! - *resolve addr*, *resolve route*: N `rdma_resolve_addr`
//!   (`rdma_resolve_route`) issued, then until its event thread handled all
//!   N `ADDR_RESOLVED` (`ROUTE_RESOLVED`) events;
//! - *create qp*: N `rdma_create_qp` in a loop, given no CQs (librdmacm
//!   makes them; vRDMA's makes the CQ and the attached QP in one call);
//! - *connect*: N `rdma_connect` issued, then until the client handled all
//!   N `ESTABLISHED`. The server's side is inside: its event thread hands
//!   each `CONNECT_REQUEST` to a worker thread that makes the QP and
//!   accepts, and the client's `ESTABLISHED` comes of that accept (the
//!   server's own `ESTABLISHED` comes one message later and is not
//!   waited for);
//! - *disconnect*, *destroy*: the teardown, not read here.
//!
//! So "create id to ESTABLISHED" as cmtime measures it is the sum of its
//! first five steps' "us / conn". The anchor is TCP done in the same
//! phases ([`tcp_phases`]): N non-blocking sockets made (cmtime's create
//! id), then N non-blocking `connect`s issued to a listener whose thread
//! accepts them, until all N are connected and all N accepted (cmtime's
//! resolve addr, resolve route, create qp and connect: TCP resolves and
//! makes its buffers inside `connect` and `accept`), each phase's wall
//! time over N. Rows: one connection (`-c 1`, a fresh process's first)
//! and N (the five steps; the connect step alone beside the connect phase
//! alone). The target is at most 3× TCP.
//!
//! cmtime's server serves until killed; it serves one client run (see
//! [`table`]) and is killed by its pid after it ([`Reaped`]), as is a
//! client past its deadline. Its port is one the kernel says is free and no
//! listener of ours holds on the daemon; the client starts once the
//! daemon says the server listens ([`vrdma::cm::is_listening`]: rdma_cm
//! listeners show in no socket table), and a client turned away anyway
//! (`REJECTED`, `UNREACHABLE`) is run again, a bounded number of times.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use vrdma::cm::PortSpace;

use super::anchors::Stat;
use super::cm_setup::now;
use super::cmtime_table::{self, Table, SETUP};
use super::reaped::Reaped;
use super::Figure;
use crate::cmd::run::{check_build_id, find_library, find_rdmacm, LibDir};

const CMTIME: &str = "cmtime";
/// How long the server may take to listen, and TCP's phases to end.
const WAIT: Duration = Duration::from_secs(10);
/// Client runs per measurement, the first included, while turned away.
const TRIES: usize = 3;
/// Ports tried for a server that exits instead of listening.
const PORTS: usize = 3;

/// The drop-in libraries as `vrdma run` sets them up, for programs run on
/// the daemon at `sock`.
struct DropIn {
    dir: LibDir,
    sock: PathBuf,
}

impl DropIn {
    /// Why not, when the libraries are missing or of another build.
    fn new(sock: &Path) -> std::result::Result<DropIn, String> {
        let lib = find_library().map_err(|e| format!("{e:#}"))?;
        check_build_id(&lib).map_err(|e| format!("{e:#}"))?;
        let cm = find_rdmacm().map_err(|e| format!("{e:#}"))?.ok_or(
            "the drop-in librdmacm (libvrdma_rdmacm.so) is not next to the vrdma executable; build it \
             (cargo build -p vrdma-verbs -p vrdma-rdmacm, with the same profile) or name it with \
             VRDMA_RDMACM_LIB",
        )?;
        check_build_id(&cm).map_err(|e| format!("{e:#}"))?;
        let dir = LibDir::create(&lib, None).map_err(|e| format!("{e:#}"))?;
        dir.add_rdmacm(&cm).map_err(|e| format!("{e:#}"))?;
        Ok(DropIn { dir, sock: sock.to_owned() })
    }

    fn command(&self, program: &Path, args: &[&str]) -> Command {
        let mut path = self.dir.path().to_owned().into_os_string();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
            path.push(":");
            path.push(old);
        }
        let mut c = Command::new(program);
        c.args(args).env("LD_LIBRARY_PATH", path).env(vrdma::SOCKET_ENV, &self.sock);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }
}

fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| p.is_file())
}

/// cmtime's server, listening on the daemon.
struct Server {
    proc: Reaped,
    port: u16,
}

impl Server {
    fn start(env: &DropIn, bin: &Path, ctx: &vrdma::Context) -> Result<Server> {
        let mut last = String::new();
        for _ in 0..PORTS {
            let port = super::sockets_apps::free_port()?;
            let at = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
            if vrdma::cm::is_listening(ctx, PortSpace::Tcp, at)? {
                continue;
            }
            let mut c = env.command(bin, &["-p", &port.to_string()]);
            // Not read while it serves: nothing into a pipe that could fill.
            c.stdout(Stdio::null()).stderr(Stdio::null());
            let mut p = Reaped(c.spawn().with_context(|| format!("starting {c:?}"))?);
            let end = Instant::now() + WAIT;
            loop {
                if vrdma::cm::is_listening(ctx, PortSpace::Tcp, at)? {
                    return Ok(Server { proc: p, port });
                }
                if let Some(status) = p.0.try_wait()? {
                    last = format!("cmtime -p {port} exited ({status}) instead of listening");
                    break;
                }
                if Instant::now() > end {
                    bail!("cmtime -p {port} did not listen within {WAIT:?}");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        bail!("cmtime's server did not listen on any of {PORTS} ports: {last}")
    }

    /// One client run of `n` connections: its output.
    fn client(&mut self, env: &DropIn, bin: &Path, n: usize) -> Result<String> {
        let args = ["-s", "127.0.0.1", "-p", &self.port.to_string(), "-c", &n.to_string()].map(String::from);
        let out = super::sockets_apps::client(env.command(bin, &args.each_ref().map(String::as_str)), false)?;
        if let Some(status) = self.proc.0.try_wait()? {
            bail!("cmtime's server exited ({status}) during cmtime {}:\n{out}", args.join(" "));
        }
        Ok(out)
    }
}

/// cmtime's table for `n` connections, a server of its own for each try
/// (cmtime 44's server outlives only its first client: each request's QP
/// takes the CQs its first connection made, which librdmacm wrote into
/// the attributes the server passes again, and those go with that
/// connection), tried again while turned away.
fn table(env: &DropIn, bin: &Path, ctx: &vrdma::Context, n: usize) -> Result<Table> {
    for attempt in 1..=TRIES {
        let mut server = Server::start(env, bin, ctx)?;
        let out = server.client(env, bin, n)?;
        drop(server);
        if cmtime_table::turned_away(&out) && attempt < TRIES {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        return cmtime_table::parse(&out, n).with_context(|| format!("cmtime -c {n}"));
    }
    unreachable!("the last try returns")
}

/// Per connection, in ns: TCP's `n` sockets made, and their `n`
/// non-blocking connects issued together until all are connected and
/// accepted (see the module documentation), each phase's wall time over
/// `n`, on loopback.
pub fn tcp_phases(n: usize) -> Result<[f64; 2]> {
    let listener = tcp_listener(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0), n)?;
    let std::net::SocketAddr::V4(at) = listener.local_addr()? else { bail!("loopback is not IPv4") };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    // As cmtime's server, the acceptor waits before the client starts.
    let ready = std::sync::Arc::new(std::sync::Barrier::new(2));
    let its = ready.clone();
    let server = std::thread::spawn(move || {
        its.wait();
        accept_all(&listener, n, &stopped, WAIT)
    });
    ready.wait();
    let client = connect_all(at, n, WAIT);
    if client.is_err() {
        // The acceptor ends now rather than at its deadline.
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let accepted = server.join();
    let client = client?;
    let accepted = match accepted {
        Ok(r) => r.context("the TCP listener")?,
        Err(_) => bail!("the TCP listener's thread panicked"),
    };
    Ok(client.per_conn(accepted))
}

/// A TCP listener on `at` with room for `n` connections at once (std
/// listens with a backlog of 128).
pub fn tcp_listener(at: SocketAddrV4, n: usize) -> Result<TcpListener> {
    let listener = TcpListener::bind(at).with_context(|| format!("listen on {at}"))?;
    rustix::net::listen(&listener, n.max(128).min(i32::MAX as usize) as i32)?;
    Ok(listener)
}

/// The connecting side of TCP in cmtime's phases: when it began making
/// its sockets, when it began issuing their connects and when the last
/// was connected ([`now`]'s clock), and the sockets.
pub struct Connected {
    pub start: Duration,
    pub issued: Duration,
    pub connected: Duration,
    pub socks: Vec<OwnedFd>,
}

impl Connected {
    /// Per connection, in ns: the sockets phase, and the connect phase
    /// until all were connected and (`accepted`, when the listener had
    /// the last) accepted.
    pub fn per_conn(&self, accepted: Duration) -> [f64; 2] {
        self.per_conn_of(self.socks.len(), accepted)
    }

    /// [`Connected::per_conn`] for `n` connections (whose sockets another
    /// process held).
    pub fn per_conn_of(&self, n: usize, accepted: Duration) -> [f64; 2] {
        let n = n.max(1) as f64;
        [
            (self.issued - self.start).as_nanos() as f64 / n,
            (self.connected.max(accepted) - self.issued).as_nanos() as f64 / n,
        ]
    }
}

/// `n` non-blocking sockets made, then their connects to `at` issued
/// together, until all are connected (bounded by `wait`).
pub fn connect_all(at: SocketAddrV4, n: usize, wait: Duration) -> Result<Connected> {
    let start = now();
    let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
    let socks = (0..n)
        .map(|_| rustix::net::socket_with(AddressFamily::INET, SocketType::STREAM, flags, None))
        .collect::<rustix::io::Result<Vec<OwnedFd>>>()
        .context("socket")?;
    let issued = now();
    for s in &socks {
        match rustix::net::connect(s, &at) {
            Ok(()) | Err(rustix::io::Errno::INPROGRESS) => {}
            Err(e) => bail!("connect to {at}: {e}"),
        }
    }
    wait_connected(&socks, wait)?;
    Ok(Connected { start, issued, connected: now(), socks })
}

/// Accepts `n` connections (kept until all are in); when the last was.
/// Gives up after `wait`, or once `stop` is set (the client failed).
pub fn accept_all(
    l: &TcpListener,
    n: usize,
    stop: &std::sync::atomic::AtomicBool,
    wait: Duration,
) -> Result<Duration> {
    let end = Instant::now() + wait;
    let mut held = Vec::with_capacity(n);
    while held.len() < n {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || stop.load(std::sync::atomic::Ordering::Relaxed) {
            bail!("{} of {n} connections accepted", held.len());
        }
        let mut fds = [PollFd::new(l, PollFlags::IN)];
        let slice = left.min(Duration::from_millis(50));
        let timeout = Timespec::try_from(slice).unwrap_or(Timespec { tv_sec: 0, tv_nsec: 50_000_000 });
        if rustix::event::poll(&mut fds, Some(&timeout))? == 0 {
            continue;
        }
        held.push(l.accept().context("accept")?.0);
    }
    Ok(now())
}

/// Until every socket's non-blocking connect has completed (an error if
/// one failed).
fn wait_connected(socks: &[OwnedFd], wait: Duration) -> Result<()> {
    let end = Instant::now() + wait;
    let mut pending: Vec<&OwnedFd> = socks.iter().collect();
    while !pending.is_empty() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("{} of {} TCP connects still pending after {wait:?}", pending.len(), socks.len());
        }
        let mut fds: Vec<PollFd<'_>> = pending.iter().map(|s| PollFd::new(*s, PollFlags::OUT)).collect();
        let timeout = Timespec::try_from(left).unwrap_or(Timespec { tv_sec: 10, tv_nsec: 0 });
        rustix::event::poll(&mut fds, Some(&timeout))?;
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        let mut still = Vec::with_capacity(pending.len());
        for (s, ready) in pending.into_iter().zip(ready) {
            if !ready {
                still.push(s);
                continue;
            }
            if let Err(e) = rustix::net::sockopt::socket_error(s)? {
                bail!("a non-blocking TCP connect failed: {e}");
            }
        }
        pending = still;
    }
    Ok(())
}

/// The rows, or why they cannot be measured here: cmtime `-c 1` and `-c
/// n` against one server on the daemon at `sock`, each beside
/// [`tcp_phases`] of as many, `runs` times interleaved. A failed run makes
/// a failed row (the report goes on and `vrdma bench` exits non-zero).
pub fn figures(
    sock: &Path,
    n: usize,
    runs: usize,
    cores: usize,
    progress: &dyn Fn(&str),
) -> std::result::Result<Vec<Figure>, String> {
    let bin = find(CMTIME).ok_or("cmtime not installed (apt-get install rdmacm-utils)")?;
    let env = DropIn::new(sock)?;
    progress(&format!(
        "rdma-core's cmtime through the drop-in librdmacm (-c 1 and -c {n}), and TCP in its phases"
    ));
    let name = format!("cmtime (rdma-core, C, through the drop-in librdmacm), -c 1 and -c {n}");
    match measure(&env, &bin, n, runs, cores) {
        Ok(f) => Ok(f),
        Err(e) => Ok(vec![Figure::failed(name, &e, cores)]),
    }
}

fn measure(env: &DropIn, bin: &Path, n: usize, runs: usize, cores: usize) -> Result<Vec<Figure>> {
    let ctx = vrdma::Context::open_at(&env.sock).context("opening a context on the bench's daemon")?;
    // [value, anchor] samples in ns: one connection's five steps; n's
    // five steps; n's connect step.
    let [mut one, mut many, mut connect]: [[Vec<f64>; 2]; 3] = Default::default();
    for _ in 0..runs {
        let t = table(env, bin, &ctx, 1)?;
        let [sock1, conn1] = tcp_phases(1)?;
        one[0].push(t.us_per_conn(&SETUP) * 1e3);
        one[1].push(sock1 + conn1);
        let t = table(env, bin, &ctx, n)?;
        let [sock_n, conn_n] = tcp_phases(n)?;
        many[0].push(t.us_per_conn(&SETUP) * 1e3);
        many[1].push(sock_n + conn_n);
        connect[0].push(t.us_per_conn(&["connect"]) * 1e3);
        connect[1].push(conn_n);
    }
    let figure = |name: String, v: &[Vec<f64>; 2], anchor: String| {
        let (value, anchor_stat) = (Stat::from_samples(&v[0]), Stat::from_samples(&v[1]));
        Figure::beside(name, "ns", value, anchor, anchor_stat, "<= 3x TCP", cores)
    };
    let who = "cmtime (rdma-core, C, through the drop-in librdmacm)";
    let steps = "create id + resolve addr + resolve route + create qp + connect steps";
    Ok(vec![
        figure(
            format!("{who} -c 1: {steps}, one connection (a fresh process's first)"),
            &one,
            "TCP socket + non-blocking connect, accepted, one connection, loopback".into(),
        ),
        figure(
            format!("{who} -c {n}: {steps}, us per connection of {n} issued together"),
            &many,
            format!("TCP: {n} sockets, then {n} non-blocking connects issued together, all accepted, per connection"),
        ),
        figure(
            format!(
                "{who} -c {n}: connect step alone ({n} rdma_connect to all ESTABLISHED at the client, the \
                 server's QP and accept inside), per connection"
            ),
            &connect,
            format!("TCP: {n} non-blocking connects issued together to all connected and accepted, per connection"),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The anchor makes and accepts all its connections, and each phase
    /// takes some time (no figure asserted: the machine decides those).
    #[test]
    fn tcp_phases_connects_and_accepts_all() {
        for n in [1, 20, 200] {
            let [socket, connect] = tcp_phases(n).unwrap();
            assert!(socket > 0.0 && connect > 0.0, "{n}: {socket} {connect}");
        }
    }
}
