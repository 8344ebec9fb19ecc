//! The progress thread's timing, with the time passed in: how long it
//! waits between looks, how long it keeps looking after its list emptied,
//! how often it checks that the daemon is still there. Its own state (no
//! lock: only the thread has it), kept apart so that tests can play it
//! with made-up `Instant`s (`progress/tests.rs`).

use std::time::{Duration, Instant};

/// How long the thread keeps looking after its list emptied: a steady
/// exchange adds connections to its list without waking it.
pub(crate) const LINGER: Duration = Duration::from_millis(20);

/// How often the thread looks while every connection on its list only
/// waits for its peer's answer ([`crate::credit`]), which wakes it.
pub(crate) const QUIET_LOOK: Duration = Duration::from_secs(1);

/// Looks at a non-empty list between two checks that the daemon is
/// still there.
const DAEMON_CHECK: u32 = 1024;

/// The thread's pace.
pub(crate) struct Pace {
    /// The last look that found the list non-empty.
    last_busy: Instant,
    /// Looks at a non-empty list (wrapping).
    rounds: u32,
}

impl Pace {
    /// A thread started at `now`: it lingers from there.
    pub(crate) fn new(now: Instant) -> Self {
        Pace { last_busy: now, rounds: 0 }
    }

    /// Whether the thread stopped lingering at `now` (more than
    /// [`LINGER`] since its last look at a non-empty list).
    pub(crate) fn lingered(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_busy) > LINGER
    }

    /// How long the thread waits for answers before its next look: the
    /// slow look where the list is quiet (`ProgressList::quiet`), else
    /// `interval`.
    pub(crate) fn wait(quiet: bool, interval: Duration) -> Duration {
        if quiet {
            QUIET_LOOK
        } else {
            interval
        }
    }

    /// A look at a non-empty list at `now`; returns whether the caller
    /// checks that the daemon is still there (every [`DAEMON_CHECK`]th).
    pub(crate) fn busy(&mut self, now: Instant) -> bool {
        self.last_busy = now;
        self.rounds = self.rounds.wrapping_add(1);
        self.rounds.is_multiple_of(DAEMON_CHECK)
    }
}
