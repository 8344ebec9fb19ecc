//! The part of a completion channel that a guest's move reaches: its ring,
//! its fd, and what keeps the fd's wake-ups matched to the ring's events.
//!
//! Each unread event has one wake-up (a datagram) on the channel's fd, or
//! is "quiet" (`channel`'s module docs). When the VM moves, the events
//! move (the ring is in the VM's region) but some wake-ups do not: those
//! the source daemon sent after QEMU stopped the VM, or that were still in
//! the port's stream, are lost with the source. So the guest's link, once
//! it has taken its context back (`guest::reattach`), calls
//! [`ChannelCore::moved`]: with every taker held off, it drops the
//! wake-ups the fd still holds from the source and rings again once for
//! each event from before the import still unread (the destination says
//! which: `proto::MovedChannel`), counting those a taker took and waits
//! for the wake-up of. The destination's own events come with their
//! wake-ups after that (a taker waiting for one gets it then). So the fd is readable exactly while
//! an event is unread, across the move, whatever the application did
//! meanwhile (`docs/migration.md`, "Completion channels").

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use vrdma_shm::{Doorbell, RingView};

#[derive(Debug)]
pub(crate) struct ChannelCore {
    pub ring: RingView,
    /// The channel's fd: the library's end of its doorbell.
    pub event: Doorbell,
    /// Claimed events (raised without a datagram, "Quiet events") whose
    /// claims were collected when another event was taken: as many events
    /// still to be taken need no datagram.
    pub quiet_owed: AtomicU32,
    /// Held by a taker from an event's pop to its wake-up's take (or to
    /// the start of its wait for it), and by [`Self::moved`]: the ring
    /// indices of the events whose takers wait for their wake-ups.
    taking: Mutex<Vec<u32>>,
}

/// Most wake-ups a moved channel's fd can hold from the source: one per
/// unread event, at most its ring's capacity (and a little, for any stale
/// one).
const DROP_AT_MOST: u64 = 2 * vrdma_core::proto::CHANNEL_RING_CAPACITY as u64;

impl ChannelCore {
    pub fn new(ring: RingView, event: Doorbell) -> ChannelCore {
        ChannelCore { ring, event, quiet_owed: AtomicU32::new(0), taking: Mutex::new(Vec::new()) }
    }

    /// Holds off [`moved`](Self::moved) while an event is taken.
    pub fn taking(&self) -> MutexGuard<'_, Vec<u32>> {
        // A taker that panicked left nothing half done under it.
        self.taking.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A taker popped the event of ring index `index` (`None`: one the
    /// direct path raised, not in the ring) and found no wake-up for it:
    /// it waits for one, after letting go of `guard`.
    pub fn await_begins(&self, mut guard: MutexGuard<'_, Vec<u32>>, index: Option<u32>) {
        guard.extend(index);
    }

    /// Takes the wake-up the taker of `index` waits for, if it came (or
    /// ends its wait when `give_up`): whether it is done waiting.
    pub fn await_ends(&self, index: Option<u32>, give_up: bool) -> bool {
        let mut waiting = self.taking();
        if give_up || self.event.take_one() {
            if let Some(at) = index.and_then(|i| waiting.iter().position(|&w| w == i)) {
                waiting.swap_remove(at);
            }
            return true;
        }
        false
    }

    /// The VM moved and its link took the context back: the wake-ups from
    /// the source go, and `ring_again(n)` rings the channel's fd (through
    /// its new proxy) once for each event raised before the import
    /// (`raised_before`, the ring's producer index then) still unread or
    /// taken by a taker that waits for its wake-up, less the quiet events
    /// owed. Returns how many went and how many were rung.
    pub fn moved(&self, raised_before: u32, ring_again: impl FnOnce(u32)) -> (u64, u32) {
        let waiting = self.taking();
        let dropped = self.event.drain_at_most(DROP_AT_MOST);
        let owed = self.quiet_owed.load(Ordering::SeqCst);
        // Indices are within a ring's capacity of each other: before the
        // import when `raised_before` is ahead.
        let waiting_old = waiting.iter().filter(|&&i| (raised_before.wrapping_sub(i) as i32) > 0).count();
        let n =
            self.ring.unread_before(raised_before).saturating_add(waiting_old as u32).saturating_sub(owed);
        ring_again(n);
        (dropped, n)
    }
}
