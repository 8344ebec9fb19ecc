//! A guest's rdma_cm state moves with its VM (`docs/migration.md`,
//! "rdma_cm ids and event channels"): an emulated guest on A connects to
//! a host process on B through rdma_cm (its event channel and id in its
//! context, its QP attached, as rping does), moves A → C, and its
//! connection stays up: its messages keep reaching B, and B's disconnect
//! reaches the guest's channel once, on C, through the same descriptor.

use std::net::{Ipv4Addr, SocketAddrV4};

use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
use vrdma_it::protocol::{Command as C, Said};

use super::*;

const PORT: u16 = 7471;

/// Three hosts; an emulated guest of VM `t` on A, movable to C, with a
/// listener of a host process on B.
struct CmGuest {
    uid: u32,
    h: ThreeHosts,
    vm_a: vrdma::vm::VmAttachment,
    vm_c: vrdma::vm::VmAttachment,
    _dir: tempfile::TempDir,
    port_link: std::path::PathBuf,
    b_ch: EventChannel,
    _listener: CmId,
    b_ctx: vrdma::Context,
}

/// B's side of a connection: its id and its QP's side.
struct Accepted {
    id: CmId,
    side: Side,
}

fn ip(h: &ThreeHosts, i: usize) -> Result<Ipv4Addr> {
    Ok(h.ips[i].parse()?)
}

impl CmGuest {
    /// The hosts and B's listener, and the guest.
    fn start() -> Result<(CmGuest, PeerProc)> {
        CmGuest::start_with(&[])
    }

    /// As `start`, the guest started with `more` arguments too.
    fn start_with(more: &[&str]) -> Result<(CmGuest, PeerProc)> {
        let uid = rustix::process::geteuid().as_raw();
        let vm = format!("[vms.t]\ntenant = {uid}\nmemory_mib = 8\nports = 2\n");
        let h = ThreeHosts::start([&vm, "", &vm])?;
        let vm_a = vrdma::vm::attach_at(&h.a.socket, "t")?;
        let vm_c = vrdma::vm::attach_at(&h.c.socket, "t")?;
        let dir = tempfile::tempdir()?;
        let port_link = dir.path().join("port");
        std::os::unix::fs::symlink(&vm_a.port_socket, &port_link)?;
        let guest = PeerProc::spawn_movable_guest(
            &port_link,
            &[&vm_a.region, &vm_c.region],
            &[],
            "tenant",
            &[&["--mr-len", "65536"], more].concat(),
        )?;
        guest.hello()?;
        let b_ctx = h.b.context()?;
        let b_ch = EventChannel::create(&b_ctx)?;
        let listener = CmId::create(&b_ch, PortSpace::Tcp)?;
        listener.bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, PORT))?;
        listener.listen(8)?;
        Ok((CmGuest { uid, h, vm_a, vm_c, _dir: dir, port_link, b_ch, _listener: listener, b_ctx }, guest))
    }

    /// The guest connects to B through rdma_cm; B accepts with a QP of
    /// its own and `recvs` receives posted.
    fn connect(&self, guest: &mut PeerProc, recvs: u64) -> Result<Accepted> {
        let to = SocketAddrV4::new(ip(&self.h, 1)?, PORT);
        guest.send(&C::CmConnect { to })?;
        let req = expect(&self.b_ch, EventKind::ConnectRequest)?;
        let id = CmId::from_request(&self.b_ch, &req, PortSpace::Tcp)?;
        let side = Side::new(&self.b_ctx, 1 << 16)?;
        id.attach_qp(&side.qp)?;
        for i in 0..recvs {
            side.qp
                .post_recv(&[wr::recv(i, &[side.mr.sge(i as usize * 256, 256)?])?])
                .map_err(|e| e.error)?;
        }
        id.accept(&ConnParam { responder_resources: 1, initiator_depth: 1, ..ConnParam::default() })?;
        match guest.recv::<Said>(WAIT)? {
            Said::Ok => {}
            other => bail!("the guest's rdma_cm connect: {other:?}"),
        }
        expect(&self.b_ch, EventKind::Established)?;
        Ok(Accepted { id, side })
    }

    fn moves(&self) -> (Move<'_>, Move<'_>) {
        let a_to_c = Move {
            from: &self.h.a.socket,
            to: &self.h.c.socket,
            from_vm: &self.vm_a,
            to_vm: &self.vm_c,
            to_fd: 102,
            port_link: &self.port_link,
        };
        let c_to_a = Move {
            from: &self.h.c.socket,
            to: &self.h.a.socket,
            from_vm: &self.vm_c,
            to_vm: &self.vm_a,
            to_fd: 101,
            port_link: &self.port_link,
        };
        (a_to_c, c_to_a)
    }
}

/// `ch`'s next event, of `kind`.
fn expect(ch: &EventChannel, kind: EventKind) -> Result<vrdma::cm::CmEvent> {
    match ch.get_event(Some(WAIT))? {
        Some(e) if e.kind == kind => Ok(e),
        other => bail!("expected {kind:?}, got {other:?}"),
    }
}

/// The guest sends message `i` (64 bytes at `i * 256`), B receives it
/// with its bytes, and the guest's send completes.
fn message(guest: &mut PeerProc, b: &Side, i: u64) -> Result<()> {
    let data = pattern(64, i);
    guest.call_ok(&C::Fill { offset: i as usize * 256, data: data.clone() })?;
    guest.call_ok(&C::Send { wr_id: i, offset: i as usize * 256, len: 64, imm: None })?;
    let wc = poll_n(&b.cq, 1, WAIT)?;
    anyhow::ensure!((wc[0].wr_id, wc[0].status) == (i, WcStatus::Success), "B's receive {i}: {:?}", wc[0]);
    let mut got = vec![0u8; 64];
    b.mr.read(i as usize * 256, &mut got)?;
    anyhow::ensure!(got == data, "message {i}'s bytes");
    match guest.call(&C::Poll { count: 1, timeout_ms: WAIT.as_millis() as u64 })? {
        Said::Completions(w) if w.len() == 1 && w[0].wr_id == i && w[0].status == WcStatus::Success.raw() => {
            Ok(())
        }
        other => bail!("the guest's send {i}: {other:?}"),
    }
}

/// The guest's channel: exactly one event, `kind`, within `WAIT`, and
/// then neither a readable descriptor nor a second event.
fn once(guest: &mut PeerProc, kind: EventKind, what: &str) -> Result<()> {
    match guest.call(&C::CmEvent { timeout_ms: WAIT.as_millis() as u64 })? {
        Said::Cm(Some((k, 0))) if k == kind as u32 => {}
        other => bail!("{what}: expected {kind:?}, got {other:?}"),
    }
    match guest.call(&C::CmReadable { timeout_ms: 200 })? {
        Said::Readable(false) => {}
        other => bail!("{what}: the descriptor after its one event: {other:?}"),
    }
    match guest.call(&C::CmEvent { timeout_ms: 200 })? {
        Said::Cm(None) => Ok(()),
        other => bail!("{what}: a second event {other:?}"),
    }
}

/// The connection stays up across A → C: messages flow before and after
/// (the QP moved), B's disconnect after the move comes to the guest's
/// channel once, on C, and the descriptor is quiet between.
#[test]
fn a_guests_rdma_cm_connection_moves_with_it_and_hears_its_peers_disconnect_once() -> Result<()> {
    let (g, mut guest) = CmGuest::start()?;
    let b = g.connect(&mut guest, 8)?;
    message(&mut guest, &b.side, 0)?;
    let (a_to_c, _) = g.moves();
    a_to_c.run(&mut guest, g.uid)?;
    message(&mut guest, &b.side, 1)?;
    match guest.call(&C::CmReadable { timeout_ms: 200 })? {
        Said::Readable(false) => {}
        other => {
            // What made it readable, if anything: an event, none (a stray
            // wake-up), or the device gone.
            let behind = guest.call(&C::CmEvent { timeout_ms: 200 });
            bail!("the guest's rdma_cm descriptor after the move, before any event: {other:?}; behind it: {behind:?}")
        }
    }
    message(&mut guest, &b.side, 2)?;
    b.id.disconnect()?;
    expect(&g.b_ch, EventKind::Disconnected)?;
    once(&mut guest, EventKind::Disconnected, "B's disconnect after the move")?;
    Ok(())
}

/// A context holding two channels, its CQ's completion channel and its
/// rdma_cm event channel, is taken back on C: the adoption's reply
/// carries the context's segment, doorbell and event signal and a
/// doorbell per channel, five handles, and a guest took at most four (a
/// host's fds): it skipped the reply and never took its context back
/// (perftest's `-R`, two rdma_cm channels, failed so with a real guest).
#[test]
fn a_context_with_two_channels_is_taken_back_after_the_move() -> Result<()> {
    let (g, mut guest) = CmGuest::start_with(&["--channel"])?;
    let b = g.connect(&mut guest, 8)?;
    message(&mut guest, &b.side, 0)?;
    let (a_to_c, _) = g.moves();
    a_to_c.run(&mut guest, g.uid)?;
    message(&mut guest, &b.side, 1)?;
    b.id.disconnect()?;
    expect(&g.b_ch, EventKind::Disconnected)?;
    once(&mut guest, EventKind::Disconnected, "B's disconnect after the move")?;
    Ok(())
}

/// B disconnects while the guest's tenant is paused on A: the guest
/// hears DISCONNECTED once, after the move, on C; B once too.
#[test]
fn a_disconnect_while_the_guest_is_paused_reaches_it_once_after_the_move() -> Result<()> {
    let (g, mut guest) = CmGuest::start()?;
    let b = g.connect(&mut guest, 8)?;
    message(&mut guest, &b.side, 0)?;
    let (a_to_c, _) = g.moves();
    a_to_c.run_with(&mut guest, g.uid, || {
        b.id.disconnect()?;
        Ok(())
    })?;
    expect(&g.b_ch, EventKind::Disconnected)?;
    once(&mut guest, EventKind::Disconnected, "B's disconnect during the pause")?;
    match g.b_ch.get_event(Some(Duration::from_millis(300)))? {
        None => {}
        other => bail!("B heard more: {other:?}"),
    }
    Ok(())
}

/// A guest's listener on every address moves A → C and listens there: a
/// request from B to C's address reaches the guest's channel (and one to
/// A's is refused: no one listens there any more).
#[test]
fn a_guests_listener_on_every_address_listens_on_the_destination() -> Result<()> {
    let (g, mut guest) = CmGuest::start()?;
    guest.call_ok(&C::CmListen { at: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7480) })?;
    let (a_to_c, _) = g.moves();
    a_to_c.run(&mut guest, g.uid)?;
    // (A call: the guest takes its context back on C.)
    match guest.call(&C::Query)? {
        Said::State(_) => {}
        other => bail!("querying on C: {other:?}"),
    }
    let connect = |to: Ipv4Addr| -> Result<vrdma::cm::CmEvent> {
        let id = CmId::create(&g.b_ch, PortSpace::Tcp)?;
        id.resolve_addr(None, SocketAddrV4::new(to, 7480))?;
        expect(&g.b_ch, EventKind::AddrResolved)?;
        id.resolve_route()?;
        expect(&g.b_ch, EventKind::RouteResolved)?;
        id.connect(&ConnParam { qp_num: 0x77, ..ConnParam::default() })?;
        let ev = g.b_ch.get_event(Some(WAIT))?.context("no answer to B's request")?;
        drop(id);
        Ok(ev)
    };
    let ev = connect(ip(&g.h, 0)?)?;
    anyhow::ensure!(ev.kind == EventKind::Rejected, "a request to A's address: {ev:?}");
    let _pending = std::thread::scope(|s| {
        let to_c = s.spawn(|| connect(ip(&g.h, 2)?));
        let said = guest.call(&C::CmEvent { timeout_ms: WAIT.as_millis() as u64 });
        (to_c.join(), said)
    });
    match _pending.1? {
        Said::Cm(Some((k, 0))) if k == EventKind::ConnectRequest as u32 => Ok(()),
        other => bail!("the moved listener on C: {other:?}"),
    }
}
