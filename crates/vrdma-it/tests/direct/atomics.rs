//! Atomics on the direct path: compare-and-swap and fetch-and-add on the
//! granted word, with the engine's own word operations, so that they stay
//! atomic against the engine's atomics on the same word.

use std::time::{Duration, Instant};

use super::*;

#[test]
fn atomics_carry_and_return_the_old_value() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    b.mr.write_u64(64, 10)?;
    let (addr, rkey) = (b.mr.addr() + 64, b.mr.rkey());
    a.qp.post_send(&[
        wr::fetch_add(1, a.mr.sge(0, 8)?, addr, rkey, 5).signaled(),
        wr::cmp_swap(2, a.mr.sge(8, 8)?, addr, rkey, 15, 100).signaled(),
        wr::cmp_swap(3, a.mr.sge(16, 8)?, addr, rkey, 15, 200).signaled(),
        wr::fetch_add(4, a.mr.sge(24, 8)?, addr, rkey, u64::MAX).signaled(),
    ])?;
    let wcs = poll_n(&a.cq, 4, WAIT)?;
    let ops = [WcOpcode::FetchAdd, WcOpcode::CompSwap, WcOpcode::CompSwap, WcOpcode::FetchAdd];
    for (i, (wc, op)) in wcs.iter().zip(ops).enumerate() {
        assert_eq!((wc.wr_id, wc.status, wc.opcode, wc.byte_len), (i as u64 + 1, WcStatus::Success, op, 8));
    }
    assert_eq!(carried(&a), 4, "the atomics took the direct path");
    // Old values: 10, 15 (swapped to 100), 100 (no swap), 100 (- 1).
    let olds = (0..4).map(|i| a.mr.read_u64(8 * i)).collect::<vrdma::Result<Vec<_>>>()?;
    assert_eq!(olds, [10, 15, 100, 100]);
    assert_eq!(b.mr.read_u64(64)?, 99);
    Ok(())
}

#[test]
fn misaligned_or_unpermitted_atomics_are_the_engines_errors() -> Result<()> {
    let d = DaemonProc::start_with_config(ON)?;
    for case in 0..2 {
        let (a, b) = pair(&d, 4096)?;
        let no_atomic =
            b.pd.alloc_mr(4096, vrdma::AccessFlags::LOCAL_WRITE | vrdma::AccessFlags::REMOTE_WRITE)?;
        a.qp.post_send(&[wr::fetch_add(1, a.mr.sge(0, 8)?, b.mr.addr(), b.mr.rkey(), 1).signaled()])?;
        a.qp.post_send(&[
            wr::rdma_write(2, &[a.mr.sge(0, 8)?], no_atomic.addr(), no_atomic.rkey())?.signaled()
        ])?;
        assert_eq!(poll_n(&a.cq, 2, WAIT)?.iter().filter(|w| w.status == WcStatus::Success).count(), 2);
        assert_eq!(carried(&a), 2);
        let (bad, want) = match case {
            0 => (wr::fetch_add(3, a.mr.sge(0, 8)?, b.mr.addr() + 4, b.mr.rkey(), 1), WcStatus::RemInvReqErr),
            _ => (
                wr::fetch_add(3, a.mr.sge(0, 8)?, no_atomic.addr(), no_atomic.rkey(), 1),
                WcStatus::RemAccessErr,
            ),
        };
        a.qp.post_send(&[bad.signaled()])?;
        let wc = poll_one(&a.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status), (3, want), "case {case}");
        assert_eq!(carried(&a), 2, "the bad atomic went to the engine");
        wait_state(&a.qp, QpState::Err, WAIT)?;
        assert_eq!(b.mr.read_u64(0)?, 1, "only the first add applied");
    }
    Ok(())
}

/// Posts `w`; on the engine path if `engine` (after an unsignaled empty
/// RDMA write in the same call, which the direct path leaves to the
/// engine, and every WR after it in the call with it).
fn post(s: &Side, engine: bool, w: vrdma::SendWr, (addr, rkey): (u64, u32)) -> Result<()> {
    if engine {
        s.qp.post_send(&[wr::rdma_write(u64::MAX, &[], addr, rkey)?, w])?;
    } else {
        s.qp.post_send(&[w])?;
    }
    Ok(())
}

/// `n` fetch-and-adds of 1 on the word, one at a time (on the engine path
/// if `engine`); the old values.
fn adds(s: &Side, engine: bool, (addr, rkey): (u64, u32), n: u64) -> Result<Vec<u64>> {
    let end = Instant::now() + Duration::from_secs(60);
    let mut olds = Vec::with_capacity(n as usize);
    for i in 0..n {
        anyhow::ensure!(Instant::now() < end, "adds took too long");
        post(s, engine, wr::fetch_add(i, s.mr.sge(0, 8)?, addr, rkey, 1).signaled(), (addr, rkey))?;
        let wc = poll_one(&s.cq, WAIT)?;
        anyhow::ensure!((wc.wr_id, wc.status) == (i, WcStatus::Success), "{wc:?}");
        olds.push(s.mr.read_u64(0)?);
    }
    Ok(olds)
}

/// Increments the word `n` times by compare-and-swap (each guess the last
/// old value seen); returns how many swaps failed.
fn cas_increments(s: &Side, engine: bool, (addr, rkey): (u64, u32), n: u64) -> Result<u64> {
    let end = Instant::now() + Duration::from_secs(60);
    let (mut guess, mut done, mut failed, mut id) = (0u64, 0u64, 0u64, 0u64);
    while done < n {
        anyhow::ensure!(Instant::now() < end, "compare-and-swaps took too long");
        let w = wr::cmp_swap(id, s.mr.sge(0, 8)?, addr, rkey, guess, guess + 1).signaled();
        post(s, engine, w, (addr, rkey))?;
        let wc = poll_one(&s.cq, WAIT)?;
        anyhow::ensure!((wc.wr_id, wc.status) == (id, WcStatus::Success), "{wc:?}");
        id += 1;
        let old = s.mr.read_u64(0)?;
        if old == guess {
            done += 1;
            guess += 1;
        } else {
            failed += 1;
            guess = old;
        }
    }
    Ok(failed)
}

#[test]
fn direct_and_engine_atomics_on_one_word_count_exactly() -> Result<()> {
    const N: u64 = 3000;
    let d = DaemonProc::start_with_config(ON)?;
    let target = Side::new(&d.context()?, 4096)?;
    // One issuer on the direct path; the other posts each atomic behind
    // an empty write, which keeps it on the engine path.
    let direct = Side::new(&d.context()?, 4096)?;
    let engine = Side::new(&d.context()?, 4096)?;
    let second = target.another_qp(vrdma_it::cap(256, 4))?;
    connect(&direct, &target)?;
    engine.qp.connect(&second.endpoint(&target.ctx)?, vrdma_it::access_all())?;
    second.connect(&engine.endpoint()?, vrdma_it::access_all())?;
    let word = (target.mr.addr(), target.mr.rkey());
    // Fetch-and-adds from both at once: every old value once.
    let (x, y) = std::thread::scope(|sc| {
        let t = sc.spawn(|| adds(&engine, true, word, N));
        let x = adds(&direct, false, word, N);
        (x, t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the engine issuer panicked"))))
    });
    let (x, y) = (x?, y?);
    assert_eq!(carried(&direct), N, "the direct issuer's adds were carried");
    assert_eq!(carried(&engine), 0, "the engine issuer's took the engine");
    assert_eq!(target.mr.read_u64(0)?, 2 * N);
    let mut all: Vec<u64> = x.into_iter().chain(y).collect();
    all.sort_unstable();
    assert!(all.iter().copied().eq(0..2 * N), "an add was lost or applied twice");
    // Compare-and-swap increments from both at once: none lost.
    let (f1, f2) = std::thread::scope(|sc| {
        let t = sc.spawn(|| cas_increments(&engine, true, word, N));
        let f = cas_increments(&direct, false, word, N);
        (f, t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the engine issuer panicked"))))
    });
    let (f1, f2) = (f1?, f2?);
    assert_eq!(target.mr.read_u64(0)?, 4 * N, "{f1} and {f2} swaps failed");
    assert_eq!(carried(&engine), 0);
    Ok(())
}

#[test]
fn adds_racing_a_deregistration_all_apply_before_it_returns() -> Result<()> {
    const MAX_ADDS: u64 = 1_000_000;
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = pair(&d, 4096)?;
    let mut mem = vec![0u64; 512];
    let ptr = mem.as_mut_ptr();
    // SAFETY: `mem` outlives the region and every atomic on it (the
    // issuer is joined before `mem` drops); read below only atomically.
    let mr = unsafe { b.pd.register_raw(ptr.cast(), 4096, vrdma_it::access_all())? };
    let (addr, rkey) = (mr.addr(), mr.rkey());
    // SAFETY: `ptr` is 8-aligned and lives as long as `mem`; every access
    // to the word (the engine's, the direct path's, this) is atomic.
    let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
    let (last, ok, at_return) = std::thread::scope(|sc| -> Result<_> {
        let issuer = sc.spawn(|| -> Result<(WcStatus, u64)> {
            let end = Instant::now() + Duration::from_secs(30);
            for i in 0..MAX_ADDS {
                anyhow::ensure!(Instant::now() < end, "the adds never failed");
                a.qp.post_send(&[wr::fetch_add(i, a.mr.sge(0, 8)?, addr, rkey, 1).signaled()])?;
                let wc = poll_one(&a.cq, WAIT)?;
                if wc.status != WcStatus::Success {
                    return Ok((wc.status, i));
                }
            }
            anyhow::bail!("{MAX_ADDS} adds and none failed")
        });
        vrdma_it::wait_until(WAIT, "direct adds", || carried(&a) >= 200)?;
        drop(mr);
        let at_return = word.load(std::sync::atomic::Ordering::SeqCst);
        let (last, ok) = issuer.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the issuer panicked")))?;
        Ok((last, ok, at_return))
    })?;
    assert_eq!(last, WcStatus::RemAccessErr);
    let end = word.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(end, at_return, "an add applied after deregistration returned");
    assert_eq!(end, ok, "every successful add applied once, no failed one");
    drop(mem);
    Ok(())
}
