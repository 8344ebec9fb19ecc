//! Atomics on one word from several QPs at once, some on another host
//! (the TCP transport, the remote responder) and one on the word's own
//! host (the shared-memory path): every operation applies exactly once
//! and returns the value it replaced, so the old values of all the adds
//! are distinct and together exactly `0..total`, and the word ends at
//! `total`. That holds too when requests are sent again (the word's
//! daemon stalled past the requesters' ACK timeout): a duplicate atomic is
//! answered with the first answer, never executed twice.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{Mtu, WcOpcode, WcStatus};
use vrdma_core::hca::Path;
use vrdma_it::{access_all, cap, poll_one, wait_until, Side, TwoHosts, WAIT};

/// QPs on host A, each connected to a QP on host B.
const REMOTE_QPS: usize = 3;
/// Atomics each QP keeps in flight: several, within the QP's
/// `max_rd_atomic` (16).
const IN_FLIGHT: u64 = 8;
/// How long one QP's whole run may take.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// The word on host B and the QPs that issue atomics on it: `REMOTE_QPS`
/// on host A and one on B, each connected to a QP of B in the word's PD.
/// Fields drop in order: the issuers, the responders, then the daemons.
struct Setup {
    /// The issuing sides, each with a region for its results; the last
    /// is on host B.
    issuers: Vec<Side>,
    _responders: Vec<vrdma::QueuePair>,
    /// The word's region (at offset 0), its PD and the first responder.
    target: Side,
    hosts: TwoHosts,
}

impl Setup {
    /// `timeout`: the local ACK timeout exponent of the issuers on A.
    fn start(results: usize, timeout: u8) -> Result<Setup> {
        let hosts = TwoHosts::start(true)?;
        let target = Side::new(&hosts.b.context()?, 4096)?;
        let mut responders = Vec::new();
        let mut issuers = Vec::new();
        for i in 0..=REMOTE_QPS {
            let local = i == REMOTE_QPS;
            let host = if local { &hosts.b } else { &hosts.a };
            let s = Side::with(&host.context()?, results * 8, 1024, cap(64, 1), None)?;
            let r = if i == 0 { None } else { Some(target.another_qp(cap(64, 1))?) };
            let (r_qp, r_ep) = match &r {
                Some(q) => (q, q.endpoint(&target.ctx)?),
                None => (&target.qp, target.endpoint()?),
            };
            s.qp.to_init(1, access_all())?;
            s.qp.to_rtr(&r_ep, Mtu::Mtu4096, 12)?;
            s.qp.to_rts(s.qp.psn(), if local { 14 } else { timeout }, 7, 7)?;
            r_qp.connect(&s.endpoint()?, access_all())?;
            responders.extend(r);
            issuers.push(s);
        }
        // The paths are the ones this test is about.
        for (i, s) in issuers.iter().enumerate() {
            let st = s.ctx.stat()?;
            let path = st.qps.iter().find(|q| q.qpn == s.qp.qpn()).map(|q| q.path);
            if i == REMOTE_QPS {
                assert_eq!(path, Some(Path::SharedMemory), "{st:?}");
            } else {
                assert!(matches!(path, Some(Path::Link(_))), "{st:?}");
            }
        }
        Ok(Setup { issuers, _responders: responders, target, hosts })
    }

    fn word(&self) -> (u64, u32) {
        (self.target.mr.addr(), self.target.mr.rkey())
    }
}

/// Runs `f` for every issuer on its own thread, all released at once, and
/// `meanwhile` on this one; returns what each `f` returned. (Every wait
/// in `f` and `meanwhile` is bounded, so the joins are.)
fn run<T: Send>(
    issuers: &[Side],
    f: impl Fn(&Side) -> Result<T> + Sync,
    meanwhile: impl FnOnce() -> Result<()>,
) -> Result<Vec<T>> {
    let go = Barrier::new(issuers.len() + 1);
    std::thread::scope(|sc| {
        let threads: Vec<_> = issuers
            .iter()
            .map(|s| {
                let (go, f) = (&go, &f);
                sc.spawn(move || {
                    go.wait();
                    f(s)
                })
            })
            .collect();
        go.wait();
        let m = meanwhile();
        let got: Vec<Result<T>> =
            threads.into_iter().map(|t| t.join().unwrap_or_else(|_| bail!("an issuer panicked"))).collect();
        m?;
        got.into_iter().collect()
    })
}

/// Posts `n` fetch-and-adds of 1 on the word, keeping [`IN_FLIGHT`] of
/// them outstanding; the `i`-th returns its old value into the 8 bytes at
/// `8 * i` of `s`'s region. Counts completions in `done`. Returns the old
/// values in posting order.
fn fetch_adds(s: &Side, (addr, rkey): (u64, u32), n: u64, done: &AtomicU64) -> Result<Vec<u64>> {
    let end = Instant::now() + RUN_LIMIT;
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut buf = vrdma::wc_buffer(16);
    while completed < n {
        while posted < n && posted - completed < IN_FLIGHT {
            let w = wr::fetch_add(posted, s.mr.sge(posted as usize * 8, 8)?, addr, rkey, 1);
            s.qp.post_send(&[w.signaled()])?;
            posted += 1;
        }
        let k = s.cq.poll(&mut buf)?;
        for wc in &buf[..k] {
            // In order, each once, each a success.
            let want = (completed, WcStatus::Success, WcOpcode::FetchAdd, 8);
            assert_eq!((wc.wr_id, wc.status, wc.opcode, wc.byte_len), want, "{wc:?}");
            completed += 1;
        }
        done.fetch_add(k as u64, Ordering::Relaxed);
        if k == 0 {
            if Instant::now() > end {
                bail!("QP {:#x}: {completed} of {n} fetch-and-adds within {RUN_LIMIT:?}", s.qp.qpn());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    (0..n as usize).map(|i| Ok(s.mr.read_u64(i * 8)?)).collect()
}

/// [`fetch_adds`], where the QP on the word's own host (`local`) starts
/// only once an add from host A has reached the word (`target`): its
/// answers come so much sooner that, released at the same moment, it could
/// be done before A's first request arrives (a loaded machine did that:
/// [`interleaved`] found it ran alone).
fn fetch_adds_after_a(
    s: &Side,
    local: &Side,
    target: &vrdma::MemoryRegion,
    word: (u64, u32),
    n: u64,
    done: &AtomicU64,
) -> Result<Vec<u64>> {
    if std::ptr::eq(s, local) {
        wait_until(WAIT, "an add from host A", || target.read_u64(0).is_ok_and(|v| v > 0))?;
    }
    fetch_adds(s, word, n, done)
}

/// The old values every QP got, and the word: exactly one add each.
fn check_adds(setup: &Setup, olds: &[Vec<u64>], per_qp: u64) -> Result<()> {
    let total = per_qp * olds.len() as u64;
    assert_eq!(setup.target.mr.read_u64(0)?, total, "the word after {total} adds of 1");
    for (i, o) in olds.iter().enumerate() {
        // What one QP sees grows: its atomics execute in order.
        assert!(o.windows(2).all(|w| w[0] < w[1]), "QP {i} got {o:?}");
    }
    let mut all: Vec<u64> = olds.concat();
    all.sort_unstable();
    let dups: Vec<u64> = all.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
    assert!(dups.is_empty(), "old values returned twice: {dups:?}");
    assert_eq!(all, (0..total).collect::<Vec<_>>(), "old values");
    interleaved(olds);
    Ok(())
}

/// Asserts that each QP's atomics ran while another QP's did (else the
/// test checked nothing concurrent): the range of the old values one QP
/// got overlaps another QP's range. `olds`: each QP's, growing.
fn interleaved(olds: &[Vec<u64>]) {
    let spans: Vec<(u64, u64)> = olds.iter().map(|o| (o[0], o[o.len() - 1])).collect();
    let overlaps =
        |i: usize| (0..spans.len()).any(|j| j != i && spans[i].0 < spans[j].1 && spans[j].0 < spans[i].1);
    assert!((0..spans.len()).all(overlaps), "some QP ran alone (old values from..to, per QP): {spans:?}");
}

/// Several QPs on another host and one on the word's own host add to one
/// word at once: no add is lost or counted twice, no old value is handed
/// out twice.
#[test]
fn fetch_and_add_on_one_word_from_both_hosts_is_atomic() -> Result<()> {
    const PER_QP: u64 = 500;
    let setup = Setup::start(PER_QP as usize, 14)?;
    let done = AtomicU64::new(0);
    let start = Instant::now();
    let word = setup.word();
    let (local, target) = (&setup.issuers[REMOTE_QPS], &setup.target.mr);
    let olds = run(&setup.issuers, |s| fetch_adds_after_a(s, local, target, word, PER_QP, &done), || Ok(()))?;
    println!("{} fetch-and-adds in {:?}", PER_QP * olds.len() as u64, start.elapsed());
    check_adds(&setup, &olds, PER_QP)
}

/// The same while requests are sent again: host B (the word's) is
/// stalled twice for longer than the ACK timeout of the QPs on A, which
/// then send their outstanding atomics again. B answers each duplicate
/// with the value the atomic returned the first time and executes it no
/// second time.
///
/// One round of duplicates per stall, not more: with two, B's answers to
/// them can fill its queue of 16 (`MAX_RD_ATOMIC`) when new requests
/// arrive, and B refuses those (RemInvReqErr) though no QP had more than
/// 8 outstanding: answers to duplicates count against the limit.
#[test]
fn fetch_and_add_sent_again_after_a_timeout_applies_once() -> Result<()> {
    const PER_QP: u64 = 400;
    // 4.096 µs × 2^12 ≈ 17 ms, 7 retries: a 25 ms stall costs one of
    // them, and a QP fails only after about 134 ms without an answer
    // (with 2^11 and a 12 ms stall, B had to answer within some 55 ms of
    // SIGCONT, which a loaded machine need not grant).
    let mut setup = Setup::start(PER_QP as usize, 12)?;
    let done = AtomicU64::new(0);
    let total = PER_QP * (REMOTE_QPS as u64 + 1);
    let dropped_before = dropped_in(&setup.target.ctx)?;
    let word = setup.word();
    let (local, target) = (&setup.issuers[REMOTE_QPS], &setup.target.mr);
    let b = &mut setup.hosts.b.proc;
    let stall_twice = || -> Result<()> {
        for at in [total / 4, total / 2] {
            wait_until(WAIT, "the adds under way", || done.load(Ordering::Relaxed) >= at)?;
            let stopped = b.stop(WAIT);
            std::thread::sleep(Duration::from_millis(25));
            b.kill(libc::SIGCONT);
            stopped?;
        }
        Ok(())
    };
    let olds =
        run(&setup.issuers, |s| fetch_adds_after_a(s, local, target, word, PER_QP, &done), stall_twice)?;
    check_adds(&setup, &olds, PER_QP)?;
    // Requests did come twice (B dropped them as duplicates, answering
    // the atomics among them), or this tested nothing.
    let dropped = dropped_in(&setup.target.ctx)? - dropped_before;
    println!("B dropped {dropped} frames (duplicates)");
    assert!(dropped > 0, "no request was sent again");
    assert!(setup.hosts.b.is_alive());
    Ok(())
}

/// Frames host B's daemon dropped on its links (duplicates among them).
fn dropped_in(ctx: &vrdma::Context) -> Result<u64> {
    Ok(ctx.stat()?.links.iter().map(|l| l.stats.dropped_in).sum())
}

/// Data frames the daemon of `ctx` sent on its links (requests sent again
/// among them).
fn frames_out(ctx: &vrdma::Context) -> Result<u64> {
    Ok(ctx.stat()?.links.iter().map(|l| l.stats.frames_out).sum())
}

/// Each QP increments the word by compare-and-swap until it has
/// succeeded `n` times: expects the word to hold its last answer, swaps
/// in one more, and retries with the answer when another QP came first.
/// After each success it calls `after_win` with the old value. Returns the
/// old values of its successful swaps and how many it tried.
///
/// A swap fails only if another QP won since this one's last answer, so
/// a QP tries at most `total` times (its `n` wins, one failure per win of
/// the others).
fn cas_increments(
    s: &Side,
    (addr, rkey): (u64, u32),
    n: usize,
    total: u64,
    after_win: impl Fn(u64) -> Result<()>,
) -> Result<(Vec<u64>, u64)> {
    let end = Instant::now() + RUN_LIMIT;
    let (mut expect, mut tries) = (0u64, 0u64);
    let mut won = Vec::with_capacity(n);
    while won.len() < n {
        if tries >= total || Instant::now() > end {
            bail!("QP {:#x}: {} of {n} swaps won in {tries} tries", s.qp.qpn(), won.len());
        }
        s.qp.post_send(&[wr::cmp_swap(tries, s.mr.sge(0, 8)?, addr, rkey, expect, expect + 1).signaled()])?;
        let wc = poll_one(&s.cq, WAIT)?;
        let want = (tries, WcStatus::Success, WcOpcode::CompSwap, 8);
        assert_eq!((wc.wr_id, wc.status, wc.opcode, wc.byte_len), want, "{wc:?}");
        let old = s.mr.read_u64(0)?;
        if old == expect {
            won.push(old);
            expect = old + 1;
            after_win(old)?;
        } else {
            // The word only grows; a CAS that failed saw it grown.
            assert!(old > expect, "QP {:#x}: the word went back from {expect} to {old}", s.qp.qpn());
            expect = old;
        }
        tries += 1;
    }
    Ok((won, tries))
}

/// Compare-and-swap across hosts and locally on one word: every swap
/// that reports success is the only one that saw its old value, so `n`
/// wins per QP make the word exactly `n` times the QPs.
#[test]
fn compare_and_swap_on_one_word_from_both_hosts_is_atomic() -> Result<()> {
    const PER_QP: usize = 100;
    let setup = Setup::start(1, 14)?;
    let word = setup.word();
    let total = (PER_QP * setup.issuers.len()) as u64;
    let (local, target) = (&setup.issuers[REMOTE_QPS], &setup.target.mr);
    let remote_done = AtomicUsize::new(0);
    let got = run(
        &setup.issuers,
        |s| {
            // The QP on the word's own host gets its answers so much sooner
            // than those on A that it would win every race and be done
            // before their first swap went through: after each win it
            // waits until another QP has won since (or all are done).
            let is_local = std::ptr::eq(s, local);
            let others_won = |mine: u64| -> Result<()> {
                if !is_local {
                    return Ok(());
                }
                wait_until(WAIT, "a swap from host A", || {
                    remote_done.load(Ordering::Relaxed) == REMOTE_QPS
                        || target.read_u64(0).is_ok_and(|v| v > mine + 1)
                })
            };
            let r = cas_increments(s, word, PER_QP, total, others_won);
            if !is_local {
                remote_done.fetch_add(1, Ordering::Relaxed);
            }
            r
        },
        || Ok(()),
    )?;
    let tries: Vec<u64> = got.iter().map(|g| g.1).collect();
    println!("{PER_QP} swaps per QP took {tries:?} tries");
    assert_eq!(setup.target.mr.read_u64(0)?, total);
    let won: Vec<Vec<u64>> = got.into_iter().map(|g| g.0).collect();
    let mut all = won.concat();
    all.sort_unstable();
    assert_eq!(all, (0..total).collect::<Vec<_>>(), "old values of the successful swaps");
    interleaved(&won);
    Ok(())
}

/// The responder counted its answers to duplicate atomics against its
/// max_dest_rd_atomic (16), so a requester that never has more than 16
/// outstanding gets RemInvReqErr once its ACK timer has fired. Host B is
/// stopped while A posts 8 atomics, A's timer fires (the 8 go again),
/// A posts 8 more (16 outstanding, as max_rd_atomic allows); when B
/// resumes it reads originals (8 answers queued), duplicates (8 more: 16)
/// and then refused the first new request (NAK invalid request). Answers
/// to requests sent again no longer take the responder's resources.
#[test]
fn a_requester_within_max_rd_atomic_is_not_refused_after_its_timer_fired() -> Result<()> {
    let mut h = TwoHosts::start(true)?;
    let a = Side::new(&h.a.context()?, 4096)?;
    let b = Side::new(&h.b.context()?, 4096)?;
    b.qp.connect(&a.endpoint()?, access_all())?;
    a.qp.to_init(1, access_all())?;
    a.qp.to_rtr(&b.endpoint()?, Mtu::Mtu4096, 12)?;
    // ACK timeout 4.096 µs × 2^13 ≈ 34 ms, 7 retries: A fails only after
    // some 270 ms without an answer, far beyond the stall below, which
    // waits for A's frames rather than for a time (with 2^10 it allowed
    // 34 ms in all, and a loaded machine resumed B too late: RETRY_EXC_ERR);
    // 16 reads/atomics outstanding each way (the library's default).
    a.qp.to_rts(a.qp.psn(), 13, 7, 7)?;
    let post = |ids: std::ops::Range<u64>| -> Result<()> {
        for i in ids {
            let w = wr::fetch_add(i, a.mr.sge(i as usize * 8, 8)?, b.mr.addr(), b.mr.rkey(), 1);
            a.qp.post_send(&[w.signaled()])?;
        }
        Ok(())
    };
    // One round trip first: the link is up.
    post(0..1)?;
    assert_eq!(poll_one(&a.cq, WAIT)?.status, WcStatus::Success);
    h.b.proc.stop(WAIT)?;
    let sent = || frames_out(&a.ctx);
    let before = sent()?;
    // 8 outstanding; A's timer fires and sends them again.
    post(1..9)?;
    wait_until(WAIT, "A sending its 8 atomics twice", || sent().is_ok_and(|n| n >= before + 16))?;
    let again = sent()?;
    post(9..17)?; // 16 outstanding: within max_rd_atomic
    wait_until(WAIT, "A sending 8 more", || sent().is_ok_and(|n| n >= again + 8))?;
    h.b.proc.kill(libc::SIGCONT);
    let wcs = vrdma_it::poll_n(&a.cq, 16, WAIT)?;
    let bad: Vec<_> =
        wcs.iter().filter(|w| w.status != WcStatus::Success).map(|w| (w.wr_id, w.status)).collect();
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(b.mr.read_u64(0)?, 17);
    Ok(())
}
