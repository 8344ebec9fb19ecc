//! A VM's tenant's rdma_cm ids and event channels moving with it: the
//! driver's half of `vrdma_core::cm::migrate` (the channels, their unread
//! events and the ids' QPs are the driver's), `docs/migration.md`
//! ("rdma_cm ids and event channels").
//!
//! The events do not move as wake-ups: each imported channel gets a new
//! doorbell, rung once for each event it holds, which waits for the
//! guest session that adopts the context; the guest's library drops the
//! wake-ups the source rang (some never reached the VM) and keeps the
//! destination's, so its descriptor is readable exactly while events wait.

use vrdma_core::cm::migrate::{CmChannelSnap, CmSnapshot};
use vrdma_core::hca::migrate::SnapshotError;
use vrdma_core::hca::{ContextId, TenantId};
use vrdma_shm::Doorbell;

use super::{CmDriver, EventChannel, MAX_CHANNELS_PER_TENANT, MAX_UNREAD};

/// An event channel an import made: its number, context, and the tenant's
/// end of its new doorbell (for the session that adopts the context).
pub struct ImportedCmChannel {
    pub id: u32,
    pub ctx: ContextId,
    pub tenant_end: Doorbell,
}

impl CmDriver {
    /// The rdma_cm state of `ctxs` (a paused tenant's), for its snapshot.
    pub fn export(&self, ctxs: &[ContextId]) -> CmSnapshot {
        let mut ids = self.cm.export_ids(ctxs);
        for i in &mut ids {
            i.channel = self.id_channel.get(&i.id).copied().unwrap_or(0);
            i.qp = self.id_qp.get(&i.id).map(|&(c, q)| (c.0, q));
        }
        let mut channels: Vec<CmChannelSnap> = (self.channels.iter())
            .filter(|(_, c)| ctxs.contains(&c.ctx))
            .map(|(&channel, c)| CmChannelSnap {
                channel,
                ctx: c.ctx.0,
                // (An entry whose event went with its id has no event.)
                events: c.events.iter().flatten().cloned().collect(),
            })
            .collect();
        channels.sort_by_key(|c| c.channel);
        CmSnapshot { channels, ids }
    }

    /// Whether [`import`](Self::import) would take `snap` for `tenant`
    /// (checked by `TenantSnapshot::check_cm` already): its channel
    /// numbers free here (`taken`: numbers other channels hold, a
    /// completion channel's), its ids free, within the tenant's limits.
    pub fn check_import(
        &self,
        tenant: TenantId,
        snap: &CmSnapshot,
        taken: impl Fn(u32) -> bool,
    ) -> Result<(), SnapshotError> {
        if let Some(c) =
            snap.channels.iter().find(|c| self.channels.contains_key(&c.channel) || taken(c.channel))
        {
            return Err(SnapshotError::Collision(format!(
                "rdma_cm event channel {:#x} is in use here",
                c.channel
            )));
        }
        let held = self.channels.values().filter(|c| c.tenant == tenant).count();
        if held + snap.channels.len() > MAX_CHANNELS_PER_TENANT {
            return Err(SnapshotError::Quota(format!(
                "{} rdma_cm event channels more than the tenant's limit of {MAX_CHANNELS_PER_TENANT} (it holds {held} here)",
                snap.channels.len()
            )));
        }
        self.cm.check_import(tenant, &snap.ids)
    }

    /// Takes `tenant`'s rdma_cm state, paused (after
    /// [`check_import`](Self::check_import) and the device state's
    /// import): each channel with a new doorbell rung once per event it
    /// holds, each id on its channel with its QP. The channels made, for
    /// the adopting sessions.
    pub fn import(
        &mut self,
        tenant: TenantId,
        snap: &CmSnapshot,
    ) -> Result<Vec<ImportedCmChannel>, SnapshotError> {
        let mut made = Vec::with_capacity(snap.channels.len());
        let mut pairs = Vec::with_capacity(snap.channels.len());
        for _ in &snap.channels {
            let (fd, tenant_end) = Doorbell::pair_with_hangup()
                .map_err(|e| SnapshotError::Invalid(format!("an rdma_cm channel's doorbell: {e}")))?;
            fd.reserve(MAX_UNREAD);
            pairs.push((fd, tenant_end));
        }
        self.cm.import_ids(tenant, &snap.ids)?;
        for (c, (fd, tenant_end)) in snap.channels.iter().zip(pairs) {
            let mut ch = EventChannel::new(ContextId(c.ctx), tenant, fd, false);
            for ev in &c.events {
                ch.events.push_back(Some(ev.clone()));
                ch.ring();
            }
            self.channels.insert(c.channel, ch);
            made.push(ImportedCmChannel { id: c.channel, ctx: ContextId(c.ctx), tenant_end });
        }
        for i in &snap.ids {
            self.id_channel.insert(i.id, i.channel);
            if let Some((c, q)) = i.qp {
                self.id_qp.insert(i.id, (ContextId(c), q));
            }
        }
        Ok(made)
    }

    /// The tenant moved away (`finish`): the ids of `ctxs` go without a
    /// word to their peers (they follow the tenant), and their channels.
    pub fn forget(&mut self, tenant: TenantId, ctxs: &[ContextId]) {
        self.cm.forget_contexts(tenant, ctxs);
        let cm = &self.cm;
        self.id_channel.retain(|&id, _| cm.has_id(id));
        self.id_qp.retain(|&id, _| cm.has_id(id));
        self.channels.retain(|_, c| !ctxs.contains(&c.ctx));
    }
}
