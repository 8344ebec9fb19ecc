//! The control protocol between a tenant process and the daemon.
//!
//! One request, one reply, each a single `SOCK_SEQPACKET` message encoded
//! with postcard; file descriptors (memfds, eventfds) travel beside the
//! bytes as `SCM_RIGHTS`. The daemon treats every request as hostile input:
//! [`decode_request`] bounds the size, and the decoder never panics (a
//! fuzz target in `fuzz/` holds it to that). Object numbers in requests are
//! only names; the daemon checks that the caller owns each one.

mod cm;
pub mod guest;
mod layout;
mod migrate;
mod sockets;

pub use cm::{CmBatchOp, CmReply, CmRequest, MAX_CM_BATCH, MAX_CM_EVENTS, MAX_CM_UNREAD};
pub use layout::*;
pub use migrate::{MigrateReply, MigrateRequest};
pub use sockets::{SockReply, SockRequest};

use serde::{Deserialize, Serialize};

use crate::hca::{AsyncEvent, QpCreated};
use crate::verbs::{AccessFlags, AhAttr, DeviceAttr, Gid, PortAttr, QpAttr, QpAttrMask, QpInitAttr, SrqAttr};

/// Bumped on any incompatible change of these messages. (3: the replies
/// of `CmRequest::ResolveAddr`, `ResolveRoute` and `Accept` may carry the
/// id's event, taken off its channel, which a library of version 2 would
/// lose. 4: `CmRequest::CreateQp`, `rdma_create_qp` in one call. 5:
/// `CmRequest::AttachQp` (and `CreateQp`) may name an id and a QP of two
/// contexts of one process, and a `CmEvent` carries its id's addresses.
/// 7: a `StatReport` carries the asking tenant's own figures, and a
/// link's stats what its scheduler held back; its links' counters and
/// missed wake-ups are the tenant's own share unless the operator asked
/// (`totals`, appended; a tenant's counters end with its missed
/// wake-ups); `Request::Migrate`, the
/// operator's migration steps; `Request::Sock`, the socket registry of
/// `docs/sockets.md`; `CmRequest::CreateQpWithCq`, answered
/// `Reply::CqQp`; an event channel's wake-up may carry its event,
/// [`CARRIED_CM_EVENT`]; `Request::AdoptContext`, a guest taking its
/// context back after its VM moved; `Reply::Pooled`, a host context's
/// rings placed in its ring pool; `CmRequest::RouteReported` and
/// `ConnectRouted`, a route the library resolved itself;
/// `CmRequest::Batch`, answered `Reply::Batch`, several calls in one
/// round trip; `Request::GuestGrow`, a guest's memory extent grown in
/// place; `Request::RegMrPieces`, a region of several pieces;
/// `SockRequest`'s addresses and `Tuple`'s ends are IPv4 or IPv6;
/// `Request::SockScoped`, a socket call with link-local scopes.
/// Version 7 is unreleased: a library and a daemon of different builds
/// within it may disagree on these encodings; they then refuse the call
/// or answer plain TCP, and never corrupt a stream.)
pub const PROTOCOL_VERSION: u32 = 7;
/// Largest message either side sends or accepts.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Most file descriptors one request carries (the daemon reads no more).
pub const MAX_FDS: usize = 4;
/// Most file descriptors one reply carries. The direct path's receive
/// grant (`Reply::DirectRecvGrant`) carries up to five: a new window page,
/// the responder's QP segment, its SRQ's, its receive CQ's segment and
/// that CQ's channel doorbell. A client that read fewer would find the
/// reply cut (`MSG_CTRUNC`), the descriptors lost, and its connection out
/// of step. Guests get none of these (`guest::MAX_HANDLES`).
pub const MAX_REPLY_FDS: usize = 8;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    Hello {
        version: u32,
    },
    QueryDevice,
    QueryPort {
        port: u8,
    },
    QueryGid {
        port: u8,
        index: u32,
    },
    AllocPd,
    DeallocPd {
        pd: u32,
    },
    /// With one fd: a sealed memfd holding the region's bytes from `fd_offset`.
    RegMr {
        pd: u32,
        addr: u64,
        len: u64,
        access: AccessFlags,
        fd_offset: u64,
    },
    DeregMr {
        key: u32,
    },
    CreateCompChannel,
    DestroyCompChannel {
        channel: u32,
    },
    CreateCq {
        cqe: u32,
        channel: Option<u32>,
    },
    DestroyCq {
        cq: u32,
    },
    CreateSrq {
        pd: u32,
        attr: SrqAttr,
    },
    ModifySrq {
        srq: u32,
        limit: Option<u32>,
        resize: bool,
    },
    QuerySrq {
        srq: u32,
    },
    DestroySrq {
        srq: u32,
    },
    CreateQp {
        pd: u32,
        init: QpInitAttr,
    },
    ModifyQp {
        qp: u32,
        attr: QpAttr,
        mask: QpAttrMask,
    },
    QueryQp {
        qp: u32,
    },
    DestroyQp {
        qp: u32,
    },
    // Variants are numbered by position on the wire: new ones go last.
    /// `ibv_create_ah` in `pd`; answered [`Reply::Ah`].
    CreateAh {
        pd: u32,
        attr: AhAttr,
    },
    DestroyAh {
        ah: u32,
    },
    /// The first page of [`Request::StatPage`], answered [`Reply::Stat`]:
    /// for clients that do not page.
    Stat,
    /// A page of the links to other hosts and of the paths of the
    /// tenant's QPs; answered [`Reply::StatPage`].
    StatPage {
        from: crate::hca::StatCursor,
    },
    /// The connection manager (rdma_cm); answered [`Reply::Cm`].
    Cm(CmRequest),
    /// The direct path (`docs/direct-path.md`): may QP `qp` write into its
    /// peer's region `rkey` itself? Answered [`Reply::DirectGrant`] or
    /// [`Reply::DirectRefused`].
    DirectGrant {
        qp: u32,
        rkey: u32,
    },
    /// The host side of a VM (`docs/vms.md`): its region memfd and port
    /// socket, for uid 0 or the VM's tenant uid; may come before Hello.
    /// Answered [`Reply::VmAttached`] with one fd, the region.
    VmAttach {
        name: String,
    },
    /// Guest sessions only: an extent of the VM's region for registered
    /// memory, of at least `len` bytes (whole pages). Answered
    /// [`Reply::GuestExtent`]; a later [`Request::RegMr`] of that session
    /// may name bytes inside it (its `fd_offset` is the region offset).
    GuestAlloc {
        len: u64,
    },
    /// Guest sessions only: gives back the extent at `offset`, refused
    /// while a memory region lies on it.
    GuestFree {
        offset: u64,
    },
    /// The direct path: may QP `qp` claim its peer's receives itself (RDMA
    /// writes with immediate)? Answered [`Reply::DirectRecvGrant`] or
    /// [`Reply::DirectRefused`].
    DirectRecvGrant {
        qp: u32,
    },
    /// The direct path: the doorbell of CQ `cq`'s completion channel (the
    /// daemon's end), so that this library can raise the CQ's events for
    /// the completions it queues itself. Answered [`Reply::DirectChannel`]
    /// with one fd, or [`Reply::DirectRefused`].
    DirectChannel {
        cq: u32,
    },
    /// The direct path: QP `qp` claimed a receive from its peer's SRQ and
    /// found fewer posted than the SRQ's armed limit (`SRQ_AUX_LIMIT`): the
    /// daemon checks and raises `IBV_EVENT_SRQ_LIMIT_REACHED` once.
    /// Answered [`Reply::Done`].
    DirectSrqLimit {
        qp: u32,
    },
    /// The operator's live-migration steps (root or the daemon's uid only;
    /// on a connection of their own, before Hello). See [`MigrateRequest`].
    Migrate(MigrateRequest),
    /// The socket registry (`docs/sockets.md`); answered [`Reply::Sock`].
    Sock(SockRequest),
    /// Guest sessions only, instead of [`Request::Hello`]: take over
    /// context `context` of the VM's tenant, imported on this host with
    /// the VM (`docs/migration.md`), with its objects and the same numbers.
    /// Answered as Hello is, with the context's own segment where it was
    /// in the VM's region (its rings as the guest left them) and new
    /// doorbells.
    AdoptContext {
        version: u32,
        context: u32,
    },
    /// Guest sessions only: grows this session's memory extent at
    /// `offset` in place to at least `len` bytes (whole pages), into the
    /// free bytes right after it; refused where they are not free (a
    /// re-backed span that a registration extends, `docs/vms.md`).
    /// Answered [`Reply::GuestExtent`] with its new length.
    GuestGrow {
        offset: u64,
        len: u64,
    },
    /// [`Request::RegMr`] of a region whose pages come from several
    /// pieces, one after the other (a registration covering pages
    /// registered before and pages between them, `docs/vms.md`): on a host
    /// with one fd per piece, each a memfd sealed against shrinking holding
    /// the piece from its `fd_offset`; from a guest with none, each
    /// `fd_offset` an offset of the VM's region in a memory extent of the
    /// session. The region's first byte is the first piece's; the pieces'
    /// lengths sum to `len`; every boundary between two pieces is on a
    /// page in both the address space and the files; at most
    /// [`MAX_MR_PIECES`] (and on a host [`MAX_FDS`]). Answered
    /// [`Reply::Mr`].
    RegMrPieces {
        pd: u32,
        addr: u64,
        len: u64,
        access: AccessFlags,
        pieces: Vec<MrPiece>,
    },
    /// [`Request::Sock`] whose link-local addresses carry their scope ids
    /// (`docs/sockets.md`, "Link-local"), which `SockRequest`'s encoding
    /// drops (postcard writes an IPv6 socket address as its address and
    /// port): `scopes` are the client's and the server's (a listening
    /// address or a looked-up destination is the server's), set on the
    /// request's link-local addresses by the daemon; a non-link-local
    /// address takes no scope. A `Listen` of `[::]` sent this way (scopes
    /// 0) says its library claims link-local connections: that listener
    /// owns this host's link-local destinations of its port (as a plain
    /// `Sock` one does not). Appended, so that every other request
    /// keeps its encoding: a daemon without it refuses the call
    /// (`EINVAL`), and the library then leaves the connection plain TCP
    /// (and registers a `[::]` listener again as a plain `Sock`).
    SockScoped {
        scopes: [u32; 2],
        req: SockRequest,
    },
}

/// Most pieces one [`Request::RegMrPieces`] names.
pub const MAX_MR_PIECES: usize = 64;

/// One piece of a [`Request::RegMrPieces`] region: `len` bytes from
/// `fd_offset` of its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrPiece {
    pub fd_offset: u64,
    pub len: u64,
}

impl Request {
    /// How many fds must come with this request.
    pub fn expected_fds(&self) -> usize {
        match self {
            Request::RegMr { .. } => 1,
            // On a host; guest sessions pass no fds (and are not asked).
            Request::RegMrPieces { pieces, .. } => pieces.len(),
            Request::Migrate(MigrateRequest::Import) => 1,
            _ => 0,
        }
    }
}

/// Where a ring lies in a segment the reply's fd maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingSpec {
    pub offset: u64,
    pub capacity: u32,
    pub stride: u32,
}

/// A completion channel handed over with an adopted context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedChannel {
    pub channel: u32,
    /// Its ring's producer index at the import: the events before it were
    /// raised where the tenant was, and their wake-ups did not move (the
    /// library rings again for those still unread); those after it come
    /// with their wake-ups on the new doorbell.
    pub raised_before: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// With fds: the context segment, the engine doorbell, the async-event fd.
    Hello {
        context: u32,
        tenant: u32,
        device_name: String,
        segment_len: u64,
        async_ring: RingSpec,
        /// In the same segment: the ring the tenant names posted QPs in.
        posted_ring: RingSpec,
        /// The context's completion channels, in the order of their
        /// doorbells after the first three fds: none on a Hello; on an
        /// adoption (`Request::AdoptContext`) those that moved with it
        /// (`docs/migration.md`, "Completion channels").
        channels: Vec<MovedChannel>,
    },
    Device(DeviceAttr),
    Port(PortAttr),
    Gid(Gid),
    Pd {
        pd: u32,
    },
    Mr {
        key: u32,
    },
    /// With fds: the channel's segment and its eventfd.
    CompChannel {
        channel: u32,
        segment_len: u64,
        ring: RingSpec,
    },
    /// With one fd: the CQ segment.
    Cq {
        cq: u32,
        depth: u32,
        segment_len: u64,
        ring: RingSpec,
    },
    /// With one fd: the SRQ segment.
    Srq {
        srq: u32,
        attr: SrqAttr,
        segment_len: u64,
        ring: RingSpec,
    },
    /// With one fd: the QP segment holding the send and receive rings,
    /// and, with the direct path on, the inbox of completions that a
    /// direct-path requester pushes for this QP's receives (polled before
    /// the receive CQ's ring, `docs/direct-path.md`).
    Qp {
        created: QpCreated,
        segment_len: u64,
        sq: RingSpec,
        rq: Option<RingSpec>,
        inbox: Option<RingSpec>,
    },
    QpAttr {
        attr: QpAttr,
        init: QpInitAttr,
    },
    SrqAttr(SrqAttr),
    Done,
    Error {
        errno: i32,
        message: String,
    },
    // Variants are numbered by position on the wire: new ones go last.
    /// The address handle created by [`Request::CreateAh`].
    Ah {
        ah: u32,
    },
    Stat(crate::hca::StatReport),
    StatPage(crate::hca::StatPage),
    Cm(CmReply),
    /// With fds: the QP's window page first when `window_len` is not 0
    /// (the first grant of a window), then the region's memfd, whose bytes
    /// from `fd_offset` are the region's.
    DirectGrant(DirectGranted),
    DirectRefused(crate::hca::DirectRefusal),
    /// With one fd, the region memfd (`region_len` bytes).
    VmAttached {
        region_len: u64,
        port_socket: String,
        ports: u32,
    },
    /// The extent [`Request::GuestAlloc`] allocated, in region offsets.
    GuestExtent {
        offset: u64,
        len: u64,
    },
    /// With fds: the window page first when `window_len` is not 0, then
    /// the responder's QP segment, then, when `cq_segment_len` is not 0
    /// (the responder's receive CQ has a completion channel), the CQ's
    /// segment and the channel's doorbell.
    DirectRecvGrant(DirectRecvGranted),
    /// With one fd: the channel's doorbell (see [`Request::DirectChannel`]).
    DirectChannel,
    /// A migration step done; [`MigrateReply::Exported`] comes with one fd.
    Migrated(MigrateReply),
    Sock(SockReply),
    /// With two fds, the CQ's segment, then the QP's: a CQ as
    /// [`Reply::Cq`] describes one and a QP as [`Reply::Qp`] does (see
    /// [`CmRequest::CreateQpWithCq`]).
    CqQp {
        cq: u32,
        depth: u32,
        cq_segment_len: u64,
        cq_ring: RingSpec,
        created: QpCreated,
        segment_len: u64,
        sq: RingSpec,
        rq: Option<RingSpec>,
        inbox: Option<RingSpec>,
    },
    /// A host context's reply that places rings in its ring pool
    /// (`Reply::Cq`, `Srq`, `Qp` or `CqQp` inside, never another
    /// `Pooled`): per ring of `reply`, in its order, where it lies. A
    /// pooled ring's `segment_len` is its chunk's length and its
    /// `RingSpec` offsets count from the chunk's start. The descriptors
    /// are, in the rings' order, each [`PoolRing::Own`] ring's segment and
    /// each chunk's memfd where `fd` says it comes (the first ring in a
    /// chunk the library has not mapped yet).
    Pooled {
        rings: Vec<PoolRing>,
        reply: Box<Reply>,
    },
    /// The replies of a [`CmRequest::Batch`]'s calls, in order, up to
    /// the first that failed: then the last is its `Reply::Error` and
    /// `failed` its index in the batch. The descriptors of its replies'
    /// rings come in their order.
    Batch {
        replies: Vec<Reply>,
        failed: Option<u32>,
    },
}

/// Where one ring of a [`Reply::Pooled`] lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PoolRing {
    /// In a segment of its own, whose descriptor comes with the reply (a
    /// ring larger than a chunk, or one the tenant's budgets held no
    /// chunk for).
    Own,
    /// In chunk `chunk` of the context's pool, `len` bytes long; its
    /// memfd comes with the reply when `fd`, and the library keeps it
    /// mapped for the context's life; otherwise the library has it.
    Chunk { chunk: u32, len: u64, fd: bool },
}

/// A direct-path receive grant as the library receives it (see
/// [`crate::hca::RecvGrant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectRecvGranted {
    pub responder: u32,
    pub generation: u32,
    pub window_len: u64,
    pub qp_segment_len: u64,
    /// The responder's receive queue and inbox in its QP segment.
    pub rq: RingSpec,
    pub inbox: RingSpec,
    /// The depth of the responder's receive CQ: the inbox never holds
    /// more.
    pub cq_depth: u32,
    pub lid: u16,
    /// The responder's receive SGEs at most.
    pub max_recv_sge: u32,
    /// The responder's receive CQ's segment and ring, sent after the QP's
    /// (and the SRQ's) segment: the requester marks the CQ's ready set
    /// (`CQ_AUX_READY_SUMMARY`) after each push into the inbox and, with a
    /// completion channel, raises the CQ's events itself.
    pub cq_segment_len: u64,
    pub cq_ring: RingSpec,
    /// The responder's SRQ's segment, when its receives come from an SRQ
    /// (0: `rq` lies in the QP segment); sent after the QP segment's fd,
    /// and `rq` then lies in it.
    pub srq_segment_len: u64,
    /// The responder's receive CQ has a completion channel: its doorbell
    /// (the daemon's end, duplicated) comes last.
    pub channel: bool,
}

/// A direct-path grant as the library receives it (see
/// [`crate::hca::DirectGrant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectGranted {
    pub responder: u32,
    pub addr: u64,
    pub len: u64,
    pub fd_offset: u64,
    /// The remote rights granted (part of [`crate::hca::DIRECT_RIGHTS`]).
    pub rights: crate::verbs::AccessFlags,
    pub slot: u32,
    pub generation: u32,
    /// Bytes of the window page, when it comes with this reply; 0 when
    /// the QP already holds it.
    pub window_len: u64,
}

/// The direct path's window page: word 0 is 1 while the window is open,
/// word 1 counts the library's copies in flight, word 2 holds the receive
/// grant's generation and word `3 + slot` a region grant's, while they
/// stand (0 once revoked). Words of 4 bytes.
pub const DIRECT_WINDOW_OPEN: usize = 0;
pub const DIRECT_WINDOW_INFLIGHT: usize = 1;
/// Word 2: the receive grant's generation while it stands (0 otherwise).
pub const DIRECT_WINDOW_RECV: usize = 2;
pub const DIRECT_WINDOW_SLOTS: usize = 3;

/// Bytes of a window page.
pub fn direct_window_bytes() -> usize {
    4 * (DIRECT_WINDOW_SLOTS + crate::hca::DIRECT_SLOTS as usize)
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("{trailing} bytes after the end of the message")]
    Trailing { trailing: usize },
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ProtoError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(ProtoError::TooLarge(bytes.len()));
    }
    let (v, rest) = postcard::take_from_bytes(bytes).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtoError::Trailing { trailing: rest.len() });
    }
    Ok(v)
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("protocol values always serialize")
}

/// The first byte of an rdma_cm event channel's wake-up that carries
/// its event (a bare wake-up is the byte 1): the daemon sends the event
/// itself when the channel's descriptor holds nothing unread, and the
/// library reads it there instead of asking for it with
/// `CmRequest::GetEvent` (a round trip: two thread wake-ups). See
/// `vrdma::cm`.
pub const CARRIED_CM_EVENT: u8 = 2;

/// An event channel's wake-up carrying `ev` ([`CARRIED_CM_EVENT`]).
pub fn encode_carried_cm_event(ev: &crate::cm::CmEvent) -> Vec<u8> {
    let mut bytes = vec![CARRIED_CM_EVENT];
    bytes.extend(encode(ev));
    bytes
}

/// The event a wake-up carries; `None` for a bare wake-up.
pub fn decode_carried_cm_event(bytes: &[u8]) -> Option<Result<crate::cm::CmEvent, ProtoError>> {
    match bytes.split_first() {
        Some((&CARRIED_CM_EVENT, rest)) => Some(decode(rest)),
        _ => None,
    }
}

pub fn decode_request(bytes: &[u8]) -> Result<Request, ProtoError> {
    decode(bytes)
}
pub fn encode_request(r: &Request) -> Vec<u8> {
    encode(r)
}
pub fn decode_reply(bytes: &[u8]) -> Result<Reply, ProtoError> {
    decode(bytes)
}
pub fn encode_reply(r: &Reply) -> Vec<u8> {
    encode(r)
}

/// An async event as stored in a context's event ring: 8 bytes.
pub fn encode_async_event(ev: &AsyncEvent, slot: &mut [u8]) {
    slot[0] = ev.event_type.raw();
    slot[1..4].fill(0);
    slot[4..8].copy_from_slice(&ev.element.to_le_bytes());
}

pub fn decode_async_event(slot: &[u8]) -> Option<AsyncEvent> {
    let event_type = crate::verbs::AsyncEventType::from_raw(*slot.first()?)?;
    let element = u32::from_le_bytes(slot.get(4..8)?.try_into().ok()?);
    Some(AsyncEvent { event_type, element })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::AsyncEventType;

    #[test]
    fn round_trips() {
        let r =
            Request::RegMr { pd: 1, addr: 0x1000, len: 4096, access: AccessFlags::LOCAL_WRITE, fd_offset: 0 };
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let e = Reply::Error { errno: 22, message: "no".into() };
        assert_eq!(decode_reply(&encode_reply(&e)).unwrap(), e);
    }

    #[test]
    fn address_handle_messages_round_trip_and_keep_older_encodings() {
        let attr =
            AhAttr { dlid: 7, sl: 3, port_num: 1, is_global: true, hop_limit: 64, ..AhAttr::default() };
        let r = Request::CreateAh { pd: 4, attr };
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let r = Request::DestroyAh { ah: 9 };
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let a = Reply::Ah { ah: 9 };
        assert_eq!(decode_reply(&encode_reply(&a)).unwrap(), a);
        // Appended: the variants before them keep their numbers.
        assert_eq!(encode_request(&Request::Hello { version: 1 })[0], 0);
        assert_eq!(encode_request(&Request::DestroyQp { qp: 1 })[0], 19);
        assert_eq!(encode_request(&Request::CreateAh { pd: 1, attr })[0], 20);
        assert_eq!(encode_request(&Request::DestroyAh { ah: 1 })[0], 21);
        assert_eq!(encode_reply(&Reply::Done)[0], 12);
        assert_eq!(encode_reply(&Reply::Error { errno: 1, message: String::new() })[0], 13);
        assert_eq!(encode_reply(&Reply::Ah { ah: 1 })[0], 14);
    }

    #[test]
    fn a_full_stat_page_fits_one_message_whatever_its_values() {
        use crate::hca::*;
        use crate::verbs::{QpState, QpType};
        let link = LinkReport {
            id: LinkId(u32::MAX),
            // (`verified` is not in the pages: it comes back false.)
            info: LinkInfo { gid: Gid([0xff; 16]), lid: u16::MAX, chunk: u32::MAX, verified: false },
            up: true,
            qps: u32::MAX,
            stats: LinkStats {
                frames_out: u64::MAX,
                payload_out: u64::MAX,
                frames_in: u64::MAX,
                payload_in: u64::MAX,
                dropped_in: u64::MAX,
                throttle: LinkThrottle {
                    rate_limited_ns: u64::MAX,
                    cut_frames: u64::MAX,
                    cut_bytes: u64::MAX,
                },
                queues: {
                    let m = Sampled { sum: u64::MAX, max: u64::MAX };
                    LinkQueues {
                        tx_samples: u64::MAX,
                        daemon: m,
                        unsent: m,
                        in_flight: m,
                        rx_samples: u64::MAX,
                        rx_waiting: m,
                        rx_frames: m,
                        rx_payload: m,
                        latency_frames: u64::MAX,
                        ahead_daemon: m,
                        ahead_kernel: m,
                        daemon_wait_ns: m,
                        capped_ns: u64::MAX,
                        ahead_kernel_samples: u64::MAX,
                    }
                },
            },
        };
        let latency = metrics::Histogram {
            counts: [u64::MAX; metrics::LATENCY_BUCKETS + 1],
            sum_ns: u64::MAX,
            count: u64::MAX,
        };
        let mut tenant = metrics::TenantReport {
            tenant: TenantId(u32::MAX),
            objects: u32::MAX,
            registered_bytes: u64::MAX,
            counters: metrics::TenantCounters::default(),
        };
        let c = &mut tenant.counters;
        for v in [
            &mut c.messages_sent,
            &mut c.bytes_sent,
            &mut c.messages_received,
            &mut c.bytes_received,
            &mut c.completions_error,
            &mut c.turns,
            &mut c.engine_ns,
            &mut c.throttled_ns,
            &mut c.throttled_shares,
            &mut c.link_throttled_ns,
            &mut c.missed_wakeups,
        ] {
            *v = u64::MAX;
        }
        c.latency = latency;
        let qp = QpPathReport {
            qpn: u32::MAX,
            qp_type: QpType::Ud,
            state: QpState::Err,
            dest_qpn: u32::MAX,
            path: Path::Link(Some(LinkId(u32::MAX))),
            direct_grants: u32::MAX,
        };
        let page = StatPage {
            report: StatReport {
                links: vec![link; STAT_PAGE_LINKS],
                qps: vec![qp; STAT_PAGE_QPS],
                missed_wakeups: u64::MAX,
                tenant: Some(Box::new(tenant)),
                totals: true,
            },
            next: Some(StatCursor { link: Some(u32::MAX), qpn: Some(u32::MAX) }),
        };
        let bytes = encode_reply(&Reply::StatPage(page.clone()));
        assert!(bytes.len() <= MAX_MESSAGE, "{} bytes", bytes.len());
        assert_eq!(decode_reply(&bytes).unwrap(), Reply::StatPage(page));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_request(&[]).is_err());
        assert!(decode_request(&[0xff; 32]).is_err());
        assert!(matches!(decode_request(&vec![0; MAX_MESSAGE + 1]), Err(ProtoError::TooLarge(_))));
        let mut ok = encode_request(&Request::AllocPd);
        ok.push(0);
        assert!(matches!(decode_request(&ok), Err(ProtoError::Trailing { .. })));
        // Every prefix of a valid message is rejected cleanly.
        let full =
            encode_request(&Request::ModifyQp { qp: 3, attr: QpAttr::default(), mask: QpAttrMask::STATE });
        for n in 0..full.len() {
            assert!(decode_request(&full[..n]).is_err());
        }
    }

    #[test]
    fn vm_messages_are_appended() {
        let r = Request::VmAttach { name: "g".into() };
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        assert_eq!(encode_request(&r)[0], 26);
        assert_eq!(r.expected_fds(), 0);
        let a = Reply::VmAttached { region_len: 64 << 20, port_socket: "/run/vm-g.sock".into(), ports: 4 };
        assert_eq!(decode_reply(&encode_reply(&a)).unwrap(), a);
        assert_eq!(encode_reply(&a)[0], 20);
    }

    #[test]
    fn socket_messages_are_appended_and_round_trip() {
        let tuple = crate::sockets::Tuple {
            client: "127.0.0.1:40000".parse().unwrap(),
            server: "10.1.2.3:5000".parse().unwrap(),
        };
        for r in [
            Request::Sock(SockRequest::Listen { addr: tuple.server }),
            Request::Sock(SockRequest::Announce { tuple, local: true }),
            Request::Sock(SockRequest::Resolve { tuple, give_up: false }),
            Request::Sock(SockRequest::Counts),
            Request::Sock(SockRequest::Lookup { dst: "[fd00::1]:5000".parse().unwrap(), local: true }),
        ] {
            assert_eq!(encode_request(&r)[0], 33);
            assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
            let full = encode_request(&r);
            for n in 0..full.len() {
                assert!(decode_request(&full[..n]).is_err());
            }
        }
        let a = Reply::Sock(SockReply::Outcome(crate::sockets::Outcome::Carried));
        assert_eq!(encode_reply(&a)[0], 25);
        // Link-local scopes: a request of their own, appended last.
        let scoped = crate::sockets::Tuple {
            client: "[fe80::1%3]:40000".parse().unwrap(),
            server: "[fe80::1%3]:5000".parse().unwrap(),
        };
        let claim = SockRequest::Claim { tuple: scoped };
        let r = Request::SockScoped { scopes: claim.scopes(), req: claim.clone() };
        assert_eq!(r, Request::SockScoped { scopes: [3, 3], req: claim.clone() });
        let bytes = encode_request(&r);
        assert_eq!(bytes[0], 37, "after RegMrPieces' 36");
        // The whole example: the tag, the scopes (varints), then the plain
        // `SockRequest` (Claim's 4; each end: V6's 1, its 16 bytes, its
        // port as a varint).
        let fe80_1 = [254, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let mut want = vec![37, 3, 3, 4, 1];
        want.extend(fe80_1);
        want.extend([192, 184, 2, 1]);
        want.extend(fe80_1);
        want.extend([136, 39]);
        assert_eq!(bytes, want);
        // A `[::]` listener of a library that names scopes (it owns
        // link-local destinations): scopes 0, Listen's 0, V6's 1.
        let any = SockRequest::Listen { addr: "[::]:5000".parse().unwrap() };
        let mut want = vec![37, 0, 0, 0, 1];
        want.extend([0; 16]);
        want.extend([136, 39]);
        assert_eq!(encode_request(&Request::SockScoped { scopes: [0, 0], req: any }), want);
        let Request::SockScoped { scopes, req } = decode_request(&bytes).unwrap() else { panic!() };
        assert_ne!(req, claim, "the plain encoding drops the scopes");
        assert_eq!(req.with_scopes(scopes), claim);
        assert_eq!(decode_reply(&encode_reply(&a)).unwrap(), a);
    }

    #[test]
    fn a_pooled_reply_is_appended_after_cq_qp_and_round_trips() {
        let ring = RingSpec { offset: 8192, capacity: 64, stride: 64 };
        let a = Reply::Pooled {
            rings: vec![PoolRing::Chunk { chunk: 3, len: 4 << 20, fd: true }, PoolRing::Own],
            reply: Box::new(Reply::Cq { cq: 7, depth: 64, segment_len: 4 << 20, ring }),
        };
        let bytes = encode_reply(&a);
        assert_eq!(bytes[0], 27, "after CqQp's 26");
        assert_eq!(bytes[2], 1, "PoolRing::Chunk is the second kind");
        assert_eq!(decode_reply(&bytes).unwrap(), a);
        for n in 0..bytes.len() {
            assert!(decode_reply(&bytes[..n]).is_err());
        }
    }

    #[test]
    fn get_events_and_its_reply_are_appended_and_round_trip() {
        let r = Request::Cm(CmRequest::GetEvents { channel: 7, max: MAX_CM_EVENTS });
        let bytes = encode_request(&r);
        let cm = encode_request(&Request::Cm(CmRequest::CreateChannel))[0];
        assert_eq!(bytes[0], cm);
        assert_eq!(bytes[1], 25, "after Batch's 24");
        assert_eq!(&bytes[2..], &[7, MAX_CM_EVENTS as u8]);
        assert_eq!(decode_request(&bytes).unwrap(), r);
        let reply = Reply::Cm(CmReply::Events { events: vec![(None, 2)] });
        let bytes = encode_reply(&reply);
        let listening = encode_reply(&Reply::Cm(CmReply::Listening(true)));
        assert_eq!(bytes[0], listening[0]);
        assert_eq!(bytes[1], listening[1] + 1, "after Listening");
        assert_eq!(&bytes[2..], &[1, 0, 2], "one entry: no event, two wake-ups");
        assert_eq!(decode_reply(&bytes).unwrap(), reply);
    }

    #[test]
    fn a_cm_batch_is_appended_and_round_trips() {
        use crate::cm::ConnInfo;
        let init = QpInitAttr {
            qp_type: crate::verbs::QpType::Rc,
            send_cq: 0,
            recv_cq: 0,
            srq: None,
            cap: Default::default(),
            sq_sig_all: false,
        };
        let r = Request::Cm(CmRequest::Batch {
            ops: vec![
                CmBatchOp::CreateQpWithCq { id: 5, pd: 1, cqe: 32, init },
                CmBatchOp::Accept { id: 5, conn: ConnInfo::default(), qkey: 0 },
            ],
        });
        let bytes = encode_request(&r);
        let cm = encode_request(&Request::Cm(CmRequest::CreateChannel))[0];
        assert_eq!(bytes[0], cm);
        assert_eq!(bytes[1], 24, "after ConnectRouted's 23");
        assert_eq!(bytes[2], 2, "two calls");
        assert_eq!(bytes[3], 1, "CmBatchOp::CreateQpWithCq is the second kind");
        assert_eq!(decode_request(&bytes).unwrap(), r);
        for n in 0..bytes.len() {
            assert!(decode_request(&bytes[..n]).is_err());
        }
        // Each op is the request of its name.
        let op = CmBatchOp::ConnectRouted { id: 3, conn: ConnInfo::default() };
        assert_eq!(CmRequest::from(op), CmRequest::ConnectRouted { id: 3, conn: ConnInfo::default() });
        // The kinds added later come after the first seven, in order.
        let dst = std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 7471);
        let later = Request::Cm(CmRequest::Batch {
            ops: vec![
                CmBatchOp::ResolveAddr { id: 3, src: None, dst },
                CmBatchOp::CreateId { channel: 2, ps: 0x106 },
            ],
        });
        let bytes = encode_request(&later);
        assert_eq!(bytes[3], 7, "CmBatchOp::ResolveAddr is the eighth kind");
        assert_eq!(decode_request(&bytes).unwrap(), later);
        let create = encode_request(&Request::Cm(CmRequest::Batch {
            ops: vec![CmBatchOp::CreateId { channel: 2, ps: 0x106 }],
        }));
        assert_eq!(create[3], 8, "CmBatchOp::CreateId is the ninth kind");
        let create = CmBatchOp::CreateId { channel: 2, ps: 0x106 };
        assert_eq!(CmRequest::from(create), CmRequest::CreateId { channel: 2, ps: 0x106 });
        let resolve = CmBatchOp::ResolveAddr { id: 3, src: None, dst };
        assert_eq!(CmRequest::from(resolve), CmRequest::ResolveAddr { id: 3, src: None, dst });
        let a = Reply::Batch {
            replies: vec![Reply::Done, Reply::Error { errno: 22, message: "accept: wrong state".into() }],
            failed: Some(1),
        };
        let bytes = encode_reply(&a);
        assert_eq!(bytes[0], 28, "after Pooled's 27");
        assert_eq!(decode_reply(&bytes).unwrap(), a);
        for n in 0..bytes.len() {
            assert!(decode_reply(&bytes[..n]).is_err());
        }
    }

    #[test]
    fn adopting_a_context_is_appended_and_round_trips() {
        let r = Request::AdoptContext { version: PROTOCOL_VERSION, context: 0x0300_0007 };
        assert_eq!(encode_request(&r)[0], 34, "after the socket registry's");
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let full = encode_request(&r);
        for n in 0..full.len() {
            assert!(decode_request(&full[..n]).is_err());
        }
    }

    #[test]
    fn growing_a_guest_extent_is_appended_and_round_trips() {
        let r = Request::GuestGrow { offset: 0x4000, len: 3 * 4096 };
        assert_eq!(encode_request(&r)[0], 35, "after AdoptContext's 34");
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let full = encode_request(&r);
        for n in 0..full.len() {
            assert!(decode_request(&full[..n]).is_err());
        }
    }

    #[test]
    fn registering_a_region_of_pieces_is_appended_and_round_trips() {
        let pieces = vec![MrPiece { fd_offset: 0x123, len: 4096 - 0x123 }, MrPiece { fd_offset: 0, len: 10 }];
        let r = Request::RegMrPieces {
            pd: 1,
            addr: 0x1123,
            len: 4096 - 0x123 + 10,
            access: AccessFlags::LOCAL_WRITE,
            pieces,
        };
        assert_eq!(encode_request(&r)[0], 36, "after GuestGrow's 35");
        assert_eq!(r.expected_fds(), 2, "one fd a piece, on a host");
        assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
        let full = encode_request(&r);
        for n in 0..full.len() {
            assert!(decode_request(&full[..n]).is_err());
        }
    }

    #[test]
    fn async_event_slots() {
        let ev = AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: 77 };
        let mut s = [0u8; 8];
        encode_async_event(&ev, &mut s);
        assert_eq!(decode_async_event(&s), Some(ev));
        s[0] = 200;
        assert_eq!(decode_async_event(&s), None);
    }
}

#[cfg(test)]
mod random_input {
    use super::*;

    /// Cheap, dependency-free stand-in for the fuzz target in `fuzz/`:
    /// many pseudo-random messages, none of which may panic the decoder.
    #[test]
    fn random_messages_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let valid = encode_request(&Request::CreateQp {
            pd: 1,
            init: QpInitAttr {
                qp_type: crate::verbs::QpType::Rc,
                send_cq: 1,
                recv_cq: 2,
                srq: None,
                cap: Default::default(),
                sq_sig_all: false,
            },
        });
        for _ in 0..50_000 {
            let len = (next() % 96) as usize;
            let mut buf: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let _ = decode_request(&buf);
            // Mutations of a valid message reach deeper into the decoder.
            buf = valid.clone();
            let i = (next() as usize) % buf.len();
            buf[i] = next() as u8;
            if let Ok(r) = decode_request(&buf) {
                assert_eq!(decode_request(&encode_request(&r)).unwrap(), r);
            }
        }
    }
}
