//! Completion channels: where armed CQs report that they have work.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_core::proto::{self, Reply, Request};
use vrdma_shm::{Doorbell, RingView, Segment};

use crate::context::Context;
use crate::control;
use crate::error::{Error, Result};

/// A completion channel (`ibv_comp_channel`).
///
/// When a CQ armed with [`req_notify`](crate::CompletionQueue::req_notify)
/// gets a completion, the daemon pushes the CQ's number into the channel
/// and rings the channel's doorbell, whose descriptor [`fd`](Self::fd) can
/// be watched with `poll`/`epoll`. Events need no acknowledgement. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

#[derive(Debug)]
pub(crate) struct ChannelInner {
    pub(crate) ctx: Context,
    channel: u32,
    ring: RingView,
    pub(crate) event: Doorbell,
    /// CQs created on this channel and still alive.
    pub(crate) cqs: AtomicUsize,
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        self.ctx.inner.control.destroy(Request::DestroyCompChannel { channel: self.channel });
    }
}

impl ChannelInner {
    /// Pops one event: the CQ number, or `None` if the ring is empty.
    pub(crate) fn pop(&self, slot: &mut [u8]) -> Result<Option<u32>> {
        if self.ring.try_pop(slot)? {
            let cqn = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
            Ok(Some(cqn))
        } else {
            Ok(None)
        }
    }

    pub(crate) fn slot_buf(&self) -> Vec<u8> {
        vec![0u8; self.ring.stride()]
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
            let mut fds = answer.take_fds(2, "CompChannel")?.into_iter();
            let (seg_fd, event_fd) = match (fds.next(), fds.next()) {
                (Some(a), Some(b)) => (a, b),
                _ => return Err(Error::protocol("CompChannel reply lacks descriptors")),
            };
            let seg = Arc::new(Segment::map_trusted(
                seg_fd,
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
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: ctx.clone(),
                channel,
                ring,
                event,
                cqs: AtomicUsize::new(0),
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
        self.inner.event.as_fd()
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
    /// With `poll`/`epoll` on [`fd`](Self::fd): when the fd is readable,
    /// call this with a zero timeout until it returns `Ok(None)`. After an
    /// event is returned the fd may stay readable (for the next event, or
    /// spuriously); a call that finds no event consumes the stale
    /// readiness, so the fd does not stay readable for nothing.
    ///
    /// Fails, instead of waiting, once the daemon has gone away.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Result<Option<u32>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut slot = self.inner.slot_buf();
        if let Some(cqn) = self.spin_for_event(&mut slot, timeout)? {
            return Ok(Some(cqn));
        }
        loop {
            if let Some(cqn) = self.inner.pop(&mut slot)? {
                return Ok(Some(cqn));
            }
            // Nothing pending: the wake-ups still queued on the fd belong to
            // events already taken. Consume them, then look once more (an
            // event pushed before the drain is seen now, one pushed after it
            // rings again), so that the fd is not left readable for nothing.
            self.inner.event.drain();
            if let Some(cqn) = self.inner.pop(&mut slot)? {
                return Ok(Some(cqn));
            }
            // `None` when there is no limit (or one too far ahead).
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Ok(None);
            }
            self.inner.ctx.inner.control.wait_bell(&self.inner.event, left)?;
        }
    }

    /// Looks for an event in shared memory, yielding the CPU between looks,
    /// for up to [`event_spin`] before the caller goes to sleep on the fd.
    ///
    /// An event that comes within microseconds (the answer in a ping-pong)
    /// is then taken without a sleep and a wake-up, which cost more than
    /// the message itself; a quiet channel still sleeps after the window.
    fn spin_for_event(&self, slot: &mut [u8], timeout: Option<Duration>) -> Result<Option<u32>> {
        let window = event_spin().min(timeout.unwrap_or(Duration::MAX));
        let start = Instant::now();
        loop {
            if let Some(cqn) = self.inner.pop(slot)? {
                return Ok(Some(cqn));
            }
            if start.elapsed() >= window {
                return Ok(None);
            }
            std::thread::yield_now();
        }
    }

    /// How many events the daemon dropped because the channel's ring was
    /// full. A dropped event's CQ still holds its completions; poll it.
    pub fn events_dropped(&self) -> u32 {
        self.inner.ring.aux(proto::CHANNEL_AUX_DROPPED).load(Ordering::Relaxed)
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
