//! A sender stopped (SIGSTOP) in the middle of its direct-path sends into
//! us (issue 17, item 2). What hardware implies: a stopped sender just
//! stops sending; the receiver sees nothing more, stays as responsive as
//! ever (it polls, its other QPs work), and after SIGCONT every message
//! arrives, once and in order. A sender killed while stopped is a dead
//! peer: our QP goes to ERR with its receives flushed.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpState, WcFlags, WcStatus};
use vrdma_it::protocol::{Command, Said};
use vrdma_it::{access_all, cap, poll_one, wait_state, DaemonProc, PeerProc, Side, WAIT};

use super::{carried, pair, ON};

const LEN: usize = 64;
const DEPTH: u64 = 128;

/// The receiving side: reposts each receive it reaps and records the
/// sequence numbers (immediates) in arrival order.
struct Receiver {
    side: Side,
    got: Vec<u32>,
}

impl Receiver {
    fn post(&self, wr_id: u64) -> Result<()> {
        self.side.qp.post_recv(&[wr::recv(wr_id, &[self.side.mr.sge(0, LEN)?])?])?;
        Ok(())
    }

    /// Polls once, reposting what completed; how many completed.
    fn poll(&mut self) -> Result<usize> {
        let mut wcs = vrdma::wc_buffer(32);
        let n = self.side.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success || !wc.wc_flags.contains(WcFlags::WITH_IMM) {
                bail!("a receive completed with {wc:?}");
            }
            self.got.push(wc.imm_data);
            self.post(wc.wr_id)?;
        }
        Ok(n)
    }

    /// Polls until `n` messages have arrived, within `limit`.
    fn until(&mut self, n: usize, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        while self.got.len() < n {
            if self.poll()? == 0 {
                if Instant::now() > end {
                    bail!("only {} of {n} messages arrived within {limit:?}", self.got.len());
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Polls for `d`, however much arrives.
    fn for_a_while(&mut self, d: Duration) -> Result<()> {
        let end = Instant::now() + d;
        while Instant::now() < end {
            if self.poll()? == 0 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}

/// A tenant peer process connected to a fresh receiver of ours, with
/// `DEPTH` receives posted.
fn connected(d: &DaemonProc) -> Result<(Receiver, PeerProc)> {
    let side = Side::with(&d.context()?, 4096, 1024, cap(DEPTH as u32, 1), None)?;
    let mut peer = PeerProc::spawn(&d.socket, "tenant", &[])?;
    let h = peer.hello()?;
    peer.call_ok(&Command::Connect { peer: side.endpoint()? })?;
    side.qp.connect(&h.endpoint, access_all())?;
    let me = Receiver { side, got: Vec::new() };
    for i in 0..DEPTH {
        me.post(i)?;
    }
    Ok((me, peer))
}

/// Our other QPs (a pair in this process) move data meanwhile.
fn others_work(a: &Side, b: &Side, round: u64) -> Result<()> {
    a.mr.write(0, &round.to_le_bytes())?;
    b.qp.post_recv(&[wr::recv(round, &[b.mr.sge(0, 8)?])?])?;
    a.qp.post_send(&[wr::send(round, &[a.mr.sge(0, 8)?])?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (round, WcStatus::Success));
    let mut got = [0u8; 8];
    b.mr.read(0, &mut got)?;
    assert_eq!(u64::from_le_bytes(got), round);
    Ok(())
}

/// Checks what our QP's flush left in the CQ: every receive still posted
/// flushed, once. One may come first as a success: the message the sender
/// had placed, and made a success, when it stopped (or died) before it
/// published that completion, which the daemon's flush then published as
/// it stood. That message is the next one in order; it is recorded.
fn check_flushed(me: &mut Receiver, flushed: &[vrdma::WorkCompletion]) -> Result<()> {
    let rest = match flushed.first() {
        Some(wc) if wc.status == WcStatus::Success => {
            let next = me.got.len() as u32;
            if !wc.wc_flags.contains(WcFlags::WITH_IMM) || wc.imm_data != next {
                bail!("a success in the flush that is not message {next}: {wc:?}");
            }
            me.got.push(wc.imm_data);
            &flushed[1..]
        }
        _ => flushed,
    };
    if let Some(wc) = rest.iter().find(|w| w.status != WcStatus::WrFlushErr) {
        bail!("a receive completed with {wc:?} in the flush: {flushed:?}");
    }
    let mut ids: Vec<u64> = flushed.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    if ids != (0..DEPTH).collect::<Vec<_>>() {
        bail!("not each receive once: {ids:?}");
    }
    Ok(())
}

/// The peer's answers up to the end of its flood.
fn flood_done(peer: &PeerProc) -> Result<()> {
    loop {
        match peer.recv::<Said>(WAIT)? {
            Said::Flooding => continue,
            Said::Ok => return Ok(()),
            other => bail!("the flood ended with {other:?}"),
        }
    }
}

#[test]
fn a_stopped_sender_stops_and_resumes_with_nothing_lost_or_repeated() -> Result<()> {
    const N: u64 = 20_000;
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let (mut me, mut peer) = connected(&d)?;
    peer.send(&Command::FloodSendSeq { len: LEN, count: N })?;
    me.until(2_000, WAIT)?;
    peer.proc.stop(WAIT)?;
    // What was in flight when it stopped may still land; then nothing.
    me.for_a_while(Duration::from_millis(200))?;
    let at_stop = me.got.len();
    for round in 0..20 {
        others_work(&a, &b, round)?;
    }
    me.for_a_while(Duration::from_millis(300))?;
    assert_eq!(me.got.len(), at_stop, "messages of a stopped sender kept arriving");
    assert!((at_stop as u64) < N, "the sender finished before it was stopped");
    assert_eq!(me.side.qp.state(), QpState::Rts, "a stopped peer is not a dead one");
    peer.proc.kill(libc::SIGCONT);
    me.until(N as usize, Duration::from_secs(60))?;
    flood_done(&peer)?;
    me.for_a_while(Duration::from_millis(50))?;
    let want: Vec<u32> = (0..N as u32).collect();
    assert!(me.got == want, "not every message once and in order: {} arrived", me.got.len());
    let carried = match peer.call(&Command::Carried)? {
        Said::Carried(n) => n,
        other => bail!("peer answered {other:?} to Carried"),
    };
    assert!(carried > 0, "no send of the flood took the direct path");
    assert!(others_work(&a, &b, 99).is_ok());
    assert!(super::carried(&a) > 0, "our own pair took the direct path too");
    Ok(())
}

#[test]
fn a_sender_killed_while_stopped_breaks_our_qp_and_flushes() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let (mut me, mut peer) = connected(&d)?;
    peer.send(&Command::FloodSendSeq { len: LEN, count: 1 << 30 })?;
    me.until(1_000, WAIT)?;
    peer.proc.stop(WAIT)?;
    me.for_a_while(Duration::from_millis(100))?;
    peer.proc.kill(libc::SIGKILL);
    assert!(!peer.proc.wait_timeout(WAIT)?.success());
    wait_state(&me.side.qp, QpState::Err, WAIT)?;
    // Every message that arrived did so once and in order; every receive
    // still posted is flushed; a new request is flushed.
    let flushed = vrdma_it::poll_n(&me.side.cq, DEPTH as usize, WAIT)?;
    check_flushed(&mut me, &flushed)?;
    let want: Vec<u32> = (0..me.got.len() as u32).collect();
    assert!(me.got == want, "messages out of order or repeated before the kill");
    me.side.qp.post_send(&[wr::send(7, &[me.side.mr.sge(0, 8)?])?.signaled()])?;
    let wc = poll_one(&me.side.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushErr));
    assert!(vrdma_it::poll_for(&me.side.cq, Duration::from_millis(50))?.is_empty(), "a completion twice");
    others_work(&a, &b, 1)?;
    assert!(carried(&a) > 0);
    Ok(())
}

/// The symmetric case: our QP goes to ERR (we move it there) while the
/// sender is stopped, perhaps between its claim of one of our receives and
/// its push of the completion; every posted receive is flushed once (that
/// one by the daemon, from the completion the sender staged), and the
/// sender, continued, completes nothing a second time.
#[test]
fn a_sender_stopped_while_we_flush_completes_nothing_twice_when_continued() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (mut me, mut peer) = connected(&d)?;
    peer.send(&Command::FloodSendSeq { len: LEN, count: 1 << 30 })?;
    me.until(1_000, WAIT)?;
    peer.proc.stop(WAIT)?;
    me.for_a_while(Duration::from_millis(100))?;
    let want: Vec<u32> = (0..me.got.len() as u32).collect();
    assert!(me.got == want, "messages out of order or repeated before the stop");
    let err = vrdma::QpAttr { qp_state: QpState::Err, ..Default::default() };
    me.side.qp.modify(&err, vrdma::QpAttrMask::STATE)?;
    let flushed = vrdma_it::poll_n(&me.side.cq, DEPTH as usize, WAIT)?;
    check_flushed(&mut me, &flushed)?;
    peer.proc.kill(libc::SIGCONT);
    let late = vrdma_it::poll_for(&me.side.cq, Duration::from_millis(200))?;
    assert!(late.is_empty(), "a completion twice after the sender continued: {late:?}");
    Ok(())
}
