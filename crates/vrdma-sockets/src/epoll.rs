//! The program's epoll registrations of its carried connections, so that
//! epoll reports a carried socket's writability as the ring has it, not
//! as the kernel socket has it (`docs/sockets.md`, "Writing").
//!
//! The kernel socket of a carried connection is nearly always writable:
//! the bytes go through the ring. A non-blocking write that finds the ring
//! full returns `EAGAIN`, and the program waits for `EPOLLOUT`. Left to
//! the kernel, a level-triggered registration would report it at once
//! (the program spins on `EAGAIN`), and an edge-triggered one never again
//! (no edge: the socket never stopped being writable), which stalls nginx
//! for its send timeout. So `epoll_ctl` is interposed for the connections
//! this library may carry, and each registration (set, descriptor) is
//! kept as the program asked (events, `data`): while the ring is full
//! ([`Link::write_blocked`]) the kernel's registration has `EPOLLOUT`
//! taken out (`EPOLL_CTL_MOD`: level-triggered waiters no longer see it),
//! and when credits come back (seen by the writer's next call, by a
//! readiness call before it waits, or by the progress thread: [`crate::progress`])
//! it is put back with the program's own events and data, a
//! modification after which the kernel looks at the socket again and,
//! finding it writable, reports `EPOLLOUT` anew, also edge-triggered.
//!
//! `EPOLLONESHOT`: a registration the kernel reported (seen by the
//! interposed `epoll_wait`s) is disabled until the program modifies it;
//! it is then neither stripped nor given back (a modification would arm
//! it again). Limits: a report that another thread's `epoll_wait` is
//! returning while the progress thread gives `EPOLLOUT` back can arm a
//! one-shot registration once more (a spurious report); registrations are
//! found from reported events by their `data`, so two registrations of
//! one set with the same `data` are not told apart (neither is filtered);
//! a registration made through a descriptor that is then closed while a
//! `dup` of it stays open is forgotten here, as the kernel keeps it.
//!
//! The interposed `epoll_wait`s also take back a carried socket's
//! readability that is only stale wake bytes, as `poll` does
//! ([`crate::readiness`]), and decide a connection registered before its
//! first call when its report may be the peer's first message (a hello:
//! the library's bytes, not the program's; [`report_or_undecided`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use libc::{c_int, epoll_event};

use crate::link::{Link, Look};
use crate::real;
use crate::stream::{Elsewhere, Stream};
use crate::table::{self, keep_errno, Entry, Guard};

const OUT: u32 = libc::EPOLLOUT as u32;
const IN: u32 = libc::EPOLLIN as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
const ET: u32 = libc::EPOLLET as u32;
/// A registration that may not be modified (the kernel refuses): left as
/// the program made it.
const EXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;

/// One registration of a connection this library may carry.
struct Reg {
    /// As the program asked.
    events: u32,
    data: u64,
    stream: Weak<Stream>,
    /// Its link, once carried (found on first need).
    link: Weak<Link>,
    /// One-shot and reported: the kernel disabled it.
    fired: bool,
    /// The kernel's registration lacks the `EPOLLOUT` the program asked.
    stripped: bool,
    /// Made while bytes waited in the link's ring that no wake byte
    /// announces (a lazy read left it unarmed): the epoll waits report
    /// `EPOLLIN` themselves until they are read ([`pending`]).
    pending: bool,
    /// Made for reading while its connection was not decided yet (no call
    /// on it): its first report may be the peer's hello
    /// ([`report_or_undecided`]).
    undecided: bool,
}

impl Reg {
    fn link(&mut self) -> Option<Arc<Link>> {
        if let Some(l) = self.link.upgrade() {
            return Some(l);
        }
        let l = self.stream.upgrade()?.link_now()?;
        self.link = Arc::downgrade(&l);
        Some(l)
    }

    fn is(&mut self, link: &Link) -> bool {
        self.link().is_some_and(|l| std::ptr::eq(Arc::as_ptr(&l), link))
    }

    /// Sets the kernel's registration of `fd` in `ep` to the program's
    /// events, less `EPOLLOUT` if `strip`.
    fn apply(&mut self, ep: c_int, fd: c_int, strip: bool) -> bool {
        let events = if strip { self.events & !OUT } else { self.events };
        let mut k = epoll_event { events, u64: self.data };
        // SAFETY: epoll_ctl(2) with a valid event; `ep` and `fd` are a
        // registration the program made and has not removed (closing
        // either forgets it here first, under the same lock).
        let ok = unsafe { real::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut k) } == 0;
        if ok {
            self.stripped = strip && self.events & OUT != 0;
        }
        ok
    }
}

/// How many registrations are kept, and how many of them have
/// [`Reg::pending`] and [`Reg::undecided`] set: kept up to date by every
/// change under the registrations' lock (a count over every registration
/// on each `epoll_ctl` cost a server with 10k connections a walk of them
/// all per call), and mirrored in [`TRACKED`] and [`PENDING`] for the
/// calls that pass without the lock.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
struct Counts {
    tracked: usize,
    pending: usize,
    undecided: usize,
}

impl Counts {
    fn of(r: &Reg) -> Counts {
        Counts { tracked: 1, pending: r.pending as usize, undecided: r.undecided as usize }
    }

    fn add(&mut self, c: Counts) {
        self.tracked += c.tracked;
        self.pending += c.pending;
        self.undecided += c.undecided;
    }

    fn sub(&mut self, c: Counts) {
        self.tracked -= c.tracked;
        self.pending -= c.pending;
        self.undecided -= c.undecided;
    }

    fn pending(n: usize) -> Counts {
        Counts { pending: n, ..Counts::default() }
    }

    fn undecided(n: usize) -> Counts {
        Counts { undecided: n, ..Counts::default() }
    }
}

#[derive(Default)]
struct Set {
    /// Inside another epoll set, or polled (`poll`, `select`): a wait on
    /// the outer one sleeps on this set without arming its connections,
    /// so none of them may leave its ring unarmed.
    nested: bool,
    regs: HashMap<c_int, Reg>,
    /// The descriptors registered with each `data`.
    by_data: HashMap<u64, Vec<c_int>>,
    /// Of `regs` (a wait on a set with no undecided registration looks
    /// at none of its events for them).
    counts: Counts,
}

impl Set {
    fn insert(&mut self, fd: c_int, r: Reg, total: &mut Counts) {
        self.remove(fd, total);
        let c = Counts::of(&r);
        self.counts.add(c);
        total.add(c);
        self.by_data.entry(r.data).or_default().push(fd);
        self.regs.insert(fd, r);
    }

    fn remove(&mut self, fd: c_int, total: &mut Counts) {
        if let Some(r) = self.regs.remove(&fd) {
            let c = Counts::of(&r);
            self.counts.sub(c);
            total.sub(c);
            if let Some(v) = self.by_data.get_mut(&r.data) {
                v.retain(|&x| x != fd);
                if v.is_empty() {
                    self.by_data.remove(&r.data);
                }
            }
        }
    }

    /// `c` (flags set or cleared in its registrations) less.
    fn less(&mut self, c: Counts, total: &mut Counts) {
        self.counts.sub(c);
        total.sub(c);
    }

    /// `c` more.
    fn more(&mut self, c: Counts, total: &mut Counts) {
        self.counts.add(c);
        total.add(c);
    }

    /// The one registration reported with `data`, if only one has it.
    fn by_data(&mut self, data: u64) -> Option<(c_int, &mut Reg)> {
        match self.by_data.get(&data).map(Vec::as_slice) {
            Some(&[fd]) => self.regs.get_mut(&fd).map(|r| (fd, r)),
            _ => None,
        }
    }

    fn recount(&self) -> Counts {
        let mut c = Counts::default();
        for r in self.regs.values() {
            c.add(Counts::of(r));
        }
        c
    }
}

struct Sets {
    sets: HashMap<c_int, Set>,
    /// Descriptors other than connections added to an epoll set: an
    /// epoll set among them is nested ([`Set::nested`]) once it holds
    /// connections.
    inner: std::collections::HashSet<c_int>,
    /// Of every set.
    counts: Counts,
}

impl Sets {
    fn new() -> Sets {
        Sets { sets: HashMap::new(), inner: Default::default(), counts: Counts::default() }
    }

    /// Keeps `r`, the registration of `fd` in `ep` (replacing one made
    /// before).
    fn add(&mut self, ep: c_int, fd: c_int, r: Reg, nested: bool) {
        let set = self.sets.entry(ep).or_default();
        set.nested |= nested;
        set.insert(fd, r, &mut self.counts);
    }

    /// Forgets the registration of `fd` in `ep`.
    fn remove(&mut self, ep: c_int, fd: c_int) {
        if let Some(set) = self.sets.get_mut(&ep) {
            set.remove(fd, &mut self.counts);
        }
    }

    /// `fd` is closed: its registrations go, and, if it is a set, the
    /// set's.
    fn forget(&mut self, fd: c_int) {
        self.inner.remove(&fd);
        if let Some(set) = self.sets.remove(&fd) {
            self.counts.sub(set.counts);
        }
        for set in self.sets.values_mut() {
            set.remove(fd, &mut self.counts);
        }
    }

    /// [`pending`] for `ep`, under the lock.
    fn take_pending(&mut self, ep: c_int) -> Vec<epoll_event> {
        let mut out = Vec::new();
        let Some(set) = self.sets.get_mut(&ep) else { return out };
        if set.counts.pending == 0 {
            return out;
        }
        let mut cleared = 0;
        for r in set.regs.values_mut().filter(|r| r.pending) {
            let waits = r.link().is_some_and(|l| l.unannounced_bytes());
            if !waits || r.events & (libc::EPOLLET as u32 | ONESHOT) != 0 {
                r.pending = false;
                cleared += 1;
            }
            if waits && !r.fired {
                out.push(epoll_event { events: IN, u64: r.data });
            }
        }
        set.less(Counts::pending(cleared), &mut self.counts);
        out
    }

    /// [`nest`], under the lock.
    fn nest(&mut self, ep: c_int) {
        let Some(set) = self.sets.get_mut(&ep) else { return };
        if set.nested {
            return;
        }
        set.nested = true;
        let mut marked = 0;
        for r in set.regs.values_mut() {
            if let Some(st) = r.stream.upgrade() {
                st.lazy(false);
            }
            if let Some(l) = r.link() {
                if l.is_unarmed() && l.lazy_look(true) == Look::Bytes {
                    marked += !r.pending as usize;
                    r.pending = true;
                }
            }
        }
        set.more(Counts::pending(marked), &mut self.counts);
    }

    /// The undecided registrations among the events `ev` reported on `ep`
    /// ([`report_or_undecided`]); those that need no look any more
    /// (decided, or another process's for good) are cleared.
    fn undecided(&mut self, ep: c_int, ev: impl Iterator<Item = (usize, epoll_event)>) -> Vec<Undecided> {
        let mut out = Vec::new();
        let Some(set) = self.sets.get_mut(&ep) else { return out };
        if set.counts.undecided == 0 {
            return out;
        }
        let mut cleared = 0;
        for (index, e) in ev {
            let Some((fd, r)) = set.by_data(e.u64) else { continue };
            if !r.undecided {
                continue;
            }
            // (Writable only: not the peer's message.)
            let woke = e.events & (IN | (libc::EPOLLHUP | libc::EPOLLERR) as u32) != 0;
            let Some(stream) = r.stream.upgrade() else {
                // Gone: a decision (another thread's, since the kernel's
                // report) turned it into plain TCP and took it off the
                // table, and its last holder let it go. Answered as it
                // turned out, once, as one found decided below (its
                // message may be gone: the decision took it).
                r.undecided = false;
                cleared += 1;
                if woke {
                    out.push(Undecided { index, fd, stream: None, decided: true });
                }
                continue;
            };
            let elsewhere = stream.elsewhere();
            if elsewhere == Elsewhere::ForGood {
                // Another process (after a fork) took it: this one's calls
                // fail with EIO, and a decision here would too, at every
                // report. The kernel's report stands.
                r.undecided = false;
                cleared += 1;
            } else if elsewhere == Elsewhere::ForNow {
                // Taken by a process that may give it back (its adoption
                // failed): the kernel's report stands, this time only.
            } else if !stream.undecided() {
                // Decided since (by the program's call, or by another
                // thread's wait, which may have taken the message this
                // report was for off the socket): answered as it
                // turned out, once.
                r.undecided = false;
                cleared += 1;
                if woke {
                    out.push(Undecided { index, fd, stream: Some(stream), decided: true });
                }
            } else if woke {
                out.push(Undecided { index, fd, stream: Some(stream), decided: false });
            }
        }
        set.less(Counts::undecided(cleared), &mut self.counts);
        out
    }

    /// The registration of `fd` in `ep`, if still of `stream` (not a
    /// later connection given the same descriptor number), is not looked
    /// at for a decision any more: a report found nothing to decide on,
    /// and nothing can come ([`nothing_to_decide`]).
    fn decided(&mut self, ep: c_int, fd: c_int, stream: &Weak<Stream>) {
        let Some(set) = self.sets.get_mut(&ep) else { return };
        let Some(r) = set.regs.get_mut(&fd) else { return };
        if r.undecided && Weak::ptr_eq(&r.stream, stream) {
            r.undecided = false;
            set.less(Counts::undecided(1), &mut self.counts);
        }
    }

    fn recount(&self) -> Counts {
        let mut c = Counts::default();
        for set in self.sets.values() {
            c.add(set.recount());
        }
        c
    }

    /// Whether every count is its registrations' (each set's, and the
    /// total).
    fn counted(&self) -> bool {
        self.sets.values().all(|x| x.counts == x.recount()) && self.counts == self.recount()
    }

    /// Mirrors the counts for the calls that pass without the lock. Under
    /// the lock: the mirror is always a state the registrations were in.
    /// A mirror that says so already is left alone ([`mirror`]).
    fn publish(&self) {
        debug_assert!(self.counted(), "epoll registrations miscounted");
        mirror(&TRACKED, self.counts.tracked);
        mirror(&PENDING, self.counts.pending);
    }
}

/// Sets `a` to `v` unless it is `v` already (under the registrations'
/// lock, which every other change of it holds: a child's fork handler
/// aside, run while it is the child's only thread). A load leaves the
/// shared line in every core's cache; a store takes it from them, and
/// every wait of every thread stored both mirrors.
fn mirror(a: &AtomicUsize, v: usize) {
    if a.load(Ordering::Relaxed) != v {
        a.store(v, Ordering::Release);
        #[cfg(test)]
        tests::MIRROR_STORES.with(|c| c.set(c.get() + 1));
    }
}

/// A registration not decided yet that a report may be the peer's first
/// message for ([`Sets::undecided`]).
pub struct Undecided {
    /// The event's index in the report.
    pub index: usize,
    pub fd: c_int,
    /// `None`: gone, turned into plain TCP by another thread's decision
    /// (then `decided`).
    pub stream: Option<Arc<Stream>>,
    /// Decided since (by another thread): only answered as it turned out.
    pub decided: bool,
}

/// A process's registrations, never freed once published.
struct Slot {
    pid: u32,
    sets: Mutex<Sets>,
}

/// Registrations tracked (this process's): 0 lets calls pass without a
/// lock.
static TRACKED: AtomicUsize = AtomicUsize::new(0);

/// This process's registrations ([`sets`]).
static CURRENT: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());

/// This process's registrations. A child after fork gets new ones: its
/// parent's are of connections it does not carry, and their lock may have
/// been held by a thread of the parent at the fork (the parent's stay
/// leaked in the child).
fn sets() -> MutexGuard<'static, Sets> {
    let pid = crate::pid::get();
    loop {
        let p = CURRENT.load(Ordering::Acquire);
        // SAFETY: a published slot is leaked, never freed.
        if let Some(slot) = unsafe { p.as_ref() } {
            if slot.pid == pid {
                return slot.sets.lock().unwrap_or_else(|e| e.into_inner());
            }
        }
        let mine = Box::into_raw(Box::new(Slot { pid, sets: Mutex::new(Sets::new()) }));
        match CURRENT.compare_exchange(p, mine, Ordering::AcqRel, Ordering::Acquire) {
            // A child forked without the fork handlers ([`forked`]): the
            // mirrors still say the parent's. Set from the new sets under
            // their lock, as every change is: another thread of this
            // process that changed them meanwhile has its change counted.
            // SAFETY: `mine` is published now, and never freed.
            Ok(_) => unsafe { &*mine }.sets.lock().unwrap_or_else(|e| e.into_inner()).publish(),
            // SAFETY: `mine` came from Box::into_raw and was not published.
            Err(_) => drop(unsafe { Box::from_raw(mine) }),
        }
    }
}

/// In a child just forked (a `pthread_atfork` child handler, [`crate::pid`];
/// the only thread there is): its parent's registrations are not its own,
/// and the mirrored counts go with them, before any other thread of the
/// child can count its own. Only atomic stores (async-signal-safe).
pub(crate) fn forked() {
    CURRENT.store(std::ptr::null_mut(), Ordering::SeqCst);
    TRACKED.store(0, Ordering::SeqCst);
    PENDING.store(0, Ordering::SeqCst);
    INNER.store(false, Ordering::SeqCst);
}

/// After an epoll wait on `ep` reported the `n` events at `ev`: those of
/// connections not decided yet (registered before their first call) that
/// the peer's first message may have made ready (`EPOLLIN`, `EPOLLHUP`,
/// `EPOLLERR`), with their descriptor. That message is the library's (a
/// hello, a decline) or the end, not the program's bytes: the wait
/// decides them before it answers ([`crate::readiness`]), then calls
/// [`reported`]. With none, `Ok`: [`reported`] was done, under the same
/// lock (a wait with nothing to decide pays no second look), with the
/// events left.
///
/// A registration is looked at here until a report finds it decided (by
/// the wait, by another thread's, or by the program's own call; one
/// found decided is answered as it turned out, once: another thread's
/// wait may have taken the message that this report was for; one whose
/// stream is gone, turned plain TCP by another thread, too), taken by
/// another process for good (after a fork; [`Stream::elsewhere`]: one
/// that may give it back is only left as the kernel reported it, that
/// time), or left with nothing to decide on ([`nothing_to_decide`]).
///
/// # Safety
/// `ev` holds `n` events.
pub unsafe fn report_or_undecided(
    ep: c_int,
    ev: *mut epoll_event,
    n: c_int,
) -> Result<c_int, Vec<Undecided>> {
    let Some(_g) = Guard::enter() else { return Ok(n) };
    keep_errno(|| {
        let mut s = sets();
        let events = (0..n.max(0) as usize).map(|i| {
            // SAFETY: `i < n`; read by value (the struct may be packed).
            (i, unsafe { std::ptr::read(ev.add(i)) })
        });
        let before = s.counts;
        let out = s.undecided(ep, events);
        if s.counts != before {
            s.publish();
        }
        if !out.is_empty() {
            return Err(out);
        }
        // SAFETY: `ev` holds `n` events.
        Ok(unsafe { reported_in(&mut s, ep, ev, n) })
    })
}

/// The registrations of `fds` in `ep`, reported undecided with nothing on
/// their sockets while nobody decided them (the peer's end or an error
/// before the first call, which no hello can follow), are not looked at
/// again: a level-triggered report of the end would otherwise cost every
/// wait a look and a count of the bytes. Each is named with its stream:
/// a descriptor closed since and given to another connection registered
/// in its place keeps that one's registration looked at.
pub fn nothing_to_decide(ep: c_int, fds: &[(c_int, Weak<Stream>)]) {
    if fds.is_empty() {
        return;
    }
    let Some(_g) = Guard::enter() else { return };
    keep_errno(|| {
        let mut s = sets();
        for (fd, stream) in fds {
            s.decided(ep, *fd, stream);
        }
        s.publish();
    })
}

/// Registrations with [`Reg::pending`] set (this process's): 0 lets the
/// waits pass without a lock.
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Before an epoll wait on `ep`: an `EPOLLIN` event for each registration
/// whose link holds bytes that no wake byte announces (made while a lazy
/// read had left it unarmed), which the kernel cannot report. Level-
/// triggered, until the ring is read empty (a read then arms); edge-
/// triggered and one-shot registrations get one.
pub fn pending(ep: c_int) -> Vec<epoll_event> {
    if PENDING.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let Some(_g) = Guard::enter() else { return Vec::new() };
    keep_errno(|| {
        let mut s = sets();
        let before = s.counts;
        let out = s.take_pending(ep);
        if s.counts != before {
            s.publish();
        }
        out
    })
}

/// This process's stream on `fd`, if any.
fn stream_of(fd: c_int) -> Option<Arc<Stream>> {
    match table::get(fd)? {
        e @ Entry::Stream(_) if !e.ours() => None,
        Entry::Stream(s) => Some(s),
        _ => None,
    }
}

/// `epoll_ctl`: a connection this library may carry has its registration
/// kept (and `EPOLLOUT` left out of the kernel's while its ring is full);
/// everything else is the kernel's.
///
/// # Safety
/// As epoll_ctl(2): `ev` valid for `EPOLL_CTL_ADD`/`MOD`.
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int {
    let Some(_g) = Guard::enter() else {
        // SAFETY: libc's epoll_ctl with the caller's arguments.
        return unsafe { real::epoll_ctl(ep, op, fd, ev) };
    };
    let stream = keep_errno(|| stream_of(fd));
    if stream.is_none() && op == libc::EPOLL_CTL_ADD && crate::link::lazy_epoll() {
        // Perhaps an epoll set: its connections must then arm at once.
        let mut s = sets();
        s.inner.insert(fd);
        INNER.store(true, Ordering::Release);
        s.nest(fd);
        s.publish();
    }
    if stream.is_none() && TRACKED.load(Ordering::Acquire) == 0 {
        // SAFETY: as above.
        return unsafe { real::epoll_ctl(ep, op, fd, ev) };
    }
    let mut s = sets();
    let add = op == libc::EPOLL_CTL_ADD || op == libc::EPOLL_CTL_MOD;
    match stream {
        Some(stream) if add && !ev.is_null() => {
            // SAFETY: the caller's event (epoll_ctl's contract); read by
            // value, as the struct may be packed.
            let want = unsafe { std::ptr::read(ev) };
            let mut r = Reg {
                events: want.events,
                data: want.u64,
                stream: Arc::downgrade(&stream),
                link: Weak::new(),
                fired: false,
                stripped: false,
                pending: false,
                undecided: want.events & IN != 0 && stream.undecided(),
            };
            // Its reads arm at once from now on; an arming a lazy read
            // left undone is made now, and bytes that wait without a
            // wake byte are reported by the waits.
            stream.watch();
            let nested = s.inner.contains(&ep) || s.sets.get(&ep).is_some_and(|x| x.nested);
            // (A registration for writing only says nothing of how its
            // reads are waited for.)
            if r.events & IN != 0 {
                let lt = r.events & (ET | ONESHOT | EXCLUSIVE) == 0;
                stream.lazy(crate::link::lazy_epoll() && !nested && lt);
            }
            if let Some(l) = keep_errno(|| r.link()) {
                if r.events & IN != 0 && stream.lazy_ok() && !crate::readiness::sleeping() {
                    // Armed (if need be) by the next wait on the set,
                    // after it watched the ring: a program that registers
                    // for reading after each write (redis-benchmark's
                    // event loop) then pays no arming per message.
                    l.mark_unarmed();
                } else if r.events & IN != 0 && keep_errno(|| l.arm_for_readiness()) {
                    r.pending = true;
                }
            }
            let strip = r.events & OUT != 0
                && r.events & EXCLUSIVE == 0
                && keep_errno(|| r.link()).is_some_and(|l| l.write_blocked());
            let mut k = epoll_event { events: if strip { r.events & !OUT } else { r.events }, u64: r.data };
            // SAFETY: libc's epoll_ctl with a valid event.
            let res = unsafe { real::epoll_ctl(ep, op, fd, &mut k) };
            if res == 0 {
                r.stripped = strip;
                s.add(ep, fd, r, nested);
                s.publish();
            }
            res
        }
        _ => {
            // SAFETY: libc's epoll_ctl with the caller's arguments.
            let res = unsafe { real::epoll_ctl(ep, op, fd, ev) };
            if res == 0 {
                s.remove(ep, fd);
                s.publish();
            }
            res
        }
    }
}

/// `fd` is closed (or replaced): its registrations go with it, and, if it
/// is an epoll set, the set's.
/// Whether [`forget`] may have a descriptor to forget (no lock, no
/// system call).
pub fn may_know() -> bool {
    TRACKED.load(Ordering::Acquire) != 0 || INNER.load(Ordering::Acquire)
}

pub fn forget(fd: c_int) {
    if TRACKED.load(Ordering::Acquire) == 0 && !INNER.load(Ordering::Acquire) {
        return;
    }
    let mut s = sets();
    s.forget(fd);
    s.publish();
}

/// Some descriptor was added to an epoll set without being a connection
/// ([`Sets::inner`]): `forget` must look.
static INNER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `ep`, if it is a set holding connections, is inside another set or
/// polled: its connections arm at once from now on, and those a
/// non-blocking read left unarmed are armed now.
fn nest(s: &mut Sets, ep: c_int) {
    s.nest(ep);
    s.publish();
}

/// For `poll` and `select`: those of `fds` that are epoll sets holding
/// connections are nested ([`nest`]).
pub fn polled(fds: impl Iterator<Item = c_int>) {
    if TRACKED.load(Ordering::Acquire) == 0 || !crate::link::lazy_epoll() {
        return;
    }
    let mut s = sets();
    for fd in fds {
        nest(&mut s, fd);
    }
}

/// For an epoll wait on `ep`: an `EPOLLIN` event for each registration
/// whose connection a non-blocking read left unarmed and whose ring holds
/// bytes (or ended); with `arm` (the wait is about to sleep), those left
/// empty are armed ([`Link::lazy_look`]). Also whether the set holds such
/// connections at all (a wait may watch their rings a moment before it
/// sleeps), and whether a read of the program held one of them (the wait
/// must look again soon).
pub fn lazy_scan(ep: c_int, arm: bool) -> (Vec<epoll_event>, bool, bool) {
    let mut out = Vec::new();
    if TRACKED.load(Ordering::Acquire) == 0 || !crate::link::lazy_epoll() {
        return (out, false, false);
    }
    let Some(_g) = Guard::enter() else { return (out, false, false) };
    keep_errno(|| {
        let mut s = sets();
        let (mut any, mut busy) = (false, false);
        if let Some(set) = s.sets.get_mut(&ep) {
            for r in set.regs.values_mut() {
                if r.fired || r.events & IN == 0 {
                    continue;
                }
                let Some(l) = r.link() else { continue };
                if !l.is_unarmed() {
                    continue;
                }
                any = true;
                match l.lazy_look(arm) {
                    Look::Bytes => out.push(epoll_event { events: IN, u64: r.data }),
                    Look::Busy => busy = true,
                    Look::Quiet => {}
                }
            }
        }
        (out, any, busy)
    })
}

/// `link`'s ring is full: its registrations lose `EPOLLOUT`.
pub fn write_blocked(link: &Link) {
    each_of(link, |ep, fd, r| {
        if !r.stripped && !r.fired && r.events & OUT != 0 && r.events & EXCLUSIVE == 0 {
            r.apply(ep, fd, true);
        }
    });
}

/// `link` is writable again: its registrations get `EPOLLOUT` back, which
/// the kernel reports (the socket is writable), also edge-triggered.
pub fn writable_again(link: &Link) {
    each_of(link, |ep, fd, r| {
        if r.stripped && (r.fired || !r.apply(ep, fd, false)) {
            // Disabled (one-shot, reported): the program's next
            // modification arms it whole.
            r.stripped = false;
        }
    });
}

fn each_of(link: &Link, mut f: impl FnMut(c_int, c_int, &mut Reg)) {
    if TRACKED.load(Ordering::Acquire) == 0 {
        return;
    }
    // Its calls are libc's own (`real`), whether or not this thread is
    // inside the library already (the progress thread always is).
    let _g = Guard::enter();
    keep_errno(|| {
        let mut s = sets();
        for (&ep, set) in s.sets.iter_mut() {
            for (&fd, r) in set.regs.iter_mut() {
                if r.is(link) {
                    f(ep, fd, r);
                }
            }
        }
    })
}

/// Whether `ep` holds registrations kept here.
pub fn tracks(ep: c_int) -> bool {
    TRACKED.load(Ordering::Acquire) != 0 && sets().sets.get(&ep).is_some_and(|s| !s.regs.is_empty())
}

/// After `epoll_wait` on `ep` reported the `n` events at `ev`: one-shot
/// registrations are marked disabled, and a carried socket's `EPOLLIN`
/// that is only stale wake bytes is taken back (the bytes taken off; an
/// event left empty is dropped, and a one-shot registration it disabled
/// is armed again). Returns the events left, moved to the front.
///
/// # Safety
/// `ev` holds `n` events.
pub unsafe fn reported(ep: c_int, ev: *mut epoll_event, n: c_int) -> c_int {
    let Some(_g) = Guard::enter() else { return n };
    // SAFETY: `ev` holds `n` events.
    keep_errno(|| unsafe { reported_in(&mut sets(), ep, ev, n) })
}

/// [`reported`], under the lock.
///
/// # Safety
/// `ev` holds `n` events.
unsafe fn reported_in(s: &mut Sets, ep: c_int, ev: *mut epoll_event, n: c_int) -> c_int {
    let Some(set) = s.sets.get_mut(&ep) else { return n };
    let mut out = 0usize;
    for i in 0..n.max(0) as usize {
        // SAFETY: `i < n`; read by value (the struct may be packed).
        let mut e = unsafe { std::ptr::read(ev.add(i)) };
        if let Some((fd, r)) = set.by_data(e.u64) {
            if r.events & ONESHOT != 0 {
                r.fired = true;
            }
            if e.events & IN != 0 {
                if let Some(l) = r.link() {
                    // Left unarmed by a non-blocking read: every wake
                    // byte is stale (taken off, not armed: an arming
                    // here would cost the writer a wake byte again).
                    let unarmed = if l.is_unarmed() { l.unarmed_is_stale() } else { None };
                    if unarmed.unwrap_or_else(|| l.readable_is_stale()) {
                        e.events &= !(IN | libc::EPOLLRDNORM as u32);
                    }
                }
            }
            if e.events == 0 {
                if r.fired {
                    let strip = r.link().is_some_and(|l| l.write_blocked());
                    if r.apply(ep, fd, strip) {
                        r.fired = false;
                    }
                }
                continue;
            }
        }
        // SAFETY: `out <= i < n`.
        unsafe { std::ptr::write(ev.add(out), e) };
        out += 1;
    }
    out as c_int
}

#[cfg(test)]
mod tests;
