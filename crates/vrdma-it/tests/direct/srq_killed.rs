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
//! each run kills `ROUNDS` senders.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpInit, QpState, SrqAttr, WcStatus};
use vrdma_it::protocol::Command;
use vrdma_it::{access_all, cap, poll_for, poll_n, wait_state, DaemonProc, PeerProc, Side, WAIT};

use super::ON;

const LEN: usize = 64;
const DEPTH: u64 = 64;
const ROUNDS: usize = 4;

#[test]
fn a_sender_killed_mid_flood_into_an_srq_loses_and_repeats_no_receive() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let ctx = d.context()?;
    let pd = ctx.alloc_pd()?;
    let mr = pd.alloc_mr(4096, access_all())?;
    let cq = ctx.create_cq(4096, None)?;
    let srq = pd.create_srq(SrqAttr { max_wr: DEPTH as u32, max_sge: 1, srq_limit: 0 })?;
    let new_qp = || pd.create_qp(&QpInit::rc(&cq, &cq, cap(16, 1)).with_srq(&srq));
    // The SRQ's other QP, fed by a sender of ours, drains it at the end.
    let drain = new_qp()?;
    let a2 = Side::new(&d.context()?, 4096)?;
    a2.qp.connect(&drain.endpoint(&ctx)?, access_all())?;
    drain.connect(&a2.endpoint()?, access_all())?;
    let mut posted = BTreeSet::new();
    let mut next = 0u64;
    let mut post = |posted: &mut BTreeSet<u64>| -> Result<()> {
        srq.post_recv(&[wr::recv(next, &[mr.sge(0, LEN)?])?])?;
        posted.insert(next);
        next += 1;
        Ok(())
    };
    for _ in 0..DEPTH {
        post(&mut posted)?;
    }
    let mut done = BTreeSet::new();
    let mut flushed = 0;
    let record = |w: &vrdma::WorkCompletion, done: &mut BTreeSet<u64>| -> Result<()> {
        ensure!(done.insert(w.wr_id), "receive {} completed twice: {w:?}", w.wr_id);
        Ok(())
    };
    for round in 0..ROUNDS {
        let b = new_qp()?;
        let mut peer = PeerProc::spawn(&d.socket, "tenant", &[])?;
        let h = peer.hello()?;
        peer.call_ok(&Command::Connect { peer: b.endpoint(&ctx)? })?;
        b.connect(&h.endpoint, access_all())?;
        peer.send(&Command::FloodSendSeq { len: LEN, count: 1 << 30 })?;
        // Let it flood (reposting what completes), then kill it mid-flood.
        let end = Instant::now() + WAIT;
        let mut arrived = 0;
        while arrived < 500 + 300 * round {
            let got = poll_for(&cq, Duration::ZERO)?;
            for w in &got {
                if w.status != WcStatus::Success || w.qp_num != b.qpn() {
                    bail!("round {round}: before the kill, {w:?}");
                }
                record(w, &mut done)?;
                post(&mut posted)?;
            }
            arrived += got.len();
            if got.is_empty() {
                ensure!(Instant::now() < end, "round {round}: only {arrived} messages arrived");
                std::thread::yield_now();
            }
        }
        peer.proc.kill(libc::SIGKILL);
        ensure!(!peer.proc.wait_timeout(WAIT)?.success());
        wait_state(&b, QpState::Err, WAIT)?;
        // What landed before the kill, and at most one flush on this QP:
        // the receive the sender had taken and not completed.
        for w in poll_for(&cq, Duration::from_millis(100))? {
            ensure!(w.qp_num == b.qpn(), "round {round}: {w:?}");
            match w.status {
                WcStatus::Success => {}
                WcStatus::WrFlushErr => flushed += 1,
                _ => bail!("round {round}: {w:?}"),
            }
            record(&w, &mut done)?;
        }
    }
    ensure!(flushed <= ROUNDS, "{flushed} flushes for {ROUNDS} killed senders");
    // Every receive not completed is still in the SRQ: the drain QP's
    // sender takes each one exactly once (one lost, its last send would
    // wait for a receive that never comes).
    let left: Vec<u64> = posted.difference(&done).copied().collect();
    ensure!(left.len() as u64 <= DEPTH, "{} receives left of {DEPTH} posted at a time", left.len());
    for (i, _) in left.iter().enumerate() {
        a2.qp.post_send(&[wr::send(i as u64, &[a2.mr.sge(0, 8)?])?.signaled()])?;
        let sent = poll_n(&a2.cq, 1, WAIT).map_err(|e| {
            anyhow::anyhow!("send {i} of {} found no receive in the SRQ (one was lost): {e}", left.len())
        })?;
        ensure!(sent[0].status == WcStatus::Success, "{sent:?}");
    }
    let got = poll_n(&cq, left.len(), WAIT).map_err(|e| {
        anyhow::anyhow!("the SRQ held fewer receives than were posted and never completed: {e}")
    })?;
    for w in &got {
        ensure!(w.qp_num == drain.qpn() && w.status == WcStatus::Success, "{w:?}");
        record(w, &mut done)?;
    }
    ensure!(done == posted, "not every posted receive completed once");
    ensure!(poll_for(&cq, Duration::from_millis(50))?.is_empty(), "a completion more");
    eprintln!("{ROUNDS} senders killed: {flushed} claimed receive(s) flushed, {} drained after", left.len());
    Ok(())
}
