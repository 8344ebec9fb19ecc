//! UD datagrams between hosts: sent once, never acknowledged.
//!
//! A datagram's bytes are copied out of the sender's buffers when the WR
//! is taken, because its completion (successful, as for every UD send)
//! is reported at once and the application may reuse the buffers before
//! the frame is written. Datagrams are at most one MTU, so the copy is
//! small; RC payloads, which complete only on their ACK, are never copied.

use std::collections::VecDeque;

use super::{AfterPayload, LinkId, Sink, Transmit};
use crate::hca::datapath::{effective_qkey, grh_bytes, Exec, Requester, GRH_LEN};
use crate::hca::{Hca, Queues};
use crate::ring::{Cqe, SendWr};
use crate::verbs::{AccessFlags, AhAttr, QpType, SendFlags, WcFlags, WcOpcode, WcStatus};
use crate::wire::{DataFlags, DataRepr, Opcode, UdEth};

/// Datagrams queued on one link before more are dropped.
const MAX_QUEUED: usize = 1024;

impl Hca {
    /// A UD send to another host: copied into a frame on the link to it.
    pub(crate) fn send_datagram_remote(&mut self, req: &Requester, wr: &SendWr, ah: &AhAttr) -> Exec {
        let Some(link) = self.net.route(ah) else {
            if ah.is_global {
                self.net.want(ah.dgid);
            }
            return Exec::NoPeer;
        };
        let len = wr.msg_len() as usize;
        let mut data = Vec::with_capacity(len);
        if wr.is_inline() {
            data.extend_from_slice(wr.inline_data());
        } else {
            let Some(segs) = self.resolve(req.pd, wr.sg.as_slice(), AccessFlags::empty()) else {
                return Exec::Failed(super::super::datapath::Failure::local(WcStatus::LocProtErr));
            };
            for s in segs.iter() {
                let at = data.len();
                data.resize(at + s.len, 0);
                if s.region.read(s.off, &mut data[at..]).is_err() {
                    return Exec::Failed(super::super::datapath::Failure::local(WcStatus::LocProtErr));
                }
            }
        }
        let imm = wr.opcode.has_imm();
        let op = if imm { Opcode::UdSendOnlyImm } else { Opcode::UdSendOnly };
        let mut r = DataRepr::new(op, req.tenant.0, wr.ud.remote_qpn & crate::wire::MAX_24, req.qpn, 0);
        let sgid = self.config.gids.get(ah.sgid_index as usize).copied().unwrap_or_default();
        r.ud = Some(UdEth {
            qkey: effective_qkey(wr.ud.remote_qkey, req.attr.qkey),
            sgid,
            slid: self.config.port.lid,
            global: ah.is_global,
            sl: ah.sl,
            hop_limit: ah.hop_limit,
        });
        r.payload_len = len as u32;
        if imm {
            r.imm = Some(wr.imm_data);
        }
        if wr.flags.contains(SendFlags::SOLICITED) {
            r.flags |= DataFlags::SOLICITED;
        }
        let mut t = Transmit::new(&r);
        t.data = data;
        if let Some(l) = self.net.links.get_mut(&link) {
            if l.datagrams.len() < MAX_QUEUED {
                l.datagrams.push_back((req.tenant, t));
            }
        }
        Exec::Complete { byte_len: 0 }
    }

    /// A datagram arrived for one of our UD QPs.
    pub(super) fn datagram_handle(
        &mut self,
        link: LinkId,
        hdr: &DataRepr,
        io: &mut dyn Queues,
    ) -> (Sink, AfterPayload) {
        let drop = |h: &mut Hca| {
            h.net.dropped(link, "datagram not taken");
            (Sink::Discard, AfterPayload::Nothing)
        };
        let Some(ud) = hdr.ud else { return drop(self) };
        let qpn = hdr.dest_qpn;
        let ok = self.qps.get(&qpn).is_some_and(|q| {
            q.init.qp_type == QpType::Ud
                && q.tenant.0 == hdr.vnet
                && !q.tenant.is_host_local()
                && q.accepts_incoming()
                && q.attr.qkey == ud.qkey
        });
        let len = u64::from(hdr.payload_len);
        if !ok || len > u64::from(self.config.port.active_mtu.bytes()) {
            return drop(self);
        }
        let resp = self.responder_of(qpn, &self.qps[&qpn]);
        let recv = match self.take_recv(&resp, io) {
            None => return drop(self),
            Some(Ok(r)) => r,
            Some(Err((wr_id, _))) => {
                self.datagram_recv_error(qpn, resp.recv_cq, wr_id, WcStatus::LocQpOpErr, io);
                return drop(self);
            }
        };
        let status = if recv.sg.as_slice().len() > resp.max_recv_sge as usize
            || recv.sg.total_len() < GRH_LEN as u64 + len
        {
            Err(WcStatus::LocLenErr)
        } else {
            // As on one host: a GRH only if the sender's address handle was
            // global, and the first 40 bytes left alone otherwise.
            let grh = ud
                .global
                .then(|| grh_bytes(ud.sgid, self.config.gids[0], ud.hop_limit, len, hdr.imm.is_some()));
            self.resolve(resp.recv_pd, recv.sg.as_slice(), AccessFlags::LOCAL_WRITE)
                .and_then(|segs| {
                    if let Some(grh) = grh {
                        let head = super::windows(&segs, 0, GRH_LEN as u64)?;
                        let mut at = 0;
                        for w in &head {
                            w.region.write(w.off, &grh[at..at + w.len]).ok()?;
                            at += w.len;
                        }
                    }
                    super::windows(&segs, GRH_LEN as u64, len)
                })
                .ok_or(WcStatus::LocProtErr)
        };
        match status {
            Ok(w) => (
                Sink::Place(w),
                AfterPayload::Datagram {
                    qpn,
                    resets: self.qps.get(&qpn).map_or(0, |q| q.resets),
                    wr_id: recv.wr_id,
                    len: hdr.payload_len,
                    src_qpn: hdr.src_qpn,
                    ud,
                    imm: hdr.imm,
                    solicited: hdr.flags.contains(DataFlags::SOLICITED),
                },
            ),
            Err(s) => {
                self.datagram_recv_error(qpn, resp.recv_cq, recv.wr_id, s, io);
                drop(self)
            }
        }
    }

    /// Where the receive taken for a datagram whose payload just ended
    /// completes, and whether it flushes: nowhere if the QP is gone or was
    /// reset since (a reset discards its receives without completions);
    /// flushed if the QP failed meanwhile.
    fn datagram_receiver(&self, qpn: u32, resets: u32) -> Option<(u32, bool)> {
        let qp = self.qps.get(&qpn).filter(|q| q.resets == resets)?;
        Some((qp.init.recv_cq, qp.state() == crate::verbs::QpState::Err))
    }

    /// The receive buffer of a datagram in flight was deregistered.
    pub(super) fn datagram_lost(&mut self, qpn: u32, resets: u32, wr_id: u64, io: &mut dyn Queues) {
        match self.datagram_receiver(qpn, resets) {
            None => {}
            Some((cq, true)) => {
                self.complete(cq, Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, qpn), qpn, io)
            }
            Some((cq, false)) => self.datagram_recv_error(qpn, cq, wr_id, WcStatus::LocProtErr, io),
        }
    }

    fn datagram_recv_error(&mut self, qpn: u32, cq: u32, wr_id: u64, status: WcStatus, io: &mut dyn Queues) {
        self.complete(cq, Cqe::new(wr_id, status, WcOpcode::Recv, qpn), qpn, io);
        self.enter_error(qpn, io);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn datagram_placed(
        &mut self,
        qpn: u32,
        resets: u32,
        wr_id: u64,
        len: u32,
        src_qpn: u32,
        ud: UdEth,
        imm: Option<u32>,
        solicited: bool,
        io: &mut dyn Queues,
    ) {
        let Some((cq, flushed)) = self.datagram_receiver(qpn, resets) else { return };
        if flushed {
            self.complete(cq, Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, qpn), qpn, io);
            return;
        }
        let mut cqe = Cqe::new(wr_id, WcStatus::Success, WcOpcode::Recv, qpn);
        cqe.byte_len = GRH_LEN as u32 + len;
        cqe.src_qp = src_qpn;
        cqe.slid = ud.slid;
        cqe.sl = ud.sl;
        cqe.solicited = solicited;
        if ud.global {
            cqe.wc_flags = WcFlags::GRH;
        }
        if let Some(i) = imm {
            cqe.wc_flags |= WcFlags::WITH_IMM;
            cqe.imm_data = i;
        }
        self.complete(cq, cqe, qpn, io);
    }
}

/// The datagrams waiting on a link, each with the tenant it is traffic of.
pub(crate) type DatagramQueue = VecDeque<(crate::hca::TenantId, Transmit)>;
