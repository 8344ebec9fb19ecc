//! A direct-path sender killed mid-flood into one of our QPs whose
//! receives come from an SRQ (issue 17, "either process SIGKILLed
//! mid-transfer", with "an SRQ shared by QPs on different paths"). What
//! hardware implies: the SRQ receive the dying sender's message had taken
//! is flushed on that QP's CQ (a WQE a QP consumed when it goes to ERR);
//! every other receive stays in the SRQ for the SRQ's other QPs. So every
//! receive posted completes exactly once: a success or that one flush on
//! the killed sender's QP, or a success on another QP of the SRQ later.
//! Whether a kill lands between a claim and its push is chance (the
//! deterministic test is the daemon's
//! `a_claimed_srq_receive_whose_requester_died_is_flushed_once_on_its_qp`);
//! each run kills `ROUNDS` senders. A sender stopped while its QP is
//! flushed keeps the SRQ's claiming turn it may hold until it dies (it
//! could still claim), then the SRQ's other requesters claim directly
//! again.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpInit, QpState, SrqAttr, WcStatus};
use vrdma_it::protocol::Command;
use vrdma_it::{access_all, cap, poll_for, poll_n, wait_state, DaemonProc, PeerProc, Side, WAIT};

use super::{carried, ON};

const LEN: usize = 64;
const DEPTH: u64 = 64;
const ROUNDS: usize = 4;

/// One SRQ with `DEPTH` receives posted, and the SRQ's other QP (fed by
/// a sender of ours, `drainer`) that takes what is left at the end.
struct Srq {
    d: DaemonProc,
    ctx: vrdma::Context,
    pd: vrdma::ProtectionDomain,
    mr: vrdma::MemoryRegion,
    cq: vrdma::CompletionQueue,
    srq: vrdma::SharedReceiveQueue,
    drain: vrdma::QueuePair,
    drainer: Side,
    posted: BTreeSet<u64>,
    done: BTreeSet<u64>,
    next: u64,
}

impl Srq {
    fn new() -> Result<Srq> {
        let d = DaemonProc::start_with_config(ON)?;
        let ctx = d.context()?;
        let pd = ctx.alloc_pd()?;
        let mr = pd.alloc_mr(4096, access_all())?;
        let cq = ctx.create_cq(4096, None)?;
        let srq = pd.create_srq(SrqAttr { max_wr: DEPTH as u32, max_sge: 1, srq_limit: 0 })?;
        let drain = pd.create_qp(&QpInit::rc(&cq, &cq, cap(16, 1)).with_srq(&srq))?;
        let drainer = Side::new(&d.context()?, 4096)?;
        drainer.qp.connect(&drain.endpoint(&ctx)?, access_all())?;
        drain.connect(&drainer.endpoint()?, access_all())?;
        let mut s = Srq {
            d,
            ctx,
            pd,
            mr,
            cq,
            srq,
            drain,
            drainer,
            posted: BTreeSet::new(),
            done: BTreeSet::new(),
            next: 0,
        };
        for _ in 0..DEPTH {
            s.post()?;
        }
        Ok(s)
    }

    fn post(&mut self) -> Result<()> {
        self.srq.post_recv(&[wr::recv(self.next, &[self.mr.sge(0, LEN)?])?])?;
        self.posted.insert(self.next);
        self.next += 1;
        Ok(())
    }

    fn record(&mut self, w: &vrdma::WorkCompletion) -> Result<()> {
        ensure!(self.done.insert(w.wr_id), "receive {} completed twice: {w:?}", w.wr_id);
        Ok(())
    }

    /// A QP of the SRQ connected to a new tenant peer process flooding
    /// it with sends.
    fn flooded(&self) -> Result<(vrdma::QueuePair, PeerProc)> {
        let b = self.pd.create_qp(&QpInit::rc(&self.cq, &self.cq, cap(16, 1)).with_srq(&self.srq))?;
        let mut peer = PeerProc::spawn(&self.d.socket, "tenant", &[])?;
        let h = peer.hello()?;
        peer.call_ok(&Command::Connect { peer: b.endpoint(&self.ctx)? })?;
        b.connect(&h.endpoint, access_all())?;
        peer.send(&Command::FloodSendSeq { len: LEN, count: 1 << 30 })?;
        Ok((b, peer))
    }

    /// Polls (reposting what completes) until `n` messages arrived on `b`.
    fn arrive(&mut self, b: &vrdma::QueuePair, n: usize) -> Result<()> {
        let end = Instant::now() + WAIT;
        let mut arrived = 0;
        while arrived < n {
            let got = poll_for(&self.cq, Duration::ZERO)?;
            for w in &got {
                ensure!(w.status == WcStatus::Success && w.qp_num == b.qpn(), "before the kill, {w:?}");
                self.record(w)?;
                self.post()?;
            }
            arrived += got.len();
            if got.is_empty() {
                ensure!(
                    Instant::now() < end,
                    "only {arrived} messages arrived ({} receives outstanding in the SRQ)",
                    self.posted.len() - self.done.len()
                );
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// What completes on `b` within `d`, recorded and reposted (as in
    /// [`Self::arrive`]: the SRQ keeps `DEPTH` receives posted, or a next
    /// sender finds it drained by the completions of the messages that
    /// landed before a kill and RNR-waits for ever): successes, and how
    /// many flushes (`WR_FLUSH_ERR`).
    fn flushes_within(&mut self, b: &vrdma::QueuePair, d: Duration) -> Result<usize> {
        let mut flushed = 0;
        for w in poll_for(&self.cq, d)? {
            ensure!(w.qp_num == b.qpn(), "{w:?}");
            match w.status {
                WcStatus::Success => {}
                WcStatus::WrFlushErr => flushed += 1,
                _ => bail!("{w:?}"),
            }
            self.record(&w)?;
            self.post()?;
        }
        Ok(flushed)
    }

    /// Every receive not completed is still in the SRQ: the drain QP's
    /// sender takes each one exactly once (one lost, its last send would
    /// wait for a receive that never comes). Returns how many it took.
    fn drain_left(&mut self) -> Result<usize> {
        let left: Vec<u64> = self.posted.difference(&self.done).copied().collect();
        ensure!(left.len() as u64 <= DEPTH, "{} receives left of {DEPTH} posted at a time", left.len());
        let a2 = &self.drainer;
        for (i, _) in left.iter().enumerate() {
            a2.qp.post_send(&[wr::send(i as u64, &[a2.mr.sge(0, 8)?])?.signaled()])?;
            let sent = poll_n(&a2.cq, 1, WAIT).map_err(|e| {
                anyhow::anyhow!("send {i} of {} found no receive in the SRQ (one was lost): {e}", left.len())
            })?;
            ensure!(sent[0].status == WcStatus::Success, "{sent:?}");
        }
        let got = poll_n(&self.cq, left.len(), WAIT).map_err(|e| {
            anyhow::anyhow!("the SRQ held fewer receives than were posted and never completed: {e}")
        })?;
        for w in &got {
            ensure!(w.qp_num == self.drain.qpn() && w.status == WcStatus::Success, "{w:?}");
            self.record(w)?;
        }
        ensure!(self.done == self.posted, "not every posted receive completed once");
        ensure!(poll_for(&self.cq, Duration::from_millis(50))?.is_empty(), "a completion more");
        Ok(left.len())
    }
}

#[test]
fn a_sender_killed_mid_flood_into_an_srq_loses_and_repeats_no_receive() -> Result<()> {
    let mut s = Srq::new()?;
    let mut flushed = 0;
    for round in 0..ROUNDS {
        let (b, mut peer) = s.flooded()?;
        // Let it flood (reposting what completes), then kill it mid-flood.
        s.arrive(&b, 500 + 300 * round)?;
        peer.proc.kill(libc::SIGKILL);
        ensure!(!peer.proc.wait_timeout(WAIT)?.success());
        wait_state(&b, QpState::Err, WAIT)?;
        // What landed before the kill, and at most one flush on this QP:
        // the receive the sender had taken and not completed.
        flushed += s.flushes_within(&b, Duration::from_millis(100))?;
    }
    ensure!(flushed <= ROUNDS, "{flushed} flushes for {ROUNDS} killed senders");
    let left = s.drain_left()?;
    eprintln!("{ROUNDS} senders killed: {flushed} claimed receive(s) flushed, {left} drained after");
    Ok(())
}

/// The sender stopped (it may hold the SRQ's claiming turn, between any
/// two steps of a claim), our QP moved to ERR meanwhile, then the sender
/// killed: each receive completes once (at most one flush on our QP, the
/// receive it had claimed), and once it is gone the SRQ's other requester
/// claims on the direct path again (the turn given back when it died, not
/// kept forever, nor given back while it could still claim).
#[test]
fn a_sender_stopped_while_its_srq_qp_is_flushed_then_killed_loses_and_repeats_no_receive() -> Result<()> {
    let mut s = Srq::new()?;
    let (b, mut peer) = s.flooded()?;
    s.arrive(&b, 500)?;
    peer.proc.stop(WAIT)?;
    let mut flushed = s.flushes_within(&b, Duration::from_millis(100))?;
    let err = vrdma::QpAttr { qp_state: QpState::Err, ..Default::default() };
    b.modify(&err, vrdma::QpAttrMask::STATE)?;
    flushed += s.flushes_within(&b, Duration::from_millis(100))?;
    peer.proc.kill(libc::SIGKILL);
    ensure!(!peer.proc.wait_timeout(WAIT)?.success());
    flushed += s.flushes_within(&b, Duration::from_millis(100))?;
    ensure!(flushed <= 1, "{flushed} flushes on the stopped sender's QP");
    let before = carried(&s.drainer);
    let left = s.drain_left()?;
    let direct = carried(&s.drainer) - before;
    ensure!(
        direct > 0,
        "none of {left} sends into the SRQ's other QP carried: its claiming turn was never given back"
    );
    eprintln!(
        "stopped, flushed, killed: {flushed} flush(es); {left} drained after, {direct} on the direct path"
    );
    Ok(())
}
