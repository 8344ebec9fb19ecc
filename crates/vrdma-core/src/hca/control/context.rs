//! Contexts: a tenant process's connection, and everything it holds.

use super::super::*;
use crate::verbs::{QpState, QpType};

impl Hca {
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
        self.direct.touch();
        // One pass over all QPs to find this context's and their peers, so
        // that closing a context with many QPs costs O(QPs), not O(QPs²).
        let mine: std::collections::HashSet<u32> =
            self.qps.iter().filter(|(_, q)| q.ctx == ctx).map(|(&n, _)| n).collect();
        let tenant = self.contexts.get(&ctx).map(|c| c.tenant);
        // A peer is a QP of the same tenant on this host: a QP connected to
        // another host names a QP number of that host, which may equal one
        // here.
        let peers: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| {
                q.ctx != ctx
                    && Some(q.tenant) == tenant
                    && self.is_local(&q.attr.ah_attr)
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
            let bytes = self.srqs.remove(&n).map_or(0, |s| s.ring_bytes);
            self.refund_queue(ctx, bytes);
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
                m.region.revoke();
                self.refund(ctx, 1, m.len);
            }
        }
        let cqs: Vec<u32> = self.cqs.iter().filter(|(_, c)| c.ctx == ctx).map(|(&n, _)| n).collect();
        for n in cqs {
            let bytes = self.cqs.remove(&n).map_or(0, |c| c.ring_bytes);
            self.refund_queue(ctx, bytes);
            t.cqs.push(n);
        }
        let pds: Vec<u32> = self.pds.iter().filter(|(_, p)| p.ctx == ctx).map(|(&n, _)| n).collect();
        for n in pds {
            self.pds.remove(&n);
            self.refund(ctx, 1, 0);
        }
        self.contexts.remove(&ctx);
        // Its tenant's last context: its traffic on the links is no longer
        // kept apart (bounded by the tenants present, not those that were).
        if let Some(tenant) = tenant.filter(|&tn| !self.contexts.values().any(|c| c.tenant == tn)) {
            self.net.forget_tenant(tenant);
        }
        t
    }
}
