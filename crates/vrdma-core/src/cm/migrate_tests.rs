//! Three hosts' managers: a tenant's ids on A connected to B move to C.

use std::net::{Ipv4Addr, SocketAddrV4};

use super::*;
use crate::cm::tests::Counter;
use crate::cm::CmConfig;

const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const C: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
const T: TenantId = TenantId(1000);
/// The moving tenant's context (the same number on A and C).
const CG: ContextId = ContextId(0x0100_0001);
const CB: ContextId = ContextId(0x0200_0001);
const T0: Instant = Instant(1_000_000_000);

struct Hosts {
    cms: [ConnectionManager; 3],
    /// (from, to, message), in order.
    log: Vec<(Ipv4Addr, Ipv4Addr, CmMessage)>,
}

fn ix(h: Ipv4Addr) -> usize {
    usize::from(h.octets()[3] - 1)
}

impl Hosts {
    fn new() -> Hosts {
        let cm = |h: Ipv4Addr, space: u8| {
            let mut m =
                ConnectionManager::new(CmConfig::default(), vec![h], Box::new(Counter(u32::from(space))));
            m.set_number_space(space);
            m
        };
        Hosts { cms: [cm(A, 1), cm(B, 2), cm(C, 3)], log: Vec::new() }
    }

    fn cm(&mut self, h: Ipv4Addr) -> &mut ConnectionManager {
        &mut self.cms[ix(h)]
    }

    fn run(&mut self) {
        for _ in 0..100 {
            let mut moved = false;
            for from in [A, B, C] {
                while let Some((to, msg)) = self.cm(from).poll_transmit() {
                    moved = true;
                    self.log.push((from, to, msg.clone()));
                    self.cm(to).handle_message(from, msg);
                }
            }
            if !moved {
                return;
            }
        }
        panic!("messages without end");
    }

    fn events(&mut self, h: Ipv4Addr) -> Vec<(u32, EventKind, i32)> {
        std::iter::from_fn(|| self.cm(h).poll_event()).map(|e| (e.id, e.kind, e.status)).collect()
    }

    /// The guest's id on A connected to a listener on B:7471; (guest's
    /// id, B's id).
    fn connected(&mut self) -> (u32, u32) {
        let l = self.cm(B).create_id(CB, T, PortSpace::Tcp).unwrap();
        self.cm(B).bind(CB, l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471)).unwrap();
        self.cm(B).listen(CB, l, 8).unwrap();
        let g = self.cm(A).create_id(CG, T, PortSpace::Tcp).unwrap();
        self.cm(A).resolve_addr(CG, g, None, SocketAddrV4::new(B, 7471)).unwrap();
        self.cm(A).resolve_route(CG, g).unwrap();
        self.cm(A).connect(CG, g, ConnInfo { qp_num: 0x10011, ..Default::default() }, T0).unwrap();
        self.run();
        let req = self.events(B);
        assert_eq!(req[0].1, EventKind::ConnectRequest);
        let b = req[0].0;
        self.cm(B).accept(CB, b, ConnInfo { qp_num: 0x20011, ..Default::default() }, 0, T0).unwrap();
        self.run();
        self.cm(A).establish(CG, g).unwrap();
        self.run();
        assert_eq!(self.events(B), [(b, EventKind::Established, 0)]);
        self.events(A);
        self.log.clear();
        (g, b)
    }

    /// The tenant's ids paused on A and exported (each on channel 1),
    /// then `meanwhile` (what happens during the pause), imported on C,
    /// dropped on A, resumed on C.
    fn moved(&mut self, meanwhile: impl FnOnce(&mut Hosts)) {
        self.cm(A).pause_tenant(T);
        let mut ids = self.cm(A).export_ids(&[CG]);
        for i in &mut ids {
            i.channel = 1;
        }
        let snap =
            CmSnapshot { channels: vec![CmChannelSnap { channel: 1, ctx: CG.0, events: vec![] }], ids };
        meanwhile(self);
        self.run();
        snap.check(&[CG.0], &[(CG.0, 0x10011)]).unwrap();
        self.cm(C).import_ids(T, &snap.ids).unwrap();
        self.cm(A).forget_contexts(T, &[CG]);
        self.cm(C).resume_tenant(T, T0);
        self.run();
    }

    fn sent_by(&self, h: Ipv4Addr) -> Vec<&CmMessage> {
        self.log.iter().filter(|(f, _, _)| *f == h).map(|(_, _, m)| m).collect()
    }
}

/// Moved with its tenant, a connection stays up: A says nothing to B, C
/// tells B where it is, and B's later disconnect reaches C: one
/// DISCONNECTED on each side.
#[test]
fn a_connection_moves_and_a_later_disconnect_comes_once_from_the_new_host() {
    let mut h = Hosts::new();
    let (g, b) = h.connected();
    h.moved(|_| {});
    assert!(h.sent_by(A).is_empty(), "the source says nothing to the peer: {:?}", h.log);
    assert_eq!(h.sent_by(C), [&CmMessage::Moved { to: b, from: g, tenant: T.0 }]);
    assert_eq!(h.cm(C).state(CG, g), Some(State::Established));
    assert!(h.cm(A).state(CG, g).is_none());
    assert!(h.events(C).is_empty() && h.events(B).is_empty());
    h.cm(B).disconnect(CB, b, T0).unwrap();
    h.run();
    assert_eq!(h.events(C), [(g, EventKind::Disconnected, 0)]);
    assert_eq!(h.events(B), [(b, EventKind::Disconnected, 0)]);
    assert!(h.sent_by(A).is_empty());
}

/// The peer disconnects while the tenant is paused: its DREQ goes to the
/// source, which drops it (its state is being exported); C's Moved brings
/// the DREQ again, and the moved id hears DISCONNECTED once, after the
/// resume; B too, once.
#[test]
fn a_disconnect_during_the_pause_is_delivered_once_after_the_resume() {
    let mut h = Hosts::new();
    let (g, b) = h.connected();
    h.moved(|h| h.cm(B).disconnect(CB, b, T0).unwrap());
    assert_eq!(h.events(C), [(g, EventKind::Disconnected, 0)]);
    assert_eq!(h.events(B), [(b, EventKind::Disconnected, 0)]);
    assert!(h.events(A).is_empty(), "nothing left on A");
    // Later timers change nothing.
    h.cm(B).handle_timeout(T0 + std::time::Duration::from_secs(10));
    h.cm(C).handle_timeout(T0 + std::time::Duration::from_secs(10));
    h.run();
    assert!(h.events(B).is_empty() && h.events(C).is_empty());
}

/// The peer's program ended during the pause (its id destroyed, or its
/// DREQ's wait over): the Moved finds no connection, and the mover hears
/// DISCONNECTED once.
#[test]
fn a_peer_gone_during_the_pause_ends_the_moved_connection_once() {
    for timed_out in [false, true] {
        let mut h = Hosts::new();
        let (g, b) = h.connected();
        h.moved(|h| {
            if timed_out {
                h.cm(B).disconnect(CB, b, T0).unwrap();
                h.run();
                h.cm(B).handle_timeout(T0 + std::time::Duration::from_secs(2));
                assert_eq!(h.events(B), [(b, EventKind::Disconnected, 0)]);
            } else {
                h.cm(B).destroy_id(CB, b, T0).unwrap();
            }
        });
        assert_eq!(h.events(C), [(g, EventKind::Disconnected, 0)], "timed out: {timed_out}");
        assert!(h.events(B).is_empty());
    }
}

/// The moved side disconnects after the move: B hears it from C, once.
#[test]
fn a_disconnect_by_the_moved_side_reaches_its_peer() {
    let mut h = Hosts::new();
    let (g, b) = h.connected();
    h.moved(|_| {});
    h.cm(C).disconnect(CG, g, T0).unwrap();
    h.run();
    assert_eq!(h.events(B), [(b, EventKind::Disconnected, 0)]);
    assert_eq!(h.events(C), [(g, EventKind::Disconnected, 0)]);
}

/// Listeners: one on every address keeps listening on C (a request from
/// B to C's address finds it); one on A's own address, and one whose
/// port C's host process holds, end with DEVICE_REMOVAL.
#[test]
fn a_listener_keeps_listening_where_its_address_is_valid_and_ends_clearly_elsewhere() {
    let mut h = Hosts::new();
    let listen = |h: &mut Hosts, ip: Ipv4Addr, port: u16| {
        let l = h.cm(A).create_id(CG, T, PortSpace::Tcp).unwrap();
        h.cm(A).bind(CG, l, SocketAddrV4::new(ip, port)).unwrap();
        h.cm(A).listen(CG, l, 4).unwrap();
        l
    };
    let any = listen(&mut h, Ipv4Addr::UNSPECIFIED, 7000);
    let on_a = listen(&mut h, A, 7001);
    let taken = listen(&mut h, Ipv4Addr::UNSPECIFIED, 7002);
    let other = ContextId(0x0300_0001);
    let holder = h.cm(C).create_id(other, TenantId(2000), PortSpace::Tcp).unwrap();
    h.cm(C).bind(other, holder, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7002)).unwrap();
    h.moved(|_| {});
    let mut ev = h.events(C);
    ev.sort_by_key(|e| e.0);
    let mut want = vec![
        (on_a, EventKind::DeviceRemoval, -errno::EADDRNOTAVAIL),
        (taken, EventKind::DeviceRemoval, -errno::EADDRINUSE),
    ];
    want.sort_by_key(|e| e.0);
    assert_eq!(ev, want);
    assert_eq!(h.cm(C).state(CG, any), Some(State::Listening));
    // A request from B to C:7000 finds the moved listener.
    let r = h.cm(B).create_id(CB, T, PortSpace::Tcp).unwrap();
    h.cm(B).resolve_addr(CB, r, None, SocketAddrV4::new(C, 7000)).unwrap();
    h.cm(B).resolve_route(CB, r).unwrap();
    h.cm(B).connect(CB, r, ConnInfo::default(), T0).unwrap();
    h.run();
    let ev = std::iter::from_fn(|| h.cm(C).poll_event()).collect::<Vec<_>>();
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].kind, ev[0].listen_id), (EventKind::ConnectRequest, Some(any)));
    // The port is free again on A.
    let again = h.cm(A).create_id(ContextId(9), T, PortSpace::Tcp).unwrap();
    h.cm(A).bind(ContextId(9), again, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7000)).unwrap();
}

/// A connection being set up when the tenant moved ends on C with
/// CONNECT_ERROR (UNREACHABLE for a REQ sent), once.
#[test]
fn a_connection_being_set_up_ends_clearly() {
    let mut h = Hosts::new();
    let l = h.cm(B).create_id(CB, T, PortSpace::Tcp).unwrap();
    h.cm(B).bind(CB, l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471)).unwrap();
    h.cm(B).listen(CB, l, 8).unwrap();
    let g = h.cm(A).create_id(CG, T, PortSpace::Tcp).unwrap();
    h.cm(A).resolve_addr(CG, g, None, SocketAddrV4::new(B, 7471)).unwrap();
    h.cm(A).resolve_route(CG, g).unwrap();
    h.events(A);
    h.cm(A).connect(CG, g, ConnInfo::default(), T0).unwrap();
    // Paused before the REQ went (it goes in `moved`'s run and its REP is
    // dropped at A).
    h.moved(|_| {});
    assert_eq!(h.events(C), [(g, EventKind::Unreachable, -errno::ECONNRESET)]);
}

/// A snapshot's rdma_cm part is untrusted: forged ones are refused, and
/// an id in use on the importer is a collision that changes nothing.
#[test]
fn forged_or_colliding_cm_state_is_refused() {
    let mut h = Hosts::new();
    let (g, _) = h.connected();
    let mut ids = h.cm(A).export_ids(&[CG]);
    ids[0].channel = 1;
    let chan = |events| CmChannelSnap { channel: 1, ctx: CG.0, events };
    let good = CmSnapshot { channels: vec![chan(vec![])], ids };
    let qps = [(CG.0, 0x10011)];
    good.check(&[CG.0], &qps).unwrap();
    let ev = CmEvent {
        ctx: CG,
        id: g,
        kind: EventKind::Disconnected,
        status: 0,
        listen_id: None,
        peer: None,
        qkey: 0,
        local: None,
        remote: None,
    };
    let forged: Vec<(&str, CmSnapshot)> = vec![
        ("an id twice", CmSnapshot { ids: vec![good.ids[0].clone(), good.ids[0].clone()], ..good.clone() }),
        ("no channel", CmSnapshot { channels: vec![], ..good.clone() }),
        (
            "channel 0",
            CmSnapshot { channels: vec![CmChannelSnap { channel: 0, ..chan(vec![]) }], ..good.clone() },
        ),
        ("another context's channel", {
            let mut s = good.clone();
            s.channels[0].ctx = 7;
            s
        }),
        ("an event of an id not there", {
            let mut s = good.clone();
            s.channels[0].events = vec![CmEvent { id: 0x99, ..ev.clone() }];
            s
        }),
        ("an event of another context", {
            let mut s = good.clone();
            s.channels[0].events = vec![CmEvent { ctx: ContextId(7), ..ev.clone() }];
            s
        }),
        ("a QP not in the snapshot", {
            let mut s = good.clone();
            s.ids[0].qp = Some((CG.0, 0x777));
            s
        }),
        ("connected to no peer", {
            let mut s = good.clone();
            s.ids[0].peer = None;
            s
        }),
        ("a PSN past 24 bits", {
            let mut s = good.clone();
            s.ids[0].psn = 1 << 24;
            s
        }),
        ("too many events", {
            let mut s = good.clone();
            s.channels[0].events = vec![ev.clone(); MAX_CM_UNREAD as usize + 1];
            s
        }),
    ];
    for (what, s) in forged {
        assert!(s.check(&[CG.0], &qps).is_err(), "{what} passed");
    }
    let mut with_event = good.clone();
    with_event.channels[0].events = vec![ev];
    with_event.check(&[CG.0], &qps).unwrap();
    // On A the id is in use: a collision, and nothing changed.
    let before = h.cm(A).export_ids(&[CG]);
    let e = h.cm(A).import_ids(T, &good.ids).unwrap_err();
    assert!(matches!(e, SnapshotError::Collision(_)), "{e}");
    assert_eq!(h.cm(A).export_ids(&[CG]), before);
}

/// Ids are numbered in the daemon's space, so that a moved id keeps its
/// number on a daemon of another space.
#[test]
fn ids_are_numbered_in_the_daemons_space() {
    let mut h = Hosts::new();
    let a = h.cm(A).create_id(CG, T, PortSpace::Tcp).unwrap();
    let c = h.cm(C).create_id(CG, T, PortSpace::Tcp).unwrap();
    assert_eq!((a >> 24, c >> 24), (1, 3));
    assert_ne!(a, c);
}

/// Both ends moving at once is not handled, but a Moved that reaches a
/// paused peer ends nothing: the peer holds still (no DREQ).
#[test]
fn a_moved_for_a_paused_peer_ends_nothing() {
    let mut h = Hosts::new();
    let (g, b) = h.connected();
    h.cm(B).pause_tenant(T);
    h.moved(|_| {});
    assert!(h.sent_by(B).is_empty(), "{:?}", h.log);
    assert_eq!(h.cm(C).state(CG, g), Some(State::Established));
    assert_eq!(h.cm(B).state(CB, b), Some(State::Established));
}

/// The guest established its connection (its RTU sent) and moved before
/// B heard the RTU: it lags on the source's link behind the move, or is
/// lost with it. C's Moved stands for it: B's connection is established
/// and follows the guest to C; the late RTU from A is dropped; B's
/// disconnect then reaches C, one DISCONNECTED on each side (review 3 of
/// linkdefer, A: the Moved was dropped, and the late RTU bound B to A,
/// where nobody answers it any more).
#[test]
fn a_moved_before_the_rtu_establishes_the_connection_and_the_late_rtu_is_dropped() {
    let mut h = Hosts::new();
    let l = h.cm(B).create_id(CB, T, PortSpace::Tcp).unwrap();
    h.cm(B).bind(CB, l, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 7471)).unwrap();
    h.cm(B).listen(CB, l, 8).unwrap();
    let g = h.cm(A).create_id(CG, T, PortSpace::Tcp).unwrap();
    h.cm(A).resolve_addr(CG, g, None, SocketAddrV4::new(B, 7471)).unwrap();
    h.cm(A).resolve_route(CG, g).unwrap();
    h.cm(A).connect(CG, g, ConnInfo { qp_num: 0x10011, ..Default::default() }, T0).unwrap();
    h.run();
    let b = h.events(B)[0].0;
    h.cm(B).accept(CB, b, ConnInfo { qp_num: 0x20011, ..Default::default() }, 0, T0).unwrap();
    h.run();
    h.cm(A).establish(CG, g).unwrap();
    let (to, rtu) = h.cm(A).poll_transmit().unwrap();
    assert_eq!((to, &rtu), (B, &CmMessage::Rtu { to: b, from: g }));
    h.events(A);
    h.log.clear();
    h.moved(|_| {});
    assert_eq!(h.cm(B).state(CB, b), Some(State::Established), "the Moved was dropped");
    assert_eq!(h.events(B), [(b, EventKind::Established, 0)]);
    // The RTU comes late, from the source: B is established already, and
    // now with C.
    h.cm(B).handle_message(A, rtu);
    h.run();
    assert!(h.events(B).is_empty() && h.sent_by(B).is_empty(), "{:?}", h.log);
    assert_eq!(h.cm(B).state(CB, b), Some(State::Established));
    h.cm(B).disconnect(CB, b, T0).unwrap();
    h.run();
    assert_eq!(h.events(C), [(g, EventKind::Disconnected, 0)]);
    assert_eq!(h.events(B), [(b, EventKind::Disconnected, 0)]);
    assert!(h.sent_by(A).is_empty() && !h.log.iter().any(|(_, to, _)| *to == A), "{:?}", h.log);
}

/// The moved connection's Moved went by no link of C's manager (held for
/// a dial, then sent by the link the driver told of first), and its
/// program disconnected before the manager heard of the host's links:
/// the DREQ, queued by no link too, goes by the link the connection was
/// bound to meanwhile, not by the driver's choice (the newest verified
/// link, which the peer does not know the connection by), and the
/// driver's report of a later message does not move the connection
/// (review 3 of linkdefer, B).
#[test]
fn a_later_message_queued_by_no_link_goes_by_its_connections_link() {
    let mut h = Hosts::new();
    let (g, b) = h.connected();
    h.cm(A).pause_tenant(T);
    let ids = h.cm(A).export_ids(&[CG]);
    h.cm(C).import_ids(T, &ids).unwrap();
    h.cm(A).forget_contexts(T, &[CG]);
    h.cm(C).resume_tenant(T, T0);
    let c = h.cm(C);
    let (host, link, moved) = c.poll_transmit_by().unwrap();
    assert_eq!((host, link, moved), (B, None, CmMessage::Moved { to: b, from: g, tenant: T.0 }));
    c.disconnect(CG, g, T0).unwrap();
    // The held Moved went by link 1, told first; a verified one came after.
    c.link_up(B, LinkId(1), false);
    c.link_up(B, LinkId(2), true);
    let (host, link, dreq) = c.poll_transmit_by().unwrap();
    assert_eq!((host, &dreq), (B, &CmMessage::Dreq { to: b, from: g }));
    assert_eq!(link, Some(LinkId(1)), "the DREQ by another link than its connection's");
    // Were it sent by the other all the same, the connection stays.
    c.sent_by(B, &dreq, LinkId(2));
    c.link_down(B, Some(LinkId(2)));
    assert_eq!(c.state(CG, g), Some(State::DreqSent), "moved to the link of a later message");
    c.link_down(B, Some(LinkId(1)));
    assert_eq!(c.state(CG, g), Some(State::Closed));
}
