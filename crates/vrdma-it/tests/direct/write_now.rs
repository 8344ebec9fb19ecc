//! `QueuePair::write_now`: an unsignaled RDMA write from memory that is
//! not registered, carried by the direct path within the call or not
//! posted at all (the sockets carrier writes a program's buffer straight
//! into its peer's ring with it).

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpState, WcStatus};
use vrdma_it::{pattern, poll_n, DaemonProc, WAIT};

use super::{carried, pair, ON};

#[test]
fn a_write_from_unregistered_memory_lands_before_the_call_returns() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    // A heap buffer of this process, never registered, in three pieces.
    let data = pattern(5000, 7);
    let pieces = [&data[..1], &data[1..4096], &data[4096..]];
    assert!(a.qp.write_now(&pieces, b.mr.addr() + 300, b.mr.rkey())?);
    let mut got = vec![0u8; 5000];
    b.mr.read(300, &mut got)?;
    assert!(got == data, "the bytes landed, in order, before the call returned");
    assert_eq!(carried(&a), 1);
    // Unsignaled: nothing completes until a signaled WR after it does,
    // and it held a send-queue slot until then.
    assert!(a.cq.poll_one()?.is_none());
    a.mr.write(0, b"tail")?;
    a.qp.post_send(&[wr::rdma_write(9, &[a.mr.sge(0, 4)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    let wc = poll_n(&a.cq, 1, WAIT)?;
    assert_eq!((wc[0].wr_id, wc[0].status), (9, WcStatus::Success));
    Ok(())
}

#[test]
fn nothing_is_posted_where_the_direct_path_cannot_take_it_now() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    let data = [0x5au8; 64];
    // Outside the peer's region, and an unknown key: not carried, and
    // nothing posted (the QP stays in RTS, no error completes).
    assert!(!a.qp.write_now(&[&data], b.mr.addr() + (1 << 16) - 8, b.mr.rkey())?);
    assert!(!a.qp.write_now(&[&data], b.mr.addr(), b.mr.rkey() ^ 0x40)?);
    // Work of the QP on the engine path not yet polled: it must land
    // first, so the write is refused until it is polled.
    let len = 2 << 20;
    let (a2, b2) = pair(&d, 4 << 20)?;
    a2.qp.post_send(&[wr::rdma_write(1, &[a2.mr.sge(0, len)?], b2.mr.addr(), b2.mr.rkey())?.signaled()])?;
    assert!(!a2.qp.write_now(&[&data], b2.mr.addr(), b2.mr.rkey())?);
    poll_n(&a2.cq, 1, WAIT)?;
    assert!(a2.qp.write_now(&[&data], b2.mr.addr(), b2.mr.rkey())?);
    assert_eq!(a.qp.state(), QpState::Rts);
    assert!(a.cq.poll_one()?.is_none());
    let mut got = [0u8; 8];
    b.mr.read((1 << 16) - 8, &mut got)?;
    assert_eq!(got, [0; 8], "nothing landed");
    // A QP that signals every WR has no unsignaled write to carry.
    let all = a.pd.create_qp(&vrdma::QpInit::rc(&a.cq, &a.cq, vrdma_it::cap(16, 1)).sig_all(true))?;
    let peer = b.another_qp(vrdma_it::cap(16, 1))?;
    all.connect(&peer.endpoint(&b.ctx)?, vrdma_it::access_all())?;
    peer.connect(&all.endpoint(&a.ctx)?, vrdma_it::access_all())?;
    assert!(!all.write_now(&[&data], b.mr.addr(), b.mr.rkey())?);
    // With the switch off nothing is ever carried this way.
    let off = DaemonProc::start_with_config("[direct]\nenabled = false\n")?;
    let (c, e) = pair(&off, 4096)?;
    assert!(!c.qp.write_now(&[&data], e.mr.addr(), e.mr.rkey())?);
    Ok(())
}
