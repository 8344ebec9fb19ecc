//! Live migration driven on real daemons (`docs/migration.md`): three
//! daemons that play three hosts in three network namespaces on a bridge
//! (three loopback addresses where namespaces cannot be made), a tenant's
//! QP on A connected RC to a peer on B, and the operator's calls
//! (`vrdma::migrate`, what `vrdma migrate` runs).
//!
//! What moves here and what does not: a process cannot move between
//! hosts, and the daemon maps memory only for a VM's imported tenant (in
//! its region: `migrate_vm.rs`). So the tests here move device state only:
//! - pause on A with the peer's sends held PAUSED (past the peer's own
//!   transport timeout), export, an import on C that is refused because
//!   the tenant has memory C cannot map, and the cancel (resume on A):
//!   every held message then arrives once and in order, the traffic goes
//!   on;
//! - a tenant whose QP has no memory region moves A → C for real (pause,
//!   export, import on a C that serves another tenant, finish on A,
//!   resume on C): its numbers are kept, its session on A ends, and the
//!   peer on B accepts C's Moved frame and from then on sends to C, its QP
//!   in RTS throughout.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use vrdma::wr::{self, SendWrExt};
use vrdma::{QpState, WcOpcode, WcStatus};
use vrdma_core::hca::Path as QpPath;
use vrdma_it::protocol::Said;
use vrdma_it::{access_all, poll_for, poll_n, PeerProc, Side, ThreeHosts, WAIT};

const NOBODY: u32 = 65534;

fn uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The GID of the host a QP of `ctx` numbered `qpn` sends to now.
fn peer_host(ctx: &vrdma::Context, qpn: u32) -> Result<Option<vrdma::Gid>> {
    let s = ctx.stat()?;
    let Some(q) = s.qps.iter().find(|q| q.qpn == qpn) else { bail!("QP {qpn:#x} not in stat") };
    Ok(match q.path {
        QpPath::Link(Some(l)) => s.links.iter().find(|x| x.id == l).map(|x| x.info.gid),
        _ => None,
    })
}

/// Pause on A holds the peer's sends (PAUSED, no retry spent, past its
/// transport timeout); an import on C of a tenant with memory is refused
/// clearly; the cancel (resume on A) delivers every held message once and
/// in order, and the connection goes on.
#[test]
fn a_paused_tenant_holds_its_peer_and_a_cancel_delivers_every_message_once_in_order() -> Result<()> {
    let h = ThreeHosts::start(["", "", ""])?;
    let (a, b) = vrdma_it::across::pair(&h.a, &h.b, true)?;
    let tenant = uid();
    const N: u64 = 6;
    for i in 0..N {
        a.qp.post_recv(&[wr::recv(100 + i, &[a.mr.sge(i as usize * 64, 64)?])?])?;
    }
    // Before: one message.
    b.mr.write(0, &[7u8; 64])?;
    b.qp.post_send(&[wr::send(0, &[b.mr.sge(0, 64)?])?.signaled()])?;
    vrdma_it::across::check(&poll_n(&b.cq, 1, WAIT)?[0], 0, WcOpcode::Send);
    assert_eq!(poll_n(&a.cq, 1, WAIT)?[0].wr_id, 100);

    assert_eq!(vrdma::migrate::pause(&h.a.socket, tenant)?, 1);
    for i in 1..N {
        b.mr.write(i as usize * 64, &[i as u8; 64])?;
        b.qp.post_send(&[wr::send(i, &[b.mr.sge(i as usize * 64, 64)?])?.signaled()])?;
    }
    // The peer's QP (timeout 2^14 × 4 µs ≈ 67 ms, 7 retries: about half
    // a second) would have failed RETRY_EXC_ERR by now if it spent retries.
    let held = poll_for(&b.cq, Duration::from_millis(1500))?;
    assert!(held.is_empty(), "completions while the responder is paused: {held:?}");
    assert!(poll_for(&a.cq, Duration::from_millis(10))?.is_empty());
    assert_eq!(b.qp.query()?.0.qp_state, QpState::Rts);

    // Export; C cannot map this tenant's memory (no VM region moves yet).
    let (snap, len, qps) = vrdma::migrate::export(&h.a.socket, tenant)?;
    assert!(len > 0 && qps == 1, "{len} bytes, {qps} QPs");
    let e = vrdma::migrate::import(&h.c.socket, snap.as_fd()).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("no memory for region"), "{e}");
    // A non-operator may not pause anyone (root only can run as nobody).
    if tenant == 0 {
        let p = PeerProc::spawn_as(&h.a.socket, "migrate-pause", &["--tenant", "0"], Some(NOBODY))?;
        match p.recv::<Said>(Duration::from_secs(20))? {
            Said::Error { errno, message } => {
                assert_eq!(errno, libc::EPERM, "{message}");
                assert!(message.contains("for the operator"), "{message}");
            }
            other => panic!("uid {NOBODY} paused tenant 0: {other:?}"),
        }
    } else {
        vrdma_it::skip("the non-operator check needs root (to run as nobody)");
    }

    // Cancel: resume where it was.
    assert_eq!(vrdma::migrate::resume(&h.a.socket, tenant)?, 1);
    let sent = poll_n(&b.cq, (N - 1) as usize, WAIT)?;
    assert_eq!(
        sent.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        (1..N).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    let got = poll_n(&a.cq, (N - 1) as usize, WAIT)?;
    assert_eq!(
        got.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (101..100 + N).collect::<Vec<_>>(),
        "once, in order"
    );
    for i in 1..N {
        let mut m = [0u8; 64];
        a.mr.read(i as usize * 64, &mut m)?;
        assert_eq!(m, [i as u8; 64], "message {i}");
    }
    let late = poll_for(&a.cq, Duration::from_millis(200))?;
    assert!(late.is_empty(), "a message delivered twice: {late:?}");
    // The connection goes on, both ways.
    b.qp.post_recv(&[wr::recv(9, &[b.mr.sge(4096, 8)?])?])?;
    a.qp.post_send(&[wr::send(8, &[a.mr.sge(0, 8)?])?.signaled()])?;
    vrdma_it::across::check(&poll_n(&a.cq, 1, WAIT)?[0], 8, WcOpcode::Send);
    assert_eq!(poll_n(&b.cq, 1, WAIT)?[0].wr_id, 9);
    Ok(())
}

/// A tenant's QP without memory regions moves A → C: numbers kept, its
/// session on A ended, the peer on B follows C's Moved frame and its QP
/// stays in RTS.
#[test]
fn a_tenant_without_memory_moves_to_a_busy_host_and_its_peer_follows() -> Result<()> {
    let h = ThreeHosts::start(["", "", ""])?;
    let tenant = uid();
    // C already serves another tenant (a uid of its own where we can).
    let other_c =
        if tenant == 0 { Some(PeerProc::spawn_as(&h.c.socket, "tenant", &[], Some(NOBODY))?) } else { None };
    if let Some(p) = &other_c {
        p.hello()?;
    }
    let ctx_a = h.a.context()?;
    let pd = ctx_a.alloc_pd()?;
    let cq = ctx_a.create_cq(64, None)?;
    let qp = pd.create_rc_qp(&cq, &cq, vrdma_it::cap(16, 1))?;
    let b = Side::new(&h.b.context()?, 4096)?;
    let (mut ea, mut eb) = (qp.endpoint(&ctx_a)?, b.endpoint()?);
    ea.lid = 0;
    eb.lid = 0;
    qp.connect(&eb, access_all())?;
    b.qp.connect(&ea, access_all())?;
    // A zero-byte send from B, so that B's QP has sent over a link.
    qp.post_recv(&[wr::recv(1, &[])?])?;
    b.qp.post_send(&[wr::send(2, &[])?.signaled()])?;
    vrdma_it::across::check(&poll_n(&b.cq, 1, WAIT)?[0], 2, WcOpcode::Send);
    assert_eq!(poll_n(&cq, 1, WAIT)?[0].wr_id, 1);
    assert_eq!(peer_host(&b.ctx, b.qp.qpn())?, Some(h.gid(0)), "B sends to A");

    let qpn = qp.qpn();
    assert_eq!(vrdma::migrate::pause(&h.a.socket, tenant)?, 1);
    let (snap, _, _) = vrdma::migrate::export(&h.a.socket, tenant)?;
    assert_eq!(vrdma::migrate::import(&h.c.socket, snap.as_fd())?, (tenant, 1));
    // Imported twice: the numbers are in use now.
    let e = vrdma::migrate::import(&h.c.socket, snap.as_fd()).unwrap_err();
    assert!(e.to_string().contains("collides with this host"), "{e}");
    assert_eq!(vrdma::migrate::finish(&h.a.socket, tenant)?, (1, 1));
    assert_eq!(vrdma::migrate::resume(&h.c.socket, tenant)?, 1);
    // A's session ended: its context answers nothing more.
    let end = Instant::now() + WAIT;
    while qp.query().is_ok() {
        if Instant::now() > end {
            bail!("the moved tenant's context on A still answers");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // B follows the Moved frame to C; its QP never left RTS.
    let end = Instant::now() + WAIT;
    while peer_host(&b.ctx, b.qp.qpn())? != Some(h.gid(2)) {
        if Instant::now() > end {
            bail!("B's QP still sends to {:?}, not C", peer_host(&b.ctx, b.qp.qpn())?);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(b.qp.query()?.0.qp_state, QpState::Rts);
    // Nothing can move twice from A, which holds nothing of it now.
    let e = vrdma::migrate::pause(&h.a.socket, tenant).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    // On C the QP keeps its number (in A's number space, not C's).
    let e = vrdma::migrate::export(&h.c.socket, tenant).unwrap_err();
    assert!(e.to_string().contains("not paused"), "{e}");
    assert_ne!(qpn >> 16, 0, "A numbers in a space of its own: {qpn:#x}");
    // A serves on: a new connection from A to B carries a message.
    let (a2, b2) = vrdma_it::across::pair(&h.a, &h.b, true)?;
    b2.qp.post_recv(&[wr::recv(5, &[b2.mr.sge(0, 8)?])?])?;
    a2.qp.post_send(&[wr::send(6, &[a2.mr.sge(0, 8)?])?.signaled()])?;
    vrdma_it::across::check(&poll_n(&a2.cq, 1, WAIT)?[0], 6, WcOpcode::Send);
    assert_eq!(poll_n(&b2.cq, 1, WAIT)?[0].wr_id, 5);
    drop(other_c);
    Ok(())
}

/// `migration_pause_limit_ms` (the peer's daemon configuration) bounds how
/// long a peer's request waits on a paused QP: with 1 s configured on B,
/// B's send to A's paused QP fails `RETRY_EXC_ERR` after about a second,
/// not the default 5 s, and B's QP goes to ERR. The bounds are loose (a
/// loaded machine): not before most of the second, well before 5 s.
#[test]
fn a_shorter_migration_pause_limit_fails_the_peers_request_after_it() -> Result<()> {
    const LIMIT: Duration = Duration::from_millis(1000);
    let b_extra = format!("migration_pause_limit_ms = {}", LIMIT.as_millis());
    let h = ThreeHosts::start(["", &b_extra, ""])?;
    let (a, b) = vrdma_it::across::pair(&h.a, &h.b, true)?;
    let tenant = uid();
    a.qp.post_recv(&[wr::recv(100, &[a.mr.sge(0, 64)?])?])?;
    assert_eq!(vrdma::migrate::pause(&h.a.socket, tenant)?, 1);
    let posted = Instant::now();
    b.qp.post_send(&[wr::send(1, &[b.mr.sge(0, 64)?])?.signaled()])?;
    let wc = poll_n(&b.cq, 1, Duration::from_secs(15))?;
    let waited = posted.elapsed();
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::RetryExcErr), "{wc:?}");
    assert!(waited >= LIMIT - Duration::from_millis(100), "failed after {waited:?}, before the bound");
    assert!(waited < Duration::from_millis(3500), "failed after {waited:?}: the default 5 s, not {LIMIT:?}?");
    assert_eq!(b.qp.query()?.0.qp_state, QpState::Err);
    assert_eq!(vrdma::migrate::resume(&h.a.socket, tenant)?, 1);
    Ok(())
}
