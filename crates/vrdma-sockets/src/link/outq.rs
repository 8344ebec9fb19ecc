//! The outgoing queue of an exec's resend (`docs/sockets.md`, "Exec"):
//! the marker and bytes that the peer of an exec demotion (P) sends again
//! on the kernel socket, as far as the kernel did not take them at once.
//!
//! Why a queue: P resends inside whichever call of its program noticed
//! the demotion (often a read). Sent synchronously, a program at the
//! other end that writes before it reads (`cat big; cat`) blocks in its
//! write, since P reads nothing while it resends, and never reads P's
//! bytes: both would wait for ever. Queued, P's call returns and its
//! reads go on (its incoming path stays the kernel's), so the program's
//! output is read and the program gets to read what P sends.
//!
//! Who pushes it: P's later writes on the connection (they go behind it:
//! a blocking one flushes it first, a non-blocking one pushes what fits
//! and says `EAGAIN` while bytes of it remain), the progress thread
//! (`crate::progress`, while P makes no call), the readiness calls (whose
//! `POLLOUT`/`EPOLLOUT` is withheld while it is not empty), and a
//! `shutdown(SHUT_WR)` (its FIN waits until the queue is sent), a close
//! (which flushes it) and the process's exit (`atexit`: within
//! `VRDMA_SOCKETS_WAIT_MS`). Only in the process that made it (after a fork,
//! the child's copy of the memory is not a queue of its own), and only
//! for a connection held by that one process when the resend began
//! (else the resend is synchronous, as before).
//!
//! [`OutQ`] is the accounting, without sockets (unit-tested below).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use libc::c_int;

use super::{Link, Res};
use crate::real;

/// The queue's lock, held: the library's lines said meanwhile are said
/// once it is let go (`crate::connlock`): the program's descriptor 2 may
/// be this very connection, whose write takes this lock.
pub(crate) type OutLock<'a> = crate::connlock::ConnGuard<'a, OutQ>;

/// Bytes queued for the kernel socket, sent in order, each once.
#[derive(Debug, Default)]
pub(crate) struct OutQ {
    buf: Vec<u8>,
    /// Bytes of `buf` sent already.
    at: usize,
}

/// What a push ended with.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Everything is sent.
    Empty,
    /// The kernel takes no more now (`EAGAIN`): this many bytes remain.
    Full(usize),
}

impl OutQ {
    /// A queue of `buf`, of which `at` bytes were sent.
    pub(crate) fn new(buf: Vec<u8>, at: usize) -> OutQ {
        let at = at.min(buf.len());
        let mut q = OutQ { buf, at };
        q.tidy();
        q
    }

    /// The bytes still to send.
    pub(crate) fn pending(&self) -> &[u8] {
        &self.buf[self.at..]
    }

    pub(crate) fn len(&self) -> usize {
        self.buf.len() - self.at
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `n` more bytes were sent (at most what remains).
    pub(crate) fn sent(&mut self, n: usize) {
        self.at = (self.at + n).min(self.buf.len());
        self.tidy();
    }

    fn tidy(&mut self) {
        if self.is_empty() {
            self.buf = Vec::new();
            self.at = 0;
        }
    }

    /// Sends with `send` (which takes a slice and answers the bytes it
    /// took, or an errno) until it is empty or `send` says `EAGAIN`;
    /// `EINTR` is tried again; any other errno is returned, the bytes not
    /// sent left in the queue.
    pub(crate) fn push(&mut self, mut send: impl FnMut(&[u8]) -> Res<usize>) -> Res<Pushed> {
        while !self.is_empty() {
            match send(self.pending()) {
                Ok(0) => return Ok(Pushed::Full(self.len())),
                Ok(n) => self.sent(n),
                Err(libc::EINTR) => {}
                Err(libc::EAGAIN) => return Ok(Pushed::Full(self.len())),
                Err(e) => return Err(e),
            }
        }
        Ok(Pushed::Empty)
    }
}

/// One non-blocking send of `b` on `sock` (no `SIGPIPE`).
pub(crate) fn send_now(sock: c_int, b: &[u8]) -> Res<usize> {
    // SAFETY: `b` is valid for its length.
    let r = unsafe { real::send(sock, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if r >= 0 {
        Ok(r as usize)
    } else {
        Err(crate::table::errno())
    }
}

/// Waits (100 ms at most: a `shutdown` is looked at between) for room
/// on `sock`; an error or hang-up on it is returned.
fn wait_room(sock: c_int) -> Res<()> {
    wait_room_for(sock, Duration::from_millis(100))
}

/// Waits (`max` at most) for room on `sock`, as [`wait_room`].
fn wait_room_for(sock: c_int, max: Duration) -> Res<()> {
    let mut p = libc::pollfd { fd: sock, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, max.as_millis().clamp(1, 1000) as c_int) };
    if n == 1 && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
        return Err(match crate::stream::socket_error(sock) {
            0 => libc::EPIPE,
            e => e,
        });
    }
    Ok(())
}

/// Reads and drops what waits on `sock` (a close that flushes: nobody
/// reads them any more, as TCP's close drops them).
fn drop_incoming(sock: c_int) -> usize {
    let mut b = [0u8; 16384];
    let mut n = 0;
    loop {
        // SAFETY: `b` is valid for its length.
        let r = unsafe { real::recv(sock, b.as_mut_ptr().cast(), b.len(), libc::MSG_DONTWAIT) };
        if r <= 0 {
            return n;
        }
        n += r as usize;
    }
}

impl Link {
    /// The queue's lock (waited for).
    fn lock_out(&self) -> OutLock<'_> {
        self.out.lock()
    }

    /// The queue's lock if it is free now.
    fn try_lock_out(&self) -> Option<OutLock<'_>> {
        self.out.try_lock().ok()
    }

    /// The queue's lock, tried until `end` (another thread may hold it
    /// for ever, blocked in a write), `pause` between the tries (false:
    /// given up before `end`). `None`: not had.
    fn lock_out_until(&self, end: Instant, mut pause: impl FnMut() -> bool) -> Option<OutLock<'_>> {
        loop {
            if let Some(o) = self.try_lock_out() {
                return Some(o);
            }
            if Instant::now() >= end || !pause() {
                return None;
            }
        }
    }

    /// Whether this process has bytes queued for the kernel socket (an
    /// exec's resend not sent yet).
    pub(crate) fn out_queued(&self) -> bool {
        self.out_len.load(Ordering::SeqCst) > 0 && self.out_pid.load(Ordering::Acquire) == crate::pid::get()
    }

    /// Queues the rest of an exec's resend (`q`, not empty).
    pub(super) fn queue_out(&self, q: OutQ) {
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        AT_EXIT.call_once(|| {
            // SAFETY: registers a handler with no pointers but the
            // function (the library is never unloaded).
            unsafe { libc::atexit(flush_queues_at_exit) };
        });
        let mut o = self.lock_out();
        self.out_pid.store(crate::pid::get(), Ordering::Release);
        self.out_len.store(q.len(), Ordering::SeqCst);
        *o = q;
        self.reset_if_ended_now();
        drop(o);
        // No `EPOLLOUT` until it is sent (the progress thread gives it
        // back then: `Link::still_blocked`).
        self.write_blocked_now();
    }

    /// The queue just emptied: a `shutdown(SHUT_WR)` that waited goes to
    /// the kernel, the connection is plain TCP if both ways switched, and
    /// writability comes back (epoll's `EPOLLOUT`, poll's waiters).
    fn out_emptied(&self) {
        self.end_as_the_program_asked();
        // (SeqCst: against `shut_behind_out`, which stores its flag, then
        // looks at the count; and `p_done`'s look at `p_rd`.)
        self.out_len.store(0, Ordering::SeqCst);
        if self.out_shut.load(Ordering::SeqCst) {
            self.shut_out_now();
        }
        self.p_done();
        self.unblock();
        crate::credit::came();
    }

    /// While the queue holds bytes, the socket lingers 0, so that a
    /// process end that runs no handler of the library (`_exit`, a fatal
    /// signal, `SIGKILL`) resets the connection when the kernel closes it:
    /// the program there reads an error, never a clean end behind a
    /// truncated resend. A close, an exec and `exit` flush first and reset
    /// if anything is left, as before; the socket's own linger (the
    /// program's) is kept and put back when the queue empties
    /// ([`Self::end_as_the_program_asked`]). Called with the queue's lock
    /// held.
    fn reset_if_ended_now(&self) {
        let mut kept = self.out_linger.lock().unwrap_or_else(|p| p.into_inner());
        if kept.is_some() {
            return;
        }
        let own = Self::get_linger(self.sock);
        let Some(own) =
            own.filter(|_| Self::set_linger(self.sock, libc::linger { l_onoff: 1, l_linger: 0 }) == 0)
        else {
            crate::dev::debug(&format!(
                "a queued resend's linger 0 not set (errno {}): an end without handlers is a FIN",
                crate::table::errno()
            ));
            return;
        };
        *kept = Some(own);
    }

    /// The queue emptied: the socket's own linger back
    /// ([`Self::reset_if_ended_now`]).
    fn end_as_the_program_asked(&self) {
        // (The lock held until the linger is back: a program's
        // `setsockopt` meanwhile comes after it.)
        let mut kept = self.out_linger.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(own) = kept.take().filter(|_| !self.out_stuck()) {
            Self::set_linger(self.sock, own);
        }
    }

    /// Whether this process's queue may hold the socket's linger (it made
    /// the queue): in another (a child forked since) the program's
    /// `SO_LINGER` calls go straight to the kernel, as for a connection
    /// that never queued.
    fn keeps_linger_here(&self) -> bool {
        self.out_pid.load(Ordering::Acquire) == crate::pid::get()
    }

    /// The program's `setsockopt(SO_LINGER)` on this connection (`fd`):
    /// to the kernel, which checks it; while the queue holds bytes it is
    /// kept as the socket's own, put back when the queue empties, and the
    /// linger 0 stays ([`Self::reset_if_ended_now`]).
    ///
    /// # Safety
    /// `val` and `len` as setsockopt(2) takes them (the kernel checks
    /// them).
    pub(crate) unsafe fn program_sets_linger(
        &self,
        fd: c_int,
        val: *const libc::c_void,
        len: libc::socklen_t,
    ) -> c_int {
        if !self.keeps_linger_here() {
            // SAFETY: the caller's arguments, as setsockopt(2) takes them.
            return unsafe { real::setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, val, len) };
        }
        let mut kept = self.out_linger.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller's arguments, as setsockopt(2) takes them.
        let r = unsafe { real::setsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, val, len) };
        // (A connection whose reset could not disconnect it keeps the
        // reset's linger 0 whatever the program sets: its last close must
        // be a reset, not a FIN behind what was dropped.)
        if r == 0 && (kept.is_some() || self.out_stuck()) {
            if let Some(own) = Self::get_linger(self.sock).filter(|_| kept.is_some()) {
                *kept = Some(own);
            }
            crate::table::keep_errno(|| {
                Self::set_linger(self.sock, libc::linger { l_onoff: 1, l_linger: 0 })
            });
        }
        r
    }

    /// The program's `getsockopt(SO_LINGER)`: while the queue holds bytes,
    /// the socket's own linger (the program's), not the 0 the library
    /// set; the kernel checks the arguments and says how much it copies.
    ///
    /// # Safety
    /// `val` and `len` as getsockopt(2) takes them.
    pub(crate) unsafe fn program_gets_linger(
        &self,
        fd: c_int,
        val: *mut libc::c_void,
        len: *mut libc::socklen_t,
    ) -> c_int {
        if !self.keeps_linger_here() {
            // SAFETY: the caller's arguments, as getsockopt(2) takes them.
            return unsafe { real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, val, len) };
        }
        let kept = self.out_linger.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller's arguments, as getsockopt(2) takes them.
        let r = unsafe { real::getsockopt(fd, libc::SOL_SOCKET, libc::SO_LINGER, val, len) };
        if let (0, Some(own), false) = (r, *kept, val.is_null() || len.is_null()) {
            // SAFETY: the kernel just wrote `*len` bytes (at most a
            // linger's) at `val`, which is not null: they are the
            // caller's, valid.
            unsafe {
                let n = (*len as usize).min(std::mem::size_of::<libc::linger>());
                std::ptr::copy_nonoverlapping(
                    (&own as *const libc::linger).cast::<u8>(),
                    val.cast::<u8>(),
                    n,
                );
            }
        }
        r
    }

    /// `SO_LINGER` of `sock`, if getsockopt says it.
    fn get_linger(sock: c_int) -> Option<libc::linger> {
        let mut own = libc::linger { l_onoff: 0, l_linger: 0 };
        let mut len = std::mem::size_of::<libc::linger>() as libc::socklen_t;
        // SAFETY: getsockopt(2) of `sock` into a linger of ours, its size.
        let got = unsafe {
            real::getsockopt(
                sock,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&mut own as *mut libc::linger).cast(),
                &mut len,
            )
        };
        (got == 0).then_some(own)
    }

    /// `SO_LINGER` of `sock` to `lg`; setsockopt's result.
    fn set_linger(sock: c_int, lg: libc::linger) -> c_int {
        // SAFETY: setsockopt(2) with a linger of ours, its size.
        unsafe {
            real::setsockopt(
                sock,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&lg as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        }
    }

    /// The kernel socket's `SHUT_WR` that waited for the queue, once.
    fn shut_out_now(&self) {
        if !self.out_shut_done.swap(true, Ordering::SeqCst) {
            // SAFETY: shutdown(2) of the library's descriptor.
            unsafe { real::shutdown(self.sock, libc::SHUT_WR) };
        }
    }

    /// The push failed (`e`: the socket's end, the program there gone):
    /// what was queued cannot reach it any more. The failing send took
    /// the socket's error, so it is kept here: the program's next call on
    /// the connection returns it ([`Self::take_out_err`]), and only then
    /// is the connection plain TCP (a reset never reads as a clean end).
    /// The state is final before anything is said (the queue empty, its
    /// count 0, the error kept), and the warning waits until the queue's
    /// lock is let go ([`OutLock`]): its write may be this connection's.
    fn out_failed(&self, o: &mut OutQ, e: c_int) {
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let lost = o.len();
        *o = OutQ::default();
        self.out_err.store(if e == 0 { libc::ECONNRESET } else { e }, Ordering::SeqCst);
        self.out_emptied();
        crate::dev::warn_once(
            &SAID,
            &format!(
                "the rest of a resend to an exec'd program could not be sent (errno {e}: the connection ended): \
                 {lost} bytes lost with it; the program's next call on it gets the error"
            ),
        );
    }

    /// Resets `sock` for a queue cut short (`Link::reset_sock`); where
    /// that could not disconnect it, every later call of the program on
    /// the connection fails (`out_stuck`): the bytes it writes would
    /// otherwise go out behind the ones dropped, a silent gap.
    fn reset_out_sock(&self, sock: c_int) {
        if !Self::reset_sock(sock) {
            self.out_stuck.store(true, Ordering::SeqCst);
            // The reset's linger 0 stays: the socket's own is not put
            // back when the queue is cleared, nor by the program.
            self.out_linger.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    /// Whether a queue cut short could not be reset ([`Self::reset_out_sock`]):
    /// every later call of the program on the connection fails.
    pub(crate) fn out_stuck(&self) -> bool {
        self.out_stuck.load(Ordering::SeqCst)
    }

    /// The errno of a failed push, for the program's call (once: every
    /// call where the reset could not disconnect the socket); the
    /// connection is plain TCP from then on (if both ways switched). A
    /// line of the library's own (its descriptor 2 this connection) fails
    /// with it and leaves it for the program (`crate::dev::saying`).
    pub(super) fn take_out_err(&self) -> Option<c_int> {
        if self.out_stuck() {
            return Some(libc::ECONNRESET);
        }
        if self.out_err.load(Ordering::SeqCst) == 0 {
            return None;
        }
        if crate::dev::saying() {
            return Some(self.out_err.load(Ordering::SeqCst)).filter(|&e| e != 0);
        }
        let e = self.out_err.swap(0, Ordering::SeqCst);
        if e == 0 {
            return None;
        }
        self.p_done();
        Some(e)
    }

    /// A read met the kernel socket's end: the errno of a push of the
    /// queue that failed meanwhile, if any (a push now first where the
    /// queue is still there and free: the failing send of a push in
    /// progress may not have stored it yet). `EPIPE` (the reset's error
    /// taken by an earlier call) reads as `ECONNRESET`: bytes were lost,
    /// the end is not clean.
    pub(super) fn out_err_at_end(&self) -> Option<c_int> {
        if self.out_err.load(Ordering::SeqCst) == 0 && self.out_queued() {
            // A push in progress (the progress thread's, a writer's) may
            // have taken the socket's error and not stored it yet: the
            // lock is waited for a short while (a push holds it for one
            // non-blocking send, and a writer whose flush meets the reset
            // lets go at once; one that still has room to wait for, the
            // end being a FIN, is not waited out).
            let end = Instant::now() + Duration::from_millis(200);
            let held = self.lock_out_until(end, || {
                if self.out_err.load(Ordering::SeqCst) != 0 {
                    return false;
                }
                std::thread::yield_now();
                true
            });
            if let Some(mut o) = held {
                self.push_locked(&mut o);
            }
        }
        self.take_out_err().map(|e| if e == libc::EPIPE { libc::ECONNRESET } else { e })
    }

    /// Pushes what the kernel takes now. `wait`: waits for the lock (a
    /// writer of the program), else leaves it to whoever holds it.
    /// Whether the queue is empty now.
    pub(crate) fn push_out(&self, wait: bool) -> bool {
        if !self.out_queued() {
            return true;
        }
        let mut o = if wait {
            self.lock_out()
        } else {
            match self.try_lock_out() {
                Some(o) => o,
                None => return false,
            }
        };
        self.push_locked(&mut o)
    }

    fn push_locked(&self, o: &mut OutQ) -> bool {
        if o.is_empty() {
            return true;
        }
        match o.push(|b| send_now(self.sock, b)) {
            Ok(Pushed::Empty) => {
                self.out_emptied();
                crate::dev::debug("the exec resend's queue is sent");
                true
            }
            Ok(Pushed::Full(n)) => {
                self.out_len.store(n, Ordering::SeqCst);
                false
            }
            Err(e) => {
                self.out_failed(o, e);
                true
            }
        }
    }

    /// Sends the whole queue, however long the other end takes to read
    /// (as a blocking write would), for a blocking write of the program
    /// behind it. `Err`: the socket's error (the queue is dropped), or
    /// `EPIPE` once a `shutdown(SHUT_WR)` came meanwhile (the queue stays,
    /// for the progress thread, then the FIN).
    fn flush_out(&self) -> Res<()> {
        if !self.out_queued() {
            return Ok(());
        }
        let mut o = self.lock_out();
        loop {
            if self.push_locked(&mut o) {
                break;
            }
            // A shutdown of the write side: this write fails, as TCP's
            // (looked at after every slice of the wait).
            if self.out_shut.load(Ordering::SeqCst) {
                return Err(libc::EPIPE);
            }
            if let Err(e) = wait_room(self.sock) {
                self.out_failed(&mut o, e);
                return Err(self.take_out_err().unwrap_or(e));
            }
            if let e @ 1.. = crate::stream::socket_error(self.sock) {
                self.out_failed(&mut o, e);
                return Err(self.take_out_err().unwrap_or(e));
            }
        }
        // (An error the push met emptied the queue and is kept.)
        match self.take_out_err() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Sends the queue (held: `o`) until `end` at most, reading and
    /// dropping what comes in meanwhile where `drop_in` (a close or an
    /// exit: nobody reads it any more, and a program there that writes
    /// before it reads would otherwise block for ever; not an exec, which
    /// may fail and leave the process reading on). `Err`: the bytes not
    /// sent (the push failed, or `end` came).
    fn flush_locked_until(&self, o: &mut OutQ, end: Instant, drop_in: bool) -> Result<(), usize> {
        let mut dropped = 0;
        let r = loop {
            let n = o.len();
            if self.push_locked(o) {
                break if self.out_err.load(Ordering::SeqCst) != 0 { Err(n) } else { Ok(()) };
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Err(o.len());
            }
            if drop_in {
                dropped += drop_incoming(self.sock);
            }
            if let Err(e) = wait_room_for(self.sock, left) {
                let n = o.len();
                self.out_failed(o, e);
                break Err(n);
            }
        };
        if dropped > 0 {
            crate::dev::debug(&format!(
                "{dropped} bytes dropped unread while the resend's queue was flushed"
            ));
        }
        r
    }

    /// At a close, an exec or the exit (`what`): sends the queue until
    /// `end` ([`Self::flush_locked_until`], `drop_in` as there); what is
    /// not sent by then (or lost with a failed push) resets the
    /// connection, so the program there reads an error, never a clean,
    /// short stream. The reset comes first, then the queue and its count
    /// are cleared (under the lock: no write of another thread goes to
    /// the kernel socket behind a hole), then the warning (the lock let
    /// go: descriptor 2 may be this connection). Where the lock is not
    /// had by `end` (a writer blocked behind the queue holds it), the
    /// reset ends that writer's wait, and its push clears the queue.
    pub(crate) fn flush_out_or_reset(&self, end: Instant, what: &str, drop_in: bool) {
        if !self.out_queued() {
            return;
        }
        let held = self.lock_out_until(end, || {
            std::thread::sleep(Duration::from_millis(1));
            true
        });
        let n = match held {
            Some(mut o) => match self.flush_locked_until(&mut o, end, drop_in) {
                Ok(()) => return,
                Err(n) => {
                    self.out_reset.store(true, Ordering::SeqCst);
                    self.reset_out_sock(self.sock);
                    *o = OutQ::default();
                    self.out_len.store(0, Ordering::SeqCst);
                    n
                }
            },
            None => {
                self.out_reset.store(true, Ordering::SeqCst);
                self.reset_out_sock(self.sock);
                self.out_len.load(Ordering::SeqCst)
            }
        };
        // Writers waiting for writability wake and see the failure.
        self.unblock();
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        crate::dev::warn_once(
            &SAID,
            &format!(
                "{what} with {n} bytes of a resend to an exec'd program not sent (not read within \
                 VRDMA_SOCKETS_WAIT_MS, or the connection ended): the connection is reset"
            ),
        );
    }

    /// As [`Self::flush_out`], where the program's own threads may be
    /// the only readers and are not (a demotion of this end as the
    /// driver, before an exec): the deadlock guess of the synchronous
    /// resend ([`crate::stream::send_all_while_alive`]) ends it. A failure
    /// (part of the queue may be sent) resets the connection: never plain
    /// TCP behind a stream with a hole (the caller marks the demotion
    /// failed, so every later call fails). Within `VRDMA_SOCKETS_WAIT_MS`
    /// (the lock, then the sending): a close after a fork or the watcher
    /// of a child's write must not wait for ever for a program there that
    /// neither reads nor writes (the guess never fires then); past it,
    /// `ETIMEDOUT` and the reset. The state is final (reset, queue and
    /// count cleared) and the lock let go before the warning.
    pub(crate) fn flush_out_guessing(&self, sock: c_int) -> Res<()> {
        if !self.out_queued() {
            return Ok(());
        }
        let end = Instant::now() + super::demote::wait_ms();
        // (A writer of the program may hold it, blocked behind the queue.)
        let mut held = self.lock_out_until(end, || {
            std::thread::sleep(Duration::from_millis(1));
            true
        });
        let r = match held.as_mut() {
            Some(o) => {
                let r = crate::stream::send_all_while_alive_until(sock, o.pending(), Some(end));
                **o = OutQ::default();
                r
            }
            None => Err(libc::ETIMEDOUT),
        };
        match r {
            Ok(()) => {
                self.out_emptied();
                Ok(())
            }
            Err(e) => {
                self.out_reset.store(true, Ordering::SeqCst);
                self.reset_out_sock(sock);
                self.out_len.store(0, Ordering::SeqCst);
                drop(held);
                // Writers waiting for writability wake and see the failure.
                self.unblock();
                static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                crate::dev::warn_once(
                    &SAID,
                    &format!(
                        "the resend to an exec'd program still queued could not be sent before this end's own \
                         demotion (errno {e}): the connection is reset"
                    ),
                );
                Err(e)
            }
        }
    }

    /// A write of the program behind the queue: `None` if nothing is
    /// queued (the kernel socket's). Blocking: the queue first, then the
    /// write. Non-blocking: what fits of the queue, then the write if the
    /// queue is empty, else `EAGAIN` (the kernel's buffer is full then:
    /// an edge-triggered `EPOLLOUT` comes once it drains, and epoll's
    /// `EPOLLOUT` is withheld until the queue is sent).
    pub(crate) fn write_behind_out(
        self: &std::sync::Arc<Self>,
        iov: &[(*const u8, usize)],
        nonblocking: bool,
    ) -> Option<Res<usize>> {
        if !self.out_queued() {
            return None;
        }
        if self.out_shut.load(Ordering::SeqCst) {
            return Some(Err(libc::EPIPE));
        }
        if nonblocking {
            // Never waits for the lock: a blocking writer may hold it for
            // as long as the other end does not read (`EAGAIN` then, as
            // for a queue not sent yet).
            let Some(mut o) = self.try_lock_out() else {
                self.write_blocked_now();
                crate::progress::watch(self);
                return Some(Err(libc::EAGAIN));
            };
            if !self.push_locked(&mut o) {
                drop(o);
                self.write_blocked_now();
                crate::progress::watch(self);
                return Some(Err(libc::EAGAIN));
            }
            drop(o);
            return Some(self.write_kernel(iov, true));
        }
        if let Err(e) = self.flush_out() {
            return Some(Err(e));
        }
        Some(self.write_kernel(iov, false))
    }

    /// `shutdown(SHUT_WR)` while bytes are queued: the FIN waits for
    /// them (sent once the queue is empty). Whether it waits (the caller
    /// does not shut the kernel socket's writes now). A flag, not the
    /// queue's lock: a blocking writer may hold that for long; it sees
    /// the flag within a slice of its wait and fails with `EPIPE`.
    pub(crate) fn shut_behind_out(&self) -> bool {
        if !self.out_queued() {
            return false;
        }
        self.out_shut.store(true, Ordering::SeqCst);
        // Emptied meanwhile (its emptying may not have seen the flag).
        if self.out_len.load(Ordering::SeqCst) == 0 {
            self.shut_out_now();
            return true;
        }
        // Pushed now where it fits (and the FIN with it), unless a writer
        // holds the queue.
        self.push_out(false);
        true
    }

    /// A slice for a poll that waits for the queue to go (the kernel
    /// socket is not asked for `POLLOUT` meanwhile).
    pub(crate) const OUT_SLICE: Duration = Duration::from_millis(2);
}

/// The process exits (`atexit`, registered with the first queue): every
/// queue of its connections is sent first, within
/// `VRDMA_SOCKETS_WAIT_MS` in all (TCP would deliver them after the exit;
/// the library's queue goes with the process).
extern "C" fn flush_queues_at_exit() {
    // Not in a `vfork` child that calls `exit`: the queues in this memory
    // are its parent's, which lives on (and pushes them).
    if crate::pid::vforked() {
        return;
    }
    // (Inside the library or not: the calls below are libc's own.)
    let _g = crate::table::Guard::enter();
    let end = Instant::now() + super::demote::wait_ms();
    let links = crate::progress::listed_now();
    crate::dev::debug(&format!("exit: {} connections listed", links.len()));
    for l in links {
        l.flush_out_or_reset(end, "the process exits", true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel that takes `k` bytes per call, `room` in all, then EAGAIN.
    struct Kernel {
        got: Vec<u8>,
        k: usize,
        room: usize,
    }

    impl Kernel {
        fn take(&mut self, b: &[u8]) -> Res<usize> {
            if self.room == 0 {
                return Err(libc::EAGAIN);
            }
            let n = b.len().min(self.k).min(self.room);
            self.got.extend_from_slice(&b[..n]);
            self.room -= n;
            Ok(n)
        }
    }

    #[test]
    fn a_queue_sends_every_byte_once_in_order_across_pushes() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut q = OutQ::new(data.clone(), 100);
        let mut kern = Kernel { got: data[..100].to_vec(), k: 700, room: 3000 };
        assert_eq!(q.push(|b| kern.take(b)), Ok(Pushed::Full(10_000 - 3100)));
        (kern.k, kern.room) = (4096, 5000);
        assert_eq!(q.push(|b| kern.take(b)), Ok(Pushed::Full(10_000 - 8100)));
        (kern.k, kern.room) = (1, usize::MAX);
        assert_eq!(q.push(|b| kern.take(b)), Ok(Pushed::Empty));
        assert!(q.is_empty());
        assert_eq!(kern.got, data);
        // Empty: nothing more goes.
        assert_eq!(q.push(|b| kern.take(b)), Ok(Pushed::Empty));
        assert_eq!(kern.got.len(), data.len());
    }

    #[test]
    fn an_error_keeps_the_bytes_not_sent_and_eintr_is_tried_again() {
        let mut q = OutQ::new(vec![1, 2, 3, 4], 0);
        let mut calls = 0;
        let r = q.push(|b| {
            calls += 1;
            match calls {
                1 => Err(libc::EINTR),
                2 => Ok(b.len().min(1)),
                _ => Err(libc::EPIPE),
            }
        });
        assert_eq!(r, Err(libc::EPIPE));
        assert_eq!(q.pending(), &[2, 3, 4]);
    }

    #[test]
    fn a_queue_made_all_sent_is_empty() {
        let q = OutQ::new(vec![1, 2], 5);
        assert!(q.is_empty());
        let mut q = OutQ::new(vec![1, 2], 1);
        assert_eq!(q.len(), 1);
        q.sent(10);
        assert!(q.is_empty());
    }
}
