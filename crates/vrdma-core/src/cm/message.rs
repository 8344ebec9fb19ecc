//! What one connection manager says to another: the IB CM's exchange
//! (REQ, REP, RTU, REJ, DREQ, DREP and UD's SIDR pair) reduced to what a
//! vRDMA peer needs. The transport between daemons is reliable and
//! authenticated, so nothing here is retransmitted or checksummed; what
//! is kept is each side's number for the connection (the IB CM's local
//! and remote communication ids), so that a message is matched to its
//! connection and a stale or forged one is dropped.

use std::net::SocketAddrV4;

use serde::{Deserialize, Serialize};

use super::PortSpace;

/// Largest private data of each message, as rdma_cm over IB allows it to
/// applications (the IB CM's limits less the 36 bytes rdma_cm's own
/// header takes from a REQ).
pub const MAX_REQ_PRIVATE_DATA: usize = 56;
pub const MAX_REP_PRIVATE_DATA: usize = 196;
pub const MAX_REJ_PRIVATE_DATA: usize = 148;
/// SIDR (UD) request and reply.
pub const MAX_SIDR_REQ_PRIVATE_DATA: usize = 180;
pub const MAX_SIDR_REP_PRIVATE_DATA: usize = 136;

/// The IB CM's reasons for a REJ that rdma_cm applications see as the
/// REJECTED event's status.
pub mod reject {
    /// The responder has no resources (a listener's backlog is full).
    pub const NO_RESOURCES: u16 = 3;
    /// No REP came in time (reported as UNREACHABLE, not REJECTED).
    pub const TIMEOUT: u16 = 4;
    /// No one listens on the port (or a tenant other than the sender's).
    pub const INVALID_SERVICE_ID: u16 = 8;
    /// The application rejected it (`rdma_reject`).
    pub const CONSUMER_DEFINED: u16 = 28;
}

/// The requester's side of a connection, as the responder needs it to
/// bring its QP up, and as `rdma_cm_event.param.conn` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnInfo {
    pub qp_num: u32,
    /// The first PSN the sender sends with (the receiver's `rq_psn`).
    pub start_psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub private_data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CmMessage {
    /// A connection request for `dst` in port space `ps` (a UD space's is
    /// SIDR's), from connection `from` of the sender's CM. `tenant` is the
    /// sender's tenant: only a listener of the same tenant hears it.
    Req {
        from: u32,
        tenant: u32,
        ps: PortSpace,
        src: SocketAddrV4,
        dst: SocketAddrV4,
        conn: ConnInfo,
    },
    /// The responder accepts: `to` is the requester's number, `from` the
    /// responder's. For UD, `conn.qp_num` and `qkey` name the responder's
    /// QP and no RTU follows.
    Rep {
        to: u32,
        from: u32,
        conn: ConnInfo,
        qkey: u32,
    },
    /// The requester's QP is ready: the connection is established.
    Rtu {
        to: u32,
        from: u32,
    },
    /// A refusal of the connection `to`; `from` is 0 where no connection
    /// was made for the request.
    Rej {
        to: u32,
        from: u32,
        reason: u16,
        private_data: Vec<u8>,
    },
    /// Disconnect request and reply.
    Dreq {
        to: u32,
        from: u32,
    },
    Drep {
        to: u32,
        from: u32,
    },
    /// The connection `from` of `tenant` moved with its tenant (a VM's
    /// migration) to the host this comes from: its peer `to` sends there
    /// from now on (`super::migrate`). Appended: variants are numbered by
    /// position on the wire.
    Moved {
        to: u32,
        from: u32,
        tenant: u32,
    },
}

impl CmMessage {
    /// The receiver's number for the connection, where the message names
    /// one.
    pub fn to(&self) -> Option<u32> {
        match self {
            CmMessage::Req { .. } => None,
            CmMessage::Rep { to, .. }
            | CmMessage::Rtu { to, .. }
            | CmMessage::Rej { to, .. }
            | CmMessage::Dreq { to, .. }
            | CmMessage::Drep { to, .. }
            | CmMessage::Moved { to, .. } => Some(*to),
        }
    }

    /// The sender's number for the connection.
    pub fn from(&self) -> u32 {
        match self {
            CmMessage::Req { from, .. }
            | CmMessage::Rep { from, .. }
            | CmMessage::Rtu { from, .. }
            | CmMessage::Rej { from, .. }
            | CmMessage::Dreq { from, .. }
            | CmMessage::Drep { from, .. }
            | CmMessage::Moved { from, .. } => *from,
        }
    }
}
