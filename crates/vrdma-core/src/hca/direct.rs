//! The direct path's grant rules: which requester QP may move bytes into
//! and out of which of its peer's regions itself, without the engine, and
//! when that permission ends (see `docs/direct-path.md`).
//!
//! Why here and not in the daemon: the rules are the same checks the
//! engine makes for every work request ([`Hca::responder`], the rkey, the
//! PD, the access flags), made once at grant time and made again whenever
//! something they depend on may have changed. Keeping them beside those
//! checks, with no I/O, lets the unit tests drive every revocation case
//! deterministically; the daemon only turns the answers into shared
//! memory (a window page per requester QP, the regions' memfds) and back.
//!
//! The model: a requester QP that is connected, in RTS, to a QP of the
//! same tenant on this device may hold a *window*. A window has slots,
//! one per region of the responder's PD that the requester was granted;
//! the library checks the window's open word and the slot's valid word
//! (and announces itself in the window's in-flight count) around every
//! copy. Whatever the library cannot prove it may do goes to the engine,
//! which then reports the error as it always has.
//!
//! Every control operation that may end a grant (modify, destroy or
//! failure of either QP, deregistration, a context closing) marks the
//! table dirty; [`Hca::direct_revocations`] then checks every grant again
//! and says which to close.

use super::*;
use crate::verbs::{AccessFlags, AsyncEventType, QpState, QpType};

/// Slots (granted regions) one window holds; a grant past it is refused
/// and the WR takes the engine path.
pub const DIRECT_SLOTS: u32 = 1000;

/// The remote rights a grant may carry: RDMA write, RDMA read, atomics.
/// A grant carries those that both the region and the peer QP's access
/// flags allow, exactly what the engine checks per opcode.
pub const DIRECT_RIGHTS: AccessFlags =
    AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ).union(AccessFlags::REMOTE_ATOMIC);

/// The local right a grant may carry besides: a region of the peer's PD
/// registered with local write may receive a SEND's bytes through the
/// peer's receive SGEs (the engine's check of receive SGEs,
/// `LOCAL_WRITE` in the responder QP's PD; no QP access flag applies).
pub const DIRECT_LOCAL: AccessFlags = AccessFlags::LOCAL_WRITE;

/// Why a grant was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DirectRefusal {
    /// The QP pair is not (or not yet) one the direct path serves: not
    /// connected, not RTS, another host, another tenant, no such QP.
    /// Asking again later may succeed.
    NotNow,
    /// The key names no region the peer's QP may be reached through (no
    /// such key, another PD, neither local write nor a remote write, read
    /// or atomic access that the QP's access flags allow too): the engine
    /// path reports the error.
    NotGranted,
    /// The window has no slot left.
    Full,
    /// The daemon serves no direct path (its switch is off): do not ask
    /// again.
    Off,
}

/// A region granted to a requester QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectGrant {
    pub requester: u32,
    pub responder: u32,
    pub key: u32,
    /// The region's tenant address and length (what `remote_addr` names).
    pub addr: u64,
    pub len: u64,
    /// What the grant allows: the part of [`DIRECT_RIGHTS`] that the
    /// region's access and the peer QP's access flags both allow, and
    /// [`DIRECT_LOCAL`] if the region has it (never empty). The library
    /// carries an opcode only if its right is here (local write: the
    /// region may hold the peer's receive SGEs).
    pub rights: AccessFlags,
    /// The slot of the window whose word guards this grant.
    pub slot: u32,
    /// What that word holds while the grant stands (never 0; a slot used
    /// again after a revocation gets another, so a stale grant of the
    /// slot's last key never matches).
    pub generation: u32,
    /// The window was made for this grant: the driver creates its page.
    pub new_window: bool,
}

/// A requester QP's grant to claim its peer's receives itself (RDMA
/// write with immediate, `docs/direct-path.md`): the peer's receive queue
/// and its completion inbox, and the peer's receive CQ for the order and
/// depth checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvGrant {
    pub requester: u32,
    pub responder: u32,
    /// The responder's receive CQ.
    pub recv_cq: u32,
    /// What the window's receive word holds while the grant stands.
    pub generation: u32,
    pub new_window: bool,
    /// The port's LID, for the responder's completion (`slid`).
    pub lid: u16,
    /// The responder's receive SGEs at most (a receive with more is the
    /// engine's `LOC_LEN_ERR`).
    pub max_recv_sge: u32,
    /// The responder's SRQ, when its receives come from one: the grant
    /// hands out that queue instead of the QP's own.
    pub srq: Option<u32>,
}

/// What the driver must close in shared memory, then wait for the
/// window's in-flight count to drain before the operation that caused it
/// returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    /// The whole window of requester QP `requester`: the pair is no longer
    /// served directly.
    Window { requester: u32 },
    /// One slot of a window that stays open.
    Slot { requester: u32, slot: u32 },
    /// The receive grant of a window that stays open.
    Recv { requester: u32 },
}

#[derive(Debug, Default)]
pub(crate) struct Grants {
    windows: IdMap<u32, Window>,
    /// Something a grant depends on may have changed.
    dirty: bool,
    /// Grants made since the device started (for `stat` and the tests).
    granted: u64,
}

#[derive(Debug)]
struct Window {
    responder: u32,
    /// Granted keys: their slots, generations and rights.
    slots: IdMap<u32, Slot>,
    /// Slots freed by revocation, used again first.
    free: Vec<u32>,
    next_slot: u32,
    /// The receive grant's generation, if one stands.
    recv: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    slot: u32,
    generation: u32,
    rights: AccessFlags,
}

impl Grants {
    pub(crate) fn touch(&mut self) {
        if !self.windows.is_empty() {
            self.dirty = true;
        }
    }
}

impl Hca {
    /// The responder QP that `qpn`'s direct window may target now, if any:
    /// an RC QP in RTS connected to an RC QP of the same tenant on this
    /// device that is connected back and accepts incoming work (the
    /// engine's own rule, [`Hca::responder`]).
    fn direct_pair(&self, qpn: u32) -> Option<u32> {
        let req = self.requester_of(qpn)?;
        let qp = self.qps.get(&qpn)?;
        if req.qp_type != QpType::Rc || req.attr.qp_state != QpState::Rts || qp.remote.is_some() {
            return None;
        }
        self.responder(&req).map(|r| r.qpn)
    }

    /// The region `key` of `responder`'s PD and what the direct path may
    /// do with it now: the remote rights that the region and the
    /// responder QP's access flags both allow (the engine's per-opcode
    /// check, [`Hca::remote_mr`] against the QP's flags), and local write
    /// if the region has it (the engine's check of a receive's SGEs), if
    /// any.
    fn direct_rights(&self, responder: u32, key: u32) -> Option<(&objects::Mr, AccessFlags)> {
        let peer = self.qps.get(&responder)?;
        let mr = self.remote_mr(peer.pd, key, AccessFlags::empty())?;
        // Receive SGEs are checked in the receive queue's PD (an SRQ's own,
        // which may differ from the QP's): local write only where the two
        // agree, so a grant never lets a receive use a key the engine
        // would refuse (a receive in another PD stays the engine's).
        let recv_pd = peer.init.srq.and_then(|s| self.srqs.get(&s)).map_or(peer.pd, |s| s.pd);
        let local = if recv_pd == peer.pd { mr.access & DIRECT_LOCAL } else { AccessFlags::empty() };
        let rights = (peer.attr.qp_access_flags & mr.access & DIRECT_RIGHTS) | local;
        (!rights.is_empty()).then_some((mr, rights))
    }

    /// Grants `ctx`'s QP `qpn` direct RDMA writes, reads and atomics on
    /// its peer's region `key`, each as far as the engine would allow that
    /// opcode ([`DirectGrant::rights`]): the pair first (see
    /// [`DirectRefusal::NotNow`]), then the key. Granting the same key
    /// again answers the same slot.
    pub fn direct_grant(&mut self, ctx: ContextId, qpn: u32, key: u32) -> Result<DirectGrant, DirectRefusal> {
        match self.qps.get(&qpn) {
            Some(q) if q.ctx == ctx => {}
            _ => return Err(DirectRefusal::NotNow),
        }
        let responder = self.direct_pair(qpn).ok_or(DirectRefusal::NotNow)?;
        let (mr, rights) = self.direct_rights(responder, key).ok_or(DirectRefusal::NotGranted)?;
        let (addr, len) = (mr.addr, mr.len);
        let new_window = match self.direct.windows.get(&qpn) {
            Some(w) if w.responder == responder => false,
            _ => {
                // A window towards another responder (the QP was reset and
                // connected elsewhere) was revoked by then; start afresh.
                self.direct_new_window(qpn, responder);
                true
            }
        };
        let w = self.direct.windows.get_mut(&qpn).expect("inserted above");
        let (slot, generation) = match w.slots.get(&key) {
            // The rights cannot have changed unseen: a change marks the
            // table dirty and the next revocation pass frees the slot.
            Some(s) => (s.slot, s.generation),
            None => {
                let s = match w.free.pop() {
                    Some(s) => s,
                    None if w.next_slot < DIRECT_SLOTS => {
                        w.next_slot += 1;
                        w.next_slot - 1
                    }
                    None => return Err(DirectRefusal::Full),
                };
                self.direct.granted += 1;
                let generation = (self.direct.granted as u32).max(1);
                w.slots.insert(key, Slot { slot: s, generation, rights });
                (s, generation)
            }
        };
        Ok(DirectGrant { requester: qpn, responder, key, addr, len, rights, slot, generation, new_window })
    }

    fn direct_new_window(&mut self, qpn: u32, responder: u32) {
        let w = Window { responder, slots: IdMap::default(), free: Vec::new(), next_slot: 0, recv: None };
        self.direct.windows.insert(qpn, w);
    }

    /// The receive CQ of `responder`, if a requester may claim its
    /// receives now, and its SRQ if it has one: no receive the core took
    /// from its receive queue (its own or the SRQ) and gave back
    /// (`requeued`: a claim from the ring would overtake it).
    fn direct_recv_target(&self, responder: u32) -> Option<(u32, Option<u32>)> {
        let r = self.qps.get(&responder)?;
        let queue_clear = match r.init.srq {
            None => true,
            Some(s) => self.srqs.get(&s).is_some_and(|s| s.requeued.is_empty()),
        };
        (queue_clear && r.requeued.is_empty()).then_some((r.init.recv_cq, r.init.srq))
    }

    /// Grants `ctx`'s QP `qpn` claiming its peer's receives itself, for
    /// RDMA writes with immediate: the pair as for [`Hca::direct_grant`],
    /// then the responder's receive queue ([`DirectRefusal::NotNow`] while
    /// it has an SRQ or receives given back). Asking again while it
    /// stands answers the same generation.
    pub fn direct_grant_recv(&mut self, ctx: ContextId, qpn: u32) -> Result<RecvGrant, DirectRefusal> {
        match self.qps.get(&qpn) {
            Some(q) if q.ctx == ctx => {}
            _ => return Err(DirectRefusal::NotNow),
        }
        let responder = self.direct_pair(qpn).ok_or(DirectRefusal::NotNow)?;
        let (recv_cq, srq) = self.direct_recv_target(responder).ok_or(DirectRefusal::NotNow)?;
        let new_window = match self.direct.windows.get(&qpn) {
            Some(w) if w.responder == responder => false,
            _ => {
                self.direct_new_window(qpn, responder);
                true
            }
        };
        let generation = match self.direct.windows[&qpn].recv {
            Some(g) => g,
            None => {
                self.direct.granted += 1;
                let g = (self.direct.granted as u32).max(1);
                self.direct.windows.get_mut(&qpn).expect("present").recv = Some(g);
                g
            }
        };
        let lid = self.config.port.lid;
        let max_recv_sge = match srq {
            Some(s) => self.srqs.get(&s).map_or(0, |s| s.attr.max_sge),
            None => self.qps.get(&responder).map_or(0, |r| r.init.cap.max_recv_sge),
        };
        Ok(RecvGrant { requester: qpn, responder, recv_cq, generation, new_window, lid, max_recv_sge, srq })
    }

    /// The SRQ limit event for receives a direct-path requester claimed
    /// from its peer's SRQ (the engine checks its own takes in
    /// `take_recv`): `ctx`'s QP `qpn` holds a receive grant on a QP whose
    /// receives come from an SRQ; if that SRQ's limit is armed and fewer
    /// receives than the limit remain posted, the limit disarms and
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` goes to the SRQ's context, once,
    /// whoever claimed last. Anything else (no such grant, not armed, not
    /// below) does nothing: the library asks on a hint it reads from
    /// shared memory.
    pub fn direct_srq_limit(&mut self, ctx: ContextId, qpn: u32, io: &mut dyn Queues) {
        match self.qps.get(&qpn) {
            Some(q) if q.ctx == ctx => {}
            _ => return,
        }
        let Some(w) = self.direct.windows.get(&qpn).filter(|w| w.recv.is_some()) else { return };
        let Some(s) = self.qps.get(&w.responder).and_then(|r| r.init.srq) else { return };
        let Some(srq) = self.srqs.get_mut(&s) else { return };
        if srq.attr.srq_limit == 0 {
            return;
        }
        let left = io.recv_posted(RecvSource::Srq(s)) as usize + srq.requeued.len();
        if left < srq.attr.srq_limit as usize {
            srq.attr.srq_limit = 0;
            let ev = AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: s };
            io.async_event(srq.ctx, ev);
        }
    }

    /// Checks every grant again if anything they depend on changed since
    /// the last call, and returns those that no longer hold (removed from
    /// the table). Cheap when nothing changed.
    pub fn direct_revocations(&mut self) -> Vec<Revocation> {
        if !std::mem::take(&mut self.direct.dirty) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let qpns: Vec<u32> = self.direct.windows.keys().copied().collect();
        for qpn in qpns {
            let responder = self.direct.windows[&qpn].responder;
            if self.direct_pair(qpn) != Some(responder) {
                self.direct.windows.remove(&qpn);
                out.push(Revocation::Window { requester: qpn });
                continue;
            }
            if self.direct.windows[&qpn].recv.is_some() && self.direct_recv_target(responder).is_none() {
                self.direct.windows.get_mut(&qpn).expect("present").recv = None;
                out.push(Revocation::Recv { requester: qpn });
            }
            let keys: Vec<(u32, Slot)> =
                self.direct.windows[&qpn].slots.iter().map(|(&k, &s)| (k, s)).collect();
            for (key, Slot { slot, rights, .. }) in keys {
                // Any change of the rights (a region gone, the peer QP's
                // access flags changed) ends the grant; asked again, the
                // key is granted what holds now.
                if self.direct_rights(responder, key).map(|(_, r)| r) != Some(rights) {
                    let w = self.direct.windows.get_mut(&qpn).expect("present");
                    w.slots.remove(&key);
                    w.free.push(slot);
                    out.push(Revocation::Slot { requester: qpn, slot });
                }
            }
        }
        out
    }

    /// Windows open now, and grants made since the device started.
    pub fn direct_counts(&self) -> (usize, u64) {
        (self.direct.windows.len(), self.direct.granted)
    }

    /// How many keys `qpn`'s window grants (0: no window), for `stat`.
    pub fn direct_grants_of(&self, qpn: u32) -> u32 {
        self.direct.windows.get(&qpn).map_or(0, |w| w.slots.len() as u32)
    }

    /// Whether `qpn` holds an open window (its writes may take the direct
    /// path).
    pub fn direct_window_open(&self, qpn: u32) -> bool {
        self.direct.windows.contains_key(&qpn)
    }
}
