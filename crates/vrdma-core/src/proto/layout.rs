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

/// CQ ring aux word: the armed state written by the client.
pub const CQ_AUX_ARMED: usize = 0;
pub const CQ_ARM_NONE: u32 = 0;
pub const CQ_ARM_NEXT: u32 = 1;
pub const CQ_ARM_SOLICITED: u32 = 2;

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

/// Completion-channel ring: one slot per event, holding the CQ number.
pub const CHANNEL_RING_CAPACITY: u32 = 1024;
pub const CHANNEL_EVENT_SIZE: usize = 8;
/// Channel ring aux word: events dropped because the ring was full.
pub const CHANNEL_AUX_DROPPED: usize = 0;
