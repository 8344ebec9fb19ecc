//! The connection manager's driver: the core's [`ConnectionManager`] on
//! the engine thread, its events delivered to the tenants' event channels,
//! its messages carried to the manager they are for.
//!
//! The engine's state holds it, as it holds the HCA, so that the exchange
//! between two processes of this host needs no other lock and no other
//! thread: a tenant's call runs on its session thread under the engine's
//! lock (`engine::handle`), and what the call set off is done within it.
//! A message for an address of this host is handed straight back to the
//! manager; one for another host rides the authenticated link to that
//! host's daemon (a connection manager's frame, `docs/wire-protocol.md`),
//! dialled for it if need be. Where it cannot go (the transport is off,
//! the host is outside `net.allow`, the dial fails, the link goes down),
//! the connections with that host end at once (UNREACHABLE before they
//! are established, DISCONNECTED after), and the daemon says why in its
//! log.
//!
//! An id with a QP attached (`CmRequest::AttachQp`) has its QP moved
//! here, as the kernel's CM moves it: to RTR and RTS before an accept's
//! REP goes out, to RTR and RTS when the REP comes in (then the RTU goes,
//! and the event is ESTABLISHED), to ERR on disconnect. Done by the
//! library instead, each state is two control round trips (its attributes,
//! then the modify), and a connection's setup paid for about fifteen of
//! them on the path between the two sides.

mod migrate;

use std::collections::{HashMap, VecDeque};

use std::net::Ipv4Addr;

use vrdma_core::cm::{CmError, CmEvent, CmMessage, ConnInfo, ConnectionManager, EventKind, PortSpace, State};
use vrdma_core::hca::{ContextId, HcaError, LinkId, TenantId};
use vrdma_core::limited_warn;
use vrdma_core::log_limit::{LogLimiter, Source};
use vrdma_core::proto::{CmReply, CmRequest};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{QpAttr, QpAttrMask, QpState};
use vrdma_shm::Doorbell;

/// Event channels one tenant may hold: each keeps a descriptor in the
/// daemon.
pub const MAX_CHANNELS_PER_TENANT: usize = 256;

/// Events one channel holds unread at most. A channel's events come from
/// its ids, which the tenant's id quota bounds, a few each; past this the
/// tenant is not reading them, and its listeners' new requests are
/// refused rather than queued without end (see [`CmDriver::deliver`]).
pub const MAX_UNREAD: usize = vrdma_core::proto::MAX_CM_UNREAD as usize;

/// A tenant's event channel: events wait here until its owner asks for
/// them; its doorbell is readable while any do.
struct EventChannel {
    ctx: ContextId,
    tenant: TenantId,
    fd: Doorbell,
    /// Events in order; `None` where one went with its id (destroyed, or
    /// moved to another channel) after its wake-up was rung: the tenant
    /// takes that wake-up with the next event it reads. (One that goes
    /// before its wake-up was rung goes from here at once: see
    /// [`drop_gone_unrung`](Self::drop_gone_unrung). So the `None`s are
    /// among the rung entries, which [`max_rung`](Self::max_rung) bounds:
    /// a tenant that makes and destroys ids without reading their events
    /// cannot make the queue grow without end.)
    events: VecDeque<Option<CmEvent>>,
    /// Wake-ups of `events` not yet rung (the last `owed` entries): the
    /// doorbell's buffer was full (it holds what `net.core.wmem_max`
    /// allows, which may be fewer than [`MAX_UNREAD`]), or it holds
    /// `max_rung` of this queue's already. Rung as the tenant reads and
    /// room frees, so that rung + owed = events, and the descriptor is
    /// readable exactly while events wait (see
    /// [`take_event`](Self::take_event): a rung one is left while any is
    /// owed).
    owed: usize,
    /// Most entries of `events` rung at once ([`MAX_UNREAD`]; lower in
    /// tests): a doorbell may hold more (some 5400 where `wmem_max` is
    /// 2 MiB or more), but the library takes at most [`MAX_UNREAD`]
    /// wake-ups in a reply (`vrdma::cm_reply`), and the entries of
    /// destroyed ids are bounded by it.
    max_rung: usize,
    /// Whether an event may go in its wake-up (see [`CmDriver::deliver`]):
    /// a host tenant's library reads it there. (A guest's channel is
    /// signalled through its port, which carries no bytes.)
    carry: bool,
}

impl EventChannel {
    fn new(ctx: ContextId, tenant: TenantId, fd: Doorbell, carry: bool) -> EventChannel {
        EventChannel { ctx, tenant, fd, events: VecDeque::new(), owed: 0, max_rung: MAX_UNREAD, carry }
    }

    /// Entries whose wake-ups are rung.
    fn rung(&self) -> usize {
        self.events.len() - self.owed
    }

    /// One more wake-up (for the entry just queued), or owed if the
    /// doorbell holds all it can; with those owed before, if room freed
    /// (the tenant took some since).
    fn ring(&mut self) {
        self.owed += 1;
        self.ring_owed();
    }

    /// Rings what is owed while the doorbell takes it.
    fn ring_owed(&mut self) {
        while self.owed > 0 && self.rung() < self.max_rung && self.fd.ring_one() {
            self.owed -= 1;
        }
    }

    /// Drops the entries gone with their ids (`None`) whose wake-ups were
    /// not rung: they owe nothing to the tenant, and kept they would let
    /// the queue grow without end (found in review, 2026-11-28: 4300 ids
    /// made, resolved and destroyed unread left 4300 entries, and the
    /// next `GetEvent` handed out 4301 wake-ups, more than the library
    /// takes in a reply).
    fn drop_gone_unrung(&mut self) {
        let rung = self.rung();
        let mut i = 0;
        let before = self.events.len();
        self.events.retain(|e| {
            i += 1;
            i <= rung || e.is_some()
        });
        self.owed -= before - self.events.len();
    }

    /// `GetEvent`'s take: the next event and the wake-ups the tenant
    /// takes with it (one per entry, those of events gone with their ids
    /// included), at most `budget` (what is left of a reply's
    /// [`MAX_UNREAD`]). Only entries whose wake-ups are in the doorbell
    /// go, and while any are owed, not the last of those: the doorbell
    /// must keep a wake-up of this queue, which brings the tenant back to
    /// ask, and then the owed ones are rung (the library may hold the
    /// wake-ups of up to `MAX_CM_EVENTS` fetched events in its
    /// descriptor, so the doorbell has no room at the call; taking every
    /// rung entry left the tenant with an empty descriptor and events
    /// owed that nothing would ring, found in review, 2026-11-28).
    /// `first`: at least one entry even where none is rung (a channel
    /// whose doorbell took none: the tenant's takes find nothing, and the
    /// count stays right), as `GetEvent` always did.
    fn take_event(&mut self, first: bool, budget: usize) -> (Option<CmEvent>, u32) {
        // (The tenant takes the wake-ups from its end of the doorbell:
        // readable while any event is left.)
        self.ring_owed();
        let rung = self.rung();
        let room = if self.owed > 0 { rung.saturating_sub(1) } else { rung };
        let floor = if first { room.max(1) } else { room }.min(budget);
        let mut wakeups = 0;
        let mut event = None;
        while wakeups < floor {
            let Some(e) = self.events.pop_front() else { break };
            wakeups += 1;
            if e.is_some() {
                event = e;
                break;
            }
        }
        self.owed = self.owed.min(self.events.len());
        (event, wakeups as u32)
    }
}

/// Moves a context's QP (the HCA's `modify_qp`, which checks that the
/// QP is the context's).
pub type ModifyQp<'a> = &'a mut dyn FnMut(ContextId, u32, &QpAttr, QpAttrMask) -> Result<(), HcaError>;

pub struct CmDriver {
    pub cm: ConnectionManager,
    channels: HashMap<u32, EventChannel>,
    /// The channel of each id.
    id_channel: HashMap<u32, u32>,
    /// The QP attached to each id that has one: its context (the id's, or
    /// another of the same tenant: see [`CmDriver::attach_qp`]) and number.
    id_qp: HashMap<u32, (ContextId, u32)>,
    next_channel: u32,
    log: LogLimiter,
}

/// Why a call failed, as the library reports it.
#[derive(Debug, thiserror::Error)]
pub enum CmCallError {
    #[error(transparent)]
    Cm(#[from] CmError),
    #[error("no event channel {0}")]
    NoChannel(u32),
    #[error("port space {0:#x} is not one of rdma_cm's")]
    PortSpace(u32),
    #[error("a tenant may hold at most {MAX_CHANNELS_PER_TENANT} rdma_cm event channels")]
    Channels,
    #[error("the event channel still has ids")]
    Busy,
    #[error("the id's QP: {0}")]
    Qp(#[from] HcaError),
    #[error("a request the session answers, not the connection manager")]
    NotHere,
}

impl CmCallError {
    pub fn errno(&self) -> i32 {
        match self {
            CmCallError::Cm(e) => e.errno(),
            CmCallError::NoChannel(_) | CmCallError::PortSpace(_) => libc::EINVAL,
            CmCallError::Channels => libc::EMFILE,
            CmCallError::Busy => libc::EBUSY,
            CmCallError::Qp(e) => e.errno(),
            CmCallError::NotHere => libc::EINVAL,
        }
    }
}

impl CmDriver {
    pub fn new(cm: ConnectionManager) -> CmDriver {
        CmDriver {
            cm,
            channels: HashMap::new(),
            id_channel: HashMap::new(),
            id_qp: HashMap::new(),
            next_channel: 0,
            log: LogLimiter::new(),
        }
    }

    /// Adds an event channel of `ctx` whose doorbell is `fd` (the tenant
    /// holds the other end).
    pub fn add_channel(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        fd: Doorbell,
    ) -> Result<u32, CmCallError> {
        self.add_channel_with(ctx, tenant, fd, false)
    }

    /// [`add_channel`](Self::add_channel); `carry`: an event may go in
    /// its wake-up, for a library that reads it there
    /// (`vrdma_core::proto::CARRIED_CM_EVENT`).
    pub fn add_channel_with(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        fd: Doorbell,
        carry: bool,
    ) -> Result<u32, CmCallError> {
        self.check_channel_quota(tenant)?;
        let id = loop {
            self.next_channel = self.next_channel.wrapping_add(1).max(1);
            if !self.channels.contains_key(&self.next_channel) {
                break self.next_channel;
            }
        };
        self.channels.insert(id, EventChannel::new(ctx, tenant, fd, carry));
        Ok(id)
    }

    fn check_channel_quota(&self, tenant: TenantId) -> Result<(), CmCallError> {
        if self.channels.values().filter(|c| c.tenant == tenant).count() >= MAX_CHANNELS_PER_TENANT {
            return Err(CmCallError::Channels);
        }
        Ok(())
    }

    /// [`add_channel_with`](Self::add_channel_with) under number `id`
    /// (the daemon's number space, shared with completion channels: the
    /// session picks a free one, `RingTable::free_channel_id`), so that
    /// the channel keeps its number when its VM's tenant moves.
    pub fn add_channel_as(
        &mut self,
        id: u32,
        ctx: ContextId,
        tenant: TenantId,
        fd: Doorbell,
        carry: bool,
    ) -> Result<u32, CmCallError> {
        self.check_channel_quota(tenant)?;
        if id == 0 || self.channels.contains_key(&id) {
            return Err(CmCallError::NoChannel(id));
        }
        self.channels.insert(id, EventChannel::new(ctx, tenant, fd, carry));
        Ok(id)
    }

    /// Whether an event channel numbered `id` is in use.
    pub fn has_channel(&self, id: u32) -> bool {
        self.channels.contains_key(&id)
    }

    fn own_channel(&self, ctx: ContextId, channel: u32) -> Result<(), CmCallError> {
        match self.channels.get(&channel) {
            Some(c) if c.ctx == ctx => Ok(()),
            _ => Err(CmCallError::NoChannel(channel)),
        }
    }

    /// Moves `id`'s attached QP through `states` with the manager's
    /// attributes; on the passive side with the depths this side accepts
    /// with (`depths`: responder resources, initiator depth), as librdmacm
    /// applies them.
    /// `CmRequest::AttachQp`: QP `qp` of context `qp_ctx` (the id's own,
    /// or another context of the id's tenant, as the engine checked) goes
    /// to INIT with the id's attributes and becomes the id's.
    pub fn attach_qp(
        &mut self,
        ctx: ContextId,
        id: u32,
        qp_ctx: ContextId,
        qp: u32,
        modify: ModifyQp,
    ) -> Result<(), CmCallError> {
        let (attr, mask) = self.cm.init_qp_attr(ctx, id, QpState::Init)?;
        modify(qp_ctx, qp, &attr, mask)?;
        self.id_qp.insert(id, (qp_ctx, qp));
        Ok(())
    }

    fn bring_up(
        &self,
        ctx: ContextId,
        id: u32,
        (qp_ctx, qp): (ContextId, u32),
        states: &[QpState],
        depths: Option<(u8, u8)>,
        modify: ModifyQp,
    ) -> Result<(), CmCallError> {
        for &state in states {
            let (mut attr, mask) = self.cm.init_qp_attr(ctx, id, state)?;
            if let Some((responder_resources, initiator_depth)) = depths {
                if mask.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
                    attr.max_dest_rd_atomic = responder_resources;
                }
                if mask.contains(QpAttrMask::MAX_QP_RD_ATOMIC) {
                    attr.max_rd_atomic = initiator_depth;
                }
            }
            modify(qp_ctx, qp, &attr, mask)?;
        }
        Ok(())
    }

    /// The limiter of the lines tenants' and peers' CM input triggers
    /// (the metrics count its occurrences).
    pub fn log(&self) -> &LogLimiter {
        &self.log
    }

    /// A connect's parameters with the number of the id's attached QP,
    /// where it has one (as `Accept` takes it): the library sends the
    /// same, except in a `CmRequest::Batch` that makes the QP first, where
    /// it cannot know it yet.
    fn with_qp_num(&self, id: u32, conn: ConnInfo) -> ConnInfo {
        match self.id_qp.get(&id) {
            Some(&(_, qp_num)) => ConnInfo { qp_num, ..conn },
            None => conn,
        }
    }

    /// One call of a tenant's context; `modify` moves its QPs.
    pub fn handle(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        req: CmRequest,
        now: Instant,
        modify: ModifyQp,
    ) -> Result<CmReply, CmCallError> {
        let done = CmReply::Event { event: None, wakeups: 0 };
        let reply = match req {
            // Made by the session, which creates the descriptors.
            CmRequest::CreateChannel => return Err(CmCallError::NoChannel(0)),
            CmRequest::DestroyChannel { channel } => {
                self.own_channel(ctx, channel)?;
                if self.id_channel.values().any(|&c| c == channel) {
                    return Err(CmCallError::Busy);
                }
                self.channels.remove(&channel);
                done
            }
            CmRequest::CreateId { channel, ps } => {
                self.own_channel(ctx, channel)?;
                let ps = PortSpace::from_raw(ps).ok_or(CmCallError::PortSpace(ps))?;
                let id = self.cm.create_id(ctx, tenant, ps)?;
                self.id_channel.insert(id, channel);
                CmReply::Id { id }
            }
            CmRequest::DestroyId { id } => {
                self.cm.destroy_id(ctx, id, now)?;
                self.id_channel.remove(&id);
                self.id_qp.remove(&id);
                // Its events not yet read go with it, as the kernel's do.
                for c in self.channels.values_mut().filter(|c| c.ctx == ctx) {
                    for e in c.events.iter_mut() {
                        if e.as_ref().is_some_and(|e| e.id == id) {
                            *e = None;
                        }
                    }
                    c.drop_gone_unrung();
                }
                done
            }
            CmRequest::MigrateId { id, channel } => {
                self.own_channel(ctx, channel)?;
                self.cm.state(ctx, id).ok_or(CmError::NoSuchId)?;
                // Its unread events move with it, as the kernel's do.
                let mut moved = Vec::new();
                if let Some(old) = self.id_channel.insert(id, channel).filter(|&o| o != channel) {
                    if let Some(c) = self.channels.get_mut(&old) {
                        for e in c.events.iter_mut() {
                            if e.as_ref().is_some_and(|e| e.id == id) {
                                moved.extend(e.take());
                            }
                        }
                        c.drop_gone_unrung();
                    }
                }
                if let Some(c) = self.channels.get_mut(&channel) {
                    for ev in moved {
                        c.events.push_back(Some(ev));
                        c.ring();
                    }
                }
                done
            }
            CmRequest::SetReuseAddr { id, reuse } => {
                self.cm.set_reuseaddr(ctx, id, reuse)?;
                done
            }
            CmRequest::Bind { id, addr } => {
                self.cm.bind(ctx, id, addr)?;
                self.addrs(ctx, id)?
            }
            CmRequest::ResolveAddr { id, src, dst } => {
                self.cm.resolve_addr(ctx, id, src, dst)?;
                done
            }
            CmRequest::ResolveRoute { id } => {
                self.cm.resolve_route(ctx, id)?;
                done
            }
            CmRequest::Listen { id, backlog } => {
                self.cm.listen(ctx, id, backlog)?;
                done
            }
            CmRequest::Connect { id, conn } => {
                let conn = self.with_qp_num(id, conn);
                self.cm.connect(ctx, id, conn, now)?;
                done
            }
            CmRequest::RouteReported { id } => {
                self.cm.resolve_route_reported(ctx, id)?;
                done
            }
            CmRequest::ConnectRouted { id, conn } => {
                self.cm.resolve_route_reported(ctx, id)?;
                let conn = self.with_qp_num(id, conn);
                self.cm.connect(ctx, id, conn, now)?;
                done
            }
            CmRequest::Accept { id, mut conn, qkey } => {
                if let Some(&qp) = self.id_qp.get(&id) {
                    let ps = self.cm.port_space(ctx, id).ok_or(CmError::NoSuchId)?;
                    if self.cm.state(ctx, id) != Some(State::ReqReceived) {
                        return Err(CmError::WrongState.into());
                    }
                    let states: &[QpState] = if ps.is_ud() {
                        &[QpState::Rtr, QpState::Rts]
                    } else {
                        &[QpState::Init, QpState::Rtr, QpState::Rts]
                    };
                    let depths = (conn.responder_resources, conn.initiator_depth);
                    self.bring_up(ctx, id, qp, states, Some(depths), modify)?;
                    conn.qp_num = qp.1;
                }
                self.cm.accept(ctx, id, conn, qkey, now)?;
                done
            }
            CmRequest::Establish { id } => {
                self.cm.establish(ctx, id)?;
                done
            }
            CmRequest::Reject { id, private_data } => {
                self.cm.reject(ctx, id, private_data)?;
                done
            }
            CmRequest::Disconnect { id } => {
                self.cm.state(ctx, id).ok_or(CmError::NoSuchId)?;
                if let Some(&(qp_ctx, qp)) = self.id_qp.get(&id) {
                    // Its work is flushed, as the kernel's rdma_disconnect does.
                    // A QP the program destroyed already has nothing to flush
                    // (the kernel's id forgets its QP in rdma_destroy_qp; a
                    // QP of the drop-in's libibverbs goes without a word to
                    // the connection manager).
                    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
                    match modify(qp_ctx, qp, &attr, QpAttrMask::STATE) {
                        Err(HcaError::NoSuchObject { .. }) => {
                            self.id_qp.remove(&id);
                        }
                        r => r?,
                    }
                }
                self.cm.disconnect(ctx, id, now)?;
                done
            }
            CmRequest::AttachQp { id, qp } => {
                self.attach_qp(ctx, id, ctx, qp, modify)?;
                done
            }
            // The session makes the QP, then attaches it with `AttachQp`.
            // The session runs a batch's calls one by one.
            CmRequest::CreateQp { .. } | CmRequest::CreateQpWithCq { .. } | CmRequest::Batch { .. } => {
                return Err(CmCallError::NotHere)
            }
            CmRequest::InitQpAttr { id, state } => {
                let (attr, mask) = self.cm.init_qp_attr(ctx, id, state)?;
                CmReply::QpAttr { attr, mask }
            }
            CmRequest::QueryAddr { id } => self.addrs(ctx, id)?,
            CmRequest::HasListener { ps, addr } => {
                let ps = PortSpace::from_raw(ps).ok_or(CmCallError::PortSpace(ps))?;
                CmReply::Listening(self.cm.has_listener(tenant, ps, addr))
            }
            CmRequest::GetEvent { channel } => {
                self.own_channel(ctx, channel)?;
                let c = self.channels.get_mut(&channel).expect("checked above");
                let (event, wakeups) = c.take_event(true, MAX_UNREAD);
                CmReply::Event { event, wakeups }
            }
            CmRequest::GetEvents { channel, max } => {
                self.own_channel(ctx, channel)?;
                let c = self.channels.get_mut(&channel).expect("checked above");
                let max = max.clamp(1, vrdma_core::proto::MAX_CM_EVENTS) as usize;
                let mut events = Vec::new();
                // As `GetEvent`s in a row, the later ones only while rung
                // wake-ups are left, and no more than `MAX_UNREAD` in all
                // (what the library takes in one reply).
                let mut total = 0;
                loop {
                    let (event, wakeups) = c.take_event(events.is_empty(), MAX_UNREAD - total);
                    total += wakeups as usize;
                    let got = event.is_some();
                    if got || wakeups > 0 {
                        events.push((event, wakeups));
                    }
                    if !got || events.len() >= max || total >= MAX_UNREAD {
                        break;
                    }
                }
                CmReply::Events { events }
            }
        };
        Ok(reply)
    }

    /// The event at the head of `id`'s channel, taken out for the reply of
    /// the call that made it, if it is `id`'s and its wake-up is in the
    /// doorbell. The wake-up stays there: the library keeps the event and
    /// takes the wake-up when the program reads the event, so the
    /// descriptor stays readable exactly while events wait, and the
    /// program's `rdma_get_cm_event` costs no round trip. (An address or a
    /// route is resolved at once, and a same-host accept establishes both
    /// sides within its call: each of these saves a round trip of the
    /// few that a connection's setup waits on.)
    pub fn take_ready(&mut self, ctx: ContextId, id: u32) -> Option<CmEvent> {
        let channel = *self.id_channel.get(&id)?;
        let c = self.channels.get_mut(&channel).filter(|c| c.ctx == ctx)?;
        c.ring_owed();
        // (While any are owed, the last rung one stays, as in `take_event`.)
        let room = c.rung().saturating_sub(usize::from(c.owed > 0));
        let ids = |e: &Option<CmEvent>| e.as_ref().is_some_and(|e| e.id == id);
        if room == 0 || !c.events.front().is_some_and(ids) {
            return None;
        }
        let ev = c.events.pop_front().flatten();
        c.owed = c.owed.min(c.events.len());
        ev
    }

    fn addrs(&self, ctx: ContextId, id: u32) -> Result<CmReply, CmCallError> {
        let (local, remote) = self.cm.addresses(ctx, id).ok_or(CmError::NoSuchId)?;
        Ok(CmReply::Addrs { local, remote })
    }

    /// Carries the manager's messages and delivers its events; runs its
    /// timers due at `now`. A message for another host goes through
    /// `send`, by the link its connection belongs to (`None`: the host's
    /// newest, or a dial), whose refusal ends the connections of that link
    /// (as a dead host would, promptly), or with `None` the connection that
    /// sent it. `send` says the link the message went by (`None`: held for
    /// a link); a connection's first message (REQ, Moved) sent by no link
    /// of the manager's binds its connection there
    /// ([`ConnectionManager::sent_by`]; a later one goes by the link its
    /// connection is bound to). Returns when it next needs to run.
    pub fn run(
        &mut self,
        now: Instant,
        mut send: impl FnMut(Ipv4Addr, Option<LinkId>, &CmMessage) -> Result<Option<LinkId>, &'static str>,
        modify: ModifyQp,
    ) -> Option<Instant> {
        if self.cm.poll_timeout().is_some_and(|t| t <= now) {
            self.cm.handle_timeout(now);
        }
        // Twice: delivering an event may answer a request (a refusal), and
        // that answer goes now. Bounded: a message answered locally makes at
        // most one more (REQ → REP → RTU, DREQ → DREP), and calls come one
        // at a time.
        for _ in 0..2 {
            for _ in 0..1024 {
                let Some((host, link, msg)) = self.cm.poll_transmit_by() else { break };
                if self.cm.is_local(host) {
                    // Both ends are here: the sender is named by the address
                    // the message went to, which is the one each side knows
                    // the other by.
                    self.cm.handle_message(host, msg);
                } else {
                    match send(host, link, &msg) {
                        // Sent by no link of the manager's: it went by
                        // the host's newest, which a connection's first
                        // message binds it to (not one a link's report
                        // bound it to meanwhile).
                        Ok(Some(went)) if link.is_none() => self.cm.sent_by(host, &msg, went),
                        Ok(_) => {}
                        Err(why) => {
                            const UNREACHABLE: &str =
                                "an rdma_cm message cannot reach its host: its connections end";
                            limited_warn!(self.log, Source::Address(host.into()), now, UNREACHABLE, %host, why);
                            self.cm.send_refused(host, link, &msg);
                        }
                    }
                }
            }
            while let Some(ev) = self.cm.poll_event() {
                let ev = self.complete_connect(ev, &mut *modify);
                self.deliver(ev, now);
            }
        }
        self.log.sweep(now);
        // Messages still waiting (a burst larger than a run sends) go in
        // the next pass, not after the next timer.
        if self.cm.transmit_pending() {
            return Some(now);
        }
        self.cm.poll_timeout()
    }

    /// The kernel's handling of a REP for an id with a QP: the QP to RTR
    /// and RTS, then the RTU; the program sees ESTABLISHED, or
    /// CONNECT_ERROR (and the peer a REJ) if the QP could not come up.
    fn complete_connect(&mut self, mut ev: CmEvent, modify: ModifyQp) -> CmEvent {
        let qp = match self.id_qp.get(&ev.id) {
            Some(&qp) if ev.kind == EventKind::ConnectResponse => qp,
            _ => return ev,
        };
        let states = [QpState::Init, QpState::Rtr, QpState::Rts];
        let up = self
            .bring_up(ev.ctx, ev.id, qp, &states, None, modify)
            .and_then(|()| self.cm.establish(ev.ctx, ev.id).map_err(CmCallError::from));
        match up {
            Ok(()) => ev.kind = EventKind::Established,
            Err(e) => {
                tracing::debug!(id = ev.id, error = %e, "an rdma_cm id's QP could not come up: rejecting the REP");
                let _ = self.cm.reject(ev.ctx, ev.id, Vec::new());
                ev.kind = EventKind::ConnectError;
                ev.status = -e.errno().max(1);
            }
        }
        ev
    }

    /// Puts an event in its id's channel.
    fn deliver(&mut self, ev: CmEvent, now: Instant) {
        let channel = match ev.listen_id {
            // A request's new id goes where its listener's events go.
            Some(l) if ev.kind == EventKind::ConnectRequest => self.id_channel.get(&l).copied(),
            _ => self.id_channel.get(&ev.id).copied(),
        };
        let Some(ch) = channel.and_then(|c| self.channels.get_mut(&c).map(|ch| (c, ch))) else { return };
        let (channel, c) = ch;
        if c.events.len() >= MAX_UNREAD {
            // A tenant that reads none of its events: a new request is
            // turned away, never queued. The requester hears a REJ with
            // reason 3 (no resources), as for a listener's full backlog.
            // (The kernel's CM drops such a request without a word, so
            // that the requester's retries may find room, and the
            // requester ends in UNREACHABLE when they run out; our
            // requests are not resent, and an answer now spares the
            // requester its whole timeout.)
            if ev.kind == EventKind::ConnectRequest {
                let _ = self.cm.reject_with(ev.ctx, ev.id, vrdma_core::cm::reject::NO_RESOURCES, Vec::new());
                let _ = self.cm.destroy_id(ev.ctx, ev.id, now);
                return;
            }
        }
        if ev.kind == EventKind::ConnectRequest {
            self.id_channel.insert(ev.id, channel);
        }
        // Nothing queued, nothing unread in the descriptor: the event goes
        // in its wake-up, and the library reads it there, without the
        // `GetEvent` round trip after its wake-up (two thread wake-ups:
        // the server's request and the client's ESTABLISHED each waited on
        // one). Otherwise it waits here as before, so that the one
        // carrying wake-up that may be unread is always the oldest of the
        // channel's, and order is kept.
        if c.carry
            && c.events.is_empty()
            && c.owed == 0
            && c.fd.ring_carrying(&vrdma_core::proto::encode_carried_cm_event(&ev))
        {
            return;
        }
        c.events.push_back(Some(ev));
        c.ring();
        if c.owed == 1 {
            tracing::debug!(channel, "rdma_cm event channel doorbell full: wake-ups owed until it is read");
        }
    }

    /// Destroys everything of `ctx` (its process closed the device or died).
    /// (The engine then runs the manager, which sends the DREQs.)
    pub fn close_context(&mut self, ctx: ContextId) {
        self.cm.close_context(ctx);
        let cm = &self.cm;
        self.id_channel.retain(|&id, _| cm.owner(id).is_some());
        // (A QP of the closed context, attached to an id of another, went
        // with the context.)
        self.id_qp.retain(|&id, &mut (qp_ctx, _)| cm.owner(id).is_some() && qp_ctx != ctx);
        self.channels.retain(|_, c| c.ctx != ctx);
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddrV4;

    use vrdma_core::cm::ConnInfo;

    use super::*;
    use crate::testing::{traced, Keys};

    const C: ContextId = ContextId(1);

    /// For tests whose ids have no QP: any move of one is a bug.
    fn no_qps() -> impl FnMut(ContextId, u32, &QpAttr, QpAttrMask) -> Result<(), HcaError> {
        |_, qp, _, _| panic!("QP {qp} moved, but no id has one")
    }
    const T: TenantId = TenantId(1000);

    /// A request that has nowhere to go (the transport is off) ends in
    /// UNREACHABLE at once, and the log says why once for that host, not
    /// once per request.
    #[test]
    fn requests_that_cannot_leave_end_unreachable_and_are_logged_once_per_host() {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1_000_000_000);
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let log = traced(|| {
            for _ in 0..20 {
                let Ok(CmReply::Id { id }) =
                    d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
                else {
                    panic!("no id");
                };
                for req in [
                    CmRequest::ResolveAddr { id, src: None, dst },
                    CmRequest::ResolveRoute { id },
                    CmRequest::Connect { id, conn: ConnInfo::default() },
                ] {
                    d.handle(C, T, req, now, &mut no_qps()).unwrap();
                    d.run(now, |_, _, _| Err("the transport between daemons is off"), &mut no_qps());
                }
            }
        });
        let mut kinds = Vec::new();
        while let Ok(CmReply::Event { event: Some(ev), wakeups }) =
            d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps())
        {
            assert_eq!(wakeups, 1);
            assert!(tenant_end.take_one(), "one wake-up per event");
            kinds.push(ev.kind);
        }
        assert_eq!(kinds.iter().filter(|k| **k == EventKind::Unreachable).count(), 20);
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("cannot reach its host")).collect();
        assert_eq!(lines.len(), 1, "{log}");
        assert!(lines[0].contains("10.0.0.9") && lines[0].contains("transport between daemons is off"));
    }

    /// A channel whose library reads events in their wake-ups gets an
    /// event there only while its descriptor holds nothing unread: the
    /// second of two unread events waits in the daemon behind a bare
    /// wake-up, and `GetEvent` hands it out after the first is read
    /// there; once all is read, the next is carried again.
    #[test]
    fn an_event_rides_its_wake_up_only_into_a_descriptor_with_nothing_unread() {
        let cm = ConnectionManager::new(Default::default(), vec![Ipv4Addr::LOCALHOST], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair_with_hangup().unwrap();
        let channel = d.add_channel_with(C, T, fd, true).unwrap();
        let now = Instant(1);
        let mut id = || match d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
        {
            Ok(CmReply::Id { id }) => id,
            other => panic!("{other:?}"),
        };
        let (a, b, c) = (id(), id(), id());
        let dst = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7471);
        let resolve = |d: &mut CmDriver, id| {
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
            d.run(now, |_, _, _| Ok(None), &mut no_qps());
        };
        resolve(&mut d, a);
        resolve(&mut d, b);
        let mut buf = [0u8; 2048];
        let carried = |buf: &[u8]| vrdma_core::proto::decode_carried_cm_event(buf).map(|r| r.unwrap());
        let (len, _) = tenant_end.peek(&mut buf).unwrap();
        let first = carried(&buf[..len]).expect("the first event rides its wake-up");
        assert_eq!((first.id, first.kind), (a, EventKind::AddrResolved));
        assert!(tenant_end.take_one());
        let (len, _) = tenant_end.peek(&mut buf).unwrap();
        assert!(carried(&buf[..len]).is_none(), "the second waits behind a bare wake-up");
        match d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps()) {
            Ok(CmReply::Event { event: Some(ev), wakeups: 1 }) => assert_eq!(ev.id, b),
            other => panic!("{other:?}"),
        }
        assert!(tenant_end.take_one());
        assert!(!tenant_end.is_readable());
        resolve(&mut d, c);
        let (len, _) = tenant_end.peek(&mut buf).unwrap();
        assert_eq!(carried(&buf[..len]).map(|e| e.id), Some(c), "nothing unread: carried again");
    }

    /// `GetEvents` takes what `GetEvent`s in a row would: the events
    /// queued behind bare wake-ups, in order, each with its wake-ups (an
    /// event gone with its id folded into the next one's), at most `max`,
    /// and nothing (an empty list) where none waits.
    #[test]
    fn get_events_takes_the_queued_events_in_order_with_their_wake_ups() {
        let cm = ConnectionManager::new(Default::default(), vec![Ipv4Addr::LOCALHOST], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair_with_hangup().unwrap();
        let channel = d.add_channel_with(C, T, fd, true).unwrap();
        let now = Instant(1);
        let id = |d: &mut CmDriver| match d.handle(
            C,
            T,
            CmRequest::CreateId { channel, ps: 0x0106 },
            now,
            &mut no_qps(),
        ) {
            Ok(CmReply::Id { id }) => id,
            other => panic!("{other:?}"),
        };
        let ids: Vec<u32> = (0..6).map(|_| id(&mut d)).collect();
        let dst = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7471);
        for &id in &ids[..4] {
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
            d.run(now, |_, _, _| Ok(None), &mut no_qps());
        }
        // The first rode its wake-up; the other three wait behind bare ones.
        assert!(tenant_end.take_one());
        d.handle(C, T, CmRequest::DestroyId { id: ids[2] }, now, &mut no_qps()).unwrap();
        let get =
            |d: &mut CmDriver, max| d.handle(C, T, CmRequest::GetEvents { channel, max }, now, &mut no_qps());
        match get(&mut d, 16) {
            Ok(CmReply::Events { events }) => {
                let got: Vec<(Option<u32>, u32)> =
                    events.iter().map(|(e, w)| (e.as_ref().map(|e| e.id), *w)).collect();
                assert_eq!(got, vec![(Some(ids[1]), 1), (Some(ids[3]), 2)], "{events:?}");
            }
            other => panic!("{other:?}"),
        }
        for _ in 0..3 {
            assert!(tenant_end.take_one());
        }
        assert!(!tenant_end.is_readable());
        assert!(matches!(get(&mut d, 16), Ok(CmReply::Events { events }) if events.is_empty()));
        // At most `max`: the rest stay for the next call.
        for &id in &ids[4..] {
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
            d.run(now, |_, _, _| Ok(None), &mut no_qps());
        }
        assert!(tenant_end.take_one(), "the first rode its wake-up again");
        let id6 = id(&mut d);
        d.handle(C, T, CmRequest::ResolveAddr { id: id6, src: None, dst }, now, &mut no_qps()).unwrap();
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        match get(&mut d, 1) {
            Ok(CmReply::Events { events }) => {
                assert_eq!(events.len(), 1);
                assert_eq!(events[0].0.as_ref().map(|e| e.id), Some(ids[5]));
            }
            other => panic!("{other:?}"),
        }
        match get(&mut d, 0) {
            Ok(CmReply::Events { events }) => assert_eq!(events[0].0.as_ref().map(|e| e.id), Some(id6)),
            other => panic!("{other:?}"),
        }
    }

    /// A tenant that reads none of its events cannot make the daemon queue
    /// requests for it without end: past the bound they are refused (five
    /// listeners' backlogs on one channel hold more than the bound).
    #[test]
    fn a_listener_whose_events_are_not_read_refuses_requests_past_the_bound() {
        let cm = ConnectionManager::new(
            vrdma_core::cm::CmConfig { max_ids_per_tenant: 100_000, ..Default::default() },
            vec![Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(1)),
        );
        let mut d = CmDriver::new(cm);
        let (fd, _tenant_end) = Doorbell::pair().unwrap();
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1);
        let src = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 40000);
        let mut from = 0;
        let mut refused = 0;
        for port in 7471..7476 {
            let at = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), port);
            let Ok(CmReply::Id { id: l }) =
                d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
            else {
                panic!("no id");
            };
            d.handle(C, T, CmRequest::Bind { id: l, addr: at }, now, &mut no_qps()).unwrap();
            d.handle(C, T, CmRequest::Listen { id: l, backlog: 0 }, now, &mut no_qps()).unwrap();
            for _ in 0..1024 {
                from += 1;
                let conn = ConnInfo::default();
                let req = CmMessage::Req { from, tenant: T.0, ps: PortSpace::Tcp, src, dst: at, conn };
                d.cm.handle_message(*src.ip(), req);
                d.run(
                    now,
                    |_, _, m| {
                        refused += usize::from(matches!(m, CmMessage::Rej { .. }));
                        if let CmMessage::Rej { reason, .. } = m {
                            assert_eq!(
                                *reason,
                                vrdma_core::cm::reject::NO_RESOURCES,
                                "no resources, as a full backlog"
                            );
                        }
                        Ok(None)
                    },
                    &mut no_qps(),
                );
            }
        }
        assert_eq!(d.channels[&channel].events.len(), MAX_UNREAD);
        assert_eq!(refused, 5 * 1024 - MAX_UNREAD, "every request past the bound is answered");
        assert!(d.channels[&channel].events.len() <= MAX_UNREAD);
    }

    /// Events of an id destroyed (or moved) before they were read leave
    /// their wake-ups behind: the next read takes those too, so the
    /// descriptor is readable exactly while an event waits.
    #[test]
    fn events_that_go_with_their_id_give_back_their_wake_ups() {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1);
        let id = |d: &mut CmDriver| match d.handle(
            C,
            T,
            CmRequest::CreateId { channel, ps: 0x0106 },
            now,
            &mut no_qps(),
        ) {
            Ok(CmReply::Id { id }) => id,
            other => panic!("{other:?}"),
        };
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let (gone, kept) = (id(&mut d), id(&mut d));
        d.handle(C, T, CmRequest::ResolveAddr { id: gone, src: None, dst }, now, &mut no_qps()).unwrap();
        d.handle(C, T, CmRequest::ResolveAddr { id: kept, src: None, dst }, now, &mut no_qps()).unwrap();
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        d.handle(C, T, CmRequest::DestroyId { id: gone }, now, &mut no_qps()).unwrap();
        let reply = d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps()).unwrap();
        let CmReply::Event { event: Some(ev), wakeups: 2 } = reply else { panic!("{reply:?}") };
        assert_eq!((ev.id, ev.kind), (kept, EventKind::AddrResolved));
        assert!(tenant_end.take_one() && tenant_end.take_one(), "two were rung");
        assert!(!tenant_end.take_one(), "and nothing more: the descriptor is quiet");
        let reply = d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps()).unwrap();
        assert!(matches!(reply, CmReply::Event { event: None, wakeups: 0 }), "{reply:?}");
    }

    /// Moves of QPs as a recorder sees them: (context, QP, state, mask).
    type Moves = std::cell::RefCell<Vec<(ContextId, u32, QpAttr, QpAttrMask)>>;

    fn recorder(
        moves: &Moves,
    ) -> impl FnMut(ContextId, u32, &QpAttr, QpAttrMask) -> Result<(), HcaError> + '_ {
        |c, qp, attr, mask| {
            moves.borrow_mut().push((c, qp, *attr, mask));
            Ok(())
        }
    }

    fn next_event(d: &mut CmDriver, ctx: ContextId, channel: u32) -> Option<CmEvent> {
        match d.handle(ctx, T, CmRequest::GetEvent { channel }, Instant(1), &mut no_qps()) {
            Ok(CmReply::Event { event, .. }) => event,
            other => panic!("{other:?}"),
        }
    }

    const SRV: ContextId = ContextId(1);
    const CLI: ContextId = ContextId(2);

    /// A driver with a channel for each of two contexts of this host
    /// (channel 1 the server's [`SRV`], 2 the client's [`CLI`]), and the
    /// tenants' ends of the channels' doorbells.
    fn two_contexts() -> (CmDriver, [Doorbell; 2]) {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, s_end) = Doorbell::pair().unwrap();
        assert_eq!(d.add_channel(SRV, T, fd).unwrap(), 1);
        let (fd, c_end) = Doorbell::pair().unwrap();
        assert_eq!(d.add_channel(CLI, T, fd).unwrap(), 2);
        (d, [s_end, c_end])
    }

    /// A listener of [`SRV`] on 10.0.0.1:7471 and an id of [`CLI`]'s with
    /// its route to it resolved and QP 0x20 attached; the client's id.
    fn listener_and_resolved_client(
        d: &mut CmDriver,
        call: &mut impl FnMut(&mut CmDriver, ContextId, CmRequest) -> CmReply,
    ) -> u32 {
        let at = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 7471);
        let CmReply::Id { id: l } = call(d, SRV, CmRequest::CreateId { channel: 1, ps: 0x0106 }) else {
            panic!()
        };
        call(d, SRV, CmRequest::Bind { id: l, addr: at });
        call(d, SRV, CmRequest::Listen { id: l, backlog: 8 });
        let CmReply::Id { id: a } = call(d, CLI, CmRequest::CreateId { channel: 2, ps: 0x0106 }) else {
            panic!()
        };
        call(d, CLI, CmRequest::ResolveAddr { id: a, src: None, dst: at });
        call(d, CLI, CmRequest::ResolveRoute { id: a });
        call(d, CLI, CmRequest::AttachQp { id: a, qp: 0x20 });
        a
    }

    /// A connect of an id with a QP attached names that QP, whatever
    /// number the call carried (a `CmRequest::Batch` that makes the QP
    /// first sends 0: the library cannot know it yet).
    #[test]
    fn a_connect_names_the_attached_qp() {
        let (mut d, _ends) = two_contexts();
        let now = Instant(1);
        let moves = Moves::default();
        let mut call = |d: &mut CmDriver, ctx, req| {
            let r = d.handle(ctx, T, req, now, &mut recorder(&moves));
            d.run(now, |_, _, _| Err("not local"), &mut recorder(&moves));
            r.unwrap()
        };
        let a = listener_and_resolved_client(&mut d, &mut call);
        call(&mut d, CLI, CmRequest::Connect { id: a, conn: ConnInfo { qp_num: 0, ..Default::default() } });
        while next_event(&mut d, CLI, 2).is_some() {}
        let req = next_event(&mut d, SRV, 1).expect("a request");
        assert_eq!(req.kind, EventKind::ConnectRequest);
        assert_eq!(req.peer.map(|p| p.qp_num), Some(0x20));
    }

    /// A connection between two contexts of this host whose ids have QPs
    /// attached: the daemon moves both QPs (INIT when attached; INIT, RTR
    /// and RTS before the REP, with the depths the acceptor gave; INIT,
    /// RTR and RTS when the REP comes in, then the RTU), and the
    /// requester hears ESTABLISHED, never CONNECT_RESPONSE.
    #[test]
    fn ids_with_qps_have_them_brought_up_by_the_daemon() {
        let (mut d, _ends) = two_contexts();
        let (srv, cli, s_ch, c_ch) = (SRV, CLI, 1, 2);
        let now = Instant(1);
        let moves = Moves::default();
        let mut call = |d: &mut CmDriver, ctx, req| {
            let r = d.handle(ctx, T, req, now, &mut recorder(&moves));
            d.run(now, |_, _, _| Err("not local"), &mut recorder(&moves));
            r.unwrap()
        };
        let a = listener_and_resolved_client(&mut d, &mut call);
        let m = moves.take();
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].0, m[0].1, m[0].2.qp_state), (cli, 0x20, QpState::Init));
        let conn =
            ConnInfo { qp_num: 0x20, responder_resources: 1, initiator_depth: 1, ..Default::default() };
        call(&mut d, cli, CmRequest::Connect { id: a, conn });
        assert!(moves.borrow().is_empty(), "nothing moves before the REP");
        let kinds: Vec<_> = std::iter::from_fn(|| next_event(&mut d, cli, c_ch)).map(|e| e.kind).collect();
        assert_eq!(kinds, [EventKind::AddrResolved, EventKind::RouteResolved]);
        let req = next_event(&mut d, srv, s_ch).expect("a request");
        assert_eq!(req.kind, EventKind::ConnectRequest);
        let p = req.id;
        call(&mut d, srv, CmRequest::AttachQp { id: p, qp: 0x30 });
        let conn = ConnInfo { qp_num: 0, responder_resources: 3, initiator_depth: 2, ..Default::default() };
        call(&mut d, srv, CmRequest::Accept { id: p, conn, qkey: 0 });
        let m = moves.take();
        let states: Vec<_> = m.iter().map(|(c, qp, a, _)| (*c, *qp, a.qp_state)).collect();
        assert_eq!(
            states,
            [
                (srv, 0x30, QpState::Init),
                (srv, 0x30, QpState::Init),
                (srv, 0x30, QpState::Rtr),
                (srv, 0x30, QpState::Rts),
                (cli, 0x20, QpState::Init),
                (cli, 0x20, QpState::Rtr),
                (cli, 0x20, QpState::Rts),
            ]
        );
        assert_eq!(m[2].2.max_dest_rd_atomic, 3, "the acceptor's responder resources");
        assert_eq!(m[3].2.max_rd_atomic, 2, "the acceptor's initiator depth");
        assert_eq!(m[5].2.dest_qp_num, 0x30, "the REP names the attached QP");
        assert_eq!(m[2].2.dest_qp_num, 0x20);
        let ev = next_event(&mut d, cli, c_ch).expect("the requester's event");
        assert_eq!((ev.id, ev.kind, ev.status), (a, EventKind::Established, 0));
        let ev = next_event(&mut d, srv, s_ch).expect("the acceptor's event");
        assert_eq!((ev.id, ev.kind), (p, EventKind::Established), "the RTU went");
        call(&mut d, cli, CmRequest::Disconnect { id: a });
        let m = moves.take();
        assert_eq!((m[0].1, m[0].2.qp_state, m[0].3), (0x20, QpState::Err, QpAttrMask::STATE));
    }

    /// The kernel CM's rule: no event that lets a side send is rung before
    /// the QP move it implies. Each QP move is made while neither side's
    /// channel holds an unread wake-up (the server's RTR and RTS before
    /// the REP can reach the client, the client's RTS before its
    /// ESTABLISHED), and the client's ESTABLISHED is rung once the accept
    /// returns.
    #[test]
    fn no_event_that_lets_a_side_send_is_rung_before_its_qp_moves() {
        let (mut d, [s_end, c_end]) = two_contexts();
        let now = Instant(1);
        let drain = |end: &Doorbell| while end.take_one() {};
        // (state of the move, whether either side had an unread wake-up)
        let seen = std::cell::RefCell::new(Vec::new());
        let mut watch = |_: ContextId, _: u32, attr: &QpAttr, _: QpAttrMask| {
            seen.borrow_mut().push((attr.qp_state, s_end.is_readable() || c_end.is_readable()));
            Ok(())
        };
        let mut call = |d: &mut CmDriver, ctx, req| {
            let r = d.handle(ctx, T, req, now, &mut watch);
            d.run(now, |_, _, _| Err("not local"), &mut watch);
            r.unwrap()
        };
        let a = listener_and_resolved_client(&mut d, &mut call);
        let conn = ConnInfo { qp_num: 0x20, ..Default::default() };
        call(&mut d, CLI, CmRequest::Connect { id: a, conn });
        while next_event(&mut d, CLI, 2).is_some() {}
        let req = next_event(&mut d, SRV, 1).expect("a request");
        // Everything so far read: the wake-ups taken, as the tenants would.
        drain(&s_end);
        drain(&c_end);
        seen.borrow_mut().clear();
        call(&mut d, SRV, CmRequest::AttachQp { id: req.id, qp: 0x30 });
        call(&mut d, SRV, CmRequest::Accept { id: req.id, conn: ConnInfo::default(), qkey: 0 });
        let seen = seen.take();
        let states: Vec<_> = seen.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            states,
            [
                QpState::Init,
                QpState::Init,
                QpState::Rtr,
                QpState::Rts,
                QpState::Init,
                QpState::Rtr,
                QpState::Rts
            ]
        );
        assert!(seen.iter().all(|(_, rung)| !rung), "a wake-up came before a QP move: {seen:?}");
        assert!(c_end.is_readable(), "the client's ESTABLISHED is rung once its QP is up");
        let ev = next_event(&mut d, CLI, 2).expect("the requester's event");
        assert_eq!((ev.id, ev.kind), (a, EventKind::Established));
    }

    /// A requester whose QP cannot come up when the REP comes in hears
    /// CONNECT_ERROR, and the acceptor a REJ (REJECTED), as with the
    /// kernel's CM; neither is left waiting.
    #[test]
    fn a_qp_that_cannot_come_up_on_the_rep_ends_in_connect_error_and_a_rej() {
        let (mut d, _ends) = two_contexts();
        let (srv, cli, s_ch, c_ch) = (SRV, CLI, 1, 2);
        let now = Instant(1);
        // The requester's QP refuses RTR.
        let refused = HcaError::NoSuchObject { kind: "QP", id: 0x20 };
        let mut modify = |c: ContextId, _: u32, attr: &QpAttr, _: QpAttrMask| {
            if c == cli && attr.qp_state == QpState::Rtr {
                return Err(refused.clone());
            }
            Ok(())
        };
        let mut call = |d: &mut CmDriver, ctx, req| {
            let r = d.handle(ctx, T, req, now, &mut modify);
            d.run(now, |_, _, _| Err("not local"), &mut modify);
            r.unwrap()
        };
        let a = listener_and_resolved_client(&mut d, &mut call);
        call(
            &mut d,
            cli,
            CmRequest::Connect { id: a, conn: ConnInfo { qp_num: 0x20, ..Default::default() } },
        );
        let req = next_event(&mut d, srv, s_ch).expect("a request");
        call(&mut d, srv, CmRequest::AttachQp { id: req.id, qp: 0x30 });
        call(&mut d, srv, CmRequest::Accept { id: req.id, conn: ConnInfo::default(), qkey: 0 });
        let kinds: Vec<_> =
            std::iter::from_fn(|| next_event(&mut d, cli, c_ch)).map(|e| (e.kind, e.status)).collect();
        assert_eq!(
            kinds,
            [
                (EventKind::AddrResolved, 0),
                (EventKind::RouteResolved, 0),
                (EventKind::ConnectError, -refused.errno())
            ]
        );
        let ev = next_event(&mut d, srv, s_ch).expect("the acceptor's event");
        assert_eq!((ev.id, ev.kind), (req.id, EventKind::Rejected));
    }

    /// A channel whose doorbell holds fewer wake-ups than it has events
    /// (a small `net.core.wmem_max`) stays readable while any event is
    /// unread: the wake-ups that did not fit are rung as it is read.
    #[test]
    fn a_doorbell_smaller_than_the_events_stays_readable_until_the_last_is_read() {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        let holds = fd.reserve(1);
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1);
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let n = 3 * holds.max(8) + 5;
        for _ in 0..n {
            let Ok(CmReply::Id { id }) =
                d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
            else {
                panic!("no id");
            };
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
        }
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        assert!(d.channels[&channel].owed > 0, "the doorbell held {holds}, fewer than {n}: some were owed");
        for read in 0..n {
            assert!(tenant_end.is_readable(), "readable with {} of {n} events unread", n - read);
            let Ok(CmReply::Event { event: Some(_), wakeups }) =
                d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps())
            else {
                panic!("event {read} of {n} missing");
            };
            for _ in 0..wakeups {
                assert!(tenant_end.take_one(), "each wake-up handed out was rung");
            }
        }
        assert!(!tenant_end.is_readable(), "quiet once all are read");
    }

    /// As above, read as the library reads with `GetEvents`: each reply's
    /// events kept, their wake-ups left in the descriptor until each is
    /// handed out, so the doorbell has no room at the call. A reply leaves
    /// a rung wake-up of the daemon's queue while any is owed, so the
    /// descriptor never empties with events waiting (it did: "readable
    /// with 23 of 29 events unread").
    #[test]
    fn a_small_doorbell_read_with_get_events_stays_readable_until_the_last_is_read() {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        let holds = fd.reserve(1);
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1);
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let n = 3 * holds.max(8) + 5;
        for _ in 0..n {
            let Ok(CmReply::Id { id }) =
                d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
            else {
                panic!("no id");
            };
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
        }
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        assert!(d.channels[&channel].owed > 0, "the doorbell held {holds}, fewer than {n}: some were owed");
        let mut read = 0;
        while read < n {
            let owed = d.channels[&channel].owed;
            assert!(
                tenant_end.is_readable(),
                "holds {holds}: readable with {} of {n} unread (owed {owed})",
                n - read
            );
            let Ok(CmReply::Events { events }) =
                d.handle(C, T, CmRequest::GetEvents { channel, max: 16 }, now, &mut no_qps())
            else {
                panic!("no reply");
            };
            assert!(!events.is_empty(), "events {read} of {n} missing");
            for (event, wakeups) in events {
                assert!(event.is_some());
                read += 1;
                for _ in 0..wakeups {
                    assert!(tenant_end.take_one(), "each wake-up handed out was rung");
                }
            }
        }
        assert!(!tenant_end.is_readable(), "quiet once all are read");
    }

    /// A run of entries of destroyed ids that covers every rung wake-up
    /// is not taken whole while some are owed: `GetEvent` hands out all
    /// but the last (an entry with no event), and the descriptor stays
    /// readable until the last event is read.
    #[test]
    fn destroyed_ids_covering_the_rung_wake_ups_leave_the_descriptor_readable() {
        let cm =
            ConnectionManager::new(Default::default(), vec![Ipv4Addr::new(10, 0, 0, 1)], Box::new(Keys(1)));
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        let holds = fd.reserve(1);
        let channel = d.add_channel(C, T, fd).unwrap();
        let now = Instant(1);
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let n = 3 * holds.max(8) + 5;
        let mut ids = Vec::new();
        for _ in 0..n {
            let Ok(CmReply::Id { id }) =
                d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now, &mut no_qps())
            else {
                panic!("no id");
            };
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
            ids.push(id);
        }
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        let rung = d.channels[&channel].rung();
        assert!(d.channels[&channel].owed > 0, "the doorbell held {holds}, fewer than {n}: some were owed");
        let gone = rung + 2;
        for &id in &ids[..gone] {
            d.handle(C, T, CmRequest::DestroyId { id }, now, &mut no_qps()).unwrap();
        }
        let mut read = 0;
        while read < n - gone {
            assert!(tenant_end.is_readable(), "holds {holds}: readable with {} unread", n - gone - read);
            let Ok(CmReply::Event { event, wakeups }) =
                d.handle(C, T, CmRequest::GetEvent { channel }, now, &mut no_qps())
            else {
                panic!("no reply");
            };
            read += usize::from(event.is_some());
            for _ in 0..wakeups {
                assert!(tenant_end.take_one(), "each wake-up handed out was rung");
            }
        }
        assert!(!tenant_end.is_readable(), "quiet once all are read");
    }

    /// Ids made, resolved and destroyed without their events read leave
    /// no more entries than a reply may hand out wake-ups for
    /// (`MAX_UNREAD`, whatever the doorbell holds): those never rung go
    /// at once, the rung ones are bounded. A reply never hands out more
    /// than `MAX_UNREAD` wake-ups (the library refuses one that does),
    /// and the live event after them comes, the descriptor readable until
    /// then.
    #[test]
    fn entries_of_destroyed_ids_are_bounded_and_a_reply_hands_out_at_most_max_unread() {
        let cm = ConnectionManager::new(
            vrdma_core::cm::CmConfig { max_ids_per_tenant: 100_000, ..Default::default() },
            vec![Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(1)),
        );
        let mut d = CmDriver::new(cm);
        let (fd, tenant_end) = Doorbell::pair().unwrap();
        // (As the session reserves, and more: a doorbell may hold more
        // than `MAX_UNREAD`, where `wmem_max` allows.)
        fd.reserve(2 * MAX_UNREAD);
        let channel = d.add_channel_with(C, T, fd, true).unwrap();
        let now = Instant(1);
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let create = |d: &mut CmDriver| match d.handle(
            C,
            T,
            CmRequest::CreateId { channel, ps: 0x0106 },
            now,
            &mut no_qps(),
        ) {
            Ok(CmReply::Id { id }) => id,
            other => panic!("{other:?}"),
        };
        for _ in 0..MAX_UNREAD + 200 {
            let id = create(&mut d);
            d.handle(C, T, CmRequest::ResolveAddr { id, src: None, dst }, now, &mut no_qps()).unwrap();
            d.run(now, |_, _, _| Ok(None), &mut no_qps());
            d.handle(C, T, CmRequest::DestroyId { id }, now, &mut no_qps()).unwrap();
        }
        let live = create(&mut d);
        d.handle(C, T, CmRequest::ResolveAddr { id: live, src: None, dst }, now, &mut no_qps()).unwrap();
        d.run(now, |_, _, _| Ok(None), &mut no_qps());
        assert!(
            d.channels[&channel].events.len() <= MAX_UNREAD + 1,
            "{} entries",
            d.channels[&channel].events.len()
        );
        // (The first rode its wake-up: taken as the library takes it.)
        assert!(tenant_end.take_one());
        let mut got = None;
        for _ in 0..4 {
            assert!(tenant_end.is_readable(), "readable while the live event waits");
            let Ok(CmReply::Events { events }) =
                d.handle(C, T, CmRequest::GetEvents { channel, max: 16 }, now, &mut no_qps())
            else {
                panic!("no reply");
            };
            let total: u64 = events.iter().map(|(_, w)| u64::from(*w)).sum();
            assert!(total <= MAX_UNREAD as u64, "a reply of {total} wake-ups");
            for (event, wakeups) in events {
                for _ in 0..wakeups {
                    assert!(tenant_end.take_one(), "each wake-up handed out was rung");
                }
                got = got.or(event);
            }
            if got.is_some() {
                break;
            }
        }
        assert_eq!(got.map(|e| e.id), Some(live));
        assert!(!tenant_end.is_readable(), "quiet once all are read");
    }

    /// A route the library resolved (`RouteReported`, or `ConnectRouted`
    /// with the connect) moves the id as `ResolveRoute` does, with the
    /// same errors, and makes no event: the library reported it.
    #[test]
    fn a_route_the_library_reported_moves_the_id_without_an_event() {
        let (mut d, _ends) = two_contexts();
        let now = Instant(1);
        let call = |d: &mut CmDriver, ctx, req| {
            let r = d.handle(ctx, T, req, now, &mut no_qps());
            d.run(now, |_, _, _| Err("not local"), &mut no_qps());
            r
        };
        let at = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 7471);
        let Ok(CmReply::Id { id: l }) = call(&mut d, SRV, CmRequest::CreateId { channel: 1, ps: 0x0106 })
        else {
            panic!()
        };
        call(&mut d, SRV, CmRequest::Bind { id: l, addr: at }).unwrap();
        call(&mut d, SRV, CmRequest::Listen { id: l, backlog: 8 }).unwrap();
        let id = |d: &mut CmDriver| {
            let Ok(CmReply::Id { id }) =
                d.handle(CLI, T, CmRequest::CreateId { channel: 2, ps: 0x0106 }, now, &mut no_qps())
            else {
                panic!()
            };
            id
        };
        // Before its address: the state is wrong, as for ResolveRoute.
        let (a, b) = (id(&mut d), id(&mut d));
        let e = call(&mut d, CLI, CmRequest::RouteReported { id: a }).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        let e = call(&mut d, CLI, CmRequest::ConnectRouted { id: a, conn: ConnInfo::default() }).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        // Another context's id is no id of the caller's.
        call(&mut d, CLI, CmRequest::ResolveAddr { id: a, src: None, dst: at }).unwrap();
        assert!(call(&mut d, SRV, CmRequest::RouteReported { id: a }).is_err());
        call(&mut d, CLI, CmRequest::RouteReported { id: a }).unwrap();
        assert_eq!(d.cm.state(CLI, a), Some(State::RouteResolved));
        let e = call(&mut d, CLI, CmRequest::RouteReported { id: a }).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "once, as ResolveRoute");
        call(&mut d, CLI, CmRequest::Connect { id: a, conn: ConnInfo::default() }).unwrap();
        call(&mut d, CLI, CmRequest::ResolveAddr { id: b, src: None, dst: at }).unwrap();
        call(&mut d, CLI, CmRequest::ConnectRouted { id: b, conn: ConnInfo::default() }).unwrap();
        assert_eq!(d.cm.state(CLI, b), Some(State::ReqSent));
        let kinds: Vec<_> =
            std::iter::from_fn(|| next_event(&mut d, CLI, 2)).map(|e| (e.id, e.kind)).collect();
        assert_eq!(kinds, [(a, EventKind::AddrResolved), (b, EventKind::AddrResolved)], "no ROUTE_RESOLVED");
        let reqs =
            std::iter::from_fn(|| next_event(&mut d, SRV, 1)).filter(|e| e.kind == EventKind::ConnectRequest);
        assert_eq!(reqs.count(), 2, "both connects went");
    }
}
