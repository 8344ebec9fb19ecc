//! Completion channels and solicited events on the direct path: a CQ with
//! a channel, armed, gets its event when the library completes into it
//! (the requester's own send CQ, or the peer's receive CQ), exactly once
//! per arming, as the engine's `notify_channel` gives it; solicited-only
//! arming wakes only on a solicited completion. Scenarios that must match
//! the engine run on a daemon with the switch on and one with it off.

use std::time::Duration;

use super::*;

const OFF: &str = "[direct]\nenabled = false\n";

/// A side whose one CQ (send and receive) reports to its own channel.
fn side(d: &DaemonProc) -> Result<(Side, vrdma::CompletionChannel)> {
    let ctx = d.context()?;
    let ch = ctx.create_comp_channel()?;
    let s = Side::with(&ctx, 1 << 16, 256, vrdma_it::cap(64, 2), Some(&ch))?;
    Ok((s, ch))
}

fn channel_pair(
    d: &DaemonProc,
) -> Result<((Side, vrdma::CompletionChannel), (Side, vrdma::CompletionChannel))> {
    let a = side(d)?;
    let b = side(d)?;
    connect(&a.0, &b.0)?;
    Ok((a, b))
}

/// No event waiting (none doubled).
fn no_event(ch: &vrdma::CompletionChannel) -> Result<()> {
    assert_eq!(ch.get_cq_event(Some(Duration::ZERO))?, None, "an event more than the armings");
    Ok(())
}

#[test]
fn each_arming_fires_once_on_both_sides_over_many_sends() -> Result<()> {
    const N: u64 = 300;
    for (config, direct) in [(ON, true), (OFF, false)] {
        let d = DaemonProc::start_with_config(config)?;
        let ((a, ach), (b, bch)) = channel_pair(&d)?;
        a.mr.write(0, b"pingpong")?;
        for i in 0..N {
            b.qp.post_recv(&[wr::recv(i, &[b.mr.sge(0, 8)?])?])?;
            a.cq.req_notify(false)?;
            b.cq.req_notify(false)?;
            let send = wr::send(i, &[a.mr.sge(0, 8)?])?.signaled();
            // Every other one a write with immediate.
            let w = if i % 2 == 0 {
                send
            } else {
                wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr() + 64, b.mr.rkey())?
                    .with_imm(i as u32)
                    .signaled()
            };
            a.qp.post_send(&[w])?;
            assert_eq!(ach.get_cq_event(Some(WAIT))?, Some(a.cq.cqn()), "the sender's event, {i}");
            assert_eq!(bch.get_cq_event(Some(WAIT))?, Some(b.cq.cqn()), "the receiver's event, {i}");
            assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, i);
            let wc = poll_one(&b.cq, WAIT)?;
            assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
            no_event(&ach)?;
            no_event(&bch)?;
        }
        // Not armed: completions, no events.
        b.qp.post_recv(&[wr::recv(N, &[b.mr.sge(0, 8)?])?])?;
        a.qp.post_send(&[wr::send(N, &[a.mr.sge(0, 8)?])?.signaled()])?;
        assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, N);
        assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, N);
        no_event(&ach)?;
        no_event(&bch)?;
        if direct {
            assert_eq!(carried(&a), N + 1, "every WR took the direct path");
        } else {
            assert_eq!(carried(&a), 0);
        }
    }
    Ok(())
}

#[test]
fn solicited_only_arming_wakes_only_on_a_solicited_completion() -> Result<()> {
    for (config, direct) in [(ON, true), (OFF, false)] {
        let d = DaemonProc::start_with_config(config)?;
        let ((a, _ach), (b, bch)) = channel_pair(&d)?;
        a.mr.write(0, b"solicit!")?;
        for i in 0..4 {
            b.qp.post_recv(&[wr::recv(i, &[b.mr.sge(0, 8)?])?])?;
        }
        b.cq.req_notify(true)?;
        // Unsolicited: a completion, no event.
        a.qp.post_send(&[wr::send(0, &[a.mr.sge(0, 8)?])?.signaled()])?;
        assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, 0);
        std::thread::sleep(Duration::from_millis(20));
        no_event(&bch)?;
        let w = wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.with_imm(1).signaled();
        a.qp.post_send(&[w])?;
        assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, 1);
        std::thread::sleep(Duration::from_millis(20));
        no_event(&bch)?;
        // Solicited: the event, once.
        let mut s = wr::send(2, &[a.mr.sge(0, 8)?])?.signaled();
        s.flags |= vrdma::SendFlags::SOLICITED;
        a.qp.post_send(&[s])?;
        assert_eq!(bch.get_cq_event(Some(WAIT))?, Some(b.cq.cqn()));
        assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, 2);
        // A solicited write with immediate, armed again.
        b.cq.req_notify(true)?;
        let mut w = wr::rdma_write(3, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.with_imm(3).signaled();
        w.flags |= vrdma::SendFlags::SOLICITED;
        a.qp.post_send(&[w])?;
        assert_eq!(bch.get_cq_event(Some(WAIT))?, Some(b.cq.cqn()));
        assert_eq!(poll_one(&b.cq, WAIT)?.wr_id, 3);
        no_event(&bch)?;
        assert_eq!(poll_n(&a.cq, 4, WAIT)?.len(), 4);
        assert_eq!(carried(&a), if direct { 4 } else { 0 });
    }
    Ok(())
}

/// The loop a program runs: each side sleeps on its channel until its
/// message comes (arm, poll, then wait), then answers.
/// `n` sends bounced between `a` and `b`, each side waiting for the
/// peer's by arming its CQ, polling it and sleeping on its channel;
/// returns the events each side took.
fn event_ping_pong(
    (a, ach): &(Side, vrdma::CompletionChannel),
    (b, bch): &(Side, vrdma::CompletionChannel),
    n: u64,
) -> Result<(u64, u64)> {
    a.mr.write(0, b"ping!!!!")?;
    b.mr.write(0, b"pong!!!!")?;
    let run = |s: &Side, ch: &vrdma::CompletionChannel, first: bool| -> Result<u64> {
        let mut events = 0;
        s.qp.post_recv(&[wr::recv(0, &[s.mr.sge(1024, 8)?])?])?;
        let mut buf = vrdma::wc_buffer(16);
        for i in 0..n {
            if first {
                s.qp.post_send(&[wr::send(i, &[s.mr.sge(0, 8)?])?.signaled()])?;
            }
            // Wait for the peer's message: arm, poll, sleep on the channel.
            let mut got = false;
            while !got {
                s.cq.req_notify(false)?;
                let k = s.cq.poll(&mut buf)?;
                for wc in &buf[..k] {
                    assert_eq!(wc.status, WcStatus::Success);
                    got |= wc.opcode == WcOpcode::Recv;
                }
                if k == 0 {
                    match ch.get_cq_event(Some(WAIT))? {
                        Some(_) => events += 1,
                        None => anyhow::bail!("no event within {WAIT:?} at message {i}: lost"),
                    }
                }
            }
            s.qp.post_recv(&[wr::recv(i + 1, &[s.mr.sge(1024, 8)?])?])?;
            if !first {
                s.qp.post_send(&[wr::send(i, &[s.mr.sge(0, 8)?])?.signaled()])?;
            }
        }
        Ok(events)
    };
    let (ea, eb) = std::thread::scope(|sc| {
        let hb = sc.spawn(|| run(b, bch, false));
        let ea = run(a, ach, true);
        (ea, hb.join().expect("the responder's thread"))
    });
    Ok((ea?, eb?))
}

/// Whether the channel's fd becomes readable within `ms` milliseconds.
fn readable(ch: &vrdma::CompletionChannel, ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: ch.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

#[test]
fn an_event_driven_ping_pong_is_carried() -> Result<()> {
    const N: u64 = 500;
    let d = DaemonProc::start_with_config(ON)?;
    let (a, b) = channel_pair(&d)?;
    let (ea, eb) = event_ping_pong(&a, &b, N)?;
    let (a, b) = (a.0, b.0);
    assert!(ea > 0 && eb > 0, "the sides slept on their channels ({ea}, {eb} events)");
    assert!(carried(&a) >= N - 5 && carried(&b) >= N - 5, "carried: {} and {}", carried(&a), carried(&b));
    Ok(())
}

/// Events taken while the waiter looked for them in shared memory come
/// without a datagram (`vrdma::channel`, "Quiet events"), on either path:
/// after many of them the channel's fd is not readable (no datagram left
/// over), and an event raised while no thread waits still makes it
/// readable, until that event is taken.
#[test]
fn the_channel_fd_stays_in_step_with_events_taken_while_waiting() -> Result<()> {
    for config in [ON, OFF] {
        let d = DaemonProc::start_with_config(config)?;
        let (a, b) = channel_pair(&d)?;
        event_ping_pong(&a, &b, 300)?;
        let ((a, ach), (b, bch)) = (a, b);
        // Events the sides never waited for are still unread: each pass
        // of the loop arms the CQ before it polls, and an arming that a
        // completion fires while the poll then finds that completion
        // leaves an event behind (as on hardware: the program would ack
        // them): at most one per poll that found something, two per
        // message. With the direct path, fast enough to complete between
        // the arming and the poll, more than four were left in about one
        // run in four here, and a drain of four left the fd readable.
        // Take them all, then no wake-up may be left.
        std::thread::sleep(Duration::from_millis(20));
        for ch in [&ach, &bch] {
            let mut taken = 0u64;
            while ch.get_cq_event(Some(Duration::ZERO))?.is_some() {
                taken += 1;
                assert!(taken <= 2 * 300 + 4, "more events than armings ({config:?})");
            }
        }
        poll_for(&a.cq, Duration::from_millis(20))?;
        poll_for(&b.cq, Duration::from_millis(20))?;
        assert!(!readable(&ach, 0) && !readable(&bch, 0), "a wake-up left over ({config:?})");
        // The ping-pong left receive 300 posted.
        b.cq.req_notify(false)?;
        a.qp.post_send(&[wr::send(1000, &[a.mr.sge(0, 8)?])?])?;
        assert!(
            readable(&bch, WAIT.as_millis() as i32),
            "no wake-up for an event no one waited for ({config:?})"
        );
        assert_eq!(bch.get_cq_event(Some(Duration::ZERO))?, Some(b.cq.cqn()));
        assert!(!readable(&bch, 0), "the wake-up outlived its event ({config:?})");
        let wc = poll_one(&b.cq, WAIT)?;
        assert_eq!((wc.wr_id, wc.status, wc.opcode), (300, WcStatus::Success, WcOpcode::Recv));
        no_event(&ach)?;
    }
    Ok(())
}

/// A pseudo-random delay in `0..max` (xorshift; the seed fixes the run).
fn next_delay(state: &mut u64, max: Duration) -> Duration {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    Duration::from_nanos(*state % max.as_nanos() as u64)
}

/// Waits `d` without sleeping (a sleep of a few µs lasts 50 µs or more).
fn spin_for(d: Duration) {
    let start = std::time::Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// No event is lost to the waiter's decision to sleep, and none doubled:
/// each round the receiver arms its CQ, and the sender posts after a
/// random delay from nothing to three times the spin `get_cq_event` makes
/// before it sleeps (`vrdma::event_spin`), so that sends land while the
/// waiter polls after arming, spins, gives its mark back
/// ("Quiet events": the compare-and-swap against the raiser's claim) and
/// sleeps on the fd. Every round must give exactly one event within
/// `WAIT`, its completion, and leave neither another event nor a readable
/// fd behind. Both paths: the library's claim and the engine's.
#[test]
fn no_event_is_lost_while_the_waiter_decides_to_sleep() -> Result<()> {
    const ROUNDS: u64 = 400;
    let max = 3 * vrdma::event_spin().max(Duration::from_micros(20));
    for (config, direct) in [(ON, true), (OFF, false)] {
        let d = DaemonProc::start_with_config(config)?;
        let ((a, _ach), (b, bch)) = channel_pair(&d)?;
        a.mr.write(0, b"racing!!")?;
        let (armed_tx, armed_rx) = std::sync::mpsc::channel::<u64>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let a = &a;
        std::thread::scope(|sc| -> Result<()> {
            let sender = sc.spawn(move || -> Result<()> {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64;
                for i in 0..ROUNDS {
                    // Bounded: the receiver answers each round within WAIT.
                    let round = armed_rx.recv_timeout(2 * WAIT)?;
                    assert_eq!(round, i);
                    spin_for(next_delay(&mut seed, max));
                    a.qp.post_send(&[wr::send(i, &[a.mr.sge(0, 8)?])?.signaled()])?;
                    assert_eq!(poll_one(&a.cq, WAIT)?.wr_id, i);
                    done_rx.recv_timeout(2 * WAIT)?;
                }
                Ok(())
            });
            let receiver = (|| -> Result<()> {
                let mut buf = vrdma::wc_buffer(4);
                for i in 0..ROUNDS {
                    b.qp.post_recv(&[wr::recv(i, &[b.mr.sge(0, 8)?])?])?;
                    b.cq.req_notify(false)?;
                    armed_tx.send(i)?;
                    // Every other round the race rule's poll after arming;
                    // what it finds fired the arming all the same.
                    let mut got = if i % 2 == 0 { b.cq.poll(&mut buf)? } else { 0 };
                    let ev = bch.get_cq_event(Some(WAIT))?;
                    assert_eq!(ev, Some(b.cq.cqn()), "round {i}: the event was lost ({config:?})");
                    if got == 0 {
                        got = poll_n(&b.cq, 1, WAIT)?.len();
                    }
                    assert_eq!(got, 1, "round {i}");
                    assert_eq!(bch.get_cq_event(Some(Duration::ZERO))?, None, "round {i}: a second event");
                    assert!(!readable(&bch, 0), "round {i}: a wake-up outlived its event ({config:?})");
                    done_tx.send(())?;
                }
                Ok(())
            })();
            let sent = sender.join().expect("the sender's thread");
            receiver.and(sent)
        })?;
        assert_eq!(carried(a), if direct { ROUNDS } else { 0 }, "{config:?}");
    }
    Ok(())
}
