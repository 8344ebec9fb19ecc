//! The direct path (`docs/direct-path.md`): RDMA writes, reads and
//! atomics between QPs of one tenant on one host that the requester's
//! library carries itself, with the daemon's `direct.enabled` on. Each
//! test checks that the path was taken (the QP's `direct_stats`) where it
//! must be, and that bytes, completions and errors are what the engine
//! path gives. Writes here; reads in `reads.rs`, atomics in `atomics.rs`,
//! writes with immediate (the peer's receives claimed) in `imm.rs`.

mod atomics;
mod budget;
mod channels;
mod fairness;
mod imm;
mod large;
mod reads;
mod send;
mod srq;
mod srq_killed;
mod stopped;
mod write_now;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpState, WcOpcode, WcStatus};
use vrdma_it::protocol::Command;
use vrdma_it::{connect, pattern, poll_for, poll_n, poll_one, wait_state, DaemonProc, PeerProc, Side, WAIT};

const ON: &str = "[direct]\nenabled = true\n";

fn pair(d: &DaemonProc, mr_len: usize) -> Result<(Side, Side)> {
    let a = Side::new(&d.context()?, mr_len)?;
    let b = Side::new(&d.context()?, mr_len)?;
    connect(&a, &b)?;
    Ok((a, b))
}

fn carried(s: &Side) -> u64 {
    s.qp.direct_stats().0
}

#[test]
fn writes_carry_the_bytes_and_complete() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    let data = pattern(4096, 1);
    a.mr.write(0, &data)?;
    // 8 bytes, 4 KiB from two SGEs, and inline bytes.
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr() + 100, b.mr.rkey())?.signaled()])?;
    let two = [a.mr.sge(0, 1000)?, a.mr.sge(1000, 3096)?];
    a.qp.post_send(&[wr::rdma_write(2, &two, b.mr.addr() + 8192, b.mr.rkey())?.signaled()])?;
    let mut inline = wr::rdma_write(3, &[], b.mr.addr() + 20_000, b.mr.rkey())?.signaled();
    inline = inline.inline(b"inline!!")?;
    a.qp.post_send(&[inline])?;
    let wcs = poll_n(&a.cq, 3, WAIT)?;
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.qp_num),
            (i as u64 + 1, WcStatus::Success, WcOpcode::RdmaWrite, a.qp.qpn())
        );
    }
    assert_eq!(carried(&a), 3, "the writes took the direct path");
    let mut got = vec![0u8; 4096];
    b.mr.read(100, &mut got[..8])?;
    assert_eq!(got[..8], data[..8]);
    b.mr.read(8192, &mut got)?;
    assert!(got == data);
    let mut s = [0u8; 8];
    b.mr.read(20_000, &mut s)?;
    assert_eq!(&s, b"inline!!");
    // Nothing for the responder: a write without immediate completes nowhere.
    assert!(b.cq.poll_one()?.is_none());
    Ok(())
}

#[test]
fn an_unsignaled_write_completes_nowhere_and_the_next_signaled_one_does() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 1 << 16)?;
    a.mr.write(0, b"12345678")?;
    a.qp.post_send(&[
        wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?,
        wr::rdma_write(2, &[a.mr.sge(0, 8)?], b.mr.addr() + 8, b.mr.rkey())?.signaled(),
    ])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    assert!(a.cq.poll_one()?.is_none());
    assert_eq!(carried(&a), 2);
    let mut got = [0u8; 16];
    b.mr.read(0, &mut got)?;
    assert_eq!(&got, b"1234567812345678");
    Ok(())
}

#[test]
fn an_engine_write_then_direct_ones_land_in_order() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let len = 2 << 20; // above the direct limit: the engine's
    assert!(len as u64 > vrdma::DIRECT_MAX_RDMA_BYTES);
    let (a, b) = pair(&d, 4 << 20)?;
    a.mr.fill(0, len, 0xee)?;
    a.mr.fill(len, 64, 0x11)?;
    let rkey = b.mr.rkey();
    // One call: the large one to the engine, then small ones over its
    // first bytes, which must land after it.
    a.qp.post_send(&[
        wr::rdma_write(1, &[a.mr.sge(0, len)?], b.mr.addr(), rkey)?.signaled(),
        wr::rdma_write(2, &[a.mr.sge(len, 64)?], b.mr.addr(), rkey)?.signaled(),
        wr::rdma_write(3, &[a.mr.sge(len, 64)?], b.mr.addr() + 4096, rkey)?.signaled(),
    ])?;
    let ids: Vec<u64> = poll_n(&a.cq, 3, WAIT)?.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    let mut got = vec![0u8; 4160];
    b.mr.read(0, &mut got)?;
    assert!(got[..64].iter().all(|&x| x == 0x11) && got[4096..].iter().all(|&x| x == 0x11), "order lost");
    assert!(got[64..4096].iter().all(|&x| x == 0xee));
    // Once the engine's are polled, small writes take the direct path,
    // and a large one after them the engine's again, in order.
    let before = carried(&a);
    a.mr.fill(len, 64, 0x22)?;
    a.qp.post_send(&[
        wr::rdma_write(4, &[a.mr.sge(len, 64)?], b.mr.addr() + 8192, rkey)?.signaled(),
        wr::rdma_write(5, &[a.mr.sge(0, len)?], b.mr.addr(), rkey)?.signaled(),
    ])?;
    let ids: Vec<u64> = poll_n(&a.cq, 2, WAIT)?.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [4, 5]);
    assert_eq!(carried(&a), before + 1);
    b.mr.read(0, &mut got)?;
    assert!(got.iter().all(|&x| x == 0xee));
    Ok(())
}

#[test]
fn bad_bounds_and_keys_are_remote_access_errors_on_both_sides() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    for case in 0..2 {
        let (a, b) = pair(&d, 4096)?;
        a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        poll_one(&a.cq, WAIT)?;
        assert_eq!(carried(&a), 1);
        b.mr.fill(0, 4096, 0x5a)?;
        let bad = match case {
            0 => wr::rdma_write(2, &[a.mr.sge(0, 16)?], b.mr.addr() + 4090, b.mr.rkey())?,
            _ => wr::rdma_write(2, &[a.mr.sge(0, 16)?], b.mr.addr(), b.mr.rkey() ^ 0x5555)?,
        };
        a_bad_write_breaks_both_and_lands_nothing(&a, &b, bad, case)?;
    }
    Ok(())
}

/// Posts `bad` (wr_id 2, a write with bad bounds or key, after one
/// carried write; `b`'s region filled with 0x5a): REM_ACCESS_ERR from the
/// engine, both QPs in ERR, no byte landed, and what follows is flushed,
/// not carried.
fn a_bad_write_breaks_both_and_lands_nothing(
    a: &Side,
    b: &Side,
    bad: vrdma::SendWr,
    case: u32,
) -> Result<()> {
    a.qp.post_send(&[bad.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemAccessErr), "case {case}");
    wait_state(&a.qp, QpState::Err, WAIT)?;
    wait_state(&b.qp, QpState::Err, WAIT)?;
    assert_eq!(carried(a), 1, "the bad write went to the engine");
    assert!(b.mr.to_vec().iter().all(|&x| x == 0x5a), "a byte landed");
    a.qp.post_send(&[wr::rdma_write(3, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::WrFlushErr);
    assert_eq!(carried(a), 1);
    Ok(())
}

#[test]
fn deregistration_revokes_before_it_returns() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    // Memory of b's own, registered and later deregistered while it lives.
    let mut mem = vec![0u8; 8192];
    let ptr = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region (dropped below, before `mem`) and
    // nothing else touches it meanwhile.
    let mr = unsafe { b.pd.register_raw(ptr, mem.len(), vrdma_it::access_all())? };
    let (addr, rkey) = (mr.addr(), mr.rkey());
    a.mr.fill(0, 64, 0x77)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 64)?], addr, rkey)?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 1, "granted and carried");
    drop(mr);
    // SAFETY: the region is gone; `ptr` still addresses `mem`'s bytes,
    // read raw since the daemon no longer reaches them.
    let after = || unsafe { std::slice::from_raw_parts(ptr, 8192).to_vec() };
    let before = after();
    assert!(before[..64].iter().all(|&x| x == 0x77));
    a.mr.fill(0, 64, 0x99)?;
    a.qp.post_send(&[wr::rdma_write(2, &[a.mr.sge(0, 64)?], addr, rkey)?.signaled()])?;
    let wc = poll_one(&a.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemAccessErr));
    assert_eq!(carried(&a), 1);
    assert!(after() == before, "a byte landed after deregistration");
    drop(mem);
    Ok(())
}

#[test]
fn a_killed_peer_breaks_our_qp_and_nothing_hangs() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let me = Side::new(&d.context()?, 1 << 16)?;
    let mut peer = PeerProc::spawn(&d.socket, "tenant", &[])?;
    let h = peer.hello()?;
    peer.call_ok(&Command::Connect { peer: me.endpoint()? })?;
    me.qp.connect(&h.endpoint, vrdma_it::access_all())?;
    me.mr.fill(0, 8, 0x42)?;
    for i in 0..4 {
        me.qp.post_send(&[wr::rdma_write(i, &[me.mr.sge(0, 8)?], h.addr + 8 * i, h.rkey)?.signaled()])?;
        assert_eq!(poll_one(&me.cq, WAIT)?.status, WcStatus::Success);
    }
    assert_eq!(carried(&me), 4, "the writes into the other process were carried directly");
    assert_eq!(peer.read(0, 32)?, vec![0x42; 32]);
    // The peer floods us with direct writes and dies in the middle.
    peer.send(&Command::Flood { remote_addr: me.mr.addr(), rkey: me.mr.rkey(), len: 64, count: 1 << 40 })?;
    std::thread::sleep(std::time::Duration::from_millis(50));
    peer.proc.kill(libc::SIGKILL);
    assert!(!peer.proc.wait_timeout(WAIT)?.success());
    wait_state(&me.qp, QpState::Err, WAIT)?;
    me.qp.post_send(&[wr::rdma_write(9, &[me.mr.sge(0, 8)?], h.addr, h.rkey)?.signaled()])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushErr));
    // Our region can still be deregistered (nothing waits on the dead).
    drop(me);
    Ok(())
}

#[test]
fn another_uid_never_gets_a_grant() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run a peer as another uid");
        return Ok(());
    }
    let d = DaemonProc::start_with_config(ON)?;
    let me = Side::new(&d.context()?, 4096)?;
    let mut peer = PeerProc::spawn_as(&d.socket, "tenant", &[], Some(65534))?;
    let h = peer.hello()?;
    assert_eq!(h.tenant, 65534);
    peer.call_ok(&Command::Fill { offset: 0, data: vec![0x44; 64] })?;
    peer.call_ok(&Command::Connect { peer: me.endpoint()? })?;
    me.qp.to_init(1, vrdma_it::access_all())?;
    me.qp.to_rtr(&h.endpoint, vrdma::Mtu::Mtu4096, 12)?;
    me.qp.to_rts(me.qp.psn(), 4, 1, 7)?;
    me.mr.fill(0, 64, 0xcc)?;
    me.qp.post_send(&[wr::rdma_write(1, &[me.mr.sge(0, 64)?], h.addr, h.rkey)?.signaled()])?;
    let wc = poll_one(&me.cq, WAIT)?;
    assert_ne!(wc.status, WcStatus::Success);
    assert_eq!(me.qp.direct_stats(), (0, false), "a window was granted across uids");
    assert_eq!(peer.read(0, 64)?, vec![0x44; 64]);
    Ok(())
}

#[test]
fn with_the_switch_off_nothing_is_carried() -> Result<()> {
    let d = DaemonProc::start_with_config("[direct]\nenabled = false\n")?;
    let (a, b) = pair(&d, 4096)?;
    a.mr.write(0, b"engine!!")?;
    for i in 0..3 {
        a.qp.post_send(&[wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    }
    assert_eq!(a.qp.direct_stats(), (0, false));
    let mut got = [0u8; 8];
    b.mr.read(0, &mut got)?;
    assert_eq!(&got, b"engine!!");
    Ok(())
}

#[test]
fn carried_writes_hold_their_send_queue_slots_until_a_completion_is_polled() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let a = Side::with(&d.context()?, 4096, 64, vrdma_it::cap(8, 1), None)?;
    let b = Side::with(&d.context()?, 4096, 64, vrdma_it::cap(8, 1), None)?;
    connect(&a, &b)?;
    let n = a.qp.cap().max_send_wr as usize;
    let w = |i: u64| -> Result<vrdma::SendWr> {
        Ok(wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr() + 64, b.mr.rkey())?)
    };
    // n - 1 unsignaled and one signaled: the queue is full until that one
    // completion is polled (the unsignaled ones are freed with it).
    let mut wrs = (0..n as u64 - 1).map(w).collect::<Result<Vec<_>>>()?;
    wrs.push(w(99)?.signaled());
    a.qp.post_send(&wrs)?;
    assert_eq!(carried(&a), n as u64);
    let e = a.qp.post_send(&[w(100)?.signaled()]).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::ENOMEM));
    assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, 99);
    // All free again: a whole queue of signaled ones, then one too many.
    let wrs = (0..n as u64).map(|i| Ok(w(i)?.signaled())).collect::<Result<Vec<_>>>()?;
    a.qp.post_send(&wrs)?;
    let e = a.qp.post_send(&[w(100)?.signaled()]).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM);
    // One polled frees one slot, not more.
    assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, 0);
    a.qp.post_send(&[w(101)?.signaled()])?;
    assert_eq!(a.qp.post_send(&[w(102)?.signaled()]).unwrap_err().errno(), libc::ENOMEM);
    assert_eq!(carried(&a), 2 * n as u64 + 1);
    assert_eq!(poll_n(&a.cq, n, WAIT)?.len(), n);
    assert_eq!(a.qp.state(), QpState::Rts);
    Ok(())
}

#[test]
fn a_carried_completion_that_would_overrun_the_cq_is_the_engines_cq_error() -> Result<()> {
    use vrdma::{AsyncEvent, AsyncEventType};
    let d = DaemonProc::start_with_config(ON)?;
    let ctx = d.context()?;
    let a = Side::with(&ctx, 4096, 4, vrdma_it::cap(16, 1), None)?;
    let b = Side::with(&d.context()?, 4096, 64, vrdma_it::cap(16, 1), None)?;
    connect(&a, &b)?;
    let depth = a.cq.depth() as usize;
    let wrs: Vec<_> = (0..depth as u64 + 2)
        .map(|i| Ok(wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr() + 64, b.mr.rkey())?.signaled()))
        .collect::<Result<_>>()?;
    a.qp.post_send(&wrs)?;
    // The CQ's depth of them were carried; the next found no room and
    // went to the engine, which overran the CQ as it always does.
    assert_eq!(carried(&a), depth as u64);
    let mut events = vec![vrdma_it::async_event(&ctx, WAIT)?, vrdma_it::async_event(&ctx, WAIT)?];
    events.sort_by_key(|e| e.event_type.raw());
    assert_eq!(
        events,
        [
            AsyncEvent { event_type: AsyncEventType::CqErr, element: a.cq.cqn() },
            AsyncEvent { event_type: AsyncEventType::QpFatal, element: a.qp.qpn() },
        ]
    );
    wait_state(&a.qp, QpState::Err, WAIT)?;
    let got = vrdma_it::poll_for(&a.cq, std::time::Duration::from_millis(50))?;
    assert_eq!(got.len(), depth, "{got:?}");
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    Ok(())
}
