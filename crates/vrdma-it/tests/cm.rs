//! The connection manager from the Rust API, against a real daemon: ids
//! that resolve an address, listen, connect and accept with private data,
//! carry messages over the QPs the exchange brought up, and disconnect;
//! and what a program sees when no one listens or the host is another.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use vrdma::cm::{reject, CmEvent, CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::wr::SendWrExt;
use vrdma::{QpState, WcStatus};
use vrdma_it::{cap, poll_one, DaemonProc, Side, WAIT};

fn event(ch: &EventChannel) -> Result<CmEvent> {
    match ch.get_event(Some(WAIT))? {
        Some(ev) => Ok(ev),
        None => bail!("no rdma_cm event within {WAIT:?}"),
    }
}

fn expect(ch: &EventChannel, kind: EventKind) -> Result<CmEvent> {
    let ev = event(ch)?;
    ensure!(ev.kind == kind, "expected {kind:?}, got {ev:?}");
    Ok(ev)
}

fn param(private: &[u8]) -> ConnParam {
    ConnParam {
        private_data: private.to_vec(),
        responder_resources: 1,
        initiator_depth: 1,
        ..ConnParam::default()
    }
}

/// A listener on 127.0.0.1:`port`.
fn listener(ch: &EventChannel, port: u16, backlog: i32) -> Result<CmId> {
    let id = CmId::create(ch, PortSpace::Tcp)?;
    assert_eq!(id.bind(localhost(port))?, localhost(port));
    id.listen(backlog)?;
    Ok(id)
}

fn localhost(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)
}

/// A client id with its route to `dst` resolved.
fn resolved(ch: &EventChannel, dst: SocketAddrV4) -> Result<CmId> {
    let id = CmId::create(ch, PortSpace::Tcp)?;
    id.resolve_addr(None, dst)?;
    expect(ch, EventKind::AddrResolved)?;
    id.resolve_route()?;
    expect(ch, EventKind::RouteResolved)?;
    Ok(id)
}

#[test]
fn a_connection_by_address_carries_messages_and_ends_disconnected_on_both_sides() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = vrdma_it::free_port()?;
    let (server_ch, client_ch) = (EventChannel::create(&ctx)?, EventChannel::create(&ctx)?);
    let listener = listener(&server_ch, port, 8)?;

    let client = resolved(&client_ch, localhost(port))?;
    let a = Side::with(&ctx, 4096, 64, cap(16, 1), None)?;
    client.attach_qp(&a.qp)?;
    assert_eq!(a.qp.state(), QpState::Init);
    client.connect(&param(b"from the client"))?;

    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    assert_eq!(req.listen_id, Some(listener.id()));
    let peer = req.peer.clone().unwrap();
    assert_eq!((peer.qp_num, peer.private_data.as_slice()), (a.qp.qpn(), &b"from the client"[..]));
    let server = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    assert_eq!(server.local_addr()?, Some(localhost(port)));
    assert_eq!(server.peer_addr()?, client.local_addr()?);
    let b = Side::with(&ctx, 4096, 64, cap(16, 1), None)?;
    server.attach_qp(&b.qp)?;
    b.qp.post_recv(&[vrdma::wr::recv(1, &[b.mr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    server.accept(&param(b"from the server"))?;
    assert_eq!(b.qp.state(), QpState::Rts, "ready before the reply goes");

    // The reply brings the client's QP up before the program hears of it.
    let est = expect(&client_ch, EventKind::Established)?;
    assert_eq!(est.peer.unwrap().private_data, b"from the server");
    assert_eq!(a.qp.state(), QpState::Rts);
    expect(&server_ch, EventKind::Established)?;

    a.mr.write(0, b"over rdma_cm")?;
    a.qp.post_send(&[vrdma::wr::send(2, &[a.mr.sge(0, 12)?])?.signaled()]).map_err(|e| e.error)?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 12));
    let mut got = [0u8; 12];
    b.mr.read(0, &mut got)?;
    assert_eq!(&got, b"over rdma_cm");

    client.disconnect()?;
    expect(&client_ch, EventKind::Disconnected)?;
    expect(&server_ch, EventKind::Disconnected)?;
    assert_eq!(a.qp.state(), QpState::Err, "the initiator's QP is flushed");
    Ok(())
}

#[test]
fn a_port_without_a_listener_answers_rejected_with_reason_8() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    let id = resolved(&ch, localhost(vrdma_it::free_port()?))?;
    let started = Instant::now();
    id.connect(&param(b""))?;
    let ev = expect(&ch, EventKind::Rejected)?;
    assert_eq!(ev.status, i32::from(reject::INVALID_SERVICE_ID));
    assert!(started.elapsed() < WAIT, "at once, not after a timeout");
    Ok(())
}

#[test]
fn a_listener_may_reject_with_private_data() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = vrdma_it::free_port()?;
    let ch = EventChannel::create(&ctx)?;
    let _listener = listener(&ch, port, 0)?;
    let client = resolved(&ch, localhost(port))?;
    client.connect(&param(b"let me in"))?;
    let req = expect(&ch, EventKind::ConnectRequest)?;
    let server = CmId::from_request(&ch, &req, PortSpace::Tcp)?;
    let err = server.reject(&[0; 149]).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL, "over the REJ's 148 bytes: {err}");
    server.reject(b"no")?;
    let ev = expect(&ch, EventKind::Rejected)?;
    assert_eq!((ev.id, ev.status), (client.id(), i32::from(reject::CONSUMER_DEFINED)));
    assert_eq!(ev.peer.unwrap().private_data, b"no");
    Ok(())
}

#[test]
fn the_event_channels_descriptor_is_readable_exactly_while_events_wait() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    let readable = |ch: &EventChannel| -> Result<bool> {
        let fd = ch.fd();
        let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        Ok(rustix::event::poll(&mut fds, Some(&zero))? == 1)
    };
    assert!(!readable(&ch)?);
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    id.resolve_addr(None, localhost(7))?;
    id.resolve_route()?;
    assert!(readable(&ch)?);
    expect(&ch, EventKind::AddrResolved)?;
    assert!(readable(&ch)?, "one more waits");
    expect(&ch, EventKind::RouteResolved)?;
    assert!(!readable(&ch)?);
    assert!(ch.get_event(Some(Duration::from_millis(50)))?.is_none());
    Ok(())
}

#[test]
fn a_connection_to_another_host_ends_unreachable_promptly_while_rdma_cm_between_hosts_is_missing(
) -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    // An address of no host here: nothing is sent anywhere.
    let id = resolved(&ch, SocketAddrV4::new(Ipv4Addr::new(192, 0, 2, 1), 7471))?;
    let started = Instant::now();
    id.connect(&param(b""))?;
    expect(&ch, EventKind::Unreachable)?;
    assert!(started.elapsed() < Duration::from_secs(2));
    Ok(())
}

/// `rdma_destroy_id` of a connected id tells its peer (a DREQ).
#[test]
fn destroying_a_connected_id_disconnects_its_peer() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let port = vrdma_it::free_port()?;
    let (server_ch, ch) = (EventChannel::create(&ctx)?, EventChannel::create(&ctx)?);
    let _listener = listener(&server_ch, port, 1)?;
    let client = resolved(&ch, localhost(port))?;
    let a = Side::with(&ctx, 4096, 64, cap(4, 1), None)?;
    client.attach_qp(&a.qp)?;
    client.connect(&param(b""))?;
    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    let server = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    server.accept(&param(b""))?;
    expect(&ch, EventKind::Established)?;
    expect(&server_ch, EventKind::Established)?;
    drop(client);
    expect(&server_ch, EventKind::Disconnected)?;
    Ok(())
}
