//! How long a connection takes to set up through the connection manager
//! (issue 16's figure): from `rdma_create_id` to ESTABLISHED on both
//! sides, QP creation included, for the first connection and for each of
//! many in a row (as rdma-core's `cmtime` counts them), beside TCP's
//! `connect` and `accept` on the same loopback in the same run.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::{Context, QpCap};

use super::anchors::Stat;

/// Per connection: the first one's setup time and the median of the rest.
pub struct Setup {
    pub first: Duration,
    pub each: Stat,
}

const WAIT: Duration = Duration::from_secs(10);
const CAP: QpCap =
    QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

fn event(ch: &EventChannel, kind: EventKind) -> Result<vrdma::cm::CmEvent> {
    match ch.get_event(Some(WAIT))? {
        Some(ev) if ev.kind == kind => Ok(ev),
        Some(ev) => bail!("expected {kind:?}, the connection manager said {ev:?}"),
        None => bail!("no {kind:?} within {WAIT:?}"),
    }
}

/// `n` rdma_cm connections in a row, on the daemon at `sock`, between a
/// listener thread and this one.
pub fn rdma_cm(sock: &std::path::Path, n: usize) -> Result<Setup> {
    let server_ctx = Context::open_at(sock).context("opening the listener's context")?;
    let server_ch = EventChannel::create(&server_ctx)?;
    let listener = CmId::create(&server_ch, PortSpace::Tcp)?;
    let at = listener.bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))?;
    listener.listen(n.min(1024) as i32)?;
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<Result<Instant, String>>(1);
    let server = std::thread::spawn(move || {
        let pd = server_ctx.alloc_pd()?;
        let mut held = Vec::new();
        for _ in 0..n {
            let accepted = (|| -> Result<Instant> {
                let req = event(&server_ch, EventKind::ConnectRequest)?;
                let id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
                let cq = server_ctx.create_cq(32, None)?;
                let qp = pd.create_rc_qp(&cq, &cq, CAP)?;
                id.attach_qp(&qp)?;
                id.accept(&ConnParam::default())?;
                event(&server_ch, EventKind::Established)?;
                let t = Instant::now();
                held.push((id, qp, cq));
                Ok(t)
            })();
            let failed = accepted.is_err();
            let _ = done_tx.send(accepted.map_err(|e| format!("{e:#}")));
            if failed {
                break;
            }
        }
        drop(listener);
        Ok::<_, anyhow::Error>(())
    });
    let ctx = Context::open_at(sock).context("opening the client's context")?;
    let ch = EventChannel::create(&ctx)?;
    let pd = ctx.alloc_pd()?;
    let mut times = Vec::with_capacity(n);
    let mut held = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let id = CmId::create(&ch, PortSpace::Tcp)?;
        id.resolve_addr(None, at)?;
        event(&ch, EventKind::AddrResolved)?;
        id.resolve_route()?;
        event(&ch, EventKind::RouteResolved)?;
        let cq = ctx.create_cq(32, None)?;
        let qp = pd.create_rc_qp(&cq, &cq, CAP)?;
        id.attach_qp(&qp)?;
        id.connect(&ConnParam::default())?;
        event(&ch, EventKind::Established)?;
        let client_done = Instant::now();
        let server_done = match done_rx.recv_timeout(WAIT) {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => bail!("the listener: {e}"),
            Err(_) => bail!("the listener did not establish within {WAIT:?}"),
        };
        times.push(client_done.max(server_done) - t0);
        held.push((id, qp, cq));
    }
    drop(held);
    match server.join() {
        Ok(r) => r?,
        Err(_) => bail!("the listener thread panicked"),
    }
    Ok(summary(&times))
}

/// `n` TCP connections in a row on loopback: from `connect` to both
/// `connect` and `accept` having returned.
pub fn tcp(n: usize) -> Result<Setup> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let at = l.local_addr()?;
    let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<std::io::Result<Instant>>(1);
    let server = std::thread::spawn(move || {
        let mut held = Vec::new();
        for _ in 0..n {
            let r = l.accept().map(|(s, _)| {
                held.push(s);
                Instant::now()
            });
            let failed = r.is_err();
            let _ = done_tx.send(r);
            if failed {
                break;
            }
        }
    });
    let mut times = Vec::with_capacity(n);
    let mut held = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let s = TcpStream::connect_timeout(&at, WAIT)?;
        let client_done = Instant::now();
        let server_done = done_rx.recv_timeout(WAIT).context("accept did not return")??;
        times.push(client_done.max(server_done) - t0);
        held.push(s);
    }
    drop(held);
    let _ = server.join();
    Ok(summary(&times))
}

fn summary(times: &[Duration]) -> Setup {
    let ns: Vec<f64> = times.iter().skip(1).map(|d| d.as_nanos() as f64).collect();
    let each = if ns.is_empty() {
        Stat::from_samples(&[times[0].as_nanos() as f64])
    } else {
        Stat::from_samples(&ns)
    };
    Setup { first: times[0], each }
}
