//! A TCP connection this library may carry: its negotiation's state, and
//! once both ends said yes, its [`Link`].
//!
//! The descriptor stays the application's kernel socket; the library keeps
//! a duplicate of its own (close-on-exec), so that the connection lives,
//! and its FIN waits, until the last of the application's descriptors of
//! it is closed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
    /// registry answers the context that made it), or one that adopted
    /// it ([`Stream::adopt`]).
    creator: u32,
    client: bool,
    /// The connection as the registry names it (announced or claimed).
    tuple: Tuple,
    sock: Arc<Sock>,
    phase: crate::connlock::ConnLock<Phase>,
}

/// The library's own duplicate of the socket, closed when both the stream
/// and its link are gone; and whether the program waits for the
/// connection's readiness (`poll`, `select`, `epoll`): a link that no
/// readiness call knows arms only when a read waits
/// ([`crate::link::Link::read`]).
///
/// The third field says whether its non-blocking reads may leave the ring
/// unarmed (0: not known yet, 1: yes, 2: never): only while every wait
/// for it goes through an interposed epoll wait that arms it first
/// ([`crate::epoll::lazy_scan`]).
pub struct Sock(pub c_int, AtomicBool, std::sync::atomic::AtomicU8);

impl Sock {
    pub fn new(fd: c_int) -> Sock {
        Sock(fd, AtomicBool::new(false), std::sync::atomic::AtomicU8::new(0))
    }

    /// Level-triggered epoll registrations only so far: its non-blocking
    /// reads may leave the ring unarmed (unless already ruled out).
    pub fn allow_lazy(&self) {
        let _ = self.2.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Waited for some other way (`poll`, `select`, an edge-triggered or
    /// one-shot registration, a set inside another): every read that
    /// empties its ring arms at once, for good.
    pub fn never_lazy(&self) {
        self.2.store(2, Ordering::SeqCst);
    }

    pub fn lazy_ok(&self) -> bool {
        self.2.load(Ordering::SeqCst) == 1
    }

    /// A readiness call or an epoll registration knows it (for good).
    pub fn watch(&self) {
        self.1.store(true, Ordering::SeqCst);
    }

    pub fn watched(&self) -> bool {
        self.1.load(Ordering::SeqCst)
    }
}

impl Drop for Sock {
    fn drop(&mut self) {
        // SAFETY: the library's own duplicate, closed once.
        unsafe { real::close(self.0) };
    }
}

/// Another process's hold on a connection, for this process's readiness
/// calls ([`Stream::elsewhere`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Elsewhere {
    /// No other process drives it (this one does or may take it, it is
    /// plain TCP, or another settles it before an exec: the outcome comes).
    No,
    /// Another process took it and may give it back (the connection is
    /// free again): not decided here now, but perhaps later.
    ForNow,
    /// Another process drives it for good.
    ForGood,
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

/// The longest another holder's settling before an exec may take: its
/// wait for the peer's message, its daemon calls, and some.
fn settle_wait() -> Duration {
    claim_wait() + Duration::from_secs(5)
}

impl Stream {
    fn new(fd: c_int, tuple: Tuple, phase: Phase) -> Option<Arc<Stream>> {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a descriptor the caller holds.
        let sock = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        (sock >= 0).then(|| {
            Arc::new(Stream {
                owner: Owner::new(),
                creator: crate::pid::get(),
                client: matches!(phase, Phase::Announced(_)),
                tuple,
                sock: Arc::new(Sock::new(sock)),
                phase: crate::connlock::ConnLock::new(phase),
            })
        })
    }

    /// Takes it for this process if no other drives it ([`Owner::take`]).
    /// A client's connection taken in a process that did not announce it
    /// (a child forked before the first call) is adopted from the
    /// announcing context first ([`Stream::adopt`]).
    pub fn take(&self) -> Take {
        self.owner.take(settle_wait)
    }

    /// In a process that did not announce this client's connection (a
    /// child forked before its first call, which took it): takes the
    /// announcement over at the daemon, so that this process's context may
    /// resolve it (the registry answers only the announcing context).
    /// Where it cannot (the announcement is gone with its context, or
    /// another host's daemon holds it), the connection is given back
    /// untouched (the parent may still take it) and the call fails with
    /// `EIO`: resolving it otherwise could read TCP while the server
    /// carries it, and put its hello into the stream.
    fn adopt(&self, t: Tuple) -> Res<()> {
        if self.creator == crate::pid::get() {
            return Ok(());
        }
        match dev().map(|d| d.ctx.sock_adopt(t)) {
            Some(Ok(true)) => {
                debug(&format!("{t:?}: adopted from the process that announced it"));
                Ok(())
            }
            r => {
                debug(&format!("{t:?}: not adopted ({r:?}): left to the process that announced it"));
                self.owner.release();
                Err(libc::EIO)
            }
        }
    }

    /// A client's stream after its announcement.
    pub fn announced(fd: c_int, tuple: Tuple) -> Option<Arc<Stream>> {
        Stream::new(fd, tuple, Phase::Announced(tuple))
    }

    /// A server's stream after a successful claim of `tuple`.
    pub fn claimed(fd: c_int, tuple: Tuple) -> Option<Arc<Stream>> {
        Stream::new(fd, tuple, Phase::Agreed)
    }

    /// Whether both ends exchanged their hellos: the bytes go through the
    /// rings.
    pub fn is_carried(&self) -> bool {
        matches!(*self.phase.lock(), Phase::Carried(_))
    }

    /// Not decided yet: the outcome or the hellos are still to come (or
    /// another thread is negotiating it now).
    pub fn undecided(&self) -> bool {
        match self.phase.try_lock() {
            Ok(p) => matches!(*p, Phase::Announced(_) | Phase::Agreed),
            Err(_) => true,
        }
    }

    /// Whether it is decided, once a negotiation that another thread is
    /// making now is done (the phase's lock is held for the whole of it):
    /// waits for it at most `within` (`None`: no bound of the caller's),
    /// and never beyond [`settle_wait`]; `None` if it is not known by
    /// then. For a readiness call that found the peer's first message
    /// gone from the socket: another thread's decision may have taken it
    /// ([`crate::readiness`]).
    ///
    /// Plain TCP is known from the owner word, without the lock: a forked
    /// child's copy of the lock stays locked for ever if a thread of its
    /// parent held it at the fork (deciding it), and the wait's own
    /// timeout bounds the rest (an `epoll_wait(.., 0)` waited for the
    /// whole of another thread's negotiation, seconds).
    pub fn decided_after(&self, within: Option<Duration>) -> Option<bool> {
        let decided = |p: &Phase| !matches!(p, Phase::Announced(_) | Phase::Agreed);
        let bound = within.map_or(settle_wait(), |d| d.min(settle_wait()));
        let start = Instant::now();
        loop {
            if self.owner.is_tcp() {
                return Some(true);
            }
            if let Ok(p) = self.phase.try_lock() {
                return Some(decided(&p));
            }
            if start.elapsed() >= bound {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether another process holds it, as this process's readiness
    /// calls see it (one look at the owner's words).
    pub fn elsewhere(&self) -> Elsewhere {
        match self.owner.driver_elsewhere() {
            None => Elsewhere::No,
            // A client's connection taken by a process that did not
            // announce it: that process adopts it at its first call, and
            // gives it back if it cannot ([`Stream::adopt`]).
            Some(w) if self.client && w != self.creator => Elsewhere::ForNow,
            Some(_) => Elsewhere::ForGood,
        }
    }

    /// Test only: another thread's decision, as [`Stream::route`] makes
    /// one that turns out plain TCP: the phase's lock held while `during`
    /// runs, then TCP for every holder.
    #[cfg(test)]
    pub fn decide_tcp_for_test(self: &Arc<Stream>, during: impl FnOnce()) {
        let mut p = self.phase.lock();
        during();
        self.owner.set_tcp();
        crate::table::forget_stream(self);
        *p = Phase::Tcp;
    }

    /// The program waits for its readiness (an epoll registration): its
    /// link arms whenever a read empties its ring.
    pub fn watch(&self) {
        self.sock.watch();
    }

    pub fn lazy_ok(&self) -> bool {
        self.sock.lazy_ok()
    }

    /// See [`Sock::allow_lazy`] and [`Sock::never_lazy`].
    pub fn lazy(&self, ok: bool) {
        if ok {
            self.sock.allow_lazy()
        } else {
            self.sock.never_lazy()
        }
    }

    /// The library's own descriptor of its socket.
    pub fn own_fd(&self) -> c_int {
        self.sock.0
    }

    /// Its link, if carried already (never negotiates, never waits: for
    /// the readiness calls).
    pub fn link_now(&self) -> Option<Arc<Link>> {
        match &*self.phase.try_lock().ok()? {
            Phase::Carried(l) => Some(l.clone()),
            _ => None,
        }
    }

    /// [`link_now`](Self::link_now), or `Err` where the stream's lock is
    /// held this moment (by a call on another thread).
    pub fn link_if_free(&self) -> Result<Option<Arc<Link>>, ()> {
        let p = self.phase.try_lock().map_err(drop)?;
        Ok(match &*p {
            Phase::Carried(l) => Some(l.clone()),
            _ => None,
        })
    }

    /// A client whose connect failed: its announcement is withdrawn.
    pub fn abandon(&self) {
        let mut p = self.phase.lock();
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
        let mut p = self.phase.lock();
        loop {
            match &*p {
                Phase::Carried(l) => return Ok(Route::Link(l.clone())),
                Phase::Tcp => return Ok(Route::Tcp),
                Phase::Broken(e) => return Err(*e),
                Phase::Announced(t) => {
                    let t = *t;
                    self.adopt(t)?;
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
                        Ok(Hello::Carried(l)) => {
                            for fd in crate::table::fds_of(self) {
                                crate::table::set_cloexec(fd);
                            }
                            Phase::Carried(Arc::new(*l))
                        }
                        Ok(Hello::Declined) => {
                            debug(&format!(
                                "{:?}: the peer declined (it settled it before an exec): TCP",
                                self.tuple
                            ));
                            self.owner.set_tcp();
                            crate::table::forget_stream(self);
                            *p = Phase::Tcp;
                            return Ok(Route::Tcp);
                        }
                        Err(ENDED) => {
                            debug("the peer closed before its first call");
                            Phase::Broken(ENDED)
                        }
                        Err(e) => {
                            debug(&format!("the exchange of hellos failed: errno {e}"));
                            Phase::Broken(broken_errno(e))
                        }
                    };
                }
            }
        }
    }

    /// Runs `send` (a decline before an exec) with the library's socket
    /// options on `fd`, the program's put back after: a cork or Nagle the
    /// program set would hold the decline, and the peer in its first
    /// call, for up to 200 ms.
    fn unheld(&self, fd: c_int, send: impl FnOnce() -> Res<()>) -> Res<()> {
        crate::kept::keep_all(&self.owner, fd);
        let r = send();
        crate::kept::give_back_all(&self.owner, fd);
        r
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
    /// private to two vRDMA libraries, and connects the QP. Each end sends
    /// one 64-byte message and reads one: its hello, or a decline where
    /// its program settled the connection before an exec
    /// ([`Stream::settle_for_exec`]); a decline either way makes it plain
    /// TCP for both, and only two hellos are followed by ready bytes.
    /// Both ends send before they read: a server that speaks first to a
    /// client that waits in `poll` before its first call wakes it with its
    /// hello.
    fn exchange(&self) -> Res<Hello> {
        let d = dev().ok_or(libc::ECONNRESET)?;
        let fd = self.sock.0;
        // A peer that closed before its first call sent no hello: its end
        // is read as the end (a hello sent now would be answered by RST).
        let mut b = [0u8; 1];
        // SAFETY: `b` is valid for one byte.
        if unsafe { real::recv(fd, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) } == 0 {
            return Err(ENDED);
        }
        let half = Half::new(d).map_err(|e| e.errno())?;
        // The hellos and ready bytes go at once: a cork or Nagle the
        // program set before its first call would hold each for up to
        // 200 ms (a cork's timeout) or a delayed ACK. The program's
        // values are kept from here, and given back if the connection
        // stays plain TCP.
        crate::kept::keep_all(&self.owner, fd);
        let r = self.hellos(fd, half);
        if !matches!(r, Ok(Hello::Carried(_))) {
            crate::kept::give_back_all(&self.owner, fd);
        }
        r
    }

    /// [`Stream::exchange`]'s messages, the socket's options kept.
    fn hellos(&self, fd: c_int, half: Half) -> Res<Hello> {
        send_all(fd, half.hello())?;
        if crate::dev::debugging() {
            debug(&format!("hello sent (the kernel's {})", crate::kept::kernel_values(fd)));
        }
        let mut peer = [0u8; HELLO_LEN];
        recv_exact(fd, &mut peer)?;
        if link::is_decline(&peer) {
            return Ok(Hello::Declined);
        }
        let link = half.connect(self.sock.clone(), self.owner.page(), &peer)?;
        // Both QPs are connected before either writes.
        send_all(fd, &[link::ready_byte()])?;
        let mut b = [0u8; 1];
        recv_exact(fd, &mut b)?;
        debug("carried over vRDMA");
        Ok(Hello::Carried(Box::new(link)))
    }

    /// Before an `exec` that this connection's descriptor survives (not
    /// close-on-exec): a connection not decided yet is settled as plain
    /// TCP, so that the exec'd program (which does not know it: the
    /// library starts afresh there, or is not loaded at all) reads a clean
    /// stream. A connection carried already is close-on-exec and not
    /// touched (the program does not get it); one that another process
    /// drives (after fork) is that process's and not touched either.
    ///
    /// - A client that announced it gives up waiting ([`Outcome`] `Tcp`
    ///   for both ends if the server has not claimed it). If the server
    ///   claimed it, the client sends a decline in place of its hello and
    ///   reads the server's message off the socket (its hello, sent at its
    ///   first call, which the decline makes readable for an event loop;
    ///   or its own decline), the claim wait at most: a server that makes
    ///   no call on the connection for that long would put its hello into
    ///   the exec'd program's stream later.
    /// - A server that claimed it declines it through the daemon: the
    ///   client, which has not resolved it yet, reads TCP and sends no
    ///   hello. If the client resolved it already its hello is on its
    ///   way (it is in its first call): it is read off the socket (5 s at
    ///   most, `VRDMA_SOCKETS_WAIT_MS`) and answered with a decline, which
    ///   the client reads in place of the server's hello.
    ///
    /// `fd` is a descriptor of the connection that the program keeps (the
    /// socket's I/O goes through it: the library's own copy is
    /// close-on-exec, and a program may have closed it before the exec).
    ///
    /// `end`: the exec's bound for its whole settle (a message waited for
    /// stops there, or at the claim wait, whichever comes first).
    pub fn settle_for_exec(self: &Arc<Stream>, fd: c_int, end: Instant) {
        match self.take() {
            Take::Mine => {}
            Take::Tcp => {
                crate::table::forget_stream(self);
                return;
            }
            Take::Other => return,
        }
        let mut p = self.phase.lock();
        // Another holder (ncat's relay, whose child execs) waits for the
        // outcome rather than failing with EIO ([`Owner::take`]); cleared
        // once the driver's word changed, at every return below.
        struct Settling<'a>(&'a Owner);
        impl Drop for Settling<'_> {
            fn drop(&mut self) {
                self.0.settling(false);
            }
        }
        let _settling = matches!(*p, Phase::Announced(_) | Phase::Agreed).then(|| {
            self.owner.settling(true);
            Settling(&self.owner)
        });
        match &*p {
            Phase::Announced(t) => {
                let t = *t;
                if self.adopt(t).is_err() {
                    // Not this process's to settle; the parent's may.
                    return;
                }
                let out = dev().map_or(Outcome::Tcp, |d| d.ctx.sock_resolve(t, true).unwrap_or(Outcome::Tcp));
                if out == Outcome::Carried {
                    // The server sends its hello (or its own decline) at
                    // its first call, which our decline makes readable.
                    let r = self.unheld(fd, || send_all(fd, &link::decline()));
                    let r = r.and_then(|()| read_message(fd, end)).map(|_| ());
                    debug(&format!("{t:?}: declined before an exec ({r:?}): TCP"));
                } else {
                    debug(&format!("{t:?}: given up before an exec: TCP"));
                }
            }
            Phase::Agreed if !self.client => {
                let t = self.tuple;
                match crate::dev::call_before_exec(|c| c.sock_decline(t)) {
                    Some(Ok(true)) => {
                        debug(&format!("{t:?}: declined through the daemon before an exec: TCP"))
                    }
                    // The client resolved it (its hello comes), or the
                    // daemon cannot say (gone, or without `Decline`).
                    r => {
                        if let Some(Err(e)) = r {
                            debug(&format!("{t:?}: the daemon did not take the decline: {e}"));
                        }
                        // Its message is a hello, or a decline (its
                        // program execs too): answered by a decline either
                        // way, which it reads in place of our hello.
                        let r = read_message(fd, end)
                            .and_then(|_| self.unheld(fd, || send_all(fd, &link::decline())));
                        debug(&format!(
                            "{t:?}: the client's hello answered with a decline before an exec ({r:?}): TCP"
                        ));
                    }
                }
            }
            _ => return,
        }
        *p = Phase::Tcp;
        self.owner.set_tcp();
        drop(p);
        crate::table::forget_stream(self);
    }
}

/// Reads the peer's 64-byte message (a hello or a decline) off `fd`,
/// waiting for it at most the claim wait (`VRDMA_SOCKETS_WAIT_MS`). Takes
/// nothing if what comes is not one (a first byte that is not the
/// magic: application data), if the peer ends, or if nothing whole comes
/// in time (by `by` at the latest).
fn read_message(fd: c_int, by: Instant) -> Res<[u8; HELLO_LEN]> {
    let end = by.min(Instant::now() + claim_wait());
    let mut b = [0u8; HELLO_LEN];
    loop {
        // SAFETY: `b` is valid for its length.
        let r =
            unsafe { real::recv(fd, b.as_mut_ptr().cast(), b.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        match r {
            0 => return Err(ENDED),
            1.. if !link::may_be_hello(&b[..r as usize]) => return Err(libc::EPROTO),
            1.. if r as usize == HELLO_LEN => break,
            1.. => {}
            _ => match crate::table::errno() {
                libc::EAGAIN | libc::EINTR => {}
                e => return Err(e),
            },
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(libc::ETIMEDOUT);
        }
        if r > 0 {
            // Part of it: the rest is on its way.
            std::thread::sleep(left.min(Duration::from_millis(1)));
        } else {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, 100) as c_int) };
        }
    }
    recv_exact(fd, &mut b)?;
    Ok(b)
}

/// What the exchange of hellos gave.
enum Hello {
    Carried(Box<Link>),
    /// The peer settled the connection as TCP (a decline in place of its
    /// hello, or in answer to ours).
    Declined,
}

impl Drop for Stream {
    fn drop(&mut self) {
        // No lock: a forked child's copy of it may be held for ever by a
        // thread of the parent that the child does not have.
        let phase = self.phase.get_mut();
        if self.owner.mine() {
            if let Phase::Carried(l) = phase {
                // Carried before a fork, and perhaps still held by the
                // other process: demoted rather than ended (the kernel
                // socket ends with its last holder), once the peer
                // stopped writing into the ring (its QP goes with this
                // link). Else its end of stream, as always.
                if let Some(d) = self.owner.demote() {
                    let forked = d.forked.load(std::sync::atomic::Ordering::Acquire) != 0;
                    let took = forked
                        && d.held_elsewhere()
                        && l.can_demote()
                        && d.state
                            .compare_exchange(
                                crate::owner::D_NONE,
                                crate::owner::D_DEMOTING,
                                std::sync::atomic::Ordering::AcqRel,
                                std::sync::atomic::Ordering::Acquire,
                            )
                            .is_ok();
                    if took {
                        debug("closed while another process may hold it: demoted, not ended");
                        if l.demote_as_driver() {
                            l.close_in_demotion();
                        }
                        return;
                    }
                    if l.in_demotion() {
                        l.close_in_demotion();
                        return;
                    }
                }
                l.finish();
            }
            return;
        }
        let Phase::Carried(l) = std::mem::replace(phase, Phase::Tcp) else { return };
        crate::forkshare::leaving(self);
        if l.in_demotion() && l.maker() == crate::pid::get() {
            // Demoted here (plain TCP now): its QP and regions are this
            // process's, and go with the link.
            return;
        }
        // A holder's close after the fork: the peer's marker, if every
        // ring byte before it is read, so that the last close sends FIN.
        l.d_take_mark_at_close();
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

/// What every later call on a connection whose exchange of hellos failed
/// with `e` answers: the connection is gone (`ECONNRESET`) unless `e` says
/// why for good. An errno that asks the caller to try again (`EINTR`,
/// `EAGAIN`) is never kept: a program that does try again would be told
/// so for ever.
fn broken_errno(e: c_int) -> c_int {
    match e {
        libc::EPROTO | libc::EINTR | libc::EAGAIN | libc::EINPROGRESS | libc::EALREADY => libc::ECONNRESET,
        e => e,
    }
}

/// Waits (10 s at most) until `fd` is ready for `events`, whether or not
/// the application made it non-blocking.
///
/// A signal the program handles does not end the wait: the exchange is
/// the library's, half done (a hello sent, the peer's awaited), and it
/// cannot be left and taken up again by the program's next call. Ending
/// it with `EINTR` broke the connection for good, and that errno was
/// then every later call's answer: libpq retries a send that says
/// `EINTR` at once, so `pgbench -C -T` (its `SIGALRM` at the end of the
/// run) spun for ever in a connection being set up.
fn wait(fd: c_int, events: i16) -> Res<()> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let left = end.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd { fd, events, revents: 0 };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as c_int) };
        match r {
            1.. => return Ok(()),
            0 => return Err(libc::ETIMEDOUT),
            _ => match crate::table::errno() {
                libc::EINTR if !left.is_zero() => {}
                libc::EINTR => return Err(libc::ETIMEDOUT),
                e => return Err(e),
            },
        }
    }
}

/// Sends all of `b` on `fd` however long the other end takes to read, as
/// a blocking TCP write would (a demotion's resend where it cannot be
/// queued: a connection held by other processes too, or a queue sent
/// before this end is demoted itself, `link/outq.rs`; it cannot be given
/// up halfway: the program there may legitimately take its time before it
/// reads). Only the socket's end stops it: an error on it (the peer's
/// reset, its host gone: the kernel's own retransmission limits) or a
/// hang-up, each looked at every second. A peer process that is gone has
/// its socket closed by the kernel, which resets ours at the next send.
///
/// Or a deadlock with the program there ([`STALL`]): it writes before
/// it reads (`cat big; cat`), and this process, inside this resend (in a
/// read), reads nothing: its receive buffer fills, the program blocks in
/// its write and never reads ours. Seen as no progress of this send while
/// the socket's received bytes, unread, stay the same and fill a quarter
/// of its receive buffer or more, for [`STALL`] in a row:
/// `EDEADLK` (the caller resets the connection). A program that wrote
/// that much, then only sleeps before it reads, is taken for one in the
/// deadlock (`docs/sockets.md`, "Exec").
pub(crate) fn send_all_while_alive(fd: c_int, b: &[u8]) -> Res<()> {
    send_all_while_alive_until(fd, b, None)
}

/// As [`send_all_while_alive`], until `end` at most (`ETIMEDOUT` past it).
pub(crate) fn send_all_while_alive_until(
    fd: c_int,
    mut b: &[u8],
    end: Option<std::time::Instant>,
) -> Res<()> {
    let (mut stalled_since, mut last_inq) = (None::<std::time::Instant>, -1);
    while !b.is_empty() {
        if end.is_some_and(|e| std::time::Instant::now() >= e) {
            return Err(libc::ETIMEDOUT);
        }
        // SAFETY: `b` is valid for its length.
        let r =
            unsafe { real::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if r > 0 {
            b = &b[r as usize..];
            continue;
        }
        match crate::table::errno() {
            libc::EAGAIN => {
                let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                let ms = end.map_or(1000, |e| {
                    e.saturating_duration_since(std::time::Instant::now()).as_millis().clamp(1, 1000) as c_int
                });
                // SAFETY: one valid pollfd.
                let n = unsafe { libc::poll(&mut p, 1, ms) };
                if n == 1 && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                    return Err(match socket_error(fd) {
                        0 => libc::EPIPE,
                        e => e,
                    });
                }
                if n == 1 {
                    stalled_since = None;
                } else {
                    // No room within the second, or a signal (timed by
                    // the clock: a timer signal above 1 Hz must neither
                    // keep the count at 0 nor make it run fast).
                    if let e @ 1.. = socket_error(fd) {
                        return Err(e);
                    }
                    let inq = unread_bytes(fd);
                    let full = inq > 0 && inq == last_inq && inq.saturating_mul(4) >= rcvbuf(fd);
                    last_inq = inq;
                    match (full, stalled_since) {
                        (false, _) => stalled_since = None,
                        (true, None) => stalled_since = Some(std::time::Instant::now()),
                        (true, Some(t)) if t.elapsed() >= STALL => return Err(libc::EDEADLK),
                        (true, Some(_)) => {}
                    }
                }
            }
            libc::EINTR => {}
            e => return Err(e),
        }
    }
    Ok(())
}

/// How long without progress of a resend, the received bytes unread and
/// filling the receive buffer, is taken for a deadlock.
const STALL: std::time::Duration = std::time::Duration::from_secs(3);

/// The bytes received on `fd` and not read yet (`FIONREAD`), -1 unknown.
fn unread_bytes(fd: c_int) -> c_int {
    let mut n: c_int = 0;
    // SAFETY: ioctl(2) FIONREAD into an int of ours.
    let r = unsafe { real::ioctl(fd, libc::FIONREAD, (&mut n as *mut c_int).cast()) };
    if r == 0 {
        n
    } else {
        -1
    }
}

/// The socket's receive buffer (`SO_RCVBUF`, as the kernel reports it).
fn rcvbuf(fd: c_int) -> c_int {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into an int of ours, its size.
    let r = unsafe {
        real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, (&mut v as *mut c_int).cast(), &mut len)
    };
    if r == 0 && v > 0 {
        v
    } else {
        c_int::MAX
    }
}

/// The socket's pending error (`SO_ERROR`), 0 for none.
pub(crate) fn socket_error(fd: c_int) -> c_int {
    let mut e: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into an int of ours, its size.
    let r = unsafe {
        real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ERROR, (&mut e as *mut c_int).cast(), &mut len)
    };
    if r == 0 {
        e
    } else {
        0
    }
}

pub(crate) fn send_all(fd: c_int, mut b: &[u8]) -> Res<()> {
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
