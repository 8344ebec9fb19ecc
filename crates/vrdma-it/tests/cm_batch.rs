//! Connection-manager calls folded into fewer round trips, against a real
//! daemon: `rdma_create_qp` with its connect or accept in one message
//! (`CmRequest::Batch`), what the daemon answers to a batch it must
//! refuse or that fails part-way (and which call failed), and the spare
//! id each event channel keeps for its next `rdma_create_id`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use vrdma::cm::{CmEvent, CmId, ConnInfo, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma::wr::SendWrExt;
use vrdma::{QpState, WcStatus};
use vrdma_core::proto::{
    CmBatchOp, CmReply, CmRequest, Reply, Request, MAX_CM_BATCH, MAX_CM_EVENTS, MAX_CM_UNREAD,
};
use vrdma_core::verbs::{QpInitAttr, QpType};
use vrdma_it::control_proxy::{context_through_proxy, Seen};
use vrdma_it::{cap, poll_one, DaemonProc, RawConn, WAIT};

fn expect(ch: &EventChannel, kind: EventKind) -> Result<CmEvent> {
    match ch.get_event(Some(WAIT))? {
        Some(ev) if ev.kind == kind => Ok(ev),
        Some(ev) => bail!("expected {kind:?}, got {ev:?}"),
        None => bail!("no {kind:?} within {WAIT:?}"),
    }
}

fn localhost(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)
}

/// Both sides make their CQ and QP in the call that connects or accepts:
/// each QP is the id's (brought up by the daemon, its number the one the
/// peer learns), the connection is established on both sides, and a
/// message crosses.
#[test]
fn create_qp_with_connect_and_with_accept_establish_in_one_call_each() -> Result<()> {
    let d = DaemonProc::start()?;
    let (client, server) = (d.context()?, d.context()?);
    let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
    let at = localhost(vrdma_it::free_port()?);
    let listener = CmId::create(&server_ch, PortSpace::Tcp)?;
    listener.bind(at)?;
    listener.listen(4)?;

    let id = CmId::create(&client_ch, PortSpace::Tcp)?;
    id.resolve_addr(None, at)?;
    expect(&client_ch, EventKind::AddrResolved)?;
    id.resolve_route()?;
    expect(&client_ch, EventKind::RouteResolved)?;
    let pd = client.alloc_pd()?;
    let param = ConnParam { private_data: b"hi".to_vec(), ..ConnParam::default() };
    let (cq, qp) = id.create_qp_with_cq_and_connect(&pd, vrdma::QpType::Rc, 16, cap(4, 1), &param)?;
    assert_eq!(qp.state(), QpState::Init, "attached, waiting for the reply");

    let req = expect(&server_ch, EventKind::ConnectRequest)?;
    let peer = req.peer.clone().expect("a request carries the peer's parameters");
    assert_eq!(peer.qp_num, qp.qpn(), "the connect named the QP made with it");
    assert_eq!(peer.private_data, b"hi");
    let server_id = CmId::from_request(&server_ch, &req, PortSpace::Tcp)?;
    let spd = server.alloc_pd()?;
    let (scq, sqp) = server_id.create_qp_with_cq_and_accept(
        &spd,
        vrdma::QpType::Rc,
        16,
        cap(4, 1),
        &ConnParam::default(),
    )?;
    assert_eq!(sqp.state(), QpState::Rts, "brought up before the reply went");
    let smr = spd.alloc_mr(64, vrdma::AccessFlags::LOCAL_WRITE)?;
    sqp.post_recv(&[vrdma::wr::recv(1, &[smr.sge(0, 64)?])?]).map_err(|e| e.error)?;
    let est = expect(&client_ch, EventKind::Established)?;
    assert_eq!(est.peer.map(|p| p.qp_num), Some(sqp.qpn()), "the accept named the QP made with it");
    expect(&server_ch, EventKind::Established)?;
    assert_eq!(qp.state(), QpState::Rts);

    let mr = pd.alloc_mr(64, vrdma::AccessFlags::LOCAL_WRITE)?;
    mr.write(0, b"batched!")?;
    qp.post_send(&[vrdma::wr::send(2, &[mr.sge(0, 8)?])?.signaled()]).map_err(|e| e.error)?;
    assert_eq!(poll_one(&cq, WAIT)?.status, WcStatus::Success);
    let wc = poll_one(&scq, WAIT)?;
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 8));
    Ok(())
}

/// A connect that fails after its QP was made in the same call: the call
/// fails with the connect's error, and neither the CQ nor the QP stays
/// (forty such failures under a quota of 16 objects leave room for
/// more); the id can still connect.
#[test]
fn a_batched_connect_that_fails_leaves_no_cq_or_qp_behind() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_objects = 16\n")?;
    let ctx = d.context()?;
    let ch = EventChannel::create(&ctx)?;
    let at = localhost(vrdma_it::free_port()?);
    let listener = CmId::create(&ch, PortSpace::Tcp)?;
    listener.bind(at)?;
    listener.listen(4)?;
    let pd = ctx.alloc_pd()?;
    // Not resolved: a connect is in the wrong state.
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    for _ in 0..40 {
        let e = id
            .create_qp_with_cq_and_connect(&pd, vrdma::QpType::Rc, 16, cap(4, 1), &ConnParam::default())
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{e}");
        assert!(e.to_string().contains("call 1 of the batch"), "says which call failed: {e}");
    }
    id.resolve_addr(None, at)?;
    expect(&ch, EventKind::AddrResolved)?;
    id.resolve_route()?;
    expect(&ch, EventKind::RouteResolved)?;
    let (_cq, _qp) =
        id.create_qp_with_cq_and_connect(&pd, vrdma::QpType::Rc, 16, cap(4, 1), &ConnParam::default())?;
    expect(&ch, EventKind::ConnectRequest)?;
    Ok(())
}

fn rc_init() -> QpInitAttr {
    QpInitAttr { qp_type: QpType::Rc, send_cq: 0, recv_cq: 0, srq: None, cap: cap(4, 1), sq_sig_all: false }
}

/// What the daemon answers on the wire: an empty batch and one over the
/// limit are refused whole (EINVAL, nothing run); a batch whose second
/// call fails answers the first's reply, then the second's error and its
/// index, and runs nothing after it; and the connection goes on serving.
#[test]
fn the_daemon_bounds_a_batch_and_says_which_call_failed() -> Result<()> {
    let d = DaemonProc::start()?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let channel = match c.call(&Request::Cm(CmRequest::CreateChannel), &[])?.reply()? {
        Reply::Cm(CmReply::Channel { channel }) => channel,
        other => bail!("CreateChannel answered {other:?}"),
    };
    let new_id = |c: &mut RawConn| -> Result<u32> {
        match c.call(&Request::Cm(CmRequest::CreateId { channel, ps: PortSpace::Tcp.raw() }), &[])?.reply()? {
            Reply::Cm(CmReply::Id { id }) => Ok(id),
            other => bail!("CreateId answered {other:?}"),
        }
    };
    let id = new_id(&mut c)?;

    let refused = |c: &mut RawConn, ops: Vec<CmBatchOp>| -> Result<(i32, String)> {
        match c.call(&Request::Cm(CmRequest::Batch { ops }), &[])?.reply()? {
            Reply::Error { errno, message } => Ok((errno, message)),
            other => bail!("expected an error, got {other:?}"),
        }
    };
    let (errno, message) = refused(&mut c, Vec::new())?;
    ensure!(errno == libc::EINVAL, "an empty batch: {errno} {message}");
    let many = vec![CmBatchOp::RouteReported { id }; MAX_CM_BATCH + 1];
    let (errno, message) = refused(&mut c, many)?;
    ensure!(errno == libc::EINVAL && message.contains("1 to"), "too long a batch: {errno} {message}");

    // Two calls: the first (an attach of a QP that is not there) fails,
    // so the second (which would move the id) never runs.
    let ops = vec![CmBatchOp::AttachQp { id, qp: 0xdead }, CmBatchOp::RouteReported { id }];
    match c.call(&Request::Cm(CmRequest::Batch { ops }), &[])?.reply()? {
        Reply::Batch { replies, failed: Some(0) } => {
            ensure!(replies.len() == 1 && matches!(replies[0], Reply::Error { .. }), "{replies:?}");
        }
        other => bail!("expected a batch failed at 0, got {other:?}"),
    }

    // A CQ and QP made, then an accept of an id that has no request:
    // the first reply stands (with its rings' descriptors), the second is
    // the accept's error, at index 1.
    let pd = match c.call(&Request::AllocPd, &[])?.reply()? {
        Reply::Pd { pd } => pd,
        other => bail!("AllocPd answered {other:?}"),
    };
    let ops = vec![
        CmBatchOp::CreateQpWithCq { id, pd, cqe: 16, init: rc_init() },
        CmBatchOp::Accept { id, conn: ConnInfo::default(), qkey: 0 },
        CmBatchOp::RouteReported { id },
    ];
    let (replies, failed) = match c.call(&Request::Cm(CmRequest::Batch { ops }), &[])?.reply()? {
        Reply::Pooled { reply, .. } => match *reply {
            Reply::Batch { replies, failed } => (replies, failed),
            other => bail!("a pooled {other:?}"),
        },
        Reply::Batch { replies, failed } => (replies, failed),
        other => bail!("expected a batch, got {other:?}"),
    };
    ensure!(failed == Some(1), "the accept failed: {failed:?} {replies:?}");
    ensure!(replies.len() == 2, "nothing ran after it: {replies:?}");
    ensure!(matches!(replies[0], Reply::CqQp { .. }), "{:?}", replies[0]);
    match &replies[1] {
        Reply::Error { errno, message } => {
            ensure!(*errno == libc::EINVAL && message.contains("call 1 of the batch"), "{errno} {message}")
        }
        other => bail!("{other:?}"),
    }
    // Still serving.
    new_id(&mut c)?;
    Ok(())
}

/// The spare id a channel keeps: ids made in a row are distinct and each
/// works; a channel whose spare's reply is still unread, or read, is
/// destroyed cleanly (the daemon refuses to destroy a channel that still
/// has an id, and the channel's descriptor would stay charged: the spare
/// goes first), so that a context makes and drops many more channels
/// than its descriptor quota holds.
#[test]
fn spare_ids_are_distinct_and_go_with_their_channel() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_descriptors = 32\n")?;
    let ctx = d.context()?;
    for round in 0..60 {
        let ch = EventChannel::create(&ctx)?;
        let a = CmId::create(&ch, PortSpace::Tcp)?;
        let b = CmId::create(&ch, PortSpace::Tcp)?;
        ensure!(a.id() != b.id(), "round {round}: two ids alike");
        let at = localhost(vrdma_it::free_port()?);
        a.bind(at)?;
        a.listen(1)?;
        b.resolve_addr(None, at)?;
        expect(&ch, EventKind::AddrResolved)?;
        drop((a, b));
        if round % 2 == 0 {
            // Its last spare's reply is read (a call of the context).
            vrdma::cm::is_listening(&ctx, PortSpace::Tcp, at)?;
        }
    }
    Ok(())
}

/// `rdma_resolve_addr` right after `rdma_create_id` carries the request
/// for the channel's next spare id (a batch of `ResolveAddr` then
/// `CreateId`): in a row of create-and-resolve, each id is distinct and
/// resolves, the spare made there is the next create's, and a channel
/// dropped with such a spare goes cleanly (the descriptor quota would run
/// out otherwise). A resolve that fails there fails exactly as alone
/// (same errno, same message) and makes no spare; the next create still
/// works.
#[test]
fn a_resolve_carries_the_spare_request_and_fails_as_alone() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_descriptors = 32\n")?;
    let ctx = d.context()?;
    let server_ch = EventChannel::create(&ctx)?;
    let listener = CmId::create(&server_ch, PortSpace::Tcp)?;
    let at = localhost(vrdma_it::free_port()?);
    listener.bind(at)?;
    listener.listen(8)?;
    for round in 0..40 {
        let ch = EventChannel::create(&ctx)?;
        let mut seen = Vec::new();
        for _ in 0..3 {
            let id = CmId::create(&ch, PortSpace::Tcp)?;
            ensure!(!seen.contains(&id.id()), "round {round}: id {} made twice", id.id());
            seen.push(id.id());
            id.resolve_addr(None, at)?;
            let ev = expect(&ch, EventKind::AddrResolved)?;
            ensure!(ev.id == id.id() && ev.remote == Some(at), "round {round}: {ev:?}");
        }
        if round == 0 {
            // A failed resolve, batched (the channel wants a spare after
            // the create) and then alone: the same error.
            let id = CmId::create(&ch, PortSpace::Tcp)?;
            let nowhere = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, at.port());
            let batched = id.resolve_addr(None, nowhere).expect_err("a resolve to 0.0.0.0");
            let alone = id.resolve_addr(None, nowhere).expect_err("a resolve to 0.0.0.0");
            ensure!(batched.to_string() == alone.to_string(), "{batched} against {alone}");
            ensure!(!batched.to_string().contains("batch"), "{batched}");
            // No spare was made: the next create asks for its id and works.
            let next = CmId::create(&ch, PortSpace::Tcp)?;
            next.resolve_addr(None, at)?;
            expect(&ch, EventKind::AddrResolved)?;
        }
    }
    Ok(())
}

/// What the daemon answers to the kinds a resolve's batch carries: the
/// resolve's event and the new id; a `CreateId` it refuses (another's
/// channel, a port space rdma_cm has not) fails as call 1, the resolve
/// done; a resolve it refuses fails as call 0, and no id is made after
/// it.
#[test]
fn the_daemon_answers_a_resolve_and_create_id_batch() -> Result<()> {
    let d = DaemonProc::start()?;
    let mut c = RawConn::connect(&d.socket)?;
    c.hello()?;
    let channel = match c.call(&Request::Cm(CmRequest::CreateChannel), &[])?.reply()? {
        Reply::Cm(CmReply::Channel { channel }) => channel,
        other => bail!("CreateChannel answered {other:?}"),
    };
    let tcp = PortSpace::Tcp.raw();
    let new_id = |c: &mut RawConn| -> Result<u32> {
        match c.call(&Request::Cm(CmRequest::CreateId { channel, ps: tcp }), &[])?.reply()? {
            Reply::Cm(CmReply::Id { id }) => Ok(id),
            other => bail!("CreateId answered {other:?}"),
        }
    };
    let batch = |c: &mut RawConn, ops: Vec<CmBatchOp>| -> Result<(Vec<Reply>, Option<u32>)> {
        match c.call(&Request::Cm(CmRequest::Batch { ops }), &[])?.reply()? {
            Reply::Batch { replies, failed } => Ok((replies, failed)),
            other => bail!("expected a batch, got {other:?}"),
        }
    };
    let dst = localhost(vrdma_it::free_port()?);

    let id = new_id(&mut c)?;
    let (replies, failed) = batch(
        &mut c,
        vec![CmBatchOp::ResolveAddr { id, src: None, dst }, CmBatchOp::CreateId { channel, ps: tcp }],
    )?;
    ensure!(failed.is_none() && replies.len() == 2, "{replies:?} {failed:?}");
    ensure!(matches!(replies[0], Reply::Cm(CmReply::Event { .. })), "{:?}", replies[0]);
    match replies[1] {
        Reply::Cm(CmReply::Id { id: spare }) => ensure!(spare != id, "the spare is a new id"),
        ref other => bail!("CreateId answered {other:?}"),
    }

    for bad in
        [CmBatchOp::CreateId { channel: channel + 1000, ps: tcp }, CmBatchOp::CreateId { channel, ps: 0x999 }]
    {
        let id = new_id(&mut c)?;
        let (replies, failed) =
            batch(&mut c, vec![CmBatchOp::ResolveAddr { id, src: None, dst }, bad.clone()])?;
        ensure!(failed == Some(1) && replies.len() == 2, "{bad:?}: {replies:?} {failed:?}");
        ensure!(
            matches!(replies[0], Reply::Cm(CmReply::Event { .. })),
            "{bad:?}: the resolve ran: {replies:?}"
        );
        match &replies[1] {
            Reply::Error { errno, message } => {
                ensure!(
                    *errno == libc::EINVAL && message.contains("call 1 of the batch"),
                    "{errno} {message}"
                )
            }
            other => bail!("{bad:?}: {other:?}"),
        }
    }

    // A resolve of an id that is not there: call 0 fails, nothing after.
    let (replies, failed) = batch(
        &mut c,
        vec![CmBatchOp::ResolveAddr { id: 0xdead, src: None, dst }, CmBatchOp::CreateId { channel, ps: tcp }],
    )?;
    ensure!(failed == Some(0) && replies.len() == 1, "{replies:?} {failed:?}");
    ensure!(matches!(&replies[0], Reply::Error { message, .. } if message.contains("call 0 of the batch")));
    // Still serving.
    new_id(&mut c)?;
    Ok(())
}

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
}

/// Requests queued on a listener's channel behind bare wake-ups (the
/// first rides its own; the daemon keeps the rest, as for a server that
/// many clients connect to at once) come from the daemon in one call
/// (`CmRequest::GetEvents`), where each took a `GetEvent` round trip of
/// its own; the program still reads them one by one, in the order they
/// came, and the channel's descriptor is readable exactly while some wait.
#[test]
fn queued_events_come_in_one_call_in_order_while_the_descriptor_shows_them() -> Result<()> {
    const N: u8 = 6;
    let d = DaemonProc::start()?;
    let (client, server) = (d.context()?, d.context()?);
    let (server_ch, client_ch) = (EventChannel::create(&server)?, EventChannel::create(&client)?);
    let at = localhost(vrdma_it::free_port()?);
    let listener = CmId::create(&server_ch, PortSpace::Tcp)?;
    listener.bind(at)?;
    listener.listen(16)?;
    let pd = client.alloc_pd()?;
    let mut held = Vec::new();
    for i in 0..N {
        let id = CmId::create(&client_ch, PortSpace::Tcp)?;
        id.resolve_addr(None, at)?;
        expect(&client_ch, EventKind::AddrResolved)?;
        id.resolve_route()?;
        expect(&client_ch, EventKind::RouteResolved)?;
        let param = ConnParam { private_data: vec![i], ..ConnParam::default() };
        let made = id.create_qp_with_cq_and_connect(&pd, vrdma::QpType::Rc, 4, cap(1, 1), &param)?;
        held.push((id, made));
    }
    let before = server_ch.event_calls();
    for i in 0..N {
        ensure!(readable(server_ch.fd()), "the descriptor shows the requests still waiting ({i} read)");
        let req = expect(&server_ch, EventKind::ConnectRequest)?;
        let data = req.peer.map(|p| p.private_data);
        ensure!(data == Some(vec![i]), "request {i} read in its place: {data:?}");
    }
    ensure!(!readable(server_ch.fd()), "nothing waits: the descriptor is quiet");
    let calls = server_ch.event_calls() - before;
    ensure!(calls <= 2, "{calls} calls to the daemon for {N} requests read (one each before GetEvents)");
    Ok(())
}

/// A hook for [`context_through_proxy`] that, once armed, holds the first
/// request (or the reply to it) that `pick` chooses until released.
struct Gate {
    armed: Arc<AtomicBool>,
    held: mpsc::Receiver<()>,
    release: mpsc::Sender<()>,
}

impl Gate {
    /// A context of `d` whose calls pass the gate (`reply`: held after
    /// the daemon answered, else before it saw the request).
    fn context(
        d: &DaemonProc,
        reply: bool,
        pick: impl Fn(&Request) -> bool + Send + 'static,
    ) -> Result<(vrdma::Context, Gate)> {
        let armed = Arc::new(AtomicBool::new(false));
        let (held_tx, held) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let on = armed.clone();
        let ctx = context_through_proxy(&d.socket, move |seen| {
            let req = match (seen, reply) {
                (Seen::Request(req), false) | (Seen::Reply(req, _), true) => req,
                _ => return,
            };
            if pick(req) && on.swap(false, Ordering::SeqCst) {
                let _ = held_tx.send(());
                let _ = released.recv_timeout(WAIT);
            }
        })?;
        Ok((ctx, Gate { armed, held, release }))
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Waits until the gate holds its call.
    fn holding(&self) -> Result<()> {
        self.held.recv_timeout(WAIT).map_err(|_| anyhow::anyhow!("the gate never held its call"))
    }

    /// Lets the call go once the other threads had the time to reach
    /// where they wait (the connection's lock); if one is late, it finds
    /// the library's state the call left, and the test shows nothing.
    fn release_later(&self) {
        std::thread::sleep(Duration::from_millis(200));
        let _ = self.release.send(());
    }
}

fn is_get_events(req: &Request) -> bool {
    matches!(req, Request::Cm(CmRequest::GetEvents { .. }))
}

/// `n` ids of `ch` whose connects to a port no one listens on end in
/// REJECTED: the first rides its wake-up, the daemon keeps the others.
fn rejected_ids(ch: &EventChannel, n: usize) -> Result<Vec<CmId>> {
    let dead = localhost(vrdma_it::free_port()?);
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = CmId::create(ch, PortSpace::Tcp)?;
        id.resolve_addr(None, dead)?;
        expect(ch, EventKind::AddrResolved)?;
        id.resolve_route()?;
        expect(ch, EventKind::RouteResolved)?;
        ids.push(id);
    }
    for id in &ids {
        id.connect(&ConnParam::default())?;
    }
    Ok(ids)
}

/// An event a call's reply hands over (a resolve's ADDR_RESOLVED) while a
/// reader of the channel waits for the connection, to fetch the events
/// the daemon queued after it, is read before those: the reply's event is
/// kept before the connection serves the fetch, and the fetched ones go
/// behind it (found in review: kept after the connection's lock was let
/// go, it came after a later CONNECT_REQUEST).
#[test]
fn an_event_kept_from_a_reply_is_read_before_the_events_a_waiting_reader_fetches_after_it() -> Result<()> {
    let d = DaemonProc::start()?;
    let resolve = |r: &Request| match r {
        Request::Cm(CmRequest::ResolveAddr { .. }) => true,
        Request::Cm(CmRequest::Batch { ops }) => matches!(ops.first(), Some(CmBatchOp::ResolveAddr { .. })),
        _ => false,
    };
    let (server, gate) = Gate::context(&d, true, resolve)?;
    let ch = EventChannel::create(&server)?;
    let listener = CmId::create(&ch, PortSpace::Tcp)?;
    let at = listener.bind(localhost(0))?;
    listener.listen(4)?;
    // P's ADDR_RESOLVED rides its wake-up into the empty descriptor; A's,
    // behind it, comes in its resolve's reply.
    let p = CmId::create(&ch, PortSpace::Tcp)?;
    p.resolve_addr(None, localhost(7))?;
    let a = CmId::create(&ch, PortSpace::Tcp)?;
    gate.arm();
    std::thread::scope(|s| -> Result<()> {
        let resolving = s.spawn(|| a.resolve_addr(None, localhost(7)));
        gate.holding()?;
        let first = ch.try_get_event()?.ok_or_else(|| anyhow::anyhow!("P's event, carried"))?;
        ensure!((first.id, first.kind) == (p.id(), EventKind::AddrResolved), "{first:?}");
        // A request, queued behind A's event.
        let client = d.context()?;
        let client_ch = EventChannel::create(&client)?;
        let c = CmId::create(&client_ch, PortSpace::Tcp)?;
        c.resolve_addr(None, at)?;
        expect(&client_ch, EventKind::AddrResolved)?;
        c.resolve_route()?;
        expect(&client_ch, EventKind::RouteResolved)?;
        c.connect(&ConnParam::default())?;
        let reader = s.spawn(|| ch.try_get_event());
        gate.release_later();
        resolving.join().map_err(|_| anyhow::anyhow!("resolve panicked"))??;
        let read = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let read = read.map(|e| (e.id, e.kind));
        ensure!(read == Some((a.id(), EventKind::AddrResolved)), "A's event first, got {read:?}");
        expect(&ch, EventKind::ConnectRequest)?;
        ensure!(ch.try_get_event()?.is_none());
        ensure!(!readable(ch.fd()));
        Ok(())
    })
}

/// An event of an id destroyed while a fetch that took it is on its way
/// goes with the id, as one kept before does: never handed out later
/// (found in review).
#[test]
fn an_event_fetched_while_its_id_is_destroyed_goes_with_it() -> Result<()> {
    let d = DaemonProc::start()?;
    let (ctx, gate) = Gate::context(&d, true, is_get_events)?;
    let ch = EventChannel::create(&ctx)?;
    let mut ids = rejected_ids(&ch, 3)?;
    let x = ids.pop().expect("three");
    let first = expect(&ch, EventKind::Rejected)?;
    ensure!(first.id == ids[0].id(), "{first:?}");
    gate.arm();
    std::thread::scope(|s| -> Result<()> {
        let reader = s.spawn(|| ch.try_get_event());
        gate.holding()?;
        let destroying = s.spawn(move || drop(x));
        gate.release_later();
        let read = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let read = read.map(|e| (e.id, e.kind));
        ensure!(read == Some((ids[1].id(), EventKind::Rejected)), "the second id's, got {read:?}");
        destroying.join().map_err(|_| anyhow::anyhow!("destroy panicked"))?;
        Ok(())
    })?;
    let after = ch.get_event(Some(Duration::from_millis(50)))?;
    ensure!(after.is_none(), "the destroyed id's event was handed out: {after:?}");
    ensure!(!readable(ch.fd()), "its wake-up went with it");
    Ok(())
}

/// A carried event that came while a fetch was on its way (the reader
/// found the descriptor empty; the daemon then carried one request in its
/// wake-up and queued the next behind it) is read first: it is older
/// than every fetched one (3ecc662's rule, kept by `GetEvents`).
#[test]
fn a_carried_event_that_came_during_a_fetch_is_read_before_the_fetched_ones() -> Result<()> {
    let d = DaemonProc::start()?;
    let (server, gate) = Gate::context(&d, false, is_get_events)?;
    let ch = EventChannel::create(&server)?;
    let listener = CmId::create(&ch, PortSpace::Tcp)?;
    let at = listener.bind(localhost(0))?;
    listener.listen(4)?;
    let client = d.context()?;
    let client_ch = EventChannel::create(&client)?;
    gate.arm();
    std::thread::scope(|s| -> Result<()> {
        let reader = s.spawn(|| ch.try_get_event());
        gate.holding()?;
        let mut held = Vec::new();
        for i in 0..2u8 {
            let c = CmId::create(&client_ch, PortSpace::Tcp)?;
            c.resolve_addr(None, at)?;
            expect(&client_ch, EventKind::AddrResolved)?;
            c.resolve_route()?;
            expect(&client_ch, EventKind::RouteResolved)?;
            c.connect(&ConnParam { private_data: vec![i], ..ConnParam::default() })?;
            held.push(c);
        }
        gate.release_later();
        let read = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
        let data = |e: Option<CmEvent>| e.and_then(|e| e.peer).map(|p| p.private_data);
        ensure!(data(read.clone()) == Some(vec![0]), "the carried request first, got {read:?}");
        ensure!(data(Some(expect(&ch, EventKind::ConnectRequest)?)) == Some(vec![1]));
        ensure!(ch.try_get_event()?.is_none());
        ensure!(!readable(ch.fd()));
        Ok(())
    })
}

/// A `GetEvents` reply that cannot be right (more events than asked for,
/// more wake-ups than a channel holds, an empty entry before others, an
/// event whose fields are out of range, a reply of another shape) is an
/// error, with nothing of it kept; the channel is unusable from then on
/// (what the reply stood for is lost, and its wake-ups may stay in the
/// descriptor): every later read fails with `EPROTO` at once, rather than
/// find the descriptor readable and nothing to read for ever. Other
/// channels go on working.
#[test]
fn a_get_events_reply_that_cannot_be_right_is_an_error_and_breaks_the_channel() -> Result<()> {
    use vrdma_core::cm::ConnInfo as Conn;
    let d = DaemonProc::start()?;
    let forged: Arc<Mutex<Option<Reply>>> = Arc::default();
    let swap = forged.clone();
    let ctx = context_through_proxy(&d.socket, move |seen| {
        if let Seen::Reply(req, bytes) = seen {
            if is_get_events(req) {
                if let Some(r) = swap.lock().unwrap().take() {
                    *bytes = vrdma_core::proto::encode_reply(&r);
                }
            }
        }
    })?;
    let ev = |id: &CmId| CmEvent {
        ctx: vrdma_core::hca::ContextId(0),
        id: id.id(),
        kind: EventKind::Established,
        status: 0,
        listen_id: None,
        peer: None,
        qkey: 0,
        local: None,
        remote: None,
    };
    type Forge = fn(CmEvent) -> Reply;
    let bad: Vec<(&str, Forge)> = vec![
        ("too many", |ev| {
            Reply::Cm(CmReply::Events { events: vec![(Some(ev), 1); MAX_CM_EVENTS as usize + 1] })
        }),
        ("too many wake-ups", |ev| {
            Reply::Cm(CmReply::Events { events: vec![(Some(ev), MAX_CM_UNREAD + 1)] })
        }),
        ("an empty entry first", |ev| Reply::Cm(CmReply::Events { events: vec![(None, 1), (Some(ev), 1)] })),
        ("no wake-up", |ev| {
            Reply::Cm(CmReply::Events { events: vec![(Some(ev.clone()), 1), (Some(ev), 0)] })
        }),
        ("a status", |ev| {
            Reply::Cm(CmReply::Events { events: vec![(Some(CmEvent { status: 3, ..ev }), 1)] })
        }),
        ("a listener", |ev| {
            Reply::Cm(CmReply::Events { events: vec![(Some(CmEvent { listen_id: Some(1), ..ev }), 1)] })
        }),
        ("private data", |ev| {
            let peer = Some(Conn { private_data: vec![0; 300], ..Conn::default() });
            Reply::Cm(CmReply::Events { events: vec![(Some(CmEvent { peer, ..ev }), 1)] })
        }),
        // Another shape: kept unchecked, a count of wake-ups of u32::MAX
        // had the next read take ~4e9 of them.
        ("an Event", |ev| Reply::Cm(CmReply::Event { event: Some(ev), wakeups: 1 })),
        ("a huge Event", |_| Reply::Cm(CmReply::Event { event: None, wakeups: u32::MAX })),
    ];
    for (what, forge) in bad {
        let ch = EventChannel::create(&ctx)?;
        let id = CmId::create(&ch, PortSpace::Tcp)?;
        *forged.lock().unwrap() = Some(forge(ev(&id)));
        match ch.try_get_event() {
            Err(vrdma::Error::Protocol(_)) => {}
            other => bail!("{what}: a reply taken: {other:?}"),
        }
        ensure!(forged.lock().unwrap().is_none(), "{what}: the forged reply was read");
        for _ in 0..2 {
            match ch.try_get_event() {
                Err(e @ vrdma::Error::Protocol(_)) => ensure!(e.errno() == libc::EPROTO, "{what}: {e}"),
                other => bail!("{what}: the channel still read: {other:?}"),
            }
        }
        match ch.get_event(Some(Duration::from_millis(50))) {
            Err(vrdma::Error::Protocol(_)) => {}
            other => bail!("{what}: a blocking read on the broken channel: {other:?}"),
        }
        drop(id);
    }
    // Other channels still work.
    let ch = EventChannel::create(&ctx)?;
    let id = CmId::create(&ch, PortSpace::Tcp)?;
    id.resolve_addr(None, localhost(7))?;
    expect(&ch, EventKind::AddrResolved)?;
    Ok(())
}

/// A daemon that knows no `GetEvents` (an older one answers `EINVAL`)
/// is asked with `GetEvent` from then on, and the events come as before.
#[test]
fn an_older_daemons_einval_turns_get_events_into_get_event() -> Result<()> {
    let d = DaemonProc::start()?;
    let asked: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let log = asked.clone();
    let ctx = context_through_proxy(&d.socket, move |seen| match seen {
        Seen::Reply(Request::Cm(CmRequest::GetEvents { .. }), bytes) => {
            log.lock().unwrap().push("GetEvents");
            // (The daemon's answer was an empty list: nothing is lost.)
            let refused = Reply::Error { errno: libc::EINVAL, message: "unknown request".into() };
            *bytes = vrdma_core::proto::encode_reply(&refused);
        }
        Seen::Reply(Request::Cm(CmRequest::GetEvent { .. }), _) => log.lock().unwrap().push("GetEvent"),
        _ => {}
    })?;
    let ch = EventChannel::create(&ctx)?;
    ensure!(ch.try_get_event()?.is_none());
    ensure!(*asked.lock().unwrap() == ["GetEvents", "GetEvent"], "{:?}", asked.lock().unwrap());
    let ids = rejected_ids(&ch, 3)?;
    for id in &ids {
        ensure!(expect(&ch, EventKind::Rejected)?.id == id.id());
    }
    let asked = asked.lock().unwrap();
    ensure!(asked[2..].iter().all(|k| *k == "GetEvent") && asked.len() > 2, "{asked:?}");
    Ok(())
}
