//! Log lines that tenants and strangers cannot flood.
//!
//! Much of what the daemon logs is caused by someone it does not trust: a
//! tenant that scribbles on its rings or never reads its events, a peer
//! daemon whose link flaps, a stranger that connects to the transport's
//! port with garbage. One line per such event would let any of them fill
//! the disk and bury everything else. So each such message goes through a
//! [`LogLimiter`], keyed by who caused it ([`Source`]) and which message it
//! is (its text, a `&'static str`): the first occurrence is logged at
//! once; later ones are only counted, and the count is logged as one line
//! ("… (N more in the last 4s)") after an interval that doubles from
//! [`FIRST_INTERVAL`] up to [`MAX_INTERVAL`]. A steady flood therefore
//! costs about a dozen lines in its first ten minutes and six an hour after.
//!
//! Memory is bounded too: at most [`MAX_ENTRIES`] keys are tracked. An
//! entry quiet for [`MAX_INTERVAL`] is forgotten (its next occurrence is a
//! first one again); while every entry is in use, a new source is counted
//! under [`Source::Anyone`] for that message, so random source addresses
//! cannot grow the table nor buy one line each.
//!
//! Like the rest of the core, the limiter has no clock: the caller passes
//! the time. Use it through [`limited_warn!`](crate::limited_warn) and its
//! siblings; [`LogLimiter::sweep`] logs the counts of floods that stopped.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use crate::hca::{LinkId, TenantId};
use crate::time::Instant;

/// The interval before the first count is logged.
pub const FIRST_INTERVAL: Duration = Duration::from_secs(1);
/// The longest interval between two lines of one key.
pub const MAX_INTERVAL: Duration = Duration::from_secs(600);
/// Keys tracked at most by one limiter.
pub const MAX_ENTRIES: usize = 1024;

/// Who caused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    Tenant(TenantId),
    /// A peer daemon, by its link.
    Link(LinkId),
    /// A remote host by address (a peer daemon or a stranger).
    Address(IpAddr),
    /// No one in particular, or more sources than the limiter tracks.
    Anyone,
}

/// A line to log now: the count of occurrences left out since the last
/// line of the same key, over how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub suppressed: u64,
    pub over: Duration,
}

/// The levels a limited line may have (a tracing level is a constant at
/// each call site; the limiter keeps it only for [`LogLimiter::sweep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Error,
    Warn,
    Info,
}

#[derive(Debug)]
struct Entry {
    level: Level,
    /// When the last line of this key was logged.
    logged: Instant,
    /// When the next line may be.
    next: Instant,
    interval: Duration,
    /// Occurrences since `logged`, not logged.
    suppressed: u64,
    last_seen: Instant,
}

type Key = (Source, &'static str);

/// See the module's doc.
#[derive(Debug)]
pub struct LogLimiter {
    entries: HashMap<Key, Entry>,
    cap: usize,
    /// Occurrences left out, per message, since the limiter was made.
    suppressed: BTreeMap<&'static str, u64>,
    /// Every occurrence, logged or not, per message (the metrics' count
    /// of rejected and rate-limited inputs). Bounded by the messages,
    /// which are `&'static str`s in the code.
    occurred: BTreeMap<&'static str, u64>,
    next_sweep: Instant,
    /// When a full table may next be searched for quiet keys.
    next_prune: Instant,
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter::with_capacity(MAX_ENTRIES)
    }
}

impl LogLimiter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A limiter that tracks at most `cap` keys (at least one).
    pub fn with_capacity(cap: usize) -> Self {
        LogLimiter {
            entries: HashMap::new(),
            cap: cap.max(1),
            suppressed: BTreeMap::new(),
            occurred: BTreeMap::new(),
            next_sweep: Instant::ZERO,
            next_prune: Instant::ZERO,
        }
    }

    /// Whether the occurrence of `message` caused by `source` at `now` is
    /// to be logged, and if so with what count. Counted otherwise.
    pub fn admit(
        &mut self,
        level: Level,
        source: Source,
        message: &'static str,
        now: Instant,
    ) -> Option<Admitted> {
        *self.occurred.entry(message).or_default() += 1;
        let mut key = (source, message);
        if self.entries.len() >= self.cap && !self.entries.contains_key(&key) {
            if now >= self.next_prune {
                self.next_prune = now + FIRST_INTERVAL;
                self.forget_quiet(now);
            }
            if self.entries.len() >= self.cap {
                key = (Source::Anyone, message);
            }
        }
        let full = self.entries.len() >= self.cap;
        match self.entries.get_mut(&key) {
            // Quiet for long, with nothing pending: a first occurrence again.
            Some(e) if e.suppressed == 0 && now.saturating_since(e.last_seen) >= MAX_INTERVAL => {}
            Some(e) => {
                e.last_seen = now;
                if now < e.next {
                    e.suppressed += 1;
                    *self.suppressed.entry(message).or_default() += 1;
                    return None;
                }
                return Some(Self::line(e, now));
            }
            None if full => {
                // Full of live keys, even for `Anyone`: the oldest goes.
                let oldest = self.entries.iter().min_by_key(|(_, e)| e.last_seen).map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.drop_entry(k);
                }
            }
            None => {}
        }
        self.first(key, level, now)
    }

    /// A key's first occurrence (or its first after it went quiet).
    fn first(&mut self, key: Key, level: Level, now: Instant) -> Option<Admitted> {
        let e = Entry {
            level,
            logged: now,
            next: now + FIRST_INTERVAL,
            interval: FIRST_INTERVAL,
            suppressed: 0,
            last_seen: now,
        };
        self.entries.insert(key, e);
        Some(Admitted { suppressed: 0, over: Duration::ZERO })
    }

    /// Logs now: the count so far, and the interval doubles.
    fn line(e: &mut Entry, now: Instant) -> Admitted {
        let a =
            Admitted { suppressed: std::mem::take(&mut e.suppressed), over: now.saturating_since(e.logged) };
        e.logged = now;
        e.interval = (e.interval * 2).min(MAX_INTERVAL);
        e.next = now + e.interval;
        a
    }

    /// Removes entries with nothing pending that have been quiet for
    /// [`MAX_INTERVAL`].
    fn forget_quiet(&mut self, now: Instant) {
        self.entries.retain(|_, e| e.suppressed > 0 || now.saturating_since(e.last_seen) < MAX_INTERVAL);
    }

    /// Removes an entry, logging what it had left out.
    fn drop_entry(&mut self, key: Key) {
        if let Some(mut e) = self.entries.remove(&key) {
            if e.suppressed > 0 {
                let now = e.last_seen;
                emit_count(key, e.level, Self::line(&mut e, now));
            }
        }
    }

    /// Logs the counts that are due of keys whose flood stopped (a count
    /// is otherwise only logged with the key's next occurrence), and
    /// forgets quiet keys. Does nothing more than once a second, so it can
    /// be called every pass.
    pub fn sweep(&mut self, now: Instant) {
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + FIRST_INTERVAL;
        for (k, e) in self.entries.iter_mut() {
            if e.suppressed > 0 && now >= e.next {
                emit_count(*k, e.level, Self::line(e, now));
            }
        }
        self.forget_quiet(now);
    }

    /// Occurrences left out so far, per message.
    pub fn suppressed(&self) -> &BTreeMap<&'static str, u64> {
        &self.suppressed
    }

    /// Occurrences so far, logged or not, per message.
    pub fn occurred(&self) -> &BTreeMap<&'static str, u64> {
        &self.occurred
    }

    /// Occurrences left out so far, of every message.
    pub fn suppressed_total(&self) -> u64 {
        self.suppressed.values().sum()
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The line of a count logged without an occurrence to carry it.
fn emit_count((source, message): Key, level: Level, a: Admitted) {
    let (n, over) = (a.suppressed, a.over);
    match level {
        Level::Error => tracing::error!(?source, "{message} ({n} more in the last {over:.0?})"),
        Level::Warn => tracing::warn!(?source, "{message} ({n} more in the last {over:.0?})"),
        Level::Info => tracing::info!(?source, "{message} ({n} more in the last {over:.0?})"),
    }
}

#[doc(hidden)]
pub use tracing as __tracing;

/// Logs `message` (a `&'static str`, also the key's message) with
/// `fields` at WARN, unless `limiter` (a [`LogLimiter`], or anything that
/// derefs to one mutably) says that `source` made it too often by `now`:
///
/// ```
/// # use vrdma_core::{limited_warn, log_limit::{LogLimiter, Source}, hca::TenantId, time::Instant};
/// # let (mut log, now, cq) = (LogLimiter::new(), Instant::ZERO, 7);
/// limited_warn!(log, Source::Tenant(TenantId(1000)), now, "completion channel full: event dropped", cq);
/// ```
#[macro_export]
macro_rules! limited_warn {
    ($limiter:expr, $source:expr, $now:expr, $message:expr $(, $($field:tt)+)?) => {
        $crate::__limited!(warn, Warn, $limiter, $source, $now, $message $(, $($field)+)?)
    };
}

/// [`limited_warn!`] at ERROR.
#[macro_export]
macro_rules! limited_error {
    ($limiter:expr, $source:expr, $now:expr, $message:expr $(, $($field:tt)+)?) => {
        $crate::__limited!(error, Error, $limiter, $source, $now, $message $(, $($field)+)?)
    };
}

/// [`limited_warn!`] at INFO.
#[macro_export]
macro_rules! limited_info {
    ($limiter:expr, $source:expr, $now:expr, $message:expr $(, $($field:tt)+)?) => {
        $crate::__limited!(info, Info, $limiter, $source, $now, $message $(, $($field)+)?)
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __limited {
    ($mac:ident, $level:ident, $limiter:expr, $source:expr, $now:expr, $message:expr
     $(, $($field:tt)+)?) => {{
        let message: &'static str = $message;
        // A statement of its own: a lock guard in `$limiter` is released
        // before the line is written.
        let admitted = $limiter.admit($crate::log_limit::Level::$level, $source, message, $now);
        if let Some(a) = admitted {
            if a.suppressed == 0 {
                $crate::log_limit::__tracing::$mac!($($($field)+,)? "{}", message);
            } else {
                $crate::log_limit::__tracing::$mac!(
                    $($($field)+,)? suppressed = a.suppressed,
                    "{} ({} more in the last {:.0?})", message, a.suppressed, a.over
                );
            }
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &str = "a message";
    const T: Source = Source::Tenant(TenantId(1000));

    fn at(ms: u64) -> Instant {
        Instant(ms * 1_000_000)
    }

    /// Feeds one occurrence every `step` ms for `total` ms; the times (ms)
    /// and counts of the lines admitted.
    fn flood(l: &mut LogLimiter, src: Source, step: u64, total: u64) -> Vec<(u64, u64)> {
        (0..total / step)
            .map(|i| i * step)
            .filter_map(|t| l.admit(Level::Warn, src, M, at(t)).map(|a| (t, a.suppressed)))
            .collect()
    }

    #[test]
    fn the_first_occurrence_is_logged_then_counts_at_doubling_intervals() {
        let mut l = LogLimiter::new();
        let lines = flood(&mut l, T, 10, 16_000);
        // At 0, then after 1, 2, 4, 8 s: 1 + 2 + 4 + 8 = 15.
        let times: Vec<u64> = lines.iter().map(|l| l.0).collect();
        assert_eq!(times, [0, 1_000, 3_000, 7_000, 15_000]);
        let counts: Vec<u64> = lines.iter().map(|l| l.1).collect();
        assert_eq!(counts, [0, 99, 199, 399, 799], "each line counts what was left out since the last");
        assert_eq!(l.suppressed()[M], 99 + 199 + 399 + 799 + 99);
        assert_eq!(l.occurred()[M], 1600, "every occurrence is counted");
    }

    #[test]
    fn a_steady_flood_gets_a_bounded_number_of_lines() {
        let mut l = LogLimiter::new();
        // One a millisecond for two hours: 7.2 million occurrences.
        let lines = (0..7_200_000u64).filter(|&t| l.admit(Level::Warn, T, M, at(t)).is_some()).count();
        // 10 lines until the interval reaches its cap, then one per 10 minutes.
        assert!(lines <= 10 + 12 + 1, "{lines} lines");
        assert!(lines >= 10 + 10, "{lines} lines: the counts must keep coming");
    }

    #[test]
    fn sources_and_messages_are_limited_apart() {
        let mut l = LogLimiter::new();
        let u = Source::Tenant(TenantId(1001));
        assert!(l.admit(Level::Warn, T, M, at(0)).is_some());
        assert!(l.admit(Level::Warn, T, M, at(1)).is_none());
        assert!(l.admit(Level::Warn, u, M, at(2)).is_some(), "another tenant");
        assert!(l.admit(Level::Warn, T, "another message", at(3)).is_some());
    }

    #[test]
    fn a_key_quiet_for_the_longest_interval_starts_again() {
        let mut l = LogLimiter::new();
        flood(&mut l, T, 10, 16_000);
        // The next line would be 16 s after 15 s; a quiet key with nothing
        // pending is forgotten after the longest interval.
        let later = 16_000 + MAX_INTERVAL.as_millis() as u64;
        assert_eq!(
            l.admit(Level::Warn, T, M, at(later)),
            Some(Admitted { suppressed: 100 - 1, over: Duration::from_millis(later - 15_000) }),
            "pending counts are not lost"
        );
        assert!(l.admit(Level::Warn, T, M, at(later + 1)).is_none());
        let much_later = later + 1 + MAX_INTERVAL.as_millis() as u64;
        l.sweep(at(much_later));
        assert_eq!(
            l.admit(Level::Warn, T, M, at(much_later + 1)).map(|a| a.suppressed),
            Some(0),
            "a first occurrence again"
        );
    }

    #[test]
    fn sweep_logs_the_count_of_a_flood_that_stopped_and_forgets_it() {
        let mut l = LogLimiter::new();
        flood(&mut l, T, 100, 500);
        let pending = |l: &LogLimiter| l.entries.values().next().map(|e| (e.suppressed, e.interval));
        l.sweep(at(500));
        assert_eq!(pending(&l), Some((4, FIRST_INTERVAL)), "not due yet");
        l.sweep(at(1_400));
        assert_eq!(pending(&l), Some((4, FIRST_INTERVAL)), "a sweep runs once a second at most");
        l.sweep(at(1_500));
        assert_eq!(pending(&l), Some((0, FIRST_INTERVAL * 2)), "logged by the sweep");
        l.sweep(at(2_500));
        assert_eq!(l.len(), 1, "not quiet for long yet");
        l.sweep(at(400 + MAX_INTERVAL.as_millis() as u64));
        assert!(l.is_empty(), "a quiet key is forgotten");
        assert_eq!(l.suppressed()[M], 4);
    }

    #[test]
    fn memory_stays_bounded_under_many_sources_and_extra_sources_share_one_line() {
        let mut l = LogLimiter::with_capacity(64);
        let addr = |i: u32| {
            Source::Address(IpAddr::from(
                (0xfd00_0000_0000_0000_0000_0000_0000_0000u128 | i as u128).to_be_bytes(),
            ))
        };
        let mut lines = 0;
        for i in 0..100_000u32 {
            lines += l.admit(Level::Warn, addr(i), M, at(u64::from(i) / 10)).is_some() as u32;
            assert!(l.len() <= 64);
        }
        // 63 sources have a line each, then `Anyone` a line and its counts
        // (10 s of flood: lines at 0, 1, 3, 7 s after it starts).
        assert!(lines <= 64 + 4, "{lines} lines from 100000 strangers");
        assert!(l.entries.contains_key(&(Source::Anyone, M)));
        // Once the table's sources are quiet, new ones get their own lines.
        let later = 10_000 + MAX_INTERVAL.as_millis() as u64;
        assert_eq!(l.admit(Level::Warn, addr(1 << 30), M, at(later)).map(|a| a.suppressed), Some(0));
        assert!(l.entries.contains_key(&(addr(1 << 30), M)));
    }

    #[test]
    fn a_full_table_of_live_keys_drops_the_oldest() {
        let mut l = LogLimiter::with_capacity(2);
        assert!(l.admit(Level::Warn, T, "one", at(0)).is_some());
        assert!(l.admit(Level::Warn, T, "two", at(1)).is_some());
        // Full of live keys: the third message is counted under `Anyone`,
        // which takes the oldest key's place.
        assert!(l.admit(Level::Warn, T, "three", at(2)).is_some());
        assert_eq!(l.len(), 2);
        assert!(l.entries.contains_key(&(Source::Anyone, "three")));
        assert!(!l.entries.contains_key(&(T, "one")));
    }

    #[test]
    fn the_macro_logs_through_a_lock_guard_and_adds_the_count() {
        let l = std::sync::Mutex::new(LogLimiter::new());
        for ms in [0, 10, 20, 1_000] {
            crate::limited_warn!(l.lock().unwrap(), T, at(ms), M, qpn = 7);
        }
        assert_eq!(l.lock().unwrap().suppressed()[M], 2);
    }
}
