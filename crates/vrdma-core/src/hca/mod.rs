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
mod datapath;
mod error;
mod objects;
mod queues;
mod remote;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

pub use config::{HcaConfig, Quota, MAX_CQE, MAX_QP_WR, MAX_RD_ATOMIC, VENDOR_ID};
pub use datapath::{Activity, GRH_LEN};
pub use error::HcaError;
pub use queues::{AsyncEvent, CqFull, Pulled, Queues, RecvSource};
pub use remote::{
    IoSeg, LinkId, LinkInfo, LinkReport, LinkStats, Path, QpPathReport, Sink, StatReport, Transmit,
    TX_HEADER_CAP,
};

use crate::memory::Region;
use crate::qp::fsm;
use crate::verbs::{
    AccessFlags, AhAttr, AsyncEventType, QpAttr, QpAttrMask, QpCap, QpInitAttr, QpState, QpType, SrqAttr,
};
use objects::{Ah, Context, Cq, Mr, Pd, Qp, Srq};

/// One connection of a tenant process: the `ibv_context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContextId(pub u32);

/// Who owns objects, as the kernel identified the process (not as it claims).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TenantId(pub u32);

/// Where memory keys come from: unguessable in the daemon, a counter in tests.
pub trait KeySource: Send {
    fn next_key(&mut self) -> u32;
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    objects: u32,
    registered_bytes: u64,
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
    /// QP numbers in service order; the engine walks it round-robin.
    qp_order: Vec<u32>,
    next_id: u32,
    next_qpn: u32,
    /// Links to other hosts' daemons.
    net: remote::Network,
}

impl Hca {
    pub fn new(config: HcaConfig, keys: Box<dyn KeySource>) -> Hca {
        Hca {
            config,
            keys,
            quotas: HashMap::new(),
            usage: HashMap::new(),
            contexts: HashMap::new(),
            pds: HashMap::new(),
            mrs: HashMap::new(),
            cqs: HashMap::new(),
            srqs: HashMap::new(),
            ahs: HashMap::new(),
            qps: HashMap::new(),
            qp_order: Vec::new(),
            next_id: 1,
            next_qpn: 0x11,
            net: remote::Network::default(),
        }
    }

    pub fn config(&self) -> &HcaConfig {
        &self.config
    }

    pub fn set_quota(&mut self, tenant: TenantId, quota: Quota) {
        self.quotas.insert(tenant, quota);
    }

    fn quota(&self, tenant: TenantId) -> Quota {
        self.quotas.get(&tenant).copied().unwrap_or(self.config.default_quota)
    }

    fn tenant_of(&self, ctx: ContextId) -> Result<TenantId, HcaError> {
        self.contexts.get(&ctx).map(|c| c.tenant).ok_or(HcaError::NoSuchObject { kind: "context", id: ctx.0 })
    }

    fn charge(&mut self, ctx: ContextId, objects: u32, bytes: u64) -> Result<(), HcaError> {
        let tenant = self.tenant_of(ctx)?;
        let q = self.quota(tenant);
        let u = self.usage.entry(tenant).or_default();
        if u.objects + objects > q.max_objects {
            return Err(HcaError::QuotaExceeded(format!(
                "{} objects held, limit {}",
                u.objects, q.max_objects
            )));
        }
        if u.registered_bytes + bytes > q.max_registered_bytes {
            return Err(HcaError::QuotaExceeded(format!(
                "{} bytes registered, {} more asked, limit {}",
                u.registered_bytes, bytes, q.max_registered_bytes
            )));
        }
        u.objects += objects;
        u.registered_bytes += bytes;
        Ok(())
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
        if depth > q.max_queue_depth {
            return Err(HcaError::QuotaExceeded(format!(
                "{what} {depth} above the tenant's queue depth limit {}",
                q.max_queue_depth
            )));
        }
        Ok(())
    }

    fn alloc_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    /// Usage of a tenant: (objects, registered bytes).
    pub fn usage(&self, tenant: TenantId) -> (u32, u64) {
        self.usage.get(&tenant).map(|u| (u.objects, u.registered_bytes)).unwrap_or((0, 0))
    }

    // ---- contexts ----

    pub fn open_context(&mut self, ctx: ContextId, tenant: TenantId) -> Result<(), HcaError> {
        if self.contexts.contains_key(&ctx) {
            return Err(HcaError::invalid("context already open"));
        }
        let open = self.contexts.values().filter(|c| c.tenant == tenant).count();
        let limit = self.quota(tenant).max_contexts as usize;
        if open >= limit {
            return Err(HcaError::QuotaExceeded(format!("{open} contexts open, limit {limit}")));
        }
        self.contexts.insert(ctx, Context { tenant });
        Ok(())
    }

    /// Charges an object the driver keeps itself (a completion channel) to
    /// the context's tenant, so that it counts against the quota.
    pub fn charge_object(&mut self, ctx: ContextId) -> Result<(), HcaError> {
        self.charge(ctx, 1, 0)
    }

    /// Gives back what [`charge_object`](Self::charge_object) took.
    pub fn refund_object(&mut self, ctx: ContextId) {
        self.refund(ctx, 1, 0);
    }

    /// Destroys everything `ctx` holds, as when its process exits or dies.
    /// QPs of other processes connected to its QPs go to the error state:
    /// their peer is gone and nothing they post can complete.
    pub fn close_context(&mut self, ctx: ContextId, io: &mut dyn Queues) -> Teardown {
        let mut t = Teardown::default();
        // One pass over all QPs to find this context's and their peers, so
        // that closing a context with many QPs costs O(QPs), not O(QPs²).
        let mine: std::collections::HashSet<u32> =
            self.qps.iter().filter(|(_, q)| q.ctx == ctx).map(|(&n, _)| n).collect();
        let peers: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| {
                q.ctx != ctx
                    && mine.contains(&q.attr.dest_qp_num)
                    && q.init.qp_type == QpType::Rc
                    && matches!(q.state(), QpState::Rtr | QpState::Rts | QpState::Sqd)
            })
            .map(|(&n, _)| n)
            .collect();
        for p in peers {
            self.peer_lost(p, io);
        }
        let mine: Vec<u32> = mine.into_iter().collect();
        self.remove_qps(&mine, io);
        t.qps = mine;
        let srqs: Vec<u32> = self.srqs.iter().filter(|(_, s)| s.ctx == ctx).map(|(&n, _)| n).collect();
        for n in srqs {
            self.srqs.remove(&n);
            self.refund(ctx, 1, 0);
            t.srqs.push(n);
        }
        let ahs: Vec<u32> = self.ahs.iter().filter(|(_, a)| a.ctx == ctx).map(|(&n, _)| n).collect();
        for n in ahs {
            self.ahs.remove(&n);
            self.refund(ctx, 1, 0);
        }
        let mrs: Vec<u32> = self.mrs.iter().filter(|(_, m)| m.ctx == ctx).map(|(&k, _)| k).collect();
        for k in mrs {
            if let Some(m) = self.mrs.remove(&k) {
                self.refund(ctx, 1, m.len);
            }
        }
        let cqs: Vec<u32> = self.cqs.iter().filter(|(_, c)| c.ctx == ctx).map(|(&n, _)| n).collect();
        for n in cqs {
            self.cqs.remove(&n);
            self.refund(ctx, 1, 0);
            t.cqs.push(n);
        }
        let pds: Vec<u32> = self.pds.iter().filter(|(_, p)| p.ctx == ctx).map(|(&n, _)| n).collect();
        for n in pds {
            self.pds.remove(&n);
            self.refund(ctx, 1, 0);
        }
        self.contexts.remove(&ctx);
        t
    }

    // ---- protection domains ----

    pub fn alloc_pd(&mut self, ctx: ContextId) -> Result<u32, HcaError> {
        if self.pds.len() >= self.config.device.max_pd as usize {
            return Err(HcaError::Exhausted("protection domains"));
        }
        self.charge(ctx, 1, 0)?;
        let pd = self.alloc_id();
        self.pds.insert(pd, Pd { ctx, users: 0 });
        Ok(pd)
    }

    fn own_pd(&mut self, ctx: ContextId, pd: u32) -> Result<&mut Pd, HcaError> {
        match self.pds.get_mut(&pd) {
            Some(p) if p.ctx == ctx => Ok(p),
            _ => Err(HcaError::NoSuchObject { kind: "PD", id: pd }),
        }
    }

    pub fn dealloc_pd(&mut self, ctx: ContextId, pd: u32) -> Result<(), HcaError> {
        if self.own_pd(ctx, pd)?.users > 0 {
            return Err(HcaError::Busy("protection domain"));
        }
        self.pds.remove(&pd);
        self.refund(ctx, 1, 0);
        Ok(())
    }

    // ---- address handles ----

    /// `ibv_create_ah`: an address vector for UD sends from QPs of `pd`.
    /// The destination need not exist (a datagram to nowhere is simply
    /// lost); the port and GID index must, and multicast addresses are not
    /// supported.
    pub fn create_ah(&mut self, ctx: ContextId, pd: u32, attr: AhAttr) -> Result<u32, HcaError> {
        let ports = self.config.device.phys_port_cnt;
        if attr.port_num == 0 || attr.port_num > ports {
            return Err(HcaError::invalid(format!(
                "address handle on port {}; the device has port{} 1..={ports}",
                attr.port_num,
                if ports == 1 { "" } else { "s" }
            )));
        }
        if attr.is_global && attr.sgid_index as usize >= self.config.gids.len() {
            return Err(HcaError::invalid(format!(
                "sgid_index {} beyond the GID table of {} entries",
                attr.sgid_index,
                self.config.gids.len()
            )));
        }
        if is_multicast_lid(attr.dlid) || (attr.is_global && attr.dgid.0[0] == 0xff) {
            return Err(HcaError::Unsupported("multicast address handles"));
        }
        if self.ahs.len() >= self.config.device.max_ah as usize {
            return Err(HcaError::Exhausted("address handles"));
        }
        self.own_pd(ctx, pd)?;
        self.charge(ctx, 1, 0)?;
        self.own_pd(ctx, pd).expect("checked").users += 1;
        let ah = self.alloc_id();
        self.ahs.insert(ah, Ah { ctx, pd, attr });
        Ok(ah)
    }

    /// `ibv_destroy_ah`. A send still queued with this handle fails with
    /// `LocQpOpErr` when the engine reaches it.
    pub fn destroy_ah(&mut self, ctx: ContextId, ah: u32) -> Result<(), HcaError> {
        match self.ahs.get(&ah) {
            Some(a) if a.ctx == ctx => {}
            _ => return Err(HcaError::NoSuchObject { kind: "AH", id: ah }),
        }
        let a = self.ahs.remove(&ah).expect("present");
        if let Some(p) = self.pds.get_mut(&a.pd) {
            p.users -= 1;
        }
        self.refund(ctx, 1, 0);
        Ok(())
    }

    // ---- memory regions ----

    /// Registers `region` as the bytes at tenant address `addr`; returns the
    /// key, which serves as both lkey and rkey.
    pub fn reg_mr(
        &mut self,
        ctx: ContextId,
        pd: u32,
        addr: u64,
        access: AccessFlags,
        region: Region,
    ) -> Result<u32, HcaError> {
        let len = region.len() as u64;
        if !access.is_consistent() {
            return Err(HcaError::invalid("remote write or atomic access requires local write"));
        }
        let supported = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC
            | AccessFlags::RELAXED_ORDERING;
        if !supported.contains(access) {
            return Err(HcaError::Unsupported("memory-region access flags other than local write, remote read/write/atomic and relaxed ordering"));
        }
        if len > self.config.device.max_mr_size || addr.checked_add(len).is_none() {
            return Err(HcaError::invalid(format!("region of {len} bytes at {addr:#x} is too large")));
        }
        if self.mrs.len() >= self.config.device.max_mr as usize {
            return Err(HcaError::Exhausted("memory regions"));
        }
        self.own_pd(ctx, pd)?;
        self.charge(ctx, 1, len)?;
        let key = loop {
            let k = self.keys.next_key();
            if k != 0 && !self.mrs.contains_key(&k) {
                break k;
            }
        };
        self.own_pd(ctx, pd).expect("checked").users += 1;
        self.mrs.insert(key, Mr { ctx, pd, addr, len, access, region });
        Ok(key)
    }

    /// Deregisters at once: from here on no work request can reach the region.
    pub fn dereg_mr(&mut self, ctx: ContextId, key: u32) -> Result<(), HcaError> {
        match self.mrs.get(&key) {
            Some(m) if m.ctx == ctx => {}
            _ => return Err(HcaError::NoSuchObject { kind: "MR", id: key }),
        }
        let m = self.mrs.remove(&key).expect("present");
        if let Some(p) = self.pds.get_mut(&m.pd) {
            p.users -= 1;
        }
        self.refund(ctx, 1, m.len);
        Ok(())
    }

    // ---- completion queues ----

    /// Creates a CQ of at least `cqe` entries; returns (cqn, depth granted).
    pub fn create_cq(&mut self, ctx: ContextId, cqe: u32) -> Result<(u32, u32), HcaError> {
        if cqe == 0 {
            return Err(HcaError::invalid("a CQ needs at least one entry"));
        }
        self.check_depth(ctx, "CQ depth", cqe, self.config.device.max_cqe)?;
        if self.cqs.len() >= self.config.device.max_cq as usize {
            return Err(HcaError::Exhausted("completion queues"));
        }
        self.charge(ctx, 1, 0)?;
        let depth = cqe.next_power_of_two();
        let n = self.alloc_id();
        self.cqs.insert(n, Cq { ctx, users: 0, overrun: false });
        Ok((n, depth))
    }

    pub fn destroy_cq(&mut self, ctx: ContextId, cqn: u32) -> Result<(), HcaError> {
        match self.cqs.get(&cqn) {
            Some(c) if c.ctx == ctx && c.users > 0 => Err(HcaError::Busy("completion queue")),
            Some(c) if c.ctx == ctx => {
                self.cqs.remove(&cqn);
                self.refund(ctx, 1, 0);
                Ok(())
            }
            _ => Err(HcaError::NoSuchObject { kind: "CQ", id: cqn }),
        }
    }

    // ---- shared receive queues ----

    pub fn create_srq(&mut self, ctx: ContextId, pd: u32, attr: SrqAttr) -> Result<(u32, SrqAttr), HcaError> {
        let dev = &self.config.device;
        if attr.max_wr == 0 || attr.max_sge > dev.max_srq_sge {
            return Err(HcaError::invalid(format!(
                "SRQ needs 1..={} WRs and at most {} SGEs",
                dev.max_srq_wr, dev.max_srq_sge
            )));
        }
        self.check_depth(ctx, "SRQ depth", attr.max_wr, dev.max_srq_wr)?;
        if self.srqs.len() >= dev.max_srq as usize {
            return Err(HcaError::Exhausted("shared receive queues"));
        }
        self.own_pd(ctx, pd)?;
        self.charge(ctx, 1, 0)?;
        self.own_pd(ctx, pd).expect("checked").users += 1;
        let granted = SrqAttr {
            max_wr: attr.max_wr.next_power_of_two(),
            max_sge: attr.max_sge.max(1),
            srq_limit: attr.srq_limit,
        };
        let n = self.alloc_id();
        self.srqs.insert(n, Srq { ctx, pd, attr: granted, users: 0, requeued: VecDeque::new() });
        Ok((n, granted))
    }

    /// `ibv_modify_srq`: only the limit can change (`IBV_SRQ_LIMIT`); a
    /// resize (`IBV_SRQ_MAX_WR`) is refused as on most hardware.
    pub fn modify_srq(
        &mut self,
        ctx: ContextId,
        srqn: u32,
        limit: Option<u32>,
        resize: bool,
    ) -> Result<(), HcaError> {
        let s = self.own_srq(ctx, srqn)?;
        if resize {
            return Err(HcaError::Unsupported("resizing an SRQ"));
        }
        if let Some(l) = limit {
            if l > s.attr.max_wr {
                return Err(HcaError::invalid(format!("SRQ limit {l} above its depth {}", s.attr.max_wr)));
            }
            s.attr.srq_limit = l;
        }
        Ok(())
    }

    pub fn query_srq(&mut self, ctx: ContextId, srqn: u32) -> Result<SrqAttr, HcaError> {
        Ok(self.own_srq(ctx, srqn)?.attr)
    }

    fn own_srq(&mut self, ctx: ContextId, srqn: u32) -> Result<&mut Srq, HcaError> {
        match self.srqs.get_mut(&srqn) {
            Some(s) if s.ctx == ctx => Ok(s),
            _ => Err(HcaError::NoSuchObject { kind: "SRQ", id: srqn }),
        }
    }

    pub fn destroy_srq(&mut self, ctx: ContextId, srqn: u32) -> Result<(), HcaError> {
        if self.own_srq(ctx, srqn)?.users > 0 {
            return Err(HcaError::Busy("shared receive queue"));
        }
        let s = self.srqs.remove(&srqn).expect("present");
        if let Some(p) = self.pds.get_mut(&s.pd) {
            p.users -= 1;
        }
        self.refund(ctx, 1, 0);
        Ok(())
    }

    // ---- queue pairs ----

    pub fn create_qp(&mut self, ctx: ContextId, pd: u32, init: QpInitAttr) -> Result<QpCreated, HcaError> {
        let tenant = self.tenant_of(ctx)?;
        if init.qp_type == QpType::Uc {
            return Err(HcaError::Unsupported("UC queue pairs (RC and UD are supported)"));
        }
        let dev = &self.config.device;
        let c = init.cap;
        if c.max_send_sge > dev.max_sge || c.max_recv_sge > dev.max_sge {
            return Err(HcaError::invalid(format!("at most {} SGEs per WR", dev.max_sge)));
        }
        if c.max_inline_data > dev.max_inline_data {
            return Err(HcaError::invalid(format!("at most {} inline bytes", dev.max_inline_data)));
        }
        if c.max_send_wr == 0 {
            return Err(HcaError::invalid("a QP needs max_send_wr of at least 1"));
        }
        if init.srq.is_none() && c.max_recv_wr == 0 {
            return Err(HcaError::invalid("a QP without an SRQ needs max_recv_wr of at least 1"));
        }
        self.check_depth(ctx, "max_send_wr", c.max_send_wr, dev.max_qp_wr)?;
        self.check_depth(ctx, "max_recv_wr", c.max_recv_wr, dev.max_qp_wr)?;
        if self.qps.len() >= dev.max_qp as usize {
            return Err(HcaError::Exhausted("queue pairs"));
        }
        self.own_pd(ctx, pd)?;
        for cq in [init.send_cq, init.recv_cq] {
            match self.cqs.get(&cq) {
                Some(c) if c.ctx == ctx => {}
                _ => return Err(HcaError::NoSuchObject { kind: "CQ", id: cq }),
            }
        }
        if let Some(s) = init.srq {
            // Receive SGEs from an SRQ are checked against the SRQ's PD.
            self.own_srq(ctx, s)?;
        }
        self.charge(ctx, 1, 0)?;
        let granted = QpCap {
            max_send_wr: c.max_send_wr.next_power_of_two(),
            max_recv_wr: if init.srq.is_some() { 0 } else { c.max_recv_wr.next_power_of_two() },
            max_send_sge: c.max_send_sge.max(1),
            max_recv_sge: if init.srq.is_some() { 0 } else { c.max_recv_sge.max(1) },
            max_inline_data: c.max_inline_data,
        };
        let qpn = loop {
            let n = self.next_qpn;
            // 0xff_ffff is the multicast QPN: never a QP's number.
            self.next_qpn = if n >= 0xff_fffe { 0x11 } else { n + 1 };
            if !self.qps.contains_key(&n) {
                break n;
            }
        };
        self.own_pd(ctx, pd).expect("checked").users += 1;
        self.cqs.get_mut(&init.send_cq).expect("checked").users += 1;
        self.cqs.get_mut(&init.recv_cq).expect("checked").users += 1;
        if let Some(s) = init.srq {
            self.srqs.get_mut(&s).expect("checked").users += 1;
        }
        let mut init = init;
        init.cap = granted;
        let attr = QpAttr { cap: granted, ..QpAttr::default() };
        self.qps.insert(
            qpn,
            Qp {
                ctx,
                tenant,
                pd,
                init,
                attr,
                inflight: None,
                requeued: VecDeque::new(),
                sqd_notify: false,
                remote: None,
            },
        );
        self.qp_order.push(qpn);
        Ok(QpCreated { qpn, cap: granted })
    }

    fn own_qp(&mut self, ctx: ContextId, qpn: u32) -> Result<&mut Qp, HcaError> {
        match self.qps.get_mut(&qpn) {
            Some(q) if q.ctx == ctx => Ok(q),
            _ => Err(HcaError::NoSuchObject { kind: "QP", id: qpn }),
        }
    }

    /// `ibv_modify_qp`, checked against the state machine and the limits.
    pub fn modify_qp(
        &mut self,
        ctx: ContextId,
        qpn: u32,
        attr: &QpAttr,
        mask: QpAttrMask,
        io: &mut dyn Queues,
    ) -> Result<QpState, HcaError> {
        let limits = self.config.modify_limits();
        let qp = self.own_qp(ctx, qpn)?;
        let cur = qp.state();
        let to = fsm::check_modify(qp.init.qp_type, cur, attr, mask, &limits)?;
        if mask.contains(QpAttrMask::CAP) {
            return Err(HcaError::Unsupported("resizing a QP's queues"));
        }
        let cap = qp.attr.cap;
        fsm::apply_modify(&mut qp.attr, attr, mask, to);
        qp.attr.cap = cap;
        if to == QpState::Sqd && cur != QpState::Sqd {
            qp.sqd_notify = mask.contains(QpAttrMask::EN_SQD_ASYNC_NOTIFY) && attr.en_sqd_async_notify;
        }
        match to {
            QpState::Reset => {
                // A receive claimed from the peer for an unfinished message
                // goes back to it, as when the QP is destroyed.
                let dest = qp.attr.dest_qp_num;
                let held = qp.inflight.take();
                // Everything of the remote transport starts over, as the
                // PSNs do; what it held was posted to this QP and goes
                // with its queues.
                let remote_held = qp.remote.take().map_or(0, |r| r.held_sends());
                let was_held = held.is_some();
                let claimed = held.and_then(|i| i.recv);
                qp.requeued.clear();
                let keep = qp.attr.cap;
                qp.attr = QpAttr { cap: keep, ..QpAttr::default() };
                // The WR in flight is dropped without a completion: it is
                // retired before the queue is reset, so that the driver's
                // count of outstanding WRs starts again from zero.
                let held = u32::from(was_held) + remote_held;
                if held > 0 {
                    io.send_retired(qpn, held);
                }
                io.discard(qpn);
                if let Some(r) = claimed {
                    self.requeue_recv(dest, r);
                }
            }
            QpState::Err if cur != QpState::Err => {
                qp.attr.qp_state = cur;
                self.enter_error(qpn, io);
            }
            _ => {}
        }
        // enter_error publishes ERR itself.
        if to != cur && to != QpState::Err {
            io.qp_state_changed(qpn, to);
        }
        if to == QpState::Rtr && cur != QpState::Rtr {
            if let Some(path) = self.qp_path(qpn) {
                tracing::info!(qpn, dest_qpn = attr.dest_qp_num, ?path, "QP connected");
            }
        }
        Ok(to)
    }

    pub fn query_qp(&mut self, ctx: ContextId, qpn: u32) -> Result<(QpAttr, QpInitAttr), HcaError> {
        let qp = self.own_qp(ctx, qpn)?;
        let mut a = qp.attr;
        a.cur_qp_state = a.qp_state;
        a.sq_draining = a.qp_state == QpState::Sqd && qp.inflight.is_some();
        Ok((a, qp.init))
    }

    /// `ibv_destroy_qp`. A send WR the QP held is retired (through `io`)
    /// without a completion, as everything still posted is dropped.
    pub fn destroy_qp(&mut self, ctx: ContextId, qpn: u32, io: &mut dyn Queues) -> Result<(), HcaError> {
        self.own_qp(ctx, qpn)?;
        self.remove_qps(&[qpn], io);
        Ok(())
    }

    fn remove_qps(&mut self, qpns: &[u32], io: &mut dyn Queues) {
        let gone: std::collections::HashSet<u32> = qpns.iter().copied().collect();
        self.qp_order.retain(|n| !gone.contains(n));
        for &qpn in qpns {
            self.remove_one_qp(qpn, io);
        }
    }

    /// Removes one QP; `qp_order` is the caller's to update.
    fn remove_one_qp(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(mut qp) = self.qps.remove(&qpn) else { return };
        if let Some(n) = qp.remote.take().map(|r| r.held_sends()).filter(|&n| n > 0) {
            io.send_retired(qpn, n);
        }
        if let Some(inf) = qp.inflight.take() {
            io.send_retired(qpn, 1);
            // A receive WR taken for a message that never finished goes
            // back to the responder, as if the message had never arrived.
            if let Some(recv) = inf.recv {
                self.requeue_recv(qp.attr.dest_qp_num, recv);
            }
        }
        // Receive WRs other requesters took from this QP must never be
        // handed back by number: the number may later name another
        // tenant's QP. Those of its SRQ go back to the SRQ now; those of its
        // own receive queue are discarded with it, as destroy_qp discards
        // every posted receive.
        let mut orphans = Vec::new();
        for other in self.qps.values_mut() {
            if other.attr.dest_qp_num == qpn {
                if let Some(r) = other.inflight.as_mut().and_then(|i| i.recv.take()) {
                    orphans.push(r);
                }
            }
        }
        if let Some(srq) = qp.init.srq.and_then(|s| self.srqs.get_mut(&s)) {
            for r in orphans {
                srq.requeued.push_front(r);
            }
        }
        if let Some(p) = self.pds.get_mut(&qp.pd) {
            p.users = p.users.saturating_sub(1);
        }
        for cq in [qp.init.send_cq, qp.init.recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.users -= 1;
            }
        }
        if let Some(s) = qp.init.srq.and_then(|s| self.srqs.get_mut(&s)) {
            s.users -= 1;
        }
        self.refund(qp.ctx, 1, 0);
    }

    fn requeue_recv(&mut self, responder_qpn: u32, recv: crate::ring::RecvWr) {
        let Some(r) = self.qps.get_mut(&responder_qpn) else { return };
        match r.init.srq {
            Some(s) => {
                if let Some(srq) = self.srqs.get_mut(&s) {
                    srq.requeued.push_front(recv);
                }
            }
            None => r.requeued.push_front(recv),
        }
    }

    /// A send WR of `qpn` failed locally: a UD QP goes to SQE (its receive
    /// queue keeps working, its send queue is flushed until it is moved
    /// back to RTS), an RC QP to ERR.
    fn send_queue_error(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if qp.init.qp_type != QpType::Ud {
            self.enter_error(qpn, io);
            return;
        }
        if matches!(qp.state(), QpState::Rts | QpState::Sqd) {
            qp.attr.qp_state = QpState::Sqe;
            io.qp_state_changed(qpn, QpState::Sqe);
        }
    }

    /// Moves a QP to ERR; its queues are flushed by the engine.
    fn enter_error(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if qp.state() == QpState::Err {
            return;
        }
        qp.attr.qp_state = QpState::Err;
        let (ctx, srq) = (qp.ctx, qp.init.srq);
        io.qp_state_changed(qpn, QpState::Err);
        if srq.is_some() {
            io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::QpLastWqeReached, element: qpn });
        }
    }

    /// The QP this one is connected to is gone: what it has in flight can
    /// never be acknowledged.
    fn peer_lost(&mut self, qpn: u32, io: &mut dyn Queues) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let ctx = qp.ctx;
        if let Some(inf) = qp.inflight.take() {
            let cqe = datapath::error_cqe(&inf.wr, crate::verbs::WcStatus::RetryExcErr, qpn);
            let cq = qp.init.send_cq;
            io.send_retired(qpn, 1);
            self.complete(cq, cqe, qpn, io);
        }
        self.enter_error(qpn, io);
        io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::QpFatal, element: qpn });
    }

    /// Appends a completion; an overrun puts the CQ and the QP in error.
    fn complete(&mut self, cqn: u32, cqe: crate::ring::Cqe, qpn: u32, io: &mut dyn Queues) {
        let Some(cq) = self.cqs.get_mut(&cqn) else { return };
        if cq.overrun {
            return;
        }
        if io.push_cqe(cqn, &cqe).is_err() {
            cq.overrun = true;
            let ctx = cq.ctx;
            io.async_event(ctx, AsyncEvent { event_type: AsyncEventType::CqErr, element: cqn });
            if let Some(q) = self.qps.get(&qpn) {
                let qctx = q.ctx;
                self.enter_error(qpn, io);
                io.async_event(qctx, AsyncEvent { event_type: AsyncEventType::QpFatal, element: qpn });
            }
        }
    }
}

/// LIDs 0xc000..=0xfffe are multicast (0xffff is the permissive LID).
fn is_multicast_lid(lid: u16) -> bool {
    (0xc000..0xffff).contains(&lid)
}
