//! How long a connection takes to set up through the connection manager
//! (issue 16's figure): from `rdma_create_id` to ESTABLISHED on both
//! sides, QP creation included, for the first connection and for each of
//! many in a row (as rdma-core's `cmtime` counts them; the QP made as
//! `rdma_create_qp` makes it when given no CQs, its CQ made with it, here
//! [`CmId::create_qp_with_cq`]), beside TCP's `connect` and `accept` on
//! the same pair in the same run. Each side makes its CQ and QP in the
//! same round trip as its connect or accept
//! ([`CmId::create_qp_with_cq_and_connect`],
//! [`CmId::create_qp_with_cq_and_accept`]), as a program of the Rust API
//! would.
//!
//! Each side is a loop of its own ([`serve_rdma_cm`] and [`connect_rdma_cm`],
//! [`serve_tcp`] and [`connect_tcp`]), so that the same loops run as two
//! threads on one host (`vrdma bench --cm-setup`) and as two processes in
//! two network namespaces (`vrdma bench-hosts`, through the hidden `vrdma
//! cm-setup`). The listener reports when each connection was established
//! on its side; a connection counts from the client's create id to the
//! later of the two sides' ESTABLISHED. Times are `CLOCK_MONOTONIC`
//! ([`now`]), which processes on one machine share, namespaces or not.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::{Context, QpCap, QpType};

use super::anchors::Stat;

/// Per connection: the first one's setup time and the median of the rest.
pub struct Setup {
    pub first: Duration,
    pub each: Stat,
}

const WAIT: Duration = Duration::from_secs(10);
const CAP: QpCap =
    QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

/// `CLOCK_MONOTONIC`, the clock `Instant` reads on Linux, as a number
/// another process on this machine can compare with its own.
pub fn now() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the valid pointer given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn event(ch: &EventChannel, kind: EventKind) -> Result<vrdma::cm::CmEvent> {
    match ch.get_event(Some(WAIT))? {
        Some(ev) if ev.kind == kind => Ok(ev),
        Some(ev) => bail!("expected {kind:?}, the connection manager said {ev:?}"),
        None => bail!("no {kind:?} within {WAIT:?}"),
    }
}

/// An rdma_cm listener bound and listening (the part of the server that
/// is not timed).
pub struct CmListener {
    ctx: Context,
    ch: EventChannel,
    id: CmId,
    pub at: SocketAddrV4,
}

impl CmListener {
    /// Listens on `at` (port 0: any) on the daemon at `sock`, room for
    /// `backlog` pending requests.
    pub fn bind(sock: &Path, at: SocketAddrV4, backlog: usize) -> Result<CmListener> {
        let ctx = Context::open_at(sock).context("opening the listener's context")?;
        let ch = EventChannel::create(&ctx)?;
        let id = CmId::create(&ch, PortSpace::Tcp)?;
        let at = id.bind(at)?;
        id.listen(backlog.min(1024) as i32)?;
        Ok(CmListener { ctx, ch, id, at })
    }
}

/// Accepts `n` connections, each with its own CQ and QP, all kept until
/// the end; tells `done` when each was established on this side (or why
/// not, which ends the loop).
pub fn serve_rdma_cm(l: CmListener, n: usize, mut done: impl FnMut(Result<Duration, String>)) -> Result<()> {
    let CmListener { ctx, ch, id: listener, .. } = l;
    let pd = ctx.alloc_pd()?;
    let mut held = Vec::new();
    for _ in 0..n {
        let accepted = (|| -> Result<Duration> {
            let req = event(&ch, EventKind::ConnectRequest)?;
            let id = CmId::from_request(&ch, &req, PortSpace::Tcp)?;
            let (cq, qp) =
                id.create_qp_with_cq_and_accept(&pd, QpType::Rc, 32, CAP, &ConnParam::default())?;
            event(&ch, EventKind::Established)?;
            let t = now();
            held.push((id, qp, cq));
            Ok(t)
        })();
        let failed = accepted.as_ref().err().map(|e| format!("{e:#}"));
        done(accepted.map_err(|e| format!("{e:#}")));
        if let Some(e) = failed {
            bail!("{e}");
        }
    }
    drop(held);
    drop(listener);
    Ok(())
}

/// `n` connections in a row to the listener at `at`, from the daemon at
/// `sock`, each with its own CQ and QP; `server_done` says when the
/// listener established each. Returns each connection's setup time.
pub fn connect_rdma_cm(
    sock: &Path,
    at: SocketAddrV4,
    n: usize,
    mut server_done: impl FnMut() -> Result<Duration>,
) -> Result<Vec<Duration>> {
    let ctx = Context::open_at(sock).context("opening the client's context")?;
    let ch = EventChannel::create(&ctx)?;
    let pd = ctx.alloc_pd()?;
    let mut times = Vec::with_capacity(n);
    let mut held = Vec::new();
    for _ in 0..n {
        let t0 = now();
        let id = CmId::create(&ch, PortSpace::Tcp)?;
        id.resolve_addr(None, at)?;
        event(&ch, EventKind::AddrResolved)?;
        id.resolve_route()?;
        event(&ch, EventKind::RouteResolved)?;
        let (cq, qp) = id.create_qp_with_cq_and_connect(&pd, QpType::Rc, 32, CAP, &ConnParam::default())?;
        event(&ch, EventKind::Established)?;
        let client_done = now();
        times.push(client_done.max(server_done()?) - t0);
        held.push((id, qp, cq));
    }
    Ok(times)
}

/// `n` rdma_cm connections in a row, on the daemon at `sock`, between a
/// listener thread and this one.
pub fn rdma_cm(sock: &Path, n: usize) -> Result<Setup> {
    let l = CmListener::bind(sock, SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0), n)?;
    let at = l.at;
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<Result<Duration, String>>(1);
    let server = std::thread::spawn(move || {
        serve_rdma_cm(l, n, |r| {
            let _ = done_tx.send(r);
        })
    });
    let times = connect_rdma_cm(sock, at, n, || from_thread(&done_rx));
    // A client that stopped early must not leave the listener blocked on
    // telling it.
    drop(done_rx);
    match server.join() {
        Ok(r) => r.context("the listener")?,
        Err(_) => bail!("the listener thread panicked"),
    }
    Ok(summary(&times?))
}

fn from_thread(rx: &std::sync::mpsc::Receiver<Result<Duration, String>>) -> Result<Duration> {
    match rx.recv_timeout(WAIT) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => bail!("the listener: {e}"),
        Err(_) => bail!("the listener did not establish within {WAIT:?}"),
    }
}

/// Accepts `n` TCP connections, all kept until the end, telling `done`
/// when each `accept` returned.
pub fn serve_tcp(l: &TcpListener, n: usize, mut done: impl FnMut(Result<Duration, String>)) -> Result<()> {
    let mut held = Vec::new();
    for _ in 0..n {
        let r = l.accept().map(|(s, _)| {
            held.push(s);
            now()
        });
        let failed = r.as_ref().err().map(|e| format!("accept: {e}"));
        done(r.map_err(|e| format!("accept: {e}")));
        if let Some(e) = failed {
            bail!("{e}");
        }
    }
    Ok(())
}

/// `n` TCP connections in a row to `at`: from `connect` to both `connect`
/// and the listener's `accept` (`server_done`) having returned.
pub fn connect_tcp(
    at: SocketAddrV4,
    n: usize,
    mut server_done: impl FnMut() -> Result<Duration>,
) -> Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(n);
    let mut held = Vec::new();
    for _ in 0..n {
        let t0 = now();
        let s = TcpStream::connect_timeout(&at.into(), WAIT)?;
        let client_done = now();
        times.push(client_done.max(server_done()?) - t0);
        held.push(s);
    }
    Ok(times)
}

/// `n` TCP connections in a row on loopback: from `connect` to both
/// `connect` and `accept` having returned.
pub fn tcp(n: usize) -> Result<Setup> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let std::net::SocketAddr::V4(at) = l.local_addr()? else { bail!("loopback is not IPv4") };
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<Result<Duration, String>>(1);
    let server = std::thread::spawn(move || {
        serve_tcp(&l, n, |r| {
            let _ = done_tx.send(r);
        })
    });
    let times = connect_tcp(at, n, || from_thread(&done_rx));
    drop(done_rx);
    match server.join() {
        Ok(r) => r.context("the listener")?,
        Err(_) => bail!("the listener thread panicked"),
    }
    Ok(summary(&times?))
}

/// The first time and the median of the rest (of all, for one).
pub fn summary(times: &[Duration]) -> Setup {
    let ns: Vec<f64> = times.iter().skip(1).map(|d| d.as_nanos() as f64).collect();
    let each = if ns.is_empty() {
        Stat::from_samples(&[times[0].as_nanos() as f64])
    } else {
        Stat::from_samples(&ns)
    };
    Setup { first: times[0], each }
}
