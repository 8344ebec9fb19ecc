//! Importing a tenant's snapshot: the snapshot came from another host and
//! is untrusted, so everything is checked before anything changes here.
//!
//! The checks: every number is in range and unique in the snapshot;
//! every reference (a QP's PD, CQs, SRQ; an MR's or AH's PD) names an
//! object of the snapshot in the same context; capacities are within the
//! device's limits and the rings' sizes are what those capacities give;
//! work requests pass the ring's own decoder; PSN ranges are contiguous
//! and within the window; and nothing collides with what this host holds:
//! a context id, QPN, memory key or object id in use here is refused
//! (numbers keep their values across a move; the imported ones are then
//! reserved here by being in the tables, which every allocator skips).
//! Last, the tenant's quota here is charged for all of it, or nothing.

use std::collections::{HashMap, HashSet, VecDeque};

use super::snapshot::{invalid, InMsgSnap, QpSnap, SnapshotError, TenantSnapshot};
use crate::hca::objects::{Ah, Context, Cq, Mr, Pd, Qp, Srq};
use crate::hca::remote::{RemoteQp, RemoteRecv, RemoteSend};
use crate::hca::{qp_ring_bytes, ring_bytes, ContextId, Hca, TenantId};
use crate::memory::Region;
use crate::time::Instant;
use crate::verbs::{AccessFlags, QpState, QpType};
use crate::wire::{psn_add, MAX_24};

/// A memory region the importer asks the driver to map: the tenant's
/// memory at `addr`, `len` bytes, which moved with it; for a VM's tenant,
/// `at` is its first byte in the VM's region (checked to lie inside the
/// snapshot's `placement.region_len`, which the driver checks against
/// the region it has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrImport {
    pub key: u32,
    pub ctx: ContextId,
    pub addr: u64,
    pub len: u64,
    pub at: Option<u64>,
}

fn unique<T: std::hash::Hash + Eq + Copy + std::fmt::Debug>(
    what: &str,
    ids: impl Iterator<Item = T>,
) -> Result<HashSet<T>, SnapshotError> {
    let mut seen = HashSet::new();
    for id in ids {
        if !seen.insert(id) {
            return Err(invalid(format!("{what} {id:?} appears twice")));
        }
    }
    Ok(seen)
}

impl Hca {
    /// Whether a PD, CQ, SRQ or AH number is in use here (they share one
    /// counter).
    fn object_id_taken(&self, n: u32) -> bool {
        self.pds.contains_key(&n)
            || self.cqs.contains_key(&n)
            || self.srqs.contains_key(&n)
            || self.ahs.contains_key(&n)
    }

    /// Imports a tenant from `bytes` (an [`Hca::export_tenant`] of another
    /// host), paused; [`Hca::resume_tenant`] starts it. `region_of` maps
    /// each memory region's memory (the tenant's, moved with it); `None`
    /// refuses the import. On any error nothing here has changed.
    pub fn import_tenant(
        &mut self,
        bytes: &[u8],
        now: Instant,
        region_of: &mut dyn FnMut(&MrImport) -> Option<Region>,
    ) -> Result<TenantId, SnapshotError> {
        self.import_tenant_with(bytes, now, region_of, 0)
    }

    /// [`Hca::import_tenant`], charging the tenant `driver_objects` more
    /// objects that the driver keeps for it (a guest's completion
    /// channels, which the snapshot's placement carries): counted in the
    /// one quota check, so that an import that cannot hold them is refused
    /// before anything here changes (the tenant's objects and usage here
    /// as they were), and charged with the rest. The driver refunds each
    /// with [`Hca::refund_object`] when it goes.
    pub fn import_tenant_with(
        &mut self,
        bytes: &[u8],
        now: Instant,
        region_of: &mut dyn FnMut(&MrImport) -> Option<Region>,
        driver_objects: u32,
    ) -> Result<TenantId, SnapshotError> {
        let snap = TenantSnapshot::decode(bytes)?;
        let plan = self.check_import(&snap, driver_objects)?;
        // Memory last among the checks: mapping is the costly part.
        let mut regions = Vec::with_capacity(snap.mrs.len());
        let placed: HashMap<u32, u64> =
            snap.placement.iter().flat_map(|p| p.mrs.iter().map(|x| (x.key, x.at))).collect();
        for m in &snap.mrs {
            let at = placed.get(&m.key).copied();
            let want = MrImport { key: m.key, ctx: ContextId(m.ctx), addr: m.addr, len: m.len, at };
            let r = region_of(&want)
                .ok_or_else(|| invalid(format!("no memory for region {:#x} ({} bytes)", m.key, m.len)))?;
            if (r.len() as u64) < m.len {
                return Err(invalid(format!(
                    "memory for region {:#x} is {} bytes, not {}",
                    m.key,
                    r.len(),
                    m.len
                )));
            }
            regions.push(r);
        }
        let tenant = TenantId(plan.tenant);
        self.commit_import(snap, plan, regions, now);
        Ok(tenant)
    }

    fn check_import(&self, s: &TenantSnapshot, driver_objects: u32) -> Result<Plan, SnapshotError> {
        let tenant = TenantId(s.tenant);
        if tenant.is_host_local() {
            return Err(invalid(format!("tenant {:#x} is a host-local number", s.tenant)));
        }
        let dev = &self.config.device;
        let quota = self.quota(tenant);
        // Contexts.
        let ctxs = unique("context", s.contexts.iter().copied())?;
        if ctxs.is_empty() {
            return Err(invalid("no context"));
        }
        for c in &ctxs {
            if self.contexts.contains_key(&ContextId(*c)) {
                return Err(SnapshotError::Collision(format!("context {c} is open here")));
            }
        }
        let open = self.contexts.values().filter(|c| c.tenant == tenant).count();
        if open + ctxs.len() > quota.max_contexts as usize {
            return Err(SnapshotError::Quota(format!(
                "{open} contexts open, {} more, limit {}",
                ctxs.len(),
                quota.max_contexts
            )));
        }
        s.check_answers()?;
        s.check_cm()?;
        let in_ctx = |c: u32| -> Result<(), SnapshotError> {
            if ctxs.contains(&c) {
                Ok(())
            } else {
                Err(invalid(format!("context {c} is not the snapshot's")))
            }
        };
        // Object ids, one space.
        let ids = s
            .pds
            .iter()
            .map(|p| p.pd)
            .chain(s.cqs.iter().map(|c| c.cq))
            .chain(s.srqs.iter().map(|x| x.srq))
            .chain(s.ahs.iter().map(|a| a.ah));
        for n in unique("object id", ids)? {
            if n == 0 {
                return Err(invalid("object id 0"));
            }
            if self.object_id_taken(n) {
                return Err(SnapshotError::Collision(format!("object id {n:#x} is in use here")));
            }
        }
        let pd_ctx: HashMap<u32, u32> = s.pds.iter().map(|p| (p.pd, p.ctx)).collect();
        for p in &s.pds {
            in_ctx(p.ctx)?;
        }
        let pd_of = |pd: u32, ctx: u32, what: &str| -> Result<(), SnapshotError> {
            match pd_ctx.get(&pd) {
                Some(&c) if c == ctx => Ok(()),
                _ => Err(invalid(format!("{what}: PD {pd:#x} is not of its context"))),
            }
        };
        let mut bytes: u64 = 0;
        let mut queue_bytes: u64 = 0;
        // Memory regions.
        for k in unique("memory key", s.mrs.iter().map(|m| m.key))? {
            if self.mrs.contains_key(&k) {
                return Err(SnapshotError::Collision(format!("memory key {k:#x} is in use here")));
            }
        }
        for m in &s.mrs {
            in_ctx(m.ctx)?;
            pd_of(m.pd, m.ctx, &format!("region {:#x}", m.key))?;
            if m.len > dev.max_mr_size || m.addr.checked_add(m.len).is_none() {
                return Err(invalid(format!("region {:#x}: {} bytes at {:#x}", m.key, m.len, m.addr)));
            }
            if AccessFlags::from_bits(m.access).is_none() {
                return Err(invalid(format!("region {:#x}: access flags {:#x}", m.key, m.access)));
            }
            bytes = bytes.saturating_add(m.len);
        }
        // A queue's ring: a power of two of entries within the limits.
        let ring_ok = |rb: u64, stride: usize, most: u32| -> bool {
            let stride = stride as u64;
            stride > 0 && rb.is_multiple_of(stride) && {
                let n = rb / stride;
                n.is_power_of_two() && n <= u64::from(most.min(quota.max_queue_depth))
            }
        };
        // CQs.
        let cq_ctx: HashMap<u32, u32> = s.cqs.iter().map(|c| (c.cq, c.ctx)).collect();
        for c in &s.cqs {
            in_ctx(c.ctx)?;
            if !ring_ok(c.ring_bytes, crate::ring::CQE_SIZE, dev.max_cqe) {
                return Err(invalid(format!("CQ {:#x}: a ring of {} bytes", c.cq, c.ring_bytes)));
            }
            queue_bytes = queue_bytes.saturating_add(c.ring_bytes);
        }
        // SRQs.
        let srq_ctx: HashMap<u32, u32> = s.srqs.iter().map(|x| (x.srq, x.ctx)).collect();
        for x in &s.srqs {
            in_ctx(x.ctx)?;
            pd_of(x.pd, x.ctx, &format!("SRQ {:#x}", x.srq))?;
            let a = x.attr;
            if a.max_wr == 0
                || a.max_sge == 0
                || a.max_sge > dev.max_srq_sge
                || a.srq_limit > a.max_wr
                || !ring_ok(x.ring_bytes, crate::ring::recv_stride(a.max_sge), dev.max_srq_wr)
                || x.ring_bytes != ring_bytes(a.max_wr, crate::ring::recv_stride(a.max_sge))
                || x.requeued.len() > a.max_wr as usize
            {
                return Err(invalid(format!("SRQ {:#x}: attributes {a:?}, ring {}", x.srq, x.ring_bytes)));
            }
            for w in &x.requeued {
                w.decode_recv()?;
            }
            queue_bytes = queue_bytes.saturating_add(x.ring_bytes);
        }
        // AHs.
        for a in &s.ahs {
            in_ctx(a.ctx)?;
            pd_of(a.pd, a.ctx, &format!("AH {:#x}", a.ah))?;
            if a.attr.port_num == 0 || a.attr.port_num > dev.phys_port_cnt {
                return Err(invalid(format!("AH {:#x} on port {}", a.ah, a.attr.port_num)));
            }
        }
        // QPs.
        for n in unique("QPN", s.qps.iter().map(|q| q.qpn))? {
            if !(2..=0xff_fffe).contains(&n) {
                return Err(invalid(format!("QPN {n:#x} out of range")));
            }
            if self.qps.contains_key(&n) {
                return Err(SnapshotError::Collision(format!("QPN {n:#x} is in use here")));
            }
        }
        let mut qp_rings = Vec::with_capacity(s.qps.len());
        for q in &s.qps {
            let rb = self.check_qp(q, &in_ctx, &pd_of, &cq_ctx, &srq_ctx)?;
            queue_bytes = queue_bytes.saturating_add(rb);
            qp_rings.push(rb);
        }
        // Device-wide counts and the tenant's quota.
        let over = |have: usize, more: usize, most: u32| have.saturating_add(more) > most as usize;
        if over(self.qps.len(), s.qps.len(), dev.max_qp)
            || over(self.cqs.len(), s.cqs.len(), dev.max_cq)
            || over(self.mrs.len(), s.mrs.len(), dev.max_mr)
            || over(self.pds.len(), s.pds.len(), dev.max_pd)
            || over(self.ahs.len(), s.ahs.len(), dev.max_ah)
            || over(self.srqs.len(), s.srqs.len(), dev.max_srq)
        {
            return Err(SnapshotError::Quota("the device's object limits".into()));
        }
        let objects = s.pds.len() + s.mrs.len() + s.cqs.len() + s.srqs.len() + s.ahs.len() + s.qps.len();
        let objects = u32::try_from(objects)
            .ok()
            .and_then(|n| n.checked_add(driver_objects))
            .ok_or_else(|| SnapshotError::Quota("objects".into()))?;
        let all_bytes = bytes.saturating_add(queue_bytes);
        self.within_quota(tenant, objects, all_bytes).map_err(|e| {
            SnapshotError::Quota(format!(
                "{objects} objects to import ({driver_objects} of them the driver's): {e}"
            ))
        })?;
        if let Some(most) = quota.max_queue_bytes {
            let held = self.usage.get(&tenant).map_or(0, |u| u.queue_bytes);
            if held.saturating_add(queue_bytes) > most {
                return Err(SnapshotError::Quota(format!(
                    "{queue_bytes} bytes of queue rings, limit {most}"
                )));
            }
        }
        super::placement::check(s)?;
        Ok(Plan { tenant: s.tenant, objects, bytes: all_bytes, queue_bytes, qp_rings })
    }

    /// Checks one QP of a snapshot; returns the bytes of its rings.
    fn check_qp(
        &self,
        q: &QpSnap,
        in_ctx: &dyn Fn(u32) -> Result<(), SnapshotError>,
        pd_of: &dyn Fn(u32, u32, &str) -> Result<(), SnapshotError>,
        cq_ctx: &HashMap<u32, u32>,
        srq_ctx: &HashMap<u32, u32>,
    ) -> Result<u64, SnapshotError> {
        let dev = &self.config.device;
        let what = format!("QP {:#x}", q.qpn);
        let bad = |m: String| invalid(format!("{what}: {m}"));
        in_ctx(q.ctx)?;
        pd_of(q.pd, q.ctx, &what)?;
        let init = &q.init;
        for cq in [init.send_cq, init.recv_cq] {
            if cq_ctx.get(&cq) != Some(&q.ctx) {
                return Err(bad(format!("CQ {cq:#x} is not of its context")));
            }
        }
        if let Some(srq) = init.srq {
            if srq_ctx.get(&srq) != Some(&q.ctx) {
                return Err(bad(format!("SRQ {srq:#x} is not of its context")));
            }
        }
        if !matches!(init.qp_type, QpType::Rc | QpType::Ud) {
            return Err(bad("only RC and UD QPs".into()));
        }
        let c = init.cap;
        let pow = |v: u32| v == 0 || v.is_power_of_two();
        if c.max_send_wr == 0
            || !pow(c.max_send_wr)
            || !pow(c.max_recv_wr)
            || c.max_send_wr > dev.max_qp_wr
            || c.max_recv_wr > dev.max_qp_wr
            || c.max_send_sge > dev.max_sge
            || c.max_recv_sge > dev.max_sge
            || c.max_inline_data > dev.max_inline_data
            || (init.srq.is_none() && (c.max_recv_wr == 0 || c.max_recv_sge == 0))
            || (init.srq.is_some() && (c.max_recv_wr != 0 || c.max_recv_sge != 0))
            || q.attr.cap != c
        {
            return Err(bad(format!("capacities {c:?}")));
        }
        let a = &q.attr;
        if a.dest_qp_num > MAX_24 || a.sq_psn > MAX_24 || a.rq_psn > MAX_24 {
            return Err(bad("a QPN or PSN above 24 bits".into()));
        }
        if AccessFlags::from_bits(a.qp_access_flags.bits()).is_none() {
            return Err(bad("access flags".into()));
        }
        if q.epoch == 0 {
            return Err(bad("epoch 0".into()));
        }
        let connected = matches!(a.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
        if init.qp_type == QpType::Rc && connected && self.is_local(&a.ah_attr) {
            return Err(bad("its peer would be on this host: not supported yet".into()));
        }
        if q.requeued.len() > c.max_recv_wr.max(1) as usize {
            return Err(bad("too many receives given back".into()));
        }
        for w in &q.requeued {
            w.decode_recv()?;
        }
        if init.qp_type != QpType::Rc && (q.send.is_some() || q.recv.is_some()) {
            return Err(bad("transport state on a UD QP".into()));
        }
        if let Some(s) = &q.send {
            let chunk_ok = (crate::wire::MIN_CHUNK..=crate::wire::MAX_CHUNK).contains(&s.chunk)
                && s.chunk.is_power_of_two();
            if s.sent.len() > c.max_send_wr as usize
                || s.next_psn > MAX_24
                || s.retries_left > 7
                || s.rnr_left > 7
                || !chunk_ok
            {
                return Err(bad("requester state".into()));
            }
            if let Some(l) = self.net.route(&a.ah_attr).map(|l| self.net.chunk(l)) {
                if l != s.chunk && s.sent.iter().any(|w| w.went_out) {
                    return Err(bad(format!(
                        "requests numbered at a chunk of {} bytes, the link here uses {l}",
                        s.chunk
                    )));
                }
            }
            let mut psn = s.sent.first().map_or(s.next_psn, |w| w.first_psn);
            let mut span: u64 = 0;
            for w in &s.sent {
                let wr = w.wr.decode_send()?;
                if crate::hca::remote::frame_of(&wr, w.npsn, s.chunk).is_none() {
                    return Err(bad("a request's PSN count does not match its length".into()));
                }
                if w.first_psn != psn || w.npsn == 0 || w.npsn > MAX_24 {
                    return Err(bad("outstanding requests' PSNs are not contiguous".into()));
                }
                psn = psn_add(psn, w.npsn);
                span += u64::from(w.npsn);
            }
            if psn != s.next_psn || span > u64::from(self.config.max_psns_in_flight) {
                return Err(bad("outstanding requests' PSNs do not end at the next PSN".into()));
            }
            if let Some((w, _)) = &s.blocked {
                w.decode_send()?;
            }
        }
        if let Some(r) = &q.recv {
            if r.epsn > MAX_24 || r.msn > MAX_24 || r.atomics.len() > RemoteRecv::MAX_ATOMICS {
                return Err(bad("responder state".into()));
            }
            if r.atomics.iter().any(|(p, _)| *p > MAX_24) {
                return Err(bad("an atomic's PSN above 24 bits".into()));
            }
            match &r.cur {
                None => {}
                Some(InMsgSnap::Send { recv, .. } | InMsgSnap::WriteImm { recv }) => {
                    recv.decode_recv()?;
                }
                Some(InMsgSnap::Write { got, dma_len, va, .. })
                    if got > dma_len || va.checked_add(*dma_len).is_none() =>
                {
                    return Err(bad("a write in progress".into()));
                }
                Some(InMsgSnap::Write { .. }) => {}
            }
        }
        Ok(qp_ring_bytes(c))
    }

    /// Inserts what `check_import` accepted.
    fn commit_import(&mut self, s: TenantSnapshot, plan: Plan, regions: Vec<Region>, now: Instant) {
        let tenant = TenantId(s.tenant);
        for &c in &s.contexts {
            self.contexts.insert(ContextId(c), Context { tenant });
        }
        let u = self.usage.entry(tenant).or_default();
        u.objects += plan.objects;
        u.registered_bytes += plan.bytes;
        u.queue_bytes += plan.queue_bytes;
        for p in &s.pds {
            self.pds.insert(p.pd, Pd { ctx: ContextId(p.ctx), users: 0 });
        }
        for (m, region) in s.mrs.iter().zip(regions) {
            let access = AccessFlags::from_bits(m.access).unwrap_or(AccessFlags::empty());
            self.mrs.insert(
                m.key,
                Mr { ctx: ContextId(m.ctx), pd: m.pd, addr: m.addr, len: m.len, access, region },
            );
            if let Some(p) = self.pds.get_mut(&m.pd) {
                p.users += 1;
            }
        }
        for c in &s.cqs {
            let cq = Cq { ctx: ContextId(c.ctx), users: 0, ring_bytes: c.ring_bytes, overrun: c.overrun };
            self.cqs.insert(c.cq, cq);
        }
        for x in &s.srqs {
            let requeued: VecDeque<_> = x.requeued.iter().filter_map(|w| w.decode_recv().ok()).collect();
            self.srqs.insert(
                x.srq,
                Srq {
                    ctx: ContextId(x.ctx),
                    pd: x.pd,
                    attr: x.attr,
                    users: 0,
                    ring_bytes: x.ring_bytes,
                    requeued,
                },
            );
            if let Some(p) = self.pds.get_mut(&x.pd) {
                p.users += 1;
            }
        }
        for a in &s.ahs {
            self.ahs.insert(a.ah, Ah { ctx: ContextId(a.ctx), pd: a.pd, attr: a.attr });
            if let Some(p) = self.pds.get_mut(&a.pd) {
                p.users += 1;
            }
        }
        for (q, rb) in s.qps.iter().zip(plan.qp_rings.iter().copied()) {
            let remote = self.restore_transport(q, now);
            let connected =
                matches!(q.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe);
            self.qps.insert(
                q.qpn,
                Qp {
                    ctx: ContextId(q.ctx),
                    tenant,
                    pd: q.pd,
                    init: q.init,
                    attr: q.attr,
                    inflight: None,
                    requeued: q.requeued.iter().filter_map(|w| w.decode_recv().ok()).collect(),
                    sqd_notify: q.sqd_notify,
                    remote,
                    resets: q.resets,
                    ring_bytes: rb,
                    served: false,
                    in_order: false,
                    swept: false,
                    paused: true,
                    epoch: q.epoch,
                    announce: q.init.qp_type == QpType::Rc && connected,
                    peer_link: None,
                    peer_epoch: 0,
                    peer_stale: false,
                    peer_lid: 0,
                },
            );
            if let Some(p) = self.pds.get_mut(&q.pd) {
                p.users += 1;
            }
            for cq in [q.init.send_cq, q.init.recv_cq] {
                if let Some(c) = self.cqs.get_mut(&cq) {
                    c.users += 1;
                }
            }
            if let Some(x) = q.init.srq.and_then(|x| self.srqs.get_mut(&x)) {
                x.users += 1;
            }
        }
        self.paused_tenants.insert(tenant);
        tracing::info!(tenant = tenant.0, qps = s.qps.len(), "tenant imported, paused");
    }

    /// The RC transport state of an imported QP, from its checked parts.
    fn restore_transport(&mut self, q: &QpSnap, now: Instant) -> Option<Box<RemoteQp>> {
        if q.send.is_none() && q.recv.is_none() {
            return None;
        }
        let send = q.send.as_ref().map(|s| {
            let sent = s.sent.iter().filter_map(|w| Some((w.wr.decode_send().ok()?, w))).collect();
            let blocked = s.blocked.as_ref().and_then(|(w, st)| Some((w.decode_send().ok()?, *st)));
            RemoteSend::restored(s, sent, blocked, &mut self.net.next_serial, now)
        });
        let recv = q.recv.as_ref().map(|r| {
            use crate::hca::remote::InMsg;
            let cur = r.cur.as_ref().and_then(|m| {
                Some(match m {
                    InMsgSnap::Send { recv, got } => {
                        InMsg::Send { recv: recv.decode_recv().ok()?, got: *got }
                    }
                    InMsgSnap::Write { va, rkey, dma_len, got } => {
                        InMsg::Write { va: *va, rkey: *rkey, dma_len: *dma_len, got: *got }
                    }
                    InMsgSnap::WriteImm { recv } => InMsg::WriteImm { recv: recv.decode_recv().ok()? },
                })
            });
            RemoteRecv::restored(r.epsn, r.msn, cur, r.atomics.clone())
        });
        Some(Box::new(RemoteQp { send, recv }))
    }
}

/// What the checks worked out, for the commit.
struct Plan {
    tenant: u32,
    objects: u32,
    bytes: u64,
    queue_bytes: u64,
    qp_rings: Vec<u64>,
}
