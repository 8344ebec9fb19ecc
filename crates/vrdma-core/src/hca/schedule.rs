//! The engine's order of service: which QPs with work get a turn in a
//! pass, and how many of one tenant's.
//!
//! Every tenant waits for the pass it is in to end, so what bounds a pass
//! bounds everyone's latency. A pass used to walk every QP with work and
//! count only the turns that moved something against a tenant's share: a
//! tenant that woke thousands of idle QPs at once (a posted-QP ring it
//! kept overflowing, a flood of notices) made every pass walk all of them,
//! each turn cheap but thousands long, and other tenants' messages waited
//! milliseconds.
//!
//! Here each tenant's QPs queue behind each other in a queue of the
//! tenant's own, and tenants take turns. A tenant's share of a pass ends
//! after `tenant_turns` turns that did work, or [`IDLE_TURNS`] that did
//! none, or, while another tenant has QPs queued too, once its QPs have
//! moved `contended_bytes`, whichever comes first; a QP that keeps work
//! goes to the back of its tenant's queue. The bytes make the shares fair
//! and short when tenants contend (a tenant streaming over 64 QPs used to
//! hold a pass for 32 turns of 256 KiB, some 8 MiB of copying, while
//! another tenant's 8-byte message waited), and leave a tenant alone on
//! the engine its whole pass. So a pass costs O(tenants × turns) whatever any
//! tenant does, never O(QPs), and what a tenant's share left out goes
//! first in its next share. Turns that find nothing are few for a tenant
//! that names its QPs only after posting to them; they are what a tenant
//! gets for waking QPs that have nothing to do, and each costs the engine
//! a walk through that QP's rings (cache and TLB misses, some hundreds of
//! nanoseconds): so few are allowed a pass.
//!
//! A tenant's queue may hold QPs that only wait for a timer (an RNR wait,
//! a retransmission). Those cannot keep the engine awake for ever: once
//! every queued QP has had a turn since the last that did work, the
//! tenant is quiet and the engine may sleep until the earliest timer
//! those turns reported.

use std::collections::VecDeque;

use super::{IdMap, TenantId};
use crate::time::Instant;

/// What a tenant's share of a pass left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// Queued QPs may have work: run another pass soon.
    Work,
    /// Every queued QP has had a turn since the last that did work:
    /// nothing to do before this timer, if any.
    Quiet(Option<Instant>),
}

#[derive(Debug, Default)]
struct TenantQueue {
    qps: VecDeque<u32>,
    /// Turns in a row that did nothing.
    quiet: usize,
    /// The earliest timer those quiet turns reported.
    timer: Option<Instant>,
}

/// Turns that did nothing a tenant's share of a pass allows.
pub const IDLE_TURNS: u32 = 4;

/// One tenant's share of a pass: the turns it has had, the bytes it may
/// still move.
#[derive(Debug)]
pub(crate) struct Share {
    pub(crate) tenant: TenantId,
    /// QPs queued when the share began that have not had a turn: no QP
    /// has two turns in one share.
    left: usize,
    busy: u32,
    idle: u32,
    pub(crate) bytes: u64,
}

impl Share {
    /// Whether another QP may have a turn, with `busy_turns` turns that
    /// do work allowed.
    pub(crate) fn more(&self, busy_turns: u32) -> bool {
        self.left > 0 && self.busy < busy_turns && self.idle < IDLE_TURNS && self.bytes > 0
    }

    /// Counts a turn (or an entry that was no longer served: `busy`
    /// false).
    pub(crate) fn count(&mut self, busy: bool) {
        self.left = self.left.saturating_sub(1);
        if busy {
            self.busy += 1;
        } else {
            self.idle += 1;
        }
    }
}

/// The QPs the engine serves, queued per tenant; tenants in turn.
#[derive(Debug, Default)]
pub(crate) struct ServiceOrder {
    queues: IdMap<TenantId, TenantQueue>,
    /// Tenants with queued QPs, in the order they take their shares.
    tenants: VecDeque<TenantId>,
}

impl ServiceOrder {
    /// Queues `qpn` at the back of its tenant's queue.
    pub(crate) fn push(&mut self, tenant: TenantId, qpn: u32) {
        let q = self.queues.entry(tenant).or_insert_with(|| {
            self.tenants.push_back(tenant);
            TenantQueue::default()
        });
        q.qps.push_back(qpn);
        // A QP that has not had a turn yet may have work.
        q.quiet = 0;
    }

    /// A QP of `tenant` that is queued already may have work now (a frame
    /// or a change of state woke it): the tenant is not quiet.
    pub(crate) fn stir(&mut self, tenant: TenantId) {
        if let Some(q) = self.queues.get_mut(&tenant) {
            q.quiet = 0;
        }
    }

    /// Tenants waiting for their share of a pass.
    pub(crate) fn tenants_waiting(&self) -> usize {
        self.tenants.len()
    }

    /// Tenants whose queued QPs may have work: not quiet (a tenant whose
    /// QPs only wait for timers does not contend for the engine).
    pub(crate) fn tenants_contending(&self) -> usize {
        self.queues.values().filter(|q| q.quiet < q.qps.len()).count()
    }

    /// The next tenant to take its share of the pass, with `bytes` to
    /// move at most. End the share with [`Self::end_share`].
    pub(crate) fn next_share(&mut self, bytes: u64) -> Option<Share> {
        let tenant = self.tenants.pop_front()?;
        let queued = self.queues.get(&tenant).map_or(0, |q| q.qps.len());
        Some(Share { tenant, left: queued, busy: 0, idle: 0, bytes })
    }

    /// The next QP of `tenant`'s queue, taken off it.
    pub(crate) fn pop(&mut self, tenant: TenantId) -> Option<u32> {
        self.queues.get_mut(&tenant)?.qps.pop_front()
    }

    /// After `qpn`'s turn: it goes to the back of the queue (`keep`) or
    /// leaves it, and the turn counts towards the tenant's quiet.
    pub(crate) fn after_turn(
        &mut self,
        tenant: TenantId,
        qpn: u32,
        keep: bool,
        busy: bool,
        timer: Option<Instant>,
    ) {
        let Some(q) = self.queues.get_mut(&tenant) else { return };
        if keep {
            q.qps.push_back(qpn);
        }
        if busy {
            q.quiet = 0;
            q.timer = None;
        } else if keep {
            // (A QP that left the queue leaves nothing to wait for.)
            q.quiet += 1;
            if let Some(t) = timer {
                q.timer = Some(q.timer.map_or(t, |o| o.min(t)));
            }
        }
    }

    /// Ends `tenant`'s share of the pass: it goes to the back of the
    /// tenants' turn if it still has QPs queued.
    pub(crate) fn end_share(&mut self, tenant: TenantId, now: Instant) -> Left {
        let Some(q) = self.queues.get_mut(&tenant) else { return Left::Quiet(None) };
        if q.qps.is_empty() {
            self.queues.remove(&tenant);
            return Left::Quiet(None);
        }
        self.tenants.push_back(tenant);
        if q.quiet < q.qps.len() {
            return Left::Work;
        }
        let timer = q.timer;
        if timer.is_some_and(|t| t <= now) {
            // A timer came due: its QP is somewhere in the queue, so the
            // next pass goes round once more. (Not this one's `Work`: a
            // QP whose due timer its turn does not clear would keep the
            // engine spinning; the due timer wakes it at once instead.)
            q.quiet = 0;
            q.timer = None;
        }
        Left::Quiet(timer)
    }

    /// Drops the QPs `gone` says are gone from every queue.
    pub(crate) fn remove(&mut self, gone: impl Fn(u32) -> bool) {
        for q in self.queues.values_mut() {
            q.qps.retain(|&n| !gone(n));
        }
        let queues = &mut self.queues;
        queues.retain(|_, q| !q.qps.is_empty());
        self.tenants.retain(|t| queues.contains_key(t));
    }

    /// Every queued QP, tenants in turn order (entries may be stale: the
    /// caller filters them).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> impl Iterator<Item = u32> + '_ {
        self.tenants.iter().filter_map(|t| self.queues.get(t)).flat_map(|q| q.qps.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: TenantId = TenantId(1);
    const B: TenantId = TenantId(2);

    /// Runs one pass in which every turn is `busy`; returns the QPs
    /// visited, in order.
    fn pass(o: &mut ServiceOrder, turns: u32, busy: bool) -> Vec<u32> {
        let mut seen = Vec::new();
        for _ in 0..o.tenants_waiting() {
            let Some(mut share) = o.next_share(u64::MAX) else { break };
            let t = share.tenant;
            while share.more(turns) {
                let Some(q) = o.pop(t) else { break };
                seen.push(q);
                share.count(busy);
                o.after_turn(t, q, true, busy, None);
            }
            o.end_share(t, Instant::ZERO);
        }
        seen
    }

    #[test]
    fn a_pass_visits_at_most_the_share_of_each_tenant_whatever_it_queued() {
        let mut o = ServiceOrder::default();
        for q in 0..10_000 {
            o.push(A, q);
        }
        o.push(B, 99_999);
        let seen = pass(&mut o, 32, true);
        assert_eq!(seen.len(), 33, "32 of A's, then B's one");
        assert_eq!(seen.last(), Some(&99_999));
        // The next pass goes on where A's share stopped.
        let seen = pass(&mut o, 32, true);
        assert_eq!(seen[0], 32);
        // Turns that do nothing: fewer still.
        let seen = pass(&mut o, 32, false);
        assert_eq!(seen.len(), IDLE_TURNS as usize + 1);
    }

    #[test]
    fn no_qp_has_two_turns_in_one_share() {
        let mut o = ServiceOrder::default();
        o.push(A, 1);
        o.push(A, 2);
        assert_eq!(pass(&mut o, 32, true), vec![1, 2]);
    }

    #[test]
    fn a_tenant_is_quiet_only_after_every_queued_qp_had_a_turn_that_did_nothing() {
        let mut o = ServiceOrder::default();
        for q in 0..64 {
            o.push(A, q);
        }
        // (Here every queued QP is visited in a share.)
        let share = |o: &mut ServiceOrder, timer: Option<Instant>| {
            let mut share = o.next_share(u64::MAX).unwrap();
            let t = share.tenant;
            while share.left > 0 {
                let q = o.pop(t).unwrap();
                share.count(false);
                o.after_turn(t, q, true, false, timer);
            }
            o.end_share(t, Instant(10))
        };
        assert_eq!(share(&mut o, Some(Instant(40))), Left::Quiet(Some(Instant(40))));
        o.after_turn(A, 64, true, true, None);
        assert_eq!(
            share(&mut o, Some(Instant(50))),
            Left::Quiet(Some(Instant(50))),
            "a busy turn began again"
        );
        // A QP woken while queued may have work again.
        o.stir(A);
        let t = o.next_share(u64::MAX).unwrap().tenant;
        assert_eq!(o.end_share(t, Instant(10)), Left::Work);
        // A timer that came due wakes the engine at once, and its next
        // pass goes round once more.
        let mut o2 = ServiceOrder::default();
        o2.push(A, 1);
        assert_eq!(share(&mut o2, Some(Instant(5))), Left::Quiet(Some(Instant(5))), "due at 5, now is 10");
        let t = o2.next_share(u64::MAX).unwrap().tenant;
        assert_eq!(o2.end_share(t, Instant(10)), Left::Work, "not quiet until its QP had a turn again");
    }

    #[test]
    fn removed_qps_and_empty_tenants_leave_the_order() {
        let mut o = ServiceOrder::default();
        o.push(A, 1);
        o.push(B, 2);
        o.remove(|n| n == 1);
        assert_eq!(o.queued().collect::<Vec<_>>(), vec![2]);
        assert_eq!(o.tenants_waiting(), 1);
    }
}
