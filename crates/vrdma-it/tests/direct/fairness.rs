//! Many QPs on one CQ (`docs/direct-path.md`, "What is missing", item 9):
//! the receive CQ finds its QPs' inboxes through its ready set, and a
//! scan starts after the bucket the last one stopped in, so a busy QP
//! made first (early in the CQ's list of QPs) does not keep a later QP's
//! completion waiting behind everything it holds.

use anyhow::{ensure, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::WcStatus;
use vrdma_it::{access_all, cap, poll_n, DaemonProc, Side, WAIT};

use super::{carried, ON};

/// The busy QP's completions already waiting when the later one's comes.
const BUSY: u64 = 60;

#[test]
fn a_busy_qp_made_first_does_not_delay_a_later_qp_on_the_same_cq() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = (Side::new(&d.context()?, 1 << 16)?, Side::new(&d.context()?, 1 << 16)?);
    // b.qp (made first) and b2 receive into b's CQ; a.qp and a2 send.
    let (b2, a2) = (b.another_qp(cap(256, 4))?, a.another_qp(cap(256, 4))?);
    a.qp.connect(&b.endpoint()?, access_all())?;
    b.qp.connect(&a.endpoint()?, access_all())?;
    a2.connect(&b2.endpoint(&b.ctx)?, access_all())?;
    b2.connect(&a2.endpoint(&a.ctx)?, access_all())?;
    let write = |qp: &vrdma::QueuePair, id: u64| -> Result<()> {
        let w = wr::rdma_write(id, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.with_imm(id as u32);
        qp.post_send(&[w]).map_err(|e| e.error)?;
        Ok(())
    };
    for id in 0..BUSY {
        b.qp.post_recv(&[wr::recv(id, &[])?])?;
    }
    b2.post_recv(&[wr::recv(1000, &[])?])?;
    for id in 0..BUSY {
        write(&a.qp, id)?;
    }
    write(&a2, 1000)?;
    ensure!(carried(&a) == BUSY && a2.direct_stats().0 == 1, "not all carried: the inboxes hold nothing");
    // One completion per poll: the later QP's comes within the first two,
    // and the busy QP's keep coming.
    let mut order = Vec::new();
    for _ in 0..4 {
        let wc = poll_n(&b.cq, 1, WAIT)?[0];
        ensure!(wc.status == WcStatus::Success, "{wc:?}");
        order.push(wc.wr_id);
    }
    let late = order.iter().position(|&id| id == 1000);
    ensure!(late.is_some_and(|p| p < 2), "the later QP's completion came at poll {late:?}: {order:?}");
    ensure!(order.iter().filter(|&&id| id < BUSY).count() == 3, "the busy QP stalled: {order:?}");
    // The rest: each once, in order.
    let rest = poll_n(&b.cq, (BUSY - 3) as usize, WAIT)?;
    let busy: Vec<u64> =
        order.iter().copied().filter(|&id| id < BUSY).chain(rest.iter().map(|w| w.wr_id)).collect();
    ensure!(busy == (0..BUSY).collect::<Vec<_>>(), "{busy:?}");
    Ok(())
}
