//! Every RC opcode through a real daemon, between the test process and a
//! tenant peer process (or two contexts of the test process where the
//! check needs both ends at hand).
//!
//! Every test runs in both topologies: both ends on one daemon, and the
//! peer (or the second context) on a second daemon across the TCP
//! transport (`name::one_host`, `name::two_hosts`).

use std::time::Duration;

use anyhow::Result;
use vrdma::wr::{self, SendWrExt};
use vrdma::{WcOpcode, WcStatus};
use vrdma_it::protocol::{digest, Command, Hello, Said, Wc};
use vrdma_it::{
    access_all, cap, connect, in_both_topologies, le, pattern, poll_for, poll_n, poll_one, Hosts, PeerProc,
    Side, Topology, WAIT,
};

/// The test's side connected to a peer process's QP. Fields drop in
/// order: our objects, then the peer, then the daemon.
struct Remote {
    me: Side,
    peer: PeerProc,
    hello: Hello,
    _hosts: Hosts,
}

fn remote(t: Topology, mr_len: usize, peer_args: &[&str]) -> Result<Remote> {
    let hosts = Hosts::start(t)?;
    let ctx = hosts.a().context()?;
    let me = Side::with(&ctx, mr_len, 2048, cap(1024, 4), None)?;
    let mut peer = PeerProc::spawn(&hosts.b().socket, "tenant", peer_args)?;
    let hello = peer.hello()?;
    me.qp.connect(&hello.endpoint, access_all())?;
    peer.call_ok(&Command::Connect { peer: me.endpoint()? })?;
    Ok(Remote { me, peer, hello, _hosts: hosts })
}

/// Two sides of the test process, each its own context, connected.
struct Local {
    a: Side,
    b: Side,
    _hosts: Hosts,
}

fn local(t: Topology, mr_len: usize) -> Result<Local> {
    let hosts = Hosts::start(t)?;
    let a = Side::new(&hosts.a().context()?, mr_len)?;
    let b = Side::new(&hosts.b().context()?, mr_len)?;
    connect(&a, &b)?;
    Ok(Local { a, b, _hosts: hosts })
}

fn check_wc(wc: &vrdma::WorkCompletion, wr_id: u64, opcode: WcOpcode) {
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, opcode), "{wc:?}");
}

fn send_with_and_without_immediate(t: Topology) -> Result<()> {
    let mut r = remote(t, 1 << 16, &[])?;
    let first = pattern(1000, 1);
    let second = pattern(777, 2);
    r.me.mr.write(0, &first)?;
    r.me.mr.write(8192, &second)?;
    let me_qpn = r.me.qp.qpn();

    r.peer.call_ok(&Command::PostRecv { count: 1, offset: 4096, len: 2048 })?;
    r.me.qp.post_send(&[wr::send(7, &[r.me.mr.sge(0, first.len())?])?.signaled()])?;
    check_wc(&poll_one(&r.me.cq, WAIT)?, 7, WcOpcode::Send);
    let got = r.peer.poll(1, WAIT)?;
    let recv = WcOpcode::Recv.raw();
    assert_eq!(
        got,
        vec![Wc { wr_id: 0, status: 0, opcode: recv, byte_len: 1000, imm: None, src_qp: me_qpn }]
    );
    assert_eq!(r.peer.read(4096, first.len())?, first);

    r.peer.call_ok(&Command::PostRecv { count: 1, offset: 16384, len: 1024 })?;
    let send = wr::send(8, &[r.me.mr.sge(8192, second.len())?])?.with_imm(0xdead_beef).signaled();
    assert_eq!(send.opcode, vrdma::SendOpcode::SendWithImm);
    r.me.qp.post_send(&[send])?;
    check_wc(&poll_one(&r.me.cq, WAIT)?, 8, WcOpcode::Send);
    let got = r.peer.poll(1, WAIT)?;
    let want =
        Wc { wr_id: 0, status: 0, opcode: recv, byte_len: 777, imm: Some(0xdead_beef), src_qp: me_qpn };
    assert_eq!(got, vec![want]);
    assert_eq!(r.peer.read(16384, second.len())?, second);
    // The first message was not touched by the second.
    assert_eq!(r.peer.read(4096, first.len())?, first);
    Ok(())
}

fn rdma_write_into_the_peers_region(t: Topology) -> Result<()> {
    let mut r = remote(t, 1 << 16, &[])?;
    let data = pattern(3000, 3);
    r.me.mr.write(100, &data)?;
    let before = r.peer.read(12_345 - 16, 16)?;
    let w = wr::rdma_write(1, &[r.me.mr.sge(100, data.len())?], r.hello.addr + 12_345, r.hello.rkey)?;
    r.me.qp.post_send(&[w.signaled()])?;
    let wc = poll_one(&r.me.cq, WAIT)?;
    check_wc(&wc, 1, WcOpcode::RdmaWrite);
    assert_eq!(r.peer.read(12_345, data.len())?, data);
    // Exactly the named bytes: the ones before are untouched.
    assert_eq!(r.peer.read(12_345 - 16, 16)?, before);
    // A plain write consumes no receive at the peer.
    assert_eq!(r.peer.poll(1, Duration::from_millis(50))?, vec![]);
    Ok(())
}

fn rdma_write_with_immediate(t: Topology) -> Result<()> {
    let mut r = remote(t, 1 << 16, &[])?;
    let data = pattern(5000, 4);
    r.me.mr.write(0, &data)?;
    r.peer.call_ok(&Command::PostRecv { count: 1, offset: 0, len: 0 })?;
    let w = wr::rdma_write(9, &[r.me.mr.sge(0, data.len())?], r.hello.addr + 65_536, r.hello.rkey)?
        .with_imm(0x1234_5678)
        .signaled();
    assert_eq!(w.opcode, vrdma::SendOpcode::RdmaWriteWithImm);
    r.me.qp.post_send(&[w])?;
    check_wc(&poll_one(&r.me.cq, WAIT)?, 9, WcOpcode::RdmaWrite);
    let got = r.peer.poll(1, WAIT)?;
    let want = Wc {
        wr_id: 0,
        status: 0,
        opcode: WcOpcode::RecvRdmaWithImm.raw(),
        byte_len: 5000,
        imm: Some(0x1234_5678),
        src_qp: r.me.qp.qpn(),
    };
    assert_eq!(got, vec![want]);
    assert_eq!(r.peer.read(65_536, data.len())?, data);
    Ok(())
}

fn rdma_read_from_the_peers_region(t: Topology) -> Result<()> {
    let mut r = remote(t, 1 << 16, &[])?;
    let data = pattern(5000, 5);
    r.peer.call_ok(&Command::Fill { offset: 100_000, data: data.clone() })?;
    let rd = wr::rdma_read(3, &[r.me.mr.sge(10, data.len())?], r.hello.addr + 100_000, r.hello.rkey)?;
    r.me.qp.post_send(&[rd.signaled()])?;
    let wc = poll_one(&r.me.cq, WAIT)?;
    check_wc(&wc, 3, WcOpcode::RdmaRead);
    assert_eq!(wc.byte_len, 5000);
    let mut got = vec![0u8; data.len()];
    r.me.mr.read(10, &mut got)?;
    assert_eq!(got, data);
    // Reading leaves the source as it was.
    assert_eq!(r.peer.read(100_000, data.len())?, data);
    Ok(())
}

fn atomics_return_the_old_value_and_update_the_peer(t: Topology) -> Result<()> {
    let mut r = remote(t, 1 << 16, &[])?;
    let (addr, rkey) = (r.hello.addr + 64, r.hello.rkey);
    r.peer.call_ok(&Command::Fill { offset: 64, data: le(10) })?;
    let result = r.me.mr.sge(0, 8)?;
    let run = |wr: vrdma::SendWr, opcode: WcOpcode| -> Result<u64> {
        let id = wr.wr_id;
        r.me.mr.write_u64(0, 0xffff_ffff_ffff_ffff)?;
        r.me.qp.post_send(&[wr.signaled()])?;
        let wc = poll_one(&r.me.cq, WAIT)?;
        check_wc(&wc, id, opcode);
        assert_eq!(wc.byte_len, 8);
        Ok(r.me.mr.read_u64(0)?)
    };
    // Compare matches: swapped.
    assert_eq!(run(wr::cmp_swap(1, result, addr, rkey, 10, 99), WcOpcode::CompSwap)?, 10);
    assert_eq!(r.peer.read(64, 8)?, le(99));
    // Compare does not match: unchanged, the old value still returned.
    assert_eq!(run(wr::cmp_swap(2, result, addr, rkey, 5, 7), WcOpcode::CompSwap)?, 99);
    assert_eq!(r.peer.read(64, 8)?, le(99));
    // Fetch and add.
    assert_eq!(run(wr::fetch_add(3, result, addr, rkey, 5), WcOpcode::FetchAdd)?, 99);
    assert_eq!(r.peer.read(64, 8)?, le(104));
    // It wraps as a 64-bit add.
    assert_eq!(run(wr::fetch_add(4, result, addr, rkey, u64::MAX), WcOpcode::FetchAdd)?, 104);
    assert_eq!(r.peer.read(64, 8)?, le(103));
    // The neighbouring words are untouched.
    assert_eq!(r.peer.read(56, 8)?, le(0));
    assert_eq!(r.peer.read(72, 8)?, le(0));
    Ok(())
}

fn scatter_gather_three_sges_into_two(t: Topology) -> Result<()> {
    let l = local(t, 1 << 16)?;
    let (a, b) = (&l.a, &l.b);
    let other = a.pd.alloc_mr(4096, access_all())?;
    let (p1, p2, p3) = (pattern(100, 6), pattern(300, 7), pattern(50, 8));
    a.mr.write(0, &p1)?;
    a.mr.write(5000, &p2)?;
    other.write(1000, &p3)?;
    let gather = [a.mr.sge(0, 100)?, a.mr.sge(5000, 300)?, other.sge(1000, 50)?];
    let whole: Vec<u8> = [p1.clone(), p2.clone(), p3.clone()].concat();

    // Send: gathered from three SGEs, scattered into two.
    b.mr.fill(0, 1 << 16, 0xee)?;
    b.qp.post_recv(&[wr::recv(5, &[b.mr.sge(0, 200)?, b.mr.sge(10_000, 250)?])?])?;
    a.qp.post_send(&[wr::send(1, &gather)?.signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::Send);
    let wc = poll_one(&b.cq, WAIT)?;
    check_wc(&wc, 5, WcOpcode::Recv);
    assert_eq!(wc.byte_len, 450);
    let mut first = vec![0u8; 200];
    let mut second = vec![0u8; 250];
    b.mr.read(0, &mut first)?;
    b.mr.read(10_000, &mut second)?;
    assert_eq!(first, whole[..200]);
    assert_eq!(second, whole[200..]);
    // Nothing beyond the SGEs was written.
    let mut after = [0u8; 8];
    b.mr.read(200, &mut after)?;
    assert_eq!(after, [0xee; 8]);
    b.mr.read(10_250, &mut after)?;
    assert_eq!(after, [0xee; 8]);

    // RDMA write gathers the same way; RDMA read scatters.
    a.qp.post_send(&[wr::rdma_write(2, &gather, b.mr.addr() + 30_000, b.mr.rkey())?.signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 2, WcOpcode::RdmaWrite);
    let mut got = vec![0u8; 450];
    b.mr.read(30_000, &mut got)?;
    assert_eq!(got, whole);
    let scatter = [a.mr.sge(40_000, 150)?, other.sge(2000, 300)?];
    a.qp.post_send(&[wr::rdma_read(3, &scatter, b.mr.addr() + 30_000, b.mr.rkey())?.signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 3, WcOpcode::RdmaRead);
    let mut x = vec![0u8; 150];
    let mut y = vec![0u8; 300];
    a.mr.read(40_000, &mut x)?;
    other.read(2000, &mut y)?;
    assert_eq!([x, y].concat(), whole);
    Ok(())
}

fn inline_data(t: Topology) -> Result<()> {
    let l = local(t, 1 << 16)?;
    let (a, b) = (&l.a, &l.b);
    assert_eq!(a.qp.cap().max_inline_data, 64);
    // The bytes come from the request itself, not from any region.
    let msg = *b"inline: no memory region holds these forty bytes";
    b.qp.post_recv(&[wr::recv(1, &[b.mr.sge(0, 128)?])?])?;
    a.qp.post_send(&[wr::send(10, &[])?.inline(&msg)?.signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 10, WcOpcode::Send);
    let wc = poll_one(&b.cq, WAIT)?;
    check_wc(&wc, 1, WcOpcode::Recv);
    assert_eq!(wc.byte_len as usize, msg.len());
    let mut got = vec![0u8; msg.len()];
    b.mr.read(0, &mut got)?;
    assert_eq!(got, msg);

    let w = wr::rdma_write(11, &[], b.mr.addr() + 999, b.mr.rkey())?.inline(&[7u8; 64])?.signaled();
    a.qp.post_send(&[w])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 11, WcOpcode::RdmaWrite);
    let mut got = [0u8; 66];
    b.mr.read(998, &mut got)?;
    assert_eq!(got[0], 0);
    assert_eq!(got[1..65], [7u8; 64]);
    assert_eq!(got[65], 0);

    // More than the QP's max_inline_data is refused when posting.
    let big = wr::send(12, &[])?.inline(&[1u8; 65])?;
    let e = a.qp.post_send(&[big]).unwrap_err();
    assert_eq!((e.index, e.errno()), (0, libc::EINVAL));
    // An inline read makes no sense and is refused too.
    let mut rd = wr::rdma_read(13, &[], b.mr.addr(), b.mr.rkey())?;
    rd.flags |= vrdma::SendFlags::INLINE;
    rd.inline_len = 8;
    assert_eq!(a.qp.post_send(&[rd]).unwrap_err().errno(), libc::EINVAL);
    // The QP still works.
    assert_eq!(a.qp.state(), vrdma::QpState::Rts);
    Ok(())
}

fn unsignaled_requests_complete_silently(t: Topology) -> Result<()> {
    let l = local(t, 1 << 16)?;
    let (a, b) = (&l.a, &l.b);
    let data = pattern(6 * 64, 9);
    a.mr.write(0, &data)?;
    let mut wrs = Vec::new();
    for i in 0..6u64 {
        let off = i as usize * 64;
        let w = wr::rdma_write(i, &[a.mr.sge(off, 64)?], b.mr.addr() + off as u64, b.mr.rkey())?;
        wrs.push(if i == 5 { w.signaled() } else { w });
    }
    a.qp.post_send(&wrs)?;
    // Completions come in order, so the unsignaled ones would come first.
    let wc = poll_one(&a.cq, WAIT)?;
    check_wc(&wc, 5, WcOpcode::RdmaWrite);
    let mut got = vec![0u8; data.len()];
    b.mr.read(0, &mut got)?;
    assert_eq!(got, data, "the unsignaled writes were carried out");
    assert!(poll_for(&a.cq, Duration::from_millis(50))?.is_empty());

    // With sq_sig_all every request completes.
    let all = a.pd.create_qp(&vrdma::QpInit::rc(&a.cq, &a.cq, cap(16, 1)).sig_all(true))?;
    let peer = b.another_qp(cap(16, 1))?;
    all.connect(&peer.endpoint(&b.ctx)?, access_all())?;
    peer.connect(&all.endpoint(&a.ctx)?, access_all())?;
    let w = |i: u64| wr::rdma_write(100 + i, &[a.mr.sge(0, 8)?], b.mr.addr(), b.mr.rkey());
    all.post_send(&[w(0)?, w(1)?, w(2)?])?;
    let ids: Vec<u64> = poll_n(&a.cq, 3, WAIT)?.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [100, 101, 102]);
    Ok(())
}

fn solicited_only_arming_fires_for_solicited_sends(t: Topology) -> Result<()> {
    let hosts = Hosts::start(t)?;
    let a = Side::new(&hosts.a().context()?, 4096)?;
    let ctx_b = hosts.b().context()?;
    let ch = ctx_b.create_comp_channel()?;
    let b = Side::with(&ctx_b, 4096, 64, cap(16, 1), Some(&ch))?;
    connect(&a, &b)?;
    b.qp.post_recv(&[wr::recv(1, &[b.mr.sge(0, 64)?])?, wr::recv(2, &[b.mr.sge(64, 64)?])?])?;
    b.cq.req_notify(true)?;

    a.qp.post_send(&[wr::send(1, &[a.mr.sge(0, 8)?])?.signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 1, WcOpcode::Send);
    let wc = poll_one(&b.cq, WAIT)?;
    check_wc(&wc, 1, WcOpcode::Recv);
    assert!(!wc.solicited);
    assert_eq!(ch.get_cq_event(Some(Duration::from_millis(200)))?, None, "an unsolicited send fired");

    a.qp.post_send(&[wr::send(2, &[a.mr.sge(0, 8)?])?.solicited().signaled()])?;
    check_wc(&poll_one(&a.cq, WAIT)?, 2, WcOpcode::Send);
    assert_eq!(ch.get_cq_event(Some(WAIT))?, Some(b.cq.cqn()));
    let wc = poll_one(&b.cq, WAIT)?;
    check_wc(&wc, 2, WcOpcode::Recv);
    assert!(wc.solicited);
    // One event per arming.
    assert_eq!(ch.get_cq_event(Some(Duration::from_millis(50)))?, None);
    Ok(())
}

fn large_write_arrives_intact(t: Topology) -> Result<()> {
    const LEN: usize = 8 << 20;
    let mr_len = LEN.to_string();
    let mut r = remote(t, LEN, &["--mr-len", &mr_len])?;
    assert_eq!(r.hello.mr_len, LEN);
    let data = pattern(LEN, 10);
    r.me.mr.write(0, &data)?;
    let w = wr::rdma_write(1, &[r.me.mr.sge_all()?], r.hello.addr, r.hello.rkey)?.signaled();
    r.me.qp.post_send(&[w])?;
    check_wc(&poll_one(&r.me.cq, Duration::from_secs(30))?, 1, WcOpcode::RdmaWrite);
    match r.peer.call(&Command::Digest { offset: 0, len: LEN })? {
        Said::Digest(d) => assert_eq!(d, digest(&data), "the peer's 8 MiB differ from what was written"),
        other => panic!("{other:?}"),
    }
    // And back: an 8 MiB read into a fresh region.
    let back = r.me.pd.alloc_mr(LEN, access_all())?;
    let rd = wr::rdma_read(2, &[back.sge_all()?], r.hello.addr, r.hello.rkey)?.signaled();
    r.me.qp.post_send(&[rd])?;
    let wc = poll_one(&r.me.cq, Duration::from_secs(30))?;
    check_wc(&wc, 2, WcOpcode::RdmaRead);
    assert_eq!(wc.byte_len as usize, LEN);
    assert!(back.to_vec() == data, "the 8 MiB read back differ");
    Ok(())
}

fn writes_are_visible_when_a_later_send_arrives(t: Topology) -> Result<()> {
    const N: u64 = 1000;
    let mut r = remote(t, 1 << 16, &[])?;
    for j in 1..=N {
        r.me.mr.write(8 * j as usize, &le(j))?;
    }
    r.peer.call_ok(&Command::PostRecv { count: 1, offset: 4096, len: 64 })?;
    // The peer reads its word the moment the send's completion arrives.
    r.peer.send(&Command::PollThenRead { timeout_ms: 20_000, offset: 0, len: 8 })?;
    let mut wrs = Vec::new();
    for j in 1..=N {
        wrs.push(wr::rdma_write(j, &[r.me.mr.sge(8 * j as usize, 8)?], r.hello.addr, r.hello.rkey)?);
    }
    wrs.push(wr::send(0, &[r.me.mr.sge(8, 8)?])?.signaled());
    r.me.qp.post_send(&wrs)?;
    check_wc(&poll_one(&r.me.cq, Duration::from_secs(30))?, 0, WcOpcode::Send);
    match r.peer.recv::<Said>(vrdma_it::PEER_TIMEOUT)? {
        Said::CompletionThenBytes(wc, bytes) => {
            assert_eq!((wc.status, wc.opcode, wc.byte_len), (0, WcOpcode::Recv.raw(), 8));
            assert_eq!(bytes, le(N), "the send overtook the writes posted before it");
        }
        other => panic!("{other:?}"),
    }
    Ok(())
}

fn threads_share_a_qp_and_a_context(t: Topology) -> Result<()> {
    const THREADS: u64 = 4;
    const EACH: u64 = 200;
    let l = std::sync::Arc::new(local(t, 1 << 16)?);
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let l = l.clone();
            std::thread::spawn(move || -> Result<()> {
                // Control calls from several threads at once, too.
                let _pd = l.a.ctx.alloc_pd()?;
                for i in 0..EACH {
                    let id = t * EACH + i;
                    let off = 8 * id as usize;
                    l.a.mr.write(off, &le(id))?;
                    let w = wr::rdma_write(
                        id,
                        &[l.a.mr.sge(off, 8)?],
                        l.b.mr.addr() + off as u64,
                        l.b.mr.rkey(),
                    )?
                    .signaled();
                    loop {
                        match l.a.qp.post_send(std::slice::from_ref(&w)) {
                            Ok(()) => break,
                            Err(e) if e.errno() == libc::ENOMEM => std::thread::yield_now(),
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    let wcs = poll_n(&l.a.cq, (THREADS * EACH) as usize, Duration::from_secs(30))?;
    for w in workers {
        w.join().expect("poster thread")?;
    }
    let mut ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
    // Each thread's requests complete in the order it posted them.
    for t in 0..THREADS {
        let mine: Vec<u64> = ids.iter().copied().filter(|id| id / EACH == t).collect();
        assert_eq!(mine, (t * EACH..(t + 1) * EACH).collect::<Vec<_>>());
    }
    ids.sort_unstable();
    assert_eq!(ids, (0..THREADS * EACH).collect::<Vec<_>>());
    for id in 0..THREADS * EACH {
        assert_eq!(l.b.mr.read_u64(8 * id as usize)?, id);
    }
    Ok(())
}

/// The engine serves only QPs with work: a QP that went idle is woken by
/// the post that names it. Threads post to many QPs with pauses, so that
/// QPs keep going idle and being posted to again, racing the engine's
/// leaving them idle. The daemons never sweep (`sweep_ms = 0`), so a
/// wake-up missed is a message that never arrives.
fn idle_qps_are_woken_by_every_post_without_a_sweep(t: Topology) -> Result<()> {
    const PAIRS: usize = 32;
    const THREADS: usize = 4;
    const ROUNDS: u64 = 60;
    let hosts = Hosts::start_with(t, "[engine]\nsweep_ms = 0\n")?;
    let (ca, cb) = (hosts.a().context()?, hosts.b().context()?);
    let pairs: Vec<(Side, Side)> = (0..PAIRS)
        .map(|_| {
            let (a, b) = (Side::new(&ca, 4096)?, Side::new(&cb, 4096)?);
            connect(&a, &b)?;
            Ok((a, b))
        })
        .collect::<Result<_>>()?;
    let started = std::time::Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = pairs
            .chunks(PAIRS / THREADS)
            .enumerate()
            .map(|(k, chunk)| {
                s.spawn(move || -> Result<()> {
                    for round in 0..ROUNDS {
                        for (i, (a, b)) in chunk.iter().enumerate() {
                            // Some QPs wait a little, so that the engine
                            // finds them idle before their next post.
                            if (round + i as u64 + k as u64).is_multiple_of(3) {
                                std::thread::sleep(Duration::from_micros(200));
                            }
                            b.qp.post_recv(&[wr::recv(round, &[b.mr.sge(0, 64)?])?])?;
                            a.mr.write(0, &round.to_le_bytes())?;
                            a.qp.post_send(&[wr::send(round, &[a.mr.sge(0, 8)?])?.signaled()])?;
                            check_wc(&poll_one(&a.cq, WAIT)?, round, WcOpcode::Send);
                            check_wc(&poll_one(&b.cq, WAIT)?, round, WcOpcode::Recv);
                            assert_eq!(b.mr.to_vec()[..8], round.to_le_bytes());
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a worker panicked")?;
        }
        Ok(())
    })?;
    println!("{} messages in {:?}", PAIRS as u64 * ROUNDS, started.elapsed());
    Ok(())
}

in_both_topologies!(
    idle_qps_are_woken_by_every_post_without_a_sweep,
    send_with_and_without_immediate,
    rdma_write_into_the_peers_region,
    rdma_write_with_immediate,
    rdma_read_from_the_peers_region,
    atomics_return_the_old_value_and_update_the_peer,
    scatter_gather_three_sges_into_two,
    inline_data,
    unsignaled_requests_complete_silently,
    solicited_only_arming_fires_for_solicited_sends,
    large_write_arrives_intact,
    writes_are_visible_when_a_later_send_arrives,
    threads_share_a_qp_and_a_context,
);
