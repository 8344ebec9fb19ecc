//! The shared-memory queues of every object, seen from the device side.
//!
//! [`RingTable`] is the daemon's implementation of the core's [`Queues`]:
//! it pops work requests out of the rings tenants write (copying each slot
//! before decoding it, so a tenant cannot change a request while it is
//! checked) and pushes completions and events into the rings tenants read.
//! A ring whose indices a tenant corrupted is marked dead: its owner gets
//! one error completion and nothing more is read from it.
//!
//! What a tenant's rings make the daemon log goes through
//! [`RingTable::log`], keyed by the tenant, so that a tenant cannot flood
//! the log (see [`vrdma_core::log_limit`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use vrdma_core::hca::IdMap as HashMap;

use vrdma_core::hca::{AsyncEvent, ContextId, CqFull, Pulled, Queues, RecvSource, Teardown, TenantId};
use vrdma_core::limited_warn;
use vrdma_core::log_limit::{LogLimiter, Source};
use vrdma_core::proto::{
    self, CHANNEL_AUX_DROPPED, CQ_ARM_NONE, CQ_AUX_ARMED, CQ_AUX_LOCAL, CTX_AUX_ENGINE_SLEEPING,
    CTX_AUX_EVENTS_DROPPED, INBOX_AUX_ENGINE_PUSHED, INBOX_AUX_STAGED, POSTED_AUX_OVERFLOW, SQ_AUX_NOTIFIED,
    SQ_AUX_RETIRED, SQ_AUX_STATE, SRQ_AUX_CLAIMER, SRQ_AUX_CLAIM_AT, SRQ_AUX_CLAIM_SLOT, SRQ_CLAIMER_NOTED,
};
use vrdma_core::ring::{Cqe, RecvWr, SendWr, WqeError, CQE_SIZE};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{AsyncEventType, QpState, WcStatus};
use vrdma_shm::{Doorbell, RingView};

/// How long a context's overflow flag is left alone after a rescan of its
/// QPs that woke none, doubling from the first to the second while
/// rescans stay fruitless; a rescan that wakes a QP ends it. A tenant that
/// keeps its flag set over thousands of idle QPs otherwise made the
/// engine read one word per QP without end (16 a pass, each in another
/// QP's segment: about a quarter of the engine's time); a tenant whose
/// ring really overflowed has QPs to wake, and is never held off.
const RESCAN_BACKOFF: (Duration, Duration) = (Duration::from_micros(50), Duration::from_millis(8));

/// A context's rings: async events out; doorbell and posted QPs in.
pub struct ContextRings {
    pub tenant: TenantId,
    pub events: RingView,
    pub event_fd: Doorbell,
    pub doorbell: Arc<Doorbell>,
    /// The QPs the tenant names after posting (see
    /// [`proto::POSTED_RING_CAPACITY`]).
    pub posted: RingView,
    /// The context's QPs: those it may name.
    qps: HashMap<u32, ()>,
    /// QPs still to be woken because the tenant said it could not name
    /// them all (its ring was full): a few each call, never all at once.
    rescan: Vec<u32>,
    /// The overflow flag was set again during a rescan: a post it stands
    /// for may be to a QP the rescan had passed, so another follows.
    rescan_again: bool,
    /// The rescan under way woke a QP.
    rescan_woke: bool,
    /// After rescans that woke nothing, the flag is left alone until
    /// then (see [`RESCAN_BACKOFF`]).
    rescan_after: Instant,
    rescan_backoff: Duration,
    /// The tenant corrupted its posted ring: nothing more is read from it,
    /// and the context is being closed ([`RingTable::take_broken`]).
    broken: bool,
}

/// What one call took from a context's notices.
struct Taken {
    /// Notices (or QPs of a rescan) looked at: what the call cost.
    looked: u32,
    /// More are waiting.
    more: bool,
    /// This call found the ring corrupt.
    broke: bool,
}

impl ContextRings {
    pub fn new(
        tenant: TenantId,
        events: RingView,
        event_fd: Doorbell,
        doorbell: Arc<Doorbell>,
        posted: RingView,
    ) -> Self {
        ContextRings {
            tenant,
            events,
            event_fd,
            doorbell,
            posted,
            qps: HashMap::default(),
            rescan: Vec::new(),
            rescan_again: false,
            rescan_woke: false,
            rescan_after: Instant(0),
            rescan_backoff: Duration::ZERO,
            broken: false,
        }
    }

    /// Appends the QPs of this context that its tenant named since the
    /// last call and that `announced` a post since the engine left them
    /// idle, looking at `budget` notices at most; a tenant that said it
    /// could not name them all gets all its QPs looked at, `budget` at a
    /// time. Garbage in the ring marks the context broken.
    ///
    /// Why `announced`: the library sets a QP's [`SQ_AUX_NOTIFIED`] word
    /// before it names the QP (or finds the ring full), and only the
    /// engine clears it, when it parks the QP after a turn that saw the
    /// rings empty; so every post not yet served is on a QP whose word is
    /// set, and a name or a rescan of a QP whose word is clear stands for
    /// nothing. Waking them anyway gave each a turn through its rings: a
    /// tenant that kept its overflow flag set over 3000 idle QPs (one store
    /// every 50 µs) spent half the engine on turns that found nothing, and
    /// another tenant's 8 B sends took 2.0 to 2.7 times as long; one that
    /// named its idle QPs without end, 1.4 to 1.8 times. Now each costs a
    /// word read per notice, and a rescan that woke nothing holds the
    /// next off (see [`RESCAN_BACKOFF`]).
    fn take_posted(
        &mut self,
        budget: u32,
        now: Instant,
        announced: &dyn Fn(u32) -> bool,
        out: &mut Vec<u32>,
    ) -> Taken {
        if self.broken {
            return Taken { looked: 0, more: false, broke: false };
        }
        // The flag before the slots: a tenant that finds the ring full
        // after this has its flag seen by the next call.
        // (Read first: a swap each pass would write the line every pass.)
        let overflow = self.posted.aux(POSTED_AUX_OVERFLOW);
        let flagged = overflow.load(Ordering::SeqCst) != 0;
        let held_off = now < self.rescan_after;
        if flagged && !held_off && overflow.swap(0, Ordering::SeqCst) != 0 {
            if self.rescan.is_empty() {
                self.rescan.extend(self.qps.keys().copied());
            } else {
                self.rescan_again = true;
            }
        }
        let mut looked = 0;
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        while looked < budget {
            match self.posted.try_pop(&mut slot) {
                Ok(true) => {
                    looked += 1;
                    let qpn = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
                    if self.qps.contains_key(&qpn) && announced(qpn) {
                        out.push(qpn);
                    }
                }
                Ok(false) => break,
                Err(e) => {
                    // Logged, limited per tenant, by `RingTable::take_broken`.
                    tracing::debug!(tenant = self.tenant.0, error = %e, "posted-QP ring corrupt");
                    self.broken = true;
                    self.rescan.clear();
                    return Taken { looked, more: false, broke: true };
                }
            }
        }
        let scanning = !self.rescan.is_empty();
        while looked < budget {
            let Some(qpn) = self.rescan.pop() else { break };
            looked += 1;
            // A QP destroyed since the rescan began is not woken, nor
            // one with nothing posted since it was left idle.
            if self.qps.contains_key(&qpn) && announced(qpn) {
                out.push(qpn);
                self.rescan_woke = true;
                self.rescan_backoff = Duration::ZERO;
            }
        }
        if scanning && self.rescan.is_empty() {
            self.rescan_backoff = if std::mem::take(&mut self.rescan_woke) {
                Duration::ZERO
            } else {
                (self.rescan_backoff * 2).clamp(RESCAN_BACKOFF.0, RESCAN_BACKOFF.1)
            };
            self.rescan_after = now + self.rescan_backoff;
        }
        if self.rescan.is_empty() && self.rescan_again && now >= self.rescan_after {
            self.rescan_again = false;
            self.rescan.extend(self.qps.keys().copied());
        }
        // A flag or a rescan held off is work left, so that the engine
        // does not sleep on it.
        let more = !self.rescan.is_empty()
            || self.rescan_again
            || (flagged && held_off)
            || self.posted.len().is_ok_and(|n| n > 0);
        Taken { looked, more, broke: false }
    }
}

impl ContextRings {
    /// Whether notices wait that a call with budget would take: in the
    /// ring, in a rescan, or the overflow flag (a tenant that found the
    /// ring full says so there and nowhere else, so a pass that passes
    /// this context over must count it, or the engine may sleep on it).
    fn waiting(&self) -> bool {
        !self.broken
            && (self.posted.len().is_ok_and(|n| n > 0)
                || !self.rescan.is_empty()
                || self.rescan_again
                || self.posted.aux(POSTED_AUX_OVERFLOW).load(Ordering::SeqCst) != 0)
    }
}

/// A completion channel: CQ numbers out, and one datagram per event on a
/// doorbell socket that the owner polls.
pub struct Channel {
    pub ctx: ContextId,
    pub tenant: vrdma_core::hca::TenantId,
    pub ring: RingView,
    pub fd: Doorbell,
    pub cqs: u32,
    /// Most unread events: as many as the doorbell's socket buffer holds
    /// wake-ups for (at most the ring's capacity).
    pub max_unread: u32,
}

pub struct CqRing {
    pub ring: RingView,
    pub channel: Option<u32>,
    /// QPs completing their receives here that have an inbox (the direct
    /// path): the inboxes' entries count against the CQ's depth.
    pub inbox_qps: Vec<u32>,
}

/// A ring the tenant owns the producer side of.
pub struct InRing {
    pub ring: RingView,
    dead: bool,
    tenant: TenantId,
    /// A direct-path requester may take entries too (a receive queue with
    /// the direct path on): entries are claimed with a compare-and-swap.
    shared: bool,
    /// Entries the engine took (claimed or discarded), free-running, from
    /// the base [`QpRings::with_inbox`] sets: the consumer index less this
    /// is what direct-path requesters claimed. Kept here, never read back
    /// from tenant memory.
    took: u32,
    /// An SRQ's ring: after each of its claims the engine reads the index
    /// the requester holding the SRQ's claiming turn is about to claim
    /// (`SRQ_AUX_CLAIM_AT`).
    srq: bool,
    /// The last index the engine claimed that was the one named in
    /// `SRQ_AUX_CLAIM_AT` then: that requester's compare-and-swap of it
    /// failed, so its staged completion is not to be published.
    claimed_noted: Option<u32>,
}

impl InRing {
    pub fn new(ring: RingView, tenant: TenantId) -> Self {
        InRing { ring, dead: false, tenant, shared: false, took: 0, srq: false, claimed_noted: None }
    }

    /// A ring whose entries a direct-path requester may claim too
    /// (`docs/direct-path.md`).
    pub fn shared(mut self) -> Self {
        self.shared = true;
        self
    }

    /// An SRQ's ring whose entries direct-path requesters may claim
    /// ([`Self::shared`]), one requester at a time (`SRQ_AUX_CLAIMER`).
    pub fn shared_srq(mut self) -> Self {
        self.shared = true;
        self.srq = true;
        self
    }

    /// Pops one slot into `buf` and decodes it.
    fn pull<T>(
        &mut self,
        buf: &mut Vec<u8>,
        decode: fn(&[u8]) -> Pulled<T>,
        log: &mut LogLimiter,
        now: Instant,
    ) -> Option<Pulled<T>> {
        if self.dead {
            return None;
        }
        buf.resize(self.ring.stride(), 0);
        let mut at = 0;
        let popped = if self.shared {
            self.ring.try_claim_noting(buf, |c| at = c, |_| true).map(|c| c == vrdma_shm::Claim::Taken)
        } else {
            self.ring.try_pop(buf)
        };
        match popped {
            Ok(true) => {
                self.took = self.took.wrapping_add(1);
                // After the claim (SeqCst), the index the SRQ's claiming
                // requester noted before its own last look at the index
                // (SeqCst): if it is this one, the requester's claim of it
                // failed or will (`Queues::flush_claimed`).
                if self.srq && self.ring.aux(SRQ_AUX_CLAIM_AT).load(Ordering::SeqCst) == at {
                    self.claimed_noted = Some(at);
                }
                Some(decode(buf))
            }
            Ok(false) => None,
            Err(e) => {
                let tenant = Source::Tenant(self.tenant);
                const CORRUPT: &str = "tenant corrupted a work queue; no more requests are read from it";
                limited_warn!(log, tenant, now, CORRUPT, error = %e);
                self.dead = true;
                Some(Err((0, WqeError::SlotTooSmall)))
            }
        }
    }
}

pub struct QpRings {
    /// The context the QP belongs to (the only one that may name it).
    ctx: ContextId,
    pub sq: InRing,
    pub rq: Option<InRing>,
    /// Send WRs retired, free-running, published in `SQ_AUX_RETIRED`.
    /// Kept here, never read back from the shared word the tenant can
    /// scribble on.
    retired: u32,
    /// Send WRs pulled and not yet retired.
    held: u32,
    /// The inbox of completions a direct-path requester pushes for this
    /// QP's receives, and the CQ they complete in (`docs/direct-path.md`).
    inbox: Option<(u32, RingView)>,
}

impl QpRings {
    pub fn new(ctx: ContextId, sq: InRing, rq: Option<InRing>) -> Self {
        QpRings { ctx, sq, rq, retired: 0, held: 0, inbox: None }
    }

    /// The QP's receives may be claimed by a direct-path requester, which
    /// completes them into `inbox`; they complete in CQ `recv_cq`.
    pub fn with_inbox(mut self, recv_cq: u32, inbox: RingView) -> Self {
        // What requesters claimed so far (0 for a new QP) is what they
        // completed: the count of claims starts level with the inbox's
        // pushes (a QP resumed here after a move included).
        if let Some(rq) = self.rq.as_mut() {
            rq.took = rq.ring.consumed().wrapping_sub(inbox.produced());
        }
        self.inbox = Some((recv_cq, inbox));
        self
    }

    /// Send WRs retired (free-running) and held (pulled, not retired): the
    /// positions a migration carries (`server::migrate`).
    pub fn positions(&self) -> (u32, u32) {
        (self.retired, self.held)
    }

    /// Resumes the positions of a QP that moved here, and publishes the
    /// retired count as the source last did.
    pub fn resume_positions(mut self, retired: u32, held: u32) -> Self {
        self.retired = retired;
        self.held = held;
        self.sq.ring.aux(SQ_AUX_RETIRED).store(retired, Ordering::Release);
        self
    }

    /// Counts `n` more send WRs retired and publishes the count: Release,
    /// so that a client that sees it also sees the slots those WRs freed,
    /// and before the completions the core pushes next.
    /// Whether the tenant posted to the QP since the engine last left it
    /// idle ([`SQ_AUX_NOTIFIED`]: the library sets it before naming the
    /// QP, the engine clears it when it parks the QP).
    fn announced(&self) -> bool {
        self.sq.ring.aux(SQ_AUX_NOTIFIED).load(Ordering::SeqCst) != 0
    }

    fn retire(&mut self, n: u32) {
        self.retired = self.retired.wrapping_add(n);
        self.sq.ring.aux(SQ_AUX_RETIRED).store(self.retired, Ordering::Release);
    }
}

#[derive(Default)]
pub struct RingTable {
    pub contexts: HashMap<ContextId, ContextRings>,
    /// The async-event rings of contexts that moved here with their VM
    /// and that no session has adopted yet (`migrate_vm::Attached::install`),
    /// where the guest left them in the VM's region. Their QPs run from
    /// the resume on: an event raised before the guest's library takes
    /// its context back (an SRQ's limit reached as the peers' messages
    /// take its receives, a QP's fatal error) goes there, and the library
    /// finds it after the adoption ([`Self::add_context`]). With the
    /// context's tenant, whose log share an event dropped there counts to.
    pub awaiting: HashMap<ContextId, (TenantId, RingView)>,
    pub channels: HashMap<u32, Channel>,
    pub cqs: HashMap<u32, CqRing>,
    pub qps: HashMap<u32, QpRings>,
    pub srqs: HashMap<u32, InRing>,
    scratch: Vec<u8>,
    /// Completions lost to full CQs, async events lost to full rings.
    pub dropped_events: u64,
    next_channel: u32,
    /// Where the next [`Queues::take_posted`] starts among the contexts,
    /// so that every context of a tenant gets its turn at the budget.
    posted_from: usize,
    /// Per tenant, what the current `take_posted` call has spent.
    posted_spent: Vec<(TenantId, u32)>,
    /// Contexts found broken, not yet given to [`Self::take_broken`].
    broken: Vec<ContextId>,
    /// What tenants' rings make the daemon log, limited per tenant.
    pub log: LogLimiter,
    /// The time of the engine's current pass, for `log`.
    pub now: Instant,
    /// Per CQ, its inbox QPs by ready-set bucket
    /// ([`proto::cq_ready_bucket`]): the overrun check adds up the
    /// inboxes of the buckets the CQ's ready set marks, not every QP's.
    inbox_buckets: HashMap<u32, HashMap<u32, Vec<u32>>>,
}

impl RingTable {
    /// A channel number no live channel has, in the daemon's number space
    /// (`Hca::alloc_driver_id`): a channel keeps its number when its
    /// VM's tenant moves to another daemon.
    /// `also`: numbers in use elsewhere (the rdma_cm event channels',
    /// which share the space, so that a guest's library tells a moved
    /// channel of one kind from one of the other by its number).
    pub fn free_channel_id(&mut self, hca: &vrdma_core::hca::Hca, also: impl Fn(u32) -> bool) -> u32 {
        let channels = &self.channels;
        hca.alloc_driver_id(&mut self.next_channel, |n| channels.contains_key(&n) || also(n))
    }

    /// Adds the rings of a context that already has QPs (one a guest
    /// adopted after its VM moved: the import installed their rings
    /// before the context had any): it may name them from now on.
    /// Events raised meanwhile are in its event ring already
    /// ([`Self::awaiting`]): its signal is rung, so that a program waiting
    /// on its async fd wakes for them.
    pub fn add_context(&mut self, ctx: ContextId, mut rings: ContextRings) {
        for (qpn, q) in &self.qps {
            if q.ctx == ctx {
                rings.qps.insert(*qpn, ());
            }
        }
        self.awaiting.remove(&ctx);
        if rings.events.len().is_ok_and(|n| n > 0) {
            rings.event_fd.ring();
        }
        self.contexts.insert(ctx, rings);
    }

    /// Contexts that moved away: their event rings, if no session had
    /// adopted them here, go with the VM's region.
    pub fn forget_awaiting(&mut self, ctxs: &[ContextId]) {
        self.awaiting.retain(|c, _| !ctxs.contains(c));
    }

    /// Adds a QP's rings; its context may name it from now on.
    pub fn add_qp(&mut self, qpn: u32, rings: QpRings) {
        if let Some(c) = self.contexts.get_mut(&rings.ctx) {
            c.qps.insert(qpn, ());
        }
        if let Some((cqn, cq)) = rings.inbox.as_ref().and_then(|(cq, _)| Some((*cq, self.cqs.get_mut(cq)?))) {
            cq.inbox_qps.push(qpn);
            let buckets = self.inbox_buckets.entry(cqn).or_default();
            buckets.entry(proto::cq_ready_bucket(qpn)).or_default().push(qpn);
        }
        self.qps.insert(qpn, rings);
    }

    pub fn remove_qp(&mut self, qpn: u32) {
        if let Some(q) = self.qps.remove(&qpn) {
            // An SRQ's claiming turn held for it (its requester died or
            // stopped holding it) is given back: no flush of it will.
            if q.inbox.is_some() {
                for srq in self.srqs.values().filter(|r| r.srq) {
                    let turn = srq.ring.aux(SRQ_AUX_CLAIMER);
                    let held = turn.load(Ordering::SeqCst);
                    if held & !SRQ_CLAIMER_NOTED == qpn.wrapping_add(1) {
                        let _ = turn.compare_exchange(held, 0, Ordering::SeqCst, Ordering::SeqCst);
                    }
                }
            }
            if let Some(c) = self.contexts.get_mut(&q.ctx) {
                c.qps.remove(&qpn);
            }
            if let Some(cq) = q.inbox.as_ref().and_then(|(cq, _)| self.cqs.get_mut(cq)) {
                cq.inbox_qps.retain(|&n| n != qpn);
            }
            if let Some((cqn, _)) = q.inbox.as_ref() {
                if let Some(buckets) = self.inbox_buckets.get_mut(cqn) {
                    let bucket = proto::cq_ready_bucket(qpn);
                    if let Some(list) = buckets.get_mut(&bucket) {
                        list.retain(|&n| n != qpn);
                        if list.is_empty() {
                            buckets.remove(&bucket);
                        }
                    }
                    if buckets.is_empty() {
                        self.inbox_buckets.remove(cqn);
                    }
                }
            }
        }
    }

    /// Drops the rings of the QPs, CQs and SRQs the HCA tore down (a
    /// context closed, or a tenant that moved away).
    pub fn remove_torn_down(&mut self, t: &Teardown) {
        for &q in &t.qps {
            self.remove_qp(q);
        }
        for c in &t.cqs {
            self.cqs.remove(c);
        }
        for s in &t.srqs {
            self.srqs.remove(s);
        }
    }

    /// Entries the inboxes of QPs completing in CQ `cqn` hold (the direct
    /// path's completions not yet polled): those of the buckets its ready
    /// set marks (an inbox holds entries only while marked, but for the
    /// moments between a requester's push and its mark, and between the
    /// owner's clearing of a mark and its drain; the words are the
    /// tenant's, so a scribbled set costs only its own CQ's check).
    fn inbox_entries(&self, cqn: u32, cq: &CqRing) -> u32 {
        let Some(buckets) = self.inbox_buckets.get(&cqn) else { return 0 };
        let held =
            |n: &u32| self.qps.get(n).and_then(|q| q.inbox.as_ref()).map_or(0, |(_, r)| r.len().unwrap_or(0));
        let mut sum = 0u32;
        proto::for_each_ready_bucket(
            |i| cq.ring.aux(i).load(Ordering::SeqCst),
            |b| {
                for n in buckets.get(&b).into_iter().flatten() {
                    sum = sum.saturating_add(held(n));
                }
            },
        );
        sum
    }

    /// Contexts whose tenant broke the shared-memory protocol since the
    /// last call. Each is told (`IBV_EVENT_DEVICE_FATAL`) and nothing more
    /// is read from its posted ring; the caller closes its session.
    pub fn take_broken(&mut self) -> Vec<ContextId> {
        let broken = std::mem::take(&mut self.broken);
        for &id in &broken {
            if let Some(c) = self.contexts.get(&id) {
                const BROKEN: &str = "a tenant corrupted its posted-QP ring; its context is closed";
                limited_warn!(self.log, Source::Tenant(c.tenant), self.now, BROKEN, ctx = id.0);
            }
            self.async_event(id, AsyncEvent { event_type: AsyncEventType::DeviceFatal, element: 0 });
        }
        broken
    }

    /// Tells every context whether the engine is asleep (and so whether a
    /// post must ring the doorbell).
    pub fn set_sleeping(&self, sleeping: bool) {
        for c in self.contexts.values() {
            c.events.aux(CTX_AUX_ENGINE_SLEEPING).store(sleeping as u32, Ordering::SeqCst);
        }
    }

    fn notify_channel(&mut self, cqn: u32, cqe: &Cqe) {
        let Some(cq) = self.cqs.get(&cqn) else { return };
        let Some(ch) = cq.channel.and_then(|c| self.channels.get(&c)) else { return };
        let armed = cq.ring.aux(CQ_AUX_ARMED);
        // The completion was published with a release store; order it
        // before reading the arm word, or a client that arms, fences and
        // polls could miss both the completion and the event.
        std::sync::atomic::fence(Ordering::SeqCst);
        let a = armed.load(Ordering::SeqCst);
        if !proto::arm_fires(a, cqe.solicited, cqe.status == WcStatus::Success) {
            return;
        }
        if armed.compare_exchange(a, CQ_ARM_NONE, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return;
        }
        // One event, then one datagram for it on the doorbell: the channel
        // fd is readable exactly while events are unread (the client takes
        // one datagram with each event, waiting for it if it took the event
        // first). An event is dropped rather than left without its
        // datagram: the channel holds at most `max_unread`, what the
        // socket buffer has room for.
        let full = ch.ring.len().map_or(true, |n| n >= ch.max_unread);
        let mut slot = [0u8; proto::CHANNEL_EVENT_SIZE];
        slot[..4].copy_from_slice(&cqn.to_le_bytes());
        if full || !matches!(ch.ring.try_push_bytes(&slot), Ok(true)) {
            ch.ring.aux(CHANNEL_AUX_DROPPED).fetch_add(1, Ordering::Relaxed);
            let tenant = Source::Tenant(ch.tenant);
            limited_warn!(self.log, tenant, self.now, "completion channel full: event dropped", cq = cqn);
            return;
        }
        // The owner is looking for it in shared memory: no wake-up needed
        // (`proto::CQ_AUX_WAITER`).
        if proto::claim_quiet_event(cq.ring.aux(proto::CQ_AUX_WAITER)) {
            return;
        }
        if !ch.fd.ring_one() {
            // The estimate of the socket buffer was wrong (or the tenant
            // closed its end): the event is there, its wake-up is not.
            ch.ring.aux(CHANNEL_AUX_DROPPED).fetch_add(1, Ordering::Relaxed);
            let tenant = Source::Tenant(ch.tenant);
            limited_warn!(
                self.log,
                tenant,
                self.now,
                "completion channel doorbell full: wake-up lost",
                cq = cqn
            );
        }
    }
}

fn decode_send(b: &[u8]) -> Pulled<SendWr> {
    SendWr::decode(b)
}
fn decode_recv(b: &[u8]) -> Pulled<RecvWr> {
    RecvWr::decode(b)
}

impl RingTable {
    /// [`Queues::flush_claimed`] for a QP's own receive queue: the queue's
    /// consumer index less the entries the engine itself took is what
    /// requesters claimed; one more than the inbox's pushes is a claim
    /// whose completion is staged in the slot the producer index names.
    fn flush_claimed_own(&mut self, qpn: u32) -> bool {
        let Some(q) = self.qps.get(&qpn) else { return false };
        let (Some(rq), Some((_, inbox))) = (q.rq.as_ref(), q.inbox.as_ref()) else { return false };
        if rq.dead || !rq.shared {
            return false;
        }
        let pushed = inbox.produced();
        let claimed = rq.ring.consumed().wrapping_sub(rq.took);
        // One claim at most is ever unpublished (a requester QP delivers
        // one message at a time and stages in the next slot); any other
        // difference is a tenant's scribbling, which gets nothing.
        claimed.wrapping_sub(pushed) == 1 && publish_staged_flush(inbox, pushed)
    }

    /// [`Queues::flush_claimed`] for a QP whose receives come from SRQ
    /// `srq`. Its consumer index is claimed for every QP on it, so counts
    /// cannot tell whose claim lacks its completion; the claiming turn
    /// can (`SRQ_AUX_CLAIMER`): direct-path requesters claim one at a
    /// time, each holding the turn, named by its responder QP, from before
    /// its claim until after its publication. So a turn that names this
    /// QP, and an index in `SRQ_AUX_CLAIM_AT` that the consumer index has
    /// passed and that the engine did not claim (it notes the one it
    /// claims), is this QP's requester's claim: nobody else could have
    /// made it. Its completion is staged in the slot `SRQ_AUX_CLAIM_SLOT`
    /// names, and, if that slot is still the inbox's next, is published as
    /// a flush on this QP's CQ, as
    /// hardware flushes a WQE a QP took from its SRQ when the QP goes to
    /// ERR. The turn is given back, so that the SRQ's other QPs' requesters
    /// claim again, only once the requester is gone (`requester_gone`):
    /// while its QP exists its process may still run (stopped on its way
    /// to a claim, say), and a turn given back under it would let it claim
    /// beside the next holder, whose claims the daemon could then no
    /// longer tell from its own. Its holder gives it back itself after
    /// its claim, or the core asks again when it goes.
    fn flush_claimed_srq(&mut self, qpn: u32, srq: u32, requester_gone: bool) -> bool {
        let Some((_, inbox)) = self.qps.get(&qpn).and_then(|q| q.inbox.as_ref()) else { return false };
        let Some(rq) = self.srqs.get(&srq) else { return false };
        if rq.dead || !rq.shared || !rq.srq {
            return false;
        }
        let turn = rq.ring.aux(SRQ_AUX_CLAIMER);
        let mine = qpn.wrapping_add(1);
        let held = turn.load(Ordering::SeqCst);
        if held & !SRQ_CLAIMER_NOTED != mine {
            return false;
        }
        // Noted: the index is this turn's (before it, nothing was claimed).
        let at = rq.ring.aux(SRQ_AUX_CLAIM_AT).load(Ordering::SeqCst);
        // Passed: claimed by someone; a distance of half the index space
        // or more is an index from the future (scribbled), not claimed.
        let passed = rq.ring.consumed().wrapping_sub(at);
        let claimed =
            held & SRQ_CLAIMER_NOTED != 0 && passed != 0 && passed < 1 << 31 && rq.claimed_noted != Some(at);
        // The slot its completion was staged in, read after the claim was
        // seen (the requester stored it before claiming), and published
        // only while the producer index names it: one published already
        // (the requester killed after its publication, before giving the
        // turn back) is not published again.
        let slot = rq.ring.aux(SRQ_AUX_CLAIM_SLOT).load(Ordering::SeqCst);
        let published = claimed && inbox.produced() == slot && publish_staged_flush(inbox, slot);
        if requester_gone {
            let _ = turn.compare_exchange(held, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        published
    }
}

/// Publishes, as staged, the completion a requester staged in slot
/// `pushed` of `inbox` (a flush, unless it had placed the message and was
/// making it a success): the staged word first (won, a requester that runs
/// again leaves the slot alone; lost, it had placed the message, whose
/// one status byte may land after this publication, success being then as
/// true as the flush), then the compare-and-swap of the producer index,
/// which publishes the slot once (the requester's own fails after it).
fn publish_staged_flush(inbox: &RingView, pushed: u32) -> bool {
    let staged = inbox.aux(INBOX_AUX_STAGED);
    let _ = staged.compare_exchange(pushed, pushed.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst);
    // The engine's view pushes into an inbox only here, while the
    // requester publishes on: its copy of the consumer index may be any
    // age.
    inbox.refresh_consumer_copy();
    inbox.publish_staged(pushed)
}

impl Queues for RingTable {
    fn pull_send(&mut self, qpn: u32) -> Option<Pulled<SendWr>> {
        let q = self.qps.get_mut(&qpn)?;
        let got = q.sq.pull(&mut self.scratch, decode_send, &mut self.log, self.now);
        if got.is_some() {
            q.held = q.held.wrapping_add(1);
        }
        got
    }

    fn send_retired(&mut self, qpn: u32, count: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        // Never more than were pulled: the count must not run ahead of
        // the ring's producer index.
        let n = count.min(q.held);
        if n != count {
            tracing::error!(qp = qpn, count, held = q.held, "more send WRs retired than pulled");
        }
        q.held -= n;
        q.retire(n);
    }

    fn pull_recv(&mut self, src: RecvSource) -> Option<Pulled<RecvWr>> {
        let ring = match src {
            RecvSource::Qp(n) => self.qps.get_mut(&n)?.rq.as_mut()?,
            RecvSource::Srq(n) => self.srqs.get_mut(&n)?,
        };
        ring.pull(&mut self.scratch, decode_recv, &mut self.log, self.now)
    }

    fn recv_posted(&mut self, src: RecvSource) -> u32 {
        let ring = match src {
            RecvSource::Qp(n) => self.qps.get(&n).and_then(|q| q.rq.as_ref()),
            RecvSource::Srq(n) => self.srqs.get(&n),
        };
        ring.and_then(|r| r.ring.len().ok()).unwrap_or(0)
    }

    fn flush_claimed(&mut self, qpn: u32, rq: RecvSource, requester_gone: bool) -> bool {
        let published = match rq {
            RecvSource::Qp(_) => self.flush_claimed_own(qpn),
            RecvSource::Srq(srq) => self.flush_claimed_srq(qpn, srq, requester_gone),
        };
        // The owner's poll finds the inbox through its bucket's bit, set
        // after the publication as a requester does; set too when the
        // inbox holds completions anyway (a requester stopped or killed
        // between its push and its mark), and the CQ's event raised for
        // them, as the requester would have (`notify_channel` raises it
        // only for an arming; a flush fires any).
        let Some((cqn, inbox)) = self.qps.get(&qpn).and_then(|q| q.inbox.as_ref()) else { return published };
        let waiting = published || inbox.len().is_ok_and(|n| n > 0);
        if waiting {
            let cqn = *cqn;
            if let Some(cq) = self.cqs.get(&cqn) {
                let bucket = proto::cq_ready_bucket(qpn);
                let (w, b) = ((bucket / 32) as usize, bucket % 32);
                cq.ring.aux(proto::CQ_AUX_READY_FIRST + w).fetch_or(1 << b, Ordering::SeqCst);
                cq.ring.aux(proto::CQ_AUX_READY_SUMMARY).fetch_or(1 << w, Ordering::SeqCst);
            }
            let cqe = Cqe::new(0, WcStatus::WrFlushErr, vrdma_core::verbs::WcOpcode::Recv, qpn);
            self.notify_channel(cqn, &cqe);
        }
        published
    }

    fn discard(&mut self, qpn: u32) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            // What is dropped from the ring is retired; so is anything the
            // core still held (it retires its WRs before a reset, so that is
            // nothing): the retired count then equals the producer index,
            // and the client has nothing outstanding.
            let dropped = q.sq.ring.discard_all().unwrap_or(0);
            let held = std::mem::take(&mut q.held);
            q.retire(dropped.wrapping_add(held));
            if let Some(rq) = q.rq.as_mut() {
                let dropped = rq.ring.discard_all().unwrap_or(0);
                rq.took = rq.took.wrapping_add(dropped);
            }
        }
    }

    fn push_cqe(&mut self, cqn: u32, cqe: &Cqe) -> Result<(), CqFull> {
        let cq = self.cqs.get(&cqn).ok_or(CqFull)?;
        let mut slot = [0u8; CQE_SIZE];
        cqe.encode(&mut slot);
        // The core retires a send WR just before it pushes the WR's
        // completion, so the count now includes this WR and no later one.
        if !cqe.opcode.is_recv() {
            if let Some(q) = self.qps.get(&cqe.qp_num) {
                Cqe::set_sq_retired(&mut slot, q.retired);
            }
        }
        // Completions the tenant's library holds in its local queue, and
        // those direct-path requesters pushed into the inboxes of QPs
        // completing here (the direct path), take room in the CQ too: the
        // CQ's depth is the ring's capacity, shared by all.
        let local = cq.ring.aux(CQ_AUX_LOCAL).load(Ordering::SeqCst);
        let local =
            if cq.inbox_qps.is_empty() { local } else { local.saturating_add(self.inbox_entries(cqn, cq)) };
        if local > 0 && cq.ring.len().map_or(true, |n| n.saturating_add(local) >= cq.ring.capacity()) {
            self.dropped_events += 1;
            return Err(CqFull);
        }
        // A receive completion of a QP with an inbox is counted there
        // before it is visible: a direct-path requester claims the QP's
        // next receive only while all of them were polled (the order).
        let pushed = match self.qps.get(&cqe.qp_num).and_then(|q| q.inbox.as_ref()) {
            Some((_, inbox)) if cqe.opcode.is_recv() => Some(inbox.aux(INBOX_AUX_ENGINE_PUSHED)),
            _ => None,
        };
        if let Some(p) = pushed {
            p.fetch_add(1, Ordering::SeqCst);
        }
        match cq.ring.try_push_bytes(&slot) {
            Ok(true) => {
                self.notify_channel(cqn, cqe);
                Ok(())
            }
            Ok(false) | Err(_) => {
                if let Some(p) = pushed {
                    p.fetch_sub(1, Ordering::SeqCst);
                }
                self.dropped_events += 1;
                Err(CqFull)
            }
        }
    }

    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent) {
        tracing::debug!(ctx = ctx.0, ?event, "async event");
        if event.event_type == AsyncEventType::SrqLimitReached {
            // The limit disarmed: the direct path's claimers stop asking
            // (`SRQ_AUX_LIMIT`).
            if let Some(r) = self.srqs.get(&event.element) {
                r.ring.aux(proto::SRQ_AUX_LIMIT).store(0, Ordering::SeqCst);
            }
        }
        let mut slot = [0u8; proto::ASYNC_EVENT_SIZE];
        proto::encode_async_event(&event, &mut slot);
        let Some(c) = self.contexts.get(&ctx) else {
            // A moved context not yet adopted: in its ring, where its
            // library will look (its signal is rung at the adoption).
            if let Some((tenant, ring)) = self.awaiting.get(&ctx) {
                if !matches!(ring.try_push_bytes(&slot), Ok(true)) {
                    ring.aux(CTX_AUX_EVENTS_DROPPED).fetch_add(1, Ordering::Relaxed);
                    self.dropped_events += 1;
                    limited_warn!(
                        self.log,
                        Source::Tenant(*tenant),
                        self.now,
                        "async event ring full: event dropped",
                        ctx = ctx.0,
                        ?event,
                        adopted = false
                    );
                }
            }
            return;
        };
        if !matches!(c.events.try_push_bytes(&slot), Ok(true)) {
            c.events.aux(CTX_AUX_EVENTS_DROPPED).fetch_add(1, Ordering::Relaxed);
            self.dropped_events += 1;
            let tenant = Source::Tenant(c.tenant);
            limited_warn!(
                self.log,
                tenant,
                self.now,
                "async event ring full: event dropped",
                ctx = ctx.0,
                ?event
            );
        }
        c.event_fd.ring();
    }

    fn qp_state_changed(&mut self, qpn: u32, state: QpState) {
        if let Some(q) = self.qps.get(&qpn) {
            q.sq.ring.aux(SQ_AUX_STATE).store(state.raw() as u32, Ordering::SeqCst);
        }
    }

    fn take_posted(&mut self, per_tenant: u32, out: &mut Vec<u32>) -> bool {
        let n = self.contexts.len();
        if n == 0 {
            return false;
        }
        let from = self.posted_from % n;
        self.posted_from = self.posted_from.wrapping_add(1);
        let now = self.now;
        let mut spent = std::mem::take(&mut self.posted_spent);
        spent.clear();
        let mut more = false;
        // Contexts in a turning order: a tenant whose first contexts use
        // its whole budget does not leave its others unread for ever.
        let broken = &mut self.broken;
        let qps = &self.qps;
        let announced = |qpn: u32| qps.get(&qpn).is_some_and(QpRings::announced);
        let mut take = |(&id, c): (&ContextId, &mut ContextRings)| {
            let i = match spent.iter().position(|(t, _)| *t == c.tenant) {
                Some(i) => i,
                None => {
                    spent.push((c.tenant, 0));
                    spent.len() - 1
                }
            };
            let budget = per_tenant.saturating_sub(spent[i].1);
            if budget == 0 {
                more |= c.waiting();
                return;
            }
            let taken = c.take_posted(budget, now, &announced, out);
            spent[i].1 += taken.looked;
            more |= taken.more;
            if taken.broke {
                broken.push(id);
            }
        };
        self.contexts.iter_mut().skip(from).for_each(&mut take);
        self.contexts.iter_mut().take(from).for_each(&mut take);
        self.posted_spent = spent;
        more
    }

    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.qps.get(&qpn).is_some_and(QpRings::announced)
    }

    fn park_queues(&mut self, qpn: u32, recv_too: bool) -> bool {
        let Some(q) = self.qps.get(&qpn) else { return true };
        // Re-arm, then look: a tenant that posted before the store is seen
        // here; one that posts after it finds 0 and names the QP.
        q.sq.ring.aux(SQ_AUX_NOTIFIED).store(0, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let empty = |r: &InRing| r.dead || r.ring.len().is_ok_and(|n| n == 0);
        empty(&q.sq) && (!recv_too || q.rq.as_ref().is_none_or(empty))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_shm::{ring_bytes, Segment};

    use crate::testing::traced;

    /// A context of `tenant` owning `qps`, and the tenant's view of its
    /// posted ring.
    fn context(tenant: u32, qps: impl IntoIterator<Item = u32>) -> (ContextRings, RingView) {
        let ring = || {
            let len = ring_bytes(proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE);
            let seg = Arc::new(Segment::create("vrdma-test", len).unwrap());
            (
                RingView::in_segment(seg.clone(), 0, proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE)
                    .unwrap(),
                seg,
            )
        };
        let (posted, seg) = ring();
        let tenant_view =
            RingView::in_segment(seg, 0, proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE).unwrap();
        let len = ring_bytes(proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE);
        let events = RingView::in_segment(
            Arc::new(Segment::create("vrdma-test", len).unwrap()),
            0,
            proto::ASYNC_RING_CAPACITY,
            proto::ASYNC_EVENT_SIZE,
        )
        .unwrap();
        let (bell, _) = Doorbell::pair().unwrap();
        let (event_fd, _) = Doorbell::pair().unwrap();
        let mut c = ContextRings::new(TenantId(tenant), events, event_fd, Arc::new(bell), posted);
        for q in qps {
            c.qps.insert(q, ());
        }
        (c, tenant_view)
    }

    /// Adds QP `qpn` of context `ctx` to `table`; returns the tenant's
    /// view of its send ring.
    fn send_ring(table: &mut RingTable, ctx: ContextId, qpn: u32) -> RingView {
        let seg = Arc::new(Segment::create("vrdma-test", ring_bytes(4, 64)).unwrap());
        let engine_side = RingView::in_segment(seg.clone(), 0, 4, 64).unwrap();
        let tenant = table.contexts[&ctx].tenant;
        table.add_qp(qpn, QpRings::new(ctx, InRing::new(engine_side, tenant), None));
        RingView::in_segment(seg, 0, 4, 64).unwrap()
    }

    fn name(ring: &RingView, qpn: u32) -> bool {
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        slot[..4].copy_from_slice(&qpn.to_le_bytes());
        ring.try_push_bytes(&slot).unwrap()
    }

    /// A receive a direct-path requester claimed and never completed (it
    /// died between its claim and its push, having staged the completion
    /// as a flush) is published by the QP's flush, once; one the
    /// requester completed, or completes after, never twice; forged
    /// indices get nothing.
    #[test]
    fn a_claimed_receive_whose_requester_died_is_flushed_once() {
        use vrdma_core::ring::CQE_STATUS_BYTE;
        use vrdma_core::verbs::WcOpcode;
        // Views of one ring: the engine's first, then the tenant's.
        let ring = |cap: u32, stride: usize, n: usize| {
            let seg = Arc::new(Segment::create("vrdma-test", ring_bytes(cap, stride)).unwrap());
            (0..n).map(|_| RingView::in_segment(seg.clone(), 0, cap, stride).unwrap()).collect::<Vec<_>>()
        };
        let (qpn, cqn) = (40, 3);
        let mut table = RingTable::default();
        let (c, _) = context(1, [qpn]);
        table.contexts.insert(ContextId(7), c);
        let sq = ring(4, 64, 1).remove(0);
        let [rq, owner_rq, requester_rq]: [RingView; 3] = ring(8, 64, 3).try_into().unwrap();
        let [inbox, requester_inbox, owner_inbox]: [RingView; 3] = ring(8, CQE_SIZE, 3).try_into().unwrap();
        let [cq, owner_cq]: [RingView; 2] = ring(8, CQE_SIZE, 2).try_into().unwrap();
        table.cqs.insert(cqn, CqRing { ring: cq, channel: None, inbox_qps: vec![qpn] });
        let (t, ctx) = (TenantId(1), ContextId(7));
        let rings =
            QpRings::new(ctx, InRing::new(sq, t), Some(InRing::new(rq, t).shared())).with_inbox(cqn, inbox);
        table.add_qp(qpn, rings);
        for _ in 0..6 {
            assert!(owner_rq.try_push_bytes(&[0u8; 64]).unwrap());
        }
        let mut buf = [0u8; 64];
        let staged = |status: WcStatus, wr_id: u64| {
            let mut out = [0u8; CQE_SIZE];
            Cqe::new(wr_id, status, WcOpcode::Recv, qpn).encode(&mut out);
            let at = requester_inbox.stage(&out).unwrap().unwrap();
            requester_inbox.aux(INBOX_AUX_STAGED).store(at, Ordering::SeqCst);
            at
        };
        // The requester's side once it placed the message: the slot is its
        // to publish unless the daemon took it.
        let finish = |at: u32| {
            let staged = requester_inbox.aux(INBOX_AUX_STAGED);
            if staged.compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                return false;
            }
            requester_inbox.set_staged_byte(at, CQE_STATUS_BYTE, WcStatus::Success.raw());
            requester_inbox.publish_staged(at)
        };
        let claim = |buf: &mut [u8; 64]| {
            assert_eq!(requester_rq.try_claim(buf, |_| true).unwrap(), vrdma_shm::Claim::Taken);
        };
        // Completed by the requester, then one taken by the engine: nothing
        // lost.
        let at = staged(WcStatus::WrFlushErr, 1);
        claim(&mut buf);
        assert!(finish(at));
        assert!(table.pull_recv(RecvSource::Qp(qpn)).is_some());
        assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true), "nothing was lost");
        // Staged, not yet claimed (it may still be): not the flush's.
        let at = staged(WcStatus::WrFlushErr, 2);
        assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true));
        // Claimed, then the requester stopped: flushed, once.
        claim(&mut buf);
        assert!(table.flush_claimed(qpn, RecvSource::Qp(qpn), true));
        assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true), "once");
        // The requester continued: its completion is not published again.
        assert!(!finish(at));
        let mut got = Vec::new();
        let mut slot = [0u8; CQE_SIZE];
        while owner_inbox.try_pop(&mut slot).unwrap() {
            let c = Cqe::decode(&slot);
            got.push((c.wr_id, c.status));
        }
        assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::WrFlushErr)]);
        let ready = |i: usize| owner_cq.aux(i).load(Ordering::SeqCst);
        let mut marked = Vec::new();
        proto::for_each_ready_bucket(ready, |b| marked.push(b));
        assert_eq!(marked, vec![proto::cq_ready_bucket(qpn)], "the owner's poll looks at the inbox");
        // Forged indices (the inbox's producer index ahead of or behind
        // the claims): nothing published, nothing read outside the ring.
        let pushed = requester_inbox.produced();
        for forged in [pushed.wrapping_add(3), pushed.wrapping_sub(2), pushed.wrapping_add(1 << 31)] {
            requester_inbox.scribble_producer_index(forged);
            assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true));
            assert_eq!(requester_inbox.produced(), forged);
        }
        requester_inbox.scribble_producer_index(pushed);
        // Stopped after taking the staged word (the message placed), before
        // publishing: published by the flush, as a success, once.
        let at = staged(WcStatus::WrFlushErr, 3);
        claim(&mut buf);
        let word = requester_inbox.aux(INBOX_AUX_STAGED);
        assert!(word.compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok());
        requester_inbox.set_staged_byte(at, CQE_STATUS_BYTE, WcStatus::Success.raw());
        assert!(table.flush_claimed(qpn, RecvSource::Qp(qpn), true));
        assert!(!requester_inbox.publish_staged(at), "the requester's own publication fails");
        assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true), "once");
        // Stopped between its publication and its mark: the flush marks.
        let ready_word = owner_cq.aux(proto::CQ_AUX_READY_SUMMARY);
        ready_word.store(0, Ordering::SeqCst);
        assert!(!table.flush_claimed(qpn, RecvSource::Qp(qpn), true));
        assert_ne!(ready_word.load(Ordering::SeqCst), 0, "an inbox with completions is marked");
        assert!(owner_inbox.try_pop(&mut slot).unwrap());
        let c = Cqe::decode(&slot);
        assert_eq!((c.wr_id, c.status), (3, WcStatus::Success));
        assert_eq!(owner_inbox.len().unwrap(), 0, "nothing else published (forged indices included)");
    }

    /// QP `x` of [`srq_claim_fixture`] (and `y`, the SRQ's other QP).
    const SRQ_X: u32 = 40;
    const SRQ_Y: u32 = 41;
    /// The fixture's SRQ and CQ.
    const SRQ_N: u32 = 9;
    const SRQ_CQ: u32 = 3;

    /// QPs [`SRQ_X`] and [`SRQ_Y`] of one context on SRQ [`SRQ_N`] with
    /// `posted` receives, their inboxes on CQ [`SRQ_CQ`]: the daemon's
    /// table, and the views through which a test plays the library's
    /// parts (the SRQ's requester, the CQ's owner, `x`'s inbox
    /// as its requester sees it, each QP's inbox as its owner sees it).
    struct SrqClaimFixture {
        table: RingTable,
        requester_srq: RingView,
        owner_cq: RingView,
        x_inbox: RingView,
        x_owner: RingView,
        y_owner: RingView,
    }

    /// The completions an inbox's owner pops: (wr_id, status, QP).
    fn popped(owner: &RingView) -> Vec<(u64, WcStatus, u32)> {
        let mut slot = [0u8; CQE_SIZE];
        let mut got = Vec::new();
        while owner.try_pop(&mut slot).unwrap() {
            let c = Cqe::decode(&slot);
            got.push((c.wr_id, c.status, c.qp_num));
        }
        got
    }

    fn srq_claim_fixture(posted: u64) -> SrqClaimFixture {
        let ring = |cap: u32, stride: usize, n: usize| {
            let seg = Arc::new(Segment::create("vrdma-test", ring_bytes(cap, stride)).unwrap());
            (0..n).map(|_| RingView::in_segment(seg.clone(), 0, cap, stride).unwrap()).collect::<Vec<_>>()
        };
        let (t, ctx) = (TenantId(1), ContextId(7));
        let mut table = RingTable::default();
        table.contexts.insert(ctx, context(1, [SRQ_X, SRQ_Y]).0);
        let [srq, owner_srq, requester_srq]: [RingView; 3] = ring(8, 64, 3).try_into().unwrap();
        table.srqs.insert(SRQ_N, InRing::new(srq, t).shared_srq());
        let [cq, owner_cq]: [RingView; 2] = ring(8, CQE_SIZE, 2).try_into().unwrap();
        table.cqs.insert(SRQ_CQ, CqRing { ring: cq, channel: None, inbox_qps: Vec::new() });
        // Each QP's inbox: the daemon's view, the requester's, the owner's.
        let mut inboxes = Vec::new();
        for qpn in [SRQ_X, SRQ_Y] {
            let [inbox, requester, owner]: [RingView; 3] = ring(8, CQE_SIZE, 3).try_into().unwrap();
            let sq = ring(4, 64, 1).remove(0);
            table.add_qp(qpn, QpRings::new(ctx, InRing::new(sq, t), None).with_inbox(SRQ_CQ, inbox));
            inboxes.push((requester, owner));
        }
        let [(x_inbox, x_owner), (_, y_owner)]: [(RingView, RingView); 2] = inboxes.try_into().unwrap();
        for i in 0..posted {
            let mut slot = [0u8; 64];
            slot[..8].copy_from_slice(&i.to_le_bytes());
            assert!(owner_srq.try_push_bytes(&slot).unwrap());
        }
        SrqClaimFixture { table, requester_srq, owner_cq, x_inbox, x_owner, y_owner }
    }

    /// A receive a direct-path requester claimed from an SRQ for QP `x`
    /// and never completed (it died between its claim and its push) is
    /// published by `x`'s flush, as a flush on `x`'s CQ, once; nothing is
    /// published for a claim that was not made (a turn taken and nothing
    /// noted yet, an index noted and not claimed, an index noted and
    /// claimed by the engine instead), none into another QP of the SRQ,
    /// and the turn is given back; the requester, continued, publishes
    /// nothing more.
    #[test]
    fn a_claimed_srq_receive_whose_requester_died_is_flushed_once_on_its_qp() {
        use vrdma_core::ring::CQE_STATUS_BYTE;
        use vrdma_core::verbs::WcOpcode;
        use vrdma_shm::Claim;
        let (x, y, srqn) = (SRQ_X, SRQ_Y, SRQ_N);
        let SrqClaimFixture { mut table, requester_srq, owner_cq, x_inbox, x_owner, y_owner } =
            srq_claim_fixture(8);
        let (x_inbox, x_owner, y_owner) = (&x_inbox, &x_owner, &y_owner);
        let turn = requester_srq.aux(SRQ_AUX_CLAIMER);
        let claim_at = requester_srq.aux(SRQ_AUX_CLAIM_AT);
        let take_turn =
            |qpn: u32| turn.compare_exchange(0, qpn + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok();
        // The library's note: the index, then the turn marked noted.
        let note = |qpn: u32, at: u32| {
            claim_at.store(at, Ordering::SeqCst);
            turn.store((qpn + 1) | SRQ_CLAIMER_NOTED, Ordering::SeqCst);
        };
        let stage = |wr_id: u64| {
            let mut out = [0u8; CQE_SIZE];
            Cqe::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, x).encode(&mut out);
            let at = x_inbox.stage(&out).unwrap().unwrap();
            x_inbox.aux(INBOX_AUX_STAGED).store(at, Ordering::SeqCst);
            requester_srq.aux(SRQ_AUX_CLAIM_SLOT).store(at, Ordering::SeqCst);
            at
        };
        let finish = |at: u32| {
            let staged = x_inbox.aux(INBOX_AUX_STAGED);
            if staged.compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                return false;
            }
            x_inbox.set_staged_byte(at, CQE_STATUS_BYTE, WcStatus::Success.raw());
            x_inbox.publish_staged(at)
        };
        let claim = || {
            let mut buf = [0u8; 64];
            let got = requester_srq.try_claim_noting(&mut buf, |at| note(x, at), |_| true).unwrap();
            assert_eq!(got, Claim::Taken);
            u64::from_le_bytes(buf[..8].try_into().unwrap())
        };
        // Each flush here is one with the requester gone (its process died):
        // the turn is given back (`a_flush_while_the_srq_claimer_lives_leaves_it_its_turn`).
        let flush = |table: &mut RingTable, qpn: u32| table.flush_claimed(qpn, RecvSource::Srq(srqn), true);

        // Completed by the requester, killed before it gave the turn back:
        // nothing published again.
        assert!(take_turn(x));
        let at = stage(0);
        assert_eq!(claim(), 0);
        assert!(finish(at));
        assert!(!flush(&mut table, x), "nothing was lost");
        assert_eq!(turn.load(Ordering::SeqCst), 0, "the daemon gave the turn back");
        // The turn taken, nothing noted yet (the index there is the last
        // turn's, claimed and published): nothing; the turn given back.
        assert!(take_turn(x));
        assert!(!flush(&mut table, x));
        assert_eq!(turn.load(Ordering::SeqCst), 0, "the daemon gave the turn back");
        // Noted and staged, not claimed: nothing.
        assert!(take_turn(x));
        note(x, requester_srq.consumed());
        stage(1);
        assert!(!flush(&mut table, x));
        // Noted and staged, then the engine claimed that index first (the
        // requester's compare-and-swap would fail): nothing.
        assert!(take_turn(x));
        note(x, requester_srq.consumed());
        stage(1);
        assert!(table.pull_recv(RecvSource::Srq(srqn)).is_some());
        assert!(!flush(&mut table, x), "the engine's claim is not the requester's");
        // Claimed, then the requester died: flushed on x, once; y's flush
        // while another QP's requester holds the turn publishes nothing.
        assert!(take_turn(x));
        let at = stage(2);
        assert_eq!(claim(), 2);
        assert!(!flush(&mut table, y), "not y's claim");
        assert!(flush(&mut table, x));
        assert!(!flush(&mut table, x), "once");
        assert_eq!(turn.load(Ordering::SeqCst), 0, "the daemon gave the turn back");
        // The requester continued: its completion is not published again.
        assert!(!finish(at));
        assert_eq!(popped(x_owner), vec![(0, WcStatus::Success, x), (2, WcStatus::WrFlushErr, x)]);
        assert!(popped(y_owner).is_empty(), "nothing in the other QP's inbox");
        let ready = |i: usize| owner_cq.aux(i).load(Ordering::SeqCst);
        let mut marked = Vec::new();
        proto::for_each_ready_bucket(ready, |b| marked.push(b));
        assert_eq!(marked, vec![proto::cq_ready_bucket(x)], "the owner's poll looks at x's inbox");
        // Another QP's requester's turn: x's flush leaves it alone.
        assert!(take_turn(y));
        note(y, requester_srq.consumed());
        assert!(!flush(&mut table, x));
        assert_eq!(turn.load(Ordering::SeqCst), (y + 1) | SRQ_CLAIMER_NOTED);
        turn.store(0, Ordering::SeqCst);
        // Stopped after taking the staged word (the message placed),
        // before publishing: published by the flush, as a success, once.
        assert!(take_turn(x));
        let at = stage(3);
        assert_eq!(claim(), 3);
        let word = x_inbox.aux(INBOX_AUX_STAGED);
        assert!(word.compare_exchange(at, at + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok());
        x_inbox.set_staged_byte(at, CQE_STATUS_BYTE, WcStatus::Success.raw());
        assert!(flush(&mut table, x));
        assert!(!x_inbox.publish_staged(at), "the requester's own publication fails");
        assert_eq!(popped(x_owner), vec![(3, WcStatus::Success, x)]);
        // A forged index (ahead of the consumer): nothing.
        assert!(take_turn(x));
        note(x, requester_srq.consumed().wrapping_add(5));
        stage(5);
        assert!(!flush(&mut table, x));
        assert!(popped(x_owner).is_empty());
        // A turn held for a QP destroyed without a flush is given back;
        // another QP's is not.
        assert!(take_turn(y));
        table.remove_qp(x);
        assert_eq!(turn.load(Ordering::SeqCst), y + 1);
        turn.store(0, Ordering::SeqCst);
        assert!(take_turn(y));
        note(y, requester_srq.consumed());
        table.remove_qp(y);
        assert_eq!(turn.load(Ordering::SeqCst), 0, "the destroyed QP's turn given back");
    }

    /// A flush of an SRQ's QP whose requester still exists (its process
    /// stopped on its way to a claim: turn taken, index noted, completion
    /// staged) publishes nothing and leaves it the turn: given back then,
    /// another QP's requester would take it while this one can still
    /// claim, and the daemon could then no longer tell their claims apart
    /// (that one's flush would publish a completion for a receive the
    /// other took, a second completion). Once the requester goes (the core
    /// asks again), the claim it made meanwhile is flushed, once, and the
    /// turn is given back.
    #[test]
    fn a_flush_while_the_srq_claimer_lives_leaves_it_its_turn() {
        use vrdma_core::verbs::WcOpcode;
        use vrdma_shm::Claim;
        let (x, y, srqn) = (SRQ_X, SRQ_Y, SRQ_N);
        let SrqClaimFixture { mut table, requester_srq, x_inbox, x_owner, y_owner, .. } =
            srq_claim_fixture(4);
        let (x_inbox, x_owner, y_owner) = (&x_inbox, &x_owner, &y_owner);
        let turn = requester_srq.aux(SRQ_AUX_CLAIMER);
        let take_turn =
            |qpn: u32| turn.compare_exchange(0, qpn + 1, Ordering::SeqCst, Ordering::SeqCst).is_ok();
        // x's requester: the turn, the index noted, the completion staged
        // (as the library does inside `try_claim_noting`); then stopped.
        assert!(take_turn(x));
        let at = requester_srq.consumed();
        requester_srq.aux(SRQ_AUX_CLAIM_AT).store(at, Ordering::SeqCst);
        turn.store((x + 1) | SRQ_CLAIMER_NOTED, Ordering::SeqCst);
        let mut out = [0u8; CQE_SIZE];
        Cqe::new(0, WcStatus::WrFlushErr, WcOpcode::Recv, x).encode(&mut out);
        let slot = x_inbox.stage(&out).unwrap().unwrap();
        x_inbox.aux(INBOX_AUX_STAGED).store(slot, Ordering::SeqCst);
        requester_srq.aux(SRQ_AUX_CLAIM_SLOT).store(slot, Ordering::SeqCst);
        // x flushed (its owner moved it to ERR) while the requester lives.
        assert!(!table.flush_claimed(x, RecvSource::Srq(srqn), false), "nothing claimed yet");
        assert!(!take_turn(y), "the turn stays with the requester that may still claim");
        assert_eq!(turn.load(Ordering::SeqCst), (x + 1) | SRQ_CLAIMER_NOTED);
        // It continues and claims (with its turn), then dies before its
        // publication.
        let mut buf = [0u8; 64];
        assert_eq!(requester_srq.try_claim(&mut buf, |_| true).unwrap(), Claim::Taken);
        assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), 0);
        // Its QP gone, the core asks again: flushed on x, once.
        assert!(table.flush_claimed(x, RecvSource::Srq(srqn), true));
        assert!(!table.flush_claimed(x, RecvSource::Srq(srqn), true), "once");
        assert_eq!(popped(x_owner), vec![(0, WcStatus::WrFlushErr, x)]);
        assert!(popped(y_owner).is_empty());
        assert_eq!(turn.load(Ordering::SeqCst), 0, "given back once the requester is gone");
        assert!(take_turn(y), "the SRQ's other requesters claim again");
    }

    /// An event raised for a context that moved here and that no session
    /// has adopted yet (an SRQ's limit reached by its peers' messages
    /// after the resume) goes into its event ring where the guest left
    /// it; the adoption rings the new signal for it, and the context's
    /// next events go to its rings as any context's. One that moved away
    /// again, never adopted, is forgotten.
    #[test]
    fn an_event_for_a_moved_context_not_yet_adopted_waits_in_its_ring() {
        let mut table = RingTable::default();
        let len = ring_bytes(proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE);
        let seg = Arc::new(Segment::create("vrdma-test", len).unwrap());
        let view = || {
            RingView::in_segment(seg.clone(), 0, proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE).unwrap()
        };
        let (guest, ctx) = (view(), ContextId(7));
        let popped = || {
            let mut slot = [0u8; proto::ASYNC_EVENT_SIZE];
            let mut out = Vec::new();
            while guest.try_pop(&mut slot).unwrap() {
                out.push(proto::decode_async_event(&slot).unwrap());
            }
            out
        };
        let limit = AsyncEvent { event_type: AsyncEventType::SrqLimitReached, element: 0x55 };
        // No ring at all: dropped (as before).
        table.async_event(ctx, limit);
        assert!(popped().is_empty());
        table.awaiting.insert(ctx, (TenantId(1), view()));
        table.async_event(ctx, limit);
        // Adopted: the ring is the session's, its signal rung for the
        // event waiting there.
        let (mut c, _) = context(1, []);
        c.events = view();
        let (event_fd, tenant_end) = Doorbell::pair().unwrap();
        c.event_fd = event_fd;
        table.add_context(ctx, c);
        assert!(table.awaiting.is_empty());
        assert!(tenant_end.is_readable(), "the adopter's signal rung for the event raised before");
        assert_eq!(popped(), vec![limit], "once");
        tenant_end.drain();
        let fatal = AsyncEvent { event_type: AsyncEventType::QpFatal, element: 9 };
        table.async_event(ctx, fatal);
        assert_eq!(popped(), vec![fatal]);
        // Moved away unadopted: forgotten.
        table.awaiting.insert(ContextId(8), (TenantId(1), view()));
        table.forget_awaiting(&[ContextId(8)]);
        assert!(table.awaiting.is_empty());
    }

    /// An event for a moved context not yet adopted, its ring full (a
    /// guest that never reads its async events), is dropped, counted and
    /// logged (rate-limited, on the tenant's share) as an adopted one's.
    #[test]
    fn an_event_dropped_from_a_moved_contexts_full_ring_is_logged() {
        let mut table = RingTable::default();
        let len = ring_bytes(proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE);
        let seg = Arc::new(Segment::create("vrdma-test", len).unwrap());
        let ring = RingView::in_segment(seg, 0, proto::ASYNC_RING_CAPACITY, proto::ASYNC_EVENT_SIZE).unwrap();
        let ctx = ContextId(7);
        table.awaiting.insert(ctx, (TenantId(3), ring));
        let fatal = AsyncEvent { event_type: AsyncEventType::QpFatal, element: 9 };
        for _ in 0..proto::ASYNC_RING_CAPACITY {
            table.async_event(ctx, fatal);
        }
        assert_eq!(table.dropped_events, 0);
        assert!(table.log.occurred().is_empty());
        table.async_event(ctx, fatal);
        assert_eq!(table.dropped_events, 1);
        assert_eq!(table.log.occurred().get("async event ring full: event dropped"), Some(&1));
        assert_eq!(table.awaiting[&ctx].1.aux(CTX_AUX_EVENTS_DROPPED).load(Ordering::Relaxed), 1);
    }

    /// A context whose QPs' rings came first (an import: a guest adopts
    /// the context afterwards) names them once its rings are added; those
    /// of another context stay its own.
    #[test]
    fn an_adopted_context_names_the_qps_imported_before_it() {
        let mut table = RingTable::default();
        let (other, _) = context(1, []);
        table.contexts.insert(ContextId(9), other);
        // The QPs' rings, before their context has any (as an import
        // installs them): a stand-in context to make them, then removed.
        let (stand_in, _) = context(1, []);
        table.contexts.insert(ContextId(7), stand_in);
        let lib = send_ring(&mut table, ContextId(7), 40);
        let _theirs = send_ring(&mut table, ContextId(9), 41);
        table.contexts.remove(&ContextId(7));
        let (c, tenant) = context(1, []);
        table.add_context(ContextId(7), c);
        assert_eq!(table.contexts[&ContextId(7)].qps.keys().copied().collect::<Vec<_>>(), vec![40]);
        lib.aux(SQ_AUX_NOTIFIED).store(1, Ordering::SeqCst);
        assert!(name(&tenant, 40) && name(&tenant, 41));
        let mut woken = Vec::new();
        for calls in 0.. {
            assert!(calls < 10);
            if !table.take_posted(16, &mut woken) {
                break;
            }
        }
        assert_eq!(woken, vec![40], "its own QP, named; not another context's");
    }

    /// A tenant may write anything into its posted ring: a ring full of
    /// the same QP's number costs a call no more than its budget.
    #[test]
    fn a_posted_ring_of_duplicates_costs_no_more_than_the_budget() {
        let (mut c, tenant) = context(1, [0x11]);
        while name(&tenant, 0x11) {}
        let mut out = Vec::new();
        let t = c.take_posted(64, Instant(0), &|_| true, &mut out);
        assert_eq!((t.looked, out.len()), (64, 64));
        assert!(t.more, "the rest waits for later calls");
    }

    /// The overflow flag wakes every QP of the context, `budget` a call:
    /// never all at once, and a flag set again during the rescan (a post
    /// to a QP the rescan had passed) brings another.
    #[test]
    fn an_overflowed_ring_wakes_the_contexts_qps_a_budget_at_a_time() {
        let (mut c, tenant) = context(1, 0..1000);
        let flag = || tenant.aux(POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
        flag();
        let mut out = Vec::new();
        let mut calls = 0;
        loop {
            let before = out.len();
            let t = c.take_posted(32, Instant(0), &|_| true, &mut out);
            assert!(out.len() - before <= 32 && t.looked <= 32);
            calls += 1;
            if calls == 10 {
                flag();
            }
            if !t.more {
                break;
            }
            assert!(calls < 1000, "a rescan never ends");
        }
        let mut woken = out.clone();
        woken.sort_unstable();
        woken.dedup();
        assert_eq!(woken.len(), 1000, "every QP is woken");
        assert_eq!(out.len(), 2000, "twice: the flag came again during the first rescan");
        // Kept set by a tenant, the flag costs a budget a call, no more.
        for _ in 0..100 {
            flag();
            out.clear();
            c.take_posted(32, Instant(0), &|_| true, &mut out);
            assert!(out.len() <= 32);
        }
    }

    /// The overflow flag, and a name in the ring, wake the QPs that were
    /// posted to since the engine left them idle (their send ring's
    /// notified word is set, as the library sets it before naming a QP),
    /// and no other: a tenant that keeps the flag set, or names idle QPs,
    /// gets no turns for them.
    #[test]
    fn notices_wake_only_the_qps_posted_to_since_they_were_parked() {
        let (c, tenant) = context(1, []);
        let mut table = RingTable::default();
        table.contexts.insert(ContextId(7), c);
        let libs: Vec<RingView> = (0..200u32).map(|qpn| send_ring(&mut table, ContextId(7), qpn)).collect();
        let mut woken = Vec::new();
        for round in 0..3 {
            // As the library does when the ring is full: the word, then the flag.
            let posted_to = [3 + round, 50, 199];
            for q in posted_to {
                libs[q as usize].aux(SQ_AUX_NOTIFIED).store(1, Ordering::SeqCst);
            }
            tenant.aux(POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
            woken.clear();
            for calls in 0.. {
                assert!(calls < 100, "a rescan of 200 QPs, 16 a call, ends");
                let before = woken.len();
                if !table.take_posted(16, &mut woken) {
                    break;
                }
                assert!(woken.len() - before <= 16);
            }
            woken.sort_unstable();
            assert_eq!(woken, posted_to, "round {round}: those posted to, once each");
            // The engine parks them.
            for q in posted_to {
                assert!(table.park_queues(q, false));
            }
        }
        // Kept set over idle QPs, or their names pushed without a post,
        // the flag and the names wake nothing.
        for i in 0..50 {
            tenant.aux(POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
            assert!(name(&tenant, i));
            woken.clear();
            table.take_posted(16, &mut woken);
            assert!(woken.is_empty(), "idle QPs woken: {woken:?}");
        }
        // A name of a QP posted to wakes it.
        libs[9].aux(SQ_AUX_NOTIFIED).store(1, Ordering::SeqCst);
        assert!(name(&tenant, 9));
        woken.clear();
        for _ in 0..100 {
            if !table.take_posted(16, &mut woken) {
                break;
            }
        }
        // (Once by its name, and by what remains of the rescans.)
        woken.dedup();
        assert_eq!(woken, [9]);
    }

    /// A flag kept set over idle QPs: each rescan that wakes nothing holds
    /// the next off, doubling up to 8 ms, so over a simulated second of
    /// 2 µs passes the engine reads a few per cent of the words it read
    /// with a rescan always under way; and a post behind the flag is
    /// still found within the longest hold-off and a rescan.
    #[test]
    fn rescans_that_wake_nothing_are_held_off_until_one_does() {
        let (mut c, tenant) = context(1, 0..1000);
        let reads = std::cell::Cell::new(0u64);
        let posted = std::cell::Cell::new(None::<u32>);
        let announced = |q: u32| {
            reads.set(reads.get() + 1);
            posted.get() == Some(q)
        };
        let pass = |i: u64| Instant(1_000_000_000 + i * 2_000);
        let mut out = Vec::new();
        let passes = 500_000;
        for i in 0..passes {
            tenant.aux(POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
            let t = c.take_posted(16, pass(i), &announced, &mut out);
            assert!(t.more, "a flag held off is work left: the engine must not sleep on it");
        }
        assert!(out.is_empty());
        let always = 16 * passes;
        assert!(reads.get() * 20 < always, "{} words read, {always} without the hold-off", reads.get());
        // A post the ring could not name: found within 8 ms and a rescan
        // (63 passes of 16), and the hold-off ends.
        posted.set(Some(500));
        let mut found = None;
        for i in passes..passes + 5_000 {
            tenant.aux(POSTED_AUX_OVERFLOW).store(1, Ordering::SeqCst);
            c.take_posted(16, pass(i), &announced, &mut out);
            if !out.is_empty() {
                found = Some(i - passes);
                break;
            }
        }
        let found = found.expect("the post is found");
        assert!(found <= 8_000 / 2 + 63, "found after {found} passes");
        assert_eq!(out, [500]);
        assert_eq!(c.rescan_backoff, Duration::ZERO, "a rescan that woke a QP ends the hold-off");
    }

    /// Indices no well-behaved tenant writes: the context is broken once,
    /// told so, and its ring is never read again.
    #[test]
    fn a_corrupt_posted_ring_breaks_its_context_once() {
        let (c, tenant) = context(1, [0x11]);
        let mut table = RingTable::default();
        table.contexts.insert(ContextId(7), c);
        tenant.scribble_producer_index(proto::POSTED_RING_CAPACITY * 3);
        let mut out = Vec::new();
        assert!(!table.take_posted(64, &mut out));
        assert_eq!(table.take_broken(), vec![ContextId(7)]);
        let c = &table.contexts[&ContextId(7)];
        assert_eq!(c.events.len(), Ok(1), "IBV_EVENT_DEVICE_FATAL is in its event ring");
        for _ in 0..10 {
            assert!(!table.take_posted(64, &mut out));
        }
        assert!(table.take_broken().is_empty(), "broken once");
        assert!(out.is_empty());
    }

    /// A tenant's budget is shared by all its contexts; another tenant's
    /// notices are taken whatever the first one wrote.
    #[test]
    fn the_notice_budget_is_per_tenant_across_its_contexts() {
        let mut table = RingTable::default();
        let mut views = Vec::new();
        // Each QP posted to, as the library says before it names it.
        let posted = |table: &mut RingTable, ctx, qpn| {
            send_ring(table, ctx, qpn).aux(SQ_AUX_NOTIFIED).store(1, Ordering::SeqCst);
        };
        for i in 0..20 {
            let (c, v) = context(1, []);
            table.contexts.insert(ContextId(i), c);
            posted(&mut table, ContextId(i), 100 + i);
            while name(&v, 100 + i) {}
            views.push(v);
        }
        let (c, v) = context(2, []);
        table.contexts.insert(ContextId(99), c);
        posted(&mut table, ContextId(99), 7);
        name(&v, 7);
        let mut out = Vec::new();
        assert!(table.take_posted(64, &mut out));
        assert_eq!(out.iter().filter(|&&q| q == 7).count(), 1, "the other tenant's notice");
        assert_eq!(out.iter().filter(|&&q| q != 7).count(), 64, "tenant 1's budget, no more");
    }

    /// A context passed over because its tenant's budget went to its
    /// other contexts, whose only notice is the overflow flag (it found
    /// its ring full, and the engine emptied the ring before the flag was
    /// set): the pass says more waits, so the engine does not sleep on it.
    #[test]
    fn a_context_passed_over_with_only_its_overflow_flag_set_is_more_to_do() {
        let mut table = RingTable::default();
        let (busy, busy_view) = context(1, [0x11]);
        let (flagged, flagged_view) = context(1, [0x22]);
        table.contexts.insert(ContextId(1), busy);
        table.contexts.insert(ContextId(2), flagged);
        let flag = flagged_view.aux(POSTED_AUX_OVERFLOW);
        let mut passed_over = 0;
        for _ in 0..8 {
            // Exactly the budget: the busy context has nothing left after.
            for _ in busy_view.len().unwrap()..64 {
                assert!(name(&busy_view, 0x11));
            }
            flag.store(1, Ordering::SeqCst);
            let mut out = Vec::new();
            let more = table.take_posted(64, &mut out);
            if flag.load(Ordering::SeqCst) != 0 {
                passed_over += 1;
                assert!(more, "the flag waits: more to do");
            }
        }
        assert!(passed_over > 0, "the turning order put the busy context first at least once");
    }

    /// A tenant that never reads its async events: every event from then
    /// on is dropped, and ten seconds of them, one every 100 µs, cost the
    /// log its first line and a few counts, not a hundred thousand lines.
    #[test]
    fn an_unread_event_ring_costs_the_log_a_few_lines() {
        let seg =
            Arc::new(Segment::create("vrdma-test", ring_bytes(4, proto::ASYNC_EVENT_SIZE) * 2).unwrap());
        let ring = |at| RingView::in_segment(seg.clone(), at, 4, proto::ASYNC_EVENT_SIZE).unwrap();
        let (bell, _) = Doorbell::pair().unwrap();
        let (event_fd, _tenant_end) = Doorbell::pair().unwrap();
        let posted_at = ring_bytes(4, proto::ASYNC_EVENT_SIZE).next_multiple_of(64);
        let c = ContextRings::new(TenantId(1000), ring(0), event_fd, Arc::new(bell), ring(posted_at));
        let mut t = RingTable::default();
        t.contexts.insert(ContextId(1), c);
        let event = AsyncEvent { event_type: vrdma_core::verbs::AsyncEventType::QpFatal, element: 0x11 };
        let log = traced(|| {
            for i in 0..100_000u64 {
                t.now = Instant(i * 100_000);
                t.async_event(ContextId(1), event);
            }
        });
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("async event ring full")).collect();
        // At once, then after 1, 3 and 7 s.
        assert_eq!(lines.len(), 4, "{:#?}", &lines[..lines.len().min(8)]);
        assert!(!lines[0].contains("more"), "the first is logged as it is: {}", lines[0]);
        assert!(lines[1].contains("(9999 more in the last 1s)"), "{}", lines[1]);
        assert!(lines.iter().all(|l| l.contains("ctx=1")), "the fields of the site are kept: {log}");
        assert_eq!(t.dropped_events, 100_000 - 4, "every dropped event is still counted");
    }
}
