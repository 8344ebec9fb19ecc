//! Tenants are the kernel's uids (with `tenant_by = "uid+netns"`, also
//! network namespaces), and contexts own their objects: nothing of one
//! tenant is reachable from another, whatever keys or numbers the other
//! presents, on one host or across two. The cross-uid tests need root
//! (to run a peer as uid 65534), the namespace test root and iproute2;
//! without them they say so and pass vacuously.

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpAttr, QpAttrMask, QpState, WcStatus};
use vrdma_core::proto::{Reply, Request};
use vrdma_it::isolation::{another_tenants_key_is_refused, every_way_to_the_peer, ACROSS_HOSTS, ONE_HOST};
use vrdma_it::protocol::{Command, Hello, Said};
use vrdma_it::{access_all, le, poll_one, DaemonProc, PeerProc, RawConn, Side, TwoHosts, WAIT};

const NOBODY: u32 = 65534;

fn root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    vrdma_it::skip(format!("this test needs root (to run a tenant as uid {NOBODY})"));
    false
}

/// A daemon, a peer tenant running as `nobody`, its greeting.
fn with_nobody() -> Result<(DaemonProc, PeerProc, Hello)> {
    let d = DaemonProc::start()?;
    let peer = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(NOBODY))?;
    let h = peer.hello()?;
    Ok((d, peer, h))
}

#[test]
fn tenants_are_uids() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let (d, mut peer, h) = with_nobody()?;
    assert_eq!(d.context()?.tenant(), 0);
    assert_eq!(h.tenant, NOBODY);
    // The peer's process really is nobody's.
    let status = std::fs::read_to_string(format!("/proc/{}/status", h.pid))?;
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap_or_default().to_string();
    assert!(uid_line.split_whitespace().skip(1).all(|u| u == NOBODY.to_string()), "{uid_line}");
    peer.call_ok(&Command::Fill { offset: 0, data: vec![1, 2, 3] })?;
    assert_eq!(peer.read(0, 3)?, [1, 2, 3]);
    Ok(())
}

#[test]
fn a_connection_across_tenants_never_reaches_the_other_side() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let (d, mut peer, h) = with_nobody()?;
    every_way_to_the_peer(&d.context()?, &mut peer, &h, false, ONE_HOST)?;
    // Its own send failed, so its QP is in ERR now.
    assert!(matches!(peer.call(&Command::State)?, Said::State(6)));
    Ok(())
}

#[test]
fn the_same_attempts_within_one_tenant_succeed() -> Result<()> {
    // The control for the test above: a peer of our own uid.
    let d = DaemonProc::start()?;
    let mut peer = PeerProc::spawn(&d.socket, "tenant", &[])?;
    let h = peer.hello()?;
    every_way_to_the_peer(&d.context()?, &mut peer, &h, true, ONE_HOST)
}

/// The same across hosts, where the tenant travels in every frame and the
/// receiving daemon checks it: from QPs on host A, a peer of another uid
/// on host B is never reached, and its sends never reach us. A peer of
/// our own uid on B, before and after, is reached every way (the control:
/// the link works, so the failures are isolation's).
#[test]
fn across_hosts_another_tenant_is_never_reached() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let h = TwoHosts::start(true)?;
    let mut ours = PeerProc::spawn(&h.b.socket, "tenant", &[])?;
    let ho = ours.hello()?;
    let mut nobody = PeerProc::spawn_as(&h.b.socket, "tenant", &[], Some(NOBODY))?;
    let hn = nobody.hello()?;
    assert_eq!((ho.tenant, hn.tenant), (0, NOBODY));
    every_way_to_the_peer(&h.a.context()?, &mut ours, &ho, true, ACROSS_HOSTS)?;
    every_way_to_the_peer(&h.a.context()?, &mut nobody, &hn, false, ACROSS_HOSTS)?;
    // Its own send failed, so its QP is in ERR now.
    assert!(matches!(nobody.call(&Command::State)?, Said::State(6)));
    every_way_to_the_peer(&h.a.context()?, &mut ours, &ho, true, ACROSS_HOSTS)?;
    Ok(())
}

/// `vrdma stat`'s links to other hosts: a tenant sees its own frames and
/// bytes on each (and its own QPs there), never another tenant's; the
/// operator (root, or the daemon's uid) sees the totals over every
/// tenant. Two tenants on host A: one sends to its own QP on host B, the
/// other only looks.
#[test]
fn stat_shows_a_tenant_its_own_traffic_on_a_link_and_the_operator_the_totals() -> Result<()> {
    if !root() {
        return Ok(());
    }
    /// The tenant that only looks.
    const BYSTANDER: u32 = 65533;
    const LEN: usize = 100_000;
    const N: usize = 4;
    let h = TwoHosts::start(true)?;
    let mut sender = PeerProc::spawn_as(&h.a.socket, "tenant", &[], Some(NOBODY))?;
    let mut receiver = PeerProc::spawn_as(&h.b.socket, "tenant", &[], Some(NOBODY))?;
    let mut bystander = PeerProc::spawn_as(&h.a.socket, "tenant", &[], Some(BYSTANDER))?;
    let (hs, hr, hb) = (sender.hello()?, receiver.hello()?, bystander.hello()?);
    assert_eq!((hs.tenant, hb.tenant), (NOBODY, BYSTANDER));
    sender.call_ok(&Command::Connect { peer: hr.endpoint })?;
    receiver.call_ok(&Command::Connect { peer: hs.endpoint })?;
    receiver.call_ok(&Command::PostRecv { count: N, offset: 0, len: LEN })?;
    for i in 0..N {
        sender.call_ok(&Command::Send { wr_id: i as u64, offset: 0, len: LEN, imm: None })?;
    }
    let done = sender.poll(N, WAIT)?;
    assert_eq!(done.iter().filter(|w| w.status == WcStatus::Success.raw()).count(), N, "{done:?}");
    assert_eq!(receiver.poll(N, WAIT)?.len(), N);

    let stat = |p: &mut PeerProc| -> Result<vrdma_core::hca::StatReport> {
        match p.call(&Command::Stat)? {
            Said::Stat(s) => Ok(*s),
            other => bail!("peer answered {other:?} to Stat"),
        }
    };
    let out = |s: &vrdma_core::hca::StatReport| s.links.iter().map(|l| l.stats.payload_out).sum::<u64>();
    let (mine, theirs) = (stat(&mut sender)?, stat(&mut bystander)?);
    let total = h.a.context()?.stat()?;
    assert!(!theirs.links.is_empty(), "the link itself shows: {theirs:?}");
    // The bystander: the link (peer, state), none of the sender's traffic.
    for l in &theirs.links {
        let s = &l.stats;
        assert_eq!((s.frames_out, s.payload_out, s.frames_in, s.payload_in, l.qps), (0, 0, 0, 0, 0), "{l:?}");
    }
    assert_eq!(theirs.missed_wakeups, 0);
    // Which view each got (checked after the figures: the operator's view
    // given to a tenant fails above, on the sender's traffic).
    assert!(total.totals && !mine.totals && !theirs.totals);
    // The sender: its bytes, and its QP on the link.
    assert!(out(&mine) >= (N * LEN) as u64, "{mine:?}");
    assert_eq!(mine.links.iter().map(|l| l.qps).sum::<u32>(), 1, "{mine:?}");
    // The operator: the totals, at least the sender's.
    assert!(out(&total) >= out(&mine), "{total:?} {mine:?}");
    assert_eq!(
        total.links.iter().map(|l| (l.id, l.info, l.up)).collect::<Vec<_>>(),
        theirs.links.iter().map(|l| (l.id, l.info, l.up)).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn another_tenants_rkey_is_refused_on_a_same_tenant_connection() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let (d, mut peer, h) = with_nobody()?;
    another_tenants_key_is_refused(&d.context()?, &mut peer, &h)
}

/// Every request naming an object of another context is refused as if
/// the object did not exist, and the object is unharmed.
fn name_foreign_objects(conn: &mut RawConn, qpn: u32, key: u32) -> Result<()> {
    let rts_to_err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    for req in [
        Request::DestroyQp { qp: qpn },
        Request::ModifyQp { qp: qpn, attr: rts_to_err, mask: QpAttrMask::STATE },
        Request::QueryQp { qp: qpn },
        Request::DeregMr { key },
    ] {
        match conn.call(&req, &[])?.reply()? {
            Reply::Error { errno, message } => assert_eq!(errno, libc::EINVAL, "{req:?}: {message}"),
            other => bail!("{req:?} on another context's object answered {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn a_context_cannot_name_another_tenants_objects() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let (d, mut peer, h) = with_nobody()?;
    let mut conn = RawConn::connect(&d.socket)?;
    assert_eq!(conn.hello()?, 0);
    name_foreign_objects(&mut conn, h.endpoint.qpn, h.rkey)?;
    // The peer's QP and region are as they were.
    assert!(matches!(peer.call(&Command::State)?, Said::State(0)));
    peer.call_ok(&Command::Fill { offset: 0, data: le(42) })?;
    assert_eq!(peer.read(0, 8)?, le(42));
    peer.call_ok(&Command::Connect { peer: h.endpoint })?;
    assert!(matches!(peer.call(&Command::State)?, Said::State(3)));
    Ok(())
}

/// An rdma_cm id takes a QP of another context of its own process (the
/// drop-in librdmacm's way), never one of another process's, of its
/// tenant or another: the attach is refused as for a QP that does not
/// exist, and the QP is untouched.
fn an_rdma_cm_id_cannot_take_the_qp_of(d: &DaemonProc, peer: &mut PeerProc, h: &Hello) -> Result<()> {
    let ctx = d.context()?;
    let ch = vrdma::cm::EventChannel::create(&ctx)?;
    let id = vrdma::cm::CmId::create(&ch, vrdma::cm::PortSpace::Tcp)?;
    id.resolve_addr(None, "127.0.0.1:7503".parse().expect("an address"))?;
    let e = id.attach_qp_num(h.endpoint.qpn).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(matches!(peer.call(&Command::State)?, Said::State(0)), "the other process's QP moved");
    Ok(())
}

#[test]
fn an_rdma_cm_id_cannot_take_another_tenants_qp() -> Result<()> {
    if !root() {
        return Ok(());
    }
    let (d, mut peer, h) = with_nobody()?;
    an_rdma_cm_id_cannot_take_the_qp_of(&d, &mut peer, &h)
}

#[test]
fn an_rdma_cm_id_cannot_take_another_process_qp_of_the_same_tenant() -> Result<()> {
    let d = DaemonProc::start()?;
    let mut peer = PeerProc::spawn(&d.socket, "tenant", &[])?;
    let h = peer.hello()?;
    assert_eq!(h.tenant, d.context()?.tenant(), "one tenant");
    an_rdma_cm_id_cannot_take_the_qp_of(&d, &mut peer, &h)
}

#[test]
fn a_context_cannot_name_another_contexts_objects_of_the_same_tenant() -> Result<()> {
    // Needs no root: two contexts of this very process.
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let s = Side::new(&ctx, 4096)?;
    s.qp.connect(&s.endpoint()?, access_all())?;
    let mut conn = RawConn::connect(&d.socket)?;
    conn.hello()?;
    name_foreign_objects(&mut conn, s.qp.qpn(), s.mr.rkey())?;
    for req in [
        Request::DeallocPd { pd: s.pd.pd_id() },
        Request::DestroyCq { cq: s.cq.cqn() },
        Request::CreateQp { pd: s.pd.pd_id(), init: s.qp.init_attr() },
    ] {
        match conn.call(&req, &[])?.reply()? {
            Reply::Error { errno, message } => assert_eq!(errno, libc::EINVAL, "{req:?}: {message}"),
            other => bail!("{req:?} on another context's object answered {other:?}"),
        }
    }
    // Untouched: the QP still moves data through the region.
    assert_eq!(s.qp.state(), QpState::Rts);
    let w = wr::rdma_write(1, &[s.mr.sge(0, 8)?], s.mr.addr() + 8, s.mr.rkey())?.signaled();
    s.qp.post_send(&[w])?;
    assert_eq!(poll_one(&s.cq, WAIT)?.status, WcStatus::Success);
    // The raw connection's own objects are its own.
    let pd = match conn.call(&Request::AllocPd, &[])?.reply()? {
        Reply::Pd { pd } => pd,
        other => bail!("{other:?}"),
    };
    assert_ne!(pd, s.pd.pd_id());
    Ok(())
}

/// With `tenant_by = "uid+netns"` a process of our own uid in another
/// network namespace is another tenant, of this host only, and nothing
/// crosses between it and us; processes of one namespace share a tenant.
/// By default the namespace does not count.
#[test]
fn with_uid_and_netns_another_network_namespace_is_another_tenant() -> Result<()> {
    if let Some(why) = vrdma_it::netns_unavailable() {
        vrdma_it::skip(format!("needs root and iproute2 ({why})"));
        return Ok(());
    }
    let net = vrdma_it::Netns::create()?;
    let ns = &net.ns[0];
    let d = DaemonProc::start()?;
    let peer = PeerProc::spawn_in(&d.socket, "tenant", &[], ns)?;
    assert_eq!(peer.hello()?.tenant, 0, "by default a tenant is a uid, wherever it runs");
    drop((peer, d));

    let d = DaemonProc::start_with_config("tenant_by = \"uid+netns\"\n")?;
    let mut peer = PeerProc::spawn_in(&d.socket, "tenant", &[], ns)?;
    let h = peer.hello()?;
    assert_eq!(d.context()?.tenant(), 0, "in the daemon's namespace a tenant is still its uid");
    assert!(h.tenant >= vrdma_core::hca::TenantId::HOST_LOCAL_BASE, "tenant {:#x}", h.tenant);
    let other = PeerProc::spawn_in(&d.socket, "tenant", &[], ns)?;
    assert_eq!(other.hello()?.tenant, h.tenant, "one namespace, one uid: one tenant");
    every_way_to_the_peer(&d.context()?, &mut peer, &h, false, ONE_HOST)?;
    Ok(())
}
