//! Doorbells: one side rings, the other wakes.
//!
//! A ring's indices say *what* is pending; a doorbell only wakes the side
//! that should look. A doorbell is one end of a `SOCK_DGRAM` Unix socket
//! pair: ringing sends a byte to the other end, which becomes readable (and
//! so pollable, which is what a completion channel's or the async-event fd
//! must be).
//!
//! Why not an eventfd: both holders of an eventfd share one open file
//! description, so a tenant could clear `O_NONBLOCK` and then fill or empty
//! the counter until the daemon's `write` or `read` blocked, stalling the
//! device for everyone. Each end of a socket pair is its own open file
//! description, and every send and receive here passes `MSG_DONTWAIT`, so
//! nothing the other end does can make us block. A full socket buffer
//! means wake-ups are already pending, so a failed send is not lost.
//!
//! A completion channel's doorbell is counted instead: one datagram per
//! event ([`ring_one`](Doorbell::ring_one)), taken with the event
//! ([`take_one`](Doorbell::take_one)), so that its fd is readable exactly
//! while events are unread; [`reserve`](Doorbell::reserve) sizes the
//! buffer for that.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// Bytes of the sender's socket buffer one unread wake-up is counted for
/// (a one-byte datagram's true size is about 770 on x86-64 Linux).
const RING_COST: usize = 1024;

/// One end of a doorbell socket pair.
#[derive(Debug)]
pub struct Doorbell(OwnedFd);

impl Doorbell {
    /// Two connected ends: ringing either wakes the other.
    pub fn pair() -> io::Result<(Doorbell, Doorbell)> {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        Ok((Doorbell(a), Doorbell(b)))
    }

    /// Two connected ends, as [`pair`](Self::pair), except that when one is
    /// closed the other hangs up: it becomes readable for good (a read
    /// finds the end of the stream once the wake-ups are taken). For a
    /// descriptor a tenant polls that must wake it when the daemon goes
    /// away, as an rdma_cm event channel's does (DEVICE_REMOVAL): a
    /// datagram pair's survivor sees nothing when its peer closes.
    /// `SOCK_SEQPACKET`, whose sends Linux makes with the datagram code:
    /// the same wake-up per send and the same buffer accounting.
    pub fn pair_with_hangup() -> io::Result<(Doorbell, Doorbell)> {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        Ok((Doorbell(a), Doorbell(b)))
    }

    /// Sends `bytes` as one wake-up that carries them, but only while the
    /// other end has read every wake-up sent before (nothing of ours is
    /// unread in its buffer: `SIOCOUTQ` is 0): `false` otherwise, or if
    /// it could not go. For a pair made by
    /// [`pair_with_hangup`](Self::pair_with_hangup), whose messages keep
    /// their bounds. So at most one carrying wake-up is ever unread, and
    /// it is the oldest: the reader finds it first, with nothing before
    /// it to take.
    pub fn ring_carrying(&self, bytes: &[u8]) -> bool {
        let mut unread: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int, the bytes this end
        // sent that the other has not read, to the valid pointer given; the
        // descriptor is ours for as long as `self` lives.
        let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&self.0), libc::TIOCOUTQ, &mut unread) };
        if r != 0 || unread != 0 {
            return false;
        }
        loop {
            match rustix::net::send(&self.0, bytes, SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(n) => return n == bytes.len(),
                Err(Errno::INTR) => continue,
                Err(_) => return false,
            }
        }
    }

    /// The next wake-up, looked at without taking it, into `buf`: its
    /// length, and whether it was longer than `buf` (`None`: none waits,
    /// or an error; a length of 0 is the end of a pair with hang-up).
    pub fn peek(&self, buf: &mut [u8]) -> Option<(usize, bool)> {
        let room = buf.len();
        loop {
            match rustix::net::recv(
                &self.0,
                &mut *buf,
                RecvFlags::DONTWAIT | RecvFlags::PEEK | RecvFlags::TRUNC,
            ) {
                Ok((_, n)) => return Some((n.min(room), n > room)),
                Err(Errno::INTR) => continue,
                Err(_) => return None,
            }
        }
    }

    /// Whether the other end is gone (this end hung up).
    pub fn hung_up(&self) -> bool {
        let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
        matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
            && fds[0].revents().contains(PollFlags::HUP)
    }

    /// Whether a ring is pending at this end now, and whether the other
    /// end is gone (hung up), in one poll: what
    /// [`is_readable`](Self::is_readable) and [`hung_up`](Self::hung_up)
    /// say, for a waiter that asks both before it blocks.
    pub fn readable_and_hung_up(&self) -> (bool, bool) {
        let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })) {
            Ok(n) if n > 0 => (true, fds[0].revents().contains(PollFlags::HUP)),
            _ => (false, false),
        }
    }

    /// Wraps an end received from the daemon.
    pub fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell(fd)
    }

    /// Wakes the other end. Never blocks; a full buffer (`EAGAIN`) means a
    /// wake-up is already pending, and a closed peer needs none.
    pub fn ring(&self) {
        loop {
            match rustix::net::send(&self.0, &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(_) | Err(Errno::AGAIN) => return,
                Err(Errno::INTR) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "doorbell ring failed");
                    return;
                }
            }
        }
    }

    /// Queues exactly one wake-up, for a doorbell whose datagrams are
    /// counted (a completion channel's: one per event). Never blocks;
    /// returns whether the datagram was queued (`false`: the buffer is
    /// full, or the other end is closed).
    pub fn ring_one(&self) -> bool {
        loop {
            match rustix::net::send(&self.0, &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
                Ok(_) => return true,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return false,
                Err(e) => {
                    tracing::debug!(error = %e, "doorbell ring failed");
                    return false;
                }
            }
        }
    }

    /// Consumes one pending ring without blocking; returns whether there
    /// was one.
    pub fn take_one(&self) -> bool {
        let mut buf = [0u8; 16];
        loop {
            match rustix::net::recv(&self.0, &mut buf, RecvFlags::DONTWAIT) {
                // Every ring is one byte: nothing read is the end of the
                // stream of a pair with hang-up whose peer closed.
                Ok((0, _)) => return false,
                Ok(_) => return true,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => return false,
                Err(e) => {
                    tracing::debug!(error = %e, "doorbell take failed");
                    return false;
                }
            }
        }
    }

    /// Whether a ring is pending at this end now, without consuming it.
    pub fn is_readable(&self) -> bool {
        let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
        matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
    }

    /// Asks for room for about `rings` unread wake-ups sent from this end
    /// (the kernel caps the request at `net.core.wmem_max`), and returns
    /// how many unread wake-ups the buffer surely holds: each datagram
    /// costs some 770 bytes of the sender's buffer, counted here as 1024.
    pub fn reserve(&self, rings: usize) -> usize {
        // The kernel doubles the value asked for.
        let bytes = rings.saturating_mul(RING_COST) / 2;
        if let Err(e) = rustix::net::sockopt::set_socket_send_buffer_size(&self.0, bytes) {
            tracing::debug!(error = %e, "doorbell buffer size not set");
        }
        rustix::net::sockopt::socket_send_buffer_size(&self.0).map_or(0, |b| b / RING_COST)
    }

    /// Consumes every pending ring without blocking; returns how many.
    pub fn drain(&self) -> u64 {
        // Bounded: a socket buffer holds a bounded number of datagrams, and
        // a peer ringing as fast as we drain must not hold us here.
        self.drain_at_most(4096)
    }

    /// Consumes at most `most` pending rings without blocking; returns
    /// how many. Each ring is a system call: one who reads a doorbell that
    /// an untrusted peer may flood bounds what the peer can make it spend.
    pub fn drain_at_most(&self, most: u64) -> u64 {
        let mut buf = [0u8; 16];
        let mut n = 0u64;
        for _ in 0..most {
            match rustix::net::recv(&self.0, &mut buf, RecvFlags::DONTWAIT) {
                // The end of the stream (a hung-up pair): nothing more to take.
                Ok((0, _)) => break,
                Ok(_) => n += 1,
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "doorbell drain failed");
                    break;
                }
            }
        }
        n
    }

    /// Waits until the doorbell is readable or `timeout` passes (`None`:
    /// no limit), taking nothing. Returns whether it is readable.
    pub fn wait_readable(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let ts = timeout.and_then(|d| Timespec::try_from(d).ok());
        let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(0) | Err(Errno::INTR) => Ok(false),
            Ok(_) if fds[0].revents().intersects(PollFlags::ERR | PollFlags::NVAL | PollFlags::HUP) => {
                Err(io::Error::new(io::ErrorKind::ConnectionAborted, "doorbell closed by its peer"))
            }
            Ok(_) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits until the doorbell rings or `timeout` passes (`None`: no
    /// limit), then drains it. Returns whether it had rung.
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let left = match (timeout, deadline) {
                (None, _) => None,
                (Some(_), Some(d)) => Some(d.saturating_duration_since(Instant::now())),
                // A timeout too far ahead for Instant: wait without limit.
                (Some(_), None) => None,
            };
            // A timeout too large for a timespec also means "no limit".
            let ts = left.and_then(|d| Timespec::try_from(d).ok());
            let mut fds = [PollFd::new(&self.0, PollFlags::IN)];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(0) => return Ok(false),
                Ok(_) => {
                    let rev = fds[0].revents();
                    if rev.intersects(PollFlags::ERR | PollFlags::NVAL) {
                        return Err(io::Error::other("doorbell poll error"));
                    }
                    if self.drain() > 0 {
                        return Ok(true);
                    }
                    // Hung up (a pair with hang-up whose peer closed), with
                    // nothing left to take: readable for good, never rung.
                    if rev.contains(PollFlags::HUP) {
                        return Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "doorbell closed by its peer",
                        ));
                    }
                    // Someone else drained it first: wait again.
                    if left == Some(Duration::ZERO) {
                        return Ok(false);
                    }
                }
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl From<Doorbell> for OwnedFd {
    fn from(d: Doorbell) -> OwnedFd {
        d.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_and_drain() {
        let (a, b) = Doorbell::pair().unwrap();
        assert_eq!(b.drain(), 0);
        a.ring();
        a.ring();
        assert_eq!(b.drain(), 2);
        assert_eq!(b.drain(), 0);
        b.ring();
        assert_eq!(a.drain(), 1);
    }

    /// A pair with hang-up counts wake-ups as a datagram pair does, and its
    /// survivor turns readable (hung up) when the other end closes, where
    /// a datagram pair's stays quiet.
    #[test]
    fn a_pair_with_hangup_counts_and_wakes_its_survivor() {
        let (a, b) = Doorbell::pair_with_hangup().unwrap();
        assert!(a.ring_one() && a.ring_one());
        assert!(b.take_one() && b.take_one());
        assert!(!b.take_one() && !b.is_readable() && !b.hung_up());
        assert_eq!(b.readable_and_hung_up(), (false, false));
        assert!(a.ring_one());
        assert_eq!(b.readable_and_hung_up(), (true, false));
        assert!(b.take_one());
        drop(a);
        assert!(b.is_readable() && b.hung_up());
        assert_eq!(b.readable_and_hung_up(), (true, true));
        // The end of the stream is no wake-up: taking and draining stop.
        assert!(!b.take_one());
        assert_eq!(b.drain(), 0);
        assert!(b.wait_readable(Some(Duration::from_secs(1))).is_err(), "closed by its peer");
        let (a, b) = Doorbell::pair().unwrap();
        drop(a);
        assert!(!b.is_readable() && !b.hung_up(), "why the pair with hang-up exists");
    }

    #[test]
    fn a_full_buffer_does_not_block() {
        let (a, b) = Doorbell::pair().unwrap();
        for _ in 0..100_000 {
            a.ring();
        }
        assert!(b.drain() > 0);
    }

    #[test]
    fn the_other_end_cannot_make_us_block() {
        let (a, b) = Doorbell::pair().unwrap();
        // The peer clears O_NONBLOCK on its end; ours is a separate open
        // file description, and we pass MSG_DONTWAIT anyway.
        rustix::fs::fcntl_setfl(&b.0, rustix::fs::OFlags::empty()).unwrap();
        rustix::fs::fcntl_setfl(&a.0, rustix::fs::OFlags::empty()).unwrap();
        assert_eq!(a.drain(), 0);
        for _ in 0..100_000 {
            a.ring();
        }
    }

    #[test]
    fn wait_timeout_behaviour() {
        let (a, b) = Doorbell::pair().unwrap();
        assert!(!b.wait_timeout(Some(Duration::from_millis(10))).unwrap());
        a.ring();
        assert!(b.wait_timeout(Some(Duration::from_millis(10))).unwrap());
        assert!(!b.wait_timeout(Some(Duration::ZERO)).unwrap());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            a.ring();
        });
        assert!(b.wait_timeout(None).unwrap());
        t.join().unwrap();
    }

    #[test]
    fn counted_rings() {
        let (a, b) = Doorbell::pair().unwrap();
        assert!(!b.is_readable() && !b.take_one());
        assert!(a.ring_one() && a.ring_one());
        assert!(b.is_readable());
        assert!(b.take_one());
        assert!(b.is_readable());
        assert!(b.take_one());
        assert!(!b.is_readable() && !b.take_one());
    }

    #[test]
    fn reserve_makes_room_for_more_rings() {
        let count = |reserve: Option<usize>| {
            let (a, _b) = Doorbell::pair().unwrap();
            let promised = reserve.map(|n| a.reserve(n));
            let mut n = 0;
            while n < 100_000 && a.ring_one() {
                n += 1;
            }
            if let Some(p) = promised {
                assert!(p >= 100 && p <= n, "promised {p}, held {n}");
            }
            n
        };
        let plain = count(None);
        assert!(plain > 100, "{plain}");
        assert!(count(Some(4096)) >= plain);
    }

    #[test]
    fn a_closed_peer_is_not_an_error() {
        let (a, b) = Doorbell::pair().unwrap();
        drop(b);
        a.ring();
        assert_eq!(a.drain(), 0);
    }
}
