//! Failures through a real daemon: each reported where verbs reports it
//! (a work completion, an async event, an errno), and the daemon keeps
//! serving. Two contexts of the test process play two processes of one
//! tenant.
//!
//! The tests of a connection run in both topologies (`name::one_host`,
//! `name::two_hosts`: the second context on another daemon across the TCP
//! transport). Those of one QP connected to itself, of the control path
//! and of one daemon's quotas stay on one host: a second host has no part
//! in them.

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{
    AccessFlags, AsyncEvent, AsyncEventType, Context, Mtu, QpAttr, QpAttrMask, QpInit, QpState, QpType,
    SrqAttr, WcOpcode, WcStatus,
};
use vrdma_it::{
    access_all, async_event, cap, connect, in_both_topologies, poll_for, poll_n, poll_one, wait_state,
    DaemonProc, Hosts, Side, Topology, WAIT,
};

/// A short look for something that must not come.
const QUIET: Duration = Duration::from_millis(50);

/// Two contexts of one tenant: `ca` on host a, `cb` on host b (the same
/// daemon on one host).
struct Two {
    ca: Context,
    cb: Context,
    d: Hosts,
}

fn two(t: Topology) -> Result<Two> {
    let d = Hosts::start(t)?;
    Ok(Two { ca: d.a().context()?, cb: d.b().context()?, d })
}

impl Two {
    /// A fresh connected pair: `a` in the first context, `b` in the second.
    fn pair(&self) -> Result<(Side, Side)> {
        let a = Side::new(&self.ca, 1 << 16)?;
        let b = Side::new(&self.cb, 1 << 16)?;
        connect(&a, &b)?;
        Ok((a, b))
    }

    /// As [`pair`](Self::pair), with QPs of `cap` and CQs of `cqe`.
    fn pair_for(&self, cap: vrdma::QpCap, cqe: u32) -> Result<(Side, Side)> {
        let a = Side::with(&self.ca, 4096, cqe, cap, None)?;
        let b = Side::with(&self.cb, 4096, cqe, cap, None)?;
        connect(&a, &b)?;
        Ok((a, b))
    }
}

fn status_of(wc: &vrdma::WorkCompletion) -> (u64, WcStatus) {
    (wc.wr_id, wc.status)
}

/// An rkey none of `keys` is.
fn bogus_key(keys: &[u32]) -> u32 {
    (1u32..).map(|i| keys[0].wrapping_add(i)).find(|k| *k != 0 && !keys.contains(k)).expect("a free key")
}

/// The requester's WR failed with `status`; both QPs are in ERR, and the
/// responder got `event`.
fn assert_remote_failure(a: &Side, b: &Side, status: WcStatus, event: AsyncEventType) -> Result<()> {
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!(wc.status, status, "{wc:?}");
    wait_state(&a.qp, QpState::Err, WAIT)?;
    let ev = async_event(&b.ctx, WAIT)?;
    assert_eq!(ev, AsyncEvent { event_type: event, element: b.qp.qpn() });
    wait_state(&b.qp, QpState::Err, WAIT)?;
    Ok(())
}

fn bad_rkey_is_a_remote_access_error_that_breaks_both_ends(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = t.pair()?;
    b.qp.post_recv(&[wr::recv(77, &[b.mr.sge(0, 64)?])?])?;
    a.mr.fill(0, 64, 0xab)?;
    let bad = bogus_key(&[a.mr.rkey(), b.mr.rkey()]);
    let sge = [a.mr.sge(0, 64)?];
    a.qp.post_send(&[
        wr::rdma_write(1, &sge, b.mr.addr(), bad)?.signaled(),
        wr::rdma_write(2, &sge, b.mr.addr(), b.mr.rkey())?.signaled(),
    ])?;
    let wcs = poll_n(&a.cq, 2, WAIT)?;
    assert_eq!(status_of(&wcs[0]), (1, WcStatus::RemAccessErr));
    assert_eq!(wcs[0].opcode, WcOpcode::RdmaWrite);
    assert_eq!(status_of(&wcs[1]), (2, WcStatus::WrFlushErr));
    wait_state(&a.qp, QpState::Err, WAIT)?;
    // Posting in ERR is allowed; the request is flushed.
    a.qp.post_send(&[wr::rdma_write(3, &sge, b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (3, WcStatus::WrFlushErr));

    // The responder: an access error event, ERR, its receive flushed.
    let ev = async_event(&b.ctx, WAIT)?;
    assert_eq!(ev, AsyncEvent { event_type: AsyncEventType::QpAccessErr, element: b.qp.qpn() });
    wait_state(&b.qp, QpState::Err, WAIT)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (77, WcStatus::WrFlushErr, WcOpcode::Recv));
    // Nothing was written, and the requester gets no async event.
    assert_eq!(b.mr.read_u64(0)?, 0);
    assert_eq!(a.ctx.get_async_event(Some(QUIET))?, None);
    assert_eq!(b.ctx.get_async_event(Some(QUIET))?, None);

    // Only this connection broke: a new one in the same contexts works.
    let (c, e) = t.pair()?;
    c.qp.post_send(&[wr::rdma_write(4, &[c.mr.sge(0, 8)?], e.mr.addr(), e.mr.rkey())?.signaled()])?;
    assert_eq!(status_of(&poll_one(&c.cq, WAIT)?), (4, WcStatus::Success));
    Ok(())
}

fn out_of_bounds_and_missing_access_are_remote_access_errors(t: Topology) -> Result<()> {
    let t = two(t)?;
    let rw_no_read = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let local_only = AccessFlags::LOCAL_WRITE;
    type Case<'a> = (&'a str, Box<dyn Fn(&Side, &Side) -> Result<vrdma::SendWr>>);
    let cases: Vec<Case> = vec![
        (
            "write past the end",
            Box::new(|a: &Side, b: &Side| {
                let end = b.mr.addr() + b.mr.len() as u64;
                Ok(wr::rdma_write(1, &[a.mr.sge(0, 8)?], end - 4, b.mr.rkey())?)
            }),
        ),
        (
            "read before the start",
            Box::new(|a: &Side, b: &Side| {
                Ok(wr::rdma_read(1, &[a.mr.sge(0, 16)?], b.mr.addr() - 8, b.mr.rkey())?)
            }),
        ),
        (
            "atomic past the end",
            Box::new(|a: &Side, b: &Side| {
                let end = b.mr.addr() + b.mr.len() as u64;
                Ok(wr::fetch_add(1, a.mr.sge(0, 8)?, end, b.mr.rkey(), 1))
            }),
        ),
    ];
    for (what, make) in &cases {
        let (a, b) = t.pair()?;
        a.qp.post_send(&[make(&a, &b)?.signaled()])?;
        assert_remote_failure(&a, &b, WcStatus::RemAccessErr, AsyncEventType::QpAccessErr)
            .map_err(|e| e.context(*what))?;
    }

    // The region lacks the access the operation needs.
    for (what, access, op) in [
        ("write to a local-only region", local_only, 0),
        ("read from a region without remote read", rw_no_read, 1),
        ("atomic on a region without remote atomic", rw_no_read, 2),
    ] {
        let (a, b) = t.pair()?;
        let m = b.pd.alloc_mr(4096, access)?;
        let w = match op {
            0 => wr::rdma_write(1, &[a.mr.sge(0, 8)?], m.addr(), m.rkey())?,
            1 => wr::rdma_read(1, &[a.mr.sge(0, 8)?], m.addr(), m.rkey())?,
            _ => wr::cmp_swap(1, a.mr.sge(0, 8)?, m.addr(), m.rkey(), 0, 1),
        };
        a.qp.post_send(&[w.signaled()])?;
        assert_remote_failure(&a, &b, WcStatus::RemAccessErr, AsyncEventType::QpAccessErr)
            .map_err(|e| e.context(what))?;
        assert_eq!(m.read_u64(0)?, 0, "{what}: the region changed");
    }

    // The responder QP does not grant the access (the region would).
    let a = Side::new(&t.ca, 4096)?;
    let b = Side::new(&t.cb, 4096)?;
    a.qp.connect(&b.endpoint()?, access_all())?;
    b.qp.connect(&a.endpoint()?, AccessFlags::REMOTE_WRITE)?;
    a.qp.post_send(&[wr::rdma_read(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_remote_failure(&a, &b, WcStatus::RemAccessErr, AsyncEventType::QpAccessErr)?;
    Ok(())
}

fn bad_local_keys_are_local_protection_errors(t: Topology) -> Result<()> {
    let t = two(t)?;
    for case in 0..4 {
        let (a, b) = t.pair()?;
        let other_pd = a.ctx.alloc_pd()?;
        let foreign = other_pd.alloc_mr(4096, access_all())?;
        let no_local_write = a.pd.alloc_mr(4096, AccessFlags::REMOTE_READ)?;
        let target = (b.mr.addr(), b.mr.rkey());
        let w = match case {
            // An lkey that names nothing.
            0 => {
                let mut s = a.mr.sge(0, 8)?;
                s.lkey = bogus_key(&[a.mr.lkey(), b.mr.lkey(), foreign.lkey(), no_local_write.lkey()]);
                wr::rdma_write(1, &[s], target.0, target.1)?
            }
            // Past the end of the local region.
            1 => {
                let mut s = a.mr.sge(0, 8)?;
                s.addr = a.mr.addr() + a.mr.len() as u64 - 4;
                wr::rdma_write(1, &[s], target.0, target.1)?
            }
            // A region of another PD.
            2 => wr::rdma_write(1, &[foreign.sge(0, 8)?], target.0, target.1)?,
            // A read into a region without local write.
            _ => wr::rdma_read(1, &[no_local_write.sge(0, 8)?], target.0, target.1)?,
        };
        a.qp.post_send(&[w.signaled()])?;
        let wc = poll_one(&a.cq, WAIT)?;
        assert_eq!(status_of(&wc), (1, WcStatus::LocProtErr), "case {case}");
        wait_state(&a.qp, QpState::Err, WAIT)?;
        // A local error is the requester's alone.
        assert_eq!(b.qp.state(), QpState::Rts, "case {case}");
        assert_eq!(b.ctx.get_async_event(Some(QUIET))?, None, "case {case}");
    }
    Ok(())
}

fn receive_too_small_fails_both_ends(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = t.pair()?;
    b.qp.post_recv(&[wr::recv(5, &[b.mr.sge(0, 16)?])?])?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 100)?])?.signaled()])?;
    assert_remote_failure(&a, &b, WcStatus::RemInvReqErr, AsyncEventType::QpReqErr)?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (5, WcStatus::LocLenErr, WcOpcode::Recv));
    Ok(())
}

fn misused_atomics_fail_where_verbs_says(t: Topology) -> Result<()> {
    let t = two(t)?;
    // An unaligned target: the responder refuses the request.
    let (a, b) = t.pair()?;
    a.qp.post_send(&[wr::fetch_add(1, a.mr.sge(0, 8)?, b.mr.addr() + 4, b.mr.rkey(), 1).signaled()])?;
    assert_remote_failure(&a, &b, WcStatus::RemInvReqErr, AsyncEventType::QpReqErr)?;
    assert_eq!(b.mr.read_u64(0)?, 0);
    assert_eq!(b.mr.read_u64(8)?, 0);
    // A result buffer shorter than the 8-byte word: the requester's own
    // length error.
    let (a, b) = t.pair()?;
    a.qp.post_send(&[wr::cmp_swap(2, a.mr.sge(0, 4)?, b.mr.addr(), b.mr.rkey(), 0, 1).signaled()])?;
    assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (2, WcStatus::LocLenErr));
    wait_state(&a.qp, QpState::Err, WAIT)?;
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(b.mr.read_u64(0)?, 0, "the word changed");
    Ok(())
}

/// A pair brought up by hand with small RNR timers and `rnr_retry`.
fn rnr_pair(t: &Two, rnr_retry: u8) -> Result<(Side, Side)> {
    let a = Side::new(&t.ca, 4096)?;
    let b = Side::new(&t.cb, 4096)?;
    for (x, y) in [(&a, &b), (&b, &a)] {
        x.qp.to_init(1, access_all())?;
        x.qp.to_rtr(&y.endpoint()?, Mtu::Mtu4096, 1)?;
        x.qp.to_rts(x.qp.psn(), 14, 7, rnr_retry)?;
    }
    Ok((a, b))
}

fn missing_receive_exhausts_rnr_retries(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = rnr_pair(&t, 1)?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!(status_of(&wc), (1, WcStatus::RnrRetryExcErr));
    wait_state(&a.qp, QpState::Err, WAIT)?;
    // The responder did nothing wrong.
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(b.ctx.get_async_event(Some(QUIET))?, None);
    Ok(())
}

fn infinite_rnr_retry_waits_for_a_receive(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = rnr_pair(&t, 7)?;
    a.mr.write(0, b"late but whole")?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 14)?])?.signaled()])?;
    // No receive yet: the send cannot complete, however often it retries.
    assert!(poll_for(&a.cq, Duration::from_millis(100))?.is_empty());
    assert_eq!(a.qp.state(), QpState::Rts);
    b.qp.post_recv(&[wr::recv(9, &[b.mr.sge(100, 64)?])?])?;
    assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (1, WcStatus::Success));
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.byte_len), (9, WcStatus::Success, 14));
    let mut got = [0u8; 14];
    b.mr.read(100, &mut got)?;
    assert_eq!(&got, b"late but whole");
    Ok(())
}

fn posting_before_rts_is_einval_and_harmless(t: Topology) -> Result<()> {
    let mut t = two(t)?;
    let a = Side::new(&t.ca, 4096)?;
    let b = Side::new(&t.cb, 4096)?;
    let w = || -> Result<vrdma::SendWr> {
        Ok(wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled())
    };
    let recv = wr::recv(1, &[a.mr.sge(0, 8)?])?;
    assert_eq!(a.qp.state(), QpState::Reset);
    let e = a.qp.post_send(&[w()?]).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::EINVAL));
    assert_eq!(a.qp.post_recv(&[recv]).unwrap_err().errno(), libc::EINVAL);
    a.qp.to_init(1, access_all())?;
    assert_eq!(a.qp.post_send(&[w()?]).unwrap_err().errno(), libc::EINVAL);
    b.qp.connect(&a.endpoint()?, access_all())?;
    a.qp.to_rtr(&b.endpoint()?, Mtu::Mtu4096, 12)?;
    assert_eq!(a.qp.state(), QpState::Rtr);
    assert_eq!(a.qp.post_send(&[w()?]).unwrap_err().errno(), libc::EINVAL);
    assert!(t.d.alive());
    // Nothing refused was queued: once in RTS only the new request runs.
    a.qp.to_rts(a.qp.psn(), 14, 7, 7)?;
    a.mr.write(0, b"12345678")?;
    let mut w2 = w()?;
    w2.wr_id = 2;
    a.qp.post_send(&[w2])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!(status_of(&wc), (2, WcStatus::Success));
    assert!(poll_for(&a.cq, QUIET)?.is_empty());
    assert_eq!(b.mr.read_u64(0)?, u64::from_le_bytes(*b"12345678"));
    assert!(t.d.alive());
    Ok(())
}

#[test]
fn full_send_queue_is_enomem() -> Result<()> {
    let t = two(Topology::OneHost)?;
    let a = Side::with(&t.ca, 4096, 64, cap(8, 1), None)?;
    let n = a.qp.cap().max_send_wr as usize;
    assert_eq!(n, 8);
    let me = a.endpoint()?;
    a.qp.connect(&me, access_all())?;
    // In SQD the device takes nothing from the send queue, so it fills.
    let sqd = QpAttr { qp_state: QpState::Sqd, ..QpAttr::default() };
    a.qp.modify(&sqd, QpAttrMask::STATE)?;
    assert_eq!(a.qp.state(), QpState::Sqd);
    let wrs: Vec<_> = (0..n as u64 + 1)
        .map(|i| {
            Ok(wr::rdma_write(i, &[a.mr.sge(8 * i as usize, 8)?], a.mr.addr() + 2048, a.mr.rkey())?
                .signaled())
        })
        .collect::<Result<_>>()?;
    let e = a.qp.post_send(&wrs).unwrap_err();
    assert_eq!((e.index, e.errno()), (n, libc::ENOMEM));
    let e = a.qp.post_send(&wrs[n..]).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::ENOMEM));
    // Back to RTS: exactly the accepted requests run, in order.
    let rts = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
    a.qp.modify(&rts, QpAttrMask::STATE)?;
    let ids: Vec<(u64, WcStatus)> = poll_n(&a.cq, n, WAIT)?.iter().map(status_of).collect();
    let want: Vec<(u64, WcStatus)> = (0..n as u64).map(|i| (i, WcStatus::Success)).collect();
    assert_eq!(ids, want);
    assert!(poll_for(&a.cq, QUIET)?.is_empty());
    // And the queue has room again.
    a.qp.post_send(&wrs[n..])?;
    assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (n as u64, WcStatus::Success));
    Ok(())
}

/// A pair of QPs with `max_send_wr` 8 and infinite RNR retries: a send
/// from `a` waits in RNR until `b` posts a receive.
fn small_rnr_pair(t: &Two) -> Result<(Side, Side)> {
    let a = Side::with(&t.ca, 4096, 64, cap(8, 1), None)?;
    let b = Side::with(&t.cb, 4096, 64, cap(8, 1), None)?;
    for (x, y) in [(&a, &b), (&b, &a)] {
        x.qp.to_init(1, access_all())?;
        x.qp.to_rtr(&y.endpoint()?, Mtu::Mtu4096, 1)?;
        x.qp.to_rts(x.qp.psn(), 14, 7, 7)?;
    }
    assert_eq!(a.qp.cap().max_send_wr, 8);
    Ok((a, b))
}

/// Sends `ids`, the odd ones and the last signaled.
fn sends(a: &Side, ids: std::ops::Range<u64>) -> Result<Vec<vrdma::SendWr>> {
    let last = ids.end - 1;
    ids.map(|i| {
        let w = wr::send(i, &[a.mr.sge(8 * (i % 64) as usize, 8)?])?;
        Ok(if i % 2 == 1 || i == last { w.signaled() } else { w })
    })
    .collect()
}

/// Posting fails with ENOMEM for a while.
fn assert_full(a: &Side, w: &vrdma::SendWr) {
    let end = std::time::Instant::now() + QUIET;
    while std::time::Instant::now() < end {
        let e = a.qp.post_send(std::slice::from_ref(w)).unwrap_err();
        assert_eq!((e.index, e.errno()), (0, libc::ENOMEM));
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn a_wr_the_device_holds_counts_against_the_send_queue(t: Topology) -> Result<()> {
    // The first send waits in RNR: the engine took it out of the ring but
    // is not done with it, so the QP has 8 outstanding and a ninth is
    // refused, as hardware refuses it, however long we wait.
    let mut t = two(t)?;
    let (a, b) = small_rnr_pair(&t)?;
    let n = 8u64;
    a.qp.post_send(&sends(&a, 0..n)?)?;
    std::thread::sleep(QUIET);
    assert!(poll_for(&a.cq, QUIET)?.is_empty(), "blocked in RNR");
    let extra = sends(&a, n..n + 1)?;
    assert_full(&a, &extra[0]);
    let e = a.qp.post_send(&sends(&a, n..n + 3)?).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::ENOMEM));

    // The blocker clears: everything completes, in order.
    let recvs: Vec<_> = (0..n).map(|i| wr::recv(100 + i, &[b.mr.sge(0, 64)?])).collect::<Result<_, _>>()?;
    b.qp.post_recv(&recvs)?;
    let signaled = (0..n).filter(|i| i % 2 == 1 || *i == n - 1).count();
    let got: Vec<(u64, WcStatus)> = poll_n(&a.cq, signaled, WAIT)?.iter().map(status_of).collect();
    let want: Vec<(u64, WcStatus)> = [1, 3, 5, 7].iter().map(|&i| (i, WcStatus::Success)).collect();
    assert_eq!(got, want);
    assert_eq!(poll_n(&b.cq, n as usize, WAIT)?.len(), n as usize);
    // Once the last completion is polled, every WR before it, signaled or
    // not, is retired: a whole queue of new WRs is accepted at once.
    b.qp.post_recv(&recvs)?;
    a.qp.post_send(&sends(&a, n..2 * n)?)?;
    assert_eq!(poll_n(&a.cq, signaled, WAIT)?.last().map(status_of), Some((2 * n - 1, WcStatus::Success)));
    assert_eq!(poll_n(&b.cq, n as usize, WAIT)?.len(), n as usize);
    assert!(t.d.alive());
    Ok(())
}

fn flush_and_reset_empty_a_full_send_queue(t: Topology) -> Result<()> {
    let mut t = two(t)?;
    let (a, b) = small_rnr_pair(&t)?;
    let n = 8u64;
    // Full, the head held in RNR; ERR flushes it all and frees the queue.
    a.qp.post_send(&sends(&a, 0..n)?)?;
    std::thread::sleep(QUIET);
    assert_full(&a, &sends(&a, n..n + 1)?[0]);
    a.qp.modify(&QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)?;
    let got = poll_n(&a.cq, n as usize, WAIT)?;
    assert!(got.iter().all(|w| w.status == WcStatus::WrFlushErr), "{got:?}");
    // Posting in ERR: the requests are flushed, a whole queue at once.
    a.qp.post_send(&sends(&a, n..2 * n)?)?;
    assert_eq!(poll_n(&a.cq, n as usize, WAIT)?.len(), n as usize);

    // Back through RESET, full again with the head in RNR, then RESET:
    // what the device held and what was queued are dropped, and the
    // queue is empty.
    let reconnect = |a: &Side| -> Result<()> {
        a.qp.modify(&QpAttr { qp_state: QpState::Reset, ..QpAttr::default() }, QpAttrMask::STATE)?;
        a.qp.to_init(1, access_all())?;
        a.qp.to_rtr(&b.endpoint()?, Mtu::Mtu4096, 1)?;
        a.qp.to_rts(a.qp.psn(), 14, 7, 7)?;
        Ok(())
    };
    reconnect(&a)?;
    a.qp.post_send(&sends(&a, 0..n)?)?;
    std::thread::sleep(QUIET);
    assert_full(&a, &sends(&a, n..n + 1)?[0]);
    reconnect(&a)?;
    assert!(poll_for(&a.cq, QUIET)?.is_empty(), "a reset completes nothing");
    let recvs: Vec<_> = (0..n).map(|i| wr::recv(100 + i, &[b.mr.sge(0, 64)?])).collect::<Result<_, _>>()?;
    b.qp.post_recv(&recvs)?;
    a.qp.post_send(&sends(&a, n..2 * n)?)?;
    let last = poll_n(&a.cq, 4, WAIT)?.last().map(status_of);
    assert_eq!(last, Some((2 * n - 1, WcStatus::Success)));
    let e = a.qp.post_send(&sends(&a, 0..n + 1)?).unwrap_err();
    assert_eq!(e.index as u64, n, "room for exactly max_send_wr");
    assert!(t.d.alive());
    Ok(())
}

#[test]
fn modify_with_a_wrong_mask_is_einval() -> Result<()> {
    let t = two(Topology::OneHost)?;
    let a = Side::new(&t.ca, 4096)?;
    let init =
        QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: access_all(), ..QpAttr::default() };
    let base = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
    // A required attribute missing.
    let e = a.qp.modify(&init, base).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("ACCESS"), "{e}");
    // An attribute the transition does not take.
    let e = a.qp.modify(&init, base | QpAttrMask::ACCESS_FLAGS | QpAttrMask::TIMEOUT).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // A transition that skips states.
    let rts = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
    assert_eq!(a.qp.modify(&rts, QpAttrMask::STATE).unwrap_err().errno(), libc::EINVAL);
    // Nothing changed, and the right mask still works.
    assert_eq!(a.qp.state(), QpState::Reset);
    assert_eq!(a.qp.query()?.0.qp_state, QpState::Reset);
    a.qp.modify(&init, base | QpAttrMask::ACCESS_FLAGS)?;
    assert_eq!(a.qp.state(), QpState::Init);
    Ok(())
}

#[test]
fn uc_qps_are_not_supported_but_ud_qps_are() -> Result<()> {
    let t = two(Topology::OneHost)?;
    let pd = t.ca.alloc_pd()?;
    let cq = t.ca.create_cq(16, None)?;
    let init = QpInit { qp_type: QpType::Uc, ..QpInit::rc(&cq, &cq, cap(16, 1)) };
    let e = pd.create_qp(&init).unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
    assert!(e.to_string().contains("UC"), "{e}");
    // The refusal left nothing behind that holds the CQ.
    let qp = pd.create_rc_qp(&cq, &cq, cap(16, 1))?;
    drop(qp);
    let ud = pd.create_qp(&QpInit { qp_type: QpType::Ud, ..QpInit::rc(&cq, &cq, cap(16, 1)) })?;
    assert_eq!(ud.qp_type(), QpType::Ud);
    Ok(())
}

fn deregistered_rkey_is_a_remote_access_error(t: Topology) -> Result<()> {
    let t = two(t)?;
    let (a, b) = t.pair()?;
    let m = b.pd.alloc_mr(4096, access_all())?;
    let (addr, rkey) = (m.addr(), m.rkey());
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (1, WcStatus::Success));
    drop(m);
    a.qp.post_send(&[wr::rdma_write(2, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    assert_remote_failure(&a, &b, WcStatus::RemAccessErr, AsyncEventType::QpAccessErr)?;
    Ok(())
}

fn srq_limit_event_arrives_on_the_async_fd(t: Topology) -> Result<()> {
    let t = two(t)?;
    let a = Side::new(&t.ca, 4096)?;
    let b = Side::new(&t.cb, 4096)?;
    let srq = b.pd.create_srq(SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 })?;
    let qp = b.pd.create_qp(&QpInit::rc(&b.cq, &b.cq, cap(16, 1)).with_srq(&srq))?;
    a.qp.connect(&qp.endpoint(&b.ctx)?, access_all())?;
    qp.connect(&a.endpoint()?, access_all())?;
    let recvs: Vec<_> =
        (0..8).map(|i| wr::recv(i, &[b.mr.sge(64 * i as usize, 64)?])).collect::<Result<_, _>>()?;
    srq.post_recv(&recvs)?;
    srq.set_limit(4)?;
    assert_eq!(srq.query()?.srq_limit, 4);
    let send = |id: u64| -> Result<()> {
        a.qp.post_send(&[wr::send(id, &[a.mr.sge(0, 8)?])?.signaled()])?;
        assert_eq!(status_of(&poll_one(&a.cq, WAIT)?), (id, WcStatus::Success));
        assert_eq!(poll_one(&b.cq, WAIT)?.status, WcStatus::Success);
        Ok(())
    };
    // Four taken, four left: not below the limit yet.
    for i in 0..4 {
        send(i)?;
    }
    assert_eq!(b.ctx.get_async_event(Some(QUIET))?, None);
    send(4)?;
    let fd = b.ctx.async_event_fd();
    let mut pfd = libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&fd), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) };
    assert_eq!(n, 1, "the async-event fd did not become readable");
    let ev = async_event(&b.ctx, WAIT)?;
    assert_eq!(ev, AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq.srqn() });
    // The limit disarms itself.
    assert_eq!(srq.query()?.srq_limit, 0);
    send(5)?;
    assert_eq!(b.ctx.get_async_event(Some(QUIET))?, None);
    Ok(())
}

fn a_cq_as_deep_as_the_send_queue_never_overflows(t: Topology) -> Result<()> {
    // Signaled writes, posted as fast as the queue takes them and never
    // polled: a slot is free only once its completion is polled, so the
    // queue fills at its depth and the CQ of the same depth holds every
    // completion (before, slots came back as completions were written,
    // and the CQ overran).
    let t = two(t)?;
    let (a, b) = t.pair_for(cap(16, 1), 16)?;
    let n = a.qp.cap().max_send_wr as usize;
    assert_eq!((n, a.cq.depth() as usize), (16, 16));
    let w = wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr() + 64, b.mr.rkey())?.signaled();
    let mut accepted = 0;
    for _ in 0..200 {
        match a.qp.post_send(std::slice::from_ref(&w)) {
            Ok(()) => accepted += 1,
            Err(e) => assert_eq!(e.errno(), libc::ENOMEM),
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(accepted, n, "the queue takes its depth and no more until completions are polled");
    assert!(a.ctx.get_async_event(Some(QUIET))?.is_none(), "no CQ error");
    assert_eq!(a.qp.state(), QpState::Rts);
    let got = poll_n(&a.cq, n, WAIT)?;
    assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
    // Polled: a whole queue fits again.
    a.qp.post_send(&vec![w.clone(); n])?;
    assert_eq!(poll_n(&a.cq, n, WAIT)?.len(), n);
    Ok(())
}

#[test]
fn cq_overrun_is_a_cq_error_event() -> Result<()> {
    let t = two(Topology::OneHost)?;
    let a = Side::with(&t.ca, 4096, 4, cap(16, 1), None)?;
    let depth = a.cq.depth() as usize;
    assert_eq!(depth, 4);
    a.qp.connect(&a.endpoint()?, access_all())?;
    let wrs: Vec<_> = (0..depth as u64 + 2)
        .map(|i| Ok(wr::rdma_write(i, &[a.mr.sge(0, 8)?], a.mr.addr() + 64, a.mr.rkey())?.signaled()))
        .collect::<Result<_>>()?;
    a.qp.post_send(&wrs)?;
    let mut events = vec![async_event(&a.ctx, WAIT)?, async_event(&a.ctx, WAIT)?];
    events.sort_by_key(|e| e.event_type.raw());
    assert_eq!(
        events,
        [
            AsyncEvent { event_type: AsyncEventType::CqErr, element: a.cq.cqn() },
            AsyncEvent { event_type: AsyncEventType::QpFatal, element: a.qp.qpn() },
        ]
    );
    wait_state(&a.qp, QpState::Err, WAIT)?;
    // What fit is there; nothing more is written into the overrun CQ.
    let got = poll_for(&a.cq, QUIET)?;
    assert_eq!(got.len(), depth, "{got:?}");
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    Ok(())
}

#[test]
fn quota_refuses_the_seventh_object() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_objects = 6\n")?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(4096, access_all())?;
    let cq = ctx.create_cq(16, None)?;
    let cq2 = ctx.create_cq(16, None)?;
    let qp = pd.create_rc_qp(&cq, &cq2, cap(16, 1))?;
    let mr2 = pd.alloc_mr(4096, access_all())?;
    // A completion channel counts too: it holds memory and descriptors in
    // the daemon.
    let e = ctx.create_comp_channel().unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    let e = ctx.alloc_pd().unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert!(e.to_string().contains("quota"), "{e}");
    let e = ctx.create_cq(16, None).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert!(e.to_string().contains("quota"), "{e}");
    let e = pd.alloc_mr(4096, access_all()).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    // The quota is the tenant's, not the context's.
    let e = d.context()?.alloc_pd().unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    // Freeing one makes room for one.
    drop(mr2);
    let pd2 = ctx.alloc_pd()?;
    assert_eq!(ctx.alloc_pd().unwrap_err().errno(), libc::ENOMEM);
    drop((pd2, qp, mr));
    Ok(())
}

#[test]
fn channels_are_charged_and_refunded() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_objects = 2\n")?;
    let ctx = d.context()?;
    let a = ctx.create_comp_channel()?;
    let _b = ctx.create_comp_channel()?;
    let e = ctx.create_comp_channel().unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    drop(a);
    let _c = ctx.create_comp_channel()?;
    // Closing the context refunds its channels to the tenant.
    drop((ctx, _b, _c));
    vrdma_it::wait_until(Duration::from_secs(10), "channels refunded", || {
        d.context().and_then(|c| Ok(c.create_comp_channel()?)).is_ok()
    })?;
    Ok(())
}

#[test]
fn contexts_per_tenant_are_limited() -> Result<()> {
    let d = DaemonProc::start_with_config("[quota]\nmax_contexts = 2\n")?;
    // The harness's readiness probe opened and dropped a context; the
    // daemon frees its slot when it sees the hang-up, which may come later.
    let open = || -> Result<vrdma::Context> {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match d.context() {
                Ok(c) => return Ok(c),
                Err(e) if std::time::Instant::now() > end => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    };
    let a = open()?;
    let _b = open()?;
    let e = d.context().unwrap_err();
    assert!(e.to_string().contains("contexts open"), "{e}");
    drop(a);
    // The closed context's slot comes back once the daemon has seen it go.
    vrdma_it::wait_until(Duration::from_secs(10), "a context slot freed", || d.context().is_ok())?;
    Ok(())
}

in_both_topologies!(
    bad_rkey_is_a_remote_access_error_that_breaks_both_ends,
    out_of_bounds_and_missing_access_are_remote_access_errors,
    bad_local_keys_are_local_protection_errors,
    receive_too_small_fails_both_ends,
    misused_atomics_fail_where_verbs_says,
    missing_receive_exhausts_rnr_retries,
    infinite_rnr_retry_waits_for_a_receive,
    posting_before_rts_is_einval_and_harmless,
    a_wr_the_device_holds_counts_against_the_send_queue,
    flush_and_reset_empty_a_full_send_queue,
    deregistered_rkey_is_a_remote_access_error,
    srq_limit_event_arrives_on_the_async_fd,
    a_cq_as_deep_as_the_send_queue_never_overflows,
);
