//! An RC work request, carried out whole: the requester's checks, the
//! responder's checks, the copy (chunk by chunk), and both completions.

use super::*;

impl Hca {
    /// The requester's checks of an RC work request, before anything
    /// leaves the QP; the status it fails with.
    pub(crate) fn check_request(&self, req: &Requester, wr: &SendWr) -> Result<(), WcStatus> {
        use SendOpcode::*;
        let op = wr.opcode;
        let cap = req.attr.cap;
        if wr.is_inline() {
            if !matches!(op, Send | SendWithImm | RdmaWrite | RdmaWriteWithImm) {
                return Err(WcStatus::LocQpOpErr);
            }
            if wr.inline_len as u32 > cap.max_inline_data {
                return Err(WcStatus::LocLenErr);
            }
        } else if wr.sg.as_slice().len() > cap.max_send_sge as usize {
            return Err(WcStatus::LocLenErr);
        }
        let len = wr.msg_len();
        if len > self.config.port.max_msg_sz as u64 || (op.is_atomic() && len < 8) {
            return Err(WcStatus::LocLenErr);
        }
        let need_local = if op.writes_local() { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
        if !wr.is_inline() && self.resolve(req.pd, wr.sg.as_slice(), need_local).is_none() {
            return Err(WcStatus::LocProtErr);
        }
        Ok(())
    }

    pub(super) fn execute(
        &mut self,
        req: &Requester,
        inf: &mut Inflight,
        budget: &mut u64,
        io: &mut dyn Queues,
    ) -> Exec {
        use SendOpcode::*;
        let op = inf.wr.opcode;
        if let Err(status) = self.check_request(req, &inf.wr) {
            return Exec::Failed(Failure::local(status));
        }
        let len = inf.wr.msg_len();
        let need_local = if op.writes_local() { AccessFlags::LOCAL_WRITE } else { AccessFlags::empty() };
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
