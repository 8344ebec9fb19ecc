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
//!
//! The loop reads the clock once at each boundary between parts and hands
//! the reading in ([`Turns::lap`]): the end of one part is the start of
//! the next, so a busy turn costs one clock read (the pass's end), which
//! the loop needs anyway for its busy time.

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
    /// Where the part now running began (the last lap).
    mark: Instant,
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
        Turns {
            began: now,
            mark: now,
            parts: [Duration::ZERO; 4],
            planned: None,
            last_line: None,
            left_out: 0,
        }
    }

    /// `part` ran from the last lap (or the turn's start) until `now`.
    pub(super) fn lap(&mut self, part: Part, now: Instant) {
        self.parts[part as usize] += now.saturating_duration_since(self.mark);
        self.mark = now;
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

    /// [`end`](Self::end) at `now`, logging a late turn at debug level.
    pub(super) fn end_and_log(&mut self, now: Instant) {
        if let Some(l) = self.end(now) {
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
        let at = |ms: u32| t0 + ms * MS;
        let mut t = Turns::new(t0);
        // A short pass and a sleep of 900 ms of a planned second: on time.
        t.lap(Part::Pass, at(1));
        t.planned_sleep(1000 * MS);
        t.lap(Part::Sleep, at(901));
        assert_eq!(t.end(at(901)), None);
        // A yield that came back 700 ms later.
        t.lap(Part::Pass, at(902));
        t.lap(Part::Yield, at(1602));
        let l = t.end(at(1602)).expect("late");
        assert_eq!(
            (l.total, l.pass, l.yielded, l.slept, l.left_out),
            (701 * MS, MS, 700 * MS, Duration::ZERO, 0)
        );
        // A sleep 200 ms past its timeout is late; within the second
        // after the last line it is only counted...
        t.planned_sleep(100 * MS);
        t.lap(Part::Sleep, at(1902));
        assert_eq!(t.end(at(1902)), None);
        // ...and said with the next line due.
        t.lap(Part::Pass, at(2620));
        t.lap(Part::Callers, at(2700));
        let l = t.end(at(2700)).expect("late");
        assert_eq!((l.callers, l.pass, l.left_out, l.planned), (80 * MS, 718 * MS, 1, None));
    }
}
