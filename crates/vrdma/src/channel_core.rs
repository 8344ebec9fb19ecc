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

#[cfg(test)]
mod tests {
    use super::ChannelCore;
    use std::sync::atomic::Ordering;
    use vrdma_shm::{ring_bytes, Doorbell, RingView, Segment};

    /// A channel with `events` events pushed and `wakeups` of their
    /// wake-ups on its fd; the daemon's end of the fd.
    fn channel(events: u32, wakeups: u32) -> (ChannelCore, Doorbell) {
        let seg = std::sync::Arc::new(Segment::create("vrdma-test", ring_bytes(16, 8)).unwrap());
        let ring = RingView::in_segment(seg, 0, 16, 8).unwrap();
        for _ in 0..events {
            assert!(ring.try_push_bytes(&[7u8; 8]).unwrap());
        }
        let (daemon, library) = Doorbell::pair().unwrap();
        for _ in 0..wakeups {
            assert!(daemon.ring_one());
        }
        (ChannelCore::new(ring, library), daemon)
    }

    fn take(c: &ChannelCore) -> u32 {
        let next = c.ring.consumed();
        assert!(c.ring.try_pop(&mut [0u8; 8]).unwrap());
        next
    }

    /// The source's wake-ups go; each event from before the import still
    /// unread, or taken by a taker waiting for its wake-up, is rung again;
    /// the destination's events and quiet ones are not.
    #[test]
    fn a_move_rings_again_once_per_event_from_before_the_import_still_unread() {
        // Four events at the source, two wake-ups reached the VM.
        let (c, _daemon) = channel(4, 2);
        let raised_before = c.ring.produced();
        // A taker took the first and its wake-up; a second taker took the
        // next and found none (it waits).
        take(&c);
        assert!(c.event.take_one(), "the first's wake-up");
        let waiting = take(&c);
        let g = c.taking();
        c.await_begins(g, Some(waiting));
        // Two raised here since (their wake-ups come from the new doorbell).
        assert!(c.ring.try_push_bytes(&[7u8; 8]).unwrap());
        assert!(c.ring.try_push_bytes(&[7u8; 8]).unwrap());
        let mut rung = None;
        let (dropped, n) = c.moved(raised_before, |n| rung = Some(n));
        assert_eq!((dropped, n, rung), (1, 3, Some(3)), "two unread from before, one waited for");
        assert!(!c.event.is_readable(), "the source's wake-up is gone");
        // A quiet event owed lowers the count by one.
        let (c, _daemon) = channel(3, 0);
        c.quiet_owed.store(1, Ordering::SeqCst);
        assert_eq!(c.moved(c.ring.produced(), |_| {}).1, 2);
        // A taker waiting for an event raised here is not counted (its
        // wake-up comes from the destination).
        let (c, _daemon) = channel(1, 0);
        let raised_before = c.ring.produced();
        assert!(c.ring.try_push_bytes(&[7u8; 8]).unwrap());
        let _old = take(&c);
        let here = take(&c);
        let g = c.taking();
        c.await_begins(g, Some(here));
        assert_eq!(c.moved(raised_before, |_| {}).1, 0);
        // Its wait ends: no longer counted.
        assert!(c.await_ends(Some(here), true));
        assert!(c.taking().is_empty());
    }
}
