//! What the engine counts per tenant, for the daemon's metrics endpoint
//! and `vrdma stat`.
//!
//! The counters live in the [`Hca`](super::Hca), which the engine thread
//! owns: plain integers, no lock, no atomic, no allocation per message
//! (a tenant's entry is made once). A scrape copies them out through the
//! engine's call mechanism ([`super::Hca::tenant_reports`]).
//!
//! Time is read from the clock the driver gives ([`super::Hca::set_clock`])
//! once per turn of a QP (and once per tenant's share of a pass), never
//! per message. Without a clock (the core's tests) the pass's time is
//! used, and the times below stay 0.
//!
//! - **Engine time** of a tenant: the time from the start to the end of
//!   each turn its QPs had in the engine's passes (running their send
//!   queues, flushing them). Frames from other hosts' daemons handled for
//!   the tenant's QPs are not in it.
//! - **Throttled time** of a tenant: for each share of a pass that ended
//!   while the tenant still had QPs that may have work (its share of
//!   turns or bytes was spent), the time from the end of that share to the
//!   start of the tenant's next one: the time it had work pending and the
//!   engine was serving others (or its own bookkeeping) instead, or its
//!   rate limit held it back (passed over until its bucket refills: see
//!   `schedule`; `throttled_shares` counts those shares and passes).
//! - **Message latency**: for each send work request that completes with a
//!   completion written, the time from the start of the turn in which the
//!   engine took it from the send queue to the end of the turn in which it
//!   wrote the completion (over a link: to the moment of the pass in which
//!   the acknowledgement or response arrived). Recorded in fixed log2
//!   buckets ([`Histogram`]).

use serde::{Deserialize, Serialize};

use super::{IdMap, LinkId, TenantId};
use crate::time::Instant;

/// Buckets of a [`Histogram`] with a finite bound: the bound of bucket
/// `i` is `2^(10 + i)` ns (1.024 µs, 2.048 µs, ... about 8.6 s); one more
/// bucket holds everything above.
pub const LATENCY_BUCKETS: usize = 24;

/// The upper bound, in nanoseconds, of finite bucket `i`.
pub fn bucket_bound_ns(i: usize) -> u64 {
    1u64 << (10 + i)
}

/// A latency histogram in fixed log2 buckets (not cumulative: the
/// Prometheus form adds them up).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram {
    /// `counts[i]`: samples above bucket `i - 1`'s bound and at most
    /// bucket `i`'s; `counts[LATENCY_BUCKETS]`: above every bound.
    pub counts: [u64; LATENCY_BUCKETS + 1],
    pub sum_ns: u64,
    pub count: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: [0; LATENCY_BUCKETS + 1], sum_ns: 0, count: 0 }
    }
}

impl Histogram {
    /// The bucket a sample of `ns` falls in.
    pub fn bucket_of(ns: u64) -> usize {
        if ns <= bucket_bound_ns(0) {
            return 0;
        }
        let ceil_log2 = (64 - (ns - 1).leading_zeros()) as usize;
        (ceil_log2 - 10).min(LATENCY_BUCKETS)
    }

    pub fn record(&mut self, ns: u64) {
        self.counts[Self::bucket_of(ns)] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.count += 1;
    }

    /// The upper bound, in nanoseconds, of the bucket the `q`-quantile
    /// (0 to 1) falls in: the quantile is at most that (and above the
    /// bucket below's bound). `u64::MAX` when it falls above every bound;
    /// `None` without samples. The buckets double, so this overstates by
    /// up to 2x: a figure for a person, not a benchmark.
    pub fn quantile_bound_ns(&self, q: f64) -> Option<u64> {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return None;
        }
        // The rank of the sample wanted, 1-based: at least the first.
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(if i < LATENCY_BUCKETS { bucket_bound_ns(i) } else { u64::MAX });
            }
        }
        Some(u64::MAX)
    }
}

/// One tenant's counters since the daemon started (or since the tenant
/// was last forgotten, see [`MAX_TRACKED`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantCounters {
    /// Send work requests of the tenant's QPs that completed successfully
    /// (signaled or not), and their message bytes (an RDMA read's are the
    /// bytes read).
    pub messages_sent: u64,
    pub bytes_sent: u64,
    /// Receive work requests that completed successfully, and their bytes.
    pub messages_received: u64,
    pub bytes_received: u64,
    /// Completions written with a status other than success (flushes
    /// included).
    pub completions_error: u64,
    /// Turns its QPs had, and their engine time (see the module's doc).
    pub turns: u64,
    pub engine_ns: u64,
    /// See the module's doc.
    pub throttled_ns: u64,
    /// Times its rate limit ended a share or passed the tenant over with
    /// work pending.
    #[serde(default)]
    pub throttled_shares: u64,
    /// Time its requests on links to other hosts waited for its rate limit
    /// while its QPs there may have had frames to send, summed over the
    /// links (see `remote::LinkThrottle`).
    #[serde(default)]
    pub link_throttled_ns: u64,
    pub latency: Histogram,
    /// Turns of its QPs in which a sweep found work nothing had woken
    /// (its share of [`super::Hca::missed_wakeups`]).
    #[serde(default)]
    pub missed_wakeups: u64,
    /// The end of a share that left work, not yet followed by another.
    #[serde(skip)]
    waiting_since: Option<Instant>,
}

/// What a scrape sees of a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantReport {
    pub tenant: TenantId,
    pub objects: u32,
    pub registered_bytes: u64,
    pub counters: TenantCounters,
}

/// Tenants whose counters are kept at most; past it, those that hold no
/// objects are forgotten. The daemon admits `max_tenants` at once, so
/// this only bounds tenants that came and went.
pub const MAX_TRACKED: usize = 4096;

/// The clock the driver gives the core.
pub type Clock = Box<dyn Fn() -> Instant + Send>;

#[derive(Default)]
pub(crate) struct Metrics {
    pub(crate) tenants: IdMap<TenantId, TenantCounters>,
    pub(crate) clock: Option<Clock>,
    /// When the engine took each send WR that completed in the turn under
    /// way (recorded at the turn's end: one clock read for them all).
    pending: Vec<Instant>,
    /// The start of the turn under way: when its WRs were taken.
    pub(crate) turn_start: Instant,
    /// Retransmissions per link (see [`super::Hca::link_retransmits`]).
    pub(crate) link_retransmits: IdMap<LinkId, u64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("tenants", &self.tenants.len()).finish()
    }
}

impl Metrics {
    /// Now on the driver's clock, or `now` without one.
    pub(crate) fn clock_or(&self, now: Instant) -> Instant {
        self.clock.as_ref().map_or(now, |c| c())
    }

    pub(crate) fn tenant(
        &mut self,
        t: TenantId,
        holds_objects: impl Fn(TenantId) -> bool,
    ) -> &mut TenantCounters {
        if !self.tenants.contains_key(&t) && self.tenants.len() >= MAX_TRACKED {
            self.tenants.retain(|&k, _| holds_objects(k));
        }
        self.tenants.entry(t).or_default()
    }

    /// A send WR taken at `taken` completed with a completion written in
    /// the turn under way.
    pub(crate) fn completed_in_turn(&mut self, taken: Instant) {
        self.pending.push(taken);
    }

    /// The turn that began at `self.turn_start` ended at `end`.
    pub(crate) fn turn_end(c: &mut TenantCounters, pending: &mut Vec<Instant>, start: Instant, end: Instant) {
        c.turns += 1;
        c.engine_ns += end.saturating_since(start).as_nanos() as u64;
        for taken in pending.drain(..) {
            c.latency.record(end.saturating_since(taken).as_nanos() as u64);
        }
    }

    pub(crate) fn retransmitted(&mut self, link: Option<LinkId>) {
        if let Some(l) = link {
            *self.link_retransmits.entry(l).or_default() += 1;
        }
    }

    pub(crate) fn take_pending(&mut self) -> Vec<Instant> {
        std::mem::take(&mut self.pending)
    }

    pub(crate) fn put_pending(&mut self, v: Vec<Instant>) {
        self.pending = v;
    }
}

impl TenantCounters {
    /// Its share of a pass begins at `at`.
    pub(crate) fn share_start(&mut self, at: Instant) {
        if let Some(w) = self.waiting_since.take() {
            self.throttled_ns += at.saturating_since(w).as_nanos() as u64;
        }
    }

    /// Its share ended at `at`, leaving work.
    pub(crate) fn left_work(&mut self, at: Instant) {
        self.waiting_since = Some(at);
    }

    pub(crate) fn sent(&mut self, bytes: u64) {
        self.messages_sent += 1;
        self.bytes_sent += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_fall_in_the_smallest_bucket_whose_bound_holds_them() {
        assert_eq!(Histogram::bucket_of(0), 0);
        assert_eq!(Histogram::bucket_of(1024), 0);
        assert_eq!(Histogram::bucket_of(1025), 1);
        assert_eq!(Histogram::bucket_of(2048), 1);
        assert_eq!(Histogram::bucket_of(2049), 2);
        assert_eq!(Histogram::bucket_of(bucket_bound_ns(LATENCY_BUCKETS - 1)), LATENCY_BUCKETS - 1);
        assert_eq!(Histogram::bucket_of(bucket_bound_ns(LATENCY_BUCKETS - 1) + 1), LATENCY_BUCKETS);
        assert_eq!(Histogram::bucket_of(u64::MAX), LATENCY_BUCKETS);
        let mut h = Histogram::default();
        for ns in [5, 1500, 1500, u64::MAX] {
            h.record(ns);
        }
        assert_eq!((h.counts[0], h.counts[1], h.counts[LATENCY_BUCKETS], h.count), (1, 2, 1, 4));
        assert_eq!(h.sum_ns, u64::MAX, "the sum saturates");
    }

    #[test]
    fn a_quantile_is_bounded_by_the_bucket_it_falls_in() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile_bound_ns(0.5), None, "no samples");
        for _ in 0..98 {
            h.record(1500);
        }
        h.record(5000);
        h.record(u64::MAX);
        assert_eq!(h.quantile_bound_ns(0.0), Some(2048), "the first sample at least");
        assert_eq!(h.quantile_bound_ns(0.5), Some(2048));
        assert_eq!(h.quantile_bound_ns(0.98), Some(2048));
        assert_eq!(h.quantile_bound_ns(0.99), Some(8192));
        assert_eq!(h.quantile_bound_ns(1.0), Some(u64::MAX), "above every bound");
    }

    #[test]
    fn throttled_time_runs_from_a_share_that_left_work_to_the_next_share() {
        let mut c = TenantCounters::default();
        c.share_start(Instant(100));
        assert_eq!(c.throttled_ns, 0, "no share left work before");
        c.left_work(Instant(200));
        c.share_start(Instant(350));
        assert_eq!(c.throttled_ns, 150);
        c.share_start(Instant(1000));
        assert_eq!(c.throttled_ns, 150, "the last share left nothing");
    }
}
