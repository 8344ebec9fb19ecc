//! Holds a paused tenant's state-changing calls until its migration ends.
//!
//! Between `pause` and `finish` (or a cancel's `resume`) the source must
//! not run a call that changes the tenant's device state (create, modify
//! or destroy a PD, MR, CQ, SRQ, QP or AH): the snapshot, taken after the
//! pause, would not hold it, and the destination would never see it. The
//! core refuses such calls for a paused tenant (`HcaError::TenantPaused`);
//! this gate makes the sessions wait instead, in their own threads (never
//! the engine's, never another tenant's), and closes the race between a
//! call already on its way to the engine and the pause:
//!
//! - a state-changing call passes the gate before it runs and is counted
//!   as running until its answer is made ([`PauseGate::enter`]);
//! - the operator's pause (and an import, whose tenant arrives paused)
//!   closes the gate first and waits for the running calls to end
//!   ([`PauseGate::close`]), then pauses the tenant in the core; calls
//!   that come meanwhile wait at the gate;
//! - resume and finish open it after the core has changed
//!   ([`PauseGate::sync`]). A held call then runs (a cancelled migration:
//!   the tenant is the source's still), or finds its session noted as
//!   moved and is not run (`Shared::mark_moved`: the guest hears
//!   `Ended { Moved }` and sends it again on the destination; a host
//!   process sees its connection closed, as for any call after `finish`).
//!
//! Bounded by the migration's own bound (`migration_pause_limit`, after
//! which the peers' QPs give up too): a call held longer is answered with
//! `ETIMEDOUT` and not run.
//!
//! `docs/migration.md`, "Calls while a tenant is paused".

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_core::hca::TenantId;

/// One tenant's state at the gate.
#[derive(Debug, Default)]
struct Entry {
    /// Closed since (paused for a migration, or closing).
    paused_since: Option<Instant>,
    /// State-changing calls past the gate and not yet answered.
    running: u32,
}

/// Why a call was not let through.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// The tenant's context left this host while the call was held.
    Moved,
    /// The tenant stayed paused past the bound.
    TooLong(Duration),
}

pub(crate) struct PauseGate {
    limit: Duration,
    tenants: Mutex<HashMap<TenantId, Entry>>,
    changed: Condvar,
}

/// A state-changing call let through: counted as running until dropped.
pub(crate) struct Pass<'a> {
    gate: &'a PauseGate,
    tenant: TenantId,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut t = self.gate.lock();
        // Only a closing gate's `close` waits on a call's end, for the
        // last one: the calls of an open gate, every call but during a
        // migration, wake no one (a `notify_all` is a system call each
        // time, twice per rdma_cm connection setup on each side).
        let mut last_of_closed = false;
        if let Some(e) = t.get_mut(&self.tenant) {
            e.running = e.running.saturating_sub(1);
            last_of_closed = e.running == 0 && e.paused_since.is_some();
            if e.running == 0 && e.paused_since.is_none() {
                t.remove(&self.tenant);
            }
        }
        drop(t);
        if last_of_closed {
            self.gate.changed.notify_all();
        }
    }
}

impl PauseGate {
    /// A gate whose calls wait at most `limit` from the pause.
    pub(crate) fn new(limit: Duration) -> PauseGate {
        PauseGate { limit, tenants: Mutex::default(), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TenantId, Entry>> {
        self.tenants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets a state-changing call of `tenant` through, once the tenant is
    /// not paused; `moved` says whether the calling session's context left
    /// this host (checked when the gate opens).
    pub(crate) fn enter(&self, tenant: TenantId, moved: impl Fn() -> bool) -> Result<Pass<'_>, Held> {
        let mut t = self.lock();
        let mut held = false;
        loop {
            let since = t.get(&tenant).and_then(|e| e.paused_since);
            let Some(since) = since else { break };
            held = true;
            let until = since + self.limit;
            let now = Instant::now();
            if now >= until {
                return Err(Held::TooLong(self.limit));
            }
            t = self.changed.wait_timeout(t, until - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        if held && moved() {
            return Err(Held::Moved);
        }
        t.entry(tenant).or_default().running += 1;
        Ok(Pass { gate: self, tenant })
    }

    /// Whether `tenant`'s gate is closed: paused for a migration or a
    /// snapshot (its VM, if it is one, normally stopped meanwhile).
    pub(crate) fn is_paused(&self, tenant: TenantId) -> bool {
        self.lock().get(&tenant).is_some_and(|e| e.paused_since.is_some())
    }

    /// Closes the gate for `tenant` and waits, at most `wait`, for its
    /// state-changing calls under way to end. Returns whether they did; if
    /// not, the gate is open again (the caller refuses its step).
    pub(crate) fn close(&self, tenant: TenantId, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut t = self.lock();
        t.entry(tenant).or_default().paused_since.get_or_insert_with(Instant::now);
        loop {
            let running = t.get(&tenant).map_or(0, |e| e.running);
            if running == 0 {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                drop(t);
                self.sync(tenant, false);
                return false;
            }
            t = self.changed.wait_timeout(t, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Makes the gate say what the core says: closed while `tenant` is
    /// paused there, open otherwise (held calls go on).
    pub(crate) fn sync(&self, tenant: TenantId, paused: bool) {
        let mut t = self.lock();
        if paused {
            t.entry(tenant).or_default().paused_since.get_or_insert_with(Instant::now);
        } else if let Some(e) = t.get_mut(&tenant) {
            e.paused_since = None;
            if e.running == 0 {
                t.remove(&tenant);
            }
        }
        drop(t);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const T: TenantId = TenantId(1000);

    /// A call held at a closed gate runs when it opens (a cancel), or is
    /// refused as moved (a finish), or after the bound; close waits for a
    /// call under way.
    #[test]
    fn a_closed_gate_holds_calls_until_it_opens() {
        let gate = Arc::new(PauseGate::new(Duration::from_secs(10)));
        let moved = Arc::new(AtomicBool::new(false));
        assert!(gate.enter(TenantId(7), || false).is_ok(), "an open gate lets calls through");
        // Close waits for the call under way.
        let pass = gate.enter(T, || false).unwrap();
        assert!(!gate.close(T, Duration::from_millis(20)), "a call was still running");
        drop(pass);
        assert!(gate.close(T, Duration::from_secs(1)));
        for (finish, want_moved) in [(false, false), (true, true)] {
            assert!(gate.close(T, Duration::from_secs(1)));
            let (g, m) = (gate.clone(), moved.clone());
            let held = std::thread::spawn(move || g.enter(T, || m.load(Ordering::SeqCst)).map(drop));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!held.is_finished(), "a call went through a closed gate");
            moved.store(finish, Ordering::SeqCst);
            gate.sync(T, false);
            let r = held.join().unwrap();
            assert_eq!(r, if want_moved { Err(Held::Moved) } else { Ok(()) });
        }
        // A close that waits is woken by the end of the last call under way
        // (calls of an open gate wake no one): it returns true, not at its
        // bound.
        let pass = gate.enter(T, || false).unwrap();
        let other = gate.enter(T, || false).unwrap();
        let g = gate.clone();
        let closing = std::thread::spawn(move || g.close(T, Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(50));
        drop(other);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!closing.is_finished(), "a call is still under way");
        drop(pass);
        assert!(closing.join().unwrap(), "the last call's end let the close through");
        gate.sync(T, false);
        let short = PauseGate::new(Duration::from_millis(30));
        short.sync(T, true);
        assert_eq!(short.enter(T, || false).map(drop), Err(Held::TooLong(Duration::from_millis(30))));
    }
}
