//! The device's objects as the core keeps them.

use std::collections::VecDeque;

use super::{ContextId, TenantId};
use crate::memory::Region;
use crate::ring::{RecvWr, SendWr};
use crate::time::Instant;
use crate::verbs::{AccessFlags, AhAttr, QpAttr, QpInitAttr, QpState, SrqAttr};

pub(crate) struct Context {
    pub tenant: TenantId,
}

pub(crate) struct Pd {
    pub ctx: ContextId,
    pub users: u32,
}

pub(crate) struct Mr {
    pub ctx: ContextId,
    pub pd: u32,
    /// The tenant virtual address the region starts at (what SGEs name).
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
    pub region: Region,
}

impl Mr {
    /// Offset of `[addr, addr+len)` in the region, if it lies inside.
    pub fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.addr)?;
        (off.checked_add(len)? <= self.len).then_some(off as usize)
    }
}

/// An address handle: where a UD send goes, checked against its PD.
pub(crate) struct Ah {
    pub ctx: ContextId,
    pub pd: u32,
    pub attr: AhAttr,
}

pub(crate) struct Cq {
    pub ctx: ContextId,
    pub users: u32,
    /// Bytes of its ring, charged to the tenant.
    pub ring_bytes: u64,
    /// An overrun happened: the CQ is in error and reported once.
    pub overrun: bool,
}

pub(crate) struct Srq {
    pub ctx: ContextId,
    pub pd: u32,
    pub attr: SrqAttr,
    pub users: u32,
    /// Bytes of its ring, charged to the tenant.
    pub ring_bytes: u64,
    /// Receive WRs taken for a message that was then abandoned, to be
    /// consumed again first.
    pub requeued: VecDeque<RecvWr>,
}

/// A send WR the requester has started.
pub(crate) struct Inflight {
    pub wr: SendWr,
    /// Bytes of the message already placed.
    pub done: u64,
    /// The responder's receive WR, once taken.
    pub recv: Option<RecvWr>,
    /// When the next attempt may run (after an RNR NAK or a timeout).
    pub next_try: Instant,
    pub rnr_left: u8,
    /// Transport retries: the moment the last retry expires.
    pub retry_deadline: Option<Instant>,
    /// When the engine took it from the send queue (for the latency
    /// histogram, see [`super::metrics`]).
    pub taken: Instant,
}

pub(crate) struct Qp {
    pub ctx: ContextId,
    pub tenant: TenantId,
    pub pd: u32,
    pub init: QpInitAttr,
    pub attr: QpAttr,
    pub inflight: Option<Inflight>,
    pub requeued: VecDeque<RecvWr>,
    /// Report SQ_DRAINED when the send queue has drained in SQD.
    pub sqd_notify: bool,
    /// The transport state of a QP whose peer is on another host.
    pub remote: Option<Box<super::remote::RemoteQp>>,
    /// Times the QP was reset: a receive taken for a datagram before a
    /// reset is not completed after it.
    pub resets: u32,
    /// Bytes of its send and receive rings, charged to the tenant.
    pub ring_bytes: u64,
    /// In the engine's service order ([`Hca::update_service`]).
    ///
    /// [`Hca::update_service`]: super::Hca::update_service
    pub served: bool,
    /// Has an entry in the service order: while `served`, and after it was
    /// parked until the pass that parked it ends.
    pub in_order: bool,
    /// Put in the service order by a sweep rather than by a notice: work
    /// found in its next turn is counted as a wake-up that was missed.
    pub swept: bool,
    /// Its tenant is paused for a migration (`hca::migrate`): it sends
    /// nothing, answers requests with PAUSED NAKs and ignores responses.
    pub paused: bool,
    /// Its migration generation: how many times it moved.
    pub epoch: u32,
    /// It was imported from another host and must announce its new
    /// location (a Moved frame) before its first other frame.
    pub announce: bool,
    /// Its peer QP moved to another host: the link that proved it, and
    /// the epoch it proved; frames about this QP from any other link are
    /// dropped, and a later move must carry a higher epoch.
    pub peer_link: Option<super::LinkId>,
    pub peer_epoch: u32,
    /// A Moved frame no newer than `peer_epoch` came on `peer_link`: a
    /// second copy of the peer QP resumed on the host that holds (or
    /// held) the accepted one, from an older snapshot (one restored
    /// twice). Its frames are dropped until a newer Moved, so that it
    /// fails by its own retry count instead of its stale PSNs being
    /// answered as duplicates (which would complete its requests with
    /// nothing delivered).
    pub peer_stale: bool,
    /// The LID its peer had before its first move (what receive
    /// completions keep reporting as the source).
    pub peer_lid: u16,
}

impl Qp {
    /// Whether the engine has anything to do for this QP in its passes:
    /// run or flush its send queue, or time a held ACK. A QP in RESET or
    /// INIT, or in RTR with no peer on another host, has not; leaving it
    /// out keeps a pass's cost in the QPs in use, however many a tenant
    /// creates and leaves idle.
    pub fn needs_service(&self) -> bool {
        if self.paused {
            return false;
        }
        match self.state() {
            QpState::Reset | QpState::Init => false,
            QpState::Rtr => self.remote.is_some(),
            _ => true,
        }
    }

    /// Whether the QP has nothing in progress: a turn would find nothing
    /// to do unless the tenant posts, the QP changes state, or a frame
    /// comes for it, and each of those puts it back in the service order.
    /// (Its queues are asked separately: see `Queues::park_queues`.)
    pub fn is_quiescent(&self) -> bool {
        self.inflight.is_none()
            // Receives given back wait for the peer's next message, except
            // in ERR, where the QP's own turn flushes them.
            && (self.requeued.is_empty() || self.state() != QpState::Err)
            && !self.sqd_notify
            && !self.announce
            && self.remote.as_ref().is_none_or(|r| r.is_quiescent())
    }

    pub fn state(&self) -> QpState {
        self.attr.qp_state
    }

    pub fn accepts_incoming(&self) -> bool {
        matches!(self.state(), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe)
    }
}
