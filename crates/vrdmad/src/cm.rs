//! The connection manager's driver: the core's [`ConnectionManager`] on
//! the engine thread, its events delivered to the tenants' event channels,
//! its messages carried to the manager they are for.
//!
//! The engine thread owns it, as it owns the HCA, so that the exchange
//! between two processes of this host needs no lock and no other thread.
//! A message for an address of this host is handed straight back to the
//! manager. Messages for other hosts would ride the links between daemons;
//! until that transport carries them, a request to another host ends at
//! once in UNREACHABLE, and the daemon says why in its log.

use std::collections::{HashMap, VecDeque};

use vrdma_core::cm::{CmError, CmEvent, ConnectionManager, EventKind, PortSpace};
use vrdma_core::hca::{ContextId, TenantId};
use vrdma_core::limited_warn;
use vrdma_core::log_limit::{LogLimiter, Source};
use vrdma_core::proto::{CmReply, CmRequest};
use vrdma_core::time::Instant;
use vrdma_shm::Doorbell;

/// Event channels one tenant may hold: each keeps a descriptor in the
/// daemon.
pub const MAX_CHANNELS_PER_TENANT: usize = 256;

/// Events one channel holds unread at most. A channel's events come from
/// its ids, which the tenant's id quota bounds, a few each; past this the
/// tenant is not reading them, and its listeners' new requests are
/// refused rather than queued without end (see [`CmDriver::deliver`]).
pub const MAX_UNREAD: usize = 4096;

/// A tenant's event channel: events wait here until its owner asks for
/// them; its doorbell is readable while any do.
struct EventChannel {
    ctx: ContextId,
    tenant: TenantId,
    fd: Doorbell,
    events: VecDeque<CmEvent>,
}

pub struct CmDriver {
    pub cm: ConnectionManager,
    channels: HashMap<u32, EventChannel>,
    /// The channel of each id.
    id_channel: HashMap<u32, u32>,
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
}

impl CmCallError {
    pub fn errno(&self) -> i32 {
        match self {
            CmCallError::Cm(e) => e.errno(),
            CmCallError::NoChannel(_) | CmCallError::PortSpace(_) => libc::EINVAL,
            CmCallError::Channels => libc::EMFILE,
            CmCallError::Busy => libc::EBUSY,
        }
    }
}

impl CmDriver {
    pub fn new(cm: ConnectionManager) -> CmDriver {
        CmDriver {
            cm,
            channels: HashMap::new(),
            id_channel: HashMap::new(),
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
        if self.channels.values().filter(|c| c.tenant == tenant).count() >= MAX_CHANNELS_PER_TENANT {
            return Err(CmCallError::Channels);
        }
        let id = loop {
            self.next_channel = self.next_channel.wrapping_add(1).max(1);
            if !self.channels.contains_key(&self.next_channel) {
                break self.next_channel;
            }
        };
        self.channels.insert(id, EventChannel { ctx, tenant, fd, events: VecDeque::new() });
        Ok(id)
    }

    fn own_channel(&self, ctx: ContextId, channel: u32) -> Result<(), CmCallError> {
        match self.channels.get(&channel) {
            Some(c) if c.ctx == ctx => Ok(()),
            _ => Err(CmCallError::NoChannel(channel)),
        }
    }

    /// One call of a tenant's context.
    pub fn handle(
        &mut self,
        ctx: ContextId,
        tenant: TenantId,
        req: CmRequest,
        now: Instant,
    ) -> Result<CmReply, CmCallError> {
        let done = CmReply::Event(None);
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
                self.cm.destroy_id(ctx, id)?;
                self.id_channel.remove(&id);
                // Its events not yet read go with it, as the kernel's do.
                for c in self.channels.values_mut().filter(|c| c.ctx == ctx) {
                    c.events.retain(|e| e.id != id);
                }
                done
            }
            CmRequest::MigrateId { id, channel } => {
                self.own_channel(ctx, channel)?;
                self.cm.state(ctx, id).ok_or(CmError::NoSuchId)?;
                self.id_channel.insert(id, channel);
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
                self.cm.connect(ctx, id, conn, now)?;
                done
            }
            CmRequest::Accept { id, conn, qkey } => {
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
                self.cm.disconnect(ctx, id, now)?;
                done
            }
            CmRequest::InitQpAttr { id, state } => {
                let (attr, mask) = self.cm.init_qp_attr(ctx, id, state)?;
                CmReply::QpAttr { attr, mask }
            }
            CmRequest::QueryAddr { id } => self.addrs(ctx, id)?,
            CmRequest::GetEvent { channel } => {
                self.own_channel(ctx, channel)?;
                // (The tenant takes the event's datagram from its end of
                // the doorbell: readable while any event is left.)
                let c = self.channels.get_mut(&channel).expect("checked above");
                CmReply::Event(c.events.pop_front())
            }
        };
        self.run(now);
        Ok(reply)
    }

    fn addrs(&self, ctx: ContextId, id: u32) -> Result<CmReply, CmCallError> {
        let (local, remote) = self.cm.addresses(ctx, id).ok_or(CmError::NoSuchId)?;
        Ok(CmReply::Addrs { local, remote })
    }

    /// Carries the manager's messages and delivers its events; runs its
    /// timers due at `now`. Returns when it next needs to run.
    pub fn run(&mut self, now: Instant) -> Option<Instant> {
        if self.cm.poll_timeout().is_some_and(|t| t <= now) {
            self.cm.handle_timeout(now);
        }
        // Bounded: each message answered locally makes at most one more
        // (REQ → REP → RTU, DREQ → DREP), and calls come one at a time.
        for _ in 0..1024 {
            let Some((host, msg)) = self.cm.poll_transmit() else { break };
            if self.cm.is_local(host) {
                // Both ends are here: the sender is named by the address
                // the message went to, which is the one each side knows
                // the other by.
                self.cm.handle_message(host, msg);
            } else {
                const NO_TRANSPORT: &str =
                    "an rdma_cm request is for another host, and rdma_cm between hosts \
                                            is not supported yet: it ends in UNREACHABLE";
                limited_warn!(self.log, Source::Anyone, now, NO_TRANSPORT, %host);
                self.cm.link_down(host);
            }
        }
        while let Some(ev) = self.cm.poll_event() {
            self.deliver(ev);
        }
        self.log.sweep(now);
        self.cm.poll_timeout()
    }

    /// Puts an event in its id's channel.
    fn deliver(&mut self, ev: CmEvent) {
        let channel = match ev.listen_id {
            // A request's new id goes where its listener's events go.
            Some(l) if ev.kind == EventKind::ConnectRequest => self.id_channel.get(&l).copied(),
            _ => self.id_channel.get(&ev.id).copied(),
        };
        let Some(ch) = channel.and_then(|c| self.channels.get_mut(&c).map(|ch| (c, ch))) else { return };
        let (channel, c) = ch;
        if c.events.len() >= MAX_UNREAD {
            // A tenant that reads none of its events: a new request is
            // turned away (the requester hears a REJ), never queued.
            if ev.kind == EventKind::ConnectRequest {
                let _ = self.cm.reject(ev.ctx, ev.id, Vec::new());
                let _ = self.cm.destroy_id(ev.ctx, ev.id);
                return;
            }
        }
        if ev.kind == EventKind::ConnectRequest {
            self.id_channel.insert(ev.id, channel);
        }
        c.events.push_back(ev);
        if !c.fd.ring_one() {
            // The socket buffer holds fewer wake-ups than events unread
            // (net.core.wmem_max): the event waits, and a tenant that
            // reads its events in a loop after a wake-up still finds it.
            tracing::debug!(channel, "rdma_cm event channel doorbell full");
        }
    }

    /// Destroys everything of `ctx` (its process closed the device or died).
    pub fn close_context(&mut self, ctx: ContextId, now: Instant) {
        self.cm.close_context(ctx);
        let cm = &self.cm;
        self.id_channel.retain(|&id, _| cm.owner(id).is_some());
        self.channels.retain(|_, c| c.ctx != ctx);
        self.run(now);
    }
}
