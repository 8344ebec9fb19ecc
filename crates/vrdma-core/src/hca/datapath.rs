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

use super::objects::{Inflight, Mr};
use super::AsyncEvent;
use super::TenantId;
use super::{Hca, Queues, RecvSource};
use crate::memory::{OutOfBounds, Region};
use crate::qp::timers;
use crate::ring::{Cqe, RecvWr, SendWr, Sge, WqeError};
use crate::time::Instant;
use crate::verbs::{
    AccessFlags, AhAttr, AsyncEventType, QpAttr, QpState, QpType, SendOpcode, WcFlags, WcOpcode, WcStatus,
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

/// How long the engine waits before looking again for a peer when the QP's
/// timeout is 0 (wait forever).
const PEER_POLL: std::time::Duration = std::time::Duration::from_millis(1);

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
                Some(QpState::Rts | QpState::Sqd) => self.run_send_queue(qpn, now, io, &mut act),
                _ => {}
            }
        }
        act
    }

    /// Completes everything queued on a QP in ERR with WR_FLUSH_ERR.
    fn flush(&mut self, qpn: u32, io: &mut dyn Queues, act: &mut Activity) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let (send_cq, recv_cq, srq) = (qp.init.send_cq, qp.init.recv_cq, qp.init.srq);
        let bound = (qp.init.cap.max_send_wr + qp.init.cap.max_recv_wr) as usize + 1;
        let dest = qp.attr.dest_qp_num;
        let inflight = qp.inflight.take();
        let mut requeued: std::collections::VecDeque<RecvWr> = std::mem::take(&mut qp.requeued);
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

    fn run_send_queue(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues, act: &mut Activity) {
        let mut budget = self.config.chunk_bytes.max(1);
        // Bounded: each round completes a WR, waits, or spends the budget.
        let bound = self.qps.get(&qpn).map_or(0, |q| q.init.cap.max_send_wr as usize + 1);
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
                        self.enter_error(qpn, io);
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
            tenant: qp.tenant,
            pd: qp.pd,
            send_cq: qp.init.send_cq,
            sig_all: qp.init.sq_sig_all,
            attr: qp.attr,
        };
        match self.execute(&req, &mut inf, budget, io) {
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
        self.enter_error(req.qpn, io);
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
        ok.then(|| Responder {
            qpn: req.attr.dest_qp_num,
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
        })
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
