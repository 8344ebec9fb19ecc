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
use super::schedule::Left;
use super::AsyncEvent;
use super::TenantId;
use super::{Hca, Queues, RecvSource};
use crate::memory::Region;
use crate::qp::timers;
use crate::ring::{Cqe, RecvWr, SendWr, Sge, WqeError};
use crate::time::Instant;
use crate::verbs::{
    AccessFlags, AhAttr, AsyncEventType, QpAttr, QpState, QpType, SendFlags, SendOpcode, WcFlags, WcOpcode,
    WcStatus,
};

mod copy;
mod rc;
mod ud;

use copy::{copy_message, skip};
pub use ud::GRH_LEN;
pub(crate) use ud::{effective_qkey, grh_bytes};

/// What a call to [`Hca::process`] found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Work was done; call again soon.
    pub busy: bool,
    /// No work was done, but some may be waiting (QPs not yet visited,
    /// notices not yet taken): call again, but a driver short of CPUs may
    /// let others run first. A tenant that wakes idle QPs without end
    /// keeps the engine from sleeping this way, never from yielding.
    pub pending: bool,
    /// More than one tenant had QPs to serve in this pass.
    pub contended: bool,
    /// The earliest moment a waiting work request may run again.
    pub next_timer: Option<Instant>,
}

impl Activity {
    /// Whether to call again without sleeping.
    pub fn again(&self) -> bool {
        self.busy || self.pending
    }

    pub fn timer(&mut self, t: Instant) {
        self.next_timer = Some(self.next_timer.map_or(t, |n| n.min(t)));
    }
}

/// Most send WRs one QP starts in one engine pass.
pub(crate) const WRS_PER_PASS: usize = 64;

/// How long the engine waits before looking again for a peer when the QP's
/// timeout is 0 (wait forever).
const PEER_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// How long a datagram waits for a link to its host before it is lost.
const UD_LINK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A resolved piece of a message: `len` bytes at `off` in `region`.
pub(crate) struct Seg<'a> {
    pub(crate) region: &'a Region,
    pub(crate) off: usize,
    pub(crate) len: usize,
}

/// The resolved SGEs of one work request, kept on the stack.
pub(crate) type Segs<'a> = arrayvec::ArrayVec<Seg<'a>, { crate::ring::MAX_SGE }>;

enum Source<'a> {
    Segs(&'a [Seg<'a>]),
    Inline(&'a [u8]),
}

/// The requester's attributes, copied out so the responder can be borrowed.
pub(crate) struct Requester {
    pub(crate) qpn: u32,
    pub(crate) qp_type: QpType,
    pub(crate) tenant: TenantId,
    pub(crate) pd: u32,
    pub(crate) send_cq: u32,
    pub(crate) sig_all: bool,
    pub(crate) attr: QpAttr,
}

/// The responder's attributes.
pub(crate) struct Responder {
    pub(crate) qpn: u32,
    pub(crate) recv_pd: u32,
    pub(crate) pd: u32,
    pub(crate) recv_cq: u32,
    pub(crate) srq: Option<u32>,
    pub(crate) max_recv_sge: u32,
    pub(crate) attr: QpAttr,
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
pub(crate) struct Failure {
    requester: WcStatus,
    /// The responder goes to ERR with this async event...
    responder_event: Option<AsyncEventType>,
    /// ...and completes the receive it consumed with this status.
    responder_recv: Option<WcStatus>,
}

impl Failure {
    pub(crate) fn local(status: WcStatus) -> Self {
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

pub(crate) enum Exec {
    Complete { byte_len: u32 },
    Partial,
    Rnr(std::time::Duration),
    NoPeer,
    Failed(Failure),
}

pub(crate) fn error_cqe(wr: &SendWr, status: WcStatus, qpn: u32) -> Cqe {
    Cqe::new(wr.wr_id, status, wr.opcode.wc_opcode(), qpn)
}

pub(crate) fn wqe_status(e: WqeError) -> WcStatus {
    match e {
        WqeError::TooManySge(_) | WqeError::InlineTooLong(_) | WqeError::SlotTooSmall => WcStatus::LocLenErr,
        WqeError::BadOpcode(_) | WqeError::BadFlags(_) => WcStatus::LocQpOpErr,
    }
}

impl Hca {
    /// Gives the QPs with work their turns: each turn moves at most
    /// `chunk_bytes` of payload or starts at most 64 WRs, so that one large
    /// transfer cannot starve the others, and each tenant gets at most
    /// `tenant_turns` turns that do work a pass and
    /// [`IDLE_TURNS`](super::IDLE_TURNS) that do none, so that nothing a
    /// tenant does (thousands of QPs with work, thousands woken at once)
    /// makes a pass, and so every other tenant's wait, longer than that
    /// (see [`super::schedule`]). The QPs a tenant's share left out go first in
    /// its next share.
    ///
    /// Only QPs with work are visited: those named by
    /// [`Queues::take_posted`], woken by a frame or a change of state, or
    /// with something in progress. A QP whose turn finds nothing to do and
    /// nothing pending is left out of later passes ([`Queues::park_queues`]),
    /// so idle QPs, however many, cost a pass nothing.
    pub fn process(&mut self, now: Instant, io: &mut dyn Queues) -> Activity {
        let mut act = Activity::default();
        self.flush_pending = false;
        act.pending |= self.wake_posted(io);
        self.sweep_some();
        self.order.begin_pass();
        let tenants = self.order.tenants_waiting();
        // Bytes bound a share only while tenants contend: one tenant alone
        // keeps the engine's whole pass.
        // (Counted among those that may have work: a tenant whose QPs only
        // wait for a timer costs another nothing.)
        let contending = tenants > 1 && self.order.tenants_contending() > 1;
        let quantum = contending.then(|| self.config.contended_bytes.max(1));
        act.contended = contending;
        for _ in 0..tenants {
            let Some(mut share) = self.order.next_share(quantum, self.config.tenant_turns, now) else {
                break;
            };
            self.run_share(&mut share, quantum, now, io, &mut act);
        }
        // A sweep under way finishes before the engine may sleep.
        act.pending |= !self.sweeping.is_empty();
        act
    }

    /// Runs one tenant's share of a pass: its QPs' turns while the share
    /// allows, then its end (what it left, charged and counted).
    ///
    /// While a latency-class tenant is active, another tenant's share
    /// looks between two turns whether the posted rings named a QP of
    /// one, and serves that tenant's share there, out of its turn: its
    /// message waits a turn (a chunk), and the share it cut goes on
    /// where it stopped, with its turns, bytes and slice as they were,
    /// rather than ending with the pass (a hog beside a ping-pong would
    /// pay for a pass a message). `quantum`: the pass's (see
    /// `ServiceOrder::next_share`).
    fn run_share(
        &mut self,
        share: &mut super::schedule::Share,
        quantum: Option<u64>,
        now: Instant,
        io: &mut dyn Queues,
        act: &mut Activity,
    ) {
        let tenant = share.tenant;
        // One clock read per turn (and one per share), never per
        // message: the ends of turns bound engine time, throttled time
        // and latency (see `metrics`).
        let mut clock = self.metrics.clock_or(now);
        // A tenant passed over for its rate limit has no share: its
        // throttled time runs on from its last one.
        let served = share.throttled.is_none();
        if served {
            self.counters(tenant).share_start(clock);
        }
        share.start(clock);
        // A share bounded in time takes turns of a chunk whatever its
        // weight, so that it ends close to its slice.
        let weight = if share.slice.is_some() { 1 } else { share.weight };
        // Only a share bounded in time looks for latency tenants (a
        // latency tenant's own is not), and only while one is active.
        let looks = share.slice.is_some() && self.order.latency_active(now);
        let mut turned = false;
        loop {
            // A slice over: the share goes on for another unless a tenant
            // that goes before it waits (one the posted rings name now),
            // so a busy tenant keeps its share between a latency tenant's
            // messages without paying for a pass each slice.
            let over = !share.more_at(clock);
            if over && !share.slice_over(clock) {
                break;
            }
            if (looks && turned) || over {
                act.pending |= self.wake_posted(io);
                if looks {
                    if let Some(t) = self.order.latency_waiting(now) {
                        // One turn: a message, not a share of a stream (a
                        // latency tenant that streams gets a turn between
                        // two of the others', and its share in its turn).
                        let mut first = self.order.take_share(t, quantum, 1, now);
                        self.run_share(&mut first, quantum, now, io, act);
                        clock = self.metrics.clock_or(now);
                    }
                }
                if over {
                    if self.order.preempts(share) {
                        break;
                    }
                    share.start(clock);
                }
            }
            turned = false;
            let Some(qpn) = self.order.pop(tenant) else { break };
            // An entry of a QP that stopped being served (or is gone,
            // or whose number now names another tenant's QP) leaves.
            let Some(qp) = self.qps.get_mut(&qpn).filter(|q| q.in_order && q.tenant == tenant) else {
                share.count(false);
                continue;
            };
            if !qp.served {
                qp.in_order = false;
                share.count(false);
                continue;
            }
            // A held ACK goes out with the link's next frame when due;
            // the engine must be awake then.
            let ack = qp.remote.as_ref().and_then(|r| r.recv.as_ref()).and_then(|r| r.ack_due());
            let chunk = self.config.chunk_bytes.max(1).saturating_mul(weight.into());
            self.turn_bytes = share.bytes.min(share.turn_bytes(chunk));
            self.turn_spent = 0;
            self.turn_messages = share.messages;
            self.metrics.turn_start = clock;
            let turn = self.turn(qpn, now, io);
            let end = self.metrics.clock_or(now);
            let mut pending = self.metrics.take_pending();
            super::metrics::Metrics::turn_end(self.counters(tenant), &mut pending, clock, end);
            self.metrics.put_pending(pending);
            clock = end;
            share.bytes = share.bytes.saturating_sub(self.turn_spent);
            share.messages = self.turn_messages;
            self.turn_messages = u64::MAX;
            let timer = match (turn.next_timer, ack) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if let Some(t) = timer {
                act.timer(t);
            }
            let parked = self.after_turn(qpn, &turn, now, io);
            let keep = !parked && self.qps.get(&qpn).is_some_and(|q| q.served);
            if !keep {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.in_order = false;
                }
            }
            act.busy |= turn.busy;
            turned = true;
            share.count(turn.busy);
            self.order.after_turn(tenant, qpn, keep, turn.busy, timer);
        }
        match self.order.end_share(share, now) {
            Left::Work => {
                act.pending = true;
                self.counters(tenant).left_work(clock);
            }
            Left::Throttled(t) => {
                act.timer(t);
                let c = self.counters(tenant);
                c.throttled_shares += 1;
                if served {
                    c.left_work(clock);
                }
            }
            Left::Quiet(Some(t)) => act.timer(t),
            Left::Quiet(None) => {}
        }
    }

    /// One QP's turn: its send queue, or its flush.
    fn turn(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues) -> Activity {
        let mut turn = Activity::default();
        let Some(qp) = self.qps.get(&qpn) else { return turn };
        let remote = qp.init.qp_type == QpType::Rc && !self.is_local(&qp.attr.ah_attr);
        match qp.state() {
            QpState::Err => self.flush(qpn, io, &mut turn),
            // The send queue of a QP in SQE is flushed; its receive
            // queue keeps working.
            QpState::Sqe => self.flush_sends(qpn, io, &mut turn),
            QpState::Rts | QpState::Sqd if remote => self.run_remote_requester(qpn, now, io, &mut turn),
            QpState::Rts | QpState::Sqd => self.run_send_queue(qpn, now, io, &mut turn),
            _ => {}
        }
        turn
    }

    /// Serves the QPs the driver says were posted to; `true` when it
    /// left notices for the next pass.
    fn wake_posted(&mut self, io: &mut dyn Queues) -> bool {
        let mut posted = std::mem::take(&mut self.posted);
        let more = io.take_posted(self.notices_per_tenant, &mut posted);
        for &qpn in &posted {
            self.update_service(qpn);
        }
        posted.clear();
        self.posted = posted;
        more
    }

    /// After a QP's turn: counts work a sweep found, and parks the QP if
    /// the turn found nothing to do, nothing is pending and nothing is
    /// posted. Returns whether it parked it.
    fn after_turn(&mut self, qpn: u32, turn: &Activity, now: Instant, io: &mut dyn Queues) -> bool {
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        let idle = !turn.busy && turn.next_timer.is_none() && qp.is_quiescent();
        let mut missed_by = None;
        // Work a post brought that its notice has yet to announce was not
        // missed. (A post whose owner has pushed its WRs and not yet
        // named it, a window of nanoseconds, can still count.)
        if std::mem::take(&mut qp.swept) && !idle && !io.named_since_parked(qpn) {
            self.missed_wakeups += 1;
            // A tenant that never names its QPs makes one per QP per sweep:
            // the count says how many, the log only now and then.
            const MISSED: &str = "a sweep found work on a QP that was left idle: a wake-up was missed";
            let (missed, owner) = (self.missed_wakeups, qp.tenant);
            let tenant = crate::log_limit::Source::Tenant(owner);
            crate::limited_warn!(self.log, tenant, now, MISSED, qpn, missed);
            missed_by = Some(owner);
        }
        let recv_too = qp.state() == QpState::Err && qp.init.srq.is_none();
        if let Some(owner) = missed_by {
            // Its own count too: a tenant sees its own, never the daemon's.
            self.counters(owner).missed_wakeups += 1;
        }
        if idle && io.park_queues(qpn, recv_too) {
            self.park(qpn);
            return true;
        }
        false
    }

    /// Completes everything queued on a QP in ERR with WR_FLUSH_ERR.
    fn flush(&mut self, qpn: u32, io: &mut dyn Queues, act: &mut Activity) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let (recv_cq, srq, dest, ah) = (qp.init.recv_cq, qp.init.srq, qp.attr.dest_qp_num, qp.attr.ah_attr);
        let bound = flush_bound(qp);
        let mut requeued: std::collections::VecDeque<RecvWr> = std::mem::take(&mut qp.requeued);
        // A receive claimed by a message arriving from another host.
        if let Some(r) = qp.remote.as_deref_mut().and_then(|r| r.recv.as_mut()).and_then(|r| r.take_claimed())
        {
            requeued.push_front(r);
        }
        self.flush_sends(qpn, io, act);
        // A receive a direct-path requester claimed for this QP and never
        // completed is flushed on this QP's CQ, as hardware flushes a WQE
        // a QP consumed when it goes to ERR, an SRQ's included (its entry
        // may be reused once claimed: it cannot go back). It comes before
        // every receive still in the ring (it was claimed first) and those
        // given back (no claim while any is given back).
        // While the requester exists it may still claim (a process
        // stopped, or on its way to its claim): what it holds for this QP
        // stays its own until it goes (`Hca::remove_qps` asks again then).
        let rq = srq.map_or(RecvSource::Qp(qpn), RecvSource::Srq);
        if io.flush_claimed(qpn, rq, !self.requester_exists(qpn, dest, &ah)) {
            act.busy = true;
        }
        if srq.is_some() {
            // A receive this QP took from its SRQ for a message that never
            // finished goes back to the SRQ, as on this host when the
            // requester goes: as if the message had never arrived.
            for r in requeued.into_iter().rev() {
                self.requeue_recv(qpn, r);
            }
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
        // Past the bound: the rest is flushed in the next passes, first.
        if !requeued.is_empty() {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                requeued.append(&mut qp.requeued);
                qp.requeued = requeued;
            }
        }
    }

    /// Completes the WR in flight and everything posted to the send queue
    /// with WR_FLUSH_ERR (a QP in ERR or SQE).
    fn flush_sends(&mut self, qpn: u32, io: &mut dyn Queues, act: &mut Activity) {
        if self.flush_remote_sends(qpn, io) {
            act.busy = true;
        }
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
            io.send_retired(qpn, 1);
            self.complete(send_cq, error_cqe(&inf.wr, WcStatus::WrFlushErr, qpn), qpn, io);
        }
        for _ in 0..bound {
            let Some(pulled) = io.pull_send(qpn) else { break };
            act.busy = true;
            io.send_retired(qpn, 1);
            let cqe = match pulled {
                Ok(wr) => error_cqe(&wr, WcStatus::WrFlushErr, qpn),
                Err((wr_id, _)) => Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Send, qpn),
            };
            self.complete(send_cq, cqe, qpn, io);
        }
    }

    fn run_send_queue(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues, act: &mut Activity) {
        let start = self.turn_bytes.max(1);
        let mut budget = start;
        self.run_send_queue_within(qpn, now, &mut budget, io, act);
        self.turn_spent = start - budget;
    }

    fn run_send_queue_within(
        &mut self,
        qpn: u32,
        now: Instant,
        budget: &mut u64,
        io: &mut dyn Queues,
        act: &mut Activity,
    ) {
        // Bounded: each round completes a WR, waits, or spends the budget.
        // At most WRS_PER_PASS WRs per QP per pass, whatever their size, so
        // that a tenant with deep queues of empty WRs cannot stretch a pass.
        let bound = self.qps.get(&qpn).map_or(0, |q| (q.init.cap.max_send_wr as usize + 1).min(WRS_PER_PASS));
        let taken = self.metrics.turn_start;
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
                // The share's messages (its tenant's rate limit) are spent.
                if self.turn_messages == 0 {
                    return;
                }
                let pulled = io.pull_send(qpn);
                if pulled.is_some() {
                    self.turn_messages -= 1;
                }
                match pulled {
                    None => return,
                    Some(Ok(wr)) => {
                        qp.inflight = Some(Inflight {
                            wr,
                            done: 0,
                            recv: None,
                            next_try: now,
                            rnr_left: qp.attr.rnr_retry,
                            retry_deadline: None,
                            taken,
                        })
                    }
                    Some(Err((wr_id, e))) => {
                        act.busy = true;
                        io.send_retired(qpn, 1);
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
            if !self.step(qpn, now, budget, io, act) || *budget == 0 {
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
        let req = self.requester_of(qpn).expect("caller checked");
        let qp = self.qps.get_mut(&qpn).expect("caller checked");
        let mut inf = qp.inflight.take().expect("caller checked");
        let exec = match req.qp_type {
            QpType::Ud => self.execute_ud(&req, &mut inf, budget, io),
            _ => self.execute(&req, &mut inf, budget, io),
        };
        match exec {
            Exec::Complete { byte_len } => {
                io.send_retired(qpn, 1);
                self.counters(req.tenant).sent(inf.wr.msg_len());
                if inf.wr.flags.contains(crate::verbs::SendFlags::SIGNALED) || req.sig_all {
                    self.metrics.completed_in_turn(inf.taken);
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
            // A datagram for a host no link reaches yet waits a little for
            // the link the driver is dialling, then is lost, as a datagram
            // may be.
            Exec::NoPeer if req.qp_type == QpType::Ud => {
                let deadline = *inf.retry_deadline.get_or_insert(now + UD_LINK_WAIT);
                if now >= deadline {
                    self.complete_datagram(&req, inf, io);
                    return true;
                }
                inf.next_try = now + PEER_POLL;
                act.timer(inf.next_try);
                self.put_back(qpn, inf);
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

    /// A datagram that could not be sent completes successfully anyway: a
    /// UD sender is never told of a loss.
    fn complete_datagram(&mut self, req: &Requester, inf: Inflight, io: &mut dyn Queues) {
        io.send_retired(req.qpn, 1);
        self.counters(req.tenant).sent(inf.wr.msg_len());
        if inf.wr.flags.contains(SendFlags::SIGNALED) || req.sig_all {
            self.metrics.completed_in_turn(inf.taken);
            let cqe = Cqe::new(inf.wr.wr_id, WcStatus::Success, inf.wr.opcode.wc_opcode(), req.qpn);
            self.complete(req.send_cq, cqe, req.qpn, io);
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
        io.send_retired(req.qpn, 1);
        self.complete(req.send_cq, error_cqe(&inf.wr, f.requester, req.qpn), req.qpn, io);
        self.send_queue_error(req.qpn, io);
    }

    /// The requester's attributes of `qpn`.
    pub(crate) fn requester_of(&self, qpn: u32) -> Option<Requester> {
        let qp = self.qps.get(&qpn)?;
        Some(Requester {
            qpn,
            qp_type: qp.init.qp_type,
            tenant: qp.tenant,
            pd: qp.pd,
            send_cq: qp.init.send_cq,
            sig_all: qp.init.sq_sig_all,
            attr: qp.attr,
        })
    }

    /// Whether an address vector names this device.
    pub(crate) fn is_local(&self, ah: &AhAttr) -> bool {
        if ah.is_global {
            self.config.gids.contains(&ah.dgid)
        } else {
            ah.dlid == self.config.port.lid
        }
    }

    /// Whether the QP `qpn` is connected to (`dest`, through `ah`) is a QP
    /// of this host connected back to it: the one QP a direct-path receive
    /// grant on `qpn` can have been made to, whose process may claim
    /// `qpn`'s receives while it exists.
    pub(crate) fn requester_exists(&self, qpn: u32, dest: u32, ah: &AhAttr) -> bool {
        self.is_local(ah) && self.qps.get(&dest).is_some_and(|d| d.attr.dest_qp_num == qpn)
    }

    pub(crate) fn responder(&self, req: &Requester) -> Option<Responder> {
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

    pub(crate) fn responder_of(&self, qpn: u32, peer: &Qp) -> Responder {
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

    pub(crate) fn resolve<'a>(&'a self, pd: u32, sges: &[Sge], need: AccessFlags) -> Option<Segs<'a>> {
        let mut out = Segs::new();
        for s in sges.iter().filter(|s| s.length > 0) {
            let mr = self.mrs.get(&s.lkey).filter(|m| m.pd == pd && m.access.contains(need))?;
            let off = mr.offset_of(s.addr, s.length as u64)?;
            out.push(Seg { region: &mr.region, off, len: s.length as usize });
        }
        Some(out)
    }

    pub(crate) fn remote_mr(&self, pd: u32, rkey: u32, need: AccessFlags) -> Option<&Mr> {
        self.mrs.get(&rkey).filter(|m| m.pd == pd && m.access.contains(need))
    }

    /// Takes the responder's next receive WR.
    pub(crate) fn take_recv(
        &mut self,
        resp: &Responder,
        io: &mut dyn Queues,
    ) -> Option<super::Pulled<RecvWr>> {
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
}

/// WRs flushed per queue of a QP per pass: what the queues can hold, and
/// no more than a send queue runs, so that a tenant with deep queues in
/// ERR (full of garbage, which flushes too) cannot stretch a pass.
fn flush_bound(qp: &Qp) -> usize {
    ((qp.init.cap.max_send_wr + qp.init.cap.max_recv_wr) as usize + 1).min(WRS_PER_PASS)
}
