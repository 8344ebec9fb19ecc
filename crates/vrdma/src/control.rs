//! The control socket: one request, one reply, descriptors alongside.
//!
//! Every exchange is a single `SOCK_SEQPACKET` message each way: the
//! postcard-encoded [`Request`] with the descriptors it carries, then the
//! [`Reply`] with those the daemon hands back. One request is in flight per
//! connection, so the socket sits behind a mutex. If an exchange breaks
//! half-way (an I/O error after the request went out, a truncated reply)
//! the connection is marked broken: a later reply could otherwise be taken
//! for the answer to a different request.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use vrdma_core::proto::{self, Reply, Request};
use vrdma_shm::{spin, Doorbell, Segment};

use crate::error::{Error, Result};

struct State {
    sock: OwnedFd,
    buf: Vec<u8>,
    broken: bool,
    /// Requests sent with [`Control::send_deferred`] whose replies are
    /// still to be read, oldest first: each is handed its reply (`None`
    /// where it broke or was an error).
    deferred: std::collections::VecDeque<Deferred>,
}

/// What takes a deferred request's reply.
pub(crate) type Deferred = Box<dyn FnOnce(Option<Reply>) + Send>;

/// Most requests sent ahead of their replies: far more than the library
/// ever has (one spare rdma_cm id per channel at a time), and a bound on
/// how far a connection may run ahead of its reader.
const MAX_DEFERRED: usize = 16;

/// A connection to the daemon.
pub(crate) struct Control {
    state: Mutex<State>,
    /// The socket's descriptor number, to watch for the daemon hanging up
    /// without taking the lock (`State::sock` owns it for as long as
    /// `self` lives and is never replaced).
    raw: RawFd,
    /// In guest mode: the port the calls go through (`State::sock` is
    /// then the link's hang-up descriptor).
    guest: Option<crate::guest::GuestLink>,
    /// The chunks of this context's ring pool mapped so far, by number
    /// (`Reply::Pooled`): each mapped once, for the context's life.
    chunks: Mutex<HashMap<u32, Arc<Segment>>>,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control").finish_non_exhaustive()
    }
}

/// A reply and the descriptors that came with it.
#[derive(Debug)]
pub(crate) struct Answer {
    pub reply: Reply,
    pub fds: Vec<OwnedFd>,
    /// Per descriptor, the offset its memory starts at: 0 from a host
    /// daemon (a memfd each), the extent's offset in the BAR in guest
    /// mode.
    pub offsets: Vec<u64>,
    /// For a reply the daemon sent as `Reply::Pooled`: per ring, its
    /// segment (the descriptors are then all taken).
    pub rings: Option<Vec<Placed>>,
}

/// Where a ring's segment comes from: a descriptor to map (and the offset
/// its memory starts at), or a ring pool chunk this context has mapped.
#[derive(Debug)]
pub(crate) enum Placed {
    Fd(OwnedFd, u64),
    Mapped(Arc<Segment>),
}

impl Placed {
    /// The segment, `len` bytes, mapped if it is not yet.
    pub fn segment(self, len: u64, what: &str) -> Result<Arc<Segment>> {
        let len = to_usize(len, what)?;
        match self {
            Placed::Fd(fd, at) => Ok(Arc::new(Segment::map_trusted_at(fd, at, len)?)),
            Placed::Mapped(seg) if seg.len() >= len => Ok(seg),
            Placed::Mapped(seg) => {
                Err(Error::protocol(format!("{what} of {len} bytes in a pool chunk of {} bytes", seg.len())))
            }
        }
    }
}

impl Answer {
    /// The segments of the `n` rings a reply of `what` places.
    pub fn take_rings(self, n: usize, what: &str) -> Result<Vec<Placed>> {
        match self.rings {
            Some(rings) if rings.len() == n => Ok(rings),
            Some(rings) => {
                Err(Error::protocol(format!("{what} reply placed {} rings, expected {n}", rings.len())))
            }
            None => Ok(self.take_placed(n, what)?.into_iter().map(|(fd, at)| Placed::Fd(fd, at)).collect()),
        }
    }

    /// The descriptors with their offsets, which must be exactly `n`.
    pub fn take_placed(self, n: usize, what: &str) -> Result<Vec<(OwnedFd, u64)>> {
        let offsets = self.offsets.clone();
        Ok(self.take_fds(n, what)?.into_iter().zip(offsets.into_iter().chain(std::iter::repeat(0))).collect())
    }

    /// The descriptors, which must be exactly `n` for a reply of `what`.
    pub fn take_fds(self, n: usize, what: &str) -> Result<Vec<OwnedFd>> {
        if self.fds.len() != n {
            return Err(Error::protocol(format!(
                "{what} reply came with {} descriptors, expected {n}",
                self.fds.len()
            )));
        }
        Ok(self.fds)
    }
}

impl Control {
    /// Connects a close-on-exec `SOCK_SEQPACKET` socket to `path`.
    pub fn connect(path: &Path) -> Result<Control> {
        let sock =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let addr = SocketAddrUnix::new(path)?;
        loop {
            match rustix::net::connect(&sock, &addr) {
                Ok(()) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(Error::Connect { path: path.to_path_buf(), source: e.into() }),
            }
        }
        Ok(Control::from_socket(sock))
    }

    /// Uses an already connected socket.
    pub fn from_socket(sock: OwnedFd) -> Control {
        let raw = sock.as_raw_fd();
        Control {
            state: Mutex::new(State {
                sock,
                buf: vec![0; proto::MAX_MESSAGE],
                broken: false,
                deferred: Default::default(),
            }),
            raw,
            guest: None,
            chunks: Mutex::default(),
        }
    }

    /// Calls through a guest's port (`crate::guest`).
    pub fn guest(link: crate::guest::GuestLink) -> Result<Control> {
        let sock = link.gone_fd().try_clone()?;
        let raw = sock.as_raw_fd();
        Ok(Control {
            state: Mutex::new(State { sock, buf: Vec::new(), broken: false, deferred: Default::default() }),
            raw,
            guest: Some(link),
            chunks: Mutex::default(),
        })
    }

    /// The guest link, in guest mode.
    pub fn guest_link(&self) -> Option<&crate::guest::GuestLink> {
        self.guest.as_ref()
    }

    /// The socket, to be polled for `POLLRDHUP`/`POLLHUP` only (reading
    /// it is `call`'s business): it hangs up when the daemon goes away.
    pub fn hangup_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `raw` is the descriptor owned by `self.state`'s socket,
        // which is neither closed nor replaced while `self` lives, and the
        // borrow cannot outlive `self`.
        unsafe { BorrowedFd::borrow_raw(self.raw) }
    }

    /// Waits until `bell` rings (then drains it: `Ok(true)`) or `timeout`
    /// passes (`Ok(false)`; `None`: no limit), like
    /// [`Doorbell::wait_timeout`], but fails as soon as the daemon hangs
    /// up the control connection: a daemon that died rings nothing, and a
    /// wait for it must not last for ever.
    pub fn wait_bell(&self, bell: &Doorbell, timeout: Option<Duration>) -> Result<bool> {
        self.wait_on(bell.as_fd(), timeout, Some(bell))
    }

    /// Waits like [`wait_bell`](Self::wait_bell) until `bell` is readable,
    /// but consumes nothing: for a completion channel, whose datagrams are
    /// counted (one per event) and taken with their events.
    pub fn wait_readable(&self, bell: &Doorbell, timeout: Option<Duration>) -> Result<bool> {
        self.wait_on(bell.as_fd(), timeout, None)
    }

    /// [`wait_readable`](Self::wait_readable) on any pollable descriptor
    /// (an rdma_cm channel's epoll instance), after a short look where
    /// cores are spare (`vrdma_shm::spin`: an rdma_cm event usually comes
    /// within tens of microseconds of the call that caused it).
    pub fn wait_fd_readable(&self, fd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<bool> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let look = timeout.map_or(spin::budget(), |t| t.min(spin::budget()));
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        let mut fds = [
            PollFd::from_borrowed_fd(fd, PollFlags::IN),
            PollFd::from_borrowed_fd(self.hangup_fd(), PollFlags::RDHUP),
        ];
        spin::spin_until(look, || matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0));
        self.wait_on(fd, timeout, None)
    }

    /// Waits until `bell` is readable; with `drain`, the doorbell `bell`
    /// is, drains it and waits again if it held nothing.
    fn wait_on(
        &self,
        bell: BorrowedFd<'_>,
        timeout: Option<Duration>,
        drain: Option<&Doorbell>,
    ) -> Result<bool> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let sock = self.hangup_fd();
        loop {
            let left = match (timeout, deadline) {
                (Some(_), Some(d)) => Some(d.saturating_duration_since(Instant::now())),
                // No limit, or one too far ahead to represent.
                _ => None,
            };
            let ts = left.and_then(|d| Timespec::try_from(d).ok());
            let mut fds = [
                PollFd::from_borrowed_fd(bell, PollFlags::IN),
                PollFd::from_borrowed_fd(sock, PollFlags::RDHUP),
            ];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(0) => return Ok(false),
                Ok(_) => {
                    if fds[1].revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR) {
                        return Err(gone());
                    }
                    let rev = fds[0].revents();
                    if rev.intersects(PollFlags::ERR | PollFlags::NVAL) {
                        return Err(Error::Io(io::Error::other("doorbell poll error")));
                    }
                    if drain.is_none_or(|d| d.drain() > 0) {
                        return Ok(true);
                    }
                    // A bell that hangs up when the daemon goes (the
                    // async-event signal) and has nothing left: the daemon
                    // is going, whichever of its descriptors closes first.
                    if rev.contains(PollFlags::HUP) {
                        return Err(gone());
                    }
                    // Someone else drained it first: wait again.
                    if left == Some(Duration::ZERO) {
                        return Ok(false);
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether the daemon hung up this connection (it died, or was
    /// stopped): a look, without waiting.
    pub fn hung_up(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::from_borrowed_fd(self.hangup_fd(), PollFlags::RDHUP)];
        matches!(rustix::event::poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
            && fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panic (at worst `broken` is
        // set), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `req` with `fds` and returns the daemon's answer.
    ///
    /// `Reply::Error` becomes [`Error::Daemon`] with its errno.
    pub fn call(&self, req: &Request, fds: &[BorrowedFd<'_>]) -> Result<Answer> {
        self.call_noting(req, fds, |_| ()).map(|(answer, ())| answer)
    }

    /// [`call`](Self::call), with `note` run on the reply (not an error's)
    /// before the connection is free for another call: what `note` does
    /// comes before what any later call's caller does with its own reply.
    /// The connection manager keeps the events a reply hands over so
    /// (`cm`), in the order the daemon sent them, which is the order of
    /// the calls it served. (`note` sees a pooled reply's inner reply, and
    /// must not call the daemon itself.)
    pub fn call_noting<R>(
        &self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
        note: impl FnOnce(&Reply) -> R,
    ) -> Result<(Answer, R)> {
        if let Some(g) = &self.guest {
            if !fds.is_empty() {
                return Err(Error::protocol("a guest cannot pass descriptors to the daemon"));
            }
            let ((reply, placed), noted) =
                g.call_noting(req, |reply| (!matches!(reply, Reply::Error { .. })).then(|| note(reply)))?;
            if let Reply::Error { errno, message } = reply {
                return Err(Error::Daemon { errno, message });
            }
            let noted = noted.ok_or_else(|| Error::protocol("a reply not noted"))?;
            let (fds, offsets) = placed.into_iter().unzip();
            return Ok((Answer { reply, fds, offsets, rings: None }, noted));
        }
        let bytes = proto::encode_request(req);
        let mut st = self.lock();
        if st.broken {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection to vrdmad is broken",
            )));
        }
        // A failed send leaves the connection in step: nothing went out.
        // (A partial send cannot happen on seqpacket; treat it as broken.)
        if let Err(e) = vrdma_shm::send_msg(st.sock.as_fd(), &bytes, fds) {
            if e.kind() == io::ErrorKind::WriteZero {
                st.broken = true;
            }
            return Err(e.into());
        }
        // A short look for the (first) reply before blocking on it, where
        // cores are spare (`vrdma_shm::spin`).
        spin::before_blocking_on(st.sock.as_fd());
        Self::read_deferred(&mut st)?;
        let (reply, fds) = Self::recv_reply(&mut st)?;
        if let Reply::Error { errno, message } = reply {
            return Err(Error::Daemon { errno, message });
        }
        let noted = note(match &reply {
            Reply::Pooled { reply, .. } => reply,
            reply => reply,
        });
        drop(st);
        match reply {
            Reply::Pooled { rings, reply } => {
                let placed = self.place(&rings, fds)?;
                Ok((
                    Answer { reply: *reply, fds: Vec::new(), offsets: Vec::new(), rings: Some(placed) },
                    noted,
                ))
            }
            reply => Ok((Answer { reply, offsets: vec![0; fds.len()], fds, rings: None }, noted)),
        }
    }

    /// One reply off the socket, decoded; the connection is marked broken
    /// where it cannot be.
    fn recv_reply(st: &mut State) -> Result<(Reply, Vec<OwnedFd>)> {
        let State { sock, buf, broken, .. } = st;
        let received = match vrdma_shm::recv_msg(sock.as_fd(), buf, proto::MAX_REPLY_FDS) {
            Ok(r) => r,
            Err(e) => {
                *broken = true;
                return Err(e.into());
            }
        };
        if received.len == 0 {
            *broken = true;
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "vrdmad closed the connection",
            )));
        }
        if received.truncated {
            *broken = true;
            return Err(Error::protocol("reply truncated"));
        }
        let reply = proto::decode_reply(&buf[..received.len])
            .map_err(|e| Error::protocol(format!("undecodable reply: {e}")))?;
        Ok((reply, received.fds))
    }

    /// Reads the replies of the requests sent ahead (they come before any
    /// later request's) and hands each to its taker; a reply that fails
    /// to arrive breaks the connection, and its takers get `None`.
    fn read_deferred(st: &mut State) -> Result<()> {
        while let Some(take) = st.deferred.pop_front() {
            match Self::recv_reply(st) {
                // (Such requests are answered without descriptors; any
                // that came are closed here.)
                Ok((Reply::Error { .. }, _)) => take(None),
                Ok((reply, _)) => take(Some(reply)),
                Err(e) => {
                    take(None);
                    for take in st.deferred.drain(..) {
                        take(None);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Sends `req` without waiting for its reply: the next call on this
    /// connection reads it, before its own, and hands it to `take` (or
    /// [`flush_deferred`](Self::flush_deferred) does). For requests whose
    /// reply the caller can do without until then, answered without
    /// descriptors; a round trip's two thread wake-ups saved. Not in
    /// guest mode (a guest's port takes one call at a time), nor past
    /// [`MAX_DEFERRED`] replies unread: then it fails, sending nothing.
    pub fn send_deferred(&self, req: &Request, take: Deferred) -> Result<()> {
        if self.guest.is_some() {
            return Err(Error::invalid("a guest's calls are not deferred"));
        }
        let bytes = proto::encode_request(req);
        let mut st = self.lock();
        if st.broken {
            return Err(Error::Io(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection to vrdmad is broken",
            )));
        }
        if st.deferred.len() >= MAX_DEFERRED {
            return Err(Error::invalid("too many requests sent ahead of their replies"));
        }
        if let Err(e) = vrdma_shm::send_msg(st.sock.as_fd(), &bytes, &[]) {
            if e.kind() == io::ErrorKind::WriteZero {
                st.broken = true;
            }
            return Err(e.into());
        }
        st.deferred.push_back(take);
        Ok(())
    }

    /// Reads the replies of all requests sent ahead, now.
    pub fn flush_deferred(&self) -> Result<()> {
        if self.guest.is_some() {
            return Ok(());
        }
        Self::read_deferred(&mut self.lock())
    }

    /// The rings of a `Reply::Pooled`, with the descriptors that came with
    /// it: each ring's own, or its chunk's (mapped and kept here the
    /// first time), or the chunk mapped before.
    fn place(&self, rings: &[proto::PoolRing], fds: Vec<OwnedFd>) -> Result<Vec<Placed>> {
        let mut fds = fds.into_iter();
        let mut chunks = self.chunks.lock().unwrap_or_else(|p| p.into_inner());
        let mut placed = Vec::with_capacity(rings.len());
        for r in rings {
            let missing = || Error::protocol("a pooled reply lacks a descriptor");
            placed.push(match *r {
                proto::PoolRing::Own => Placed::Fd(fds.next().ok_or_else(missing)?, 0),
                proto::PoolRing::Chunk { chunk, len, fd: true } => {
                    let fd = fds.next().ok_or_else(missing)?;
                    let seg = Arc::new(Segment::map_trusted(fd, to_usize(len, "pool chunk length")?)?);
                    chunks.insert(chunk, seg.clone());
                    Placed::Mapped(seg)
                }
                proto::PoolRing::Chunk { chunk, len, fd: false } => match chunks.get(&chunk) {
                    Some(seg) if seg.len() as u64 == len => Placed::Mapped(seg.clone()),
                    _ => {
                        return Err(Error::protocol(format!(
                            "pool chunk {chunk} of {len} bytes is not mapped"
                        )))
                    }
                },
            });
        }
        if fds.next().is_some() {
            return Err(Error::protocol("a pooled reply with more descriptors than its rings take"));
        }
        Ok(placed)
    }

    /// [`call`](Self::call) for requests answered by `Reply::Done`.
    pub fn call_done(&self, req: &Request) -> Result<()> {
        match self.call(req, &[])?.reply {
            Reply::Done => Ok(()),
            other => Err(unexpected(req, &other)),
        }
    }

    /// Sends a destroy request on behalf of a `Drop`, logging a failure.
    pub fn destroy(&self, req: Request) {
        if let Err(e) = self.call_done(&req) {
            tracing::warn!(error = %e, request = ?req, "vrdma: destroying an object failed");
        }
    }
}

/// The error of a wait that the daemon's going ended.
pub(crate) fn gone() -> Error {
    Error::Io(io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "vrdmad closed the connection: the device is gone",
    ))
}

/// The error for a reply of the wrong kind.
pub(crate) fn unexpected(req: &Request, reply: &Reply) -> Error {
    Error::protocol(format!("unexpected reply {reply:?} to {req:?}"))
}

/// A daemon-provided `u64` length as `usize`.
pub(crate) fn to_usize(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::protocol(format!("{what} {v} does not fit in usize")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_shm::seqpacket_pair;

    fn serve_one(sock: OwnedFd, reply: Option<Reply>) -> std::thread::JoinHandle<Request> {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; proto::MAX_MESSAGE];
            let r = vrdma_shm::recv_msg(sock.as_fd(), &mut buf, 4).unwrap();
            let req = proto::decode_request(&buf[..r.len]).unwrap();
            if let Some(reply) = reply {
                vrdma_shm::send_msg(sock.as_fd(), &proto::encode_reply(&reply), &[]).unwrap();
            }
            req
        })
    }

    #[test]
    fn round_trip_and_errors() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let h = serve_one(b, Some(Reply::Pd { pd: 9 }));
        let ans = c.call(&Request::AllocPd, &[]).unwrap();
        assert_eq!(ans.reply, Reply::Pd { pd: 9 });
        assert!(h.join().is_ok());
    }

    #[test]
    fn daemon_error_carries_errno() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let h = serve_one(b, Some(Reply::Error { errno: libc::EBUSY, message: "busy".into() }));
        let e = c.call_done(&Request::DeallocPd { pd: 1 }).unwrap_err();
        assert_eq!(e.errno(), libc::EBUSY);
        assert_eq!(h.join().unwrap(), Request::DeallocPd { pd: 1 });
    }

    #[test]
    fn closed_peer_breaks_connection() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let h = serve_one(b, None);
        let e = c.call(&Request::AllocPd, &[]).unwrap_err();
        h.join().unwrap();
        assert!(matches!(e, Error::Io(_)), "{e}");
        let e = c.call(&Request::AllocPd, &[]).unwrap_err();
        assert_eq!(e.errno(), libc::ENOTCONN);
    }

    /// Serves `replies.len()` requests in order, answering each with its
    /// reply; returns the requests.
    fn serve(sock: OwnedFd, replies: Vec<Reply>) -> std::thread::JoinHandle<Vec<Request>> {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; proto::MAX_MESSAGE];
            let mut reqs = Vec::new();
            for reply in replies {
                let r = vrdma_shm::recv_msg(sock.as_fd(), &mut buf, 4).unwrap();
                reqs.push(proto::decode_request(&buf[..r.len]).unwrap());
                vrdma_shm::send_msg(sock.as_fd(), &proto::encode_reply(&reply), &[]).unwrap();
            }
            reqs
        })
    }

    /// What a call notes of its reply is done before the connection takes
    /// another call: a second thread's call waits for it (the connection
    /// manager keeps a reply's events so, in the daemon's order). An
    /// error is not noted.
    #[test]
    fn a_note_on_a_reply_comes_before_the_next_call() {
        use std::sync::mpsc;
        let (a, b) = seqpacket_pair().unwrap();
        let c = Arc::new(Control::from_socket(a));
        let h = serve(
            b,
            vec![
                Reply::Pd { pd: 1 },
                Reply::Pd { pd: 2 },
                Reply::Error { errno: libc::EINVAL, message: "no".into() },
            ],
        );
        let (entered, in_note) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let first = {
            let c = c.clone();
            std::thread::spawn(move || {
                c.call_noting(&Request::AllocPd, &[], |reply| {
                    entered.send(()).unwrap();
                    released.recv().unwrap();
                    reply.clone()
                })
            })
        };
        in_note.recv().unwrap();
        let (done, answered) = mpsc::channel();
        let second = {
            let c = c.clone();
            std::thread::spawn(move || {
                let r = c.call(&Request::AllocPd, &[]).map(|a| a.reply);
                done.send(()).unwrap();
                r
            })
        };
        // (Long enough for the second call's round trip, were it let go.)
        std::thread::sleep(Duration::from_millis(100));
        assert!(answered.try_recv().is_err(), "another call was served while a reply was being noted");
        release.send(()).unwrap();
        let (answer, noted) = first.join().unwrap().unwrap();
        assert_eq!((answer.reply, noted), (Reply::Pd { pd: 1 }, Reply::Pd { pd: 1 }));
        assert_eq!(second.join().unwrap().unwrap(), Reply::Pd { pd: 2 });
        let mut ran = false;
        let e = c.call_noting(&Request::AllocPd, &[], |_| ran = true).unwrap_err();
        assert_eq!((e.errno(), ran), (libc::EINVAL, false));
        h.join().unwrap();
    }

    /// A request sent ahead: its reply is read by the next call, before
    /// that call's own, and handed to its taker (an error as `None`); a
    /// flush reads what is left.
    #[test]
    fn a_deferred_reply_is_read_before_the_next_calls_own() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let h = serve(
            b,
            vec![
                Reply::Pd { pd: 1 },
                Reply::Error { errno: libc::ENOMEM, message: "quota".into() },
                Reply::Pd { pd: 3 },
                Reply::Pd { pd: 4 },
            ],
        );
        let got = Arc::new(Mutex::new(Vec::new()));
        let taker = |got: &Arc<Mutex<Vec<Option<Reply>>>>| -> Deferred {
            let got = got.clone();
            Box::new(move |r| got.lock().unwrap().push(r))
        };
        c.send_deferred(&Request::AllocPd, taker(&got)).unwrap();
        c.send_deferred(&Request::AllocPd, taker(&got)).unwrap();
        assert!(got.lock().unwrap().is_empty(), "nothing read yet");
        let ans = c.call(&Request::QueryDevice, &[]).unwrap();
        assert_eq!(ans.reply, Reply::Pd { pd: 3 }, "the call's own reply, after the two sent ahead");
        assert_eq!(*got.lock().unwrap(), vec![Some(Reply::Pd { pd: 1 }), None]);
        c.send_deferred(&Request::AllocPd, taker(&got)).unwrap();
        c.flush_deferred().unwrap();
        assert_eq!(got.lock().unwrap().last(), Some(&Some(Reply::Pd { pd: 4 })));
        let reqs = h.join().unwrap();
        assert_eq!(reqs[2], Request::QueryDevice);
    }

    /// Replies sent ahead are bounded, and a broken connection hands its
    /// takers `None`.
    #[test]
    fn deferred_replies_are_bounded_and_a_break_hands_none() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let nones = Arc::new(Mutex::new(0));
        for _ in 0..MAX_DEFERRED {
            let nones = nones.clone();
            c.send_deferred(
                &Request::AllocPd,
                Box::new(move |r| {
                    if r.is_none() {
                        *nones.lock().unwrap() += 1;
                    }
                }),
            )
            .unwrap();
        }
        assert!(c.send_deferred(&Request::AllocPd, Box::new(|_| {})).is_err(), "past the bound");
        drop(b);
        assert!(c.flush_deferred().is_err());
        assert_eq!(*nones.lock().unwrap(), MAX_DEFERRED);
    }

    #[test]
    fn unexpected_reply_is_protocol_error() {
        let (a, b) = seqpacket_pair().unwrap();
        let c = Control::from_socket(a);
        let h = serve_one(b, Some(Reply::Pd { pd: 1 }));
        let e = c.call_done(&Request::DeallocPd { pd: 1 }).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)));
        h.join().unwrap();
    }

    #[test]
    fn connect_missing_path_fails_cleanly() {
        let p = std::env::temp_dir().join(format!("vrdma-missing-{}.sock", std::process::id()));
        let e = Control::connect(&p).unwrap_err();
        assert!(e.to_string().contains("cannot connect"), "{e}");
        assert_eq!(e.errno(), libc::ENOENT);
    }
}
