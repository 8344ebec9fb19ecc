//! A VM's tenant in a migration: where its objects lie in the VM's region
//! (the snapshot's placement, at export) and its memory regions and rings
//! found again at the same offsets of the destination's region (import).
//!
//! The region's contents move with the VM, not through the daemons: QEMU
//! migrates the ivshmem region as the VM's RAM (or the operator copies
//! it), and the destination's `[vms.NAME]` is the same VM with a region of
//! the same length. The daemon writes into the region too (completions,
//! received payloads) and QEMU does not see those writes in its dirty log,
//! so the region's last copy must be taken after the pause (see
//! `docs/migration.md`). Import maps what the snapshot places, after
//! checking every offset against the region (the snapshot is untrusted),
//! and takes the VM's extents as the source had them, so the destination
//! never hands out bytes the guest still uses.
//!
//! A guest's completion channels move too (snapshot version 3): their
//! rings are in the region (the unread events with them), and the import
//! makes them channels of the engine again, with new doorbells whose
//! tenant ends wait for the adopting session (`vm::MovedChannel`). The
//! wake-ups the source sent do not move: the adoption tells the guest's
//! library each ring's producer index at the import, and the library
//! rings again for the events from before it still unread.

// An `Answer` is the reply to send whichever way a call ends (as in
// `session`); not on the data path.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;

use vrdma_core::hca::migrate::{
    ChannelAt, Extent, MemoryAt, MrAt, MrPiecesAt, Placement, QpAt, RingAt, TenantSnapshot,
};
use vrdma_core::hca::{ContextId, TenantId};
use vrdma_core::memory::Region;
use vrdma_core::proto::{ASYNC_EVENT_SIZE, ASYNC_RING_CAPACITY, CHANNEL_EVENT_SIZE, CHANNEL_RING_CAPACITY};
use vrdma_core::ring::CQE_SIZE;
use vrdma_shm::RingView;

use super::guest_memory::RingMemory;
use super::session::{error, qp_layout, Answer};
use super::Shared;
use crate::engine::{CqRing, InRing, QpRings};
use crate::vm::{Kind, MovedChannel, Place, Vm};

/// The configured VM whose tenant is `tenant`.
pub(super) fn vm_of(shared: &Shared, tenant: u32) -> Option<&Arc<Vm>> {
    shared.vms.values().find(|v| v.config.tenant == tenant)
}

/// The placement of `snap`'s objects in `vm`'s region: `None` when none
/// of its contexts is a guest's (a host process of the VM's uid, whose
/// memory is memfds); refused when some are and some are not.
/// `positions`: each QP's retired and held send WRs; `bindings`: each
/// CQ's completion channel.
pub(super) fn placement(
    vm: &Vm,
    snap: &TenantSnapshot,
    positions: &HashMap<u32, (u32, u32)>,
    bindings: &HashMap<u32, u32>,
) -> Result<Option<Placement>, Answer> {
    let placed = vm.placed();
    let guest = |c: &u32| placed.has_context(*c);
    if !snap.contexts.iter().any(guest) {
        return Ok(None);
    }
    if let Some(c) = snap.contexts.iter().find(|c| !guest(c)) {
        return Err(error(
            libc::EOPNOTSUPP,
            format!(
                "context {c} of tenant {} is a host process's, not VM {:?}'s: only a VM's guest contexts move",
                snap.tenant, vm.name
            ),
        ));
    }
    let missing = |what: &str, id: u32| {
        error(libc::EOPNOTSUPP, format!("{what} {id:#x} has no place in VM {:?}'s region", vm.name))
    };
    let mut p = Placement {
        region_len: vm.region_len,
        extents: vm.extents().used().map(|(at, len)| Extent { at, len }).collect(),
        mrs: Vec::with_capacity(snap.mrs.len()),
        cqs: Vec::with_capacity(snap.cqs.len()),
        srqs: Vec::with_capacity(snap.srqs.len()),
        qps: Vec::with_capacity(snap.qps.len()),
        contexts: Vec::with_capacity(snap.contexts.len()),
        channels: Vec::new(),
        memory: Vec::new(),
        mr_pieces: Vec::new(),
    };
    for &c in &snap.contexts {
        match placed.get(c, Kind::Context, c) {
            Some(Place::Ring(at, len)) => p.contexts.push(RingAt { id: c, at, len }),
            _ => return Err(missing("context", c)),
        }
        // Its memory extents, with regions on them or not.
        p.memory.extend(placed.memory_of(c).into_iter().map(|(at, len)| MemoryAt { ctx: c, at, len }));
        for (id, at, len) in placed.channels_of(c) {
            let mut cqs: Vec<u32> = bindings.iter().filter(|(_, ch)| **ch == id).map(|(cq, _)| *cq).collect();
            cqs.sort_unstable();
            p.channels.push(ChannelAt { id, ctx: c, at, len, cqs });
        }
    }
    // A CQ on a channel the placement lacks (a host context's): refused,
    // rather than moved without its events.
    if let Some((cq, ch)) = bindings.iter().find(|(_, ch)| !p.channels.iter().any(|c| c.id == **ch)) {
        tracing::warn!(
            cq,
            channel = ch,
            "a CQ of the VM's tenant is on a channel with no place in its region"
        );
        return Err(missing("completion channel", *ch));
    }
    for m in &snap.mrs {
        match placed.get(m.ctx, Kind::Mr, m.key) {
            Some(Place::Mr(at)) => p.mrs.push(MrAt { key: m.key, at }),
            Some(Place::MrPieces(v)) => p.mr_pieces.push(MrPiecesAt {
                key: m.key,
                pieces: v.iter().map(|&(at, len)| Extent { at, len }).collect(),
            }),
            _ => return Err(missing("memory region", m.key)),
        }
    }
    for c in &snap.cqs {
        match placed.get(c.ctx, Kind::Cq, c.cq) {
            Some(Place::Ring(at, len)) => p.cqs.push(RingAt { id: c.cq, at, len }),
            _ => return Err(missing("CQ", c.cq)),
        }
    }
    for x in &snap.srqs {
        match placed.get(x.ctx, Kind::Srq, x.srq) {
            Some(Place::Ring(at, len)) => p.srqs.push(RingAt { id: x.srq, at, len }),
            _ => return Err(missing("SRQ", x.srq)),
        }
    }
    for q in &snap.qps {
        let (retired, held) = positions.get(&q.qpn).copied().unwrap_or((0, 0));
        match placed.get(q.ctx, Kind::Qp, q.qpn) {
            Some(Place::Qp(at, len, inbox)) => p.qps.push(QpAt { qpn: q.qpn, at, len, inbox, retired, held }),
            _ => return Err(missing("QP", q.qpn)),
        }
    }
    Ok(Some(p))
}

/// A moved VM's objects mapped on this host, ready for the engine.
pub(super) struct Attached {
    pub vm: Arc<Vm>,
    tenant: TenantId,
    pub regions: HashMap<u32, Region>,
    cqs: Vec<(u32, RingView)>,
    srqs: Vec<(u32, RingView)>,
    qps: Vec<(u32, QpRings)>,
    channels: Vec<ImportedChannel>,
    /// Each context's async-event ring, where the guest left it in its
    /// segment: the engine pushes the events raised before a session
    /// adopts the context there (`RingTable::awaiting`). The segment's
    /// extent stays the context's (in `memory` until the adoption).
    events: Vec<(u32, RingView)>,
    /// Extents taken that no ring owns (the guest's memory): given back
    /// if the import fails.
    memory: Vec<u64>,
    /// The guest contexts' memory extents among them, by owner (the
    /// adopting session takes its context's).
    owners: Vec<MemoryAt>,
    contexts: Vec<u32>,
    places: Vec<(u32, Kind, u32, Place)>,
}

/// A completion channel found again in the region, with a new doorbell.
struct ImportedChannel {
    id: u32,
    ctx: u32,
    ring: RingView,
    cqs: Vec<u32>,
    fd: vrdma_shm::Doorbell,
    tenant_end: vrdma_shm::Doorbell,
}

fn bad(m: String) -> Answer {
    error(libc::EINVAL, m)
}

/// Maps what `snap` places in its VM's region here, or `None` for a
/// snapshot without a placement. Refused: no VM of its tenant here, a
/// region of another length, the VM's region in use here (a guest session
/// or an extent), or any offset the snapshot gets wrong.
pub(super) fn attach(shared: &Shared, snap: &TenantSnapshot) -> Result<Option<Attached>, Answer> {
    let Some(p) = &snap.placement else { return Ok(None) };
    snap.check_placement(vrdma_shm::page_size() as u64).map_err(|e| bad(e.to_string()))?;
    let vm = vm_of(shared, snap.tenant).ok_or_else(|| {
        error(
            libc::ENOENT,
            format!(
                "the snapshot is of a VM's tenant {}, and no VM of that tenant is configured here",
                snap.tenant
            ),
        )
    })?;
    if p.region_len != vm.region_len {
        return Err(bad(format!(
            "the snapshot's VM region is {} bytes, VM {:?}'s here {}: the same VM must be configured on both",
            p.region_len, vm.name, vm.region_len
        )));
    }
    // Take the source's extents, all or none.
    {
        let mut ext = vm.extents();
        if ext.used().next().is_some() {
            return Err(error(libc::EBUSY, format!("VM {:?}'s region is in use here", vm.name)));
        }
        let mut taken = Vec::with_capacity(p.extents.len());
        for e in &p.extents {
            if ext.reserve(e.at, e.len) != Some(e.len) {
                for at in taken {
                    ext.free(at);
                }
                return Err(bad(format!(
                    "extent of {} bytes at {:#x} is not whole pages of the region",
                    e.len, e.at
                )));
            }
            taken.push(e.at);
        }
    }
    let mut a = Attached {
        vm: vm.clone(),
        tenant: TenantId(snap.tenant),
        regions: HashMap::new(),
        cqs: Vec::new(),
        srqs: Vec::new(),
        qps: Vec::new(),
        channels: Vec::new(),
        events: Vec::new(),
        memory: p.extents.iter().map(|e| e.at).collect(),
        owners: p.memory.clone(),
        contexts: snap.contexts.clone(),
        places: Vec::new(),
    };
    match map_all(&mut a, snap, p) {
        Ok(()) => Ok(Some(a)),
        Err(e) => {
            a.give_back();
            Err(e)
        }
    }
}

fn map_all(a: &mut Attached, snap: &TenantSnapshot, p: &Placement) -> Result<(), Answer> {
    let vm = a.vm.clone();
    let tenant = a.tenant;
    let ring_at = |a: &mut Attached, at: u64, len: u64| -> Result<Arc<RingMemory>, Answer> {
        let len = usize::try_from(len).map_err(|_| bad(format!("a ring of {len} bytes")))?;
        // Rings own their extents from here (given back when dropped).
        a.memory.retain(|&m| m != at);
        let mem = RingMemory::reserved_in_vm(&vm, at, len).map_err(|e| {
            // Not a ring's yet: still ours to give back.
            a.memory.push(at);
            error(libc::ENOMEM, format!("cannot map a ring of the VM's region at {at:#x}: {e}"))
        })?;
        Ok(Arc::new(mem))
    };
    let view = |mem: &Arc<RingMemory>, offset: u64, capacity: u32, stride: usize| {
        RingView::in_segment(mem.clone(), offset as usize, capacity, stride)
            .map_err(|e| bad(format!("a ring of the snapshot does not fit its extent: {e}")))
    };
    // A context's segment stays reserved (in `memory`, an orphan until a
    // guest session adopts the context) at its offset; its place is kept
    // for the next move.
    for c in &p.contexts {
        a.places.push((c.id, Kind::Context, c.id, Place::Ring(c.at, c.len)));
        // Its event ring, mapped apart from the extent (which the
        // adopting session claims): events raised before the adoption.
        // Its pages alone (the segment's posted ring is the adopter's).
        let len = usize::try_from(c.len).map_err(|_| bad(format!("a context segment of {} bytes", c.len)))?;
        let page = vrdma_shm::page_size();
        let len =
            vrdma_shm::ring_bytes(ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE).next_multiple_of(page).min(len);
        let map = vm
            .region
            .try_clone()
            .and_then(|fd| vrdma_shm::Mapping::map_untrusted_in(fd, c.at, len, None).map_err(Into::into))
            .map_err(|e| {
                error(libc::ENOMEM, format!("cannot map context {}'s segment at {:#x}: {e}", c.id, c.at))
            })?;
        let events = RingView::in_segment(Arc::new(map), 0, ASYNC_RING_CAPACITY, ASYNC_EVENT_SIZE)
            .map_err(|e| bad(format!("context {}'s event ring does not fit its segment: {e}", c.id)))?;
        a.events.push((c.id, events));
    }
    let mr_len: HashMap<u32, (u32, u64)> = snap.mrs.iter().map(|m| (m.key, (m.ctx, m.len))).collect();
    for m in &p.mrs {
        let (ctx, len) = mr_len.get(&m.key).copied().unwrap_or((0, 0));
        let fd = vm.region.try_clone().map_err(|e| error(libc::EMFILE, e.to_string()))?;
        let region = super::session::map_region(fd, m.at, len, None)?;
        a.regions.insert(m.key, region);
        a.places.push((ctx, Kind::Mr, m.key, Place::Mr(m.at)));
    }
    for m in &p.mr_pieces {
        let (ctx, len) = mr_len.get(&m.key).copied().unwrap_or((0, 0));
        let pieces: Vec<vrdma_core::proto::MrPiece> =
            m.pieces.iter().map(|e| vrdma_core::proto::MrPiece { fd_offset: e.at, len: e.len }).collect();
        let files = vec![std::os::fd::AsFd::as_fd(&vm.region); pieces.len()];
        let region = super::session::map_pieces(&files, &pieces, len, None)?;
        a.regions.insert(m.key, region);
        let at = m.pieces.iter().map(|e| (e.at, e.len)).collect();
        a.places.push((ctx, Kind::Mr, m.key, Place::MrPieces(at)));
    }
    let cq_of: HashMap<u32, &vrdma_core::hca::migrate::CqSnap> = snap.cqs.iter().map(|c| (c.cq, c)).collect();
    for r in &p.cqs {
        let c = cq_of.get(&r.id).ok_or_else(|| bad(format!("CQ {:#x} placed, not in the snapshot", r.id)))?;
        let depth = u32::try_from(c.ring_bytes / CQE_SIZE as u64).map_err(|_| bad("a CQ's depth".into()))?;
        let mem = ring_at(a, r.at, r.len)?;
        a.cqs.push((r.id, view(&mem, 0, depth, CQE_SIZE)?));
        a.places.push((c.ctx, Kind::Cq, r.id, Place::Ring(r.at, r.len)));
    }
    let srq_of: HashMap<u32, &vrdma_core::hca::migrate::SrqSnap> =
        snap.srqs.iter().map(|x| (x.srq, x)).collect();
    for r in &p.srqs {
        let x =
            srq_of.get(&r.id).ok_or_else(|| bad(format!("SRQ {:#x} placed, not in the snapshot", r.id)))?;
        let mem = ring_at(a, r.at, r.len)?;
        let stride = vrdma_core::ring::recv_stride(x.attr.max_sge);
        a.srqs.push((r.id, view(&mem, 0, x.attr.max_wr, stride)?));
        a.places.push((x.ctx, Kind::Srq, r.id, Place::Ring(r.at, r.len)));
    }
    let qp_of: HashMap<u32, &vrdma_core::hca::migrate::QpSnap> =
        snap.qps.iter().map(|q| (q.qpn, q)).collect();
    for r in &p.qps {
        let q =
            qp_of.get(&r.qpn).ok_or_else(|| bad(format!("QP {:#x} placed, not in the snapshot", r.qpn)))?;
        let cap = q.init.cap;
        let inbox_depth = r.inbox.then(|| match q.init.srq {
            None => cap.max_recv_wr,
            Some(s) => srq_of.get(&s).map_or(0, |x| x.attr.max_wr),
        });
        let (sq, rq, inbox, total) = qp_layout(cap, q.init.srq.is_none(), inbox_depth);
        if (total as u64) > r.len {
            return Err(bad(format!("QP {:#x}: rings of {total} bytes in an extent of {}", r.qpn, r.len)));
        }
        let mem = ring_at(a, r.at, r.len)?;
        let spec = |s: vrdma_core::proto::RingSpec| view(&mem, s.offset, s.capacity, s.stride as usize);
        let rings = QpRings::new(
            ContextId(q.ctx),
            InRing::new(spec(sq)?, tenant),
            rq.map(spec).transpose()?.map(|r| InRing::new(r, tenant)),
        );
        let rings = match inbox {
            Some(s) => rings.with_inbox(q.init.recv_cq, spec(s)?),
            None => rings,
        };
        a.qps.push((r.qpn, rings.resume_positions(r.retired, r.held)));
        a.places.push((q.ctx, Kind::Qp, r.qpn, Place::Qp(r.at, r.len, r.inbox)));
    }
    // Completion channels: their rings (the events not yet taken are in
    // them) where they were, and new doorbells (wake-ups do not move).
    for ch in &p.channels {
        let mem = ring_at(a, ch.at, ch.len)?;
        let ring = view(&mem, 0, CHANNEL_RING_CAPACITY, CHANNEL_EVENT_SIZE)?;
        let (fd, tenant_end) = vrdma_shm::Doorbell::pair()
            .map_err(|e| error(libc::EMFILE, format!("a completion channel's doorbell: {e}")))?;
        a.channels.push(ImportedChannel {
            id: ch.id,
            ctx: ch.ctx,
            ring,
            cqs: ch.cqs.clone(),
            fd,
            tenant_end,
        });
        a.places.push((ch.ctx, Kind::Channel, ch.id, Place::Ring(ch.at, ch.len)));
    }
    Ok(())
}

impl Attached {
    /// The import failed: the rings and regions go, the extents back.
    pub fn give_back(self) {
        let Attached { vm, memory, cqs, srqs, qps, regions, channels, events, .. } = self;
        drop((cqs, srqs, qps, regions, channels, events));
        let mut ext = vm.extents();
        for at in memory {
            ext.free(at);
        }
    }

    /// The import succeeded: the engine takes the rings (`rings`), and the
    /// objects' places are recorded for the next move.
    /// Its completion channels (charged by the import) become the
    /// engine's, with their CQs, and their tenant ends wait for the
    /// adopting session.
    pub fn install(self, rings: &mut crate::engine::RingTable) {
        let mut moved = HashMap::<u32, Vec<MovedChannel>>::new();
        {
            let mut placed = self.vm.placed();
            for c in &self.contexts {
                placed.open_context(*c);
            }
            placed.orphans.extend(self.memory.iter().copied());
            for (ctx, kind, id, place) in self.places {
                placed.record(ctx, kind, id, place);
            }
            for m in &self.owners {
                placed.memory_is(m.ctx, m.at, m.len);
            }
        }
        for (cq, ring) in self.cqs {
            rings.cqs.insert(cq, CqRing { ring, channel: None, inbox_qps: Vec::new() });
        }
        for (srq, ring) in self.srqs {
            rings.srqs.insert(srq, InRing::new(ring, self.tenant));
        }
        for (ctx, ring) in self.events {
            rings.awaiting.insert(ContextId(ctx), (self.tenant, ring));
        }
        for (qpn, r) in self.qps {
            rings.add_qp(qpn, r);
        }
        for ch in self.channels {
            for cq in &ch.cqs {
                if let Some(r) = rings.cqs.get_mut(cq) {
                    r.channel = Some(ch.id);
                }
            }
            let max_unread =
                ch.fd.reserve(CHANNEL_RING_CAPACITY as usize).clamp(1, CHANNEL_RING_CAPACITY as usize) as u32;
            let produced_at_import = ch.ring.produced();
            rings.channels.insert(
                ch.id,
                crate::engine::Channel {
                    ctx: ContextId(ch.ctx),
                    tenant: self.tenant,
                    ring: ch.ring,
                    fd: ch.fd,
                    cqs: ch.cqs.len() as u32,
                    max_unread,
                },
            );
            moved.entry(ch.ctx).or_default().push(MovedChannel {
                id: ch.id,
                tenant_end: ch.tenant_end,
                produced_at_import,
            });
        }
        self.vm.placed().moved_channels.extend(moved);
        self.vm.imports.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The VM's tenant moved away from here (`Finish`): its contexts' places
/// are forgotten and the extents an import took for its memory given
/// back (its rings' extents go with the rings, its sessions' with them).
pub(super) fn moved_away(vm: &Vm, contexts: &[ContextId]) {
    let orphans = {
        let mut placed = vm.placed();
        for c in contexts {
            placed.forget_context(c.0);
        }
        std::mem::take(&mut placed.orphans)
    };
    let mut ext = vm.extents();
    for at in orphans {
        ext.free(at);
    }
}

/// Claims context `context`'s segment for a guest session of `vm` that
/// adopts it: the context must have been imported with the VM (its
/// segment placed and still unowned here). Its extent and length.
pub(super) fn claim_context(vm: &Vm, context: u32) -> Result<(u64, u64), Answer> {
    let mut placed = vm.placed();
    let Some(Place::Ring(at, len)) = placed.get(context, Kind::Context, context) else {
        return Err(error(
            libc::ENOENT,
            format!("context {context} was not imported here with VM {:?}: nothing to adopt", vm.name),
        ));
    };
    let Some(i) = placed.orphans.iter().position(|&o| o == at) else {
        return Err(error(libc::EBUSY, format!("context {context} of VM {:?} is adopted already", vm.name)));
    };
    placed.orphans.swap_remove(i);
    Ok((at, len))
}

/// An adoption failed after `claim_context`: the segment's extent at
/// `at`, still reserved (the adoption's mapping did not own it), is
/// unowned again, for a later adoption. Had the VM's tenant moved away
/// meanwhile (`Finish` forgot the context and gave back the unowned
/// extents), the extent is given back too.
pub(super) fn unclaim_context(vm: &Vm, context: u32, at: u64) {
    let mut placed = vm.placed();
    if matches!(placed.get(context, Kind::Context, context), Some(Place::Ring(a, _)) if a == at) {
        placed.orphans.push(at);
        return;
    }
    drop(placed);
    tracing::info!(vm = %vm.name, ctx = context, at, "the VM moved away during a failed adoption: its segment given back");
    vm.extents().free(at);
}

/// The memory extents an import took for `context` (the snapshot names
/// their owner, version 6) go to the guest session that adopted it, with
/// the regions on them or none: they are no longer unowned, the session
/// registers in them, grows and frees them, and gives them back when it
/// ends. (A session adopts before it takes any extent: `AdoptContext` is
/// its first call.)
pub(super) fn hand_memory(g: &mut super::guest_memory::GuestMemory, context: u32) {
    let vm = g.vm.clone();
    let mut placed = vm.placed();
    for (start, span) in placed.memory_of(context) {
        if let Some(i) = placed.orphans.iter().position(|&o| o == start) {
            placed.orphans.swap_remove(i);
            g.memory.insert(start, (span, 0));
        }
    }
    // The import checked that each region (each of its pieces) lies in a
    // memory extent of its context; one still unowned under a region is
    // taken with it.
    let ext = vm.extents();
    for (key, ats) in placed.mrs_of(context) {
        let mut held = Vec::with_capacity(ats.len());
        for at in ats {
            let Some((start, span)) = ext.containing(at, 1) else { continue };
            if let Some(i) = placed.orphans.iter().position(|&o| o == start) {
                placed.orphans.swap_remove(i);
                g.memory.insert(start, (span, 0));
            }
            if !held.contains(&start) {
                held.push(start);
            }
        }
        g.registered_in(key, &held);
    }
}

#[cfg(test)]
mod tests {
    use super::super::guest_memory::GuestMemory;
    use super::*;

    /// An adoption that fails after it claimed the context (no doorbell, the
    /// engine said no) never frees the segment's extent, not even for a
    /// moment: the engine may be pushing the context's events into its
    /// ring there (`RingTable::awaiting`). The context is unowned again,
    /// to adopt later; had its tenant moved away meanwhile, the extent is
    /// given back with the rest (issue 19, L1 and P1).
    #[test]
    fn a_failed_adoption_leaves_the_contexts_segment_reserved_for_a_later_one() {
        let dir = std::env::temp_dir().join(format!("vrdmad-unclaim-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = crate::config::VmConfig { memory_mib: 8, ..crate::config::VmConfig::new(0) };
        let vm = Arc::new(Vm::create("g", &config, &dir).unwrap());
        let (ctx, at, len) = (5u32, 0x10000u64, 0x10000u64);
        assert_eq!(vm.extents().reserve(at, len), Some(len));
        {
            let mut placed = vm.placed();
            placed.orphans = vec![at];
            placed.record(ctx, Kind::Context, ctx, Place::Ring(at, len));
        }
        // What an adoption does until it fails: claims, maps the segment.
        assert_eq!(claim_context(&vm, ctx).ok(), Some((at, len)));
        let seg = RingMemory::unowned_in_vm(&vm, at, len as usize).unwrap();
        drop(seg);
        assert_eq!(vm.extents().reserve(at, len), None, "the segment's bytes free for another object");
        unclaim_context(&vm, ctx, at);
        assert_eq!(vm.placed().orphans, vec![at]);
        // Adopted again: this time its mapping owns the extent.
        assert_eq!(claim_context(&vm, ctx).ok(), Some((at, len)));
        let seg = RingMemory::unowned_in_vm(&vm, at, len as usize).unwrap();
        seg.own_extent(&vm, at);
        drop(seg);
        assert_eq!(vm.extents().reserve(at, len), Some(len), "given back with the adopted rings");
        // Claimed, then the tenant moved away (`Finish`), then the
        // adoption failed: given back, not left reserved for ever.
        {
            let mut placed = vm.placed();
            placed.orphans = vec![at];
        }
        assert_eq!(claim_context(&vm, ctx).ok(), Some((at, len)));
        moved_away(&vm, &[ContextId(ctx)]);
        unclaim_context(&vm, ctx, at);
        assert!(vm.placed().orphans.is_empty());
        assert_eq!(vm.extents().reserve(at, len), Some(len), "given back after the move");
        drop(vm);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A session adopting a moved context takes every extent its region of
    /// pieces lies on (an import left them unowned), and holds each while
    /// the region lives.
    #[test]
    fn an_adopting_session_holds_every_extent_a_region_of_pieces_lies_on() {
        let dir = std::env::temp_dir().join(format!("vrdmad-hand-memory-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = crate::config::VmConfig { memory_mib: 8, ..crate::config::VmConfig::new(0) };
        let vm = Arc::new(Vm::create("g", &config, &dir).unwrap());
        let (x, y) = (0x10000, 0x20000);
        for at in [x, y] {
            assert_eq!(vm.extents().reserve(at, 0x4000), Some(0x4000));
        }
        {
            let mut placed = vm.placed();
            placed.orphans = vec![x, y];
            placed.record(5, Kind::Mr, 9, Place::MrPieces(vec![(x + 0x100, 0x3f00), (y, 10)]));
        }
        let mut g = GuestMemory::new(vm.clone());
        hand_memory(&mut g, 5);
        assert!(vm.placed().orphans.is_empty(), "both extents went to the session");
        assert_eq!((g.memory.get(&x), g.memory.get(&y)), (Some(&(0x4000, 1)), Some(&(0x4000, 1))));
        assert_eq!(g.free(x).unwrap_err().0, libc::EBUSY);
        g.deregistered(9);
        assert_eq!((g.free(x), g.free(y)), (Ok(()), Ok(())));
        drop((g, vm));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
