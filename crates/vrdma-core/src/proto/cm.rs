//! The connection manager's requests and replies on the control socket
//! (`librdmacm`'s calls, as the kernel's `rdma_ucm` takes them).

use std::net::SocketAddrV4;

use serde::{Deserialize, Serialize};

use crate::cm::{CmEvent, ConnInfo};
use crate::verbs::{QpAttr, QpAttrMask, QpState};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CmRequest {
    /// An event channel; answered [`CmReply::Channel`] with one fd, which
    /// is readable while the channel holds events.
    CreateChannel,
    DestroyChannel {
        channel: u32,
    },
    /// `ps` is `enum rdma_port_space`.
    CreateId {
        channel: u32,
        ps: u32,
    },
    DestroyId {
        id: u32,
    },
    /// Moves `id` (and the requests its listener takes from now on) to
    /// another channel of the context.
    MigrateId {
        id: u32,
        channel: u32,
    },
    SetReuseAddr {
        id: u32,
        reuse: bool,
    },
    Bind {
        id: u32,
        addr: SocketAddrV4,
    },
    ResolveAddr {
        id: u32,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    },
    ResolveRoute {
        id: u32,
    },
    Listen {
        id: u32,
        backlog: i32,
    },
    Connect {
        id: u32,
        conn: ConnInfo,
    },
    Accept {
        id: u32,
        conn: ConnInfo,
        qkey: u32,
    },
    Establish {
        id: u32,
    },
    Reject {
        id: u32,
        private_data: Vec<u8>,
    },
    Disconnect {
        id: u32,
    },
    InitQpAttr {
        id: u32,
        state: QpState,
    },
    QueryAddr {
        id: u32,
    },
    /// The next event of a channel, if any.
    GetEvent {
        channel: u32,
    },
    /// Whether a listener of the caller's tenant takes requests for
    /// `addr` in port space `ps` (answered [`CmReply::Listening`]).
    HasListener {
        ps: u32,
        addr: SocketAddrV4,
    },
    /// `rdma_create_qp`'s second half, done by the daemon: QP `qp` goes to
    /// INIT with the id's attributes and becomes the id's. The id and the
    /// QP may be of two contexts of one local process (the drop-in
    /// `librdmacm.so.1` holds its ids in a context of its own, the
    /// program's QPs are its `libibverbs.so.1`'s), never of two processes.
    /// From then on the daemon moves it as the kernel's CM moves an id's
    /// QP: to RTR and RTS in `Accept` (before the REP goes out) and when
    /// the REP comes in (the RTU follows, and the program sees
    /// ESTABLISHED, never CONNECT_RESPONSE), and to ERR in `Disconnect`.
    /// Each of those would otherwise be several round trips from the
    /// library (`InitQpAttr` and `ModifyQp` per state).
    AttachQp {
        id: u32,
        qp: u32,
    },
    /// `rdma_create_qp` in one call: the QP that `Request::CreateQp`
    /// would make (answered as that is, with `Reply::Qp` and the rings'
    /// descriptor), attached to the id as `AttachQp` attaches one. If the
    /// attach fails, the QP is destroyed and the call fails with its error.
    CreateQp {
        id: u32,
        pd: u32,
        init: crate::verbs::QpInitAttr,
    },
    // Variants are numbered by position on the wire: new ones go last.
    /// `rdma_create_qp` with no CQs given, in one call (rdma-core then
    /// makes the QP's CQs itself): a CQ of at least `cqe` entries, as
    /// `Request::CreateCq` without a channel makes it, then the QP that
    /// `CreateQp` would make with that CQ as both its send and receive CQ
    /// (the CQ numbers in `init` are not looked at), attached to the id.
    /// Answered `Reply::CqQp` with two descriptors, the CQ's segment and
    /// the QP's. If any part fails, what was made is destroyed and the
    /// call fails with that part's error. (Apart, the two are two round
    /// trips, each about a tenth of a connection's setup.)
    CreateQpWithCq {
        id: u32,
        pd: u32,
        cqe: u32,
        init: crate::verbs::QpInitAttr,
    },
    /// The route of `id` was resolved in the library, which reported
    /// ROUTE_RESOLVED to the program itself: the id moves as
    /// `ResolveRoute` moves it, with the same checks and errors, and no
    /// event is made. The library sends it before any call whose outcome
    /// depends on the id's state (a connect sends `ConnectRouted`
    /// instead). The library answers `rdma_resolve_route` itself where
    /// `ResolveAddr` succeeded (which leaves the id in ADDR_RESOLVED),
    /// the program read its ADDR_RESOLVED (whose addresses the route's
    /// event repeats), and the channel's descriptor holds nothing unread
    /// (so that order holds): a round trip of the seven a connection's
    /// setup waited on.
    RouteReported {
        id: u32,
    },
    /// `RouteReported` then `Connect`, in one call: fails with the first
    /// one's error (if `Connect` fails, the route stays resolved, as
    /// after `ResolveRoute`).
    ConnectRouted {
        id: u32,
        conn: ConnInfo,
    },
    /// Several calls in one message, run in order as if each were sent
    /// alone, stopping at the first that fails (what ran before it
    /// stays done, as it would have apart). Answered `Reply::Batch`: each
    /// call's reply in order, the failed one's `Reply::Error` last, and
    /// its index. At most [`MAX_CM_BATCH`] calls, at least one; only the
    /// kinds of [`CmBatchOp`], so a batch never holds a batch. Its rings'
    /// descriptors come in its calls' order (a `Reply::Pooled` around the
    /// whole batch places them). What it is for: `rdma_create_qp` and the
    /// `rdma_accept` (or `rdma_connect`) that follows it in one round
    /// trip, where each was one of the few left on a connection's setup;
    /// the accept needs nothing of the creation's reply (the daemon takes
    /// the attached QP's number itself); and `rdma_resolve_addr` with the
    /// request for the channel's next spare id (`ResolveAddr` then
    /// `CreateId`: a resolve that fails makes no id).
    Batch {
        ops: Vec<CmBatchOp>,
    },
    /// `GetEvent` for up to `max` events (at least one, at most
    /// [`MAX_CM_EVENTS`]): the first as `GetEvent` takes it, then each
    /// next one whose wake-up is in the descriptor, as many `GetEvent`s in
    /// a row would take them, stopping where one finds none. Answered
    /// [`CmReply::Events`]. What it is for: a channel whose events pile up
    /// behind bare wake-ups (a server taking many requests at once, a
    /// client with many connects in flight: rdma-core's `cmtime`) paid a
    /// round trip per event; the library keeps the ones after the first,
    /// their wake-ups left in the descriptor until it hands each out. An
    /// older daemon answers it `EINVAL` (an unknown request), and the
    /// library sends `GetEvent` from then on.
    GetEvents {
        channel: u32,
        max: u32,
    },
}

/// Most calls one [`CmRequest::Batch`] carries.
pub const MAX_CM_BATCH: usize = 4;

/// Most events one [`CmRequest::GetEvents`] takes (each at most a few
/// hundred bytes: private data and two addresses).
pub const MAX_CM_EVENTS: u32 = 16;

/// Most events a daemon keeps unread on one channel (a tenant that reads
/// none of its events has its listeners' new requests refused past it;
/// a snapshot's channel holds no more), and the most wake-ups one reply
/// hands the library to take: the daemon rings at most this many of a
/// channel's queue at once (entries of destroyed ids among them), and
/// caps each `GetEvent`'s and `GetEvents`' reply at it, leaving the rest
/// for the next call. The library refuses a reply that says more
/// (`vrdma::cm_reply`), and its channel is unusable from then on.
pub const MAX_CM_UNREAD: u32 = 4096;

/// A call a [`CmRequest::Batch`] may carry: each is the [`CmRequest`] of
/// the same name and fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CmBatchOp {
    CreateQp {
        id: u32,
        pd: u32,
        init: crate::verbs::QpInitAttr,
    },
    CreateQpWithCq {
        id: u32,
        pd: u32,
        cqe: u32,
        init: crate::verbs::QpInitAttr,
    },
    AttachQp {
        id: u32,
        qp: u32,
    },
    RouteReported {
        id: u32,
    },
    Connect {
        id: u32,
        conn: ConnInfo,
    },
    ConnectRouted {
        id: u32,
        conn: ConnInfo,
    },
    Accept {
        id: u32,
        conn: ConnInfo,
        qkey: u32,
    },
    /// With `CreateId` after it: an address resolved, and the next
    /// `rdma_create_id`'s id (the channel's spare) made in the same round
    /// trip, where the spare's request was one of its own.
    ResolveAddr {
        id: u32,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    },
    CreateId {
        channel: u32,
        ps: u32,
    },
}

impl From<CmBatchOp> for CmRequest {
    fn from(op: CmBatchOp) -> CmRequest {
        match op {
            CmBatchOp::CreateQp { id, pd, init } => CmRequest::CreateQp { id, pd, init },
            CmBatchOp::CreateQpWithCq { id, pd, cqe, init } => {
                CmRequest::CreateQpWithCq { id, pd, cqe, init }
            }
            CmBatchOp::AttachQp { id, qp } => CmRequest::AttachQp { id, qp },
            CmBatchOp::RouteReported { id } => CmRequest::RouteReported { id },
            CmBatchOp::Connect { id, conn } => CmRequest::Connect { id, conn },
            CmBatchOp::ConnectRouted { id, conn } => CmRequest::ConnectRouted { id, conn },
            CmBatchOp::Accept { id, conn, qkey } => CmRequest::Accept { id, conn, qkey },
            CmBatchOp::ResolveAddr { id, src, dst } => CmRequest::ResolveAddr { id, src, dst },
            CmBatchOp::CreateId { channel, ps } => CmRequest::CreateId { channel, ps },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CmReply {
    Channel {
        channel: u32,
    },
    Id {
        id: u32,
    },
    Addrs {
        local: Option<SocketAddrV4>,
        remote: Option<SocketAddrV4>,
    },
    QpAttr {
        attr: QpAttr,
        mask: QpAttrMask,
    },
    /// The next event, if any, and the wake-ups to take from the channel's
    /// descriptor with it: one for the event, and one for each event that
    /// went with its id (destroyed or moved) after its wake-up was rung.
    /// Also the reply of `ResolveAddr`, `ResolveRoute` and `Accept`, with
    /// the id's event when the call produced it and it was next on the
    /// channel (taken off the channel for the reply; its wake-up stays in
    /// the descriptor until the library hands the event to the program),
    /// and of the other calls that answer nothing (`event: None`).
    Event {
        event: Option<CmEvent>,
        wakeups: u32,
    },
    Listening(bool),
    /// The reply of [`CmRequest::GetEvents`]: events in order, each with
    /// the wake-ups to take with it, as [`CmReply::Event`] says them (the
    /// last may be `None`: wake-ups of events that went with their ids,
    /// and none after them; an empty list: nothing at all).
    Events {
        events: Vec<(Option<CmEvent>, u32)>,
    },
}
