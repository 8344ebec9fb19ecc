//! An authenticated peer daemon may still be hostile or broken: whatever
//! data frames it sends, in whatever order, the device must not panic,
//! must not place bytes outside the windows it handed out, and must keep
//! its own invariants (every frame it emits parses back).
//!
//! The device here has one link to the peer, two RC QPs connected to QPs
//! on that peer (0x22, and 0x23 through an SRQ), each requester and
//! responder, a UD QP, a region with every access right and a canary
//! region the peer has no rights to. The input is a script of actions:
//!
//! - frames from the peer, most of them built from the core's own `Repr`
//!   types with fields drawn mostly from what would be accepted (our
//!   tenant, our QPNs, PSNs the QP expects, keys and addresses of the real
//!   region, lengths around the chunk size) and sometimes raw: requests to
//!   our responders (multi-frame messages followed through), ACKs, NAKs,
//!   RNR NAKs, read responses and atomic ACKs for the requests the device
//!   actually sent, datagrams; and raw bytes through the frame parser, so
//!   that the decoder path stays covered;
//! - what the driver and the tenant do meanwhile, also between a frame's
//!   header and the end of its payload, as the daemon does while a payload
//!   trickles in: engine passes, time passing (small steps and jumps, so
//!   that the transport and RNR timers fire), transmission, work requests
//!   posted, `modify_qp` to ERR, RESET, SQD and back to RTS, the link going
//!   down and another coming up, the region deregistered and another
//!   registered, a QP destroyed.
//!
//! Checked throughout: nothing panics; the windows of a `Sink::Place`
//! cover the payload exactly, lie inside live regions and never in the
//! canary; every frame the device emits parses back, carries our tenant
//! and the right QPNs, and reads its payload from live regions; the canary
//! is never written.
#![no_main]

use std::collections::{HashMap, HashSet, VecDeque};

use libfuzzer_sys::fuzz_target;
use vrdma_core::hca::{
    AsyncEvent, ContextId, CqFull, Hca, HcaConfig, KeySource, LinkId, LinkInfo, Pulled, Queues, RecvSource,
    Sink, TenantId,
};
use vrdma_core::memory::Region;
use vrdma_core::ring::{Cqe, RecvWr, SendWr, Sge, SgeList, UdDest};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{
    AccessFlags, AhAttr, Gid, Mtu, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, SendFlags,
    SendOpcode, SrqAttr,
};
use vrdma_core::wire::{
    chunk_count, parse_frame, psn_add, Aeth, AtomicEth, DataFlags, DataRepr, FrameRepr, NakCode, Opcode,
    Packet, Reth, Syndrome, UdEth, MAX_24, MAX_HEADER_LEN,
};

#[derive(Default)]
struct Q {
    send: HashMap<u32, VecDeque<SendWr>>,
    recv: HashMap<u32, VecDeque<RecvWr>>,
    srq: HashMap<u32, VecDeque<RecvWr>>,
    cqes: usize,
    /// QPs posted to since the core last asked (as a client names them).
    posted: Vec<u32>,
    /// Per QP: send WRs pulled, send WRs retired, send completions.
    pulled: HashMap<u32, u64>,
    retired: HashMap<u32, u64>,
    send_cqes: HashMap<u32, u64>,
    /// Work requests completed, by (receive?, wr_id): every wr_id the
    /// harness posts is unique.
    done: HashSet<(bool, u64)>,
}

impl Queues for Q {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        let wr = self.send.get_mut(&qpn)?.pop_front()?;
        *self.pulled.entry(qpn).or_default() += 1;
        Some(Ok(wr))
    }
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        match src {
            RecvSource::Qp(q) => self.recv.get_mut(&q)?.pop_front().map(Ok),
            RecvSource::Srq(s) => self.srq.get_mut(&s)?.pop_front().map(Ok),
        }
    }
    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        match src {
            RecvSource::Qp(q) => self.recv.get(&q).map_or(0, |v| v.len() as u32),
            RecvSource::Srq(s) => self.srq.get(&s).map_or(0, |v| v.len() as u32),
        }
    }
    fn discard(&mut self, qpn: u32) {
        assert_eq!(
            self.pulled.get(&qpn),
            self.retired.get(&qpn),
            "every send WR pulled is retired before the queues are discarded"
        );
        self.send.remove(&qpn);
        self.recv.remove(&qpn);
    }
    fn push_cqe(&mut self, _cqn: u32, cqe: &Cqe) -> Result<(), CqFull> {
        self.cqes += 1;
        if self.cqes > 10_000 {
            return Err(CqFull);
        }
        let recv = cqe.opcode.is_recv();
        assert!(self.done.insert((recv, cqe.wr_id)), "a work request completed twice: {cqe:?}");
        if !recv {
            let n = self.send_cqes.entry(cqe.qp_num).or_default();
            *n += 1;
            assert!(
                *n <= self.retired.get(&cqe.qp_num).copied().unwrap_or(0),
                "a send WR completed before it was retired: {cqe:?}"
            );
        }
        Ok(())
    }
    fn async_event(&mut self, _ctx: ContextId, _event: AsyncEvent) {}
    fn qp_state_changed(&mut self, _qpn: u32, _state: QpState) {}
    fn send_retired(&mut self, qpn: u32, count: u32) {
        let n = self.retired.entry(qpn).or_default();
        *n += u64::from(count);
        assert!(
            *n <= self.pulled.get(&qpn).copied().unwrap_or(0),
            "more send WRs retired than were pulled from QP {qpn:#x}"
        );
    }
    fn take_posted(&mut self, _per_tenant: u32, out: &mut Vec<u32>) -> bool {
        // (The daemon's budget per tenant is tested with its rings.)
        out.append(&mut self.posted);
        false
    }
    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool {
        self.send.get(&qpn).is_none_or(|q| q.is_empty())
            && (!recv_too || self.recv.get(&qpn).is_none_or(|q| q.is_empty()))
    }
    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.posted.contains(&qpn)
    }
}

struct Keys(u32);
impl KeySource for Keys {
    fn next_key(&mut self) -> u32 {
        self.0 += 1;
        self.0
    }
}

/// The input, read from the front; zeros once it runs out.
struct R<'a>(&'a [u8]);

impl R<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            self.u8() as usize % n
        }
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }

    /// Mostly `v`, sometimes one off, a little off, or anything.
    fn tweak(&mut self, v: u32) -> u32 {
        match self.u8() % 16 {
            0..=10 => v,
            11 => v.wrapping_add(1),
            12 => v.wrapping_sub(1),
            13 => v.wrapping_add(u32::from(self.u8() % 8) + 2),
            14 => v.wrapping_sub(u32::from(self.u8() % 8) + 2),
            _ => self.u32(),
        }
    }
    /// A 24-bit field (PSN, QPN, MSN): as `tweak`, in 24 bits but for the
    /// raw case.
    fn tweak24(&mut self, v: u32) -> u32 {
        match self.u8() % 16 {
            0..=10 => v,
            11 => psn_add(v, 1),
            12 => psn_add(v, MAX_24),
            13 => psn_add(v, u32::from(self.u8() % 16) + 2),
            14 => psn_add(v, MAX_24 - u32::from(self.u8() % 16) - 1),
            _ => self.u32(),
        }
    }

    /// A message or chunk length around the interesting boundaries.
    fn len(&mut self, chunk: u32) -> u32 {
        match self.u8() % 16 {
            0 => 0,
            1 => 1,
            2 => 8,
            3 => chunk - 1,
            4 => chunk,
            5 => chunk + 1,
            6 => 2 * chunk,
            7 => 2 * chunk + 1,
            8 => 3 * chunk - 1,
            9 => 4096,
            10 => 4096 - 40,
            11 => 4096 - 39,
            12 => 64,
            13 => 65,
            14 => u32::from(self.u16()),
            _ => self.u32() % (1 << 17),
        }
    }

    /// An address in the region of `len` bytes at `base`, for `n` bytes.
    fn addr(&mut self, base: u64, len: u64, n: u64) -> u64 {
        match self.u8() % 10 {
            0..=3 => base + u64::from(self.u16()) % len.saturating_sub(n).max(1),
            4 => base,
            5 => (base + len).wrapping_sub(n),
            6 => (base + len).wrapping_sub(n).wrapping_add(1),
            7 => base + ((u64::from(self.u16()) % len) & !7),
            8 => base.wrapping_sub(u64::from(self.u8()) + 1),
            _ => self.u64(),
        }
    }
}

const PEER: [u8; 4] = [10, 0, 0, 2];
const TENANT: u32 = 1000;
const MR_ADDR: u64 = 0x10000;
const MR_LEN: usize = 1 << 16;
const CANARY_ADDR: u64 = 0x80000;
const CANARY_LEN: usize = 4096;
const UD_QKEY: u32 = 7;

/// What the peer, as requester, does to one of our RC QPs.
#[derive(Default)]
struct PeerReq {
    /// The PSN of its next request frame.
    psn: u32,
    /// A send or write of several frames it is in the middle of.
    msg: Option<OutMsg>,
}

struct OutMsg {
    write: bool,
    imm: bool,
    total: u32,
    off: u32,
}

/// A request frame the device sent, that the peer may answer.
#[derive(Clone, Copy)]
struct Seen {
    qi: usize,
    op: Opcode,
    psn: u32,
    dma_len: u32,
    /// Bytes of a read answered so far.
    resp_off: u32,
}

/// One of our RC QPs.
struct Rc {
    qpn: u32,
    dest: u32,
    alive: bool,
    peer: PeerReq,
}

struct Params {
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
    max_rd_atomic: u8,
    sq_psn: u32,
    rq_psn: u32,
}

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

struct World {
    hca: Hca,
    io: Q,
    ctx: ContextId,
    pd: u32,
    now: Instant,
    next_timer: Option<Instant>,
    link: LinkId,
    link_live: bool,
    /// An older link to the same peer still up beside `link`, as when
    /// both daemons dialled.
    extra: Option<LinkId>,
    chunk: u32,
    region: Region,
    key: u32,
    canary: Region,
    canary_key: u32,
    rcs: Vec<Rc>,
    ud: u32,
    srq: u32,
    ah: u32,
    params: Params,
    seen: Vec<Seen>,
    payload: Vec<u8>,
    wr_id: u64,
}

impl World {
    fn new(r: &mut R) -> World {
        let mut config = HcaConfig::for_host([10, 0, 0, 1]);
        let b = r.u8();
        config.ack_delay = [std::time::Duration::ZERO, std::time::Duration::from_micros(20)][b as usize & 1];
        if b & 2 != 0 {
            // A small window, so that requests wait for room.
            config.max_psns_in_flight = 8 << (b >> 2 & 3);
        }
        let chunk = 256u32 << (r.u8() % 9);
        let t = r.u8();
        let a = r.u8();
        let psn = |r: &mut R, sel: u8| match sel % 4 {
            0 => 0,
            1 => MAX_24 - (u32::from(r.u8()) % 8),
            2 => MAX_24 / 2 + 1,
            _ => r.u32() & MAX_24,
        };
        let sq_sel = r.u8();
        let sq_psn = psn(r, sq_sel);
        let rq_sel = r.u8();
        let rq_psn = psn(r, rq_sel);
        let params = Params {
            timeout: [0, 1, 6, 10, 14, 18, 22, 31][usize::from(t & 7)],
            retry_cnt: t >> 3 & 7,
            rnr_retry: t >> 6 | (a & 4),
            min_rnr_timer: a >> 3,
            max_rd_atomic: 1 + (a & 3) * 5,
            sq_psn,
            rq_psn,
        };
        let mut hca = Hca::new(config, Box::new(Keys(0x100)));
        let io = Q::default();
        let ctx = ContextId(1);
        hca.open_context(ctx, TenantId(TENANT)).unwrap();
        let pd = hca.alloc_pd(ctx).unwrap();
        let region = Region::heap(MR_LEN);
        let key = hca.reg_mr(ctx, pd, MR_ADDR, ALL, region.clone()).unwrap();
        let canary = Region::heap(CANARY_LEN);
        let canary_key = hca.reg_mr(ctx, pd, CANARY_ADDR, AccessFlags::LOCAL_WRITE, canary.clone()).unwrap();
        let (cq, _) = hca.create_cq(ctx, 4096).unwrap();
        let (srq, _) = hca.create_srq(ctx, pd, SrqAttr { max_wr: 64, max_sge: 4, srq_limit: 0 }).unwrap();
        let cap =
            QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 };
        let mut mk = |qp_type, srq| {
            hca.create_qp(
                ctx,
                pd,
                QpInitAttr { qp_type, send_cq: cq, recv_cq: cq, srq, cap, sq_sig_all: false },
            )
            .unwrap()
            .qpn
        };
        let rc0 = mk(QpType::Rc, None);
        let rc1 = mk(QpType::Rc, Some(srq));
        let ud = mk(QpType::Ud, None);
        let link = hca.link_up(LinkInfo { gid: Gid::from_ipv4(PEER), lid: 2, chunk, verified: true });
        let mut ah_attr = AhAttr {
            is_global: true,
            dgid: Gid::from_ipv4(PEER),
            hop_limit: 1,
            port_num: 1,
            ..AhAttr::default()
        };
        ah_attr.dlid = 2;
        let ah = hca.create_ah(ctx, pd, ah_attr).unwrap();
        let rcs = [(rc0, 0x22), (rc1, 0x23)]
            .into_iter()
            .map(|(qpn, dest)| Rc { qpn, dest, alive: true, peer: PeerReq { psn: rq_psn, msg: None } })
            .collect();
        let mut w = World {
            hca,
            io,
            ctx,
            pd,
            now: Instant(1_000_000_000),
            next_timer: None,
            link,
            link_live: true,
            extra: None,
            chunk,
            region,
            key,
            canary,
            canary_key,
            rcs,
            ud,
            srq,
            ah,
            params,
            seen: Vec::new(),
            payload: Vec::new(),
            wr_id: 1000,
        };
        w.connect(0);
        w.connect(1);
        w.connect_ud();
        for i in 0..8u64 {
            let sg =
                SgeList::from_slice(&[Sge { addr: MR_ADDR + i * 4096, length: 4096, lkey: key }]).unwrap();
            w.io.recv.entry(rc0).or_default().push_back(RecvWr { wr_id: i, sg });
            w.io.srq.entry(srq).or_default().push_back(RecvWr { wr_id: 50 + i, sg });
            w.io.recv.entry(ud).or_default().push_back(RecvWr { wr_id: 100 + i, sg });
        }
        w
    }

    /// RESET (or wherever it is) through INIT and RTR to RTS; steps the
    /// state machine refuses are skipped.
    fn connect(&mut self, qi: usize) {
        let p = &self.params;
        let (qpn, dest) = (self.rcs[qi].qpn, self.rcs[qi].dest);
        let init = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: ALL & !AccessFlags::LOCAL_WRITE,
            ..QpAttr::default()
        };
        let mut rtr = QpAttr {
            qp_state: QpState::Rtr,
            dest_qp_num: dest,
            rq_psn: p.rq_psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: p.min_rnr_timer,
            path_mtu: Mtu::Mtu1024,
            ..QpAttr::default()
        };
        rtr.ah_attr.is_global = true;
        rtr.ah_attr.dgid = Gid::from_ipv4(PEER);
        rtr.ah_attr.hop_limit = 1;
        rtr.ah_attr.port_num = 1;
        let rts = QpAttr {
            qp_state: QpState::Rts,
            sq_psn: p.sq_psn,
            timeout: p.timeout,
            retry_cnt: p.retry_cnt,
            rnr_retry: p.rnr_retry,
            max_rd_atomic: p.max_rd_atomic,
            ..QpAttr::default()
        };
        let m = QpAttrMask::STATE;
        let (ctx, io) = (self.ctx, &mut self.io);
        let _ = self.hca.modify_qp(
            ctx,
            qpn,
            &init,
            m | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
            io,
        );
        let _ = self.hca.modify_qp(
            ctx,
            qpn,
            &rtr,
            m | QpAttrMask::AV
                | QpAttrMask::PATH_MTU
                | QpAttrMask::DEST_QPN
                | QpAttrMask::RQ_PSN
                | QpAttrMask::MAX_DEST_RD_ATOMIC
                | QpAttrMask::MIN_RNR_TIMER,
            io,
        );
        let _ = self.hca.modify_qp(
            ctx,
            qpn,
            &rts,
            m | QpAttrMask::SQ_PSN
                | QpAttrMask::TIMEOUT
                | QpAttrMask::RETRY_CNT
                | QpAttrMask::RNR_RETRY
                | QpAttrMask::MAX_QP_RD_ATOMIC,
            io,
        );
    }

    fn connect_ud(&mut self) {
        let m = QpAttrMask::STATE;
        let init = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: UD_QKEY, ..QpAttr::default() };
        let (ctx, ud, io) = (self.ctx, self.ud, &mut self.io);
        let _ = self.hca.modify_qp(
            ctx,
            ud,
            &init,
            m | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY,
            io,
        );
        let _ = self.hca.modify_qp(ctx, ud, &QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() }, m, io);
        let _ = self.hca.modify_qp(
            ctx,
            ud,
            &QpAttr { qp_state: QpState::Rts, ..QpAttr::default() },
            m | QpAttrMask::SQ_PSN,
            io,
        );
    }

    fn modify_state(&mut self, qpn: u32, state: QpState) {
        let attr = QpAttr { qp_state: state, en_sqd_async_notify: true, ..QpAttr::default() };
        let mut mask = QpAttrMask::STATE;
        if state == QpState::Sqd {
            mask |= QpAttrMask::EN_SQD_ASYNC_NOTIFY;
        }
        let _ = self.hca.modify_qp(self.ctx, qpn, &attr, mask, &mut self.io);
        if state == QpState::Reset {
            // The peer's side of the connection starts over too.
            if let Some(qi) = self.rcs.iter().position(|q| q.qpn == qpn) {
                self.rcs[qi].peer = PeerReq { psn: self.params.rq_psn, msg: None };
                self.seen.retain(|s| s.qi != qi);
            }
        }
    }

    fn is_canary(&self, region: &Region, off: usize, len: usize) -> bool {
        let (Ok(p), Ok(c)) = (region.io_ptr(off, len), self.canary.io_ptr(0, CANARY_LEN)) else {
            panic!("a window outside its region: [{off}, +{len}) of {}", region.len());
        };
        let (p, c) = (p as usize, c as usize);
        p < c + CANARY_LEN && c < p + len.max(1)
    }

    // ---- the device's side ----

    fn process(&mut self) {
        let act = self.hca.process(self.now, &mut self.io);
        self.next_timer = act.next_timer;
    }

    fn advance(&mut self, r: &mut R) {
        let d = match r.u8() % 8 {
            0..=2 => std::time::Duration::from_micros(u64::from(r.u8())),
            3 => std::time::Duration::from_millis(u64::from(r.u8() % 16)),
            4 => std::time::Duration::from_secs(1),
            5 => std::time::Duration::from_nanos(u64::from(r.u32())),
            _ => match self.next_timer {
                Some(t) => t.saturating_since(self.now) + std::time::Duration::from_nanos(1),
                None => std::time::Duration::from_micros(100),
            },
        };
        self.now = self.now + d;
        self.process();
    }

    /// Frames the device writes to the link, checked, and the requests
    /// among them remembered for the peer to answer.
    fn transmit(&mut self, n: usize) {
        for link in [Some(self.link), self.extra].into_iter().flatten() {
            self.transmit_on(link, n);
        }
    }

    fn transmit_on(&mut self, link: LinkId, n: usize) {
        for _ in 0..n {
            let Some(t) = self.hca.poll_transmit(link, self.now, &mut self.io) else { break };
            let mut bytes = t.header.to_vec();
            bytes.extend(&t.data);
            for s in &t.payload {
                assert!(!s.region.is_revoked(), "a payload read from a deregistered region");
                assert!(!self.is_canary(&s.region, s.off, s.len), "a payload read from the canary");
                let mut v = vec![0; s.len];
                s.region.read(s.off, &mut v).expect("a window inside its region");
                bytes.extend(v);
            }
            let (back, _) = parse_frame(&bytes).expect("every frame the device emits parses");
            assert_eq!(back.buffer_len(), bytes.len());
            let FrameRepr::Data(d) = back else { panic!("the core emits data frames only") };
            assert_eq!(d.vnet, TENANT, "our tenant's frames carry its network");
            self.observe(&d);
        }
    }

    fn observe(&mut self, d: &DataRepr) {
        if matches!(d.opcode, Opcode::UdSendOnly | Opcode::UdSendOnlyImm) {
            assert_eq!(d.src_qpn, self.ud);
            return;
        }
        let qi = self.rcs.iter().position(|q| q.qpn == d.src_qpn).expect("an RC frame from one of our QPs");
        assert_eq!(d.dest_qpn, self.rcs[qi].dest, "an RC frame to the QP ours is connected to");
        if d.opcode.is_request() {
            let dma_len = d.reth.map_or(0, |r| r.dma_len);
            if let Some(s) = self.seen.iter_mut().find(|s| s.qi == qi && s.psn == d.psn && s.op == d.opcode) {
                // Sent again: a read is answered from its start.
                s.resp_off = 0;
                s.dma_len = dma_len;
                return;
            }
            if self.seen.len() >= 32 {
                self.seen.remove(0);
            }
            self.seen.push(Seen { qi, op: d.opcode, psn: d.psn, dma_len, resp_off: 0 });
        } else if let Some(a) = d.aeth {
            if matches!(a.syndrome, Syndrome::RnrNak { .. } | Syndrome::Nak(NakCode::PsnSequenceError)) {
                // The peer goes back to the frame our responder expects.
                let p = &mut self.rcs[qi].peer;
                p.psn = d.psn;
                p.msg = None;
            }
        }
    }

    fn post_send(&mut self, r: &mut R) {
        let ops = [
            SendOpcode::Send,
            SendOpcode::SendWithImm,
            SendOpcode::RdmaWrite,
            SendOpcode::RdmaWriteWithImm,
            SendOpcode::RdmaRead,
            SendOpcode::AtomicFetchAndAdd,
            SendOpcode::AtomicCmpAndSwp,
        ];
        let qi = r.below(2);
        let op = ops[r.below(ops.len())];
        self.wr_id += 1;
        let mut wr = SendWr::new(self.wr_id, op);
        let f = r.u8();
        wr.flags = if f & 7 != 0 { SendFlags::SIGNALED } else { SendFlags::empty() };
        if f & 8 != 0 {
            wr.flags |= SendFlags::SOLICITED;
        }
        let len = if op.is_atomic() { 8 } else { r.len(self.chunk).min(MR_LEN as u32) };
        if f & 0x30 == 0x30 && !op.writes_local() && len <= 64 {
            wr.flags |= SendFlags::INLINE;
            wr.inline_len = len as u16;
        } else {
            let lkey = if f & 0xc0 == 0xc0 { r.u32() } else { self.key };
            let nsge = 1 + usize::from(f >> 6 & 1) * (1 + r.below(3));
            let mut sges = Vec::new();
            let mut left = len;
            for i in 0..nsge {
                let l = if i + 1 == nsge { left } else { left / 2 };
                left -= l;
                let addr = r.addr(MR_ADDR, MR_LEN as u64, u64::from(l));
                sges.push(Sge { addr, length: l, lkey });
            }
            wr.sg = SgeList::from_slice(&sges).unwrap();
        }
        wr.remote_addr = u64::from(r.u16()) << 3;
        wr.rkey = 0x55;
        wr.imm_data = 0xabcd;
        wr.compare_add = 1;
        wr.swap = 2;
        let qpn = self.rcs[qi].qpn;
        self.io.send.entry(qpn).or_default().push_back(wr);
        self.io.posted.push(qpn);
    }

    fn post_ud_send(&mut self, r: &mut R) {
        self.wr_id += 1;
        let op = if r.bool() { SendOpcode::Send } else { SendOpcode::SendWithImm };
        let mut wr = SendWr::new(self.wr_id, op);
        wr.flags = SendFlags::SIGNALED;
        let len = r.len(self.chunk).min(8192);
        let addr = r.addr(MR_ADDR, MR_LEN as u64, u64::from(len));
        wr.sg = SgeList::from_slice(&[Sge { addr, length: len, lkey: self.key }]).unwrap();
        wr.ud = UdDest { remote_qpn: r.tweak24(0x30), remote_qkey: r.tweak(UD_QKEY), ah: self.ah };
        self.io.send.entry(self.ud).or_default().push_back(wr);
        self.io.posted.push(self.ud);
    }

    fn post_recv(&mut self, r: &mut R) {
        let sel = r.u8();
        let n = 1 + usize::from(sel >> 4 & 3);
        let mut sges = Vec::new();
        for _ in 0..n {
            let length = match r.u8() % 4 {
                0 => 4096,
                1 => self.chunk,
                2 => u32::from(r.u8()),
                _ => r.len(self.chunk).min(MR_LEN as u32),
            };
            let addr = r.addr(MR_ADDR, MR_LEN as u64, u64::from(length));
            sges.push(Sge { addr, length, lkey: self.key });
        }
        self.wr_id += 1;
        let wr = RecvWr { wr_id: self.wr_id, sg: SgeList::from_slice(&sges).unwrap() };
        match sel % 3 {
            0 => {
                let q = self.rcs[0].qpn;
                self.io.recv.entry(q).or_default().push_back(wr);
                self.io.posted.push(q);
            }
            1 => {
                self.io.srq.entry(self.srq).or_default().push_back(wr);
                // The SRQ's QP is told, as the client tells the daemon.
                self.io.posted.push(self.rcs[1].qpn);
            }
            _ => {
                self.io.recv.entry(self.ud).or_default().push_back(wr);
                self.io.posted.push(self.ud);
            }
        }
    }

    // ---- the peer's side ----

    /// A frame from the peer: emitted from its `Repr` (a header the
    /// decoder would refuse is not sent), parsed back as the decoder
    /// parses it, and handed to the device.
    fn send_repr(&mut self, r: &mut R, d: DataRepr) -> bool {
        let mut hdr = [0u8; MAX_HEADER_LEN];
        let Ok(hl) = FrameRepr::Data(d).emit(&mut hdr) else { return false };
        let back = FrameRepr::parse(&Packet::new_unchecked(&hdr[..hl])).expect("an emitted header parses");
        assert_eq!(back, FrameRepr::Data(d));
        let n = d.payload_len as usize;
        if self.payload.len() < n {
            self.payload.resize(n, 0x5a);
        }
        let payload = std::mem::take(&mut self.payload);
        self.deliver(r, &d, &payload[..n]);
        self.payload = payload;
        true
    }

    /// Hands a parsed data header to the device and places its payload as
    /// the driver does, with something else happening meanwhile perhaps.
    fn deliver(&mut self, r: &mut R, d: &DataRepr, payload: &[u8]) {
        let mid = r.u8();
        let link = match self.extra {
            Some(x) if mid & 0x20 != 0 => x,
            _ => self.link,
        };
        let sink = self.hca.handle_data(link, d, self.now, &mut self.io);
        let mut lost = false;
        match sink {
            Sink::Place(w) => {
                assert_eq!(
                    w.iter().map(|s| s.len).sum::<usize>(),
                    payload.len(),
                    "windows cover the payload exactly"
                );
                for s in &w {
                    assert!(!s.region.is_revoked(), "a window into a deregistered region");
                    assert!(!self.is_canary(&s.region, s.off, s.len), "a window into the canary");
                }
                // The payload arrives in two parts, and the daemon may do
                // something else in between.
                let split = if mid < 0xc0 { w.len() } else { usize::from(mid) % (w.len() + 1) };
                let mut at = 0;
                for (i, s) in w.iter().enumerate() {
                    if i == split {
                        self.interlude(r);
                    }
                    if !self.is_live(link) {
                        // The connection is gone, and the payload with it.
                        return;
                    }
                    if s.region.is_revoked() {
                        lost = true;
                        break;
                    }
                    if self.hca.placement_cancelled(link) {
                        break;
                    }
                    s.region.write(s.off, &payload[at..at + s.len]).expect("a window inside its region");
                    at += s.len;
                }
                if split == w.len() && mid >= 0xc0 {
                    self.interlude(r);
                }
            }
            Sink::Discard => {
                if mid >= 0xc0 {
                    self.interlude(r);
                }
            }
        }
        if lost {
            self.hca.data_lost(link, &mut self.io);
        } else {
            self.hca.data_placed(link, self.now, &mut self.io);
        }
    }

    /// What may happen while a payload is still arriving.
    fn interlude(&mut self, r: &mut R) {
        match r.u8() % 8 {
            0 => self.process(),
            1 => self.advance(r),
            2 => self.transmit(2),
            3 => {
                let q = self.rcs[r.below(2)].qpn;
                self.modify_state(q, QpState::Err)
            }
            4 => {
                let q = self.rcs[r.below(2)].qpn;
                self.modify_state(q, QpState::Reset)
            }
            5 => self.rereg(),
            6 => self.link_down(),
            _ => {
                let ud = self.ud;
                let s = if r.bool() { QpState::Reset } else { QpState::Err };
                self.modify_state(ud, s)
            }
        }
    }

    fn flags(r: &mut R, op: Opcode, last: bool) -> DataFlags {
        let mut f = DataFlags::empty();
        let b = r.u8();
        if last && b & 1 != 0 && op.may_request_ack() {
            f |= DataFlags::ACK_REQ;
        }
        if b & 2 != 0 && op.may_be_solicited() {
            f |= DataFlags::SOLICITED;
        }
        f
    }

    /// A request to one of our RC QPs, as a peer requester would send it:
    /// the next frame of a message in progress, or a new message.
    fn peer_request(&mut self, r: &mut R) {
        let qi = r.below(2);
        let (qpn, dest) = (self.rcs[qi].qpn, self.rcs[qi].dest);
        let chunk = self.chunk;
        let vnet = r.tweak(TENANT);
        let dst = match r.u8() % 16 {
            0 => self.rcs[1 - qi].qpn,
            1 => self.ud,
            2 => r.u32() & MAX_24,
            _ => qpn,
        };
        let src = r.tweak24(dest);
        let psn = r.tweak24(self.rcs[qi].peer.psn);
        let cont = self.rcs[qi].peer.msg.is_some() && !r.u8().is_multiple_of(4);
        // What the frame does to the peer's own view, once it is sent
        // (whatever becomes of it): PSNs it takes, the message it starts,
        // continues or ends.
        let (d, npsn, msg) = if cont {
            let m = self.rcs[qi].peer.msg.as_ref().unwrap();
            let left = m.total - m.off;
            let n = r.tweak(left.min(chunk)).min(1 << 16);
            let last = n >= left;
            let op = match (m.write, last, m.imm) {
                (false, false, _) => Opcode::SendMiddle,
                (false, true, false) => Opcode::SendLast,
                (false, true, true) => Opcode::SendLastImm,
                (true, false, _) => Opcode::WriteMiddle,
                (true, true, false) => Opcode::WriteLast,
                (true, true, true) => Opcode::WriteLastImm,
            };
            let mut d = DataRepr::new(op, vnet, dst, src, psn);
            d.msg_offset = r.tweak(m.off);
            d.payload_len = n;
            if m.imm && last {
                d.imm = Some(r.u32());
            }
            d.flags = Self::flags(r, op, last);
            let next = (!last).then(|| OutMsg { write: m.write, imm: m.imm, total: m.total, off: m.off + n });
            (d, 1, next)
        } else {
            let kind = r.u8() % 10;
            let len = r.len(chunk);
            let mut write = false;
            let mut imm = false;
            let mut d = match kind {
                0..=2 => {
                    imm = kind == 2;
                    let op = match (len > chunk, imm) {
                        (true, _) => Opcode::SendFirst,
                        (false, false) => Opcode::SendOnly,
                        (false, true) => Opcode::SendOnlyImm,
                    };
                    let mut d = DataRepr::new(op, vnet, dst, src, psn);
                    d.payload_len = len.min(chunk);
                    if op == Opcode::SendOnlyImm {
                        d.imm = Some(r.u32());
                    }
                    d
                }
                3..=5 => {
                    write = true;
                    imm = kind == 5;
                    let op = match (len > chunk, imm) {
                        (true, _) => Opcode::WriteFirst,
                        (false, false) => Opcode::WriteOnly,
                        (false, true) => Opcode::WriteOnlyImm,
                    };
                    let mut d = DataRepr::new(op, vnet, dst, src, psn);
                    d.payload_len = len.min(chunk);
                    d.reth = Some(self.reth(r, len));
                    if op == Opcode::WriteOnlyImm {
                        d.imm = Some(r.u32());
                    }
                    d
                }
                6 => {
                    let mut d = DataRepr::new(Opcode::ReadRequest, vnet, dst, src, psn);
                    d.reth = Some(self.reth(r, len));
                    d
                }
                7 | 8 => {
                    let op = if kind == 7 { Opcode::CompareSwap } else { Opcode::FetchAdd };
                    let mut d = DataRepr::new(op, vnet, dst, src, psn);
                    let va = r.addr(MR_ADDR, MR_LEN as u64, 8);
                    let va = if r.u8().is_multiple_of(4) { va } else { va & !7 };
                    d.atomic =
                        Some(AtomicEth { va, rkey: self.rkey(r), swap_add: r.u64(), compare: r.u64() });
                    d
                }
                _ => {
                    // Any opcode at all, with what it needs.
                    let op = Opcode::ALL[r.below(Opcode::ALL.len())];
                    let mut d = DataRepr::new(op, vnet, dst, src, psn);
                    let e = op.exts();
                    d.payload_len = if op.carries_payload() { len.min(1 << 16) } else { 0 };
                    d.msg_offset = if op.starts_message() { 0 } else { r.tweak(chunk) };
                    if e.reth {
                        d.reth = Some(self.reth(r, len));
                    }
                    if e.atomic {
                        let va = r.addr(MR_ADDR, MR_LEN as u64, 8);
                        d.atomic = Some(AtomicEth { va, rkey: self.rkey(r), swap_add: 1, compare: 0 });
                    }
                    if e.aeth {
                        d.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn: r.u32() & MAX_24 });
                    }
                    if e.atomic_ack {
                        d.atomic_ack = Some(r.u64());
                    }
                    if e.imm {
                        d.imm = Some(r.u32());
                    }
                    if e.ud {
                        d.ud = Some(self.ud_eth(r));
                    }
                    d
                }
            };
            let op = d.opcode;
            d.flags = Self::flags(r, op, !op.is_first());
            let npsn = match op {
                Opcode::ReadRequest => chunk_count(u64::from(d.reth.map_or(0, |x| x.dma_len)), chunk) as u32,
                _ => 1,
            };
            let msg = op.is_first().then_some(OutMsg { write, imm, total: len, off: d.payload_len });
            (d, npsn, msg)
        };
        if !self.send_repr(r, d) {
            return;
        }
        let p = &mut self.rcs[qi].peer;
        p.psn = psn_add(p.psn, npsn);
        p.msg = msg;
    }

    fn rkey(&self, r: &mut R) -> u32 {
        match r.u8() % 16 {
            0 => self.canary_key,
            1 => r.u32(),
            2 => 0,
            _ => self.key,
        }
    }

    fn reth(&self, r: &mut R, len: u32) -> Reth {
        let rkey = self.rkey(r);
        let (base, size) =
            if rkey == self.canary_key { (CANARY_ADDR, CANARY_LEN as u64) } else { (MR_ADDR, MR_LEN as u64) };
        Reth { va: r.addr(base, size, u64::from(len)), rkey, dma_len: r.tweak(len) }
    }

    fn ud_eth(&self, r: &mut R) -> UdEth {
        let b = r.u8();
        UdEth {
            qkey: r.tweak(UD_QKEY),
            sgid: Gid::from_ipv4(PEER),
            slid: 2,
            global: b & 1 != 0,
            sl: b >> 1 & 0xf,
            hop_limit: r.u8(),
        }
    }

    fn datagram(&mut self, r: &mut R) {
        let op = if r.bool() { Opcode::UdSendOnly } else { Opcode::UdSendOnlyImm };
        let dst = match r.u8() % 8 {
            0 => self.rcs[0].qpn,
            1 => r.u32() & MAX_24,
            _ => self.ud,
        };
        let mut d = DataRepr::new(op, r.tweak(TENANT), dst, r.u32() & MAX_24, r.u32() & MAX_24);
        d.ud = Some(self.ud_eth(r));
        d.payload_len = r.len(self.chunk).min(1 << 16);
        if op == Opcode::UdSendOnlyImm {
            d.imm = Some(r.u32());
        }
        d.flags = Self::flags(r, op, true);
        self.send_repr(r, d);
    }

    /// An answer to a request the device sent: an ACK, NAK, RNR NAK, the
    /// next read response chunk or an atomic ACK.
    fn peer_answer(&mut self, r: &mut R) {
        let chunk = self.chunk;
        let pick = r.below(self.seen.len().max(1));
        let s = match self.seen.get(pick) {
            Some(s) => *s,
            None => {
                let qi = r.below(2);
                Seen { qi, op: Opcode::SendOnly, psn: self.params.sq_psn, dma_len: 0, resp_off: 0 }
            }
        };
        let (qpn, dest) = (self.rcs[s.qi].qpn, self.rcs[s.qi].dest);
        let vnet = r.tweak(TENANT);
        let dst = if r.u8().is_multiple_of(16) { self.rcs[1 - s.qi].qpn } else { qpn };
        let src = r.tweak24(dest);
        let msn = r.u32() & MAX_24;
        let kind = r.u8() % 10;
        let read = s.op == Opcode::ReadRequest;
        let atomic = matches!(s.op, Opcode::CompareSwap | Opcode::FetchAdd);
        let d = match kind {
            0..=3 if read => {
                let off = s.resp_off;
                let left = s.dma_len.saturating_sub(off);
                let n = r.tweak(left.min(chunk)).min(1 << 16);
                let (first, last) = (off == 0, n >= left);
                let op = match (first, last) {
                    (true, true) => Opcode::ReadResponseOnly,
                    (true, false) => Opcode::ReadResponseFirst,
                    (false, false) => Opcode::ReadResponseMiddle,
                    (false, true) => Opcode::ReadResponseLast,
                };
                let psn = r.tweak24(psn_add(s.psn, off / chunk));
                let mut d = DataRepr::new(op, vnet, dst, src, psn);
                d.msg_offset = if first { 0 } else { r.tweak(off) };
                d.payload_len = n;
                if first || last {
                    d.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                }
                if let Some(x) = self.seen.get_mut(pick) {
                    x.resp_off = off + n;
                }
                d
            }
            0..=3 if atomic => {
                let mut d = DataRepr::new(Opcode::AtomicAcknowledge, vnet, dst, src, r.tweak24(s.psn));
                d.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                d.atomic_ack = Some(r.u64());
                d
            }
            _ => {
                let last_psn = if read {
                    psn_add(s.psn, (chunk_count(u64::from(s.dma_len), chunk) as u32).saturating_sub(1))
                } else {
                    s.psn
                };
                let syndrome = match kind {
                    0..=5 => Syndrome::Ack,
                    6 => Syndrome::RnrNak { timer: r.u8() & 0x1f },
                    7 => Syndrome::Nak(NakCode::PsnSequenceError),
                    _ => Syndrome::Nak(NakCode::from_raw(r.u8() % 4).unwrap()),
                };
                let psn = if syndrome == Syndrome::Ack { last_psn } else { s.psn };
                let mut d = DataRepr::new(Opcode::Acknowledge, vnet, dst, src, r.tweak24(psn));
                d.aeth = Some(Aeth { syndrome, msn });
                d
            }
        };
        self.send_repr(r, d);
    }

    /// Raw bytes through the frame parser, as the decoder would hand them
    /// over; optionally with the base header's constant fields stamped.
    fn raw(&mut self, r: &mut R) {
        let sel = r.u8();
        let n = r.u8() as usize + if sel & 1 != 0 { 36 } else { 0 };
        let mut bytes = r.bytes(n).to_vec();
        if sel & 2 != 0 && bytes.len() >= 12 {
            bytes[0..4].copy_from_slice(&[0x76, 0x52, 0x01, 0x10]);
            bytes[5] = 0;
            if sel & 4 != 0 {
                let op = Opcode::ALL[usize::from(sel >> 3) % Opcode::ALL.len()];
                bytes[6..8].copy_from_slice(&(op.header_len() as u16).to_be_bytes());
                let pl = bytes.len().saturating_sub(op.header_len()) as u32;
                bytes[8..12].copy_from_slice(&pl.to_be_bytes());
                if bytes.len() > 12 {
                    bytes[12] = op.raw();
                }
            }
        }
        let Ok((FrameRepr::Data(d), payload)) = parse_frame(&bytes) else { return };
        let payload = payload.to_vec();
        self.deliver(r, &d, &payload);
    }

    fn is_live(&self, link: LinkId) -> bool {
        (self.link_live && link == self.link) || self.extra == Some(link)
    }

    /// The current link goes down; an older one still up takes its place.
    fn link_down(&mut self) {
        self.hca.link_down(self.link);
        self.link_live = false;
        if let Some(x) = self.extra.take() {
            self.link = x;
            self.link_live = true;
        }
    }

    fn link_up(&mut self, r: &mut R) {
        let keep = r.u8();
        if let Some(x) = self.extra.take() {
            self.hca.link_down(x);
        }
        if self.link_live && keep & 1 != 0 {
            // Both daemons dialled: the old link stays up for a while
            // (same daemons, same chunk size).
            self.extra = Some(self.link);
        } else {
            if self.link_live {
                self.hca.link_down(self.link);
            }
            if keep & 2 != 0 {
                self.chunk = 256u32 << (r.u8() % 9);
            }
        }
        self.link = self.hca.link_up(LinkInfo {
            gid: Gid::from_ipv4(PEER),
            lid: 2,
            chunk: self.chunk,
            verified: true,
        });
        self.link_live = true;
        // A new connection: the peer knows nothing of what was sent on
        // the old one.
        self.seen.clear();
    }

    /// The region is deregistered and a new one registered at its
    /// address (with a new key).
    fn rereg(&mut self) {
        if self.hca.dereg_mr(self.ctx, self.key).is_err() {
            return;
        }
        self.region = Region::heap(MR_LEN);
        self.key = self.hca.reg_mr(self.ctx, self.pd, MR_ADDR, ALL, self.region.clone()).unwrap();
    }

    fn step(&mut self, r: &mut R) {
        match r.u8() % 32 {
            0..=7 => self.peer_request(r),
            8..=13 => self.peer_answer(r),
            14 | 15 => self.datagram(r),
            16 | 17 => self.raw(r),
            18..=20 => self.post_send(r),
            21 => self.post_ud_send(r),
            22 => self.post_recv(r),
            23 | 24 => {
                let n = 1 + r.below(8);
                self.transmit(n)
            }
            25 => self.process(),
            26 | 27 => self.advance(r),
            28 => {
                if self.link_live && !r.u8().is_multiple_of(4) {
                    self.link_down()
                } else {
                    self.link_up(r)
                }
            }
            29 => {
                let qi = r.below(2);
                let qpn = self.rcs[qi].qpn;
                match r.u8() % 6 {
                    0 => self.modify_state(qpn, QpState::Err),
                    1 => self.modify_state(qpn, QpState::Reset),
                    2 => self.modify_state(qpn, QpState::Sqd),
                    3 => self.modify_state(qpn, QpState::Rts),
                    _ => {
                        self.modify_state(qpn, QpState::Reset);
                        self.connect(qi);
                    }
                }
            }
            30 => {
                let ud = self.ud;
                match r.u8() % 3 {
                    0 => self.modify_state(ud, QpState::Err),
                    1 => self.modify_state(ud, QpState::Reset),
                    _ => {
                        self.modify_state(ud, QpState::Reset);
                        self.connect_ud();
                    }
                }
            }
            _ => match r.u8() % 8 {
                0 => self.rereg(),
                1 if self.rcs[1].alive => {
                    let qpn = self.rcs[1].qpn;
                    let _ = self.hca.destroy_qp(self.ctx, qpn, &mut self.io);
                    self.rcs[1].alive = false;
                }
                _ => {
                    // The engine keeps up, as the daemon's loop does.
                    self.process();
                    self.transmit(4);
                }
            },
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut r = R(data);
    let mut w = World::new(&mut r);
    let mut steps = 0;
    while !r.is_empty() && steps < 256 {
        w.step(&mut r);
        steps += 1;
    }
    w.process();
    w.transmit(8);
    w.link_down();
    w.link_down();
    w.now = w.now + std::time::Duration::from_secs(1);
    w.process();
    w.now = w.now + std::time::Duration::from_secs(10);
    w.process();
    let mut c = vec![0u8; CANARY_LEN];
    w.canary.read(0, &mut c).unwrap();
    assert!(c.iter().all(|&b| b == 0), "the peer wrote into a region it has no rights to");
});
