//! Two hosts as two network namespaces joined by a veth pair, one daemon
//! in each (`NetnsHosts`): every opcode across the veth, a cut link, a
//! stalled connection, a stranger on the wire port. Each test makes and
//! removes its own namespaces; without root or iproute2 it is skipped with
//! a printed notice.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::WcOpcode;
use vrdma_it::across::{check, every_opcode, new_pairs_work_again, outstanding_writes_fail, pair};
use vrdma_it::{poll_one, run_cmd, NetnsHosts, WAIT};

#[test]
fn every_opcode_across_a_veth() -> Result<()> {
    let Some(h) = NetnsHosts::start("")? else { return Ok(()) };
    every_opcode(&h.a, &h.b, false)?;
    every_opcode(&h.a, &h.b, true)
}

#[test]
fn a_cut_link_ends_in_retry_exc_err_and_new_qps_connect_once_it_is_back() -> Result<()> {
    let Some(mut h) = NetnsHosts::start("")? else { return Ok(()) };
    let (a, b) = pair(&h.a, &h.b, false)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
    // Cut on b's side: a's packets vanish, as on a pulled cable.
    h.net.link(1, false)?;
    let cut = std::time::Instant::now();
    // The QP's timeout (14: 67 ms) and retry count (7) allow about 0.5 s.
    let took = outstanding_writes_fail(&a, &b, 4, Duration::from_secs(5));
    // Down longer than dead_ms (1.5 s): the daemons give the TCP link up,
    // and new QPs need a new one.
    std::thread::sleep(Duration::from_millis(2000).saturating_sub(cut.elapsed()));
    h.net.link(1, true)?;
    println!("cut: failed after {:?}", took?);
    let tries = new_pairs_work_again(&h.a, &h.b, Duration::from_secs(15))?;
    println!("new pairs worked after {tries} tries");
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn a_stalled_connection_ends_in_retry_exc_err() -> Result<()> {
    let Some(mut h) = NetnsHosts::start("")? else { return Ok(()) };
    if !h.has_netem(1) {
        // (two_hosts.rs stalls a peer daemon with SIGSTOP instead.)
        println!("skipping: tc cannot add a netem qdisc here (no sch_netem)");
        return Ok(());
    }
    let (a, b) = pair(&h.a, &h.b, false)?;
    a.qp.post_send(&[wr::rdma_write(1, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
    check(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::RdmaWrite);
    let (ns, dev) = (h.net.ns[1].clone(), h.net.veth[1].clone());
    run_cmd(&["tc", "-n", &ns, "qdisc", "add", "dev", &dev, "root", "netem", "loss", "100%"])?;
    let took = outstanding_writes_fail(&a, &b, 4, Duration::from_secs(5));
    run_cmd(&["tc", "-n", &ns, "qdisc", "del", "dev", &dev, "root"])?;
    println!("stalled: failed after {:?}", took?);
    new_pairs_work_again(&h.a, &h.b, Duration::from_secs(15))?;
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}

#[test]
fn a_stranger_in_the_peer_namespace_is_dropped_and_harms_no_one() -> Result<()> {
    let Some(mut h) = NetnsHosts::start("")? else { return Ok(()) };
    let (a, b) = pair(&h.a, &h.b, false)?;
    // From host b's namespace, garbage to host a's wire port.
    let to = format!("{}:{}", h.net.addr[0], h.port);
    let dropped = h.net.on_host(1, Duration::from_secs(15), move || -> Result<bool> {
        let mut s = std::net::TcpStream::connect(&to)?;
        let _ = s.write_all(&vrdma_it::pattern(64 << 10, 3));
        s.set_read_timeout(Some(Duration::from_secs(8)))?;
        let mut buf = [0u8; 4096];
        let end = std::time::Instant::now() + Duration::from_secs(8);
        loop {
            match s.read(&mut buf) {
                Ok(0) => return Ok(true),
                Ok(_) if std::time::Instant::now() < end => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(true),
                _ => return Ok(false),
            }
        }
    })?;
    assert!(dropped, "the stranger was not dropped");
    for i in 0..10u64 {
        a.qp.post_send(&[wr::rdma_write(i, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey())?.signaled()])?;
        check(&poll_one(&a.cq, WAIT)?, i, WcOpcode::RdmaWrite);
    }
    assert!(h.a.is_alive() && h.b.is_alive());
    Ok(())
}
