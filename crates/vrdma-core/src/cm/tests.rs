//! Two hosts' connection managers joined by a perfect network, and one
//! host's manager talking to itself: the exchanges rdma_cm programs make,
//! and what goes wrong with them.

use std::net::{Ipv4Addr, SocketAddrV4};

use super::*;

const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const TENANT: TenantId = TenantId(1000);
const OTHER: TenantId = TenantId(2000);
const CA: ContextId = ContextId(1);
const CB: ContextId = ContextId(2);
const T0: Instant = Instant(1_000_000_000);

/// Keys 0x101 apart from a start (also the migration tests' key source).
pub(super) struct Counter(pub(super) u32);

impl KeySource for Counter {
    fn next_key(&mut self) -> u32 {
        self.0 += 0x101;
        self.0
    }
}

/// Two hosts; messages to an address neither owns are lost.
struct Net {
    a: ConnectionManager,
    b: ConnectionManager,
    /// Messages carried, in order: (from, to, message).
    log: Vec<(Ipv4Addr, Ipv4Addr, CmMessage)>,
    /// While false, messages to B are dropped (B is dead).
    b_alive: bool,
}

impl Net {
    fn new() -> Net {
        Net {
            a: ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1))),
            b: ConnectionManager::new(CmConfig::default(), vec![B], Box::new(Counter(7))),
            log: Vec::new(),
            b_alive: true,
        }
    }

    fn cm(&mut self, host: Ipv4Addr) -> &mut ConnectionManager {
        if host == A {
            &mut self.a
        } else {
            &mut self.b
        }
    }

    /// Carries messages until none is left.
    fn run(&mut self) {
        for _ in 0..1000 {
            let mut moved = false;
            for from in [A, B] {
                while let Some((to, msg)) = self.cm(from).poll_transmit() {
                    moved = true;
                    self.log.push((from, to, msg.clone()));
                    if to == B && !self.b_alive || to != A && to != B {
                        continue;
                    }
                    self.cm(to).handle_message(from, msg);
                }
            }
            if !moved {
                return;
            }
        }
        panic!("messages without end");
    }

    fn events(&mut self, host: Ipv4Addr) -> Vec<CmEvent> {
        std::iter::from_fn(|| self.cm(host).poll_event()).collect()
    }

    /// A listener of `tenant` on `host`:`port`.
    fn listen(&mut self, host: Ipv4Addr, ctx: ContextId, tenant: TenantId, port: u16, backlog: i32) -> u32 {
        let cm = self.cm(host);
        let id = cm.create_id(ctx, tenant, PortSpace::Tcp).unwrap();
        cm.bind(ctx, id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)).unwrap();
        cm.listen(ctx, id, backlog).unwrap();
        id
    }

    /// An id on `host` with its route to `dst` resolved; its events taken.
    fn resolved(
        &mut self,
        host: Ipv4Addr,
        ctx: ContextId,
        tenant: TenantId,
        ps: PortSpace,
        dst: SocketAddrV4,
    ) -> u32 {
        let cm = self.cm(host);
        let id = cm.create_id(ctx, tenant, ps).unwrap();
        cm.resolve_addr(ctx, id, None, dst).unwrap();
        cm.resolve_route(ctx, id).unwrap();
        let kinds: Vec<_> = self.events(host).iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::AddrResolved, EventKind::RouteResolved]);
        id
    }
}

fn conn(qp_num: u32, private: &[u8]) -> ConnInfo {
    ConnInfo {
        qp_num,
        responder_resources: 4,
        initiator_depth: 2,
        rnr_retry_count: 6,
        private_data: private.to_vec(),
        ..ConnInfo::default()
    }
}

fn kinds(events: &[CmEvent]) -> Vec<EventKind> {
    events.iter().map(|e| e.kind).collect()
}

/// Connects an id on A to a listener of the same tenant on `to`, port
/// 7471, through accept and RTU; returns (active id, passive id).
fn established(net: &mut Net, to: Ipv4Addr, ctx_b: ContextId) -> (u32, u32) {
    let l = net.listen(to, ctx_b, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(to, 7471));
    net.a.connect(CA, a, conn(0x11, b"hello"), T0).unwrap();
    net.run();
    let ev = net.events(to);
    assert_eq!(kinds(&ev), [EventKind::ConnectRequest]);
    assert_eq!(ev[0].listen_id, Some(l));
    let b = ev[0].id;
    net.cm(to).accept(ctx_b, b, conn(0x22, b"welcome"), 0, T0).unwrap();
    net.run();
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::ConnectResponse]);
    net.a.establish(CA, a).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(to)), [EventKind::Established]);
    (a, b)
}

#[test]
fn a_connection_is_requested_accepted_established_and_disconnected_on_both_sides() {
    let mut net = Net::new();
    let l = net.listen(B, CB, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b"hello"), T0).unwrap();
    assert_eq!(net.a.state(CA, a), Some(State::ReqSent));
    net.run();
    let ev = net.events(B);
    assert_eq!(kinds(&ev), [EventKind::ConnectRequest]);
    let (b, req) = (ev[0].id, ev[0].peer.clone().unwrap());
    assert_eq!((ev[0].ctx, ev[0].listen_id), (CB, Some(l)));
    assert_eq!((req.qp_num, req.private_data.as_slice()), (0x11, &b"hello"[..]));
    let (local, remote) = net.b.addresses(CB, b).unwrap();
    assert_eq!(local, Some(SocketAddrV4::new(B, 7471)));
    assert_eq!(remote.map(|r| *r.ip()), Some(A), "the request's source");
    net.b.accept(CB, b, conn(0x22, b"welcome"), 0, T0).unwrap();
    net.run();
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::ConnectResponse]);
    assert_eq!(ev[0].peer.as_ref().unwrap().private_data, b"welcome");
    assert!(net.events(B).is_empty(), "no ESTABLISHED before the RTU");
    net.a.establish(CA, a).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(B)), [EventKind::Established]);
    assert_eq!(net.a.state(CA, a), Some(State::Established));
    assert_eq!(net.b.state(CB, b), Some(State::Established));

    // Each side's QP attributes point at the other's QP and first PSN.
    let (a_rtr, _) = net.a.init_qp_attr(CA, a, QpState::Rtr).unwrap();
    let (a_rts, _) = net.a.init_qp_attr(CA, a, QpState::Rts).unwrap();
    let (b_rtr, _) = net.b.init_qp_attr(CB, b, QpState::Rtr).unwrap();
    let (b_rts, _) = net.b.init_qp_attr(CB, b, QpState::Rts).unwrap();
    assert_eq!((a_rtr.dest_qp_num, b_rtr.dest_qp_num), (0x22, 0x11));
    assert_eq!(a_rtr.rq_psn, b_rts.sq_psn);
    assert_eq!(b_rtr.rq_psn, a_rts.sq_psn);
    assert_ne!(a_rts.sq_psn, b_rts.sq_psn);
    assert_eq!(a_rtr.ah_attr.dgid, crate::verbs::Gid::from_ipv4(B.octets()));
    assert_eq!(b_rtr.ah_attr.dgid, crate::verbs::Gid::from_ipv4(A.octets()));
    // Depths: B accepted with 4 responder resources and depth 2; A's
    // reads in flight are B's resources, and the other way round.
    assert_eq!((a_rts.max_rd_atomic, b_rtr.max_dest_rd_atomic), (4, 4));
    assert_eq!((b_rts.max_rd_atomic, a_rtr.max_dest_rd_atomic), (2, 2));
    let (a_init, _) = net.a.init_qp_attr(CA, a, QpState::Init).unwrap();
    assert!(a_init.qp_access_flags.contains(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ));

    net.a.disconnect(CA, a, T0).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(B)), [EventKind::Disconnected]);
    assert_eq!(kinds(&net.events(A)), [EventKind::Disconnected]);
    // Both sides may call it; the second is a no-op.
    net.b.disconnect(CB, b, T0).unwrap();
    net.run();
    assert!(net.events(A).is_empty() && net.events(B).is_empty());
}

#[test]
fn processes_of_one_host_connect_through_the_same_exchange() {
    let mut net = Net::new();
    let (a, b) = established(&mut net, A, CB);
    assert_eq!(net.a.state(CB, b), Some(State::Established));
    assert!(net.log.iter().all(|(from, to, _)| *from == A && *to == A), "nothing left the host");
    net.a.destroy_id(CA, a, T0).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::Disconnected], "the survivor hears the DREQ");
}

#[test]
fn another_tenants_listener_answers_as_no_listener_does() {
    let mut answers = Vec::new();
    for listener_tenant in [None, Some(OTHER)] {
        let mut net = Net::new();
        if let Some(t) = listener_tenant {
            net.listen(B, CB, t, 7471, 8);
        }
        let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
        net.a.connect(CA, a, conn(0x11, b"secret"), T0).unwrap();
        net.run();
        assert!(net.events(B).is_empty(), "the other tenant's listener hears nothing");
        let ev = net.events(A);
        assert_eq!(kinds(&ev), [EventKind::Rejected]);
        assert_eq!(ev[0].status, i32::from(reject::INVALID_SERVICE_ID));
        answers.push((ev, net.log.iter().map(|(_, _, m)| m.clone()).collect::<Vec<_>>()));
    }
    assert_eq!(answers[0], answers[1], "the same events and the same messages");
}

#[test]
fn a_rejection_carries_its_private_data() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    let b = net.events(B)[0].id;
    assert_eq!(net.b.reject(CB, b, vec![1; 149]).unwrap_err().errno(), errno::EINVAL);
    net.b.reject(CB, b, b"go away".to_vec()).unwrap();
    net.run();
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::Rejected]);
    assert_eq!(ev[0].status, i32::from(reject::CONSUMER_DEFINED));
    assert_eq!(ev[0].peer.as_ref().unwrap().private_data, b"go away");
}

#[test]
fn private_data_over_the_limit_is_refused_before_anything_is_sent() {
    let mut net = Net::new();
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    let err = net.a.connect(CA, a, conn(0x11, &[0; 57]), T0).unwrap_err();
    assert_eq!(err, CmError::PrivateDataTooLong { got: 57, max: 56 });
    assert!(net.a.poll_transmit().is_none());
    assert_eq!(net.a.state(CA, a), Some(State::RouteResolved), "and the id can try again");
    net.a.connect(CA, a, conn(0x11, &[0; 56]), T0).unwrap();
}

#[test]
fn a_listener_holds_its_backlog_of_unanswered_requests_and_no_more() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 2);
    let ids: Vec<u32> = (0..3)
        .map(|_| {
            let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
            net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
            net.run();
            a
        })
        .collect();
    let pending = net.events(B);
    assert_eq!(pending.len(), 2);
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::Rejected]);
    assert_eq!((ev[0].id, ev[0].status), (ids[2], i32::from(reject::NO_RESOURCES)));
    // Answering one frees its place.
    net.b.accept(CB, pending[0].id, conn(0x22, b""), 0, T0).unwrap();
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(B)), [EventKind::ConnectRequest]);
}

#[test]
fn a_request_never_answered_ends_unreachable_within_the_connect_timeout() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    let b = net.events(B)[0].id;
    let due = net.a.poll_timeout().unwrap();
    assert_eq!(due, T0 + CmConfig::default().connect_timeout);
    net.a.handle_timeout(Instant(due.0 - 1));
    assert!(net.events(A).is_empty(), "not before its time");
    net.a.handle_timeout(due);
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::Unreachable]);
    assert_eq!(ev[0].status, -errno::ETIMEDOUT);
    // The listener's application answers late: no one is waiting.
    net.run();
    assert!(
        net.b.accept(CB, b, conn(0x22, b""), 0, T0).is_err(),
        "told of the timeout: {:?}",
        net.b.state(CB, b)
    );
}

#[test]
fn a_reply_never_confirmed_ends_in_connect_error_on_the_passive_side() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    let b = net.events(B)[0].id;
    net.b.accept(CB, b, conn(0x22, b""), 0, T0).unwrap();
    net.b_alive = false;
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::ConnectResponse]);
    // A never establishes (its process hung); B gives up.
    let due = net.b.poll_timeout().unwrap();
    net.b.handle_timeout(due);
    let ev = net.events(B);
    assert_eq!((ev[0].kind, ev[0].status), (EventKind::ConnectError, -errno::ETIMEDOUT));
}

#[test]
fn a_lost_link_ends_every_connection_with_that_host() {
    let mut net = Net::new();
    let (a, _) = established(&mut net, B, CB);
    let pending = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 9999));
    net.b_alive = false;
    net.a.connect(CA, pending, conn(0x11, b""), T0).unwrap();
    net.run();
    net.a.link_down(B, None);
    let mut ev = net.events(A);
    ev.sort_by_key(|e| e.id);
    assert_eq!(ev.len(), 2);
    assert_eq!((ev[0].id, ev[0].kind), (a, EventKind::Disconnected));
    assert_eq!((ev[1].id, ev[1].kind), (pending, EventKind::Unreachable));
    assert!(net.a.poll_timeout().is_none(), "no timer left behind");
}

#[test]
fn a_closed_context_disconnects_its_peers_and_frees_its_ports() {
    let mut net = Net::new();
    let (_, b) = established(&mut net, B, CB);
    net.b.close_context(CB);
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::Disconnected]);
    assert_eq!(net.b.state(CB, b), None);
    // The listener's port is free again.
    net.listen(B, CB, TENANT, 7471, 8);
}

#[test]
fn messages_from_anyone_but_the_connections_peer_are_ignored() {
    let mut net = Net::new();
    let (a, b) = established(&mut net, B, CB);
    // A DREQ for A's connection, from the right host with the wrong
    // number, and from another host with the right one.
    net.a.handle_message(B, CmMessage::Dreq { to: a, from: b + 1 });
    net.a.handle_message(Ipv4Addr::new(10, 0, 0, 9), CmMessage::Dreq { to: a, from: b });
    net.a.handle_message(B, CmMessage::Rtu { to: a, from: b });
    assert!(net.events(A).is_empty());
    assert_eq!(net.a.state(CA, a), Some(State::Established));
    assert!(net.a.poll_transmit().is_none(), "nothing answered");
    // And a tenant's calls name only its own context's ids.
    assert_eq!(net.a.disconnect(CB, a, T0).unwrap_err(), CmError::NoSuchId);
}

#[test]
fn ports_are_the_hosts_and_addresses_must_be_its_own() {
    let mut net = Net::new();
    net.listen(A, CA, TENANT, 7471, 8);
    let other = net.a.create_id(CB, OTHER, PortSpace::Tcp).unwrap();
    let err = net.a.bind(CB, other, SocketAddrV4::new(A, 7471)).unwrap_err();
    assert_eq!(err.errno(), errno::EADDRINUSE, "another tenant's listener holds the port");
    let err = net.a.bind(CB, other, SocketAddrV4::new(B, 1)).unwrap_err();
    assert_eq!(err.errno(), errno::EADDRNOTAVAIL);
    assert!(net.a.listen(CB, other, 0).is_ok(), "an unbound listener gets a free port");
    let (local, _) = net.a.addresses(CB, other).unwrap();
    assert!(ports::EPHEMERAL.contains(&local.unwrap().port()));
}

#[test]
fn a_ud_request_is_answered_with_the_responders_qp_and_qkey() {
    let mut net = Net::new();
    let cm = &mut net.b;
    let l = cm.create_id(CB, TENANT, PortSpace::Udp).unwrap();
    cm.bind(CB, l, SocketAddrV4::new(B, 7471)).unwrap();
    cm.listen(CB, l, 8).unwrap();
    let a = net.resolved(A, CA, TENANT, PortSpace::Udp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, &[7; 180]), T0).unwrap();
    net.run();
    let b = net.events(B)[0].id;
    let (init, mask) = net.b.init_qp_attr(CB, b, QpState::Init).unwrap();
    assert!(mask.contains(QpAttrMask::QKEY) && init.qkey == UD_QKEY);
    net.b.accept(CB, b, conn(0x22, b""), UD_QKEY, T0).unwrap();
    net.run();
    let ev = net.events(A);
    assert_eq!(kinds(&ev), [EventKind::Established]);
    assert_eq!((ev[0].peer.as_ref().unwrap().qp_num, ev[0].qkey), (0x22, UD_QKEY));
    assert!(net.log.iter().all(|(_, _, m)| !matches!(m, CmMessage::Rtu { .. })), "SIDR has no RTU");
    assert!(net.events(B).is_empty());
}

#[test]
fn a_tenant_holds_at_most_its_quota_of_ids_pending_requests_included() {
    let mut net = Net::new();
    net.b = ConnectionManager::new(
        CmConfig { max_ids_per_tenant: 2, ..CmConfig::default() },
        vec![B],
        Box::new(Counter(3)),
    );
    net.listen(B, CB, TENANT, 7471, 8);
    for expect in [EventKind::ConnectRequest, EventKind::Rejected] {
        let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
        net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
        net.run();
        let got: Vec<_> = net.events(A).into_iter().chain(net.events(B)).map(|e| e.kind).collect();
        assert_eq!(got, [expect]);
    }
    assert_eq!(net.b.create_id(CB, TENANT, PortSpace::Tcp).unwrap_err().errno(), errno::ENOMEM);
    assert!(net.b.create_id(CB, OTHER, PortSpace::Tcp).is_ok(), "another tenant is not affected");
}

#[test]
fn a_tenant_of_one_host_only_never_meets_another_hosts_listener() {
    let local = TenantId(TenantId::HOST_LOCAL_BASE + 1);
    let mut net = Net::new();
    net.listen(B, CB, local, 7471, 8);
    let a = net.resolved(A, CA, local, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    assert_eq!(net.a.connect(CA, a, conn(0x11, b""), T0).unwrap_err().errno(), errno::EINVAL);
    // A forged REQ claiming that number from A is answered as no listener.
    let src = SocketAddrV4::new(A, 40000);
    let msg = CmMessage::Req {
        from: 9,
        tenant: local.0,
        ps: PortSpace::Tcp,
        src,
        dst: SocketAddrV4::new(B, 7471),
        conn: conn(1, b""),
    };
    net.b.handle_message(A, msg);
    assert!(net.events(B).is_empty());
    assert!(matches!(
        net.b.poll_transmit(),
        Some((A, CmMessage::Rej { reason: reject::INVALID_SERVICE_ID, .. }))
    ));
}

#[test]
fn loopback_is_this_host_unless_the_host_is_a_loopback_address() {
    let cm = |addr| ConnectionManager::new(CmConfig::default(), vec![addr], Box::new(Counter(1)));
    assert!(cm(A).is_local(Ipv4Addr::LOCALHOST));
    assert!(!cm(A).is_local(B));
    let test_host = cm(Ipv4Addr::new(127, 0, 0, 2));
    assert!(test_host.is_local(Ipv4Addr::new(127, 0, 0, 2)));
    assert!(!test_host.is_local(Ipv4Addr::new(127, 0, 0, 3)), "another daemon's");
}

/// A connection to 127.0.0.1 leaves from 127.0.0.1, as the kernel's
/// loopback route gives it; one to another host from this host's address.
#[test]
fn a_resolved_address_leaves_from_loopback_to_loopback_and_from_the_host_to_others() {
    let mut net = Net::new();
    let to_self = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7471);
    let id = net.resolved(A, CA, TENANT, PortSpace::Tcp, to_self);
    let (local, remote) = net.a.addresses(CA, id).unwrap();
    assert_eq!((local.map(|l| *l.ip()), remote), (Some(Ipv4Addr::LOCALHOST), Some(to_self)));
    let id = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    assert_eq!(net.a.addresses(CA, id).unwrap().0.map(|l| *l.ip()), Some(A));
}

#[test]
fn a_request_sent_again_is_the_same_request_and_a_rej_by_the_requesters_number_finds_it() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    let src = SocketAddrV4::new(A, 40000);
    let dst = SocketAddrV4::new(B, 7471);
    let req = CmMessage::Req { from: 77, tenant: TENANT.0, ps: PortSpace::Tcp, src, dst, conn: conn(1, b"") };
    net.b.handle_message(A, req.clone());
    net.b.handle_message(A, req);
    let ev = net.events(B);
    assert_eq!(kinds(&ev), [EventKind::ConnectRequest], "once");
    // The requester gives up before it heard from us: its REJ names only
    // its own number.
    net.b
        .handle_message(A, CmMessage::Rej { to: 0, from: 77, reason: reject::TIMEOUT, private_data: vec![] });
    let ev2 = net.events(B);
    assert_eq!((ev2[0].id, ev2[0].kind), (ev[0].id, EventKind::Rejected));
    // Destroyed, the request is forgotten: the same numbers are a new one.
    net.b.destroy_id(CB, ev[0].id, T0).unwrap();
    let req = CmMessage::Req { from: 77, tenant: TENANT.0, ps: PortSpace::Tcp, src, dst, conn: conn(1, b"") };
    net.b.handle_message(A, req);
    assert_eq!(kinds(&net.events(B)), [EventKind::ConnectRequest]);
}

#[test]
fn a_tenant_sees_its_own_listeners_only() {
    let mut net = Net::new();
    let at = SocketAddrV4::new(B, 7471);
    assert!(!net.b.has_listener(TENANT, PortSpace::Tcp, at));
    net.listen(B, CB, TENANT, 7471, 8);
    assert!(net.b.has_listener(TENANT, PortSpace::Tcp, at));
    assert!(!net.b.has_listener(OTHER, PortSpace::Tcp, at), "another tenant's is not seen");
    assert!(!net.b.has_listener(TENANT, PortSpace::Udp, at));
}

#[test]
fn an_address_resolves_once_and_a_restarted_peers_numbers_are_new_requests() {
    let mut net = Net::new();
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    let again = net.a.resolve_addr(CA, a, None, SocketAddrV4::new(B, 7471));
    assert_eq!(again.unwrap_err(), CmError::WrongState, "no second event for the same id");
    assert!(net.events(A).is_empty());
    // A REQ from B's id 1, B's link lost, B restarted: its new id 1 asks
    // again, and is heard.
    net.listen(A, CA, TENANT, 7000, 8);
    let src = SocketAddrV4::new(B, 40000);
    let req = || CmMessage::Req {
        from: 1,
        tenant: TENANT.0,
        ps: PortSpace::Tcp,
        src,
        dst: SocketAddrV4::new(A, 7000),
        conn: conn(1, b""),
    };
    net.a.handle_message(B, req());
    assert_eq!(kinds(&net.events(A)), [EventKind::ConnectRequest]);
    net.a.link_down(B, None);
    net.events(A);
    net.a.handle_message(B, req());
    assert_eq!(kinds(&net.events(A)), [EventKind::ConnectRequest], "a new request");
}

#[test]
fn the_requesters_address_is_the_host_its_request_came_from() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    // A REQ from A claiming to come from a third host.
    let c = Ipv4Addr::new(10, 0, 0, 3);
    let msg = CmMessage::Req {
        from: 5,
        tenant: TENANT.0,
        ps: PortSpace::Tcp,
        src: SocketAddrV4::new(c, 40000),
        dst: SocketAddrV4::new(B, 7471),
        conn: conn(9, b""),
    };
    net.b.handle_message(A, msg);
    let id = net.events(B)[0].id;
    let (_, remote) = net.b.addresses(CB, id).unwrap();
    assert_eq!(remote.map(|r| *r.ip()), Some(A));
    let (rtr, _) = net.b.init_qp_attr(CB, id, QpState::Rtr).unwrap();
    assert_eq!(rtr.ah_attr.dgid, crate::verbs::Gid::from_ipv4(A.octets()));
}

/// A DREQ that comes while the requester holds the REP unanswered is not
/// taken then (the IB CM drops it in REP received: no DREP, no
/// DISCONNECTED before ESTABLISHED); once the RTU goes, it is, as the
/// peer's resend would be: the requester's program sees its connection
/// established, then disconnected, and the acceptor hears its DREP.
#[test]
fn a_dreq_before_the_rtu_is_taken_after_it_as_its_resend_would_be() {
    let mut net = Net::new();
    net.listen(B, CB, TENANT, 7471, 8);
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    let b = net.events(B)[0].id;
    net.b.accept(CB, b, conn(0x22, b""), 0, T0).unwrap();
    net.b.disconnect(CB, b, T0).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::ConnectResponse], "no DISCONNECTED before ESTABLISHED");
    assert_eq!(net.a.state(CA, a), Some(State::RepReceived));
    assert!(!net.log.iter().any(|(_, _, m)| matches!(m, CmMessage::Drep { .. })), "no DREP yet");
    net.a.establish(CA, a).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::Disconnected]);
    assert_eq!(kinds(&net.events(B)), [EventKind::Disconnected], "the acceptor's DREQ was answered");
    assert_eq!(net.a.state(CA, a), Some(State::Closed));
}

/// `rdma_resolve_addr` on an id already bound ignores its `src`, as the
/// kernel's does (it does not bind again): the id keeps the address it
/// was bound to, and the call succeeds.
#[test]
fn resolving_from_a_bound_id_keeps_its_address_whatever_src_says() {
    let mut net = Net::new();
    let id = net.a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    let bound = net.a.bind(CA, id, SocketAddrV4::new(A, 5000)).unwrap();
    let other = SocketAddrV4::new(A, 6000);
    net.a.resolve_addr(CA, id, Some(other), SocketAddrV4::new(B, 7471)).unwrap();
    assert_eq!(net.a.addresses(CA, id), Some((Some(bound), Some(SocketAddrV4::new(B, 7471)))));
    assert_eq!(kinds(&net.events(A)), [EventKind::AddrResolved]);
}

/// perftest -R's race: its client's second request reaches B after the
/// server destroyed its listener and before it listens again. The port
/// lingers for the listener's tenant, so the request waits for the new
/// listener and connects.
#[test]
fn a_request_racing_its_tenants_next_listen_on_the_port_waits_for_it() {
    let mut net = Net::new();
    let first = net.listen(B, CB, TENANT, 7471, 8);
    net.b.destroy_id(CB, first, T0).unwrap();
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b"again"), T0).unwrap();
    net.run();
    assert!(net.events(A).is_empty(), "no answer while the port lingers");
    assert!(net.events(B).is_empty());
    assert_eq!(net.b.poll_timeout(), Some(T0 + CmConfig::default().listen_linger));
    // The new listener takes it as if it had just come.
    let second = net.listen(B, CB, TENANT, 7471, 8);
    net.run();
    let ev = net.events(B);
    assert_eq!(kinds(&ev), [EventKind::ConnectRequest]);
    assert_eq!(ev[0].listen_id, Some(second));
    assert_eq!(ev[0].peer.as_ref().unwrap().private_data, b"again");
    net.b.accept(CB, ev[0].id, conn(0x22, b""), 0, T0).unwrap();
    net.run();
    assert_eq!(kinds(&net.events(A)), [EventKind::ConnectResponse]);
    assert_eq!(net.b.poll_timeout(), Some(T0 + CmConfig::default().connect_timeout), "the linger is over");
}

/// A lingering port holds only its tenant's requests, and only for the
/// linger: then they get the answer of a port without a listener, the one
/// another tenant gets at once; a port that never had a listener answers
/// at once too.
#[test]
fn a_lingering_port_refuses_other_tenants_at_once_and_its_own_when_the_time_is_up() {
    let mut net = Net::new();
    let l = net.listen(B, CB, TENANT, 7471, 8);
    net.b.destroy_id(CB, l, T0).unwrap();
    let rejected = |net: &mut Net| {
        let ev = net.events(A);
        assert_eq!(kinds(&ev), [EventKind::Rejected]);
        assert_eq!(ev[0].status, i32::from(reject::INVALID_SERVICE_ID));
    };
    for (tenant, port) in [(OTHER, 7471), (TENANT, 7472)] {
        let a = net.resolved(A, CA, tenant, PortSpace::Tcp, SocketAddrV4::new(B, port));
        net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
        net.run();
        rejected(&mut net);
    }
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    assert!(net.events(A).is_empty(), "held");
    let linger = CmConfig::default().listen_linger;
    net.b.handle_timeout(T0 + (linger - Duration::from_millis(1)));
    net.run();
    assert!(net.events(A).is_empty(), "held until the linger is up");
    net.b.handle_timeout(T0 + linger);
    net.run();
    rejected(&mut net);
    assert!(net.events(B).is_empty(), "the listener's side heard nothing");
    // Another tenant's listener on the port later takes none of them.
    net.listen(B, CB, OTHER, 7471, 8);
    net.run();
    assert!(net.events(B).is_empty());
}

/// A requester that gives up while its request is held takes it back:
/// the next listener never sees it.
#[test]
fn a_held_request_whose_requester_gave_up_is_not_delivered() {
    let mut net = Net::new();
    let l = net.listen(B, CB, TENANT, 7471, 8);
    net.b.destroy_id(CB, l, T0).unwrap();
    let a = net.resolved(A, CA, TENANT, PortSpace::Tcp, SocketAddrV4::new(B, 7471));
    net.a.connect(CA, a, conn(0x11, b""), T0).unwrap();
    net.run();
    net.a.destroy_id(CA, a, T0).unwrap();
    net.run();
    net.listen(B, CB, TENANT, 7471, 8);
    net.run();
    assert!(net.events(B).is_empty(), "no CONNECT_REQUEST for a requester that left");
}

/// A VM's address (`[vms.NAME] address`): this host's for every tenant's
/// requests, bindable by its own tenant only.
#[test]
fn a_tenants_address_is_local_and_only_its_tenant_binds_it() {
    const VM: Ipv4Addr = Ipv4Addr::new(10, 76, 0, 2);
    let mut cm = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    cm.add_tenant_addr(VM, TENANT).unwrap();
    for bad in [A, VM, Ipv4Addr::UNSPECIFIED, Ipv4Addr::LOCALHOST, Ipv4Addr::new(224, 0, 0, 1)] {
        assert!(cm.add_tenant_addr(bad, OTHER).is_err(), "{bad}");
    }
    assert!(cm.is_local(VM) && !cm.is_local(Ipv4Addr::new(10, 76, 0, 3)));
    let other = cm.create_id(CB, OTHER, PortSpace::Tcp).unwrap();
    let err = cm.bind(CB, other, SocketAddrV4::new(VM, 7471)).unwrap_err();
    assert_eq!(err.errno(), errno::EADDRNOTAVAIL, "another tenant's address");
    // The VM's tenant listens there; a process of the host (the same
    // tenant) connects to it, leaving from the address it connects to.
    let l = cm.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    cm.bind(CA, l, SocketAddrV4::new(VM, 7471)).unwrap();
    cm.listen(CA, l, 8).unwrap();
    let a = cm.create_id(CB, TENANT, PortSpace::Tcp).unwrap();
    cm.resolve_addr(CB, a, None, SocketAddrV4::new(VM, 7471)).unwrap();
    cm.resolve_route(CB, a).unwrap();
    assert_eq!(cm.addresses(CB, a).unwrap().0.map(|l| *l.ip()), Some(VM));
    cm.connect(CB, a, conn(0x11, b""), T0).unwrap();
    // The driver hands a message to a local address straight back.
    let (to, req) = cm.poll_transmit().expect("the REQ");
    assert!(to == VM && cm.is_local(to));
    cm.handle_message(to, req);
    let ev: Vec<_> = std::iter::from_fn(|| cm.poll_event()).collect();
    assert!(ev.iter().any(|e| e.kind == EventKind::ConnectRequest), "{ev:?}");
    // Another tenant reaches the address from the host's own (and its
    // request meets no listener of its tenant there).
    let o = cm.create_id(CB, OTHER, PortSpace::Tcp).unwrap();
    cm.resolve_addr(CB, o, None, SocketAddrV4::new(VM, 7471)).unwrap();
    assert_eq!(cm.addresses(CB, o).unwrap().0.map(|l| *l.ip()), Some(A));
    // The port on the host's own address stays free for the other
    // tenant: the listener holds the VM's address only.
    assert!(cm.bind(CB, other, SocketAddrV4::new(A, 7471)).is_ok());
}

/// Carries every message `from` (at `from_ip`) queued to `to`, checking
/// that each goes by `by` (`from`'s number for its link), and hands it to
/// `to` as come by `at` (`to`'s number for the same link); how many.
fn carry(
    from: &mut ConnectionManager,
    from_ip: Ipv4Addr,
    to: &mut ConnectionManager,
    by: LinkId,
    at: LinkId,
) -> usize {
    let mut n = 0;
    while let Some((_, link, msg)) = from.poll_transmit_by() {
        assert_eq!(link, Some(by), "{msg:?} went by another link");
        to.handle_message_by(from_ip, Some(at), msg);
        n += 1;
    }
    n
}

/// Carries messages both ways between A and one daemon of B until none
/// is left (A's number for the link is `by_a`, that daemon's `by_b`).
fn exchange(a: &mut ConnectionManager, b: &mut ConnectionManager, by_a: LinkId, by_b: LinkId) {
    for _ in 0..100 {
        if carry(a, A, b, by_a, by_b) + carry(b, B, a, by_b, by_a) == 0 {
            return;
        }
    }
    panic!("messages without end");
}

fn drain(cm: &mut ConnectionManager) -> Vec<CmEvent> {
    std::iter::from_fn(|| cm.poll_event()).collect()
}

/// What one life of B's daemon does with A over its link: listens on
/// 7471, takes A's `a`'s connection there to ESTABLISHED, and sends a
/// request of its own that A leaves unanswered. Returns A's id for that
/// request.
fn one_life_of_b(a: &mut ConnectionManager, b: &mut ConnectionManager, by_a: LinkId, a_id: u32) -> u32 {
    let by_b = LinkId(1);
    let l = b.create_id(CB, TENANT, PortSpace::Tcp).unwrap();
    b.bind(CB, l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471)).unwrap();
    b.listen(CB, l, 8).unwrap();
    a.resolve_addr(CA, a_id, None, SocketAddrV4::new(B, 7471)).unwrap();
    a.resolve_route(CA, a_id).unwrap();
    a.connect(CA, a_id, conn(0x11, b""), T0).unwrap();
    exchange(a, b, by_a, by_b);
    let ev = drain(b);
    assert_eq!(kinds(&ev), [EventKind::ConnectRequest]);
    b.accept(CB, ev[0].id, conn(0x22, b""), 0, T0).unwrap();
    exchange(a, b, by_a, by_b);
    a.establish(CA, a_id).unwrap();
    exchange(a, b, by_a, by_b);
    assert_eq!(kinds(&drain(b)), [EventKind::Established]);
    // B's request to A's listener, not answered yet.
    let r = b.create_id(CB, TENANT, PortSpace::Tcp).unwrap();
    b.resolve_addr(CB, r, None, SocketAddrV4::new(A, 7471)).unwrap();
    b.resolve_route(CB, r).unwrap();
    b.connect(CB, r, conn(0x33, b""), T0).unwrap();
    exchange(a, b, by_a, by_b);
    let ev: Vec<_> = drain(a).into_iter().filter(|e| e.kind == EventKind::ConnectRequest).collect();
    assert_eq!(ev.len(), 1, "B's request reaches A: {ev:?}");
    ev[0].id
}

/// B's daemon restarted and linked to A again (A's link 2) before A found
/// its first link (1) dead. The first link's end takes what was made over
/// it only: the new link's connection stays ESTABLISHED and its request,
/// numbered as the last life's was, is answered (review, issue 16: the
/// end of a link ended every connection with its host). And what goes to
/// B goes by the newest link.
#[test]
fn an_old_links_end_leaves_what_a_restarted_peers_new_link_made() {
    let (l1, l2) = (LinkId(1), LinkId(2));
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let al = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    a.bind(CA, al, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471)).unwrap();
    a.listen(CA, al, 8).unwrap();
    let (old_conn, new_conn) =
        (a.create_id(CA, TENANT, PortSpace::Tcp).unwrap(), a.create_id(CA, TENANT, PortSpace::Tcp).unwrap());
    a.link_up(B, l1, true);
    let mut b1 = ConnectionManager::new(CmConfig::default(), vec![B], Box::new(Counter(7)));
    b1.link_up(A, LinkId(1), true);
    let old_req = one_life_of_b(&mut a, &mut b1, l1, old_conn);
    drain(&mut a);
    // B's daemon restarts (its ids numbered from 1 again) and links again.
    let mut b2 = ConnectionManager::new(CmConfig::default(), vec![B], Box::new(Counter(7)));
    b2.link_up(A, LinkId(1), true);
    a.link_up(B, l2, true);
    let new_req = one_life_of_b(&mut a, &mut b2, l2, new_conn);
    assert_ne!(old_req, new_req, "a request of the new life is not one the old sent again");
    drain(&mut a);

    // The old link is found dead now.
    a.link_down(B, Some(l1));
    let mut ev = drain(&mut a);
    ev.sort_by_key(|e| e.id);
    let got: Vec<_> = ev.iter().map(|e| (e.id, e.kind)).collect();
    let mut want = vec![(old_conn, EventKind::Disconnected), (old_req, EventKind::ConnectError)];
    want.sort_by_key(|w| w.0);
    assert_eq!(got, want, "the old link's connection and request end, and nothing else");
    assert!(a.poll_transmit_by().is_none());
    assert_eq!(a.state(CA, new_conn), Some(State::Established));
    assert_eq!(a.state(CA, new_req), Some(State::ReqReceived));

    // The new link's request is answered, by the new link.
    a.accept(CA, new_req, conn(0x44, b""), 0, T0).unwrap();
    exchange(&mut a, &mut b2, l2, LinkId(1));
    let ev: Vec<_> = drain(&mut b2).into_iter().filter(|e| e.kind == EventKind::ConnectResponse).collect();
    assert_eq!(ev.len(), 1, "A's answer reaches the new life of B");
    b2.establish(CB, ev[0].id).unwrap();
    exchange(&mut a, &mut b2, l2, LinkId(1));
    assert_eq!(kinds(&drain(&mut a)), [EventKind::Established]);

    // The new link's end takes the rest.
    a.link_down(B, Some(l2));
    let mut ev = drain(&mut a);
    ev.sort_by_key(|e| e.id);
    let got: Vec<_> = ev.iter().map(|e| (e.id, e.kind)).collect();
    let mut want = vec![(new_conn, EventKind::Disconnected), (new_req, EventKind::Disconnected)];
    want.sort_by_key(|w| w.0);
    assert_eq!(got, want);
}

/// A request sent while no link to its host was up waits for the dial:
/// it belongs to the link that comes (the driver sends it by that one),
/// and a failed dial (no link) ends it.
#[test]
fn a_request_that_waited_for_a_dial_belongs_to_the_link_that_came() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let connect = |a: &mut ConnectionManager| {
        let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
        a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
        a.resolve_route(CA, id).unwrap();
        a.connect(CA, id, conn(0x11, b""), T0).unwrap();
        drain(a);
        id
    };
    // The dial fails: no link came.
    let failed = connect(&mut a);
    assert!(matches!(a.poll_transmit_by(), Some((B, None, CmMessage::Req { .. }))));
    a.link_down(B, Some(LinkId(9)));
    assert!(drain(&mut a).is_empty(), "another link's end is not its");
    a.link_down(B, None);
    assert_eq!(kinds(&drain(&mut a)), [EventKind::Unreachable]);
    assert_eq!(a.state(CA, failed), Some(State::Closed));
    // The dial makes link 3: the waiting request is that link's.
    let waited = connect(&mut a);
    a.poll_transmit_by();
    a.link_up(B, LinkId(3), true);
    a.link_down(B, None);
    assert!(drain(&mut a).is_empty(), "it waits for no dial any more");
    let next = connect(&mut a);
    assert!(matches!(a.poll_transmit_by(), Some((B, Some(LinkId(3)), CmMessage::Req { .. }))));
    a.link_down(B, Some(LinkId(3)));
    let mut ev: Vec<_> = drain(&mut a).iter().map(|e| (e.id, e.kind)).collect();
    ev.sort_by_key(|e| e.0);
    assert_eq!(ev, [(waited, EventKind::Unreachable), (next, EventKind::Unreachable)]);
}

/// A new REQ goes by the host's newest verified link, not by a newer one
/// whose peer only claims the host's GID; with none verified, by the
/// newest (review links3 D).
#[test]
fn a_new_req_takes_the_hosts_verified_link_before_a_newer_unverified_one() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let req_link = |a: &mut ConnectionManager| {
        let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
        a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
        a.resolve_route(CA, id).unwrap();
        a.connect(CA, id, conn(0x11, b""), T0).unwrap();
        let (_, link, msg) = a.poll_transmit_by().unwrap();
        assert!(matches!(msg, CmMessage::Req { .. }), "{msg:?}");
        link
    };
    a.link_up(B, LinkId(1), false);
    assert_eq!(req_link(&mut a), Some(LinkId(1)), "none verified: the one up");
    a.link_up(B, LinkId(2), true);
    a.link_up(B, LinkId(3), false);
    assert_eq!(req_link(&mut a), Some(LinkId(2)));
    a.link_down(B, Some(LinkId(2)));
    drain(&mut a);
    assert_eq!(req_link(&mut a), Some(LinkId(3)), "the verified one gone: the newest");
}

/// A passive connection moved by a Moved (its host and link changed)
/// leaves no entry of its REQ behind when it goes (review links3 F).
#[test]
fn a_moved_passive_connection_leaves_no_request_entry_behind() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let l = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    a.bind(CA, l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7000)).unwrap();
    a.listen(CA, l, 8).unwrap();
    a.link_up(B, LinkId(1), true);
    let req = CmMessage::Req {
        from: 5,
        tenant: TENANT.0,
        ps: PortSpace::Tcp,
        src: SocketAddrV4::new(B, 40000),
        dst: SocketAddrV4::new(A, 7000),
        conn: conn(1, b""),
    };
    a.handle_message_by(B, Some(LinkId(1)), req);
    let child = drain(&mut a).into_iter().find(|e| e.kind == EventKind::ConnectRequest).unwrap().id;
    assert_eq!(a.requested.len(), 1);
    let c = Ipv4Addr::new(10, 0, 0, 9);
    a.handle_message_by(c, Some(LinkId(2)), CmMessage::Moved { to: child, from: 5, tenant: TENANT.0 });
    a.destroy_id(CA, child, T0).unwrap();
    assert!(a.requested.is_empty(), "{:?}", a.requested);
}

/// A message the driver refuses for no link ends the connection that
/// sent it, not the others to that host whose REQs it holds for the link
/// (review links3 F).
#[test]
fn a_refused_send_for_no_link_ends_only_the_connection_that_sent_it() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let mut reqs = Vec::new();
    for _ in 0..2 {
        let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
        a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
        a.resolve_route(CA, id).unwrap();
        a.connect(CA, id, conn(0x11, b""), T0).unwrap();
        let (_, link, msg) = a.poll_transmit_by().unwrap();
        assert_eq!(link, None, "no link up: held for the dial");
        reqs.push((id, msg));
    }
    drain(&mut a);
    a.send_refused(B, None, &reqs[1].1);
    assert_eq!(a.state(CA, reqs[1].0), Some(State::Closed));
    assert_eq!(a.state(CA, reqs[0].0), Some(State::ReqSent), "its REQ is held for the link");
    assert_eq!(kinds(&drain(&mut a)), [EventKind::Unreachable]);
}

/// A connection hears only what comes by its link: an answer to a REQ
/// that went by link 1 is dropped when it comes by another link to the
/// host (a daemon that only claims the host's GID, guessing our numbers),
/// or by none; one whose REQ the driver holds for a link hears an answer
/// only by a verified link it was told of (review of linkdefer, 7).
#[test]
fn an_answer_by_another_link_than_its_connections_is_dropped() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let connect = |a: &mut ConnectionManager| {
        let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
        a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
        a.resolve_route(CA, id).unwrap();
        a.connect(CA, id, conn(0x11, b""), T0).unwrap();
        drain(a);
        let (_, link, msg) = a.poll_transmit_by().unwrap();
        assert!(matches!(msg, CmMessage::Req { .. }), "{msg:?}");
        (id, link)
    };
    let rep = |to| CmMessage::Rep { to, from: 9, conn: conn(0x22, b""), qkey: 0 };
    // Bound to link 1.
    a.link_up(B, LinkId(1), true);
    let (id, link) = connect(&mut a);
    assert_eq!(link, Some(LinkId(1)));
    a.link_up(B, LinkId(2), false);
    for by in [Some(LinkId(2)), Some(LinkId(5)), None] {
        a.handle_message_by(B, by, rep(id));
        assert!(drain(&mut a).is_empty(), "an answer by {by:?}");
        assert_eq!(a.state(CA, id), Some(State::ReqSent));
    }
    a.handle_message_by(B, Some(LinkId(1)), rep(id));
    assert_eq!(kinds(&drain(&mut a)), [EventKind::ConnectResponse]);

    // No link up: the REQ is held for the dial, bound to no link.
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let (id, link) = connect(&mut a);
    assert_eq!(link, None);
    // A link the driver holds back (not told), or an unverified one.
    a.handle_message_by(B, Some(LinkId(3)), rep(id));
    assert!(drain(&mut a).is_empty(), "an answer by a link the manager has not heard of");
    assert_eq!(a.state(CA, id), Some(State::ReqSent));
    // The driver sends the held REQ by the verified link it tells of.
    a.link_up(B, LinkId(4), true);
    a.handle_message_by(B, Some(LinkId(3)), rep(id));
    assert!(drain(&mut a).is_empty());
    a.handle_message_by(B, Some(LinkId(4)), rep(id));
    assert_eq!(kinds(&drain(&mut a)), [EventKind::ConnectResponse]);
}

/// Only a connection that was up sends a Moved (`migrate::resume_tenant`),
/// so one being set up here does not take it: a daemon that claims the
/// peer's host and guesses the tenant and our number (the peer's, not yet
/// known to a REQ sent, is 0) takes neither side over, and the
/// connection hears only its own link, not the Moved's (review 2 of
/// linkdefer, 2: the Moved bound it to the claimer's link, whose REP was
/// then taken). One whose REP we sent takes it as the RTU it implies
/// (the mover's side was up), with both numbers, as an established one
/// does (review 3 of linkdefer, A).
#[test]
fn a_moved_for_a_connection_being_set_up_is_dropped() {
    let rep = |to| CmMessage::Rep { to, from: 9, conn: conn(0x22, b""), qkey: 0 };
    let moved = |to, from| CmMessage::Moved { to, from, tenant: TENANT.0 };
    // Ours requested, by link 1 (verified); the claimer's link 2 (not).
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    a.link_up(B, LinkId(1), true);
    a.link_up(B, LinkId(2), false);
    let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
    a.resolve_route(CA, id).unwrap();
    a.connect(CA, id, conn(0x11, b""), T0).unwrap();
    drain(&mut a);
    assert_eq!(a.poll_transmit_by().map(|(_, l, _)| l), Some(Some(LinkId(1))));
    a.handle_message_by(B, Some(LinkId(2)), moved(id, 0));
    assert_eq!(a.poll_transmit_by(), None, "a Moved that fits no connection up");
    a.handle_message_by(B, Some(LinkId(2)), rep(id));
    assert!(drain(&mut a).is_empty(), "a REP by the Moved's link was taken");
    assert_eq!(a.state(CA, id), Some(State::ReqSent));
    a.handle_message_by(B, Some(LinkId(1)), rep(id));
    assert_eq!(kinds(&drain(&mut a)), [EventKind::ConnectResponse]);
    // The REP come, the RTU not yet sent: no side was up.
    a.handle_message_by(B, Some(LinkId(2)), moved(id, 9));
    assert_eq!(a.poll_transmit_by(), None);
    assert!(drain(&mut a).is_empty());
    assert_eq!(a.state(CA, id), Some(State::RepReceived));
    a.link_down(B, Some(LinkId(2)));
    assert_eq!(a.state(CA, id), Some(State::RepReceived), "bound to the Moved's link");

    // Theirs, come by link 1: the REQ not yet answered, then the REP
    // sent and the RTU not yet come.
    let mut b = ConnectionManager::new(CmConfig::default(), vec![B], Box::new(Counter(1)));
    b.link_up(A, LinkId(1), true);
    b.link_up(A, LinkId(2), false);
    let l = b.create_id(CB, TENANT, PortSpace::Tcp).unwrap();
    b.bind(CB, l, SocketAddrV4::new(B, 7471)).unwrap();
    b.listen(CB, l, 8).unwrap();
    let (src, dst) = (SocketAddrV4::new(A, 40000), SocketAddrV4::new(B, 7471));
    let req = CmMessage::Req { from: 77, tenant: TENANT.0, ps: PortSpace::Tcp, src, dst, conn: conn(1, b"") };
    b.handle_message_by(A, Some(LinkId(1)), req);
    let child = drain(&mut b)[0].id;
    b.handle_message_by(A, Some(LinkId(2)), moved(child, 77));
    assert_eq!(b.poll_transmit_by(), None);
    assert!(drain(&mut b).is_empty());
    assert_eq!(b.state(CB, child), Some(State::ReqReceived));
    b.accept(CB, child, conn(0x33, b""), 0, T0).unwrap();
    assert_eq!(b.poll_transmit_by().map(|(_, l, _)| l), Some(Some(LinkId(1))), "the REP by the REQ's link");
    assert_eq!(b.state(CB, child), Some(State::RepSent));
    // A Moved from another number, or 0, or another tenant: not the peer.
    for (from, tenant) in [(78, TENANT.0), (0, TENANT.0), (77, TENANT.0 + 1)] {
        b.handle_message_by(A, Some(LinkId(2)), CmMessage::Moved { to: child, from, tenant });
        while b.poll_transmit_by().is_some() {}
        assert!(drain(&mut b).is_empty());
        assert_eq!(b.state(CB, child), Some(State::RepSent), "a Moved from {from} of tenant {tenant}");
    }
    b.handle_message_by(A, Some(LinkId(2)), moved(child, 77));
    assert_eq!(b.poll_transmit_by(), None);
    assert_eq!(kinds(&drain(&mut b)), [EventKind::Established], "the Moved stands for the RTU");
    b.handle_message_by(A, Some(LinkId(1)), CmMessage::Rtu { to: child, from: 77 });
    assert!(drain(&mut b).is_empty(), "the late RTU by the old link");
    b.link_down(A, Some(LinkId(1)));
    assert_eq!(b.state(CB, child), Some(State::Established), "still bound to the old link");
    b.link_down(A, Some(LinkId(2)));
    assert_eq!(b.state(CB, child), Some(State::Closed), "not bound to the Moved's link");
}

/// A REQ queued by no link (the manager knew none to the host), then two
/// links reported at once: the first binds the connection, but the
/// driver sent the REQ by the other (its newest verified one) and says
/// so: the connection is bound to that one, and hears its answer there
/// (review 2 of linkdefer, 1).
#[test]
fn a_message_sent_by_no_link_binds_its_connection_to_the_link_it_went_by() {
    let mut a = ConnectionManager::new(CmConfig::default(), vec![A], Box::new(Counter(1)));
    let id = a.create_id(CA, TENANT, PortSpace::Tcp).unwrap();
    a.resolve_addr(CA, id, None, SocketAddrV4::new(B, 7471)).unwrap();
    a.resolve_route(CA, id).unwrap();
    a.connect(CA, id, conn(0x11, b""), T0).unwrap();
    drain(&mut a);
    let (host, link, req) = a.poll_transmit_by().unwrap();
    assert_eq!((host, link), (B, None));
    a.link_up(B, LinkId(1), false);
    a.link_up(B, LinkId(2), true);
    a.sent_by(B, &req, LinkId(2));
    let rep = CmMessage::Rep { to: id, from: 9, conn: conn(0x22, b""), qkey: 0 };
    a.handle_message_by(B, Some(LinkId(1)), rep.clone());
    assert!(drain(&mut a).is_empty(), "an answer by the link first reported");
    a.handle_message_by(B, Some(LinkId(2)), rep);
    assert_eq!(kinds(&drain(&mut a)), [EventKind::ConnectResponse]);
    // Its link's end ends it.
    a.link_down(B, Some(LinkId(2)));
    assert_eq!(a.state(CA, id), Some(State::Closed));
}
