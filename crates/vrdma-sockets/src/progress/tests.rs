//! The progress thread's list and pace played step by step: each step is
//! one hold of the list's lock in `progress.rs` (a writer's `watch`, a
//! drain, the thread's question before it waits), in the orders that the
//! real threads may take. No threads, no sleeps: the condvar is modelled
//! by [`Thread::asleep`], which only a notification clears.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::list::{claim, Entry, ProgressList};
use super::pace::{Pace, LINGER, QUIET_LOOK};

/// A connection as the list sees it.
#[derive(Default)]
struct Conn {
    queued: AtomicBool,
    /// Writes in flight, blocked, or asked.
    needs: AtomicBool,
    /// Only the peer's answer awaited.
    answer_only: AtomicBool,
}

#[derive(Clone, Default)]
struct E(Arc<Conn>);

impl Entry for E {
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
    fn queued(&self) -> &AtomicBool {
        &self.0.queued
    }
    fn needs_watch(&self) -> bool {
        self.0.needs.load(Ordering::SeqCst)
    }
    fn awaits_answer_only(&self) -> bool {
        self.0.answer_only.load(Ordering::SeqCst)
    }
}

impl E {
    fn needs(&self, v: bool) -> &Self {
        self.0.needs.store(v, Ordering::SeqCst);
        self
    }
    fn queued_flag(&self) -> bool {
        self.0.queued.load(Ordering::SeqCst)
    }
}

const PID: u32 = 100;

/// The progress thread as its condvar sees it.
struct Thread {
    pace: Pace,
    now: Instant,
    /// Waiting on the condvar: only a notification wakes it.
    asleep: bool,
}

impl Thread {
    /// A thread that lingered already.
    fn new() -> Self {
        let t0 = Instant::now();
        Thread { pace: Pace::new(t0), now: t0 + LINGER * 2, asleep: false }
    }

    /// One step: asleep, nothing (blocked); else its question before the
    /// wait, and where it may not sleep, a look that drains what has
    /// nothing left (its copy of the list, then each entry's drain).
    fn step(&mut self, l: &mut ProgressList<E>) {
        if self.asleep {
            return;
        }
        self.asleep = l.may_sleep(&self.pace, self.now);
        if !self.asleep {
            for e in l.snapshot(PID) {
                if !e.needs_watch() {
                    let n = l.drained(&e, PID);
                    self.notified(n);
                }
            }
        }
    }

    fn notified(&mut self, notify: bool) {
        if notify {
            self.asleep = false;
        }
    }
}

/// A writer's `watch`: the flag without the lock, then the list.
fn watch(l: &mut ProgressList<E>, t: &mut Thread, e: &E) {
    if claim(e) {
        let n = l.list(e);
        t.notified(n);
    }
}

/// A list of `PID`'s with its thread started.
fn started() -> ProgressList<E> {
    let mut l = ProgressList::new();
    assert!(l.adopt(PID));
    l
}

/// Whether the thread sleeps for ever: asleep, with entries that nobody
/// will wake it for.
fn lost(l: &ProgressList<E>, t: &Thread) -> bool {
    t.asleep && l.len() > 0
}

#[test]
fn a_writer_that_lists_while_the_thread_sleeps_wakes_it() {
    let mut l = started();
    let mut t = Thread::new();
    t.step(&mut l);
    assert!(t.asleep && l.idle());
    let a = E::default();
    assert!(claim(&a));
    assert!(l.list(&a), "the thread sleeps: the writer must notify");
    assert!(!l.idle(), "the notification clears idle");
    // A second write on the listed connection takes no lock.
    assert!(!claim(&a));
}

#[test]
fn a_writer_before_the_look_is_seen_and_one_after_it_notifies() {
    // Listed before the thread's question: the thread does not sleep,
    // and the writer had no one to notify.
    let mut l = started();
    let t = Thread::new();
    let a = E::default();
    a.needs(true);
    assert!(claim(&a));
    assert!(!l.list(&a));
    assert!(!l.may_sleep(&t.pace, t.now), "a non-empty list: no sleep");
    // Listed between the question and the wait (the lock is held across
    // both, so this is the latest a writer can come): it sees idle.
    let mut l = started();
    assert!(l.may_sleep(&t.pace, t.now));
    assert!(l.idle());
    assert!(claim(&E::default()));
    assert!(l.list(&E::default()), "idle set before the wait: the writer notifies");
}

/// The lost wake-up of before 12f49b0 (pgbench -i's COPY, about one run in
/// twenty): the thread sleeps; a writer lists A and notifies; A drains
/// (a readiness call's flush) before the woken thread takes the lock
/// back; the thread finds the list empty and waits again; writer B lists
/// and must notify again.
#[test]
fn the_thread_woken_for_an_entry_drained_meanwhile_is_woken_again() {
    let mut l = started();
    let mut t = Thread::new();
    let (a, b) = (E::default(), E::default());
    t.step(&mut l);
    assert!(t.asleep);
    watch(&mut l, &mut t, a.needs(true));
    assert!(!t.asleep, "A's writer notified");
    a.needs(false);
    assert!(!l.drained(&a, PID));
    assert_eq!(l.len(), 0);
    t.step(&mut l);
    assert!(t.asleep, "an empty list again: the thread waits again");
    b.needs(true);
    assert!(claim(&b));
    assert!(l.list(&b), "the thread waits again: B's writer must notify");
}

/// Every order of a few steps: the thread's (three), writer A's, the
/// drain of A (after A's write), writer B's. None may leave the thread
/// asleep on a non-empty list.
#[test]
fn no_order_of_writers_drains_and_looks_leaves_the_thread_asleep_on_a_listed_entry() {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Step {
        Thread,
        WriteA,
        DrainA,
        WriteB,
    }
    fn orders(left: &mut Vec<Step>, done: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
        if left.is_empty() {
            out.push(done.clone());
            return;
        }
        let mut tried = Vec::new();
        for i in 0..left.len() {
            let s = left[i];
            if tried.contains(&s) || (s == Step::DrainA && !done.contains(&Step::WriteA)) {
                continue;
            }
            tried.push(s);
            left.remove(i);
            done.push(s);
            orders(left, done, out);
            done.pop();
            left.insert(i, s);
        }
    }
    let mut all = Vec::new();
    let mut steps = vec![Step::Thread, Step::Thread, Step::Thread, Step::WriteA, Step::DrainA, Step::WriteB];
    orders(&mut steps, &mut Vec::new(), &mut all);
    assert_eq!(all.len(), 60, "6!/3! orders, halved by A's write before its drain");
    for order in &all {
        let mut l = started();
        let mut t = Thread::new();
        let (a, b) = (E::default(), E::default());
        for s in order {
            match s {
                Step::Thread => t.step(&mut l),
                Step::WriteA => watch(&mut l, &mut t, a.needs(true)),
                Step::DrainA => {
                    // A's bytes landed; a readiness call's flush drains it.
                    a.needs(false);
                    let n = l.drained(&a, PID);
                    t.notified(n);
                }
                // B stays in flight: only the thread's looks can reap it.
                Step::WriteB => watch(&mut l, &mut t, b.needs(true)),
            }
            assert!(!lost(&l, &t), "asleep on {} entries after {s:?} in {order:?}", l.len());
            assert!(!t.asleep || l.idle(), "asleep and not idle after {s:?} in {order:?}");
        }
    }
}

/// Two drains of one entry race: the earlier takes it off, a write is
/// posted, the later (from a stale copy of the list) keeps it, and the
/// writer's claim, after, finds the flag set and lists nothing. The later
/// drain must have put it back, and woken the thread if it sleeps.
#[test]
fn an_entry_a_late_drain_keeps_is_listed_again() {
    let mut l = started();
    let mut t = Thread::new();
    let a = E::default();
    watch(&mut l, &mut t, a.needs(true));
    let stale = l.snapshot(PID);
    a.needs(false);
    assert!(!l.drained(&a, PID));
    assert!(!l.has(&a) && !a.queued_flag());
    t.step(&mut l);
    assert!(t.asleep, "the thread sleeps on the empty list");
    // A write is posted; before its writer's claim, the stale drain.
    a.needs(true);
    let n = l.drained(&stale[0], PID);
    t.notified(n);
    assert!(l.has(&a), "kept: listed again");
    assert!(n, "the thread sleeps: the drain must notify");
    assert!(!claim(&a), "the writer's claim finds the flag set");
    assert!(!lost(&l, &t));
    assert_eq!(l.len(), 1, "listed once");
}

#[test]
fn a_drained_entry_leaves_unless_something_came() {
    let mut l = started();
    let (a, b) = (E::default(), E::default());
    for e in [&a, &b] {
        assert!(claim(e));
        assert!(!l.list(e));
    }
    a.needs(false);
    b.needs(true);
    assert!(!l.drained(&a, PID));
    assert!(!l.drained(&b, PID));
    assert!(!l.has(&a) && !a.queued_flag(), "A off, flag clear: its next write lists it");
    assert!(l.has(&b) && b.queued_flag());
    assert_eq!(l.len(), 1);
    assert!(claim(&a));
}

#[test]
fn the_thread_lingers_before_it_sleeps() {
    let t0 = Instant::now();
    let mut pace = Pace::new(t0);
    let mut l = started();
    assert!(!l.may_sleep(&pace, t0 + LINGER / 2));
    assert!(!l.may_sleep(&pace, t0 + LINGER), "not past LINGER yet");
    assert!(!l.idle());
    assert!(l.may_sleep(&pace, t0 + LINGER + Duration::from_micros(1)));
    assert!(l.idle());
    // A busy look starts the linger again.
    let mut l = started();
    let t1 = t0 + Duration::from_secs(1);
    pace.busy(t1);
    assert!(!l.may_sleep(&pace, t1 + LINGER));
    assert!(!l.idle());
    assert!(l.may_sleep(&pace, t1 + LINGER * 2));
    // A time before the last busy look (clocks do not go back, but
    // nothing panics): still lingering.
    assert!(!started().may_sleep(&pace, t0));
    // Never on a non-empty list, however long since.
    let mut l = started();
    let a = E::default();
    assert!(claim(&a));
    let _ = l.list(&a);
    assert!(!l.may_sleep(&pace, t1 + Duration::from_secs(3600)));
}

#[test]
fn the_thread_waits_quietly_only_while_every_entry_awaits_an_answer() {
    let interval = Duration::from_micros(500);
    let mut l = started();
    assert!(!l.quiet(), "an empty list is not quiet");
    let (a, b) = (E::default(), E::default());
    for e in [&a, &b] {
        e.0.answer_only.store(true, Ordering::SeqCst);
        assert!(claim(e));
        let _ = l.list(e);
    }
    assert!(l.quiet());
    assert_eq!(Pace::wait(l.quiet(), interval), QUIET_LOOK);
    b.0.answer_only.store(false, Ordering::SeqCst);
    assert!(!l.quiet(), "B has writes in flight");
    assert_eq!(Pace::wait(l.quiet(), interval), interval);
}

#[test]
fn the_daemon_is_checked_every_1024th_busy_look() {
    let t0 = Instant::now();
    let mut pace = Pace::new(t0);
    let checks: Vec<u32> = (1..=3000).filter(|_| pace.busy(t0)).collect();
    assert_eq!(checks.len(), 2);
    let mut l = started();
    let a = E::default();
    assert!(claim(&a));
    let _ = l.list(&a);
    l.clear();
    assert_eq!(l.len(), 0);
    assert!(!a.queued_flag(), "let go: its next write lists it again");
}

/// The daemon gone, the list is let go except the entries kept (an
/// exec's resend still queued: nobody else pushes it, review L3).
#[test]
fn a_cleared_list_keeps_the_entries_asked_for() {
    let mut l = started();
    let (a, b) = (E::default(), E::default());
    b.0.needs.store(true, Ordering::SeqCst);
    for e in [&a, &b] {
        assert!(claim(e));
        let _ = l.list(e);
    }
    l.clear_except(|e| e.needs_watch());
    assert_eq!(l.len(), 1);
    assert!(l.has(&b) && b.queued_flag(), "kept, flag set");
    assert!(!l.has(&a) && !a.queued_flag(), "let go: its next write lists it again");
}

/// A forked child shares its parent's list in memory, not its thread:
/// the parent's entries are not its to look at, drop or list again, and
/// its first write starts its own thread, whoever was idle at the fork.
#[test]
fn a_forked_childs_list_is_its_own() {
    const CHILD: u32 = 200;
    let mut l = started();
    let mut t = Thread::new();
    let (a, b) = (E::default(), E::default());
    watch(&mut l, &mut t, a.needs(true));
    // At the fork: A listed by the parent, B kept by a drain off the
    // list (its writer's claim to come).
    assert!(l.snapshot(CHILD).is_empty(), "the parent's entries are not the child's");
    assert!(!l.drained(&a, CHILD));
    assert!(l.has(&a), "kept in the parent's list, untouched");
    b.needs(true);
    assert!(!l.drained(&b, CHILD));
    assert!(!l.has(&b), "not listed in the parent's list by the child");
    let refs = Arc::strong_count(&a.0);
    assert!(l.adopt(CHILD), "the child's first write starts a thread");
    assert_eq!(Arc::strong_count(&a.0), refs, "the parent's entries are forgotten, not dropped");
    assert_eq!(l.len(), 0);
    assert!(!l.adopt(CHILD));
    let c = E::default();
    assert!(claim(&c));
    assert!(!l.list(&c), "the child's thread is not idle yet");
    assert_eq!(l.snapshot(CHILD).len(), 1);
    // No thread could start: the next write tries again.
    l.abandon();
    assert!(l.adopt(CHILD));

    // The parent's thread asleep at the fork: idle, which the child's
    // new thread is not.
    let mut l = started();
    let mut t = Thread::new();
    t.step(&mut l);
    assert!(l.idle());
    assert!(l.adopt(CHILD));
    assert!(!l.idle(), "the child's writer does not notify a thread that is not waiting");
}
