//! The demotion of a carried connection to plain TCP, mid-stream, at an
//! exact byte each way: how a connection carried before a `fork` is
//! shared by the processes that hold it (`docs/sockets.md`, "Sharing a
//! carried connection after fork"; who asks and when:
//! [`crate::forkshare`]).
//!
//! At the end whose process forked (D), the driver stops its ring writes,
//! waits until they landed, writes their exact count into the peer's
//! `DEMOTE` word and sends a marker (a byte 0, which no wake byte is) and
//! the same count on the kernel socket. From then on every holder at D,
//! in any process, writes to the kernel socket, and reads the ring (its
//! bytes are the peer's, in a memfd every holder maps), then the peer's
//! marker, then the kernel socket. The ring's read count is in the
//! shared page, read under a lock between the processes.
//!
//! The peer (P), at its first write, wait for credits, or read that
//! reaches the marker: stops its ring writes, waits until they landed,
//! sends its own marker and count, and writes to the kernel socket; its
//! reads take its ring up to D's count, then D's marker, then the kernel
//! socket. Both ends resend nothing: every byte over the ring is read
//! from the ring.
//!
//! An exec demotion ([`Link::demote_for_exec`], `crate::exec`) is D's part
//! done synchronously before an exec, whose program inherits the kernel
//! socket; D's ring goes with the exec, so D's read count goes into the
//! peer's `DEMOTE_RD` word and the `DEMOTE` word has its top bit set (only
//! for a peer whose hello says it answers that): P reads its bytes past
//! that count back from D's ring (an RDMA read) and sends them after its
//! marker, whose count is D's read count; D takes the marker off and
//! execs. What the kernel does not take at once is queued
//! ([`super::outq`]): P's call returns and its reads go on.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use libc::c_int;
use vrdma::wr::{self, SendWrExt as _};

use super::{lock, Link, Res, Rx, Tx, DEMOTE, DEMOTE_RD, EXEC_BIT, MARK_LEN, RING, S_DEMOTE, S_DEMOTE_RD};
use crate::owner::{Demote, D_DEMOTED, D_DEMOTING, D_DONE, D_FAILED, D_NONE};
use crate::real;

/// Where a peer's read goes once its ring is read up to the demoting
/// end's count ([`Link::p_switch_reads`]).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PSwitch {
    /// The marker is taken (by this thread or another): the kernel socket.
    Kernel,
    /// The end came instead.
    End,
    /// This end is demoted itself (both ends forked): the demoted read,
    /// which takes the marker under the same lock.
    Demoted,
}

/// A demotion's marker and record for `count` ring bytes written.
fn mark(count: u64) -> [u8; MARK_LEN] {
    let mut b = [0u8; MARK_LEN];
    b[1] = 1;
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b
}

/// The count in a marker and record, if `b` is one.
fn parse_mark(b: &[u8; MARK_LEN]) -> Option<u64> {
    (b[0] == 0 && b[1] == 1).then(|| u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()))
}

/// What the head of the kernel socket holds, after the wake bytes
/// before it were taken off.
enum Head {
    /// A whole marker and record (not taken yet): the count.
    Mark(u64),
    /// Nothing yet.
    Nothing,
    /// Part of a marker (the socket reads readable: a wait for it must
    /// sleep, not poll).
    Part,
    /// The socket's end.
    End,
    /// Not a marker: a protocol error.
    Bad,
}

/// Takes the wake bytes (1..=255) at the head of `sock` off, and looks at
/// what follows without taking it.
fn head(sock: c_int) -> Res<Head> {
    let mut b = [0u8; 64];
    loop {
        // SAFETY: `b` is valid for its length; a peek takes nothing.
        let r =
            unsafe { real::recv(sock, b.as_mut_ptr().cast(), b.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
        let n = match r {
            0 => return Ok(Head::End),
            1.. => r as usize,
            _ => {
                return match crate::table::errno() {
                    libc::EAGAIN | libc::EINTR => Ok(Head::Nothing),
                    e => Err(e),
                }
            }
        };
        let wakes = b[..n].iter().position(|&x| x == 0).unwrap_or(n);
        if wakes > 0 {
            // SAFETY: as above; takes the `wakes` bytes just peeked.
            unsafe { real::recv(sock, b.as_mut_ptr().cast(), wakes, libc::MSG_DONTWAIT) };
            continue;
        }
        if n < MARK_LEN {
            return Ok(Head::Part);
        }
        let m: [u8; MARK_LEN] = b[..MARK_LEN].try_into().unwrap_or([1; MARK_LEN]);
        return Ok(parse_mark(&m).map_or(Head::Bad, Head::Mark));
    }
}

/// What a reader whose ring was empty at read count `rd` does with the
/// peer's marker for `w` ring bytes, `written` the ring's written count
/// and `late` whether ring bytes wait now (looked at after the marker).
#[derive(Debug, PartialEq, Eq)]
enum AtMark {
    /// Every ring byte read: the marker goes, then the kernel socket.
    Take,
    /// Ring bytes landed meanwhile: they are read first.
    Ring,
    /// The peer's bytes up to its count are not visible yet: later.
    Wait,
    /// A count that cannot be (behind the ring's, or past what it
    /// wrote): a protocol error.
    Bad,
}

fn at_mark(w: u64, rd: u64, written: u64, late: bool) -> AtMark {
    if w == rd {
        AtMark::Take
    } else if w < rd {
        AtMark::Bad
    } else if late {
        AtMark::Ring
    } else if written >= w {
        // Everything up to the count landed and none of it waits, yet
        // the read count is behind it.
        AtMark::Bad
    } else {
        AtMark::Wait
    }
}

/// Takes a marker and record (peeked whole by [`head`]) off `sock`.
fn take_mark(sock: c_int) {
    let mut b = [0u8; MARK_LEN];
    // SAFETY: `b` is valid for its length; the bytes are in the socket.
    unsafe { real::recv(sock, b.as_mut_ptr().cast(), MARK_LEN, libc::MSG_DONTWAIT) };
}

/// Waits for more of the head of `sock`: a part of a marker (readable
/// already) a millisecond, else until it is readable, `max` at most.
fn wait_more(sock: c_int, part: bool, max: Duration) {
    if part {
        std::thread::sleep(Duration::from_millis(1));
    } else {
        wait_readable(sock, max);
    }
}

/// Waits until `sock` is readable, `max` at most.
fn wait_readable(sock: c_int, max: Duration) {
    let mut p = libc::pollfd { fd: sock, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, max.as_millis().max(1) as c_int) };
}

/// The lock between the processes that read the ring of a demoted
/// connection (held while a read copies and moves the shared count).
struct RingLock<'a>(&'a Demote);

impl<'a> RingLock<'a> {
    fn take(d: &'a Demote) -> RingLock<'a> {
        let me = crate::pid::get();
        let mut spins = 0u32;
        loop {
            match d.lock.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return RingLock(d),
                Err(holder) => {
                    spins += 1;
                    // A holder that died with it (killed mid-copy) leaves it
                    // (gone: `ESRCH` only; `EPERM` is a live process).
                    if spins.is_multiple_of(4096) && !crate::owner::exists(holder) {
                        let _ = d.lock.compare_exchange(holder, 0, Ordering::AcqRel, Ordering::Acquire);
                    }
                    if spins > 64 {
                        std::thread::sleep(Duration::from_micros(20));
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
    }
}

impl Drop for RingLock<'_> {
    fn drop(&mut self) {
        self.0.lock.store(0, Ordering::Release);
    }
}

/// The longest a demotion waits for the peer: `VRDMA_SOCKETS_WAIT_MS`.
pub(crate) fn wait_ms() -> Duration {
    let ms = std::env::var("VRDMA_SOCKETS_WAIT_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(5000);
    Duration::from_millis(ms)
}

/// Whether a `shutdown(SHUT_WR)` leaves the ring alone: this end's marker
/// went (or its demotion failed), or its writes switched at the peer's
/// demotion. A demotion that only began (`D_DEMOTING`) is not: while the
/// shutting thread holds the send lock the driver has not sent its count
/// and marker, so the shut goes first and the driver sends no marker.
pub(crate) fn shut_goes_to_the_kernel(d_state: u32, p_wr: bool) -> bool {
    d_state >= D_DEMOTED || p_wr
}

impl Link {
    fn demote_words(&self) -> Option<&Demote> {
        self.page.demote()
    }

    /// This end's demotion state (D's side; [`crate::owner::D_NONE`] where
    /// there is none).
    pub(crate) fn d_state(&self) -> u32 {
        self.demote_words().map_or(0, |d| d.state.load(Ordering::Acquire))
    }

    /// Whether the holders at this end read and write as demoted (this end's
    /// marker is sent, or the demotion failed).
    pub(crate) fn d_demoted(&self) -> bool {
        self.d_state() >= D_DEMOTED
    }

    /// `shutdown(SHUT_WR)` in a demotion: nothing over the ring (the
    /// kernel's FIN follows every byte written to the kernel socket).
    /// Whether it was so.
    pub(crate) fn shut_demoted(&self) -> bool {
        shut_goes_to_the_kernel(self.d_state(), self.p_wr.load(Ordering::Acquire))
    }

    /// For another holder (after fork) that would ask for a demotion:
    /// whether it may (the peer answers demotions, the page is shared).
    /// Touches no lock: a forked copy's may be held for ever.
    pub(crate) fn may_ask(&self) -> bool {
        self.peer_demotes && self.demote_words().is_some()
    }

    /// Whether a demotion of this end may be asked for: the page is
    /// shared, the peer answers demotions, and no direct placement
    /// mapping lives (it cannot move to the kernel socket).
    pub(crate) fn can_demote(&self) -> bool {
        self.peer_demotes
            && self.demote_words().is_some()
            && !lock(&self.iomaps).has_maps()
            && !lock(&self.post).failed
    }

    /// The driver's part (D): stops the ring writes, waits until they
    /// landed, tells the peer their count (its `DEMOTE` word, then the
    /// marker and record on the socket) and lets every holder go on as
    /// demoted. Only in the driving process, once, after the state went
    /// to [`D_DEMOTING`]. Whether it worked (else the state is
    /// [`D_FAILED`]: every call fails).
    pub(crate) fn demote_as_driver(&self) -> bool {
        self.demote_as_driver_on(self.sock, None)
    }

    /// [`Self::demote_as_driver`], the socket's bytes through `sock` (a
    /// descriptor of the same socket: before an exec, the program's, which
    /// a `vfork` child keeps where it closed the library's). `exec_rd`: an
    /// exec demotion, this end's ring read up to it (the peer sends the
    /// rest again: its `DEMOTE_RD` word, then the `DEMOTE` word with
    /// [`EXEC_BIT`]).
    fn demote_as_driver_on(&self, sock: c_int, exec_rd: Option<u64>) -> bool {
        let Some(d) = self.demote_words() else { return false };
        let r = (|| -> Res<()> {
            crate::pause::at(crate::pause::Point::DemoteLock);
            // Writers waiting for credits leave their waits (`credits`
            // looks at the state); the rest finish their write first.
            let tx = self.tx.lock();
            let w = tx.wr;
            // An exec's resend this end still queues goes before anything
            // else (the holders write to the kernel socket from now on).
            self.flush_out_guessing(sock)?;
            // This end answered the peer's own demotion already (both
            // ends forked): its marker is sent, and only one may be. A
            // peer that closed writes no more (its last byte landed
            // before its `CLOSED` word): its ring is read, then its end.
            if !self.p_wr.load(Ordering::Acquire) && !self.peer_closed() {
                let told = (|| -> Res<()> {
                    self.flush()?;
                    let mut word = w + 1;
                    if let Some(rd) = exec_rd {
                        let _ = self.stage.write_u64(S_DEMOTE_RD, rd);
                        self.write_word(S_DEMOTE_RD, 8, DEMOTE_RD)?;
                        word |= EXEC_BIT;
                    }
                    let _ = self.stage.write_u64(S_DEMOTE, word);
                    self.write_word(S_DEMOTE, 8, DEMOTE)?;
                    // A peer writer waiting for credits wakes and sees the word.
                    self.answer_want(&mut lock(&self.post));
                    let _ = self.flush_sends();
                    // Shut for writing: its FIN is on the socket already, and
                    // the peer reads its ring up to the count, then the end.
                    if !tx.shut {
                        crate::stream::send_all(sock, &mark(w))?;
                    }
                    Ok(())
                })();
                // A peer that closed meanwhile (its `CLOSED` word landed
                // after the look above) fails the writes: as if it had
                // closed before (its ring is read, then its end).
                if let Err(e) = told {
                    if !self.peer_closed() {
                        return Err(e);
                    }
                }
            }
            // No wake byte goes any more: the program's socket options
            // go back into the kernel (its marker went out at once).
            crate::kept::give_back_page(&self.page, sock);
            // Every ring read of this process is done under the lock from
            // here (`read`), and their count is the shared one.
            let _g = RingLock::take(d);
            // Its marker taken as well: plain TCP.
            let state = if self.p_rd.load(Ordering::Acquire) { D_DONE } else { D_DEMOTED };
            d.state.store(state, Ordering::Release);
            drop(tx);
            crate::dev::debug(&format!("demoted after {w} bytes written over vRDMA"));
            Ok(())
        })();
        if let Err(e) = r {
            crate::dev::debug(&format!("the demotion failed: errno {e}"));
            d.state.store(D_FAILED, Ordering::Release);
            return false;
        }
        self.unblock();
        crate::credit::came();
        true
    }

    /// Before an exec whose program inherits this connection (this
    /// process drives it, `crate::exec`): demotes it as the driver and
    /// waits, until `end` at most, for the peer's marker, which is taken
    /// off, so that the kernel socket holds exactly the stream that
    /// follows (the peer's bytes after its marker; no wake byte, no
    /// marker). `sock`: the program's descriptor of the socket (a `vfork`
    /// child may have closed the library's). Only while the ring holds no byte the program has not
    /// read: those could not reach the exec'd program (its address space
    /// goes, and a TCP receive queue takes nothing back), so such a
    /// connection is not demoted at all. `Err`: why not, and whether the
    /// demotion was made anyway and the peer's bytes landed in the ring
    /// meanwhile (lost with the exec: the caller resets the socket).
    pub(crate) fn demote_for_exec(
        &self,
        sock: c_int,
        end: Instant,
        resend: bool,
    ) -> Result<(), (&'static str, bool)> {
        let Some(d) = self.demote_words() else { return Err(("no shared page", false)) };
        // The peer sends the ring's bytes past the read count again.
        let exec = resend && self.peer_exec;
        let exec_rd: Option<u64>;
        if !self.can_demote() {
            return Err(("the peer does not answer demotions, or the connection is mapped or failed", false));
        }
        if self.in_demotion() || self.peer_demoted().is_some() {
            return Err(("a demotion is under way", false));
        }
        {
            // A thread of this process that reads it holds the receive
            // lock (and takes its bytes): not demoted under it.
            let mut rx = None;
            for _ in 0..20 {
                if let Ok(g) = self.rx.try_lock() {
                    rx = Some(g);
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            let Some(rx) = rx else { return Err(("another thread reads it", false)) };
            // (A peer that shut its write side, its end read here, is
            // demoted too: it sends no marker, and the loop below finds
            // its end on the socket with the ring empty. Its reads of
            // the answer switch at this end's marker.)
            if !exec && self.waiting(rx.rd) > 0 {
                return Err(("the ring holds bytes the program has not read", false));
            }
            self.share_rd(rx.rd);
            exec_rd = exec.then_some(rx.rd);
            if d.state.compare_exchange(D_NONE, D_DEMOTING, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return Err(("a demotion is under way", false));
            }
        }
        if !self.demote_as_driver_on(sock, exec_rd) {
            return Err(("the demotion failed", true));
        }
        loop {
            let part = {
                let _g = RingLock::take(d);
                match d.state.load(Ordering::Acquire) {
                    D_DONE => return Ok(()),
                    D_FAILED => return Err(("the demotion failed", true)),
                    _ => {}
                }
                let rd = d.rd.load(Ordering::Acquire);
                if !exec && self.waiting(rd) > 0 {
                    return Err(("the peer's bytes landed in the ring before its switch", true));
                }
                let h = match head(sock) {
                    Ok(h) => h,
                    Err(_) => return Err(("the kernel socket failed", true)),
                };
                let written = self.ring.read_u64(super::WRITTEN).unwrap_or(rd);
                let late = self.waiting(rd) > 0;
                match h {
                    // The peer's count is this end's read count: what its
                    // ring holds past it follows on the socket.
                    Head::Mark(w) if exec && w == rd => {
                        take_mark(sock);
                        d.state.store(D_DONE, Ordering::Release);
                        self.page.set_tcp();
                        crate::dev::debug(&format!(
                            "the peer's marker at {w} bytes, {} sent again after it: plain TCP for the exec",
                            written.saturating_sub(rd)
                        ));
                        return Ok(());
                    }
                    Head::Mark(_) if exec => {
                        d.state.store(D_FAILED, Ordering::Release);
                        return Err(("the peer's marker is not at this end's read count", true));
                    }
                    Head::Mark(w) => match at_mark(w, rd, written, late) {
                        AtMark::Take => {
                            take_mark(sock);
                            d.state.store(D_DONE, Ordering::Release);
                            self.page.set_tcp();
                            crate::dev::debug(&format!(
                                "the peer's marker after {w} bytes: plain TCP for the exec"
                            ));
                            return Ok(());
                        }
                        AtMark::Ring => {
                            return Err(("the peer's bytes landed in the ring before its switch", true))
                        }
                        AtMark::Wait => false,
                        AtMark::Bad => {
                            d.state.store(D_FAILED, Ordering::Release);
                            return Err(("the peer's marker is wrong", true));
                        }
                    },
                    Head::Bad => {
                        d.state.store(D_FAILED, Ordering::Release);
                        return Err(("the peer's marker is wrong", true));
                    }
                    // The peer's end and nothing in the ring: the exec'd
                    // program reads the end (plain TCP from here).
                    Head::End if !late => {
                        d.state.store(D_DONE, Ordering::Release);
                        self.page.set_tcp();
                        return Ok(());
                    }
                    Head::End => return Err(("the peer's bytes landed in the ring before its end", true)),
                    Head::Part => true,
                    Head::Nothing => false,
                }
            };
            let now = Instant::now();
            if now >= end {
                // (Its bytes that land later are not read, as before: it
                // sees the end.) Bytes the program has not read (an
                // exec's demotion takes a ring that holds some) are lost
                // with the exec: a reset, not a clean end.
                let unread = exec && self.waiting(d.rd.load(Ordering::Acquire)) > 0;
                return Err(("the peer did not answer the demotion in time", unread));
            }
            wait_more(sock, part, (end - now).min(Duration::from_millis(10)));
        }
    }

    /// For the driver's close of a demoted connection: waits (a while at
    /// most) until the peer stopped writing into the ring (its marker, its
    /// end, or its close), so that its QP may go.
    pub(crate) fn await_peer_switch(&self) {
        let end = Instant::now() + wait_ms();
        let Some(d) = self.demote_words() else { return };
        while Instant::now() < end {
            let part = {
                // (Under the lock: another holder may take the marker
                // off, after which the socket holds data.)
                let _g = RingLock::take(d);
                if self.d_state() != D_DEMOTED || self.peer_closed() {
                    return;
                }
                // (Wake bytes are taken off: they are no holder's data.)
                match head(self.sock) {
                    Ok(Head::Nothing) => false,
                    Ok(Head::Part) => true,
                    _ => return,
                }
            };
            wait_more(self.sock, part, Duration::from_millis(10));
        }
        crate::dev::debug("the peer did not answer the demotion before this close");
    }

    /// The close of this process's copy in a demotion (either side): the
    /// peer's marker is taken off when every ring byte before it is read,
    /// with the wake bytes before it, so that the kernel's last close
    /// sends FIN, not RST (a marker left unread is unread data to the
    /// kernel). Ring bytes left unread leave it: a reset, as TCP's close
    /// with unread data.
    pub(crate) fn close_in_demotion(&self) {
        // An exec's resend still queued goes first (`outq`): what comes in
        // meanwhile is dropped, as nobody reads it any more. Within
        // `VRDMA_SOCKETS_WAIT_MS` (a close does not block without bound):
        // what is left then resets the connection, never a short stream.
        self.flush_out_or_reset(Instant::now() + wait_ms(), "a close", true);
        if self.d_state() != crate::owner::D_NONE {
            // D (the driver's copy): once the peer stopped writing.
            self.await_peer_switch();
            self.d_take_mark_at_close();
        }
        self.p_take_mark_at_close();
    }

    /// At D, at a close: the peer's marker is taken off if the shared
    /// read count reached it (as a read would: plain TCP for the holders
    /// left). Any holder's copy may call it (no per-process lock).
    pub(crate) fn d_take_mark_at_close(&self) {
        let Some(d) = self.demote_words() else { return };
        let _g = RingLock::take(d);
        if d.state.load(Ordering::Acquire) != D_DEMOTED {
            return;
        }
        let rd = d.rd.load(Ordering::Acquire);
        if let Ok(Head::Mark(w)) = head(self.sock) {
            if w == rd && self.waiting(rd) == 0 {
                take_mark(self.sock);
                d.state.store(D_DONE, Ordering::Release);
                self.page.set_tcp();
                crate::dev::debug(&format!("the peer's marker after {w} bytes taken at a close"));
            }
        }
    }

    /// At P (the demoting end's peer), at a close once its `DEMOTE` word
    /// came, reads not switched yet: waits a while (the marker follows
    /// the word at once) for the demoting end's marker and takes it off
    /// if this end read the ring up to its count. A reader thread of this
    /// process that holds the receive lock is left to it.
    pub(crate) fn p_take_mark_at_close(&self) {
        let Some(w) = self.peer_demoted() else { return };
        // Both ends forked: this end's own demoted reads take it
        // (`d_take_mark_at_close`).
        if self.p_reads_switched() || self.d_state() != crate::owner::D_NONE {
            return;
        }
        let Ok(rx) = self.rx.try_lock() else { return };
        if rx.rd != w {
            return;
        }
        let end = Instant::now() + wait_ms().min(Duration::from_secs(1));
        loop {
            let g = self.demote_words().map(RingLock::take);
            if self.d_state() != crate::owner::D_NONE {
                return;
            }
            match head(self.sock) {
                Ok(Head::Mark(c)) if c == w => {
                    take_mark(self.sock);
                    self.p_rd.store(true, Ordering::SeqCst);
                    drop(g);
                    self.p_done();
                    crate::dev::debug(&format!("the peer's marker after {c} bytes taken at a close"));
                    return;
                }
                Ok(h @ (Head::Nothing | Head::Part)) if Instant::now() < end => {
                    drop(g);
                    wait_more(self.sock, matches!(h, Head::Part), Duration::from_millis(10));
                }
                _ => return,
            }
        }
    }

    /// A read at a demoted end (D, any holder): the ring up to the peer's
    /// marker, then the kernel socket.
    pub(crate) fn read_demoted(
        &self,
        iov: &[(*mut u8, usize)],
        cap: usize,
        done: usize,
        nonblocking: bool,
        peek: bool,
        all: bool,
    ) -> Res<usize> {
        let Some(d) = self.demote_words() else { return Err(libc::ECONNRESET) };
        let mut done = done;
        loop {
            let g = RingLock::take(d);
            match d.state.load(Ordering::Acquire) {
                D_DONE => {
                    drop(g);
                    if done > 0 && (!all || nonblocking) {
                        return Ok(done);
                    }
                    // Bytes this call took off the ring are the program's
                    // whatever the kernel then says (as a partial read).
                    return match self.read_kernel(iov, done, nonblocking, peek, all) {
                        Ok(n) => Ok(n + done),
                        Err(_) if done > 0 => Ok(done),
                        Err(e) => Err(e),
                    };
                }
                D_FAILED => return if done > 0 { Ok(done) } else { Err(libc::ECONNRESET) },
                _ => {}
            }
            let rd = d.rd.load(Ordering::Acquire);
            let avail = self.waiting(rd);
            if avail > 0 {
                let n = avail.min(cap - done);
                self.copy_out(rd, n, iov, done);
                if peek {
                    return Ok(n);
                }
                d.rd.store(rd + n as u64, Ordering::Release);
                done += n;
                if !all || done == cap {
                    return Ok(done);
                }
                continue;
            }
            // (The ring was looked at before the socket: the peer's last
            // ring bytes may have landed in between, then its marker or
            // end came. Looked at again before either is believed.)
            crate::pause::at(crate::pause::Point::RingThenSocket);
            let h = match head(self.sock) {
                Ok(h) => h,
                Err(_) if done > 0 => return Ok(done),
                Err(e) => return Err(e),
            };
            let part = matches!(h, Head::Part);
            let written = self.ring.read_u64(super::WRITTEN).unwrap_or(rd);
            let late = self.waiting(rd) > 0;
            match h {
                Head::Mark(w) => match at_mark(w, rd, written, late) {
                    AtMark::Take => {
                        take_mark(self.sock);
                        d.state.store(D_DONE, Ordering::Release);
                        self.page.set_tcp();
                        crate::dev::debug(&format!("the peer's marker after {w} bytes: plain TCP"));
                        continue;
                    }
                    AtMark::Ring => continue,
                    AtMark::Wait => {}
                    AtMark::Bad => {
                        d.state.store(D_FAILED, Ordering::Release);
                        return if done > 0 { Ok(done) } else { Err(libc::ECONNRESET) };
                    }
                },
                Head::Bad => {
                    d.state.store(D_FAILED, Ordering::Release);
                    return if done > 0 { Ok(done) } else { Err(libc::ECONNRESET) };
                }
                // The peer's last ring bytes first, then its end.
                Head::End if late => continue,
                Head::End => return Ok(done),
                Head::Nothing | Head::Part => {}
            }
            drop(g);
            if done > 0 && (nonblocking || !all) {
                return Ok(done);
            }
            if nonblocking {
                return Err(libc::EAGAIN);
            }
            // The peer's ring bytes that land before it stops send no
            // wake byte (nobody armed): looked at again in a while.
            wait_more(self.sock, part, Duration::from_millis(10));
        }
    }

    /// Reads the kernel socket into `iov` from byte `skip`, as the program's
    /// call would.
    pub(crate) fn read_kernel(
        &self,
        iov: &[(*mut u8, usize)],
        skip: usize,
        nonblocking: bool,
        peek: bool,
        all: bool,
    ) -> Res<usize> {
        // The queue cut short and the socket not disconnected: reset, for
        // the program, for good (`Link::take_out_err`).
        if self.out_stuck() {
            return Err(libc::ECONNRESET);
        }
        let mut v = Vec::with_capacity(iov.len());
        let mut skip = skip;
        for &(p, n) in iov {
            if skip >= n {
                skip -= n;
                continue;
            }
            // SAFETY: `p + skip .. p + n` is in the caller's buffer.
            v.push(libc::iovec { iov_base: unsafe { p.add(skip) }.cast(), iov_len: n - skip });
            skip = 0;
        }
        if v.is_empty() {
            return Ok(0);
        }
        let mut flags = 0;
        if nonblocking {
            flags |= libc::MSG_DONTWAIT;
        }
        if peek {
            flags |= libc::MSG_PEEK;
        }
        if all {
            flags |= libc::MSG_WAITALL;
        }
        // SAFETY: a zeroed msghdr is valid; its vector points to `v`.
        let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = v.as_mut_ptr();
        m.msg_iovlen = v.len() as _;
        // A push of an exec's queue failed (`outq`): the bytes that came
        // before the error are read, then the error (as TCP's own). An
        // error the kernel still has is that one; an `EPIPE` of the push
        // (the reset's error taken by an earlier call) is no read's.
        if self.out_err.load(Ordering::SeqCst) != 0 {
            // SAFETY: `m` describes the caller's buffers.
            let r = unsafe { real::recvmsg(self.sock, &mut m, flags | libc::MSG_DONTWAIT) };
            if r > 0 {
                return Ok(r as usize);
            }
            let now = if r < 0 { crate::table::errno() } else { 0 };
            match self.take_out_err() {
                _ if now != 0 && now != libc::EAGAIN && now != libc::EINTR => return Err(now),
                Some(e) if e != libc::EPIPE => return Err(e),
                _ => {}
            }
        }
        loop {
            // SAFETY: `m` describes the caller's buffers.
            let r = unsafe { real::recvmsg(self.sock, &mut m, flags) };
            if r == 0 {
                // Woken by the end while a push of the queue met the
                // reset (its send took the socket's error): the error,
                // never a clean end after lost bytes.
                if let Some(e) = self.out_err_at_end() {
                    return Err(e);
                }
            }
            if r >= 0 {
                return Ok(r as usize);
            }
            match crate::table::errno() {
                libc::EINTR => continue,
                e => return Err(e),
            }
        }
    }

    /// Writes `iov` to the kernel socket, as the program's call would.
    pub(crate) fn write_kernel(&self, iov: &[(*const u8, usize)], nonblocking: bool) -> Res<usize> {
        // A push of an exec's queue failed: its errno first (`outq`).
        if let Some(e) = self.take_out_err() {
            return Err(e);
        }
        let mut v: Vec<libc::iovec> =
            iov.iter().map(|&(p, n)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: n }).collect();
        // SAFETY: a zeroed msghdr is valid; its vector points to `v`.
        let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
        m.msg_iov = v.as_mut_ptr();
        m.msg_iovlen = v.len() as _;
        let flags = libc::MSG_NOSIGNAL | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
        loop {
            // SAFETY: `m` describes the caller's buffers.
            let r = unsafe { real::sendmsg(self.sock, &m, flags) };
            if r >= 0 {
                return Ok(r as usize);
            }
            match crate::table::errno() {
                libc::EINTR => continue,
                e => return Err(e),
            }
        }
    }

    /// A write at a demoted end (D): waits while the driver demotes it,
    /// then to the kernel socket. `None`: not demoted, the ring's.
    pub(crate) fn write_demoted(&self, iov: &[(*const u8, usize)], nonblocking: bool) -> Option<Res<usize>> {
        let d = self.demote_words()?;
        loop {
            match d.state.load(Ordering::Acquire) {
                D_DEMOTING => std::thread::sleep(Duration::from_micros(200)),
                D_DEMOTED | D_DONE => return Some(self.write_kernel(iov, nonblocking)),
                D_FAILED => return Some(Err(libc::ECONNRESET)),
                _ => return None,
            }
        }
    }

    /// Whether ring bytes wait beyond the shared read count (readiness of a
    /// connection in a demotion, which no wake byte announces).
    pub(crate) fn demoted_bytes(&self) -> bool {
        self.demoted_waiting() > 0
    }

    /// How many ring bytes wait beyond the shared read count.
    pub(crate) fn demoted_waiting(&self) -> usize {
        let rd = self.demote_words().map_or(u64::MAX, |d| d.rd.load(Ordering::Acquire));
        self.waiting(rd)
    }

    /// The process whose context made the link (its QP and regions).
    pub(crate) fn maker(&self) -> u32 {
        self.pid
    }

    /// As the peer: the count the demoting end wrote into this end's ring
    /// (its `DEMOTE` word), if it demoted.
    pub(crate) fn peer_demoted(&self) -> Option<u64> {
        let w = self.ring.read_u64(DEMOTE).unwrap_or(0) & !EXEC_BIT;
        (w != 0).then(|| w - 1)
    }

    /// As the peer: the demoting end's read count, if it demotes for an
    /// exec (its `DEMOTE` word has [`EXEC_BIT`]): this end's ring bytes
    /// past it are sent again on the kernel socket.
    fn peer_exec_rd(&self) -> Option<u64> {
        let w = self.ring.read_u64(DEMOTE).unwrap_or(0);
        (w & EXEC_BIT != 0).then(|| self.ring.read_u64(DEMOTE_RD).unwrap_or(u64::MAX))
    }

    /// As the peer of an exec demotion, the send lock held, every write
    /// landed: the marker with the demoting end's read count `rd`, then
    /// the bytes this end wrote into its ring past it (`rd..wr`), read
    /// back from that ring by an RDMA read, on the kernel socket. Nothing
    /// of them was read there: the exec'd program reads them from the
    /// socket.
    fn p_resend_for_exec(&self, rd: u64, wr: u64) -> Res<()> {
        let n = wr.checked_sub(rd).filter(|&n| n as usize <= RING).ok_or(libc::ECONNRESET)? as usize;
        let mut out = Vec::with_capacity(MARK_LEN + n);
        out.extend_from_slice(&mark(rd));
        if n > 0 {
            let off = (rd % RING as u64) as usize;
            let first = n.min(RING - off);
            let mut wrs = Vec::with_capacity(2);
            for (at, from, len) in [(0, off, first), (first, 0, n - first)] {
                if len == 0 {
                    continue;
                }
                let sge = self.stage.sge(at, len).map_err(|e| e.errno())?;
                let w = wr::rdma_read(0, &[sge], self.peer_addr + from as u64, self.peer_rkey)
                    .map_err(|e| e.errno())?
                    .signaled();
                wrs.push(w);
            }
            let id = self.post(&mut wrs, None)?;
            self.wait_until(|p| p.done >= id)?;
            let mut b = vec![0u8; n];
            self.stage.read(0, &mut b).map_err(|e| e.errno())?;
            out.extend_from_slice(&b);
        }
        if crate::pause::fails(crate::pause::Point::ResendFails) {
            crate::stream::send_all(self.sock, &out[..out.len() / 2])?;
            return Err(libc::ETIMEDOUT);
        }
        // Held by this process alone: what the kernel takes now goes, the
        // rest is queued (`outq`) and this call returns, so that this
        // end's reads go on: a program there that writes before it reads
        // is read, and gets to read these bytes. Nothing is guessed.
        if self.demote_words().is_none_or(|d| !d.held_elsewhere()) {
            let mut q = super::outq::OutQ::new(out, 0);
            let left = match q.push(|b| super::outq::send_now(self.sock, b))? {
                super::outq::Pushed::Empty => 0,
                super::outq::Pushed::Full(left) => left,
            };
            if left > 0 {
                self.queue_out(q);
            }
            crate::dev::debug(&format!(
                "the peer demoted for an exec at {rd}: {n} bytes sent again after the marker, {left} of them queued"
            ));
            return Ok(());
        }
        // Held by other processes too (after a fork): their writes go
        // straight to the kernel socket, so nothing may wait behind a
        // queue of this process. Synchronous, with no time limit: the
        // exec'd program may take its time before it reads, and a resend
        // cut short is final (a reset). Only a deadlock with a program that
        // writes before it reads ends it (the guess).
        if let Err(e) = crate::stream::send_all_while_alive(self.sock, &out) {
            if e == libc::EDEADLK {
                static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                crate::dev::warn_once(
                    &SAID,
                    "the exec'd program at the other end writes without reading while this resend waits \
                     for it to read (both would wait for ever): the connection is reset",
                );
            }
            return Err(e);
        }
        crate::dev::debug(&format!(
            "the peer demoted for an exec at {rd}: {n} bytes sent again after the marker"
        ));
        Ok(())
    }

    /// Whether a demoting peer's marker is at the head of the socket
    /// (after wake bytes, which are not taken off here).
    pub(crate) fn zero_at_head(&self) -> bool {
        if self.peer_demoted().is_none() {
            return false;
        }
        let mut b = [0u8; 64];
        // SAFETY: `b` is valid for its length; a peek takes nothing.
        let r = unsafe {
            real::recv(self.sock, b.as_mut_ptr().cast(), b.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        r > 0 && b[..r as usize].contains(&0)
    }

    /// As the peer (P), the send lock held: this end's writes go to the
    /// kernel socket from now on, after its ring writes landed and its
    /// marker and record (their count) were sent.
    pub(super) fn p_switch_writes(&self, tx: &mut Tx) -> Res<()> {
        if self.p_wr.load(Ordering::Acquire) {
            return Ok(());
        }
        // A switch that began and failed left part of its bytes on the
        // socket: another try would send a second marker and the bytes
        // again. Final.
        if self.p_wr_began.load(Ordering::Acquire) {
            return Err(libc::ECONNRESET);
        }
        self.flush()?;
        // This end demoted itself too (both ends forked): its marker went
        // then (under the send lock, as this), and only one may. (A
        // driver that took the request but not the lock yet sends none:
        // it finds this end's writes switched.)
        if !tx.shut && self.d_state() < D_DEMOTED {
            // Before any byte goes out.
            self.p_wr_began.store(true, Ordering::Release);
            let sent = match self.peer_exec_rd() {
                Some(rd) => self.p_resend_for_exec(rd, tx.wr),
                None => crate::stream::send_all(self.sock, &mark(tx.wr)),
            };
            if let Err(e) = sent {
                self.reset_after_partial_switch(e);
                return Err(libc::ECONNRESET);
            }
        }
        self.p_wr.store(true, Ordering::SeqCst);
        // No wake byte goes any more: the program's socket options go
        // back into the kernel (the marker went out at once).
        crate::kept::give_back_page(&self.page, self.sock);
        crate::dev::debug(&format!("the peer demoted: writing to the kernel socket after {} bytes", tx.wr));
        // (Not while an exec's resend is queued: `EPOLLOUT` stays out
        // until it is sent, `outq`.)
        if !self.out_queued() {
            self.unblock();
        }
        self.p_done();
        Ok(())
    }

    /// As the peer (P), no lock held: [`Self::p_switch_writes`] under the
    /// send lock.
    pub(super) fn p_switch_writes_now(&self) -> Res<()> {
        let mut tx = self.tx.lock();
        self.p_switch_writes(&mut tx)
    }

    /// As the peer: whether this end's writes switched.
    pub(super) fn p_writes_switched(&self) -> bool {
        self.p_wr.load(Ordering::Acquire)
    }

    /// The switch of this end's writes failed after it began sending
    /// (`e`): the other end may hold part of the marker or of an exec's
    /// resend, so the kernel connection is reset (a `connect` to
    /// `AF_UNSPEC` disconnects a TCP socket with a reset), not ended: the
    /// program there reads an error, never a short stream.
    fn reset_after_partial_switch(&self, e: c_int) {
        static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        crate::dev::warn_once(
            &SAID,
            &format!("the switch of a demoted connection to plain TCP failed midway (errno {e}): the connection is reset"),
        );
        Self::reset_sock(self.sock);
    }

    /// Resets the kernel connection of `sock` (a `connect` to
    /// `AF_UNSPEC`; failing that, a linger of 0, so that its last close
    /// is a reset): the program there reads an error, never a short
    /// stream. Whether it disconnected it now (not: the fallback).
    pub(super) fn reset_sock(sock: c_int) -> bool {
        if crate::pause::fails(crate::pause::Point::ResetFallsBack) {
            return Self::linger_zero(sock);
        }
        // SAFETY: a zeroed sockaddr with family AF_UNSPEC, its size.
        let r = unsafe {
            let mut a: libc::sockaddr = std::mem::zeroed();
            a.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
            real::connect(sock, &a, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t)
        };
        if r == 0 {
            return true;
        }
        // Not disconnected (an older kernel, a socket state that refuses
        // it, a ULP such as kTLS): a linger of 0 makes the last close a
        // reset, not a FIN that would read as a clean, short stream (no
        // shutdown: that sends one). The caller makes this end's later
        // calls fail, so nothing more goes out behind the hole.
        crate::dev::debug(&format!(
            "the reset by a connect to AF_UNSPEC failed (errno {}): linger 0, reset at the close",
            crate::table::errno()
        ));
        Self::linger_zero(sock)
    }

    /// [`Self::reset_sock`]'s fallback: a linger of 0 on `sock` (false).
    fn linger_zero(sock: c_int) -> bool {
        let lg = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: setsockopt(2) with a linger of ours, its size.
        let r = unsafe {
            real::setsockopt(
                sock,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&lg as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        if r != 0 {
            static SAID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            crate::dev::warn_once(
                &SAID,
                &format!(
                    "the reset's fallback (SO_LINGER 0) failed too (errno {}): the connection ends by a plain close",
                    crate::table::errno()
                ),
            );
        }
        false
    }

    /// As the peer (P), the receive lock held, the ring read up to the
    /// demoting end's count: its marker is taken off (the writes switched
    /// first): what the read does now.
    pub(super) fn p_switch_reads(&self, rx: &mut Rx, nonblocking: bool) -> Res<PSwitch> {
        // Another reader thread switched while this one waited for the
        // receive lock: the marker is taken, the socket holds data.
        if self.p_rd.load(Ordering::Acquire) {
            return Ok(PSwitch::Kernel);
        }
        {
            let mut tx = self.tx.lock();
            self.p_switch_writes(&mut tx)?;
        }
        let w = self.peer_demoted().unwrap_or(u64::MAX);
        loop {
            // Both ends forked: a holder of this end in another process
            // (a demoted read) may take the same marker; the lock between
            // the processes serializes them, and once this end is demoted
            // its reads go the demoted way (the shared count).
            let g = self.demote_words().map(RingLock::take);
            if self.d_demoted() {
                return Ok(PSwitch::Demoted);
            }
            if self.p_rd.load(Ordering::Acquire) {
                return Ok(PSwitch::Kernel);
            }
            match head(self.sock)? {
                Head::Mark(c) if c == w && c == rx.rd => {
                    take_mark(self.sock);
                    self.p_rd.store(true, Ordering::SeqCst);
                    drop(g);
                    crate::dev::debug(&format!(
                        "the peer's marker after {c} bytes: reading the kernel socket"
                    ));
                    self.p_done();
                    return Ok(PSwitch::Kernel);
                }
                Head::Mark(_) | Head::Bad => return Err(libc::ECONNRESET),
                Head::End => {
                    rx.eof = true;
                    return Ok(PSwitch::End);
                }
                Head::Nothing | Head::Part if nonblocking => return Err(libc::EAGAIN),
                h @ (Head::Nothing | Head::Part) => {
                    drop(g);
                    wait_more(self.sock, matches!(h, Head::Part), Duration::from_millis(100));
                }
            }
        }
    }

    /// As the peer: both ways switched: plain TCP for this end's holders.
    pub(super) fn p_done(&self) {
        // (Not while an exec's resend is queued: the holders' calls must
        // still come here, behind it.)
        // (SeqCst: the queue's emptying stores its count, then looks at
        // `p_rd`; the read's switch stores `p_rd`, then looks at the
        // count: one of them sees the other's store.) Nor after the queue
        // failed: its errno is the program's first (`Link::take_out_err`),
        // or the connection was reset.
        if self.p_wr.load(Ordering::SeqCst)
            && self.p_rd.load(Ordering::SeqCst)
            && self.out_len.load(Ordering::SeqCst) == 0
            && self.out_err.load(Ordering::SeqCst) == 0
            && !self.out_reset.load(Ordering::SeqCst)
        {
            self.page.set_tcp();
        }
    }

    /// Whether this end's part of a demotion (either side) is over or
    /// under way: its link must not end the stream over the ring at a
    /// close.
    pub(crate) fn in_demotion(&self) -> bool {
        self.d_state() != 0 || self.p_wr.load(Ordering::Acquire) || self.p_rd.load(Ordering::Acquire)
    }

    /// As the peer, in a read whose ring is empty: whether the demoting
    /// end's bytes are all read (its count reached), so the read switches.
    pub(crate) fn p_at_mark(&self, rd: u64) -> bool {
        self.peer_demoted().is_some_and(|w| rd >= w) || self.p_rd.load(Ordering::Acquire)
    }

    /// As the peer: whether the reads switched to the kernel socket.
    pub(crate) fn p_reads_switched(&self) -> bool {
        self.p_rd.load(Ordering::Acquire)
    }

    /// As the peer: whether writes must switch (the demoting end's word
    /// came, or they did already).
    pub(crate) fn p_writes_switch(&self) -> bool {
        self.p_wr.load(Ordering::Acquire) || self.peer_demoted().is_some()
    }

    /// Runs `f` (a take-off of stale wake bytes by the driver's normal
    /// paths) under the ring's lock between processes, unless the
    /// connection is demoted (`None`): once another holder took the
    /// peer's marker off, the socket holds data, which no take-off of
    /// wake bytes may touch.
    pub(super) fn unless_demoted<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let Some(d) = self.demote_words() else { return Some(f()) };
        let _g = RingLock::take(d);
        if d.state.load(Ordering::Acquire) >= D_DEMOTED {
            return None;
        }
        Some(f())
    }

    /// The read count a demoting driver hands to the other holders:
    /// this process's ring reads move it under the lock.
    pub(crate) fn share_rd(&self, rd: u64) {
        if let Some(d) = self.demote_words() {
            d.rd.store(rd, Ordering::Release);
        }
    }

    /// Runs `f` (a ring read of the driving process) under the ring's lock
    /// between processes (uncontended but for a demotion: two atomic
    /// operations); `None` if the connection is demoted meanwhile (the
    /// read goes the demoted way). Always, not only once a fork shared
    /// the connection: a read that looked before the fork could still be
    /// copying when the driver demotes.
    pub(crate) fn locked_ring<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let Some(d) = self.demote_words() else { return Some(f()) };
        let _g = RingLock::take(d);
        if d.state.load(Ordering::Acquire) >= D_DEMOTED {
            return None;
        }
        Some(f())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_past_the_read_count_waits_for_the_ring_bytes_before_it() {
        // Read up to it: taken.
        assert_eq!(at_mark(100, 100, 100, false), AtMark::Take);
        // The peer's last ring bytes landed after the ring looked empty,
        // then its marker came: they are read, not a reset.
        assert_eq!(at_mark(150, 100, 150, true), AtMark::Ring);
        // Not visible yet: waited for.
        assert_eq!(at_mark(150, 100, 100, false), AtMark::Wait);
        // Behind the read count, or all landed yet none waits: an error.
        assert_eq!(at_mark(90, 100, 100, false), AtMark::Bad);
        assert_eq!(at_mark(150, 100, 150, false), AtMark::Bad);
    }

    #[test]
    fn a_marker_carries_its_count_and_nothing_else_is_one() {
        let m = mark(123_456_789);
        assert_eq!(m[0], 0);
        assert_eq!(parse_mark(&m), Some(123_456_789));
        let mut bad = m;
        bad[1] = 2;
        assert_eq!(parse_mark(&bad), None);
        bad = m;
        bad[0] = 7;
        assert_eq!(parse_mark(&bad), None);
    }
}
