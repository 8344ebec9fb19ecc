//! The direct path's grant rules (`hca::direct`): who gets a grant, and
//! every change that must end one.

use super::*;

fn revoked_window(env: &mut Env, qpn: u32) {
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Window { requester: qpn }]);
    assert!(!env.hca.direct_window_open(qpn));
}

#[test]
fn a_connected_pair_of_one_tenant_is_granted_its_peers_writable_region() {
    let (mut env, a, b) = Env::pair();
    let g = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    assert_eq!((g.requester, g.responder, g.key, g.addr), (a.qpn, b.qpn, b.buf.key, b.buf.addr));
    assert_eq!(g.len, 64 << 10);
    assert!(g.new_window && g.generation != 0);
    // The same key again: the same slot, no new window.
    let again = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    assert_eq!((again.slot, again.generation, again.new_window), (g.slot, g.generation, false));
    assert_eq!(env.hca.direct_counts(), (1, 1));
    assert!(env.hca.direct_revocations().is_empty(), "nothing changed");
}

#[test]
fn grants_are_refused_as_the_engine_would_refuse_every_remote_opcode() {
    let (mut env, a, b) = Env::pair();
    // Only the QP's owner may ask.
    assert_eq!(env.hca.direct_grant(C2, a.qpn, b.buf.key), Err(DirectRefusal::NotNow));
    // A key of the requester's own PD, not the peer's.
    assert_eq!(env.hca.direct_grant(C1, a.qpn, a.buf.key), Err(DirectRefusal::NotGranted));
    // A region of the peer's PD without any access.
    let none = env.mr(C2, b.pd, 4096, AccessFlags::empty());
    assert_eq!(env.hca.direct_grant(C1, a.qpn, none.key), Err(DirectRefusal::NotGranted));
    // With local write only: its receive SGEs may take a SEND, nothing
    // remote.
    let local = env.mr(C2, b.pd, 4096, AccessFlags::LOCAL_WRITE);
    assert_eq!(env.hca.direct_grant(C1, a.qpn, local.key).unwrap().rights, AccessFlags::LOCAL_WRITE);
    assert_eq!(env.hca.direct_grant(C1, a.qpn, 0xdead), Err(DirectRefusal::NotGranted));
    // A peer QP that allows no remote access at all.
    let mut env2 = Env::new();
    let x = env2.end(C1);
    let y = env2.end(C2);
    let c = Conn { access: AccessFlags::empty(), ..Conn::default() };
    env2.connect_with(x.qpn, y.qpn, c);
    env2.connect_with(y.qpn, x.qpn, c);
    // Its regions' local write stays: receives take SENDs whatever the
    // access flags.
    assert_eq!(env2.hca.direct_grant(C1, x.qpn, y.buf.key).unwrap().rights, AccessFlags::LOCAL_WRITE);
}

#[test]
fn a_grant_carries_the_rights_both_the_region_and_the_peer_qp_allow() {
    let (mut env, a, b) = Env::pair();
    assert_eq!(env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap().rights, DIRECT_RIGHTS | DIRECT_LOCAL);
    // A read-only region: reads only (and local write, for receives).
    let ro = env.mr(C2, b.pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    assert_eq!(
        env.hca.direct_grant(C1, a.qpn, ro.key).unwrap().rights,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ
    );
    let at = env.mr(C2, b.pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC);
    assert_eq!(
        env.hca.direct_grant(C1, a.qpn, at.key).unwrap().rights,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC
    );
    // A peer QP allowing reads and writes, a region allowing writes and
    // atomics: writes only.
    let mut env2 = Env::new();
    let x = env2.end(C1);
    let y = env2.end(C2);
    let c = Conn { access: AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE, ..Conn::default() };
    env2.connect_with(x.qpn, y.qpn, c);
    env2.connect_with(y.qpn, x.qpn, c);
    let wa = env2.mr(
        C2,
        y.pd,
        4096,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
    );
    assert_eq!(
        env2.hca.direct_grant(C1, x.qpn, wa.key).unwrap().rights,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE
    );
    assert_eq!(
        env2.hca.direct_grant(C1, x.qpn, y.buf.key).unwrap().rights,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE
    );
}

#[test]
fn a_change_of_the_peer_qps_access_flags_revokes_the_slot_and_a_new_grant_has_the_new_rights() {
    let (mut env, a, b) = Env::pair();
    let g = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    assert_eq!(g.rights, DIRECT_RIGHTS | DIRECT_LOCAL);
    // RTS to RTS, reads only from now on: the pair is still served.
    let attr =
        QpAttr { qp_state: QpState::Rts, qp_access_flags: AccessFlags::REMOTE_READ, ..QpAttr::default() };
    env.modify(b.qpn, &attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS).unwrap();
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Slot { requester: a.qpn, slot: g.slot }]);
    assert!(env.hca.direct_window_open(a.qpn));
    let g2 = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    assert_eq!(g2.rights, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
    assert_ne!(g2.generation, g.generation);
    // A modification that changes nothing the grant depends on keeps it.
    env.modify(b.qpn, &attr, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS).unwrap();
    assert!(env.hca.direct_revocations().is_empty());
    // No remote access left: local write only (receives).
    let none = QpAttr { qp_access_flags: AccessFlags::empty(), ..attr };
    env.modify(b.qpn, &none, QpAttrMask::STATE | QpAttrMask::ACCESS_FLAGS).unwrap();
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Slot { requester: a.qpn, slot: g2.slot }]);
    assert_eq!(env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap().rights, AccessFlags::LOCAL_WRITE);
}

#[test]
fn qps_of_different_tenants_never_get_a_grant() {
    let mut env = Env::new();
    let a = env.end(C1);
    let x = env.end(C3);
    env.connect(a.qpn, x.qpn);
    env.connect(x.qpn, a.qpn);
    assert_eq!(env.hca.direct_grant(C1, a.qpn, x.buf.key), Err(DirectRefusal::NotNow));
    assert_eq!(env.hca.direct_grant(C3, x.qpn, a.buf.key), Err(DirectRefusal::NotNow));
    assert_eq!(env.hca.direct_counts(), (0, 0));
}

#[test]
fn a_pair_not_yet_connected_both_ways_is_not_served() {
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    env.connect(a.qpn, b.qpn);
    // b is still in RESET: the engine would not place a write either.
    assert_eq!(env.hca.direct_grant(C1, a.qpn, b.buf.key), Err(DirectRefusal::NotNow));
    env.connect(b.qpn, a.qpn);
    assert!(env.hca.direct_grant(C1, a.qpn, b.buf.key).is_ok());
}

#[test]
fn deregistration_revokes_the_slot_and_a_slot_used_again_has_another_generation() {
    let (mut env, a, b) = Env::pair();
    let g = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    let other = env.mr(C2, b.pd, 4096, FULL);
    let g2 = env.hca.direct_grant(C1, a.qpn, other.key).unwrap();
    assert_ne!(g.slot, g2.slot);
    env.hca.dereg_mr(C2, b.buf.key).unwrap();
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Slot { requester: a.qpn, slot: g.slot }]);
    assert!(env.hca.direct_window_open(a.qpn), "the window and its other grants stay");
    assert_eq!(env.hca.direct_grant(C1, a.qpn, b.buf.key), Err(DirectRefusal::NotGranted));
    let third = env.mr(C2, b.pd, 4096, FULL);
    let g3 = env.hca.direct_grant(C1, a.qpn, third.key).unwrap();
    assert_eq!(g3.slot, g.slot, "the freed slot is used again");
    assert_ne!(g3.generation, g.generation, "a stale grant of the slot never matches");
}

#[test]
fn any_state_change_of_either_qp_closes_the_window() {
    for case in 0..5 {
        let (mut env, a, b) = Env::pair();
        env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
        let err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
        match case {
            0 => drop(env.modify(b.qpn, &err, QpAttrMask::STATE).unwrap()),
            1 => drop(env.modify(a.qpn, &err, QpAttrMask::STATE).unwrap()),
            2 => env.hca.destroy_qp(C2, b.qpn, &mut env.io).unwrap(),
            3 => drop(env.hca.close_context(C2, &mut env.io)),
            _ => {
                // The engine fails the pair: a write with a bad rkey.
                env.io
                    .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, 0xdead));
                env.run(T0);
                assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
            }
        }
        revoked_window(&mut env, a.qpn);
        assert!(env.hca.direct_revocations().is_empty(), "revoked once");
    }
}

#[test]
fn the_requesters_context_closing_drops_its_window() {
    let (mut env, a, b) = Env::pair();
    env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    env.hca.close_context(C1, &mut env.io);
    revoked_window(&mut env, a.qpn);
    assert_eq!(env.hca.direct_counts().0, 0);
}

#[test]
fn a_receive_grant_names_the_peers_receive_cq_and_is_asked_again_the_same() {
    let (mut env, a, b) = Env::pair();
    let g = env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    assert_eq!((g.requester, g.responder, g.recv_cq), (a.qpn, b.qpn, b.cq));
    assert!(g.new_window && g.generation != 0);
    assert_eq!(g.lid, env.hca.config().port.lid);
    let again = env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    assert_eq!((again.generation, again.new_window), (g.generation, false));
    // Key grants share its window.
    assert!(!env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap().new_window);
    assert_eq!(env.hca.direct_grant_recv(C2, a.qpn), Err(DirectRefusal::NotNow), "only the owner asks");
    assert!(env.hca.direct_revocations().is_empty());
}

#[test]
fn a_peer_with_an_srq_is_granted_the_srqs_receives_until_one_is_given_back() {
    let mut env = Env::new();
    let a = env.end(C1);
    let pd = env.hca.alloc_pd(C2).unwrap();
    let (cq, _) = env.hca.create_cq(C2, 64).unwrap();
    let (srq, _) = env.hca.create_srq(C2, pd, SrqAttr { max_wr: 8, max_sge: 3, srq_limit: 0 }).unwrap();
    let b = env.qp(C2, pd, qp_init(cq, cq, Some(srq)));
    env.connect(a.qpn, b);
    env.connect(b, a.qpn);
    let g = env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    assert_eq!((g.responder, g.recv_cq, g.srq, g.max_recv_sge), (b, cq, Some(srq), 3), "the SRQ's max_sge");
    let buf = env.mr(C2, pd, 4096, FULL);
    assert!(env.hca.direct_grant(C1, a.qpn, buf.key).unwrap().rights.contains(AccessFlags::LOCAL_WRITE));
    // The core holds a receive of the SRQ's: a claim would overtake it.
    env.hca.requeue_recv(b, recv(5, &[buf.sge(0, 8)]));
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Recv { requester: a.qpn }]);
    assert_eq!(env.hca.direct_grant_recv(C1, a.qpn), Err(DirectRefusal::NotNow));
}

#[test]
fn an_srq_of_another_pd_gives_no_local_write_for_receives() {
    let mut env = Env::new();
    let a = env.end(C1);
    let pd = env.hca.alloc_pd(C2).unwrap();
    let other = env.hca.alloc_pd(C2).unwrap();
    let (cq, _) = env.hca.create_cq(C2, 64).unwrap();
    let (srq, _) = env.hca.create_srq(C2, other, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 }).unwrap();
    let b = env.qp(C2, pd, qp_init(cq, cq, Some(srq)));
    env.connect(a.qpn, b);
    env.connect(b, a.qpn);
    // The QP's PD's region: remote rights, but no local write (the
    // engine checks receive SGEs in the SRQ's PD).
    let buf = env.mr(C2, pd, 4096, FULL);
    let rights = env.hca.direct_grant(C1, a.qpn, buf.key).unwrap().rights;
    assert!(!rights.contains(AccessFlags::LOCAL_WRITE) && rights.contains(AccessFlags::REMOTE_WRITE));
}

#[test]
fn the_srq_limit_for_direct_claims_fires_once_below_the_limit() {
    let mut env = Env::new();
    let a = env.end(C1);
    let pd = env.hca.alloc_pd(C2).unwrap();
    let (cq, _) = env.hca.create_cq(C2, 64).unwrap();
    let (srq, _) = env.hca.create_srq(C2, pd, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 2 }).unwrap();
    let b = env.qp(C2, pd, qp_init(cq, cq, Some(srq)));
    env.connect(a.qpn, b);
    env.connect(b, a.qpn);
    let buf = env.mr(C2, pd, 4096, FULL);
    for i in 0..2 {
        env.io.post_srq(srq, recv(i, &[buf.sge(0, 8)]));
    }
    // No receive grant yet: nothing.
    env.hca.direct_srq_limit(C1, a.qpn, &mut env.io);
    assert!(env.io.events.is_empty());
    env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    // Two posted, limit 2: not below.
    env.hca.direct_srq_limit(C1, a.qpn, &mut env.io);
    assert!(env.io.events.is_empty());
    // Another context's ask: nothing.
    assert!(env.io.pull_recv(RecvSource::Srq(srq)).is_some());
    env.hca.direct_srq_limit(C2, a.qpn, &mut env.io);
    assert!(env.io.events.is_empty());
    // One left: fires and disarms; asked again, nothing more.
    env.hca.direct_srq_limit(C1, a.qpn, &mut env.io);
    env.hca.direct_srq_limit(C1, a.qpn, &mut env.io);
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq })]
    );
    assert_eq!(env.hca.query_srq(C2, srq).unwrap().srq_limit, 0);
}

#[test]
fn a_receive_given_back_to_the_core_revokes_the_receive_grant_only() {
    let (mut env, a, b) = Env::pair();
    let k = env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap();
    env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    // The core holds a receive of b's that the ring no longer has: a claim
    // from the ring would overtake it.
    env.hca.requeue_recv(b.qpn, recv(5, &[b.buf.sge(0, 8)]));
    assert_eq!(env.hca.direct_revocations(), vec![Revocation::Recv { requester: a.qpn }]);
    assert!(env.hca.direct_window_open(a.qpn), "the window and its key grants stay");
    assert_eq!(env.hca.direct_grant(C1, a.qpn, b.buf.key).unwrap().generation, k.generation);
    assert_eq!(env.hca.direct_grant_recv(C1, a.qpn), Err(DirectRefusal::NotNow));
}

#[test]
fn the_peer_leaving_rts_revokes_the_receive_grant_with_its_window() {
    let (mut env, a, b) = Env::pair();
    env.hca.direct_grant_recv(C1, a.qpn).unwrap();
    let err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    env.modify(b.qpn, &err, QpAttrMask::STATE).unwrap();
    revoked_window(&mut env, a.qpn);
}

/// The driver is told, at each flush of a QP whose receives a requester
/// on this host may claim, whether that requester still exists (while it
/// does, its process may still claim: what it holds stays its own), and
/// is asked once more when the requester goes while the QP is in ERR
/// (`Queues::flush_claimed`); for an SRQ's QP and a QP's own queue, the
/// requester destroyed or its context closed.
#[test]
fn a_flush_says_whether_the_requester_is_gone_and_asks_again_when_it_goes() {
    let err = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    for (case, with_srq) in [(0, true), (1, true), (0, false), (1, false)] {
        let mut env = Env::new();
        let a = env.end(C1);
        let pd = env.hca.alloc_pd(C2).unwrap();
        let (cq, _) = env.hca.create_cq(C2, 64).unwrap();
        let srq = with_srq
            .then(|| env.hca.create_srq(C2, pd, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 }).unwrap().0);
        let b = env.qp(C2, pd, qp_init(cq, cq, srq));
        env.connect(a.qpn, b);
        env.connect(b, a.qpn);
        let rq = srq.map_or(RecvSource::Qp(b), RecvSource::Srq);
        // b flushed by its owner: the requester (a) exists.
        env.modify(b, &err, QpAttrMask::STATE).unwrap();
        env.run(T0);
        let calls = std::mem::take(&mut env.io.claimed_flushes);
        assert!(!calls.is_empty() && calls.iter().all(|&c| c == (b, rq, false)), "{calls:?}");
        // a goes: asked once more, the requester gone.
        match case {
            0 => env.hca.destroy_qp(C1, a.qpn, &mut env.io).unwrap(),
            _ => drop(env.hca.close_context(C1, &mut env.io)),
        }
        assert_eq!(env.io.claimed_flushes, vec![(b, rq, true)], "case {case}, SRQ {with_srq}");
        env.run(T0);
        assert!(env.io.claimed_flushes.iter().all(|&c| c == (b, rq, true)));
    }
    // The requester's process dies while b is in RTS: b goes to ERR
    // (peer lost), and every look finds the requester gone.
    let (mut env, _a, b) = Env::pair();
    drop(env.hca.close_context(C1, &mut env.io));
    env.run(T0);
    let calls = &env.io.claimed_flushes;
    assert!(
        !calls.is_empty() && calls.iter().all(|&c| c == (b.qpn, RecvSource::Qp(b.qpn), true)),
        "{calls:?}"
    );
}
