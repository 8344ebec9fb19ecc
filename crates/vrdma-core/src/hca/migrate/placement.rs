//! Where a VM tenant's objects live in its region: the part of a snapshot
//! (version 2) that lets the destination rebuild them on the same bytes.
//!
//! A VM's memory regions and queue rings are all extents of one region
//! (the guest's ivshmem BAR, a memfd the daemon maps). The region's
//! contents move with the VM (QEMU migrates it as the VM's RAM, or the
//! operator copies it; `docs/migration.md`); the snapshot says where in it
//! each object is, so that the destination maps each memory region at the
//! same offset and views each ring at the same offset, where its indices
//! and entries already are. The core only carries and checks these
//! numbers (they come from another host: untrusted); the daemon records
//! them at creation and maps them at import.
//!
//! The one ring position that lives outside the region is an SQ's count
//! of retired send WRs: the daemon keeps it privately (a guest may
//! scribble on the shared word) and publishes it; it travels here.
//!
//! Version 3 added the completion channels: each channel's ring (its
//! unread events, CQ numbers, are in the region and move with it) and the
//! CQs it serves. A CQ's armed state needs nothing here: it is a word of
//! the CQ's ring (`proto::CQ_AUX_ARMED`), in the region too.
//!
//! Version 6 added each memory extent's owner ([`MemoryAt`]): the extents
//! a guest context took to register in (`GuestAlloc`), registered in or
//! not, so that the context's session on the destination owns them again
//! (registers in them, grows and frees them) rather than only those its
//! memory regions lay on at the move (a guest may allocate an extent, or
//! deregister everything in it and keep it, right before a move).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::snapshot::{invalid, SnapshotError, TenantSnapshot};

/// Every ring's offset is a multiple of this (the ring's own alignment;
/// the daemon's extents are page-aligned, which is stricter).
pub const RING_ALIGN: u64 = 64;

/// Where a tenant's objects lie in its region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The region's length on the source: the destination's must be the
    /// same (the same `[vms.NAME]`).
    pub region_len: u64,
    /// Every extent of the region in use on the source (rings, and the
    /// memory the guest took to register in, registered or not), sorted:
    /// the destination's allocator starts from the same state, so that it
    /// never hands out bytes the guest still uses.
    pub extents: Vec<Extent>,
    /// Each memory region's first byte in the region (its length is the
    /// region's own, in its `MrSnap`).
    pub mrs: Vec<MrAt>,
    /// Each CQ's ring.
    pub cqs: Vec<RingAt>,
    /// Each SRQ's ring.
    pub srqs: Vec<RingAt>,
    /// Each QP's rings (send, then receive unless it has an SRQ, then the
    /// inbox when it had one), as one extent.
    pub qps: Vec<QpAt>,
    /// Each context's own segment (its async-event ring, then its posted
    /// ring, in `proto::layout::context_segment_layout`): the destination
    /// reserves it at the same offset, so that a guest session adopting
    /// the context finds its rings where they were.
    pub contexts: Vec<RingAt>,
    /// Each completion channel of the tenant's contexts (version 3): its
    /// ring in the region and the CQs it serves, so that the destination
    /// raises their events into the same ring.
    pub channels: Vec<ChannelAt>,
    /// Each memory extent of a guest context (version 6): the extents the
    /// context's session took to register in, with memory regions on them
    /// or not, each one of `extents`, so that the session adopting the
    /// context owns them again. An extent of `extents` that is no ring's
    /// and not here (a session's without a context) stays reserved on the
    /// destination and unowned until the tenant moves away again.
    pub memory: Vec<MemoryAt>,
    /// Each memory region of several pieces (version 6; `RegMrPieces`):
    /// its pieces in order, each inside one extent. A region is placed
    /// here or in `mrs`, not both.
    pub mr_pieces: Vec<MrPiecesAt>,
}

/// A memory extent of a guest context: its owner and where it lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryAt {
    pub ctx: u32,
    pub at: u64,
    pub len: u64,
}

/// A memory region of pieces: its key and its pieces (offset, length) in
/// order, their lengths summing to the region's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrPiecesAt {
    pub key: u32,
    pub pieces: Vec<Extent>,
}

/// The most completion channels a placement may hold (a tenant's limit on
/// every daemon, as it keeps a descriptor each).
pub const MAX_CHANNELS_PER_TENANT: usize = 1024;

/// A completion channel: its number, its context, its ring's extent and
/// the CQs created on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelAt {
    pub id: u32,
    pub ctx: u32,
    pub at: u64,
    pub len: u64,
    pub cqs: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub at: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrAt {
    pub key: u32,
    pub at: u64,
}

/// An extent holding one object's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingAt {
    pub id: u32,
    pub at: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpAt {
    pub qpn: u32,
    pub at: u64,
    pub len: u64,
    /// The segment has an inbox after its receive ring (the direct path
    /// was on where the QP was created).
    pub inbox: bool,
    /// Send WRs retired, free-running (the daemon's, not the guest's word).
    pub retired: u32,
    /// Send WRs taken from the ring and not yet retired (those the
    /// snapshot's requester holds): at most the send queue's depth.
    pub held: u32,
}

/// One extent of the region: checked within it.
fn within(what: &str, at: u64, len: u64, region_len: u64) -> Result<(u64, u64), SnapshotError> {
    match at.checked_add(len) {
        Some(end) if len > 0 && end <= region_len => Ok((at, end)),
        _ => Err(invalid(format!("{what}: {len} bytes at {at:#x}, outside a region of {region_len} bytes"))),
    }
}

/// Every object of `ids` placed exactly once, and nothing else placed.
fn same_objects(what: &str, have: &HashSet<u32>, placed: &[u32]) -> Result<(), SnapshotError> {
    let mut seen = HashSet::with_capacity(placed.len());
    for id in placed {
        if !have.contains(id) {
            return Err(invalid(format!("placement of {what} {id:#x}, which the snapshot does not hold")));
        }
        if !seen.insert(*id) {
            return Err(invalid(format!("{what} {id:#x} placed twice")));
        }
    }
    if let Some(id) = have.iter().find(|id| !seen.contains(id)) {
        return Err(invalid(format!("{what} {id:#x} has no placement")));
    }
    Ok(())
}

/// The bytes of a QP's rings (as `hca::qp_ring_bytes`), for capacities
/// not checked yet (this check may run before the import's): `u64::MAX`
/// where they overflow, which no extent holds.
fn qp_need(cap: crate::verbs::QpCap) -> u64 {
    let send = u64::from(cap.max_send_wr)
        .checked_mul(crate::ring::send_stride(cap.max_send_sge, cap.max_inline_data) as u64);
    let recv = u64::from(cap.max_recv_wr).checked_mul(crate::ring::recv_stride(cap.max_recv_sge) as u64);
    send.zip(recv).and_then(|(a, b)| a.checked_add(b)).unwrap_or(u64::MAX)
}

/// Checks a snapshot's placement, if it has one: the extents sorted,
/// disjoint and inside the region; every memory region, CQ, SRQ and QP
/// placed once, and every context's segment and completion channel's ring,
/// inside one extent; rings aligned, at least as long as the
/// ring they hold, and overlapping neither each other nor a memory region. Memory regions may overlap each other (one
/// buffer registered twice). Memory extents ([`check_memory`]) each an
/// extent of the placement, of a context of the snapshot, holding no ring,
/// and each memory region inside one of its own context's. The driver
/// checks the rest when it maps.
pub(crate) fn check(s: &TenantSnapshot) -> Result<(), SnapshotError> {
    let Some(p) = &s.placement else { return Ok(()) };
    if p.region_len == 0 {
        return Err(invalid("placement in a region of 0 bytes"));
    }
    let mut extents = Vec::with_capacity(p.extents.len());
    for e in &p.extents {
        let (a, b) = within("extent", e.at, e.len, p.region_len)?;
        if extents.last().is_some_and(|&(_, end)| a < end) {
            return Err(invalid(format!("extent at {a:#x}: not sorted, or overlapping the one before")));
        }
        extents.push((a, b));
    }
    // The extent holding all of `[a, b)`.
    let inside = |what: &str, (a, b): (u64, u64)| -> Result<(), SnapshotError> {
        let i = extents.partition_point(|e| e.0 <= a);
        match i.checked_sub(1).map(|i| extents[i]) {
            Some((_, end)) if b <= end => Ok(()),
            _ => Err(invalid(format!("{what} at {a:#x} lies in no extent"))),
        }
    };
    same_objects(
        "memory region",
        &s.mrs.iter().map(|m| m.key).collect(),
        &p.mrs.iter().map(|m| m.key).chain(p.mr_pieces.iter().map(|m| m.key)).collect::<Vec<_>>(),
    )?;
    same_objects(
        "CQ",
        &s.cqs.iter().map(|c| c.cq).collect(),
        &p.cqs.iter().map(|c| c.id).collect::<Vec<_>>(),
    )?;
    same_objects(
        "SRQ",
        &s.srqs.iter().map(|x| x.srq).collect(),
        &p.srqs.iter().map(|x| x.id).collect::<Vec<_>>(),
    )?;
    same_objects(
        "context",
        &s.contexts.iter().copied().collect(),
        &p.contexts.iter().map(|c| c.id).collect::<Vec<_>>(),
    )?;
    same_objects(
        "QP",
        &s.qps.iter().map(|q| q.qpn).collect(),
        &p.qps.iter().map(|q| q.qpn).collect::<Vec<_>>(),
    )?;
    // Lookups by number (a snapshot may hold many objects: no quadratic
    // scans over untrusted input).
    let mr_len: HashMap<u32, u64> = s.mrs.iter().map(|m| (m.key, m.len)).collect();
    let cq_need: HashMap<u32, u64> = s.cqs.iter().map(|c| (c.cq, c.ring_bytes)).collect();
    let srq_need: HashMap<u32, u64> = s.srqs.iter().map(|x| (x.srq, x.ring_bytes)).collect();
    let qp_need: HashMap<u32, u64> = s.qps.iter().map(|q| (q.qpn, qp_need(q.init.cap))).collect();
    let qp_depth: HashMap<u32, u32> = s.qps.iter().map(|q| (q.qpn, q.init.cap.max_send_wr)).collect();
    let mut mrs = Vec::with_capacity(p.mrs.len());
    for at in &p.mrs {
        let len = mr_len.get(&at.key).copied().unwrap_or(0);
        let what = format!("memory region {:#x}", at.key);
        let span = within(&what, at.at, len, p.region_len)?;
        inside(&what, span)?;
        mrs.push((at.key, span));
    }
    for m in &p.mr_pieces {
        let what = format!("memory region {:#x}", m.key);
        let n = m.pieces.len();
        if n == 0 || n > crate::proto::MAX_MR_PIECES {
            return Err(invalid(format!("{what}: {n} pieces, not 1 to {}", crate::proto::MAX_MR_PIECES)));
        }
        let mut sum = 0u64;
        for e in &m.pieces {
            let span = within(&what, e.at, e.len, p.region_len)?;
            inside(&what, span)?;
            mrs.push((m.key, span));
            sum = sum.saturating_add(e.len);
        }
        let len = mr_len.get(&m.key).copied().unwrap_or(0);
        if sum != len {
            return Err(invalid(format!("{what}: pieces of {sum} bytes for a region of {len}")));
        }
    }
    let mut rings = Vec::with_capacity(
        p.cqs.len()
            + p.srqs.len()
            + p.qps.len()
            + p.contexts.len()
            + p.channels.len().min(MAX_CHANNELS_PER_TENANT),
    );
    let mut ring = |what: String, at: u64, len: u64, need: u64| -> Result<(), SnapshotError> {
        if !at.is_multiple_of(RING_ALIGN) {
            return Err(invalid(format!("{what}: ring at {at:#x}, not {RING_ALIGN}-byte aligned")));
        }
        if len < need {
            return Err(invalid(format!("{what}: an extent of {len} bytes for a ring of {need}")));
        }
        let span = within(&what, at, len, p.region_len)?;
        inside(&what, span)?;
        rings.push(span);
        Ok(())
    };
    for c in &p.cqs {
        let need = cq_need.get(&c.id).copied().unwrap_or(u64::MAX);
        ring(format!("CQ {:#x}", c.id), c.at, c.len, need)?;
    }
    for r in &p.srqs {
        let need = srq_need.get(&r.id).copied().unwrap_or(u64::MAX);
        ring(format!("SRQ {:#x}", r.id), r.at, r.len, need)?;
    }
    for q in &p.qps {
        let need = qp_need.get(&q.qpn).copied().unwrap_or(u64::MAX);
        let depth = qp_depth.get(&q.qpn).copied().unwrap_or(0);
        if q.held > depth {
            return Err(invalid(format!("QP {:#x}: {} send WRs held, depth {depth}", q.qpn, q.held)));
        }
        ring(format!("QP {:#x}", q.qpn), q.at, q.len, need)?;
    }
    let (_, ctx_need) = crate::proto::context_segment_layout();
    for c in &p.contexts {
        ring(format!("context {}", c.id), c.at, c.len, ctx_need)?;
    }
    check_channels(s, p, &mut ring)?;
    rings.sort_unstable();
    for w in rings.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(invalid(format!("rings overlap at {:#x}", w[1].0)));
        }
    }
    // The first ring ending after `a`: one starting before `b` overlaps
    // `[a, b)`.
    let on_a_ring = |(a, b): (u64, u64)| {
        let i = rings.partition_point(|r| r.1 <= a);
        rings.get(i).is_some_and(|r| r.0 < b)
    };
    for &(_, (a, b)) in &mrs {
        if on_a_ring((a, b)) {
            return Err(invalid(format!("a memory region at {a:#x} overlaps a ring")));
        }
    }
    check_memory(s, p, &mrs, &on_a_ring)
}

/// The memory extents: each inside the region, one of the placement's
/// extents exactly (so disjoint from each other), listed once, of a
/// context of the snapshot, holding no ring; each memory region inside a
/// memory extent of its own context (as the source let it register: in
/// one of its session's extents).
fn check_memory(
    s: &TenantSnapshot,
    p: &Placement,
    mrs: &[(u32, (u64, u64))],
    on_a_ring: &dyn Fn((u64, u64)) -> bool,
) -> Result<(), SnapshotError> {
    let contexts: HashSet<u32> = s.contexts.iter().copied().collect();
    let extents: HashMap<u64, u64> = p.extents.iter().map(|e| (e.at, e.len)).collect();
    // Start -> (end, owner), sorted: a memory region's extent is the last
    // starting at or before it.
    let mut owned = std::collections::BTreeMap::new();
    for m in &p.memory {
        let what = format!("memory extent of context {}", m.ctx);
        let (a, b) = within(&what, m.at, m.len, p.region_len)?;
        if extents.get(&a) != Some(&m.len) {
            return Err(invalid(format!(
                "{what}: {} bytes at {a:#x}, which is not an extent of the placement (overlapping one, or none)",
                m.len
            )));
        }
        if !contexts.contains(&m.ctx) {
            return Err(invalid(format!("{what} at {a:#x}: the snapshot holds no such context")));
        }
        if on_a_ring((a, b)) {
            return Err(invalid(format!("{what} at {a:#x} holds a ring")));
        }
        if owned.insert(a, (b, m.ctx)).is_some() {
            return Err(invalid(format!("memory extent at {a:#x} listed twice")));
        }
    }
    let mr_ctx: HashMap<u32, u32> = s.mrs.iter().map(|m| (m.key, m.ctx)).collect();
    for &(key, (a, b)) in mrs {
        let ctx = mr_ctx.get(&key).copied();
        match owned.range(..=a).next_back() {
            Some((_, &(end, owner))) if b <= end && Some(owner) == ctx => {}
            _ => {
                return Err(invalid(format!(
                    "memory region {key:#x} at {a:#x} lies in no memory extent of its context"
                )))
            }
        }
    }
    Ok(())
}

/// The channels: at most [`MAX_CHANNELS_PER_TENANT`], numbers nonzero and
/// unique, each of a context of the snapshot, each CQ on at most one
/// channel of its own context, each ring long enough for the channel's
/// (`ring` checks and records its extent).
fn check_channels(
    s: &TenantSnapshot,
    p: &Placement,
    ring: &mut dyn FnMut(String, u64, u64, u64) -> Result<(), SnapshotError>,
) -> Result<(), SnapshotError> {
    if p.channels.len() > MAX_CHANNELS_PER_TENANT {
        return Err(invalid(format!(
            "{} completion channels, above the limit of {MAX_CHANNELS_PER_TENANT}",
            p.channels.len()
        )));
    }
    let contexts: HashSet<u32> = s.contexts.iter().copied().collect();
    let cq_ctx: HashMap<u32, u32> = s.cqs.iter().map(|c| (c.cq, c.ctx)).collect();
    // The ring's header, then its slots (as `vrdma_shm::ring_bytes`).
    let need = crate::proto::CONTEXT_RING_HEADER
        + u64::from(crate::proto::CHANNEL_RING_CAPACITY) * crate::proto::CHANNEL_EVENT_SIZE as u64;
    let mut ids = HashSet::with_capacity(p.channels.len());
    let mut bound = HashSet::new();
    for ch in &p.channels {
        let what = format!("completion channel {:#x}", ch.id);
        if ch.id == 0 || !ids.insert(ch.id) {
            return Err(invalid(format!("{what}: number 0 or placed twice")));
        }
        if !contexts.contains(&ch.ctx) {
            return Err(invalid(format!("{what} of context {}, which the snapshot does not hold", ch.ctx)));
        }
        for cq in &ch.cqs {
            if cq_ctx.get(cq) != Some(&ch.ctx) {
                return Err(invalid(format!("{what} serves CQ {cq:#x}, not a CQ of its context")));
            }
            if !bound.insert(*cq) {
                return Err(invalid(format!("CQ {cq:#x} on two completion channels, or twice on one")));
            }
        }
        ring(what, ch.at, ch.len, need)?;
    }
    Ok(())
}

impl TenantSnapshot {
    /// Checks the snapshot's placement alone (see [`check`]), for a driver
    /// that maps the region before the import, which checks it again with
    /// everything else; and that each context's segment starts on a page
    /// of `page` bytes (the driver's): a guest session adopting the context
    /// maps it by itself, as the driver does its event ring until then, so
    /// a segment off a page is a malformed snapshot, refused here rather
    /// than as a mapping that fails.
    pub fn check_placement(&self, page: u64) -> Result<(), SnapshotError> {
        check(self)?;
        let Some(p) = &self.placement else { return Ok(()) };
        for c in &p.contexts {
            if page == 0 || !c.at.is_multiple_of(page) {
                return Err(invalid(format!(
                    "context {}: segment at {:#x}, not on a page of {page} bytes",
                    c.id, c.at
                )));
            }
        }
        Ok(())
    }
}
