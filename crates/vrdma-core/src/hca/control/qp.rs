//! Queue pairs: creation, the state machine's effects, destruction, and
//! the error transitions the data path shares.

use std::collections::VecDeque;

use super::super::*;
use crate::qp::fsm;
use crate::verbs::{AsyncEventType, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType};

impl Hca {
    pub fn create_qp(&mut self, ctx: ContextId, pd: u32, init: QpInitAttr) -> Result<QpCreated, HcaError> {
        self.refuse_paused(ctx)?;
        let tenant = self.tenant_of(ctx)?;
        if init.qp_type == QpType::Uc {
            return Err(HcaError::Unsupported("UC queue pairs (RC and UD are supported)"));
        }
        let dev = &self.config.device;
        let c = init.cap;
        if c.max_send_sge > dev.max_sge || c.max_recv_sge > dev.max_sge {
            return Err(HcaError::invalid(format!("at most {} SGEs per WR", dev.max_sge)));
        }
        if c.max_inline_data > dev.max_inline_data {
            return Err(HcaError::invalid(format!("at most {} inline bytes", dev.max_inline_data)));
        }
        if c.max_send_wr == 0 {
            return Err(HcaError::invalid("a QP needs max_send_wr of at least 1"));
        }
        if init.srq.is_none() && c.max_recv_wr == 0 {
            return Err(HcaError::invalid("a QP without an SRQ needs max_recv_wr of at least 1"));
        }
        self.check_depth(ctx, "max_send_wr", c.max_send_wr, dev.max_qp_wr)?;
        self.check_depth(ctx, "max_recv_wr", c.max_recv_wr, dev.max_qp_wr)?;
        if self.qps.len() >= dev.max_qp as usize {
            return Err(HcaError::Exhausted("queue pairs"));
        }
        self.own_pd(ctx, pd)?;
        for cq in [init.send_cq, init.recv_cq] {
            match self.cqs.get(&cq) {
                Some(c) if c.ctx == ctx => {}
                _ => return Err(HcaError::NoSuchObject { kind: "CQ", id: cq }),
            }
        }
        if let Some(s) = init.srq {
            // Receive SGEs from an SRQ are checked against the SRQ's PD.
            self.own_srq(ctx, s)?;
        }
        let granted = QpCap {
            max_send_wr: c.max_send_wr.next_power_of_two(),
            max_recv_wr: if init.srq.is_some() { 0 } else { c.max_recv_wr.next_power_of_two() },
            max_send_sge: c.max_send_sge.max(1),
            max_recv_sge: if init.srq.is_some() { 0 } else { c.max_recv_sge.max(1) },
            max_inline_data: c.max_inline_data,
        };
        let ring_bytes = qp_ring_bytes(granted);
        self.charge_queue(ctx, ring_bytes)?;
        let mut counter = self.next_qpn;
        let qpn = super::super::numbering::alloc_qpn(self.config.number_space, &mut counter, |n| {
            self.qps.contains_key(&n)
        });
        self.next_qpn = counter;
        let Some(qpn) = qpn else {
            self.refund_queue(ctx, ring_bytes);
            return Err(HcaError::Exhausted("QP numbers"));
        };
        self.own_pd(ctx, pd).expect("checked").users += 1;
        self.cqs.get_mut(&init.send_cq).expect("checked").users += 1;
        self.cqs.get_mut(&init.recv_cq).expect("checked").users += 1;
        if let Some(s) = init.srq {
            self.srqs.get_mut(&s).expect("checked").users += 1;
        }
        let mut init = init;
        init.cap = granted;
        let attr = QpAttr { cap: granted, ..QpAttr::default() };
        self.qps.insert(
            qpn,
            Qp {
                ctx,
                tenant,
                pd,
                init,
                attr,
                inflight: None,
                requeued: VecDeque::new(),
                sqd_notify: false,
                resets: 0,
                remote: None,
                ring_bytes,
                served: false,
                in_order: false,
                swept: false,
                paused: false,
                epoch: 0,
                announce: false,
                peer_link: None,
                peer_epoch: 0,
                peer_stale: false,
                peer_lid: 0,
            },
        );
        Ok(QpCreated { qpn, cap: granted })
    }

    /// The QPs the engine serves, in the order it will visit them.
    #[cfg(test)]
    pub(crate) fn served_qps(&self) -> Vec<u32> {
        let mut seen = std::collections::HashSet::new();
        self.order
            .queued()
            .filter(|n| self.qps.get(n).is_some_and(|q| q.served && q.in_order) && seen.insert(*n))
            .collect()
    }

    /// Puts a QP into the engine's service order or takes it out, as
    /// [`Qp::needs_service`] says; called wherever its state or its
    /// transport across hosts begins or ends.
    ///
    /// A QP that may be served but is not (it was left idle) is put back:
    /// this is also how a QP is woken, by a post, a frame or a change of
    /// state.
    pub(crate) fn update_service(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let serve = qp.needs_service();
        if serve == qp.served {
            // Woken while served: whatever its next turn finds was not
            // missed, and its tenant may have work again.
            qp.swept = false;
            if serve {
                let tenant = qp.tenant;
                self.order.stir(tenant);
            }
            return;
        }
        qp.served = serve;
        // A QP that stops being served leaves its tenant's queue when the
        // engine next comes to it (see `process`).
        if serve && !qp.in_order {
            qp.in_order = true;
            let tenant = qp.tenant;
            self.order.push(tenant, qpn);
        }
        self.set_awake_on_links(qpn, serve);
    }

    /// Tells the links a QP is bound to whether it is served.
    fn set_awake_on_links(&mut self, qpn: u32, awake: bool) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        let (tenant, links) = (qp.tenant, qp.remote.as_ref().map(|r| r.links()));
        for link in links.into_iter().flatten().flatten() {
            self.net.set_awake(link, qpn, tenant, awake);
        }
    }

    /// Leaves a QP with nothing to do out of the engine's passes (and its
    /// links') until it is woken. `process` takes it out of its tenant's
    /// queue.
    pub(crate) fn park(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        qp.served = false;
        self.set_awake_on_links(qpn, false);
    }

    /// Starts a sweep, unless one is under way: every QP that may be
    /// served and is not gets one turn, [`SWEEP_PER_PASS`] of them a pass
    /// (so that a sweep of thousands does not stretch one pass), each
    /// marked so that work found in that turn counts as a wake-up that
    /// was missed. The driver sweeps now and then, so that a QP whose
    /// wake-up was lost (a tenant that never names its QPs, or a bug)
    /// waits at most until the next sweep.
    ///
    /// Starting one only copies the QP numbers; each pass then looks at
    /// [`SWEEP_PER_PASS`] of them, so that no one pass pays for a tenant's
    /// thousands of QPs.
    pub fn sweep(&mut self) {
        if self.sweeping.is_empty() {
            self.sweeping.extend(self.qps.keys().copied());
        }
    }

    /// Wakes the next QPs of a sweep under way.
    pub(crate) fn sweep_some(&mut self) {
        for _ in 0..SWEEP_PER_PASS {
            let Some(qpn) = self.sweeping.pop() else { return };
            if self.qps.get(&qpn).is_some_and(|q| !q.served && q.needs_service()) {
                self.update_service(qpn);
                if let Some(q) = self.qps.get_mut(&qpn).filter(|q| q.served) {
                    q.swept = true;
                }
            }
        }
    }

    /// Turns a sweep found work in: wake-ups that were missed.
    pub fn missed_wakeups(&self) -> u64 {
        self.missed_wakeups
    }

    /// The context and tenant that own QP `qpn`, if it exists: how the
    /// connection manager takes a QP that another context of the same
    /// tenant made (the drop-in `librdmacm.so.1` attaches QPs of the
    /// program's `libibverbs.so.1`, a context of its own).
    pub fn qp_owner(&self, qpn: u32) -> Option<(ContextId, TenantId)> {
        self.qps.get(&qpn).map(|q| (q.ctx, q.tenant))
    }

    /// The tenant of an open context.
    pub fn tenant(&self, ctx: ContextId) -> Option<TenantId> {
        self.tenant_of(ctx).ok()
    }

    pub(crate) fn own_qp(&mut self, ctx: ContextId, qpn: u32) -> Result<&mut Qp, HcaError> {
        match self.qps.get_mut(&qpn) {
            Some(q) if q.ctx == ctx => Ok(q),
            _ => Err(HcaError::NoSuchObject { kind: "QP", id: qpn }),
        }
    }

    /// `ibv_modify_qp`, checked against the state machine and the limits.
    pub fn modify_qp(
        &mut self,
        ctx: ContextId,
        qpn: u32,
        attr: &QpAttr,
        mask: QpAttrMask,
        io: &mut dyn Queues,
    ) -> Result<QpState, HcaError> {
        self.refuse_paused(ctx)?;
        let limits = self.config.modify_limits();
        self.direct.touch();
        let qp = self.own_qp(ctx, qpn)?;
        let cur = qp.state();
        let to = fsm::check_modify(qp.init.qp_type, cur, attr, mask, &limits)?;
        if mask.contains(QpAttrMask::CAP) {
            return Err(HcaError::Unsupported("resizing a QP's queues"));
        }
        let (tenant, rc) = (qp.tenant, qp.init.qp_type == QpType::Rc);
        if rc && tenant.is_host_local() && mask.contains(QpAttrMask::AV) && !self.is_local(&attr.ah_attr) {
            return Err(HcaError::invalid(
                "this tenant exists on this host only (its processes are outside the daemon's network \
                 namespace): its QPs cannot connect to another host",
            ));
        }
        let qp = self.own_qp(ctx, qpn)?;
        let cap = qp.attr.cap;
        fsm::apply_modify(&mut qp.attr, attr, mask, to);
        qp.attr.cap = cap;
        if to == QpState::Sqd && cur != QpState::Sqd {
            qp.sqd_notify = mask.contains(QpAttrMask::EN_SQD_ASYNC_NOTIFY) && attr.en_sqd_async_notify;
        }
        match to {
            QpState::Reset => {
                qp.resets = qp.resets.wrapping_add(1);
                // A receive claimed from the peer for an unfinished message
                // goes back to it, as when the QP is destroyed.
                let dest = qp.attr.dest_qp_num;
                let held = qp.inflight.take();
                // Everything of the remote transport starts over, as the
                // PSNs do; what it held was posted to this QP and goes
                // with its queues.
                let mut remote = qp.remote.take();
                let remote_held = remote.as_ref().map_or(0, |r| r.held_sends());
                // A receive of its SRQ taken for a message from another
                // host that the reset cut short goes back to the SRQ.
                let srq_claimed = qp
                    .init
                    .srq
                    .zip(remote.as_deref_mut().and_then(|r| r.recv.as_mut()).and_then(|r| r.take_claimed()));
                let was_held = held.is_some();
                let claimed = held.and_then(|i| i.recv);
                qp.requeued.clear();
                let keep = qp.attr.cap;
                qp.attr = QpAttr { cap: keep, ..QpAttr::default() };
                // The WR in flight is dropped without a completion: it is
                // retired before the queue is reset, so that the driver's
                // count of outstanding WRs starts again from zero.
                let held = u32::from(was_held) + remote_held;
                if held > 0 {
                    io.send_retired(qpn, held);
                }
                io.discard(qpn);
                if let Some(r) = &remote {
                    self.send_owed_acks(r, qpn, tenant.0, dest);
                    self.net.detach(r, qpn, tenant);
                }
                // (Connected to itself, the receive was its own: discarded
                // with its queue.)
                if let Some(r) = claimed.filter(|_| dest != qpn) {
                    self.requeue_recv(dest, r);
                }
                if let Some((srq, r)) = srq_claimed {
                    if let Some(s) = self.srqs.get_mut(&srq) {
                        s.requeued.push_front(r);
                        // Its direct-path claimers must stop (order).
                        self.direct.touch();
                    }
                }
            }
            QpState::Err if cur != QpState::Err => {
                qp.attr.qp_state = cur;
                self.enter_error(qpn, io);
            }
            _ => {}
        }
        if to == QpState::Reset && cur != QpState::Reset {
            self.take_back_claimed_receives(qpn);
            self.cancel_placements_of(qpn);
        }
        // enter_error publishes ERR itself.
        if to != cur && to != QpState::Err {
            io.qp_state_changed(qpn, to);
        }
        self.update_service(qpn);
        if to == QpState::Rtr && cur != QpState::Rtr {
            if let Some(path) = self.qp_path(qpn) {
                tracing::debug!(qpn, dest_qpn = attr.dest_qp_num, ?path, "QP connected");
            }
        }
        Ok(to)
    }

    pub fn query_qp(&mut self, ctx: ContextId, qpn: u32) -> Result<(QpAttr, QpInitAttr), HcaError> {
        let qp = self.own_qp(ctx, qpn)?;
        let mut a = qp.attr;
        a.cur_qp_state = a.qp_state;
        a.sq_draining = a.qp_state == QpState::Sqd && qp.inflight.is_some();
        Ok((a, qp.init))
    }

    /// `ibv_destroy_qp`. A send WR the QP held is retired (through `io`)
    /// without a completion, as everything still posted is dropped.
    pub fn destroy_qp(&mut self, ctx: ContextId, qpn: u32, io: &mut dyn Queues) -> Result<(), HcaError> {
        self.refuse_paused(ctx)?;
        self.own_qp(ctx, qpn)?;
        self.remove_qps(&[qpn], io);
        Ok(())
    }

    pub(crate) fn remove_qps(&mut self, qpns: &[u32], io: &mut dyn Queues) {
        self.direct.touch();
        let gone: std::collections::HashSet<u32> = qpns.iter().copied().collect();
        self.order.remove(|n| gone.contains(&n));
        // Receive WRs other requesters took from a QP that goes must never
        // be handed back by number: the number may later name another
        // tenant's QP. Those of its SRQ go back to the SRQ now; those of its
        // own receive queue are discarded with it, as destroy_qp discards
        // every posted receive. One scan for all, so that closing a context
        // with thousands of QPs costs the engine one walk, not one per QP.
        let mut orphans = Vec::new();
        for other in self.qps.values_mut() {
            if gone.contains(&other.attr.dest_qp_num) {
                if let Some(r) = other.inflight.as_mut().and_then(|i| i.recv.take()) {
                    orphans.push((other.attr.dest_qp_num, r));
                }
            }
        }
        for (responder, r) in orphans {
            let srq = self.qps.get(&responder).and_then(|q| q.init.srq);
            if let Some(srq) = srq.and_then(|s| self.srqs.get_mut(&s)) {
                srq.requeued.push_front(r);
                self.direct.touch();
            }
        }
        // A QP already in ERR whose requester goes: its flush may have
        // found the requester's claim not yet made (the process stopped on
        // its way to it) and left it what it held; the requester can
        // claim no more now, so the driver looks once more, and gives
        // back what it held (`Queues::flush_claimed`).
        let mut flushed = Vec::new();
        for (&n, other) in &self.qps {
            let dest = other.attr.dest_qp_num;
            if !gone.contains(&n)
                && gone.contains(&dest)
                && other.state() == QpState::Err
                && self.is_local(&other.attr.ah_attr)
                && self.qps.get(&dest).is_some_and(|d| d.tenant == other.tenant)
            {
                flushed.push((n, other.init.srq.map_or(RecvSource::Qp(n), RecvSource::Srq)));
            }
        }
        for &qpn in qpns {
            self.remove_one_qp(qpn, io);
        }
        for (n, rq) in flushed {
            io.flush_claimed(n, rq, true);
        }
    }

    /// Removes one QP; the caller updates the service order and takes back the
    /// receives other requesters hold of it.
    fn remove_one_qp(&mut self, qpn: u32, io: &mut dyn Queues) {
        self.cancel_placements_of(qpn);
        let Some(mut qp) = self.qps.remove(&qpn) else { return };
        if let Some(r) = qp.remote.take() {
            self.send_owed_acks(&r, qpn, qp.tenant.0, qp.attr.dest_qp_num);
            self.net.detach(&r, qpn, qp.tenant);
            if r.held_sends() > 0 {
                io.send_retired(qpn, r.held_sends());
            }
        }
        if let Some(inf) = qp.inflight.take() {
            io.send_retired(qpn, 1);
            // A receive WR taken for a message that never finished goes
            // back to the responder, as if the message had never arrived.
            if let Some(recv) = inf.recv {
                self.requeue_recv(qp.attr.dest_qp_num, recv);
            }
        }
        if let Some(p) = self.pds.get_mut(&qp.pd) {
            p.users = p.users.saturating_sub(1);
        }
        for cq in [qp.init.send_cq, qp.init.recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.users -= 1;
            }
        }
        if let Some(s) = qp.init.srq.and_then(|s| self.srqs.get_mut(&s)) {
            s.users -= 1;
        }
        self.refund_queue(qp.ctx, qp.ring_bytes);
    }

    /// `qpn` was reset: receives that requesters on this host had taken
    /// from it for messages still arriving go back to its SRQ, or are
    /// discarded with the rest of its receive queue (a reset discards
    /// every posted receive: none may complete afterwards). Each such
    /// message starts again from its first byte, so that it arrives whole,
    /// in a receive posted after the reset, if the QP is connected again.
    fn take_back_claimed_receives(&mut self, qpn: u32) {
        let mut claimed = Vec::new();
        for other in self.qps.values_mut() {
            if other.attr.dest_qp_num != qpn {
                continue;
            }
            if let Some(inf) = other.inflight.as_mut() {
                if let Some(r) = inf.recv.take() {
                    inf.done = 0;
                    inf.retry_deadline = None;
                    claimed.push(r);
                }
            }
        }
        let srq = self.qps.get(&qpn).and_then(|q| q.init.srq);
        if let Some(srq) = srq.and_then(|s| self.srqs.get_mut(&s)) {
            for r in claimed {
                srq.requeued.push_front(r);
                self.direct.touch();
            }
        }
    }

    pub(crate) fn requeue_recv(&mut self, responder_qpn: u32, recv: crate::ring::RecvWr) {
        let Some(r) = self.qps.get_mut(&responder_qpn) else { return };
        match r.init.srq {
            Some(s) => {
                if let Some(srq) = self.srqs.get_mut(&s) {
                    srq.requeued.push_front(recv);
                    // A direct-path requester must not claim from the SRQ
                    // while the core holds receives of it (their order).
                    self.direct.touch();
                }
            }
            None => {
                r.requeued.push_front(recv);
                // A direct-path requester must not claim from the ring
                // while the core holds receives of it (their order).
                self.direct.touch();
                // A responder in ERR flushes it in its turn: wake it if it
                // was left idle.
                self.update_service(responder_qpn);
            }
        }
    }

    /// A send WR of `qpn` failed locally: a UD QP goes to SQE (its receive
    /// queue keeps working, its send queue is flushed until it is moved
    /// back to RTS), an RC QP to ERR.
    pub(crate) fn send_queue_error(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if qp.init.qp_type != QpType::Ud {
            self.enter_error(qpn, io);
            return;
        }
        if matches!(qp.state(), QpState::Rts | QpState::Sqd) {
            qp.attr.qp_state = QpState::Sqe;
            io.qp_state_changed(qpn, QpState::Sqe);
            self.update_service(qpn);
        }
    }

    /// Moves a QP to ERR; its queues are flushed by the engine.
    pub(crate) fn enter_error(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if qp.state() == QpState::Err {
            return;
        }
        qp.attr.qp_state = QpState::Err;
        self.flush_pending = true;
        self.direct.touch();
        let (ctx, srq) = (qp.ctx, qp.init.srq);
        io.qp_state_changed(qpn, QpState::Err);
        self.update_service(qpn);
        self.cancel_placements_of(qpn);
        if srq.is_some() {
            io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::QpLastWqeReached, element: qpn });
        }
    }

    /// The QP this one is connected to is gone: what it has in flight can
    /// never be acknowledged.
    pub(crate) fn peer_lost(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let ctx = qp.ctx;
        if let Some(inf) = qp.inflight.take() {
            let cqe = datapath::error_cqe(&inf.wr, crate::verbs::WcStatus::RetryExcErr, qpn);
            let cq = qp.init.send_cq;
            io.send_retired(qpn, 1);
            self.complete(cq, cqe, qpn, io);
        }
        self.enter_error(qpn, io);
        io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::QpFatal, element: qpn });
    }

    /// Appends a completion; an overrun puts the CQ and the QP in error.
    pub(crate) fn complete(&mut self, cqn: u32, cqe: crate::ring::Cqe, qpn: u32, io: &mut dyn Queues) {
        // Received messages and errors are counted here, where every
        // completion passes (sends where they finish: unsignaled ones
        // write none).
        let counted = cqe.status != crate::verbs::WcStatus::Success || cqe.opcode.is_recv();
        if let Some(t) = self.qps.get(&qpn).filter(|_| counted).map(|q| q.tenant) {
            let c = self.counters(t);
            if cqe.status != crate::verbs::WcStatus::Success {
                c.completions_error += 1;
            } else {
                c.messages_received += 1;
                c.bytes_received += u64::from(cqe.byte_len);
            }
        }
        let Some(cq) = self.cqs.get_mut(&cqn) else { return };
        if !cq.overrun {
            if io.push_cqe(cqn, &cqe).is_ok() {
                return;
            }
            cq.overrun = true;
            let ctx = cq.ctx;
            io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::CqErr, element: cqn });
        }
        // As on hardware, every QP that has a completion for a CQ in error
        // goes to ERR, not only the one that overran it: a completion it
        // could not deliver must not vanish while the QP runs on.
        if let Some(q) = self.qps.get(&qpn).filter(|q| q.state() != QpState::Err) {
            let qctx = q.ctx;
            self.enter_error(qpn, io);
            io.async_event(qctx, AsyncEvent { event_type: AsyncEventType::QpFatal, element: qpn });
        }
    }
}
