//! An authenticated peer daemon may still be hostile or broken: whatever
//! data frames it sends, in whatever order, the device must not panic,
//! must not place bytes outside the windows it handed out, and must keep
//! its own invariants (every frame it emits parses back).
//!
//! The device here has one link to the peer, an RC QP connected to a QP
//! on that peer (as responder and, with WRs posted from the input, as
//! requester), a UD QP, and a region with every access right. The input
//! is a stream of frames (decoded as the driver decodes them) interleaved
//! with the device's own passes.
#![no_main]

use std::collections::{HashMap, VecDeque};

use libfuzzer_sys::fuzz_target;
use vrdma_core::hca::{
    AsyncEvent, ContextId, CqFull, Hca, HcaConfig, KeySource, LinkInfo, Pulled, Queues, RecvSource, Sink,
    TenantId,
};
use vrdma_core::memory::Region;
use vrdma_core::ring::{Cqe, RecvWr, SendWr, Sge, SgeList};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{
    AccessFlags, Gid, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, SendFlags, SendOpcode,
};
use vrdma_core::wire::{parse_frame, FrameRepr};

#[derive(Default)]
struct Q {
    send: HashMap<u32, VecDeque<SendWr>>,
    recv: HashMap<u32, VecDeque<RecvWr>>,
    cqes: usize,
    /// QPs posted to since the core last asked (as a client names them).
    posted: Vec<u32>,
}

impl Queues for Q {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        self.send.get_mut(&qpn)?.pop_front().map(Ok)
    }
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        match src {
            RecvSource::Qp(q) => self.recv.get_mut(&q)?.pop_front().map(Ok),
            RecvSource::Srq(_) => None,
        }
    }
    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        match src {
            RecvSource::Qp(q) => self.recv.get(&q).map_or(0, |v| v.len() as u32),
            RecvSource::Srq(_) => 0,
        }
    }
    fn discard(&mut self, qpn: u32) {
        self.send.remove(&qpn);
        self.recv.remove(&qpn);
    }
    fn push_cqe(&mut self, _cqn: u32, _cqe: &Cqe) -> Result<(), CqFull> {
        self.cqes += 1;
        if self.cqes > 10_000 {
            return Err(CqFull);
        }
        Ok(())
    }
    fn async_event(&mut self, _ctx: ContextId, _event: AsyncEvent) {}
    fn qp_state_changed(&mut self, _qpn: u32, _state: QpState) {}
    fn send_retired(&mut self, _qpn: u32, _count: u32) {}
    fn take_posted(&mut self, out: &mut Vec<u32>) {
        out.append(&mut self.posted);
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

const PEER: [u8; 4] = [10, 0, 0, 2];
const MR_LEN: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let mut hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0x100)));
    let mut io = Q::default();
    let ctx = ContextId(1);
    hca.open_context(ctx, TenantId(1000)).unwrap();
    let pd = hca.alloc_pd(ctx).unwrap();
    let region = Region::heap(MR_LEN);
    let all = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    let key = hca.reg_mr(ctx, pd, 0x10000, all, region.clone()).unwrap();
    let (cq, _) = hca.create_cq(ctx, 4096).unwrap();
    let cap =
        QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 64 };
    let rc = hca
        .create_qp(
            ctx,
            pd,
            QpInitAttr { qp_type: QpType::Rc, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false },
        )
        .unwrap()
        .qpn;
    let ud = hca
        .create_qp(
            ctx,
            pd,
            QpInitAttr { qp_type: QpType::Ud, send_cq: cq, recv_cq: cq, srq: None, cap, sq_sig_all: false },
        )
        .unwrap()
        .qpn;
    let chunk = 256u32 << (data[0] % 9);
    let link = hca.link_up(LinkInfo { gid: Gid::from_ipv4(PEER), lid: 2, chunk });
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: all & !AccessFlags::LOCAL_WRITE,
        qkey: 7,
        ..QpAttr::default()
    };
    let mut rtr = QpAttr {
        qp_state: QpState::Rtr,
        dest_qp_num: 0x22,
        rq_psn: 0,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
        ..QpAttr::default()
    };
    rtr.ah_attr.is_global = true;
    rtr.ah_attr.dgid = Gid::from_ipv4(PEER);
    rtr.ah_attr.hop_limit = 1;
    rtr.ah_attr.port_num = 1;
    rtr.path_mtu = vrdma_core::verbs::Mtu::Mtu1024;
    let rts = QpAttr {
        qp_state: QpState::Rts,
        sq_psn: 0,
        timeout: 1,
        retry_cnt: 1,
        rnr_retry: 1,
        max_rd_atomic: 4,
        ..QpAttr::default()
    };
    let m = QpAttrMask::STATE;
    hca.modify_qp(
        ctx,
        rc,
        &init,
        m | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS,
        &mut io,
    )
    .unwrap();
    hca.modify_qp(
        ctx,
        rc,
        &rtr,
        m | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
        &mut io,
    )
    .unwrap();
    hca.modify_qp(
        ctx,
        rc,
        &rts,
        m | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC,
        &mut io,
    )
    .unwrap();
    hca.modify_qp(ctx, ud, &init, m | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY, &mut io)
        .unwrap();
    hca.modify_qp(ctx, ud, &QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() }, m, &mut io).unwrap();
    for i in 0..8u64 {
        let sg = SgeList::from_slice(&[Sge { addr: 0x10000 + i * 4096, length: 4096, lkey: key }]).unwrap();
        io.recv.entry(rc).or_default().push_back(RecvWr { wr_id: i, sg });
        io.recv.entry(ud).or_default().push_back(RecvWr { wr_id: 100 + i, sg });
    }
    // WRs of every opcode, from the first bytes.
    for (i, b) in data[1..].iter().take(8).enumerate() {
        let ops = [
            SendOpcode::Send,
            SendOpcode::RdmaWrite,
            SendOpcode::RdmaRead,
            SendOpcode::AtomicFetchAndAdd,
            SendOpcode::AtomicCmpAndSwp,
            SendOpcode::RdmaWriteWithImm,
        ];
        let op = ops[*b as usize % ops.len()];
        let len = if op.is_atomic() { 8 } else { u32::from(*b) * 37 };
        let mut wr = SendWr::new(i as u64, op);
        wr.sg = SgeList::from_slice(&[Sge { addr: 0x10000 + 8 * i as u64, length: len, lkey: key }]).unwrap();
        wr.flags = SendFlags::SIGNALED;
        wr.remote_addr = 0x4000;
        wr.rkey = 0x55;
        io.send.entry(rc).or_default().push_back(wr);
        io.posted.push(rc);
    }
    let mut now = Instant(1_000_000);
    let mut rest = &data[1..];
    for _ in 0..256 {
        let (repr, payload) = match parse_frame(rest) {
            Ok(x) => x,
            Err(_) => break,
        };
        rest = &rest[repr.buffer_len()..];
        if let FrameRepr::Data(d) = repr {
            match hca.handle_data(link, &d, now, &mut io) {
                Sink::Place(w) => {
                    assert_eq!(
                        w.iter().map(|s| s.len).sum::<usize>(),
                        payload.len(),
                        "windows cover the payload exactly"
                    );
                    let mut at = 0;
                    for s in &w {
                        s.region.write(s.off, &payload[at..at + s.len]).expect("a window inside its region");
                        at += s.len;
                    }
                }
                Sink::Discard => {}
            }
            hca.data_placed(link, now, &mut io);
        }
        for _ in 0..4 {
            let Some(t) = hca.poll_transmit(link, now, &mut io) else { break };
            let mut bytes = t.header.to_vec();
            bytes.extend(&t.data);
            for s in &t.payload {
                let mut v = vec![0; s.len];
                s.region.read(s.off, &mut v).expect("a window inside its region");
                bytes.extend(v);
            }
            let (back, _) = parse_frame(&bytes).expect("every frame the device emits parses");
            assert_eq!(back.buffer_len(), bytes.len());
        }
        hca.process(now, &mut io);
        now = now + std::time::Duration::from_micros(50);
    }
    if rest.is_empty() {
        hca.link_down(link);
        hca.process(now + std::time::Duration::from_secs(1), &mut io);
    }
});
