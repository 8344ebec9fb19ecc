//! Deterministic tests of the device logic: objects, the state machine's
//! effects, and what the engine does for every opcode, driven through a
//! `VecDeque`-backed [`Queues`] and explicit time.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::*;
use crate::memory::Region;
use crate::qp::timers;
use crate::ring::{Cqe, RecvWr, SendWr, Sge, SgeList, WqeError};
use crate::time::Instant;
use crate::verbs::{
    AccessFlags, AhAttr, AsyncEventType, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType,
    SendFlags, SendOpcode, SrqAttr, WcFlags, WcOpcode, WcStatus,
};

mod direct;
mod slices;
mod three_hosts;
mod two_hosts;

// ---------------------------------------------------------------- harness

/// The driver's side of the queues, in memory.
#[derive(Default)]
struct FakeQueues {
    send: HashMap<u32, VecDeque<SendWr>>,
    recv: HashMap<u32, VecDeque<RecvWr>>,
    srq: HashMap<u32, VecDeque<RecvWr>>,
    cqs: HashMap<u32, Vec<Cqe>>,
    /// Entries a CQ holds before `push_cqe` reports an overrun.
    cq_cap: HashMap<u32, usize>,
    events: Vec<(ContextId, AsyncEvent)>,
    states: HashMap<u32, QpState>,
    discarded: Vec<u32>,
    /// Send WRs pulled, retired, and send completions pushed, per QP.
    pulled: HashMap<u32, u32>,
    retired: HashMap<u32, u32>,
    send_cqes: HashMap<u32, u32>,
    /// QPs posted to and not yet taken by the core; QPs it left idle.
    posted: Vec<u32>,
    parked: Vec<u32>,
    /// `flush_claimed` calls: the QP, its receive source, whether its
    /// requester was gone.
    claimed_flushes: Vec<(u32, RecvSource, bool)>,
}

impl Queues for FakeQueues {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        let wr = self.send.get_mut(&qpn)?.pop_front()?;
        *self.pulled.entry(qpn).or_default() += 1;
        Some(Ok(wr))
    }
    fn send_retired(&mut self, qpn: u32, count: u32) {
        assert!(count > 0, "QP {qpn}: zero WRs retired");
        let r = self.retired.entry(qpn).or_default();
        *r += count;
        let pulled = self.pulled.get(&qpn).copied().unwrap_or(0);
        assert!(*r <= pulled, "QP {qpn}: {r} send WRs retired, only {pulled} pulled");
    }
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        match src {
            RecvSource::Qp(q) => self.recv.get_mut(&q)?.pop_front().map(Ok),
            RecvSource::Srq(s) => self.srq.get_mut(&s)?.pop_front().map(Ok),
        }
    }
    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        let q = match src {
            RecvSource::Qp(q) => self.recv.get(&q),
            RecvSource::Srq(s) => self.srq.get(&s),
        };
        q.map_or(0, |q| q.len() as u32)
    }
    fn discard(&mut self, qpn: u32) {
        self.send.remove(&qpn);
        self.recv.remove(&qpn);
        self.discarded.push(qpn);
    }
    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull> {
        let v = self.cqs.entry(cqn).or_default();
        if self.cq_cap.get(&cqn).is_some_and(|&cap| v.len() >= cap) {
            return Err(CqFull);
        }
        v.push(*cqe);
        if !matches!(cqe.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
            // A send WR is retired before its completion is seen.
            let q = cqe.qp_num;
            let n = self.send_cqes.entry(q).or_default();
            *n += 1;
            let retired = self.retired.get(&q).copied().unwrap_or(0);
            assert!(*n <= retired, "QP {q}: send completion {n} pushed with {retired} WRs retired");
        }
        Ok(())
    }
    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent) {
        self.events.push((ctx, event));
    }
    fn qp_state_changed(&mut self, qpn: u32, state: QpState) {
        self.states.insert(qpn, state);
    }
    fn take_posted(&mut self, _per_tenant: u32, out: &mut Vec<u32>) -> bool {
        // (The daemon's budget per tenant is tested with its rings.)
        out.append(&mut self.posted);
        false
    }
    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.posted.contains(&qpn)
    }
    fn flush_claimed(&mut self, qpn: u32, rq: RecvSource, requester_gone: bool) -> bool {
        self.claimed_flushes.push((qpn, rq, requester_gone));
        false
    }
    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool {
        self.parked.push(qpn);
        self.send.get(&qpn).is_none_or(|q| q.is_empty())
            && (!recv_too || self.recv.get(&qpn).is_none_or(|q| q.is_empty()))
    }
}

/// The queues of a test, except that the first send pulled from QP `.1`
/// does not decode.
struct Garbled<'a>(&'a mut FakeQueues, u32, bool);

impl Queues for Garbled<'_> {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        if qpn == self.1 && !std::mem::replace(&mut self.2, true) {
            *self.0.pulled.entry(qpn).or_default() += 1;
            return Some(Err((77, WqeError::BadOpcode(99))));
        }
        self.0.pull_send(qpn)
    }
    fn send_retired(&mut self, qpn: u32, count: u32) {
        self.0.send_retired(qpn, count)
    }
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        self.0.pull_recv(src)
    }
    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        self.0.recv_posted(src)
    }
    fn discard(&mut self, qpn: u32) {
        self.0.discard(qpn)
    }
    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull> {
        self.0.push_cqe(cqn, cqe)
    }
    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent) {
        self.0.async_event(ctx, event)
    }
    fn qp_state_changed(&mut self, qpn: u32, state: QpState) {
        self.0.qp_state_changed(qpn, state)
    }
    fn take_posted(&mut self, per_tenant: u32, out: &mut Vec<u32>) -> bool {
        self.0.take_posted(per_tenant, out)
    }
    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.0.named_since_parked(qpn)
    }
    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool {
        // The garbled WR is there to be pulled until it was.
        (qpn != self.1 || self.2) && self.0.park_queues(qpn, recv_too)
    }
}

impl FakeQueues {
    fn post_send(&mut self, qpn: u32, wr: SendWr) {
        self.send.entry(qpn).or_default().push_back(wr);
        self.posted.push(qpn);
    }
    fn post_recv(&mut self, qpn: u32, wr: RecvWr) {
        self.recv.entry(qpn).or_default().push_back(wr);
        // As the client does: a QP it reads ERR of is named.
        if self.states.get(&qpn) == Some(&QpState::Err) {
            self.posted.push(qpn);
        }
    }
    fn post_srq(&mut self, srqn: u32, wr: RecvWr) {
        self.srq.entry(srqn).or_default().push_back(wr);
    }
    /// Takes the completions a CQ holds (polling it).
    fn poll(&mut self, cqn: u32) -> Vec<Cqe> {
        self.cqs.get_mut(&cqn).map(std::mem::take).unwrap_or_default()
    }
    fn state(&self, qpn: u32) -> Option<QpState> {
        self.states.get(&qpn).copied()
    }
    /// (send WRs pulled, retired) of a QP.
    fn retirement(&self, qpn: u32) -> (u32, u32) {
        (self.pulled.get(&qpn).copied().unwrap_or(0), self.retired.get(&qpn).copied().unwrap_or(0))
    }
    /// Send WRs posted and not yet pulled.
    fn send_queued(&self, qpn: u32) -> usize {
        self.send.get(&qpn).map_or(0, |q| q.len())
    }
}

/// Keys 0x100, 0x101, ...: predictable in tests.
struct Counter(u32);

impl KeySource for Counter {
    fn next_key(&mut self) -> u32 {
        self.0 += 1;
        self.0
    }
}

const TENANT: TenantId = TenantId(1000);
const OTHER_TENANT: TenantId = TenantId(2000);
/// Two processes of `TENANT` and one of `OTHER_TENANT`.
const C1: ContextId = ContextId(1);
const C2: ContextId = ContextId(2);
const C3: ContextId = ContextId(3);

const FULL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);
const QP_ACCESS: AccessFlags =
    AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ).union(AccessFlags::REMOTE_ATOMIC);

const T0: Instant = Instant(1_000_000);

fn new_hca() -> Hca {
    Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Counter(0xff)))
}

fn cap() -> QpCap {
    QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 }
}

fn qp_init(send_cq: u32, recv_cq: u32, srq: Option<u32>) -> QpInitAttr {
    QpInitAttr { qp_type: QpType::Rc, send_cq, recv_cq, srq, cap: cap(), sq_sig_all: false }
}

/// Connection parameters a test may change.
#[derive(Debug, Clone, Copy)]
struct Conn {
    rnr_retry: u8,
    min_rnr_timer: u8,
    access: AccessFlags,
    timeout: u8,
    retry_cnt: u8,
}

impl Default for Conn {
    fn default() -> Self {
        Conn { rnr_retry: 2, min_rnr_timer: 1, access: QP_ACCESS, timeout: 1, retry_cnt: 1 }
    }
}

/// A registered memory region and the tenant address it sits at.
#[derive(Clone)]
struct Buf {
    key: u32,
    addr: u64,
    mem: Region,
}

impl Buf {
    fn sge(&self, off: u64, len: u32) -> Sge {
        Sge { addr: self.addr + off, length: len, lkey: self.key }
    }
    fn write(&self, off: usize, bytes: &[u8]) {
        self.mem.write(off, bytes).unwrap();
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read(off, &mut v).unwrap();
        v
    }
    fn u64_at(&self, off: usize) -> u64 {
        u64::from_le_bytes(self.read(off, 8).try_into().unwrap())
    }
}

/// One end of a connection: a PD, one CQ for sends and receives, a QP and a
/// 64 KiB region with every access right.
#[derive(Clone)]
struct End {
    pd: u32,
    cq: u32,
    qpn: u32,
    buf: Buf,
}

struct Env {
    hca: Hca,
    io: FakeQueues,
    next_addr: u64,
    owner: HashMap<u32, ContextId>,
}

impl Env {
    fn new() -> Env {
        let mut hca = new_hca();
        hca.open_context(C1, TENANT).unwrap();
        hca.open_context(C2, TENANT).unwrap();
        hca.open_context(C3, OTHER_TENANT).unwrap();
        Env { hca, io: FakeQueues::default(), next_addr: 0, owner: HashMap::new() }
    }

    fn mr(&mut self, ctx: ContextId, pd: u32, len: usize, access: AccessFlags) -> Buf {
        self.next_addr += 0x10_0000 * (1 + len as u64 / 0x10_0000);
        let mem = Region::heap(len);
        let key = self.hca.reg_mr(ctx, pd, self.next_addr, access, mem.clone()).unwrap();
        Buf { key, addr: self.next_addr, mem }
    }

    fn qp(&mut self, ctx: ContextId, pd: u32, init: QpInitAttr) -> u32 {
        let qpn = self.hca.create_qp(ctx, pd, init).unwrap().qpn;
        self.owner.insert(qpn, ctx);
        qpn
    }

    /// A PD, a CQ, a QP and a region in `ctx`, the QP still in RESET.
    fn end_with(&mut self, ctx: ContextId, sig_all: bool) -> End {
        let pd = self.hca.alloc_pd(ctx).unwrap();
        let (cq, _) = self.hca.create_cq(ctx, 64).unwrap();
        let mut init = qp_init(cq, cq, None);
        init.sq_sig_all = sig_all;
        let qpn = self.qp(ctx, pd, init);
        let buf = self.mr(ctx, pd, 64 << 10, FULL);
        End { pd, cq, qpn, buf }
    }

    fn end(&mut self, ctx: ContextId) -> End {
        self.end_with(ctx, false)
    }

    fn modify(&mut self, qpn: u32, attr: &QpAttr, mask: QpAttrMask) -> Result<QpState, HcaError> {
        let ctx = self.owner[&qpn];
        self.hca.modify_qp(ctx, qpn, attr, mask, &mut self.io)
    }

    fn bring_to_init(&mut self, qpn: u32, c: Conn) {
        let attr =
            QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: c.access, ..QpAttr::default() };
        let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
        assert_eq!(self.modify(qpn, &attr, mask), Ok(QpState::Init));
    }

    fn bring_to_rtr(&mut self, qpn: u32, remote: u32, c: Conn) {
        let ah = AhAttr { dlid: self.hca.config().port.lid, port_num: 1, ..AhAttr::default() };
        self.bring_to_rtr_via(qpn, remote, c, ah, 0, 1);
    }

    /// INIT -> RTR towards `remote` at `ah`, expecting PSN `psn` first.
    fn bring_to_rtr_via(&mut self, qpn: u32, remote: u32, c: Conn, ah: AhAttr, psn: u32, rd_atomic: u8) {
        let (attr, mask) = to_rtr(remote, c, ah, psn, rd_atomic);
        assert_eq!(self.modify(qpn, &attr, mask), Ok(QpState::Rtr));
    }

    fn bring_to_rts(&mut self, qpn: u32, c: Conn) {
        self.bring_to_rts_via(qpn, c, 0, 1);
    }

    /// RTR -> RTS, sending from PSN `psn`.
    fn bring_to_rts_via(&mut self, qpn: u32, c: Conn, psn: u32, rd_atomic: u8) {
        let attr = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: psn,
            timeout: c.timeout,
            retry_cnt: c.retry_cnt,
            rnr_retry: c.rnr_retry,
            max_rd_atomic: rd_atomic,
            ..QpAttr::default()
        };
        let mask = QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC;
        assert_eq!(self.modify(qpn, &attr, mask), Ok(QpState::Rts));
    }

    /// RESET -> INIT -> RTR -> RTS towards `remote`.
    fn connect_with(&mut self, qpn: u32, remote: u32, c: Conn) {
        self.bring_to_init(qpn, c);
        self.bring_to_rtr(qpn, remote, c);
        self.bring_to_rts(qpn, c);
    }

    fn connect(&mut self, qpn: u32, remote: u32) {
        self.connect_with(qpn, remote, Conn::default());
    }

    /// Two ends in two processes of one tenant, connected.
    fn pair_with(c: Conn) -> (Env, End, End) {
        let mut env = Env::new();
        let a = env.end(C1);
        let b = env.end(C2);
        env.connect_with(a.qpn, b.qpn, c);
        env.connect_with(b.qpn, a.qpn, c);
        (env, a, b)
    }

    fn pair() -> (Env, End, End) {
        Env::pair_with(Conn::default())
    }

    /// One engine pass.
    fn step(&mut self, now: Instant) -> Activity {
        self.hca.process(now, &mut self.io)
    }

    /// Engine passes until one finds nothing to do; returns that last pass.
    fn run(&mut self, now: Instant) -> Activity {
        for _ in 0..1000 {
            let act = self.step(now);
            if !act.again() {
                return act;
            }
        }
        panic!("the engine stayed busy for 1000 passes");
    }

    fn poll(&mut self, cqn: u32) -> Vec<Cqe> {
        self.io.poll(cqn)
    }
}

/// INIT -> RTR towards `remote` at `ah`, expecting PSN `psn`.
fn to_rtr(remote: u32, c: Conn, ah: AhAttr, psn: u32, rd_atomic: u8) -> (QpAttr, QpAttrMask) {
    let attr = QpAttr {
        qp_state: QpState::Rtr,
        path_mtu: Mtu::Mtu1024,
        dest_qp_num: remote,
        rq_psn: psn,
        min_rnr_timer: c.min_rnr_timer,
        max_dest_rd_atomic: rd_atomic,
        ah_attr: ah,
        ..QpAttr::default()
    };
    let mask = QpAttrMask::STATE
        | QpAttrMask::AV
        | QpAttrMask::PATH_MTU
        | QpAttrMask::DEST_QPN
        | QpAttrMask::RQ_PSN
        | QpAttrMask::MAX_DEST_RD_ATOMIC
        | QpAttrMask::MIN_RNR_TIMER;
    (attr, mask)
}

fn wr(wr_id: u64, opcode: SendOpcode, sges: &[Sge], flags: SendFlags) -> SendWr {
    let mut w = SendWr::new(wr_id, opcode);
    w.sg = SgeList::from_slice(sges).unwrap();
    w.flags = flags;
    w
}

fn rdma(wr_id: u64, opcode: SendOpcode, sges: &[Sge], remote_addr: u64, rkey: u32) -> SendWr {
    let mut w = wr(wr_id, opcode, sges, SendFlags::SIGNALED);
    w.remote_addr = remote_addr;
    w.rkey = rkey;
    w
}

fn recv(wr_id: u64, sges: &[Sge]) -> RecvWr {
    RecvWr { wr_id, sg: SgeList::from_slice(sges).unwrap() }
}

/// The requester's completion.
fn req_cqe(wr_id: u64, status: WcStatus, opcode: WcOpcode, qpn: u32, byte_len: u32) -> Cqe {
    let mut c = Cqe::new(wr_id, status, opcode, qpn);
    c.byte_len = byte_len;
    c
}

/// A successful receive completion.
fn recv_cqe(env: &Env, wr_id: u64, qpn: u32, src_qp: u32, byte_len: u32) -> Cqe {
    let mut c = Cqe::new(wr_id, WcStatus::Success, WcOpcode::Recv, qpn);
    c.byte_len = byte_len;
    c.src_qp = src_qp;
    c.slid = env.hca.config().port.lid;
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// What a CQ of `depth` entries charges for its ring.
fn cq_ring(depth: u32) -> u64 {
    ring_bytes(depth, crate::ring::CQE_SIZE)
}

fn errno<T: std::fmt::Debug>(r: Result<T, HcaError>) -> i32 {
    r.unwrap_err().errno()
}

// ---------------------------------------------------------------- sends

#[test]
fn send_and_send_with_imm_complete_on_both_sides() {
    let (mut env, a, b) = Env::pair();
    let msg = pattern(100, 7);
    a.buf.write(0, &msg);
    env.io.post_recv(b.qpn, recv(10, &[b.buf.sge(0, 4096)]));
    env.io.post_recv(b.qpn, recv(11, &[b.buf.sge(4096, 4096)]));
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 100)], SendFlags::SIGNALED));
    let mut imm = wr(2, SendOpcode::SendWithImm, &[a.buf.sge(0, 50)], SendFlags::SIGNALED);
    imm.imm_data = 0xdead_beef;
    env.io.post_send(a.qpn, imm);
    let act = env.run(T0);
    assert_eq!(act.next_timer, None);

    assert_eq!(
        env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0),
            req_cqe(2, WcStatus::Success, WcOpcode::Send, a.qpn, 0)
        ]
    );
    let mut with_imm = recv_cqe(&env, 11, b.qpn, a.qpn, 50);
    with_imm.wc_flags = WcFlags::WITH_IMM;
    with_imm.imm_data = 0xdead_beef;
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 10, b.qpn, a.qpn, 100), with_imm]);
    assert_eq!(b.buf.read(0, 100), msg);
    assert_eq!(b.buf.read(4096, 50), msg[..50]);
    assert_eq!(b.buf.read(100, 8), [0; 8], "nothing beyond the message is written");
    assert_eq!(env.io.state(a.qpn), Some(QpState::Rts));
    assert!(env.io.events.is_empty());
}

#[test]
fn unsignaled_sends_complete_only_at_the_responder() {
    let (mut env, a, b) = Env::pair();
    for i in 0..3 {
        env.io.post_recv(b.qpn, recv(20 + i, &[b.buf.sge(0, 64)]));
    }
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.io.post_send(a.qpn, wr(3, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    let got: Vec<u64> = env.poll(b.cq).iter().map(|c| c.wr_id).collect();
    assert_eq!(got, vec![20, 21, 22]);
}

#[test]
fn sq_sig_all_signals_every_send() {
    let mut env = Env::new();
    let a = env.end_with(C1, true);
    let b = env.end(C2);
    env.connect(a.qpn, b.qpn);
    env.connect(b.qpn, a.qpn);
    for i in 0..2 {
        env.io.post_recv(b.qpn, recv(20 + i, &[b.buf.sge(0, 64)]));
        env.io.post_send(a.qpn, wr(i, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    }
    env.run(T0);
    assert_eq!(
        env.poll(a.cq),
        vec![
            req_cqe(0, WcStatus::Success, WcOpcode::Send, a.qpn, 0),
            req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)
        ]
    );
}

#[test]
fn scatter_gather_across_different_split_points() {
    let (mut env, a, b) = Env::pair();
    let msg = pattern(100, 3);
    // Send SGEs of 10, 50 and 40 bytes, scattered in a's region.
    a.buf.write(1000, &msg[..10]);
    a.buf.write(2000, &msg[10..60]);
    a.buf.write(3000, &msg[60..]);
    let sges = [a.buf.sge(1000, 10), a.buf.sge(2000, 50), a.buf.sge(3000, 40)];
    // Receive SGEs of 35 and 65 bytes: splits fall inside both middle pieces.
    env.io.post_recv(b.qpn, recv(5, &[b.buf.sge(500, 35), b.buf.sge(9000, 65)]));
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &sges, SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 5, b.qpn, a.qpn, 100)]);
    assert_eq!(b.buf.read(500, 35), msg[..35]);
    assert_eq!(b.buf.read(9000, 65), msg[35..]);
    assert_eq!(b.buf.read(535, 1), [0]);
}

#[test]
fn inline_send_and_inline_longer_than_the_qp_allows() {
    let (mut env, a, b) = Env::pair();
    env.io.post_recv(b.qpn, recv(5, &[b.buf.sge(0, 256)]));
    let mut w = wr(1, SendOpcode::Send, &[], SendFlags::SIGNALED | SendFlags::INLINE);
    w.inline_len = 11;
    w.inline[..11].copy_from_slice(b"hello world");
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 5, b.qpn, a.qpn, 11)]);
    assert_eq!(b.buf.read(0, 11), b"hello world");

    // 65 inline bytes on a QP granted 64.
    env.io.post_recv(b.qpn, recv(6, &[b.buf.sge(0, 256)]));
    let mut w = wr(2, SendOpcode::Send, &[], SendFlags::SIGNALED | SendFlags::INLINE);
    w.inline_len = 65;
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::LocLenErr, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts), "a local error leaves the responder alone");
    assert!(env.poll(b.cq).is_empty());
}

// ---------------------------------------------------------------- RDMA

#[test]
fn rdma_write_write_with_imm_and_read() {
    let (mut env, a, b) = Env::pair();
    let data = pattern(300, 9);
    a.buf.write(0, &data);
    env.io
        .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 300)], b.buf.addr + 100, b.buf.key));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert!(env.poll(b.cq).is_empty(), "a plain write consumes no receive");
    assert_eq!(b.buf.read(100, 300), data);

    // With immediate: consumes a receive, whose buffers stay untouched.
    env.io.post_recv(b.qpn, recv(40, &[b.buf.sge(8000, 16)]));
    let mut w = rdma(2, SendOpcode::RdmaWriteWithImm, &[a.buf.sge(0, 200)], b.buf.addr + 4000, b.buf.key);
    w.imm_data = 0x1234_5678;
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    let mut c = recv_cqe(&env, 40, b.qpn, a.qpn, 200);
    c.opcode = WcOpcode::RecvRdmaWithImm;
    c.wc_flags = WcFlags::WITH_IMM;
    c.imm_data = 0x1234_5678;
    assert_eq!(env.poll(b.cq), vec![c]);
    assert_eq!(b.buf.read(4000, 200), data[..200]);
    assert_eq!(b.buf.read(8000, 16), [0; 16]);

    // Read back into two local SGEs.
    let back = pattern(64, 77);
    b.buf.write(20_000, &back);
    let sges = [a.buf.sge(30_000, 24), a.buf.sge(40_000, 40)];
    env.io.post_send(a.qpn, rdma(3, SendOpcode::RdmaRead, &sges, b.buf.addr + 20_000, b.buf.key));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(3, WcStatus::Success, WcOpcode::RdmaRead, a.qpn, 64)]);
    assert!(env.poll(b.cq).is_empty());
    assert_eq!(a.buf.read(30_000, 24), back[..24]);
    assert_eq!(a.buf.read(40_000, 40), back[24..]);
}

// ---------------------------------------------------------------- atomics

#[test]
fn compare_and_swap_and_fetch_and_add() {
    let (mut env, a, b) = Env::pair();
    let target = b.buf.addr + 64;
    b.buf.write(64, &5u64.to_le_bytes());

    // Success: the old value comes back, the new one is in place.
    let mut w = rdma(1, SendOpcode::AtomicCmpAndSwp, &[a.buf.sge(8, 8)], target, b.buf.key);
    w.compare_add = 5;
    w.swap = 9;
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::CompSwap, a.qpn, 8)]);
    assert_eq!(a.buf.u64_at(8), 5);
    assert_eq!(b.buf.u64_at(64), 9);

    // Mismatch: the current value comes back, memory is unchanged.
    let mut w = rdma(2, SendOpcode::AtomicCmpAndSwp, &[a.buf.sge(16, 8)], target, b.buf.key);
    w.compare_add = 5;
    w.swap = 100;
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::CompSwap, a.qpn, 8)]);
    assert_eq!(a.buf.u64_at(16), 9);
    assert_eq!(b.buf.u64_at(64), 9);

    let mut w = rdma(3, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(24, 8)], target, b.buf.key);
    w.compare_add = 0x1_0000_0000;
    env.io.post_send(a.qpn, w);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(3, WcStatus::Success, WcOpcode::FetchAdd, a.qpn, 8)]);
    assert_eq!(a.buf.u64_at(24), 9);
    assert_eq!(b.buf.u64_at(64), 0x1_0000_0009);
    assert!(env.poll(b.cq).is_empty());
    assert!(env.io.events.is_empty());
}

// ---------------------------------------------------------------- fairness

#[test]
fn large_write_is_chunked_and_does_not_starve_other_qps() {
    const LEN: usize = 300 << 10;
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    let c = env.end(C1);
    let d = env.end(C2);
    env.connect(a.qpn, b.qpn);
    env.connect(b.qpn, a.qpn);
    env.connect(c.qpn, d.qpn);
    env.connect(d.qpn, c.qpn);
    let src = env.mr(C1, a.pd, LEN, FULL);
    let dst = env.mr(C2, b.pd, LEN, FULL);
    let data = pattern(LEN, 1);
    src.write(0, &data);
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[src.sge(0, LEN as u32)], dst.addr, dst.key));
    env.io.post_recv(d.qpn, recv(9, &[d.buf.sge(0, 64)]));
    env.io.post_send(c.qpn, wr(2, SendOpcode::Send, &[c.buf.sge(0, 16)], SendFlags::SIGNALED));

    let chunk = env.hca.config().chunk_bytes as usize;
    assert_eq!(chunk, 64 << 10);
    let act = env.step(T0);
    assert!(act.busy);
    assert!(env.io.cqs.get(&a.cq).is_none_or(|v| v.is_empty()), "300 KiB do not fit one pass");
    assert_eq!(dst.read(0, chunk), data[..chunk]);
    assert_eq!(dst.read(chunk, 16), [0; 16], "one pass moves one chunk");
    assert_eq!(env.poll(c.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::Send, c.qpn, 0)]);
    assert_eq!(env.poll(d.cq), vec![recv_cqe(&env, 9, d.qpn, c.qpn, 16)]);

    let mut passes = 1;
    while env.io.cqs.get(&a.cq).is_none_or(|v| v.is_empty()) {
        env.step(T0);
        passes += 1;
        assert!(passes < 20);
    }
    assert_eq!(passes, LEN.div_ceil(chunk));
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert!(dst.read(0, LEN) == data);
}

// ---------------------------------------------------------------- errors

/// The responder's completion for a receive that failed.
fn recv_err(wr_id: u64, status: WcStatus, qpn: u32) -> Cqe {
    Cqe::new(wr_id, status, WcOpcode::Recv, qpn)
}

#[test]
fn bad_rkey_breaks_both_ends_and_flushes_the_rest() {
    let (mut env, a, b) = Env::pair();
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, 0xbad));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(a.qpn, rdma(3, SendOpcode::RdmaRead, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    env.io.post_recv(b.qpn, recv(50, &[b.buf.sge(0, 8)]));
    env.run(T0);
    assert_eq!(
        env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0),
            req_cqe(3, WcStatus::WrFlushErr, WcOpcode::RdmaRead, a.qpn, 0),
        ]
    );
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::QpAccessErr, element: b.qpn })]
    );
    // The responder's posted receive is flushed.
    assert_eq!(env.poll(b.cq), vec![recv_err(50, WcStatus::WrFlushErr, b.qpn)]);
    assert_eq!(env.hca.query_qp(C1, a.qpn).unwrap().0.qp_state, QpState::Err);
}

#[test]
fn a_deep_queue_in_err_is_flushed_over_several_passes_in_order() {
    let mut env = Env::new();
    let pd = env.hca.alloc_pd(C1).unwrap();
    let (cq, _) = env.hca.create_cq(C1, 1024).unwrap();
    let mut init = qp_init(cq, cq, None);
    init.cap.max_send_wr = 256;
    init.cap.max_recv_wr = 256;
    let q = env.qp(C1, pd, init);
    let other = env.end(C2);
    env.connect(q, other.qpn);
    env.modify(q, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
    for i in 0..200 {
        env.io.post_send(q, wr(i, SendOpcode::Send, &[], SendFlags::SIGNALED));
        env.io.post_recv(q, recv(1000 + i, &[]));
    }
    env.step(T0);
    assert!(env.io.send_queued(q) >= 200 - datapath::WRS_PER_PASS, "one pass flushed more than its bound");
    env.run(T0);
    let got: Vec<u64> = env.poll(cq).iter().map(|c| c.wr_id).collect();
    let sends: Vec<u64> = got.iter().copied().filter(|&w| w < 1000).collect();
    let recvs: Vec<u64> = got.iter().copied().filter(|&w| w >= 1000).collect();
    assert_eq!(sends, (0..200).collect::<Vec<_>>());
    assert_eq!(recvs, (1000..1200).collect::<Vec<_>>());
}

#[test]
fn a_responder_only_in_rtr_that_errs_flushes_its_receives() {
    // A QP that only receives never moves to RTS, so the engine does not
    // serve it until the error.
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    env.connect(a.qpn, b.qpn);
    env.bring_to_init(b.qpn, Conn::default());
    env.bring_to_rtr(b.qpn, a.qpn, Conn::default());
    env.io.post_recv(b.qpn, recv(50, &[b.buf.sge(0, 8)]));
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, 0xbad));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(env.poll(b.cq), vec![recv_err(50, WcStatus::WrFlushErr, b.qpn)]);
}

/// Runs one WR on a fresh connection and returns the requester's
/// completion, after checking the requester went to ERR.
fn failing(c: Conn, build: impl FnOnce(&mut Env, &End, &End) -> SendWr) -> (Env, End, End, Cqe) {
    let (mut env, a, b) = Env::pair_with(c);
    let w = build(&mut env, &a, &b);
    env.io.post_send(a.qpn, w);
    env.run(T0);
    let cqes = env.poll(a.cq);
    assert_eq!(cqes.len(), 1, "{cqes:?}");
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    (env, a, b, cqes[0])
}

fn assert_remote_access_err(env: &Env, a: &End, b: &End, cqe: Cqe, opcode: WcOpcode) {
    assert_eq!(cqe, req_cqe(1, WcStatus::RemAccessErr, opcode, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::QpAccessErr, element: b.qpn })]
    );
}

#[test]
fn remote_access_errors() {
    // Past the end of the remote region.
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 16)], b.buf.addr + (64 << 10) - 8, b.buf.key)
    });
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::RdmaWrite);
    assert_eq!(b.buf.read((64 << 10) - 8, 8), [0; 8], "nothing of a refused write lands");

    // Below the start of the remote region.
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 16)], b.buf.addr - 1, b.buf.key)
    });
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::RdmaRead);

    // A region registered without REMOTE_WRITE.
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, b| {
        let ro = env.mr(C2, b.pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
        rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 16)], ro.addr, ro.key)
    });
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::RdmaWrite);

    // A region registered without REMOTE_ATOMIC.
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, b| {
        let rw = env.mr(C2, b.pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        rdma(1, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(0, 8)], rw.addr, rw.key)
    });
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::FetchAdd);

    // A responder QP that does not allow remote reads.
    let conn = Conn { access: AccessFlags::REMOTE_WRITE, ..Conn::default() };
    let (env, a, b, cqe) =
        failing(conn, |_, a, b| rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 16)], b.buf.addr, b.buf.key));
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::RdmaRead);
}

#[test]
fn local_protection_errors_leave_the_responder_alone() {
    // An lkey that names nothing.
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        let mut s = a.buf.sge(0, 16);
        s.lkey = 0xbad;
        rdma(1, SendOpcode::RdmaWrite, &[s], b.buf.addr, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocProtErr, WcOpcode::RdmaWrite, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));
    assert!(env.io.events.is_empty());

    // A local region of another PD of the same process.
    let (env, a, b, cqe) = failing(Conn::default(), |env, _, b| {
        let pd2 = env.hca.alloc_pd(C1).unwrap();
        let other = env.mr(C1, pd2, 4096, FULL);
        rdma(1, SendOpcode::RdmaWrite, &[other.sge(0, 16)], b.buf.addr, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocProtErr, WcOpcode::RdmaWrite, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));

    // A local SGE reaching past its region.
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge((64 << 10) - 4, 8)], b.buf.addr, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocProtErr, WcOpcode::RdmaWrite, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));

    // A read into a region without LOCAL_WRITE.
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, b| {
        let ro = env.mr(C1, a.pd, 4096, AccessFlags::REMOTE_READ);
        rdma(1, SendOpcode::RdmaRead, &[ro.sge(0, 8)], b.buf.addr, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocProtErr, WcOpcode::RdmaRead, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));
}

#[test]
fn receive_buffer_too_small() {
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, b| {
        env.io.post_recv(b.qpn, recv(70, &[b.buf.sge(0, 10), b.buf.sge(100, 10)]));
        wr(1, SendOpcode::Send, &[a.buf.sge(0, 21)], SendFlags::SIGNALED)
    });
    let mut env = env;
    assert_eq!(cqe, req_cqe(1, WcStatus::RemInvReqErr, WcOpcode::Send, a.qpn, 0));
    assert_eq!(env.poll(b.cq), vec![recv_err(70, WcStatus::LocLenErr, b.qpn)]);
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::QpReqErr, element: b.qpn })]
    );
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        rdma(1, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(0, 8)], b.buf.addr + 4, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::RemInvReqErr, WcOpcode::FetchAdd, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(b.buf.read(0, 16), [0; 16]);

    // An atomic with a local buffer under 8 bytes is the requester's error.
    let (env, a, b, cqe) = failing(Conn::default(), |_, a, b| {
        rdma(1, SendOpcode::AtomicFetchAndAdd, &[a.buf.sge(0, 4)], b.buf.addr, b.buf.key)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocLenErr, WcOpcode::FetchAdd, a.qpn, 0));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));
}

#[test]
fn too_many_sges_and_inline_read_are_local_errors() {
    let (_, a, _, cqe) = failing(Conn::default(), |_, a, _| {
        let s = a.buf.sge(0, 1);
        wr(1, SendOpcode::Send, &[s, s, s, s, s], SendFlags::SIGNALED)
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocLenErr, WcOpcode::Send, a.qpn, 0));

    let (_, a, _, cqe) = failing(Conn::default(), |_, _, b| {
        let mut w = rdma(1, SendOpcode::RdmaRead, &[], b.buf.addr, b.buf.key);
        w.flags |= SendFlags::INLINE;
        w.inline_len = 8;
        w
    });
    assert_eq!(cqe, req_cqe(1, WcStatus::LocQpOpErr, WcOpcode::RdmaRead, a.qpn, 0));
}

#[test]
fn undecodable_send_wr_completes_in_error() {
    let (mut env, a, _) = Env::pair();
    env.hca.process(T0, &mut Garbled(&mut env.io, a.qpn, false));
    assert_eq!(env.poll(a.cq), vec![req_cqe(77, WcStatus::LocQpOpErr, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.retirement(a.qpn), (1, 1));
}

// ---------------------------------------------------------------- isolation

#[test]
fn another_tenants_rkey_is_refused() {
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, _| {
        let pd = env.hca.alloc_pd(C3).unwrap();
        let theirs = env.mr(C3, pd, 4096, FULL);
        theirs.write(0, b"secret");
        rdma(1, SendOpcode::RdmaRead, &[a.buf.sge(0, 6)], theirs.addr, theirs.key)
    });
    assert_remote_access_err(&env, &a, &b, cqe, WcOpcode::RdmaRead);
    assert_eq!(a.buf.read(0, 6), [0; 6]);
}

#[test]
fn a_qp_connected_across_tenants_times_out() {
    let mut env = Env::new();
    let a = env.end(C1);
    let x = env.end(C3);
    env.connect(a.qpn, x.qpn);
    env.connect(x.qpn, a.qpn);
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], x.buf.addr, x.buf.key));
    a.buf.write(0, b"intruder");

    let t = timers::ack_timeout(1).unwrap();
    let deadline = T0 + t * 2; // retry_cnt 1: the first try and one retry
    let act = env.run(T0);
    assert_eq!(act.next_timer, Some(T0 + t));
    assert!(env.poll(a.cq).is_empty());
    let act = env.run(T0 + t);
    assert_eq!(act.next_timer, Some(deadline));
    let act = env.run(Instant(deadline.0 - 1));
    assert!(!act.busy);
    assert_eq!(act.next_timer, Some(deadline));
    assert!(env.poll(a.cq).is_empty(), "not before the deadline");
    assert_eq!(env.io.state(a.qpn), Some(QpState::Rts));

    let act = env.run(deadline);
    assert_eq!(act.next_timer, None);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.state(x.qpn), Some(QpState::Rts), "the other tenant sees nothing");
    assert!(env.io.events.is_empty());
    assert_eq!(x.buf.read(0, 8), [0; 8]);
}

// ---------------------------------------------------------------- RNR

#[test]
fn rnr_retries_then_fails() {
    let (mut env, a, b) = Env::pair_with(Conn { rnr_retry: 2, min_rnr_timer: 1, ..Conn::default() });
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    let delay = timers::rnr_delay(1);
    assert_eq!(delay, Duration::from_micros(10));

    let act = env.run(T0);
    assert_eq!(act.next_timer, Some(T0 + delay));
    assert!(env.poll(a.cq).is_empty());
    // Before the timer, nothing happens.
    let act = env.step(Instant((T0 + delay).0 - 1));
    assert!(!act.busy);
    let t1 = T0 + delay;
    let act = env.run(t1);
    assert_eq!(act.next_timer, Some(t1 + delay));
    assert!(env.poll(a.cq).is_empty());
    let t2 = t1 + delay;
    let act = env.run(t2);
    assert_eq!(act.next_timer, None);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RnrRetryExcErr, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));
    assert!(env.poll(b.cq).is_empty());
}

#[test]
fn rnr_retry_seven_waits_for_a_receive() {
    let (mut env, a, b) = Env::pair_with(Conn { rnr_retry: 7, min_rnr_timer: 1, ..Conn::default() });
    a.buf.write(0, b"late");
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 4)], SendFlags::SIGNALED));
    let mut now = T0;
    for _ in 0..20 {
        let act = env.run(now);
        assert!(env.poll(a.cq).is_empty());
        now = act.next_timer.expect("waiting on the RNR timer");
        assert!(now.0 - T0.0 <= 20 * 10_000);
    }
    env.io.post_recv(b.qpn, recv(3, &[b.buf.sge(0, 64)]));
    env.run(now);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 3, b.qpn, a.qpn, 4)]);
    assert_eq!(b.buf.read(0, 4), b"late");
}

// ---------------------------------------------------------------- deregistration

#[test]
fn dereg_mr_revokes_remote_access() {
    let (mut env, a, b) = Env::pair();
    env.hca.dereg_mr(C2, b.buf.key).unwrap();
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    // Deregistering twice, or from another process, names nothing.
    assert!(matches!(env.hca.dereg_mr(C2, b.buf.key), Err(HcaError::NoSuchObject { .. })));
    assert!(matches!(env.hca.dereg_mr(C2, a.buf.key), Err(HcaError::NoSuchObject { .. })));
}

#[test]
fn dereg_mid_transfer_stops_the_write_and_flushes_the_receive() {
    const LEN: usize = 300 << 10;
    let (mut env, a, b) = Env::pair();
    let src = env.mr(C1, a.pd, LEN, FULL);
    let dst = env.mr(C2, b.pd, LEN, FULL);
    src.write(0, &pattern(LEN, 4));
    env.io.post_recv(b.qpn, recv(60, &[]));
    let w = rdma(1, SendOpcode::RdmaWriteWithImm, &[src.sge(0, LEN as u32)], dst.addr, dst.key);
    env.io.post_send(a.qpn, w);
    env.step(T0);
    assert!(env.poll(a.cq).is_empty());
    env.hca.dereg_mr(C2, dst.key).unwrap();
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    // The receive the write-with-immediate had claimed is not lost: the
    // responder's error flushes it like any other.
    assert_eq!(env.poll(b.cq), vec![recv_err(60, WcStatus::WrFlushErr, b.qpn)]);
    let chunk = env.hca.config().chunk_bytes as usize;
    assert_eq!(dst.read(chunk, 8), [0; 8], "nothing lands after the deregistration");
}

// ---------------------------------------------------------------- state rules

#[test]
fn modify_rejects_a_wrong_mask() {
    let mut env = Env::new();
    let a = env.end(C1);
    let attr = QpAttr { qp_state: QpState::Init, port_num: 1, ..QpAttr::default() };
    // ACCESS_FLAGS missing.
    let r = env.modify(a.qpn, &attr, QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT);
    assert!(matches!(r, Err(HcaError::Modify(_))), "{r:?}");
    assert_eq!(errno(r), 22);
    // A skipped state.
    let rtr = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
    assert!(matches!(env.modify(a.qpn, &rtr, QpAttrMask::STATE), Err(HcaError::Modify(_))));
    // An attribute the transition does not take.
    let mask = QpAttrMask::STATE
        | QpAttrMask::PKEY_INDEX
        | QpAttrMask::PORT
        | QpAttrMask::ACCESS_FLAGS
        | QpAttrMask::SQ_PSN;
    assert!(matches!(env.modify(a.qpn, &attr, mask), Err(HcaError::Modify(_))));
    assert_eq!(env.hca.query_qp(C1, a.qpn).unwrap().0.qp_state, QpState::Reset);
    assert!(env.io.states.is_empty(), "a refused modify publishes nothing");
    // Another process cannot modify the QP.
    let r = env.hca.modify_qp(C2, a.qpn, &attr, QpAttrMask::STATE, &mut env.io);
    assert!(matches!(r, Err(HcaError::NoSuchObject { .. })));
}

#[test]
fn sends_wait_until_rts() {
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    let c = Conn::default();
    env.connect(b.qpn, a.qpn);
    env.bring_to_init(a.qpn, c);
    env.bring_to_rtr(a.qpn, b.qpn, c);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Rtr));
    env.io.post_recv(b.qpn, recv(4, &[b.buf.sge(0, 8)]));
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    let act = env.run(T0);
    assert_eq!(act, Activity::default());
    assert!(env.poll(a.cq).is_empty());
    assert_eq!(env.io.send[&a.qpn].len(), 1, "not even pulled");
    // An RTR QP already receives.
    env.io.post_recv(a.qpn, recv(5, &[a.buf.sge(0, 8)]));
    env.io.post_send(b.qpn, wr(2, SendOpcode::Send, &[b.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![recv_cqe(&env, 5, a.qpn, b.qpn, 8)]);
    env.bring_to_rts(a.qpn, c);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
}

#[test]
fn modify_to_err_flushes_sends_and_receives() {
    let (mut env, a, _) = Env::pair();
    // Posted while RTS, before any pass ran.
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], 0, 0));
    env.io.post_recv(a.qpn, recv(3, &[a.buf.sge(0, 8)]));
    env.io.post_recv(a.qpn, recv(4, &[]));
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    assert_eq!(env.modify(a.qpn, &attr, QpAttrMask::STATE), Ok(QpState::Err));
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    env.run(T0);
    assert_eq!(
        env.poll(a.cq),
        vec![
            req_cqe(1, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0),
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, a.qpn, 0),
            recv_err(3, WcStatus::WrFlushErr, a.qpn),
            recv_err(4, WcStatus::WrFlushErr, a.qpn),
        ]
    );
    // What is posted later is flushed too.
    env.io.post_recv(a.qpn, recv(5, &[]));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![recv_err(5, WcStatus::WrFlushErr, a.qpn)]);
    assert!(env.io.events.is_empty(), "a QP without an SRQ reports no last-WQE event");
}

#[test]
fn modify_to_reset_discards_without_completions() {
    let (mut env, a, b) = Env::pair();
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.io.post_recv(a.qpn, recv(3, &[a.buf.sge(0, 8)]));
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    assert_eq!(env.modify(a.qpn, &attr, QpAttrMask::STATE), Ok(QpState::Reset));
    assert_eq!(env.io.discarded, vec![a.qpn]);
    assert_eq!(env.io.state(a.qpn), Some(QpState::Reset));
    env.run(T0);
    assert!(env.poll(a.cq).is_empty());
    assert!(env.poll(b.cq).is_empty());
    let (attr, _) = env.hca.query_qp(C1, a.qpn).unwrap();
    assert_eq!(attr.qp_state, QpState::Reset);
    assert_eq!(attr.dest_qp_num, 0);
    assert_eq!(attr.cap.max_send_wr, 16);
    // It can be brought up again.
    env.connect(a.qpn, b.qpn);
    env.io.post_recv(b.qpn, recv(7, &[b.buf.sge(0, 8)]));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 7, b.qpn, a.qpn, 8)]);
}

/// A signaled send (wr_id 1) of `len` bytes from a to b after one pass:
/// it has claimed b's receive `recv_id` and filled part of it. Returns the
/// pair and a's source buffer.
fn half_placed_send(len: usize, recv_id: u64) -> (Env, End, End, Buf) {
    let (mut env, a, b) = Env::pair();
    let src = env.mr(C1, a.pd, len, FULL);
    let dst = env.mr(C2, b.pd, len, FULL);
    env.io.post_recv(b.qpn, recv(recv_id, &[dst.sge(0, len as u32)]));
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[src.sge(0, len as u32)], SendFlags::SIGNALED));
    env.step(T0);
    assert!(env.poll(b.cq).is_empty(), "a holds b's receive, part-filled");
    (env, a, b, src)
}

#[test]
fn reset_mid_send_gives_the_receive_back() {
    let (mut env, a, b, src) = half_placed_send(200 << 10, 8);
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    env.modify(a.qpn, &attr, QpAttrMask::STATE).unwrap();
    // The message was abandoned: the receive it claimed serves the next one.
    env.connect(a.qpn, b.qpn);
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[src.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    assert_eq!(env.poll(b.cq), vec![recv_cqe(&env, 8, b.qpn, a.qpn, 8)]);
}

#[test]
fn destroying_the_requester_mid_send_gives_the_receive_back() {
    let (mut env, a, b, _src) = half_placed_send(200 << 10, 8);
    env.hca.destroy_qp(C1, a.qpn, &mut env.io).unwrap();
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    env.modify(b.qpn, &attr, QpAttrMask::STATE).unwrap();
    env.run(T0);
    assert_eq!(env.poll(b.cq), vec![recv_err(8, WcStatus::WrFlushErr, b.qpn)]);
}

// ---------------------------------------------------------------- SRQ

#[test]
fn srq_shared_by_two_qps_with_limit_and_last_wqe() {
    let mut env = Env::new();
    let a1 = env.end(C1);
    let a2 = env.end(C1);
    let pd = env.hca.alloc_pd(C2).unwrap();
    let (cq, _) = env.hca.create_cq(C2, 64).unwrap();
    let (srq, granted) =
        env.hca.create_srq(C2, pd, SrqAttr { max_wr: 10, max_sge: 2, srq_limit: 2 }).unwrap();
    assert_eq!(granted, SrqAttr { max_wr: 16, max_sge: 2, srq_limit: 2 });
    let b1 = env.qp(C2, pd, qp_init(cq, cq, Some(srq)));
    let b2 = env.qp(C2, pd, qp_init(cq, cq, Some(srq)));
    assert_eq!(env.hca.query_qp(C2, b1).unwrap().1.cap.max_recv_wr, 0);
    let buf = env.mr(C2, pd, 4096, FULL);
    for (a, b) in [(&a1, b1), (&a2, b2)] {
        env.connect(a.qpn, b);
        env.connect(b, a.qpn);
    }
    for i in 0..4u64 {
        env.io.post_srq(srq, recv(100 + i, &[buf.sge(i * 64, 64)]));
    }
    a1.buf.write(0, b"one");
    a2.buf.write(0, b"two");

    env.io.post_send(a1.qpn, wr(1, SendOpcode::Send, &[a1.buf.sge(0, 3)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(cq), vec![recv_cqe(&env, 100, b1, a1.qpn, 3)]);
    assert!(env.io.events.is_empty(), "3 left, limit 2");
    env.io.post_send(a2.qpn, wr(2, SendOpcode::Send, &[a2.buf.sge(0, 3)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(cq), vec![recv_cqe(&env, 101, b2, a2.qpn, 3)]);
    assert!(env.io.events.is_empty(), "2 left is not below the limit 2");
    env.io.post_send(a1.qpn, wr(3, SendOpcode::Send, &[a1.buf.sge(0, 3)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(cq), vec![recv_cqe(&env, 102, b1, a1.qpn, 3)]);
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq })]
    );
    assert_eq!(env.hca.query_srq(C2, srq).unwrap().srq_limit, 0, "the limit disarms");
    assert_eq!(buf.read(0, 3), b"one");
    assert_eq!(buf.read(64, 3), b"two");
    assert_eq!(buf.read(128, 3), b"one");

    // Disarmed: no second event.
    env.io.post_send(a2.qpn, wr(4, SendOpcode::Send, &[a2.buf.sge(0, 3)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(cq), vec![recv_cqe(&env, 103, b2, a2.qpn, 3)]);
    assert_eq!(env.io.events.len(), 1);
    // Re-armed: fires again.
    env.hca.modify_srq(C2, srq, Some(1), false).unwrap();
    assert!(matches!(env.hca.modify_srq(C2, srq, None, true), Err(HcaError::Unsupported(_))));
    assert!(matches!(env.hca.modify_srq(C2, srq, Some(17), false), Err(HcaError::InvalidArgument(_))));
    env.io.post_srq(srq, recv(104, &[buf.sge(0, 64)]));
    env.io.post_send(a1.qpn, wr(5, SendOpcode::Send, &[a1.buf.sge(0, 3)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(cq), vec![recv_cqe(&env, 104, b1, a1.qpn, 3)]);
    assert_eq!(env.io.events.len(), 2);
    assert_eq!(env.hca.query_srq(C2, srq).unwrap().srq_limit, 0);

    // A QP of an SRQ in ERR: last WQE reached; the SRQ's receives stay.
    env.io.post_srq(srq, recv(105, &[buf.sge(0, 64)]));
    env.io.events.clear();
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    env.modify(b1, &attr, QpAttrMask::STATE).unwrap();
    env.run(T0);
    assert_eq!(
        env.io.events,
        vec![(C2, AsyncEvent { event_type: AsyncEventType::QpLastWqeReached, element: b1 })]
    );
    assert!(env.poll(cq).is_empty());
    assert_eq!(env.io.srq[&srq].len(), 1);
    // The SRQ is in use until both QPs are gone.
    assert!(matches!(env.hca.destroy_srq(C2, srq), Err(HcaError::Busy(_))));
    env.hca.destroy_qp(C2, b1, &mut env.io).unwrap();
    env.hca.destroy_qp(C2, b2, &mut env.io).unwrap();
    env.hca.destroy_srq(C2, srq).unwrap();
}

// ---------------------------------------------------------------- CQ overrun

#[test]
fn cq_overrun_is_an_error_for_cq_and_qp() {
    let (mut env, a, b) = Env::pair();
    env.io.cq_cap.insert(a.cq, 1);
    for i in 1..=2 {
        let w = rdma(i, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key);
        env.io.post_send(a.qpn, w);
    }
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(
        env.io.events,
        vec![
            (C1, AsyncEvent { event_type: AsyncEventType::CqErr, element: a.cq }),
            (C1, AsyncEvent { event_type: AsyncEventType::QpFatal, element: a.qpn }),
        ]
    );
    assert_eq!(env.io.state(a.qpn), Some(QpState::Err));
    assert_eq!(env.io.state(b.qpn), Some(QpState::Rts));
    // The CQ stays in error: nothing more is pushed to it.
    env.io.post_send(a.qpn, wr(3, SendOpcode::Send, &[], SendFlags::SIGNALED));
    env.run(T0);
    assert!(env.poll(a.cq).is_empty());
    assert_eq!(env.io.events.len(), 2);
    // Another QP on that CQ goes to ERR at its next completion, rather
    // than running on with its completions lost.
    let a2 = env.qp(C1, a.pd, qp_init(a.cq, a.cq, None));
    let b2 = env.end(C2);
    env.connect(a2, b2.qpn);
    env.connect(b2.qpn, a2);
    env.io.post_send(a2, rdma(4, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b2.buf.addr, b2.buf.key));
    env.io.post_send(a2, rdma(5, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b2.buf.addr, b2.buf.key));
    env.run(T0);
    assert_eq!(env.io.state(a2), Some(QpState::Err));
    assert_eq!(env.io.events[2..], [(C1, AsyncEvent { event_type: AsyncEventType::QpFatal, element: a2 })]);
    assert!(env.poll(a.cq).is_empty());
    assert_eq!(env.io.state(b2.qpn), Some(QpState::Rts));
}

// ---------------------------------------------------------------- stat

#[test]
fn stat_pages_list_each_link_and_each_qp_of_the_tenant_once_in_order() {
    let mut env = Env::new();
    let pd = env.hca.alloc_pd(C1).unwrap();
    let (cq, _) = env.hca.create_cq(C1, 64).unwrap();
    let mut mine: Vec<u32> =
        (0..2 * STAT_PAGE_QPS + 5).map(|_| env.qp(C1, pd, qp_init(cq, cq, None))).collect();
    // Another process of the tenant counts; another tenant does not show.
    let pd2 = env.hca.alloc_pd(C2).unwrap();
    let (cq2, _) = env.hca.create_cq(C2, 64).unwrap();
    mine.push(env.qp(C2, pd2, qp_init(cq2, cq2, None)));
    let pd3 = env.hca.alloc_pd(C3).unwrap();
    let (cq3, _) = env.hca.create_cq(C3, 64).unwrap();
    let theirs = env.qp(C3, pd3, qp_init(cq3, cq3, None));
    mine.sort_unstable();
    let links: Vec<u32> = (0..STAT_PAGE_LINKS + 3)
        .map(|i| {
            let gid = crate::verbs::Gid::from_ipv4([10, 1, (i >> 8) as u8, i as u8]);
            env.hca.link_up(LinkInfo { gid, lid: 100 + i as u16, chunk: 65536, verified: true }).0
        })
        .collect();

    let (mut seen_qps, mut seen_links, mut pages) = (Vec::new(), Vec::new(), 0);
    let mut from = StatCursor::START;
    loop {
        let page = env.hca.stat(C1, from, StatView::Tenant).unwrap();
        assert!(page.report.qps.len() <= STAT_PAGE_QPS && page.report.links.len() <= STAT_PAGE_LINKS);
        seen_qps.extend(page.report.qps.iter().map(|q| q.qpn));
        seen_links.extend(page.report.links.iter().map(|l| l.id.0));
        pages += 1;
        match page.next {
            Some(next) => from = next,
            None => break,
        }
        assert!(pages < 10, "the pages do not end");
    }
    assert_eq!(pages, 3);
    assert_eq!(seen_qps, mine);
    let mine_qps = mine.len();
    assert!(!seen_qps.contains(&theirs));
    assert_eq!(seen_links, links);
    // The other tenant sees only its own QP, and every link.
    let page = env.hca.stat(C3, StatCursor::START, StatView::Tenant).unwrap();
    assert_eq!(page.report.qps.iter().map(|q| q.qpn).collect::<Vec<_>>(), vec![theirs]);
    assert_eq!(page.next, Some(StatCursor { link: Some(links[STAT_PAGE_LINKS]), qpn: None }));
    // Each sees its own tenant's figures, and only those.
    let own = |c| {
        env.hca
            .stat(c, StatCursor::START, StatView::Tenant)
            .unwrap()
            .report
            .tenant
            .expect("the tenant's figures")
    };
    let (mine, theirs) = (own(C1), own(C3));
    assert_eq!((mine.tenant, theirs.tenant), (TENANT, OTHER_TENANT));
    assert_eq!(*mine, env.hca.tenant_report(TENANT));
    assert_eq!(mine.objects as usize, 2 + 2 + mine_qps, "its PDs, CQs and QPs");
    assert_eq!(theirs.objects, 3, "{theirs:?}");
}

#[test]
fn the_engine_serves_only_qps_with_something_to_do() {
    let (mut env, a, b) = Env::pair();
    // Connected, they are served until a pass finds them idle.
    assert_eq!(env.hca.served_qps(), &[a.qpn, b.qpn]);
    env.run(T0);
    assert_eq!(env.hca.served_qps(), &[] as &[u32]);
    // Idle QPs, however many, cost a pass nothing.
    let idle: Vec<u32> = (0..100).map(|_| env.qp(C1, a.pd, qp_init(a.cq, a.cq, None))).collect();
    env.bring_to_init(idle[0], Conn::default());
    env.bring_to_init(idle[1], Conn::default());
    env.bring_to_rtr(idle[1], b.qpn, Conn::default());
    assert_eq!(env.hca.served_qps(), &[] as &[u32]);
    // A QP in ERR is served (its queues are flushed), also straight from
    // INIT, until it is flushed; a post to either queue wakes it again.
    env.modify(idle[0], &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
    assert_eq!(env.hca.served_qps(), &[idle[0]]);
    env.run(T0);
    assert_eq!(env.hca.served_qps(), &[] as &[u32]);
    env.io.post_send(idle[0], wr(77, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.io.post_recv(idle[0], recv(78, &[a.buf.sge(0, 8)]));
    env.run(T0);
    assert_eq!(
        env.poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        vec![(77, WcStatus::WrFlushErr), (78, WcStatus::WrFlushErr)]
    );
    env.io.post_recv(idle[0], recv(79, &[a.buf.sge(0, 8)]));
    env.run(T0);
    assert_eq!(env.poll(a.cq).iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![79]);
    // Back in RESET or destroyed, a QP is not served even when posted to.
    env.modify(a.qpn, &QpAttr { qp_state: QpState::Reset, ..QpAttr::default() }, QpAttrMask::STATE).unwrap();
    env.io.post_send(a.qpn, wr(80, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.hca.destroy_qp(C1, idle[0], &mut env.io).unwrap();
    env.io.post_send(idle[0], wr(81, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.hca.served_qps(), &[] as &[u32]);
    assert!(env.poll(a.cq).is_empty());
    // Connected again, it is served again, and works. (The WR posted in
    // RESET would run once it can send: dropped here.)
    env.io.send.remove(&a.qpn);
    env.connect(a.qpn, b.qpn);
    env.run(T0);
    env.io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, 8)]));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    assert_eq!(env.hca.served_qps(), &[] as &[u32], "asleep until the next pass takes the notice");
    env.run(T0);
    assert_eq!(env.poll(a.cq).len(), 1);
    assert_eq!(env.poll(b.cq).len(), 1);
    // Only the posted QP's queues were looked at in that pass.
    env.io.post_recv(b.qpn, recv(3, &[b.buf.sge(0, 8)]));
    env.io.parked.clear();
    env.io.post_send(a.qpn, wr(4, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.io.parked, vec![a.qpn]);
    assert_eq!((env.poll(a.cq).len(), env.poll(b.cq).len()), (1, 1));
}

/// A QP that never got named (as when a tenant does not name its QPs)
/// still runs: at the next sweep, which counts the missed wake-up.
#[test]
fn a_sweep_finds_a_qp_whose_wake_up_was_missed() {
    let (mut env, a, b) = Env::pair();
    env.run(T0);
    env.io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, 8)]));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.io.posted.clear();
    env.run(T0);
    assert!(env.poll(a.cq).is_empty(), "not named, not served");
    assert_eq!(env.hca.missed_wakeups(), 0);
    env.hca.sweep();
    env.run(T0);
    assert_eq!(env.poll(a.cq).len(), 1);
    assert_eq!(env.hca.missed_wakeups(), 1, "a's turn found work");
    // A sweep that finds nothing counts nothing.
    env.hca.sweep();
    env.run(T0);
    assert_eq!(env.hca.missed_wakeups(), 1);
    // Its tenant's own count, which is all its `vrdma stat` shows; another
    // tenant's shows none, the operator's the daemon's.
    let missed = |c, view| env.hca.stat(c, StatCursor::START, view).unwrap().report.missed_wakeups;
    assert_eq!(env.hca.tenant_report(TENANT).counters.missed_wakeups, 1);
    assert_eq!((missed(C1, StatView::Tenant), missed(C3, StatView::Tenant)), (1, 0));
    assert_eq!(missed(C3, StatView::Operator), 1);
}

/// A receive a requester held (a send cut short) goes back to its
/// responder when the requester fails or goes: a responder already in ERR,
/// and left idle once its own queues were flushed, must still flush it.
#[test]
fn a_receive_given_back_to_an_idle_qp_in_err_is_flushed() {
    for destroy in [false, true] {
        let (mut env, a, b, _src) = half_placed_send(300 << 10, 60);
        // b fails: it has nothing of its own to flush, and is left idle.
        env.modify(b.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
            .unwrap();
        env.run(T0);
        assert!(!env.hca.served_qps().contains(&b.qpn));
        // a goes: the receive it held goes back to b.
        if destroy {
            env.hca.destroy_qp(C1, a.qpn, &mut env.io).unwrap();
        } else {
            env.modify(a.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
                .unwrap();
        }
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![recv_err(60, WcStatus::WrFlushErr, b.qpn)], "destroy: {destroy}");
        assert_eq!(env.hca.missed_wakeups(), 0);
    }
}

// ---------------------------------------------------------------- quotas

#[test]
fn object_quota_counts_every_object_and_refunds() {
    let mut env = Env::new();
    env.hca.set_quota(OTHER_TENANT, Quota { max_objects: 3, ..Quota::default() });
    let pd = env.hca.alloc_pd(C3).unwrap();
    let (cq, depth) = env.hca.create_cq(C3, 5).unwrap();
    assert_eq!(depth, 8);
    let buf = env.mr(C3, pd, 4096, FULL);
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, 4096 + cq_ring(8)));
    let r = env.hca.alloc_pd(C3);
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))), "{r:?}");
    assert_eq!(errno(r), 12);
    assert!(matches!(env.hca.create_cq(C3, 1), Err(HcaError::QuotaExceeded(_))));
    let r = env.hca.reg_mr(C3, pd, 0x9000_0000, FULL, Region::heap(64));
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))));
    let r = env.hca.create_qp(C3, pd, qp_init(cq, cq, None));
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))));
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, 4096 + cq_ring(8)), "refused calls charge nothing");
    // The other tenant is not affected.
    env.hca.alloc_pd(C1).unwrap();
    assert_eq!(env.hca.usage(TENANT), (1, 0));

    env.hca.dereg_mr(C3, buf.key).unwrap();
    assert_eq!(env.hca.usage(OTHER_TENANT), (2, cq_ring(8)));
    let created = env.hca.create_qp(C3, pd, qp_init(cq, cq, None)).unwrap();
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, cq_ring(8) + qp_ring_bytes(created.cap)));
    assert!(env.hca.alloc_pd(C3).is_err());
}

#[test]
fn quota_is_shared_by_a_tenants_processes() {
    let mut env = Env::new();
    env.hca.set_quota(TENANT, Quota { max_objects: 2, ..Quota::default() });
    let pd1 = env.hca.alloc_pd(C1).unwrap();
    env.hca.alloc_pd(C2).unwrap();
    assert!(matches!(env.hca.alloc_pd(C1), Err(HcaError::QuotaExceeded(_))));
    assert!(matches!(env.hca.alloc_pd(C2), Err(HcaError::QuotaExceeded(_))));
    env.hca.dealloc_pd(C1, pd1).unwrap();
    env.hca.alloc_pd(C2).unwrap();
}

#[test]
fn registered_bytes_quota() {
    let mut env = Env::new();
    env.hca.set_quota(OTHER_TENANT, Quota { max_registered_bytes: 8192, ..Quota::default() });
    let pd = env.hca.alloc_pd(C3).unwrap();
    let first = env.mr(C3, pd, 4096, FULL);
    env.mr(C3, pd, 4096, AccessFlags::empty());
    let r = env.hca.reg_mr(C3, pd, 0x9000_0000, FULL, Region::heap(1));
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))), "{r:?}");
    assert_eq!(errno(r), 12);
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, 8192));
    env.hca.dereg_mr(C3, first.key).unwrap();
    assert_eq!(env.hca.usage(OTHER_TENANT), (2, 4096));
    env.mr(C3, pd, 4096, FULL);
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, 8192));
}

#[test]
fn queue_rings_count_against_the_memory_quota() {
    let mut env = Env::new();
    let pd = env.hca.alloc_pd(C3).unwrap();
    let (cq, _) = env.hca.create_cq(C3, 64).unwrap();
    let mut init = qp_init(cq, cq, None);
    init.cap = QpCap {
        max_send_wr: 1024,
        max_recv_wr: 1024,
        max_send_sge: 16,
        max_recv_sge: 16,
        max_inline_data: 256,
    };
    let one = qp_ring_bytes(init.cap);
    env.hca
        .set_quota(OTHER_TENANT, Quota { max_registered_bytes: cq_ring(64) + 2 * one, ..Quota::default() });
    let q1 = env.hca.create_qp(C3, pd, init).unwrap().qpn;
    env.hca.create_qp(C3, pd, init).unwrap();
    let r = env.hca.create_qp(C3, pd, init);
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))), "a third QP's rings pass the quota: {r:?}");
    assert!(matches!(env.hca.create_cq(C3, 1), Err(HcaError::QuotaExceeded(_))));
    let r = env.hca.create_srq(C3, pd, SrqAttr { max_wr: 1, max_sge: 1, srq_limit: 0 });
    assert!(matches!(r, Err(HcaError::QuotaExceeded(_))));
    assert!(matches!(
        env.hca.reg_mr(C3, pd, 0x9000_0000, FULL, Region::heap(1)),
        Err(HcaError::QuotaExceeded(_))
    ));
    // A QP destroyed gives its rings back; a context closed, everything.
    env.hca.destroy_qp(C3, q1, &mut env.io).unwrap();
    let (srq, _) = env.hca.create_srq(C3, pd, SrqAttr { max_wr: 16, max_sge: 2, srq_limit: 0 }).unwrap();
    assert_eq!(
        env.hca.usage(OTHER_TENANT),
        (4, cq_ring(64) + one + ring_bytes(16, crate::ring::recv_stride(2)))
    );
    env.hca.destroy_srq(C3, srq).unwrap();
    env.hca.close_context(C3, &mut env.io);
    assert_eq!(env.hca.usage(OTHER_TENANT), (0, 0));
}

#[test]
fn the_device_shows_each_tenant_its_quota_as_limits() {
    let mut env = Env::new();
    env.hca.set_quota(
        OTHER_TENANT,
        Quota { max_queue_depth: 100, max_objects: 7, max_registered_bytes: 1 << 20, ..Quota::default() },
    );
    let d = env.hca.device_attr(C3).unwrap();
    // Depths: the largest granted as asked (a power of two) within 100.
    assert_eq!((d.max_cqe, d.max_qp_wr, d.max_srq_wr), (64, 64, 64));
    assert_eq!((d.max_qp, d.max_cq, d.max_mr, d.max_pd, d.max_ah, d.max_srq), (7, 7, 7, 7, 7, 7));
    assert_eq!(d.max_mr_size, 1 << 20);
    // What it shows can be had.
    let pd = env.hca.alloc_pd(C3).unwrap();
    env.hca.create_cq(C3, d.max_cqe).unwrap();
    assert!(env.hca.create_cq(C3, d.max_cqe + 1).is_err());
    env.hca.reg_mr(C3, pd, 0x10_0000, FULL, Region::heap(1 << 19)).unwrap();
    // Other tenants see the device's own limits where their quota is higher.
    let full = env.hca.device_attr(C1).unwrap();
    assert_eq!(full.max_cqe, env.hca.config().device.max_cqe.min(Quota::default().max_queue_depth));
    assert_eq!(full.max_sge, d.max_sge);
}

/// A tenant's share of the daemon's mappings bounds the regions and queues
/// it can have (its context takes one), and the device says so; objects
/// that cost no mapping (PDs, AHs) are bounded by the object quota alone.
#[test]
fn the_device_shows_each_tenant_its_share_of_mappings() {
    let mut env = Env::new();
    env.hca.set_quota(OTHER_TENANT, Quota { max_objects: 100, max_mappings: Some(10), ..Quota::default() });
    let d = env.hca.device_attr(C3).unwrap();
    assert_eq!((d.max_qp, d.max_cq, d.max_mr, d.max_srq), (9, 9, 9, 9));
    assert_eq!((d.max_pd, d.max_ah), (100, 100));
    // No share of its own: the object quota is the bound.
    env.hca.set_quota(OTHER_TENANT, Quota { max_objects: 100, max_mappings: None, ..Quota::default() });
    assert_eq!(env.hca.device_attr(C3).unwrap().max_mr, 100);
    // A share that leaves nothing beyond the context shows nothing.
    env.hca.set_quota(OTHER_TENANT, Quota { max_mappings: Some(1), ..Quota::default() });
    assert_eq!(env.hca.device_attr(C3).unwrap().max_mr, 0);
}

/// Queue rings are memory the daemon creates: a tenant's share of it
/// bounds its queues apart from its regions, is given back when they go,
/// and the depths the device shows fit in it.
#[test]
fn queue_memory_is_bounded_by_its_own_share() {
    let mut env = Env::new();
    let share = cq_ring(64) + cq_ring(32);
    env.hca.set_quota(OTHER_TENANT, Quota { max_queue_bytes: Some(share), ..Quota::default() });
    let pd = env.hca.alloc_pd(C3).unwrap();
    let (big, _) = env.hca.create_cq(C3, 64).unwrap();
    env.hca.create_cq(C3, 32).unwrap();
    let r = env.hca.create_cq(C3, 1);
    assert!(matches!(&r, Err(HcaError::QuotaExceeded(m)) if m.contains("queue rings")), "{r:?}");
    // Regions are the tenant's own memory: not queue memory.
    env.hca.reg_mr(C3, pd, 0x10_0000, FULL, Region::heap(1 << 20)).unwrap();
    env.hca.destroy_cq(C3, big).unwrap();
    env.hca.create_cq(C3, 64).unwrap();
    assert!(env.hca.create_cq(C3, 1).is_err());
    // The deepest CQ shown is one that fits in the share.
    let d = env.hca.device_attr(C3).unwrap();
    assert_eq!(d.max_cqe, 64);
    env.hca.close_context(C3, &mut env.io);
    assert_eq!(env.hca.usage(OTHER_TENANT), (0, 0));
}

#[test]
fn queue_depth_quota() {
    let mut env = Env::new();
    env.hca.set_quota(OTHER_TENANT, Quota { max_queue_depth: 8, ..Quota::default() });
    let pd = env.hca.alloc_pd(C3).unwrap();
    // Above the depth the device shows this tenant: EINVAL, as above a
    // device's max_cqe on hardware.
    let r = env.hca.create_cq(C3, 9);
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "{r:?}");
    assert_eq!(errno(r), 22);
    let (cq, _) = env.hca.create_cq(C3, 8).unwrap();
    let r = env.hca.create_qp(C3, pd, qp_init(cq, cq, None));
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "{r:?}");
    let mut init = qp_init(cq, cq, None);
    init.cap.max_send_wr = 8;
    init.cap.max_recv_wr = 8;
    let created = env.hca.create_qp(C3, pd, init).unwrap();
    assert_eq!(created.cap.max_send_wr, 8);
    let r = env.hca.create_srq(C3, pd, SrqAttr { max_wr: 9, max_sge: 1, srq_limit: 0 });
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))));
    assert_eq!(env.hca.usage(OTHER_TENANT), (3, cq_ring(8) + qp_ring_bytes(created.cap)));
    // Beyond the device's own limit it is an invalid argument, not a quota.
    let r = env.hca.create_cq(C1, MAX_CQE + 1);
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "{r:?}");
}

// ---------------------------------------------------------------- contexts

#[test]
fn object_numbers_in_use_are_not_handed_out_again_when_the_counter_wraps() {
    let mut env = Env::new();
    let pd = env.hca.alloc_pd(C1).unwrap();
    let (cq, _) = env.hca.create_cq(C1, 8).unwrap();
    // The counter comes round to the numbers in use.
    env.hca.next_id = pd;
    let pd2 = env.hca.alloc_pd(C1).unwrap();
    assert_ne!(pd2, pd);
    env.hca.next_id = cq;
    let (cq2, _) = env.hca.create_cq(C1, 8).unwrap();
    assert_ne!(cq2, cq);
    env.hca.dealloc_pd(C1, pd2).unwrap();
    assert!(env.hca.own_pd(C1, pd).is_ok(), "the first PD is still there");
}

#[test]
fn close_context_breaks_peers_and_frees_everything() {
    let (mut env, a, b) = Env::pair();
    let pd2 = env.hca.alloc_pd(C1).unwrap();
    let (srq, _) = env.hca.create_srq(C1, pd2, SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 }).unwrap();
    // b waits on an RNR for a send to a, and has more posted behind it.
    env.io.post_send(b.qpn, wr(1, SendOpcode::Send, &[b.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(b.qpn, wr(2, SendOpcode::RdmaWrite, &[b.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_recv(b.qpn, recv(3, &[b.buf.sge(0, 8)]));
    let act = env.run(T0);
    assert!(act.next_timer.is_some());

    let mut t = env.hca.close_context(C1, &mut env.io);
    t.qps.sort();
    t.cqs.sort();
    assert_eq!(t, Teardown { qps: vec![a.qpn], cqs: vec![a.cq], srqs: vec![srq] });
    let rings = cq_ring(64) + qp_ring_bytes(env.hca.query_qp(C2, b.qpn).unwrap().1.cap);
    assert_eq!(env.hca.usage(TENANT), (4, (64 << 10) + rings), "only C2's PD, CQ, QP and MR remain");
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(env.io.events, vec![(C2, AsyncEvent { event_type: AsyncEventType::QpFatal, element: b.qpn })]);
    env.run(T0);
    assert_eq!(
        env.poll(b.cq),
        vec![
            // The WR in flight can never be acknowledged...
            req_cqe(1, WcStatus::RetryExcErr, WcOpcode::Send, b.qpn, 0),
            // ...and the rest is flushed, signaled or not.
            req_cqe(2, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, b.qpn, 0),
            recv_err(3, WcStatus::WrFlushErr, b.qpn),
        ]
    );
    // C1's objects are gone.
    assert!(matches!(env.hca.query_qp(C1, a.qpn), Err(HcaError::NoSuchObject { .. })));
    assert!(matches!(env.hca.alloc_pd(C1), Err(HcaError::NoSuchObject { .. })));
    let t = env.hca.close_context(C2, &mut env.io);
    assert_eq!(t, Teardown { qps: vec![b.qpn], cqs: vec![b.cq], srqs: vec![] });
    assert_eq!(env.hca.usage(TENANT), (0, 0));
    // The context number can be used again.
    env.hca.open_context(C1, TENANT).unwrap();
    assert!(env.hca.open_context(C1, TENANT).is_err());
}

#[test]
fn busy_objects_and_other_contexts_objects() {
    let mut env = Env::new();
    let a = env.end(C1);
    let r = env.hca.dealloc_pd(C1, a.pd);
    assert!(matches!(r, Err(HcaError::Busy(_))), "{r:?}");
    assert_eq!(errno(r), 16);
    let r = env.hca.destroy_cq(C1, a.cq);
    assert!(matches!(r, Err(HcaError::Busy(_))), "{r:?}");
    assert_eq!(errno(r), 16);

    // Another process of the same tenant sees none of it.
    let r = env.hca.dealloc_pd(C2, a.pd);
    assert!(matches!(r, Err(HcaError::NoSuchObject { .. })), "{r:?}");
    assert_eq!(errno(r), 22);
    assert!(matches!(env.hca.destroy_cq(C2, a.cq), Err(HcaError::NoSuchObject { .. })));
    assert!(matches!(env.hca.destroy_qp(C2, a.qpn, &mut env.io), Err(HcaError::NoSuchObject { .. })));
    assert!(matches!(env.hca.query_qp(C3, a.qpn), Err(HcaError::NoSuchObject { .. })));
    assert!(matches!(env.hca.dereg_mr(C2, a.buf.key), Err(HcaError::NoSuchObject { .. })));
    let r = env.hca.reg_mr(C2, a.pd, 0x9000_0000, FULL, Region::heap(8));
    assert!(matches!(r, Err(HcaError::NoSuchObject { .. })));
    let (cq2, _) = env.hca.create_cq(C2, 4).unwrap();
    let pd2 = env.hca.alloc_pd(C2).unwrap();
    let r = env.hca.create_qp(C2, pd2, qp_init(cq2, a.cq, None));
    assert!(matches!(r, Err(HcaError::NoSuchObject { .. })), "{r:?}");
    assert!(matches!(
        env.hca.create_qp(C2, a.pd, qp_init(cq2, cq2, None)),
        Err(HcaError::NoSuchObject { .. })
    ));

    // In order, everything goes.
    env.hca.destroy_qp(C1, a.qpn, &mut env.io).unwrap();
    env.hca.destroy_cq(C1, a.cq).unwrap();
    assert!(matches!(env.hca.dealloc_pd(C1, a.pd), Err(HcaError::Busy(_))), "the MR still holds it");
    env.hca.dereg_mr(C1, a.buf.key).unwrap();
    env.hca.dealloc_pd(C1, a.pd).unwrap();
    assert_eq!(env.hca.usage(TENANT), (2, cq_ring(4)), "C2's PD and CQ of 4 entries remain");
}

#[test]
fn reg_mr_checks_its_arguments() {
    let mut env = Env::new();
    let pd = env.hca.alloc_pd(C1).unwrap();
    let r = env.hca.reg_mr(C1, pd, 0x1000, AccessFlags::REMOTE_WRITE, Region::heap(8));
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "remote write needs local write: {r:?}");
    let r = env.hca.reg_mr(C1, pd, 0x1000, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND, Region::heap(8));
    assert!(matches!(r, Err(HcaError::Unsupported(_))), "{r:?}");
    let r = env.hca.reg_mr(C1, pd, u64::MAX - 3, AccessFlags::LOCAL_WRITE, Region::heap(8));
    assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "{r:?}");
    assert_eq!(env.hca.usage(TENANT), (1, 0));
    let k1 = env.hca.reg_mr(C1, pd, 0x1000, AccessFlags::empty(), Region::heap(8)).unwrap();
    let k2 = env.hca.reg_mr(C1, pd, 0x1000, AccessFlags::empty(), Region::heap(8)).unwrap();
    assert_ne!(k1, k2, "keys are unique");
}

// ---------------------------------------------------------------- loopback

#[test]
fn loopback_qp_writes_and_sends_to_itself() {
    let mut env = Env::new();
    let a = env.end(C1);
    env.connect(a.qpn, a.qpn);
    a.buf.write(0, b"loopback");
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], a.buf.addr + 100, a.buf.key));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(a.buf.read(100, 8), b"loopback");

    // Overlapping source and destination in one region.
    env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], a.buf.addr + 4, a.buf.key));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(2, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(a.buf.read(0, 12), b"looploopback", "an overlapping copy moves like memmove");

    env.io.post_recv(a.qpn, recv(9, &[a.buf.sge(2000, 16)]));
    env.io.post_send(a.qpn, wr(3, SendOpcode::Send, &[a.buf.sge(100, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(
        env.poll(a.cq),
        vec![recv_cqe(&env, 9, a.qpn, a.qpn, 8), req_cqe(3, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]
    );
    assert_eq!(a.buf.read(2000, 8), b"loopback");
}

// ---------------------------------------------------------------- SQD

#[test]
fn sqd_drains_notifies_and_holds_new_sends() {
    let (mut env, a, b) = Env::pair();
    let sqd = QpAttr { qp_state: QpState::Sqd, en_sqd_async_notify: true, ..QpAttr::default() };
    let mask = QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY;
    assert_eq!(env.modify(a.qpn, &sqd, mask), Ok(QpState::Sqd));
    assert_eq!(env.io.state(a.qpn), Some(QpState::Sqd));
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    env.run(T0);
    assert_eq!(
        env.io.events,
        vec![(C1, AsyncEvent { event_type: AsyncEventType::SqDrained, element: a.qpn })]
    );
    assert!(env.poll(a.cq).is_empty());
    assert_eq!(env.io.send[&a.qpn].len(), 1, "posted in SQD: waits");
    let (attr, _) = env.hca.query_qp(C1, a.qpn).unwrap();
    assert_eq!((attr.qp_state, attr.sq_draining), (QpState::Sqd, false));
    // Reported once.
    env.run(T0);
    assert_eq!(env.io.events.len(), 1);
    // An SQD QP still receives.
    env.io.post_recv(a.qpn, recv(5, &[a.buf.sge(0, 8)]));
    env.io.post_send(b.qpn, wr(6, SendOpcode::Send, &[b.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![recv_cqe(&env, 5, a.qpn, b.qpn, 8)]);

    let rts = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
    assert_eq!(env.modify(a.qpn, &rts, QpAttrMask::STATE), Ok(QpState::Rts));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(env.io.events.len(), 1);
}

#[test]
fn sqd_waits_for_the_wr_in_flight() {
    const LEN: usize = 200 << 10;
    let (mut env, a, b) = Env::pair();
    let src = env.mr(C1, a.pd, LEN, FULL);
    let dst = env.mr(C2, b.pd, LEN, FULL);
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[src.sge(0, LEN as u32)], dst.addr, dst.key));
    env.io.post_send(a.qpn, rdma(2, SendOpcode::RdmaWrite, &[src.sge(0, 8)], dst.addr, dst.key));
    env.step(T0);
    let sqd = QpAttr { qp_state: QpState::Sqd, en_sqd_async_notify: true, ..QpAttr::default() };
    env.modify(a.qpn, &sqd, QpAttrMask::STATE | QpAttrMask::EN_SQD_ASYNC_NOTIFY).unwrap();
    assert!(env.hca.query_qp(C1, a.qpn).unwrap().0.sq_draining);
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::Success, WcOpcode::RdmaWrite, a.qpn, 0)]);
    assert_eq!(
        env.io.events,
        vec![(C1, AsyncEvent { event_type: AsyncEventType::SqDrained, element: a.qpn })]
    );
    assert_eq!(env.io.send[&a.qpn].len(), 1);
    assert!(!env.hca.query_qp(C1, a.qpn).unwrap().0.sq_draining);
}

#[test]
fn receive_with_a_bad_lkey_is_the_responders_protection_error() {
    let (env, a, b, cqe) = failing(Conn::default(), |env, a, b| {
        let mut s = b.buf.sge(0, 64);
        s.lkey = a.buf.key; // another process's region
        env.io.post_recv(b.qpn, recv(90, &[s]));
        wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED)
    });
    let mut env = env;
    assert_eq!(cqe, req_cqe(1, WcStatus::RemOpErr, WcOpcode::Send, a.qpn, 0));
    assert_eq!(env.poll(b.cq), vec![recv_err(90, WcStatus::LocProtErr, b.qpn)]);
    assert_eq!(env.io.state(b.qpn), Some(QpState::Err));
    assert_eq!(env.io.events, vec![(C2, AsyncEvent { event_type: AsyncEventType::QpFatal, element: b.qpn })]);
    assert_eq!(a.buf.read(0, 8), [0; 8]);
}

#[test]
fn peer_in_error_is_a_peer_that_does_not_answer() {
    let (mut env, a, b) = Env::pair();
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    env.modify(b.qpn, &attr, QpAttrMask::STATE).unwrap();
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    let act = env.run(T0);
    let t = timers::ack_timeout(1).unwrap();
    assert_eq!(act.next_timer, Some(T0 + t));
    env.run(T0 + t);
    env.run(T0 + t * 2);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::RdmaWrite, a.qpn, 0)]);
}

// ---------------------------------------------------------------- send queue retirement
//
// Every send WR the core pulls is retired through `Queues::send_retired`
// exactly once, before its completion: `FakeQueues` panics on a WR retired
// twice or a send completion ahead of its retirement, and these tests check
// that nothing pulled is left unretired once the core is done with it.

impl Env {
    /// Send WRs of `qpn` outstanding as the client counts them: posted and
    /// not yet retired (queued + pulled - retired).
    fn outstanding(&self, qpn: u32) -> u32 {
        let (pulled, retired) = self.io.retirement(qpn);
        self.io.send_queued(qpn) as u32 + pulled - retired
    }

    fn assert_all_retired(&self, qpn: u32) {
        let (pulled, retired) = self.io.retirement(qpn);
        assert_eq!(retired, pulled, "QP {qpn}: every pulled WR retired");
        assert_eq!(self.outstanding(qpn), 0, "QP {qpn}: nothing outstanding");
    }
}

#[test]
fn retirement_of_signaled_and_unsignaled_sends() {
    let (mut env, a, b) = Env::pair();
    let flags = [SendFlags::SIGNALED, SendFlags::empty(), SendFlags::empty(), SendFlags::SIGNALED];
    for (i, f) in flags.into_iter().enumerate() {
        env.io.post_recv(b.qpn, recv(10 + i as u64, &[b.buf.sge(0, 64)]));
        env.io.post_send(a.qpn, wr(i as u64, SendOpcode::Send, &[a.buf.sge(0, 8)], f));
    }
    env.io.post_send(a.qpn, rdma(4, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, b.buf.key));
    assert_eq!(env.outstanding(a.qpn), 5);
    env.run(T0);
    assert_eq!(env.poll(a.cq).len(), 3, "only the signaled WRs complete");
    assert_eq!(env.io.retirement(a.qpn), (5, 5), "unsignaled WRs are retired when executed");
    env.assert_all_retired(a.qpn);
    env.assert_all_retired(b.qpn);
}

#[test]
fn a_wr_waiting_on_rnr_stays_outstanding_until_it_completes() {
    let (mut env, a, b) = Env::pair_with(Conn { rnr_retry: 7, min_rnr_timer: 1, ..Conn::default() });
    for i in 0..4 {
        env.io.post_send(a.qpn, wr(i, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    }
    let mut now = T0;
    for _ in 0..5 {
        now = env.run(now).next_timer.expect("waiting on the RNR timer");
        // Pulled and held: still outstanding.
        assert_eq!(env.io.retirement(a.qpn), (1, 0));
        assert_eq!(env.outstanding(a.qpn), 4);
    }
    for i in 0..4 {
        env.io.post_recv(b.qpn, recv(20 + i, &[b.buf.sge(0, 64)]));
    }
    env.run(now);
    assert_eq!(env.poll(b.cq).len(), 4);
    env.assert_all_retired(a.qpn);
}

#[test]
fn retirement_of_a_failed_wr_and_the_flushed_rest() {
    let (mut env, a, b) = Env::pair();
    env.io.post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, 8)], b.buf.addr, 0xbad));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(a.qpn, wr(3, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    let st: Vec<WcStatus> = env.poll(a.cq).iter().map(|c| c.status).collect();
    assert_eq!(st, vec![WcStatus::RemAccessErr, WcStatus::WrFlushErr, WcStatus::WrFlushErr]);
    env.assert_all_retired(a.qpn);
    // Posted in ERR: pulled only to be flushed, and retired.
    env.io.post_send(a.qpn, wr(4, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.poll(a.cq).len(), 1);
    assert_eq!(env.io.retirement(a.qpn), (4, 4));
    env.assert_all_retired(a.qpn);
}

#[test]
fn retirement_of_the_wr_in_flight_when_the_qp_goes_to_err() {
    let (mut env, a, _) = Env::pair_with(Conn { rnr_retry: 7, ..Conn::default() });
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(a.qpn, wr(2, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.io.retirement(a.qpn), (1, 0));
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    env.modify(a.qpn, &attr, QpAttrMask::STATE).unwrap();
    env.run(T0);
    assert_eq!(env.poll(a.cq).len(), 2);
    env.assert_all_retired(a.qpn);
}

#[test]
fn retirement_when_the_retry_timer_expires() {
    let mut env = Env::new();
    let a = env.end(C1);
    let b = env.end(C2);
    // b never reaches RTR: a's WR times out after its retries.
    env.connect_with(a.qpn, b.qpn, Conn { timeout: 1, retry_cnt: 1, ..Conn::default() });
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    let act = env.run(T0);
    assert_eq!(env.io.retirement(a.qpn), (1, 0));
    env.run(act.next_timer.unwrap());
    let t = timers::ack_timeout(1).unwrap();
    env.run(T0 + t * 2);
    assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::RetryExcErr, WcOpcode::Send, a.qpn, 0)]);
    env.assert_all_retired(a.qpn);
}

#[test]
fn reset_retires_the_wr_in_flight_and_counting_starts_again() {
    let (mut env, a, b) = Env::pair_with(Conn { rnr_retry: 7, ..Conn::default() });
    for i in 0..3 {
        env.io.post_send(a.qpn, wr(i, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    }
    env.run(T0);
    assert_eq!(env.io.retirement(a.qpn), (1, 0));
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    env.modify(a.qpn, &attr, QpAttrMask::STATE).unwrap();
    // The held WR is retired (no completion); the two never pulled were
    // discarded with the ring, which the driver counts itself.
    assert_eq!(env.io.retirement(a.qpn), (1, 1));
    assert_eq!(env.io.send_queued(a.qpn), 0);
    assert!(env.poll(a.cq).is_empty());
    env.connect_with(a.qpn, b.qpn, Conn { rnr_retry: 7, ..Conn::default() });
    env.io.post_recv(b.qpn, recv(9, &[b.buf.sge(0, 64)]));
    env.io.post_send(a.qpn, wr(5, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.run(T0);
    assert_eq!(env.poll(a.cq), vec![req_cqe(5, WcStatus::Success, WcOpcode::Send, a.qpn, 0)]);
    env.assert_all_retired(a.qpn);
}

#[test]
fn destroy_and_a_lost_peer_retire_what_was_held() {
    let (mut env, a, b) = Env::pair_with(Conn { rnr_retry: 7, ..Conn::default() });
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(b.qpn, wr(2, SendOpcode::Send, &[b.buf.sge(0, 8)], SendFlags::empty()));
    env.io.post_send(b.qpn, wr(3, SendOpcode::Send, &[b.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.io.retirement(a.qpn), (1, 0));
    assert_eq!(env.io.retirement(b.qpn), (1, 0));
    // a's context goes away: a is destroyed holding its WR, b loses its
    // peer and its held WR fails, the one behind it is flushed.
    env.hca.close_context(C1, &mut env.io);
    assert_eq!(env.io.retirement(a.qpn), (1, 1));
    env.run(T0);
    env.assert_all_retired(b.qpn);
    let st: Vec<WcStatus> = env.poll(b.cq).iter().map(|c| c.status).collect();
    assert_eq!(st, vec![WcStatus::RetryExcErr, WcStatus::WrFlushErr]);
    // destroy_qp on its own.
    let (mut env, a, _) = Env::pair_with(Conn { rnr_retry: 7, ..Conn::default() });
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    env.run(T0);
    assert_eq!(env.io.retirement(a.qpn), (1, 0));
    env.hca.destroy_qp(C1, a.qpn, &mut env.io).unwrap();
    assert_eq!(env.io.retirement(a.qpn), (1, 1));
}

#[test]
fn sqd_holds_new_sends_outstanding() {
    let (mut env, a, b) = Env::pair();
    let attr = QpAttr { qp_state: QpState::Sqd, ..QpAttr::default() };
    env.modify(a.qpn, &attr, QpAttrMask::STATE).unwrap();
    for i in 0..3 {
        env.io.post_recv(b.qpn, recv(10 + i, &[b.buf.sge(0, 64)]));
        env.io.post_send(a.qpn, wr(i, SendOpcode::Send, &[a.buf.sge(0, 8)], SendFlags::empty()));
    }
    env.run(T0);
    assert_eq!(env.outstanding(a.qpn), 3, "nothing is taken in SQD");
    let rts = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
    assert_eq!(env.modify(a.qpn, &rts, QpAttrMask::STATE), Ok(QpState::Rts));
    env.run(T0);
    env.assert_all_retired(a.qpn);
}

// ---------------------------------------------------------------- UD

mod ud {
    //! Unreliable datagram QPs: address handles, the sender's checks and
    //! its SQE state, and a receiver that drops what it cannot take.

    use super::*;
    use crate::hca::GRH_LEN;
    use crate::ring::UdDest;
    use crate::verbs::{AhAttr, Gid};

    const QKEY: u32 = 0x1111_2222;
    const GRH: u32 = GRH_LEN as u32;

    /// One UD end: a PD, a CQ for both queues, a QP (in RTS with `QKEY`
    /// once [`ud_pair`] made it), a 64 KiB region, and an address handle
    /// of the PD naming this host by LID.
    #[derive(Clone)]
    struct Ud {
        pd: u32,
        cq: u32,
        qpn: u32,
        ah: u32,
        buf: Buf,
    }

    fn ud_init(cq: u32, srq: Option<u32>) -> QpInitAttr {
        QpInitAttr { qp_type: QpType::Ud, ..qp_init(cq, cq, srq) }
    }

    /// An address vector naming this host by LID, on port 1, service level `sl`.
    fn lid_av(env: &Env, sl: u8) -> AhAttr {
        AhAttr { dlid: env.hca.config().port.lid, port_num: 1, sl, ..AhAttr::default() }
    }

    /// An address vector naming this host by GID, with a GRH.
    fn gid_av(env: &Env) -> AhAttr {
        AhAttr {
            dgid: env.hca.config().gids[0],
            sgid_index: 0,
            hop_limit: 64,
            traffic_class: 0x12,
            flow_label: 0x3_4567,
            is_global: true,
            port_num: 1,
            sl: 2,
            ..AhAttr::default()
        }
    }

    impl Env {
        /// A UD end in `ctx`, its QP in RESET.
        fn ud_end(&mut self, ctx: ContextId) -> Ud {
            let pd = self.hca.alloc_pd(ctx).unwrap();
            let (cq, _) = self.hca.create_cq(ctx, 64).unwrap();
            let qpn = self.qp(ctx, pd, ud_init(cq, None));
            let buf = self.mr(ctx, pd, 64 << 10, FULL);
            let ah = self.hca.create_ah(ctx, pd, lid_av(self, 0)).unwrap();
            Ud { pd, cq, qpn, ah, buf }
        }

        /// RESET -> INIT (with `qkey`) -> RTR -> RTS.
        fn ud_up(&mut self, qpn: u32, qkey: u32) {
            let attr = QpAttr { qp_state: QpState::Init, port_num: 1, qkey, ..QpAttr::default() };
            let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY;
            assert_eq!(self.modify(qpn, &attr, mask), Ok(QpState::Init));
            self.ud_rtr(qpn);
            let attr = QpAttr { qp_state: QpState::Rts, sq_psn: 0x42, ..QpAttr::default() };
            assert_eq!(self.modify(qpn, &attr, QpAttrMask::STATE | QpAttrMask::SQ_PSN), Ok(QpState::Rts));
        }

        fn ud_rtr(&mut self, qpn: u32) {
            let attr = QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() };
            assert_eq!(self.modify(qpn, &attr, QpAttrMask::STATE), Ok(QpState::Rtr));
        }

        /// SQE -> RTS.
        fn recover(&mut self, qpn: u32) {
            let attr = QpAttr { qp_state: QpState::Rts, ..QpAttr::default() };
            assert_eq!(self.modify(qpn, &attr, QpAttrMask::STATE), Ok(QpState::Rts));
        }

        fn ud_state(&mut self, qpn: u32) -> QpState {
            let ctx = self.owner[&qpn];
            let state = self.hca.query_qp(ctx, qpn).unwrap().0.qp_state;
            // What the owner sees agrees with the device.
            assert_eq!(self.io.state(qpn).unwrap_or(QpState::Reset), state);
            state
        }
    }

    /// Two UD QPs in two processes of one tenant, both in RTS with `QKEY`.
    fn ud_pair() -> (Env, Ud, Ud) {
        let mut env = Env::new();
        let a = env.ud_end(C1);
        let b = env.ud_end(C2);
        env.ud_up(a.qpn, QKEY);
        env.ud_up(b.qpn, QKEY);
        (env, a, b)
    }

    /// A signalled datagram send.
    fn ud_wr(wr_id: u64, sges: &[Sge], ah: u32, remote_qpn: u32, remote_qkey: u32) -> SendWr {
        let mut w = wr(wr_id, SendOpcode::Send, sges, SendFlags::SIGNALED);
        w.ud = UdDest { remote_qpn, remote_qkey, ah };
        w
    }

    /// The receiver's completion of a datagram of `len` bytes.
    fn ud_recv_cqe(env: &Env, wr_id: u64, qpn: u32, src_qp: u32, len: u32) -> Cqe {
        recv_cqe(env, wr_id, qpn, src_qp, GRH + len)
    }

    fn sent(wr_id: u64, qpn: u32) -> Cqe {
        req_cqe(wr_id, WcStatus::Success, WcOpcode::Send, qpn, 0)
    }

    /// `b` posts a receive of `len` bytes at offset 0 of its region,
    /// filled with 0xee first so that untouched bytes show.
    fn post_marked_recv(env: &mut Env, b: &Ud, wr_id: u64, len: u32) {
        b.buf.write(0, &vec![0xee; len as usize]);
        env.io.post_recv(b.qpn, recv(wr_id, &[b.buf.sge(0, len)]));
    }

    // ---- address handles

    #[test]
    fn address_handles_belong_to_a_pd_and_count_in_the_quota() {
        let mut env = Env::new();
        let pd = env.hca.alloc_pd(C1).unwrap();
        assert_eq!(env.hca.usage(TENANT), (1, 0));
        let av = lid_av(&env, 0);
        let ah = env.hca.create_ah(C1, pd, av).unwrap();
        assert_ne!(ah, 0);
        assert_eq!(env.hca.usage(TENANT), (2, 0));
        // The PD is in use while the AH lives.
        assert!(matches!(env.hca.dealloc_pd(C1, pd), Err(HcaError::Busy(_))));
        // Another process (even of the same tenant) neither uses the PD
        // nor destroys the AH.
        assert_eq!(errno(env.hca.create_ah(C2, pd, av)), 22);
        assert_eq!(errno(env.hca.destroy_ah(C2, ah)), 22);
        assert_eq!(errno(env.hca.create_ah(C1, 0xdead, av)), 22);
        env.hca.destroy_ah(C1, ah).unwrap();
        assert_eq!(errno(env.hca.destroy_ah(C1, ah)), 22, "destroyed once");
        assert_eq!(env.hca.usage(TENANT), (1, 0));
        env.hca.dealloc_pd(C1, pd).unwrap();
        assert_eq!(env.hca.usage(TENANT), (0, 0));

        // Each AH is an object of the tenant's quota.
        env.hca.set_quota(OTHER_TENANT, Quota { max_objects: 2, ..Quota::default() });
        let pd = env.hca.alloc_pd(C3).unwrap();
        let ah = env.hca.create_ah(C3, pd, av).unwrap();
        let r = env.hca.create_ah(C3, pd, av);
        assert!(matches!(r, Err(HcaError::QuotaExceeded(_))), "{r:?}");
        assert_eq!(env.hca.usage(OTHER_TENANT), (2, 0), "a refused AH charges nothing");
        env.hca.destroy_ah(C3, ah).unwrap();
        env.hca.create_ah(C3, pd, av).unwrap();
    }

    #[test]
    fn address_handle_arguments_are_checked() {
        let mut env = Env::new();
        let pd = env.hca.alloc_pd(C1).unwrap();
        let good = lid_av(&env, 0);
        for port in [0, 2] {
            let r = env.hca.create_ah(C1, pd, AhAttr { port_num: port, ..good });
            assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "port {port}: {r:?}");
        }
        // One GID in the table: sgid_index 1 names nothing (only with a GRH).
        let r = env.hca.create_ah(C1, pd, AhAttr { sgid_index: 1, ..gid_av(&env) });
        assert!(matches!(r, Err(HcaError::InvalidArgument(_))), "{r:?}");
        env.hca.create_ah(C1, pd, AhAttr { sgid_index: 1, ..good }).unwrap();
        // Multicast is not supported, by LID or by GID.
        for dlid in [0xc000, 0xc001, 0xfffe] {
            let r = env.hca.create_ah(C1, pd, AhAttr { dlid, ..good });
            assert!(matches!(r, Err(HcaError::Unsupported(_))), "{dlid:#x}: {r:?}");
            assert_eq!(errno(r), 95);
        }
        let mut mgid = [0u8; 16];
        mgid[0] = 0xff;
        mgid[15] = 1;
        let r = env.hca.create_ah(C1, pd, AhAttr { dgid: Gid(mgid), ..gid_av(&env) });
        assert!(matches!(r, Err(HcaError::Unsupported(_))), "{r:?}");
        // A destination elsewhere is fine: datagrams to it are just lost.
        env.hca.create_ah(C1, pd, AhAttr { dlid: 0x99, ..good }).unwrap();
        env.hca.create_ah(C1, pd, AhAttr { dgid: Gid::from_ipv4([10, 9, 9, 9]), ..gid_av(&env) }).unwrap();
        // The permissive LID is not multicast.
        env.hca.create_ah(C1, pd, AhAttr { dlid: 0xffff, ..good }).unwrap();
        assert_eq!(env.hca.usage(TENANT), (5, 0));
    }

    #[test]
    fn closing_a_context_destroys_its_address_handles() {
        let mut env = Env::new();
        let pd = env.hca.alloc_pd(C3).unwrap();
        for _ in 0..3 {
            env.hca.create_ah(C3, pd, lid_av(&env, 0)).unwrap();
        }
        assert_eq!(env.hca.usage(OTHER_TENANT), (4, 0));
        let t = env.hca.close_context(C3, &mut env.io);
        assert_eq!(t, Teardown::default());
        assert_eq!(env.hca.usage(OTHER_TENANT), (0, 0));
    }

    // ---- creation and the state machine

    #[test]
    fn ud_qps_are_created_and_uc_is_refused() {
        let mut env = Env::new();
        let pd = env.hca.alloc_pd(C1).unwrap();
        let (cq, _) = env.hca.create_cq(C1, 16).unwrap();
        let uc = QpInitAttr { qp_type: QpType::Uc, ..qp_init(cq, cq, None) };
        let e = env.hca.create_qp(C1, pd, uc).unwrap_err();
        assert!(matches!(e, HcaError::Unsupported(_)), "{e:?}");
        assert_eq!(e.errno(), 95);
        assert!(e.to_string().contains("UC"), "{e}");
        assert_eq!(env.hca.usage(TENANT), (2, cq_ring(16)), "the refusal charged nothing");

        let qpn = env.qp(C1, pd, ud_init(cq, None));
        let (attr, init) = env.hca.query_qp(C1, qpn).unwrap();
        assert_eq!((attr.qp_state, init.qp_type), (QpState::Reset, QpType::Ud));

        // RESET -> INIT takes a Q_Key and no access flags.
        let to_init = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: QKEY, ..QpAttr::default() };
        let base = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT;
        assert!(matches!(env.modify(qpn, &to_init, base), Err(HcaError::Modify(_))));
        let r = env.modify(qpn, &to_init, base | QpAttrMask::QKEY | QpAttrMask::ACCESS_FLAGS);
        assert!(matches!(r, Err(HcaError::Modify(_))));
        // An RC-style bring-up is refused too.
        assert!(matches!(
            env.modify(qpn, &to_init, base | QpAttrMask::ACCESS_FLAGS),
            Err(HcaError::Modify(_))
        ));
        env.ud_up(qpn, QKEY);
        let (attr, _) = env.hca.query_qp(C1, qpn).unwrap();
        assert_eq!((attr.qp_state, attr.qkey, attr.sq_psn), (QpState::Rts, QKEY, 0x42));
        // The Q_Key can change in RTS.
        let a = QpAttr { qkey: 7, ..QpAttr::default() };
        assert_eq!(env.modify(qpn, &a, QpAttrMask::QKEY), Ok(QpState::Rts));
        assert_eq!(env.hca.query_qp(C1, qpn).unwrap().0.qkey, 7);
        // SQE is entered by errors only.
        let a = QpAttr { qp_state: QpState::Sqe, ..QpAttr::default() };
        assert!(matches!(env.modify(qpn, &a, QpAttrMask::STATE), Err(HcaError::Modify(_))));
    }

    // ---- sending

    #[test]
    fn send_and_send_with_imm_land_after_the_grh_area() {
        let (mut env, a, b) = ud_pair();
        let ah = env.hca.create_ah(C1, a.pd, lid_av(&env, 5)).unwrap();
        let msg = pattern(100, 3);
        a.buf.write(0, &msg);
        post_marked_recv(&mut env, &b, 70, GRH + 100);
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 100)], ah, b.qpn, QKEY));
        env.run(T0);
        let mut want = ud_recv_cqe(&env, 70, b.qpn, a.qpn, 100);
        want.sl = 5;
        assert_eq!(env.poll(b.cq), vec![want]);
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)]);
        // No GRH: the first 40 bytes are left as they were.
        assert_eq!(b.buf.read(0, GRH_LEN), vec![0xee; GRH_LEN]);
        assert_eq!(b.buf.read(GRH_LEN, 100), msg);

        // With immediate data, solicited.
        post_marked_recv(&mut env, &b, 71, 200);
        let mut w = ud_wr(2, &[a.buf.sge(10, 20)], ah, b.qpn, QKEY);
        w.opcode = SendOpcode::SendWithImm;
        w.imm_data = 0xfeed_f00d;
        w.flags |= SendFlags::SOLICITED;
        env.io.post_send(a.qpn, w);
        env.run(T0);
        let mut want = ud_recv_cqe(&env, 71, b.qpn, a.qpn, 20);
        want.sl = 5;
        want.wc_flags = WcFlags::WITH_IMM;
        want.imm_data = 0xfeed_f00d;
        want.solicited = true;
        assert_eq!(env.poll(b.cq), vec![want]);
        assert_eq!(env.poll(a.cq), vec![sent(2, a.qpn)]);
        assert_eq!(b.buf.read(GRH_LEN, 20), msg[10..30]);
        assert_eq!(b.buf.read(GRH_LEN + 20, 1), [0xee], "nothing past the message");
        assert!(env.io.events.is_empty());
        assert_eq!((env.ud_state(a.qpn), env.ud_state(b.qpn)), (QpState::Rts, QpState::Rts));
    }

    #[test]
    fn a_global_address_handle_fills_the_grh() {
        let (mut env, a, b) = ud_pair();
        let av = gid_av(&env);
        let ah = env.hca.create_ah(C1, a.pd, av).unwrap();
        a.buf.write(0, b"hello, datagram");
        for (i, imm) in [(0u64, false), (1, true)] {
            post_marked_recv(&mut env, &b, 80 + i, 128);
            let mut w = ud_wr(i, &[a.buf.sge(0, 15)], ah, b.qpn, QKEY);
            if imm {
                w = SendWr { opcode: SendOpcode::SendWithImm, imm_data: 9, ..w };
            }
            env.io.post_send(a.qpn, w);
            env.run(T0);
            let mut want = ud_recv_cqe(&env, 80 + i, b.qpn, a.qpn, 15);
            want.sl = 2;
            want.wc_flags = WcFlags::GRH;
            if imm {
                want.wc_flags |= WcFlags::WITH_IMM;
                want.imm_data = 9;
            }
            assert_eq!(env.poll(b.cq), vec![want]);
            assert_eq!(env.poll(a.cq), vec![sent(i, a.qpn)]);
            let g = b.buf.read(0, GRH_LEN);
            // IP version 6, traffic class 0x12, flow label 0x34567.
            assert_eq!(u32::from_be_bytes(g[0..4].try_into().unwrap()), 0x6123_4567);
            // Payload length: BTH 12 + DETH 8 (+ ImmDt 4) + 16 (15 padded) + ICRC 4.
            let pay_len = u16::from_be_bytes([g[4], g[5]]);
            assert_eq!(pay_len, if imm { 44 } else { 40 });
            assert_eq!((g[6], g[7]), (0x1b, 64), "next header IBA transport, hop limit");
            let host = env.hca.config().gids[0].0;
            assert_eq!(g[8..24], host, "SGID");
            assert_eq!(g[24..40], av.dgid.0, "DGID");
            assert_eq!(b.buf.read(GRH_LEN, 15), b"hello, datagram");
        }
    }

    #[test]
    fn grh_and_payload_scatter_across_receive_sges() {
        let (mut env, a, b) = ud_pair();
        let ah = env.hca.create_ah(C1, a.pd, gid_av(&env)).unwrap();
        let msg = pattern(300, 9);
        a.buf.write(0, &msg[..100]);
        a.buf.write(1000, &msg[100..]);
        b.buf.write(0, &[0xee; 4096]);
        // 16 + 30 bytes: the GRH ends 6 bytes into the second SGE.
        let sges = [b.buf.sge(0, 16), b.buf.sge(100, 30), b.buf.sge(1000, 0), b.buf.sge(2000, 400)];
        env.io.post_recv(b.qpn, recv(5, &sges));
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 100), a.buf.sge(1000, 200)], ah, b.qpn, QKEY));
        env.run(T0);
        let got = env.poll(b.cq);
        assert_eq!((got.len(), got[0].status, got[0].byte_len), (1, WcStatus::Success, GRH + 300));
        let mut grh = b.buf.read(0, 16);
        grh.extend(b.buf.read(100, 24));
        assert_eq!(grh[0] >> 4, 6);
        assert_eq!(grh[24..40], env.hca.config().gids[0].0);
        let mut payload = b.buf.read(124, 6);
        payload.extend(b.buf.read(2000, 294));
        assert_eq!(payload, msg);
        assert_eq!(b.buf.read(2294, 1), [0xee]);
    }

    #[test]
    fn inline_datagram() {
        let (mut env, a, b) = ud_pair();
        post_marked_recv(&mut env, &b, 1, 64);
        let mut w = ud_wr(3, &[], a.ah, b.qpn, QKEY);
        w.flags |= SendFlags::INLINE;
        w.inline_len = 5;
        w.inline[..5].copy_from_slice(b"small");
        env.io.post_send(a.qpn, w.clone());
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 1, b.qpn, a.qpn, 5)]);
        assert_eq!(env.poll(a.cq), vec![sent(3, a.qpn)]);
        assert_eq!(b.buf.read(GRH_LEN, 5), b"small");
        // Longer than the QP's max_inline_data (64): a local length error.
        w.inline_len = 65;
        env.io.post_send(a.qpn, w);
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![req_cqe(3, WcStatus::LocLenErr, WcOpcode::Send, a.qpn, 0)]);
        assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
    }

    #[test]
    fn unsignaled_datagrams_complete_only_at_the_receiver_unless_sq_sig_all() {
        let mut env = Env::new();
        let a = env.ud_end(C1);
        let b = env.ud_end(C2);
        let pd = a.pd;
        let all = env.qp(C1, pd, QpInitAttr { sq_sig_all: true, ..ud_init(a.cq, None) });
        for q in [a.qpn, b.qpn, all] {
            env.ud_up(q, QKEY);
        }
        for i in 0..2 {
            env.io.post_recv(b.qpn, recv(i, &[b.buf.sge(i * 100, 100)]));
        }
        let mut w = ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY);
        w.flags = SendFlags::empty();
        env.io.post_send(a.qpn, w.clone());
        env.io.post_send(all, w);
        env.run(T0);
        assert_eq!(env.poll(b.cq).len(), 2);
        assert_eq!(env.poll(a.cq), vec![sent(1, all)]);
    }

    #[test]
    fn one_qp_sends_to_many_and_to_itself() {
        let mut env = Env::new();
        let a = env.ud_end(C1);
        let b = env.ud_end(C2);
        let c = env.ud_end(C2);
        for q in [a.qpn, b.qpn, c.qpn] {
            env.ud_up(q, QKEY);
        }
        a.buf.write(0, b"abc");
        for (i, r) in [&a, &b, &c].into_iter().enumerate() {
            env.io.post_recv(r.qpn, recv(10 + i as u64, &[r.buf.sge(4096, 64)]));
            env.io.post_send(a.qpn, ud_wr(i as u64, &[a.buf.sge(0, 3)], a.ah, r.qpn, QKEY));
        }
        env.run(T0);
        // a's CQ holds its own receive (loopback) and its three sends.
        let got = env.poll(a.cq);
        assert_eq!(
            got,
            vec![ud_recv_cqe(&env, 10, a.qpn, a.qpn, 3), sent(0, a.qpn), sent(1, a.qpn), sent(2, a.qpn)]
        );
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 11, b.qpn, a.qpn, 3)]);
        assert_eq!(env.poll(c.cq), vec![ud_recv_cqe(&env, 12, c.qpn, a.qpn, 3)]);
        for r in [&a, &b, &c] {
            assert_eq!(r.buf.read(4096 + GRH_LEN, 3), b"abc");
        }
    }

    #[test]
    fn receives_come_from_an_srq() {
        let mut env = Env::new();
        let a = env.ud_end(C1);
        let pd = env.hca.alloc_pd(C2).unwrap();
        let (cq, _) = env.hca.create_cq(C2, 16).unwrap();
        let (srq, _) = env.hca.create_srq(C2, pd, SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 2 }).unwrap();
        let b1 = env.qp(C2, pd, ud_init(cq, Some(srq)));
        let b2 = env.qp(C2, pd, ud_init(cq, Some(srq)));
        let buf = env.mr(C2, pd, 4096, FULL);
        for q in [a.qpn, b1, b2] {
            env.ud_up(q, QKEY);
        }
        for i in 0..3u64 {
            env.io.post_srq(srq, recv(i, &[buf.sge(i * 100, 100)]));
        }
        a.buf.write(0, b"xy");
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 2)], a.ah, b1, QKEY));
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 2)], a.ah, b2, QKEY));
        env.run(T0);
        assert_eq!(
            env.poll(cq),
            vec![ud_recv_cqe(&env, 0, b1, a.qpn, 2), ud_recv_cqe(&env, 1, b2, a.qpn, 2)]
        );
        assert_eq!(buf.read(100 + GRH_LEN, 2), b"xy");
        assert_eq!(
            env.io.events,
            vec![(C2, AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: srq })]
        );
    }

    // ---- the sender's errors: SQE

    #[test]
    fn only_sends_run_on_a_ud_qp() {
        let (mut env, a, b) = ud_pair();
        let ops = [
            SendOpcode::RdmaWrite,
            SendOpcode::RdmaWriteWithImm,
            SendOpcode::RdmaRead,
            SendOpcode::AtomicCmpAndSwp,
            SendOpcode::AtomicFetchAndAdd,
        ];
        for (i, op) in ops.into_iter().enumerate() {
            env.io.post_recv(b.qpn, recv(50, &[b.buf.sge(0, 128)]));
            let mut w = ud_wr(i as u64, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY);
            w.opcode = op;
            w.remote_addr = b.buf.addr;
            w.rkey = b.buf.key;
            env.io.post_send(a.qpn, w);
            env.run(T0);
            assert_eq!(
                env.poll(a.cq),
                vec![req_cqe(i as u64, WcStatus::LocQpOpErr, op.wc_opcode(), a.qpn, 0)],
                "{op:?}"
            );
            // SQE, not ERR: no async event, the receiver untouched.
            assert_eq!(env.ud_state(a.qpn), QpState::Sqe, "{op:?}");
            assert!(env.io.events.is_empty());
            assert!(env.poll(b.cq).is_empty());
            env.recover(a.qpn);
        }
        assert_eq!(b.buf.read(0, 8), [0; 8]);
    }

    #[test]
    fn sqe_flushes_sends_keeps_receiving_and_recovers_to_rts() {
        let (mut env, a, b) = ud_pair();
        let mut bad = ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY);
        bad.opcode = SendOpcode::RdmaWrite;
        env.io.post_send(a.qpn, bad);
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.io.post_send(a.qpn, ud_wr(3, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.io.post_recv(b.qpn, recv(60, &[b.buf.sge(0, 128)]));
        env.run(T0);
        assert_eq!(
            env.poll(a.cq),
            vec![
                req_cqe(1, WcStatus::LocQpOpErr, WcOpcode::RdmaWrite, a.qpn, 0),
                req_cqe(2, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0),
                req_cqe(3, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0),
            ]
        );
        assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
        assert!(env.poll(b.cq).is_empty(), "flushed sends never left");
        // Posting in SQE is allowed; the send flushes.
        env.io.post_send(a.qpn, ud_wr(4, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![req_cqe(4, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0)]);

        // The receive queue of a QP in SQE keeps working.
        b.buf.write(0, b"to a");
        env.io.post_recv(a.qpn, recv(61, &[a.buf.sge(1024, 128)]));
        env.io.post_send(b.qpn, ud_wr(5, &[b.buf.sge(0, 4)], b.ah, a.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![ud_recv_cqe(&env, 61, a.qpn, b.qpn, 4)]);
        assert_eq!(env.poll(b.cq), vec![sent(5, b.qpn)]);
        assert_eq!(a.buf.read(1024 + GRH_LEN, 4), b"to a");

        // SQE -> RTS (which may change the Q_Key): sends work again.
        let attr = QpAttr { qp_state: QpState::Rts, cur_qp_state: QpState::Sqe, ..QpAttr::default() };
        let r = env.modify(a.qpn, &attr, QpAttrMask::STATE | QpAttrMask::CUR_STATE | QpAttrMask::QKEY);
        assert_eq!(r, Ok(QpState::Rts));
        assert_eq!(env.ud_state(a.qpn), QpState::Rts);
        a.buf.write(0, b"again");
        env.io.post_send(a.qpn, ud_wr(6, &[a.buf.sge(0, 5)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(6, a.qpn)]);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 60, b.qpn, a.qpn, 5)]);
        assert_eq!(b.buf.read(GRH_LEN, 5), b"again");
        assert!(env.io.events.is_empty());
    }

    #[test]
    fn the_address_handle_must_be_one_of_the_qps_pd() {
        let (mut env, a, b) = ud_pair();
        let other_pd = env.hca.alloc_pd(C1).unwrap();
        let other_pd_ah = env.hca.create_ah(C1, other_pd, lid_av(&env, 0)).unwrap();
        let gone = env.hca.create_ah(C1, a.pd, lid_av(&env, 0)).unwrap();
        env.hca.destroy_ah(C1, gone).unwrap();
        // 0 (none), another PD's, another process's (b's), a destroyed one,
        // a number that is not an AH at all (a's CQ).
        for (i, ah) in [0, other_pd_ah, b.ah, gone, a.cq].into_iter().enumerate() {
            env.io.post_recv(b.qpn, recv(70, &[b.buf.sge(0, 128)]));
            env.io.post_send(a.qpn, ud_wr(i as u64, &[a.buf.sge(0, 8)], ah, b.qpn, QKEY));
            env.run(T0);
            assert_eq!(
                env.poll(a.cq),
                vec![req_cqe(i as u64, WcStatus::LocQpOpErr, WcOpcode::Send, a.qpn, 0)],
                "AH {ah:#x}"
            );
            assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
            assert!(env.poll(b.cq).is_empty());
            env.recover(a.qpn);
        }
        // An AH destroyed while a send naming it waits.
        let ah = env.hca.create_ah(C1, a.pd, lid_av(&env, 0)).unwrap();
        env.io.post_send(a.qpn, ud_wr(9, &[a.buf.sge(0, 8)], ah, b.qpn, QKEY));
        env.hca.destroy_ah(C1, ah).unwrap();
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![req_cqe(9, WcStatus::LocQpOpErr, WcOpcode::Send, a.qpn, 0)]);
    }

    #[test]
    fn a_datagram_is_at_most_one_mtu() {
        let (mut env, a, b) = ud_pair();
        assert_eq!(env.hca.config().port.active_mtu.bytes(), 4096);
        let msg = pattern(4097, 1);
        a.buf.write(0, &msg);
        env.io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, GRH + 8192)]));
        // One byte over, even split over two SGEs: a local length error.
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 4000), a.buf.sge(4000, 97)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![req_cqe(1, WcStatus::LocLenErr, WcOpcode::Send, a.qpn, 0)]);
        assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
        assert!(env.poll(b.cq).is_empty());
        assert_eq!(env.io.recv_posted(RecvSource::Qp(b.qpn)), 1, "the receive was not consumed");
        env.recover(a.qpn);
        // Exactly one MTU fits.
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 4096)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(2, a.qpn)]);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 1, b.qpn, a.qpn, 4096)]);
        assert_eq!(b.buf.read(GRH_LEN, 4096), msg[..4096]);
    }

    #[test]
    fn bad_lkeys_and_too_many_sges_are_the_senders_errors() {
        let (mut env, a, b) = ud_pair();
        let cases: [(Vec<Sge>, WcStatus); 3] = [
            // b's region is another process's.
            (vec![b.buf.sge(0, 8)], WcStatus::LocProtErr),
            (vec![a.buf.sge(64 << 10, 1)], WcStatus::LocProtErr),
            (vec![a.buf.sge(0, 1); 5], WcStatus::LocLenErr),
        ];
        for (i, (sges, status)) in cases.into_iter().enumerate() {
            env.io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, 128)]));
            env.io.post_send(a.qpn, ud_wr(i as u64, &sges, a.ah, b.qpn, QKEY));
            env.run(T0);
            assert_eq!(env.poll(a.cq), vec![req_cqe(i as u64, status, WcOpcode::Send, a.qpn, 0)]);
            assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
            assert!(env.poll(b.cq).is_empty());
            env.recover(a.qpn);
        }
        assert_eq!(env.ud_state(b.qpn), QpState::Rts);
    }

    #[test]
    fn an_undecodable_send_moves_a_ud_qp_to_sqe() {
        let (mut env, a, _) = ud_pair();
        env.hca.process(T0, &mut Garbled(&mut env.io, a.qpn, false));
        assert_eq!(env.poll(a.cq), vec![req_cqe(77, WcStatus::LocQpOpErr, WcOpcode::Send, a.qpn, 0)]);
        assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
        assert_eq!(env.io.retirement(a.qpn), (1, 1));
    }

    // ---- what the receiver drops

    #[test]
    fn a_qkey_mismatch_drops_the_datagram_silently() {
        let (mut env, a, b) = ud_pair();
        post_marked_recv(&mut env, &b, 1, 128);
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY + 1));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)], "the sender cannot tell");
        assert!(env.poll(b.cq).is_empty());
        assert_eq!(env.io.recv_posted(RecvSource::Qp(b.qpn)), 1, "the receive is still there");
        assert_eq!(b.buf.read(0, 128), vec![0xee; 128]);

        // The high bit: use the sending QP's own Q_Key, which matches.
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 8)], a.ah, b.qpn, 0x8000_0000));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(2, a.qpn)]);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 1, b.qpn, a.qpn, 8)]);

        // Once the sender's own Q_Key differs, the same WR is dropped...
        let attr = QpAttr { qkey: 0x5555, ..QpAttr::default() };
        env.modify(a.qpn, &attr, QpAttrMask::QKEY).unwrap();
        env.io.post_recv(b.qpn, recv(2, &[b.buf.sge(0, 128)]));
        env.io.post_send(a.qpn, ud_wr(3, &[a.buf.sge(0, 8)], a.ah, b.qpn, 0x8000_0000));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(3, a.qpn)]);
        assert!(env.poll(b.cq).is_empty());
        // ...and the receiver taking that Q_Key makes it match.
        env.modify(b.qpn, &attr, QpAttrMask::QKEY).unwrap();
        env.io.post_send(a.qpn, ud_wr(4, &[a.buf.sge(0, 8)], a.ah, b.qpn, 0x8000_1234));
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 2, b.qpn, a.qpn, 8)]);
        assert_eq!((env.ud_state(a.qpn), env.ud_state(b.qpn)), (QpState::Rts, QpState::Rts));
        assert!(env.io.events.is_empty());
    }

    #[test]
    fn without_a_receive_posted_the_datagram_is_dropped() {
        let (mut env, a, b) = ud_pair();
        a.buf.write(0, b"first");
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 5)], a.ah, b.qpn, QKEY));
        let act = env.run(T0);
        assert_eq!(act.next_timer, None, "no RNR wait: UD does not retry");
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)]);
        assert!(env.poll(b.cq).is_empty());
        // A receive posted later does not get the lost datagram...
        post_marked_recv(&mut env, &b, 7, 64);
        env.run(T0);
        assert!(env.poll(b.cq).is_empty());
        // ...only the next one.
        a.buf.write(0, b"second");
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 6)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 7, b.qpn, a.qpn, 6)]);
        assert_eq!(b.buf.read(GRH_LEN, 6), b"second");
        assert_eq!((env.ud_state(a.qpn), env.ud_state(b.qpn)), (QpState::Rts, QpState::Rts));
    }

    #[test]
    fn datagrams_to_nowhere_are_dropped_and_the_sender_succeeds() {
        let mut env = Env::new();
        let a = env.ud_end(C1);
        env.ud_up(a.qpn, QKEY);
        // Would-be receivers, each with a receive posted.
        let reset = env.ud_end(C2);
        let init = env.ud_end(C2);
        let rtr = env.ud_end(C2);
        let stranger = env.ud_end(C3);
        let rc = env.end(C2);
        let attr = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: QKEY, ..QpAttr::default() };
        let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY;
        env.modify(init.qpn, &attr, mask).unwrap();
        env.modify(rtr.qpn, &attr, mask).unwrap();
        env.ud_rtr(rtr.qpn);
        env.ud_up(stranger.qpn, QKEY);
        env.connect(rc.qpn, a.qpn);
        let errored = env.ud_end(C2);
        env.ud_up(errored.qpn, QKEY);
        env.modify(errored.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
            .unwrap();
        for (q, buf) in [
            (reset.qpn, &reset.buf),
            (init.qpn, &init.buf),
            (rtr.qpn, &rtr.buf),
            (stranger.qpn, &stranger.buf),
            (rc.qpn, &rc.buf),
        ] {
            env.io.post_recv(q, recv(1, &[buf.sge(0, 128)]));
        }
        let elsewhere = env.hca.create_ah(C1, a.pd, AhAttr { dlid: 0x99, ..lid_av(&env, 0) }).unwrap();
        let elsewhere_gid = AhAttr { dgid: Gid::from_ipv4([10, 0, 0, 2]), ..gid_av(&env) };
        let elsewhere_gid = env.hca.create_ah(C1, a.pd, elsewhere_gid).unwrap();
        let targets = [
            (a.ah, 0x77_7777),        // no such QP
            (a.ah, 0xff_ffff),        // the multicast QPN
            (a.ah, reset.qpn),        // not ready to receive
            (a.ah, init.qpn),         //
            (a.ah, errored.qpn),      //
            (a.ah, stranger.qpn),     // another tenant's
            (a.ah, rc.qpn),           // not a UD QP
            (elsewhere, rtr.qpn),     // another host, by LID
            (elsewhere_gid, rtr.qpn), // another host, by GID
        ];
        for (i, (ah, qpn)) in targets.into_iter().enumerate() {
            env.io.post_send(a.qpn, ud_wr(i as u64, &[a.buf.sge(0, 8)], ah, qpn, QKEY));
        }
        env.run(T0);
        // A datagram for another host waits a while for a link to it (the
        // driver dials a GID's host), then is lost; the sender succeeds.
        let local = targets.len() as u64 - 2;
        let want: Vec<Cqe> = (0..local).map(|i| sent(i, a.qpn)).collect();
        assert_eq!(env.poll(a.cq), want);
        let later = T0 + Duration::from_secs(2) + Duration::from_millis(1);
        env.run(later);
        assert_eq!(
            env.hca.take_wanted_peers(),
            vec![Gid::from_ipv4([10, 0, 0, 2])],
            "the GID's host is dialled"
        );
        env.run(later + Duration::from_secs(2) + Duration::from_millis(1));
        let want: Vec<Cqe> = (local..targets.len() as u64).map(|i| sent(i, a.qpn)).collect();
        assert_eq!(env.poll(a.cq), want);
        for cq in [reset.cq, init.cq, rtr.cq, stranger.cq, rc.cq, errored.cq] {
            assert!(env.poll(cq).is_empty());
        }
        assert!(env.io.events.is_empty());
        assert_eq!(env.ud_state(a.qpn), QpState::Rts);
        assert_eq!(env.hca.query_qp(C2, rc.qpn).unwrap().0.qp_state, QpState::Rts);
        // An RTR QP does receive.
        env.io.post_send(a.qpn, ud_wr(20, &[a.buf.sge(0, 8)], a.ah, rtr.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(rtr.cq), vec![ud_recv_cqe(&env, 1, rtr.qpn, a.qpn, 8)]);
    }

    #[test]
    fn a_receive_too_small_fails_the_receiver_not_the_sender() {
        let (mut env, a, b) = ud_pair();
        // Room for the GRH and 99 of 100 bytes.
        post_marked_recv(&mut env, &b, 1, GRH + 99);
        env.io.post_recv(b.qpn, recv(2, &[b.buf.sge(1024, 1024)]));
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 100)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)]);
        assert_eq!(
            env.poll(b.cq),
            vec![recv_err(1, WcStatus::LocLenErr, b.qpn), recv_err(2, WcStatus::WrFlushErr, b.qpn)]
        );
        assert_eq!(env.ud_state(b.qpn), QpState::Err);
        assert_eq!(env.ud_state(a.qpn), QpState::Rts);
        assert_eq!(b.buf.read(0, GRH_LEN + 99), vec![0xee; GRH_LEN + 99], "nothing was written");
        assert!(env.io.events.is_empty());

        // Smaller than the GRH alone, even for an empty datagram.
        let (mut env, a, b) = ud_pair();
        env.io.post_recv(b.qpn, recv(3, &[b.buf.sge(0, 39)]));
        env.io.post_send(a.qpn, ud_wr(2, &[], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(2, a.qpn)]);
        assert_eq!(env.poll(b.cq), vec![recv_err(3, WcStatus::LocLenErr, b.qpn)]);
        assert_eq!(env.ud_state(b.qpn), QpState::Err);
        // An empty datagram fits in exactly 40 bytes.
        let (mut env, a, b) = ud_pair();
        env.io.post_recv(b.qpn, recv(4, &[b.buf.sge(0, 40)]));
        env.io.post_send(a.qpn, ud_wr(3, &[], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 4, b.qpn, a.qpn, 0)]);
    }

    #[test]
    fn a_receive_with_a_bad_lkey_is_the_receivers_protection_error() {
        let (mut env, a, b) = ud_pair();
        let mut s = b.buf.sge(0, 128);
        s.lkey = a.buf.key; // another process's region
        env.io.post_recv(b.qpn, recv(1, &[s]));
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)]);
        assert_eq!(env.poll(b.cq), vec![recv_err(1, WcStatus::LocProtErr, b.qpn)]);
        assert_eq!(env.ud_state(b.qpn), QpState::Err);
        assert_eq!(env.ud_state(a.qpn), QpState::Rts);
    }

    #[test]
    fn a_ud_qp_in_err_flushes_both_queues_and_reset_discards() {
        let (mut env, a, b) = ud_pair();
        env.io.post_recv(a.qpn, recv(1, &[a.buf.sge(0, 64)]));
        env.io.post_send(a.qpn, ud_wr(2, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.modify(a.qpn, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE)
            .unwrap();
        env.run(T0);
        let mut got = env.poll(a.cq);
        got.sort_by_key(|c| c.wr_id);
        assert_eq!(
            got,
            vec![
                recv_err(1, WcStatus::WrFlushErr, a.qpn),
                req_cqe(2, WcStatus::WrFlushErr, WcOpcode::Send, a.qpn, 0)
            ]
        );
        env.modify(a.qpn, &QpAttr::default(), QpAttrMask::STATE).unwrap();
        assert_eq!(env.ud_state(a.qpn), QpState::Reset);
        env.ud_up(a.qpn, QKEY);
        env.io.post_recv(b.qpn, recv(3, &[b.buf.sge(0, 64)]));
        env.io.post_send(a.qpn, ud_wr(4, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(b.cq), vec![ud_recv_cqe(&env, 3, b.qpn, a.qpn, 8)]);
    }

    #[test]
    fn a_receiver_that_goes_away_breaks_no_sender() {
        let (mut env, a, b) = ud_pair();
        env.io.post_recv(b.qpn, recv(1, &[b.buf.sge(0, 64)]));
        let t = env.hca.close_context(C2, &mut env.io);
        assert_eq!(t.qps, vec![b.qpn]);
        env.io.post_send(a.qpn, ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.poll(a.cq), vec![sent(1, a.qpn)]);
        assert_eq!(env.ud_state(a.qpn), QpState::Rts);
        assert!(env.io.events.is_empty(), "no QP fatal: UD has no peer");
        // And a sender that goes away breaks no receiver.
        let (mut env, _, b) = ud_pair();
        env.hca.close_context(C1, &mut env.io);
        assert_eq!(env.ud_state(b.qpn), QpState::Rts);
        assert!(env.io.events.is_empty());
    }

    #[test]
    fn sqe_retires_the_failed_send_and_the_flushed_ones() {
        let (mut env, a, b) = ud_pair();
        let mut bad = ud_wr(1, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY);
        bad.ud.ah = 0xdead;
        env.io.post_send(a.qpn, bad);
        let mut unsignaled = ud_wr(2, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY);
        unsignaled.flags = SendFlags::empty();
        env.io.post_send(a.qpn, unsignaled.clone());
        env.io.post_send(a.qpn, ud_wr(3, &[a.buf.sge(0, 8)], a.ah, b.qpn, QKEY));
        env.run(T0);
        assert_eq!(env.ud_state(a.qpn), QpState::Sqe);
        assert_eq!(env.poll(a.cq).len(), 3, "flushed WRs complete whether signaled or not");
        env.assert_all_retired(a.qpn);
        env.recover(a.qpn);
        env.io.post_send(a.qpn, unsignaled);
        env.run(T0);
        assert_eq!(env.io.retirement(a.qpn), (4, 4), "a datagram to no receive is retired");
        env.assert_all_retired(a.qpn);
    }

    #[test]
    fn a_large_datagram_burst_stays_within_the_chunk_budget() {
        // 16 datagrams of 4 KiB: each engine pass moves at most chunk_bytes
        // (64 KiB) per QP, and the burst still finishes.
        let (mut env, a, b) = ud_pair();
        for i in 0..16u64 {
            env.io.post_recv(b.qpn, recv(i, &[b.buf.sge(0, 4096 + GRH)]));
            env.io.post_send(a.qpn, ud_wr(i, &[a.buf.sge(0, 4096)], a.ah, b.qpn, QKEY));
        }
        env.run(T0);
        assert_eq!(env.poll(a.cq).len(), 16);
        assert_eq!(env.poll(b.cq).len(), 16);
    }
}

/// A tenant with many busy QPs gets `tenant_turns` of them served per
/// pass, not all: another tenant's QP waits for that many turns at most.
/// The QPs it left out go first in the next pass, so each still moves.
#[test]
fn a_tenant_with_many_busy_qps_gets_its_turns_per_pass_not_one_per_qp() {
    let mut env = Env::new();
    let mut config = env.hca.config().clone();
    config.tenant_turns = 2;
    // (Bytes bound the shares of contending tenants too: not here.)
    config.contended_bytes = u64::MAX;
    env.hca = Hca::new(config, Box::new(Counter(1)));
    for (c, t) in [(C1, TENANT), (C2, TENANT), (C3, OTHER_TENANT)] {
        env.hca.open_context(c, t).unwrap();
    }
    let chunk = env.hca.config().chunk_bytes as u32;
    // Tenant 1000: eight QPs, each with two writes of one chunk (one chunk
    // per QP per pass, so each busy turn completes one write).
    let mut many = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..8 {
        let (a, b) = (env.end_with(C1, true), env.end(C2));
        env.connect(a.qpn, b.qpn);
        env.connect(b.qpn, a.qpn);
        many.push(a);
        peers.push(b);
    }
    // Tenant 2000: one QP with one write.
    let (x, y) = (env.end_with(C3, true), env.end(C3));
    env.connect(x.qpn, y.qpn);
    env.connect(y.qpn, x.qpn);
    // Connecting woke every QP; with nothing to do they are left idle
    // before the passes that count. (A turn counts against its tenant's
    // share whether it moved anything or not.)
    env.run(T0);
    for (a, b) in many.iter().zip(&peers) {
        for id in 0..2 {
            env.io.post_send(
                a.qpn,
                rdma(id, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key),
            );
        }
    }
    env.io.post_send(x.qpn, rdma(9, SendOpcode::RdmaWrite, &[x.buf.sge(0, chunk)], y.buf.addr, y.buf.key));
    let done = |env: &mut Env, ends: &[End]| ends.iter().map(|e| env.poll(e.cq).len()).collect::<Vec<_>>();

    assert!(env.step(T0).again());
    let first = done(&mut env, &many);
    assert_eq!(first.iter().sum::<usize>(), 2, "two turns of tenant 1000 in the pass: {first:?}");
    assert_eq!(env.poll(x.cq).len(), 1, "the other tenant's QP was served in the same pass");
    // Pass after pass, the QPs left out come first: all eight move before
    // any moves twice.
    let mut moved = first;
    for _ in 0..3 {
        env.step(T0);
        for (m, d) in moved.iter_mut().zip(done(&mut env, &many)) {
            *m += d;
        }
    }
    assert_eq!(moved, vec![1; 8], "each QP served once in four passes of two turns");
    env.run(T0);
    let rest: usize = done(&mut env, &many).iter().sum();
    assert_eq!(rest, 8, "every write completes");
}

/// Resetting the responder in the middle of a message drops every receive
/// posted to it before the reset, also the one a requester had claimed
/// (ibv_modify_qp(RESET) discards the receive queue); the message starts
/// again and arrives whole in a receive posted after the reset.
#[test]
fn a_responder_reset_mid_send_discards_the_claimed_receive() {
    const LEN: usize = 200 << 10;
    let (mut env, a, b) = Env::pair();
    let src = env.mr(C1, a.pd, LEN, FULL);
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    src.write(0, &pattern);
    let dst = env.mr(C2, b.pd, LEN, FULL);
    env.io.post_recv(b.qpn, recv(8, &[dst.sge(0, LEN as u32)]));
    env.io.post_send(a.qpn, wr(1, SendOpcode::Send, &[src.sge(0, LEN as u32)], SendFlags::SIGNALED));
    env.step(T0);
    assert!(env.poll(b.cq).is_empty(), "200 KiB take more than one pass");
    // The responder's application resets its QP (and so its receive
    // queue), then connects it again and posts a fresh receive.
    let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
    assert_eq!(env.modify(b.qpn, &attr, QpAttrMask::STATE), Ok(QpState::Reset));
    env.connect(b.qpn, a.qpn);
    env.io.post_recv(b.qpn, recv(9, &[dst.sge(0, LEN as u32)]));
    env.run(T0);
    let got = env.poll(b.cq);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status, c.byte_len)).collect::<Vec<_>>(),
        [(9, WcStatus::Success, LEN as u32)],
        "receive 8 was posted before the reset"
    );
    assert_eq!(dst.read(0, LEN), pattern);
    assert_eq!(
        env.poll(a.cq).iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success)]
    );
}

/// Quota::max_queue_depth bounds the depth granted (a power of two), and
/// device_attr advertises the largest depth granted as asked within it: a
/// program that sizes its queues to max_cqe/max_qp_wr/max_srq_wr gets them,
/// and nothing is granted above the quota.
#[test]
fn granted_depths_stay_within_the_queue_depth_quota() {
    let mut hca = new_hca();
    hca.set_quota(TENANT, Quota { max_queue_depth: 1000, ..Quota::default() });
    hca.open_context(C1, TENANT).unwrap();
    let dev = hca.device_attr(C1).unwrap();
    assert_eq!((dev.max_cqe, dev.max_qp_wr, dev.max_srq_wr), (512, 512, 512));
    let pd = hca.alloc_pd(C1).unwrap();
    let (cq, depth) = hca.create_cq(C1, dev.max_cqe).unwrap();
    let (_, srq) =
        hca.create_srq(C1, pd, SrqAttr { max_wr: dev.max_srq_wr, max_sge: 1, srq_limit: 0 }).unwrap();
    let mut init = qp_init(cq, cq, None);
    init.cap.max_send_wr = dev.max_qp_wr;
    init.cap.max_recv_wr = dev.max_qp_wr;
    let qp = hca.create_qp(C1, pd, init).unwrap();
    assert_eq!((depth, srq.max_wr, qp.cap.max_send_wr, qp.cap.max_recv_wr), (512, 512, 512, 512));
    // 1000 would be granted 1024: above the quota.
    assert!(matches!(hca.create_cq(C1, 1000), Err(HcaError::InvalidArgument(_))));
    let mut init = qp_init(cq, cq, None);
    init.cap.max_send_wr = 600;
    assert!(matches!(hca.create_qp(C1, pd, init), Err(HcaError::InvalidArgument(_))));
}

/// A tenant that wakes thousands of idle QPs at once (a flood of notices,
/// an overflowed posted ring, or a sweep) gets its share of each pass in
/// turns that do nothing: no pass gives it more than `IDLE_TURNS` of
/// them, and another tenant's message goes in the first pass.
#[test]
fn thousands_of_qps_woken_at_once_cost_each_pass_one_tenants_share() {
    for by_sweep in [false, true] {
        let mut env = Env::new();
        let turns = crate::hca::IDLE_TURNS as usize;
        let pd = env.hca.alloc_pd(C1).unwrap();
        let (cq, _) = env.hca.create_cq(C1, 64).unwrap();
        let idle: HashSet<u32> = (0..2000)
            .map(|_| {
                let q = env.qp(C1, pd, qp_init(cq, cq, None));
                env.connect(q, q);
                q
            })
            .collect();
        let (x, y) = (env.end_with(C3, true), env.end(C3));
        env.connect(x.qpn, y.qpn);
        env.connect(y.qpn, x.qpn);
        env.run(T0);
        assert!(env.hca.served_qps().is_empty(), "all idle");
        if by_sweep {
            env.hca.sweep();
        } else {
            env.io.posted.extend(idle.iter().copied());
        }
        env.io.post_send(x.qpn, rdma(1, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], y.buf.addr, y.buf.key));
        let mut passes = 0;
        loop {
            env.io.parked.clear();
            let act = env.step(T0);
            passes += 1;
            let visits = env.io.parked.iter().filter(|q| idle.contains(q)).count();
            assert!(visits <= turns, "sweep {by_sweep}: pass {passes} gave the tenant {visits} turns");
            if passes == 1 {
                assert_eq!(env.poll(x.cq).len(), 1, "sweep {by_sweep}: the other tenant waited");
            }
            if !act.again() {
                break;
            }
            assert!(passes < 10_000, "sweep {by_sweep}: never done");
        }
        assert!(passes >= idle.len() / turns, "sweep {by_sweep}: {passes} passes");
        assert!(env.hca.served_qps().is_empty(), "sweep {by_sweep}: all idle again");
    }
}

/// An [`Env`], the chunk size, the streaming tenant's pairs and the other's.
type StreamerAndOther = (Env, u32, Vec<(End, End)>, (End, End));

/// Tenant 1000 with eight connected QP pairs (to stream on), tenant 2000
/// with one pair, all idle, and `contended_bytes` of two chunks; returns
/// the chunk size too.
fn streamer_and_other() -> StreamerAndOther {
    let mut env = Env::new();
    let chunk = env.hca.config().chunk_bytes as u32;
    let mut config = env.hca.config().clone();
    config.contended_bytes = u64::from(chunk) * 2;
    env.hca = Hca::new(config, Box::new(Counter(1)));
    for (c, t) in [(C1, TENANT), (C2, TENANT), (C3, OTHER_TENANT)] {
        env.hca.open_context(c, t).unwrap();
    }
    let mut many = Vec::new();
    for _ in 0..8 {
        let (a, b) = (env.end_with(C1, true), env.end(C2));
        env.connect(a.qpn, b.qpn);
        env.connect(b.qpn, a.qpn);
        many.push((a, b));
    }
    let (x, y) = (env.end_with(C3, true), env.end(C3));
    env.connect(x.qpn, y.qpn);
    env.connect(y.qpn, x.qpn);
    env.run(T0);
    (env, chunk, many, (x, y))
}

/// While another tenant waits, a tenant streaming over many QPs moves at
/// most `contended_bytes` a pass, whatever its turns would allow; alone on
/// the engine it keeps its whole pass.
#[test]
fn a_streaming_tenant_moves_its_byte_share_a_pass_while_another_waits() {
    for contended in [true, false] {
        let (mut env, chunk, many, (x, y)) = streamer_and_other();
        for (a, b) in &many {
            env.io.post_send(
                a.qpn,
                rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key),
            );
        }
        if contended {
            env.io
                .post_send(x.qpn, rdma(9, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], y.buf.addr, y.buf.key));
        }
        let act = env.step(T0);
        assert_eq!(act.contended, contended, "the pass says whether tenants contended");
        let done: usize = many.iter().map(|(a, _)| env.poll(a.cq).len()).sum();
        if contended {
            assert_eq!(done, 2, "two chunks' worth of the streaming tenant");
            assert_eq!(env.poll(x.cq).len(), 1, "the other tenant's message in the same pass");
        } else {
            assert_eq!(done, 8, "alone, every QP's turn");
        }
    }
}

/// A tenant whose only queued QP waits for a timer (an RNR wait) does not
/// contend: a streaming tenant beside it keeps its whole pass.
#[test]
fn a_tenant_waiting_on_a_timer_does_not_cut_anothers_share() {
    let (mut env, chunk, many, (x, _no_receive)) = streamer_and_other();
    // No receive at y: x's send waits for y's RNR timer.
    env.io.post_send(x.qpn, wr(1, SendOpcode::Send, &[x.buf.sge(0, 8)], SendFlags::SIGNALED));
    env.step(T0);
    // A pass whose turn found only the timer: the tenant is quiet now.
    let act = env.step(T0);
    assert!(act.next_timer.is_some() && !act.busy, "the send waits for a timer");
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    let act = env.step(T0);
    assert!(!act.contended, "a tenant that only waits does not contend");
    let done: usize = many.iter().map(|(a, _)| env.poll(a.cq).len()).sum();
    assert_eq!(done, 8, "every QP's turn");
}

/// A tenant limited to 1000 messages a second with a burst of 2 starts two
/// of its eight posted writes, then is passed over: the pass reports no
/// work and a timer at its bucket's refill (so the engine sleeps instead of
/// spinning), and at that time the next write starts. Weighted, the
/// streaming tenant beside another moves its weight's worth of bytes.
#[test]
fn a_rate_limited_tenant_is_passed_over_until_its_bucket_refills() {
    let (mut env, chunk, many, _) = streamer_and_other();
    let qos = Qos { messages_per_s: Some(1000), burst_messages: Some(2), ..Qos::default() };
    env.hca.set_qos(TENANT, qos).unwrap();
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    env.step(T0);
    let done: usize = many.iter().map(|(a, _)| env.poll(a.cq).len()).sum();
    assert_eq!(done, 2, "the burst");
    let act = env.step(T0);
    assert!(!act.again(), "nothing to do before the refill: {act:?}");
    let refill = T0 + std::time::Duration::from_millis(1);
    assert_eq!(act.next_timer, Some(refill), "one message's worth at 1000/s");
    env.step(refill);
    let done: usize = many.iter().map(|(a, _)| env.poll(a.cq).len()).sum();
    assert_eq!(done, 1, "one more a millisecond");
    assert!(env.hca.set_qos(TENANT, Qos { weight: 0, ..Qos::default() }).is_err());
}

/// A tenant limited to 200 MB/s keeps eight QPs' send queues full of
/// 64 KiB writes for a second of simulated time, each pass taking a
/// microsecond: whenever a pass leaves work, it asks for another at once
/// or names a timer (never neither, or the engine would sleep its second
/// away), and the bytes moved are within 5 % of the limit.
#[test]
fn a_rate_limited_stream_always_leaves_a_timer_and_keeps_its_rate() {
    let (mut env, chunk, many, _) = streamer_and_other();
    const RATE: u64 = 200_000_000;
    env.hca.set_qos(TENANT, Qos { bytes_per_s: Some(RATE), ..Qos::default() }).unwrap();
    let post = |env: &mut Env, a: &End, b: &End| {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    };
    for (a, b) in &many {
        for _ in 0..8 {
            post(&mut env, a, b);
        }
    }
    let end = T0 + std::time::Duration::from_secs(1);
    let (mut now, mut moved) = (T0, 0u64);
    for _ in 0..2_000_000 {
        if now >= end {
            break;
        }
        let act = env.step(now);
        for (a, b) in &many {
            for _ in env.poll(a.cq) {
                moved += u64::from(chunk);
                post(&mut env, a, b);
            }
        }
        let next = now + std::time::Duration::from_micros(1);
        now = match (act.again(), act.next_timer) {
            (true, _) => next,
            (false, Some(t)) => t.max(next),
            (false, None) => panic!("at {now:?} work waits and the pass named no timer: {act:?}"),
        };
    }
    let err = moved as f64 / RATE as f64 - 1.0;
    assert!(err.abs() < 0.05, "{moved} bytes in a second (error {err:+.4})");
}

/// With weight 3 against 1, the streaming tenant's share of a contended
/// pass is three rounds' bytes (`contended_bytes` is two chunks here).
#[test]
fn a_weighted_tenant_moves_its_weights_worth_a_contended_pass() {
    let (mut env, chunk, many, (x, y)) = streamer_and_other();
    env.hca.set_qos(TENANT, Qos { weight: 3, ..Qos::default() }).unwrap();
    for (a, b) in &many {
        env.io
            .post_send(a.qpn, rdma(1, SendOpcode::RdmaWrite, &[a.buf.sge(0, chunk)], b.buf.addr, b.buf.key));
    }
    env.io.post_send(x.qpn, rdma(9, SendOpcode::RdmaWrite, &[x.buf.sge(0, 8)], y.buf.addr, y.buf.key));
    assert!(env.step(T0).contended);
    let done: usize = many.iter().map(|(a, _)| env.poll(a.cq).len()).sum();
    assert_eq!(done, 6, "3 × two chunks");
    assert_eq!(env.poll(x.cq).len(), 1);
}
