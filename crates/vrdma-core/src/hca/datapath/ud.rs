//! A UD datagram: the sender's checks, then delivery to the QP it names
//! if that QP is there to take it. Nothing the receiver does changes the
//! sender's completion.

use super::*;

/// Bytes of the Global Route Header a UD receive buffer starts with.
pub const GRH_LEN: usize = 40;

/// The QP number that addresses a multicast group, never a QP.
const MULTICAST_QPN: u32 = 0xff_ffff;

/// A Q_Key with this bit set in a UD send means "use the sending QP's
/// own Q_Key" (a controlled Q_Key).
const QKEY_FROM_QP: u32 = 0x8000_0000;

impl Hca {
    /// A UD send: the sender's checks, then delivery to the QP the WR
    /// names if it is there to receive it. Every failure at the receiver
    /// leaves the sender's completion successful.
    pub(super) fn execute_ud(
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
        if !self.is_local(&ah) {
            if req.tenant.is_host_local() {
                // A tenant of this host only: its datagrams never leave
                // (lost, as UD loses what no one can take).
                return Exec::Complete { byte_len: 0 };
            }
            return self.send_datagram_remote(req, wr, &ah);
        }
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
        let qkey = effective_qkey(ud.remote_qkey, req.attr.qkey);
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
        let sgid = self.config.gids.get(ah.sgid_index as usize).copied().unwrap_or_default();
        let mut g = grh_bytes(sgid, ah.dgid, ah.hop_limit, len, imm);
        let word0 = (6u32 << 28) | (u32::from(ah.traffic_class) << 20) | (ah.flow_label & 0xf_ffff);
        g[0..4].copy_from_slice(&word0.to_be_bytes());
        g
    }
}

/// The Q_Key a UD send carries: the WR's, or the QP's own for a controlled
/// Q_Key.
pub(crate) fn effective_qkey(wr_qkey: u32, qp_qkey: u32) -> u32 {
    if wr_qkey & QKEY_FROM_QP != 0 {
        qp_qkey
    } else {
        wr_qkey
    }
}

/// A GRH with traffic class and flow label zero.
pub(crate) fn grh_bytes(
    sgid: crate::verbs::Gid,
    dgid: crate::verbs::Gid,
    hop: u8,
    len: u64,
    imm: bool,
) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    g[0..4].copy_from_slice(&(6u32 << 28).to_be_bytes());
    let pay_len = 12 + 8 + if imm { 4 } else { 0 } + len.next_multiple_of(4) + 4;
    g[4..6].copy_from_slice(&(pay_len as u16).to_be_bytes());
    g[6] = 0x1b;
    g[7] = hop;
    g[8..24].copy_from_slice(&sgid.0);
    g[24..40].copy_from_slice(&dgid.0);
    g
}
