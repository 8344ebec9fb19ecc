//! Completion queues.

use super::super::*;

impl Hca {
    /// Creates a CQ of at least `cqe` entries; returns (cqn, depth granted).
    pub fn create_cq(&mut self, ctx: ContextId, cqe: u32) -> Result<(u32, u32), HcaError> {
        self.refuse_paused(ctx)?;
        if cqe == 0 {
            return Err(HcaError::invalid("a CQ needs at least one entry"));
        }
        self.check_depth(ctx, "CQ depth", cqe, self.config.device.max_cqe)?;
        if self.cqs.len() >= self.config.device.max_cq as usize {
            return Err(HcaError::Exhausted("completion queues"));
        }
        let depth = cqe.next_power_of_two();
        let ring_bytes = ring_bytes(depth, crate::ring::CQE_SIZE);
        self.charge_queue(ctx, ring_bytes)?;
        let n = self.alloc_id(|h, n| h.cqs.contains_key(&n));
        self.cqs.insert(n, Cq { ctx, users: 0, overrun: false, ring_bytes });
        Ok((n, depth))
    }

    pub fn destroy_cq(&mut self, ctx: ContextId, cqn: u32) -> Result<(), HcaError> {
        self.refuse_paused(ctx)?;
        match self.cqs.get(&cqn) {
            Some(c) if c.ctx == ctx && c.users > 0 => Err(HcaError::Busy("completion queue")),
            Some(c) if c.ctx == ctx => {
                let bytes = c.ring_bytes;
                self.cqs.remove(&cqn);
                self.refund_queue(ctx, bytes);
                Ok(())
            }
            _ => Err(HcaError::NoSuchObject { kind: "CQ", id: cqn }),
        }
    }
}
