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
use vrdma_core::hca::IdMap as HashMap;

use vrdma_core::hca::{AsyncEvent, ContextId, CqFull, Pulled, Queues, RecvSource, TenantId};
use vrdma_core::limited_warn;
use vrdma_core::log_limit::{LogLimiter, Source};
use vrdma_core::proto::{
    self, CHANNEL_AUX_DROPPED, CQ_ARM_NONE, CQ_AUX_ARMED, CTX_AUX_ENGINE_SLEEPING, CTX_AUX_EVENTS_DROPPED,
    POSTED_AUX_OVERFLOW, SQ_AUX_NOTIFIED, SQ_AUX_RETIRED, SQ_AUX_STATE,
};
use vrdma_core::ring::{Cqe, RecvWr, SendWr, WqeError, CQE_SIZE};
use vrdma_core::time::Instant;
use vrdma_core::verbs::{QpState, WcStatus};
use vrdma_shm::{Doorbell, RingView};

/// A context's rings: async events out; doorbell and posted QPs in.
pub struct ContextRings {
    pub events: RingView,
    pub event_fd: Doorbell,
    pub doorbell: Arc<Doorbell>,
    /// The QPs the tenant names after posting (see
    /// [`proto::POSTED_RING_CAPACITY`]).
    pub posted: RingView,
    /// The context's QPs: those it may name.
    qps: HashMap<u32, ()>,
    pub tenant: TenantId,
}

impl ContextRings {
    pub fn new(
        events: RingView,
        event_fd: Doorbell,
        doorbell: Arc<Doorbell>,
        posted: RingView,
        tenant: TenantId,
    ) -> Self {
        ContextRings { events, event_fd, doorbell, posted, qps: HashMap::default(), tenant }
    }

    /// Appends the QPs of this context that its tenant named since the
    /// last call, all of them if it said it could not name them all (or
    /// scribbled on the ring). At most one ring's worth a call.
    fn take_posted(&self, out: &mut Vec<u32>) {
        // The flag before the slots: a tenant that finds the ring full
        // after this has its flag seen by the next call.
        // (Read first: a swap each pass would write the line every pass.)
        let overflow = self.posted.aux(POSTED_AUX_OVERFLOW);
        let mut all = overflow.load(Ordering::SeqCst) != 0 && overflow.swap(0, Ordering::SeqCst) != 0;
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        // A tenant names each QP at most once per re-arm, and the engine
        // re-arms a QP at most once a pass: more notices than QPs are a
        // tenant's scribbles (duplicates), left for later passes so that
        // they cannot make a pass cost more than the context's QPs.
        let most = (self.qps.len() as u32).clamp(1, self.posted.capacity());
        for _ in 0..most {
            match self.posted.try_pop(&mut slot) {
                Ok(true) => {
                    let qpn = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
                    if self.qps.contains_key(&qpn) {
                        out.push(qpn);
                    }
                }
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "tenant corrupted its posted ring; serving all of its QPs once");
                    let _ = self.posted.discard_all();
                    all = true;
                    break;
                }
            }
        }
        if all {
            out.extend(self.qps.keys().copied());
        }
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
}

/// A ring the tenant owns the producer side of.
pub struct InRing {
    pub ring: RingView,
    dead: bool,
    tenant: TenantId,
}

impl InRing {
    pub fn new(ring: RingView, tenant: TenantId) -> Self {
        InRing { ring, dead: false, tenant }
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
        match self.ring.try_pop(buf) {
            Ok(true) => Some(decode(buf)),
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
}

impl QpRings {
    pub fn new(ctx: ContextId, sq: InRing, rq: Option<InRing>) -> Self {
        QpRings { ctx, sq, rq, retired: 0, held: 0 }
    }

    /// Counts `n` more send WRs retired and publishes the count: Release,
    /// so that a client that sees it also sees the slots those WRs freed,
    /// and before the completions the core pushes next.
    fn retire(&mut self, n: u32) {
        self.retired = self.retired.wrapping_add(n);
        self.sq.ring.aux(SQ_AUX_RETIRED).store(self.retired, Ordering::Release);
    }
}

#[derive(Default)]
pub struct RingTable {
    pub contexts: HashMap<ContextId, ContextRings>,
    pub channels: HashMap<u32, Channel>,
    pub cqs: HashMap<u32, CqRing>,
    pub qps: HashMap<u32, QpRings>,
    pub srqs: HashMap<u32, InRing>,
    scratch: Vec<u8>,
    /// Completions lost to full CQs, async events lost to full rings.
    pub dropped_events: u64,
    next_channel: u32,
    /// What tenants' rings make the daemon log, limited per tenant.
    pub log: LogLimiter,
    /// The time of the engine's current pass, for `log`.
    pub now: Instant,
}

impl RingTable {
    /// A channel number no live channel has (numbers wrap after 2^32).
    pub fn free_channel_id(&mut self) -> u32 {
        loop {
            self.next_channel = self.next_channel.wrapping_add(1).max(1);
            if !self.channels.contains_key(&self.next_channel) {
                return self.next_channel;
            }
        }
    }

    /// Adds a QP's rings; its context may name it from now on.
    pub fn add_qp(&mut self, qpn: u32, rings: QpRings) {
        if let Some(c) = self.contexts.get_mut(&rings.ctx) {
            c.qps.insert(qpn, ());
        }
        self.qps.insert(qpn, rings);
    }

    pub fn remove_qp(&mut self, qpn: u32) {
        if let Some(q) = self.qps.remove(&qpn) {
            if let Some(c) = self.contexts.get_mut(&q.ctx) {
                c.qps.remove(&qpn);
            }
        }
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

    fn discard(&mut self, qpn: u32) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            // What is dropped from the ring is retired; so is anything the
            // core still held (it retires its WRs before a reset, so that is
            // nothing): the retired count then equals the producer index,
            // and the client has nothing outstanding.
            let dropped = q.sq.ring.discard_all().unwrap_or(0);
            let held = std::mem::take(&mut q.held);
            q.retire(dropped.wrapping_add(held));
            if let Some(rq) = &q.rq {
                let _ = rq.ring.discard_all();
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
        match cq.ring.try_push_bytes(&slot) {
            Ok(true) => {
                self.notify_channel(cqn, cqe);
                Ok(())
            }
            Ok(false) | Err(_) => {
                self.dropped_events += 1;
                Err(CqFull)
            }
        }
    }

    fn async_event(&mut self, ctx: ContextId, event: AsyncEvent) {
        tracing::debug!(ctx = ctx.0, ?event, "async event");
        let Some(c) = self.contexts.get(&ctx) else { return };
        let mut slot = [0u8; proto::ASYNC_EVENT_SIZE];
        proto::encode_async_event(&event, &mut slot);
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

    fn take_posted(&mut self, out: &mut Vec<u32>) {
        for c in self.contexts.values() {
            c.take_posted(out);
        }
    }

    fn named_since_parked(&mut self, qpn: u32) -> bool {
        self.qps.get(&qpn).is_some_and(|q| q.sq.ring.aux(SQ_AUX_NOTIFIED).load(Ordering::SeqCst) != 0)
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

    /// A tenant may write anything into its posted ring: a ring full of
    /// the same QP's number costs a pass no more than the context's QPs.
    #[test]
    fn a_posted_ring_of_duplicates_costs_no_more_than_the_contexts_qps() {
        let len = ring_bytes(proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE);
        let seg = Arc::new(Segment::create("vrdma-test", len).unwrap());
        let view =
            || RingView::in_segment(seg.clone(), 0, proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE);
        let other = Arc::new(Segment::create("vrdma-test", len).unwrap());
        let events =
            RingView::in_segment(other, 0, proto::POSTED_RING_CAPACITY, proto::POSTED_SLOT_SIZE).unwrap();
        let tenant = view().unwrap();
        let (bell, _) = Doorbell::pair().unwrap();
        let (event_fd, _) = Doorbell::pair().unwrap();
        let mut c = ContextRings::new(events, event_fd, Arc::new(bell), view().unwrap(), TenantId(1000));
        c.qps.insert(0x11, ());
        let mut slot = [0u8; proto::POSTED_SLOT_SIZE];
        slot[..4].copy_from_slice(&0x11u32.to_le_bytes());
        while tenant.try_push_bytes(&slot).unwrap() {}
        let mut out = Vec::new();
        c.take_posted(&mut out);
        assert!(out.len() <= 1, "{} notices taken for a context of one QP", out.len());
        assert_eq!(out, vec![0x11]);
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
        let c = ContextRings::new(ring(0), event_fd, Arc::new(bell), ring(posted_at), TenantId(1000));
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

    /// The log lines of `f`, at info level and above.
    fn traced(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let out = lines.clone();
        let sub = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || out.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            // Other tests' threads may have met the callsites first, while
            // no subscriber wanted them, and cached that: ask again.
            tracing::callsite::rebuild_interest_cache();
            f()
        });
        let b = lines.0.lock().unwrap().clone();
        String::from_utf8(b).unwrap()
    }
}
