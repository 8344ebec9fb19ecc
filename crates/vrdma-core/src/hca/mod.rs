//! The software HCA: every object of every tenant, and the rules that move
//! bytes between them.
//!
//! Control operations (`alloc_pd`, `reg_mr`, `modify_qp`, ...) check
//! ownership, quotas and the verbs rules, and change the object tables.
//! [`Hca::process`] is the engine's step: it pulls work requests through
//! [`Queues`], performs each as an RC requester and responder would (or,
//! for UD QPs, as a datagram sender and receiver), and pushes completions
//! and asynchronous events back. It is driven with the
//! current time and reports when it next needs to run, so RNR and transport
//! timers work without a clock of its own.

mod config;
mod control;
mod datapath;
mod direct;
mod error;
pub mod metrics;
pub mod migrate;
mod numbering;
mod objects;
mod queues;
mod remote;
mod schedule;

pub use schedule::IDLE_TURNS;
#[cfg(test)]
mod tests;

/// A map keyed by numbers the device hands out (QPNs, keys, handles, link
/// and context ids), never chosen by a tenant, so a fast unkeyed hash is
/// safe: the engine looks every QP up in every pass and several times per
/// frame, at half the cost of SipHash.
pub type IdMap<K, V> = rustc_hash::FxHashMap<K, V>;
use IdMap as HashMap;

use serde::{Deserialize, Serialize};

pub use config::{
    lid_of_ipv4, HcaConfig, LatencyClass, Qos, Quota, CONTENDED_BYTES, LATENCY_SLICE, MAX_CQE, MAX_QP_WR,
    MAX_RD_ATOMIC, TENANT_TURNS, VENDOR_ID,
};
pub use datapath::{Activity, GRH_LEN};
pub use direct::{
    DirectGrant, DirectRefusal, RecvGrant, Revocation, DIRECT_LOCAL, DIRECT_RIGHTS, DIRECT_SLOTS,
};
pub use error::HcaError;
pub use queues::{AsyncEvent, CqFull, Pulled, Queues, RecvSource};
pub use remote::{
    IoSeg, LinkId, LinkInfo, LinkQueues, LinkReport, LinkStats, LinkThrottle, Path, QpPathReport, Sampled,
    Sink, StatCursor, StatPage, StatReport, StatView, Transmit, MAX_LINK_TENANTS, STAT_PAGE_LINKS,
    STAT_PAGE_QPS, TX_HEADER_CAP,
};

use crate::verbs::QpCap;
use objects::{Ah, Context, Cq, Mr, Pd, Qp, Srq};

/// One connection of a tenant process: the `ibv_context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContextId(pub u32);

/// Who owns objects, as the kernel identified the process (not as it claims).
///
/// A uid names the same tenant on every host, and is the tenant's virtual
/// network across hosts. Numbers from [`TenantId::HOST_LOCAL_BASE`] up are
/// tenants a daemon named for itself (a uid in a network namespace other
/// than the daemon's): they mean nothing to another host, so their QPs
/// never reach one, and frames carrying such a number are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u32);

impl TenantId {
    /// The first tenant number a daemon gives out itself.
    pub const HOST_LOCAL_BASE: u32 = 0xf000_0000;

    /// Whether this tenant exists on this host only.
    pub fn is_host_local(self) -> bool {
        self.0 >= Self::HOST_LOCAL_BASE
    }
}

/// Where memory keys come from: unguessable in the daemon, a counter in tests.
pub trait KeySource: Send {
    fn next_key(&mut self) -> u32;
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    objects: u32,
    registered_bytes: u64,
    /// The part of `registered_bytes` that is queue rings.
    queue_bytes: u64,
}

/// What a context held when it closed, for the driver to unmap.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Teardown {
    pub qps: Vec<u32>,
    pub cqs: Vec<u32>,
    pub srqs: Vec<u32>,
}

/// Limits a QP was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpCreated {
    pub qpn: u32,
    pub cap: QpCap,
}

pub struct Hca {
    config: HcaConfig,
    keys: Box<dyn KeySource>,
    quotas: HashMap<TenantId, Quota>,
    usage: HashMap<TenantId, Usage>,
    contexts: HashMap<ContextId, Context>,
    pds: HashMap<u32, Pd>,
    mrs: HashMap<u32, Mr>,
    cqs: HashMap<u32, Cq>,
    srqs: HashMap<u32, Srq>,
    ahs: HashMap<u32, Ah>,
    qps: HashMap<u32, Qp>,
    /// The QPs the engine serves, queued per tenant (see [`schedule`]).
    order: schedule::ServiceOrder,
    next_id: u32,
    next_qpn: u32,
    /// Links to other hosts' daemons.
    net: remote::Network,
    /// A QP went to ERR outside `process` (on a frame from a link): its
    /// queues are flushed by the next pass, which the driver must run.
    flush_pending: bool,
    /// QPs the driver said were posted to (a buffer kept between passes).
    posted: Vec<u32>,
    /// See [`Hca::missed_wakeups`].
    missed_wakeups: u64,
    /// QPs a sweep has yet to look at ([`Hca::sweep`]).
    sweeping: Vec<u32>,
    /// Notices of posted QPs taken per tenant per pass, at most (see
    /// [`Queues::take_posted`]).
    notices_per_tenant: u32,
    /// Bytes the next QP's turn may move, and what the last one moved (the
    /// tenant's share of a pass holds its own count).
    turn_bytes: u64,
    turn_spent: u64,
    /// Send WRs the turn under way may still start (its tenant's rate
    /// limit); `u64::MAX` outside turns.
    turn_messages: u64,
    /// Per-tenant counters for the metrics endpoint (see [`metrics`]).
    metrics: metrics::Metrics,
    /// Limits what tenants and peers can make the device log (see
    /// [`crate::log_limit`]); the driver calls its `sweep`.
    pub log: crate::log_limit::LogLimiter,
    /// The direct path's grants ([`direct`]).
    direct: direct::Grants,
    /// Tenants paused for a migration ([`Hca::pause_tenant`], or imported
    /// paused), until [`Hca::resume_tenant`] or [`Hca::finish_export`]:
    /// their state-changing control calls are refused
    /// ([`HcaError::TenantPaused`]), so that the snapshot stays true.
    paused_tenants: std::collections::HashSet<TenantId>,
}

/// QPs a sweep wakes per pass.
pub const SWEEP_PER_PASS: usize = 256;

impl Hca {
    pub fn new(config: HcaConfig, keys: Box<dyn KeySource>) -> Hca {
        // Each notice of an idle QP makes a turn that does nothing, of which
        // a tenant's share of a pass has IDLE_TURNS: a few passes' worth is
        // taken, and the rest waits in its rings at no cost.
        let notices_per_tenant = 4 * IDLE_TURNS;
        let slice = config.latency_slice;
        let (next_id, next_qpn) =
            (numbering::first_id(config.number_space), numbering::first_qpn(config.number_space));
        Hca {
            config,
            keys,
            quotas: HashMap::default(),
            usage: HashMap::default(),
            contexts: HashMap::default(),
            pds: HashMap::default(),
            mrs: HashMap::default(),
            cqs: HashMap::default(),
            srqs: HashMap::default(),
            ahs: HashMap::default(),
            qps: HashMap::default(),
            order: schedule::ServiceOrder::with_slice(slice),
            next_id,
            next_qpn,
            net: remote::Network::default(),
            flush_pending: false,
            posted: Vec::new(),
            missed_wakeups: 0,
            log: crate::log_limit::LogLimiter::new(),
            sweeping: Vec::new(),
            notices_per_tenant,
            turn_bytes: 0,
            turn_spent: 0,
            turn_messages: u64::MAX,
            metrics: metrics::Metrics::default(),
            direct: direct::Grants::default(),
            paused_tenants: std::collections::HashSet::default(),
        }
    }

    /// The clock the engine's per-turn times are read from (see
    /// [`metrics`]); the driver's, on the same epoch as the `now` it
    /// passes. Without one, those times stay 0.
    pub fn set_clock(&mut self, clock: metrics::Clock) {
        self.metrics.clock = Some(clock);
    }

    /// Every tenant's counters, with what it holds now, by tenant.
    pub fn tenant_reports(&self) -> Vec<metrics::TenantReport> {
        let mut tenants: Vec<TenantId> = self.metrics.tenants.keys().copied().collect();
        for t in self.usage.keys() {
            if !self.metrics.tenants.contains_key(t) {
                tenants.push(*t);
            }
        }
        tenants.sort();
        tenants.into_iter().map(|t| self.tenant_report(t)).collect()
    }

    /// The figures of one tenant (zeros for one the engine never served).
    pub fn tenant_report(&self, t: TenantId) -> metrics::TenantReport {
        let (objects, registered_bytes) = self.usage(t);
        metrics::TenantReport {
            tenant: t,
            objects,
            registered_bytes,
            counters: self.metrics.tenants.get(&t).cloned().unwrap_or_default(),
        }
    }

    /// The counters of `t`, made on first use.
    fn counters(&mut self, t: TenantId) -> &mut metrics::TenantCounters {
        let usage = &self.usage;
        self.metrics.tenant(t, |k| usage.get(&k).is_some_and(|u| u.objects > 0))
    }

    pub fn config(&self) -> &HcaConfig {
        &self.config
    }

    pub fn set_quota(&mut self, tenant: TenantId, quota: Quota) {
        self.quotas.insert(tenant, quota);
    }

    /// Sets `tenant`'s weight and rate limit in the engine's service (see
    /// [`schedule`]); refused if [`Qos::check`] refuses it.
    pub fn set_qos(&mut self, tenant: TenantId, qos: Qos) -> Result<(), String> {
        qos.check()?;
        self.order.set_qos(tenant, qos);
        Ok(())
    }

    /// Sets the weight and rate limit of every tenant not set one of its
    /// own with [`Hca::set_qos`] (each has buckets of its own).
    pub fn set_default_qos(&mut self, qos: Qos) -> Result<(), String> {
        qos.check()?;
        self.order.set_default_qos(qos);
        Ok(())
    }

    /// The quota `tenant` is held to.
    pub fn quota(&self, tenant: TenantId) -> Quota {
        self.quotas.get(&tenant).copied().unwrap_or(self.config.default_quota)
    }

    /// `ibv_query_device` as `ctx` sees the device: its limits, lowered to
    /// its tenant's quota, so that a program that sizes its queues to
    /// `max_cqe` or `max_qp_wr` gets them, and that `max_mr` and the other
    /// counts are ones it can reach (objects, and mappings in the daemon).
    pub fn device_attr(&self, ctx: ContextId) -> Result<crate::verbs::DeviceAttr, HcaError> {
        let q = self.quota(self.tenant_of(ctx)?);
        let mut d = self.config.device.clone();
        // The largest depth that is granted as asked (a power of two)
        // within the quota.
        // ... and whose ring, at its smallest stride, fits in the memory
        // quotas.
        let memory = q.max_registered_bytes.min(q.max_queue_bytes.unwrap_or(u64::MAX));
        let cqe = crate::ring::CQE_SIZE as u64;
        let qp_entry = (crate::ring::send_stride(1, 0) + crate::ring::recv_stride(1)) as u64;
        let srq_entry = crate::ring::recv_stride(1) as u64;
        for (depth, entry) in
            [(&mut d.max_cqe, cqe), (&mut d.max_qp_wr, qp_entry), (&mut d.max_srq_wr, srq_entry)]
        {
            let fits = u32::try_from(memory / entry).unwrap_or(u32::MAX);
            let most = (*depth).min(q.max_queue_depth).min(fits);
            *depth = if most == 0 { 0 } else { 1 << (31 - most.leading_zeros()) };
        }
        for count in
            [&mut d.max_qp, &mut d.max_cq, &mut d.max_mr, &mut d.max_pd, &mut d.max_ah, &mut d.max_srq]
        {
            *count = (*count).min(q.max_objects);
        }
        d.max_mr_size = d.max_mr_size.min(q.max_registered_bytes);
        // Each region, CQ, QP and SRQ is a mapping in the daemon, and the
        // context itself takes one.
        if let Some(maps) = q.max_mappings {
            let room = maps.saturating_sub(1);
            for count in [&mut d.max_qp, &mut d.max_cq, &mut d.max_mr, &mut d.max_srq] {
                *count = (*count).min(room);
            }
        }
        Ok(d)
    }

    /// The tenant of context `ctx`, if it is open here (opened or
    /// imported).
    pub fn context_tenant(&self, ctx: ContextId) -> Option<TenantId> {
        self.contexts.get(&ctx).map(|c| c.tenant)
    }

    fn tenant_of(&self, ctx: ContextId) -> Result<TenantId, HcaError> {
        self.contexts.get(&ctx).map(|c| c.tenant).ok_or(HcaError::NoSuchObject { kind: "context", id: ctx.0 })
    }

    /// Whether `tenant` may hold `objects` more objects and `bytes` more of
    /// memory (regions, queue rings) within its quota.
    fn within_quota(&self, tenant: TenantId, objects: u32, bytes: u64) -> Result<(), HcaError> {
        let q = self.quota(tenant);
        let (held, held_bytes) = self.usage(tenant);
        if held.saturating_add(objects) > q.max_objects {
            return Err(HcaError::QuotaExceeded(format!("{held} objects held, limit {}", q.max_objects)));
        }
        if held_bytes.saturating_add(bytes) > q.max_registered_bytes {
            return Err(HcaError::QuotaExceeded(format!(
                "{held_bytes} bytes of memory regions and queue rings held, {bytes} more asked, limit {}",
                q.max_registered_bytes
            )));
        }
        Ok(())
    }

    /// Charges `objects` and `bytes` of memory to the context's tenant, or
    /// refuses if that would pass its quota.
    fn charge(&mut self, ctx: ContextId, objects: u32, bytes: u64) -> Result<(), HcaError> {
        let tenant = self.tenant_of(ctx)?;
        self.within_quota(tenant, objects, bytes)?;
        let u = self.usage.entry(tenant).or_default();
        u.objects += objects;
        u.registered_bytes += bytes;
        Ok(())
    }

    /// Charges a queue (CQ, QP, SRQ) whose rings take `bytes` to the
    /// context's tenant: an object, memory, and queue memory, which the
    /// daemon creates and so pays for (`Quota::max_queue_bytes`).
    fn charge_queue(&mut self, ctx: ContextId, bytes: u64) -> Result<(), HcaError> {
        let tenant = self.tenant_of(ctx)?;
        if let Some(most) = self.quota(tenant).max_queue_bytes {
            let held = self.usage.get(&tenant).map_or(0, |u| u.queue_bytes);
            if held.saturating_add(bytes) > most {
                return Err(HcaError::QuotaExceeded(format!(
                    "{held} bytes of queue rings held, {bytes} more asked, limit {most} (the tenant's share \
                     of the daemon's queue memory)"
                )));
            }
        }
        self.charge(ctx, 1, bytes)?;
        self.usage.entry(tenant).or_default().queue_bytes += bytes;
        Ok(())
    }

    /// Gives back what [`charge_queue`](Self::charge_queue) took.
    fn refund_queue(&mut self, ctx: ContextId, bytes: u64) {
        self.refund(ctx, 1, bytes);
        if let Some(t) = self.contexts.get(&ctx).map(|c| c.tenant) {
            let u = self.usage.entry(t).or_default();
            u.queue_bytes = u.queue_bytes.saturating_sub(bytes);
        }
    }

    fn refund(&mut self, ctx: ContextId, objects: u32, bytes: u64) {
        if let Some(t) = self.contexts.get(&ctx).map(|c| c.tenant) {
            let u = self.usage.entry(t).or_default();
            u.objects = u.objects.saturating_sub(objects);
            u.registered_bytes = u.registered_bytes.saturating_sub(bytes);
        }
    }

    fn check_depth(&self, ctx: ContextId, what: &str, depth: u32, device_max: u32) -> Result<(), HcaError> {
        if depth > device_max {
            return Err(HcaError::invalid(format!("{what} {depth} above the device limit {device_max}")));
        }
        let q = self.quota(self.tenant_of(ctx)?);
        // Rings hold a power of two of entries: the depth granted is what
        // counts against the quota.
        let granted = depth.checked_next_power_of_two().unwrap_or(u32::MAX);
        // The tenant's depth limit is what `ibv_query_device` shows it as
        // the device's (`max_cqe`, `max_qp_wr`, `max_srq_wr`): above it is
        // an invalid argument, as above a device's limit on hardware, and
        // programs that probe for the largest queue read EINVAL so. (A
        // quota used up, memory or objects, stays ENOMEM.)
        if granted > q.max_queue_depth {
            return Err(HcaError::invalid(format!(
                "{what} {depth} (granted as {granted}) above the tenant's queue depth limit {}",
                q.max_queue_depth
            )));
        }
        Ok(())
    }

    /// The next PD, CQ, SRQ or AH number that `taken` says is free in its
    /// table, in this daemon's number space ([`numbering`]): after the
    /// counter wraps, a number in use is never handed out again.
    fn alloc_id(&mut self, taken: impl Fn(&Hca, u32) -> bool) -> u32 {
        let mut counter = self.next_id;
        let id = numbering::alloc_id(self.config.number_space, &mut counter, |n| taken(self, n));
        self.next_id = counter;
        id
    }

    /// A number for an object the driver keeps itself (a completion
    /// channel), in this daemon's number space as the core's ids are, so
    /// that it keeps its value when its tenant moves to another daemon
    /// (`hca::migrate::ChannelAt`). `counter` is the driver's (0 to start);
    /// `taken` says whether a number is in use.
    pub fn alloc_driver_id(&self, counter: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
        let space = self.config.number_space;
        if *counter == 0 || (space != 0 && *counter >> 24 != u32::from(space)) {
            *counter = numbering::first_id(space);
        }
        numbering::alloc_id(space, counter, taken)
    }

    /// Whether `ctx` may register `len` more bytes: asked before the daemon
    /// maps a tenant's memory, so that a region that the size limit or the
    /// quota refuses never takes the daemon's address space.
    pub fn may_register(&self, ctx: ContextId, len: u64) -> Result<(), HcaError> {
        if len > self.config.device.max_mr_size {
            return Err(HcaError::invalid(format!("region of {len} bytes is too large")));
        }
        self.within_quota(self.tenant_of(ctx)?, 0, len)
    }

    /// Usage of a tenant: (objects, registered bytes).
    pub fn usage(&self, tenant: TenantId) -> (u32, u64) {
        self.usage.get(&tenant).map(|u| (u.objects, u.registered_bytes)).unwrap_or((0, 0))
    }

    /// Whether a pass of [`Hca::process`] has work now that no queue shows:
    /// a QP that went to ERR while a link's frames were handled.
    pub fn needs_pass(&self) -> bool {
        self.flush_pending
    }
}

/// The memory a queue's ring takes: entries of `stride` bytes (the driver
/// adds a header of a few bytes). The daemon creates and maps the rings,
/// so a tenant's queues count against its quota of memory as its regions
/// do; otherwise deep queues, which cost the tenant nothing to create,
/// would be memory the daemon pays for.
pub(crate) fn ring_bytes(entries: u32, stride: usize) -> u64 {
    u64::from(entries) * stride as u64
}

/// The memory of a QP's send and receive rings, for the capacities
/// granted (none for receives taken from an SRQ).
pub(crate) fn qp_ring_bytes(cap: QpCap) -> u64 {
    ring_bytes(cap.max_send_wr, crate::ring::send_stride(cap.max_send_sge, cap.max_inline_data))
        + ring_bytes(cap.max_recv_wr, crate::ring::recv_stride(cap.max_recv_sge))
}
