//! A TCP connection this library may carry: its negotiation's state, and
//! once both ends said yes, its [`Link`].
//!
//! The descriptor stays the application's kernel socket; the library keeps
//! a duplicate of its own (close-on-exec), so that the connection lives,
//! and its FIN waits, until the last of the application's descriptors of
//! it is closed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::c_int;
use vrdma::sockets::{Outcome, Tuple};

use crate::dev::{debug, dev};
use crate::link::{self, Half, Link, Res, HELLO_LEN};
use crate::owner::{Owner, Take};
use crate::real;

enum Phase {
    /// A client that announced `tuple` and has not learnt the outcome.
    Announced(Tuple),
    /// Both ends said yes; the hellos are not exchanged yet.
    Agreed,
    Carried(Arc<Link>),
    /// It turned out TCP (the descriptors were taken off the table).
    Tcp,
    /// The exchange failed: every call fails with this errno (or
    /// [`ENDED`]).
    Broken(c_int),
}

pub struct Stream {
    /// Which of the processes holding it (after `fork`) drives it.
    pub owner: Owner,
    /// The process that made it, and whether it is a client's (made
    /// announced): only that process may resolve the announcement (the
    /// registry answers the context that made it).
    creator: u32,
    client: bool,
    sock: Arc<Sock>,
    phase: Mutex<Phase>,
}

/// The library's own duplicate of the socket, closed when both the stream
/// and its link are gone.
pub struct Sock(pub c_int);

impl Drop for Sock {
    fn drop(&mut self) {
        // SAFETY: the library's own duplicate, closed once.
        unsafe { real::close(self.0) };
    }
}

/// Not an errno: the peer closed the connection before its first call
/// (reads return 0, writes fail with `EPIPE`, as over TCP).
pub const ENDED: c_int = -1;

/// Where a call on the stream goes.
pub enum Route {
    Tcp,
    Link(Arc<Link>),
}

/// How long a client waits for the server's claim: `VRDMA_SOCKETS_WAIT_MS`
/// (5000 by default).
fn claim_wait() -> Duration {
    let ms = std::env::var("VRDMA_SOCKETS_WAIT_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(5000);
    Duration::from_millis(ms)
}

impl Stream {
    fn new(fd: c_int, phase: Phase) -> Option<Arc<Stream>> {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a descriptor the caller holds.
        let sock = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        (sock >= 0).then(|| {
            Arc::new(Stream {
                owner: Owner::new(),
                creator: crate::pid::get(),
                client: matches!(phase, Phase::Announced(_)),
                sock: Arc::new(Sock(sock)),
                phase: Mutex::new(phase),
            })
        })
    }

    /// Takes it for this process if no other drives it ([`Owner::take`]),
    /// but for a client's connection that nobody took in a process that
    /// did not announce it (a child forked before the first call): the
    /// registry answers the announcement only to the context that made
    /// it, the parent's, which may still take it.
    pub fn take(&self) -> Take {
        if self.client && self.creator != crate::pid::get() && self.owner.is_free() {
            return Take::Other;
        }
        self.owner.take()
    }

    /// A client's stream after its announcement.
    pub fn announced(fd: c_int, tuple: Tuple) -> Option<Arc<Stream>> {
        Stream::new(fd, Phase::Announced(tuple))
    }

    /// A server's stream after a successful claim.
    pub fn claimed(fd: c_int) -> Option<Arc<Stream>> {
        Stream::new(fd, Phase::Agreed)
    }

    /// Whether both ends exchanged their hellos: the bytes go through the
    /// rings.
    pub fn is_carried(&self) -> bool {
        matches!(*self.phase.lock().unwrap_or_else(|e| e.into_inner()), Phase::Carried(_))
    }

    /// Its link, if carried already (never negotiates, never waits: for
    /// the readiness calls).
    pub fn link_now(&self) -> Option<Arc<Link>> {
        match &*self.phase.try_lock().ok()? {
            Phase::Carried(l) => Some(l.clone()),
            _ => None,
        }
    }

    /// A client whose connect failed: its announcement is withdrawn.
    pub fn abandon(&self) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if let (Phase::Announced(t), Some(d)) = (&*p, dev()) {
            let _ = d.ctx.sock_resolve(*t, true);
        }
        *p = Phase::Tcp;
        self.owner.set_tcp();
    }

    /// Finishes the negotiation if it is not (the client waits for the
    /// server's claim, both ends exchange hellos) and says where the call
    /// goes. Only for the process that took it ([`Owner::take`]).
    pub fn route(self: &Arc<Stream>) -> Res<Route> {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*p {
                Phase::Carried(l) => return Ok(Route::Link(l.clone())),
                Phase::Tcp => return Ok(Route::Tcp),
                Phase::Broken(e) => return Err(*e),
                Phase::Announced(t) => {
                    let t = *t;
                    *p = match self.resolve(t) {
                        Outcome::Carried => Phase::Agreed,
                        _ => Phase::Tcp,
                    };
                    if matches!(*p, Phase::Tcp) {
                        debug(&format!("{t:?}: TCP"));
                        // For the other holders too (after fork).
                        self.owner.set_tcp();
                        crate::table::forget_stream(self);
                        return Ok(Route::Tcp);
                    }
                }
                Phase::Agreed => {
                    *p = match self.exchange() {
                        Ok(l) => {
                            for fd in crate::table::fds_of(self) {
                                crate::table::set_cloexec(fd);
                            }
                            Phase::Carried(Arc::new(l))
                        }
                        Err(ENDED) => {
                            debug("the peer closed before its first call");
                            Phase::Broken(ENDED)
                        }
                        Err(e) => {
                            debug(&format!("the exchange of hellos failed: errno {e}"));
                            Phase::Broken(if e == libc::EPROTO { libc::ECONNRESET } else { e })
                        }
                    };
                }
            }
        }
    }

    fn resolve(&self, t: Tuple) -> Outcome {
        let Some(d) = dev() else { return Outcome::Tcp };
        let end = Instant::now() + claim_wait();
        loop {
            let give_up = Instant::now() >= end;
            match d.ctx.sock_resolve(t, give_up) {
                Ok(Outcome::Pending) if !give_up => std::thread::sleep(Duration::from_millis(1)),
                Ok(Outcome::Pending) => return Outcome::Tcp,
                Ok(o) => return o,
                // No answer: the daemon is gone, and so is the
                // announcement with the context (the server's claim is
                // refused). TCP for both.
                Err(_) => return Outcome::Tcp,
            }
        }
    }

    /// Exchanges hellos and one ready byte each way over the socket, now
    /// private to two vRDMA libraries, and connects the QP.
    fn exchange(&self) -> Res<Link> {
        let d = dev().ok_or(libc::ECONNRESET)?;
        let half = Half::new(d).map_err(|e| e.errno())?;
        let fd = self.sock.0;
        // A peer that closed before its first call sent no hello: its end
        // is read as the end (a hello sent now would be answered by RST).
        let mut b = [0u8; 1];
        // SAFETY: `b` is valid for one byte.
        if unsafe { real::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) } == 0 {
            return Err(ENDED);
        }
        send_all(fd, half.hello())?;
        let mut peer = [0u8; HELLO_LEN];
        recv_exact(fd, &mut peer)?;
        let link = half.connect(self.sock.clone(), &peer)?;
        // Both QPs are connected before either writes.
        send_all(fd, &[link::ready_byte()])?;
        let mut b = [0u8; 1];
        recv_exact(fd, &mut b)?;
        debug("carried over vRDMA");
        Ok(link)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // No lock: a forked child's copy of it may be held for ever by a
        // thread of the parent that the child does not have.
        let phase = self.phase.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.owner.mine() {
            if let Phase::Carried(l) = phase {
                l.finish();
            }
            return;
        }
        let Phase::Carried(l) = std::mem::replace(phase, Phase::Tcp) else { return };
        // Another process's link (its parent's, inherited through fork):
        // its QP, rings and daemon connection are not this process's to
        // use or destroy, and its end of stream is not this process's to
        // send. Only this process's copy of the socket goes.
        // SAFETY: this process's copy of the library's descriptor; the
        // link, which holds the other reference to it, is leaked here, so
        // the descriptor is never closed again by this library.
        unsafe { real::close(self.sock.0) };
        std::mem::forget(l);
    }
}

/// Waits (10 s at most) until `fd` is ready for `events`, whether or not
/// the application made it non-blocking.
fn wait(fd: c_int, events: i16) -> Res<()> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, 10_000) };
    match r {
        1.. => Ok(()),
        0 => Err(libc::ETIMEDOUT),
        _ => Err(crate::table::errno()),
    }
}

fn send_all(fd: c_int, mut b: &[u8]) -> Res<()> {
    while !b.is_empty() {
        // SAFETY: `b` is valid for its length.
        let r =
            unsafe { real::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if r > 0 {
            b = &b[r as usize..];
            continue;
        }
        match crate::table::errno() {
            libc::EAGAIN => wait(fd, libc::POLLOUT)?,
            libc::EINTR => {}
            e => return Err(e),
        }
    }
    Ok(())
}

/// Receives exactly `b.len()` bytes; [`ENDED`] if the socket ends before
/// the first.
fn recv_exact(fd: c_int, b: &mut [u8]) -> Res<()> {
    let mut got = 0;
    while got < b.len() {
        // SAFETY: `b[got..]` is valid for its length.
        let r = unsafe { real::recv(fd, b[got..].as_mut_ptr().cast(), b.len() - got, libc::MSG_DONTWAIT) };
        match r {
            0 if got == 0 => return Err(ENDED),
            0 => return Err(libc::ECONNRESET),
            1.. => got += r as usize,
            _ => match crate::table::errno() {
                libc::EAGAIN => wait(fd, libc::POLLIN)?,
                libc::EINTR => {}
                e => return Err(e),
            },
        }
    }
    Ok(())
}
