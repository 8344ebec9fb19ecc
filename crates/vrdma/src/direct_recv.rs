//! The direct path's receive side (`docs/direct-path.md`): SENDs and RDMA
//! writes with immediate whose receive this library claims itself from
//! the peer QP's receive queue, completing it into the peer QP's *inbox*, which the
//! peer's library polls before its receive CQ's ring.
//!
//! What keeps the engine path's semantics:
//! - **one consumer per receive**: the receive queue is claimed with a
//!   compare-and-swap on its consumer index, as the engine's pulls do for
//!   such queues, so a receive completes once, by this path or by the
//!   engine (a flush included);
//! - **a requester stopped or killed mid-delivery**: the completion is
//!   staged in the inbox (as a flush, `RingView::stage`) and its slot named
//!   in `INBOX_AUX_STAGED` before the claim; after placing the message this
//!   library takes that word with a compare-and-swap, makes the completion
//!   a success and publishes it with a compare-and-swap of the producer
//!   index. The daemon's flush of the peer QP publishes a claim's staged
//!   completion that was never published, so the receive completes once
//!   whenever this process stops or dies (`docs/direct-path.md`);
//! - **order in the peer's CQ**: a receive is claimed only while every
//!   receive completion of the peer QP that the engine pushed into its
//!   CQ's ring was polled (the inbox's `INBOX_AUX_ENGINE_PUSHED` and
//!   `INBOX_AUX_ENGINE_POLLED` words are equal), and the peer polls
//!   inboxes before the ring (every engine completion after it waits
//!   behind it);
//! - **the CQ's depth**: the engine adds the inboxes' entries to its own
//!   overrun check; the inbox itself never holds more than the CQ's depth
//!   (a completion that would not fit is left to the engine). Not checked
//!   here: the peer CQ's other completions (see `docs/direct-path.md`);
//! - **an SRQ**: the peer's receives may come from an SRQ, claimed the same
//!   way (the engine and every requester claim its entries with the same
//!   compare-and-swap), requesters one at a time: each takes the SRQ's
//!   claiming turn (`SRQ_AUX_CLAIMER`, named by the peer QP) before its
//!   claim and notes the index it is about to claim (`SRQ_AUX_CLAIM_AT`),
//!   and gives the turn back after its publication, so that the daemon's
//!   flush of the peer QP can tell this process's claim from another's
//!   and publish its staged completion as a flush on that QP's CQ if this
//!   process died in between; a claim that leaves fewer posted than the SRQ's
//!   armed limit (`SRQ_AUX_LIMIT`) has the daemon check and raise the
//!   limit event, which it disarms, so it fires once;
//! - **RNR**: no receive posted (or the peer's inbox as full as its CQ
//!   may be), a SEND waits up to `crate::direct::RECV_WAIT` for the peer
//!   to catch up (never inside an announced copy), then the WR goes to the
//!   engine, whose RNR timer and retry count (or overrun check) apply;
//! - **a receive a SEND does not fit** (more SGEs than the QP's
//!   `max_recv_sge`, an SGE outside a local-write region of the peer's PD
//!   granted here, a message longer than the SGEs): the entry is left
//!   unclaimed and the WR goes to the engine, which reports
//!   `LOC_LEN_ERR`/`LOC_PROT_ERR` as always;
//! - **many QPs on one CQ**: the grant carries the peer's receive CQ's
//!   segment; after each push this library marks the peer QP's bucket in
//!   that CQ's ready set, so the owner's polls look only at marked
//!   inboxes (`crate::direct_ready`);
//! - **completion channels and solicited events**: when the peer's
//!   receive CQ has a channel, the grant also carries the channel's
//!   doorbell; after pushing a completion this library takes the
//!   CQ's armed word with a compare-and-swap and rings the doorbell, as
//!   the engine's `notify_channel` does (`crate::cq::raise_event`), so
//!   each arming fires once, whichever side completes first.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use vrdma_core::hca::DirectRefusal;
use vrdma_core::proto::{
    DirectRecvGranted, Reply, Request, RingSpec, INBOX_AUX_ENGINE_POLLED, INBOX_AUX_ENGINE_PUSHED,
    INBOX_AUX_REQUESTER_CPU, INBOX_AUX_STAGED, SRQ_AUX_CLAIMER, SRQ_AUX_CLAIM_AT, SRQ_AUX_CLAIM_SLOT,
    SRQ_AUX_LIMIT, SRQ_CLAIMER_NOTED,
};
use vrdma_core::ring::{Cqe, RecvSlot, SendWr, CQE_SIZE, CQE_STATUS_BYTE, RECV_HEADER};
use vrdma_core::verbs::{SendFlags, SendOpcode, WcFlags, WcOpcode, WcStatus};
use vrdma_shm::{Claim, Mapping, RingView, WordPage};

use crate::context::Context;
use crate::direct_ready::ReadySet;

/// A standing receive grant: the peer QP's receive queue and inbox.
pub(crate) struct RecvTarget {
    pub(crate) generation: u32,
    responder: u32,
    lid: u16,
    rq: RingView,
    inbox: RingView,
    /// The peer's receive CQ's depth: the inbox never holds more.
    cq_depth: u32,
    /// The peer QP's receive SGEs at most.
    pub(crate) max_recv_sge: u32,
    /// The peer's receive CQ's ring: its ready set (marked after each
    /// push, `crate::direct_ready`), and its armed and event words.
    cq: RingView,
    /// The peer CQ's channel's doorbell, when it has a completion channel.
    bell: Option<vrdma_shm::Doorbell>,
    /// A receive slot's bytes, looked at before it is claimed (read in
    /// place, `RecvSlot`: no decoded request is built per SEND).
    scratch: Vec<u8>,
    /// `rq` is the peer's SRQ (shared with the engine and other
    /// requesters), whose limit event the daemon raises.
    srq: bool,
    /// A claim left the SRQ below its armed limit: the caller asks the
    /// daemon to check it (`Request::DirectSrqLimit`) once its copy is no
    /// longer announced.
    pub(crate) limit_due: bool,
}

/// What [`RecvTarget::deliver`] did.
pub(crate) enum Delivered {
    /// Claimed, placed and completed.
    Done,
    /// The peer is behind: no receive posted, or its inbox holds as many
    /// completions as its CQ may (it has not polled). It may catch up in
    /// a moment ([`crate::direct`] waits a little for a SEND before
    /// leaving it to the engine, whose RNR or overrun then applies).
    Behind,
    /// Not now (engine completions of the peer QP not yet polled, an
    /// entry this path cannot prove valid): the engine's.
    NotNow,
}

impl RecvTarget {
    /// Claims the peer's next receive for `wr` (a SEND or an RDMA write
    /// with immediate of requester QP `requester`) if its completion can
    /// be delivered in order and within the CQ's depth now and `fits` the
    /// receive (saying `Some`); then `place`s the payload (into the
    /// receive's SGEs for a SEND, with what `fits` found of them) and
    /// pushes the peer's completion. The caller holds the grant
    /// (window words checked after announcing itself).
    pub(crate) fn deliver<P>(
        &mut self,
        requester: u32,
        wr: &SendWr,
        mut fits: impl FnMut(&RecvSlot) -> Option<P>,
        place: impl FnOnce(&RecvSlot, P),
    ) -> Delivered {
        let pushed = self.inbox.aux(INBOX_AUX_ENGINE_PUSHED).load(Ordering::SeqCst);
        if self.inbox.aux(INBOX_AUX_ENGINE_POLLED).load(Ordering::SeqCst) != pushed {
            return Delivered::NotNow;
        }
        // The inbox's consumer index (the owner writes it on every poll)
        // is read only when this view's copy of it says the inbox is at
        // the CQ's depth (`RingView::fewer_than`): an older copy counts
        // more entries, never fewer.
        match self.inbox.fewer_than(self.cq_depth) {
            Ok(true) => {}
            Ok(false) => return Delivered::Behind,
            Err(_) => return Delivered::NotNow,
        }
        let opcode = if wr.opcode == SendOpcode::RdmaWriteWithImm {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let solicited = wr.flags.contains(SendFlags::SOLICITED);
        // An SRQ's receives are claimed by one requester at a time: the
        // turn is taken before the claim and given back after the
        // publication (or when nothing was claimed); another's turn is a
        // peer a moment behind, as one without a receive posted.
        let turn = match self.srq {
            true => match Turn::take(self.rq.aux(SRQ_AUX_CLAIMER), self.responder) {
                Some(t) => Some(t),
                None => return Delivered::Behind,
            },
            false => None,
        };
        let (claim_at, claim_slot) = (self.rq.aux(SRQ_AUX_CLAIM_AT), self.rq.aux(SRQ_AUX_CLAIM_SLOT));
        let srq = self.srq;
        // Ours alone (`&mut self`, under the QP's direct-path lock): staged
        // without the view's producer lock.
        let inbox = &mut self.inbox;
        let (responder, lid) = (self.responder, self.lid);
        let mut taken = None;
        // The completion is staged in the inbox's next slot *before* the
        // claim, as a flush, and the slot named in `INBOX_AUX_STAGED`: if
        // this process stops or dies between the claim and the
        // publication, the daemon's flush of the peer QP publishes it
        // (`Queues::flush_claimed`), so the receive still completes
        // exactly once.
        // On an SRQ, each index is noted before it is looked at again and
        // claimed: an index the engine claimed instead is then known to
        // the daemon as the engine's (`Queues::flush_claimed`).
        // A turn no longer ours (the daemon gave it back: our peer QP was
        // destroyed while we were on our way; or scribbled on) is another
        // requester's from then on: its index stays unwritten and nothing
        // is claimed without it (`lost`).
        let lost = std::cell::Cell::new(false);
        let note = |at: u32| {
            if let Some(t) = &turn {
                if !t.held() {
                    lost.set(true);
                    return;
                }
                claim_at.store(at, Ordering::SeqCst);
                t.noted();
            }
        };
        let claimed = self.rq.try_claim_noting(&mut self.scratch, note, |b| match RecvSlot::parse(b) {
            _ if lost.get() => false,
            Ok(r) => {
                let Some(fit) = fits(&r) else { return false };
                let mut cqe = Cqe::new(r.wr_id, WcStatus::WrFlushErr, opcode, responder);
                cqe.byte_len = wr.msg_len() as u32;
                cqe.src_qp = requester;
                cqe.slid = lid;
                if wr.opcode.has_imm() {
                    cqe.wc_flags = WcFlags::WITH_IMM;
                    cqe.imm_data = wr.imm_data;
                }
                cqe.solicited = solicited;
                let mut out = [0u8; CQE_SIZE];
                cqe.encode(&mut out);
                match inbox.stage_mut(&out) {
                    Ok(Some(at)) => {
                        // Release is enough: the claim's compare-and-swap
                        // (AcqRel) follows, and the daemon reads this only
                        // after it has seen the claim.
                        inbox.aux(INBOX_AUX_STAGED).store(at, Ordering::Release);
                        if srq {
                            // Before the claim: the daemon publishes this
                            // slot only while it is still unpublished.
                            claim_slot.store(at, Ordering::SeqCst);
                        }
                        taken = Some((at, fit));
                        true
                    }
                    _ => false,
                }
            }
            Err(_) => false,
        });
        let (Ok(Claim::Taken), Some((at, fit))) = (claimed, taken) else {
            return if matches!(claimed, Ok(Claim::Empty)) { Delivered::Behind } else { Delivered::NotNow };
        };
        // The claimed entry's bytes are still in `scratch` (the claim copies
        // each entry it looks at there, and stops at the one taken): the
        // same private bytes that parsed and passed `fits` above.
        let recv = RecvSlot::parse(&self.scratch).expect("the claimed entry parsed when claimed");
        place(&recv, fit);
        // Placed: the staged completion is ours to publish unless the
        // daemon took it first (the peer QP was flushed while this process
        // was stopped between its claim and here: the receive completed
        // once, flushed, and nothing more is done for it).
        let staged = self.inbox.aux(INBOX_AUX_STAGED);
        if staged.compare_exchange(at, at.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Delivered::Done;
        }
        self.inbox.set_staged_byte(at, CQE_STATUS_BYTE, WcStatus::Success.raw());
        // A failure: the daemon published the slot first (this process was
        // stopped right here while the peer QP was flushed: the receive
        // completed once), or the peer's own scribbling on its indices.
        if !self.inbox.publish_staged(at) {
            return Delivered::Done;
        }
        drop(turn);
        // After the push: the owner's poll finds the inbox through its
        // bucket's bit (`crate::direct_ready`).
        ReadySet::of(&self.cq).mark(self.responder);
        // Where we run, for the owner's choice to spin (written only when
        // it changed: the word shares its line with the two read above).
        let cpu = crate::idle::current_cpu_word();
        let word = self.inbox.aux(INBOX_AUX_REQUESTER_CPU);
        if word.load(Ordering::Relaxed) != cpu {
            word.store(cpu, Ordering::Relaxed);
        }
        if let Some(bell) = &self.bell {
            crate::cq::raise_event(&self.cq, bell, solicited, true);
        }
        if self.srq {
            // After the claim (SeqCst): a limit armed before it is seen.
            let limit = self.rq.aux(SRQ_AUX_LIMIT).load(Ordering::SeqCst);
            if limit > 0 && matches!(self.rq.len(), Ok(n) if n < limit) {
                self.limit_due = true;
            }
        }
        Delivered::Done
    }
}

/// An SRQ's claiming turn (`SRQ_AUX_CLAIMER`), held by this requester
/// for peer QP `responder`: given back when dropped, with a
/// compare-and-swap, so that a turn the daemon took back meanwhile (it
/// flushed the peer QP) and another requester took is left alone.
struct Turn<'a> {
    word: &'a AtomicU32,
    mine: u32,
}

impl<'a> Turn<'a> {
    fn take(word: &'a AtomicU32, responder: u32) -> Option<Turn<'a>> {
        let mine = responder.wrapping_add(1);
        word.compare_exchange(0, mine, Ordering::SeqCst, Ordering::SeqCst).ok()?;
        Some(Turn { word, mine })
    }

    /// Whether the turn is still this one's (noted or not).
    fn held(&self) -> bool {
        self.word.load(Ordering::SeqCst) & !SRQ_CLAIMER_NOTED == self.mine
    }

    /// An index is noted in `SRQ_AUX_CLAIM_AT` (stored before this):
    /// the daemon reads it as this turn's from now on.
    fn noted(&self) {
        let noted = self.mine | SRQ_CLAIMER_NOTED;
        let _ = self.word.compare_exchange(self.mine, noted, Ordering::SeqCst, Ordering::SeqCst);
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        for held in [self.mine | SRQ_CLAIMER_NOTED, self.mine] {
            if self.word.compare_exchange(held, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                return;
            }
        }
    }
}

/// Asks the daemon for a receive grant of `qpn`, with the window page
/// when it comes; `Err(None)` when the call itself failed.
pub(crate) fn ask(ctx: &Context, qpn: u32) -> Result<(RecvTarget, Option<WordPage>), Option<DirectRefusal>> {
    let req = Request::DirectRecvGrant { qp: qpn };
    let answer = ctx.inner.control.call(&req, &[]).map_err(|_| None)?;
    let g: DirectRecvGranted = match answer.reply {
        Reply::DirectRecvGrant(g) => g,
        Reply::DirectRefused(why) => return Err(Some(why)),
        _ => return Err(Some(DirectRefusal::Off)),
    };
    // Without the CQ's segment there is no ready set to mark: not usable.
    if g.cq_segment_len == 0 {
        return Err(Some(DirectRefusal::NotGranted));
    }
    let with_srq = g.srq_segment_len > 0;
    let want = usize::from(g.window_len > 0) + 1 + usize::from(with_srq) + 1 + usize::from(g.channel);
    let mut fds = answer.take_fds(want, "DirectRecvGrant").map_err(|_| None)?;
    let bell = if g.channel { Some(vrdma_shm::Doorbell::from_fd(fds.pop().ok_or(None)?)) } else { None };
    let cq_fd = fds.pop().ok_or(None)?;
    let srq_fd = if with_srq { Some(fds.pop().ok_or(None)?) } else { None };
    let qp_fd = fds.pop().ok_or(None)?;
    let window = match fds.pop() {
        Some(fd) => {
            let len = usize::try_from(g.window_len).map_err(|_| None)?;
            Some(WordPage::of_mapping(Mapping::map_untrusted(fd, 0, len).map_err(|_| None)?))
        }
        None => None,
    };
    let map = |fd, len: u64| -> Result<Arc<Mapping>, Option<DirectRefusal>> {
        let len = usize::try_from(len).map_err(|_| None)?;
        Ok(Arc::new(Mapping::map_untrusted(fd, 0, len).map_err(|_| None)?))
    };
    let ring = |m: &Arc<Mapping>, spec: RingSpec| -> Result<RingView, Option<DirectRefusal>> {
        let off = usize::try_from(spec.offset).map_err(|_| None)?;
        RingView::in_segment(m.clone(), off, spec.capacity, spec.stride as usize).map_err(|_| None)
    };
    let qp_map = map(qp_fd, g.qp_segment_len)?;
    // The receive queue lies in the SRQ's segment when the peer has one.
    let rq = match srq_fd {
        Some(fd) => ring(&map(fd, g.srq_segment_len)?, g.rq)?,
        None => ring(&qp_map, g.rq)?,
    };
    let inbox = ring(&qp_map, g.inbox)?;
    if rq.stride() < RECV_HEADER || inbox.stride() != CQE_SIZE {
        return Err(None);
    }
    let cq = ring(&map(cq_fd, g.cq_segment_len)?, g.cq_ring)?;
    if cq.stride() != CQE_SIZE {
        return Err(None);
    }
    let scratch = vec![0u8; rq.stride()];
    let (generation, responder, lid, cq_depth) = (g.generation, g.responder, g.lid, g.cq_depth);
    let max_recv_sge = g.max_recv_sge;
    let target = RecvTarget {
        generation,
        responder,
        lid,
        rq,
        inbox,
        cq_depth,
        max_recv_sge,
        cq,
        bell,
        scratch,
        srq: with_srq,
        limit_due: false,
    };
    Ok((target, window))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn the daemon gave back under its holder (its peer QP was
    /// destroyed) and another requester took is no longer held: the
    /// holder notes nothing into it and leaves it to the other when it
    /// drops it.
    #[test]
    fn a_turn_taken_over_is_no_longer_held_and_left_alone() {
        let word = AtomicU32::new(0);
        let (x, y) = (40, 41);
        let t = Turn::take(&word, x).unwrap();
        assert!(t.held());
        t.noted();
        assert!(t.held(), "noted, still its own");
        assert!(Turn::take(&word, y).is_none(), "one holder at a time");
        // The daemon gives it back; y's requester takes it.
        word.store(0, Ordering::SeqCst);
        let other = Turn::take(&word, y).unwrap();
        assert!(!t.held());
        t.noted();
        assert_eq!(word.load(Ordering::SeqCst), y + 1, "x's note leaves y's turn alone");
        drop(t);
        assert_eq!(word.load(Ordering::SeqCst), y + 1, "and so does its drop");
        assert!(other.held());
        drop(other);
        assert_eq!(word.load(Ordering::SeqCst), 0);
    }
}
