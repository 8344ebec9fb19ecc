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
    /// Takes the next receive work request from a QP's receive queue or an SRQ.
    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>>;
    /// How many receive work requests are posted and not yet pulled.
    fn recv_posted(&mut self, src: RecvSource) -> u32;
    /// Drops everything posted to a QP's queues (the QP went to RESET).
    fn discard(&mut self, qpn: u32);
    /// Appends a completion to a CQ.
    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull>;
    /// Delivers an asynchronous event to a context.
    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent);
    /// Publishes a QP's new state to its owner.
    fn qp_state_changed(&mut self, qpn: u32, state: QpState);
    /// The core is done with `count` more work requests it pulled from
    /// `qpn`'s send queue: their slots count as free for the poster.
    fn send_retired(&mut self, qpn: u32, count: u32) {
        let _ = (qpn, count);
    }
}
