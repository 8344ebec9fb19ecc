//! Shared receive queues.

use std::collections::VecDeque;

use super::super::*;
use crate::verbs::SrqAttr;

impl Hca {
    pub fn create_srq(&mut self, ctx: ContextId, pd: u32, attr: SrqAttr) -> Result<(u32, SrqAttr), HcaError> {
        self.refuse_paused(ctx)?;
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
        let granted = SrqAttr {
            max_wr: attr.max_wr.next_power_of_two(),
            max_sge: attr.max_sge.max(1),
            srq_limit: attr.srq_limit,
        };
        let ring_bytes = ring_bytes(granted.max_wr, crate::ring::recv_stride(granted.max_sge));
        self.charge_queue(ctx, ring_bytes)?;
        self.own_pd(ctx, pd).expect("checked").users += 1;
        let n = self.alloc_id(|h, n| h.srqs.contains_key(&n));
        self.srqs.insert(n, Srq { ctx, pd, attr: granted, users: 0, requeued: VecDeque::new(), ring_bytes });
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
        self.refuse_paused(ctx)?;
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

    pub(crate) fn own_srq(&mut self, ctx: ContextId, srqn: u32) -> Result<&mut Srq, HcaError> {
        match self.srqs.get_mut(&srqn) {
            Some(s) if s.ctx == ctx => Ok(s),
            _ => Err(HcaError::NoSuchObject { kind: "SRQ", id: srqn }),
        }
    }

    pub fn destroy_srq(&mut self, ctx: ContextId, srqn: u32) -> Result<(), HcaError> {
        self.refuse_paused(ctx)?;
        if self.own_srq(ctx, srqn)?.users > 0 {
            return Err(HcaError::Busy("shared receive queue"));
        }
        let s = self.srqs.remove(&srqn).expect("present");
        if let Some(p) = self.pds.get_mut(&s.pd) {
            p.users -= 1;
        }
        self.refund_queue(ctx, s.ring_bytes);
        Ok(())
    }
}
