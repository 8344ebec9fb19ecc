//! A guest session adopts a context that moved here with its VM
//! (`AdoptContext`, issue 19): the context's segment found again where the
//! guest left it in the VM's region, new doorbells, its memory extents
//! (regions on them or not), and the completion channels the import made
//! again for it, whose doorbells the guest's library takes here.
//!
//! Apart from `session` because it is one step of a migration, not a call
//! that makes objects: it reads what the import (`migrate_vm`) left for it
//! and hands it to the session, and only a guest session runs it.

use std::sync::Arc;

use vrdma_core::hca::ContextId;
use vrdma_core::proto::{
    MovedChannel, Reply, RingSpec, ASYNC_EVENT_SIZE, ASYNC_RING_CAPACITY, POSTED_RING_CAPACITY,
    POSTED_SLOT_SIZE,
};
use vrdma_shm::{Doorbell, RingView};

use super::super::guest_memory::RingMemory;
use super::{check_version, engine_gone, error, Answer, Carry, Session, EINVAL, ENOMEM, EPROTO};
use crate::engine::ContextRings;

// An adoption's reply carries three handles and one per channel of the
// context (a tenant's completion and rdma_cm event channels at most):
// the guest's decoder takes that many.
const _: () = assert!(
    3 + super::MAX_CHANNELS_PER_TENANT + crate::cm::MAX_CHANNELS_PER_TENANT
        <= vrdma_core::proto::guest::MAX_HANDLES
);

impl Session {
    /// A guest session takes over `context`, imported with its VM
    /// (`migrate_vm::claim_context` says which may be): its context
    /// segment found again where the guest left it, new doorbells, its
    /// memory extents, and the session's number becomes the context's.
    /// Answered as Hello.
    pub(super) fn adopt(&mut self, version: u32, context: u32) -> Result<Answer, Answer> {
        if self.open {
            return Err(error(EPROTO, "this session has a context already"));
        }
        check_version(version)?;
        let Some(g) = &self.guest else {
            return Err(error(
                libc::EPERM,
                "only a guest session adopts a context: a host process's context does not move",
            ));
        };
        let vm = g.vm.clone();
        let admitted = self.admit()?;
        let tenant = self.tenant;
        // Claimed (out of the VM's unowned extents) before anything else,
        // so that two sessions cannot both adopt it.
        let (at, len) = super::super::migrate_vm::claim_context(&vm, context)?;
        let installed = self.install_adopted(&vm, context, at, len);
        let (doorbell_tenant, event_tenant, channels) = match installed {
            Ok(fds) => fds,
            Err(a) => {
                // Everything that mapped the segment is gone, its extent
                // still reserved (no mapping of the adoption owned it):
                // the context's again, to adopt later.
                super::super::migrate_vm::unclaim_context(&vm, context, at);
                return Err(a);
            }
        };
        let (posted_at, _) = vrdma_core::proto::context_segment_layout();
        // The session is the context's now: its number (which `Shared`
        // ends it by) and its memory.
        let old = self.ctx.0;
        self.ctx = ContextId(context);
        for s in self.shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if s.0 == old {
                s.0 = context;
            }
        }
        if let Some(g) = self.guest.as_mut() {
            // Memory the session took before it adopted goes with it.
            g.vm.placed().memory_moves(old, context);
            super::super::migrate_vm::hand_memory(g, context);
        }
        self.open = true;
        self.admitted = Some(admitted);
        // Each channel's doorbell is a descriptor here, as when made.
        for _ in &channels {
            if let Some(Err(e)) = self.admitted.as_mut().map(|a| a.charge_descriptor()) {
                tracing::warn!(error = %e, "a moved completion channel's descriptor is over the limit");
            }
        }
        let (ids, mut fds): (Vec<_>, Vec<Carry>) = channels
            .into_iter()
            .map(|m| {
                let moved = MovedChannel { channel: m.id, raised_before: m.produced_at_import };
                (moved, m.tenant_end.into())
            })
            .unzip();
        tracing::info!(vm = %vm.name, ctx = context, channels = ids.len(), "a guest session adopted its moved context");
        Ok(Answer {
            reply: Reply::Hello {
                context,
                tenant: tenant.0,
                device_name: self.shared.device_name.clone(),
                segment_len: len,
                async_ring: RingSpec {
                    offset: 0,
                    capacity: ASYNC_RING_CAPACITY,
                    stride: ASYNC_EVENT_SIZE as u32,
                },
                posted_ring: RingSpec {
                    offset: posted_at,
                    capacity: POSTED_RING_CAPACITY,
                    stride: POSTED_SLOT_SIZE as u32,
                },
                channels: ids,
            },
            fds: {
                let mut all =
                    vec![Carry::Extent { offset: at, len }, doorbell_tenant.into(), event_tenant.into()];
                all.append(&mut fds);
                all
            },
        })
    }

    /// The rings of an adopted context, in its segment at `at`, handed to
    /// the engine with new doorbells (checked there: the context of this
    /// tenant, with no session): the tenant's ends of the doorbells, and
    /// the completion channels that moved with the context (their wake-ups
    /// from before the import are the library's to ring again: it alone
    /// knows which it still holds).
    fn install_adopted(
        &self,
        vm: &Arc<crate::vm::Vm>,
        context: u32,
        at: u64,
        len: u64,
    ) -> Result<(Doorbell, Doorbell, Vec<crate::vm::MovedChannel>), Answer> {
        let moved = vm.placed().moved_channels.remove(&context).unwrap_or_default();
        match self.install_adopted_rings(vm, context, at, len) {
            Ok((d, e)) => Ok((d, e, moved)),
            Err(a) => {
                if !moved.is_empty() {
                    vm.placed().moved_channels.insert(context, moved);
                }
                Err(a)
            }
        }
    }

    fn install_adopted_rings(
        &self,
        vm: &Arc<crate::vm::Vm>,
        context: u32,
        at: u64,
        len: u64,
    ) -> Result<(Doorbell, Doorbell), Answer> {
        // Not owning the extent until the engine has the rings: the
        // engine pushes this context's events into its ring meanwhile
        // (`RingTable::awaiting`), so a failure on the way must not free
        // those bytes, not even for a moment.
        let seg = Arc::new(
            RingMemory::unowned_in_vm(vm, at, len as usize)
                .map_err(|e| error(ENOMEM, format!("cannot map the context's segment at {at:#x}: {e}")))?,
        );
        let (posted_at, need) = vrdma_core::proto::context_segment_layout();
        let view = |off: u64, cap: u32, stride: usize| {
            RingView::in_segment(seg.clone(), off as usize, cap, stride).map_err(|e| {
                error(EINVAL, format!("the context's segment ({len} bytes, {need} needed): {e}"))
            })
        };
        let events = view(0, ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE)?;
        let posted = view(posted_at, POSTED_RING_CAPACITY, POSTED_SLOT_SIZE)?;
        let (doorbell, doorbell_tenant) = Doorbell::pair()?;
        let doorbell = Arc::new(doorbell);
        let (event_fd, event_tenant) = Doorbell::pair_with_hangup()?;
        let origin = crate::engine::Origin::Vm(vm.name.clone());
        let (ctx, tenant, vm) = (ContextId(context), self.tenant, vm.clone());
        self.shared
            .engine
            .call(move |e| {
                if e.hca.context_tenant(ctx) != Some(tenant) {
                    return Err(error(
                        libc::ENOENT,
                        format!("no context {context} of tenant {} here", tenant.0),
                    ));
                }
                if e.rings.contexts.contains_key(&ctx) {
                    return Err(error(libc::EBUSY, format!("context {context} has a session already")));
                }
                // Nothing fails from here: the segment's mapping owns its
                // extent, given back when the context's rings go.
                seg.own_extent(&vm, at);
                drop(seg);
                e.processes.insert(ctx, origin);
                // Its QPs' rings are there since the import: the context
                // names them from now on.
                e.rings.add_context(ctx, ContextRings::new(tenant, events, event_fd, doorbell, posted));
                Ok(())
            })
            .map_err(|_| engine_gone())??;
        Ok((doorbell_tenant, event_tenant))
    }
}
