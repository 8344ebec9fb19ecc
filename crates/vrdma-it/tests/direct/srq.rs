//! SENDs into a QP whose receives come from a shared receive queue: the
//! direct-path requester claims the SRQ's next receive with the same
//! compare-and-swap as the engine (and as other requesters), so each
//! receive completes once whoever takes it; the SRQ limit event fires once
//! (the daemon raises it for the direct path's claims). Each scenario runs
//! on a daemon with the switch on and one with it off, and the outcomes
//! must be equal.

use std::time::Duration;

use vrdma::{AsyncEvent, AsyncEventType, QpInit, SrqAttr};
use vrdma_it::{access_all, cap};

use super::*;

const OFF: &str = "[direct]\nenabled = false\n";
const QUIET: Duration = Duration::from_millis(50);

/// Two requesters (`a1`, `a2`, in contexts of their own) connected to
/// two QPs (`b1`, `b2`) of one context whose receives come from `srq`,
/// completing in `cq`; `mr` holds the receive buffers.
struct Rig {
    a1: Side,
    a2: Side,
    ctx: vrdma::Context,
    mr: vrdma::MemoryRegion,
    cq: vrdma::CompletionQueue,
    srq: vrdma::SharedReceiveQueue,
    b1: vrdma::QueuePair,
    b2: vrdma::QueuePair,
}

impl Rig {
    fn new(d: &DaemonProc, mr_len: usize) -> Result<Rig> {
        let a1 = Side::new(&d.context()?, mr_len)?;
        let a2 = Side::new(&d.context()?, mr_len)?;
        let ctx = d.context()?;
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(mr_len, access_all())?;
        let cq = ctx.create_cq(1024, None)?;
        let srq = pd.create_srq(SrqAttr { max_wr: 256, max_sge: 2, srq_limit: 0 })?;
        let b1 = pd.create_qp(&QpInit::rc(&cq, &cq, cap(16, 2)).with_srq(&srq))?;
        let b2 = pd.create_qp(&QpInit::rc(&cq, &cq, cap(16, 2)).with_srq(&srq))?;
        for (a, b) in [(&a1, &b1), (&a2, &b2)] {
            a.qp.connect(&b.endpoint(&ctx)?, access_all())?;
            b.connect(&a.endpoint()?, access_all())?;
        }
        Ok(Rig { a1, a2, ctx, mr, cq, srq, b1, b2 })
    }

    /// The limit events that arrive, then nothing for [`QUIET`].
    fn events(&self) -> Result<Vec<AsyncEvent>> {
        let mut got = Vec::new();
        for _ in 0..4 {
            match self.ctx.get_async_event(Some(if got.is_empty() { WAIT } else { QUIET }))? {
                Some(ev) => got.push(ev),
                None => break,
            }
        }
        Ok(got)
    }
}

/// Runs `f` on a daemon with the switch on and one with it off; returns
/// the result and the on side's carried counts of `a1` and `a2`.
fn both<T: PartialEq + std::fmt::Debug>(
    mr_len: usize,
    f: impl Fn(&Rig) -> Result<T>,
) -> Result<(T, u64, u64)> {
    let on = DaemonProc::start_with_config(ON)?;
    let r = Rig::new(&on, mr_len)?;
    let got = f(&r)?;
    let n = (carried(&r.a1), carried(&r.a2));
    let off = DaemonProc::start_with_config(OFF)?;
    let x = Rig::new(&off, mr_len)?;
    let want = f(&x)?;
    assert_eq!((carried(&x.a1), carried(&x.a2)), (0, 0));
    assert_eq!(got, want, "the direct path's outcome differs from the engine's");
    Ok((got, n.0, n.1))
}

#[test]
fn a_direct_and_an_engine_requester_share_one_srq_each_receive_once() -> Result<()> {
    const N: usize = 60;
    // Above the direct path's 64 KiB: `a2`'s sends take the engine.
    const BIG: usize = (64 << 10) + 8;
    const SLOT: usize = 72 << 10;
    let (got, n1, n2) = both(2 * N * SLOT, |r| {
        r.a1.mr.fill(0, 8, 0xa1)?;
        r.a2.mr.fill(0, BIG, 0xa2)?;
        r.mr.fill(0, 2 * N * SLOT, 0)?;
        let recvs: Vec<_> =
            (0..2 * N).map(|i| wr::recv(i as u64, &[r.mr.sge(i * SLOT, SLOT)?])).collect::<Result<_, _>>()?;
        r.srq.post_recv(&recvs)?;
        r.srq.set_limit(10)?;
        // Both requesters at once, a few WRs per call.
        let stream = |a: &Side, len: usize| -> Result<Vec<WcStatus>> {
            let mut done = Vec::new();
            for k in 0..N / 4 {
                let wrs: Vec<_> = (0..4)
                    .map(|j| Ok(wr::send((4 * k + j) as u64, &[a.mr.sge(0, len)?])?.signaled()))
                    .collect::<Result<_>>()?;
                a.qp.post_send(&wrs).map_err(|e| e.error)?;
                done.extend(poll_n(&a.cq, 4, WAIT)?.iter().map(|w| w.status));
            }
            Ok(done)
        };
        let (s1, s2) = std::thread::scope(|s| {
            let t1 = s.spawn(|| stream(&r.a1, 8));
            let t2 = s.spawn(|| stream(&r.a2, BIG));
            (t1.join().expect("a1's thread"), t2.join().expect("a2's thread"))
        });
        let (s1, s2) = (s1?, s2?);
        assert!(s1.iter().chain(&s2).all(|&s| s == WcStatus::Success), "{s1:?} {s2:?}");
        let wcs = poll_n(&r.cq, 2 * N, WAIT)?;
        assert!(poll_for(&r.cq, QUIET)?.is_empty(), "a receive completed twice");
        let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..2 * N as u64).collect::<Vec<_>>(), "each receive completes once");
        let mut per_qp = [0usize; 2];
        for w in &wcs {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            let at = w.wr_id as usize * SLOT;
            let mut bytes = vec![0u8; w.byte_len as usize];
            r.mr.read(at, &mut bytes)?;
            if w.qp_num == r.b1.qpn() {
                assert_eq!((w.byte_len, w.src_qp), (8, r.a1.qp.qpn()));
                assert!(bytes.iter().all(|&x| x == 0xa1));
                per_qp[0] += 1;
            } else {
                assert_eq!((w.qp_num, w.byte_len, w.src_qp), (r.b2.qpn(), BIG as u32, r.a2.qp.qpn()));
                assert!(bytes.iter().all(|&x| x == 0xa2));
                per_qp[1] += 1;
            }
        }
        let events: Vec<_> = r.events()?.iter().map(|e| (e.event_type, e.element == r.srq.srqn())).collect();
        Ok((per_qp, events, r.srq.query()?.srq_limit))
    })?;
    assert_eq!(got.0, [N, N]);
    assert_eq!(got.1, vec![(AsyncEventType::SrqLimitReached, true)], "the limit event, once");
    assert_eq!(got.2, 0, "the limit disarmed");
    assert_eq!((n1, n2), (N as u64, 0), "a1's sends carried, a2's the engine's");
    Ok(())
}

#[test]
fn sends_and_writes_with_immediate_cross_the_srq_limit_once() -> Result<()> {
    let (got, n1, _) = both(4096, |r| {
        let recvs: Vec<_> =
            (0..8).map(|i| wr::recv(i, &[r.mr.sge(64 * i as usize, 64)?])).collect::<Result<_, _>>()?;
        r.srq.post_recv(&recvs)?;
        r.srq.set_limit(4)?;
        let mut seen = Vec::new();
        for id in 0..6u64 {
            // SENDs with immediate and writes with immediate in turn.
            let sge = [r.a1.mr.sge(0, 8)?];
            let w = if id % 2 == 0 {
                wr::send(id, &sge)?
            } else {
                wr::rdma_write(id, &sge, r.mr.addr() + 2048, r.mr.rkey())?
            };
            r.a1.qp.post_send(&[w.with_imm(id as u32).signaled()])?;
            assert_eq!(poll_one(&r.a1.cq, WAIT)?.status, WcStatus::Success);
            let wc = poll_one(&r.cq, WAIT)?;
            let ev = r.ctx.get_async_event(Some(QUIET))?.map(|e| (e.event_type, e.element == r.srq.srqn()));
            seen.push((wc.wr_id, wc.status, wc.opcode, wc.imm_data, wc.qp_num == r.b1.qpn(), ev));
        }
        Ok((seen, r.srq.query()?.srq_limit))
    })?;
    let fired: Vec<usize> = got.0.iter().enumerate().filter(|(_, s)| s.5.is_some()).map(|(i, _)| i).collect();
    assert_eq!(fired, vec![4], "fired once, when three were left below the limit of four");
    assert_eq!(got.0[4].5, Some((AsyncEventType::SrqLimitReached, true)));
    assert_eq!(got.0[1].2, WcOpcode::RecvRdmaWithImm);
    assert!(got.0.iter().all(|s| s.1 == WcStatus::Success && s.4), "{:?}", got.0);
    assert_eq!(got.1, 0);
    assert_eq!(n1, 6, "carried");
    Ok(())
}

#[test]
fn a_too_small_srq_receive_is_the_engines_length_error() -> Result<()> {
    let (got, n1, _) = both(4096, |r| {
        r.srq.post_recv(&[wr::recv(1, &[r.mr.sge(0, 4)?])?])?;
        r.a1.qp.post_send(&[wr::send(1, &[r.a1.mr.sge(0, 8)?])?.signaled()])?;
        let req = poll_one(&r.a1.cq, WAIT)?;
        let resp = poll_one(&r.cq, WAIT)?;
        Ok(((req.wr_id, req.status), (resp.wr_id, resp.status, resp.qp_num == r.b1.qpn())))
    })?;
    assert_eq!(got.0, (1, WcStatus::RemInvReqErr));
    assert_eq!(got.1, (1, WcStatus::LocLenErr, true));
    assert_eq!(n1, 0, "left to the engine");
    Ok(())
}

#[test]
fn an_empty_srq_leaves_the_send_to_the_engines_rnr() -> Result<()> {
    let (got, n1, _) = both(4096, |r| {
        r.a1.qp.post_send(&[wr::send(1, &[r.a1.mr.sge(0, 8)?])?.signaled()])?;
        std::thread::sleep(Duration::from_millis(30));
        let early = r.a1.cq.poll_one()?.is_some();
        r.srq.post_recv(&[wr::recv(1, &[r.mr.sge(0, 8)?])?])?;
        let first = (poll_one(&r.a1.cq, WAIT)?.status, poll_one(&r.cq, WAIT)?.status);
        r.srq.post_recv(&[wr::recv(2, &[r.mr.sge(0, 8)?])?])?;
        r.a1.qp.post_send(&[wr::send(2, &[r.a1.mr.sge(0, 8)?])?.signaled()])?;
        let second = (poll_one(&r.a1.cq, WAIT)?.status, poll_one(&r.cq, WAIT)?.wr_id);
        Ok((early, first, second))
    })?;
    assert_eq!(got, (false, (WcStatus::Success, WcStatus::Success), (WcStatus::Success, 2)));
    assert_eq!(n1, 1, "the first waited on the engine, the second was carried");
    Ok(())
}

/// A receive grant with every part (a new window page, the responder's
/// QP, its SRQ, and the receive CQ's segment and channel doorbell) is five
/// descriptors in one reply: the first request of a requester QP being a
/// SEND into such a QP (Open MPI over UCX's `rc_verbs`, whose receives
/// come from an SRQ and whose CQs have a channel, did that). The reply
/// must arrive whole and leave the requester's connection usable; it was
/// cut to four descriptors, the connection taken as broken and every later
/// call of the process failed with `ENOTCONN`.
#[test]
fn a_receive_grant_with_an_srq_a_channel_and_a_new_window_arrives_whole() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let a = Side::new(&d.context()?, 4096)?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(4096, access_all())?;
    let ch = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(64, Some(&ch))?;
    let srq = pd.create_srq(SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 })?;
    let b = pd.create_qp(&QpInit::rc(&cq, &cq, cap(16, 1)).with_srq(&srq))?;
    a.qp.connect(&b.endpoint(&ctx)?, access_all())?;
    b.connect(&a.endpoint()?, access_all())?;
    srq.post_recv(&[wr::recv(1, &[mr.sge(0, 64)?])?, wr::recv(2, &[mr.sge(64, 64)?])?])?;
    a.mr.write(0, b"sent 1st")?;
    // The requester QP's first request: the receive grant brings the window.
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 8)?])?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    let wcs = poll_n(&cq, 2, WAIT)?;
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status, w.byte_len)).collect::<Vec<_>>(),
        [(1, WcStatus::Success, 8), (2, WcStatus::Success, 8)]
    );
    let mut got = [0u8; 8];
    mr.read(64, &mut got)?;
    assert_eq!(&got, b"sent 1st");
    assert_eq!(carried(&a), 2, "both sends carried");
    // The requester's connection to the daemon still answers.
    a.ctx.alloc_pd()?;
    Ok(())
}
