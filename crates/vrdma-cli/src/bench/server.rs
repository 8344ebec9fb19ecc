//! `vrdma bench --server`: serves the named tests to clients, one thread
//! per client, until interrupted.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

use super::control::{Conn, Msg, Ready, RecvError, Setup, SideReport, SILENCE, VERSION};
use super::spec::{Limit, Transport};
use super::traffic::{self, Flags, Side, Stream};

/// Clients served at once; more are told the server is busy.
const MAX_CLIENTS: usize = 8;
/// How long a client may stay quiet between tests.
const IDLE: Duration = Duration::from_secs(60);

pub fn serve(listen: SocketAddr, once: bool, device: crate::embedded::Opener) -> Result<()> {
    let listener = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    // The first line of stdout: the address, for scripts (and the local mode) to read.
    println!("vrdma bench server listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a client");
                continue;
            }
        };
        if once {
            return client(stream, &device);
        }
        if active.load(Ordering::SeqCst) >= MAX_CLIENTS {
            if let Ok(c) = Conn::new(stream) {
                let _ = c.send(&Msg::Error { message: format!("busy: {MAX_CLIENTS} clients already") });
            }
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let (active, device) = (active.clone(), device.clone());
        let spawned = std::thread::Builder::new().name("bench-client".into()).spawn(move || {
            if let Err(e) = client(stream, &device) {
                tracing::warn!("{e:#}");
            }
            active.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "starting a client thread");
        }
    }
    Ok(())
}

/// One client's session: hello, then tests until it says bye.
fn client(stream: TcpStream, device: &crate::embedded::Opener) -> Result<()> {
    let mut conn = Conn::new(stream)?;
    let peer = conn.peer.clone();
    tracing::info!(client = %peer, "client connected");
    match conn.expect(SILENCE, "hello")? {
        Msg::Hello { version } if version == VERSION => conn.send(&Msg::Hello { version: VERSION })?,
        other => return refuse(&conn, format!("expected hello version {VERSION}, got {other:?}")),
    }
    let ctx = device.open().context("opening the vRDMA device")?;
    loop {
        match conn.expect(IDLE, "a test or bye")? {
            Msg::Setup(setup) => {
                if let Err(e) = test(&mut conn, &ctx, setup) {
                    let _ = conn.send(&Msg::Error { message: format!("{e:#}") });
                    return Err(e.context(format!("client {peer}")));
                }
            }
            Msg::Bye => {
                tracing::info!(client = %peer, "client done");
                return Ok(());
            }
            other => return refuse(&conn, format!("unexpected {other:?}")),
        }
    }
}

fn refuse(conn: &Conn, message: String) -> Result<()> {
    let _ = conn.send(&Msg::Error { message: message.clone() });
    bail!("client {}: {message}", conn.peer)
}

/// One test: make our side, report it, run until the client stops us.
fn test(conn: &mut Conn, ctx: &vrdma::Context, setup: Setup) -> Result<()> {
    setup.check().map_err(anyhow::Error::msg)?;
    let (mut streams, mut ready) = (Vec::new(), Ready { endpoints: Vec::new(), tcp_port: None });
    let listener = if setup.test.transport() == Transport::Tcp {
        let l = TcpListener::bind((conn.local_ip()?, 0))?;
        ready.tcp_port = Some(l.local_addr()?.port());
        Some(l)
    } else {
        for peers in &setup.endpoints {
            let mut r = traffic::make_rdma(ctx, setup.test, setup.size, setup.qps, setup.events)?;
            ready.endpoints.push(r.info()?);
            r.connect(peers)?;
            streams.push(Stream::Rdma(Box::new(r)));
        }
        None
    };
    conn.send(&Msg::Ready(ready))?;
    match conn.expect(SILENCE, "start")? {
        Msg::Start => {}
        other => bail!("expected start, got {other:?}"),
    }
    if let Some(l) = &listener {
        streams = traffic::accept_streams(l, setup.streams)?.into_iter().map(Stream::Tcp).collect();
    }
    let flags = Arc::new(Flags::default());
    let running = traffic::spawn(setup.test, setup.size, streams, Side::Server, Limit::Iters(0), &flags)?;
    // Wait for stop, answering pings; a client gone or silent aborts the test.
    let mut stream_failed = false;
    let stopped = loop {
        if flags.abort.load(Ordering::Relaxed) {
            stream_failed = true;
            break Err(anyhow::anyhow!("a stream failed"));
        }
        match conn.recv(Duration::from_millis(100)) {
            Ok(Msg::Stop) => break Ok(()),
            Ok(other) => break Err(anyhow::anyhow!("expected stop, got {other:?}")),
            Err(RecvError::Timeout) if conn.silent_for() < SILENCE => {}
            Err(RecvError::Timeout) => break Err(anyhow::anyhow!("the client said nothing for {SILENCE:?}")),
            Err(RecvError::Closed(e)) => break Err(anyhow::anyhow!(e)),
        }
    };
    match &stopped {
        Ok(()) => flags.stop.store(true, Ordering::Relaxed),
        Err(_) => flags.abort.store(true, Ordering::Relaxed),
    }
    let outcomes = traffic::join(running, SILENCE);
    let outcomes = match (stopped, outcomes) {
        (Ok(()), outcomes) => outcomes?,
        (Err(_), Err(o)) if stream_failed => return Err(o),
        (Err(e), _) => return Err(e),
    };
    let mut report = SideReport::default();
    for (o, _) in outcomes {
        report.sent_bytes += o.sent.bytes;
        report.sent_messages += o.sent.messages;
        report.received_bytes += o.received.bytes;
        report.received_messages += o.received.messages;
        report.seconds = report.seconds.max(o.seconds);
    }
    conn.send(&Msg::Done(report))
}
