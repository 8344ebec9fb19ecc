//! Where the engine's time went when it came back late: a debug line
//! when one turn of its loop (a pass, the callers let in, a yield, a
//! sleep) took far longer than it should, saying which part. Links time
//! out and QPs run out of retries when an engine does not turn, and
//! without this a log cannot tell an engine held up by a caller holding
//! its lock, by a long pass or by the scheduler from frames held up in
//! the network. (On a loaded 2-vCPU machine it showed whole daemons
//! runnable and not run for up to 1.9 s: the time was in a yield, in a
//! sleep long past its timeout, or in a pass that was preempted; see
//! `docs/migration.md`, "A loaded machine".)
//!
//! At most one line a second, the ones left out counted in the next: a
//! tenant's slow control calls hold the lock, so a tenant can make the
//! daemon log this.

use std::time::{Duration, Instant};

/// A turn of the engine's loop late by this much is logged, with its parts.
const LATE: Duration = Duration::from_millis(50);
/// Lines at most this often.
const EVERY: Duration = Duration::from_secs(1);

/// A part of a turn.
#[derive(Debug, Clone, Copy)]
pub(super) enum Part {
    Pass,
    Yield,
    Sleep,
    /// Control calls run between passes, or waited for (the state's lock).
    Callers,
}

/// What one turn of the engine's loop spent, and the rate limit of the
/// lines about it.
#[derive(Debug)]
pub(super) struct Turns {
    began: Instant,
    parts: [Duration; 4],
    /// The longest this turn's sleep was to last.
    planned: Option<Duration>,
    last_line: Option<Instant>,
    left_out: u64,
}

/// A late turn, as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Late {
    pub total: Duration,
    pub pass: Duration,
    pub callers: Duration,
    pub yielded: Duration,
    pub slept: Duration,
    pub planned: Option<Duration>,
    /// Late turns not logged since the last line.
    pub left_out: u64,
}

impl Turns {
    pub(super) fn new(now: Instant) -> Turns {
        Turns { began: now, parts: [Duration::ZERO; 4], planned: None, last_line: None, left_out: 0 }
    }

    /// `part` took `d`.
    pub(super) fn spent(&mut self, part: Part, d: Duration) {
        self.parts[part as usize] += d;
    }

    /// `part` ran from `since` until now.
    pub(super) fn since(&mut self, part: Part, since: Instant) {
        self.spent(part, since.elapsed());
    }

    /// This turn's sleep was to last `d` at most.
    pub(super) fn planned_sleep(&mut self, d: Duration) {
        self.planned = Some(d);
    }

    /// Ends the turn at `now` and starts the next; the turn if it was late
    /// (a sleep counts only where it outlasted its timeout) and a line is
    /// due.
    pub(super) fn end(&mut self, now: Instant) -> Option<Late> {
        let total = now.saturating_duration_since(self.began);
        let slept = self.parts[Part::Sleep as usize];
        let overslept = slept.saturating_sub(self.planned.unwrap_or(Duration::MAX));
        let late = total.saturating_sub(slept) + overslept;
        let out = if late < LATE {
            None
        } else if self.last_line.is_some_and(|t| now.saturating_duration_since(t) < EVERY) {
            self.left_out += 1;
            None
        } else {
            self.last_line = Some(now);
            Some(Late {
                total,
                pass: self.parts[Part::Pass as usize],
                callers: self.parts[Part::Callers as usize],
                yielded: self.parts[Part::Yield as usize],
                slept,
                planned: self.planned,
                left_out: std::mem::take(&mut self.left_out),
            })
        };
        *self = Turns { last_line: self.last_line, left_out: self.left_out, ..Turns::new(now) };
        out
    }

    /// [`end`](Self::end) now, logging a late turn at debug level.
    pub(super) fn end_and_log(&mut self) {
        if let Some(l) = self.end(Instant::now()) {
            let ms = |d: Duration| d.as_millis() as u64;
            tracing::debug!(
                total_ms = ms(l.total),
                pass_ms = ms(l.pass),
                callers_ms = ms(l.callers),
                yield_ms = ms(l.yielded),
                slept_ms = ms(l.slept),
                planned_sleep_ms = l.planned.map(ms),
                left_out = l.left_out,
                "the engine came back late"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_late_turn_says_which_part_took_the_time_and_a_sleep_within_its_timeout_is_not_late() {
        let t0 = Instant::now();
        let mut t = Turns::new(t0);
        // A sleep of 900 ms of a planned second, and a short pass: on time.
        t.spent(Part::Pass, MS);
        t.planned_sleep(1000 * MS);
        t.spent(Part::Sleep, 900 * MS);
        assert_eq!(t.end(t0 + 901 * MS), None);
        // A yield that came back 700 ms later.
        t.spent(Part::Pass, MS);
        t.spent(Part::Yield, 700 * MS);
        let l = t.end(t0 + 1602 * MS).expect("late");
        assert_eq!(
            (l.total, l.pass, l.yielded, l.slept, l.left_out),
            (701 * MS, MS, 700 * MS, Duration::ZERO, 0)
        );
        // A sleep 200 ms past its timeout is late; within the second
        // after the last line it is only counted...
        t.planned_sleep(100 * MS);
        t.spent(Part::Sleep, 300 * MS);
        assert_eq!(t.end(t0 + 1902 * MS), None);
        // ...and said with the next line due.
        t.spent(Part::Callers, 80 * MS);
        let l = t.end(t0 + 2700 * MS).expect("late");
        assert_eq!((l.callers, l.left_out, l.planned), (80 * MS, 1, None));
    }
}
