//! UD queue pairs through real daemons: two contexts of the test process
//! play two processes of one tenant, each with a UD QP and an address
//! handle naming the other's host (by the port's LID, or by GID with a
//! GRH). Each test runs with both ends on one daemon and on two daemons
//! that play two hosts, where datagrams cross the TCP link.

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{
    AccessFlags, AddressHandle, AhAttr, Context, QpAttr, QpAttrMask, QpInit, QpState, QpType, WcFlags,
    WcOpcode, WcStatus, GRH_LEN,
};
use vrdma_it::{
    cap, in_both_topologies, pattern, poll_for, poll_n, poll_one, wait_state, wait_until, DaemonProc, Hosts,
    Topology, WAIT,
};

const QKEY: u32 = 0x1234_5678;
/// How long a test looks for a completion that must not come.
const QUIET: Duration = Duration::from_millis(200);
const GRH: usize = GRH_LEN;

/// One end: a PD, a 64 KiB region, one CQ for both queues, a UD QP in
/// RTS with `QKEY`, and an address handle naming the other end's host
/// (`peer`) by LID.
struct Ud {
    ctx: Context,
    pd: vrdma::ProtectionDomain,
    mr: vrdma::MemoryRegion,
    cq: vrdma::CompletionQueue,
    qp: vrdma::QueuePair,
    ah: AddressHandle,
}

fn lid_attr(ctx: &Context) -> Result<AhAttr> {
    Ok(AhAttr { dlid: ctx.query_port(1)?.lid, port_num: 1, ..AhAttr::default() })
}

fn ud(ctx: &Context, peer: &Context) -> Result<Ud> {
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(1 << 16, AccessFlags::LOCAL_WRITE)?;
    let cq = ctx.create_cq(256, None)?;
    let qp = pd.create_ud_qp(&cq, &cq, cap(64, 2), QKEY)?;
    let ah = pd.create_ah(&lid_attr(peer)?)?;
    Ok(Ud { ctx: ctx.clone(), pd, mr, cq, qp, ah })
}

/// Fields drop in order: the ends, then the daemons.
struct Two {
    a: Ud,
    b: Ud,
    h: Hosts,
}

/// An end on host a and one on host b (the same daemon on one host).
fn two(t: Topology) -> Result<Two> {
    let h = Hosts::start(t)?;
    let (ca, cb) = (h.a().context()?, h.b().context()?);
    let a = ud(&ca, &cb)?;
    let b = ud(&cb, &ca)?;
    Ok(Two { a, b, h })
}

impl Ud {
    /// Posts a receive of `len` bytes at `offset`, filled with 0xee first
    /// so that bytes the device leaves alone show.
    fn post_recv(&self, wr_id: u64, offset: usize, len: usize) -> Result<()> {
        self.mr.write(offset, &vec![0xee; len])?;
        self.qp.post_recv(&[wr::recv(wr_id, &[self.mr.sge(offset, len)?])?])?;
        Ok(())
    }

    /// A signalled datagram of `len` bytes at `offset` to `to`'s QP.
    fn send_to(&self, wr_id: u64, offset: usize, len: usize, to: &Ud, qkey: u32) -> Result<()> {
        let w = wr::ud_send(wr_id, &[self.mr.sge(offset, len)?], &self.ah, to.qp.qpn(), qkey)?.signaled();
        self.qp.post_send(&[w])?;
        Ok(())
    }

    fn expect_sent(&self, wr_id: u64) -> Result<()> {
        let wc = poll_one(&self.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, WcOpcode::Send), "{wc:?}");
        Ok(())
    }

    fn expect_nothing(&self) -> Result<()> {
        let got = poll_for(&self.cq, QUIET)?;
        assert!(got.is_empty(), "nothing should arrive: {got:?}");
        Ok(())
    }

    /// SQE -> RTS.
    fn recover(&self) -> Result<()> {
        self.qp.modify(&QpAttr { qp_state: QpState::Rts, ..QpAttr::default() }, QpAttrMask::STATE)?;
        assert_eq!(self.qp.state(), QpState::Rts);
        Ok(())
    }
}

fn send_with_and_without_immediate_lands_after_the_grh_area(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    let lid = a.ctx.query_port(1)?.lid;
    let msg = pattern(1000, 1);
    a.mr.write(0, &msg)?;

    b.post_recv(7, 0, GRH + 1000)?;
    a.send_to(1, 0, 1000, b, QKEY)?;
    a.expect_sent(1)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (7, WcStatus::Success, WcOpcode::Recv), "{wc:?}");
    assert_eq!(wc.byte_len as usize, GRH + 1000);
    assert_eq!((wc.qp_num, wc.src_qp, wc.slid, wc.pkey_index), (b.qp.qpn(), a.qp.qpn(), lid, 0));
    assert!(wc.wc_flags.is_empty(), "no GRH, no immediate: {wc:?}");
    // Without a GRH the first 40 bytes are left alone; the payload follows.
    assert_eq!(b.mr.to_vec()[..GRH], [0xee; GRH]);
    assert_eq!(b.mr.to_vec()[GRH..GRH + 1000], msg[..]);

    b.post_recv(8, 8192, 4096)?;
    let w = wr::ud_send(2, &[a.mr.sge(100, 33)?], &a.ah, b.qp.qpn(), QKEY)?.with_imm(0xdead_beef).signaled();
    a.qp.post_send(&[w])?;
    a.expect_sent(2)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize), (8, WcStatus::Success, GRH + 33), "{wc:?}");
    assert_eq!((wc.wc_flags, wc.imm_data), (WcFlags::WITH_IMM, 0xdead_beef));
    let got = b.mr.to_vec();
    assert_eq!(got[8192 + GRH..8192 + GRH + 33], msg[100..133]);
    assert_eq!(got[8192 + GRH + 33], 0xee, "nothing past the message");
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
    Ok(())
}

fn a_global_address_handle_delivers_a_grh(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    let (sgid, dgid) = (a.ctx.query_gid(1, 0)?, b.ctx.query_gid(1, 0)?);
    let attr = AhAttr {
        dgid,
        sgid_index: 0,
        hop_limit: 64,
        is_global: true,
        port_num: 1,
        sl: 1,
        ..Default::default()
    };
    let ah = a.pd.create_ah(&attr)?;
    a.mr.write(0, b"with a header")?;
    b.post_recv(1, 0, 256)?;
    a.qp.post_send(&[wr::ud_send(1, &[a.mr.sge(0, 13)?], &ah, b.qp.qpn(), QKEY)?.signaled()])?;
    a.expect_sent(1)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.status, wc.byte_len as usize, wc.sl), (WcStatus::Success, GRH + 13, 1), "{wc:?}");
    assert_eq!(wc.wc_flags, WcFlags::GRH);
    let buf = b.mr.to_vec();
    assert_eq!(buf[0] >> 4, 6, "IP version 6");
    assert_eq!((buf[6], buf[7]), (0x1b, 64), "next header, hop limit");
    assert_eq!(buf[8..24], sgid.0, "SGID");
    assert_eq!(buf[24..40], dgid.0, "DGID");
    assert_eq!(&buf[GRH..GRH + 13], b"with a header");
    Ok(())
}

fn a_qkey_mismatch_is_dropped_silently(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    a.mr.write(0, b"right key")?;
    b.post_recv(1, 0, 128)?;
    let dropped_before = dropped_in(&b.ctx)?;
    a.send_to(1, 0, 9, b, QKEY ^ 1)?;
    a.expect_sent(1)?;
    t.wait_dropped_by_b(dropped_before)?;
    b.expect_nothing()?;
    // The receive is still there for a datagram with the right Q_Key, or
    // with the high bit set (the sending QP's own Q_Key, the same here).
    a.send_to(2, 0, 9, b, 0x8000_0000)?;
    a.expect_sent(2)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.src_qp), (1, WcStatus::Success, a.qp.qpn()), "{wc:?}");
    assert_eq!(&b.mr.to_vec()[GRH..GRH + 9], b"right key");
    Ok(())
}

fn an_oversized_datagram_fails_locally_and_sqe_recovers_to_rts(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    assert_eq!(a.ctx.query_port(1)?.active_mtu.bytes(), 4096);
    b.post_recv(1, 0, GRH + 8192)?;
    a.send_to(1, 0, 4097, b, QKEY)?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::LocLenErr), "{wc:?}");
    wait_state(&a.qp, QpState::Sqe, WAIT)?;
    assert_eq!(a.qp.query()?.0.qp_state, QpState::Sqe);
    // In SQE a send can be posted; it is flushed.
    a.send_to(2, 0, 8, b, QKEY)?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr), "{wc:?}");
    b.expect_nothing()?;
    assert_eq!(b.qp.state(), QpState::Rts, "the receiver knows nothing of it");

    a.recover()?;
    let msg = pattern(4096, 3);
    a.mr.write(0, &msg)?;
    a.send_to(3, 0, 4096, b, QKEY)?;
    a.expect_sent(3)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len as usize), (1, WcStatus::Success, GRH + 4096), "{wc:?}");
    assert_eq!(b.mr.to_vec()[GRH..GRH + 4096], msg[..]);
    Ok(())
}

fn a_datagram_without_a_receive_is_dropped(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    let dropped_before = dropped_in(&b.ctx)?;
    a.mr.write(0, b"lost")?;
    a.send_to(1, 0, 4, b, QKEY)?;
    a.expect_sent(1)?;
    // Or the receive below could race the datagram across hosts.
    t.wait_dropped_by_b(dropped_before)?;
    // A receive posted afterwards does not get it: there is no RNR retry.
    b.post_recv(5, 0, 128)?;
    b.expect_nothing()?;
    a.mr.write(0, b"kept")?;
    a.send_to(2, 0, 4, b, QKEY)?;
    a.expect_sent(2)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success), "{wc:?}");
    assert_eq!(&b.mr.to_vec()[GRH..GRH + 4], b"kept");
    assert_eq!((a.qp.state(), b.qp.state()), (QpState::Rts, QpState::Rts));
    Ok(())
}

/// Frames the daemon of `ctx` received on its links and threw away.
fn dropped_in(ctx: &Context) -> Result<u64> {
    Ok(ctx.stat()?.links.iter().map(|l| l.stats.dropped_in).sum())
}

impl Two {
    /// Waits until b's daemon has thrown away a datagram since it counted
    /// `before`. A sender completes once its datagram has left, as on
    /// hardware, so across hosts the datagram may still be on its way; on
    /// one host the daemon drops it before the sender completes.
    fn wait_dropped_by_b(&self, before: u64) -> Result<()> {
        if matches!(self.h, Hosts::One(_)) {
            return Ok(());
        }
        wait_until(WAIT, "b's daemon to drop the datagram", || {
            dropped_in(&self.b.ctx).is_ok_and(|n| n > before)
        })
    }
}

fn an_address_handle_of_another_pd_is_an_error(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    // Of another PD of a's context, and of another context on a's daemon
    // (a handle of b's daemon would mean nothing to a's).
    let other_pd = a.ctx.alloc_pd()?;
    let other_ctx = t.h.a().context()?;
    let other_ctx_pd = other_ctx.alloc_pd()?;
    let foreign = [other_pd.create_ah(&lid_attr(&a.ctx)?)?, other_ctx_pd.create_ah(&lid_attr(&a.ctx)?)?];
    b.post_recv(1, 0, 128)?;
    for (i, ah) in foreign.iter().enumerate() {
        let w = wr::ud_send(i as u64, &[a.mr.sge(0, 8)?], ah, b.qp.qpn(), QKEY)?.signaled();
        a.qp.post_send(&[w])?;
        let wc = poll_one(&a.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status), (i as u64, WcStatus::LocQpOpErr), "{wc:?}");
        wait_state(&a.qp, QpState::Sqe, WAIT)?;
        a.recover()?;
    }
    b.expect_nothing()?;
    // A send with no address handle never leaves the library.
    let e = a.qp.post_send(&[wr::send(9, &[a.mr.sge(0, 8)?])?]).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::EINVAL));
    // Only sends run on a UD QP.
    let mut w = wr::rdma_write(10, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled();
    w.ud.ah = a.ah.handle();
    a.qp.post_send(&[w])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (10, WcStatus::LocQpOpErr), "{wc:?}");
    wait_state(&a.qp, QpState::Sqe, WAIT)?;
    Ok(())
}

fn a_receive_too_small_fails_only_the_receiver(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    b.post_recv(1, 0, GRH + 99)?;
    a.send_to(1, 0, 100, b, QKEY)?;
    a.expect_sent(1)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::LocLenErr), "{wc:?}");
    wait_state(&b.qp, QpState::Err, WAIT)?;
    assert_eq!(a.qp.state(), QpState::Rts);
    Ok(())
}

#[test]
fn address_handle_arguments_are_checked() -> Result<()> {
    let d = DaemonProc::start()?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let good = lid_attr(&ctx)?;
    let e = pd.create_ah(&AhAttr { port_num: 2, ..good }).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = pd.create_ah(&AhAttr { dlid: 0xc001, ..good }).unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "multicast: {e}");
    let ah = pd.create_ah(&good)?;
    assert_ne!(ah.handle(), 0);
    assert_eq!(ah.attr(), good);
    Ok(())
}

fn ud_ping_pong_with_a_qp_made_step_by_step(t: Topology) -> Result<()> {
    // As ibv_ud_pingpong does it: INIT with a Q_Key, RTR, RTS; a receive
    // posted before each send; many round trips.
    let t = two(t)?;
    let (a, b) = (&t.a, &t.b);
    let pd = &b.pd;
    let qp = pd.create_qp(&QpInit::ud(&b.cq, &b.cq, cap(16, 1)))?;
    assert_eq!(qp.qp_type(), QpType::Ud);
    qp.to_init_ud(1, QKEY)?;
    qp.to_rtr_ud()?;
    qp.to_rts_ud(qp.psn())?;
    let (attr, _) = qp.query()?;
    assert_eq!((attr.qp_state, attr.qkey), (QpState::Rts, QKEY));
    const ROUNDS: u64 = 200;
    for i in 0..ROUNDS {
        qp.post_recv(&[wr::recv(i, &[b.mr.sge(4096, 128)?])?])?;
        a.qp.post_recv(&[wr::recv(i, &[a.mr.sge(4096, 128)?])?])?;
        a.mr.write(0, &i.to_le_bytes())?;
        // Signaled, as ibv_ud_pingpong's are: a send slot is free again
        // only once a completion covering it is polled.
        a.qp.post_send(&[wr::ud_send(i, &[a.mr.sge(0, 8)?], &a.ah, qp.qpn(), QKEY)?.signaled()])?;
        let wc = poll_one(&b.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status, wc.src_qp), (i, WcStatus::Success, a.qp.qpn()), "{wc:?}");
        assert_eq!(b.mr.read_u64(4096 + GRH)?, i);
        b.mr.write(0, &(i + 1).to_le_bytes())?;
        qp.post_send(&[wr::ud_send(i, &[b.mr.sge(0, 8)?], &b.ah, a.qp.qpn(), QKEY)?.signaled()])?;
        let got = poll_n(&a.cq, 2, WAIT)?;
        let got: Vec<_> = got.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
        assert_eq!(got, [(i, WcStatus::Success, WcOpcode::Send), (i, WcStatus::Success, WcOpcode::Recv)]);
        assert_eq!(a.mr.read_u64(4096 + GRH)?, i + 1);
        let sent = poll_one(&b.cq, WAIT)?;
        assert_eq!((sent.wr_id, sent.status, sent.opcode), (i, WcStatus::Success, WcOpcode::Send));
    }
    Ok(())
}

in_both_topologies!(
    send_with_and_without_immediate_lands_after_the_grh_area,
    a_global_address_handle_delivers_a_grh,
    a_qkey_mismatch_is_dropped_silently,
    an_oversized_datagram_fails_locally_and_sqe_recovers_to_rts,
    a_datagram_without_a_receive_is_dropped,
    an_address_handle_of_another_pd_is_an_error,
    a_receive_too_small_fails_only_the_receiver,
    ud_ping_pong_with_a_qp_made_step_by_step,
);
