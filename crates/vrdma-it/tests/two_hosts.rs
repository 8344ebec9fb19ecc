//! Queue pairs between two daemons that play two hosts: every opcode over
//! the TCP transport, addressing by LID and by GID, faults: a killed or
//! stalled peer daemon, strangers on the daemon port, a wrong key. (The
//! same across network namespaces and a veth: `netns.rs`.)

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{Mtu, WcOpcode, WcStatus};
use vrdma_it::across::{check, every_opcode, new_pairs_work_again, outstanding_writes_fail, pair};
use vrdma_it::{access_all, poll_n, poll_one, Side, TwoHosts, WAIT};

#[test]
fn every_opcode_by_lid_over_configured_peers() -> Result<()> {
    let h = TwoHosts::start(true)?;
    every_opcode(&h.a, &h.b, false)
}

#[test]
fn every_opcode_by_gid_dialling_the_peer_on_demand() -> Result<()> {
    let h = TwoHosts::start(false)?;
    every_opcode(&h.a, &h.b, true)
}

#[test]
fn a_killed_peer_daemon_ends_in_retry_exc_err_and_a_restarted_one_serves_new_qps() -> Result<()> {
    killed_peer_then_restarted(true)
}

/// Without configured peers the daemon dials the host a GID names when a
/// QP first needs it, and dials the restarted daemon again for new QPs.
#[test]
fn a_killed_peer_daemon_dialled_by_gid_ends_in_retry_exc_err_and_a_restarted_one_serves_new_qps() -> Result<()>
{
    killed_peer_then_restarted(false)
}

/// `peered`: the daemons know each other from their configs and QPs
/// address by LID; otherwise by GID, each daemon dialling on demand.
fn killed_peer_then_restarted(peered: bool) -> Result<()> {
    let mut h = TwoHosts::start(peered)?;
    let (a, b) = pair(&h.a, &h.b, !peered)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
    let (addr, rkey) = (b.mr.addr(), b.mr.rkey());
    drop(b);
    h.b.restart()?;
    let start = std::time::Instant::now();
    a.qp.post_send(&[wr::rdma_write(2, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    a.qp.post_send(&[wr::rdma_write(3, &[a.mr.sge(0, 8)?], addr, rkey)?.signaled()])?;
    let wcs = poll_n(&a.cq, 2, Duration::from_secs(20))?;
    assert_eq!((wcs[0].wr_id, wcs[0].status), (2, WcStatus::RetryExcErr), "{wcs:?}");
    assert_eq!((wcs[1].wr_id, wcs[1].status), (3, WcStatus::WrFlushErr), "{wcs:?}");
    // The QP's timeout (14: 67 ms) and retry count (7) allow about 0.5 s.
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    let late = vrdma_it::poll_for(&a.cq, Duration::from_millis(500))?;
    assert!(late.is_empty(), "completions after the failure: {late:?}");
    // New QPs connect to the restarted daemon.
    let (a2, b2) = pair(&h.a, &h.b, !peered)?;
    a2.mr.write(0, b"again")?;
    a2.qp.post_send(&[wr::rdma_write(9, &[a2.mr.sge(0, 5)?], b2.mr.addr(), b2.mr.rkey())?.signaled()])?;
    check(&poll_one(&a2.cq, WAIT)?, 9, WcOpcode::RdmaWrite);
    let mut got = [0u8; 5];
    b2.mr.read(0, &mut got)?;
    assert_eq!(&got, b"again");
    Ok(())
}

#[test]
fn a_stalled_peer_daemon_ends_in_retry_exc_err_and_new_qps_connect_once_it_resumes() -> Result<()> {
    // SIGSTOP: the connection stays open, nothing answers on it (a stall,
    // where netem is not available: see netns.rs). The link would be
    // declared dead only after 20 s, so what ends the QP is its own timer.
    let dead = "dead_ms = 20000";
    let mut h = TwoHosts::start_nets(true, dead, dead)?;
    let (a, b) = pair(&h.a, &h.b, false)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
    h.b.proc.stop(WAIT)?;
    let r = outstanding_writes_fail(&a, &b, 3, Duration::from_secs(10));
    h.b.proc.kill(libc::SIGCONT);
    // The QP's timeout (14: 67 ms) and retry count (7) allow 8 × 67 ms
    // from the last frame sent: no sooner, and well before the link's end.
    let took = r?;
    println!("stalled: failed after {took:?}");
    assert!(took >= Duration::from_millis(500), "failed after {took:?}, before the QP's timer could expire");
    assert!(took < Duration::from_secs(10), "failed after {took:?}: the QP's timer did not end it");
    // The resumed daemon finds the requests sent again in its socket and
    // answers them: the failed QP completes nothing more.
    let late = vrdma_it::poll_for(&a.cq, Duration::from_secs(1))?;
    assert!(late.is_empty(), "completions after the failure: {late:?}");
    let tries = new_pairs_work_again(&h.a, &h.b, Duration::from_secs(10))?;
    println!("new pairs worked after {tries} tries");
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn strangers_on_the_daemon_port_are_dropped_and_harm_no_one() -> Result<()> {
    use std::io::{Read, Write};
    let mut h = TwoHosts::start(true)?;
    let (a, b) = pair(&h.a, &h.b, false)?;
    let addr = format!("127.0.0.2:{}", h.port);
    // One says nothing; one sends garbage; one sends a frame-sized lie.
    let mut silent = std::net::TcpStream::connect(&addr)?;
    let mut garbage = std::net::TcpStream::connect(&addr)?;
    let _ = garbage.write_all(&vrdma_it::pattern(64 << 10, 77));
    let mut huge = std::net::TcpStream::connect(&addr)?;
    let _ = huge.write_all(&[0xff; 16]);
    // The link and the QPs on it carry on meanwhile.
    for i in 0..20u64 {
        a.qp.post_send(&[wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        check(&poll_one(&a.cq, WAIT)?, i, WcOpcode::RdmaWrite);
    }
    // Each stranger is dropped: end of stream (or a reset), within the
    // handshake deadline (3 s) and some slack.
    for (what, s) in [("garbage", &mut garbage), ("a huge length", &mut huge), ("silence", &mut silent)] {
        s.set_read_timeout(Some(Duration::from_secs(8)))?;
        let mut buf = [0u8; 4096];
        let end = std::time::Instant::now() + Duration::from_secs(8);
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                // What it may say before closing (a Hello, a Close).
                Ok(_) if std::time::Instant::now() < end => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                other => panic!("the stranger sending {what} was not dropped: {other:?}"),
            }
        }
    }
    // And still: the old QPs and new ones work.
    a.qp.post_send(&[wr::rdma_write(99, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 99, WcOpcode::RdmaWrite);
    new_pairs_work_again(&h.a, &h.b, WAIT)?;
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn a_daemon_with_a_wrong_key_never_links() -> Result<()> {
    let mut h = TwoHosts::start_keys(true, "", vrdma_it::TEST_PSK, "not the cluster's key, but long enough")?;
    // By GID: the daemon dials the peer for the QP, and the handshake
    // fails every time.
    let (a, b) = pair(&h.a, &h.b, true)?;
    let took = outstanding_writes_fail(&a, &b, 2, Duration::from_secs(5))?;
    println!("a: failed after {took:?}");
    let took = outstanding_writes_fail(&b, &a, 2, Duration::from_secs(5))?;
    println!("b: failed after {took:?}");
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

/// `net.allow` bounds the hosts a daemon dials for its tenants and takes
/// connections from: A lists only itself, so neither A's dial to B (for a
/// QP naming B's GID) nor B's dial to A makes a link, and QPs both ways end
/// in RETRY_EXC_ERR by their timers.
#[test]
fn a_daemon_dials_and_admits_only_the_networks_net_allow_lists() -> Result<()> {
    let mut h = TwoHosts::start_nets(false, "allow = [\"127.0.0.2/32\"]\n", "")?;
    let (a, b) = pair(&h.a, &h.b, true)?;
    let took = outstanding_writes_fail(&a, &b, 2, Duration::from_secs(5))?;
    println!("a: failed after {took:?}");
    let took = outstanding_writes_fail(&b, &a, 2, Duration::from_secs(5))?;
    println!("b: failed after {took:?}");
    assert_eq!((links_up(&h.a)?, links_up(&h.b)?), (0, 0), "a link formed across net.allow");
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn bursts_of_small_writes_complete_without_waiting_for_the_next_frame() -> Result<()> {
    // A burst of up to 255 eight-byte writes waits in the responder's socket as
    // far more frames than it handles in one pass (64); the rest sit in its
    // read buffer,
    // where the socket's readiness no longer shows them. They must be
    // handled in the next passes, not when the next frame happens to
    // arrive. The next frame would be a keepalive (every 5 s here) or the
    // writer's request sent again (its timer: 2^18 × 4.096 µs ≈ 1.07 s), so
    // a burst left waiting takes a second or more, while one handled at
    // once takes milliseconds: the bound below leaves a loaded machine
    // half a second (with a keepalive every 200 ms and the default timer,
    // 67 ms, it had to allow less than 150 ms).
    let (mut h, a, b) = slow_pair(18, 7)?;
    let mut slowest = Duration::ZERO;
    // Bursts of several lengths, so that some end with more than a pass's
    // worth of frames in the buffer, whatever the frame size.
    for burst in 0..12u64 {
        let n = 255 - 13 * burst;
        let wrs: Vec<_> = (0..n)
            .map(|i| {
                let w = wr::rdma_write(i, &[a.mr.sge(8 * i as usize, 8)?], b.mr.addr() + 8 * i, b.mr.rkey())?;
                Ok(if i == n - 1 { w.signaled() } else { w })
            })
            .collect::<Result<_>>()?;
        for i in 0..n {
            a.mr.write(8 * i as usize, &(burst * 1000 + i).to_le_bytes())?;
        }
        // The responder stopped while the burst is sent: it finds the
        // whole burst waiting in its socket when it goes on.
        h.b.proc.stop(WAIT)?;
        a.qp.post_send(&wrs)?;
        std::thread::sleep(Duration::from_millis(20));
        let start = std::time::Instant::now();
        h.b.proc.kill(libc::SIGCONT);
        check(&poll_one(&a.cq, WAIT)?, n - 1, WcOpcode::RdmaWrite);
        slowest = slowest.max(start.elapsed());
        let mut got = [0u8; 8];
        for i in 0..n {
            b.mr.read(8 * i as usize, &mut got)?;
            assert_eq!(u64::from_le_bytes(got), burst * 1000 + i, "burst {burst}, write {i}");
        }
    }
    println!("slowest burst: {slowest:?}");
    assert!(slowest < Duration::from_millis(500), "a burst waited {slowest:?}: frames were left unhandled");
    Ok(())
}

/// An engine that runs late (here: stopped) finds the ACK of its request
/// waiting in its socket when it goes on, past the request's timer. It
/// reads the ACK before it looks at the timer: the write completes. (It
/// looked at the timer first, sent the request again for nothing, and a
/// QP with no retries left failed with RETRY_EXC_ERR, its write done.)
#[test]
fn an_ack_waiting_when_a_late_engine_goes_on_beats_its_requests_timer() -> Result<()> {
    // Timeout 17 (2^17 × 4.096 µs: 537 ms), no retries: the first expiry
    // of the timer fails the QP.
    let (mut h, a, b) = slow_pair(17, 0)?;
    let mut exercised = 0;
    for round in 0..6u64 {
        a.mr.write(0, &(round + 1).to_le_bytes())?;
        // The responder stopped: the request waits in its socket.
        h.b.proc.stop(WAIT)?;
        let sent = std::time::Instant::now();
        a.qp.post_send(&[wr::rdma_write(round, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        std::thread::sleep(Duration::from_millis(100));
        // The requester stopped after sending; the responder goes on,
        // writes and ACKs into the requester's socket.
        h.a.proc.stop(WAIT)?;
        h.b.proc.kill(libc::SIGCONT);
        let reached =
            vrdma_it::wait_until(Duration::from_secs(2), "the write reaching the responder", || {
                let mut got = [0u8; 8];
                b.mr.read(0, &mut got).is_ok() && u64::from_le_bytes(got) == round + 1
            });
        if reached.is_ok() {
            // Past the requester's timer, it goes on.
            std::thread::sleep(Duration::from_millis(800).saturating_sub(sent.elapsed()));
        }
        // (Not reached: a loaded machine stopped the requester before it
        // sent; the round shows nothing, and completes as usual.)
        h.a.proc.kill(libc::SIGCONT);
        let wc = poll_one(&a.cq, WAIT)?;
        assert_eq!(
            (wc.wr_id, wc.status),
            (round, WcStatus::Success),
            "round {round}: the ACK waiting in the socket lost to the request's timer"
        );
        exercised += usize::from(reached.is_ok());
        if exercised == 3 {
            break;
        }
    }
    assert!(exercised > 0, "no round had the requester stopped after it sent");
    Ok(())
}

/// Two hosts with rare keepalives and a late link death, and a QP pair
/// across them whose requester `a` has the transport `timeout` and
/// `retry` count given.
fn slow_pair(timeout: u8, retry: u8) -> Result<(TwoHosts, Side, Side)> {
    let slow = "keepalive_ms = 5000\ndead_ms = 20000";
    let h = TwoHosts::start_nets(true, slow, slow)?;
    let a = Side::new(&h.a.context()?, 1 << 16)?;
    let b = Side::new(&h.b.context()?, 1 << 16)?;
    b.qp.connect(&a.endpoint()?, access_all())?;
    a.qp.to_init(1, access_all())?;
    a.qp.to_rtr(&b.endpoint()?, Mtu::Mtu4096, 12)?;
    a.qp.to_rts(a.qp.psn(), timeout, retry, 7)?;
    Ok((h, a, b))
}

/// Live links in a daemon's `vrdma stat`.
fn links_up(d: &vrdma_it::DaemonProc) -> Result<usize> {
    Ok(d.context()?.stat()?.links.iter().filter(|l| l.up).count())
}

#[test]
fn daemons_that_dial_each_other_at_the_same_moment_keep_one_link() -> Result<()> {
    // Unpeered daemons dial a peer when a QP first names its GID. Two QPs,
    // one on each daemon, naming each other at the same moment make both
    // dial at once; each then accepts the other's connection while its own
    // dial is under way. The daemon with the smaller GID must refuse the
    // other's, so that one link forms, not two. Several rounds, since the
    // two dials must overlap to collide.
    for round in 0..4 {
        let h = TwoHosts::start(false)?;
        let a = Side::new(&h.a.context()?, 1 << 16)?;
        let b = Side::new(&h.b.context()?, 1 << 16)?;
        let (mut ea, mut eb) = (a.endpoint()?, b.endpoint()?);
        (ea.lid, eb.lid) = (0, 0);
        let go = std::sync::Barrier::new(2);
        std::thread::scope(|s| -> Result<()> {
            let ta = s.spawn(|| {
                go.wait();
                a.qp.connect(&eb, vrdma_it::access_all())
            });
            let tb = s.spawn(|| {
                go.wait();
                b.qp.connect(&ea, vrdma_it::access_all())
            });
            ta.join().expect("connect a")?;
            tb.join().expect("connect b")?;
            Ok(())
        })?;
        // Traffic both ways waits for a link, so it is up once this passes.
        a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        b.qp.post_send(&[wr::rdma_write(2, &[b.mr.sge(0, 8)?], a.mr.addr(), a.mr.rkey())?.signaled()])?;
        check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
        check(&poll_one(&b.cq, WAIT)?, 2, WcOpcode::RdmaWrite);
        // A refused dial is tried again after 500 ms if no link serves the
        // peer; give it that long to show up as a second link.
        std::thread::sleep(Duration::from_millis(700));
        assert_eq!(
            (links_up(&h.a)?, links_up(&h.b)?),
            (1, 1),
            "round {round}: two links between two daemons"
        );
    }
    Ok(())
}

#[test]
fn daemons_that_list_each_other_keep_one_link() -> Result<()> {
    // Host a lists b and dials it first, before b runs (refused; it tries
    // again in 500 ms); b, started next, lists a and dials it, so a's end
    // of their link is an accepted connection. When a tries again it must
    // see that it is linked to b already and open no second connection.
    let h = TwoHosts::start(true)?;
    let (a, b) = (&h.a, &h.b);
    vrdma_it::wait_until(Duration::from_secs(10), "the daemons link", || {
        links_up(a).is_ok_and(|n| n > 0) && links_up(b).is_ok_and(|n| n > 0)
    })?;
    // Several redial periods (and keepalive ticks: 100 ms here): one link,
    // even if both dialled at the same moment (see the test above).
    std::thread::sleep(Duration::from_millis(2000));
    assert_eq!((links_up(a)?, links_up(b)?), (1, 1), "a second link between the same daemons");
    // The one link carries traffic both ways.
    every_opcode(a, b, true)
}

#[test]
fn a_late_nak_for_a_request_made_before_a_reset_leaves_the_reconnected_qp_alone() -> Result<()> {
    // A's send waits in RNR (B posts no receive), A's QP is reset and
    // connected again while B, stalled, still holds A's last try: B's RNR
    // NAK for it reaches the new QP, which has nothing outstanding. It must
    // be dropped (it failed the new QP: `errors.rs`'s reset test could meet
    // it whenever B answered late).
    let mut h = TwoHosts::start(true)?;
    let a = Side::with(&h.a.context()?, 4096, 64, vrdma_it::cap(8, 1), None)?;
    let b = Side::with(&h.b.context()?, 4096, 64, vrdma_it::cap(8, 1), None)?;
    for (x, y) in [(&a, &b), (&b, &a)] {
        x.qp.to_init(1, access_all())?;
        x.qp.to_rtr(&y.endpoint()?, Mtu::Mtu4096, 1)?;
        x.qp.to_rts(x.qp.psn(), 14, 7, 7)?;
    }
    let eb = b.endpoint()?;
    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
    std::thread::sleep(Duration::from_millis(20));
    h.b.proc.stop(WAIT)?;
    let reset = vrdma::QpAttr { qp_state: vrdma::QpState::Reset, ..Default::default() };
    a.qp.modify(&reset, vrdma::QpAttrMask::STATE)?;
    a.qp.to_init(1, access_all())?;
    a.qp.to_rtr(&eb, Mtu::Mtu4096, 1)?;
    a.qp.to_rts(a.qp.psn(), 14, 7, 7)?;
    // Long enough for A's engine to take the QP up again on its link.
    std::thread::sleep(Duration::from_millis(5));
    h.b.proc.kill(libc::SIGCONT);
    assert!(vrdma_it::poll_for(&a.cq, Duration::from_millis(100))?.is_empty());
    assert_eq!(a.qp.state(), vrdma::QpState::Rts, "a late NAK failed the reconnected QP");
    b.qp.post_recv(&[wr::recv(7, &[b.mr.sge(0, 64)?])?])?;
    a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 8)?])?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 2, WcOpcode::Send);
    Ok(())
}
