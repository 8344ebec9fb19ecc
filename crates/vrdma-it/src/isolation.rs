//! The isolation checks between tenants (issue 18), shared by the host
//! tenants' tests (`tests/isolation.rs`) and the guests' (`tests/vm.rs`),
//! so that a guest is held to exactly what a host process is: the side
//! that tries is a context of the test process (a host context, or one in
//! guest mode on a VM's port), the victim a [`PeerProc`] (a host process,
//! or an emulated guest of another VM).

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{Mtu, WcStatus};

use crate::protocol::{Command, Hello, Said};
use crate::{access_all, connect, poll_for, poll_one, PeerProc, Side, WAIT};

/// The local ACK timeout of our QPs towards a peer on our own daemon (the
/// shared-memory path): 4.096 µs × 2^4 ≈ 65 µs.
pub const ONE_HOST: u8 = 4;
/// ... and towards a peer on another daemon: 2^13 ≈ 34 ms, so about 67 ms
/// with the one retry.
pub const ACROSS_HOSTS: u8 = 13;

/// Brings `s`'s QP to RTS towards `remote`: where the peer must not be
/// reached (`reach` false), with a short transport timeout (the exponent
/// `timeout`) and one retry, so that it fails fast; where it must, with
/// the library's default (2^14, 7 retries: about half a second), since
/// the control (a peer of our own uid) must not time out for a slow round
/// trip between two daemons on a loaded machine (67 ms is a thin margin).
pub fn connect_fast(s: &Side, remote: &vrdma::Endpoint, timeout: u8, reach: bool) -> Result<()> {
    let (timeout, retries) = if reach { (14, 7) } else { (timeout, 1) };
    s.qp.to_init(1, access_all())?;
    s.qp.to_rtr(remote, Mtu::Mtu4096, 12)?;
    s.qp.to_rts(s.qp.psn(), timeout, retries, 7)?;
    Ok(())
}

fn status(wc: vrdma::WorkCompletion) -> (u64, WcStatus) {
    (wc.wr_id, wc.status)
}

/// Tries every way to reach the peer's QP and region from fresh QPs of
/// context `ctx` that the peer's QP is connected back to: a send each way,
/// an RDMA write and an RDMA read. The peer may run on `ctx`'s daemon or
/// on another one (`timeout`: [`ONE_HOST`] or [`ACROSS_HOSTS`]). With
/// `reach` they all succeed (a control that the setup is right); without,
/// they all end in `RetryExcErr` (what a QP number with no QP behind it
/// gets) and nothing crosses: no byte of the peer's receive buffers or
/// region changes, and neither side gets a receive completion.
pub fn every_way_to_the_peer(
    ctx: &vrdma::Context,
    peer: &mut PeerProc,
    h: &Hello,
    reach: bool,
    timeout: u8,
) -> Result<()> {
    let expect = if reach { WcStatus::Success } else { WcStatus::RetryExcErr };
    // A fresh QP of ours, and the peer's QP connected to it.
    let fresh = |peer: &mut PeerProc| -> Result<Side> {
        let s = Side::new(ctx, 1 << 16)?;
        peer.call_ok(&Command::Reset)?;
        connect_fast(&s, &h.endpoint, timeout, reach)?;
        peer.call_ok(&Command::Connect { peer: s.endpoint()? })?;
        Ok(s)
    };
    peer.call_ok(&Command::Fill { offset: 0, data: vec![0; 64] })?;
    peer.call_ok(&Command::Fill { offset: 8192, data: vec![0x77; 64] })?;

    // Our send.
    let s = fresh(peer)?;
    peer.call_ok(&Command::PostRecv { count: 1, offset: 0, len: 4096 })?;
    s.mr.fill(0, 64, 0xaa)?;
    s.qp.post_send(&[wr::send(1, &[s.mr.sge(0, 64)?])?.signaled()])?;
    assert_eq!(status(poll_one(&s.cq, WAIT)?), (1, expect));
    let got = peer.poll(1, if reach { WAIT } else { Duration::from_millis(200) })?;
    assert_eq!(got.len(), reach as usize, "receives at the peer: {got:?}");
    assert_eq!(peer.read(0, 64)?, vec![if reach { 0xaa } else { 0 }; 64]);

    // Our RDMA write with the peer's own address and key.
    let s = fresh(peer)?;
    s.mr.fill(0, 64, 0xbb)?;
    s.qp.post_send(&[wr::rdma_write(2, &[s.mr.sge(0, 64)?], h.addr + 8192, h.rkey)?.signaled()])?;
    assert_eq!(status(poll_one(&s.cq, WAIT)?), (2, expect));
    assert_eq!(peer.read(8192, 64)?, vec![if reach { 0xbb } else { 0x77 }; 64]);

    // Our RDMA read of it.
    let s = fresh(peer)?;
    s.qp.post_send(&[wr::rdma_read(3, &[s.mr.sge(0, 64)?], h.addr + 8192, h.rkey)?.signaled()])?;
    assert_eq!(status(poll_one(&s.cq, WAIT)?), (3, expect));
    assert_eq!(s.mr.to_vec()[..64], [if reach { 0xbb } else { 0 }; 64]);
    // Our failures are ours: the peer's QP is still in RTS.
    assert!(matches!(peer.call(&Command::State)?, Said::State(3)));

    // The peer's send to us.
    let s = fresh(peer)?;
    s.qp.post_recv(&[wr::recv(9, &[s.mr.sge(0, 64)?])?])?;
    peer.call_ok(&Command::Fill { offset: 0, data: vec![0x99; 16] })?;
    peer.call_ok(&Command::Send { wr_id: 5, offset: 0, len: 16, imm: None })?;
    let got = peer.poll(1, WAIT)?;
    assert_eq!(got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(), [(5, expect.raw())]);
    let ours = poll_for(&s.cq, Duration::from_millis(if reach { 0 } else { 50 }))?;
    if reach {
        assert_eq!(ours.len(), 1);
    } else {
        assert!(ours.is_empty(), "a send from another tenant arrived: {ours:?}");
        assert_eq!(s.mr.to_vec()[..16], [0u8; 16]);
    }
    Ok(())
}

/// The peer's address and key, used through a connection of `ctx`'s own
/// tenant (two QPs of `ctx`): an RDMA write and an RDMA read with them end
/// in `RemAccessErr` (as an invalid key does) and the key as a local key
/// in `LocProtErr`; no byte of the peer's region changes and none of it
/// comes back.
pub fn another_tenants_key_is_refused(ctx: &vrdma::Context, peer: &mut PeerProc, h: &Hello) -> Result<()> {
    peer.call_ok(&Command::Fill { offset: 0, data: vec![0x44; 256] })?;
    let pair = || -> Result<(Side, Side)> {
        let (a, b) = (Side::new(ctx, 4096)?, Side::new(ctx, 4096)?);
        connect(&a, &b)?;
        Ok((a, b))
    };
    let (a, _b) = pair()?;
    a.mr.fill(0, 64, 0xcc)?;
    // Address and key of the other tenant's region, through our own QP pair.
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 64)?], h.addr, h.rkey)?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::RemAccessErr);
    assert_eq!(peer.read(0, 256)?, vec![0x44; 256], "our write reached the other tenant");

    let (a, _b) = pair()?;
    a.qp.post_send(&[wr::rdma_read(2, &[a.mr.sge(0, 64)?], h.addr, h.rkey)?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::RemAccessErr);
    assert_eq!(a.mr.to_vec()[..64], [0u8; 64], "we read the other tenant's memory");

    // The key as a local key is no better.
    let (a, b) = pair()?;
    let stolen = vrdma::Sge { addr: h.addr, length: 64, lkey: h.rkey };
    a.qp.post_send(&[wr::rdma_write(3, &[stolen], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::LocProtErr);
    assert_eq!(b.mr.to_vec()[..64], [0u8; 64]);
    drop(b);
    // The other tenant is unaffected.
    assert_eq!(peer.read(0, 256)?, vec![0x44; 256]);
    Ok(())
}
