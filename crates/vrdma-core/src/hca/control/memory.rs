//! Protection domains, address handles and memory regions.

use super::super::*;
use crate::memory::Region;
use crate::verbs::{AccessFlags, AhAttr};

impl Hca {
    pub fn alloc_pd(&mut self, ctx: ContextId) -> Result<u32, HcaError> {
        self.refuse_paused(ctx)?;
        if self.pds.len() >= self.config.device.max_pd as usize {
            return Err(HcaError::Exhausted("protection domains"));
        }
        self.charge(ctx, 1, 0)?;
        let pd = self.alloc_id(|h, n| h.pds.contains_key(&n));
        self.pds.insert(pd, Pd { ctx, users: 0 });
        Ok(pd)
    }

    pub(crate) fn own_pd(&mut self, ctx: ContextId, pd: u32) -> Result<&mut Pd, HcaError> {
        match self.pds.get_mut(&pd) {
            Some(p) if p.ctx == ctx => Ok(p),
            _ => Err(HcaError::NoSuchObject { kind: "PD", id: pd }),
        }
    }

    pub fn dealloc_pd(&mut self, ctx: ContextId, pd: u32) -> Result<(), HcaError> {
        self.refuse_paused(ctx)?;
        if self.own_pd(ctx, pd)?.users > 0 {
            return Err(HcaError::Busy("protection domain"));
        }
        self.pds.remove(&pd);
        self.refund(ctx, 1, 0);
        Ok(())
    }

    /// `ibv_create_ah`: an address vector for UD sends from QPs of `pd`.
    /// The destination need not exist (a datagram to nowhere is simply
    /// lost); the port and GID index must, and multicast addresses are not
    /// supported.
    pub fn create_ah(&mut self, ctx: ContextId, pd: u32, attr: AhAttr) -> Result<u32, HcaError> {
        self.refuse_paused(ctx)?;
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
        let ah = self.alloc_id(|h, n| h.ahs.contains_key(&n));
        self.ahs.insert(ah, Ah { ctx, pd, attr });
        Ok(ah)
    }

    /// `ibv_destroy_ah`. A send still queued with this handle fails with
    /// `LocQpOpErr` when the engine reaches it.
    pub fn destroy_ah(&mut self, ctx: ContextId, ah: u32) -> Result<(), HcaError> {
        self.refuse_paused(ctx)?;
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
        self.refuse_paused(ctx)?;
        let len = region.len() as u64;
        if !access.is_consistent() {
            return Err(HcaError::invalid("remote write or atomic access requires local write"));
        }
        if !AccessFlags::FOR_REGIONS.contains(access) {
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
            let k = super::super::numbering::key_in_space(self.config.number_space, self.keys.next_key());
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
        self.refuse_paused(ctx)?;
        match self.mrs.get(&key) {
            Some(m) if m.ctx == ctx => {}
            _ => return Err(HcaError::NoSuchObject { kind: "MR", id: key }),
        }
        let m = self.mrs.remove(&key).expect("present");
        m.region.revoke();
        self.direct.touch();
        if let Some(p) = self.pds.get_mut(&m.pd) {
            p.users -= 1;
        }
        self.refund(ctx, 1, m.len);
        Ok(())
    }
}

/// LIDs 0xc000..=0xfffe are multicast (0xffff is the permissive LID).
fn is_multicast_lid(lid: u16) -> bool {
    (0xc000..0xffff).contains(&lid)
}
