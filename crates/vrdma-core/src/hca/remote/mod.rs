//! RC queue pairs whose peer lives on another host: the requester and
//! responder halves of the InfiniBand RC transport, speaking the wire
//! format of [`crate::wire`] over a link to the peer's daemon.
//!
//! On one host a work request is carried out whole in one place
//! (`datapath`). Across hosts the two halves run in two daemons, so the
//! same rules are split the way an HCA splits them: the requester turns
//! work requests into request frames, numbers them with PSNs, keeps them
//! until they are acknowledged and completes them in order; the responder
//! checks each request against its own QP, MRs and receive queue, places
//! the payload and answers with ACKs, NAKs, read responses and atomic
//! acknowledgements. The checks and statuses are the single-host ones, so
//! a program cannot tell which path its QP took.
//!
//! This module is sans-IO, like the rest of the core. The driver owns the
//! sockets and calls in:
//!
//! - [`Hca::link_up`] / [`Hca::link_down`] when an authenticated
//!   connection to a peer daemon starts or ends;
//! - [`Hca::poll_transmit`] while the socket can take more: it returns the
//!   next frame, tenant after tenant by deficit round robin in bytes (a
//!   chunk's worth a turn times the tenant's weight, so a contended link
//!   is shared by bytes in the ratio of the weights however many QPs and
//!   whatever message sizes each uses), and within a tenant QP after QP a
//!   frame each, so that a large transfer delays a small message by at
//!   most a turn of each busy tenant. A tenant of the latency class
//!   (see `hca::schedule`) with a frame ready goes before the round, as
//!   long as its deficit holds credit: its bandwidth stays bounded by its
//!   weight, but its 8-byte request does not wait for the others' turns.
//!   While such a tenant has sent on a link within `LATENCY_WINDOW`, the
//!   others' requests taken meanwhile are numbered and sent in frames of
//!   [`cut_frame`] bytes (a quarter of the chunk; the wire carries each
//!   frame's offset, so the peer needs no notice): the frame being
//!   written when the latency request arrives is what it waits for, and
//!   that is a quarter as long. A hog alone, or beside a latency tenant
//!   idle for the window, sends full chunks again (work conservation). A
//!   tenant's rate limit (the same
//!   token buckets as on one host, see `hca::schedule`) holds its request
//!   frames back; [`Hca::take_link_timer`] then says when to transmit
//!   again. The payload is a list of region windows, written from the
//!   mapped memory straight into the socket;
//! - [`Hca::handle_data`] with each received data header: it checks the
//!   frame and says where its payload goes ([`Sink`]), straight into the
//!   mapped region, or to be discarded; then [`Hca::data_placed`] once the
//!   payload is in, which is when completions and ACKs are produced, so an
//!   acknowledged write is a placed write;
//! - [`Hca::take_wanted_peers`] for the hosts some QP waits to reach.
//!
//! # What TCP changes
//!
//! A link is a reliable, ordered byte stream, so frames are neither lost
//! nor reordered while it lives, and a requester never needs to resend
//! for loss. The transport timer is kept with its meaning: when no
//! acknowledgement arrives within the QP's `timeout`, `retry_cnt` times
//! over, the peer is unreachable (its daemon died, the link was cut or it
//! stalls) and the work request completes `RETRY_EXC_ERR`. Resending
//! happens only where IB resends for a reason other than loss: after an
//! RNR NAK (no receive was posted) and after a PSN sequence error. A QP is
//! bound to the link it first used; if that link goes down its
//! outstanding requests can no longer be acknowledged, and it fails by the
//! timer, as on a cut cable. QPs created afterwards use the next link.

mod datagram;
mod requester;
mod responder;

use crate::hca::IdMap as HashMap;

use arrayvec::ArrayVec;
use serde::{Deserialize, Serialize};

use crate::hca::TenantId;

pub(crate) use requester::{frame_of, RemoteSend};
pub(crate) use responder::{InMsg, RemoteRecv};

use super::{Hca, Queues};
use crate::memory::Region;
use crate::ring::{MAX_INLINE, MAX_SGE};
use crate::time::Instant;
use crate::verbs::{AhAttr, Gid};
use crate::wire::{DataRepr, FrameRepr, MAX_DATA_HEADER_LEN};

/// A connection to another host's daemon, as the driver numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LinkId(pub u32);

/// What the handshake told about the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkInfo {
    /// The peer's port GID (entry 0 of its table).
    pub gid: Gid,
    pub lid: u16,
    /// Payload bytes per frame, as both Hellos negotiated.
    pub chunk: u32,
    /// Whether the peer's address vouches for its GID: this daemon dialled
    /// it at that GID's IPv4 address, or its connection came from there.
    /// A Hello may claim any GID (holding the key is all it proves): of
    /// the links whose GID a QP or a connection names, a verified one is
    /// taken first, so that a key holder cannot take over another host's
    /// traffic by claiming its GID; an unverified one only when no verified
    /// one is up (a loopback pair of daemons, a NATed peer). Not in the
    /// stats pages (their encoding is unchanged).
    #[serde(skip)]
    pub verified: bool,
}

/// How many times smaller than the link's chunk the other tenants'
/// request frames are while a latency-class tenant is active on it.
pub const LATENCY_CUT: u32 = 4;

/// The frame size of requests cut for a latency-class tenant on a link of
/// `chunk` bytes a frame (at least [`crate::wire::MIN_CHUNK`], never more
/// than the chunk).
pub fn cut_frame(chunk: u32) -> u32 {
    (chunk / LATENCY_CUT).max(crate::wire::MIN_CHUNK).min(chunk).max(1)
}

/// Counters of one link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStats {
    pub frames_out: u64,
    pub payload_out: u64,
    pub frames_in: u64,
    pub payload_in: u64,
    /// Frames received and discarded: for no QP of ours, out of sequence,
    /// or refused with a NAK.
    pub dropped_in: u64,
    /// What the link's scheduler held back (see [`LinkThrottle`]).
    pub throttle: LinkThrottle,
    /// What waited ahead of the next frame in the driver's and the
    /// kernel's queues while a latency-class tenant was active (counted
    /// by the driver: [`Hca::link_queues_mut`]).
    pub queues: LinkQueues,
}

/// Samples of the queues a latency-class tenant's frame waits behind on a
/// link, taken by the driver while such a tenant is active on it (one
/// pass in a few), so that a benchmark can say at which stage the bytes
/// were: each a count of samples, and over them the sum and the largest
/// value. Sending: the daemon's own queue, the kernel's unsent bytes and
/// its bytes in flight (sent, not yet acknowledged by the peer's kernel).
/// Receiving: the bytes waiting in the kernel's receive queue as a pass
/// began, and the frames and payload bytes the pass took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkQueues {
    pub tx_samples: u64,
    pub daemon: Sampled,
    pub unsent: Sampled,
    pub in_flight: Sampled,
    pub rx_samples: u64,
    pub rx_waiting: Sampled,
    pub rx_frames: Sampled,
    pub rx_payload: Sampled,
    /// Frames of a latency-class tenant sent, and for each as the core
    /// handed it to the driver: the bytes ahead of it in the daemon's
    /// queue, and then the time until its last byte was written to the
    /// socket, in ns. The bytes ahead of it in the kernel's queue (unsent
    /// and in flight) are `ahead_kernel`, over `ahead_kernel_samples`
    /// of these frames only.
    pub latency_frames: u64,
    pub ahead_daemon: Sampled,
    pub ahead_kernel: Sampled,
    pub daemon_wait_ns: Sampled,
    /// Time the daemon's queue was held at `net.max_queued_kib`, in ns.
    pub capped_ns: u64,
    /// The latency-class frames whose `ahead_kernel` was sampled: asking
    /// the kernel is a system call, so the driver does it for one frame
    /// in a few (the first of the link's, then every few), not for each
    /// small frame. `ahead_kernel`'s mean is over these.
    pub ahead_kernel_samples: u64,
}

/// The sum and the largest of a series of samples (their count is kept
/// beside).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sampled {
    pub sum: u64,
    pub max: u64,
}

impl Sampled {
    pub fn add(&mut self, v: u64) {
        self.sum = self.sum.saturating_add(v);
        self.max = self.max.max(v);
    }

    /// The mean over `n` samples.
    pub fn mean(&self, n: u64) -> f64 {
        self.sum as f64 / n.max(1) as f64
    }
}

/// What a link's scheduler held back, in the core; the driver's own
/// bound on what is queued while a latency-class tenant is active
/// (`net.max_queued_kib`) is counted by the driver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkThrottle {
    /// Time during which at least one tenant's requests on the link were
    /// held back by its rate limit while its QPs there may have had
    /// frames to send (they were in the engine's service order). Seen at
    /// the link's polls: a hold starts at the first poll that finds the
    /// tenant's bucket empty and ends at the first that finds it ready.
    pub rate_limited_ns: u64,
    /// Request frames of tenants not of the latency class cut to a
    /// quarter of the link's chunk ([`cut_frame`]) because a latency-class
    /// tenant was active on the link, counting only messages longer than
    /// the cut frame; and the payload bytes of those frames.
    pub cut_frames: u64,
    pub cut_bytes: u64,
}

/// One tenant's own traffic on a link: what `vrdma stat` shows a tenant
/// of the link's counters ([`LinkStats`] are every tenant's together,
/// which only the operator sees). A frame counts for the tenant of the
/// QP of ours that sends it or that it is addressed to; a received frame
/// for no QP of ours counts in the link's totals only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TenantTraffic {
    pub frames_out: u64,
    pub payload_out: u64,
    pub frames_in: u64,
    pub payload_in: u64,
    pub dropped_in: u64,
    pub cut_frames: u64,
    pub cut_bytes: u64,
}

/// Tenants whose traffic a link keeps apart at most. A tenant's entries
/// go when its last context closes (or it moves away), so the daemon's
/// `max_tenants` bounds them; this bounds them whatever the driver
/// admits. Past it a new tenant's frames count in the link's totals only.
pub const MAX_LINK_TENANTS: usize = super::metrics::MAX_TRACKED;

/// Whose figures a [`StatReport`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatView {
    /// The asking tenant's: its own traffic on each link, its own QPs
    /// there and its own missed wake-ups; never another tenant's.
    Tenant,
    /// The host operator's (the driver decides who that is): the links'
    /// totals over every tenant, and the daemon's missed wake-ups.
    Operator,
}

/// A window of a mapped region: where a payload comes from or goes to.
#[derive(Debug, Clone)]
pub struct IoSeg {
    pub region: Region,
    pub off: usize,
    pub len: usize,
}

/// Room for a data header and, when the payload is inline data posted
/// with the WR, the payload itself.
pub const TX_HEADER_CAP: usize = MAX_DATA_HEADER_LEN + MAX_INLINE;

/// One frame to write: `header`, then `data`, then the bytes of
/// `payload` in order.
#[derive(Debug, Default)]
pub struct Transmit {
    pub header: ArrayVec<u8, TX_HEADER_CAP>,
    /// A payload copied out of the sender's memory (UD datagrams only).
    pub data: Vec<u8>,
    pub payload: ArrayVec<IoSeg, MAX_SGE>,
    /// A latency-class tenant's frame (the driver samples what it waits
    /// behind: [`LinkQueues`]).
    pub latency: bool,
}

impl Transmit {
    pub(crate) fn new(repr: &DataRepr) -> Transmit {
        let mut t = Transmit::default();
        let hl = repr.header_len();
        t.header.extend(std::iter::repeat_n(0, hl));
        // Every repr built here is valid by construction; a failure is a
        // bug, and the frame goes out as a zeroed header the peer refuses.
        if let Err(e) = FrameRepr::Data(*repr).emit(&mut t.header) {
            debug_assert!(false, "emitting a frame we built: {e}");
        }
        t
    }

    /// A frame with no payload that is not a data frame (a Moved frame).
    pub(crate) fn control(repr: &FrameRepr) -> Transmit {
        let mut t = Transmit::default();
        t.header.extend(std::iter::repeat_n(0, repr.header_len()));
        if let Err(e) = repr.emit(&mut t.header) {
            debug_assert!(false, "emitting a frame we built: {e}");
        }
        t
    }

    /// Bytes on the wire.
    pub fn len(&self) -> usize {
        self.header.len() + self.data.len() + self.payload.iter().map(|s| s.len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a received frame's payload goes.
// Returned once per frame on the stack; boxing would allocate per frame.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Sink {
    /// Into these windows, in order; their lengths add up to the payload.
    Place(ArrayVec<IoSeg, MAX_SGE>),
    /// Read and thrown away, to keep the stream in step.
    Discard,
}

/// What to do once a frame's payload is in.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AfterPayload {
    Nothing,
    /// A request frame was accepted by the responder QP.
    Request {
        qpn: u32,
    },
    /// A read response chunk arrived for the requester QP, for the
    /// request numbered `serial`, at `offset` of its message.
    ReadResponse {
        qpn: u32,
        serial: u64,
        offset: u64,
        len: u32,
        last: bool,
    },
    /// A datagram for a UD QP, into the receive WR `wr_id`, taken while
    /// the QP had been reset `resets` times.
    Datagram {
        qpn: u32,
        resets: u32,
        wr_id: u64,
        len: u32,
        src_qpn: u32,
        ud: crate::wire::UdEth,
        imm: Option<u32>,
        solicited: bool,
    },
}

pub(crate) struct Link {
    pub info: LinkInfo,
    pub up: bool,
    /// QPs that send on this link (as requester or responder), by
    /// tenant: tenant after tenant, each a turn of a chunk's worth of
    /// bytes times its weight (deficit round robin), and within a tenant
    /// QP after QP a frame each, so that a tenant with many busy QPs
    /// delays another's message by one turn, not by one frame per QP.
    pub tenants: Vec<LinkTenant>,
    /// The tenant in `tenants` whose turn is next.
    pub next: usize,
    pub stats: LinkStats,
    pub after: AfterPayload,
    /// The QP the payload in flight goes to failed, was reset or
    /// destroyed: the driver throws the rest away (see
    /// [`Hca::placement_cancelled`]).
    pub cancelled: bool,
    pub datagrams: datagram::DatagramQueue,
    /// When a latency-class tenant last sent a frame on it.
    pub latency_seen: Option<Instant>,
    /// Since when at least one of `tenants` is held back by its rate
    /// limit (see [`LinkThrottle::rate_limited_ns`]).
    pub rate_held_since: Option<Instant>,
    /// Each tenant's share of `stats` (see [`TenantTraffic`]).
    pub traffic: HashMap<TenantId, TenantTraffic>,
    /// The tenant of the QP the frame being received is for, if it is
    /// ours: a drop of that frame counts for it.
    pub rx_tenant: Option<TenantId>,
}

/// One tenant's QPs on a link, served in turn.
pub(crate) struct LinkTenant {
    pub tenant: TenantId,
    /// Every QP of the tenant bound to the link.
    pub qps: QpSet,
    /// Those of them in the engine's service order: the only ones that
    /// can have a frame to send, so the only ones a link looks at.
    pub awake: QpSet,
    pub next: usize,
    /// Bytes it may still send in its turn (deficit round robin: each
    /// turn adds a frame's worth times its weight); below 0, what its
    /// last frame overdrew.
    pub deficit: i64,
    /// Its turn has begun (its deficit was topped up).
    pub visiting: bool,
    /// Since when its rate limit holds its requests back while its QPs
    /// on the link may have frames to send.
    pub rate_held_since: Option<Instant>,
}

/// QPs in an order, with membership, insertion and removal in constant
/// time: a link's lists change at every wake-up and every park of a QP,
/// so a linear search would make waking N QPs of a tenant cost N².
#[derive(Default)]
pub(crate) struct QpSet {
    list: Vec<u32>,
    at: HashMap<u32, usize>,
}

impl QpSet {
    fn of(qpn: u32) -> QpSet {
        let mut s = QpSet::default();
        s.insert(qpn);
        s
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn contains(&self, qpn: u32) -> bool {
        self.at.contains_key(&qpn)
    }

    fn get(&self, i: usize) -> Option<u32> {
        self.list.get(i).copied()
    }

    fn insert(&mut self, qpn: u32) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.at.entry(qpn) {
            e.insert(self.list.len());
            self.list.push(qpn);
        }
    }

    /// Removes `qpn`; the last QP takes its place.
    fn remove(&mut self, qpn: u32) {
        let Some(i) = self.at.remove(&qpn) else { return };
        self.list.swap_remove(i);
        if let Some(&moved) = self.list.get(i) {
            self.at.insert(moved, i);
        }
    }

    fn into_iter(self) -> impl Iterator<Item = u32> {
        self.list.into_iter()
    }
}

impl Link {
    /// `t`'s traffic on the link, made on first use (`None` past
    /// [`MAX_LINK_TENANTS`]).
    pub(crate) fn traffic_of(&mut self, t: TenantId) -> Option<&mut TenantTraffic> {
        if !self.traffic.contains_key(&t) && self.traffic.len() >= MAX_LINK_TENANTS {
            return None;
        }
        Some(self.traffic.entry(t).or_default())
    }

    /// Counts a frame sent for `tenant` (`None`: no tenant's) with
    /// `payload` bytes.
    fn sent(&mut self, tenant: Option<TenantId>, payload: u64) {
        self.stats.frames_out += 1;
        self.stats.payload_out += payload;
        if let Some(c) = tenant.and_then(|t| self.traffic_of(t)) {
            c.frames_out += 1;
            c.payload_out += payload;
        }
    }

    fn qp_count(&self) -> usize {
        self.tenants.iter().map(|t| t.qps.len()).sum()
    }

    /// The `ti`th tenant's rate limit holds its requests back at `now`
    /// (`held`), or not. Returns how long a hold that ended now lasted, in
    /// ns (the tenant's share of [`LinkThrottle::rate_limited_ns`]); the
    /// link's time counts while any tenant is held.
    fn rate_hold(&mut self, ti: usize, held: bool, now: Instant) -> u64 {
        let Some(t) = self.tenants.get_mut(ti) else { return 0 };
        // Only while it may have something to send.
        let held = held && !t.awake.is_empty();
        let ended = match (t.rate_held_since, held) {
            (None, true) => {
                t.rate_held_since = Some(now);
                self.rate_held_since.get_or_insert(now);
                return 0;
            }
            (Some(since), false) => {
                t.rate_held_since = None;
                now.saturating_since(since).as_nanos() as u64
            }
            _ => return 0,
        };
        if !self.tenants.iter().any(|t| t.rate_held_since.is_some()) {
            if let Some(since) = self.rate_held_since.take() {
                self.stats.throttle.rate_limited_ns += now.saturating_since(since).as_nanos() as u64;
            }
        }
        ended
    }

    /// Tenants left with no QP on the link go (a hold of theirs under
    /// way is not counted).
    fn forget_idle_tenants(&mut self) {
        self.tenants.retain(|t| !t.qps.is_empty());
        if !self.tenants.iter().any(|t| t.rate_held_since.is_some()) {
            self.rate_held_since = None;
        }
    }
}

impl AfterPayload {
    /// The QP whose frame's payload this finishes.
    pub(crate) fn qpn(&self) -> Option<u32> {
        match *self {
            AfterPayload::Nothing => None,
            AfterPayload::Request { qpn }
            | AfterPayload::ReadResponse { qpn, .. }
            | AfterPayload::Datagram { qpn, .. } => Some(qpn),
        }
    }
}

/// Every link, and the peers QPs are waiting for.
#[derive(Default)]
pub(crate) struct Network {
    pub links: HashMap<LinkId, Link>,
    next_link: u32,
    wanted: Vec<Gid>,
    /// Numbers every request a requester sends, so that a read response
    /// whose payload outlived its request (the QP was reset or failed
    /// meanwhile) cannot complete another one.
    pub next_serial: u64,
    /// The earliest moment a tenant a rate limit held back on a link may
    /// send again (see [`Hca::take_link_timer`]).
    throttled: Option<Instant>,
}

impl Network {
    /// The live link to the host an address vector names: a verified one
    /// ([`LinkInfo::verified`]) before any other, and the newest of those,
    /// where there are two (the host's daemon restarted and linked again
    /// while its last life's link is not yet found dead; a QP bound to
    /// that one would fail when it is, whatever the peer it reached).
    pub fn route(&self, ah: &AhAttr) -> Option<LinkId> {
        self.links
            .iter()
            .filter(|(_, l)| l.up && if ah.is_global { l.info.gid == ah.dgid } else { l.info.lid == ah.dlid })
            .map(|(&id, l)| (l.info.verified, id))
            .max()
            .map(|(_, id)| id)
    }

    pub fn want(&mut self, gid: Gid) {
        if !self.wanted.contains(&gid) {
            self.wanted.push(gid);
        }
    }

    /// Binds a QP to a link; it is awake there (it binds while it works).
    pub(crate) fn attach(&mut self, link: LinkId, qpn: u32, tenant: TenantId) {
        let Some(l) = self.links.get_mut(&link) else { return };
        match l.tenants.iter_mut().find(|t| t.tenant == tenant) {
            Some(t) => {
                t.qps.insert(qpn);
                t.awake.insert(qpn);
            }
            None => l.tenants.push(LinkTenant {
                tenant,
                qps: QpSet::of(qpn),
                awake: QpSet::of(qpn),
                next: 0,
                deficit: 0,
                visiting: false,
                rate_held_since: None,
            }),
        }
    }

    /// A QP's transport across hosts ended (a reset or its destruction).
    pub(crate) fn detach(&mut self, r: &RemoteQp, qpn: u32, tenant: TenantId) {
        for link in r.links().into_iter().flatten() {
            self.detach_from(link, qpn, tenant);
        }
    }

    /// Unbinds a QP from one link.
    pub(crate) fn detach_from(&mut self, link: LinkId, qpn: u32, tenant: TenantId) {
        let Some(l) = self.links.get_mut(&link) else { return };
        if let Some(t) = l.tenants.iter_mut().find(|t| t.tenant == tenant) {
            t.qps.remove(qpn);
            t.awake.remove(qpn);
        }
        l.forget_idle_tenants();
    }

    /// Says whether a QP bound to `link` is in the engine's service order.
    pub(crate) fn set_awake(&mut self, link: LinkId, qpn: u32, tenant: TenantId, awake: bool) {
        let Some(t) =
            self.links.get_mut(&link).and_then(|l| l.tenants.iter_mut().find(|t| t.tenant == tenant))
        else {
            return;
        };
        if !t.qps.contains(qpn) {
            return;
        }
        if awake {
            t.awake.insert(qpn);
        } else {
            t.awake.remove(qpn);
        }
    }

    /// Counts a received frame that was thrown away, and says why in the
    /// debug log.
    pub fn dropped(&mut self, link: LinkId, why: &'static str) {
        tracing::debug!(link = link.0, why, "frame dropped");
        if let Some(l) = self.links.get_mut(&link) {
            l.stats.dropped_in += 1;
            if let Some(c) = l.rx_tenant.and_then(|t| l.traffic_of(t)) {
                c.dropped_in += 1;
            }
        }
    }

    /// `tenant` is gone from this host (its last context closed, or it
    /// moved away): its traffic on each link is no longer kept apart.
    pub fn forget_tenant(&mut self, tenant: TenantId) {
        for l in self.links.values_mut() {
            l.traffic.remove(&tenant);
            if l.rx_tenant == Some(tenant) {
                l.rx_tenant = None;
            }
        }
    }

    /// Whether a latency-class tenant sent on `link` within
    /// [`crate::hca::schedule::LATENCY_WINDOW`] of `now`: the others'
    /// requests are cut into smaller frames meanwhile.
    pub fn latency_active(&self, link: LinkId, now: Instant) -> bool {
        self.links
            .get(&link)
            .and_then(|l| l.latency_seen)
            .is_some_and(|t| now.saturating_since(t) < crate::hca::schedule::LATENCY_WINDOW)
    }

    pub fn chunk(&self, link: LinkId) -> u32 {
        self.links.get(&link).map_or(crate::wire::MAX_CHUNK, |l| l.info.chunk)
    }
}

/// Per-QP state of the remote path, made when the QP first uses it.
pub(crate) struct RemoteQp {
    pub send: Option<RemoteSend>,
    pub recv: Option<RemoteRecv>,
}

impl RemoteQp {
    /// Nothing to send, time or complete: no request outstanding or held
    /// back, no answer queued or being placed.
    pub fn is_quiescent(&self) -> bool {
        self.send.as_ref().is_none_or(|s| s.sent.is_empty() && s.blocked.is_none())
            && self.recv.as_ref().is_none_or(|r| r.is_quiescent())
    }

    /// The links its requests go out on and come in on.
    pub fn links(&self) -> [Option<LinkId>; 2] {
        [self.send.as_ref().and_then(|s| s.link), self.recv.as_ref().and_then(|r| r.link)]
    }

    /// Send WRs pulled from the queue and not yet retired.
    pub fn held_sends(&self) -> u32 {
        self.send.as_ref().map_or(0, |s| s.sent.len() as u32 + u32::from(s.blocked.is_some()))
    }
}

/// What `vrdma stat` shows of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkReport {
    pub id: LinkId,
    pub info: LinkInfo,
    pub up: bool,
    pub qps: u32,
    pub stats: LinkStats,
}

/// A QP and the path its traffic takes, for `vrdma stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpPathReport {
    pub qpn: u32,
    pub qp_type: crate::verbs::QpType,
    pub state: crate::verbs::QpState,
    pub dest_qpn: u32,
    pub path: Path,
    /// Regions of the peer QP this QP holds direct-path grants for (its
    /// RDMA writes to them skip the engine; `docs/direct-path.md`); 0 when
    /// it holds no window.
    pub direct_grants: u32,
}

/// What `vrdma stat` shows: the links, and the QPs of the asking tenant.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatReport {
    pub links: Vec<LinkReport>,
    pub qps: Vec<QpPathReport>,
    /// Turns in which a sweep found work on a QP nothing had woken
    /// ([`super::Hca::missed_wakeups`]): 0 unless a tenant does not name
    /// the QPs it posts to, or the device has a bug.
    pub missed_wakeups: u64,
    /// The asking tenant's own figures (the metrics endpoint's per-tenant
    /// series, for that tenant only: never another's). Of fixed size, so
    /// a page stays bounded.
    /// Boxed: the control protocol's replies stay small.
    pub tenant: Option<Box<super::metrics::TenantReport>>,
    /// The links' counters and `missed_wakeups` are the daemon's totals
    /// over every tenant (the operator asked); otherwise they are the
    /// asking tenant's own (see [`StatView`]).
    pub totals: bool,
}

/// Where a page of a [`StatReport`] starts: the lowest link id and QP
/// number to list, `None` once that list is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatCursor {
    pub link: Option<u32>,
    pub qpn: Option<u32>,
}

impl StatCursor {
    pub const START: StatCursor = StatCursor { link: Some(0), qpn: Some(0) };
}

/// One page of a [`StatReport`], and where the next one starts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatPage {
    pub report: StatReport,
    pub next: Option<StatCursor>,
}

/// Links in one [`StatPage`]. With [`STAT_PAGE_QPS`] they bound a page
/// well under the control protocol's message size, whatever the values
/// (a link's report is about 400 bytes at most with its queue samples).
pub const STAT_PAGE_LINKS: usize = 64;
/// QPs in one [`StatPage`]: a tenant may hold thousands, more than one
/// control message carries.
pub const STAT_PAGE_QPS: usize = 1024;

/// The path a QP's traffic takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Path {
    /// Not connected yet (not in RTR).
    None,
    /// The peer QP is on this host: shared memory.
    SharedMemory,
    /// The peer QP is on another host, reached over this link (or not
    /// reached yet).
    Link(Option<LinkId>),
}

impl Hca {
    /// A connection to a peer daemon is up and authenticated.
    pub fn link_up(&mut self, info: LinkInfo) -> LinkId {
        let n = &mut self.net;
        n.next_link = n.next_link.wrapping_add(1);
        let id = LinkId(n.next_link);
        n.links.insert(
            id,
            Link {
                info,
                up: true,
                tenants: Vec::new(),
                next: 0,
                stats: LinkStats::default(),
                after: AfterPayload::Nothing,
                cancelled: false,
                datagrams: Default::default(),
                latency_seen: None,
                rate_held_since: None,
                traffic: HashMap::default(),
                rx_tenant: None,
            },
        );
        n.wanted.retain(|g| *g != info.gid);
        id
    }

    /// Whether a latency-class tenant has sent on `link` within
    /// `LATENCY_WINDOW` of `now`: the driver then keeps few bytes queued
    /// for the link ahead of its next frame (the core already cuts the
    /// others' frames).
    pub fn link_latency_active(&self, link: LinkId, now: Instant) -> bool {
        self.net.latency_active(link, now)
    }

    /// The driver's samples of `link`'s queues (see [`LinkQueues`]).
    pub fn link_queues_mut(&mut self, link: LinkId) -> Option<&mut LinkQueues> {
        self.net.links.get_mut(&link).map(|l| &mut l.stats.queues)
    }

    /// The connection is gone. Its QPs' outstanding requests can no
    /// longer be acknowledged: they fail by their transport timers.
    pub fn link_down(&mut self, link: LinkId) {
        self.metrics.link_retransmits.remove(&link);
        let Some(l) = self.net.links.remove(&link) else { return };
        for qpn in l.tenants.into_iter().flat_map(|t| t.qps.into_iter()) {
            let Some(r) = self.qps.get_mut(&qpn).and_then(|q| q.remote.as_deref_mut()) else { continue };
            if let Some(s) = r.send.as_mut().filter(|s| s.link == Some(link)) {
                s.link_lost = true;
            }
            if let Some(rc) = r.recv.as_mut().filter(|rc| rc.link == Some(link)) {
                rc.link_lost();
            }
        }
    }

    /// Hosts that QPs wait to reach and no link serves; the driver
    /// connects to them. Each is reported once until asked for again.
    pub fn take_wanted_peers(&mut self) -> Vec<Gid> {
        std::mem::take(&mut self.net.wanted)
    }

    /// Times a QP on `link` sent its unanswered requests again (its
    /// transport timer expired, or the peer asked with a sequence NAK).
    pub fn link_retransmits(&self, link: LinkId) -> u64 {
        self.metrics.link_retransmits.get(&link).copied().unwrap_or(0)
    }

    pub fn links(&self) -> Vec<LinkReport> {
        let mut v: Vec<LinkReport> = self
            .net
            .links
            .iter()
            .map(|(&id, l)| LinkReport {
                id,
                info: l.info,
                up: l.up,
                qps: l.qp_count() as u32,
                stats: l.stats,
            })
            .collect();
        v.sort_by_key(|r| r.id);
        v
    }

    /// The links as `tenant` sees them: each link's peer and state, and
    /// of its counters only the tenant's own traffic and QPs (the queue
    /// samples and the link's rate-limited time are every tenant's
    /// together: shown to the operator only; the tenant's own held time
    /// is its `link_throttled_ns`).
    pub fn links_of(&self, tenant: TenantId) -> Vec<LinkReport> {
        let mut v: Vec<LinkReport> = self
            .net
            .links
            .iter()
            .map(|(&id, l)| {
                let c = l.traffic.get(&tenant).copied().unwrap_or_default();
                LinkReport {
                    id,
                    info: l.info,
                    up: l.up,
                    qps: l.tenants.iter().find(|t| t.tenant == tenant).map_or(0, |t| t.qps.len() as u32),
                    stats: LinkStats {
                        frames_out: c.frames_out,
                        payload_out: c.payload_out,
                        frames_in: c.frames_in,
                        payload_in: c.payload_in,
                        dropped_in: c.dropped_in,
                        throttle: LinkThrottle {
                            rate_limited_ns: 0,
                            cut_frames: c.cut_frames,
                            cut_bytes: c.cut_bytes,
                        },
                        queues: LinkQueues::default(),
                    },
                }
            })
            .collect();
        v.sort_by_key(|r| r.id);
        v
    }

    /// A page of the links and of the QPs of `ctx`'s tenant with their
    /// paths, each list in ascending order from `from`; the links'
    /// counters and the missed wake-ups as `view` may see them.
    pub fn stat(
        &self,
        ctx: super::ContextId,
        from: StatCursor,
        view: StatView,
    ) -> Result<StatPage, super::HcaError> {
        let tenant = self.tenant_of(ctx)?;
        let mut links: Vec<LinkReport> = match from.link {
            Some(first) => {
                let all = match view {
                    StatView::Operator => self.links(),
                    StatView::Tenant => self.links_of(tenant),
                };
                all.into_iter().filter(|l| l.id.0 >= first).collect()
            }
            None => Vec::new(),
        };
        let mut qps: Vec<QpPathReport> = match from.qpn {
            Some(first) => self
                .qps
                .iter()
                .filter(|(&qpn, q)| q.tenant == tenant && qpn >= first)
                .filter_map(|(&qpn, q)| {
                    Some(QpPathReport {
                        qpn,
                        qp_type: q.init.qp_type,
                        state: q.state(),
                        dest_qpn: q.attr.dest_qp_num,
                        path: self.qp_path(qpn)?,
                        direct_grants: self.direct_grants_of(qpn),
                    })
                })
                .collect(),
            None => Vec::new(),
        };
        qps.sort_by_key(|q| q.qpn);
        let next_link = links.get(STAT_PAGE_LINKS).map(|l| l.id.0);
        let next_qpn = qps.get(STAT_PAGE_QPS).map(|q| q.qpn);
        links.truncate(STAT_PAGE_LINKS);
        qps.truncate(STAT_PAGE_QPS);
        let next = (next_link.is_some() || next_qpn.is_some())
            .then_some(StatCursor { link: next_link, qpn: next_qpn });
        let own = self.tenant_report(tenant);
        let (missed_wakeups, totals) = match view {
            StatView::Operator => (self.missed_wakeups, true),
            StatView::Tenant => (own.counters.missed_wakeups, false),
        };
        let report = StatReport { links, qps, missed_wakeups, tenant: Some(Box::new(own)), totals };
        Ok(StatPage { report, next })
    }

    /// When a held ACK of `qpn` is due.
    #[cfg(test)]
    pub(crate) fn ack_timer(&self, qpn: u32) -> Option<Instant> {
        self.qps.get(&qpn)?.remote.as_ref()?.recv.as_ref()?.ack_due()
    }

    /// The path of a QP's traffic.
    pub fn qp_path(&self, qpn: u32) -> Option<Path> {
        let qp = self.qps.get(&qpn)?;
        if !matches!(
            qp.state(),
            crate::verbs::QpState::Rtr | crate::verbs::QpState::Rts | crate::verbs::QpState::Sqd
        ) && qp.remote.is_none()
        {
            return Some(Path::None);
        }
        if qp.init.qp_type == crate::verbs::QpType::Rc && !self.is_local(&qp.attr.ah_attr) {
            let link = qp.remote.as_ref().and_then(|r| r.send.as_ref()).and_then(|s| s.link);
            return Some(Path::Link(link.or_else(|| self.net.route(&qp.attr.ah_attr))));
        }
        Some(Path::SharedMemory)
    }

    /// The next frame to write on `link`, if any QP has one.
    pub fn poll_transmit(&mut self, link: LinkId, now: Instant, io: &mut dyn Queues) -> Option<Transmit> {
        // Datagrams first: each is at most one MTU.
        if let Some((tenant, t)) = self.net.links.get_mut(&link)?.datagrams.pop_front() {
            let l = self.net.links.get_mut(&link)?;
            l.sent(Some(tenant), t.data.len() as u64);
            return Some(t);
        }
        // Tenant after tenant (deficit round robin in bytes, by weight);
        // within one, QP after QP from where it left off. Each QP is
        // looked at once at most.
        let (tenants, chunk) = self.net.links.get(&link).map(|l| (l.tenants.len(), l.info.chunk))?;
        // A full frame's payload a turn, times the weight: a frame's header
        // overdraws it a little, repaid from the next turn.
        let quantum = i64::from(chunk).max(TX_HEADER_CAP as i64);
        if let Some(tx) = self.latency_transmit(link, now, io) {
            return Some(tx);
        }
        // A tenant passed over to repay a debt is visited again (after two
        // turns' credit it holds some, the quantum being at least a
        // frame): a link with work never reports none.
        let (mut visits, mut visited) = (tenants, 0);
        while visited < visits {
            visited += 1;
            let l = self.net.links.get_mut(&link)?;
            if l.tenants.is_empty() {
                return None;
            }
            let ti = l.next % l.tenants.len();
            let tenant = l.tenants[ti].tenant;
            if !l.tenants[ti].visiting {
                let weight = i64::from(self.order.weight(tenant));
                let l = self.net.links.get_mut(&link)?;
                let t = &mut l.tenants[ti];
                t.visiting = true;
                t.deficit = t.deficit.saturating_add(quantum * weight);
            }
            let l = self.net.links.get_mut(&link)?;
            if l.tenants[ti].deficit <= 0 {
                // Still repaying what it overdrew.
                l.tenants[ti].visiting = false;
                l.next = ti + 1;
                // Round once more: its next turn holds credit.
                visits = (visited + tenants).min(2 * tenants + 1);
                continue;
            }
            // Its rate limit holds back its requests (not its answers to
            // another host's requests: ACKs, read responses).
            let throttled = self.rate_check(link, ti, tenant, now);
            let tx = self.tenant_transmit(link, ti, throttled.is_none(), now, io);
            let l = self.net.links.get_mut(&link)?;
            let Some(t) = l.tenants.get_mut(ti) else { continue };
            match tx {
                Some(tx) => {
                    let payload = tx.payload.iter().map(|s| s.len as u64).sum::<u64>() + tx.data.len() as u64;
                    t.deficit -= tx.len() as i64;
                    if t.deficit <= 0 {
                        // Its turn is over; what it overdrew is paid from
                        // its next.
                        t.visiting = false;
                        l.next = ti + 1;
                    }
                    l.sent(Some(tenant), payload);
                    let mut tx = tx;
                    if self.order.is_latency(tenant) {
                        l.latency_seen = Some(now);
                        tx.latency = true;
                    }
                    self.order.charge(tenant, payload, 0);
                    return Some(tx);
                }
                None => {
                    // Nothing to send: an idle tenant keeps no credit,
                    // but a latency-class tenant keeps this turn's (one
                    // turn's worth at most) to go first with when its
                    // next request comes.
                    let keep = if self.order.is_latency(tenant) {
                        quantum * self.order.weight(tenant) as i64
                    } else {
                        0
                    };
                    let l = self.net.links.get_mut(&link)?;
                    let Some(t) = l.tenants.get_mut(ti) else { continue };
                    t.deficit = t.deficit.min(keep);
                    t.visiting = false;
                    l.next = ti + 1;
                }
            }
        }
        // Tenants left with no QP on this link go.
        if let Some(l) = self.net.links.get_mut(&link) {
            l.forget_idle_tenants();
        }
        None
    }

    /// A frame of a latency-class tenant on `link` that holds credit in
    /// the round (its deficit), before the round's turn: it goes first,
    /// and its bytes come out of its deficit as in its turn, so its share
    /// of the link stays bounded by its weight. Marks the link as having
    /// a latency tenant active.
    fn latency_transmit(&mut self, link: LinkId, now: Instant, io: &mut dyn Queues) -> Option<Transmit> {
        let n = self.net.links.get(&link)?.tenants.len();
        for ti in 0..n {
            let l = self.net.links.get(&link)?;
            let Some(t) = l.tenants.get(ti) else { break };
            let tenant = t.tenant;
            if t.deficit <= 0 || t.awake.is_empty() || !self.order.is_latency(tenant) {
                continue;
            }
            let throttled = self.rate_check(link, ti, tenant, now);
            let Some(mut tx) = self.tenant_transmit(link, ti, throttled.is_none(), now, io) else { continue };
            tx.latency = true;
            let payload = tx.payload.iter().map(|s| s.len as u64).sum::<u64>() + tx.data.len() as u64;
            let l = self.net.links.get_mut(&link)?;
            if let Some(t) = l.tenants.get_mut(ti) {
                t.deficit -= tx.len() as i64;
            }
            l.sent(Some(tenant), payload);
            l.latency_seen = Some(now);
            self.order.charge(tenant, payload, 0);
            return Some(tx);
        }
        None
    }

    /// When the rate limit of `tenant`, the `ti`th on `link`, lets its
    /// requests go again (`None`: now): the link's timer is set for it,
    /// and its held time counted (see [`LinkThrottle`]).
    fn rate_check(&mut self, link: LinkId, ti: usize, tenant: TenantId, now: Instant) -> Option<Instant> {
        let throttled = self.order.ready_at(tenant, now);
        if let Some(at) = throttled {
            self.net.throttled = Some(self.net.throttled.map_or(at, |t| t.min(at)));
        }
        let ended = self.net.links.get_mut(&link).map_or(0, |l| l.rate_hold(ti, throttled.is_some(), now));
        if ended > 0 {
            let c = self.counters(tenant);
            c.link_throttled_ns = c.link_throttled_ns.saturating_add(ended);
        }
        throttled
    }

    /// The next frame of the QPs of the `ti`th tenant on `link`, from the
    /// QP after the last that sent: an answer, or (if `requests`) a
    /// request.
    fn tenant_transmit(
        &mut self,
        link: LinkId,
        ti: usize,
        requests: bool,
        now: Instant,
        io: &mut dyn Queues,
    ) -> Option<Transmit> {
        let n = self.net.links.get(&link)?.tenants.get(ti)?.awake.len();
        for _ in 0..n {
            let l = self.net.links.get_mut(&link)?;
            let t = l.tenants.get_mut(ti).filter(|t| !t.awake.is_empty())?;
            let i = t.next % t.awake.len();
            let qpn = t.awake.get(i)?;
            t.next = i + 1;
            match self.qps.get(&qpn).map(|q| q.remote.is_some()) {
                None | Some(false) => {
                    // Destroyed or reset: no longer on this link.
                    let t = &mut self.net.links.get_mut(&link)?.tenants[ti];
                    t.qps.remove(qpn);
                    t.awake.remove(qpn);
                }
                Some(true) => {
                    // A QP that moved here says so before anything else.
                    if let Some(tx) = self.announce_transmit(qpn, link) {
                        return Some(tx);
                    }
                    let tx = self.responder_transmit(qpn, link, now).or_else(|| {
                        if requests {
                            self.requester_transmit(qpn, link, now, io)
                        } else {
                            None
                        }
                    });
                    if tx.is_some() {
                        return tx;
                    }
                }
            }
        }
        None
    }

    /// The earliest moment a tenant held back by its rate limit on a link
    /// may send again, since the last call: the driver wakes the engine
    /// then to transmit.
    pub fn take_link_timer(&mut self) -> Option<Instant> {
        self.net.throttled.take()
    }

    /// A data frame's header arrived on `link`: checks it and says where
    /// its payload goes. Call [`Hca::data_placed`] once the payload is in
    /// (at once when it has none).
    pub fn handle_data(&mut self, link: LinkId, hdr: &DataRepr, now: Instant, io: &mut dyn Queues) -> Sink {
        // The frame is the traffic of the tenant of the QP it names, if
        // that QP is ours and of the tenant the frame says.
        let rx_tenant = self.qps.get(&hdr.dest_qpn).map(|q| q.tenant).filter(|t| t.0 == hdr.vnet);
        let Some(l) = self.net.links.get_mut(&link) else { return Sink::Discard };
        l.stats.frames_in += 1;
        l.stats.payload_in += u64::from(hdr.payload_len);
        l.rx_tenant = rx_tenant;
        if let Some(c) = rx_tenant.and_then(|t| l.traffic_of(t)) {
            c.frames_in += 1;
            c.payload_in += u64::from(hdr.payload_len);
        }
        l.after = AfterPayload::Nothing;
        l.cancelled = false;
        let ud = matches!(hdr.opcode, crate::wire::Opcode::UdSendOnly | crate::wire::Opcode::UdSendOnlyImm);
        if self.paused_handle(link, hdr) {
            return Sink::Discard;
        }
        let (sink, after) = if ud {
            self.datagram_handle(link, hdr, io)
        } else if hdr.opcode.is_request() {
            self.responder_handle(link, hdr, now, io)
        } else {
            self.requester_handle(link, hdr, now, io)
        };
        if let Some(l) = self.net.links.get_mut(&link) {
            l.after = after;
        }
        if !ud {
            // An answer to send or a request to complete: the QP's turn.
            self.update_service(hdr.dest_qpn);
        }
        sink
    }

    /// The payload of the frame last passed to [`Hca::handle_data`] on
    /// `link` could not be placed: a memory region it was going to was
    /// deregistered meanwhile (the driver saw [`Region::is_revoked`] and
    /// discarded the rest). The QP it was for fails as it would have, had
    /// the region been gone when the header came.
    ///
    /// [`Region::is_revoked`]: crate::memory::Region::is_revoked
    pub fn data_lost(&mut self, link: LinkId, io: &mut dyn Queues) {
        let Some(l) = self.net.links.get_mut(&link) else { return };
        l.cancelled = false;
        let after = std::mem::replace(&mut l.after, AfterPayload::Nothing);
        self.net.dropped(link, "payload for a region deregistered meanwhile");
        match after {
            AfterPayload::Nothing => {}
            AfterPayload::Request { qpn } => self.responder_lost(qpn, io),
            AfterPayload::ReadResponse { qpn, serial, .. } => self.read_response_lost(qpn, serial, io),
            AfterPayload::Datagram { qpn, resets, wr_id, .. } => self.datagram_lost(qpn, resets, wr_id, io),
        }
    }

    /// Whether the rest of the payload arriving on `link` must be thrown
    /// away, not placed: the QP it was for failed, was reset or was
    /// destroyed meanwhile, and what it had claimed (a receive, an SRQ's
    /// receive, a read's buffer) is no longer its to write. The driver
    /// asks before every read into the windows [`Hca::handle_data`] gave,
    /// and still calls [`Hca::data_placed`] at the frame's end.
    pub fn placement_cancelled(&self, link: LinkId) -> bool {
        self.net.links.get(&link).is_some_and(|l| l.cancelled)
    }

    /// `qpn` fails, is reset or is destroyed: a payload arriving for it
    /// stops being placed (see [`Hca::placement_cancelled`]).
    pub(crate) fn cancel_placements_of(&mut self, qpn: u32) {
        for l in self.net.links.values_mut() {
            if l.after.qpn() == Some(qpn) {
                l.cancelled = true;
            }
        }
    }

    /// The payload of the frame last passed to [`Hca::handle_data`] on
    /// `link` has been placed (or discarded).
    pub fn data_placed(&mut self, link: LinkId, now: Instant, io: &mut dyn Queues) {
        let Some(l) = self.net.links.get_mut(&link) else { return };
        l.cancelled = false;
        match std::mem::replace(&mut l.after, AfterPayload::Nothing) {
            AfterPayload::Nothing => {}
            AfterPayload::Request { qpn } => self.responder_placed(qpn, now, io),
            AfterPayload::ReadResponse { qpn, serial, offset, len, last } => {
                self.read_response_placed(link, qpn, serial, offset, len, last, now, io)
            }
            AfterPayload::Datagram { qpn, resets, wr_id, len, src_qpn, ud, imm, solicited } => {
                self.datagram_placed(qpn, resets, wr_id, len, src_qpn, ud, imm, solicited, io)
            }
        }
    }
}

/// The windows of `segs` that hold bytes `[start, start+len)` of a message.
pub(super) fn windows(
    segs: &[super::datapath::Seg<'_>],
    start: u64,
    len: u64,
) -> Option<ArrayVec<IoSeg, MAX_SGE>> {
    let mut out = ArrayVec::new();
    let mut skip = start as usize;
    let mut left = len as usize;
    for s in segs {
        if left == 0 {
            break;
        }
        if skip >= s.len {
            skip -= s.len;
            continue;
        }
        let n = (s.len - skip).min(left);
        out.push(IoSeg { region: s.region.clone(), off: s.off + skip, len: n });
        skip = 0;
        left -= n;
    }
    (left == 0).then_some(out)
}

#[cfg(test)]
mod qp_set_tests {
    use super::QpSet;

    /// Membership, order and removal (the last takes the removed one's
    /// place), as the link's round robin relies on.
    #[test]
    fn a_qp_set_keeps_each_qp_once_and_removes_in_place() {
        let mut s = QpSet::default();
        for q in [5, 7, 9, 7, 11] {
            s.insert(q);
        }
        assert_eq!((0..s.len()).filter_map(|i| s.get(i)).collect::<Vec<_>>(), vec![5, 7, 9, 11]);
        s.remove(7);
        s.remove(42);
        assert_eq!((0..s.len()).filter_map(|i| s.get(i)).collect::<Vec<_>>(), vec![5, 11, 9]);
        assert!(s.contains(11) && !s.contains(7));
        s.remove(9);
        s.remove(5);
        s.remove(11);
        assert!(s.is_empty());
        s.insert(3);
        assert_eq!(s.into_iter().collect::<Vec<_>>(), vec![3]);
    }
}
