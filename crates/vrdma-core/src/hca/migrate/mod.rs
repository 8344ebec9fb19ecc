//! Live migration of a tenant's device state between hosts: pause,
//! export, import, resume, and the rules for the peers that wait.
//!
//! The daemon owns all of a tenant's device state, so it can move it with
//! the tenant (a VM; later a checkpointed process), transparently to the
//! tenant's peers on other hosts. The sequence, driven by the daemons:
//!
//! 1. [`Hca::pause_tenant`] on the source: the tenant's QPs send nothing
//!    more; a request that arrives for one is answered with a PAUSED NAK
//!    (`NakCode::QpPaused`), an answer to one of its requests is dropped
//!    (it comes again to where the QP resumes).
//! 2. [`Hca::export_tenant`]: the snapshot ([`TenantSnapshot`]) of every
//!    object, with the same numbers: PDs, MRs with their keys, CQs, SRQs,
//!    AHs, QPs with their QPNs, states, attributes, PSNs and outstanding
//!    work requests. Memory contents and queue rings are not in it: they
//!    are the tenant's shared memory, which moves with the VM.
//! 3. [`Hca::import_tenant`] on the destination: the snapshot is untrusted
//!    input, every id and bound checked, numbers in use refused, quotas
//!    charged; the QPs arrive paused.
//! 4. [`Hca::resume_tenant`] there: each connected RC QP announces its new
//!    location to its peer with a Moved frame (epoch one higher than the
//!    last), then sends again from its oldest unacknowledged PSN.
//!    [`Hca::finish_export`] on the source drops the tenant's objects.
//!    (A cancelled migration is [`Hca::resume_tenant`] on the source.)
//!
//! The peer's requester, told PAUSED, keeps its work requests and probes
//! the paused QP every `migration_probe_interval`, spending no retry;
//! after `migration_pause_limit` it fails `RETRY_EXC_ERR`, as for a dead
//! host. Its daemon moves the QP to the link a Moved frame came on when
//! the frame names its QP, the tenant's network and a higher epoch
//! ([`Hca::handle_moved`]); from then on frames about that QP from any
//! other link, the old location's included, are dropped.
//!
//! Design and limits: `docs/migration.md`.

mod import;
pub mod placement;
mod snapshot;

pub use import::MrImport;
pub use placement::{
    ChannelAt, Extent, MemoryAt, MrAt, MrPiecesAt, Placement, QpAt, RingAt, MAX_CHANNELS_PER_TENANT,
};
pub use snapshot::{
    AhSnap, AnswerSnap, CqSnap, InMsgSnap, MrSnap, PdSnap, QpSnap, RecvSnap, SendSnap, SentSnap,
    SnapshotError, SrqSnap, TenantSnapshot, WrBytes, MAX_SNAPSHOT_BYTES, SNAPSHOT_MAGIC, SNAPSHOT_VERSION,
};

use super::remote::{LinkId, Transmit};
use super::{Hca, TenantId};
use crate::time::Instant;
use crate::verbs::{QpState, QpType};
use crate::wire::{Aeth, DataRepr, FrameRepr, MovedRepr, NakCode, Opcode, Syndrome};

/// PAUSED NAKs queued on one link before more requests are dropped
/// unanswered (the requester's transport timer covers those).
const MAX_PAUSED_NAKS: usize = 1024;

/// Why a migration step was refused on the source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    #[error("tenant {0} has no context on this host")]
    NoSuchTenant(u32),
    #[error("tenant {0} is local to this host (a uid in another namespace) and cannot move")]
    HostLocal(u32),
    #[error("tenant {0} is not paused")]
    NotPaused(u32),
    #[error("not yet: {0}")]
    Busy(String),
    #[error("not supported yet: {0}")]
    Unsupported(String),
}

impl Hca {
    fn tenant_qps(&self, tenant: TenantId) -> Vec<u32> {
        let mut v: Vec<u32> = self.qps.iter().filter(|(_, q)| q.tenant == tenant).map(|(&n, _)| n).collect();
        v.sort_unstable();
        v
    }

    fn check_movable(&self, tenant: TenantId) -> Result<(), MigrateError> {
        if tenant.is_host_local() {
            return Err(MigrateError::HostLocal(tenant.0));
        }
        if !self.contexts.values().any(|c| c.tenant == tenant) {
            return Err(MigrateError::NoSuchTenant(tenant.0));
        }
        Ok(())
    }

    /// Pauses every QP of `tenant`: they send nothing more, answer
    /// requests with PAUSED, drop answers. Returns how many QPs it holds.
    pub fn pause_tenant(&mut self, tenant: TenantId) -> Result<usize, MigrateError> {
        self.check_movable(tenant)?;
        self.paused_tenants.insert(tenant);
        let qps = self.tenant_qps(tenant);
        for &qpn in &qps {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.paused = true;
            }
            self.update_service(qpn);
        }
        tracing::info!(tenant = tenant.0, qps = qps.len(), "tenant paused for a migration");
        Ok(qps.len())
    }

    /// The contexts `tenant` holds here, in order (a driver ends their
    /// sessions after [`Hca::finish_export`]).
    pub fn tenant_contexts(&self, tenant: TenantId) -> Vec<super::ContextId> {
        let mut v: Vec<super::ContextId> =
            self.contexts.iter().filter(|(_, c)| c.tenant == tenant).map(|(&k, _)| k).collect();
        v.sort_unstable();
        v
    }

    /// Whether `tenant` is paused for a migration: by
    /// [`Hca::pause_tenant`] here, or imported here paused, and neither
    /// resumed nor finished since. A tenant never paused is not, whatever
    /// objects it holds.
    pub fn is_paused(&self, tenant: TenantId) -> bool {
        self.paused_tenants.contains(&tenant)
    }

    /// Refuses a control call of `ctx` that would change its tenant's
    /// device state while the tenant is paused: the snapshot, taken after
    /// the pause, would not hold the change, and the destination would
    /// never see it. Queries are not refused. The daemon holds such calls
    /// before they get here; this is what makes the rule hold for any
    /// driver.
    pub(crate) fn refuse_paused(&self, ctx: super::ContextId) -> Result<(), super::HcaError> {
        match self.contexts.get(&ctx) {
            Some(c) if self.paused_tenants.contains(&c.tenant) => {
                Err(super::HcaError::TenantPaused(c.tenant.0))
            }
            _ => Ok(()),
        }
    }

    /// The snapshot of a paused tenant's device state, encoded. The
    /// tenant stays here, paused, until [`Hca::finish_export`] (moved) or
    /// [`Hca::resume_tenant`] (cancelled).
    pub fn export_tenant(&self, tenant: TenantId) -> Result<Vec<u8>, MigrateError> {
        self.snapshot_tenant(tenant).map(|s| s.encode())
    }

    /// [`Hca::export_tenant`], not encoded.
    pub fn snapshot_tenant(&self, tenant: TenantId) -> Result<TenantSnapshot, MigrateError> {
        self.check_movable(tenant)?;
        if !self.is_paused(tenant) {
            return Err(MigrateError::NotPaused(tenant.0));
        }
        let mine = |ctx: &super::ContextId| self.contexts.get(ctx).is_some_and(|c| c.tenant == tenant);
        for l in self.net.links.values() {
            if l.after.qpn().and_then(|n| self.qps.get(&n)).is_some_and(|q| q.tenant == tenant) {
                return Err(MigrateError::Busy(
                    "a frame's payload is being placed for one of its QPs".into(),
                ));
            }
        }
        let mut contexts: Vec<u32> =
            self.contexts.iter().filter(|(_, c)| c.tenant == tenant).map(|(k, _)| k.0).collect();
        contexts.sort_unstable();
        let mut snap = TenantSnapshot {
            tenant: tenant.0,
            contexts,
            pds: Vec::new(),
            mrs: Vec::new(),
            cqs: Vec::new(),
            srqs: Vec::new(),
            ahs: Vec::new(),
            qps: Vec::new(),
            placement: None,
            answers: Vec::new(),
            cm: Default::default(),
        };
        for (&pd, p) in self.pds.iter().filter(|(_, p)| mine(&p.ctx)) {
            snap.pds.push(PdSnap { pd, ctx: p.ctx.0 });
        }
        for (&key, m) in self.mrs.iter().filter(|(_, m)| mine(&m.ctx)) {
            snap.mrs.push(MrSnap {
                key,
                ctx: m.ctx.0,
                pd: m.pd,
                addr: m.addr,
                len: m.len,
                access: m.access.bits(),
            });
        }
        for (&cq, c) in self.cqs.iter().filter(|(_, c)| mine(&c.ctx)) {
            snap.cqs.push(CqSnap { cq, ctx: c.ctx.0, ring_bytes: c.ring_bytes, overrun: c.overrun });
        }
        for (&srq, s) in self.srqs.iter().filter(|(_, s)| mine(&s.ctx)) {
            snap.srqs.push(SrqSnap {
                srq,
                ctx: s.ctx.0,
                pd: s.pd,
                attr: s.attr,
                ring_bytes: s.ring_bytes,
                requeued: s.requeued.iter().map(WrBytes::recv).collect(),
            });
        }
        for (&ah, a) in self.ahs.iter().filter(|(_, a)| mine(&a.ctx)) {
            snap.ahs.push(AhSnap { ah, ctx: a.ctx.0, pd: a.pd, attr: a.attr });
        }
        for qpn in self.tenant_qps(tenant) {
            let q = &self.qps[&qpn];
            if q.inflight.is_some() {
                return Err(MigrateError::Unsupported(format!(
                    "QP {qpn:#x} has a message in progress to a QP on this host"
                )));
            }
            let connected = matches!(q.state(), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
            if q.init.qp_type == QpType::Rc && connected && self.is_local(&q.attr.ah_attr) {
                return Err(MigrateError::Unsupported(format!(
                    "QP {qpn:#x} is connected to a QP on this host; only QPs whose peers are on other hosts move"
                )));
            }
            if q.remote.as_ref().and_then(|r| r.recv.as_ref()).is_some_and(|r| r.placing()) {
                return Err(MigrateError::Busy(format!("QP {qpn:#x} is placing a payload")));
            }
            let remote = q.remote.as_deref();
            let send = remote.and_then(|r| r.send.as_ref()).map(|s| {
                let chunk = self.net.chunk(s.link.unwrap_or(LinkId(0)));
                s.snapshot(chunk)
            });
            let recv = remote.and_then(|r| r.recv.as_ref()).map(|r| r.snapshot());
            snap.qps.push(QpSnap {
                qpn,
                ctx: q.ctx.0,
                pd: q.pd,
                init: q.init,
                attr: q.attr,
                resets: q.resets,
                sqd_notify: q.sqd_notify,
                epoch: q.epoch.wrapping_add(1).max(1),
                requeued: q.requeued.iter().map(WrBytes::recv).collect(),
                send,
                recv,
            });
        }
        snap.pds.sort_by_key(|p| p.pd);
        snap.mrs.sort_by_key(|m| m.key);
        snap.cqs.sort_by_key(|c| c.cq);
        snap.srqs.sort_by_key(|s| s.srq);
        snap.ahs.sort_by_key(|a| a.ah);
        Ok(snap)
    }

    /// The tenant moved away: its objects here go, without completions,
    /// events or answers (they are the destination's now). Memory regions
    /// are not revoked: the memory is the tenant's, which the driver
    /// unmaps. Returns what the driver had mapped for its queues.
    pub fn finish_export(&mut self, tenant: TenantId) -> Result<super::Teardown, MigrateError> {
        self.check_movable(tenant)?;
        if !self.is_paused(tenant) {
            return Err(MigrateError::NotPaused(tenant.0));
        }
        let mut t = super::Teardown::default();
        let qps = self.tenant_qps(tenant);
        let gone: std::collections::HashSet<u32> = qps.iter().copied().collect();
        self.order.remove(|n| gone.contains(&n));
        for qpn in qps {
            self.cancel_placements_of(qpn);
            if let Some(mut q) = self.qps.remove(&qpn) {
                if let Some(r) = q.remote.take() {
                    self.net.detach(&r, qpn, tenant);
                }
                t.qps.push(qpn);
            }
        }
        let ctxs: Vec<super::ContextId> =
            self.contexts.iter().filter(|(_, c)| c.tenant == tenant).map(|(&k, _)| k).collect();
        let set: std::collections::HashSet<super::ContextId> = ctxs.iter().copied().collect();
        t.srqs = self.srqs.iter().filter(|(_, s)| set.contains(&s.ctx)).map(|(&n, _)| n).collect();
        t.cqs = self.cqs.iter().filter(|(_, c)| set.contains(&c.ctx)).map(|(&n, _)| n).collect();
        self.srqs.retain(|_, s| !set.contains(&s.ctx));
        self.cqs.retain(|_, c| !set.contains(&c.ctx));
        self.ahs.retain(|_, a| !set.contains(&a.ctx));
        self.mrs.retain(|_, m| !set.contains(&m.ctx));
        self.pds.retain(|_, p| !set.contains(&p.ctx));
        for c in ctxs {
            self.contexts.remove(&c);
        }
        self.usage.remove(&tenant);
        self.paused_tenants.remove(&tenant);
        self.net.forget_tenant(tenant);
        tracing::info!(tenant = tenant.0, qps = t.qps.len(), "tenant moved away; its objects here are gone");
        Ok(t)
    }

    /// Resumes a paused tenant: on the host it was imported to, or on the
    /// source after a cancelled migration. Each connected RC QP announces
    /// where it is (a Moved frame with a higher epoch, which its peer
    /// needs to leave its pause at once) and sends again from its oldest
    /// unacknowledged request.
    pub fn resume_tenant(&mut self, tenant: TenantId, now: Instant) -> Result<usize, MigrateError> {
        self.check_movable(tenant)?;
        self.paused_tenants.remove(&tenant);
        let qps = self.tenant_qps(tenant);
        for &qpn in &qps {
            let Some(q) = self.qps.get_mut(&qpn) else { continue };
            if !q.paused {
                continue;
            }
            q.paused = false;
            let connected = matches!(q.state(), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
            if q.init.qp_type == QpType::Rc && connected {
                if !q.announce {
                    // Resumed where it was paused: a new epoch all the same,
                    // so that a copy resumed elsewhere loses to this one or
                    // wins over it, never both.
                    q.epoch = q.epoch.wrapping_add(1).max(1);
                    q.announce = true;
                }
                if let Some(s) = q.remote.as_deref_mut().and_then(|r| r.send.as_mut()) {
                    s.tx = 0;
                    s.tx_off = 0;
                    s.hold_until = now;
                    s.ack_deadline = None;
                }
                self.bind_resumed(qpn);
            }
            self.update_service(qpn);
        }
        tracing::info!(tenant = tenant.0, qps = qps.len(), "tenant resumed");
        Ok(qps.len())
    }

    /// Binds a resumed QP's two halves to the link towards its peer (if
    /// one is up; otherwise the requester binds when one comes).
    fn bind_resumed(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        if q.remote.is_none() {
            // A connection that carried nothing yet: it is given a
            // responder state here, so that it has a link to announce
            // itself on and its peer's first request finds it.
            let recv =
                super::remote::RemoteRecv::restored(q.attr.rq_psn & crate::wire::MAX_24, 0, None, Vec::new());
            q.remote = Some(Box::new(super::remote::RemoteQp { send: None, recv: Some(recv) }));
        }
        let (ah, tenant) = (q.attr.ah_attr, q.tenant);
        let route = q.peer_link.filter(|l| self.net.links.contains_key(l)).or_else(|| self.net.route(&ah));
        let Some(link) = route else {
            if ah.is_global {
                self.net.want(ah.dgid);
            }
            return;
        };
        let old = q.remote.as_ref().map(|r| r.links());
        let Some(r) = self.qps.get_mut(&qpn).and_then(|q| q.remote.as_deref_mut()) else { return };
        if let Some(s) = r.send.as_mut() {
            s.link = Some(link);
            s.link_lost = false;
        }
        if let Some(rc) = r.recv.as_mut() {
            rc.link = Some(link);
        }
        for o in old.into_iter().flatten().flatten().filter(|&o| o != link) {
            self.net.detach_from(o, qpn, tenant);
        }
        if self.qps.get(&qpn).is_some_and(|q| q.remote.is_some()) {
            self.net.attach(link, qpn, tenant);
        }
    }

    /// The Moved frame of a QP that resumed, if it is due on `link`.
    pub(crate) fn announce_transmit(&mut self, qpn: u32, link: LinkId) -> Option<Transmit> {
        let q = self.qps.get(&qpn).filter(|q| q.announce)?;
        let on = q.remote.as_ref().is_some_and(|r| r.links().contains(&Some(link)));
        if !on {
            return None;
        }
        let m = MovedRepr { vnet: q.tenant.0, qpn, peer_qpn: q.attr.dest_qp_num, epoch: q.epoch };
        self.qps.get_mut(&qpn)?.announce = false;
        tracing::debug!(qpn, epoch = m.epoch, link = link.0, "announcing a migrated QP's location");
        Some(Transmit::control(&FrameRepr::Moved(m)))
    }

    /// A Moved frame arrived on `link`: if it names one of our RC QPs
    /// connected to the QP that moved, in the tenant's network, with an
    /// epoch above any seen, the QP's peer is now reached over `link`.
    /// Returns whether it was accepted.
    pub fn handle_moved(&mut self, link: LinkId, m: &MovedRepr, now: Instant) -> bool {
        let Some(l) = self.net.links.get_mut(&link) else { return false };
        // A drop of it counts in the link's totals only (the last data
        // frame's tenant is not this one's).
        l.rx_tenant = None;
        let ok = self.qps.get(&m.peer_qpn).is_some_and(|q| {
            q.init.qp_type == QpType::Rc
                && q.tenant.0 == m.vnet
                && !q.tenant.is_host_local()
                && q.attr.dest_qp_num == m.qpn
                && matches!(q.state(), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe)
                && m.epoch > q.peer_epoch
        });
        if !ok {
            self.net.dropped(link, "Moved frame for no QP of ours, or with an old epoch");
            self.mark_stale_peer(link, m);
            return false;
        }
        let qpn = m.peer_qpn;
        let first_lid = self.qps.get(&qpn).filter(|q| q.peer_link.is_none()).map(|q| {
            let bound = q.remote.as_ref().and_then(|r| r.links().into_iter().flatten().next());
            let link = bound.or_else(|| self.net.route(&q.attr.ah_attr));
            link.and_then(|l| self.net.links.get(&l)).map_or(q.attr.ah_attr.dlid, |l| l.info.lid)
        });
        let q = self.qps.get_mut(&qpn).expect("checked");
        if let Some(lid) = first_lid {
            q.peer_lid = lid;
        }
        q.peer_link = Some(link);
        q.peer_epoch = m.epoch;
        q.peer_stale = false;
        let tenant = q.tenant;
        let old = q.remote.as_ref().map(|r| r.links());
        if let Some(r) = q.remote.as_deref_mut() {
            if let Some(s) = r.send.as_mut() {
                s.link = Some(link);
                s.link_lost = false;
                s.paused_since = None;
                s.tx = 0;
                s.tx_off = 0;
                s.hold_until = now;
                s.ack_deadline = None;
            }
            if let Some(rc) = r.recv.as_mut() {
                rc.link = Some(link);
                rc.nak_sent = false;
            }
        }
        for o in old.into_iter().flatten().flatten().filter(|&o| o != link) {
            self.net.detach_from(o, qpn, tenant);
        }
        if self.qps.get(&qpn).is_some_and(|q| q.remote.is_some()) {
            self.net.attach(link, qpn, tenant);
        }
        tracing::debug!(qpn, epoch = m.epoch, link = link.0, "peer QP moved");
        self.update_service(qpn);
        true
    }

    /// A refused Moved frame that names one of our connected RC QPs and
    /// its peer, with an epoch no newer than the one accepted, on the link
    /// the accepted one came on: the peer QP was resumed a second time on
    /// that host from an older snapshot (a snapshot restored twice; two
    /// live copies of one QPN cannot share a host). Its PSNs are behind
    /// ours, so its requests would be answered as duplicates and complete
    /// with nothing delivered: from now on its frames are dropped, and it
    /// fails by its retry count (`RETRY_EXC_ERR`, the rest flushed), as
    /// for a peer that moved on. A newer Moved clears the mark.
    fn mark_stale_peer(&mut self, link: LinkId, m: &MovedRepr) {
        let Some(q) = self.qps.get_mut(&m.peer_qpn) else { return };
        let stale = q.init.qp_type == QpType::Rc
            && q.tenant.0 == m.vnet
            && !q.tenant.is_host_local()
            && q.attr.dest_qp_num == m.qpn
            && q.peer_link == Some(link)
            && m.epoch <= q.peer_epoch
            && !q.peer_stale;
        if stale {
            q.peer_stale = true;
            tracing::warn!(
                qpn = m.peer_qpn,
                peer_qpn = m.qpn,
                epoch = m.epoch,
                accepted = q.peer_epoch,
                link = link.0,
                "a stale copy of the peer QP resumed where the accepted one was (a snapshot restored twice?); \
                 its frames are dropped from now on"
            );
        }
    }

    /// A data frame for a paused QP: a request from its peer is answered
    /// PAUSED (queued on the link ahead of the QPs' frames), anything else
    /// (an answer, a datagram for a paused UD QP) is dropped, so that
    /// nothing the snapshot holds or the tenant's rings hold changes.
    /// Returns whether the frame was for a paused QP.
    pub(crate) fn paused_handle(&mut self, link: LinkId, hdr: &DataRepr) -> bool {
        let Some(q) = self.qps.get(&hdr.dest_qpn).filter(|q| q.paused) else { return false };
        let from_peer = q.init.qp_type == QpType::Rc
            && q.tenant.0 == hdr.vnet
            && q.attr.dest_qp_num == hdr.src_qpn
            && q.accepts_incoming()
            && self.peer_on(q, link);
        if !from_peer || !hdr.opcode.is_request() {
            self.net.dropped(link, "frame for a paused QP");
            return true;
        }
        let (epsn, msn) = q
            .remote
            .as_ref()
            .and_then(|r| r.recv.as_ref())
            .map_or((q.attr.rq_psn & crate::wire::MAX_24, 0), |r| (r.epsn, r.msn));
        let mut r = DataRepr::new(Opcode::Acknowledge, q.tenant.0, hdr.src_qpn, hdr.dest_qpn, epsn);
        r.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::QpPaused), msn });
        if let Some(l) = self.net.links.get_mut(&link).filter(|l| l.datagrams.len() < MAX_PAUSED_NAKS) {
            l.datagrams.push_back((q.tenant, Transmit::new(&r)));
        }
        self.net.dropped(link, "request for a paused QP (PAUSED NAK)");
        true
    }
}
