//! Queue pairs between two daemons that play two hosts: every opcode over
//! the TCP transport, addressing by LID and by GID, faults.

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{WcOpcode, WcStatus};
use vrdma_it::{access_all, pattern, poll_n, poll_one, Side, TwoHosts, WAIT};

fn check(wc: &vrdma::WorkCompletion, wr_id: u64, opcode: WcOpcode) {
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, opcode), "{wc:?}");
}

/// A side on each host, connected.
fn pair(h: &TwoHosts, by_gid: bool) -> Result<(Side, Side)> {
    let a = Side::new(&h.a.context()?, 1 << 20)?;
    let b = Side::new(&h.b.context()?, 1 << 20)?;
    let (mut ea, mut eb) = (a.endpoint()?, b.endpoint()?);
    if by_gid {
        ea.lid = 0;
        eb.lid = 0;
    }
    a.qp.connect(&eb, access_all())?;
    b.qp.connect(&ea, access_all())?;
    Ok((a, b))
}

fn every_opcode(by_gid: bool) -> Result<()> {
    let h = TwoHosts::start(!by_gid)?;
    let (a, b) = pair(&h, by_gid)?;
    let big = pattern(300_000, 5);
    a.mr.write(0, &big)?;
    // Send (several chunks), write, write with immediate.
    b.qp.post_recv(&[wr::recv(10, &[b.mr.sge(0, 300_000)?])?])?;
    b.qp.post_recv(&[wr::recv(11, &[])?])?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 300_000)?])?.signaled()])?;
    a.qp.post_send(&[
        wr::rdma_write(2, &[a.mr.sge(0, 200_000)?], b.mr.addr() + 400_000, b.mr.rkey())?.signaled()
    ])?;
    a.qp.post_send(&[wr::rdma_write(3, &[a.mr.sge(0, 1000)?], b.mr.addr() + 700_000, b.mr.rkey())?
        .with_imm(77)
        .signaled()])?;
    let wcs = poll_n(&a.cq, 3, WAIT)?;
    check(&wcs[0], 1, WcOpcode::Send);
    check(&wcs[1], 2, WcOpcode::RdmaWrite);
    check(&wcs[2], 3, WcOpcode::RdmaWrite);
    let wcs = poll_n(&b.cq, 2, WAIT)?;
    check(&wcs[0], 10, WcOpcode::Recv);
    assert_eq!((wcs[0].byte_len, wcs[0].src_qp), (300_000, a.qp.qpn()));
    check(&wcs[1], 11, WcOpcode::RecvRdmaWithImm);
    assert_eq!(wcs[1].imm_data, 77);
    let mut got = vec![0; 300_000];
    b.mr.read(0, &mut got)?;
    assert!(got == big, "send data differs");
    let mut got = vec![0; 200_000];
    b.mr.read(400_000, &mut got)?;
    assert!(got == big[..200_000], "write data differs");

    // Read back and atomics.
    b.mr.write(800_000, &pattern(100_000, 9))?;
    b.mr.write_u64(960_000, 40)?;
    a.qp.post_send(&[
        wr::rdma_read(4, &[a.mr.sge(500_000, 100_000)?], b.mr.addr() + 800_000, b.mr.rkey())?.signaled()
    ])?;
    a.qp.post_send(&[
        wr::cmp_swap(5, a.mr.sge(900_000, 8)?, b.mr.addr() + 960_000, b.mr.rkey(), 40, 50).signaled()
    ])?;
    a.qp.post_send(&[
        wr::fetch_add(6, a.mr.sge(900_008, 8)?, b.mr.addr() + 960_000, b.mr.rkey(), 2).signaled()
    ])?;
    let wcs = poll_n(&a.cq, 3, WAIT)?;
    check(&wcs[0], 4, WcOpcode::RdmaRead);
    check(&wcs[1], 5, WcOpcode::CompSwap);
    check(&wcs[2], 6, WcOpcode::FetchAdd);
    let mut got = vec![0; 100_000];
    a.mr.read(500_000, &mut got)?;
    assert!(got == pattern(100_000, 9), "read data differs");
    assert_eq!((a.mr.read_u64(900_000)?, a.mr.read_u64(900_008)?, b.mr.read_u64(960_000)?), (40, 50, 52));

    // The path shows: the QP goes over a link; one between two QPs of
    // the same host goes through shared memory.
    let local = Side::new(&h.a.context()?, 4096)?;
    let local2 = Side::new(&h.a.context()?, 4096)?;
    vrdma_it::connect(&local, &local2)?;
    let st = a.ctx.stat()?;
    assert!(st.links.iter().any(|l| l.up && l.stats.frames_out > 0), "{st:?}");
    let path = |qpn: u32| st.qps.iter().find(|q| q.qpn == qpn).map(|q| q.path);
    assert!(matches!(path(a.qp.qpn()), Some(vrdma_core::hca::Path::Link(Some(_)))), "{st:?}");
    assert_eq!(path(local.qp.qpn()), Some(vrdma_core::hca::Path::SharedMemory), "{st:?}");
    Ok(())
}

#[test]
fn every_opcode_by_lid_over_configured_peers() -> Result<()> {
    every_opcode(false)
}

#[test]
fn every_opcode_by_gid_dialling_the_peer_on_demand() -> Result<()> {
    every_opcode(true)
}

#[test]
fn a_killed_peer_daemon_ends_in_retry_exc_err_and_a_restarted_one_serves_new_qps() -> Result<()> {
    let mut h = TwoHosts::start(true)?;
    let (a, b) = pair(&h, false)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
    let (addr, rkey) = (b.mr.addr(), b.mr.rkey());
    drop(b);
    h.b.restart()?;
    let start = std::time::Instant::now();
    a.qp.post_send(&[wr::rdma_write(2, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    a.qp.post_send(&[wr::rdma_write(3, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    let wcs = poll_n(&a.cq, 2, Duration::from_secs(20))?;
    assert_eq!((wcs[0].wr_id, wcs[0].status), (2, WcStatus::RetryExcErr), "{wcs:?}");
    assert_eq!((wcs[1].wr_id, wcs[1].status), (3, WcStatus::WrFlushErr), "{wcs:?}");
    // The QP's timeout (14: 67 ms) and retry count (7) allow about 0.5 s.
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    // New QPs connect to the restarted daemon.
    let a2 = Side::new(&h.a.context()?, 1 << 16)?;
    let b2 = Side::new(&h.b.context()?, 1 << 16)?;
    a2.qp.connect(&b2.endpoint()?, access_all())?;
    b2.qp.connect(&a2.endpoint()?, access_all())?;
    a2.mr.write(0, b"again")?;
    a2.qp.post_send(&[wr::rdma_write(9, &[a2.mr.sge(0, 5)?], b2.mr.addr(), b2.mr.rkey())?.signaled()])?;
    check(&poll_one(&a2.cq, WAIT)?, 9, WcOpcode::RdmaWrite);
    let mut got = [0u8; 5];
    b2.mr.read(0, &mut got)?;
    assert_eq!(&got, b"again");
    Ok(())
}
