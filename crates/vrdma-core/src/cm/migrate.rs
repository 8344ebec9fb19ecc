//! A tenant's rdma_cm state moving with it (a VM's migration,
//! `docs/migration.md`, "rdma_cm ids and event channels").
//!
//! A guest that connected through rdma_cm holds ids and an event channel
//! in the daemon; its QP moves with the device state, so its ids must too,
//! or the program's next `rdma_get_cm_event` (a DISCONNECTED, say) never
//! comes. What moves is the ids with their state, addresses, both sides'
//! words and the peer's number, and each channel's unread events; ids keep
//! their numbers (the peer names the connection by them), so the importer
//! refuses one in use, as for QPNs.
//!
//! The rules, as a user of RDMA software expects them:
//!
//! - **A connection stays up.** Its ids keep their local address (what
//!   `rdma_get_local_addr` said stays true for the program, and the peer
//!   learns nothing from an address anyway: it names the connection by
//!   the ids' numbers). The resume sends the peer a [`CmMessage::Moved`],
//!   and the peer's manager sends there from then on. Whatever the peer
//!   said while the tenant was paused (a DREQ) was dropped at the source,
//!   whose state was being exported; the peer answers the Moved with it
//!   again: a connection it ended, or no longer knows, gets a DREQ, so the
//!   program hears DISCONNECTED once, after the resume.
//! - **A listener keeps listening** where its address means something on
//!   the destination: the wildcard, or an address the destination owns for
//!   the tenant (a VM's `address`, configured on both hosts). Elsewhere, or
//!   where its port is taken there, it ends with DEVICE_REMOVAL (status
//!   `-EADDRNOTAVAIL` or `-EADDRINUSE`): the program's listener is gone,
//!   as when the kernel's device goes, and it may listen again.
//! - **An id not connected yet** (bound, or its address or route
//!   resolved) takes the destination's source address for its destination
//!   when its address was the source host's, as a resolution there would
//!   give; a bound id whose address is not the destination's ends with
//!   DEVICE_REMOVAL.
//! - **A connection being set up** (REQ or REP sent, a request not yet
//!   answered) ends: CONNECT_ERROR (`-ECONNRESET`; UNREACHABLE for a REQ
//!   sent) after the events it had. Its peer's own timers end its side
//!   (unless the peer is established already, its RTU dropped at the
//!   paused source: that side stays up until its program disconnects or
//!   its link to the source ends). The other way round, a connection
//!   whose REP was sent here takes the Moved of a peer that moved
//!   established, its RTU late, for that RTU
//!   (`ConnectionManager::handle_moved`).
//!
//! Sans-IO like the rest: the driver keeps the channels and says which QP
//! each id holds; this module checks a snapshot as untrusted input
//! ([`CmSnapshot::check`]) and moves the ids in and out.

use std::net::{Ipv4Addr, SocketAddrV4};

use serde::{Deserialize, Serialize};

use super::{
    errno, message, CmEvent, CmId, CmMessage, ConnInfo, ConnectionManager, EventKind, PortSpace, State,
};
use crate::hca::migrate::SnapshotError;
use crate::hca::{ContextId, LinkId, TenantId};
use crate::proto::MAX_CM_UNREAD;
use crate::time::Instant;

/// Event channels one tenant may hold (the daemon's limit).
pub const MAX_CM_CHANNELS: usize = 256;
/// Ids one snapshot may carry (the manager's default quota).
pub const MAX_CM_IDS: usize = 4096;

/// An rdma_cm id in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmIdSnap {
    pub id: u32,
    pub ctx: u32,
    /// The event channel its events go to.
    pub channel: u32,
    pub ps: PortSpace,
    pub state: State,
    pub local: Option<SocketAddrV4>,
    pub remote: Option<SocketAddrV4>,
    pub reuse: bool,
    /// The peer's host and its number for the connection.
    pub peer: Option<(Ipv4Addr, u32)>,
    pub backlog: u32,
    pub active: bool,
    pub psn: u32,
    pub ours: Option<ConnInfo>,
    pub theirs: Option<ConnInfo>,
    /// The QP attached (`CmRequest::AttachQp`): its context and QPN.
    pub qp: Option<(u32, u32)>,
}

/// An event channel in a snapshot: its number (the library names it in
/// its calls), context, and its events not yet read, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmChannelSnap {
    pub channel: u32,
    pub ctx: u32,
    pub events: Vec<CmEvent>,
}

/// A tenant's rdma_cm state (snapshot version 5).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmSnapshot {
    pub channels: Vec<CmChannelSnap>,
    pub ids: Vec<CmIdSnap>,
}

fn bad(msg: String) -> SnapshotError {
    SnapshotError::Invalid(format!("rdma_cm: {msg}"))
}

fn conn_ok(c: &Option<ConnInfo>) -> bool {
    c.as_ref().is_none_or(|c| c.private_data.len() <= message::MAX_REP_PRIVATE_DATA)
}

impl CmSnapshot {
    /// Checks the snapshot as untrusted input: every number in range and
    /// once, every reference (a channel's context, an id's channel and QP,
    /// an event's id) to something of the snapshot, in the same context;
    /// bounds on counts and sizes. `contexts`: the snapshot's contexts;
    /// `qps`: its QPs (context, QPN).
    pub fn check(&self, contexts: &[u32], qps: &[(u32, u32)]) -> Result<(), SnapshotError> {
        if self.channels.len() > MAX_CM_CHANNELS {
            return Err(bad(format!("{} event channels, more than {MAX_CM_CHANNELS}", self.channels.len())));
        }
        if self.ids.len() > MAX_CM_IDS {
            return Err(bad(format!("{} ids, more than {MAX_CM_IDS}", self.ids.len())));
        }
        let mut channels = std::collections::HashMap::new();
        for c in &self.channels {
            if c.channel == 0 || channels.insert(c.channel, c.ctx).is_some() {
                return Err(bad(format!("event channel {:#x} numbered 0 or twice", c.channel)));
            }
            if !contexts.contains(&c.ctx) {
                return Err(bad(format!(
                    "event channel {:#x} of context {}, not in the snapshot",
                    c.channel, c.ctx
                )));
            }
            if c.events.len() > MAX_CM_UNREAD as usize {
                return Err(bad(format!(
                    "event channel {:#x} holds more than {MAX_CM_UNREAD} events",
                    c.channel
                )));
            }
        }
        let mut ids = std::collections::HashMap::new();
        for i in &self.ids {
            if i.id == 0 || ids.insert(i.id, i.ctx).is_some() {
                return Err(bad(format!("id {:#x} numbered 0 or twice", i.id)));
            }
            if channels.get(&i.channel) != Some(&i.ctx) {
                return Err(bad(format!(
                    "id {:#x} on event channel {:#x}, not one of its context",
                    i.id, i.channel
                )));
            }
            if let Some(qp) = i.qp {
                if !qps.contains(&qp) {
                    return Err(bad(format!("id {:#x} holds QP {:#x}, not in the snapshot", i.id, qp.1)));
                }
            }
            if i.psn > 0x00ff_ffff || !conn_ok(&i.ours) || !conn_ok(&i.theirs) {
                return Err(bad(format!("id {:#x}: PSN or private data out of range", i.id)));
            }
            let connected = matches!(
                i.state,
                State::ReqSent
                    | State::RepReceived
                    | State::ReqReceived
                    | State::RepSent
                    | State::Established
                    | State::DreqSent
            );
            if connected && i.peer.is_none() {
                return Err(bad(format!("id {:#x} connected to no peer", i.id)));
            }
            if i.state == State::Listening && i.local.is_none() {
                return Err(bad(format!("listener {:#x} bound to no address", i.id)));
            }
        }
        for c in &self.channels {
            for e in &c.events {
                // An event names an id of the channel's context (a
                // CONNECT_REQUEST's new id, or the id it is about).
                if e.ctx.0 != c.ctx || ids.get(&e.id) != Some(&c.ctx) {
                    return Err(bad(format!(
                        "an event of channel {:#x} names id {:#x}, not its context's",
                        c.channel, e.id
                    )));
                }
                if e.listen_id.is_some_and(|l| ids.get(&l) != Some(&c.ctx)) || !conn_ok(&e.peer) {
                    return Err(bad(format!(
                        "an event of channel {:#x} names no listener of its context",
                        c.channel
                    )));
                }
            }
        }
        Ok(())
    }
}

impl ConnectionManager {
    /// Pauses `tenant`'s ids: messages for them are dropped and their
    /// timers stop (the state being exported must not change; the resume
    /// asks the peers again).
    pub fn pause_tenant(&mut self, tenant: TenantId) {
        self.paused.insert(tenant);
        let mine: Vec<u32> = self.ids.iter().filter(|(_, i)| i.tenant == tenant).map(|(&n, _)| n).collect();
        for id in mine {
            self.arm(id, None);
        }
    }

    /// The ids of `ctxs`, for a snapshot; the driver fills in each id's
    /// channel and QP.
    pub fn export_ids(&self, ctxs: &[ContextId]) -> Vec<CmIdSnap> {
        let mut out: Vec<CmIdSnap> = (self.ids.iter())
            .filter(|(_, i)| ctxs.contains(&i.ctx))
            .map(|(&id, i)| CmIdSnap {
                id,
                ctx: i.ctx.0,
                channel: 0,
                ps: i.ps,
                state: i.state,
                local: i.local,
                remote: i.remote,
                reuse: i.reuse,
                peer: i.peer,
                backlog: i.backlog,
                active: i.active,
                psn: i.psn,
                ours: i.ours.clone(),
                theirs: i.theirs.clone(),
                qp: None,
            })
            .collect();
        out.sort_by_key(|i| i.id);
        out
    }

    /// The ids of `ctxs` go without a word to their peers (the tenant
    /// moved: the peers follow it to its new host), and `tenant` is no
    /// longer paused here.
    pub fn forget_contexts(&mut self, tenant: TenantId, ctxs: &[ContextId]) {
        let mine: Vec<u32> =
            self.ids.iter().filter(|(_, i)| ctxs.contains(&i.ctx)).map(|(&n, _)| n).collect();
        for id in mine {
            self.leave_listener(id);
            self.arm(id, None);
            let Some(i) = self.ids.remove(&id) else { continue };
            self.requested.retain(|_, v| *v != id);
            if let Some(n) = self.per_tenant.get_mut(&i.tenant) {
                *n = n.saturating_sub(1);
            }
            if let Some(l) = i.local {
                self.ports.unbind(i.ps, l.port(), id);
            }
        }
        self.events.retain(|e| !ctxs.contains(&e.ctx));
        self.paused.remove(&tenant);
    }

    /// Whether an id numbered `id` is in use here.
    pub fn has_id(&self, id: u32) -> bool {
        self.ids.contains_key(&id)
    }

    /// Whether [`import_ids`](Self::import_ids) would take `ids`: none in
    /// use here, and the tenant's quota holds them. Asked before anything
    /// of the import changes.
    pub fn check_import(&self, tenant: TenantId, ids: &[CmIdSnap]) -> Result<(), SnapshotError> {
        if let Some(i) = ids.iter().find(|i| self.ids.contains_key(&i.id)) {
            return Err(SnapshotError::Collision(format!("rdma_cm id {:#x} is in use here", i.id)));
        }
        let held = self.per_tenant.get(&tenant).copied().unwrap_or(0);
        if held as usize + ids.len() > self.config.max_ids_per_tenant as usize {
            return Err(SnapshotError::Quota(format!(
                "{} rdma_cm ids more than the tenant's limit of {} (it holds {held} here)",
                ids.len(),
                self.config.max_ids_per_tenant
            )));
        }
        Ok(())
    }

    /// Takes `tenant`'s ids from a snapshot checked by
    /// [`CmSnapshot::check`], paused until [`resume_tenant`]. Refused,
    /// changing nothing, for an id in use here or over the tenant's quota.
    /// Ids that cannot go on here (see the module) end with an event,
    /// queued after the snapshot's (the driver delivers them).
    ///
    /// [`resume_tenant`]: Self::resume_tenant
    pub fn import_ids(&mut self, tenant: TenantId, ids: &[CmIdSnap]) -> Result<(), SnapshotError> {
        self.check_import(tenant, ids)?;
        self.paused.insert(tenant);
        *self.per_tenant.entry(tenant).or_default() += ids.len() as u32;
        // Listeners first, so that nothing else takes their ports.
        let mut order: Vec<&CmIdSnap> = ids.iter().collect();
        order.sort_by_key(|i| (i.state != State::Listening, i.id));
        for s in order {
            self.ids.insert(
                s.id,
                CmId {
                    ctx: ContextId(s.ctx),
                    tenant,
                    ps: s.ps,
                    state: s.state,
                    local: s.local,
                    remote: s.remote,
                    reuse: s.reuse,
                    peer: s.peer,
                    // Taken at its first message (the Moved of the resume).
                    link: None,
                    requested_as: None,
                    backlog: s.backlog.min(self.config.max_backlog),
                    pending: 0,
                    listener: None,
                    active: s.active,
                    psn: s.psn & 0x00ff_ffff,
                    ours: s.ours.clone(),
                    theirs: s.theirs.clone(),
                    deadline: None,
                    dreq_waiting: false,
                },
            );
            self.settle_imported(s.id, tenant);
        }
        Ok(())
    }

    /// Whether `ip` is an address `tenant`'s ids may hold here.
    fn ours_here(&self, ip: Ipv4Addr, tenant: TenantId) -> bool {
        ip.is_unspecified() || self.is_local(ip) && self.tenant_addrs.get(&ip).is_none_or(|&t| t == tenant)
    }

    /// An imported id made to fit this host (the rules of the module).
    fn settle_imported(&mut self, id: u32, tenant: TenantId) {
        let i = &self.ids[&id];
        let (state, ps, reuse, local, remote) = (i.state, i.ps, i.reuse, i.local, i.remote);
        let end = |cm: &mut Self, kind, status| {
            cm.close(id, kind, status);
        };
        match state {
            State::Idle | State::Established | State::DreqSent | State::Closed => {}
            State::ReqSent => end(self, EventKind::Unreachable, -errno::ECONNRESET),
            State::RepReceived | State::ReqReceived | State::RepSent => {
                end(self, EventKind::ConnectError, -errno::ECONNRESET)
            }
            State::Bound | State::AddrResolved | State::RouteResolved | State::Listening => {
                let Some(mut l) = local else { return };
                if !self.ours_here(*l.ip(), tenant) {
                    match (state, remote) {
                        // As a resolution here would give.
                        (State::AddrResolved | State::RouteResolved, Some(r)) => {
                            l.set_ip(self.source_for(*r.ip(), tenant));
                        }
                        _ => return end(self, EventKind::DeviceRemoval, -errno::EADDRNOTAVAIL),
                    }
                }
                let resolved = matches!(state, State::AddrResolved | State::RouteResolved);
                let port = match self.ports.bind(ps, *l.ip(), l.port(), id, reuse) {
                    Ok(p) => p,
                    // An id not connected yet names no port to its peer.
                    Err(_) if resolved => match self.ports.bind(ps, *l.ip(), 0, id, reuse) {
                        Ok(p) => p,
                        Err(_) => return end(self, EventKind::DeviceRemoval, -errno::EADDRINUSE),
                    },
                    Err(_) => {
                        self.ids.get_mut(&id).expect("inserted").local = None;
                        return end(self, EventKind::DeviceRemoval, -errno::EADDRINUSE);
                    }
                };
                if state == State::Listening && self.ports.listen(ps, port, id).is_err() {
                    self.ports.unbind(ps, port, id);
                    self.ids.get_mut(&id).expect("inserted").local = None;
                    return end(self, EventKind::DeviceRemoval, -errno::EADDRINUSE);
                }
                self.ids.get_mut(&id).expect("inserted").local = Some(SocketAddrV4::new(*l.ip(), port));
            }
        }
    }

    /// Resumes `tenant`'s ids here (after an import, or a cancelled
    /// migration at the source): each connection tells its peer where it
    /// is now ([`CmMessage::Moved`]); a DREQ of ours still unanswered is
    /// waited for again from `now`.
    pub fn resume_tenant(&mut self, tenant: TenantId, now: Instant) {
        self.paused.remove(&tenant);
        let mine: Vec<(u32, State, (Ipv4Addr, u32))> = (self.ids.iter())
            .filter(|(_, i)| i.tenant == tenant)
            .filter_map(|(&n, i)| Some((n, i.state, i.peer?)))
            .collect();
        for (id, state, (_, theirs)) in mine {
            if theirs == 0 || !matches!(state, State::Established | State::DreqSent) {
                continue;
            }
            self.send_for(id, CmMessage::Moved { to: theirs, from: id, tenant: tenant.0 });
            if state == State::DreqSent {
                self.arm(id, Some(now + self.config.disconnect_timeout));
            }
        }
    }

    /// The peer of our connection `to` says it moved to `host` (the
    /// connection goes by the link the Moved came by from now on). Taken
    /// only for a connection that was up, or whose REP we sent (the Moved
    /// stands for its late RTU: ESTABLISHED); see the body. Others are
    /// answered with a DREQ where the connection is not here, or dropped.
    pub(super) fn handle_moved(
        &mut self,
        host: Ipv4Addr,
        link: Option<LinkId>,
        to: u32,
        from: u32,
        tenant: TenantId,
    ) {
        // Both ends moving at once (not handled, docs/migration.md): this
        // side, paused, holds still rather than end the connection.
        if self.ids.get(&to).is_some_and(|i| self.paused.contains(&i.tenant)) {
            return;
        }
        // A mover names its side by its number, never 0 (which stands for
        // a peer not yet known, as in a REQ sent unanswered): nothing to
        // move, nor to answer.
        if from == 0 {
            return;
        }
        let ours =
            self.ids.get(&to).is_some_and(|i| i.tenant == tenant && i.peer.is_some_and(|(_, n)| n == from));
        let dreq = CmMessage::Dreq { to: from, from: to };
        if !ours {
            // No such connection here (ended and destroyed, or never ours):
            // it is over, and the mover hears so.
            self.transmit.push_back((host, link, dreq));
            return;
        }
        // Only a connection that was up sends one ([`Self::resume_tenant`]:
        // established, or its DREQ sent), so only one that was up here,
        // or ended since, takes it; or one whose REP we sent, by the
        // number the REQ gave (never 0): the mover's side was up, so its
        // RTU was sent, and is late (it lags behind the move on the old
        // host's link, or was lost with it). The Moved stands for it: the
        // connection is established, then follows the mover, and the late
        // RTU from the old host finds it moved and is dropped. Any other
        // being set up (a REQ sent or come, a REP come) was not up on the
        // mover's side, which ended it at the move; a Moved for it (a
        // daemon that claims its peer's tenant and numbers) is dropped,
        // and the connection keeps its link (it hears only what comes by
        // that, `by_its_link`).
        match self.ids.get(&to).map(|i| i.state) {
            Some(State::Established | State::DreqSent | State::Closed) => {}
            Some(State::RepSent) => self.rtu_came(to),
            _ => return,
        }
        let i = self.ids.get_mut(&to).expect("looked up above");
        i.peer = Some((host, from));
        i.link = link;
        match i.state {
            // Ours went to the old host while the peer was paused (and was
            // dropped there), or the connection ended here meanwhile.
            State::DreqSent | State::Closed => self.send_for(to, dreq),
            _ => {}
        }
    }
}

#[cfg(test)]
#[path = "migrate_tests.rs"]
mod tests;
