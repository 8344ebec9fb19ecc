//! The client of the named tests: `vrdma bench HOST TEST...` against a
//! `vrdma bench --server`, or `vrdma bench TEST...` against a server it
//! starts itself on 127.0.0.1 (the local mode).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};

use super::control::{check_limits, Conn, Msg, RecvError, Setup, SideReport, PING_EVERY, SILENCE, VERSION};
use super::output::{Bandwidth, Latency, Row};
use super::spec::{Kind, Limit, TestName, Transport};
use super::traffic::{self, Flags, Outcome, Side, Stream, STALL};

/// How the tests run (besides which and at what sizes).
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub qps: u32,
    pub streams: u32,
    pub events: bool,
    pub limit: Limit,
}

const CONNECT: Duration = Duration::from_secs(10);
/// How long the server may take to make its side of a test.
const SETUP: Duration = Duration::from_secs(30);

/// Connects to a server at `host` (`HOST`, `HOST:PORT`).
pub fn connect(host: &str, port: u16) -> Result<Conn> {
    let addrs: Vec<SocketAddr> =
        (host, port).to_socket_addrs().with_context(|| format!("cannot resolve {host}"))?.collect();
    let mut last = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, CONNECT) {
            Ok(s) => return Ok(Conn::new(s)?),
            Err(e) => last = Some(e),
        }
    }
    let why = last.map_or("no address".to_string(), |e| e.to_string());
    bail!("cannot reach a vrdma bench server at {host}:{port}: {why} (is `vrdma bench --server` running there?)")
}

/// Runs every (test, size) of `plan`; `progress` says what runs on stderr.
pub fn run(
    mut conn: Conn,
    ctx: &vrdma::Context,
    plan: &[(TestName, usize)],
    o: &Options,
    progress: bool,
) -> Result<Vec<Row>> {
    conn.send(&Msg::Hello { version: VERSION })?;
    match conn.expect(SILENCE, "hello")? {
        Msg::Hello { version } if version == VERSION => {}
        other => bail!("the server answered {other:?} to hello (version {VERSION})"),
    }
    let ip = conn.peer.parse::<SocketAddr>().map(|a| a.ip()).context("the server's address")?;
    let mut rows = Vec::new();
    for &(test, size) in plan {
        if progress {
            eprintln!("running {} {size} B ...", test.name());
        }
        let row =
            one(&mut conn, ip, ctx, test, size, o).with_context(|| format!("{} {size} B", test.name()))?;
        rows.push(row);
    }
    conn.send(&Msg::Bye)?;
    Ok(rows)
}

fn one(
    conn: &mut Conn,
    ip: IpAddr,
    ctx: &vrdma::Context,
    test: TestName,
    size: usize,
    o: &Options,
) -> Result<Row> {
    let tcp = test.transport() == Transport::Tcp;
    check_limits(test, size, o.qps, o.streams).map_err(anyhow::Error::msg)?;
    let mut rdma = Vec::new();
    if !tcp {
        for _ in 0..o.streams {
            rdma.push(traffic::make_rdma(ctx, test, size, o.qps, o.events)?);
        }
    }
    let endpoints = rdma.iter().map(|r| r.info()).collect::<Result<Vec<_>>>()?;
    let setup = Setup { test, size, qps: o.qps, streams: o.streams, events: o.events, endpoints };
    conn.send(&Msg::Setup(setup))?;
    let ready = match conn.expect(SETUP, "ready")? {
        Msg::Ready(r) => r,
        other => bail!("expected ready, got {other:?}"),
    };
    let streams: Vec<Stream> = if tcp {
        let port =
            ready.tcp_port.filter(|p| *p != 0).ok_or_else(|| anyhow!("the server named no data port"))?;
        traffic::connect_streams(ip, port, o.streams)?.into_iter().map(Stream::Tcp).collect()
    } else {
        if ready.endpoints.len() != rdma.len() {
            bail!("the server sent {} QP lists for {} streams", ready.endpoints.len(), rdma.len());
        }
        for (r, peers) in rdma.iter_mut().zip(&ready.endpoints) {
            r.connect(peers)?;
        }
        rdma.into_iter().map(|r| Stream::Rdma(Box::new(r))).collect()
    };
    conn.send(&Msg::Start)?;
    let flags = Arc::new(Flags::default());
    let running = traffic::spawn(test, size, streams, Side::Client, o.limit, &flags)?;
    let watched = watch(conn, &running);
    if watched.is_err() {
        flags.abort.store(true, Ordering::Relaxed);
    }
    let outcomes = traffic::join(running, STALL + Duration::from_secs(5));
    let outcomes = match (watched, outcomes) {
        (Ok(()), Ok(o)) => o,
        (Err(e), _) => return Err(e),
        // A stream failed: say so, and whether the server is gone too.
        (Ok(()), Err(e)) => match conn.recv(Duration::from_millis(200)) {
            Err(RecvError::Closed(why)) => return Err(e.context(format!("the server went away: {why}"))),
            _ => return Err(e),
        },
    };
    conn.send(&Msg::Stop)?;
    let server = match conn.expect(STALL, "the server's results")? {
        Msg::Done(r) => r,
        other => bail!("expected the server's results, got {other:?}"),
    };
    let mine: Vec<Outcome> = outcomes.into_iter().map(|(o, _stream)| o).collect();
    Ok(row(test, size, o, &mine, &server))
}

/// While the streams run: keeps the control connection alive and fails
/// as soon as the server is gone, silent or reports an error.
fn watch(conn: &mut Conn, running: &[traffic::Running]) -> Result<()> {
    let mut pinged = Instant::now();
    while !traffic::all_done(running) {
        match conn.recv(Duration::from_millis(20)) {
            Ok(Msg::Error { message }) => bail!("the server reports: {message}"),
            Ok(other) => bail!("unexpected {other:?} from the server during the test"),
            Err(RecvError::Timeout) if conn.silent_for() > SILENCE => {
                bail!("the server said nothing for {SILENCE:?}")
            }
            Err(RecvError::Timeout) => {}
            Err(RecvError::Closed(e)) => bail!("the server went away: {e}"),
        }
        if pinged.elapsed() >= PING_EVERY {
            conn.send(&Msg::Ping)?;
            pinged = Instant::now();
        }
    }
    Ok(())
}

fn row(test: TestName, size: usize, o: &Options, mine: &[Outcome], server: &SideReport) -> Row {
    let secs = mine.iter().map(|m| m.seconds).fold(0.0, f64::max);
    let (mut sent, mut received) = (traffic::Count::default(), traffic::Count::default());
    for m in mine {
        sent.bytes += m.sent.bytes;
        sent.messages += m.sent.messages;
        received.bytes += m.received.bytes;
        received.messages += m.received.messages;
    }
    let samples: Vec<f64> = mine.iter().flat_map(|m| m.lat_ns.iter().copied()).collect();
    let mut note = None;
    let (latency, bandwidth) = match test.kind() {
        Kind::Latency => (Latency::from_ns(&samples), None),
        Kind::Rate => {
            (Latency::from_ns(&samples), Some(Bandwidth::new(received.bytes, received.messages, secs)))
        }
        Kind::Bandwidth => {
            let bw = match test {
                TestName::RcBiBw => {
                    let a = Bandwidth::new(sent.bytes, sent.messages, secs);
                    let b = Bandwidth::new(server.sent_bytes, server.sent_messages, server.seconds);
                    Bandwidth {
                        gb_per_s: a.gb_per_s + b.gb_per_s,
                        mmsg_per_s: a.mmsg_per_s + b.mmsg_per_s,
                        bytes: a.bytes + b.bytes,
                        messages: a.messages + b.messages,
                        seconds: secs,
                    }
                }
                TestName::UdBw => {
                    let lost = sent.messages.saturating_sub(server.received_messages);
                    if lost > 0 {
                        note = Some(format!("{lost} of {} datagrams lost", sent.messages));
                    }
                    Bandwidth::new(server.received_bytes, server.received_messages, secs)
                }
                TestName::TcpBw => {
                    Bandwidth::new(server.received_bytes, server.received_messages, server.seconds)
                }
                _ => {
                    if test == TestName::RcBw && server.received_messages != sent.messages {
                        note = Some(format!(
                            "the server counted {} messages of {}",
                            server.received_messages, sent.messages
                        ));
                    }
                    Bandwidth::new(sent.bytes, sent.messages, secs)
                }
            };
            (None, Some(bw))
        }
    };
    Row {
        test: test.name(),
        size,
        qps: if test.transport() == Transport::Tcp { 0 } else { o.qps },
        streams: o.streams,
        completions: match (test.transport(), o.events) {
            (Transport::Tcp, _) => "socket",
            (_, true) => "event",
            (_, false) => "poll",
        },
        latency,
        bandwidth,
        note,
    }
}

/// The local mode's server: this program as `vrdma bench --server --once`
/// on 127.0.0.1, killed by pid if still running when dropped.
pub struct ServerProc {
    child: Child,
    pub addr: SocketAddr,
}

impl ServerProc {
    /// `socket`: the daemon's; `None` in a guest, whose server finds the
    /// VM's ports as this process did.
    pub fn spawn(socket: Option<&Path>) -> Result<ServerProc> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "--server", "--once", "--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if let Some(s) = socket {
            cmd.env("VRDMA_SOCKET", s);
        }
        if std::env::var_os("VRDMA_LOG").is_none() {
            cmd.env("VRDMA_LOG", "warn");
        }
        let mut child = cmd.spawn().context("starting the local bench server")?;
        let out = child.stdout.take().ok_or_else(|| anyhow!("no stdout from the local server"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut server = ServerProc { child, addr: SocketAddr::from(([127, 0, 0, 1], 0)) };
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .map_err(|_| anyhow!("the local server did not start"))?;
        server.addr = line
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| anyhow!("the local server said {line:?}"))?;
        Ok(server)
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
