//! The links' waker (`engine.link_wake`, off by default): a thread
//! blocked on the links' sockets that runs the engine's pass itself when
//! a frame comes while the engine idles.
//!
//! An idle engine polls with `sched_yield` between passes (on small
//! machines, `engine.yield_us`) before it sleeps. A frame from another
//! host that comes meanwhile waits until the yielding thread is scheduled
//! again, and a yield asks to be scheduled last: on a loaded CPU it is
//! passed over for other runnable threads' whole time slices. A thread
//! blocked on the socket is instead woken by the frame itself.
//!
//! While the engine idles, this thread waits in `epoll_wait` on the
//! links' readiness set (the epoll instance the engine's passes use to
//! find readable links, nested here) and, when a link becomes readable,
//! takes the engine's lock if it is free and runs one pass: the engine's
//! own, with its per-tenant turns and latency class, on this thread. A
//! held lock is an engine in a pass (which reads its links) or a call
//! (after which the engine passes): waiting on it would add a second
//! wake-up. The waker does not re-arm itself (`EPOLLONESHOT`): the engine
//! arms it whenever a pass finds no work, so a busy engine, which reads
//! its links every pass, never has a second thread woken per frame beside
//! it. A sleeping engine waits on the links itself too (see `sleep`);
//! the waker's pass rings it afterwards, as a call does, so that it sees
//! the timers the pass set.
//!
//! Measured (docs/measurements.md, "Across hosts"): on 2 vCPUs loaded
//! by other builds
//! it cut the tail of a frame's wait (the kernel's receive timestamp to
//! the read: mean 55 -> 31 µs, 90th percentile 37 -> 29) but not its
//! median (17 -> 19 µs: a wake-up costs as much there as a turn of the
//! yield loop), and `ib_write_lat` and the rdma_cm setup got slower with
//! a fifth thread on the two CPUs. Hence off by default.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rustix::event::epoll;
use vrdma_shm::Doorbell;

use super::handle::Core;
use super::EngineStats;

/// The outer epoll's tags.
const STOP: u64 = 0;
const LINKS: u64 = 1;

/// What the engine and the waker thread share.
pub(super) struct LinkWake {
    /// The waker's own epoll set: `links` (one-shot) and `stop`.
    outer: OwnedFd,
    /// A duplicate of the links' readiness set (`Net`), kept here so that
    /// the registration in `outer` outlives nothing it names.
    links: OwnedFd,
    stop_tx: Doorbell,
    stop_rx: Doorbell,
    /// The waker ran a pass since the engine last looked: the engine
    /// counts that as work, so that it arms the waker again when it next
    /// finds itself idle.
    pub(super) served: AtomicBool,
    /// The engine armed it and it has not fired since (saves the engine
    /// an `epoll_ctl` per idle pass).
    armed: AtomicBool,
    /// Passes the waker ran.
    pub(super) passes: AtomicU64,
}

impl LinkWake {
    /// A waker for the links whose readiness set is `links`; disarmed.
    pub(super) fn new(links: std::os::fd::BorrowedFd<'_>) -> std::io::Result<LinkWake> {
        let outer = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let links = links.try_clone_to_owned()?;
        let (stop_tx, stop_rx) = Doorbell::pair()?;
        epoll::add(&outer, &links, epoll::EventData::new_u64(LINKS), epoll::EventFlags::ONESHOT)?;
        epoll::add(&outer, stop_rx.as_fd(), epoll::EventData::new_u64(STOP), epoll::EventFlags::IN)?;
        Ok(LinkWake {
            outer,
            links,
            stop_tx,
            stop_rx,
            served: AtomicBool::new(false),
            armed: AtomicBool::new(false),
            passes: AtomicU64::new(0),
        })
    }

    /// Arms the waker for the next readable link (the engine, as it goes
    /// idle). A link already readable fires it at once.
    pub(super) fn arm(&self) {
        if self.armed.swap(true, Ordering::SeqCst) {
            return;
        }
        let flags = epoll::EventFlags::IN | epoll::EventFlags::ONESHOT;
        if let Err(e) = epoll::modify(&self.outer, &self.links, epoll::EventData::new_u64(LINKS), flags) {
            self.armed.store(false, Ordering::SeqCst);
            tracing::debug!(error = %e, "cannot arm the links' waker");
        }
    }

    /// Ends [`run`].
    pub(super) fn stop(&self) {
        self.stop_tx.ring();
    }

    /// Waits for an event: `true` for readable links, `false` to stop.
    fn wait(&self) -> bool {
        let mut events =
            [epoll::Event { flags: epoll::EventFlags::empty(), data: epoll::EventData::new_u64(0) }; 2];
        loop {
            match epoll::wait(&self.outer, &mut events[..], None) {
                Ok(n) => {
                    if events[..n].iter().any(|e| e.data.u64() == STOP) {
                        self.stop_rx.drain();
                        return false;
                    }
                    if n > 0 {
                        self.armed.store(false, Ordering::SeqCst);
                        return true;
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "the links' waker cannot wait; the engine alone reads the links");
                    return false;
                }
            }
        }
    }
}

/// The waker thread: a pass under the engine's lock each time a link
/// becomes readable while it is armed.
pub(super) fn run(wake: Arc<LinkWake>, core: Arc<Core>, engine_bell: Arc<Doorbell>, stats: Arc<EngineStats>) {
    while wake.wait() {
        if core.stopped.load(Ordering::SeqCst) {
            return;
        }
        // A held lock is an engine in a pass, which reads the readable
        // links itself (or a call, after which the engine passes): waiting
        // for it would add a second wake-up to this one. An engine that
        // passes without finding work arms this again.
        let Some(mut guard) = core.try_lock() else { continue };
        let Some(s) = guard.as_mut() else { return };
        super::handle::run_queued(&core.rx, s);
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.pass())).is_err() {
            tracing::error!("the engine pass panicked on the links' waker; continuing");
        }
        wake.passes.fetch_add(1, Ordering::Relaxed);
        stats.passes.fetch_add(1, Ordering::Relaxed);
        wake.served.store(true, Ordering::SeqCst);
        drop(guard);
        // A sleeping engine gathers its timers again (the pass may have
        // set one), as after a control call.
        core.wake_if_asleep(&engine_bell);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::{Duration, Instant};

    use super::*;

    /// A readiness set holding one end of a socket pair, and the other end.
    fn set() -> (OwnedFd, std::os::unix::net::UnixStream, std::os::unix::net::UnixStream) {
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        epoll::add(&ep, &b, epoll::EventData::new_u64(9), epoll::EventFlags::IN).unwrap();
        (ep, a, b)
    }

    /// Fires once per arming, and only when armed: a link that stays
    /// readable does not wake the thread again until the engine arms it.
    #[test]
    fn the_waker_fires_once_per_arming_for_a_readable_link() {
        let (ep, mut a, _b) = set();
        let w = LinkWake::new(ep.as_fd()).unwrap();
        a.write_all(b"x").unwrap();
        let ready = |w: &LinkWake| {
            let mut ev =
                [epoll::Event { flags: epoll::EventFlags::empty(), data: epoll::EventData::new_u64(0) }];
            epoll::wait(&w.outer, &mut ev[..], Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 }))
                .unwrap()
        };
        assert_eq!(ready(&w), 0, "not armed: no event");
        w.arm();
        assert_eq!(ready(&w), 1, "armed with a readable link: an event");
        assert_eq!(ready(&w), 0, "one-shot: no second event while the link stays readable");
        w.armed.store(false, Ordering::SeqCst);
        w.arm();
        assert_eq!(ready(&w), 1, "armed again: an event again");
    }

    /// The thread waits, and a stop ends it.
    #[test]
    fn a_stop_ends_the_wait() {
        let (ep, _a, _b) = set();
        let w = Arc::new(LinkWake::new(ep.as_fd()).unwrap());
        let w2 = w.clone();
        let t = std::thread::spawn(move || w2.wait());
        std::thread::sleep(Duration::from_millis(10));
        w.stop();
        let started = Instant::now();
        while !t.is_finished() {
            assert!(started.elapsed() < Duration::from_secs(10), "the wait did not end");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!t.join().unwrap(), "a stop, not a link");
    }
}
