//! The engine's step: RC requester and responder rules for every opcode.
//!
//! On one host both ends of a connection live in this `Hca`, so a work
//! request is carried out whole in one place: the requester's checks, the
//! responder's checks, the copy, and both completions. The outcome is what
//! RC hardware reports for the same request: a local protection error is
//! the requester's, a bad rkey is a remote access error that also breaks
//! the responder, a missing receive is an RNR NAK that is retried after the
//! responder's RNR timer, and a peer that does not answer is retried until
//! the QP's timeout and retry count are spent.
//!
//! A UD QP sends datagrams instead: SEND and SEND_WITH_IMM of at most one
//! path MTU, addressed by an address handle, a QP number and a Q_Key. The
//! receiver gets a 40-byte GRH area before the payload. Nothing is
//! acknowledged, so nothing that happens at the receiver (no such QP, a
//! Q_Key mismatch, no receive posted, a receive too small) changes the
//! sender's successful completion; the sender's own errors move its QP to
//! SQE, from which a modify to RTS recovers.

use super::objects::{Inflight, Mr, Qp};
use super::AsyncEvent;
use super::TenantId;
use super::{Hca, Queues, RecvSource};
use crate::memory::{OutOfBounds, Region};
use crate::qp::timers;
use crate::ring::{Cqe, RecvWr, SendWr, Sge, WqeError};
use crate::time::Instant;
use crate::verbs::{
    AccessFlags, AhAttr, AsyncEventType, QpAttr, QpState, QpType, SendFlags, SendOpcode, WcFlags, WcOpcode,
    WcStatus,
};

/// What a call to [`Hca::process`] found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Work was done; call again soon.
    pub busy: bool,
    /// The earliest moment a waiting work request may run again.
    pub next_timer: Option<Instant>,
}

impl Activity {
    fn timer(&mut self, t: Instant) {
        self.next_timer = Some(self.next_timer.map_or(t, |n| n.min(t)));
    }
}

/// Most send WRs one QP starts in one engine pass.
const WRS_PER_PASS: usize = 64;

/// How long the engine waits before looking again for a peer when the QP's
/// timeout is 0 (wait forever).
const PEER_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// Bytes of the Global Route Header a UD receive buffer starts with.
pub const GRH_LEN: usize = 40;

/// The QP number that addresses a multicast group, never a QP.
const MULTICAST_QPN: u32 = 0xff_ffff;

/// A Q_Key with this bit set in a UD send means "use the sending QP's
/// own Q_Key" (a controlled Q_Key).
const QKEY_FROM_QP: u32 = 0x8000_0000;

/// A resolved piece of a message: `len` bytes at `off` in `region`.
struct Seg<'a> {
    region: &'a Region,
    off: usize,
    len: usize,
}

/// The resolved SGEs of one work request, kept on the stack.
type Segs<'a> = arrayvec::ArrayVec<Seg<'a>, { crate::ring::MAX_SGE }>;

enum Source<'a> {
    Segs(&'a [Seg<'a>]),
    Inline(&'a [u8]),
}

/// The requester's attributes, copied out so the responder can be borrowed.
struct Requester {
    qpn: u32,
    qp_type: QpType,
    tenant: TenantId,
    pd: u32,
    send_cq: u32,
    sig_all: bool,
    attr: QpAttr,
}

/// The responder's attributes.
struct Responder {
    qpn: u32,
    recv_pd: u32,
    pd: u32,
    recv_cq: u32,
    srq: Option<u32>,
    max_recv_sge: u32,
    attr: QpAttr,
}

/// Why a datagram was not placed.
enum Placement {
    /// The receiver's fault: its receive completes with this status and
    /// its QP goes to ERR; the sender does not know.
    Recv(WcStatus),
    /// The sender's fault: the receive goes back unused.
    Local(WcStatus),
}

/// A failure, with what each side reports.
struct Failure {
    requester: WcStatus,
    /// The responder goes to ERR with this async event...
    responder_event: Option<AsyncEventType>,
    /// ...and completes the receive it consumed with this status.
    responder_recv: Option<WcStatus>,
}

impl Failure {
    fn local(status: WcStatus) -> Self {
        Failure { requester: status, responder_event: None, responder_recv: None }
    }
    fn remote_access() -> Self {
        Failure {
            requester: WcStatus::RemAccessErr,
            responder_event: Some(AsyncEventType::QpAccessErr),
            responder_recv: None,
        }
    }
    fn remote_invalid(recv: Option<WcStatus>) -> Self {
        Failure {
            requester: WcStatus::RemInvReqErr,
            responder_event: Some(AsyncEventType::QpReqErr),
            responder_recv: recv,
        }
    }
}

enum Exec {
    Complete { byte_len: u32 },
    Partial,
    Rnr(std::time::Duration),
    NoPeer,
    Failed(Failure),
}

pub(crate) fn error_cqe(wr: &SendWr, status: WcStatus, qpn: u32) -> Cqe {
    Cqe::new(wr.wr_id, status, wr.opcode.wc_opcode(), qpn)
}

fn wqe_status(e: WqeError) -> WcStatus {
    match e {
        WqeError::TooManySge(_) | WqeError::InlineTooLong(_) | WqeError::SlotTooSmall => WcStatus::LocLenErr,
        WqeError::BadOpcode(_) | WqeError::BadFlags(_) => WcStatus::LocQpOpErr,
    }
}

impl Hca {
    /// Runs every QP's queues once: at most `chunk_bytes` of payload per QP,
    /// so that one large transfer cannot starve the others.
    pub fn process(&mut self, now: Instant, io: &mut dyn Queues) -> Activity {
        let mut act = Activity::default();
        let mut i = 0;
        while let Some(&qpn) = self.qp_order.get(i) {
            i += 1;
            match self.qps.get(&qpn).map(|q| q.state()) {
                Some(QpState::Err) => self.flush(qpn, io, &mut act),
                // The send queue of a QP in SQE is flushed; its receive
                // queue keeps working.
                Some(QpState::Sqe) => self.flush_sends(qpn, io, &mut act),
                Some(QpState::Rts | QpState::Sqd) => self.run_send_queue(qpn, now, io, &mut act),
                _ => {}
            }
        }
        act
    }

    /// Completes everything queued on a QP in ERR with WR_FLUSH_ERR.
    fn flush(&mut self, qpn: u32, io: &mut dyn Queues, act: &mut Activity) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let (recv_cq, srq) = (qp.init.recv_cq, qp.init.srq);
        let bound = flush_bound(qp);
        let mut requeued: std::collections::VecDeque<RecvWr> = std::mem::take(&mut qp.requeued);
        self.flush_sends(qpn, io, act);
        if srq.is_some() {
            return;
        }
        for _ in 0..bound {
            let wr_id = match requeued.pop_front() {
                Some(r) => r.wr_id,
                None => match io.pull_recv(RecvSource::Qp(qpn)) {
                    Some(Ok(r)) => r.wr_id,
                    Some(Err((wr_id, _))) => wr_id,
                    None => break,
                },
            };
            act.busy = true;
            self.complete(recv_cq, Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, qpn), qpn, io);
        }
    }

    /// Completes the WR in flight and everything posted to the send queue
    /// with WR_FLUSH_ERR (a QP in ERR or SQE).
    fn flush_sends(&mut self, qpn: u32, io: &mut dyn Queues, act: &mut Activity) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let send_cq = qp.init.send_cq;
        let bound = flush_bound(qp);
        let dest = qp.attr.dest_qp_num;
        let inflight = qp.inflight.take();
        if let Some(inf) = inflight {
            act.busy = true;
            if let Some(r) = inf.recv {
                self.requeue_recv(dest, r);
            }
            self.complete(send_cq, error_cqe(&inf.wr, WcStatus::WrFlushErr, qpn), qpn, io);
        }
        for _ in 0..bound {
            let Some(pulled) = io.pull_send(qpn) else { break };
            act.busy = true;
            let cqe = match pulled {
                Ok(wr) => error_cqe(&wr, WcStatus::WrFlushErr, qpn),
                Err((wr_id, _)) => Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Send, qpn),
            };
            self.complete(send_cq, cqe, qpn, io);
        }
    }

    fn run_send_queue(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues, act: &mut Activity) {
        let mut budget = self.config.chunk_bytes.max(1);
        // Bounded: each round completes a WR, waits, or spends the budget.
        // At most WRS_PER_PASS WRs per QP per pass, whatever their size, so
        // that a tenant with deep queues of empty WRs cannot stretch a pass.
        let bound = self.qps.get(&qpn).map_or(0, |q| (q.init.cap.max_send_wr as usize + 1).min(WRS_PER_PASS));
        for _ in 0..bound {
            let Some(qp) = self.qps.get_mut(&qpn) else { return };
            if !matches!(qp.state(), QpState::Rts | QpState::Sqd) {
                return;
            }
            if qp.inflight.is_none() {
                if qp.state() == QpState::Sqd {
                    if std::mem::take(&mut qp.sqd_notify) {
                        let ev = AsyncEvent { event_type: AsyncEventType::SqDrained, element: qpn };
                        io.async_event(qp.ctx, ev);
                    }
                    return;
                }
                match io.pull_send(qpn) {
                    None => return,
                    Some(Ok(wr)) => {
                        qp.inflight = Some(Inflight {
                            wr,
                            done: 0,
                            recv: None,
                            next_try: now,
                            rnr_left: qp.attr.rnr_retry,
                            retry_deadline: None,
                        })
                    }
                    Some(Err((wr_id, e))) => {
                        act.busy = true;
                        let cq = qp.init.send_cq;
                        let cqe = Cqe::new(wr_id, wqe_status(e), WcOpcode::Send, qpn);
                        self.complete(cq, cqe, qpn, io);
                        self.send_queue_error(qpn, io);
                        return;
                    }
                }
            }
            let next_try = qp.inflight.as_ref().expect("set above").next_try;
            if next_try > now {
                act.timer(next_try);
                return;
            }
            act.busy = true;
            if !self.step(qpn, now, &mut budget, io, act) || budget == 0 {
                return;
            }
        }
    }

    /// Advances the head WR of `qpn`. Returns whether the WR finished and
    /// the next one may start in this pass.
    fn step(
        &mut self,
        qpn: u32,
        now: Instant,
        budget: &mut u64,
        io: &mut dyn Queues,
        act: &mut Activity,
    ) -> bool {
        let qp = self.qps.get_mut(&qpn).expect("caller checked");
        let mut inf = qp.inflight.take().expect("caller checked");
        let req = Requester {
            qpn,
            qp_type: qp.init.qp_type,
            tenant: qp.tenant,
            pd: qp.pd,
            send_cq: qp.init.send_cq,
            sig_all: qp.init.sq_sig_all,
            attr: qp.attr,
        };
        let exec = match req.qp_type {
            QpType::Ud => self.execute_ud(&req, &mut inf, budget, io),
            _ => self.execute(&req, &mut inf, budget, io),
        };
        match exec {
            Exec::Complete { byte_len } => {
                if inf.wr.flags.contains(crate::verbs::SendFlags::SIGNALED) || req.sig_all {
                    let mut cqe = Cqe::new(inf.wr.wr_id, WcStatus::Success, inf.wr.opcode.wc_opcode(), qpn);
                    cqe.byte_len = byte_len;
                    self.complete(req.send_cq, cqe, qpn, io);
                }
                true
            }
            Exec::Partial => {
                self.put_back(qpn, inf);
                false
            }
            Exec::Rnr(delay) => {
                if inf.rnr_left == 0 {
                    self.fail(&req, inf, Failure::local(WcStatus::RnrRetryExcErr), io);
                } else {
                    if inf.rnr_left != timers::RNR_RETRY_INFINITE {
                        inf.rnr_left -= 1;
                    }
                    inf.next_try = now + delay;
                    act.timer(inf.next_try);
                    self.put_back(qpn, inf);
                }
                false
            }
            Exec::NoPeer => {
                match timers::ack_timeout(req.attr.timeout) {
                    None => inf.next_try = now + PEER_POLL,
                    Some(t) => {
                        let deadline =
                            *inf.retry_deadline.get_or_insert(now + t * (req.attr.retry_cnt as u32 + 1));
                        if now >= deadline {
                            self.fail(&req, inf, Failure::local(WcStatus::RetryExcErr), io);
                            return false;
                        }
                        inf.next_try = (now + t).min(deadline);
                    }
                }
                act.timer(inf.next_try);
                self.put_back(qpn, inf);
                false
            }
            Exec::Failed(f) => {
                self.fail(&req, inf, f, io);
                false
            }
        }
    }

    fn put_back(&mut self, qpn: u32, inf: Inflight) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.inflight = Some(inf);
        }
    }

    /// Completes the WR in error on both sides as the failure says.
    fn fail(&mut self, req: &Requester, inf: Inflight, f: Failure, io: &mut dyn Queues) {
        let peer = req.attr.dest_qp_num;
        if let (Some(ev), Some(resp)) = (f.responder_event, self.qps.get(&peer)) {
            let (ctx, recv_cq) = (resp.ctx, resp.init.recv_cq);
            match (f.responder_recv, inf.recv) {
                (Some(status), Some(r)) => {
                    let cqe = Cqe::new(r.wr_id, status, WcOpcode::Recv, peer);
                    self.complete(recv_cq, cqe, peer, io);
                }
                // A receive claimed earlier (a write with immediate cut off
                // mid-transfer) goes back, so the responder's flush completes it.
                (None, Some(r)) => self.requeue_recv(peer, r),
                _ => {}
            }
            if self.qps.get(&peer).is_some_and(|p| p.state() != QpState::Err) {
                self.enter_error(peer, io);
                io.async_event(ctx, AsyncEvent { event_type: ev, element: peer });
            }
        } else if let Some(r) = inf.recv {
            self.requeue_recv(peer, r);
        }
        self.complete(req.send_cq, error_cqe(&inf.wr, f.requester, req.qpn), req.qpn, io);
        self.send_queue_error(req.qpn, io);
    }

    /// Whether an address vector names this device.
    fn is_local(&self, ah: &AhAttr) -> bool {
        if ah.is_global {
            self.config.gids.contains(&ah.dgid)
        } else {
            ah.dlid == self.config.port.lid
        }
    }

    fn responder(&self, req: &Requester) -> Option<Responder> {
        if !self.is_local(&req.attr.ah_attr) {
            return None;
        }
        let peer = self.qps.get(&req.attr.dest_qp_num)?;
        let ok = peer.tenant == req.tenant
            && peer.init.qp_type == QpType::Rc
            && peer.attr.dest_qp_num == req.qpn
            && peer.accepts_incoming();
        ok.then(|| self.responder_of(req.attr.dest_qp_num, peer))
    }

    fn responder_of(&self, qpn: u32, peer: &Qp) -> Responder {
        Responder {
            qpn,
            recv_pd: peer.init.srq.and_then(|s| self.srqs.get(&s)).map_or(peer.pd, |s| s.pd),
            pd: peer.pd,
            recv_cq: peer.init.recv_cq,
            srq: peer.init.srq,
            max_recv_sge: peer
                .init
                .srq
                .and_then(|s| self.srqs.get(&s))
                .map_or(peer.init.cap.max_recv_sge, |s| s.attr.max_sge),
            attr: peer.attr,
        }
    }

    fn resolve<'a>(&'a self, pd: u32, sges: &[Sge], need: AccessFlags) -> Option<Segs<'a>> {
        let mut out = Segs::new();
        for s in sges.iter().filter(|s| s.length > 0) {
            let mr = self.mrs.get(&s.lkey).filter(|m| m.pd == pd && m.access.contains(need))?;
            let off = mr.offset_of(s.addr, s.length as u64)?;
            out.push(Seg { region: &mr.region, off, len: s.length as usize });
        }
        Some(out)
    }

    fn remote_mr(&self, pd: u32, rkey: u32, need: AccessFlags) -> Option<&Mr> {
        self.mrs.get(&rkey).filter(|m| m.pd == pd && m.access.contains(need))
    }

    /// Takes the responder's next receive WR.
    fn take_recv(&mut self, resp: &Responder, io: &mut dyn Queues) -> Option<super::Pulled<RecvWr>> {
        match resp.srq {
            None => {
                let q = self.qps.get_mut(&resp.qpn)?;
                q.requeued.pop_front().map(Ok).or_else(|| io.pull_recv(RecvSource::Qp(resp.qpn)))
            }
            Some(s) => {
                let srq = self.srqs.get_mut(&s)?;
                let got = srq.requeued.pop_front().map(Ok).or_else(|| io.pull_recv(RecvSource::Srq(s)));
                if got.is_some() && srq.attr.srq_limit > 0 {
                    let left = io.recv_posted(RecvSource::Srq(s)) as usize + srq.requeued.len();
                    if left < srq.attr.srq_limit as usize {
                        srq.attr.srq_limit = 0;
                        let ev = AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: s };
                        io.async_event(srq.ctx, ev);
                    }
                }
                got
            }
        }
    }

    fn execute(
        &mut self,
        req: &Requester,
        inf: &mut Inflight,
        budget: &mut u64,
        io: &mut dyn Queues,
    ) -> Exec {
        use SendOpcode::*;
        let op = inf.wr.opcode;
        let cap = req.attr.cap;
        // Requester checks, before anything leaves the QP.
        if inf.wr.is_inline() {
            if !matches!(op, Send | SendWithImm | RdmaWrite | RdmaWriteWithImm) {
                return Exec::Failed(Failure::local(WcStatus::LocQpOpErr));
            }
            if inf.wr.inline_len as u32 > cap.max_inline_data {
                return Exec::Failed(Failure::local(WcStatus::LocLenErr));
            }
        } else if inf.wr.sg.as_slice().len() > cap.max_send_sge as usize {
            return Exec::Failed(Failure::local(WcStatus::LocLenErr));
        }
        let len = inf.wr.msg_len();
        if len > self.config.port.max_msg_sz as u64 || (op.is_atomic() && len < 8) {
            return Exec::Failed(Failure::local(WcStatus::LocLenErr));
        }
        let need_local = if op.writes_local() { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
        if !inf.wr.is_inline() && self.resolve(req.pd, inf.wr.sg.as_slice(), need_local).is_none() {
            return Exec::Failed(Failure::local(WcStatus::LocProtErr));
        }
        let Some(resp) = self.responder(req) else { return Exec::NoPeer };

        // Responder checks: QP access, rkey, and a receive WR if one is consumed.
        let need_remote = match op {
            RdmaWrite | RdmaWriteWithImm => AccessFlags::REMOTE_WRITE,
            RdmaRead => AccessFlags::REMOTE_READ,
            AtomicCmpAndSwp | AtomicFetchAndAdd => AccessFlags::REMOTE_ATOMIC,
            Send | SendWithImm => AccessFlags::empty(),
        };
        if !resp.attr.qp_access_flags.contains(need_remote) {
            return Exec::Failed(Failure::remote_access());
        }
        let remote_len = if op.is_atomic() { 8 } else { len };
        let mut remote_off = 0usize;
        if !need_remote.is_empty() && remote_len > 0 {
            let Some(mr) = self.remote_mr(resp.pd, inf.wr.rkey, need_remote) else {
                return Exec::Failed(Failure::remote_access());
            };
            let Some(off) = mr.offset_of(inf.wr.remote_addr, remote_len) else {
                return Exec::Failed(Failure::remote_access());
            };
            if op.is_atomic() && !inf.wr.remote_addr.is_multiple_of(8) {
                return Exec::Failed(Failure::remote_invalid(None));
            }
            remote_off = off;
        }
        if op.consumes_recv() && inf.recv.is_none() {
            match self.take_recv(&resp, io) {
                None => return Exec::Rnr(timers::rnr_delay(resp.attr.min_rnr_timer)),
                Some(Ok(r)) => inf.recv = Some(r),
                Some(Err((wr_id, _))) => {
                    inf.recv = Some(RecvWr { wr_id, sg: Default::default() });
                    return Exec::Failed(Failure {
                        requester: WcStatus::RemOpErr,
                        responder_event: Some(AsyncEventType::QpFatal),
                        responder_recv: Some(WcStatus::LocQpOpErr),
                    });
                }
            }
        }

        // The transfer, chunk by chunk; keys are re-checked at every chunk
        // so a deregistration takes effect at once.
        let local_segs = if inf.wr.is_inline() {
            Segs::new()
        } else {
            match self.resolve(req.pd, inf.wr.sg.as_slice(), need_local) {
                Some(s) => s,
                None => return Exec::Failed(Failure::local(WcStatus::LocProtErr)),
            }
        };
        let local =
            if inf.wr.is_inline() { Source::Inline(inf.wr.inline_data()) } else { Source::Segs(&local_segs) };
        fn remote_seg(mr: &Mr, off: usize, len: u64) -> Seg<'_> {
            Seg { region: &mr.region, off, len: len as usize }
        }
        match op {
            Send | SendWithImm => {
                let recv = inf.recv.as_ref().expect("taken above");
                if recv.sg.as_slice().len() > resp.max_recv_sge as usize {
                    return Exec::Failed(Failure::remote_invalid(Some(WcStatus::LocLenErr)));
                }
                let Some(dst) = self.resolve(resp.recv_pd, recv.sg.as_slice(), AccessFlags::LOCAL_WRITE)
                else {
                    return Exec::Failed(Failure {
                        requester: WcStatus::RemOpErr,
                        responder_event: Some(AsyncEventType::QpFatal),
                        responder_recv: Some(WcStatus::LocProtErr),
                    });
                };
                if (recv.sg.total_len()) < len {
                    return Exec::Failed(Failure::remote_invalid(Some(WcStatus::LocLenErr)));
                }
                let n = (*budget).min(len - inf.done);
                if copy_message(&dst, &local, inf.done, n).is_err() {
                    return Exec::Failed(Failure::local(WcStatus::LocProtErr));
                }
                inf.done += n;
                *budget -= n;
            }
            RdmaWrite | RdmaWriteWithImm => {
                if len > 0 {
                    let Some(mr) = self.remote_mr(resp.pd, inf.wr.rkey, need_remote) else {
                        return Exec::Failed(Failure::remote_access());
                    };
                    let n = (*budget).min(len - inf.done);
                    if copy_message(&[remote_seg(mr, remote_off, remote_len)], &local, inf.done, n).is_err() {
                        return Exec::Failed(Failure::remote_access());
                    }
                    inf.done += n;
                    *budget -= n;
                }
            }
            RdmaRead => {
                if len > 0 {
                    let Some(mr) = self.remote_mr(resp.pd, inf.wr.rkey, need_remote) else {
                        return Exec::Failed(Failure::remote_access());
                    };
                    let src = [remote_seg(mr, remote_off, remote_len)];
                    let n = (*budget).min(len - inf.done);
                    if copy_message(&local_segs, &Source::Segs(&src), inf.done, n).is_err() {
                        return Exec::Failed(Failure::local(WcStatus::LocProtErr));
                    }
                    inf.done += n;
                    *budget -= n;
                }
            }
            AtomicCmpAndSwp | AtomicFetchAndAdd => {
                let Some(mr) = self.remote_mr(resp.pd, inf.wr.rkey, need_remote) else {
                    return Exec::Failed(Failure::remote_access());
                };
                let old = match op {
                    AtomicCmpAndSwp => mr.region.compare_swap(remote_off, inf.wr.compare_add, inf.wr.swap),
                    _ => mr.region.fetch_add(remote_off, inf.wr.compare_add),
                };
                let Ok(old) = old else { return Exec::Failed(Failure::remote_invalid(None)) };
                let bytes = old.to_le_bytes();
                if copy_message(&local_segs, &Source::Inline(&bytes), 0, 8).is_err() {
                    return Exec::Failed(Failure::local(WcStatus::LocProtErr));
                }
                inf.done = len;
                *budget = budget.saturating_sub(8);
            }
        }
        drop(local_segs);
        if inf.done < len {
            return Exec::Partial;
        }

        // Placed: the responder's completion first, as its HCA writes it
        // before the requester sees the acknowledgement.
        if let Some(recv) = inf.recv.take() {
            let opcode = if op == RdmaWriteWithImm { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
            let mut cqe = Cqe::new(recv.wr_id, WcStatus::Success, opcode, resp.qpn);
            cqe.byte_len = len as u32;
            cqe.src_qp = req.qpn;
            cqe.slid = self.config.port.lid;
            cqe.solicited = inf.wr.flags.contains(crate::verbs::SendFlags::SOLICITED);
            if op.has_imm() {
                cqe.wc_flags = WcFlags::WITH_IMM;
                cqe.imm_data = inf.wr.imm_data;
            }
            self.complete(resp.recv_cq, cqe, resp.qpn, io);
        }
        Exec::Complete { byte_len: if op == RdmaRead || op.is_atomic() { len as u32 } else { 0 } }
    }
}

impl Hca {
    /// A UD send: the sender's checks, then delivery to the QP the WR
    /// names if it is there to receive it. Every failure at the receiver
    /// leaves the sender's completion successful.
    fn execute_ud(
        &mut self,
        req: &Requester,
        inf: &mut Inflight,
        budget: &mut u64,
        io: &mut dyn Queues,
    ) -> Exec {
        let wr = &inf.wr;
        let cap = req.attr.cap;
        if !matches!(wr.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            return Exec::Failed(Failure::local(WcStatus::LocQpOpErr));
        }
        if wr.is_inline() {
            if wr.inline_len as u32 > cap.max_inline_data {
                return Exec::Failed(Failure::local(WcStatus::LocLenErr));
            }
        } else if wr.sg.as_slice().len() > cap.max_send_sge as usize {
            return Exec::Failed(Failure::local(WcStatus::LocLenErr));
        }
        // The address handle must be one of the QP's protection domain.
        let Some(ah) = self.ahs.get(&wr.ud.ah).filter(|a| a.pd == req.pd).map(|a| a.attr) else {
            return Exec::Failed(Failure::local(WcStatus::LocQpOpErr));
        };
        let len = wr.msg_len();
        if len > u64::from(self.config.port.active_mtu.bytes()) {
            return Exec::Failed(Failure::local(WcStatus::LocLenErr));
        }
        if !wr.is_inline() && self.resolve(req.pd, wr.sg.as_slice(), AccessFlags::empty()).is_none() {
            return Exec::Failed(Failure::local(WcStatus::LocProtErr));
        }
        *budget = budget.saturating_sub(len);
        // From here on the datagram has left: whatever becomes of it, the
        // sender completes successfully.
        let Some(resp) = self.ud_receiver(req, &ah, wr.ud) else { return Exec::Complete { byte_len: 0 } };
        let recv = match self.take_recv(&resp, io) {
            // No receive posted: UD has no RNR, the datagram is dropped.
            None => return Exec::Complete { byte_len: 0 },
            Some(Ok(r)) => r,
            Some(Err((wr_id, _))) => {
                self.ud_recv_error(&resp, wr_id, WcStatus::LocQpOpErr, io);
                return Exec::Complete { byte_len: 0 };
            }
        };
        let wr = &inf.wr;
        let grh = ah.is_global.then(|| self.grh(&ah, len, wr.opcode.has_imm()));
        match self.place_datagram(req.pd, wr, &resp, &recv, grh.as_ref()) {
            Ok(()) => {
                let mut cqe = Cqe::new(recv.wr_id, WcStatus::Success, WcOpcode::Recv, resp.qpn);
                cqe.byte_len = (GRH_LEN as u64 + len) as u32;
                cqe.src_qp = req.qpn;
                cqe.slid = self.config.port.lid;
                cqe.sl = ah.sl;
                cqe.pkey_index = 0;
                cqe.solicited = wr.flags.contains(SendFlags::SOLICITED);
                if ah.is_global {
                    cqe.wc_flags |= WcFlags::GRH;
                }
                if wr.opcode.has_imm() {
                    cqe.wc_flags |= WcFlags::WITH_IMM;
                    cqe.imm_data = wr.imm_data;
                }
                self.complete(resp.recv_cq, cqe, resp.qpn, io);
                Exec::Complete { byte_len: 0 }
            }
            Err(Placement::Recv(status)) => {
                self.ud_recv_error(&resp, recv.wr_id, status, io);
                Exec::Complete { byte_len: 0 }
            }
            Err(Placement::Local(status)) => {
                self.requeue_recv(resp.qpn, recv);
                Exec::Failed(Failure::local(status))
            }
        }
    }

    /// The QP a datagram is delivered to: on this device (the address
    /// handle names this host), of the sender's tenant, a UD QP able to
    /// receive, whose Q_Key matches. `None`: the datagram is lost.
    fn ud_receiver(&self, req: &Requester, ah: &AhAttr, ud: crate::ring::UdDest) -> Option<Responder> {
        if !self.is_local(ah) || ud.remote_qpn == MULTICAST_QPN {
            return None;
        }
        let peer = self.qps.get(&ud.remote_qpn)?;
        let qkey = if ud.remote_qkey & QKEY_FROM_QP != 0 { req.attr.qkey } else { ud.remote_qkey };
        let ok = peer.tenant == req.tenant
            && peer.init.qp_type == QpType::Ud
            && peer.accepts_incoming()
            && peer.attr.qkey == qkey;
        ok.then(|| self.responder_of(ud.remote_qpn, peer))
    }

    /// Writes the GRH (when there is one) and the payload into the
    /// receive's buffers: the payload starts at byte 40 either way.
    fn place_datagram(
        &self,
        pd: u32,
        wr: &SendWr,
        resp: &Responder,
        recv: &RecvWr,
        grh: Option<&[u8; GRH_LEN]>,
    ) -> Result<(), Placement> {
        if recv.sg.as_slice().len() > resp.max_recv_sge as usize {
            return Err(Placement::Recv(WcStatus::LocLenErr));
        }
        let Some(dst) = self.resolve(resp.recv_pd, recv.sg.as_slice(), AccessFlags::LOCAL_WRITE) else {
            return Err(Placement::Recv(WcStatus::LocProtErr));
        };
        let len = wr.msg_len();
        if recv.sg.total_len() < GRH_LEN as u64 + len {
            return Err(Placement::Recv(WcStatus::LocLenErr));
        }
        if let Some(g) = grh {
            copy_message(&dst, &Source::Inline(g), 0, GRH_LEN as u64)
                .map_err(|_| Placement::Recv(WcStatus::LocProtErr))?;
        }
        let payload = skip(&dst, GRH_LEN);
        let local_segs;
        let src = if wr.is_inline() {
            Source::Inline(wr.inline_data())
        } else {
            local_segs = self
                .resolve(pd, wr.sg.as_slice(), AccessFlags::empty())
                .ok_or(Placement::Local(WcStatus::LocProtErr))?;
            Source::Segs(&local_segs)
        };
        copy_message(&payload, &src, 0, len).map_err(|_| Placement::Local(WcStatus::LocProtErr))
    }

    /// The receiver failed to take a datagram: its receive completes with
    /// `status` and its QP goes to ERR.
    fn ud_recv_error(&mut self, resp: &Responder, wr_id: u64, status: WcStatus, io: &mut dyn Queues) {
        let cqe = Cqe::new(wr_id, status, WcOpcode::Recv, resp.qpn);
        self.complete(resp.recv_cq, cqe, resp.qpn, io);
        self.enter_error(resp.qpn, io);
    }

    /// An InfiniBand GRH as the receiver's HCA would scatter it: IP version
    /// 6, traffic class and flow label from the AH, the payload length of
    /// the packet after the GRH (BTH, DETH, immediate, padded payload,
    /// ICRC), next header 0x1B (IBA transport), hop limit, SGID, DGID.
    fn grh(&self, ah: &AhAttr, len: u64, imm: bool) -> [u8; GRH_LEN] {
        let mut g = [0u8; GRH_LEN];
        let word0 = (6u32 << 28) | (u32::from(ah.traffic_class) << 20) | (ah.flow_label & 0xf_ffff);
        g[0..4].copy_from_slice(&word0.to_be_bytes());
        let pay_len = 12 + 8 + if imm { 4 } else { 0 } + len.next_multiple_of(4) + 4;
        g[4..6].copy_from_slice(&(pay_len as u16).to_be_bytes());
        g[6] = 0x1b;
        g[7] = ah.hop_limit;
        let sgid = self.config.gids.get(ah.sgid_index as usize).copied().unwrap_or_default();
        g[8..24].copy_from_slice(&sgid.0);
        g[24..40].copy_from_slice(&ah.dgid.0);
        g
    }
}

/// The work-request bound of a flush: everything both queues can hold.
fn flush_bound(qp: &Qp) -> usize {
    (qp.init.cap.max_send_wr + qp.init.cap.max_recv_wr) as usize + 1
}

/// `segs` without their first `n` bytes.
fn skip<'a>(segs: &[Seg<'a>], mut n: usize) -> Segs<'a> {
    let mut out = Segs::new();
    for s in segs {
        if n >= s.len {
            n -= s.len;
            continue;
        }
        out.push(Seg { region: s.region, off: s.off + n, len: s.len - n });
        n = 0;
    }
    out
}

/// Copies bytes `[start, start+len)` of a message from `src` into the same
/// bytes of `dst`, both given as lists of segments.
fn copy_message(dst: &[Seg], src: &Source, start: u64, len: u64) -> Result<(), OutOfBounds> {
    match src {
        Source::Segs(segs) => copy_spans(dst, segs, start, len, |d, doff, si, soff, n| {
            let s = &segs[si];
            d.region.copy_from(d.off + doff, s.region, s.off + soff, n)
        }),
        Source::Inline(b) => copy_spans(dst, &[b.len()], start, len, |d, doff, _, soff, n| {
            d.region.write(d.off + doff, &b[soff..soff + n])
        }),
    }
}

/// Walks `dst` and `src` from message offset `start` for `len` bytes and
/// calls `copy(dst_seg, dst_off, src_index, src_off, n)` for each piece.
fn copy_spans<T: Span>(
    dst: &[Seg],
    src: &[T],
    start: u64,
    len: u64,
    mut copy: impl FnMut(&Seg, usize, usize, usize, usize) -> Result<(), OutOfBounds>,
) -> Result<(), OutOfBounds> {
    let mut d = Cursor::new(dst, start);
    let mut s = Cursor::new(src, start);
    let mut left = len as usize;
    while left > 0 {
        let (Some((di, doff, dleft)), Some((si, soff, sleft))) = (d.at(), s.at()) else {
            return Err(OutOfBounds { offset: start as usize, len: len as usize, region_len: 0 });
        };
        let n = left.min(dleft).min(sleft);
        copy(&dst[di], doff, si, soff, n)?;
        d.advance(n);
        s.advance(n);
        left -= n;
    }
    Ok(())
}

/// Something with a length: a segment, or the length of inline data.
trait Span {
    fn span(&self) -> usize;
}

impl Span for Seg<'_> {
    fn span(&self) -> usize {
        self.len
    }
}

impl Span for usize {
    fn span(&self) -> usize {
        *self
    }
}

/// A position in a list of spans: which one, and how far into it.
struct Cursor<'s, T> {
    spans: &'s [T],
    idx: usize,
    off: usize,
}

impl<'s, T: Span> Cursor<'s, T> {
    fn new(spans: &'s [T], start: u64) -> Self {
        let mut c = Cursor { spans, idx: 0, off: 0 };
        c.advance(start as usize);
        c
    }

    fn advance(&mut self, n: usize) {
        self.off += n;
        while self.idx < self.spans.len() && self.off >= self.spans[self.idx].span() {
            self.off -= self.spans[self.idx].span();
            self.idx += 1;
        }
    }

    /// (span index, offset in it, bytes left in it)
    fn at(&self) -> Option<(usize, usize, usize)> {
        let s = self.spans.get(self.idx)?;
        Some((self.idx, self.off, s.span() - self.off))
    }
}
