//! The connection manager from the Rust API, against real daemons: ids
//! that resolve an address, listen, connect and accept with private data,
//! carry messages over the QPs the exchange brought up, and disconnect,
//! on one host and across two (two daemons on 127.0.0.2 and 127.0.0.3,
//! linked when the first request needs it); and what a program sees when
//! no one listens, the transport is off, or the peer's daemon dies.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use vrdma::cm::{reject, CmEvent, CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::wr::SendWrExt;
use vrdma::{QpState, WcStatus};
use vrdma_it::{cap, poll_one, DaemonProc, Side, TwoHosts, WAIT};

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
    listener_at(ch, localhost(port), backlog)
}

fn listener_at(ch: &EventChannel, at: SocketAddrV4, backlog: i32) -> Result<CmId> {
    let id = CmId::create(ch, PortSpace::Tcp)?;
    assert_eq!(id.bind(at)?, at);
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

/// A listener of `server` on `at`, a client of `client` that connects to
/// it with QPs attached, a message over them, and the client's
/// disconnect seen on both sides. The two contexts may be of one daemon
/// or of two.
fn connect_send_disconnect(client: &vrdma::Context, server: &vrdma::Context, at: SocketAddrV4) -> Result<()> {
    let (server_ch, client_ch) = (EventChannel::create(server)?, EventChannel::create(client)?);
    let listener = CmId::create(&server_ch, PortSpace::Tcp)?;
    assert_eq!(listener.bind(at)?, at);
    listener.listen(8)?;

    let id = resolved(&client_ch, at)?;
    let a = Side::with(client, 4096, 64, cap(16, 1), None)?;
    id.attach_qp(&a.qp)?;
    assert_eq!(a.qp.state(), QpState::Init);
    id.connect(&param(b"from the client"))?;

    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    assert_eq!(req.listen_id, Some(listener.id()));
    let peer = req.peer.clone().unwrap();
    assert_eq!((peer.qp_num, peer.private_data.as_slice()), (a.qp.qpn(), &b"from the client"[..]));
    let server_id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    assert_eq!(server_id.local_addr()?, Some(at));
    assert_eq!(server_id.peer_addr()?, id.local_addr()?);
    let b = Side::with(server, 4096, 64, cap(16, 1), None)?;
    server_id.attach_qp(&b.qp)?;
    b.qp.post_recv(&[vrdma::wr::recv(1, &[b.mr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    server_id.accept(&param(b"from the server"))?;
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

    id.disconnect()?;
    expect(&client_ch, EventKind::Disconnected)?;
    expect(&server_ch, EventKind::Disconnected)?;
    assert_eq!(a.qp.state(), QpState::Err, "the initiator's QP is flushed");
    Ok(())
}

/// An id's QP may be of another context of the same process, as the
/// drop-in librdmacm attaches the QPs of the program's libibverbs (a
/// context of its own), attached apart or made attached in one call: the
/// daemon moves it (INIT on attach, RTS before the reply goes and when it
/// comes), and the events of a resolution and of a request carry the
/// id's addresses, as its queries give them.
#[test]
fn a_qp_of_another_context_of_the_process_is_attached_and_brought_up() -> Result<()> {
    let d = DaemonProc::start()?;
    let (client, server) = (d.context()?, d.context()?);
    let (client_verbs, server_verbs) = (d.context()?, d.context()?);
    let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
    let _listener = listener(&server_ch, 7502, 8)?;

    let id = CmId::create(&client_ch, PortSpace::Tcp)?;
    id.resolve_addr(None, localhost(7502))?;
    let ev = expect(&client_ch, EventKind::AddrResolved)?;
    assert_eq!((ev.local, ev.remote), id.addrs()?);
    assert_eq!(ev.remote, Some(localhost(7502)));
    assert!(ev.local.is_some_and(|l| l.port() != 0), "{ev:?}");
    id.resolve_route()?;
    expect(&client_ch, EventKind::RouteResolved)?;

    let a = Side::with(&client_verbs, 4096, 64, cap(16, 1), None)?;
    id.attach_qp_num(a.qp.qpn())?;
    assert_eq!(a.qp.state(), QpState::Init);
    id.connect(&param(b""))?;
    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    let server_id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    assert_eq!((req.local, req.remote), server_id.addrs()?);
    assert_eq!((req.local, req.remote), (Some(localhost(7502)), ev.local));
    // The passive side's QP made attached in one call, naming the id of
    // the other context.
    let mut b = Side::with(&server_verbs, 4096, 64, cap(16, 1), None)?;
    b.qp = b.pd.create_qp_for_cm_id(&vrdma::QpInit::rc(&b.cq, &b.cq, cap(16, 1)), server_id.id())?;
    assert_eq!(b.qp.state(), QpState::Init);
    b.qp.post_recv(&[vrdma::wr::recv(1, &[b.mr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    server_id.accept(&param(b""))?;
    assert_eq!(b.qp.state(), QpState::Rts, "ready before the reply goes");
    expect(&client_ch, EventKind::Established)?;
    assert_eq!(a.qp.state(), QpState::Rts);
    expect(&server_ch, EventKind::Established)?;

    a.mr.write(0, b"other ctx")?;
    a.qp.post_send(&[vrdma::wr::send(2, &[a.mr.sge(0, 9)?])?.signaled()]).map_err(|e| e.error)?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&b.cq, WAIT)?.byte_len, 9);

    // A QP the program destroyed before its disconnect has nothing to
    // flush: the disconnect still goes.
    drop(a);
    id.disconnect()?;
    expect(&client_ch, EventKind::Disconnected)?;
    expect(&server_ch, EventKind::Disconnected)?;
    Ok(())
}

/// `rdma_create_qp` as one call: the QP comes back attached, in INIT,
/// and the connection brings it up as an attached one. A QP whose attach
/// fails (a UD QP on a TCP id: the id's INIT attributes are an RC QP's)
/// is destroyed: fifty such failures under a quota of 16 objects leave
/// room for a QP made apart.
#[test]
fn create_qp_on_an_id_attaches_it_in_one_call_or_leaves_no_qp_behind() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_objects = 16\n")?;
    let (client, server) = (d.context()?, d.context()?);
    let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
    let listener = listener(&server_ch, 7501, 8)?;
    let id = resolved(&client_ch, localhost(7501))?;

    let (pd, cq) = (client.alloc_pd()?, client.create_cq(16, None)?);
    for _ in 0..50 {
        let e = id.create_qp(&pd, &vrdma::QpInit::ud(&cq, &cq, cap(4, 1))).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "a UD QP cannot take a TCP id's INIT attributes: {e}");
    }
    drop(pd.create_rc_qp(&cq, &cq, cap(4, 1))?);

    let qp = id.create_qp(&pd, &vrdma::QpInit::rc(&cq, &cq, cap(4, 1)))?;
    assert_eq!(qp.state(), QpState::Init);
    id.connect(&param(b""))?;
    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    assert_eq!(req.listen_id, Some(listener.id()));
    let server_id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    let (spd, scq) = (server.alloc_pd()?, server.create_cq(16, None)?);
    let sqp = server_id.create_qp(&spd, &vrdma::QpInit::rc(&scq, &scq, cap(4, 1)))?;
    server_id.accept(&param(b""))?;
    assert_eq!(sqp.state(), QpState::Rts, "ready before the reply goes");
    expect(&client_ch, EventKind::Established)?;
    assert_eq!(qp.state(), QpState::Rts);
    expect(&server_ch, EventKind::Established)?;
    Ok(())
}

/// `rdma_create_qp` with no CQs given, as one call: the CQ and the QP
/// come back together, the QP attached in INIT and completing into the
/// CQ; the connection brings both sides' up and a message crosses. A
/// call whose QP part fails (a UD QP on a TCP id) leaves neither behind:
/// fifty such failures under a quota of 24 objects leave room for more.
#[test]
fn create_qp_with_cq_makes_both_in_one_call_or_leaves_nothing_behind() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_objects = 24\n")?;
    let (client, server) = (d.context()?, d.context()?);
    let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
    let _listener = listener(&server_ch, 7503, 8)?;
    let id = resolved(&client_ch, localhost(7503))?;

    let pd = client.alloc_pd()?;
    for _ in 0..50 {
        let e = id.create_qp_with_cq(&pd, vrdma::QpType::Ud, 16, cap(4, 1)).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "a UD QP cannot take a TCP id's INIT attributes: {e}");
    }
    let (cq, qp) = id.create_qp_with_cq(&pd, vrdma::QpType::Rc, 16, cap(4, 1))?;
    assert!(cq.depth() >= 16);
    assert_eq!(qp.state(), QpState::Init);
    let mr = pd.alloc_mr(64, vrdma::AccessFlags::LOCAL_WRITE)?;
    id.connect(&param(b""))?;

    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    let server_id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    let spd = server.alloc_pd()?;
    let (scq, sqp) = server_id.create_qp_with_cq(&spd, vrdma::QpType::Rc, 16, cap(4, 1))?;
    let smr = spd.alloc_mr(64, vrdma::AccessFlags::LOCAL_WRITE)?;
    sqp.post_recv(&[vrdma::wr::recv(1, &[smr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    server_id.accept(&param(b""))?;
    assert_eq!(sqp.state(), QpState::Rts, "ready before the reply goes");
    expect(&client_ch, EventKind::Established)?;
    assert_eq!(qp.state(), QpState::Rts);
    expect(&server_ch, EventKind::Established)?;

    mr.write(0, b"one call")?;
    qp.post_send(&[vrdma::wr::send(2, &[mr.sge(0, 8)?])?.signaled()]).map_err(|e| e.error)?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success, "the send completes into the CQ made with it");
    let wc = poll_one(&scq, WAIT)?;
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 8), "and the receive into the peer's");
    Ok(())
}

#[test]
fn a_connection_by_address_carries_messages_and_ends_disconnected_on_both_sides() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    connect_send_disconnect(&ctx, &ctx, localhost(vrdma_it::free_port()?))
}

/// The exchange rides the link between two daemons, dialled for it.
#[test]
fn across_hosts_a_connection_by_address_carries_messages_and_ends_disconnected() -> Result<()> {
    let hosts = TwoHosts::start(false)?;
    let at = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 3), vrdma_it::free_port()?);
    connect_send_disconnect(&hosts.a.context()?, &hosts.b.context()?, at)
}

/// A peer daemon that dies after the connection is up: its link ends
/// after the dead time, and so does the connection.
#[test]
fn across_hosts_a_dead_peer_daemon_ends_its_connections_in_disconnected() -> Result<()> {
    let mut hosts = TwoHosts::start(false)?;
    let at = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 3), vrdma_it::free_port()?);
    let (a_ctx, b_ctx) = (hosts.a.context()?, hosts.b.context()?);
    let (server_ch, ch) = (EventChannel::create(&b_ctx)?, EventChannel::create(&a_ctx)?);
    let _listener = listener_at(&server_ch, at, 1)?;
    let client = resolved(&ch, at)?;
    client.connect(&param(b""))?;
    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    let server = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    server.accept(&param(b""))?;
    let resp = expect(&ch, EventKind::ConnectResponse)?;
    assert_eq!(resp.id, client.id(), "no QP attached: the program establishes");
    client.establish()?;
    expect(&server_ch, EventKind::Established)?;
    std::mem::forget((server, server_ch, b_ctx));
    hosts.b.proc.kill(libc::SIGKILL);
    let started = Instant::now();
    expect(&ch, EventKind::Disconnected)?;
    assert!(started.elapsed() < WAIT);
    Ok(())
}

/// B's daemon restarted: a second daemon at b's address (its own port)
/// links to a's while a's link to the first is up. A connection a makes
/// to b's address goes by the newest link, to the new daemon, and so do
/// its QP's messages; when the first daemon dies and its link ends, what
/// was made over that link ends, and only that: the new link's connection
/// carries a message still, and a request of the new daemon's that a had
/// not answered is answered (issue 16 review: the old link's end ended
/// every connection with its host, and a's requests went by the oldest).
#[test]
fn across_hosts_an_old_links_end_leaves_what_a_restarted_peers_new_link_made() -> Result<()> {
    let mut hosts = TwoHosts::start(false)?;
    let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));
    let links_up =
        |d: &DaemonProc| -> Result<usize> { Ok(d.context()?.stat()?.links.iter().filter(|l| l.up).count()) };
    let (a_ctx, b1_ctx) = (hosts.a.context()?, hosts.b.context()?);
    // A connection over the first link (a dials b's daemon for it).
    let (old_srv_ch, old_ch) = (EventChannel::create(&b1_ctx)?, EventChannel::create(&a_ctx)?);
    let old_at = SocketAddrV4::new(b_ip, vrdma_it::free_port()?);
    let _old_listener = listener_at(&old_srv_ch, old_at, 1)?;
    let old = resolved(&old_ch, old_at)?;
    old.connect(&param(b""))?;
    let req = expect(&old_srv_ch, EventKind::ConnectRequest)?;
    let old_srv = CmId::from_request(&old_srv_ch, &req, PortSpace::Tcp)?;
    old_srv.accept(&param(b""))?;
    expect(&old_ch, EventKind::ConnectResponse)?;
    old.establish()?;
    expect(&old_srv_ch, EventKind::Established)?;

    // The new daemon at b's address dials a's, its configured peer. (Its
    // own daemon id: a dialled the first, and would take a link from a
    // daemon of the same id for the other half of a simultaneous dial.)
    let peer_a = format!("{a_ip}:{}", hosts.port);
    let cfg = vrdma_it::host_config(&b_ip.to_string(), vrdma_it::free_port()?, &[peer_a], "");
    let b2 = DaemonProc::start_with_config(&format!("{cfg}id = 3303\n"))?;
    vrdma_it::wait_until(Duration::from_secs(20), "a's daemon has both links", || {
        links_up(&hosts.a).ok() == Some(2) && links_up(&b2).ok() == Some(1)
    })?;
    let b2_ctx = b2.context()?;

    // a's connection, with QPs, to a listener of the new daemon.
    let (srv_ch, ch) = (EventChannel::create(&b2_ctx)?, EventChannel::create(&a_ctx)?);
    let at = SocketAddrV4::new(b_ip, vrdma_it::free_port()?);
    let _listener = listener_at(&srv_ch, at, 8)?;
    let id = resolved(&ch, at)?;
    let a = Side::with(&a_ctx, 4096, 64, cap(16, 1), None)?;
    id.attach_qp(&a.qp)?;
    id.connect(&param(b""))?;
    let req = expect(&srv_ch, EventKind::ConnectRequest)?;
    let srv = CmId::from_request(&srv_ch, &req, PortSpace::Tcp)?;
    let b = Side::with(&b2_ctx, 4096, 64, cap(16, 1), None)?;
    srv.attach_qp(&b.qp)?;
    b.qp.post_recv(&[vrdma::wr::recv(1, &[b.mr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    srv.accept(&param(b""))?;
    expect(&ch, EventKind::Established)?;
    expect(&srv_ch, EventKind::Established)?;
    // The new daemon's request to a listener of a's, not answered yet.
    let a_at = SocketAddrV4::new(a_ip, vrdma_it::free_port()?);
    let (a_srv_ch, b_ch) = (EventChannel::create(&a_ctx)?, EventChannel::create(&b2_ctx)?);
    let _a_listener = listener_at(&a_srv_ch, a_at, 8)?;
    let b_id = resolved(&b_ch, a_at)?;
    b_id.connect(&param(b""))?;
    let pending = expect(&a_srv_ch, EventKind::ConnectRequest)?;

    // The first daemon dies: its link ends, and its connection with it.
    std::mem::forget((old_srv, old_srv_ch, b1_ctx));
    hosts.b.proc.kill(libc::SIGKILL);
    expect(&old_ch, EventKind::Disconnected)?;
    vrdma_it::wait_until(Duration::from_secs(20), "the old link goes down", || {
        links_up(&hosts.a).ok() == Some(1)
    })?;

    // The new link's connection carries a message, and the request is
    // answered.
    a.mr.write(0, b"new link")?;
    a.qp.post_send(&[vrdma::wr::send(2, &[a.mr.sge(0, 8)?])?.signaled()]).map_err(|e| e.error)?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&b.cq, WAIT)?.byte_len, 8);
    let answered = CmId::from_request(&a_srv_ch, &pending, PortSpace::Tcp)?;
    answered.accept(&param(b""))?;
    expect(&b_ch, EventKind::ConnectResponse)?;
    b_id.establish()?;
    expect(&a_srv_ch, EventKind::Established)?;
    // a's connection ends when a ends it, not before.
    id.disconnect()?;
    expect(&ch, EventKind::Disconnected)?;
    expect(&srv_ch, EventKind::Disconnected)?;
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

/// A route the library resolves itself (the address's reply said the
/// address was resolved, and nothing waits unread): ROUTE_RESOLVED is one
/// event, read after the events rung before it and before those rung
/// after; it makes the channel's descriptor readable, `O_NONBLOCK` or not,
/// and wakes a thread that polls the descriptor before reading; a second
/// resolution, or an address's, fails as the daemon's would (EINVAL: the
/// daemon learnt of the route first); and a connect after such a route
/// is established on both sides (the daemon learns of the route with it).
#[test]
fn a_route_resolved_in_the_library_is_one_event_in_order_and_wakes_a_poller() -> Result<()> {
    use rustix::event::{PollFd, PollFlags};
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    let flags = rustix::fs::fcntl_getfl(ch.fd())?;
    rustix::fs::fcntl_setfl(ch.fd(), flags | rustix::fs::OFlags::NONBLOCK)?;
    let readable = |wait: Duration| -> Result<bool> {
        let fd = ch.fd();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let ts = rustix::time::Timespec::try_from(wait)?;
        Ok(rustix::event::poll(&mut fds, Some(&ts))? == 1)
    };
    let a = CmId::create(&ch, PortSpace::Tcp)?;
    a.resolve_addr(None, localhost(7))?;
    expect(&ch, EventKind::AddrResolved)?;
    assert!(!readable(Duration::ZERO)?);
    std::thread::scope(|s| -> Result<()> {
        // Polls the descriptor, as a program with an event loop does,
        // before the route is asked for (if it runs late, the descriptor
        // is already readable: it wakes either way).
        let poller = s.spawn(|| readable(WAIT));
        std::thread::sleep(Duration::from_millis(20));
        a.resolve_route()?;
        ensure!(poller.join().map_err(|_| anyhow::anyhow!("poller panicked"))??, "the poller never woke");
        Ok(())
    })?;
    assert!(readable(Duration::ZERO)?);
    // An event rung after the route's is read after it.
    let b = CmId::create(&ch, PortSpace::Tcp)?;
    b.resolve_addr(None, localhost(7))?;
    let route = expect(&ch, EventKind::RouteResolved)?;
    assert_eq!(route.id, a.id());
    assert_eq!((route.local.is_some(), route.remote), (true, Some(localhost(7))));
    assert!(readable(Duration::ZERO)?, "the address event of the other id waits");
    assert_eq!(expect(&ch, EventKind::AddrResolved)?.id, b.id());
    assert!(!readable(Duration::ZERO)?);
    assert!(ch.try_get_event()?.is_none(), "ROUTE_RESOLVED once");
    assert!(ch.get_event(Some(Duration::from_millis(50)))?.is_none());
    let again = a.resolve_route().expect_err("a route resolved twice");
    assert_eq!(again.errno(), libc::EINVAL, "{again}");
    let addr = a.resolve_addr(None, localhost(7)).expect_err("an address resolved after its route");
    assert_eq!(addr.errno(), libc::EINVAL, "{addr}");
    assert!(ch.get_event(Some(Duration::from_millis(50)))?.is_none());
    // A connect after a route resolved here.
    let server = EventChannel::create(&ctx)?;
    let l = CmId::create(&server, PortSpace::Tcp)?;
    let at = l.bind(localhost(0))?;
    l.listen(4)?;
    let c = resolved(&ch, at)?;
    c.connect(&param(b""))?;
    let req = expect(&server, EventKind::ConnectRequest)?;
    let s = CmId::from_request(&server, &req, PortSpace::Tcp)?;
    s.accept(&param(b""))?;
    // (No QP on the client's id: its program finishes the exchange.)
    expect(&ch, EventKind::ConnectResponse)?;
    c.establish()?;
    expect(&server, EventKind::Established)?;
    Ok(())
}

/// An event that came in its call's reply (a resolve's) and was not read
/// goes with its id when the id is destroyed, and moves with it to
/// another channel, as the kernel's unread events do; the old channel's
/// descriptor is left with nothing to read.
#[test]
fn an_event_carried_by_its_calls_reply_goes_with_its_id_and_moves_with_it() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    let readable = |ch: &EventChannel| -> Result<bool> {
        let fd = ch.fd();
        let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
        let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
        Ok(rustix::event::poll(&mut fds, Some(&zero))? == 1)
    };
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    id.resolve_addr(None, localhost(7))?;
    assert!(readable(&ch)?);
    drop(id);
    assert!(ch.get_event(Some(Duration::from_millis(50)))?.is_none());
    assert!(!readable(&ch)?);
    let mut id = CmId::create(&ch, PortSpace::Tcp)?;
    id.resolve_addr(None, localhost(7))?;
    let other = EventChannel::create(&ctx)?;
    id.migrate(&other)?;
    let ev = expect(&other, EventKind::AddrResolved)?;
    assert_eq!(ev.id, id.id());
    assert!(ch.get_event(Some(Duration::from_millis(50)))?.is_none());
    assert!(!readable(&ch)?);
    Ok(())
}

/// With the transport between daemons off (no key), a request for
/// another host has nowhere to go: UNREACHABLE at once, and the daemon's
/// log says which line turns the transport on.
#[test]
fn with_the_transport_off_a_connection_to_another_host_ends_unreachable_promptly() -> Result<()> {
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

/// The daemon restarted under a program: each channel's descriptor turns
/// readable, each id with a device hears DEVICE_REMOVAL once (the
/// listener, the accepted id and the requester; not an id that has no
/// address), then the channel fails with ENODEV rather than wait; and a
/// new context reaches the new daemon, where a new connection works.
#[test]
fn a_restarted_daemon_is_device_removal_for_every_id_with_a_device_then_new_connections_work() -> Result<()> {
    let mut d = DaemonProc::start()?;
    let at = localhost(vrdma_it::free_port()?);
    {
        let (server, client) = (d.context()?, d.context()?);
        let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
        let listener = listener_at(&server_ch, at, 4)?;
        let id = resolved(&client_ch, at)?;
        let idle = CmId::create(&client_ch, PortSpace::Tcp)?;
        let a = Side::with(&client, 4096, 64, cap(16, 1), None)?;
        id.attach_qp(&a.qp)?;
        id.connect(&param(b""))?;
        let req = expect(&server_ch, EventKind::ConnectRequest)?;
        let accepted = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
        accepted.accept(&param(b""))?;
        expect(&client_ch, EventKind::Established)?;
        expect(&server_ch, EventKind::Established)?;

        d.restart()?;
        for ch in [&server_ch, &client_ch] {
            let fd = ch.fd();
            let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
            let ts = rustix::time::Timespec { tv_sec: WAIT.as_secs() as i64, tv_nsec: 0 };
            ensure!(rustix::event::poll(&mut fds, Some(&ts))? == 1, "the channel's descriptor stayed quiet");
        }
        let mut heard = Vec::new();
        for (ch, n) in [(&server_ch, 2), (&client_ch, 1)] {
            for _ in 0..n {
                let ev = expect(ch, EventKind::DeviceRemoval)?;
                heard.push(ev.id);
            }
            let after = ch.get_event(Some(WAIT));
            ensure!(
                matches!(&after, Err(e) if e.errno() == libc::ENODEV),
                "after the removals: {after:?} (expected ENODEV, at once)"
            );
        }
        heard.sort_unstable();
        let mut want = vec![listener.id(), accepted.id(), id.id()];
        want.sort_unstable();
        ensure!(
            heard == want,
            "DEVICE_REMOVAL for {heard:?}, expected {want:?} (not the idle {})",
            idle.id()
        );
    }
    let ctx = d.context()?;
    connect_send_disconnect(&ctx, &ctx, localhost(vrdma_it::free_port()?))
}
