//! Where things lie in the shared segments the daemon hands out.
//!
//! Every ring has a 256-byte header with 32 auxiliary words (see
//! `vrdma-shm`'s `RingView::aux`); these constants say which word means what.

/// Context segment, async-event ring, aux word: non-zero while the engine
/// sleeps and wants a doorbell after a post.
pub const CTX_AUX_ENGINE_SLEEPING: usize = 0;
/// Context segment, async-event ring, aux word: events dropped because the
/// ring was full.
pub const CTX_AUX_EVENTS_DROPPED: usize = 1;
/// Slots of the async-event ring.
pub const ASYNC_RING_CAPACITY: u32 = 256;
pub const ASYNC_EVENT_SIZE: usize = 8;

/// Context segment, posted ring: the tenant names a QP here (its number,
/// little-endian, in the first 4 bytes of a slot) when it posts send WRs
/// to a send queue whose [`SQ_AUX_NOTIFIED`] word it found 0 and set to 1.
/// The engine serves only QPs with work, so a QP that was idle is found
/// through this ring rather than by looking at every QP in every pass.
pub const POSTED_RING_CAPACITY: u32 = 4096;
pub const POSTED_SLOT_SIZE: usize = 8;
/// Posted ring aux word: set to 1 by a tenant that found the ring full;
/// the engine then looks at every QP of the context once.
pub const POSTED_AUX_OVERFLOW: usize = 0;

/// A ring's header bytes before its slots (as `vrdma-shm`'s `RING_HEADER`).
pub const CONTEXT_RING_HEADER: u64 = 256;
/// A context segment's layout: the async-event ring at 0, the posted ring
/// at the first 64-byte boundary after it. Returns (posted ring's offset,
/// the segment's bytes). A VM's context segment is an extent of its region
/// and moves with it (`hca::migrate::placement`).
pub const fn context_segment_layout() -> (u64, u64) {
    let events = CONTEXT_RING_HEADER + ASYNC_RING_CAPACITY as u64 * ASYNC_EVENT_SIZE as u64;
    let posted_at = events.next_multiple_of(64);
    (posted_at, posted_at + CONTEXT_RING_HEADER + POSTED_RING_CAPACITY as u64 * POSTED_SLOT_SIZE as u64)
}

/// CQ ring aux word: the armed state written by the client.
pub const CQ_AUX_ARMED: usize = 0;
pub const CQ_ARM_NONE: u32 = 0;
pub const CQ_ARM_NEXT: u32 = 1;
pub const CQ_ARM_SOLICITED: u32 = 2;
/// CQ ring aux word: completions the client library holds outside the
/// ring (the direct path's local queue, `docs/direct-path.md`), written by
/// the client. They count against the CQ's depth: the engine refuses a
/// completion (a CQ overrun) when the ring's entries plus these fill it.
pub const CQ_AUX_LOCAL: usize = 1;
/// CQ ring aux word: events of this CQ that the direct path raised (the
/// party that completed into the CQ took the armed word with a swap, as
/// the engine does, and rang the channel's doorbell once) and that the
/// channel's owner has not taken yet; the owner's library looks here when
/// the channel's ring is empty (`docs/direct-path.md`).
pub const CQ_AUX_DIRECT_EVENTS: usize = 2;
/// CQ ring aux word: whether a thread of the CQ's owner is looking for
/// its channel's next event in shared memory (the spin at the start of
/// `get_cq_event`), so that whoever raises the CQ's event need not ring
/// the channel's doorbell. The owner sets [`CQ_WAITER_SPINNING`] (from
/// [`CQ_WAITER_IDLE`]) before it looks and takes it back before it sleeps
/// on the doorbell; a party that raises an event (the engine, or the
/// direct path) publishes the event first, then swaps SPINNING for
/// [`CQ_WAITER_CLAIMED`] and, if that swap succeeded, rings no doorbell.
/// The owner, taking an event, swaps the word back to IDLE and takes no
/// datagram for an event it finds CLAIMED: the doorbell's datagrams stay
/// as many as the unread events that were not claimed. Tenant-written; a
/// wrong value costs the tenant its own wake-ups, nothing else.
pub const CQ_AUX_WAITER: usize = 3;
pub const CQ_WAITER_IDLE: u32 = 0;
pub const CQ_WAITER_SPINNING: u32 = 1;
pub const CQ_WAITER_CLAIMED: u32 = 2;

/// Whether the event just published for a CQ whose ring holds `waiter`
/// (its [`CQ_AUX_WAITER`] word) goes to a waiter that is looking for it
/// in shared memory, and so needs no doorbell: swaps SPINNING for
/// CLAIMED. Call after the event is published.
pub fn claim_quiet_event(waiter: &std::sync::atomic::AtomicU32) -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    waiter.load(SeqCst) == CQ_WAITER_SPINNING
        && waiter.compare_exchange(CQ_WAITER_SPINNING, CQ_WAITER_CLAIMED, SeqCst, SeqCst).is_ok()
}

/// CQ ring aux words 16 to 31 (the header's second aux cache line): the
/// *ready set* of the CQ's inboxes (the direct path,
/// `docs/direct-path.md`, "Many QPs on one CQ"). A direct-path requester
/// that pushed a completion into the inbox of QP `qpn` sets the bit of
/// bucket [`cq_ready_bucket`]`(qpn)` in data word
/// `CQ_AUX_READY_FIRST + bucket / 32`, then bit `bucket / 32` of the
/// summary word [`CQ_AUX_READY_SUMMARY`]; the CQ's owner looks only at
/// the buckets whose bits are set, clearing each bit before it drains
/// that bucket's inboxes, so an empty poll reads one word whatever the
/// number of QPs. Tenant-written (both sides are the same tenant's
/// processes): a wrong bit costs the owner a look at an empty inbox, a
/// cleared one delays the tenant's own completions; every bucket index is
/// computed by the reader, never read from the words.
pub const CQ_AUX_READY_SUMMARY: usize = 16;
/// The first of the ready set's data words (see [`CQ_AUX_READY_SUMMARY`]).
pub const CQ_AUX_READY_FIRST: usize = 17;
/// The ready set's data words: aux words 17 to 31.
pub const CQ_READY_WORDS: usize = 15;
/// The ready set's buckets (32 per data word): QPs whose numbers are equal
/// modulo this share one.
pub const CQ_READY_BUCKETS: u32 = CQ_READY_WORDS as u32 * 32;

/// The ready-set bucket of the inbox of QP `qpn` (see
/// [`CQ_AUX_READY_SUMMARY`]).
pub const fn cq_ready_bucket(qpn: u32) -> u32 {
    qpn % CQ_READY_BUCKETS
}

/// Calls `f` with every bucket whose bit is set in a CQ's ready set, in
/// order; `aux(i)` reads the CQ ring's aux word `i`. The buckets are bit
/// positions, never numbers read from the words, so scribbled words name
/// only buckets of the set (bits of the summary that name no word are
/// ignored).
pub fn for_each_ready_bucket(aux: impl Fn(usize) -> u32, mut f: impl FnMut(u32)) {
    let mut summary = aux(CQ_AUX_READY_SUMMARY) & ((1u32 << CQ_READY_WORDS) - 1);
    while summary != 0 {
        let w = summary.trailing_zeros() as usize;
        summary &= summary - 1;
        let mut bits = aux(CQ_AUX_READY_FIRST + w);
        while bits != 0 {
            let b = bits.trailing_zeros();
            bits &= bits - 1;
            f(w as u32 * 32 + b);
        }
    }
}

/// Inbox ring aux words (the direct path's completions of a QP's
/// receives, `docs/direct-path.md`): receive completions of the QP the
/// engine pushed into its CQ's ring, and those the client polled from
/// there. A direct-path requester claims the QP's next receive only while
/// the two are equal, so that the CQ returns the QP's completions in order.
pub const INBOX_AUX_ENGINE_PUSHED: usize = 0;
pub const INBOX_AUX_ENGINE_POLLED: usize = 1;
/// Inbox ring aux word: the CPU, plus one, that the direct-path requester
/// ran on when it last completed into the inbox (0: not known). A hint for
/// the owner's polls only: while the requester seems to run on another
/// CPU, an empty poll spins on rather than yield its CPU to no one who is
/// needed (`vrdma::idle`). Tenant-written; nothing else reads it.
pub const INBOX_AUX_REQUESTER_CPU: usize = 2;
/// Inbox ring aux word: the inbox slot (its free-running index) where the
/// direct-path requester staged, as a flush, the completion of the
/// receive it is about to claim, stored before the claim. Whoever swaps it
/// from that index to the next one owns the slot's publication: the
/// requester once it has placed the message (it turns the completion into
/// a success and publishes it), or the daemon when it flushes the QP and
/// finds a claim without its completion (the requester stopped or died
/// between its claim and its push), which publishes the flush. So the
/// receive completes exactly once. Tenant-written: a forged value costs
/// the tenant its own QP's completions, nothing outside the inbox.
///
/// Word 16, the header's second aux cache line, alone: the requester
/// writes it twice per message and nobody else looks at it but the daemon
/// at a flush, while the first aux line holds the words the requester and
/// the owner read on every message or poll (`INBOX_AUX_ENGINE_*`,
/// `INBOX_AUX_REQUESTER_CPU`). Beside them, each message's two writes
/// took that line from the owner's spinning poll and gave it back.
pub const INBOX_AUX_STAGED: usize = 16;
// An aux word of the ring's header (32 of them), in every build.
const _: () = assert!(INBOX_AUX_STAGED < 32);
/// SRQ ring aux word: the SRQ's armed limit (0: disarmed), written by the
/// daemon when it is set and when its event fires. A direct-path
/// requester that claimed an SRQ's receive and finds fewer posted than
/// this asks the daemon to check the limit (`Request::DirectSrqLimit`);
/// the daemon's own state decides, so a scribbled word costs its tenant
/// calls, nothing else.
pub const SRQ_AUX_LIMIT: usize = 0;
/// SRQ ring aux word: whose turn it is to claim the SRQ's receives on
/// the direct path: 0 when no requester's, else the number, plus one, of
/// the responder QP (on this SRQ) whose requester takes it with a
/// compare-and-swap from 0, sets [`SRQ_CLAIMER_NOTED`] in it once it has
/// noted an index in [`SRQ_AUX_CLAIM_AT`] (so a value left there by an
/// earlier turn is never read as this one's), and gives it back with a
/// compare-and-swap once the claimed receive's completion is published
/// (or nothing was claimed). Direct-path requesters
/// claim one at a time, so that the daemon can tell which of them claimed
/// an index (the engine claims as ever, never waiting on it): when it
/// flushes a QP whose requester held the turn, the index in
/// [`SRQ_AUX_CLAIM_AT`], claimed and not by the engine, was that
/// requester's, and its staged completion is published as a flush on
/// that QP's CQ (`docs/direct-path.md`, "Receives from an SRQ"). The
/// daemon gives a turn back only once its holder cannot claim any more
/// (its QP gone, or the responder QP destroyed); a holder that finds the
/// turn no longer its own claims nothing.
/// Tenant-written: a forged value costs the tenant its own SRQ's direct
/// claims or publishes at most one staged slot of its own inbox.
pub const SRQ_AUX_CLAIMER: usize = 1;
/// In [`SRQ_AUX_CLAIMER`]: the holder noted the index it is claiming in
/// [`SRQ_AUX_CLAIM_AT`] (QP numbers have 24 bits, so it is never part of
/// one).
pub const SRQ_CLAIMER_NOTED: u32 = 1 << 31;
/// SRQ ring aux word: the consumer index the requester holding
/// [`SRQ_AUX_CLAIMER`] is about to claim, stored (`SeqCst`) before it
/// reads the index again and claims it; the engine reads it after each of
/// its own claims of the SRQ, so an index both tried is known to be the
/// engine's.
pub const SRQ_AUX_CLAIM_AT: usize = 2;
/// SRQ ring aux word: the inbox slot (free-running index) in which the
/// requester holding [`SRQ_AUX_CLAIMER`] staged the completion of the
/// receive it is claiming, stored before its claim. The daemon publishes
/// that slot only while the inbox's producer index still names it: a
/// requester killed after its publication and before it gave the turn
/// back gets nothing published a second time.
pub const SRQ_AUX_CLAIM_SLOT: usize = 3;

/// Whether a completion fires an armed CQ's event.
pub fn arm_fires(armed: u32, solicited: bool, success: bool) -> bool {
    match armed {
        CQ_ARM_NEXT => true,
        CQ_ARM_SOLICITED => solicited || !success,
        _ => false,
    }
}

/// Send ring aux word: the QP's state (`ibv_qp_state`), written by the daemon.
pub const SQ_AUX_STATE: usize = 0;
/// Send ring aux word: how many send WRs the device has retired (finished
/// with: completed, failed, flushed or dropped by a reset), a free-running
/// count in the numbering of the ring's producer index, written by the
/// daemon with `Release` before the completion of the WRs it counts. Each
/// send completion carries the count as of its WR ([`Cqe::sq_retired`]); a
/// client frees send slots as it polls those, and after a reset (which
/// drops the WRs without completions) catches up to this word.
///
/// [`Cqe::sq_retired`]: crate::ring::Cqe::sq_retired
pub const SQ_AUX_RETIRED: usize = 1;
/// Send ring aux word: 1 while the QP has been named in the posted ring
/// and the engine has not yet left it idle. A tenant that posts swaps in 1
/// (after a `SeqCst` fence that orders its slots before the swap) and
/// names the QP only if it swapped out 0; the engine stores 0, fences, and
/// looks at the ring once more before it leaves a QP idle. Either the
/// engine sees the slots or the tenant sees the 0.
pub const SQ_AUX_NOTIFIED: usize = 2;

/// Completion-channel ring: one slot per event, holding the CQ number.
pub const CHANNEL_RING_CAPACITY: u32 = 1024;
pub const CHANNEL_EVENT_SIZE: usize = 8;
/// Channel ring aux word: events dropped because the ring was full.
pub const CHANNEL_AUX_DROPPED: usize = 0;

#[cfg(test)]
mod tests {
    use super::*;

    /// The aux word a direct-path requester writes on every message
    /// (`INBOX_AUX_STAGED`) shares no cache line (16 words) with those the
    /// requester and the inbox's owner read on every message or poll.
    #[test]
    fn the_staged_word_has_an_aux_cache_line_of_its_own() {
        let line = |w: usize| w / 16;
        for read in [INBOX_AUX_ENGINE_PUSHED, INBOX_AUX_ENGINE_POLLED, INBOX_AUX_REQUESTER_CPU] {
            assert_ne!(line(INBOX_AUX_STAGED), line(read), "word {read}");
        }
    }
}
