//! An rdma_cm event channel's descriptor (`rdma_event_channel.fd`): an
//! epoll instance over the daemon's doorbell and a wake-up of the
//! library's own.
//!
//! Why: the library answers some calls itself (a route's resolution,
//! whose event needs nothing the daemon has not told it already: see
//! `CmRequest::RouteReported`), and the event of such a call must make
//! the channel's descriptor readable exactly when the call returns, for a
//! program that polls the descriptor before `rdma_get_cm_event`. The
//! library cannot ring the daemon's doorbell itself (its end's sends go to
//! the daemon), and holding a copy of the daemon's end would keep the pair
//! alive when the daemon dies, which must hang the descriptor up
//! (DEVICE_REMOVAL). So the descriptor the program sees is an epoll
//! instance, readable (level-triggered) while either the doorbell is (an
//! event waits in the daemon, or it hung up) or the library's eventfd
//! counts a wake-up; `poll`, `select`, `epoll` and `fcntl(O_NONBLOCK)`
//! treat it as they treat the doorbell. Programs never `read` a channel's
//! descriptor (librdmacm reads its events with `rdma_get_cm_event`).
//!
//! The eventfd is the library's alone (no other process holds it), and it
//! counts as a semaphore: one wake-up per event the library made, taken
//! with that event.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{epoll, eventfd, EventfdFlags};
use rustix::io::Errno;
use vrdma_shm::Doorbell;

/// The descriptor the program polls, and the library's own wake-up.
#[derive(Debug)]
pub(crate) struct ChannelFd {
    poll: OwnedFd,
    local: OwnedFd,
}

impl ChannelFd {
    /// An epoll instance over `doorbell` and a fresh eventfd.
    pub(crate) fn new(doorbell: &Doorbell) -> io::Result<ChannelFd> {
        let local = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK | EventfdFlags::SEMAPHORE)?;
        let poll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        // Level-triggered: readable while either source is (a hung-up
        // doorbell reports EPOLLHUP, which makes the instance readable too).
        epoll::add(&poll, doorbell, epoll::EventData::new_u64(0), epoll::EventFlags::IN)?;
        epoll::add(&poll, &local, epoll::EventData::new_u64(1), epoll::EventFlags::IN)?;
        Ok(ChannelFd { poll, local })
    }

    /// One wake-up of the library's (never blocks: the counter holds far
    /// more than a channel's events).
    pub(crate) fn ring(&self) {
        loop {
            match rustix::io::write(&self.local, &1u64.to_ne_bytes()) {
                Err(Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "vrdma: an rdma_cm channel's own wake-up failed");
                    return;
                }
                Ok(_) => return,
            }
        }
    }

    /// Takes one wake-up of the library's; whether there was one.
    pub(crate) fn take_one(&self) -> bool {
        let mut buf = [0u8; 8];
        loop {
            match rustix::io::read(&self.local, &mut buf) {
                Err(Errno::INTR) => continue,
                Ok(8) => return true,
                Ok(_) | Err(_) => return false,
            }
        }
    }
}

impl AsFd for ChannelFd {
    /// The descriptor the program polls.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.poll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::event::{PollFd, PollFlags, Timespec};

    fn readable(fd: BorrowedFd<'_>) -> bool {
        let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
        matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
    }

    /// Readable exactly while the doorbell or the library's wake-up is;
    /// each of the library's wake-ups is taken once; a hung-up doorbell
    /// makes it readable for good.
    #[test]
    fn readable_while_either_source_is_and_when_the_daemon_hangs_up() {
        let (daemon, ours) = Doorbell::pair_with_hangup().unwrap();
        let fd = ChannelFd::new(&ours).unwrap();
        assert!(!readable(fd.as_fd()));
        fd.ring();
        fd.ring();
        assert!(readable(fd.as_fd()));
        assert!(fd.take_one());
        assert!(readable(fd.as_fd()), "one of two taken");
        assert!(fd.take_one());
        assert!(!fd.take_one());
        assert!(!readable(fd.as_fd()));
        assert!(daemon.ring_one());
        assert!(readable(fd.as_fd()));
        assert!(ours.take_one());
        assert!(!readable(fd.as_fd()));
        drop(daemon);
        assert!(readable(fd.as_fd()), "the daemon's end closed");
    }

    /// O_NONBLOCK on the descriptor changes nothing of the above.
    #[test]
    fn nonblocking_descriptor_still_wakes() {
        let (_daemon, ours) = Doorbell::pair_with_hangup().unwrap();
        let fd = ChannelFd::new(&ours).unwrap();
        let flags = rustix::fs::fcntl_getfl(fd.as_fd()).unwrap();
        rustix::fs::fcntl_setfl(fd.as_fd(), flags | rustix::fs::OFlags::NONBLOCK).unwrap();
        assert!(!readable(fd.as_fd()));
        fd.ring();
        assert!(readable(fd.as_fd()));
    }
}
