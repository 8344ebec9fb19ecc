//! SEND and SEND with immediate on the direct path: the requester claims
//! the peer's receive and copies the message into its SGEs (regions of
//! the peer's PD with local write, granted), completing the receive into
//! the peer QP's inbox. Each scenario runs on a daemon with the switch on
//! and on one with it off, and the completions and bytes must be equal.

use vrdma::{WcFlags, WorkCompletion};

use super::*;

const OFF: &str = "[direct]\nenabled = false\n";

/// What a completion says, the QP numbers as who they are.
type Seen = (u64, WcStatus, WcOpcode, u32, u32, bool, WcFlags);

fn seen(wc: &WorkCompletion, src: &Side) -> Seen {
    let imm = if wc.wc_flags.contains(WcFlags::WITH_IMM) { wc.imm_data } else { 0 };
    (wc.wr_id, wc.status, wc.opcode, wc.byte_len, imm, wc.src_qp == src.qp.qpn(), wc.wc_flags)
}

/// Runs `f` on a daemon with the switch on and one with it off; returns
/// both results and the on side's carried count.
fn both<T: PartialEq + std::fmt::Debug>(f: impl Fn(&Side, &Side) -> Result<T>) -> Result<(T, u64)> {
    let on = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&on, 1 << 21)?;
    let got = f(&a, &b)?;
    let n = carried(&a);
    let off = DaemonProc::start_with_config(OFF)?;
    let (x, y) = pair(&off, 1 << 21)?;
    let want = f(&x, &y)?;
    assert_eq!(carried(&x), 0);
    assert_eq!(got, want, "the direct path's completions or bytes differ from the engine's");
    Ok((got, n))
}

#[test]
fn sends_land_and_complete_as_on_the_engine_path() -> Result<()> {
    let (_, n) = both(|a, b| {
        let data = pattern(4096, 5);
        a.mr.write(0, &data)?;
        b.mr.fill(0, 1 << 16, 0)?;
        // 8 B into one SGE; 4 KiB from two SGEs into three; inline with
        // immediate; 100 B into a 64 + 64 receive.
        b.qp.post_recv(&[wr::recv(10, &[b.mr.sge(0, 8)?])?])?;
        b.qp.post_recv(&[wr::recv(
            11,
            &[b.mr.sge(100, 1000)?, b.mr.sge(5000, 96)?, b.mr.sge(9000, 4000)?],
        )?])?;
        b.qp.post_recv(&[wr::recv(12, &[b.mr.sge(20_000, 64)?])?])?;
        b.qp.post_recv(&[wr::recv(13, &[b.mr.sge(30_000, 64)?, b.mr.sge(40_000, 64)?])?])?;
        let two = [a.mr.sge(0, 1000)?, a.mr.sge(1000, 3096)?];
        let inline = wr::send(3, &[])?.with_imm(0xabcd).signaled().inline(b"inline!!")?;
        a.qp.post_send(&[
            wr::send(1, &[a.mr.sge(0, 8)?])?.signaled(),
            wr::send(2, &two)?.signaled(),
            inline,
            wr::send(4, &[a.mr.sge(0, 100)?])?.with_imm(7).signaled(),
        ])?;
        let req: Vec<_> = poll_n(&a.cq, 4, WAIT)?.iter().map(|w| seen(w, b)).collect();
        let resp: Vec<_> = poll_n(&b.cq, 4, WAIT)?.iter().map(|w| seen(w, a)).collect();
        assert!(resp.iter().all(|r| r.1 == WcStatus::Success), "{resp:?}");
        let mut bytes = vec![0u8; 1 << 16];
        b.mr.read(0, &mut bytes)?;
        Ok((req, resp, bytes))
    })?;
    assert_eq!(n, 4, "the sends took the direct path");
    Ok(())
}

#[test]
fn direct_and_engine_sends_keep_their_order() -> Result<()> {
    let big = 1 << 20; // above the direct limit: the engine's
    let (got, n) = both(|a, b| {
        a.mr.fill(0, big, 0x11)?;
        for id in 0..6 {
            b.qp.post_recv(&[wr::recv(id, &[b.mr.sge(0, big)?])?])?;
        }
        // Small, large, small in one call; then small ones after it.
        a.qp.post_send(&[
            wr::send(0, &[a.mr.sge(0, 8)?])?.signaled(),
            wr::send(1, &[a.mr.sge(0, big)?])?.signaled(),
            wr::send(2, &[a.mr.sge(0, 8)?])?.signaled(),
        ])?;
        assert_eq!(poll_n(&a.cq, 3, WAIT)?.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [0, 1, 2]);
        for id in 3..6 {
            a.qp.post_send(&[wr::send(id, &[a.mr.sge(0, 16)?])?.signaled()])?;
            assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, id);
        }
        let mut got: Vec<_> =
            poll_n(&b.cq, 6, WAIT)?.iter().map(|w| (w.wr_id, w.byte_len, w.status)).collect();
        // The peer polled the engine's completions: direct again.
        b.qp.post_recv(&[wr::recv(6, &[b.mr.sge(0, 8)?])?])?;
        a.qp.post_send(&[wr::send(6, &[a.mr.sge(0, 8)?])?.signaled()])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, 6);
        got.extend(poll_n(&b.cq, 1, WAIT)?.iter().map(|w| (w.wr_id, w.byte_len, w.status)));
        Ok(got)
    })?;
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 6]);
    // 0 carried; 1 and 2 the engine's (one call); 3..5 the engine's too,
    // since the peer had not polled the engine's receive completions of
    // 1 and 2 (the order rule); 6 carried.
    assert_eq!(n, 2);
    Ok(())
}

#[test]
fn a_send_larger_than_its_receive_is_the_engines_error() -> Result<()> {
    let (got, n) = both(|a, b| {
        b.qp.post_recv(&[wr::recv(1, &[b.mr.sge(0, 8)?])?])?;
        b.qp.post_recv(&[wr::recv(2, &[b.mr.sge(0, 8)?])?])?;
        a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
        let first = seen(&poll_one(&a.cq, WAIT)?, b);
        a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 9)?])?.signaled()])?;
        let req = seen(&poll_one(&a.cq, WAIT)?, b);
        let resp: Vec<_> = poll_n(&b.cq, 2, WAIT)?.iter().map(|w| seen(w, a)).collect();
        wait_state(&b.qp, QpState::Err, WAIT)?;
        Ok((first, req, resp))
    })?;
    assert_eq!(got.1 .1, WcStatus::RemInvReqErr);
    assert_eq!(got.2[1].1, WcStatus::LocLenErr);
    assert_eq!(n, 1, "the one that fits was carried, the other left to the engine");
    Ok(())
}

#[test]
fn a_receive_with_a_bad_lkey_is_the_engines_protection_error() -> Result<()> {
    let (got, n) = both(|a, b| {
        let mut s = b.mr.sge(0, 8)?;
        s.lkey = a.mr.lkey(); // a region of another PD
        b.qp.post_recv(&[wr::recv(1, &[s])?])?;
        a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
        let req = seen(&poll_one(&a.cq, WAIT)?, b);
        let resp = seen(&poll_one(&b.cq, WAIT)?, a);
        Ok((req, resp))
    })?;
    assert_eq!(got.1 .1, WcStatus::LocProtErr);
    assert_eq!(n, 0);
    Ok(())
}

#[test]
fn deregistering_the_receive_buffer_revokes_before_it_returns() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let mut mem = vec![0u8; 8192];
    let ptr = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region (dropped below, before `mem`) and
    // nothing else touches it meanwhile.
    let mr = unsafe { b.pd.register_raw(ptr, mem.len(), vrdma_it::access_all())? };
    a.mr.fill(0, 64, 0x77)?;
    b.qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)?])?])?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 64)?])?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&b.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 1, "granted and carried");
    b.qp.post_recv(&[wr::recv(2, &[mr.sge(0, 64)?])?])?;
    drop(mr);
    // SAFETY: the region is gone; `ptr` still addresses `mem`'s bytes,
    // read raw since the daemon no longer reaches them.
    let after = || unsafe { std::slice::from_raw_parts(ptr, 8192).to_vec() };
    let before = after();
    assert!(before[..64].iter().all(|&x| x == 0x77));
    a.mr.fill(0, 64, 0x99)?;
    a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 64)?])?.signaled()])?;
    let wc = poll_one(&b.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::LocProtErr));
    assert_eq!(carried(&a), 1);
    assert!(after() == before, "a byte landed after deregistration");
    drop(mem);
    Ok(())
}

#[test]
fn without_a_receive_the_send_waits_on_the_engines_rnr() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(a.cq.poll_one()?.is_none(), "completed without a receive");
    b.qp.post_recv(&[wr::recv(1, &[b.mr.sge(0, 8)?])?])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&b.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(carried(&a), 0);
    b.qp.post_recv(&[wr::recv(2, &[b.mr.sge(0, 8)?])?])?;
    a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 8)?])?.signaled()])?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, 2);
    assert_eq!(carried(&a), 1, "carried once a receive is there");
    Ok(())
}

/// A receiver that reposts each receive as it polls is often a moment
/// behind a direct-path sender; the sender waits for it
/// (`RECV_WAIT`) instead of handing the SEND to the engine, whose order
/// rule would keep the QP's next sends there. Each message arrives once,
/// in order, with its bytes, and (nearly) all were carried: before the
/// wait, a quarter to half of them went to the engine (its sender finds the
/// one receive not yet posted again).
#[test]
fn a_sender_ahead_of_its_receiver_waits_for_the_receive_and_stays_direct() -> Result<()> {
    const N: u64 = 2000;
    const LEN: usize = 4096;
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, LEN)?;
    // One receive at a time, reposted as soon as its message was read.
    b.qp.post_recv(&[wr::recv(0, &[b.mr.sge(0, LEN)?])?])?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let received = std::thread::scope(|sc| -> Result<u64> {
        let rx = sc.spawn(|| -> Result<u64> {
            let mut got = 0u64;
            while got < N && std::time::Instant::now() < deadline {
                let Some(wc) = b.cq.poll_one()? else { continue };
                anyhow::ensure!(wc.status == WcStatus::Success && wc.wr_id == got, "{wc:?} as message {got}");
                let mut head = [0u8; 8];
                b.mr.read(0, &mut head)?;
                anyhow::ensure!(u64::from_le_bytes(head) == got, "message {got}'s bytes");
                if got + 1 < N {
                    b.qp.post_recv(&[wr::recv(got + 1, &[b.mr.sge(0, LEN)?])?])?;
                }
                got += 1;
            }
            Ok(got)
        });
        for i in 0..N {
            a.mr.write(0, &i.to_le_bytes())?;
            a.qp.post_send(&[wr::send(i, &[a.mr.sge(0, LEN)?])?.signaled()])?;
            let wc = poll_one(&a.cq, WAIT)?;
            anyhow::ensure!((wc.wr_id, wc.status) == (i, WcStatus::Success), "{wc:?}");
        }
        rx.join().expect("receiver thread")
    })?;
    assert_eq!(received, N);
    let n = carried(&a);
    eprintln!("carried {n} of {N}");
    assert!(n >= N * 9 / 10, "only {n} of {N} sends carried");
    Ok(())
}
