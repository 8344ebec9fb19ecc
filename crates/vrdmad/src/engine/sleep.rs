//! The engine's sleep: what it waits on, gathered under the state's lock
//! and waited on without it, so that control calls run on their callers'
//! threads while the engine sleeps as while it works (see `handle`).
//!
//! The set holds what it waits on by itself: the contexts' doorbells
//! (shared with the state) and duplicates of the links' sockets, so that
//! a call that closes a context or a link meanwhile closes nothing the
//! wait uses. A caller that changed the state while the engine slept
//! rings its doorbell afterwards, and the engine gathers a new set.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use vrdma_core::hca::TenantId;
use vrdma_shm::Doorbell;

use super::EngineState;

/// Rings of one tenant's doorbells read per wake-up at most (see
/// [`PollSet::wait`]).
const DOORBELL_READS_PER_TENANT: u64 = 64;

/// What a sleeping engine waits on.
pub(super) struct PollSet {
    bells: Vec<(TenantId, Arc<Doorbell>)>,
    links: Vec<(OwnedFd, PollFlags)>,
    timeout: Duration,
}

impl PollSet {
    /// The contexts' doorbells and the links of `s`, and how long to wait:
    /// until `timer`, the links' next keepalive, or a second at most, so
    /// that a lost wakeup could never stall the device for long. Fails
    /// only if the daemon is out of descriptors for the duplicates.
    pub(super) fn of(s: &EngineState, timer: Option<Duration>) -> std::io::Result<PollSet> {
        let timeout = timer.unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
        let bells = s.rings.contexts.values().map(|c| (c.tenant, c.doorbell.clone())).collect();
        let (links, timeout) = match s.net.as_ref() {
            Some(n) => {
                let (links, keepalive) = n.poll_fds_owned()?;
                (links, keepalive.map_or(timeout, |t| timeout.min(t.max(Duration::from_millis(1)))))
            }
            None => (Vec::new(), timeout),
        };
        Ok(PollSet { bells, links, timeout })
    }

    /// The longest [`wait`](Self::wait) blocks.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Blocks until `wake` or a doorbell rings, a link is ready, or the
    /// time passes; then reads the doorbells that rang.
    pub(super) fn wait(&self, wake: &Doorbell) {
        let mut fds: Vec<PollFd> = Vec::with_capacity(1 + self.bells.len() + self.links.len());
        fds.push(PollFd::new(wake, PollFlags::IN));
        for (_, bell) in &self.bells {
            fds.push(PollFd::from_borrowed_fd(bell.as_fd(), PollFlags::IN));
        }
        for (fd, flags) in &self.links {
            fds.push(PollFd::from_borrowed_fd(fd.as_fd(), *flags));
        }
        let t = self.timeout;
        let ts = rustix::time::Timespec { tv_sec: t.as_secs() as i64, tv_nsec: t.subsec_nanos() as i64 };
        if let Err(e) = rustix::event::poll(&mut fds, Some(&ts)) {
            if e != rustix::io::Errno::INTR {
                tracing::warn!(error = %e, "engine poll failed");
            }
        }
        // Only the doorbells that rang are read, and at most
        // DOORBELL_READS_PER_TENANT rings of one tenant's: a tenant that
        // floods its doorbells keeps the engine awake (as its posts could),
        // but cannot make it spend thousands of system calls per wake-up
        // while others wait. What is left unread wakes the next poll at once.
        let rang: Vec<bool> =
            fds[1..=self.bells.len()].iter().map(|f| f.revents().contains(PollFlags::IN)).collect();
        drop(fds);
        wake.drain();
        let mut spent: Vec<(TenantId, u64)> = Vec::new();
        for ((tenant, bell), _) in self.bells.iter().zip(rang).filter(|(_, rang)| *rang) {
            let i = match spent.iter().position(|(t, _)| t == tenant) {
                Some(i) => i,
                None => {
                    spent.push((*tenant, 0));
                    spent.len() - 1
                }
            };
            let left = DOORBELL_READS_PER_TENANT.saturating_sub(spent[i].1);
            spent[i].1 += bell.drain_at_most(left);
        }
    }
}
