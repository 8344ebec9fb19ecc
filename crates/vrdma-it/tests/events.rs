//! Waiting instead of spinning: completion channels and the async-event
//! descriptor are real pollable fds, and completions stream into tokio.
//!
//! Every test runs in both topologies (`name::one_host`, `name::two_hosts`):
//! across hosts the completions that fire the channels come back over the
//! TCP transport, and the async event from the remote daemon's responder.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{AsyncEvent, AsyncEventType, CompletionChannel, Context, QpState, WcOpcode, WcStatus};
use vrdma_it::{
    access_all, async_event, cap, connect, in_both_topologies, poll_one, wait_state, Hosts, Side, Topology,
    WAIT,
};

/// `poll(2)` of one fd for `POLLIN`: whether it became readable in time.
fn readable(fd: BorrowedFd<'_>, limit: Duration) -> Result<bool> {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) };
    if n < 0 {
        bail!("poll: {}", std::io::Error::last_os_error());
    }
    Ok(n == 1 && p.revents & libc::POLLIN != 0)
}

/// A side whose CQ reports to `ch`, and where its writes go: on one host
/// its QP is connected to itself; across hosts to a QP on the other host
/// (`far`), so that its completions come back over the TCP transport.
struct Linked {
    s: Side,
    far: Option<Side>,
}

impl std::ops::Deref for Linked {
    type Target = Side;
    fn deref(&self) -> &Side {
        &self.s
    }
}

fn loopback(hosts: &Hosts, ctx: &Context, ch: &CompletionChannel) -> Result<Linked> {
    let s = Side::with(ctx, 1 << 16, 256, cap(128, 1), Some(ch))?;
    if !hosts.two() {
        s.qp.connect(&s.endpoint()?, access_all())?;
        return Ok(Linked { s, far: None });
    }
    let far = Side::with(&hosts.b().context()?, 1 << 16, 256, cap(128, 1), None)?;
    connect(&s, &far)?;
    Ok(Linked { s, far: Some(far) })
}

/// An 8-byte write from `l`'s region to its target's.
fn write(l: &Linked, id: u64) -> Result<vrdma::SendWr> {
    let to = l.far.as_ref().unwrap_or(&l.s);
    Ok(wr::rdma_write(id, &[l.s.mr.sge(0, 8)?], to.mr.addr() + 4096, to.mr.rkey())?.signaled())
}

fn channel_fd_becomes_readable_for_poll(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let ctx = d.a().context()?;
    let ch = ctx.create_comp_channel()?;
    let s = loopback(&d, &ctx, &ch)?;
    assert!(!readable(ch.fd(), Duration::ZERO)?);

    // Not armed: a completion raises no event.
    s.qp.post_send(&[write(&s, 1)?])?;
    assert_eq!(poll_one(&s.cq, WAIT)?.wr_id, 1);
    assert!(!readable(ch.fd(), Duration::from_millis(100))?, "an unarmed CQ raised an event");

    // Armed: the fd becomes readable and the event names the CQ.
    s.cq.req_notify(false)?;
    s.qp.post_send(&[write(&s, 2)?])?;
    assert!(readable(ch.fd(), WAIT)?, "the channel fd did not become readable");
    assert_eq!(ch.get_cq_event(Some(Duration::ZERO))?, Some(s.cq.cqn()));
    // Taking the last event takes the fd's readiness along, as with
    // rdma-core (an event loop would spin, or block in a get_cq_event that
    // finds nothing).
    assert!(!readable(ch.fd(), Duration::ZERO)?, "the channel fd stays readable after its last event");
    let wc = poll_one(&s.cq, WAIT)?;
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (2, WcStatus::Success, WcOpcode::RdmaWrite));
    assert_eq!(ch.get_cq_event(Some(Duration::ZERO))?, None);
    assert!(!readable(ch.fd(), Duration::ZERO)?, "the channel fd stays readable with no event");
    // One event per arming: the next completion stays silent.
    s.qp.post_send(&[write(&s, 3)?])?;
    assert_eq!(poll_one(&s.cq, WAIT)?.wr_id, 3);
    assert!(!readable(ch.fd(), Duration::from_millis(100))?);
    assert_eq!(ch.get_cq_event(Some(Duration::ZERO))?, None);
    assert_eq!(ch.events_dropped(), 0);
    Ok(())
}

/// An idle poller's clock (what decides when its empty polls yield and,
/// on small machines, nap; see `vrdma::idle`) starts with empty polls and
/// stops at a post or a completion found, per thread.
fn idle_clock_runs_on_empty_polls_and_stops_at_a_post_or_a_completion(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let ctx = d.a().context()?;
    let ch = ctx.create_comp_channel()?;
    let s = loopback(&d, &ctx, &ch)?;
    let empty_polls = |n: u32| -> Result<()> {
        for _ in 0..n {
            assert_eq!(s.cq.poll(&mut vrdma::wc_buffer(1))?, 0, "a completion nobody asked for");
        }
        Ok(())
    };
    empty_polls(vrdma::spin_polls() + 2)?;
    assert!(vrdma::idle::idle_for().is_some(), "empty polls past the spin did not start the idle clock");
    s.qp.post_send(&[write(&s, 1)?])?;
    assert_eq!(vrdma::idle::idle_for(), None, "a post did not stop the idle clock");
    assert_eq!(poll_one(&s.cq, WAIT)?.wr_id, 1);
    assert_eq!(vrdma::idle::idle_for(), None, "a completion found did not stop the idle clock");
    // Per thread: this thread's silence is not another's.
    empty_polls(vrdma::spin_polls() + 2)?;
    let other =
        std::thread::spawn(vrdma::idle::idle_for).join().map_err(|_| anyhow::anyhow!("thread failed"))?;
    assert_eq!(other, None, "another thread saw this thread's idle clock");
    assert!(vrdma::idle::idle_for().is_some());
    Ok(())
}

fn channel_fd_works_with_epoll(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let ctx = d.a().context()?;
    let ch = ctx.create_comp_channel()?;
    let s = loopback(&d, &ctx, &ch)?;
    // SAFETY: plain epoll system calls on descriptors we own; the epoll
    // fd is closed below.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(ep >= 0);
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 0xc0ffee };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, ch.fd().as_raw_fd(), &mut ev) }, 0);
    let wait = |ms: i32| -> Vec<u64> {
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: `out` has room for 4 events.
        let n = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, ms) };
        out[..n.max(0) as usize].iter().map(|e| e.u64).collect()
    };
    let result = (|| -> Result<()> {
        assert!(wait(0).is_empty());
        for round in 0..3u64 {
            s.cq.req_notify(false)?;
            s.qp.post_send(&[write(&s, round)?])?;
            assert_eq!(wait(WAIT.as_millis() as i32), vec![0xc0ffee], "round {round}");
            assert_eq!(ch.get_cq_event(Some(WAIT))?, Some(s.cq.cqn()));
            assert_eq!(poll_one(&s.cq, WAIT)?.wr_id, round);
            // Drained (until None): level-triggered epoll reports nothing more.
            assert_eq!(ch.get_cq_event(Some(Duration::ZERO))?, None);
            assert!(wait(50).is_empty(), "round {round}: readable with no event");
        }
        Ok(())
    })();
    // SAFETY: `ep` is ours and closed once.
    unsafe { libc::close(ep) };
    result
}

fn get_cq_event_names_the_cq_that_fired(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let ctx = d.a().context()?;
    let ch = ctx.create_comp_channel()?;
    let x = loopback(&d, &ctx, &ch)?;
    let y = loopback(&d, &ctx, &ch)?;
    assert_ne!(x.cq.cqn(), y.cq.cqn());
    x.cq.req_notify(false)?;
    y.cq.req_notify(false)?;
    y.qp.post_send(&[write(&y, 1)?])?;
    assert_eq!(ch.get_cq_event(Some(WAIT))?, Some(y.cq.cqn()));
    assert_eq!(poll_one(&y.cq, WAIT)?.wr_id, 1);
    x.qp.post_send(&[write(&x, 2)?])?;
    assert_eq!(ch.get_cq_event(Some(WAIT))?, Some(x.cq.cqn()));
    assert_eq!(poll_one(&x.cq, WAIT)?.wr_id, 2);
    // Nothing is pending, and waiting for nothing times out.
    assert_eq!(ch.get_cq_event(Some(Duration::from_millis(20)))?, None);
    // The blocking helper: arm, poll, sleep on the channel of a lone CQ.
    let ch2 = ctx.create_comp_channel()?;
    let z = loopback(&d, &ctx, &ch2)?;
    let mut out = vrdma::wc_buffer(4);
    assert_eq!(z.cq.wait(&mut out, Some(Duration::from_millis(20)))?, 0);
    z.qp.post_send(&[write(&z, 3)?])?;
    assert_eq!(z.cq.wait(&mut out, Some(WAIT))?, 1);
    assert_eq!(out[0].wr_id, 3);
    Ok(())
}

fn completion_stream_yields_completions_in_order(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let ctx = d.a().context()?;
    let ch = ctx.create_comp_channel()?;
    let s = std::sync::Arc::new(loopback(&d, &ctx, &ch)?);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let got: Vec<u64> = rt.block_on(async {
        let mut stream = s.cq.stream()?;
        // Another thread posts in bursts with pauses, so that the stream
        // both finds completions waiting and sleeps on the channel.
        let poster = {
            let s = s.clone();
            std::thread::spawn(move || -> Result<()> {
                for burst in 0..10u64 {
                    let wrs: Vec<_> = (0..10).map(|i| write(&s, burst * 10 + i)).collect::<Result<_>>()?;
                    s.qp.post_send(&wrs)?;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(())
            })
        };
        let mut ids = Vec::new();
        while ids.len() < 100 {
            match tokio::time::timeout(WAIT, stream.next()).await {
                Ok(Some(Ok(wc))) => {
                    assert_eq!(wc.status, WcStatus::Success);
                    ids.push(wc.wr_id);
                }
                Ok(other) => bail!("the stream yielded {other:?}"),
                Err(_) => bail!("the stream stalled after {} completions", ids.len()),
            }
        }
        poster.join().expect("poster thread")?;
        // Nothing more comes.
        assert!(tokio::time::timeout(Duration::from_millis(50), stream.next()).await.is_err());
        Ok::<_, anyhow::Error>(ids)
    })?;
    assert_eq!(got, (0..100).collect::<Vec<u64>>());
    Ok(())
}

fn async_event_fd_is_pollable(t: Topology) -> Result<()> {
    let d = Hosts::start(t)?;
    let (ca, cb) = (d.a().context()?, d.b().context()?);
    let a = Side::new(&ca, 4096)?;
    let b = Side::new(&cb, 4096)?;
    connect(&a, &b)?;
    assert!(!readable(cb.async_event_fd(), Duration::ZERO)?);
    assert_eq!(cb.get_async_event(Some(Duration::ZERO))?, None);
    // A write with a key that is not B's breaks B's QP: B gets an event.
    let bad = b.mr.rkey() ^ 0x5a5a_5a5a;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), bad)?.signaled()])?;
    assert!(readable(cb.async_event_fd(), WAIT)?, "the async-event fd did not become readable");
    let ev = async_event(&cb, Duration::ZERO)?;
    assert_eq!(ev, AsyncEvent { event_type: AsyncEventType::QpAccessErr, element: b.qp.qpn() });
    wait_state(&b.qp, QpState::Err, WAIT)?;
    // Drained: the fd is not left readable for nothing.
    assert_eq!(cb.get_async_event(Some(Duration::ZERO))?, None);
    assert!(!readable(cb.async_event_fd(), Duration::ZERO)?, "the async fd stays readable with no event");
    assert_eq!(cb.async_events_dropped(), 0);
    // A's context heard nothing.
    assert!(!readable(ca.async_event_fd(), Duration::from_millis(50))?);
    Ok(())
}

in_both_topologies!(
    idle_clock_runs_on_empty_polls_and_stops_at_a_post_or_a_completion,
    channel_fd_becomes_readable_for_poll,
    channel_fd_works_with_epoll,
    get_cq_event_names_the_cq_that_fired,
    completion_stream_yields_completions_in_order,
    async_event_fd_is_pollable,
);

/// The daemon dies (SIGKILL) under a context: a thread blocked in
/// `get_async_event` wakes with `DeviceFatal`, the async-event fd turns
/// readable for `poll`, later calls fail with `EIO` instead of waiting,
/// a completion channel's wait fails too; a new context reaches the
/// daemon that took its place, with a quiet async-event fd.
#[test]
fn a_daemon_gone_is_device_fatal_then_an_error() -> Result<()> {
    let mut d = vrdma_it::DaemonProc::start()?;
    let ctx = d.context()?;
    let ch = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(16, Some(&ch))?;
    cq.req_notify(false)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let waiting = ctx.clone();
    std::thread::spawn(move || {
        let _ = tx.send(waiting.get_async_event(None).map_err(|e| e.errno()));
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!ctx.daemon_gone());
    d.restart()?;
    assert!(readable(ctx.async_event_fd(), WAIT)?, "the async-event fd stayed quiet");
    let woke =
        rx.recv_timeout(WAIT).map_err(|_| anyhow::anyhow!("the blocked get_async_event did not wake"))?;
    assert_eq!(woke, Ok(Some(AsyncEvent { event_type: AsyncEventType::DeviceFatal, element: 0 })));
    assert!(ctx.daemon_gone());
    for wait in [None, Some(Duration::ZERO), Some(WAIT)] {
        let after = ctx.get_async_event(wait);
        assert!(matches!(&after, Err(e) if e.errno() == libc::EIO), "after DEVICE_FATAL: {after:?}");
    }
    assert!(ch.get_cq_event(Some(WAIT)).is_err(), "a completion channel's wait fails");
    drop(cq);
    let new = d.context()?;
    assert!(!new.daemon_gone());
    new.query_port(1)?;
    assert!(!readable(new.async_event_fd(), Duration::ZERO)?);
    assert_eq!(new.get_async_event(Some(Duration::ZERO))?, None);
    Ok(())
}
