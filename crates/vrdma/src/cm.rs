//! The connection manager: connect QPs by IP address and port, as
//! librdmacm does, through the daemon's connection manager.
//!
//! The daemon runs the exchange (REQ, REP, RTU, REJ, DREQ) and keeps the
//! host's port space. A QP attached to an id ([`CmId::attach_qp`]) is the
//! daemon's to move, as the kernel's CM moves an id's QP: to INIT when it
//! is attached, to RTR and RTS before an accept goes out, and on the
//! requester's side when the reply comes in, before the event is reported
//! as `Established` (the program never sees the `ConnectResponse`, as
//! with librdmacm when the id has a QP), and to ERR on disconnect. (Moved
//! from here, with the attributes of [`CmId::init_qp_attr`], each state
//! costs two control round trips, and a connection's setup waited on
//! about fifteen of them.) An id without a QP leaves its QP to the
//! program, which moves it with [`CmId::init_qp_attr`]'s attributes.
//!
//! A call whose event follows at once (a resolve's `AddrResolved` or
//! `RouteResolved`, and, on one host, an accept's `Established`) gets it
//! in its reply: the channel keeps it, and the program's next
//! `get_event` returns it without a round trip to the daemon (which
//! otherwise cost about a tenth of a connection's setup each). Its
//! wake-up stays in the channel's descriptor until then, so the
//! descriptor is readable exactly while events wait; a kept event goes
//! with its id when the id is destroyed, and moves with it on
//! [`CmId::migrate`] (there the new channel's `get_event` finds it, but
//! its descriptor does not show it: the wake-up was the old channel's).
//!
//! An event whose channel's descriptor holds nothing unread rides its
//! wake-up (`vrdma_core::proto::CARRIED_CM_EVENT`), and `get_event` reads
//! it there, with no round trip at all; the daemon keeps the others, each
//! behind a bare wake-up, for a `GetEvent` as above. So a carried wake-up
//! is always the oldest one, and the order holds. An event of an id
//! destroyed meanwhile is dropped there, as the daemon drops its kept
//! ones; one of an id moved to another channel moves with it.
//!
//! Where the daemon keeps several events behind bare wake-ups (a server
//! that many clients connect to at once, a client with many connects in
//! flight: rdma-core's `cmtime` issues 100 of each), the round trip that
//! fetches the oldest also takes the ones after it whose wake-ups are in
//! the descriptor (`CmRequest::GetEvents`, up to
//! `proto::MAX_CM_EVENTS`), and the channel keeps them as it keeps an
//! event that came in a call's reply: their wake-ups stay in the
//! descriptor until each is handed out, so it is readable exactly while
//! they wait, and each comes in its place. (cmtime's server asked 229
//! and 189 times in two runs for the 300 events of its 100 connections,
//! set up and torn down; now 7 and 25 times.) An older daemon answers
//! the request `EINVAL`, and the channel asks with `GetEvent` from then
//! on; a guest's port takes `GetEvent` only.
//!
//! Whatever events a reply hands over (a call's, `GetEvent`'s,
//! `GetEvents`') are kept before the control connection takes another
//! call (`control::Control::call_noting`), behind those kept before: the
//! daemon serves one connection's calls in order, so the channel's queue
//! is in the daemon's order whichever threads made the calls, and a
//! reader hands out the oldest (one moved here or made by the library,
//! then a carried one, then the queue's), not necessarily the one its own
//! fetch brought. An id's kept events go when it is destroyed, those a
//! fetch in flight brought too (they are kept before its `DestroyId` is
//! sent). A reply is checked before any of it is kept (`cm_reply`: the
//! counts of events and wake-ups, each event's fields, and that
//! `GetEvents` is answered with a list); one that cannot be right is an
//! error, and the channel is unusable from then on: what the reply stood
//! for is lost and its wake-ups may stay in the descriptor, which nothing
//! accounts for any more, so every later read fails with `EPROTO` at
//! once rather than find the descriptor readable with nothing to read.
//! (The daemon hands out at most `proto::MAX_CM_UNREAD` wake-ups a reply,
//! as the check wants.)
//!
//! A route needs nothing of the daemon once the program has read its
//! address's `AddrResolved`: [`CmId::resolve_route`] makes
//! `RouteResolved` here and rings the channel's descriptor (an epoll
//! instance over the doorbell and a wake-up of the library's own,
//! `cm_fd`), and the daemon learns of the route with the id's connect
//! (`CmRequest::ConnectRouted`) or before its next call that depends on
//! its state (`CmRequest::RouteReported`). It does so only while the
//! doorbell holds nothing unread, so that the event is read after every
//! event rung before it.
//!
//! Two more round trips of a connection's setup are folded away. Each
//! channel keeps a spare id, made ahead ([`CmId::create`]): its request
//! goes in the same message as the id's `rdma_resolve_addr` (a batch of
//! `ResolveAddr` then `CreateId`), or, before a call of another kind, on
//! its own with its reply read with the context's next call; and
//! [`CmId::create_qp_with_cq_and_connect`] and
//! [`CmId::create_qp_with_cq_and_accept`] send the QP's creation and the
//! connect or accept in one message (`CmRequest::Batch`, run in order,
//! stopping at the first call that fails), where the drop-in
//! `librdmacm.so.1`'s separate `rdma_create_qp` and `rdma_accept` still
//! take one round trip each.
//!
//! When the daemon goes away (it died or was restarted), each channel's
//! descriptor turns readable, and the channel reports
//! `DeviceRemoval` once for each of its ids that had a device (bound to
//! an address of it, resolved through it, or made by a connect request:
//! as the kernel's CM, ids with no address, and listeners on the wildcard
//! address, hear nothing), then fails with `ENODEV` instead of waiting.
//! The objects of the old context only fail from then on; a new
//! [`Context`] reaches the daemon that took its place.
//!
//! ```no_run
//! # fn main() -> vrdma::Result<()> {
//! use std::net::SocketAddrV4;
//! use vrdma::cm::{CmId, ConnParam, EventChannel, EventKind, PortSpace};
//!
//! let ctx = vrdma::Context::open()?;
//! let ch = EventChannel::create(&ctx)?;
//! let id = CmId::create(&ch, PortSpace::Tcp)?;
//! id.resolve_addr(None, "127.0.0.1:7471".parse::<SocketAddrV4>().unwrap())?;
//! assert_eq!(ch.get_event(None)?.map(|e| e.kind), Some(EventKind::AddrResolved));
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vrdma_core::proto::{CmBatchOp, CmReply, CmRequest, Reply, Request, MAX_CM_EVENTS};
use vrdma_shm::Doorbell;

pub use vrdma_core::cm::{reject, CmEvent, ConnInfo, EventKind, PortSpace, UD_QKEY};

use crate::cm_fd::ChannelFd;
use crate::cm_reply;
use crate::control;
use crate::{Context, Error, QpAttr, QpAttrMask, QpState, QueuePair, Result};

/// `struct rdma_conn_param`: what this side offers when it connects or
/// accepts. Its `qp_num` is taken from the attached QP where there is
/// one, and its `start_psn` is the daemon's to choose.
pub type ConnParam = ConnInfo;

/// The parameters as sent: with the QP's number, counts within 3 bits.
fn info(param: &ConnParam, qp_num: u32) -> ConnInfo {
    ConnInfo {
        qp_num,
        start_psn: 0,
        retry_count: param.retry_count.min(7),
        rnr_retry_count: param.rnr_retry_count.min(7),
        ..param.clone()
    }
}

fn call(ctx: &Context, req: CmRequest) -> Result<CmReply> {
    let req = Request::Cm(req);
    let answer = ctx.inner.control.call(&req, &[])?;
    match answer.reply {
        Reply::Cm(r) => Ok(r),
        other => Err(control::unexpected(&req, &other)),
    }
}

/// A destroy on behalf of a `Drop`, logging a failure (the daemon answers
/// the connection manager's destroys with its own kind of reply, not
/// `Done`).
fn destroy(ctx: &Context, req: CmRequest) {
    match call(ctx, req.clone()) {
        // Everything of the context went with the daemon.
        Err(e) if daemon_gone(&e) => tracing::debug!(request = ?req, "rdma_cm object of a daemon gone"),
        Err(e) => tracing::warn!(error = %e, request = ?req, "vrdma: destroying an rdma_cm object failed"),
        Ok(_) => {}
    }
}

/// Whether a control call failed because the daemon is gone.
fn daemon_gone(e: &Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(e, Error::Io(io) if matches!(io.kind(), K::ConnectionAborted | K::ConnectionReset | K::BrokenPipe | K::NotConnected))
}

/// Whether the daemon hung up the control connection, waiting up to
/// `timeout` for it (`None`: as long as it takes).
fn daemon_hung_up(control: &control::Control, timeout: Option<Duration>) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let ts = timeout.and_then(|d| Timespec::try_from(d).ok());
    let mut fds = [PollFd::from_borrowed_fd(control.hangup_fd(), PollFlags::RDHUP)];
    matches!(rustix::event::poll(&mut fds, ts.as_ref()), Ok(n) if n > 0)
        && fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
}

/// Largest event a wake-up carries: private data (196 bytes at most)
/// and two addresses in postcard, well below.
const CARRIED_MAX: usize = 2048;

/// An event kept in the library until the program reads it: one that
/// came in a call's reply (its wake-up still in the doorbell), one moved
/// here with its id (no wake-up here), or one the library made itself
/// (its wake-up is the library's own, [`ChannelFd`]). `None` where the
/// event went with its id (destroyed or moved); its wake-ups stay to be
/// taken.
struct Kept {
    event: Option<CmEvent>,
    /// Wake-ups in the daemon's doorbell it stands for.
    wakeups: u32,
    /// Whether it stands for one wake-up of the library's own.
    local: bool,
}

struct ChannelInner {
    ctx: Context,
    channel: u32,
    fd: Doorbell,
    /// What the program polls: the doorbell and the library's own wake-up.
    poll: ChannelFd,
    /// The QPs attached to this channel's ids (by number).
    qps: Mutex<HashMap<u32, u32>>,
    /// This channel's ids, and whether each has a device (what decides
    /// whether it hears DEVICE_REMOVAL).
    ids: Mutex<BTreeMap<u32, bool>>,
    /// Once the daemon is gone: the ids still to hear DEVICE_REMOVAL.
    removal: Mutex<Option<VecDeque<u32>>>,
    /// The ADDR_RESOLVED each id's program read (what its ROUTE_RESOLVED
    /// repeats, where the library resolves the route: see
    /// [`CmId::resolve_route`]).
    addr_events: Mutex<HashMap<u32, CmEvent>>,
    /// Events that came in the replies of the calls that made them (see
    /// the module's notes), oldest first, each with the wake-ups it
    /// stands for, still in the doorbell; `None` where the event went with
    /// its id (destroyed or moved).
    ready: Mutex<VecDeque<Kept>>,
    /// The id made ahead for the next [`CmId::create`] (see there).
    spare: Arc<Mutex<Spare>>,
    /// Whether the daemon is asked for the events queued behind the next
    /// one too (`CmRequest::GetEvents`, see [`EventChannel::try_read`]):
    /// not in a guest (its port takes `GetEvent`), nor once a daemon
    /// refused it (an older one).
    batch_events: AtomicBool,
    /// `GetEvent` and `GetEvents` calls made (for tests:
    /// [`EventChannel::event_calls`]).
    event_calls: AtomicU64,
    /// Why the channel is unusable, once a reply was refused
    /// ([`keep_reply`](Self::keep_reply)): every later read fails with
    /// `EPROTO` ([`check_usable`](Self::check_usable)), where it would
    /// spin on a descriptor readable for ever.
    broken: Mutex<Option<String>>,
}

/// A channel's spare id: made ahead with a request whose reply is read
/// with the next call's (`control::Control::send_deferred`), so that the
/// next `rdma_create_id` of its port space costs no round trip.
#[derive(Default)]
struct Spare {
    /// The id and its port space, once its reply was read.
    id: Option<(PortSpace, u32)>,
    /// Whether one was asked for and its reply is still unread.
    asked: bool,
    /// A spare of this port space is wanted and not asked for yet: it is
    /// asked for with the id's `rdma_resolve_addr`, in the same message
    /// ([`CmId::resolve_addr`]), or on its own before the context's next
    /// call of another kind ([`ChannelInner::settle_spare`]).
    wanted: Option<PortSpace>,
}

impl ChannelInner {
    fn set_device(&self, id: u32) {
        if let Some(d) = self.ids.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&id) {
            *d = true;
        }
    }

    /// After the daemon went away: the next DEVICE_REMOVAL, or `ENODEV`
    /// once each id with a device has had its own.
    fn removal_event(&self) -> Result<CmEvent> {
        let mut removal = self.removal.lock().unwrap_or_else(|p| p.into_inner());
        let left = removal.get_or_insert_with(|| {
            let ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
            ids.iter().filter(|(_, &device)| device).map(|(&id, _)| id).collect()
        });
        match left.pop_front() {
            Some(id) => Ok(CmEvent {
                ctx: vrdma_core::hca::ContextId(0),
                id,
                kind: EventKind::DeviceRemoval,
                status: 0,
                listen_id: None,
                peer: None,
                qkey: 0,
                local: None,
                remote: None,
            }),
            None => Err(Error::Daemon { errno: libc::ENODEV, message: "the vRDMA daemon went away".into() }),
        }
    }

    /// Keeps the events a reply hands over (a call's, or a batch's calls',
    /// `CmReply::Event`; `GetEvent`'s; `GetEvents`' list), with the
    /// wake-ups each stands for, after those kept before: the library
    /// hands them out from here, in order (see
    /// [`next_local`](Self::next_local)). Run before the connection takes
    /// another call (`Control::call_noting`), so that events are kept in
    /// the order the daemon handed them over, whichever thread made the
    /// call: kept after the control lock was let go, an accept's
    /// ESTABLISHED could come after the later events of a `GetEvent`
    /// another thread sent meanwhile (found in review, 2026-11-28). A
    /// reply that cannot be right (`cm_reply`) keeps nothing and is an
    /// error.
    ///
    /// A refused reply breaks the channel for good (see
    /// [`broken`](Self::broken)): what it said was lost, and the wake-ups
    /// it stood for stay in the descriptor, which no later reply accounts
    /// for (a reader would find the descriptor readable and nothing to
    /// read, for ever: found in review, 2026-11-28).
    fn keep_reply(&self, reply: &Reply, get_events_max: Option<u32>) -> Result<()> {
        let kept = self.check_and_keep(reply, get_events_max);
        if let Err(e) = &kept {
            tracing::warn!(channel = self.channel, error = %e, "an rdma_cm reply refused: the event channel is unusable");
            let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
            broken.get_or_insert_with(|| e.to_string());
        }
        kept
    }

    /// [`keep_reply`](Self::keep_reply)'s checks and keep.
    fn check_and_keep(&self, reply: &Reply, get_events_max: Option<u32>) -> Result<()> {
        let entries: Vec<(&Option<CmEvent>, u32)> = match reply {
            Reply::Cm(CmReply::Events { events }) => {
                let Some(max) = get_events_max else {
                    return Err(Error::protocol("an event list in the reply of another call than GetEvents"));
                };
                cm_reply::check_events(events, max)?;
                events.iter().map(|(e, w)| (e, *w)).collect()
            }
            // `GetEvents` is answered with a list only: another reply
            // kept unchecked could say any count of wake-ups (found in
            // review, 2026-11-28).
            _ if get_events_max.is_some() => {
                return Err(Error::protocol("GetEvents answered with something else than an event list"));
            }
            Reply::Cm(CmReply::Event { event, wakeups }) => vec![(event, *wakeups)],
            Reply::Batch { replies, .. } => replies
                .iter()
                .filter_map(|r| match r {
                    Reply::Cm(CmReply::Event { event, wakeups }) => Some((event, *wakeups)),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        if get_events_max.is_none() {
            let mut total: u32 = 0;
            for (event, wakeups) in &entries {
                // (A batch's replies together, as one reply's.)
                total = total.saturating_add(*wakeups);
                cm_reply::check_entry(event.as_ref(), *wakeups)?;
                cm_reply::check_entry(None, total)?;
            }
        }
        let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        for (event, wakeups) in entries {
            if event.is_some() || wakeups > 0 {
                ready.push_back(Kept { event: event.clone(), wakeups, local: false });
            }
        }
        Ok(())
    }

    /// An error if a refused reply broke the channel (see
    /// [`keep_reply`](Self::keep_reply)).
    fn check_usable(&self) -> Result<()> {
        match &*self.broken.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(Error::protocol(format!(
                "the rdma_cm event channel is unusable: a reply of the daemon was refused ({why})"
            ))),
            None => Ok(()),
        }
    }

    /// A call whose reply may hand over events: they are kept before the
    /// connection takes another call ([`keep_reply`](Self::keep_reply)).
    fn call_keeping(&self, req: &Request, get_events_max: Option<u32>) -> Result<control::Answer> {
        let (answer, kept) =
            self.ctx.inner.control.call_noting(req, &[], |reply| self.keep_reply(reply, get_events_max))?;
        kept.map(|()| answer)
    }

    /// Keeps `ev`, an event the library made itself, and rings the
    /// library's own wake-up for it, if the doorbell holds nothing unread
    /// (so that every event the daemon rang before is read before it: a
    /// wake-up the daemon rings meanwhile is no older than this call, and
    /// may be read first). `false`, keeping nothing, otherwise, or when the
    /// daemon went away: the caller asks the daemon then.
    fn keep_local(&self, ev: CmEvent) -> bool {
        let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        // (A hung-up doorbell is readable too.)
        if self.removed() || self.fd.is_readable() {
            return false;
        }
        ready.push_back(Kept { event: Some(ev), wakeups: 0, local: true });
        self.poll.ring();
        true
    }

    /// The oldest event kept, its wake-ups taken; with `unrung`, only one
    /// with no wake-up in the doorbell (moved here with its id, or made
    /// by the library), which is older than anything the doorbell holds.
    fn pop_ready(&self, ready: &mut VecDeque<Kept>, unrung: bool) -> Option<CmEvent> {
        // (One the library made has no wake-up in the doorbell either, and
        // is older than all it holds: the doorbell held nothing when it
        // was kept, and what was kept before it had no wake-up there.)
        while ready.front().is_some_and(|k| !unrung || k.wakeups == 0) {
            let kept = ready.pop_front()?;
            for _ in 0..kept.wakeups {
                self.fd.take_one();
            }
            if kept.local {
                self.poll.take_one();
            }
            if kept.event.is_some() {
                return kept.event;
            }
        }
        None
    }

    /// The next event the program reads without asking the daemon, in
    /// order: one moved here with its id or made by the library, then one
    /// carried by the doorbell's oldest wake-up, then one kept from a
    /// reply.
    fn next_local(&self) -> Result<Option<CmEvent>> {
        self.next_local_polled(true)
    }

    /// [`next_local`](Self::next_local), told whether the doorbell was
    /// readable a moment ago: if not, and nothing kept here stands for a
    /// wake-up in it, the peek is spared (a system call on each wait for
    /// an event). An event kept since the poll (another thread's reply)
    /// whose wake-up is in the doorbell may sit behind a carried one that
    /// came after the poll too (the daemon carries an event only into an
    /// empty doorbell, so that one is older): its wake-up is not the
    /// doorbell's first, and taking the first for it lost the carried
    /// event (found in review, 2026-11-28: a server's CONNECT_REQUEST
    /// gone, its client UNREACHABLE after its timeout).
    fn next_local_polled(&self, readable: bool) -> Result<Option<CmEvent>> {
        let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ev) = self.pop_ready(&mut ready, true) {
            return Ok(Some(ev));
        }
        // (What is left kept, if anything, has its wake-ups in the doorbell.)
        if readable || !ready.is_empty() {
            if let Some(ev) = self.take_carried(None)? {
                return Ok(Some(ev));
            }
        }
        Ok(self.pop_ready(&mut ready, false))
    }

    /// The event the descriptor's oldest wake-up carries, taken (of `id`
    /// only, if given); `None` where that wake-up is a bare one, or none
    /// waits. The daemon sends an event in its wake-up only into a
    /// descriptor that holds nothing unread (`proto::CARRIED_CM_EVENT`),
    /// so a carried one is always the oldest of the channel's, and the
    /// bare wake-ups after it are those of the events the daemon kept. An
    /// event of an id this channel no longer has (destroyed) is dropped,
    /// as the daemon drops its kept ones. (Called with `ready` locked, so
    /// that two readers never take one wake-up for another.)
    fn take_carried(&self, id: Option<u32>) -> Result<Option<CmEvent>> {
        let mut buf = [0u8; CARRIED_MAX];
        loop {
            let Some((len, truncated)) = self.fd.peek(&mut buf) else { return Ok(None) };
            let Some(decoded) = vrdma_core::proto::decode_carried_cm_event(&buf[..len]) else {
                return Ok(None);
            };
            if let (Some(id), Ok(ev)) = (id, &decoded) {
                if ev.id != id {
                    return Ok(None);
                }
            }
            self.fd.take_one();
            if truncated {
                return Err(Error::protocol(format!("an rdma_cm event of more than {CARRIED_MAX} bytes")));
            }
            let ev = decoded.map_err(|e| Error::protocol(format!("undecodable rdma_cm event: {e}")))?;
            let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
            if ids.contains_key(&ev.id) {
                return Ok(Some(ev));
            }
            // A request's new id is the program's from the moment it reads
            // the event (as `CmId::from_request` records it).
            if ev.kind == EventKind::ConnectRequest && ev.listen_id.is_some_and(|l| ids.contains_key(&l)) {
                ids.insert(ev.id, true);
                return Ok(Some(ev));
            }
        }
    }

    /// Takes `id`'s kept events out (their wake-ups stay to be taken).
    fn forget(&self, id: u32) -> Vec<CmEvent> {
        let mut ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        let mut gone = Vec::new();
        for kept in ready.iter_mut() {
            if kept.event.as_ref().is_some_and(|e| e.id == id) {
                gone.extend(kept.event.take());
            }
        }
        gone
    }

    /// Records an ADDR_RESOLVED the program is handed.
    fn note(&self, ev: Option<&CmEvent>) {
        if let Some(ev) = ev.filter(|e| e.kind == EventKind::AddrResolved && e.status == 0) {
            self.addr_events.lock().unwrap_or_else(|p| p.into_inner()).insert(ev.id, ev.clone());
        }
    }

    /// The ADDR_RESOLVED `id`'s program read, taken.
    fn take_addr_event(&self, id: u32) -> Option<CmEvent> {
        self.addr_events.lock().unwrap_or_else(|p| p.into_inner()).remove(&id)
    }

    fn removed(&self) -> bool {
        self.removal.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The spare id, if one of port space `ps` is made.
    fn take_spare(&self, ps: PortSpace) -> Option<u32> {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        match spare.id {
            Some((p, id)) if p == ps => {
                spare.id = None;
                Some(id)
            }
            _ => None,
        }
    }

    /// Notes that a spare of port space `ps` is wanted, unless the channel
    /// has or awaits one: asked for with the next `rdma_resolve_addr` (see
    /// [`CmId::resolve_addr`]), or before another call
    /// ([`settle_spare`](Self::settle_spare)).
    fn want_spare(&self, ps: PortSpace) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if !spare.asked && spare.id.is_none() && !self.removed() {
            spare.wanted = Some(ps);
        }
    }

    /// The spare wanted, taken, to be asked for in the caller's message;
    /// marked asked until [`spare_answered`](Self::spare_answered).
    fn take_wanted(&self) -> Option<PortSpace> {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let ps = spare.wanted.take()?;
        if spare.asked || spare.id.is_some() || self.removed() {
            return None;
        }
        spare.asked = true;
        Some(ps)
    }

    /// The outcome of a spare asked for with another call (`None`: not
    /// made, or its reply never came).
    fn spare_answered(&self, made: Option<(PortSpace, u32)>) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        spare.asked = false;
        if made.is_some() {
            spare.id = made;
        }
    }

    /// Asks now (a request sent ahead, as [`ask_spare`](Self::ask_spare))
    /// for a spare still wanted: before a call that does not carry the
    /// request itself.
    fn settle_spare(&self) {
        let wanted = self.spare.lock().unwrap_or_else(|p| p.into_inner()).wanted.take();
        if let Some(ps) = wanted {
            self.ask_spare(ps);
        }
    }

    /// Asks for a spare id of port space `ps`, unless the channel has or
    /// awaits one: the request goes now, its reply is read with the
    /// context's next call. Nothing is made where it cannot be sent (a
    /// guest's context, a broken connection) or the daemon refuses it
    /// (the tenant's id quota): `CmId::create` then asks and waits, and
    /// reports the daemon's error as always.
    fn ask_spare(&self, ps: PortSpace) {
        {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            if spare.asked || spare.id.is_some() || self.removed() {
                return;
            }
            spare.asked = true;
        }
        let into = self.spare.clone();
        let take: control::Deferred = Box::new(move |reply| {
            let mut spare = into.lock().unwrap_or_else(|p| p.into_inner());
            spare.asked = false;
            if let Some(Reply::Cm(CmReply::Id { id })) = reply {
                spare.id = Some((ps, id));
            }
        });
        let req = Request::Cm(CmRequest::CreateId { channel: self.channel, ps: ps.raw() });
        // (Not under `spare`'s lock: a call on another thread that reads
        // the reply takes it under the connection's.)
        if self.ctx.inner.control.send_deferred(&req, take).is_err() {
            self.spare.lock().unwrap_or_else(|p| p.into_inner()).asked = false;
        }
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // The spare id goes first: the daemon keeps a channel with ids.
        if !self.removed() && self.ctx.inner.control.flush_deferred().is_ok() {
            let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).id.take();
            if let Some((_, id)) = spare {
                destroy(&self.ctx, CmRequest::DestroyId { id });
            }
        }
        destroy(&self.ctx, CmRequest::DestroyChannel { channel: self.channel });
    }
}

/// `struct rdma_event_channel`: where the events of its ids arrive.
#[derive(Clone)]
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel").field("channel", &self.inner.channel).finish()
    }
}

impl EventChannel {
    /// `rdma_create_event_channel`.
    pub fn create(ctx: &Context) -> Result<EventChannel> {
        let req = Request::Cm(CmRequest::CreateChannel);
        let answer = ctx.inner.control.call(&req, &[])?;
        let Reply::Cm(CmReply::Channel { channel }) = answer.reply else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        let fd = answer.take_fds(1, "CmChannel").and_then(|fds| {
            fds.into_iter().next().ok_or_else(|| Error::protocol("CmChannel reply lacks its descriptor"))
        });
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) => {
                destroy(ctx, CmRequest::DestroyChannel { channel });
                return Err(e);
            }
        };
        let fd = Doorbell::from_fd(fd);
        let poll = match ChannelFd::new(&fd) {
            Ok(p) => p,
            Err(e) => {
                destroy(ctx, CmRequest::DestroyChannel { channel });
                return Err(e.into());
            }
        };
        let inner = ChannelInner {
            ctx: ctx.clone(),
            channel,
            fd,
            poll,
            qps: Mutex::default(),
            ids: Mutex::default(),
            removal: Mutex::default(),
            addr_events: Mutex::default(),
            ready: Mutex::default(),
            spare: Arc::default(),
            batch_events: AtomicBool::new(ctx.inner.control.guest_link().is_none()),
            event_calls: AtomicU64::new(0),
            broken: Mutex::default(),
        };
        let inner = Arc::new(inner);
        // A guest's channel moves with its VM: its library side is told.
        if let Some(link) = ctx.inner.control.guest_link() {
            let end: std::sync::Weak<dyn crate::guest::MovedCmChannel> = Arc::downgrade(&inner) as _;
            link.note_cm_channel(channel, end);
        }
        Ok(EventChannel { inner })
    }

    /// `rdma_event_channel.fd`: readable while an event waits (an epoll
    /// instance: see `cm_fd`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.poll.as_fd()
    }

    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// `rdma_get_cm_event`: the next event, waiting up to `timeout`
    /// (`None`: as long as it takes); `Ok(None)` when the time passed.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<Option<CmEvent>> {
        self.read(timeout).inspect(|ev| self.inner.note(ev.as_ref()))
    }

    /// How many times this channel asked the daemon for events
    /// (`GetEvent`, `GetEvents`): the reads that cost a round trip. For
    /// tests of the library's folding; not a stable interface.
    #[doc(hidden)]
    pub fn event_calls(&self) -> u64 {
        self.inner.event_calls.load(Ordering::Relaxed)
    }

    /// The next event if one waits.
    pub fn try_get_event(&self) -> Result<Option<CmEvent>> {
        self.try_read().inspect(|ev| self.inner.note(ev.as_ref()))
    }

    fn read(&self, timeout: Option<Duration>) -> Result<Option<CmEvent>> {
        let end = timeout.map(|t| Instant::now() + t);
        let control = &self.inner.ctx.inner.control;
        loop {
            self.inner.check_usable()?;
            // The daemon's end of the descriptor closed: the daemon went
            // away, or (it still answers) the program destroyed this
            // channel while waiting on it, where the kernel's wait goes on:
            // then only the daemon's going ends it.
            // (One poll says both.)
            let (readable, hung_up) = self.inner.fd.readable_and_hung_up();
            if self.inner.removed() || hung_up && daemon_hung_up(control, Some(Duration::ZERO)) {
                return self.inner.removal_event().map(Some);
            }
            if let Some(ev) = self.inner.next_local_polled(readable)? {
                return Ok(Some(ev));
            }
            // The descriptor is readable exactly while an event waits (the
            // daemon keeps it so): a round trip to the daemon is made only
            // when it is (and its oldest wake-up carries no event; asked
            // again, as the kept events just looked at may have taken the
            // wake-ups the poll saw).
            if !hung_up && readable && self.inner.fd.is_readable() {
                if let Some(ev) = self.try_read()? {
                    return Ok(Some(ev));
                }
            }
            let left = match end {
                Some(e) => match e.checked_duration_since(Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Ok(None),
                },
                None => None,
            };
            if hung_up {
                daemon_hung_up(control, left);
                continue;
            }
            match control.wait_fd_readable(self.inner.poll.as_fd(), left) {
                Ok(_) => {}
                Err(e) if daemon_gone(&e) => return self.inner.removal_event().map(Some),
                Err(e) => return Err(e),
            }
        }
    }

    fn try_read(&self) -> Result<Option<CmEvent>> {
        self.inner.check_usable()?;
        if self.inner.removed() {
            return self.inner.removal_event().map(Some);
        }
        if let Some(ev) = self.inner.next_local()? {
            return Ok(Some(ev));
        }
        match self.fetch() {
            Ok(()) => {}
            Err(e) if daemon_gone(&e) => return self.inner.removal_event().map(Some),
            Err(e) => return Err(e),
        }
        // The events fetched are kept behind any kept before (older: see
        // `keep_reply`), their wake-ups still in the descriptor, and come
        // out as those do: after one moved here or made by the library,
        // and after a carried one the descriptor took meanwhile (the
        // daemon carries an event only into an empty descriptor, so that
        // one is older than all the fetched ones, whose wake-ups are
        // behind it: taking the first wake-ups for them lost it, found in
        // review, 2026-11-28). (Another reader of the channel may take
        // them first: then there is nothing for this one.)
        self.inner.next_local()
    }

    /// Asks the daemon for the channel's next events, which are kept (see
    /// `ChannelInner::keep_reply`): with `GetEvents` (up to
    /// `MAX_CM_EVENTS`: those queued behind the first whose wake-ups are
    /// in the descriptor come in the same round trip, where each took one
    /// of its own), or with `GetEvent` where the daemon is an older one,
    /// which answers `GetEvents` `EINVAL` (from then on), or in a guest
    /// (its port takes `GetEvent` only).
    fn fetch(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.batch_events.load(Ordering::Relaxed) {
            let req = Request::Cm(CmRequest::GetEvents { channel: inner.channel, max: MAX_CM_EVENTS });
            inner.event_calls.fetch_add(1, Ordering::Relaxed);
            let answer = match inner.call_keeping(&req, Some(MAX_CM_EVENTS)) {
                // An older daemon, which knows no `GetEvents` (a failure
                // `GetEvent` would report comes again from it).
                Err(Error::Daemon { errno: libc::EINVAL, .. }) => {
                    inner.batch_events.store(false, Ordering::Relaxed);
                    None
                }
                r => Some(r?),
            };
            if let Some(answer) = answer {
                return match answer.reply {
                    Reply::Cm(CmReply::Events { .. }) => Ok(()),
                    other => Err(control::unexpected(&req, &other)),
                };
            }
        }
        let req = Request::Cm(CmRequest::GetEvent { channel: inner.channel });
        inner.event_calls.fetch_add(1, Ordering::Relaxed);
        let answer = inner.call_keeping(&req, None)?;
        match answer.reply {
            Reply::Cm(CmReply::Event { .. }) => Ok(()),
            other => Err(control::unexpected(&req, &other)),
        }
    }
}

fn init_qp_attr(ctx: &Context, id: u32, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
    match call(ctx, CmRequest::InitQpAttr { id, state })? {
        CmReply::QpAttr { attr, mask } => Ok((attr, mask)),
        _ => Err(Error::protocol("InitQpAttr answered with something else")),
    }
}

/// Whether a listener of this context's tenant takes requests for `addr`
/// (rdma_cm listeners show in no socket table: this is how a program, or
/// a test, learns that a server it started listens).
pub fn is_listening(ctx: &Context, ps: PortSpace, addr: SocketAddrV4) -> Result<bool> {
    match call(ctx, CmRequest::HasListener { ps: ps.raw(), addr })? {
        CmReply::Listening(yes) => Ok(yes),
        _ => Err(Error::protocol("HasListener answered with something else")),
    }
}

/// A batch's outcome: its error says too whether the calls after the
/// first may have run (see `CmId::create_qp_with_cq_then`).
type BatchOutcome<T> = std::result::Result<T, (Error, bool)>;

/// What the library knows of an id's route (see
/// [`CmId::resolve_route`]).
#[derive(Debug, Clone)]
enum Route {
    /// Nothing: a resolution asks the daemon.
    Ask,
    /// The id's address was resolved (the daemon's `ResolveAddr`
    /// succeeded, which leaves the id in ADDR_RESOLVED, its event made)
    /// and no call since moved it: its route is the library's to resolve
    /// once the program read that event.
    Resolvable,
    /// Resolved here and reported to the program; the daemon learns it
    /// with the id's next call that depends on it
    /// (`CmRequest::RouteReported`, `ConnectRouted`).
    Reported,
}

/// `struct rdma_cm_id`: one end of a connection, or a listener.
pub struct CmId {
    channel: EventChannel,
    id: u32,
    ps: PortSpace,
    route: Mutex<Route>,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId").field("id", &self.id).field("ps", &self.ps).finish()
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        self.channel.inner.ids.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        // Its events not yet read go with it, as the kernel's do.
        self.channel.inner.forget(self.id);
        self.channel.inner.take_addr_event(self.id);
        if self.channel.inner.removed() {
            return; // the daemon, and the id with it, are gone
        }
        destroy(&self.channel.inner.ctx, CmRequest::DestroyId { id: self.id });
        // And those a fetch in flight on another thread brought (the
        // daemon sent them before it destroyed the id): they were kept
        // before the destroy was sent (`ChannelInner::keep_reply`), so
        // they are found now, and never handed out (found in review).
        self.channel.inner.forget(self.id);
    }
}

impl CmId {
    /// `rdma_create_id`.
    ///
    /// Each channel keeps one id made ahead (a spare, of the port space
    /// last asked for): the call takes it where there is one, with no
    /// round trip, and the next is asked for with this id's
    /// [`resolve_addr`](Self::resolve_addr), in its message (the
    /// daemon's `ResolveAddr` then `CreateId`: one round trip of a
    /// connection's setup saved, and no message of its own), or, if
    /// another call of the channel's ids or another create comes first,
    /// before it, without waiting for the daemon's reply, which is read
    /// with the context's next call. The first call of a channel,
    /// of another port space, or after the daemon refused a spare (the
    /// tenant's id quota, which a spare counts against) waits as before,
    /// and fails with the daemon's error.
    pub fn create(channel: &EventChannel, ps: PortSpace) -> Result<CmId> {
        // (One wanted by an id that made no call since goes now: a program
        // that makes ids in a row still finds every other one made.)
        channel.inner.settle_spare();
        let id = match channel.inner.take_spare(ps) {
            Some(id) => id,
            None => {
                let req = CmRequest::CreateId { channel: channel.inner.channel, ps: ps.raw() };
                let CmReply::Id { id } = call(&channel.inner.ctx, req)? else {
                    return Err(Error::protocol("CreateId answered with something else"));
                };
                id
            }
        };
        channel.inner.ids.lock().unwrap_or_else(|p| p.into_inner()).insert(id, false);
        channel.inner.want_spare(ps);
        Ok(CmId { channel: channel.clone(), id, ps, route: Mutex::new(Route::Ask) })
    }

    /// The id a `ConnectRequest` event made; the program owns it from now.
    pub fn from_request(channel: &EventChannel, ev: &CmEvent, ps: PortSpace) -> Result<CmId> {
        if ev.kind != EventKind::ConnectRequest {
            return Err(Error::Daemon { errno: libc::EINVAL, message: "not a connect request".into() });
        }
        channel.inner.ids.lock().unwrap_or_else(|p| p.into_inner()).insert(ev.id, true);
        Ok(CmId { channel: channel.clone(), id: ev.id, ps, route: Mutex::new(Route::Ask) })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn port_space(&self) -> PortSpace {
        self.ps
    }

    /// A call of this id's: an event its reply hands over (a resolve's,
    /// an accept's: see the module's notes) is kept before the connection
    /// takes another call (`ChannelInner::keep_reply`).
    fn call(&self, req: CmRequest) -> Result<CmReply> {
        self.channel.inner.settle_spare();
        let req = Request::Cm(req);
        let answer = self.channel.inner.call_keeping(&req, None)?;
        match answer.reply {
            Reply::Cm(r) => Ok(r),
            other => Err(control::unexpected(&req, &other)),
        }
    }

    fn route(&self) -> std::sync::MutexGuard<'_, Route> {
        self.route.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A call whose outcome depends on the id's state: a route resolved
    /// here is told to the daemon first (a round trip, off the usual
    /// path: a connect carries it instead), so that the call meets the
    /// state the program was told of. The call may move the id, so the
    /// route is the daemon's to resolve after it.
    fn call_settled(&self, req: CmRequest) -> Result<CmReply> {
        let mut route = self.route();
        if matches!(*route, Route::Reported) {
            self.call(CmRequest::RouteReported { id: self.id })?;
        }
        *route = Route::Ask;
        self.call(req)
    }

    /// `rdma_migrate_id`: the id's next events go to `channel`, another
    /// channel of the same context (those already queued stay where they
    /// are).
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<()> {
        self.call(CmRequest::MigrateId { id: self.id, channel: channel.inner.channel })?;
        // Its kept events move with it (their wake-ups stay in the old
        // channel's doorbell, taken there: the new channel's descriptor
        // does not show these, though its get_event finds them), after
        // one its old descriptor carries, which is older. Before them, the
        // new channel's own carried event, older still, is taken out of
        // its descriptor (which then does not show it either), so that
        // the order holds.
        let other = !Arc::ptr_eq(&self.channel.inner, &channel.inner);
        let mut moved: Vec<CmEvent> = Vec::new();
        if other {
            let _old = self.channel.inner.ready.lock().unwrap_or_else(|p| p.into_inner());
            moved.extend(self.channel.inner.take_carried(Some(self.id))?);
        }
        moved.extend(self.channel.inner.forget(self.id));
        if !moved.is_empty() {
            let mut ready = channel.inner.ready.lock().unwrap_or_else(|p| p.into_inner());
            if other && ready.is_empty() {
                if let Some(ev) = channel.inner.take_carried(None)? {
                    ready.push_back(Kept { event: Some(ev), wakeups: 0, local: false });
                }
            }
            ready.extend(moved.into_iter().map(|ev| Kept { event: Some(ev), wakeups: 0, local: false }));
        }
        let qp = self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        if let Some(qpn) = qp {
            channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, qpn);
        }
        if let Some(ev) = self.channel.inner.take_addr_event(self.id) {
            channel.inner.addr_events.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, ev);
        }
        let device = self.channel.inner.ids.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
        channel.inner.ids.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, device.unwrap_or(false));
        self.channel = channel.clone();
        Ok(())
    }

    /// `rdma_set_option(RDMA_OPTION_ID_REUSEADDR)`.
    pub fn set_reuseaddr(&self, reuse: bool) -> Result<()> {
        self.call_settled(CmRequest::SetReuseAddr { id: self.id, reuse }).map(drop)
    }

    /// `rdma_bind_addr`; returns the address bound (its port chosen if 0).
    pub fn bind(&self, addr: SocketAddrV4) -> Result<SocketAddrV4> {
        self.call_settled(CmRequest::Bind { id: self.id, addr })?;
        if !addr.ip().is_unspecified() {
            self.channel.inner.set_device(self.id);
        }
        self.local_addr()?.ok_or_else(|| Error::protocol("bound, but no address"))
    }

    /// `rdma_resolve_addr`; `AddrResolved` follows on the channel.
    ///
    /// Where the channel wants a spare id (see [`CmId::create`]), its
    /// request goes in the same message (`CmRequest::Batch` of
    /// `ResolveAddr` then `CreateId`: a resolve that fails makes none),
    /// so that the spare costs the daemon no message, and the library no
    /// read, of its own. The resolve's outcome and errors are those of
    /// the call alone; a spare the daemon refuses is not made (the next
    /// `rdma_create_id` asks and waits, as always).
    pub fn resolve_addr(&self, src: Option<SocketAddrV4>, dst: SocketAddrV4) -> Result<()> {
        let batched = {
            let route = self.route();
            let inner = &self.channel.inner;
            (!matches!(*route, Route::Reported) && inner.ctx.inner.control.guest_link().is_none())
                .then(|| inner.take_wanted())
                .flatten()
        };
        // (The event its reply carries, if any, is kept.)
        match batched {
            Some(ps) => self.resolve_addr_and_spare(src, dst, ps)?,
            None => self.call_settled(CmRequest::ResolveAddr { id: self.id, src, dst })?,
        };
        self.channel.inner.set_device(self.id);
        *self.route() = Route::Resolvable;
        Ok(())
    }

    /// `ResolveAddr` and the channel's spare of port space `ps` in one
    /// round trip (see [`resolve_addr`](Self::resolve_addr)): the
    /// resolve's reply, or its error as it would have come alone.
    fn resolve_addr_and_spare(
        &self,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
        ps: PortSpace,
    ) -> Result<CmReply> {
        let inner = &self.channel.inner;
        // (As `call_settled`: the route was not the library's, and the
        // resolve may move the id.)
        *self.route() = Route::Ask;
        let ops = vec![
            CmBatchOp::ResolveAddr { id: self.id, src, dst },
            CmBatchOp::CreateId { channel: inner.channel, ps: ps.raw() },
        ];
        let req = Request::Cm(CmRequest::Batch { ops });
        // (The resolve's event, if its reply carries one, is kept.)
        let answer = match inner.call_keeping(&req, None) {
            Ok(a) => a,
            Err(e) => {
                inner.spare_answered(None);
                return Err(e);
            }
        };
        let (mut replies, failed) = match answer.reply {
            Reply::Batch { replies, failed } => (replies.into_iter(), failed),
            other => {
                inner.spare_answered(None);
                return Err(control::unexpected(&req, &other));
            }
        };
        let resolved = match (replies.next(), failed) {
            (Some(Reply::Error { errno, message }), Some(0)) => {
                inner.spare_answered(None);
                // The resolve's own error, as it reads when sent alone.
                let message = match message.strip_prefix("call 0 of the batch: ") {
                    Some(m) => m.to_string(),
                    None => message,
                };
                return Err(Error::Daemon { errno, message });
            }
            (Some(Reply::Cm(r)), _) => r,
            (other, _) => {
                inner.spare_answered(None);
                return Err(Error::protocol(format!("a resolve's batch answered {other:?} first")));
            }
        };
        match (replies.next(), failed) {
            (Some(Reply::Cm(CmReply::Id { id })), None) => inner.spare_answered(Some((ps, id))),
            // The daemon refused the spare (the tenant's id quota): none.
            (Some(Reply::Error { .. }), Some(1)) => inner.spare_answered(None),
            (other, _) => {
                inner.spare_answered(None);
                return Err(Error::protocol(format!("a resolve's batch answered {other:?} second")));
            }
        }
        Ok(resolved)
    }

    /// `rdma_resolve_route`; `RouteResolved` follows.
    ///
    /// Where [`resolve_addr`](Self::resolve_addr) succeeded (the daemon
    /// resolves an address at once) and the program read its
    /// `AddrResolved`, the route is resolved here, with no round trip: the daemon's resolution needs nothing more (it only
    /// checks the id's state, which the library knows, and its event
    /// carries the address event's addresses), and the daemon hears of it
    /// with the id's next call that depends on it (the connect says so in
    /// the same message, `CmRequest::ConnectRouted`). Its event is kept
    /// here and rings the channel's descriptor through the library's own
    /// wake-up, if the daemon's doorbell holds nothing unread (so that it
    /// comes after every event rung before it); otherwise, or once the
    /// daemon is gone, the daemon is asked, as always.
    pub fn resolve_route(&self) -> Result<()> {
        let mut route = self.route();
        if matches!(*route, Route::Resolvable) {
            if let Some(addr) = self.channel.inner.take_addr_event(self.id) {
                let ev = CmEvent { kind: EventKind::RouteResolved, ..addr };
                if self.channel.inner.keep_local(ev) {
                    *route = Route::Reported;
                    return Ok(());
                }
            }
        }
        drop(route);
        self.call_settled(CmRequest::ResolveRoute { id: self.id })?;
        Ok(())
    }

    /// `rdma_listen`.
    pub fn listen(&self, backlog: i32) -> Result<()> {
        self.call_settled(CmRequest::Listen { id: self.id, backlog }).map(drop)
    }

    /// (`rdma_get_local_addr`, `rdma_get_peer_addr`) in one call.
    pub fn addrs(&self) -> Result<(Option<SocketAddrV4>, Option<SocketAddrV4>)> {
        match self.call(CmRequest::QueryAddr { id: self.id })? {
            CmReply::Addrs { local, remote } => Ok((local, remote)),
            _ => Err(Error::protocol("QueryAddr answered with something else")),
        }
    }

    /// `rdma_get_local_addr`.
    pub fn local_addr(&self) -> Result<Option<SocketAddrV4>> {
        Ok(self.addrs()?.0)
    }

    /// `rdma_get_peer_addr`.
    pub fn peer_addr(&self) -> Result<Option<SocketAddrV4>> {
        Ok(self.addrs()?.1)
    }

    /// `rdma_init_qp_attr`.
    pub fn init_qp_attr(&self, state: QpState) -> Result<(QpAttr, QpAttrMask)> {
        init_qp_attr(&self.channel.inner.ctx, self.id, state)
    }

    /// `rdma_create_qp`: a QP of `pd` made and attached to this id in one
    /// call to the daemon ([`attach_qp`](Self::attach_qp) of a QP made
    /// apart takes two). If the attach fails, the QP is destroyed and
    /// this fails with the attach's error.
    pub fn create_qp(&self, pd: &crate::ProtectionDomain, init: &crate::QpInit<'_>) -> Result<QueuePair> {
        let qp = QueuePair::create_for(pd, init, Some(self.id))?;
        self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, qp.qpn());
        Ok(qp)
    }

    /// `rdma_create_qp` with no CQs given (rdma-core then makes them):
    /// a CQ of at least `cqe` entries, and a QP of `pd` of `qp_type` with
    /// `cap` that completes into it (sends and receives), attached to this
    /// id, in one call to the daemon ([`Context::create_cq`] and
    /// [`create_qp`](Self::create_qp) take two). If any part fails, the
    /// daemon destroys what it made and this fails with that error.
    ///
    /// [`Context::create_cq`]: crate::Context::create_cq
    pub fn create_qp_with_cq(
        &self,
        pd: &crate::ProtectionDomain,
        qp_type: crate::QpType,
        cqe: u32,
        cap: crate::QpCap,
    ) -> Result<(crate::CompletionQueue, QueuePair)> {
        let ctx = pd.context();
        if !Arc::ptr_eq(&ctx.inner, &self.channel.inner.ctx.inner) {
            return Err(Error::invalid("the PD belongs to another context than the id's channel"));
        }
        let attr = crate::QpInitAttr { qp_type, send_cq: 0, recv_cq: 0, srq: None, cap, sq_sig_all: false };
        let req = Request::Cm(CmRequest::CreateQpWithCq { id: self.id, pd: pd.pd_id(), cqe, init: attr });
        let answer = ctx.inner.control.call(&req, &[])?;
        self.cq_qp_made(pd, &req, attr, answer)
    }

    /// The CQ and QP of a `Reply::CqQp` (`answer`, of `req`), attached to
    /// this id; if they cannot be used, the daemon's objects are
    /// destroyed.
    fn cq_qp_made(
        &self,
        pd: &crate::ProtectionDomain,
        req: &Request,
        attr: crate::QpInitAttr,
        answer: control::Answer,
    ) -> Result<(crate::CompletionQueue, QueuePair)> {
        let ctx = pd.context();
        let Reply::CqQp { cq, depth, cq_segment_len, cq_ring, created, segment_len, sq, rq, inbox } =
            answer.reply
        else {
            return Err(control::unexpected(req, &answer.reply));
        };
        let qpn = created.qpn;
        let mut placed = match answer.take_rings(2, "CqQp") {
            Ok(p) => p.into_iter(),
            Err(e) => {
                // Nothing of it is ours to use: the daemon's objects go.
                ctx.inner.control.destroy(Request::DestroyQp { qp: qpn });
                ctx.inner.control.destroy(Request::DestroyCq { cq });
                return Err(e);
            }
        };
        let (cq_fd, qp_fd) = (placed.next(), placed.next());
        let missing = || Error::protocol("CqQp reply lacks a descriptor");
        let cq = match crate::CompletionQueue::from_reply(
            ctx,
            None,
            (cq, depth, cq_segment_len, cq_ring),
            cq_fd.ok_or_else(missing),
        ) {
            Ok(cq) => cq,
            Err(e) => {
                // (`from_reply` destroyed the CQ; its QP goes first.)
                ctx.inner.control.destroy(Request::DestroyQp { qp: qpn });
                return Err(e);
            }
        };
        let (qp_type, cap) = (attr.qp_type, attr.cap);
        let attr = crate::QpInitAttr { send_cq: cq.cqn(), recv_cq: cq.cqn(), ..attr };
        let init = crate::QpInit { qp_type, send_cq: &cq, recv_cq: &cq, srq: None, cap, sq_sig_all: false };
        let made = crate::qp::QpMade { created, segment_len, sq, rq, inbox };
        let qp = QueuePair::from_reply(pd, &init, attr, made, qp_fd.ok_or_else(missing))?;
        self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, qpn);
        Ok((cq, qp))
    }

    /// [`create_qp_with_cq`](Self::create_qp_with_cq), then `then` (calls
    /// on this id that need nothing of the creation's reply), in one
    /// round trip (`CmRequest::Batch`): the CQ and QP, and the replies of
    /// `then`. If a call of `then` fails, the CQ and QP are destroyed and
    /// this fails with that call's error (the daemon ran none after it).
    /// The error says too whether `then` may have run (`false`: the
    /// creation failed, and the daemon ran nothing after it).
    fn create_qp_with_cq_then(
        &self,
        pd: &crate::ProtectionDomain,
        qp_type: crate::QpType,
        cqe: u32,
        cap: crate::QpCap,
        then: Vec<CmBatchOp>,
    ) -> BatchOutcome<((crate::CompletionQueue, QueuePair), Vec<CmReply>)> {
        let ctx = pd.context();
        if !Arc::ptr_eq(&ctx.inner, &self.channel.inner.ctx.inner) {
            return Err((Error::invalid("the PD belongs to another context than the id's channel"), false));
        }
        let attr = crate::QpInitAttr { qp_type, send_cq: 0, recv_cq: 0, srq: None, cap, sq_sig_all: false };
        let mut ops = vec![CmBatchOp::CreateQpWithCq { id: self.id, pd: pd.pd_id(), cqe, init: attr }];
        let calls = 1 + then.len();
        ops.extend(then);
        let req = Request::Cm(CmRequest::Batch { ops });
        // (Where the call breaks, the daemon's state is not known: the
        // calls after the creation count as run.)
        // (An accept's event, if its reply carries one, is kept.)
        let control::Answer { reply, fds, offsets, rings } =
            self.channel.inner.call_keeping(&req, None).map_err(|e| (e, true))?;
        let Reply::Batch { replies, failed } = reply else {
            return Err((control::unexpected(&req, &reply), true));
        };
        let mut replies = replies.into_iter();
        let made = match replies.next() {
            Some(Reply::Error { errno, message }) if failed == Some(0) => {
                return Err((Error::Daemon { errno, message }, false))
            }
            Some(first) => self
                .cq_qp_made(pd, &req, attr, control::Answer { reply: first, fds, offsets, rings })
                .map_err(|e| (e, true))?,
            None => return Err((Error::protocol("an empty reply to a batch"), true)),
        };
        let mut answered = Vec::with_capacity(calls - 1);
        for reply in replies {
            match reply {
                Reply::Error { errno, message } if failed.is_some() => {
                    // The CQ and QP go (dropped: destroyed), and the id's
                    // record of its QP with them.
                    self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
                    return Err((Error::Daemon { errno, message }, true));
                }
                Reply::Cm(r) => answered.push(r),
                other => return Err((control::unexpected(&req, &other), true)),
            }
        }
        if failed.is_some() || answered.len() + 1 != calls {
            let n = answered.len() + 1;
            return Err((
                Error::protocol(format!("a batch of {calls} calls answered with {n} replies")),
                true,
            ));
        }
        Ok((made, answered))
    }

    /// [`create_qp_with_cq`](Self::create_qp_with_cq) then
    /// [`accept`](Self::accept), in one round trip to the daemon where
    /// they were two (a connection's passive side: `rdma_create_qp`
    /// given no CQs, then `rdma_accept`). The accept carries the new QP's
    /// number (the daemon takes it from the attached QP). If the accept
    /// fails, the CQ and QP are destroyed and this fails with its error.
    pub fn create_qp_with_cq_and_accept(
        &self,
        pd: &crate::ProtectionDomain,
        qp_type: crate::QpType,
        cqe: u32,
        cap: crate::QpCap,
        param: &ConnParam,
    ) -> Result<(crate::CompletionQueue, QueuePair)> {
        if pd.context().inner.control.guest_link().is_some() {
            // A guest's port takes one call at a time.
            let made = self.create_qp_with_cq(pd, qp_type, cqe, cap)?;
            self.accept(param)?;
            return Ok(made);
        }
        let qkey = if self.ps.is_ud() { UD_QKEY } else { 0 };
        let mut then = Vec::with_capacity(2);
        let mut route = self.route();
        if matches!(*route, Route::Reported) {
            then.push(CmBatchOp::RouteReported { id: self.id });
        }
        then.push(CmBatchOp::Accept { id: self.id, conn: info(param, param.qp_num), qkey });
        // (The accept's event, if its reply carried one, is kept.)
        let (made, _) =
            self.settle_with(&mut route, self.create_qp_with_cq_then(pd, qp_type, cqe, cap, then))?;
        Ok(made)
    }

    /// [`create_qp_with_cq`](Self::create_qp_with_cq) then
    /// [`connect`](Self::connect), in one round trip to the daemon where
    /// they were two (`rdma_create_qp` given no CQs, then
    /// `rdma_connect`); the connect carries the new QP's number (the
    /// daemon takes it from the attached QP). If the connect fails, the
    /// CQ and QP are destroyed and this fails with its error.
    pub fn create_qp_with_cq_and_connect(
        &self,
        pd: &crate::ProtectionDomain,
        qp_type: crate::QpType,
        cqe: u32,
        cap: crate::QpCap,
        param: &ConnParam,
    ) -> Result<(crate::CompletionQueue, QueuePair)> {
        if pd.context().inner.control.guest_link().is_some() {
            let made = self.create_qp_with_cq(pd, qp_type, cqe, cap)?;
            self.connect(param)?;
            return Ok(made);
        }
        let (id, conn) = (self.id, info(param, param.qp_num));
        let mut route = self.route();
        let op = match *route {
            Route::Reported => CmBatchOp::ConnectRouted { id, conn },
            _ => CmBatchOp::Connect { id, conn },
        };
        let (made, _) =
            self.settle_with(&mut route, self.create_qp_with_cq_then(pd, qp_type, cqe, cap, vec![op]))?;
        Ok(made)
    }

    /// The outcome of a batch that carried this id's route where the
    /// library resolved it: from then on the route is the daemon's, unless
    /// the batch failed before the calls that carried it ran.
    fn settle_with<T>(&self, route: &mut Route, outcome: std::result::Result<T, (Error, bool)>) -> Result<T> {
        match outcome {
            Ok(t) => {
                *route = Route::Ask;
                Ok(t)
            }
            Err((e, ran)) => {
                if ran {
                    *route = Route::Ask;
                }
                Err(e)
            }
        }
    }

    /// `rdma_create_qp`'s second half: `qp` becomes this id's, in INIT;
    /// the daemon brings it up from there (see the module's notes).
    pub fn attach_qp(&self, qp: &QueuePair) -> Result<()> {
        self.attach_qp_num(qp.qpn())
    }

    /// [`attach_qp`](Self::attach_qp) by number: a QP of this context or
    /// of another context of the same tenant (the drop-in
    /// `librdmacm.so.1` attaches the QPs of the program's
    /// `libibverbs.so.1`, which has a context of its own). One call; the
    /// daemon moves the QP from then on, as for `attach_qp`.
    pub fn attach_qp_num(&self, qpn: u32) -> Result<()> {
        self.call(CmRequest::AttachQp { id: self.id, qp: qpn })?;
        self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).insert(self.id, qpn);
        Ok(())
    }

    /// The number of the attached QP.
    fn qp(&self) -> Option<u32> {
        self.channel.inner.qps.lock().unwrap_or_else(|p| p.into_inner()).get(&self.id).copied()
    }

    /// `rdma_connect`.
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let qpn = self.qp().unwrap_or(param.qp_num);
        let (id, conn) = (self.id, info(param, qpn));
        let mut route = self.route();
        let req = match *route {
            // The route resolved here goes with the connect.
            Route::Reported => CmRequest::ConnectRouted { id, conn },
            _ => CmRequest::Connect { id, conn },
        };
        *route = Route::Ask;
        self.call(req).map(drop)
    }

    /// `rdma_accept` of a connect request: the daemon moves an attached
    /// QP to RTR and RTS (with `param`'s responder resources and
    /// initiator depth) before the reply goes out, as librdmacm does. A UD
    /// id answers with `qkey`.
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let qpn = self.qp().unwrap_or(param.qp_num);
        let qkey = if self.ps.is_ud() { UD_QKEY } else { 0 };
        self.call_settled(CmRequest::Accept { id: self.id, conn: info(param, qpn), qkey })?;
        Ok(())
    }

    /// `rdma_establish`: after a `ConnectResponse` on an id without a QP.
    pub fn establish(&self) -> Result<()> {
        self.call_settled(CmRequest::Establish { id: self.id }).map(drop)
    }

    /// `rdma_reject`.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        self.call_settled(CmRequest::Reject { id: self.id, private_data: private_data.to_vec() }).map(drop)
    }

    /// `rdma_disconnect`: the attached QP goes to ERR (its work is
    /// flushed; the daemon moves it), and both sides get `Disconnected`.
    pub fn disconnect(&self) -> Result<()> {
        self.call_settled(CmRequest::Disconnect { id: self.id }).map(drop)
    }
}

impl crate::guest::MovedCmChannel for ChannelInner {
    fn moved(&self, ring: &mut dyn FnMut(usize)) -> (usize, usize) {
        let ready = self.ready.lock().unwrap_or_else(|p| p.into_inner());
        let mut dropped = 0;
        while self.fd.take_one() {
            dropped += 1;
        }
        let kept: usize = ready.iter().map(|k| k.wakeups as usize).sum();
        ring(kept);
        (dropped, kept)
    }
}
