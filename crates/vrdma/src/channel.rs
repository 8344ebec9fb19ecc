//! Completion channels: where armed CQs report that they have work.
//!
//! # Quiet events
//!
//! Each event comes with a datagram on the channel's doorbell, so that its
//! fd is readable while an event is unread: one `send(2)` where the event
//! is raised and one `recv(2)` where it is taken, per event. A thread in
//! [`CompletionChannel::get_cq_event`] first looks for the event in shared
//! memory for a while ([`event_spin`]); an event raised meanwhile needs no
//! wake-up. So, while the channel serves one CQ, the spinning thread marks
//! that CQ's [`proto::CQ_AUX_WAITER`] word, the party raising an event (the
//! direct path's requester, or the engine) claims the mark instead of
//! ringing, and the thread takes the event without a datagram. The mark is
//! taken back before the thread sleeps on the fd, with one compare-and-swap
//! against the raiser's, so that an event is either claimed (and found by
//! the spinning thread) or rung. What this changes for a program that
//! `poll`s the fd: an event raised while one of its threads spins in
//! `get_cq_event` is taken by that thread without the fd ever becoming
//! readable for it.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_core::proto::{self, Reply, Request};
use vrdma_shm::{Doorbell, RingView, Segment};

use crate::channel_core::ChannelCore;
use crate::context::Context;
use crate::control;
use crate::error::{Error, Result};

/// A completion channel (`ibv_comp_channel`).
///
/// When a CQ armed with [`req_notify`](crate::CompletionQueue::req_notify)
/// gets a completion, the daemon pushes the CQ's number into the
/// channel's ring, then queues one datagram for it on the channel's
/// doorbell, whose descriptor [`fd`](Self::fd) can be watched with
/// `poll`/`epoll`. Taking an event takes its datagram too, so the fd is
/// readable exactly while an event is unread, as rdma-core's channel fd
/// is, except for an event raised while a thread waits in
/// [`get_cq_event`](Self::get_cq_event), which that thread takes without
/// a datagram (module docs, "Quiet events"). Events need no
/// acknowledgement. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

#[derive(Debug)]
pub(crate) struct ChannelInner {
    pub(crate) ctx: Context,
    channel: u32,
    /// The ring and the fd. Shared (weakly) with a guest's link, which
    /// matches the fd's wake-ups to the ring's events again when the VM
    /// moves (`crate::channel_core`).
    pub(crate) core: Arc<ChannelCore>,
    /// CQs created on this channel and still alive.
    pub(crate) cqs: AtomicUsize,
    /// Those CQs, for the events the direct path raises in their rings'
    /// aux words (looked at when the channel's ring is empty).
    direct: std::sync::Mutex<Vec<std::sync::Weak<crate::cq::CqInner>>>,
    /// When (ns since [`elapsed_ns`]'s origin, 0: not) the fd was first
    /// seen readable with no event; see `drop_stale`.
    stale_since: AtomicU64,
}

/// A spin's looks at the one CQ it watches between two full looks at the
/// channel (`spin_for_event`).
const FULL_LOOK_EVERY: u32 = 16;
/// A spin reads the clock every this many looks while it spins (and at
/// every look once it yields).
const CLOCK_EVERY: u32 = 16;

/// How long an event's wake-up is waited for once the event was taken.
const WAKEUP_WAIT: Duration = Duration::from_secs(1);
/// How long the fd may be readable with no event before the wake-up is
/// taken as stale.
const STALE_AFTER: Duration = Duration::from_millis(20);

/// Nanoseconds since the first call in this process (never 0 after it).
fn elapsed_ns() -> u64 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    (origin.elapsed().as_nanos() as u64).max(1)
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        self.ctx.inner.control.destroy(Request::DestroyCompChannel { channel: self.channel });
    }
}

impl ChannelInner {
    /// Takes one event: the CQ number, or `None` if the ring is empty.
    ///
    /// The daemon publishes each event, then queues its datagram on the
    /// doorbell; the datagram is taken with the event (waiting the moment
    /// it may take to come), so that the fd stays readable exactly while
    /// events are unread.
    pub(crate) fn take(&self, slot: &mut [u8]) -> Result<Option<u32>> {
        // An event and its wake-up are taken together, as far as a move's
        // resync is concerned (`channel_core`).
        let taking = self.core.taking();
        let next = self.core.ring.consumed();
        let (cqn, index) = if self.core.ring.try_pop(slot)? {
            (u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]), Some(next))
        } else {
            match self.take_direct() {
                Some(cqn) => (cqn, None),
                None => return Ok(None),
            }
        };
        self.stale_since.store(0, Ordering::Relaxed);
        if !self.quiet() && !self.core.event.take_one() {
            self.core.await_begins(taking, index);
            self.await_wakeup(index)?;
        }
        Ok(Some(cqn))
    }

    /// Called with an event just taken: ends any spin announced on the
    /// channel's CQs (a raiser that has not claimed yet rings), collects
    /// the claims made meanwhile, and says whether one of them (or one
    /// owed from before) stands for this event, which then has no
    /// datagram to take.
    fn quiet(&self) -> bool {
        let mut claimed = 0u32;
        {
            let d = self.direct.lock().unwrap_or_else(|p| p.into_inner());
            for cq in d.iter().filter_map(|w| w.upgrade()) {
                let w = cq.waiter();
                if w.load(Ordering::SeqCst) != proto::CQ_WAITER_IDLE
                    && w.swap(proto::CQ_WAITER_IDLE, Ordering::SeqCst) == proto::CQ_WAITER_CLAIMED
                {
                    claimed += 1;
                }
            }
        }
        if claimed > 0 {
            // One for this event; any more for events still unread (the
            // claims of two CQs, announced one after the other).
            self.core.quiet_owed.fetch_add(claimed - 1, Ordering::SeqCst);
            return true;
        }
        self.core.quiet_owed.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }

    /// Before a spin: marks the channel's CQ as watched from shared memory
    /// ("Quiet events"), when the channel serves one CQ and no other thread
    /// marked it; returns it, for [`end_spin`](Self::end_spin).
    fn announce_spin(&self) -> Option<Arc<crate::cq::CqInner>> {
        let d = self.direct.lock().unwrap_or_else(|p| p.into_inner());
        let mut live = d.iter().filter_map(|w| w.upgrade());
        let cq = live.next()?;
        if live.next().is_some() {
            return None;
        }
        cq.waiter()
            .compare_exchange(
                proto::CQ_WAITER_IDLE,
                proto::CQ_WAITER_SPINNING,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .ok()?;
        Some(cq)
    }

    /// Whether `cq`, the one CQ a spin watches, or the channel's ring may
    /// hold an event: the two words an event is published in before it is
    /// claimed (`cq::raise_event`, the engine's `notify_channel`). A look
    /// without the locks of [`take`](Self::take).
    fn may_hold_event(&self, cq: &crate::cq::CqInner) -> bool {
        self.core.ring.produced() != self.core.ring.consumed() || cq.has_direct_event()
    }

    /// After a spin that found nothing: takes the mark back. `false` when
    /// an event was claimed meanwhile (it is published: take it, without
    /// a datagram).
    fn end_spin(cq: &crate::cq::CqInner) -> bool {
        let w = cq.waiter();
        w.compare_exchange(
            proto::CQ_WAITER_SPINNING,
            proto::CQ_WAITER_IDLE,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) != Err(proto::CQ_WAITER_CLAIMED)
    }

    /// Registers a CQ created on this channel.
    pub(crate) fn watch(&self, cq: &Arc<crate::cq::CqInner>) {
        let mut d = self.direct.lock().unwrap_or_else(|p| p.into_inner());
        d.retain(|w| w.strong_count() > 0);
        d.push(Arc::downgrade(cq));
    }

    /// An event the direct path raised for one of the channel's CQs (each
    /// with its datagram, as the engine's): its CQ's number.
    fn take_direct(&self) -> Option<u32> {
        let d = self.direct.lock().unwrap_or_else(|p| p.into_inner());
        d.iter().filter_map(|w| w.upgrade()).find(|cq| cq.take_direct_event()).map(|cq| cq.cqn)
    }

    /// Takes the datagram of an event taken before it came. The daemon
    /// sends it right after publishing the event; should it never come
    /// (the daemon's estimate of the socket buffer was wrong), the wait
    /// ends after [`WAKEUP_WAIT`].
    fn await_wakeup(&self, index: Option<u32>) -> Result<()> {
        let end = Instant::now() + WAKEUP_WAIT;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::debug!(channel = self.channel, "an event came without its wake-up");
                self.core.await_ends(index, true);
                return Ok(());
            }
            if let Err(e) = self.ctx.inner.control.wait_readable(&self.core.event, Some(left)) {
                self.core.await_ends(index, true);
                return Err(e);
            }
            if self.core.await_ends(index, false) {
                return Ok(());
            }
        }
    }

    /// Called when the ring is empty: a datagram that stays readable that
    /// long with no event is stale (one [`await_wakeup`](Self::await_wakeup)
    /// gave up on), and is taken, so that the fd is not readable for
    /// nothing. Another thread that has just taken an event and not yet
    /// its datagram takes it within microseconds, well before.
    fn drop_stale(&self) {
        if !self.core.event.is_readable() {
            self.stale_since.store(0, Ordering::Relaxed);
            return;
        }
        let now = elapsed_ns();
        let since = self.stale_since.load(Ordering::Relaxed);
        if since == 0 {
            self.stale_since.store(now, Ordering::Relaxed);
        } else if now.saturating_sub(since) > STALE_AFTER.as_nanos() as u64 {
            self.core.event.take_one();
            self.stale_since.store(0, Ordering::Relaxed);
        }
    }

    /// [`take`](Self::take), and when the ring is empty, a look for a
    /// stale wake-up.
    pub(crate) fn take_or_clean(&self, slot: &mut [u8]) -> Result<Option<u32>> {
        let got = self.take(slot)?;
        if got.is_none() {
            self.drop_stale();
        }
        Ok(got)
    }

    pub(crate) fn slot_buf(&self) -> Vec<u8> {
        vec![0u8; self.core.ring.stride()]
    }
}

impl CompletionChannel {
    pub(crate) fn create(ctx: &Context) -> Result<CompletionChannel> {
        let req = Request::CreateCompChannel;
        let answer = ctx.inner.control.call(&req, &[])?;
        let Reply::CompChannel { channel, segment_len, ring } = answer.reply else {
            return Err(control::unexpected(&req, &answer.reply));
        };
        // From here on a failure must still destroy the daemon's channel.
        let setup = (|| -> Result<(RingView, Doorbell)> {
            let mut fds = answer.take_placed(2, "CompChannel")?.into_iter();
            let ((seg_fd, at), (event_fd, _)) = match (fds.next(), fds.next()) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(Error::protocol("CompChannel reply lacks descriptors")),
            };
            let seg = Arc::new(Segment::map_trusted_at(
                seg_fd,
                at,
                control::to_usize(segment_len, "channel segment length")?,
            )?);
            let ring = RingView::in_segment(
                seg,
                control::to_usize(ring.offset, "channel ring offset")?,
                ring.capacity,
                ring.stride as usize,
            )?;
            if ring.stride() < 4 {
                return Err(Error::protocol(format!(
                    "channel slots of {} bytes cannot hold a CQ number",
                    ring.stride()
                )));
            }
            Ok((ring, Doorbell::from_fd(event_fd)))
        })();
        let (ring, event) = match setup {
            Ok(x) => x,
            Err(e) => {
                ctx.inner.control.destroy(Request::DestroyCompChannel { channel });
                return Err(e);
            }
        };
        let core = Arc::new(ChannelCore::new(ring, event));
        if let Some(link) = ctx.inner.control.guest_link() {
            link.note_channel(channel, Arc::downgrade(&core));
        }
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: ctx.clone(),
                channel,
                core,
                cqs: AtomicUsize::new(0),
                direct: Default::default(),
                stale_since: AtomicU64::new(0),
            }),
        })
    }

    /// The daemon's number for this channel.
    pub fn channel_id(&self) -> u32 {
        self.inner.channel
    }

    /// The descriptor that becomes readable when an event is pending (the
    /// channel's doorbell; read it only through this type).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.core.event.as_fd()
    }

    /// `ibv_get_cq_event`: the number ([`cqn`](crate::CompletionQueue::cqn))
    /// of the next CQ that fired, waiting up to `timeout` (`None`: no
    /// limit). `Ok(None)` means the time ran out. A CQ fires once per
    /// [`req_notify`](crate::CompletionQueue::req_notify); re-arm it before
    /// draining it to catch the next completion.
    ///
    /// Events are consumed: if several threads or a
    /// [`CompletionStream`](crate::CompletionStream) also take events from
    /// this channel, each event goes to only one of them.
    ///
    /// With `poll`/`epoll` on [`fd`](Self::fd): the fd is readable exactly
    /// while an event is unread, as rdma-core's channel fd is, but for an
    /// event raised while a thread waits here, which it takes without the
    /// fd becoming readable (module docs, "Quiet events"). When it is
    /// readable this finds an event (unless another thread took it), and
    /// each event this returns takes the fd's readiness for it along.
    ///
    /// Fails, instead of waiting, once the daemon has gone away.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<Option<u32>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        // The daemon's slots are 8 bytes (CHANNEL_EVENT_SIZE): on the
        // stack, so that taking an event allocates nothing.
        let mut small = [0u8; 64];
        let mut large = Vec::new();
        let stride = self.inner.core.ring.stride();
        let slot: &mut [u8] = if stride <= small.len() {
            &mut small[..stride]
        } else {
            large.resize(stride, 0);
            &mut large
        };
        if let Some(cqn) = self.spin_for_event(slot, timeout)? {
            return Ok(Some(cqn));
        }
        let mut readable = false;
        loop {
            if let Some(cqn) = self.inner.take_or_clean(slot)? {
                return Ok(Some(cqn));
            }
            // `None` when there is no limit (or one too far ahead).
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            if readable {
                // Readable with no event: another thread's, about to be
                // taken, or stale (see `drop_stale`). Do not spin hot.
                std::thread::sleep(Duration::from_micros(200));
            }
            readable = self.inner.ctx.inner.control.wait_readable(&self.inner.core.event, left)?;
        }
    }

    /// Looks for an event in shared memory, yielding the CPU between looks,
    /// for up to [`event_spin`] before the caller goes to sleep on the fd.
    ///
    /// An event that comes within microseconds (the answer in a ping-pong)
    /// is then taken without a sleep and a wake-up, which cost more than
    /// the message itself; a quiet channel still sleeps after the window.
    ///
    /// While it looks, an event of the channel's CQ needs no wake-up
    /// ("Quiet events" above). As a NIC's interrupt moderation or the
    /// kernel's socket busy-polling, the spin is bounded (the window) and
    /// adapts to the peer, as an empty CQ poll does (`idle::spin_limit`):
    /// it spins where the program raising the CQ's events last ran on
    /// another CPU, yields at every look where it ran on this one (it can
    /// raise the event only once this thread lets go of the CPU), and
    /// spins the usual few looks otherwise. A look at the one CQ watched is
    /// two loads ([`ChannelInner::may_hold_event`]); the channel's locks
    /// are taken only when they show something, and every
    /// [`FULL_LOOK_EVERY`] looks.
    fn spin_for_event(&self, slot: &mut [u8], timeout: Option<Duration>) -> Result<Option<u32>> {
        let window = event_spin().min(timeout.unwrap_or(Duration::MAX));
        if window.is_zero() {
            return self.inner.take(slot);
        }
        let start = Instant::now();
        let spinner = self.inner.announce_spin();
        // Empty looks that spin before each further one yields: as an
        // empty poll of the CQ would (`idle`), so that an event a program
        // on another CPU raises is not waited for behind a trip through
        // the scheduler, and one that a program on this CPU raises is not
        // held up by looks it cannot answer before it runs.
        let peer = spinner.as_ref().map_or(crate::idle::Peer::Unknown, |cq| cq.peer());
        let spins = crate::idle::spin_limit(peer);
        let mut looks = 0u32;
        // Empty looks since the last full one (`FULL_LOOK_EVERY`).
        let mut cheap = 0u32;
        let got = (|| -> Result<Option<u32>> {
            loop {
                // While one CQ is watched, a look is two loads of shared
                // words until either shows an event; the channel's full
                // look (its locks) only then, and every few looks for a
                // CQ created on the channel meanwhile.
                let nothing = cheap < FULL_LOOK_EVERY
                    && spinner.as_ref().is_some_and(|cq| !self.inner.may_hold_event(cq));
                if nothing {
                    cheap += 1;
                } else {
                    cheap = 0;
                    if let Some(cqn) = self.inner.take(slot)? {
                        return Ok(Some(cqn));
                    }
                }
                let spinning = looks < spins;
                // The clock at every yield, and every few spinning looks.
                if (!spinning || looks.is_multiple_of(CLOCK_EVERY)) && start.elapsed() >= window {
                    match &spinner {
                        // Claimed meanwhile: the event is there (or another
                        // thread took it, and the mark with it).
                        Some(cq) if !ChannelInner::end_spin(cq) => {
                            cheap = FULL_LOOK_EVERY;
                            continue;
                        }
                        _ => return Ok(None),
                    }
                }
                if spinning {
                    looks += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        })();
        if got.is_err() {
            // A claim left here is collected by the next event taken.
            if let Some(cq) = &spinner {
                ChannelInner::end_spin(cq);
            }
        }
        got
    }

    /// How many events the daemon dropped because the channel's ring was
    /// full. A dropped event's CQ still holds its completions; poll it.
    pub fn events_dropped(&self) -> u32 {
        self.inner.core.ring.aux(proto::CHANNEL_AUX_DROPPED).load(Ordering::Relaxed)
    }

    /// The context the channel belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }
}

/// How long a wait on a completion channel polls shared memory before it
/// sleeps: `VRDMA_EVENT_SPIN_US` microseconds, 50 by default (the window
/// Linux's socket busy-polling uses); 0 sleeps at once.
pub fn event_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("VRDMA_EVENT_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
        Duration::from_micros(us)
    })
}
