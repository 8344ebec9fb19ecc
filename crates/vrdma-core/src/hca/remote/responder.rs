//! The responder half: request frames checked against our QP, MRs and
//! receive queue, payloads placed, and ACKs, NAKs, read responses and
//! atomic acknowledgements sent back in PSN order.

use std::collections::VecDeque;

use super::{windows, AfterPayload, IoSeg, LinkId, RemoteQp, Sink, Transmit};
use crate::hca::{AsyncEvent, Hca, Queues};
use crate::ring::{Cqe, RecvWr};
use crate::time::Instant;
use crate::verbs::{AccessFlags, AhAttr, AsyncEventType, QpType, WcFlags, WcOpcode, WcStatus};
use crate::wire::{psn_add, psn_diff, Aeth, DataRepr, NakCode, Opcode, Syndrome, MAX_24};

/// A QP that sent a request this recently counts as sending both ways,
/// and may hold its ACKs (see `responder_placed`).
const BIDIRECTIONAL: std::time::Duration = std::time::Duration::from_millis(1);

/// Answers a responder QP holds before it stops taking requests.
const MAX_RESPONSES: usize = 4096;
/// Reads and atomics a responder QP has accepted and not yet answered:
/// the device's `max_qp_rd_atom`; a requester that exceeds it is refused,
/// as an HCA refuses it.
const MAX_READS: usize = crate::hca::MAX_RD_ATOMIC as usize;

/// Frames a link holds at most (with its datagrams) for QPs that went
/// away still owing ACKs: a flood of destroyed QPs on a stalled link
/// cannot grow it without bound.
const MAX_OWED_FRAMES: usize = 4096;

/// A message arriving in several frames.
pub(crate) enum InMsg {
    Send {
        recv: RecvWr,
        got: u64,
    },
    Write {
        va: u64,
        rkey: u32,
        dma_len: u64,
        got: u64,
    },
    /// The last frame of a write with immediate, holding the receive WR
    /// its immediate consumes.
    WriteImm {
        recv: RecvWr,
    },
}

/// An answer waiting to go out, in PSN order. `again` marks the answer to
/// a request sent again: it takes none of the responder's read and atomic
/// resources (`max_dest_rd_atomic`), which the original already holds or
/// has given back, so that a requester within its limit is never refused
/// because its timer fired.
pub(crate) enum Response {
    Ack { psn: u32, syndrome: Syndrome, msn: u32 },
    AtomicAck { psn: u32, orig: u64, msn: u32, again: bool },
    Read { first_psn: u32, rkey: u32, va: u64, len: u64, sent: u64, msn: u32, again: bool },
}

pub(crate) struct RemoteRecv {
    /// Where answers go: the link the requests come in on.
    pub link: Option<LinkId>,
    /// The PSN the next request frame must carry.
    pub epsn: u32,
    /// Requests completed (24 bits).
    pub msn: u32,
    /// A NAK went out for `epsn`; frames out of sequence are dropped
    /// silently until the requester goes back to it.
    pub nak_sent: bool,
    pub cur: Option<InMsg>,
    pub responses: VecDeque<Response>,
    /// A lone ACK at the front waits until then (see `push_ack`)...
    ack_hold: Instant,
    /// ...unless a request of this QP just went out on the link: then it
    /// follows at once, in the same write.
    pub ack_flush: bool,
    /// The message a frame being placed belongs to completes with it.
    pending: Option<Finish>,
    /// The last atomics executed, by PSN, with the value each returned:
    /// a duplicate is answered from here, never executed twice.
    atomics: VecDeque<(u32, u64)>,
}

/// What completes when the payload of the frame being placed is in.
#[derive(Clone, Copy)]
struct Finish {
    psn: u32,
    len: u64,
    last: bool,
    imm: Option<u32>,
    solicited: bool,
    src_qpn: u32,
    slid: u16,
}

impl RemoteRecv {
    fn new(rq_psn: u32) -> RemoteRecv {
        RemoteRecv {
            link: None,
            epsn: rq_psn & MAX_24,
            msn: 0,
            nak_sent: false,
            cur: None,
            responses: VecDeque::new(),
            ack_hold: Instant::ZERO,
            ack_flush: false,
            pending: None,
            atomics: VecDeque::new(),
        }
    }

    /// What a migration carries of it (see `hca::migrate`): where the
    /// next request starts, the message in progress, the atomics' answers.
    /// Queued answers are not carried: the requester sends again what
    /// they would have answered, and duplicates are answered anew.
    pub(crate) fn snapshot(&self) -> crate::hca::migrate::RecvSnap {
        use crate::hca::migrate::{InMsgSnap, RecvSnap, WrBytes};
        RecvSnap {
            epsn: self.epsn,
            msn: self.msn,
            cur: self.cur.as_ref().map(|m| match m {
                InMsg::Send { recv, got } => InMsgSnap::Send { recv: WrBytes::recv(recv), got: *got },
                InMsg::Write { va, rkey, dma_len, got } => {
                    InMsgSnap::Write { va: *va, rkey: *rkey, dma_len: *dma_len, got: *got }
                }
                InMsg::WriteImm { recv } => InMsgSnap::WriteImm { recv: WrBytes::recv(recv) },
            }),
            atomics: self.atomics.iter().copied().collect(),
        }
    }

    /// The responder of an imported QP, from checked parts.
    pub(crate) fn restored(epsn: u32, msn: u32, cur: Option<InMsg>, atomics: Vec<(u32, u64)>) -> RemoteRecv {
        let mut r = RemoteRecv::new(epsn);
        r.msn = msn & MAX_24;
        r.cur = cur;
        r.atomics = atomics.into();
        r
    }

    /// A frame's payload is being placed for it.
    pub(crate) fn placing(&self) -> bool {
        self.pending.is_some()
    }

    /// Most atomics' answers kept for duplicates.
    pub(crate) const MAX_ATOMICS: usize = MAX_READS;

    pub fn link_lost(&mut self) {
        self.link = None;
        self.responses.clear();
        self.pending = None;
    }

    /// The receive WR a message in progress had claimed, to be completed
    /// by the flush.
    pub fn take_claimed(&mut self) -> Option<RecvWr> {
        match self.cur.take() {
            Some(InMsg::Send { recv, .. } | InMsg::WriteImm { recv }) => Some(recv),
            _ => None,
        }
    }

    /// Queues a positive ACK for everything up to `psn`. ACKs are
    /// cumulative, so one that would follow another in the queue replaces
    /// it. It may be held until `hold_until`, so that it goes out with the
    /// next request of this QP (one write for both) or with later ACKs.
    fn push_ack(&mut self, psn: u32, msn: u32, hold_until: Instant) {
        if let Some(Response::Ack { psn: p, syndrome: Syndrome::Ack, msn: m }) = self.responses.back_mut() {
            *p = psn;
            *m = msn;
            return;
        }
        if self.responses.is_empty() {
            self.ack_hold = hold_until;
            self.ack_flush = false;
        }
        self.responses.push_back(Response::Ack { psn, syndrome: Syndrome::Ack, msn });
    }

    /// No answer queued and no frame's payload being placed. (A message
    /// in progress needs nothing until its next frame arrives.)
    pub fn is_quiescent(&self) -> bool {
        self.responses.is_empty() && self.pending.is_none()
    }

    /// When a held ACK must go out, if one is held.
    pub fn ack_due(&self) -> Option<Instant> {
        match self.responses.front() {
            Some(Response::Ack { syndrome: Syndrome::Ack, .. })
                if self.responses.len() == 1 && !self.ack_flush =>
            {
                Some(self.ack_hold)
            }
            _ => None,
        }
    }

    fn nak(&mut self, syndrome: Syndrome) {
        let (psn, msn) = (self.epsn, self.msn);
        self.responses.push_back(Response::Ack { psn, syndrome, msn });
        self.nak_sent = true;
    }
}

/// Why the responder refused a request: the NAK, and what it does itself.
struct Refusal {
    code: NakCode,
    event: AsyncEventType,
    recv: Option<(RecvWr, WcStatus)>,
}

impl Refusal {
    fn access() -> Refusal {
        Refusal { code: NakCode::RemoteAccessError, event: AsyncEventType::QpAccessErr, recv: None }
    }
    fn invalid(recv: Option<(RecvWr, WcStatus)>) -> Refusal {
        Refusal { code: NakCode::InvalidRequest, event: AsyncEventType::QpReqErr, recv }
    }
    fn operational(recv: RecvWr, status: WcStatus) -> Refusal {
        Refusal {
            code: NakCode::RemoteOperationalError,
            event: AsyncEventType::QpFatal,
            recv: Some((recv, status)),
        }
    }
}

// Built and consumed once per frame on the stack; boxing would allocate per frame.
#[allow(clippy::large_enum_variant)]
enum Step {
    Place(arrayvec::ArrayVec<IoSeg, { crate::ring::MAX_SGE }>, Finish),
    Done,
    Rnr,
    Refuse(Refusal),
}

impl Hca {
    fn recv_state(&mut self, qpn: u32) -> Option<&mut RemoteRecv> {
        self.qps.get_mut(&qpn)?.remote.as_deref_mut()?.recv.as_mut()
    }

    /// Whether `link` leads to the host `ah` names.
    fn link_serves(&self, link: LinkId, ah: &AhAttr) -> bool {
        self.net.links.get(&link).is_some_and(|l| {
            if ah.is_global {
                l.info.gid == ah.dgid
            } else {
                l.info.lid == ah.dlid
            }
        })
    }

    /// Whether `link` leads to where `q`'s peer QP is: the host its
    /// address names, or, once the peer moved, the link that proved it
    /// (and no other: the host it left cannot take it back), unless a
    /// stale copy of the peer announced itself there (`Qp::peer_stale`).
    pub(crate) fn peer_on(&self, q: &crate::hca::objects::Qp, link: LinkId) -> bool {
        match q.peer_link {
            Some(l) => l == link && !q.peer_stale,
            None => self.link_serves(link, &q.attr.ah_attr),
        }
    }

    /// A request frame for one of our QPs.
    pub(super) fn responder_handle(
        &mut self,
        link: LinkId,
        hdr: &DataRepr,
        _now: crate::time::Instant,
        io: &mut dyn Queues,
    ) -> (Sink, AfterPayload) {
        let qpn = hdr.dest_qpn;
        // A frame for no QP of ours, or for one not connected to its
        // sender, is dropped without an answer, as IB drops it.
        let ok = self.qps.get(&qpn).is_some_and(|q| {
            q.init.qp_type == QpType::Rc
                && q.tenant.0 == hdr.vnet
                && !q.tenant.is_host_local()
                && q.attr.dest_qp_num == hdr.src_qpn
                && q.accepts_incoming()
                && self.peer_on(q, link)
        });
        if !ok {
            self.net.dropped(link, "request for no QP connected to its sender");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        let qp = self.qps.get_mut(&qpn).expect("checked");
        let (rq_psn, tenant) = (qp.attr.rq_psn, qp.tenant);
        let r = qp.remote.get_or_insert_with(|| Box::new(RemoteQp { send: None, recv: None }));
        let send_link = r.send.as_ref().and_then(|s| s.link);
        let rs = r.recv.get_or_insert_with(|| RemoteRecv::new(rq_psn));
        if rs.link != Some(link) {
            let old = rs.link.replace(link);
            self.net.attach(link, qpn, tenant);
            // Requests now come in on another link (both daemons dialled):
            // the old one serves the QP no more, unless its requests go out
            // there.
            if let Some(old) = old.filter(|&o| Some(o) != send_link) {
                self.net.detach_from(old, qpn, tenant);
            }
        }
        // An RTR QP answers from now on, and may hold an ACK to time.
        self.update_service(qpn);
        let rs = self.recv_state(qpn).expect("made above");
        // A peer that sends requests but never reads our answers gets no
        // more than a bounded queue of them; the rest of its requests are
        // dropped (it is stuck behind its own socket anyway).
        if rs.responses.len() >= MAX_RESPONSES {
            self.net.dropped(link, "too many answers queued");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        let d = psn_diff(hdr.psn, rs.epsn);
        if d < 0 {
            self.answer_duplicate(qpn, hdr);
            self.net.dropped(link, "duplicate request");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        if d > 0 {
            if !rs.nak_sent {
                rs.nak(Syndrome::Nak(NakCode::PsnSequenceError));
            }
            self.net.dropped(link, "request ahead of the expected PSN");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        rs.nak_sent = false;
        match self.responder_step(qpn, link, hdr, io) {
            Step::Place(w, f) => {
                self.advance_epsn(qpn, 1);
                self.recv_state(qpn).expect("exists").pending = Some(f);
                (Sink::Place(w), AfterPayload::Request { qpn })
            }
            Step::Done => (Sink::Discard, AfterPayload::Nothing),
            Step::Rnr => {
                let timer = self.qps[&qpn].attr.min_rnr_timer;
                self.recv_state(qpn).expect("exists").nak(Syndrome::RnrNak { timer });
                self.net.dropped(link, "no receive posted (RNR NAK)");
                (Sink::Discard, AfterPayload::Nothing)
            }
            Step::Refuse(f) => {
                self.refuse(qpn, f, io);
                self.net.dropped(link, "request refused (NAK)");
                (Sink::Discard, AfterPayload::Nothing)
            }
        }
    }

    /// A request the requester sent again (after its timer expired) that
    /// this QP had accepted already: a completed message is acknowledged
    /// again, a read is executed again (it changes nothing), an atomic is
    /// answered with the value it returned the first time. Nothing is
    /// placed or executed twice; what cannot be answered is dropped.
    fn answer_duplicate(&mut self, qpn: u32, hdr: &DataRepr) {
        use Opcode::*;
        // Answers to requests sent again are bounded apart from new ones.
        let reads = self.reads_queued(qpn, true);
        let Some(rs) = self.recv_state(qpn) else { return };
        let (msn, epsn) = (rs.msn, rs.epsn);
        let atomic = rs.atomics.iter().find(|(psn, _)| *psn == hdr.psn).copied();
        let qp = &self.qps[&qpn];
        let (pd, access) = (qp.pd, qp.attr.qp_access_flags);
        let readable = |hca: &Hca, reth: &crate::wire::Reth| {
            let len = u64::from(reth.dma_len);
            access.contains(AccessFlags::REMOTE_READ)
                && (len == 0
                    || hca
                        .remote_mr(pd, reth.rkey, AccessFlags::REMOTE_READ)
                        .and_then(|m| m.offset_of(reth.va, len))
                        .is_some())
        };
        let answer = match hdr.opcode {
            ReadRequest => match hdr.reth {
                Some(reth) if reads < MAX_READS && readable(self, &reth) => Some(Response::Read {
                    first_psn: hdr.psn,
                    rkey: reth.rkey,
                    va: reth.va,
                    len: u64::from(reth.dma_len),
                    sent: 0,
                    msn,
                    again: true,
                }),
                _ => None,
            },
            CompareSwap | FetchAdd if reads < MAX_READS => {
                atomic.map(|(psn, orig)| Response::AtomicAck { psn, orig, msn, again: true })
            }
            _ if hdr.opcode.is_last() || hdr.opcode.is_only() => {
                Some(Response::Ack { psn: psn_add(epsn, MAX_24), syndrome: Syndrome::Ack, msn })
            }
            _ => None,
        };
        if let Some(a) = answer {
            self.recv_state(qpn).expect("exists").responses.push_back(a);
        }
    }

    /// Read and atomic answers queued: to new requests, or (`again`) to
    /// requests sent again.
    fn reads_queued(&mut self, qpn: u32, again: bool) -> usize {
        self.recv_state(qpn).map_or(0, |rs| {
            rs.responses
                .iter()
                .filter(|r| match r {
                    Response::Read { again: a, .. } | Response::AtomicAck { again: a, .. } => *a == again,
                    Response::Ack { .. } => false,
                })
                .count()
        })
    }

    fn advance_epsn(&mut self, qpn: u32, n: u32) {
        if let Some(rs) = self.recv_state(qpn) {
            rs.epsn = psn_add(rs.epsn, n);
        }
    }

    /// Checks one in-sequence request frame and works out where its
    /// payload goes, or answers it at once (reads, atomics, refusals).
    fn responder_step(&mut self, qpn: u32, link: LinkId, hdr: &DataRepr, io: &mut dyn Queues) -> Step {
        use Opcode::*;
        let qp = &self.qps[&qpn];
        let (pd, access) = (qp.pd, qp.attr.qp_access_flags);
        let resp = self.responder_of(qpn, qp);
        // A peer that moved keeps the LID it had: its completions here
        // must not tell where it went.
        let slid = match qp.peer_link {
            Some(_) => qp.peer_lid,
            None => self.net.links.get(&link).map_or(0, |l| l.info.lid),
        };
        let n = u64::from(hdr.payload_len);
        let off = u64::from(hdr.msg_offset);
        let last = hdr.opcode.is_last() || hdr.opcode.is_only();
        let fin = Finish {
            psn: hdr.psn,
            len: n,
            last,
            imm: hdr.imm,
            solicited: hdr.flags.contains(crate::wire::DataFlags::SOLICITED),
            src_qpn: hdr.src_qpn,
            slid,
        };
        let cur = self.recv_state(qpn).expect("exists").cur.take();
        match (hdr.opcode, cur) {
            (SendFirst | SendOnly | SendOnlyImm, None) => {
                let recv = match self.take_recv(&resp, io) {
                    None => return Step::Rnr,
                    Some(Ok(r)) => r,
                    Some(Err((wr_id, _))) => {
                        let r = RecvWr { wr_id, sg: Default::default() };
                        return Step::Refuse(Refusal::operational(r, WcStatus::LocQpOpErr));
                    }
                };
                self.place_send(qpn, &resp, recv, 0, n, fin)
            }
            (SendMiddle | SendLast | SendLastImm, Some(InMsg::Send { recv, got })) if got == off => {
                self.place_send(qpn, &resp, recv, got, n, fin)
            }
            (WriteFirst | WriteOnly | WriteOnlyImm, None) => {
                let Some(reth) = hdr.reth else { return Step::Refuse(Refusal::invalid(None)) };
                if !access.contains(AccessFlags::REMOTE_WRITE) {
                    return Step::Refuse(Refusal::access());
                }
                let dma_len = u64::from(reth.dma_len);
                if dma_len > 0
                    && self
                        .remote_mr(pd, reth.rkey, AccessFlags::REMOTE_WRITE)
                        .and_then(|m| m.offset_of(reth.va, dma_len))
                        .is_none()
                {
                    return Step::Refuse(Refusal::access());
                }
                self.place_write(qpn, &resp, reth.va, reth.rkey, dma_len, 0, n, hdr.opcode, fin, io)
            }
            (WriteMiddle | WriteLast | WriteLastImm, Some(InMsg::Write { va, rkey, dma_len, got }))
                if got == off =>
            {
                self.place_write(qpn, &resp, va, rkey, dma_len, got, n, hdr.opcode, fin, io)
            }
            (ReadRequest | CompareSwap | FetchAdd, None) if self.reads_queued(qpn, false) >= MAX_READS => {
                Step::Refuse(Refusal::invalid(None))
            }
            (ReadRequest, None) => {
                let Some(reth) = hdr.reth else { return Step::Refuse(Refusal::invalid(None)) };
                if !access.contains(AccessFlags::REMOTE_READ) {
                    return Step::Refuse(Refusal::access());
                }
                let len = u64::from(reth.dma_len);
                if len > 0
                    && self
                        .remote_mr(pd, reth.rkey, AccessFlags::REMOTE_READ)
                        .and_then(|m| m.offset_of(reth.va, len))
                        .is_none()
                {
                    return Step::Refuse(Refusal::access());
                }
                let chunk = self.net.chunk(link);
                let npsn = crate::wire::chunk_count(len, chunk) as u32;
                let rs = self.recv_state(qpn).expect("exists");
                rs.msn = psn_add(rs.msn, 1);
                let msn = rs.msn;
                rs.responses.push_back(Response::Read {
                    first_psn: hdr.psn,
                    rkey: reth.rkey,
                    va: reth.va,
                    len,
                    sent: 0,
                    msn,
                    again: false,
                });
                self.advance_epsn(qpn, npsn);
                Step::Done
            }
            (CompareSwap | FetchAdd, None) => {
                let Some(a) = hdr.atomic else { return Step::Refuse(Refusal::invalid(None)) };
                if !access.contains(AccessFlags::REMOTE_ATOMIC) {
                    return Step::Refuse(Refusal::access());
                }
                let Some(mr) = self.remote_mr(pd, a.rkey, AccessFlags::REMOTE_ATOMIC) else {
                    return Step::Refuse(Refusal::access());
                };
                let Some(at) = mr.offset_of(a.va, 8) else { return Step::Refuse(Refusal::access()) };
                if !a.va.is_multiple_of(8) {
                    return Step::Refuse(Refusal::invalid(None));
                }
                // The same 8-byte atomics the single-host path uses, so an
                // atomic from another host is atomic with respect to every
                // vRDMA atomic on the region.
                let old = if hdr.opcode == CompareSwap {
                    mr.region.compare_swap(at, a.compare, a.swap_add)
                } else {
                    mr.region.fetch_add(at, a.swap_add)
                };
                let Ok(orig) = old else { return Step::Refuse(Refusal::invalid(None)) };
                let rs = self.recv_state(qpn).expect("exists");
                if rs.atomics.len() >= MAX_READS {
                    rs.atomics.pop_front();
                }
                rs.atomics.push_back((hdr.psn, orig));
                rs.msn = psn_add(rs.msn, 1);
                let msn = rs.msn;
                rs.responses.push_back(Response::AtomicAck { psn: hdr.psn, orig, msn, again: false });
                self.advance_epsn(qpn, 1);
                Step::Done
            }
            // An opcode that does not continue the message in progress, or
            // a continuation at the wrong offset.
            (_, cur) => {
                let recv = match cur {
                    Some(InMsg::Send { recv, .. } | InMsg::WriteImm { recv }) => {
                        Some((recv, WcStatus::RemInvReqErr))
                    }
                    _ => None,
                };
                Step::Refuse(Refusal::invalid(recv))
            }
        }
    }

    fn place_send(
        &mut self,
        qpn: u32,
        resp: &crate::hca::datapath::Responder,
        recv: RecvWr,
        got: u64,
        n: u64,
        fin: Finish,
    ) -> Step {
        if recv.sg.as_slice().len() > resp.max_recv_sge as usize {
            return Step::Refuse(Refusal::invalid(Some((recv, WcStatus::LocLenErr))));
        }
        if got + n > recv.sg.total_len() {
            return Step::Refuse(Refusal::invalid(Some((recv, WcStatus::LocLenErr))));
        }
        let w = if n == 0 {
            Some(Default::default())
        } else {
            self.resolve(resp.recv_pd, recv.sg.as_slice(), AccessFlags::LOCAL_WRITE)
                .and_then(|segs| windows(&segs, got, n))
        };
        let Some(w) = w else { return Step::Refuse(Refusal::operational(recv, WcStatus::LocProtErr)) };
        self.recv_state(qpn).expect("exists").cur = Some(InMsg::Send { recv, got });
        Step::Place(w, fin)
    }

    #[allow(clippy::too_many_arguments)]
    fn place_write(
        &mut self,
        qpn: u32,
        resp: &crate::hca::datapath::Responder,
        va: u64,
        rkey: u32,
        dma_len: u64,
        got: u64,
        n: u64,
        op: Opcode,
        fin: Finish,
        io: &mut dyn Queues,
    ) -> Step {
        if got + n > dma_len || fin.last != (got + n == dma_len) {
            return Step::Refuse(Refusal::invalid(None));
        }
        let w = if n == 0 {
            Some(Default::default())
        } else {
            // The key is checked again for every chunk.
            self.remote_mr(resp.pd, rkey, AccessFlags::REMOTE_WRITE).and_then(|m| {
                let at = m.offset_of(va + got, n)?;
                let mut w = arrayvec::ArrayVec::new();
                w.push(IoSeg { region: m.region.clone(), off: at, len: n as usize });
                Some(w)
            })
        };
        let Some(w) = w else { return Step::Refuse(Refusal::access()) };
        if matches!(op, Opcode::WriteLastImm | Opcode::WriteOnlyImm) {
            // The immediate consumes a receive WR, claimed as the message
            // ends (an RNR NAK here sends the requester back to this frame).
            match self.take_recv(resp, io) {
                None => {
                    // The message so far stays; the requester comes back
                    // to this frame.
                    if op == Opcode::WriteLastImm {
                        self.recv_state(qpn).expect("exists").cur =
                            Some(InMsg::Write { va, rkey, dma_len, got });
                    }
                    return Step::Rnr;
                }
                Some(Ok(r)) => self.recv_state(qpn).expect("exists").cur = Some(InMsg::WriteImm { recv: r }),
                Some(Err((wr_id, _))) => {
                    let r = RecvWr { wr_id, sg: Default::default() };
                    return Step::Refuse(Refusal::operational(r, WcStatus::LocQpOpErr));
                }
            }
            return Step::Place(w, Finish { len: dma_len, ..fin });
        }
        self.recv_state(qpn).expect("exists").cur = Some(InMsg::Write { va, rkey, dma_len, got });
        Step::Place(w, fin)
    }

    /// The payload of an accepted request frame is placed: a finished
    /// message completes its receive and is acknowledged.
    pub(super) fn responder_placed(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues) {
        // An ACK is held only on a QP that also sends requests, as in a
        // ping-pong: there it will soon have one to ride with. A QP that
        // only receives acknowledges at once, so that a requester waiting
        // on its completion does not wait for the delay.
        let sends = self.qps.get(&qpn).and_then(|q| q.remote.as_ref()?.send.as_ref()).map(|s| s.last_sent);
        let ack_delay = match sends {
            Some(t) if now.saturating_since(t) < BIDIRECTIONAL => self.config.ack_delay,
            _ => std::time::Duration::ZERO,
        };
        let live = self.qps.get(&qpn).is_some_and(|q| q.accepts_incoming());
        let Some(rs) = self.recv_state(qpn) else { return };
        let Some(f) = rs.pending.take() else { return };
        if !live {
            // The QP failed while the payload came (its flush took the
            // receive): nothing completes and nothing is acknowledged, so
            // the requester cannot count the message as delivered.
            rs.cur = None;
            return;
        }
        let cur = rs.cur.take();
        if !f.last {
            rs.cur = match cur {
                Some(InMsg::Send { recv, got }) => Some(InMsg::Send { recv, got: got + f.len }),
                Some(InMsg::Write { va, rkey, dma_len, got }) => {
                    Some(InMsg::Write { va, rkey, dma_len, got: got + f.len })
                }
                other => other,
            };
            return;
        }
        rs.msn = psn_add(rs.msn, 1);
        let msn = rs.msn;
        rs.push_ack(f.psn, msn, now + ack_delay);
        // A send's length is what arrived; a write with immediate reports
        // the write's length.
        let (recv, opcode, byte_len) = match cur {
            Some(InMsg::Send { recv, got }) => (recv, WcOpcode::Recv, got + f.len),
            Some(InMsg::WriteImm { recv }) => (recv, WcOpcode::RecvRdmaWithImm, f.len),
            _ => return,
        };
        let qp = &self.qps[&qpn];
        let cq = qp.init.recv_cq;
        let mut cqe = Cqe::new(recv.wr_id, WcStatus::Success, opcode, qpn);
        cqe.byte_len = byte_len as u32;
        cqe.src_qp = f.src_qpn;
        cqe.slid = f.slid;
        cqe.solicited = f.solicited;
        if let Some(imm) = f.imm {
            cqe.wc_flags = WcFlags::WITH_IMM;
            cqe.imm_data = imm;
        }
        self.complete(cq, cqe, qpn, io);
    }

    /// The payload of an accepted request frame lost its destination (a
    /// region deregistered while it arrived): refused as if the region had
    /// been gone when the header came, with a NAK for that frame's PSN.
    pub(super) fn responder_lost(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(rs) = self.recv_state(qpn) else { return };
        if rs.pending.take().is_none() {
            return;
        }
        // Its header moved the expected PSN on; the NAK names it.
        rs.epsn = psn_add(rs.epsn, MAX_24);
        let refusal = match rs.cur.take() {
            Some(InMsg::Send { recv, .. }) => Refusal::operational(recv, WcStatus::LocProtErr),
            Some(InMsg::WriteImm { recv }) => {
                Refusal { recv: Some((recv, WcStatus::LocProtErr)), ..Refusal::access() }
            }
            _ => Refusal::access(),
        };
        self.refuse(qpn, refusal, io);
    }

    /// Refuses a request: NAK to the requester, and the responder goes to
    /// ERR with the matching event, as on one host.
    fn refuse(&mut self, qpn: u32, f: Refusal, io: &mut dyn Queues) {
        let Some(rs) = self.recv_state(qpn) else { return };
        rs.nak(Syndrome::Nak(f.code));
        let qp = &self.qps[&qpn];
        let (ctx, cq) = (qp.ctx, qp.init.recv_cq);
        if let Some((r, status)) = f.recv {
            self.complete(cq, Cqe::new(r.wr_id, status, WcOpcode::Recv, qpn), qpn, io);
        }
        if self.qps.get(&qpn).is_some_and(|q| q.state() != crate::verbs::QpState::Err) {
            self.enter_error(qpn, io);
            io.async_event(ctx, AsyncEvent { event_type: f.event, element: qpn });
        }
    }

    /// `qpn` is destroyed or reset: the ACKs it owes for messages it
    /// completed (held by `ack_delay`, or not yet polled by the link)
    /// still go out, ahead of the link's QP frames. An HCA acknowledges a
    /// message before its receive completes, so a program that destroys
    /// its QP once it has seen its last completion never leaves the peer
    /// waiting for an ACK; without this the peer's last send would end
    /// `RETRY_EXC_ERR`. Only positive ACKs and atomic ACKs go: a NAK or a
    /// read response of a QP that is gone answers nothing useful.
    pub(crate) fn send_owed_acks(&mut self, r: &RemoteQp, qpn: u32, vnet: u32, dest: u32) {
        let Some(rs) = r.recv.as_ref() else { return };
        let Some(l) = rs.link.and_then(|link| self.net.links.get_mut(&link)).filter(|l| l.up) else { return };
        for resp in &rs.responses {
            let repr = match *resp {
                Response::Ack { psn, syndrome: Syndrome::Ack, msn } => {
                    let mut r = DataRepr::new(Opcode::Acknowledge, vnet, dest, qpn, psn);
                    r.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                    r
                }
                Response::AtomicAck { psn, orig, msn, .. } => {
                    let mut r = DataRepr::new(Opcode::AtomicAcknowledge, vnet, dest, qpn, psn);
                    r.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                    r.atomic_ack = Some(orig);
                    r
                }
                _ => continue,
            };
            if l.datagrams.len() >= MAX_OWED_FRAMES {
                tracing::debug!(qpn, "link queue full; an owed ACK is not sent");
                return;
            }
            tracing::debug!(qpn, psn = repr.psn, "QP gone: sending the ACK it owed");
            l.datagrams.push_back((crate::hca::TenantId(vnet), Transmit::new(&repr)));
        }
    }

    /// The next answer of `qpn` for `link`.
    pub(super) fn responder_transmit(&mut self, qpn: u32, link: LinkId, now: Instant) -> Option<Transmit> {
        let chunk = u64::from(self.net.chunk(link));
        let qp = self.qps.get(&qpn)?;
        let (vnet, dest, pd) = (qp.tenant.0, qp.attr.dest_qp_num, qp.pd);
        let rs = qp.remote.as_ref()?.recv.as_ref()?;
        if rs.link != Some(link) || rs.ack_due().is_some_and(|due| now < due) {
            return None;
        }
        let (repr, payload, done) = match *rs.responses.front()? {
            Response::Ack { psn, syndrome, msn } => {
                let mut r = DataRepr::new(Opcode::Acknowledge, vnet, dest, qpn, psn);
                r.aeth = Some(Aeth { syndrome, msn });
                (r, None, true)
            }
            Response::AtomicAck { psn, orig, msn, .. } => {
                let mut r = DataRepr::new(Opcode::AtomicAcknowledge, vnet, dest, qpn, psn);
                r.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                r.atomic_ack = Some(orig);
                (r, None, true)
            }
            Response::Read { first_psn, rkey, va, len, sent, msn, .. } => {
                let n = chunk.min(len - sent);
                let (first, last) = (sent == 0, sent + n == len);
                let op = match (first, last) {
                    (true, true) => Opcode::ReadResponseOnly,
                    (true, false) => Opcode::ReadResponseFirst,
                    (false, false) => Opcode::ReadResponseMiddle,
                    (false, true) => Opcode::ReadResponseLast,
                };
                let psn = psn_add(first_psn, (sent / chunk) as u32);
                let mut r = DataRepr::new(op, vnet, dest, qpn, psn);
                r.msg_offset = sent as u32;
                r.payload_len = n as u32;
                if first || last {
                    r.aeth = Some(Aeth { syndrome: Syndrome::Ack, msn });
                }
                // The key is checked again for every chunk.
                let seg = if n == 0 {
                    Some(None)
                } else {
                    self.remote_mr(pd, rkey, AccessFlags::REMOTE_READ).and_then(|m| {
                        let at = m.offset_of(va + sent, n)?;
                        Some(Some(IoSeg { region: m.region.clone(), off: at, len: n as usize }))
                    })
                };
                match seg {
                    Some(seg) => (r, seg, last),
                    None => {
                        // Deregistered mid-read: the rest is refused.
                        let mut r = DataRepr::new(Opcode::Acknowledge, vnet, dest, qpn, psn);
                        r.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::RemoteAccessError), msn });
                        (r, None, true)
                    }
                }
            }
        };
        let mut t = Transmit::new(&repr);
        if let Some(seg) = payload {
            t.payload.push(seg);
        }
        let rs = self.recv_state(qpn)?;
        rs.ack_flush = false;
        if done {
            rs.responses.pop_front();
        } else if let Some(Response::Read { sent, .. }) = rs.responses.front_mut() {
            *sent += u64::from(repr.payload_len);
        }
        Some(t)
    }
}
