//! The boundary between the core and the driver that owns the queues.

use serde::{Deserialize, Serialize};

use super::ContextId;
use crate::ring::{Cqe, RecvWr, SendWr, WqeError};
use crate::verbs::{AsyncEventType, QpState};

/// Where receive work requests for a QP come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecvSource {
    Qp(u32),
    Srq(u32),
}

/// The completion queue had no free entry: an overrun.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqFull;

/// An asynchronous event for a context (`struct ibv_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsyncEvent {
    pub event_type: AsyncEventType,
    /// The QP, CQ or SRQ number, or the port number for port events.
    pub element: u32,
}

/// A pulled work request: decoded, or the `wr_id` of one that did not decode.
pub type Pulled<T> = Result<T, (u64, WqeError)>;

/// What the core needs from the driver: the queues' contents and a place
/// to put completions and events. The daemon implements it over
/// shared-memory rings; tests implement it over `VecDeque`s.
pub trait Queues {
    /// Takes the next work request posted to `qpn`'s send queue.
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>>;
    /// The core is done with `count` work requests it pulled from `qpn`'s
    /// send queue: they completed (signaled or not), failed, were flushed,
    /// were refused because they did not decode, or were dropped by a
    /// reset or the QP's destruction. Called exactly once for every WR
    /// [`pull_send`](Self::pull_send) returned, and before the WR's
    /// completion is pushed, so that a client that polled the completion
    /// finds the WR's place in the send queue free again. What the driver
    /// publishes from it is what bounds the send queue at `max_send_wr`
    /// outstanding WRs, as on hardware: a WR is outstanding from its post
    /// until it is retired, however long the core held it after pulling.
    fn send_retired(&mut self, qpn: u32, count: u32);
    /// Takes the next receive work request from a QP's receive queue or an SRQ.
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>>;
    /// How many receive work requests are posted and not yet pulled.
    fn recv_posted(&mut self, src: RecvSource) -> u32;
    /// A QP in ERR is being flushed: completes, flushed, the receive a
    /// direct-path requester claimed for it from `rq` (its own receive
    /// queue or its SRQ) and did not complete (it stopped or died between
    /// its claim and its push, and had staged the completion as a flush,
    /// `docs/direct-path.md`). `true` when there was one. At most one;
    /// never one the requester completes too. `requester_gone`: the QP
    /// connected to `qpn` on this host (the only one a receive grant on
    /// `qpn` is made to) no longer exists, so nothing of it claims any
    /// more and the driver may give back what it holds for it (an SRQ's
    /// claiming turn); while it exists the requester's process may still
    /// be running (stopped, or about to claim), and what it holds stays
    /// its own. The core calls this again with `requester_gone` when the
    /// requester of a QP already in ERR goes (it may have claimed after
    /// the first flush).
    fn flush_claimed(&mut self, _qpn: u32, _rq: RecvSource, _requester_gone: bool) -> bool {
        false
    }
    /// Drops everything posted to a QP's queues (the QP went to RESET).
    /// The core has retired every send WR it pulled before it calls this;
    /// the driver counts the WRs it drops from the send queue as retired.
    fn discard(&mut self, qpn: u32);
    /// Appends a completion to a CQ.
    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull>;
    /// Delivers an asynchronous event to a context.
    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent);
    /// Publishes a QP's new state to its owner.
    fn qp_state_changed(&mut self, qpn: u32, state: QpState);
    /// Appends the QPs whose owners posted send WRs since the last call
    /// (a QP may come more than once). The driver reads the tenants'
    /// notices and passes on only QPs of the context that named them, at
    /// most `per_tenant` of each tenant's a call whatever its contexts
    /// wrote, leaving the rest for later calls; `true` when it left some.
    fn take_posted(&mut self, per_tenant: u32, out: &mut Vec<u32>) -> bool;
    /// The core is about to leave `qpn` idle until
    /// [`take_posted`](Self::take_posted) names it again: re-arm the
    /// owner's notification, then say whether its send queue (and, with
    /// `recv_too`, its receive queue: a QP in ERR flushes what is posted
    /// there) is empty. `false` (WRs are posted): the core keeps serving
    /// it. The owner names a QP after a post to its send queue, and after a
    /// post to its receive queue once it reads the state ERR.
    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool;
    /// Whether the owner has named `qpn` since the core last parked it: a
    /// notice is on its way through [`take_posted`](Self::take_posted).
    fn named_since_parked(&mut self, qpn: u32) -> bool;
}
