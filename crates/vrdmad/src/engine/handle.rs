//! How other threads reach the engine's state: in place under its lock
//! while the engine is awake, through its queue while it sleeps.
//!
//! A control call used to be a closure sent to the engine thread and a
//! reply sent back: two thread hand-offs on top of the tenant's own two
//! (tenant, session thread, engine, session thread, tenant), each a
//! wake-up that costs microseconds, and tens of them on a machine with
//! fewer cores than runnable threads. The connection manager makes a
//! dozen such calls per connection in a row, so that was most of an
//! rdma_cm connection's setup (issue 16).
//!
//! Now the engine holds its state's lock while it works and lets callers
//! in between passes: a caller says it waits ([`Core::waiting`]), the
//! engine, which looks at that count after every pass, lets go of the
//! lock until the waiters are through, and the call runs on the caller's
//! own thread, as a command would have run between passes. The data path
//! pays one uncontended atomic load per pass.
//!
//! A sleeping engine lets go of the lock too (it waits on descriptors of
//! its own, see `sleep`): a call made while it sleeps
//! ([`Core::asleep`]) runs at once and rings the engine's doorbell after,
//! so that the engine looks at what the call changed (a new context's
//! doorbell, a message for a link, a timer).
//!
//! Order is kept: [`EngineHandle::post`] queues without waiting, and a
//! call that takes the lock first runs what is queued, so a caller's
//! posted closures run before its next call.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use vrdma_shm::Doorbell;

use super::{EngineState, EngineStats};

pub(super) type Command = Box<dyn FnOnce(&mut EngineState) + Send>;

/// What the engine thread and its handles share.
pub(super) struct Core {
    /// The engine's state: `None` once the engine has stopped.
    pub(super) state: Mutex<Option<EngineState>>,
    /// Closures queued for the engine (by [`EngineHandle::post`], and by
    /// calls that must not wait on the lock).
    pub(super) rx: Receiver<Command>,
    /// Callers that are about to take `state`'s lock.
    pub(super) waiting: AtomicU32,
    /// The engine sleeps (without `state`'s lock): a call rings its
    /// doorbell after.
    pub(super) asleep: AtomicBool,
    /// The doorbell was rung since the engine last went to sleep: a call
    /// after the first (a batch's several, a connection's setup's) need
    /// not ring it again ([`Core::wake_if_asleep`]).
    pub(super) rung: AtomicBool,
    /// The engine has stopped; what is queued is dropped (its callers
    /// hear [`EngineGone`]).
    pub(super) stopped: AtomicBool,
    /// The engine thread runs at real-time priority: it sleeps on the lock
    /// (its yields would let no normal thread run: see
    /// [`Core::lock_yielding`]).
    pub(super) realtime: AtomicBool,
    /// Tests: the engine thread stops taking turns (as if it were not
    /// scheduled) while set, and says so in `held`.
    #[cfg(test)]
    pub(super) hold: AtomicBool,
    #[cfg(test)]
    pub(super) held: AtomicBool,
}

impl Core {
    /// A core without a state yet (the state holds a handle to it).
    pub(super) fn new(rx: Receiver<Command>) -> Core {
        Core {
            state: Mutex::new(None),
            rx,
            waiting: AtomicU32::new(0),
            asleep: AtomicBool::new(false),
            rung: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            realtime: AtomicBool::new(false),
            #[cfg(test)]
            hold: AtomicBool::new(false),
            #[cfg(test)]
            held: AtomicBool::new(false),
        }
    }

    /// The state's lock, whoever held it when it panicked (a panic is
    /// caught where the state is used, so poisoning is not expected).
    pub(super) fn lock(&self) -> MutexGuard<'_, Option<EngineState>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lock if it is free now (`None`: held).
    pub(super) fn try_lock(&self) -> Option<MutexGuard<'_, Option<EngineState>>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The lock, for the engine thread between its passes: it yields
    /// while a caller holds it rather than sleeping on it, so that the
    /// caller's unlock never has a sleeper to wake (a system call and a
    /// cross-CPU wake-up on the caller's path, several per rdma_cm
    /// connection while a setup's calls come one after another). The
    /// engine polled with yields at that point anyway. (A real-time
    /// engine's yield lets no normal thread run, the lock's holder
    /// included: it sleeps on the lock as before.)
    pub(super) fn lock_yielding(&self) -> MutexGuard<'_, Option<EngineState>> {
        if self.realtime.load(Ordering::Relaxed) {
            return self.lock();
        }
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            std::thread::yield_now();
        }
    }

    /// The engine's part, with the lock held, just before it sleeps: from
    /// now on a call rings it (once).
    pub(super) fn going_to_sleep(&self) {
        self.rung.store(false, Ordering::SeqCst);
        self.asleep.store(true, Ordering::SeqCst);
    }

    /// After a call (or a pass on another thread) changed the state while
    /// the engine sleeps: rings `bell` so that it looks, unless a ring
    /// since it went to sleep is already on its way (each ring was a
    /// system call, and a wake-up for the engine to drain one by one:
    /// three or four per rdma_cm batch before). The engine takes the lock
    /// after it wakes, so it sees every change made before then.
    pub(super) fn wake_if_asleep(&self, bell: &Doorbell) {
        if self.asleep.load(Ordering::SeqCst) && !self.rung.swap(true, Ordering::SeqCst) {
            bell.ring();
        }
    }

    /// The lock, for a caller (see [`Core::waiting`]); `None` once the
    /// engine has stopped.
    pub(super) fn lock_for_call(&self) -> Option<MutexGuard<'_, Option<EngineState>>> {
        if self.stopped.load(Ordering::SeqCst) {
            return None;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let guard = self.lock();
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        Some(guard)
    }

    /// The engine's part: lets go of the lock (`guard`) while callers wait
    /// for it, a bounded while, and takes it back.
    pub(super) fn let_callers_in<'a>(
        &'a self,
        guard: MutexGuard<'a, Option<EngineState>>,
    ) -> MutexGuard<'a, Option<EngineState>> {
        drop(guard);
        // A waiter on this CPU needs a yield to run; one on another CPU
        // was woken by the unlock. A waiter that does not come in time
        // (descheduled) is let in after the next pass.
        for _ in 0..LET_IN_YIELDS {
            if self.waiting.load(Ordering::SeqCst) == 0 {
                break;
            }
            std::thread::yield_now();
        }
        self.lock_yielding()
    }

    /// Drops what is queued, once the engine has stopped.
    fn drop_queued(&self) {
        while let Ok(cmd) = self.rx.try_recv() {
            drop(cmd);
        }
    }
}

/// Yields the engine makes at most, each time, while callers wait for its
/// lock.
const LET_IN_YIELDS: u32 = 64;

/// Runs what is queued for the engine, in order; a closure that panics
/// is logged, and its caller hears [`EngineGone`] (its reply is dropped).
pub(super) fn run_queued(rx: &Receiver<Command>, s: &mut EngineState) -> bool {
    let mut ran = false;
    while let Ok(cmd) = rx.try_recv() {
        ran = true;
        // A bug in one control operation must not take the device down
        // for every tenant: its caller gets an error (the reply channel is
        // dropped), everyone else carries on.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd(s))).is_err() {
            tracing::error!("a control operation panicked on the engine thread");
        }
    }
    ran
}

/// A handle to send work to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    pub(super) wake: Arc<Doorbell>,
    pub stats: Arc<EngineStats>,
    pub(super) core: Arc<Core>,
}

#[derive(Debug, thiserror::Error)]
#[error("the engine thread has stopped")]
pub struct EngineGone;

impl EngineHandle {
    pub(super) fn new(
        tx: Sender<Command>,
        wake: Arc<Doorbell>,
        stats: Arc<EngineStats>,
        core: Arc<Core>,
    ) -> Self {
        EngineHandle { tx, wake, stats, core }
    }

    /// Runs `f` on the engine's state between passes, on this thread, and
    /// returns its result (see the module's notes).
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EngineState) -> R + Send + 'static,
    ) -> Result<R, EngineGone> {
        let mut guard = self.core.lock_for_call().ok_or(EngineGone)?;
        let s = guard.as_mut().ok_or(EngineGone)?;
        run_queued(&self.core.rx, s);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s))).map_err(|_| {
            tracing::error!("a control operation panicked on the engine's state");
            EngineGone
        });
        drop(guard);
        self.core.wake_if_asleep(&self.wake);
        r
    }

    /// [`call`](Self::call) through the engine's queue, waiting `timeout`
    /// at most for the result (the metrics endpoint must not hang on an
    /// engine that is stuck, so it does not wait for the lock either).
    pub fn call_within<R: Send + 'static>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&mut EngineState) -> R + Send + 'static,
    ) -> Result<R, EngineGone> {
        self.send(f)?.recv_timeout(timeout).map_err(|_| EngineGone)
    }

    /// Queues `f`, wakes the engine, and gives where its result will come.
    fn send<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut EngineState) -> R + Send + 'static,
    ) -> Result<crossbeam_channel::Receiver<R>, EngineGone> {
        let (rtx, rrx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Box::new(move |s: &mut EngineState| {
                let _ = rtx.send(f(s));
            }))
            .map_err(|_| EngineGone)?;
        self.wake.ring();
        // An engine that stopped after this caller looked has dropped what
        // was queued before it stopped; what came after is dropped here
        // (the engine sets `stopped` before its last look at the queue).
        if self.core.stopped.load(Ordering::SeqCst) {
            self.core.drop_queued();
        }
        Ok(rrx)
    }

    /// Queues `f` to run on the engine's state, neither waking the engine
    /// nor waiting for it: for bookkeeping that nothing can need before
    /// the caller's next [`EngineHandle::call`], which runs after it
    /// (queued closures run in the order they were sent, and before a
    /// call that takes the lock). Saves the caller a handoff to the
    /// engine thread and back.
    pub fn post(&self, f: impl FnOnce(&mut EngineState) + Send + 'static) -> Result<(), EngineGone> {
        self.tx.send(Box::new(f)).map_err(|_| EngineGone)?;
        if self.core.stopped.load(Ordering::SeqCst) {
            self.core.drop_queued();
            return Err(EngineGone);
        }
        Ok(())
    }
}

impl Core {
    /// Marks the engine stopped and takes its state out (to be dropped by
    /// the engine thread), dropping what was queued.
    pub(super) fn stop(&self, mut guard: MutexGuard<'_, Option<EngineState>>) -> Option<EngineState> {
        self.stopped.store(true, Ordering::SeqCst);
        let state = guard.take();
        drop(guard);
        self.drop_queued();
        state
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use vrdma_core::hca::{Hca, HcaConfig};

    use super::*;
    use crate::config::EngineConfig;
    use crate::engine::Engine;
    use crate::testing::Keys;

    fn engine(cfg: EngineConfig) -> Engine {
        let hca = Hca::new(HcaConfig::for_host([10, 0, 0, 1]), Box::new(Keys(0)));
        let cm = crate::cm::CmDriver::new(vrdma_core::cm::ConnectionManager::new(
            Default::default(),
            vec![std::net::Ipv4Addr::new(10, 0, 0, 1)],
            Box::new(Keys(7)),
        ));
        Engine::start(hca, cm, cfg, None).unwrap()
    }

    /// Waits (10 s at most) until the engine sleeps or stays awake as
    /// `asleep` says.
    fn until_asleep(e: &Engine, asleep: bool) {
        let started = Instant::now();
        while e.handle().core.asleep.load(Ordering::SeqCst) != asleep {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the engine never reached asleep = {asleep}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Calls see what was posted before them and what earlier calls did,
    /// whether the engine is awake or asleep, from several threads at once.
    #[test]
    fn calls_run_in_order_after_what_their_caller_posted_awake_or_asleep() {
        let awake = EngineConfig { busy_poll: true, ..EngineConfig::default() };
        let sleepy = EngineConfig { spin_us: 0, yield_us: 0, ..EngineConfig::default() };
        for (cfg, asleep) in [(awake, false), (sleepy, true)] {
            let e = engine(cfg);
            until_asleep(&e, asleep);
            if asleep {
                // A call does not wait for a sleeping engine: it runs while
                // the engine sleeps, and wakes it after.
                let (core, woken) =
                    (e.handle().core.clone(), e.handle().stats.wakeups.load(Ordering::SeqCst));
                assert!(e.handle().call(move |_| core.asleep.load(Ordering::SeqCst)).unwrap());
                let started = Instant::now();
                while e.handle().stats.wakeups.load(Ordering::SeqCst) == woken {
                    assert!(started.elapsed() < Duration::from_secs(10), "the engine was not woken");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let h = e.handle();
                    std::thread::spawn(move || {
                        let ctx = vrdma_core::hca::ContextId(100 + t);
                        h.call(move |s| s.hca.open_context(ctx, vrdma_core::hca::TenantId(1)))
                            .unwrap()
                            .unwrap();
                        let slot = Arc::new(AtomicU32::new(0));
                        for i in 0..200u32 {
                            // The posted closure makes a PD; the call that
                            // follows finds it (or fails).
                            let made = slot.clone();
                            h.post(move |s| made.store(s.hca.alloc_pd(ctx).unwrap(), Ordering::Relaxed))
                                .unwrap();
                            let made = slot.clone();
                            let r =
                                h.call(move |s| s.hca.dealloc_pd(ctx, made.load(Ordering::Relaxed))).unwrap();
                            assert!(r.is_ok(), "thread {t}, call {i}: {r:?}");
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        }
    }

    /// Calls made while the engine sleeps ring its doorbell once, until
    /// it goes to sleep again.
    #[test]
    fn calls_while_the_engine_sleeps_ring_it_once() {
        let (_tx, rx) = crossbeam_channel::unbounded();
        let core = Core::new(rx);
        let (bell, engine_end) = Doorbell::pair().unwrap();
        let rings = || {
            let mut n = 0;
            while engine_end.take_one() {
                n += 1;
            }
            n
        };
        core.wake_if_asleep(&bell);
        assert_eq!(rings(), 0, "an awake engine is not rung");
        core.going_to_sleep();
        for _ in 0..3 {
            core.wake_if_asleep(&bell);
        }
        assert_eq!(rings(), 1);
        core.going_to_sleep();
        core.wake_if_asleep(&bell);
        core.wake_if_asleep(&bell);
        assert_eq!(rings(), 1, "rung again after the next sleep");
    }

    /// A call that panics fails alone; the engine goes on. Once the engine
    /// has stopped, calls and posts fail at once instead of waiting.
    #[test]
    fn a_panicking_call_fails_alone_and_a_stopped_engine_answers_engine_gone() {
        for cfg in [
            EngineConfig { busy_poll: true, ..EngineConfig::default() },
            EngineConfig { spin_us: 0, yield_us: 0, ..EngineConfig::default() },
        ] {
            let e = engine(cfg);
            let h = e.handle();
            let r = h.call(|_| -> u32 { panic!("a bug in one control operation") });
            assert!(r.is_err());
            assert_eq!(h.call(|s| s.rings.contexts.len()).unwrap(), 0, "the engine serves on");
            drop(e);
            assert!(h.call(|_| ()).is_err());
            assert!(h.post(|_| ()).is_err());
            assert!(h.call_within(Duration::from_secs(10), |_| ()).is_err());
        }
    }
}
