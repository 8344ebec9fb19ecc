//! The requester half: work requests out as request frames, numbered
//! with PSNs, kept until acknowledged, completed in order.

use std::collections::VecDeque;

use super::{windows, AfterPayload, LinkId, RemoteQp, Sink, Transmit};
use crate::hca::datapath::error_cqe;
use crate::hca::{AsyncEvent, Hca, Queues};
use crate::qp::timers;
use crate::ring::{Cqe, SendWr};
use crate::time::Instant;
use crate::verbs::{AccessFlags, AsyncEventType, QpState, SendFlags, SendOpcode, WcStatus};
use crate::wire::{psn_add, psn_diff, AtomicEth, DataFlags, DataRepr, NakCode, Opcode, Reth, Syndrome};

/// A work request taken from the send queue and not yet completed.
pub(crate) struct SentWr {
    pub wr: SendWr,
    /// This request's number among every request of this device.
    pub serial: u64,
    pub first_psn: u32,
    /// PSNs it takes: one per frame, a read one per response chunk.
    pub npsn: u32,
    /// Payload bytes a frame of it carries: the link's chunk, or less for
    /// a request taken while a latency-class tenant was active on the link
    /// (see [`super::cut_frame`]); fixed when it is numbered.
    pub frame: u32,
    /// Bytes of a read response placed so far.
    pub placed: u64,
    /// The status it completes with when the QP fails: its own error, if
    /// it is the request that failed; the others flush.
    pub status: Option<WcStatus>,
    /// Its last frame went out (at least once): answers for it count from
    /// here on, also while it is being sent again.
    pub went_out: bool,
    /// When the engine took it (for the latency histogram).
    pub taken: Instant,
}

/// The PSNs a request takes at `chunk` bytes a frame.
pub(crate) fn psns_of(wr: &SendWr, chunk: u64) -> u32 {
    if wr.opcode.is_atomic() {
        1
    } else {
        crate::wire::chunk_count(wr.msg_len(), chunk as u32) as u32
    }
}

/// Whether a request's frames may be cut smaller than the link's chunk:
/// those that carry its payload (a read's response frames are sized by
/// the responder, at the link's chunk).
fn may_cut(wr: &SendWr) -> bool {
    wr.opcode != SendOpcode::RdmaRead && !wr.opcode.is_atomic()
}

/// The frame size a request numbered `npsn` PSNs on a link of `chunk`
/// was sent at: the chunk, or the cut frame ([`super::cut_frame`]);
/// `None` if neither gives that count (a snapshot to refuse).
pub(crate) fn frame_of(wr: &SendWr, npsn: u32, chunk: u32) -> Option<u32> {
    if psns_of(wr, u64::from(chunk)) == npsn {
        return Some(chunk);
    }
    let cut = super::cut_frame(chunk);
    (may_cut(wr) && psns_of(wr, u64::from(cut)) == npsn).then_some(cut)
}

impl RemoteSend {
    /// Numbers the requests taken but not yet sent again, at the chunk
    /// size of the link just bound. Returns true if one now takes more
    /// than `per_message` PSNs (too long for this link).
    fn renumber(&mut self, chunk: u64, per_message: u32) -> bool {
        if self.tx > 0 || self.tx_off > 0 || self.sent.iter().any(|w| w.went_out) {
            return false; // Sent already: numbered for good.
        }
        let Some(mut psn) = self.sent.front().map(|w| w.first_psn) else { return false };
        let mut too_long = false;
        for w in self.sent.iter_mut() {
            w.npsn = psns_of(&w.wr, chunk);
            w.frame = chunk as u32;
            w.first_psn = psn;
            psn = psn_add(psn, w.npsn);
            too_long |= w.npsn > per_message;
        }
        self.next_psn = psn;
        too_long
    }
}

impl SentWr {
    fn last_psn(&self) -> u32 {
        psn_add(self.first_psn, self.npsn.saturating_sub(1))
    }

    /// Reads and atomics complete on their response, not on an ACK.
    fn needs_response(&self) -> bool {
        self.wr.opcode == SendOpcode::RdmaRead || self.wr.opcode.is_atomic()
    }
}

pub(crate) struct RemoteSend {
    /// The link the QP sends on; bound on first use.
    pub link: Option<LinkId>,
    /// That link went down: nothing outstanding can be acknowledged.
    pub link_lost: bool,
    pub next_psn: u32,
    /// Outstanding work requests, oldest first.
    pub sent: VecDeque<SentWr>,
    /// Index in `sent` of the request whose frames go out next
    /// (`sent.len()`: all are out).
    pub tx: usize,
    /// Bytes of `sent[tx]` already sent.
    pub tx_off: u64,
    /// A request that failed the local checks while others were
    /// outstanding: it completes in error once they have completed.
    pub blocked: Option<(SendWr, WcStatus)>,
    /// Nothing goes out before this (after an RNR NAK).
    pub hold_until: Instant,
    pub rnr_left: u8,
    /// When the oldest outstanding request counts as unanswered.
    pub ack_deadline: Option<Instant>,
    pub retries_left: u8,
    /// When the last request frame went out.
    pub last_sent: Instant,
    /// Since when the peer has answered PAUSED (its tenant migrates): the
    /// requester probes it instead of timing it, until it resumes or
    /// `migration_pause_limit` passes.
    pub paused_since: Option<Instant>,
}

impl RemoteSend {
    fn new(attr: &crate::verbs::QpAttr) -> RemoteSend {
        RemoteSend {
            link: None,
            link_lost: false,
            next_psn: attr.sq_psn & crate::wire::MAX_24,
            sent: VecDeque::new(),
            tx: 0,
            tx_off: 0,
            blocked: None,
            hold_until: Instant::ZERO,
            rnr_left: attr.rnr_retry,
            ack_deadline: None,
            retries_left: attr.retry_cnt,
            last_sent: Instant::ZERO,
            paused_since: None,
        }
    }

    /// What a migration carries of it (see `hca::migrate`): the
    /// outstanding requests at their PSNs, the counters; not the link,
    /// the timers or the progress of the transmitter, which starts again
    /// from the oldest request on the host that resumes.
    pub(crate) fn snapshot(&self, chunk: u32) -> crate::hca::migrate::SendSnap {
        use crate::hca::migrate::{SendSnap, SentSnap, WrBytes};
        SendSnap {
            next_psn: self.next_psn,
            chunk,
            sent: self
                .sent
                .iter()
                .map(|w| SentSnap {
                    wr: WrBytes::send(&w.wr),
                    first_psn: w.first_psn,
                    npsn: w.npsn,
                    status: w.status,
                    went_out: w.went_out,
                })
                .collect(),
            blocked: self.blocked.as_ref().map(|(wr, st)| (WrBytes::send(wr), *st)),
            rnr_left: self.rnr_left,
            retries_left: self.retries_left,
        }
    }

    /// The requester of an imported QP, from checked parts: `sent` holds
    /// the decoded WRs with their PSN ranges, each given a fresh serial.
    pub(crate) fn restored(
        snap: &crate::hca::migrate::SendSnap,
        sent: Vec<(SendWr, &crate::hca::migrate::SentSnap)>,
        blocked: Option<(SendWr, WcStatus)>,
        serial: &mut u64,
        now: Instant,
    ) -> RemoteSend {
        RemoteSend {
            link: None,
            link_lost: false,
            next_psn: snap.next_psn,
            sent: sent
                .into_iter()
                .map(|(wr, w)| {
                    *serial += 1;
                    let frame = frame_of(&wr, w.npsn, snap.chunk).unwrap_or(snap.chunk);
                    SentWr {
                        wr,
                        serial: *serial,
                        first_psn: w.first_psn,
                        npsn: w.npsn,
                        frame,
                        placed: 0,
                        status: w.status,
                        went_out: w.went_out,
                        taken: now,
                    }
                })
                .collect(),
            tx: 0,
            tx_off: 0,
            blocked,
            hold_until: Instant::ZERO,
            rnr_left: snap.rnr_left,
            ack_deadline: None,
            retries_left: snap.retries_left,
            last_sent: Instant::ZERO,
            paused_since: None,
        }
    }
}

fn send_opcode(op: SendOpcode, first: bool, last: bool) -> Opcode {
    use Opcode::*;
    let imm = op.has_imm();
    let write = matches!(op, SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm);
    match (write, first, last, imm) {
        (false, true, true, false) => SendOnly,
        (false, true, true, true) => SendOnlyImm,
        (false, true, false, _) => SendFirst,
        (false, false, false, _) => SendMiddle,
        (false, false, true, false) => SendLast,
        (false, false, true, true) => SendLastImm,
        (true, true, true, false) => WriteOnly,
        (true, true, true, true) => WriteOnlyImm,
        (true, true, false, _) => WriteFirst,
        (true, false, false, _) => WriteMiddle,
        (true, false, true, false) => WriteLast,
        (true, false, true, true) => WriteLastImm,
    }
}

impl Hca {
    /// The chunk size of the link `qpn` sends on.
    fn send_chunk(&self, qpn: u32) -> u64 {
        let link = self.qps.get(&qpn).and_then(|q| q.remote.as_ref()?.send.as_ref()?.link);
        u64::from(self.net.chunk(link.unwrap_or(LinkId(0))))
    }

    /// Whether a request `qpn` takes now goes out in cut frames: its
    /// tenant is not of the latency class and one is active on its link.
    fn cuts_frames(&self, qpn: u32, tenant: crate::hca::TenantId, now: Instant) -> bool {
        let link = self.qps.get(&qpn).and_then(|q| q.remote.as_ref()?.send.as_ref()?.link);
        !self.order.is_latency(tenant) && link.is_some_and(|l| self.net.latency_active(l, now))
    }

    fn send_state(&mut self, qpn: u32) -> Option<&mut RemoteSend> {
        self.qps.get_mut(&qpn)?.remote.as_deref_mut()?.send.as_mut()
    }

    /// The engine's turn for an RC QP in RTS or SQD whose peer is on
    /// another host: bind it to a link, run its timers, and take a request
    /// when there is no link to send it on, so that the timer runs for it.
    pub(crate) fn run_remote_requester(
        &mut self,
        qpn: u32,
        now: Instant,
        io: &mut dyn Queues,
        act: &mut crate::hca::Activity,
    ) {
        let route = self.qps.get(&qpn).map(|q| {
            // A peer that moved is where its Moved frame came from.
            let moved = q.peer_link.filter(|l| self.net.links.contains_key(l));
            (q.attr.ah_attr, moved.or_else(|| self.net.route(&q.attr.ah_attr)))
        });
        let Some((ah, route)) = route else { return };
        let qp = self.qps.get_mut(&qpn).expect("looked up above");
        let (attr, tenant) = (qp.attr, qp.tenant);
        let state = qp.state();
        let r = qp.remote.get_or_insert_with(|| Box::new(RemoteQp { send: None, recv: None }));
        let s = r.send.get_or_insert_with(|| RemoteSend::new(&attr));
        let mut too_long = false;
        if s.link.is_none() {
            match route {
                Some(l) => {
                    s.link = Some(l);
                    self.net.attach(l, qpn, tenant);
                    tracing::debug!(qpn, link = l.0, "QP bound to link");
                    // A request taken while there was no link counted its
                    // PSNs at the largest chunk; the link's may be smaller.
                    too_long = s.renumber(u64::from(self.net.chunk(l)), self.config.max_psns_in_flight / 2);
                }
                None if ah.is_global => self.net.want(ah.dgid),
                None => {}
            }
        }
        if too_long {
            act.busy = true;
            self.remote_fail(qpn, WcStatus::LocLenErr, io);
            return;
        }
        let s = self.send_state(qpn).expect("made above");
        let unreachable = s.link.is_none() || s.link_lost;
        if s.sent.is_empty() && s.blocked.is_none() {
            if state == QpState::Sqd {
                let qp = self.qps.get_mut(&qpn).expect("looked up above");
                if std::mem::take(&mut qp.sqd_notify) {
                    let ev = AsyncEvent { event_type: AsyncEventType::SqDrained, element: qpn };
                    io.async_event(qp.ctx, ev);
                }
                return;
            }
            // With no link, a request is taken anyway so that its timer
            // runs: it completes RETRY_EXC_ERR unless a link comes in time.
            if unreachable && self.pull_remote(qpn, now, io) {
                act.busy = true;
            }
        }
        let limit = self.config.migration_pause_limit;
        let Some(s) = self.send_state(qpn) else { return };
        if s.hold_until > now {
            act.timer(s.hold_until);
        }
        // The peer is paused for a migration: no retry is spent while it
        // is, only the bound, after which it counts as a dead host.
        if let Some(since) = s.paused_since {
            let end = since + limit;
            if now >= end || s.sent.is_empty() {
                s.paused_since = None;
                if now >= end {
                    act.busy = true;
                    tracing::debug!(qpn, "peer paused past the migration bound");
                    self.remote_fail(qpn, WcStatus::RetryExcErr, io);
                }
                return;
            }
            s.ack_deadline = None;
            act.timer(end);
            return;
        }
        // Whatever is outstanding is timed (unless the timeout is
        // infinite), so that a QP whose peer went silent always ends.
        if s.ack_deadline.is_none() && !s.sent.is_empty() {
            let from = now.max(s.hold_until);
            s.ack_deadline = timers::ack_timeout(attr.timeout).map(|t| from + t);
        }
        let Some(deadline) = s.ack_deadline else { return };
        if now < deadline {
            act.timer(deadline);
            return;
        }
        if s.retries_left == 0 || s.sent.is_empty() {
            act.busy = true;
            self.remote_fail(qpn, WcStatus::RetryExcErr, io);
            return;
        }
        s.retries_left -= 1;
        // Everything unanswered goes again, from the oldest request (the
        // peer drops what it had not accepted, e.g. before it was in RTR,
        // and answers duplicates without executing them twice).
        s.tx = 0;
        s.tx_off = 0;
        let t = timers::ack_timeout(attr.timeout).unwrap_or(std::time::Duration::from_secs(1));
        s.ack_deadline = Some(now + t);
        act.busy = true;
        act.timer(now + t);
        tracing::debug!(qpn, left = s.retries_left, "transport timer expired; sending again");
        let link = s.link.filter(|l| self.net.links.contains_key(l));
        self.metrics.retransmitted(link);
    }

    /// Takes the next request from the send queue into `sent`. Returns
    /// whether one was taken.
    fn pull_remote(&mut self, qpn: u32, now: Instant, io: &mut dyn Queues) -> bool {
        let Some(req) = self.requester_of(qpn) else { return false };
        // Room for the largest message before the window is full; the
        // request waits in the send queue for ACKs otherwise.
        let per_message = self.config.max_psns_in_flight / 2;
        if let Some(s) = self.send_state(qpn) {
            let in_flight = s.sent.front().map_or(0, |h| psn_diff(s.next_psn, h.first_psn).max(0) as u32);
            if in_flight > per_message {
                return false;
            }
        }
        let wr = match io.pull_send(qpn) {
            None => return false,
            Some(Ok(wr)) => wr,
            Some(Err((wr_id, e))) => {
                self.remote_refuse(
                    qpn,
                    SendWr::new(wr_id, SendOpcode::Send),
                    crate::hca::datapath::wqe_status(e),
                    io,
                );
                return false;
            }
        };
        if let Err(status) = self.check_request(&req, &wr) {
            self.remote_refuse(qpn, wr, status, io);
            return false;
        }
        let timeout = req.attr.timeout;
        let chunk = self.send_chunk(qpn);
        let mut frame = chunk;
        if may_cut(&wr) && self.cuts_frames(qpn, req.tenant, now) {
            // A latency-class tenant is active on the link: this request
            // goes out in smaller frames, unless that makes it too long.
            let cut = u64::from(super::cut_frame(chunk as u32));
            if psns_of(&wr, cut) <= per_message {
                frame = cut;
            }
        }
        let npsn = psns_of(&wr, frame);
        if npsn > per_message {
            // More PSNs than one window holds: too long for this link's
            // chunk size.
            self.remote_refuse(qpn, wr, WcStatus::LocLenErr, io);
            return false;
        }
        // A message of its tenant's rate limit (its bytes are charged as
        // its frames go out).
        self.order.charge(req.tenant, 0, 1);
        self.net.next_serial += 1;
        let serial = self.net.next_serial;
        let taken = self.metrics.turn_start;
        let Some(s) = self.send_state(qpn) else { return false };
        let first_psn = s.next_psn;
        s.next_psn = psn_add(first_psn, npsn);
        s.sent.push_back(SentWr {
            wr,
            serial,
            first_psn,
            npsn,
            frame: frame as u32,
            placed: 0,
            status: None,
            went_out: false,
            taken,
        });
        if s.ack_deadline.is_none() {
            s.ack_deadline = timers::ack_timeout(timeout).map(|t| now + t);
        }
        true
    }

    /// A request failed the local checks: it completes in error now, or
    /// once the requests before it have completed.
    fn remote_refuse(&mut self, qpn: u32, wr: SendWr, status: WcStatus, io: &mut dyn Queues) {
        let Some(s) = self.send_state(qpn) else { return };
        if s.sent.is_empty() {
            let cq = self.qps[&qpn].init.send_cq;
            io.send_retired(qpn, 1);
            self.complete(cq, error_cqe(&wr, status, qpn), qpn, io);
            self.send_queue_error(qpn, io);
        } else {
            s.blocked = Some((wr, status));
        }
    }

    /// The QP fails: the oldest outstanding request completes with
    /// `status`, the rest flush.
    pub(crate) fn remote_fail(&mut self, qpn: u32, status: WcStatus, io: &mut dyn Queues) {
        if let Some(s) = self.send_state(qpn) {
            if let Some(head) = s.sent.front_mut() {
                head.status.get_or_insert(status);
            }
            s.ack_deadline = None;
        }
        self.enter_error(qpn, io);
    }

    /// The next request frame of `qpn` for `link`, if it has one to send.
    pub(super) fn requester_transmit(
        &mut self,
        qpn: u32,
        link: LinkId,
        now: Instant,
        io: &mut dyn Queues,
    ) -> Option<Transmit> {
        let qp = self.qps.get(&qpn)?;
        let state = qp.state();
        if qp.init.qp_type != crate::verbs::QpType::Rc || !matches!(state, QpState::Rts | QpState::Sqd) {
            return None;
        }
        let max_out = qp.init.cap.max_send_wr as usize;
        let max_rd = usize::from(qp.attr.max_rd_atomic.max(1));
        let ack_timeout = timers::ack_timeout(qp.attr.timeout);
        let s = qp.remote.as_ref()?.send.as_ref()?;
        if s.link != Some(link) || s.link_lost || now < s.hold_until {
            return None;
        }
        if s.tx == s.sent.len() {
            if state != QpState::Rts || s.blocked.is_some() || s.sent.len() >= max_out {
                return None;
            }
            if !self.pull_remote(qpn, now, io) {
                return None;
            }
        }
        let s = self.qps.get(&qpn)?.remote.as_ref()?.send.as_ref()?;
        let w = &s.sent[s.tx];
        if w.needs_response() && s.sent.range(..s.tx).filter(|x| x.needs_response()).count() >= max_rd {
            return None;
        }
        let Some(t) = self.build_request(qpn, link) else {
            // The request failed on its own memory: the QP goes to ERR, and
            // the flush completes it with that status, in order.
            if self.send_state(qpn).is_some_and(|s| s.sent.get(s.tx).is_some_and(|w| w.status.is_some())) {
                self.enter_error(qpn, io);
            }
            return None;
        };
        // An ACK this QP holds goes out right behind its request.
        if let Some(rs) =
            self.qps.get_mut(&qpn).and_then(|q| q.remote.as_deref_mut()).and_then(|r| r.recv.as_mut())
        {
            if rs.link == Some(link) {
                rs.ack_flush = true;
            }
        }
        // The transport timer runs from the last frame sent: a long
        // message is answered only at its end, and the time its frames
        // take to go out is not the peer's silence.
        let probe = self.config.migration_probe_interval;
        let s = self.send_state(qpn)?;
        s.last_sent = now;
        s.ack_deadline = ack_timeout.map(|t| now + t);
        if s.paused_since.is_some() {
            // A probe of a paused peer: one frame, the oldest, each
            // interval, until it answers otherwise or moves.
            s.tx = 0;
            s.tx_off = 0;
            s.hold_until = now + probe;
            s.ack_deadline = None;
        }
        Some(t)
    }

    fn build_request(&mut self, qpn: u32, link: LinkId) -> Option<Transmit> {
        let link_chunk = u64::from(self.net.chunk(link));
        let qp = self.qps.get(&qpn)?;
        let (vnet, dest, pd) = (qp.tenant.0, qp.attr.dest_qp_num, qp.pd);
        let s = qp.remote.as_ref()?.send.as_ref()?;
        let w = &s.sent[s.tx];
        let wr = &w.wr;
        let len = wr.msg_len();
        // Its own frame size (never more than the link's chunk).
        let chunk = u64::from(w.frame).clamp(1, link_chunk);
        let (mut repr, advance, data) = match wr.opcode {
            SendOpcode::RdmaRead => {
                let mut r = DataRepr::new(Opcode::ReadRequest, vnet, dest, qpn, w.first_psn);
                r.reth = Some(Reth { va: wr.remote_addr, rkey: wr.rkey, dma_len: len as u32 });
                (r, len, None)
            }
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => {
                let cas = wr.opcode == SendOpcode::AtomicCmpAndSwp;
                let op = if cas { Opcode::CompareSwap } else { Opcode::FetchAdd };
                let mut r = DataRepr::new(op, vnet, dest, qpn, w.first_psn);
                r.atomic = Some(AtomicEth {
                    va: wr.remote_addr,
                    rkey: wr.rkey,
                    swap_add: if cas { wr.swap } else { wr.compare_add },
                    compare: if cas { wr.compare_add } else { 0 },
                });
                (r, len, None)
            }
            op => {
                let off = s.tx_off;
                let n = chunk.min(len - off);
                let (first, last) = (off == 0, off + n == len);
                let psn = psn_add(w.first_psn, (off / chunk) as u32);
                let mut r = DataRepr::new(send_opcode(op, first, last), vnet, dest, qpn, psn);
                r.msg_offset = off as u32;
                r.payload_len = n as u32;
                if first && matches!(op, SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm) {
                    r.reth = Some(Reth { va: wr.remote_addr, rkey: wr.rkey, dma_len: len as u32 });
                }
                if last && op.has_imm() {
                    r.imm = Some(wr.imm_data);
                }
                if chunk < link_chunk && len > chunk {
                    // Cut for a latency-class tenant (see `cut_frame`).
                    if let Some(l) = self.net.links.get_mut(&link) {
                        l.stats.throttle.cut_frames += 1;
                        l.stats.throttle.cut_bytes += n;
                        if let Some(c) = l.traffic_of(crate::hca::TenantId(vnet)) {
                            c.cut_frames += 1;
                            c.cut_bytes += n;
                        }
                    }
                }
                (r, n, Some((off, n)))
            }
        };
        let last_frame = match data {
            Some((off, n)) => off + n == len,
            None => true,
        };
        if last_frame {
            repr.flags |= DataFlags::ACK_REQ;
            if wr.flags.contains(SendFlags::SOLICITED) && repr.opcode.may_be_solicited() {
                repr.flags |= DataFlags::SOLICITED;
            }
        }
        let mut t = Transmit::new(&repr);
        if let Some((off, n)) = data {
            if wr.is_inline() {
                let d = wr.inline_data();
                t.header.extend(d[off as usize..(off + n) as usize].iter().copied());
            } else if n > 0 {
                // Keys are looked up again for every chunk: a region
                // deregistered mid-transfer stops it at once.
                let segs = self.resolve(pd, wr.sg.as_slice(), AccessFlags::empty());
                match segs.and_then(|segs| windows(&segs, off, n)) {
                    Some(w) => t.payload = w,
                    None => {
                        self.remote_fail_at_tx(qpn);
                        return None;
                    }
                }
            }
        }
        let s = self.send_state(qpn)?;
        s.tx_off += advance;
        if last_frame {
            let tx = s.tx;
            s.sent[tx].went_out = true;
            s.tx += 1;
            s.tx_off = 0;
        }
        Some(t)
    }

    /// The request being sent lost its local memory (deregistered mid-
    /// transfer): it completes LOC_PROT_ERR in order when the QP's queue is
    /// flushed, and nothing more is sent (see `requester_transmit`).
    fn remote_fail_at_tx(&mut self, qpn: u32) {
        let Some(s) = self.send_state(qpn) else { return };
        let tx = s.tx;
        if let Some(w) = s.sent.get_mut(tx) {
            w.status = Some(WcStatus::LocProtErr);
        }
    }

    /// A response frame (ACK, NAK, read response, atomic ACK) for one of
    /// our requests.
    pub(super) fn requester_handle(
        &mut self,
        link: LinkId,
        hdr: &DataRepr,
        now: Instant,
        io: &mut dyn Queues,
    ) -> (Sink, AfterPayload) {
        let qpn = hdr.dest_qpn;
        let ours = self.qps.get(&qpn).is_some_and(|q| {
            // A paused QP's state is frozen for its snapshot: the
            // answers it misses come again to where it resumes.
            !q.paused
                && !q.peer_stale
                && q.tenant.0 == hdr.vnet
                && !q.tenant.is_host_local()
                && q.attr.dest_qp_num == hdr.src_qpn
                && q.remote.as_ref().and_then(|r| r.send.as_ref()).is_some_and(|s| s.link == Some(link))
                && matches!(q.state(), QpState::Rts | QpState::Sqd | QpState::Sqe)
        });
        if !ours {
            self.net.dropped(link, "response for no requester of ours");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        let psn = hdr.psn;
        let paused_nak = hdr.aeth.is_some_and(|a| a.syndrome == Syndrome::Nak(NakCode::QpPaused));
        if !paused_nak {
            // Any other answer: the peer is not (or no longer) paused.
            if let Some(s) = self.send_state(qpn) {
                s.paused_since = None;
            }
        }
        match hdr.opcode {
            Opcode::Acknowledge => {
                let Some(aeth) = hdr.aeth else { return (Sink::Discard, AfterPayload::Nothing) };
                if aeth.syndrome != Syndrome::Ack && self.send_state(qpn).is_some_and(|s| s.sent.is_empty()) {
                    // With nothing outstanding, a NAK answers a request of
                    // the QP's life before a reset, which the peer answered
                    // late: a ghost, dropped (it failed the new QP).
                    self.net.dropped(link, "NAK with no request outstanding");
                    return (Sink::Discard, AfterPayload::Nothing);
                }
                match aeth.syndrome {
                    Syndrome::Ack => self.acked_through(qpn, psn, now, io),
                    Syndrome::RnrNak { timer } => self.rnr_nak(qpn, psn, timer, now, io),
                    Syndrome::Nak(NakCode::PsnSequenceError) => self.sequence_nak(qpn, psn, now, io),
                    Syndrome::Nak(NakCode::QpPaused) => self.paused_nak(qpn, psn, now, io),
                    Syndrome::Nak(code) => {
                        self.acked_before(qpn, psn, now, io);
                        let status = code.completion_status().unwrap_or(WcStatus::RemOpErr);
                        self.remote_fail(qpn, status, io);
                    }
                }
                (Sink::Discard, AfterPayload::Nothing)
            }
            Opcode::AtomicAcknowledge => {
                self.acked_before(qpn, psn, now, io);
                let Some(orig) = hdr.atomic_ack else { return (Sink::Discard, AfterPayload::Nothing) };
                let head = self
                    .send_state(qpn)
                    .and_then(|s| {
                        s.sent.front().filter(|w| w.went_out && w.wr.opcode.is_atomic() && w.first_psn == psn)
                    })
                    .map(|w| w.wr.sg);
                let Some(sg) = head else {
                    self.net.dropped(link, "atomic ACK for no outstanding atomic");
                    return (Sink::Discard, AfterPayload::Nothing);
                };
                let pd = self.qps[&qpn].pd;
                let placed = self
                    .resolve(pd, sg.as_slice(), AccessFlags::LOCAL_WRITE)
                    .and_then(|segs| windows(&segs, 0, 8))
                    .map(|w| {
                        let bytes = orig.to_le_bytes();
                        let mut at = 0;
                        w.iter().all(|s| {
                            let ok = s.region.write(s.off, &bytes[at..at + s.len]).is_ok();
                            at += s.len;
                            ok
                        })
                    });
                if placed == Some(true) {
                    self.complete_head(qpn, 8, now, io);
                } else {
                    self.remote_fail(qpn, WcStatus::LocProtErr, io);
                }
                (Sink::Discard, AfterPayload::Nothing)
            }
            _ => self.read_response(link, qpn, hdr, now, io),
        }
    }

    fn read_response(
        &mut self,
        link: LinkId,
        qpn: u32,
        hdr: &DataRepr,
        now: Instant,
        io: &mut dyn Queues,
    ) -> (Sink, AfterPayload) {
        let chunk = u64::from(self.net.chunk(link));
        // A response implicitly acknowledges every request before it.
        let first = self
            .send_state(qpn)
            .and_then(|s| s.sent.iter().find(|w| w.needs_response()).map(|w| w.first_psn));
        if let Some(f) = first {
            self.acked_before(qpn, f, now, io);
        }
        let pd = self.qps[&qpn].pd;
        let Some(s) = self.send_state(qpn) else { return (Sink::Discard, AfterPayload::Nothing) };
        let expect = s.sent.front().filter(|w| w.went_out && w.wr.opcode == SendOpcode::RdmaRead).map(|w| {
            (psn_add(w.first_psn, (w.placed / chunk) as u32), w.placed, w.wr.msg_len(), w.wr.sg, w.serial)
        });
        let Some((want_psn, placed, len, sg, serial)) = expect else {
            self.net.dropped(link, "read response for no outstanding read");
            return (Sink::Discard, AfterPayload::Nothing);
        };
        if psn_diff(hdr.psn, want_psn) < 0 {
            // The answer to a read sent again, for bytes already placed.
            self.net.dropped(link, "duplicate read response");
            return (Sink::Discard, AfterPayload::Nothing);
        }
        let n = u64::from(hdr.payload_len);
        let in_order = hdr.psn == want_psn
            && u64::from(hdr.msg_offset) == placed
            && placed + n <= len
            && (hdr.opcode.is_last() || hdr.opcode.is_only()) == (placed + n == len);
        if !in_order {
            self.net.dropped(link, "read response out of order");
            self.remote_fail(qpn, WcStatus::RetryExcErr, io);
            return (Sink::Discard, AfterPayload::Nothing);
        }
        let last = placed + n == len;
        if n == 0 {
            return (Sink::Discard, AfterPayload::ReadResponse { qpn, serial, offset: placed, len: 0, last });
        }
        match self
            .resolve(pd, sg.as_slice(), AccessFlags::LOCAL_WRITE)
            .and_then(|segs| windows(&segs, placed, n))
        {
            Some(w) => (
                Sink::Place(w),
                AfterPayload::ReadResponse { qpn, serial, offset: placed, len: n as u32, last },
            ),
            None => {
                self.remote_fail(qpn, WcStatus::LocProtErr, io);
                (Sink::Discard, AfterPayload::Nothing)
            }
        }
    }

    /// A read response chunk is in the local buffer. It counts only if its
    /// read is still the oldest request, as it was when its header came:
    /// the QP may have failed or been reset while the payload arrived.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_response_placed(
        &mut self,
        link: LinkId,
        qpn: u32,
        serial: u64,
        offset: u64,
        len: u32,
        last: bool,
        now: Instant,
        io: &mut dyn Queues,
    ) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        let live = matches!(qp.state(), QpState::Rts | QpState::Sqd | QpState::Sqe);
        let ack_timeout = timers::ack_timeout(qp.attr.timeout);
        let Some(s) = self.send_state(qpn) else { return };
        let Some(head) =
            s.sent.front_mut().filter(|h| live && h.went_out && h.serial == serial && h.placed == offset)
        else {
            self.net.dropped(link, "read response for a read that is gone");
            return;
        };
        head.placed += u64::from(len);
        if last {
            let total = head.placed as u32;
            self.complete_head(qpn, total, now, io);
        } else if let Some(t) = ack_timeout {
            // A long read's answer is progress too.
            if let Some(s) = self.send_state(qpn) {
                s.ack_deadline = Some(now + t);
            }
        }
    }

    /// The buffer a read response was being placed in was deregistered:
    /// the read, if still the oldest request, fails LOC_PROT_ERR.
    pub(super) fn read_response_lost(&mut self, qpn: u32, serial: u64, io: &mut dyn Queues) {
        let head = self.send_state(qpn).and_then(|s| s.sent.front().map(|h| h.serial));
        if head == Some(serial) {
            self.remote_fail(qpn, WcStatus::LocProtErr, io);
        }
    }

    /// An ACK for every PSN up to `psn`: completes the requests it covers.
    fn acked_through(&mut self, qpn: u32, psn: u32, now: Instant, io: &mut dyn Queues) {
        self.acked_before(qpn, psn_add(psn, 1), now, io);
    }

    /// Completes every request whose PSNs all lie before `psn`, except a
    /// read or atomic, which waits for its response.
    fn acked_before(&mut self, qpn: u32, psn: u32, now: Instant, io: &mut dyn Queues) {
        loop {
            let Some(s) = self.send_state(qpn) else { return };
            let Some(head) = s.sent.front() else { return };
            if !head.went_out || head.needs_response() || psn_diff(head.last_psn(), psn) >= 0 {
                return;
            }
            self.complete_head(qpn, 0, now, io);
        }
    }

    /// The oldest request completed successfully.
    fn complete_head(&mut self, qpn: u32, byte_len: u32, now: Instant, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let (cq, sig_all, attr, tenant) = (qp.init.send_cq, qp.init.sq_sig_all, qp.attr, qp.tenant);
        let Some(s) = qp.remote.as_deref_mut().and_then(|r| r.send.as_mut()) else { return };
        let Some(w) = s.sent.pop_front() else { return };
        if s.tx == 0 {
            // It completed while being sent again: the next one is sent
            // again from its start.
            s.tx_off = 0;
        } else {
            s.tx -= 1;
        }
        // Progress: the timers and retry counts start over.
        s.retries_left = attr.retry_cnt;
        s.rnr_left = attr.rnr_retry;
        s.ack_deadline =
            if s.sent.is_empty() { None } else { timers::ack_timeout(attr.timeout).map(|t| now + t) };
        let blocked = if s.sent.is_empty() { s.blocked.take() } else { None };
        io.send_retired(qpn, 1);
        let c = self.counters(tenant);
        c.sent(w.wr.msg_len());
        if w.wr.flags.contains(SendFlags::SIGNALED) || sig_all {
            c.latency.record(now.saturating_since(w.taken).as_nanos() as u64);
            let mut cqe = Cqe::new(w.wr.wr_id, WcStatus::Success, w.wr.opcode.wc_opcode(), qpn);
            cqe.byte_len = byte_len;
            self.complete(cq, cqe, qpn, io);
        }
        if let Some((wr, status)) = blocked {
            io.send_retired(qpn, 1);
            self.complete(cq, error_cqe(&wr, status, qpn), qpn, io);
            self.send_queue_error(qpn, io);
        }
    }

    /// Receiver not ready at `psn`: the requests before it are done, and
    /// the rest go again from `psn` after the responder's RNR delay.
    fn rnr_nak(&mut self, qpn: u32, psn: u32, timer: u8, now: Instant, io: &mut dyn Queues) {
        self.acked_before(qpn, psn, now, io);
        let Some(s) = self.send_state(qpn) else { return };
        if s.rnr_left == 0 {
            self.remote_fail(qpn, WcStatus::RnrRetryExcErr, io);
            return;
        }
        if s.rnr_left != timers::RNR_RETRY_INFINITE {
            s.rnr_left -= 1;
        }
        s.hold_until = now + timers::rnr_delay(timer);
        // The timer starts again once the delay is over (the frame going
        // out again restarts it; if it cannot, the QP still ends).
        let timeout = self.qps[&qpn].attr.timeout;
        let s = self.send_state(qpn).expect("checked");
        let resume = s.hold_until;
        s.ack_deadline = timers::ack_timeout(timeout).map(|t| resume + t);
        let chunk = self.send_chunk(qpn);
        let s = self.send_state(qpn).expect("checked");
        if !Self::rewind(s, psn, chunk) {
            self.remote_fail(qpn, WcStatus::RetryExcErr, io);
        }
    }

    /// The peer QP is paused (its tenant migrates) and expected `psn`:
    /// what lies before it is done; the rest waits, probed every
    /// `migration_probe_interval`, without spending a retry, until the
    /// peer answers otherwise, announces where it moved, or the pause
    /// outlasts `migration_pause_limit`.
    fn paused_nak(&mut self, qpn: u32, psn: u32, now: Instant, io: &mut dyn Queues) {
        self.acked_before(qpn, psn, now, io);
        let probe = self.config.migration_probe_interval;
        let Some(s) = self.send_state(qpn) else { return };
        if s.sent.is_empty() {
            return;
        }
        if s.paused_since.is_none() {
            tracing::debug!(qpn, psn, "peer QP paused for a migration; waiting");
            s.paused_since = Some(now);
            s.hold_until = now + probe;
        }
        s.tx = 0;
        s.tx_off = 0;
        s.ack_deadline = None;
    }

    /// The responder expected `psn`: send again from there, once per retry.
    fn sequence_nak(&mut self, qpn: u32, psn: u32, now: Instant, io: &mut dyn Queues) {
        self.acked_before(qpn, psn, now, io);
        if self.send_state(qpn).is_none() {
            return;
        }
        let chunk = self.send_chunk(qpn);
        let s = self.send_state(qpn).expect("checked");
        if s.retries_left == 0 || !Self::rewind(s, psn, chunk) {
            self.remote_fail(qpn, WcStatus::RetryExcErr, io);
            return;
        }
        s.retries_left -= 1;
        let link = s.link.filter(|l| self.net.links.contains_key(l));
        self.metrics.retransmitted(link);
    }

    /// Points the transmitter back at the frame with `psn`, in the oldest
    /// outstanding request. Returns false if no request holds that PSN.
    fn rewind(s: &mut RemoteSend, psn: u32, chunk: u64) -> bool {
        let Some(head) = s.sent.front() else { return false };
        let d = psn_diff(psn, head.first_psn);
        if d < 0 || d as u32 >= head.npsn || head.needs_response() && d != 0 {
            return false;
        }
        // Every frame before `psn` carried one full frame of its request.
        let frame = if head.frame == 0 { chunk } else { u64::from(head.frame).min(chunk) };
        s.tx = 0;
        s.tx_off = d as u64 * frame;
        true
    }

    /// Everything outstanding completes: the failed request with its
    /// status, the rest with WR_FLUSH_ERR (the QP is in ERR or SQE).
    pub(crate) fn flush_remote_sends(&mut self, qpn: u32, io: &mut dyn Queues) -> bool {
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        let cq = qp.init.send_cq;
        let Some(s) = qp.remote.as_deref_mut().and_then(|r| r.send.as_mut()) else { return false };
        let sent = std::mem::take(&mut s.sent);
        let blocked = s.blocked.take();
        s.tx = 0;
        s.tx_off = 0;
        s.ack_deadline = None;
        let any = !sent.is_empty() || blocked.is_some();
        for w in sent {
            io.send_retired(qpn, 1);
            let status = w.status.unwrap_or(WcStatus::WrFlushErr);
            self.complete(cq, error_cqe(&w.wr, status, qpn), qpn, io);
        }
        if let Some((wr, status)) = blocked {
            io.send_retired(qpn, 1);
            self.complete(cq, error_cqe(&wr, status, qpn), qpn, io);
        }
        any
    }
}
