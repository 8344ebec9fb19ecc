//! The RC transport between two hosts, deterministic: two `Hca`s whose
//! link is an in-memory byte stream, every frame encoded and decoded as
//! on TCP, with faults (a cut link, a stalled peer) injected by the test.

use super::*;
use crate::verbs::Gid;
use crate::wire::{parse_frame, FrameRepr};

const IP_A: [u8; 4] = [10, 0, 0, 1];
const IP_B: [u8; 4] = [10, 0, 0, 2];

struct Host {
    env: Env,
    link: LinkId,
}

/// Two hosts and the link between them.
struct TwoHosts {
    a: Host,
    b: Host,
    /// Frames each way are delivered (false: the link is stalled).
    flowing: bool,
    /// Frames that crossed, per direction, with their opcodes.
    log: Vec<(char, crate::wire::Opcode, u32)>,
}

fn host(ip: [u8; 4]) -> Env {
    host_with(ip, |_| {})
}

pub(super) fn host_with(ip: [u8; 4], tune: impl Fn(&mut HcaConfig)) -> Env {
    let mut env = Env::new();
    let mut config = HcaConfig::for_host(ip);
    tune(&mut config);
    env.hca = Hca::new(config, Box::new(Counter(u32::from(ip[3]) << 16)));
    env.hca.open_context(C1, TENANT).unwrap();
    env.hca.open_context(C2, TENANT).unwrap();
    env.hca.open_context(C3, OTHER_TENANT).unwrap();
    env
}

impl TwoHosts {
    fn new(chunk: u32) -> TwoHosts {
        TwoHosts::with(chunk, |_| {})
    }

    /// Two hosts whose devices `tune` configures.
    fn with(chunk: u32, tune: impl Fn(&mut HcaConfig)) -> TwoHosts {
        let mut a = host_with(IP_A, &tune);
        let mut b = host_with(IP_B, &tune);
        let la = a.hca.link_up(LinkInfo {
            gid: Gid::from_ipv4(IP_B),
            lid: b.hca.config().port.lid,
            chunk,
            verified: true,
        });
        let lb = b.hca.link_up(LinkInfo {
            gid: Gid::from_ipv4(IP_A),
            lid: a.hca.config().port.lid,
            chunk,
            verified: true,
        });
        TwoHosts {
            a: Host { env: a, link: la },
            b: Host { env: b, link: lb },
            flowing: true,
            log: Vec::new(),
        }
    }

    /// Connects `qa` on A with `qb` on B, addressed by GID.
    fn connect(&mut self, qa: u32, qb: u32, c: Conn) {
        connect_side(&mut self.a.env, qa, qb, IP_B, c);
        connect_side(&mut self.b.env, qb, qa, IP_A, c);
    }

    /// An end on each host, connected.
    fn pair(chunk: u32, c: Conn) -> (TwoHosts, End, End) {
        let mut t = TwoHosts::new(chunk);
        let a = t.a.env.end(C1);
        let b = t.b.env.end(C1);
        t.connect(a.qpn, b.qpn, c);
        (t, a, b)
    }

    /// An end on each host, connected, while A has no link to B.
    fn unlinked_pair(mut self) -> (TwoHosts, End, End) {
        self.a.env.hca.link_down(self.a.link);
        let a = self.a.env.end(C1);
        let b = self.b.env.end(C1);
        self.connect(a.qpn, b.qpn, conn());
        (self, a, b)
    }

    /// Moves one frame from `from` to `to`, encoded and decoded as bytes.
    fn carry(
        from: &mut Host,
        to: &mut Host,
        now: Instant,
        dir: char,
        log: &mut Vec<(char, crate::wire::Opcode, u32)>,
    ) -> bool {
        let Some(t) = from.env.hca.poll_transmit(from.link, now, &mut from.env.io) else { return false };
        Self::deliver(&t, to, now, dir, log);
        true
    }

    /// Delivers frame `t` to `to`, encoded and decoded as bytes.
    fn deliver(
        t: &crate::hca::remote::Transmit,
        to: &mut Host,
        now: Instant,
        dir: char,
        log: &mut Vec<(char, crate::wire::Opcode, u32)>,
    ) {
        let bytes = frame_bytes(t);
        let (repr, payload) = parse_frame(&bytes).expect("a frame we emitted parses");
        assert_eq!(repr.buffer_len(), bytes.len());
        let FrameRepr::Data(d) = repr else { panic!("data frames only") };
        log.push((dir, d.opcode, d.psn));
        match to.env.hca.handle_data(to.link, &d, now, &mut to.env.io) {
            Sink::Place(w) => {
                assert_eq!(w.iter().map(|s| s.len).sum::<usize>(), payload.len());
                let mut at = 0;
                for s in &w {
                    s.region.write(s.off, &payload[at..at + s.len]).unwrap();
                    at += s.len;
                }
            }
            Sink::Discard => {}
        }
        to.env.hca.data_placed(to.link, now, &mut to.env.io);
    }

    /// Engine passes and frame deliveries on both hosts until nothing moves.
    fn run(&mut self, now: Instant) {
        for _ in 0..10_000 {
            let mut busy = self.a.env.step(now).again() | self.b.env.step(now).again();
            if self.flowing {
                busy |= Self::carry(&mut self.a, &mut self.b, now, '>', &mut self.log);
                busy |= Self::carry(&mut self.b, &mut self.a, now, '<', &mut self.log);
            }
            // As the engine does: a QP that failed on a frame is flushed
            // by another pass.
            busy |= self.a.env.hca.needs_pass() | self.b.env.hca.needs_pass();
            if !busy {
                return;
            }
        }
        panic!("the hosts stayed busy for 10000 rounds");
    }

    /// `n` steps of `step` from `from`, running both hosts after each;
    /// returns the time reached.
    fn advance(&mut self, from: Instant, step: Duration, n: u32) -> Instant {
        let mut now = from;
        for _ in 0..n {
            now = now + step;
            self.run(now);
        }
        now
    }

    /// [`Self::advance`], running only A.
    fn advance_a_only(&mut self, from: Instant, step: Duration, n: u32) -> Instant {
        let mut now = from;
        for _ in 0..n {
            now = now + step;
            self.run_a_only(now);
        }
        now
    }

    /// Only A's side: frames A would send stay queued.
    fn run_a_only(&mut self, now: Instant) {
        for _ in 0..1000 {
            if !self.a.env.step(now).again() {
                return;
            }
        }
    }
}

/// Frame `t` as it goes on the wire: header, copied data, payload.
pub(super) fn frame_bytes(t: &crate::hca::remote::Transmit) -> Vec<u8> {
    let mut bytes = t.header.to_vec();
    bytes.extend(&t.data);
    for s in &t.payload {
        let mut v = vec![0; s.len];
        s.region.read(s.off, &mut v).unwrap();
        bytes.extend(v);
    }
    bytes
}

/// The data header of frame `t`, parsed from its bytes.
fn data_header(t: &crate::hca::remote::Transmit) -> crate::wire::DataRepr {
    let (FrameRepr::Data(d), _) = parse_frame(&frame_bytes(t)).expect("a frame we emitted parses") else {
        panic!("a data frame")
    };
    d
}

/// RESET -> RTS on one host, towards `peer` on the host at `ip`.
/// An address vector naming host `ip` by its GID, `hop_limit` hops away.
pub(super) fn gid_ah(ip: [u8; 4], hop_limit: u8) -> crate::verbs::AhAttr {
    crate::verbs::AhAttr {
        is_global: true,
        dgid: Gid::from_ipv4(ip),
        hop_limit,
        port_num: 1,
        ..Default::default()
    }
}

pub(super) fn connect_side(env: &mut Env, me: u32, peer: u32, ip: [u8; 4], c: Conn) {
    env.bring_to_init(me, c);
    env.bring_to_rtr_via(me, peer, c, gid_ah(ip, 1), 100, 4);
    env.bring_to_rts_via(me, c, 100, 4);
}

/// A UD QP in RTS (Q_Key 0x1111) with its PD, CQ and a 16 KiB region.
fn ud_end(env: &mut Env) -> (u32, u32, u32, Buf) {
    ud_end_in(env, C1)
}

/// [`ud_end`] in context `ctx`.
fn ud_end_in(env: &mut Env, ctx: ContextId) -> (u32, u32, u32, Buf) {
    let pd = env.hca.alloc_pd(ctx).unwrap();
    let (cq, _) = env.hca.create_cq(ctx, 64).unwrap();
    let init = QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: cap(),
        sq_sig_all: false,
    };
    let qpn = env.qp(ctx, pd, init);
    let buf = env.mr(ctx, pd, 16 << 10, FULL);
    ud_up(env, qpn);
    (pd, cq, qpn, buf)
}

/// RESET -> RTS for a UD QP.
fn ud_up(env: &mut Env, qpn: u32) {
    for (st, mask) in [
        (QpState::Init, QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY),
        (QpState::Rtr, QpAttrMask::STATE),
        (QpState::Rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN),
    ] {
        let attr = QpAttr { qp_state: st, port_num: 1, qkey: 0x1111, ..QpAttr::default() };
        assert_eq!(env.modify(qpn, &attr, mask), Ok(st));
    }
}

pub(super) fn conn() -> Conn {
    Conn { rnr_retry: 3, min_rnr_timer: 1, access: QP_ACCESS, timeout: 14, retry_cnt: 2 }
}

#[test]
fn every_opcode_crosses_hosts_with_data_intact() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    let msg = pattern(1000, 3);
    a.buf.write(0, &msg);
    // A send of four chunks into two receive SGEs.
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 300), b.buf.sge(1000, 800)]));
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 1000)], SendFlags::SIGNALED));
    // A write of three chunks from two SGEs, then a write with immediate.
    t.a.env.io.post_send(
        a.qpn,
        rdma(
            2,
            SendOpcode::RdmaWrite,
            &[a.buf.sge(0, 400), a.buf.sge(400, 300)],
            b.buf.addr + 4096,
            b.buf.key,
        ),
    );
    t.b.env.io.post_recv(b.qpn, recv(11, &[]));
    let mut wimm = rdma(3, SendOpcode::RdmaWriteWithImm, &[a.buf.sge(0, 600)], b.buf.addr + 8192, b.buf.key);
    wimm.imm_data = 0x1234_5678;
    t.a.env.io.post_send(a.qpn, wimm);
    t.run(T0);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0),
            req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(3, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0),
        ]
    );
    let got = t.b.env.poll(b.cq);
    assert_eq!(got.len(), 2);
    assert_eq!(
        (got[0].wr_id, got[0].status, got[0].byte_len, got[0].src_qp),
        (10, WcStatus::Success, 1000, a.qpn)
    );
    assert_eq!(got[0].slid, t.a.env.hca.config().port.lid);
    assert_eq!(
        (got[1].wr_id, got[1].opcode, got[1].byte_len, got[1].imm_data),
        (11, WcOpcode::RecvRdmaWithImm, 600, 0x1234_5678)
    );
    assert_eq!([b.buf.read(0, 300), b.buf.read(1000, 700)].concat(), msg);
    assert_eq!(b.buf.read(4096, 700), msg[..700]);
    assert_eq!(b.buf.read(8192, 600), msg[..600]);

    // A read of five chunks into two SGEs, and both atomics.
    let remote = pattern(1200, 9);
    b.buf.write(16384, &remote);
    b.buf.write(32768, &7u64.to_le_bytes());
    t.a.env.io.post_send(
        a.qpn,
        rdma(
            4,
            SendOpcode::RdmaRead,
            &[a.buf.sge(20000, 500), a.buf.sge(30000, 700)],
            b.buf.addr + 16384,
            b.buf.key,
        ),
    );
    let mut cas = rdma(5, SendOpcode::AtomicCmpAndSwp, &[a.buf.sge(40000, 8)], b.buf.addr + 32768, b.buf.key);
    cas.compare_add = 7;
    cas.swap = 100;
    t.a.env.io.post_send(a.qpn, cas);
    let mut faa =
        rdma(6, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(40008, 8)], b.buf.addr + 32768, b.buf.key);
    faa.compare_add = 5;
    t.a.env.io.post_send(a.qpn, faa);
    t.run(T0);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(4, WcStatus::Success, WcOpcode::RdmaRead, a.qpn, 1200),
            req_cqe(5, WcStatus::Success, WcOpcode::CompSwap, a.qpn, 8),
            req_cqe(6, WcStatus::Success, WcOpcode::FetchAdd, a.qpn, 8),
        ]
    );
    assert_eq!([a.buf.read(20000, 500), a.buf.read(30000, 700)].concat(), remote);
    assert_eq!((a.buf.u64_at(40000), a.buf.u64_at(40008), b.buf.u64_at(32768)), (7, 100, 105));
    assert_eq!(t.a.env.io.state(a.qpn), Some(QpState::Rts));
    assert_eq!(t.b.env.io.state(b.qpn), Some(QpState::Rts));
}

#[test]
fn a_signaled_write_completes_only_once_the_peer_has_placed_it() {
    let (mut t, a, b) = TwoHosts::pair(1024, conn());
    a.buf.write(0, b"placed");
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 6)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    // The frame is out (A's side took it), the ACK has not come back.
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    assert!(t.a.env.poll(a.cq).is_empty(), "no completion before the ACK");
    assert_eq!(b.buf.read(0, 6), b"placed");
    assert!(TwoHosts::carry(&mut t.b, &mut t.a, T0, '<', &mut t.log));
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

#[test]
fn many_requests_are_in_flight_at_once_and_complete_in_order() {
    let (mut t, a, b) = TwoHosts::pair(1024, conn());
    for i in 0..8u64 {
        t.b.env.io.post_recv(b.qpn, recv(100 + i, &[b.buf.sge(i * 64, 64)]));
        t.a.env.io.post_send(a.qpn, wr(i, SendOpcode::Send, &[a.buf.sge(i * 64, 64)], SendFlags::SIGNALED));
    }
    t.run_a_only(T0);
    // Eight frames go out before the first ACK is read.
    for _ in 0..8 {
        assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    }
    assert!(t.a.env.poll(a.cq).is_empty());
    t.run(T0);
    let ids: Vec<u64> = t.a.env.poll(a.cq).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (0..8).collect::<Vec<_>>());
    let ids: Vec<u64> = t.b.env.poll(b.cq).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (100..108).collect::<Vec<_>>());
}

#[test]
fn rnr_nak_waits_the_responders_timer_then_resends() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    a.buf.write(0, &pattern(600, 1));
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 600)], SendFlags::SIGNALED));
    t.a.env
        .io
        .post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr + 4096, b.buf.key));
    t.run(T0);
    assert!(t.a.env.poll(a.cq).is_empty(), "RNR: nothing completes");
    assert!(t.log.iter().any(|(d, op, _)| *d == '<' && *op == crate::wire::Opcode::Acknowledge));
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 1000)]));
    // Before the RNR delay has passed nothing is resent.
    t.run(T0);
    assert!(t.a.env.poll(a.cq).is_empty());
    let later = T0 + timers::rnr_delay(1) + Duration::from_micros(1);
    t.run(later);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0),
            req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)
        ]
    );
    assert_eq!(b.buf.read(0, 600), pattern(600, 1));
    let got = t.b.env.poll(b.cq);
    assert_eq!((got.len(), got[0].byte_len), (1, 600));
}

#[test]
fn rnr_retries_spent_end_in_rnr_retry_exc_err() {
    let c = Conn { rnr_retry: 1, ..conn() };
    let (mut t, a, _b) = TwoHosts::pair(256, c);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.a.env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    let mut now = T0;
    for _ in 0..4 {
        t.run(now);
        now = now + timers::rnr_delay(1) + Duration::from_micros(1);
    }
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::RnrRetryExcErr, WcOpcode::Send, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0)
        ]
    );
    assert_eq!(t.a.env.io.state(a.qpn), Some(QpState::Err));
}

#[test]
fn write_with_immediate_waits_for_a_receive_at_its_last_chunk() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    a.buf.write(0, &pattern(700, 4));
    let mut w = rdma(1, SendOpcode::RdmaWriteWithImm, &[a.buf.sge(0, 700)], b.buf.addr, b.buf.key);
    w.imm_data = 9;
    t.a.env.io.post_send(a.qpn, w);
    t.run(T0);
    assert!(t.a.env.poll(a.cq).is_empty());
    t.b.env.io.post_recv(b.qpn, recv(5, &[]));
    t.run(T0 + timers::rnr_delay(1) + Duration::from_micros(1));
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    let got = t.b.env.poll(b.cq);
    assert_eq!((got[0].wr_id, got[0].byte_len, got[0].imm_data), (5, 700, 9));
    assert_eq!(b.buf.read(0, 700), pattern(700, 4));
}

#[test]
fn a_bad_rkey_is_a_remote_access_error_on_both_hosts() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.a.env
        .io
        .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key + 1));
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.run(T0);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, a.qpn, 0)
        ]
    );
    assert_eq!(t.a.env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(t.b.env.io.state(b.qpn), Some(QpState::Err));
    assert!(t
        .b
        .env
        .io
        .events
        .iter()
        .any(|(_, e)| e.event_type == AsyncEventType::QpAccessErr && e.element == b.qpn));
    assert_eq!(t.b.env.poll(b.cq), vec![recv_err(10, WcStatus::WrFlushErr, b.qpn)]);
    // Out of bounds, and a read without the access right, likewise.
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.a.env.io.post_send(
        a.qpn,
        rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 64)], b.buf.addr + (64 << 10) - 8, b.buf.key),
    );
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaRead, a.qpn, 0)]);
}

#[test]
fn a_send_too_long_for_the_receive_is_an_invalid_request() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 300)]));
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 600)], SendFlags::SIGNALED));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RemInvReqErr, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(t.b.env.poll(b.cq), vec![recv_err(10, WcStatus::LocLenErr, b.qpn)]);
    assert_eq!(t.b.env.io.state(b.qpn), Some(QpState::Err));
}

#[test]
fn a_stalled_link_ends_in_retry_exc_err_after_timeout_and_retries_and_nothing_twice() {
    let c = Conn { timeout: 10, retry_cnt: 2, ..conn() };
    let (mut t, a, b) = TwoHosts::pair(256, c);
    t.flowing = false;
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    // Frames leave A; none is answered.
    while TwoHosts::carry(
        &mut t.a,
        &mut Host { env: host([10, 9, 9, 9]), link: LinkId(99) },
        T0,
        '>',
        &mut t.log,
    ) {}
    let tick = timers::ack_timeout(10).unwrap();
    let mut now = T0;
    // Three periods of the timer (the first try and two retries) fail it,
    // not two.
    for _ in 0..2 {
        now = now + tick + Duration::from_nanos(1);
        t.run(now);
        assert!(t.a.env.poll(a.cq).is_empty());
    }
    now = now + tick + Duration::from_nanos(1);
    t.run(now);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, a.qpn, 0)
        ]
    );
    // The link comes back and the old ACKs arrive: nothing completes twice.
    t.flowing = true;
    t.run(now);
    assert!(t.a.env.poll(a.cq).is_empty());
}

#[test]
fn a_link_that_goes_down_fails_its_qps_and_a_new_link_serves_new_qps() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    // The frame leaves; the link goes down before any answer.
    assert!(TwoHosts::carry(
        &mut t.a,
        &mut Host { env: host([10, 9, 9, 9]), link: LinkId(99) },
        T0,
        '>',
        &mut t.log
    ));
    t.a.env.hca.link_down(t.a.link);
    t.b.env.hca.link_down(t.b.link);
    let tick = timers::ack_timeout(14).unwrap();
    let now = t.advance_a_only(T0, tick + Duration::from_nanos(1), 3);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    // A new link; new QPs connect over it.
    let chunk = 256;
    t.a.link = t.a.env.hca.link_up(LinkInfo { gid: Gid::from_ipv4(IP_B), lid: 2, chunk, verified: true });
    t.b.link = t.b.env.hca.link_up(LinkInfo { gid: Gid::from_ipv4(IP_A), lid: 1, chunk, verified: true });
    let a2 = t.a.env.end(C1);
    let b2 = t.b.env.end(C1);
    t.connect(a2.qpn, b2.qpn, conn());
    t.a.env
        .io
        .post_send(a2.qpn, rdma(7, SendOpcode::RdmaWrite, &[a2.buf.sge(0, 8)], b2.buf.addr, b2.buf.key));
    t.run(now);
    assert_eq!(t.a.env.poll(a2.cq), vec![req_cqe(7, WcStatus::Success, WcOpcode::RdmaWrite, a2.qpn, 0)]);
}

/// B's daemon restarted and linked again while A's first link to it is
/// not yet found dead: a QP connected now runs over the newest link (the
/// oldest took it to the dead daemon, and the QP failed when that link's
/// end was found), and the old link's end leaves it (issue 16 review).
#[test]
fn a_new_qp_runs_over_the_newest_link_to_its_host_and_outlives_the_old_one() {
    let mut t = TwoHosts::new(256);
    let old = t.a.link;
    t.a.link =
        t.a.env.hca.link_up(LinkInfo { gid: Gid::from_ipv4(IP_B), lid: 2, chunk: 256, verified: true });
    let a = t.a.env.end(C1);
    let b = t.b.env.end(C1);
    t.connect(a.qpn, b.qpn, conn());
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.hca.qp_path(a.qpn), Some(Path::Link(Some(t.a.link))));
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    t.a.env.hca.link_down(old);
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

#[test]
fn with_no_link_the_peer_is_wanted_and_the_request_times_out() {
    let (mut t, a, b) = TwoHosts::new(256).unlinked_pair();
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    assert_eq!(t.a.env.hca.take_wanted_peers(), vec![Gid::from_ipv4(IP_B)]);
    assert_eq!(t.a.env.hca.qp_path(a.qpn), Some(Path::Link(None)));
    let tick = timers::ack_timeout(14).unwrap();
    t.advance_a_only(T0, tick + Duration::from_nanos(1), 3);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

#[test]
fn frames_from_another_tenant_or_qp_are_dropped_without_effect() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    // A QP of another tenant on A aimed at b's QP number.
    let x = t.a.env.end(C3);
    connect_side(&mut t.a.env, x.qpn, b.qpn, IP_B, conn());
    t.a.env.io.post_send(x.qpn, rdma(1, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    let before = b.buf.read(0, 8);
    x.buf.write(0, b"intruder");
    t.run(T0);
    assert_eq!(b.buf.read(0, 8), before, "nothing placed across tenants");
    assert_eq!(t.b.env.io.state(b.qpn), Some(QpState::Rts));
    // a's traffic still flows.
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert!(t.b.env.hca.links()[0].stats.dropped_in >= 1);
}

#[test]
fn a_small_message_waits_at_most_one_chunk_per_busy_qp() {
    let mut t = TwoHosts::new(1024);
    let big = t.a.env.end(C1);
    let small = t.a.env.end(C1);
    let bb = t.b.env.end(C1);
    let bs = t.b.env.end(C1);
    t.connect(big.qpn, bb.qpn, conn());
    t.connect(small.qpn, bs.qpn, conn());
    t.a.env.io.post_send(
        big.qpn,
        rdma(1, SendOpcode::RdmaWrite, &[big.buf.sge(0, 60 << 10)], bb.buf.addr, bb.buf.key),
    );
    t.b.env.io.post_recv(bs.qpn, recv(9, &[bs.buf.sge(0, 8)]));
    t.a.env.io.post_send(small.qpn, wr(2, SendOpcode::Send, &[small.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run(T0);
    let first_small =
        t.log.iter().position(|(d, op, _)| *d == '>' && *op == crate::wire::Opcode::SendOnly).unwrap();
    assert!(
        first_small <= 2,
        "the send went out as frame {first_small}, behind one chunk of the write at most"
    );
    assert_eq!(t.a.env.poll(big.cq).len(), 1);
    assert_eq!(t.a.env.poll(small.cq).len(), 1);
}

/// On a link, tenants take turns a frame at a time: another tenant's small
/// message waits behind one chunk of a tenant with eight busy QPs, not
/// behind one chunk of each.
#[test]
fn a_small_message_waits_at_most_one_chunk_per_busy_tenant() {
    let mut t = TwoHosts::new(1024);
    t.a.env.hca.open_context(ContextId(4), OTHER_TENANT).unwrap();
    t.b.env.hca.open_context(ContextId(4), OTHER_TENANT).unwrap();
    let mut bigs = Vec::new();
    for _ in 0..8 {
        let (big, bb) = (t.a.env.end(C1), t.b.env.end(C1));
        t.connect(big.qpn, bb.qpn, conn());
        t.a.env.io.post_send(
            big.qpn,
            rdma(1, SendOpcode::RdmaWrite, &[big.buf.sge(0, 60 << 10)], bb.buf.addr, bb.buf.key),
        );
        bigs.push(big);
    }
    let (small, bs) = (t.a.env.end(ContextId(4)), t.b.env.end(ContextId(4)));
    t.connect(small.qpn, bs.qpn, conn());
    t.b.env.io.post_recv(bs.qpn, recv(9, &[bs.buf.sge(0, 8)]));
    // The writes' frames are queued first; then the small send is posted.
    t.run_a_only(T0);
    for _ in 0..3 {
        assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    }
    t.a.env.io.post_send(small.qpn, wr(2, SendOpcode::Send, &[small.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run(T0);
    let out: Vec<crate::wire::Opcode> =
        t.log.iter().filter(|(d, ..)| *d == '>').map(|(_, op, _)| *op).collect();
    let first_small = out.iter().position(|op| *op == crate::wire::Opcode::SendOnly).unwrap();
    assert!(first_small <= 3 + 2, "the send went out as frame {first_small} of {out:?}");
    assert_eq!(t.a.env.poll(small.cq).len(), 1);
    for big in &bigs {
        assert_eq!(t.a.env.poll(big.cq).len(), 1);
    }
}

#[test]
fn datagrams_cross_hosts_with_their_grh_and_are_lost_quietly_when_no_one_takes_them() {
    let mut t = TwoHosts::new(1024);
    let (pa, cqa, qa, bufa) = ud_end(&mut t.a.env);
    let (_pb, cqb, qb, bufb) = ud_end(&mut t.b.env);
    let mut ah = gid_ah(IP_B, 64);
    ah.dlid = 0;
    let ahn = t.a.env.hca.create_ah(C1, pa, ah).unwrap();
    bufa.write(0, b"datagram");
    let mut w = wr(1, SendOpcode::SendWithImm, &[bufa.sge(0, 8)], SendFlags::SIGNALED);
    w.imm_data = 5;
    w.ud = crate::ring::UdDest { remote_qpn: qb, remote_qkey: 0x1111, ah: ahn };
    t.b.env.io.post_recv(qb, recv(20, &[bufb.sge(0, 100)]));
    t.a.env.io.post_send(qa, w.clone());
    // A wrong Q_Key: lost, and the sender still completes successfully.
    let mut bad = w.clone();
    bad.wr_id = 2;
    bad.ud.remote_qkey = 0x2222;
    t.a.env.io.post_send(qa, bad);
    t.run(T0);
    let sent = t.a.env.poll(cqa);
    assert_eq!(
        sent.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let got = t.b.env.poll(cqb);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].byte_len, got[0].src_qp, got[0].imm_data), (20, 48, qa, 5));
    assert!(got[0].wc_flags.contains(WcFlags::GRH));
    assert_eq!(bufb.read(40, 8), b"datagram");
    assert_eq!(bufb.read(8, 16), Gid::from_ipv4(IP_A).0.to_vec(), "the GRH carries the sender's GID");
}

#[test]
fn a_held_ack_goes_with_the_next_request_or_when_its_delay_is_over() {
    let mut t = TwoHosts::new(1024);
    t.b.env.hca.config.ack_delay = Duration::from_micros(10);
    let a = t.a.env.end(C1);
    let b = t.b.env.end(C1);
    t.connect(a.qpn, b.qpn, conn());
    // A QP that only receives acknowledges at once.
    t.a.env.io.post_send(a.qpn, rdma(9, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![9]);
    // Once B sends too, it holds its ACKs.
    t.b.env.io.post_send(b.qpn, rdma(8, SendOpcode::RdmaWrite, &[b.buf.sge(0, 8)], a.buf.addr, a.buf.key));
    t.run(T0);
    assert_eq!(t.b.env.poll(b.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![8]);
    // Two writes A -> B: B holds one (merged) ACK.
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert!(t.a.env.poll(a.cq).is_empty(), "the ACK is held");
    assert_eq!(t.b.env.hca.ack_timer(b.qpn), Some(T0 + Duration::from_micros(10)));
    // B writes back: its request and the held ACK leave together.
    t.b.env.io.post_send(b.qpn, rdma(3, SendOpcode::RdmaWrite, &[b.buf.sge(0, 8)], a.buf.addr, a.buf.key));
    t.log.clear();
    t.run(T0);
    let from_b: Vec<_> = t.log.iter().filter(|(d, _, _)| *d == '<').map(|(_, op, _)| *op).collect();
    assert_eq!(
        from_b,
        vec![crate::wire::Opcode::WriteOnly, crate::wire::Opcode::Acknowledge],
        "one ACK for both writes, behind the request"
    );
    assert_eq!(t.a.env.poll(a.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![1, 2]);
    // A's ACK for B's write is immediate (A has no delay).
    assert_eq!(t.b.env.poll(b.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![3]);
    // With nothing to ride on, the ACK leaves when its delay is over.
    t.a.env.io.post_send(a.qpn, rdma(4, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert!(t.a.env.poll(a.cq).is_empty());
    t.run(T0 + Duration::from_micros(11));
    assert_eq!(t.a.env.poll(a.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![4]);
}

/// How a program ends its QP once it has seen its last completion.
#[derive(Debug, Clone, Copy)]
enum Teardown {
    Destroy,
    Reset,
    Error,
}

#[test]
fn a_qp_ended_right_after_its_last_receive_still_acknowledges_it() {
    // The end of a ping-pong: B's QP sends too, so it holds its ACK for
    // `ack_delay`; B's program sees the receive complete and ends its QP
    // before the delay is over (a loaded host runs the engine late, and
    // the destroy may come first). A's last send must still succeed.
    for end in [Teardown::Destroy, Teardown::Reset, Teardown::Error] {
        last_receive_then_teardown(end);
    }
}

fn last_receive_then_teardown(end: Teardown) {
    let mut t = TwoHosts::new(1024);
    t.b.env.hca.config.ack_delay = Duration::from_micros(10);
    let a = t.a.env.end(C1);
    let b = t.b.env.end(C1);
    t.connect(a.qpn, b.qpn, conn());
    // The pong before: B has sent lately.
    t.b.env.io.post_send(b.qpn, rdma(8, SendOpcode::RdmaWrite, &[b.buf.sge(0, 8)], a.buf.addr, a.buf.key));
    t.run(T0);
    assert_eq!(t.b.env.poll(b.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![8]);
    // The last ping.
    t.b.env.io.post_recv(b.qpn, recv(20, &[b.buf.sge(0, 64)]));
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run(T0);
    let got = t.b.env.poll(b.cq);
    assert_eq!(got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), vec![(20, WcStatus::Success)]);
    assert_eq!(
        t.b.env.hca.ack_timer(b.qpn),
        Some(T0 + Duration::from_micros(10)),
        "{end:?}: the ACK is held"
    );
    match end {
        Teardown::Destroy => t.b.env.hca.destroy_qp(C1, b.qpn, &mut t.b.env.io).unwrap(),
        Teardown::Reset => {
            t.b.env
                .modify(b.qpn, &QpAttr { qp_state: QpState::Reset, ..QpAttr::default() }, QpAttrMask::STATE)
                .unwrap();
        }
        Teardown::Error => {
            t.b.env
                .modify(b.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
                .unwrap();
        }
    }
    // Past the transport timer's every retry: the send succeeded, once.
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    t.advance(T0, tick + Duration::from_nanos(1), u32::from(conn().retry_cnt) + 2);
    assert_eq!(
        t.a.env.poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success)],
        "{end:?}"
    );
}

#[test]
fn a_receive_taken_from_an_srq_for_a_message_cut_short_goes_back_to_the_srq() {
    // Cut short by the QP's error, or by a reset straight from RTS.
    for cut in [QpState::Reset, QpState::Err] {
        srq_receive_of_a_message_cut_short(cut);
    }
}

fn srq_receive_of_a_message_cut_short(cut: QpState) {
    let mut t = TwoHosts::new(256);
    let pd = t.b.env.hca.alloc_pd(C1).unwrap();
    let (cq, _) = t.b.env.hca.create_cq(C1, 64).unwrap();
    let (srq, _) = t.b.env.hca.create_srq(C1, pd, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 }).unwrap();
    let buf = t.b.env.mr(C1, pd, 4096, FULL);
    let on_srq = |env: &mut Env| env.qp(C1, pd, qp_init(cq, cq, Some(srq)));
    let (b1, b2) = (on_srq(&mut t.b.env), on_srq(&mut t.b.env));
    let (a1, a2) = (t.a.env.end(C1), t.a.env.end(C1));
    t.connect(a1.qpn, b1, conn());
    t.connect(a2.qpn, b2, conn());
    t.b.env.io.post_srq(srq, recv(50, &[buf.sge(0, 1024)]));
    // A 700-byte send: its first chunk claims the SRQ's receive for b1...
    t.a.env.io.post_send(a1.qpn, wr(1, SendOpcode::Send, &[a1.buf.sge(0, 700)], SendFlags::SIGNALED));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    // ...then b1 fails (or is reset) before the rest arrives.
    t.b.env.modify(b1, &QpAttr { qp_state: cut, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
    t.b.env.run(T0);
    // The receive was not lost: b2's message finds it in the SRQ.
    t.a.env.io.post_send(a2.qpn, wr(2, SendOpcode::Send, &[a2.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run(T0);
    let got: Vec<(u64, WcStatus, u32)> =
        t.b.env.poll(cq).iter().map(|c| (c.wr_id, c.status, c.qp_num)).collect();
    assert!(got.contains(&(50, WcStatus::Success, b2)), "{cut:?}: {got:?}");
    assert_eq!(
        t.a.env.poll(a2.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(2, WcStatus::Success)]
    );
}

#[test]
fn a_region_deregistered_mid_send_ends_the_request_in_loc_prot_err() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 700)], b.buf.addr, b.buf.key));
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    // The first chunk leaves; then the source region goes away.
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    t.a.env.hca.dereg_mr(C1, a.buf.key).unwrap();
    t.run(T0);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::LocProtErr, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, a.qpn, 0)
        ]
    );
    assert_eq!(t.a.env.io.state(a.qpn), Some(QpState::Err));
}

#[test]
fn a_read_response_whose_read_was_flushed_mid_payload_completes_nothing_later() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    b.buf.write(0, &[7; 8]);
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log), "the read request crosses");
    for _ in 0..100 {
        t.b.env.step(T0);
    }
    // The response's header reaches A, whose payload is still on its way...
    let resp = t.b.env.hca.poll_transmit(t.b.link, T0, &mut t.b.env.io).expect("B answers");
    let d = data_header(&resp);
    assert!(matches!(t.a.env.hca.handle_data(t.a.link, &d, T0, &mut t.a.env.io), Sink::Place(_)));
    // ...when the application resets the QP, connects it again and posts
    // another read.
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    assert_eq!(t.a.env.modify(a.qpn, &attr, QpAttrMask::STATE), Ok(QpState::Reset));
    // B expects PSN 101 next: the new connection starts there.
    t.a.env.bring_to_init(a.qpn, conn());
    let ah = gid_ah(IP_B, 1);
    t.a.env.bring_to_rtr_via(a.qpn, b.qpn, conn(), ah, 100, 4);
    t.a.env.bring_to_rts_via(a.qpn, conn(), 101, 4);
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaRead, &[a.buf.sge(64, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    let request = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("the new read leaves");
    // The old payload lands: it answers the old read, not the new one.
    t.a.env.hca.data_placed(t.a.link, T0, &mut t.a.env.io);
    t.run_a_only(T0);
    assert!(t.a.env.poll(a.cq).is_empty(), "a response for a read that is gone completed the new one");
    // The new read is answered as usual.
    TwoHosts::deliver(&request, &mut t.b, T0, '>', &mut t.log);
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::RdmaRead, a.qpn, 8)]);
    assert_eq!(a.buf.read(64, 8), vec![7; 8]);
}

/// Takes A's next frame and hands B its header; the payload is "on its
/// way" until the test says it is placed or lost.
fn header_reaches_b(t: &mut TwoHosts) -> Sink {
    let f = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("A sends");
    t.b.env.hca.handle_data(t.b.link, &data_header(&f), T0, &mut t.b.env.io)
}

#[test]
fn a_region_deregistered_while_a_write_into_it_arrives_is_a_remote_access_error() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    let Sink::Place(w) = header_reaches_b(&mut t) else { panic!("B places the write") };
    // The tenant deregisters the target: every window in flight is revoked,
    // and the driver, seeing it, discards the payload and says so.
    t.b.env.hca.dereg_mr(C1, b.buf.key).unwrap();
    assert!(w.iter().all(|s| s.region.is_revoked()));
    t.b.env.hca.data_lost(t.b.link, &mut t.b.env.io);
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(t.b.env.io.state(b.qpn), Some(QpState::Err));
    assert!(t.b.env.io.events.iter().any(|(_, e)| e.event_type == AsyncEventType::QpAccessErr));
}

#[test]
fn a_receive_buffer_deregistered_while_a_send_arrives_fails_the_receive_and_the_send() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.b.env.step(T0);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run_a_only(T0);
    assert!(matches!(header_reaches_b(&mut t), Sink::Place(_)));
    t.b.env.hca.dereg_mr(C1, b.buf.key).unwrap();
    t.b.env.hca.data_lost(t.b.link, &mut t.b.env.io);
    t.run(T0);
    assert_eq!(t.b.env.poll(b.cq), vec![recv_err(10, WcStatus::LocProtErr, b.qpn)]);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::RemOpErr, WcOpcode::Send, a.qpn, 0)]);
}

#[test]
fn a_requester_keeps_its_psns_in_flight_within_the_window() {
    let mut t = TwoHosts::with(256, |c| c.max_psns_in_flight = 64);
    let (a, b) = (t.a.env.end(C1), t.b.env.end(C1));
    t.connect(a.qpn, b.qpn, conn());
    // Eight writes of 16 chunks each: after the third, 48 PSNs are in
    // flight, more than half the window (the most one message may take),
    // so the rest wait for ACKs.
    for i in 0..8 {
        t.a.env
            .io
            .post_send(a.qpn, rdma(i, SendOpcode::RdmaWrite, &[a.buf.sge(0, 4096)], b.buf.addr, b.buf.key));
    }
    t.run_a_only(T0);
    // Frames reach B, whose ACKs are held back.
    let mut sent = 0;
    while TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log) {
        sent += 1;
        assert!(sent <= 1000);
    }
    assert_eq!(sent, 48, "frames sent before any ACK");
    // Once ACKs come, the rest go and all complete.
    t.run(T0);
    let done = t.a.env.poll(a.cq);
    assert_eq!(done.len(), 8, "{done:?}");
    assert!(done.iter().all(|c| c.status == WcStatus::Success), "{done:?}");

    // A message of more PSNs than half the window is too long here.
    t.a.env
        .io
        .post_send(a.qpn, rdma(9, SendOpcode::RdmaWrite, &[a.buf.sge(0, 33 * 256)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(9, WcStatus::LocLenErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

#[test]
fn a_request_taken_before_its_link_is_numbered_at_the_links_chunk_size() {
    let (mut t, a, b) = TwoHosts::new(256).unlinked_pair();
    let data: Vec<u8> = (0..1024u32).map(|i| i as u8 ^ 0x5a).collect();
    a.buf.write(0, &data);
    // With no link the first request is taken (its timer runs), counted
    // at the largest chunk: 1 PSN for 1 KiB.
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 1024)], b.buf.addr, b.buf.key));
    t.a.env
        .io
        .post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr + 4096, b.buf.key));
    t.run_a_only(T0);
    // The link comes, with 256-byte chunks: the first takes 4 PSNs, and
    // the second must not reuse one of them (it would be taken for a
    // duplicate and "completed" without landing).
    let lid = t.b.env.hca.config().port.lid;
    t.a.link = t.a.env.hca.link_up(LinkInfo { gid: Gid::from_ipv4(IP_B), lid, chunk: 256, verified: true });
    t.run(T0);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)
        ]
    );
    assert_eq!(b.buf.read(0, 1024), data);
    assert_eq!(b.buf.read(4096, 8), data[..8]);

    // One that is too long at the link's chunk size fails once it is known.
    let (mut t, a, b) = TwoHosts::with(256, |c| c.max_psns_in_flight = 64).unlinked_pair();
    t.a.env
        .io
        .post_send(a.qpn, rdma(3, SendOpcode::RdmaWrite, &[a.buf.sge(0, 33 * 256)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    t.a.link = t.a.env.hca.link_up(LinkInfo { gid: Gid::from_ipv4(IP_B), lid, chunk: 256, verified: true });
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(3, WcStatus::LocLenErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

#[test]
fn a_datagram_whose_qp_was_reset_while_it_arrived_completes_nothing() {
    let mut t = TwoHosts::new(1024);
    let (pa, _, qa, bufa) = ud_end(&mut t.a.env);
    let (_, cqb, qb, bufb) = ud_end(&mut t.b.env);
    let ah = gid_ah(IP_B, 64);
    let ahn = t.a.env.hca.create_ah(C1, pa, ah).unwrap();
    let mut w = wr(1, SendOpcode::Send, &[bufa.sge(0, 8)], SendFlags::empty());
    w.ud = crate::ring::UdDest { remote_qpn: qb, remote_qkey: 0x1111, ah: ahn };
    t.b.env.io.post_recv(qb, recv(10, &[bufb.sge(0, 100)]));
    t.b.env.step(T0);
    t.a.env.io.post_send(qa, w.clone());
    t.run_a_only(T0);
    assert!(matches!(header_reaches_b(&mut t), Sink::Place(_)), "receive 10 taken");
    // Reset, up again, a new receive; then the old payload ends.
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    assert_eq!(t.b.env.modify(qb, &attr, QpAttrMask::STATE), Ok(QpState::Reset));
    ud_up(&mut t.b.env, qb);
    t.b.env.io.post_recv(qb, recv(20, &[bufb.sge(0, 100)]));
    t.b.env.hca.data_placed(t.b.link, T0, &mut t.b.env.io);
    assert!(t.b.env.poll(cqb).is_empty(), "a receive of the QP before its reset completed after it");
    // The next datagram takes the new receive.
    t.a.env.io.post_send(qa, w);
    t.run(T0);
    let got = t.b.env.poll(cqb);
    assert_eq!(got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), vec![(20, WcStatus::Success)]);
}

#[test]
fn closing_a_context_breaks_no_qp_connected_to_another_host_with_the_same_number() {
    let mut t = TwoHosts::new(256);
    // B's QP gets the number that a QP of another context on A will have.
    let _b0 = t.b.env.end(C2);
    let b = t.b.env.end(C1);
    let a = t.a.env.end(C1);
    t.connect(a.qpn, b.qpn, conn());
    let x = t.a.env.end(C2);
    assert_eq!(x.qpn, b.qpn, "the test needs the numbers to meet");
    t.a.env.hca.close_context(C2, &mut t.a.env.io);
    assert_eq!(
        t.a.env.io.state(a.qpn),
        Some(QpState::Rts),
        "a QP on another host was taken for a local peer"
    );
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

/// After an RNR NAK the transport timer runs again from the end of the
/// RNR delay, so a link lost meanwhile still ends the WR (it hung).
#[test]
fn an_rnr_nak_then_a_lost_link_still_ends_by_the_transport_timer() {
    let (mut t, a, _b) = TwoHosts::pair(256, conn());
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    // B has no receive posted: RNR NAK.
    t.run(T0);
    assert!(t.log.iter().any(|(d, op, _)| *d == '<' && *op == crate::wire::Opcode::Acknowledge));
    assert!(t.a.env.poll(a.cq).is_empty());
    // The link goes down before the RNR delay is over.
    t.a.env.hca.link_down(t.a.link);
    t.b.env.hca.link_down(t.b.link);
    // Far more than (retry_cnt + 1) transport timeouts and rnr_retry RNR delays.
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    t.advance_a_only(T0, tick + timers::rnr_delay(1) + Duration::from_micros(1), 20);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::Send, a.qpn, 0)],
        "the send neither completed nor failed: QP {:?}",
        t.a.env.io.state(a.qpn)
    );
}

/// A request that reaches the responder before its QP is in RTR is
/// dropped, as IB drops it; the requester's transport timer sends it
/// again, and it is delivered once the peer is in RTR, as on one host.
#[test]
fn a_request_sent_before_the_peer_is_in_rtr_is_sent_again_and_delivered() {
    let mut t = TwoHosts::new(256);
    let a = t.a.env.end(C1);
    let b = t.b.env.end(C1);
    // A is connected first and posts at once; B is still in RESET.
    connect_side(&mut t.a.env, a.qpn, b.qpn, IP_B, conn());
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    t.run(T0);
    // B reaches RTS a moment later, well inside A's timeout * (retry_cnt+1).
    connect_side(&mut t.b.env, b.qpn, a.qpn, IP_A, conn());
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    t.advance(T0, tick + Duration::from_nanos(1), 4);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

/// A responder QP that goes to ERR while the payload of a send arrives
/// flushes the receive the send had claimed; the message is then never
/// acknowledged, so the sender ends in RETRY_EXC_ERR, never SUCCESS.
#[test]
fn a_send_whose_receiver_failed_mid_payload_never_completes_successfully() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.b.env.step(T0);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run_a_only(T0);
    assert!(matches!(header_reaches_b(&mut t), Sink::Place(_)), "receive 10 claimed");
    // The application moves B's QP to ERR while the payload is on its way;
    // the engine flushes it.
    t.b.env
        .modify(b.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
        .unwrap();
    t.b.env.run(T0);
    let b_done = t.b.env.poll(b.cq);
    assert_eq!(b_done, vec![recv_err(10, WcStatus::WrFlushErr, b.qpn)]);
    // The payload ends.
    t.b.env.hca.data_placed(t.b.link, T0, &mut t.b.env.io);
    t.run(T0);
    // The first try and the retry go unanswered (B's QP drops them).
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    t.advance(T0, tick + Duration::from_nanos(1), u32::from(conn().retry_cnt) + 1);
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::Send, a.qpn, 0)],
        "the receiver flushed its receive: {b_done:?}"
    );
}

/// The transport timer runs from the last frame sent: a message that
/// takes longer to send than timeout * (retry_cnt + 1) (here 16 MiB at
/// 1 GB/s, 16 ms, against 4.2 ms * 3) completes on a healthy link.
#[test]
fn a_large_write_on_a_healthy_link_does_not_time_out() {
    let c = Conn { timeout: 10, retry_cnt: 2, ..conn() };
    let mut t = TwoHosts::new(64 << 10);
    let a = t.a.env.end(C1);
    let b = t.b.env.end(C1);
    t.connect(a.qpn, b.qpn, c);
    const LEN: usize = 16 << 20;
    let src = t.a.env.mr(C1, a.pd, LEN, FULL);
    let dst = t.b.env.mr(C1, b.pd, LEN, FULL);
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[src.sge(0, LEN as u32)], dst.addr, dst.key));
    // The link carries 64 KiB every 64 us (1 GB/s); every frame is
    // delivered and answered as soon as it is on the wire.
    let mut now = T0;
    for _ in 0..2000 {
        t.a.env.step(now);
        TwoHosts::carry(&mut t.a, &mut t.b, now, '>', &mut t.log);
        t.b.env.step(now);
        while TwoHosts::carry(&mut t.b, &mut t.a, now, '<', &mut t.log) {}
        now = now + Duration::from_micros(64);
    }
    t.run(now);
    let frames = t.log.iter().filter(|(d, _, _)| *d == '>').count();
    assert_eq!(
        t.a.env.poll(a.cq),
        vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)],
        "{frames} of 256 frames went out before the timer fired"
    );
}

/// A duplicate read is answered again from memory and a duplicate atomic
/// from the result the original returned, without applying it twice.
#[test]
fn a_duplicate_atomic_and_read_are_answered_again_and_the_atomic_applied_once() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    b.buf.write(0, &10u64.to_le_bytes());
    b.buf.write(64, &[9; 8]);
    let mut faa = rdma(1, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key);
    faa.compare_add = 5;
    t.a.env.io.post_send(a.qpn, faa);
    t.a.env
        .io
        .post_send(a.qpn, rdma(2, SendOpcode::RdmaRead, &[a.buf.sge(64, 8)], b.buf.addr + 64, b.buf.key));
    t.run_a_only(T0);
    let atomic = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("the atomic");
    let read = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("the read");
    for f in [&atomic, &read] {
        TwoHosts::deliver(f, &mut t.b, T0, '>', &mut t.log);
    }
    // The same two frames again, as a requester's retransmission.
    for f in [&atomic, &read] {
        TwoHosts::deliver(f, &mut t.b, T0, '>', &mut t.log);
    }
    t.b.env.run(T0);
    let mut answers = Vec::new();
    while let Some(f) = t.b.env.hca.poll_transmit(t.b.link, T0, &mut t.b.env.io) {
        let d = data_header(&f);
        answers.push((d.opcode, d.psn, d.atomic_ack));
    }
    assert_eq!(b.buf.u64_at(0), 15, "the atomic was applied once");
    use crate::wire::Opcode::*;
    assert_eq!(
        answers,
        vec![
            (AtomicAcknowledge, 100, Some(10)),
            (ReadResponseOnly, 101, None),
            (AtomicAcknowledge, 100, Some(10)),
            (ReadResponseOnly, 101, None),
        ],
        "the duplicates were not answered"
    );
}

/// The single-host counterpart of
/// `a_request_sent_before_the_peer_is_in_rtr_is_sent_again_and_delivered`.
#[test]
fn on_one_host_a_request_sent_before_the_peer_is_in_rtr_is_delivered() {
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    env.connect_with(a.qpn, b.qpn, conn());
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    env.run(T0);
    env.connect_with(b.qpn, a.qpn, conn());
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let mut now = T0;
    for _ in 0..4 {
        now = now + tick + Duration::from_nanos(1);
        env.run(now);
    }
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

/// A read whose answer is slow is sent again on the transport timer; the
/// answers of both tries arrive, and the read completes once, with the
/// responder's bytes, each byte placed from the first answer that has it.
#[test]
fn a_read_sent_again_mid_answer_completes_once_with_its_bytes() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
    b.buf.write(0, &pattern);
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 1024)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log), "the read request crosses");
    for _ in 0..10 {
        t.b.env.step(T0);
    }
    // Two of the four answer chunks arrive; then the link stalls.
    for _ in 0..2 {
        assert!(TwoHosts::carry(&mut t.b, &mut t.a, T0, '<', &mut t.log));
    }
    t.flowing = false;
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let now = T0 + tick + Duration::from_nanos(1);
    t.run(now);
    assert!(t.a.env.poll(a.cq).is_empty());
    t.flowing = true;
    t.run(now);
    let requests = t.log.iter().filter(|(d, op, _)| *d == '>' && *op == crate::wire::Opcode::ReadRequest);
    assert_eq!(requests.count(), 2, "sent again once");
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaRead, a.qpn, 1024)]);
    assert_eq!(a.buf.read(0, 1024), pattern);
    // Later answers of the second try complete nothing.
    t.run(now + tick * 3);
    assert!(t.a.env.poll(a.cq).is_empty());
}

/// A send whose ACK is late is sent again; the responder acknowledges the
/// duplicate without taking a second receive.
#[test]
fn a_send_sent_again_is_received_once() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.b.env.io.post_recv(b.qpn, recv(11, &[b.buf.sge(8, 8)]));
    t.b.env.step(T0);
    a.buf.write(0, &[5; 8]);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log), "the send crosses");
    // B completes it, but its ACK waits on a stalled link past A's timer.
    t.flowing = false;
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let now = T0 + tick + Duration::from_nanos(1);
    t.run(now);
    t.flowing = true;
    t.run(now);
    let sends = t.log.iter().filter(|(d, op, _)| *d == '>' && *op == crate::wire::Opcode::SendOnly);
    assert_eq!(sends.count(), 2, "sent again once");
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    let got =
        |env: &mut Env| env.poll(b.cq).iter().map(|c| (c.wr_id, c.status, c.byte_len)).collect::<Vec<_>>();
    assert_eq!(got(&mut t.b.env), vec![(10, WcStatus::Success, 8)]);
    assert_eq!(b.buf.read(0, 8), vec![5; 8]);
    // The second receive is still there for the next message.
    t.a.env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run(now);
    assert_eq!(got(&mut t.b.env), vec![(11, WcStatus::Success, 8)]);
}

/// A tenant a daemon named for itself (a uid in another network namespace
/// than the daemon's) exists on one host only, and its number may name
/// another tenant elsewhere: its RC QPs cannot connect to another host, its
/// datagrams never leave, and a frame carrying such a number is dropped.
#[test]
fn a_tenant_of_one_host_only_never_reaches_another_host() {
    let mut t = TwoHosts::new(1024);
    let local = TenantId(TenantId::HOST_LOCAL_BASE + 1);
    let c4 = ContextId(4);
    t.a.env.hca.open_context(c4, local).unwrap();
    t.b.env.hca.open_context(c4, local).unwrap();
    let ah = gid_ah(IP_B, 1);
    // RC: refused at RTR, with a clear error.
    let x = t.a.env.end(c4);
    t.a.env.bring_to_init(x.qpn, conn());
    let (attr, mask) = to_rtr(0x11, conn(), ah, 0, 1);
    let e = t.a.env.modify(x.qpn, &attr, mask).unwrap_err();
    assert!(e.to_string().contains("this host only"), "{e}");
    assert_eq!(t.a.env.io.state(x.qpn), Some(QpState::Init), "still in INIT");

    // UD: a datagram to the other host completes (UD) but never leaves.
    let (pa, cqa, qa, bufa) = ud_end_in(&mut t.a.env, c4);
    let (_pb, cqb, qb, bufb) = ud_end_in(&mut t.b.env, c4);
    let ahn = t.a.env.hca.create_ah(c4, pa, ah).unwrap();
    let mut w = wr(1, SendOpcode::Send, &[bufa.sge(0, 8)], SendFlags::SIGNALED);
    w.ud = crate::ring::UdDest { remote_qpn: qb, remote_qkey: 0x1111, ah: ahn };
    t.b.env.io.post_recv(qb, recv(20, &[bufb.sge(0, 100)]));
    t.a.env.io.post_send(qa, w);
    t.run(T0);
    assert_eq!(
        t.a.env.poll(cqa).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success)]
    );
    assert!(t.log.is_empty(), "a frame crossed: {:?}", t.log);
    assert!(t.b.env.poll(cqb).is_empty());

    // A frame carrying the host-local number (a buggy or hostile peer
    // daemon) is dropped, though a QP of that number's tenant here would
    // take it.
    let (pu, _, qu, bufu) = ud_end(&mut t.a.env);
    let ahu = t.a.env.hca.create_ah(C1, pu, ah).unwrap();
    let mut w = wr(2, SendOpcode::Send, &[bufu.sge(0, 8)], SendFlags::SIGNALED);
    w.ud = crate::ring::UdDest { remote_qpn: qb, remote_qkey: 0x1111, ah: ahu };
    t.a.env.io.post_send(qu, w);
    t.run_a_only(T0);
    let f = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("A's own tenant's datagram");
    let mut d = data_header(&f);
    d.vnet = local.0;
    assert!(matches!(t.b.env.hca.handle_data(t.b.link, &d, T0, &mut t.b.env.io), Sink::Discard));
    t.b.env.hca.data_placed(t.b.link, T0, &mut t.b.env.io);
    t.b.env.run(T0);
    assert!(t.b.env.poll(cqb).is_empty(), "a frame with a host-local tenant number was taken");
}

/// A's timer fires (B's answers are late), and B's answers arrive before
/// A has sent its oldest request again (its link is still full, or the
/// request is long): send 1 was delivered and acknowledged, write 2 was
/// refused with a NAK. A must complete 1 SUCCESS and 2 REM_ACCESS_ERR.
#[test]
fn answers_that_arrive_after_the_timer_fired_still_count() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.b.env.step(T0);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    // A bad rkey: B refuses it.
    t.a.env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, 0xdead));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    t.b.env.run(T0);
    assert_eq!(
        t.b.env.poll(b.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>()[0],
        (10, WcStatus::Success)
    );
    // A's timer expires before B's answers come.
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let now = T0 + tick + Duration::from_nanos(1);
    t.run_a_only(now);
    // B's answers (ACK for 1, NAK for 2) arrive before A sends again.
    while TwoHosts::carry(&mut t.b, &mut t.a, now, '<', &mut t.log) {}
    t.run(now);
    assert_eq!(
        t.a.env.poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr)],
        "B received send 1 (receive 10 SUCCESS)"
    );
}

/// Same, with an RNR NAK for the second send: A must not fail the QP.
#[test]
fn an_rnr_nak_that_arrives_after_the_timer_fired_does_not_fail_the_qp() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    t.b.env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 8)]));
    t.b.env.step(T0);
    t.a.env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.a.env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log));
    t.b.env.run(T0);
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let now = T0 + tick + Duration::from_nanos(1);
    t.run_a_only(now);
    while TwoHosts::carry(&mut t.b, &mut t.a, now, '<', &mut t.log) {}
    // B posts the receive send 2 needs; A sends again after the RNR delay.
    t.b.env.io.post_recv(b.qpn, recv(11, &[b.buf.sge(8, 8)]));
    t.advance(now, timers::rnr_delay(1) + Duration::from_nanos(1), 4);
    assert_eq!(
        t.a.env.poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

/// A's timer fires while B's answer to a 4-chunk read is on its way; its
/// first chunk arrives before A has sent the read again (the read still
/// counts as sent), the rest after: the read completes once, with B's bytes.
#[test]
fn a_read_answer_chunk_that_arrives_after_the_timer_fired_is_placed() {
    let (mut t, a, b) = TwoHosts::pair(256, conn());
    let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
    b.buf.write(0, &pattern);
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 1024)], b.buf.addr, b.buf.key));
    t.run_a_only(T0);
    assert!(TwoHosts::carry(&mut t.a, &mut t.b, T0, '>', &mut t.log), "the read request crosses");
    t.b.env.run(T0);
    let tick = timers::ack_timeout(conn().timeout).unwrap();
    let now = T0 + tick + Duration::from_nanos(1);
    t.run_a_only(now);
    // The first answer chunk arrives before A sends the read again.
    assert!(TwoHosts::carry(&mut t.b, &mut t.a, now, '<', &mut t.log));
    t.run(now);
    assert_eq!(t.a.env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaRead, a.qpn, 1024)]);
    assert_eq!(a.buf.read(0, 1024), pattern);
}

/// b1 (on an SRQ) is reset, or fails, while the payload of a send that
/// claimed the SRQ's receive is still arriving (the link reads it over
/// several passes). The receive goes back to the SRQ at once, so the rest
/// of that payload must not land in it: the core tells the driver to throw
/// it away (`placement_cancelled`), and b2's message, which takes the
/// receive next, is what the buffer holds.
#[test]
fn an_srq_receive_given_back_mid_payload_is_not_written_by_the_rest_of_it() {
    for cut in [QpState::Reset, QpState::Err] {
        let mut t = TwoHosts::new(256);
        let pd = t.b.env.hca.alloc_pd(C1).unwrap();
        let (cq, _) = t.b.env.hca.create_cq(C1, 64).unwrap();
        let (srq, _) =
            t.b.env.hca.create_srq(C1, pd, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 }).unwrap();
        let buf = t.b.env.mr(C1, pd, 4096, FULL);
        let on_srq = |env: &mut Env| env.qp(C1, pd, qp_init(cq, cq, Some(srq)));
        let (b1, b2) = (on_srq(&mut t.b.env), on_srq(&mut t.b.env));
        let (a1, a2) = (t.a.env.end(C1), t.a.env.end(C1));
        t.connect(a1.qpn, b1, conn());
        t.connect(a2.qpn, b2, conn());
        t.b.env.io.post_srq(srq, recv(50, &[buf.sge(0, 1024)]));
        a1.buf.write(0, &[0xaa; 256]);
        a2.buf.write(0, &[0x55; 8]);
        t.a.env.io.post_send(a1.qpn, wr(1, SendOpcode::Send, &[a1.buf.sge(0, 256)], SendFlags::SIGNALED));
        t.run_a_only(T0);
        // The header of a1's frame: B hands the link the receive's buffer.
        let f = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("A sends");
        let Sink::Place(w) = t.b.env.hca.handle_data(t.b.link, &data_header(&f), T0, &mut t.b.env.io) else {
            panic!("placed")
        };
        assert!(!t.b.env.hca.placement_cancelled(t.b.link));
        // The payload is on its way; b1 is reset (or fails).
        t.b.env.modify(b1, &QpAttr { qp_state: cut, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
        t.b.env.run(T0);
        // The rest of a1's payload arrives: the driver, told to, drops it.
        assert!(t.b.env.hca.placement_cancelled(t.b.link), "{cut:?}: the payload in flight is still placed");
        let bytes = frame_bytes(&f);
        let payload = &bytes[bytes.len() - 256..];
        let mut at = 0;
        for s in &w {
            if !s.region.is_revoked() && !t.b.env.hca.placement_cancelled(t.b.link) {
                s.region.write(s.off, &payload[at..at + s.len]).unwrap();
            }
            at += s.len;
        }
        t.b.env.hca.data_placed(t.b.link, T0, &mut t.b.env.io);
        assert!(!t.b.env.hca.placement_cancelled(t.b.link), "cleared at the frame's end");
        // b2's message takes the receive from the SRQ and completes.
        t.a.env.io.post_send(a2.qpn, wr(2, SendOpcode::Send, &[a2.buf.sge(0, 8)], SendFlags::SIGNALED));
        t.run_a_only(T0);
        let f2 = t.a.env.hca.poll_transmit(t.a.link, T0, &mut t.a.env.io).expect("A sends a2's frame");
        assert_eq!(data_header(&f2).src_qpn, a2.qpn);
        TwoHosts::deliver(&f2, &mut t.b, T0, '>', &mut t.log);
        let got: Vec<(u64, WcStatus, u32)> =
            t.b.env.poll(cq).iter().map(|c| (c.wr_id, c.status, c.qp_num)).collect();
        assert!(got.contains(&(50, WcStatus::Success, b2)), "{cut:?}: {got:?}");
        assert_eq!(buf.read(0, 256), [vec![0x55; 8], vec![0; 248]].concat(), "{cut:?}: a1's bytes landed");
    }
}

/// The log lines of `f`, at info level and above.
fn traced(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let out = lines.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || out.clone())
        .finish();
    tracing::subscriber::with_default(sub, || {
        // Other tests' threads may have met the callsites first, while no
        // subscriber wanted them, and cached that: ask again with ours.
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let b = lines.0.lock().unwrap().clone();
    String::from_utf8(b).unwrap()
}

#[test]
fn the_path_a_qp_takes_is_traced_when_it_connects() {
    let mut qpns = (0, 0, 0);
    let log = traced(|| {
        let mut t = TwoHosts::new(1024);
        let (a, b) = (t.a.env.end(C1), t.b.env.end(C1));
        t.connect(a.qpn, b.qpn, conn());
        let (l1, l2) = (t.a.env.end(C1), t.a.env.end(C1));
        t.a.env.connect(l1.qpn, l2.qpn);
        t.a.env.connect(l2.qpn, l1.qpn);
        qpns = (a.qpn, b.qpn, l1.qpn);
    });
    let line = |qpn: u32| {
        let key = format!("qpn={qpn} ");
        log.lines()
            .find(|l| l.contains("QP connected") && l.contains(&key))
            .unwrap_or_else(|| panic!("no line with {key}:\n{log}"))
    };
    let (a, b, local) = qpns;
    for qpn in [a, b] {
        assert!(line(qpn).contains("path=Link(Some(LinkId("), "{}", line(qpn));
    }
    assert!(line(local).contains("path=SharedMemory"), "{}", line(local));
}

/// Idle QPs on a link cost neither the engine's passes nor the link's:
/// after a message each, every QP is left out of both; one message later
/// only its two QPs were looked at, and they are left out again.
#[test]
fn idle_qps_across_hosts_are_left_out_of_passes_and_links() {
    let mut t = TwoHosts::new(1024);
    let pairs: Vec<(End, End)> = (0..64)
        .map(|_| {
            let (a, b) = (t.a.env.end(C1), t.b.env.end(C1));
            t.connect(a.qpn, b.qpn, conn());
            (a, b)
        })
        .collect();
    let exchange = |t: &mut TwoHosts, (a, b): &(End, End), id: u64| {
        t.b.env.io.post_recv(b.qpn, recv(id, &[b.buf.sge(0, 8)]));
        t.a.env.io.post_send(a.qpn, wr(id, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    };
    for (i, p) in pairs.iter().enumerate() {
        exchange(&mut t, p, i as u64);
    }
    t.run(T0);
    for (a, b) in &pairs {
        assert_eq!(t.a.env.poll(a.cq).len(), 1);
        assert_eq!(t.b.env.poll(b.cq).len(), 1);
    }
    let awake = |h: &Host| -> usize {
        h.env.hca.net.links[&h.link].tenants.iter().map(|t| t.awake.len()).sum::<usize>()
    };
    for h in [&t.a, &t.b] {
        assert_eq!(h.env.hca.served_qps(), &[] as &[u32]);
        assert_eq!(awake(h), 0);
        assert_eq!(h.env.hca.links()[0].qps, 64, "still bound to the link");
    }
    t.a.env.io.parked.clear();
    t.b.env.io.parked.clear();
    let (a, b) = &pairs[17];
    exchange(&mut t, &pairs[17], 100);
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq).len(), 1);
    assert_eq!(t.b.env.poll(b.cq).len(), 1);
    assert!(t.a.env.io.parked.iter().all(|&q| q == a.qpn), "{:?}", t.a.env.io.parked);
    assert!(t.b.env.io.parked.iter().all(|&q| q == b.qpn), "{:?}", t.b.env.io.parked);
    assert_eq!((awake(&t.a), awake(&t.b)), (0, 0));
    // A link that goes down reaches its idle QPs all the same: the next
    // request of one fails by its timer rather than waiting for ever.
    t.a.env.hca.link_down(t.a.link);
    let (a, _) = &pairs[3];
    t.a.env.io.post_send(a.qpn, wr(7, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    let mut now = T0;
    for _ in 0..200 {
        now = now + Duration::from_millis(50);
        t.run_a_only(now);
        if !t.a.env.io.cqs.get(&a.cq).is_none_or(|v| v.is_empty()) {
            break;
        }
    }
    let got = t.a.env.poll(a.cq);
    assert_eq!(got.first().map(|c| (c.wr_id, c.status)), Some((7, WcStatus::RetryExcErr)), "{got:?}");
}

/// A tenant that posts without naming its QPs (it may write its rings
/// directly) makes each sweep find a missed wake-up on every QP it posted
/// to: counted each time, but not one warning each, or the tenant fills
/// the daemon's log at will (ten sweeps a second).
#[test]
fn missed_wake_ups_are_counted_not_each_logged() {
    let mut env = host(IP_A);
    let ends: Vec<End> = (0..64).map(|_| env.end(C1)).collect();
    for e in &ends {
        env.connect(e.qpn, e.qpn);
    }
    env.run(T0);
    let log = traced(|| {
        for e in &ends {
            env.io.post_recv(e.qpn, recv(1, &[e.buf.sge(0, 8)]));
            env.io.post_send(e.qpn, wr(2, SendOpcode::Send, &[e.buf.sge(8, 8)], SendFlags::SIGNALED));
        }
        env.io.posted.clear();
        env.hca.sweep();
        env.run(T0);
    });
    assert_eq!(env.hca.missed_wakeups(), 64);
    let warned = log.lines().filter(|l| l.contains("WARN") && l.contains("wake-up was missed")).count();
    assert!(warned <= 7, "{warned} warnings for 64 missed wake-ups");
}

/// Requests that start coming in on another link to the same host (both
/// daemons dialled each other) move the responder there: the old link
/// lists it no more.
#[test]
fn a_responder_whose_requests_move_to_another_link_leaves_the_old_one() {
    // b only receives (RTR): it sends nothing, so no link of its own.
    let mut t = TwoHosts::new(1024);
    let (a, b) = (t.a.env.end(C1), t.b.env.end(C1));
    connect_side(&mut t.a.env, a.qpn, b.qpn, IP_B, conn());
    t.b.env.bring_to_init(b.qpn, conn());
    let ah = gid_ah(IP_A, 1);
    t.b.env.bring_to_rtr_via(b.qpn, a.qpn, conn(), ah, 100, 4);
    let exchange = |t: &mut TwoHosts, id: u64| {
        t.b.env.io.post_recv(b.qpn, recv(id, &[b.buf.sge(0, 8)]));
        t.a.env.io.post_send(a.qpn, wr(id, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
        t.run(T0);
        assert_eq!(t.a.env.poll(a.cq).len(), 1);
        assert_eq!(t.b.env.poll(b.cq).len(), 1);
    };
    exchange(&mut t, 1);
    let old = t.b.link;
    let info = LinkInfo {
        gid: Gid::from_ipv4(IP_A),
        lid: t.a.env.hca.config().port.lid,
        chunk: 1024,
        verified: true,
    };
    t.b.link = t.b.env.hca.link_up(info);
    exchange(&mut t, 2);
    let qps_on = |h: &Host, link: LinkId| h.env.hca.links().iter().find(|l| l.id == link).map(|l| l.qps);
    assert_eq!(qps_on(&t.b, t.b.link), Some(1));
    assert_eq!(qps_on(&t.b, old), Some(0), "the old link still lists the responder");
}

mod qos;

/// `vrdma stat`'s links: a tenant sees its own frames and bytes on each
/// link (and its own QPs there), never another tenant's; the operator
/// sees the totals. A tenant's share is freed with its last context.
#[test]
fn a_tenant_sees_only_its_own_traffic_on_a_link_and_the_operator_the_totals() {
    let (mut t, a, b) = TwoHosts::pair(1024, conn());
    let x = t.a.env.end(C3);
    t.a.env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 3000)], b.buf.addr, b.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(a.cq).len(), 1);
    let links = |env: &Env, c, view| env.hca.stat(c, StatCursor::START, view).unwrap().report;
    let total = links(&t.a.env, C1, StatView::Operator);
    let (mine, theirs) = (links(&t.a.env, C1, StatView::Tenant), links(&t.a.env, C3, StatView::Tenant));
    assert!(total.totals && !mine.totals && !theirs.totals);
    let (tl, ml, ol) = (total.links[0], mine.links[0], theirs.links[0]);
    assert_eq!(tl.stats, t.a.env.hca.links()[0].stats, "the operator: the link's totals");
    assert_eq!((ml.stats.frames_out, ml.stats.payload_out), (3, 3000), "the writer's three frames");
    assert!(ml.stats.frames_in >= 1, "and the ACK it got: {ml:?}");
    assert_eq!((ml.stats.frames_out, ml.stats.frames_in), (tl.stats.frames_out, tl.stats.frames_in));
    assert_eq!(ml.qps, 1);
    // The other tenant: the link (peer, state), none of the traffic.
    assert_eq!((ol.id, ol.info, ol.up), (tl.id, tl.info, tl.up));
    assert_eq!(ol.stats, LinkStats::default(), "{ol:?}");
    assert_eq!(ol.qps, 0);
    // B's side: the bytes came in for the writer's tenant only.
    let bl = |c| links(&t.b.env, c, StatView::Tenant).links[0].stats;
    assert_eq!(bl(C1).payload_in, 3000);
    assert_eq!(bl(C3), LinkStats::default());
    // The other tenant's traffic is its own, and the totals grow by it.
    let y = t.b.env.end(C3);
    t.connect(x.qpn, y.qpn, conn());
    t.a.env.io.post_send(x.qpn, rdma(2, SendOpcode::RdmaWrite, &[x.buf.sge(0, 100)], y.buf.addr, y.buf.key));
    t.run(T0);
    assert_eq!(t.a.env.poll(x.cq).len(), 1);
    assert_eq!(links(&t.a.env, C3, StatView::Tenant).links[0].stats.payload_out, 100);
    assert_eq!(links(&t.a.env, C1, StatView::Tenant).links[0].stats.payload_out, 3000);
    assert_eq!(links(&t.a.env, C1, StatView::Operator).links[0].stats.payload_out, 3100);
    // Its last context gone, a tenant's share goes (C1 and C2 are one
    // tenant: closing one keeps it).
    let a_link = t.a.link;
    let shares = |env: &Env| env.hca.net.links[&a_link].traffic.len();
    assert_eq!(shares(&t.a.env), 2);
    t.a.env.hca.close_context(C3, &mut t.a.env.io);
    assert_eq!(shares(&t.a.env), 1);
    t.a.env.hca.close_context(C2, &mut t.a.env.io);
    assert_eq!(shares(&t.a.env), 1);
    t.a.env.hca.close_context(C1, &mut t.a.env.io);
    assert_eq!(shares(&t.a.env), 0);
    assert_eq!(t.a.env.hca.links()[0].stats.payload_out, 3100, "the totals stay");
}

/// A QP takes the host's verified link (its peer's address vouches for
/// its GID) before a newer one whose peer only claims that GID, and an
/// unverified one only while none is verified (review links3 D: a key
/// holder linking in later took over the host's new QPs).
#[test]
fn a_qp_takes_a_hosts_verified_link_before_a_newer_one_that_only_claims_its_gid() {
    let mut env = Env::new();
    let (gid, ah) = (Gid::from_ipv4(IP_B), gid_ah(IP_B, 1));
    let claim = env.hca.link_up(LinkInfo { gid, lid: 2, chunk: 1024, verified: false });
    assert_eq!(env.hca.net.route(&ah), Some(claim), "none verified: the one there is");
    let real = env.hca.link_up(LinkInfo { gid, lid: 2, chunk: 1024, verified: true });
    let later = env.hca.link_up(LinkInfo { gid, lid: 2, chunk: 1024, verified: false });
    assert!(later > real);
    assert_eq!(env.hca.net.route(&ah), Some(real));
    let newer = env.hca.link_up(LinkInfo { gid, lid: 2, chunk: 1024, verified: true });
    assert_eq!(env.hca.net.route(&ah), Some(newer), "the newest verified");
}
