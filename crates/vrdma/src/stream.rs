//! Completions as an async stream, for tokio.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use tokio::io::unix::AsyncFd;
use vrdma_shm::Doorbell;

use crate::channel::ChannelInner;
use crate::cq::{CompletionQueue, WorkCompletion};
use crate::error::{Error, Result};

/// Completions taken from the ring per batch.
const BATCH: usize = 32;
/// Items yielded in a row before the stream lets other tasks run.
const BUDGET: u32 = 128;

/// A doorbell as tokio's reactor wants it.
#[derive(Debug)]
struct Bell(Doorbell);

impl AsRawFd for Bell {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// A duplicate of the context's control socket, watched only for the
/// daemon hanging up (never read).
#[derive(Debug)]
struct Hangup(OwnedFd);

impl AsRawFd for Hangup {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// An async stream of one CQ's completions
/// ([`CompletionQueue::stream`]).
///
/// It polls the CQ; when the CQ is empty it arms it, polls once more (a
/// completion may have arrived before the arming), and then waits for the
/// channel's doorbell through tokio's reactor. Implements
/// [`futures_core::Stream`]; [`next`](Self::next) is a convenience for
/// code without `futures`' `StreamExt`. It never ends on its own; once the
/// daemon has gone away (its control connection hung up) it yields an
/// error instead of waiting for ever.
#[derive(Debug)]
pub struct CompletionStream {
    cq: CompletionQueue,
    channel: Arc<ChannelInner>,
    /// A duplicate of the channel's doorbell descriptor, so that several
    /// streams on one channel each have their own reactor registration.
    fd: AsyncFd<Bell>,
    /// The control socket: it hangs up when the daemon goes away, which
    /// would otherwise leave the stream waiting for ever.
    hangup: AsyncFd<Hangup>,
    ready: VecDeque<WorkCompletion>,
    batch: Vec<WorkCompletion>,
    slot: Vec<u8>,
    yielded: u32,
}

impl CompletionStream {
    pub(crate) fn new(cq: CompletionQueue) -> Result<CompletionStream> {
        let ch = cq
            .channel()
            .ok_or_else(|| {
                Error::invalid("a completion stream needs a CQ created with a completion channel")
            })?
            .clone();
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::invalid("a completion stream must be created inside a tokio runtime"));
        }
        let dup = Bell(Doorbell::from_fd(ch.fd().try_clone_to_owned()?));
        // SAFETY: `dup` owns its descriptor and is moved into the
        // `AsyncFd`: it stays open, names the same doorbell, and returns
        // the same raw fd until the `AsyncFd` is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        let sock = Hangup(ch.inner.ctx.inner.control.hangup_fd().try_clone_to_owned()?);
        // SAFETY: as for `dup`: `sock` owns its descriptor and lives in the
        // `AsyncFd` until it is dropped.
        let hangup = unsafe { AsyncFd::register_with_interest(sock, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(CompletionStream {
            slot: ch.inner.slot_buf(),
            channel: ch.inner.clone(),
            cq,
            fd,
            hangup,
            ready: VecDeque::with_capacity(BATCH),
            batch: crate::cq::wc_buffer(BATCH),
            yielded: 0,
        })
    }

    /// The CQ this stream drains.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The next completion (never `None`: the stream does not end).
    pub async fn next(&mut self) -> Option<Result<WorkCompletion>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next_item(cx)).await
    }

    /// Moves what the CQ holds into `ready`; whether anything came.
    fn fill(&mut self) -> Result<bool> {
        let n = self.cq.inner.poll_raw(&mut self.batch)?;
        self.ready.extend(self.batch[..n].iter().copied());
        Ok(n > 0)
    }

    /// Fails once the daemon has hung up the control connection; else
    /// registers for that event and returns `Ok`.
    fn poll_hangup(&mut self, cx: &mut TaskContext<'_>) -> Result<()> {
        loop {
            match self.hangup.poll_read_ready(cx) {
                Poll::Pending => return Ok(()),
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Ready(Ok(mut guard)) => {
                    if guard.ready().is_read_closed() {
                        return Err(Error::Io(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "vrdmad closed the connection: the device is gone",
                        )));
                    }
                    // A reply to some control call: not ours to read.
                    guard.clear_ready();
                }
            }
        }
    }

    fn poll_next_item(&mut self, cx: &mut TaskContext<'_>) -> Poll<Option<Result<WorkCompletion>>> {
        loop {
            if let Some(wc) = self.ready.pop_front() {
                self.yielded += 1;
                if self.yielded > BUDGET {
                    // A CQ that never runs dry must not starve the other
                    // tasks of a current-thread runtime: step aside once.
                    self.yielded = 0;
                    self.ready.push_front(wc);
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                return Poll::Ready(Some(Ok(wc)));
            }
            match self.fill() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
            // Empty: arm, then look once more before sleeping.
            self.cq.inner.arm(false);
            match self.fill() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
            self.yielded = 0;
            if let Err(e) = self.poll_hangup(cx) {
                return Poll::Ready(Some(Err(e)));
            }
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            };
            // Take every pending event (each with its datagram: the
            // channel's readiness is counted, see CompletionChannel).
            let mut took = false;
            loop {
                match self.channel.take_or_clean(&mut self.slot) {
                    Ok(Some(_)) => took = true,
                    Ok(None) => break,
                    Err(e) => return Poll::Ready(Some(Err(e))),
                }
            }
            // Clear tokio's readiness only if the fd is really quiet now (a
            // newer wake-up arriving meanwhile keeps it set).
            if !guard.get_ref().get_ref().0.is_readable() {
                let _ = guard.try_io(|_| Err::<(), _>(io::ErrorKind::WouldBlock.into()));
            } else if !took {
                // Readable with no event: another thread's, or a stale
                // wake-up the channel drops after a while. Step aside.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
    }
}

impl futures_core::Stream for CompletionStream {
    type Item = Result<WorkCompletion>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_next_item(cx)
    }
}
