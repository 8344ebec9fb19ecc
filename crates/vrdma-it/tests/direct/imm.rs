//! RDMA writes with immediate on the direct path: the requester claims the
//! peer's receive itself and completes it into the peer QP's inbox, which
//! the peer's CQ polls before its ring. Order, RNR and flushes stay the
//! engine's; a peer CQ with a channel gets its event from the requester
//! (more in `channels.rs`).

use vrdma::{WcFlags, WorkCompletion};

use super::*;

fn recv(s: &Side, id: u64) -> Result<()> {
    s.qp.post_recv(&[wr::recv(id, &[s.mr.sge(0, 8)?])?])?;
    Ok(())
}

fn write_imm(a: &Side, b: &Side, id: u64, len: usize, off: u64, imm: u32) -> Result<vrdma::SendWr> {
    Ok(wr::rdma_write(id, &[a.mr.sge(0, len)?], b.mr.addr() + off, b.mr.rkey())?.with_imm(imm).signaled())
}

/// The peer's view of a write with immediate: (wr_id, status, opcode, byte_len, imm).
fn seen(wc: &WorkCompletion) -> (u64, WcStatus, WcOpcode, u32, u32) {
    (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.imm_data)
}

#[test]
fn writes_with_immediate_claim_the_peers_receives_and_complete_on_both_sides() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    let data = pattern(4096, 3);
    a.mr.write(0, &data)?;
    for id in 10..13 {
        recv(&b, id)?;
    }
    let mut inline = wr::rdma_write(3, &[], b.mr.addr() + 20_000, b.mr.rkey())?.with_imm(33).signaled();
    inline = inline.inline(b"inline!!")?;
    a.qp.post_send(&[write_imm(&a, &b, 1, 8, 100, 11)?, write_imm(&a, &b, 2, 4096, 8192, 22)?, inline])?;
    let wcs = poll_n(&a.cq, 3, WAIT)?;
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (i as u64 + 1, WcStatus::Success, WcOpcode::RdmaWrite));
    }
    assert_eq!(carried(&a), 3, "the writes with immediate took the direct path");
    let got = poll_n(&b.cq, 3, WAIT)?;
    let want = [(10, 8, 11), (11, 4096, 22), (12, 8, 33)];
    for (wc, (id, len, imm)) in got.iter().zip(want) {
        assert_eq!(seen(wc), (id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len, imm));
        assert_eq!((wc.qp_num, wc.src_qp), (b.qp.qpn(), a.qp.qpn()));
        assert!(wc.wc_flags.contains(WcFlags::WITH_IMM));
    }
    let mut buf = vec![0u8; 4096];
    b.mr.read(8192, &mut buf)?;
    assert!(buf == data);
    b.mr.read(20_000, &mut buf[..8])?;
    assert_eq!(&buf[..8], b"inline!!");
    assert!(b.cq.poll_one()?.is_none());
    Ok(())
}

#[test]
fn without_a_receive_the_write_waits_on_the_engines_rnr_and_then_completes() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    recv(&b, 1)?;
    a.qp.post_send(&[write_imm(&a, &b, 1, 8, 0, 1)?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(seen(&poll_one(&b.cq, WAIT)?).0, 1);
    assert_eq!(carried(&a), 1);
    // No receive posted: the engine's, which waits (RNR, retried without
    // end) until one comes.
    a.qp.post_send(&[write_imm(&a, &b, 2, 8, 0, 2)?])?;
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(a.cq.poll_one()?.is_none(), "completed without a receive");
    recv(&b, 2)?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(seen(&poll_one(&b.cq, WAIT)?), (2, WcStatus::Success, WcOpcode::RecvRdmaWithImm, 8, 2));
    assert_eq!(carried(&a), 1, "the WR without a receive took the engine");
    // And the next one, with a receive there, is carried again.
    recv(&b, 3)?;
    a.qp.post_send(&[write_imm(&a, &b, 3, 8, 0, 3)?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(seen(&poll_one(&b.cq, WAIT)?).0, 3);
    assert_eq!(carried(&a), 2);
    Ok(())
}

#[test]
fn direct_and_engine_receive_completions_keep_their_order_in_the_peers_cq() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let big = 2 << 20; // the engine's (above the direct limit)
    assert!(big as u64 > vrdma::DIRECT_MAX_RDMA_BYTES);
    let (a, b) = pair(&d, 4 << 20)?;
    for id in 1..=4 {
        recv(&b, id)?;
    }
    // 1 carried (into the inbox), 2 the engine's (into the ring); then 3,
    // with the ring not empty, the engine's too. The peer polls nothing
    // in between, and must see 1, 2, 3.
    a.qp.post_send(&[write_imm(&a, &b, 1, 8, 0, 1)?])?;
    a.qp.post_send(&[write_imm(&a, &b, 2, big, 0, 2)?])?;
    assert_eq!(poll_n(&a.cq, 2, WAIT)?.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2]);
    a.qp.post_send(&[write_imm(&a, &b, 3, 8, 0, 3)?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, 3);
    assert_eq!(carried(&a), 1);
    let got: Vec<_> = poll_n(&b.cq, 3, WAIT)?.iter().map(|w| (w.wr_id, w.imm_data, w.status)).collect();
    assert_eq!(got, [(1, 1, WcStatus::Success), (2, 2, WcStatus::Success), (3, 3, WcStatus::Success)]);
    // All polled: carried again.
    a.qp.post_send(&[write_imm(&a, &b, 4, 8, 0, 4)?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, 4);
    assert_eq!(seen(&poll_one(&b.cq, WAIT)?).0, 4);
    assert_eq!(carried(&a), 2);
    Ok(())
}

#[test]
fn a_responder_sent_to_error_completes_each_receive_once() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    for id in 0..8 {
        recv(&b, id)?;
    }
    for id in 0..3 {
        a.qp.post_send(&[write_imm(&a, &b, id, 8, 0, id as u32)?])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    }
    assert_eq!(carried(&a), 3);
    let err = vrdma::QpAttr { qp_state: QpState::Err, ..Default::default() };
    b.qp.modify(&err, vrdma::QpAttrMask::STATE)?;
    let got = poll_n(&b.cq, 8, WAIT)?;
    let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "each receive once, in order");
    assert!(got[..3].iter().all(|w| w.status == WcStatus::Success));
    assert!(got[3..].iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert!(b.cq.poll_one()?.is_none());
    Ok(())
}

#[test]
fn a_peer_whose_receive_cq_has_a_channel_gets_its_event_from_the_direct_path() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let a = Side::new(&d.context()?, 4096)?;
    let ctx = d.context()?;
    let channel = ctx.create_comp_channel()?;
    let b = Side::with(&ctx, 4096, 64, vrdma_it::cap(16, 1), Some(&channel))?;
    connect(&a, &b)?;
    b.cq.req_notify(false)?;
    recv(&b, 7)?;
    a.qp.post_send(&[write_imm(&a, &b, 1, 8, 0, 9)?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(channel.get_cq_event(Some(WAIT))?, Some(b.cq.cqn()), "the armed CQ's event");
    assert_eq!(seen(&poll_one(&b.cq, WAIT)?).0, 7);
    assert_eq!(carried(&a), 1, "a receive CQ with a channel is served directly");
    assert_eq!(channel.get_cq_event(Some(std::time::Duration::ZERO))?, None, "one event per arming");
    Ok(())
}

#[test]
fn inbox_entries_count_against_the_peers_cq_and_an_overrun_is_the_engines() -> Result<()> {
    use vrdma::{AsyncEvent, AsyncEventType};
    let d = DaemonProc::start_with_config(ON)?;
    let a = Side::new(&d.context()?, 4096)?;
    let ctx = d.context()?;
    let b = Side::with(&ctx, 4096, 4, vrdma_it::cap(16, 1), None)?;
    connect(&a, &b)?;
    let depth = b.cq.depth() as u64;
    for id in 0..=depth {
        recv(&b, id)?;
    }
    // The peer polls nothing: its CQ's depth of them are carried into the
    // inbox, the next is the engine's, which finds the CQ full.
    for id in 0..depth {
        a.qp.post_send(&[write_imm(&a, &b, id, 8, 0, id as u32)?])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    }
    assert_eq!(carried(&a), depth);
    a.qp.post_send(&[write_imm(&a, &b, depth, 8, 0, 0)?])?;
    let event = vrdma_it::async_event(&ctx, WAIT)?;
    assert_eq!(event, AsyncEvent { event_type: AsyncEventType::CqErr, element: b.cq.cqn() });
    assert_eq!(carried(&a), depth, "the one that did not fit took the engine");
    let got = poll_n(&b.cq, depth as usize, WAIT)?;
    assert!(got.iter().enumerate().all(|(i, w)| w.wr_id == i as u64 && w.status == WcStatus::Success));
    Ok(())
}
