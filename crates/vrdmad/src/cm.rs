//! The connection manager's driver: the core's [`ConnectionManager`] on
//! the engine thread, its events delivered to the tenants' event channels,
//! its messages carried to the manager they are for.
//!
//! The engine thread owns it, as it owns the HCA, so that the exchange
//! between two processes of this host needs no lock and no other thread.
//! A message for an address of this host is handed straight back to the
//! manager; one for another host rides the authenticated link to that
//! host's daemon (a connection manager's frame, `docs/wire-protocol.md`),
//! dialled for it if need be. Where it cannot go (the transport is off,
//! the host is outside `net.allow`, the dial fails, the link goes down),
//! the connections with that host end at once (UNREACHABLE before they
//! are established, DISCONNECTED after), and the daemon says why in its
//! log.

use std::collections::{HashMap, VecDeque};

use std::net::Ipv4Addr;

use vrdma_core::cm::{CmError, CmEvent, CmMessage, ConnectionManager, EventKind, PortSpace};
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
    /// Events in order; `None` where one went with its id (destroyed, or
    /// moved to another channel) after its wake-up was rung: the tenant
    /// takes that wake-up with the next event it reads.
    events: VecDeque<Option<CmEvent>>,
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
                self.cm.destroy_id(ctx, id)?;
                self.id_channel.remove(&id);
                // Its events not yet read go with it, as the kernel's do.
                for c in self.channels.values_mut().filter(|c| c.ctx == ctx) {
                    for e in c.events.iter_mut() {
                        if e.as_ref().is_some_and(|e| e.id == id) {
                            *e = None;
                        }
                    }
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
                    }
                }
                if let Some(c) = self.channels.get_mut(&channel) {
                    for ev in moved {
                        c.events.push_back(Some(ev));
                        c.fd.ring_one();
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
            CmRequest::HasListener { ps, addr } => {
                let ps = PortSpace::from_raw(ps).ok_or(CmCallError::PortSpace(ps))?;
                CmReply::Listening(self.cm.has_listener(tenant, ps, addr))
            }
            CmRequest::GetEvent { channel } => {
                self.own_channel(ctx, channel)?;
                // (The tenant takes the wake-ups from its end of the
                // doorbell: readable while any event is left.)
                let c = self.channels.get_mut(&channel).expect("checked above");
                let mut wakeups = 0;
                let mut event = None;
                while let Some(e) = c.events.pop_front() {
                    wakeups += 1;
                    if e.is_some() {
                        event = e;
                        break;
                    }
                }
                CmReply::Event { event, wakeups }
            }
        };
        Ok(reply)
    }

    fn addrs(&self, ctx: ContextId, id: u32) -> Result<CmReply, CmCallError> {
        let (local, remote) = self.cm.addresses(ctx, id).ok_or(CmError::NoSuchId)?;
        Ok(CmReply::Addrs { local, remote })
    }

    /// Carries the manager's messages and delivers its events; runs its
    /// timers due at `now`. A message for another host goes through
    /// `send`, whose refusal ends the connections with that host (as a
    /// dead host would, promptly). Returns when it next needs to run.
    pub fn run(
        &mut self,
        now: Instant,
        mut send: impl FnMut(Ipv4Addr, &CmMessage) -> Result<(), &'static str>,
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
                let Some((host, msg)) = self.cm.poll_transmit() else { break };
                if self.cm.is_local(host) {
                    // Both ends are here: the sender is named by the address
                    // the message went to, which is the one each side knows
                    // the other by.
                    self.cm.handle_message(host, msg);
                } else if let Err(why) = send(host, &msg) {
                    const UNREACHABLE: &str = "an rdma_cm message cannot reach its host: its connections end";
                    limited_warn!(self.log, Source::Address(host.into()), now, UNREACHABLE, %host, why);
                    self.cm.link_down(host);
                }
            }
            while let Some(ev) = self.cm.poll_event() {
                self.deliver(ev);
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
        c.events.push_back(Some(ev));
        if !c.fd.ring_one() {
            // The socket buffer holds fewer wake-ups than events unread
            // (net.core.wmem_max): the event waits, and a tenant that
            // reads its events in a loop after a wake-up still finds it.
            tracing::debug!(channel, "rdma_cm event channel doorbell full");
        }
    }

    /// Destroys everything of `ctx` (its process closed the device or died).
    /// (The engine then runs the manager, which sends the DREQs.)
    pub fn close_context(&mut self, ctx: ContextId) {
        self.cm.close_context(ctx);
        let cm = &self.cm;
        self.id_channel.retain(|&id, _| cm.owner(id).is_some());
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
                let Ok(CmReply::Id { id }) = d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now)
                else {
                    panic!("no id");
                };
                for req in [
                    CmRequest::ResolveAddr { id, src: None, dst },
                    CmRequest::ResolveRoute { id },
                    CmRequest::Connect { id, conn: ConnInfo::default() },
                ] {
                    d.handle(C, T, req, now).unwrap();
                    d.run(now, |_, _| Err("the transport between daemons is off"));
                }
            }
        });
        let mut kinds = Vec::new();
        while let Ok(CmReply::Event { event: Some(ev), wakeups }) =
            d.handle(C, T, CmRequest::GetEvent { channel }, now)
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
            let Ok(CmReply::Id { id: l }) = d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now)
            else {
                panic!("no id");
            };
            d.handle(C, T, CmRequest::Bind { id: l, addr: at }, now).unwrap();
            d.handle(C, T, CmRequest::Listen { id: l, backlog: 0 }, now).unwrap();
            for _ in 0..1024 {
                from += 1;
                let conn = ConnInfo::default();
                let req = CmMessage::Req { from, tenant: T.0, ps: PortSpace::Tcp, src, dst: at, conn };
                d.cm.handle_message(*src.ip(), req);
                d.run(now, |_, m| {
                    refused += usize::from(matches!(m, CmMessage::Rej { .. }));
                    Ok(())
                });
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
        let id = |d: &mut CmDriver| match d.handle(C, T, CmRequest::CreateId { channel, ps: 0x0106 }, now) {
            Ok(CmReply::Id { id }) => id,
            other => panic!("{other:?}"),
        };
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 9), 7471);
        let (gone, kept) = (id(&mut d), id(&mut d));
        d.handle(C, T, CmRequest::ResolveAddr { id: gone, src: None, dst }, now).unwrap();
        d.handle(C, T, CmRequest::ResolveAddr { id: kept, src: None, dst }, now).unwrap();
        d.run(now, |_, _| Ok(()));
        d.handle(C, T, CmRequest::DestroyId { id: gone }, now).unwrap();
        let reply = d.handle(C, T, CmRequest::GetEvent { channel }, now).unwrap();
        let CmReply::Event { event: Some(ev), wakeups: 2 } = reply else { panic!("{reply:?}") };
        assert_eq!((ev.id, ev.kind), (kept, EventKind::AddrResolved));
        assert!(tenant_end.take_one() && tenant_end.take_one(), "two were rung");
        assert!(!tenant_end.take_one(), "and nothing more: the descriptor is quiet");
        let reply = d.handle(C, T, CmRequest::GetEvent { channel }, now).unwrap();
        assert!(matches!(reply, CmReply::Event { event: None, wakeups: 0 }), "{reply:?}");
    }
}
